"""diffu-GRPO (d1; Zhao et al. 2025): token-level PPO on one-step mean-field log-probs, with a k3 KL.

    loss = sum_{n,j,i} s_nji * l_nji / sum s            (normalization="token", d1's code)
    l_nji = -min(rho A_n, clip(rho, 1 - eps, 1 + eps) A_n) + beta * k3,   rho = exp(lp - lp_old)
    k3 = exp(lp_ref - lp) - (lp_ref - lp) - 1

lp comes from the "mean_field" sampler: the whole completion masked, each prompt token masked with probability
0.15 (d1's prompt perturbation); s marks the scored tokens (through the first EOS). A_n = r_n - mean of its group,
no std (d1's code logs the std but never divides by it). The paper was not available; d1's official code is the
reference (../shared/notes/objectives.md). normalization="sequence" takes each sequence's token mean first, then
the mean over sequences (GRPO's form). Separable: every term belongs to one (sequence, sample) pair.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm_fast.objectives.base import (LossInputs, Objective, ObjectiveConfig, check_epsilon, clipped,
                                       clipped_surrogate, kl_k3)
from dllm_fast.validation import check_choice, check_float

NORMALIZATIONS = ("token", "sequence")


@dataclass
class DiffuGRPOConfig(ObjectiveConfig):
    n_t: int = 1
    sampler: str = "mean_field"
    count: str = "eos"
    perturb_prob: float = 0.15
    epsilon: float = 0.5
    beta: float = 0.04
    normalization: str = "token"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_epsilon("epsilon", self.epsilon)
        check_float("beta", self.beta, minimum=0.0, hint="KL coefficient")
        check_choice("normalization", self.normalization, NORMALIZATIONS)


class DiffuGRPO(Objective):
    name = "diffu_grpo"
    Config = DiffuGRPOConfig
    uses_old_policy = True
    separable = True

    @property
    def needs_reference(self) -> bool:
        return self.config.beta > 0

    def extra(self, batch, masks):
        scored = masks.scored
        if self.config.normalization == "token":
            per_sequence = scored.sum().clamp_min(1).expand(masks.num_sequences)
            return {"denominator": per_sequence.double()}
        return {"denominator": scored.sum((1, 2)).clamp_min(1).double() * masks.num_sequences}

    def token_terms(self, lp, old, ref, advantage, scored):
        """Per-token loss terms l (0 where not scored), the ratio and the clip indicator."""
        c = self.config
        ratio = torch.exp(lp - old)
        terms = -clipped_surrogate(ratio, advantage, c.epsilon, c.epsilon)
        if c.beta > 0:
            terms = terms + c.beta * kl_k3(ref - lp)
        zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
        return torch.where(scored, terms, zero), ratio, clipped(ratio, advantage, c.epsilon, c.epsilon) & scored

    def pair_loss(self, lp_pairs, sequence, sample, inputs: LossInputs):
        masks = inputs.masks
        scored = masks.scored[sequence, sample]
        old = inputs.old(lp_pairs) if inputs.lp_old is None else inputs.lp_old[sequence, sample].to(lp_pairs.dtype)
        ref = inputs.lp_ref[sequence, sample].to(lp_pairs.dtype) if self.config.beta > 0 else None
        advantage = inputs.advantage(lp_pairs)[sequence, None]
        terms, _, _ = self.token_terms(lp_pairs, old, ref, advantage, scored)
        denominator = inputs.extra["denominator"].to(lp_pairs.dtype)[sequence]
        return (terms.sum(-1) / denominator).sum()

    def stats(self, lp, inputs):
        scored = inputs.masks.scored
        old = inputs.old(lp)
        ref = inputs.ref(lp) if self.config.beta > 0 else None
        _, ratio, clip = self.token_terms(lp, old, ref, inputs.advantage(lp)[:, None, None], scored)
        tokens = scored.sum().clamp_min(1)
        stats = {"ratio_mean": ratio[scored].mean(), "ratio_max": ratio[scored].max(),
                 "clip_fraction": clip.sum() / tokens}
        if ref is not None:
            stats["kl"] = torch.where(scored, kl_k3(ref - lp), 0.0).sum() / tokens
        return stats
