"""The peers' models on dllm_fast's weights, for benchmarks/bench_peers.py (see its docstring for why each):

- `official_llada`: the official LLaDA model file (Fast-dLLM's llada/model, the Hugging Face LLaDA code with its
  KV caches) on a dllm_fast LLaDAModel's parameters;
- `qwen3_stand_in` and `SDARStandIn`: what SDAR's block_diffusion_generate calls, transformers' Qwen3 on a
  dllm_fast SDARModel's parameters with the loop's block-causal mask and store_kv;
- `NoMaskToken`: a peer's logits with the mask token at -inf (dllm_fast's convention), for the samplers;
- `Quiet`, `Recorder`: the official model for the loss code, its warnings silenced, the noisy inputs recorded.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

import peer_code


def official_llada(peers_dir: Path, model, *, shared_gradients: bool = True):
    """The official LLaDA model (Fast-dLLM's llada/model: the Hugging Face LLaDA code with its KV caches) built on
    `model`'s parameters. shared_gradients: gradients of either land in the same .grad: the same Parameter objects,
    and for the projections dllm_fast fuses (q, k, v; gate, up) dllm_fast's own modules, which compute the official
    projection from their rows of the fused weight (False: the official nn.Linear modules on those rows, as the
    official model runs them, for counting its kernels)."""
    fast = fast_dllm_module(peers_dir)
    configuration = sys.modules["model.configuration_llada"]
    config = configuration.LLaDAConfig(**model.config.to_dict())
    config.use_cache = False  # the official config.json's value; transformers 5 no longer keeps the keyword
    with torch.device("meta"):
        twin = fast.LLaDAModelLM(config, init_params=False)
    twin.load_state_dict({"model." + k: v for k, v in model.state_dict(keep_vars=True).items()}, assign=True,
                         strict=True)
    from dllm_fast.models.layers import ProjectionSlice

    for name, module in model.named_modules():
        if shared_gradients and isinstance(module, ProjectionSlice):
            parent, _, attribute = ("model." + name).rpartition(".")
            setattr(twin.get_submodule(parent), attribute, module)
    return twin.eval()


def fast_dllm_module(peers_dir: Path):
    """Fast-dLLM's llada/generate.py (it imports the official model package, llada/model, which imports einops)."""
    peer_code.use_wheels(peers_dir)
    return peer_code.load_module(peers_dir, "fast_dllm", "llada/generate.py", "fast_dllm_generate",
                                 search=("llada",))


def llada_generate_module(peers_dir: Path):
    return peer_code.load_module(peers_dir, "llada", "generate.py", "llada_generate")


def sdar_generate_module(peers_dir: Path):
    return peer_code.load_module(peers_dir, "sdar", "generate.py", "sdar_generate")


def qwen3_stand_in(model):
    """transformers' Qwen3ForCausalLM on the SDAR model's parameters (shared tensors; see the docstring)."""
    import transformers

    c = model.config
    config = transformers.Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
        rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings, attn_implementation="sdpa",
        max_position_embeddings=c.max_position_embeddings)
    with torch.device("meta"):
        qwen = transformers.Qwen3ForCausalLM(config)
    qwen.load_state_dict(model.state_dict(keep_vars=True), assign=True, strict=not c.tie_word_embeddings)
    if c.tie_word_embeddings:
        qwen.lm_head.weight = qwen.model.embed_tokens.weight
    rotary = type(qwen.model.rotary_emb)(config)  # its tables: buffers the meta construction left empty
    qwen.model.rotary_emb = rotary.to(device=model.device)
    return qwen.eval()


class NoMaskToken(torch.nn.Module):
    """A peer's model whose logits give the mask token -inf: dllm_fast never decodes [MASK] (README), so its
    confidences are normalised without it; the peers then decode and normalise over the same tokens."""

    def __init__(self, model, mask_token_id: int):
        super().__init__()
        self.model = model
        self.mask_token_id = mask_token_id

    @property
    def device(self):
        return next(self.model.parameters()).device

    @property
    def dtype(self):
        return next(self.model.parameters()).dtype

    def forward(self, *args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers 5's deprecations of the 4.x keywords the peers pass
            out = self.model(*args, **kwargs)
        out.logits[..., self.mask_token_id] = float("-inf")
        return out


class SDARStandIn(NoMaskToken):
    """What SDAR's block_diffusion_generate calls: model(block, attention_mask=[1, q, k] block-causal,
    position_ids, past_key_values=DynamicCache, use_cache=True, store_kv=...) -> .logits. Qwen3 appends every
    call's keys and values to the cache; a call with store_kv=False has them trimmed again, as SDAR's attention
    reads without storing."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=True,
                store_kv=False):
        allowed = attention_mask.bool()[:, None]  # [1, 1, queries, keys]
        out = super().forward(input_ids=input_ids, attention_mask=allowed, position_ids=position_ids,
                              past_key_values=past_key_values, use_cache=True)
        if not store_kv:
            past_key_values.crop(-input_ids.shape[1])
        return out


class Quiet(torch.nn.Module):
    """The official model, with transformers' deprecation warnings (of the 4.x keywords the peers pass) silenced."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    @property
    def device(self):
        return next(self.model.parameters()).device

    @property
    def dtype(self):
        return next(self.model.parameters()).dtype

    def forward(self, input_ids, *args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self.model(input_ids, *args, **kwargs)


class Recorder(Quiet):
    """The official model, recording the token ids of every forward (the noisy sequences the loss code drew)."""

    def __init__(self, model):
        super().__init__(model)
        self.inputs: list[torch.Tensor] = []

    def forward(self, input_ids, *args, **kwargs):
        self.inputs.append(input_ids.detach().clone())
        return super().forward(input_ids, *args, **kwargs)
