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

    return TrainConfig(**{"model": "llada2-tiny", "block_length": 4, "gen_length": 8, "diffusion_steps": 4,
                          "eval_gen_lengths": [8], "prompts_per_step": 2, "group_size": 2,
                          "output_dir": str(tmp_path / "run"), **overrides})


@pytest.mark.parametrize("overrides, world, words", [
    (dict(model="sudoku4"), 2, "has no routed experts"),
    (dict(), 3, "must divide the number of ranks, 3"),
    (dict(), 1, "must divide the number of ranks, 1"),
    (dict(parallel="fsdp2"), 2, "--parallel fsdp2 with expert parallelism is not supported"),
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


def rank_worker(rank, world, size, lora, rendezvous, result_dir):
    import torch.distributed as dist

    from dllm_fast.contracts import unwrap_model
    from dllm_fast.train.distributed import Ranks
    from dllm_fast.train.expert_parallel import (ExpertGradients, distribute, expert_group, ignore_experts_in_ddp,
                                                 whole_state)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))  # a lost peer fails the collective, never hangs it
    try:
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
        state, optimizer_state = whole_state(model, optimizer, group)
        out["state"] = {k: v.detach().clone() for k, v in state.items()}
        torch.save(out, Path(result_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see test_distributed.worker: torch 2.13's gloo thread can abort a finalizing interpreter


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world, size, lora", [(2, 2, False), (2, 2, True), (4, 2, False)])
def test_expert_parallel_ranks_equal_one_process(tmp_path, world, size, lora):
    """world ranks in expert groups of `size` (4 ranks: two groups, each expert on two replicas): each rank's
    logits, lp and greedy tokens on its share, the clipped norms and the whole parameters after two updates equal
    one process's on the whole batch to 1e-10 (LoRA: the routed experts frozen, the adapters trained)."""
    run_ranks(rank_worker, (world, size, lora, str(tmp_path / "rendezvous"), str(tmp_path)), world)
    model = make_model(lora)
    batch = make_batch(world)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    single, _ = steps(model, model, batch, draw(batch),
                      lambda parameters, norm: torch.nn.utils.clip_grad_norm_(parameters, norm))
    assert single["norm0"] > CLIP
    rows = GROUPS_PER_RANK * G
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
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
