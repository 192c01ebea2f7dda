"""The LM head's gradient for a known upstream gradient (masked_logprobs_grad) and the two ways the engine adds
the weight's gradient straight into `.grad` (grad_into_weight in the backward, logprobs_with_known_gradient in
the forward): values and gradients against the plain-PyTorch twin, in-place accumulation, the AccumulateGrad
hook, opcheck, torch.compile, bad input. The `device` cases run the CPU kernel, a GPU's, and the CUDA kernel in
the host emulator (emulated_cuda); the emulated kernel is also compared with the CPU kernel directly."""

import pytest
import torch
from torch.library import opcheck

import dllm_fast
from dllm_fast import reference
from dllm_fast.ops import logprobs_with_known_gradient, masked_logprobs_grad
from dllm_fast.memory import track_allocations
from dllm_fast.ops import emulation
from dllm_fast.ops.logprobs import _composite_grad

# (M, d, V, chunk): a chunk that does not divide V, one larger than V, a single row and column, a single column
# per chunk (4099 chunks: too many launches to emulate; the smaller one covers that case there).
SHAPES = [(37, 24, 1000, 128), (5, 8, 77, 1000), (1, 4, 1, 16),
          pytest.param(64, 32, 4099, 1, marks=pytest.mark.slow_to_emulate), (9, 8, 67, 1)]


def make_inputs(M, d, V, device="cpu", dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, d, generator=gen).to(device, dtype)
    weight = (torch.randn(V, d, generator=gen) * 2 / d**0.5).to(device, dtype)  # logits with a std of about 2
    targets = torch.randint(0, V, (M,), generator=gen).to(device)
    upstream = torch.randn(M, generator=gen).to(device, dtype)
    return hidden, weight, targets, upstream


def tolerance(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)


def exact_lse(hidden, weight):
    return (hidden @ weight.T).logsumexp(-1)


