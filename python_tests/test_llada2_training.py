"""Objectives, the trainer, LoRA, FSDP2 and the planner on LLaDA2: `train --model llada2-tiny` runs every objective
without NaN and logs the router's balance; a checkpoint in LLaDA2.0-mini's official layout (random weights, tiny
widths, the official config's fields) loads, generates and trains; LoRA adapts the attention and the shared
experts, not the routed ones; two FSDP2 ranks give one process's update; the planner plans a LoRA step."""

import json
import math
import os
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import dllm_fast
from dllm_fast import objectives
from dllm_fast.assets import SUDOKU4_DIR
from dllm_fast.contracts import RolloutBatch, completion_mask
from dllm_fast.models import LLaDA2Config, LLaDA2Model
from dllm_fast.testing.ranks import run_ranks
from dllm_fast.train import TrainConfig, train
from test_llada2_model import official_config, write_official_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

# sudoku4 (short prompts) with the embedded tokenizer, a random llada2-tiny in blocks of 4: 2 prompts x G = 2,
# 16 tokens in 4 blocks.
QUICK = dict(model="llada2-tiny", task_options={"prompt_style": "grid"}, block_length=4, gen_length=16,
             diffusion_steps=8, eval_gen_lengths=[16], steps=1, prompts_per_step=2, group_size=2, eval_every=10,
             checkpoint_every=10, eval_examples=2, progress=False, plot=False, threads=1, cache="block")


def quick_config(tmp_path, **overrides):
    return TrainConfig(**{**QUICK, "output_dir": str(tmp_path / "run"), **overrides})


def finite(row: dict) -> bool:
    return all(math.isfinite(v) for v in row.values() if isinstance(v, float))


@pytest.mark.slow
# JustGRPO and offline VRPO run on block models in test_block_training (SDAR): no second MoE case for them; d-TreeRPO's
# and MDPO's refusals on block models are tested there
@pytest.mark.parametrize("name", [n for n in objectives.available()
                                  if n not in ("justgrpo", "vrpo_dpo", "d_treerpo", "mdpo")])
def test_every_objective_trains_llada2_without_nan(tmp_path, name):
    objective = objectives.get(name)
    small = {"n_t": 2} if objective.config.n_t > 2 and objective.config.sampler != "coupled" else {}
    if name == "tracerl":
        small = {"shrink": 1}  # TraceRL's setting for block models: every decoding step a state
    result = train(quick_config(tmp_path, objective=name, objective_options=small, inner_updates=2))
    row = result.history[-1]
    assert finite(row), row
    assert row["grad_norm"] >= 0


def test_a_step_logs_the_routers_balance(tmp_path):
    result = train(quick_config(tmp_path, objective="bgpo", objective_options={"n_t": 2, "sampler": "block_elbo"},
                                threshold=0.9))
    row = result.history[-1]
    assert finite(row) and row["grad_norm"] >= 0
    assert row["router_load_max"] >= 1 and row["router_load_cv"] >= 0 and 0 <= row["router_idle_experts"] < 1


