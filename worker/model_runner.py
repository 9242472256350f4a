"""ModelRunner: one rank's model and KV cache, and the step, top to bottom:

    launch_step(plan): InputBatch.prepare(plan)   per-request state updated, the step's flat batch built
                       -> _forward                 a captured decode graph's replay, or the eager forward
                       -> LM head -> sampler       on the rows that sample
                       -> StepInFlight             owns the sampled ids (still on the device)
    finish_step(step): waits for that step's ids only, writes them over their placeholders, returns its result

Every rank runs the same steps on the same state and samples the same token (the sampler is deterministic given
the seed), so rank 0's result speaks for all.
"""

from __future__ import annotations

import time

import torch

from shardserve.kernels.backend_choice import get_backend
from shardserve.kernels.kv_fp8 import FP8_DTYPE
from shardserve.proto.config import EngineConfig
from shardserve.proto.plan import NewRequest, SamplingSpec, StepPlan, StepResult, cdiv
from shardserve.proto.stages import result_rank, stage_of
from shardserve.worker import cuda_graphs, graph_memory, kv_cache, kv_scales
from shardserve.worker.device_copy import device_tensor
from shardserve.worker.grammar_matchers import GrammarMatchers
from shardserve.worker.layers import cpu_packed
from shardserve.worker.input_batch import InputBatch
from shardserve.worker.step_inputs import RequestState, StepInputs
from shardserve.worker.sampler import sample, sample_tokens
from shardserve.worker.sampler_warm_up import warm_up as sampler_warm_up
from shardserve.worker.sampling_row import SamplingRow
from shardserve.worker.spec_verify import launch_verify_step
from shardserve.worker.stage_link import StageLink, stage_forward
from shardserve.worker.step_in_flight import StepInFlight

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a resolved EngineConfig.dtype (shardserve/settings/resolve.py resolves "auto" and aliases)."""
    return _DTYPES[name]


def kv_cache_torch_dtype(config: EngineConfig) -> torch.dtype:
    """The KV cache's element type: float8 e4m3 for "fp8", else the model's ("auto" or a dtype name)."""
    if config.kv_cache_dtype == "fp8":
        return FP8_DTYPE
    return torch_dtype(config.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype)


def torch_device(name: str, rank: int) -> torch.device:
    """This rank's device for a resolved EngineConfig.device ("cpu" or "cuda")."""
    if name == "cuda":
        # Local processes see every GPU (rank i takes GPU i); a Ray actor sees only its own (index 0).
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device(name)


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        from shardserve.worker.loader import init_dummy_weights, load_weights
        from shardserve.worker.models.hf_config import read_hf_config
        from shardserve.worker.models.registry import build_model

        self.config = config
        self.rank = rank
        self.reports = rank == result_rank(config)  # whose StepResult carries the tokens (the step loop asks)
        self.device = torch_device(config.device, rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = torch_dtype(config.dtype)
        self.kv_dtype = kv_cache_torch_dtype(config)
        self.block_size = config.block_size
        self.hf_config = read_hf_config(config.model)  # not transformers' AutoConfig: see hf_config.py
        # this rank's pipeline stage (all of the model at pipeline_parallel_size 1) and its link to its neighbours
        self.stage = stage_of(config, rank, self.hf_config.num_hidden_layers)
        self.link = StageLink(self.stage, rank, config.tensor_parallel_size, self.hf_config.hidden_size, self.dtype,
                              self.device) if self.stage.count > 1 else None
        self.attn_backend = get_backend(config.attention_backend, self.device.type, config.split_mixed_decodes)
        if self.kv_dtype == FP8_DTYPE and self.attn_backend.name == "flash-attn":  # it has no FP8 cache here
            if config.attention_backend != "auto":
                raise ValueError("kv_cache_dtype fp8 needs the triton or torch attention backend, not flash-attn")
            self.attn_backend = get_backend("triton", self.device.type, config.split_mixed_decodes)
        self.model = build_model(self.hf_config, self.dtype, self.device, self.attn_backend, self.stage)
        with torch.inference_mode():
            if config.load_format == "dummy":
                init_dummy_weights(self.model, config.seed)
            else:
                load_weights(self.model, config.model)
        if config.quantization == "fp8":  # before the KV scales' calibration, which runs the model as it will run
            self.model.quantize_weights_fp8()
        if self.kv_dtype == FP8_DTYPE:  # the scales, before any graph captures where they live
            if config.load_format != "dummy":
                kv_scales.load_checkpoint_scales(self.model, config.model)
            kv_scales.calibrate_scales(self.model, self.block_size, self.dtype, self.device)
        if self.device.type == "cpu":  # the matmuls' weights blocked once for oneDNN (worker/layers/cpu_packed.py)
            cpu_packed.pack_model(self.model)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        # every request's state on this rank, and each step's batch; its device block table sized for the limits
        self.input_batch = InputBatch(self.block_size, config.max_num_seqs, cdiv(config.max_model_len, self.block_size),
                                      samples=self.stage.is_last)
        self.decode_graphs: cuda_graphs.DecodeGraphRunner | None = None  # captured by allocate_kv_cache on CUDA
        self.grammars = GrammarMatchers(config.tokenizer, self.model.vocab_size)  # structured outputs' matchers
        self._graph_reserve: int | None = None  # bytes the KV sizing left for the graphs (measured)

    @property
    def requests(self) -> dict[str, RequestState]:
        return self.input_batch.requests

    @property
    def last_step_id(self) -> int:
        return self.input_batch.last_step_id

    # ------------------------------------------------------------------------------------------ cache

    def profile_num_blocks(self) -> int:
        blocks = kv_cache.profile_num_blocks(self.config, self.model, self.kv_dtype, self.device, self._profile_forward)
        blocks, self._graph_reserve = graph_memory.leave_room_for_graphs(
            blocks, self.model, self.attn_backend, self.config, self.device, self.kv_dtype
        )
        return blocks

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.decode_graphs = None  # graphs over an earlier cache go first
        self.kv_caches = []  # drop an earlier cache before allocating the new one
        self.kv_caches = kv_cache.allocate_kv_cache(
            self.model, num_blocks, self.block_size, self.kv_dtype, self.device, self.attn_backend)
        self.num_blocks = num_blocks
        if self.link is None and cuda_graphs.graphs_unsupported_reason(self.config, self.device, self.attn_backend) is None:
            self.decode_graphs = cuda_graphs.capture_decode_graphs(
                self.model, self.kv_caches, self.attn_backend, self.config, self.device, self._graph_reserve
            )
        if self.stage.is_last:
            sampler_warm_up(self.model.vocab_size, self.dtype, self.device)
        if self.device.type == "cuda" and num_blocks >= self._profile_blocks():
            # The KV sizing emptied torch's cache after measuring the largest step; without this its activations
            # are allocated from the device again inside the first large prefill steps served, which made a first
            # run's prefill steps slower than later ones'. The cache is new: no request owns its blocks yet.
            self._profile_forward(self.kv_caches)

    def _profile_seq_len(self) -> int:
        """The longest sequence of the largest step (_profile_forward)."""
        return min(self.config.max_num_batched_tokens, self.config.max_model_len)

    def _profile_blocks(self) -> int:
        return cdiv(self._profile_seq_len(), self.block_size)

    @torch.inference_mode()
    def _profile_forward(self, cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """The largest step the scheduler may plan: max_num_batched_tokens of prefill, then logits and sampling
        for up to max_num_seqs rows, on a throwaway cache just big enough for one sequence (or on the first blocks
        of the given cache, which it writes over)."""
        total = self.config.max_num_batched_tokens
        seq_len = self._profile_seq_len()
        blocks = list(range(self._profile_blocks()))
        scratch = cache if cache is not None else kv_cache.allocate_kv_cache(
            self.model, len(blocks), self.block_size, self.kv_dtype, self.device, self.attn_backend)
        spec = SamplingSpec(temperature=1.0, top_p=0.9)
        lens = [min(seq_len, total - start) for start in range(0, total, seq_len)]
        new = [NewRequest(str(i), [0] * n, n, 0, blocks, spec) for i, n in enumerate(lens)]
        plan = StepPlan(1, new_requests=new, req_ids=[r.req_id for r in new], num_tokens=lens)
        batch = InputBatch(self.block_size).prepare(plan)
        input_ids, positions, meta = batch.to_device(self.device)
        carried = None if self.stage.is_first else (torch.zeros(total, self.hf_config.hidden_size, dtype=self.dtype,
                                                                device=self.device),) * 2
        hidden = self.model(input_ids, positions, scratch, meta, carried)
        if not self.stage.is_last:  # (a pipeline stage's own layers only: nothing is sent while profiling)
            return
        rows = min(self.config.max_num_seqs, total)
        logits = self.model.compute_logits(hidden[-rows:])
        state = batch.states[0]
        sample(logits, [SamplingRow(state.sampling, state.token_ids, 0)] * rows)
        del scratch, hidden, logits

    # ------------------------------------------------------------------------------------------ step

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        return self.finish_step(self.launch_step(plan))

    @torch.inference_mode()
    def launch_step(self, plan: StepPlan) -> StepInFlight:
        """Queues the step's device work (inputs, forward, sampling) without waiting for it. The sampled ids stay
        on the device as placeholders the next step reads there (worker/input_batch.py); finish_step reads them."""
        started = time.perf_counter()
        batch = self.input_batch.prepare(plan, self.decode_graphs)
        self.grammars.drop(plan)
        if plan.draft_token_ids:  # speculative decoding: drafts verified in this step (worker/spec_verify.py)
            return launch_verify_step(self, plan, batch)
        step = StepInFlight(StepResult(step_id=plan.step_id))
        if batch.states:
            step.start_device_timer(self.device)
            hidden, last_rows = self._forward(batch, plan.step_id)
            if hidden is None:  # a pipeline stage before the last: its output went on to the next stage
                step.host_s = self._busy_s(started)
                return step
            if batch.sample_rows:
                rows = self.input_batch.sampling_rows(batch)  # (after the forward is queued: may read tokens back)
                index = last_rows
                if len(batch.sample_rows) < batch.num_seqs:
                    index = last_rows[device_tensor(batch.sample_rows, torch.int64, self.device)]
                logits = self.model.compute_logits(hidden[index])
                if any(r.spec.grammar_kind for r in rows):
                    self.grammars.mask(logits, [plan.req_ids[i] for i in batch.sample_rows], rows)
                    step.result.grammar_mask_ms = self.grammars.last_mask_s * 1e3
                tokens = sample_tokens(logits, rows)
                # Timed steps are the ones that sample: finish_step waits for those anyway (their tokens), while a
                # prefill-chunk step's finish must not wait for the device.
                step.stop_device_timer()
                step.hold(tokens, logits, rows)
                self.input_batch.add_placeholders(step, batch)
                step.result.req_ids = [plan.req_ids[i] for i in batch.sample_rows]
            self._launch_prompt_logprobs(plan, batch, hidden, step)
        step.host_s = self._busy_s(started)
        return step

    def _busy_s(self, started: float) -> float:
        """Host time since started, less what a pipeline stage spent waiting for the stage before it."""
        return time.perf_counter() - started - (self.link.take_wait_s() if self.link is not None else 0.0)

    def _launch_prompt_logprobs(self, plan: StepPlan, batch: StepInputs, hidden: torch.Tensor,
                                step: StepInFlight) -> None:
        """Requests that asked for prompt logprobs: the logits of the prompt positions this step computed (position p
        scores prompt token p + 1), handed to the step, which turns them into logprobs when it finishes."""
        spans, rows, targets, top_n = prompt_logprob_rows(plan.req_ids, batch)
        if spans:
            logits = self.model.compute_logits(hidden[device_tensor(rows, torch.int64, self.device)])
            step.hold_prompt_logits(spans, logits, device_tensor(targets, torch.int64, self.device), top_n)

    @torch.inference_mode()
    def finish_step(self, step: StepInFlight) -> StepResult:
        """Waits for a launched step's tokens (only its own), writes them over their placeholders and returns the
        step's result. Finish steps in launch order."""
        self.input_batch.resolve_placeholders(step)
        return step.finish()

    def _forward(self, batch: StepInputs, step_id: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The step's hidden states and the row of each sequence's last token in them: a decode batch that
        prepare() padded for a captured CUDA graph replays it (worker/cuda_graphs.py); anything else runs eagerly.
        A pipeline stage runs its layers between its neighbours (worker/stage_link.py): None before the last."""
        if batch.padded is not None:
            return self.decode_graphs.run(batch), self.decode_graphs.rows(batch.num_seqs)
        input_ids, positions, meta = batch.to_device(self.device)
        hidden = stage_forward(self.model, self.link, step_id, input_ids, positions, self.kv_caches, meta)
        return hidden, meta.query_start_loc[1:].long() - 1


def prompt_logprob_rows(
    req_ids: list[str], batch: StepInputs
) -> tuple[list[tuple[str, int, int]], list[int], list[int], list[int]]:
    """For the scheduled requests whose spec asks for prompt logprobs: (req_id, first prompt token scored, count)
    per request, and per scored token the row of the hidden states before it, the token, and the top N asked."""
    spans, rows, targets, top_n = [], [], [], []
    offset = 0
    for req_id, state, q, end in zip(req_ids, batch.states, batch.query_lens, batch.seq_lens):
        n = state.sampling.prompt_logprobs
        if n >= 0:
            start, last = end - q, min(end, state.num_prompt_tokens - 1)  # positions [start, last) score a token
            if start < last:
                spans.append((req_id, start + 1, last - start))
                rows += range(offset, offset + last - start)
                targets += state.token_ids[start + 1 : last + 1]
                top_n += [n] * (last - start)
        offset += q
    return spans, rows, targets, top_n
