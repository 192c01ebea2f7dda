"""Objectives, the trainer, the planner and the adapters on block-diffusion models: `train --model sdar-tiny` runs
every objective without NaN (TraceRL on trajectories recorded by block decoding), an SDAR-layout checkpoint
loads, generates and trains, the planner plans a LoRA step, and the TRL and HF adapters accept the model."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dllm_fast
from dllm_fast import objectives
from dllm_fast.assets import SUDOKU4_DIR
from dllm_fast.models import HFDiffusionLM, SDARConfig, SDARModel
from dllm_fast.models.hf_pretrained import DiffusionPreTrainedModel
from dllm_fast.train import TrainConfig, train
from test_sdar_model import official_config, write_official_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

# sudoku4 (the embedded model's short prompts) with the embedded tokenizer, a random sdar-tiny in blocks of 4:
# 2 prompts x G = 2, 24 tokens in 6 blocks.
QUICK = dict(model="sdar-tiny", task_options={"prompt_style": "grid"}, block_length=4, gen_length=24, diffusion_steps=12, eval_gen_lengths=[24], steps=1,
             prompts_per_step=2, group_size=2, eval_every=10, checkpoint_every=10, eval_examples=2, progress=False,
             plot=False, threads=1, cache="block")


def quick_config(tmp_path, **overrides):
    return TrainConfig(**{**QUICK, "output_dir": str(tmp_path / "run"), **overrides})


@pytest.mark.parametrize("name", objectives.available())
@pytest.mark.slow
def test_every_objective_trains_a_block_model_without_nan(tmp_path, name):
    objective = objectives.get(name)
    small = {"n_t": 2} if objective.config.n_t > 2 and objective.config.sampler != "coupled" else {}
    if name == "tracerl":
        small = {"shrink": 1}  # TraceRL's setting for block models: every decoding step a state
    settings = {}
    if name == "justgrpo":  # left-to-right rollouts: the preset attends in blocks of 1
        small, settings = {}, dict(block_length=1, diffusion_steps=24)
    if objective.preference_pairs:  # stored pairs instead of rollouts
        settings = dict(task="sudoku4_pairs")
    if name == "d_treerpo":  # tree rollouts resume partly decoded canvases: bidirectional models only, refused early
        with pytest.raises(ValueError, match="tree rollouts resume partly decoded canvases"):
            train(quick_config(tmp_path, objective=name))
        return
    if name == "mdpo":  # its step record predicts every later block, which a block model never computes
        with pytest.raises(ValueError, match="record_step_predictions records each step's prediction"):
            train(quick_config(tmp_path, objective=name))
        return
    result = train(quick_config(tmp_path, objective=name, objective_options=small, inner_updates=2, **settings))
    row = result.history[-1]
    assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
    assert row["grad_norm"] >= 0


@pytest.mark.slow  # two training runs, about 20 s on 2 cores
def test_block_elbo_and_the_dynamic_rule_train(tmp_path):
    result = train(quick_config(tmp_path, objective="bgpo", objective_options={"n_t": 2, "sampler": "block_elbo"},
                                threshold=0.9))
    assert all(math.isfinite(v) for v in result.history[-1].values() if isinstance(v, float))


@pytest.mark.slow
def test_the_command_line_trains_sdar_tiny(tmp_path):
    """`python -m dllm_fast train --model sdar-tiny` with the defaults' schedule (its preset takes --block-length)."""
    out = subprocess.run([sys.executable, "-m", "dllm_fast", "train", "--model", "sdar-tiny", "--steps", "1",
                          "--task-options", '{"prompt_style": "grid"}',
                          "--prompts-per-step", "2", "--group-size", "2", "--eval-examples", "2", "--threads", "1",
                          "--progress", "false", "--plot", "false", "--output-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1 and math.isfinite(rows[-1]["loss"])
    saved = json.loads((tmp_path / "run" / "checkpoint" / "model" / "config.json").read_text())
    assert saved["model_type"] == "sdar" and saved["block_size"] == 24


def official_checkpoint(directory: Path) -> Path:
    """An SDAR-layout checkpoint (random bf16 weights by the official rules) with the embedded tokenizer's ids."""
    write_official_checkpoint(directory, official_config())  # vocabulary 111, EOS 105, mask 109: sudoku4's
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SUDOKU4_DIR / name, directory / name)
    return directory


def test_an_official_layout_checkpoint_loads_generates_and_trains(tmp_path):
    path = official_checkpoint(tmp_path / "sdar")
    model = SDARModel.from_pretrained(path, dtype=torch.float32)
    ids = torch.randint(0, 100, (2, 7))
    out = dllm_fast.generate(model, ids, gen_length=8, block_length=4, steps=4, cache="block")
    assert out.completion_ids.shape == (2, 8)
    result = train(quick_config(tmp_path, model=str(path), objective="tracerl", objective_options={"shrink": 1}))
    assert math.isfinite(result.history[-1]["loss"])
    with pytest.raises(ValueError, match="trained with blocks of 4 .* pass --block-length 4"):
        train(quick_config(tmp_path, model=str(path), block_length=8, overwrite=True))


@pytest.mark.slow  # a whole planned step, about 20 s on 2 cores
def test_the_planner_plans_a_lora_step_of_a_block_model():
    from dllm_fast.planning.gpus import GPU
    from dllm_fast.planning.planner import plan_step

    config = TrainConfig(model="sdar-tiny", lora=True, prompts_per_step=2, group_size=2, gen_length=8,
                         block_length=4, diffusion_steps=4, micro_batch=4, cache="block", bf16=False)
    plan = plan_step(config, gpu=GPU("roomy", "test GPU", 1e12, 1e12, 1e12, 1e12, 10**12), prompt_length=6,
                     search=False)
    assert plan.fits and plan.peak > 0
    # Issue 40 item 4: the rollout's forwards as the real run counts them (a 6-token prompt's first and last
    # blocks are partial: 1 + 2 + 1), not the widest layout's full steps (6).
    ids = torch.randint(0, 100, (4, 6))
    real = dllm_fast.generate(SDARModel.with_random_weights(SDARConfig.preset("sdar-tiny")), ids, torch.ones_like(ids),
                              config.generate_config("cpu"))
    assert plan.nfe == real.nfe == 4


def test_the_trl_wrapper_and_rollout_use_the_models_blocks():
    model = SDARModel.with_random_weights(SDARConfig.preset("sdar-tiny"))
    wrapped = DiffusionPreTrainedModel(model)
    assert wrapped.block_length == 4 and dllm_fast.contracts.block_length(wrapped) == 4
    pytest.importorskip("trl")
    from dllm_fast.integrations.trl import make_rollout_func
    from test_trl_integration import fake_trainer, trl_example

    out = make_rollout_func()(["a1 b70 a5", "b99"], fake_trainer(wrapped, trl_example.build_tokenizer()))
    assert len(out["completion_ids"]) == 2 and all(len(ids) <= 8 for ids in out["completion_ids"])
    hidden = wrapped(torch.randint(0, 100, (2, 9)))  # the contract's forward: hidden states
    assert hidden.shape == (2, 9, 64)


def test_the_hf_adapter_runs_an_sdar_model_block_by_block():
    """HFDiffusionLM's "block" style (model_type sdar's default) on transformers' Qwen3 with SDAR's weights gives
    the native model's likelihoods and greedy tokens."""
    transformers = pytest.importorskip("transformers")
    model = SDARModel.with_random_weights(SDARConfig.preset("sdar-tiny"), dtype=torch.float64, seed=2)
    c = model.config
    qwen = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
        rms_norm_eps=c.rms_norm_eps, attn_implementation="sdpa")).double()
    qwen.load_state_dict(model.state_dict())
    qwen.config.block_size = 4
    with pytest.raises(ValueError, match="no known logit convention"):
        HFDiffusionLM(qwen, mask_token_id=127, eos_token_id=126)
    hf = HFDiffusionLM(qwen, logit_shift=0, attention_mask_style="block", mask_token_id=127, eos_token_id=126)
    assert hf.block_length == 4
    ids = torch.randint(0, 120, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    masks = dllm_fast.likelihood.sample_masks(ids, prompt_length=5, n_t=2, sampler="block_elbo", count="all",
                                              attention_mask=mask, block_length=4,
                                              generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(dllm_fast.likelihood.score(hf, ids, masks, micro_batch=4, attention_mask=mask),
                                   dllm_fast.likelihood.score(model, ids, masks, micro_batch=4, attention_mask=mask),
                                   rtol=0, atol=1e-5)  # transformers builds its rotary tables in fp32
    kwargs = dict(gen_length=8, block_length=4, steps=4)
    assert torch.equal(dllm_fast.generate(hf, ids[:, :5], mask[:, :5], **kwargs).sequences,
                       dllm_fast.generate(model, ids[:, :5], mask[:, :5], cache="block", **kwargs).sequences)
