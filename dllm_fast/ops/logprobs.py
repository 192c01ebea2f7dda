"""The typed faces of the fused LM-head log-prob ops (input checks, fake kernels, autograd).

- `masked_logprobs`: logp of the targets; differentiable (backward recomputes the chunks). With
  grad_into_weight=True the weight's gradient is added straight into `lm_head_weight.grad` during backward.
- `masked_logprobs_grad`: for an upstream gradient known before the forward, the gradients in one walk over the
  vocabulary, the weight's added into a caller's buffer.
- `logprobs_with_known_gradient`: the engine's pass 2 on top of it: logp, and a surrogate whose backward hands
  grad_hidden to the model body.

Accumulating into `.grad` in place (never a second [V, d] tensor) keeps the streaming engine's memory flat when
gradients accumulate over micro-batches. The weight still gets an autograd edge: its AccumulateGrad node runs
(with no gradient) in every backward, so DDP's and FSDP2's hooks see the complete `.grad`.
"""

from __future__ import annotations

import torch

from dllm_fast import reference
from dllm_fast._extension import HAS_EXTENSION, has_kernel
from dllm_fast.contracts import accumulate_dtype
from dllm_fast.ops.backend import FLOAT_DTYPES, choose_backend, resolve_chunk_size
from dllm_fast.validation import check_bool, check_same_device


