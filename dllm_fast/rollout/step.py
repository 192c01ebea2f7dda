"""One denoising step as one function of (model, state, step inputs, constants): the forward under the cache
policy, the fused LM-head sampling, transfer selection and the write-back. `generate` runs it eagerly, or
captured whole by torch.compile(fullgraph=True) (`compiled_step`; CUDA graphs on a GPU).

What lets one compiled graph serve every step, block and call:

- Everything that changes between steps is a tensor on the device: the block's positions, the positions a cached
  step feeds, the noise counters (advanced in place by the step), the call's noise key. The Python values a step
  sees (`StepConstants`) are fixed for a call; torch.compile guards on them.
- The canvas, the KV cache and the per-call records are buffers written in place: the KV cache at tensor
  positions (index_copy_), never at a Python slice.
- Compiled, a step decodes every position of its block (a static shape; the already decoded ones are not
  candidates). Eagerly it decodes only the masked ones, as many as the most-masked row holds: the same tokens,
  and less LM-head work.
- The prefix cache feeds the block and everything after it, a span that shrinks block by block: that length is
  marked dynamic (one graph; on a GPU, one CUDA-graph recording per block length, reused by every later step
  and call). Padding it to a fixed length instead would recompute up to gen_length positions every step, the
  work the prefix cache exists to save.
- The sampler's noise is keyed only through the op's row ids (a tensor): the call's 62-bit key XOR (step << 32 |
  row * gen_length + position), with the op's seed and offset fixed at 0. A Python seed or offset would
  recompile every step (dynamo specialises ints), and as a SymInt a CUDA graph would be re-recorded per value.
- Nothing reads a value on the host: no host sync, so a step also runs on fake tensors (the planner).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch

from dllm_fast import ops
from dllm_fast.contracts import logit_shift
from dllm_fast.ops.backend import default_chunk_size
from dllm_fast.rollout.cache import CachePolicy
from dllm_fast.rollout.plan import DecodingPlan
from dllm_fast.rollout.remasking import Remasking
from dllm_fast.rollout.rules import confidence_excluded_ids, suppressed_ids

# Counters a step advances in place: the noise step (the Philox step word), forwards so far, step in the block.
NOISE_STEP, FORWARDS, STEP_IN_BLOCK = 0, 1, 2


@dataclass(frozen=True)
class StepConstants:
    """The Python values of a generate call that every step shares (compiled: guarded, never a recompile)."""

    prompt_length: int
    block_length: int
    mask_id: int
    logit_shift: int
    temperature: float
    threshold: float | None  # None: the fixed schedule (RolloutState.schedule); with a schedule too: its minimum
    cfg_scale: float
    cache: CachePolicy
    remasking: Remasking
    suppress_ids: tuple[int, ...]
    exclude_ids: tuple[int, ...]
    chunk_size: int  # the LM head's vocabulary chunk, one for the call: eager and compiled sum alike
    decode_whole_block: bool  # compiled: every position of the block (static shapes); eager: the masked ones
    eos_id: int = -1  # the token whose confidence EOSER scales (RolloutState.eos_factor)


@dataclass
class RolloutState:
    """The tensors of a generate call that its steps read and write in place.

    canvas: [B, P + G] the prompts, then the completion being unmasked. kv: the KV cache, or None.
    attention_mask: [B, P + G] (doubled for CFG) or None. masked_prompt: CFG's unconditional prompt [B, P].
    noise_key: [] int64, the call's random key (0 at T = 0). counters: [3] int64 (NOISE_STEP, FORWARDS,
    STEP_IN_BLOCK). schedule: [steps per block] tokens a fixed-schedule step unmasks (None in threshold mode).
    row_base: [B, 1] row * gen_length; a block rollout's full last block adds two columns, the column where each
    row's completion ends and the jump of the words from there on (rollout/blocks.py). not_finite: [B, G] completion positions whose output had no defined
    confidence. unmask_step: [B, G] the forward that unmasked each position (-1: not yet), or None. eos_factor:
    [steps per block] float64, EOSER's factor on the confidence of a sampled EOS at each step (None: off).
    """

    canvas: torch.Tensor
    kv: object | None
    attention_mask: torch.Tensor | None
    masked_prompt: torch.Tensor | None
    noise_key: torch.Tensor
    counters: torch.Tensor
    schedule: torch.Tensor | None
    row_base: torch.Tensor
    not_finite: torch.Tensor
    unmask_step: torch.Tensor | None
    # MDPO's step record (generate(record_step_predictions=True)): [B, forwards bound, G] each forward's one-step
    # prediction of the completion and its confidences; None when not recorded.
    step_predictions: torch.Tensor | None = None
    step_confidence: torch.Tensor | None = None
    # EOSER's factor at each step of a block [steps] (float64); None without eos_schedule.
    eos_factor: torch.Tensor | None = None

    def restart(self, canvas: torch.Tensor, attention_mask: torch.Tensor | None, noise_key: torch.Tensor) -> None:
        """Start a new call of the same shapes in these buffers, in place (their addresses stay). The KV cache
        needs no reset: every block's first step refreshes all of it before any step reads it."""
        self.canvas.copy_(canvas)
        if self.attention_mask is not None:
            self.attention_mask.copy_(attention_mask)
        self.noise_key.copy_(noise_key)
        self.counters.zero_()
        self.not_finite.zero_()
        if self.unmask_step is not None:
            self.unmask_step.fill_(-1)

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer the steps write in place (CUDA graphs need their addresses fixed)."""
        written = [self.canvas, self.counters, self.not_finite, self.unmask_step]
        if self.kv is not None:
            written += self.kv.tensors()
        return [tensor for tensor in written if tensor is not None]


def denoise_step(model, state: RolloutState, constants: StepConstants, block: torch.Tensor,
                 fed: torch.Tensor | None, rows: int, drawn: torch.Tensor | None) -> None:
    """Unmask the positions one step of the block `block` ([block_length] positions in the canvas) decides.

    fed: the [F] positions a cached step feeds (None: every position, refreshing the cache); rows: how many
    positions of each row to decode when decoding only masked ones (the most any row still has masked); drawn: the
    remasking rule's random numbers for this step (Remasking.draw). Writes the canvas, the KV cache,
    not_finite, unmask_step, and advances the counters.

    Recording the step's prediction (state.step_predictions; eager only): `block` is then the block followed by
    every later completion position; all of them are decoded and recorded, and only the block's first
    block_length positions are candidates to unmask (their samples are the unrecorded step's: the noise is keyed
    by position).
    """
    c = constants
    canvas = state.canvas
    B = canvas.shape[0]
    window = canvas.index_select(1, block)  # [B, block_length] (recording: to the end), a copy
    masked = window == c.mask_id
    recording = state.step_predictions is not None
    if c.decode_whole_block or recording:
        positions = torch.arange(window.shape[1], device=canvas.device).expand(B, -1)
        candidates = masked & (positions < c.block_length) if recording else masked
    else:  # the first `rows` masked positions of each row, in position order (rows with fewer pad with unmasked)
        positions = torch.argsort((~masked).to(torch.int8), dim=1, stable=True)[:, :rows]
        candidates = masked.gather(1, positions)
    at = block[positions]  # [B, n] canvas positions decoded
    completion_at = at - c.prompt_length

    ids = canvas
    if state.masked_prompt is not None:  # CFG: the conditional and the unconditional (prompt masked) halves
        ids = torch.cat([canvas, torch.cat([state.masked_prompt, canvas[:, c.prompt_length:]], dim=1)])
    hidden = c.cache.forward_fed(model, ids, state.attention_mask, state.kv, fed)
    weight = model.lm_head_weight  # read after the forward: FSDP2 gathers the root's weights in it
    in_fed = at if fed is None else at - fed[0]  # [B, n] the positions among those fed
    index = (in_fed - c.logit_shift)[..., None].expand(-1, -1, hidden.shape[-1])
    if state.masked_prompt is None:
        rows_hidden = hidden.gather(1, index)
    else:  # logits are linear in hidden, so guidance can be applied before the LM head
        cond, uncond = hidden.gather(1, torch.cat([index, index])).chunk(2)
        rows_hidden = uncond + (c.cfg_scale + 1) * (cond - uncond)
    # A non-finite output is flagged (the caller raises), zeroed so the kernel never sees it, and never unmasked.
    bad_rows = ~torch.isfinite(rows_hidden).all(dim=-1)
    rows_hidden = rows_hidden.masked_fill(bad_rows[..., None], 0)
    stream = state.noise_key ^ ((state.counters[NOISE_STEP] << 32) | position_words(state.row_base, completion_at))
    tokens, confidence = ops.sample_tokens(
        rows_hidden.reshape(-1, rows_hidden.shape[-1]), weight, temperature=c.temperature, seed=0, offset=0,
        row_ids=stream.reshape(-1), suppress_ids=c.suppress_ids, confidence_exclude_ids=c.exclude_ids,
        chunk_size=c.chunk_size, check_finite=False)
    tokens, confidence = tokens.view(positions.shape), confidence.view(positions.shape)
    bad = (bad_rows | confidence.isnan() | (tokens < 0)) & (masked if recording else candidates)
    if recording:  # x_hat: the canvas before this step, every masked position filled by its sample
        record_step(state, completion_at, torch.where(masked, tokens, window),
                    torch.where(masked, confidence, torch.zeros((), dtype=confidence.dtype, device=canvas.device)))
    state.not_finite.scatter_(1, completion_at, state.not_finite.gather(1, completion_at) | bad)
    candidates = candidates & ~bad
    if state.eos_factor is not None:  # EOSER: a sampled EOS ranks by its confidence times the step's factor
        factor = state.eos_factor.index_select(0, state.counters[STEP_IN_BLOCK:STEP_IN_BLOCK + 1])
        confidence = torch.where(tokens == c.eos_id, (confidence.double() * factor).to(confidence.dtype), confidence)

    fed_length = ids.shape[1] if fed is None else fed.shape[0]
    scores = c.remasking.rank(confidence, drawn, fed_shape=(B, fed_length), fed_positions=in_fed,
                              device=canvas.device)
    if c.threshold is None or state.schedule is not None:
        counts = state.schedule.index_select(0, state.counters[STEP_IN_BLOCK:STEP_IN_BLOCK + 1]).expand(B)
        if c.threshold is not None:  # SDAR's dynamic rule: every candidate above the threshold, at least counts
            counts = torch.maximum(counts, ((scores > c.threshold) & candidates).sum(dim=1))
        transfer = ops.select_transfer(scores, candidates, counts=counts, check_finite=False)
    else:
        transfer = ops.select_transfer(scores, candidates, threshold=c.threshold, check_finite=False)
    canvas.scatter_(1, at, torch.where(transfer, tokens, window.gather(1, positions)))
    if state.unmask_step is not None:
        previous = state.unmask_step.gather(1, completion_at)
        state.unmask_step.scatter_(1, completion_at, torch.where(transfer, state.counters[FORWARDS], previous))
    state.counters.add_(1)


def record_step(state: RolloutState, completion_at: torch.Tensor, predicted: torch.Tensor,
                confidence: torch.Tensor) -> None:
    """Write this forward's prediction of the completion ([B, n] at completion columns `completion_at`, the
    columns before them decoded already) and its confidences into the step record, at index FORWARDS."""
    completion = state.canvas[:, state.canvas.shape[1] - state.step_predictions.shape[2]:]
    full = completion.scatter(1, completion_at, predicted)
    scores = torch.zeros(completion.shape, dtype=state.step_confidence.dtype, device=completion.device).scatter(
        1, completion_at, confidence.to(state.step_confidence.dtype))
    forward = state.counters[FORWARDS:FORWARDS + 1]
    state.step_predictions.index_copy_(1, forward, full[:, None, :])
    state.step_confidence.index_copy_(1, forward, scores[:, None, :])


def position_words(row_base: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """The noise counter's position word of each decoded column [B, n]: row_base [B, 1] plus the column, and with
    a block rollout's full last block ([B, 3]: also the column where each completion ends and the jump after it,
    rollout/blocks.py) the positions after the completion flagged apart from every row's completion words."""
    words = row_base[:, :1] + columns
    if row_base.shape[1] == 3:
        words = words + (columns >= row_base[:, 1:2]) * row_base[:, 2:3]
    return words


