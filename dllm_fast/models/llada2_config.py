"""LLaDA2Config: a LLaDA2-family model's hyper-parameters (inclusionAI's LLaDA2.0/2.1-mini and -flash, the
mixture-of-experts block-diffusion models) under the official config.json field names, with presets.

Facts of the official layout this follows (LLaDA2.0-mini's and LLaDA2.1-mini's config.json, which are identical):
model_type "llada2_moe", architectures ["LLaDA2MoeModelLM"], an auto_map to the remote code; 20 layers of width
2048, 16 query and 4 key/value heads of 128 (one fused `query_key_value` projection, per-head RMSNorm of queries
and keys), rotary on the first `partial_rotary_factor` x head_dim = 64 dimensions with rope_theta 600,000; the first
`first_k_dense_replace` = 1 layer a dense SwiGLU of width 5120, the others 256 routed experts of width 512 (top-8)
plus `num_shared_experts` = 1 shared expert of width 512; a sigmoid router in fp32 (`router_dtype`, `score_function`)
whose `expert_bias` steers the selection only, grouped top-k (`n_group` 8, the best `topk_group` 4 groups by the
sum of their two best scores), the chosen scores normalised (`norm_topk_prob`) and scaled by
`routed_scaling_factor` 2.5; vocabulary 157,184, pad 156,892. config.json names no mask or EOS token: the official
generate takes mask_id 156895 (<|mask|>) and eos_id 156892 (<|endoftext|>, also the pad), the defaults here.

Fields the official modeling code reads but implements one way only (it applies QK-norm whatever `use_qk_norm`
says, always routes with sigmoid scores and an expert bias, ...) must hold that value; a checkpoint that says
otherwise is refused by name rather than run wrongly. Block diffusion's block size is not in config.json (the
official generate takes block_length=32): `block_size` here defaults to 32 and is written only when it differs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dllm_fast.models.config import _json_type
from dllm_fast.validation import check_bool, check_float, check_int

MODEL_TYPE = "llada2_moe"
ARCHITECTURE = "LLaDA2MoeModelLM"
# LLaDA2's tokenizer: <|endoftext|> ends a completion (and pads), <|mask|> is the mask token.
LLADA2_VOCAB_SIZE = 157184
LLADA2_EOS_TOKEN_ID = 156892
LLADA2_MASK_TOKEN_ID = 156895
DEFAULT_BLOCK_SIZE = 32

# Fields whose value must be this: the only behaviour the official modeling code implements (or the only one
# this implementation does), checked by value and type.
_REQUIRED_VALUES: dict[str, Any] = {
    "hidden_act": "silu",
    "use_qkv_bias": False,
    "use_bias": False,
    "use_qk_norm": True,
    "norm_head": False,
    "norm_softmax": False,
    "use_rmsnorm": True,
    "use_sliding_window": False,
    "using_split_qkv_in_self_attention": False,
    "score_function": "sigmoid",
    "router_dtype": "fp32",
    "moe_router_enable_expert_bias": True,
    "norm_topk_prob": True,
}
_MUST_BE_NULL = ("rope_scaling",)
_MUST_BE_ZERO = ("attention_dropout", "embedding_dropout", "output_dropout")


@dataclass
class LLaDA2Config:
    """Hyper-parameters of a LLaDA2-family model, under config.json's names (LLaDA2.0-mini's values by default).
    `extra` keeps every other field of a loaded config.json (auto_map, dtype, sliding_window, ...) so that
    save_pretrained writes them back. num_experts None makes every layer dense (as the official code does)."""

    hidden_size: int = 2048
    intermediate_size: int = 5120
    num_hidden_layers: int = 20
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int | None = 128
    vocab_size: int = LLADA2_VOCAB_SIZE
    max_position_embeddings: int = 32768
    rope_theta: float = 600000.0
    partial_rotary_factor: float = 0.5
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    num_experts: int | None = 256
    num_experts_per_tok: int = 8
    num_shared_experts: int | None = 1
    moe_intermediate_size: int = 512
    first_k_dense_replace: int = 1
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    pad_token_id: int | None = LLADA2_EOS_TOKEN_ID
    mask_token_id: int = LLADA2_MASK_TOKEN_ID
    eos_token_id: int = LLADA2_EOS_TOKEN_ID
    eot_token_id: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "max_position_embeddings", "block_size",
                     "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("first_k_dense_replace", self.first_k_dense_replace, minimum=0)
        if self.head_dim is None:  # the official default: hidden_size / heads
            self.head_dim = self.hidden_size // self.num_attention_heads
        check_int("head_dim", self.head_dim, minimum=1)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}.")
        self.partial_rotary_factor = check_float("partial_rotary_factor", self.partial_rotary_factor, minimum=0.0,
                                                 maximum=1.0, open_minimum=True)
        if self.rotary_dim < 2:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} of head_dim={self.head_dim} rotates "
                             f"{self.rotary_dim} dimensions (int(head_dim x factor)), so positions would not reach "
                             f"attention; use at least {2 / self.head_dim:g} (2 dimensions).")
        if self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} of head_dim={self.head_dim} rotates "
                             f"{self.rotary_dim} dimensions; rotary embeddings need an even number.")
        self.rope_theta = check_float("rope_theta", self.rope_theta, minimum=0.0, open_minimum=True)
        self.rms_norm_eps = check_float("rms_norm_eps", self.rms_norm_eps, minimum=0.0, open_minimum=True)
        self.routed_scaling_factor = check_float("routed_scaling_factor", self.routed_scaling_factor, minimum=0.0,
                                                 open_minimum=True)
        check_bool("tie_word_embeddings", self.tie_word_embeddings)
        if self.num_shared_experts is not None:
            check_int("num_shared_experts", self.num_shared_experts, minimum=1,
                      hint="or null for none (the official code builds a shared expert unless it is null)")
        if self.num_experts is not None:
            self._check_routing()
        # each id is checked under the name it was given by: a pad id left out is the eos id (checked as that), an
        # eos id left out of config.json is the pad id (from_dict: checked as the pad id)
        pad_given = self.pad_token_id is not None
        if not pad_given:
            self.pad_token_id = self.eos_token_id
        names = ("mask_token_id", "pad_token_id", "eos_token_id", "eot_token_id") if pad_given else (
            "mask_token_id", "eos_token_id", "pad_token_id", "eot_token_id")
        for name in names:
            token = getattr(self, name)
            if token is None and name == "eot_token_id":
                continue
            check_int(name, token, hint="a token id")
            if not 0 <= token < self.vocab_size:
                hint = ("; config.json names no mask token (the official generate takes mask_id=156895): add "
                        "mask_token_id for a vocabulary of another size" if name == "mask_token_id" else
                        "; config.json names no eos_token_id (nor a pad_token_id to take it from), so it is the "
                        f"official {LLADA2_EOS_TOKEN_ID}: add eos_token_id for a vocabulary of another size"
                        if name == "eos_token_id" and token == LLADA2_EOS_TOKEN_ID else "")
                raise ValueError(f"{name}={token} is outside the vocabulary [0, {self.vocab_size}){hint}.")
        for name in names[1:]:
            if getattr(self, name) == self.mask_token_id:
                raise ValueError(f"mask_token_id={self.mask_token_id} is also {name}; the mask token must differ "
                                 "from every other special token.")
        if not isinstance(self.extra, dict):
            raise TypeError(f"extra must be a dict of further config.json fields, got {type(self.extra).__name__}.")

    def _check_routing(self) -> None:
        E, k, groups, kept = self.num_experts, self.num_experts_per_tok, self.n_group, self.topk_group
        check_int("num_experts", E, minimum=1, hint="or null for dense layers only")
        if E % groups:
            raise ValueError(f"num_experts={E} must be a multiple of n_group={groups} (experts are routed in "
                             "equal groups).")
        if E // groups < 2:
            raise ValueError(f"n_group={groups} leaves {E // groups} expert per group; a group is scored by the sum "
                             "of its two best experts, so each needs at least 2.")
        if kept > groups:
            raise ValueError(f"topk_group={kept} exceeds n_group={groups}; at most every group can be kept.")
        if k > kept * (E // groups):
            raise ValueError(f"num_experts_per_tok={k} exceeds the {kept * (E // groups)} experts of the "
                             f"topk_group={kept} groups a token may use.")

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

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that rotary embeddings rotate: int(head_dim x partial_rotary_factor), as the
        official attention and transformers' rotary tables compute it."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` is a mixture of experts (the official rule: experts configured, and the layer at or
        after first_k_dense_replace)."""
        return self.num_experts is not None and index >= self.first_k_dense_replace

    @classmethod
    def preset(cls, name: str) -> "LLaDA2Config":
        """"llada2-tiny" (tests: 16 experts in 4 groups, top-4 of the best 2 groups, a dense first layer, a shared
        expert, partial rotary, grouped-query attention, blocks of 4), "llada2-mini" (LLaDA2.0/2.1-mini's
        config.json) and "llada2-flash" (LLaDA2.0-flash's shapes as inclusionAI/dFactory's model config gives them:
        32 layers of width 4096, 32 query and 4 key/value heads, dense width 9216, 256 experts of width 1024)."""
        presets = {
            "llada2-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=512,
                                num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, n_group=4,
                                topk_group=2, mask_token_id=127, eos_token_id=126, pad_token_id=126, block_size=4),
            "llada2-mini": dict(),
            "llada2-flash": dict(hidden_size=4096, intermediate_size=9216, num_hidden_layers=32,
                                 num_attention_heads=32, moe_intermediate_size=1024),
        }
        if name not in presets:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(presets)}.")
        return cls(**presets[name])

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "LLaDA2Config":
        """Build from a LLaDA2 config.json dict, refusing (by name) any feature the official code does not
        implement the way this one does, and any field of the wrong type or out of range."""
        if not isinstance(values, dict):
            raise TypeError(f"the config must be a JSON object of fields, got a JSON {_json_type(values)}.")
        model_type = values.get("model_type")
        if model_type != MODEL_TYPE:
            hint = (" (inclusionAI/dFactory's training config; its released checkpoints say 'llada2_moe')"
                    if model_type == "llada2_moe_veomni" else "")
            raise ValueError(f"model_type={model_type!r} is not a LLaDA2 checkpoint (model_type {MODEL_TYPE!r}){hint}.")
        for key, required in _REQUIRED_VALUES.items():
            if key in values and (type(values[key]) is not type(required) or values[key] != required):
                raise ValueError(f"{key}={values[key]!r} is not supported: dllm_fast's LLaDA2 implements only "
                                 f"{key}={required!r}, as the official modeling code does.")
        for key in _MUST_BE_NULL:
            if values.get(key) is not None:
                raise ValueError(f"{key}={values[key]!r} is not supported by dllm_fast's LLaDA2; it must be null.")
        for key in _MUST_BE_ZERO:
            if values.get(key, 0.0):
                raise ValueError(f"{key}={values[key]!r} is not supported: dllm_fast's LLaDA2 runs without dropout.")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in values.items() if k in names}
        if isinstance(known.get("eos_token_id"), list):  # some exports list several; the first ends a completion
            known["eos_token_id"] = known["eos_token_id"][0] if known["eos_token_id"] else None
        if ("eos_token_id" not in known and known.get("pad_token_id") is not None
                and values.get("vocab_size") != LLADA2_VOCAB_SIZE):
            known["eos_token_id"] = known["pad_token_id"]  # another tokenizer: its pad is its end of text
        config = cls(**known, extra={k: v for k, v in values.items() if k not in names})
        rotary_dim = values.get("rotary_dim")
        if rotary_dim is not None and rotary_dim != config.rotary_dim:
            raise ValueError(f"rotary_dim={rotary_dim!r} disagrees with partial_rotary_factor="
                             f"{config.partial_rotary_factor} x head_dim={config.head_dim} = {config.rotary_dim}; "
                             "the official code rotates int(head_dim x partial_rotary_factor) dimensions.")
        return config

    def to_dict(self) -> dict[str, Any]:
        """The config.json content, under the official names."""
        values: dict[str, Any] = {"model_type": MODEL_TYPE, "architectures": [ARCHITECTURE], "rope_scaling": None,
                                  **{key: 0.0 for key in _MUST_BE_ZERO}, **_REQUIRED_VALUES}
        values.update(self.extra)
        values.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"})
        values["rotary_dim"] = self.rotary_dim
        official_ids = self.vocab_size == LLADA2_VOCAB_SIZE
        # Not official fields: written only where from_dict would not infer them again.
        if official_ids and self.mask_token_id == LLADA2_MASK_TOKEN_ID:
            del values["mask_token_id"]
        if self.eos_token_id == (LLADA2_EOS_TOKEN_ID if official_ids else self.pad_token_id):
            del values["eos_token_id"]
        if self.eot_token_id is None:
            del values["eot_token_id"]
        if self.block_size == DEFAULT_BLOCK_SIZE:
            del values["block_size"]
        return values