def masked_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int | None = None,
    backend: str | None = None,
    grad_into_weight: bool = False,
) -> torch.Tensor:
    """Log-probabilities of `targets` under the LM head, without materialising the [M, V] logits.

    Args:
        hidden: [M, d] final hidden states of the positions to score (fp32, fp64, bf16 or fp16).
        lm_head_weight: [V, d] LM head, same dtype and device as `hidden`.
        targets: [M] token ids in [0, V).
        chunk_size: vocabulary columns per chunk (default: sized for the device; more than V means V). Peak
            temporary memory is about M * chunk_size * 4 bytes.
        backend: None/"auto", "compiled" or "reference" (see module docstring).
        grad_into_weight: for a trainable leaf `lm_head_weight` (a parameter), backward adds the weight's
            gradient straight into `lm_head_weight.grad` (created when None) instead of returning a new [V, d]
            tensor for autograd to add: no gradient-sized temporary when gradients accumulate over several
            backwards. The upstream gradient's scale is honoured (a host's scaled loss); AccumulateGrad still
            runs, so DDP/FSDP2 hooks fire. Ignored for the reference backend and a non-leaf or frozen weight.

    Returns:
        logp: [M], ``log_softmax(hidden @ lm_head_weight.T)[i, targets[i]]`` in fp32 (fp64 for fp64 inputs).
        Differentiable with respect to `hidden` and `lm_head_weight`; backward recomputes the logits chunk by
        chunk. A target outside [0, V) yields NaN on every device and backend (checking would cost a host sync
        on CUDA), and no gradient flows back through it.
        The compiled backend has no second derivative (create_graph=True through it raises); the reference
        backend has.
    """
    chunk_size = _check_masked_logprobs(hidden, lm_head_weight, targets, chunk_size)
    targets = targets.long()
    check_bool("grad_into_weight", grad_into_weight)
    if choose_backend("masked_logprobs", hidden.device, backend) == "reference":
        return reference.masked_logprobs(hidden, lm_head_weight, targets)
    if grad_into_weight and trainable_leaf(lm_head_weight) and torch.is_grad_enabled():
        return _WeightGradInPlace.apply(hidden.contiguous(), lm_head_weight, targets.contiguous(), chunk_size)
    logp, _ = torch.ops.dllm_fast.masked_logprobs(
        hidden.contiguous(), lm_head_weight.contiguous(), targets.contiguous(), chunk_size
    )
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``sum(grad_logp * logp)`` for an upstream gradient known before the forward, in one walk
    over the vocabulary (three GEMMs per chunk: the logits, grad_hidden, grad_weight's rows); not differentiable.

    Args:
        hidden, lm_head_weight, targets, chunk_size, backend: as for `masked_logprobs` (no graph is recorded).
        grad_logp: [M], d loss / d logp.
        lse: [M] the rows' logsumexp when it is known (fp32, fp64 for fp64 inputs), e.g. ``hidden . W[target] -
            logp`` for a logp scored earlier; None computes it first (one more GEMM per chunk). The walk measures
            the true normaliser S as it goes, so logp and grad_hidden come out exact even when lse is off by a
            little; grad_weight's softmax part is then off by a relative S - 1 (about 1e-6 in fp32 when lse
            comes from the same hidden states).
        grad_weight: a [V, d] buffer of lm_head_weight's shape, dtype and device (contiguous), e.g. its `.grad`:
            the weight's gradient is added into it in place. None: not computed.

    Returns:
        (logp [M], grad_hidden [M, d]): logp in fp32 (fp64 for fp64 inputs), grad_hidden in hidden's dtype. A
        target outside [0, V) gives logp NaN and passes no gradient back, as `masked_logprobs` does.

    The compiled path runs the op's own kernel on CPU and CUDA (never a [V, d] temporary). A device whose build
    lacks it takes the composite of the masked_logprobs forward and backward kernels instead (exact lse, four
    GEMMs per chunk, and one [V, d] temporary added into grad_weight).
    """
    chunk_size = _check_masked_logprobs(hidden, lm_head_weight, targets, chunk_size)
    acc = accumulate_dtype(hidden.dtype)
    rows = hidden.shape[0]
    check_same_device("masked_logprobs_grad", hidden=hidden, grad_logp=grad_logp, lse=lse, grad_weight=grad_weight)
    if grad_logp.shape != (rows,) or not grad_logp.is_floating_point():
        raise ValueError(f"masked_logprobs_grad: grad_logp must be a floating-point [M] = [{rows}] tensor (one "
                         f"upstream gradient per row), got {grad_logp.dtype} {tuple(grad_logp.shape)}.")
    if lse is not None and (lse.shape != (rows,) or lse.dtype != acc):
        raise ValueError(f"masked_logprobs_grad: lse must be a {acc} [M] = [{rows}] tensor, got {lse.dtype} "
                         f"{tuple(lse.shape)}; pass None to compute it.")
    if grad_weight is not None and (grad_weight.shape != lm_head_weight.shape
                                    or grad_weight.dtype != lm_head_weight.dtype):
        raise ValueError(f"masked_logprobs_grad: grad_weight must match lm_head_weight ({lm_head_weight.dtype} "
                         f"{tuple(lm_head_weight.shape)}), got {grad_weight.dtype} {tuple(grad_weight.shape)}.")
    if grad_weight is not None and not grad_weight.is_contiguous():
        raise ValueError("masked_logprobs_grad: grad_weight must be contiguous (its rows are updated in place chunk "
                         "by chunk); pass the .grad of a contiguous parameter, or None.")
    hidden, weight = hidden.detach(), lm_head_weight.detach()
    targets, grad_logp = targets.long(), grad_logp.detach().to(acc)
    if choose_backend("masked_logprobs", hidden.device, backend) == "reference":
        logp, grad_hidden, weight_grad = reference.masked_logprobs_grad(hidden, weight, targets, grad_logp)
        if grad_weight is not None:
            grad_weight.add_(weight_grad)
        return logp, grad_hidden
    if has_kernel("masked_logprobs_grad", hidden.device.type):
        return torch.ops.dllm_fast.masked_logprobs_grad(
            hidden.contiguous(), weight.contiguous(), targets.contiguous(), grad_logp.contiguous(),
            None if lse is None else lse.contiguous(), grad_weight, chunk_size)
    return _composite_grad(hidden.contiguous(), weight.contiguous(), targets.contiguous(), grad_logp, grad_weight,
                           chunk_size)


def _composite_grad(hidden, weight, targets, grad_logp, grad_weight, chunk_size):
    """masked_logprobs_grad from the forward and backward kernels, for a device whose build lacks its kernel."""
    logp, lse = torch.ops.dllm_fast.masked_logprobs(hidden, weight, targets, chunk_size)
    grad_hidden, weight_grad = torch.ops.dllm_fast.masked_logprobs_backward(
        grad_logp, None, hidden, weight, targets, lse, chunk_size, [True, grad_weight is not None])
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
        lm_head_weight, targets, chunk_size, backend: as for `masked_logprobs`.
        grad_logp: [M] d loss / d logp of each row.
        logp: [M] the rows' log-probs when already known (scored earlier on the same hidden states): their
            logsumexp follows from one dot product per row, and the walk needs three GEMMs per chunk instead of
            four. None: computed.

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
                                                 grad_weight=buffer, chunk_size=chunk_size, backend=backend)
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
    """masked_logprobs whose backward adds the weight's gradient into `weight.grad` and returns none for it."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size):
        logp, lse = torch.ops.dllm_fast.masked_logprobs(hidden, weight, targets, chunk_size)
        ctx.save_for_backward(hidden, targets, lse)
        ctx.weight, ctx.chunk_size = weight, chunk_size  # the parameter itself, whose .grad receives the gradient
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        hidden, targets, lse = ctx.saved_tensors
        if torch.is_grad_enabled():
            raise RuntimeError(_NO_DOUBLE_BACKWARD)
        buffer = weight_grad_buffer(ctx.weight) if ctx.needs_input_grad[1] else None
        _, grad_hidden = masked_logprobs_grad(hidden, ctx.weight, targets, grad_logp, lse=lse, grad_weight=buffer,
                                              chunk_size=ctx.chunk_size, backend="compiled")
        return (grad_hidden if ctx.needs_input_grad[0] else None), None, None, None


