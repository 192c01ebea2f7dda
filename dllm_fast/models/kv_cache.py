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
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        for name, value in (("n_layers", n_layers), ("batch", batch), ("n_kv_heads", n_kv_heads),
                            ("capacity", capacity), ("head_dim", head_dim)):
            check_int(name, value, minimum=1)
        shape = (batch, n_kv_heads, capacity, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]

    @classmethod
    def for_model(cls, model, batch: int, capacity: int) -> "KVCache":
        config = model.config
        return cls(config.n_layers, batch, config.n_kv_heads, capacity, config.head_dim, model.dtype, model.device)

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]
