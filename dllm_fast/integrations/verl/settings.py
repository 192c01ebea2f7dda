"""The dllm_fast actor engine's settings in a verl config, and the verl settings it refuses (no verl import here:
the checks run on plain dicts and OmegaConf configs alike, in the driver before Ray starts and in each worker).

The engine's section is `actor_rollout_ref.model.override_config.dllm_fast`:

    actor_rollout_ref.model.model_type=dllm_fast                 # selects the engine (verl's EngineRegistry)
    actor_rollout_ref.actor.strategy=fsdp2
    +actor_rollout_ref.model.override_config.dllm_fast.objective=espo
    +actor_rollout_ref.model.override_config.dllm_fast.options.n_t=8          # any option of the objective
    +actor_rollout_ref.model.override_config.dllm_fast.preset=sudoku          # an objective preset (optional)
    +actor_rollout_ref.model.override_config.dllm_fast.micro_batch=16         # pairs per backward graph
    +actor_rollout_ref.model.override_config.dllm_fast.seed=0                 # the masks' seed

Why there: `override_config` is the one free-form part of the model's config, and verl hands the model config
verbatim to every worker that builds this model (actor, reference, rollout), so the objective's sampler and n_t
reach each of them from one place, with no schema of verl's to extend. verl also copies override_config onto the HF
config; dllm_fast's model types (`model_types.py`) accept the section there. A model of a type transformers knows
(the HF adapter) does not: give it `+actor_rollout_ref.model.override_config.model_config={}` as well, which makes
verl copy only that sub-dict onto the HF config.

Keys: objective (default "espo"), options (the objective's options, as `objectives.get(name, **options)`), preset,
micro_batch ((sequence, sample) pairs per backward graph; default: verl's `ppo_micro_batch_size_per_gpu` rows times
n_t, or `ppo_max_token_len_per_gpu` tokens' worth of pairs with dynamic batch sizes), seed (default the engine's
`seed`), check_advantages (default true: verl's advantages must equal the objective's, see engine.py), and
`rollout` (the rollout's own section, read by the rollout; the engine checks only that its temperature, when
given, is verl's `rollout.temperature`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from dllm_fast import objectives
from dllm_fast.integrations.verl.losses import ONE_VALUE_PER_SEQUENCE, PREFIX, VERL_LOSS_DEFAULTS
from dllm_fast.objectives import Objective

MODEL_TYPE = "dllm_fast"  # actor_rollout_ref.model.model_type
SECTION_PATH = "actor_rollout_ref.model.override_config.dllm_fast"
KEYS = ("objective", "options", "preset", "micro_batch", "seed", "check_advantages", "rollout")
DEFAULT_OBJECTIVE = "espo"
STRATEGIES = ("fsdp2",)


@dataclass
class EngineSettings:
    """The engine's section, checked: the objective built with its options, and the engine's own settings."""

    objective: Objective
    micro_batch: int | None = None
    seed: int = 42
    check_advantages: bool = True
    rollout: dict = field(default_factory=dict)

    @classmethod
    def from_section(cls, section: Any, *, default_seed: int = 42) -> "EngineSettings":
        """Parse `override_config.dllm_fast` (a dict or None); every error names the key under SECTION_PATH."""
        section = _plain(section) if section is not None else {}
        if not isinstance(section, dict):
            raise TypeError(f"{SECTION_PATH} must be a mapping of {', '.join(KEYS)}, got {type(section).__name__}.")
        unknown = sorted(set(section) - set(KEYS))
        if unknown:
            raise ValueError(f"{SECTION_PATH} has no key {', '.join(map(repr, unknown))}; its keys are "
                             f"{', '.join(KEYS)}.")
        name = section.get("objective", DEFAULT_OBJECTIVE)
        if not isinstance(name, str) or name not in objectives.available():
            raise ValueError(f"{SECTION_PATH}.objective={name!r} is not a dllm_fast objective; available: "
                             f"{', '.join(objectives.available())}.")
        options = section.get("options") or {}
        if not isinstance(options, dict):
            raise TypeError(f"{SECTION_PATH}.options must be a mapping of {name}'s options, got "
                            f"{type(options).__name__}.")
        try:
            objective = objectives.get(name, preset=section.get("preset"), **options)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{SECTION_PATH} (objective {name!r}): {error}") from None
        if getattr(objective, "needs_step_predictions", False):  # MDPO: a reward per denoising step
            raise ValueError(f"{SECTION_PATH}.objective={name!r} rewards the model's one-step prediction at every "
                             "denoising step and trains on the steps with the largest advantage; verl's rollouts and "
                             "reward manager score final completions only: train it with `python -m dllm_fast "
                             "train --objective mdpo`.")
        micro_batch = section.get("micro_batch")
        if micro_batch is not None:
            micro_batch = _positive_int(f"{SECTION_PATH}.micro_batch", micro_batch,
                                        "(sequence, sample) pairs per backward graph")
        seed = section.get("seed", default_seed)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"{SECTION_PATH}.seed={seed!r} must be an int >= 0 (the masks' seed).")
        check = section.get("check_advantages", True)
        if not isinstance(check, bool):
            raise TypeError(f"{SECTION_PATH}.check_advantages={check!r} must be true or false.")
        rollout = section.get("rollout") or {}
        if not isinstance(rollout, dict):
            raise TypeError(f"{SECTION_PATH}.rollout must be a mapping (the rollout's settings), got "
                            f"{type(rollout).__name__}.")
        return cls(objective=objective, micro_batch=micro_batch, seed=seed, check_advantages=check, rollout=rollout)


def _positive_int(name: str, value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1 ({what}).")
    return int(value)


def _plain(value):
    """OmegaConf containers as plain dicts and lists (other values as given)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - verl brings omegaconf
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _get(config, dotted: str, default=None):
    node = config
    for part in dotted.split("."):
        if node is None:
            return default
        node = node.get(part) if isinstance(node, dict) or hasattr(node, "get") else getattr(node, part, None)
    return default if node is None else node


