"""The Triton path of the fused LM head (backend="triton": ops/triton_head.py's kernel, ops/logprobs_triton.py's
walk): the kernel's two epilogues against torch on the same tiles, the ops against the plain-PyTorch twin
(values and gradients in fp32/fp64, bf16 error at most twice the naive bf16 path's against an fp64 oracle), the
frozen head's skipped GEMM, one chunk of memory, opcheck, torch.compile, the backend choice and its errors, and
the planner's pricing on fake tensors.

Without a GPU the kernel runs in triton's interpreter (conftest sets TRITON_INTERPRET=1 before triton is
imported), on small tiles; the `cuda` cases compile it for the GPU. Both skip, naming why, where triton is not
installed (it ships with torch's CUDA wheels; the main CPU environment lacks it)."""

import pytest
import torch
from torch.library import opcheck

from dllm_fast import ops, reference
from dllm_fast.ops import backend as backend_module
from dllm_fast.ops import logprobs as faces
from dllm_fast.ops import logprobs_triton, masked_logprobs, masked_logprobs_grad, triton_head
from dllm_fast.testing.memory import track_allocations
from dllm_fast.validation import values_checked

INTERPRETED = triton_head.triton_importable() and triton_head.interpreting()
COMPILED = triton_head.triton_importable() and not triton_head.interpreting() and torch.cuda.is_available()
needs_triton = pytest.mark.skipif(not (INTERPRETED or COMPILED),
                                  reason="needs triton (torch's CUDA wheels ship it): with a GPU, or in its "
                                         "interpreter (TRITON_INTERPRET=1 before triton is imported; conftest sets it)")


@pytest.fixture
def device():
    """CPU tensors: the kernel in the interpreter. (The `cuda` cases below compile it: a few shapes and dtypes,
    since each new specialisation costs the GPU run seconds of compilation.)"""
    if not INTERPRETED:
        pytest.skip("the interpreter is off (a GPU machine compiles the kernels) or triton is not installed")
    return torch.device("cpu")


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


# (M, d, V, chunk) against the interpreter's 32 x 64 x 32 tiles: rows over two row tiles, a chunk that does not
# divide V, a width below and one above a K tile, a single column.
SHAPES = [(37, 24, 300, 128), (5, 8, 77, 1000), (9, 40, 130, 64), (1, 4, 1, 16)]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tma", [False, True])
def test_the_kernels_epilogues_give_torchs_logsumexp_and_softmax_gradient(device, dtype, tma):
    """MODE_LSE: each row's logsumexp over the chunk and its target's logit (NaN where the target lies outside);
    MODE_GRAD: d(logits) = g_target onehot - g_softmax exp(z - lse) in the chunk's columns (rounded once to the
    model's dtype), nothing written past them, and the sum of exp(z - lse). By TMA descriptors and by pointers."""
    M, d, V, v0, width = 37, 24, 200, 72, 100
    hidden, weight, targets, _ = make_inputs(M, d, V, device, dtype)
    # the edges of the interpreter's 64-column tiles and of the chunk, and just outside it
    targets[:6] = v0 + torch.tensor([0, 63, 64, width - 1, -1, width], device=device)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    logits = hidden.to(acc) @ weight.to(acc).T
    chunk = logits[:, v0:v0 + width]
    inside = (targets >= v0) & (targets < v0 + width)
    rows = torch.arange(M, device=device)
    config = triton_head.INTERPRETER
    target_logit = torch.full((M,), float("nan"), dtype=acc, device=device)
    lse = triton_head.chunk_logsumexp(hidden, weight[v0:v0 + width], targets, v0, target_logit, config, tma=tma)
    close = dict(rtol=1e-5, atol=1e-5) if acc == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, chunk.logsumexp(1), **close)
    torch.testing.assert_close(target_logit[inside], logits[rows[inside], targets[inside]], **close)
    assert target_logit[~inside].isnan().all()

    full_lse = logits.logsumexp(1)
    g_target, g_softmax = torch.randn(M, dtype=acc, device=device), torch.randn(M, dtype=acc, device=device)
    buffer = torch.full((M, 128), 7.0, dtype=dtype, device=device)  # wider than the chunk: its tail stays
    target_logit.fill_(float("nan"))
    sums = triton_head.chunk_softmax_grad(hidden, weight[v0:v0 + width], targets, v0, full_lse, g_target, g_softmax,
                                          buffer[:, :width], target_logit, config, tma=tma)
    e = (chunk - full_lse[:, None]).exp()
    onehot = torch.zeros_like(chunk)
    onehot[rows[inside], targets[inside] - v0] = 1
    want = (g_target[:, None] * onehot - g_softmax[:, None] * e).to(dtype)
    if dtype == torch.bfloat16:  # rounded once to nearest from fp32: equal but where fp32 sums differ at a tie
        torch.testing.assert_close(buffer[:, :width], want, rtol=2**-7, atol=1e-6)
        assert (buffer[:, :width] == want).float().mean() > 0.99
    else:
        torch.testing.assert_close(buffer[:, :width], want, **close)
    assert (buffer[:, width:] == 7).all()
    torch.testing.assert_close(sums, e.sum(1), **close)
    torch.testing.assert_close(target_logit[inside], logits[rows[inside], targets[inside]], **close)


