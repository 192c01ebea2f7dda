"""What a `generate` call means, checked once at the boundary into a `DecodingPlan`: the schedule, the
temperature, the cache policy and the remasking rule. Shared by the fused sampler (dllm_fast.rollout.generate)
and its reference twin (dllm_fast.reference.llada_sampler)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm_fast.rollout.cache import CachePolicy, cache_policy
from dllm_fast.rollout.remasking import Remasking, remasking_rule
from dllm_fast.validation import (check_binary_mask, check_bool, check_float, check_int, check_same_device,
                                  check_temperature, check_threshold)


@dataclass(frozen=True)
class DecodingPlan:
    """A checked generate() call: steps_per_block is None when threshold sets the steps adaptively; temperature
    is the one to sample at (0.0 for greedy, including temperatures too small to sample at)."""

    steps_per_block: int | None
    temperature: float
    threshold: float | None
    cfg_scale: float
    cache: CachePolicy
    remasking: Remasking
    logits_eos_inf: bool
    confidence_eos_eot_inf: bool

    def step_limit(self, block_length: int) -> int:
        """Most steps a block may take: its schedule, or one unmasked token per step under a threshold."""
        return block_length if self.steps_per_block is None else self.steps_per_block


def masked_count_schedule(block_length: int, steps_per_block: int) -> list[int]:
    """Tokens unmasked at each step of a fully masked block: LLaDA's even split, remainder first."""
    base, remainder = divmod(block_length, steps_per_block)
    return [base + (1 if i < remainder else 0) for i in range(steps_per_block)]


def initial_canvas(input_ids, attention_mask, gen_length: int, mask_id: int):
    """The prompts followed by gen_length mask tokens, and the attention mask (int64, 1 = token) extended over
    them. attention_mask must have passed check_generate_args."""
    B = input_ids.shape[0]
    masks = torch.full((B, gen_length), mask_id, dtype=torch.long, device=input_ids.device)
    x = torch.cat([input_ids.long(), masks], dim=1)
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask.long(), torch.ones_like(masks)], dim=1)
    return x, attention_mask


def check_generate_args(model, input_ids, attention_mask, *, gen_length, block_length, steps, temperature,
                        remasking, cfg_scale, cache, threshold, logits_eos_inf=False, confidence_eos_eot_inf=False,
                        generator=None) -> DecodingPlan:
    """Validate a generate() call, once, and return its plan."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a [B, P] tensor of prompt token ids, got {getattr(input_ids, 'shape', input_ids)!r}.")
    check_same_device("generate", **{"input_ids": input_ids, "attention_mask": attention_mask,
                                     "model.lm_head_weight": model.lm_head_weight})
    if input_ids.shape[0] == 0:
        raise ValueError("input_ids is an empty batch (B = 0); pass at least one prompt.")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids has prompts of length 0; every prompt needs at least one token.")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must hold integer token ids, got {input_ids.dtype}.")
    mask_id = model.mask_token_id
    real = torch.ones_like(input_ids, dtype=torch.bool)
    if attention_mask is not None:
        real = check_binary_mask("attention_mask", attention_mask, shape=tuple(input_ids.shape),
                                 device=input_ids.device)
        if not torch.equal(real, real.to(torch.int8).cummax(dim=1).values.to(torch.bool)):
            raise ValueError("attention_mask must be left-padded (zeros, then ones, in every row); pad prompts on the left.")
        if (~real[:, -1]).any():
            row = int((~real[:, -1]).nonzero()[0])
            raise ValueError(f"prompt {row} is all padding; every prompt needs at least one token.")
    hits = (input_ids == mask_id).nonzero()
    if len(hits):
        row, pos = (int(v) for v in hits[0])
        kind = "padding" if not real[row, pos] else "prompt"
        raise ValueError(
            f"input_ids[{row}, {pos}] is the mask token {mask_id} ({kind}); prompts and padding must not contain it "
            "(pad with the EOS/pad token instead)."
        )
    check_int("gen_length", gen_length, minimum=1)
    check_int("block_length", block_length, minimum=1)
    if gen_length % block_length != 0:
        raise ValueError(f"gen_length={gen_length} is not a multiple of block_length={block_length}; "
                         "choose a block_length that divides gen_length.")
    num_blocks = gen_length // block_length
    if threshold is not None:
        threshold = check_threshold("threshold", threshold)
        if steps is not None:
            raise ValueError(f"steps={steps} is ignored when threshold is set (the schedule is adaptive); pass steps=None.")
        steps_per_block = None
    else:
        check_int("steps", steps, minimum=1, hint="or set threshold for adaptive steps")
        if steps % num_blocks != 0:
            raise ValueError(f"steps={steps} is not a multiple of the number of blocks {num_blocks} "
                             f"(gen_length / block_length); use e.g. steps={num_blocks * max(1, steps // num_blocks)}.")
        steps_per_block = steps // num_blocks
    temperature = check_temperature("temperature", temperature)
    cfg_scale = check_float("cfg_scale", cfg_scale, minimum=0.0, hint="0 disables classifier-free guidance")
    policy = cache_policy(cache)
    policy.check_model(model)
    rule = remasking_rule(remasking)
    check_bool("logits_eos_inf", logits_eos_inf)
    check_bool("confidence_eos_eot_inf", confidence_eos_eot_inf)
    if confidence_eos_eot_inf and getattr(model, "eot_token_id", None) is None:
        raise ValueError("confidence_eos_eot_inf needs the model's end-of-turn id; set config.eot_token_id.")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}.")
        if generator.device.type != input_ids.device.type:
            raise ValueError(f"generator is on {generator.device} but input_ids on {input_ids.device}; pass "
                             f"torch.Generator(device={str(input_ids.device)!r}).manual_seed(seed).")
    return DecodingPlan(steps_per_block, temperature, threshold, cfg_scale, policy, rule, logits_eos_inf,
                        confidence_eos_eot_inf)


