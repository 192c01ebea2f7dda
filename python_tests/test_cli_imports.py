"""`train --help` prints from the configuration alone (issue 32 item 16): it took 22-32 s on a loaded machine
because it imported torch.compile's machinery, the compiled ops, the sampler and the likelihood engine. Checked by
what a fresh interpreter has imported after printing it (robust, unlike a timing)."""

import json
import subprocess
import sys

# Modules `train --help` must not import: torch's compiler stack and every layer that computes.
HEAVY = ("torch._dynamo", "torch._inductor", "dllm_fast._extension", "dllm_fast.ops", "dllm_fast.likelihood",
         "dllm_fast.rollout.sampler", "dllm_fast.objectives.base", "dllm_fast.train.loop", "dllm_fast.train.run")

PROBE = """
import contextlib, io, json, sys
from dllm_fast.__main__ import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        main(sys.argv[1:])
    except SystemExit:
        pass
print(json.dumps({"help": out.getvalue(), "modules": sorted(sys.modules)}))
"""


def imported_by(*argv):
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_train_help_imports_no_compiler_op_sampler_or_engine():
    seen = imported_by("train", "--help")
    heavy = [name for name in seen["modules"] if name.startswith(HEAVY)]
    assert heavy == [], heavy
    from dllm_fast import objectives
    from dllm_fast.rollout import CACHE_POLICIES, REMASKING
    from dllm_fast.tasks import available_tasks

    for names in (objectives.available(), available_tasks(), CACHE_POLICIES, REMASKING):  # still every choice
        assert all(name in seen["help"] for name in names), names


@pytest.mark.slow  # fresh interpreters, about 10 s on 2 cores
def test_an_objectives_own_help_still_lists_its_options():
    seen = imported_by("train", "--objective", "spg", "--help")
    assert "omega" in seen["help"] and "sudoku" in seen["help"]


@pytest.mark.slow  # a fresh interpreter importing torch
def test_importing_the_sampler_module_first_leaves_generate_a_function():
    """A lazy package attribute named like one of its submodules is hidden by that submodule once it is imported
    directly: `dllm_fast.generate` was the module `dllm_fast.rollout.generate` whenever a caller (a test patching
    its compiled step) imported the module first, and the call raised "'module' object is not callable"."""
    probe = ("import importlib, dllm_fast, dllm_fast.rollout\n"
             "importlib.import_module('dllm_fast.rollout.sampler')\n"
             "from dllm_fast.rollout import generate\n"
             "print(all(callable(f) and f.__name__ == 'generate' for f in "
             "(dllm_fast.generate, dllm_fast.rollout.generate, generate)))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["True"]


def test_no_package_exports_a_non_module_under_a_submodules_name():
    """The guard for the trap above, over every package: an exported name that is also a submodule's name must be
    that submodule."""
    import importlib
    import pkgutil

    import dllm_fast

    clashes = []
    for info in pkgutil.walk_packages(dllm_fast.__path__, "dllm_fast."):
        if info.ispkg:
            package = importlib.import_module(info.name)
            exported = set(getattr(package, "__all__", ())) | set(getattr(package, "_EXPORTS", ()))
            for name in exported & {module.name for module in pkgutil.iter_modules(package.__path__)}:
                if getattr(package, name) is not importlib.import_module(f"{info.name}.{name}"):
                    clashes.append(f"{info.name}.{name}")
    assert clashes == []
