"""Which GEMMs the fused LM head's CUDA code runs (issue 28): read from the emulator's log of its host cuBLAS
(`dllm_fast.testing.emulation.gemm_log`), so that the operand types, compute types, counts and FLOPs are checked
without a GPU. A bf16/fp16 model runs only model-dtype x model-dtype -> fp32 GEMMs with fp32 accumulation: one
per chunk in the forward, three per chunk in the backward (recomputed logits, grad_hidden, grad_weight) and in
the known-gradient walk; fp32 and fp64 inputs run exact GEMMs in their own type; `tf32_grad_gemms=True` runs
the two gradient GEMMs on fp32 operands in TF32."""

import dataclasses

import pytest
import torch

import dllm_fast
from dllm_fast.ops import masked_logprobs_grad
from dllm_fast.testing import emulation
from dllm_fast.testing.emulation import GemmRecord

pytestmark = pytest.mark.emulated_cuda

M, D, V, CHUNK = 24, 16, 300, 128  # three chunks: 128, 128 and a partial 44
CHUNKS = 3


def make_inputs(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, D, generator=gen).to(dtype)
    weight = (torch.randn(V, D, generator=gen) * 2 / D**0.5).to(dtype)
    targets = torch.randint(0, V, (M,), generator=gen)
    upstream = torch.randn(M, generator=gen)
    return hidden, weight, targets, upstream


def exact_lse(hidden, weight):
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    return (hidden.to(acc) @ weight.to(acc).T).logsumexp(-1)


def kinds(records):
    """The distinct (A, B, C, compute) combinations of a log."""
    return {(r.a_dtype, r.b_dtype, r.c_dtype, r.compute) for r in records}


