"""Times the sampler's top-p on one GPU: the sort (the path before the cut-off search) against the sort-free cut-off,
at batch 1, 32 and 256 x the Qwen3 vocabulary (151,936, bf16 logits), with CUDA events around the whole call.

    python tests/gpu/sampling_timing.py OUT.json     # on a CUDA host, from the project root

Also: the draw at several programs per SM, top-k through the search, each cut-off launch's time at each batch
(per_launch_ms) and a profiler table of one top-p call at batch 256.

Not a test (no timing asserts); docs/performance.md records its figures with the command, machine, date and commit.
"""

from __future__ import annotations

import json
import sys

import torch

from shardserve.kernels import sampling, sampling_filter
from shardserve.kernels.sampling import gumbel_sample, split_keys
from shardserve.proto.plan import SamplingSpec
from shardserve.worker import gpu_draw
from shardserve.worker.logit_filter import filter_logits
from shardserve.worker.sampler import sample_tokens
from shardserve.worker.sampling_row import SamplingRow
from shardserve.worker.sampling_keys import row_key

VOCAB = 151936


def _ms(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def _sort_top_p(logits, rows):
    """The sampler's CUDA path before the cut-off search: scaled float copy, the sort-based filter, the draw."""
    inv_t = torch.tensor([1.0 / r.spec.temperature for r in rows], device="cuda")
    keys = torch.tensor(split_keys([row_key(r.spec.seed, r.output_index) for r in rows]), dtype=torch.int64,
                        device="cuda").view(-1, 2)
    return gumbel_sample(filter_logits(logits * inv_t.unsqueeze(1), rows), keys, torch.ones_like(inv_t))


class _TimedKernel:
    """A Triton kernel whose launches record CUDA events around them (per-launch times of one call)."""

    def __init__(self, kernel, log: list) -> None:
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            compiled = self.kernel[grid](*args, **kwargs)
            end.record()
            regs = (getattr(compiled, "n_regs", None), getattr(compiled, "n_spills", None))
            self.log.append((self.kernel.fn.__name__, start, end, regs))
        return launch


def _logged_launches(*args, **kwargs) -> list:
    """One filter_thresholds call with each launch logged: [(kernel, start event, end event, (registers, spills))]
    (each launch waited for: no overlap of launches)."""
    log: list = []
    stats, passes = sampling_filter._stats_kernel, sampling_filter._pass_kernel
    sampling_filter._stats_kernel, sampling_filter._pass_kernel = _TimedKernel(stats, log), _TimedKernel(passes, log)
    try:
        sampling_filter.filter_thresholds(*args, **kwargs)
        torch.cuda.synchronize()
    finally:
        sampling_filter._stats_kernel, sampling_filter._pass_kernel = stats, passes
    return log


def _per_launch_ms(*args, **kwargs) -> list:
    """filter_thresholds' launches one by one: [(kernel, ms)]."""
    return [(name, round(start.elapsed_time(end), 4)) for name, start, end, _ in _logged_launches(*args, **kwargs)]


def _registers(*args, **kwargs) -> dict:
    """Registers and spills per thread of each kernel of filter_thresholds, as compiled."""
    return {name: regs for name, _, _, regs in _logged_launches(*args, **kwargs)}


SWEEP = [  # (pivot step, warps per pass program, compaction step, stats step, stats warps); the first: the default
    (128, 4, 512, 2048, 4), (128, 4, 128, 2048, 4), (128, 4, 1024, 2048, 4), (128, 4, 2048, 2048, 4),
    (128, 2, 1024, 2048, 4), (256, 8, 1024, 2048, 4), (128, 4, 1024, 4096, 8), (128, 4, 1024, 1024, 4),
]


def sweep(logits, inv_t, zeros, p, rows) -> list:
    """The cut-off search's launch settings at one batch: its time, each launch's, registers and spills."""
    knobs = ("_BLOCK", "_PASS_WARPS", "_COPY_BLOCK", "_STATS_BLOCK", "_STATS_WARPS")
    default = tuple(getattr(sampling_filter, k) for k in knobs)
    want = sampling_filter.filter_thresholds(logits, inv_t, zeros, p, zeros, count_search=False)
    results = []
    for setting in SWEEP:
        for k, v in zip(knobs, setting):
            setattr(sampling_filter, k, v)
        try:
            got = sampling_filter.filter_thresholds(logits, inv_t, zeros, p, zeros, count_search=False)
            results.append({
                "block": setting[0], "warps": setting[1], "copy_block": setting[2], "stats_block": setting[3],
                "stats_warps": setting[4],
                "ms": round(_ms(lambda: sampling_filter.filter_thresholds(logits, inv_t, zeros, p, zeros,
                                                                          count_search=False)), 4),
                "sampler_top_p_ms": round(_ms(lambda: sample_tokens(logits, rows)), 4),
                "rows_differing_from_default": int((got != want).sum()),
                "per_launch_ms": _per_launch_ms(logits, inv_t, zeros, p, zeros, count_search=False),
                "regs_spills": _registers(logits, inv_t, zeros, p, zeros, count_search=False)})
        except Exception as e:  # a setting that does not compile or run: recorded, the sweep goes on
            results.append({"setting": list(setting), "error": repr(e)[:300]})
        print("sweep", results[-1], flush=True)
    for k, v in zip(knobs, default):
        setattr(sampling_filter, k, v)
    return results


def main(path: str) -> None:
    out = {"device": torch.cuda.get_device_name(), "vocab": VOCAB, "dtype": "bfloat16", "ms": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch in (1, 32, 256):
        logits = (torch.randn(batch, VOCAB, device="cuda", generator=gen) * 2).to(torch.bfloat16)
        spec = lambda **kw: [SamplingRow(SamplingSpec(temperature=0.7, seed=i, **kw), [1], 1)  # noqa: E731
                             for i in range(batch)]
        nucleus = spec(top_p=0.9)
        logits_f32 = logits.float()
        inv_t = torch.full((batch,), 1 / 0.7, device="cuda")
        zeros, p = torch.zeros(batch, device="cuda"), torch.full((batch,), 0.9, device="cuda")
        sample_tokens(logits, spec())  # the first call of a batch size (compiles, clocks up)
        k50, ones = torch.full((batch,), 50.0, device="cuda"), torch.ones(batch, device="cuda")
        row = {
            "temperature_only": _ms(lambda: sample_tokens(logits, spec())),
            "top_p_sort": _ms(lambda: _sort_top_p(logits, nucleus), repeats=10),
            "top_p": _ms(lambda: sample_tokens(logits, nucleus)),
            "top_p_cut_off_kernel": _ms(lambda: sampling_filter.filter_thresholds(logits, inv_t, zeros, p, zeros)),
            "top_k_50": _ms(lambda: sample_tokens(logits, spec(top_k=50))),
            "top_k_50_top_p": _ms(lambda: sample_tokens(logits, spec(top_k=50, top_p=0.9))),
            "min_p_0.05": _ms(lambda: sample_tokens(logits, spec(min_p=0.05))),
            "top_p_float32_logits": _ms(lambda: sample_tokens(logits_f32, nucleus)),
            "top_p_temperature_2": _ms(lambda: sample_tokens(logits, [SamplingRow(SamplingSpec(
                temperature=2.0, top_p=0.9, seed=i), [1], 1) for i in range(batch)])),
            "top_k_50_cut_off_kernel": _ms(lambda: sampling_filter.filter_thresholds(logits, inv_t, k50, ones, zeros)),
        }
        gpu_draw.SEARCH_TOP_K = True
        row["top_k_50_through_the_search"] = _ms(lambda: sample_tokens(logits, spec(top_k=50)))
        gpu_draw.SEARCH_TOP_K = False
        per_sm = sampling._PROGRAMS_PER_SM
        for programs in (1, 2, 4, 16):  # the draw's programs per SM (the default: 8)
            sampling._PROGRAMS_PER_SM = programs
            row[f"temperature_only_{programs}_programs_per_sm"] = _ms(lambda: sample_tokens(logits, spec()))
        sampling._PROGRAMS_PER_SM = per_sm
        exact = sampling_filter.filter_thresholds(logits, inv_t, zeros, p, zeros, count_search=False)
        default_passes = sampling_filter._PASSES
        for passes in (3, 4, 5, 6):  # pass launches per search: time, and rows whose cut-off moves
            sampling_filter._PASSES = passes
            row[f"rows_moved_at_{passes}_passes"] = int(
                (sampling_filter.filter_thresholds(logits, inv_t, zeros, p, zeros, count_search=False) != exact).sum())
            row[f"top_p_cut_off_kernel_{passes}_passes"] = _ms(
                lambda: sampling_filter.filter_thresholds(logits, inv_t, zeros, p, zeros, count_search=False))
        sampling_filter._PASSES = default_passes
        row["top_p_cut_off_kernel_no_count_search"] = _ms(
            lambda: sampling_filter.filter_thresholds(logits, inv_t, zeros, p, zeros, count_search=False))
        out["ms"][str(batch)] = {k: round(v, 4) for k, v in row.items()}
        print(batch, out["ms"][str(batch)], flush=True)
        out.setdefault("per_launch_ms", {})[str(batch)] = {
            "top_p": _per_launch_ms(logits, inv_t, zeros, p, zeros, count_search=False),
            "top_p_float32": _per_launch_ms(logits_f32, inv_t, zeros, p, zeros, count_search=False),
            "top_k_50": _per_launch_ms(logits, inv_t, k50, ones, zeros),
            "top_k_50_top_p": _per_launch_ms(logits, inv_t, k50, p, zeros)}
        print(batch, out["per_launch_ms"][str(batch)], flush=True)
        if batch == 256:
            out.setdefault("sweep", {})[str(batch)] = sweep(logits, inv_t, zeros, p, nucleus)
        if batch == 256:  # where the time of one top-p call goes, per kernel
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    sample_tokens(logits, nucleus)
                torch.cuda.synchronize()
            out["profile_top_p_256"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
            print(out["profile_top_p_256"], flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
