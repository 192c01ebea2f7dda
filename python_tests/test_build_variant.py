"""What differs between a CPU and a CUDA build of the extension, checked on whichever build imports it.

CI runs this file on both builds: with the README's suite on the CPU build, and in `.ci/cuda_build` on PyPI's
CUDA torch without a GPU (where `DLLM_FAST_EXPECT_CUDA=1` says the CUDA kernels must be there). The rest of the
suite runs on the CPU build only: the Python above the extension is the same on both. What a build changes:

- the import (`dllm_fast._C` loads against that torch) and what `build_info()` says of it;
- the ops registered, each with a kernel for every device the build serves (schemas.h lists them);
- the fake kernels on those devices (torch.compile and the planner trace through them);
- the CUDA tests, collected on either build and skipped by their marker where there is no GPU (.ci/cuda_build
  runs `-m cuda` over the suite for that).
"""

import os
import re
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import dllm_fast
import dllm_fast.ops  # the op faces register the fake kernels

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = (ROOT / "csrc/include/dllm_fast/schemas.h").read_text()
EXPECT_CUDA = os.environ.get("DLLM_FAST_EXPECT_CUDA") == "1"


def macro_names(macro: str) -> list[str]:
    """The first argument of every X(...) in `#define macro(X)`'s body."""
    body = re.search(rf"#define {macro}\(X\)(.*?)(?:\n\s*\n|\n#|\Z)", SCHEMAS, flags=re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    return re.findall(r"\bX\(\s*(\w+)\s*,", body)


OPS = macro_names("DLLM_FAST_OP_SCHEMAS")
CUDA_OPS = macro_names("DLLM_FAST_CUDA_KERNELS")


def has_kernel(op: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"dllm_fast::{op}", key)


def test_the_schema_lists_are_read():
    assert len(OPS) >= 6 and "masked_logprobs" in OPS and "rope" in OPS
    assert set(CUDA_OPS) <= set(OPS) and "sample_tokens" in CUDA_OPS


def test_the_build_imports_with_the_kernels_it_promises():
    info = dllm_fast.build_info()
    assert info["extension"], f"dllm_fast._C did not import: {info}"
    assert info["compiled_against_torch"] == ".".join(torch.__version__.split(".")[:2]), info
    if EXPECT_CUDA:
        assert info["with_cuda"], f"DLLM_FAST_EXPECT_CUDA=1, but the extension has no CUDA kernels: {info}"
    if not torch.version.cuda:
        assert not info["with_cuda"], f"a CPU torch cannot carry CUDA kernels: {info}"
    for op in OPS:
        assert hasattr(torch.ops.dllm_fast, op), f"dllm_fast::{op} is not registered"
        assert has_kernel(op, "CPU"), f"dllm_fast::{op} has no CPU kernel"
    for op in CUDA_OPS:
        assert has_kernel(op, "CUDA") == info["with_cuda"], (op, info)


def fake_calls(device: str):
    """One call of every op at tiny shapes on `device`, as (op, args)."""
    M, d, V, B, L, H, D = 5, 8, 40, 2, 3, 2, 4
    f = dict(device=device)
    hidden, weight = torch.empty(M, d, **f), torch.empty(V, d, **f)
    targets, lse = torch.zeros(M, dtype=torch.long, **f), torch.empty(M, **f)
    return {
        "masked_logprobs": (hidden, weight, targets, 16),
        "masked_logprobs_backward": (torch.empty(M, **f), None, hidden, weight, targets, lse, 16, [True, True]),
        "masked_logprobs_grad": (hidden, weight, targets, torch.empty(M, **f), lse, None, 16),
        "sample_tokens": (hidden, weight, torch.arange(M, **f), 0.0, 0, 0, [], [], 16),
        "select_transfer": (torch.empty(B, L, **f), torch.ones(B, L, dtype=torch.bool, **f),
                            torch.ones(B, dtype=torch.long, **f), -1.0),
        "rope": (torch.empty(B, L, H, D, **f), torch.empty(2, B, L, 1, D, **f), 1),
    }


FAKE_CALLS = set(fake_calls("meta"))


def fake_devices() -> list[str]:
    return ["cpu"] + (["cuda"] if dllm_fast.build_info()["with_cuda"] else [])


@pytest.mark.parametrize("device", fake_devices(), ids=lambda device: f"fake-{device}")  # not the cuda marker
def test_every_op_runs_on_fake_tensors_of_each_device_the_build_serves(device):
    assert set(OPS) == FAKE_CALLS, "a new op needs a fake call here"
    with FakeTensorMode():
        for op, args in fake_calls(device).items():
            outputs = getattr(torch.ops.dllm_fast, op).default(*args)
            for out in outputs if isinstance(outputs, tuple) else (outputs,):
                assert out.device.type == device, (op, out.device)

