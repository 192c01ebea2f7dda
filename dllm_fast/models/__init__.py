"""Diffusion LMs that satisfy dllm_fast's model contract (hidden-state forward + lm_head_weight + special ids)."""

from dllm_fast.models.config import LLaDAConfig
from dllm_fast.models.hf_diffusion import HFDiffusionLM
from dllm_fast.models.llada import LLaDAModel

__all__ = ["HFDiffusionLM", "LLaDAConfig", "LLaDAModel"]
