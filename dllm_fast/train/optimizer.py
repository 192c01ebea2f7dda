"""The run's AdamW, as train builds it and the planner prices it (planning/step.py builds it through here too).

On CUDA it is torch's fused AdamW (`fused=True`: one multi-tensor kernel reads each weight, its gradient and both
moments once and writes the weight and the moments, 28 bytes a trained fp32 element, with no temporary), when every
trainable parameter is a floating-point CUDA tensor; FSDP2's shards qualify (DTensor dispatches the fused kernel
to its local shards, torch/distributed/tensor/_ops/_pointwise_ops.py). Anywhere else (CPU, and the host shards of
`--fsdp-offload true`) it is torch's default, as before: the same numbers on CPU. Torch's foreach AdamW, the
default on CUDA otherwise, would allocate a temporary the size of the trained weights at every step (the square
roots of the second moments): a 103B-parameter model's fp32 shards on 16 GPUs, 25.7 GB a GPU.
"""

from __future__ import annotations

import torch

IMPLEMENTATIONS = ("fused", "default")


def adamw_implementation(trainable, device_type: str | None = None) -> str:
    """"fused" when every tensor of `trainable` is a floating-point tensor on CUDA (device_type: the device to take
    them as being on, for a plan's fake tensors; None: each tensor's own), else "default"."""
    trainable = list(trainable)
    if not trainable:
        return "default"
    return "fused" if all(p.is_floating_point() and (device_type or p.device.type) == "cuda"
                          for p in trainable) else "default"


def build_adamw(trainable, optim, *, device_type: str | None = None) -> torch.optim.AdamW:
    """AdamW over `trainable` with the run's OptimSettings `optim` (lr, betas, weight decay), fused where
    `adamw_implementation` says so, torch's default elsewhere."""
    trainable = list(trainable)
    fused = adamw_implementation(trainable, device_type) == "fused"
    return torch.optim.AdamW(trainable, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay,
                             **({"fused": True} if fused else {}))
