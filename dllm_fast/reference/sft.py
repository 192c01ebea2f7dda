"""Plain-PyTorch twin of dllm_fast.sft.sft_loss: LLaDA's SFT loss as its guidelines write it, over full logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dllm_fast.contracts import accumulate_dtype


def sft_loss(model, sequences: torch.Tensor, masks, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """mean_b (1/L) sum_{masked i} CE(logits[b, i], x[b, i]) / p_b, with `masks` any object with
    MonteCarloMasks' fields (masked [B, 1, P + L], t [B, 1] holding p, prompt_length)."""
    masked = masks.masked[:, 0]
    p = masks.t[:, 0]
    noisy = sequences.masked_fill(masked, model.mask_token_id)
    logits = F.linear(model(noisy, attention_mask=attention_mask), model.lm_head_weight)
    logits = logits.to(accumulate_dtype(logits.dtype))
    rows, positions = masked.nonzero(as_tuple=True)
    token_loss = F.cross_entropy(logits[rows, positions], sequences[rows, positions], reduction="none")
    answer_length = sequences.shape[1] - masks.prompt_length
    return (token_loss / p[rows].to(token_loss.dtype)).sum() / answer_length / sequences.shape[0]
