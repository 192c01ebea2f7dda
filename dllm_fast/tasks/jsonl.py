"""Tasks read from local JSONL files (one JSON object per line), one file per split."""

from __future__ import annotations

import json
import os
import random
from abc import abstractmethod
from pathlib import Path

from dllm_fast.tasks.base import Example, Task
from dllm_fast.validation import check_bool, check_int


class JsonlTask(Task):
    """A task over `train_path` and `test_path` (either may be None when that split is not needed).

    Subclasses name the fields each line needs (`fields`) and turn a record into an Example (`example`).
    Training examples come in the file's order shuffled by the seed; test examples in the file's order.
    """

    fields: tuple[str, ...] = ()

    def __init__(self, *, train_path: str | os.PathLike | None = None, test_path: str | os.PathLike | None = None,
                 legacy_d1_regex: bool = False):
        self.train_path = None if train_path is None else Path(train_path)
        self.test_path = None if test_path is None else Path(test_path)
        for name, path in (("train_path", self.train_path), ("test_path", self.test_path)):
            if path is not None and not path.is_file():
                raise FileNotFoundError(f"{name}={str(path)!r} is not a file; pass the path of a local JSONL file "
                                        f"(one {{{', '.join(map(repr, self.fields))}: ...}} object per line).")
        if self.train_path is None and self.test_path is None:
            raise ValueError(f"{self.name} reads local JSONL files and got neither train_path nor test_path; pass "
                             "at least one.")
        self.legacy_d1_regex = check_bool("legacy_d1_regex", legacy_d1_regex)

    @abstractmethod
    def example(self, record: dict) -> Example: ...

    def train_examples(self, seed: int = 0) -> list[Example]:
        check_int("seed", seed)
        examples = self._read("train_path", self.train_path)
        random.Random(f"{self.name}-train-{seed}").shuffle(examples)
        return examples

    def test_examples(self) -> list[Example]:
        return self._read("test_path", self.test_path)

    def _read(self, name: str, path: Path | None) -> list[Example]:
        if path is None:
            raise ValueError(f"{self.name} was built without {name}; pass {name}= to get_task to use this split.")
        examples = []
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{number} is not valid JSON ({error}).") from None
                missing = [f for f in self.fields if not isinstance(record, dict) or f not in record]
                if missing:
                    raise ValueError(f"{path}:{number} lacks the field {missing[0]!r}; each {self.name} line needs "
                                     f"{', '.join(map(repr, self.fields))}.")
                examples.append(self.example(record))
        if not examples:
            raise ValueError(f"{path} holds no examples; it needs one JSON object per line.")
        return examples
