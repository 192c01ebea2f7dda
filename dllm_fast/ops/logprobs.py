"""The typed faces of the fused LM-head log-prob ops (input checks, fake kernels, autograd).

- `masked_logprobs`: logp of the targets; differentiable (backward recomputes the chunks). With
  grad_into_weight=True the weight's gradient is added straight into `lm_head_weight.grad` during backward.
- `masked_logprobs_grad`: for an upstream gradient known before the forward, the gradients in one walk over the
  vocabulary, the weight's added into a caller's buffer.
- `logprobs_with_known_gradient`: the engine's pass 2 on top of it: logp, and a surrogate whose backward hands
  grad_hidden to the model body.

Backends (ops/backend.py): "compiled" runs dllm_fast::masked_logprobs, masked_logprobs_backward and
masked_logprobs_grad (the C++/CUDA kernels, cuBLAS or MKL for every GEMM, the softmax in a pass of its own over
each chunk's fp32 logits); "triton" runs their twins dllm_fast::*_triton (ops/logprobs_triton.py): the logits
GEMM in a Triton kernel whose epilogue holds the softmax (its logsumexp, or its gradient written once in bf16),
cuBLAS for the gradient GEMMs, the same schemas, semantics and rounding. None takes "triton" for bf16 CUDA
tensors where the kernels serve the GPU (ops/triton_head.py's probe), "compiled" otherwise; fp16 and the TF32
option always run compiled. `head_kernels(backend)` gives either set of ops.

Accumulating into `.grad` in place (never a second [V, d] tensor) keeps the streaming engine's memory flat when
gradients accumulate over micro-batches. The weight still gets an autograd edge: its AccumulateGrad node runs
(with no gradient) in every backward, so DDP's and FSDP2's hooks see the complete `.grad`.

Precision (every backend, CPU and CUDA alike): products accumulate in fp32 (fp64 for fp64 inputs). For bf16/fp16
inputs the backward's two gradient GEMMs take each chunk's d(logits), computed in fp32 and rounded once to the
model's dtype, with hidden and the weight as they are: bf16 tensor-core GEMMs on a GPU, as Liger's and Cut
Cross-Entropy's fused heads run them. Measured against an fp64 oracle (python_tests/test_masked_logprobs.py,
test_low_precision_error_at_most_twice_torch and its masked_logprobs_grad twin) the log-probs stay near fp32's
error and the gradients within 2x the naive bf16 path's error (its logits, softmax and gradient GEMMs all in
bf16). In fp16, d(logits) entries below fp16's smallest subnormal (6e-8 of the upstream gradient's scale) flush
to zero, as in the naive fp16 path: scale the loss (torch.amp.GradScaler) as for the rest of an fp16 model.
``tf32_grad_gemms=True`` keeps d(logits) in fp32 and runs the gradient GEMMs on fp32 operands in TF32 on CUDA
(fp32 copies of a bf16/fp16 hidden and of each weight chunk): the path before issue 28, at half bf16's
tensor-core rate and twice its bytes, for a caller that wants d(logits) unrounded. On CPU, which has no TF32, it
keeps d(logits) in fp32 and the GEMMs exact fp32. fp32 inputs run exact fp32 GEMMs (TF32 under the option, on
CUDA), fp64 inputs fp64 GEMMs.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
from torch._guards import detect_fake_mode

from dllm_fast._extension import HAS_EXTENSION, has_kernel
from dllm_fast.contracts import accumulate_dtype
from dllm_fast.ops import logprobs_triton, twins
from dllm_fast.ops.backend import FLOAT_DTYPES, choose_backend, resolve_chunk_size
from dllm_fast.validation import check_bool, check_same_device, data_checks_enabled


def masked_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int | None = None,
    backend: str | None = None,
    grad_into_weight: bool = False,
    tf32_grad_gemms: bool = False,
) -> torch.Tensor:
    """Log-probabilities of `targets` under the LM head, without materialising the [M, V] logits.

    Args:
        hidden: [M, d] final hidden states of the positions to score (fp32, fp64, bf16 or fp16).
        lm_head_weight: [V, d] LM head, same dtype and device as `hidden`.
        targets: [M] token ids in [0, V).
        chunk_size: vocabulary columns per chunk (default: sized for the device; more than V means V). Peak
            temporary memory is about M * chunk_size * 4 bytes.
        backend: None/"auto", "compiled", "triton" or "reference" (see module docstring and ops/backend.py).
        grad_into_weight: for a trainable leaf `lm_head_weight` (a parameter), backward adds the weight's
            gradient straight into `lm_head_weight.grad` (created when None) instead of returning a new [V, d]
            tensor for autograd to add: no gradient-sized temporary when gradients accumulate over several
            backwards. The upstream gradient's scale is honoured (a host's scaled loss); AccumulateGrad still
            runs, so DDP/FSDP2 hooks fire. Ignored for the reference backend and a non-leaf or frozen weight.
            A backward that does not accumulate into the weight's `.grad` is honoured: `torch.autograd.grad`
            gets the weight's gradient as a new tensor (`.grad` untouched), and `backward(inputs=...)` without
            the weight leaves `.grad` alone.
        tf32_grad_gemms: the backward's gradient GEMMs on fp32 d(logits) and fp32 operands in TF32 (CUDA; exact
            fp32 on CPU) instead of d(logits) rounded to the model's dtype (see the module docstring: the
            accuracy and cost of each). Not for fp64 inputs.

    Returns:
        logp: [M], ``log_softmax(hidden @ lm_head_weight.T)[i, targets[i]]`` in fp32 (fp64 for fp64 inputs).
        Differentiable with respect to `hidden` and `lm_head_weight`; backward recomputes the logits chunk by
        chunk. A target outside [0, V) yields NaN on every device and backend (checking would cost a host sync
        on CUDA), and no gradient flows back through it.
        The compiled backend has no second derivative (create_graph=True through it raises); the reference
        backend has.
    """
    _check_masked_logprobs(hidden, lm_head_weight, targets)
    targets = targets.long()
    check_bool("grad_into_weight", grad_into_weight)
    _check_tf32_grad_gemms("masked_logprobs", tf32_grad_gemms, hidden.dtype)
    choice = choose_backend("masked_logprobs", hidden.device, backend,
                            triton=_triton_fit("masked_logprobs", backend, hidden.dtype, tf32_grad_gemms))
    chunk_size = _chunk_size(choice, chunk_size, hidden, lm_head_weight)
    if choice == "reference":
        return twins.masked_logprobs(hidden, lm_head_weight, targets)
    kernels = head_kernels(choice)
    if grad_into_weight and trainable_leaf(lm_head_weight) and torch.is_grad_enabled():
        return _WeightGradInPlace.apply(hidden.contiguous(), lm_head_weight, targets.contiguous(), chunk_size,
                                        tf32_grad_gemms, kernels)
    logp, _ = kernels.forward(hidden.contiguous(), lm_head_weight.contiguous(), targets.contiguous(), chunk_size,
                              tf32_grad_gemms)
    return logp


def masked_logprobs_grad(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    grad_logp: torch.Tensor,
    *,
    lse: torch.Tensor | None = None,
    grad_weight: torch.Tensor | None = None,
    chunk_size: int | None = None,
    backend: str | None = None,
    tf32_grad_gemms: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``sum(grad_logp * logp)`` for an upstream gradient known before the forward, in one walk
    over the vocabulary (three GEMMs per chunk: the logits, grad_hidden, grad_weight's rows); not differentiable.

    Args:
        hidden, lm_head_weight, targets, chunk_size, backend, tf32_grad_gemms: as for `masked_logprobs` (no graph
            is recorded).
        grad_logp: [M], d loss / d logp.
        lse: [M] the rows' logsumexp when it is known (fp32, fp64 for fp64 inputs), e.g. ``hidden . W[target] -
            logp`` for a logp scored earlier; None computes it first (one more GEMM per chunk). It is verified
            wherever values may be read (not under torch.compile, fake tensors or ``values_checked()``, where it
            is trusted): before the walk, every row's must be finite and at least its target's logit (a
            logsumexp is at least each of its terms), else ValueError and nothing is written; after it, the walk's
            measured normaliser S (1 for an exact lse) says how far each row's lse was off, and a row off by more
            than the inputs' rounding (LSE_TOLERANCE: 1e-4 for fp32, 1e-10 fp64, 2**-8 bf16, 2**-11 fp16) is
            recomputed with its exact logsumexp, grad_weight corrected (an lse too low first adds that row's
            softmax part S times too large, whose rounding, about the dtype's eps times S, stays; fp16 overflows
            for S above 16). Within the tolerance logp and grad_hidden are exact and grad_weight's softmax part is
            off by a relative S - 1.
        grad_weight: a [V, d] tensor of lm_head_weight's shape, dtype and device (contiguous, not requiring grad),
            e.g. its `.grad`: the weight's gradient is added into it in place. None: not computed. An input that
            shares memory with it (hidden, targets, grad_logp or lse viewing its storage) is copied first; the
            weight itself may not share it.

    Returns:
        (logp [M], grad_hidden [M, d]): logp in fp32 (fp64 for fp64 inputs), grad_hidden in hidden's dtype. A
        target outside [0, V) gives logp NaN and passes no gradient back, as `masked_logprobs` does.

    The compiled path runs the op's own kernel on CPU and CUDA (never a [V, d] temporary). A device whose build
    lacks it takes the composite of the masked_logprobs forward and backward kernels instead (exact lse, four
    GEMMs per chunk, and one [V, d] temporary added into grad_weight). The Triton path (backend="triton", the
    default for bf16 on CUDA) runs the same walk with the softmax gradient in the logits GEMM's epilogue, and
    skips the weight's GEMM when grad_weight is None (a frozen head).
    """
    _check_grad_weight_type(grad_weight)
    _check_masked_logprobs(hidden, lm_head_weight, targets)
    _check_tf32_grad_gemms("masked_logprobs_grad", tf32_grad_gemms, hidden.dtype)
    choice = choose_backend("masked_logprobs", hidden.device, backend,
                            triton=_triton_fit("masked_logprobs_grad", backend, hidden.dtype, tf32_grad_gemms))
    chunk_size = _chunk_size(choice, chunk_size, hidden, lm_head_weight)
    acc = accumulate_dtype(hidden.dtype)
    rows = hidden.shape[0]
    check_same_device("masked_logprobs_grad", hidden=hidden, grad_logp=grad_logp, lse=lse, grad_weight=grad_weight)
    if grad_logp.shape != (rows,) or not grad_logp.is_floating_point():
        raise ValueError(f"masked_logprobs_grad: grad_logp must be a floating-point [M] = [{rows}] tensor (one "
                         f"upstream gradient per row), got {grad_logp.dtype} {tuple(grad_logp.shape)}.")
    if lse is not None and (lse.shape != (rows,) or lse.dtype != acc):
        raise ValueError(f"masked_logprobs_grad: lse must be a {acc} [M] = [{rows}] tensor, got {lse.dtype} "
                         f"{tuple(lse.shape)}; pass None to compute it.")
    if grad_weight is not None:
        _check_grad_weight(grad_weight, lm_head_weight)
        hidden, targets, grad_logp, lse = _unshared_with(grad_weight, lm_head_weight, hidden=hidden,
                                                         targets=targets, grad_logp=grad_logp, lse=lse)
    hidden, weight = hidden.detach(), lm_head_weight.detach()
    targets, grad_logp = targets.long(), grad_logp.detach().to(acc)
    if choice == "reference":
        logp, grad_hidden, weight_grad = twins.masked_logprobs_grad(hidden, weight, targets, grad_logp)
        if grad_weight is not None:
            grad_weight.add_(weight_grad)
        return logp, grad_hidden
    hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.contiguous()
    kernels = head_kernels(choice)
    if choice == "compiled" and not has_kernel("masked_logprobs_grad", hidden.device.type):
        return _composite_grad(hidden, weight, targets, grad_logp, grad_weight, chunk_size, tf32_grad_gemms)
    verify = lse is not None and data_checks_enabled(hidden, weight, lse)
    if verify:
        target_logit, rounding = _target_logits(hidden, weight, targets)
        slack = rounding + LSE_TOLERANCE[hidden.dtype]  # per row: how far lse may be off and pass
        _check_lse_bounds(lse, target_logit, slack, targets, weight.shape[0])
    logp, grad_hidden = kernels.grad(
        hidden, weight, targets, grad_logp.contiguous(), None if lse is None else lse.contiguous(), grad_weight,
        chunk_size, tf32_grad_gemms)
    if verify:
        rows = _rows_off(lse, target_logit, slack, targets, logp, weight.shape[0])
        if rows.numel():
            _recompute_rows(rows, hidden, weight, targets, grad_logp, lse, grad_weight, chunk_size, tf32_grad_gemms,
                            logp, grad_hidden, kernels)
    return logp, grad_hidden


