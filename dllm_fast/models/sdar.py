"""Native SDAR (JetAstra/SDAR; TraDo, the TraceRL models built on it): Qwen3 continued into block diffusion.
The forward stops before the LM head.

Architecture (Qwen3's equations, which SDAR's modeling code keeps), for each of num_hidden_layers layers:

    n = input_layernorm(x)
    q = rope(q_norm(q_proj(n)))   k = rope(k_norm(k_proj(n)))   v = v_proj(n)
        (per head: q_norm and k_norm are RMSNorms over head_dim; num_key_value_heads key/value heads serve
         num_attention_heads query heads; head_dim need not be hidden_size / heads)
    h = x + o_proj(softmax(q k^T / sqrt(head_dim) + block-causal bias) v)
    x = h + down_proj(silu(gate_proj(m)) * up_proj(m))          with m = post_attention_layernorm(h)

then `norm`. The LM head is `lm_head` (`embed_tokens` with tie_word_embeddings). No biases, no dropout. RMSNorm
and rotary (rotate-half, rope_theta) run in at least fp32 and return the input's dtype. The hidden state at
position i predicts token i (logit_shift 0): SDAR's generate samples every masked position from its own logits.

Attention is block-causal (models/block_attention.py): blocks of `block_length` positions (config.json's
block_size, the size the checkpoint was trained with; `from_pretrained(..., block_length=N)` or
`model.block_length = N` override it) aligned to each row's first real token, as the official generate aligns
them. The forward has three layouts:

- plain: `model(ids, attention_mask)`, every block reading itself and the blocks before it;
- cached (rollouts): `cache=`, `cache_start=`, `attend_length=` as LLaDAModel takes them; the keys of earlier
  blocks come from the cache, which block-causality makes exact (a finished block never changes);
- two-stream (likelihoods): `clean_length=S` with ids = [clean (S) | noisy copy of the last T - S columns]:
  each noisy block reads the clean blocks before it and itself, so all blocks of a sample are scored in one
  forward (what `dllm_fast.likelihood` uses; see block_attention.two_stream).

Module names equal the official checkpoint's keys (model.embed_tokens.weight, model.layers.N.self_attn.q_proj.weight,
model.layers.N.mlp.gate_proj.weight, model.norm.weight, lm_head.weight), so checkpoints load and save without
renaming and PEFT target_modules written for Qwen3/SDAR (q_proj ... down_proj) match.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dllm_fast.models.block_attention import attention_bias, call_layout, check_block_length
from dllm_fast.models.kv_cache import KVCache
from dllm_fast.models.layers import ConfigTokenIds
from dllm_fast.models.llada import LLaDAModel, RMSNorm, _normal_, apply_rotary, at_least_fp32, rotary_tables
from dllm_fast.models.sdar_config import SDARConfig
from dllm_fast.validation import data_checks_enabled

# The linear layers of a decoder layer, by their official names: LoRA's default targets.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class SDARAttention(nn.Module):
    def __init__(self, config: SDARConfig):
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def forward(self, n: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bias: torch.Tensor,
                cached: tuple[torch.Tensor, torch.Tensor, int | torch.Tensor, int] | None) -> torch.Tensor:
        """`cached` = (keys, values, at, attend): write this call's keys/values at positions [at, at + L) of the
        layer's cache (`at` an int, or the [L] positions as a tensor) and attend over its first `attend`."""
        B, L, _ = n.shape
        q = self.q_norm(self.q_proj(n).view(B, L, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(n).view(B, L, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(n).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cached is not None:
            keys, values, at, attend = cached
            if isinstance(at, torch.Tensor):  # positions on the device: one graph for every block (torch.compile)
                keys.index_copy_(2, at, k)
                values.index_copy_(2, at, v)
            else:
                keys[:, :, at:at + L] = k
                values[:, :, at:at + L] = v
            k, v = keys[:, :, :attend], values[:, :, :attend]
        if self.n_kv_heads != self.n_heads:
            k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=False)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


class SDARMLP(nn.Module):
    def __init__(self, config: SDARConfig):
        super().__init__()
        d, hidden = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, m: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))


class SDARLayer(nn.Module):
    def __init__(self, config: SDARConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SDARAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SDARMLP(config)

    def forward(self, x, cos, sin, bias, cached=None):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, bias, cached)
        return h + self.mlp(self.post_attention_layernorm(h))


