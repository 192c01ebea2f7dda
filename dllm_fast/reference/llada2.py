"""LLaDA2-family mixture-of-experts block diffusion in plain PyTorch, written from the equations, one row at a time:
the oracle for dllm_fast.models.LLaDA2Model, its rollouts and its likelihoods.

- `route`: the router's choice and weights, token by token from the definition (sigmoid scores; groups ranked by
  the sum of their two best biased scores; the best experts of the kept groups by biased score; the unbiased
  scores of the chosen normalised and scaled). Ties go to the lower group and expert index (the definition
  leaves them open; the model reproduces torch.topk's rule, as the official code does, so tests compare on
  tie-free scores and check tied ones separately).
- `forward`: the layer equations with explicit per-head loops on the official weight names, the experts as a
  dense sum over every expert weighted by the router's weights (zero for the experts not chosen).
- `generate`, `block_logprobs`: reference/sdar.py's block decoder and per-block scoring on this forward.

Weights come by official names: `official_weights(model)` gives them for a LLaDA2Model (views of its parameters,
so gradients flow).
"""

from __future__ import annotations

import math

import torch

from dllm_fast.reference import sdar


def official_weights(model) -> dict[str, torch.Tensor]:
    """A LLaDA2Model's parameters and buffers under the official checkpoint names (views: gradients flow)."""
    return type(model).official_state_dict(model.state_dict(keep_vars=True))


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    """Rotate-half rotary embedding of the first rotary_dim dimensions of x [T, head_dim] (frequencies over
    rotary_dim), the others unchanged."""
    half = rotary_dim // 2
    inv_freq = theta ** (-torch.arange(half, dtype=x.dtype) * 2 / rotary_dim)
    angle = positions.to(x.dtype)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angle.cos(), angle.cos()], -1), torch.cat([angle.sin(), angle.sin()], -1)
    part = x[:, :rotary_dim]
    rotated = torch.cat([-part[:, half:], part[:, :half]], -1)
    return torch.cat([part * cos + rotated * sin, x[:, rotary_dim:]], -1)


def _swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    g = x @ gate.T
    return (g * torch.sigmoid(g) * (x @ up.T)) @ down.T


def route(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, config) -> tuple[list[list[int]], torch.Tensor]:
    """(chosen experts of each token, best first; dense weights [T, E], zero off the chosen) for x [T, d]."""
    E, G = config.num_experts, config.n_group
    per_group = E // G
    scores = torch.sigmoid(x @ router.T)
    biased = scores + bias
    chosen, dense = [], torch.zeros_like(scores)
    for t in range(x.shape[0]):
        b = biased[t].tolist()
        group_score = [sum(sorted(b[g * per_group:(g + 1) * per_group], reverse=True)[:2]) for g in range(G)]
        groups = sorted(range(G), key=lambda g: (-group_score[g], g))[:config.topk_group]
        candidates = [e for e in range(E) if e // per_group in groups]
        picked = sorted(candidates, key=lambda e: (-b[e], e))[:config.num_experts_per_tok]
        total = sum(scores[t, e] for e in picked) if len(picked) > 1 else 1.0
        for e in picked:
            dense[t, e] = scores[t, e] / (total + (1e-20 if len(picked) > 1 else 0.0)) * config.routed_scaling_factor
        chosen.append(picked)
    return chosen, dense


def moe(w: dict[str, torch.Tensor], x: torch.Tensor, config) -> torch.Tensor:
    """A mixture-of-experts layer on x [T, d] with the layer's weights `w` (official names after "mlp."): every
    expert run on every token, weighted by the router's dense weights, plus the shared expert."""
    _, dense = route(x, w["gate.weight"], w["gate.expert_bias"], config)
    y = torch.zeros_like(x)
    for e in range(config.num_experts):
        out = _swiglu(x, w[f"experts.{e}.gate_proj.weight"], w[f"experts.{e}.up_proj.weight"],
                      w[f"experts.{e}.down_proj.weight"])
        y = y + dense[:, e:e + 1] * out
    if config.num_shared_experts is not None:
        y = y + _swiglu(x, w["shared_experts.gate_proj.weight"], w["shared_experts.up_proj.weight"],
                        w["shared_experts.down_proj.weight"])
    return y


def forward(weights: dict[str, torch.Tensor], config, ids: torch.Tensor, allowed: torch.Tensor,
            positions: torch.Tensor) -> torch.Tensor:
    """One sequence: ids [T], allowed [T, T] bool (query, key), positions [T] -> hidden [T, d] after the final
    norm. `weights` by the official names (official_weights(model)); `config` a LLaDA2Config."""
    eps, theta, hd, rotary = config.rms_norm_eps, config.rope_theta, config.head_dim, config.rotary_dim
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    x = weights["model.word_embeddings.weight"][ids]
    for layer in range(config.num_hidden_layers):
        w = {name[len(f"model.layers.{layer}."):]: value for name, value in weights.items()
             if name.startswith(f"model.layers.{layer}.")}
        n = _rms(x, w["input_layernorm.weight"], eps)
        qkv = n @ w["attention.query_key_value.weight"].T
        q, k, v = qkv[:, :heads * hd], qkv[:, heads * hd:(heads + kv_heads) * hd], qkv[:, (heads + kv_heads) * hd:]
        outputs = []
        for h in range(heads):
            g = h // (heads // kv_heads)
            qh = _rope(_rms(q[:, h * hd:(h + 1) * hd], w["attention.query_layernorm.weight"], eps), positions, theta,
                       rotary)
            kh = _rope(_rms(k[:, g * hd:(g + 1) * hd], w["attention.key_layernorm.weight"], eps), positions, theta,
                       rotary)
            scores = (qh @ kh.T / math.sqrt(hd)).masked_fill(~allowed, float("-inf"))
            outputs.append(torch.softmax(scores, dim=-1) @ v[:, g * hd:(g + 1) * hd])
        h_ = x + torch.cat(outputs, -1) @ w["attention.dense.weight"].T
        m = _rms(h_, w["post_attention_layernorm.weight"], eps)
        mlp = {name[len("mlp."):]: value for name, value in w.items() if name.startswith("mlp.")}
        if config.is_moe_layer(layer):
            x = h_ + moe(mlp, m, config)
        else:
            x = h_ + _swiglu(m, mlp["gate_proj.weight"], mlp["up_proj.weight"], mlp["down_proj.weight"])
    return _rms(x, weights["model.norm.weight"], eps)


def lm_head(weights: dict[str, torch.Tensor], config) -> torch.Tensor:
    return weights["model.word_embeddings.weight" if config.tie_word_embeddings else "lm_head.weight"]


def generate(weights, config, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs) -> torch.Tensor:
    """reference/sdar.generate (greedy block decoding recomputing every block, each prompt alone) on this model."""
    return sdar.generate(weights, config, input_ids, attention_mask, forward_fn=forward,
                         head=lm_head(weights, config), **kwargs)


def block_logprobs(weights, config, sequences, masked, prompt_length, attention_mask, mask_token_id) -> torch.Tensor:
    """reference/sdar.block_logprobs (a forward per block per sample) on this model."""
    return sdar.block_logprobs(weights, config, sequences, masked, prompt_length, attention_mask, mask_token_id,
                               forward_fn=forward, head=lm_head(weights, config))
