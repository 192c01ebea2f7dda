"""The scoring micro-batch compiled whole: the model's forward, the gather of the scored rows and the fused LM
head in one torch.compile(fullgraph=True) graph (`MicroBatching(compile=True)`), for no-grad scoring, the
separable path, and the engine's pass 2 (forward, then the backward AOTAutograd derived with it).

What lets a few graphs serve every micro-batch and call:

- Everything data-dependent is computed outside the graph, eagerly: the pairs' noisy sequences, the scored rows
  (a `nonzero_static` of the count the engine read once per call) and where each row's lp goes. The graph
  receives index tensors only; no Python value in it depends on the masks.
- The pairs and the scored rows are padded to buckets (`bucket`: powers of two, capped by the micro-batch and by
  pairs x L), so a graph is compiled once per (pairs, rows) bucket, never per micro-batch. A padded pair repeats
  the micro-batch's first pair and scores nothing; a padded row repeats the first scored row (same hidden
  state, target and lp, so the LM head's normaliser stays exact) with a zero upstream gradient, and its lp goes
  to a discarded slot. Padding therefore contributes exactly nothing to lp or to any gradient.
- The sequence length is marked dynamic: prompts padded to a different length in the next call reuse the graph.
- The vocabulary chunk is resolved outside the graph for the padded row count (one Python int per bucket).

Pass 2's graph boundary: the graph is the forward (model, gather, `logprobs_with_known_gradient`) and returns the
surrogate; `surrogate.backward()` then runs the backward graph AOTAutograd compiled with it. `.backward()` itself
stays outside (inside a graph it would be a graph break, and the per-parameter AccumulateGrad that DDP/FSDP hooks
rely on belongs to the autograd engine). The LM head's gradient is added into its `.grad` in the forward graph
(the op's `Tensor(a!)` argument, functionalized by AOTAutograd and written back into the buffer), and trainable
embeddings add theirs in the backward graph: both buffers must exist before the graph runs (a graph cannot
create a parameter's `.grad`), so `ensure_grad_buffers` creates them first.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dllm_fast.contracts import logit_shift, unwrap_model
from dllm_fast.likelihood.blocks import denoising_hidden
from dllm_fast.likelihood.gradients import in_place_embeddings
from dllm_fast.likelihood.masks import MonteCarloMasks
from dllm_fast.ops import logprobs_with_known_gradient, masked_logprobs
from dllm_fast.ops.backend import resolve_chunk_size
from dllm_fast.ops.logprobs import trainable_leaf, weight_grad_buffer

# Graphs each compiled function may hold (dynamo's default is 8, then fullgraph fails): one per (pairs, rows)
# bucket, about log2(micro_batch) * log2(micro_batch * L) at most, and a few more per model or dtype.
COMPILED_SCORING_GRAPHS = 64


def bucket(count: int, cap: int) -> int:
    """The padded size of `count` items: the next power of two, but at most `cap` (which is itself a bucket)."""
    return min(1 << max(count - 1, 0).bit_length(), max(cap, count))


@dataclass
class PaddedPairs:
    """A micro-batch of pairs as a compiled graph takes it: shapes depend only on the buckets.

    noisy [b_pad, S], clean [b_pad, S] and attention_mask [b_pad, S] (or None): the model's inputs (a block model
    reads the clean sequence too, likelihood/blocks.py). hidden_rows [M_pad]: the row of
    the flattened hidden states [b_pad * S, d] that predicts each scored token; targets [M_pad]. slots [M_pad]:
    where each row's lp goes in the flattened [b_pad * L] output, b_pad * L (discarded) for padded rows.
    rows, positions [M]: the real scored rows' (pair, completion position). pairs: the b real pairs.
    """

    noisy: torch.Tensor
    clean: torch.Tensor
    attention_mask: torch.Tensor | None
    hidden_rows: torch.Tensor
    targets: torch.Tensor
    slots: torch.Tensor
    rows: torch.Tensor
    positions: torch.Tensor
    pairs: int
    chunk_size: int

    def padded(self, values: torch.Tensor, fill: torch.Tensor | float) -> torch.Tensor:
        """Per-row values [M] of the real rows, padded to [M_pad] with `fill`."""
        extra = self.hidden_rows.shape[0] - values.shape[0]
        if isinstance(fill, torch.Tensor):
            return torch.cat([values, fill.expand(extra)])
        return torch.cat([values, values.new_full((extra,), fill)])


def pad_pairs(model, sequences: torch.Tensor, masks: MonteCarloMasks, pairs: torch.Tensor, attention_mask,
              capacity: int, chunk_size: int | None, scored_count: int | None = None) -> PaddedPairs:
    """The noisy inputs and scored-row indices of `pairs`, padded to buckets (capacity: the most pairs a
    micro-batch of this call holds; scored_count: how many positions the pairs score, when the host knows it, so that
    finding them reads nothing back)."""
    n_t, P, L = masks.n_t, masks.prompt_length, masks.completion_length
    core = unwrap_model(model)
    pair_count = pairs.numel()
    padded_pairs = torch.cat([pairs, pairs[:1].expand(bucket(pair_count, capacity) - pair_count)])
    seq_index, sample_index = padded_pairs // n_t, padded_pairs % n_t
    tokens = sequences[seq_index]
    masked = masks.masked[seq_index, sample_index]
    noisy = tokens.masked_fill(masked, core.mask_token_id)
    mask = None if attention_mask is None else attention_mask[seq_index]
    S = tokens.shape[1]
    scored = masked[:pair_count, P:] & masks.counted[seq_index[:pair_count]]
    if scored_count is None:
        rows, positions = scored.nonzero(as_tuple=True)
    else:
        rows, positions = torch.nonzero_static(scored, size=scored_count).unbind(1)
    hidden_rows = rows * S + P + positions - logit_shift(core)
    targets = tokens[rows, P + positions]
    slots = rows * L + positions
    rows_padded = bucket(rows.numel(), padded_pairs.numel() * L)
    extra = rows_padded - rows.numel()
    first = (lambda index: index[:1].expand(extra)) if rows.numel() else (lambda index: index.new_zeros(extra))
    # The sequence length varies between calls (prompts padded to the batch's longest): one graph for all.
    torch._dynamo.maybe_mark_dynamic(noisy, 1)
    torch._dynamo.maybe_mark_dynamic(tokens, 1)
    if mask is not None:
        torch._dynamo.maybe_mark_dynamic(mask, 1)
    weight = core.lm_head_weight
    return PaddedPairs(
        noisy=noisy, clean=tokens, attention_mask=mask, hidden_rows=torch.cat([hidden_rows, first(hidden_rows)]),
        targets=torch.cat([targets, first(targets)]),
        slots=torch.cat([slots, slots.new_full((extra,), padded_pairs.numel() * L)]), rows=rows,
        positions=positions, pairs=pair_count,
        chunk_size=resolve_chunk_size("masked_logprobs", chunk_size, rows_padded, weight.shape[0], weight.device))


def score_padded(model, noisy, clean, attention_mask, hidden_rows, targets, slots, completion_length: int,
                 chunk_size: int, grad_into_weight: bool) -> torch.Tensor:
    """The graph of a scoring micro-batch: lp [b_pad, L] of the padded pairs (0 where nothing is scored)."""
    hidden = denoising_hidden(model, clean, noisy, attention_mask, noisy.shape[1] - completion_length)
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, hidden_rows)
    logp = masked_logprobs(rows, unwrap_model(model).lm_head_weight, targets, chunk_size=chunk_size,
                           grad_into_weight=grad_into_weight)
    out = logp.new_zeros(noisy.shape[0] * completion_length + 1).index_put((slots,), logp)
    return out[:-1].view(noisy.shape[0], completion_length)


def known_gradient_padded(model, noisy, clean, attention_mask, hidden_rows, targets, coef, lp,
                          completion_length: int, chunk_size: int) -> torch.Tensor:
    """The graph of a pass-2 micro-batch's forward: the surrogate whose backward completes the gradient of
    sum(coef * lp) (the LM head's part is added into its `.grad` here, in the forward)."""
    hidden = denoising_hidden(model, clean, noisy, attention_mask, noisy.shape[1] - completion_length)
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, hidden_rows)
    _, surrogate = logprobs_with_known_gradient(rows, unwrap_model(model).lm_head_weight, targets, coef, logp=lp,
                                                chunk_size=chunk_size)
    return surrogate


