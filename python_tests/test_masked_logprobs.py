"""The fused masked log-prob op against its plain-PyTorch twin: values, gradients, dtypes, memory, compile."""

import pytest
import torch
from torch.library import opcheck

import dllm_fast
from dllm_fast import reference
from dllm_fast.memory import count_saved_tensors
from dllm_fast.testing.memory import peak_extra_rss

# (M, d, V, chunk): odd sizes, a chunk that does not divide V, one larger than V, a single row/column, a single
# column per chunk (4099 chunks: too many launches to emulate; the smaller one covers that case there).
SHAPES = [(37, 24, 1000, 128), (5, 8, 77, 1000), (1, 4, 1, 16),
          pytest.param(64, 32, 4099, 1, marks=pytest.mark.slow_to_emulate), (9, 8, 67, 1)]


def make_inputs(M, d, V, device, dtype=torch.float32, requires_grad=False):
    hidden = torch.randn(M, d, device=device, dtype=dtype)
    weight = (torch.randn(V, d, device=device) * 2 / d**0.5).to(dtype)  # logits with a std of about 2
    targets = torch.randint(0, V, (M,), device=device)
    return hidden.requires_grad_(requires_grad), weight.requires_grad_(requires_grad), targets


@pytest.mark.parametrize("M,d,V,chunk", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_values_and_gradients_match_reference(device, M, d, V, chunk, dtype):
    hidden, weight, targets = make_inputs(M, d, V, device, dtype, requires_grad=True)
    upstream = torch.randn(M, device=device, dtype=dtype)

    logp = dllm_fast.masked_logprobs(hidden, weight, targets, chunk_size=chunk)
    expected = reference.masked_logprobs(hidden, weight, targets)
    assert logp.dtype == expected.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logp, expected, **tol)

    grads = torch.autograd.grad(logp, (hidden, weight), upstream)
    expected_grads = torch.autograd.grad(expected, (hidden, weight), upstream)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("inf_chunk", [0, 2, 4])  # the leading chunk, a middle one, the last (partial) one
def test_a_chunk_of_minus_inf_logits_contributes_nothing(device, dtype, inf_chunk):
    """Issue 10.4: a vocabulary chunk whose logits are all -inf adds nothing to the online logsumexp (the
    leading one used to make it exp(-inf - -inf) = NaN). Here its weights overflow the logits to -inf while
    staying finite, so the reference's gradients are finite too."""
    M, d, V, chunk = 6, 4, 37, 8
    hidden = torch.rand(M, d, device=device, dtype=dtype) + 0.5  # positive: each product below -max/2
    weight = torch.randn(V, d, device=device, dtype=dtype) * 2 / d**0.5
    columns = slice(inf_chunk * chunk, (inf_chunk + 1) * chunk)
    weight[columns] = -torch.finfo(dtype).max
    finite = torch.tensor([j for j in range(V) if not columns.start <= j < columns.stop], device=device)
    targets = finite[torch.randint(0, len(finite), (M,), device=device)]
    hidden.requires_grad_()
    weight.requires_grad_()
    upstream = torch.randn(M, device=device, dtype=dtype)

    assert torch.isneginf((hidden @ weight.T)[:, columns]).all()
    logp = dllm_fast.masked_logprobs(hidden, weight, targets, chunk_size=chunk)
    expected = reference.masked_logprobs(hidden, weight, targets)
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(logp, expected)
    grads = torch.autograd.grad(logp, (hidden, weight), upstream)
    expected_grads = torch.autograd.grad(expected, (hidden, weight), upstream)
    for got, want in zip(grads, expected_grads):
        assert torch.isfinite(want).all()
        torch.testing.assert_close(got, want)


def test_logsumexp_output_is_differentiable_too(device):
    """The raw op also returns lse; its gradient (softmax) must be right even though the face hides it."""
    hidden, weight, targets = make_inputs(9, 6, 50, device, torch.float64, requires_grad=True)
    logp, lse = torch.ops.dllm_fast.masked_logprobs(hidden, weight, targets, 16)
    a, b = torch.randn(9, device=device, dtype=torch.float64), torch.randn(9, device=device, dtype=torch.float64)
    grads = torch.autograd.grad((a * logp + b * lse).sum(), (hidden, weight))
    logits = hidden @ weight.T
    oracle = a * torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1) + b * logits.logsumexp(-1)
    for got, want in zip(grads, torch.autograd.grad(oracle.sum(), (hidden, weight))):
        torch.testing.assert_close(got, want)


def test_gradcheck_float64(device):
    hidden, weight, targets = make_inputs(6, 5, 23, device, torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda h, w: dllm_fast.masked_logprobs(h, w, targets, chunk_size=7), (hidden, weight)
    )


