"""Offline VRPO (LLaDA 1.5, Zhu et al. 2025, "Variance-Reduced Preference Optimization"; its code is closed, this
follows the paper's loss and DARE's implementation: verl/trainer/ppo/dllm_core_algos.py compute_dpo_loss and
_forward_process_vrpo, verl/workers/actor/llada_dp_actor_vrpo.py): DPO with ELBOs for masked diffusion LMs.

    s_k = beta [(B_theta(y_w) - B_ref(y_w)) - (B_theta(y_l) - B_ref(y_l))] / R
    loss = -(1/K) sum_k log sigmoid(s_k)                                      (K preference pairs)

B = the Monte Carlo ELBO of a completion (1/n) sum_j (L_n / x_j) sum_{i masked in j} lp, n = 4 samples with DARE's
stratified mask counts x_j (sampler "stratified_linspace": k ~ U{1..L_n}, x_j = round(k + j L_n / n) wrapped
into 1..L_n; "stratified_l" is dllm_fast's floor-stratified twin, "random_t" the continuous-t estimator). The
reference policy is scored on the very masks the policy is (VRPO's antithetic sampling): at theta = ref the
score is exactly 0 whatever the masks, loss = log 2, and the masks' noise cancels between the two policies.
normalization="padded" divides the ELBOs by R, the padded completion width (DARE's ELBO / R: beta then depends
on the padding); "none" uses the raw ELBOs (beta_effective = beta / R of the padded form). beta 0.2, n 4: DARE's.

Batches are preference pairs, not rollouts: a RolloutBatch of groups of two completions of one prompt whose
rewards differ, the larger reward marking the chosen completion y_w. `preference_batch` lays stored pairs out so
(row 2k chosen, row 2k + 1 rejected, rewards 1 and 0), and the engine, the masks and the planner take them as
they are. A pair has no advantage: the advantage options do not apply and are refused. The loss couples a pair's
two sequences, so it runs on the two-pass engine (exact gradient; memory independent of n_t).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dllm_fast.contracts import RolloutBatch, completion_mask
from dllm_fast.likelihood import MaskSpec, elbo
from dllm_fast.objectives.base import LossInputs, Objective, ObjectiveConfig, mask_defaults
from dllm_fast.validation import check_choice, check_float

NORMALIZATIONS = ("padded", "none")


@dataclass
class VRPODPOConfig(ObjectiveConfig):
    masks: MaskSpec = mask_defaults(n_t=4, sampler="stratified_linspace", count="eos")
    beta: float = field(default=0.2, metadata={"help": "DPO's beta on the ELBO differences"})
    normalization: str = field(default="padded", metadata={"help": "padded (DARE: ELBO / R, the padded width) or "
                                                                    "none (raw ELBOs)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float("beta", self.beta, minimum=0.0, open_minimum=True, hint="DPO's beta; DARE uses 0.2")
        check_choice("normalization", self.normalization, NORMALIZATIONS)
        defaults = {f.name: f.default for f in dataclasses.fields(ObjectiveConfig) if f.name != "masks"}
        changed = sorted(name for name, value in defaults.items() if getattr(self, name) != value)
        if changed:
            raise ValueError(f"vrpo_dpo has no advantage (a pair's preference is the order of its two rewards), so "
                             f"{', '.join(changed)} does not apply; leave the advantage options at their defaults.")


class VRPODPO(Objective):
    name = "vrpo_dpo"
    Config = VRPODPOConfig
    preference_pairs = True

    @property
    def needs_reference(self) -> bool:
        return True

    def extra(self, batch, masks):
        """+1 where a pair's first row is the chosen one, -1 where its second is."""
        return {"order": preference_order(batch)}

    def scores(self, lp, inputs: LossInputs) -> torch.Tensor:
        """[K] s_k, the pairs' preference scores (chosen minus rejected)."""
        masks = inputs.masks
        relative = elbo(lp, masks) - elbo(inputs.ref(lp), masks)  # B_theta - B_ref per sequence, same masks
        width = float(masks.completion_length) if self.config.normalization == "padded" else 1.0
        order = inputs.extra["order"].to(device=lp.device, dtype=lp.dtype)
        return self.config.beta * order * (relative[0::2] - relative[1::2]) / width

    def loss(self, lp, inputs: LossInputs):
        return F.softplus(-self.scores(lp, inputs)).mean()  # -log sigmoid(s), stable for any s

    def stats(self, lp, inputs):
        scores = self.scores(lp, inputs)
        bound = elbo(lp, inputs.masks)
        first = inputs.extra["order"].to(lp.device) > 0
        chosen = torch.where(first, bound[0::2], bound[1::2])
        return {"preference_score_mean": scores.mean(), "preference_accuracy": (scores > 0).double().mean(),
                "chosen_elbo_mean": chosen.mean(), "rejected_elbo_mean": (bound[0::2] + bound[1::2] - chosen).mean()}


