"""dllm_fast objectives as VeRL policy losses (verl>=0.9, imported only inside `register_verl_losses`).

    from dllm_fast.integrations.verl import register_verl_losses
    register_verl_losses()        # "dllm_fast_diffu_grpo", "dllm_fast_espo", ... in verl's policy-loss registry
    # then: actor_rollout_ref.actor.policy_loss.loss_mode=dllm_fast_espo

VeRL's workers are separate processes: set VERL_USE_EXTERNAL_MODULES=dllm_fast.integrations.verl_plugin and verl
imports that module, which registers the defaults, in each of them.

VeRL calls a policy loss with per-token tensors [B, T] of one micro-batch: `log_prob` (current policy, with
gradient), `old_log_prob`, `advantages` (one value per sequence, broadcast over its tokens) and `response_mask`.
The adapter reads them as one Monte Carlo sample per sequence on a fully masked completion, i.e. d1's one-step
mean-field estimate (weight 1): lp[n, 0, i] = log_prob[n, i] where the response mask is 1. The objective's own
loss (its paper's clipping and normalisation) runs on that; its sampler and n_t settings do not apply.

What VeRL's side must provide (not part of this module, and not tested here): an actor whose `compute_log_prob`
returns diffusion log-probs of that kind, scored for the old and the current policy on the same masks (e.g.
`dllm_fast.integrations.logprobs.mean_field_logprobs`, whose masks are a function of each row's tokens), and a
rollout worker that decodes by diffusion.

Mapping of VeRL's conventions:
- KL: VeRL's own (`actor.use_kl_loss`, `kl_loss_type="low_var_kl"` is diffu-GRPO's k3), so objectives are
  registered with their KL coefficient at 0 and one with a reference term is rejected.
- aggregation: the objective's normalisation replaces `loss_agg_mode`. With VeRL's global batch info (data
  parallelism, gradient accumulation) the micro-batch loss is rescaled the way VeRL's `agg_loss` rescales its own:
  by local / global sequences (tokens, for token-normalised objectives) times dp_size, so the micro-batch losses
  sum to the objective on the global batch.
- rollout correction (`rollout_is_weights`) is rejected: the objectives define no importance weights.

Supported: diffu_grpo, vrpo_ol, bgpo, espo, spg (with one sample per sequence, SPG's EUBO equals its ELBO),
coupled_grpo and gdpo. For those two the per-token tensors VeRL hands over are read as their own per-token
quantities: coupled-GRPO's estimate lp_hat (the actor averages the full-mask and complementary-pair scores per
token, DiffuCoder Eq. 13) and GDPO's per-position SDMC contributions (NVIDIA NeMo RL's form, whose masked sum is the
ELBO); the loss is then exactly the objective's (token-level GRPO; one ratio exp(dELBO / L_n) per sequence).
Not supported: wd1 (a softmax over each prompt group, which a VeRL micro-batch does not keep together), rspo
(it needs the reference log-probs inside the loss) and tracerl (its loss averages over each decoding state's
tokens, which VeRL's per-token tensors do not say).

Tested against verl 0.9.1 in a throwaway environment (it pulls ray, wandb and tensorboard, so it is not a test
dependency); the suite tests the mapping itself, and the registration only where verl is installed.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from dllm_fast import objectives
from dllm_fast.likelihood import MonteCarloMasks
from dllm_fast.objectives import LossInputs, Objective

SUPPORTED = ("diffu_grpo", "vrpo_ol", "bgpo", "espo", "spg", "coupled_grpo", "gdpo")
PREFIX = "dllm_fast_"


def default_objectives() -> list[Objective]:
    """The supported objectives with their papers' defaults, KL coefficients at 0 (VeRL adds its own KL loss)."""
    without_kl = {"diffu_grpo": {"beta": 0.0}, "espo": {"beta": 0.0}, "coupled_grpo": {"beta": 0.0}}
    return [objectives.get(name, **without_kl.get(name, {})) for name in SUPPORTED]


def register_verl_losses(*chosen: Objective | str, prefix: str = PREFIX) -> list[str]:
    """Register objectives (instances or names; default `default_objectives()`) as VeRL policy losses named
    prefix + objective name; returns the names. Imports verl here, so dllm_fast never depends on it."""
    try:
        from verl.trainer.ppo.core_algos import register_policy_loss
    except ImportError as error:
        raise ImportError("register_verl_losses needs verl (pip install verl>=0.9); dllm_fast does not depend on "
                          f"it. Import failed with: {error}") from error
    selected = [objectives.get(o) if isinstance(o, str) else o for o in chosen] or default_objectives()
    names = []
    for objective in selected:
        check_supported(objective)
        name = prefix + objective.name
        register_policy_loss(name)(functools.partial(policy_loss, objective))
        names.append(name)
    return names


