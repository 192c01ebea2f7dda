"""The Triton path of the fused LM-head ops (backend="triton"): dllm_fast::masked_logprobs_triton,
masked_logprobs_backward_triton and masked_logprobs_grad_triton, with the schemas and semantics of the compiled
ops they stand beside (csrc/include/dllm_fast/schemas.h), so that the faces in ops/logprobs.py call either.

Each walks the vocabulary in chunks; per chunk, the Triton kernel (ops/triton_head.py) runs the logits GEMM with
the softmax in its epilogue, and cuBLAS (torch.mm) runs the gradient GEMMs on the chunk's d(logits):

- masked_logprobs_triton: one GEMM per chunk whose epilogue leaves each tile's logsumexp and the target's logit;
  no logits reach memory.
- masked_logprobs_grad_triton (the known-gradient walk): with the rows' logsumexp known, three GEMMs per chunk
  (d(logits) from the kernel's epilogue, in the model's dtype; grad_hidden and, for a trained head, grad_weight's
  rows from torch.mm); a frozen head (grad_weight None, LoRA) skips the third. Without the logsumexp, the forward
  walk first (four GEMMs).
- masked_logprobs_backward_triton: the backward of masked_logprobs_triton (the lean forward + backward's last
  three GEMMs), each gradient only when asked.

Precision is the compiled ops' (ops/logprobs.py's docstring): products accumulate in fp32 (fp64 for fp64);
d(logits) is computed in fp32 and rounded once to bf16 for bf16 inputs; grad_hidden accumulates over the chunks
in fp32 and is rounded once; grad_weight's rows get each chunk's fp32 product added and rounded once. fp16 is not
taken (its d(logits) need the compiled kernels' power-of-two scaling), nor the TF32 option: the faces send those
to the compiled ops.

On CPU tensors the kernel runs in triton's interpreter (TRITON_INTERPRET=1 before triton is imported: the
tests), the torch.mm GEMMs in fp32 on upcast operands, which is what cuBLAS computes for bf16 ones.
"""

from __future__ import annotations

import torch

from dllm_fast.contracts import accumulate_dtype
from dllm_fast.ops import triton_head

_LIBRARY = torch.library.Library("dllm_fast", "FRAGMENT")  # noqa: TOR901 (the ops are defined in Python)
_LIBRARY.define("masked_logprobs_triton(Tensor hidden, Tensor weight, Tensor targets, int chunk_size, "
                "bool tf32_grad_gemms=False) -> (Tensor, Tensor)")
_LIBRARY.define("masked_logprobs_backward_triton(Tensor? grad_logp, Tensor? grad_lse, Tensor hidden, Tensor weight, "
                "Tensor targets, Tensor lse, int chunk_size, bool[2] output_mask, bool tf32_grad_gemms=False) "
                "-> (Tensor, Tensor)")
_LIBRARY.define("masked_logprobs_grad_triton(Tensor hidden, Tensor weight, Tensor targets, Tensor grad_logp, "
                "Tensor? lse, Tensor(a!)? grad_weight, int chunk_size, bool tf32_grad_gemms=False) "
                "-> (Tensor, Tensor)")

DTYPES = (torch.bfloat16, torch.float32, torch.float64)  # the dtypes the Triton path takes


def _check(op: str, hidden: torch.Tensor, tf32_grad_gemms: bool) -> None:
    if hidden.dtype not in DTYPES:
        raise ValueError(f"dllm_fast::{op}: the Triton path takes {DTYPES}, got {hidden.dtype}; use the compiled "
                         "op (backend='compiled') for float16.")
    if tf32_grad_gemms:
        raise ValueError(f"dllm_fast::{op}: tf32_grad_gemms=True runs on the compiled ops only (backend='compiled').")
    triton_head.check_runnable(hidden.device)


def _chunks(vocab: int, chunk_size: int):
    chunk = max(1, min(chunk_size, vocab))
    for v0 in range(0, vocab, chunk):
        yield v0, min(chunk, vocab - v0)


def _forward(hidden, weight, targets, chunk_size):
    """(logp, lse) from one MODE_LSE kernel per chunk; lse folds the chunks' logsumexps as they come."""
    acc = accumulate_dtype(hidden.dtype)
    M = hidden.shape[0]
    lse = torch.full((M,), float("-inf"), dtype=acc, device=hidden.device)
    target_logit = torch.full((M,), float("nan"), dtype=acc, device=hidden.device)
    config = triton_head.default_config(hidden.device)
    for v0, c in _chunks(weight.shape[0], chunk_size):
        chunk_lse = triton_head.chunk_logsumexp(hidden, weight.narrow(0, v0, c), targets, v0, target_logit, config)
        lse = torch.logaddexp(lse, chunk_lse)
    return target_logit - lse, lse


