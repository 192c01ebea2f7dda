"""Plain-PyTorch twin of the likelihood engine: the naive Monte Carlo ELBO / EUBO that keeps every graph.

All N * n_t noisy copies go through the model in one batch, the full [N * n_t, P + L, V] logits go through
log_softmax, and the per-token log-probs are gathered: what LLaDA's get_log_likelihood.py and the RL trainers
built on it do. Memory grows linearly with n_t. It is the test oracle for dllm_fast.likelihood.score and the
"naive" provider of benchmarks/bench_elbo.py. `masks` is any object with dllm_fast.likelihood.MonteCarloMasks'
fields (masked [N, n_t, P + L], counted [N, L], weight [N, n_t] or [N, n_t, L], prompt_length).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dllm_fast.contracts import accumulate_dtype, logit_shift


def noisy_sequences(sequences: torch.Tensor, masked: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """[N, S] clean tokens and [N, n_t, S] masks -> [N, n_t, S] inputs with the masked tokens replaced."""
    return sequences[:, None, :].masked_fill(masked, mask_token_id)


def score_naive(model, sequences: torch.Tensor, masks, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """lp [N, n_t, L]: log p(x_i | noisy_{n,j}) at masked and counted completion positions, 0 elsewhere.

    One forward over all pairs, full logits, log_softmax in fp32 (fp64 for fp64 models); differentiable and
    keeps the whole graph.
    """
    N, n_t, S = masks.masked.shape
    P = masks.prompt_length
    inputs = noisy_sequences(sequences, masks.masked, model.mask_token_id).reshape(N * n_t, S)
    mask = None if attention_mask is None else attention_mask[:, None, :].expand(N, n_t, S).reshape(N * n_t, S)
    hidden = model(inputs, attention_mask=mask)
    logits = F.linear(hidden, model.lm_head_weight)  # LLaDAModel.logits: [N * n_t, S, V]
    logp = torch.log_softmax(logits.to(accumulate_dtype(logits.dtype)), dim=-1)
    targets = sequences[:, None, P:].expand(N, n_t, S - P).reshape(N * n_t, S - P)
    shift = logit_shift(model)  # logits at i - shift predict token i
    lp = logp[:, P - shift:S - shift].gather(-1, targets[..., None]).squeeze(-1).view(N, n_t, S - P)
    scored = masks.masked[..., P:] & masks.counted[:, None, :]
    return torch.where(scored, lp, torch.zeros((), dtype=lp.dtype, device=lp.device))


def read_positions(masks) -> torch.Tensor:
    """[N, n_t, L] bool: the positions an estimate reads, the masks' `target` when they narrow the scored ones
    (TraceRL's states), else every masked and counted completion position."""
    target = getattr(masks, "target", None)
    return masks.masked[..., masks.prompt_length:] & masks.counted[:, None, :] if target is None else target


def mc_elbo(lp: torch.Tensor, masks) -> torch.Tensor:
    """[N]: (1/n_t) sum_j w_j sum_i lp[n, j, i], written as the per-sample loop of LLaDA's evaluator."""
    total = torch.zeros(lp.shape[0], dtype=lp.dtype, device=lp.device)
    if getattr(masks, "target", None) is not None:  # lp is 0 off the scored positions: only targets narrow it
        lp = lp * masks.target
    weight = masks.weight.to(lp.dtype)
    for j in range(lp.shape[1]):
        if weight.dim() == 3:  # a weight per position (block_elbo)
            total = total + (weight[:, j] * lp[:, j]).sum(-1)
        else:
            total = total + weight[:, j] * lp[:, j].sum(-1)
    return total / lp.shape[1]


def mc_eubo(lp: torch.Tensor, masks, beta: float = 1.0) -> torch.Tensor:
    """[N]: (1/beta) sum_i log((1/n_t) sum_j w_j 1[i scored in j] p^beta), positions never scored dropped.

    Direct (not log-space) form of SPG's estimator, as SPG's code computes it.
    """
    scored = read_positions(masks)
    weight = masks.weight.to(lp.dtype)
    weight = weight if weight.dim() == 3 else weight[..., None]
    a = (weight * scored * torch.exp(beta * lp)).mean(1)  # [N, L]
    present = scored.any(1)
    return torch.where(present, torch.log(torch.where(present, a, 1.0)), 0.0).sum(-1) / beta
