"""The commands and code of README.md and docs/*.md are pasteable as written (issue 32 item 12, issue 41 item 1).

Shell commands (```bash blocks): run here in full, `python -m dllm_fast train --help` (it must print every
option). Checked without running (too slow for the suite, or needing what CI or a GPU has): every `train` and
`plan` command, whose flags must parse and whose configuration must validate as `train` would check it before
loading anything (a `path/to/...` checkpoint, the user's own, stands in as the `llada-8b` preset of the same shapes;
a tokenizer directory that a `char_tokenizer` command of the docs writes stands in as the embedded one, also a
character tokenizer); the pip commands, whose extras must exist; benchmark scripts, which must exist and whose
flags must parse (argparse stops the script right after parsing); and the build, CI and emulator commands, whose
scripts and modules must exist. The planner's own tests run the plan commands of README and docs/planning.md.
verl is not installed here, so its command is checked for the plugin module and the loss name it registers.

Python (```python blocks): each must compile, its imports must resolve (packages not installed here aside), every
attribute it reads off an imported name must exist, and every keyword it passes to a function it names so must be
one that function takes. A block whose first line is `# Runs as written` is executed (tiny presets, seconds).

Links: every relative link of README, docs/ and benchmarks/RESULTS.md names a file that exists, and a heading of it
where the link has an anchor.
"""

import argparse
import ast
import builtins
import importlib
import importlib.util
import inspect
import os
import re
import runpy
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CHECKPOINT_PLACEHOLDER = "path/to/LLaDA-8B-Instruct"
EMBEDDED_TOKENIZER = ROOT / "dllm_fast" / "assets" / "sudoku4"
RUNS_MARK = "# Runs as written"


def blocks(language: str, documents=DOCUMENTS) -> list[tuple[str, str]]:
    """(document, block) for every ```language block of the documents, in order."""
    return [(path.relative_to(ROOT).as_posix(), block) for path in documents
            for block in re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.S)]


def shell_commands() -> dict[str, str]:
    """Every command of the bash blocks (continuation lines joined, comments dropped) -> the first document that
    has it; a command two documents share is checked once."""
    commands = {}
    for document, block in blocks("bash"):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line:
                commands.setdefault(line, document)
    return commands


COMMANDS = shell_commands()
README_COMMANDS = [c for c, document in shell_commands().items() if document == "README.md"]


def parts(command: str) -> list[list[str]]:
    """The simple commands of a `&&` chain, each as its words."""
    return [shlex.split(part) for part in command.split(" && ")]


def dllm_fast_arguments(words: list[str], program: str) -> list[str] | None:
    """The arguments after `dllm_fast PROGRAM` (train or plan) when `words` runs it (python -m or torchrun -m)."""
    for i in range(len(words) - 2):
        if words[i:i + 3] == ["-m", "dllm_fast", program]:
            return words[i + 3:]
    return None


def written_tokenizers() -> set[str]:
    """The directories the docs' `char_tokenizer` commands write."""
    return {words[words.index("--out") + 1] for command in COMMANDS for words in parts(command)
            if "dllm_fast.assets.char_tokenizer" in words and "--out" in words}


def ids(commands) -> list[str]:
    return [f"{COMMANDS[c]}:{c[:70]}" for c in commands]


def test_the_documents_have_the_commands_this_test_knows():
    readme_trains = [c for c in README_COMMANDS for w in parts(c) if dllm_fast_arguments(w, "train") is not None]
    assert len(readme_trains) >= 5 and any("dllm_fast plan" in c for c in README_COMMANDS)
    assert any(c.endswith("python -m dllm_fast train") for c in README_COMMANDS)  # the Quickstart
    assert any("-m pytest python_tests" in c for c in README_COMMANDS)
    assert len(COMMANDS) >= 30 and {"docs/gpu-runs.md", "docs/design.md", "docs/integrations.md"} <= set(
        COMMANDS.values())
    assert not any(" ... " in f" {c} " for c in COMMANDS if "dllm_fast train" in c or "dllm_fast plan" in c), \
        "a train or plan command is elided"


def validate(program: str, arguments: list[str]):
    """What `train` or `plan` checks before loading anything: the flags parse, the configuration validates."""
    from dllm_fast.planning.cli import plan_parser
    from dllm_fast.train.cli import add_config_arguments, config_from_arguments, new_parser, parse

    if program == "plan":
        parser = plan_parser(arguments)
    else:
        parser = new_parser()
        add_config_arguments(parser, arguments)
    return config_from_arguments(parse(parser, arguments))


RUN_COMMANDS = [c for c in COMMANDS if "dllm_fast train" in c or "dllm_fast plan" in c]


