"""ESPO (ELBO-based Sequence-level Policy Optimization): a sequence-level ratio of ELBOs normalised per token,
PPO's two-sided clip, and a k2 KL on the sequence ELBO.

    rho_n = exp((ELBO_n - ELBO_old,n) / L)                         (L = the fixed completion width)
    loss = -(1/N) sum_n min(rho_n A_n, clip(rho_n, 1 - eps_low, 1 + eps_high) A_n)
           + beta sum_n (1/2) (ELBO_n - ELBO_ref,n)^2 / (N L)       (k2: quadratic, no exponential)

The ELBO is the coupled estimator with complementary masks (sampler "complementary": each pair masks a subset and
its complement, weights (L + 1) / |M|) over all L completion positions, EOS padding included (count="all"), as
ESPO's code sums them. A = r - group mean (ESPO Sec. 2.2); advantage="leave_one_out" is the code's RLOO
baseline. n_t = 4 is ESPO's "2 Monte Carlo samples", each a complementary pair of forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm_fast.likelihood import elbo
from dllm_fast.objectives.advantages import BASELINES, group_advantages
from dllm_fast.objectives.base import LossInputs, Objective, ObjectiveConfig, check_epsilon, clipped, clipped_surrogate
from dllm_fast.validation import check_choice, check_float


@dataclass
class ESPOConfig(ObjectiveConfig):
    n_t: int = 4
    sampler: str = "complementary"
    count: str = "all"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 1e-3
    advantage: str = "mean"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_epsilon("epsilon_low", self.epsilon_low)
        check_epsilon("epsilon_high", self.epsilon_high)
        check_float("beta", self.beta, minimum=0.0, hint="KL coefficient")
        check_choice("advantage", self.advantage, BASELINES)


class ESPO(Objective):
    name = "espo"
    Config = ESPOConfig
    uses_old_policy = True

    @property
    def needs_reference(self) -> bool:
        return self.config.beta > 0

    def advantages(self, batch):
        return group_advantages(batch.rewards, batch.group_size, baseline=self.config.advantage)

    def ratio(self, lp, inputs: LossInputs):
        masks = inputs.masks
        return torch.exp((elbo(lp, masks) - elbo(inputs.old(lp), masks)) / masks.completion_length)

    def kl(self, lp, inputs: LossInputs):
        masks = inputs.masks
        difference = elbo(lp, masks) - elbo(inputs.ref(lp), masks)
        return (0.5 * difference**2).sum() / (masks.num_sequences * masks.completion_length)

    def loss(self, lp, inputs: LossInputs):
        c = self.config
        surrogate = clipped_surrogate(self.ratio(lp, inputs), inputs.advantage(lp), c.epsilon_low, c.epsilon_high)
        value = -surrogate.mean()
        if c.beta > 0:
            value = value + c.beta * self.kl(lp, inputs)
        return value

    def stats(self, lp, inputs):
        c = self.config
        ratio = self.ratio(lp, inputs)
        clip = clipped(ratio, inputs.advantage(lp), c.epsilon_low, c.epsilon_high)
        stats = {"ratio_mean": ratio.mean(), "ratio_max": ratio.max(), "clip_fraction": clip.double().mean(),
                 "elbo_mean": elbo(lp, inputs.masks).mean()}
        if c.beta > 0:
            stats["kl"] = self.kl(lp, inputs)
        return stats
