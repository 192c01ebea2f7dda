"""Plain-PyTorch twins of the sampling ops and of the published samplers.

- `philox4x32_10`, `gumbel_noise`, `sample_tokens`, `select_transfer`: the exact semantics of the compiled ops
  (same Philox stream, so tokens match the kernels at every temperature up to floating-point near-ties).
- `generate`: LLaDA's generate.py (block semi-autoregressive, low-confidence or random remasking, CFG, EOS
  options) with Fast-dLLM's parallel decoding (threshold) and prefix/dual caches: full logits over every fed
  position, float64 Gumbel noise from a torch.Generator, per-row top-k with ties to the lowest position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dllm_fast.contracts import GenerationResult, completion_mask, logit_shift
from dllm_fast.decoding import (check_block_done, check_generate_args, confidence_excluded_ids, initial_canvas,
                                raise_if_not_finite, suppressed_ids)

# ---------------------------------------------------------------------------------------------------------
# Philox4x32-10 on int64 tensors holding uint32 values (products are split so nothing overflows int64).

_MASK32 = 0xFFFFFFFF


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b_lo, b_hi = b & 0xFFFF, b >> 16
    low_part, high_part = a * b_lo, a * b_hi  # each < 2^48
    lo_sum = (low_part & _MASK32) + ((high_part & 0xFFFF) << 16)
    hi = (low_part >> 32) + (high_part >> 16) + (lo_sum >> 32)
    return hi & _MASK32, lo_sum & _MASK32


def philox4x32_10(counter: list[torch.Tensor], key: tuple[int, int]) -> list[torch.Tensor]:
    """Philox4x32-10 of four uint32 counter words (int64 tensors) under a two-word key."""
    c0, c1, c2, c3 = (c.to(torch.int64) & _MASK32 for c in counter)
    k0, k1 = key
    for _ in range(10):
        hi0, lo0 = _mul_hi_lo(0xD2511F53, c0)
        hi1, lo1 = _mul_hi_lo(0xCD9E8D57, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + 0x9E3779B9) & _MASK32, (k1 + 0xBB67AE85) & _MASK32
    return [c0, c1, c2, c3]


def gumbel_noise(seed: int, offset: int, row_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, V] fp32 standard Gumbel noise of the compiled sampler: for row r and token j, Philox word j % 4 of
    counter (j // 4, r low, r high, offset) under key (seed low, seed high), mapped to v = (w + 1/2) / 2^32 and
    then to -log(-log1p(-v))."""
    device = row_ids.device
    quads = torch.arange((vocab + 3) // 4, device=device, dtype=torch.int64)
    rows = row_ids.to(torch.int64)[:, None]
    counter = [quads[None, :].expand(len(rows), -1), (rows & _MASK32).expand(-1, len(quads)),
               (rows >> 32).expand(-1, len(quads)), torch.full_like(rows, offset & _MASK32).expand(-1, len(quads))]
    words = torch.stack(philox4x32_10(counter, (seed & _MASK32, (seed >> 32) & _MASK32)), dim=-1)
    words = words.reshape(len(rows), -1)[:, :vocab]
    uniform = words.to(torch.float32) * 2.3283064365386963e-10 + 1.1641532182693481e-10
    return -torch.log(-torch.log1p(-uniform))


def sample_tokens(hidden, weight, row_ids, temperature, seed, offset, suppress_ids=(), confidence_exclude_ids=()):
    """Twin of the compiled sample op: (tokens [N] int64, confidence [N] fp32/fp64).

    As in the kernels: scores are logits * (1 / T) (1 / T rounded to the accumulation dtype) plus Gumbel noise;
    suppressed ids, NaN and -inf scores never win; a row with nothing to win gets token -1 and confidence NaN;
    a sampled excluded id gets confidence 0; a NaN logit makes the row's confidence NaN.
    """
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = hidden.to(acc) @ weight.to(acc).T
    scores = logits
    if temperature != 0:
        inverse_temperature = torch.tensor(1.0 / temperature, dtype=acc, device=logits.device)
        scores = logits * inverse_temperature + gumbel_noise(seed, offset, row_ids, logits.shape[1])
    scores = scores.masked_fill(scores.isnan(), float("-inf"))
    scores[:, list(suppress_ids)] = float("-inf")
    best, tokens = scores.max(dim=-1)  # ties: the first (lowest) id
    tokens = torch.where(best > float("-inf"), tokens, -1)
    confidence_logits = logits.clone()
    confidence_logits[:, list(suppress_ids) + list(confidence_exclude_ids)] = float("-inf")
    confidence = torch.softmax(confidence_logits, dim=-1).gather(1, tokens.clamp(min=0)[:, None]).squeeze(1)
    excluded = torch.isin(tokens, torch.tensor(list(confidence_exclude_ids), dtype=torch.long, device=tokens.device))
    confidence = confidence.masked_fill(excluded, 0.0).masked_fill(tokens < 0, float("nan"))
    return tokens, confidence


def transfer_ranks(confidence: torch.Tensor) -> torch.Tensor:
    """Rank of every position in its row by descending confidence, ties to the lowest position."""
    order = torch.sort(confidence, dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return ranks


def select_transfer(confidence, candidates, counts, threshold):
    """Twin of the compiled transfer selection: [B, n] bool, the positions to unmask this step."""
    confidence = confidence.to(torch.float64).masked_fill(~candidates, float("-inf"))
    ranks = transfer_ranks(confidence)
    if threshold is not None and threshold >= 0:
        return candidates & ((ranks == 0) | (confidence >= threshold))
    return candidates & (ranks < counts[:, None])


# ---------------------------------------------------------------------------------------------------------
# The sampler


def transfer_schedule(masked_in_block: torch.Tensor, steps: int) -> torch.Tensor:
    """[B, steps] tokens to unmask per step (LLaDA's get_num_transfer_tokens): n // steps each, and the
    first n % steps steps one more."""
    n = masked_in_block.sum(dim=1, keepdim=True)
    step = torch.arange(steps, device=n.device)[None, :]
    return n // steps + (step < n % steps).to(torch.int64)


@torch.no_grad()
def generate(model, input_ids, attention_mask=None, *, gen_length, block_length, steps=None, temperature=0.0,
             remasking="low_confidence", cfg_scale=0.0, cache="none", threshold=None, logits_eos_inf=False,
             confidence_eos_eot_inf=False, generator=None) -> GenerationResult:
    """Reference block diffusion sampler (LLaDA generate.py + Fast-dLLM), the oracle for dllm_fast.generate.

    Differences from the published code, each deliberate: batches with left padding and an attention mask;
    top-k ties go to the lowest position (torch.topk leaves them unspecified); confidence_eos_eot_inf removes
    EOS and EoT from the confidence softmax at every temperature (LLaDA's code does both only at T = 0);
    caches and threshold work for batch > 1; the mask token is never decoded (removed from sampling and from
    the confidence softmax); a block is left once complete (Fast-dLLM), so steps beyond block_length run no
    forward; Gumbel-max runs in the log domain, argmax(logits / T - log(-log u)), the same argmax as LLaDA's
    exp(logits) / (-log u)^T without its overflow; a decoded position without a defined confidence (a NaN or
    +inf logit among the tokens that may be decoded) raises, as in the fused sampler.
    """
    plan = check_generate_args(
        model, input_ids, attention_mask, gen_length=gen_length, block_length=block_length, steps=steps,
        temperature=temperature, remasking=remasking, cfg_scale=cfg_scale, cache=cache, threshold=threshold,
        logits_eos_inf=logits_eos_inf, confidence_eos_eot_inf=confidence_eos_eot_inf, generator=generator)
    mask_id, device = model.mask_token_id, input_ids.device
    B, P = input_ids.shape
    total = P + gen_length
    x, attention_mask = initial_canvas(input_ids, attention_mask, gen_length, mask_id)
    prompt_positions = x != mask_id
    weight = model.lm_head_weight
    shift = logit_shift(model)
    guided = plan.cfg_scale > 0
    kv = plan.cache.new_cache(model, 2 * B if guided else B, total)
    suppress, exclude = suppressed_ids(model, plan), confidence_excluded_ids(model, plan)

    def logits_at(start: int, end: int, step: int) -> torch.Tensor:
        """Logits for the positions the cache policy feeds at this step of the block [start, end)."""
        ids = x
        mask = attention_mask
        if guided:
            ids = torch.cat([x, x.masked_fill(prompt_positions, mask_id)])
            mask = None if mask is None else torch.cat([mask, mask])
        hidden = plan.cache.forward(model, ids, mask, kv, start, end, step)
        if shift:  # the hidden state at i - 1 predicts token i; position 0 is a prompt token, never sampled
            hidden = torch.cat([hidden[:, :1], hidden[:, :-1]], dim=1)
        logits = F.linear(hidden, weight)
        if guided:
            cond, uncond = logits.chunk(2)
            logits = uncond + (plan.cfg_scale + 1) * (cond - uncond)
        return logits

    nfe = 0
    for block in range(gen_length // block_length):
        start, end = P + block * block_length, P + (block + 1) * block_length
        schedule = None
        if plan.steps_per_block is not None:
            schedule = transfer_schedule(x[:, start:end] == mask_id, plan.steps_per_block)
        for step in range(plan.step_limit(block_length)):
            if not (x[:, start:end] == mask_id).any():  # Fast-dLLM leaves a complete block
                break
            # Positions fed this step: everything (no cache / refresh), [start, L) (prefix), the block (dual).
            seen, seen_end = plan.cache.fed_span(start, end, total, step)
            logits = logits_at(start, end, step)
            nfe += 1
            window = x[:, seen:seen_end]
            candidates = window == mask_id
            candidates[:, end - seen:] = False  # only the current block
            logits[:, :, suppress] = float("-inf")
            # The kernels' rule: a decoded position without a defined confidence (a NaN or +inf logit among the
            # tokens not excluded) or without a token to sample raises; a NaN never wins the argmax.
            block_logits = logits[:, start - seen:end - seen]  # a view
            defining = block_logits.clone()
            defining[:, :, exclude] = float("-inf")
            undefined = (defining.isnan() | defining.isposinf()).any(dim=-1)
            block_logits.masked_fill_(block_logits.isnan(), float("-inf"))
            undefined |= (block_logits == float("-inf")).all(dim=-1)
            raise_if_not_finite(undefined & candidates[:, start - seen:end - seen], start - P, plan.cfg_scale, weight)
            if plan.temperature == 0:
                x0 = logits.argmax(dim=-1)
            else:
                uniform = torch.rand(logits.shape, dtype=torch.float64, device=device, generator=generator)
                x0 = (logits.double() / plan.temperature - torch.log(-torch.log(uniform))).argmax(dim=-1)
            x0_p = None
            if plan.remasking.uses_model_confidence:
                confidence_logits = logits.clone()
                confidence_logits[:, :, exclude] = float("-inf")
                x0_p = torch.softmax(confidence_logits, dim=-1).gather(-1, x0[..., None]).squeeze(-1)
            x0_p = plan.remasking.scores(x0_p, fed_shape=tuple(x0.shape), fed_positions=None, generator=generator,
                                         device=device)
            x0_p = x0_p.double().masked_fill(~candidates, float("-inf"))
            if schedule is not None:
                k = schedule[:, step]
                order = torch.sort(x0_p, dim=-1, descending=True, stable=True).indices
                chosen = torch.zeros_like(candidates)
                for row in range(B):  # the published per-row loop
                    chosen[row, order[row, : int(k[row])]] = True
            else:
                order = torch.sort(x0_p, dim=-1, descending=True, stable=True).indices
                chosen = torch.zeros_like(candidates)
                for row in range(B):
                    if candidates[row].any():
                        chosen[row, order[row, 0]] = True
                        chosen[row] |= x0_p[row] >= plan.threshold
            chosen &= candidates
            window[chosen] = x0[chosen]
        check_block_done(int((x[:, start:end] == mask_id).sum()), block, plan.step_limit(block_length))
    completion = x[:, P:]
    return GenerationResult(x, completion, completion_mask(completion, model.eos_token_id), nfe, attention_mask)
