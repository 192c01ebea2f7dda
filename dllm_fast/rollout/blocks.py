"""Rollouts of block-diffusion models (SDAR, TraDo): what `generate` runs for a model with block-causal attention
(contracts.block_length).

Alignment. Blocks count from each row's first real token, as the official generate counts them from its
unpadded prompt: the prompt's whole blocks are context, and its last partial block is decoded together with the
first generated tokens. In a left-padded batch the rows' block boundaries therefore fall on different columns.
The rollout decodes on a canvas of its own where row n is shifted right by s_n = (-pad_n) mod block_length (more
left padding), which puts every row's position 0 on a multiple of the block length, so that all rows share the
block windows [k b, (k + 1) b). Row n's completion is the gen_length columns from P + s_n; the canvas ends at
W = b ceil((P + max s + G) / b). By default columns after a row's completion do not exist for it (attention mask
0, never decoded), so its last block ends with its completion; with full_last_block (the official generate's
way) they are mask positions of its last block, decoded with it and then dropped: they attend and are attended,
so they change the last block's tokens. The result is mapped back to [B, P + G].

Forwards. A window runs until the most masked row in it is complete: at most min(steps per block, b) forwards
(its schedule, or one token per step), fewer in a partial window. A row whose prompt length is not a multiple of
b spans G / b + 1 windows (its first and last blocks partial; gen_length need not be a multiple of b either, and
G / b is then rounded up), so a batch decodes at most G / b + 1 windows when its rows share one alignment and
G / b + 2 when they do not (`max_block_forwards`): a mixed batch can run more forwards than gen_length (each
forward unmasks at least one token of some row, not of every row).
`GenerationResult.nfe` is the count and bounds `unmask_step` (each position's forward, counted over the batch).
The planner's count is the real one: on its constant prompts (planning/fake.py) the layout and every window's
masked count are known without reading a computed value.

Work. The columns [0, F) that hold only whole prompt blocks of every row are prefilled in one forward. Each
window then runs the plan's steps through the shared denoising step (rollout/step.py, eager or compiled):

- cache="block" (BlockCache): a step feeds its window and reads the keys and values of the earlier blocks from
  the cache. The first step of a window also feeds the window before it, whose tokens are final by then: that
  one forward stores the finished block's keys and values and denoises the new block (no forward of its own
  for the store, unlike the official generate's extra forward per block). Exact: a finished block never
  changes and no block reads a later one.
- cache="none": every step recomputes the whole canvas with the block-causal mask (no reuse; the same tokens).

Remasking as the official generate offers it: a fixed schedule ("low_confidence_static": the block split evenly
over its steps, remainder first, the most confident first), the same with a threshold ("low_confidence_dynamic":
steps and threshold together, every candidate above the threshold and at least the schedule's count), or
Fast-dLLM's threshold rule (threshold alone). A partial first block ends as soon as its masked positions are
decoded. Unlike the official generate, a step never writes a position that is not masked (its top-k can pick
an already decoded or prompt position when fewer masked ones are left than the schedule's count).

The noise of T > 0 sampling is keyed by (the step within the block, the row, the completion position), so a
prompt's sample does not depend on how far the batch pads it.

EOS early stop (`eos_early_stop=True`, what LLaDA2's generate does after each block): once every row's completion
holds an EOS in its finished blocks, no later block is decoded; the completion's undecoded positions are EOS (and
their unmask_step the last forward's). The completion up to and including each row's first EOS is the one a full
rollout gives: the tokens before it are decoded, and a decoded token never changes.

Host syncs: one at the start (the rows' extreme shifts, which size the canvas), one per block (its masked count
and the previous block's non-finite flag; with eos_early_stop one more, whether every row has ended), and with a
threshold one per step (as generate's threshold decoding).
On fake tensors (the planner) none: the layout of the prompts' constant mask (else the widest canvas any batch of
the shape needs), every window run for the steps its masked count takes (or assumed_steps_per_block).
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from dllm_fast.contracts import GenerationResult, block_length as block_length_of, completion_mask
from dllm_fast.rollout.cache import BlockCache, NoCache
from dllm_fast.rollout.plan import DecodingPlan, check_block_call, step_tensors, unmask_counts
from dllm_fast.rollout.rules import check_assumed_steps, check_block_done, raise_if_not_finite
from dllm_fast.rollout.step import (_KEPT_STATES, COMPILED_STEP_GRAPHS, NOISE_STEP, STEP_IN_BLOCK, RolloutState,
                                    _graph_limit, compiled_step, denoise_step, masked_left_and_bad, step_constants)
from dllm_fast.validation import data_checks_enabled, values_checked


def generate_blocks(model, plan: DecodingPlan, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    gen_length: int, block_length: int, generator) -> GenerationResult:
    """`generate` on a block-diffusion model, its call already checked into `plan` (see the module docstring)."""
    check_block_call(model, plan, block_length)
    device, mask_id = input_ids.device, model.mask_token_id
    B, P = input_ids.shape
    b, G = block_length, gen_length
    reads_values = data_checks_enabled(input_ids, attention_mask, model.lm_head_weight)
    layout = Layout.of(input_ids, attention_mask, G, b, read=reads_values, full_last_block=plan.full_last_block)
    shapes = ("blocks", device, B, P, G, b, layout.width, layout.prefilled, plan.steps_per_block,
              plan.record_unmask_step, plan.cache, model.lm_head_weight.dtype, plan.full_last_block,
              plan.unmask_schedule, plan.eos_schedule)
    state = _start(model, plan, input_ids, layout, b, generator, shapes, _KEPT_STATES)
    constants = step_constants(model, plan, 0, b, B)
    step_fn = denoise_step
    if plan.compile:
        step_fn = compiled_step(device.type)
        if device.type == "cuda":
            for tensor in state.tensors():
                torch._dynamo.mark_static_address(tensor, guard=False)
    schedule = None if plan.steps_per_block is None else unmask_counts(b, plan.steps_per_block, plan.unmask_schedule)
    cached = isinstance(plan.cache, BlockCache)
    with values_checked():  # the prompts were checked once: the model skips its per-call check
        if cached and layout.prefilled:
            model(state.canvas[:, :layout.prefilled], attention_mask=state.attention_mask[:, :layout.prefilled],
                  cache=state.kv)
    stored = layout.prefilled  # columns whose final keys and values are in the cache
    nfe = 0
    decoded_to = layout.width  # columns decoded (less when every row ended early)
    with _graph_limit(COMPILED_STEP_GRAPHS) if plan.compile else nullcontext():
        for window in range(layout.prefilled // b, layout.width // b):
            start, end = window * b, (window + 1) * b
            if plan.eos_early_stop and reads_values and window > layout.prefilled // b and \
                    _every_row_ended(state, layout, start, model.eos_token_id):
                decoded_to = start
                break
            positions = torch.arange(start, end, device=device)
            state.counters[STEP_IN_BLOCK] = 0
            state.counters[NOISE_STEP] = 0  # the noise is keyed by the step within the block
            remaining = layout.masked_in(window)  # b for a fake batch of unknown layout
            if reads_values:  # one host sync per block: its masked count, and the last block's non-finite flag
                remaining, any_bad = masked_left_and_bad(state, positions, mask_id)
                if any_bad:
                    _raise_not_finite(state, layout, plan, model)
            for step in range(plan.step_limit(b)):
                if remaining <= 0:
                    break
                fed = None
                if cached:
                    fed = torch.arange(stored if step == 0 else start, end, device=device)
                drawn = plan.remasking.draw((B, layout.width if fed is None else len(fed)), generator, device)
                rows = b if plan.compile or plan.assumed_steps_per_block else remaining
                with values_checked():
                    step_fn(model, state, constants, positions, fed, rows, drawn)
                nfe += 1
                stored = start
                if schedule is not None and plan.threshold is None:
                    remaining -= schedule[step]
                elif plan.assumed_steps_per_block is not None:
                    remaining = 0 if step + 1 == plan.assumed_steps_per_block else remaining
                else:  # a threshold: one host sync per step (its masked count and the non-finite flag)
                    remaining, any_bad = masked_left_and_bad(state, positions, mask_id)
                    if any_bad:
                        _raise_not_finite(state, layout, plan, model)
            if plan.threshold is not None and plan.assumed_steps_per_block is None:
                check_block_done(remaining, window, plan.step_limit(b))
            elif plan.assumed_steps_per_block is not None and reads_values:  # as the bidirectional sampler does
                check_assumed_steps(masked_left_and_bad(state, positions, mask_id)[0], plan.assumed_steps_per_block,
                                    window)
        if reads_values:
            left, any_bad = masked_left_and_bad(state, torch.arange(decoded_to, device=device), mask_id)
            if any_bad:
                _raise_not_finite(state, layout, plan, model)
            check_block_done(left, decoded_to // b - 1, plan.step_limit(b))
    completion = state.canvas.gather(1, layout.completion_columns)
    if decoded_to < layout.width:  # stopped early: what no step decoded is EOS, unmasked with the last forward
        undecoded = completion == mask_id
        completion = completion.masked_fill(undecoded, model.eos_token_id)
        if state.unmask_step is not None:
            state.unmask_step.scatter_(1, layout.completion_columns, state.unmask_step.gather(
                1, layout.completion_columns).masked_fill(undecoded, nfe - 1))
    sequences = torch.cat([input_ids.long(), completion], dim=1)
    unmask_step = None if state.unmask_step is None else state.unmask_step.gather(1, layout.completion_columns)
    result_mask = None
    if attention_mask is not None:
        result_mask = torch.cat([attention_mask.long(), torch.ones_like(completion)], dim=1)
    return GenerationResult(sequences, completion, completion_mask(completion, model.eos_token_id), nfe,
                            result_mask, unmask_step)


def _every_row_ended(state: RolloutState, layout: "Layout", column: int, eos: int) -> bool:
    """Whether every row's completion holds an EOS before canvas column `column` (all decoded: the blocks before
    the current one are complete), so nothing after it can change the completion up to its first EOS. One host
    sync."""
    completion = state.canvas.gather(1, layout.completion_columns)
    return bool(((completion == eos) & (layout.completion_columns < column)).any(dim=1).all())


def max_block_forwards(plan: DecodingPlan, gen_length: int, block_length: int) -> int:
    """The most forwards a block rollout of `plan` can run: gen_length / block_length (rounded up) + 2 windows
    (rows of two alignments: a partial first and last block each) of at most min(steps per block, block_length)
    forwards."""
    return (-(-gen_length // block_length) + 2) * plan.step_limit(block_length)


class Layout:
    """Where each row sits on the block rollout's canvas (see the module docstring).

    shift [B]: s_n; width: W; prefilled: F, the columns every row's whole prompt blocks fill;
    completion_columns [B, G]: the canvas columns of each row's completion; tokens [B, W] the initial canvas (-1
    where no token is), decoded [B, W] bool the columns decoded (the completion, and with full_last_block the rest
    of its last block) and mask [B, W] int64 (1 on each row's real tokens and decoded columns). spans: each row's
    decoded columns [start, end) as Python ints when its shift is known (read, or the planner's constant prompts),
    else None (a fake batch: the widest layout)."""

    def __init__(self, shift, width, prefilled, completion_columns, tokens, mask, decoded, block_length, spans):
        self.shift, self.width, self.prefilled = shift, width, prefilled
        self.completion_columns, self.tokens, self.mask = completion_columns, tokens, mask
        self.decoded, self.block_length, self.spans = decoded, block_length, spans

    @classmethod
    def of(cls, input_ids, attention_mask, gen_length: int, block_length: int, read: bool,
           full_last_block: bool = False) -> "Layout":
        """The layout of a batch. With `read` the shifts are read in one host sync (the tightest canvas); a fake
        batch's are known when its mask is a planner's constant (or absent), else the widest canvas any batch of
        this shape needs is taken."""
        B, P = input_ids.shape
        b, G, device = block_length, gen_length, input_ids.device
        real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.ne(0)
        pad = (~real).sum(dim=1)
        shift = (-pad) % b
        shifts = known_shifts(attention_mask, b, B, shift if read else None)
        low, high = (min(shifts), max(shifts)) if shifts is not None else (0, b - 1)
        width = b * math.ceil((P + high + G) / b)
        prefilled = b * ((P + low) // b)
        column = torch.arange(width, device=device)[None, :]
        source = column - shift[:, None]  # column in [prompt | completion]
        inside = (source >= 0) & (source < P + G)
        original = torch.cat([input_ids.long(), torch.full((B, G), -1, dtype=torch.long, device=device)], dim=1)
        tokens = original.gather(1, source.clamp(0, P + G - 1)).masked_fill(~inside, -1)

        def end_of(completion_end):  # where a row's decoding ends: its completion, or its last block's end
            return (completion_end + b - 1) // b * b if full_last_block else completion_end

        end = end_of(P + shift + G)
        decoded = ((source >= P) & inside) | ((source >= P + G) & (column < end[:, None]))
        mask = ((inside & (source >= pad[:, None])) | decoded).long()
        completion_columns = (P + shift)[:, None] + torch.arange(G, device=device)[None, :]
        spans = None if shifts is None else [(P + s, end_of(P + s + G)) for s in shifts]
        return cls(shift, width, prefilled, completion_columns, tokens, mask, decoded, b, spans)

    def masked_in(self, window: int) -> int:
        """The most positions any row decodes in window `window` (its masked count before the window's first
        step), from the layout alone: the block length when the rows' shifts are unknown (a fake batch)."""
        if self.spans is None:
            return self.block_length
        low, high = window * self.block_length, (window + 1) * self.block_length
        return max(max(0, min(high, end) - max(low, start)) for start, end in self.spans)


def known_shifts(attention_mask, block_length: int, batch: int, shift=None) -> list[int] | None:
    """Each row's shift as Python ints, or None where they cannot be known: from `shift` (a real tensor: one host
    sync), without padding (all 0), or from a planner's constant mask (a fake tensor carrying its real value,
    planning/fake.py); a fake mask without one has no values to read."""
    if shift is not None:
        return shift.tolist()
    if attention_mask is None:
        return [0] * batch
    constant = getattr(attention_mask, "constant", None)
    if constant is None:
        return None
    from torch.utils._mode_utils import no_dispatch

    with no_dispatch():  # the constant is a real tensor: read it outside the fake mode
        return ((-(constant == 0).sum(dim=1)) % block_length).tolist()


def _start(model, plan: DecodingPlan, input_ids, layout: Layout, block_length: int, generator, shapes,
           kept_states) -> RolloutState:
    """The call's buffers (compiled: the model's last call's, refilled in place, as generate keeps them)."""
    device, mask_id = input_ids.device, model.mask_token_id
    B, G = input_ids.shape[0], layout.completion_columns.shape[1]
    # -1 marks what is not a token: the decoded columns (masked) and the columns around the rows (padded with EOS).
    canvas = layout.tokens.masked_fill(layout.decoded, mask_id).masked_fill(layout.tokens.eq(-1) & ~layout.decoded,
                                                                            model.eos_token_id)
    noise_key = torch.zeros((), dtype=torch.long, device=device)
    if plan.temperature > 0:
        noise_key = torch.randint(2**62, (), generator=generator, device=device)
    kept = kept_states.get(model) if plan.compile else None
    if kept is not None and kept[0] == shapes:
        kept[1].restart(canvas, layout.mask, noise_key)
        kept[1].row_base.copy_(_row_base(layout, G, block_length, plan.full_last_block))
        return kept[1]
    schedule = eos_factor = None
    if plan.steps_per_block is not None:  # unmask_counts (and EOSER's factors), on the device
        schedule, eos_factor = step_tensors(plan, block_length, plan.steps_per_block, device)
    kv = plan.cache.new_cache(model, B, layout.width)
    if kv is not None:  # columns a step reads before any step wrote them are masked out, but must be finite
        for tensor in kv.keys + kv.values:
            tensor.zero_()
    state = RolloutState(
        canvas=canvas, kv=kv, attention_mask=layout.mask, masked_prompt=None, noise_key=noise_key,
        counters=torch.zeros(3, dtype=torch.long, device=device), schedule=schedule,
        row_base=_row_base(layout, G, block_length, plan.full_last_block),
        not_finite=torch.zeros(B, layout.width, dtype=torch.bool, device=device),
        unmask_step=torch.full((B, layout.width), -1, dtype=torch.long, device=device)
        if plan.record_unmask_step else None, eos_factor=eos_factor)
    if plan.compile:
        kept_states[model] = (shapes, state)
    return state


# The flag of a full last block's positions after the completion in the noise counter: bit 62, which the step word
# (bits 32 and up, the step within a block) never reaches, so their words need no room among the completions'.
AFTER_COMPLETION = 1 << 62


def _row_base(layout: Layout, gen_length: int, block_length: int, full_last_block: bool = False) -> torch.Tensor:
    """What the step adds to a canvas column for the noise counter's position word: [B, 1] row * G + b plus the
    completion position: unique per (row, completion position), independent of the batch's padding, and
    non-negative on the prompt tail decoded with the first block (fewer than b columns; its noise is unused).
    With full_last_block, [B, 3]: that, the column where each row's completion ends, and the jump that moves the
    words of the positions after it to AFTER_COMPLETION + row * b + their offset: keyed by the row and the offset
    alone, like the completion's, so that a row's sample does not depend on the batch's size (the completion's
    words stay the default's: only what the extra positions change in the logits changes a sample)."""
    first = layout.completion_columns[:, :1]
    B, G, b = first.shape[0], gen_length, block_length
    rows = torch.arange(B, device=first.device)[:, None]
    base = rows * G + b - first
    if not full_last_block:
        return base
    end = first + G
    return torch.cat([base, end, (AFTER_COMPLETION + rows * b) - (base + end)], dim=1)


def _raise_not_finite(state: RolloutState, layout: Layout, plan: DecodingPlan, model) -> None:
    raise_if_not_finite(state.not_finite.gather(1, layout.completion_columns), 0, plan.cfg_scale, model.lm_head_weight)
    if state.not_finite.any():  # a position of a full last block after the completion
        row, column = (int(v) for v in state.not_finite.nonzero()[0])
        after = column - int(layout.completion_columns[row, -1])
        raise ValueError(f"generate: the model's output for prompt {row} at the {after}. position after its "
                         "completion (full_last_block decodes the rest of the last block) is NaN or infinite; check "
                         "the model's weights and inputs (e.g. fp16 overflow).")
