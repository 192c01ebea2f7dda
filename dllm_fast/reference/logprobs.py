"""Plain-PyTorch twin of the fused masked log-prob op: the whole [M, V] logits, then log-softmax and gather."""

from __future__ import annotations

import torch

from dllm_fast.contracts import accumulate_dtype


def masked_logprobs(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logp[i] = log_softmax(hidden[i] @ lm_head_weight.T)[targets[i]], computed in fp32 (fp64 for fp64); NaN for
    a target outside [0, V), as in the kernels."""
    acc = accumulate_dtype(hidden.dtype)
    logits = hidden.to(acc) @ lm_head_weight.to(acc).T
    targets = targets.long()
    inside = (targets >= 0) & (targets < logits.shape[-1])
    logp = torch.log_softmax(logits, dim=-1).gather(-1, torch.where(inside, targets, 0)[:, None]).squeeze(-1)
    return logp.masked_fill(~inside, float("nan"))


def masked_logprobs_grad(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor,
                         grad_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, grad_hidden, grad_weight) of sum(grad_logp * logp) by autograd through the full logits; the
    gradients in the inputs' dtypes."""
    acc = accumulate_dtype(hidden.dtype)
    with torch.enable_grad():
        h = hidden.detach().to(acc).requires_grad_(True)
        w = lm_head_weight.detach().to(acc).requires_grad_(True)
        logp = masked_logprobs(h, w, targets)
        grad_hidden, grad_weight = torch.autograd.grad((grad_logp.detach().to(acc) * logp).sum(), (h, w))
    return logp.detach(), grad_hidden.to(hidden.dtype), grad_weight.to(lm_head_weight.dtype)
