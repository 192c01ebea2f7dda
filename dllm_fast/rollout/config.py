"""The rollout settings as one object: `GenerateConfig`, what a `generate` call decodes with, unchecked (the
checked form is rollout.plan.DecodingPlan, built by check_generate_args when the call runs, since some checks need
the model and the prompts). Imports neither torch nor the sampler."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dllm_fast.rollout.cache import CachePolicy
    from dllm_fast.rollout.remasking import Remasking


@dataclass(frozen=True)
class GenerateConfig:
    """The settings of a rollout, as `dllm_fast.generate` takes them (its docstring says what each means): the
    lengths, the schedule (steps or a threshold), temperature, remasking, classifier-free guidance, the cache, the
    EOS rules, compilation, for planning on fake tensors assumed_steps_per_block, and for block-diffusion models
    full_last_block (the official SDAR/LLaDA2 generate's whole last block; off by default) and eos_early_stop
    (stop once every row has ended, as LLaDA2's generate does), and CJ-GRPO's decoders: unmask_schedule ("even",
    LLaDA's split; "ass", 2^s tokens at step s of a block) and eos_schedule (EOSER: the EOS confidence times a
    factor rising from eos_schedule[0] to eos_schedule[1] over a block's steps). The generator and
    record_unmask_step are not settings: they travel beside it. Values are checked where the config is used
    (errors name the field, as generate's keyword), so a config can be built before its model exists."""

    gen_length: int
    block_length: int
    steps: int | None = None
    temperature: float = 0.0
    remasking: str | Remasking = "low_confidence"
    cfg_scale: float = 0.0
    cache: str | CachePolicy = "none"
    threshold: float | None = None
    logits_eos_inf: bool = False
    confidence_eos_eot_inf: bool = False
    compile: bool = False
    assumed_steps_per_block: int | None = None
    full_last_block: bool = False
    eos_early_stop: bool = False
    # -- CJ-GRPO's decoders (EOSER, ASS; rollout/plan.py unmask_counts and eos_factors) --
    unmask_schedule: str = "even"
    eos_schedule: tuple[float, float] | None = None


SETTINGS = tuple(field.name for field in dataclasses.fields(GenerateConfig))


def rollout_settings(config: GenerateConfig | None, settings: dict[str, Any], caller: str) -> dict[str, Any]:
    """A call's settings by name: `config`'s fields, with the keyword `settings` over them (as
    dataclasses.replace would); a name that is no setting is refused as Python refuses an unknown keyword."""
    if config is not None and not isinstance(config, GenerateConfig):
        raise TypeError(f"{caller}() takes config=GenerateConfig(...) or None, got {type(config).__name__}; pass the "
                        "settings as a GenerateConfig or as keywords (gen_length=..., block_length=..., ...).")
    unknown = [name for name in settings if name not in SETTINGS]
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}; the rollout settings are "
                        f"GenerateConfig's fields: {', '.join(SETTINGS)}.")
    given = {} if config is None else {name: getattr(config, name) for name in SETTINGS}
    return {**given, **settings}


def rollout_config(config: GenerateConfig | None, settings: dict[str, Any], caller: str) -> GenerateConfig:
    """The GenerateConfig of a call that takes `config` and keyword settings: the config itself when no keyword
    is given, else the config with the keywords overriding its fields (or the keywords alone)."""
    if config is not None and not settings:
        rollout_settings(config, settings, caller)  # the type check
        return config
    merged = rollout_settings(config, settings, caller)
    missing = [name for name in ("gen_length", "block_length") if name not in merged]
    if missing:
        raise TypeError(f"{caller}() needs {' and '.join(missing)}: pass them as keywords, or "
                        "config=GenerateConfig(gen_length=..., block_length=..., ...).")
    return GenerateConfig(**merged)
