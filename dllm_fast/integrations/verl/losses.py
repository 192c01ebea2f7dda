"""dllm_fast objectives as VeRL policy losses (verl>=0.9, imported only inside `register_verl_losses`): the path for
users who keep their own actor. dllm_fast's own actor engine (`engine.py`, `actor_rollout_ref.model.model_type=
dllm_fast`) is the path that keeps the objectives' estimators; see "What this path loses" below.

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

What this path loses, against the engine: the objective's estimator. Whatever the objective's sampler and n_t, the
loss sees one mean-field sample per sequence: no multi-sample ELBO (ESPO's complementary pairs, VRPO's and BGPO's
n_t samples, SPG's block masks, GDPO's quadrature) and so no variance reduction from it; no reference term (rspo,
and the KL of espo, diffu_grpo and coupled_grpo, are left to verl's own `use_kl_loss` on the same one sample); and
the actor that scores `log_prob` is the user's (it must give diffusion log-probs, scored for the old and the
current policy on the same masks, e.g. `dllm_fast.integrations.logprobs.mean_field_logprobs`), as is the rollout.

Mapping of VeRL's conventions:
- KL: VeRL's own (`actor.use_kl_loss`, `kl_loss_type="low_var_kl"` is diffu-GRPO's k3), so objectives are
  registered with their KL coefficient at 0 and one with a reference term is rejected.
- aggregation: the objective's normalisation replaces `loss_agg_mode`, which must stay verl's default
  "token-mean"; verl's PPO clip (`actor.clip_ratio`, `clip_ratio_low`/`_high`, `clip_ratio_c`) and
  `actor.loss_scale_factor` are replaced by the objective's options and must stay at verl's defaults (an error
  names a changed one: it would be silently ignored). With VeRL's global batch info (data parallelism, gradient
  accumulation) the micro-batch loss is rescaled the way VeRL's `agg_loss` rescales its own: by local / global
  sequences (tokens, for token-normalised objectives) times dp_size, so the micro-batch losses sum to the
  objective on the global batch. Each of its fields must be a positive whole number, at least the micro-batch's
  own count.
- advantages: one value per sequence, as verl's outcome estimators give (`ONE_VALUE_PER_SEQUENCE`: grpo, rloo,
  ...); per-token ones (gae, reinforce_plus_plus, remax) are refused, naming those.
- empty rows (no response token) contribute nothing and count as a sequence of zero loss; an empty micro-batch
  gives a loss of 0 with a zero gradient.
- rollout correction (`rollout_is_weights`) is rejected: the objectives define no importance weights.

Supported: diffu_grpo, vrpo_ol, bgpo, espo, spg (with one sample per sequence, SPG's EUBO equals its ELBO),
coupled_grpo and gdpo. For those two the per-token tensors VeRL hands over are read as their own per-token
quantities: coupled-GRPO's estimate lp_hat (the actor averages the full-mask and complementary-pair scores per
token, DiffuCoder Eq. 13) and GDPO's per-position SDMC contributions (NVIDIA NeMo RL's form, whose masked sum is the
ELBO); the loss is then exactly the objective's (token-level GRPO; one ratio exp(dELBO / L_n) per sequence).
Not supported: wd1 (a softmax over each prompt group, which a VeRL micro-batch does not keep together), rspo
(it needs the reference log-probs inside the loss) and tracerl (its loss averages over each decoding state's
tokens, which VeRL's per-token tensors do not say); all three run in the engine.

Tested against verl 0.9.1; the suite tests the mapping itself, and the registration only where verl is installed.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any

import torch

from dllm_fast import objectives
from dllm_fast.likelihood import MonteCarloMasks
from dllm_fast.objectives import LossInputs, Objective

SUPPORTED = ("diffu_grpo", "vrpo_ol", "bgpo", "espo", "spg", "coupled_grpo", "gdpo")
PREFIX = "dllm_fast_"
# verl's advantage estimators that give one value per sequence (broadcast over its response tokens), which is what
# every objective's advantage is; gae, reinforce_plus_plus, remax and the optimal-token baselines vary per token.
ONE_VALUE_PER_SEQUENCE = ("grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "opo", "gpg", "grpo_passk",
                          "reinforce_plus_plus_baseline", "gdpo")
# verl's ActorConfig defaults of the settings an objective's own options replace; a changed one would be ignored.
VERL_LOSS_DEFAULTS = {"loss_agg_mode": "token-mean", "clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2,
                      "clip_ratio_c": 3.0, "loss_scale_factor": None}


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
                         f"{', '.join(SUPPORTED)}); see dllm_fast.integrations.verl.losses for why, and run it in "
                         "dllm_fast's actor engine (actor_rollout_ref.model.model_type=dllm_fast).")
    if objective.needs_reference:
        raise ValueError(f"{objective!r} has a reference-policy term, which VeRL's policy loss cannot see; set "
                         f"its KL coefficient to 0 (objectives.get({objective.name!r}, beta=0.0)) and use VeRL's "
                         "actor.use_kl_loss instead.")
    rows = getattr(objective.config, "micro_batch_rows", None)
    if rows is not None:
        raise ValueError(f"{objective.name} with micro_batch_rows={rows} normalises within micro-batches of its own, "
                         "which VeRL's micro-batches (actor.ppo_micro_batch_size_per_gpu) and the rescaling to the "
                         "global batch replace; leave micro_batch_rows unset (and normalize_per='batch').")


def policy_loss(objective: Objective, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                rollout_is_weights: torch.Tensor | None = None, **unused) -> tuple[torch.Tensor, dict[str, float]]:
    """VeRL's policy-loss signature -> (loss, metrics) of `objective` on one micro-batch (module docstring).

    Every argument is checked and a bad one named: the tensors are torch [batch, response_length] (the log-probs
    and advantages floating point; response_mask bool or 0/1), the log-probs finite and <= 0 wherever the mask
    scores, the advantages finite and one value per row, the global batch info positive whole numbers."""
    check_supported(objective)
    if rollout_is_weights is not None:
        raise ValueError("rollout correction weights (rollout_is_weights) were passed, but dllm_fast objectives "
                         "define no importance weights; disable algorithm.rollout_correction.")
    check_verl_loss_settings(objective, config, loss_agg_mode)
    shape = per_token_tensor("log_prob", log_prob)
    for name, value in (("old_log_prob", old_log_prob), ("advantages", advantages)):
        per_token_tensor(name, value, shape, log_prob.device)
    scored = binary_response_mask(response_mask, shape, log_prob.device)
    check_log_probs("log_prob", log_prob, scored)
    check_log_probs("old_log_prob", old_log_prob, scored)
    per_sequence = sequence_advantages(advantages, scored)
    info = global_batch_info(config, scored, token_normalised(objective))

    kept = scored.any(-1)  # rows with no response token contribute nothing (verl's seq_mask does the same)
    if not bool(kept.any()):
        return (log_prob * 0).sum(), {}  # a zero that keeps the graph: its gradient is zero everywhere
    rows = kept.nonzero().squeeze(-1)
    scored_rows = scored[rows]
    masks = one_sample_masks(scored_rows)
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    lp = torch.where(scored_rows, log_prob[rows], zero)[:, None, :]
    lp_old = torch.where(scored_rows, old_log_prob[rows].detach().to(log_prob.dtype), zero)[:, None, :]
    inputs = LossInputs(masks=masks, batch=None,  # VeRL's loss sees no token ids; supported objectives read none
                        advantages=per_sequence[rows], lp_old=lp_old, extra=objective.extra(None, masks))
    loss = objective.loss(lp, inputs) * global_scale(objective, scored, info, kept_rows=rows.numel())
    with torch.no_grad():
        metrics = {f"dllm_fast/{name}": float(value) for name, value in objective.stats(lp.detach(), inputs).items()}
    return loss, metrics


# ---------------------------------------------------------------------------------------------------------
# The arguments


def check_verl_loss_settings(objective: Objective, config, loss_agg_mode: str = "token-mean") -> None:
    """Refuse verl actor settings that the objective's own options replace (they would be silently ignored):
    loss_agg_mode, the PPO clip ratios and loss_scale_factor must stay at verl's defaults (VERL_LOSS_DEFAULTS)."""
    given = {"loss_agg_mode": loss_agg_mode}
    if config is not None:
        given.update({name: _setting(config, name, default) for name, default in VERL_LOSS_DEFAULTS.items()
                      if name != "loss_agg_mode"})
    for name, value in given.items():
        default = VERL_LOSS_DEFAULTS[name]
        same = value == default if default is None or isinstance(default, str) else (
            isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value) == default)
        if not same:
            raise ValueError(f"actor.{name}={value!r} is verl's own loss setting, which {objective.name}'s loss "
                             f"replaces with its own ({_objective_options(objective)}); leave actor.{name} at "
                             f"verl's default {default!r} and set the objective's options instead.")


