"""A step on N GPUs under torchrun (--parallel ddp or fsdp2): one rank's plan from the single-process one.

Each rank rolls out its own share of the step's prompts (train/run.py), so the rank's step is the planner's step
at prompts_per_step / N; this module turns that plan into the rank's memory and time on one GPU of N.

Memory at each phase's peak (train/distributed.py's wrappers):

- FSDP2 (`fully_shard` on each of the model's shard_units(), then the root): the policy's parameters, the
  gradients and the AdamW state are 1/N each (and so are the optimizer step's temporaries: AdamW runs on the
  local shards). Unsharded at once, in a phase where the policy runs: the root's unit (what is outside the shard
  units: embedding, final norm, LM head; FSDP2 keeps the root unsharded from forward to backward) and two layer
  units, the one computing and the one prefetched (the largest, in the dtype it is stored in); in a phase with a
  backward also their unsharded gradients before the reduce-scatter. An update of more than one backward
  accumulates unsharded gradients (the engine runs every micro-batch but the last under
  set_requires_gradient_sync(False), likelihood/engine.py), so there the gradients stay whole. The reference copy
  is not wrapped (train/run.py wraps the policy only): it stays whole on every rank.
- DDP: every rank holds the whole model, plus the reducer's buckets, which hold a copy of every trained
  gradient (DistributedDataParallel's default gradient_as_bucket_view=False), counted as gradients.

Time: the rank's compute at its share, plus communication overlapped with it (phase seconds = max(compute,
communication)), at the GPU's `interconnect` bus bandwidth (gpus.py: an assumption, not fitted):

- FSDP2: every call of the policy all-gathers its weights ((N-1)/N x their bytes in the stored dtype; in the
  rollout every denoising forward), every backward all-gathers them again, and each optimizer step's gradients are
  reduce-scattered once ((N-1)/N x the trained bytes);
- DDP: one all-reduce of the trained gradients per optimizer step (2 (N-1)/N x their bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from dllm_fast.planning.accounting import CATEGORIES
from dllm_fast.planning.step import PhasePlan, Session
from dllm_fast.train import step as train_step
from dllm_fast.train.config import TrainConfig

PARALLEL = ("ddp", "fsdp2")


def rank_config(config: TrainConfig, world: int) -> TrainConfig:
    """The step one rank of `world` runs: its share of the prompts. Refuses, naming the flags, a world below 1,
    prompts that do not split evenly, and FSDP2 with threshold decoding (as train refuses them)."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"--gpus {world!r} must be a whole number of GPUs, at least 1.")
    if world == 1:
        return config
    prompts = config.run.prompts_per_step
    if prompts % world:
        raise ValueError(f"--prompts-per-step {prompts} must be a multiple of --gpus {world}: each rank rolls out "
                         "its own complete prompt groups (train refuses it under torchrun too).")
    if config.run.parallel == "fsdp2" and config.rollout.threshold is not None:
        raise ValueError("--threshold decoding takes a different number of model calls on each rank, which FSDP2's "
                         "sharded forwards cannot; use a fixed schedule (--diffusion-steps) or --parallel ddp.")
    return config.replace(prompts_per_step=prompts // world)


@dataclass(frozen=True)
class Layout:
    """The policy's bytes as FSDP2 shards them, each in the dtype the session stores it in: all parameters, the
    trained ones (their gradients), the root's unit (what no shard unit holds) and the largest shard unit."""

    parameters: int
    trained: int
    root: int
    root_trained: int
    unit: int
    unit_trained: int


def layout(session: Session) -> Layout:
    def size(parameters, trained_only=False):
        return sum(p.numel() * p.element_size() for p in parameters if p.requires_grad or not trained_only)

    policy = session.policy
    units = [list(unit.parameters()) for unit in policy.shard_units()]
    in_units = {id(p) for unit in units for p in unit}
    root = [p for p in policy.parameters() if id(p) not in in_units]
    largest = max(units, key=size, default=[])
    return Layout(size(policy.parameters()), size(policy.parameters(), True), size(root), size(root, True),
                  size(largest), size(largest, True))


def per_gpu(phases: dict[str, PhasePlan], session: Session, world: int, parallel: str,
            interconnect: float | None) -> tuple[dict[str, float], list[str]]:
    """Turn the rank's `phases` (planned at its share of the prompts) into one GPU's of `world`, in place: memory
    at each peak and the communication each phase overlaps with its compute (seconds added where communication is
    longer). Returns the communication seconds by phase (None bandwidth: no time) and the notes."""
    if parallel not in PARALLEL:
        raise ValueError(f"--parallel {parallel!r} is not one of {', '.join(PARALLEL)}.")
    shape = layout(session)
    spread = (world - 1) / world
    updates = phases[train_step.OPTIMIZER_STEP].runs
    communication = {}
    for name, phase in phases.items():
        if not phase.runs:
            continue
        memory = dict(phase.memory)
        if parallel == "fsdp2":
            backward = phase.grad_forwards > 0
            held = shape.root + 2 * shape.unit if phase.forwards else 0
            whole = max(0, memory["parameters"] - shape.parameters)  # the reference copy, buffers
            memory["parameters"] = whole + -(-shape.parameters // world) + held
            accumulated = phase.grad_forwards > phase.runs  # several backwards an update: unsharded, whole
            if not accumulated:
                memory["gradients"] = -(-memory["gradients"] // world)
                if backward:
                    memory["gradients"] += shape.root_trained + 2 * shape.unit_trained
            memory["optimizer_state"] = -(-memory["optimizer_state"] // world)
            if name == train_step.OPTIMIZER_STEP:
                memory["temporaries"] = -(-memory["temporaries"] // world)
            moved = spread * (shape.parameters * (phase.forwards + phase.grad_forwards)
                              + (shape.trained * updates if name == "inner update" else 0))
        else:
            memory["gradients"] += shape.trained  # the reducer's buckets
            moved = 2 * spread * shape.trained * updates if name == "inner update" else 0.0
        phase.peak += sum(memory[c] for c in CATEGORIES) - sum(phase.memory[c] for c in CATEGORIES)
        phase.memory = memory
        if interconnect:
            seconds = moved / interconnect
            communication[name] = seconds
            phase.costs.closed += max(0.0, seconds - phase.costs.seconds)
    notes = [_memory_note(parallel, world, shape), _time_note(parallel, interconnect)]
    return communication, notes


def _memory_note(parallel: str, world: int, shape: Layout) -> str:
    if parallel == "ddp":
        return (f"DDP on {world} GPUs: each rank plans its share of the prompts with the whole model; gradients add "
                f"the reducer's buckets, a copy of every trained gradient ({shape.trained / 1e9:.2f} GB, DDP's "
                "default gradient_as_bucket_view=False)")
    return (f"FSDP2 on {world} GPUs: each rank plans its share of the prompts; the policy's parameters, gradients "
            "and AdamW state (and the optimizer step's temporaries) at 1/N; where the policy runs, unsharded at once: "
            f"the root's unit ({shape.root / 1e9:.2f} GB: embedding, norm, head) and two of the largest layer unit "
            f"({shape.unit / 1e9:.2f} GB each: the one computing and the one prefetched), and in a backward their "
            "gradients; an update of several backwards accumulates unsharded gradients (set_requires_gradient_sync("
            "False) until the last), so there gradients stay whole; the reference copy is not sharded "
            "(train wraps the policy only); activations, KV cache and other temporaries as the rank's own step")


def _time_note(parallel: str, interconnect: float | None) -> str:
    if not interconnect:
        return "communication: no time (no GPU, or its interconnect is unknown in planning/gpus.py)"
    what = ("each call of the policy all-gathers its weights ((N-1)/N of their bytes, stored dtype; every "
            "denoising forward of the rollout), each backward again, and each optimizer step reduce-scatters the "
            "trained gradients" if parallel == "fsdp2" else
            "one all-reduce of the trained gradients per optimizer step (2 (N-1)/N of their bytes)")
    return (f"communication: {what}, at {interconnect / 1e9:.0f} GB/s bus bandwidth (an assumption, not fitted: "
            "about 80% of one direction of the GPU link, planning/gpus.py), overlapped with compute: a phase takes "
            "max(compute, communication); collectives' latency not counted")
