"""BGPO (Boundary-Guided Policy Optimization; BGPO paper Eqs. 9-19): VRPO-OL's objective through a linear lower
bound that is a sum over Monte Carlo samples, so each sample's graph is freed as soon as it is backpropagated.

    l_nj = w_nj sum_i lp_nji          (BGPO Eq. 4: (1/t) times the masked log-likelihood, here with the sampler's w)
    d_nj = l_nj - l_old,nj            (same stored mask for old and current)
    g_nj = (1 + d_nj) A_n / n_t   if A_n >= 0;   exp(d_nj) A_n / n_t   if A_n < 0      (BGPO Eq. 13)
    loss = -(1/N) sum_n sum_j g_nj

By e^x >= 1 + x and Jensen, sum_j g_nj <= exp(B_n - B_old,n) A_n per sequence, with equality of value and
gradient on-policy (d = 0). A = (r - mean) / std (Eq. 18). The paper draws t ~ U(0, 1) ("random_t").

Options reproducing DARE's verl re-implementation (verl/workers/actor/llada_dp_actor_bgpo.py and
compute_policy_loss_bgpo, dllm_core_algos.py L77-150): scale="padded_length" divides l by the padded completion
width R (DARE), "response_length" by the sequence's counted length; clip_epsilon applies PPO's clip to the
per-sample ratio (1 + d for A > 0, e^d for A < 0) and dual_clip bounds the A < 0 loss at dual_clip * |A| (DARE:
0.2 and 3); aggregation="length_weighted" is verl's token-mean over each micro-batch of micro_batch_rows
sequences (required: never the memory micro-batch): each sequence's mean bound weighted by its counted length
L_n, sum_n L_n g_n / sum_n L_n within the micro-batch, then the micro-batches averaged (equal to the plain mean
for DARE's micro-batch of one sequence). preset="dare" sets all of these (rows 1) with LLaDA's stratified masks;
preset="sudoku" the paper's n_t = 32 for Sudoku. Separable: one scoring pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dllm_fast.likelihood import MaskSpec
from dllm_fast.likelihood.masks import weighted_sum
from dllm_fast.objectives.base import (LossInputs, Objective, ObjectiveConfig, check_dual_clip, check_micro_batch_rows,
                                       clipped, clipped_surrogate, dual_clipped, mask_defaults, micro_batch_index,
                                       micro_batch_sums, safe_exp)
from dllm_fast.validation import check_choice, check_float

SCALES = ("none", "padded_length", "response_length")
AGGREGATIONS = ("mean", "length_weighted")


@dataclass
class BGPOConfig(ObjectiveConfig):
    masks: MaskSpec = mask_defaults(n_t=16, sampler="random_t", count="eos")
    scale_rewards: bool = True  # A = (r - mean) / std (Eq. 18)
    scale: str = field(default="none", metadata={"help": "divide l by: none, padded_length (DARE) or "
                                                         "response_length"})
    clip_epsilon: float | None = field(default=None, metadata={"help": "PPO clip of the per-sample ratio (DARE 0.2)"})
    dual_clip: float | None = field(default=None, metadata={"help": "dual clip c > 1 for A < 0 (DARE 3)"})
    aggregation: str = field(default="mean", metadata={"help": "mean, or length_weighted (DARE's token-mean per "
                                                               "micro-batch)"})
    micro_batch_rows: int | None = field(default=None, metadata={"help": "sequences per length_weighted "
                                                                         "micro-batch (required with it)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("scale", self.scale, SCALES)
        check_choice("aggregation", self.aggregation, AGGREGATIONS)
        check_micro_batch_rows(self.micro_batch_rows, self.aggregation == "length_weighted",
                               "aggregation='length_weighted'")
        if self.clip_epsilon is not None:
            check_float("clip_epsilon", self.clip_epsilon, minimum=0.0, open_minimum=True)
        check_dual_clip(self.dual_clip)


class BGPO(Objective):
    name = "bgpo"
    Config = BGPOConfig
    uses_old_policy = True
    separable = True
    presets = {"dare": dict(sampler="stratified_l", scale="padded_length", clip_epsilon=0.2, dual_clip=3.0,
                            aggregation="length_weighted", micro_batch_rows=1),
               "sudoku": dict(n_t=32)}

    def extra(self, batch, masks):
        c = self.config
        device = masks.weight.device
        if c.scale == "padded_length":
            divisor = torch.full((masks.num_sequences,), float(masks.completion_length), dtype=torch.float64)
        elif c.scale == "response_length":
            divisor = masks.num_counted.double()
        else:
            divisor = torch.ones(masks.num_sequences, dtype=torch.float64)
        if c.aggregation == "length_weighted":  # L_n / (sum of L over its micro-batch x micro-batches)
            index = micro_batch_index(masks, c.micro_batch_rows)
            lengths = masks.num_counted.double()
            weight = lengths / micro_batch_sums(lengths, index) / (int(index.max()) + 1)
        else:
            weight = torch.full((masks.num_sequences,), 1.0 / masks.num_sequences, dtype=torch.float64)
        return {"divisor": divisor.to(device), "sequence_weight": weight.to(device)}

    def sample_terms(self, rows, old_rows, weight, divisor, advantage):
        """Per-sample bound terms g * n_t (to maximise), the per-sample ratio, and the clip indicator."""
        c = self.config
        d = weighted_sum(rows - old_rows, weight) / divisor
        positive = advantage >= 0
        ratio = torch.where(positive, 1.0 + d, safe_exp(d, ~positive))
        if c.clip_epsilon is None:
            gain = ratio * advantage
            clip = torch.zeros_like(positive)
        else:
            gain = clipped_surrogate(ratio, advantage, c.clip_epsilon, c.clip_epsilon)
            clip = clipped(ratio, advantage, c.clip_epsilon, c.clip_epsilon)
        if c.dual_clip is not None:
            gain, _ = dual_clipped(gain, advantage, c.dual_clip)
        return gain, ratio, clip

    def pair_loss(self, lp_pairs, sequence, sample, inputs: LossInputs):
        masks = inputs.masks
        old_rows = inputs.old(lp_pairs) if inputs.lp_old is None else inputs.lp_old[sequence, sample]
        weight = masks.weight[sequence, sample].to(lp_pairs.dtype)
        divisor = inputs.extra["divisor"].to(lp_pairs.dtype)[sequence]
        gain, _, _ = self.sample_terms(lp_pairs, old_rows.to(lp_pairs.dtype), weight, divisor,
                                       inputs.advantage(lp_pairs)[sequence])
        sequence_weight = inputs.extra["sequence_weight"].to(lp_pairs.dtype)[sequence]
        return -(sequence_weight * gain).sum() / masks.n_t

    def stats(self, lp, inputs):
        masks = inputs.masks
        weight = masks.weight.to(lp.dtype)
        divisor = inputs.extra["divisor"].to(lp.dtype)[:, None]
        gain, ratio, clip = self.sample_terms(lp, inputs.old(lp), weight, divisor, inputs.advantage(lp)[:, None])
        return {"ratio_mean": ratio.mean(), "ratio_max": ratio.max(), "clip_fraction": clip.double().mean(),
                "bound_mean": gain.mean(-1).mean()}
