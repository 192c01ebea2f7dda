"""Native LLaDA2 (inclusionAI's LLaDA2.0/2.1-mini and -flash): a mixture-of-experts transformer trained for block
diffusion. The forward stops before the LM head.

Architecture (the official modeling_llada2_moe.py's equations and order of roundings), for each layer:

    n = input_layernorm(x)
    q, k, v = split(query_key_value(n))                      one fused projection, (H + 2 H_kv) heads of head_dim
    q = rope(query_layernorm(q))   k = rope(key_layernorm(k))  per-head RMSNorm, then rotary on the first
                                                              rotary_dim = partial_rotary_factor x head_dim dims
    h = x + dense(softmax(q k^T / sqrt(head_dim) + block-causal bias) v)
    x = h + mlp(post_attention_layernorm(h))

where mlp is a dense SwiGLU (gate_proj, up_proj, down_proj) in the first `first_k_dense_replace` layers and a
mixture of experts after them (models/moe.py: sigmoid router with expert bias and grouped top-k, routed experts
as grouped GEMMs, a shared expert); then `norm`, and the LM head `lm_head`. No biases, no dropout. RMSNorms
normalise in fp32 and round before their scale; the rotary tables are computed in fp32 and rounded to the
activations' dtype, and the rotation runs in that dtype (the official order; the dense families rotate in fp32).
The word embedding's padding row (pad_token_id, the EOS) gets no gradient, as nn.Embedding(padding_idx) gives
the official model. The hidden state at position i predicts token i (logit_shift 0).

Attention is block-causal in blocks of `block_length` (config.block_size, 32 by default: the official generate's
block_length) aligned to each row's first real token, with SDAR's three layouts (models/sdar.py,
block_attention.call_layout): plain, cached (rollouts; exact, since a finished block never changes), and
two-stream (`clean_length=S`: every block of a sample scored in one forward).

Module names equal the official checkpoint's keys (model.word_embeddings.weight,
model.layers.N.attention.query_key_value.weight, model.layers.N.mlp.gate.expert_bias, ...), except the routed
experts, which are two stacked parameters per layer (`mlp.experts.gate_up_proj` [E, 2I, d], `mlp.experts.down_proj`
[E, d, I]) whose checkpoint entries are the official per-expert `mlp.experts.<e>.{gate,up,down}_proj.weight`
(`official_state_dict` / `native_state_dict`, which models/checkpoint.py applies on save and load).

LoRA (PEFT): `query_key_value`, `dense`, and the SwiGLUs' `gate_proj`, `up_proj`, `down_proj` (the dense layers'
MLP and every shared expert) are nn.Linear modules PEFT adapts. The routed experts take no adapter: PEFT matches
modules, and they are two 3-D parameters of one `Experts` module, not 256 nn.Linear layers; a LoRA run freezes
them with the rest of the base (in bf16 on a GPU, train/precision.py). The router (`mlp.gate`) is not adapted.
"""

from __future__ import annotations

import math
import os
import re

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dllm_fast.models.block_attention import attention_bias, call_layout, check_block_length
from dllm_fast.models.kv_cache import KVCache
from dllm_fast.models.layers import ConfigTokenIds, RMSNorm, at_least_fp32, attention, rotary_tables
from dllm_fast.models.llada import LLaDAModel, _normal_
from dllm_fast.models.llada2_config import LLaDA2Config
from dllm_fast.models.moe import EXPERT_PROVIDERS, Experts, MixtureOfExperts, SwiGLU
from dllm_fast.models.sdar import SDARModel

