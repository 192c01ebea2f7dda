"""`plan_step`: plan one trainer step of a TrainConfig on a GPU, with the verdict and the largest settings that fit.

How the step is run (all on fake tensors, see step.py):

- the rollout once, at the configured group size;
- the phases after it (old-policy and reference scoring, the inner updates, the optimizer steps) at the configured
  n_t when it is small; otherwise at two small n_t, from which each phase is extrapolated to the configured one
  (fit.py: their work and memory are affine in the number of pairs once every kind of micro-batch has run). The
  report says which phases were extrapolated, and from which n_t.

The largest settings that fit (search.py) come from the same kind of fits, each checked where a check is cheap.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field

import torch

from dllm_fast import objectives
from dllm_fast.likelihood import MicroBatching
from dllm_fast.planning.accounting import Target
from dllm_fast.planning.fit import extrapolate
from dllm_fast.planning.gpus import GPU, gpu as gpu_named
from dllm_fast.planning.layout import ParallelSettings
from dllm_fast.planning.parallel import ParallelPlan, Sizes, layout, per_gpu, rank_config
from dllm_fast.planning.step import (PHASES, UPDATE_PHASES, PhasePlan, Session, fixed_n_t, one_pass, probe_n_t,
                                     two_pass_line)
from dllm_fast.train.config import TrainConfig, micro_batching
from dllm_fast.train.precision import training_precision
from dllm_fast.train.settings import AUTO, DEFAULT_MICRO_BATCH

WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Plan:
    """A planned step. phases: by name (see step.PHASES), each with its peak memory by category and its costs.
    capacity: the GPU's memory (None on CPU). largest: the largest n_t, micro_batch and group_size that fit, each
    with the others as configured (None: not even the smallest fits; absent: not searched). notes: how the plan
    was made (extrapolations, assumptions), one line each."""

    config: TrainConfig
    gpu: GPU | None
    engine: str
    weights_dtype: str
    prompt_length: int
    phases: dict[str, PhasePlan]
    shapes: dict
    nfe: int
    weight_bytes: int
    autocast: bool = False  # bf16 autocast around the forwards
    compiled: bool = False  # rollouts as CUDA graphs (scoring compiles only under --compile true)
    largest: dict[str, int | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    world: int = 1  # GPUs under torchrun: the plan is one rank's (its share of the prompts), see parallel.py
    parallel: str | None = None  # "ddp" or "fsdp2" when world > 1
    communication: dict[str, float] = field(default_factory=dict)  # seconds of collectives by phase (world > 1)
    parallel_plan: ParallelPlan | None = None  # collectives by phase, the rollout's path, ... (world > 1)

    @property
    def peak(self) -> int:
        return max((p.peak for p in self.phases.values() if p.runs), default=0)

    @property
    def capacity(self) -> int | None:
        return None if self.gpu is None else self.gpu.memory

    @property
    def fits(self) -> bool | None:
        return None if self.capacity is None else self.peak <= self.capacity

    @property
    def step_seconds(self) -> float:
        return sum(p.costs.seconds for p in self.phases.values() if p.runs)

    @property
    def roofline_seconds(self) -> float:
        """The step's datasheet floor: every kernel at its peak, launches free."""
        return sum(p.costs.roofline_seconds for p in self.phases.values() if p.runs)

    @property
    def weight_streaming_floor(self) -> float | None:
        """The rollout's lower bound from reading the weights once per forward: nfe * weight bytes / bandwidth."""
        return None if self.gpu is None else self.nfe * self.weight_bytes / self.gpu.bandwidth


