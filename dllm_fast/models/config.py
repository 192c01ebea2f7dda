"""LLaDAConfig: the architecture hyper-parameters under LLaDA's own config.json field names, plus presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dllm_fast.validation import check_bool, check_float, check_int

# Official config.json fields whose value must be this for the architecture dllm_fast implements
# (LLaDA-8B's values). A checkpoint that differs is rejected by name instead of being loaded wrongly.
_REQUIRED_VALUES: dict[str, Any] = {
    "rope": True,
    "rope_full_precision": True,
    "alibi": False,
    "block_type": "llama",
    "activation_type": "silu",
    "layer_norm_type": "rms",
    "layer_norm_with_affine": True,
    "include_bias": False,
    "include_qkv_bias": False,
    "attention_layer_norm": False,
    "input_emb_norm": False,
    "scale_logits": False,
    "block_group_size": 1,
}
_MUST_BE_FALSY = ("bias_for_layer_norm", "multi_query_attention", "clip_qkv")
_MUST_BE_ZERO = ("attention_dropout", "residual_dropout", "embedding_dropout")

# config.json's model_type of LLaDA checkpoints (one without it is read as LLaDA too).
MODEL_TYPE = "llada"
# LLaDA's tokenizer: <|eot_id|> ends an instruct answer; generate.py can zero its confidence.
LLADA_EOT_TOKEN_ID = 126348


@dataclass
class LLaDAConfig:
    """Hyper-parameters of a LLaDA-architecture masked diffusion LM (field names as in LLaDA's config.json).

    `extra` keeps every other field of a loaded config.json (auto_map, precision, init_* ...) so that
    save_pretrained writes them back unchanged.
    """

    d_model: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    mlp_hidden_size: int = 12288
    vocab_size: int = 126464
    embedding_size: int | None = None
    max_sequence_length: int = 4096
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    weight_tying: bool = False
    mask_token_id: int = 126336
    eos_token_id: int = 126081
    pad_token_id: int = 126081
    eot_token_id: int | None = LLADA_EOT_TOKEN_ID
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "mlp_hidden_size", "vocab_size", "max_sequence_length"):
            check_int(name, getattr(self, name), minimum=1)
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        check_int("n_kv_heads", self.n_kv_heads, minimum=1, hint="or null for n_heads")
        if self.embedding_size is None:
            self.embedding_size = self.vocab_size
        check_int("embedding_size", self.embedding_size, minimum=self.vocab_size,
                  hint="or null for vocab_size")
        self.rope_theta = check_float("rope_theta", self.rope_theta, minimum=0.0, open_minimum=True)
        self.rms_norm_eps = check_float("rms_norm_eps", self.rms_norm_eps, minimum=0.0, open_minimum=True)
        check_bool("weight_tying", self.weight_tying)
        for name in ("mask_token_id", "eos_token_id", "pad_token_id", "eot_token_id"):
            token = getattr(self, name)
            if token is None and name == "eot_token_id":
                continue  # <|eot_id|> is optional: unknown for other tokenizers
            check_int(name, token, hint="a token id")
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"{name}={token} is outside the vocabulary [0, {self.vocab_size}).")
        for name in ("eos_token_id", "pad_token_id", "eot_token_id"):  # the mask must be a token of its own
            if getattr(self, name) == self.mask_token_id:
                raise ValueError(f"mask_token_id={self.mask_token_id} is also {name}; the mask token must differ "
                                 "from every other special token (a masked position would read as an end of text).")
        if not isinstance(self.extra, dict):
            raise TypeError(f"extra must be a dict of further config.json fields, got {type(self.extra).__name__}.")
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}.")
        if (self.d_model // self.n_heads) % 2 != 0:
            raise ValueError(f"head size d_model/n_heads = {self.d_model // self.n_heads} must be even for RoPE.")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}.")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def preset(cls, name: str) -> "LLaDAConfig":
        """"tiny" (tests), "small" (CPU benchmarks: LLaDA's 126464 vocab, small body) or "llada-8b"."""
        presets = {
            "tiny": dict(
                d_model=64, n_layers=2, n_heads=4, mlp_hidden_size=128, vocab_size=128, max_sequence_length=512,
                mask_token_id=127, eos_token_id=126, pad_token_id=126, eot_token_id=125,
            ),
            "small": dict(d_model=512, n_layers=4, n_heads=8, mlp_hidden_size=1536, max_sequence_length=1024),
            "llada-8b": dict(),
        }
        if name not in presets:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(presets)}.")
        return cls(**presets[name])

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "LLaDAConfig":
        """Build from a LLaDA config.json dict, rejecting any feature this implementation does not cover and any
        field of the wrong type or out of range (by name)."""
        if not isinstance(values, dict):
            raise TypeError(f"the config must be a JSON object of fields, got a JSON {_json_type(values)}.")
        if values.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ValueError(f"model_type={values['model_type']!r} is not a LLaDA checkpoint (model_type "
                             f"{MODEL_TYPE!r}); load other Hugging Face models with HFDiffusionLM.")
        for key, required in _REQUIRED_VALUES.items():
            # type() too: JSON's 1.0 or true equal 1 in Python, but are not LLaDA's block_group_size.
            if key in values and (type(values[key]) is not type(required) or values[key] != required):
                raise ValueError(
                    f"{key}={values[key]!r} is not supported: dllm_fast's LLaDA implements only {key}={required!r}."
                )
        for key in _MUST_BE_FALSY:
            if values.get(key):
                raise ValueError(f"{key}={values[key]!r} is not supported by dllm_fast's LLaDA; set it to null or false.")
        for key in _MUST_BE_ZERO:
            if values.get(key, 0.0):
                raise ValueError(
                    f"{key}={values[key]!r} is not supported: dllm_fast's LLaDA runs without dropout, set it to 0."
                )
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in values.items() if k in names}
        if "eot_token_id" not in values:
            known["eot_token_id"] = _inferred_eot_token_id(values.get("vocab_size", cls.vocab_size))
        extra = {k: v for k, v in values.items() if k not in names}
        return cls(**known, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """The config.json content: LLaDA's field names and the fixed architecture values."""
        values: dict[str, Any] = {"model_type": MODEL_TYPE, "architectures": ["LLaDAModelLM"], **_REQUIRED_VALUES}
        values.update(self.extra)
        values.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"})
        if self.eot_token_id == _inferred_eot_token_id(self.vocab_size):
            del values["eot_token_id"]  # not a field of LLaDA's config.json; from_dict infers it again
        return values


def _inferred_eot_token_id(vocab_size: int) -> int | None:
    """<|eot_id|> is only known for LLaDA's own tokenizer (its 126464-token vocabulary)."""
    return LLADA_EOT_TOKEN_ID if vocab_size == LLaDAConfig.vocab_size else None


def _json_type(value: Any) -> str:
    names = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)
