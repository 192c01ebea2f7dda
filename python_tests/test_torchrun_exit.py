"""A finished torchrun run exits 0 on every rank (issue 45 item 6: 1 two-rank DDP run in 24 ended with a rank
aborting after its checkpoint). distributed_session leaves the process group in order: a finished run meets at a
barrier, its objects (the DDP wrapper and its reducer, which holds the group) are collected, then the group is
destroyed; a failed run skips the barrier (its peers may never reach it). Checked with a recording stand-in for
torch.distributed, and by real 2-rank runs (slow; benchmarks/bench_torchrun_exit.py repeats them)."""

import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch.distributed as dist

from dllm_fast.train.distributed import distributed_session

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_torchrun_exit  # noqa: E402


class Cycle:
    """What the DDP wrapper is to a run: an object kept alive by a reference cycle only."""

    def __init__(self):
        self.me = self


@pytest.fixture
def recorded(monkeypatch):
    """torch.distributed's calls distributed_session makes, recorded in order (two ranks, no real group), and
    whether the run's cycle was still alive at destroy_process_group."""
    events, state = [], {"initialized": False}
    monkeypatch.setenv("WORLD_SIZE", "2")

    def init_process_group(backend):
        events.append(("init", backend))
        state["initialized"] = True

    def destroy_process_group():
        events.append(("destroy", state["run"]() is not None if "run" in state else None))
        state["initialized"] = False

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "destroy_process_group", destroy_process_group)
    monkeypatch.setattr(dist, "is_initialized", lambda: state["initialized"])
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "barrier", lambda: events.append(("barrier",)))
    return events, state


def session_body(state, fail):
    run = Cycle()
    state["run"] = weakref.ref(run)
    del run
    if fail:
        raise RuntimeError("a step failed")


@pytest.mark.parametrize("gc_enabled", [True, False])
def test_a_finished_run_meets_at_a_barrier_and_its_objects_go_before_the_group(recorded, gc_enabled):
    events, state = recorded
    if not gc_enabled:  # the automatic collector may not have run by then: the session must collect itself
        gc.disable()
    try:
        with distributed_session("cpu") as ranks:
            assert (ranks.rank, ranks.world) == (0, 2)
            session_body(state, fail=False)
    finally:
        gc.enable()
    assert events == [("init", "gloo"), ("barrier",), ("destroy", False)]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failed_run_leaves_the_group_without_waiting_for_its_peers(recorded, error):
    events, state = recorded

    def body():
        with distributed_session("cpu"):
            raise error("a step failed")

    with pytest.raises(error, match="a step failed"):
        body()
    assert events == [("init", "gloo"), ("destroy", None)]


@pytest.mark.slow
@pytest.mark.distributed
def test_finished_two_rank_ddp_runs_exit_0_on_every_rank():
    """Three real runs (benchmarks/bench_torchrun_exit.py repeats 50): torchrun's status 0 (every rank's),
    the checkpoint written, no abort printed."""
    rows = bench_torchrun_exit.repeated_runs(3, "ddp", report=lambda row: None)
    assert [row["clean"] for row in rows] == [True] * 3, [(row["returncode"], row["abort"], row["tail"])
                                                          for row in rows]
