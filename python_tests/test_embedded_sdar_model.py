"""The second embedded default, a tiny SDAR-architecture (block-diffusion) sudoku4 model: the shipped checkpoint
is small, in SDAR's official layout, loads as `--model sdar-sudoku4`, decodes in its blocks of 4 (block cache and
recomputation alike) with the greedy accuracy its build recorded, trains EBPO, and its builder is
deterministic."""

import json
import math

import pytest
import torch

from dllm_fast.assets import (EMBEDDED_MODELS, SDAR_SUDOKU4_DIR, SDAR_SUDOKU4_GENERATION, SUDOKU4_DIR,
                              SUDOKU4_ROLLOUT_TEMPERATURE, SUDOKU4_TASK_OPTIONS, load_sudoku4)
from dllm_fast.build_sudoku4 import build, parse_args
from dllm_fast.models import SDARModel
from dllm_fast.train.evaluation import evaluate


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def test_the_shipped_checkpoint_is_small_in_sdars_layout_with_the_shared_tokenizer():
    names = {p.name for p in SDAR_SUDOKU4_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "build_sudoku4.json"} <= names
    assert sum(p.stat().st_size for p in SDAR_SUDOKU4_DIR.iterdir()) < 2**20
    config = json.loads((SDAR_SUDOKU4_DIR / "config.json").read_text())
    assert config["model_type"] == "sdar" and config["architectures"] == ["SDARForCausalLM"]
    assert config["block_size"] == SDAR_SUDOKU4_GENERATION["block_length"] == 4
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (SDAR_SUDOKU4_DIR / name).read_bytes() == (SUDOKU4_DIR / name).read_bytes()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(SDAR_SUDOKU4_DIR))
    model = SDARModel.from_pretrained(SDAR_SUDOKU4_DIR, device="meta")
    assert (tokenizer.mask_token_id, tokenizer.eos_token_id) == (model.mask_token_id, model.eos_token_id)
    assert 90_000 < sum(p.numel() for p in model.parameters()) < 110_000  # the LLaDA model's size
    assert EMBEDDED_MODELS["sdar-sudoku4"] == SDAR_SUDOKU4_DIR


@pytest.mark.slow
def test_it_reproduces_its_recorded_accuracy_with_and_without_the_block_cache(one_thread):
    record = json.loads((SDAR_SUDOKU4_DIR / "build_sudoku4.json").read_text())
    assert 0.2 <= record["test_accuracy"] <= 0.5 and record["settings"]["architecture"] == "sdar"
    assert record["generation"] == SDAR_SUDOKU4_GENERATION and record["task_options"] == SUDOKU4_TASK_OPTIONS
    model, tokenizer, task = load_sudoku4(SDAR_SUDOKU4_DIR)
    assert isinstance(model, SDARModel) and model.block_length == 4
    cached = evaluate(model, tokenizer, task, **SDAR_SUDOKU4_GENERATION)
    assert cached.accuracy == record["test_accuracy"]
    recomputed = evaluate(model, tokenizer, task, task.test_examples()[:64], **{**SDAR_SUDOKU4_GENERATION,
                                                                               "cache": "none"})
    assert recomputed.completions == cached.completions[:64]
    sampled = evaluate(model, tokenizer, task, task.test_examples()[:32], **SDAR_SUDOKU4_GENERATION,
                       temperature=SUDOKU4_ROLLOUT_TEMPERATURE)
    assert all("<answer>" in c for c in sampled.completions)


@pytest.mark.slow
def test_train_runs_ebpo_on_it(tmp_path):
    """`train --model sdar-sudoku4 --block-length 4 --cache block --objective ebpo`: rollouts whose rewards differ,
    so a nonzero, finite gradient."""
    from dllm_fast.train import TrainConfig, train

    result = train(TrainConfig(model="sdar-sudoku4", block_length=4, cache="block", objective="ebpo",
                               objective_options={"n_t": 4}, steps=1, prompts_per_step=2, group_size=4,
                               task_options={"num_train": 64, "num_test": 8},
                               eval_every=10, checkpoint_every=10, eval_examples=4, progress=False, plot=False,
                               threads=1, output_dir=str(tmp_path / "run")))
    row = result.history[-1]
    assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)) and row["grad_norm"] > 0


def test_a_block_length_other_than_its_own_is_refused(tmp_path):
    from dllm_fast.train import TrainConfig, train

    with pytest.raises(ValueError, match="trained with blocks of 4 .*pass --block-length 4"):
        train(TrainConfig(model="sdar-sudoku4", cache="block", steps=1, output_dir=str(tmp_path / "run")))


TINY = ["--architecture", "sdar", "--d-model", "16", "--n-layers", "1", "--n-heads", "2", "--mlp-hidden-size", "32",
        "--batch-size", "8", "--num-train", "64", "--num-test", "4", "--eval-every", "2", "--min-steps", "0",
        "--max-steps", "2", "--stop-accuracy", "0.0"]


def test_the_builder_makes_an_sdar_model_deterministically(one_thread, tmp_path):
    threads = torch.get_num_threads()
    summary = build(parse_args(["--out", str(tmp_path / "a"), *TINY]))
    build(parse_args(["--out", str(tmp_path / "b"), *TINY]))
    torch.set_num_threads(threads)
    assert summary["generation"] == SDAR_SUDOKU4_GENERATION and summary["settings"]["block_size"] == 4
    model, tokenizer, _ = load_sudoku4(tmp_path / "a")
    assert isinstance(model, SDARModel) and model.config.hidden_size == 16 and model.block_length == 4
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="--block-size 5 must divide"):
        build(parse_args(["--out", str(tmp_path / "c"), *TINY, "--block-size", "5"]))
    torch.set_num_threads(threads)
