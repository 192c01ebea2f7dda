"""A step on N GPUs under torchrun (--parallel ddp or fsdp2): one GPU's memory and time from the rank's plan.

Each rank rolls out its own share of the step's prompts (train/run.py), so the rank's step is the planner's step
at prompts_per_step / N (with expert parallelism, on the rank's own experts: planning/layout.py); this module
turns that plan into one GPU's memory by category and its collectives per phase. Memory is counted from the
parameters' elements (layout.Layout) in the dtypes they are stored and gathered in; activations, the KV cache and
temporaries are the rank's plan's.

FSDP2, as issue 46 builds it (`fully_shard` on each of the model's shard_units(), then the root, on a mesh of the
N ranks; with expert parallelism N_e, the routed experts on the expert groups' mesh instead):

- MixedPrecisionPolicy with bf16 autocast (a GPU): parameters all-gathered in bf16, gradients reduce-scattered in
  fp32. So the rank's compute is planned on bf16 weights (no autocast casts: the gathered weights are bf16),
  while the shards keep their stored dtypes (fp32 master weights and AdamW state of a full fine-tune, a LoRA
  run's bf16 frozen base).
- Sharded, 1/N each: the policy's parameters, its gradients (reduce-scattered after every backward, never held
  whole) and AdamW's two moments; the reference copy of a full fine-tune, sharded like the policy, without
  optimizer state (a LoRA run's reference is the policy with its adapters off). A rank's routed experts under
  expert parallelism: E / N_e of them, sharded over the N / N_e expert groups (across nodes) when there are
  several. `--fsdp-offload true` (CPUOffloadPolicy): shards, gradients and AdamW state on the host; each unshard
  copies the shard host to device, each reduce-scatter's output goes back, AdamW runs on the host.
  `--reference-offload true`: the reference copy's shards alone on the host, copied in at each of its gathers.
- AdamW as train builds it (train/optimizer.py): fused on CUDA, so the optimizer step holds no temporary the size
  of the weights (torch's foreach AdamW would); the rank's planned step measures whichever it builds.
- Unsharded while a model runs on FSDP2's per-layer gathers: the root's unit (embedding, norm, head: FSDP2 keeps
  the root unsharded from forward to backward) and two of the largest layer unit (the one computing, the one
  prefetched), in the gather dtype; in a backward also their gradients, in the reduce dtype.
- The rollout, by the rule of train/rollout_weights.py (`rollout_path`): on a plain copy of the policy's weights
  gathered once a step (the dense weights, and a rank's own experts where they are sharded across nodes; LoRA's
  adapters merged in when merged rollouts are on) when the rollout's peak with the copy stays within ROLLOUT_MARGIN
  of the GPU; else on the per-layer gathers, the rank's whole batch in one forward a step (one gather serves it).
  The copy is kept between steps when every other phase's peak plus the copy stays within ROLLOUT_MARGIN, and
  freed after each rollout otherwise.

Collectives per phase (planning/links.py prices them; gathers and reduce-scatters overlap with compute, prefetched:
a phase takes max(compute, their time); all-to-alls, the gather-once copy's gather and host work do not):

- all-gather of a model's weights for every call of it (each denoising forward on the per-layer path; once per
  step on the gather-once path), again in each backward (FSDP2 reshards after forward): (N-1)/N of the dense
  weights over the N ranks, and (S-1)/S of a rank's experts over their S = N / N_e shards;
- reduce-scatter of the trained gradients after every backward, in fp32;
- all-to-all (expert parallelism): at every MoE layer of every forward the dispatch and the combine each move
  tokens x top_k x d activations, (N_e-1)/N_e of them off the rank, inside the node; a backward runs both again,
  and gradient checkpointing's recompute once more;
- host copies (offload): the shards in at every unshard, the gradients out after every reduce-scatter, and
  AdamW's step streaming 28 bytes a trained element through host memory (gpus.HOST_MEMORY_BANDWIDTH, shared by a
  node's ranks).

DDP: every rank holds the whole model, plus the reducer's buckets, which hold a copy of every trained gradient
(DistributedDataParallel's default gradient_as_bucket_view=False), counted as gradients; one all-reduce of the
trained gradients per optimizer step (2 (N-1)/N x their bytes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dllm_fast.planning.accounting import CATEGORIES
from dllm_fast.planning.gpus import GPU
from dllm_fast.planning.layout import PARALLEL, Elements, Layout, ParallelSettings, layout as elements_layout
from dllm_fast.planning.links import Links, all_gather, all_to_all, links as links_of
from dllm_fast.planning.step import PhasePlan, Session
from dllm_fast.train import step as train_step
from dllm_fast.train.config import TrainConfig
from dllm_fast.train.rollout_rule import ROLLOUT_MARGIN, keep_copy, rollout_path

ADAMW_BYTES = 28  # a trained fp32 element: AdamW reads the weight, its gradient and two moments, writes three


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
class Sizes:
    """Bytes an element takes: stored (trained, frozen), gathered by FSDP2, reduced, and as activations; and the
    trained dtype the rank's session planned in (its optimizer step is rescaled from it)."""

    trained: int
    frozen: int
    gather: int  # 2 under MixedPrecisionPolicy's bf16; None-like 0: each part in its stored dtype
    reduce: int
    activation: int
    session_trained: int

    def gathered(self, trained: Elements, frozen: Elements) -> tuple[float, float]:
        """(dense, experts) bytes of these parameters unsharded."""
        t, f = (self.gather, self.gather) if self.gather else (self.trained, self.frozen)
        return trained.dense * t + frozen.dense * f, trained.experts * t + frozen.experts * f


