"""`python -m dllm_fast plan` answers or refuses clearly for every flag combination its --help allows (issue 32
items 7-10, issue 28 item 5): every objective with an explicit n_t, every cache mode, compiled or not, hostile
sizes, and the plan commands of README and docs/planning.md. Tiny shapes, except those, which are their own."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dllm_fast import objectives
from dllm_fast.planning import cli

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "tiny", "--prompt-length", "8", "--gen-length", "16", "--block-length", "8",
        "--diffusion-steps", "4", "--prompts-per-step", "2", "--group-size", "4", "--micro-batch", "4",
        "--gpu", "h100", "--json"]


def plan(capsys, *argv: str) -> dict:
    """The plan of `argv` through the command's own entry point, as JSON."""
    cli.main([*TINY, *argv])
    return json.loads(capsys.readouterr().out)


def refusal(capsys, *argv: str) -> str:
    """The one-line error of a refused `plan` command (exit status 1 or 2)."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(list(argv))
    assert exit_.value.code in (1, 2)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def explicit_n_t(name: str) -> int:
    """An n_t the objective accepts other than its default (1 for the trajectory objective, which takes only 1)."""
    return objectives.nearest_valid_n_t(name, 3) or 1


CACHES = ("none", "prefix", "dual")


# The objectives the LLaDA preset cannot run plan on the setup they need: EBPO on a block model's block cache,
# offline VRPO on preference pairs (no rollout).
OWN_SETUP = {"ebpo": ["--model", "sdar-tiny", "--cache", "block"], "vrpo_dpo": ["--task", "sudoku4_pairs"]}


@pytest.mark.parametrize("index, name", list(enumerate(objectives.available())))
@pytest.mark.slow
def test_every_objective_and_cache_mode_plans_with_an_explicit_n_t(capsys, index, name):
    """--objective-options '{"n_t": N}' used to fail for every objective ("nearest_valid_n_t() got multiple values
    for argument 'n_t'"), and tracerl failed without one (a fixed n_t has no second probe). The objectives take
    the cache modes in turn, eager and compiled, so that every cache mode plans both ways."""
    n_t = explicit_n_t(name)
    cache, compile = CACHES[index % 3], ("false", "true")[index // 3 % 2]
    if name == "mdpo":  # records every step's prediction, eagerly, which the dual cache cannot (its own tests)
        cache, compile = ("prefix" if cache == "dual" else cache), "false"
    if name == "d_treerpo":  # resumes canvases eagerly, and branches inside the default's one block (no cache)
        cache, compile = "none", "false"
    search = "true" if name in ("tracerl", "vrpo_ol") else "false"
    own = OWN_SETUP.get(name, [])
    cache = own[own.index("--cache") + 1] if "--cache" in own else cache
    result = plan(capsys, "--objective", name, "--objective-options", json.dumps({"n_t": n_t}), "--cache", cache,
                  "--compile", compile, "--search", search, *own)
    assert result["shapes"]["n_t"] == n_t
    assert result["phases"]["inner update"]["flops"] > 0 and result["fits"] is True
    rollout = result["phases"].get("rollout")
    if name == "vrpo_dpo":  # the pairs are data: no rollout to price
        assert rollout is None or rollout["seconds"] == 0
    else:
        assert result["compiled"] is (compile == "true") and rollout["seconds"] > 0
        assert (rollout["memory_bytes"]["kv_cache"] > 0) is (cache != "none")
    if name == "tracerl":
        assert "n_t" not in result["largest"] and "decoding states" in " ".join(result["notes"])
    elif search == "true":
        assert result["largest"]["n_t"] >= n_t


def test_the_objectives_cover_every_cache_mode_eager_and_compiled():
    covered = {(CACHES[i % 3], i // 3 % 2) for i in range(len(objectives.available()))}
    assert covered == {(cache, compile) for cache in CACHES for compile in (0, 1)}


@pytest.mark.parametrize("flags", [["--threshold", "0.9", "--diffusion-steps", "none", "--engine", "all_graphs"],
                                   ["--weights-dtype", "bfloat16", "--inner-updates", "2"],
                                   ["--lora", "true", "--lora-rank", "4", "--gpu", "l40s", "--bf16", "false"]])
@pytest.mark.slow
def test_other_options_plan(capsys, flags):
    result = plan(capsys, *flags, "--search", "false")
    assert result["peak_bytes"] > 0 and result["step_seconds"] > 0


@pytest.mark.parametrize("argv, named", [
    (["--gen-length", "1000000", "--block-length", "1000000"], "--gen-length 1000000"),
    (["--prompt-length", "100000"], "--prompt-length 100000"),
    (["--prompt-length", "0"], "--prompt-length 0"),
    (["--model", "llada-8b", "--prompt-length", "8", "--gen-length", "2048", "--block-length", "2048",
      "--diffusion-steps", "2048"], "2048 denoising steps"),
    (["--prompts-per-step", "64", "--micro-batch", "1"], "--micro-batch"),
    (["--prompts-per-step", "4096", "--group-size", "256", "--objective", "vrpo_ol"], "rollouts"),
    (["--gpu", "h300"], "--gpu 'h300'"),
    (["--objective", "espo", "--objective-options", '{"n_t": 3}'], "n_t=3"),
])
def test_hostile_sizes_are_refused_naming_the_flag(capsys, argv, named):
    """Sizes the trainer would refuse, or that a plan cannot replay in bounded time, are one line naming the flag
    (a million-token completion used to end in a fake-tensor AssertionError; a 100,000-token prompt ran for
    minutes)."""
    assert named in refusal(capsys, *argv)


PLANNING_DOCS = (ROOT / "README.md", ROOT / "docs" / "planning.md")


def readme_plan_commands() -> list[str]:
    """The `python -m dllm_fast plan` commands of the README and docs/planning.md, continuation lines joined, each
    once (other pages' plan commands are parsed and validated by test_readme_commands.py, not run)."""
    commands = []
    for path in PLANNING_DOCS:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
            for command in re.sub(r"\\\n\s*", " ", block).splitlines():
                command = command.split("  #")[0].strip()
                if command.startswith("python -m dllm_fast plan") and command not in commands:
                    commands.append(command)
    return commands


def readme_table() -> dict[str, tuple[list[float], list[float]]]:
    """docs/planning.md's LLaDA-8B table: setup -> (its streaming peaks in GB, its step seconds) at n_t 1 / 16 / 64 /
    256."""
    rows = {}
    for line in (ROOT / "docs" / "planning.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[1] == "1 / 16 / 64 / 256":
            rows[cells[0]] = tuple([float(v) for v in cells[i].split(" / ")] for i in (2, 4))
    return rows


@pytest.mark.slow
def test_the_readme_plan_commands_run_as_written_and_match_its_table():
    """Each plan command of the README and docs/planning.md, pasted into a shell as written (no `...`), answers; the
    headline one reproduces the planning table's row for the trainer's own setup at its n_t (peak and step time)."""
    commands = readme_plan_commands()
    assert commands and not any("..." in c for c in commands)
    table = readme_table()
    for command in commands:
        argv = shlex.split(command)
        out = subprocess.run([sys.executable, *argv[1:], "--json"], capture_output=True, text=True, timeout=900,
                             cwd=ROOT)
        assert out.returncode == 0, (command, out.stderr)
        result = json.loads(out.stdout)
        if "--weights-dtype" in argv or "--engine" in argv or "--gpus" in argv:  # not the table's setup
            continue
        column = (1, 16, 64, 256).index(result["shapes"]["n_t"])
        peaks, seconds = next(v for k, v in table.items() if k.startswith("LoRA") and "train" in k)
        assert round(result["peak_bytes"] / 1e9, 1) == peaks[column], (command, result["peak_bytes"])
        assert result["step_seconds"] == pytest.approx(seconds[column], rel=0.005), (command, result["step_seconds"])


@pytest.mark.slow
def test_the_plan_command_with_an_explicit_n_t_runs_in_a_fresh_process():
    """The regression of issue 28 item 5 as a user typed it."""
    out = subprocess.run([sys.executable, "-m", "dllm_fast", "plan", *TINY, "--objective-options", '{"n_t": 16}',
                          "--search", "false"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["shapes"]["n_t"] == 16


def test_lora_without_peft_is_one_line_naming_the_package(capsys, monkeypatch):
    """On a Quickstart install without PEFT, --lora true is a one-line error that names the package to install
    (it was a ModuleNotFoundError traceback)."""
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ModuleNotFoundError
    line = refusal(capsys, *TINY, "--lora", "true", "--search", "false")
    assert "peft" in line and "pip install peft" in line