def _setting(config, name: str, default):
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def _objective_options(objective: Objective) -> str:
    shown = {name: value for name, (value, _) in objective.config.options().items()
             if "epsilon" in name or name in ("normalization", "dual_clip", "scale")}
    return ", ".join(f"{k}={v!r}" for k, v in shown.items()) or "its paper's normalisation"


def per_token_tensor(name: str, value, shape: tuple[int, int] | None = None,
                     device: torch.device | None = None) -> tuple[int, int]:
    """A floating-point torch tensor [batch, response_length] (of `shape` and on `device` when given); its shape."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [batch, response_length] with a floating dtype, "
                        f"got {type(value).__module__}.{type(value).__name__}; convert it with torch.as_tensor.")
    if value.dim() != 2:
        raise ValueError(f"{name} must have shape [batch, response_length], got {tuple(value.shape)} "
                         f"({value.dim()}-D).")
    if not value.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype (float32, float64, bfloat16), got {value.dtype}.")
    if shape is not None and tuple(value.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(value.shape)} but log_prob {shape}; VeRL passes [batch, "
                         "response_length] tensors.")
    if device is not None and value.device != device:
        raise ValueError(f"{name} is on {value.device} but log_prob on {device}; pass every tensor on one device.")
    return tuple(value.shape)


def binary_response_mask(mask, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """response_mask as bool: a torch tensor of `shape` holding only 0 and 1 (bool, integer or float)."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"response_mask must be a torch.Tensor of shape [batch, response_length] holding 0 and 1 "
                        f"(or bool), got {type(mask).__module__}.{type(mask).__name__}.")
    if mask.dim() != 2:
        raise ValueError(f"response_mask must have shape [batch, response_length], got {tuple(mask.shape)} "
                         f"({mask.dim()}-D).")
    if tuple(mask.shape) != shape:
        raise ValueError(f"response_mask has shape {tuple(mask.shape)} but log_prob {shape}; VeRL passes [batch, "
                         "response_length] tensors.")
    if mask.device != device:
        raise ValueError(f"response_mask is on {mask.device} but log_prob on {device}; pass every tensor on one "
                         "device.")
    if mask.is_complex():
        raise TypeError(f"response_mask has dtype {mask.dtype}; it must be bool or hold 0 and 1.")
    if mask.dtype != torch.bool:
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            n, i = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"response_mask[{n}, {i}] = {mask[n, i].item()}; it holds only 0 (not scored) and 1 "
                             "(a response token): a fractional weight would be read as 1.")
    return mask.to(torch.bool)


