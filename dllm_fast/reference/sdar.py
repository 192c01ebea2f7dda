"""SDAR-family block diffusion in plain PyTorch, written from the equations, one row at a time: the oracle for
dllm_fast.models.SDARModel, for block rollouts (dllm_fast.generate on a block model) and for block likelihoods.

- `forward`: the Qwen3/SDAR layer equations with explicit per-head loops, on the official weight names.
- `dense_block_causal_mask`: the block-causal mask built the obvious way, pair by pair.
- `generate`: a decoder that recomputes every block from scratch (no KV cache) with the dense mask, each prompt
  alone and unpadded (what the official generate does at batch 1), greedy.
- `block_logprobs`: per-block scoring: for each sample and each block, a forward on [the prompt as the mask leaves
  it, the clean earlier blocks, the block as the mask leaves it].

Blocks count from a row's first real token, so a left-padded row here is its unpadded prompt.
"""

from __future__ import annotations

import math

import torch

from dllm_fast.reference import eoser_ass


def dense_block_causal_mask(length: int, block_length: int) -> torch.Tensor:
    """[length, length] bool: i reads j when j's block is not after i's (blocks of block_length from 0)."""
    allowed = torch.zeros(length, length, dtype=torch.bool)
    for i in range(length):
        for j in range(length):
            allowed[i, j] = j // block_length <= i // block_length
    return allowed


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half rotary embedding of x [T, head_dim] at integer positions [T]."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=x.dtype) * 2 / x.shape[-1])
    angle = positions.to(x.dtype)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angle.cos(), angle.cos()], -1), torch.cat([angle.sin(), angle.sin()], -1)
    rotated = torch.cat([-x[:, half:], x[:, :half]], -1)
    return x * cos + rotated * sin


def forward(weights: dict[str, torch.Tensor], config, ids: torch.Tensor, allowed: torch.Tensor,
            positions: torch.Tensor) -> torch.Tensor:
    """One sequence: ids [T], allowed [T, T] bool (query, key), positions [T] -> hidden [T, d] after the final
    norm. `weights` by the official key names (an SDARModel's named_parameters() qualify, gradients flow);
    `config` has the official field names."""
    eps, theta, hd = config.rms_norm_eps, config.rope_theta, config.head_dim
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    x = weights["model.embed_tokens.weight"][ids]
    for layer in range(config.num_hidden_layers):
        w = {name[len(f"model.layers.{layer}."):]: value for name, value in weights.items()
             if name.startswith(f"model.layers.{layer}.")}
        n = _rms(x, w["input_layernorm.weight"], eps)
        q, k, v = (n @ w[f"self_attn.{name}_proj.weight"].T for name in "qkv")
        outputs = []
        for h in range(heads):
            g = h // (heads // kv_heads)  # the key/value head this query head shares
            qh = _rope(_rms(q[:, h * hd:(h + 1) * hd], w["self_attn.q_norm.weight"], eps), positions, theta)
            kh = _rope(_rms(k[:, g * hd:(g + 1) * hd], w["self_attn.k_norm.weight"], eps), positions, theta)
            vh = v[:, g * hd:(g + 1) * hd]
            scores = (qh @ kh.T / math.sqrt(hd)).masked_fill(~allowed, float("-inf"))
            outputs.append(torch.softmax(scores, dim=-1) @ vh)
        h_ = x + torch.cat(outputs, -1) @ w["self_attn.o_proj.weight"].T
        m = _rms(h_, w["post_attention_layernorm.weight"], eps)
        gate, up = m @ w["mlp.gate_proj.weight"].T, m @ w["mlp.up_proj.weight"].T
        x = h_ + (gate * torch.sigmoid(gate) * up) @ w["mlp.down_proj.weight"].T
    return _rms(x, weights["model.norm.weight"], eps)


