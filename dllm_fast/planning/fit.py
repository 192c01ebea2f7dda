"""Affine extrapolation of phases: what a phase costs and holds at a setting it was not run at.

The work of the scoring and update phases grows with the number of (sequence, sample) pairs, one identical
micro-batch after another; their memory grows with the pair-sized buffers (masks, lp, coefficients) and, for
all-graphs scoring, with the graphs kept. Both are affine in n_t once every kind of micro-batch has run (the first
one of an update creates the gradients, the later ones accumulate into them). A phase run at two settings x1 < x2
of that affine regime gives its value at any x.
"""

from __future__ import annotations

from dllm_fast.planning.accounting import CATEGORIES, Costs
from dllm_fast.planning.step import PhasePlan


def affine(x1: float, y1: float, x2: float, y2: float, x: float) -> float:
    return y2 + (y2 - y1) * (x - x2) / (x2 - x1)


def extrapolate(first: PhasePlan, second: PhasePlan, x1: float, x2: float, x: float,
                fresh: PhasePlan | None = None) -> PhasePlan:
    """The phase at setting x from its runs at x1 and x2: costs affine; memory by category affine with a slope
    of at least zero (more pairs never free memory; a negative slope is the small noise of which micro-batch
    peaks). `fresh`: the phase's first run at x1, whose real calls hold slightly more at the peak than replays
    of them do (a few tenths of a percent); its excess over `first` is added back."""
    if not (first.runs and second.runs):
        return second
    excess = {c: max(0, fresh.memory[c] - first.memory[c]) if fresh is not None else 0 for c in CATEGORIES}
    memory = {c: max(0, round(second.memory[c] + max(0.0, (second.memory[c] - first.memory[c]) / (x2 - x1))
                              * (x - x2))) + excess[c] for c in CATEGORIES}
    costs = Costs(*(affine(x1, getattr(first.costs, f), x2, getattr(second.costs, f), x)
                    for f in ("flops", "bytes", "seconds", "kernels", "syncs")))
    costs.kernels, costs.syncs = round(costs.kernels), round(costs.syncs)
    return PhasePlan(second.name, runs=second.runs, peak=sum(memory.values()), memory=memory, costs=costs,
                     calls_run=first.calls_run + second.calls_run,
                     calls_replayed=first.calls_replayed + second.calls_replayed,
                     extrapolated_from=(x1, x2))
