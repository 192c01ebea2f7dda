"""verl's step beside dllm_fast's own trainer step.

    python benchmarks/bench_verl_step.py cpu [--steps 4] [--python VENV/bin/python]    # measured, this machine
    python benchmarks/bench_verl_step.py plan [--gpu H100] [--gpus 8]                  # planner estimate

cpu: in one run, the same shapes through both: the embedded sudoku4 model, 2 prompts x 2 completions a step, 24
tokens decoded in one block of 12 steps, espo, fp32, one compute thread each (OMP_NUM_THREADS=1); verl through
`python -m dllm_fast.integrations.verl` (its whole trainer inside Ray, 1 hybrid worker, dllm_fast's actor engine
`model_type=dllm_fast`), the trainer through `python -m dllm_fast train`. Per step (the first, with its warm-up, left out): the median seconds of the step and of its
phases, and verl / trainer. verl's own step timer (`timing_s/step`) does not count Ray's and the workers' start.

plan: the planner's step at LLaDA-8B LoRA shapes (`python -m dllm_fast plan`, labelled as its estimate), and what
verl's dataflow adds to it, counted one by one:
- the old-policy pass: verl always scores the batch with the policy before the update (`compute_log_prob`), where
  the trainer at mu=1 reuses its first pass (the policy has not moved). It is one no-grad forward over the same
  N x n_t masked sequences as the reference pass, whose planned seconds it takes;
- the weight sync: both merge the LoRA adapters for the rollout (verl with `lora.merge`, the trainer's
  models.merged_lora): nothing more on one GPU; under FSDP2 over W GPUs each sync all-gathers the bf16 model,
  (W-1)/W x P bytes received per GPU, at NVLink's 450 GB/s a direction (an assumption, stated);
- padding: verl pads prompts to `max_prompt_length` in its batch but hands the engine unpadded rows
  (`left_right_2_no_padding`), and the rollout pads within each generate call as the trainer does: no extra
  tokens are computed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine, write_results  # noqa: E402

SUDOKU4 = ROOT / "dllm_fast/assets/sudoku4"
VERL_TIMERS = ("timing_s/step", "timing_s/gen", "timing_s/reward", "timing_s/old_log_prob", "timing_s/adv",
               "timing_s/update_actor", "timing_s/update_weights")
NVLINK_BYTES_PER_S = 450e9
THREADS = {"OMP_NUM_THREADS": "1"}  # both runs: verl's worker and the trainer compute on one thread each


def verl_overrides(data: Path, out: Path, steps: int) -> list[str]:
    # The launcher's actor: dllm_fast's engine (model_type=dllm_fast, FSDP2), in fp32 as the trainer on the CPU.
    return [f"actor_rollout_ref.model.path={SUDOKU4}", "actor_rollout_ref.model.use_remove_padding=false",
            "++actor_rollout_ref.model.model_type=dllm_fast", "actor_rollout_ref.actor.strategy=fsdp2",
            "++actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
            "trainer.balance_batch=false",
            "actor_rollout_ref.actor.optim.lr=1e-4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.use_kl_loss=false",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.dtype=float32", "actor_rollout_ref.rollout.agent.num_workers=1",
            "++actor_rollout_ref.rollout.engine_kwargs.dllm_fast.block_length=24",
            "++actor_rollout_ref.rollout.engine_kwargs.dllm_fast.steps=12",
            f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
            "data.train_batch_size=2", "data.max_prompt_length=64", "data.max_response_length=24",
            "data.dataloader_num_workers=0", "reward.num_workers=1", "trainer.nnodes=1", "trainer.n_gpus_per_node=1",
            f"trainer.total_training_steps={steps}", "trainer.save_freq=-1", "trainer.test_freq=-1",
            "trainer.val_before_train=false", "trainer.logger=[console]", f"trainer.default_local_dir={out}",
            "trainer.resume_mode=disable", "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
            "++ray_kwargs.ray_init.include_dashboard=false"]


def run_verl(python: str, steps: int, work: Path) -> dict[str, float]:
    from dllm_fast.integrations.verl.data import write_task

    data = write_task("sudoku4", work / "data", num_train=2 * steps, num_test=2, prompt_style="grid")["train"].parent
    env = {**os.environ, **THREADS, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
           "RAY_memory_monitor_refresh_ms": "0",  # Ray's monitor kills the run's actors on a full shared machine
           "VERL_USE_EXTERNAL_MODULES": "dllm_fast.integrations.verl_plugin",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    for attempt in range(2):  # Ray gives its raylet a fixed 30 s to register: a loaded machine can miss it, once
        done = subprocess.run([python, "-m", "dllm_fast.integrations.verl",
                               *verl_overrides(data, work / "ckpt", steps)],
                              cwd=work, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode == 0 or "node timed out during startup" not in done.stdout + done.stderr \
                and "Deadline Exceeded" not in done.stdout + done.stderr:
            break
    if done.returncode != 0:
        raise RuntimeError(f"the verl run failed:\n{(done.stdout + done.stderr)[-4000:]}")
    rows = {}
    for line in done.stdout.splitlines():
        match = re.search(r"step:(\d+) - (.*)", line)
        if match:
            values = dict(item.partition(":")[::2] for item in match.group(2).split(" - "))
            rows[int(match.group(1))] = {k: float(values[k]) for k in VERL_TIMERS if k in values}
    kept = [rows[s] for s in sorted(rows) if s > 1]
    return {key: statistics.median(r[key] for r in kept) for key in VERL_TIMERS if all(key in r for r in kept)}


def run_trainer(python: str, steps: int, work: Path) -> dict[str, float]:
    out = work / "trainer"
    command = [python, "-m", "dllm_fast", "train", "--model", str(SUDOKU4), "--task", "sudoku4",
               "--task-options", json.dumps({"prompt_style": "grid"}), "--prompts-per-step", "2", "--group-size", "2",
               "--gen-length", "24", "--block-length", "24", "--diffusion-steps", "12", "--steps", str(steps),
               "--objective", "espo", "--lr", "1e-4", "--eval-every", "1000", "--output-dir", str(out),
               "--progress", "false", "--plot", "false"]
    env = {**os.environ, **THREADS,
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the trainer run failed:\n{(done.stdout + done.stderr)[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    kept = [r for r in rows if r.get("step", 0) > 1 and "step_seconds" in r]
    return {key: statistics.median(r[key] for r in kept)
            for key in ("step_seconds", "rollout_seconds", "update_seconds") if all(key in r for r in kept)}


def cpu(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_verl_step_") as folder:
        work = Path(folder)
        verl = run_verl(args.python, args.steps, work)
        trainer = run_trainer(args.python, args.steps, work)
    ratios = {"step": verl["timing_s/step"] / trainer["step_seconds"],
              "rollout": verl.get("timing_s/gen", float("nan")) / trainer["rollout_seconds"]}
    rows = [{"measured": "verl", **verl}, {"measured": "trainer", **trainer}, {"measured": "verl / trainer", **ratios}]
    for row in rows:
        print(json.dumps(row))
    return {"rows": rows}


def plan(args) -> dict:
    command = [sys.executable, "-m", "dllm_fast", "plan", "--model", "llada-8b", "--lora", "true", "--gpu", args.gpu,
               "--json", "--prompts-per-step", "8", "--group-size", "8", "--prompt-length", "256",
               "--gen-length", "256", "--block-length", "32", "--diffusion-steps", "256", "--cache", "dual",
               "--micro-batch", str(args.micro_batch), "--objective", "espo"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"the planner failed:\n{done.stderr[-4000:]}")
    planned = json.loads(done.stdout)
    phases = {name: phase["seconds"] for name, phase in planned["phases"].items()}
    trainer_step = planned["step_seconds"]
    old_policy = phases.get("reference scoring", 0.0)
    parameter_bytes = planned["weight_bytes_per_forward"]
    sync = (args.gpus - 1) / args.gpus * parameter_bytes / NVLINK_BYTES_PER_S if args.gpus > 1 else 0.0
    verl_step = trainer_step + old_policy + sync
    row = {"label": "PLANNER ESTIMATE (python -m dllm_fast plan), not a measurement", "summary": planned["summary"],
           "trainer_phases_s": phases, "trainer_step_s": trainer_step, "verl_old_policy_pass_s": old_policy,
           f"verl_weight_sync_s_fsdp2_{args.gpus}_gpus": sync, "verl_padding_s": 0.0, "verl_step_s": verl_step,
           "verl_over_trainer": verl_step / trainer_step, "fits": planned["fits"]}
    print(json.dumps(row, indent=1))
    return {"rows": [row]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    on_cpu = sub.add_parser("cpu")
    on_cpu.add_argument("--steps", type=int, default=4)
    on_cpu.add_argument("--python", default=sys.executable, help="an interpreter with verl (and dllm_fast) installed")
    planner = sub.add_parser("plan")
    planner.add_argument("--gpu", default="H100")
    planner.add_argument("--gpus", type=int, default=8)
    planner.add_argument("--micro-batch", type=int, default=16)
    args = parser.parse_args()
    result = cpu(args) if args.mode == "cpu" else plan(args)
    print("written:", write_results(f"verl_step_{args.mode}", vars(args), result["rows"]))
    print(json.dumps(machine()))


if __name__ == "__main__":
    main()
