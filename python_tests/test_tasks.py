"""Verifiable tasks: generators, splits, prompts, and the rewards and accuracies on exact strings (every d1 quirk
that the legacy option keeps and the default fixes)."""

import time
from pathlib import Path

import pytest

from dllm_fast.tasks import Example, available_tasks, chat_prompt, get_task
from dllm_fast.tasks.countdown import countdown_reward, evaluate_expression
from dllm_fast.tasks.formats import (REASONING_FORMAT, last_answer_tag, soft_format_reward, split_answer,
                                     strict_format_reward, xml_count_reward)
from dllm_fast.tasks.math import boxed_and_tags_reward, last_boxed, normalize_answer
from dllm_fast.tasks.sudoku4 import all_grids, count_solutions, sudoku_reward

DATA = Path(__file__).parent / "data"
GSM8K_FILE, MATH_FILE = DATA / "gsm8k_sample.jsonl", DATA / "math_sample.jsonl"


def test_registry_lists_and_builds_the_tasks():
    assert available_tasks() == ["countdown", "gsm8k", "math", "pairs_jsonl", "sudoku4", "sudoku4_pairs", "synthetic"]
    assert get_task("sudoku4").name == "sudoku4"
    with pytest.raises(ValueError, match="unknown task 'sudoku'.*sudoku4"):
        get_task("sudoku")


# ---------------------------------------------------------------------------------------------------------
# synthetic


def test_synthetic_prompts_are_seeded_and_its_reward_deterministic_and_spread():
    """The reward is a fixed function of the completion text in [0, 1) (the same in every process: not Python's
    salted hash()), and distinct completions spread over it, so a group of sampled completions has a nonzero
    reward std; prompts have prompt_length characters and depend on the seed only."""
    import subprocess
    import sys

    from dllm_fast.tasks.synthetic import synthetic_reward

    task = get_task("synthetic", prompt_length=37, num_train=5, num_test=3)
    train = task.train_examples(seed=1)
    assert [e.question for e in train] == [e.question for e in task.train_examples(seed=1)]
    assert train[0].question != task.train_examples(seed=2)[0].question
    assert all(len(e.question) == 37 for e in train) and len(task.test_examples()) == 3
    assert {e.question for e in task.test_examples()}.isdisjoint(e.question for e in train)
    group = [f"completion {i}" for i in range(8)]
    rewards = [task.reward(train[0], text) for text in group]
    assert all(0.0 <= r < 1.0 for r in rewards) and len(set(rewards)) == 8
    assert sum(task.correct(train[0], text) for text in [f"c{i}" for i in range(200)]) in range(70, 131)
    other = subprocess.run([sys.executable, "-c", "from dllm_fast.tasks.synthetic import synthetic_reward; "
                            "print(repr(synthetic_reward('completion 0')))"], capture_output=True, text=True,
                           check=True)
    assert float(other.stdout) == synthetic_reward("completion 0") == rewards[0]
    with pytest.raises(ValueError, match="prompt_length=0 must be an int"):
        get_task("synthetic", prompt_length=0)


# ---------------------------------------------------------------------------------------------------------
# sudoku4


def _valid(grid: str) -> bool:
    rows = [grid[r * 4:r * 4 + 4] for r in range(4)]
    columns = ["".join(row[c] for row in rows) for c in range(4)]
    boxes = ["".join(rows[r + i][c + j] for i in (0, 1) for j in (0, 1)) for r in (0, 2) for c in (0, 2)]
    return all(sorted(unit) == list("1234") for unit in rows + columns + boxes)


def test_all_288_grids_are_distinct_and_valid():
    grids = all_grids()
    assert len(grids) == 288 and len(set(grids)) == 288
    assert all(_valid(g) for g in grids)
    assert count_solutions("0" * 16) == 288


def test_sudoku4_split_is_by_solution_and_puzzles_are_unique():
    task = get_task("sudoku4", num_train=300, num_test=64)
    assert set(task.train_solutions).isdisjoint(task.test_solutions)
    assert len(task.train_solutions) + len(task.test_solutions) == 288
    assert len(task.test_solutions) == 72  # test_fraction 0.25
    train, test = task.train_examples(seed=0), task.test_examples()
    assert len(train) == 300 and len(test) == 64
    assert {e.answer for e in train} <= set(task.train_solutions)
    assert {e.answer for e in test} <= set(task.test_solutions)
    assert len({e.data["puzzle"] for e in test}) == 64
    for example in train[:50] + test:
        puzzle = example.data["puzzle"]
        assert 4 <= puzzle.count("0") <= 10
        assert count_solutions(puzzle) == 1
        assert all(p in ("0", s) for p, s in zip(puzzle, example.answer))


