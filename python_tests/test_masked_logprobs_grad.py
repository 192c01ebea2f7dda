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
from dllm_fast.testing.memory import track_allocations
from dllm_fast.testing import emulation
from dllm_fast.ops.logprobs import _composite_grad
from dllm_fast.validation import values_checked

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
    """Where the lse is trusted (inside values_checked(), as under torch.compile): the walk measures the true
    normaliser S, so logp and grad_hidden are corrected exactly, and grad_weight's softmax part is off by a
    relative S - 1 (its rows sum over rows of different S before S is known)."""
    hidden, weight, targets, upstream = make_inputs(40, 16, 3000, device, dtype=torch.float64)
    want_logp, want_hidden, want_weight = reference.masked_logprobs_grad(hidden, weight, targets, upstream)
    offset = 1e-3 * torch.linspace(-1, 1, 40, dtype=torch.float64, device=device)
    buffer = torch.zeros_like(weight)
    with values_checked():
        logp, grad_hidden = masked_logprobs_grad(hidden, weight, targets, upstream,
                                                 lse=exact_lse(hidden, weight) + offset, grad_weight=buffer,
                                                 chunk_size=256)
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
@pytest.mark.parametrize("tf32", [False, True])
def test_the_emulated_cuda_kernel_gives_the_cpu_kernels_results(dtype, lse_kind, tf32):
    """The CUDA kernel and glue, run by the emulator, against the CPU kernel on the same inputs, every argument
    variant: out-of-range targets (NaN, no gradient), a partial last chunk, a buffer added to in place, the
    gradient GEMMs in the model's dtype or (tf32_grad_gemms) on fp32 d(logits)."""
    if tf32 and dtype == torch.float64:
        pytest.skip("fp64 runs fp64 GEMMs either way")
    hidden, weight, targets, upstream = make_inputs(19, 40, 301, dtype=dtype)
    targets[4], targets[11] = -3, 301
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    lse = {"exact": exact_lse(hidden.to(acc), weight.to(acc)), "none": None,
           "off": exact_lse(hidden.to(acc), weight.to(acc)) - 1e-3}[lse_kind]
    start = torch.randn(301, 40).to(dtype)

    def run():
        buffer = start.clone()
        logp, grad_hidden = torch.ops.dllm_fast.masked_logprobs_grad(hidden, weight, targets, upstream.to(acc), lse,
                                                                     buffer, 64, tf32)
        return logp, grad_hidden, buffer

    want = run()
    module = emulation.load()
    launches = module.launch_count()
    with emulation.emulated_cuda():
        got = run()
    assert module.launch_count() > launches
    assert got[0][[4, 11]].isnan().all() and got[0].isnan().sum() == 2
    assert (got[1][[4, 11]] == 0).all()
    # bf16/fp16: both round d(logits) to the model's dtype (a value whose fp32 logit differs in the last bit
    # between the two GEMMs may round the other way) and the gradients once more. Under tf32 the CUDA gradient
    # GEMMs round d(logits) and fp32 operands to TF32 (cuBLAS, and the emulator, do); the CPU's stay exact fp32.
    close = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5)}.get(
        dtype, dict(rtol=1e-2, atol=1e-3))
    if tf32 and dtype == torch.float32:
        close = dict(rtol=1e-3, atol=1e-3)
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


# ---------------------------------------------------------------------------------------------------------
# Precision (issue 28): the gradient GEMMs of a bf16/fp16 call take d(logits) rounded once to the model's dtype


def max_error(x, truth):
    return (x.double() - truth.double()).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tf32_grad_gemms", [False, True])
