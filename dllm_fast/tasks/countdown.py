"""countdown: reach a target with three given numbers and + - * /, each number used exactly once.

Generator: three numbers uniform in [min_number, max_number], combined left-deep or right-deep in a random order
with random operators, kept when the value is an integer in [1, max_target] (that expression is the
demonstration). Test problems are distinct and never appear in the training examples.

Reward (d1's `countdown_reward_func`, itself TinyZero's): the expression in the last ``<answer>...</answer>``;
no tags score 0; 0.1 (a well-formed attempt) when the numbers in it (every run of digits) are not exactly the
given ones, when it holds anything but digits, + - * / ( ) . and spaces, when it cannot be evaluated, or when
its value misses the target; 1.0 when ``|value - target| < 1e-5``. Accuracy: the full reward.

One deliberate difference: d1 evaluates with Python's `eval`, which the character whitelist lets compute
``**`` (and ``99**99**99`` never finishes). Here a small exact evaluator accepts only + - * / // and signs, so
``**`` scores 0.1 like any other invalid expression.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from fractions import Fraction

from dllm_fast.tasks.base import MAX_FAILED_DRAWS, MAX_GENERATED_EXAMPLES, Example, Task, register_task
from dllm_fast.tasks.formats import REASONING_FORMAT, last_answer_tag
from dllm_fast.validation import check_int

FORMAT_SCORE, FULL_SCORE = 0.1, 1.0
_ALLOWED_CHARACTERS = re.compile(r"^[\d+\-*/().\s]+$")
_OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate_expression(expression: str) -> Fraction | None:
    """The exact value of an arithmetic expression of numbers, + - * / //, signs and parentheses; None when it
    holds anything else, does not parse, or divides by zero."""
    if not _ALLOWED_CHARACTERS.match(expression):
        return None
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        return _value(tree.body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return Fraction(_BINARY[type(node.op)](_value(node.left), _value(node.right)))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    raise ValueError(f"{ast.dump(node)} is not allowed in a countdown expression")


def countdown_reward(numbers: list[int], target: int, completion: str) -> float:
    """d1's score: 0 (no answer tags), 0.1 (an attempt that fails) or 1.0 (the target, each number once)."""
    expression = last_answer_tag(completion)
    if expression is None:
        return 0.0
    used = sorted(int(n) for n in re.findall(r"\d+", expression))
    if used != sorted(numbers):
        return FORMAT_SCORE
    value = evaluate_expression(expression)
    if value is None or abs(value - target) >= 1e-5:
        return FORMAT_SCORE
    return FULL_SCORE


class Countdown(Task):
    """Options:
        split_seed: draws the test problems and seeds the training draws.
        num_train, num_test: problems per split.
        min_number, max_number: range of the three numbers; max_target: the largest target.
    """

    name = "countdown"

    def __init__(self, *, split_seed: int = 0, num_train: int = 20000, num_test: int = 256, min_number: int = 1,
                 max_number: int = 100, max_target: int = 100):
        self.split_seed = check_int("split_seed", split_seed)
        self.num_train = check_int("num_train", num_train, minimum=1, maximum=MAX_GENERATED_EXAMPLES)
        self.num_test = check_int("num_test", num_test, minimum=1, maximum=MAX_GENERATED_EXAMPLES)
        self.min_number = check_int("min_number", min_number, minimum=1)
        self.max_number = check_int("max_number", max_number, minimum=self.min_number)
        self.max_target = check_int("max_target", max_target, minimum=1)
        self._test = self._draw(random.Random(f"countdown-test-{split_seed}"), num_test, exclude=set())
        self._test_keys = {self._key(e) for e in self._test}

    def train_examples(self, seed: int = 0) -> list[Example]:
        check_int("seed", seed)
        rng = random.Random(f"countdown-train-{self.split_seed}-{seed}")
        return self._draw(rng, self.num_train, exclude=self._test_keys, distinct=False)

    def test_examples(self) -> list[Example]:
        return list(self._test)

    @staticmethod
    def _key(example: Example) -> tuple:
        return tuple(sorted(example.data["numbers"])), example.data["target"]

    def _draw(self, rng: random.Random, count: int, *, exclude: set, distinct: bool = True) -> list[Example]:
        examples: list[Example] = []
        seen = set(exclude)
        failed = 0
        while failed < MAX_FAILED_DRAWS:
            if len(examples) == count:
                return examples
            failed += 1
            numbers = [rng.randint(self.min_number, self.max_number) for _ in range(3)]
            expression, value = self._random_expression(numbers, rng)
            if value.denominator != 1 or not 1 <= value <= self.max_target:
                continue
            example = self._example(numbers, int(value), expression)
            key = self._key(example)
            if key in exclude or (distinct and key in seen):
                continue
            seen.add(key)
            examples.append(example)
            failed = 0
        raise ValueError(f"could not draw {count} {'distinct ' if distinct else ''}countdown problems with numbers "
                         f"in [{self.min_number}, {self.max_number}] and targets up to {self.max_target} (drew "
                         f"{len(examples)}, then {MAX_FAILED_DRAWS} draws in a row gave no new one); widen the ranges "
                         "or ask for fewer.")

    @staticmethod
    def _random_expression(numbers: list[int], rng: random.Random) -> tuple[str, Fraction]:
        a, b, c = rng.sample(numbers, 3)
        first, second = rng.choice("+-*/"), rng.choice("+-*/")
        try:
            if rng.random() < 0.5:  # (a op b) op c
                value = _OPERATORS[second](_OPERATORS[first](Fraction(a), b), c)
                return f"({a} {first} {b}) {second} {c}", value
            value = _OPERATORS[first](Fraction(a), _OPERATORS[second](Fraction(b), c))
            return f"{a} {first} ({b} {second} {c})", value
        except ZeroDivisionError:
            return "", Fraction(0)

    def _example(self, numbers: list[int], target: int, expression: str) -> Example:
        question = (
            f"{REASONING_FORMAT}\n"
            f"Using only the numbers {numbers}, write an arithmetic expression whose value is exactly {target}. Use "
            "every number in the list exactly once; the operations +, -, * and / are allowed. After reasoning, put "
            "only the final expression inside <answer></answer> tags, without an equals sign or the target. For "
            "example, for the numbers [2, 3, 4] and the target 5, a valid answer is <answer>\n2*4-3\n</answer>"
        )
        return Example(question=question, answer=str(target),
                       data={"numbers": numbers, "target": target, "expression": expression})

    def reward_components(self, example: Example, completion: str) -> dict[str, float]:
        return {"countdown": countdown_reward(example.data["numbers"], example.data["target"], completion)}

    def correct(self, example: Example, completion: str) -> bool:
        return countdown_reward(example.data["numbers"], example.data["target"], completion) == FULL_SCORE

    def demonstration(self, example: Example) -> str:
        expression = example.data["expression"]
        return (f"<reasoning>\n{expression} = {example.data['target']}\n</reasoning>\n"
                f"<answer>\n{expression}\n</answer>")


register_task(Countdown.name, Countdown)