@needs_triton
@pytest.mark.parametrize("M,d,V,chunk", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_and_backward_match_the_twin(device, M, d, V, chunk, dtype):
    hidden, weight, targets, upstream = make_inputs(M, d, V, device, dtype)
    want_logp, want_hidden, want_weight = reference.masked_logprobs_grad(hidden, weight, targets, upstream)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp = masked_logprobs(h, w, targets, chunk_size=chunk, backend="triton")
    logp.backward(upstream)
    assert logp.dtype == dtype
    torch.testing.assert_close(logp, want_logp, **tolerance(dtype))
    torch.testing.assert_close(h.grad, want_hidden, **tolerance(dtype))
    torch.testing.assert_close(w.grad, want_weight, **tolerance(dtype))


@needs_triton
@pytest.mark.parametrize("M,d,V,chunk", SHAPES[:3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("known_lse", [True, False])
@pytest.mark.parametrize("head", ["trained", "frozen"])
def test_the_known_gradient_walk_matches_the_twin(device, M, d, V, chunk, dtype, known_lse, head):
    """The walk with the logsumexp known (3 GEMMs a chunk) and not (the forward walk first), adding the weight's
    gradient into a buffer (a trained head) or computing none (frozen: LoRA)."""
    hidden, weight, targets, upstream = make_inputs(M, d, V, device, dtype)
    want_logp, want_hidden, want_weight = reference.masked_logprobs_grad(hidden, weight, targets, upstream)
    start = torch.randn(V, d, dtype=dtype, device=device)  # gradients accumulated earlier: added to
    buffer = start.clone() if head == "trained" else None
    logp, grad_hidden = masked_logprobs_grad(hidden, weight, targets, upstream, grad_weight=buffer, chunk_size=chunk,
                                             lse=exact_lse(hidden, weight) if known_lse else None, backend="triton")
    assert logp.dtype == dtype and grad_hidden.dtype == dtype
    torch.testing.assert_close(logp, want_logp, **tolerance(dtype))
    torch.testing.assert_close(grad_hidden, want_hidden, **tolerance(dtype))
    if buffer is not None:
        torch.testing.assert_close(buffer - start, want_weight, **tolerance(dtype))


@needs_triton
def test_a_persistent_grid_loops_over_its_tiles(device, monkeypatch):
    """Persistent configurations (a program per SM looping over tiles in GROUP_M order): three programs in the
    interpreter, each walking several tiles, give the twin's values and gradients."""
    monkeypatch.setenv("DLLM_FAST_TRITON_HEAD_TILES", "32x64x32,2,4,1,persistent")
    hidden, weight, targets, upstream = make_inputs(70, 24, 300, device, torch.float64)
    want_logp, want_hidden, want_weight = reference.masked_logprobs_grad(hidden, weight, targets, upstream)
    buffer = torch.zeros_like(weight)
    logp, grad_hidden = masked_logprobs_grad(hidden, weight, targets, upstream, grad_weight=buffer, chunk_size=256,
                                             backend="triton")
    for got, want in ((logp, want_logp), (grad_hidden, want_hidden), (buffer, want_weight)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@needs_triton
def test_a_frozen_head_runs_no_weight_gemm_and_a_trained_one_one_per_chunk(device, monkeypatch):
    """LoRA's frozen head: two GEMMs a chunk (the kernel's and grad_hidden's), never grad_weight's; the backward of
    masked_logprobs likewise when the weight does not require grad."""
    calls = []
    original = logprobs_triton._rows_into
    monkeypatch.setattr(logprobs_triton, "_rows_into", lambda *args: calls.append(1) or original(*args))
    hidden, weight, targets, upstream = make_inputs(9, 8, 200, device)
    masked_logprobs_grad(hidden, weight, targets, upstream, lse=exact_lse(hidden, weight), chunk_size=64,
                         backend="triton")
    h = hidden.clone().requires_grad_()
    masked_logprobs(h, weight, targets, chunk_size=64, backend="triton").backward(upstream)
    assert calls == [] and h.grad is not None
    masked_logprobs_grad(hidden, weight, targets, upstream, lse=exact_lse(hidden, weight), chunk_size=64,
                         grad_weight=torch.zeros_like(weight), backend="triton")
    assert len(calls) == 4  # 200 columns in chunks of 64


@needs_triton
def test_the_walk_holds_one_chunk_never_the_logits_nor_a_weight_sized_gradient(device):
    """d(logits) for one chunk, per-tile partials and per-row state: far below [M, V] and [V, d]."""
    M, d, V, chunk = 16, 64, 2000, 256
    hidden, weight, targets, upstream = make_inputs(M, d, V, device)
    buffer = torch.zeros_like(weight)
    for lse in (exact_lse(hidden, weight), None):
        with track_allocations(device) as allocated:
            masked_logprobs_grad(hidden, weight, targets, upstream, lse=lse, grad_weight=buffer, chunk_size=chunk,
                                 backend="triton")
        assert 0 < allocated.peak < M * V * 4 // 4 and allocated.peak < weight.numel() * 4 // 8


@needs_triton
@pytest.mark.parametrize("known_lse", [True, False])
def test_bf16_error_at_most_twice_the_naive_path(device, known_lse):
    """Against an fp64 oracle, bf16 log-probs, grad_hidden and grad_weight (added into a zero bf16 buffer) err at
    most 2x the naive bf16 path (logits, log-softmax and autograd's gradient GEMMs in bf16), as DESIGN.md asks;
    and the lean forward + backward likewise."""
    M, d, V = 48, 64, 700
    hidden, weight, targets, upstream = make_inputs(M, d, V, device, dtype=torch.bfloat16)
    upstream = upstream.float()
    truth = reference.masked_logprobs_grad(hidden.double(), weight.double(), targets, upstream.double())
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    naive_logp = torch.log_softmax(h @ w.T, dim=-1).gather(1, targets[:, None]).squeeze(1)
    naive = (naive_logp.detach(), *torch.autograd.grad(naive_logp, (h, w), upstream.to(torch.bfloat16)))
    buffer = torch.zeros_like(weight)
    lse = exact_lse(hidden.float(), weight.float()) if known_lse else None
    logp, grad_hidden = masked_logprobs_grad(hidden, weight, targets, upstream, lse=lse, grad_weight=buffer,
                                             chunk_size=256, backend="triton")
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lean = masked_logprobs(h2, w2, targets, chunk_size=256, backend="triton")
    lean.backward(upstream)
    assert logp.dtype == torch.float32 and grad_hidden.dtype == torch.bfloat16 and buffer.dtype == torch.bfloat16
    for results in ((logp, grad_hidden, buffer), (lean.detach(), h2.grad, w2.grad)):
        for ours, theirs, want in zip(results, naive, truth):
            assert max_error(ours, want) <= 2 * max_error(theirs, want) + 1e-6
        assert max_error(results[0], truth[0]) <= 1e-4  # fp32 accumulation and an fp32 result


def max_error(x, truth):
    return (x.double() - truth.double()).abs().max().item()


@needs_triton
@pytest.mark.parametrize("offset", [5.0, -0.05])  # too high; a little too low (S > 1)
def test_a_wrong_lse_is_recomputed_row_by_row_with_the_triton_kernels(device, offset, monkeypatch):
    """The face's verification (a given lse checked against the walk's measured normaliser) recomputes the rows
    that were off with the Triton kernels too; an lse a little off leaves logp and grad_hidden exact."""
    hidden, weight, targets, upstream = make_inputs(12, 8, 300, device, dtype=torch.float64)
    want_logp, want_hidden, want_weight = reference.masked_logprobs_grad(hidden, weight, targets, upstream)
    lse = exact_lse(hidden, weight)
    off = torch.zeros(12, dtype=torch.bool, device=device)
    off[[2, 7]] = True
    given = lse + off * offset
    used = []
    original = faces._recompute_rows
    monkeypatch.setattr(faces, "_recompute_rows", lambda rows, *args: used.append(args[-1]) or original(rows, *args))
    buffer = torch.zeros_like(weight)
    logp, grad_hidden = masked_logprobs_grad(hidden, weight, targets, upstream, lse=given, grad_weight=buffer,
                                             chunk_size=128, backend="triton")
    assert used == [faces.head_kernels("triton")]
    for got, want in ((logp, want_logp), (grad_hidden, want_hidden), (buffer, want_weight)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    small = lse + 1e-3 * torch.linspace(-1, 1, 12, dtype=torch.float64, device=device)
    with values_checked():  # trusted: not recomputed, corrected by the measured normaliser
        logp, grad_hidden = masked_logprobs_grad(hidden, weight, targets, upstream, lse=small, chunk_size=128,
                                                 backend="triton")
    torch.testing.assert_close(logp, want_logp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_hidden, want_hidden, rtol=1e-12, atol=1e-12)


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on -inf logits
def test_out_of_vocabulary_targets_empty_batches_and_minus_inf_chunks(device):
    """A target outside [0, V) gives NaN and no gradient; no rows gives empty results; a chunk whose logits are
    all -inf adds nothing to the normaliser."""
    hidden, weight, targets, upstream = make_inputs(6, 8, 150, device, dtype=torch.float64)
    targets[[1, 4]] = torch.tensor([-1, 150], device=device)
    inside = (targets >= 0) & (targets < 150)
    buffer = torch.zeros_like(weight)
    logp, grad_hidden = masked_logprobs_grad(hidden, weight, targets, upstream, grad_weight=buffer, chunk_size=64,
                                             backend="triton")
    want_logp, want_hidden, want_weight = reference.masked_logprobs_grad(
        hidden[inside], weight, targets[inside], upstream[inside])
    assert logp[~inside].isnan().all() and (grad_hidden[~inside] == 0).all()
    torch.testing.assert_close(logp[inside], want_logp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_hidden[inside], want_hidden, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(buffer, want_weight, rtol=1e-12, atol=1e-12)

    empty = masked_logprobs_grad(hidden[:0], weight, targets[:0], upstream[:0], backend="triton")
    assert empty[0].shape == (0,) and empty[1].shape == (0, 8)
    assert masked_logprobs(hidden[:0], weight, targets[:0], backend="triton").shape == (0,)

    weight = weight.clone()
    weight[64:128] = 0
    hidden_inf = hidden.clone()
    hidden_inf[:, 0] = 1.0
    weight[64:128, 0] = float("-inf")  # the middle chunk's logits: all -inf
    targets = targets.clamp(0, 63)
    got = masked_logprobs(hidden_inf, weight, targets, chunk_size=64, backend="triton")
    want = reference.masked_logprobs(hidden_inf, weight, targets)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@needs_triton
def test_gradcheck_float64(device):
    hidden, weight, targets, _ = make_inputs(5, 6, 70, device, dtype=torch.float64)
    torch.autograd.gradcheck(lambda h, w: masked_logprobs(h, w, targets, chunk_size=32, backend="triton"),
                             (hidden.requires_grad_(), weight.requires_grad_()), fast_mode=True)


@needs_triton
def test_grad_into_weight_and_the_known_gradient_surrogate_take_the_triton_kernels(device):
    """The engine's two ways of adding the weight's gradient into .grad (in the backward, in the forward) run on
    the Triton ops and give autograd's gradients."""
    hidden, weight, targets, upstream = make_inputs(10, 8, 200, device, dtype=torch.float64)
    _, want_hidden, want_weight = reference.masked_logprobs_grad(hidden, weight, targets, upstream)
    parameter = torch.nn.Parameter(weight.clone())
    h = hidden.clone().requires_grad_()
    masked_logprobs(h, parameter, targets, chunk_size=64, grad_into_weight=True, backend="triton").backward(upstream)
    torch.testing.assert_close(parameter.grad, want_weight, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h.grad, want_hidden, rtol=1e-12, atol=1e-12)
    parameter.grad = None
    h.grad = None
    _, surrogate = ops.logprobs_with_known_gradient(h, parameter, targets, upstream, chunk_size=64, backend="triton")
    surrogate.backward()
    torch.testing.assert_close(parameter.grad, want_weight, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h.grad, want_hidden, rtol=1e-12, atol=1e-12)


@needs_triton
def test_opcheck(device):
    """Schemas, fake kernels (the planner's and torch.compile's shapes) and the autograd registration."""
    hidden, weight, targets, upstream = make_inputs(5, 8, 70, device)
    lse = exact_lse(hidden, weight)
    tests = ("test_schema", "test_faketensor", "test_autograd_registration")
    opcheck(torch.ops.dllm_fast.masked_logprobs_triton, (hidden.requires_grad_(), weight, targets, 32),
            test_utils=tests)
    opcheck(torch.ops.dllm_fast.masked_logprobs_backward_triton,
            (upstream, None, hidden.detach(), weight, targets, lse, 32, [True, True]), test_utils=tests)
    opcheck(torch.ops.dllm_fast.masked_logprobs_grad_triton,
            (hidden.detach(), weight, targets, upstream, lse, torch.zeros_like(weight), 32), test_utils=tests)


@needs_triton
@pytest.mark.compile
def test_torch_compile_fullgraph(device):
    """torch.compile(fullgraph=True) keeps the Triton ops whole, forward and backward."""
    hidden, weight, targets, upstream = make_inputs(9, 8, 100, device)

    def score(h, w):
        return masked_logprobs(h, w, targets, chunk_size=64, backend="triton")

    compiled = torch.compile(score, fullgraph=True, backend="aot_eager")
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    compiled(h, w).backward(upstream)
    want = reference.masked_logprobs_grad(hidden, weight, targets, upstream)
    torch.testing.assert_close(h.grad, want[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, want[2], rtol=1e-5, atol=1e-5)


needs_gpu_triton = pytest.mark.skipif(not COMPILED, reason="needs triton compiling for a GPU")


@pytest.mark.cuda
@needs_gpu_triton
@pytest.mark.parametrize("head", ["trained", "frozen"])
def test_cuda_bf16_agrees_with_the_compiled_kernels_and_errs_at_most_twice_naive(head):
    """The compiled kernels (TMA on sm_90) at a bf16 shape of several tiles: the walk and the lean forward +
    backward against the compiled ops (the same rounding of d(logits)) and against an fp64 oracle."""
    M, d, V = 512, 256, 5000
    hidden, weight, targets, upstream = make_inputs(M, d, V, "cuda", torch.bfloat16)
    upstream = upstream.float()
    truth = reference.masked_logprobs_grad(hidden.double(), weight.double(), targets, upstream.double())
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(head == "trained")
    naive_logp = torch.log_softmax(h @ w.T, dim=-1).gather(1, targets[:, None]).squeeze(1)
    naive = (naive_logp.detach(), *torch.autograd.grad(naive_logp, (h, w) if head == "trained" else (h,),
                                                       upstream.to(torch.bfloat16)))
    lse = exact_lse(hidden.float(), weight.float())
    results = {}
    for backend in ("triton", "compiled"):
        buffer = torch.zeros_like(weight) if head == "trained" else None
        logp, grad_hidden = masked_logprobs_grad(hidden, weight, targets, upstream, lse=lse, grad_weight=buffer,
                                                 chunk_size=2048, backend=backend)
        results[backend] = (logp, grad_hidden) + ((buffer,) if buffer is not None else ())
    for ours, theirs in zip(results["triton"], results["compiled"]):
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=2e-2, atol=1e-3)
    for ours, theirs, want in zip(results["triton"], naive, truth):
        assert max_error(ours, want) <= 2 * max_error(theirs, want) + 1e-6
    h2 = hidden.clone().requires_grad_(True)
    masked_logprobs(h2, weight, targets, chunk_size=2048, backend="triton").backward(upstream)
    assert max_error(h2.grad, truth[1]) <= 2 * max_error(naive[1], truth[1]) + 1e-6


@pytest.mark.cuda
@needs_gpu_triton
def test_cuda_fp32_by_pointer_loads_matches_the_twin():
    """A width whose rows are not 16-byte aligned (no TMA): the pointer path compiled, exact fp32 dots."""
    hidden, weight, targets, upstream = make_inputs(37, 26, 300, "cuda")
    assert not triton_head.uses_tma([hidden, weight], hidden.device)
    want_logp, want_hidden, want_weight = reference.masked_logprobs_grad(hidden, weight, targets, upstream)
    buffer = torch.zeros_like(weight)
    logp, grad_hidden = masked_logprobs_grad(hidden, weight, targets, upstream, grad_weight=buffer, chunk_size=128,
                                             backend="triton")
    for got, want in ((logp, want_logp), (grad_hidden, want_hidden), (buffer, want_weight)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@needs_gpu_triton
@pytest.mark.parametrize("config", (triton_head.SM90, triton_head.SM90_SWEEP[1], triton_head.SM80),
                         ids=lambda c: c.label())
def test_the_default_configurations_compile_and_agree(config, monkeypatch):
    """The default tiles of sm_90 (grid and persistent) and sm_80: bf16 at tile-sized shapes against the compiled
    kernels (the same rounding of d(logits)), the gradients within bf16's rounding. (bench_logprob.py
    --triton-sweep checks every configuration it times the same way.)"""
    major = torch.cuda.get_device_capability()[0]
    if major < 9 and config != triton_head.SM80:
        pytest.skip("sm_90 tiles")
    monkeypatch.setenv("DLLM_FAST_TRITON_HEAD_TILES", ",".join(
        [f"{config.block_m}x{config.block_n}x{config.block_k}", str(config.group_m), str(config.num_warps),
         str(config.num_stages)] + (["persistent"] if config.persistent else [])))
    hidden, weight, targets, upstream = make_inputs(600, 256, 3000, "cuda", torch.bfloat16)
    lse = exact_lse(hidden.float(), weight.float())
    ours, theirs = torch.zeros_like(weight), torch.zeros_like(weight)
    logp, grad_hidden = masked_logprobs_grad(hidden, weight, targets, upstream, lse=lse, grad_weight=ours,
                                             chunk_size=1024, backend="triton")
    want_logp, want_hidden = masked_logprobs_grad(hidden, weight, targets, upstream, lse=lse, grad_weight=theirs,
                                                  chunk_size=1024, backend="compiled")
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_hidden.float(), want_hidden.float(), rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=2e-2, atol=2e-3)
    forward = masked_logprobs(hidden, weight, targets, chunk_size=1024, backend="triton")
    torch.testing.assert_close(forward, want_logp, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# The backend choice and its errors: run everywhere, triton or not.

def test_auto_takes_triton_for_bf16_on_a_gpu_where_it_compiles_and_compiled_otherwise(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.delenv("DLLM_FAST_BACKEND", raising=False)
    monkeypatch.setattr(backend_module, "_FOUND", {})
    monkeypatch.setattr(backend_module, "_triton_compiles", lambda device_type: device_type == "cuda")
    monkeypatch.setattr(backend_module, "has_kernel", lambda op, device_type: True)
    assert ops.choose_backend("masked_logprobs", cuda, None, triton="best") == "triton"
    assert ops.choose_backend("masked_logprobs", cuda, None, triton="able") == "compiled"  # fp32: cuBLAS's
    assert ops.choose_backend("masked_logprobs", cuda, None, triton="no") == "compiled"  # fp16, TF32
    assert ops.choose_backend("masked_logprobs", cuda, "compiled", triton="best") == "compiled"
    assert ops.choose_backend("masked_logprobs", torch.device("cpu"), None, triton="best") == "compiled"
    assert ops.choose_backend("rope", cuda, None) == "compiled"
    monkeypatch.setattr(backend_module, "_FOUND", {})
    monkeypatch.setattr(backend_module, "_triton_compiles", lambda device_type: False)  # no triton: falls back
    assert ops.choose_backend("masked_logprobs", cuda, None, triton="best") == "compiled"


def test_the_environments_triton_takes_it_where_an_op_has_it_and_chooses_as_auto_elsewhere(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(backend_module, "_FOUND", {})
    monkeypatch.setattr(backend_module, "has_kernel", lambda op, device_type: True)
    monkeypatch.setenv("DLLM_FAST_BACKEND", "triton")
    assert ops.choose_backend("masked_logprobs", cpu, None, triton="able") == "triton"
    assert ops.choose_backend("masked_logprobs", cpu, None, triton="no") == "compiled"
    assert ops.choose_backend("rope", cpu, None) == "compiled"
    with pytest.raises(ValueError, match="only masked_logprobs has Triton kernels"):
        ops.choose_backend("rope", cpu, "triton")


@needs_triton
def test_the_probe_passes_on_working_kernels_and_warns_on_wrong_ones(device, monkeypatch):
    """auto takes the Triton kernels on a GPU only after a small call of both epilogues agrees with torch: a
    kernel that compiles but computes wrong (or fails to compile) is reported once and left to the compiled ones."""
    assert triton_head._probe(device)
    original = triton_head.chunk_softmax_grad
    monkeypatch.setattr(triton_head, "chunk_softmax_grad", lambda *args: original(*args) * 1.01)
    with pytest.warns(UserWarning, match="results differ from torch's"):
        assert not triton_head._probe(device)
    monkeypatch.setattr(triton_head, "chunk_logsumexp", lambda *args: 1 / 0)
    with pytest.warns(UserWarning, match="ZeroDivisionError"):
        assert not triton_head._probe(device)


def test_what_the_triton_kernels_cannot_take_is_named():
    hidden, weight, targets, upstream = make_inputs(4, 8, 50)
    with pytest.raises(ValueError, match="not torch.float16.*backend='compiled'"):
        masked_logprobs(hidden.half(), weight.half(), targets, backend="triton")
    with pytest.raises(ValueError, match="tf32_grad_gemms=True runs on the compiled kernels only"):
        masked_logprobs_grad(hidden, weight, targets, upstream, backend="triton", tf32_grad_gemms=True)


def test_a_missing_triton_or_interpreter_is_named(monkeypatch):
    hidden, weight, targets, _ = make_inputs(4, 8, 50)
    monkeypatch.setattr(triton_head, "_triton", lambda: None)
    with pytest.raises(RuntimeError, match="need the triton package"):
        masked_logprobs(hidden, weight, targets, backend="triton")
    monkeypatch.setattr(triton_head, "_triton", lambda: object())
    monkeypatch.setattr(triton_head, "interpreting", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1 before triton is imported"):
        masked_logprobs(hidden, weight, targets, backend="triton")


def test_the_default_chunk_holds_bf16_d_logits_twice_as_wide():
    """The Triton walk's chunk buffer is d(logits) in the model's dtype: the same budget spans twice the columns
    of the compiled kernels' fp32 logits for bf16."""
    cpu = torch.device("cpu")
    assert ops.default_chunk_size(512, 126464, cpu, 2) == 2 * ops.default_chunk_size(512, 126464, cpu)
    hidden = torch.empty(8192, 4096, dtype=torch.bfloat16, device="meta")
    weight = torch.empty(126464, 4096, dtype=torch.bfloat16, device="meta")
    with backend_module.chunks_sized_for("cuda"):
        assert faces._chunk_size("triton", None, hidden, weight) == 16384
        assert faces._chunk_size("compiled", None, hidden, weight) == 8192


def test_a_tile_override_is_parsed_and_a_bad_one_named(monkeypatch):
    monkeypatch.setenv("DLLM_FAST_TRITON_HEAD_TILES", "128x128x64,8,4,4,persistent")
    assert triton_head.default_config(torch.device("cpu")) == triton_head.TileConfig(128, 128, 64, 8, 4, 4, True)
    monkeypatch.setenv("DLLM_FAST_TRITON_HEAD_TILES", "128x128,8")
    with pytest.raises(ValueError, match="DLLM_FAST_TRITON_HEAD_TILES='128x128,8'"):
        triton_head.default_config(torch.device("cpu"))


# ---------------------------------------------------------------------------------------------------------
# What the planner prices (fake tensors: no triton needed).

def test_the_planner_prices_the_triton_ops_on_fake_tensors(monkeypatch):
    """With DLLM_FAST_BACKEND=triton a plan for the H200 runs the Triton ops on fake tensors: same GEMM FLOPs as
    the compiled ops, less traffic (no fp32 logits) and less workspace; the known-gradient walk prices below
    today's, the lean forward + backward too."""
    from dllm_fast.ops import costs
    from dllm_fast.planning import predict

    monkeypatch.setenv("DLLM_FAST_BACKEND", "triton")
    triton = {p: predict.head("h200", M=8192, provider=p, backward=p == "dllm_fast")
              for p in ("dllm_fast", "dllm_grad_lse", "dllm_grad")}
    monkeypatch.setenv("DLLM_FAST_BACKEND", "compiled")
    compiled = {p: predict.head("h200", M=8192, provider=p, backward=p == "dllm_fast") for p in triton}
    for provider in triton:
        assert 0 < triton[provider].seconds < compiled[provider].seconds
        assert triton[provider].flops == compiled[provider].flops
    meta = dict(device="meta")
    hidden = torch.empty(8192, 4096, dtype=torch.bfloat16, **meta)
    weight = torch.empty(126464, 4096, dtype=torch.bfloat16, **meta)
    targets, upstream, lse = (torch.empty(8192, dtype=t, **meta) for t in (torch.long, torch.float, torch.float))
    ours = costs.workspace("masked_logprobs_grad_triton", "cuda", (hidden, weight, targets, upstream, lse, weight,
                                                                   16384))
    theirs = costs.workspace("masked_logprobs_grad", "cuda", (hidden, weight, targets, upstream, lse, weight, 8192))
    assert ours.traffic < theirs.traffic and ours.bytes < theirs.bytes
    frozen = costs.gemm_flops_by_type("masked_logprobs_grad_triton", "cuda",
                                      (hidden, weight, targets, upstream, lse, None, 16384))
    assert frozen == {(torch.bfloat16, "fp32"): 2 * 2 * 8192 * 4096 * 126464}  # the weight's GEMM skipped


@needs_triton
def test_the_declared_cpu_workspace_bounds_what_the_interpreted_walk_allocates(device):
    """costs.workspace for the CPU (the interpreter's run) covers what the walk allocates beyond its outputs."""
    from dllm_fast.ops import costs

    M, d, V, chunk = 16, 64, 2000, 256
    for dtype in (torch.float32, torch.bfloat16):
        hidden, weight, targets, upstream = make_inputs(M, d, V, dtype=dtype)
        lse = exact_lse(hidden.float(), weight.float())
        buffer = torch.zeros_like(weight)
        args = (hidden, weight, targets, upstream.float(), lse, buffer, chunk)
        with track_allocations(device) as allocated:
            torch.ops.dllm_fast.masked_logprobs_grad_triton(*args)
        outputs = M * 4 + M * d * hidden.element_size()
        declared = costs.workspace("masked_logprobs_grad_triton", "cpu", args).bytes
        assert allocated.peak - outputs <= declared


@needs_triton
def test_the_benchmarks_triton_rows_and_sweep_run(device):
    """bench_logprob.py --roofline's Triton rows and --triton-sweep (run on the next GPU loan, where a bug would
    cost the loan) in the interpreter: every run completes, the sweep's configurations agree exactly."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_logprob.py"
    spec = importlib.util.spec_from_file_location("bench_logprob_under_test", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    hidden, weight, targets, upstream = make_inputs(40, 32, 300, device, torch.bfloat16)
    lse = exact_lse(hidden.float(), weight.float())
    runs = bench.triton_runs(hidden, weight, targets, upstream, lse, torch.zeros_like(weight), [128])
    assert set(op for op, _ in runs) == set(bench.TRITON_GEMMS)
    for run in runs.values():
        run()
    rows = bench.triton_sweep(hidden, weight, targets, upstream, lse, 128, repeats=1)
    assert [row["status"] for row in rows] == ["ok", "ok"] and all(row["max_diff"] == 0 for row in rows)
