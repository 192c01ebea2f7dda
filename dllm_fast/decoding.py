"""What a `generate` call means, shared by the fused sampler (dllm_fast.sampling) and its reference twin
(dllm_fast.reference.sampling):

- `check_generate_args`: every argument checked once, at the boundary, into a `DecodingPlan`;
- cache policies (`CACHE_POLICIES`): which positions a denoising step feeds to the model, and when the KV cache
  is refreshed; a new policy is one `CachePolicy` subclass;
- remasking rules (`REMASKING`): how a step ranks the still-masked positions it may unmask;
- the rules both samplers enforce: the mask token is never decoded, a block is left as soon as it is complete,
  and a non-finite model output raises, naming the prompt and the completion position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm_fast.contracts import logit_shift
from dllm_fast.validation import (check_binary_mask, check_bool, check_choice, check_float, check_int,
                                  check_same_device, check_temperature, check_threshold)

# ---------------------------------------------------------------------------------------------------------
# Cache policies


@dataclass(frozen=True)
class PlannedStep:
    """One denoising step of a fixed schedule, as a cache policy runs it (for cost models such as a roofline).

    block, step: indices; start, end: the block's positions; fed_start, fed_end: the positions fed to the model;
    refresh: whether the step recomputes every position (and rewrites the cache); masked: the block's masked
    positions before the step (the rows the LM head is applied to); unmasked: how many the step unmasks.
    """

    block: int
    step: int
    start: int
    end: int
    fed_start: int
    fed_end: int
    refresh: bool
    masked: int
    unmasked: int

    @property
    def fed(self) -> int:
        return self.fed_end - self.fed_start


class CachePolicy:
    """Which positions a denoising step feeds to the model, and when the KV cache is refreshed.

    A step of the block [start, end) on a canvas of `total` positions either refreshes, feeding all positions
    (and writing their keys and values to the cache), or reuses the cache and feeds `reused_span`. This base
    class refreshes at the first step of every block (Fast-dLLM); a subclass sets `name` and `reused_span`, and
    may override `refreshes`. Register an instance in CACHE_POLICIES to select it by name, or pass it to
    generate(cache=...) directly.
    """

    name = ""
    uses_cache = True

    def refreshes(self, step: int) -> bool:
        """Whether step `step` of a block feeds every position."""
        return step == 0

    def reused_span(self, start: int, end: int, total: int) -> tuple[int, int]:
        """Positions [lo, hi) fed by a step that does not refresh."""
        raise NotImplementedError

    def fed_span(self, start: int, end: int, total: int, step: int) -> tuple[int, int]:
        """Positions [lo, hi) fed to the model by step `step` of the block [start, end)."""
        return (0, total) if self.refreshes(step) else self.reused_span(start, end, total)

    def check_model(self, model) -> None:
        if not hasattr(model, "new_cache"):
            raise ValueError(f"cache={self.name!r} needs a model with a KV cache (new_cache); use cache='none' "
                             "for this model.")
        if logit_shift(model) != 0:
            raise ValueError(f"cache={self.name!r} needs a model with logit_shift=0; this model predicts token i "
                             "from position i - 1 (logit_shift=1, Dream-style), so use cache='none'.")

    def new_cache(self, model, batch: int, capacity: int):
        return model.new_cache(batch, capacity) if self.uses_cache else None

    def forward(self, model, ids: torch.Tensor, attention_mask, kv, start: int, end: int, step: int) -> torch.Tensor:
        """Hidden states [B, hi - lo, d] of the fed span (lo, hi) = fed_span(start, end, ids.shape[1], step)."""
        total = ids.shape[1]
        if self.refreshes(step):
            return model(ids, attention_mask=attention_mask, cache=kv)
        lo, hi = self.reused_span(start, end, total)
        return model(ids[:, lo:hi], attention_mask=attention_mask, cache=kv, cache_start=lo, attend_length=total)

    def plan(self, prompt_length: int, gen_length: int, block_length: int, steps_per_block: int) -> list[PlannedStep]:
        """Every step a fixed schedule runs, in order (steps that would unmask nothing are skipped)."""
        total, steps = prompt_length + gen_length, []
        for block in range(gen_length // block_length):
            start, end = prompt_length + block * block_length, prompt_length + (block + 1) * block_length
            masked = block_length
            for step, count in enumerate(masked_count_schedule(block_length, steps_per_block)):
                if masked == 0:
                    break
                lo, hi = self.fed_span(start, end, total, step)
                steps.append(PlannedStep(block, step, start, end, lo, hi, self.refreshes(step), masked, count))
                masked -= count
        return steps

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NoCache(CachePolicy):
    """Every step recomputes the whole canvas (LLaDA)."""

    name = "none"
    uses_cache = False

    def refreshes(self, step: int) -> bool:
        return True

    def check_model(self, model) -> None:
        pass

    def forward(self, model, ids, attention_mask, kv, start, end, step):
        return model(ids, attention_mask=attention_mask)


class PrefixCache(CachePolicy):
    """Fast-dLLM's prefix cache: later steps feed the block and everything after it; the prefix comes from the
    block's refresh."""

    name = "prefix"

    def reused_span(self, start, end, total):
        return start, total


