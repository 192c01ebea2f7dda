"""Native LLaDA: a bidirectional Llama-style transformer whose forward stops before the LM head.

Architecture (LLaDA-8B): token embedding, n_layers blocks of
    h = x + attn_out(SDPA(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))   with n = attn_norm(x), no causal mask
    x = h + ff_out(silu(ff_proj(m)) * up_proj(m))                           with m = ff_norm(h)
then ln_f. RMSNorm and RoPE (rotate-half, non-interleaved) run in fp32. The LM head `ff_out` is untied unless
config.weight_tying. Padding enters attention as an additive bias on the padded keys.

Module names equal the official checkpoint's key names (minus the leading "model."), so PEFT target_modules
written for LLaDA (q_proj, k_proj, v_proj, attn_out, ff_proj, up_proj, ff_out) match, and state dicts carry the
official keys and shapes. Inside a block, q/k/v and gate/up are each one weight (`fused_qkv`, `fused_gate_up`,
layers.FusedLinear: one GEMM each); the official names are nn.Linear views of their rows (layers.ProjectionSlice).

Why this design, for LoRA: PEFT replaces a target nn.Linear by a wrapper whose base_layer is the original and
whose forward is base_layer(x, **kwargs) plus its delta (nothing but the base when disabled or merged). The block
runs the fused GEMM once and hands each part its rows as `base_output`: an unwrapped part returns them as they are,
a wrapper passes them to its base layer and adds its delta. So LoRA on q_proj adapts exactly the query rows, the
base GEMM stays fused with adapters on, disable_adapter() gives the base model, merges write into the fused
weight (ProjectionSlice.weight is a view of it), and gradients are those of separate projections (the fused
GEMM's rows are the parts' GEMMs; its input gradient sums theirs). The alternative, separate parameters that are
views of one buffer, breaks silently whenever something rebinds a parameter (`.to()`, load_state_dict(assign=
True), FSDP2's sharding); here the fused weight is the only parameter, and the parts are derived from it.

Kernels per layer in eager mode (benchmarks/bench_rollout.py counts them): RMSNorm one each (a second for the bf16
scale, layers.rms_norm), fused GEMMs, RoPE on queries and keys together in place (three), the KV-cache write of
keys and values in one copy, SDPA over the cache's span (flash without padding), residual adds.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch._guards import detect_fake_mode
from torch.utils.checkpoint import checkpoint

from dllm_fast.models.config import LLaDAConfig
from dllm_fast.models.kv_cache import KVCache
from dllm_fast.models.layers import (ConfigTokenIds, RMSNorm, adapted_linear, apply_rope, apply_rotary, at_least_fp32,
                                     attention, fuse_linears, padding_bias, projection_outputs, rope_tables,
                                     rotary_tables)
from dllm_fast.validation import data_checks_enabled

# The shared pieces live in layers.py; these names stay importable from here.
__all__ = ["LORA_TARGETS", "LLaDABlock", "LLaDAModel", "RMSNorm", "apply_rotary", "at_least_fp32", "padding_bias",
           "rotary_tables"]

# The linear layers of a block, by their official names: LoRA's default targets.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out")


def _normal_(weight: torch.Tensor, std: float, generator: torch.Generator | None) -> None:
    """N(0, std^2) drawn in at least fp32 and rounded once to weight's dtype: torch's own bf16/fp16 normal_
    draws a different sequence from the same seed in some versions (2.11 on CPU, for tensors of 16+ values)."""
    draw_dtype = at_least_fp32(weight.dtype)
    if weight.dtype == draw_dtype:
        weight.normal_(0.0, std, generator=generator)
    else:
        draw = torch.empty(weight.shape, dtype=draw_dtype, device=weight.device)
        weight.copy_(draw.normal_(0.0, std, generator=generator))


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    try:  # set inside: an interrupt right after it must not leave the process's default dtype changed
        torch.set_default_dtype(dtype)
        yield
    finally:
        try:
            torch.set_default_dtype(previous)
        except BaseException:  # an interrupt landed in it: finish it, then let the interrupt go on
            torch.set_default_dtype(previous)
            raise


class LLaDABlock(nn.Module):
    def __init__(self, config: LLaDAConfig):
        super().__init__()
        d, hidden, kv = config.d_model, config.mlp_hidden_size, config.n_kv_heads * config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.attn_norm = RMSNorm(d, config.rms_norm_eps)
        fuse_linears(self, "fused_qkv", {"q_proj": d, "k_proj": kv, "v_proj": kv}, d)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ff_norm = RMSNorm(d, config.rms_norm_eps)
        fuse_linears(self, "fused_gate_up", {"ff_proj": hidden, "up_proj": hidden}, d)  # ff_proj: the gate (SiLU)
        self.ff_out = nn.Linear(hidden, d, bias=False)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, attn_bias: torch.Tensor | None,
        cached: tuple[torch.Tensor, int | torch.Tensor, int] | None = None,
    ) -> torch.Tensor:
        """rope: layers.rope_tables of the positions. `cached` = (layer buffer [B, capacity, 2 * n_kv_heads, D] of
        a KVCache, at, attend): write this call's keys and values at positions [at, at + L) (`at` an int, or the
        [L] positions as a tensor) and attend over the first `attend` positions."""
        B, L, _ = x.shape
        H, Hkv = self.n_heads, self.n_kv_heads
        n = self.attn_norm(x)
        qkv = projection_outputs(n, self.fused_qkv, (self.q_proj, self.k_proj, self.v_proj))
        qkv = qkv.view(B, L, H + 2 * Hkv, self.head_dim)
        if torch.is_grad_enabled() and qkv.requires_grad:  # the composite, for autograd
            rotated = apply_rope(qkv[:, :, :H + Hkv], rope)
            q, k, v = rotated[:, :, :H], rotated[:, :, H:], qkv[:, :, H + Hkv:]
        else:  # one kernel, bit for bit the composite; keys and values stay side by side for one cache copy
            from dllm_fast.ops import rotary  # here: importing the model must not load the compiled ops

            qkv = rotary.rope(qkv, rope, H + Hkv)
            q, k, v = qkv[:, :, :H], qkv[:, :, H:H + Hkv], qkv[:, :, H + Hkv:]
        if cached is not None:
            layer, at, attend = cached
            if isinstance(at, torch.Tensor):  # positions on the device: one graph for every block (torch.compile)
                layer.index_copy_(1, at, qkv[:, :, H:])
            else:
                layer[:, at:at + L] = qkv[:, :, H:]
            k, v = layer[:, :attend, :Hkv], layer[:, :attend, Hkv:]
        att = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_bias)
        h = x + adapted_linear(self.attn_out, att.transpose(1, 2).reshape(B, L, -1))
        m = self.ff_norm(h)
        gate, up = projection_outputs(m, self.fused_gate_up, (self.ff_proj, self.up_proj)).chunk(2, dim=-1)
        return h + adapted_linear(self.ff_out, F.silu(gate) * up)


class LLaDAModel(ConfigTokenIds, nn.Module):
    """LLaDA-architecture masked diffusion LM. `forward` returns final-normed hidden states; the LM head is
    `lm_head_weight`, applied by the fused ops (or `logits()` for convenience)."""

    def __init__(self, config: LLaDAConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.embedding_size, config.d_model),
                "blocks": nn.ModuleList(LLaDABlock(config) for _ in range(config.n_layers)),
                "ln_f": RMSNorm(config.d_model, config.rms_norm_eps),
            }
        )
        if not config.weight_tying:
            self.transformer["ff_out"] = nn.Linear(config.d_model, config.embedding_size, bias=False)
        self.gradient_checkpointing = False
        self.name_or_path: str | None = None  # the checkpoint directory from_pretrained read, if any
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    # -- model contract -------------------------------------------------------------------------------------
    logit_shift = 0  # the hidden state at position i predicts token i (no shift, unlike Dream)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        head = self.transformer["wte"] if self.config.weight_tying else self.transformer["ff_out"]
        return head.weight

    @property
    def device(self) -> torch.device:
        return self.transformer["wte"].weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer["wte"].weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        cache_start: int | torch.Tensor = 0,
        attend_length: int | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] -> hidden [B, T, d] after the final norm.

        Without a cache the T tokens attend to each other (bidirectionally). attention_mask [B, T] (1 = token,
        0 = padding) masks padded keys; position_ids [B, T] default to 0..T-1. RoPE is relative, so left
        padding needs no position shift for the real tokens.

        With a KVCache (sampling only, under torch.no_grad), the tokens sit at positions
        [cache_start, cache_start + T): their keys/values are written there and they attend over the cached
        positions [0, attend_length) (default cache_start + T); attention_mask then covers those
        attend_length keys and position_ids default to cache_start + 0..T-1. See KVCache for the modes.
        cache_start may be a 0-d integer tensor (so that torch.compile traces one graph for every start); then
        attend_length is required, and the caller keeps 0 <= cache_start <= attend_length - T (reading the value
        to check it would cost a host sync).

        On CPU, token ids outside the embedding table raise (`check_input_ids`), except where value checks are
        off (validation.data_checks_enabled: under torch.compile, on fake tensors, inside generate's loop, which
        checked its prompts once).
        """
        if input_ids.dim() != 2 or 0 in input_ids.shape:
            raise ValueError(f"input_ids must be [B, T] with B >= 1 sequences of T >= 1 tokens, got shape "
                             f"{tuple(input_ids.shape)}.")
        if self.device.type == "meta" and input_ids.device.type != "meta":
            raise ValueError("the model is on the meta device and holds no weights (from_pretrained(device='meta') "
                             "gives a skeleton); load it with device='cpu' or 'cuda' to run it.")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids must hold integer token ids, got {input_ids.dtype}; pass ids.long().")
        if input_ids.device.type == "cpu" and data_checks_enabled(input_ids):  # on GPU: a host sync per call
            self.check_input_ids(input_ids)
        B, T = input_ids.shape
        keys_length = T
        if cache is not None:
            keys_length = self._check_cache(cache, B, T, cache_start, attend_length)
        elif isinstance(cache_start, torch.Tensor) or cache_start != 0 or attend_length is not None:
            raise ValueError("cache_start and attend_length need a cache; pass cache=KVCache.for_model(...).")
        written: int | torch.Tensor = cache_start  # where the cache receives this call's keys and values
        if isinstance(cache_start, torch.Tensor):
            written = cache_start + torch.arange(T, device=input_ids.device)
        if position_ids is None:
            if isinstance(written, torch.Tensor):
                position_ids = written.expand(B, T)
            else:
                position_ids = torch.arange(cache_start, cache_start + T, device=input_ids.device).expand(B, T)
        elif position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}, expected {(B, T)}.")
        x = self.transformer["wte"](input_ids)
        rope = rope_tables(position_ids, self.config.head_dim, self.config.rope_theta, at_least_fp32(x.dtype))
        bias = None
        if attention_mask is not None:
            if attention_mask.shape != (B, keys_length):
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(B, keys_length)} "
                    "(one entry per attended key)."
                )
            bias = padding_bias(attention_mask, x.dtype)
        for i, block in enumerate(self.transformer["blocks"]):
            if cache is not None:
                x = block(x, rope, bias, (cache.layers[i], written, keys_length))
            elif self.gradient_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, rope, bias, use_reentrant=False)
            else:
                x = block(x, rope, bias)
        return self.transformer["ln_f"](x)

    def check_input_ids(self, input_ids: torch.Tensor) -> None:
        """Raise if a token id lies outside the embedding table. Reads the values: one host sync."""
        low, high = torch.stack([input_ids.min(), input_ids.max()]).tolist()
        if low < 0 or high >= self.config.embedding_size:
            raise ValueError(f"input_ids holds token id {low if low < 0 else high}, outside the model's "
                             f"embedding table [0, {self.config.embedding_size}); check the tokenizer.")

    def _check_cache(self, cache: KVCache, batch: int, length: int, start: int | torch.Tensor,
                     attend: int | None) -> int:
        if torch.is_grad_enabled():
            raise RuntimeError("KV caches are for sampling; run the cached forward under torch.no_grad().")
        if cache.batch != batch or len(cache.layers) != self.config.n_layers:
            raise ValueError(f"the cache holds {cache.batch} sequences and {len(cache.layers)} layers; the call has "
                             f"{batch} sequences and the model {self.config.n_layers} layers.")
        if isinstance(start, torch.Tensor):
            if start.dim() != 0 or start.is_floating_point() or attend is None:
                raise ValueError(f"a tensor cache_start must be a 0-d integer tensor (got {start.dtype} of shape "
                                 f"{tuple(start.shape)}) and needs attend_length.")
            if not length <= attend <= cache.capacity:
                raise ValueError(f"{length} tokens with attend_length={attend} must satisfy tokens <= attend_length "
                                 f"<= capacity={cache.capacity}.")
            return attend
        end = start + length
        attend = end if attend is None else attend
        if not (0 <= start and end <= attend <= cache.capacity):
            raise ValueError(f"cache_start={start} with {length} tokens and attend_length={attend} must satisfy "
                             f"0 <= cache_start, cache_start + tokens <= attend_length <= capacity={cache.capacity}.")
        return attend

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty KV cache for `batch` sequences of up to `capacity` positions (see KVCache)."""
        return KVCache.for_model(self, batch, capacity)

    def logits(self, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
        """Full [B, L, V] logits; prefer the fused ops, which apply the head only where needed."""
        return F.linear(self(input_ids, attention_mask, position_ids), self.lm_head_weight)

    def set_gradient_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each block in backward instead of storing its activations."""
        self.gradient_checkpointing = enabled

    @property
    def is_gradient_checkpointing(self) -> bool:
        """transformers' name for the state, which PEFT reads: when it cannot, it assumes checkpointing and hooks
        the input embeddings with a requires_grad_ call (for reentrant checkpointing; ours is non-reentrant) that
        torch.compile cannot trace, which broke compiled LoRA rollouts under torch 2.11."""
        return self.gradient_checkpointing

    # -- hooks for trainers (dllm_fast.train, the TRL adapter): what they need to know of this architecture ----
    # The modules LoRA may adapt, all of them by default. The LM head is also called ff_out; lora_target_pattern
    # keeps adapters off it, since the fused ops read lm_head_weight directly and would ignore one.
    lora_target_modules = LORA_TARGETS

    @staticmethod
    def lora_target_pattern(targets) -> str:
        """A PEFT target_modules regex matching the named modules inside the transformer blocks only."""
        return r".*blocks\.\d+\.(" + "|".join(targets) + r")$"

    def shard_units(self) -> list[nn.Module]:
        """The submodules FSDP2 shards as units of their own (the root's unit holds the rest: the embedding, the
        final norm and the LM head, gathered by the root's forward)."""
        return list(self.transformer["blocks"])

    def get_input_embeddings(self) -> nn.Module:
        return self.transformer["wte"]

    @property
    def max_sequence_length(self) -> int:
        """Positions a sequence (prompt and completion) may span."""
        return self.config.max_sequence_length

    # -- weights ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Random weights at a realistic scale: variance-preserving projections, residual outputs scaled by
        1/sqrt(2 n_layers), and an LM head whose logits have a std of about 2 (not sqrt(d)). A seed gives the
        same weights in every dtype: each is drawn in fp32 and rounded once."""
        residual_scale = 1.0 / math.sqrt(2 * self.config.n_layers)
        residual_outputs = {id(m) for block in self.transformer["blocks"] for m in (block.attn_out, block.ff_out)}
        for module in self.modules():
            if isinstance(module, nn.Linear):
                std = 1.0 / math.sqrt(module.in_features)
                _normal_(module.weight, std * residual_scale if id(module) in residual_outputs else std, generator)
            elif isinstance(module, nn.Embedding):
                # A tied embedding doubles as the LM head, so it takes the head's scale.
                std = 2.0 / math.sqrt(self.config.d_model) if self.config.weight_tying else 1.0
                _normal_(module.weight, std, generator)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        if not self.config.weight_tying:
            _normal_(self.transformer["ff_out"].weight, 2.0 / math.sqrt(self.config.d_model), generator)

    @staticmethod
    def preset_config(name: str) -> LLaDAConfig:
        """The config of a preset: "tiny", "small" or "llada-8b" (LLaDAConfig.preset)."""
        return LLaDAConfig.preset(name)

    @classmethod
    def with_random_weights(cls, config: LLaDAConfig, *, dtype: torch.dtype = torch.float32,
                            device: str | torch.device = "cpu", seed: int = 0) -> "LLaDAModel":
        """`init_weights`' random weights from `seed`, allocated directly in `dtype` on `device` (an 8B model
        never exists in fp32 on the host). Under a FakeTensorMode (the planner) the model is built in place:
        fake tensors take no memory, and a meta skeleton could not be moved onto them."""
        if torch.device(device).type == "meta":
            raise ValueError("with_random_weights(device='meta'): meta tensors hold no values to draw; build the "
                             "skeleton with `with torch.device('meta'): LLaDAModel(config)`, or pick a real device.")
        if detect_fake_mode() is not None:
            with torch.device(device), _default_dtype(dtype):
                model = cls(config)
        else:
            with torch.device("meta"):
                model = cls(config)
            model = model.to(dtype=dtype).to_empty(device=device)
        model.init_weights(generator=torch.Generator(device=device).manual_seed(seed))
        return model

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, dtype: torch.dtype | None = None, device: str | torch.device | None = None,
        *, allow_external_links: bool = False,
    ) -> "LLaDAModel":
        """Load an official LLaDA checkpoint directory (config.json + model*.safetensors, sharded or not).

        dtype (a torch dtype or its name) defaults to the checkpoint's. A checkpoint that mixes dtypes (e.g. bf16
        matrices with fp32 norms) loads entirely in the dtype that holds most of its weight elements, so that the
        model runs; pass dtype to choose another. device defaults to CPU; device="meta" gives a skeleton with
        the checkpoint's shapes and dtype checked and no data read. config.json is validated field by field
        (name, type, range) before any weight is read. If a save was interrupted mid-swap (see save_pretrained),
        the old checkpoint is moved back into place first. The tokenizer loads separately with
        `transformers.AutoTokenizer.from_pretrained(path)`; `save_pretrained` carries it over. Nothing outside the
        directory is read: its index names files in it, and a symbolic link out of it is followed only with
        allow_external_links=True (a Hugging Face cache snapshot's links into its blobs/ are; models/checkpoint.py).
        """
        from dllm_fast.models.checkpoint import load_checkpoint

        return load_checkpoint(cls, path, dtype=dtype, device=device, allow_external_links=allow_external_links)

    def save_pretrained(
        self, path: str | os.PathLike, *, max_shard_size: int = 5 * 2**30, tokenizer=None
    ) -> None:
        """Write the official layout: config.json and model.safetensors (or shards plus the index when larger
        than max_shard_size bytes). Pass `tokenizer` to save it alongside; without one, the tokenizer files of
        the directory the model was loaded from are copied (remote-code *.py files always are).

        The save is atomic for the whole directory: the checkpoint is written (and fsynced) into a staging
        directory beside `path`, then swapped in. An interrupted save leaves the old checkpoint at `path`,
        loadable and unmixed; saving into the directory the model was loaded from works. Files in an existing
        `path` that are not part of a checkpoint (anything but model*.safetensors, the index, config.json,
        tokenizer files and *.py) are kept. One writer per path at a time."""
        from dllm_fast.models.checkpoint import save_checkpoint

        save_checkpoint(self, path, max_shard_size=max_shard_size, tokenizer=tokenizer)
