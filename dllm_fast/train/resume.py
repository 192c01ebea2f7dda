"""What a resumed run is: the saved run's configuration, of which only how long it runs and how it reports may
change. `--resume true` never silently continues with other settings, and config.json says what runs. Options are
compared by their flat keys (the flags' names); config.json is read nested or flat (as earlier versions wrote it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dllm_fast.train.config import TrainConfig
from dllm_fast.train.settings import OPTIONS, flag

CONFIG = "config.json"  # the configuration that ran, in the run directory and in each checkpoint
# What a resumed run may change: how long it runs and how it reports. Everything else must be the saved run's.
CHANGEABLE_ON_RESUME = ("steps", "eval_every", "checkpoint_every", "progress", "plot", "threads")
# Where and how to start, not what runs.
RUN_CONTROL = ("resume", "overwrite", "output_dir")


def resumed_config(saved: TrainConfig, given: dict[str, Any], where: str) -> TrainConfig:
    """The configuration of a resumed run: the saved one (`where` names its file), with the options `given` on the
    command line or in a config file that may change on resume; any other given option that differs is an error
    listing them all."""
    settings = saved.flat()
    differing = [name for name in OPTIONS if name in given  # in the order of --help
                 and name not in CHANGEABLE_ON_RESUME + RUN_CONTROL and given[name] != settings[name]]
    if differing:
        raise ValueError(_resume_refusal(saved, given, differing, where))
    kept = {name: value for name, value in given.items() if name in CHANGEABLE_ON_RESUME + RUN_CONTROL}
    # How the saved run started (e.g. --overwrite true) is not how this one does: its run control is this call's.
    return saved.replace(**{"resume": False, "overwrite": False, **kept})


def check_resumable(config: TrainConfig, saved: TrainConfig, where: str) -> None:
    """Raise unless `config` continues the run `saved` describes (only CHANGEABLE_ON_RESUME may differ)."""
    settings, saved_settings = config.flat(), saved.flat()
    differing = [name for name in OPTIONS if name not in CHANGEABLE_ON_RESUME + RUN_CONTROL
                 and settings[name] != saved_settings[name]]
    if differing:
        raise ValueError(_resume_refusal(saved, settings, differing, where))


def _resume_refusal(saved: TrainConfig, given: dict[str, Any], differing: list[str], where: str) -> str:
    settings = saved.flat()
    listed = ", ".join(f"{flag(name)} {given[name]!r} (saved: {settings[name]!r})" for name in differing)
    return (f"--resume true continues the run saved in {where}, but these options differ from it: {listed}. On "
            f"resume only {', '.join(map(flag, CHANGEABLE_ON_RESUME))} may change; drop the others, or start a new "
            "run with --overwrite true or another --output-dir.")


def saved_config(checkpoint: Path) -> TrainConfig:
    """The configuration the checkpoint directory's run was trained with (its config.json, nested, or flat as
    earlier versions wrote it)."""
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
