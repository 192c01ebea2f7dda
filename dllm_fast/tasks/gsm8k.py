"""gsm8k: grade-school math word problems from a local JSONL file in openai/gsm8k's layout.

Each line: ``{"question": ..., "answer": "<worked solution>\\n#### 72"}``; the reference answer is the text after
``####`` (the whole answer when it has none). The prompt is d1's: the reasoning/answer format, a blank line,
the question.

Reward (d1's five functions, summed; at most 4.0): xml count (0-0.5), soft format (0.5), strict format (0.5),
integer answer (0.5), correctness (2.0). The answer is d1's: the text after the last ``<answer>`` up to
``</answer>``, stripped (the whole completion when there are no tags). Accuracy: the correctness term.

By default the known pitfalls are fixed (`dllm_fast.tasks.formats` describes the format ones); also, the
integer and correctness terms compare numbers, not strings: commas, a leading ``$`` and a trailing ``.`` are
dropped and ``72.0`` equals ``72`` (d1's ``str.isdigit`` rejects ``-3`` and ``1,000`` and accepts ``²``; its
exact string match rejects ``$72``). ``legacy_d1_regex=True`` reproduces the released functions exactly.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from dllm_fast.tasks.base import Example, register_task
from dllm_fast.tasks.formats import (REASONING_FORMAT, soft_format_reward, split_answer, strict_format_reward,
                                     xml_count_reward)
from dllm_fast.tasks.jsonl import JsonlTask

_NUMBER = re.compile(r"-?(\d+(\.\d*)?|\.\d+)")


def gold_answer(solution: str) -> str:
    """The reference answer of a GSM8K solution: the text after "####", stripped."""
    return solution.split("####")[1].strip() if "####" in solution else solution.strip()


def canonical_number(text: str) -> str | None:
    """"$1,000." -> "1000", "72.50" -> "72.5", "-3" -> "-3"; None when the text is not a plain number."""
    text = text.strip().replace(",", "").removeprefix("$").removesuffix(".").strip()
    if not _NUMBER.fullmatch(text):
        return None
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    canonical = format(value.normalize(), "f")
    return "0" if canonical in ("-0", "") else canonical


def integer_reward(answer: str, *, legacy: bool = False) -> float:
    """0.5 when the extracted answer is an integer."""
    if legacy:
        return 0.5 if answer.isdigit() else 0.0
    number = canonical_number(answer)
    return 0.5 if number is not None and "." not in number else 0.0


def answers_match(answer: str, gold: str, *, legacy: bool = False) -> bool:
    if legacy:
        return answer == gold
    number, gold_number = canonical_number(answer), canonical_number(gold)
    if number is not None and gold_number is not None:
        return number == gold_number
    return answer.strip() == gold.strip()


class GSM8K(JsonlTask):
    """Options: train_path, test_path (local JSONL files), legacy_d1_regex (see the module docstring)."""

    name = "gsm8k"
    fields = ("question", "answer")

    def example(self, record: dict) -> Example:
        solution = record["answer"]
        gold = gold_answer(solution)
        if not gold:
            raise ValueError(f"'answer' has nothing after '####' ({solution[-80:]!r}); the reference answer follows "
                             "'####', e.g. \"... so she has 72 left.\\n#### 72\".")
        return Example(question=f"{REASONING_FORMAT}\n\n{record['question']}", answer=gold,
                       data={"solution": solution})

    def reward_components(self, example: Example, completion: str) -> dict[str, float]:
        legacy = self.legacy_d1_regex
        answer = split_answer(completion)
        return {
            "xml_count": xml_count_reward(completion, legacy=legacy),
            "soft_format": soft_format_reward(completion, legacy=legacy),
            "strict_format": strict_format_reward(completion, legacy=legacy),
            "integer": integer_reward(answer, legacy=legacy),
            "correctness": 2.0 if answers_match(answer, example.answer, legacy=legacy) else 0.0,
        }

    def correct(self, example: Example, completion: str) -> bool:
        return answers_match(split_answer(completion), example.answer, legacy=self.legacy_d1_regex)

    def demonstration(self, example: Example) -> str:
        reasoning = example.data["solution"].split("####")[0].strip()
        return f"<reasoning>\n{reasoning}\n</reasoning>\n<answer>\n{example.answer}\n</answer>\n"


register_task(GSM8K.name, GSM8K)
