"""What a `generate` call means, shared by the fused sampler (dllm_fast.sampling) and its reference twin
(dllm_fast.reference.sampling): the argument checks and the initial canvas."""

from __future__ import annotations

import torch

from dllm_fast.contracts import logit_shift

REMASKING = ("low_confidence", "random")
CACHE_MODES = ("none", "prefix", "dual")


def initial_canvas(input_ids, attention_mask, gen_length: int, mask_id: int):
    """The prompts followed by gen_length mask tokens, and the attention mask extended over them."""
    B = input_ids.shape[0]
    masks = torch.full((B, gen_length), mask_id, dtype=torch.long, device=input_ids.device)
    x = torch.cat([input_ids.long(), masks], dim=1)
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask.long(), torch.ones_like(masks)], dim=1)
    return x, attention_mask


def check_generate_args(model, input_ids, attention_mask, *, gen_length, block_length, steps, temperature,
                        remasking, cfg_scale, cache, threshold, confidence_eos_eot_inf,
                        generator=None) -> int | None:
    """Validate a generate() call; returns the steps per block (None when threshold sets them adaptively)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a [B, P] tensor of prompt token ids, got {getattr(input_ids, 'shape', input_ids)!r}.")
    if input_ids.shape[0] == 0:
        raise ValueError("input_ids is an empty batch (B = 0); pass at least one prompt.")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids has prompts of length 0; every prompt needs at least one token.")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must hold integer token ids, got {input_ids.dtype}.")
    mask_id = model.mask_token_id
    real = torch.ones_like(input_ids, dtype=torch.bool)
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {tuple(input_ids.shape)}.")
        real = attention_mask.to(torch.bool)
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
    if not (isinstance(gen_length, int) and gen_length > 0):
        raise ValueError(f"gen_length must be a positive int, got {gen_length!r}.")
    if not (isinstance(block_length, int) and block_length > 0):
        raise ValueError(f"block_length must be a positive int, got {block_length!r}.")
    if gen_length % block_length != 0:
        raise ValueError(f"gen_length={gen_length} is not a multiple of block_length={block_length}; "
                         "choose a block_length that divides gen_length.")
    num_blocks = gen_length // block_length
    if threshold is not None:
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {threshold!r}.")
        if steps is not None:
            raise ValueError(f"steps={steps} is ignored when threshold is set (the schedule is adaptive); pass steps=None.")
        steps_per_block = None
    else:
        if not (isinstance(steps, int) and steps > 0):
            raise ValueError(f"steps must be a positive int (or set threshold for adaptive steps), got {steps!r}.")
        if steps % num_blocks != 0:
            raise ValueError(f"steps={steps} is not a multiple of the number of blocks {num_blocks} "
                             f"(gen_length / block_length); use e.g. steps={num_blocks * max(1, steps // num_blocks)}.")
        steps_per_block = steps // num_blocks
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}.")
    if remasking not in REMASKING:
        raise ValueError(f"remasking={remasking!r} is not one of {REMASKING}.")
    if not cfg_scale >= 0:
        raise ValueError(f"cfg_scale must be >= 0, got {cfg_scale!r}.")
    if cache not in CACHE_MODES:
        raise ValueError(f"cache={cache!r} is not one of {CACHE_MODES}.")
    if cache != "none" and not hasattr(model, "new_cache"):
        raise ValueError(f"cache={cache!r} needs a model with a KV cache (new_cache); use cache='none' for this model.")
    if cache != "none" and logit_shift(model) != 0:
        raise ValueError(f"cache={cache!r} needs a model with logit_shift=0; this model predicts token i from "
                         "position i - 1 (logit_shift=1, Dream-style), so use cache='none'.")
    if confidence_eos_eot_inf and getattr(model, "eot_token_id", None) is None:
        raise ValueError("confidence_eos_eot_inf needs the model's end-of-turn id; set config.eot_token_id.")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}.")
        if generator.device.type != input_ids.device.type:
            raise ValueError(f"generator is on {generator.device} but input_ids on {input_ids.device}; pass "
                             f"torch.Generator(device={str(input_ids.device)!r}).manual_seed(seed).")
    return steps_per_block
