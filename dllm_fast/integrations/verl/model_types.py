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


def _config_class(model_type: str) -> type[PretrainedConfig]:
    def __init__(self, **fields):
        fields.setdefault("architectures", [f"{model_type}_diffusion_lm"])  # verl asks for exactly one
        super(cls, self).__init__(**fields)
        self.__dict__.setdefault(SECTION, Section())

    cls = type(f"DllmFast{model_type.capitalize()}Config", (PretrainedConfig,),
               {"model_type": model_type, "__init__": __init__, "__module__": __name__,
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
