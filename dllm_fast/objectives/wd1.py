"""wd1 (Tang et al. 2025): ratio-free weighted log-likelihood with group softmax weights.

    w+_i = softmax_i(psi A) and w-_i = softmax_i(-psi A) within each group of G completions
    loss = (1 / #groups) sum_groups sum_i (-w+_i + w-_i) log pi_i,    log pi_i = sum_j sum_t lp_ijt / n_t

log pi is d1's one-step mean-field estimate summed over the counted tokens (no length normalisation), A_i =
r_i - group mean. No ratio, no clip, no KL. The paper was not available; wd1's official code is the reference
(its per-device micro-batch is one group, so its dim-0 softmax is a group softmax; here groups are explicit).
A zero-std group has w+ = w- and contributes nothing. Separable: linear in lp with constant weights.

Options: psi, the inverse temperature of the weights (the paper's psi in w proportional to exp(psi A); the
official code fixes it at 1, rev_grpo_trainer.py L117-160); negative_term=False drops the w- term, the code's
positive-only variant (trainer_type "wll_d1_pos_only").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dllm_fast.likelihood import MaskSpec
from dllm_fast.objectives.base import LossInputs, Objective, ObjectiveConfig, mask_defaults
from dllm_fast.validation import check_bool, check_float


@dataclass
class WD1Config(ObjectiveConfig):
    masks: MaskSpec = mask_defaults(n_t=1, sampler="mean_field", count="eos", perturb_prob=0.15)
    psi: float = field(default=1.0, metadata={"help": "inverse temperature of the softmax(psi A) weights"})
    negative_term: bool = field(default=True, metadata={"help": "false: the positive-only variant (no w- term)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float("psi", self.psi, minimum=0.0, open_minimum=True, hint="wd1's weight temperature; 1 in its code")
        check_bool("negative_term", self.negative_term)


class WD1(Objective):
    name = "wd1"
    Config = WD1Config
    separable = True

    def extra(self, batch, masks):
        scaled = self.config.psi * self.advantages(batch).to(batch.sequences.device).view(-1, batch.group_size)
        positive, negative = scaled.softmax(-1), (-scaled).softmax(-1)
        if not self.config.negative_term:
            negative = negative.new_zeros(())
        coefficient = (negative - positive).reshape(-1) / batch.num_groups  # d loss / d log pi_i
        return {"coefficient": coefficient, "positive_weight": positive.reshape(-1)}

    def pair_loss(self, lp_pairs, sequence, sample, inputs: LossInputs):
        coefficient = inputs.extra["coefficient"].to(lp_pairs.dtype)[sequence]
        return (coefficient * lp_pairs.sum(-1)).sum() / inputs.masks.n_t

    def stats(self, lp, inputs):
        log_pi = lp.sum(-1).mean(-1)
        return {"log_likelihood_mean": log_pi.mean(),
                "positive_weight_max": inputs.extra["positive_weight"].max()}