def test_only_requested_gradients_are_computed(device):
    hidden, weight, targets = make_inputs(8, 4, 30, device, requires_grad=False)
    hidden.requires_grad_(True)
    dllm_fast.masked_logprobs(hidden, weight, targets).sum().backward()
    assert hidden.grad is not None and weight.grad is None
    expected = torch.autograd.grad(reference.masked_logprobs(hidden, weight, targets).sum(), hidden)[0]
    torch.testing.assert_close(hidden.grad, expected, rtol=1e-5, atol=1e-5)


def test_empty_batch(device):
    hidden, weight, targets = make_inputs(0, 8, 40, device, requires_grad=True)
    logp = dllm_fast.masked_logprobs(hidden, weight, targets)
    assert logp.shape == (0,)
    logp.sum().backward()
    assert torch.count_nonzero(weight.grad) == 0 and hidden.grad.shape == (0, 8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tf32_grad_gemms", [False, True])
def test_low_precision_error_at_most_twice_torch(device, dtype, tf32_grad_gemms):
    """flash-attention's rule: our error against an fp64 oracle is at most 2x PyTorch's own in that dtype, with
    d(logits) rounded to the model's dtype for the gradient GEMMs (issue 28) and with the TF32 option's fp32."""
    M, d, V = 96, 64, 3000
    hidden, weight, targets = make_inputs(M, d, V, device, dtype, requires_grad=True)
    upstream = torch.randn(M, device=device).to(dtype).float()  # representable in dtype: no part of either error

    oracle_inputs = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    oracle = reference.masked_logprobs(*oracle_inputs, targets)
    oracle_grads = torch.autograd.grad(oracle, oracle_inputs, upstream.double())

    torch_lp = torch.log_softmax(hidden @ weight.T, dim=-1).gather(1, targets[:, None]).squeeze(1)
    torch_grads = torch.autograd.grad(torch_lp, (hidden, weight), upstream.to(dtype))

    ours = dllm_fast.masked_logprobs(hidden, weight, targets, chunk_size=512, tf32_grad_gemms=tf32_grad_gemms)
    our_grads = torch.autograd.grad(ours, (hidden, weight), upstream)
    assert ours.dtype == torch.float32 and our_grads[0].dtype == dtype

    def err(x, y):
        return (x.double() - y).abs().max().item()

    assert err(ours, oracle) <= 2 * err(torch_lp, oracle) + 1e-6
    assert err(ours, oracle) <= 1e-4  # fp32 accumulation and an fp32 result: far tighter than the dtype's eps
    for mine, theirs, truth in zip(our_grads, torch_grads, oracle_grads):
        assert err(mine, truth) <= 2 * err(theirs, truth) + 1e-6


def test_opcheck(device):
    for requires_grad in (True, False):
        hidden, weight, targets = make_inputs(12, 8, 100, device, requires_grad=requires_grad)
        opcheck(torch.ops.dllm_fast.masked_logprobs.default, (hidden, weight, targets, 32))
    hidden, weight, targets = make_inputs(12, 8, 100, device)
    lse = (hidden @ weight.T).logsumexp(-1)
    grad = torch.randn(12, device=device)
    for mask in ([True, True], [False, True], [True, False]):
        opcheck(torch.ops.dllm_fast.masked_logprobs_backward.default,
                (grad, None, hidden, weight, targets, lse, 32, mask))


@pytest.mark.slow  # torch.compile: about 30 s on 2 cores
def test_torch_compile_fullgraph(device):
    hidden, weight, targets = make_inputs(16, 8, 300, device, requires_grad=True)

    def loss(h, w):
        return (dllm_fast.masked_logprobs(h, w, targets, chunk_size=64) * torch.arange(16, device=device)).sum()

    compiled = torch.compile(loss, fullgraph=True)
    value = compiled(hidden, weight)
    grads = torch.autograd.grad(value, (hidden, weight))
    expected_value = loss(hidden, weight)
    expected = torch.autograd.grad(expected_value, (hidden, weight))
    torch.testing.assert_close(value, expected_value)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


def test_saves_no_logits_for_backward():
    M, d, V = 256, 32, 20000
    hidden, weight, targets = make_inputs(M, d, V, "cpu", requires_grad=True)
    with count_saved_tensors() as fused:
        dllm_fast.masked_logprobs(hidden, weight, targets, chunk_size=512)
    with count_saved_tensors() as naive:
        reference.masked_logprobs(hidden, weight, targets)
    inputs = sum(t.numel() * t.element_size() for t in (hidden, weight, targets))
    # The inputs themselves plus the per-row logsumexp; nothing of size [M, V].
    assert fused.bytes <= inputs + M * 4
    assert naive.bytes >= M * V * 4  # sanity: the naive path does keep the logits


@pytest.mark.slow
def test_peak_memory_is_a_few_chunks_not_the_logits():
    """In a fresh process, forward+backward's peak resident memory above baseline stays far below [M, V]."""
    M, d, V, chunk = 512, 64, 100_000, 2048
    setup = f"""
import dllm_fast
M, d, V = {M}, {d}, {V}
h = torch.randn(M, d, requires_grad=True); W = torch.randn(V, d, requires_grad=True)
y = torch.randint(0, V, (M,))
dllm_fast.masked_logprobs(h[:4], W[:1000], y[:4] % 1000).sum().backward()  # warm up threads and MKL
h.grad = None; W.grad = None
"""
    extra = peak_extra_rss(setup, f"dllm_fast.masked_logprobs(h, W, y, chunk_size={chunk}).sum().backward()")
    grads = (M * d + V * d) * 4
    logits = M * V * 4
    chunk_buffer = M * chunk * 4
    # A few [M, chunk] buffers (logits, softmax grad) at most: about 1/12 of the [M, V] logits here.
    assert extra - grads <= 4 * chunk_buffer < logits / 8, f"peak {extra / 1e6:.1f} MB above baseline"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda h, w, t: (h[None], w, t), "hidden must be \\[M, d\\]"),
        (lambda h, w, t: (h, w[:, :3], t), "lm_head_weight must be \\[V, d\\] with d = 8"),
        (lambda h, w, t: (h, w, t[:-1]), "targets must be \\[M\\] = \\[10\\]"),
        (lambda h, w, t: (h, w.double(), t), "must share one of"),
        (lambda h, w, t: (h, w, t.float()), "targets must be int64"),
        (lambda h, w, t: (h.int(), w.int(), t), "must share one of"),
    ],
)
def test_bad_input_names_the_value(mutate, message):
    hidden, weight, targets = make_inputs(10, 8, 50, "cpu")
    with pytest.raises((ValueError, TypeError), match=message):
        dllm_fast.masked_logprobs(*mutate(hidden, weight, targets))


