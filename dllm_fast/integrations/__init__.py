"""Adapters to host trainers. Each imports its host library (an optional extra) only when it is imported itself:

- `dllm_fast.integrations.trl`: `DiffusionGRPOTrainer`, a TRL `GRPOTrainer` whose rollouts, log-probs and loss
  are dllm_fast's (`pip install "dllm_fast[trl]"`); `python -m dllm_fast.integrations.trl_example` runs it.
- `dllm_fast.integrations.verl`: `register_verl_losses()`, dllm_fast objectives as VeRL policy losses
  (`verl_plugin` registers them on import, for VERL_USE_EXTERNAL_MODULES).
- `dllm_fast.integrations.logprobs`: per-token diffusion log-probs for hosts' per-token hooks.
"""