def _masked_logprobs_triton(hidden, weight, targets, chunk_size, tf32_grad_gemms=False):
    _check("masked_logprobs_triton", hidden, tf32_grad_gemms)
    acc = accumulate_dtype(hidden.dtype)
    if hidden.shape[0] == 0:
        return hidden.new_empty(0, dtype=acc), hidden.new_empty(0, dtype=acc)
    return _forward(hidden.contiguous(), weight.contiguous(), targets.long().contiguous(), chunk_size)


def _walk(hidden, weight, targets, lse, g_target, g_softmax, grad_hidden, grad_weight, add_into_weight, chunk_size):
    """The known-gradient walk over the vocabulary chunks: per chunk, the kernel writes d(logits) = g_target *
    onehot - g_softmax * exp(logits - lse) into a chunk buffer, then grad_hidden (accumulator type) += d(logits)
    @ W_chunk and grad_weight's rows (+)= d(logits)^T @ hidden, either skipped when None. Returns each row's
    sum of exp(logits - lse) over the vocabulary (the measured normaliser S) and its target's logit."""
    M = hidden.shape[0]
    acc = accumulate_dtype(hidden.dtype)
    config = triton_head.default_config(hidden.device)
    chunk = max(1, min(chunk_size, weight.shape[0]))
    grad_type = hidden.dtype  # bf16 d(logits) for a bf16 model; fp32/fp64 ones stay in their own type
    buffer = torch.empty(M, chunk, dtype=grad_type, device=hidden.device)
    sum_e = torch.zeros(M, dtype=acc, device=hidden.device)
    target_logit = torch.full((M,), float("nan"), dtype=acc, device=hidden.device)
    product = _ProductInto(grad_hidden, hidden.device) if grad_hidden is not None else None
    for v0, c in _chunks(weight.shape[0], chunk_size):
        w_chunk = weight.narrow(0, v0, c)
        grad = buffer[:, :c]  # rows of `chunk` entries: a strided view both GEMMs take as it is
        sum_e += triton_head.chunk_softmax_grad(hidden, w_chunk, targets, v0, lse, g_target, g_softmax, grad,
                                                target_logit, config)
        if product is not None:
            product.add(grad, w_chunk)
        if grad_weight is not None:
            _rows_into(grad_weight.narrow(0, v0, c), grad.T, hidden, add_into_weight)
    return sum_e, target_logit


class _ProductInto:
    """grad_hidden (the accumulator type) += a @ b over the chunks, the product accumulated in fp32 and rounded
    never. cuBLAS through torch cannot add a bf16 x bf16 product into an fp32 buffer (addmm's out_dtype requires
    its addend in the operands' type), so a bf16 product goes to an fp32 temporary (torch.mm's out_dtype), then
    one add. On CPU the operands are upcast: the same sums."""

    def __init__(self, out: torch.Tensor, device: torch.device):
        self.out = out
        self.scratch = None
        self.device = device

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        out = self.out
        if a.dtype == out.dtype:
            out.addmm_(a, b)
        elif self.device.type == "cuda":
            if self.scratch is None:
                self.scratch = torch.empty_like(out)
            torch.mm(a, b, out_dtype=out.dtype, out=self.scratch)
            out.add_(self.scratch)
        else:
            out.addmm_(a.to(out.dtype), b.to(out.dtype))


def _rows_into(rows: torch.Tensor, a: torch.Tensor, b: torch.Tensor, add: bool) -> None:
    """rows (+)= a @ b, the product in fp32 (fp64) and the sum rounded once into rows' dtype: cuBLAS with beta = 1
    on CUDA (its bf16 C is read, added in fp32 and rounded once), the same arithmetic spelled out on CPU."""
    if rows.device.type == "cuda" or rows.dtype == a.dtype == accumulate_dtype(rows.dtype):
        if add:
            rows.addmm_(a, b)
        else:
            torch.mm(a, b, out=rows)
        return
    acc = accumulate_dtype(rows.dtype)
    product = a.to(acc) @ b.to(acc)
    rows.copy_(rows.to(acc) + product if add else product)


def _masked_logprobs_grad_triton(hidden, weight, targets, grad_logp, lse, grad_weight, chunk_size,
                                 tf32_grad_gemms=False):
    _check("masked_logprobs_grad_triton", hidden, tf32_grad_gemms)
    M, d = hidden.shape
    V = weight.shape[0]
    acc = accumulate_dtype(hidden.dtype)
    if M == 0:
        return hidden.new_empty(0, dtype=acc), hidden.new_zeros(0, d)
    hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.long().contiguous()
    # A target outside [0, V) is never found (logp stays NaN) and passes no gradient back.
    g = grad_logp.to(acc).masked_fill((targets < 0) | (targets >= V), 0).contiguous()
    lse = _forward(hidden, weight, targets, chunk_size)[1] if lse is None else lse.to(acc).contiguous()
    grad_hidden = torch.zeros(M, d, dtype=acc, device=hidden.device)
    sum_e, target_logit = _walk(hidden, weight, targets, lse, g, g, grad_hidden, grad_weight, True, chunk_size)
    # The walk used e = S p (S: the measured normaliser, 1 for an exact lse): logp and grad_hidden are made exact
    # (grad_hidden = (walk's) / S + g W[target] (1 - 1/S)); grad_weight's softmax part stays S times (the face
    # recomputes rows whose S is off by more than rounding).
    inverse = sum_e.reciprocal()
    target_rows = weight.index_select(0, targets.clamp(0, V - 1)).to(acc)
    grad_hidden.mul_(inverse[:, None]).addcmul_(target_rows, (g * (1 - inverse))[:, None])
    logp = target_logit - lse - sum_e.log()
    return logp, grad_hidden.to(hidden.dtype)


