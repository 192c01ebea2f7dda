"""math: competition problems (MATH, MATH-500) from a local JSONL file.

Each line: ``{"problem": ..., "solution": ...}`` with the final answer in the solution's last ``\\boxed{}``, or an
explicit ``"answer"`` field (MATH-500's layout), which is preferred.

Reward (d1's two MATH functions, summed; at most 3.0):

- correctness (2.0): the content of the completion's last ``\\boxed{...}`` (or ``\\fbox``; the whole completion
  when there is none, as in d1) equals the reference after the MATH normalisation (`normalize_answer`);
- boxed and answer tags (0.25-1.0): half of (1 if the completion has ``<answer>`` + 1 if the text inside the first
  answer tags (the whole completion without them) contains ``\\boxed``, else 0.5).

Pitfall: d1's code tests ``"\\boxed" in text`` with a single backslash, i.e. a backspace followed by "oxed",
which no completion contains, so its format term only takes the values 0.25 and 0.75. Fixed by default;
``legacy_d1_regex=True`` keeps it. Accuracy: the correctness term.
"""

from __future__ import annotations

import re

from dllm_fast.tasks.base import Example, register_task
from dllm_fast.tasks.jsonl import JsonlTask, check_text_field

MATH_FORMAT = "Respond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n\\boxed{...}\n</answer>"
MATH_INSTRUCTIONS = ("You are a math expert. Solve the following problem step by step, and write the final answer "
                     "inside \\boxed{}.")
_LEGACY_BOXED = "\boxed"  # noqa: W605  d1's literal: "\b" is a backspace


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed x`` up to a ``$``), braces
    matched; None when there is none or it is not closed."""
    if "\\boxed " in text:
        return text.split("\\boxed ")[-1].split("$")[0].strip()
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
    if start < 0:
        return None
    opening = text.find("{", start)
    if opening < 0:
        return None
    depth = 0
    for index in range(opening, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[opening + 1:index]
    return None


def normalize_answer(answer: str) -> str:
    """The MATH benchmark's answer normalisation (Hendrycks et al.): strip spacing, \\left/\\right, degrees,
    dollars, units and percent signs; write \\tfrac/\\dfrac as \\frac; brace \\frac12 and \\sqrt3; 0.5 and a/b as
    fractions; drop a short "x =" prefix."""
    text = answer.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    text = text.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    if "\\text{ " in text:  # a unit written after the value
        text = text.split("\\text{ ")[0]
    text = text.replace("\\%", "").replace("%", "")
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text.startswith("."):
        text = "0" + text
    parts = text.split("=")
    if len(parts) == 2 and len(parts[0]) <= 2:
        text = parts[1]
    text = text.replace(" ", "")
    text = re.sub(r"\\sqrt([^{\\])", r"\\sqrt{\1}", text)
    text = _brace_fractions(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    match = re.fullmatch(r"(-?\d+)/(\d+)", text)
    if match:
        text = f"\\frac{{{match.group(1)}}}{{{match.group(2)}}}"
    return text


def _brace_fractions(text: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{72} -> \\frac{1}{72}, \\fracab -> \\frac{a}{b}."""
    pieces = text.split("\\frac")
    out = pieces[0]
    for piece in pieces[1:]:
        out += "\\frac"
        if piece.startswith("{") or len(piece) < 2:
            out += piece
        elif piece[1] == "{":
            out += "{" + piece[0] + "}" + piece[1:]
        else:
            out += "{" + piece[0] + "}{" + piece[1] + "}" + piece[2:]
    return out


def answers_equivalent(answer: str, reference: str) -> bool:
    return normalize_answer(answer) == normalize_answer(reference)


def boxed_and_tags_reward(completion: str, *, legacy: bool = False) -> float:
    """d1's boxed_and_answer_tags_format_reward: 0.5 * (1[has <answer>] + (1 if boxed inside it else 0.5))."""
    score = 0.0
    inside = completion
    if "<answer>" in completion:
        inside = completion.split("<answer>")[1].split("</answer>")[0]
        score += 1.0
    score += 1.0 if (_LEGACY_BOXED if legacy else "\\boxed") in inside else 0.5
    return 0.5 * score


class Math(JsonlTask):
    """Options: train_path, test_path (local JSONL files), legacy_d1_regex (see the module docstring)."""

    name = "math"
    fields = ("problem",)

    def example(self, record: dict) -> Example:
        if "answer" in record:
            answer = record["answer"]
            integer = isinstance(answer, int) and not isinstance(answer, bool)
            reference = str(answer) if integer else check_text_field(record, "answer").strip()
        elif "solution" in record and last_boxed(check_text_field(record, "solution")):
            reference = last_boxed(record["solution"])
        else:
            raise ValueError(f"a math record needs an 'answer' field or a 'solution' with a \\boxed{{}} "
                             f"answer; got the fields {sorted(record)} (problem {record['problem'][:60]!r}).")
        solution = record.get("solution")
        question = f"{MATH_FORMAT}\n\n{MATH_INSTRUCTIONS}\n\n{record['problem']}"
        return Example(question=question, answer=reference,
                       data={"solution": solution if isinstance(solution, str) else ""})

    def _extracted(self, completion: str) -> str:
        boxed = last_boxed(completion)
        return completion if boxed is None else boxed

    def reward_components(self, example: Example, completion: str) -> dict[str, float]:
        return {
            "correctness": 2.0 if self.correct(example, completion) else 0.0,
            "boxed_and_answer_tags": boxed_and_tags_reward(completion, legacy=self.legacy_d1_regex),
        }

    def correct(self, example: Example, completion: str) -> bool:
        return answers_equivalent(self._extracted(completion), example.answer)

    def demonstration(self, example: Example) -> str | None:
        solution = example.data["solution"]
        if not solution:
            return None
        return (f"<reasoning>\n{solution.strip()}\n</reasoning>\n<answer>\n\\boxed{{{example.answer}}}\n"
                "</answer>\n")


register_task(Math.name, Math)
