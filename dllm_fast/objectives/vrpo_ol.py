"""VRPO-OL, the online VRPO objective as the BGPO paper defines it (Eqs. 3-7): a sequence-level ratio of ELBOs.

    loss = -(1/N) sum_n exp(B_n - B_old,n) A_n,     B_n = (1/n_t) sum_j w_j sum_i lp_nji   (the MC ELBO)

with the old and current ELBOs on the same stored masks (so the ratio is exactly 1 on-policy) and
A = (r - mean) / std within the group (BGPO Eq. 18). The paper draws t ~ U(0, 1) per sample with weight 1/t
(sampler "random_t"); "stratified_l" (LLaDA's l ~ U{1..L}, weight L/l) is the lower-variance option. Not length-
normalised, no clip, no KL. exp is not linear, so the exact gradient needs the two-pass engine.
scale_rewards=False takes the unscaled advantage r - mean (the BGPO paper states the std only for BGPO itself,
Eq. 18; VRPO-OL has no public code).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm_fast.likelihood import MaskSpec, elbo
from dllm_fast.objectives.base import LossInputs, Objective, ObjectiveConfig, mask_defaults


@dataclass
class VRPOOLConfig(ObjectiveConfig):
    masks: MaskSpec = mask_defaults(n_t=4, sampler="random_t", count="eos")
    scale_rewards: bool = True  # BGPO Eq. 18; false: r - mean


class VRPOOL(Objective):
    name = "vrpo_ol"
    Config = VRPOOLConfig
    uses_old_policy = True
    sequence_local = True

    def inert_sequences(self, inputs: LossInputs):
        return inputs.advantages == 0

    def log_ratio(self, lp, inputs: LossInputs) -> torch.Tensor:
        return elbo(lp, inputs.masks) - elbo(inputs.old(lp), inputs.masks)

    def loss(self, lp, inputs: LossInputs):
        return -(torch.exp(self.log_ratio(lp, inputs)) * inputs.advantage(lp)).mean()

    def stats(self, lp, inputs):
        ratio = torch.exp(self.log_ratio(lp, inputs))
        return {"ratio_mean": ratio.mean(), "ratio_max": ratio.max(), "elbo_mean": elbo(lp, inputs.masks).mean()}
