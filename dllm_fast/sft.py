"""Masked-diffusion supervised fine-tuning: LLaDA's SFT loss, computed through the fused LM head.

LLaDA's SFT (GUIDELINES.md): per sequence draw t ~ U(0, 1) and p = (1 - eps) t + eps; mask every completion token
independently with probability p (the prompt is never masked); the loss is

    loss = mean over the batch of  (1 / L) sum_{masked i} -log p(x_i | noisy) / p

with L the answer length, EOS padding included (here: the completion width). The masks are a
`dllm_fast.likelihood.MonteCarloMasks` with one sample per sequence and weight 1/p, so the scoring is the
likelihood engine's: the model runs once on the noisy batch and only the masked rows go through
`dllm_fast.masked_logprobs` (never the [B, S, V] logits). Its plain-PyTorch twin is
`dllm_fast.reference.sft.sft_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from dllm_fast.likelihood import MicroBatching, MonteCarloMasks, elbo, score
from dllm_fast.tasks.encoding import encode_prompts
from dllm_fast.validation import check_float, check_int

SFT_SAMPLER = "llada_sft"


@dataclass(frozen=True, eq=False)
class SFTBatch:
    """Prompts (left-padded to a common length) followed by their completions, padded with EOS.

    sequences: [B, P + L] token ids; attention_mask: [B, P + L] (0 on left padding) or None; prompt_length: P.
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor | None
    prompt_length: int


def encode_sft_batch(tokenizer, prompts: Sequence[str], completions: Sequence[str], *, completion_length: int,
                     eos_token_id: int, eot_token_id: int | None = None,
                     device: torch.device | str = "cpu") -> SFTBatch:
    """Tokenize (prompt, completion) pairs the way LLaDA's instruct data looks: the completion text, then the
    end-of-turn token (when given), then EOS up to `completion_length` tokens (at least one EOS, so the model
    learns to stop)."""
    if len(prompts) != len(completions):
        raise ValueError(f"got {len(prompts)} prompts but {len(completions)} completions; pair them one to one.")
    check_int("completion_length", completion_length, minimum=1)
    input_ids, prompt_mask = encode_prompts(tokenizer, prompts, device="cpu", pad_token_id=eos_token_id)
    tail = [] if eot_token_id is None else [eot_token_id]
    rows = []
    for i, text in enumerate(completions):
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"] + tail
        if len(tokens) >= completion_length:
            raise ValueError(f"completion {i} takes {len(tokens)} tokens (end of turn included) but "
                             f"completion_length={completion_length} leaves no room for EOS; raise "
                             f"completion_length to at least {len(tokens) + 1}.")
        rows.append(tokens + [eos_token_id] * (completion_length - len(tokens)))
    completion_ids = torch.tensor(rows, dtype=torch.long)
    sequences = torch.cat([input_ids, completion_ids], dim=1)
    attention_mask = None
    if prompt_mask is not None:
        attention_mask = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1).to(device)
    return SFTBatch(sequences.to(device), attention_mask, input_ids.shape[1])


def draw_sft_masks(sequences: torch.Tensor, *, prompt_length: int, generator: torch.Generator,
                   eps: float = 1e-3) -> MonteCarloMasks:
    """LLaDA's SFT noise: t ~ U(0, 1), p = (1 - eps) t + eps, each completion token masked with probability p.

    One sample per sequence (n_t = 1), weight 1/p, every completion position counted (EOS padding included).
    Draws come from `generator` only, on its device.
    """
    if not isinstance(sequences, torch.Tensor) or sequences.dim() != 2:
        got = tuple(sequences.shape) if isinstance(sequences, torch.Tensor) else type(sequences).__name__
        raise ValueError(f"sequences must be a [B, P + L] tensor of token ids, got {got}.")
    check_int("prompt_length", prompt_length, minimum=0, maximum=sequences.shape[1] - 1,
              hint="the completion, the last positions of sequences, must not be empty")
    check_float("eps", eps, minimum=0.0, maximum=1.0, open_minimum=True, hint="LLaDA uses 1e-3")
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}; pass "
                        "torch.Generator().manual_seed(seed).")
    B, S = sequences.shape
    L = S - prompt_length
    t = torch.rand(B, generator=generator, device=generator.device, dtype=torch.float64)
    p = (1 - eps) * t + eps
    chosen = torch.rand(B, L, generator=generator, device=generator.device, dtype=torch.float64) < p[:, None]
    chosen, p = chosen.to(sequences.device), p.to(sequences.device)
    prompt = torch.zeros(B, prompt_length, dtype=torch.bool, device=sequences.device)
    return MonteCarloMasks(
        masked=torch.cat([prompt, chosen], dim=1)[:, None, :],
        counted=torch.ones(B, L, dtype=torch.bool, device=sequences.device),
        weight=(1.0 / p)[:, None],
        t=p[:, None],
        num_masked=chosen.sum(-1)[:, None],
        prompt_length=prompt_length,
        sampler=SFT_SAMPLER,
    )


def sft_loss(model, sequences: torch.Tensor, masks: MonteCarloMasks, *, attention_mask: torch.Tensor | None = None,
             micro_batch: int | None = None, chunk_size: int | None = None) -> torch.Tensor:
    """LLaDA's SFT loss on stored masks (`draw_sft_masks`): a 0-dim tensor, differentiable in the model.

    micro_batch: sequences per model call (default: all at once); the graph of every micro-batch is kept.
    """
    if masks.n_t != 1:
        raise ValueError(f"masks has n_t={masks.n_t} samples per sequence; the SFT loss takes one (draw_sft_masks).")
    N = masks.num_sequences
    batching = MicroBatching(micro_batch or N, chunk_size=chunk_size)
    lp = score(model, sequences, masks, micro_batch=batching, attention_mask=attention_mask)
    return -(elbo(lp, masks) / masks.completion_length).mean()
