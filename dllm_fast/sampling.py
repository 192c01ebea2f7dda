"""Fused block semi-autoregressive diffusion sampling (LLaDA semantics, Fast-dLLM caches and parallel decoding).

Per step, the model body runs on the positions the cache mode needs; the LM head runs only on the still-masked
positions of the current block, inside the fused `sample_tokens` op (Gumbel-max and confidence in one pass
over the vocabulary, never a [B, L, V] tensor); `select_transfer` picks the positions to unmask without a
Python loop over rows. With a fixed schedule every row has the same number of masked positions at each step,
so that number is known on the host and no step needs a host sync; threshold mode syncs once per step for
the largest number of masked positions left in a row (zero ends the block).
"""

from __future__ import annotations

import torch

from dllm_fast import ops
from dllm_fast.contracts import GenerationResult, completion_mask, logit_shift
from dllm_fast.decoding import check_generate_args, initial_canvas


def masked_count_schedule(block_length: int, steps_per_block: int) -> list[int]:
    """Tokens unmasked at each step of a fully masked block: LLaDA's even split, remainder first."""
    base, remainder = divmod(block_length, steps_per_block)
    return [base + (1 if i < remainder else 0) for i in range(steps_per_block)]


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
    remasking: str = "low_confidence",
    cfg_scale: float = 0.0,
    cache: str = "none",
    threshold: float | None = None,
    logits_eos_inf: bool = False,
    confidence_eos_eot_inf: bool = False,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Generate `gen_length` tokens after each prompt by block diffusion.

    Args:
        model: a diffusion LM with the dllm_fast model contract (hidden-state forward, lm_head_weight,
            mask_token_id, eos_token_id; eot_token_id for confidence_eos_eot_inf; new_cache for cache modes).
        input_ids: [B, P] prompts, left-padded; attention_mask: [B, P], 1 on tokens, 0 on padding.
        gen_length, block_length: the completion is decoded in gen_length / block_length blocks, left to right.
        steps: total denoising steps (a multiple of the number of blocks); each step of a block unmasks
            block_length / steps_per_block tokens (the remainder goes to the first steps).
        temperature: 0 is greedy; T > 0 samples softmax(logits / T) exactly (Gumbel-max with Philox noise keyed
            by a seed drawn once from `generator`, the row, and the position in the completion, so a prompt's
            sample depends on its row but not on how wide the batch is padded).
        remasking: "low_confidence" unmasks the most probable sampled tokens first; "random" in random order
            (uniforms drawn from `generator`, as in LLaDA).
        cfg_scale: unsupervised classifier-free guidance, logits = u + (s + 1)(c - u) with the prompt masked for u.
        cache: "none" (full recompute), "prefix" or "dual" (Fast-dLLM; refreshed at every block start).
        threshold: Fast-dLLM parallel decoding: unmask the most confident token plus every token with
            confidence >= threshold, until the block is done; needs steps=None.
        logits_eos_inf: never sample EOS (the mask token is never sampled in any case: unmasking to it would
            leave the position masked in the finished rollout). confidence_eos_eot_inf: EOS and EoT get
            confidence 0 (removed from the confidence softmax), so they are unmasked last within a block. This
            holds at every temperature; LLaDA's generate.py, through a chained assignment, removes only EoT
            when T > 0.
        generator: the source of all randomness, on input_ids' device; a fixed generator state gives
            identical outputs (None: torch's default generator).

    Returns: GenerationResult(sequences [B, P+G], completion_ids [B, G], completion_mask [B, G] (up to and
        including the first EOS), nfe).
    """
    steps_per_block = check_generate_args(
        model, input_ids, attention_mask, gen_length=gen_length, block_length=block_length, steps=steps,
        temperature=temperature, remasking=remasking, cfg_scale=cfg_scale, cache=cache, threshold=threshold,
        confidence_eos_eot_inf=confidence_eos_eot_inf, generator=generator)
    device, mask_id = input_ids.device, model.mask_token_id
    B, P = input_ids.shape
    total = P + gen_length
    x, result_mask = initial_canvas(input_ids, attention_mask, gen_length, mask_id)
    attention_mask = result_mask
    if cfg_scale > 0:
        masked_prompt = torch.full((B, P), mask_id, dtype=torch.long, device=device)  # CFG's unconditional input
        attention_mask = None if attention_mask is None else torch.cat([attention_mask, attention_mask])
    shift = logit_shift(model)  # the hidden state at i - shift predicts token i
    kv = model.new_cache(2 * B if cfg_scale > 0 else B, total) if cache != "none" else None
    seed = 0
    if temperature > 0:
        seed = int(torch.randint(2**62, (1,), generator=generator,
                                 device=generator.device if generator is not None else "cpu"))
    # Unmasking to the mask token would leave an unfinished rollout, so it is never sampled.
    suppress = [mask_id] + ([model.eos_token_id] if logits_eos_inf else [])
    exclude = [model.eos_token_id, model.eot_token_id] if confidence_eos_eot_inf else []
    weight = model.lm_head_weight
    # Noise is keyed by (row, position in the completion): a prompt's sample does not depend on the padded width.
    row_base = torch.arange(B, device=device)[:, None] * gen_length

    def block_hidden(start: int, end: int, refresh: bool) -> torch.Tensor:
        """Hidden states [B, end - start, d] of the current block under the cache mode (CFG applied)."""
        ids = x if cfg_scale <= 0 else torch.cat([x, torch.cat([masked_prompt, x[:, P:]], dim=1)])
        if cache == "none":
            hidden = model(ids, attention_mask=attention_mask)[:, start - shift:end - shift]
        elif refresh:
            hidden = model(ids, attention_mask=attention_mask, cache=kv)[:, start:end]
        else:
            fed_end = total if cache == "prefix" else end
            hidden = model(ids[:, start:fed_end], attention_mask=attention_mask, cache=kv, cache_start=start,
                           attend_length=total)[:, : end - start]
        if cfg_scale > 0:  # logits are linear in hidden, so guidance can be applied before the LM head
            cond, uncond = hidden.chunk(2)
            hidden = uncond + (cfg_scale + 1) * (cond - uncond)
        return hidden

    nfe = 0
    for block in range(gen_length // block_length):
        start, end = P + block * block_length, P + (block + 1) * block_length
        schedule = masked_count_schedule(block_length, steps_per_block) if steps_per_block is not None else None
        remaining = block_length
        step = 0
        while schedule is None or step < len(schedule):
            window = x[:, start:end]
            masked = window == mask_id
            if schedule is None:
                remaining = int(masked.sum(dim=1).max())  # threshold mode: the one host sync per step
                if remaining == 0:
                    break
            # The first `remaining` masked positions of each row (a stable argsort keeps position order). With a
            # fixed schedule every row has exactly `remaining`; in threshold mode rows with fewer pad with
            # unmasked positions, which are not candidates.
            positions = torch.argsort((~masked).to(torch.int8), dim=1, stable=True)[:, :remaining]
            candidates = masked.gather(1, positions)
            refresh = cache == "none" or step == 0
            hidden = block_hidden(start, end, refresh)
            rows = hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))
            tokens, confidence = ops.sample_tokens(
                rows.reshape(-1, rows.shape[-1]), weight, temperature=temperature, seed=seed, offset=nfe,
                row_ids=(row_base + (start - P) + positions).reshape(-1), suppress_ids=suppress,
                confidence_exclude_ids=exclude)
            if remasking == "random":  # LLaDA draws one uniform per fed position, in this order
                seen = 0 if refresh else start
                seen_end = total if (refresh or cache == "prefix") else end
                uniform = torch.rand((B, seen_end - seen), device=device, generator=generator)
                confidence = uniform.gather(1, positions + (start - seen))
            confidence = confidence.reshape(positions.shape)
            if schedule is None:
                transfer = ops.select_transfer(confidence, candidates, threshold=threshold)
            else:
                counts = torch.full((B,), schedule[step], dtype=torch.long, device=device)
                transfer = ops.select_transfer(confidence, candidates, counts=counts)
                remaining -= schedule[step]
            current = window.gather(1, positions)
            window.scatter_(1, positions, torch.where(transfer, tokens.view(positions.shape), current))
            nfe += 1
            step += 1
    completion = x[:, P:]
    return GenerationResult(x, completion, completion_mask(completion, model.eos_token_id), nfe, result_mask)
