"""Between task text and token tensors: prompts in (left-padded for `generate`), completions out (decoded as d1's
reward functions see them)."""

from __future__ import annotations

from typing import Sequence

import torch

from dllm_fast.contracts import GenerationResult


def encode_prompts(tokenizer, prompts: Sequence[str], *, device: torch.device | str = "cpu",
                   pad_token_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids [B, P] of the prompt texts, left-padded, and the attention mask (None when none is padded).

    The texts already hold any BOS (the chat template writes it), so no special tokens are added. Padding uses
    `pad_token_id` (default: the tokenizer's pad token, else its EOS), as LLaDA pads with <|endoftext|>.
    """
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty sequence of prompt strings (one per row), "
                         f"got {prompts!r:.80}.")
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts]
    if pad_token_id is None:
        pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_token_id is None:
        raise ValueError("the tokenizer has neither a pad nor an EOS token; pass pad_token_id.")
    return left_pad(rows, pad_token_id, device)


def left_pad(rows: Sequence[Sequence[int]], pad_token_id: int,
             device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, P] left-padded ids of token-id rows and their 0/1 mask (None when no row is padded)."""
    if not rows:
        raise ValueError("no prompts to pad; pass at least one row of token ids.")
    empty = [i for i, row in enumerate(rows) if len(row) == 0]
    if empty:
        raise ValueError(f"prompt {empty[0]} encodes to no tokens (an empty prompt); every prompt needs at least "
                         "one.")
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    padded = bool((mask == 0).any())
    return ids.to(device), (mask.to(device) if padded else None)


def decode_completions(tokenizer, result: GenerationResult) -> list[str]:
    """Each row's completion up to and including its first EOS, decoded with special tokens skipped (how TRL
    hands completions to d1's reward functions)."""
    completions = result.completion_ids.cpu()
    lengths = result.completion_mask.sum(-1).cpu().tolist()
    return [tokenizer.decode(row[:n].tolist(), skip_special_tokens=True) for row, n in zip(completions, lengths)]