class HeadKernels(NamedTuple):
    """One backend's three LM-head ops, with the schemas of dllm_fast::masked_logprobs, masked_logprobs_backward
    and masked_logprobs_grad (csrc/include/dllm_fast/schemas.h)."""

    forward: Callable
    backward: Callable
    grad: Callable


def head_kernels(backend: str) -> HeadKernels:
    """The LM-head ops of `backend` ("compiled" or "triton"), looked up in torch.ops on each call (a dictionary
    filled lazily would be a global that torch.compile guards on, recompiling once it fills)."""
    suffix = "_triton" if backend == "triton" else ""
    ops = torch.ops.dllm_fast
    return HeadKernels(getattr(ops, "masked_logprobs" + suffix), getattr(ops, "masked_logprobs_backward" + suffix),
                       getattr(ops, "masked_logprobs_grad" + suffix))


def _triton_fit(op: str, backend, dtype: torch.dtype, tf32_grad_gemms: bool) -> str:
    """How well the Triton kernels fit a call (backend.choose_backend's `triton`): "best" for bf16, "able" for
    fp32/fp64, "no" for fp16 or the TF32 option. An explicit backend='triton' they cannot take is refused here."""
    fits = dtype in logprobs_triton.DTYPES and not tf32_grad_gemms
    if (backend == "triton") and not fits:
        reason = ("tf32_grad_gemms=True runs on the compiled kernels only" if tf32_grad_gemms else
                  f"the Triton kernels take {', '.join(str(t) for t in logprobs_triton.DTYPES)}, not {dtype} (fp16's "
                  "d(logits) need the compiled kernels' power-of-two scaling)")
        raise ValueError(f"{op}: backend='triton' was requested, but {reason}; pass backend='compiled' or None.")
    if not fits:
        return "no"
    return "best" if dtype == torch.bfloat16 else "able"


