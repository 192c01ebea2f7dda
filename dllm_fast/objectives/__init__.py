"""The published RL objectives for masked diffusion LMs, each a short module over the likelihood engine's lp.

    from dllm_fast import objectives
    objective = objectives.get("bgpo", n_t=8)          # the paper's defaults, with overrides
    objectives.get("spg", preset="sudoku")             # a named setting of the official scripts
    out = objective.backward(model, batch, micro_batch=4, generator=torch.Generator().manual_seed(0))
    out.loss, out.stats                                # gradients are in model's .grad
    for update in objective.plan_updates(model, batch, moved=[False, True], generator=g, micro_batch=4):
        objective.backward(model, batch, update, micro_batch=4); optimizer.step()   # mu = 2 inner updates

| name | paper | estimator | ratio / clip | KL |
|---|---|---|---|---|
| diffu_grpo | d1 | mean-field, prompt perturbation, n_t 1 | token, two-sided eps | k3 per token |
| wd1 | wd1 | mean-field, n_t 1 | none (group softmax(+-A) weights) | none |
| vrpo_ol | BGPO Eqs. 3-7 | ELBO, n_t 4 | exp(ELBO - ELBO_old) | none |
| bgpo | BGPO | ELBO, n_t 16, separable bound | (1 + d) or e^d per sample | none |
| spg | SPG | block masks, ELBO / EUBO / mixture | none | none |
| espo | ESPO | complementary pairs | exp(dELBO / L), two-sided clip | k2 on the ELBO |
| rspo | RSPO | ELBO vs reference, n_t 2 | none (residual weights) | implicit |
| coupled_grpo | DiffuCoder | full mask + complementary pairs, n_t 3 | token, on the estimate | k3 per token |
| gdpo | GDPO | SDMC: Gauss quadrature in t, n_t 3 | exp(dELBO / L_n), two-sided clip | none |
| tracerl | TraceRL | the rollout's own decoding states (needs unmask_step) | token, per state | k3 vs the old policy |
| ebpo | LLaDA2.1 (DARE's) | composite block ELBO, a noise level per (sample, block), n_t 16; block models | exp(E - E_old), clipped once | k1/k2/k3 on E (off) |
| justgrpo | JustGRPO | exact left-to-right likelihood, one sample per position (block-1 rollouts) | token, two-sided eps | none |
| vrpo_dpo | LLaDA 1.5 (offline VRPO) | ELBO, n_t 4, stratified counts; preference pairs, no rollout | none (DPO) | implicit (DPO) |
| cj_grpo | CJ-GRPO | the rollout's own decoding states, every step (unmask_step) | token, two-sided eps | k3 per token |
| mdpo | MDPO | the rollout's recorded states x_t, target the one-step prediction x_hat_t; top-k steps by per-step A | token, two-sided eps | k2 per token vs ref |
| d_treerpo | d-TreeRPO | per tree edge: one forward on the parent canvas (tree rollouts) + self-distillation | token, two-sided eps 0.4 | k3 per token vs base |
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dllm_fast._lazy import lazy_attributes

if TYPE_CHECKING:
    from dllm_fast.objectives.advantages import group_advantages, zero_std_fraction
    from dllm_fast.objectives.base import InnerUpdate, LossInputs, Objective, ObjectiveConfig, ObjectiveOutput
    from dllm_fast.objectives.bgpo import BGPO, BGPOConfig
    from dllm_fast.objectives.coupled_grpo import CoupledGRPO, CoupledGRPOConfig
    from dllm_fast.objectives.diffu_grpo import DiffuGRPO, DiffuGRPOConfig
    from dllm_fast.objectives.espo import ESPO, ESPOConfig
    from dllm_fast.objectives.gdpo import GDPO, GDPOConfig
    from dllm_fast.objectives.rspo import RSPO, RSPOConfig
    from dllm_fast.objectives.spg import SPG, SPGConfig
    from dllm_fast.objectives.tracerl import TraceRL, TraceRLConfig
    from dllm_fast.objectives.vrpo_ol import VRPOOL, VRPOOLConfig
    from dllm_fast.objectives.wd1 import WD1, WD1Config
    # -- EBPO, JustGRPO, offline VRPO (the likelihood engine's family) --
    from dllm_fast.objectives.ebpo import EBPO, EBPOConfig
    from dllm_fast.objectives.justgrpo import JustGRPO, JustGRPOConfig
    from dllm_fast.objectives.vrpo_dpo import VRPODPO, VRPODPOConfig
    # -- CJ-GRPO --
    from dllm_fast.objectives.cj_grpo import CJGRPO, CJGRPOConfig
    # -- MDPO (the rollout's step record) --
    from dllm_fast.objectives.mdpo import MDPO, MDPOConfig
    # -- d-TreeRPO (tree rollouts) --
    from dllm_fast.objectives.d_treerpo import DTreeRPO, DTreeRPOConfig, TreeBatch, tree_batch

# The built-in objectives by name, each loaded (with torch and the likelihood engine) when first asked for, so that
# listing the names (`train --help`) imports nothing heavy. Each class's `name` is its key here (a test checks).
_BUILT_IN: dict[str, str] = {
    "diffu_grpo": "diffu_grpo:DiffuGRPO", "wd1": "wd1:WD1", "vrpo_ol": "vrpo_ol:VRPOOL", "bgpo": "bgpo:BGPO",
    "spg": "spg:SPG", "espo": "espo:ESPO", "rspo": "rspo:RSPO", "coupled_grpo": "coupled_grpo:CoupledGRPO",
    "gdpo": "gdpo:GDPO", "tracerl": "tracerl:TraceRL",
    # -- EBPO, JustGRPO, offline VRPO (the likelihood engine's family) --
    "ebpo": "ebpo:EBPO", "justgrpo": "justgrpo:JustGRPO", "vrpo_dpo": "vrpo_dpo:VRPODPO",
    # -- CJ-GRPO --
    "cj_grpo": "cj_grpo:CJGRPO",
    # -- MDPO (the rollout's step record) --
    "mdpo": "mdpo:MDPO",
    # -- d-TreeRPO (tree rollouts) --
    "d_treerpo": "d_treerpo:DTreeRPO",
}
# Every other public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    **{f"{cls}{suffix}": module for module, cls in (entry.split(":") for entry in _BUILT_IN.values())
       for suffix in ("", "Config")},
    **{name: "base" for name in ("InnerUpdate", "LossInputs", "Objective", "ObjectiveConfig", "ObjectiveOutput")},
    "group_advantages": "advantages", "zero_std_fraction": "advantages",
    "preference_batch": "vrpo_dpo",
    # -- MDPO --
    "StepBatch": "mdpo",
    "TreeBatch": "d_treerpo", "tree_batch": "d_treerpo",
}
_REGISTRY: dict[str, type] = {}


def register(cls: type[Objective]) -> type[Objective]:
    """Make an Objective subclass available to `get` by its `name` (usable as a class decorator)."""
    from dllm_fast.objectives.base import Objective

    if not (isinstance(cls, type) and issubclass(cls, Objective)) or not cls.name:
        raise TypeError(f"register takes an Objective subclass with a name, got {cls!r}.")
    known = _REGISTRY.get(cls.name) or (_built_in(cls.name) if cls.name in _BUILT_IN else None)
    if known is not None and known is not cls:
        raise ValueError(f"an objective named {cls.name!r} is already registered ({known.__name__}).")
    _REGISTRY[cls.name] = cls
    return cls


def available() -> tuple[str, ...]:
    """The registered objective names (the built-in ones first), without loading any of them."""
    return (*_BUILT_IN, *(name for name in _REGISTRY if name not in _BUILT_IN))


def get(name: str, *, preset: str | None = None, **overrides: Any) -> Objective:
    """The objective `name` with its paper's defaults, or the named `preset` of its official scripts (e.g.
    spg's "sudoku"; `presets(name)`), any config field overridden by keyword."""
    cls = _class(name)
    if preset is not None and not isinstance(preset, str):
        raise TypeError(f"preset={preset!r} must be one preset's name (a str) or None; {name}'s presets: "
                        f"{', '.join(cls.presets) or 'none'}.")
    return cls(preset=preset, **overrides)