_NO_DOUBLE_BACKWARD = (
    "masked_logprobs: the compiled backend has no second derivative, so a backward with create_graph=True "
    "(double backward, e.g. a gradient penalty) cannot go through it; pass backend='reference' to "
    "masked_logprobs for higher-order gradients.")


def _check_masked_logprobs(hidden, weight, targets, chunk_size) -> int:
    """Check the arguments; returns the chunk size to run with."""
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
    return resolve_chunk_size("masked_logprobs", chunk_size, hidden.shape[0], weight.shape[0], hidden.device)


if HAS_EXTENSION:

    @torch.library.register_fake("dllm_fast::masked_logprobs")
    def _masked_logprobs_fake(hidden, weight, targets, chunk_size):
        acc = accumulate_dtype(hidden.dtype)
        rows = hidden.shape[0]
        return hidden.new_empty(rows, dtype=acc), hidden.new_empty(rows, dtype=acc)

    @torch.library.register_fake("dllm_fast::masked_logprobs_backward")
    def _masked_logprobs_backward_fake(grad_logp, grad_lse, hidden, weight, targets, lse, chunk_size, output_mask):
        grad_hidden = torch.empty_like(hidden) if output_mask[0] else None
        grad_weight = torch.empty_like(weight) if output_mask[1] else None
        return grad_hidden, grad_weight

    def _masked_logprobs_setup_context(ctx, inputs, output):
        hidden, weight, targets, chunk_size = inputs
        _, lse = output
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_size = chunk_size

    def _masked_logprobs_backward(ctx, grad_logp, grad_lse):
        hidden, weight, targets, lse = ctx.saved_tensors
        if torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (grad_logp, grad_lse, hidden, weight)):
            raise RuntimeError(_NO_DOUBLE_BACKWARD)
        grad_hidden, grad_weight = torch.ops.dllm_fast.masked_logprobs_backward(
            grad_logp, grad_lse, hidden, weight, targets, lse, ctx.chunk_size,
            [ctx.needs_input_grad[0], ctx.needs_input_grad[1]],
        )
        return grad_hidden, grad_weight, None, None

    torch.library.register_autograd(
        "dllm_fast::masked_logprobs", _masked_logprobs_backward, setup_context=_masked_logprobs_setup_context
    )

    @torch.library.register_fake("dllm_fast::masked_logprobs_grad")
    def _masked_logprobs_grad_fake(hidden, weight, targets, grad_logp, lse, grad_weight, chunk_size):
        return hidden.new_empty(hidden.shape[0], dtype=accumulate_dtype(hidden.dtype)), torch.empty_like(hidden)
