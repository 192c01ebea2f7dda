"""The command line: `--help` lists the commands without loading torch, `train --help` describes every option and
its choices, `train --objective NAME --help` lists that objective's options, and bad flags are one line."""

import dataclasses
import subprocess
import sys

import pytest

from dllm_fast import objectives
from dllm_fast.train import TrainConfig
from dllm_fast.train.cli import main, parse_overrides
from dllm_fast.train.config import flag


def test_top_level_help_lists_the_commands_and_loads_no_torch():
    code = ("import sys; from dllm_fast.__main__ import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'python -m dllm_fast --help imported torch'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "train" in out and "demo" in out
    assert "--preset" not in out and "--rollout-length" not in out  # the demo's options are the demo's


def test_train_help_describes_every_option_with_its_choices(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for config_field in dataclasses.fields(TrainConfig):
        assert flag(config_field.name) in out, config_field.name
        assert " ".join(config_field.metadata["help"].split()[:4]) in out, config_field.name
    assert "one of " + ", ".join(objectives.available()) in out
    assert "one of none, prefix, dual" in out and "countdown, gsm8k, math, sudoku4" in out
    assert "--objective NAME --help" in out


def test_train_help_lists_the_objectives_own_options_with_their_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["--objective", "spg", "--help"])
    out = capsys.readouterr().out
    config = objectives.get("spg").config
    for config_field in dataclasses.fields(config):
        assert f"{config_field.name}={getattr(config, config_field.name)!r}" in out
    assert "beta=1.0" in out and "n_t=2" in out and "Monte Carlo masks per sequence" in out


@pytest.mark.parametrize("arguments, message", [
    (["--learning-rate", "1"], "unknown training option --learning-rate"),
    (["--stepz", "1"], r"did you mean --steps\?"),
    (["--steps", "many"], "--steps takes an integer, got 'many'"),
    (["--lora", "maybe"], "--lora takes true or false, got 'maybe'"),
    (["--objective-options", "[1]"], "--objective-options takes a JSON object"),
])
def test_a_bad_flag_is_one_line(arguments, message, capsys):
    with pytest.raises(SystemExit) as exit:
        main(arguments)
    assert str(exit.value).startswith("python -m dllm_fast train: ") and "\n" not in str(exit.value)
    assert __import__("re").search(message, str(exit.value))


def test_flags_with_underscores_and_typed_lists():
    values = parse_overrides(["--inner_updates", "2", "--betas", "0.8", "0.9", "--lora-targets", "q_proj",
                              "--eval-gen-lengths", "24", "48", "--diffusion-steps", "none"])
    assert values == {"inner_updates": 2, "betas": [0.8, 0.9], "lora_targets": ["q_proj"],
                      "eval_gen_lengths": [24, 48], "diffusion_steps": None}
    assert TrainConfig(**values).betas == [0.8, 0.9]
