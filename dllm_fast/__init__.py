"""dllm_fast: fast rollouts and constant-memory likelihoods for RL on masked diffusion language models."""

import torch  # noqa: F401  (the compiled ops link against libtorch, so torch loads first)

from dllm_fast._extension import HAS_EXTENSION, build_info
from dllm_fast.ops import masked_logprobs

__version__ = "0.1.0"

__all__ = ["HAS_EXTENSION", "build_info", "masked_logprobs"]