@pytest.mark.parametrize("M,d,V,chunk", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("known_lse", [True, False])
def test_values_and_gradients_match_the_twin(device, M, d, V, chunk, dtype, known_lse):
    hidden, weight, targets, upstream = make_inputs(M, d, V, device, dtype)
    want_logp, want_hidden, want_weight = reference.masked_logprobs_grad(hidden, weight, targets, upstream)
    start = torch.randn(V, d, dtype=dtype, device=device)  # gradients accumulated earlier: added to, not replaced
    buffer = start.clone()
    storage = buffer.data_ptr()
    logp, grad_hidden = masked_logprobs_grad(hidden, weight, targets, upstream, grad_weight=buffer, chunk_size=chunk,
                                             lse=exact_lse(hidden, weight) if known_lse else None)
    assert logp.dtype == dtype and grad_hidden.dtype == dtype and buffer.data_ptr() == storage
    torch.testing.assert_close(logp, want_logp, **tolerance(dtype))
    torch.testing.assert_close(grad_hidden, want_hidden, **tolerance(dtype))
    torch.testing.assert_close(buffer - start, want_weight, **tolerance(dtype))


def test_a_normaliser_that_is_a_little_off_leaves_logp_and_grad_hidden_exact(device):
    """The walk measures the true normaliser S: logp and grad_hidden are corrected exactly, grad_weight's softmax
    part is off by a relative S - 1 (its rows sum over rows of different S before S is known)."""
    hidden, weight, targets, upstream = make_inputs(40, 16, 3000, device, dtype=torch.float64)
    want_logp, want_hidden, want_weight = reference.masked_logprobs_grad(hidden, weight, targets, upstream)
    offset = 1e-3 * torch.linspace(-1, 1, 40, dtype=torch.float64, device=device)
    buffer = torch.zeros_like(weight)
    logp, grad_hidden = masked_logprobs_grad(hidden, weight, targets, upstream, lse=exact_lse(hidden, weight) + offset,
                                             grad_weight=buffer, chunk_size=256)
    torch.testing.assert_close(logp, want_logp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_hidden, want_hidden, rtol=1e-12, atol=1e-12)
    error = ((buffer - want_weight).norm() / want_weight.norm()).item()
    assert 1e-6 < error < 1e-3


def test_the_composite_of_the_forward_and_backward_kernels_gives_the_same():
    """The path CUDA tensors take until csrc/cuda has this kernel, run here on the CPU kernels."""
    hidden, weight, targets, upstream = make_inputs(33, 16, 700, dtype=torch.float64)
    fused_buffer, composite_buffer = torch.ones_like(weight), torch.ones_like(weight)
    fused = masked_logprobs_grad(hidden, weight, targets, upstream, grad_weight=fused_buffer, chunk_size=64)
    composite = _composite_grad(hidden, weight, targets, upstream, composite_buffer, 64)
    for got, want in zip(composite + (composite_buffer,), fused + (fused_buffer,)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert _composite_grad(hidden, weight, targets, upstream, None, 64)[1].shape == hidden.shape


def test_a_device_without_the_kernel_takes_the_composite(device, monkeypatch):
    """A build whose device lacks masked_logprobs_grad (one compiled before the CUDA kernel existed): the face
    must route to the forward and backward kernels, not fail."""
    import dllm_fast.ops.logprobs as faces

    hidden, weight, targets, upstream = make_inputs(20, 8, 300, device, dtype=torch.float64)
    want = masked_logprobs_grad(hidden, weight, targets, upstream, lse=exact_lse(hidden, weight))
    calls = []
    monkeypatch.setattr(faces, "has_kernel", lambda op, device: op != "masked_logprobs_grad")
    monkeypatch.setattr(faces, "_composite_grad", lambda *args: calls.append(1) or _composite_grad(*args))
    got = masked_logprobs_grad(hidden, weight, targets, upstream, lse=exact_lse(hidden, weight))
    assert calls == [1]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_device_with_the_kernel_never_takes_the_composite_nor_allocates_a_gradient(device, monkeypatch):
    """Issue 16: with its kernel (CPU, CUDA, emulated CUDA) the op adds into the buffer chunk by chunk; the
    composite's [V, d] temporary (1 MB here) would show in what torch allocates during the call."""
    import dllm_fast.ops.logprobs as faces

    monkeypatch.setattr(faces, "_composite_grad", lambda *args: pytest.fail("took the composite"))
    hidden, weight, targets, upstream = make_inputs(8, 64, 4000, device)
    buffer = torch.zeros_like(weight)
    for lse in (exact_lse(hidden, weight), None):
        with track_allocations(device) as allocated:
            masked_logprobs_grad(hidden, weight, targets, upstream, lse=lse, grad_weight=buffer, chunk_size=256)
        assert 0 < allocated.peak < weight.numel() * weight.element_size() // 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_accumulates_in_fp32_into_a_low_precision_gradient(device, dtype):
    hidden, weight, targets, upstream = make_inputs(24, 16, 500, device, dtype=dtype)
    start = torch.randn(500, 16, device=device).to(dtype)
    buffer = start.clone()
    logp, grad_hidden = masked_logprobs_grad(hidden, weight, targets, upstream, grad_weight=buffer, chunk_size=128)
    want_logp, want_hidden, want_weight = reference.masked_logprobs_grad(hidden, weight, targets, upstream)
    assert logp.dtype == torch.float32 and grad_hidden.dtype == dtype and buffer.dtype == dtype
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_hidden, want_hidden, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(buffer, (start.float() + want_weight.float()).to(dtype), rtol=2e-2, atol=2e-2)


def test_empty_batch_and_frozen_weight(device):
    hidden, weight, targets, upstream = make_inputs(0, 8, 50, device)
    buffer = torch.ones_like(weight)
    logp, grad_hidden = masked_logprobs_grad(hidden, weight, targets, upstream, grad_weight=buffer)
    assert logp.shape == (0,) and grad_hidden.shape == (0, 8) and torch.equal(buffer, torch.ones_like(weight))
    hidden, weight, targets, upstream = make_inputs(6, 8, 50, device)
    _, grad_hidden = masked_logprobs_grad(hidden, weight, targets, upstream)  # no grad_weight: not computed
    torch.testing.assert_close(grad_hidden, reference.masked_logprobs_grad(hidden, weight, targets, upstream)[1])


@pytest.mark.parametrize("vocab, width", [(1, 8), (33, 33), (257, 300)])
def test_rows_of_1_33_and_257_columns_match_the_twin(device, vocab, width):
    """One chunk of V columns and hidden rows of `width`: the CUDA kernels' partial warps and blocks, in the walk
    over the chunk's columns and in the final correction over the hidden width."""
    hidden, weight, targets, upstream = make_inputs(5, width, vocab, device, dtype=torch.float64)
    start = torch.randn(vocab, width, dtype=torch.float64, device=device)
    buffer = start.clone()
    lse = exact_lse(hidden, weight) + 1e-4  # a little off: S differs from 1
    logp, grad_hidden = masked_logprobs_grad(hidden, weight, targets, upstream, lse=lse, grad_weight=buffer,
                                             chunk_size=vocab)
    want_logp, want_hidden, want_weight = reference.masked_logprobs_grad(hidden, weight, targets, upstream)
    torch.testing.assert_close(logp, want_logp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_hidden, want_hidden, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(buffer - start, want_weight, rtol=1e-3, atol=5e-4)  # off by about S - 1 = 1e-4


@pytest.mark.emulated_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lse_kind", ["exact", "off", "none"])
def test_the_emulated_cuda_kernel_gives_the_cpu_kernels_results(dtype, lse_kind):
    """The CUDA kernel and glue, run by the emulator, against the CPU kernel on the same inputs, every argument
    variant: out-of-range targets (NaN, no gradient), a partial last chunk, a buffer added to in place."""
    hidden, weight, targets, upstream = make_inputs(19, 40, 301, dtype=dtype)
    targets[4], targets[11] = -3, 301
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    lse = {"exact": exact_lse(hidden.to(acc), weight.to(acc)), "none": None,
           "off": exact_lse(hidden.to(acc), weight.to(acc)) - 1e-3}[lse_kind]
    start = torch.randn(301, 40).to(dtype)

    def run():
        buffer = start.clone()
        logp, grad_hidden = torch.ops.dllm_fast.masked_logprobs_grad(hidden, weight, targets, upstream.to(acc), lse,
                                                                     buffer, 64)
        return logp, grad_hidden, buffer

    want = run()
    module = emulation.load()
    launches = module.launch_count()
    with emulation.emulated_cuda():
        got = run()
    assert module.launch_count() > launches
    assert got[0][[4, 11]].isnan().all() and got[0].isnan().sum() == 2
    assert (got[1][[4, 11]] == 0).all()
    # bf16/fp16: the CUDA gradient GEMMs round d(logits) to TF32 (cuBLAS, and the emulator, do); the CPU's do not.
    close = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5)}.get(
        dtype, dict(rtol=1e-2, atol=1e-3))
    torch.testing.assert_close(got[0], want[0], equal_nan=True, **close)
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w, **close)


