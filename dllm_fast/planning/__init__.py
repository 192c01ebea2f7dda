"""Plan a training step before renting a GPU: the real trainer step, run on fake tensors at the configured shapes
and dtypes, with memory by category, FLOPs, bytes moved and a roofline time per phase for a chosen GPU, a verdict
and the largest settings that fit.

    python -m dllm_fast plan --help
    from dllm_fast.planning import plan_step, text
    plan = plan_step(config, gpu="h100")          # config: a dllm_fast.train.TrainConfig
    print(text(plan)); plan.fits, plan.peak, plan.phases, plan.largest

Layout: gpus.py (the GPU table and its sources), calibration.py (the efficiencies and launch costs fitted on a
measured GPU, and the measurements), fake.py (the fake world: model fake, small data real), accounting.py (the
ledger: memory, FLOPs, bytes, time), replay.py (identical calls and optimizer steps run once), step.py (the
trainer's phases), layout.py, links.py and parallel.py (several GPUs: the settings, what collectives cost, one GPU's
memory and communication), fit.py and search.py (extrapolation, the largest settings that fit), planner.py
(plan_step and its bounds), predict.py (single benchmark calls, for bench_plan.py), report.py (text, JSON), cli.py.
The names below load on first use.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"plan_step": "dllm_fast.planning.planner", "Plan": "dllm_fast.planning.planner",
            "GPUS": "dllm_fast.planning.gpus", "GPU": "dllm_fast.planning.gpus",
            "text": "dllm_fast.planning.report", "as_dict": "dllm_fast.planning.report"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dllm_fast.planning' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
