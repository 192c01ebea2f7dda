"""Memory measurement for tests and benchmarks on machines without a GPU.

Three views: the bytes autograd saves for backward (exact and deterministic, via saved_tensors_hooks), the peak
of torch's allocator over a block (`track_allocations`: every tensor and kernel buffer, from the profiler's
allocation events), and the peak resident memory of a fresh subprocess above its baseline (Linux /proc; the
peak is reset after setup). On CUDA, torch.cuda.max_memory_allocated also does.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap
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


class AllocationPeak:
    """What `track_allocations` measured: `peak`, the most bytes that allocations made inside the block held at
    once (frees of memory allocated before the block count against it), and `total`, all bytes allocated."""

    def __init__(self):
        self.peak = 0
        self.total = 0


@contextlib.contextmanager
def track_allocations(device: str | torch.device = "cpu"):
    """`with track_allocations() as allocated: fn()`, then `allocated.peak` is the peak of torch's allocator on
    `device` above its level on entry. Unlike the saved-tensor views it sees everything torch allocates: outputs
    and temporaries of every op (a gradient built in a backward, the buffers inside a compiled kernel); not
    memory that libraries allocate on their own (MKL's workspace). Deterministic for a deterministic block; it
    runs the profiler, so keep the block small."""
    from torch.profiler import ProfilerActivity, profile

    device_type = torch.device(device).type
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
    result = AllocationPeak()
    with profile(activities=activities, profile_memory=True) as profiler:
        yield result
    events = sorted((e for e in profiler.profiler.kineto_results.events()
                     if e.name() == "[memory]" and str(e.device_type()).split(".")[-1].lower() == device_type),
                    key=lambda e: e.start_ns())
    level = 0
    for event in events:
        level += event.nbytes()
        result.peak = max(result.peak, level)
        result.total += max(event.nbytes(), 0)


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


_PROBE = """
import json, torch
from dllm_fast.memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss
torch.set_num_threads({threads})
{setup}
reset_peak_rss()
_baseline = current_rss_bytes()
{run}
print("DLLM_FAST_MEMORY " + json.dumps({{"baseline": _baseline, "peak": peak_rss_bytes()}}))
"""


def peak_extra_rss(setup: str, run: str, *, threads: int | None = None, timeout: float = 600) -> int:
    """Run `setup` then `run` in a fresh Python process; return run's peak resident bytes above the baseline
    measured right after setup. Put warm-up calls in `setup` so thread pools and libraries are resident."""
    code = _PROBE.format(
        threads=threads or torch.get_num_threads(), setup=textwrap.dedent(setup), run=textwrap.dedent(run)
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"memory probe failed:\n{result.stderr[-4000:]}")
    line = next(l for l in result.stdout.splitlines() if l.startswith("DLLM_FAST_MEMORY "))
    values = json.loads(line.split(" ", 1)[1])
    return values["peak"] - values["baseline"]