def check_log_probs(name: str, values: torch.Tensor, scored: torch.Tensor) -> None:
    """Log-probabilities where the mask scores: finite and <= 0; the error names the first bad row."""
    with torch.no_grad():
        bad = scored & ~(torch.isfinite(values) & (values <= 0))
        if bool(bad.any()):
            n, i = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"{name} row {n} (position {i}) holds {float(values[n, i])}, which is not a "
                             f"log-probability (finite, <= 0); check the scoring that produced {name}.")


def sequence_advantages(advantages: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """[B] float64: each row's advantage, the one value verl broadcasts over its response tokens (0 for a row with
    none). Refuses non-finite values and values that vary within a row, naming the row and the estimators that
    give one value per sequence."""
    with torch.no_grad():
        values = advantages.detach().double()
        bad = scored & ~torch.isfinite(values)
        if bool(bad.any()):
            n, i = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"advantages row {n} (position {i}) is {float(values[n, i])}; advantages must be "
                             "finite (check the rewards).")
        high = torch.where(scored, values, -math.inf).amax(-1)
        low = torch.where(scored, values, math.inf).amin(-1)
        spread = torch.where(scored.any(-1), high - low, 0.0)
        varies = spread > 1e-6 * torch.where(scored.any(-1), high.abs().maximum(low.abs()), 0.0).clamp_min(1.0)
        if bool(varies.any()):
            n = int(varies.nonzero()[0])
            raise ValueError(f"advantages vary within row {n} (from {float(low[n]):.6g} to {float(high[n]):.6g}): "
                             "dllm_fast objectives take one advantage per sequence. Use one of verl's outcome "
                             f"estimators (algorithm.adv_estimator in {', '.join(ONE_VALUE_PER_SEQUENCE)}); gae, "
                             "reinforce_plus_plus and remax give per-token advantages.")
        return torch.where(scored.any(-1), high, 0.0)


