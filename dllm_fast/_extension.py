"""Loads the compiled ops (dllm_fast._C), which registers torch.ops.dllm_fast.*, and reports what it holds."""

from __future__ import annotations

import torch

try:
    import dllm_fast._C as _C  # the compiled module itself (not the package)
except ImportError as error:  # not built, or built against another torch
    _C = None
    LOAD_ERROR: ImportError | None = error
else:
    LOAD_ERROR = None

HAS_EXTENSION = _C is not None


# The dispatch keys of the device types the library registers kernels for (meta: the fake kernels, which give
# shapes on meta tensors); any other device type has none.
_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA", "meta": "Meta"}


@torch.compiler.assume_constant_result  # a registry lookup: torch.compile treats it as a constant
def has_kernel(op: str, device_type: str) -> bool:
    """Whether the compiled library registered `dllm_fast::<op>` for a device type ("cpu", "cuda" or "meta")."""
    key = _DISPATCH_KEYS.get(device_type)
    if not HAS_EXTENSION or key is None:
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"dllm_fast::{op}", key)


def build_info() -> dict:
    """What the extension was built with: version, the torch it was compiled against, CUDA kernels or not."""
    if not HAS_EXTENSION:
        return {"extension": False, "error": str(LOAD_ERROR)}
    return {
        "extension": True,
        "version": _C.version,
        "compiled_against_torch": _C.torch_version,
        "with_cuda": bool(_C.with_cuda),
    }


def missing_extension_message() -> str:
    return (
        f"dllm_fast's compiled ops are not available ({LOAD_ERROR}). Build them against the installed torch "
        f"{torch.__version__} with `pip install --no-build-isolation -e .` from the repository root."
    )
