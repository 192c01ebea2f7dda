"""Settings refused early and by their own name (issue 45 item 5): a bad DLLM_FAST_BACKEND before `train` makes its
run directory, assumed_steps_per_block on real tensors of a block model, a group of one completion, LLaDA2 configs
whose rotary part is empty or whose pad id is bad, and LLaDA2 checkpoints with non-finite routers."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch

from dllm_fast.train.cli import main


def refused_train(capsys, tmp_path, *arguments: str) -> str:
    """The one-line error of `train ...` refused before it ran (exit 2), after checking nothing was written."""
    with pytest.raises(SystemExit) as exit_:
        main(["--output-dir", str(tmp_path / "run"), *arguments])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("python -m dllm_fast train: ") and error.count("\n") == 1, error
    assert not (tmp_path / "run").exists()  # the run directory was never made
    return error


# -- DLLM_FAST_BACKEND ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["tritn", "Compiled", "auto ", "reference,compiled", "0"])
def test_a_bad_backend_variable_is_named_before_train_makes_its_run_directory(value, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DLLM_FAST_BACKEND", value)
    error = refused_train(capsys, tmp_path)
    assert f"DLLM_FAST_BACKEND={value!r}" in error and "auto, compiled, reference, triton" in error


@pytest.mark.parametrize("value", ["tritn", "cuda"])
@pytest.mark.parametrize("op", ["masked_logprobs", "sample_tokens"])
def test_a_bad_backend_variable_is_named_by_the_ops_too(value, op, monkeypatch):
    """An op asked with backend=None (every public face's default) reads the variable, and names it."""
    from dllm_fast.ops.backend import choose_backend

    monkeypatch.setenv("DLLM_FAST_BACKEND", value)
    with pytest.raises(ValueError, match=f"DLLM_FAST_BACKEND={value!r} is not one of auto, compiled"):
        choose_backend(op, torch.device("cpu"), None)
    with pytest.raises(ValueError, match=f"backend={value!r} is not one of auto, compiled, reference, triton"):
        choose_backend(op, torch.device("cpu"), value)


def test_an_empty_backend_variable_is_auto(monkeypatch):
    from dllm_fast.ops.backend import environment_backend

    monkeypatch.setenv("DLLM_FAST_BACKEND", "")
    assert environment_backend() == "auto"


# -- train --group-size 1 -------------------------------------------------------------------------------------

@pytest.mark.parametrize("objective", ["diffu_grpo", "vrpo_ol", "wd1"])
def test_a_group_of_one_is_refused_naming_the_group_size(objective, capsys, tmp_path):
    """Every group-relative advantage of a group of one is 0: the run could not learn, and ran without a word."""
    error = refused_train(capsys, tmp_path, "--group-size", "1", "--objective", objective)
    assert "--group-size 1" in error and "every advantage is 0" in error and "--group-size 2" in error


# -- assumed_steps_per_block on real tensors ------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def block_model(preset: str):
    from dllm_fast.models.llada2 import LLaDA2Model
    from dllm_fast.models.sdar import SDARModel

    family = LLaDA2Model if preset.startswith("llada2") else SDARModel
    model = family.with_random_weights(family.preset_config(preset), seed=0)
    model.block_length = 4
    return model


@pytest.mark.parametrize("preset", ["sdar-tiny", "llada2-tiny"])
@pytest.mark.parametrize("assumed", [1, 2, 3])
def test_assumed_steps_per_block_on_real_tensors_of_a_block_model_is_a_clear_error(preset, assumed):
    """It surfaced as the sampler's internal "this is a bug in dllm_fast's sampler" error; now as the bidirectional
    sampler's: the option named, with the block it left incomplete and what to do."""
    from dllm_fast.rollout import GenerateConfig, generate

    config = GenerateConfig(gen_length=8, block_length=4, steps=None, threshold=0.99, cache="none",
                            assumed_steps_per_block=assumed)
    prompts = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=f"assumed_steps_per_block={assumed} left .* masked positions in block "
                                         r"\d+; it is meant for planning on fake tensors"):
        generate(block_model(preset), prompts, None, config)


@pytest.mark.parametrize("preset", ["sdar-tiny", "llada2-tiny"])
def test_assumed_steps_that_complete_every_block_decode(preset):
    """The guard of the guard: as many steps as a block has positions complete it, and the rollout decodes."""
    from dllm_fast.rollout import GenerateConfig, generate

    config = GenerateConfig(gen_length=8, block_length=4, steps=None, threshold=0.99, cache="none",
                            assumed_steps_per_block=4)
    prompts = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    result = generate(block_model(preset), prompts, None, config)
    assert result.completion_ids.shape == (2, 8)


# -- LLaDA2 configs -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("factor, head_dim", [(0.01, 16), (0.06, 16), (0.1, 16), (1 / 128, 128), (0.015, 64)])
def test_a_rotary_factor_that_rotates_fewer_than_two_dimensions_is_refused(factor, head_dim):
    from dllm_fast.models.llada2_config import LLaDA2Config

    tiny = LLaDA2Config.preset("llada2-tiny")
    with pytest.raises(ValueError, match=f"partial_rotary_factor={factor} of head_dim={head_dim} rotates [01] "
                                         f"dimensions.* use at least {2 / head_dim:g}"):
        dataclasses.replace(tiny, partial_rotary_factor=factor, head_dim=head_dim)
    assert dataclasses.replace(tiny, partial_rotary_factor=2 / head_dim, head_dim=head_dim).rotary_dim == 2


