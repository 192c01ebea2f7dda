"""Accuracy of a model on a task's examples at given generation settings, batched through `dllm_fast.generate`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from dllm_fast.rollout import generate
from dllm_fast.rollout.config import GenerateConfig, rollout_config
from dllm_fast.tasks.base import Example, Task
from dllm_fast.tasks.encoding import decode_completions, encode_prompts
from dllm_fast.tasks.rewards import task_reward
from dllm_fast.validation import check_int


@dataclass(frozen=True)
class Evaluation:
    """accuracy: share of examples `task.correct` accepts; mean_reward: mean of `task.reward`; per example:
    completions (decoded text), correct, rewards; seconds: wall time of generation and scoring."""

    accuracy: float
    mean_reward: float
    completions: list[str]
    correct: list[bool]
    rewards: list[float]
    seconds: float

    @property
    def num_examples(self) -> int:
        return len(self.correct)


@torch.no_grad()
def evaluate(model, tokenizer, task: Task, examples: Sequence[Example] | None = None, *,
             config: GenerateConfig | None = None, batch_size: int = 256, seed: int = 0,
             **settings) -> Evaluation:
    """Generate one completion per example (greedy by default) and score it with the task.

    Args:
        examples: default `task.test_examples()`.
        config, settings: the rollout settings, as `dllm_fast.generate` takes them (a GenerateConfig, keywords
            such as gen_length, block_length, steps, temperature, cache over it); temperature 0 unless set.
        batch_size: prompts per `generate` call.
        seed: seeds the sampling generator when temperature > 0 (greedy decoding draws nothing).
    """
    config = rollout_config(config, settings, "evaluate")
    check_int("batch_size", batch_size, minimum=1)
    examples = list(task.test_examples() if examples is None else examples)
    if not examples:
        raise ValueError(f"no examples to evaluate {task.name} on; pass a non-empty list (or None for the test split).")
    start = time.perf_counter()
    device = model.lm_head_weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    was_training = getattr(model, "training", False)
    try:  # eval() inside: an interrupt within it must not leave the model half in eval mode
        if was_training:
            model.eval()
        completions: list[str] = []
        for first in range(0, len(examples), batch_size):
            chunk = examples[first:first + batch_size]
            input_ids, attention_mask = encode_prompts(tokenizer, [task.prompt(e, tokenizer) for e in chunk],
                                                       device=device)
            result = generate(model, input_ids, attention_mask, config, generator=generator)
            completions += decode_completions(tokenizer, result)
    finally:
        if was_training:
            try:
                model.train()
            except BaseException:  # an interrupt landed in it: finish it, then let the interrupt go on
                model.train()
                raise
    correct = [bool(task.correct(e, c)) for e, c in zip(examples, completions)]
    rewards = [task_reward(task, e, c, f"example {i} ({e.question[:200]!r}), completion {c[:200]!r}")
               for i, (e, c) in enumerate(zip(examples, completions))]
    return Evaluation(accuracy=sum(correct) / len(correct), mean_reward=sum(rewards) / len(rewards),
                      completions=completions, correct=correct, rewards=rewards,
                      seconds=time.perf_counter() - start)
