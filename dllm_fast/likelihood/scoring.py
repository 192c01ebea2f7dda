"""Per-token log-probs `lp[N, n_t, L]` of the completion tokens under stored masks, through the fused LM head.

A (sequence, sample) pair is the unit of work; pair p stands for sequence p // n_t, sample p % n_t. For a
micro-batch of pairs, scoring builds the noisy inputs, runs the model once on the batch (a block-diffusion model
in the two-stream layout, likelihood/blocks.py), keeps only the rows of
`hidden` that are masked and counted completion positions, and sends those rows alone through
`dllm_fast.masked_logprobs`: nothing of size [rows, V] beyond one vocabulary chunk ever exists.
"""

from __future__ import annotations

import torch

from dllm_fast.contracts import accumulate_dtype, data_parallel, logit_shift, unwrap_model
from dllm_fast.likelihood.blocks import denoising_hidden
from dllm_fast.likelihood.compiled import score_pairs_compiled
from dllm_fast.likelihood.masks import MonteCarloMasks
from dllm_fast.ops import logprobs_with_known_gradient, masked_logprobs
from dllm_fast.validation import check_bool, check_int


def score(
    model,
    sequences: torch.Tensor,
    masks: MonteCarloMasks,
    *,
    micro_batch: int,
    attention_mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
    compile: bool = False,
) -> torch.Tensor:
    """Log-probs of every completion token at every masked position, for all N * n_t pairs.

    Args:
        model: anything with the model contract: `model(input_ids, attention_mask=...) -> hidden [B, S, d]`,
            `model.lm_head_weight` [V, d] and `model.mask_token_id` (a PEFT-wrapped LLaDAModel qualifies; for a
            LoRA reference policy call this inside `with model.disable_adapter():`).
        sequences: [N, S] token ids, S = P + L; the completion is the last L positions.
        masks: the stored masks (`sample_masks`); the same object gives the same lp for any micro_batch.
        micro_batch: pairs per model call. Pairs with nothing to score are skipped.
        attention_mask: optional [N, S] (1 = token, 0 = left padding), passed to the model.
        chunk_size: vocabulary chunk of the fused LM head (default: sized for the device).
        compile: score each micro-batch through one torch.compile(fullgraph=True) graph, its pairs and scored
            rows padded to buckets (see `MicroBatching.compile`, likelihood/compiled.py).

    Under a data-parallel wrapper (DDP, FSDP2) and no_grad, every rank makes the same number of model calls.

    Returns:
        lp: [N, n_t, L] in fp32 (fp64 for an fp64 model); lp[n, j, i] = log p(x_i | noisy_{n,j}) where
        completion position i is masked and counted in sample j, and exactly 0 elsewhere. Under grad mode it
        is differentiable and keeps every micro-batch's graph; `streaming_backward` is the constant-memory way
        to differentiate through it.
    """
    check_inputs(model, sequences, masks, attention_mask=attention_mask, micro_batch=micro_batch)
    check_bool("compile", compile)
    N, n_t, L = masks.num_sequences, masks.n_t, masks.completion_length
    dtype = accumulate_dtype(unwrap_model(model).lm_head_weight.dtype)
    pairs = active_pairs(masks)

    def score_batch(batch):
        if compile:
            return score_pairs_compiled(model, sequences, masks, batch, capacity=micro_batch,
                                        attention_mask=attention_mask, chunk_size=chunk_size)
        return score_pairs(model, sequences, masks, batch, attention_mask=attention_mask, chunk_size=chunk_size)

    if not torch.is_grad_enabled():
        lp = torch.zeros(N * n_t, L, dtype=dtype, device=sequences.device)
        batches = pairs.split(micro_batch)
        for batch in batches:
            lp[batch] = score_batch(batch)
        for _ in range(aligned_call_count(len(batches), sequences.device, data_parallel(model)) - len(batches)):
            score_batch(batches[-1])
        return lp.view(N, n_t, L)
    rows = [score_batch(batch) for batch in pairs.split(micro_batch)]
    if not rows:
        return torch.zeros(N, n_t, L, dtype=dtype, device=sequences.device)
    lp = torch.zeros(N * n_t, L, dtype=dtype, device=sequences.device).index_put((pairs,), torch.cat(rows))
    return lp.view(N, n_t, L)


def score_pairs(
    model,
    sequences: torch.Tensor,
    masks: MonteCarloMasks,
    pairs: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
    grad_into_weight: bool = False,
) -> torch.Tensor:
    """lp rows of some (sequence, sample) pairs: pairs [b] int64 (p = n * n_t + j) -> [b, L].

    One model call on the b noisy sequences; differentiable under grad mode. grad_into_weight: the LM head's
    gradient goes straight into its `.grad` in the backward (see `masked_logprobs`). Inputs are not re-checked
    (see `score` and `check_inputs`).
    """
    hidden, weight, targets, scored, rows, positions = _scored_rows(model, sequences, masks, pairs, attention_mask)
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's pass 2 for some pairs, whose d loss / d lp (coef [b, L]) and lp (lp [b, L], scored earlier on
    the same masks) are known: one model call, the LM head's gradient computed in the forward and its weight's
    part added into `.grad` (`logprobs_with_known_gradient`). Returns (surrogate, lp rows [b, L] of this
    forward): `surrogate.backward()` (unit upstream gradient) completes the gradient of (coef * lp).sum().
    """
    hidden, weight, targets, scored, rows, positions = _scored_rows(model, sequences, masks, pairs, attention_mask)
    logp, surrogate = logprobs_with_known_gradient(hidden, weight, targets, coef[rows, positions],
                                                   logp=lp[rows, positions], chunk_size=chunk_size)
    return surrogate, _pair_rows(scored, rows, positions, logp)


def _scored_rows(model, sequences, masks, pairs, attention_mask):
    """One model call on the pairs' noisy sequences; the hidden rows that predict their scored tokens [M, d], the
    LM head, the targets [M], the pairs' scored positions [b, L] and the (row, position) of each of the M rows."""
    n_t, P = masks.n_t, masks.prompt_length
    core = unwrap_model(model)  # forwards go through a DDP wrapper; attributes live on the module
    seq_index, sample_index = pairs // n_t, pairs % n_t
    tokens = sequences[seq_index]
    masked = masks.masked[seq_index, sample_index]
    noisy = tokens.masked_fill(masked, core.mask_token_id)
    hidden = denoising_hidden(model, tokens, noisy, None if attention_mask is None else attention_mask[seq_index], P)
    scored = masked[:, P:] & masks.counted[seq_index]
    rows, positions = scored.nonzero(as_tuple=True)
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


def check_inputs(model, sequences, masks, *, attention_mask=None, micro_batch=None) -> None:
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
    if micro_batch is not None:
        check_int("micro_batch", micro_batch, minimum=1, hint="(sequence, sample) pairs per model call")
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