GLOBAL_FIELDS = ("dp_size", "batch_num_tokens", "global_batch_size")


def global_batch_info(config, scored: torch.Tensor, by_tokens: bool) -> dict[str, int]:
    """verl's `config.global_batch_info` checked: each of dp_size, batch_num_tokens and global_batch_size that is
    given (not None) is a positive whole number, and the global counts are at least this micro-batch's own
    (scored tokens, rows); loss_scale_factor must be None (verl's seq-mean-token-sum-norm setting). Returns the
    given fields as ints."""
    raw = _setting(config, "global_batch_info", None) if config is not None else None
    info = dict(raw or {})
    if info.get("loss_scale_factor") is not None:
        raise ValueError(f"global_batch_info loss_scale_factor={info['loss_scale_factor']!r} scales verl's "
                         "seq-mean-token-sum-norm aggregation, which the objective's normalisation replaces; leave "
                         "actor.loss_scale_factor unset (null).")
    checked = {}
    for name in GLOBAL_FIELDS:
        value = info.get(name)
        if value is None:
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or (
                value != int(value)):
            raise ValueError(f"global_batch_info {name}={value!r} must be a positive whole number (an int), got "
                             f"{type(value).__name__}.")
        if value <= 0:
            raise ValueError(f"global_batch_info {name}={value!r} must be positive: it divides the loss.")
        checked[name] = int(value)
    rows, tokens = scored.shape[0], int(scored.sum())
    if checked.get("global_batch_size", rows) < rows:
        raise ValueError(f"global_batch_info global_batch_size={checked['global_batch_size']} is smaller than this "
                         f"micro-batch's {rows} sequences; it counts the sequences of the whole mini-batch over "
                         "every data-parallel rank.")
    if checked.get("batch_num_tokens", tokens) < tokens:
        raise ValueError(f"global_batch_info batch_num_tokens={checked['batch_num_tokens']} is smaller than this "
                         f"micro-batch's {tokens} response tokens; it counts the response tokens of the whole "
                         "mini-batch over every data-parallel rank.")
    dp_size = checked.get("dp_size", 1)
    total = "batch_num_tokens" if by_tokens else "global_batch_size"
    if dp_size > 1 and total not in checked:
        raise ValueError(f"VeRL's global_batch_info has dp_size={dp_size} but no {total}; the loss cannot be "
                         "normalised over the global batch.")
    return checked


def one_sample_masks(scored: torch.Tensor) -> MonteCarloMasks:
    """n_t = 1 mean-field masks over the response: every response token masked and scored, weight 1."""
    N = scored.shape[0]
    ones = torch.ones(N, 1, dtype=torch.float64, device=scored.device)
    return MonteCarloMasks(masked=scored[:, None, :].clone(), counted=scored.clone(), weight=ones, t=ones.clone(),
                           num_masked=scored.sum(-1, keepdim=True), prompt_length=0, sampler="mean_field")


def token_normalised(objective: Objective) -> bool:
    """Whether the loss divides by the batch's scored tokens (rather than its sequences)."""
    return objective.name == "coupled_grpo" or getattr(objective.config, "normalization", None) == "token"


def global_scale(objective: Objective, scored: torch.Tensor, info: dict, *, kept_rows: int | None = None) -> float:
    """The factor that turns the objective's loss on this micro-batch's rows with response tokens (`kept_rows` of
    them; default all) into its share of the global batch's loss: for a sequence-normalised objective kept /
    global sequences x dp_size (an empty row counts as a sequence of zero loss), for a token-normalised one local
    / global tokens x dp_size, as VeRL's agg_loss scales its own micro-batch losses. Without global batch info
    the global batch is this micro-batch (one micro-batch on one rank)."""
    dp_size = info.get("dp_size", 1)
    rows = scored.shape[0]
    kept = rows if kept_rows is None else kept_rows
    if token_normalised(objective):
        total = info.get("batch_num_tokens")
        return 1.0 if total is None else int(scored.sum()) / total * dp_size
    total = info.get("global_batch_size")
    return kept / (rows if total is None else total) * (1 if total is None else dp_size)
