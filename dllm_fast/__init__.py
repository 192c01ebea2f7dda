"""dllm_fast: fast rollouts and constant-memory likelihoods for RL on masked diffusion language models.

The names below load on first use (torch and the compiled ops with them), so that `python -m dllm_fast --help`
answers at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS = {
    "DiffusionLM": "dllm_fast.contracts",
    "GenerationResult": "dllm_fast.contracts",
    "RolloutBatch": "dllm_fast.contracts",
    "HAS_EXTENSION": "dllm_fast._extension",
    "build_info": "dllm_fast._extension",
    "GenerateConfig": "dllm_fast.rollout",
    "generate": "dllm_fast.rollout",
    "masked_logprobs": "dllm_fast.ops",
    "sample_tokens": "dllm_fast.ops",
    "select_transfer": "dllm_fast.ops",
}

__all__ = [*_EXPORTS, "likelihood"]

if TYPE_CHECKING:
    from dllm_fast import likelihood
    from dllm_fast._extension import HAS_EXTENSION, build_info
    from dllm_fast.contracts import DiffusionLM, GenerationResult, RolloutBatch
    from dllm_fast.ops import masked_logprobs, sample_tokens, select_transfer
    from dllm_fast.rollout import GenerateConfig, generate


def __getattr__(name: str):
    if name == "likelihood":
        return importlib.import_module("dllm_fast.likelihood")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dllm_fast' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
