"""A model's accuracy on a task: `evaluate` (a task's examples at given generation settings, batched through
`dllm_fast.generate`), and during training greedy test accuracy at every evaluation generation length, with the
rollouts' schedule (`evaluate_lengths`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from dllm_fast.contracts import block_length
from dllm_fast.rollout import generate
from dllm_fast.rollout.config import GenerateConfig, rollout_config
from dllm_fast.tasks.base import Example, Task
from dllm_fast.tasks.encoding import decode_completions, encode_prompts
from dllm_fast.tasks.rewards import task_reward
from dllm_fast.validation import check_int


def evaluate_lengths(run) -> dict:
    """A metrics row: `eval_accuracy@<length>` and `eval_reward@<length>` for each of --eval-gen-lengths."""
    c = run.config
    row = {"step": run.step}
    for length in c.eval.gen_lengths:
        with run.autocast():
            result = evaluate(run.core, run.tokenizer, run.task, run.test_examples,
                              config=eval_config(run.generate_config, c, length, run.core),
                              batch_size=c.eval.batch_size, device=run.device)
        row[f"eval_accuracy@{length}"] = result.accuracy
        row[f"eval_reward@{length}"] = result.mean_reward
    return row


def eval_config(rollouts: GenerateConfig, config, length: int, model) -> GenerateConfig:
    """The rollouts' settings for evaluating at `length` tokens: greedy, eval_schedule's block and steps, and
    eager (evaluation's batch and lengths are not the rollouts': each would compile graphs of its own)."""
    block, steps = eval_schedule(config, length)
    if rollouts.unmask_schedule == "ass":  # its steps follow from the block (rollout.plan.ass_steps)
        steps = None
    # A block-diffusion model takes a threshold with steps too (SDAR's dynamic rule).
    threshold = rollouts.threshold if steps is None or block_length(model) is not None else None
    return replace(rollouts, gen_length=length, block_length=block, steps=steps, threshold=threshold,
                   temperature=0.0, compile=False)


def eval_schedule(config, length: int) -> tuple[int, int | None]:
    """Block length and diffusion steps for evaluating at `length` tokens: the training block when it divides the
    length, and the training rollout's steps per token."""
    block = config.rollout.block_length if length % config.rollout.block_length == 0 else length
    if config.rollout.steps is None:
        return block, None
    blocks = length // block
    per_block = max(1, round(config.rollout.steps * length / config.rollout.gen_length / blocks))
    return block, blocks * per_block


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
             device: torch.device | str | None = None, **settings) -> Evaluation:
    """Generate one completion per example (greedy by default) and score it with the task.

    Args:
        examples: default `task.test_examples()`.
        config, settings: the rollout settings, as `dllm_fast.generate` takes them (a GenerateConfig, keywords
            such as gen_length, block_length, steps, temperature, cache over it); temperature 0 unless set.
        batch_size: prompts per `generate` call.
        seed: seeds the sampling generator when temperature > 0 (greedy decoding draws nothing).
        device: where prompts go and sampling runs (default: the device of the model's LM head; FSDP2 with its
            shards offloaded to the host computes on the GPU).
    """
    config = rollout_config(config, settings, "evaluate")
    check_int("batch_size", batch_size, minimum=1)
    examples = list(task.test_examples() if examples is None else examples)
    if not examples:
        raise ValueError(f"no examples to evaluate {task.name} on; pass a non-empty list (or None for the test split).")
    start = time.perf_counter()
    if device is None:  # where the model computes: its head's device (a trainer under --fsdp-offload says it)
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
