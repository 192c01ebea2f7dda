"""Fused block semi-autoregressive diffusion sampling (LLaDA semantics, Fast-dLLM caches and parallel decoding).

Per step, the model body runs on the positions the cache policy feeds; the LM head runs only on positions of the
current block, inside the fused `sample_tokens` op (Gumbel-max and confidence in one pass over the vocabulary,
never a [B, L, V] tensor); `select_transfer` picks the positions to unmask without a Python loop over rows. The
step itself is one function (rollout/step.py) that runs eagerly or compiled whole (`compile=True`).

Host syncs (the host reading a value; counted by dllm_fast.testing.syncs, pinned by the tests): with a fixed schedule
none per step and one per block (the non-finite check); threshold decoding one per step (the largest number of
masked positions left in a row, zero ends the block, read with the non-finite flag), or, with
assumed_steps_per_block, none per step and one per block. At the boundary, the prompt checks read the values in
one sync, and LLaDAModel's token-id check in one more. On fake tensors (FakeTensorMode) every value check is
skipped: a fixed schedule, or threshold decoding with assumed_steps_per_block, runs without reading a value.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from dllm_fast.contracts import GenerationResult, block_length as block_length_of, completion_mask, mixed_dtypes_named
from dllm_fast.rollout.blocks import generate_blocks
from dllm_fast.rollout.cache import CachePolicy
from dllm_fast.rollout.config import GenerateConfig, rollout_config
from dllm_fast.rollout.plan import DecodingPlan, check_generate_args, initial_canvas, step_tensors, unmask_counts
from dllm_fast.rollout.resume import FROM_START, Resume, ResumePoint, check_resume
from dllm_fast.rollout.rules import check_assumed_steps, check_block_done, raise_if_not_finite
from dllm_fast.rollout.step import (_KEPT_STATES, COMPILED_STEP_GRAPHS, NOISE_STEP, STEP_IN_BLOCK, RolloutState,
                                    StepConstants, _graph_limit, compiled_step, denoise_step, masked_left_and_bad,
                                    step_constants)
from dllm_fast.validation import data_checks_enabled, values_checked


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    config: GenerateConfig | None = None,
    *,
    generator: torch.Generator | None = None,
    record_unmask_step: bool = False,
    record_step_predictions: bool = False,
    resume: Resume | None = None,
    **settings,
) -> GenerationResult:
    """Generate `gen_length` tokens after each prompt by block diffusion.

    The settings come as one `GenerateConfig` (`config`), as keywords (`gen_length=..., block_length=...`, each a
    GenerateConfig field), or both: keywords override the config's fields (dataclasses.replace), so
    `generate(model, ids, mask, config, temperature=0.0)` decodes `config` greedily. An unknown keyword is refused.

    Args:
        model: a diffusion LM with the dllm_fast model contract (hidden-state forward, lm_head_weight,
            mask_token_id, eos_token_id; eot_token_id for confidence_eos_eot_inf; new_cache for cache modes).
        input_ids: [B, P] prompts, left-padded; attention_mask: [B, P] bool, or integer 0/1 (1 on tokens, 0 on
            padding); float masks are rejected.
        config: the rollout settings below (rollout.GenerateConfig); settings: the same, as keywords.
        gen_length, block_length: the completion is decoded in gen_length / block_length blocks, left to right
            (a multiple of block_length on LLaDA; any length on a block-diffusion model, its last block partial,
            or whole with full_last_block).
        steps: total denoising steps (a multiple of the number of blocks); each step of a block unmasks
            block_length / steps_per_block tokens (the remainder goes to the first steps). A block is left as
            soon as it is complete (Fast-dLLM), so with more steps per block than block_length the extra steps
            run no forward and cost nothing: a call runs at most gen_length forwards (a block-diffusion model's,
            whose blocks align to each prompt, at most gen_length + 2 block_length: see below).
        temperature: 0 is greedy; T > 0 samples softmax(logits / T) exactly (Gumbel-max with Philox noise keyed
            by a key drawn once from `generator`, the denoising step, the row, and the position in the
            completion, so a prompt's sample depends on its row but not on how wide the batch is padded).
            T < 1e-30 (validation.GREEDY_BELOW_TEMPERATURE) is greedy: logits / T would leave fp32's range, and
            the sample is the argmax up to exact ties anyway. T must be finite (a large T is near-uniform).
        remasking: "low_confidence" unmasks the most probable sampled tokens first; "random" in random order
            (uniforms drawn from `generator`, as in LLaDA); or a rollout.Remasking (registry: REMASKING).
        cfg_scale: unsupervised classifier-free guidance, logits = u + (s + 1)(c - u) with the prompt masked for u.
        cache: "none" (full recompute), "prefix" or "dual" (Fast-dLLM; refreshed at every block start), or a
            rollout.CachePolicy (registry: CACHE_POLICIES).
        threshold: Fast-dLLM parallel decoding: unmask the most confident token plus every token with
            confidence >= threshold, until the block is done; needs steps=None.
        logits_eos_inf: never sample EOS. confidence_eos_eot_inf: EOS and EoT get confidence 0 (removed from
            the confidence softmax), so they are unmasked last within a block. This holds at every temperature;
            LLaDA's generate.py, through a chained assignment, removes only EoT when T > 0.
        generator: the source of all randomness, on input_ids' device; a fixed generator state gives
            identical outputs (None: torch's default generator of that device).
        compile: run each denoising step through torch.compile(fullgraph=True) (mode="reduce-overhead", CUDA
            graphs, on a GPU): one graph for every step, block and call of the same configuration; the first
            call compiles. A compiled step decodes every position of its block (static shapes), so the LM head
            also runs on already decoded positions; the tokens are those of eager mode.
        resume: rollout.Resume(canvas, start_step, num_steps), to resume a partly decoded canvas (d-TreeRPO's
            branching; rollout/resume.py): decode canvas ([B, P + gen_length], the sequences a call with the same
            settings returned after start_step steps of the global schedule, steps numbered 0 .. steps - 1 across
            blocks) from step start_step, for num_steps steps (None: to the end; canvas None: from the start).
            A call with num_steps stops there and returns the partly decoded canvas (masks left in it). Resumed
            with a generator in the state the first call started from, the tokens are the uninterrupted run's,
            at every temperature (random remasking draws per step, so not there). Fixed schedules on
            bidirectional models only; the prefix and dual caches resume at block boundaries only; not with
            compile, record_unmask_step or record_step_predictions. The canvas is
            checked against the schedule (its prompts, each block's masked count). nfe counts this call's forwards.
        record_unmask_step: also return GenerationResult.unmask_step, for each completion position the forward
            (0-based, counted across blocks like nfe) that unmasked it: every step lies in [0, nfe). Off, it costs
            nothing.
        record_step_predictions: also return, for every forward k, MDPO's one-step prediction x_hat_k
            (GenerationResult.step_predictions [B, K, G] int64, K = nfe: the canvas before forward k with every
            masked completion position filled by the model's sample) and its confidences (step_confidence
            [B, K, G] float32); unmask_step is recorded with it (the canvas x_k masks the positions whose
            unmask_step is >= k). Memory: steps x batch x gen_length int64 and as many float32 (12 bytes each:
            e.g. 128 steps x 64 rows x 512 tokens is 50 MiB), and each step runs the LM head on every masked
            position from the block on (gen_length rows at most) instead of the block's. The tokens decoded are
            those of the unrecorded call. Bidirectional models only, eagerly (compile=False), with cache "none"
            or "prefix" (or one block); anything else is refused. Off, it costs nothing.
        full_last_block: block-diffusion models: decode each row's last block whole, as the official SDAR (and
            LLaDA2) generate does: the positions of the last block after the completion are masked, decoded with
            it and dropped, and they change its tokens. Default False: the last block ends with the completion.
            (A bidirectional model's blocks start at the prompt's end: its last block is always whole.)
        eos_early_stop: block-diffusion models only: once every row's finished blocks hold an EOS, decode no
            further block (LLaDA2's generate); the completions up to their first EOS are unchanged, later
            undecoded positions are EOS.
        unmask_schedule: the fixed schedule's counts per block: "even" (the split above) or "ass" (CJ-GRPO's
            ascending step-size schedule: 2^s tokens at step s of a block, the rest at its last step, so a block of
            2^K tokens takes K = floor(log2 block_length) steps: 1, 2, 4, ..., 2^(K-1) + 1; steps must be
            (gen_length / block_length, rounded up) K, or None; no threshold; a block model's partial last block
            runs the same schedule until it is decoded; resume takes it, its canvas at ASS's step counts).
        eos_schedule: CJ-GRPO's EOSER, (gamma_min, gamma_max) or None: a position whose sampled token is EOS ranks by
            its confidence times gamma_s = gamma_min + (gamma_max - gamma_min) t_s at step s of a block's K steps,
            t_s = s / (K - 1) (even) or (2^(s+1) - 1) / 2^K (ass), so an early EOS is unmasked late (the official
            code's (0.01, 1.0) with ASS). Needs a fixed schedule and a confidence-ranking remasking rule; it
            replaces confidence_eos_eot_inf (the factor 0), which it refuses beside it.
        assumed_steps_per_block: threshold decoding only: instead of reading the masked count after every step
            (one host sync), assume each block completes in this many steps. For planning on fake tensors, where
            no value can be read; a real run checks at each block's end that the block is complete.

    Bounds (each refused at once, naming the value and the fix): the padded prompt length plus gen_length fits the
    model's positions (`max_sequence_length`, when the model declares it), as the trainer's; steps < 2^31 (the noise
    key's step word); B x gen_length <= 2^32 (its position word; B x (gen_length + block_length) with
    full_last_block). Within them a call's cost is bounded by its gen_length forwards (+ 2 block_length on a
    block-diffusion model), whatever steps is.

    On a block-diffusion model (contracts.block_length: SDAR) the completion is decoded block by block with the
    model's blocks, aligned to each prompt's first token (rollout/blocks.py): block_length must be the model's,
    cache is "block" (the exact cache of finished blocks) or "none", threshold with steps is SDAR's dynamic rule
    (every candidate above the threshold, at least the schedule's count), and cfg_scale is 0. A prompt whose
    length is not a multiple of block_length starts with a partial block and ends with one, and a batch whose rows
    fall on different alignments decodes the union of their block windows: at most gen_length / block_length
    (rounded up) + 2 windows of at most min(steps per block, block_length) forwards each
    (`blocks.max_block_forwards`), so nfe can exceed gen_length; it is the exact count, and bounds unmask_step.

    The mask token is never sampled nor argmaxed: it is removed from sampling and from the confidence softmax,
    like EOS under logits_eos_inf (a deviation from LLaDA's generate.py, whose completions can hold it). A NaN or
    infinite hidden state, or a NaN or +inf logit, at a position being decoded raises ValueError naming the
    LM-head row at fault, or else the prompt and the completion position (on CUDA with a fixed schedule at the
    end of the block, to avoid a host sync per step); such a position is never unmasked.

    Returns: GenerationResult(sequences [B, P+G], completion_ids [B, G], completion_mask [B, G] (up to and
        including the first EOS), nfe (forwards that unmasked something), attention_mask, unmask_step).
    """
    config = rollout_config(config, settings, "generate")
    plan = check_generate_args(model, input_ids, attention_mask, config, generator=generator,
                               record_unmask_step=record_unmask_step,
                               record_step_predictions=record_step_predictions)
    gen_length, block_length = config.gen_length, config.block_length
    resume = check_resume(model, plan, input_ids, gen_length, block_length, resume)
    reads_values = data_checks_enabled(input_ids, attention_mask, model.lm_head_weight)
    if plan.threshold is not None and plan.assumed_steps_per_block is None and not reads_values:
        raise ValueError("threshold decoding reads the masked count after every step, and these tensors hold no "
                         "values (fake or meta); pass assumed_steps_per_block=N to plan it.")
    if block_length_of(model) is not None:  # block-causal attention: decode block by block (rollout/blocks.py)
        return generate_blocks(model, plan, input_ids, attention_mask, gen_length, block_length, generator)
    device = input_ids.device
    B, P = input_ids.shape
    state, result_mask = start_rollout(model, plan, input_ids, attention_mask, gen_length, block_length, generator)
    if resume.canvas is not None:
        state.canvas.copy_(resume.canvas)
    constants = step_constants(model, plan, P, block_length, B)
    step_fn = denoise_step
    if plan.compile:
        step_fn = compiled_step(device.type)
        if device.type == "cuda":  # CUDA graphs replay on fixed addresses: the buffers the steps write
            for tensor in state.tensors():
                torch._dynamo.mark_static_address(tensor, guard=False)
    with mixed_dtypes_named(model), _graph_limit(COMPILED_STEP_GRAPHS) if plan.compile else nullcontext():
        nfe = decode(model, plan, state, constants, step_fn, P, gen_length, block_length, generator, resume)
    sequences, unmask_step = state.canvas, state.unmask_step
    if plan.compile:  # the buffers are kept for the next call: the result gets its own copy
        sequences, unmask_step = sequences.clone(), None if unmask_step is None else unmask_step.clone()
    completion = sequences[:, P:]
    predictions = confidence = None
    if state.step_predictions is not None:  # the forwards that ran, of the buffer's bound
        predictions, confidence = state.step_predictions[:, :nfe], state.step_confidence[:, :nfe]
    return GenerationResult(sequences, completion, completion_mask(completion, model.eos_token_id), nfe,
                            result_mask, unmask_step, predictions, confidence)


def decode(model, plan: DecodingPlan, state: RolloutState, constants: StepConstants, step_fn, P: int,
           gen_length: int, block_length: int, generator, resume: ResumePoint = FROM_START) -> int:
    """The block loop: runs the steps of every block (those `resume` names), and returns the number of
    forwards."""
    device, B = state.canvas.device, state.canvas.shape[0]
    feeds = FedPositions(plan.cache, P, gen_length, block_length, device, dynamic=plan.compile)
    reads_values = data_checks_enabled(state.canvas, model.lm_head_weight)
    # Of a schedule longer than the block, only the first block_length steps can run (plan.step_limit).
    schedule = None if plan.steps_per_block is None else unmask_counts(block_length, plan.step_limit(block_length),
                                                                         plan.unmask_schedule)
    nfe = 0
    recorded = None
    if state.step_predictions is not None:  # MDPO's record: each step predicts the block and every later position
        recorded = [torch.arange(P + block * block_length, P + gen_length, device=device)
                    for block in range(gen_length // block_length)]
    for block in range(gen_length // block_length):
        begin, end = resume.block_steps(block, plan.step_limit(block_length))
        if begin == end:  # decoded before this call (or after it stops)
            continue
        positions = torch.arange(P + block * block_length, P + (block + 1) * block_length, device=device)
        state.counters[STEP_IN_BLOCK] = begin
        if plan.steps_per_block is not None:  # the noise step is the schedule's: skipped steps change no sample
            state.counters[NOISE_STEP] = block * plan.steps_per_block + begin
        # the most masked positions in a row: a new block is fully masked, a resumed one as its schedule left it
        remaining = block_length - (sum(schedule[:begin]) if schedule is not None else 0)
        for step in range(begin, end):
            if remaining == 0:  # the block is complete: leave it (Fast-dLLM), no forward that unmasks nothing
                break
            fed = feeds(block, step)
            drawn = feeds.mark(plan.remasking.draw((B, P + gen_length if fed is None else len(fed)), generator,
                                                   device), fed)
            # Compiled, a step decodes the whole block (a static shape); without the masked count, so must one
            # that assumes the steps; else the most masked positions any row has left.
            rows = block_length if plan.compile or plan.assumed_steps_per_block else remaining
            decoded = positions if recorded is None else recorded[block]  # recording: the block and all after it
            with values_checked():  # the prompts were checked once: the model skips its per-call check
                step_fn(model, state, constants, decoded, fed, rows, drawn)
            nfe += 1
            if schedule is not None:
                remaining -= schedule[step]
            elif plan.assumed_steps_per_block is not None:
                remaining = 0 if step + 1 == plan.assumed_steps_per_block else remaining
            else:  # threshold decoding's one host sync per step, which reads the non-finite flag too
                remaining, any_bad = masked_left_and_bad(state, positions, model.mask_token_id)
                if any_bad:
                    raise_if_not_finite(state.not_finite, 0, plan.cfg_scale, model.lm_head_weight)
        if not resume.finishes(block):  # the call stops inside this block: only the non-finite check applies
            if reads_values:
                raise_if_not_finite(state.not_finite, 0, plan.cfg_scale, model.lm_head_weight)
            break
        if reads_values:
            check_block_end(state, plan, positions, block, model)
        check_block_done(remaining if plan.assumed_steps_per_block is None else 0, block,
                         plan.step_limit(block_length))
    return nfe


class FedPositions:
    """The positions each step feeds: None for a step that refreshes (it feeds every position), else the cache
    policy's reused span of the block, as a tensor made once per block. With dynamic=True (compiled) a span whose
    length varies between blocks (the prefix cache's) is marked dynamic: one graph serves every block."""

    def __init__(self, policy: CachePolicy, prompt_length: int, gen_length: int, block_length: int, device,
                 dynamic: bool):
        self.policy, self.device = policy, device
        self.spans = reused_spans(policy, prompt_length, gen_length, block_length)
        self.dynamic = dynamic and len({hi - lo for lo, hi in self.spans}) > 1
        self._block, self._positions = None, None

    def __call__(self, block: int, step: int) -> torch.Tensor | None:
        if self.policy.refreshes(step):
            return None
        if self._block != block:
            self._block, self._positions = block, torch.arange(*self.spans[block], device=self.device)
            if self.dynamic:
                torch._dynamo.maybe_mark_dynamic(self._positions, 0)
        return self._positions

    def mark(self, drawn: torch.Tensor | None, fed: torch.Tensor | None) -> torch.Tensor | None:
        """A remasking rule's draw over the fed positions: as dynamic as their span."""
        if self.dynamic and drawn is not None and fed is not None:
            torch._dynamo.maybe_mark_dynamic(drawn, 1)
        return drawn


def start_rollout(model, plan: DecodingPlan, input_ids, attention_mask, gen_length: int, block_length: int,
                  generator) -> tuple[RolloutState, torch.Tensor | None]:
    """The buffers of a call (no host-to-device copy, which would sync on a GPU; compiled, the model's last
    call's, refilled) and the result's attention mask."""
    device, mask_id = input_ids.device, model.mask_token_id
    B, P = input_ids.shape
    canvas, result_mask = initial_canvas(input_ids, attention_mask, gen_length, mask_id)
    guided = plan.cfg_scale > 0
    step_mask = result_mask
    if guided and result_mask is not None:
        step_mask = torch.cat([result_mask, result_mask])
    schedule = eos_factor = None
    if plan.steps_per_block is not None:  # unmask_counts (and EOSER's factors), built on the device
        schedule, eos_factor = step_tensors(plan, block_length, plan.step_limit(block_length), device)
    noise_key = torch.zeros((), dtype=torch.long, device=device)
    if plan.temperature > 0:  # 62 random bits, drawn once on the device: no host sync
        noise_key = torch.randint(2**62, (), generator=generator, device=device)
    shapes = (device, B, P, gen_length, block_length, plan.steps_per_block, guided, step_mask is not None,
              plan.record_unmask_step, plan.cache, model.lm_head_weight.dtype, plan.unmask_schedule, plan.eos_schedule)
    kept = _KEPT_STATES.get(model) if plan.compile else None
    if kept is not None and kept[0] == shapes:
        kept[1].restart(canvas, step_mask, noise_key)
        return kept[1], result_mask
    state = RolloutState(
        canvas=canvas,
        kv=plan.cache.new_cache(model, 2 * B if guided else B, P + gen_length),
        attention_mask=step_mask,
        masked_prompt=torch.full((B, P), mask_id, dtype=torch.long, device=device) if guided else None,
        noise_key=noise_key,
        counters=torch.zeros(3, dtype=torch.long, device=device),
        schedule=schedule,
        row_base=torch.arange(B, device=device)[:, None] * gen_length,
        not_finite=torch.zeros(B, gen_length, dtype=torch.bool, device=device),
        unmask_step=torch.full((B, gen_length), -1, dtype=torch.long, device=device)
        if plan.record_unmask_step else None,
        eos_factor=eos_factor,
    )
    if plan.record_step_predictions:  # a forward per step at most: the blocks' step limits
        forwards = gen_length // block_length * plan.step_limit(block_length)
        state.step_predictions = torch.full((B, forwards, gen_length), mask_id, dtype=torch.long, device=device)
        state.step_confidence = torch.zeros(
            B, forwards, gen_length, device=device,
            dtype=torch.float64 if model.lm_head_weight.dtype == torch.float64 else torch.float32)
    if plan.compile:
        _KEPT_STATES[model] = (shapes, state)
    return state, result_mask


def reused_spans(policy: CachePolicy, prompt_length: int, gen_length: int, block_length: int):
    """The (lo, hi) span of every block that a step reusing the cache feeds (none for a policy without one)."""
    if not policy.uses_cache:
        return []
    total = prompt_length + gen_length
    starts = range(prompt_length, total, block_length)
    return [policy.reused_span(start, start + block_length, total) for start in starts]


def check_block_end(state: RolloutState, plan: DecodingPlan, positions, block: int, model) -> None:
    """At a block's end (one host sync where the steps read nothing): raise on a non-finite output, and check
    that assumed_steps_per_block completed the block."""
    if plan.threshold is not None and plan.assumed_steps_per_block is None:
        return  # the last step's read covered it
    if plan.assumed_steps_per_block is None:
        raise_if_not_finite(state.not_finite, 0, plan.cfg_scale, model.lm_head_weight)
        return
    masked, any_bad = masked_left_and_bad(state, positions, model.mask_token_id)
    if any_bad:
        raise_if_not_finite(state.not_finite, 0, plan.cfg_scale, model.lm_head_weight)
    check_assumed_steps(masked, plan.assumed_steps_per_block, block)