def test_opcheck(device):
    hidden, weight, targets, upstream = make_inputs(12, 8, 100, device)
    lse = exact_lse(hidden, weight)
    for args in ((lse, torch.zeros_like(weight), 32), (None, None, 32), (None, torch.zeros_like(weight), 7)):
        opcheck(torch.ops.dllm_fast.masked_logprobs_grad.default, (hidden, weight, targets, upstream, *args))


def test_torch_compile_fullgraph_with_the_buffer_mutated(device):
    hidden, weight, targets, upstream = make_inputs(16, 8, 300, device)

    def step(h, w, g, buffer):
        logp, grad_hidden = masked_logprobs_grad(h, w, targets, g, grad_weight=buffer, chunk_size=64)
        return logp.sum() + grad_hidden.sum()

    eager, compiled = torch.zeros_like(weight), torch.zeros_like(weight)
    value = torch.compile(step, fullgraph=True)(hidden, weight, upstream, compiled)
    torch.testing.assert_close(value, step(hidden, weight, upstream, eager))
    torch.testing.assert_close(compiled, eager)


# ---------------------------------------------------------------------------------------------------------
# Into .grad: in the backward (grad_into_weight) and in the forward (logprobs_with_known_gradient)


def accumulate_grad_node(parameter):
    """The parameter's AccumulateGrad node, as DDP finds it to hook it (hold on to it: autograd keeps it weakly)."""
    return parameter.view_as(parameter).grad_fn.next_functions[0][0]


