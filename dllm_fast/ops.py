"""Typed Python faces of the compiled ops: input checks, fake kernels for torch.compile, autograd, backend choice.

Every op runs on one of two backends:

- ``"compiled"``: the C++/CUDA kernel in dllm_fast._C for the tensors' device;
- ``"reference"``: the plain-PyTorch twin in dllm_fast.reference.

``backend=None`` (or ``"auto"``) takes the compiled kernel when one is registered for the device and otherwise
falls back to the reference with a one-time warning. Asking for ``"compiled"`` explicitly raises instead of
falling back. The environment variable ``DLLM_FAST_BACKEND`` sets the default.
"""

from __future__ import annotations

import os
import warnings

import torch

from dllm_fast import reference
from dllm_fast._extension import HAS_EXTENSION, has_kernel, missing_extension_message
from dllm_fast.contracts import accumulate_dtype

BACKENDS = ("auto", "compiled", "reference")
_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_warned_fallback: set[tuple[str, str]] = set()


def choose_backend(op: str, device: torch.device, backend: str | None) -> str:
    """Resolve `backend` (None, "auto", "compiled" or "reference") for op `op` on `device`."""
    requested = backend or os.environ.get("DLLM_FAST_BACKEND", "auto")
    if requested not in BACKENDS:
        raise ValueError(f"backend={requested!r} is not one of {BACKENDS}.")
    if requested == "reference":
        return "reference"
    if has_kernel(op, device.type):
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


# ---------------------------------------------------------------------------------------------------------
# masked_logprobs


def default_chunk_size(rows: int, vocab: int, device: torch.device) -> int:
    """Vocabulary columns per chunk: about 8 MB of fp32 logits on CPU (cache-friendly), 256 MB on GPU."""
    budget = (256 << 20) if device.type == "cuda" else (8 << 20)
    columns = budget // (4 * max(rows, 1))
    columns = max(1024 if device.type == "cuda" else 256, min(columns, 32768))
    return int(min(vocab, columns - columns % 128))


