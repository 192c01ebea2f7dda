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
what changed.
"""

import glob
import json
import os
import sysconfig

ROOT = os.path.dirname(os.path.abspath(__file__))
CONFIG = json.load(open(os.path.join(ROOT, "csrc", "build.json")))


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


def build_ext_class():
    from torch.utils.cpp_extension import BuildExtension

    class PersistentBuildExtension(BuildExtension):
        """pip's editable install compiles in a fresh temporary folder each time; a fixed one under build/ lets
        ninja reuse every object file whose sources, headers and flags did not change."""

        def finalize_options(self):
            super().finalize_options()
            self.build_temp = os.path.join(ROOT, "build", f"temp.{sysconfig.get_platform()}-"
                                                          f"{sysconfig.get_python_version()}")

    return PersistentBuildExtension


if __name__ == "__main__":
    from setuptools import setup

    setup(ext_modules=[extension()], cmdclass={"build_ext": build_ext_class()})
