"""synthetic: random prompts and a cheap deterministic reward that differs between completions, for throughput
runs: the trainer's whole step at a real model's shapes (random weights included), where no real task's reward
would ever be earned and every group would have zero advantage (and the step no gradient work).

Examples: `prompt_length` characters of lowercase letters and digits from a seeded `random.Random` (one token each
under the embedded character tokenizer, plus the chat template's tokens). Reward: the completion text hashed to
[0, 1) (the first 8 bytes of its SHA-256 over 2^64; Python's own hash() changes between processes). It is
deterministic and costs microseconds, and almost any two different completions get different rewards, so a group
of sampled completions (temperature > 0) has a spread of rewards and every (sequence, sample) pair of the
objective carries a gradient weight, the most work per step (what the planner assumes). Accuracy: a reward of at
least 0.5. Nothing is learnable: a run on it measures speed and memory, not learning.

    python -m dllm_fast train --task synthetic --task-options '{"prompt_length": 200}' --model llada-8b ...
"""

from __future__ import annotations

import hashlib
import random
import string

from dllm_fast.tasks.base import MAX_GENERATED_EXAMPLES, Example, Task, register_task
from dllm_fast.validation import check_int

ALPHABET = string.ascii_lowercase + string.digits
MAX_PROMPT_LENGTH = 1 << 16


def synthetic_reward(completion: str) -> float:
    """The completion's SHA-256, its first 8 bytes as a fraction of 2^64: a deterministic value in [0, 1)."""
    digest = hashlib.sha256(completion.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


class Synthetic(Task):
    """Options:
        prompt_length: characters of random text per prompt.
        num_train, num_test: prompts per split (the test prompts are drawn apart from the training ones).
    """

    name = "synthetic"

    def __init__(self, *, prompt_length: int = 200, num_train: int = 1024, num_test: int = 8):
        self.prompt_length = check_int("prompt_length", prompt_length, minimum=1, maximum=MAX_PROMPT_LENGTH)
        self.num_train = check_int("num_train", num_train, minimum=1, maximum=MAX_GENERATED_EXAMPLES)
        self.num_test = check_int("num_test", num_test, minimum=1, maximum=MAX_GENERATED_EXAMPLES)

    def train_examples(self, seed: int = 0) -> list[Example]:
        check_int("seed", seed)
        rng = random.Random(f"synthetic-train-{seed}")
        return [self._example(rng) for _ in range(self.num_train)]

    def test_examples(self) -> list[Example]:
        rng = random.Random("synthetic-test")
        return [self._example(rng) for _ in range(self.num_test)]

    def _example(self, rng: random.Random) -> Example:
        return Example(question="".join(rng.choices(ALPHABET, k=self.prompt_length)), answer="")

    def reward_components(self, example: Example, completion: str) -> dict[str, float]:
        return {"hash": synthetic_reward(completion)}

    def correct(self, example: Example, completion: str) -> bool:
        return synthetic_reward(completion) >= 0.5


register_task(Synthetic.name, Synthetic)
