"""The command line: `--help` lists the commands without loading torch, `train --help` describes every option and
its choices, `train --objective NAME --help` lists that objective's options, and bad flags are one line."""

import dataclasses
import re
import subprocess
import sys

import pytest

from dllm_fast import objectives
from dllm_fast.train import TrainConfig
from dllm_fast.train.cli import main, parse_overrides
from dllm_fast.train.settings import OPTIONS


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
    for setting in OPTIONS.values():
        assert setting.flag in out, setting.key
        assert " ".join(setting.field.metadata["help"].split()[:4]) in out, setting.key
    assert "one of " + ", ".join(objectives.available()) in out
    assert "one of none, prefix, dual" in out and "countdown, gsm8k, math, pairs_jsonl, sudoku4" in out
    assert "--objective NAME --help" in out


def test_train_help_lists_the_objectives_own_options_with_their_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["--objective", "spg", "--help"])
    out = capsys.readouterr().out
    config = objectives.get("spg").config
    options = {**dataclasses.asdict(config.masks),  # the mask settings are options of their own
               **{f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "masks"}}
    for name, value in options.items():
        assert f"{name}={value!r}" in out
    assert "beta=1.5" in out and "n_t=2" in out and "Monte Carlo masks per sequence" in out
    assert "preset 'sudoku': beta=1.0" in out


@pytest.mark.parametrize("arguments, message", [
    (["--learning-rate", "1"], "unknown training option --learning-rate"),
    (["--stepz", "1"], r"did you mean --steps\?"),
    (["--steps", "many"], "--steps = 'many' must be an integer"),
    (["--lora", "maybe"], "--lora = 'maybe' must be true or false"),
    (["--objective-options", "[1]"], "--objective-options = '\\[1\\]' must be a mapping of option names"),
    (["--objective", "foo"], "--objective 'foo' is not one of diffu_grpo"),
    (["--model", "/nonexistent"], "--model '/nonexistent' is neither a preset"),
    (["--task", "foo"], "--task 'foo' is not one of countdown"),
    (["--cache", "bogus"], "--cache 'bogus' is not one of none, prefix, dual"),
    (["--eval-gen-lengths", "0"], "--eval-gen-lengths=0 must be an int >= 1"),
    (["--threads", "0"], "--threads=0 must be an int >= 1"),
    (["--betas", "a", "b"], "--betas = 'a' must be a number"),
    (["--betas", "0.9"], "--betas 0.9 must be two numbers"),
    (["--seed", str(2**70)], r"--seed=\d+ must be an int in \[0, 9223372036854775807\]"),
    (["--eval-examples", "-1"], "--eval-examples=-1 must be an int >= 1"),
    (["--output-dir", ""], "--output-dir is empty"),
    (["--objective-options", '{"n_t": 0}'], "--objective-options: n_t=0 must be an int >= 1"),
    (["--prompts-per-step", str(10**9)], "rollouts per step, more than 1048576"),
    (["--diffusion-steps", str(10**9)], "--diffusion-steps 1000000000 exceeds --gen-length 24"),
    (["--inner-updates", str(10**9)], "--inner-updates 1000000000 is more than 1024"),
    (["--threshold", "0.9"], "pass --diffusion-steps none with it"),
    (["--lora", "true", "--lora-targets", "bogus"], "--lora-targets bogus: LLaDAModel's adaptable modules are"),
])
def test_a_bad_option_is_one_line_before_anything_runs(arguments, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit:
        main(["--output-dir", str(tmp_path / "run"), *arguments])
    assert exit.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("python -m dllm_fast train: ") and error.count("\n") == 1, error
    assert re.search(message, error), error
    assert not (tmp_path / "run").exists()  # nothing was written


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(ValueError, match="--objective 'foo' is not one of"):
        main(["--objective", "foo", "--debug"])


def test_flags_with_underscores_and_typed_lists():
    values = parse_overrides(["--inner_updates", "2", "--betas", "0.8", "0.9", "--lora-targets", "q_proj",
                              "--eval-gen-lengths", "24", "48", "--diffusion-steps", "none", "--threshold", "0.9"])
    assert values == {"inner_updates": 2, "betas": [0.8, 0.9], "lora_targets": ["q_proj"],
                      "eval_gen_lengths": [24, 48], "diffusion_steps": None, "threshold": 0.9}
    assert TrainConfig(**values).optim.betas == [0.8, 0.9]