@pytest.mark.parametrize("pad, error", [(-1, ValueError), (10**9, ValueError), ("3", TypeError), (True, TypeError),
                                        (1.5, TypeError), (127, ValueError)])
@pytest.mark.parametrize("eos_given", [False, True])
def test_a_bad_pad_token_id_is_reported_as_the_pad_token_id(pad, error, eos_given):
    """A config.json without eos_token_id takes its pad id as the end of text (another tokenizer's vocabulary): a bad
    pad id was reported as eos_token_id, a field the file does not have."""
    from dllm_fast.models.llada2_config import LLaDA2Config

    values = LLaDA2Config.preset("llada2-tiny").to_dict()
    values.pop("eos_token_id", None)
    if eos_given:
        values["eos_token_id"] = 126
    values["pad_token_id"] = pad
    with pytest.raises(error, match=f"pad_token_id={pad!r}" if error is TypeError or pad != 127 else
                       "mask_token_id=127 is also pad_token_id"):
        LLaDA2Config.from_dict(values)


# -- LLaDA2 checkpoints with non-finite routers ---------------------------------------------------------------

@pytest.fixture(scope="module")
def llada2_checkpoint(tmp_path_factory):
    from dllm_fast.models.llada2 import LLaDA2Model

    path = tmp_path_factory.mktemp("llada2")
    LLaDA2Model.with_random_weights(LLaDA2Model.preset_config("llada2-tiny"), seed=0).save_pretrained(path)
    return path


@pytest.mark.parametrize("tensor, index", [("model.layers.1.mlp.gate.expert_bias", (3,)),
                                           ("model.layers.2.mlp.gate.expert_bias", (15,)),
                                           ("model.layers.1.mlp.gate.weight", (7, 5))])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_checkpoint_whose_router_is_not_finite_is_refused_at_load(llada2_checkpoint, tmp_path, tensor, index,
                                                                     value):
    """A NaN in expert_bias loaded and decoded (the outputs stay finite, the experts chosen are arbitrary)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from dllm_fast.models.llada2 import LLaDA2Model

    damaged = tmp_path / "damaged"
    shutil.copytree(llada2_checkpoint, damaged)
    weights = load_file(damaged / "model.safetensors")
    weights[tensor][index] = value
    save_file(weights, damaged / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"router tensor {tensor} holds NaN or inf for 1 of its 16 experts "
                                         f"\\({index[0]}\\)"):
        LLaDA2Model.from_pretrained(damaged)
    LLaDA2Model.from_pretrained(llada2_checkpoint)  # the intact one loads
    LLaDA2Model.from_pretrained(damaged, device="meta")  # a skeleton reads no values
    assert json.loads((damaged / "config.json").read_text())["model_type"]


# -- --parallel fsdp2 without torchrun ------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [[], ["--lora", "true"], ["--objective", "vrpo_ol"]])
def test_fsdp2_in_one_process_says_it_trains_unsharded(extra, capsys, tmp_path):
    """It ran unsharded without a word. The warning comes with the settings' checks, before the run starts (here
    a group of one stops the run right after it)."""
    with pytest.warns(UserWarning, match="--parallel fsdp2 shards the weights across torchrun's ranks, and this is "
                                         "one process .* trains unsharded"):
        refused_train(capsys, tmp_path, "--parallel", "fsdp2", "--group-size", "1", *extra)


def test_ddp_in_one_process_says_nothing(capsys, tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        refused_train(capsys, tmp_path, "--parallel", "ddp", "--group-size", "1")


# -- --eos-early-stop -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag, value", [("true", True), ("false", False), ("1", True), ("0", False)])
def test_eos_early_stop_is_a_train_flag_that_reaches_generate(flag, value):
    from dllm_fast.train import TrainConfig
    from dllm_fast.train.cli import parse_overrides

    settings = parse_overrides(["--eos-early-stop", flag])
    assert settings["eos_early_stop"] is value
    config = TrainConfig(model="sdar-tiny", cache="block", block_length=4, gen_length=8, diffusion_steps=8,
                         **settings)
    assert config.rollout.eos_early_stop is value
    assert config.generate_config("cpu").eos_early_stop is value  # what every rollout and evaluation decodes with
    assert TrainConfig.from_dict(config.to_dict()).rollout.eos_early_stop is value  # config.json round trip


def test_eos_early_stop_is_in_train_help_and_the_docs(capsys):
    from pathlib import Path

    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--eos-early-stop true|false" in help_text and "once every completion's finished blocks hold an EOS" in \
        help_text
    docs = (Path(__file__).resolve().parents[1] / "docs" / "training-and-configuration.md").read_text()
    assert "--eos-early-stop true" in docs


@pytest.mark.parametrize("model", ["tiny", "sudoku4", "dream-tiny"])
def test_eos_early_stop_on_a_bidirectional_model_is_refused_by_name(model, capsys, tmp_path):
    error = refused_train(capsys, tmp_path, "--model", model, "--eos-early-stop", "true")
    assert "--eos-early-stop true" in error and f"--model {model} decodes bidirectionally" in error
