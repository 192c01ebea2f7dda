"""One launch: verl's own trainer (`verl.trainer.main_ppo`) with dllm_fast's plugin loaded and its defaults set.

    python -m dllm_fast.integrations.verl actor_rollout_ref.model.path=PATH data.train_files=... [verl overrides]
    python -m dllm_fast.integrations.verl --show-defaults      # what it adds, then exit

Every argument is a verl (Hydra) override, passed on unchanged. Before them come dllm_fast's defaults, each only
where the command does not set the same key (`DEFAULTS`, below): the rollout `rollout.name=dllm_fast` on one device
per replica, the policy loss (`dllm_fast_espo`, the project's default objective), the advantage estimator that
computes the objective's own advantages (espo's: GRPO's group mean, unscaled; `settings.advantage_estimator_for`), the
reward manager `dllm_fast`, and the actor engine `model_type=dllm_fast` where that engine is registered. The
objective's rollout needs follow from the loss (`record_unmask_step` for TraceRL's trajectory objective). On
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
    loss = next((a.split("=", 1)[1] for a in arguments if key_of(a) == "actor_rollout_ref.actor.policy_loss."
                 "loss_mode"), chosen["actor_rollout_ref.actor.policy_loss.loss_mode"])
    if _needs_unmask_step(loss):
        chosen["++actor_rollout_ref.rollout.engine_kwargs.dllm_fast.record_unmask_step"] = "true"
    chosen.update(_advantage_defaults(arguments, loss, engine=bool(verl_plugin.REGISTERED.get("engine"))))
    added = [f"{key}={value}" for key, value in chosen.items() if key_of(key) not in given]
    return added + list(arguments)


def _advantage_defaults(arguments: list[str], loss_mode: str, *, engine: bool) -> dict[str, str]:
    """verl's advantage settings that compute the objective's own advantages (settings.advantage_estimator_for):
    the engine's objective (its section's, default espo), else the loss's. Empty where none of verl's estimators
    does, or the name is unknown (the engine, or verl's loss registry, then refuses it by name)."""
    from dllm_fast import objectives
    from dllm_fast.integrations.verl.losses import PREFIX
    from dllm_fast.integrations.verl.settings import DEFAULT_OBJECTIVE, SECTION_PATH, advantage_estimator_for

    if engine:
        name = next((a.split("=", 1)[1] for a in arguments if key_of(a) == f"{SECTION_PATH}.objective"),
                    DEFAULT_OBJECTIVE)
    elif loss_mode.startswith(PREFIX):
        name = loss_mode[len(PREFIX):]
    else:
        return {}
    try:
        settings = advantage_estimator_for(objectives.get(name))
    except ValueError:
        return {}
    return dict(item.split("=", 1) for item in settings.split()) if settings else {}


def _needs_unmask_step(loss_mode: str) -> bool:
    from dllm_fast import objectives
    from dllm_fast.integrations.verl.losses import PREFIX

    if not loss_mode.startswith(PREFIX):
        return False
    try:
        return objectives.get(loss_mode[len(PREFIX):]).needs_unmask_step
    except ValueError:
        return False  # an unknown name: verl's policy-loss registry refuses it by name


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
        check_verl_config(config)
    except (TypeError, ValueError) as error:
        raise SystemExit(f"dllm_fast: {error}") from None


if __name__ == "__main__":
    main()
