"""Expert parallelism for LLaDA2 (--expert-parallel N: models/expert_parallel.py, train/expert_parallel.py): the
dispatch and combine permutations over simulated ranks equal the experts of one process; on gloo ranks in fp64, a
rank's logits, lp, greedy tokens and the parameters after two clipped AdamW steps (DDP over the rest, full fine-
tune and LoRA) equal a single process's on the whole batch; `train --expert-parallel 2` under torchrun follows the
DDP run and resumes bit for bit; the flag is refused, by name, where it cannot run."""

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import dllm_fast
from dllm_fast import objectives
from dllm_fast.contracts import RolloutBatch, completion_mask
from dllm_fast.models import LLaDA2Config, LLaDA2Model
from dllm_fast.models.expert_parallel import dispatch_plan, receive_plan, weighted_sum
from dllm_fast.models.moe import Experts
from dllm_fast.testing.ranks import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")

G, P, L, GROUPS_PER_RANK = 2, 4, 8, 2
CLIP = 0.05  # below the first update's gradient norm: the clipping (and its norm over every rank) is exercised


# -- the permutations, in one process ---------------------------------------------------------------------------

@pytest.mark.parametrize("size", [2, 4])
def test_dispatch_and_combine_over_simulated_ranks_equal_the_experts_of_one_process(size):
    """Each simulated rank routes its tokens, sends its sorted rows to the experts' ranks (the all-to-all as list
    slicing), the receivers sort by local expert and run their slice of the experts; combined back, every rank's
    outputs are those of the whole Experts on its tokens."""
    torch.manual_seed(0)
    E, d, width, k, T = 8, 6, 5, 3, 7
    whole = Experts(E, d, width).double()
    torch.nn.init.normal_(whole.gate_up_proj)
    torch.nn.init.normal_(whole.down_proj)
    xs = [torch.randn(T + r, d, dtype=torch.float64) for r in range(size)]  # uneven token counts
    chosen = [torch.stack([torch.randperm(E)[:k] for _ in range(x.shape[0])]) for x in xs]
    chosen[0][:, 0] = 0  # one expert (rank 0's) takes every token of rank 0
    weights = [torch.rand(c.shape, dtype=torch.float64) for c in chosen]
    local = E // size
    plans = [dispatch_plan(c, E, size) for c in chosen]
    sent = []  # sent[source][destination]: (rows, local ids)
    for x, c, (order, ids, counts, sends) in zip(xs, chosen, plans):
        k_ = c.shape[1]
        rows = x.index_select(0, order // k_)
        cuts = sends.tolist()
        assert counts.sum() == c.numel() and sends.sum() == c.numel()
        sent.append(list(zip(rows.split(cuts), ids.split(cuts))))
    returned = [[None] * size for _ in range(size)]
    for destination in range(size):
        rows = torch.cat([sent[s][destination][0] for s in range(size)])
        ids = torch.cat([sent[s][destination][1] for s in range(size)])
        assert ids.numel() == 0 or int(ids.max()) < local
        arrange, sorted_ids, counts = receive_plan(ids, local)
        mine = Experts(local, d, width).double()
        mine.gate_up_proj.data = whole.gate_up_proj.data[destination * local:(destination + 1) * local]
        mine.down_proj.data = whole.down_proj.data[destination * local:(destination + 1) * local]
        out = torch.empty_like(rows)
        out[arrange] = mine.sorted_rows(rows[arrange], counts, sorted_ids, max(rows.shape[0], 1))
        sizes = [sent[s][destination][0].shape[0] for s in range(size)]
        for source, part in enumerate(out.split(sizes)):
            returned[source][destination] = part
    for r in range(size):
        order = plans[r][0]
        y = weighted_sum(torch.cat(returned[r]), order, weights[r])
        expected, counts = whole(xs[r], chosen[r], weights[r])
        torch.testing.assert_close(y, expected, rtol=0, atol=1e-13)
        torch.testing.assert_close(counts, plans[r][2], rtol=0, atol=0)


# -- refusals ---------------------------------------------------------------------------------------------------

def _config(tmp_path, **overrides):
    from dllm_fast.train.config import TrainConfig

    return TrainConfig(**{"model": "llada2-tiny", "task": "synthetic",  # few short prompts: a quick setup
                          "task_options": {"prompt_length": P, "num_train": 8, "num_test": 1},
                          "block_length": 4, "gen_length": 8, "diffusion_steps": 4,
                          "eval_gen_lengths": [8], "prompts_per_step": 2, "group_size": 2,
                          "output_dir": str(tmp_path / "run"), **overrides})


@pytest.mark.parametrize("overrides, world, words", [
    (dict(model="sudoku4"), 2, "has no routed experts"),
    (dict(), 3, "must divide the number of ranks, 3"),
    (dict(), 1, "must divide the number of ranks, 1"),
    (dict(compile=True), 2, "use --compile false or auto"),
    (dict(threshold=0.9), 2, "a fixed schedule"),
])
def test_the_flag_is_refused_by_name_where_it_cannot_run(tmp_path, overrides, world, words):
    from dllm_fast.train.expert_parallel import check_expert_parallel
    from dllm_fast.train.run import model_and_tokenizer_plan

    config = _config(tmp_path, expert_parallel=2, **overrides)
    with pytest.raises(ValueError, match="--expert-parallel 2") as error:
        check_expert_parallel(config, model_and_tokenizer_plan(config)[2], world)
    assert words in str(error.value)


def test_the_flag_must_divide_the_routed_experts(tmp_path):
    from dllm_fast.train.expert_parallel import check_expert_parallel
    from dllm_fast.train.run import model_and_tokenizer_plan

    config = _config(tmp_path, expert_parallel=32)
    with pytest.raises(ValueError, match="--expert-parallel 32 must divide the model's 16 routed experts"):
        check_expert_parallel(config, model_and_tokenizer_plan(config)[2], 32)
    check_expert_parallel(_config(tmp_path, expert_parallel=4), model_and_tokenizer_plan(config)[2], 8)  # fits


@pytest.mark.slow  # about 2.5 s: the run's setup
def test_a_single_process_run_refuses_it_before_writing_anything(tmp_path):
    from dllm_fast.train.loop import train

    with pytest.raises(ValueError, match="--expert-parallel 2 must divide the number of ranks, 1"):
        train(_config(tmp_path, expert_parallel=2))
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="--expert-parallel"):
        _config(tmp_path, expert_parallel=0)


