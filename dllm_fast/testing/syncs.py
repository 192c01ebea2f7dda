"""Count host syncs on the CPU: the points where the host reads a tensor's values, so on a GPU it waits for the
device to finish everything queued before.

A host sync stalls a GPU's launch queue, a CUDA graph cannot capture one, and a fake-tensor run (the planner)
cannot pass one, since it has no values to read. The same Python code reads values at the same points on any
device, so counting them in a CPU run tells what a GPU run will do:

    from dllm_fast.testing.syncs import SyncCounter

    with SyncCounter() as syncs:
        dllm_fast.generate(model, prompts, gen_length=64, block_length=32, steps=32)
    syncs.count           # how many
    syncs.by_site()       # {"dllm_fast/rollout/sampler.py:210 in generate": 2, ...}: where they come from

What counts as one sync:

- an aten op that reads a value on the host: `_local_scalar_dense` (`.item()`, `int(t)`, `float(t)`, `bool(t)`,
  `if t:`), `equal`, `allclose`;
- an aten op whose output shape depends on values: `nonzero` (`torch.where(c)`, `argwhere`), `masked_select`,
  `unique`, `bincount`, `repeat_interleave` without `output_size`, indexing and `index_put` with a boolean mask;
- a copy to the host: `Tensor.tolist`, `Tensor.numpy`, `Tensor.cpu` (free on a CPU tensor, but a sync on a GPU,
  so counted on any device), and `Tensor.to` a CPU device from another device.

A sync inside a C++ kernel is not seen (dllm_fast's kernels have none). The modes see every op of the context,
so a counted run is slower: count in tests, not in timed runs.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops that read a value on the host, or whose output shape depends on the values.
VALUE_READS = {aten._local_scalar_dense, aten.equal, aten.allclose, aten.is_nonzero}
VALUE_DEPENDENT_SHAPES = {aten.nonzero, aten.masked_select, aten._unique, aten._unique2, aten.unique_dim,
                          aten.unique_consecutive, aten.unique_dim_consecutive, aten.bincount}
BOOLEAN_INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
HOST_COPIES = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}

_TORCH_DIR = os.path.dirname(torch.__file__)
_REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout


@dataclasses.dataclass(frozen=True)
class SyncEvent:
    """One host sync: the op that caused it and the innermost line of code outside torch that called it."""

    op: str
    site: str


class SyncCounter:
    """A context manager that records every host sync of the code it wraps (see the module docstring)."""

    def __init__(self) -> None:
        self.events: list[SyncEvent] = []
        self._modes = (_SyncFunctionMode(self), _SyncDispatchMode(self))

    @property
    def count(self) -> int:
        return len(self.events)

    def by_op(self) -> dict[str, int]:
        return dict(collections.Counter(event.op for event in self.events))

    def by_site(self) -> dict[str, int]:
        return dict(collections.Counter(event.site for event in self.events))

    def __enter__(self) -> "SyncCounter":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def __repr__(self) -> str:
        return f"SyncCounter(count={self.count}, by_site={self.by_site()})"

    def _record(self, op: str) -> None:
        self.events.append(SyncEvent(op, _caller_site()))


def _caller_site() -> str:
    """'path:line in function' of the innermost frame outside torch and this module."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_TORCH_DIR) and path != __file__:
            shown = os.path.relpath(path, _REPOSITORY) if path.startswith(_REPOSITORY) else path
            return f"{shown}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<unknown>"


def _is_host_copy(func, args, kwargs) -> bool:
    if func in HOST_COPIES:
        return True
    if func is torch.Tensor.to and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
        targets = list(args[1:]) + [kwargs.get("device")]
        return any(_is_cpu(target) for target in targets)
    return False


def _is_cpu(target) -> bool:
    if isinstance(target, torch.device):
        return target.type == "cpu"
    return isinstance(target, str) and target.split(":")[0] == "cpu"


def _has_boolean_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8) for index in indices)


class _SyncFunctionMode(TorchFunctionMode):
    """Host copies that never reach the dispatcher (tolist and numpy read CPU memory directly)."""

    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_host_copy(func, args, kwargs):
            self.counter._record(f"Tensor.{func.__name__}")
        return func(*args, **kwargs)


class _SyncDispatchMode(TorchDispatchMode):
    """Value reads and value-dependent shapes, at the aten level (what `.item()` and friends become)."""

    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if (packet in VALUE_READS or packet in VALUE_DEPENDENT_SHAPES
                or (packet in BOOLEAN_INDEXING and _has_boolean_index(args))
                or (packet is aten.repeat_interleave and func is aten.repeat_interleave.Tensor
                    and (kwargs or {}).get("output_size") is None)):
            self.counter._record(f"aten.{packet.__name__}")
        return func(*args, **(kwargs or {}))
