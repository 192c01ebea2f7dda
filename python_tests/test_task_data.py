"""Task data against broken files (issue 17, item 8): every bad line of a JSONL file is an error that names the file
and the line, before any example is used; generated tasks refuse sizes they cannot draw, quickly."""

import json
import time

import pytest

from dllm_fast.tasks import get_task
from dllm_fast.tasks.jsonl import MAX_LINE_BYTES

GOOD_GSM8K = {"question": "Ann has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"}
GOOD_MATH = {"problem": "What is 1 + 1?", "answer": "2"}


def write_lines(path, *lines: bytes):
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def record(**fields) -> bytes:
    return json.dumps(fields).encode()


@pytest.mark.parametrize("task, bad, message", [
    ("gsm8k", record(question=None, answer="#### 7"), r": 'question' is null, not text"),
    ("gsm8k", record(question=["a", "list"], answer="#### 7"), r": 'question' is \[\"a\", \"list\"\], not text"),
    ("gsm8k", record(question="   ", answer="#### 7"), r": 'question' is empty"),
    ("gsm8k", record(question="q", answer=7), r": 'answer' is 7, not text"),
    ("gsm8k", record(question="q", answer="so it is 7\n####"), r": 'answer' has nothing after '####'"),
    ("gsm8k", record(question="q", answer="####   "), r": 'answer' has nothing after '####'"),
    ("gsm8k", b"[1, 2]", r" holds a JSON list, not an object"),
    ("gsm8k", b'{"question": "caf\xe9", "answer": "#### 1"}', r" is not UTF-8 text \(byte 0xe9 at column 18\)"),
    ("math", record(problem=None, answer="2"), r": 'problem' is null, not text"),
    ("math", record(problem="p", answer=None), r": 'answer' is null, not text"),
    ("math", record(problem="p", answer=""), r": 'answer' is empty"),
    ("math", record(problem="p", solution=None), r": 'solution' is null, not text"),
])
def test_a_bad_line_names_the_file_and_the_line(tmp_path, task, bad, message):
    good = record(**(GOOD_GSM8K if task == "gsm8k" else GOOD_MATH))
    path = write_lines(tmp_path / "data.jsonl", good, good, bad, good)
    with pytest.raises(ValueError, match=r"data.jsonl:3" + message):
        get_task(task, test_path=path).test_examples()


def test_good_lines_keep_their_place_for_messages(tmp_path):
    path = write_lines(tmp_path / "data.jsonl", record(**GOOD_GSM8K), b"", record(**GOOD_GSM8K))
    examples = get_task("gsm8k", test_path=path).test_examples()
    assert [e.source for e in examples] == [f"{path}:1", f"{path}:3"]
    assert examples[0].answer == "7"
    math = write_lines(tmp_path / "math.jsonl", record(problem="p", answer=12))  # an integer answer is fine
    assert get_task("math", test_path=math).test_examples()[0].answer == "12"


def test_a_huge_line_is_refused_before_it_is_parsed(tmp_path):
    path = tmp_path / "big.jsonl"
    huge = json.dumps({"question": "x" * (10 * 2**20), "answer": "#### 1"}).encode()  # a 10 MB prompt
    write_lines(path, record(**GOOD_GSM8K), huge)
    started = time.perf_counter()
    with pytest.raises(ValueError, match=rf"big.jsonl:2 is longer than {MAX_LINE_BYTES} bytes"):
        get_task("gsm8k", train_path=path).train_examples()
    assert time.perf_counter() - started < 5  # read in bounded pieces, never parsed


def test_generated_tasks_refuse_sizes_they_cannot_draw():
    with pytest.raises(ValueError, match=r"num_train=1000000000 must be an int in \[1, 100000\]"):
        get_task("countdown", num_train=10**9)
    with pytest.raises(ValueError, match=r"num_test=1000000000 must be an int in \[1, 100000\]"):
        get_task("sudoku4", num_test=10**9)
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"could not draw 256 distinct countdown problems .* then 10000 draws in a "
                                         r"row gave no new one"):
        get_task("countdown", min_number=5, max_number=5, max_target=3)
    with pytest.raises(ValueError, match=r"num_test=5000 distinct test puzzles could not be drawn .* \(drew 1152, "):
        get_task("sudoku4", num_test=5000, min_blanks=1, max_blanks=1).test_examples()  # 72 grids x 16 cells
    assert time.perf_counter() - started < 30


def test_an_unknown_task_option_lists_the_options():
    with pytest.raises(ValueError, match=r"task 'sudoku4' has no option 'bogus'; its options are max_blanks, "
                                         r"min_blanks, num_test, num_train, prompt_style"):
        get_task("sudoku4", bogus=1)
