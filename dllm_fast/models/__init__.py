"""Diffusion LMs that satisfy dllm_fast's model contract (hidden-state forward + lm_head_weight + special ids)."""

from dllm_fast.models.config import LLaDAConfig
from dllm_fast.models.dream import DreamModel
from dllm_fast.models.dream_config import DreamConfig
from dllm_fast.models.hf_diffusion import HFDiffusionLM
from dllm_fast.models.llada import LLaDAModel
from dllm_fast.models.llada2 import LLaDA2Model
from dllm_fast.models.llada2_config import LLaDA2Config
from dllm_fast.models.sdar import SDARModel
from dllm_fast.models.sdar_config import SDARConfig

__all__ = ["DreamConfig", "DreamModel", "HFDiffusionLM", "LLaDA2Config", "LLaDA2Model", "LLaDAConfig", "LLaDAModel",
           "SDARConfig", "SDARModel"]
