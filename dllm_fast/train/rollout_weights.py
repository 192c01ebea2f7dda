"""Rollouts that gather once: under FSDP2, a rollout's 64-256 denoising forwards would each all-gather every
weight of the policy. `GatheredWeights` instead keeps a plain (unsharded, un-hooked) copy of the policy's module
tree, fills it once a step through one FSDP2 unshard of each unit (one all-gather a unit a step, in the
MixedPrecisionPolicy's dtype when it has one), and the rollout samples through the copy with no collective.

The two paths and the rule between them (`rollout_path`, the planner's and train's: train/rollout_rule.py, which
imports nothing of the planner's, so that planning/parallel.py can take it without importing this module back):

- "gathered": the copy; taken when the rollout's peak with the copy stays within ROLLOUT_MARGIN of the GPU's
  memory (or where no limit is known: on CPU). With LoRA the copy holds the merged weights W + s B A (models/
  merged_lora.py's merge, computed while each unit is unsharded) when --lora-merge-rollouts is on, else the
  adapters as modules of their own. The copy's dtype is the rollout's compute dtype (bf16 under autocast, as
  FSDP2's bf16 gathers give it; the parameters' own dtype without autocast), so a rollout on the copy computes
  what one on the per-layer gathers computes.
- "sharded": FSDP2's own per-layer gathers at every forward, each layer prefetching the next
  (`prefetch_next_units`), the rank's whole batch in one forward a denoising step (generate runs every row of
  the batch at once), so each gather serves every prompt.

Kept or freed (`keep_copy`, measured): after each step, the copy's storage is kept for the next step when the
step's measured peak without it plus the copy stays within ROLLOUT_MARGIN of the device's memory (refilled in
place next step: the same addresses, so a compiled rollout's CUDA graphs replay); otherwise its storage is freed
after each rollout and allocated again at the next. Unmeasured (CPU), it is freed.

Expert parallelism (the seam): modules that `shared(module)` names (by default those whose `rollout_shared`
attribute is true and whose parameters are whole) are not copied; the copy calls the policy's own modules. Under
expert parallelism with one expert group these are the routed experts (`Experts`), which each rank holds itself
(E / N_e of them) and whose forward runs the all-to-alls: the copy then holds the dense weights only. With several
groups (world > N_e) FSDP2 shards a rank's experts over their replicas: the copy then gathers them like the rest
(one all-gather of their unit a step) and its plain copy of the expert module runs the same all-to-alls.
`GatheredWeights` refuses a shared module with sharded parameters (a `shared` predicate that names one).

On one process (no FSDP2) nothing changes: the rollout runs on the policy (or merged_lora's copy), as before.
"""

from __future__ import annotations

import copy as copying
from typing import Callable

import torch
from torch import nn

from dllm_fast.models.merged_lora import add_lora_deltas, check_plain_lora, lora_wrappers, merge_target
from dllm_fast.train.rollout_rule import ROLLOUT_MARGIN, PATHS, keep_copy, rollout_path  # noqa: F401 (re-exported)