# ---------------------------------------------------------------------------------------------------------
# The verl settings the engine cannot honour


def check_actor_settings(objective: Objective, actor) -> None:
    """Refuse verl actor settings (an `ActorConfig` or its dict) that the engine would silently override: the
    loss settings the objective replaces (`losses.check_verl_loss_settings`), a policy loss other than verl's
    default or this objective's registered one, verl's entropy bonus and KL loss (the update runs the
    objective's own loss, which has neither; the objective holds its own KL, scored on the same masks)."""
    from dllm_fast.integrations.verl.losses import check_verl_loss_settings

    check_verl_loss_settings(objective, actor, _get(actor, "loss_agg_mode", VERL_LOSS_DEFAULTS["loss_agg_mode"]))
    mode = _get(actor, "policy_loss.loss_mode", "vanilla")
    if mode not in ("vanilla", PREFIX + objective.name):
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.loss_mode={mode!r}: the dllm_fast engine runs "
                         f"{objective.name}'s own loss; leave loss_mode at 'vanilla' (or {PREFIX + objective.name!r}) "
                         f"and choose the objective with {SECTION_PATH}.objective.")
    entropy = _get(actor, "entropy_coeff", 0)
    if entropy:
        raise ValueError(f"actor_rollout_ref.actor.entropy_coeff={entropy!r}: the dllm_fast engine's update runs the "
                         "objective's own loss, which has no entropy bonus (the entropy verl logs, actor/entropy, is "
                         "only reported); set it to 0.")
    if _get(actor, "use_kl_loss", False):
        raise ValueError("actor_rollout_ref.actor.use_kl_loss=true adds verl's per-token KL, which the dllm_fast "
                         "engine does not compute; the objective's own KL is scored on its masks: set "
                         f"{SECTION_PATH}.options.beta (espo, diffu_grpo, coupled_grpo) and use_kl_loss=false.")


def advantage_estimator_for(objective: Objective) -> str | None:
    """verl's advantage settings that compute `objective`'s advantages, or None when none of verl's does."""
    c = objective.config
    if getattr(objective, "tree_shape", None) is not None:  # d_treerpo: a tree's sibling advantages, none of verl's
        return None
    if c.advantage == "mean" and not c.scale_rewards:
        return "algorithm.adv_estimator=grpo algorithm.norm_adv_by_std_in_grpo=false"
    if c.advantage == "mean" and c.scale_rewards and not c.population_std and c.std_epsilon == 1e-6:
        return "algorithm.adv_estimator=grpo algorithm.norm_adv_by_std_in_grpo=true"
    if c.advantage == "leave_one_out" and not c.scale_rewards:
        return "algorithm.adv_estimator=rloo"
    return None


