"""`--micro-batch auto` on a GPU: the largest micro-batch the planner fits in this device's free memory, less a
margin, so that the engine's passes feed the GPU as many (sequence, sample) pairs per call as memory allows.

The planner (dllm_fast.planning) runs one step of the run's configuration on fake tensors and searches the largest
micro-batch at which every phase's peak stays within a GPU's memory (planning/search.py: each phase's peak fit
through plans at two micro-batches, then checked by a plan at the answer). Here that GPU is this device, its memory
set to MARGIN of what is free before the run loads its weights: the plan counts the weights, gradients, optimizer
state and activations; the margin covers the caching allocator's fragmentation and what a plan leaves out. Pass 1
(no-grad scoring) takes the same micro-batch unless --score-micro-batch says otherwise.

The planner plans train's step, so it imports train's configuration; this module is the one place in train that
asks the planner back, through an import made when it is called.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from dllm_fast.train.config import TrainConfig
from dllm_fast.train.settings import DEFAULT_MICRO_BATCH

MARGIN = 0.9  # of the device's free memory, for the plan's peak


def fitted_micro_batch(config: TrainConfig, device: torch.device | None = None, *, gpu=None,
                       prompt_length: int | None = None) -> tuple[int, str]:
    """(the largest micro-batch whose planned step fits MARGIN of the free memory, a line saying so) for a run of
    `config` on the CUDA `device`. gpu: a planning.GPU to fit instead, its memory taken as the free memory (no
    device is read). The plan is of eager execution at the configured n_t, group size and lengths; prompt_length:
    tokens per prompt (default: the task's longest, as train checks it)."""
    from dllm_fast.planning.planner import plan_step

    if gpu is None:
        gpu = device_gpu(device)
    budget = dataclasses.replace(gpu, memory=int(MARGIN * gpu.memory),
                                 description=f"{gpu.description}, {MARGIN:.0%} of {gpu.memory / 1e9:.1f} GB free")
    started = time.perf_counter()
    # The plan starts from the default micro-batch; compiled scoring is planned as eager (what the planner prices).
    planned = config.replace(objective={"micro_batch": DEFAULT_MICRO_BATCH}, rollout={"compile": False})
    plan = plan_step(planned, gpu=budget, prompt_length=prompt_length, search=True)
    fitted = plan.largest.get("micro_batch")
    if fitted is None:
        raise ValueError(f"--micro-batch auto: not even a micro-batch of 1 fits {budget.description} by the "
                         f"planner's estimate (peak {plan.peak / 1e9:.1f} GB); lower --group-size, "
                         "--prompts-per-step or the lengths, or use --lora true (`python -m dllm_fast plan` shows "
                         "the step's memory by phase).")
    return fitted, (f"--micro-batch auto: {fitted} pairs per graph, the largest the planner fits in "
                    f"{budget.memory / 1e9:.1f} GB ({budget.description}; planned in "
                    f"{time.perf_counter() - started:.0f} s)")


def device_gpu(device: torch.device):
    """The planner's GPU for a CUDA device: its rates from the planner's table when the device's name is there
    (the fit reads only the memory), with the device's free memory."""
    from dllm_fast.planning.gpus import GPUS

    name = torch.cuda.get_device_name(device)
    free, _ = torch.cuda.mem_get_info(device)
    known = next((gpu for gpu in GPUS.values() if gpu.description.split()[1].lower() in name.lower()), GPUS["h100"])
    return dataclasses.replace(known, name=name, description=name, memory=free)
