"""dllm_fast inside verl (>= 0.9): its objectives as verl policy losses (`losses.py`). verl itself is imported only
inside the functions that register with it, so dllm_fast never depends on it."""

from dllm_fast.integrations.verl.losses import (PREFIX, SUPPORTED, check_supported, default_objectives, global_scale,
                                                one_sample_masks, policy_loss, register_verl_losses,
                                                token_normalised)

__all__ = ["PREFIX", "SUPPORTED", "check_supported", "default_objectives", "global_scale", "one_sample_masks",
           "policy_loss", "register_verl_losses", "token_normalised"]
