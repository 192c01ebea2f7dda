"""setup.py's reuse of the last build (what lets CI's verl venv install the project without recompiling the main
environment's extension): the build's inputs digest (every csrc/ file, setup.py, the extension's settings, the
exact torch build, with this environment's torch path left out) and the recorded library, reused only while it
is unchanged. No compiler runs here."""

import importlib.util
import json
import shutil
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def copy(tmp_path):
    """setup.py loaded from a copy of the tree's build files (csrc/ and setup.py) under tmp_path."""
    shutil.copytree(ROOT / "csrc", tmp_path / "csrc")
    shutil.copy(ROOT / "setup.py", tmp_path / "setup.py")
    spec = importlib.util.spec_from_file_location("dllm_fast_setup_copy", tmp_path / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # setup() itself runs only as __main__
    return module, tmp_path


def digest(setup):
    return setup.build_inputs(setup.extension(), sysconfig.get_config_var("CXX").split())


def test_the_inputs_change_with_any_build_file_and_not_with_where_torch_lies(copy, monkeypatch):
    setup, root = copy
    first = digest(setup)
    assert digest(setup) == first
    import torch

    here = setup.build_inputs(setup.extension(), ["c++"])
    moved = setup.extension()
    torch_dir, elsewhere = str(Path(torch.__file__).parent), "/elsewhere/site-packages/torch"
    for name in ("include_dirs", "library_dirs", "runtime_library_dirs"):
        setattr(moved, name, [p.replace(torch_dir, elsewhere) for p in getattr(moved, name) or []])
    # the same torch build installed elsewhere (another venv): its paths differ, the inputs do not
    with monkeypatch.context() as patch:
        patch.setattr(torch, "__file__", elsewhere + "/__init__.py")
        there = setup.build_inputs(moved, ["c++"])
    assert there == here
    header = next((root / "csrc" / "include").rglob("*.h"))
    header.write_text(header.read_text() + "\n// changed\n")
    assert digest(setup) != first
    monkeypatch.setenv("CXXFLAGS", "-O0")
    assert digest(setup) != first


def test_a_recorded_library_is_reused_only_while_unchanged_and_for_the_same_inputs(copy, monkeypatch):
    setup, root = copy
    record = root / "build" / "_C.build.json"
    monkeypatch.setattr(setup, "BUILD_RECORD", str(record))
    library = root / "dllm_fast" / "_C.so"
    library.parent.mkdir()
    library.write_bytes(b"a library")
    assert setup.reusable_library("inputs", [str(library)]) is None  # nothing recorded yet
    record.parent.mkdir()
    record.write_text(json.dumps({"inputs": "inputs", "sha256": setup._sha256(str(library)), "library": "x"}))
    assert setup.reusable_library("inputs", [str(root / "missing.so"), str(library)]) == str(library)
    assert setup.reusable_library("other inputs", [str(library)]) is None
    library.write_bytes(b"another library")  # replaced since (e.g. copied in from another tree)
    assert setup.reusable_library("inputs", [str(library)]) is None
