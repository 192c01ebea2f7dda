"""masked_logprobs: the typed face of the fused LM-head log-prob op (input checks, fake kernel, autograd)."""

from __future__ import annotations

import torch

from dllm_fast import reference
from dllm_fast._extension import HAS_EXTENSION
from dllm_fast.contracts import accumulate_dtype
from dllm_fast.ops.backend import FLOAT_DTYPES, choose_backend, resolve_chunk_size
from dllm_fast.validation import check_same_device


def masked_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Log-probabilities of `targets` under the LM head, without materialising the [M, V] logits.

    Args:
        hidden: [M, d] final hidden states of the positions to score (fp32, fp64, bf16 or fp16).
        lm_head_weight: [V, d] LM head, same dtype and device as `hidden`.
        targets: [M] token ids in [0, V).
        chunk_size: vocabulary columns per chunk (default: sized for the device; more than V means V). Peak
            temporary memory is about M * chunk_size * 4 bytes.
        backend: None/"auto", "compiled" or "reference" (see module docstring).

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
    if choose_backend("masked_logprobs", hidden.device, backend) == "reference":
        return reference.masked_logprobs(hidden, lm_head_weight, targets)
    logp, _ = torch.ops.dllm_fast.masked_logprobs(
        hidden.contiguous(), lm_head_weight.contiguous(), targets.contiguous(), chunk_size
    )
    return logp


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
            raise RuntimeError(
                "masked_logprobs: the compiled backend has no second derivative, so a backward with "
                "create_graph=True (double backward, e.g. a gradient penalty) cannot go through it; pass "
                "backend='reference' to masked_logprobs for higher-order gradients.")
        grad_hidden, grad_weight = torch.ops.dllm_fast.masked_logprobs_backward(
            grad_logp, grad_lse, hidden, weight, targets, lse, ctx.chunk_size,
            [ctx.needs_input_grad[0], ctx.needs_input_grad[1]],
        )
        return grad_hidden, grad_weight, None, None

    torch.library.register_autograd(
        "dllm_fast::masked_logprobs", _masked_logprobs_backward, setup_context=_masked_logprobs_setup_context
    )