@pytest.mark.slow
def test_the_command_line_trains_llada2_tiny(tmp_path):
    """`python -m dllm_fast train --model llada2-tiny` with the defaults' schedule (its preset takes
    --block-length): the checkpoint is in the official layout."""
    out = subprocess.run([sys.executable, "-m", "dllm_fast", "train", "--model", "llada2-tiny", "--steps", "1",
                          "--task-options", '{"prompt_style": "grid"}', "--cache", "block",
                          "--prompts-per-step", "2", "--group-size", "2", "--eval-examples", "2", "--threads", "1",
                          "--progress", "false", "--plot", "false", "--output-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1 and math.isfinite(rows[-1]["loss"]) and "router_load_cv" in rows[-1]
    model_dir = tmp_path / "run" / "checkpoint" / "model"
    saved = json.loads((model_dir / "config.json").read_text())
    assert saved["model_type"] == "llada2_moe" and saved["block_size"] == 24
    index = json.loads((model_dir / "model.safetensors.index.json").read_text()) \
        if (model_dir / "model.safetensors.index.json").exists() else None
    from safetensors import safe_open
    keys = set(index["weight_map"]) if index else set(safe_open(str(model_dir / "model.safetensors"), "pt").keys())
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in keys and not any(k.endswith("gate_up_proj") for k in keys)


def official_checkpoint(directory: Path) -> Path:
    """A checkpoint in LLaDA2.0-mini's layout (its config.json's fields, tiny widths, random bf16 weights by the
    official naming) with the embedded tokenizer's vocabulary and ids (111 tokens, EOS/pad 105, mask 109)."""
    write_official_checkpoint(directory, official_config())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SUDOKU4_DIR / name, directory / name)
    return directory


def test_an_official_layout_checkpoint_loads_generates_and_trains(tmp_path):
    path = official_checkpoint(tmp_path / "llada2")
    model = LLaDA2Model.from_pretrained(path, dtype=torch.float32, block_length=4)
    ids = torch.randint(0, 100, (2, 7))
    out = dllm_fast.generate(model, ids, gen_length=8, block_length=4, steps=4, threshold=0.95, cache="block")
    assert out.completion_ids.shape == (2, 8) and (out.completion_ids != 109).all()
    result = train(quick_config(tmp_path, model=str(path), block_length=32, gen_length=32, diffusion_steps=8,
                                eval_gen_lengths=[32], objective="tracerl", objective_options={"shrink": 1}))
    assert finite(result.history[-1]) and math.isfinite(result.history[-1]["loss"])
    with pytest.raises(ValueError, match="pass --block-length 32"):
        train(quick_config(tmp_path, model=str(path), block_length=4, overwrite=True))


def test_lora_adapts_attention_and_shared_experts_not_the_routed_ones(tmp_path):
    pytest.importorskip("peft")
    result = train(quick_config(tmp_path, lora=True, lora_rank=4, objective="espo", objective_options={"n_t": 2}))
    assert finite(result.history[-1])
    adapter = tmp_path / "run" / "checkpoint" / "adapter"
    from safetensors.torch import load_file
    names = list(load_file(str(next(adapter.glob("*.safetensors")))))
    assert any("attention.query_key_value.lora_A" in n for n in names)
    assert any("shared_experts.down_proj.lora_B" in n for n in names)
    assert any("layers.0.mlp.gate_proj.lora_A" in n for n in names)  # the dense layer's MLP
    assert not any(".experts." in n.replace("shared_experts", "") or "mlp.gate." in n for n in names)


@pytest.mark.slow
def test_the_planner_plans_a_lora_step():
    from dllm_fast.planning.gpus import GPU
    from dllm_fast.planning.planner import plan_step

    config = TrainConfig(model="llada2-tiny", lora=True, prompts_per_step=2, group_size=2, gen_length=8,
                         block_length=4, diffusion_steps=4, micro_batch=4, cache="block", bf16=False)
    plan = plan_step(config, gpu=GPU("roomy", "test GPU", 1e12, 1e12, 1e12, 1e12, 10**12), prompt_length=6,
                     search=False)
    assert plan.fits and plan.peak > 0


WORLD, G, P, L = 2, 2, 4, 8


def make_model():
    return LLaDA2Model.with_random_weights(LLaDA2Config.preset("llada2-tiny"), dtype=torch.float64, seed=0)


def make_batch():
    gen = torch.Generator().manual_seed(1)
    sequences = torch.randint(0, 120, (2 * WORLD * G, P + L), generator=gen)
    sequences[1, P + 5:] = 126
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.25, 1.0, 1.0], dtype=torch.float64)
    return RolloutBatch(sequences, None, P, completion_mask(sequences[:, P:], 126), rewards, G)


def update(model, batch, masks):
    objective = objectives.get("espo", n_t=2, beta=0.0)
    optimizer = torch.optim.AdamW(list(model.parameters()), lr=1e-2)
    objective.backward(model, batch, objectives.InnerUpdate(masks), micro_batch=3)
    optimizer.step()


def draw(batch):
    return objectives.get("espo", n_t=2, beta=0.0).draw_masks(batch, generator=torch.Generator().manual_seed(2),
                                                              eos_token_id=126)


def fsdp2_worker(rank, rendezvous, result_path):
    import torch.distributed as dist

    from dllm_fast.train.distributed import Ranks, data_parallel_wrapper

    torch.set_num_threads(1)
    # A rank that never arrives (or a collective that never completes) raises after 120 s instead of hanging.
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    try:
        model = make_model()
        batch = make_batch()
        groups = batch.num_groups // WORLD
        masks = draw(batch)
        wrapped = data_parallel_wrapper(model, "fsdp2", Ranks(rank, WORLD), torch.device("cpu"))
        experts = wrapped.moe_layers()[0].experts.gate_up_proj
        assert experts.to_local().shape[0] == 16 // WORLD  # the stacked experts are sharded by expert
        update(wrapped, batch.groups(rank * groups, (rank + 1) * groups),
               masks.rows(rank * groups * G, (rank + 1) * groups * G))
        state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                 for k, v in wrapped.state_dict().items()}
        if rank == 0:
            torch.save(state, result_path)
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see test_distributed.worker: torch 2.13's gloo thread can abort a finalizing interpreter


@pytest.mark.slow
@pytest.mark.distributed
def test_two_fsdp2_ranks_equal_one_process(tmp_path):
    """FSDP2 shards every layer (the stacked experts by expert) across 2 gloo ranks; one update of each rank's
    share gives a single process's update on the whole batch."""
    result = tmp_path / "rank0.pt"
    run_ranks(fsdp2_worker, (str(tmp_path / "rendezvous"), str(result)), WORLD)
    distributed = torch.load(result)
    model = make_model()
    batch = make_batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    update(model, batch, draw(batch))
    single = model.state_dict()
    assert distributed.keys() == single.keys()
    for name in single:
        torch.testing.assert_close(distributed[name], single[name], rtol=1e-10, atol=1e-12, msg=name)
    assert not torch.equal(single["model.layers.1.mlp.experts.gate_up_proj"],
                           before["model.layers.1.mlp.experts.gate_up_proj"])
