"""Builds dllm_fast._C, the compiled ops, from csrc/.

    pip install --no-build-isolation -e .

torch is deliberately not a build requirement: the extension must be compiled against the torch that is
installed, so build without isolation. Environment:

    DLLM_FAST_CUDA=auto|0|1   auto (default): CUDA kernels iff torch is a CUDA build and CUDA_HOME is found;
                              1: require them; 0: CPU kernels only.
    TORCH_CUDA_ARCH_LIST      GPU architectures (default: csrc/build.json's, the newest with PTX).
    DLLM_FAST_DEBUG=1         -O0 -g.
    MAX_JOBS=N                parallel compile jobs (ninja).

The sources, architectures, C++ standard and flags come from csrc/build.json, which CMakeLists.txt reads too.
Object files are kept in build/temp.* (not pip's fresh temporary folder), so a second install recompiles only
what changed. An install whose build inputs are those of the last build (`build_inputs`: every file under csrc/,
setup.py, the extension's sources and flags, the compiler, the Python and the exact torch build, the build's
environment variables) reuses that build's library without compiling, where it still lies unchanged (its SHA-256
is recorded with the inputs in build/_C.build.json): a second environment with the same torch, e.g. CI's verl
venv, installs in seconds. DLLM_FAST_REBUILD=1 always compiles.
"""

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig

ROOT = os.path.dirname(os.path.abspath(__file__))
CONFIG = json.load(open(os.path.join(ROOT, "csrc", "build.json")))
BUILD_RECORD = os.path.join(ROOT, "build", "_C.build.json")  # the last build's inputs and its library's SHA-256
BUILD_ENVIRONMENT = ("CC", "CXX", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "CUDA_HOME", "NVCC_FLAGS",
                     "TORCH_CUDA_ARCH_LIST", "DLLM_FAST_CUDA", "DLLM_FAST_DEBUG")


def sources(kind: str) -> list[str]:
    """The files of one source list of csrc/build.json ("cpu" or "cuda"), relative to the repository root."""
    return [os.path.relpath(path, ROOT) for pattern in CONFIG["sources"][kind]
            for path in sorted(glob.glob(os.path.join(ROOT, pattern)))]


def cuda_arch_list() -> str:
    """TORCH_CUDA_ARCH_LIST of csrc/build.json's architectures: SASS for each, PTX for the newest too."""
    *older, newest = CONFIG["cuda_architectures"]
    return ";".join(older + [newest + "+PTX"])


def cxx_standard_flag() -> str:
    return f"-std=c++{CONFIG['cxx_standard']}"


def build_with_cuda(torch, cuda_home) -> bool:
    mode = os.environ.get("DLLM_FAST_CUDA", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"DLLM_FAST_CUDA={mode!r} is not one of auto, 0, 1.")
    # torch sets CUDA_HOME only for CUDA builds, so a CPU wheel next to an installed nvcc stays CPU-only.
    possible = torch.version.cuda is not None and cuda_home is not None
    if mode == "1" and not possible:
        raise SystemExit(
            "DLLM_FAST_CUDA=1 but CUDA kernels cannot be built: "
            f"torch {torch.__version__} is {'a CPU build' if torch.version.cuda is None else 'a CUDA build'} "
            f"and CUDA_HOME is {cuda_home!r}. Install a CUDA build of torch or set DLLM_FAST_CUDA=0."
        )
    return possible if mode == "auto" else mode == "1"