# -- ranks against one process, fp64 ----------------------------------------------------------------------------

def make_model(lora: bool):
    model = LLaDA2Model.with_random_weights(LLaDA2Config.preset("llada2-tiny"), dtype=torch.float64, seed=0)
    if lora:
        from dllm_fast.train.config import TrainConfig
        from dllm_fast.train.precision import add_lora

        torch.manual_seed(0)
        model = add_lora(model, TrainConfig(model="llada2-tiny", lora=True, lora_rank=4, block_length=4))
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.data = parameter.data.double()
                torch.nn.init.normal_(parameter, std=0.05)  # B = 0 would leave the adapters out of the lp
    return model


def make_batch(world: int):
    gen = torch.Generator().manual_seed(1)
    rows = world * GROUPS_PER_RANK * G
    sequences = torch.randint(0, 120, (rows, P + L), generator=gen)
    sequences[1, P + 5:] = 126
    rewards = torch.rand(rows, generator=gen, dtype=torch.float64)
    return RolloutBatch(sequences, None, P, completion_mask(sequences[:, P:], 126), rewards, G)


def draw(batch):
    return objectives.get("espo", n_t=2, beta=0.0).draw_masks(batch, generator=torch.Generator().manual_seed(2),
                                                              eos_token_id=126)


def steps(model, core, batch, masks, clip):
    """Logits, greedy tokens, and two clipped AdamW updates' lp and norms, then the trainable parameters."""
    objective = objectives.get("espo", n_t=2, beta=0.0)
    ids = batch.sequences
    out = {"logits": core.logits(ids).detach(),
           "tokens": dllm_fast.generate(core, ids[:, :P], torch.ones_like(ids[:, :P]), gen_length=8,
                                        block_length=4, steps=4, cache="block").completion_ids}
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    for step in range(2):
        result = objective.backward(model, batch, objectives.InnerUpdate(masks), micro_batch=3)
        out[f"lp{step}"] = result.lp
        out[f"norm{step}"] = clip(trainable, CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out, optimizer


def ddp_case(rank, world, size, lora) -> dict:
    """A rank's `steps` under DDP over the dense weights, its experts split over expert groups of `size`."""
    from dllm_fast.contracts import unwrap_model
    from dllm_fast.train.distributed import Ranks
    from dllm_fast.train.expert_parallel import (ExpertGradients, distribute, expert_group, ignore_experts_in_ddp,
                                                 whole_state)

    group = expert_group(size, Ranks(rank, world), torch.device("cpu"))
    base = LLaDA2Model.with_random_weights(LLaDA2Config.preset("llada2-tiny"), dtype=torch.float64, seed=0)
    model = distribute(base, group)
    if lora:  # the adapters as make_model draws them: the same seed after the same draws
        whole = make_model(lora=True)
        from dllm_fast.train.config import TrainConfig
        from dllm_fast.train.precision import add_lora

        model = add_lora(model, TrainConfig(model="llada2-tiny", lora=True, lora_rank=4, block_length=4))
        adapters = {n: p for n, p in whole.named_parameters() if p.requires_grad}
        for name, parameter in model.named_parameters():
            if parameter.requires_grad:
                parameter.data = adapters[name].data.clone()
    batch = make_batch(world)
    masks = draw(batch)
    mine = batch.groups(rank * GROUPS_PER_RANK, (rank + 1) * GROUPS_PER_RANK)
    my_masks = masks.rows(rank * GROUPS_PER_RANK * G, (rank + 1) * GROUPS_PER_RANK * G)
    ignore_experts_in_ddp(model)
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    out, optimizer = steps(wrapped, unwrap_model(wrapped), mine, my_masks, ExpertGradients(wrapped, group))
    state, _ = whole_state(model, optimizer, group)
    out["state"] = {k: v.detach().clone() for k, v in state.items()}
    return out


# FSDP2 with expert parallelism, through the trainer's Run: 4 prompt groups a step at every world size (so one
# single-process run serves both launches, and a checkpoint of one world size is resumable, by its settings, at
# the other), ESPO with a KL term (a reference copy sharded like the policy), clipped AdamW.
FSDP_GROUPS = 4


def fsdp_config(output_dir, lora: bool, size: int, world: int, **overrides):
    from dllm_fast.train.config import TrainConfig

    return TrainConfig(**{"model": "llada2-tiny", "task": "synthetic",  # few short prompts: a quick setup
                          "task_options": {"prompt_length": P, "num_train": 8, "num_test": 1},
                          "block_length": 4, "gen_length": 8, "diffusion_steps": 4,
                          "eval_gen_lengths": [8], "output_dir": str(output_dir), "objective": "espo",
                          "objective_options": {"n_t": 2, "beta": 0.05}, "micro_batch": 3,
                          "prompts_per_step": FSDP_GROUPS, "group_size": G, "steps": 2,
                          "parallel": "fsdp2" if world > 1 else "ddp", "expert_parallel": size, "lora": lora,
                          "lora_rank": 3, "lr": 1e-2, "grad_clip": CLIP, "device": "cpu", "threads": 1,
                          "progress": False, "plot": False, "eval_every": 100, "checkpoint_every": 100,
                          "eval_examples": 1, **overrides})


def fsdp_batch(step: int, eos: int) -> RolloutBatch:
    gen = torch.Generator().manual_seed(100 + step)
    sequences = torch.randint(0, 100, (FSDP_GROUPS * G, P + L), generator=gen)  # the task's vocabulary
    sequences[1, P + 5:] = eos
    rewards = torch.rand(FSDP_GROUPS * G, generator=gen, dtype=torch.float64).round(decimals=1)
    return RolloutBatch(sequences, None, P, completion_mask(sequences[:, P:], eos), rewards, G)


def fp64_run(config, ranks):
    from dllm_fast.train.precision import Precision
    from dllm_fast.train.run import Run, RunSetup
    from dllm_fast.train.run_dir import RunDirectory

    run_dir = RunDirectory(config.run.output_dir, ranks)
    setup = RunSetup(config, ranks, run_dir)
    setup.precision = Precision(None, torch.float64, torch.float64)  # the exact comparison: every weight in fp64
    return Run(config, ranks, run_dir, setup=setup)


def trained_weights(run) -> dict:
    """The run's trainable weights, whole (FSDP2's shards and every rank's experts gathered; every rank calls)."""
    from dllm_fast.models.expert_parallel import is_expert_parameter, whole_experts

    weights = {}
    for name, p in run.core.named_parameters():
        if p.requires_grad:
            whole = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            if run.expert_group is not None and is_expert_parameter(name):
                whole = whole_experts(whole, run.expert_group)
            weights[name] = whole
    return weights


def fsdp_step(run, step: int) -> dict:
    """One update of `run` on this rank's share of the made-up batch: the lp before it and the clipped norm."""
    eos = run.core.eos_token_id
    batch = fsdp_batch(step, eos)
    masks = run.objective.draw_masks(batch, generator=torch.Generator().manual_seed(7 + step), eos_token_id=eos)
    share = run.share
    mine, my_masks = batch.groups(share.start, share.stop), masks.rows(share.start * G, share.stop * G)
    lp = run.objective.reference_lp(run.model, mine, my_masks, micro_batch=run.batching, ref_model=run.model)
    norm = run.update(mine, objectives.InnerUpdate(my_masks))["grad_norm"]
    run.step += 1
    run.data.position += FSDP_GROUPS  # the prompts a step takes (what a checkpoint checks)
    return {f"lp{step}": lp.detach().clone(), f"norm{step}": norm}


def offloaded_flags(model) -> list:
    """Whether each of the model's FSDP2 parameters (the dense units' and the experts' own) lives on the host."""
    groups = [unit._get_fsdp_state()._fsdp_param_group for unit in model.modules() if hasattr(unit, "_get_fsdp_state")]
    return sorted({p.offload_to_cpu for group in groups if group is not None for p in group.fsdp_params})


def fsdp_case(output_dir, ranks, lora: bool, size: int, resume: bool, offload: bool = False) -> dict:
    """The trainer's Run under `ranks` (FSDP2, expert groups of `size`; one process: neither): logits and greedy
    tokens of this rank's prompts (on the rollout's gathered copy, and on FSDP2's per-layer gathers), two updates'
    lp and norms, the trained weights after each. resume: a checkpoint after the first update, then a second Run
    resumed from it takes the second update again (its weights: "resumed"). offload: --reference-offload true (the
    reference's dense shards and its experts' shards over their replicas on the host: the same numbers on CPU)."""
    from dllm_fast.train.checkpoint import save_checkpoint

    extra = {"reference_offload": True} if offload else {}
    run = fp64_run(fsdp_config(output_dir, lora, size, ranks.world, **extra), ranks)
    eos = run.core.eos_token_id
    ids = fsdp_batch(0, eos).sequences[run.share.start * G:run.share.stop * G]
    copy = run.rollout_weights.gather() if run.rollout_weights is not None else run.core
    prompts = ids[:, :P]
    generate = dict(gen_length=8, block_length=4, steps=4, cache="block")
    out = {"logits": copy.logits(ids).detach().clone(),
           "tokens": dllm_fast.generate(copy, prompts, torch.ones_like(prompts), **generate).completion_ids,
           "tokens_sharded": dllm_fast.generate(run.core, prompts, torch.ones_like(prompts), **generate).completion_ids,
           "notes": run.setup_notes}
    if offload:
        out["reference_offloaded"] = offloaded_flags(run.ref_model)
    if run.rollout_weights is not None:
        run.rollout_weights.release()
    out.update(fsdp_step(run, 0))
    out["weights0"] = trained_weights(run)
    if resume:
        save_checkpoint(run)
    out.update(fsdp_step(run, 1))
    out["weights1"] = trained_weights(run)
    if resume:
        again = fp64_run(fsdp_config(output_dir, lora, size, ranks.world, resume=True, **extra), ranks)
        assert again.step == 1
        fsdp_step(again, 1)
        out["resumed"] = trained_weights(again)
    return out


def resume_refusal(output_dir, ranks, size: int) -> str:
    """The error of resuming, on these ranks with expert groups of `size`, a checkpoint written by another run."""
    try:
        fp64_run(fsdp_config(output_dir, False, size, ranks.world, resume=True), ranks)
    except ValueError as error:
        return str(error)
    return "resumed"


# What each launch checks: (parallel, expert group size, LoRA)
CASES = {2: [("ddp", 2, False), ("ddp", 2, True), ("fsdp2", 2, False), ("fsdp2", 2, True)],
         4: [("ddp", 2, False), ("fsdp2", 2, False), ("fsdp2", 2, True), ("fsdp2", 4, False)]}
# Cases run with --reference-offload true: two expert groups, whose experts are FSDP2 shards over their replicas
# (the layout of the planner's 16-GPU llada2-flash plan; one group's whole experts cannot be offloaded)
OFFLOADED = {(4, "fsdp2", 2, False)}


def launch_worker(rank, world, rendezvous, result_dir, earlier):
    """Every check of CASES[world] on this rank, in one process group; results to result_dir/rank{rank}.pt.
    earlier: the run directory of the 2-rank launch's resumed case (the 4-rank one tries to resume it)."""
    import torch.distributed as dist

    from dllm_fast.train.distributed import Ranks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))  # a lost peer fails the collective, never hangs it
    try:
        results = {}
        ranks = Ranks(rank, world)
        for parallel, size, lora in CASES[world]:
            if parallel == "ddp":
                results[parallel, size, lora] = ddp_case(rank, world, size, lora)
            else:
                resume = not lora and size == 2
                results[parallel, size, lora] = fsdp_case(Path(result_dir) / f"run-{size}-{lora}", ranks, lora,
                                                          size, resume, (world, parallel, size, lora) in OFFLOADED)
        if earlier is not None:  # the 2-rank checkpoint at 4 ranks: same settings, another world; another -EP too
            results["refusals"] = [resume_refusal(earlier, ranks, 2), resume_refusal(earlier, ranks, 4)]
        torch.save(results, Path(result_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see test_distributed.worker: torch 2.13's gloo thread can abort a finalizing interpreter


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """One launch of gloo ranks per world size (2, then 4) running every case of CASES; {world: [rank results]}."""
    root = tmp_path_factory.mktemp("expert_ranks")
    results = {}
    for world in (2, 4):
        directory = root / f"world{world}"
        directory.mkdir()
        earlier = str(root / "world2" / "run-2-False") if world == 4 else None
        run_ranks(launch_worker, (world, str(directory / "rendezvous"), str(directory), earlier), world,
                  timeout_s=200 * world)  # a loaded 2-core runner
        results[world] = [torch.load(directory / f"rank{rank}.pt") for rank in range(world)]
    return results, root


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory):
    """One process's Run of fsdp_case's settings (no expert parallelism, no sharding), full fine-tune and LoRA."""
    from dllm_fast.train.distributed import Ranks

    root = tmp_path_factory.mktemp("expert_single")
    return {lora: fsdp_case(root / f"single-{lora}", Ranks(), lora, 1, resume=False) for lora in (False, True)}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world, size, lora", [(2, 2, False), (2, 2, True), (4, 2, False)])
def test_expert_parallel_ranks_equal_one_process(launches, world, size, lora):
    """world ranks in expert groups of `size` under DDP (4 ranks: two groups, each expert on two replicas): each
    rank's logits, lp and greedy tokens on its share, the clipped norms and the whole parameters after two updates
    equal one process's on the whole batch to 1e-10 (LoRA: the routed experts frozen, the adapters trained)."""
    model = make_model(lora)
    batch = make_batch(world)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    single, _ = steps(model, model, batch, draw(batch),
                      lambda parameters, norm: torch.nn.utils.clip_grad_norm_(parameters, norm))
    assert single["norm0"] > CLIP
    rows = GROUPS_PER_RANK * G
    for rank in range(world):
        got = launches[0][world][rank]["ddp", size, lora]
        share = slice(rank * rows, (rank + 1) * rows)
        for key in ("logits", "lp0", "lp1"):
            torch.testing.assert_close(got[key], single[key][share], rtol=1e-10, atol=1e-10, msg=key)
        assert torch.equal(got["tokens"], single["tokens"][share])
        for key in ("norm0", "norm1"):
            torch.testing.assert_close(got[key], single[key], rtol=1e-10, atol=1e-12, msg=key)
        state = got["state"]
        final = model.state_dict()
        assert state.keys() == final.keys()
        for name in final:
            torch.testing.assert_close(state[name], final[name], rtol=1e-10, atol=1e-12, msg=name)
    experts = "base_model.model.model.layers.1.mlp.experts.gate_up_proj" if lora else \
        "model.layers.1.mlp.experts.gate_up_proj"
    assert torch.equal(final[experts], before[experts]) == lora  # trained in full, frozen under LoRA


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world, size, lora", [(2, 2, False), (2, 2, True), (4, 2, False), (4, 2, True),
                                               (4, 4, False)])
