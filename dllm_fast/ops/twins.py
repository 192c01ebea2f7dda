"""Plain-PyTorch twins of the compiled ops, with the exact semantics of the kernels: the ops' `backend="reference"`,
and the oracles the tests compare the kernels to (re-exported by dllm_fast.reference with the algorithms' twins).

- the fused masked log-prob op: the whole [M, V] logits, then log-softmax and gather (`masked_logprobs`,
  `masked_logprobs_grad`);
- the sampling ops: `philox4x32_10`, `gumbel_noise`, `sample_tokens` (same Philox stream, so tokens match the
  kernels at every temperature up to floating-point near-ties), `transfer_ranks` and `select_transfer`.

They sit under ops/ because the ops dispatch to them: imports point down, and the fast path never imports
dllm_fast.reference.
"""

from __future__ import annotations

import torch

from dllm_fast.contracts import accumulate_dtype


def masked_logprobs(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logp[i] = log_softmax(hidden[i] @ lm_head_weight.T)[targets[i]], computed in fp32 (fp64 for fp64); NaN for
    a target outside [0, V), as in the kernels."""
    acc = accumulate_dtype(hidden.dtype)
    logits = hidden.to(acc) @ lm_head_weight.to(acc).T
    targets = targets.long()
    inside = (targets >= 0) & (targets < logits.shape[-1])
    logp = torch.log_softmax(logits, dim=-1).gather(-1, torch.where(inside, targets, 0)[:, None]).squeeze(-1)
    return logp.masked_fill(~inside, float("nan"))


def masked_logprobs_grad(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor,
                         grad_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, grad_hidden, grad_weight) of sum(grad_logp * logp) by autograd through the full logits; the
    gradients in the inputs' dtypes."""
    acc = accumulate_dtype(hidden.dtype)
    with torch.enable_grad():
        h = hidden.detach().to(acc).requires_grad_(True)
        w = lm_head_weight.detach().to(acc).requires_grad_(True)
        logp = masked_logprobs(h, w, targets)
        grad_hidden, grad_weight = torch.autograd.grad((grad_logp.detach().to(acc) * logp).sum(), (h, w))
    return logp.detach(), grad_hidden.to(hidden.dtype), grad_weight.to(lm_head_weight.dtype)


# ---------------------------------------------------------------------------------------------------------
# The sampling ops. Philox4x32-10 on int64 tensors holding uint32 values (products are split so nothing overflows
# int64).

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


def gumbel_from_words(words: torch.Tensor) -> torch.Tensor:
    """fp32 standard Gumbel noise of uint32 Philox words (int64 tensor): v = (w + 1/2) / 2^32 in fp32, capped at
    the largest float below 1 (the words from 0xFFFFFF80 round to 1.0, whose noise would be -inf), then
    -log(-log1p(-v))."""
    uniform = words.to(torch.float32) * 2.3283064365386963e-10 + 1.1641532182693481e-10
    uniform = uniform.clamp(max=1.0 - 2.0**-24)
    return -torch.log(-torch.log1p(-uniform))


def gumbel_noise(seed: int, offset: int, row_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, V] fp32 standard Gumbel noise of the compiled sampler: for row r and token j, Philox word j % 4 of
    counter (j // 4, r low, r high, offset) under key (seed low, seed high), through gumbel_from_words."""
    device = row_ids.device
    quads = torch.arange((vocab + 3) // 4, device=device, dtype=torch.int64)
    rows = row_ids.to(torch.int64)[:, None]
    counter = [quads[None, :].expand(len(rows), -1), (rows & _MASK32).expand(-1, len(quads)),
               (rows >> 32).expand(-1, len(quads)), torch.full_like(rows, offset & _MASK32).expand(-1, len(quads))]
    words = torch.stack(philox4x32_10(counter, (seed & _MASK32, (seed >> 32) & _MASK32)), dim=-1)
    return gumbel_from_words(words.reshape(len(rows), -1)[:, :vocab])


def sample_tokens(hidden, weight, row_ids, temperature, seed, offset, suppress_ids=(), confidence_exclude_ids=()):
    """Twin of the compiled sample op: (tokens [N] int64, confidence [N] fp32/fp64).

    As in the kernels (csrc/include/dllm_fast/gumbel_max.h): scores are logits * a + b * Gumbel noise with
    (a, b) = (1, T) for T < 1 and (1 / T, 1) otherwise, rounded to the accumulation dtype; suppressed ids, NaN
    and -inf scores never win; a row with nothing to win gets token -1 and confidence NaN; a sampled excluded id
    gets confidence 0; a NaN logit makes the row's confidence NaN.
    """
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = hidden.to(acc) @ weight.to(acc).T
    scores = logits
    if temperature != 0:
        logit_scale, noise_scale = (1.0, temperature) if temperature < 1 else (1.0 / temperature, 1.0)
        logit_scale, noise_scale = (torch.tensor(v, dtype=acc, device=logits.device)
                                    for v in (logit_scale, noise_scale))
        scores = logits * logit_scale + noise_scale * gumbel_noise(seed, offset, row_ids, logits.shape[1])
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


def transfer_ranks(confidence: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Rank of every candidate in its row by descending confidence, ties to the lowest position; the positions
    that are not candidates rank after all candidates."""
    order = torch.sort(confidence, dim=-1, descending=True, stable=True).indices
    first = torch.sort(candidates.gather(-1, order).to(torch.int8), dim=-1, descending=True, stable=True).indices
    order = order.gather(-1, first)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return ranks


def select_transfer(confidence, candidates, counts, threshold):
    """Twin of the compiled transfer selection: [B, n] bool, the positions to unmask this step. A NaN confidence
    ranks as -inf (by position among equals), -0 as +0."""
    confidence = confidence.to(torch.float64)
    confidence = confidence.masked_fill(confidence.isnan(), float("-inf")).add(0.0)
    ranks = transfer_ranks(confidence, candidates)
    if threshold is not None and threshold >= 0:
        return candidates & ((ranks == 0) | (confidence >= threshold))
    return candidates & (ranks < counts[:, None])



def rotate_half_rope(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of every head of x [B, L, heads, D]: x * cos + rotate_half(x) * sin written as
    x * tables[0] + roll(x * tables[1], D / 2) (tables from layers.rope_tables, [2, B, L, 1, D], sin's sign
    folded in), each product and the sum in the tables' dtype, rounded once to x's. Differentiable."""
    products = x.unsqueeze(0) * tables  # [2, B, L, heads, D]
    return (products[0] + products[1].roll(x.shape[-1] // 2, dims=-1)).to(x.dtype)


def rope(x: torch.Tensor, tables: torch.Tensor, rotated_heads: int) -> torch.Tensor:
    """The rope op: `rotate_half_rope` of the first `rotated_heads` heads of x [B, L, heads, D], the others
    copied; a new contiguous tensor."""
    return torch.cat((rotate_half_rope(x[:, :, :rotated_heads], tables), x[:, :, rotated_heads:]), dim=2)
