"""`train --expert-parallel N` (LLaDA2): what a run does around models/expert_parallel.py's layer.

- The mesh: the ranks as a 2-D device mesh ("data", "expert") of world / N by N (init_device_mesh); an expert
  group is N consecutive ranks (inside a node under torchrun), and each rank's experts are replicated on the
  world / N ranks of its "data" column.
- Data parallelism under --parallel ddp: DDP over everything but the routed experts (DDP ignores them: it would
  broadcast rank 0's and average them). A rank's experts receive, through the all-to-all's backward, the gradients
  of the losses of every rank of its group; `ExpertGradients` sums them over the replicas and divides by the world
  size (what DDP's average gives the dense weights), then clips by the norm over every parameter of the run (each
  expert counted once) before the optimizer steps.
- Under --parallel fsdp2 (`shard_experts`): FSDP2 shards everything but the routed experts over all the ranks.
  With one expert group (N = world) the experts are FSDP2's `ignored_params`, whole on their rank, and their
  gradients are handled as under DDP (divided by the world size). With several (N < world) each rank's experts are
  a unit of their own, sharded over its "data" column of replicas (fully_shard on mesh["data"]), whose reduce-
  scatter sums the replicas' gradients and divides by the world size (set_gradient_divide_factor), so the average
  is the single process's. The clipping norm sums every rank's local squares (dense shards, expert shards or
  whole local experts: each element lives on exactly one rank) in one all-reduce.
- Checkpoints: the experts are gathered into the whole layout (the official per-expert checkpoint and whole AdamW
  state), and a resumed run cuts its own slice again (and FSDP2 re-shards it). A checkpoint resumes on the world
  size and --expert-parallel it was written with (train/checkpoint.py and train/resume.py refuse others, naming
  both).
- Metrics: `expert_rank_load_max`, the busiest expert rank's rows over the mean rank's, beside the router's balance.
"""

from __future__ import annotations

import torch

from dllm_fast.models.expert_parallel import (ExpertGroup, distribute_experts, expert_parallel_modules,
                                              local_experts, whole_experts)

FLAG = "--expert-parallel"


def check_expert_parallel(config, model, world: int) -> None:
    """Refuse, naming the flag, an --expert-parallel the run cannot take: N must divide the ranks and the model's
    routed experts, the model must have routed experts, and the run must be one expert parallelism supports here
    (eager rollouts on a fixed schedule; --parallel ddp or fsdp2 alike). `model`: the policy's skeleton."""
    size = config.run.expert_parallel
    if size == 1:
        return
    experts = getattr(getattr(model, "config", None), "num_experts", None)
    if not experts or not any(True for _ in _moe_layers(model)):
        raise ValueError(f"{FLAG} {size}: --model {config.model.name!r} has no routed experts; only "
                         "mixture-of-experts models (LLaDA2) take expert parallelism. Leave it at 1.")
    if world % size:
        raise ValueError(f"{FLAG} {size} must divide the number of ranks, {world} (torchrun's --nproc-per-node x "
                         f"--nnodes): every rank belongs to one expert group of {size}.")
    if experts % size:
        raise ValueError(f"{FLAG} {size} must divide the model's {experts} routed experts (each rank of a group "
                         "holds an equal share).")
    if config.rollout.compile is True:
        raise ValueError(f"{FLAG} {size}: the expert all-to-alls run eagerly (their sizes are read on the host); "
                         "use --compile false or auto.")
    if config.rollout.threshold is not None:
        raise ValueError(f"{FLAG} {size}: --threshold decoding takes a different number of model calls on each "
                         "rank, and every rank of an expert group must run each MoE forward together; use a fixed "
                         "schedule (--diffusion-steps).")


def _moe_layers(model):
    from dllm_fast.models.moe import MixtureOfExperts

    return (m for m in model.modules() if isinstance(m, MixtureOfExperts))


