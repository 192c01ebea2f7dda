"""CJ-GRPO (Yang et al. 2025, "Taming Masked Diffusion Language Models via Consistency Trajectory Reinforcement
Learning with Fewer Decoding Steps"; yjyddq/EOSER-ASS-RL cj-grpo/): GRPO on the rollout's own decoding
trajectory, every denoising step a state, each token scored once, in the state where the rollout unmasked it.

    lp_nsi = log softmax(f_theta(x_ns))[x_n,s+1,i]     i in U_ns, the positions step s of rollout n unmasked
    l_nsi = -min(rho A_n, clip(rho, 1 - eps, 1 + eps) A_n) + beta k3(lp_ref - lp),  rho = exp(lp - lp_old)
    normalization="step" (official, cj_grpo_trainer_*.py compute_loss):
        loss = (1/K) sum_s [sum_n sum_{i in U_ns} l_nsi / sum_n |U_ns|]   (the steps pooled over the rows)
    normalization="transition" (DARE's loss with its one-row micro-batches, and the paper's reference in DARE's
        test_cj_block_parallel.py): each (row, step) transition's token mean, then the mean over the row's
        transitions, then over the rows.

x_ns is the canvas before step s (the "trajectory" sampler with shrink 1, replaying the batch's `unmask_step` from
generate(..., record_unmask_step=True): the positions unmasked at or after step s masked), scored at temperature
1 as the official code scores it. count="all": every completion position is an action, EOS padding included (the
official code builds a completion mask and never applies it; DARE's response mask is all ones). A_n = r_n - the
group mean, no std; k3 against the reference (the base model: PEFT's adapters disabled, or ref_model), beta 0.04;
eps 0.5 (the official slurm_scripts/train.yaml, d1's values). Under "step", a step is identified by the forward
that ran it (unmask_step), so rows decoded by the same generate call share it; K is the number of steps holding a
token, and micro_batch_rows pools and averages per micro-batch of that many rows (the official per-device batch,
6; None: the whole batch). The two normalisations agree when every row unmasks the same number of tokens at every
step (LLaDA's even split, ASS); they differ under a threshold or on prompts of mixed block alignment.

preset="dare" (DARE's llada_dp_actor_cj_grpo.py with verl's loss): eps 0.2, dual clip 3, the GRPO z-score, no
KL, normalization="transition". DARE's step_merge (one state per block, a skip-step approximation) is shrink=
steps per block. The decoders CJ-GRPO rolls out with are generate's options unmask_schedule="ass" and eos_schedule
(EOSER; the official (0.01, 1.0)): `train --unmask-schedule ass --diffusion-steps none --eos-schedule 0.01 1.0`.
Separable: a sum of per-state terms, one scoring pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dllm_fast.likelihood import MaskSpec
from dllm_fast.objectives.base import (LossInputs, Objective, ObjectiveConfig, check_dual_clip, check_epsilon,
                                       check_micro_batch_rows, clipped, clipped_surrogate, dual_clipped, kl_k3,
                                       mask_defaults, micro_batch_index)
from dllm_fast.validation import check_choice, check_float

NORMALIZATIONS = ("step", "transition")


@dataclass
class CJGRPOConfig(ObjectiveConfig):
    masks: MaskSpec = mask_defaults(n_t=1, sampler="trajectory", count="all", shrink=1)
    epsilon: float = field(default=0.5, metadata={"help": "PPO clip range"})
    beta: float = field(default=0.04, metadata={"help": "k3 KL coefficient (reference policy)"})
    normalization: str = field(default="step", metadata={"help": "step: each step's tokens pooled over the rows, "
                                                                 "then the steps averaged (official); transition: "
                                                                 "each (row, step)'s token mean (DARE)"})
    micro_batch_rows: int | None = field(default=None, metadata={"help": "rows pooled per step and averaged per "
                                                                         "micro-batch (official: 6); none: all"})
    dual_clip: float | None = field(default=None, metadata={"help": "DARE's dual clip c > 1 for A < 0 (3)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_epsilon("epsilon", self.epsilon)
        check_float("beta", self.beta, minimum=0.0, hint="KL coefficient")
        check_choice("normalization", self.normalization, NORMALIZATIONS)
        check_micro_batch_rows(self.micro_batch_rows, False, "")
        check_dual_clip(self.dual_clip)


class CJGRPO(Objective):
    name = "cj_grpo"
    Config = CJGRPOConfig
    uses_old_policy = True
    separable = True
    presets = {"dare": dict(epsilon=0.2, dual_clip=3.0, scale_rewards=True, beta=0.0, normalization="transition")}

    @property
    def needs_reference(self) -> bool:
        return self.config.beta > 0

    def extra(self, batch, masks):
        """Each state's weight on its tokens' loss terms [N, n_t] (0 for an empty state)."""
        targets = masks.targets
        tokens = targets.sum(-1).double()  # [N, n_t] |U_ns|
        filled = tokens > 0
        N = masks.num_sequences
        if self.config.normalization == "transition":
            transitions = filled.sum(-1, keepdim=True).clamp_min(1).double()
            weight = 1.0 / (tokens.clamp_min(1) * transitions * N)
        else:
            weight = self._step_weights(batch, masks, tokens, filled)
        return {"weight": torch.where(filled, weight, torch.zeros_like(weight)),
                "states": float(filled.sum().clamp_min(1))}

    def _step_weights(self, batch, masks, tokens, filled):
        """The official pooling: 1 / (the tokens of the state's step over its micro-batch's rows x the steps
        holding a token in that micro-batch x the micro-batches)."""
        steps = batch.unmask_step.to(tokens.device)  # [N, L] the forward that unmasked each position
        beyond = int(steps.max()) + 1
        step_of = torch.where(masks.targets, steps[:, None, :], beyond).amin(-1)  # [N, n_t] the state's (first) step
        chunk = micro_batch_index(masks, self.config.micro_batch_rows)[:, None].expand_as(step_of)
        chunks = int(chunk.max()) + 1
        key = chunk * (beyond + 1) + step_of  # one key per (micro-batch, step)
        pooled = torch.zeros(chunks * (beyond + 1), dtype=torch.float64, device=tokens.device)
        pooled.index_add_(0, key[filled], tokens[filled])
        steps_per_chunk = (pooled > 0).view(chunks, beyond + 1).sum(-1).double()
        return 1.0 / (pooled[key].clamp_min(1) * steps_per_chunk[chunk].clamp_min(1) * chunks)

    def token_terms(self, lp, old, ref, advantage, target):
        """Per-token loss terms l (0 off the targets), the ratio, the clip and the dual-clip indicators."""
        c = self.config
        ratio = torch.exp(lp - old)
        gain = clipped_surrogate(ratio, advantage, c.epsilon, c.epsilon)
        clip = clipped(ratio, advantage, c.epsilon, c.epsilon) & target
        dual = torch.zeros_like(target)
        if c.dual_clip is not None:
            gain, dual = dual_clipped(gain, advantage, c.dual_clip)
            dual = dual & target
        terms = -gain
        if c.beta > 0:
            terms = terms + c.beta * kl_k3(ref - lp)
        zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
        return torch.where(target, terms, zero), ratio, clip, dual

    def pair_loss(self, lp_pairs, sequence, sample, inputs: LossInputs):
        target = inputs.masks.targets[sequence, sample]
        old = inputs.old(lp_pairs) if inputs.lp_old is None else inputs.lp_old[sequence, sample].to(lp_pairs.dtype)
        ref = inputs.lp_ref[sequence, sample].to(lp_pairs.dtype) if self.config.beta > 0 else None
        terms, _, _, _ = self.token_terms(lp_pairs, old, ref, inputs.advantage(lp_pairs)[sequence, None], target)
        weight = inputs.extra["weight"].to(lp_pairs.dtype)[sequence, sample]
        return (terms.sum(-1) * weight).sum()

    def stats(self, lp, inputs):
        target = inputs.masks.targets
        ref = inputs.ref(lp) if self.config.beta > 0 else None
        _, ratio, clip, dual = self.token_terms(lp, inputs.old(lp), ref, inputs.advantage(lp)[:, None, None], target)
        tokens = target.sum().clamp_min(1)
        stats = {"ratio_mean": ratio[target].mean(), "ratio_max": ratio[target].max(),
                 "clip_fraction": clip.sum() / tokens,
                 "states_per_sequence": torch.tensor(inputs.extra["states"] / inputs.masks.num_sequences)}
        if self.config.dual_clip is not None:
            stats["dual_clip_fraction"] = dual.sum() / tokens
        if ref is not None:
            stats["kl"] = torch.where(target, kl_k3(ref - lp), 0.0).sum() / tokens
        return stats
