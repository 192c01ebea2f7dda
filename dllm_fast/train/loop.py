"""The minimal trainer: RL for masked diffusion LMs in one loop that reads top to bottom.

    python -m dllm_fast train                                    # the embedded default: sudoku4 on CPU
    python -m dllm_fast train --task countdown --objective espo --model path/to/checkpoint --lora true

Each step (steps 2, 4 and 5 are the phases of dllm_fast.train.step, which the planner and the TRL trainer run too):
  1. take the next prompts (a seeded, resumable order over the task's training examples);
  2. roll out G completions per prompt with `dllm_fast.generate`;
  3. score them with the task's reward and build the RolloutBatch;
  4. plan the mu inner updates with the objective (`Objective.plan_updates`): each one's Monte Carlo masks, and the
     old policy's lp on the masks of the updates that run after the policy has moved (the reference is scored
     inside the objective's entry point, on the same masks);
  5. run the inner updates through `Objective.backward` (exact gradient, memory independent of n_t), each
     followed by gradient clipping, an AdamW step and the learning-rate schedule.
An objective that trains on preference pairs (vrpo_dpo) takes steps 1-3 from the task's stored pairs instead
(train/pairs.py). Around the loop: JSONL metrics (a mixture-of-experts model's also report its experts' balance in the update
phase's forwards: router_load_max, router_load_cv, router_idle_experts) and a progress bar, greedy evaluation at several generation lengths, atomic
checkpoints every K steps from which `--resume true` continues bit for bit, and a PNG of the curves at the end.

Scaling out: `torchrun --nproc_per_node N -m dllm_fast train ...` runs DDP (default) or FSDP2 (`--parallel
fsdp2`, full fine-tunes); see dllm_fast.train.distributed.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dllm_fast.models.moe import router_load
from dllm_fast.train.expert_parallel import expert_rank_load
from dllm_fast.train.checkpoint import save_checkpoint
from dllm_fast.train.config import TrainConfig
from dllm_fast.train.distributed import distributed_session
from dllm_fast.train.evaluation import evaluate_lengths
from dllm_fast.train.metrics import PLOT, PhaseMeter, plot_curves, progress_bar, step_metrics
from dllm_fast.train.run import Run, RunSetup
from dllm_fast.train.run_dir import RunDirectory


@dataclass
class TrainResult:
    """base_accuracy / final_accuracy: greedy test accuracy per evaluation generation length, before the first
    step and after the last. steps: the run's step count at the end; resumed_at: the step this process started
    from (0 unless resumed), so it ran steps - resumed_at steps in `seconds`. history: every metrics row written."""

    output_dir: Path
    base_accuracy: dict[int, float]
    final_accuracy: dict[int, float]
    steps: int
    seconds: float
    history: list[dict] = field(default_factory=list)
    rank: int = 0
    resumed_at: int = 0


def train(config: TrainConfig) -> TrainResult:
    """Run the training `config` describes (see the module docstring). Every setting is checked first (RunSetup:
    nothing is written to the run directory by a run that cannot start); then the run directory is locked for the
    run: a second trainer on it is refused."""
    with distributed_session(config.run.device) as ranks:
        run_dir = RunDirectory(config.run.output_dir, ranks)
        try:
            setup = RunSetup(config, ranks, run_dir)
        except (ValueError, TypeError, OSError) as error:
            error.refused_setting = True  # a setting that cannot work, found before the run started (cli: exit 2)
            raise
        with run_dir.locked():
            return _train(Run(config, ranks, run_dir, setup))


def _train(run: Run) -> TrainResult:
    config = run.config
    started, resumed_at = time.perf_counter(), run.step
    if config.run.progress and run.ranks.writer:
        for note in run.setup_notes:
            print(note, file=sys.stderr)
    if run.step == 0:
        run.metrics.append(evaluate_lengths(run))  # the base model
    progress = progress_bar(range(run.step, config.run.steps), show=config.run.progress and run.ranks.writer,
                            description=f"{config.objective.name} on {config.run.task}", total=config.run.steps)
    for step in progress:
        step_started = time.perf_counter()
        phases = PhaseMeter(run.device)  # each phase's seconds, peak memory and compile time
        if step == resumed_at and run.compiled_rollouts:  # the first rollout of the process compiles its step
            progress.set_postfix_str("compiling the rollouts' denoising step")

        # 1-2. Prompts (this rank's share), then G rollouts each.
        examples = run.data.take(config.run.prompts_per_step)[run.share]
        group_size = run.rollouts_per_prompt  # --group-size, or a tree objective's leaves per prompt
        if run.pairs is not None:  # -- preference pairs (vrpo_dpo; train/pairs.py): the task's stored pairs are
            batch, correct = run.pairs.step(examples)  # the batch; no rollout, no reward
            rollout, rollout_seconds = None, 0.0
        else:
            with phases.phase("rollout"):
                rollout, completions, rollout_seconds = run.roll_out(examples)

            # 3. Rewards and the batch the objective consumes.
            batch = run.rollout_batch(examples, rollout, completions)
            correct = [run.task.correct(examples[row // group_size], text) for row, text in enumerate(completions)]
        # MDPO trains on its rollouts' rewarded steps (Run.learner_batch); every other objective on the batch.
        learner = batch if rollout is None else run.learner_batch(examples, rollout, batch)

        # 4. The inner updates' plan: masks, and the old policy's lp where the policy will have moved.
        with phases.phase("scoring"):
            plan = run.plan_updates(learner)

        # 5. Inner updates: objective gradient, clip, AdamW, schedule.
        with phases.phase("update"), router_load(run.model) as load:  # experts' balance (MoE models)
            updates = [run.update(learner, update) for update in plan]
        run.after_step(phases.peak)  # FSDP2's gathered rollout copy: kept or freed by the measured peak

        pairs = sum(update.masks.num_sequences * update.masks.n_t for update in plan)
        row = step_metrics(step + 1, batch, correct, updates, rollout, rollout_seconds,
                           time.perf_counter() - step_started, run.schedule.get_last_lr()[0], phases, pairs,
                           run.batching.micro_batch)
        row.update(load.metrics())
        row.update(expert_rank_load(load, getattr(run, "expert_group", None), run.ranks))  # --expert-parallel: each rank's share
        run.step = step + 1
        if run.step % config.eval.every == 0 or run.step == config.run.steps:
            row.update(evaluate_lengths(run))
        row = run.ranks.average(row)
        run.metrics.append(row)
        compiled = {"compile": f"{row['compile_seconds']:.1f}s"} if row["compile_seconds"] > 0 else {}
        progress.set_postfix(reward=f"{row['reward_mean']:.3f}", accuracy=f"{row['accuracy']:.3f}", **compiled)
        if run.step % config.run.checkpoint_every == 0 or run.step == config.run.steps:
            save_checkpoint(run)

    base, final = run.metrics.accuracies()
    result = TrainResult(run.output_dir, base, final, run.step, time.perf_counter() - started, run.metrics.history,
                         run.ranks.rank, resumed_at)
    if config.run.plot and run.ranks.writer:
        plot_curves(result.history, run.run_dir.path(PLOT))
    return result
