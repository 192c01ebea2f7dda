"""Multi-process tests that cannot hang: spawn the ranks of a gloo process group with a deadline."""

from __future__ import annotations

import time

import torch.multiprocessing as mp


def run_ranks(worker, args: tuple, world: int, timeout_s: float = 240.0) -> None:
    """Spawn `world` ranks of worker(rank, *args) and wait for them. A rank's failure raises (torch's
    ProcessRaisedException); ranks still running after `timeout_s` (a stuck collective, a rank waiting on a dead
    peer) are killed and TimeoutError names the worker, so a suite never waits forever."""
    context = mp.start_processes(worker, args=args, nprocs=world, start_method="spawn", join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join(5)
            raise TimeoutError(f"{world} ranks of {worker.__name__} still ran after {timeout_s} s; killed them.")
