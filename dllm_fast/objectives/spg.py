"""SPG (Sandwiched Policy Gradient; SPG paper Eqs. 5, 7, 8): the ELBO for non-negative advantages and an evidence
upper bound for negative ones, so that the surrogate bounds the GRPO objective from below.

    loss = -(1/N) sum_n A_n Lhat_n,     Lhat_n = ELBO_n if A_n >= 0, else the negative-advantage bound:
        bound="eubo": EUBO_beta,n = (1/beta) sum_i log (1/n_t) sum_j w_j 1[i scored in j] p_nji^beta   (Eq. 7)
        bound="mix":  omega EUBO_beta,n + (1 - omega) ELBO_n                                            (Eq. 8)
        bound="elbo": ELBO_n
        bound="zero": 0, the paper's "no negative term" ablation (the code's logp_estimation="zero")

beta defaults to 1.5, the paper's main mixture setting (GSM8K, MATH500, Countdown); preset="sudoku" is its Sudoku
setting, beta = 1.0 (the paper's beta table; spg_trainer.py scripts: sudoku eubo_beta 1.0).

Masks come from the "block" sampler (a random block partly masked, later blocks masked, earlier blocks and the
prompt perturbed with probability 0.15). A = r - group mean, no std. The EUBO is not a pointwise upper bound
(its theta-independent constant is dropped); only its gradient carries the bound.

normalization="paper" (default) uses the sequence-scale bounds above. normalization="token" reproduces SPG's
code: per-token means (ELBO_n / L_n; the EUBO averaged over the positions some sample masks) and the DAPO-style
weighting sum_n A_n Lhat_n |C_n| / sum_n |C_n| with |C_n| = L_n counted tokens. normalize_per="micro_batch"
takes those sums within each micro-batch of micro_batch_rows sequences (required: never the memory
micro-batch) and averages the micro-batches, as the code's per-device loss (spg_trainer.py L87-126: per_device 6, or 3
for Sudoku) under gradient accumulation does; with normalization="paper" it is the plain mean. Not separable
(the EUBO's log sits outside the mean over samples), so it runs on the two-pass engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dllm_fast.likelihood import MaskSpec, elbo, eubo_per_position
from dllm_fast.objectives.base import (NORMALIZE_PER, LossInputs, Objective, ObjectiveConfig, check_micro_batch_rows,
                                       mask_defaults, micro_batch_index, micro_batch_sums)
from dllm_fast.validation import check_choice, check_float, check_probability

BOUNDS = ("mix", "eubo", "elbo", "zero")
NORMALIZATIONS = ("paper", "token")


@dataclass
class SPGConfig(ObjectiveConfig):
    masks: MaskSpec = mask_defaults(n_t=2, sampler="block", count="eos", block_length=32, perturb_prob=0.15)
    bound: str = field(default="mix", metadata={"help": "negative-advantage bound: mix, eubo, elbo or zero (no "
                                                        "negative term)"})
    beta: float = field(default=1.5, metadata={"help": "the EUBO's beta (1.5 main setting; preset sudoku: 1.0)"})
    omega: float = field(default=0.5, metadata={"help": "the EUBO's weight in the mixture"})
    normalization: str = field(default="paper", metadata={"help": "paper (sequence sums) or token (the code's "
                                                                  "per-token means, length-weighted)"})
    normalize_per: str = field(default="batch", metadata={"help": "batch, or micro_batch as the code (each "
                                                                  "micro-batch normalised, then averaged)"})
    micro_batch_rows: int | None = field(default=None, metadata={"help": "sequences per normalisation "
                                                                         "micro-batch (required with micro_batch)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("bound", self.bound, BOUNDS)
        check_float("beta", self.beta, minimum=0.0, open_minimum=True, hint="SPG's EUBO temperature; 1.0-2.0")
        check_probability("omega", self.omega, hint="the mixture weight of the EUBO")
        check_choice("normalization", self.normalization, NORMALIZATIONS)
        check_choice("normalize_per", self.normalize_per, NORMALIZE_PER)
        check_micro_batch_rows(self.micro_batch_rows, self.normalize_per == "micro_batch",
                               "normalize_per='micro_batch'")


class SPG(Objective):
    name = "spg"
    Config = SPGConfig
    presets = {"sudoku": dict(beta=1.0)}
    sequence_local = True

    def inert_sequences(self, inputs: LossInputs):
        return inputs.advantages == 0

    def bounds(self, lp, masks):
        """(ELBO, negative-advantage bound), [N] each, at the configured normalisation."""
        c = self.config
        token = c.normalization == "token"
        lower = elbo(lp, masks) / (masks.num_counted.to(lp.dtype) if token else 1.0)
        if c.bound == "elbo":
            return lower, lower
        if c.bound == "zero":
            return lower, torch.zeros_like(lower)
        values, present = eubo_per_position(lp, masks, c.beta)
        upper = values.sum(-1) / present.sum(-1).clamp_min(1) if token else values.sum(-1)
        if c.bound == "mix":
            upper = c.omega * upper + (1.0 - c.omega) * lower
        return lower, upper

    def surrogate(self, lp, inputs: LossInputs):
        lower, upper = self.bounds(lp, inputs.masks)
        advantage = inputs.advantage(lp)
        return torch.where(advantage >= 0, lower, upper), advantage, lower, upper

    def loss(self, lp, inputs: LossInputs):
        c = self.config
        value, advantage, _, _ = self.surrogate(lp, inputs)
        masks = inputs.masks
        # Each sequence's share: L_n / sum L (token) or 1 / N (paper), within its micro-batch when asked.
        share = masks.num_counted.to(lp.dtype) if c.normalization == "token" else torch.ones_like(value)
        if c.normalize_per == "micro_batch":
            index = micro_batch_index(masks, c.micro_batch_rows)
            share = share / micro_batch_sums(share, index) / (int(index.max()) + 1)
        else:
            share = share / share.sum()
        return -(advantage * value * share).sum()

    def stats(self, lp, inputs):
        _, advantage, lower, upper = self.surrogate(lp, inputs)
        negative = advantage < 0
        stats = {"elbo_mean": lower.mean(), "negative_fraction": negative.double().mean()}
        if negative.any():
            stats["upper_bound_mean"] = upper[negative].mean()
        return stats
