"""Data-parallel training on PyTorch's own engine, on CPU with gloo and 2 processes: one objective update of each
rank's share of the prompt groups, with one all-reduce per call, gives exactly the parameters of a single process
updating on the whole batch (DDP and FSDP2)."""

import os
import sys
from datetime import timedelta

import pytest
import torch

from dllm_fast import objectives
from dllm_fast.contracts import RolloutBatch, completion_mask
from dllm_fast.models import LLaDAConfig, LLaDAModel
from dllm_fast.testing.ranks import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_thread")]

WORLD, G, P, L = 2, 2, 4, 8


def make_model():
    torch.manual_seed(0)
    return LLaDAModel(LLaDAConfig.preset("tiny")).double()


def make_batch():
    gen = torch.Generator().manual_seed(1)
    sequences = torch.randint(0, 120, (2 * WORLD * G, P + L), generator=gen)
    sequences[1, P + 5:] = 126  # EOS padding in one answer
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.25, 1.0, 1.0], dtype=torch.float64)
    return RolloutBatch(sequences, None, P, completion_mask(sequences[:, P:], 126), rewards, G)


def make_objective(name):
    return objectives.get(name, n_t=4, **({"beta": 0.0} if name == "espo" else {}))  # no reference model here


# Pairs per micro-batch: 3 < n_t takes ESPO's two passes; VRPO-OL's 8 its one pass (whole sequences, its
# zero-advantage group scored without a graph).
MICRO_BATCH = {"bgpo": 3, "espo": 3, "vrpo_ol": 8}


def update(model, objective, batch, masks, parameters):
    """One inner update: the objective's gradient through the engine, then an AdamW step."""
    optimizer = torch.optim.AdamW(parameters, lr=1e-2)
    out = objective.backward(model, batch, objectives.InnerUpdate(masks), micro_batch=MICRO_BATCH[objective.name])
    optimizer.step()
    return out


def full_state(model) -> dict:
    state = {}
    for name, value in model.state_dict().items():
        state[name] = value.full_tensor() if hasattr(value, "full_tensor") else value
    return {k.removeprefix("module."): v.detach().clone() for k, v in state.items()}


# The six cases share one launch of 2 ranks (one process group): each spawn costs two fresh interpreters importing
# torch, most of a case's time on 2 cores.
# Objectives: separable, two-pass, one-pass.
CASES = [(engine, name) for name in ("bgpo", "espo", "vrpo_ol") for engine in ("ddp", "fsdp2")]


def distributed_update(rank, engine, objective_name, mesh):
    """Rank `rank`'s update of its share of the groups under `engine`; the whole state afterwards."""
    import torch.distributed as dist

    model = make_model()
    objective = make_objective(objective_name)
    batch = make_batch()
    masks = objective.draw_masks(batch, generator=torch.Generator().manual_seed(2), eos_token_id=126)
    groups = batch.num_groups // WORLD
    mine = batch.groups(rank * groups, (rank + 1) * groups)
    my_masks = masks.rows(rank * groups * G, (rank + 1) * groups * G)
    all_reduces = []
    if engine == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)

        def counting_hook(state, bucket):  # DDP's default all-reduce, counted
            all_reduces.append(bucket.index())
            work = dist.all_reduce(bucket.buffer().div_(WORLD), async_op=True)
            return work.get_future().then(lambda future: future.value()[0])

        wrapped.register_comm_hook(None, counting_hook)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer["blocks"]:
            fully_shard(block, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    update(wrapped, objective, mine, my_masks, list(wrapped.parameters()))
    if engine == "ddp":  # one all-reduce per bucket for the whole call, not one per micro-batch
        assert sorted(all_reduces) == list(range(len(set(all_reduces)))), (objective_name, all_reduces)
    return full_state(wrapped)


def worker(rank, rendezvous, result_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))  # a lost peer fails the collective, never hangs it
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        states = {case: distributed_update(rank, *case, mesh) for case in CASES}
        if rank == 0:
            torch.save(states, result_path)
    finally:
        dist.destroy_process_group()
    # torch 2.13's gloo worker thread can free a finished FSDP2 all-gather (holding a Python tensor) while the
    # interpreter finalizes; taking the GIL then aborts the process (SIGABRT, no Python frame). The work is
    # done and saved, so leave without finalizing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.slow
def test_two_ranks_equal_one_process_on_the_same_data(tmp_path):
    """Each of CASES (DDP and FSDP2, for a separable, a two-pass and a one-pass objective) on 2 gloo ranks gives the
    single process's parameters."""
    result = tmp_path / "rank0.pt"
    run_ranks(worker, (str(tmp_path / "rendezvous"), str(result)), WORLD, timeout_s=600.0)
    distributed = torch.load(result)
    assert list(distributed) == CASES
    singles = {}
    for engine, objective_name in CASES:
        if objective_name not in singles:  # the single process is the same for either engine
            model = make_model()
            objective = make_objective(objective_name)
            batch = make_batch()
            masks = objective.draw_masks(batch, generator=torch.Generator().manual_seed(2), eos_token_id=126)
            before = {k: v.clone() for k, v in model.state_dict().items()}
            update(model, objective, batch, masks, list(model.parameters()))
            singles[objective_name] = before, model.state_dict()
        before, single = singles[objective_name]
        state = distributed[(engine, objective_name)]
        assert state.keys() == single.keys(), (engine, objective_name)
        moved = 0
        for name in single:
            torch.testing.assert_close(state[name], single[name], rtol=1e-10, atol=1e-12,
                                       msg=f"{engine}, {objective_name}: {name}")
            moved += int(not torch.equal(single[name], before[name]))
        assert moved > len(single) // 2, (engine, objective_name)  # the update really changed the weights
