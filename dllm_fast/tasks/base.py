"""What a verifiable task is: examples, a prompt per example, and a reward and an accuracy per completion.

A task never touches the network and uses no torch: generators are seeded `random.Random`s and the
dataset tasks read a local JSONL file. Completions reach `reward` and `correct` as decoded text (special tokens
skipped, as TRL decodes them for d1's reward functions).
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

# Generated tasks draw their problems up front (countdown: about 8,000 a second on one core); beyond this
# many a run would wait minutes before its first step.
MAX_GENERATED_EXAMPLES = 100_000
# A generator that draws this many problems in a row without a new valid one has exhausted its options.
MAX_FAILED_DRAWS = 10_000


@dataclass(frozen=True)
class Example:
    """One problem.

    question: the user turn the model sees, format instructions included.
    answer: the reference answer in the task's notation (a solution grid, a target, a number, a LaTeX value).
    data: task-specific fields the reward reads (the puzzle, the numbers, the target ...).
    source: where it was read from ("train.jsonl:12"), for messages; empty for generated problems.
    """

    question: str
    answer: str
    data: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""


class Task(ABC):
    """A verifiable task. Subclasses set `name` and implement the examples, `reward_components` and `correct`.

    - `train_examples(seed)` is deterministic given the seed; `test_examples()` is fixed by the task's options
      alone, so that every training seed is evaluated on the same problems.
    - `reward` is the sum of `reward_components` (d1 adds its reward functions the same way); each is a reward
      as `dllm_fast.tasks.rewards` defines it (a real number within +-2^24), and so is the sum.
    - `demonstration(example)` is a completion that earns the full reward, in the format the prompt asks for
      (the target of supervised fine-tuning), or None when the task has none.
    """

    name: str = ""

    @abstractmethod
    def train_examples(self, seed: int = 0) -> list[Example]: ...

    @abstractmethod
    def test_examples(self) -> list[Example]: ...

    @abstractmethod
    def reward_components(self, example: Example, completion: str) -> dict[str, float]: ...

    @abstractmethod
    def correct(self, example: Example, completion: str) -> bool: ...

    def reward(self, example: Example, completion: str) -> float:
        from dllm_fast.tasks.rewards import reward_value

        components = self.reward_components(example, completion)
        return reward_value(math.fsum(reward_value(value, f"task {self.name!r}'s reward component {name!r}")
                                      for name, value in components.items()), f"task {self.name!r}'s reward")

    def demonstration(self, example: Example) -> str | None:
        return None

    def prompt(self, example: Example, tokenizer=None) -> str:
        """The prompt text: the tokenizer's chat template around the question when it has one, else the question.

        Encode it with ``add_special_tokens=False``: the chat template already holds the BOS token.
        """
        return chat_prompt(example.question, tokenizer)


def chat_prompt(question: str, tokenizer=None) -> str:
    """`question` as the single user turn of the tokenizer's chat template, ready for the assistant's answer
    (d1 puts its format instructions in the user turn too: no system message)."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=False)
    return question


# ---------------------------------------------------------------------------------------------------------
# Registry

_REGISTRY: dict[str, Callable[..., Task]] = {}


def register_task(name: str, factory: Callable[..., Task]) -> None:
    """Make `get_task(name, **options)` call `factory(**options)`."""
    if name in _REGISTRY:
        raise ValueError(f"a task named {name!r} is already registered; pick another name.")
    _REGISTRY[name] = factory


def available_tasks() -> list[str]:
    return sorted(_REGISTRY)


def get_task(name: str, **options) -> Task:
    """The task `name` built with `options` (e.g. ``get_task("gsm8k", train_path=..., test_path=...)``)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown task {name!r}; available tasks: {', '.join(sorted(_REGISTRY))}.")
    factory = _REGISTRY[name]
    parameters = inspect.signature(factory).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        unknown = sorted(set(options) - set(parameters))
        if unknown:
            raise ValueError(f"task {name!r} has no option {unknown[0]!r}; its options are "
                             f"{', '.join(sorted(parameters)) or 'none'}.")
    return factory(**options)
