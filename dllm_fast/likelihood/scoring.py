"""Per-token log-probs `lp[N, n_t, L]` of the completion tokens under stored masks, through the fused LM head.

A (sequence, sample) pair is the unit of work; pair p stands for sequence p // n_t, sample p % n_t. For a
micro-batch of pairs, scoring builds the noisy inputs, runs the model once on the batch (a block-diffusion model
in the two-stream layout, likelihood/blocks.py), keeps only the rows of
`hidden` that are masked and counted completion positions, and sends those rows alone through
`dllm_fast.masked_logprobs`: nothing of size [rows, V] beyond one vocabulary chunk ever exists.

Host syncs: the micro-batches of a call are cut on the host from one read of every pair's scored count
(`pair_batches`), so each micro-batch's scored rows are gathered with a size the host already knows
(`nonzero_static`) and its model call reads nothing back. A model with its own token-id check
(`check_input_ids`, which reads the ids) has it run once on the call's sequences, then not again per micro-batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from dllm_fast.contracts import (accumulate_dtype, check_positions, data_parallel, logit_shift, mixed_dtypes_named,
                                 unwrap_model)
from dllm_fast.likelihood.blocks import denoising_hidden
from dllm_fast.likelihood.compiled import score_pairs_compiled
from dllm_fast.likelihood.masks import MonteCarloMasks
from dllm_fast.likelihood.settings import MicroBatching
from dllm_fast.ops import logprobs_with_known_gradient, masked_logprobs
from dllm_fast.validation import data_checks_enabled, values_checked


def score(
    model,
    sequences: torch.Tensor,
    masks: MonteCarloMasks,
    *,
    micro_batch: int | MicroBatching,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probs of every completion token at every masked position, for all N * n_t pairs.

    Args:
        model: anything with the model contract: `model(input_ids, attention_mask=...) -> hidden [B, S, d]`,
            `model.lm_head_weight` [V, d] and `model.mask_token_id` (a PEFT-wrapped LLaDAModel qualifies; for a
            LoRA reference policy call this inside `with model.disable_adapter():`).
        sequences: [N, S] token ids, S = P + L; the completion is the last L positions.
        masks: the stored masks (`sample_masks`); the same object gives the same lp for any micro_batch.
        micro_batch: pairs per model call, or a `MicroBatching`: its `scoring` pairs per call under no_grad (its
            `micro_batch` under grad mode, where every call's graph is kept), its `chunk_size` (the fused LM
            head's vocabulary chunk) and `compile` (each call one torch.compile(fullgraph=True) graph, its pairs
            and scored rows padded to buckets, likelihood/compiled.py). Pairs with nothing to score are skipped.
        attention_mask: optional [N, S] (1 = token, 0 = left padding), passed to the model.

    Under a data-parallel wrapper (DDP, FSDP2) and no_grad, every rank makes the same number of model calls.
    Bounds (refused naming the value and the fix): S within the model's positions (`max_sequence_length`, when it
    declares it); N * n_t pairs within contracts.MAX_PAIRS (2^20), which `sample_masks` enforces.

    Returns:
        lp: [N, n_t, L] in fp32 (fp64 for an fp64 model); lp[n, j, i] = log p(x_i | noisy_{n,j}) where
        completion position i is masked and counted in sample j, and exactly 0 elsewhere. Under grad mode it
        is differentiable and keeps every micro-batch's graph; `streaming_backward` is the constant-memory way
        to differentiate through it.
    """
    batching = MicroBatching.of(micro_batch)
    check_inputs(model, sequences, masks, attention_mask=attention_mask)
    N, n_t, L = masks.num_sequences, masks.n_t, masks.completion_length
    dtype = accumulate_dtype(unwrap_model(model).lm_head_weight.dtype)
    per_call = batching.micro_batch if torch.is_grad_enabled() else batching.scoring
    batches = pair_batches(masks, per_call)

    def score_batch(batch: PairBatch):
        with mixed_dtypes_named(model):
            return score_batch_of_pairs(model, sequences, masks, batch, batching, capacity=per_call,
                                        attention_mask=attention_mask)

    with ids_checked_once(model, sequences):
        if not torch.is_grad_enabled():
            lp = torch.zeros(N * n_t, L, dtype=dtype, device=sequences.device)
            # agreed before the first call: under FSDP2 a rank's forwards gather, so a count agreed after them
            # would meet another rank still in its forwards (a rank skips the pairs that score nothing)
            calls = aligned_call_count(len(batches), sequences.device, data_parallel(model))
            for batch in batches:
                lp[batch.pairs] = score_batch(batch)
            for _ in range(calls - len(batches)):
                score_batch(batches[-1])
            return lp.view(N, n_t, L)
        rows = [score_batch(batch) for batch in batches]
    if not rows:
        return torch.zeros(N, n_t, L, dtype=dtype, device=sequences.device)
    pairs = torch.cat([batch.pairs for batch in batches])
    lp = torch.zeros(N * n_t, L, dtype=dtype, device=sequences.device).index_put((pairs,), torch.cat(rows))
    return lp.view(N, n_t, L)


