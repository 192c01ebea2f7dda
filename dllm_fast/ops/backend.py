"""Backend choice and the settings every op shares (dtypes, vocabulary chunking).

Every op runs on one of these backends:

- ``"compiled"``: the C++/CUDA kernel in dllm_fast._C for the tensors' device;
- ``"reference"``: the plain-PyTorch twin in dllm_fast/ops/twins.py (also named by dllm_fast.reference);
- ``"triton"`` (the LM head's log-prob ops only, TRITON_OPS): the Triton kernels of ops/triton_head.py, whose GEMM
  epilogue holds the softmax, beside cuBLAS for the gradient GEMMs (ops/logprobs_triton.py). CUDA tensors; CPU
  tensors in triton's interpreter (TRITON_INTERPRET=1 before triton is imported: the tests).

``backend=None`` (or ``"auto"``) takes the Triton kernels for a call they serve best (CUDA tensors, bf16, the
triton package importable: it ships with torch's CUDA wheels), else the compiled kernel when one is registered
for the device, and otherwise falls back to the reference with a one-time warning. Asking for ``"compiled"`` or
``"triton"`` explicitly raises instead of falling back. The environment variable ``DLLM_FAST_BACKEND`` sets the
default; ``DLLM_FAST_BACKEND=triton`` takes the Triton kernels wherever an op has them and can run the call (on
fake tensors too: the planner prices them so), and chooses as "auto" elsewhere. (The tests run the CUDA kernels on
CPU tensors in a host emulator by swapping the ops' CPU kernels: dllm_fast.testing.emulation, unknown here.)
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import warnings

import torch

from dllm_fast._extension import HAS_EXTENSION, has_kernel, missing_extension_message
from dllm_fast.ops.triton_head import compiles_for
from dllm_fast.validation import check_int

BACKENDS = ("auto", "compiled", "reference", "triton")
FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# The ops with a Triton path: the face of masked_logprobs and masked_logprobs_grad asks as "masked_logprobs".
TRITON_OPS = ("masked_logprobs",)
_warned_fallback: set[tuple[str, str]] = set()


# The (op, device type, requested backend, triton, from the environment) keys already resolved to "compiled" or
# "triton": the kernels
# register when dllm_fast._C loads and stay, and triton is importable or not for the process's life, so an eager
# call (a LLaDA layer's RoPE, each sampling step) looks them up once.
_FOUND: dict[tuple[str, str, str, str, bool], str] = {}


@torch.compiler.assume_constant_result  # an import and device check: torch.compile treats it as a constant
def _triton_compiles(device_type: str) -> bool:
    return compiles_for(torch.device(device_type))


def environment_backend() -> str:
    """The default backend the environment sets (DLLM_FAST_BACKEND; unset or empty: "auto"), checked: a value
    that is not a backend is refused naming the variable, where it is read (and by `train` and `plan` before
    they start, train/config.py)."""
    value = os.environ.get("DLLM_FAST_BACKEND", "") or "auto"
    if value not in BACKENDS:
        raise ValueError(f"the environment variable DLLM_FAST_BACKEND={value!r} is not one of {', '.join(BACKENDS)}: "
                         "set it to one of them, or unset it (auto).")
    return value


def choose_backend(op: str, device: torch.device, backend: str | None, *, triton: str = "no") -> str:
    """Resolve `backend` (None, "auto", "compiled", "reference" or "triton") for op `op` on `device`.

    triton: whether the call may take the Triton kernels, as the op's face judges it: "best" (auto takes them on
    CUDA, where they are faster), "able" (they can run the call; only an explicit request or the environment's
    default takes them), "no" (they cannot: the environment's "triton" chooses as auto)."""
    requested = backend or os.environ.get("DLLM_FAST_BACKEND", "") or "auto"
    key = (op, device.type, requested, triton, backend is None)  # the environment's "triton" is not a request
    found = _FOUND.get(key)
    if found is not None:
        return found
    if requested not in BACKENDS:
        if backend is None:
            environment_backend()  # raises, naming the variable
        raise ValueError(f"backend={requested!r} is not one of {', '.join(BACKENDS)} (or None: "
                         "DLLM_FAST_BACKEND's default, auto when unset).")
    if requested == "reference":
        return "reference"
    if requested == "triton":
        if op in TRITON_OPS and (backend == "triton" or triton != "no"):
            return "triton"  # the face names what the kernels cannot take; run time, a missing triton
        if backend == "triton":
            raise ValueError(f"backend='triton' was requested for {op}, but only {', '.join(TRITON_OPS)} has Triton "
                             "kernels; pass backend='compiled' or None.")
        requested = "auto"  # the environment's default: ops without a Triton path choose as auto
    if requested == "auto" and op in TRITON_OPS and triton == "best" and _triton_compiles(device.type):
        return _remember(key, "triton")
    if has_kernel(op, device.type):
        return _remember(key, "compiled")
    reason = (
        missing_extension_message()
        if not HAS_EXTENSION
        else f"dllm_fast._C has no {device.type} kernel for {op} (built without CUDA? set DLLM_FAST_CUDA=1 to require it)"
    )
    if requested == "compiled":
        raise RuntimeError(f"backend='compiled' was requested for {op} on {device}, but {reason}.")
    if (op, device.type) not in _warned_fallback:
        _warned_fallback.add((op, device.type))
        warnings.warn(f"{op} falls back to the plain-PyTorch reference on {device.type}: {reason}.", stacklevel=3)
    return "reference"


def _remember(key, choice: str) -> str:
    if not torch.compiler.is_compiling():  # no side effect inside a traced function
        _FOUND[key] = choice
    return choice


# The device type default chunks are sized for, when it is not the tensors' own (see chunks_sized_for).
_CHUNK_DEVICE: contextvars.ContextVar[str | None] = contextvars.ContextVar("dllm_fast_chunk_device", default=None)


@contextlib.contextmanager
def chunks_sized_for(device_type: str):
    """Size default vocabulary chunks as on `device_type` ("cpu" or "cuda") whatever device the tensors are on:
    the planner runs fake CPU tensors for a GPU and must see the GPU's chunks (and their buffers)."""
    previous = _CHUNK_DEVICE.get()
    try:  # set inside: an interrupt right after set() (where a Ctrl-C lands) must not leave it set
        _CHUNK_DEVICE.set(device_type)
        yield
    finally:
        _CHUNK_DEVICE.set(previous)


def default_chunk_size(rows: int, vocab: int, device: torch.device, entry_bytes: int = 4) -> int:
    """Vocabulary columns per chunk: about 8 MB of the chunk's per-entry buffers (fp32 logits: 4 bytes an entry;
    the Triton path's bf16 d(logits): 2) on CPU (cache-friendly), 256 MB on GPU."""
    device_type = _CHUNK_DEVICE.get() or device.type
    budget = (256 << 20) if device_type == "cuda" else (8 << 20)
    columns = budget // (entry_bytes * max(rows, 1))
    columns = max(1024 if device_type == "cuda" else 256, min(columns, 32768))
    return int(min(vocab, columns - columns % 128))


def resolve_chunk_size(op: str, chunk_size, rows: int, vocab: int, device: torch.device,
                       entry_bytes: int = 4) -> int:
    """The chunk size to run with: the default for None, and at most the vocabulary (the kernels' int64)."""
    if chunk_size is None:
        return default_chunk_size(rows, vocab, device, entry_bytes)
    check_int(f"{op}: chunk_size", chunk_size, minimum=1, hint="vocabulary columns per chunk, or None")
    return max(1, min(chunk_size, vocab))
