"""How a trainer turns a model name into weights and a tokenizer, whatever the architecture.

A model family registers its class with the `model_type` its config.json carries and its presets. The trainer
(dllm_fast.train) then asks only the functions below and the class's hooks, so a new family touches this folder
and nothing in dllm_fast/train. Besides the model contract (contracts.DiffusionLM), a trainable class provides:

- `Class(config)` builds it (on the meta device too) from `model.config`, `Class.from_pretrained(path, dtype=,
  device=)` loads a checkpoint directory, `model.save_pretrained(path, tokenizer=)` writes one, and
  `Class.with_random_weights(config, dtype=, device=, seed=)` with `Class.preset_config(name)` gives the presets;
- `lora_target_modules` (the module names LoRA may adapt; all of them by default) and
  `lora_target_pattern(names)` (a PEFT target regex for some of them);
- `shard_units()`: the submodules FSDP2 shards as units of their own;
- `set_gradient_checkpointing(enabled)`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dllm_fast.models.llada import LLaDAModel

# config.json model_type -> the class that loads it. A config.json without a model_type is read by the first.
FAMILIES: dict[str, type] = {"llada": LLaDAModel}
# preset name -> (class, its config)
PRESETS: dict[str, tuple[type, object]] = {name: (LLaDAModel, name) for name in ("tiny", "small", "llada-8b")}


def register_family(model_type: str, cls: type, presets: tuple[str, ...] = ()) -> None:
    """Make checkpoints whose config.json says `model_type`, and the named presets, load as `cls`."""
    if model_type in FAMILIES and FAMILIES[model_type] is not cls:
        raise ValueError(f"model_type {model_type!r} is already registered to {FAMILIES[model_type].__name__}.")
    FAMILIES[model_type] = cls
    PRESETS.update({name: (cls, name) for name in presets})


def model_class(directory: str | Path) -> type:
    """The registered class for the checkpoint in `directory`, by its config.json's model_type."""
    config_file = Path(directory) / "config.json"
    try:
        values = json.loads(config_file.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{config_file} cannot be read as JSON ({error}).") from None
    model_type = values.get("model_type") if isinstance(values, dict) else None
    if model_type is None:
        return next(iter(FAMILIES.values()))
    if model_type not in FAMILIES:
        raise ValueError(f"{config_file} has model_type {model_type!r}, which no registered model family loads "
                         f"(known: {', '.join(sorted(FAMILIES))}); wrap other Hugging Face models with "
                         "HFDiffusionLM and train them through the TRL adapter.")
    return FAMILIES[model_type]


def model_family(name: str | Path) -> type:
    """The class a preset name or a checkpoint directory loads as, found without reading any weight."""
    if str(name) in PRESETS:
        return PRESETS[str(name)][0]
    if not (Path(name) / "config.json").is_file():
        raise FileNotFoundError(f"model {str(name)!r} is neither a preset ({', '.join(PRESETS)}) nor a directory "
                                "holding config.json.")
    return model_class(name)


def load_model(name: str | Path, *, dtype: torch.dtype, device: torch.device | str, seed: int = 0):
    """A preset with random weights from `seed` (PRESETS), or the checkpoint directory `name`."""
    cls = model_family(name)
    if str(name) in PRESETS:
        return cls.with_random_weights(cls.preset_config(PRESETS[str(name)][1]), dtype=dtype, device=device,
                                       seed=seed)
    return cls.from_pretrained(name, dtype=dtype, device=device)


def family_of(model) -> type:
    """The registered class `model` is an instance of (FSDP2 subclasses the model's class in place)."""
    for cls in FAMILIES.values():
        if isinstance(model, cls):
            return cls
    raise TypeError(f"{type(model).__name__} belongs to no registered model family ({', '.join(FAMILIES)}).")


def load_tokenizer(directory: str | Path):
    """AutoTokenizer of a checkpoint directory (its chat template included). transformers warns when
    AutoTokenizer reads a config.json of a model_type it does not know (such as "llada"); the families' tokenizer
    configs name their class, so a blank config is enough there."""
    from transformers import AutoTokenizer, PretrainedConfig

    config_file = Path(directory) / "config.json"
    ours = config_file.is_file() and json.loads(config_file.read_text()).get("model_type") in FAMILIES
    return AutoTokenizer.from_pretrained(str(directory), **({"config": PretrainedConfig()} if ours else {}))


__all__ = ["FAMILIES", "PRESETS", "family_of", "load_model", "load_tokenizer", "model_class", "model_family",
           "register_family"]
