"""Block-causal attention for block-diffusion models (SDAR, TraDo): which key each query may read.

Blocks are aligned to absolute positions, counted from each row's first real token (the first 1 of the padding
mask; a row without padding starts at column 0): column c of row n is at position c - first_n and in block
(c - first_n) // block_length. This is how the official SDAR generate aligns them (its prompt starts at position
0; the prompt's whole blocks are prefilled, and its last partial block is decoded together with the first
generated tokens), so a prompt's blocks do not depend on how much a batch pads it.

- One stream (rollouts, the plain forward): query i reads key j when block(j) <= block(i) and j is a real token.
- Two streams (block-diffusion training, likelihoods): the input is [clean | noisy], the noisy stream a copy of the
  clean columns [start, S) with start = 2S - T (T the total length). A clean query reads the clean keys of its
  block and earlier ones; a noisy query reads the clean keys of earlier blocks and the noisy keys of its own
  block. So every noisy block is denoised against the clean earlier blocks, all blocks in one forward (the
  layout of SDAR's training code and of TraceRL's for SDAR/TraDo, which put the streams in other orders).

Both give a boolean `allowed` [B, 1, Tq, K] and the RoPE positions of the queries; `attention_bias` turns it into
the additive bias SDPA takes. A query with no key to read (a padding column) reads every key instead, so that
its output (never used) stays finite.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dllm_fast.validation import check_int


def first_token(attention_mask: torch.Tensor | None, batch: int, device) -> torch.Tensor:
    """[B] int64: the column of each row's first real token (the first nonzero of the padding mask; 0 without
    one)."""
    if attention_mask is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    return attention_mask.ne(0).to(torch.int8).argmax(dim=1)


def block_of(columns: torch.Tensor, first: torch.Tensor, block_length: int) -> torch.Tensor:
    """Block index [B, T] of columns [T] in each row (negative on left padding)."""
    return torch.div(columns[None, :] - first[:, None], block_length, rounding_mode="floor")


def positions_of(columns: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """RoPE positions [B, T] of columns [T]: counted from each row's first real token (padding at 0)."""
    return (columns[None, :] - first[:, None]).clamp_min(0)


def block_causal(query_columns: torch.Tensor, key_count: int, first: torch.Tensor, block_length: int,
                 key_mask: torch.Tensor | None) -> torch.Tensor:
    """allowed [B, 1, Tq, K]: query column c reads key column j in [0, K) when block(j) <= block(c) and j is a
    real token (key_mask [B, K], 1 = token; None: every key)."""
    keys = torch.arange(key_count, device=first.device)
    key_block, query_block = block_of(keys, first, block_length), block_of(query_columns, first, block_length)
    allowed = key_block[:, None, :] <= query_block[:, :, None]
    if key_mask is not None:
        allowed = allowed & key_mask.ne(0)[:, None, :]
    return _every_row_reads(allowed)[:, None]


def two_stream_columns(clean_length: int, total: int, device) -> tuple[torch.Tensor, int]:
    """The column of every input position of a two-stream input [clean (S) | noisy (T - S)], and the first column
    the noisy stream copies (start = 2S - T)."""
    start = 2 * clean_length - total
    if not 0 <= start < clean_length:
        raise ValueError(f"clean_length={clean_length} with {total} tokens: the noisy stream must copy the last "
                         f"1 to {clean_length} columns of the clean one (clean_length < tokens <= 2 * clean_length).")
    columns = torch.cat([torch.arange(clean_length, device=device), torch.arange(start, clean_length, device=device)])
    return columns, start


def two_stream(clean_length: int, total: int, first: torch.Tensor, block_length: int,
               key_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(allowed [B, 1, T, T], positions [B, T]) of a two-stream input (see the module docstring); key_mask
    [B, S] is the clean stream's padding mask (the noisy stream copies its columns' entries)."""
    columns, _ = two_stream_columns(clean_length, total, first.device)
    noisy = torch.arange(total, device=first.device) >= clean_length
    block = block_of(columns, first, block_length)
    query, key = block[:, :, None], block[:, None, :]
    noisy_query, noisy_key = noisy[None, :, None], noisy[None, None, :]
    allowed = ((~noisy_query & ~noisy_key & (key <= query))
               | (noisy_query & ~noisy_key & (key < query))
               | (noisy_query & noisy_key & (key == query)))
    if key_mask is not None:
        allowed = allowed & key_mask.ne(0)[:, columns][:, None, :]
    return _every_row_reads(allowed)[:, None], positions_of(columns, first)


def _every_row_reads(allowed: torch.Tensor) -> torch.Tensor:
    """A query that may read no key (a padding column: no real token in its block or before) reads every key
    instead: its output is never used, but an all-masked row would be NaN (a boolean SDPA mask, or a bias
    rounded to -inf under bf16 autocast), and 0 * NaN spreads through the values of later layers."""
    return allowed | ~allowed.any(dim=-1, keepdim=True)


def attention_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """allowed (bool) -> the additive bias SDPA takes: 0 where allowed, dtype's most negative value elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


class CallLayout(NamedTuple):
    """What a block-diffusion forward attends with: `allowed` [B, 1, T, K], the RoPE `positions` [B, T], where a
    cached call writes its keys and values (`written`: an int, or the [T] columns as a tensor) and how many keys
    it reads (`keys`)."""

    allowed: torch.Tensor
    positions: torch.Tensor
    written: int | torch.Tensor
    keys: int


def call_layout(model, input_ids: torch.Tensor, attention_mask, position_ids, cache, cache_start, attend_length,
                clean_length) -> CallLayout:
    """The layout of a block-diffusion model's forward call (SDARModel.forward's docstring has the rules): plain,
    cached (`model._check_cache` checks the cache arguments) or two-stream (clean_length), in blocks of
    `model.block_length`; position_ids, when given, replace the positions."""
    B, T = input_ids.shape
    device = input_ids.device
    written: int | torch.Tensor = cache_start
    keys = T
    if clean_length is not None:
        if cache is not None:
            raise ValueError("clean_length (the two-stream layout of likelihoods) takes no cache.")
        check_key_mask(attention_mask, B, clean_length)
        first = first_token(attention_mask, B, device)
        allowed, positions = two_stream(clean_length, T, first, model.block_length, attention_mask)
    else:
        if cache is not None:
            keys = model._check_cache(cache, B, T, cache_start, attend_length)
            if isinstance(cache_start, torch.Tensor):
                written = cache_start + torch.arange(T, device=device)
                columns = written
            else:
                columns = torch.arange(cache_start, cache_start + T, device=device)
        elif isinstance(cache_start, torch.Tensor) or cache_start != 0 or attend_length is not None:
            raise ValueError("cache_start and attend_length need a cache; pass cache=KVCache.for_model(...).")
        else:
            columns = torch.arange(T, device=device)
        check_key_mask(attention_mask, B, keys)
        first = first_token(attention_mask, B, device)
        allowed = block_causal(columns, keys, first, model.block_length, attention_mask)
        positions = positions_of(columns, first)
    if position_ids is not None:
        if position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}, expected {(B, T)}.")
        positions = position_ids
    return CallLayout(allowed, positions, written, keys)


def check_key_mask(attention_mask, batch: int, keys: int) -> None:
    if attention_mask is not None and tuple(attention_mask.shape) != (batch, keys):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(batch, keys)} "
                         "(one entry per key).")


def check_block_length(value, name: str = "block_length") -> int:
    return check_int(name, value, minimum=1, hint="positions per block of the block-causal attention")