def plan_step(config: TrainConfig, *, gpu: str | GPU | None = "h100", prompt_length: int | None = None,
              engine: str = "streaming", weights_dtype: str | None = None, search: bool = True,
              allow_tf32: bool = False, world: int = 1, parallel: ParallelSettings | None = None) -> Plan:
    """Plan one step of `config` on `gpu` (a name from planning.GPUS; None plans for this machine's CPU, without
    a time). prompt_length: tokens per prompt (default: the task's longest training prompt under the configured
    tokenizer). engine: "streaming" (the trainer's), "two_pass" (the streaming engine without its one-pass route
    for sequence-local objectives: MicroBatching(one_pass=False)) or "all_graphs" (every pair's graph at once).
    weights_dtype:
    None (what train loads: dllm_fast.train.precision), "float32" or "bfloat16" (every weight, gradient and
    optimizer state in that dtype). search: also find the largest n_t, micro-batch and group size that fit.
    --compile plans what train compiles: rollouts under true, or auto on a GPU; scoring under true only.
    world: GPUs under torchrun, with config.run.parallel ("ddp" or "fsdp2"): the plan is one GPU's, its rank's
    share of the prompts (planning/parallel.py; the search is left out). parallel: the step on several GPUs in full
    (GPUs a node, expert parallelism, offload, the rollout's weights, the links: layout.ParallelSettings; default:
    `world` GPUs in config.run.parallel's mode, the rest as train runs it)."""
    started = time.perf_counter()
    if parallel is None:
        parallel = parallel_settings(config, world=world)
    world = parallel.world
    total = config
    config = rank_config(config, world)
    if weights_dtype is not None and weights_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weights_dtype={weights_dtype!r} is not one of {', '.join(WEIGHT_DTYPES)} (or None: "
                         "what train loads).")
    if isinstance(gpu, str):
        gpu = gpu_named(gpu)
    target = Target("cpu") if gpu is None else Target("cuda", gpu, allow_tf32=allow_tf32)
    if prompt_length is None:
        prompt_length = task_prompt_length(config)
    stored = training_precision(config, target.device_type,
                                weights=None if weights_dtype is None else WEIGHT_DTYPES[weights_dtype])
    # FSDP2 under bf16 autocast gathers bf16 weights (MixedPrecisionPolicy): the rank computes on those
    sharded_bf16 = world > 1 and parallel.parallel == "fsdp2" and stored.compute is not None
    session = Session(config, target=target, engine=engine,
                      weights_dtype=torch.bfloat16 if sharded_bf16 else stored.trainable if weights_dtype else None,
                      expert_parallel=parallel.expert_parallel)
    weights_dtype = str(stored.trainable).removeprefix("torch.")
    # --micro-batch auto: planned at the default; the search's largest is what train fits (train/micro_batch.py)
    batching = micro_batching(config, auto=DEFAULT_MICRO_BATCH)
    if engine == "two_pass":
        batching = dataclasses.replace(batching, one_pass=False)
    shape = getattr(session.objective, "tree_shape", lambda: None)()
    if shape is not None:  # d_treerpo: its trees decode as train checks them (rollout/tree.py), before any work
        from dllm_fast.rollout.tree import check_tree_rollouts

        try:
            check_tree_rollouts(session.base, session.generate_config, shape)
        except ValueError as error:
            raise ValueError(f"--objective {config.objective.name} with --model {config.model.name!r}: "
                             f"{error}") from None
    asked = batching
    batching = within_the_pairs(config, batching)
    n_t = session.objective.config.n_t
    check_plannable(config, prompt_length, session.base, batching)
    with _readable_data_errors(), session:
        rollout = session.rollout(prompts=config.run.prompts_per_step, group_size=config.run.group_size,
                                  prompt_length=prompt_length)
        probes = probe_n_t(config, rollout.batch.num_rollouts, batching.micro_batch)
        direct = one_pass(config, batching.micro_batch, n_t, allowed=batching.one_pass)
        if direct:  # the engine's one pass: planned at n_t itself (it is not on the two-pass line of the probes)
            updates = session.updates(rollout.batch, n_t=n_t, batching=batching)
        line = two_pass_line(batching)
        fresh = session.updates(rollout.batch, n_t=probes[0], batching=line)
        if probes[0] == probes[1]:  # a fixed n_t: planned as configured, nothing to extrapolate
            runs = {probes[0]: fresh}
        else:
            runs = {x: session.updates(rollout.batch, n_t=x, batching=line) for x in probes}
        if direct:
            pass
        elif n_t == probes[0]:
            updates = fresh
        else:
            updates = {name: extrapolate(runs[probes[0]][name], runs[probes[1]][name], *probes, n_t, fresh[name])
                       for name in UPDATE_PHASES}
        plan = Plan(config, gpu, engine, weights_dtype, prompt_length, {"rollout": rollout.phase, **updates},
                    dict(rollouts=getattr(rollout.batch, "rollouts", rollout.batch.num_rollouts),  # MDPO: not its rows
                         prompt_length=prompt_length,
                         completion_length=config.rollout.gen_length, n_t=n_t, pairs=rollout.batch.num_rollouts * n_t,
                         micro_batch=batching.micro_batch, score_micro_batch=batching.scoring,
                         **({} if shape is None else {"tree": dict(edges=shape.edges_per_prompt(),  # d_treerpo
                                                                   leaves=shape.leaves_per_prompt())})),
                    rollout.nfe, session.weight_bytes, autocast=session.bf16, compiled=session.compile)
        plan.notes += _notes(plan, probes, n_t, session)
        if getattr(session.objective, "needs_step_predictions", False):  # MDPO's step record and step batch
            plan.notes.append(f"{config.objective.name}: the rollout records every forward's prediction and "
                              f"confidences ({rollout.nfe} steps x rollouts x gen_length, int64 + fp32, in its "
                              f"peak); the updates train on {rollout.batch.num_rollouts} step rows (the top-k steps "
                              "of each rollout); its reward of every step (K calls per rollout) is host work, not "
                              "planned")
        if shape is not None:  # d_treerpo's tree and its edge batch
            plan.notes.append(f"{config.objective.name}: a tree per prompt ({shape.root_children} root children, "
                              f"branch {shape.branch}, {shape.contraction} levels: {shape.edges_per_prompt()} edges "
                              f"and {shape.leaves_per_prompt()} leaves; --group-size is not used), one resumed "
                              f"generate call per level ({rollout.nfe} forwards in all, on each level's nodes); the "
                              f"updates score {rollout.batch.num_rollouts} edges once each, on the parent's canvas; "
                              f"the leaves' rewards ({shape.leaves_per_prompt()} a prompt) are host work, not planned")
        if asked != batching:
            plan.notes.append(f"--micro-batch {asked.micro_batch} (scoring {asked.scoring}) is more than the step's "
                              f"{step_pairs(config)} (sequence, sample) pairs: planned at {batching.micro_batch} "
                              f"(scoring {batching.scoring}), as the engine runs it, every pair in one micro-batch")
        if world > 1:
            plan.config, plan.world, plan.parallel = total, world, parallel.parallel
            sizes = _sizes(stored, session, sharded_bf16)
            plan.parallel_plan = per_gpu(plan.phases, layout(session), parallel, gpu, sizes,
                                         checkpointing=config.model.gradient_checkpointing)
            plan.communication = plan.parallel_plan.communication
            plan.notes += plan.parallel_plan.notes
            if search:
                plan.notes.append("largest settings: not searched on several GPUs (plan them with --gpus 1, or "
                                  "plan each candidate)")
        elif search and gpu is not None:
            from dllm_fast.planning.search import largest_settings

            plan.largest, search_notes = largest_settings(session, plan, rollout, runs, probes, line, fresh)
            plan.notes += search_notes
    plan.seconds = time.perf_counter() - started
    return plan


