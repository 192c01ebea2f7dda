"""Group-relative advantages from a RolloutBatch's rewards (groups of G contiguous rows).

The conventions differ between papers, so each is an explicit option:
- baseline "mean": A_i = r_i - mean_g(r) (d1, wd1, SPG, RSPO, the ESPO paper);
- baseline "leave_one_out": A_i = r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean_g(r)) (ESPO's code, RLOO);
- scale "std": divide by the group's standard deviation plus epsilon (BGPO Eq. 18; RSPO's and ESPO's options),
  the unbiased one (torch.std, verl) or the population one (unbiased=False: TraceRL's z-score).
A group whose rewards are all equal gets advantage 0 (never NaN): it is kept, and counted by `zero_std_fraction`.
"""

from __future__ import annotations

import torch

from dllm_fast.validation import check_choice, check_float

BASELINES = ("mean", "leave_one_out")
SCALES = ("none", "std")


def group_advantages(rewards: torch.Tensor, group_size: int, *, baseline: str = "mean", scale: str = "none",
                     std_epsilon: float = 1e-6, unbiased: bool = True) -> torch.Tensor:
    """[N] rewards -> [N] float64 advantages, computed within each group of `group_size` contiguous rows.

    The std is the unbiased one (as torch.std and verl compute it) unless unbiased=False; a group of size 1 has
    advantage 0. With std_epsilon 0 a group whose std is 0 gets advantage 0.
    """
    check_choice("baseline", baseline, BASELINES)
    check_choice("scale", scale, SCALES)
    check_float("std_epsilon", std_epsilon, minimum=0.0)
    grouped = rewards.double().view(-1, group_size)
    centred = grouped - grouped.mean(-1, keepdim=True)
    if group_size == 1:
        return torch.zeros_like(rewards, dtype=torch.float64)
    if baseline == "leave_one_out":
        centred = centred * (group_size / (group_size - 1))
    if scale == "std":
        std = grouped.std(-1, keepdim=True, correction=1 if unbiased else 0)
        centred = centred / (std + std_epsilon) if std_epsilon > 0 else torch.where(
            std > 0, centred / std.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    return centred.reshape(-1)


def zero_std_fraction(rewards: torch.Tensor, group_size: int) -> float:
    """The fraction of groups whose rewards are all equal (no learning signal under group baselines)."""
    grouped = rewards.view(-1, group_size)
    return float((grouped == grouped[:, :1]).all(-1).double().mean())
