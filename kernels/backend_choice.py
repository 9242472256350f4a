"""The choice of attention backend, once per worker: flash-attn where importable on CUDA, else our Triton kernels
on CUDA, else the torch backend."""

from __future__ import annotations

from shardserve.kernels.backends import AttentionBackend
from shardserve.kernels.torch_backend import TorchAttentionBackend

BACKEND_NAMES = ("auto", "torch", "triton", "flash-attn")


def _flash(split_mixed: int = 0) -> AttentionBackend:
    from shardserve.kernels.flash import FlashAttentionBackend  # ImportError without flash-attn

    return FlashAttentionBackend()


def _triton(split_mixed: int = 0) -> AttentionBackend:
    from shardserve.kernels.triton_backend import TritonAttentionBackend  # ImportError without triton

    return TritonAttentionBackend(split_mixed=split_mixed)


_CUDA_BACKENDS = {"flash-attn": _flash, "triton": _triton}  # in "auto"'s order of preference


def get_backend(name: str, device: str, split_mixed: int = 0) -> AttentionBackend:
    """A named backend (its ImportError raised where it is not installed), or "auto"'s first importable one;
    split_mixed is the Triton backend's (EngineConfig.split_mixed_decodes)."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKEND_NAMES)}; got {name!r}")
    if name == "torch" or (name == "auto" and device != "cuda"):
        return TorchAttentionBackend()
    for candidate in _CUDA_BACKENDS if name == "auto" else (name,):
        try:
            return _CUDA_BACKENDS[candidate](split_mixed)
        except ImportError:
            if name != "auto":
                raise
    return TorchAttentionBackend()
