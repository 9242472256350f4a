import pytest

from shardserve.kernels.backend_choice import get_backend


def test_auto_off_cuda_and_torch_by_name_are_the_torch_backend():
    assert get_backend("auto", "cpu").name == "torch"
    assert get_backend("torch", "cuda").name == "torch"


def test_triton_by_name_is_the_triton_backend_where_triton_imports():
    pytest.importorskip("triton")
    assert get_backend("triton", "cuda").name == "triton"


def test_the_split_mixed_setting_reaches_the_triton_backend():
    """EngineConfig.split_mixed_decodes, which every worker receives in Init, is the backend's threshold."""
    pytest.importorskip("triton")
    assert get_backend("triton", "cuda").split_mixed == 0
    assert get_backend("triton", "cuda", split_mixed=32).split_mixed == 32


def test_an_unknown_backend_name_is_refused():
    with pytest.raises(ValueError, match="one of auto, torch, triton, flash-attn"):
        get_backend("sdpa", "cuda")