def extension():
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, CppExtension, CUDAExtension

    with_cuda = build_with_cuda(torch, CUDA_HOME)
    debug = os.environ.get("DLLM_FAST_DEBUG", "0") == "1"

    def flags(configured: list[str]) -> list[str]:
        return [f for f in configured if not f.startswith("-O")] + ["-O0", "-g"] if debug else configured

    kwargs = dict(
        name="dllm_fast._C",
        sources=sources("cpu") + (sources("cuda") if with_cuda else []),
        include_dirs=[os.path.join(ROOT, d) for d in CONFIG["include_dirs"]],
        extra_link_args=CONFIG["link_flags"],
    )
    cxx = [cxx_standard_flag(), *flags(CONFIG["cxx_flags"])]
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", cuda_arch_list())
        nvcc = [cxx_standard_flag(), *flags(CONFIG["nvcc_flags"])]
        return CUDAExtension(define_macros=[("DLLM_FAST_WITH_CUDA", None)],
                             extra_compile_args={"cxx": cxx, "nvcc": nvcc}, libraries=["cublas"], **kwargs)
    return CppExtension(extra_compile_args={"cxx": cxx}, **kwargs)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _tool_version(command: list[str]) -> str:
    try:
        return subprocess.run(command + ["--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def build_inputs(ext, compiler_command: list[str]) -> str:
    """A digest of everything the compiled library depends on: the contents of every file under csrc/ and of
    setup.py, the extension's sources, flags, macros and libraries, the compiler's (and nvcc's) version, the
    Python, the exact torch build (version, git revision, CUDA version, C++ ABI) and BUILD_ENVIRONMENT."""
    import torch

    digest = hashlib.sha256()
    files = sorted(glob.glob(os.path.join(ROOT, "csrc", "**", "*"), recursive=True)) + [os.path.abspath(__file__)]
    for path in files:
        if os.path.isfile(path):
            digest.update(os.path.relpath(path, ROOT).encode() + b"\0")
            with open(path, "rb") as stream:
                digest.update(stream.read())
    installed = os.path.dirname(torch.__file__)  # where this environment's torch lies: its build is named below

    def located(paths):
        return [str(path).replace(installed, "<torch>") for path in paths or []]

    described = {
        "extension": [ext.name, ext.sources, located(ext.include_dirs), located(ext.library_dirs),
                      located(ext.runtime_library_dirs), ext.define_macros, ext.libraries, ext.extra_compile_args,
                      ext.extra_link_args],
        "python": [sys.version, sysconfig.get_config_var("EXT_SUFFIX"), sysconfig.get_platform()],
        "torch": [torch.__version__, torch.version.git_version, torch.version.cuda,
                  bool(torch._C._GLIBCXX_USE_CXX11_ABI)],
        "compiler": [compiler_command, _tool_version(compiler_command[:1])],
        "nvcc": _tool_version(["nvcc"]) if any(source.endswith(".cu") for source in ext.sources) else None,
        "environment": {name: os.environ.get(name) for name in BUILD_ENVIRONMENT},
    }
    digest.update(json.dumps(described, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def reusable_library(inputs: str, candidates: list[str]) -> str | None:
    """The last build's library, where its inputs were `inputs` and one of `candidates` still holds it unchanged."""
    try:
        with open(BUILD_RECORD) as stream:
            record = json.load(stream)
    except (OSError, ValueError):
        return None
    if record.get("inputs") != inputs:
        return None
    for path in candidates:
        if os.path.isfile(path) and _sha256(path) == record.get("sha256"):
            return path
    return None


def build_ext_class():
    from torch.utils.cpp_extension import BuildExtension

    class PersistentBuildExtension(BuildExtension):
        """pip's editable install compiles in a fresh temporary folder each time; a fixed one under build/ lets
        ninja reuse every object file whose sources, headers and flags did not change."""

        def finalize_options(self):
            super().finalize_options()
            self.build_temp = os.path.join(ROOT, "build", f"temp.{sysconfig.get_platform()}-"
                                                          f"{sysconfig.get_python_version()}")

        def build_extension(self, ext):
            """Compile, unless the last build had the same inputs and its library is still there (module
            docstring): then that library is the build's output."""
            target = self.get_ext_fullpath(ext.name)
            in_tree = os.path.join(ROOT, *ext.name.split(".")[:-1], os.path.basename(target))
            inputs = build_inputs(ext, list(getattr(self.compiler, "compiler_cxx", None) or ["c++"]))
            if os.environ.get("DLLM_FAST_REBUILD", "0") != "1":
                found = reusable_library(inputs, [in_tree, target])
                if found is not None:
                    print(f"dllm_fast: reusing {os.path.relpath(found, ROOT)} (built from the same sources, flags, "
                          "compiler and torch build; DLLM_FAST_REBUILD=1 compiles)")
                    if os.path.abspath(found) != os.path.abspath(target):
                        os.makedirs(os.path.dirname(target), exist_ok=True)
                        shutil.copy2(found, target)
                    return
            super().build_extension(ext)
            os.makedirs(os.path.dirname(BUILD_RECORD), exist_ok=True)
            with open(BUILD_RECORD, "w") as stream:
                json.dump({"inputs": inputs, "sha256": _sha256(target), "library": target}, stream, indent=1)

    return PersistentBuildExtension


if __name__ == "__main__":
    from setuptools import setup

    setup(ext_modules=[extension()], cmdclass={"build_ext": build_ext_class()})
