"""dllm_fast's verl plugin: importing this module registers dllm_fast in verl's registries.

verl imports it by itself in every process that imports verl (the driver, the task runner, every Ray worker, on
every node), through the `verl.plugins` entry point that `pip install "dllm_fast[verl]"` installs (pyproject.toml;
verl/__init__.py loads the group's entry points unless VERL_USE_EXTERNAL_PLUGINS=none). No environment variable is
needed; VERL_USE_EXTERNAL_MODULES=dllm_fast.integrations.verl_plugin does the same for a checkout that is not
installed. What it registers:

- the objectives as policy losses `dllm_fast_<name>` (integrations/verl/losses.py);
- the rollout `rollout.name=dllm_fast` (integrations/verl/rollout.py, replica.py);
- the reward manager `reward.reward_manager.name=dllm_fast` (integrations/verl/rewards.py);
- the "cpu" platform (integrations/verl/platform.py), and on it verl's FSDP engines;
- dllm_fast's model types for transformers' AutoConfig, so verl reads their config.json
  (integrations/verl/transformers_view.py), and LLaDA as an AutoModelForCausalLM for verl's stock engine;
- the actor engine `model_type=dllm_fast` (`dllm_fast.integrations.verl.engine.register_engine()`) where that
  module exists.

verl swallows an entry point's exceptions (logged at debug level), so this module catches its own: `ERROR` holds
the first failure and it is logged as a warning; `python -m dllm_fast.integrations.verl` refuses to start with it.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

SUPPORTED_VERL = ((0, 9, 1), (0, 10, 0))  # [lowest, first unsupported)
logger = logging.getLogger("dllm_fast.verl")

REGISTERED: dict[str, object] = {}
ERROR: str | None = None


def verl_version_problem() -> str | None:
    """Why the installed verl cannot take the plugin, or None."""
    try:
        import verl
    except ImportError as error:
        return f"verl is not installed ({error}); pip install \"dllm_fast[verl]\"."
    version = getattr(verl, "__version__", "0")
    numbers = tuple(int(part) for part in version.split("+")[0].split(".")[:3] if part.isdigit())
    low, high = SUPPORTED_VERL
    if not low <= numbers < high:
        return (f"verl {version} is installed; dllm_fast's plugin supports verl >= {'.'.join(map(str, low))}, < "
                f"{'.'.join(map(str, high))}: pip install \"dllm_fast[verl]\".")
    return None


def register() -> dict[str, object]:
    """Register everything (module docstring); returns what was registered, by kind."""
    from dllm_fast.integrations.verl import platform  # noqa: F401  registers PlatformCPU
    from dllm_fast.integrations.verl.losses import register_verl_losses
    from dllm_fast.integrations.verl.rewards import register_reward_manager
    from dllm_fast.integrations.verl.model_types import register_model_types

    registered: dict[str, object] = {"platform": platform.PLATFORM_NAME}
    registered["model_types"] = register_model_types()
    registered["losses"] = register_verl_losses()
    registered["rollout"] = register_rollout()
    registered["reward_manager"] = register_reward_manager()
    registered["engine"] = register_engine()
    return registered


def register_rollout() -> str:
    """`rollout.name=dllm_fast`: the in-worker rollout by its import path (verl's registry imports it when a
    worker builds its rollout), the replica by a loader."""
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from dllm_fast.integrations.verl.rollout import ROLLOUT_NAME, DllmFastRollout

    _ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{DllmFastRollout.__module__}.{DllmFastRollout.__qualname__}"
    RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)
    return ROLLOUT_NAME


def _load_replica():
    from dllm_fast.integrations.verl.replica import DllmFastReplica

    return DllmFastReplica


def register_engine() -> str | None:
    """The verl-engine workstream's `register_engine()` where dllm_fast.integrations.verl.engine exists (None
    until it does). Also verl's FSDP engines on the "cpu" platform, when that is the platform in use."""
    from verl.plugin.platform import get_platform

    from dllm_fast.integrations.verl.platform import PLATFORM_NAME, register_cpu_engines

    if get_platform().device_name == PLATFORM_NAME:
        from dllm_fast.integrations.verl.transformers_view import register_causal_lm

        register_cpu_engines()
        register_causal_lm()
    if importlib.util.find_spec("dllm_fast.integrations.verl.engine") is None:
        return None
    engine = importlib.import_module("dllm_fast.integrations.verl.engine")
    if not hasattr(engine, "register_engine"):
        return None
    engine.register_engine()
    return "dllm_fast"


def _load() -> None:
    global ERROR, REGISTERED
    problem = verl_version_problem()
    if problem is not None:
        ERROR = problem
        logger.warning("dllm_fast's verl plugin is not loaded: %s", problem)
        return
    try:
        REGISTERED = register()
    except Exception as error:  # verl would hide it: say it, and keep it for the launcher
        ERROR = f"{type(error).__name__}: {error}"
        logger.warning("dllm_fast's verl plugin failed to register: %s", ERROR, exc_info=True)


_load()
