"""Backend choice and the settings every op shares (dtypes, vocabulary chunking).

Every op runs on one of two backends:

- ``"compiled"``: the C++/CUDA kernel in dllm_fast._C for the tensors' device;
- ``"reference"``: the plain-PyTorch twin in dllm_fast/ops/twins.py (also named by dllm_fast.reference).

``backend=None`` (or ``"auto"``) takes the compiled kernel when one is registered for the device and otherwise
falls back to the reference with a one-time warning. Asking for ``"compiled"`` explicitly raises instead of
falling back. The environment variable ``DLLM_FAST_BACKEND`` sets the default. (The tests run the CUDA kernels on
CPU tensors in a host emulator by swapping the ops' CPU kernels: dllm_fast.testing.emulation, unknown here.)
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import warnings

import torch

from dllm_fast._extension import HAS_EXTENSION, has_kernel, missing_extension_message
from dllm_fast.validation import check_int

BACKENDS = ("auto", "compiled", "reference")
FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_warned_fallback: set[tuple[str, str]] = set()


# The (op, device type, requested backend) triples already resolved to "compiled": the kernels register when
# dllm_fast._C loads and stay, so an eager call (a LLaDA layer's RoPE, each sampling step) looks them up once.
_COMPILED_FOUND: set[tuple[str, str, str]] = set()


def choose_backend(op: str, device: torch.device, backend: str | None) -> str:
    """Resolve `backend` (None, "auto", "compiled" or "reference") for op `op` on `device`."""
    requested = backend or os.environ.get("DLLM_FAST_BACKEND", "auto")
    if (op, device.type, requested) in _COMPILED_FOUND:
        return "compiled"
    if requested not in BACKENDS:
        raise ValueError(f"backend={requested!r} is not one of {BACKENDS}.")
    if requested == "reference":
        return "reference"
    if has_kernel(op, device.type):
        if not torch.compiler.is_compiling():  # no side effect inside a traced function
            _COMPILED_FOUND.add((op, device.type, requested))
        return "compiled"
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


def default_chunk_size(rows: int, vocab: int, device: torch.device) -> int:
    """Vocabulary columns per chunk: about 8 MB of fp32 logits on CPU (cache-friendly), 256 MB on GPU."""
    device_type = _CHUNK_DEVICE.get() or device.type
    budget = (256 << 20) if device_type == "cuda" else (8 << 20)
    columns = budget // (4 * max(rows, 1))
    columns = max(1024 if device_type == "cuda" else 256, min(columns, 32768))
    return int(min(vocab, columns - columns % 128))


def resolve_chunk_size(op: str, chunk_size, rows: int, vocab: int, device: torch.device) -> int:
    """The chunk size to run with: the default for None, and at most the vocabulary (the kernels' int64)."""
    if chunk_size is None:
        return default_chunk_size(rows, vocab, device)
    check_int(f"{op}: chunk_size", chunk_size, minimum=1, hint="vocabulary columns per chunk, or None")
    return max(1, min(chunk_size, vocab))
