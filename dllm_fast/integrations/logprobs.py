"""Per-token diffusion log-probs for host trainers whose hooks expect one log-prob per completion token (TRL's
`_get_per_token_logps_and_entropies`, a VeRL actor's `compute_log_prob`).

d1's one-step mean-field estimate: the whole completion masked, each real prompt token masked with a small
probability, one forward. The masks of a row are a function of its tokens and a seed, so the old, reference and
current policies score a completion on the same masks however the rows are batched: on-policy ratios are exactly 1.
"""

from __future__ import annotations

import torch

from dllm_fast.likelihood import MonteCarloMasks, draw_masks, score
from dllm_fast.likelihood.masks import sequence_fingerprint



def mean_field_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int, *,
                        perturb_prob: float, seed: int, micro_batch: int) -> torch.Tensor:
    """[B, L] log-probs of the last L tokens of each row under d1's one-step mean-field masks (the whole
    completion masked, each real prompt token with probability perturb_prob); 0 where attention_mask is 0.

    Row n's masks come from a generator seeded by (seed, the row's tokens), so any batching of the same rows
    gives the same masks. The model attends to the whole completion, as during sampling.
    """
    B, S = input_ids.shape
    P = S - completion_length
    counted = attention_mask[:, P:].bool()
    prompt_real = attention_mask[:, :P].bool()
    logps = torch.zeros(B, completion_length, dtype=torch.float32, device=input_ids.device)
    rows = counted.any(-1).nonzero().squeeze(-1).tolist()
    if not rows:
        return logps
    fingerprints = sequence_fingerprint(input_ids).tolist()
    per_row = [draw_masks("mean_field", counted[n:n + 1], 1, prompt_real=prompt_real[n:n + 1],
                          perturb_prob=perturb_prob,
                          generator=torch.Generator().manual_seed(hash((seed, *fingerprints[n])) % 2**63))
               for n in rows]
    masks = MonteCarloMasks(
        masked=torch.cat([m.masked for m in per_row]), counted=torch.cat([m.counted for m in per_row]),
        weight=torch.cat([m.weight for m in per_row]), t=torch.cat([m.t for m in per_row]),
        num_masked=torch.cat([m.num_masked for m in per_row]), prompt_length=P, sampler="mean_field")
    scoring_mask = attention_mask[rows].clone()
    scoring_mask[:, P:] = 1
    lp = score(model, input_ids[rows], masks, micro_batch=micro_batch, attention_mask=scoring_mask)
    return logps.index_put((torch.tensor(rows, device=input_ids.device),), lp[:, 0].to(logps.dtype))
