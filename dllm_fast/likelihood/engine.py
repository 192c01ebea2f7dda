"""The streaming backward engine: the exact gradient of any objective of `lp`, in memory independent of n_t.

Every published objective is a differentiable function of the small tensor lp[N, n_t, L] (old and reference
log-probs on the same masks enter as constants). By the chain rule,

    d objective / d theta = sum_{n,j,i} coef[n,j,i] * d lp[n,j,i] / d theta,   coef = d objective / d lp,

so the engine (1) scores lp without a graph, (2) gets coef by autograd on lp alone, and (3) recomputes lp one
micro-batch of (sequence, sample) pairs at a time and backpropagates (coef * lp).sum(), freeing each
micro-batch's graph before the next. Peak memory is one micro-batch's graph, whatever n_t is. An objective that
is a sum of per-pair terms (BGPO's bound) needs no coef: the separable path scores and backpropagates each
micro-batch once, skipping pass 1.
"""

from __future__ import annotations

from typing import Callable

import torch

from dllm_fast.likelihood.masks import MonteCarloMasks
from dllm_fast.likelihood.scoring import active_pairs, check_inputs, score, score_pairs
from dllm_fast.reference import accumulate_dtype


def streaming_backward(
    model,
    sequences: torch.Tensor,
    masks: MonteCarloMasks,
    objective: Callable[..., torch.Tensor],
    *,
    micro_batch: int,
    attention_mask: torch.Tensor | None = None,
    separable: bool = False,
    score_micro_batch: int | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Backpropagate `objective` of the current policy's lp into the model's `.grad`, micro-batch by micro-batch.

    Gradients accumulate into `.grad` of whatever requires grad in `model` (full weights or LoRA adapters),
    exactly as `objective(score(model, ...)).backward()` would, activation checkpointing included. The model's
    forward must be deterministic (no dropout), because pass 2 recomputes what pass 1 scored.

    Args:
        model: the model contract (see `score`); the current policy.
        sequences: [N, P + L] token ids, completion in the last L positions.
        masks: stored masks from `sample_masks`; score the old and reference policies on the same object.
        objective:
            - two-pass (separable=False): `objective(lp) -> 0-dim tensor`, lp [N, n_t, L] (a leaf that requires
              grad). Any differentiable function: exp of ELBO differences, log-mean-exp EUBO, clipped ratios.
            - separable=True: `objective(lp_pairs, sequence_index, sample_index) -> 0-dim tensor` where
              lp_pairs [b, L] are the rows of b pairs, sequence_index [b] and sample_index [b] int64 say which
              (n, j) each row is (to look up advantages, old lp, weights). The full objective must be the sum of
              these calls over any partition of the N * n_t pairs, i.e. a sum of per-pair terms. Pairs with
              nothing masked are passed with all-zero rows and no model call.
        micro_batch: (sequence, sample) pairs per recomputed graph; peak memory scales with it, not with n_t.
            Pass 2 skips the pairs whose coefficients are all zero (e.g. zero advantage).
        attention_mask: optional [N, P + L], passed to the model (left-padded prompts).
        separable: take the one-pass path described above.
        score_micro_batch: pairs per model call in the no-grad pass 1 (default: micro_batch).
        chunk_size: vocabulary chunk of the fused LM head.

    Returns:
        The objective's value, a detached 0-dim tensor (fp32, or fp64 for an fp64 model).
    """
    check_inputs(model, sequences, masks, attention_mask=attention_mask, micro_batch=micro_batch)
    if not callable(objective):
        raise TypeError(f"objective must be callable, got {type(objective).__name__}.")
    if separable and score_micro_batch is not None:
        raise ValueError(f"score_micro_batch={score_micro_batch!r} sets pass 1's batch, which separable=True skips; "
                         "drop it or use separable=False.")
    if separable:
        return _separable(model, sequences, masks, objective, micro_batch, attention_mask, chunk_size)
    if score_micro_batch is not None:
        check_inputs(model, sequences, masks, micro_batch=score_micro_batch)

    with torch.no_grad():
        lp = score(model, sequences, masks, micro_batch=score_micro_batch or micro_batch,
                   attention_mask=attention_mask, chunk_size=chunk_size)
    lp.requires_grad_(True)
    with torch.enable_grad():
        loss = _scalar(objective(lp), "objective(lp)")
    value = loss.detach()
    if not loss.requires_grad:
        return value  # the objective does not depend on lp: no gradient
    (coef,) = torch.autograd.grad(loss, lp, allow_unused=True)
    if coef is None:
        return value
    # lp is a constant 0 where nothing is scored, so coef there carries no gradient.
    coef = torch.where(masks.scored, coef, torch.zeros((), dtype=coef.dtype, device=coef.device))
    if not torch.isfinite(coef).all():
        raise FloatingPointError(
            f"d objective / d lp is not finite at {int((~torch.isfinite(coef)).sum())} scored positions "
            f"(objective value {value.item()}); check the objective for overflow (e.g. exp of a large ELBO "
            "difference) before stepping."
        )
    coef_rows = coef.view(-1, masks.completion_length)
    pairs = coef_rows.ne(0).any(-1).nonzero().squeeze(-1)  # pairs whose gradient weight is zero are skipped
    with torch.enable_grad():
        for batch in pairs.split(micro_batch):
            lp_batch = score_pairs(model, sequences, masks, batch, attention_mask=attention_mask,
                                   chunk_size=chunk_size)
            if lp_batch.requires_grad:
                (coef_rows[batch] * lp_batch).sum().backward()
    return value


def _separable(model, sequences, masks, objective, micro_batch, attention_mask, chunk_size) -> torch.Tensor:
    n_t, L = masks.n_t, masks.completion_length
    dtype = accumulate_dtype(model.lm_head_weight.dtype)
    device = sequences.device
    active = active_pairs(masks)
    value = torch.zeros((), dtype=dtype, device=device)
    with torch.enable_grad():
        for batch in active.split(micro_batch):
            lp_batch = score_pairs(model, sequences, masks, batch, attention_mask=attention_mask,
                                   chunk_size=chunk_size)
            loss = _scalar(objective(lp_batch, batch // n_t, batch % n_t), "objective(lp_pairs, ...)")
            if loss.requires_grad:
                loss.backward()
            value += loss.detach()
    idle = torch.ones(masks.num_sequences * n_t, dtype=torch.bool, device=device)
    idle[active] = False
    idle = idle.nonzero().squeeze(-1)
    if idle.numel():
        with torch.no_grad():  # their lp is exactly 0 and constant: they add value, never gradient
            zeros = torch.zeros(idle.numel(), L, dtype=dtype, device=device)
            value += _scalar(objective(zeros, idle // n_t, idle % n_t), "objective(lp_pairs, ...)").detach()
    return value


def _scalar(loss, call: str) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"{call} must return a 0-dim tensor (the loss to minimise), got {got}; reduce it "
                         "with .sum() or .mean().")
    if not loss.is_floating_point():
        raise TypeError(f"{call} must return a floating-point tensor, got {loss.dtype}.")
    return loss
