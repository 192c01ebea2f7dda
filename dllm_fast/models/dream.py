"""Native Dream (Dream-org/Dream-v0-Instruct-7B, and the models built on its layout): Qwen2.5 continued into a
masked diffusion LM. The forward stops before the LM head.

Architecture (Qwen2's equations, which Dream's modeling code keeps), for each of num_hidden_layers layers:

    n = input_layernorm(x)
    q = rope(q_proj(n))   k = rope(k_proj(n))   v = v_proj(n)          (q, k, v with biases; no q/k norms)
    h = x + o_proj(softmax(q k^T / sqrt(head_dim) + padding bias) v)   (bidirectional: every token reads every
                                                                          real token)
    x = h + down_proj(silu(gate_proj(m)) * up_proj(m))                 with m = post_attention_layernorm(h)

then `norm`. The LM head is `lm_head` (`embed_tokens` with tie_word_embeddings). RMSNorm and rotary (rotate-half,
rope_theta) run in at least fp32. The hidden state at position i predicts token i + 1 (logit_shift 1, as Dream's
generate shifts its logits), so Fast-dLLM's caches, which read a block's own positions, do not apply
(cache="none"). Rotary positions count from each row's first real token, as Dream's generate counts them for
left-padded prompts.

Module names equal the official checkpoint's keys (model.embed_tokens.weight, model.layers.N.self_attn.q_proj.bias,
model.norm.weight, lm_head.weight), so checkpoints load and save without renaming and PEFT target_modules written
for Qwen2 (q_proj ... down_proj) match. The `dream-7b` preset gives Dream-7B's shapes with random weights (the
planner, and `train` on a small task), `dream-tiny` the same layout for tests.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dllm_fast.models.block_attention import first_token, positions_of
from dllm_fast.models.dream_config import DreamConfig
from dllm_fast.models.layers import ConfigTokenIds, padding_bias
from dllm_fast.models.llada import LLaDAModel, RMSNorm, _normal_, apply_rotary, at_least_fp32, rotary_tables
from dllm_fast.models.sdar import SDARMLP
from dllm_fast.validation import data_checks_enabled

# The linear layers of a decoder layer, by their official names: LoRA's default targets.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class DreamAttention(nn.Module):
    def __init__(self, config: DreamConfig):
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=True)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=True)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=True)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)

    def forward(self, n: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        B, L, _ = n.shape
        q = self.q_proj(n).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(n).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(n).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.n_kv_heads != self.n_heads:
            k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=False)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


class DreamLayer(nn.Module):
    def __init__(self, config: DreamConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DreamAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SDARMLP(config)  # Qwen's SwiGLU MLP, the same modules as SDAR's

    def forward(self, x, cos, sin, bias):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, bias)
        return h + self.mlp(self.post_attention_layernorm(h))


class DreamModel(ConfigTokenIds, nn.Module):
    """Dream-family masked diffusion LM. `forward` returns final-normed hidden states; the LM head is
    `lm_head_weight`, applied by the fused ops (or `logits()`)."""

    config_class = DreamConfig
    checkpoint_key_prefix = ""  # the native module names are the official keys
    family_name = "Dream"

    def __init__(self, config: DreamConfig):
        super().__init__()
        self.config = config
        self.model = nn.ModuleDict({
            "embed_tokens": nn.Embedding(config.vocab_size, config.hidden_size),
            "layers": nn.ModuleList(DreamLayer(config) for _ in range(config.num_hidden_layers)),
            "norm": RMSNorm(config.hidden_size, config.rms_norm_eps),
        })
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.gradient_checkpointing = False
        self.name_or_path: str | None = None
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    # -- model contract -------------------------------------------------------------------------------------
    logit_shift = 1

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return (self.model["embed_tokens"] if self.config.tie_word_embeddings else self.lm_head).weight

    @property
    def device(self) -> torch.device:
        return self.model["embed_tokens"].weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model["embed_tokens"].weight.dtype

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> hidden [B, T, d] after the final norm. attention_mask [B, T] (1 = token, 0 =
        padding) masks padded keys; each row's first real token is its position 0 (default position_ids)."""
        if input_ids.dim() != 2 or 0 in input_ids.shape:
            raise ValueError(f"input_ids must be [B, T] with B >= 1 sequences of T >= 1 tokens, got shape "
                             f"{tuple(input_ids.shape)}.")
        if self.device.type == "meta" and input_ids.device.type != "meta":
            raise ValueError("the model is on the meta device and holds no weights; load it with device='cpu' or "
                             "'cuda' to run it.")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids must hold integer token ids, got {input_ids.dtype}; pass ids.long().")
        B, T = input_ids.shape
        if input_ids.device.type == "cpu" and data_checks_enabled(input_ids):
            self.check_input_ids(input_ids)
        if attention_mask is not None and tuple(attention_mask.shape) != (B, T):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(B, T)}.")
        if position_ids is None:
            position_ids = positions_of(torch.arange(T, device=input_ids.device),
                                        first_token(attention_mask, B, input_ids.device))
        elif tuple(position_ids.shape) != (B, T):
            raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}, expected {(B, T)}.")
        x = self.model["embed_tokens"](input_ids)
        cos, sin = rotary_tables(position_ids, self.config.head_dim, self.config.rope_theta, at_least_fp32(x.dtype))
        bias = None if attention_mask is None else padding_bias(attention_mask, x.dtype)
        for layer in self.model["layers"]:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, bias, use_reentrant=False)
            else:
                x = layer(x, cos, sin, bias)
        return self.model["norm"](x)

    # What LLaDAModel does the same way: the token-id check, full logits, gradient checkpointing, and the KV
    # cache's layout (KVCache.for_model), which the planner accounts for; no rollout fills one, since Fast-dLLM's
    # caches refuse a model that predicts token i from position i - 1 (rollout/cache.py), and the forward takes none.
    check_input_ids = LLaDAModel.check_input_ids
    new_cache = LLaDAModel.new_cache
    logits = LLaDAModel.logits
    set_gradient_checkpointing = LLaDAModel.set_gradient_checkpointing
    is_gradient_checkpointing = LLaDAModel.is_gradient_checkpointing

    # -- hooks for trainers (models/loading.py) ---------------------------------------------------------------
    lora_target_modules = LORA_TARGETS

    @staticmethod
    def lora_target_pattern(targets) -> str:
        """A PEFT target_modules regex matching the named modules inside the decoder layers only (never lm_head,
        which the fused ops read directly)."""
        return r".*layers\.\d+\.(self_attn|mlp)\.(" + "|".join(targets) + r")$"

    def shard_units(self) -> list[nn.Module]:
        """The submodules FSDP2 shards as units of their own."""
        return list(self.model["layers"])

    def get_input_embeddings(self) -> nn.Module:
        return self.model["embed_tokens"]

    @property
    def max_sequence_length(self) -> int:
        return self.config.max_position_embeddings

    # -- weights ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Random weights at a realistic scale (as SDARModel.init_weights), biases at 0. A seed gives the same
        weights in every dtype."""
        residual_scale = 1.0 / math.sqrt(2 * self.config.num_hidden_layers)
        residual_outputs = {id(m) for layer in self.model["layers"]
                            for m in (layer.self_attn.o_proj, layer.mlp.down_proj)}
        head_std = 2.0 / math.sqrt(self.config.hidden_size)
        for module in self.modules():
            if isinstance(module, nn.Linear) and module is not getattr(self, "lm_head", None):
                std = 1.0 / math.sqrt(module.in_features)
                _normal_(module.weight, std * residual_scale if id(module) in residual_outputs else std, generator)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                _normal_(module.weight, head_std if self.config.tie_word_embeddings else 1.0, generator)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        if not self.config.tie_word_embeddings:
            _normal_(self.lm_head.weight, head_std, generator)

    @staticmethod
    def preset_config(name: str) -> DreamConfig:
        """The config of a preset: "dream-tiny" or "dream-7b" (DreamConfig.preset)."""
        return DreamConfig.preset(name)

    with_random_weights = classmethod(LLaDAModel.with_random_weights.__func__)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype | None = None,
                        device: str | torch.device | None = None, *,
                        allow_external_links: bool = False) -> "DreamModel":
        """Load a Dream checkpoint directory (config.json + model*.safetensors, sharded or not), with the checks
        LLaDAModel.from_pretrained makes. The tokenizer loads with `transformers.AutoTokenizer`."""
        from dllm_fast.models.checkpoint import load_checkpoint

        return load_checkpoint(cls, path, dtype=dtype, device=device, allow_external_links=allow_external_links)

    save_pretrained = LLaDAModel.save_pretrained
