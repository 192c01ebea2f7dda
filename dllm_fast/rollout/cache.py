"""Cache policies: which positions a denoising step feeds to the model, and when the KV cache is refreshed
(Fast-dLLM's prefix and dual caches, or none; a block-diffusion model's exact block cache). A new policy is one
`CachePolicy` subclass registered in `CACHE_POLICIES`."""

from __future__ import annotations

import torch

from dllm_fast.contracts import block_length, logit_shift
from dllm_fast.validation import check_choice


class CachePolicy:
    """Which positions a denoising step feeds to the model, and when the KV cache is refreshed.

    A step of the block [start, end) on a canvas of `total` positions either refreshes, feeding all positions
    (and writing their keys and values to the cache), or reuses the cache and feeds `reused_span`. This base
    class refreshes at the first step of every block (Fast-dLLM); a subclass sets `name` and `reused_span`, and
    may override `refreshes`. Register an instance in CACHE_POLICIES to select it by name, or pass it to
    generate(cache=...) directly.
    """

    name = ""
    uses_cache = True

    def refreshes(self, step: int) -> bool:
        """Whether step `step` of a block feeds every position."""
        return step == 0

    def reused_span(self, start: int, end: int, total: int) -> tuple[int, int]:
        """Positions [lo, hi) fed by a step that does not refresh."""
        raise NotImplementedError

    def fed_span(self, start: int, end: int, total: int, step: int) -> tuple[int, int]:
        """Positions [lo, hi) fed to the model by step `step` of the block [start, end)."""
        return (0, total) if self.refreshes(step) else self.reused_span(start, end, total)

    def check_model(self, model) -> None:
        if not hasattr(model, "new_cache"):
            raise ValueError(f"cache={self.name!r} needs a model with a KV cache (new_cache); use cache='none' "
                             "for this model.")
        if logit_shift(model) != 0:
            raise ValueError(f"cache={self.name!r} needs a model with logit_shift=0; this model predicts token i "
                             "from position i - 1 (logit_shift=1, Dream-style), so use cache='none'.")

    def new_cache(self, model, batch: int, capacity: int):
        return model.new_cache(batch, capacity) if self.uses_cache else None

    def forward(self, model, ids: torch.Tensor, attention_mask, kv, start: int, end: int, step: int) -> torch.Tensor:
        """Hidden states [B, hi - lo, d] of the fed span (lo, hi) = fed_span(start, end, ids.shape[1], step)."""
        total = ids.shape[1]
        if self.refreshes(step):
            return model(ids, attention_mask=attention_mask, cache=kv)
        lo, hi = self.reused_span(start, end, total)
        return model(ids[:, lo:hi], attention_mask=attention_mask, cache=kv, cache_start=lo, attend_length=total)

    def forward_fed(self, model, ids: torch.Tensor, attention_mask, kv, fed: torch.Tensor | None) -> torch.Tensor:
        """`forward` for the denoising step that torch.compile captures: the fed positions come as a tensor
        (`fed`, [F] consecutive positions; None feeds every position and refreshes the cache), so one graph
        serves every block."""
        if fed is None:
            return model(ids, attention_mask=attention_mask, cache=kv)
        return model(ids.index_select(1, fed), attention_mask=attention_mask, cache=kv, cache_start=fed[0],
                     attend_length=ids.shape[1])

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NoCache(CachePolicy):
    """Every step recomputes the whole canvas (LLaDA)."""

    name = "none"
    uses_cache = False

    def refreshes(self, step: int) -> bool:
        return True

    def check_model(self, model) -> None:
        pass

    def forward(self, model, ids, attention_mask, kv, start, end, step):
        return model(ids, attention_mask=attention_mask)

    def forward_fed(self, model, ids, attention_mask, kv, fed):
        return model(ids, attention_mask=attention_mask)


class PrefixCache(CachePolicy):
    """Fast-dLLM's prefix cache: later steps feed the block and everything after it; the prefix comes from the
    block's refresh."""

    name = "prefix"

    def reused_span(self, start, end, total):
        return start, total


class DualCache(CachePolicy):
    """Fast-dLLM's dual cache: later steps feed only the block; prefix and suffix come from the refresh."""

    name = "dual"

    def reused_span(self, start, end, total):
        return start, end


class BlockCache(CachePolicy):
    """A block-diffusion model's exact cache (SDAR, TraDo; rollout/blocks.py): the prompt's whole blocks are
    prefilled once, a step feeds only its block and reads the cached keys and values of the blocks before it,
    and a finished block's keys and values are stored by the first step of the next block (which feeds both).
    Block-causal attention makes it exact: a finished block never changes, and no block reads a later one."""

    name = "block"

    def refreshes(self, step: int) -> bool:
        return False

    def reused_span(self, start, end, total):
        return start, end

    def check_model(self, model) -> None:
        super().check_model(model)
        if block_length(model) is None:
            raise ValueError("cache='block' keeps the exact keys and values of finished blocks, which only a "
                             "block-diffusion model (block-causal attention, e.g. SDAR) has; for this model use "
                             "cache='prefix' or 'dual' (Fast-dLLM's approximate caches) or 'none'.")


CACHE_POLICIES: dict[str, CachePolicy] = {policy.name: policy for policy in (NoCache(), PrefixCache(), DualCache())}
# Policies for block-diffusion models only (rollout/blocks.py); CACHE_POLICIES holds those every model takes.
BLOCK_CACHE_POLICIES: dict[str, CachePolicy] = {"block": BlockCache()}


def cache_policy(cache) -> CachePolicy:
    """A CachePolicy instance, or the one registered under the name `cache` (CACHE_POLICIES or
    BLOCK_CACHE_POLICIES)."""
    if isinstance(cache, CachePolicy):
        return cache
    known = {**CACHE_POLICIES, **BLOCK_CACHE_POLICIES}
    return known[check_choice("cache", cache, known)]


