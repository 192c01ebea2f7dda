"""What a reward is: a finite real number within +-MAX_ABS_REWARD, whichever function returned it.

The native trainer (a task's reward) and the TRL adapter (its reward functions) read every returned value through
`reward_value`, so both accept and refuse the same values, and the error names the function that returned it.

- Accepted: int, float, bool, NumPy scalars (numpy.float32 ...) and 0-dimensional NumPy arrays or torch tensors;
  each becomes a Python float (what metrics.jsonl and the rollout batch hold).
- Refused: strings, None, lists and other containers, arrays or tensors of several values, complex numbers, NaN,
  +-inf, and magnitudes beyond MAX_ABS_REWARD.

Why the bound: rewards travel as float32 (in a RolloutBatch, in TRL), which holds every integer only up to 2^24.
And the objectives whose advantage is not divided by the group's std (every objective but vrpo_ol and bgpo, by default)
scale the gradient by it: at rewards near 1e30 the gradient norm overflows, which the native trainer reports while
TRL's clipping silently zeroes the update. Rescale larger rewards: group-relative advantages depend only on the
rewards' differences, and with std scaling (vrpo_ol, bgpo) not on their scale either.
"""

from __future__ import annotations

import math
import numbers

from dllm_fast.contracts import MAX_ABS_REWARD  # the one bound, which RolloutBatch applies to every objective


def reward_value(value, source: str) -> float:
    """`value` as a float, or a TypeError/ValueError naming `source` (e.g. "reward function 'f' for completion 3")
    and what a reward must be (see the module docstring)."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # NumPy scalars and 0-d arrays, torch scalars
        value = value.item()
    if not isinstance(value, numbers.Real):
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise TypeError(f"{source} returned {shown} (a {type(value).__name__}); a reward is one real number "
                        "(int, float, or a NumPy/torch scalar) per completion.")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{source} returned {value}; a reward must be finite.")
    if abs(value) > MAX_ABS_REWARD:
        raise ValueError(f"{source} returned {value:.6g}, beyond the reward range [-2^24, 2^24] = "
                         f"[-{MAX_ABS_REWARD:.0f}, {MAX_ABS_REWARD:.0f}]; rescale the rewards (advantages are "
                         "relative within a group, so dividing every reward by a constant keeps their ranking).")
    return value


def task_reward(task, example, completion: str, where: str) -> float:
    """`task.reward(example, completion)` checked by `reward_value`; an error of the reward says `where` the
    completion was (e.g. "prompt 3 of step 7, completion '...'")."""
    try:
        return reward_value(task.reward(example, completion), f"task {task.name!r}'s reward")
    except (TypeError, ValueError) as error:
        raise type(error)(f"{str(error).rstrip('.')}, for {where}.") from None