class SDARModel(ConfigTokenIds, nn.Module):
    """SDAR-family block-diffusion LM. `forward` returns final-normed hidden states; the LM head is
    `lm_head_weight`, applied by the fused ops (or `logits()`)."""

    config_class = SDARConfig
    checkpoint_key_prefix = ""  # the native module names are the official keys
    block_diffusion = True  # a family of block-diffusion models (block-causal attention; trainers ask the class)

    def __init__(self, config: SDARConfig):
        super().__init__()
        self.config = config
        self.model = nn.ModuleDict({
            "embed_tokens": nn.Embedding(config.vocab_size, config.hidden_size),
            "layers": nn.ModuleList(SDARLayer(config) for _ in range(config.num_hidden_layers)),
            "norm": RMSNorm(config.hidden_size, config.rms_norm_eps),
        })
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.gradient_checkpointing = False
        self.name_or_path: str | None = None
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    # -- model contract -------------------------------------------------------------------------------------
    logit_shift = 0

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return (self.model["embed_tokens"] if self.config.tie_word_embeddings else self.lm_head).weight

    @property
    def block_length(self) -> int:
        """Positions per block of the block-causal attention (contracts.block_length): config.json's block_size
        unless overridden."""
        return self.config.block_size

    @block_length.setter
    def block_length(self, value: int) -> None:
        self.config.block_size = check_block_length(value)

    @property
    def device(self) -> torch.device:
        return self.model["embed_tokens"].weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model["embed_tokens"].weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        cache_start: int | torch.Tensor = 0,
        attend_length: int | None = None,
        clean_length: int | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] -> hidden [B, T, d] after the final norm.

        attention_mask [B, K] (1 = token, 0 = padding) covers the keys: the T tokens, the attend_length cached
        positions with a cache, or the clean stream's S columns with clean_length=S. Its first 1 in each row is
        the row's position 0, from which blocks and rotary positions count (default position_ids: the positions
        so counted; padding sits at 0).

        With a KVCache (sampling, under no_grad), the tokens sit at columns [cache_start, cache_start + T); their
        keys and values are written there and they read the cached columns [0, attend_length) that block-causality
        lets them (see LLaDAModel.forward for the rules on cache_start as a 0-d tensor under torch.compile).

        With clean_length=S (no cache), input_ids are [clean (S) | noisy (T - S)], the noisy stream a copy of the
        clean columns [2S - T, S) with some tokens masked; see the module docstring.
        """
        self._check_ids(input_ids)
        allowed, positions, written, keys = call_layout(self, input_ids, attention_mask, position_ids, cache,
                                                        cache_start, attend_length, clean_length)
        x = self.model["embed_tokens"](input_ids)
        cos, sin = rotary_tables(positions, self.config.head_dim, self.config.rope_theta, at_least_fp32(x.dtype))
        bias = attention_bias(allowed, x.dtype)
        for i, layer in enumerate(self.model["layers"]):
            if cache is not None:
                x = layer(x, cos, sin, bias, (cache.keys[i], cache.values[i], written, keys))
            elif self.gradient_checkpointing and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, bias, use_reentrant=False)
            else:
                x = layer(x, cos, sin, bias)
        return self.model["norm"](x)

    def _check_ids(self, input_ids: torch.Tensor) -> tuple[int, int]:
        if input_ids.dim() != 2 or 0 in input_ids.shape:
            raise ValueError(f"input_ids must be [B, T] with B >= 1 sequences of T >= 1 tokens, got shape "
                             f"{tuple(input_ids.shape)}.")
        if self.device.type == "meta" and input_ids.device.type != "meta":
            raise ValueError("the model is on the meta device and holds no weights; load it with device='cpu' or "
                             "'cuda' to run it.")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids must hold integer token ids, got {input_ids.dtype}; pass ids.long().")
        if input_ids.device.type == "cpu" and data_checks_enabled(input_ids):
            self.check_input_ids(input_ids)
        return tuple(input_ids.shape)

    # What LLaDAModel does the same way, for any model with its config's n_layers / n_kv_heads / head_dim /
    # embedding_size: the token-id check, the cache checks and allocation, full logits, gradient checkpointing.
    check_input_ids = LLaDAModel.check_input_ids
    _check_cache = LLaDAModel._check_cache
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
        """Random weights at a realistic scale (as LLaDAModel.init_weights): variance-preserving projections,
        residual outputs (o_proj, down_proj) scaled by 1/sqrt(2 layers), an LM head whose logits have a std of
        about 2, norms at 1. A seed gives the same weights in every dtype."""
        residual_scale = 1.0 / math.sqrt(2 * self.config.num_hidden_layers)
        residual_outputs = {id(m) for layer in self.model["layers"]
                            for m in (layer.self_attn.o_proj, layer.mlp.down_proj)}
        head_std = 2.0 / math.sqrt(self.config.hidden_size)
        for module in self.modules():
            if isinstance(module, nn.Linear) and module is not getattr(self, "lm_head", None):
                std = 1.0 / math.sqrt(module.in_features)
                _normal_(module.weight, std * residual_scale if id(module) in residual_outputs else std, generator)
            elif isinstance(module, nn.Embedding):
                _normal_(module.weight, head_std if self.config.tie_word_embeddings else 1.0, generator)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        if not self.config.tie_word_embeddings:
            _normal_(self.lm_head.weight, head_std, generator)

    @staticmethod
    def preset_config(name: str) -> SDARConfig:
        """The config of a preset: "sdar-tiny", "sdar-1.7b" or "sdar-8b" (SDARConfig.preset)."""
        return SDARConfig.preset(name)

    # LLaDAModel's construction from a config with random weights works for any model built from its config
    # with init_weights(generator): on the meta device first, then allocated in the dtype and device asked.
    with_random_weights = classmethod(LLaDAModel.with_random_weights.__func__)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype | None = None,
                        device: str | torch.device | None = None, *, block_length: int | None = None,
                        allow_external_links: bool = False) -> "SDARModel":
        """Load an official SDAR checkpoint directory (config.json + model*.safetensors, sharded with
        model.safetensors.index.json or not), with the checks LLaDAModel.from_pretrained makes (config field by
        field, every weight's name, shape and dtype from the headers before any is read; nothing read outside the
        directory unless allow_external_links). block_length overrides config.json's block_size. The tokenizer
        loads with `transformers.AutoTokenizer.from_pretrained(path)`."""
        from dllm_fast.models.checkpoint import load_checkpoint

        model = load_checkpoint(cls, path, dtype=dtype, device=device, allow_external_links=allow_external_links)
        if block_length is not None:
            model.block_length = block_length
        return model

    save_pretrained = LLaDAModel.save_pretrained
