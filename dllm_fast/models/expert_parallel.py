"""Expert parallelism for mixture-of-experts models (LLaDA2): each of the N ranks of an expert group holds
num_experts / N of every MoE layer's routed experts; the router and the shared experts stay replicated, and only
tokens move.

A MoE layer's forward on each rank of the group (`ExpertParallelExperts.forward`, in place of `Experts.forward`):

1. route its own tokens as before (the replicated router: routing is the single-process routing, exactly);
2. dispatch: sort its (token, slot) pairs by expert, which sorts them by the rank holding the expert (rank j holds
   experts j E/N .. (j+1) E/N - 1), and send each rank its rows with their experts' local indices (all-to-all);
3. compute: sort the received rows by local expert and run the grouped GEMM on them (`Experts.sorted_rows`, the
   provider of the single-process path), then put the outputs back in the order they arrived;
4. combine: send each output back to the rank its token lives on (the reverse all-to-all), unsort it to its
   (token, slot) and take the router-weighted sum over the slots, as `Experts.forward` does.

The all-to-alls are `torch.distributed.all_to_all_single` with uneven splits (NCCL on CUDA; gloo runs it on CPU),
inside an autograd function whose backward is the reverse all-to-all, so gradients flow back to the tokens and to
the experts of every rank. Each exchange first swaps the row counts (one small all-to-all and a host read a layer).
Every rank of a group must therefore run the same MoE forwards in the same order, as FSDP2 requires: the same
number of model calls a rollout (a fixed --diffusion-steps schedule) and a scoring pass.

`distribute_experts(model, group)` swaps each MoE layer's `experts` for an ExpertParallelExperts holding the rank's
slice (the same parameter names, `gate_up_proj` [E/N, 2I, d] and `down_proj` [E/N, d, I]); `whole_experts` and
`local_experts` convert a state dict's stacked experts between the whole layout and a rank's slice. The single-
process path (models/moe.py) is unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from dllm_fast.models.moe import Experts, MixtureOfExperts


class ExpertGroup:
    """The ranks an expert group spans and the replicas of each of its ranks: `size` ranks in `group` (this one is
    `rank` in it), each expert replicated on the `replicas` ranks of `data_group` (one a group; None when there is
    one group). `world`: the run's ranks. data_mesh: the device mesh of this rank's replicas (FSDP2 shards its experts
    over it when there are several; None otherwise). Shared, never copied, by the models built from one (a frozen
    reference's deepcopy holds the same process groups)."""

    def __init__(self, size: int, rank: int, group, data_group=None, replicas: int = 1, world: int | None = None,
                 data_mesh=None):
        self.size, self.rank, self.group = size, rank, group
        self.data_group, self.replicas, self.data_mesh = data_group, replicas, data_mesh
        self.world = size * replicas if world is None else world

    def __deepcopy__(self, memo):
        return self

    def experts_of(self, num_experts: int) -> slice:
        """The routed experts this rank holds."""
        local = num_experts // self.size
        return slice(self.rank * local, (self.rank + 1) * local)


# -- the permutations (pure: tested without a process group) ---------------------------------------------------

def dispatch_plan(chosen: torch.Tensor, num_experts: int, size: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor, torch.Tensor]:
    """(order, local ids, counts, sends) for tokens routed to `chosen` [T, k] among `num_experts` split over `size`
    ranks: order [T k], the (token, slot) pairs sorted by expert (stable: token order within an expert); local ids
    [T k], each sorted pair's expert index on its rank; counts [E], pairs per expert; sends [size], pairs to each
    rank (the sorted pairs are contiguous by rank)."""
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).index_add_(0, flat,
                                                                                      torch.ones_like(flat))
    local = num_experts // size
    return order, flat.index_select(0, order) % local, counts, counts.view(size, local).sum(dim=1)


