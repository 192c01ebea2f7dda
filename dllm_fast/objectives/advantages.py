"""Group-relative advantages from a RolloutBatch's rewards (groups of G contiguous rows).

The conventions differ between papers, so each is an explicit option:
- baseline "mean": A_i = r_i - mean_g(r) (d1, wd1, SPG, RSPO, the ESPO paper);
- baseline "leave_one_out": A_i = r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean_g(r)) (ESPO's code, RLOO);
- scale "std": divide by the group's standard deviation plus epsilon (BGPO Eq. 18; RSPO's and ESPO's options),
  the unbiased one (torch.std, verl) or the population one (unbiased=False: TraceRL's z-score).
A group whose rewards are all equal gets advantage 0 (never NaN): it is kept, and counted by `zero_std_fraction`.

Every finite reward gives finite advantages: each group is computed divided by the power of two just above its
largest |reward| (exact, so ordinary rewards give bit for bit the unscaled result), so rewards near 1e300 neither
overflow the std (which would silently zero every advantage) nor the mean. The trainers bound rewards further
(dllm_fast.contracts.MAX_ABS_REWARD, which RolloutBatch applies).
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
    advantage 0. With std_epsilon 0 a group whose std is 0 gets advantage 0. With scale "none" the advantages are in
    the rewards' units, so they overflow float64 only when the rewards' spread does (a ValueError then).
    """
    check_choice("baseline", baseline, BASELINES)
    check_choice("scale", scale, SCALES)
    check_float("std_epsilon", std_epsilon, minimum=0.0)
    if group_size == 1:
        return torch.zeros_like(rewards, dtype=torch.float64)
    grouped = rewards.double().view(-1, group_size)
    # A power of two per group (exact to divide and multiply by): the rewards of each group then lie in [-1, 1].
    largest = grouped.abs().amax(-1, keepdim=True)
    unit = torch.ldexp(torch.ones_like(largest), torch.frexp(largest).exponent)
    unit = torch.where(largest > 0, unit, torch.ones_like(unit))
    scaled = grouped / unit
    centred = scaled - scaled.mean(-1, keepdim=True)
    if baseline == "leave_one_out":
        centred = centred * (group_size / (group_size - 1))
    if scale == "std":  # (c / u) / (std / u + eps / u) = c / (std + eps)
        std = scaled.std(-1, keepdim=True, correction=1 if unbiased else 0)
        advantages = centred / (std + std_epsilon / unit) if std_epsilon > 0 else torch.where(
            std > 0, centred / std.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    else:
        advantages = centred * unit
        if not torch.isfinite(advantages).all():
            raise ValueError("the rewards' spread within a group overflows float64 advantages; rescale the rewards "
                             "(or use scale='std', which is scale-free).")
    return advantages.reshape(-1)


def zero_std_fraction(rewards: torch.Tensor, group_size: int) -> float:
    """The fraction of groups whose rewards are all equal (no learning signal under group baselines)."""
    grouped = rewards.view(-1, group_size)
    return float((grouped == grouped[:, :1]).all(-1).double().mean())