def preference_order(batch: RolloutBatch) -> torch.Tensor:
    """[K] float64: +1 where pair k's first completion has the larger reward (it is the chosen one), -1 where its
    second has; a ValueError unless `batch` is pairs (groups of two whose rewards differ)."""
    rewards = batch.rewards.double()
    if batch.group_size != 2:
        raise ValueError(f"vrpo_dpo trains on preference pairs, groups of two completions of one prompt (got "
                         f"group_size {batch.group_size}); build the batch with "
                         "dllm_fast.objectives.preference_batch(prompt_ids, chosen_ids, rejected_ids, ...).")
    tied = rewards[0::2] == rewards[1::2]
    if bool(tied.any()):
        k = int(tied.nonzero()[0])
        raise ValueError(f"pair {k} (rows {2 * k} and {2 * k + 1}) has two equal rewards ({float(rewards[2 * k])}), "
                         "so neither completion is preferred; a pair's larger reward marks its chosen completion.")
    return torch.where(rewards[0::2] > rewards[1::2], 1.0, -1.0)


def preference_batch(prompt_ids: torch.Tensor, chosen_ids: torch.Tensor, rejected_ids: torch.Tensor, *,
                     eos_token_id: int, prompt_attention_mask: torch.Tensor | None = None) -> RolloutBatch:
    """K preference pairs as the RolloutBatch vrpo_dpo trains on: prompt_ids [K, P] (left-padded, with
    prompt_attention_mask [K, P], 0 on padding, or None), chosen_ids and rejected_ids [K, L] (each completion then
    EOS up to L: its counted positions end at the first EOS). Rows 2k and 2k + 1 are prompt k with the chosen and
    the rejected completion, rewards 1 and 0, group_size 2."""
    for name, ids in (("prompt_ids", prompt_ids), ("chosen_ids", chosen_ids), ("rejected_ids", rejected_ids)):
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ValueError(f"{name} must be a [K, length] tensor of token ids, got "
                             f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__}.")
    K = prompt_ids.shape[0]
    if chosen_ids.shape != rejected_ids.shape or chosen_ids.shape[0] != K:
        raise ValueError(f"chosen_ids {tuple(chosen_ids.shape)} and rejected_ids {tuple(rejected_ids.shape)} must both "
                         f"be [K, L] with K = {K} prompts; pad the completions to one width L with EOS.")
    completions = torch.stack((chosen_ids, rejected_ids), dim=1).reshape(2 * K, -1)
    sequences = torch.cat((prompt_ids.repeat_interleave(2, dim=0), completions), dim=1)
    attention_mask = None
    if prompt_attention_mask is not None:
        if tuple(prompt_attention_mask.shape) != tuple(prompt_ids.shape):
            raise ValueError(f"prompt_attention_mask has shape {tuple(prompt_attention_mask.shape)}; it must match "
                             f"prompt_ids, {tuple(prompt_ids.shape)}.")
        attention_mask = torch.cat((prompt_attention_mask.repeat_interleave(2, dim=0),
                                    torch.ones_like(completions)), dim=1)
    rewards = torch.tensor([1.0, 0.0], device=sequences.device).repeat(K)
    return RolloutBatch(sequences, attention_mask, prompt_ids.shape[1], completion_mask(completions, eos_token_id),
                        rewards, group_size=2)