def nearest_valid_n_t(name: str, n_t: int, *, down: bool = False, limit: int = 1 << 16, **options: Any) -> int | None:
    """The n_t nearest `n_t` (at or above it; at or below with down=True) that objective `name` accepts with
    `options` (complementary pairs need an even n_t, a full mask plus pairs an odd one, quadrature a multiple of
    its nodes); None when there is none within [1, limit]. Arithmetic on the mask settings the options give
    (`MaskSpec.valid_n_t`): the objective is not built, and options other than the mask's are checked by name
    only (`get` checks their values)."""
    options.pop("n_t", None)  # searched
    return _class(name).mask_spec(**options).valid_n_t(n_t, down=down, limit=limit)


def presets(name: str) -> dict[str, dict[str, Any]]:
    """The named settings objective `name` offers, each the options it sets."""
    return dict(_class(name).presets)


def _class(name) -> type[Objective]:
    if not isinstance(name, str):
        raise TypeError(f"an objective is named by a str, got {name!r}; available: {', '.join(available())}.")
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in _BUILT_IN:
        return _built_in(name)
    raise ValueError(f"unknown objective {name!r}; available: {', '.join(available())}.")


def _built_in(name: str) -> type[Objective]:
    module, cls = _BUILT_IN[name].split(":")
    loaded = getattr(importlib.import_module(f"dllm_fast.objectives.{module}"), cls)
    _REGISTRY.setdefault(name, loaded)
    return loaded


__getattr__ = lazy_attributes(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


__all__ = [
    "BGPO", "BGPOConfig", "CoupledGRPO", "CoupledGRPOConfig", "DiffuGRPO", "DiffuGRPOConfig", "ESPO", "ESPOConfig",
    "GDPO", "GDPOConfig", "InnerUpdate", "LossInputs", "Objective", "ObjectiveConfig", "ObjectiveOutput", "RSPO",
    "RSPOConfig", "SPG", "SPGConfig", "TraceRL", "TraceRLConfig", "VRPOOL", "VRPOOLConfig", "WD1", "WD1Config",
    "available", "get", "group_advantages", "nearest_valid_n_t", "presets", "register", "zero_std_fraction",
    # -- EBPO, JustGRPO, offline VRPO --
    "EBPO", "EBPOConfig", "JustGRPO", "JustGRPOConfig", "VRPODPO", "VRPODPOConfig", "preference_batch",
    # -- CJ-GRPO --
    "CJGRPO", "CJGRPOConfig",
    # -- MDPO --
    "MDPO", "MDPOConfig", "StepBatch",
    # -- d-TreeRPO --
    "DTreeRPO", "DTreeRPOConfig", "TreeBatch", "tree_batch",
]