def _chunk_size(choice: str, chunk_size, hidden, weight) -> int:
    """The chunk to run with: the Triton walk's default chunk holds d(logits) in the model's dtype (2 bytes an
    entry for bf16) where the compiled kernels' holds fp32 logits (4)."""
    entry = hidden.element_size() if choice == "triton" else 4
    return resolve_chunk_size("masked_logprobs", chunk_size, hidden.shape[0], weight.shape[0], hidden.device, entry)


# A row whose given lse was off by more than this (|log S| for the walk's measured normaliser S), by the inputs'
# dtype, is recomputed: its grad_weight part would be off by a relative S - 1. For fp32 and fp64 well above the
# rounding of an lse computed from the same hidden states (about 1e-6 in fp32); for bf16 and fp16 their unit
# roundoff, the rounding d(logits) gets anyway: a logp scored in another micro-batch, whose bf16 hidden states
# differ in their last bits, is not walked twice.
LSE_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _target_logits(hidden, weight, targets) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's target logit in the accumulator type (that of the clamped id for a target outside [0, V)), and
    a bound on how far the kernel's own GEMM may round it differently: a few ulps of sum |h_k W_tk|."""
    acc = accumulate_dtype(hidden.dtype)
    rows = weight[targets.clamp(0, weight.shape[0] - 1)].to(acc)
    products = hidden.to(acc) * rows
    eps = torch.finfo(acc).eps
    return products.sum(-1), 4 * hidden.shape[1] ** 0.5 * eps * products.abs().sum(-1)