@dataclass(frozen=True)
class PairBatch:
    """One micro-batch of (sequence, sample) pairs: their indices [b] (p = n * n_t + j) on the masks' device and
    on the host (`indices`), and `rows`, how many positions they score in all (the fused LM head's row count)."""

    pairs: torch.Tensor
    indices: tuple[int, ...]
    rows: int


def pair_batches(masks: MonteCarloMasks, micro_batch: int, among: torch.Tensor | None = None) -> list[PairBatch]:
    """The pairs that score at least one position (and, given `among` [N * n_t] bool, are among those), in order,
    cut into micro-batches of `micro_batch` pairs. One host read for the whole call (every pair's count)."""
    counts = masks.scored.reshape(-1, masks.completion_length).sum(-1)
    if among is not None:
        counts = torch.where(among, counts, torch.zeros((), dtype=counts.dtype, device=counts.device))
    counts = counts.tolist()
    active = [pair for pair, count in enumerate(counts) if count]
    pairs = torch.tensor(active, dtype=torch.int64).to(masks.scored.device)
    batches = []
    for first in range(0, len(active), micro_batch):
        indices = tuple(active[first:first + micro_batch])
        batches.append(PairBatch(pairs[first:first + micro_batch], indices, sum(counts[p] for p in indices)))
    return batches


def sequence_batches(masks: MonteCarloMasks, micro_batch: int, among: torch.Tensor | None = None) -> list[PairBatch]:
    """The pairs that score at least one position, of the sequences `among` ([N] bool; None: every sequence), in
    order, cut into micro-batches of whole sequences: each holds every such pair of its sequences, at most
    `micro_batch` pairs in all (micro_batch >= n_t). One host read."""
    if micro_batch < masks.n_t:
        raise ValueError(f"micro_batch={micro_batch} cannot hold a sequence's n_t={masks.n_t} samples.")
    n_t, L = masks.n_t, masks.completion_length
    counts = masks.scored.reshape(-1, L).sum(-1)
    if among is not None:
        counts = torch.where(among.repeat_interleave(n_t), counts, torch.zeros((), dtype=counts.dtype,
                                                                               device=counts.device))
    counts = counts.tolist()
    groups: list[list[int]] = [[]]
    for sequence in range(masks.num_sequences):
        active = [pair for pair in range(sequence * n_t, (sequence + 1) * n_t) if counts[pair]]
        if len(groups[-1]) + len(active) > micro_batch:
            groups.append([])
        groups[-1] += active
    pairs = torch.tensor([pair for group in groups for pair in group], dtype=torch.int64).to(masks.scored.device)
    batches, first = [], 0
    for group in filter(None, groups):
        batches.append(PairBatch(pairs[first:first + len(group)], tuple(group), sum(counts[p] for p in group)))
        first += len(group)
    return batches


