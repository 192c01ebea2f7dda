"""dllm_fast: fast rollouts and constant-memory likelihoods for RL on masked diffusion language models."""

import torch  # noqa: F401  (the compiled ops link against libtorch, so torch loads first)

from dllm_fast._extension import HAS_EXTENSION, build_info
from dllm_fast.ops import masked_logprobs, sample_tokens, select_transfer
from dllm_fast import likelihood  # noqa: E402  (after ops: the engine builds on masked_logprobs)
from dllm_fast.contracts import DiffusionLM, GenerationResult, RolloutBatch
from dllm_fast.rollout import generate

__version__ = "0.1.0"

__all__ = [
    "DiffusionLM",
    "GenerationResult",
    "RolloutBatch",
    "HAS_EXTENSION",
    "build_info",
    "generate",
    "likelihood",
    "masked_logprobs",
    "sample_tokens",
    "select_transfer",
]
