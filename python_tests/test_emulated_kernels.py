"""The CUDA kernels of csrc/cuda, run by the host emulator, where a CPU run cannot reach: block reductions at
any block size, grids beyond the hardware limit, and the rules every kernel source must follow to be emulated."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dllm_fast import ops
from dllm_fast.testing import emulation

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kernel_strides_over_rows_beyond_the_grid_limit(emulated, dtype):
    """With the emulated device's gridDim.x limit lowered to 3, ten rows need three blocks that stride: the
    launchers used to cast the row count to the grid size unchecked. bf16: the gradient kernels that write
    d(logits) in the model's dtype."""
    hidden = torch.randn(10, 8).to(dtype)
    weight = (torch.randn(37, 8) / 8**0.5).to(dtype)
    targets = torch.randint(0, 37, (10,))
    confidence, candidates = torch.rand(10, 12), torch.rand(10, 12) > 0.3
    counts = torch.randint(0, 5, (10,))
    qkv = torch.randn(2, 5, 4, 8).to(dtype)  # ten (b, l) rows
    tables = torch.randn(2, 2, 5, 1, 8)

    def run():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp = ops.masked_logprobs(h, w, targets, chunk_size=16)
        grads = torch.autograd.grad(logp.sum(), (h, w))
        buffer = torch.zeros_like(weight)
        known = ops.masked_logprobs_grad(hidden, weight, targets, torch.ones(10), grad_weight=buffer, chunk_size=16)
        sample = ops.sample_tokens(hidden, weight, temperature=0.8, seed=4, chunk_size=16)
        chosen = ops.select_transfer(confidence, candidates, counts=counts)
        rotated = ops.rope(qkv, tables, 3)
        return [logp, *grads, *known, buffer, *sample, chosen, rotated]

    expected = run()  # the CPU kernels
    emulated.set_grid_limit_x(3)
    try:
        with emulation.emulated_cuda():
            got = run()
    finally:
        emulated.set_grid_limit_x(2**31 - 1)
    close = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, **close)


def test_the_emulated_module_holds_every_op(emulated):
    assert sorted(emulated.ops) == ["masked_logprobs", "masked_logprobs_backward", "masked_logprobs_grad",
                                   "rope", "sample_tokens", "select_transfer"]


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


def tiny_llada():
    from dllm_fast.models import LLaDAConfig, LLaDAModel

    torch.manual_seed(0)
    return LLaDAModel(LLaDAConfig.preset("tiny")).eval()


def test_generate_and_score_give_the_cpu_kernels_results_through_the_emulated_cuda_kernels(emulated):
    """Whole calls: sampled rollouts (T = 0.9, the same seed) are token for token the CPU kernels', and the
    Monte Carlo log-probs and their gradient agree, with the CUDA kernels and glue doing the work."""
    import dllm_fast
    from dllm_fast.likelihood import sample_masks, score

    model = tiny_llada()
    ids = torch.randint(0, 100, (3, 5))
    kwargs = dict(gen_length=8, block_length=4, steps=4, temperature=0.9, cache="dual")

    def run():
        out = dllm_fast.generate(model, ids, generator=torch.Generator().manual_seed(7), **kwargs)
        masks = sample_masks(out.sequences, prompt_length=5, n_t=2, sampler="random_t",
                             generator=torch.Generator().manual_seed(1), eos_token_id=model.eos_token_id)
        model.zero_grad()
        lp = score(model, out.sequences, masks, micro_batch=2)
        lp.sum().backward()
        return out.sequences, lp.detach(), model.lm_head_weight.grad.clone()

    expected = run()
    launches = emulated.launch_count()
    with emulation.emulated_cuda():
        got = run()
    assert emulated.launch_count() > launches  # the emulated kernels did run
    assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], expected[2], rtol=1e-4, atol=1e-6)


def test_a_whole_process_runs_on_the_emulated_kernels(emulated):
    code = ("import sys, torch, dllm_fast; from dllm_fast.testing import emulation; "
            "dllm_fast.sample_tokens(torch.randn(3, 8), torch.randn(11, 8), temperature=1.0); "
            "print(sys.argv[1:], emulation.load().launch_count())")
    run = subprocess.run([sys.executable, "-m", "dllm_fast.testing.emulation", "--run", "-c", code, "x"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[0] == "['x']"  # the code's own arguments
    assert int(run.stdout.split()[-1]) >= 2  # the sampling kernel and its finalisation