def receive_plan(local_ids: torch.Tensor, local_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(arrange, sorted ids, counts) for rows received with their local expert ids [R] (source rank by source
    rank): arrange [R], the rows sorted by expert (stable: source rank, then its order); counts [local_experts]."""
    arrange = torch.argsort(local_ids, stable=True)
    counts = torch.zeros(local_experts, dtype=torch.long, device=local_ids.device).index_add_(
        0, local_ids, torch.ones_like(local_ids))
    return arrange, local_ids.index_select(0, arrange), counts


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes `order` (out[order[i]] = i)."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=order.device))


def weighted_sum(outputs: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [T, d] (weights' dtype): the outputs of the sorted pairs [T k, d] back in (token, slot) order, weighted by
    the router's `weights` [T, k] and summed over the slots (Experts.forward's combine)."""
    T, k = weights.shape
    unsorted = outputs.index_select(0, inverse_permutation(order))
    return (unsorted.view(T, k, -1).to(weights.dtype) * weights.unsqueeze(-1)).sum(dim=1)


# -- the exchange -----------------------------------------------------------------------------------------------

class _AllToAll(torch.autograd.Function):
    """Rows [sum(sends), ...] out as `sends[j]` rows to rank j of `group`; in, `receives[j]` rows from rank j. The
    backward sends the gradients back the same way reversed."""

    @staticmethod
    def forward(ctx, rows, sends: list[int], receives: list[int], group):
        ctx.sends, ctx.receives, ctx.group = sends, receives, group
        return _all_to_all(rows, sends, receives, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.receives, ctx.sends, ctx.group), None, None, None


def _all_to_all(rows: torch.Tensor, sends: list[int], receives: list[int], group) -> torch.Tensor:
    import torch.distributed as dist

    out = rows.new_empty((sum(receives),) + tuple(rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), receives, sends, group=group)
    return out


def exchange_counts(sends: torch.Tensor, group) -> list[int]:
    """What each rank of `group` sends this one, from what this one sends each (a host read)."""
    import torch.distributed as dist

    receives = torch.empty_like(sends)
    dist.all_to_all_single(receives, sends.contiguous(), group=group)
    return receives.tolist()


def exchange(rows: torch.Tensor, sends: list[int], receives: list[int], group) -> torch.Tensor:
    """The all-to-all of `rows` (differentiable when they need a gradient)."""
    if rows.requires_grad:
        return _AllToAll.apply(rows, sends, receives, group)
    return _all_to_all(rows, sends, receives, group)


# -- the layer --------------------------------------------------------------------------------------------------

class ExpertParallelExperts(Experts):
    """A rank's slice of a MoE layer's routed experts, run for the tokens of every rank of its expert group (the
    module docstring). `num_experts` is the layer's (routing and the router's load count all of them);
    `local_experts` this rank holds, from `first_expert`. The rollout's gathered copy (train/rollout_weights.py)
    calls it as it is (`rollout_shared`): its forward runs the all-to-alls."""

    rollout_shared = True

    def __init__(self, experts: Experts, group: ExpertGroup):
        num_experts = experts.num_experts
        if num_experts % group.size:
            raise ValueError(f"--expert-parallel {group.size} must divide the layer's {num_experts} routed experts.")
        nn.Module.__init__(self)
        self.num_experts, self.hidden_size, self.width = num_experts, experts.hidden_size, experts.width
        self.group = group
        mine = group.experts_of(num_experts)
        self.local_experts, self.first_expert = mine.stop - mine.start, mine.start
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[mine].clone(),
                                         requires_grad=experts.gate_up_proj.requires_grad)
        self.down_proj = nn.Parameter(experts.down_proj.detach()[mine].clone(),
                                      requires_grad=experts.down_proj.requires_grad)

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                provider: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """(y [T, d] in x's dtype, this rank's rows per expert [num_experts] int64), as Experts.forward."""
        T, k = chosen.shape
        group = self.group.group
        order, local_ids, counts, sends = dispatch_plan(chosen, self.num_experts, self.group.size)
        sends_list = sends.tolist()
        receives = exchange_counts(sends, group)
        rows = exchange(x.index_select(0, order // k), sends_list, receives, group)
        ids = _all_to_all(local_ids, sends_list, receives, group)
        arrange, sorted_ids, local_counts = receive_plan(ids, self.local_experts)
        out = self.sorted_rows(rows.index_select(0, arrange), local_counts, sorted_ids, max(rows.shape[0], 1),
                               provider)
        back = exchange(out.index_select(0, inverse_permutation(arrange)), receives, sends_list, group)
        return weighted_sum(back, order, weights).to(x.dtype), counts


def distribute_experts(model: nn.Module, group: ExpertGroup) -> nn.Module:
    """`model` with each MoE layer's routed experts replaced by this rank's slice of them (in place; returned)."""
    layers = [m for m in model.modules() if isinstance(m, MixtureOfExperts)]
    if not layers:
        raise ValueError(f"--expert-parallel {group.size}: {type(model).__name__} has no routed experts; only "
                         "mixture-of-experts models (LLaDA2) take expert parallelism.")
    for layer in layers:
        if not isinstance(layer.experts, ExpertParallelExperts):
            layer.experts = ExpertParallelExperts(layer.experts, group)
    return model


def expert_parallel_modules(model: nn.Module) -> list[ExpertParallelExperts]:
    return [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]


def is_expert_parameter(name: str) -> bool:
    """Whether a state-dict entry of a model (or of a wrapper of it) is a MoE layer's stacked routed experts."""
    return name.endswith((".experts.gate_up_proj", ".experts.down_proj"))


def local_experts(state: dict[str, torch.Tensor], group: ExpertGroup) -> dict[str, torch.Tensor]:
    """A whole state dict with each stacked routed-experts entry cut to this rank's slice (views)."""
    return {name: (tensor[group.experts_of(tensor.shape[0])] if is_expert_parameter(name) else tensor)
            for name, tensor in state.items()}


def whole_experts(tensor: torch.Tensor, group: ExpertGroup) -> torch.Tensor:
    """A rank's slice of stacked experts [E/N, ...] gathered over its expert group into [E, ...] (every rank of
    the group calls it)."""
    import torch.distributed as dist

    parts = [torch.empty_like(tensor) for _ in range(group.size)]
    dist.all_gather(parts, tensor.contiguous(), group=group.group)
    return torch.cat(parts)


__all__ = ["ExpertGroup", "ExpertParallelExperts", "distribute_experts", "dispatch_plan", "receive_plan",
           "weighted_sum", "local_experts", "whole_experts"]
