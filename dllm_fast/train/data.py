"""The prompts a run trains on: the task's training examples in a fresh seeded order each epoch."""

from __future__ import annotations

import random


class PromptStream:
    """The training examples in a fresh seeded order each epoch; `position` (examples taken so far) is all the
    state a resumed run needs."""

    def __init__(self, examples, seed: int):
        if not examples:
            raise ValueError("the task has no training examples.")
        self.examples, self.seed, self.position = list(examples), seed, 0
        self._epoch, self._order = -1, []

    def take(self, count: int):
        taken = []
        for _ in range(count):
            epoch, index = divmod(self.position, len(self.examples))
            if epoch != self._epoch:
                self._order = list(range(len(self.examples)))
                random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)
                self._epoch = epoch
            taken.append(self.examples[self._order[index]])
            self.position += 1
        return taken
