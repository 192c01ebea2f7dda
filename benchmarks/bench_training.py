"""RL on the embedded default: every objective trains the sudoku4 model with the trainer's defaults; base vs final.

    python benchmarks/bench_training.py                                  # every objective x 3 seeds, 300 steps, 2 jobs
    python benchmarks/bench_training.py --objectives espo spg --seeds 0 1 2 3 4 --steps 200
    python benchmarks/bench_training.py --objectives spg --options '{"spg": {"preset": "sudoku"}}'
    python benchmarks/bench_training.py --model sdar-sudoku4 --objectives ebpo bgpo --name training_sdar_cpu

Each run is `python -m dllm_fast train --objective NAME --seed S` (TrainConfig's defaults: 8 prompts x G = 8,
AdamW lr 1e-4, T = 1.0 rollouts, the objective's paper defaults), in its own process with one CPU thread;
--jobs runs side by side. The accuracy is greedy on the whole sudoku4 test split, so the base model scores the
same for every seed; the seeds move the rollouts, masks and data order. Reported per objective: the final
accuracy's mean and sample std over seeds, the gain over the base model and whether it exceeds 2 std, the
seconds per step, the rollout tokens per second and the update's (sequence, sample) pairs per second (means over
every step of every seed). The rows are written after each run, so an interrupted sweep keeps what it finished; a
run that fails (a non-finite loss, for one) is listed under "failures" and the sweep goes on. --options gives
objectives options (JSON: name -> options, e.g. a preset); they are recorded with the results. tracerl needs a
generate that records the decoding order.

--model picks the embedded model: sudoku4 (LLaDA, the default) or sdar-sudoku4 (SDAR, block diffusion: decoded in
its blocks of 4 with the block cache). Some objectives need settings of their own (`objective_settings`):
justgrpo rolls out left to right (block length 1, one step per token), vrpo_dpo trains on the preference pairs
of sudoku4_pairs instead of rollouts, and ebpo needs the block model (on sudoku4 it is refused and listed under
"failures").
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import statistics
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from common import add_results_dir_argument, print_table, write_results  # noqa: E402

from dllm_fast import objectives  # noqa: E402


MODELS = ("sudoku4", "sdar-sudoku4")


def model_settings(model: str) -> dict:
    """The trainer's settings for an embedded model: the SDAR model decodes its own blocks of 4, with its cache."""
    from dllm_fast.assets import SDAR_SUDOKU4_GENERATION

    if model == "sdar-sudoku4":
        return dict(model=model, block_length=SDAR_SUDOKU4_GENERATION["block_length"],
                    cache=SDAR_SUDOKU4_GENERATION["cache"])
    return dict(model=model)


def objective_settings(objective: str, gen_length: int = 24) -> dict:
    """Settings an objective needs beyond its options: JustGRPO's left-to-right rollouts (block length 1, a step a
    token), offline VRPO's preference pairs instead of rollouts."""
    if objective == "justgrpo":
        return dict(block_length=1, diffusion_steps=gen_length)
    if objective == "vrpo_dpo":
        return dict(task="sudoku4_pairs")
    return {}


def one_run(objective: str, seed: int, steps: int, output_dir: str, options: dict | None = None,
            model: str = "sudoku4", lr: float | None = None) -> dict:
    """A whole training run in this (fresh) process; its accuracies and mean speeds. lr: the trainer's when None."""
    from dllm_fast.train import TrainConfig, train

    learning_rate = {} if lr is None else {"lr": lr}
    config = TrainConfig(objective=objective, seed=seed, steps=steps, output_dir=output_dir, threads=1,
                         progress=False, eval_every=steps, objective_options=options or {},
                         **{**model_settings(model), **objective_settings(objective), **learning_rate})
    result = train(config)
    length = config.eval.gen_lengths[0]
    steps_rows = [row for row in result.history if "step_seconds" in row]
    return dict(objective=objective, seed=seed, steps=result.steps,
                base_accuracy=result.base_accuracy[length], final_accuracy=result.final_accuracy[length],
                seconds=result.seconds,
                seconds_per_step=statistics.fmean(r["step_seconds"] for r in steps_rows),
                rollout_tokens_per_s=statistics.fmean(r["rollout_tokens_per_s"] for r in steps_rows),
                update_pairs_per_s=statistics.fmean(r["update_pairs_per_s"] for r in steps_rows),
                curve=curve(steps_rows))


CURVE_WINDOW = 25  # steps a point of a run's curve averages