def _check_lse_bounds(lse, target_logit, slack, targets, vocab) -> None:
    """Before the walk (nothing written yet): a finite lse at least the target's logit in every row."""
    inside = (targets >= 0) & (targets < vocab)
    bad = ~torch.isfinite(lse) | (inside & (lse < target_logit - slack))
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        value, logit = float(lse[row]), float(target_logit[row])
        reason = ("is not finite" if not math.isfinite(value) else
                  f"is below that row's target logit {logit:.6g}, but a logsumexp is at least each of its logits")
        raise ValueError(f"masked_logprobs_grad: lse[{row}] = {value!r} {reason}: it is not the logsumexp of "
                         f"hidden[{row}] @ lm_head_weight.T. Pass the lse of these hidden states (e.g. "
                         f"hidden . W[target] - logp for a logp scored on them), or lse=None to compute it.")


def _rows_off(lse, target_logit, slack, targets, logp, vocab) -> torch.Tensor:
    """After the walk: the rows whose measured normaliser S (the walk's logp = target logit - lse - log S) says
    their lse was off by more than the tolerance (one host sync)."""
    inside = (targets >= 0) & (targets < vocab)
    log_s = target_logit - lse - logp
    return (inside & ~(log_s.abs() <= slack)).nonzero().squeeze(1)


