"""One training step's phases, written once: the trainer (train/run.py), the planner's fake-tensor session
(planning/step.py) and the TRL trainer (integrations/trl.py) all run them, so the planner plans what the trainers
run (the rollout's GenerateConfig, compile included) by construction.

The phases, in order:

1. rollout: `generate` under no_grad and the caller's autocast, the model in eval mode meanwhile;
2. old-policy scoring: `Objective.plan_updates` (each inner update's masks; the old policy's lp on the masks of
   the updates taken after the policy has moved);
3. reference scoring: the reference policy's lp on one update's masks (objectives with a KL or a reference term);
4. inner update: the objective's gradient for that update (`Objective.backward`);
5. optimizer step: gradient clipping, a refused non-finite norm, the optimizer and the schedule, gradients zeroed.

Phases 3 to 5 run once per inner update. `StepHooks.phase(name)` wraps each phase (the planner's accounting, a
test's record) and `StepHooks.autocast()` gives the compute dtype. What differs between the callers lies around
the phases: where prompts and rewards come from, and who steps the optimizer (TRL's own loop does, through
accelerate, so the TRL trainer runs phases 1 to 4).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from dllm_fast.contracts import RolloutBatch
from dllm_fast.likelihood import MicroBatching
from dllm_fast.models.merged_lora import merged_for_rollouts
from dllm_fast.objectives import InnerUpdate, Objective, ObjectiveOutput
from dllm_fast.rollout import generate
from dllm_fast.rollout.config import GenerateConfig

ROLLOUT = "rollout"
OLD_POLICY_SCORING = "old-policy scoring"
REFERENCE_SCORING = "reference scoring"
INNER_UPDATE = "inner update"
OPTIMIZER_STEP = "optimizer step"
PHASES = (ROLLOUT, OLD_POLICY_SCORING, REFERENCE_SCORING, INNER_UPDATE, OPTIMIZER_STEP)


def _no_phase(name: str) -> ContextManager:
    return contextlib.nullcontext()


@dataclass(frozen=True)
class StepHooks:
    """phase(name): a context manager entered around each phase (`PHASES`); autocast(): the compute dtype's."""

    phase: Callable[[str], ContextManager] = _no_phase
    autocast: Callable[[], ContextManager] = contextlib.nullcontext


NO_HOOKS = StepHooks()


def roll_out(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, config: GenerateConfig, *,
             generator: torch.Generator, record_unmask_step: bool, hooks: StepHooks = NO_HOOKS,
             merge_adapters: bool = False, weights=None, record_step_predictions: bool = False, tree=None):
    """`generate`'s result for the prompts. The model samples in eval mode (no dropout) and is left in the mode it
    was in. record_unmask_step: trajectory objectives (TraceRL) replay the decoding order, so only they ask for it.
    merge_adapters: a LoRA policy samples through a copy of its adapted weights with the adapters merged in
    (models.merged_lora: one GEMM a projection; refreshed when the adapters have moved). weights: an FSDP2
    policy's gathered copy (train/rollout_weights.GatheredWeights), filled before the rollout and released after.
    record_step_predictions: MDPO rewards every step's one-step prediction, so only it asks for them.
    tree: a rollout.tree.TreeShape: grow one tree per prompt instead (d_treerpo), returning the rollout.tree.Tree."""
    with hooks.phase(ROLLOUT):
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), hooks.autocast():
                if weights is not None:
                    sampler = weights.gather()
                else:
                    sampler = merged_for_rollouts(model) if merge_adapters else model
                try:
                    if tree is not None:  # d-TreeRPO: a tree of partial rollouts per prompt (rollout/tree.py)
                        from dllm_fast.rollout.tree import tree_rollout

                        return tree_rollout(generate, sampler, input_ids, attention_mask, config, tree,
                                            generator=generator)
                    return generate(sampler, input_ids, attention_mask, config, generator=generator,
                                    record_unmask_step=record_unmask_step,
                                    **({"record_step_predictions": True} if record_step_predictions else {}))
                finally:
                    if weights is not None:
                        weights.release()
        finally:
            model.train(was_training)


