"""Greedy test accuracy during training, at every evaluation generation length, with the rollouts' schedule."""

from __future__ import annotations

from dllm_fast.contracts import block_length
from dllm_fast.tasks.evaluate import evaluate


def evaluate_lengths(run) -> dict:
    """A metrics row: `eval_accuracy@<length>` and `eval_reward@<length>` for each of --eval-gen-lengths."""
    c = run.config
    row = {"step": run.step}
    for length in c.eval_gen_lengths:
        block, steps = eval_schedule(c, length)
        # A block-diffusion model takes a threshold with steps too (SDAR's dynamic rule).
        threshold = c.threshold if steps is None or block_length(run.core) is not None else None
        with run.autocast():
            result = evaluate(run.core, run.tokenizer, run.task, run.test_examples, gen_length=length,
                              block_length=block, steps=steps, batch_size=c.eval_batch_size,
                              threshold=threshold, cache=c.cache)
        row[f"eval_accuracy@{length}"] = result.accuracy
        row[f"eval_reward@{length}"] = result.mean_reward
    return row


def eval_schedule(config, length: int) -> tuple[int, int | None]:
    """Block length and diffusion steps for evaluating at `length` tokens: the training block when it divides the
    length, and the training rollout's steps per token."""
    block = config.block_length if length % config.block_length == 0 else length
    if config.diffusion_steps is None:
        return block, None
    blocks = length // block
    per_block = max(1, round(config.diffusion_steps * length / config.gen_length / blocks))
    return block, blocks * per_block