def curve(rows: list[dict]) -> list[dict]:
    """A run's training curve, compact: per window of CURVE_WINDOW steps the mean of the rollouts' reward and
    accuracy, the completion length, and the updates' loss, gradient norm, KL and clip statistics (what a run
    that does not learn is diagnosed by)."""
    def kept(key: str) -> bool:
        return key in ("reward_mean", "reward_std", "accuracy", "completion_length") or any(
            word in key for word in ("loss", "grad_norm", "kl", "clip", "ratio", "advantage"))

    points = []
    for start in range(0, len(rows), CURVE_WINDOW):
        window = rows[start:start + CURVE_WINDOW]
        keys = [k for k, v in window[0].items() if kept(k) and isinstance(v, (int, float))]
        points.append(dict(step=window[-1]["step"], **{k: statistics.fmean(float(r[k]) for r in window if k in r)
                                                      for k in keys}))
    return points


def summarize(runs: list[dict], objective_names: list[str]) -> list[dict]:
    rows = []
    base = sorted({r["base_accuracy"] for r in runs})
    if base:
        rows.append(dict(objective="base model", seeds=len({r["seed"] for r in runs}), final_mean=base[0], final_std=0.0))
    for name in objective_names:
        mine = [r for r in runs if r["objective"] == name]
        if not mine:
            continue
        finals = [r["final_accuracy"] for r in mine]
        mean = statistics.fmean(finals)
        std = statistics.stdev(finals) if len(finals) > 1 else 0.0
        gain = mean - mine[0]["base_accuracy"]
        rows.append(dict(objective=name, seeds=len(mine), final_mean=mean, final_std=std, gain=gain,
                         gain_over_2_std=bool(len(finals) > 1 and gain > 2 * std),
                         seeds_above_base=sum(f > r["base_accuracy"] for f, r in zip(finals, mine)),
                         seconds_per_step=statistics.fmean(r["seconds_per_step"] for r in mine),
                         rollout_tokens_per_s=statistics.fmean(r["rollout_tokens_per_s"] for r in mine),
                         update_pairs_per_s=statistics.fmean(r["update_pairs_per_s"] for r in mine)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objectives", nargs="+", default=list(objectives.available()),
                        choices=list(objectives.available()))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--jobs", type=int, default=2, help="runs side by side, one CPU thread each")
    parser.add_argument("--model", default="sudoku4", choices=MODELS, help="the embedded model to train")
    parser.add_argument("--options", type=json.loads, default={},
                        help="objective options as JSON, by objective name, e.g. '{\"spg\": {\"preset\": \"sudoku\"}}'")
    parser.add_argument("--lr", type=float, default=None, help="every run's learning rate (default: the trainer's)")
    parser.add_argument("--name", default="training_cpu")
    add_results_dir_argument(parser)
    args = parser.parse_args()
    unknown = sorted(set(args.options) - set(args.objectives))
    if unknown:
        parser.error(f"--options names objectives that are not run: {unknown}")

    config = {k: v for k, v in vars(args).items() if k not in ("name", "results_dir")}
    runs, failures = [], []
    with tempfile.TemporaryDirectory() as scratch, concurrent.futures.ProcessPoolExecutor(
            args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(one_run, name, seed, args.steps, f"{scratch}/{name}-{seed}",
                               args.options.get(name), args.model, args.lr): (name, seed)
                   for seed in args.seeds for name in args.objectives}  # seed-major: a cut sweep has each objective
        for future in concurrent.futures.as_completed(futures):
            name, seed = futures[future]
            try:
                run = future.result()
            except Exception as error:  # a diverged or crashed run is a result too; the sweep goes on
                print(f"{name} seed {seed} failed: {error!r}", flush=True)
                failures.append(dict(objective=name, seed=seed, error=repr(error)))
                continue
            runs.append(run)
            print(f"{run['objective']} seed {run['seed']}: {run['base_accuracy']:.3f} -> {run['final_accuracy']:.3f}"
                  f" in {run['seconds']:.0f} s", flush=True)
            partial = config | {"runs": runs, "failures": failures}
            write_results(args.name, partial, summarize(runs, args.objectives), args.results_dir)
    rows = summarize(runs, args.objectives)
    print_table(rows, ["objective", "seeds", "final_mean", "final_std", "gain", "gain_over_2_std", "seeds_above_base",
                       "seconds_per_step", "rollout_tokens_per_s", "update_pairs_per_s"])
    print(f"wrote {write_results(args.name, config | {'runs': runs, 'failures': failures}, rows, args.results_dir)}")


if __name__ == "__main__":
    main()