# The nn.Linear modules of a layer LoRA may adapt, by their official names.
LORA_TARGETS = ("query_key_value", "dense", "gate_proj", "up_proj", "down_proj")
_EXPERT_KEY = re.compile(r"(.*\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of the first cos.shape[-1] dimensions of x [B, H, L, D], the rest passed through, in x's
    dtype with cos and sin [B, 1, L, r] in that dtype (the official apply_rotary_pos_emb's rounding)."""
    r = cos.shape[-1]
    rotated, rest = x[..., :r], x[..., r:]
    first, second = rotated.chunk(2, dim=-1)
    return torch.cat((rotated * cos + torch.cat((-second, first), dim=-1) * sin, rest), dim=-1)


class LLaDA2Attention(nn.Module):
    def __init__(self, config: LLaDA2Config):
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.query_key_value = nn.Linear(d, (self.n_heads + 2 * self.n_kv_heads) * hd, bias=False)
        self.query_layernorm = RMSNorm(hd, config.rms_norm_eps)
        self.key_layernorm = RMSNorm(hd, config.rms_norm_eps)
        self.dense = nn.Linear(self.n_heads * hd, d, bias=False)

    def forward(self, n: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bias: torch.Tensor,
                cached: tuple[torch.Tensor, torch.Tensor, int | torch.Tensor, int] | None) -> torch.Tensor:
        """`cached` = (keys, values, at, attend), as SDARAttention takes it."""
        B, L, _ = n.shape
        qkv = self.query_key_value(n).view(B, L, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=2)
        q = partial_rotary(self.query_layernorm(q).transpose(1, 2), cos, sin)
        k = partial_rotary(self.key_layernorm(k).transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        if cached is not None:
            keys, values, at, attend = cached
            if isinstance(at, torch.Tensor):  # positions on the device: one graph for every block (torch.compile)
                keys.index_copy_(2, at, k)
                values.index_copy_(2, at, v)
            else:
                keys[:, :, at:at + L] = k
                values[:, :, at:at + L] = v
            k, v = keys[:, :, :attend], values[:, :, :attend]
        out = attention(q, k, v, bias)
        return self.dense(out.transpose(1, 2).reshape(B, L, -1))


class LLaDA2Layer(nn.Module):
    def __init__(self, config: LLaDA2Config, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = LLaDA2Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = (MixtureOfExperts(config) if config.is_moe_layer(index)
                    else SwiGLU(config.hidden_size, config.intermediate_size))

    def forward(self, x, cos, sin, bias, cached=None):
        h = x + self.attention(self.input_layernorm(x), cos, sin, bias, cached)
        return h + self.mlp(self.post_attention_layernorm(h))


class LLaDA2Model(ConfigTokenIds, nn.Module):
    """LLaDA2-family mixture-of-experts block-diffusion LM. `forward` returns final-normed hidden states; the LM
    head is `lm_head_weight`, applied by the fused ops (or `logits()`)."""

    config_class = LLaDA2Config
    checkpoint_key_prefix = ""  # the native module names are the official keys (the experts mapped, see above)
    block_diffusion = True

    def __init__(self, config: LLaDA2Config):
        super().__init__()
        self.config = config
        self.model = nn.ModuleDict({
            "word_embeddings": nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id),
            "layers": nn.ModuleList(LLaDA2Layer(config, i) for i in range(config.num_hidden_layers)),
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
        return (self.model["word_embeddings"] if self.config.tie_word_embeddings else self.lm_head).weight

    @property
    def block_length(self) -> int:
        """Positions per block of the block-causal attention (contracts.block_length): config.block_size (32
        unless set), which `model.block_length = N` or from_pretrained(..., block_length=N) overrides."""
        return self.config.block_size

    @block_length.setter
    def block_length(self, value: int) -> None:
        self.config.block_size = check_block_length(value)

    @property
    def device(self) -> torch.device:
        return self.model["word_embeddings"].weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model["word_embeddings"].weight.dtype

    @property
    def experts_provider(self) -> str:
        """How the routed experts run their GEMMs (models/moe.py: "auto", "grouped_mm", "bmm", "loop")."""
        layers = self.moe_layers()
        return layers[0].provider if layers else "auto"

    @experts_provider.setter
    def experts_provider(self, value: str) -> None:
        if value not in EXPERT_PROVIDERS:
            raise ValueError(f"experts_provider={value!r} is not one of {EXPERT_PROVIDERS}.")
        for layer in self.moe_layers():
            layer.provider = value

    def moe_layers(self) -> list[MixtureOfExperts]:
        return [layer.mlp for layer in self.model["layers"] if isinstance(layer.mlp, MixtureOfExperts)]

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
        """input_ids [B, T] -> hidden [B, T, d] after the final norm; the arguments as SDARModel.forward takes
        them (plain, cached or two-stream)."""
        self._check_ids(input_ids)
        allowed, positions, written, keys = call_layout(self, input_ids, attention_mask, position_ids, cache,
                                                        cache_start, attend_length, clean_length)
        x = self.model["word_embeddings"](input_ids)
        cos, sin = rotary_tables(positions, self.config.rotary_dim, self.config.rope_theta, at_least_fp32(x.dtype))
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        bias = attention_bias(allowed, x.dtype)
        for i, layer in enumerate(self.model["layers"]):
            if cache is not None:
                x = layer(x, cos, sin, bias, (cache.keys[i], cache.values[i], written, keys))
            elif self.gradient_checkpointing and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, bias, use_reentrant=False)
            else:
                x = layer(x, cos, sin, bias)
        return self.model["norm"](x)

    _check_ids = SDARModel._check_ids
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
        """A PEFT target_modules regex matching the named modules of the attention, the dense MLPs and the shared
        experts (never lm_head, the router or the routed experts)."""
        return r".*layers\.\d+\.(attention|mlp|mlp\.shared_experts)\.(" + "|".join(targets) + r")$"

    def shard_units(self) -> list[nn.Module]:
        """The submodules FSDP2 shards as units of their own: the layers."""
        return list(self.model["layers"])

    def get_input_embeddings(self) -> nn.Module:
        return self.model["word_embeddings"]

    @property
    def max_sequence_length(self) -> int:
        return self.config.max_position_embeddings

    # -- weights ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Random weights at a realistic scale (as LLaDAModel.init_weights): variance-preserving projections and
        experts, residual outputs (dense, down projections) scaled by 1/sqrt(2 layers), an LM head whose logits
        have a std of about 2, norms at 1, a small random expert bias (so that the bias's path is exercised). A
        seed gives the same weights in every dtype."""
        residual_scale = 1.0 / math.sqrt(2 * self.config.num_hidden_layers)
        residual_outputs = {id(layer.attention.dense) for layer in self.model["layers"]}
        residual_outputs |= {id(m.down_proj) for m in self.modules() if isinstance(m, SwiGLU)}
        head_std = 2.0 / math.sqrt(self.config.hidden_size)
        for module in self.modules():
            if isinstance(module, nn.Linear) and module is not getattr(self, "lm_head", None):
                std = 1.0 / math.sqrt(module.in_features)
                _normal_(module.weight, std * residual_scale if id(module) in residual_outputs else std, generator)
            elif isinstance(module, Experts):
                _normal_(module.gate_up_proj, 1.0 / math.sqrt(module.hidden_size), generator)
                _normal_(module.down_proj, residual_scale / math.sqrt(module.width), generator)
            elif isinstance(module, MixtureOfExperts):
                _normal_(module.gate.weight, 1.0 / math.sqrt(module.gate.weight.shape[1]), generator)
                _normal_(module.gate.expert_bias, 0.02, generator)
            elif isinstance(module, nn.Embedding):
                _normal_(module.weight, head_std if self.config.tie_word_embeddings else 1.0, generator)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        if not self.config.tie_word_embeddings:
            _normal_(self.lm_head.weight, head_std, generator)

    @staticmethod
    def preset_config(name: str) -> LLaDA2Config:
        """The config of a preset: "llada2-tiny", "llada2-mini" or "llada2-flash" (LLaDA2Config.preset)."""
        return LLaDA2Config.preset(name)

    with_random_weights = classmethod(LLaDAModel.with_random_weights.__func__)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype | None = None,
                        device: str | torch.device | None = None, *, block_length: int | None = None,
                        allow_external_links: bool = False) -> "LLaDA2Model":
        """Load an official LLaDA2 checkpoint directory (config.json + model*.safetensors, sharded with
        model.safetensors.index.json or not), with the checks LLaDAModel.from_pretrained makes (config field by
        field, every weight's official name, shape and dtype from the headers before any is read; nothing read
        outside the directory unless allow_external_links). block_length sets the block size (32 by default).
        The tokenizer loads with `transformers.AutoTokenizer`."""
        from dllm_fast.models.checkpoint import load_checkpoint

        model = load_checkpoint(cls, path, dtype=dtype, device=device, allow_external_links=allow_external_links)
        check_routers_finite(model, path)
        if block_length is not None:
            model.block_length = block_length
        return model

    save_pretrained = LLaDAModel.save_pretrained

    @staticmethod
    def official_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The state dict under the official checkpoint's names: each layer's stacked experts split into the
        per-expert `experts.<e>.gate_proj.weight` [I, d], `up_proj` [I, d], `down_proj` [d, I] (views)."""
        official = {}
        for name, tensor in state.items():
            if name.endswith(".experts.gate_up_proj"):
                prefix, width = name[:-len("gate_up_proj")], tensor.shape[1] // 2
                for e in range(tensor.shape[0]):
                    official[f"{prefix}{e}.gate_proj.weight"] = tensor[e, :width]
                    official[f"{prefix}{e}.up_proj.weight"] = tensor[e, width:]
            elif name.endswith(".experts.down_proj"):
                prefix = name[:-len("down_proj")]
                for e in range(tensor.shape[0]):
                    official[f"{prefix}{e}.down_proj.weight"] = tensor[e]
            else:
                official[name] = tensor
        return official

    @staticmethod
    def native_state_dict(official: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The inverse of official_state_dict: per-expert weights stacked into each layer's experts."""
        native, experts = {}, {}
        for name, tensor in official.items():
            match = _EXPERT_KEY.fullmatch(name)
            if match is None:
                native[name] = tensor
            else:
                prefix, index, part = match.groups()
                experts.setdefault(prefix, {}).setdefault(part, {})[int(index)] = tensor
        for prefix, parts in experts.items():
            count = len(parts["down_proj"])
            native[prefix + "gate_up_proj"] = torch.stack(
                [torch.cat([parts["gate_proj"][e], parts["up_proj"][e]]) for e in range(count)])
            native[prefix + "down_proj"] = torch.stack([parts["down_proj"][e] for e in range(count)])
        return native


def check_routers_finite(model: nn.Module, path) -> None:
    """Refuse a checkpoint whose routers (each MoE layer's `mlp.gate.weight` and `expert_bias`) hold NaN or inf:
    the model's outputs stay finite, so nothing downstream would notice, but the experts it picks are not the ones
    its weights choose (a NaN score ranks arbitrarily). A skeleton on the meta device has no values to check."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if not (name.endswith(".mlp.gate.weight") or name.endswith(".mlp.gate.expert_bias")):
            continue
        if tensor.device.type == "meta":
            return
        bad = (~torch.isfinite(tensor.detach())).reshape(tensor.shape[0], -1).any(dim=1)  # by expert
        if bad.any():
            experts = bad.nonzero().flatten().tolist()
            shown = ", ".join(str(e) for e in experts[:8]) + (", ..." if len(experts) > 8 else "")
            raise ValueError(f"{path}: the router tensor {name} holds NaN or inf for {len(experts)} of its "
                             f"{tensor.shape[0]} experts ({shown}); routing on it would choose experts arbitrarily. "
                             "The checkpoint is damaged: load an intact copy.")


__all__ = ["LLaDA2Model", "LORA_TARGETS", "partial_rotary"]
