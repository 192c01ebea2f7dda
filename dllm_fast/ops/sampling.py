"""sample_tokens and select_transfer: the typed faces of the block-diffusion sampling ops (input checks, fake
kernels)."""

from __future__ import annotations

import torch

from dllm_fast._extension import HAS_EXTENSION
from dllm_fast.contracts import accumulate_dtype
from dllm_fast.ops import twins
from dllm_fast.ops.backend import FLOAT_DTYPES, choose_backend, resolve_chunk_size
from dllm_fast.validation import (
    check_bool, check_int, check_same_device, check_temperature, check_threshold, data_checks_enabled,
)

MAX_TOKEN_IDS = 8  # per id list of sample_tokens: csrc/cuda/sampling.cuh's TokenList::kCapacity


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
    check_finite: bool = True,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from softmax(hidden @ W.T / T) and report its confidence, in one pass over V.

    Args:
        hidden: [N, d] hidden states of the positions to decode; lm_head_weight: [V, d], same dtype/device.
        temperature: 0 means argmax (ties to the lowest id); T > 0 is Gumbel-max, an exact sample, scored as
            logit + T * noise (T < 1) or logit / T + noise (T >= 1), which no temperature overflows. T below
            validation.GREEDY_BELOW_TEMPERATURE (1e-30) is greedy; T must be finite (a large T samples
            near-uniformly among the tokens not suppressed).
        seed, offset, row_ids: the noise of row i and token j is Philox4x32-10 keyed by (seed, offset,
            row_ids[i], j) (row_ids default 0..N-1; offset in [0, 2^32)), so results are reproducible and
            independent of batching.
        suppress_ids: token ids removed from sampling and from the confidence softmax (e.g. EOS).
        confidence_exclude_ids: token ids removed from the confidence softmax only; a row that samples one of
            them gets confidence 0. Each list holds at most 8 distinct ids, on every device (the CUDA kernel
            takes them by value).
        chunk_size: vocabulary columns per chunk (default: sized for the device; more than V means V).
        check_finite: raise ValueError naming the first row whose hidden state or logits hold NaN or inf
            (a NaN logit is never sampled but makes the confidence NaN). On CUDA this costs a host sync; with
            False such rows come back, on every device, with confidence NaN, or token -1 when no score is
            finite, for the caller to check (generate does so once per block).

    Returns:
        tokens [N] int64, and confidence [N] fp32 (fp64 for fp64 inputs): softmax(hidden @ W.T)[token] under the
        unscaled logits. Neither carries a gradient: inputs that require one are read as constants.
    """
    _check_rows_and_head("sample_tokens", hidden, lm_head_weight, row_ids=row_ids)
    temperature = check_temperature("sample_tokens: temperature", temperature)
    check_int("sample_tokens: seed", seed)
    check_int("sample_tokens: offset", offset, minimum=0, maximum=2**32 - 1, hint="a Philox counter word")
    check_bool("sample_tokens: check_finite", check_finite)
    N, V = hidden.shape[0], lm_head_weight.shape[0]
    suppress_ids = _token_ids("sample_tokens: suppress_ids", suppress_ids, V)
    confidence_exclude_ids = _token_ids("sample_tokens: confidence_exclude_ids", confidence_exclude_ids, V)
    if len(suppress_ids) >= V:
        raise ValueError("sample_tokens: every token is suppressed; nothing is left to sample.")
    for name, ids in (("suppress_ids", suppress_ids), ("confidence_exclude_ids", confidence_exclude_ids)):
        if len(ids) > MAX_TOKEN_IDS:
            raise ValueError(f"sample_tokens: {name} holds {len(ids)} distinct ids; at most {MAX_TOKEN_IDS} on every "
                             "device (the CUDA kernel takes them by value).")
    # Sampling has no gradient (tokens are integers, the confidence steers decoding only): weights that train
    # are read as constants, as under torch.no_grad, on every backend.
    hidden, lm_head_weight = hidden.detach(), lm_head_weight.detach()
    if row_ids is None:
        row_ids = torch.arange(N, device=hidden.device)
    if check_finite:
        _check_finite_rows(hidden)
    seed = seed & (2**64 - 1)
    seed = seed - 2**64 if seed >= 2**63 else seed  # the schema's int is signed; the kernel reads the bits
    if choose_backend("sample_tokens", hidden.device, backend) == "reference":
        tokens, confidence = twins.sample_tokens(hidden, lm_head_weight, row_ids, temperature, seed, offset,
                                                     suppress_ids, confidence_exclude_ids)
    else:
        tokens, confidence = torch.ops.dllm_fast.sample_tokens(
            hidden.contiguous(), lm_head_weight.contiguous(), row_ids.long().contiguous(), temperature, seed,
            offset, suppress_ids, confidence_exclude_ids, resolve_chunk_size("sample_tokens", chunk_size, N, V, hidden.device))
    if check_finite:
        _check_finite_logits(tokens, confidence, hidden, lm_head_weight, suppress_ids)
    return tokens, confidence


def _token_ids(name: str, ids, vocab: int) -> list[int]:
    """The distinct ids, in order of first appearance, each checked against the vocabulary."""
    if isinstance(ids, torch.Tensor):
        ids = ids.reshape(-1).tolist()
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{name} takes a list of token ids (e.g. [{ids!r}] for one id), got {type(ids).__name__} "
                        f"{ids!r}.")
    ids = [token.item() if isinstance(token, torch.Tensor) and token.numel() == 1 else token for token in ids]
    for i, token in enumerate(ids):
        check_int(f"{name}[{i}]", token, minimum=0, maximum=vocab - 1,
                  hint=f"a token id of the vocabulary [0, {vocab})")
    return list(dict.fromkeys(int(token) for token in ids))


def _check_finite_rows(hidden: torch.Tensor) -> None:
    finite = torch.isfinite(hidden).all(dim=1)
    if not finite.all():
        row = int((~finite).nonzero()[0])
        raise ValueError(f"sample_tokens: hidden[{row}] holds NaN or inf, so row {row} has no finite logit; check "
                         "the model's output (e.g. fp16 overflow).")


def _check_finite_logits(tokens, confidence, hidden, weight, suppress_ids) -> None:
    """Raise naming the first row whose confidence is NaN (a NaN or +inf logit) or that sampled nothing."""
    bad = confidence.isnan() | (tokens < 0)
    if not bad.any():
        return
    row = int(bad.nonzero()[0])
    acc = accumulate_dtype(hidden.dtype)
    logits = weight.to(acc) @ hidden[row].to(acc)
    logits[suppress_ids] = 0.0  # removed before the softmax: cannot be the cause
    culprits = (~torch.isfinite(logits)).nonzero()
    cause = "its logits are not finite"
    if len(culprits):
        token = int(culprits[0])
        cause = (f"its logit of token {token} is {float(logits[token])} (lm_head_weight[{token}] holds NaN or inf, "
                 "or the product overflowed)")
    raise ValueError(f"sample_tokens: row {row} has a non-finite confidence: {cause}; every logit must be finite.")


def select_transfer(
    confidence: torch.Tensor,
    candidates: torch.Tensor,
    *,
    counts: torch.Tensor | None = None,
    threshold: float | None = None,
    check_finite: bool = True,
    backend: str | None = None,
) -> torch.Tensor:
    """Which candidate positions to unmask this step, per row, without a Python loop or a host sync.

    Args:
        confidence: [B, n] fp32/fp64 confidence of each position's sampled token.
        candidates: [B, n] bool, the still-masked positions of the current block.
        counts: [B] integer >= 0, unmask the counts[b] most confident candidates (ties to the lowest position);
            a count above a row's number of candidates unmasks them all. Verified non-negative where values may
            be read (not under torch.compile, fake tensors or `values_checked()`, where the kernels take a
            negative count as 0).
        threshold: instead of counts, Fast-dLLM's rule: the most confident candidate plus every candidate with
            confidence >= threshold, in (0, 1].
        check_finite: raise ValueError naming the first candidate whose confidence is NaN (costs a host sync on
            CUDA). With False, a NaN confidence ranks below every number (as -inf, by position among equals).

    Returns: [B, n] bool.
    """
    check_same_device("select_transfer", confidence=confidence, candidates=candidates, counts=counts)
    if confidence.dim() != 2 or candidates.shape != confidence.shape or candidates.dtype != torch.bool:
        raise ValueError(f"select_transfer: confidence must be [B, n] and candidates a bool tensor of that shape, "
                         f"got {tuple(confidence.shape)} and {candidates.dtype} {tuple(candidates.shape)}.")
    if not confidence.is_floating_point():
        raise TypeError(f"select_transfer: confidence must be a float tensor, got {confidence.dtype}.")
    if (counts is None) == (threshold is None):
        raise ValueError("select_transfer: pass exactly one of counts (top-k) and threshold.")
    check_bool("select_transfer: check_finite", check_finite)
    if threshold is not None:
        threshold = check_threshold("select_transfer: threshold", threshold)
        counts = torch.zeros(confidence.shape[0], dtype=torch.long, device=confidence.device)
    elif counts.shape != (confidence.shape[0],) or counts.is_floating_point() or counts.dtype == torch.bool:
        raise ValueError(f"select_transfer: counts must be an integer [B] = [{confidence.shape[0]}] tensor, got "
                         f"{counts.dtype} {tuple(counts.shape)}.")
    elif data_checks_enabled(counts) and bool((counts < 0).any()):
        row = int((counts < 0).nonzero()[0])
        raise ValueError(f"select_transfer: counts[{row}] = {int(counts[row])} is negative; each row unmasks counts[b] "
                         ">= 0 candidates (0 unmasks none).")
    if confidence.dtype not in (torch.float32, torch.float64):
        confidence = confidence.float()
    if check_finite:
        bad = confidence.isnan() & candidates
        if bad.any():
            row, position = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"select_transfer: confidence[{row}, {position}] is NaN; confidences must be numbers "
                             "(pass check_finite=False to rank NaN last).")
    if choose_backend("select_transfer", confidence.device, backend) == "reference":
        return twins.select_transfer(confidence, candidates, counts.long(), threshold)
    return torch.ops.dllm_fast.select_transfer(
        confidence, candidates, counts.long(), -1.0 if threshold is None else threshold)


def _check_rows_and_head(op: str, hidden, weight, **others) -> None:
    check_same_device(op, hidden=hidden, lm_head_weight=weight, **others)
    if hidden.dim() != 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"{op}: hidden must be [N, d] and lm_head_weight [V, d] with the same d, got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}.")
    if hidden.shape[1] == 0 or weight.shape[0] == 0:
        raise ValueError(f"{op}: the hidden width d and the vocabulary V must be positive, got d = {hidden.shape[1]} "
                         f"and V = {weight.shape[0]}.")
    if hidden.dtype not in FLOAT_DTYPES or weight.dtype != hidden.dtype:
        raise TypeError(f"{op}: hidden and lm_head_weight must share one of {FLOAT_DTYPES}, got {hidden.dtype} "
                        f"and {weight.dtype}.")
    row_ids = others.get("row_ids")
    if row_ids is not None and (row_ids.shape != (hidden.shape[0],) or row_ids.is_floating_point()
                                or row_ids.dtype == torch.bool):
        raise ValueError(f"{op}: row_ids must be an integer [N] = [{hidden.shape[0]}] tensor, got {row_ids.dtype} "
                         f"of shape {tuple(row_ids.shape)}.")


if HAS_EXTENSION:

    @torch.library.register_fake("dllm_fast::sample_tokens")
    def _sample_tokens_fake(hidden, weight, row_ids, temperature, seed, offset, suppress_ids, exclude_ids, chunk_size):
        rows = hidden.shape[0]
        acc = accumulate_dtype(hidden.dtype)
        return hidden.new_empty(rows, dtype=torch.long), hidden.new_empty(rows, dtype=acc)

    @torch.library.register_fake("dllm_fast::select_transfer")
    def _select_transfer_fake(confidence, candidates, counts, threshold):
        return torch.empty_like(candidates)
