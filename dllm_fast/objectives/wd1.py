"""wd1 (Tang et al. 2025): ratio-free weighted log-likelihood with group softmax weights.

    w+_i = softmax_i(A) and w-_i = softmax_i(-A) within each group of G completions
    loss = (1 / #groups) sum_groups sum_i (-w+_i + w-_i) log pi_i,    log pi_i = sum_j sum_t lp_ijt / n_t

log pi is d1's one-step mean-field estimate summed over the counted tokens (no length normalisation), A_i =
r_i - group mean. No ratio, no clip, no KL. The paper was not available; wd1's official code is the reference
(its per-device micro-batch is one group, so its dim-0 softmax is a group softmax; here groups are explicit).
A zero-std group has w+ = w- and contributes nothing. Separable: linear in lp with constant weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm_fast.objectives.base import LossInputs, Objective, ObjectiveConfig


@dataclass
class WD1Config(ObjectiveConfig):
    n_t: int = 1
    sampler: str = "mean_field"
    count: str = "eos"
    perturb_prob: float = 0.15


class WD1(Objective):
    name = "wd1"
    Config = WD1Config
    separable = True

    def extra(self, batch, masks):
        advantages = self.advantages(batch).to(batch.sequences.device).view(-1, batch.group_size)
        positive, negative = advantages.softmax(-1), (-advantages).softmax(-1)
        coefficient = (negative - positive).reshape(-1) / batch.num_groups  # d loss / d log pi_i
        return {"coefficient": coefficient, "positive_weight": positive.reshape(-1)}

    def pair_loss(self, lp_pairs, sequence, sample, inputs: LossInputs):
        coefficient = inputs.extra["coefficient"].to(lp_pairs.dtype)[sequence]
        return (coefficient * lp_pairs.sum(-1)).sum() / inputs.masks.n_t

    def stats(self, lp, inputs):
        log_pi = lp.sum(-1).mean(-1)
        return {"log_likelihood_mean": log_pi.mean(),
                "positive_weight_max": inputs.extra["positive_weight"].max()}
