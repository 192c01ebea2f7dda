"""The dtypes a training run holds its models' weights in, and whether their forwards autocast to bf16: one choice,
made here for train/run.py and for the planner (dllm_fast.planning builds its fake models from it), so that a plan
follows whatever the trainer loads.

    from dllm_fast.train.precision import model_precision
    precision = model_precision(config, "cuda")
    precision.policy, precision.reference, precision.autocast
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelPrecision:
    """policy: the dtype the policy's weights are loaded in (with LoRA, the frozen base's; PEFT makes the adapters
    in the same dtype). reference: a full fine-tune's reference copy. autocast: forwards run under bf16 autocast."""

    policy: torch.dtype
    reference: torch.dtype
    autocast: bool


def model_precision(config, device_type: str) -> ModelPrecision:
    """What train loads for `config` (a TrainConfig) on a device of `device_type` ("cuda" or "cpu"): every weight
    in fp32, with bf16 autocast under --bf16 (default: on CUDA, not on CPU)."""
    autocast = config.bf16 if config.bf16 is not None else device_type == "cuda"
    return ModelPrecision(policy=torch.float32, reference=torch.float32, autocast=autocast)
