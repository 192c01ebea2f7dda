"""MDPO's step rewards in the trainer: every denoising step's one-step prediction x_hat (generate's step record)
decoded like a completion and rewarded by the task, K reward calls per rollout.

The calls are batched: all N x K predictions are decoded in one pass, and a prediction whose text repeats within
its prompt's group (x_hat changes only where a step's samples change it; late steps often repeat) is rewarded
once, so the task sees each distinct (prompt, text) once per step of training.
"""

from __future__ import annotations

import torch

from dllm_fast.contracts import completion_mask
from dllm_fast.tasks.rewards import task_reward


def decode_step_predictions(tokenizer, result, eos_token_id: int) -> list[list[str]]:
    """[N][K] texts of result.step_predictions [N, K, L], each up to and including its first EOS with special
    tokens skipped (as decode_completions decodes the final completions)."""
    predictions = result.step_predictions.cpu()
    lengths = completion_mask(predictions, eos_token_id).sum(-1).tolist()
    return [[tokenizer.decode(step[:n].tolist(), skip_special_tokens=True) for step, n in zip(row, row_lengths)]
            for row, row_lengths in zip(predictions, lengths)]


def step_rewards(task, examples, group_size: int, texts: list[list[str]], where: str,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """[N, K] float32 rewards of the decoded predictions `texts` ([N][K]); row n is a completion of examples[n // G].
    `where` places an error of the reward (e.g. "step 3")."""
    seen: dict[tuple[int, str], float] = {}
    rewards = []
    for row, steps in enumerate(texts):
        prompt = row // group_size
        values = []
        for step, text in enumerate(steps):
            key = (prompt, text)
            if key not in seen:
                seen[key] = task_reward(task, examples[prompt], text,
                                        f"prompt {prompt} of {where}, the prediction at denoising step {step} "
                                        f"({text[:200]!r})")
            values.append(seen[key])
        rewards.append(values)
    return torch.tensor(rewards, dtype=torch.float32, device=device)