@functools.cache
def compiled_step(device_type: str, backend: str = "inductor"):
    """denoise_step compiled whole (fullgraph: a graph break is an error), once per process, device type and
    backend; on CUDA with inductor's mode="reduce-overhead" (CUDA graphs). Tests pass backend="aot_eager" to
    check the capture without inductor's code generation.

    dynamic=False: nothing becomes dynamic behind our back (automatic dynamic would turn a temperature that
    changes between calls into a symbolic float, which the op faces cannot check); the one dynamic size, the
    prefix cache's span, is marked by generate."""
    mode = "reduce-overhead" if device_type == "cuda" and backend == "inductor" else None
    return torch.compile(denoise_step, fullgraph=True, dynamic=False, backend=backend, mode=mode)


# Graphs the compiled step may hold (dynamo's default is 8, then fullgraph fails): each configuration of a call
# (model, batch and lengths, temperature, threshold, cache policy, remasking) compiles one or two.
COMPILED_STEP_GRAPHS = 64


def _graph_limit(graphs: int):
    """Dynamo's per-function graph limit raised while the compiled step runs (named cache_size_limit before
    torch 2.6)."""
    config = torch._dynamo.config
    return config.patch(**{"recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit": graphs})


# Compiled, the buffers of a model's last call are kept for its next call of the same shapes: a CUDA graph
# replays on the addresses it recorded (new buffers would re-record it), and the KV cache is not reallocated.
_KEPT_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def step_constants(model, plan: DecodingPlan, prompt_length: int, block_length: int, batch: int) -> StepConstants:
    weight = model.lm_head_weight
    return StepConstants(
        prompt_length=prompt_length, block_length=block_length, mask_id=model.mask_token_id,
        logit_shift=logit_shift(model), temperature=plan.temperature, threshold=plan.threshold,
        cfg_scale=plan.cfg_scale, cache=plan.cache, remasking=plan.remasking,
        suppress_ids=tuple(suppressed_ids(model, plan)), exclude_ids=tuple(confidence_excluded_ids(model, plan)),
        chunk_size=default_chunk_size(batch * block_length, weight.shape[0], weight.device),
        decode_whole_block=plan.compile, eos_id=model.eos_token_id if plan.eos_schedule is not None else -1)


def masked_left_and_bad(state: RolloutState, positions: torch.Tensor, mask_id: int) -> tuple[int, bool]:
    """The most masked positions left in a row of the block, and whether any output was non-finite: one host
    sync."""
    left = (state.canvas.index_select(1, positions) == mask_id).sum(dim=1).max()
    masked, any_bad = torch.stack([left, state.not_finite.any().long()]).tolist()
    return masked, bool(any_bad)
