"""Likelihood estimators: pure, differentiable functions of `lp[N, n_t, L]` and the masks it was scored on.

Each returns one value per sequence, [N], at sequence scale (sums over tokens). Per-token normalisations (SPG's,
ESPO's /L, DARE's /response_len) belong to the objectives; `masks.num_counted` gives L_n for them.
`lp` is zero wherever a position is not masked or not counted (see scoring.py); the estimators read the positions
`masks.targets` marks (every scored one, except for the "trajectory" sampler's later-state context).
"""

from __future__ import annotations

import math

import torch

from dllm_fast.likelihood.masks import MonteCarloMasks, weighted_sum


def elbo(lp: torch.Tensor, masks: MonteCarloMasks) -> torch.Tensor:
    """Monte Carlo ELBO of log p(completion | prompt): [N, n_t, L] -> [N].

        ELBO_n = (1/n_t) sum_j w_j sum_i lp[n, j, i]

    with the sampler's weights w_j: 1/t for random_t (BGPO Eq. 4-5, ESPO Eq. 2), L_n/l for stratified_l
    (LLaDA; ESPO Eq. 3), (L_n+1)/|M| for complementary pairs (ESPO Eq. 34), L_n/m_j for block (SPG's code) and
    1 for mean_field (d1), K c_k / t_k for gauss (GDPO's Gauss-Legendre nodes), the coupled weights (DiffuCoder)
    and n_t for trajectory (the sum over TraceRL's states); block_elbo weighs each position by its block's
    v / l instead. For random_t, stratified_l and complementary it is an
    unbiased estimate of sum_{l=1..L_n} (1/l) E_{|M|=l}[sum_{i in M} log p(x_i | x with M masked)]. Only the
    `masks.targets` positions are read.
    """
    if masks.target is not None:
        return token_estimate(lp, masks).sum(-1)
    _check(lp, masks)
    return weighted_sum(lp, masks.weight.to(lp.dtype)).mean(-1)


def token_estimate(lp: torch.Tensor, masks: MonteCarloMasks) -> torch.Tensor:
    """The ELBO position by position: [N, n_t, L] -> [N, L], (1/n_t) sum_j w_j lp[n, j, i] on the targets.

    Summed over positions it is `elbo`. For the "coupled" sampler it is DiffuCoder's per-token log-likelihood
    estimate (Eq. 13: the full-mask and complementary-pair estimates averaged); for "gauss" the per-position
    SDMC contribution (as NeMo RL's SdmcElboEstimator.accumulate); for "mean_field" with n_t = 1, d1's lp.
    """
    _check(lp, masks)
    weighted = torch.where(masks.targets, lp, torch.zeros((), dtype=lp.dtype, device=lp.device))
    return (weighted * _per_position(masks.weight.to(lp.dtype))).sum(1) / masks.n_t


def eubo_per_position(lp: torch.Tensor, masks: MonteCarloMasks, beta: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """SPG's evidence upper bound, position by position (SPG Eq. 6; Theorem 1 / Corollary 1 in the limit).

        a_{n,i} = (1/n_t) sum_j w_j 1[i masked and counted in j] exp(beta * lp[n, j, i])
        EUBO_{n,i} = (1/beta) log a_{n,i}

    The log sits outside the Monte Carlo mean, so the estimate is consistent but biased for finite n_t (SPG
    keeps this tighter form). a is computed in log space: logsumexp_j(log w_j + beta * lp) - log n_t.
    A counted position that no sample masks has a_{n,i} = 0: it is dropped (value 0, present False), as SPG's
    code drops it; with ELBO-like samplers every position is masked in some sample once n_t is moderate.

    Returns:
        values [N, L] (0 where not present) and present [N, L] bool (counted and masked in some sample).
    """
    _check(lp, masks)
    if not beta > 0:
        raise ValueError(f"beta={beta!r} must be > 0 (SPG's bound holds for beta >= 1; 1.0 is tightest).")
    scored = masks.targets
    present = scored.any(1)
    log_weight = _per_position(masks.weight.to(lp.dtype)).log()
    terms = torch.where(scored, log_weight + beta * lp, float("-inf"))
    # Never-masked positions get finite dummies so logsumexp's gradient stays finite; they are dropped below.
    terms = torch.where(present[:, None, :], terms, torch.zeros((), dtype=lp.dtype, device=lp.device))
    log_a = torch.logsumexp(terms, dim=1) - math.log(masks.n_t)
    values = torch.where(present, log_a / beta, torch.zeros((), dtype=lp.dtype, device=lp.device))
    return values, present


def eubo(lp: torch.Tensor, masks: MonteCarloMasks, beta: float = 1.0) -> torch.Tensor:
    """SPG's EUBO(beta) at sequence scale: the sum over present positions of `eubo_per_position`, [N].

    It omits SPG's theta-independent constant, so it is *not* a pointwise upper bound on log p (see the tests:
    with L=2 one can have log p = -0.89 and EUBO(1) = -1.39); only its gradient carries the bound.
    SPG's code uses the per-token mean over present positions instead: `values.sum(-1) / present.sum(-1)`
    from `eubo_per_position`.
    """
    values, _ = eubo_per_position(lp, masks, beta)
    return values.sum(-1)


def mixture(lp: torch.Tensor, masks: MonteCarloMasks, beta: float = 1.0, omega: float = 0.5) -> torch.Tensor:
    """SPG's bound mixture (SPG Eq. 8): omega * EUBO(beta) + (1 - omega) * ELBO, [N], both at sequence scale.

    SPG's code mixes per-token means (EUBO over present positions, ELBO over L_n); dividing this by L_n matches
    it when every counted position is masked in some sample.
    """
    if not 0.0 <= omega <= 1.0:
        raise ValueError(f"omega={omega!r} must be in [0, 1] (SPG uses 0.5).")
    return omega * eubo(lp, masks, beta) + (1.0 - omega) * elbo(lp, masks)


def mean_field(lp: torch.Tensor, masks: MonteCarloMasks) -> torch.Tensor:
    """d1's one-step mean-field log-likelihood, sum_i lp[n, 0, i], [N] (masks from the "mean_field" sampler;
    BGPO Sec. 2 calls it diffu-GRPO's single-pass estimation).

    With n_t > 1 (several prompt perturbations) it averages over samples: (1/n_t) sum_j sum_i lp[n, j, i].
    """
    _check(lp, masks)
    return torch.where(masks.targets, lp, torch.zeros((), dtype=lp.dtype, device=lp.device)).sum(-1).mean(-1)


def _per_position(weight: torch.Tensor) -> torch.Tensor:
    """The masks' weights broadcastable over [N, n_t, L]: per sample [N, n_t] or per position [N, n_t, L]."""
    return weight if weight.dim() == 3 else weight[..., None]


def _check(lp: torch.Tensor, masks: MonteCarloMasks) -> None:
    if not isinstance(masks, MonteCarloMasks):
        raise TypeError(f"masks must be a MonteCarloMasks, got {type(masks).__name__}.")
    expected = (masks.num_sequences, masks.n_t, masks.completion_length)
    if not isinstance(lp, torch.Tensor) or tuple(lp.shape) != expected:
        shape = tuple(lp.shape) if isinstance(lp, torch.Tensor) else type(lp).__name__
        raise ValueError(f"lp must be [N, n_t, L] = {list(expected)} (scored on these masks), got {shape}.")
    if not lp.is_floating_point():
        raise TypeError(f"lp must be floating point, got {lp.dtype}.")
