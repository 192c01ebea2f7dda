"""The keys dllm_fast adds to verl's batch: written by its verl rollout (rollout.py), read by its actor engine
(batch.py). One definition, so the two sides cannot drift apart.

verl's agent loop carries a rollout's per-sample `extra_fields` into the batch: the legacy PPO trainer as
`non_tensor_batch[key]`, the V1 trainer inside each row's `extra_fields` dict; the engine reads either.
"""

UNMASK_STEP_KEY = "dllm_fast_unmask_step"  # [response_length] int64 per sample: the forward that unmasked each position
FORWARDS_KEY = "dllm_fast_rollout_forwards"  # int per sample: the rollout's forward count (GenerationResult.nfe)
EXTRA_FIELDS_KEY = "extra_fields"  # verl V1's per-row dict of the rollout's extra fields
