"""SDARConfig: an SDAR-family block-diffusion model's hyper-parameters under the official config.json field names
(JetAstra/SDAR, the Qwen3 configuration plus `block_size` and `mask_token_id`), with presets.

Facts of the official layout this follows: config.json has model_type "sdar", architectures ["SDARForCausalLM"],
an auto_map to the remote code, Qwen3's fields (hidden_size, intermediate_size, num_hidden_layers,
num_attention_heads, num_key_value_heads, head_dim (not necessarily hidden_size / heads: SDAR-4B has 2560 and
32 x 128), rope_theta, rms_norm_eps, tie_word_embeddings, vocab_size 151936, max_position_embeddings), the block
size the model was trained with (`block_size`, 4 in the released chat models, up to 64 in others) and the mask
token (151669, "<|MASK|>"); no pad_token_id (the tokenizer pads with <|endoftext|>, the eos_token_id 151643). Its
generation_config.json also stops at <|im_end|> (151645), the chat turn's end: here eot_token_id. The MoE
variant (model_type "sdar_moe") is not implemented.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dllm_fast.models.config import _json_type
from dllm_fast.validation import check_bool, check_float, check_int

MODEL_TYPE = "sdar"
# Fields whose value must be this for the architecture implemented here (a checkpoint that differs is refused
# by name instead of being run wrongly).
_REQUIRED_VALUES: dict[str, Any] = {
    "hidden_act": "silu",
    "attention_bias": False,
    "use_sliding_window": False,
}
_MUST_BE_NULL = ("rope_scaling",)
_MUST_BE_ZERO = ("attention_dropout",)
# Qwen's tokenizer (vocabulary 151936): <|im_end|> ends a chat turn.
QWEN_VOCAB_SIZE = 151936
QWEN_IM_END_TOKEN_ID = 151645


@dataclass
class SDARConfig:
    """Hyper-parameters of an SDAR-family model, under config.json's names. `extra` keeps every other field of a
    loaded config.json (auto_map, torch_dtype, fuse_cross_entropy, ...) so that save_pretrained writes them back."""

    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    vocab_size: int = QWEN_VOCAB_SIZE
    max_position_embeddings: int = 32768
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    block_size: int = 4
    mask_token_id: int = 151669
    eos_token_id: int = 151643
    pad_token_id: int | None = None
    eot_token_id: int | None = QWEN_IM_END_TOKEN_ID
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "block_size"):
            check_int(name, getattr(self, name), minimum=1)
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}.")
        self.rope_theta = check_float("rope_theta", self.rope_theta, minimum=0.0, open_minimum=True)
        self.rms_norm_eps = check_float("rms_norm_eps", self.rms_norm_eps, minimum=0.0, open_minimum=True)
        check_bool("tie_word_embeddings", self.tie_word_embeddings)
        if self.pad_token_id is None:
            self.pad_token_id = self.eos_token_id
        for name in ("mask_token_id", "eos_token_id", "pad_token_id", "eot_token_id"):
            token = getattr(self, name)
            if token is None and name == "eot_token_id":
                continue
            check_int(name, token, hint="a token id")
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"{name}={token} is outside the vocabulary [0, {self.vocab_size}).")
        for name in ("eos_token_id", "pad_token_id", "eot_token_id"):
            if getattr(self, name) == self.mask_token_id:
                raise ValueError(f"mask_token_id={self.mask_token_id} is also {name}; the mask token must differ "
                                 "from every other special token.")
        if not isinstance(self.extra, dict):
            raise TypeError(f"extra must be a dict of further config.json fields, got {type(self.extra).__name__}.")

    # Names the shared machinery (KVCache.for_model, check_input_ids) reads.
    @property
    def n_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def n_kv_heads(self) -> int:
        return self.num_key_value_heads

    @property
    def embedding_size(self) -> int:
        return self.vocab_size

    @property
    def weight_tying(self) -> bool:
        return self.tie_word_embeddings

    @classmethod
    def preset(cls, name: str) -> "SDARConfig":
        """"sdar-tiny" (tests: a head_dim other than hidden / heads, grouped-query attention, blocks of 4),
        "sdar-1.7b" (Qwen3-1.7B's shapes, which SDAR-1.7B continues: tied embeddings) and "sdar-8b"
        (SDAR-8B-Chat's config.json)."""
        presets = {
            "sdar-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=24, vocab_size=128, max_position_embeddings=512,
                              mask_token_id=127, eos_token_id=126, eot_token_id=125),
            "sdar-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                              num_key_value_heads=8, tie_word_embeddings=True),
            "sdar-8b": dict(),
        }
        if name not in presets:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(presets)}.")
        return cls(**presets[name])

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SDARConfig":
        """Build from an SDAR config.json dict, refusing (by name) any feature this implementation lacks and any
        field of the wrong type or out of range."""
        if not isinstance(values, dict):
            raise TypeError(f"the config must be a JSON object of fields, got a JSON {_json_type(values)}.")
        model_type = values.get("model_type")
        if model_type != MODEL_TYPE:
            hint = " (the MoE variant is not implemented)" if model_type == "sdar_moe" else ""
            raise ValueError(f"model_type={model_type!r} is not an SDAR checkpoint (model_type {MODEL_TYPE!r}){hint}.")
        for key, required in _REQUIRED_VALUES.items():
            if key in values and (type(values[key]) is not type(required) or values[key] != required):
                raise ValueError(f"{key}={values[key]!r} is not supported: dllm_fast's SDAR implements only "
                                 f"{key}={required!r}.")
        for key in _MUST_BE_NULL:
            if values.get(key) is not None:
                raise ValueError(f"{key}={values[key]!r} is not supported by dllm_fast's SDAR; it must be null.")
        for key in _MUST_BE_ZERO:
            if values.get(key, 0.0):
                raise ValueError(f"{key}={values[key]!r} is not supported: dllm_fast's SDAR runs without dropout.")
        if "block_size" not in values:
            raise ValueError("config.json has no block_size: an SDAR checkpoint names the block size it was trained "
                             "with; add it (the released chat models use 4).")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in values.items() if k in names}
        if isinstance(known.get("eos_token_id"), list):  # some exports list several; the first ends a completion
            known["eos_token_id"] = known["eos_token_id"][0] if known["eos_token_id"] else None
        if "eot_token_id" not in values:
            vocab = values.get("vocab_size", cls.vocab_size)
            known["eot_token_id"] = QWEN_IM_END_TOKEN_ID if vocab == QWEN_VOCAB_SIZE else None
        extra = {k: v for k, v in values.items() if k not in names}
        return cls(**known, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """The config.json content, under the official names."""
        values: dict[str, Any] = {"model_type": MODEL_TYPE, "architectures": ["SDARForCausalLM"], "rope_scaling": None,
                                  "attention_dropout": 0.0, **_REQUIRED_VALUES}
        values.update(self.extra)
        values.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"})
        inferred_eot = QWEN_IM_END_TOKEN_ID if self.vocab_size == QWEN_VOCAB_SIZE else None
        if self.eot_token_id == inferred_eot:
            del values["eot_token_id"]  # not an official field; from_dict infers it again
        if self.pad_token_id == self.eos_token_id:
            del values["pad_token_id"]  # the official configs have none; from_dict takes the EOS again
        return values
