"""dllm_fast inside verl (0.9.x): its actor engine (`engine.py`, `actor_rollout_ref.model.model_type=dllm_fast`,
registered by `engine.register_engine()`; its settings and checks in `settings.py`, the batch conversion in
`batch.py`, dllm_fast's model types for verl's HF config in `model_types.py`) and its objectives as verl policy
losses (`losses.py`). Only engine.py imports verl, and nothing here imports engine.py: dllm_fast never depends on
verl."""

from dllm_fast.integrations.verl.losses import (PREFIX, SUPPORTED, check_supported, default_objectives, global_scale,
                                                one_sample_masks, policy_loss, register_verl_losses,
                                                token_normalised)

__all__ = ["PREFIX", "SUPPORTED", "check_supported", "default_objectives", "global_scale", "one_sample_masks",
           "policy_loss", "register_verl_losses", "token_normalised"]