class DualCache(CachePolicy):
    """Fast-dLLM's dual cache: later steps feed only the block; prefix and suffix come from the refresh."""

    name = "dual"

    def reused_span(self, start, end, total):
        return start, end


CACHE_POLICIES: dict[str, CachePolicy] = {policy.name: policy for policy in (NoCache(), PrefixCache(), DualCache())}


def cache_policy(cache) -> CachePolicy:
    """A CachePolicy instance, or the one registered under the name `cache`."""
    if isinstance(cache, CachePolicy):
        return cache
    return CACHE_POLICIES[check_choice("cache", cache, CACHE_POLICIES)]


# ---------------------------------------------------------------------------------------------------------
# Remasking rules


class Remasking:
    """How a step ranks the still-masked positions of the block: the highest scores are unmasked first."""

    name = ""
    uses_model_confidence = True  # whether `scores` reads the model's confidence in its sampled tokens

    def scores(self, confidence: torch.Tensor | None, *, fed_shape: tuple[int, int], fed_positions, generator,
               device) -> torch.Tensor:
        """Ranking scores [B, n] of n positions per row.

        confidence: [B, n] the model's probability of each position's sampled token (None when
            uses_model_confidence is False); fed_positions: [B, n] the positions' indices among the
            fed_shape = (B, F) positions the step fed to the model, or None when the n positions are all of
            them; generator: the sampler's torch.Generator.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class LowConfidence(Remasking):
    """LLaDA's low_confidence remasking: the most probable sampled tokens are unmasked first."""

    name = "low_confidence"

    def scores(self, confidence, *, fed_shape, fed_positions, generator, device):
        return confidence


class RandomRemasking(Remasking):
    """LLaDA's random remasking: a random order, one uniform drawn per fed position (as in LLaDA's code)."""

    name = "random"
    uses_model_confidence = False

    def scores(self, confidence, *, fed_shape, fed_positions, generator, device):
        uniform = torch.rand(fed_shape, device=device, generator=generator)
        return uniform if fed_positions is None else uniform.gather(1, fed_positions)


REMASKING: dict[str, Remasking] = {rule.name: rule for rule in (LowConfidence(), RandomRemasking())}


def remasking_rule(remasking) -> Remasking:
    """A Remasking instance, or the one registered under the name `remasking`."""
    if isinstance(remasking, Remasking):
        return remasking
    return REMASKING[check_choice("remasking", remasking, REMASKING)]


# ---------------------------------------------------------------------------------------------------------
# The plan of a generate call


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


# ---------------------------------------------------------------------------------------------------------
# Rules both samplers enforce


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


def check_block_done(masked_left: int, block: int, steps: int) -> None:
    """A block still masked after its step limit means a step unmasked nothing: never loop on."""
    if masked_left:
        raise RuntimeError(f"generate: block {block} still has masked positions after {steps} steps; a step "
                           "unmasked nothing (this is a bug in dllm_fast's sampler, please report it).")
