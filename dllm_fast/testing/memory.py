"""Memory measurement for tests: the peak of torch's allocator over a block (`track_allocations`: every tensor
and kernel buffer, from the profiler's allocation events), and the peak resident memory of a fresh subprocess above
its baseline (`peak_extra_rss`: Linux /proc; the peak is reset after setup).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap

import torch


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
