"""Which backend an op call takes (dllm_fast.ops.backend.choose_backend): the compiled kernel of the tensors'
device type when the library registered one, meta tensors included (the fake kernels give shapes), and the
environment's default still read on every call although a kernel found is remembered."""

import pytest
import torch

from dllm_fast import ops
from dllm_fast._extension import HAS_EXTENSION, has_kernel

needs_extension = pytest.mark.skipif(not HAS_EXTENSION, reason="needs the compiled extension")


@needs_extension
def test_meta_tensors_take_the_fake_kernels_and_other_device_types_have_none():
    assert has_kernel("rope", "meta") and has_kernel("sample_tokens", "meta")
    assert not has_kernel("rope", "xpu") and not has_kernel("rope", "mps")  # no such dispatch key: no kernel
    assert ops.choose_backend("rope", torch.device("meta"), None) == "compiled"


@needs_extension
def test_a_llada_forward_on_the_meta_device_gives_shapes():
    """A model built on the meta device (a skeleton, e.g. to size a run) runs its no-grad forward on meta ids:
    the RoPE op's fake kernel answers where the lookup of a "META" dispatch key used to raise."""
    from dllm_fast.models import LLaDAConfig, LLaDAModel

    config = LLaDAConfig.preset("tiny")
    with torch.device("meta"):
        model = LLaDAModel(config).eval()
    with torch.no_grad():
        hidden = model(torch.zeros(2, 7, dtype=torch.long, device="meta"))
    assert hidden.device.type == "meta" and hidden.shape == (2, 7, config.d_model)


@needs_extension
def test_the_environment_default_is_read_on_every_call(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("DLLM_FAST_BACKEND", raising=False)
    assert ops.choose_backend("rope", cpu, None) == "compiled"  # found, and remembered
    monkeypatch.setenv("DLLM_FAST_BACKEND", "reference")
    assert ops.choose_backend("rope", cpu, None) == "reference"
    assert ops.choose_backend("rope", cpu, "compiled") == "compiled"  # an explicit choice beats the default
    monkeypatch.setenv("DLLM_FAST_BACKEND", "fastest")
    with pytest.raises(ValueError, match="'fastest' is not one of"):
        ops.choose_backend("rope", cpu, None)
