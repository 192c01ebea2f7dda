"""The planner's ledger: memory by category, and FLOPs, bytes moved, roofline time, kernels and host syncs, op by
op, while a step runs on fake tensors.

`Accountant` is a TorchDispatchMode placed above the fake mode, so it sees every op before the fake kernel runs.

Memory. Every storage an op creates is counted, from its creation to its last reference, in one category:
parameters, gradients, optimizer_state, activations (saved for backward, found through saved_tensors_hooks),
kv_cache (allocated inside `allocating_as("kv_cache")`) or temporaries (everything else: inputs, outputs,
intermediate values). A compiled op's workspace (dllm_fast.ops.costs) counts as temporaries for the duration of
the call. On a CUDA target each storage is rounded up to the caching allocator's 512-byte blocks. The peak is
the largest total alive at once, with its split by category.

Cost. FLOPs come from torch.utils.flop_counter's formulas (the compiled ops register theirs in
dllm_fast.ops.costs); bytes moved are the distinct bytes an op reads and writes (a view moves none; a compiled op
adds its declared workspace traffic); the roofline time of an op is max(FLOPs / peak FLOP/s for its dtype,
bytes / bandwidth) on the target GPU, summed over ops. It counts no launch overhead and no overlap: each op is
one kernel running at the roofline. A host sync is an op whose result the host must wait for (.item(), a bool
of a tensor, nonzero).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass, field, fields

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

from dllm_fast.ops import costs as op_costs
from dllm_fast.planning.gpus import GPU

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "kv_cache", "temporaries")
CUDA_BLOCK = 512  # the CUDA caching allocator rounds every allocation up to a multiple of this
aten = torch.ops.aten

# Ops the host waits on: their result (a number or a data-dependent shape) is read on the CPU.
HOST_SYNCS = {aten._local_scalar_dense, aten.nonzero, aten.equal, aten.masked_select, aten._unique2,
              aten.unique_dim, aten.unique_consecutive}
# Ops that write their first argument without reading it.
_OVERWRITES = {aten.copy_, aten.fill_, aten.zero_}
_METADATA = {torch.ops.prim.device.default, aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default,
             aten.sym_storage_offset.default, aten.is_contiguous.default}
_FACTORIES = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided}


# torch's flop counter has no formula for the CPU flash attention kernel SDPA runs on fake CPU tensors; it does the
# same GEMMs as the CUDA kernels it stands in for.
@register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu)
def _cpu_flash_attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


@register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward)
def _cpu_flash_attention_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args,
                                        out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


@dataclass
class Costs:
    """What some ops cost: FLOPs, bytes moved, roofline seconds on the target GPU, kernels, host syncs."""

    flops: float = 0.0
    bytes: float = 0.0
    seconds: float = 0.0
    kernels: int = 0
    syncs: int = 0

    def __add__(self, other: "Costs") -> "Costs":
        return Costs(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __sub__(self, other: "Costs") -> "Costs":
        return Costs(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def scaled(self, factor: float) -> "Costs":
        return Costs(*(type(getattr(self, f.name))(getattr(self, f.name) * factor) for f in fields(self)))


@dataclass
class Mark:
    """A point to measure from: the costs and the memory at that point, and the peak since (by category)."""

    costs: Costs
    memory: dict[str, int]
    peak: int
    peak_memory: dict[str, int]
    category_peaks: dict[str, int] = None  # the most each category held at once since the mark

    def __post_init__(self):
        if self.category_peaks is None:
            self.category_peaks = dict(self.memory)

    def peak_above(self) -> dict[str, int]:
        """The peak since the mark, above the memory at the mark, by category."""
        return {c: self.peak_memory[c] - self.memory[c] for c in CATEGORIES}


@dataclass
class Target:
    """What a plan is for: the device type whose kernels' workspaces count ("cuda" or "cpu"), and the GPU whose
    peaks give the roofline (None on CPU: no time)."""

    device_type: str
    gpu: GPU | None = None
    allow_tf32: bool = False


class Accountant(TorchDispatchMode):
    """See the module docstring. Enter it inside the fake mode; `track` the tensors made outside any op (the
    model's parameters, constants built by the planner), `watch_gradients` of the parameters."""

    def __init__(self, target: Target):
        super().__init__()
        self.target = target
        self.costs = Costs()
        self.memory = dict.fromkeys(CATEGORIES, 0)
        self.total = 0
        self._live: dict[int, list] = {}  # id(storage) -> [bytes, category, weakref to the storage]
        self._category = "temporaries"
        self._marks: list[Mark] = []
        self._hooks = []
        self._saved = None
        self.before_op = None  # called before each op (the replayer attributes backward ops to recorded calls)
        self.cached_casts: set[int] = set()  # storages of trainable weights cast by autocast, which caches them
        self._host: dict[int, weakref.ref] = {}  # storages on the host: no device memory, no kernels

    # -- memory -------------------------------------------------------------------------------------------
    def _bytes(self, storage) -> int:
        size = storage.nbytes()
        if self.target.device_type == "cuda" and size:
            size = CUDA_BLOCK * math.ceil(size / CUDA_BLOCK)
        return size

    def host_resident(self, tensor: torch.Tensor) -> None:
        """`tensor` lives on the host in the real run (e.g. AdamW's step counters): it takes no device memory,
        and ops on host tensors alone launch no kernel and read nothing back from the device."""
        storage = tensor.untyped_storage()
        self._free(id(storage))
        key = id(storage)
        self._host[key] = weakref.ref(storage, lambda _, key=key: self._host.pop(key, None))

    def _on_host(self, tensors: list[torch.Tensor]) -> bool:
        return bool(tensors) and all(id(t.untyped_storage()) in self._host for t in tensors)

    def _category_of(self, tensor: torch.Tensor) -> str | None:
        entry = self._live.get(id(tensor.untyped_storage()))
        return None if entry is None else entry[1]

    def live_storages(self) -> set[int]:
        return set(self._live)

    def size_of_storages(self, keys, category: str | None = None) -> int:
        """Bytes of the live storages among `keys` (those in `category`, when given)."""
        return sum(self._live[k][0] for k in keys if k in self._live and category in (None, self._live[k][1]))

    def size_of(self, tensor: torch.Tensor) -> int:
        return self._bytes(tensor.untyped_storage())

    def track(self, tensor: torch.Tensor, category: str | None = None) -> None:
        """Count `tensor`'s storage from now until it is freed (in `category`, or the current allocation's);
        a storage already counted keeps its category unless one is given."""
        storage = tensor.untyped_storage()
        entry = self._live.get(id(storage))
        if entry is not None:
            if category is not None:
                self._move(entry, category)
            return
        size = self._bytes(storage)
        category = category or self._category
        key = id(storage)
        entry = [size, category, weakref.ref(storage, lambda _, key=key: self._free(key))]
        self._live[key] = entry
        self.memory[category] += size
        self.total += size
        self._raise_peaks()

    def classify(self, tensor: torch.Tensor, category: str, *, only_from: str | None = None) -> None:
        """Count `tensor`'s storage as `category` from now on (if it is currently `only_from`, when given)."""
        entry = self._live.get(id(tensor.untyped_storage()))
        if entry is None:
            if only_from is None:
                self.track(tensor, category)
        elif only_from is None or entry[1] == only_from:
            self._move(entry, category)

    def _move(self, entry: list, category: str) -> None:
        self.memory[entry[1]] -= entry[0]
        self.memory[category] += entry[0]
        entry[1] = category

    def _free(self, key: int) -> None:
        self.cached_casts.discard(key)
        entry = self._live.pop(key, None)
        if entry is not None:
            self.memory[entry[1]] -= entry[0]
            self.total -= entry[0]

    def _raise_peaks(self, extra: dict[str, int] | None = None, memory: dict[str, int] | None = None,
                     marks: list[Mark] | None = None) -> None:
        memory = self.memory if memory is None else memory
        total = (self.total if memory is self.memory else sum(memory.values())) + (sum(extra.values()) if extra else 0)
        for mark in self._marks if marks is None else marks:
            peaks = mark.category_peaks
            for category, size in memory.items():
                held = size + (extra.get(category, 0) if extra else 0)
                if held > peaks[category]:
                    peaks[category] = held
            if total > mark.peak:
                mark.peak = total
                mark.peak_memory = dict(memory)
                if extra:
                    for category, size in extra.items():
                        mark.peak_memory[category] += size

    def assert_peak(self, extra: dict[str, int]) -> None:
        """Count a transient: memory above what is alive now, by category, that an op or a replayed call holds
        for a moment (a kernel's workspace, the peak of a call that is not run again)."""
        self._raise_peaks(extra)

    def assert_peak_at(self, memory: dict[str, int], extra: dict[str, int], marks: list[Mark]) -> None:
        """`assert_peak` at an earlier moment, when `memory` was alive, for the marks that were open then."""
        self._raise_peaks(extra, memory, [m for m in marks if m in self._marks])

    def active_marks(self) -> list[Mark]:
        return list(self._marks)

    @contextlib.contextmanager
    def allocating_as(self, category: str):
        """New storages made inside the block count as `category` (e.g. the KV cache)."""
        previous, self._category = self._category, category
        try:
            yield
        finally:
            self._category = previous

    def watch_gradients(self, parameters) -> None:
        """Count each parameter's .grad as gradients once autograd has accumulated it."""
        for p in parameters:
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    lambda p: self.classify(p.grad, "gradients")))

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.classify(tensor, "activations", only_from="temporaries")
        return tensor

    # -- marks --------------------------------------------------------------------------------------------
    def mark(self) -> Mark:
        """Start measuring: close it with `release`."""
        mark = Mark(Costs() + self.costs, dict(self.memory), self.total, dict(self.memory))
        self._marks.append(mark)
        return mark

    def release(self, mark: Mark) -> Mark:
        self._marks.remove(mark)
        return mark

    def add_costs(self, costs: Costs) -> None:
        self.costs = self.costs + costs

    # -- ops ----------------------------------------------------------------------------------------------
    def __enter__(self):
        self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._saved.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._saved.__exit__(*exc)
        return out

    def close(self) -> None:
        """Remove the gradient hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _METADATA:  # .device, .size() of a fake tensor: no kernel, and the hot path
            return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        if self.before_op is not None:
            self.before_op()
        packet = func.overloadpacket
        inputs = _tensors((args, kwargs))
        if self._on_host(inputs):
            out = func(*args, **kwargs)
            for t in _tensors(out):
                self.host_resident(t)
            return out
        extra = None
        namespace, _, op = packet._qualified_op_name.partition("::")
        if namespace == "dllm_fast":
            if op not in op_costs.WORKSPACES:
                raise KeyError(f"dllm_fast::{op} declares no workspace in dllm_fast/ops/costs.py; declare what its "
                               "kernels allocate so that plans count it.")
            extra = op_costs.workspace(op, self.target.device_type, args)
        if packet in HOST_SYNCS:
            self.costs.syncs += 1
        out = func(*args, **kwargs)
        outputs = _tensors(out)
        self._count(func, packet, args, kwargs, outputs, extra)
        for t in outputs:
            self.track(t)
        if (packet is aten._to_copy and args[0].requires_grad and args[0].is_leaf
                and torch.is_autocast_enabled("cpu") and self._category_of(args[0]) == "parameters"):
            # autocast keeps this cast of a trainable leaf until the autocast region ends
            self.cached_casts.add(id(outputs[0].untyped_storage()))
        if extra is not None and extra.bytes:
            self.assert_peak({"temporaries": extra.bytes})
        return out

    def _count(self, func, packet, args, kwargs, outputs, extra) -> None:
        if not outputs and packet not in HOST_SYNCS:  # a metadata query (device, size): no kernel
            return
        flop_formula = flop_registry.get(packet)
        flops = flop_formula(*args, **kwargs, out_val=outputs[0] if len(outputs) == 1 else tuple(outputs)) \
            if flop_formula is not None else 0
        moved = 0 if (func.is_view or packet in _FACTORIES) else _moved_bytes(packet, args, kwargs, outputs)
        if extra is not None:
            moved += extra.traffic
        if not flops and not moved:
            return
        self.costs.flops += flops
        self.costs.bytes += moved
        self.costs.kernels += 1
        gpu = self.target.gpu
        if gpu is not None:
            compute = flops / gpu.peak_flops(_compute_dtype(args), allow_tf32=self.target.allow_tf32) if flops else 0.0
            self.costs.seconds += max(compute, moved / gpu.bandwidth)


def flat_values(tree):
    """The leaves of nested tuples, lists and dicts (a cheaper tree_flatten for op arguments)."""
    if isinstance(tree, (tuple, list)):
        for item in tree:
            yield from flat_values(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from flat_values(item)
    else:
        yield tree


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    return [t for t in flat_values(tree) if isinstance(t, torch.Tensor)]


def _distinct_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements a tensor addresses (a broadcast dimension, stride 0, is read once)."""
    elements = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            elements *= size
    return elements * t.element_size()


def _moved_bytes(packet, args, kwargs, outputs) -> int:
    inputs = _tensors((args[1:], kwargs) if packet in _OVERWRITES else (args, kwargs))
    return sum(_distinct_bytes(t) for t in inputs) + sum(_distinct_bytes(t) for t in outputs)


def _compute_dtype(args) -> torch.dtype:
    for t in _tensors(args):
        if t.is_floating_point():
            return t.dtype
    return torch.float32
