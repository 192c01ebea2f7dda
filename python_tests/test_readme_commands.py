"""The README's shell commands, parsed out of its ```bash blocks, are pasteable as written (issue 32 item 12).

Run here in full: `python -m dllm_fast train --help` (it must print every option), and the LoRA example's flags on
the Quickstart install. Checked without running (too slow for the suite, or needing what CI or a GPU has): every
other `train` command, whose flags must parse and whose configuration must validate as `train` would check it
before loading anything (the 300-step default of the Quickstart, the 200-step bgpo run, the config-file run and
the resumed run among them; a `path/to/...` checkpoint, the user's own, stands in as the `llada-8b` preset of the
same shapes); the pip commands, whose extras must exist; and the build, CI and emulator commands, whose scripts
and modules must exist. `plan` commands are the planner's (its own tests run them); VeRL is not installed here,
so its command is checked for the plugin module and the loss name it registers.
"""

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CHECKPOINT_PLACEHOLDER = "path/to/LLaDA-8B-Instruct"


def readme_commands() -> list[str]:
    """Every command of the README's bash blocks: continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line:
                commands.append(line)
    return commands


COMMANDS = readme_commands()


def parts(command: str) -> list[list[str]]:
    """The simple commands of a `&&` chain, each as its words."""
    return [shlex.split(part) for part in command.split(" && ")]


def train_arguments(words: list[str]) -> list[str] | None:
    """The arguments after `dllm_fast train` when `words` runs it (python -m or torchrun -m), else None."""
    for i in range(len(words) - 2):
        if words[i:i + 3] == ["-m", "dllm_fast", "train"]:
            return words[i + 3:]
    return None


def test_the_readme_has_the_commands_this_test_knows():
    assert len(COMMANDS) >= 14 and sum(train_arguments(w) is not None for c in COMMANDS for w in parts(c)) >= 7
    assert not any(" ... " in f" {c} " for c in COMMANDS if "dllm_fast train" in c), "a train command is elided"


@pytest.mark.parametrize("command", [c for c in COMMANDS if "dllm_fast train" in c])
def test_every_train_command_parses_and_validates(command, tmp_path, monkeypatch):
    from dllm_fast.train.cli import add_config_arguments, config_from_arguments, new_parser, parse

    monkeypatch.chdir(tmp_path)  # a config file the command writes goes here
    for words in parts(command):
        arguments = train_arguments(words)
        if arguments is None:  # a step before the run: writing its config file is the one the test runs
            if words[0] == "printf":
                subprocess.run(command.split(" && ")[0], shell=True, check=True)
            continue
        if arguments == ["--help"]:
            done = subprocess.run([sys.executable, "-m", "dllm_fast", "train", "--help"], capture_output=True,
                                  text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            assert done.stdout.startswith("usage: python -m dllm_fast train") and "--objective-options" in done.stdout
            continue
        arguments = [a.replace(CHECKPOINT_PLACEHOLDER, "llada-8b") for a in arguments]
        parser = new_parser()
        add_config_arguments(parser, arguments)
        config = config_from_arguments(parse(parser, arguments))  # every check `train` makes before loading
        # after the Quickstart, runs/default holds a run a new one may not replace
        if arguments and not config.run.resume:
            assert config.run.output_dir != "runs/default", f"{command}: name another --output-dir"


def test_the_pip_commands_name_extras_that_exist():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("peft") for d in dependencies)  # --lora true works on the Quickstart install
    for command in COMMANDS:
        for words in parts(command):
            if words[:2] == ["pip", "install"] or words[2:4] == ["pip", "install"]:
                for target in words:
                    match = re.fullmatch(r"\.\[(\w+)\]", target)
                    if match:
                        assert match.group(1) in extras, command


@pytest.mark.parametrize("command", [c for c in COMMANDS if "dllm_fast train" not in c])
def test_the_other_commands_name_scripts_and_modules_that_exist(command):
    import importlib.util

    from dllm_fast import objectives

    if "dllm_fast plan" in command:
        pytest.skip("plan commands are the planner's (python_tests/test_planning.py runs them)")
    for words in parts(command):
        words = [w for w in words if not re.fullmatch(r"[A-Z_]+=.*", w)]  # environment assignments
        if "pip" in words[:3]:
            continue  # test_the_pip_commands_name_extras_that_exist
        if words[0] in ("source", "bash") or words[0].startswith(".ci/"):
            script = words[1] if words[0] in ("source", "bash") else words[0]
            assert (ROOT / script).is_file(), command
        elif words[:2] == ["python", "-m"] and words[2].startswith("dllm_fast"):
            assert importlib.util.find_spec(words[2]) is not None, command
        elif words[:2] == ["python", "-m"] and words[2] == "pytest":
            assert (ROOT / words[3]).is_dir(), command
        elif words[:2] == ["python", "-m"] and words[2].startswith("verl"):  # VeRL's entry point, our plugin
            from dllm_fast.integrations.verl import PREFIX

            plugin = re.search(r"VERL_USE_EXTERNAL_MODULES=(\S+)", command).group(1)
            assert importlib.util.find_spec(plugin) is not None
            loss = re.search(r"loss_mode=(\S+)", command).group(1)
            assert loss.startswith(PREFIX) and loss[len(PREFIX):] in objectives.available()
        else:
            pytest.fail(f"a README command this test does not know how to check: {command}")


def test_lora_without_peft_is_one_line_naming_the_package(monkeypatch):
    """Issue 32 item 12: a Quickstart install without peft gave a raw ModuleNotFoundError traceback for --lora true.
    peft is now a dependency; should it be missing anyway, the configuration says so before anything loads."""
    import importlib.util

    from dllm_fast.train import TrainConfig

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(ValueError, match=r"--lora true needs the peft package, which is missing here; install it "
                                         r"with `pip install peft`"):
        TrainConfig(lora=True)
    TrainConfig(lora=False)  # nothing else needs it