@pytest.mark.parametrize("known_lse", [True, False])
def test_low_precision_error_at_most_twice_the_naive_path(device, dtype, tf32_grad_gemms, known_lse):
    """Against an fp64 oracle, a bf16/fp16 call's log-probs, grad_hidden and grad_weight (added into a zero
    buffer of the model's dtype) err at most 2x the naive path in that dtype (logits, log-softmax and autograd's
    gradient GEMMs all in it), on the same inputs."""
    M, d, V = 96, 64, 3000
    hidden, weight, targets, upstream = make_inputs(M, d, V, device, dtype=dtype)
    upstream = upstream.float()  # representable in dtype: no part of either error
    truth = reference.masked_logprobs_grad(hidden.double(), weight.double(), targets, upstream.double())
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    naive_logp = torch.log_softmax(h @ w.T, dim=-1).gather(1, targets[:, None]).squeeze(1)
    naive = (naive_logp.detach(), *torch.autograd.grad(naive_logp, (h, w), upstream.to(dtype)))
    buffer = torch.zeros_like(weight)
    lse = exact_lse(hidden.float(), weight.float()) if known_lse else None
    logp, grad_hidden = masked_logprobs_grad(hidden, weight, targets, upstream, lse=lse, grad_weight=buffer,
                                             chunk_size=512, tf32_grad_gemms=tf32_grad_gemms)
    assert logp.dtype == torch.float32 and grad_hidden.dtype == dtype
    for ours, theirs, want in zip((logp, grad_hidden, buffer), naive, truth):
        assert max_error(ours, want) <= 2 * max_error(theirs, want) + 1e-6
    assert max_error(logp, truth[0]) <= 1e-4  # fp32 accumulation and an fp32 result


@pytest.mark.parametrize("tf32_grad_gemms", [False, True])
def test_fp16_d_logits_keep_their_precision_under_a_small_upstream_gradient(device, tf32_grad_gemms):
    """With hidden = 2**12 I, grad_weight = d(logits)^T hidden shows d(logits) itself (times 2**12, exactly). Times
    an upstream gradient of 2**-12, fp16 d(logits) would fall among fp16's subnormals (up to half their value
    lost, as in the naive fp16 path, and as here before d(logits) were scaled by a power of two before rounding):
    every entry keeps fp16's relative precision, with and without the TF32 option. Compared off the targets'
    entries (the softmax part)."""
    width, vocab = 32, 2000
    hidden = torch.eye(width, dtype=torch.float16, device=device) * 2**12
    weight = (torch.randn(vocab, width, generator=torch.Generator().manual_seed(0)) * 2 / 2**12).to(device,
                                                                                                    torch.float16)
    targets = torch.randint(0, vocab, (width,), generator=torch.Generator().manual_seed(1)).to(device)
    upstream = torch.full((width,), 2.0**-12, device=device)
    _, _, exact = reference.masked_logprobs_grad(hidden.double(), weight.double(), targets, upstream.double())
    buffer = torch.zeros_like(weight)
    masked_logprobs_grad(hidden, weight, targets, upstream, grad_weight=buffer, chunk_size=256,
                         tf32_grad_gemms=tf32_grad_gemms)
    softmax_part = torch.ones_like(buffer, dtype=torch.bool)
    softmax_part[targets, torch.arange(width, device=device)] = False
    got, want = buffer[softmax_part].double(), exact[softmax_part]
    # fp16's own rounding of an output entry: 2**-11 of it, or of 2**-14 (a subnormal output); d(logits)'s: 2**-11
    assert ((got - want).abs() / want.abs().clamp_min(2.0**-14)).max() < 2.0**-9


@pytest.mark.emulated_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_and_emulated_cuda_round_d_logits_alike(dtype):
    """The CPU kernel rounds d(logits) to the model's dtype (after fp16's power of two) as the CUDA glue does
    for its model-dtype GEMMs: their gradients differ only by the order of fp32 sums, in a few low bits of a few
    entries; the CPU's TF32 option (d(logits) unrounded) differs from the CUDA default in many more."""
    hidden, weight, targets, upstream = make_inputs(64, 48, 1500, dtype=dtype)
    lse = exact_lse(hidden.float(), weight.float())

    def run(tf32):
        buffer = torch.zeros_like(weight)
        _, grad_hidden = torch.ops.dllm_fast.masked_logprobs_grad(hidden, weight, targets, upstream, lse, buffer,
                                                                  256, tf32)
        return torch.cat([grad_hidden.reshape(-1), buffer.reshape(-1)])

    cpu, cpu_tf32 = run(False), run(True)
    with emulation.emulated_cuda():
        cuda = run(False)
    differ, differ_tf32 = (cpu != cuda).double().mean().item(), (cpu_tf32 != cuda).double().mean().item()
    assert differ < differ_tf32 / 4, (differ, differ_tf32)


# ---------------------------------------------------------------------------------------------------------
# Trusted arguments (issue 32): lse verified, grad_weight's overlaps, types and autograd


