"""What a `generate` call means: its GenerateConfig (rollout/config.py) checked once at the boundary into a
`DecodingPlan`, the schedule, the temperature, the cache policy and the remasking rule. Shared by the fused sampler
(dllm_fast.rollout.sampler) and its reference twin (dllm_fast.reference.llada_sampler)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dllm_fast.contracts import block_length as block_length_of, check_positions, max_positions, unwrap_model
from dllm_fast.rollout.cache import BlockCache, CachePolicy, NoCache, cache_policy
from dllm_fast.rollout.config import GenerateConfig
from dllm_fast.rollout.remasking import Remasking, remasking_rule
from dllm_fast.validation import (check_binary_mask, check_bool, check_choice, check_float, check_int,
                                  check_same_device, check_temperature, check_threshold, data_checks_enabled,
                                  nearest_multiples, non_binary)


@dataclass(frozen=True)
class DecodingPlan:
    """A checked generate() call (its GenerateConfig and record_unmask_step): steps_per_block is None when
    threshold sets the steps adaptively; temperature is the one to sample at (0.0 for greedy, including
    temperatures too small to sample at); assumed_steps_per_block, in threshold mode, replaces the per-step read of
    the masked count. Both steps_per_block and threshold (block-diffusion models only): SDAR's
    "low_confidence_dynamic" rule, each step unmasks every candidate above the threshold and at least the fixed
    schedule's count. unmask_schedule: the fixed schedule's counts ("even" or "ass", `unmask_counts`; under "ass"
    steps_per_block is ass_steps(block_length)); eos_schedule: EOSER's (gamma_min, gamma_max) or None
    (`eos_factors`)."""

    steps_per_block: int | None
    temperature: float
    threshold: float | None
    cfg_scale: float
    cache: CachePolicy
    remasking: Remasking
    logits_eos_inf: bool
    confidence_eos_eot_inf: bool
    compile: bool = False
    record_unmask_step: bool = False
    assumed_steps_per_block: int | None = None
    full_last_block: bool = False
    eos_early_stop: bool = False
    record_step_predictions: bool = False  # MDPO: every step's one-step prediction (check_step_recording)
    unmask_schedule: str = "even"
    eos_schedule: tuple[float, float] | None = None

    def step_limit(self, block_length: int) -> int:
        """Most steps a block may take: its schedule, or one unmasked token per step under a threshold. Never more
        than block_length: a schedule of more steps unmasks one token per step and is complete after block_length
        of them (the steps after it unmask nothing and are never run)."""
        return block_length if self.steps_per_block is None else min(self.steps_per_block, block_length)


# The noise key holds the step in 31 bits (rollout.step: key ^ (step << 32 | position)).
MAX_STEPS = 2**31 - 1


def masked_count_schedule(block_length: int, steps_per_block: int) -> list[int]:
    """Tokens unmasked at each step of a fully masked block: LLaDA's even split, remainder first."""
    base, remainder = divmod(block_length, steps_per_block)
    return [base + (1 if i < remainder else 0) for i in range(steps_per_block)]


# -- CJ-GRPO's decoders: the ASS schedule and the EOSER factor (Yang et al. 2025, yjyddq/EOSER-ASS-RL) ----------
UNMASK_SCHEDULES = ("even", "ass")


def ass_steps(block_length: int) -> int:
    """The steps of a block under unmask_schedule="ass": K = floor(log2 block_length), at least 1 (the official
    code's S = int(log2 L) for its one block of L = 2^S tokens)."""
    return max(1, block_length.bit_length() - 1)


def unmask_counts(block_length: int, steps: int, schedule: str = "even") -> list[int]:
    """Tokens each step of a fully masked block unmasks: "even", LLaDA's split (masked_count_schedule); "ass",
    2^s at step s and the rest at the last step (1, 2, 4, ..., 2^(K-1) + 1 for a block of 2^K: the official
    get_num_transfer_tokens_ass), over steps = ass_steps(block_length)."""
    if schedule == "even":
        return masked_count_schedule(block_length, steps)
    return [2**s for s in range(steps - 1)] + [block_length - (2 ** (steps - 1) - 1)]