def layout(session: Session) -> Layout:
    """The Layout of a planning session's models."""
    return elements_layout(session.policy, session.reference, session.base,
                           merged_rollouts=session.config.lora.enabled and session.config.lora.merge_rollouts)


@dataclass
class Collectives:
    """One GPU's communication in a phase (over its runs): counts, bytes crossing its links, seconds."""

    all_gathers: int = 0
    all_gather_bytes: float = 0.0
    reduce_scatters: int = 0
    reduce_scatter_bytes: float = 0.0
    all_to_alls: int = 0
    all_to_all_bytes: float = 0.0
    all_reduces: int = 0
    all_reduce_bytes: float = 0.0
    host_bytes: float = 0.0
    overlapped: float = 0.0  # seconds hidden behind compute where compute is longer (prefetched collectives)
    exposed: float = 0.0  # seconds added to the phase whatever its compute (all-to-alls, a copy's gather, host)

    @property
    def seconds(self) -> float:
        return self.overlapped + self.exposed

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "seconds": self.seconds}


@dataclass
class ParallelPlan:
    """What parallel.per_gpu found: collectives by phase, the rollout's path and why, whether its copy is kept,
    the rollout's share of time in communication, the memory of alternatives that would fit, notes."""

    settings: ParallelSettings
    collectives: dict[str, Collectives] = field(default_factory=dict)
    rollout_path: str | None = None  # "gathered" or "sharded" (FSDP2), None otherwise
    rollout_reason: str = ""
    copy_bytes: int = 0
    copy_kept: bool = False
    keep_reason: str = ""
    rollout_communication_share: float | None = None
    alternatives: dict[str, int] = field(default_factory=dict)  # what would fit: peak bytes by setting
    host_bytes: int = 0  # host memory a rank's offloaded state takes
    notes: list[str] = field(default_factory=list)

    @property
    def communication(self) -> dict[str, float]:
        return {name: c.seconds for name, c in self.collectives.items()}


