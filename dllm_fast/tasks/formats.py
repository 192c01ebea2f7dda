"""d1's answer format and its format rewards, shared by the tasks.

d1 (and SPG, wd1) ask for ``<reasoning>\\n...\\n</reasoning>\\n<answer>\\n...\\n</answer>`` and score the format
with three functions from Will Brown's GRPO demo. Their released code has known regex pitfalls; each function here
fixes them by default, and ``legacy=True`` reproduces the released behaviour exactly:

- soft/strict format: the May-2025 d1 snapshot (and SPG) match without ``re.DOTALL``. The soft pattern's ``.*?``
  then cannot cross the newline the requested format puts after ``<reasoning>``, so it only matches one-line
  completions; the strict pattern fails whenever the reasoning or the answer spans lines. Fixed: DOTALL (what
  d1's later reward_func.py does).
- xml count: the ``\\n<answer>\\n`` clause subtracts 0.001 per character after ``\\n</answer>\\n``, and when that
  string is absent (an answer that ends at ``</answer>``), per character of the *whole* completion; the
  ``\\n</answer>`` clause subtracts one character fewer than follow the tag, so ending exactly at the tag earns
  +0.001. Fixed: one penalty of 0.001 per non-whitespace character after the final ``\\n</answer>``.
"""

from __future__ import annotations

import re

REASONING_FORMAT = ("Respond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>")

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_SOFT_FORMAT = r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>"
_STRICT_FORMAT = r"^<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n$"


def last_answer_tag(completion: str) -> str | None:
    """The stripped content of the last complete ``<answer>...</answer>``, or None (d1's countdown and sudoku
    extraction)."""
    matches = _ANSWER_TAG.findall(completion)
    return matches[-1].strip() if matches else None


def split_answer(completion: str) -> str:
    """d1's ``extract_xml_answer`` (GSM8K): the text after the last ``<answer>`` up to the next ``</answer>``,
    stripped. Without tags it is the whole completion, as in d1."""
    return completion.split("<answer>")[-1].split("</answer>")[0].strip()


def soft_format_reward(completion: str, *, legacy: bool = False) -> float:
    """0.5 when the completion starts with a reasoning block followed by an answer block."""
    return 0.5 if re.match(_SOFT_FORMAT, completion, flags=0 if legacy else re.DOTALL) else 0.0


def strict_format_reward(completion: str, *, legacy: bool = False) -> float:
    """0.5 when the completion is exactly the format, newlines included."""
    return 0.5 if re.match(_STRICT_FORMAT, completion, flags=0 if legacy else re.DOTALL) else 0.0


def xml_count_reward(completion: str, *, legacy: bool = False) -> float:
    """0.125 for each of the four tags (with their newlines) that appears exactly once, less 0.001 per character
    after the answer (see the module docstring for the released version's two quirks)."""
    count = 0.0
    if completion.count("<reasoning>\n") == 1:
        count += 0.125
    if completion.count("\n</reasoning>\n") == 1:
        count += 0.125
    if completion.count("\n<answer>\n") == 1:
        count += 0.125
        if legacy:
            count -= len(completion.split("\n</answer>\n")[-1]) * 0.001
    if completion.count("\n</answer>") == 1:
        count += 0.125
        trailing = completion.split("\n</answer>")[-1]
        count -= (len(trailing) - 1 if legacy else len(trailing.strip())) * 0.001
    return count
