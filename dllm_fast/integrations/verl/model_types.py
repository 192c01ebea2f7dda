"""dllm_fast's model families as `transformers` config types, so that verl reads their checkpoints.

verl builds every worker's `HFModelConfig` from `actor_rollout_ref.model.path` with `AutoConfig.from_pretrained`,
which refuses a config.json whose `model_type` transformers does not know ("llada", "sdar", "Dream",
"llada2_moe": the types dllm_fast's loaders read, `dllm_fast.models.loading.FAMILIES`). `register_model_types()`
registers one plain `PretrainedConfig` subclass per family with `AutoConfig`: it holds the config.json's fields as
attributes and nothing else (the weights are loaded by dllm_fast's own loaders, `engine.py`). A checkpoint that
ships its own configuration code (official LLaDA, with trust_remote_code=True) is read with that code instead, as
transformers does.

The configs also hold the engine's settings section: verl copies `actor_rollout_ref.model.override_config` onto the
HF config (`update_model_config`, which walks nested dicts attribute by attribute), so `override_config.dllm_fast`
needs a `dllm_fast` attribute to land in; `Section` is that attribute (a dict with attribute access, which stays
JSON-serialisable). The engine reads the section from `HFModelConfig.override_config` itself, never from here.
"""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

SECTION = "dllm_fast"  # actor_rollout_ref.model.override_config.dllm_fast


class Section(dict):
    """A dict whose keys read and write as attributes, a missing one reading as a new empty Section: what verl's
    update_model_config needs to copy a nested dict into (getattr for dicts, setattr for values)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return self.setdefault(name, Section())

    def __setattr__(self, name: str, value) -> None:
        self[name] = value


# transformers' standard names (which verl reads: attention heads, sizes) for LLaDA's own config.json fields.
_LLADA_NAMES = {"hidden_size": "d_model", "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
                "num_hidden_layers": "n_layers", "intermediate_size": "mlp_hidden_size"}


def _config_class(model_type: str) -> type[PretrainedConfig]:
    def __init__(self, tie_word_embeddings=None, weight_tying=False, **fields):
        fields.setdefault("architectures", [f"{model_type}_diffusion_lm"])  # verl asks for exactly one
        super(cls, self).__init__(**fields)
        # tie_word_embeddings (which verl reads) from LLaDA's weight_tying where the file has only that
        self.weight_tying = weight_tying
        self.tie_word_embeddings = bool(weight_tying if tie_word_embeddings is None else tie_word_embeddings)
        if model_type == "llada" and getattr(self, "n_kv_heads", None) is None and hasattr(self, "n_heads"):
            self.n_kv_heads = self.n_heads  # LLaDA's null n_kv_heads means n_heads
        self.__dict__.setdefault(SECTION, Section())

    cls = type(f"DllmFast{model_type.capitalize()}Config", (PretrainedConfig,),
               {"model_type": model_type, "__init__": __init__, "__module__": __name__,
                "attribute_map": _LLADA_NAMES if model_type == "llada" else {},
                "__doc__": f"config.json of a dllm_fast {model_type!r} checkpoint, as transformers reads it."})
    return cls


CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {}


def register_model_types() -> list[str]:
    """Register a config class with AutoConfig for each dllm_fast family transformers does not know; returns the
    model types registered by this call (idempotent: a second call registers none)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from dllm_fast.models.loading import FAMILIES

    registered = []
    for model_type in FAMILIES:
        if model_type in CONFIG_CLASSES or model_type in CONFIG_MAPPING:
            continue
        CONFIG_CLASSES[model_type] = _config_class(model_type)
        AutoConfig.register(model_type, CONFIG_CLASSES[model_type])
        registered.append(model_type)
    return registered


def config_class(model_type: str) -> type[PretrainedConfig]:
    """The config class transformers reads `model_type`'s config.json with (registering the families first)."""
    register_model_types()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_CLASSES.get(model_type) or CONFIG_MAPPING[model_type]