def check_verl_config(config) -> EngineSettings | None:
    """The driver's check of a whole verl PPO config (a dict or OmegaConf) that selects the engine: the settings
    the engine cannot see or would override, each error naming the setting. Returns the engine's settings, or
    None when the config does not select the engine (model_type is not dllm_fast)."""
    if _get(config, "actor_rollout_ref.model.model_type") != MODEL_TYPE:
        return None
    settings = EngineSettings.from_section(_get(config, "actor_rollout_ref.model.override_config.dllm_fast"),
                                           default_seed=_get(config, "actor_rollout_ref.actor.fsdp_config.seed", 42))
    objective = settings.objective
    strategy = _get(config, "actor_rollout_ref.actor.strategy", "fsdp")
    if strategy not in STRATEGIES:
        raise ValueError(f"actor_rollout_ref.actor.strategy={strategy!r}: the dllm_fast engine shards with FSDP2 (its "
                         "fused LM head reads the head's weight outside the forward, which FSDP1's flat parameters "
                         "do not allow); set actor_rollout_ref.actor.strategy=fsdp2.")
    check_actor_settings(objective, _get(config, "actor_rollout_ref.actor", {}))
    estimator = _get(config, "algorithm.adv_estimator", "gae")
    if estimator not in ONE_VALUE_PER_SEQUENCE:
        raise ValueError(f"algorithm.adv_estimator={estimator!r} is not an outcome estimator with one advantage per "
                         f"sequence, which {objective.name} takes; use one of {', '.join(ONE_VALUE_PER_SEQUENCE)} "
                         f"({advantage_estimator_for(objective) or 'grpo'} matches its options).")
    if settings.check_advantages:
        _check_estimator(objective, estimator, _get(config, "algorithm.norm_adv_by_std_in_grpo", True))
    if _get(config, "algorithm.use_kl_in_reward", False):
        raise ValueError("algorithm.use_kl_in_reward=true needs verl's per-token reference log-probs, which the "
                         "dllm_fast engine does not produce; set it to false and give the objective its own KL "
                         f"({SECTION_PATH}.options.beta).")
    if _get(config, "algorithm.rollout_correction.bypass_mode", False):
        raise ValueError("algorithm.rollout_correction.bypass_mode=true replaces the old policy's scoring with the "
                         "rollout's log-probs, which a diffusion rollout does not give; leave it off.")
    group = _get(config, "actor_rollout_ref.rollout.n", 1)
    if group < 2:
        raise ValueError(f"actor_rollout_ref.rollout.n={group}: {objective.name}'s advantages compare the completions "
                         "of each prompt (its group); with one completion every advantage is 0. Use n >= 2.")
    temperature = settings.rollout.get("temperature")
    verl_temperature = _get(config, "actor_rollout_ref.rollout.temperature", 1.0)
    if temperature is not None and not _same_number(temperature, verl_temperature):
        raise ValueError(f"{SECTION_PATH}.rollout.temperature={temperature!r} but actor_rollout_ref.rollout."
                         f"temperature={verl_temperature!r}: give the rollout's temperature once, as verl's "
                         "rollout.temperature.")
    mini_batch, batch = (_get(config, "actor_rollout_ref.actor.ppo_mini_batch_size"),
                         _get(config, "data.train_batch_size"))
    world = _world(config)
    if _get(config, "trainer.use_v1", True):
        # verl's V1 trainer balances every step's rows over the data-parallel ranks by length, whatever their
        # prompt (it does not read trainer.balance_batch); each rank then cuts its share into mini-batches. Only the
        # whole step holds each prompt's group, which the engine regathers across the ranks (engine._whole_groups).
        if world > 1 and mini_batch != batch:
            raise ValueError(f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch} with {world} data-parallel "
                             "ranks: verl's V1 trainer spreads a step's rows over the ranks by length whatever their "
                             f"prompt, so only the whole step holds each prompt's completions, which {objective.name} "
                             f"needs together; set ppo_mini_batch_size=data.train_batch_size ({batch}), one "
                             "mini-batch per step (ppo_epochs for more updates).")
        if world > 1 and batch % world:
            raise ValueError(f"data.train_batch_size={batch} prompts for {world} data-parallel ranks "
                             "(trainer.nnodes x trainer.n_gpus_per_node): the engine gives each rank the same number "
                             f"of whole prompt groups; use a multiple of {world}.")
    elif _get(config, "trainer.balance_batch", True) and not (mini_batch == batch and world == 1):
        raise ValueError("trainer.balance_batch=true reorders the batch's rows across data-parallel ranks and "
                         f"mini-batches without regard to prompt groups, and {objective.name} needs each prompt's "
                         "completions together; set trainer.balance_batch=false.")
    if _get(config, "actor_rollout_ref.actor.shuffle", False):
        raise ValueError("actor_rollout_ref.actor.shuffle=true cuts mini-batches across prompt groups; "
                         f"{objective.name} needs each prompt's completions in one mini-batch: set it to false.")
    return settings


def _check_estimator(objective: Objective, estimator: str, norm_by_std) -> None:
    """Refuse, before any rollout, grpo or rloo set otherwise than to the objective's advantages (the engine would
    refuse them on its first update, `check_advantages`); other estimators are left to that check."""
    if estimator not in ("grpo", "rloo"):
        return
    match = advantage_estimator_for(objective)
    given = f"algorithm.adv_estimator={estimator}" + (
        f" algorithm.norm_adv_by_std_in_grpo={str(bool(norm_by_std)).lower()}" if estimator == "grpo" else "")
    if match != given:
        fix = (f"set {match}" if match else "no verl estimator computes them: set the objective's options "
               f"(advantage, scale_rewards, std_epsilon, population_std) to grpo's or rloo's, or {SECTION_PATH}."
               "check_advantages=false")
        raise ValueError(f"{given} does not compute {objective.name}'s advantages (advantage="
                         f"{objective.config.advantage!r}, scale_rewards={objective.config.scale_rewards}), which "
                         f"the engine trains on: {fix}.")


def _world(config) -> int:
    return int(_get(config, "trainer.nnodes", 1)) * int(_get(config, "trainer.n_gpus_per_node", 1))


def _same_number(a, b) -> bool:
    try:
        return math.isclose(float(a), float(b), rel_tol=0, abs_tol=0)
    except (TypeError, ValueError):
        return False
