"""A plan as text (a table per phase, the verdict, the largest settings) and as JSON. Every number is a planner
estimate, made on fake tensors, and says so; memory is in GB of 10^9 bytes, as GPU memory is sold."""

from __future__ import annotations

from dllm_fast.planning.accounting import CATEGORIES
from dllm_fast.planning.planner import Plan

LABEL = "PLANNER ESTIMATE: fake tensors and a calibrated roofline, not a measurement"
_SHORT = {"parameters": "params", "gradients": "grads", "optimizer_state": "optim", "activations": "activ",
          "kv_cache": "kv", "temporaries": "temps"}


def _gb(value: float) -> str:
    return f"{value / 1e9:.2f}"


def summary(plan: Plan) -> str:
    c, shapes = plan.config, plan.shapes
    rollout = c.rollout
    schedule = f"threshold {rollout.threshold}" if rollout.threshold is not None else \
        f"{rollout.decoding_steps()} steps"
    lora = f"LoRA r{c.lora.rank}" if c.lora.enabled else "full fine-tune"
    # float32 with autocast is train's precision (train/precision.py): trained weights fp32, frozen ones bf16
    weights = "fp32 trained, bf16 frozen + bf16 autocast" if plan.weights_dtype == "float32" and plan.autocast else \
        plan.weights_dtype
    target = plan.gpu.description if plan.gpu is not None else "this CPU"
    compiled = ", compiled" if plan.compiled else ""
    checkpointing = "on" if c.model.gradient_checkpointing else "off"
    return (f"{c.model.name}, {lora}, weights {weights}, gradient checkpointing {checkpointing}"
            f"; {c.objective.name} n_t={shapes['n_t']}, mu={c.objective.inner_updates}, {plan.engine} engine, "
            "micro-batch "
            f"{shapes['micro_batch']} (scoring {shapes['score_micro_batch']})\n"
            f"{_prompts(plan)} x {_per_prompt(plan)} = {shapes['rollouts']} {_rows(plan)}, prompt "
            f"{plan.prompt_length} + gen {rollout.gen_length} tokens (block {rollout.block_length}, {schedule}, cache "
            f"{rollout.cache}"
            f"{compiled})"
            f"; on {target}" + (f"\nper GPU of {plan.world}, {plan.parallel.upper()} (torchrun): every number "
                                "below is one GPU's" if plan.world > 1 else ""))


def _per_prompt(plan: Plan) -> str:
    tree = plan.shapes.get("tree")
    if tree is None:
        return f"G={plan.config.run.group_size}"
    return f"a tree of {tree['edges']} edges ({tree['leaves']} leaves)"


def _rows(plan: Plan) -> str:
    return "rollouts" if plan.shapes.get("tree") is None else "edges"


def _prompts(plan: Plan) -> str:
    prompts = plan.config.run.prompts_per_step
    if plan.world == 1:
        return f"{prompts} prompts"
    return f"{prompts // plan.world} prompts per GPU ({prompts} per step over {plan.world} GPUs)"