def per_gpu(phases: dict[str, PhasePlan], shape: Layout, settings: ParallelSettings, gpu: GPU | None,
            sizes: Sizes, *, checkpointing: bool = False) -> ParallelPlan:
    """Turn the rank's `phases` (planned at its share of the prompts, its models' parameters in `shape`) into one
    GPU's of `settings.world`, in place: memory at each peak, and each phase's time with its collectives (none
    without a GPU to time them). checkpointing: gradient checkpointing's recompute (it repeats the all-to-alls)."""
    if settings.parallel not in PARALLEL:
        raise ValueError(f"--parallel {settings.parallel!r} is not one of {', '.join(PARALLEL)}.")
    out = ParallelPlan(settings)
    wire = links_of(gpu, settings) if gpu is not None else None
    if settings.parallel == "ddp":
        _ddp(phases, shape, settings, sizes, wire, out, checkpointing)
        return out
    capacity = gpu.memory if gpu is not None else None
    rank_memory = {name: dict(phase.memory) for name, phase in phases.items()}
    out.copy_bytes = int(sum(_copy_bytes(shape, settings, sizes)))
    with_copy = {name: _fsdp2_memory(phase, rank_memory[name], shape, settings, sizes, "gathered", False)
                 for name, phase in phases.items() if phase.runs}
    rollout_peak = _peak(phases[train_step.ROLLOUT], with_copy[train_step.ROLLOUT])
    out.rollout_path, out.rollout_reason = rollout_path(settings.rollout_weights, out.copy_bytes, rollout_peak,
                                                        capacity)
    others = max((_peak(phases[name], memory) for name, memory in with_copy.items() if name != train_step.ROLLOUT),
                 default=0)
    out.copy_kept, out.keep_reason = (keep_copy(others, out.copy_bytes, capacity) if out.rollout_path == "gathered"
                                      else (False, ""))
    for name, phase in phases.items():
        if not phase.runs:
            continue
        memory = _fsdp2_memory(phase, rank_memory[name], shape, settings, sizes, out.rollout_path, out.copy_kept)
        phase.peak = _peak(phase, memory)
        phase.memory = memory
        if wire is not None:
            collectives = _fsdp2_collectives(name, phase, shape, settings, sizes, wire, out.rollout_path,
                                             checkpointing, gpu)
            out.collectives[name] = collectives
            compute = phase.costs.seconds
            if name == train_step.OPTIMIZER_STEP:  # AdamW on the shards (on the host when offloaded)
                compute = 0.0 if settings.fsdp_offload else compute * _shard_ratio(shape, settings, sizes)
                phase.costs.closed += compute - phase.costs.seconds
            phase.costs.closed += max(0.0, collectives.overlapped - compute) + collectives.exposed
    rollout = phases[train_step.ROLLOUT]
    if wire is not None and rollout.runs and rollout.costs.seconds > 0:
        out.rollout_communication_share = out.collectives[train_step.ROLLOUT].seconds / rollout.costs.seconds
    if settings.fsdp_offload:
        out.host_bytes = int(_shards(shape.trained, sizes.trained, shape, settings) * 4
                             + _shards(shape.frozen, sizes.frozen, shape, settings))
    if settings.reference_on_host:
        out.host_bytes += int(_shards(shape.reference, sizes.frozen, shape, settings))
    peak = max(p.peak for p in phases.values() if p.runs)
    if capacity is not None and peak > capacity:
        out.alternatives = _alternatives(phases, rank_memory, shape, settings, sizes, out.rollout_path)
    out.notes = _fsdp2_notes(shape, settings, sizes, out, wire)
    return out


# -- FSDP2's memory ------------------------------------------------------------------------------------------