def test_sudoku4_is_deterministic_and_the_test_split_ignores_the_training_seed():
    task = get_task("sudoku4", num_train=20, num_test=16)
    again = get_task("sudoku4", num_train=20, num_test=16)
    assert task.train_examples(seed=3) == again.train_examples(seed=3)
    assert task.train_examples(seed=3) != task.train_examples(seed=4)
    assert task.test_examples() == again.test_examples()
    other_split = get_task("sudoku4", num_train=20, num_test=16, split_seed=1)
    assert other_split.test_solutions != task.test_solutions


SOLUTION = "1234341221434321"
PUZZLE = "1004341221434301"  # blanks at cells 1, 2 and 14


def test_sudoku_reward_is_the_fraction_of_blanks_filled_correctly():
    task = get_task("sudoku4", prompt_style="grid")
    example = Example(question="", answer=SOLUTION, data={"puzzle": PUZZLE, "solution": SOLUTION})
    solved = "<answer>1234\n3412\n2143\n4321</answer>"
    assert task.reward(example, solved) == 1.0 and task.correct(example, solved)
    assert task.reward(example, "<answer>1234341221434311</answer>") == pytest.approx(2 / 3)  # cell 14 wrong
    assert task.reward(example, "1234341221434321") == 0.0  # no answer tags: d1 scores 0
    # Short answers are padded with 0 and long ones cut to 16 digits.
    assert task.reward(example, "<answer>12</answer>") == pytest.approx(1 / 3)
    assert task.reward(example, "<answer>1234341221434321999</answer>") == 1.0
    # The last answer tags count; digits are read through any separators.
    assert task.reward(example, "<answer>1111</answer> <answer>12 34 34 12 21 43 43 21</answer>") == 1.0
    # A miscopied given does not cost reward (d1 scores blanks only), but the grid is not solved.
    miscopied = "<answer>2234341221434321</answer>"
    assert task.reward(example, miscopied) == 1.0 and not task.correct(example, miscopied)
    assert sudoku_reward(SOLUTION, SOLUTION, "<answer>1</answer>") == 0.0  # no blanks: nothing to score


def test_sudoku4_grid_prompt_and_demonstration_earn_full_reward():
    task = get_task("sudoku4", prompt_style="grid", num_train=5)
    for example in task.train_examples():
        assert example.question == "\n".join(example.data["puzzle"][r * 4:r * 4 + 4] for r in range(4))
        demonstration = task.demonstration(example)
        assert task.reward(example, demonstration) == 1.0 and task.correct(example, demonstration)
    d1 = get_task("sudoku4", num_train=1).train_examples()[0]
    assert d1.question.startswith(REASONING_FORMAT)
    assert d1.question.endswith(f"Solve the following Sudoku puzzle: {d1.data['puzzle']}\n")


def test_sudoku4_rejects_bad_options_by_name():
    with pytest.raises(ValueError, match="max_blanks=13"):
        get_task("sudoku4", max_blanks=13)
    with pytest.raises(ValueError, match="prompt_style='rows'"):
        get_task("sudoku4", prompt_style="rows")
    with pytest.raises(ValueError, match="test_fraction=0.0"):
        get_task("sudoku4", test_fraction=0.0)


# ---------------------------------------------------------------------------------------------------------
# countdown


