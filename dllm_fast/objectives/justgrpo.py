"""JustGRPO (Ni et al. 2026, "The Flexibility Trap"; LeapLabTHU/JustGRPO grpo.py and train.py): GRPO on the exact
left-to-right likelihood of a masked diffusion LM decoded one token at a time.

    lp_nj = log softmax(f_theta([prompt, y_<j, MASK^(L - j)]) / T)[y_j]          (sampler "autoregressive")
    rho_nj = exp(lp_nj - lp_old,nj)
    loss = sum_{n, j counted} -min(rho A_n, clip(rho, 1 - eps, 1 + eps) A_n) / Z
        normalization="official": Z = L (V + 1e-5 #groups), V the rows with A != 0 (the official
            gain / (L (v + 1e-5)), v the mean over groups of their rows with A != 0; the official code sums its
            accumulation steps where this averages the groups: a constant factor, which AdamW ignores);
        normalization="sequence": each row's counted tokens averaged, then the rows (DARE's token mean over a
            one-row micro-batch).

exp(sum_j lp_nj) is the probability that `generate(..., block_length=1, temperature=T)` emits y_n (the rollout's
order; JustGRPO's rollouts and the only ones this likelihood is exact for, so `check_rollouts` asks for
block_length 1). A = (r - mean) / (std + 1e-4), unbiased std, no KL and no reference; one update per rollout
batch (mu 1: the clip is inert, as in the official code). Counted positions: all L, EOS padding included
(count="all", as official and DARE score them); count="eos" stops after the first EOS. temperature: the learner's
T (1, official; DARE's recipes use 0.6 for the rollouts and the learner: pass --temperature 0.6 to the trainer too),
applied by scaling the policy's final hidden state by 1/T, which scales its logits (a linear LM head without bias).
dual_clip: DARE's dual-clip bound c A for A < 0 (3 in its recipes; None: off, as official).

Separable: a sum of per-(sequence, position) terms, so the engine runs one pass of L forwards per sequence, each
micro-batch's graph freed before the next: memory is independent of L (the official code backpropagates
position by position for the same reason).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from dllm_fast.contracts import unwrap_model
from dllm_fast.likelihood import MaskSpec
from dllm_fast.objectives.base import (LossInputs, Objective, ObjectiveConfig, check_dual_clip, check_epsilon, clipped,
                                       clipped_surrogate, dual_clipped, mask_defaults)
from dllm_fast.validation import check_choice, check_float

NORMALIZATIONS = ("official", "sequence")


@dataclass
class JustGRPOConfig(ObjectiveConfig):
    masks: MaskSpec = mask_defaults(n_t=1, sampler="autoregressive", count="all")
    scale_rewards: bool = True
    std_epsilon: float = 1e-4
    epsilon: float = field(default=0.2, metadata={"help": "PPO clip range"})
    normalization: str = field(default="official", metadata={"help": "official (sum / (L x rows with A != 0)) or "
                                                                      "sequence (DARE: per-row token mean)"})
    temperature: float = field(default=1.0, metadata={"help": "the learner's softmax temperature (DARE: 0.6)"})
    dual_clip: float | None = field(default=None, metadata={"help": "dual-clip bound c for A < 0 (DARE: 3; "
                                                                    "none: off)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_epsilon("epsilon", self.epsilon)
        check_choice("normalization", self.normalization, NORMALIZATIONS)
        check_float("temperature", self.temperature, minimum=0.0, open_minimum=True,
                    hint="the learner's softmax temperature, e.g. 1.0 or 0.6")
        check_dual_clip(self.dual_clip)


class JustGRPO(Objective):
    name = "justgrpo"
    Config = JustGRPOConfig
    uses_old_policy = True
    separable = True

    def check_rollouts(self, config) -> None:
        if config.block_length != 1:
            raise ValueError(f"justgrpo's likelihood is the left-to-right one, exact for rollouts decoded one token "
                             f"at a time from left to right: block_length 1 and steps = gen_length (JustGRPO's "
                             f"rollouts), got block_length {config.block_length}. Pass --block-length 1 "
                             f"--diffusion-steps {config.gen_length} (generate(..., block_length=1, "
                             f"steps={config.gen_length})).")

    def extra(self, batch, masks):
        N, G = masks.num_sequences, batch.group_size
        valid = float((self.advantages(batch) != 0).sum())
        counted = masks.num_counted.double()
        if self.config.normalization == "official":
            per_row = torch.full((N,), masks.completion_length * (valid + 1e-5 * (N // G)), dtype=torch.float64)
        else:
            per_row = counted * N
        return {"normaliser": per_row.to(masks.weight.device), "valid_rows": valid}

    def token_terms(self, lp, old, advantage):
        c = self.config
        ratio = torch.exp(lp - old)
        gain = clipped_surrogate(ratio, advantage, c.epsilon, c.epsilon)
        if c.dual_clip is not None:
            gain, _ = dual_clipped(gain, advantage, c.dual_clip)
        return gain, ratio

    def pair_loss(self, lp_pairs, sequence, sample, inputs: LossInputs):
        target = inputs.masks.targets[sequence, sample]
        zero = torch.zeros((), dtype=lp_pairs.dtype, device=lp_pairs.device)
        lp = torch.where(target, lp_pairs, zero).sum(-1)  # the pair's one target position (0 when it has none)
        old = lp.detach() if inputs.lp_old is None else torch.where(
            target, inputs.lp_old[sequence, sample].to(lp_pairs.dtype), zero).sum(-1)
        gain, _ = self.token_terms(lp, old, inputs.advantage(lp_pairs)[sequence])
        has_target = target.any(-1)
        terms = torch.where(has_target, -gain, zero)
        return (terms / inputs.extra["normaliser"].to(lp_pairs.dtype)[sequence]).sum()

    def stats(self, lp, inputs):
        target = inputs.masks.targets
        advantage = inputs.advantage(lp)[:, None, None].expand_as(lp)
        _, ratio = self.token_terms(lp, inputs.old(lp), advantage)
        tokens = target.sum().clamp_min(1)
        clip = clipped(ratio, advantage, self.config.epsilon, self.config.epsilon) & target
        log_likelihood = torch.where(target, lp, torch.zeros((), dtype=lp.dtype, device=lp.device)).sum((1, 2))
        return {"ratio_mean": ratio[target].mean(), "ratio_max": ratio[target].max(), "clip_fraction": clip.sum() / tokens,
                "log_likelihood_mean": log_likelihood.mean(),
                "valid_rows": torch.tensor(inputs.extra["valid_rows"])}

    # -- the learner's temperature: every policy scored at it (current, old) -------------------------------------
    def plan_updates(self, model, batch, **kwargs):
        with tempered(model, self.config.temperature):
            return super().plan_updates(model, batch, **kwargs)

    def backward(self, model, batch, update=None, **kwargs):
        with tempered(model, self.config.temperature):
            return super().backward(model, batch, update, **kwargs)


@contextlib.contextmanager
def tempered(model, temperature: float):
    """The policy's logits divided by `temperature` while inside: its final hidden states scaled by 1 / T (the LM
    head is linear without bias, so logits / T = (h / T) W^T), for every forward of the block."""
    if temperature == 1.0:
        yield
        return
    handle = unwrap_model(model).register_forward_hook(lambda module, args, output: output / temperature)
    try:
        yield
    finally:
        handle.remove()
