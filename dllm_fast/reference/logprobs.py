"""Plain-PyTorch twin of the fused masked log-prob op: the whole [M, V] logits, then log-softmax and gather."""

from __future__ import annotations

import torch

from dllm_fast.contracts import accumulate_dtype


def masked_logprobs(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logp[i] = log_softmax(hidden[i] @ lm_head_weight.T)[targets[i]], computed in fp32 (fp64 for fp64)."""
    acc = accumulate_dtype(hidden.dtype)
    logits = hidden.to(acc) @ lm_head_weight.to(acc).T
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.long()[:, None]).squeeze(-1)
