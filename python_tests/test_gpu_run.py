"""benchmarks/gpu_run.sh stays in step with the benchmarks it runs, without a GPU and without running them: every
flag it passes to a benchmark is one that benchmark's argparse defines, every script it names exists, and the
places kept for the merge are marked."""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_run.sh"


def script_commands(script: Path = SCRIPT) -> list[list[str]]:
    """Each `python3 benchmarks/...` command of the script, continuation lines joined, as its words."""
    text = re.sub(r"\\\n\s*", " ", script.read_text())
    commands = []
    for line in text.splitlines():
        line = line.split("#", 1)[0] if line.lstrip().startswith("#") else line
        match = re.search(r"python3 (benchmarks/\S+\.py)(.*?)(?:\||;|$)", line)
        if match:
            commands.append([match.group(1), *shlex.split(match.group(2).replace("$", ""))])
    return commands


def argparse_flags(path: Path) -> set[str]:
    """The option strings of every add_argument call in `path` (and in the helpers it imports from common.py)."""
    flags = set()
    sources = [path] + ([ROOT / "benchmarks" / "common.py"] if "common" in path.read_text() else [])
    for source in sources:
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
    return flags


def unknown_flags(script: Path = SCRIPT) -> list[str]:
    """'benchmark: --flag' for each flag the script passes that the benchmark's argparse does not define."""
    unknown = []
    for command in script_commands(script):
        flags = {word.split("=")[0] for word in command[1:] if word.startswith("--")}
        unknown += [f"{command[0]}: {flag}" for flag in sorted(flags - argparse_flags(ROOT / command[0]))]
    return unknown


def test_every_benchmark_flag_the_gpu_run_passes_exists():
    scripts = {c[0] for c in script_commands()}
    assert {"benchmarks/gpu_smoke.py", "benchmarks/peers_logprob.py", "benchmarks/bench_rollout.py",
            "benchmarks/bench_elbo.py", "benchmarks/bench_logprob.py", "benchmarks/bench_peers.py"} <= scripts
    assert all((ROOT / script).is_file() for script in scripts)
    assert unknown_flags() == []


def test_a_flag_the_benchmark_lacks_is_caught(tmp_path):
    """The check above fails on a flag that a benchmark does not define (the guard of the guard)."""
    changed = tmp_path / "gpu_run.sh"
    changed.write_text(SCRIPT.read_text().replace("--roofline", "--roofline --no-such-flag 3", 1))
    assert unknown_flags(changed) == ["benchmarks/bench_logprob.py: --no-such-flag"]


def step_flags(script: Path = SCRIPT) -> list[str]:
    """The STEP_FLAGS array the script's 8B training step and its plan share, as words."""
    text = re.sub(r"\\\n\s*", " ", script.read_text())
    match = re.search(r"^STEP_FLAGS=\((.*?)\)$", text, flags=re.S | re.M)
    assert match, "gpu_run.sh lost its STEP_FLAGS array"
    return shlex.split(match.group(1).replace('"$RES/llada_vocab"', "llada_vocab"))


def test_the_script_parses_and_records_the_machine():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    text = SCRIPT.read_text()
    assert "[BENCH_ELBO" not in text and "not yet" not in text, "a place kept for the merge is still empty"
    for recorded in ("nvidia-smi", "torch.__version__", "git log -1"):  # the log starts with GPU, torch, commit
        assert recorded in text.split("t build", 1)[0]


@pytest.mark.slow  # 8B shapes on fake tensors, about 10 s on 2 cores
def test_the_8b_training_steps_configuration_validates(tmp_path):
    """The whole-step command (issue 29 item 5) is a configuration train accepts: every flag parses and the
    TrainConfig validates as train checks it before loading anything (the tokenizer, written on the GPU host,
    replaced by one written here)."""
    from dllm_fast.train.cli import add_config_arguments, config_from_arguments, new_parser, parse

    words = step_flags()
    assert "train" in SCRIPT.read_text() and "--gpu h200" in SCRIPT.read_text()
    tokenizer = tmp_path / "llada_vocab"
    subprocess.run([sys.executable, "-m", "dllm_fast.assets.char_tokenizer", "--vocab-size", "126464", "--out",
                    str(tokenizer)], check=True, capture_output=True)
    words = [str(tokenizer) if w == "llada_vocab" else w for w in words]
    parser = new_parser()
    add_config_arguments(parser)
    config = config_from_arguments(parse(parser, words + ["--steps", "3", "--output-dir", str(tmp_path / "run")]))
    assert (config.model.name, config.lora.enabled, config.run.task, config.objective.micro_batch) == (
        "llada-8b", True, "synthetic", 31)
    assert config.run.prompts_per_step * config.run.group_size == 32