def _shards(part: Elements, itemsize: int, shape: Layout, settings: ParallelSettings) -> float:
    """Bytes of one rank's shards of `part` stored at `itemsize`: the dense elements over every rank, a rank's
    experts over their shards."""
    return (-(-part.dense // settings.world) + -(-part.experts // settings.expert_shards)) * itemsize


def _held(trained: Elements, frozen: Elements, settings: ParallelSettings, sizes: Sizes, *,
          on_host: bool = False) -> float:
    """Bytes of these parameters unsharded: the dense ones, and the experts where FSDP2 shards them or they come
    from the host (`on_host`: this model's shards are offloaded)."""
    dense, experts = sizes.gathered(trained, frozen)
    return dense + (experts if _experts_move(settings) or on_host else 0)


def _experts_move(settings: ParallelSettings) -> bool:
    """Whether a rank's routed experts come to the GPU when used (FSDP2 shards them, or offloads them to the
    host), rather than staying whole on the rank as the policy's own modules."""
    return settings.expert_shards > 1 or settings.fsdp_offload


def _copy_bytes(shape: Layout, settings: ParallelSettings, sizes: Sizes) -> tuple[float, float]:
    """(dense, experts) bytes of the rollout's copy: the dense weights (merged under LoRA) and the rank's experts
    where they are sharded (across nodes) or offloaded; where they are neither, the copy uses the policy's own
    expert modules."""
    gather = sizes.gather or sizes.trained
    return shape.copy.dense * gather, (shape.copy.experts * gather if _experts_move(settings) else 0.0)


def _fsdp2_memory(phase: PhasePlan, rank: dict[str, int], shape: Layout, settings: ParallelSettings, sizes: Sizes,
                  path: str, kept: bool) -> dict[str, int]:
    calls = phase.model_calls
    policy_runs = calls["policy"] + calls["policy_grad"] > 0
    backward = calls["policy_grad"] > 0
    rollout = phase.name == train_step.ROLLOUT
    on_gpu = not settings.fsdp_offload
    memory = dict(rank)
    shards = 0.0
    if on_gpu:
        shards = (_shards(shape.trained, sizes.trained, shape, settings)
                  + _shards(shape.frozen, sizes.frozen, shape, settings))
    if not settings.reference_on_host:  # --reference-offload: the reference's shards on the host
        shards += _shards(shape.reference, sizes.frozen, shape, settings)
    held = 0.0
    copy = sum(_copy_bytes(shape, settings, sizes))
    if rollout and path == "gathered":
        held = copy
    else:
        if policy_runs:
            held += _held(shape.root_trained + shape.unit_trained.scaled(2),
                          shape.root_frozen + shape.unit_frozen.scaled(2), settings, sizes)
        if calls["reference"]:
            held += _held(Elements(), shape.reference_root + shape.reference_unit.scaled(2), settings, sizes,
                          on_host=settings.reference_on_host)
        if kept:
            held += copy
    memory["parameters"] = int(shape.buffers + shards + held)
    gradients = 0.0
    if rank["gradients"] > 0 or backward:
        if on_gpu:
            gradients += _shards(shape.trained, sizes.trained, shape, settings)
        if backward:  # the units in flight: their gradients unsharded, in the reduce dtype
            in_flight = shape.root_trained + shape.unit_trained.scaled(2)
            gradients += (in_flight.dense + (in_flight.experts if _experts_move(settings) else 0)) * sizes.reduce
    memory["gradients"] = int(gradients)
    memory["optimizer_state"] = int(2 * _shards(shape.trained, sizes.trained, shape, settings)
                                    if on_gpu and rank["optimizer_state"] > 0 else 0)
    if phase.name == train_step.OPTIMIZER_STEP:
        memory["temporaries"] = int(rank["temporaries"] * _shard_ratio(shape, settings, sizes)) if on_gpu else 0
    if _casts_experts(shape, settings, sizes) and policy_runs:  # one layer's experts cast to bf16 at a time
        memory["temporaries"] += int(shape.trained.experts / max(shape.moe_layers, 1) * sizes.activation)
    return memory


def _shard_ratio(shape: Layout, settings: ParallelSettings, sizes: Sizes) -> float:
    """A rank's trained shards' bytes over the trained weights' bytes in the rank's session: what scales its
    optimizer step (AdamW's time and foreach temporaries) to the shards."""
    planned = shape.trained.total * sizes.session_trained
    return _shards(shape.trained, sizes.trained, shape, settings) / planned if planned else 0.0


def _casts_experts(shape: Layout, settings: ParallelSettings, sizes: Sizes) -> bool:
    """Whether a forward casts the rank's own experts to the compute dtype: trained experts kept whole on their
    rank (expert parallelism within one node: FSDP2 does not gather, so no bf16 gather either) in fp32."""
    return bool(settings.expert_parallel > 1 and not _experts_move(settings) and shape.trained.experts
                and sizes.gather and sizes.trained != sizes.gather)


def _peak(phase: PhasePlan, memory: dict[str, int]) -> int:
    return phase.peak + sum(memory[c] for c in CATEGORIES) - sum(phase.memory[c] for c in CATEGORIES)


def _alternatives(phases, rank_memory, shape: Layout, settings: ParallelSettings, sizes: Sizes,
                  path: str) -> dict[str, int]:
    """The step's peak per GPU under settings that shrink the states (memory by this plan's categories, not
    planned again): bf16 weights, gradients and AdamW state, FSDP2's offload, both. The offloads are left out under
    one expert group, whose whole experts are not FSDP2's to offload (ParallelSettings refuses them)."""
    bf16 = dataclasses.replace(sizes, trained=2, frozen=2)
    options = {"--weights-dtype bfloat16": (bf16, settings)}
    if not (settings.expert_parallel > 1 and settings.expert_parallel == settings.world):
        offloaded = dataclasses.replace(settings, fsdp_offload=True)
        options.update({"--fsdp-offload true": (sizes, offloaded),
                        "--weights-dtype bfloat16 --fsdp-offload true": (bf16, offloaded)})
        if shape.reference.total and not settings.reference_on_host:
            options["--reference-offload true"] = (sizes, dataclasses.replace(settings, reference_offload=True))
    out = {}
    for label, (other_sizes, other) in options.items():
        if "--fsdp-offload" in label and settings.fsdp_offload:
            continue
        out[label] = max(_peak(p, _fsdp2_memory(p, rank_memory[name], shape, other, other_sizes, path, False))
                         for name, p in phases.items() if p.runs)
    return out


# -- FSDP2's collectives --------------------------------------------------------------------------------------

def _fsdp2_collectives(name: str, phase: PhasePlan, shape: Layout, settings: ParallelSettings, sizes: Sizes,
                       wire: Links, path: str, checkpointing: bool, gpu: GPU) -> Collectives:
    calls = phase.model_calls
    out = Collectives()

    def host(*parts: tuple[Elements, int]) -> float:  # offloaded: the shards copied in at each unshard
        return sum(_shards(elements, itemsize, shape, settings) for elements, itemsize in parts)

    layers = sizes.gathered(shape.trained - shape.root_trained, shape.frozen - shape.root_frozen)
    root = sizes.gathered(shape.root_trained, shape.root_frozen)
    layers_host = host((shape.trained - shape.root_trained, sizes.trained), (shape.frozen - shape.root_frozen,
                                                                               sizes.frozen))
    root_host = host((shape.root_trained, sizes.trained), (shape.root_frozen, sizes.frozen))
    layer_units = shape.units - 1
    if name == train_step.ROLLOUT and path == "gathered":  # once a step, before the rollout: nothing to hide it
        _sharded_collective(out, "all_gather", settings, wire, *_copy_bytes(shape, settings, sizes), units=shape.units,
                            times=phase.runs, exposed=True, host=layers_host + root_host)
    else:  # each call gathers the layers' units; the root's stays unsharded from its first gather to a backward
        _sharded_collective(out, "all_gather", settings, wire, *layers, units=layer_units, times=calls["policy"],
                            host=layers_host)
        _sharded_collective(out, "all_gather", settings, wire, *root, units=1,
                            times=phase.runs if calls["policy"] else 0, host=root_host)
    # a backward's forward gathers each unit, and FSDP2 gathers the layers again for the backward (resharded
    # after the forward); the root is resharded after the backward
    _sharded_collective(out, "all_gather", settings, wire, *layers, units=layer_units, times=2 * calls["policy_grad"],
                        host=layers_host)
    _sharded_collective(out, "all_gather", settings, wire, *root, units=1, times=calls["policy_grad"], host=root_host)
    reference_layers = sizes.gathered(Elements(), shape.reference - shape.reference_root)
    # the reference's shards, on the host under --reference-offload (or --fsdp-offload), come in at each gather
    on_host = settings.reference_on_host
    _sharded_collective(out, "all_gather", settings, wire, *reference_layers, units=layer_units,
                        times=calls["reference"],
                        host=host((shape.reference - shape.reference_root, sizes.frozen)), offloaded=on_host)
    _sharded_collective(out, "all_gather", settings, wire, *sizes.gathered(Elements(), shape.reference_root),
                        units=1, times=phase.runs if calls["reference"] else 0,
                        host=host((shape.reference_root, sizes.frozen)), offloaded=on_host)
    # every backward reduce-scatters the trained gradients in the reduce dtype (the shards go to the host offloaded)
    _sharded_collective(out, "reduce_scatter", settings, wire, shape.trained.dense * sizes.reduce,
                        shape.trained.experts * sizes.reduce, units=shape.units, times=calls["policy_grad"],
                        host=host((shape.trained, sizes.trained)))
    _all_to_alls(out, calls, shape, settings, sizes, wire, checkpointing)
    if _casts_experts(shape, settings, sizes):  # read fp32, write bf16, every forward (and back in a backward)
        from dllm_fast.planning.calibration import DEFAULT

        cast = shape.trained.experts * (sizes.trained + sizes.activation)
        out.exposed += (calls["policy"] + 2 * calls["policy_grad"]) * cast / (gpu.bandwidth * DEFAULT.bandwidth)
    if name == train_step.OPTIMIZER_STEP and settings.fsdp_offload:  # AdamW on the host's CPUs
        elements = _shards(shape.trained, 1, shape, settings)
        ranks_a_node = min(settings.world, settings.gpus_per_node)
        out.exposed += phase.runs * elements * ADAMW_BYTES / (wire.host_memory / ranks_a_node)
    return out


def _all_to_alls(out: Collectives, calls: dict, shape: Layout, settings: ParallelSettings, sizes: Sizes,
                 wire: Links, checkpointing: bool) -> None:
    """Expert parallelism's all-to-alls of a phase (under DDP and FSDP2 alike), exposed: dispatch and combine at
    every MoE layer of a forward; a backward runs both again, a recompute once more. Inside a node unless an
    expert group spans more than one."""
    if settings.expert_parallel == 1 or not shape.moe_layers:
        return
    ranks = settings.expert_parallel
    per_token = shape.top_k * shape.hidden * sizes.activation
    passes = {"policy": 2, "reference": 2, "policy_grad": 6 if checkpointing else 4}
    for kind, count in passes.items():
        if not calls[kind]:
            continue
        crossing = all_to_all(calls[kind + "_tokens"] * per_token, ranks) * shape.moe_layers * count
        collectives = calls[kind] * shape.moe_layers * count
        out.all_to_alls += collectives
        out.all_to_all_bytes += crossing
        out.exposed += wire.collective(crossing, ranks, count=collectives,
                                       across_nodes=ranks > settings.gpus_per_node)


def _sharded_collective(out: Collectives, kind: str, settings: ParallelSettings, wire: Links, dense: float,
                        experts: float, *, units: int, times: int, exposed: bool = False, host: float = 0.0,
                        offloaded: bool | None = None) -> None:
    """`times` all-gathers (or reduce-scatters) of `units` units: `dense` bytes over the N ranks, a rank's
    `experts` bytes over their S shards (a group of their own, across nodes when there are several; without expert
    parallelism they are in the layers' units, over the N ranks); where these shards are on the host (`offloaded`;
    default: --fsdp-offload), `host` bytes copied in (or out) each time."""
    if offloaded is None:
        offloaded = settings.fsdp_offload
    if not times or not units:
        return
    world, shards = settings.world, settings.expert_shards
    if settings.expert_parallel == 1:
        dense, experts = dense + experts, 0.0
    crossing = seconds = 0.0
    count = 0
    if dense:
        crossing += all_gather(dense, world)
        seconds += wire.collective(all_gather(dense, world), world, count=units)
        count += units
    if experts and shards > 1:
        crossing += all_gather(experts, shards)
        seconds += wire.collective(all_gather(experts, shards), shards, count=units,
                                   across_nodes=wire.spans_nodes(world))
        count += units
    setattr(out, kind + "s", getattr(out, kind + "s") + times * count)
    setattr(out, kind + "_bytes", getattr(out, kind + "_bytes") + times * crossing)
    if exposed:
        out.exposed += times * seconds
    else:
        out.overlapped += times * seconds
    if offloaded and host:  # before the collective, hidden (or not) as it is
        out.host_bytes += times * host
        if exposed:
            out.exposed += times * wire.host_copy(host)
        else:
            out.overlapped += times * wire.host_copy(host)


def _fsdp2_notes(shape: Layout, settings: ParallelSettings, sizes: Sizes, out: ParallelPlan,
                 wire: Links | None) -> list[str]:
    N, Ne, S = settings.world, settings.expert_parallel, settings.expert_shards
    gather = f"{sizes.gather * 8}-bit floats" if sizes.gather else "their stored dtypes"
    experts = ""
    if shape.copy.experts or shape.trained.experts or shape.frozen.experts:
        experts = (f"; routed experts: {shape.parameters.experts / 1e9:.2f}B elements a rank"
                   + (f" (its E/{Ne}, expert parallelism inside a node)" if Ne > 1 else "")
                   + (f", sharded over {S} ranks" if S > 1 else ", whole on their rank"))
    notes = [f"FSDP2 on {N} GPUs ({settings.nodes} node{'s' if settings.nodes > 1 else ''} of "
             f"{min(N, settings.gpus_per_node)}): each rank plans its share of the prompts, its compute on weights "
             f"gathered in {gather}; parameters, gradients (reduce-scattered every backward, in "
             f"{sizes.reduce * 8}-bit floats) and AdamW state sharded 1/{N}, the reference copy sharded like the "
             f"policy (no optimizer state), {shape.parameters.dense / 1e9:.2f}B dense elements{experts}; where a "
             f"model runs on per-layer gathers, its root unit and two of its largest layer unit are unsharded (and "
             "in a backward their gradients)"
             + ("; --fsdp-offload true: shards, gradients and AdamW state on the host (about "
                f"{out.host_bytes / 1e9:.1f} GB a rank), the optimizer step on the host's CPUs"
                if settings.fsdp_offload else "")
             + (f"; --reference-offload true: the reference copy's shards on the host ({out.host_bytes / 1e9:.1f} GB "
                "a rank, pinned), copied to the GPU at each of its gathers" if settings.reference_offload
                and not settings.fsdp_offload and shape.reference.total else "")]
    if out.alternatives:
        notes.append("what would fit (memory by this plan's categories, not planned again): " + "; ".join(
            f"{label}: peak {peak / 1e9:.1f} GB" for label, peak in out.alternatives.items()))
        if settings.expert_parallel > 1 and settings.expert_parallel == settings.world:
            notes.append(f"offload (--fsdp-offload or --reference-offload true) takes FSDP2's shards, and one expert "
                         f"group keeps each rank's experts whole: plan it with several groups, e.g. --expert-parallel "
                         f"{settings.world // 2} --fsdp-offload true")
    if wire is not None:
        notes.append(_links_note(wire, settings))
    return notes


def _links_note(wire: Links, settings: ParallelSettings) -> str:
    parts = [f"inside a node {wire.intra / 1e9:.0f} GB/s + {wire.latency_intra * 1e6:.0f} us a collective"]
    if settings.world > settings.gpus_per_node:
        parts.append(f"across nodes {wire.inter / 1e9:.0f} GB/s a GPU + {wire.latency_inter * 1e6:.0f} us")
    if settings.fsdp_offload or settings.reference_offload:
        parts.append(f"host-device {wire.host / 1e9:.0f} GB/s, host memory {wire.host_memory / 1e9:.0f} GB/s a node")
    return ("communication: " + "; ".join(parts) + " (assumptions, not fitted: planning/gpus.py; "
            "--intra-node-bandwidth, --inter-node-bandwidth, --host-bandwidth change them); gathers and "
            "reduce-scatters overlap with compute (a phase takes the longer), all-to-alls, the rollout copy's "
            "gather and host work add to it")


# -- DDP ------------------------------------------------------------------------------------------------------

def _ddp(phases, shape: Layout, settings: ParallelSettings, sizes: Sizes, wire: Links | None,
         out: ParallelPlan, checkpointing: bool = False) -> None:
    """DDP; with expert parallelism (train/expert_parallel.py) DDP ignores the routed experts (the rank's plan holds
    its own E / N_e of them): the reducer's buckets and the all-reduce take the dense gradients, the experts'
    gradients are all-reduced over their N / N_e replicas at the optimizer step, and the all-to-alls move tokens."""
    experts = settings.expert_parallel > 1
    trained = (shape.trained.dense if experts else shape.trained.total) * sizes.trained
    expert_grads = shape.trained.experts * sizes.trained if experts else 0
    world, replicas = settings.world, settings.world // settings.expert_parallel
    updates = phases[train_step.OPTIMIZER_STEP].runs
    for name, phase in phases.items():
        if not phase.runs:
            continue
        memory = dict(phase.memory)
        memory["gradients"] += trained  # the reducer's buckets
        phase.peak = _peak(phase, memory)
        phase.memory = memory
        if wire is not None:
            collectives = Collectives()
            if name == train_step.INNER_UPDATE:
                collectives.all_reduces = updates
                collectives.all_reduce_bytes = 2 * all_gather(trained, world) * updates
                collectives.overlapped = updates * wire.collective(2 * all_gather(trained, world), world)
            if name == train_step.OPTIMIZER_STEP and expert_grads and replicas > 1:
                collectives.all_reduces += phase.runs
                collectives.all_reduce_bytes += 2 * all_gather(expert_grads, replicas) * phase.runs
                collectives.exposed += phase.runs * wire.collective(2 * all_gather(expert_grads, replicas),
                                                                    replicas, across_nodes=wire.spans_nodes(world))
            _all_to_alls(collectives, phase.model_calls, shape, settings, sizes, wire, checkpointing)
            out.collectives[name] = collectives
            phase.costs.closed += max(0.0, collectives.overlapped - phase.costs.seconds) + collectives.exposed
    out.notes = [f"DDP on {world} GPUs: each rank plans its share of the prompts with the whole model"
                 + (f" but its E/{settings.expert_parallel} routed experts (DDP ignores them; their gradients are "
                    f"all-reduced over their {replicas} replica{'s' if replicas > 1 else ''} at the optimizer step, "
                    "tokens reach them by all-to-all)" if experts else "")
                 + f"; gradients add the reducer's buckets, a copy of every {'dense ' if experts else ''}trained "
                 f"gradient ({trained / 1e9:.2f} GB, DDP's default gradient_as_bucket_view=False); one all-reduce "
                 "of them per optimizer step (2 (N-1)/N of their bytes)"]
    if wire is not None:
        out.notes.append(_links_note(wire, settings))


__all__ = ["Collectives", "ParallelPlan", "ParallelSettings", "Sizes", "layout", "per_gpu", "rank_config",
           "ROLLOUT_MARGIN"]