def _recompute_rows(rows, hidden, weight, targets, grad_logp, lse, grad_weight, chunk_size, tf32, logp,
                    grad_hidden, kernels: HeadKernels | None = None) -> None:
    """Rows whose lse was off get exact logp and grad_hidden, and grad_weight the difference between their true
    and their added gradient, in place.

    The walk added g (onehot - S p) for such a row (p its softmax) where g (onehot - p) was due: the difference
    g (S - 1) p is added by a walk with upstream -g (S - 1) and the exact logsumexp, which adds
    -g (S - 1) (onehot - p), plus g (S - 1) h into the target's row."""
    kernels = kernels or head_kernels("compiled")
    h, t, g = hidden[rows], targets[rows], grad_logp[rows]
    exact_lse = kernels.forward(h, weight, t, chunk_size)[1]
    logp[rows], grad_hidden[rows] = kernels.grad(h, weight, t, g, exact_lse, None, chunk_size, tf32)
    if grad_weight is not None:
        excess = g * (torch.exp(exact_lse - lse[rows]) - 1)  # g (S - 1)
        kernels.grad(h, weight, t, -excess, exact_lse, grad_weight, chunk_size, tf32)
        grad_weight.index_add_(0, t, (excess[:, None] * h.to(excess.dtype)).to(grad_weight.dtype))


def _check_tf32_grad_gemms(op: str, value, dtype: torch.dtype) -> None:
    check_bool(f"{op}: tf32_grad_gemms", value)
    if value and dtype == torch.float64:
        raise ValueError(f"{op}: tf32_grad_gemms=True asks for TF32 gradient GEMMs, but the inputs are float64, whose "
                         "GEMMs run in fp64; pass tf32_grad_gemms=False (or fp32 inputs).")


def _check_grad_weight_type(grad_weight) -> None:
    if grad_weight is not None and not isinstance(grad_weight, torch.Tensor):
        raise TypeError(f"masked_logprobs_grad: grad_weight must be a torch.Tensor (e.g. lm_head_weight.grad), got "
                        f"{type(grad_weight).__module__}.{type(grad_weight).__name__}; its memory is added into in "
                        "place, so wrap an array with torch.from_numpy(array) (sharing its memory), or pass None.")


def _check_grad_weight(grad_weight: torch.Tensor, weight: torch.Tensor) -> None:
    if grad_weight.shape != weight.shape or grad_weight.dtype != weight.dtype:
        raise ValueError(f"masked_logprobs_grad: grad_weight must match lm_head_weight ({weight.dtype} "
                         f"{tuple(weight.shape)}), got {grad_weight.dtype} {tuple(grad_weight.shape)}.")
    if not grad_weight.is_contiguous():
        raise ValueError("masked_logprobs_grad: grad_weight must be contiguous (its rows are updated in place chunk "
                         "by chunk); pass the .grad of a contiguous parameter, or None.")
    if grad_weight.requires_grad:
        raise ValueError("masked_logprobs_grad: grad_weight requires grad, but the op adds into it in place outside "
                         "autograd; pass a buffer that does not, e.g. lm_head_weight.grad (or grad_weight.detach(), "
                         "which shares its memory), or None.")
    if _has_memory(grad_weight) and shares_memory(grad_weight, weight):
        raise ValueError("masked_logprobs_grad: grad_weight shares memory with lm_head_weight, which the walk reads "
                         "while it adds into grad_weight; pass a separate buffer such as lm_head_weight.grad.")


