"""The planner's ledger: memory by category, and FLOPs, bytes moved, time, kernels and host syncs, op by op,
while a step runs on fake tensors.

`Accountant` is a TorchDispatchMode placed above the fake mode, so it sees every op before the fake kernel runs.

Memory. Every storage an op creates is counted, from its creation to its last reference, in one category:
parameters, gradients, optimizer_state, activations (saved for backward, found through saved_tensors_hooks),
kv_cache (allocated inside `allocating_as("kv_cache")`) or temporaries (everything else: inputs, outputs,
intermediate values). A compiled op's workspace (dllm_fast.ops.costs) counts as temporaries for the duration of
the call. On a CUDA target each storage is rounded up to the caching allocator's 512-byte blocks. The peak is
the largest total alive at once, with its split by category.

Cost. FLOPs come from torch.utils.flop_counter's formulas (the compiled ops register theirs in
dllm_fast.ops.costs, and declare their GEMMs by operand type); bytes moved are the distinct bytes an op reads and
writes (a view moves none; a compiled op adds its declared workspace traffic). Each op that moves or computes
something is one kernel, except where the GPU runs it in another form than the fake CPU tensors a plan runs on
(the rules of benchmarks/bench_rollout.py's profiler count, which matched the GPU's within 1%):

- an op whose output aliases its input's storage without the schema calling it a view (`_unsafe_view`, the
  reshape of a GEMM's output) is a view: no kernel, no bytes;
- a function CUDA runs as one fused kernel that decomposes into several ops on CPU (`rms_norm`: pow, mean, add,
  rsqrt, mul on CPU) is one kernel reading its inputs and writing its output; the ops of its CPU form still
  allocate, but count nothing (`_FUSED_ON_GPU`; its backward, if any, is counted op by op);
- an op whose CUDA implementation dispatches a copy or a fill before its own kernel (out-of-place masked_fill:
  a clone, then the fill; sort: the values' copy, the indices' fill, the sort) counts them (`_GPU_KERNELS`);
- a value check the plan answers without computing it (isfinite on a model output, fake.FiniteValues) counts
  the kernels the GPU launches for it (`count_kernels`).

On a GPU target, time has three parts (calibration.py holds the fitted factors):

- device: max(GEMM FLOPs / (the peak of their operand type x its efficiency), bytes / (bandwidth x its
  efficiency)); a compiled op runs its GEMMs, then its chunk traffic;
- host: eager PyTorch spends `eager_launch` seconds launching each kernel; inside a CUDA graph
  (`graph_replay`, a compiled rollout step) kernels cost no host time and the replay costs `graph_launch`;
- wall (`Costs.seconds`): host and device overlap between host syncs (the launch queue runs ahead of the GPU),
  so each stretch of work between two syncs takes max(host, device), and the stretches add up. The queue is
  bounded (`launch_queue` pending launches; then cudaLaunchKernel blocks until the GPU frees an entry), so the
  host runs at most that many launches ahead: a stretch also ends every `launch_queue` launches (a barrier: the
  host waits, but reads nothing back), and a GPU-bound stretch (a denoising step that refreshes the cache) no
  longer hides the launches of the host-bound ones around it.

`roofline_seconds` keeps the datasheet floor: every kernel at its peak, launches free. A host sync is an op whose
result the host must wait for (.item(), a bool of a tensor, nonzero).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

from dllm_fast.ops import costs as op_costs
from dllm_fast.planning.calibration import DEFAULT as DEFAULT_CALIBRATION, Calibration
from dllm_fast.planning.gpus import GPU

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "kv_cache", "temporaries")
CUDA_BLOCK = 512  # the CUDA caching allocator rounds every allocation up to a multiple of this
aten = torch.ops.aten

# Ops the host waits on: their result (a number or a data-dependent shape) is read on the CPU.
HOST_SYNCS = {aten._local_scalar_dense, aten.nonzero, aten.equal, aten.masked_select, aten._unique2,
              aten.unique_dim, aten.unique_consecutive}
# Ops that write their first argument without reading it.
_OVERWRITES = {aten.copy_, aten.fill_, aten.zero_}
# Ops that read only the rows they gather from their first argument (a table): as many bytes as they write.
_GATHERS = {aten.embedding, aten.index_select}
# In-place ops that write only the indexed rows of their first argument: they read the index and the values and
# write as many bytes as the values hold (a KV-cache write moves the new rows, not the cache).
_INDEXED_WRITES = {aten.index_copy_, aten.index_put_, aten._index_put_impl_, aten.index_fill_}
_METADATA = {torch.ops.prim.device.default, aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default,
             aten.sym_storage_offset.default, aten.is_contiguous.default}
_FACTORIES = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided}
# Ops whose CUDA implementation launches kernels of its own before the op's (see the module docstring): an
# out-of-place masked_fill clones, then fills; a sort copies the values and fills the indices, then sorts.
_GPU_KERNELS = {aten.masked_fill: 2, aten.sort: 3}
# torch's fused AdamW (train/optimizer.py): it reads the weights, gradients, moments and step counts and writes the
# weights, moments and counts (the gradients only with a grad scaler, which train does not use), 28 bytes a
# trained fp32 element, in CUDA's multi-tensor launches (_multi_tensor_kernels).
_FUSED_ADAM = {aten._fused_adam_, aten._fused_adamw_}
_FUSED_ADAM_WRITES = (0, 2, 3, 4, 5)  # params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps
_MULTI_TENSOR = _FUSED_ADAM
# Functions a GPU runs as one fused kernel, which decompose into several ops on the CPU tensors a plan runs on.
_FUSED_ON_GPU = {torch.rms_norm, F.rms_norm}


# torch's flop counter has no formula for the CPU flash attention kernel SDPA runs on fake CPU tensors; it does the
# same GEMMs as the CUDA kernels it stands in for.
@register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu)
def _cpu_flash_attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


@register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward)
def _cpu_flash_attention_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args,
                                        out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# torch's flop counter has no formula for the grouped GEMM of a mixture of experts' routed experts
# (models/moe.py); each row meets only its own group's matrix. By operand ranks, with offs splitting the 2D side:
# (2D, 3D) rows by expert, out [M, N]; (3D, 3D) a batch, out [E, M, N]; (2D, 2D) the contracted dim split (the
# weights' gradient), out [E, M, N]; (3D, 2D) the output columns split, out [M, N].
@register_flop_formula(aten._grouped_mm)
def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    contracted = a_shape[-1]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * out_shape[1] * out_shape[2] * contracted
    return 2 * math.prod(out_shape) * contracted


# Fields of Costs that add up; the rest describe the ends of its timeline (see Costs).
ADDITIVE = ("flops", "bytes", "kernels", "syncs", "device_seconds", "host_seconds", "roofline_seconds")


@dataclass
class Costs:
    """What some ops cost: FLOPs, bytes moved, kernels, host syncs, and time on the target GPU.

    device_seconds / host_seconds: the GPU's busy time and the host's launch time, summed. roofline_seconds: the
    datasheet floor. `seconds`: the wall-time estimate, host and device overlapping between syncs (and barriers:
    a full launch queue). To compose a stretch of work with the next, Costs keep the ends of their timeline open:
    the host and device time before their first sync or barrier (head_*, when `synced`) and after their last
    (open_*, with open_launches the launches queued since); `closed` are the stretches between, already settled.
    `a + b` is a then b."""

    flops: float = 0.0
    bytes: float = 0.0
    kernels: int = 0
    syncs: int = 0
    device_seconds: float = 0.0
    host_seconds: float = 0.0
    roofline_seconds: float = 0.0
    closed: float = 0.0
    head_host: float = 0.0
    head_device: float = 0.0
    open_host: float = 0.0
    open_device: float = 0.0
    synced: bool = False
    open_launches: int = 0

    @property
    def seconds(self) -> float:
        """Wall seconds of this work on its own, between two syncs."""
        head = max(self.head_host, self.head_device) if self.synced else 0.0
        return self.closed + head + max(self.open_host, self.open_device)

    def add_(self, other: "Costs") -> "Costs":
        """In place: this work, then `other`."""
        for name in ADDITIVE:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if other.synced:
            if self.synced:
                self.closed += max(self.open_host + other.head_host, self.open_device + other.head_device)
                self.closed += other.closed
            else:
                self.head_host, self.head_device = self.open_host + other.head_host, self.open_device + other.head_device
                self.closed, self.synced = other.closed, True
            self.open_host, self.open_device = other.open_host, other.open_device
            self.open_launches = other.open_launches
        else:
            self.open_host += other.open_host
            self.open_device += other.open_device
            self.open_launches += other.open_launches
        return self

    def add_kernel(self, flops: float, moved: float, device: float, host: float, roofline: float,
                   kernels: int = 1) -> None:
        """In place: one kernel more, or `kernels` together (hot path: no object made); launched from the host
        (an entry each in the launch queue) when `host` time launches them."""
        self.flops += flops
        self.bytes += moved
        self.kernels += kernels
        self.device_seconds += device
        self.host_seconds += host
        self.roofline_seconds += roofline
        self.open_host += host
        self.open_device += device
        if host:
            self.open_launches += kernels

    def add_launch(self, host: float) -> None:
        """In place: host time that launches no kernel of its own (a CUDA graph's replay: one queue entry)."""
        self.host_seconds += host
        self.open_host += host
        self.open_launches += 1

    def sync(self) -> None:
        """In place: the host waits for the device here (and reads something back)."""
        self.syncs += 1
        self.barrier()

    def barrier(self) -> None:
        """In place: the host waits for the device here without reading anything (a full launch queue): the
        stretch ends as at a sync."""
        if self.synced:
            self.closed += max(self.open_host, self.open_device)
        else:
            self.head_host, self.head_device, self.synced = self.open_host, self.open_device, True
        self.open_host = self.open_device = 0.0
        self.open_launches = 0

    def __add__(self, other: "Costs") -> "Costs":
        return replace(self).add_(other)

    def settled(self) -> "Costs":
        """This work as a whole between two syncs: `seconds` fixed, nothing left open (a phase: the trainer's
        phases are separated by host syncs)."""
        out = Costs(**{name: getattr(self, name) for name in ADDITIVE})
        out.closed, out.synced = self.seconds, True
        return out


@dataclass
class Mark:
    """A point to measure from: the costs since (accumulated as ops run), the memory at that point, and the peak
    since (by category)."""

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
    """What a plan is for: the device type whose kernels' workspaces count ("cuda" or "cpu"), the GPU whose peaks
    give the time (None on CPU: no time), with `calibration`'s efficiencies and launch costs. allow_tf32:
    PyTorch's fp32 matmuls in TF32. tf32_grad_gemms: the fused head's TF32 path for its gradient GEMMs
    (dllm_fast.ops.costs.gemm_flops_by_type)."""

    device_type: str
    gpu: GPU | None = None
    allow_tf32: bool = False
    calibration: Calibration = DEFAULT_CALIBRATION
    tf32_grad_gemms: bool = False


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
        self._graphs = 0  # > 0 inside a CUDA graph's replay (graph_replay)
        self.split: dict[str, float] | None = None  # when a dict: device seconds by what bounds them (see _count)
        self._fused = 0  # > 0 inside a function the GPU runs as one kernel (_FUSED_ON_GPU): its ops count nothing
        self._gpu_forms = _GPUForms(self) if target.device_type == "cuda" else None

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

    def category_of(self, tensor: torch.Tensor) -> str | None:
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

    def assert_peaks(self, at_peak: dict[str, int], category_peaks: dict[str, int]) -> None:
        """Count the peaks of work not run op by op, exactly: `at_peak`, the memory above what is alive now, by
        category, when its total peaked; `category_peaks`, the most each category rose above it at any point."""
        memory, total = self.memory, self.total + sum(at_peak.values())
        for mark in self._marks:
            peaks = mark.category_peaks
            for category, size in memory.items():
                peaks[category] = max(peaks[category], size + category_peaks[category])
            if total > mark.peak:
                mark.peak = total
                mark.peak_memory = {c: memory[c] + at_peak[c] for c in CATEGORIES}

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
        """Start measuring: `mark.costs` gathers the costs of every op from now until `release`."""
        mark = Mark(Costs(), dict(self.memory), self.total, dict(self.memory))
        self._marks.append(mark)
        return mark

    def release(self, mark: Mark) -> Mark:
        self._marks.remove(mark)
        return mark

    def add_costs(self, costs: Costs) -> None:
        """Costs of work not run op by op (a replayed call), as if its ops ran now."""
        for ledger in (self.costs, *(mark.costs for mark in self._marks)):
            ledger.add_(costs)
        self._bound_run_ahead()

    def _bound_run_ahead(self) -> None:
        """A full launch queue (`launch_queue` launches since the last sync or barrier): the host waits for the
        GPU, in every ledger at once (see the module docstring)."""
        if self.costs.open_launches >= self.target.calibration.launch_queue:
            for ledger in (self.costs, *(mark.costs for mark in self._marks)):
                ledger.barrier()

    @contextlib.contextmanager
    def graph_replay(self):
        """The ops inside run as one CUDA graph replay (a compiled rollout step): one launch of the graph, no host
        time per kernel. The device time stays eager's, kernel for kernel (no credit for inductor's fusion)."""
        if self._graphs == 0 and self.target.gpu is not None:
            for ledger in (self.costs, *(mark.costs for mark in self._marks)):
                ledger.add_launch(self.target.calibration.graph_launch)
            self._bound_run_ahead()
        self._graphs += 1
        try:
            yield
        finally:
            self._graphs -= 1

    # -- ops ----------------------------------------------------------------------------------------------
    def __enter__(self):
        self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._saved.__enter__()
        if self._gpu_forms is not None:
            self._gpu_forms.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        if self._gpu_forms is not None:
            self._gpu_forms.__exit__(*exc)
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
        out = func(*args, **kwargs)
        outputs = _tensors(out)
        self._count(func, packet, args, kwargs, outputs, extra)
        for t in outputs:
            self.track(t)
        if (packet is aten._to_copy and args[0].requires_grad and args[0].is_leaf
                and torch.is_autocast_enabled("cpu") and self.category_of(args[0]) == "parameters"):
            # autocast keeps this cast of a trainable leaf until the autocast region ends
            self.cached_casts.add(id(outputs[0].untyped_storage()))
        if extra is not None and extra.bytes:
            self.assert_peak({"temporaries": extra.bytes})
        return out

    def _count(self, func, packet, args, kwargs, outputs, extra) -> None:
        sync = packet in HOST_SYNCS
        if not outputs and func._schema.is_mutable:  # an in-place op that returns nothing (foreach, fused AdamW):
            outputs = _written_in_place(func, args, kwargs)  # what it writes is its output
        if not outputs and not sync:  # a metadata query (device, size): no kernel
            return
        if not self._fused:
            flop_formula = flop_registry.get(packet)
            flops = flop_formula(*args, **kwargs, out_val=outputs[0] if len(outputs) == 1 else tuple(outputs)) \
                if flop_formula is not None else 0
            moved = 0 if (func.is_view or packet in _FACTORIES or _aliases(func, args, outputs)) \
                else _moved_bytes(packet, args, kwargs, outputs)
            traffic = extra.traffic if extra is not None else 0
            if flops or moved or traffic:
                kernels = _multi_tensor_kernels(args[0]) if packet in _MULTI_TENSOR else _GPU_KERNELS.get(packet, 1)
                self._add_kernels(packet, args, flops, moved, traffic, kernels)
        if sync:
            for ledger in (self.costs, *(mark.costs for mark in self._marks)):
                ledger.sync()

    def _add_kernels(self, packet, args, flops: float, moved: float, traffic: float, kernels: int = 1) -> None:
        device = host = roofline = 0.0
        if self.target.gpu is not None:
            device, roofline = self._device_seconds(packet, args, flops, moved, traffic)
            host = 0.0 if self._graphs else kernels * self.target.calibration.eager_launch
        for ledger in (self.costs, *(mark.costs for mark in self._marks)):
            ledger.add_kernel(flops, moved + traffic, device, host, roofline, kernels)
        if host:
            self._bound_run_ahead()

    def count_kernels(self, kernels: int, moved: float) -> None:
        """`kernels` memory-bound kernels moving `moved` bytes in all, as if they ran now: work the GPU does that
        the plan does not run op by op (a value check the plan answers without computing it)."""
        if kernels and not self._fused:
            self._add_kernels(None, (), 0, moved, 0, kernels)

    def read_back(self, tensor: torch.Tensor) -> None:
        """The host reads `tensor`'s values in one copy (tolist, answered without running its ops): one host
        sync, unless the tensor lives on the host or is empty."""
        if self.before_op is not None:
            self.before_op()
        if tensor.numel() == 0 or self._on_host([tensor]):
            return
        for ledger in (self.costs, *(mark.costs for mark in self._marks)):
            ledger.sync()

    def fused_call(self, func, args, kwargs):
        """Call `func`, a function the GPU runs as one kernel (_FUSED_ON_GPU), counting one kernel that reads its
        tensor arguments and writes its outputs; its ops on the CPU tensors count nothing (they still allocate)."""
        inputs = _tensors((args, kwargs))
        self._fused += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self._fused -= 1
        if not self._fused and not self._on_host(inputs):
            moved = sum(_distinct_bytes(t) for t in (*inputs, *_tensors(out)))
            self._add_kernels(None, (), 0, moved, 0)
        return out

    def _device_seconds(self, packet, args, flops: float, moved: float, traffic: float) -> tuple[float, float]:
        """(calibrated, datasheet) seconds the kernel keeps the GPU busy: its GEMMs at the peak of their operand
        type or its bytes at the bandwidth, whichever takes longer; a compiled op's chunk traffic after its GEMMs
        (its kernels run one after another)."""
        gpu, calibration = self.target.gpu, self.target.calibration
        by_type = {}
        if flops:
            namespace, _, op = packet._qualified_op_name.partition("::")
            if namespace == "dllm_fast":
                by_type = op_costs.gemm_flops_by_type(op, self.target.device_type, args,
                                                      tf32_grad_gemms=self.target.tf32_grad_gemms)
            else:
                dtype = _compute_dtype(args)
                compute = "fp64" if dtype == torch.float64 else (
                    "tf32" if dtype == torch.float32 and self.target.allow_tf32 else "fp32")
                by_type = {(dtype, compute): flops}
        grouped = calibration.grouped_gemm if packet is aten._grouped_mm else 1.0  # its rate against a dense GEMM's
        compute_floor = sum(f / gpu.peak_flops(dtype, compute) for (dtype, compute), f in by_type.items())
        compute = sum(f / (gpu.peak_flops(dtype, compute) * calibration.gemm_efficiency(dtype, compute) * grouped)
                      for (dtype, compute), f in by_type.items())
        memory = moved / (gpu.bandwidth * calibration.bandwidth)
        traffic_seconds = traffic / (gpu.bandwidth * calibration.bandwidth)
        if self.split is not None:  # what bounds the kernel, for fitting the calibration (bench_plan.py --fit)
            if compute >= memory:
                for (dtype, kind), f in by_type.items():
                    key = "tensor_core" if dtype in (torch.bfloat16, torch.float16) else (
                        "tf32" if kind == "tf32" else "fp32")
                    self.split[key] = self.split.get(key, 0.0) + f / (gpu.peak_flops(dtype, kind) *
                                                                        calibration.gemm_efficiency(dtype, kind))
            else:
                self.split["bandwidth"] = self.split.get("bandwidth", 0.0) + memory
            self.split["bandwidth"] = self.split.get("bandwidth", 0.0) + traffic_seconds
        roofline = max(compute_floor, moved / gpu.bandwidth) + traffic / gpu.bandwidth
        return max(compute, memory) + traffic_seconds, roofline


class _GPUForms(TorchFunctionMode):
    """Functions the GPU runs as one kernel (_FUSED_ON_GPU), counted as such by the accountant (fused_call)."""

    def __init__(self, accountant: Accountant):
        super().__init__()
        self.accountant = accountant

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FUSED_ON_GPU:
            return self.accountant.fused_call(func, args, kwargs)
        return func(*args, **kwargs)


def _aliases(func, args, outputs) -> bool:
    """Whether an op that the schema calls neither a view nor in place returns its first argument's storage (a
    view by another name: `_unsafe_view`, which reshapes a GEMM's output)."""
    return (len(outputs) == 1 and args and isinstance(args[0], torch.Tensor) and not func._schema.is_mutable
            and outputs[0].untyped_storage() is args[0].untyped_storage())


def _written_in_place(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an op that returns nothing writes: its schema's mutated arguments (a foreach op's first list),
    for fused AdamW the weights, moments and step counts (_FUSED_ADAM_WRITES)."""
    if func.overloadpacket in _FUSED_ADAM:
        return _tensors([args[i] for i in _FUSED_ADAM_WRITES if i < len(args)])
    written = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            written += _tensors(value)
    return written


def _multi_tensor_kernels(tensors) -> int:
    """Kernels CUDA's multi_tensor_apply launches over fused Adam's weights (`tensors`, each with a gradient and
    two moments: four lists): one per 320 blocks of 65,536 elements, or per 36 tensors, at least one."""
    elements = sum(t.numel() for t in tensors)
    return max(1, -(-elements // (65536 * 320)), -(-len(tensors) // 36))


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
    if packet is aten._grouped_mm and args[0].dim() == 2 and args[1].dim() == 3:
        return _routed_expert_bytes(args, outputs)
    if packet in _INDEXED_WRITES:
        return 2 * sum(_distinct_bytes(t) for t in _tensors((args[1:], kwargs)))
    read = sum(_distinct_bytes(t) for t in _tensors((args[1:], kwargs)))
    written = sum(_distinct_bytes(t) for t in outputs)
    if packet in _GATHERS:
        return read + 2 * written
    if packet not in _OVERWRITES and args:
        read += sum(_distinct_bytes(t) for t in _tensors(args[0]))
    return read + written


def _routed_expert_bytes(args, outputs) -> int:
    """Bytes a routed experts' grouped GEMM moves: its rows and output, and the weights of the experts that have
    rows. The plan cannot read the routing, so rows are taken as spread uniformly: M rows over E experts leave
    an expert without any with probability (1 - 1/E)^M (a decoding step of a few tokens reads few experts; a
    training micro-batch reads them all)."""
    rows, weights = args[0], args[1]
    experts = weights.shape[0]
    touched = 1.0 - (1.0 - 1.0 / experts) ** rows.shape[0]
    return int(_distinct_bytes(rows) + touched * _distinct_bytes(weights) + sum(_distinct_bytes(t) for t in outputs))


def _compute_dtype(args) -> torch.dtype:
    for t in _tensors(args):
        if t.is_floating_point():
            return t.dtype
    return torch.float32