def shared_with_the_copy(module: nn.Module) -> bool:
    """The seam's default: a module whose `rollout_shared` attribute is true (an expert-parallel wrapper of a rank's
    own routed experts) is called by the copy as it is, when it holds its parameters whole; sharded by FSDP2 (a
    rank's experts over their replicas, when there are several expert groups) the copy holds them gathered, like
    the dense weights, and its copy of the module runs the same all-to-alls."""
    return bool(getattr(module, "rollout_shared", False)) and not any(_is_sharded(p) for p in module.parameters())


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 modules of `model` (each holds one unit's parameters), in module order."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def prefetch_next_units(model: nn.Module) -> None:
    """Each FSDP2 layer unit of `model` prefetches the next one's all-gather in the forward (and the previous one's
    in the backward), so that a gather overlaps the layer before it."""
    units = [m for m in fsdp_units(model) if m is not model]
    for i, unit in enumerate(units):
        if i + 1 < len(units):
            unit.set_modules_to_forward_prefetch([units[i + 1]])
        if i > 0:
            unit.set_modules_to_backward_prefetch([units[i - 1]])


def _is_sharded(tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _original_class(module: nn.Module) -> type:
    """The class `module` had before fully_shard put FSDP's class in front of it."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if issubclass(cls, FSDPModule):
        return cls.__mro__[cls._orig_cls_mro_index]
    return cls


# Entries of a module's __dict__ a plain copy leaves behind: FSDP2's marks and composable state, an instance forward
_DROPPED = ("forward", "_is_fsdp_managed_module", "_fsdp_use_orig_params")
_KEPT = ("training", "_parameters", "_buffers", "_non_persistent_buffers_set", "_modules")


class GatheredWeights:
    """A plain copy of an FSDP2-sharded policy for rollouts (see the module docstring). `gather()` fills it (one
    all-gather a unit) and returns the model to sample through; `release()` frees its storage unless `keep`."""

    def __init__(self, policy: nn.Module, *, dtype: torch.dtype | None = None, merge_adapters: bool = False,
                 shared: Callable[[nn.Module], bool] | None = None, device: torch.device | None = None):
        """policy: the FSDP2-wrapped policy (a PEFT LoRA model or the model itself). dtype: the copy's (None: each
        parameter's own). merge_adapters: LoRA's adapters merged into the copy's weights. shared: modules the copy
        calls as they are instead of copying (the seam for expert parallelism). device: where the copy lives (None:
        each parameter's own; the compute device under --fsdp-offload, whose shards are on the host)."""
        self.policy, self.dtype, self.shared, self.device = policy, dtype, shared or shared_with_the_copy, device
        root = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        wrappers = lora_wrappers(root) if merge_adapters else {}
        check_plain_lora(wrappers)
        self._sources: dict[tuple[int, str], nn.Parameter] = {}  # (id(policy module), name) -> the copy's tensor
        self._deltas: list[tuple[nn.Module, nn.Parameter, slice]] = []  # (wrapper, its merged weight, rows)
        self._memo: dict[int, nn.Module] = {}
        merged = {id(w): w for w in wrappers.values()}
        self.model = self._plain(root, merged).eval()
        for clone in self._memo.values():  # references to modules of the tree that are not submodules (a fused
            for key, value in list(clone.__dict__.items()):  # projection's slices hold their FusedLinear)
                if isinstance(value, nn.Module) and id(value) in self._memo and key not in _KEPT:
                    clone.__dict__[key] = self._memo[id(value)]
        for wrapper in wrappers.values():
            source, rows = merge_target(wrapper.get_base_layer())
            owner = next(m for m in root.modules() if any(p is source for p in m._parameters.values()))
            name = next(n for n, p in owner._parameters.items() if p is source)
            self._deltas.append((wrapper, self._sources[(id(owner), name)], rows))
        self.keep = False
        self.gathers = 0

    @property
    def nbytes(self) -> int:
        """The copy's bytes."""
        return sum(t.numel() * t.element_size() for t in self._sources.values())

    def _plain(self, module: nn.Module, merged: dict[int, nn.Module]) -> nn.Module:
        if self.shared(module):
            for name, parameter in module.named_parameters():
                if _is_sharded(parameter):
                    raise ValueError(f"the rollout copy shares {type(module).__name__} with the policy, and its "
                                     f"parameter {name} is an FSDP2 shard; hold it whole on the rank for rollouts "
                                     "(train/rollout_weights.py), or do not share it.")
            return module
        if id(module) in merged:  # a LoRA wrapper merged away: its base layer, whose weight gets the deltas
            module = module.get_base_layer()
        if id(module) in self._memo:
            return self._memo[id(module)]
        clone = object.__new__(_original_class(module))
        state = {k: v for k, v in module.__dict__.items()
                 if k not in _DROPPED and not k.startswith("__composable_api")}
        for key, value in nn.Module().__dict__.items():  # hooks and the like: empty, as in a new module
            if key not in _KEPT:
                state[key] = copying.copy(value)
        parameters = {}
        for name, parameter in module._parameters.items():
            if parameter is None:
                parameters[name] = None
                continue
            dtype = self.dtype if self.dtype is not None and parameter.is_floating_point() else parameter.dtype
            device = self.device if self.device is not None else parameter.device
            tensor = nn.Parameter(torch.empty(parameter.shape, dtype=dtype, device=device),
                                  requires_grad=False)
            tensor.untyped_storage().resize_(0)  # allocated at the first gather
            parameters[name] = tensor
            self._sources[(id(module), name)] = tensor
        state["_parameters"] = parameters
        state["_buffers"] = dict(module._buffers)
        state["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
        self._memo[id(module)] = clone
        state["_modules"] = {name: None if child is None else self._plain(child, merged)
                             for name, child in module._modules.items()}
        clone.__dict__.update(state)
        return clone

    def _allocate(self) -> None:
        for tensor in self._sources.values():
            storage = tensor.untyped_storage()
            if storage.size() == 0:
                storage.resize_(tensor.numel() * tensor.element_size())

    def gather(self) -> nn.Module:
        """Fill the copy from the policy's shards, one FSDP2 unshard (one all-gather) a unit, and return it."""
        self._allocate()
        modules = {id(m): m for m in self.policy.modules()}
        pending, deltas = dict(self._sources), list(self._deltas)

        def fill() -> None:  # what is whole now: the unsharded unit's weights, then its adapters' deltas
            for key in [k for k in pending if not _is_sharded(modules[k[0]]._parameters[k[1]])]:
                pending.pop(key).copy_(modules[key[0]]._parameters[key[1]])
            for part in [d for d in deltas if not any(_is_sharded(p) for p in d[0].parameters())]:
                deltas.remove(part)
                add_lora_deltas(*part)

        device = next(iter(self._sources.values())).device.type
        with torch.no_grad(), torch.autocast(device, enabled=False):
            for unit in fsdp_units(self.policy):
                unit.unshard()
                try:
                    fill()
                finally:
                    unit.reshard()
            fill()  # without FSDP2 (a single process): everything is whole
        if pending or deltas:
            raise RuntimeError(f"the rollout copy found {len(pending)} weights and {len(deltas)} adapters in no "
                               "FSDP2 unit of the policy; it cannot fill them.")
        self.gathers += 1
        return self.model

    def release(self) -> None:
        """Free the copy's storage, unless `keep` (then the next gather refills it in place)."""
        if self.keep:
            return
        for tensor in self._sources.values():
            tensor.untyped_storage().resize_(0)


def rollout_weights_for(policy: nn.Module, config, ranks, device: torch.device, precision) -> tuple[
        GatheredWeights | None, str]:
    """(the gathered copy to roll out on, or None for the policy itself; the setup note saying which and why) for a
    run of `config` (a TrainConfig) whose `policy` is FSDP2-sharded over `ranks`. On CUDA, "auto" asks the planner
    (rank 0's plan of its step on this device: planning/parallel.py applies `rollout_path` to the rollout's planned
    peak with the copy, against the device's whole memory, since the plan counts every allocation of the step);
    elsewhere no limit is known and the copy is taken. Every rank takes rank 0's answer (their collectives must
    match). Each FSDP2 layer unit prefetches the
    next (`prefetch_next_units`) for the forwards that run sharded."""
    prefetch_next_units(policy)
    choice = config.run.rollout_weights
    merge = config.lora.enabled and config.lora.merge_rollouts
    copy = None if choice == "sharded" else GatheredWeights(policy, dtype=precision.compute, merge_adapters=merge,
                                                            device=device)
    if copy is None:
        path, why = rollout_path(choice, 0, 0, None)
    elif choice == "auto" and device.type == "cuda":  # rank 0 plans, the others take its answer
        path, why = _planned_path(config, ranks, device) if ranks.rank == 0 else (None, None)
    else:
        path, why = rollout_path(choice, copy.nbytes, 0, None)
    path, why = ranks.gather((path, why))[0]
    if path == "sharded":
        copy = None
    what = ("a plain copy of the weights gathered once a step" + (", LoRA merged into it" if merge else "")
            if copy is not None else "FSDP2's per-layer gathers at every forward, each layer prefetching the next"
            + (" (the LoRA adapters unmerged: --lora-merge-rollouts merges into a gathered copy)" if merge else ""))
    return copy, f"--rollout-weights {choice}: rollouts run on {what} ({why})"


def _planned_path(config, ranks, device: torch.device) -> tuple[str, str]:
    """The planner's rollout path for a rank of `ranks` on the CUDA `device` (train/micro_batch.py's entry for
    it, with the device's whole memory: the plan counts the weights and states it already holds)."""
    import dataclasses
    import os
    import time

    from dllm_fast.planning.planner import parallel_settings, plan_step
    from dllm_fast.train.micro_batch import device_gpu

    started = time.perf_counter()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", ranks.world))
    settings = parallel_settings(config, world=ranks.world, gpus_per_node=per_node, rollout_weights="auto")
    planned = config.replace(rollout={"compile": False})
    try:
        gpu = dataclasses.replace(device_gpu(device), memory=torch.cuda.get_device_properties(device).total_memory)
        plan = plan_step(planned, gpu=gpu, search=False, parallel=settings)
    except (ValueError, RuntimeError) as error:  # per-layer gathers need no memory beyond the step's own
        return "sharded", f"the planner could not plan this step ({' '.join(str(error).split())})"
    parallel = plan.parallel_plan
    return parallel.rollout_path, f"{parallel.rollout_reason}; planned in {time.perf_counter() - started:.0f} s"