def _unshared_with(buffer: torch.Tensor, weight: torch.Tensor, **inputs):
    """The inputs, each copied when it shares memory with `buffer` (the walk writes the buffer while it reads
    them): their values at the call. A compiled graph or fake tensors have no addresses to compare: as given."""
    if not _has_memory(buffer):
        return tuple(inputs.values())
    return tuple(None if t is None else (t.clone() if shares_memory(t, buffer) else t) for t in inputs.values())


def _has_memory(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s addresses can be read here: not while torch.compile traces, not for fake or meta ones."""
    return not torch.compiler.is_compiling() and not tensor.is_meta and detect_fake_mode([tensor]) is None


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes two tensors span (from their first to their last element) overlap."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t):
        start = t.data_ptr()
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0)
        return start, start + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _composite_grad(hidden, weight, targets, grad_logp, grad_weight, chunk_size, tf32_grad_gemms=False):
    """masked_logprobs_grad from the forward and backward kernels, for a device whose build lacks its kernel."""
    logp, lse = torch.ops.dllm_fast.masked_logprobs(hidden, weight, targets, chunk_size)
    grad_hidden, weight_grad = torch.ops.dllm_fast.masked_logprobs_backward(
        grad_logp, None, hidden, weight, targets, lse, chunk_size, [True, grad_weight is not None], tf32_grad_gemms)
    if grad_weight is not None:
        grad_weight.add_(weight_grad)
    return logp, grad_hidden


def logprobs_with_known_gradient(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    grad_logp: torch.Tensor,
    *,
    logp: torch.Tensor | None = None,
    chunk_size: int | None = None,
    backend: str | None = None,
    tf32_grad_gemms: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The LM head's part of a backward whose upstream gradient d loss / d logp is known before the forward (the
    streaming engine's pass 2), computed during the forward.

    The weight's gradient is added now into `lm_head_weight.grad` (created when None) for a trainable leaf
    weight, kept for the backward otherwise; `surrogate.backward()` then hands grad_hidden to whatever
    produced `hidden` (the model body) and runs the weight's AccumulateGrad node (with no gradient, so DDP/FSDP2
    hooks fire on the complete `.grad`). Backpropagate the surrogate once, with a unit upstream gradient (a
    scaled loss would scale grad_hidden but not the weight's gradient already added): use `masked_logprobs(...,
    grad_into_weight=True)` under a host's scaled backward.

    Args:
        hidden: [M, d] rows to score, typically part of the body's graph.
        lm_head_weight, targets, chunk_size, backend, tf32_grad_gemms: as for `masked_logprobs`.
        grad_logp: [M] d loss / d logp of each row.
        logp: [M] the rows' log-probs when already known (scored earlier on the same hidden states): their
            logsumexp follows from one dot product per row, and the walk needs three GEMMs per chunk instead of
            four. None: computed. Verified as masked_logprobs_grad verifies its lse (a logp above 0 is refused;
            rows scored on other hidden states are recomputed).

    Returns:
        (logp [M] detached, surrogate): the rows' log-probs under this forward and a 0-dim tensor whose value is
        sum(grad_logp * logp) and whose gradient is the loss's.
    """
    acc = accumulate_dtype(hidden.dtype)
    lse = None
    if logp is not None:
        if logp.shape != targets.shape:
            raise ValueError(f"logprobs_with_known_gradient: logp must be [M] = [{targets.shape[0]}] (one known "
                             f"log-prob per row), got shape {tuple(logp.shape)}.")
        rows = lm_head_weight.detach()[targets.long()].to(acc)
        lse = (hidden.detach().to(acc) * rows).sum(-1) - logp.detach().to(acc)
    weight_trains = lm_head_weight.requires_grad and torch.is_grad_enabled()
    in_place = weight_trains and trainable_leaf(lm_head_weight)
    buffer = weight_grad_buffer(lm_head_weight) if in_place else (
        torch.zeros_like(lm_head_weight) if weight_trains else None)
    logp_now, grad_hidden = masked_logprobs_grad(hidden, lm_head_weight, targets, grad_logp, lse=lse,
                                                 grad_weight=buffer, chunk_size=chunk_size, backend=backend,
                                                 tf32_grad_gemms=tf32_grad_gemms)
    held = None if in_place else buffer
    surrogate = _KnownGradientSurrogate.apply(hidden, lm_head_weight, grad_hidden, held,
                                              (grad_logp.detach().to(acc) * logp_now).sum())
    return logp_now, surrogate


def trainable_leaf(tensor: torch.Tensor) -> bool:
    """Whether gradients of `tensor` accumulate into its own `.grad`: a leaf that requires grad."""
    return tensor.requires_grad and tensor.is_leaf


def weight_grad_buffer(weight: torch.Tensor) -> torch.Tensor:
    """`weight.grad`, created as zeros when it is None: the buffer that in-place accumulation adds into."""
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight, memory_format=torch.contiguous_format)
    return weight.grad


