"""sudoku4: 4x4 Sudoku puzzles with a unique solution, generated from all 288 valid grids.

The train/test split is by solution grid: a test puzzle's solution never appears in training, so test accuracy
measures solving, not recall of the 288 grids. A puzzle blanks `blanks` cells of its grid (uniform in
[min_blanks, max_blanks]) chosen uniformly among the blank sets that leave exactly one solution.

Reward (d1's `sudoku_reward_func`): the digits inside the last ``<answer>...</answer>``, padded with 0 or cut to
16, score the fraction of the puzzle's blank cells that match the solution; no answer tags score 0. Accuracy: the
16 digits are the solution.

Prompt styles: ``"d1"`` (d1's wording: instructions, the puzzle as a 16-character string, the reasoning/answer
format) and ``"grid"`` (the puzzle as four rows of digits and the answer in the same layout inside answer tags:
``<answer>1234\\n3412\\n2143\\n4321</answer>``; what the embedded default model is trained on).
"""

from __future__ import annotations

import itertools
import random
from functools import lru_cache

from dllm_fast.tasks.base import MAX_FAILED_DRAWS, MAX_GENERATED_EXAMPLES, Example, Task, register_task
from dllm_fast.tasks.formats import REASONING_FORMAT, last_answer_tag
from dllm_fast.validation import check_choice, check_int, check_probability

CELLS = 16
PROMPT_STYLES = ("d1", "grid")

D1_INSTRUCTIONS = (
    "Please solve the following 4x4 Sudoku puzzle. The puzzle is a 16-character string read left to right, top to "
    "bottom, where 0 marks an empty cell. Each row, each column and each of the four 2x2 boxes must contain the "
    "digits 1 to 4 exactly once. Answer with the complete solution as a 16-digit string."
)


@lru_cache(maxsize=1)
def all_grids() -> tuple[str, ...]:
    """The 288 valid 4x4 Sudoku grids as 16-digit strings (row by row), in lexicographic order."""
    rows = ["".join(p) for p in itertools.permutations("1234")]
    grids: list[str] = []

    def extend(grid: list[str]) -> None:
        if len(grid) == 4:
            grids.append("".join(grid))
            return
        for row in rows:
            if all(row[c] != above[c] for above in grid for c in range(4)) and (
                    len(grid) % 2 == 0 or all({row[c], row[c + 1]}.isdisjoint(grid[-1][c:c + 2]) for c in (0, 2))):
                extend(grid + [row])

    extend([])
    return tuple(grids)


@lru_cache(maxsize=1)
def _grids_with_digit() -> tuple[tuple[int, ...], ...]:
    """[cell][digit] -> a bitset (Python int) over all_grids() of the grids holding that digit in that cell."""
    table = [[0] * 5 for _ in range(CELLS)]
    for index, grid in enumerate(all_grids()):
        for cell, digit in enumerate(grid):
            table[cell][int(digit)] |= 1 << index
    return tuple(tuple(row) for row in table)


def count_solutions(puzzle: str) -> int:
    """How many valid grids agree with the puzzle's given cells (0 = blank)."""
    table = _grids_with_digit()
    candidates = (1 << len(all_grids())) - 1
    for cell, digit in enumerate(puzzle):
        if digit != "0":
            candidates &= table[cell][int(digit)]
    return candidates.bit_count()


def make_puzzle(solution: str, blanks: int, rng: random.Random, max_tries: int = 1000) -> str | None:
    """`solution` with `blanks` cells set to 0, drawn uniformly among the blank sets with a unique solution
    (rejection sampling); None when `max_tries` draws all had several solutions."""
    for _ in range(max_tries):
        cells = set(rng.sample(range(CELLS), blanks))
        puzzle = "".join("0" if i in cells else d for i, d in enumerate(solution))
        if count_solutions(puzzle) == 1:
            return puzzle
    return None


def sudoku_reward(puzzle: str, solution: str, completion: str) -> float:
    """d1's reward: the fraction of the puzzle's blank cells that the answer fills correctly."""
    digits = _answer_digits(completion)
    if not digits:
        return 0.0
    digits = digits[:CELLS].ljust(CELLS, "0")
    blank = [i for i, d in enumerate(puzzle) if d == "0"]
    if not blank:
        return 0.0
    return sum(digits[i] == solution[i] for i in blank) / len(blank)


def _answer_digits(completion: str) -> str:
    answer = last_answer_tag(completion)
    return "" if answer is None else "".join(c for c in answer if c.isdigit())


def as_rows(grid: str) -> str:
    return "\n".join(grid[r * 4:(r + 1) * 4] for r in range(4))


