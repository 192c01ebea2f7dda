"""Fused block semi-autoregressive diffusion sampling (LLaDA semantics, Fast-dLLM caches and parallel decoding).

Per step, the model body runs on the positions the cache policy feeds; the LM head runs only on the still-masked
positions of the current block, inside the fused `sample_tokens` op (Gumbel-max and confidence in one pass
over the vocabulary, never a [B, L, V] tensor); `select_transfer` picks the positions to unmask without a
Python loop over rows. With a fixed schedule every row has the same number of masked positions at each step,
so that number is known on the host and a step needs no host sync (non-finite outputs are checked once per
block); threshold mode syncs once per step for the largest number of masked positions left in a row (zero ends
the block) and the non-finite flag together.
"""

from __future__ import annotations

import torch

from dllm_fast import ops
from dllm_fast.contracts import GenerationResult, completion_mask, logit_shift
from dllm_fast.rollout.cache import CachePolicy
from dllm_fast.rollout.plan import check_generate_args, initial_canvas, masked_count_schedule
from dllm_fast.rollout.remasking import Remasking
from dllm_fast.rollout.rules import (check_block_done, confidence_excluded_ids,
                                     raise_if_not_finite, suppressed_ids)


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    gen_length: int,
    block_length: int,
    steps: int | None = None,
    temperature: float = 0.0,
    remasking: str | Remasking = "low_confidence",
    cfg_scale: float = 0.0,
    cache: str | CachePolicy = "none",
    threshold: float | None = None,
    logits_eos_inf: bool = False,
    confidence_eos_eot_inf: bool = False,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Generate `gen_length` tokens after each prompt by block diffusion.

    Args:
        model: a diffusion LM with the dllm_fast model contract (hidden-state forward, lm_head_weight,
            mask_token_id, eos_token_id; eot_token_id for confidence_eos_eot_inf; new_cache for cache modes).
        input_ids: [B, P] prompts, left-padded; attention_mask: [B, P] bool, or integer 0/1 (1 on tokens, 0 on
            padding); float masks are rejected.
        gen_length, block_length: the completion is decoded in gen_length / block_length blocks, left to right.
        steps: total denoising steps (a multiple of the number of blocks); each step of a block unmasks
            block_length / steps_per_block tokens (the remainder goes to the first steps). A block is left as
            soon as it is complete (Fast-dLLM), so with more steps per block than block_length the extra steps
            run no forward.
        temperature: 0 is greedy; T > 0 samples softmax(logits / T) exactly (Gumbel-max with Philox noise keyed
            by a seed drawn once from `generator`, the denoising step, the row, and the position in the
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
            identical outputs (None: torch's default generator).

    The mask token is never sampled nor argmaxed: it is removed from sampling and from the confidence softmax,
    like EOS under logits_eos_inf (a deviation from LLaDA's generate.py, whose completions can hold it). A NaN or
    infinite hidden state, or a NaN or +inf logit, at a position being decoded raises ValueError naming the
    LM-head row at fault, or else the prompt and the completion position (on CUDA with a fixed schedule at the
    end of the block, to avoid a host sync per step); such a position is never unmasked.

    Returns: GenerationResult(sequences [B, P+G], completion_ids [B, G], completion_mask [B, G] (up to and
        including the first EOS), nfe (forwards that unmasked something), attention_mask).
    """
    plan = check_generate_args(
        model, input_ids, attention_mask, gen_length=gen_length, block_length=block_length, steps=steps,
        temperature=temperature, remasking=remasking, cfg_scale=cfg_scale, cache=cache, threshold=threshold,
        logits_eos_inf=logits_eos_inf, confidence_eos_eot_inf=confidence_eos_eot_inf, generator=generator)
    device, mask_id = input_ids.device, model.mask_token_id
    B, P = input_ids.shape
    total = P + gen_length
    x, result_mask = initial_canvas(input_ids, attention_mask, gen_length, mask_id)
    attention_mask = result_mask
    guided = plan.cfg_scale > 0
    if guided:
        masked_prompt = torch.full((B, P), mask_id, dtype=torch.long, device=device)  # CFG's unconditional input
        attention_mask = None if attention_mask is None else torch.cat([attention_mask, attention_mask])
    shift = logit_shift(model)  # the hidden state at i - shift predicts token i
    kv = plan.cache.new_cache(model, 2 * B if guided else B, total)
    seed = 0
    if plan.temperature > 0:
        seed = int(torch.randint(2**62, (1,), generator=generator,
                                 device=generator.device if generator is not None else "cpu"))
    suppress, exclude = suppressed_ids(model, plan), confidence_excluded_ids(model, plan)
    # Noise is keyed by (row, position in the completion): a prompt's sample does not depend on the padded width.
    row_base = torch.arange(B, device=device)[:, None] * gen_length

    def block_hidden(start: int, end: int, step: int) -> torch.Tensor:
        """Hidden states [B, end - start, d] predicting the current block under the cache policy (CFG applied)."""
        ids = x if not guided else torch.cat([x, torch.cat([masked_prompt, x[:, P:]], dim=1)])
        fed_start, _ = plan.cache.fed_span(start, end, total, step)
        hidden = plan.cache.forward(model, ids, attention_mask, kv, start, end, step)
        hidden = hidden[:, start - shift - fed_start:end - shift - fed_start]
        if guided:  # logits are linear in hidden, so guidance can be applied before the LM head
            cond, uncond = hidden.chunk(2)
            hidden = uncond + (plan.cfg_scale + 1) * (cond - uncond)
        return hidden

    nfe = 0
    for block in range(gen_length // block_length):
        start, end = P + block * block_length, P + (block + 1) * block_length
        window = x[:, start:end]  # a view: steps write their tokens into x
        schedule = None if plan.steps_per_block is None else masked_count_schedule(block_length, plan.steps_per_block)
        not_finite = torch.zeros(B, block_length, dtype=torch.bool, device=device)
        remaining = block_length  # the most masked positions in a row; a new block is fully masked
        for step in range(plan.step_limit(block_length)):
            if remaining == 0:  # the block is complete: leave it (Fast-dLLM), no forward that unmasks nothing
                break
            masked = window == mask_id
            # The first `remaining` masked positions of each row (a stable argsort keeps position order). With a
            # fixed schedule every row has exactly `remaining`; in threshold mode rows with fewer pad with
            # unmasked positions, which are not candidates.
            positions = torch.argsort((~masked).to(torch.int8), dim=1, stable=True)[:, :remaining]
            candidates = masked.gather(1, positions)
            hidden = block_hidden(start, end, step)
            weight = model.lm_head_weight  # read after the forward: FSDP2 gathers the root's weights in it
            rows = hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))
            # A non-finite output is flagged (raised below without a host sync per step), zeroed so the kernel
            # never sees it, and never unmasked.
            bad_rows = ~torch.isfinite(rows).all(dim=-1)
            rows = rows.masked_fill(bad_rows[..., None], 0)
            # The noise offset is the denoising step, so skipping a complete block's steps changes no sample.
            offset = nfe if schedule is None else block * plan.steps_per_block + step
            tokens, confidence = ops.sample_tokens(
                rows.reshape(-1, rows.shape[-1]), weight, temperature=plan.temperature, seed=seed, offset=offset,
                row_ids=(row_base + (start - P) + positions).reshape(-1), suppress_ids=suppress,
                confidence_exclude_ids=exclude, check_finite=False)
            tokens, confidence = tokens.view(positions.shape), confidence.view(positions.shape)
            bad = (bad_rows | confidence.isnan() | (tokens < 0)) & candidates
            not_finite |= torch.zeros_like(not_finite).scatter_(1, positions, bad)
            candidates &= ~bad
            fed_start, fed_end = plan.cache.fed_span(start, end, total, step)
            scores = plan.remasking.scores(confidence, fed_shape=(B, fed_end - fed_start),
                                           fed_positions=positions + (start - fed_start), generator=generator,
                                           device=device)
            if schedule is None:
                transfer = ops.select_transfer(scores, candidates, threshold=plan.threshold, check_finite=False)
            else:
                counts = torch.full((B,), schedule[step], dtype=torch.long, device=device)
                transfer = ops.select_transfer(scores, candidates, counts=counts, check_finite=False)
            window.scatter_(1, positions, torch.where(transfer, tokens, window.gather(1, positions)))
            nfe += 1
            if schedule is None:  # threshold mode's one host sync per step reads the non-finite flag too
                left = torch.stack([(window == mask_id).sum(dim=1).max(), not_finite.any().long()])
                remaining, any_bad = left.tolist()
                if any_bad:
                    raise_if_not_finite(not_finite, start - P, plan.cfg_scale, weight)
            else:
                remaining -= schedule[step]
        raise_if_not_finite(not_finite, start - P, plan.cfg_scale, weight)
        check_block_done(remaining, block, plan.step_limit(block_length))
    completion = x[:, P:]
    return GenerationResult(x, completion, completion_mask(completion, model.eos_token_id), nfe, result_mask)
