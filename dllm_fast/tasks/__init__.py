"""Verifiable tasks: prompts, rewards and accuracies (sudoku4, countdown, gsm8k, math; synthetic for throughput
runs; preference pairs for offline preference objectives: sudoku4_pairs, pairs_jsonl), none touching the network.

    task = get_task("sudoku4")
    examples = task.train_examples(seed=0)
    text = task.prompt(examples[0], tokenizer)          # the chat template when the tokenizer has one
    task.reward(examples[0], completion), task.correct(examples[0], completion)

The task modules are pure Python (no torch); `dllm_fast.tasks.encoding` (prompts to token ids, completions to
text) is the torch-facing part. A model's accuracy on a task, through `generate`: `dllm_fast.train.evaluate`.
"""

from dllm_fast.tasks.base import Example, Task, available_tasks, chat_prompt, get_task, register_task

# Importing a task module registers it (the package runs this before any of its modules is used).
from dllm_fast.tasks import countdown, gsm8k, math, sudoku4, synthetic  # noqa: E402, F401  isort: skip
from dllm_fast.tasks import preference  # noqa: E402, F401  isort: skip  (sudoku4_pairs, pairs_jsonl)

__all__ = ["Example", "Task", "available_tasks", "chat_prompt", "get_task", "register_task"]
