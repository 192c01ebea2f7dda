"""Rollouts: block semi-autoregressive diffusion sampling with Fast-dLLM's caches and parallel decoding.

- `generate` (sampler.py): the fused sampler (a module named apart from its function, so that importing the
  module never hides the function behind the package attribute);
- `step.py`: one denoising step as one function, without a host sync, run eagerly or through torch.compile;
- `config.py`: `GenerateConfig`, a rollout's settings as one object (unchecked);
- `plan.py`: a generate call checked once into a `DecodingPlan` (schedule, temperature, cache, remasking);
- `cache.py`: the cache policies (none, prefix, dual; block for block-diffusion models); `remasking.py`: the
  remasking rules;
- `blocks.py`: the rollout of block-diffusion models (SDAR): blocks aligned per prompt, the exact block cache;
- `rules.py`: what both samplers enforce (the mask token is never decoded, non-finite outputs raise).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dllm_fast._lazy import lazy_attributes

if TYPE_CHECKING:
    from dllm_fast.rollout.cache import (BLOCK_CACHE_POLICIES, CACHE_POLICIES, BlockCache, CachePolicy, DualCache,
                                         NoCache, PrefixCache, cache_policy)
    from dllm_fast.rollout.config import GenerateConfig
    from dllm_fast.rollout.sampler import generate
    from dllm_fast.rollout.plan import (UNMASK_SCHEDULES, DecodingPlan, check_generate_args, eos_factors,
                                        masked_count_schedule, unmask_counts)
    from dllm_fast.rollout.remasking import REMASKING, LowConfidence, RandomRemasking, Remasking, remasking_rule
    from dllm_fast.rollout.resume import Resume

# name -> its module, loaded on first use: the cache and remasking registries (which `train --help` lists) need
# neither the sampler nor the compiled ops.
_EXPORTS = {
    **dict.fromkeys(("BLOCK_CACHE_POLICIES", "CACHE_POLICIES", "BlockCache", "CachePolicy", "DualCache", "NoCache",
                     "PrefixCache", "cache_policy"), "cache"),
    "GenerateConfig": "config",
    "generate": "sampler",
    **dict.fromkeys(("DecodingPlan", "check_generate_args", "masked_count_schedule", "UNMASK_SCHEDULES", "eos_factors",
                     "unmask_counts"), "plan"),
    **dict.fromkeys(("REMASKING", "LowConfidence", "RandomRemasking", "Remasking", "remasking_rule"), "remasking"),
    "Resume": "resume",  # generate's resume option (d-TreeRPO's branching)
}

__all__ = ["BLOCK_CACHE_POLICIES", "CACHE_POLICIES", "REMASKING", "BlockCache", "CachePolicy", "DecodingPlan",
           "DualCache", "GenerateConfig", "LowConfidence", "NoCache", "PrefixCache", "RandomRemasking", "Remasking",
           "cache_policy", "check_generate_args", "generate", "masked_count_schedule", "remasking_rule",
           "Resume", "UNMASK_SCHEDULES", "eos_factors", "unmask_counts"]

__getattr__ = lazy_attributes(__name__, _EXPORTS)
