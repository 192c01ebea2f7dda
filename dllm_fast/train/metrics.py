"""What a run reports: one metrics row per step (reward, accuracy, the objective's stats, lengths, tokens/s,
memory), written as JSONL by rank 0; the progress bar; and the PNG of the curves at the end."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import torch

from dllm_fast.files import atomic_path, write_text_atomic
from dllm_fast.memory import peak_rss_bytes, reset_peak_rss

METRICS = "metrics.jsonl"
PLOT = "curves.png"


class MetricsLog:
    """Every row of the run (`history`), appended to metrics.jsonl in the run directory by the writing rank."""

    def __init__(self, run_dir):
        self.run_dir, self.writer = run_dir, run_dir.ranks.writer
        self.history: list[dict] = []

    def start(self) -> None:
        """A new run: an empty file."""
        if self.writer:
            write_text_atomic(self.run_dir.path(METRICS), "")

    def restart(self, history: list[dict]) -> None:
        """A resumed run: the checkpoint's rows (the file may hold steps written after it, before a crash)."""
        self.history = list(history)
        if self.writer:
            write_text_atomic(self.run_dir.path(METRICS), "".join(json.dumps(row) + "\n" for row in self.history))

    def append(self, row: dict) -> None:
        self.history.append(row)
        if self.writer:
            with open(self.run_dir.path(METRICS), "a") as f:
                f.write(json.dumps(row) + "\n")

    def accuracies(self) -> tuple[dict[int, float], dict[int, float]]:
        """Greedy test accuracy per generation length at the first and at the last evaluation."""
        evals = [row for row in self.history if any(k.startswith("eval_accuracy@") for k in row)]
        accuracy = lambda row: {int(k.split("@")[1]): v for k, v in row.items() if k.startswith("eval_accuracy@")}  # noqa: E731
        return (accuracy(evals[0]), accuracy(evals[-1])) if evals else ({}, {})


def step_metrics(step, batch, correct, updates, rollout, rollout_seconds, seconds, lr, phases: "PhaseMeter",
                 update_pairs: int, micro_batch: int) -> dict:
    """One step's row: rollout rewards and accuracy, the inner updates' stats averaged, lengths, speed (rollout
    tokens/s, 0 for a step of stored preference pairs, rollout None; update pairs/s: the (sequence, sample) pairs of the mu inner updates per second of the scoring and
    update phases), torch.compile's seconds in the step, and the peak memory of the step and of each phase."""
    rewards = batch.rewards.double()
    averaged = {k: sum(u[k] for u in updates) / len(updates) for k in updates[0]}
    update_seconds = phases.seconds.get("scoring", 0.0) + phases.seconds.get("update", 0.0)
    return {
        "step": step,
        "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "accuracy": sum(correct) / len(correct),
        **averaged,
        "completion_length": float(batch.completion_lengths.double().mean()),
        "rollout_tokens_per_s": 0.0 if rollout is None else rollout.completion_ids.numel() / max(rollout_seconds, 1e-9),
        "rollout_seconds": rollout_seconds, "step_seconds": seconds,
        "update_pairs": update_pairs, "update_seconds": update_seconds,
        "update_pairs_per_s": update_pairs / max(update_seconds, 1e-9), "micro_batch": micro_batch,
        "compile_seconds": sum(phases.compile_seconds.values()),
        "lr": lr, "peak_memory_mib": max(phases.peak.values(), default=0) / 2**20,
        **{f"peak_memory_{name}_mib": peak / 2**20 for name, peak in phases.peak.items()},
    }


class PhaseMeter:
    """Per phase of a step (rollout, scoring, update): wall seconds, the peak memory (CUDA's max_memory_allocated,
    or the process's peak resident set on CPU, each reset when the phase starts) and the seconds torch.compile
    spent compiling in it. On CUDA the phase ends by waiting for the device, so its seconds are its work's."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}
        self.peak: dict[str, int] = {}
        self.compile_seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        reset_peak_memory(self.device)
        compiling, started = compile_seconds(), time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started
        self.peak[name] = max(self.peak.get(name, 0), peak_memory(self.device))
        self.compile_seconds[name] = self.compile_seconds.get(name, 0.0) + compile_seconds() - compiling


def compile_seconds() -> float:
    """Wall seconds this process has spent in torch.compile so far (dynamo and inductor, every frame: torch's own
    compilation metrics). A compiled function's first call pays them; CUDA graph capture, on its first replays,
    is not included."""
    if "torch._dynamo" not in sys.modules:  # nothing compiled yet (and importing dynamo takes a second)
        return 0.0
    from torch._dynamo.utils import compilation_time_metrics

    return sum(compilation_time_metrics.get("_compile.compile_inner", []))


class _Silent:
    def __init__(self, steps):
        self.steps = steps

    def __iter__(self):
        return iter(self.steps)

    def set_postfix(self, **values) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass


def progress_bar(steps: range, *, show: bool, description: str, total: int):
    """A tqdm bar over `steps` (starting at a resumed step), or a silent iterator."""
    if not show:
        return _Silent(steps)
    from tqdm.auto import tqdm

    return tqdm(steps, desc=description, unit="step", initial=steps.start, total=total)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with contextlib.suppress(OSError):
            reset_peak_rss()


def peak_memory(device: torch.device) -> int:
    """Bytes: CUDA's peak allocation, or the process's peak resident set on CPU (0 where unknown)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    with contextlib.suppress(OSError, RuntimeError):
        return peak_rss_bytes()
    return 0


def plot_curves(history: list[dict], path: Path) -> Path:
    """Training reward and accuracy per step, and greedy test accuracy at each evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in history if "reward_mean" in r]
    evals = [r for r in history if any(k.startswith("eval_accuracy@") for k in r)]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot([r["step"] for r in steps], [r["reward_mean"] for r in steps], label="rollout reward")
    left.plot([r["step"] for r in steps], [r["accuracy"] for r in steps], label="rollout accuracy")
    left.set_xlabel("step")
    left.set_title("training rollouts")
    left.legend()
    for key in sorted({k for r in evals for k in r if k.startswith("eval_accuracy@")}):
        points = [(r["step"], r[key]) for r in evals if key in r]
        right.plot(*zip(*points), marker="o", label=f"greedy, {key.split('@')[1]} tokens")
    right.set_xlabel("step")
    right.set_title("test accuracy")
    right.legend()
    figure.tight_layout()
    try:
        with atomic_path(path) as tmp:  # the library's rules for writes: atomic, never through a link leaving
            figure.savefig(tmp, dpi=100, format="png")
    finally:
        plt.close(figure)
    return path
