"""GDPO (Group Diffusion Policy Optimization; Rojas et al., ICLR 2026): a GSPO-shaped sequence-level ratio of
ELBOs estimated by semi-deterministic Monte Carlo (SDMC) over a few Gauss quadrature points in t.

    ELBO_n = sum_k (c_k / t_k) (1/K') sum_draws sum_{i masked} lp          (SDMC: K nodes, K' = n_t / K draws each)
    rho_n = exp((ELBO_n - ELBO_old,n) / L_n)                               (one length-normalised ratio per sequence)
    loss = -(1/N) sum_n min(rho_n A_n, clip(rho_n, 1 - eps_low, 1 + eps_high) A_n)

Sampler "gauss": the ELBO's integral over the mask ratio t on the Gauss-Legendre nodes t_k of [0, 1] with weights
c_k; at each node only the mask is random (exactly floor(t_k L_n) counted positions, at least 1). Defaults are
the published recipe's as NVIDIA NeMo RL implements GDPO (research/gdpo: SdmcLikelihoodConfig quadrature
"gauss-3", mc_samples 1, p_mask_prompt 0; loss_fn sequence_level_importance_ratios with token_level_loss false,
reference_policy_kl_penalty 0; grpo normalize_rewards false): n_t = 3 nodes with one mask each, the ratio's
exponent normalised by each sequence's counted length L_n (ClippedPGLoss's masked mean over the response),
PPO's clip with eps 0.2 on both sides, no KL, and A = r - group mean without std (Dr. GRPO, which GDPO follows;
scale_rewards=True divides by the group std + 1e-6). quadrature_points=K with n_t = K K' gives K' masks per node
(NeMo's mc_samples). exp is not linear: two-pass engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dllm_fast.likelihood import MaskSpec, elbo
from dllm_fast.objectives.base import (LossInputs, Objective, ObjectiveConfig, check_epsilon, clipped,
                                       clipped_surrogate, mask_defaults)


@dataclass
class GDPOConfig(ObjectiveConfig):
    masks: MaskSpec = mask_defaults(n_t=3, sampler="gauss", count="eos")
    epsilon_low: float = field(default=0.2, metadata={"help": "clip range below 1"})
    epsilon_high: float = field(default=0.2, metadata={"help": "clip range above 1"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_epsilon("epsilon_low", self.epsilon_low)
        check_epsilon("epsilon_high", self.epsilon_high)


class GDPO(Objective):
    name = "gdpo"
    Config = GDPOConfig
    uses_old_policy = True
    sequence_local = True

    def inert_sequences(self, inputs: LossInputs):
        return inputs.advantages == 0

    def ratio(self, lp, inputs: LossInputs) -> torch.Tensor:
        masks = inputs.masks
        return torch.exp((elbo(lp, masks) - elbo(inputs.old(lp), masks)) / masks.num_counted.to(lp.dtype))

    def loss(self, lp, inputs: LossInputs):
        c = self.config
        return -clipped_surrogate(self.ratio(lp, inputs), inputs.advantage(lp), c.epsilon_low, c.epsilon_high).mean()

    def stats(self, lp, inputs):
        c = self.config
        ratio = self.ratio(lp, inputs)
        clip = clipped(ratio, inputs.advantage(lp), c.epsilon_low, c.epsilon_high)
        return {"ratio_mean": ratio.mean(), "ratio_max": ratio.max(), "clip_fraction": clip.double().mean(),
                "elbo_mean": elbo(lp, inputs.masks).mean()}
