"""The largest n_t, micro-batch and group size that fit on the GPU, each with the other settings as configured.

Each phase's peak is affine in each of these (n_t: pair-sized buffers, or all-graphs' kept graphs; micro-batch:
one micro-batch's activations; group size: the rollout batch, its KV cache and the pair-sized buffers), so each
search fits every phase through two plans and solves for the largest value under the GPU's memory:

- n_t: through the two n_t the step was planned at (no further plan);
- micro-batch: the updates planned again at a second micro-batch, then once more at the answer to check it;
- group size: the rollout and the updates planned again at a second group size.
"""

from __future__ import annotations

import dataclasses
import math

from dllm_fast.likelihood import MicroBatching
from dllm_fast.planning.fit import affine, extrapolate
from dllm_fast.planning.step import UPDATE_PHASES, probe_n_t, smallest_n_t, valid_n_t

MAX_N_T, MAX_MICRO_BATCH, MAX_GROUP_SIZE = 1 << 16, 1 << 14, 1 << 12


def largest_settings(session, plan, rollout, runs, probes, batching: MicroBatching, fresh):
    """({"n_t": ..., "micro_batch": ..., "group_size": ...}, notes) for a planned step (see planner.plan_step).
    A value is None when even the smallest setting does not fit."""
    capacity, config, n_t = plan.capacity, plan.config, plan.shapes["n_t"]
    rollout_peak = plan.phases["rollout"].peak
    active = [name for name in UPDATE_PHASES if plan.phases[name].runs]
    largest = {}
    if probes[0] == probes[1]:  # a fixed n_t (the rollout's decoding states): not a setting to search
        n_slopes = dict.fromkeys(UPDATE_PHASES, 0.0)
        notes = [f"largest n_t: not searched, {config.objective.name}'s samples follow from the rollouts (its "
                 "decoding states, one per completion position, or one per tree edge)"]
    else:
        n_slopes = {name: max(0.0, (runs[probes[1]][name].peak - runs[probes[0]][name].peak) /
                              (probes[1] - probes[0])) for name in UPDATE_PHASES}
        notes = [f"largest n_t: each phase's peak fit through the plans at n_t = {probes[0]} and {probes[1]}"]
        lines = {name: ((n_t, plan.phases[name].peak), (n_t + 1, plan.phases[name].peak + n_slopes[name]))
                 for name in active}
        best = _solve(capacity, rollout_peak, lines, minimum=smallest_n_t(config), maximum=MAX_N_T)
        largest["n_t"] = None if best is None else valid_n_t(config, best, down=True)

    # micro-batch: the updates at a second micro-batch (and at the answer), at a small n_t, moved to n_t
    def updates_at(micro_batch: int) -> dict[str, float]:
        probe = probe_n_t(config, plan.shapes["rollouts"], micro_batch)[0]
        if micro_batch == batching.micro_batch and probe == probes[0]:
            phases = fresh  # planned already (its first run: real calls, as a new micro-batch's plan makes)
        else:
            phases = session.updates(rollout.batch, n_t=probe, batching=dataclasses.replace(
                batching, micro_batch=micro_batch))
        return {name: phases[name].peak + n_slopes[name] * (n_t - probe) for name in active}

    m0 = batching.micro_batch
    m1 = m0 // 2 if m0 > 1 else 2
    at_m0, at_m1 = updates_at(m0), updates_at(m1)
    lines = {name: ((m1, at_m1[name]), (m0, at_m0[name])) for name in active}
    best = _solve(capacity, rollout_peak, lines, minimum=1, maximum=MAX_MICRO_BATCH)
    if best is not None and best not in (m0, m1) and best < MAX_MICRO_BATCH:
        at_best = updates_at(best)
        worst = max(active, key=lambda name: at_best[name])
        if at_best[worst] > capacity:  # the fit was optimistic: the line through the check instead
            checked = best
            best = _solve(capacity, rollout_peak, {worst: ((m0, at_m0[worst]), (checked, at_best[worst]))},
                          minimum=1, maximum=checked - 1)
            notes.append(f"largest micro-batch: fit through plans at {m1} and {m0}; a plan at {checked} did not "
                         f"fit, so the line through it and {m0}")
        else:
            notes.append(f"largest micro-batch: fit through plans at {m1} and {m0}, checked by a plan at {best}")
    largest["micro_batch"] = best

    # group size: the rollout and the updates at a second group size
    if session.objective.preference_pairs:  # stored pairs: two completions per prompt, no group to grow
        notes.append(f"largest group size: not searched, {config.objective.name} trains on preference pairs")
        return largest, notes
    if getattr(session.objective, "tree_shape", None) is not None:  # d_treerpo: its tree's shape sets the rows
        notes.append(f"largest group size: not searched, {config.objective.name}'s rollouts are a tree per prompt "
                     "(its shape: the objective's tree_branch, tree_contraction and tree_root_children)")
        return largest, notes
    g0 = config.run.group_size
    g1 = g0 // 2 if g0 > 1 else 2
    other = session.rollout(prompts=config.run.prompts_per_step, group_size=g1, prompt_length=plan.prompt_length)
    other_probes = probe_n_t(config, other.batch.num_rollouts, batching.micro_batch)
    first = session.updates(other.batch, n_t=other_probes[0], batching=batching)
    second = first if other_probes[0] == other_probes[1] else session.updates(other.batch, n_t=other_probes[1],
                                                                                 batching=batching)
    at_g1 = {"rollout": other.phase.peak}
    for name in active:
        at_g1[name] = extrapolate(first[name], second[name], *other_probes, n_t).peak
    lines = {name: ((g1, at_g1[name]), (g0, plan.phases[name].peak)) for name in ["rollout", *active]}
    largest["group_size"] = _solve(capacity, None, lines, minimum=1, maximum=MAX_GROUP_SIZE)
    notes.append(f"largest group size: each phase's peak fit through plans at group size {g1} and {g0}")
    return largest, notes


def _solve(capacity: int, fixed_peak: float | None, lines: dict, *, minimum: int, maximum: int) -> int | None:
    """The largest integer x in [minimum, maximum] at which every line ((x1, y1), (x2, y2)) is at most `capacity`
    (and `fixed_peak`, a peak that does not depend on x, is too); None when `minimum` does not fit."""
    if fixed_peak is not None and fixed_peak > capacity:
        return None
    best = maximum
    for (x1, y1), (x2, y2) in lines.values():
        if affine(x1, y1, x2, y2, minimum) > capacity:
            return None
        slope = (y2 - y1) / (x2 - x1)
        if slope > 0:
            best = min(best, math.floor(x2 + (capacity - y2) / slope))
    return max(minimum, best)