def test_a_non_finite_lse_is_refused_before_anything_is_written(device):
    hidden, weight, targets, upstream = make_inputs(10, 8, 50, device)
    for bad in (float("nan"), float("inf"), float("-inf")):
        lse = exact_lse(hidden, weight)
        lse[6] = bad
        buffer = torch.ones_like(weight)
        with pytest.raises(ValueError, match=r"lse\[6\] = .* is not finite.*lse=None"):
            masked_logprobs_grad(hidden, weight, targets, upstream, lse=lse, grad_weight=buffer)
        assert torch.equal(buffer, torch.ones_like(weight))


def test_an_lse_below_the_target_logit_is_refused_before_anything_is_written(device):
    hidden, weight, targets, upstream = make_inputs(10, 8, 50, device)
    lse = exact_lse(hidden, weight)
    lse[3] = (hidden[3] @ weight[targets[3]]) - 0.5
    buffer = torch.ones_like(weight)
    with pytest.raises(ValueError, match=r"lse\[3\] = .* below that row's target logit"):
        masked_logprobs_grad(hidden, weight, targets, upstream, lse=lse, grad_weight=buffer)
    assert torch.equal(buffer, torch.ones_like(weight))
    logp = reference.masked_logprobs(hidden, weight, targets)
    with pytest.raises(ValueError, match=r"lse\[\d+\] = .* below that row's target logit"):
        logprobs_with_known_gradient(hidden, weight, targets, upstream, logp=logp - logp[0] + 0.1)  # logp > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("offset", [5.0, -5.0, 100.0, 1e-3])
def test_a_wrong_lse_is_recomputed_row_by_row(device, dtype, offset, monkeypatch):
    """Issue 32 item 2: an lse off by +-5 (the hostile round's case), by +100 (every exp underflows) or by 1e-3
    on some rows gives the twin's logp, grad_hidden and grad_weight: the walk's measured normaliser flags those
    rows, and only they are walked again."""
    import dllm_fast.ops.logprobs as faces

    hidden, weight, targets, upstream = make_inputs(30, 16, 700, device, dtype=dtype)
    want_logp, want_hidden, want_weight = reference.masked_logprobs_grad(hidden, weight, targets, upstream)
    off = torch.zeros(30, dtype=torch.bool, device=device)
    off[[2, 7, 19]] = True
    lse = exact_lse(hidden, weight) + offset * off
    if offset < 0:  # an lse below the target logit is refused up front; keep these rows above theirs
        lse = torch.maximum(lse, (hidden * weight[targets]).sum(-1) + 1e-3)
        off = lse != exact_lse(hidden, weight)
    walked = []
    original = faces._recompute_rows
    monkeypatch.setattr(faces, "_recompute_rows", lambda rows, *args: walked.append(rows) or original(rows, *args))
    start = torch.randn_like(weight)
    buffer = start.clone()
    logp, grad_hidden = masked_logprobs_grad(hidden, weight, targets, upstream, lse=lse, grad_weight=buffer,
                                             chunk_size=128)
    assert len(walked) == 1 and walked[0].tolist() == off.nonzero().squeeze(1).tolist()
    tol = tolerance(dtype)
    torch.testing.assert_close(logp, want_logp, **tol)
    torch.testing.assert_close(grad_hidden, want_hidden, **tol)
    # An lse too low first adds these rows' softmax part S (up to e**5) times too large; its rounding, about
    # eps * S of it, stays after the correction.
    weight_tol = dict(rtol=1e-4, atol=1e-4) if offset < 0 and dtype == torch.float32 else tol
    torch.testing.assert_close(buffer - start, want_weight, **weight_tol)


def test_an_exact_lse_walks_once(device, monkeypatch):
    import dllm_fast.ops.logprobs as faces

    monkeypatch.setattr(faces, "_recompute_rows", lambda *args: pytest.fail("walked again"))
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        hidden, weight, targets, upstream = make_inputs(40, 32, 3000, device, dtype=dtype)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        logits = hidden.to(acc) @ weight.to(acc).T * 8  # logits up to about 50: the rounding bound scales with them
        lse = exact_lse(hidden.to(acc), weight.to(acc) * 8)
        masked_logprobs_grad(hidden, weight * 8, targets, upstream.to(acc), lse=lse,
                             grad_weight=torch.zeros_like(weight), chunk_size=512)
        assert logits.abs().max() > 20


