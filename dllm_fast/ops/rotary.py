"""The typed face of the rotary-embedding op, `rope` (input checks, fake kernel). A LLaDA block rotates the query
and key heads of its fused QKV projection with it at inference: one kernel and one pass over the projection,
where the composite (models/layers.apply_rope) takes three kernels through fp32 temporaries twice its size."""

from __future__ import annotations

import torch

from dllm_fast._extension import HAS_EXTENSION
from dllm_fast.contracts import accumulate_dtype
from dllm_fast.ops import twins
from dllm_fast.ops.backend import FLOAT_DTYPES, choose_backend
from dllm_fast.validation import check_int


def rope(x: torch.Tensor, tables: torch.Tensor, rotated_heads: int, *, backend: str | None = None) -> torch.Tensor:
    """The rotary embedding of the first `rotated_heads` heads of x, the other heads copied, as a new contiguous
    tensor shaped like x.

    Args:
        x: [B, L, heads, D] activations, e.g. a fused QKV projection viewed as heads (queries, keys, values), in
            bf16, fp16, fp32 or fp64; D even. Any strides (the last dimension is made contiguous if it is not).
        tables: layers.rope_tables of the positions: [2, B, L, 1, D] in fp32 (fp64 for fp64 x); entry 0 is
            cos(angle), entry 1 sin(angle) on the first half of D and -sin(angle) on the second.
        rotated_heads: how many leading heads to rotate, in [0, heads].
        backend: None/"auto", "compiled" or "reference" (dllm_fast.ops.twins.rope, which is differentiable; the
            compiled kernel has no backward, so a call that needs a gradient takes the reference).

    Per element: x * tables[0] + roll(x * tables[1], D / 2), each product and the sum rounded in the tables'
    dtype, then once to x's dtype: the same values, bit for bit, on every backend and device.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"rope: x must be a [B, L, heads, D] tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}.")
    B, L, heads, D = x.shape
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"rope: x must be one of {FLOAT_DTYPES}, got {x.dtype}.")
    if D % 2:
        raise ValueError(f"rope: the head dimension D = {D} must be even (rotate-half pairs its two halves).")
    acc = accumulate_dtype(x.dtype)
    if not isinstance(tables, torch.Tensor) or tables.shape != (2, B, L, 1, D) or tables.dtype != acc:
        got = f"{tables.dtype} {tuple(tables.shape)}" if isinstance(tables, torch.Tensor) else type(tables).__name__
        raise ValueError(f"rope: tables must be {acc} of shape {(2, B, L, 1, D)} (layers.rope_tables of the "
                         f"positions, in {acc} for {x.dtype} x), got {got}.")
    if tables.device != x.device:
        raise ValueError(f"rope: x is on {x.device} and tables on {tables.device}; put both on one device.")
    check_int("rope: rotated_heads", rotated_heads, minimum=0, maximum=heads)
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or tables.requires_grad)
    if needs_grad or choose_backend("rope", x.device, backend) == "reference":
        return twins.rope(x, tables, rotated_heads)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if tables.stride(-1) != 1:
        tables = tables.contiguous()
    return torch.ops.dllm_fast.rope(x, tables, rotated_heads)


if HAS_EXTENSION:

    @torch.library.register_fake("dllm_fast::rope")
    def _rope_fake(x, tables, rotated_heads):
        return x.new_empty(x.shape)
