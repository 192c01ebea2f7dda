"""The likelihood engine: Monte Carlo masks, per-token log-probs lp[N, n_t, L], estimators and the streaming
backward that differentiates any objective of lp in memory independent of n_t.

    masks = sample_masks(sequences, MaskSpec(n_t=16, sampler="stratified_l"), prompt_length=P, generator=g,
                         eos_token_id=model.eos_token_id)   # or the settings as keywords: n_t=16, sampler=...
    with torch.no_grad():
        lp_old = score(old_model, sequences, masks, micro_batch=8)        # same masks for old, ref, current
    def objective(lp):
        return -(torch.exp(elbo(lp, masks) - elbo(lp_old, masks)) * advantages).mean()
    value, lp = streaming_backward(model, sequences, masks, objective, micro_batch=1)
    # or micro_batch=MicroBatching(1, score_micro_batch=8, chunk_size=8192), hooks=BackwardHooks(...);
    # a sum of per-(sequence, sample) terms in one pass: streaming_backward(..., Separable(terms), ...);
    # a sum of per-sequence terms (the ratio above): SequenceLocal(objective), in one pass where it can
"""

from dllm_fast.likelihood.engine import BackwardResult, Separable, SequenceLocal, streaming_backward
from dllm_fast.likelihood.estimators import elbo, eubo, eubo_per_position, mean_field, mixture, token_estimate
from dllm_fast.likelihood.mask_spec import MaskSpec
from dllm_fast.likelihood.masks import MonteCarloMasks, counted_positions, draw_masks, sample_masks
from dllm_fast.likelihood.samplers import COUNT_MODES, SAMPLERS, register_sampler
from dllm_fast.likelihood.scoring import active_pairs, score, score_pairs
from dllm_fast.likelihood.settings import BackwardHooks, MicroBatching

__all__ = [
    "COUNT_MODES",
    "SAMPLERS",
    "Separable",
    "SequenceLocal",
    "BackwardHooks",
    "BackwardResult",
    "MaskSpec",
    "MicroBatching",
    "MonteCarloMasks",
    "active_pairs",
    "counted_positions",
    "draw_masks",
    "elbo",
    "eubo",
    "eubo_per_position",
    "mean_field",
    "mixture",
    "register_sampler",
    "sample_masks",
    "score",
    "score_pairs",
    "streaming_backward",
    "token_estimate",
]