def _masked_logprobs_backward_triton(grad_logp, grad_lse, hidden, weight, targets, lse, chunk_size, output_mask,
                                     tf32_grad_gemms=False):
    _check("masked_logprobs_backward_triton", hidden, tf32_grad_gemms)
    M, d = hidden.shape
    V = weight.shape[0]
    acc = accumulate_dtype(hidden.dtype)
    need_hidden, need_weight = output_mask
    nothing = hidden.new_empty(0)
    if (grad_logp is None and grad_lse is None) or not (need_hidden or need_weight) or M == 0:
        return (hidden.new_zeros(M, d) if need_hidden else nothing,
                torch.zeros_like(weight) if need_weight else nothing)
    hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.long().contiguous()
    outside = (targets < 0) | (targets >= V)
    g_logp = (grad_logp.to(acc).masked_fill(outside, 0) if grad_logp is not None
              else torch.zeros(M, dtype=acc, device=hidden.device))
    # d(logits) = g_logp onehot - (g_logp - g_lse) softmax
    g_softmax = g_logp - grad_lse.to(acc) if grad_lse is not None else g_logp
    grad_hidden = torch.zeros(M, d, dtype=acc, device=hidden.device) if need_hidden else None
    grad_weight = torch.empty_like(weight) if need_weight else None  # every chunk writes its rows
    _walk(hidden, weight, targets, lse.to(acc).contiguous(), g_logp.contiguous(), g_softmax.contiguous(), grad_hidden,
          grad_weight, False, chunk_size)
    return (grad_hidden.to(hidden.dtype) if need_hidden else nothing,
            grad_weight if need_weight else nothing)


for _device in ("CPU", "CUDA"):
    _LIBRARY.impl("masked_logprobs_triton", _masked_logprobs_triton, _device)
    _LIBRARY.impl("masked_logprobs_grad_triton", _masked_logprobs_grad_triton, _device)
    _LIBRARY.impl("masked_logprobs_backward_triton", _masked_logprobs_backward_triton, _device)


@torch.library.register_fake("dllm_fast::masked_logprobs_triton")
def _masked_logprobs_triton_fake(hidden, weight, targets, chunk_size, tf32_grad_gemms=False):
    acc = accumulate_dtype(hidden.dtype)
    return hidden.new_empty(hidden.shape[0], dtype=acc), hidden.new_empty(hidden.shape[0], dtype=acc)


@torch.library.register_fake("dllm_fast::masked_logprobs_backward_triton")
def _masked_logprobs_backward_triton_fake(grad_logp, grad_lse, hidden, weight, targets, lse, chunk_size,
                                          output_mask, tf32_grad_gemms=False):
    return (torch.empty_like(hidden) if output_mask[0] else hidden.new_empty(0),
            torch.empty_like(weight) if output_mask[1] else hidden.new_empty(0))


@torch.library.register_fake("dllm_fast::masked_logprobs_grad_triton")
def _masked_logprobs_grad_triton_fake(hidden, weight, targets, grad_logp, lse, grad_weight, chunk_size,
                                      tf32_grad_gemms=False):
    return hidden.new_empty(hidden.shape[0], dtype=accumulate_dtype(hidden.dtype)), torch.empty_like(hidden)


def _setup_context(ctx, inputs, output):
    hidden, weight, targets, chunk_size, *_ = inputs
    ctx.save_for_backward(hidden, weight, targets, output[1])
    ctx.chunk_size = chunk_size


def _backward(ctx, grad_logp, grad_lse):
    hidden, weight, targets, lse = ctx.saved_tensors
    if torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (grad_logp, grad_lse, hidden, weight)):
        raise RuntimeError(NO_DOUBLE_BACKWARD)
    need = [ctx.needs_input_grad[0], ctx.needs_input_grad[1]]
    grad_hidden, grad_weight = torch.ops.dllm_fast.masked_logprobs_backward_triton(
        grad_logp, grad_lse, hidden, weight, targets, lse, ctx.chunk_size, need)
    return (grad_hidden if need[0] else None), (grad_weight if need[1] else None), None, None, None


NO_DOUBLE_BACKWARD = (
    "masked_logprobs: the Triton backend has no second derivative, so a backward with create_graph=True "
    "(double backward, e.g. a gradient penalty) cannot go through it; pass backend='reference' to "
    "masked_logprobs for higher-order gradients.")

torch.library.register_autograd("dllm_fast::masked_logprobs_triton", _backward, setup_context=_setup_context)
