"""Scaling out on PyTorch's own engine: the process group of a torchrun launch, the DDP or FSDP2 wrapper, and what
the ranks exchange (barriers, gathered objects, averaged metrics, whole state dicts gathered from FSDP2's shards).

Each rank rolls out its own share of a step's prompts, so advantages stay within complete groups. Under DDP
gradients are all-reduced once per optimizer step (the objective's entry point runs every micro-batch but the last
under no_sync). Under FSDP2 every micro-batch's backward reduce-scatters into the sharded gradients, which
accumulate there: a rank never holds a whole gradient (likelihood/engine.default_grad_sync). The reference copy,
where there is one, is sharded like the policy. Rank 0 alone writes files (`Ranks.writer`).
"""

from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run: rank and world size ((0, 1) for a single process)."""

    rank: int = 0
    world: int = 1

    @property
    def writer(self) -> bool:
        """Whether this rank writes the run's files (rank 0)."""
        return self.rank == 0

    def share(self, count: int) -> slice:
        """This rank's slice of `count` items split evenly over the ranks (count is a multiple of world)."""
        size = count // self.world
        return slice(self.rank * size, (self.rank + 1) * size)

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def gather(self, value) -> list:
        """Every rank's `value` (picklable), in rank order."""
        if self.world == 1:
            return [value]
        values = [None] * self.world
        torch.distributed.all_gather_object(values, value)
        return values

    def average(self, row: dict) -> dict:
        """A metrics row with its float entries averaged over the ranks (each holds an equal share of the
        rollouts)."""
        if self.world == 1:
            return row
        rows = self.gather(row)
        return {k: (sum(r[k] for r in rows) / self.world if isinstance(v, float) else v) for k, v in row.items()}


@contextlib.contextmanager
def distributed_session(device: str):
    """The run's Ranks: under torchrun (WORLD_SIZE > 1) a process group for the run, gloo on CPU and NCCL on
    CUDA; a single process otherwise."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or dist.is_initialized():
        yield Ranks(dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else Ranks()
        return
    cuda = torch.cuda.is_available() and device in ("auto", "cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    finished = False
    try:  # joined inside: an interrupt right after joining must not leave the process group behind
        dist.init_process_group("nccl" if cuda else "gloo")
        yield Ranks(dist.get_rank(), dist.get_world_size())
        finished = True
    finally:
        if dist.is_initialized():
            leave_process_group(finished)


def leave_process_group(finished: bool) -> None:
    """Destroy the process group, in the order that lets every rank exit 0 (issue 45 item 6: a finished 2-rank
    DDP run's rank aborted at exit, 1 run in 24). A finished run waits for every rank at a barrier first, so none
    tears its side down while another still talks to it (a failed one cannot: its peers may never get there).
    Then the run's objects go (the DDP wrapper sits in reference cycles, and its reducer holds the group), so the
    group and its threads end in destroy_process_group, and not in the interpreter's teardown."""
    import torch.distributed as dist

    if finished:
        dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def sharded(parallel: str, ranks: Ranks) -> bool:
    """Whether the weights are FSDP2 shards (each rank holds a part of every tensor)."""
    return ranks.world > 1 and parallel == "fsdp2"


def check_offload(config, is_sharded: bool, world: int) -> None:
    """--fsdp-offload and --reference-offload place FSDP2's shards on the host: refused, naming the flag, where
    nothing is sharded (one process), and under one expert group (whose whole routed experts are not FSDP2's)."""
    flags = [flag for flag, on in (("--fsdp-offload", config.run.fsdp_offload),
                                   ("--reference-offload", config.run.reference_offload)) if on]
    if not flags:
        return
    if not is_sharded:
        raise ValueError(f"{' and '.join(flags)} true offload FSDP2's shards to the host, and this is one process: "
                         "nothing is sharded. Launch under torchrun (`torchrun --nproc-per-node N -m dllm_fast train "
                         "--parallel fsdp2 ...`), or leave them false.")
    if config.run.expert_parallel > 1 and config.run.expert_parallel == world:
        raise ValueError(f"{' and '.join(flags)} true with --expert-parallel {config.run.expert_parallel} on "
                         f"{world} ranks: one expert group keeps each rank's routed experts whole, outside FSDP2's "
                         "shards, so they cannot be offloaded; use an --expert-parallel that leaves several groups "
                         "(a divisor of the ranks smaller than them), or leave the offload off.")


def offload_policy(device: torch.device, offload: bool):
    """FSDP2's offload_policy for a model's units on `device`: CPUOffloadPolicy (shards in host memory, pinned on
    CUDA) when `offload`, else the plain OffloadPolicy (shards on the device)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    return CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()


def data_parallel_wrapper(model, parallel: str, ranks: Ranks, device: torch.device, *, mixed_precision=None,
                          offload: bool = False, ignored_params: set | None = None):
    """The model as every rank trains it: unchanged for one process, DDP, or FSDP2 (each of the model's
    `shard_units()`, then the root, whose unit holds the rest). mixed_precision: FSDP2's MixedPrecisionPolicy
    (train/precision.sharded_mixed_precision; None: each weight gathered in its own dtype). offload: FSDP2's
    CPUOffloadPolicy (`offload_policy`), the shards (and their gradients) in host memory, pinned on CUDA, each unit
    copied to `device` when it is gathered; on CPU they are where they were (the same numbers). A model without
    trainable weights (the reference copy) is sharded alike and holds no gradient. ignored_params: parameters
    FSDP2 leaves whole on each rank (expert parallelism's routed experts, each rank's own:
    train/expert_parallel.py); modules already sharded (fully_shard on another mesh) keep their own units."""
    if ranks.world == 1:
        return model
    if parallel == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (ranks.world,))
    policy = mixed_precision if mixed_precision is not None else MixedPrecisionPolicy()
    placement = offload_policy(device, offload)
    extra = {"ignored_params": set(ignored_params)} if ignored_params else {}
    for unit in model.shard_units():
        fully_shard(unit, mesh=mesh, mp_policy=policy, offload_policy=placement, **extra)
    return fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=placement, **extra)


def full_state(model, optimizer, is_sharded: bool, *, trainable_only: bool = False):
    """(model state, optimizer state) as whole tensors gathered from FSDP2's shards; (None, the optimizer's
    state) when the model holds whole tensors already. trainable_only: the model state holds the weights that
    train only (LoRA's adapters, named as the model's state_dict names them): a LoRA checkpoint never gathers the
    frozen base."""
    if not is_sharded:
        return None, optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if trainable_only:  # every rank gathers the same tensors in the same order
        model_state = {name: _whole(p).detach().cpu() for name, p in model.named_parameters() if p.requires_grad}
    else:
        model_state = get_model_state_dict(model, options=options)
    return model_state, get_optimizer_state_dict(model, optimizer, options=options)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """An FSDP2 shard's whole tensor (an all-gather); a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def set_full_state(model, optimizer, model_state: dict, optimizer_state: dict, is_sharded: bool, *,
                   partial: bool = False) -> None:
    """Load whole tensors into the model (and, when sharded, the optimizer: FSDP2 re-shards both). partial: the
    model state holds some of the model's weights (LoRA's adapters); the others stay as they are."""
    if not is_sharded:
        model.load_state_dict(model_state, strict=not partial)
        return
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, strict=not partial)
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=StateDictOptions(full_state_dict=True))
