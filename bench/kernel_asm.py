"""What the decode kernel compiles to on a GPU, on any machine: Triton compiles it for a given target (sm_90 by
default) without a device, and this counts the PTX memory, conversion and tensor-core instructions per thread,
the SASS instruction mix (nvdisasm, shipped with Triton) and the registers. This is how the FP8 decode kernel was
found reading its e4m3 K tile back from shared memory a byte at a time (docs/performance-history.md), without device time.

    python -m shardserve.bench.kernel_asm --cache fp8 --variant pairs [--block-n 128 --warps 4 --stages 2]
    python -m shardserve.bench.kernel_asm --one-row     # the one-row layer's kernels (gemv.py, rope.py)

The counts are static (a loop body counts once per copy the pipeliner made of it). The GPU hosts run Triton 3.6:
compile with the same version for figures that hold there.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile

_POINTERS = ("q_ptr", "k_cache_ptr", "v_cache_ptr", "block_tables_ptr", "seq_lens_ptr", "order_ptr", "out_ptr",
             "part_out_ptr", "part_lse_ptr", "k_scale_ptr", "v_scale_ptr")
_PTX_KINDS = ("ld.global", "ld.shared", "st.shared", "cp.async.c", "ldmatrix", "mma", "wgmma.mma_async", "cvt.rn")


def compile_kernel(fn, types: dict[str, str], constants: dict, aligned: set[str], arch: int = 90, **options):
    """A @triton.jit kernel compiled for sm_<arch>: types names each non-constexpr argument's type (default i32);
    the arguments in `aligned` are taken as 16-byte aligned pointers or multiples of 16, as Triton specializes
    them at a launch with such values."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        signature[name] = "constexpr" if name in constants else types.get(name, "i32")
        if name in aligned and name not in constants:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", arch, 32),
                          options=options)


def compile_decode(cache: str, variant: str, block_n: int, warps: int, stages: int, group: int = 2,
                   head_dim: int = 128, rows: int = 16, arch: int = 90, pdl: bool = False):
    """The paged decode kernel compiled for sm_<arch> (pointers and strides 16-byte aligned, as the cache's are);
    pdl: launched as a programmatic dependent (kernels/pdl.py)."""
    import triton

    from shardserve.kernels.kv_fp8 import FP8_DECODE_VARIANTS
    from shardserve.kernels.paged_decode import DECODE_KERNEL

    fp8 = cache == "fp8"
    if fp8 and variant not in FP8_DECODE_VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(FP8_DECODE_VARIANTS)}; got {variant!r}")
    kv = ("*i16" if variant == "pairs" else "*fp8e4nv") if fp8 else "*bf16"
    types = dict.fromkeys(_POINTERS, "*bf16") | {"k_cache_ptr": kv, "v_cache_ptr": kv, "block_tables_ptr": "*i32",
                                                 "seq_lens_ptr": "*i32", "order_ptr": "*i32", "part_out_ptr": "*fp32",
                                                 "part_lse_ptr": "*fp32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
                                                 "scale_log2e": "fp32"}
    constants = dict(GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=1, BLOCK_G=rows,
                     BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=block_n, DOT_PRECISION="tf32", NUM_KV_HEADS=8,
                     FP8=fp8, PAIRS=fp8 and variant == "pairs", DOT_FP16=fp8, ASM=True,
                     block_size=16, PDL=pdl, ORDERED=False)
    aligned = set(_POINTERS) | {n for n in DECODE_KERNEL.arg_names if n.startswith("stride") and n != "stride_bt"}
    return compile_kernel(DECODE_KERNEL, types, constants, aligned, arch, num_warps=warps, num_stages=stages,
                          launch_pdl=pdl)


