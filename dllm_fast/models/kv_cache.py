"""Key/value cache for block diffusion sampling (Fast-dLLM's prefix and dual caches)."""

from __future__ import annotations

import torch

from dllm_fast.validation import check_int


class KVCache:
    """Per-layer keys (RoPE applied) and values of a batch, for positions [0, capacity).

    A forward with a cache writes the keys and values of the tokens it processes at their positions
    [cache_start, cache_start + T) and attends over the cached keys [0, attend_length). One mechanism gives
    Fast-dLLM's caches (L = the full sequence length, [s, e) the current block):

    - refresh: a forward over positions [0, L) writes every position;
    - prefix cache: later steps feed x[:, s:] (block and masked suffix) and attend over [0, L); positions < s
      come from the last refresh;
    - dual cache: later steps feed only the block x[:, s:e] and attend over [0, L); the prefix and the suffix
      come from the last refresh, and the block's own keys are replaced each step.

    Layout: one buffer per layer, `layers[i]` [batch, capacity, 2 * n_kv_heads, head_dim], keys in the first
    n_kv_heads heads and values in the others. A forward's keys and values come out of its fused QKV projection
    side by side, so one indexed copy per layer writes both. `keys[i]` and `values[i]` are views
    [batch, n_kv_heads, capacity, head_dim] of layer i (writes to them land in the buffer). Separate buffers per
    layer (not one tensor) keep each a graph input of its own for torch.compile, written in place.
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        for name, value in (("n_layers", n_layers), ("batch", batch), ("n_kv_heads", n_kv_heads),
                            ("capacity", capacity), ("head_dim", head_dim)):
            check_int(name, value, minimum=1)
        shape = (batch, capacity, 2 * n_kv_heads, head_dim)
        self.layers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.keys = [layer[:, :, :n_kv_heads].transpose(1, 2) for layer in self.layers]
        self.values = [layer[:, :, n_kv_heads:].transpose(1, 2) for layer in self.layers]

    @classmethod
    def for_model(cls, model, batch: int, capacity: int) -> "KVCache":
        config = model.config
        return cls(config.n_layers, batch, config.n_kv_heads, capacity, config.head_dim, model.dtype, model.device)

    def tensors(self) -> list[torch.Tensor]:
        """The buffers a cached forward writes in place (CUDA graphs need their addresses fixed)."""
        return list(self.layers)

    @property
    def batch(self) -> int:
        return self.layers[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.layers[0].shape[1]