@pytest.mark.parametrize("grad_on_entry", [False, True])
def test_grad_into_weight_adds_into_the_same_grad_and_still_runs_its_accumulate_grad(grad_on_entry):
    """DDP/FSDP2 hook AccumulateGrad: it must run although the op returns no gradient for the weight."""
    hidden, weight, targets, upstream = make_inputs(20, 8, 300, dtype=torch.float64)
    parameter = torch.nn.Parameter(weight.clone())
    if grad_on_entry:
        parameter.grad = torch.ones_like(weight)
    start = None if parameter.grad is None else parameter.grad.clone()
    buffer = parameter.grad
    fired, node = [], accumulate_grad_node(parameter)
    node.register_hook(lambda *args: fired.append(parameter.grad.clone()))
    h = hidden.clone().requires_grad_(True)
    loss = (upstream * dllm_fast.masked_logprobs(h, parameter, targets, chunk_size=64, grad_into_weight=True)).sum()
    (3.0 * loss).backward()  # a host's scaled loss: the scale reaches the weight's gradient too
    _, want_hidden, want_weight = reference.masked_logprobs_grad(hidden, weight, targets, upstream)
    got = parameter.grad - (0 if start is None else start)
    torch.testing.assert_close(got, 3.0 * want_weight, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h.grad, 3.0 * want_hidden, rtol=1e-12, atol=1e-12)
    assert len(fired) == 1 and torch.equal(fired[0], parameter.grad)  # the hook saw the complete gradient
    if grad_on_entry:
        assert parameter.grad is buffer  # in place, no second [V, d] tensor


def test_grad_into_weight_of_a_frozen_or_non_leaf_weight_takes_autograds_path():
    hidden, weight, targets, upstream = make_inputs(10, 8, 100, dtype=torch.float64)
    base = weight.clone().requires_grad_(True)
    h = hidden.clone().requires_grad_(True)
    loss = (upstream * dllm_fast.masked_logprobs(h, base * 2, targets, grad_into_weight=True)).sum()
    loss.backward()
    _, want_hidden, want_weight = reference.masked_logprobs_grad(hidden, weight * 2, targets, upstream)
    torch.testing.assert_close(base.grad, 2 * want_weight, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h.grad, want_hidden, rtol=1e-12, atol=1e-12)
    frozen = weight.clone()
    h.grad = None
    (upstream * dllm_fast.masked_logprobs(h, frozen, targets, grad_into_weight=True)).sum().backward()
    _, want_hidden, _ = reference.masked_logprobs_grad(hidden, frozen, targets, upstream)
    torch.testing.assert_close(h.grad, want_hidden, rtol=1e-12, atol=1e-12)
    assert frozen.grad is None