def score_batch_of_pairs(model, sequences: torch.Tensor, masks: MonteCarloMasks, batch: PairBatch,
                         batching: MicroBatching, *, capacity: int, attention_mask: torch.Tensor | None = None,
                         grad_into_weight: bool = False) -> torch.Tensor:
    """lp rows [b, L] of one micro-batch of pairs, eager or through the compiled graph (`batching.compile`), the
    LM head in `batching.chunk_size` chunks. capacity: the most pairs a micro-batch of the call holds (the
    compiled path's largest bucket). grad_into_weight: as in `score_pairs`."""
    if batching.compile:
        return score_pairs_compiled(model, sequences, masks, batch.pairs, capacity=capacity,
                                    attention_mask=attention_mask, chunk_size=batching.chunk_size,
                                    grad_into_weight=grad_into_weight, rows=batch.rows)
    return score_pairs(model, sequences, masks, batch.pairs, attention_mask=attention_mask,
                       chunk_size=batching.chunk_size, grad_into_weight=grad_into_weight, rows=batch.rows)


@contextlib.contextmanager
def ids_checked_once(model, sequences: torch.Tensor):
    """Run the model's own token-id check (`check_input_ids`, one host read; the model runs it on CPU inputs) on
    the call's sequences once, then skip it in the call's model calls (`values_checked`): every micro-batch's
    noisy inputs are these sequences with some positions set to the mask id."""
    check = getattr(unwrap_model(model), "check_input_ids", None)
    if check is None or sequences.device.type != "cpu" or not data_checks_enabled(sequences):
        yield
        return
    check(sequences)
    with values_checked():
        yield


def score_pairs(
    model,
    sequences: torch.Tensor,
    masks: MonteCarloMasks,
    pairs: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
    grad_into_weight: bool = False,
    rows: int | None = None,
) -> torch.Tensor:
    """lp rows of some (sequence, sample) pairs: pairs [b] int64 (p = n * n_t + j) -> [b, L].

    One model call on the b noisy sequences; differentiable under grad mode. grad_into_weight: the LM head's
    gradient goes straight into its `.grad` in the backward (see `masked_logprobs`). rows: how many positions
    the pairs score (`PairBatch.rows`), so that gathering them reads nothing back; None: counted (a host sync).
    Inputs are not re-checked (see `score` and `check_inputs`).
    """
    hidden, weight, targets, scored, rows, positions = _scored_rows(model, sequences, masks, pairs, attention_mask,
                                                                    rows)
    logp = masked_logprobs(hidden, weight, targets, chunk_size=chunk_size, grad_into_weight=grad_into_weight)
    return _pair_rows(scored, rows, positions, logp)