def expert_group(size: int, ranks, device: torch.device) -> ExpertGroup | None:
    """This rank's ExpertGroup on the ("data", "expert") mesh of the run's ranks, or None for size 1. Its
    `data_mesh` is the mesh's "data" column (the replicas of this rank's experts), over which FSDP2 shards them."""
    if size == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (ranks.world // size, size), mesh_dim_names=("data", "expert"))
    replicas = ranks.world // size
    return ExpertGroup(size, mesh.get_local_rank("expert"), mesh.get_group("expert"),
                       mesh.get_group("data") if replicas > 1 else None, replicas, ranks.world, data_mesh=mesh["data"])


def shard_experts(model, group: ExpertGroup | None, mixed_precision=None, device=None, offload: bool = False) -> set:
    """Under --parallel fsdp2, before the rest of `model` is sharded (train/distributed.data_parallel_wrapper):
    each rank's routed experts sharded over their replicas (several expert groups), or left whole (one group).
    offload: their shards on the host (FSDP2's CPUOffloadPolicy, as train/distributed.offload_policy places the rest;
    whole experts cannot be, which train/distributed.check_offload refuses). Returns the parameters the rest's
    fully_shard must ignore (the whole experts; empty otherwise)."""
    if group is None:
        return set()
    layers = expert_parallel_modules(model)
    if group.replicas == 1:
        return {p for m in layers for p in m.parameters()}
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from dllm_fast.train.distributed import offload_policy

    policy = mixed_precision if mixed_precision is not None else MixedPrecisionPolicy()
    placement = offload_policy(device if device is not None else torch.device("cpu"), offload)
    for layer in layers:
        fully_shard(layer, mesh=group.data_mesh, mp_policy=policy, offload_policy=placement)
        # the reduce-scatter sums over the replicas; each rank's gradient already holds its group's losses, so
        # dividing by every rank gives the single process's mean (the dense weights' average over the world)
        layer.set_gradient_divide_factor(float(group.world))
    return set()


def distribute(model, group: ExpertGroup | None):
    """The base model with this rank's slice of the routed experts (unchanged without expert parallelism)."""
    return model if group is None else distribute_experts(model, group)


def expert_parallel_note(model, group: ExpertGroup, uncompiled: bool, sharded: bool = False) -> str:
    """The setup line of a run under expert parallelism (uncompiled: --compile auto left the rollouts eager;
    sharded: under FSDP2)."""
    layer = expert_parallel_modules(model)[0]
    return (f"--expert-parallel {group.size}: each rank holds {layer.local_experts} of the {layer.num_experts} "
            f"routed experts of every MoE layer ({group.replicas} expert group{'s' if group.replicas > 1 else ''} of "
            f"{group.size} ranks; tokens move to their experts by all-to-all, "
            + (_fsdp2_experts(group) if sharded else "DDP averages the rest") + ")"
            + ("; rollouts eager (--compile auto)" if uncompiled else ""))


def _fsdp2_experts(group: ExpertGroup) -> str:
    if group.replicas == 1:
        return "FSDP2 shards the rest; each rank's experts stay whole on it"
    return f"FSDP2 shards the rest; each rank's experts are sharded over their {group.replicas} replicas"


def ignore_experts_in_ddp(model) -> None:
    """Tell DDP (before it wraps `model`) to leave the routed experts alone: each rank holds its own."""
    ids = {id(p) for m in expert_parallel_modules(model) for p in m.parameters()}
    names = [name for name, p in model.named_parameters() if id(p) in ids]
    if names:
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


def _expert_parameter_ids(model) -> set[int]:
    return {id(p) for m in expert_parallel_modules(model) for p in m.parameters()}


class ExpertGradients:
    """The optimizer step's gradient clipping for a run whose policy holds a slice of the experts (see the module
    docstring): called as torch.nn.utils.clip_grad_norm_(parameters, max_norm), it returns the norm before
    clipping."""

    def __init__(self, model, group: ExpertGroup, sharded: bool = False):
        self.group, self.experts, self.sharded = group, _expert_parameter_ids(model), sharded

    @torch.no_grad()
    def __call__(self, parameters, max_norm: float) -> torch.Tensor:
        import torch.distributed as dist

        parameters = [p for p in parameters if p.requires_grad]
        if self.sharded:
            return self._sharded(parameters, max_norm)
        experts = [p for p in parameters if id(p) in self.experts]
        for p in experts:
            if p.grad is None:  # no row reached this rank's experts: its share of the sum is zero
                p.grad = torch.zeros_like(p)
            if self.group.data_group is not None:
                dist.all_reduce(p.grad, group=self.group.data_group)
            p.grad.div_(self.group.world)
        dense = [p.grad for p in parameters if id(p) not in self.experts and p.grad is not None]
        mine = [p.grad for p in experts]
        if not dense + mine:
            return torch.zeros(())
        reference = (dense + mine)[0]

        def squares(grads):
            return sum((torch.linalg.vector_norm(g).to(reference.dtype) ** 2 for g in grads),
                       torch.zeros((), dtype=reference.dtype, device=reference.device))

        dense_square, expert_square = squares(dense), squares(mine)
        dist.all_reduce(expert_square, group=self.group.group)  # each expert once: over the group's slices
        norm = torch.sqrt(dense_square + expert_square)
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # clip_grad_norm_'s rule
        for g in dense + mine:
            g.mul_(coefficient.to(g.dtype))
        return norm


    def _sharded(self, parameters, max_norm: float) -> torch.Tensor:
        """Under FSDP2: the whole experts' gradients divided by the world size (FSDP2's reduce-scatter did it for
        the dense weights and for experts sharded over their replicas), then the norm over every rank's local
        elements, each counted once, in one all-reduce over the run's ranks."""
        import torch.distributed as dist

        for p in parameters:
            if id(p) in self.experts and not _is_dtensor(p):
                if p.grad is None:  # no row reached this rank's experts: its share of the sum is zero
                    p.grad = torch.zeros_like(p)
                p.grad.div_(self.group.world)
        grads = [_local(p.grad) for p in parameters if p.grad is not None]
        if not grads:
            return torch.zeros(())
        reference = grads[0]
        square = sum((torch.linalg.vector_norm(g).to(reference.dtype) ** 2 for g in grads),
                     torch.zeros((), dtype=reference.dtype, device=reference.device))
        dist.all_reduce(square)
        norm = torch.sqrt(square)
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # clip_grad_norm_'s rule
        for g in grads:
            g.mul_(coefficient.to(g.dtype))
        return norm


def _is_dtensor(tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: writing it writes the DTensor), or the tensor itself."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor


def _whole_local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's whole slice of experts: an FSDP2 shard over the replicas all-gathered, or the tensor itself."""
    return tensor.full_tensor() if _is_dtensor(tensor) else tensor


# -- checkpoints ------------------------------------------------------------------------------------------------

def whole_state(model, optimizer, group: ExpertGroup) -> tuple[dict, dict]:
    """(model state, optimizer state) with every rank's experts gathered into the whole layout, on CPU (every
    rank of the run calls it)."""
    experts = _expert_parameter_ids(model)
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    for name in [n for n, p in model.named_parameters() if id(p) in experts]:
        state[name] = whole_experts(state[name], group).cpu()
    return state, _optimizer_state(optimizer, experts, lambda value: whole_experts(value, group).cpu())


def whole_sharded_state(model, optimizer, model_state: dict, optimizer_state: dict, group: ExpertGroup,
                        writer: bool) -> tuple[dict, dict]:
    """Under FSDP2: the whole states train/distributed.full_state gathered (rank 0's; keyed by parameter name)
    with the experts gathered from every rank into the whole layout (every rank of the run calls it, in the same
    order; the writer's dicts are completed, the others' returned as they are)."""
    named = [(name, p) for name, p in model.named_parameters() if id(p) in _expert_parameter_ids(model)]
    for name, parameter in named:
        whole = whole_experts(_whole_local(parameter.detach()), group).cpu()
        if writer:
            model_state[name] = whole
        entry = optimizer.state.get(parameter, {})
        for key in sorted(entry):
            value = entry[key]
            if torch.is_tensor(value) and value.dim() > 0:
                gathered = whole_experts(_whole_local(value), group).cpu()
                if writer:
                    optimizer_state["state"][name][key] = gathered
    return model_state, optimizer_state


def local_sharded_state(model, optimizer_state: dict, group: ExpertGroup) -> dict:
    """The inverse of whole_sharded_state for the optimizer (keyed by parameter name): the experts' entries cut
    to this rank's slice (FSDP2 re-shards them over the replicas as it loads them)."""
    names = {name for name, p in model.named_parameters() if id(p) in _expert_parameter_ids(model)}
    state = {}
    for name, entry in optimizer_state["state"].items():
        if name in names:
            entry = {key: (value[group.experts_of(value.shape[0])].clone()
                           if torch.is_tensor(value) and value.dim() > 0 else value) for key, value in entry.items()}
        state[name] = entry
    return {**optimizer_state, "state": state}


def local_state(model, optimizer, model_state: dict, optimizer_state: dict, group: ExpertGroup) -> tuple[dict,
                                                                                                         dict]:
    """The inverse of whole_state: whole model and optimizer states with the experts cut to this rank's slice."""
    experts = _expert_parameter_ids(model)
    return (local_experts(model_state, group),
            _optimizer_state(optimizer, experts, lambda value: value[group.experts_of(value.shape[0])].clone(),
                             optimizer_state))


def _optimizer_state(optimizer, experts: set[int], convert, saved: dict | None = None) -> dict:
    """An optimizer state (`saved`, or the optimizer's own) with `convert` applied to the expert parameters'
    per-element entries (AdamW's moments; its step count stays)."""
    saved = optimizer.state_dict() if saved is None else saved
    parameters = [p for g in optimizer.param_groups for p in g["params"]]  # state_dict's numbering
    state = {}
    for index, entry in saved["state"].items():
        if id(parameters[int(index)]) in experts:
            entry = {key: (convert(value) if torch.is_tensor(value) and value.dim() > 0 else value)
                     for key, value in entry.items()}
        state[index] = entry
    return {**saved, "state": state}


# -- metrics ----------------------------------------------------------------------------------------------------

def expert_rank_load(load, group: ExpertGroup | None, ranks) -> dict[str, float]:
    """expert_rank_load_max: the busiest expert rank's rows over the mean rank's, summed over the run's ranks and
    averaged over the MoE layers (1 is perfect balance), from a RouterLoad of this rank's tokens (models/moe.py);
    empty without expert parallelism. Every rank calls it (one gather)."""
    if group is None:
        return {}
    counts = [c.cpu() for c in load.counts if c.numel()]
    totals = [sum(parts) for parts in zip(*ranks.gather(counts))]
    ratios = []
    for total in totals:
        per_rank = total.view(group.size, -1).sum(dim=1).double()
        if per_rank.sum() > 0:
            ratios.append(float(per_rank.max() / per_rank.mean()))
    return {"expert_rank_load_max": sum(ratios) / len(ratios)} if ratios else {}