class _KnownGradientSurrogate(torch.autograd.Function):
    """A 0-dim value whose backward gives hidden `grad_hidden` and the weight its held gradient (None when it
    was added into .grad already): the edge to the weight keeps its AccumulateGrad node in the graph."""

    @staticmethod
    def forward(ctx, hidden, weight, grad_hidden, held_weight_grad, value):
        ctx.save_for_backward(grad_hidden)
        ctx.held_weight_grad = held_weight_grad
        return value.clone()

    @staticmethod
    def backward(ctx, upstream):
        (grad_hidden,) = ctx.saved_tensors
        held = ctx.held_weight_grad
        grad_weight = None if held is None else held * upstream
        grad_hidden = (grad_hidden * upstream).to(grad_hidden.dtype) if ctx.needs_input_grad[0] else None
        return grad_hidden, grad_weight, None, None, None


class _WeightGradInPlace(torch.autograd.Function):
    """masked_logprobs whose backward adds the weight's gradient into `weight.grad` and returns none for it, when
    the backward accumulates into `.grad` (`.backward()`): `torch.autograd.grad` gets it as a tensor instead."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, tf32_grad_gemms, kernels):
        logp, lse = kernels.forward(hidden, weight, targets, chunk_size, tf32_grad_gemms)
        ctx.save_for_backward(hidden, targets, lse)
        ctx.weight, ctx.chunk_size, ctx.tf32 = weight, chunk_size, tf32_grad_gemms  # the parameter itself
        ctx.kernels = kernels
        # Held (autograd keeps it weakly) to ask the backward whether it accumulates into .grad. A compiled graph
        # (likelihood/compiled.py) runs under .backward() only, and cannot trace the question: None.
        ctx.accumulate_grad = None if torch.compiler.is_compiling() else accumulate_grad_node(weight)
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        hidden, targets, lse = ctx.saved_tensors
        if torch.is_grad_enabled():
            raise RuntimeError(_NO_DOUBLE_BACKWARD)
        weight, chunk_size = ctx.weight.detach(), ctx.chunk_size
        into_grad = ctx.needs_input_grad[1] and (ctx.accumulate_grad is None
                                                 or _backward_accumulates(ctx.accumulate_grad))
        if ctx.needs_input_grad[1] and into_grad is None:  # torch.autograd.grad: return it, leave .grad alone
            grad_hidden, grad_weight = ctx.kernels.backward(
                grad_logp, None, hidden, weight, targets, lse, chunk_size, [ctx.needs_input_grad[0], True], ctx.tf32)
            return (grad_hidden if ctx.needs_input_grad[0] else None), grad_weight, None, None, None, None
        buffer = weight_grad_buffer(ctx.weight) if into_grad else None
        # lse comes from this op's own forward on the same tensors: exact, nothing to verify.
        _, grad_hidden = ctx.kernels.grad(
            hidden, weight, targets, grad_logp.to(lse.dtype).contiguous(), lse, buffer, chunk_size, ctx.tf32)
        return (grad_hidden if ctx.needs_input_grad[0] else None), None, None, None, None, None


def accumulate_grad_node(parameter: torch.Tensor):
    """The AccumulateGrad node of a leaf that requires grad (the node DDP hooks), found through a view of it."""
    with torch.enable_grad():
        return parameter.view_as(parameter).grad_fn.next_functions[0][0]


def _backward_accumulates(node) -> bool | None:
    """Whether the running backward executes the weight's AccumulateGrad node (True: `.backward()` adds into its
    `.grad`; False: `backward(inputs=...)` without the weight), or None under `torch.autograd.grad`, which returns
    gradients instead of accumulating them (autograd cannot say there which inputs it captures)."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return None


