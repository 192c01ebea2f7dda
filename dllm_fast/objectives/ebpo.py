"""EBPO (LLaDA2.1's RL objective, as DARE implements it: verl/trainer/ppo/dllm_core_algos.py
_forward_process_ebpo, compute_ebpo_composite_elbo, compute_policy_loss_ebpo, compute_ebpo_kl; the report's own
code is closed): PPO on one sequence-level ratio of composite block ELBOs, for block-diffusion models.

    E_n = (1/n_t) sum_j sum_b sum_{i in b masked in j} lp_nji / p_njb,       p_njb = m_njb / |b|   (not normalised)
    log rho_n = E_n - E_old,n                                                (the same stored masks)
    loss = -(1/N) sum_n A_n exp(min(log rho_n, log(1 + eps_high)))   for A_n >= 0
                        A_n exp(max(log rho_n, log(1 - eps_low)))     for A_n <  0
           + beta (1/N) sum_n k(E_n - E_ref,n)                               (k1, k2 or k3; beta 0: off)

The clip acts once, on the sequence ratio, in log space: exp(min(log rho, log(1 + eps))) A is PPO's
min(rho A, clip(rho) A) for A >= 0 exactly (max for A < 0), and exp never sees the unclipped side, so a large
|E - E_old| (sums over thousands of tokens) cannot overflow. A row whose ratio is clipped has gradient exactly 0.
A = the GRPO z-score (unbiased std + 1e-6). KL on E - E_ref: k1 = d, k2 = d^2 / 2, k3 = exp(-d) + d - 1
(DARE's compute_ebpo_kl; off in its recipes).

Masks ("block_cells", DARE's): every block of the completion on the model's grid is masked in every one of the
n_t samples (DARE's n_l = mc_num = 16), each (sample, block) cell with its own noise level, the sequence's
n_t x #blocks cells stratified by one uniform offset; m in {1..|b|}. Options: sampler "block_row_t" (one noise
level per sample shared by its blocks: one t per composite forward, the report read literally) and "block_elbo"
(dllm_fast's stratification: per (sequence, block) across the samples); count "all" (EOS padding counted).

Block models only (SDAR, LLaDA2): on a bidirectional model the block samplers are refused (`check_model`, with the
fix); sampler "stratified_l" (or any whole-completion sampler) gives EBPO on one block, the whole completion: then
E is VRPO-OL's ELBO with the discrete weights L_n / l, and EBPO is VRPO-OL with the clip above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dllm_fast.contracts import block_length, unwrap_model
from dllm_fast.likelihood import MaskSpec, elbo
from dllm_fast.likelihood.samplers import SAMPLERS
from dllm_fast.objectives.base import LossInputs, Objective, ObjectiveConfig, mask_defaults
from dllm_fast.validation import check_choice, check_float

KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass
class EBPOConfig(ObjectiveConfig):
    masks: MaskSpec = mask_defaults(n_t=16, sampler="block_cells", count="eos")
    scale_rewards: bool = True  # GRPO's z-score (DARE's adv_estimator=grpo)
    epsilon_low: float = field(default=0.2, metadata={"help": "clip range below 1 (in [0, 1))"})
    epsilon_high: float = field(default=0.2, metadata={"help": "clip range above 1"})
    beta: float = field(default=0.0, metadata={"help": "KL coefficient on E - E_ref (0: off, as DARE's recipes)"})
    kl_estimator: str = field(default="k2", metadata={"help": "KL estimator on the composite ELBO: k1, k2 or k3"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float("epsilon_low", self.epsilon_low, minimum=0.0, maximum=1.0, open_maximum=True,
                    hint="clip range below 1: log(1 - epsilon_low) must exist")
        check_float("epsilon_high", self.epsilon_high, minimum=0.0, hint="clip range above 1")
        check_float("beta", self.beta, minimum=0.0, hint="KL coefficient")
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)


class EBPO(Objective):
    name = "ebpo"
    Config = EBPOConfig
    uses_old_policy = True
    sequence_local = True

    @property
    def needs_reference(self) -> bool:
        return self.config.beta > 0

    def check_model(self, model) -> None:
        if SAMPLERS[self.config.sampler].model_blocks and block_length(model) is None:
            raise ValueError(f"ebpo estimates a block-diffusion model's composite ELBO (sampler="
                             f"{self.config.sampler!r}: a noise level per block of the model's), but the policy "
                             f"({type(unwrap_model(model)).__name__}) attends to the whole sequence. Use a block "
                             "model (SDAR, LLaDA2; e.g. --model sdar-sudoku4), or set sampler='stratified_l' for "
                             "EBPO on one block, the whole completion (VRPO-OL's ELBO with EBPO's clip).")

    def inert_sequences(self, inputs: LossInputs):
        return inputs.advantages == 0 if self.config.beta == 0 else None

    def log_ratio(self, lp, inputs: LossInputs) -> torch.Tensor:
        return elbo(lp, inputs.masks) - elbo(inputs.old(lp), inputs.masks)

    def clipped_log_ratio(self, log_ratio, advantage) -> torch.Tensor:
        """min(log rho, log(1 + eps_high)) where A >= 0, max(log rho, log(1 - eps_low)) where A < 0."""
        c = self.config
        return torch.where(advantage >= 0, log_ratio.clamp(max=math.log1p(c.epsilon_high)),
                           log_ratio.clamp(min=math.log1p(-c.epsilon_low)))

    def kl(self, lp, inputs: LossInputs) -> torch.Tensor:
        """(1/N) sum_n k(E_n - E_ref,n)."""
        d = elbo(lp, inputs.masks) - elbo(inputs.ref(lp), inputs.masks)
        k = {"k1": lambda: d, "k2": lambda: 0.5 * d**2, "k3": lambda: torch.expm1(-d) + d}[self.config.kl_estimator]
        return k().mean()

    def loss(self, lp, inputs: LossInputs):
        advantage = inputs.advantage(lp)
        value = -(advantage * torch.exp(self.clipped_log_ratio(self.log_ratio(lp, inputs), advantage))).mean()
        if self.config.beta > 0:
            value = value + self.config.beta * self.kl(lp, inputs)
        return value

    def stats(self, lp, inputs):
        c = self.config
        log_ratio, advantage = self.log_ratio(lp, inputs), inputs.advantage(lp)
        clipped = (((log_ratio > math.log1p(c.epsilon_high)) & (advantage > 0))
                   | ((log_ratio < math.log1p(-c.epsilon_low)) & (advantage < 0)))
        ratio = torch.exp(log_ratio)  # logged as it is (inf for a log-ratio beyond 709: the loss never forms it)
        stats = {"ratio_mean": ratio.mean(), "ratio_max": ratio.max(), "log_ratio_mean": log_ratio.mean(),
                 "clip_fraction": clipped.double().mean(), "elbo_mean": elbo(lp, inputs.masks).mean()}
        if c.beta > 0:
            stats["kl"] = self.kl(lp, inputs)
        return stats
