"""Builds dllm_fast._C, the compiled ops, from csrc/.

    pip install --no-build-isolation -e .

torch is deliberately not a build requirement: the extension must be compiled against the torch that is
installed, so build without isolation. Environment:

    DLLM_FAST_CUDA=auto|0|1   auto (default): CUDA kernels iff torch is a CUDA build and CUDA_HOME is found;
                              1: require them; 0: CPU kernels only.
    DLLM_FAST_DEBUG=1         -O0 -g.
    MAX_JOBS=N                parallel compile jobs (ninja).

CMakeLists.txt builds the same sources with the same switch; CI builds through both so they cannot drift.
"""

import glob
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def build_with_cuda() -> bool:
    mode = os.environ.get("DLLM_FAST_CUDA", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"DLLM_FAST_CUDA={mode!r} is not one of auto, 0, 1.")
    # torch sets CUDA_HOME only for CUDA builds, so a CPU wheel next to an installed nvcc stays CPU-only.
    possible = torch.version.cuda is not None and CUDA_HOME is not None
    if mode == "1" and not possible:
        raise SystemExit(
            "DLLM_FAST_CUDA=1 but CUDA kernels cannot be built: "
            f"torch {torch.__version__} is {'a CPU build' if torch.version.cuda is None else 'a CUDA build'} "
            f"and CUDA_HOME is {CUDA_HOME!r}. Install a CUDA build of torch or set DLLM_FAST_CUDA=0."
        )
    return possible if mode == "auto" else mode == "1"


def sources(with_cuda: bool) -> list[str]:
    files = sorted(glob.glob("csrc/*.cpp")) + sorted(glob.glob("csrc/cpu/*.cpp"))
    if with_cuda:
        files += sorted(glob.glob("csrc/cuda/*.cu")) + sorted(glob.glob("csrc/cuda/*.cpp"))
    return files


def extension():
    with_cuda = build_with_cuda()
    debug = os.environ.get("DLLM_FAST_DEBUG", "0") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3"]
    cxx = opt + ["-fopenmp"]  # the C++ standard is left to torch (C++17 or C++20 by version)
    kwargs = dict(
        name="dllm_fast._C",
        sources=sources(with_cuda),
        include_dirs=[os.path.join(ROOT, "csrc", "include")],
        extra_link_args=["-fopenmp"],
    )
    if with_cuda:
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0+PTX"
        nvcc = opt + ["-lineinfo"]
        return CUDAExtension(
            define_macros=[("DLLM_FAST_WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            libraries=["cublas"],
            **kwargs,
        )
    return CppExtension(extra_compile_args={"cxx": cxx}, **kwargs)


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension},
)
