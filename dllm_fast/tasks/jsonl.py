"""Tasks read from local JSONL files (one JSON object per line), one file per split.

Every line is checked before it becomes an example, and a bad one is an error naming the file and the line: text
that is not UTF-8, a line longer than MAX_LINE_BYTES (refused before it is parsed or tokenised), invalid JSON, a
missing field, or a field that is null, not text, or empty.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from abc import abstractmethod
from pathlib import Path

from dllm_fast.tasks.base import Example, Task
from dllm_fast.validation import check_bool, check_int

# No benchmark problem comes near this (GSM8K and MATH lines are a few KB); a longer line is a broken file.
MAX_LINE_BYTES = 2**20


class JsonlTask(Task):
    """A task over `train_path` and `test_path` (either may be None when that split is not needed).

    Subclasses name the fields each line needs (`fields`, each non-empty text) and turn a record into an Example
    (`example`; a ValueError it raises is reported with the file and the line). Training examples come in the
    file's order shuffled by the seed; test examples in the file's order.
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
        with path.open("rb") as lines:
            number = 0
            while line := lines.readline(MAX_LINE_BYTES + 1):
                number += 1
                where = f"{path}:{number}"
                if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                    raise ValueError(f"{where} is longer than {MAX_LINE_BYTES} bytes; a {self.name} line holds one "
                                     "problem (a few KB). Check the file: it may not be JSONL.")
                examples += self._line_example(line, where)
        if not examples:
            raise ValueError(f"{path} holds no examples; it needs one JSON object per line.")
        return examples

    def _line_example(self, line: bytes, where: str) -> list[Example]:
        """The example of one line (none for a blank line), or a ValueError naming `where` (file:line)."""
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{where} is not UTF-8 text (byte {line[error.start]:#04x} at column {error.start + 1}); "
                             "save the file as UTF-8.") from None
        if not text.strip():
            return []
        try:
            record = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where} is not valid JSON ({error}).") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where} holds a JSON {type(record).__name__}, not an object; each {self.name} line "
                             f"needs {{{', '.join(map(repr, self.fields))}: ...}}.")
        for field in self.fields:
            if field not in record:
                raise ValueError(f"{where} lacks the field {field!r}; each {self.name} line needs "
                                 f"{', '.join(map(repr, self.fields))}.")
            check_text_field(record, field, where)
        try:
            return [dataclasses.replace(self.example(record), source=where)]
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None


def check_text_field(record: dict, field: str, where: str = "") -> str:
    """record[field] as non-empty text, or a ValueError naming the field (and `where`, e.g. file:line)."""
    value, prefix = record[field], f"{where}: " if where else ""
    if not isinstance(value, str):
        raise ValueError(f"{prefix}{field!r} is {json.dumps(value)[:80]}, not text; every {field!r} must be a "
                         "non-empty string.")
    if not value.strip():
        raise ValueError(f"{prefix}{field!r} is empty; every {field!r} must be a non-empty string.")
    return value