def parallel_settings(config: TrainConfig, *, world: int = 1, **options) -> ParallelSettings:
    """The ParallelSettings of a run of `config` on `world` GPUs: its --parallel and --rollout-weights, and its
    --expert-parallel, --fsdp-offload and --reference-offload where the configuration has them (--expert-parallel
    on several GPUs: a one-GPU plan, e.g. train's --micro-batch auto fit, is of the rank with every expert);
    `options` set any field."""
    flat = config.flat()
    values = dict(world=world, parallel=config.run.parallel, rollout_weights=flat.get("rollout_weights", "auto"))
    for key in ("expert_parallel", "fsdp_offload", "reference_offload"):
        if key in flat and (key != "expert_parallel" or world > 1):
            values[key] = flat[key]
    return ParallelSettings(**{**values, **options})


def _sizes(stored, session: Session, sharded_bf16: bool) -> Sizes:
    """Bytes an element takes, stored as train stores it (`stored`: train/precision.py's dtypes, or every weight in
    --weights-dtype) and gathered, reduced and computed as FSDP2 does (MixedPrecisionPolicy under bf16 autocast:
    gathers in bf16, reductions in fp32)."""
    trained, frozen = stored.trainable.itemsize, stored.frozen.itemsize
    return Sizes(trained=trained, frozen=frozen, gather=2 if sharded_bf16 else 0, reduce=max(4, trained),
                 activation=2 if stored.compute is not None else trained,
                 session_trained=session.precision.trainable.itemsize)


# Bounds on what one plan runs, so that every configuration gets an answer or a refusal in bounded time (a
# replayed micro-batch or denoising step costs tens of milliseconds of CPU on fake tensors).
MAX_PLANNED_FORWARDS = 1024  # denoising steps of the rollout (an 8B step: about a minute of CPU)
MAX_PLANNED_CALLS = 1024  # scoring and update micro-batches, over the inner updates, at the larger probe n_t
UNBOUNDED_POSITIONS = 1 << 16  # for a model that states no max_sequence_length


