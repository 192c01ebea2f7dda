"""The old-policy scoring of dllm_fast's verl engine with the policy's predictive entropy, for verl's
`actor/entropy` (no verl import).

verl's trainer logs `actor/entropy` from the per-token entropies its actor returns with the old policy's
log-probs (compute_log_prob), averaged over the response tokens. A causal LM's entropy is that of its next-token
distribution at each response position; a masked diffusion LM predicts the masked positions of a noisy copy, so
here a position's entropy is that of the policy's prediction there, H = -sum_v p(v | noisy) log p(v | noisy),
averaged over the Monte Carlo samples whose mask scores the position (the objective's own masks, the same ones
the log-probs are scored on), and 0 at a position no sample scores (past the counted tokens, e.g. after the first
EOS). One model call per micro-batch gives both: the log-probs through the fused LM head, as `likelihood.score`
scores them (eager), and the entropies from the same hidden rows in plain PyTorch, the LM head's logits
materialised a chunk of rows at a time (`ENTROPY_CHUNK_ELEMENTS` logits per chunk): the LM head's matmul once
more, no extra model forward.
"""

from __future__ import annotations

import torch

from dllm_fast.contracts import accumulate_dtype, data_parallel, mixed_dtypes_named, unwrap_model
from dllm_fast.likelihood import MicroBatching
from dllm_fast.likelihood.masks import MonteCarloMasks
from dllm_fast.likelihood.scoring import (_pair_rows, _scored_rows, aligned_call_count, check_inputs,
                                          ids_checked_once, pair_batches)
from dllm_fast.ops import masked_logprobs

ENTROPY_CHUNK_ELEMENTS = 1 << 24  # logits materialised at once (64 MiB in fp32)


def row_entropies(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[M] the entropy of softmax(hidden @ weight.T) of each hidden row [M, d], in the fused head's accumulation
    dtype (fp32, fp64 for fp64) whatever autocast is active, a chunk of rows at a time."""
    dtype = accumulate_dtype(hidden.dtype)
    rows = max(1, ENTROPY_CHUNK_ELEMENTS // max(1, weight.shape[0]))
    head = weight.to(dtype)
    with torch.autocast(device_type=hidden.device.type, enabled=False):  # in `dtype`, as the fused head computes
        out = [torch.special.entr(torch.softmax(part.to(dtype) @ head.T, dim=-1)).sum(-1)
               for part in hidden.split(rows)]
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=dtype)


def score_with_entropy(model, sequences: torch.Tensor, masks: MonteCarloMasks, *, micro_batch: int | MicroBatching,
                       attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(lp [N, n_t, L], entropy [N, L]) without a graph: lp as `likelihood.score` gives it (eager), entropy the
    mean over the samples scoring each completion position of the policy's predictive entropy there (module
    docstring). Under a data-parallel wrapper every rank makes the same number of model calls."""
    if torch.is_grad_enabled():
        raise RuntimeError("score_with_entropy scores the old policy without a graph: call it under torch.no_grad().")
    batching = MicroBatching.of(micro_batch)
    check_inputs(model, sequences, masks, attention_mask=attention_mask)
    N, n_t, L = masks.num_sequences, masks.n_t, masks.completion_length
    dtype = accumulate_dtype(unwrap_model(model).lm_head_weight.dtype)
    batches = pair_batches(masks, batching.scoring)
    lp = torch.zeros(N * n_t, L, dtype=dtype, device=sequences.device)
    entropy = torch.zeros(N * n_t, L, dtype=dtype, device=sequences.device)

    def score_batch(batch):
        with mixed_dtypes_named(model):
            hidden, weight, targets, scored, rows, positions = _scored_rows(model, sequences, masks, batch.pairs,
                                                                            attention_mask, batch.rows)
            logp = masked_logprobs(hidden, weight, targets, chunk_size=batching.chunk_size)
            return _pair_rows(scored, rows, positions, logp), _pair_rows(scored, rows, positions,
                                                                         row_entropies(hidden, weight))

    with ids_checked_once(model, sequences):
        calls = aligned_call_count(len(batches), sequences.device, data_parallel(model))
        for batch in batches:
            lp[batch.pairs], entropy[batch.pairs] = score_batch(batch)
        for _ in range(calls - len(batches)):
            score_batch(batches[-1])
    samples = masks.scored.to(sequences.device).sum(1)  # [N, L]: the samples that score each position
    mean = entropy.view(N, n_t, L).sum(1) / samples.clamp_min(1).to(dtype)
    return lp.view(N, n_t, L), mean