def test_fsdp2_with_expert_parallelism_equals_one_process(launches, single_runs, world, size, lora):
    """The trainer under --parallel fsdp2 --expert-parallel `size` on `world` gloo ranks in fp64 (one expert
    group: the experts whole on their ranks, outside FSDP2; two groups of 2 on 4 ranks: each rank's experts sharded
    over its 2 replicas): each rank's logits, greedy tokens at T = 0 (on the gathered rollout copy and on the
    per-layer gathers) and lp on its prompts, the clipped norms, and the whole trained weights after each of two
    updates equal one process's on the whole batch to 1e-10 (LoRA: the routed experts frozen)."""
    single = single_runs[lora]
    assert single["norm0"] > CLIP
    rows = FSDP_GROUPS * G // world
    for rank in range(world):
        got = launches[0][world][rank]["fsdp2", size, lora]
        share = slice(rank * rows, (rank + 1) * rows)
        for key in ("logits", "lp0", "lp1"):
            torch.testing.assert_close(got[key], single[key][share], rtol=1e-10, atol=1e-10, msg=key)
        assert torch.equal(got["tokens"], single["tokens"][share])
        assert torch.equal(got["tokens_sharded"], single["tokens"][share])
        for key in ("norm0", "norm1"):
            torch.testing.assert_close(got[key], single[key], rtol=1e-10, atol=1e-12, msg=key)
        for step in ("weights0", "weights1"):
            assert got[step].keys() == single[step].keys()
            for name, want in single[step].items():
                torch.testing.assert_close(got[step][name], want, rtol=1e-10, atol=1e-12, msg=name)
    moved = [n for n, w in single["weights1"].items() if not torch.equal(w, single["weights0"][n])]
    assert len(moved) == len(single["weights1"])  # the second update moved every trained weight
    experts = [n for n in single["weights1"] if n.endswith("experts.gate_up_proj")]
    assert bool(experts) != lora  # trained in full, frozen (not trainable) under LoRA
    how = "stay whole on it" if size == world else f"are sharded over their {world // size} replicas"
    assert any(f"FSDP2 shards the rest; each rank's experts {how}" in note for note in got["notes"])
    if (world, "fsdp2", size, lora) in OFFLOADED:  # --reference-offload true: every reference shard on the host
        assert all(launches[0][world][rank]["fsdp2", size, lora]["reference_offloaded"] == [True]
                   for rank in range(world))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_with_expert_parallelism_saves_the_whole_layout_and_resumes_bit_for_bit(launches, single_runs, world):
    """Under FSDP2 with expert groups of 2 (on 4 ranks, the experts also sharded over their replicas), the
    checkpoint after the first update holds the whole official layout (all 16 experts a layer, the single
    process's weights), and a Run resumed from it ends the second update bit for bit where the uninterrupted one
    did. The 2-rank checkpoint on 4 ranks is refused, naming both world sizes; with another --expert-parallel,
    naming both settings."""
    from dllm_fast.train.config import TrainConfig
    from dllm_fast.train.run import load_model_and_tokenizer

    results, root = launches
    for rank in range(world):
        got = results[world][rank]["fsdp2", 2, False]
        assert got["resumed"].keys() == got["weights1"].keys()
        for name, value in got["weights1"].items():
            assert torch.equal(got["resumed"][name], value), name
    saved, _ = load_model_and_tokenizer(TrainConfig(model=str(root / f"world{world}" / "run-2-False" / "checkpoint"
                                                              / "model")), "cpu")
    state = dict(saved.named_parameters())  # the run's names (the file's are the official per-expert ones)
    assert state["model.layers.1.mlp.experts.gate_up_proj"].shape[0] == 16
    for name, want in single_runs[False]["weights0"].items():
        torch.testing.assert_close(state[name].double(), want, rtol=1e-6, atol=1e-7, msg=name)
    if world == 4:
        other_world, other_experts = results[4][0]["refusals"]
        assert "was written by 2 ranks" in other_world and "this run has 4" in other_world
        assert "--expert-parallel 4 (saved: 2)" in other_experts


