"""One launch: verl's own trainer (`verl.trainer.main_ppo`) with dllm_fast's plugin loaded and its defaults set.

    python -m dllm_fast.integrations.verl actor_rollout_ref.model.path=PATH data.train_files=... [verl overrides]
    python -m dllm_fast.integrations.verl --show-defaults      # what it adds, then exit

Every argument is a verl (Hydra) override, passed on unchanged. Before them come dllm_fast's defaults, each only
where the command does not set the same key (`DEFAULTS`, below): the rollout `rollout.name=dllm_fast` on one device
per replica, the policy loss (`dllm_fast_espo`, the project's default objective), the advantage estimator that
computes the objective's own advantages (espo's: GRPO's group mean, unscaled; `settings.advantage_estimator_for`), the
reward manager `dllm_fast`, and the actor engine `model_type=dllm_fast` where that engine is registered. The
objective is the engine section's (`override_config.dllm_fast.objective`, default espo) with the engine, else the
loss's; with the engine the policy loss defaults to that objective's (`dllm_fast_<objective>`, or verl's `vanilla`
for one not registered as a loss), which the engine accepts. The objective's rollout needs follow from it
(`record_unmask_step` for TraceRL's trajectory objective). On
the CPU platform (no accelerator) Ray is given `trainer.n_gpus_per_node` worker slots and enough logical CPUs for
verl's placement groups (integrations/verl/platform.py says why). Then it calls `verl.trainer.main_ppo.main()`,
which starts Ray (or joins the cluster of `ray_kwargs.ray_init.address`, for several nodes) and runs verl's task
runner there. Refuses to start, naming the cause, when the plugin did not load (a missing or mismatched verl), and,
before Ray starts, when the composed config asks for what the engine cannot honour (`check_config`). With the
engine, `actor.ppo_mini_batch_size` defaults to `data.train_batch_size`: with several data-parallel ranks verl's
V1 trainer keeps a prompt's completions together only within the whole step.
"""

from __future__ import annotations

import sys

ROLLOUT_DEFAULTS = {
    "actor_rollout_ref.rollout.name": "dllm_fast",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "1",
    "actor_rollout_ref.rollout.calculate_log_probs": "false",
    "++actor_rollout_ref.rollout.engine_kwargs.dllm_fast.block_length": "32",
}
DEFAULTS = {
    **ROLLOUT_DEFAULTS,
    "actor_rollout_ref.actor.policy_loss.loss_mode": "dllm_fast_espo",
    "algorithm.adv_estimator": "grpo",
    "reward.reward_manager.name": "dllm_fast",
}
ENGINE_DEFAULTS = {"++actor_rollout_ref.model.model_type": "dllm_fast",
                   "actor_rollout_ref.actor.strategy": "fsdp2",  # the engine shards with FSDP2 only
                   # one mini-batch per step: with several data-parallel ranks verl's V1 trainer keeps a prompt's
                   # completions together only within the whole step (settings.check_verl_config)
                   "actor_rollout_ref.actor.ppo_mini_batch_size": "${data.train_batch_size}"}
CPU_DEFAULTS = {
    "++ray_kwargs.ray_init.num_gpus": "${trainer.n_gpus_per_node}",
    "++ray_kwargs.ray_init.num_cpus": "32",
    "trainer.device": "cpu",
}


def key_of(override: str) -> str:
    """The config key an override sets ("+a.b=1" -> "a.b")."""
    return override.split("=", 1)[0].lstrip("+~")


def overrides(arguments: list[str]) -> list[str]:
    """dllm_fast's defaults not set by `arguments`, followed by `arguments` (module docstring)."""
    from dllm_fast.integrations import verl_plugin

    if verl_plugin.ERROR is not None:
        raise SystemExit(f"dllm_fast's verl plugin did not load: {verl_plugin.ERROR}")
    chosen = dict(DEFAULTS)
    if verl_plugin.REGISTERED.get("engine"):
        chosen.update(ENGINE_DEFAULTS)
    from verl.plugin.platform import get_platform

    from dllm_fast.integrations.verl.platform import PLATFORM_NAME

    if get_platform().device_name == PLATFORM_NAME:
        chosen.update(CPU_DEFAULTS)
    given = {key_of(a) for a in arguments}
    engine = bool(verl_plugin.REGISTERED.get("engine")) and _value(
        arguments, "actor_rollout_ref.model.model_type", "dllm_fast") == "dllm_fast"
    name = _objective_name(arguments, chosen["actor_rollout_ref.actor.policy_loss.loss_mode"], engine=engine)
    if engine and name is not None:  # the engine runs the section's objective: the loss named after it, or verl's
        from dllm_fast.integrations.verl.losses import PREFIX, SUPPORTED

        chosen["actor_rollout_ref.actor.policy_loss.loss_mode"] = PREFIX + name if name in SUPPORTED else "vanilla"
    objective = _objective(name)
    if objective is not None and objective.needs_unmask_step:
        chosen["++actor_rollout_ref.rollout.engine_kwargs.dllm_fast.record_unmask_step"] = "true"
    chosen.update(_advantage_defaults(objective))
    added = [f"{key}={value}" for key, value in chosen.items() if key_of(key) not in given]
    return added + list(arguments)


