"""dllm_fast's tasks (sudoku4, countdown, gsm8k, math) as verl reward functions, and the reward manager
`reward.reward_manager.name=dllm_fast` that decodes a diffusion completion the way dllm_fast scores it.

A sample's row (integrations/verl/data.py writes them) says its task in `data_source` ("dllm_fast/sudoku4"),
the reference answer in `reward_model.ground_truth`, and the task's fields in `extra_info["dllm_fast"]`
(`question` and `data`, the Example's). The reward is the task's (`Task.reward`, checked by
`tasks.rewards.reward_value`); `acc` is `Task.correct`, and each reward component is logged beside them.

    reward.custom_reward_function.path=pkg://dllm_fast.integrations.verl.rewards
    reward.custom_reward_function.name=compute_score        # by data_source; or sudoku4, countdown, gsm8k, math

The manager: the rollout returns the whole canvas (rollout.py), and what counts of it is the completion up to and
including its first EOS (`contracts.completion_mask`), which dllm_fast's trainer and its TRL adapter decode with
special tokens skipped. verl's `naive` manager decodes every response token; `dllm_fast` is the naive manager
reading the response only up to that EOS. Rows of another data_source go to the configured reward function (verl's
default scorer when none is), and a configured custom function scores dllm_fast's rows too.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from dllm_fast.tasks import Example, get_task
from dllm_fast.tasks.rewards import reward_value

DATA_SOURCE_PREFIX = "dllm_fast/"
EXTRA_KEY = "dllm_fast"
TASKS = ("sudoku4", "countdown", "gsm8k", "math")
MANAGER_NAME = "dllm_fast"


@functools.lru_cache(maxsize=None)
def _task(name: str):
    return get_task(name)


def task_of(data_source: str) -> str:
    if not isinstance(data_source, str) or not data_source.startswith(DATA_SOURCE_PREFIX):
        raise ValueError(f"data_source={data_source!r} is not a dllm_fast task; dllm_fast's rows say "
                         f"'{DATA_SOURCE_PREFIX}<task>' (integrations/verl/data.py writes them).")
    name = data_source[len(DATA_SOURCE_PREFIX):]
    if name not in TASKS:
        raise ValueError(f"data_source={data_source!r} names no dllm_fast task ({', '.join(TASKS)}).")
    return name


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                  task: str | None = None, **unused) -> dict[str, Any]:
    """verl's reward-function signature -> {"score": the task's reward, "acc": correct, components...}."""
    name = task or task_of(data_source)
    fields = (extra_info or {}).get(EXTRA_KEY)
    if not isinstance(fields, dict) or "question" not in fields:
        raise ValueError(f"extra_info[{EXTRA_KEY!r}] must hold the example's question and data (rows written by "
                         "dllm_fast.integrations.verl.data); got "
                         f"{sorted((extra_info or {}).keys()) if isinstance(extra_info, dict) else extra_info!r}.")
    data = fields.get("data") or {}
    example = Example(question=fields["question"], answer=str(ground_truth),
                      data=json.loads(data) if isinstance(data, str) else dict(data))
    task_object = _task(name)
    components = {key: reward_value(value, f"task {name!r}'s reward component {key!r}")
                  for key, value in task_object.reward_components(example, solution_str).items()}
    return {"score": reward_value(task_object.reward(example, solution_str), f"task {name!r}'s reward"),
            "acc": float(task_object.correct(example, solution_str)), **components}


def _fixed_task(name: str):
    def score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        return compute_score(data_source, solution_str, ground_truth, extra_info, task=name)

    score.__name__ = score.__qualname__ = name
    score.__doc__ = f"`compute_score` for the {name} task, whatever the row's data_source."
    return score


sudoku4 = _fixed_task("sudoku4")
countdown = _fixed_task("countdown")
gsm8k = _fixed_task("gsm8k")
math = _fixed_task("math")


class _UpToFirstEOS:
    """A tokenizer whose `decode` reads ids only up to and including the first EOS (module docstring)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._eos = tokenizer.eos_token_id

    def decode(self, ids, *args, **kwargs):
        values = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        if self._eos is not None and self._eos in values:
            values = values[:values.index(self._eos) + 1]
        return self._tokenizer.decode(values, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def register_reward_manager() -> str:
    """Register `reward.reward_manager.name=dllm_fast` in verl's reward-manager registry."""
    from verl.experimental.reward_loop.reward_manager import NaiveRewardManager, register
    from verl.experimental.reward_loop.reward_manager.registry import REWARD_MANAGER

    if MANAGER_NAME in REWARD_MANAGER:
        return MANAGER_NAME

    class DllmFastRewardManager(NaiveRewardManager):
        """verl's naive manager on the completion up to its first EOS, dllm_fast's tasks by data_source."""

        def __init__(self, config, tokenizer, compute_score=None, **kwargs):
            custom = (config.reward.get("custom_reward_function") or {}).get("path")
            super().__init__(config, _UpToFirstEOS(tokenizer), _by_source(compute_score, bool(custom)), **kwargs)

    register(MANAGER_NAME)(DllmFastRewardManager)
    return MANAGER_NAME


def _by_source(configured, custom: bool):
    """The configured function for every row when it is a custom one, else dllm_fast's for dllm_fast's rows."""
    if custom and configured is not None:
        return configured

    def score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        if isinstance(data_source, str) and data_source.startswith(DATA_SOURCE_PREFIX):
            return compute_score(data_source, solution_str, ground_truth, extra_info)
        if configured is None:
            raise ValueError(f"data_source={data_source!r} is no dllm_fast task and no reward function is "
                             "configured (reward.custom_reward_function.path).")
        return configured(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                          extra_info=extra_info, **kwargs)

    return score
