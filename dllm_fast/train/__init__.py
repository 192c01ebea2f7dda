"""RL training in one loop that reads top to bottom (`loop.py`), split by concern: what a run holds (`run.py`),
its directory (`run_dir.py`: one run at a time, no write through a link out of it), its checkpoints
(`checkpoint.py`) and what resuming may change (`resume.py`), scaling out (`distributed.py`), its metrics and
curves (`metrics.py`), the prompts (`data.py`), evaluation (`evaluation.py`, `evaluate`), the configuration
(`config.py`: `TrainConfig`, nested by role into the sections of `settings.py`; its values' types in `typed.py`)
and the command line (`cli.py`). Nothing here names a model
family: their knowledge sits behind the hooks of dllm_fast.models.

    from dllm_fast.train import TrainConfig, train
    result = train(TrainConfig(objective="spg", steps=100))          # flat keys, or sections:
    result = train(TrainConfig(objective={"name": "spg"}, run={"steps": 100}))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dllm_fast._lazy import lazy_attributes

if TYPE_CHECKING:
    from dllm_fast.train.config import TrainConfig
    from dllm_fast.train.evaluation import Evaluation, evaluate
    from dllm_fast.train.loop import TrainResult, train

# Loaded on first use, so that `train --help` (which needs only the config) imports no model, op or engine.
_EXPORTS = {"Evaluation": "evaluation", "TrainConfig": "config", "TrainResult": "loop", "evaluate": "evaluation",
            "train": "loop"}
__all__ = ["Evaluation", "TrainConfig", "TrainResult", "evaluate", "train"]

__getattr__ = lazy_attributes(__name__, _EXPORTS)