def moved_after_first(inner_updates: int) -> list[bool]:
    """`plan_updates`' moved for mu inner updates of one rollout batch, each followed by an optimizer step: the
    policy has moved before every update but the first."""
    return [k > 0 for k in range(inner_updates)]


def plan_updates(objective: Objective, model, batch: RolloutBatch, *, moved: list[bool], generator: torch.Generator,
                 batching: MicroBatching, hooks: StepHooks = NO_HOOKS) -> list[InnerUpdate]:
    """The objective's plan of this batch's inner updates (`Objective.plan_updates`), under the caller's autocast."""
    with hooks.phase(OLD_POLICY_SCORING), hooks.autocast():
        return objective.plan_updates(model, batch, moved=moved, generator=generator, micro_batch=batching)


def inner_update(objective: Objective, model, batch: RolloutBatch, update: InnerUpdate, *, batching: MicroBatching,
                 ref_model=None, backward_hooks=None, hooks: StepHooks = NO_HOOKS,
                 backward: Callable | None = None) -> ObjectiveOutput | None:
    """One update's gradient: the reference policy's lp on its masks where the objective needs it (`ref_model`, or
    a PEFT model with its adapters disabled), then `backward` (default `objective.backward`, the streaming engine;
    called as it is, with lp_ref and the engine's `backward_hooks`)."""
    lp_ref = None
    if objective.needs_reference:
        with hooks.phase(REFERENCE_SCORING), hooks.autocast():
            lp_ref = objective.reference_lp(model, batch, update.masks, micro_batch=batching, ref_model=ref_model)
    with hooks.phase(INNER_UPDATE), hooks.autocast():
        return (backward or objective.backward)(model, batch, update, micro_batch=batching, lp_ref=lp_ref,
                                                hooks=backward_hooks)


@dataclass
class Optimization:
    """What an optimizer step updates and how: the trainable parameters, the optimizer, the clipping norm and the
    learning-rate schedule (None: none). clip: what clips the gradients, called as clip_grad_norm_ (None: it; expert
    parallelism's reduces the experts' gradients first: train/expert_parallel.py)."""

    trainable: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    grad_clip: float
    schedule: object | None = None
    clip: Callable | None = None


def optimizer_step(optimization: Optimization, *, hooks: StepHooks = NO_HOOKS, when: str = "") -> torch.Tensor:
    """Clip the gradients, step the optimizer (and the schedule), zero the gradients to None; return the gradient
    norm before clipping. A non-finite norm takes no step: the gradients are zeroed and the error says so (`when`
    places it, e.g. " at step 3")."""
    optimizer = optimization.optimizer
    with hooks.phase(OPTIMIZER_STEP):
        norm = (optimization.clip or torch.nn.utils.clip_grad_norm_)(optimization.trainable, optimization.grad_clip)
        if not torch.isfinite(norm):
            optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"the gradient norm is {float(norm)}{when}; no update was taken. Lower the "
                                     "learning rate or check the objective's options.")
        optimizer.step()
        if optimization.schedule is not None:
            optimization.schedule.step()
        optimizer.zero_grad(set_to_none=True)
    return norm


def run_update(objective: Objective, model, batch: RolloutBatch, update: InnerUpdate, *, batching: MicroBatching,
               optimization: Optimization, ref_model=None, hooks: StepHooks = NO_HOOKS,
               backward: Callable | None = None, when: str = "") -> tuple[ObjectiveOutput | None, torch.Tensor]:
    """One inner update and its optimizer step: (the objective's output, the gradient norm before clipping)."""
    out = inner_update(objective, model, batch, update, batching=batching, ref_model=ref_model, hooks=hooks,
                       backward=backward)
    return out, optimizer_step(optimization, hooks=hooks, when=when)