def compile_one_row(arch: int = 90) -> dict[str, object]:
    """The one-row layer's kernels at Llama-3-8B's shapes, compiled for sm_<arch> as they launch on an H200: the
    fused GEMVs (with programmatic dependent launch), RoPE writing a bf16 and an FP8 cache, and RoPE and the decode
    kernel as the PDL chain (kernels/pdl.py) launches them."""
    from shardserve.kernels.gemv import GEMV_KERNEL
    from shardserve.kernels.rope import ROPE_KERNEL

    gemv_types = dict.fromkeys(("x_ptr", "w_ptr", "out_ptr", "norm_ptr", "res_ptr"), "*bf16") | {
        "w_scale_ptr": "*fp32", "x_scale_ptr": "*fp32", "eps": "fp32"}
    gemv_aligned = set(gemv_types) - {"eps"} | {"N", "K", "stride_xm", "stride_wn", "stride_om", "stride_rm"}
    base = dict(BLOCK_N=8, BLOCK_K=1024, ROWS=1, SPLIT_K=1, NORM=False, NORM_BLOCK=1, SILU=False, RESIDUAL=False,
                PDL=True, FLAT=False, W_SCALED=False, X_SCALED=False, W_VEC=0, GROUP=0)  # (every constexpr named:
    # left out, one would compile as an argument, both branches in)
    fp8 = dict(W_SCALED=True, W_VEC=8, GROUP=8)  # e4m3 weights (quantization="fp8"), as gemv.py launches them
    kernels = {
        "gemv_norm": (base | dict(NORM=True, NORM_BLOCK=4096), {}),
        "gemv_silu_residual": (base | dict(SILU=True, RESIDUAL=True), {}),
        "gemv_norm_flat": (base | dict(NORM=True, NORM_BLOCK=4096, FLAT=True), {}),
        "gemv_silu_residual_flat": (base | dict(SILU=True, RESIDUAL=True, FLAT=True), {}),
        "gemv_fp8_norm_flat": (base | dict(NORM=True, NORM_BLOCK=4096, FLAT=True) | fp8, {"w_ptr": "*fp8e4nv"}),
        "gemv_fp8_silu_residual_flat": (base | dict(SILU=True, RESIDUAL=True, FLAT=True) | fp8,
                                        {"w_ptr": "*fp8e4nv"}),
    }
    out = {name: compile_kernel(GEMV_KERNEL, gemv_types | types, c, gemv_aligned, arch, num_warps=4, launch_pdl=True)
           for name, (c, types) in kernels.items()}
    rope_types = dict.fromkeys(("q_ptr", "k_ptr", "q_norm_ptr", "k_norm_ptr", "v_ptr"), "*bf16") | {
        "positions_ptr": "*i64", "slot_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "k_scale_ptr": "*fp32",
        "v_scale_ptr": "*fp32", "eps": "fp32"}
    rope_aligned = {n for n in rope_types if n.endswith("_ptr")}
    for cache, pdl in (("bf16", False), ("fp8", False), ("fp8", True)):
        kv = "*fp8e4nv" if cache == "fp8" else "*bf16"
        c = dict(HALF=64, NORM=False, BLOCK_QH=32, BLOCK_KH=8, BLOCK_HALF=64, STORE=True, FP8=cache == "fp8",
                 FP8_LIMIT=448.0, PDL=pdl)
        out[f"rope_store_{cache}{'_pdl' if pdl else ''}"] = compile_kernel(
            ROPE_KERNEL, rope_types | {"k_cache_ptr": kv, "v_cache_ptr": kv}, c, rope_aligned, arch, num_warps=4,
            launch_pdl=pdl)
    # the decode kernel launched as a programmatic dependent (the PDL chain, on by default)
    out["decode_bf16_pdl"] = compile_decode("bf16", "pairs", 64, 4, 2, group=4, pdl=True, arch=arch)
    return out


def count_ptx(ptx: str) -> dict[str, int]:
    counts = collections.Counter()
    for line in ptx.splitlines():
        match = re.match(r"\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)", line)
        if match and match.group(1).startswith(_PTX_KINDS):
            counts[match.group(1)] += 1
    return dict(sorted(counts.items()))


def sass_mix(cubin: bytes) -> tuple[int, dict[str, int], str]:
    """(instructions, the most common opcodes, registers and shared memory) from the cubin, by nvdisasm and
    cuobjdump from Triton's own CUDA tools; empty where they are missing."""
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", f.name], capture_output=True, text=True,
                                  check=True).stdout
            usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", f.name],
                                   capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return 0, {}, ""
    ops = re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)", sass, re.M)
    resources = re.search(r"REG:\d+.*?SHARED:\d+", usage)
    return len(ops), dict(collections.Counter(ops).most_common(12)), resources.group(0) if resources else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", choices=("bf16", "fp8"), default="fp8")
    parser.add_argument("--variant", default="pairs", help="the FP8 loop (kernels/kv_fp8.py FP8_DECODE_VARIANTS)")
    parser.add_argument("--block-n", type=int, help="keys a tile (default: the kernel's for the cache)")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--rows", type=int, default=16, help="rows of the products (the query group padded)")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10")
    parser.add_argument("--json", action="store_true", help="print the PTX counts as one JSON object instead")
    parser.add_argument("--one-row", action="store_true",
                        help="instead: the one-row layer's GEMVs and RoPE-with-store (PTX counts per kernel)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1: Triton's interpreter compiles nothing; run with TRITON_INTERPRET=0")
    if args.one_row:
        counts = {name: count_ptx(k.asm["ptx"]) | {"griddepcontrol": k.asm["ptx"].count("griddepcontrol")}
                  for name, k in compile_one_row(args.arch).items()}
        print(json.dumps(counts) if args.json else "\n".join(f"{n}: {c}" for n, c in counts.items()))
        return 0
    block_n = args.block_n or (128 if args.cache == "fp8" else 64)
    kernel = compile_decode(args.cache, args.variant, block_n, args.warps, args.stages, rows=args.rows, arch=args.arch)
    total, mix, resources = sass_mix(kernel.asm.get("cubin", b""))
    if args.json:
        registers = re.search(r"REG:(\d+)", resources)
        print(json.dumps({"ptx": count_ptx(kernel.asm["ptx"]), "sass_instructions": total,
                          "registers": int(registers.group(1)) if registers else None}))
        return 0
    print(f"decode kernel, {args.cache} cache{' (' + args.variant + ')' if args.cache == 'fp8' else ''}, "
          f"{block_n} keys a tile, {args.warps} warps, {args.stages} stages, sm_{args.arch}")
    for name, n in count_ptx(kernel.asm["ptx"]).items():
        print(f"  ptx {name:55s} {n}")
    if total:
        print(f"  sass: {total} instructions; {', '.join(f'{k} {v}' for k, v in mix.items())}; {resources}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