_NO_DOUBLE_BACKWARD = (
    "masked_logprobs: the compiled backend has no second derivative, so a backward with create_graph=True "
    "(double backward, e.g. a gradient penalty) cannot go through it; pass backend='reference' to "
    "masked_logprobs for higher-order gradients.")


def _check_masked_logprobs(hidden, weight, targets) -> None:
    """Check the tensor arguments."""
    check_same_device("masked_logprobs", hidden=hidden, lm_head_weight=weight, targets=targets)
    if hidden.dim() != 2:
        raise ValueError(
            f"masked_logprobs: hidden must be [M, d], got shape {tuple(hidden.shape)}; "
            "select the positions to score and flatten them into rows first."
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"masked_logprobs: lm_head_weight must be [V, d] with d = {hidden.shape[1]} (hidden's width), "
            f"got shape {tuple(weight.shape)}."
        )
    if hidden.shape[1] == 0 or weight.shape[0] == 0:
        raise ValueError(f"masked_logprobs: the hidden width d and the vocabulary V must be positive, got "
                         f"d = {hidden.shape[1]} and V = {weight.shape[0]}.")
    if targets.shape != (hidden.shape[0],):
        raise ValueError(
            f"masked_logprobs: targets must be [M] = [{hidden.shape[0]}] (one id per row of hidden), "
            f"got shape {tuple(targets.shape)}."
        )
    if hidden.dtype not in FLOAT_DTYPES or weight.dtype != hidden.dtype:
        raise TypeError(
            f"masked_logprobs: hidden and lm_head_weight must share one of {FLOAT_DTYPES}, got "
            f"{hidden.dtype} and {weight.dtype}; cast with .to(dtype)."
        )
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"masked_logprobs: targets must be int64 (or int32) token ids, got {targets.dtype}; "
                        "pass targets.long().")


if HAS_EXTENSION:

    @torch.library.register_fake("dllm_fast::masked_logprobs")
    def _masked_logprobs_fake(hidden, weight, targets, chunk_size, tf32_grad_gemms=False):
        acc = accumulate_dtype(hidden.dtype)
        rows = hidden.shape[0]
        return hidden.new_empty(rows, dtype=acc), hidden.new_empty(rows, dtype=acc)

    @torch.library.register_fake("dllm_fast::masked_logprobs_backward")
    def _masked_logprobs_backward_fake(grad_logp, grad_lse, hidden, weight, targets, lse, chunk_size, output_mask,
                                       tf32_grad_gemms=False):
        grad_hidden = torch.empty_like(hidden) if output_mask[0] else None
        grad_weight = torch.empty_like(weight) if output_mask[1] else None
        return grad_hidden, grad_weight

    def _masked_logprobs_setup_context(ctx, inputs, output):
        hidden, weight, targets, chunk_size, *option = inputs
        _, lse = output
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_size, ctx.tf32 = chunk_size, bool(option and option[0])

    def _masked_logprobs_backward(ctx, grad_logp, grad_lse):
        hidden, weight, targets, lse = ctx.saved_tensors
        if torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (grad_logp, grad_lse, hidden, weight)):
            raise RuntimeError(_NO_DOUBLE_BACKWARD)
        grad_hidden, grad_weight = torch.ops.dllm_fast.masked_logprobs_backward(
            grad_logp, grad_lse, hidden, weight, targets, lse, ctx.chunk_size,
            [ctx.needs_input_grad[0], ctx.needs_input_grad[1]], ctx.tf32,
        )
        return grad_hidden, grad_weight, None, None, None

    torch.library.register_autograd(
        "dllm_fast::masked_logprobs", _masked_logprobs_backward, setup_context=_masked_logprobs_setup_context
    )

    @torch.library.register_fake("dllm_fast::masked_logprobs_grad")
    def _masked_logprobs_grad_fake(hidden, weight, targets, grad_logp, lse, grad_weight, chunk_size,
                                   tf32_grad_gemms=False):
        return hidden.new_empty(hidden.shape[0], dtype=accumulate_dtype(hidden.dtype)), torch.empty_like(hidden)