@pytest.mark.parametrize("known_logp", [True, False])
def test_known_gradient_surrogate_gives_autograds_gradients(known_logp):
    hidden, weight, targets, upstream = make_inputs(30, 8, 400, dtype=torch.float64)
    parameter = torch.nn.Parameter(weight.clone())
    body = hidden.clone().requires_grad_(True)
    fired, node = [], accumulate_grad_node(parameter)
    node.register_hook(lambda *args: fired.append(parameter.grad.clone()))
    logp = reference.masked_logprobs(hidden * 1.5, weight, targets) if known_logp else None
    rows = body * 1.5  # stands for the model body
    logp_now, surrogate = logprobs_with_known_gradient(rows, parameter, targets, upstream, logp=logp, chunk_size=64)
    assert parameter.grad is not None and not fired  # the weight's gradient is in .grad before the backward
    surrogate.backward()
    want_logp, want_hidden, want_weight = reference.masked_logprobs_grad(hidden * 1.5, weight, targets, upstream)
    torch.testing.assert_close(logp_now, want_logp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(surrogate.detach(), (upstream * want_logp).sum(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(body.grad, 1.5 * want_hidden, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(parameter.grad, want_weight, rtol=1e-12, atol=1e-12)
    assert len(fired) == 1 and torch.equal(fired[0], parameter.grad)


def test_known_gradient_surrogate_passes_gradcheck_float64():
    """The surrogate's value is sum(g * logp(hidden, W)); its gradient (grad_hidden, and the weight's, held for
    the backward when the weight is not a leaf) must be that value's derivative."""
    hidden, weight, targets, upstream = make_inputs(6, 4, 23, dtype=torch.float64)

    def surrogate(h, w):
        return logprobs_with_known_gradient(h, w * 1.0, targets, upstream, chunk_size=5)[1]

    assert torch.autograd.gradcheck(surrogate, (hidden.requires_grad_(True), weight.requires_grad_(True)))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(upstream=lambda u: u[:-1]), r"grad_logp must be a floating-point \[M\] = \[10\]"),
        (dict(upstream=lambda u: u.long()), r"grad_logp must be a floating-point"),
        (dict(lse=lambda lse: lse.double()), r"lse must be a torch.float32 \[M\] = \[10\]"),
        (dict(buffer=lambda b: b[:, :4]), r"grad_weight must match lm_head_weight"),
        (dict(buffer=lambda b: b.double()), r"grad_weight must match lm_head_weight"),
    ],
)
def test_bad_input_names_the_value(change, message):
    hidden, weight, targets, upstream = make_inputs(10, 8, 50)
    values = dict(upstream=upstream, lse=exact_lse(hidden, weight), buffer=torch.zeros_like(weight))
    values.update({key: fn(values[key]) for key, fn in change.items()})
    with pytest.raises(ValueError, match=message):
        masked_logprobs_grad(hidden, weight, targets, values["upstream"], lse=values["lse"],
                             grad_weight=values["buffer"])


def test_a_non_contiguous_buffer_is_named():
    """The kernel trusts its arguments (ops.h): the face refuses a buffer it could not update row by row."""
    hidden, weight, targets, upstream = make_inputs(10, 8, 50)
    buffer = torch.zeros(8, 50).T
    with pytest.raises(ValueError, match="grad_weight must be contiguous"):
        masked_logprobs_grad(hidden, weight, targets, upstream, grad_weight=buffer)


def test_an_out_of_range_target_gives_nan_and_no_gradient(device):
    """As masked_logprobs (forward and backward) on every device: logp NaN, its row passes nothing back."""
    hidden, weight, targets, upstream = make_inputs(10, 8, 50, device)
    targets[3], targets[7] = -1, 50
    buffer = torch.zeros_like(weight)
    logp, grad_hidden = masked_logprobs_grad(hidden, weight, targets, upstream, grad_weight=buffer)
    inside = torch.ones(10, dtype=torch.bool, device=device)
    inside[[3, 7]] = False
    assert logp[~inside].isnan().all() and logp[inside].isfinite().all()
    assert (grad_hidden[~inside] == 0).all()
    want_logp, want_hidden, want_weight = reference.masked_logprobs_grad(hidden[inside], weight, targets[inside],
                                                                         upstream[inside])
    torch.testing.assert_close(logp[inside], want_logp)
    torch.testing.assert_close(grad_hidden[inside], want_hidden)
    torch.testing.assert_close(buffer, want_weight)
