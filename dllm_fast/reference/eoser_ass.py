"""CJ-GRPO's decoders in plain PyTorch (Yang et al. 2025; yjyddq/EOSER-ASS-RL, cj-grpo/cj_grpo_trainer_eoser.py and
cj_grpo_trainer_eoser_ass.py), written from the official code's rules, one step and one row at a time: the oracle
for generate's unmask_schedule="ass" and eos_schedule (rollout/plan.py unmask_counts, eos_factors).

- ASS (ascending step-size): a block of S = int(log2 n) steps unmasks 2^i tokens at step i and the rest,
  n - (2^(S-1) - 1), at its last (the official get_num_transfer_tokens_ass with one block);
- EOSER (EOS early rejection): a position whose sampled token is EOS ranks by its confidence times
  gamma = gamma_min + (gamma_max - gamma_min) t, t = i / (S - 1) with LLaDA's even split (`sampling`) and
  t = (2^(i+1) - 1) / 2^S with ASS (`ass_sampling`); gamma_max when the block has one step.
"""

from __future__ import annotations

import math

import torch


def ass_steps(block_length: int) -> int:
    """The official S = int(log2 L) (its asserts: steps == S), at least 1."""
    return max(1, int(math.log2(block_length)))


def ass_transfer_schedule(masked_in_block: torch.Tensor, steps: int) -> torch.Tensor:
    """[B, steps]: step i unmasks 2^i tokens, the last step the rest of the row's n masked positions."""
    n = masked_in_block.sum(dim=1)
    schedule = torch.zeros(masked_in_block.shape[0], steps, dtype=torch.int64)
    for row in range(masked_in_block.shape[0]):
        for i in range(steps):
            schedule[row, i] = int(n[row]) - (2 ** i - 1) if i == steps - 1 else 2 ** i
    return schedule


def eos_factor(step: int, steps: int, eos_schedule: tuple[float, float], ass: bool) -> float:
    """EOSER's factor at step `step` of a block of `steps` (a Python float, as the official `fac`)."""
    low, high = eos_schedule
    if steps <= 1:
        return high
    t = (2 ** (step + 1) - 1) / 2 ** steps if ass else min(max(step, 0), steps - 1) / (steps - 1)
    return low + (high - low) * t


def scale_eos(confidence: torch.Tensor, tokens: torch.Tensor, eos_id: int, factor: float) -> torch.Tensor:
    """The official rule: x0_p = where(x0 == eos, x0_p * fac, x0_p)."""
    return torch.where(tokens == eos_id, confidence * factor, confidence)
