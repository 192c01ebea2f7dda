"""What a training configuration's names point at, checked without loading weights: the model family and
tokenizer directory behind --model and --tokenizer (`model_source`), whether that family decodes in blocks, the
device behind --device (`check_device`) and the modules --lora-targets adapts (`lora_targets`). The trainer,
the planner and TrainConfig's checks call them; config.py holds the configuration alone."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dllm_fast.train.settings import LoraSettings, ModelSettings


def model_source(model: ModelSettings, lora: LoraSettings) -> tuple[Any, type, Path]:
    """(what to load: a preset name or a checkpoint directory, the model family's class, the tokenizer directory),
    checked without reading any weight; with --lora true, --lora-targets against the family's modules too. Takes
    a configuration's model and LoRA sections (TrainConfig.model, .lora)."""
    from dllm_fast.assets import EMBEDDED_MODELS, SUDOKU4_DIR
    from dllm_fast.models.loading import PRESETS, model_family

    name = model.name
    source = embedded_source(name)
    try:
        family = model_family(source, allow_external_links=model.allow_external_links)
    except FileNotFoundError:
        raise FileNotFoundError(f"--model {name!r} is neither a preset ({', '.join(PRESETS)}), an embedded model "
                                f"({', '.join(EMBEDDED_MODELS)}; sudoku4 the default), nor a directory holding "
                                "config.json.") from None
    except ValueError as error:
        raise ValueError(f"--model {name!r}: {error}") from None
    if lora.enabled:
        lora_targets(family, lora)
    tokenizer = Path(model.tokenizer or (SUDOKU4_DIR if name in PRESETS else source))
    option = "--tokenizer" if model.tokenizer else "--model"
    if not tokenizer.is_dir():
        raise FileNotFoundError(f"{option} {str(tokenizer)!r} is not a directory (one holding a tokenizer's "
                                "tokenizer_config.json and files).")
    if not any((tokenizer / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"{option} {str(tokenizer)!r} holds no tokenizer (none of "
                                f"{', '.join(TOKENIZER_FILES)}); point --tokenizer at the model's tokenizer directory.")
    return source, family, tokenizer


def embedded_source(name: str):
    """What --model NAME loads: an embedded model's directory (assets.EMBEDDED_MODELS: sudoku4, sdar-sudoku4),
    else the name itself (a preset or a checkpoint directory)."""
    from dllm_fast.assets import EMBEDDED_MODELS

    return EMBEDDED_MODELS.get(name, name)


def block_diffusion_model(model: ModelSettings) -> bool:
    """Whether --model is of a block-diffusion family (SDAR): its rollouts decode the model's own blocks, and
    --threshold with --diffusion-steps is SDAR's dynamic rule. False when the model cannot be found (the setup
    checks name that)."""
    return bool(getattr(known_family(model), "block_diffusion", False))


def known_family(model: ModelSettings) -> type | None:
    """The class --model loads as, or None when it cannot be found (the setup checks name that)."""
    from dllm_fast.models.loading import model_family

    try:
        return model_family(embedded_source(model.name), allow_external_links=model.allow_external_links)
    except (FileNotFoundError, ValueError):
        return None


def check_cache(model: ModelSettings, cache: str) -> None:
    """--cache suits the model's family: a block-diffusion model's exact "block" cache for it alone, Fast-dLLM's
    approximate "prefix" and "dual" for bidirectional models that predict each position from itself."""
    family = known_family(model)
    if family is None:
        return
    name = f"--model {model.name!r}"
    if getattr(family, "block_diffusion", False):
        if cache not in ("block", "none"):
            raise ValueError(f"--cache {cache} is Fast-dLLM's approximate cache for bidirectional models; {name} is "
                             f"a block-diffusion model ({family.__name__}) whose cache is exact: pass --cache block "
                             "(or none to recompute every step).")
    elif cache == "block":
        raise ValueError(f"--cache block keeps the exact keys and values of finished blocks, which only a "
                         f"block-diffusion model (e.g. SDAR) has; {name} is a {family.__name__}: pass --cache prefix "
                         "or dual (Fast-dLLM's approximate caches) or none.")
    elif cache in ("prefix", "dual") and getattr(family, "logit_shift", 0) != 0:
        raise ValueError(f"--cache {cache} needs a model that predicts each position from itself; {name} "
                         f"({family.__name__}) predicts token i from position i - 1 (logit_shift 1): pass --cache "
                         "none.")


# A directory holds a tokenizer when it has one of these (transformers' fast, configured or SentencePiece files).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def check_device(device: str):
    """--device as a torch device the trainer can run on (cpu, cuda, cuda:N; auto), or a ValueError naming it."""
    import torch

    if device == "auto":
        return
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {device!r} is not a torch device; use auto, cpu, cuda or cuda:N.") from None
    if parsed.type == "cpu" and parsed.index not in (None, 0):
        raise ValueError(f"--device {device!r}: the CPU has no index; use --device cpu.")
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {device!r}, but this torch sees no CUDA device; use --device cpu (or auto).")
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(f"--device {device!r}, but this machine has {count} CUDA device(s), cuda:0 to "
                             f"cuda:{count - 1}.")
    elif parsed.type != "cpu":
        raise ValueError(f"--device {device!r}: the trainer runs on cpu or cuda (meta tensors hold no data).")


def lora_targets(family: type, lora: LoraSettings) -> tuple[str, ...]:
    """--lora-targets, checked against the modules the model family lets LoRA adapt (all of them by default)."""
    allowed = tuple(family.lora_target_modules)
    targets = allowed if lora.targets is None else tuple(lora.targets)
    unknown = sorted(set(targets) - set(allowed))
    if unknown or not targets:
        raise ValueError(f"--lora-targets {' '.join(targets) or '(none)'}: {family.__name__}'s adaptable modules "
                         f"are {' '.join(allowed)}; name some of them.")
    return targets