@pytest.mark.parametrize("command", RUN_COMMANDS, ids=ids(RUN_COMMANDS))
def test_every_train_and_plan_command_parses_and_validates(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a config file the command writes goes here
    tokenizers = written_tokenizers()
    for words in parts(command):
        program = next((p for p in ("train", "plan") if dllm_fast_arguments(words, p) is not None), None)
        if program is None:  # a step before the run: writing its config file is the one the test runs
            if words[0] == "printf":
                subprocess.run(command.split(" && ")[0], shell=True, check=True)
            continue
        arguments = dllm_fast_arguments(words, program)
        if arguments == ["--help"]:
            done = subprocess.run([sys.executable, "-m", "dllm_fast", program, "--help"], capture_output=True,
                                  text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            assert done.stdout.startswith(f"usage: python -m dllm_fast {program}")
            assert "--objective-options" in done.stdout
            continue
        arguments = [a.replace(CHECKPOINT_PLACEHOLDER, "llada-8b") for a in arguments]
        arguments = [str(EMBEDDED_TOKENIZER) if a in tokenizers else a for a in arguments]
        config = validate(program, arguments)
        # after the Quickstart, runs/default holds a run a new one may not replace
        if program == "train" and arguments and not config.run.resume:
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


class _Parsed(Exception):
    """Raised in place of running a benchmark once its flags have parsed."""


def check_benchmark_flags(script: Path, arguments: list[str], monkeypatch) -> None:
    """The script's argparse accepts `arguments`; the script stops right after parsing them."""
    if "argparse" not in script.read_text():
        return  # a script that reads sys.argv by hand (gpu_smoke.py, peers_logprob.py): that it exists is the check
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse_args(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [str(script), *arguments])
    monkeypatch.syspath_prepend(str(script.parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except _Parsed:
        return
    except SystemExit as exit:
        pytest.fail(f"{script.name} {' '.join(arguments)}: its flags do not parse (exit status {exit.code})")
    pytest.fail(f"{script.name} ran without parsing its arguments with argparse")


OTHER_COMMANDS = [c for c in COMMANDS if c not in RUN_COMMANDS]


@pytest.mark.parametrize("command", OTHER_COMMANDS, ids=ids(OTHER_COMMANDS))
def test_the_other_commands_name_scripts_modules_and_flags_that_exist(command, monkeypatch):
    from dllm_fast import objectives

    for words in parts(command):
        words = [w for w in words if not re.fullmatch(r"[A-Z_]+=.*", w)]  # environment assignments
        if "pip" in words[:3]:
            continue  # test_the_pip_commands_name_extras_that_exist
        if words[0] in ("source", "bash") or words[0].startswith(".ci/"):
            script = words[1] if words[0] in ("source", "bash") else words[0]
            assert (ROOT / script).is_file(), command
        elif words[0] in ("cmake", "ctest"):
            assert (ROOT / "CMakeLists.txt").is_file(), command
        elif words[0] == "python" and words[1].startswith("benchmarks/"):
            assert (ROOT / words[1]).is_file(), command
            check_benchmark_flags(ROOT / words[1], words[2:], monkeypatch)
        elif words[:2] == ["python", "-m"] and words[2].startswith("dllm_fast"):
            assert importlib.util.find_spec(words[2]) is not None, command
        elif words[:2] == ["python", "-m"] and words[2] == "pytest":
            assert (ROOT / words[3]).is_dir(), command
        elif words[:2] == ["python", "-m"] and words[2].startswith("verl"):  # verl's entry point, our plugin
            from dllm_fast.integrations.verl import PREFIX

            # The plugin loads through verl's entry point; an explicit VERL_USE_EXTERNAL_MODULES must name a module.
            plugin = re.search(r"VERL_USE_EXTERNAL_MODULES=(\S+)", command)
            assert plugin is None or importlib.util.find_spec(plugin.group(1)) is not None, command
            loss = re.search(r"loss_mode=(\S+)", command)
            assert loss is None or (loss.group(1).startswith(PREFIX)
                                    and loss.group(1)[len(PREFIX):] in objectives.available()), command
            objective = re.search(r"dllm_fast\.objective=(\S+)", command)
            assert objective is None or objective.group(1) in objectives.available(), command
            assert loss or "model_type=dllm_fast" in command, f"neither dllm_fast's engine nor its loss: {command}"
        else:
            pytest.fail(f"a documented command this test does not know how to check: {command}")


# -- Python blocks --------------------------------------------------------------------------------------------------

PYTHON_BLOCKS = blocks("python")


# Modules whose import takes seconds (TRL's): their names are checked in the source, not imported; the packages
# themselves (trl) are not ours to check.
SOURCE_CHECKED = {"dllm_fast.integrations.trl": ROOT / "dllm_fast" / "integrations" / "trl.py"}
NOT_OURS = {"trl", "verl"}


def defined_at_top(path: Path) -> set[str]:
    """The names a module's source defines at its top level."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(alias.asname or alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def imported_names(tree: ast.Module) -> dict[str, object]:
    """The names the block's imports bind -> the objects they bind here. A package not installed here, or not
    ours, is left out (the verl and TRL examples need theirs); a slow module's names are checked in its source."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in NOT_OURS or importlib.util.find_spec(alias.name.split(".")[0]) is None:
                    continue
                importlib.import_module(alias.name)
                top = alias.asname or alias.name.split(".")[0]
                names[top] = importlib.import_module(alias.name if alias.asname else top)
        elif isinstance(node, ast.ImportFrom):
            top = node.module.split(".")[0]
            if top in NOT_OURS or importlib.util.find_spec(top) is None:
                continue
            if node.module in SOURCE_CHECKED:
                defined = defined_at_top(SOURCE_CHECKED[node.module])
                assert all(a.name in defined for a in node.names), f"{node.module} lacks one of {ast.unparse(node)}"
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
                names[alias.asname or alias.name] = getattr(module, alias.name)
    return names


def rebound_names(tree: ast.Module) -> set[str]:
    """Names the block assigns (so they may not be what its imports bound)."""
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}


def resolve(node: ast.expr, names: dict[str, object]):
    """The object an expression `name.attr.attr` names, with every attribute checked; None for anything else."""
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = resolve(node.value, names)
        if owner is None:
            return None
        assert hasattr(owner, node.attr), f"{ast.unparse(node.value)} has no attribute {node.attr!r}"
        return getattr(owner, node.attr)
    return None


def settings_of(function) -> set[str] | None:
    """The names a function's **settings take, where they are a settings class's fields (generate: GenerateConfig's;
    sample_masks: MaskSpec's); None for other functions."""
    import dataclasses

    import dllm_fast
    from dllm_fast.likelihood import MaskSpec, sample_masks

    settings = {dllm_fast.generate: dllm_fast.GenerateConfig, sample_masks: MaskSpec}
    try:
        return {f.name for f in dataclasses.fields(settings[function])}
    except (KeyError, TypeError):  # not one of them, or unhashable
        return None


def accepted_keywords(function) -> set[str] | None:
    """The keyword names `function` takes; None when it takes any (**kwargs) or says nothing."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    named = {p.name for p in parameters if p.kind not in (p.POSITIONAL_ONLY, p.VAR_KEYWORD)}
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        settings = settings_of(function)
        return None if settings is None else named | settings
    return named


@pytest.mark.parametrize("document, block", PYTHON_BLOCKS, ids=[f"{d}:{i}" for i, (d, _) in enumerate(PYTHON_BLOCKS)])
def test_every_python_block_names_what_exists(document, block):
    tree = ast.parse(block, filename=document)  # a syntax error fails here
    names = imported_names(tree)
    for name in rebound_names(tree):
        names.pop(name, None)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            resolve(node, names)
        elif isinstance(node, ast.Call):
            function = resolve(node.func, names)
            keywords = accepted_keywords(function) if function is not None else None
            for keyword in node.keywords:
                if keywords is not None and keyword.arg is not None:
                    assert keyword.arg in keywords, f"{ast.unparse(node.func)} takes no keyword {keyword.arg!r}"


def test_the_python_checker_fails_on_a_wrong_name_or_keyword():
    """The checks above can fail: a renamed function, a module that lost a name, a keyword that does not exist."""
    for bad in ("import dllm_fast\ndllm_fast.generat(model)",
                "from dllm_fast.likelihood import score_all",
                "import dllm_fast\ndllm_fast.generate(model, ids, gen_lenght=8)"):
        with pytest.raises(AssertionError):
            test_every_python_block_names_what_exists("bad.md", bad)


RUNNABLE = [(d, b) for d, b in PYTHON_BLOCKS if b.startswith(RUNS_MARK)]


@pytest.mark.parametrize("document, block", RUNNABLE, ids=[f"{d}:{i}" for i, (d, _) in enumerate(RUNNABLE)])
def test_the_blocks_that_say_they_run_do(document, block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes: more threads only contend with the machine's other work
    try:
        exec(compile(block, document, "exec"), {"__name__": "__doc_block__", "__builtins__": builtins})
    finally:
        torch.set_num_threads(threads)


def test_the_readme_python_runs_as_written():
    assert [d for d, _ in RUNNABLE].count("README.md") == 1


# -- links ----------------------------------------------------------------------------------------------------------

def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens and underscores dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


LINKED = [*DOCUMENTS, ROOT / "benchmarks" / "RESULTS.md"]


@pytest.mark.parametrize("path", LINKED, ids=[p.relative_to(ROOT).as_posix() for p in LINKED])
def test_every_relative_link_names_a_file_and_heading_that_exist(path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{path.name}: {target} names no file"
        if anchor:
            headings = re.findall(r"^#+ (.*)$", linked.read_text(), flags=re.M)
            assert anchor in {slug(h) for h in headings}, f"{path.name}: {target} names no heading of {linked.name}"


def test_lora_without_peft_is_one_line_naming_the_package(monkeypatch):
    """Issue 32 item 12: a Quickstart install without peft gave a raw ModuleNotFoundError traceback for --lora true.
    peft is now a dependency; should it be missing anyway, the configuration says so before anything loads."""
    from dllm_fast.train import TrainConfig

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(ValueError, match=r"--lora true needs the peft package, which is missing here; install it "
                                         r"with `pip install peft`"):
        TrainConfig(lora=True)
    TrainConfig(lora=False)  # nothing else needs it