# -- train --expert-parallel under torchrun ---------------------------------------------------------------------

def torchrun_train(output_dir, size, steps_, *extra):
    flags = dict(model="llada2-tiny", task="synthetic", task_options='{"prompt_length": 6}', block_length=4,
                 gen_length=16, diffusion_steps=8, eval_gen_lengths=16, prompts_per_step=2, group_size=2,
                 eval_every=2, checkpoint_every=1, eval_examples=2, progress="false", plot="false", threads=1,
                 cache="block", objective="espo", expert_parallel=size, steps=steps_)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
               "dllm_fast", "train", "--output-dir", str(output_dir)]
    for key, value in flags.items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    subprocess.run(command + list(extra), check=True, capture_output=True, timeout=600,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})


def saved_parameters(output_dir):
    from dllm_fast.train.config import TrainConfig
    from dllm_fast.train.run import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(TrainConfig(model=str(Path(output_dir) / "checkpoint" / "model")), "cpu")
    return model.state_dict()


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_expert_parallel_follows_ddp_saves_the_whole_experts_and_resumes_bit_for_bit(tmp_path):
    """2 gloo ranks: `train --expert-parallel 2` (fp32) ends where the DDP run does; its checkpoint holds the
    whole experts in the official layout; a run stopped after step 1 and resumed to step 2 ends bit for bit where
    the uninterrupted one does; metrics.jsonl logs the expert ranks' load beside the router's balance."""
    torchrun_train(tmp_path / "ddp", 1, 2)
    torchrun_train(tmp_path / "experts", 2, 2)
    torchrun_train(tmp_path / "split", 2, 1)
    torchrun_train(tmp_path / "split", 2, 2, "--resume", "true")
    ddp, experts, split = (saved_parameters(tmp_path / name) for name in ("ddp", "experts", "split"))
    assert ddp.keys() == experts.keys() and experts["model.layers.1.mlp.experts.gate_up_proj"].shape[0] == 16
    for name in ddp:
        torch.testing.assert_close(experts[name], ddp[name], rtol=1e-5, atol=1e-6, msg=name)
        assert torch.equal(split[name], experts[name]), name
    initial = LLaDA2Model.preset_config("llada2-tiny")
    assert initial.num_experts == 16
    rows = [json.loads(line) for line in (tmp_path / "experts" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["expert_rank_load_max"] >= 1 and "router_load_max" in rows[-1]
    assert rows[-1]["grad_norm"] > 0