def test_countdown_reward_has_d1s_three_levels():
    numbers, target = [30, 100, 93], 23
    assert countdown_reward(numbers, target, "<answer>30 + 93 - 100</answer>") == 1.0
    tagged = "<reasoning>\n...\n</reasoning>\n<answer>\n93 - 100 + 30\n</answer>"
    assert countdown_reward(numbers, target, tagged) == 1.0
    assert countdown_reward(numbers, target, "30 + 93 - 100") == 0.0  # no answer tags
    assert countdown_reward(numbers, target, "<answer>30 + 93 - 100 = 23</answer>") == 0.1  # 23 is not a given number
    assert countdown_reward(numbers, target, "<answer>30 + 30 - 37</answer>") == 0.1  # numbers reused
    assert countdown_reward(numbers, target, "<answer>30 + 93 - 100 + 30 - 30</answer>") == 0.1  # 23, but 30 thrice
    assert countdown_reward(numbers, target, "<answer>(100 - 93) * 30</answer>") == 0.1  # wrong value
    assert countdown_reward(numbers, target, "<answer>30 + 93 - x100</answer>") == 0.1  # outside the whitelist
    assert countdown_reward(numbers, target, "<answer>30 93 100</answer>") == 0.1  # does not parse
    assert countdown_reward([6, 4, 3], 8, "<answer>6 / 3 * 4</answer>") == 1.0  # exact division
    assert countdown_reward([6, 4, 3], 8, "<answer>6 / (4 - 4)</answer>") == 0.1  # also reuses 4
    assert countdown_reward([6, 4, 4], 8, "<answer>6 / (4 - 4)</answer>") == 0.1  # division by zero
    # The last answer counts.
    assert countdown_reward(numbers, target, "<answer>1</answer><answer>30+93-100</answer>") == 1.0


def test_countdown_refuses_powers_which_d1s_eval_would_compute():
    assert countdown_reward([2, 3, 4], 32, "<answer>2**3*4</answer>") == 0.1  # d1: 1.0
    start = time.perf_counter()
    assert countdown_reward([99, 99, 99], 1, "<answer>99**99**99</answer>") == 0.1  # d1's eval never returns
    assert time.perf_counter() - start < 1.0
    assert evaluate_expression("-(3 - 5) * 2") == 4
    assert evaluate_expression("7 // 2") == 3


def test_countdown_generator_is_solvable_split_and_deterministic():
    task = get_task("countdown", num_train=200, num_test=50)
    test = task.test_examples()
    keys = {(tuple(sorted(e.data["numbers"])), e.data["target"]) for e in test}
    assert len(keys) == 50
    train = task.train_examples(seed=1)
    assert keys.isdisjoint((tuple(sorted(e.data["numbers"])), e.data["target"]) for e in train)
    assert train == get_task("countdown", num_train=200, num_test=50).train_examples(seed=1)
    assert train != task.train_examples(seed=2)
    for example in test + train[:50]:
        assert len(example.data["numbers"]) == 3 and 1 <= example.data["target"] <= 100
        assert task.reward(example, task.demonstration(example)) == 1.0
        assert task.correct(example, task.demonstration(example))
    assert "Using only the numbers" in test[0].question and test[0].question.startswith(REASONING_FORMAT)


# ---------------------------------------------------------------------------------------------------------
# d1's format rewards: each quirk, legacy and fixed


PERFECT = "<reasoning>\nadd them\n</reasoning>\n<answer>\n7\n</answer>\n"
MULTILINE = "<reasoning>\nfirst 12 + 15 = 27\nthen 27 - 20 = 7\n</reasoning>\n<answer>\n7\n</answer>\n"


def test_answer_extraction_matches_d1():
    assert split_answer(PERFECT) == "7"
    assert split_answer("no tags at all ") == "no tags at all"  # d1: the whole completion
    assert split_answer("<answer>1</answer> then <answer> 2 </answer>") == "2"
    assert split_answer("<answer>\n5") == "5"  # unclosed: up to the end
    assert last_answer_tag("<answer>\n5") is None
    assert last_answer_tag("<answer>a\nb</answer>") == "a\nb"


def test_soft_and_strict_format_need_dotall_for_multiline_reasoning():
    assert soft_format_reward(PERFECT) == 0.5 and strict_format_reward(PERFECT) == 0.5
    assert soft_format_reward(MULTILINE) == 0.5 and strict_format_reward(MULTILINE) == 0.5
    # Without re.DOTALL the soft pattern's ".*?" cannot cross the newline that the requested format puts after
    # <reasoning>, so it matches only a one-line completion; the strict pattern spells its newlines out and
    # fails only on multi-line contents.
    assert soft_format_reward(PERFECT, legacy=True) == 0.0
    assert soft_format_reward("<reasoning>r</reasoning> <answer>7</answer>", legacy=True) == 0.5
    assert strict_format_reward(PERFECT, legacy=True) == 0.5
    assert strict_format_reward(MULTILINE, legacy=True) == 0.0
    assert strict_format_reward(PERFECT.rstrip("\n")) == 0.0  # strict wants the final newline
    assert soft_format_reward(" " + PERFECT) == 0.0  # re.match: the completion must start with the tag