def check_supported(objective) -> None:
    if not isinstance(objective, Objective):
        raise TypeError(f"expected a dllm_fast Objective or its name, got {type(objective).__name__}.")
    if objective.name not in SUPPORTED:
        raise ValueError(f"objective {objective.name!r} cannot run as a VeRL policy loss (supported: "
                         f"{', '.join(SUPPORTED)}); see dllm_fast.integrations.verl for why.")
    if objective.needs_reference:
        raise ValueError(f"{objective!r} has a reference-policy term, which VeRL's policy loss cannot see; set "
                         f"its KL coefficient to 0 (objectives.get({objective.name!r}, beta=0.0)) and use VeRL's "
                         "actor.use_kl_loss instead.")


def policy_loss(objective: Objective, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                rollout_is_weights: torch.Tensor | None = None, **unused) -> tuple[torch.Tensor, dict[str, float]]:
    """VeRL's policy-loss signature -> (loss, metrics) of `objective` on one micro-batch (module docstring)."""
    check_supported(objective)
    if rollout_is_weights is not None:
        raise ValueError("rollout correction weights (rollout_is_weights) were passed, but dllm_fast objectives "
                         "define no importance weights; disable algorithm.rollout_correction.")
    shape = tuple(log_prob.shape)
    for name, value in (("old_log_prob", old_log_prob), ("advantages", advantages), ("response_mask", response_mask)):
        if tuple(value.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)} but log_prob {shape}; VeRL passes [batch, "
                             "response_length] tensors.")
    scored = response_mask.bool()
    masks = one_sample_masks(scored)
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    lp = torch.where(scored, log_prob, zero)[:, None, :]
    lp_old = torch.where(scored, old_log_prob.detach().to(log_prob.dtype), zero)[:, None, :]
    masks.check_lp(lp_old, "old_log_prob")
    tokens = scored.sum(-1)
    per_sequence = torch.where(scored, advantages.double(), 0.0).sum(-1) / tokens.clamp_min(1)
    inputs = LossInputs(masks=masks, batch=None,  # VeRL's loss sees no token ids; supported objectives read none
                        advantages=per_sequence, lp_old=lp_old, extra=objective.extra(None, masks))
    loss = objective.loss(lp, inputs) * global_scale(objective, scored, config)
    with torch.no_grad():
        metrics = {f"dllm_fast/{name}": float(value) for name, value in objective.stats(lp.detach(), inputs).items()}
    return loss, metrics


def one_sample_masks(scored: torch.Tensor) -> MonteCarloMasks:
    """n_t = 1 mean-field masks over the response: every response token masked and scored, weight 1."""
    N = scored.shape[0]
    ones = torch.ones(N, 1, dtype=torch.float64, device=scored.device)
    return MonteCarloMasks(masked=scored[:, None, :].clone(), counted=scored.clone(), weight=ones, t=ones.clone(),
                           num_masked=scored.sum(-1, keepdim=True), prompt_length=0, sampler="mean_field")


def token_normalised(objective: Objective) -> bool:
    """Whether the loss divides by the batch's scored tokens (rather than its sequences)."""
    return objective.name == "coupled_grpo" or getattr(objective.config, "normalization", None) == "token"


def global_scale(objective: Objective, scored: torch.Tensor, config) -> float | torch.Tensor:
    """local / global count x dp_size, as VeRL's agg_loss scales its own micro-batch losses; 1 without global
    batch info (a single micro-batch on one rank)."""
    info = dict(getattr(config, "global_batch_info", None) or {}) if config is not None else {}
    dp_size = info.get("dp_size") or 1
    if token_normalised(objective):
        local, total, what = scored.sum(), info.get("batch_num_tokens"), "batch_num_tokens"
    else:
        local, total, what = scored.shape[0], info.get("global_batch_size"), "global_batch_size"
    if total is None:
        if dp_size > 1:
            raise ValueError(f"VeRL's global_batch_info has dp_size={dp_size} but no {what}; the loss cannot be "
                             "normalised over the global batch.")
        return 1.0
    return local / total * dp_size