def _value(arguments: list[str], key: str, default: str) -> str:
    return next((a.split("=", 1)[1] for a in arguments if key_of(a) == key), default)


def _objective_name(arguments: list[str], default_loss: str, *, engine: bool) -> str | None:
    """The objective trained: the engine's section's (default espo), else the policy loss's; None for a loss that
    is not dllm_fast's."""
    from dllm_fast.integrations.verl.losses import PREFIX
    from dllm_fast.integrations.verl.settings import DEFAULT_OBJECTIVE, SECTION_PATH

    if engine:
        return _value(arguments, f"{SECTION_PATH}.objective", DEFAULT_OBJECTIVE)
    loss = _value(arguments, "actor_rollout_ref.actor.policy_loss.loss_mode", default_loss)
    return loss[len(PREFIX):] if loss.startswith(PREFIX) else None


def _objective(name: str | None):
    """The objective of that name with its defaults, or None (no name, or an unknown one: the engine, or verl's
    loss registry, refuses it by name)."""
    from dllm_fast import objectives

    if name is None:
        return None
    try:
        return objectives.get(name)
    except ValueError:
        return None


def _advantage_defaults(objective) -> dict[str, str]:
    """verl's advantage settings that compute the objective's own advantages (settings.advantage_estimator_for);
    empty where none of verl's estimators does."""
    from dllm_fast.integrations.verl.settings import advantage_estimator_for

    settings = advantage_estimator_for(objective) if objective is not None else None
    return dict(item.split("=", 1) for item in settings.split()) if settings else {}


def main(argv: list[str] | None = None) -> None:
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        import verl  # noqa: F401  (loads the plugin through its entry point)
    except ImportError as error:
        raise SystemExit(f"verl is not installed ({error}): pip install \"dllm_fast[verl]\".") from None
    if arguments == ["--show-defaults"]:
        print("\n".join(overrides([])))
        return
    from verl.trainer import main_ppo

    chosen = overrides(arguments)
    check_config(chosen)
    sys.argv = [f"{sys.argv[0]}"] + chosen
    main_ppo.main()


def check_config(arguments: list[str]) -> None:
    """The driver's check of the config verl's main_ppo composes from `arguments`, before Ray starts
    (`settings.check_verl_config`: the settings the engine cannot honour or verl would silently ignore, each
    named); exits with its one-line message."""
    import os

    from hydra import compose, initialize_config_dir
    from verl import trainer

    from dllm_fast.integrations.verl.settings import check_verl_config

    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(trainer.__file__), "config"),
                               version_base=None):
        config = compose(config_name="ppo_trainer", overrides=arguments)
    try:
        settings = check_verl_config(config)
        rollout = config.actor_rollout_ref.rollout
        if rollout.name == "dllm_fast":
            _check_rollout(rollout, None if settings is None else settings.objective)
    except (TypeError, ValueError) as error:
        raise SystemExit(f"dllm_fast: {error}") from None


def _check_rollout(rollout, objective) -> None:
    """The rollout's settings as each worker will read them (`rollout.rollout_settings`), and, with the engine,
    whether its objective's likelihood takes rollouts decoded so (`Objective.check_rollouts`: JustGRPO's
    left-to-right order)."""
    import dataclasses

    from dllm_fast.integrations.verl.rollout import SETTINGS_PATH, rollout_settings

    settings = rollout_settings(rollout)
    if objective is None:
        return
    config = dataclasses.replace(settings.generate, temperature=float(rollout.temperature))
    try:
        objective.check_rollouts(config)
    except ValueError as error:
        raise ValueError(f"{SETTINGS_PATH} (objective {objective.name}): {error}") from None


if __name__ == "__main__":
    main()
