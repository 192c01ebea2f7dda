"""The embedded default model: the shipped checkpoint loads in the official layout (AutoTokenizer, LLaDAModel),
reproduces its recorded accuracy, and the script that builds it runs end to end."""

import json

import pytest
import torch

from dllm_fast.assets import (SUDOKU4_DIR, SUDOKU4_GENERATION, SUDOKU4_ROLLOUT_TEMPERATURE, SUDOKU4_TASK_OPTIONS,
                              load_sudoku4)
from dllm_fast.build_sudoku4 import build, parse_args
from dllm_fast.models import LLaDAModel
from dllm_fast.tasks import get_task
from dllm_fast.train.evaluation import evaluate


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def check_official_layout(directory):
    names = {p.name for p in directory.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "llada" and config["architectures"] == ["LLaDAModelLM"]
    for field in ("d_model", "n_layers", "n_heads", "mlp_hidden_size", "vocab_size", "rope_theta", "mask_token_id",
                  "eos_token_id", "pad_token_id"):
        assert field in config
    assert "chat_template" in json.loads((directory / "tokenizer_config.json").read_text())


def check_special_ids(directory):
    """AutoTokenizer loads the directory offline, and its special tokens are the config's special ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    config = LLaDAModel.from_pretrained(directory).config
    assert len(tokenizer) == config.vocab_size
    assert tokenizer.mask_token_id == tokenizer.convert_tokens_to_ids("<|mdm_mask|>") == config.mask_token_id
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>") == config.eos_token_id
    assert tokenizer.pad_token_id == config.pad_token_id == config.eos_token_id  # LLaDA pads with EOS
    assert tokenizer.convert_tokens_to_ids("<|eot_id|>") == config.eot_token_id
    return tokenizer


def test_shipped_checkpoint_is_small_and_in_the_official_layout():
    check_official_layout(SUDOKU4_DIR)
    assert sum(p.stat().st_size for p in SUDOKU4_DIR.iterdir()) < 10 * 2**20


def test_autotokenizer_loads_it_offline_with_the_models_special_ids():
    tokenizer = check_special_ids(SUDOKU4_DIR)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "1200\n0000\n0000\n0001"}],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt == ("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\n1200\n0000\n0000\n0001<|eot_id|>"
                      "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert len(ids) == 31 and tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == prompt
    answer = "<answer>1234\n3412\n2143\n4321</answer>"
    ids = tokenizer(answer + "<|eot_id|><|endoftext|>")["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == answer


def test_shipped_model_reproduces_its_recorded_accuracy(one_thread):
    record = json.loads((SUDOKU4_DIR / "build_sudoku4.json").read_text())
    assert 0.2 <= record["test_accuracy"] <= 0.5
    assert record["generation"] == SUDOKU4_GENERATION and record["task_options"] == SUDOKU4_TASK_OPTIONS
    model, tokenizer, task = load_sudoku4()
    assert task.name == "sudoku4" and task.prompt_style == "grid"
    result = evaluate(model, tokenizer, task, **SUDOKU4_GENERATION)
    assert result.accuracy == record["test_accuracy"]
    sampled = evaluate(model, tokenizer, task, task.test_examples()[:32], **SUDOKU4_GENERATION,
                       temperature=SUDOKU4_ROLLOUT_TEMPERATURE)
    assert all("<answer>" in c for c in sampled.completions)


def test_load_sudoku4_names_a_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="build_sudoku4 --out"):
        load_sudoku4(tmp_path)


TINY_BUILD = ["--d-model", "16", "--n-layers", "1", "--n-heads", "2", "--mlp-hidden-size", "32", "--batch-size", "8",
              "--num-train", "64", "--num-test", "4", "--eval-every", "2", "--min-steps", "0"]


def test_build_script_smoke(one_thread, tmp_path):
    threads = torch.get_num_threads()
    summary = build(parse_args(["--out", str(tmp_path / "a"), "--max-steps", "4", "--stop-accuracy", "0.0",
                                *TINY_BUILD]))
    torch.set_num_threads(threads)
    assert summary["chosen_step"] == 2 and summary["curve"][0]["step"] == 2
    model, tokenizer, task = load_sudoku4(tmp_path / "a")
    assert model.config.d_model == 16 and len(tokenizer) == model.config.vocab_size
    check_official_layout(tmp_path / "a")
    check_special_ids(tmp_path / "a")
    assert json.loads((tmp_path / "a" / "build_sudoku4.json").read_text())["chosen_step"] == 2
    build(parse_args(["--out", str(tmp_path / "b"), "--max-steps", "4", "--stop-accuracy", "0.0", *TINY_BUILD]))
    torch.set_num_threads(threads)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    with pytest.raises(RuntimeError, match="did not reach --stop-accuracy=1.0"):
        build(parse_args(["--out", str(tmp_path / "c"), "--max-steps", "2", "--stop-accuracy", "1.0", *TINY_BUILD]))
    torch.set_num_threads(threads)
    assert not (tmp_path / "c").exists()
