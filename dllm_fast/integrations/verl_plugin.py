"""Importing this module registers dllm_fast's policy losses in verl (`register_verl_losses()` with defaults).

VeRL's Ray workers are separate processes; verl imports the modules named in VERL_USE_EXTERNAL_MODULES in each:

    VERL_USE_EXTERNAL_MODULES=dllm_fast.integrations.verl_plugin python -m verl.trainer.main_ppo \
        actor_rollout_ref.actor.policy_loss.loss_mode=dllm_fast_espo ...
"""

from dllm_fast.integrations.verl import register_verl_losses

REGISTERED = register_verl_losses()
