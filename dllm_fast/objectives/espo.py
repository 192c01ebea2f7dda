"""ESPO (ELBO-based Sequence-level Policy Optimization): a sequence-level ratio of ELBOs normalised per token,
PPO's two-sided clip, and a k2 KL on the sequence ELBO.

    rho_n = exp((ELBO_n - ELBO_old,n) / L)                         (L = the fixed completion width)
    loss = -(1/N) sum_n min(rho_n A_n, clip(rho_n, 1 - eps_low, 1 + eps_high) A_n)
           + beta sum_n (1/2) (ELBO_n - ELBO_ref,n)^2 / (N L)       (k2: quadratic, no exponential)

The ELBO is the coupled estimator with complementary masks (sampler "complementary": each pair masks a subset and
its complement, weights (L + 1) / |M|) over all L completion positions, EOS padding included (count="all"), as
ESPO's code sums them. A = r - group mean (ESPO Sec. 2.2); advantage="leave_one_out" is the code's RLOO
baseline. n_t = 4 is ESPO's "2 Monte Carlo samples", each a complementary pair of forwards.

Options of the official code (espo/espo_trainer.py): scale_rewards divides the advantages by the group std +
1e-4 (L703-716, off in its recipes); kl_estimator "k1" or "k3" instead of the trainer's hard-coded "k2"
(compute_approx_kl, L77-108, on the sequence ELBOs: k1 = d with its gradient correction d + (E - sg E)(sg d),
k3 = exp(-d) + d - 1, d = ELBO - ELBO_ref); length="counted" normalises the ratio's exponent and the KL by each
sequence's counted length L_n instead of the fixed width L (the paper's per-token normalisation read as the
response length). Presets from the recipes: "countdown" (eps 0, beta 3e-3), "sudoku" and "code" (beta 1e-2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dllm_fast.likelihood import MaskSpec, elbo
from dllm_fast.objectives.base import (LossInputs, Objective, ObjectiveConfig, check_epsilon, clipped,
                                       clipped_surrogate, mask_defaults)
from dllm_fast.validation import check_choice, check_float

KL_ESTIMATORS = ("k2", "k1", "k3")
LENGTHS = ("fixed", "counted")


@dataclass
class ESPOConfig(ObjectiveConfig):
    masks: MaskSpec = mask_defaults(n_t=4, sampler="complementary", count="all")
    epsilon_low: float = field(default=0.2, metadata={"help": "clip range below 1"})
    epsilon_high: float = field(default=0.2, metadata={"help": "clip range above 1"})
    beta: float = field(default=1e-3, metadata={"help": "KL coefficient (reference policy)"})
    std_epsilon: float = 1e-4  # the code's, when scale_rewards
    kl_estimator: str = field(default="k2", metadata={"help": "KL estimator on the sequence ELBO: k2, k1 or k3"})
    length: str = field(default="fixed", metadata={"help": "the ratio's and KL's length: fixed width L or the "
                                                           "counted length L_n"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_epsilon("epsilon_low", self.epsilon_low)
        check_epsilon("epsilon_high", self.epsilon_high)
        check_float("beta", self.beta, minimum=0.0, hint="KL coefficient")
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        check_choice("length", self.length, LENGTHS)


class ESPO(Objective):
    name = "espo"
    Config = ESPOConfig
    uses_old_policy = True
    sequence_local = True
    presets = {"countdown": dict(epsilon_low=0.0, epsilon_high=0.0, beta=3e-3), "sudoku": dict(beta=1e-2),
               "code": dict(beta=1e-2)}

    @property
    def needs_reference(self) -> bool:
        return self.config.beta > 0

    def inert_sequences(self, inputs: LossInputs):
        """Without the KL term, a zero advantage makes a sequence's term 0 whatever its ratio."""
        return inputs.advantages == 0 if self.config.beta == 0 else None

    def lengths(self, lp, masks) -> torch.Tensor | float:
        """The per-token normaliser: the fixed completion width L, or each sequence's counted length L_n."""
        return masks.num_counted.to(lp.dtype) if self.config.length == "counted" else float(masks.completion_length)

    def ratio(self, lp, inputs: LossInputs):
        masks = inputs.masks
        return torch.exp((elbo(lp, masks) - elbo(inputs.old(lp), masks)) / self.lengths(lp, masks))

    def kl(self, lp, inputs: LossInputs):
        """beta's term: sum_n k(ELBO_n, ELBO_ref,n) / (N L), k the chosen estimator on the sequence ELBOs."""
        masks = inputs.masks
        current = elbo(lp, masks)
        difference = current - elbo(inputs.ref(lp), masks)
        if self.config.kl_estimator == "k2":
            per_sequence = 0.5 * difference**2
        elif self.config.kl_estimator == "k1":  # value d; gradient (1 + d) dE, ESPO's correction term
            per_sequence = difference + (current - current.detach()) * difference.detach()
        else:  # k3 of the reference over the current policy: exp(-d) + d - 1 >= 0
            per_sequence = torch.expm1(-difference) + difference
        return (per_sequence / self.lengths(lp, masks)).sum() / masks.num_sequences

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