def eos_factors(eos_schedule: tuple[float, float], steps: int, schedule: str = "even") -> list[float]:
    """EOSER's factor at each step s of a block of `steps`: gamma_min + (gamma_max - gamma_min) t_s, t_s = s / (K - 1)
    under the even schedule (cj_grpo_trainer_eoser.py `sampling`) and the decoded fraction (2^(s+1) - 1) / 2^K under
    ASS (cj_grpo_trainer_eoser_ass.py `ass_sampling`); gamma_max throughout for a one-step block."""
    low, high = eos_schedule
    if steps == 1:
        return [high]
    progress = [s / (steps - 1) for s in range(steps)] if schedule == "even" else \
        [(2 ** (s + 1) - 1) / 2**steps for s in range(steps)]
    return [low + (high - low) * t for t in progress]


def step_tensors(plan: DecodingPlan, block_length: int, steps: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A fixed schedule's counts [steps] (int64) and EOSER's factors [steps] (float64; None without eos_schedule),
    built on the device from an arange (no host-to-device copy, which would sync on a GPU): `unmask_counts` and
    `eos_factors` as tensors."""
    s = torch.arange(steps, device=device)
    if plan.unmask_schedule == "even":
        base, remainder = divmod(block_length, steps)
        counts = base + (s < remainder).long()
    else:
        counts = torch.where(s == steps - 1, block_length - 2 ** (steps - 1) + 1, 2**s)
    factors = None
    if plan.eos_schedule is not None:
        low, high = plan.eos_schedule
        s = s.double()
        if steps == 1:
            progress = torch.ones_like(s)
        elif plan.unmask_schedule == "even":
            progress = s / (steps - 1)
        else:
            progress = (torch.exp2(s + 1) - 1) / 2**steps
        factors = low + (high - low) * progress
    return counts, factors


def check_eos_schedule(value) -> tuple[float, float] | None:
    """eos_schedule: None, or (gamma_min, gamma_max), two finite factors >= 0."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
        raise ValueError(f"eos_schedule={value!r} must be None or a pair (gamma_min, gamma_max): the EOS token's "
                         "confidence is scaled by a factor rising from gamma_min at a block's first step to gamma_max "
                         "at its last (CJ-GRPO's EOSER; the official code uses (0.01, 1.0) with ASS).")
    low, high = (check_float(f"eos_schedule[{i}]", v, minimum=0.0, hint="a factor on the EOS confidence, e.g. "
                             "(0.01, 1.0)") for i, v in enumerate(value))
    return low, high


def initial_canvas(input_ids, attention_mask, gen_length: int, mask_id: int):
    """The prompts followed by gen_length mask tokens, and the attention mask (int64, 1 = token) extended over
    them. attention_mask must have passed check_generate_args."""
    B = input_ids.shape[0]
    masks = torch.full((B, gen_length), mask_id, dtype=torch.long, device=input_ids.device)
    x = torch.cat([input_ids.long(), masks], dim=1)
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask.long(), torch.ones_like(masks)], dim=1)
    return x, attention_mask


def check_generate_args(model, input_ids, attention_mask, config: GenerateConfig, *, generator=None,
                        record_unmask_step=False, record_step_predictions=False) -> DecodingPlan:
    """Validate a generate() call, once, and return its plan: the prompts here, the settings by
    `check_generate_config` (errors name the field as generate's keyword). The checks that read the prompts' values
    cost one host sync (and the model's own token-id check, `check_input_ids`, one more); they are skipped where
    validation.data_checks_enabled says values cannot be read (fake tensors, torch.compile tracing)."""
    if not isinstance(config, GenerateConfig):
        raise TypeError(f"config must be a GenerateConfig, got {type(config).__name__}.")
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
    if attention_mask is not None:
        check_binary_mask("attention_mask", attention_mask, shape=tuple(input_ids.shape), device=input_ids.device,
                          check_values=False)
    if data_checks_enabled(input_ids, attention_mask):
        check_prompt_values(model, input_ids, attention_mask)
    plan = check_generate_config(model, config, prompt_length=input_ids.shape[1], batch=input_ids.shape[0],
                                 record_unmask_step=record_unmask_step,
                                 record_step_predictions=record_step_predictions)
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}.")
        if generator.device.type != input_ids.device.type:
            raise ValueError(f"generator is on {generator.device} but input_ids on {input_ids.device}; pass "
                             f"torch.Generator(device={str(input_ids.device)!r}).manual_seed(seed).")
    return plan


