"""dllm_fast's tasks as verl datasets: parquet files of the rows verl's RLHFDataset reads.

    python -m dllm_fast.integrations.verl.data --task sudoku4 --out data/sudoku4 [--option prompt_style=grid]

writes `train.parquet` (the task's `train_examples(seed)`) and `test.parquet` (`test_examples()`), one row per
example: `prompt` (the question as the one user message; verl's agent loop applies the tokenizer's chat template,
as `Task.prompt` does), `data_source` ("dllm_fast/<task>", which the reward functions read), `reward_model`
(`ground_truth`: the answer) and `extra_info` (`index`, and under "dllm_fast" the example's question and data:
what rewards.py rebuilds the Example from).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dllm_fast.integrations.verl.rewards import DATA_SOURCE_PREFIX, EXTRA_KEY, TASKS
from dllm_fast.tasks import Example, get_task


def row(task_name: str, example: Example, index: int) -> dict:
    """One verl row of `example` (module docstring)."""
    return {"prompt": [{"role": "user", "content": example.question}],
            "data_source": DATA_SOURCE_PREFIX + task_name,
            "reward_model": {"style": "rule", "ground_truth": example.answer},
            "extra_info": {"index": index,
                           EXTRA_KEY: {"question": example.question, "data": json.dumps(dict(example.data))}}}


def write_task(task_name: str, out: str | Path, *, seed: int = 0, num_train: int | None = None,
               num_test: int | None = None, **options) -> dict[str, Path]:
    """Write the task's train and test rows under `out`; returns the two paths. num_train/num_test keep the first
    rows (a small run's data). The example's data travels as JSON text, which parquet keeps whatever its fields."""
    import pandas as pd

    if task_name not in TASKS:
        raise ValueError(f"task={task_name!r} is none of dllm_fast's verl tasks ({', '.join(TASKS)}).")
    task = get_task(task_name, **options)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, examples, limit in (("train", task.train_examples(seed), num_train),
                                   ("test", task.test_examples(), num_test)):
        rows = [row(task_name, example, i) for i, example in enumerate(examples[:limit])]
        if not rows:
            raise ValueError(f"the {split} split of {task_name} is empty; ask for at least one row.")
        paths[split] = out / f"{split}.parquet"
        pd.DataFrame(rows).to_parquet(paths[split])
    return paths


def _option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--option {text!r} must be NAME=VALUE (e.g. prompt_style=grid).")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def main(argv: list[str] | None = None) -> dict[str, Path]:
    parser = argparse.ArgumentParser(prog="python -m dllm_fast.integrations.verl.data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True, choices=TASKS)
    parser.add_argument("--out", required=True, help="the folder to write train.parquet and test.parquet into")
    parser.add_argument("--seed", type=int, default=0, help="the training examples' seed")
    parser.add_argument("--num-train", type=int, default=None)
    parser.add_argument("--num-test", type=int, default=None)
    parser.add_argument("--option", type=_option, action="append", default=[],
                        help="a task option NAME=VALUE (repeatable), e.g. prompt_style=grid")
    args = parser.parse_args(argv)
    paths = write_task(args.task, args.out, seed=args.seed, num_train=args.num_train, num_test=args.num_test,
                       **dict(args.option))
    for split, path in paths.items():
        print(f"{split}: {path}")
    return paths


if __name__ == "__main__":
    main()
