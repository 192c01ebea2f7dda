"""The CUDA kernels and glue of csrc/cuda, run on the CPU by a host emulator: test infrastructure, so that the CUDA
code executes in CI without a GPU (python_tests/emulation/README.md describes the emulator).

    python -m dllm_fast.testing.emulation [--sanitize]  # builds build/dllm_fast_emulated_cuda[_asan], incrementally
    python -m dllm_fast.testing.emulation --run (-c CODE | -m MODULE | SCRIPT) [ARGS]  # a whole process on them

The emulated build is a separate extension module compiled from a source checkout (never by pip) that registers
the CUDA implementations for CPU tensors as ``torch.ops.dllm_fast_emulated.*``. Inside ``emulated_cuda()`` (or
for a whole process started with ``--run``) the CPU kernels of ``torch.ops.dllm_fast.*`` are
replaced by them, so whole ``generate`` and ``score`` calls, autograd and torch.compile included, run the CUDA
sources. ``gemm_log()`` records the GEMMs the emulated cuBLAS runs meanwhile (types, compute type, sizes), so a
test can check which GEMMs an op makes without a GPU. ``DLLM_FAST_EMULATED_CUDA=1`` enables the emulated tests
(``pytest -m emulated_cuda``); ``=asan`` runs them against the AddressSanitizer build, in a process started with
libasan preloaded (.ci/emulated_cuda does that).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import json
import os
import runpy
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
BUILD_CONFIG = ROOT / "csrc" / "build.json"
ENABLE_VARIABLE = "DLLM_FAST_EMULATED_CUDA"


def enabled() -> str | None:
    """The emulated build the tests should use: "plain", "asan", or None when the emulated tests are off."""
    value = os.environ.get(ENABLE_VARIABLE, "").strip().lower()
    if value in ("", "0"):
        return None
    if value not in ("1", "asan"):
        raise ValueError(f"{ENABLE_VARIABLE}={value!r} is not one of 0, 1, asan.")
    return "asan" if value == "asan" else "plain"


def build(sanitize: bool = False, verbose: bool = False):
    """Compile (incrementally, with ninja) and import the emulated module; returns it."""
    from torch.utils import cpp_extension

    if not BUILD_CONFIG.exists():
        raise RuntimeError(f"the emulated CUDA build needs a source checkout with {BUILD_CONFIG}; it is not part of "
                           "an installed package.")
    config = json.loads(BUILD_CONFIG.read_text())
    emulated = config["emulated_cuda"]
    name = "dllm_fast_emulated_cuda" + ("_asan" if sanitize else "")
    directory = ROOT / "build" / name
    directory.mkdir(parents=True, exist_ok=True)
    sources = [_host_source(Path(path), directory) for pattern in emulated["sources"]
               for path in sorted(glob.glob(str(ROOT / pattern)))]
    flags = [f"-std=c++{config['cxx_standard']}", *emulated["cxx_flags"]]
    link = []
    if sanitize:
        flags += emulated["sanitize_flags"]
        link += emulated["sanitize_flags"]
    return cpp_extension.load(
        name=name, sources=[str(s) for s in sources], extra_cflags=flags, extra_ldflags=link,
        extra_include_paths=[str(ROOT / d) for d in emulated["include_dirs"]], build_directory=str(directory),
        verbose=verbose)


def _host_source(path: Path, directory: Path) -> Path:
    """A .cu file is compiled as C++ through a one-line wrapper (the compiler picks the language by suffix)."""
    if path.suffix != ".cu":
        return path
    wrapper = directory / "host_sources" / f"{path.parent.name}_{path.stem}.cpp"
    text = f'#include "{path}"\n'
    if not wrapper.exists() or wrapper.read_text() != text:  # rewriting it would make ninja rebuild it
        wrapper.parent.mkdir(exist_ok=True)
        wrapper.write_text(text)
    return wrapper


@functools.cache
def load():
    """The emulated module of this process (the AddressSanitizer build when DLLM_FAST_EMULATED_CUDA=asan)."""
    return build(sanitize=enabled() == "asan")


@contextlib.contextmanager
def emulated_cuda():
    """Within this block, the CPU kernels of every dllm_fast op that has a CUDA implementation are that CUDA
    implementation, run by the emulator; on exit the CPU kernels are back."""
    from dllm_fast._extension import HAS_EXTENSION, missing_extension_message

    if not HAS_EXTENSION:  # the ops to reroute are registered by dllm_fast._C
        raise RuntimeError(missing_extension_message())
    module = load()
    library = torch.library.Library("dllm_fast", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
            for op in module.ops:
                library.impl(op, getattr(torch.ops.dllm_fast_emulated, op).default, "CPU")
        yield module
    finally:
        library._destroy()


@dataclass(frozen=True)
class GemmRecord:
    """One GEMM the emulated cuBLAS ran: the cublasGemmEx call as given (column-major m, n, k; C[m, n] =
    op(A)[m, k] @ op(B)[k, n]). The glue's row-major GEMMs reach cuBLAS with their operands swapped
    (csrc/cuda/blas.cpp), so a row-major [M, c] = [M, d] @ [d, c] product is recorded as m = c, n = M, k = d with
    A the weight chunk; the types, compute type and FLOPs are the same either way.

    a_dtype, b_dtype, c_dtype: the torch dtypes of A, B and C. compute: "fp32" (fp32 products and sums, whatever
    the operand type), "tf32" (fp32 operands rounded to TF32 for tensor cores) or "fp64".
    """

    a_dtype: torch.dtype
    b_dtype: torch.dtype
    c_dtype: torch.dtype
    compute: str
    m: int
    n: int
    k: int
    transa: bool
    transb: bool

    @property
    def flops(self) -> int:
        """Multiply-adds counted as two floating-point operations: 2 m n k."""
        return 2 * self.m * self.n * self.k


@contextlib.contextmanager
def gemm_log():
    """Records every GEMM that the emulated cuBLAS runs within the block, on any thread; yields a list that is
    filled with their `GemmRecord`s, in call order, when the block exits. Only emulated CUDA code reaches that
    cuBLAS: route the ops with ``emulated_cuda()`` (or ``--run``); the CPU kernels' GEMMs
    are not recorded. Blocks may nest (each gets the GEMMs run within it)."""
    module = load()
    records: list[GemmRecord] = []
    start = module.gemm_log_begin()
    try:
        yield records
    finally:
        raw = module.gemm_log_records(start)
        module.gemm_log_end()
        records.extend(GemmRecord(getattr(torch, a), getattr(torch, b), getattr(torch, c), compute, m, n, k, ta, tb)
                       for a, b, c, compute, m, n, k, ta, tb in raw)


def run_process(argv: list[str]) -> None:
    """`--run`: the emulated CUDA kernels replace the CPU ones until the process ends, then `argv` runs as
    `python ARGV` would: ["-c", CODE, ...], ["-m", MODULE, ...] or [SCRIPT, ...]. The product never asks for the
    emulator; this is how a whole program (a benchmark, a test's subprocess) runs the CUDA code without a GPU."""
    if not argv or (argv[0] in ("-c", "-m") and len(argv) < 2):
        raise SystemExit("--run needs -c CODE, -m MODULE or SCRIPT, as python takes them.")
    stack = contextlib.ExitStack()
    stack.enter_context(emulated_cuda())  # never closed: the process ends on the emulated kernels
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    elif argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dllm_fast.testing.emulation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sanitize", action="store_true", help="the AddressSanitizer build")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    parser.add_argument("--run", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="then run -c CODE, -m MODULE or SCRIPT (and its arguments) with the emulated CUDA "
                             "kernels in place of the CPU ones, for the whole process (the build of "
                             f"{ENABLE_VARIABLE}: plain, or asan)")
    args = parser.parse_args(argv)
    if args.run is not None:
        run_process(args.run)
        return
    module = build(sanitize=args.sanitize, verbose=args.verbose)
    print(f"{module.__file__}: ops {', '.join(module.ops)}")


if __name__ == "__main__":
    # Through the module as imported, so that code given to --run which imports it shares its one loaded build.
    from dllm_fast.testing.emulation import main as imported_main

    imported_main()
