"""DreamConfig: a Dream-family masked diffusion LM's hyper-parameters under the official config.json field names
(Dream-org/Dream-v0-Instruct-7B: Qwen2.5-7B's configuration, model_type "Dream", plus `mask_token_id`), with
presets.

Facts of the official layout this follows: Qwen2's fields (hidden_size 3584, intermediate_size 18944,
num_hidden_layers 28, num_attention_heads 28, num_key_value_heads 4, head_dim hidden_size / heads = 128, rope_theta
1e6, rms_norm_eps 1e-6, untied embeddings, vocab_size 152064, max_position_embeddings 131072), biases on the query,
key and value projections only, the mask token 151666 ("<|mask|>"), EOS and padding <|endoftext|> 151643, and
<|im_end|> 151645 ending a chat turn (here eot_token_id). No sliding window, no rope_scaling.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dllm_fast.models.config import _json_type
from dllm_fast.validation import check_bool, check_float, check_int

MODEL_TYPE = "Dream"
_REQUIRED_VALUES: dict[str, Any] = {"hidden_act": "silu", "use_sliding_window": False}
_MUST_BE_NULL = ("rope_scaling",)
_MUST_BE_ZERO = ("attention_dropout",)
QWEN25_VOCAB_SIZE = 152064
QWEN_IM_END_TOKEN_ID = 151645


@dataclass
class DreamConfig:
    """Hyper-parameters of a Dream-family model, under config.json's names. `extra` keeps every other field of a
    loaded config.json (auto_map, torch_dtype, ...) so that save_pretrained writes them back."""

    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int = 4
    vocab_size: int = QWEN25_VOCAB_SIZE
    max_position_embeddings: int = 131072
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    mask_token_id: int = 151666
    eos_token_id: int = 151643
    pad_token_id: int | None = 151643
    eot_token_id: int | None = QWEN_IM_END_TOKEN_ID
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "max_position_embeddings"):
            check_int(name, getattr(self, name), minimum=1)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be divisible by num_attention_heads="
                             f"{self.num_attention_heads}.")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = hidden_size / num_attention_heads = {self.head_dim} must be even for "
                             "rotary embeddings.")
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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    # Names the shared machinery (KVCache.for_model, check_input_ids, the planner) reads.
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
    def preset(cls, name: str) -> "DreamConfig":
        """"dream-tiny" (tests: grouped-query attention, Dream's layout at a small size) and "dream-7b"
        (Dream-v0-Instruct-7B's config.json: Qwen2.5-7B's shapes, 7.6B parameters)."""
        presets = {
            "dream-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=128, max_position_embeddings=512,
                               mask_token_id=127, eos_token_id=126, pad_token_id=126, eot_token_id=125),
            "dream-7b": dict(),
        }
        if name not in presets:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(presets)}.")
        return cls(**presets[name])

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "DreamConfig":
        """Build from a Dream config.json dict, refusing (by name) any feature this implementation lacks and any
        field of the wrong type or out of range."""
        if not isinstance(values, dict):
            raise TypeError(f"the config must be a JSON object of fields, got a JSON {_json_type(values)}.")
        if values.get("model_type") != MODEL_TYPE:
            raise ValueError(f"model_type={values.get('model_type')!r} is not a Dream checkpoint (model_type "
                             f"{MODEL_TYPE!r}).")
        for key, required in _REQUIRED_VALUES.items():
            if key in values and (type(values[key]) is not type(required) or values[key] != required):
                raise ValueError(f"{key}={values[key]!r} is not supported: dllm_fast's Dream implements only "
                                 f"{key}={required!r}.")
        for key in _MUST_BE_NULL:
            if values.get(key) is not None:
                raise ValueError(f"{key}={values[key]!r} is not supported by dllm_fast's Dream; it must be null.")
        for key in _MUST_BE_ZERO:
            if values.get(key, 0.0):
                raise ValueError(f"{key}={values[key]!r} is not supported: dllm_fast's Dream runs without dropout.")
        head_dim = values.get("head_dim")
        if head_dim is not None and head_dim != values.get("hidden_size", cls.hidden_size) // values.get(
                "num_attention_heads", cls.num_attention_heads):
            raise ValueError(f"head_dim={head_dim!r} is not hidden_size / num_attention_heads, which dllm_fast's "
                             "Dream (Qwen2's layout) requires.")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in values.items() if k in names}
        if "eot_token_id" not in values:
            vocab = values.get("vocab_size", cls.vocab_size)
            known["eot_token_id"] = QWEN_IM_END_TOKEN_ID if vocab == QWEN25_VOCAB_SIZE else None
        extra = {k: v for k, v in values.items() if k not in names}
        return cls(**known, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """The config.json content, under the official names."""
        values: dict[str, Any] = {"model_type": MODEL_TYPE, "architectures": ["DreamModel"], "rope_scaling": None,
                                  "attention_dropout": 0.0, **_REQUIRED_VALUES}
        values.update(self.extra)
        values.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"})
        inferred_eot = QWEN_IM_END_TOKEN_ID if self.vocab_size == QWEN25_VOCAB_SIZE else None
        if self.eot_token_id == inferred_eot:
            del values["eot_token_id"]  # not an official field; from_dict infers it again
        return values
