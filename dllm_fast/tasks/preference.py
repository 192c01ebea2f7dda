"""Preference tasks: training examples that are (prompt, chosen completion, rejected completion) pairs, for offline
preference objectives (vrpo_dpo), and test examples evaluated as any task's (a completion, its reward, correct).

- ``sudoku4_pairs``: sudoku4's puzzles (the "grid" prompts the embedded models were trained on), each with its
  solution as the chosen completion and a wrong one as the rejected: the careless row-by-row fill the embedded
  models half learnt (`sudoku4.row_by_row_fill`) where it is wrong, else the solution with two blank cells of
  different digits swapped. Test split, reward and accuracy: sudoku4's.
- ``pairs_jsonl``: pairs read from local JSONL files, one object a line:

      {"prompt": "the user turn", "chosen": "the preferred answer", "rejected": "the other answer"}

  prompt: the user turn (the tokenizer's chat template wraps it, as every task's question); chosen and rejected:
  the assistant's completions as text (the trainer appends the end-of-turn token and pads with EOS to
  --gen-length, so each must take fewer tokens than that). Test lines have the same fields; a test completion is
  correct, and earns reward 1, when it equals the chosen text (both stripped); 0 otherwise.

A preference task's example carries its pair in `data["chosen"]` and `data["rejected"]` (`pair(example)`).
"""

from __future__ import annotations

import random

from dllm_fast.tasks.base import Example, Task, register_task
from dllm_fast.tasks.jsonl import JsonlTask
from dllm_fast.tasks.sudoku4 import CELLS, Sudoku4, as_rows, row_by_row_fill


class PreferenceTask(Task):
    """A task whose training examples are preference pairs: `pair(example)` -> (chosen, rejected) completion texts."""

    def pair(self, example: Example) -> tuple[str, str]:
        data = example.data
        if "chosen" not in data or "rejected" not in data:
            raise ValueError(f"task {self.name!r}'s example {example.source or repr(example.question[:80])} holds no "
                             "preference pair (data['chosen'] and data['rejected']).")
        return data["chosen"], data["rejected"]


class Sudoku4Pairs(PreferenceTask, Sudoku4):
    """sudoku4's options (prompt_style "grid" by default: the pairs' answers are grids), its test split, reward and
    accuracy; each training puzzle paired with its solution (chosen) and a wrong grid (rejected)."""

    name = "sudoku4_pairs"

    def __init__(self, *, prompt_style: str = "grid", **options):
        if prompt_style != "grid":
            raise ValueError(f"prompt_style={prompt_style!r}: sudoku4_pairs' completions are grids in answer tags, "
                             "which only the 'grid' prompts ask for; leave prompt_style at 'grid'.")
        super().__init__(prompt_style=prompt_style, **options)

    def train_examples(self, seed: int = 0) -> list[Example]:
        rng = random.Random(f"sudoku4_pairs-{self.split_seed}-{seed}")
        examples = []
        for example in super().train_examples(seed):
            puzzle, solution = example.data["puzzle"], example.data["solution"]
            data = {**example.data, "chosen": self.demonstration(example),
                    "rejected": f"<answer>{as_rows(wrong_grid(puzzle, solution, rng))}</answer>"}
            examples.append(Example(example.question, example.answer, data, example.source))
        return examples


def wrong_grid(puzzle: str, solution: str, rng: random.Random) -> str:
    """A grid that fills the puzzle's givens but is not its solution: the careless fill where it is wrong, else the
    solution with two blank cells holding different digits swapped, else (every blank holds the same digit) one
    blank cell given another digit."""
    careless = row_by_row_fill(puzzle)
    if careless != solution:
        return careless
    blanks = [i for i in range(CELLS) if puzzle[i] == "0"]
    cells = list(solution)
    swaps = [(a, b) for a in blanks for b in blanks if a < b and solution[a] != solution[b]]
    if swaps:
        a, b = rng.choice(swaps)
        cells[a], cells[b] = cells[b], cells[a]
    else:
        a = rng.choice(blanks)
        cells[a] = rng.choice(sorted(set("1234") - {solution[a]}))
    return "".join(cells)


class PairsJsonl(PreferenceTask, JsonlTask):
    """Preference pairs from local JSONL files (module docstring); options train_path and test_path."""

    name = "pairs_jsonl"
    fields = ("prompt", "chosen", "rejected")

    def __init__(self, *, train_path=None, test_path=None):
        super().__init__(train_path=train_path, test_path=test_path)

    def example(self, record: dict) -> Example:
        return Example(question=record["prompt"], answer=record["chosen"],
                       data={"chosen": record["chosen"], "rejected": record["rejected"]})

    def reward_components(self, example: Example, completion: str) -> dict[str, float]:
        return {"matches_chosen": float(self.correct(example, completion))}

    def correct(self, example: Example, completion: str) -> bool:
        return completion.strip() == example.data["chosen"].strip()


register_task(Sudoku4Pairs.name, Sudoku4Pairs)
register_task(PairsJsonl.name, PairsJsonl)
