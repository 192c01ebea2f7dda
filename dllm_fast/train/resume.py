"""What a resumed run is: the saved run's configuration, of which only how long it runs and how it reports may
change. `--resume true` never silently continues with other settings, and config.json says what runs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from dllm_fast.train.config import TrainConfig, flag

CONFIG = "config.json"  # the configuration that ran, in the run directory and in each checkpoint
_FIELDS = [f.name for f in dataclasses.fields(TrainConfig)]
# What a resumed run may change: how long it runs and how it reports. Everything else must be the saved run's.
CHANGEABLE_ON_RESUME = ("steps", "eval_every", "checkpoint_every", "progress", "plot", "threads")
# Where and how to start, not what runs.
RUN_CONTROL = ("resume", "overwrite", "output_dir")


def resumed_config(saved: TrainConfig, given: dict[str, Any], where: str) -> TrainConfig:
    """The configuration of a resumed run: the saved one (`where` names its file), with the options `given` on the
    command line or in a config file that may change on resume; any other given option that differs is an error
    listing them all."""
    differing = [name for name in _FIELDS if name in given  # in the order of --help
                 and name not in CHANGEABLE_ON_RESUME + RUN_CONTROL and given[name] != getattr(saved, name)]
    if differing:
        raise ValueError(_resume_refusal(saved, given, differing, where))
    kept = {name: value for name, value in given.items() if name in CHANGEABLE_ON_RESUME + RUN_CONTROL}
    return dataclasses.replace(saved, **kept)


def check_resumable(config: TrainConfig, saved: TrainConfig, where: str) -> None:
    """Raise unless `config` continues the run `saved` describes (only CHANGEABLE_ON_RESUME may differ)."""
    differing = [name for name in _FIELDS if name not in CHANGEABLE_ON_RESUME + RUN_CONTROL
                 and getattr(config, name) != getattr(saved, name)]
    if differing:
        raise ValueError(_resume_refusal(saved, config.to_dict(), differing, where))


def _resume_refusal(saved: TrainConfig, given: dict[str, Any], differing: list[str], where: str) -> str:
    listed = ", ".join(f"{flag(name)} {given[name]!r} (saved: {getattr(saved, name)!r})" for name in differing)
    return (f"--resume true continues the run saved in {where}, but these options differ from it: {listed}. On "
            f"resume only {', '.join(map(flag, CHANGEABLE_ON_RESUME))} may change; drop the others, or start a new "
            "run with --overwrite true or another --output-dir.")


def saved_config(checkpoint: Path) -> TrainConfig:
    """The configuration the checkpoint directory's run was trained with (its config.json)."""
    path = checkpoint / CONFIG
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} cannot be read ({error}); the checkpoint cannot be resumed without the "
                         "configuration it ran with.") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a JSON object of options.")
    try:
        return TrainConfig.from_dict(values)
    except (TypeError, ValueError, OSError) as error:
        raise type(error)(f"{path}, the configuration the checkpoint ran with, is not valid ({error}); the "
                          "checkpoint cannot be resumed as it is: start afresh with --overwrite true.") from None
