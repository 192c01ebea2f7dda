"""How many finished 2-rank DDP runs exit 0 on every rank (issue 45 item 6: 1 run in 24 ended with a rank aborting,
"terminate called without an active exception", after its steps and checkpoint).

    python benchmarks/bench_torchrun_exit.py [--runs 50] [--parallel ddp] [--results-dir DIR]

Each run is `torchrun --standalone --nproc_per_node 2 -m dllm_fast train` of the tiny default preset on CPU (gloo),
cut to one step, one evaluation of 4 examples and its checkpoint (what a run does at its end), in a fresh folder.
torchrun's exit status is 0 only when every rank exited 0; a run counts as clean when it is 0, its checkpoint was
written, and no rank printed an abort. Prints the count; with --results-dir, writes the runs as
torchrun_exit_<parallel>.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from common import write_results  # noqa: E402

# One step, one evaluation and one checkpoint of the default preset: the end of a run, in seconds.
SHORT_RUN = ["--steps", "1", "--prompts-per-step", "2", "--group-size", "4", "--eval-every", "1",
             "--checkpoint-every", "1", "--eval-examples", "4", "--progress", "false", "--plot", "false",
             "--threads", "1"]
ABORTS = ("terminate called", "SIGABRT", "Signals.SIGABRT", "core dumped")


def one_run(output_dir: Path, parallel: str = "ddp", timeout: float = 600) -> dict:
    """One 2-rank run into `output_dir`: its exit status, seconds, whether it wrote its checkpoint, and the
    abort line a rank printed (None when none did)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "dllm_fast", "train", "--output-dir", str(output_dir), "--parallel", parallel, *SHORT_RUN]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        returncode, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        returncode, output = "timeout", str(expired.stdout or "") + str(expired.stderr or "")
    abort = next((line for line in output.splitlines() if any(word in line for word in ABORTS)), None)
    checkpoint = (output_dir / "checkpoint").is_dir()
    return dict(returncode=returncode, seconds=round(time.perf_counter() - started, 1), checkpoint=checkpoint,
                abort=abort, clean=returncode == 0 and checkpoint and abort is None,
                tail=None if returncode == 0 else output[-2000:])


def repeated_runs(runs: int, parallel: str = "ddp", report=print) -> list[dict]:
    """`runs` runs, each in a fresh temporary folder; `report(row)` after each."""
    rows = []
    for index in range(runs):
        with tempfile.TemporaryDirectory(prefix="torchrun_exit_") as folder:
            row = {"run": index, **one_run(Path(folder) / "run", parallel)}
        rows.append(row)
        report(row)
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="how many 2-rank runs (default 50)")
    parser.add_argument("--parallel", choices=["ddp", "fsdp2"], default="ddp")
    parser.add_argument("--results-dir", type=Path, help="also write the runs there as torchrun_exit_<parallel>.json")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs {args.runs}: give at least 1 run.")

    def report(row):
        print(f"run {row['run']}: exit {row['returncode']}, {row['seconds']} s, checkpoint {row['checkpoint']}"
              + (f", abort: {row['abort']}" if row["abort"] else ""), flush=True)

    rows = repeated_runs(args.runs, args.parallel, report)
    clean = sum(row["clean"] for row in rows)
    print(f"{clean} of {len(rows)} finished 2-rank {args.parallel} runs exited 0 on every rank")
    if args.results_dir:
        write_results(f"torchrun_exit_{args.parallel}", {"runs": args.runs, "parallel": args.parallel}, rows,
                      args.results_dir)
    return rows


if __name__ == "__main__":
    main()