def masked_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Log-probabilities of `targets` under the LM head, without materialising the [M, V] logits.

    Args:
        hidden: [M, d] final hidden states of the positions to score (fp32, fp64, bf16 or fp16).
        lm_head_weight: [V, d] LM head, same dtype and device as `hidden`.
        targets: [M] token ids in [0, V).
        chunk_size: vocabulary columns per chunk (default: sized for the device). Peak temporary memory is
            about M * chunk_size * 4 bytes.
        backend: None/"auto", "compiled" or "reference" (see module docstring).

    Returns:
        logp: [M], ``log_softmax(hidden @ lm_head_weight.T)[i, targets[i]]`` in fp32 (fp64 for fp64 inputs).
        Differentiable with respect to `hidden` and `lm_head_weight`; backward recomputes the logits chunk by
        chunk. On CUDA, an out-of-range target yields NaN (checking it would cost a host sync); on CPU it raises.
    """
    _check_masked_logprobs(hidden, lm_head_weight, targets, chunk_size)
    targets = targets.long()
    if choose_backend("masked_logprobs", hidden.device, backend) == "reference":
        return reference.masked_logprobs(hidden, lm_head_weight, targets)
    if chunk_size is None:
        chunk_size = default_chunk_size(hidden.shape[0], lm_head_weight.shape[0], hidden.device)
    logp, _ = torch.ops.dllm_fast.masked_logprobs(
        hidden.contiguous(), lm_head_weight.contiguous(), targets.contiguous(), chunk_size
    )
    return logp


def _check_masked_logprobs(hidden, weight, targets, chunk_size) -> None:
    for name, value in (("hidden", hidden), ("lm_head_weight", weight), ("targets", targets)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"masked_logprobs: {name} must be a torch.Tensor, got {type(value).__name__}.")
    if hidden.dim() != 2:
        raise ValueError(
            f"masked_logprobs: hidden must be [M, d], got shape {tuple(hidden.shape)}; "
            "select the positions to score and flatten them into rows first."
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"masked_logprobs: lm_head_weight must be [V, d] with d = {hidden.shape[1]} (hidden's width), "
            f"got shape {tuple(weight.shape)}."
        )
    if targets.shape != (hidden.shape[0],):
        raise ValueError(
            f"masked_logprobs: targets must be [M] = [{hidden.shape[0]}] (one id per row of hidden), "
            f"got shape {tuple(targets.shape)}."
        )
    if hidden.dtype not in _FLOAT_DTYPES or weight.dtype != hidden.dtype:
        raise TypeError(
            f"masked_logprobs: hidden and lm_head_weight must share one of {_FLOAT_DTYPES}, got "
            f"{hidden.dtype} and {weight.dtype}; cast with .to(dtype)."
        )
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"masked_logprobs: targets must be int64 (or int32) token ids, got {targets.dtype}; "
                        "pass targets.long().")
    if not (hidden.device == weight.device == targets.device):
        raise ValueError(
            f"masked_logprobs: hidden, lm_head_weight and targets must be on one device, got "
            f"{hidden.device}, {weight.device} and {targets.device}; move them with .to(lm_head_weight.device)."
        )
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"masked_logprobs: chunk_size must be a positive int or None, got {chunk_size!r}.")


if HAS_EXTENSION:

    @torch.library.register_fake("dllm_fast::masked_logprobs")
    def _masked_logprobs_fake(hidden, weight, targets, chunk_size):
        acc = accumulate_dtype(hidden.dtype)
        rows = hidden.shape[0]
        return hidden.new_empty(rows, dtype=acc), hidden.new_empty(rows, dtype=acc)

    @torch.library.register_fake("dllm_fast::masked_logprobs_backward")
    def _masked_logprobs_backward_fake(grad_logp, grad_lse, hidden, weight, targets, lse, chunk_size, output_mask):
        grad_hidden = torch.empty_like(hidden) if output_mask[0] else None
        grad_weight = torch.empty_like(weight) if output_mask[1] else None
        return grad_hidden, grad_weight

    def _masked_logprobs_setup_context(ctx, inputs, output):
        hidden, weight, targets, chunk_size = inputs
        _, lse = output
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_size = chunk_size

    def _masked_logprobs_backward(ctx, grad_logp, grad_lse):
        hidden, weight, targets, lse = ctx.saved_tensors
        grad_hidden, grad_weight = torch.ops.dllm_fast.masked_logprobs_backward(
            grad_logp, grad_lse, hidden, weight, targets, lse, ctx.chunk_size,
            [ctx.needs_input_grad[0], ctx.needs_input_grad[1]],
        )
        return grad_hidden, grad_weight, None, None

    torch.library.register_autograd(
        "dllm_fast::masked_logprobs", _masked_logprobs_backward, setup_context=_masked_logprobs_setup_context
    )


# ---------------------------------------------------------------------------------------------------------
# sample_tokens and select_transfer (block diffusion sampling)


def sample_tokens(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    offset: int = 0,
    row_ids: torch.Tensor | None = None,
    suppress_ids=(),
    confidence_exclude_ids=(),
    chunk_size: int | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from softmax(hidden @ W.T / T) and report its confidence, in one pass over V.

    Args:
        hidden: [N, d] hidden states of the positions to decode; lm_head_weight: [V, d], same dtype/device.
        temperature: 0 means argmax (ties to the lowest id); T > 0 is Gumbel-max, an exact sample.
        seed, offset, row_ids: the noise of row i and token j is Philox4x32-10 keyed by (seed, offset,
            row_ids[i], j) (row_ids default 0..N-1), so results are reproducible and independent of batching.
        suppress_ids: token ids removed from sampling and from the confidence softmax (e.g. EOS).
        confidence_exclude_ids: token ids removed from the confidence softmax only; a row that samples one of
            them gets confidence 0. On CUDA each list holds at most 8 ids.

    Returns:
        tokens [N] int64, and confidence [N] fp32 (fp64 for fp64 inputs): softmax(hidden @ W.T)[token] under the
        unscaled logits. A row with no finite logit (NaN hidden states) raises on CPU; on CUDA, where checking
        would cost a host sync, it comes back as token -1 with confidence NaN.
    """
    _check_rows_and_head("sample_tokens", hidden, lm_head_weight)
    if not temperature >= 0:
        raise ValueError(f"sample_tokens: temperature must be >= 0, got {temperature!r}.")
    N, V = hidden.shape[0], lm_head_weight.shape[0]
    suppress_ids, confidence_exclude_ids = [int(i) for i in suppress_ids], [int(i) for i in confidence_exclude_ids]
    for token in suppress_ids + confidence_exclude_ids:
        if not 0 <= token < V:
            raise ValueError(f"sample_tokens: token id {token} is outside the vocabulary [0, {V}).")
    if len(set(suppress_ids)) >= V:
        raise ValueError("sample_tokens: every token is suppressed; nothing is left to sample.")
    if row_ids is None:
        row_ids = torch.arange(N, device=hidden.device)
    elif row_ids.shape != (N,):
        raise ValueError(f"sample_tokens: row_ids must be [N] = [{N}], got shape {tuple(row_ids.shape)}.")
    seed = int(seed) & (2**64 - 1)
    seed = seed - 2**64 if seed >= 2**63 else seed  # the schema's int is signed; the kernel reads the bits
    if choose_backend("sample_tokens", hidden.device, backend) == "reference":
        return reference.sample_tokens(hidden, lm_head_weight, row_ids, temperature, seed, offset, suppress_ids,
                                       confidence_exclude_ids)
    if chunk_size is None:
        chunk_size = default_chunk_size(N, V, hidden.device)
    return torch.ops.dllm_fast.sample_tokens(
        hidden.contiguous(), lm_head_weight.contiguous(), row_ids.long().contiguous(), float(temperature), seed,
        int(offset), suppress_ids, confidence_exclude_ids, chunk_size)