def test_xml_count_quirks():
    assert xml_count_reward(PERFECT) == 0.5 and xml_count_reward(PERFECT, legacy=True) == 0.5
    ends_at_tag = PERFECT.rstrip("\n")
    assert xml_count_reward(ends_at_tag) == 0.5
    # Released: no "\n</answer>\n", so the <answer> clause subtracts the whole completion's length, and the
    # </answer> clause subtracts (0 - 1) characters, i.e. adds 0.001.
    assert xml_count_reward(ends_at_tag, legacy=True) == pytest.approx(0.5 - 0.001 * len(ends_at_tag) + 0.001)
    trailing = PERFECT + "extra"
    assert xml_count_reward(trailing) == pytest.approx(0.5 - 0.005)
    assert xml_count_reward(trailing, legacy=True) == pytest.approx(0.5 - 0.005 - 0.005)  # counted twice
    assert xml_count_reward(PERFECT + "\n\n") == 0.5  # trailing whitespace is free when fixed
    assert xml_count_reward("<reasoning>\n<reasoning>\nx") == 0.0  # a tag twice earns nothing


# ---------------------------------------------------------------------------------------------------------
# gsm8k


def test_gsm8k_reads_jsonl_and_builds_d1_prompts():
    task = get_task("gsm8k", train_path=GSM8K_FILE, test_path=GSM8K_FILE)
    test = task.test_examples()
    assert [e.answer for e in test] == ["7", "14", "1250", "-3"]
    assert test[0].question == REASONING_FORMAT + "\n\n" + (
        "A baker makes 12 muffins in the morning and 15 in the afternoon, then sells 20. How many muffins are left?")
    train = task.train_examples(seed=0)
    assert sorted(e.answer for e in train) == sorted(e.answer for e in test)
    assert train == task.train_examples(seed=0)
    for example in test:
        assert task.reward(example, task.demonstration(example)) == 4.0


def test_gsm8k_reward_decomposition_fixed_and_legacy():
    fixed = get_task("gsm8k", test_path=GSM8K_FILE)
    legacy = get_task("gsm8k", test_path=GSM8K_FILE, legacy_d1_regex=True)
    seven, _, thousand, negative = fixed.test_examples()
    assert fixed.reward_components(seven, PERFECT) == {
        "xml_count": 0.5, "soft_format": 0.5, "strict_format": 0.5, "integer": 0.5, "correctness": 2.0}
    assert legacy.reward_components(seven, MULTILINE) == {
        "xml_count": 0.5, "soft_format": 0.0, "strict_format": 0.0, "integer": 0.5, "correctness": 2.0}
    assert fixed.reward(seven, MULTILINE) == 4.0 and legacy.reward(seven, MULTILINE) == 3.0
    assert legacy.reward(seven, PERFECT) == 3.5  # the released soft format never matches the format it asks for
    # Numbers, not strings, when fixed.
    with_comma = "<answer>\n$1,250\n</answer>"
    assert fixed.correct(thousand, with_comma) and not legacy.correct(thousand, with_comma)
    assert fixed.reward_components(thousand, with_comma)["integer"] == 0.5
    assert legacy.reward_components(thousand, with_comma)["integer"] == 0.0
    assert fixed.correct(seven, "<answer>7.0</answer>") and not legacy.correct(seven, "<answer>7.0</answer>")
    minus = "<answer>-3</answer>"
    assert fixed.correct(negative, minus) and legacy.correct(negative, minus)
    assert fixed.reward_components(negative, minus)["integer"] == 0.5
    assert legacy.reward_components(negative, minus)["integer"] == 0.0  # "-3".isdigit() is False
    assert legacy.reward_components(seven, "<answer>²</answer>")["integer"] == 0.5  # "²".isdigit() is True
    assert fixed.reward_components(seven, "<answer>²</answer>")["integer"] == 0.0
    assert not fixed.correct(seven, "<answer>8</answer>")
    assert fixed.correct(seven, "7")  # no tags: d1 reads the whole completion


def test_jsonl_tasks_name_bad_files():
    with pytest.raises(FileNotFoundError, match="test_path='nowhere.jsonl'"):
        get_task("gsm8k", test_path="nowhere.jsonl")
    with pytest.raises(ValueError, match="neither train_path nor test_path"):
        get_task("math")
    with pytest.raises(ValueError, match="without train_path"):
        get_task("gsm8k", test_path=GSM8K_FILE).train_examples()
    with pytest.raises(ValueError, match=r"math_sample.jsonl:1 lacks the field 'question'"):
        get_task("gsm8k", test_path=MATH_FILE).test_examples()


