"""coupled-GRPO (DiffuCoder; Gong et al. 2025, Sec. 5 and App. A.3): token-level GRPO on a per-token
log-likelihood estimated from the full mask and complementary mask pairs.

    lp_hat_ni = (1 / (lambda + 1)) (lp_full,ni + sum_pairs [lp_first,ni / t + lp_second,ni / (1 - t)])   (Eq. 13)
    rho_ni = exp(lp_hat_ni - lp_hat_old,ni)
    loss = sum_{n,i} c_ni l_ni / sum c,   l_ni = -min(rho A_n, clip(rho, 1 - eps, 1 + eps) A_n) + beta k3_ni
    k3_ni = exp(lp_hat_ref - lp_hat) - (lp_hat_ref - lp_hat) - 1

The "coupled" sampler draws, per sequence, the full completion mask and lambda = (n_t - 1) / 2 complementary pairs
(Eq. 12: each counted token masked in exactly one mask of a pair, with rate t ~ U[0.2, 0.8] in the first), so
every token's log-probability is evaluated lambda + 1 times and in realistic partially masked contexts; c marks
the counted tokens (through the first EOS). `likelihood.token_estimate` is lp_hat. Defaults are the official
recipe's (apple/ml-diffucoder, recipes/config_coupled_code.yaml and src/open_r1/coupled_grpo.py): lambda = 1
(n_t = 3), eps 0.5, beta 0.01 (k3 on lp_hat against the reference), the leave-one-out advantage r_i - mean_{j != i}
without std (its _generate_and_score_completions hard-codes leave_one_out, scale_rewards false), and the token mean
over the batch's counted tokens. normalize_per="micro_batch" normalises within micro-batches of micro_batch_rows
sequences (required: never the memory micro-batch) and averages them, as its per-device loss under gradient
accumulation does. Differences from the code, by design: t is drawn per sequence and pair (the code draws one t
per call), and positions after the first EOS stay masked in every sample (the library's rule; the code masks
them at random too but never scores them). Not separable (lp_hat mixes samples): two-pass engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dllm_fast.likelihood import MaskSpec, token_estimate
from dllm_fast.objectives.base import (NORMALIZE_PER, LossInputs, Objective, ObjectiveConfig, check_epsilon,
                                       check_micro_batch_rows, clipped, clipped_surrogate, kl_k3, mask_defaults,
                                       micro_batch_index, micro_batch_sums)
from dllm_fast.validation import check_choice, check_float


@dataclass
class CoupledGRPOConfig(ObjectiveConfig):
    masks: MaskSpec = mask_defaults(n_t=3, sampler="coupled", count="eos")
    epsilon: float = field(default=0.5, metadata={"help": "PPO clip range"})
    beta: float = field(default=0.01, metadata={"help": "k3 KL coefficient (reference policy)"})
    advantage: str = "leave_one_out"  # the code's; "mean" the paper's
    std_epsilon: float = 1e-4
    normalize_per: str = field(default="batch", metadata={"help": "batch, or micro_batch as the code (each "
                                                                  "micro-batch normalised, then averaged)"})
    micro_batch_rows: int | None = field(default=None, metadata={"help": "sequences per normalisation "
                                                                         "micro-batch (required with micro_batch)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_epsilon("epsilon", self.epsilon)
        check_float("beta", self.beta, minimum=0.0, hint="KL coefficient")
        check_choice("normalize_per", self.normalize_per, NORMALIZE_PER)
        check_micro_batch_rows(self.micro_batch_rows, self.normalize_per == "micro_batch",
                               "normalize_per='micro_batch'")


class CoupledGRPO(Objective):
    name = "coupled_grpo"
    Config = CoupledGRPOConfig
    uses_old_policy = True
    sequence_local = True

    @property
    def needs_reference(self) -> bool:
        return self.config.beta > 0

    def inert_sequences(self, inputs: LossInputs):
        """Without the KL term, a zero advantage makes every token's term 0 whatever its ratio."""
        return inputs.advantages == 0 if self.config.beta == 0 else None

    def extra(self, batch, masks):
        """Each token's share of the loss: 1 / (its micro-batch's counted tokens x micro-batches)."""
        c = self.config
        per_micro_batch = c.normalize_per == "micro_batch"
        index = micro_batch_index(masks, c.micro_batch_rows if per_micro_batch else None)
        tokens = masks.num_counted.double()
        return {"token_share": 1.0 / (micro_batch_sums(tokens, index) * (int(index.max()) + 1))}

    def token_terms(self, lp, inputs: LossInputs):
        """Per-token loss terms [N, L] (0 where not counted), the ratio and the clip indicator."""
        c = self.config
        masks = inputs.masks
        estimate = token_estimate(lp, masks)
        ratio = torch.exp(estimate - token_estimate(inputs.old(lp), masks))
        advantage = inputs.advantage(lp)[:, None]
        terms = -clipped_surrogate(ratio, advantage, c.epsilon, c.epsilon)
        if c.beta > 0:
            terms = terms + c.beta * kl_k3(token_estimate(inputs.ref(lp), masks) - estimate)
        counted = masks.counted
        zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
        return torch.where(counted, terms, zero), ratio, clipped(ratio, advantage, c.epsilon, c.epsilon) & counted

    def loss(self, lp, inputs: LossInputs):
        terms, _, _ = self.token_terms(lp, inputs)
        return (terms.sum(-1) * inputs.extra["token_share"].to(lp.dtype)).sum()

    def stats(self, lp, inputs):
        masks = inputs.masks
        _, ratio, clip = self.token_terms(lp, inputs)
        counted = masks.counted
        tokens = counted.sum().clamp_min(1)
        stats = {"ratio_mean": ratio[counted].mean(), "ratio_max": ratio[counted].max(),
                 "clip_fraction": clip.sum() / tokens}
        if self.config.beta > 0:
            estimate = token_estimate(lp, masks)
            kl = kl_k3(token_estimate(inputs.ref(lp), masks) - estimate)
            stats["kl"] = torch.where(counted, kl, 0.0).sum() / tokens
        return stats