def row_by_row_fill(puzzle: str) -> str:
    """The careless solver: each row's missing digits written into its blanks in increasing order, columns and
    boxes ignored. Right on rows with one blank, often wrong elsewhere (it solves about 15% of puzzles)."""
    rows = []
    for r in range(4):
        row = puzzle[r * 4:(r + 1) * 4]
        missing = iter(sorted(set("1234") - set(row)))
        rows.append("".join(next(missing) if cell == "0" else cell for cell in row))
    return "".join(rows)


class Sudoku4(Task):
    """Options:
        prompt_style: "d1" or "grid" (see the module docstring).
        test_fraction: share of the 288 solution grids held out for the test split.
        split_seed: which grids are held out, and which test puzzles are drawn.
        num_train, num_test: puzzles per split (test puzzles are distinct).
        min_blanks, max_blanks: blank cells per puzzle (a unique 4x4 puzzle has at most 12 blanks).
    """

    name = "sudoku4"

    def __init__(self, *, prompt_style: str = "d1", test_fraction: float = 0.25, split_seed: int = 0,
                 num_train: int = 20000, num_test: int = 256, min_blanks: int = 4, max_blanks: int = 10):
        self.prompt_style = check_choice("prompt_style", prompt_style, PROMPT_STYLES)
        check_probability("test_fraction", test_fraction)
        self.split_seed = check_int("split_seed", split_seed)
        self.num_train = check_int("num_train", num_train, minimum=1, maximum=MAX_GENERATED_EXAMPLES)
        self.num_test = check_int("num_test", num_test, minimum=1, maximum=MAX_GENERATED_EXAMPLES)
        self.min_blanks = check_int("min_blanks", min_blanks, minimum=1, maximum=12)
        self.max_blanks = check_int("max_blanks", max_blanks, minimum=self.min_blanks, maximum=12,
                                    hint=f"at least min_blanks={self.min_blanks}; 12 is the most a unique 4x4 "
                                         "puzzle can have")
        grids = list(all_grids())
        random.Random(f"sudoku4-split-{split_seed}").shuffle(grids)
        held_out = round(test_fraction * len(grids))
        if not 0 < held_out < len(grids):
            raise ValueError(f"test_fraction={test_fraction} holds out {held_out} of {len(grids)} grids; choose a "
                             "fraction that leaves grids in both splits, e.g. 0.25.")
        self.test_solutions = tuple(sorted(grids[:held_out]))
        self.train_solutions = tuple(sorted(grids[held_out:]))

    def train_examples(self, seed: int = 0) -> list[Example]:
        check_int("seed", seed)
        rng = random.Random(f"sudoku4-train-{self.split_seed}-{seed}")
        return [self._example(*self._draw(rng, self.train_solutions)) for _ in range(self.num_train)]

    def test_examples(self) -> list[Example]:
        rng = random.Random(f"sudoku4-test-{self.split_seed}")
        seen: dict[str, str] = {}
        failed = 0
        while len(seen) < self.num_test:
            puzzle, solution = self._draw(rng, self.test_solutions)
            failed = failed + 1 if puzzle in seen else 0
            seen.setdefault(puzzle, solution)
            if failed >= MAX_FAILED_DRAWS:
                raise ValueError(f"num_test={self.num_test} distinct test puzzles could not be drawn from "
                                 f"{len(self.test_solutions)} grids with {self.min_blanks}-{self.max_blanks} blanks "
                                 f"(drew {len(seen)}, then {MAX_FAILED_DRAWS} draws in a row repeated one); ask for "
                                 "fewer, or widen the blank range or test_fraction.")
        return [self._example(puzzle, solution) for puzzle, solution in seen.items()]

    def _draw(self, rng: random.Random, solutions: tuple[str, ...]) -> tuple[str, str]:
        while True:
            solution = rng.choice(solutions)
            puzzle = make_puzzle(solution, rng.randint(self.min_blanks, self.max_blanks), rng, max_tries=50)
            if puzzle is not None:
                return puzzle, solution

    def _example(self, puzzle: str, solution: str) -> Example:
        if self.prompt_style == "grid":
            question = as_rows(puzzle)
        else:
            question = f"{REASONING_FORMAT}\n\n{D1_INSTRUCTIONS}\n\nSolve the following Sudoku puzzle: {puzzle}\n"
        return Example(question=question, answer=solution, data={"puzzle": puzzle, "solution": solution})

    def reward_components(self, example: Example, completion: str) -> dict[str, float]:
        return {"cells": sudoku_reward(example.data["puzzle"], example.data["solution"], completion)}

    def correct(self, example: Example, completion: str) -> bool:
        return _answer_digits(completion) == example.data["solution"]

    def demonstration(self, example: Example) -> str | None:
        """The solution in the "grid" answer layout (None for "d1", which asks for a reasoning the task lacks)."""
        if self.prompt_style != "grid":
            return None
        return f"<answer>{as_rows(example.data['solution'])}</answer>"


register_task(Sudoku4.name, Sudoku4)
