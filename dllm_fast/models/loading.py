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

import dataclasses
import json
from pathlib import Path

import torch

from dllm_fast.models.dream import DreamModel
from dllm_fast.models.llada import LLaDAModel
from dllm_fast.models.llada2 import LLaDA2Model
from dllm_fast.models.sdar import SDARModel

# config.json model_type -> the class that loads it. A config.json without a model_type is read by the first.
FAMILIES: dict[str, type] = {"llada": LLaDAModel, "sdar": SDARModel, "Dream": DreamModel, "llada2_moe": LLaDA2Model}
# preset name -> (class, its config)
PRESETS: dict[str, tuple[type, object]] = {name: (LLaDAModel, name) for name in ("tiny", "small", "llada-8b")}
PRESETS.update({name: (SDARModel, name) for name in ("sdar-tiny", "sdar-1.7b", "sdar-8b")})
PRESETS.update({name: (DreamModel, name) for name in ("dream-tiny", "dream-7b")})
PRESETS.update({name: (LLaDA2Model, name) for name in ("llada2-tiny", "llada2-mini", "llada2-flash")})


def register_family(model_type: str, cls: type, presets: tuple[str, ...] = ()) -> None:
    """Make checkpoints whose config.json says `model_type`, and the named presets, load as `cls`."""
    if model_type in FAMILIES and FAMILIES[model_type] is not cls:
        raise ValueError(f"model_type {model_type!r} is already registered to {FAMILIES[model_type].__name__}.")
    FAMILIES[model_type] = cls
    PRESETS.update({name: (cls, name) for name in presets})


def model_class(directory: str | Path, *, allow_external_links: bool = False) -> type:
    """The registered class for the checkpoint in `directory`, by its config.json's model_type (read only inside
    the directory, unless allow_external_links: models/checkpoint.py's `confined`)."""
    from dllm_fast.models.checkpoint import confined

    config_file = Path(directory) / "config.json"
    confined(config_file, Path(directory), allow_external_links)
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


def model_family(name: str | Path, *, allow_external_links: bool = False) -> type:
    """The class a preset name or a checkpoint directory loads as, found without reading any weight."""
    if str(name) in PRESETS:
        return PRESETS[str(name)][0]
    if not (Path(name) / "config.json").is_file():
        raise FileNotFoundError(f"model {str(name)!r} is neither a preset ({', '.join(PRESETS)}) nor a directory "
                                "holding config.json.")
    return model_class(name, allow_external_links=allow_external_links)


def load_model(name: str | Path, *, dtype: torch.dtype, device: torch.device | str, seed: int = 0, tokenizer=None,
               allow_external_links: bool = False):
    """A preset with random weights from `seed` (PRESETS; with `tokenizer`, its vocabulary and special ids are the
    tokenizer's, see `preset_config`), or the checkpoint directory `name` (allow_external_links: follow links out
    of it; models/checkpoint.py)."""
    cls = model_family(name, allow_external_links=allow_external_links)
    if str(name) in PRESETS:
        return cls.with_random_weights(preset_config(str(name), tokenizer), dtype=dtype, device=device, seed=seed)
    return cls.from_pretrained(name, dtype=dtype, device=device, allow_external_links=allow_external_links)


def model_skeleton(name: str | Path, *, tokenizer=None, allow_external_links: bool = False):
    """What `load_model(name, tokenizer=tokenizer)` gives, on the meta device: its shapes, special ids and
    max_sequence_length, with the checkpoint's config and weight headers checked and no weight read."""
    cls = model_family(name, allow_external_links=allow_external_links)
    if str(name) in PRESETS:
        with torch.device("meta"):
            return cls(preset_config(str(name), tokenizer))
    return cls.from_pretrained(name, device="meta", allow_external_links=allow_external_links)