@functools.cache
def compiled(function_name: str, backend: str = "inductor"):
    """`score_padded` or `known_gradient_padded` compiled whole (fullgraph: a graph break is an error), once per
    process and backend. Tests pass backend="aot_eager" to check the capture without code generation.
    dynamic=False: only what pad_pairs marks (the sequence length) is dynamic; the buckets are static shapes, as
    CUDA graphs need. No mode="reduce-overhead" yet: CUDA graphs for these graphs are untested here."""
    function = {"score_padded": score_padded, "known_gradient_padded": known_gradient_padded}[function_name]
    return torch.compile(function, fullgraph=True, dynamic=False, backend=backend)


def graph_limit():
    """Dynamo's per-function graph limit raised to COMPILED_SCORING_GRAPHS while compiled scoring runs (named
    cache_size_limit before torch 2.6)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: max(getattr(config, name), COMPILED_SCORING_GRAPHS)})


def ensure_grad_buffers(model) -> None:
    """Create the `.grad` buffers the compiled graphs add into in place (a graph cannot create them): the LM
    head's and the in-place embeddings' (see gradients.embedding_grads_in_place), when trainable leaves."""
    core = unwrap_model(model)
    weights = [core.lm_head_weight] + [module.weight for module in in_place_embeddings(model)]
    for weight in weights:
        if trainable_leaf(weight):
            weight_grad_buffer(weight)


def score_pairs_compiled(model, sequences, masks, pairs, *, capacity: int, attention_mask=None, chunk_size=None,
                         grad_into_weight: bool = False, rows: int | None = None) -> torch.Tensor:
    """`scoring.score_pairs` through the compiled graph: lp rows [b, L] of the pairs (capacity: the most pairs
    a micro-batch of the call holds, the largest bucket; rows: as in `score_pairs`)."""
    batch = pad_pairs(model, sequences, masks, pairs, attention_mask, capacity, chunk_size, rows)
    if grad_into_weight and torch.is_grad_enabled():
        ensure_grad_buffers(model)
    with graph_limit():
        lp = compiled("score_padded")(model, batch.noisy, batch.clean, batch.attention_mask, batch.hidden_rows,
                                      batch.targets, batch.slots, masks.completion_length, batch.chunk_size,
                                      grad_into_weight)
    return lp[:batch.pairs]


def known_gradient_compiled(model, sequences, masks, pairs, coef, lp, *, capacity: int, attention_mask=None,
                            chunk_size=None, rows: int | None = None) -> torch.Tensor:
    """`scoring.score_pairs_with_known_gradient` through the compiled graph (coef, lp: [b, L]); returns the
    surrogate to backpropagate with a unit upstream gradient."""
    batch = pad_pairs(model, sequences, masks, pairs, attention_mask, capacity, chunk_size, rows)
    ensure_grad_buffers(model)
    row_coef = batch.padded(coef[batch.rows, batch.positions], 0.0)  # padded rows: no gradient
    row_lp = lp[batch.rows, batch.positions]
    row_lp = batch.padded(row_lp, row_lp[:1] if row_lp.numel() else 0.0)  # the first row's, as its hidden state
    with graph_limit():
        return compiled("known_gradient_padded")(model, batch.noisy, batch.clean, batch.attention_mask,
                                                 batch.hidden_rows, batch.targets, row_coef, row_lp,
                                                 masks.completion_length, batch.chunk_size)
