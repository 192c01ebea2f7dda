"""diffu-GRPO (d1; Zhao et al. 2025): token-level PPO on one-step mean-field log-probs, with a k3 KL.

    loss = sum_{n,j,i} s_nji * l_nji / sum s            (normalization="token", d1's code)
    l_nji = -min(rho A_n, clip(rho, 1 - eps, 1 + eps) A_n) + beta * k3,   rho = exp(lp - lp_old)
    k3 = exp(lp_ref - lp) - (lp_ref - lp) - 1

lp comes from the "mean_field" sampler: the whole completion masked, each prompt token masked with probability
0.15 (d1's prompt perturbation); s marks the scored tokens (through the first EOS). A_n = r_n - mean of its group,
no std (d1's code logs the std but never divides by it). The paper was not available; d1's official code is the
reference (../shared/notes/objectives.md). normalization="sequence" takes each sequence's token mean first, then
the mean over sequences (GRPO's form). Separable: every term belongs to one (sequence, sample) pair.

Options reproducing the official code and DARE's re-implementation:
- normalize_per="micro_batch": d1's trainer (diffu_grpo_trainer.py L121) divides by the scored tokens of each
  device micro-batch, and gradient accumulation then averages the micro-batches; micro_batch_rows sequences per
  micro-batch (required in that mode; d1's per_device_train_batch_size is 6, one group).
- dual_clip=c: for A < 0 the surrogate is bounded below by c A (DARE's compute_policy_loss,
  verl/trainer/ppo/dllm_core_algos.py L382-454: pg_losses3 = -A c, taken where A < 0; c = 3).
- scale_rewards=True: A = (r - mean) / (std + std_epsilon), verl's GRPO advantage that DARE's d1 recipe uses
  (algorithm.adv_estimator=grpo). preset="dare" sets DARE's recipe: eps 0.2, dual clip 3, std-scaled advantages,
  no KL, and normalization="sequence" (its micro-batch of one sequence makes the token mean a sequence mean).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dllm_fast.likelihood import MaskSpec
from dllm_fast.objectives.base import (LossInputs, NORMALIZE_PER, Objective, ObjectiveConfig, check_dual_clip,
                                       check_epsilon, check_micro_batch_rows, clipped, clipped_surrogate, dual_clipped,
                                       kl_k3, mask_defaults, micro_batch_index, micro_batch_sums)
from dllm_fast.validation import check_choice, check_float

NORMALIZATIONS = ("token", "sequence")


@dataclass
class DiffuGRPOConfig(ObjectiveConfig):
    masks: MaskSpec = mask_defaults(n_t=1, sampler="mean_field", count="eos", perturb_prob=0.15)
    epsilon: float = field(default=0.5, metadata={"help": "PPO clip range"})
    beta: float = field(default=0.04, metadata={"help": "k3 KL coefficient (reference policy)"})
    normalization: str = field(default="token", metadata={"help": "token: mean over scored tokens; sequence: "
                                                                  "mean of each sequence's token mean"})
    normalize_per: str = field(default="batch", metadata={"help": "batch, or micro_batch as d1's code (each "
                                                                  "micro-batch normalised, then averaged)"})
    micro_batch_rows: int | None = field(default=None, metadata={"help": "sequences per normalisation "
                                                                         "micro-batch (required with micro_batch)"})
    dual_clip: float | None = field(default=None, metadata={"help": "DARE's dual clip c > 1 for A < 0 (3)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_epsilon("epsilon", self.epsilon)
        check_float("beta", self.beta, minimum=0.0, hint="KL coefficient")
        check_choice("normalization", self.normalization, NORMALIZATIONS)
        check_choice("normalize_per", self.normalize_per, NORMALIZE_PER)
        check_micro_batch_rows(self.micro_batch_rows, self.normalize_per == "micro_batch",
                               "normalize_per='micro_batch'")
        check_dual_clip(self.dual_clip)


class DiffuGRPO(Objective):
    name = "diffu_grpo"
    Config = DiffuGRPOConfig
    uses_old_policy = True
    separable = True
    presets = {"dare": dict(epsilon=0.2, dual_clip=3.0, scale_rewards=True, beta=0.0, normalization="sequence")}

    @property
    def needs_reference(self) -> bool:
        return self.config.beta > 0

    def extra(self, batch, masks):
        """The denominator of each sequence's terms: its micro-batch's scored tokens (token) or its own times
        the micro-batch's sequences (sequence), times the number of micro-batches (their losses are averaged)."""
        c = self.config
        per_micro_batch = c.normalize_per == "micro_batch"
        index = micro_batch_index(masks, c.micro_batch_rows if per_micro_batch else None)
        tokens = masks.scored.sum((1, 2)).double()
        chunks = int(index.max()) + 1
        if c.normalization == "token":
            denominator = micro_batch_sums(tokens, index).clamp_min(1)
        else:
            denominator = tokens.clamp_min(1) * micro_batch_sums(torch.ones_like(tokens), index)
        return {"denominator": denominator * chunks}

    def token_terms(self, lp, old, ref, advantage, scored):
        """Per-token loss terms l (0 where not scored), the ratio, the clip and the dual-clip indicators."""
        c = self.config
        ratio = torch.exp(lp - old)
        gain = clipped_surrogate(ratio, advantage, c.epsilon, c.epsilon)
        clip = clipped(ratio, advantage, c.epsilon, c.epsilon) & scored
        dual = torch.zeros_like(scored)
        if c.dual_clip is not None:
            gain, dual = dual_clipped(gain, advantage, c.dual_clip)
            dual = dual & scored
        terms = -gain
        if c.beta > 0:
            terms = terms + c.beta * kl_k3(ref - lp)
        zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
        return torch.where(scored, terms, zero), ratio, clip, dual

    def pair_loss(self, lp_pairs, sequence, sample, inputs: LossInputs):
        masks = inputs.masks
        scored = masks.scored[sequence, sample]
        old = inputs.old(lp_pairs) if inputs.lp_old is None else inputs.lp_old[sequence, sample].to(lp_pairs.dtype)
        ref = inputs.lp_ref[sequence, sample].to(lp_pairs.dtype) if self.config.beta > 0 else None
        advantage = inputs.advantage(lp_pairs)[sequence, None]
        terms, _, _, _ = self.token_terms(lp_pairs, old, ref, advantage, scored)
        denominator = inputs.extra["denominator"].to(lp_pairs.dtype)[sequence]
        return (terms.sum(-1) / denominator).sum()

    def stats(self, lp, inputs):
        scored = inputs.masks.scored
        old = inputs.old(lp)
        ref = inputs.ref(lp) if self.config.beta > 0 else None
        _, ratio, clip, dual = self.token_terms(lp, old, ref, inputs.advantage(lp)[:, None, None], scored)
        tokens = scored.sum().clamp_min(1)
        stats = {"ratio_mean": ratio[scored].mean(), "ratio_max": ratio[scored].max(),
                 "clip_fraction": clip.sum() / tokens}
        if self.config.dual_clip is not None:
            stats["dual_clip_fraction"] = dual.sum() / tokens
        if ref is not None:
            stats["kl"] = torch.where(scored, kl_k3(ref - lp), 0.0).sum() / tokens
        return stats
