"""A LoRA policy's weights with its adapters merged in, for rollouts (`merged_for_rollouts`).

Through PEFT's wrappers every adapted projection of every layer of every denoising step runs two skinny GEMMs
more (x A^T, then its product with B) and the delta's scale and add: at LLaDA-8B, r128 on the seven projections,
a batch of 32, 5% more FLOPs and a third more kernels per step, about 1.2 of the rollout's 8.4 s as the planner
counts it (without credit for inductor's fusion). Rolled out through merged weights, W + scaling * B A, each
projection is one GEMM again.

`merged_for_rollouts(policy)` keeps, per policy, one copy of the adapted weights (bf16 on a bf16 base: 14 GB at
LLaDA-8B with every projection adapted) and a plain model that shares every other weight (embeddings, norms, LM
head) with the policy. It refreshes the copy in place whenever the adapters or the base weights have changed since
(their version counters: an optimizer step bumps them), so a compiled rollout's CUDA graphs replay on the same
addresses. The merge rounds as PEFT's `merge` does: the fp32 delta added into the base weight, one rounding.

Exact in exact arithmetic, not bit for bit in bf16: x (W + s B A)^T rounds once where PEFT rounds x W^T, x A^T and
the sum (tests: fp64 rollouts token for token, bf16 merged weights equal to PEFT's own merge). Plain LoRA only
(no DoRA or other variants, no LoRA bias).
"""

from __future__ import annotations

import copy
import weakref

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from dllm_fast.models.layers import ProjectionSlice

_MERGED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # policy -> _Merged


def merged_for_rollouts(policy: nn.Module, *, refresh: bool = True) -> nn.Module:
    """The policy (a PEFT LoRA model, or a DDP wrapper of one) as a plain model with its active adapters merged
    into a copy of the adapted weights: what to roll out with. Built on the first call, refreshed in place when
    stale (refresh=False: built, not yet filled; the planner prepares it so), frozen and in eval mode."""
    core = _peft_model(policy)
    merged = _MERGED.get(core)
    if merged is None:
        merged = _MERGED[core] = _Merged(core)
    if refresh:
        merged.refresh()
    return merged.model


def _peft_model(policy: nn.Module) -> nn.Module:
    core = policy.module if isinstance(policy, nn.parallel.DistributedDataParallel) else policy
    if not hasattr(core, "get_base_model") or not lora_wrappers(core.get_base_model()):
        raise ValueError(f"merged rollouts need a PEFT LoRA model (peft.get_peft_model), got {type(core).__name__} "
                         "without LoRA adapters; roll out with the model itself.")
    return core


def lora_wrappers(model: nn.Module) -> dict[str, nn.Module]:
    """The LoRA wrappers of `model` by module name."""
    return {name: module for name, module in model.named_modules()
            if isinstance(getattr(module, "lora_A", None), nn.ModuleDict) and hasattr(module, "base_layer")}



def check_plain_lora(wrappers: dict[str, nn.Module]) -> None:
    """Refuse wrappers a merge cannot fold in: a LoRA variant (DoRA) or a LoRA bias."""
    for name, wrapper in wrappers.items():
        if getattr(wrapper, "lora_variant", None) or any(getattr(wrapper, "use_dora", {}).values()) or any(
                getattr(wrapper, "lora_bias", {}).values()):
            raise ValueError(f"merged rollouts support plain LoRA; {name} has a variant (DoRA) or a LoRA bias. "
                             "Roll out through the adapters instead.")


def add_lora_deltas(wrapper: nn.Module, merged: torch.Tensor, rows: slice) -> None:
    """merged[rows] += scaling * B A for each active adapter of `wrapper` (none while its adapters are disabled),
    as PEFT's merge adds them: the delta in the adapters' dtype, one rounding into `merged`'s. Call it under
    no_grad."""
    if wrapper.merged:
        raise ValueError("the policy's adapters are merged into its weights (merge_adapter); unmerge them before "
                         "merged rollouts, which merge a copy.")
    if wrapper.disable_adapters:
        return
    for name in wrapper.active_adapters:
        if name in wrapper.lora_A.keys():
            merged[rows] += wrapper.get_delta_weight(name)  # fp32 delta into bf16: one rounding


def _address(tensor: torch.Tensor) -> int:
    """Where a tensor's values live (a weight rebound to new values moves), or, for a planner's fake tensor, which
    has no address, its identity."""
    return id(tensor) if isinstance(tensor, FakeTensor) else tensor.data_ptr()


def merge_target(base_layer: nn.Module) -> tuple[nn.Parameter, slice]:
    """The parameter a wrapped layer's weight lives in and its rows there (a fused projection's part)."""
    if isinstance(base_layer, ProjectionSlice):
        return base_layer.fused.weight, slice(base_layer.start, base_layer.stop)
    if not isinstance(base_layer, nn.Linear):
        raise ValueError(f"merged rollouts merge LoRA on linear layers; {type(base_layer).__name__} is not one.")
    return base_layer.weight, slice(None)



class _Merged:
    def __init__(self, policy: nn.Module):
        self.policy = weakref.ref(policy)
        base = policy.get_base_model()
        self.wrappers = lora_wrappers(base)
        check_plain_lora(self.wrappers)
        # The modules' structure is copied, every weight shared (deepcopy's memo maps it to itself); then each
        # adapted weight's owner in the copy (an nn.Linear, or a fused projection's FusedLinear) gets its own.
        memo = {id(t): t for t in (*base.parameters(), *base.buffers())}
        model = copy.deepcopy(base, memo)
        for name in self.wrappers:  # the wrappers give way to their base layers
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, getattr(parent, child).get_base_layer())
        for module in model.modules():  # a forward set on an instance is a closure over the policy's module: the
            module.__dict__.pop("forward", None)  # copy would run the policy's layers (the adapters) through it
        self.model = model.eval()
        copies: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(policy's weight) -> (it, its merged copy)
        self.parts = []  # (wrapper, merged copy, its rows)
        for name, wrapper in self.wrappers.items():
            source, rows = merge_target(wrapper.get_base_layer())
            if id(source) not in copies:
                layer = model.get_submodule(name)
                owner = layer.fused if isinstance(layer, ProjectionSlice) else layer
                owner.weight = nn.Parameter(torch.empty_like(source), requires_grad=False)
                copies[id(source)] = (source, owner.weight)
            self.parts.append((wrapper, copies[id(source)][1], rows))
        self.pairs = list(copies.values())  # (policy's weight, its merged copy)
        self.state = None

    def _state(self) -> tuple:
        """What the merged weights were computed from: every source weight's and adapter weight's storage and
        version, the active adapters and their scales."""
        tensors = [source for source, _ in self.pairs]
        key = []
        for wrapper, _, _ in self.parts:
            for name in wrapper.active_adapters:
                if name in wrapper.lora_A.keys():
                    tensors += [wrapper.lora_A[name].weight, wrapper.lora_B[name].weight]
                    key.append((name, wrapper.scaling[name], wrapper.disable_adapters))
        return tuple(key), tuple((_address(t), t._version) for t in tensors)

    def refresh(self) -> None:
        state = self._state()
        if state == self.state:
            return
        device = self.pairs[0][1].device.type
        with torch.no_grad(), torch.autocast(device, enabled=False):  # the merge in the adapters' dtype
            for source, merged in self.pairs:
                merged.copy_(source)
            for wrapper, merged, rows in self.parts:
                add_lora_deltas(wrapper, merged, rows)
        self.state = state