def score_pairs_with_known_gradient(
    model,
    sequences: torch.Tensor,
    masks: MonteCarloMasks,
    pairs: torch.Tensor,
    coef: torch.Tensor,
    lp: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
    rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's pass 2 for some pairs, whose d loss / d lp (coef [b, L]) and lp (lp [b, L], scored earlier on
    the same masks) are known: one model call, the LM head's gradient computed in the forward and its weight's
    part added into `.grad` (`logprobs_with_known_gradient`). Returns (surrogate, lp rows [b, L] of this
    forward): `surrogate.backward()` (unit upstream gradient) completes the gradient of (coef * lp).sum().
    rows: as in `score_pairs`.
    """
    hidden, weight, targets, scored, rows, positions = _scored_rows(model, sequences, masks, pairs, attention_mask,
                                                                    rows)
    logp, surrogate = logprobs_with_known_gradient(hidden, weight, targets, coef[rows, positions],
                                                   logp=lp[rows, positions], chunk_size=chunk_size)
    return surrogate, _pair_rows(scored, rows, positions, logp)


def _scored_rows(model, sequences, masks, pairs, attention_mask, count: int | None = None):
    """One model call on the pairs' noisy sequences; the hidden rows that predict their scored tokens [M, d], the
    LM head, the targets [M], the pairs' scored positions [b, L] and the (row, position) of each of the M rows.
    count: M when the host knows it (no sync), else None."""
    n_t, P = masks.n_t, masks.prompt_length
    core = unwrap_model(model)  # forwards go through a DDP wrapper; attributes live on the module
    seq_index, sample_index = pairs // n_t, pairs % n_t
    tokens = sequences[seq_index]
    masked = masks.masked[seq_index, sample_index]
    noisy = tokens.masked_fill(masked, core.mask_token_id)
    hidden = denoising_hidden(model, tokens, noisy, None if attention_mask is None else attention_mask[seq_index], P)
    scored = masked[:, P:] & masks.counted[seq_index]
    if count is None:
        rows, positions = scored.nonzero(as_tuple=True)
    else:  # row-major like nonzero, of a size the host knows: no sync
        rows, positions = torch.nonzero_static(scored, size=count).unbind(1)
    # Token i is predicted by the hidden state at i - logit_shift (0 for LLaDA, 1 for Dream-style models). The
    # head is read after the forward: under FSDP2 that is the unsharded parameter.
    return (hidden[rows, P + positions - logit_shift(core)], core.lm_head_weight, tokens[rows, P + positions],
            scored, rows, positions)


def _pair_rows(scored, rows, positions, logp):
    out = torch.zeros(scored.shape, dtype=logp.dtype, device=logp.device)
    return out.index_put((rows, positions), logp)


def aligned_call_count(count: int, device: torch.device, distributed: bool) -> int:
    """The most model calls any data-parallel rank makes for this step. FSDP gathers parameters in every forward
    (and DDP broadcasts buffers), so every rank must make the same number of calls; ranks with fewer pad with
    calls whose results are discarded. One tiny all-reduce; `count` itself in a single process."""
    if not distributed or not torch.distributed.is_initialized():
        return count
    most = torch.tensor([count], device=device)
    torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
    return int(most.item())


def active_pairs(masks: MonteCarloMasks) -> torch.Tensor:
    """[A] int64 pair indices (n * n_t + j) whose sample scores at least one position, in order."""
    return masks.scored.reshape(-1, masks.completion_length).any(-1).nonzero().squeeze(-1)


def check_inputs(model, sequences, masks, *, attention_mask=None) -> None:
    """Reject inputs that would silently give wrong log-probs, naming the value and the fix."""
    if not isinstance(masks, MonteCarloMasks):
        raise TypeError(f"masks must be a MonteCarloMasks (from dllm_fast.likelihood.sample_masks), "
                        f"got {type(masks).__name__}.")
    if not isinstance(sequences, torch.Tensor) or sequences.dim() != 2:
        shape = tuple(sequences.shape) if isinstance(sequences, torch.Tensor) else type(sequences).__name__
        raise ValueError(f"sequences must be a [N, P + L] tensor of token ids, got {shape}.")
    if sequences.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"sequences must hold int64 token ids, got {sequences.dtype}; use sequences.long().")
    expected = (masks.num_sequences, masks.masked.shape[2])
    if tuple(sequences.shape) != expected:
        raise ValueError(f"sequences has shape {tuple(sequences.shape)} but masks were drawn for {expected} "
                         "(N sequences of P + L tokens); draw masks for these sequences with sample_masks.")
    if masks.masked.device != sequences.device:
        raise ValueError(f"masks are on {masks.masked.device} but sequences on {sequences.device}; "
                         "use masks.to(sequences.device).")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(sequences.shape):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; it must match sequences, "
                         f"{tuple(sequences.shape)}.")
    check_positions(model, sequences.shape[1], f"sequences of {sequences.shape[1]} tokens",
                    "Score shorter sequences (roll out with a smaller gen_length, or shorten the prompts).")
    if logit_shift(model) > masks.prompt_length:
        raise ValueError(f"model.logit_shift={logit_shift(model)} needs a prompt of at least that many positions "
                         f"(prompt_length={masks.prompt_length}): the first completion token is predicted from "
                         "the position before it.")
    mask_id = unwrap_model(model).mask_token_id
    real = torch.ones_like(sequences, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    clash = (sequences == mask_id) & real
    if clash.any():
        n, position = (int(v) for v in clash.nonzero()[0])
        part = "prompt" if position < masks.prompt_length else "completion"
        raise ValueError(
            f"sequences[{n}, {position}] (in the {part}) is the mask token id {mask_id}; a clean sequence must "
            "not contain it (finish the rollout, or replace it / mark it as padding with attention_mask=0)."
        )
    masks.check_sequences(sequences)
