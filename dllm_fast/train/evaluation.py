"""Greedy test accuracy during training, at every evaluation generation length, with the rollouts' schedule."""

from __future__ import annotations

from dataclasses import replace

from dllm_fast.contracts import block_length
from dllm_fast.rollout.config import GenerateConfig
from dllm_fast.tasks.evaluate import evaluate


def evaluate_lengths(run) -> dict:
    """A metrics row: `eval_accuracy@<length>` and `eval_reward@<length>` for each of --eval-gen-lengths."""
    c = run.config
    row = {"step": run.step}
    for length in c.eval_gen_lengths:
        with run.autocast():
            result = evaluate(run.core, run.tokenizer, run.task, run.test_examples,
                              config=eval_config(run.generate_config, c, length, run.core),
                              batch_size=c.eval_batch_size)
        row[f"eval_accuracy@{length}"] = result.accuracy
        row[f"eval_reward@{length}"] = result.mean_reward
    return row


def eval_config(rollouts: GenerateConfig, config, length: int, model) -> GenerateConfig:
    """The rollouts' settings for evaluating at `length` tokens: greedy, eval_schedule's block and steps, and
    eager (evaluation's batch and lengths are not the rollouts': each would compile graphs of its own)."""
    block, steps = eval_schedule(config, length)
    # A block-diffusion model takes a threshold with steps too (SDAR's dynamic rule).
    threshold = rollouts.threshold if steps is None or block_length(model) is not None else None
    return replace(rollouts, gen_length=length, block_length=block, steps=steps, threshold=threshold,
                   temperature=0.0, compile=False)


def eval_schedule(config, length: int) -> tuple[int, int | None]:
    """Block length and diffusion steps for evaluating at `length` tokens: the training block when it divides the
    length, and the training rollout's steps per token."""
    block = config.block_length if length % config.block_length == 0 else length
    if config.diffusion_steps is None:
        return block, None
    blocks = length // block
    per_block = max(1, round(config.diffusion_steps * length / config.gen_length / blocks))
    return block, blocks * per_block
