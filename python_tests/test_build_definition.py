"""One build definition: setup.py and CMakeLists.txt read the sources, GPU architectures (PTX for the newest),
C++ standard and flags from csrc/build.json, so a new GPU generation is one edit and the two cannot drift."""

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_setup():
    spec = importlib.util.spec_from_file_location("dllm_fast_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # setup() itself runs only as __main__
    return module


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake (CI installs it)")
def test_setup_py_and_cmake_build_the_same_definition():
    setup = load_setup()
    printed = subprocess.run(["cmake", "-P", str(ROOT / "csrc" / "build.cmake")], capture_output=True, text=True,
                             check=True).stderr
    cmake = dict(line.split("=", 1) for line in printed.splitlines() if "=" in line)
    assert cmake["SOURCES_CPU"].split(";") == setup.sources("cpu")
    assert cmake["SOURCES_CUDA"].split(";") == setup.sources("cuda")
    assert cmake["CXX_STANDARD"] == re.fullmatch(r"-std=c\+\+(\d+)", setup.cxx_standard_flag()).group(1)
    assert cmake["CXX_FLAGS"].split(";") == setup.CONFIG["cxx_flags"]
    assert cmake["NVCC_FLAGS"].split(";") == setup.CONFIG["nvcc_flags"]
    assert cmake["LINK_FLAGS"].split(";") == setup.CONFIG["link_flags"]
    # Every architecture as SASS, the newest also as PTX: "8.0;9.0+PTX" for torch, "80-real;90" for CMake.
    torch_archs = setup.cuda_arch_list().split(";")
    cmake_archs = cmake["CUDA_ARCHITECTURES"].split(";")
    assert torch_archs[-1].endswith("+PTX") and not cmake_archs[-1].endswith("-real")
    assert ([a.removesuffix("+PTX").replace(".", "") for a in torch_archs]
            == [a.removesuffix("-real") for a in cmake_archs])
    assert all(a.endswith("-real") for a in cmake_archs[:-1]) and not any("+PTX" in a for a in torch_archs[:-1])


def test_every_source_is_built_and_no_build_file_spells_its_own_settings():
    config = json.loads((ROOT / "csrc" / "build.json").read_text())
    setup = load_setup()
    built = set(setup.sources("cpu") + setup.sources("cuda"))
    on_disk = {str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cpp")} | {
        str(p.relative_to(ROOT)) for folder in ("cpu", "cuda") for p in (ROOT / "csrc" / folder).glob("*.c*")
        if p.suffix in (".cpp", ".cu")}
    assert built == on_disk
    assert config["cuda_architectures"] == sorted(config["cuda_architectures"], key=float)  # the newest last
    cmake_lists = (ROOT / "CMakeLists.txt").read_text()
    setup_py = (ROOT / "setup.py").read_text()
    assert "include(csrc/build.cmake)" in cmake_lists
    assert not re.search(r"CMAKE_CUDA_ARCHITECTURES\s+\d|CXX_STANDARD\s+\d|GLOB", cmake_lists)
    assert not re.search(r"\d\.\d[;+]|c\+\+\d\d|\"-O3|csrc/\w+/\*", setup_py)  # -O0 -g: DLLM_FAST_DEBUG