def preset_config(name: str, tokenizer=None):
    """The config of preset `name`; with `tokenizer`, its vocabulary size and special ids taken from the
    tokenizer, so that a preset with random weights never samples ids the tokenizer cannot decode nor masks with a
    token the tokenizer reads as text."""
    cls, preset = PRESETS[name]
    config = cls.preset_config(preset)
    if tokenizer is None:
        return config
    ids = tokenizer_special_ids(tokenizer)
    for field in ("eos_token_id", "mask_token_id"):
        if ids[field] is None:
            raise ValueError(f"the tokenizer names no {field[:-9]} token; preset {name!r} takes its special ids from "
                             f"the tokenizer, which needs an EOS and a mask token ({', '.join(MASK_TOKENS)}).")
    fields = {**ids, "embedding_size": ids["vocab_size"]}
    names = {f.name for f in dataclasses.fields(config)}  # fields only: a config may alias one as a property
    return dataclasses.replace(config, **{k: v for k, v in fields.items() if k in names})


# LLaDA's tokenizers keep the mask and end-of-turn tokens as added tokens, not as `mask_token`.
MASK_TOKENS = ("<|mdm_mask|>",)
EOT_TOKENS = ("<|eot_id|>",)


def tokenizer_special_ids(tokenizer) -> dict[str, int | None]:
    """The vocabulary size (len) and special ids of a tokenizer: eos_token_id, pad_token_id (the EOS when it has
    no pad token), mask_token_id (its mask_token, else one of MASK_TOKENS) and eot_token_id (one of EOT_TOKENS);
    None where it has none."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's tokenizer
    vocabulary = tokenizer.get_vocab()

    def named(tokens):
        return next((vocabulary[token] for token in tokens if token in vocabulary), None)

    eos = tokenizer.eos_token_id
    mask = tokenizer.mask_token_id if tokenizer.mask_token is not None else named(MASK_TOKENS)
    return {"vocab_size": len(tokenizer), "eos_token_id": eos,
            "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
            "mask_token_id": mask, "eot_token_id": named(EOT_TOKENS)}


def check_tokenizer(model, tokenizer, *, model_name: str, tokenizer_name: str) -> None:
    """Raise unless `model` (model contract; a meta skeleton will do) and `tokenizer` agree: every id the tokenizer
    produces has a row in the LM head, and the EOS and mask ids are the same where the tokenizer names them. A
    tokenizer of another model would otherwise end completions at the wrong token, feed the model ids it never
    learnt, and hand the reward function text with holes (ids the tokenizer decodes to nothing)."""
    ids = tokenizer_special_ids(tokenizer)
    vocabulary = model.lm_head_weight.shape[0]
    problems = []
    if ids["vocab_size"] > vocabulary:
        problems.append(f"the tokenizer has {ids['vocab_size']} tokens, the model's vocabulary {vocabulary} (ids from "
                        f"{vocabulary} on have no embedding)")
    for field in ("eos_token_id", "mask_token_id"):
        if ids[field] is not None and ids[field] != getattr(model, field):
            problems.append(f"{field} is {ids[field]} in the tokenizer but {getattr(model, field)} in the model")
    if problems:
        raise ValueError(f"the model {model_name} and the tokenizer {tokenizer_name} disagree: {'; '.join(problems)}. "
                         "Use the tokenizer the model was trained with (--tokenizer DIR), or a model whose config "
                         "names the tokenizer's ids.")


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
    try:
        ours = config_file.is_file() and json.loads(config_file.read_text()).get("model_type") in FAMILIES
    except (OSError, ValueError, AttributeError):
        ours = False
    try:
        return AutoTokenizer.from_pretrained(str(directory), **({"config": PretrainedConfig()} if ours else {}))
    except Exception as error:  # transformers raises OSError, ValueError, TypeError, KeyError ... by cause
        text = " ".join(str(error).split())
        raise ValueError(f"no tokenizer loads from {directory} ({type(error).__name__}: {text[:300]}); point "
                         "--tokenizer at the directory holding the model's tokenizer.json and "
                         "tokenizer_config.json.") from None


__all__ = ["FAMILIES", "PRESETS", "check_tokenizer", "family_of", "load_model", "load_tokenizer", "model_class",
           "model_family", "model_skeleton", "preset_config", "register_family", "tokenizer_special_ids"]