def run_known_gradient_walk(dtype, **options):
    hidden, weight, targets, upstream = make_inputs(dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    buffer = torch.zeros_like(weight)
    with emulation.emulated_cuda(), emulation.gemm_log() as gemms:
        masked_logprobs_grad(hidden, weight, targets, upstream.to(acc), lse=exact_lse(hidden, weight),
                             grad_weight=buffer, chunk_size=CHUNK, **options)
    return gemms


def run_forward_and_backward(dtype, **options):
    hidden, weight, targets, upstream = make_inputs(dtype)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    with emulation.emulated_cuda():
        with emulation.gemm_log() as forward:
            logp = dllm_fast.masked_logprobs(hidden, weight, targets, chunk_size=CHUNK, **options)
        with emulation.gemm_log() as backward:
            logp.backward(upstream.to(logp.dtype))
    return forward, backward


def test_the_log_records_each_gemm_as_cublas_is_given_it():
    """The glue's row-major logits GEMM [M, c] = hidden [M, d] @ chunk^T reaches cuBLAS as column-major
    C[c, M] = chunk^T-as-given (transposed) @ hidden: m = c, n = M, k = d, A transposed."""
    hidden, weight, targets, _ = make_inputs(torch.float32)
    with emulation.emulated_cuda(), emulation.gemm_log() as gemms:
        torch.ops.dllm_fast.masked_logprobs(hidden, weight, targets, CHUNK)
    assert gemms == [GemmRecord(torch.float32, torch.float32, torch.float32, "fp32", c, M, D, True, False)
                     for c in (128, 128, 44)]
    assert sum(g.flops for g in gemms) == 2 * M * D * V
    with pytest.raises(dataclasses.FrozenInstanceError):
        gemms[0].m = 1


def test_logs_nest_and_record_nothing_outside():
    hidden, weight, targets, _ = make_inputs(torch.float32)
    with emulation.emulated_cuda():
        torch.ops.dllm_fast.masked_logprobs(hidden, weight, targets, CHUNK)  # before any log: not kept
        with emulation.gemm_log() as outer:
            torch.ops.dllm_fast.masked_logprobs(hidden, weight, targets, CHUNK)
            with emulation.gemm_log() as inner:
                torch.ops.dllm_fast.masked_logprobs(hidden, weight, targets, 1000)
        torch.ops.dllm_fast.masked_logprobs(hidden, weight, targets, CHUNK)
        with emulation.gemm_log() as later:
            pass
    assert len(outer) == CHUNKS + 1 and len(inner) == 1 and later == []
    with emulation.gemm_log() as cpu:  # the CPU kernels' GEMMs never reach the emulated cuBLAS
        torch.ops.dllm_fast.masked_logprobs(hidden, weight, targets, CHUNK)
    assert cpu == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_known_gradient_walk_runs_three_model_dtype_gemms_per_chunk(dtype):
    gemms = run_known_gradient_walk(dtype)
    assert kinds(gemms) == {(dtype, dtype, torch.float32, "fp32")}
    assert len(gemms) == 3 * CHUNKS
    assert sum(g.flops for g in gemms) == 6 * M * D * V


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_backward_runs_three_model_dtype_gemms_per_chunk_and_the_forward_one(dtype):
    forward, backward = run_forward_and_backward(dtype)
    assert kinds(forward) == kinds(backward) == {(dtype, dtype, torch.float32, "fp32")}
    assert len(forward) == CHUNKS and sum(g.flops for g in forward) == 2 * M * D * V
    assert len(backward) == 3 * CHUNKS and sum(g.flops for g in backward) == 6 * M * D * V


def test_grad_into_weight_takes_the_known_gradient_walk():
    forward, backward = run_forward_and_backward(torch.bfloat16, grad_into_weight=True)
    assert kinds(forward) == kinds(backward) == {(torch.bfloat16, torch.bfloat16, torch.float32, "fp32")}
    assert len(backward) == 3 * CHUNKS


@pytest.mark.parametrize("dtype, compute", [(torch.float32, "fp32"), (torch.float64, "fp64")])
def test_fp32_and_fp64_inputs_run_exact_gemms_in_their_type(dtype, compute):
    walk = run_known_gradient_walk(dtype)
    forward, backward = run_forward_and_backward(dtype)
    for gemms, count in ((walk, 3), (forward, 1), (backward, 3)):
        assert kinds(gemms) == {(dtype, dtype, dtype, compute)}
        assert len(gemms) == count * CHUNKS


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_tf32_option_runs_the_gradient_gemms_in_tf32(dtype):
    """tf32_grad_gemms=True: d(logits) stays fp32 and the two gradient GEMMs take it with fp32 operands in TF32;
    the logits GEMM is the same as without the option."""
    logits_gemm = (dtype, dtype, torch.float32, "fp32")
    gradient_gemm = (torch.float32, torch.float32, torch.float32, "tf32")
    walk = run_known_gradient_walk(dtype, tf32_grad_gemms=True)
    forward, backward = run_forward_and_backward(dtype, tf32_grad_gemms=True)
    for gemms in (walk, backward):
        assert [kinds([g]).pop() for g in gemms] == [logits_gemm, gradient_gemm, gradient_gemm] * CHUNKS
        assert sum(g.flops for g in gemms) == 6 * M * D * V
    assert kinds(forward) == {logits_gemm}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("tf32", [False, True])
def test_the_cost_models_gemms_by_type_are_the_logs(dtype, tf32):
    """The planner prices each GEMM at the peak of its operand type (dllm_fast.ops.costs.gemm_flops_by_type): its
    FLOPs by (operand dtype, compute) must be what the CUDA glue gives cuBLAS, for every op and option."""
    from dllm_fast.ops import costs

    if tf32 and dtype == torch.float64:
        pytest.skip("tf32_grad_gemms is refused for fp64 inputs")
    hidden, weight, targets, upstream = make_inputs(dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    g, lse, buffer = upstream.to(acc), exact_lse(hidden, weight), torch.zeros_like(weight)
    calls = [("masked_logprobs", (hidden, weight, targets, CHUNK, tf32)),
             ("masked_logprobs_backward", (g, None, hidden, weight, targets, lse, CHUNK, [True, True], tf32)),
             ("masked_logprobs_backward", (g, None, hidden, weight, targets, lse, CHUNK, [True, False], tf32)),
             ("masked_logprobs_grad", (hidden, weight, targets, g, lse, buffer, CHUNK, tf32)),
             ("masked_logprobs_grad", (hidden, weight, targets, g, None, None, CHUNK, tf32))]
    for op, args in calls:
        with emulation.emulated_cuda(), emulation.gemm_log() as gemms:
            getattr(torch.ops.dllm_fast, op)(*args)
        assert costs.gemm_flops_by_type(op, "cuda", args) == costs.gemm_flops_in_log(gemms), (op, dtype, tf32)