def check_generate_config(model, config: GenerateConfig, *, prompt_length: int | None = None,
                          batch: int | None = None, record_unmask_step=False,
                          record_step_predictions=False) -> DecodingPlan:
    """The checks of a GenerateConfig against the model that decodes it, without prompts (a trainer checks its
    rollouts' settings this way before it writes anything; a meta-device skeleton of the model will do), and its
    plan. With prompt_length and batch, also the bounds that depend on them (the model's positions, the noise
    counter's position word). Errors name the field as generate's keyword, its value and the fix."""
    if not isinstance(config, GenerateConfig):
        raise TypeError(f"config must be a GenerateConfig, got {type(config).__name__}.")
    gen_length, block_length, steps, threshold = config.gen_length, config.block_length, config.steps, config.threshold
    check_int("gen_length", gen_length, minimum=1)
    if prompt_length is not None:
        P, limit = prompt_length, max_positions(model)
        check_positions(model, P + gen_length,
                        f"prompts of {P} tokens (their padded length) plus gen_length={gen_length}",
                        f"Lower gen_length to at most {limit - P}, or shorten the prompts." if limit and P < limit else
                        "Shorten the prompts: alone they fill the model's positions.")
    check_int("block_length", block_length, minimum=1)
    if gen_length % block_length != 0 and block_length_of(model) is None:
        valid = " or ".join(f"gen_length={n}" for n in nearest_multiples(gen_length, block_length))
        raise ValueError(f"gen_length={gen_length} is not a multiple of block_length={block_length}: LLaDA's "
                         "semi-autoregressive blocks split the completion evenly (the official generate asserts "
                         f"it); pass {valid}, or a block_length that divides gen_length.")
    num_blocks = -(-gen_length // block_length)  # a block-diffusion model's last block may be partial
    unmask_schedule = check_choice("unmask_schedule", config.unmask_schedule, UNMASK_SCHEDULES)
    if unmask_schedule == "ass":  # its steps follow from the block: 2^s tokens at step s
        per_block = ass_steps(block_length)
        if threshold is not None:
            raise ValueError(f"unmask_schedule='ass' is a fixed schedule (2^s tokens at step s of a block), but "
                             f"threshold={threshold} decides each step's count; drop threshold, or pass "
                             "unmask_schedule='even'.")
        if steps is not None and steps != num_blocks * per_block:
            raise ValueError(f"steps={steps} does not fit unmask_schedule='ass': a block of {block_length} tokens "
                             f"takes floor(log2 {block_length}) = {per_block} steps (1, 2, 4, ... tokens, the rest at "
                             f"the last), so {num_blocks} block(s) (gen_length / block_length, rounded up) take "
                             f"steps={num_blocks * per_block}; pass that or steps=None.")
        steps = num_blocks * per_block
    if threshold is not None and (steps is None or block_length_of(model) is None):
        threshold = check_threshold("threshold", threshold)
        if steps is not None:
            raise ValueError(f"steps={steps} is ignored when threshold is set (the schedule is adaptive); pass steps=None.")
        steps_per_block = None
    else:  # a fixed schedule; with a threshold too (block models), its counts are each step's minimum
        if threshold is not None:
            threshold = check_threshold("threshold", threshold)
        check_int("steps", steps, minimum=1, hint="or set threshold for adaptive steps")
        if steps > MAX_STEPS:
            raise ValueError(f"steps={steps} exceeds {MAX_STEPS} (2^31 - 1, the noise key's step word); a call runs "
                             f"at most gen_length={gen_length} forwards anyway (one unmasks at least one token), so "
                             f"use at most {gen_length}.")
        if steps % num_blocks != 0:
            raise ValueError(f"steps={steps} is not a multiple of the number of blocks {num_blocks} "
                             f"(gen_length / block_length, rounded up); use e.g. "
                             f"steps={num_blocks * max(1, steps // num_blocks)}.")
        steps_per_block = steps // num_blocks
    temperature = check_temperature("temperature", config.temperature)
    cfg_scale = check_float("cfg_scale", config.cfg_scale, minimum=0.0, hint="0 disables classifier-free guidance")
    policy = cache_policy(config.cache)
    policy.check_model(model)
    rule = remasking_rule(config.remasking)
    logits_eos_inf = check_bool("logits_eos_inf", config.logits_eos_inf)
    confidence_eos_eot_inf = check_bool("confidence_eos_eot_inf", config.confidence_eos_eot_inf)
    if confidence_eos_eot_inf and getattr(model, "eot_token_id", None) is None:
        raise ValueError("confidence_eos_eot_inf needs the model's end-of-turn id; set its config's eot_token_id.")
    compile = check_bool("compile", config.compile)
    check_bool("record_unmask_step", record_unmask_step)
    full_last_block = check_bool("full_last_block", config.full_last_block)
    assumed_steps_per_block = config.assumed_steps_per_block
    if assumed_steps_per_block is not None:
        check_int("assumed_steps_per_block", assumed_steps_per_block, minimum=1, maximum=block_length,
                  hint="steps a threshold-decoded block is assumed to take, at most block_length")
        if threshold is None:
            raise ValueError(f"assumed_steps_per_block={assumed_steps_per_block} replaces threshold decoding's read "
                             "of the masked count; with a fixed schedule (steps) the steps are known: drop it.")
    eos_early_stop = check_bool("eos_early_stop", config.eos_early_stop)
    eos_schedule = check_eos_schedule(config.eos_schedule)
    if eos_schedule is not None:
        if steps_per_block is None:
            raise ValueError(f"eos_schedule={config.eos_schedule!r} scales the EOS confidence by a block's step s of "
                             "its K steps, but threshold decoding has no fixed K; pass steps (a fixed schedule), or "
                             "eos_schedule=None.")
        if not rule.uses_model_confidence:
            raise ValueError(f"eos_schedule={config.eos_schedule!r} scales the EOS confidence, which "
                             f"remasking={rule.name!r} does not read (it ranks positions at random); pass "
                             "remasking='low_confidence', or eos_schedule=None.")
        if confidence_eos_eot_inf:
            raise ValueError(f"eos_schedule={config.eos_schedule!r} and confidence_eos_eot_inf=True both set the EOS "
                             "confidence (confidence_eos_eot_inf is the factor 0 at every step); choose one.")
    if eos_early_stop and block_length_of(model) is None:
        raise ValueError("eos_early_stop=True stops a block-diffusion rollout once every row has decoded its EOS "
                         "(LLaDA2's generate); this model decodes bidirectionally: pass eos_early_stop=False.")
    # The noise counter's position word numbers every decoded position of every row (a block rollout's words
    # start at block_length; a full last block decodes up to block_length - 1 positions past each completion).
    blocks = block_length_of(model) is not None
    per_row = gen_length + (block_length if full_last_block and blocks else 0)
    if batch is not None and batch * per_row + (block_length if blocks else 0) > 2**32:
        raise ValueError(f"{batch} prompts x {per_row} decoded positions (gen_length={gen_length}"
                         f"{' plus a full last block' if per_row > gen_length else ''}) exceed 2^32, the noise "
                         "counter's position word; generate in smaller batches.")
    plan = DecodingPlan(steps_per_block, temperature, threshold, cfg_scale, policy, rule, logits_eos_inf,
                        confidence_eos_eot_inf, compile, record_unmask_step, assumed_steps_per_block, full_last_block,
                        eos_early_stop, unmask_schedule=unmask_schedule, eos_schedule=eos_schedule)
    if check_bool("record_step_predictions", record_step_predictions):
        check_step_recording(model, plan, gen_length, block_length)
        plan = dataclasses.replace(plan, record_unmask_step=True, record_step_predictions=True)
    if block_length_of(model) is not None:
        check_block_call(model, plan, block_length)
    return plan


def check_block_call(model, plan: DecodingPlan, block_length: int) -> None:
    """What a block-diffusion rollout cannot take, refused by name."""
    model_block = block_length_of(model)
    if block_length != model_block:
        raise ValueError(f"block_length={block_length}, but the model attends in blocks of {model_block} "
                         "(model.block_length): a block-diffusion model decodes its own blocks. Pass "
                         f"block_length={model_block}, or set model.block_length to decode in other blocks.")
    if plan.cfg_scale:
        raise ValueError(f"cfg_scale={plan.cfg_scale}: classifier-free guidance is not implemented for "
                         "block-diffusion models (the official SDAR generate has none); pass cfg_scale=0.")
    if not isinstance(plan.cache, (BlockCache, NoCache)):
        raise ValueError(f"cache={plan.cache.name!r} is Fast-dLLM's approximate cache for bidirectional models; a "
                         "block-diffusion model's cache is exact: pass cache='block' (or 'none' to recompute).")


# -- MDPO's step record (generate(..., record_step_predictions=True)) -------------------------------------------


def check_step_recording(model, plan: DecodingPlan, gen_length: int, block_length: int) -> None:
    """Refuse, naming the fix, a rollout whose steps cannot predict every masked position: the prediction of a
    position after the current block needs its hidden state, which a block-diffusion model never computes (its
    later blocks do not exist yet), and which a cache that feeds only the block (dual) leaves stale; a compiled
    step decodes a fixed shape (the block), so recording runs eagerly."""
    if block_length_of(model) is not None:
        raise ValueError("record_step_predictions records each step's prediction of every masked completion "
                         "position (MDPO's x_hat), but a block-diffusion model decodes block by block and never "
                         "predicts the blocks after the current one; use a bidirectional model (LLaDA, Dream) or "
                         "an objective that does not need the step record.")
    if plan.compile:
        raise ValueError("record_step_predictions decodes every masked position at every step, a shape that "
                         "changes from block to block, so it runs eagerly: pass compile=False (train: --compile "
                         "false).")
    if gen_length > block_length and plan.cache.uses_cache and plan.cache.reused_span(
            0, block_length, gen_length)[1] != gen_length:
        raise ValueError(f"record_step_predictions predicts every masked position at every step, but "
                         f"cache={plan.cache.name!r} feeds only the current block after its first step (the later "
                         f"blocks' hidden states are stale); use cache='prefix' or 'none', or one block "
                         f"(block_length=gen_length={gen_length}).")


def check_prompt_values(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    """The checks of a generate() call that read the prompts' values, read together in one host sync (a failure
    then reads more, to name the position): a 0/1 left-padded attention mask with a token in every prompt, no
    mask token in the prompts or their padding; then the model's own token-id check, if it has one."""
    mask_id = model.mask_token_id
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask != 0
    where = {"mask token": input_ids == mask_id}
    if attention_mask is not None:
        left_padded = real.to(torch.int8).cummax(dim=1).values.to(torch.bool)
        where = {"non-binary": non_binary(attention_mask), "not left-padded": real != left_padded,
                 "all padding": ~real[:, -1], **where}
    found = dict(zip(where, torch.stack([flags.any() for flags in where.values()]).tolist()))
    if found.get("non-binary"):
        check_binary_mask("attention_mask", attention_mask, shape=tuple(input_ids.shape), device=input_ids.device)
    if found.get("not left-padded"):
        raise ValueError("attention_mask must be left-padded (zeros, then ones, in every row); pad prompts on the left.")
    if found.get("all padding"):
        row = int((~real[:, -1]).nonzero()[0])
        raise ValueError(f"prompt {row} is all padding; every prompt needs at least one token.")
    if found["mask token"]:
        row, pos = (int(v) for v in (input_ids == mask_id).nonzero()[0])
        kind = "padding" if not real[row, pos] else "prompt"
        raise ValueError(
            f"input_ids[{row}, {pos}] is the mask token {mask_id} ({kind}); prompts and padding must not contain it "
            "(pad with the EOS/pad token instead)."
        )
    check_input_ids = getattr(unwrap_model(model), "check_input_ids", None)
    if check_input_ids is not None:
        check_input_ids(input_ids)