def step_pairs(config: TrainConfig) -> int:
    """The (sequence, sample) pairs of one update of the step: n_t a rollout; for an objective whose samples follow
    from the rollout (fixed_n_t), a bound: a decoding state each denoising step at most, or one a completion
    position. An objective on stored preference pairs scores two completions a prompt."""
    objective = objectives.get(config.objective.name, **config.objective.options)
    objective_config, G = objective.config, config.rollout.gen_length
    rollouts = config.run.prompts_per_step * rollouts_per_prompt(objective, config)
    if getattr(objective, "needs_step_predictions", False):  # MDPO trains on top-k step rows of each rollout
        rollouts *= objective_config.top_k_steps
    if not fixed_n_t(config):
        return rollouts * objective_config.n_t
    steps = config.rollout.decoding_steps()  # ASS derives its own count
    forwards = G if config.rollout.threshold is not None or steps is None else steps
    return rollouts * (G if objective_config.sampler == "autoregressive" else forwards)


def rollouts_per_prompt(objective, config: TrainConfig) -> int:
    """The sequences an update scores per prompt: --group-size rollouts; two stored completions for an objective
    on preference pairs (vrpo_dpo); a tree objective's edges (d_treerpo: every edge of the prompt's tree)."""
    if objective.preference_pairs:
        return 2
    shape = getattr(objective, "tree_shape", lambda: None)()
    return config.run.group_size if shape is None else shape.edges_per_prompt()


def within_the_pairs(config: TrainConfig, batching: MicroBatching) -> MicroBatching:
    """`batching` with a micro-batch (and a scoring one) above the step's pairs (step_pairs) lowered to them: the
    engine runs every pair in one micro-batch either way, so the plan is the same, in the same time (planned at the
    micro-batch as given, the probes' n_t grow with it: a plan of 100,000 pairs a micro-batch for 64 pairs)."""
    pairs = step_pairs(config)
    scoring = batching.score_micro_batch
    return dataclasses.replace(batching, micro_batch=min(batching.micro_batch, pairs),
                               score_micro_batch=None if scoring is None else min(scoring, pairs))


