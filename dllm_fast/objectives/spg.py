"""SPG (Sandwiched Policy Gradient; SPG paper Eqs. 5, 7, 8): the ELBO for non-negative advantages and an evidence
upper bound for negative ones, so that the surrogate bounds the GRPO objective from below.

    loss = -(1/N) sum_n A_n Lhat_n,     Lhat_n = ELBO_n if A_n >= 0, else the negative-advantage bound:
        bound="eubo": EUBO_beta,n = (1/beta) sum_i log (1/n_t) sum_j w_j 1[i scored in j] p_nji^beta   (Eq. 7)
        bound="mix":  omega EUBO_beta,n + (1 - omega) ELBO_n                                            (Eq. 8)
        bound="elbo": ELBO_n

Masks come from the "block" sampler (a random block partly masked, later blocks masked, earlier blocks and the
prompt perturbed with probability 0.15). A = r - group mean, no std. The EUBO is not a pointwise upper bound
(its theta-independent constant is dropped); only its gradient carries the bound.

normalization="paper" (default) uses the sequence-scale bounds above. normalization="token" reproduces SPG's
code: per-token means (ELBO_n / L_n; the EUBO averaged over the positions some sample masks) and the DAPO-style
weighting sum_n A_n Lhat_n |C_n| / sum_n |C_n| with |C_n| = L_n counted tokens. Not separable (the EUBO's log
sits outside the mean over samples), so it runs on the two-pass engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm_fast.likelihood import elbo, eubo_per_position
from dllm_fast.objectives.base import LossInputs, Objective, ObjectiveConfig
from dllm_fast.validation import check_choice, check_float, check_probability

BOUNDS = ("mix", "eubo", "elbo")
NORMALIZATIONS = ("paper", "token")


@dataclass
class SPGConfig(ObjectiveConfig):
    n_t: int = 2
    sampler: str = "block"
    count: str = "eos"
    block_length: int = 32
    perturb_prob: float = 0.15
    bound: str = "mix"
    beta: float = 1.0
    omega: float = 0.5
    normalization: str = "paper"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("bound", self.bound, BOUNDS)
        check_float("beta", self.beta, minimum=0.0, open_minimum=True, hint="SPG's EUBO temperature; 1.0-2.0")
        check_probability("omega", self.omega, hint="the mixture weight of the EUBO")
        check_choice("normalization", self.normalization, NORMALIZATIONS)


class SPG(Objective):
    name = "spg"
    Config = SPGConfig

    def bounds(self, lp, masks):
        """(ELBO, negative-advantage bound), [N] each, at the configured normalisation."""
        c = self.config
        token = c.normalization == "token"
        lower = elbo(lp, masks) / (masks.num_counted.to(lp.dtype) if token else 1.0)
        if c.bound == "elbo":
            return lower, lower
        values, present = eubo_per_position(lp, masks, c.beta)
        upper = values.sum(-1) / present.sum(-1).clamp_min(1) if token else values.sum(-1)
        if c.bound == "mix":
            upper = c.omega * upper + (1.0 - c.omega) * lower
        return lower, upper

    def surrogate(self, lp, inputs: LossInputs):
        lower, upper = self.bounds(lp, inputs.masks)
        advantage = inputs.advantage(lp)
        return torch.where(advantage >= 0, lower, upper), advantage, lower, upper

    def loss(self, lp, inputs: LossInputs):
        value, advantage, _, _ = self.surrogate(lp, inputs)
        if self.config.normalization == "token":
            lengths = inputs.masks.num_counted.to(lp.dtype)
            return -(advantage * value * lengths).sum() / lengths.sum()
        return -(advantage * value).mean()

    def stats(self, lp, inputs):
        _, advantage, lower, upper = self.surrogate(lp, inputs)
        negative = advantage < 0
        stats = {"elbo_mean": lower.mean(), "negative_fraction": negative.double().mean()}
        if negative.any():
            stats["upper_bound_mean"] = upper[negative].mean()
        return stats
