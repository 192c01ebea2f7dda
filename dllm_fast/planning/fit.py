"""Affine extrapolation of phases: what a phase costs and holds at a setting it was not run at.

The work of the scoring and update phases grows with the number of (sequence, sample) pairs, one identical
micro-batch after another; their memory grows with the pair-sized buffers (masks, lp, coefficients) and, for
all-graphs scoring, with the graphs kept. Both are affine in n_t once every kind of micro-batch has run (the first
one of an update creates the gradients, the later ones accumulate into them). A phase run at two settings x1 < x2
of that affine regime gives its value at any x.
"""

from __future__ import annotations

from dllm_fast.planning.accounting import ADDITIVE, CATEGORIES, Costs
from dllm_fast.planning.step import PhasePlan


def affine(x1: float, y1: float, x2: float, y2: float, x: float) -> float:
    return y2 + (y2 - y1) * (x - x2) / (x2 - x1)


def extrapolate(first: PhasePlan, second: PhasePlan, x1: float, x2: float, x: float,
                fresh: PhasePlan | None = None) -> PhasePlan:
    """The phase at setting x from its runs at x1 < x2. Costs: affine. Memory: the peak affine with a slope of at
    least zero (more pairs never free memory; a drop is the noise of which micro-batch peaks), which errs high:
    part of the growth is the largest micro-batch's masked rows, which levels off as micro-batches add up. The
    split by category is the run's at x2, with the growth given to the categories that grew (to temporaries when
    none did). `fresh`: the phase's first run at x1, whose real calls hold slightly more at the peak than replays of
    them do (a few tenths of a percent); its excess over `first` is added back."""
    if not (first.runs and second.runs) or x1 == x2:  # nothing to fit (a fixed n_t is planned as configured)
        return second
    growth = max(0.0, (second.peak - first.peak) / (x2 - x1)) * (x - x2)
    grew = {c: max(0, second.memory[c] - first.memory[c]) for c in CATEGORIES}
    shares = {c: grew[c] / sum(grew.values()) for c in CATEGORIES} if sum(grew.values()) else {"temporaries": 1.0}
    memory = {c: max(0, round(second.memory[c] + growth * shares.get(c, 0.0))) for c in CATEGORIES}
    if fresh is not None:
        for c in CATEGORIES:
            memory[c] += max(0, fresh.memory[c] - first.memory[c])
    costs = Costs(**{f: affine(x1, getattr(first.costs, f), x2, getattr(second.costs, f), x) for f in ADDITIVE},
                  closed=affine(x1, first.costs.seconds, x2, second.costs.seconds, x), synced=True)
    costs.kernels, costs.syncs = round(costs.kernels), round(costs.syncs)
    category_peaks = {c: max(second.category_peaks[c], memory[c]) for c in CATEGORIES}
    return PhasePlan(second.name, runs=second.runs, peak=sum(memory.values()), memory=memory, costs=costs,
                     calls_run=first.calls_run + second.calls_run,
                     calls_replayed=first.calls_replayed + second.calls_replayed,
                     extrapolated_from=None if x in (x1, x2) else (x1, x2), start=second.start,
                     category_peaks=category_peaks,
                     model_calls={kind: round(affine(x1, first.model_calls[kind], x2, count, x))
                                  for kind, count in second.model_calls.items()})