def test_jsonl_reports_the_line_of_invalid_json(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\n{not json}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2 is not valid JSON"):
        get_task("gsm8k", test_path=bad).test_examples()


# ---------------------------------------------------------------------------------------------------------
# math


def test_math_reference_answers_and_boxed_extraction():
    task = get_task("math", test_path=MATH_FILE)
    assert [e.answer for e in task.test_examples()] == ["\\frac{5}{6}", "4", "2\\sqrt{3}", "\\frac{1}{2}"]
    assert last_boxed("so \\boxed{\\frac{1}{\\sqrt{3}}} and \\boxed{2}") == "2"
    assert last_boxed("\\boxed{\\frac{1}{\\sqrt{3}}}.") == "\\frac{1}{\\sqrt{3}}"
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("\\boxed 5$ end") == "5"
    assert last_boxed("\\boxed{unclosed") is None and last_boxed("nothing") is None


def test_math_normalisation():
    for answer, reference in [("\\dfrac56", "\\frac{5}{6}"), ("0.5", "\\frac{1}{2}"), ("1/2", "\\frac{1}{2}"),
                              ("x = 4", "4"), ("\\left( 1, 2 \\right)", "(1,2)"), ("90^\\circ", "90"),
                              ("\\sqrt 3", "\\sqrt{3}"), ("\\$5", "5"), ("50\\%", "50"), (".5", "0.5"),
                              ("10\\text{ cm}", "10")]:
        assert normalize_answer(answer) == normalize_answer(reference), (answer, reference)
    assert normalize_answer("\\frac{5}{6}") != normalize_answer("\\frac{6}{5}")


def test_math_rewards_fixed_and_legacy():
    fixed = get_task("math", test_path=MATH_FILE)
    legacy = get_task("math", test_path=MATH_FILE, legacy_d1_regex=True)
    five_sixths, four, root, half = fixed.test_examples()
    tagged = "<reasoning>\nadd\n</reasoning>\n<answer>\n\\boxed{\\dfrac{5}{6}}\n</answer>"
    assert fixed.reward_components(five_sixths, tagged) == {"correctness": 2.0, "boxed_and_answer_tags": 1.0}
    # d1's "\boxed" is a backspace + "oxed": the boxed check never fires.
    assert legacy.reward_components(five_sixths, tagged) == {"correctness": 2.0, "boxed_and_answer_tags": 0.75}
    untagged = "so x = \\boxed{4}"
    assert boxed_and_tags_reward(untagged) == 0.5 and boxed_and_tags_reward(untagged, legacy=True) == 0.25
    assert fixed.correct(four, untagged) and fixed.reward(four, untagged) == 2.5
    assert boxed_and_tags_reward("<answer>\n4\n</answer> \\boxed{4}") == 0.75  # boxed outside the first tags
    assert fixed.correct(root, "\\boxed{2\\sqrt3}") and not fixed.correct(root, "\\boxed{\\sqrt{12}}")
    assert fixed.correct(half, "\\boxed{0.5}")  # the "answer" field wins over the solution's boxed 0.5
    assert fixed.correct(four, "4")  # no \boxed: d1 compares the whole completion
    for example in fixed.test_examples():
        assert fixed.reward(example, fixed.demonstration(example)) == 3.0


def test_math_record_without_an_answer_is_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "What is 1 + 1?", "solution": "It is 2."}\n')
    with pytest.raises(ValueError, match="needs an 'answer' field or a 'solution' with a \\\\boxed"):
        get_task("math", test_path=bad).test_examples()


# ---------------------------------------------------------------------------------------------------------
# prompts


class TemplateTokenizer:
    chat_template = "set"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<assistant>"


class PlainTokenizer:
    chat_template = None


def test_prompt_uses_the_chat_template_when_there_is_one():
    example = get_task("countdown", num_train=1, num_test=1).test_examples()[0]
    task = get_task("countdown", num_train=1, num_test=1)
    assert task.prompt(example, TemplateTokenizer()) == f"<user>{example.question}</user><assistant>"
    assert task.prompt(example, PlainTokenizer()) == example.question
    assert task.prompt(example) == example.question
    assert chat_prompt("q", TemplateTokenizer()) == "<user>q</user><assistant>"