def text(plan: Plan) -> str:
    """The plan as the `plan` command prints it."""
    header = ["phase", "runs", "peak GB", *(_SHORT[c] for c in CATEGORIES), "TFLOP", "GB moved", "time s", "GPU s",
              "host s", "kernels", "syncs"]
    rows = []
    for name, phase in plan.phases.items():
        if not phase.runs:
            rows.append([name, "-", *([""] * (len(header) - 2))])
            continue
        mark = "*" if phase.extrapolated_from else ""
        rows.append([name + mark, str(phase.runs), _gb(phase.peak), *(_gb(phase.memory[c]) for c in CATEGORIES),
                     f"{phase.costs.flops / 1e12:.1f}", f"{phase.costs.bytes / 1e9:.1f}",
                     *((f"{phase.costs.seconds:.2f}", f"{phase.costs.device_seconds:.2f}",
                        f"{phase.costs.host_seconds:.2f}") if plan.gpu is not None else ("-", "-", "-")),
                     f"{phase.costs.kernels:,}", str(phase.costs.syncs)])
    flops = sum(p.costs.flops for p in plan.phases.values() if p.runs)
    moved = sum(p.costs.bytes for p in plan.phases.values() if p.runs)
    rows.append(["step", "", _gb(plan.peak), *([""] * len(CATEGORIES)), f"{flops / 1e12:.1f}", f"{moved / 1e9:.1f}",
                 f"{plan.step_seconds:.2f}" if plan.gpu is not None else "-", "", "", "", ""])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [LABEL, summary(plan), ""]
    for row in [header, *rows]:
        lines.append("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))
    if any(p.extrapolated_from for p in plan.phases.values()):
        lines.append("* fit to the configured n_t from plans at two other n_t (see notes)")
    lines.append("")
    lines.append(f"rollout: {plan.nfe} forwards that unmask tokens"
                 + (f"; weight-streaming floor {plan.weight_streaming_floor:.2f} s (each forward reads "
                    f"{plan.weight_bytes / 1e9:.1f} GB of weights at {plan.gpu.bandwidth / 1e12:.2f} TB/s)"
                    if plan.gpu is not None else ""))
    if plan.parallel_plan is not None:
        lines += parallel_lines(plan)
    lines.append(verdict(plan))
    if plan.largest:
        lines.append("largest that fit, the others as configured: " + "; ".join(
            f"{name.replace('_', '-')} {_largest(name, value)}" for name, value in plan.largest.items()))
    lines.append("notes:")
    lines += [f"  - {note}" for note in plan.notes]
    lines.append(f"planned in {plan.seconds:.0f} s")
    return "\n".join(lines)


def parallel_lines(plan: Plan) -> list[str]:
    """Collectives per phase of one GPU, the rollout's path and its share of time in communication."""
    parallel = plan.parallel_plan
    lines = []
    if parallel.collectives:
        lines.append(f"collectives per GPU ({plan.parallel.upper()}), per phase: count x GB crossing its links, "
                     "seconds (in time s: prefetched gathers and reduce-scatters overlap with compute)")
        for name, c in parallel.collectives.items():
            parts = [f"{label} {count:,} x {size / 1e9:.2f} GB" for label, count, size in (
                ("all-gather", c.all_gathers, c.all_gather_bytes),
                ("reduce-scatter", c.reduce_scatters, c.reduce_scatter_bytes),
                ("all-to-all", c.all_to_alls, c.all_to_all_bytes),
                ("all-reduce", c.all_reduces, c.all_reduce_bytes)) if count]
            if c.host_bytes:
                parts.append(f"host copies {c.host_bytes / 1e9:.2f} GB")
            if parts or c.seconds:
                lines.append(f"  {name}: " + ", ".join(parts) + f"; {c.seconds:.2f} s ({c.exposed:.2f} s not hidden)")
    if parallel.rollout_path:
        what = ("a plain copy gathered once a step" if parallel.rollout_path == "gathered" else
                "FSDP2's per-layer gathers at every forward")
        lines.append(f"rollout weights: {parallel.rollout_path}, {what} ({parallel.rollout_reason})"
                     + (f"; the copy is {'kept between steps' if parallel.copy_kept else 'freed after each rollout'}"
                        f" ({parallel.keep_reason})" if parallel.rollout_path == "gathered" else ""))
    if parallel.rollout_communication_share is not None:
        lines.append(f"rollout communication: {parallel.rollout_communication_share:.1%} of the rollout's "
                     f"{plan.phases['rollout'].costs.seconds:.2f} s")
    return lines


def _largest(name: str, value: int | None) -> str:
    from dllm_fast.planning.search import MAX_GROUP_SIZE, MAX_MICRO_BATCH, MAX_N_T

    if value is None:
        return "none (not even the smallest fits)"
    cap = {"n_t": MAX_N_T, "micro_batch": MAX_MICRO_BATCH, "group_size": MAX_GROUP_SIZE}[name]
    return f">= {value} (the search's cap)" if value >= cap else str(value)


def verdict(plan: Plan) -> str:
    if plan.gpu is None:
        return f"peak {_gb(plan.peak)} GB (no GPU to compare with)"
    if plan.world > 1:
        return _verdict(plan).replace(f" on {plan.gpu.description}",
                                      f" on each of {plan.world} x {plan.gpu.description} ({plan.parallel.upper()})")
    return _verdict(plan)


def _verdict(plan: Plan) -> str:
    worst = max((p for p in plan.phases.values() if p.runs), key=lambda p: p.peak)
    if plan.fits:
        spare = plan.capacity - plan.peak
        return (f"verdict: FITS on {plan.gpu.description}: peak {_gb(plan.peak)} GB ({worst.name}) of "
                f"{_gb(plan.capacity)} GB, {_gb(spare)} GB ({spare / plan.capacity:.0%}) spare; about "
                f"{plan.step_seconds:.1f} s per step (datasheet floor {plan.roofline_seconds:.1f} s)")
    return (f"verdict: DOES NOT FIT on {plan.gpu.description}: peak {_gb(plan.peak)} GB ({worst.name}) > "
            f"{_gb(plan.capacity)} GB")


def as_dict(plan: Plan) -> dict:
    """The plan as plain JSON values (bytes, FLOPs, seconds)."""
    return {
        "label": LABEL,
        "summary": summary(plan),
        "config": plan.config.to_dict(),
        "gpu": None if plan.gpu is None else {"name": plan.gpu.name, "description": plan.gpu.description,
                                              "memory_bytes": plan.gpu.memory, "bandwidth_bytes_per_s":
                                              plan.gpu.bandwidth, "bf16_flops_per_s": plan.gpu.bf16_flops},
        "engine": plan.engine,
        "world": plan.world,
        "parallel": plan.parallel,
        "communication_seconds": plan.communication,
        "parallel_plan": None if plan.parallel_plan is None else _parallel_dict(plan),
        "weights_dtype": plan.weights_dtype,
        "prompt_length": plan.prompt_length,
        "shapes": plan.shapes,
        "phases": {name: {"runs": p.runs, "peak_bytes": p.peak, "memory_bytes": dict(p.memory),
                          "flops": p.costs.flops, "bytes_moved": p.costs.bytes, "seconds": p.costs.seconds,
                          "device_seconds": p.costs.device_seconds, "host_seconds": p.costs.host_seconds,
                          "roofline_seconds": p.costs.roofline_seconds,
                          "kernels": p.costs.kernels, "host_syncs": p.costs.syncs, "calls_run": p.calls_run,
                          "calls_replayed": p.calls_replayed, "extrapolated_from_n_t": p.extrapolated_from}
                   for name, p in plan.phases.items()},
        "peak_bytes": plan.peak,
        "capacity_bytes": plan.capacity,
        "fits": plan.fits,
        "step_seconds": plan.step_seconds if plan.gpu is not None else None,
        "step_roofline_seconds": plan.roofline_seconds if plan.gpu is not None else None,
        "autocast": plan.autocast,
        "compiled": plan.compiled,
        "rollout_nfe": plan.nfe,
        "weight_bytes_per_forward": plan.weight_bytes,
        "weight_streaming_floor_seconds": plan.weight_streaming_floor,
        "largest": plan.largest,
        "notes": plan.notes,
        "planning_seconds": plan.seconds,
    }


def _parallel_dict(plan: Plan) -> dict:
    import dataclasses

    parallel = plan.parallel_plan
    return {"settings": dataclasses.asdict(parallel.settings),
            "collectives": {name: c.as_dict() for name, c in parallel.collectives.items()},
            "rollout_path": parallel.rollout_path, "rollout_reason": parallel.rollout_reason,
            "copy_bytes": parallel.copy_bytes, "copy_kept": parallel.copy_kept, "keep_reason": parallel.keep_reason,
            "rollout_communication_share": parallel.rollout_communication_share,
            "alternatives_peak_bytes": parallel.alternatives, "host_bytes_per_rank": parallel.host_bytes,
            "spare_bytes": None if plan.capacity is None else plan.capacity - plan.peak}
