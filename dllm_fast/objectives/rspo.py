"""RSPO (Relative Score Policy Optimization; RSPO paper Eqs. 3.2, 3.3, B.1): the reward advantage as a target for
the centred current-versus-reference ELBO score, with the remaining gap as the policy-gradient coefficient.

    delta_n = (E_theta,n - E_ref,n) / L_n                  (Eq. 3.2; E = the ELBO of Eq. B.1, L_n counted tokens)
    delta_hat_n = delta_n - sg(mean_B delta)               (centred with a detached mean)
    w_n = A_n - lambda sg(delta_hat_n)                     (the scaled residual to the target A_n / lambda)
    loss = -(1/N) sum_n w_n delta_hat_n                    (Eq. 3.3)

E uses K = n_t masks with weight L_n / |M| (sampler "stratified_l"), the same masks for the current and the
reference policy. With another sampler, E is that sampler's ELBO, with its own weights (`likelihood.elbo`: 1/t for
random_t, (L_n + 1)/|M| for complementary, ...), not Eq. B.1's L_n / |M|; delta is still divided by L_n. Every
such E is an ELBO estimate of the same log-likelihood, so delta keeps its meaning, but its variance and (for
block or mean_field masks, which are not unbiased ELBO estimates) its bias follow the sampler.
A = r - group mean (zero-sum per complete group); scale_rewards divides by the group std + 1e-4 (the paper's
ablation). center="batch" centres over the loss batch (the paper's micro-batch B); "group" within each prompt
group; "micro_batch" within each micro-batch of micro_batch_rows sequences (required: never the memory
micro-batch), the paper's B when the loss batch holds several. The gradient equals that of the quadratic
l_quad = -<A, delta> + (lambda/2)||delta_hat||^2 (Theorem 1), and vanishes at delta_hat = A / lambda
(Proposition 4.2). Var(delta) is reported as the paper's diagnostic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dllm_fast.likelihood import MaskSpec, elbo
from dllm_fast.objectives.base import (LossInputs, Objective, ObjectiveConfig, check_micro_batch_rows, mask_defaults,
                                       micro_batch_index, micro_batch_sums)
from dllm_fast.validation import check_choice, check_float

CENTERS = ("batch", "group", "micro_batch")


@dataclass
class RSPOConfig(ObjectiveConfig):
    masks: MaskSpec = mask_defaults(n_t=2, sampler="stratified_l", count="eos")
    lam: float = field(default=0.01, metadata={"help": "feedback coefficient lambda"})
    center: str = field(default="batch", metadata={"help": "centre delta over the batch, each group or each "
                                                           "micro_batch"})
    std_epsilon: float = 1e-4  # the paper's ablation, when scale_rewards
    micro_batch_rows: int | None = field(default=None, metadata={"help": "sequences per centring micro-batch "
                                                                         "(required with center micro_batch)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float("lam", self.lam, minimum=0.0, hint="RSPO's feedback coefficient lambda (0.01)")
        check_choice("center", self.center, CENTERS)
        check_micro_batch_rows(self.micro_batch_rows, self.center == "micro_batch", "center='micro_batch'")


class RSPO(Objective):
    name = "rspo"
    Config = RSPOConfig

    @property
    def needs_reference(self) -> bool:
        return True

    def relative_score(self, lp, inputs: LossInputs):
        """(delta, delta_hat), [N] each."""
        masks = inputs.masks
        delta = (elbo(lp, masks) - elbo(inputs.ref(lp), masks)) / masks.num_counted.to(lp.dtype)
        if self.config.center == "group":
            grouped = delta.view(-1, inputs.batch.group_size)
            centre = grouped.mean(-1, keepdim=True).expand_as(grouped).reshape(-1)
        elif self.config.center == "micro_batch":
            index = micro_batch_index(masks, self.config.micro_batch_rows)
            centre = micro_batch_sums(delta, index) / micro_batch_sums(torch.ones_like(delta), index)
        else:
            centre = delta.mean().expand_as(delta)
        return delta, delta - centre.detach()

    def weights(self, lp, inputs: LossInputs):
        _, delta_hat = self.relative_score(lp, inputs)
        return inputs.advantage(lp) - self.config.lam * delta_hat.detach()

    def loss(self, lp, inputs: LossInputs):
        _, delta_hat = self.relative_score(lp, inputs)
        weights = inputs.advantage(lp) - self.config.lam * delta_hat.detach()
        return -(weights * delta_hat).mean()

    def stats(self, lp, inputs):
        delta, delta_hat = self.relative_score(lp, inputs)
        weights = inputs.advantage(lp) - self.config.lam * delta_hat
        return {"delta_var": delta_hat.var(unbiased=False), "delta_mean": delta.mean(),
                "offset_abs_mean": delta_hat.mean().abs(), "weight_sum": weights.sum()}
