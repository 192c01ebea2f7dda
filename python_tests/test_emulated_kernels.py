"""The CUDA kernels of csrc/cuda, run by the host emulator, where a CPU run cannot reach: block reductions at
any block size, grids beyond the hardware limit, and the rules every kernel source must follow to be emulated."""

import re
from pathlib import Path

import pytest
import torch

from dllm_fast import ops
from dllm_fast.ops import emulation

pytestmark = pytest.mark.emulated_cuda
CUDA_SOURCES = sorted((Path(__file__).resolve().parents[1] / "csrc" / "cuda").glob("*.cu*"))


@pytest.fixture(scope="module")
def emulated():
    return emulation.load()


@pytest.mark.parametrize("threads", [1, 31, 32, 33, 100, 256, 257, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_block_logsumexp_works_for_any_block_size_and_twice_in_a_row(emulated, threads, dtype):
    """It used to assume 256 threads (full-warp shuffles over lanes a partial warp lacks) and to end without a
    barrier, so a second call raced with the first over its shared partials."""
    x = torch.randn(5, 300, dtype=dtype)
    x[1, :150] = float("-inf")
    x[2] = float("-inf")  # an empty row stays -inf
    out = torch.ops.dllm_fast_emulated.reduce_logsumexp_rows(x, threads, 2)
    expected = x.logsumexp(1)
    torch.testing.assert_close(out[:, 0], expected)
    assert torch.equal(out[:, 1], out[:, 0])


def test_every_kernel_strides_over_rows_beyond_the_grid_limit(emulated):
    """With the emulated device's gridDim.x limit lowered to 3, ten rows need three blocks that stride: the
    launchers used to cast the row count to the grid size unchecked."""
    hidden = torch.randn(10, 8)
    weight = torch.randn(37, 8) / 8**0.5
    targets = torch.randint(0, 37, (10,))
    confidence, candidates = torch.rand(10, 12), torch.rand(10, 12) > 0.3
    counts = torch.randint(0, 5, (10,))

    def run():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp = ops.masked_logprobs(h, w, targets, chunk_size=16)
        grads = torch.autograd.grad(logp.sum(), (h, w))
        sample = ops.sample_tokens(hidden, weight, temperature=0.8, seed=4, chunk_size=16)
        chosen = ops.select_transfer(confidence, candidates, counts=counts)
        return [logp, *grads, *sample, chosen]

    expected = run()  # the CPU kernels
    emulated.set_grid_limit_x(3)
    try:
        with emulation.emulated_cuda():
            got = run()
    finally:
        emulated.set_grid_limit_x(2**31 - 1)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_the_emulated_module_holds_every_op(emulated):
    assert sorted(emulated.ops) == ["masked_logprobs", "masked_logprobs_backward", "sample_tokens", "select_transfer"]


def test_every_kernel_source_launches_and_shares_memory_the_emulatable_way():
    """A `<<<...>>>` launch or a plain `__shared__ T x[N]` compiles under nvcc but escapes the emulator (the launch
    would not compile for the host, a plain array would not be poisoned or race-checked)."""
    for path in CUDA_SOURCES:
        code = re.sub(r"//[^\n]*", "", path.read_text())
        if path.name != "launch.cuh":
            assert "<<<" not in code, f"{path.name}: launch kernels with DLLM_FAST_LAUNCH (launch.cuh)"
        for declaration in re.findall(r"__shared__[^;]*;", code):
            assert re.match(r"__shared__\s+SharedArray<", declaration), (
                f"{path.name}: declare shared memory as `__shared__ SharedArray<T, N> name;`, got {declaration!r}")