def lm_head(weights: dict[str, torch.Tensor], config) -> torch.Tensor:
    return weights["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]


def _row(tokens: torch.Tensor, attention_mask: torch.Tensor | None, n: int) -> int:
    """The first real column of row n."""
    if attention_mask is None:
        return 0
    return int(attention_mask[n].ne(0).nonzero()[0])


@torch.no_grad()
def generate(weights, config, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *, gen_length: int,
             steps: int | None = None, threshold: float | None = None, mask_token_id: int, forward_fn=None,
             head: torch.Tensor | None = None, full_last_block: bool = False, unmask_schedule: str = "even",
             eos_schedule: tuple[float, float] | None = None, eos_token_id: int | None = None) -> torch.Tensor:
    """Greedy block decoding, each prompt alone: [B, P] left-padded prompts -> completions [B, gen_length].

    Every step runs the whole sequence so far (through the current block) with the dense block-causal mask. The
    first block holds the prompt's last partial block; the last block ends at gen_length, or with full_last_block
    (the official generate's canvas of whole blocks) at the end of its block, its positions after the completion
    masked, decoded with it and dropped. Per step of a block:
    every masked position's argmax (the mask token never) and its probability; unmask the schedule's count
    (the block size split evenly over steps / (gen_length / block), remainder first) of the most probable, ties
    to the lowest position ("low_confidence_static"); with a threshold too, at least that count and every one
    above the threshold ("low_confidence_dynamic"); with a threshold and no steps, the most probable one plus
    every one at or above the threshold (Fast-dLLM). A block is left once complete. forward_fn and head: another
    block-diffusion family's forward (same signature as `forward`) and LM head (reference/llada2.py).
    unmask_schedule="ass" (steps=None: int(log2 b) per block) and eos_schedule (with eos_token_id): CJ-GRPO's
    decoders, the official rules in each block (reference/eoser_ass.py).
    """
    b = config.block_size
    forward_fn = forward if forward_fn is None else forward_fn
    head = lm_head(weights, config) if head is None else head
    steps_per_block = None if steps is None else steps // -(-gen_length // b)  # a last block may be partial
    ass = unmask_schedule == "ass"
    if ass:
        steps_per_block = eoser_ass.ass_steps(b)
    rows = []
    for n in range(input_ids.shape[0]):
        prompt = input_ids[n, _row(input_ids, attention_mask, n):]
        P = prompt.shape[0]
        total = -(-(P + gen_length) // b) * b if full_last_block else P + gen_length
        x = torch.cat([prompt, torch.full((total - P,), mask_token_id, dtype=prompt.dtype)])
        for block in range(P // b, -(-total // b)):
            start, end = block * b, min((block + 1) * b, total)
            for step in range(b if steps_per_block is None else steps_per_block):
                masked = x[start:end] == mask_token_id
                if not masked.any():
                    break
                hidden = forward_fn(weights, config, x[:end], dense_block_causal_mask(end, b), torch.arange(end))
                logits = hidden[start:end] @ head.T
                logits[:, mask_token_id] = float("-inf")
                probs = torch.softmax(logits, dim=-1)
                tokens = logits.argmax(-1)
                confidence = probs.gather(-1, tokens[:, None])[:, 0]
                if eos_schedule is not None:
                    confidence = eoser_ass.scale_eos(confidence, tokens, eos_token_id,
                                                     eoser_ass.eos_factor(step, steps_per_block, eos_schedule, ass))
                confidence = confidence.masked_fill(~masked, float("-inf"))
                order = torch.sort(confidence, descending=True, stable=True).indices
                if ass:  # the block's own schedule: 2^step, the rest of the block at its last step
                    count = eoser_ass.ass_transfer_schedule(torch.ones(1, b, dtype=torch.bool), steps_per_block)
                    count = int(count[0, step])
                elif steps_per_block is not None:
                    base, remainder = divmod(b, steps_per_block)
                    count = base + (1 if step < remainder else 0)
                    if threshold is not None:
                        count = max(count, int((confidence > threshold).sum()))
                else:
                    count = 1 + int((confidence[order[1:]] >= threshold).sum())
                chosen = torch.zeros_like(masked)
                chosen[order[:count]] = True
                chosen &= masked
                x[start:end] = torch.where(chosen, tokens, x[start:end])
        rows.append(x[P:P + gen_length])
    return torch.stack(rows)


def block_logprobs(weights, config, sequences: torch.Tensor, masked: torch.Tensor, prompt_length: int,
                   attention_mask: torch.Tensor | None, mask_token_id: int, forward_fn=None,
                   head: torch.Tensor | None = None) -> torch.Tensor:
    """lp [N, n_t, L]: log p(x_i) at every masked completion position i (0 elsewhere), scored block by block.

    sequences [N, P + L] left-padded; masked [N, n_t, P + L] bool. Sample j of row n scores each block k that
    holds a masked completion position with a forward on [the row's columns before block k, the prompt's masked
    as the sample masks them and the completion clean; then block k as the sample masks it], through block k's
    end, with the dense block-causal mask. Differentiable in the weights. forward_fn and head: as in `generate`.
    """
    b = config.block_size
    forward_fn = forward if forward_fn is None else forward_fn
    head = lm_head(weights, config) if head is None else head
    N, n_t, S = masked.shape
    L = S - prompt_length
    out = []
    for n in range(N):
        first = _row(sequences, attention_mask, n)
        tokens = sequences[n, first:]
        P = prompt_length - first
        samples = []
        for j in range(n_t):
            mask = masked[n, j, first:]
            noisy = tokens.masked_fill(mask, mask_token_id)
            context = torch.cat([noisy[:P], tokens[P:]])  # prompt as masked, completion clean
            lp = torch.zeros(L, dtype=head.dtype)
            for block in range(P // b, -(-tokens.shape[0] // b)):
                start, end = block * b, min((block + 1) * b, tokens.shape[0])
                targets = [i for i in range(max(start, P), end) if mask[i]]
                if not targets:
                    continue
                ids = torch.cat([context[:start], noisy[start:end]])
                hidden = forward_fn(weights, config, ids, dense_block_causal_mask(end, b), torch.arange(end))
                logp = torch.log_softmax(hidden[targets] @ head.T, dim=-1)
                values = logp.gather(-1, tokens[targets][:, None])[:, 0]
                lp = lp.index_put((torch.tensor(targets) - P,), values)
            samples.append(lp)
        out.append(torch.stack(samples))
    return torch.stack(out)
