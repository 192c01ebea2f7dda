"""What a plan on several GPUs is of: its settings (`ParallelSettings`: world, GPUs a node, expert parallelism,
FSDP2's offload, the rollout's weights, the links' bandwidths), the rank's model under expert parallelism
(`expert_rank_config`), and the policy's parameters counted the way FSDP2 shards them (`Layout`).

Expert parallelism (--expert-parallel N_e, LLaDA2): each rank of an expert group holds num_experts / N_e of every
MoE layer's routed experts and computes the tokens routed to them from every rank of its group. With routing
balanced (the auxiliary-loss-free expert bias of LLaDA2's pre-training keeps it near balance; the plan assumes
it), a rank's experts receive as many (token, slot) rows as its own tokens route, so a rank runs the grouped GEMMs
of a model whose MoE layers hold num_experts / N_e experts over its own tokens: that model is what the rank's
plan runs (`expert_rank_config`). Its router scores num_experts / N_e experts (the real one scores all of them:
tokens x num_experts x d FLOPs a layer, under 1% of a layer's); its groups are kept where they divide the local
experts, else merged, which changes which experts a token picks but not how many (the plan's work, not its values).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dllm_fast.train.settings import PARALLEL, ROLLOUT_WEIGHTS


@dataclass(frozen=True)
class ParallelSettings:
    """A step on `world` GPUs under torchrun, in `parallel`'s mode, as planned (every field a flag of `plan`):

    - gpus_per_node: GPUs a node (the link between two ranks is NVLink inside a node, the network between nodes);
    - expert_parallel: ranks an expert group spans (inside a node, or its all-to-alls cross nodes), 1 for none;
    - fsdp_offload: FSDP2's CPUOffloadPolicy: sharded parameters, gradients and AdamW's state live on the host, the
      optimizer step runs there (the reference copy's shards too);
    - reference_offload: the reference copy's shards alone on the host (CPUOffloadPolicy on the reference, verl's
      ref param_offload), copied to the GPU at each of its gathers;
    - rollout_weights: "auto" (the rule of train/rollout_weights.py), "gathered" (a plain bf16 copy gathered once a
      step) or "sharded" (FSDP2's per-layer gathers at every forward);
    - intra_node_bandwidth, inter_node_bandwidth, host_bandwidth: bytes/s, None for the GPU's entry
      (planning/gpus.py)."""

    world: int = 1
    parallel: str = "ddp"
    gpus_per_node: int = 8
    expert_parallel: int = 1
    fsdp_offload: bool = False
    reference_offload: bool = False
    rollout_weights: str = "auto"
    intra_node_bandwidth: float | None = None
    inter_node_bandwidth: float | None = None
    host_bandwidth: float | None = None

    def __post_init__(self):
        for name, minimum in (("world", 1), ("gpus_per_node", 1), ("expert_parallel", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{_FLAGS[name]} {value!r} must be a whole number, at least {minimum}.")
        if self.parallel not in PARALLEL:
            raise ValueError(f"--parallel {self.parallel!r} is not one of {', '.join(PARALLEL)}.")
        if self.rollout_weights not in ROLLOUT_WEIGHTS:
            raise ValueError(f"--rollout-weights {self.rollout_weights!r} is not one of {', '.join(ROLLOUT_WEIGHTS)}.")
        for name in ("intra_node_bandwidth", "inter_node_bandwidth", "host_bandwidth"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{_FLAGS[name]} {value!r} must be a positive bandwidth (bytes/s; the flag takes "
                                 "GB/s).")
        if self.world > self.gpus_per_node and self.world % self.gpus_per_node:
            raise ValueError(f"--gpus {self.world} is not a whole number of nodes of --gpus-per-node "
                             f"{self.gpus_per_node}; torchrun starts the same number of ranks on every node.")
        offloads = [flag for flag, on in (("--fsdp-offload true", self.fsdp_offload),
                                          ("--reference-offload true", self.reference_offload)) if on]
        if offloads and (self.world == 1 or self.parallel != "fsdp2"):
            raise ValueError(f"{', '.join(offloads)} plans FSDP2 on several GPUs; add --parallel fsdp2 and "
                             "--gpus N (N > 1).")
        if offloads and self.expert_parallel > 1 and self.expert_parallel == self.world:
            raise ValueError(f"{', '.join(offloads)} with --expert-parallel {self.expert_parallel} on --gpus "
                             f"{self.world}: one expert group keeps each rank's routed experts whole, outside FSDP2's "
                             "shards, so they cannot be offloaded; use an --expert-parallel that leaves several groups "
                             "(it must divide --gpus and be smaller), or no offload.")
        if self.expert_parallel > 1:  # under DDP or FSDP2, as train runs it (train/expert_parallel.py)
            if self.world % self.expert_parallel:  # --gpus 1 included
                raise ValueError(f"--expert-parallel {self.expert_parallel} must divide --gpus {self.world}: every "
                                 "rank belongs to one expert group.")

    @property
    def reference_on_host(self) -> bool:
        """Whether the reference copy's shards live on the host (--reference-offload, or --fsdp-offload)."""
        return self.fsdp_offload or self.reference_offload

    @property
    def nodes(self) -> int:
        return max(1, self.world // self.gpus_per_node)

    @property
    def expert_shards(self) -> int:
        """Ranks each of a rank's routed experts is FSDP2-sharded over: its expert group's replicas (one a group
        of nodes, so across nodes when there are several), or every rank without expert parallelism."""
        return self.world // self.expert_parallel


_FLAGS = {"world": "--gpus", "gpus_per_node": "--gpus-per-node", "expert_parallel": "--expert-parallel",
          "intra_node_bandwidth": "--intra-node-bandwidth", "inter_node_bandwidth": "--inter-node-bandwidth",
          "host_bandwidth": "--host-bandwidth"}


def expert_rank_config(model_config, expert_parallel: int):
    """The config of the model one rank of an expert group of `expert_parallel` plans (module docstring): its
    MoE layers with num_experts / expert_parallel experts and the same top_k. Refuses a model without routed
    experts and an expert count the group cannot split."""
    experts = getattr(model_config, "num_experts", None)
    if expert_parallel == 1:
        return model_config
    if not experts:
        raise ValueError(f"--expert-parallel {expert_parallel}: the model has no routed experts (a mixture-of-"
                         "experts model such as LLaDA2 does); leave --expert-parallel at 1.")
    if experts % expert_parallel:
        raise ValueError(f"--expert-parallel {expert_parallel} must divide the model's {experts} routed experts "
                         "(each rank holds an equal share).")
    local, top_k = experts // expert_parallel, model_config.num_experts_per_tok
    if local < top_k:
        raise ValueError(f"--expert-parallel {expert_parallel} leaves {local} experts a rank, fewer than the "
                         f"{top_k} a token picks; the planner models a rank's experts as a model of {local} (plan "
                         "a smaller --expert-parallel).")
    groups = model_config.n_group
    while groups > 1 and (local % groups or local // groups < 2):
        groups -= 1
    kept = min(model_config.topk_group, groups)
    while kept < groups and kept * (local // groups) < top_k:
        kept += 1
    return dataclasses.replace(model_config, num_experts=local, n_group=groups, topk_group=kept)


@dataclass(frozen=True)
class Elements:
    """Parameter elements: dense (everything but the routed experts) and the routed experts (a rank's own under
    expert parallelism)."""

    dense: int = 0
    experts: int = 0

    def __add__(self, other: "Elements") -> "Elements":
        return Elements(self.dense + other.dense, self.experts + other.experts)

    def __sub__(self, other: "Elements") -> "Elements":
        return Elements(self.dense - other.dense, self.experts - other.experts)

    def scaled(self, factor: int) -> "Elements":
        return Elements(self.dense * factor, self.experts * factor)

    @property
    def total(self) -> int:
        return self.dense + self.experts


@dataclass(frozen=True)
class Layout:
    """The rank's models by parameter elements, as FSDP2 shards them (the model's shard_units(), then the root):
    the policy's trained and frozen parameters, the root's (what no unit holds) and the largest unit's, the
    reference copy's (a full fine-tune's frozen copy; none with LoRA, whose reference is the policy with its
    adapters off), the rollout copy's (`copy`: the weights a rollout reads, adapters merged under LoRA when
    merged), the buffers' bytes (never sharded), the number of units (one collective each per gather), and what
    an all-to-all moves: MoE layers, top_k, width."""

    trained: Elements
    frozen: Elements
    root_trained: Elements
    root_frozen: Elements
    unit_trained: Elements
    unit_frozen: Elements
    reference: Elements
    reference_root: Elements
    reference_unit: Elements
    copy: Elements
    buffers: int
    units: int
    moe_layers: int = 0
    top_k: int = 0
    hidden: int = 0

    @property
    def parameters(self) -> Elements:
        return self.trained + self.frozen

    @property
    def root(self) -> Elements:
        return self.root_trained + self.root_frozen

    @property
    def unit(self) -> Elements:
        return self.unit_trained + self.unit_frozen


def _is_expert(module) -> bool:
    from dllm_fast.models.moe import Experts

    return isinstance(module, Experts)


def _elements(named: list[tuple[torch.nn.Module, torch.nn.Parameter]], trained: bool | None = None) -> Elements:
    dense = experts = 0
    for owner, parameter in named:
        if trained is not None and parameter.requires_grad != trained:
            continue
        if _is_expert(owner):
            experts += parameter.numel()
        else:
            dense += parameter.numel()
    return Elements(dense, experts)


def _owned(module: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.nn.Parameter]]:
    """(owning module, parameter) for each distinct parameter of `module`."""
    seen, out = set(), []
    for owner in module.modules():
        for parameter in owner._parameters.values():
            if parameter is not None and id(parameter) not in seen:
                seen.add(id(parameter))
                out.append((owner, parameter))
    return out


def _split(model: torch.nn.Module):
    """(all, root, largest unit) of `model`'s (owner, parameter) pairs, units as FSDP2 wraps them."""
    everything = _owned(model)
    units = [_owned(unit) for unit in model.shard_units()]
    in_units = {id(p) for unit in units for _, p in unit}
    root = [(o, p) for o, p in everything if id(p) not in in_units]
    largest = max(units, key=lambda unit: sum(p.numel() for _, p in unit), default=[])
    return everything, root, largest, len(units) + 1


def layout(policy, reference, base, *, merged_rollouts: bool) -> Layout:
    """The Layout of a planning session's models (planning/step.py's Session: policy, reference or None, the base
    model inside a LoRA policy)."""
    everything, root, unit, units = _split(policy)
    reference_all, reference_root, reference_unit = [], [], []
    if reference is not None:
        reference_all, reference_root, reference_unit, _ = _split(reference)
    frozen = _elements(everything, trained=False)
    trained = _elements(everything, trained=True)
    lora = policy is not base
    # the copy a rollout reads: the base's weights (adapters merged into them) or the policy's own
    copy = _elements(_owned(base), trained=False) if lora and merged_rollouts else trained + frozen
    buffers = sum(b.numel() * b.element_size() for model in (policy, reference) if model is not None
                  for b in model.buffers())
    moe = [m for m in base.modules() if hasattr(m, "gate") and hasattr(m, "experts") and _is_expert(m.experts)]
    return Layout(trained=trained, frozen=frozen,
                  root_trained=_elements(root, True), root_frozen=_elements(root, False),
                  unit_trained=_elements(unit, True), unit_frozen=_elements(unit, False),
                  reference=_elements(reference_all), reference_root=_elements(reference_root),
                  reference_unit=_elements(reference_unit), copy=copy, buffers=buffers, units=units,
                  moe_layers=len(moe), top_k=moe[0].gate.top_k if moe else 0,
                  hidden=moe[0].experts.hidden_size if moe else 0)