def select_transfer(
    confidence: torch.Tensor,
    candidates: torch.Tensor,
    *,
    counts: torch.Tensor | None = None,
    threshold: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Which candidate positions to unmask this step, per row, without a Python loop or a host sync.

    Args:
        confidence: [B, n] fp32/fp64 confidence of each position's sampled token.
        candidates: [B, n] bool, the still-masked positions of the current block.
        counts: [B] int64, unmask the counts[b] most confident candidates (ties to the lowest position).
        threshold: instead of counts, Fast-dLLM's rule: the most confident candidate plus every candidate with
            confidence >= threshold.

    Returns: [B, n] bool.
    """
    if confidence.dim() != 2 or candidates.shape != confidence.shape or candidates.dtype != torch.bool:
        raise ValueError(f"select_transfer: confidence must be [B, n] and candidates a bool tensor of that shape, "
                         f"got {tuple(confidence.shape)} and {candidates.dtype} {tuple(candidates.shape)}.")
    if (counts is None) == (threshold is None):
        raise ValueError("select_transfer: pass exactly one of counts (top-k) and threshold.")
    if threshold is not None:
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"select_transfer: threshold must be in (0, 1], got {threshold!r}.")
        counts = torch.zeros(confidence.shape[0], dtype=torch.long, device=confidence.device)
    elif counts.shape != (confidence.shape[0],):
        raise ValueError(f"select_transfer: counts must be [B] = [{confidence.shape[0]}], got {tuple(counts.shape)}.")
    if confidence.dtype not in (torch.float32, torch.float64):
        confidence = confidence.float()
    if choose_backend("select_transfer", confidence.device, backend) == "reference":
        return reference.select_transfer(confidence, candidates, counts.long(), threshold)
    return torch.ops.dllm_fast.select_transfer(
        confidence, candidates, counts.long(), -1.0 if threshold is None else float(threshold))


def _check_rows_and_head(op: str, hidden, weight) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"{op}: hidden must be [N, d] and lm_head_weight [V, d] with the same d, got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}.")
    if hidden.dtype not in _FLOAT_DTYPES or weight.dtype != hidden.dtype:
        raise TypeError(f"{op}: hidden and lm_head_weight must share one of {_FLOAT_DTYPES}, got {hidden.dtype} "
                        f"and {weight.dtype}.")
    if hidden.device != weight.device:
        raise ValueError(f"{op}: hidden is on {hidden.device} but lm_head_weight on {weight.device}.")


if HAS_EXTENSION:

    @torch.library.register_fake("dllm_fast::sample_tokens")
    def _sample_tokens_fake(hidden, weight, row_ids, temperature, seed, offset, suppress_ids, exclude_ids, chunk_size):
        rows = hidden.shape[0]
        acc = accumulate_dtype(hidden.dtype)
        return hidden.new_empty(rows, dtype=torch.long), hidden.new_empty(rows, dtype=acc)

    @torch.library.register_fake("dllm_fast::select_transfer")
    def _select_transfer_fake(confidence, candidates, counts, threshold):
        return torch.empty_like(candidates)