def test_bad_chunk_size_and_backend():
    hidden, weight, targets = make_inputs(4, 8, 50, "cpu")
    with pytest.raises(ValueError, match="chunk_size=0 must be an int >= 1"):
        dllm_fast.masked_logprobs(hidden, weight, targets, chunk_size=0)
    with pytest.raises(ValueError, match="backend='fastest' is not one of"):
        dllm_fast.masked_logprobs(hidden, weight, targets, backend="fastest")


def test_backends_agree(device):
    hidden, weight, targets = make_inputs(20, 8, 300, device)
    compiled = dllm_fast.masked_logprobs(hidden, weight, targets, backend="compiled")
    plain = dllm_fast.masked_logprobs(hidden, weight, targets, backend="reference")
    torch.testing.assert_close(compiled, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_cuda_kernel_is_registered():
    assert dllm_fast.build_info()["with_cuda"], "CUDA is available but dllm_fast was built without CUDA kernels"


def test_a_chunk_size_beyond_int64_means_the_whole_vocabulary():
    hidden, weight, targets = make_inputs(6, 8, 50, "cpu")
    torch.testing.assert_close(dllm_fast.masked_logprobs(hidden, weight, targets, chunk_size=2**70),
                               dllm_fast.masked_logprobs(hidden, weight, targets, chunk_size=50))


def test_double_backward_names_the_limit_and_the_way_out():
    hidden, weight, targets = make_inputs(6, 8, 50, "cpu", torch.float64, requires_grad=True)
    logp = dllm_fast.masked_logprobs(hidden, weight, targets, backend="compiled")
    with pytest.raises(RuntimeError, match="no second derivative.*backend='reference'"):
        torch.autograd.grad(logp.sum(), hidden, create_graph=True)
    logp = dllm_fast.masked_logprobs(hidden, weight, targets, backend="reference")
    (grad,) = torch.autograd.grad(logp.sum(), hidden, create_graph=True)
    assert grad.requires_grad  # the reference backend supports higher-order gradients


@pytest.mark.parametrize("argument", ["hidden", "lm_head_weight", "targets"])
def test_a_meta_tensor_is_named(argument):
    hidden, weight, targets = make_inputs(6, 8, 50, "cpu")
    args = dict(hidden=hidden, lm_head_weight=weight, targets=targets)
    args[argument] = args[argument].to("meta")
    with pytest.raises(ValueError, match=f"masked_logprobs: {argument} is on the meta device"):
        dllm_fast.masked_logprobs(*args.values())


# ---------------------------------------------------------------------------------------------------------
# Issue 19: the CPU kernel, the CUDA kernel (emulated) and the reference agree, at the edges too


@pytest.mark.parametrize("backend", ["compiled", "reference"])
def test_an_out_of_vocabulary_target_gives_nan_on_every_backend(device, backend):
    """Checking the targets would cost a host sync on CUDA, so no device raises: the log-prob of a target
    outside [0, V) is NaN everywhere (the CPU kernel used to raise), and the other rows are untouched."""
    hidden, weight, targets = make_inputs(6, 8, 50, device, torch.float64, requires_grad=True)
    targets[1], targets[4] = 50, -1
    logp = dllm_fast.masked_logprobs(hidden, weight, targets, chunk_size=16, backend=backend)
    valid = torch.tensor([True, False, True, True, False, True], device=device)
    assert logp[~valid].isnan().all()
    expected = reference.masked_logprobs(hidden[valid], weight, targets[valid])
    torch.testing.assert_close(logp[valid], expected)
    upstream = torch.randn(6, device=device, dtype=torch.float64)  # nothing flows back through a NaN log-prob
    grads = torch.autograd.grad(logp, (hidden, weight), upstream)
    expected_grads = torch.autograd.grad(expected, (hidden, weight), upstream[valid])
    torch.testing.assert_close(grads[0], expected_grads[0])
    assert (grads[0][~valid] == 0).all()
    torch.testing.assert_close(grads[1], expected_grads[1])


def test_a_row_without_a_finite_logit_gives_nan_on_every_backend(device):
    hidden, weight, targets = make_inputs(5, 8, 40, device)
    hidden[3] = float("nan")
    for backend in ("compiled", "reference"):
        logp = dllm_fast.masked_logprobs(hidden, weight, targets, chunk_size=16, backend=backend)
        assert logp[3].isnan() and torch.isfinite(logp[[0, 1, 2, 4]]).all()


def test_float16_backward_keeps_gradients_below_float16s_smallest_number(device):
    """The CUDA backward used to round d(logits) to the model's dtype: in fp16 the softmax terms below 6e-8
    became 0, which dropped a whole term of grad_hidden here (the CPU kept them in fp32)."""
    V = 2001
    hidden = torch.tensor([[20.0, 0.0]], dtype=torch.float16, device=device, requires_grad=True)
    weight = torch.zeros(V, 2, dtype=torch.float16, device=device)
    weight[0, 0] = 1.0  # the target: logit 20; every other token has logit 0, probability about 2e-9
    weight[1:, 1] = 1.0
    weight.requires_grad_()
    targets = torch.tensor([0], device=device)
    logp = dllm_fast.masked_logprobs(hidden, weight, targets, chunk_size=256)
    grad_hidden, grad_weight = torch.autograd.grad(logp.sum(), (hidden, weight))
    oracle_inputs = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    oracle = torch.autograd.grad(reference.masked_logprobs(*oracle_inputs, targets).sum(), oracle_inputs)
    # The terms made of the tiny probabilities: -sum_j p_j (about -4e-6) and the rows -p_j * hidden (about -4e-8,
    # which fp16 rounds to its smallest subnormal). The target's own terms (1 - p, a cancellation in fp32 on
    # every device) are not what this test is about.
    assert oracle[0][0, 1] < -4e-6
    torch.testing.assert_close(grad_hidden[:, 1].double(), oracle[0][:, 1], rtol=1e-2, atol=0)
    torch.testing.assert_close(grad_weight[1:].double(), oracle[1][1:].to(torch.float16).double(), rtol=1e-2, atol=0)


@pytest.mark.parametrize("vocab", [1, 33, 257])
def test_rows_of_1_33_and_257_columns_match_the_reference(device, vocab):
    """One chunk of V columns: the CUDA kernels' partial warps and blocks, forward and backward."""
    hidden, weight, targets = make_inputs(6, 8, vocab, device, torch.float64, requires_grad=True)
    logp = dllm_fast.masked_logprobs(hidden, weight, targets, chunk_size=vocab)
    expected = reference.masked_logprobs(hidden, weight, targets)
    torch.testing.assert_close(logp, expected)
    upstream = torch.randn(6, device=device, dtype=torch.float64)
    for got, want in zip(torch.autograd.grad(logp, (hidden, weight), upstream),
                         torch.autograd.grad(expected, (hidden, weight), upstream)):
        torch.testing.assert_close(got, want)
