"""TraceRL (Wang et al. 2025, "Revolutionizing Reinforcement Learning Framework for Diffusion Large Language
Models"): PPO on the rollout's own decoding trajectory. Each state of the trajectory is the canvas as it was
before a group of `shrink` denoising steps; its action is the tokens those steps unmasked.

    rho_nji = exp(lp_nji - lp_old,nji)         (the state's tokens, token-level ratio)
    loss = (1/R) sum_{states (n,j)} [ -(1/|T_nj|) sum_{i in T_nj} min(rho A_n, clip(rho, 1 - eps, 1 + eps) A_n)
                                      + beta sum_{i in T_nj} k3(lp_old,nji - lp_nji) ]

T_nj: the counted tokens decoded during state j of sequence n (the "trajectory" sampler, replaying the batch's
`unmask_step` from generate(..., record_unmask_step=True)); R: the non-empty states of the batch. Defaults are the
official code's (Gen-Verse/dLLM-RL, train/rl_llada.py forward_process and configs/rl_llada.yaml): shrink 8
(LLaDA; its block models use 1), eps 0.2, beta 0.01 with the k3 estimator against the old policy (the policy
that rolled out) summed over the state's tokens, each state's clipped surrogate averaged over its tokens and the
states averaged, and the advantage the group z-score with the population std, 0 for a group of equal rewards
(reward/rl_reward.py z_score_normalize). Not taken from the code: its optional diffusion value model, and its
filtering of groups whose accuracy is above 0.8 or below 0.2 (data selection, not the loss). Its post_num keeps
EOS padding out of the loss as count="eos" does here, except that the first EOS is counted here.
Separable: a sum of per-state terms, one scoring pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dllm_fast.likelihood import MaskSpec
from dllm_fast.objectives.base import (LossInputs, Objective, ObjectiveConfig, check_epsilon, clipped,
                                       clipped_surrogate, kl_k3, mask_defaults)
from dllm_fast.validation import check_float


@dataclass
class TraceRLConfig(ObjectiveConfig):
    masks: MaskSpec = mask_defaults(n_t=1, sampler="trajectory", count="eos", shrink=8)
    scale_rewards: bool = True  # the z-score with the population std, 0 for a group of equal rewards
    std_epsilon: float = 0.0
    population_std: bool = True
    epsilon: float = field(default=0.2, metadata={"help": "PPO clip range"})
    beta: float = field(default=0.01, metadata={"help": "k3 KL coefficient against the old policy"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_epsilon("epsilon", self.epsilon)
        check_float("beta", self.beta, minimum=0.0, hint="KL coefficient")


class TraceRL(Objective):
    name = "tracerl"
    Config = TraceRLConfig
    uses_old_policy = True
    separable = True
    # The official configs for SDAR/TraDo (configs/rl_sdar.yaml, rl_trado.yaml): every decoding step a state.
    presets = {"sdar": dict(shrink=1)}

    def extra(self, batch, masks):
        targets = masks.targets.sum(-1)  # [N, n_t] tokens of each state
        return {"state_tokens": targets.double(), "states": float((targets > 0).sum().clamp_min(1))}

    def token_terms(self, lp, old, advantage, target):
        """Per-token surrogate and KL terms (0 off the targets), the ratio and the clip indicator."""
        c = self.config
        ratio = torch.exp(lp - old)
        zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
        gain = torch.where(target, clipped_surrogate(ratio, advantage, c.epsilon, c.epsilon), zero)
        kl = torch.where(target, kl_k3(old - lp), zero)
        return gain, kl, ratio, clipped(ratio, advantage, c.epsilon, c.epsilon) & target

    def pair_loss(self, lp_pairs, sequence, sample, inputs: LossInputs):
        target = inputs.masks.targets[sequence, sample]
        old = inputs.old(lp_pairs) if inputs.lp_old is None else inputs.lp_old[sequence, sample].to(lp_pairs.dtype)
        advantage = inputs.advantage(lp_pairs)[sequence, None]
        gain, kl, _, _ = self.token_terms(lp_pairs, old, advantage, target)
        tokens = inputs.extra["state_tokens"].to(lp_pairs.dtype)[sequence, sample].clamp_min(1)
        terms = -gain.sum(-1) / tokens + self.config.beta * kl.sum(-1)
        return terms.sum() / inputs.extra["states"]

    def stats(self, lp, inputs):
        target = inputs.masks.targets
        _, kl, ratio, clip = self.token_terms(lp, inputs.old(lp), inputs.advantage(lp)[:, None, None], target)
        tokens = target.sum().clamp_min(1)
        return {"ratio_mean": ratio[target].mean(), "ratio_max": ratio[target].max(),
                "clip_fraction": clip.sum() / tokens, "kl_old": kl.sum() / tokens,
                "states_per_sequence": torch.tensor(inputs.extra["states"] / inputs.masks.num_sequences)}
