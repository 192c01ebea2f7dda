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
from dllm_fast.decoding import check_generate_args, initial_canvas

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
    """Twin of the compiled sample op: (tokens [N] int64, confidence [N] fp32/fp64)."""
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = hidden.to(acc) @ weight.to(acc).T
    logits[:, list(suppress_ids)] = float("-inf")
    scores = logits if temperature == 0 else logits / temperature + gumbel_noise(seed, offset, row_ids, logits.shape[1])
    tokens = scores.argmax(dim=-1)  # ties: the first (lowest) id
    confidence_logits = logits.clone()
    confidence_logits[:, list(confidence_exclude_ids)] = float("-inf")
    confidence = torch.softmax(confidence_logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
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
    caches and threshold work for batch > 1; the mask token is never sampled (LLaDA's code can pick it, leaving
    a position masked in the finished sequence).
    """
    steps_per_block = check_generate_args(
        model, input_ids, attention_mask, gen_length=gen_length, block_length=block_length, steps=steps,
        temperature=temperature, remasking=remasking, cfg_scale=cfg_scale, cache=cache, threshold=threshold,
        confidence_eos_eot_inf=confidence_eos_eot_inf, generator=generator)
    mask_id, device = model.mask_token_id, input_ids.device
    B, P = input_ids.shape
    total = P + gen_length
    x, attention_mask = initial_canvas(input_ids, attention_mask, gen_length, mask_id)
    prompt_positions = x != mask_id
    weight = model.lm_head_weight
    shift = logit_shift(model)
    kv = model.new_cache(2 * B if cfg_scale > 0 else B, total) if cache != "none" else None

    def logits_at(start: int, end: int, refresh: bool) -> torch.Tensor:
        """Logits for positions [start, end) of x, with the cache semantics of the current mode."""
        ids = x
        mask = attention_mask
        if cfg_scale > 0:
            ids = torch.cat([x, x.masked_fill(prompt_positions, mask_id)])
            mask = None if mask is None else torch.cat([mask, mask])
        if cache == "none":
            hidden = model(ids, attention_mask=mask)
            if shift:  # the hidden state at i - 1 predicts token i; position 0 is a prompt token, never sampled
                hidden = torch.cat([hidden[:, :1], hidden[:, :-1]], dim=1)
            hidden = hidden[:, start:end]
        elif refresh:
            hidden = model(ids, attention_mask=mask, cache=kv)[:, start:end]
        else:
            fed_end = total if cache == "prefix" else end
            hidden = model(ids[:, start:fed_end], attention_mask=mask, cache=kv, cache_start=start,
                           attend_length=total)[:, : end - start]
        logits = F.linear(hidden, weight)
        if cfg_scale > 0:
            cond, uncond = logits.chunk(2)
            logits = uncond + (cfg_scale + 1) * (cond - uncond)
        return logits

    nfe = 0
    for block in range(gen_length // block_length):
        start, end = P + block * block_length, P + (block + 1) * block_length
        schedule = None
        if steps_per_block is not None:
            schedule = transfer_schedule(x[:, start:end] == mask_id, steps_per_block)
        step = 0
        while True:
            if schedule is not None and step == steps_per_block:
                break
            if schedule is None and not (x[:, start:end] == mask_id).any():
                break
            # Positions fed this step: everything (no cache / refresh), [start, L) (prefix), the block (dual).
            refresh = cache == "none" or step == 0
            seen = 0 if refresh else start
            seen_end = total if (refresh or cache == "prefix") else end
            logits = logits_at(seen, seen_end, refresh)
            nfe += 1
            logits[:, :, mask_id] = float("-inf")  # never unmask to the mask token
            if logits_eos_inf:
                logits[:, :, model.eos_token_id] = float("-inf")
            if temperature == 0:
                x0 = logits.argmax(dim=-1)
            else:
                uniform = torch.rand(logits.shape, dtype=torch.float64, device=device, generator=generator)
                x0 = (logits.double().exp() / (-torch.log(uniform)) ** temperature).argmax(dim=-1)
            if remasking == "low_confidence":
                confidence_logits = logits.clone()
                if confidence_eos_eot_inf:
                    confidence_logits[:, :, [model.eos_token_id, model.eot_token_id]] = float("-inf")
                x0_p = torch.softmax(confidence_logits, dim=-1).gather(-1, x0[..., None]).squeeze(-1)
            else:
                x0_p = torch.rand(x0.shape, device=device, generator=generator)
            window = x[:, seen:seen_end]
            candidates = window == mask_id
            candidates[:, end - seen:] = False  # only the current block
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
                        chosen[row] |= x0_p[row] >= threshold
            chosen &= candidates
            window[chosen] = x0[chosen]
            step += 1
    completion = x[:, P:]
    return GenerationResult(x, completion, completion_mask(completion, model.eos_token_id), nfe, attention_mask)
