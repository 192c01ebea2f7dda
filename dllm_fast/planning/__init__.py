"""Plan a training step before renting a GPU: the real trainer step, run on fake tensors at the configured shapes
and dtypes, with memory by category, FLOPs, bytes moved and a roofline time per phase for a chosen GPU, a verdict
and the largest settings that fit. `python -m dllm_fast plan --help`; `plan_step(config, gpu="h100")` in Python."""