def test_inputs_viewing_grad_weight_are_read_at_the_call(device):
    """Issue 32 item 3: hidden and lse views into grad_weight's memory, which the walk writes while it reads
    them: they are copied first, so the result is that of their values at the call."""
    hidden, weight, targets, upstream = make_inputs(10, 8, 50, device)
    want_logp, want_hidden, want_weight = reference.masked_logprobs_grad(hidden, weight, targets, upstream)
    buffer = torch.randn_like(weight)
    buffer[20:30] = hidden
    buffer.view(-1)[300:310] = exact_lse(hidden, weight)
    start = buffer.clone()
    logp, grad_hidden = masked_logprobs_grad(buffer[20:30], weight, targets, upstream,
                                             lse=buffer.view(-1)[300:310], grad_weight=buffer)
    torch.testing.assert_close(logp, want_logp)
    torch.testing.assert_close(grad_hidden, want_hidden)
    torch.testing.assert_close(buffer - start, want_weight)


def test_grad_weight_sharing_the_weights_memory_is_refused():
    hidden, weight, targets, upstream = make_inputs(10, 8, 50)
    with pytest.raises(ValueError, match="grad_weight shares memory with lm_head_weight"):
        masked_logprobs_grad(hidden, weight, targets, upstream, grad_weight=weight)


@pytest.mark.parametrize(
    "buffer, error, message",
    [
        (lambda w: w.numpy().copy(), TypeError, r"grad_weight must be a torch.Tensor .* got numpy.ndarray.*"
                                                r"torch.from_numpy"),
        (lambda w: torch.zeros_like(w).requires_grad_(True), ValueError, r"grad_weight requires grad.*\.detach\(\)"),
    ],
)
def test_a_grad_weight_that_cannot_be_added_into_is_named(buffer, error, message):
    """Issue 32 item 11: a NumPy array, or a tensor that requires grad."""
    hidden, weight, targets, upstream = make_inputs(10, 8, 50)
    with pytest.raises(error, match=message):
        masked_logprobs_grad(hidden, weight, targets, upstream, grad_weight=buffer(weight))


def test_autograd_grad_with_respect_to_the_weight_under_grad_into_weight(device):
    """Issue 32 item 11: torch.autograd.grad returns gradients and never accumulates them, so under
    grad_into_weight=True it gets the weight's gradient as a tensor, and .grad is left alone; so does a backward
    whose inputs leave the weight out."""
    hidden, weight, targets, upstream = make_inputs(20, 8, 300, device, dtype=torch.float64)
    parameter = torch.nn.Parameter(weight.clone())
    h = hidden.clone().requires_grad_(True)
    _, want_hidden, want_weight = reference.masked_logprobs_grad(hidden, weight, targets, upstream)
    logp = dllm_fast.masked_logprobs(h, parameter, targets, chunk_size=64, grad_into_weight=True)
    got_hidden, got_weight = torch.autograd.grad((upstream * logp).sum(), (h, parameter))
    torch.testing.assert_close(got_weight, want_weight, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_hidden, want_hidden, rtol=1e-12, atol=1e-12)
    assert parameter.grad is None
    logp = dllm_fast.masked_logprobs(h, parameter, targets, chunk_size=64, grad_into_weight=True)
    (got_hidden,) = torch.autograd.grad((upstream * logp).sum(), (h,))
    torch.testing.assert_close(got_hidden, want_hidden, rtol=1e-12, atol=1e-12)
    logp = dllm_fast.masked_logprobs(h, parameter, targets, chunk_size=64, grad_into_weight=True)
    (upstream * logp).sum().backward(inputs=[h])
    assert parameter.grad is None
    torch.testing.assert_close(h.grad, want_hidden, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("function", ["masked_logprobs", "masked_logprobs_grad"])
def test_tf32_for_fp64_inputs_is_refused(function):
    hidden, weight, targets, upstream = make_inputs(4, 8, 50, dtype=torch.float64)
    with pytest.raises(ValueError, match="tf32_grad_gemms=True asks for TF32 gradient GEMMs, but the inputs are "
                                         "float64"):
        if function == "masked_logprobs":
            dllm_fast.masked_logprobs(hidden, weight, targets, tf32_grad_gemms=True)
        else:
            masked_logprobs_grad(hidden, weight, targets, upstream, tf32_grad_gemms=True)