def check_plannable(config: TrainConfig, prompt_length: int, model, batching: MicroBatching) -> None:
    """Refuse, naming the flags, a step that cannot run (prompt and completion beyond the model's positions, as
    train refuses it) or that the planner cannot plan in bounded time and memory (see the bounds above)."""
    from dllm_fast.planning.fake import DEFAULT_CONSTANT_BYTES

    positions = getattr(model, "max_sequence_length", None) or UNBOUNDED_POSITIONS
    G = config.rollout.gen_length
    if G >= positions:
        raise ValueError(f"--gen-length {G} leaves no room for a prompt: the model has {positions} positions "
                         "(max_sequence_length); lower --gen-length.")
    if prompt_length + G > positions:
        raise ValueError(f"--prompt-length {prompt_length} with --gen-length {G} needs {prompt_length + G} "
                         f"positions; the model has {positions} (max_sequence_length). Lower --prompt-length "
                         f"(at most {positions - G} with this --gen-length) or --gen-length.")
    forwards = G if config.rollout.threshold is not None else config.rollout.decoding_steps()
    if forwards > MAX_PLANNED_FORWARDS:
        raise ValueError(f"the rollout runs {forwards} denoising steps (--diffusion-steps, or --gen-length under "
                         f"--threshold), more than the {MAX_PLANNED_FORWARDS} a plan replays; plan fewer steps "
                         "(the rollout's time is about linear in them).")
    objective = objectives.get(config.objective.name, **config.objective.options)
    rollouts, length = config.run.prompts_per_step * rollouts_per_prompt(objective, config), prompt_length + G
    if fixed_n_t(config):  # the rollout's decoding states (one per `shrink` steps), or one per position
        objective_config = objectives.get(config.objective.name, **config.objective.options).config
        samples = G if objective_config.sampler == "autoregressive" else -(-forwards // max(1, objective_config.shrink))
    else:
        samples = probe_n_t(config, rollouts, batching.micro_batch)[1]
    pairs = rollouts * samples
    if max(rollouts * length * 8, pairs * length) > DEFAULT_CONSTANT_BYTES:
        raise ValueError(f"{rollouts} rollouts (--prompts-per-step x --group-size) of {length} tokens, with "
                         f"{pairs} (sequence, sample) pairs to plan the updates at, exceed the token ids and masks "
                         f"a plan keeps as real data ({DEFAULT_CONSTANT_BYTES >> 20} MiB each); plan fewer "
                         "rollouts per step (the step's costs grow about linearly with them).")
    calls = config.objective.inner_updates * (-(-pairs // batching.micro_batch) + 3 * -(-pairs // batching.scoring))
    if calls > MAX_PLANNED_CALLS:
        raise ValueError(f"planning this step would run about {calls} scoring and update micro-batches on fake "
                         f"tensors ({pairs} pairs per update at n_t = {samples}, --micro-batch "
                         f"{batching.micro_batch}, --inner-updates {config.objective.inner_updates}), more than "
                         f"{MAX_PLANNED_CALLS}: minutes of CPU. Raise --micro-batch (and --score-micro-batch), or "
                         "plan fewer rollouts or --inner-updates 1 (each inner update costs the same).")


@contextlib.contextmanager
def _readable_data_errors():
    """A read of a value the fake model computed (a host sync on model output that the plan makes no assumption
    about) as one readable error."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        raise RuntimeError(f"the step reads a value the model computes ({error.func}), which a plan on fake tensors "
                           "cannot know; the planner assumes only finiteness checks, sampled tokens and log-probs "
                           "(dllm_fast/planning/fake.py). Make the read sync-free, or teach the planner the value "
                           "to assume.") from error


def task_prompt_length(config: TrainConfig, *, candidates: int = 32) -> int:
    """The longest training prompt of the task in tokens of the configured tokenizer, as train checks it, among
    the `candidates` longest in characters (tokenizing every prompt of a large task takes long)."""
    from dllm_fast.models.loading import load_tokenizer
    from dllm_fast.tasks import get_task
    from dllm_fast.train.config import task_options
    from dllm_fast.train.sources import model_source

    _, _, tokenizer_dir = model_source(config.model, config.lora)
    task = get_task(config.run.task, **task_options(config))
    tokenizer = load_tokenizer(tokenizer_dir)
    prompts = sorted({task.prompt(example, tokenizer) for example in task.train_examples(seed=config.run.seed)},
                     key=len, reverse=True)[:candidates]
    return max(len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"])


def _notes(plan: Plan, probes, n_t: int, session: Session) -> list[str]:
    notes = []
    calls = sum(p.calls_run for p in plan.phases.values())
    replayed = sum(p.calls_replayed for p in plan.phases.values())
    notes.append(f"model and block calls: {calls} run on fake tensors, {replayed} identical ones replayed from "
                 "a recorded call (denoising steps, micro-batches, blocks)")
    extrapolated = [name for name, p in plan.phases.items() if p.extrapolated_from]
    if extrapolated:
        notes.append(f"{', '.join(extrapolated)}: planned at n_t = {probes[0]} and {probes[1]} and fit to "
                     f"n_t = {n_t}: work affine in the number of pairs; memory grown linearly from the two plans, "
                     "which errs high (part of the growth, the largest micro-batch's masked rows, levels off)")
    if plan.gpu is not None:
        c = session.target.calibration
        notes.append(f"time (calibration {c.name}, dllm_fast/planning/calibration.py): each kernel's GEMMs at the "
                     f"peak of their operand type x its fitted efficiency (bf16 {c.tensor_core:.2f}, TF32 {c.tf32:.2f}, "
                     f"fp32 {c.fp32:.2f}), or its bytes at {c.bandwidth:.2f} x the bandwidth; the host launches each "
                     f"eager kernel in {c.eager_launch * 1e6:.0f} us"
                     + (f", a compiled rollout step's CUDA graph in {c.graph_launch * 1e3:.1f} ms" if plan.compiled
                        else "")
                     + "; host and device overlap between host syncs. No credit for fusion under torch.compile")
    notes.append("assumed: sampled tokens are never EOS (completions fill gen_length), every group's rewards differ "
                 "(every pair has a gradient weight), model outputs are finite"
                 + (", threshold decoding unmasks one token per step" if plan.config.rollout.threshold is not None
                    else ""))
    if plan.config.objective.micro_batch == AUTO:
        notes.append(f"--micro-batch auto: planned at {plan.shapes['micro_batch']}; on a GPU train takes the largest "
                     "that fits 90% of the free memory (the search's, dllm_fast/train/micro_batch.py)")
    if plan.autocast and session.precision.trainable == torch.float32:
        notes.append("weights as train keeps them on GPU (train/precision.py): trained weights in fp32, frozen ones "
                     "(a LoRA base, the reference copy) in bf16, bf16 autocast; autocast keeps a bf16 copy of "
                     "trainable fp32 weights for the duration of each phase (counted in temporaries)")
    return notes


__all__ = ["PHASES", "Plan", "WEIGHT_DTYPES", "plan_step", "task_prompt_length"]
