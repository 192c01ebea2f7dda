"""What each compiled op costs beyond reading its inputs and writing its outputs, declared so that the planner
(dllm_fast.planning) and torch's FlopCounterMode can count it.

- FLOPs: one formula per op, registered with `torch.utils.flop_counter`, so FlopCounterMode counts the fused
  LM-head GEMMs too (it sees only the op, not the GEMMs inside it).
- GEMMs by operand type: `gemm_flops_by_type(op, device_type, args)` splits those FLOPs by (operand dtype,
  compute), as the kernels hand them to cuBLAS (CUDA) or MKL (CPU), so that the planner prices each GEMM at the
  peak of its type, and a test can hold the declaration against the emulator's GEMM log (`gemm_flops_in_log`).
- Workspace: the fake kernels (ops/logprobs.py, ops/sampling.py) allocate only the outputs; the real kernels also
  allocate chunk buffers, upcast copies and per-row state while they run, and move the chunk logits through
  memory. `workspace(op, device_type, args)` says how much, for the CPU kernel (csrc/cpu) or the CUDA one
  (csrc/cuda/*_glue.cpp). Keep each entry in step with its kernel: when a kernel allocates something new,
  declare it here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from dllm_fast import _extension  # noqa: F401 (loads dllm_fast._C: the compiled ops whose FLOPs are registered below)
from dllm_fast.contracts import accumulate_dtype
from dllm_fast.ops import logprobs_triton  # noqa: F401 (defines the Triton ops, likewise)


@dataclass(frozen=True)
class Workspace:
    """bytes: the most memory the kernel holds at once beyond its inputs and outputs. traffic: the bytes it moves
    through memory beyond reading its inputs and writing its outputs once (chunk logits written and read back,
    weights read again)."""

    bytes: int = 0
    traffic: int = 0


# op name (without the "dllm_fast::" namespace) -> fn(device_type, *op arguments) -> Workspace
WORKSPACES: dict[str, Callable[..., Workspace]] = {}


def declare_workspace(op: str):
    def register(fn: Callable[..., Workspace]) -> Callable[..., Workspace]:
        WORKSPACES[op] = fn
        return fn

    return register


def workspace(op: str, device_type: str, args) -> Workspace:
    """The workspace of one call of dllm_fast::<op> with `args` (its schema's arguments, in order) on a device
    of `device_type` ("cpu" or "cuda"). KeyError for an op with no declaration."""
    return WORKSPACES[op](device_type, *args)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _chunks(vocab: int, chunk: int) -> tuple[int, int]:
    """(columns per chunk, number of chunks) of a pass over `vocab` columns in chunks of `chunk`."""
    chunk = max(1, min(chunk, vocab))
    return chunk, -(-vocab // chunk)


@declare_workspace("masked_logprobs")
def _masked_logprobs(device_type, hidden, weight, targets, chunk_size, tf32_grad_gemms=False) -> Workspace:
    M, d = hidden.shape
    V = weight.shape[0]
    acc, size = _size(accumulate_dtype(hidden.dtype)), _size(hidden.dtype)
    C, _ = _chunks(V, chunk_size)
    logits = M * C * acc
    traffic = 2 * M * V * acc  # each chunk's logits are written by the GEMM and read by the reduction
    if device_type == "cuda":
        return Workspace(logits + 3 * M * acc, traffic)  # + running max, sum and target logit per row
    upcast = size != acc
    return Workspace(logits + (M * d * acc if upcast else 0) + (C * d * acc if upcast else 0) + 3 * M * acc, traffic)


@declare_workspace("masked_logprobs_backward")
def _masked_logprobs_backward(device_type, grad_logp, grad_lse, hidden, weight, targets, lse, chunk_size,
                              output_mask, tf32_grad_gemms=False) -> Workspace:
    M, d = hidden.shape
    V = weight.shape[0]
    acc, size = _size(accumulate_dtype(hidden.dtype)), _size(hidden.dtype)
    C, chunks = _chunks(V, chunk_size)
    need_hidden, need_weight = output_mask
    upcast = size != acc
    grad_hidden_accumulator = M * d * acc if need_hidden else 0
    logits = M * C * acc
    # Recompute the logits (written, read), write d(logits), read it for each gradient GEMM; read the weight again
    # for grad_hidden and the hidden rows once per chunk for grad_weight.
    traffic = 2 * M * V * acc + M * V * size * (1 + need_hidden + need_weight)
    traffic += (V * d * size if need_hidden else 0) + (chunks * M * d * size if need_weight else 0)
    if device_type == "cuda":
        return Workspace(grad_hidden_accumulator + logits + _cuda_gradient_operands(
            M, d, C, acc, size, upcast, tf32_grad_gemms, need_hidden, need_weight,
            C * d * acc if need_weight and upcast else 0)
            + 4 * M * acc, traffic)
    upcast_copies = (M * d * acc + C * d * acc) if upcast else 0  # hidden and each weight chunk in fp32
    chunk_product = C * d * acc if (upcast and need_weight) else 0  # grad_weight rows before their cast
    return Workspace(grad_hidden_accumulator + logits + upcast_copies + chunk_product + 4 * M * acc, traffic)


@declare_workspace("masked_logprobs_grad")
def _masked_logprobs_grad(device_type, hidden, weight, targets, grad_logp, lse, grad_weight, chunk_size,
                          tf32_grad_gemms=False) -> Workspace:
    """Both gradients for an upstream gradient known before the forward, in one walk over the vocabulary
    (grad_weight accumulated in place). CPU: fp32 copies of hidden and of each weight chunk, d(logits) in place in
    the fp32 logits. CUDA, bf16/fp16 inputs (issue 28): hidden and the weight used as they are, each chunk's
    d(logits) rounded once to the model's dtype for the two gradient GEMMs."""
    M, d = hidden.shape
    V = weight.shape[0]
    acc, size = _size(accumulate_dtype(hidden.dtype)), _size(hidden.dtype)
    C, chunks = _chunks(V, chunk_size)
    upcast = size != acc
    rounded = device_type == "cuda" and upcast  # d(logits) in the model's dtype, operands uncopied
    gradient_operand = size if rounded else acc
    gemms_reading = 1 + (grad_weight is not None)
    # Each chunk's logits written and read (twice over with the logsumexp pass); d(logits) written (when rounded)
    # and read by each gradient GEMM; the weight read again for grad_hidden; hidden read per chunk for grad_weight,
    # whose rows are read and written once.
    traffic = 2 * M * V * acc * (2 if lse is None else 1) + M * V * gradient_operand * (rounded + gemms_reading)
    traffic += V * d * size
    if grad_weight is not None:
        traffic += chunks * M * d * gradient_operand + V * d * grad_weight.element_size()
    lse_pass = _masked_logprobs(device_type, hidden, weight, targets, chunk_size).bytes if lse is None else 0
    grad_hidden_accumulator = M * d * acc if upcast else 0  # else it is the output itself
    low_precision_grad = grad_weight is not None and grad_weight.dtype != accumulate_dtype(hidden.dtype)
    chunk_product = C * d * acc if low_precision_grad else 0  # its rows in fp32 before they are added
    if device_type == "cuda":
        copies = M * d * acc + _cuda_gradient_operands(M, d, C, acc, size, upcast, tf32_grad_gemms, True,
                                                       grad_weight is not None, chunk_product)  # + target rows
    else:
        copies = (M * d * acc + C * d * acc if upcast else 0) + M * d * acc + chunk_product  # + target rows
    held = grad_hidden_accumulator + M * C * acc + copies + 4 * M * acc
    return Workspace(max(held, lse_pass), traffic)


def _cuda_gradient_operands(M, d, C, acc, size, upcast, tf32, need_hidden, need_weight, chunk_product) -> int:
    """What the CUDA walk (csrc/cuda/masked_logprobs_glue.cpp) allocates for its gradient GEMMs: a bf16/fp16
    model's d(logits) in its own dtype; under tf32_grad_gemms fp32 copies of hidden and of a weight chunk
    instead; the fp32 rows of a chunk's grad_weight when the gradient is not fp32 (chunk_product bytes)."""
    if not upcast:
        return chunk_product
    if tf32:
        return (M * d * acc if need_weight else 0) + (C * d * acc if need_hidden else 0) + chunk_product
    return M * C * size + chunk_product


# -- The Triton path (ops/logprobs_triton.py, ops/triton_head.py) ------------------------------------------------
def _triton_tiles(device_type: str, columns: int) -> int:
    """Per-row partials one kernel launch over `columns` vocabulary columns writes (one per column tile), with the
    tiles the path runs on `device_type` (sm_90's for "cuda": what a plan for the H100/H200 prices)."""
    from dllm_fast.ops.triton_head import planned_config, tiles_per_row

    return tiles_per_row(columns, planned_config(device_type))


@declare_workspace("masked_logprobs_triton")
def _masked_logprobs_triton(device_type, hidden, weight, targets, chunk_size, tf32_grad_gemms=False) -> Workspace:
    """One kernel per chunk: the logits stay in registers; each [M, tiles] block of per-tile logsumexps is written
    and read back by one reduction, then folded into the running lse."""
    M = hidden.shape[0]
    V = weight.shape[0]
    acc = _size(accumulate_dtype(hidden.dtype))
    C, chunks = _chunks(V, chunk_size)
    partials = M * _triton_tiles(device_type, C) * acc
    traffic = 2 * M * _triton_tiles(device_type, V) * acc + chunks * 4 * M * acc  # partials; lse folded per chunk
    return Workspace(partials + 4 * M * acc, traffic)  # + lse, target logit, the chunk's lse and its fold


def _triton_walk(device_type, hidden, weight, chunk_size, need_hidden: bool, need_weight: bool,
                 weight_grad_size: int) -> Workspace:
    """The known-gradient walk of the Triton path: per chunk the kernel writes d(logits) [M, C] in the model's
    dtype once, each gradient GEMM reads it; grad_hidden accumulates in fp32 (bf16 inputs on CUDA: through an
    fp32 [M, d] product, then an add: 16 bytes per entry and chunk; in place otherwise: 8)."""
    M, d = hidden.shape
    V = weight.shape[0]
    acc, size = _size(accumulate_dtype(hidden.dtype)), _size(hidden.dtype)
    C, chunks = _chunks(V, chunk_size)
    upcast = size != acc
    gemms = need_hidden + need_weight
    traffic = M * V * size * (1 + gemms) + 2 * M * _triton_tiles(device_type, V) * acc
    bytes_ = M * C * size + M * _triton_tiles(device_type, C) * acc + 8 * M * acc  # + per-row state
    if need_hidden:
        through_scratch = upcast and device_type == "cuda"
        traffic += V * d * size + chunks * M * d * acc * (4 if through_scratch else 2)
        bytes_ += M * d * acc * (2 if through_scratch else (1 if upcast else 0))  # accumulator (+ product)
        if device_type != "cuda":
            bytes_ += M * d * acc + (M * C * acc + C * d * acc if upcast else 0)  # CPU: product; upcast operands
    if need_weight:
        traffic += chunks * M * d * size + 2 * V * d * weight_grad_size  # hidden per chunk; rows read, written
        if device_type != "cuda" and upcast:
            bytes_ += 2 * C * d * acc + M * d * acc  # the CPU's fp32 rows and product, upcast hidden
    return Workspace(bytes_, traffic)


@declare_workspace("masked_logprobs_grad_triton")
def _masked_logprobs_grad_triton(device_type, hidden, weight, targets, grad_logp, lse, grad_weight, chunk_size,
                                 tf32_grad_gemms=False) -> Workspace:
    M, d = hidden.shape
    acc = _size(accumulate_dtype(hidden.dtype))
    walk = _triton_walk(device_type, hidden, weight, chunk_size, True, grad_weight is not None,
                        grad_weight.element_size() if grad_weight is not None else 0)
    size = _size(hidden.dtype)
    rows = M * d * (acc + (size if size != acc else 0))  # the target rows gathered (and upcast)
    finish = Workspace(rows, M * d * (size + 3 * acc))  # grad_hidden / S + g W[target] (1 - 1/S)
    if lse is None:  # the forward walk first
        forward = _masked_logprobs_triton(device_type, hidden, weight, targets, chunk_size)
        return Workspace(max(forward.bytes, walk.bytes + finish.bytes), forward.traffic + walk.traffic + finish.traffic)
    return Workspace(walk.bytes + finish.bytes, walk.traffic + finish.traffic)


@declare_workspace("masked_logprobs_backward_triton")
def _masked_logprobs_backward_triton(device_type, grad_logp, grad_lse, hidden, weight, targets, lse, chunk_size,
                                     output_mask, tf32_grad_gemms=False) -> Workspace:
    if (grad_logp is None and grad_lse is None) or not any(output_mask):
        return Workspace()
    return _triton_walk(device_type, hidden, weight, chunk_size, bool(output_mask[0]), bool(output_mask[1]),
                        weight.element_size())


@declare_workspace("sample_tokens")
def _sample_tokens(device_type, hidden, weight, row_ids, temperature, seed, offset, suppress_ids, exclude_ids,
                   chunk_size) -> Workspace:
    N, d = hidden.shape
    V = weight.shape[0]
    acc, size = _size(accumulate_dtype(hidden.dtype)), _size(hidden.dtype)
    C = min((chunk_size + 3) // 4 * 4, (V + 3) // 4 * 4)  # chunks start at multiples of 4 (Philox quads)
    logits = N * C * acc
    traffic = 2 * N * V * acc
    if device_type == "cuda":
        return Workspace(logits + N * (4 * acc + 8), traffic)  # best score/logit, max, sum; best token
    upcast = size != acc
    row_state = N * (4 * acc + 8)
    return Workspace(logits + row_state + ((N * d + C * d) * acc if upcast else 0), traffic)


@declare_workspace("select_transfer")
def _select_transfer(device_type, confidence, candidates, counts, threshold) -> Workspace:
    if device_type == "cuda":
        return Workspace()
    return Workspace(confidence.numel() * 8)  # the CPU kernel ranks a float64 copy of the confidences


@declare_workspace("rope")
def _rope(device_type, x, tables, rotated_heads) -> Workspace:
    return Workspace()  # one pass: reads x and the tables, writes the output


# FLOPs of the GEMMs inside each op (2 per multiply-add), in torch.utils.flop_counter's formula convention: the
# tensor arguments arrive as their shapes.
def _masked_logprobs_flops(hidden_shape, weight_shape, targets_shape, chunk_size, *args, out_shape=None, **kwargs):
    return 2 * hidden_shape[0] * weight_shape[0] * hidden_shape[1]


def _masked_logprobs_backward_flops(grad_logp_shape, grad_lse_shape, hidden_shape, weight_shape, targets_shape,
                                    lse_shape, chunk_size, output_mask, *args, out_shape=None, **kwargs):
    if (grad_logp_shape is None and grad_lse_shape is None) or not any(output_mask):
        return 0  # no upstream gradient or no gradient asked: the kernels return zeros at once
    gemm = 2 * hidden_shape[0] * weight_shape[0] * hidden_shape[1]
    return gemm * (1 + bool(output_mask[0]) + bool(output_mask[1]))  # recompute, then one GEMM per gradient


def _sample_tokens_flops(hidden_shape, weight_shape, *args, out_shape=None, **kwargs):
    return 2 * hidden_shape[0] * weight_shape[0] * hidden_shape[1]


def _masked_logprobs_grad_flops(hidden_shape, weight_shape, targets_shape, grad_logp_shape, lse_shape,
                                grad_weight_shape, chunk_size, *args, out_shape=None, **kwargs):
    gemm = 2 * hidden_shape[0] * weight_shape[0] * hidden_shape[1]
    # the logits, grad_hidden and (when asked) grad_weight per chunk; a forward pass first when lse is not given
    return gemm * (2 + (grad_weight_shape is not None) + (lse_shape is None))


# -- GEMMs by operand type -------------------------------------------------------------------------------------
# Compute kinds: "fp32" (products accumulated in fp32: tensor cores for bf16/fp16 operands, CUDA cores for fp32
# ones), "tf32" (fp32 operands rounded to TF32 for the tensor cores), "fp64".
COMPUTES = ("fp32", "tf32", "fp64")
GemmFlops = dict[tuple[torch.dtype, str], float]


def gemm_flops_by_type(op: str, device_type: str, args, *, tf32_grad_gemms: bool = False) -> GemmFlops:
    """FLOPs (2 per multiply-add) of the GEMMs one call of dllm_fast::<op> runs, by (operand dtype, compute), on a
    device of `device_type` ("cuda" or "cpu"); `args`: the op's schema arguments in order (tensors, real or fake).

    CUDA (csrc/cuda/*_glue.cpp, cuBLAS): every GEMM takes its operands in the model's dtype (bf16, fp16, fp32 or
    fp64) and accumulates in fp32 (fp64 for fp64): the logits GEMM of each vocabulary chunk, and in the backward
    and the known-gradient walk the two gradient GEMMs too. The ops' own `tf32_grad_gemms` argument (or
    tf32_grad_gemms=True here, for every call: how the kernels ran before issue 28) prices the TF32 path the CUDA
    kernels keep behind that option: the two gradient GEMMs on fp32 operands rounded to TF32 (copies of hidden and of
    the weight chunk for bf16/fp16 inputs, fp32 inputs as they are). CPU (csrc/cpu, MKL):
    operands upcast to fp32 (fp64 for fp64), products in that type. An op without GEMMs gives {}."""
    if op not in _GEMMS:
        return {}
    dtype, shares, tf32_option = _GEMMS[op](*args)  # hidden's dtype: the model's (the op requires it of the weight)
    if not shares:
        return {}
    tf32_grad_gemms = tf32_grad_gemms or bool(tf32_option)
    acc = accumulate_dtype(dtype)
    compute = "fp64" if acc == torch.float64 else "fp32"
    native = (dtype if device_type == "cuda" else acc, compute)
    gradient = (torch.float32, "tf32") if device_type == "cuda" and tf32_grad_gemms and acc == torch.float32 else native
    out: GemmFlops = {}
    for kind, flops in shares:
        key = gradient if kind == "gradient" else native
        out[key] = out.get(key, 0) + flops
    return out


def gemm_flops_in_log(records) -> GemmFlops:
    """The same sums from a GEMM log (`dllm_fast.testing.emulation.gemm_log()`'s records: a_dtype, compute, .flops),
    so that `gemm_flops_by_type(op, "cuda", args) == gemm_flops_in_log(log)` checks a declaration against what
    the kernels ran. Dtypes may be torch dtypes or their names ("bfloat16", "torch.bfloat16")."""
    out: GemmFlops = {}
    for record in records:
        key = (_as_dtype(record.a_dtype), str(record.compute).lower())
        out[key] = out.get(key, 0) + record.flops
    return out


def _as_dtype(value) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{value!r} names no torch dtype.")
    return dtype


def _head_gemm(hidden, weight) -> float:
    """One pass of the head's GEMM over the vocabulary: [M, d] x [V, d]^T, summed over the chunks."""
    return 2 * hidden.shape[0] * weight.shape[0] * hidden.shape[1]


# op -> fn(*op arguments) -> (hidden's dtype, [(kind, FLOPs)], the call's tf32_grad_gemms): kind "logits" (the
# chunk's logits, always in the model's dtype) or "gradient" (grad_hidden or grad_weight; TF32 under
# tf32_grad_gemms). Keep in step with the glue files.
def _masked_logprobs_gemms(hidden, weight, targets=None, chunk_size=None, tf32_grad_gemms=False):
    return hidden.dtype, [("logits", _head_gemm(hidden, weight))], False  # the forward has no gradient GEMM


def _masked_logprobs_backward_gemms(grad_logp, grad_lse, hidden, weight, targets, lse, chunk_size, output_mask,
                                    tf32_grad_gemms=False):
    if (grad_logp is None and grad_lse is None) or not any(output_mask):  # the kernels return zeros at once
        return hidden.dtype, [], tf32_grad_gemms
    gemm = _head_gemm(hidden, weight)
    return hidden.dtype, [("logits", gemm)] + [("gradient", gemm) for needed in output_mask if needed], tf32_grad_gemms


def _masked_logprobs_grad_gemms(hidden, weight, targets, grad_logp, lse, grad_weight, chunk_size,
                                tf32_grad_gemms=False):
    gemm = _head_gemm(hidden, weight)
    forward = [("logits", gemm)] if lse is None else []  # the rows' logsumexp first, when not given
    gradients = [("gradient", gemm)] * (1 + (grad_weight is not None))
    return hidden.dtype, forward + [("logits", gemm)] + gradients, tf32_grad_gemms


def _sample_tokens_gemms(hidden, weight, *_):
    return hidden.dtype, [("logits", _head_gemm(hidden, weight))], False


def _masked_logprobs_backward_triton_gemms(grad_logp, grad_lse, hidden, weight, targets, lse, chunk_size,
                                           output_mask, tf32_grad_gemms=False):
    """The Triton backward: one logits GEMM (the kernel, its epilogue writing d(logits)), then one cuBLAS GEMM per
    gradient asked for; as the compiled backward's."""
    return _masked_logprobs_backward_gemms(grad_logp, grad_lse, hidden, weight, targets, lse, chunk_size, output_mask,
                                           tf32_grad_gemms)


# The Triton ops run the GEMMs of their compiled twins, typed alike (bf16 operands, fp32 accumulation): the logits
# GEMM in the Triton kernel, the gradient GEMMs in cuBLAS; they never take the TF32 option (the faces refuse it).
_GEMMS = {"masked_logprobs": _masked_logprobs_gemms, "masked_logprobs_backward": _masked_logprobs_backward_gemms,
          "masked_logprobs_grad": _masked_logprobs_grad_gemms, "sample_tokens": _sample_tokens_gemms,
          "masked_logprobs_triton": _masked_logprobs_gemms,
          "masked_logprobs_backward_triton": _masked_logprobs_backward_triton_gemms,
          "masked_logprobs_grad_triton": _masked_logprobs_grad_gemms}

_FLOPS = {"masked_logprobs": _masked_logprobs_flops, "masked_logprobs_backward": _masked_logprobs_backward_flops,
          "masked_logprobs_grad": _masked_logprobs_grad_flops, "sample_tokens": _sample_tokens_flops,
          "masked_logprobs_triton": _masked_logprobs_flops,
          "masked_logprobs_backward_triton": _masked_logprobs_backward_flops,
          "masked_logprobs_grad_triton": _masked_logprobs_grad_flops}


def _register_flop_formulas() -> None:
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    for name, formula in _FLOPS.items():
        if not hasattr(torch.ops.dllm_fast, name):  # the compiled ops need the extension; the Triton ones do not
            continue
        op = getattr(torch.ops.dllm_fast, name)
        if op not in flop_registry:  # a module reload must not register twice
            register_flop_formula(op)(formula)


_register_flop_formulas()
