"""Rules both samplers (the fused one and its reference twin) enforce: the mask token is never decoded, a block is
left as soon as it is complete, and a non-finite model output raises, naming the prompt and the completion
position (or the corrupt LM-head row)."""

from __future__ import annotations

import torch

from dllm_fast.rollout.plan import DecodingPlan


def suppressed_ids(model, plan: DecodingPlan) -> list[int]:
    """Token ids never decoded: the mask token (a decoded mask would stay masked: an endless threshold loop,
    and a completion holding the mask id; LLaDA's generate.py can decode it), and EOS under logits_eos_inf."""
    vocab = model.lm_head_weight.shape[0]
    ids = [model.mask_token_id] if 0 <= model.mask_token_id < vocab else []  # a head without it never emits it
    if plan.logits_eos_inf:
        ids.append(model.eos_token_id)
    return ids


def confidence_excluded_ids(model, plan: DecodingPlan) -> list[int]:
    """Token ids removed from the confidence softmax (confidence 0, so unmasked last)."""
    return [model.eos_token_id, model.eot_token_id] if plan.confidence_eos_eot_inf else []


def check_finite_lm_head(weight: torch.Tensor) -> None:
    """Raise naming the first LM-head row (token) that holds NaN or inf. A diagnosis for the error path only:
    it reads the whole head (about a second for LLaDA's on a small CPU)."""
    finite_rows = torch.isfinite(weight).all(dim=1)
    if not finite_rows.all():
        token = int((~finite_rows).nonzero()[0])
        raise ValueError(f"model.lm_head_weight[{token}] (the LM-head row of token {token}) holds NaN or inf, so "
                         "every confidence would be NaN; the weights are corrupt (check the checkpoint or the last "
                         "training step).")


def raise_if_not_finite(not_finite: torch.Tensor, block_start: int, cfg_scale: float, weight: torch.Tensor) -> None:
    """not_finite: [B, n] bool over the completion positions [block_start, block_start + n) of each prompt,
    True where the model's output at a masked position had no defined confidence: a NaN or infinite hidden
    state, or a NaN or +inf logit among the tokens that may be decoded. One host sync; raises naming the LM-head
    row at fault if there is one, else the first prompt and position."""
    if not not_finite.any():
        return
    check_finite_lm_head(weight)
    row, position = (int(v) for v in not_finite.nonzero()[0])
    guidance = f" (cfg_scale={cfg_scale} scales the difference of two outputs, which can overflow)" if cfg_scale else ""
    raise ValueError(f"generate: the model's output for prompt {row} at completion position "
                     f"{block_start + position} is NaN or infinite{guidance}; check the model's weights and "
                     "inputs (e.g. fp16 overflow).")


def check_assumed_steps(masked_left: int, assumed_steps_per_block: int, block: int) -> None:
    """On real tensors, a block that assumed_steps_per_block left incomplete: the option is for planning."""
    if masked_left:
        raise ValueError(f"assumed_steps_per_block={assumed_steps_per_block} left {masked_left} masked positions in "
                         f"block {block}; it is meant for planning on fake tensors: drop it to decode until each "
                         "block is complete.")


def check_block_done(masked_left: int, block: int, steps: int) -> None:
    """A block still masked after its step limit means a step unmasked nothing: never loop on."""
    if masked_left:
        raise RuntimeError(f"generate: block {block} still has masked positions after {steps} steps; a step "
                           "unmasked nothing (this is a bug in dllm_fast's sampler, please report it).")
