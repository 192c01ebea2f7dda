"""Memory measurement without a GPU, for the trainer's metrics, the demo and the benchmarks: the bytes autograd
saves for backward (exact and deterministic, via saved_tensors_hooks) and this process's resident memory (Linux
/proc). The tests' heavier views (torch's allocator over a block, a fresh process's peak) are in
dllm_fast.testing.memory. On CUDA, torch.cuda.max_memory_allocated also does.
"""

from __future__ import annotations

import contextlib
import weakref

import torch


class SavedTensorCounter:
    """Counts the distinct storages autograd saves while active; `bytes` is their total size."""

    def __init__(self, exclude=()):
        self._storages: dict[int, int] = {}
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._excluded:
            self._storages[storage.data_ptr()] = storage.nbytes()
        return tensor


@contextlib.contextmanager
def count_saved_tensors(exclude=()):
    """`with count_saved_tensors() as saved: loss = f(x)` then `saved.bytes` is what backward will hold.

    Tensors in `exclude` (typically the model's parameters, which exist anyway) are not counted."""
    counter = SavedTensorCounter(exclude)
    with torch.autograd.graph.saved_tensors_hooks(counter._pack, lambda tensor: tensor):
        yield counter


class LiveSavedTensors:
    """Peak bytes of tensors saved for backward that are alive at the same time (`peak`), where
    SavedTensorCounter counts every storage ever saved: the right measure for code that runs several
    backward passes, such as the streaming likelihood engine."""

    def __init__(self, exclude=()):
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._live: dict[int, list[int]] = {}  # storage pointer -> [bytes, saved references alive]
        self.current = 0
        self.peak = 0

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in self._excluded:
            entry = self._live.setdefault(pointer, [tensor.untyped_storage().nbytes(), 0])
            if entry[1] == 0:
                self.current += entry[0]
                self.peak = max(self.peak, self.current)
            entry[1] += 1
            weakref.finalize(tensor, self._release, pointer)
        return tensor

    def _release(self, pointer: int) -> None:
        entry = self._live[pointer]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._live[pointer]


@contextlib.contextmanager
def track_live_saved_tensors(exclude=()):
    """`with track_live_saved_tensors(model.parameters()) as live: ...` then `live.peak` is the most saved-for-
    backward memory that was alive at once."""
    tracker = LiveSavedTensors(exclude)
    with torch.autograd.graph.saved_tensors_hooks(tracker._pack, lambda tensor: tensor):
        yield tracker


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> None:
    """Reset this process's peak resident set size (VmHWM) to its current size (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def current_rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    return _status_kib("VmHWM") * 1024
