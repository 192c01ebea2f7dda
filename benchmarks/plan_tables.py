"""Planned GPU tables for RESULTS.md and the README: PLANNER ESTIMATES made on fake tensors, never measurements.

    python benchmarks/plan_tables.py                      # both tables, H100 80GB
    python benchmarks/plan_tables.py --tables rollout --gpu h200

Training step (table "step"): LLaDA-8B, one prompt group of G = 8 per step, prompt 200 + gen 256 (block 32,
128 steps, dual cache), VRPO-OL (the ELBO, stratified masks, two passes) at n_t in {1, 16, 64, 256}, micro-batch
8 pairs, gradient checkpointing; LoRA (r 16) and the full fine-tune; the streaming engine against all-graphs
(every pair's graph kept until one backward), with the n_t where all-graphs stops fitting. Weights in bf16
(weights, gradients and AdamW state); the trainer's own choice (dllm_fast/train/precision.py: fp32 weights with
bf16 autocast today) as a row of its own. Time: the calibrated estimate (dllm_fast/planning/calibration.py:
eager kernels, each at its fitted rate, with the host's launch costs) and its datasheet floor.

Several GPUs (table "parallel", issue 46): the plans of docs/planning.md's "Several GPUs" section, each the `plan`
command written beside it: llada2-flash LoRA on 8 H100s with FSDP2 and --expert-parallel 8; its full fine-tune (fp32
master weights, AdamW, a sharded reference) on 16 H200s in two nodes (also with the reference's shards on the host,
--reference-offload true), on 8 H200s, and on 8 H200s with --fsdp-offload true; llada-8b's full fine-tune on 8
H100s. Per plan: the verdict, the spare memory, the step time, the rollout's path, time and communication share, and
what would fit where nothing does.

Rollouts (table "rollout"): the same model and lengths in bf16, inference only (no optimizer state), batch 1 and
8, caches none / prefix / dual, eager and compiled (each denoising step one CUDA graph): peak memory, KV cache,
the estimated time of generate and its datasheet floor, and the weight-streaming floor (each forward reads the
weights once).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from common import add_results_dir_argument, write_results  # noqa: E402

from dllm_fast.likelihood import MicroBatching  # noqa: E402
from dllm_fast.planning.accounting import Target  # noqa: E402
from dllm_fast.planning.fit import extrapolate  # noqa: E402
from dllm_fast.planning.gpus import GPUS  # noqa: E402
from dllm_fast.planning.search import MAX_N_T, _solve  # noqa: E402
from dllm_fast.planning.step import UPDATE_PHASES, Session, one_pass, probe_n_t, two_pass_line  # noqa: E402
from dllm_fast.train.config import TrainConfig  # noqa: E402

N_T = (1, 16, 64, 256)
BASE = dict(model="llada-8b", objective="vrpo_ol", prompts_per_step=1, group_size=8, gen_length=256, block_length=32,
            diffusion_steps=128, cache="dual", micro_batch=8, gradient_checkpointing=True, temperature=1.0)
PROMPT = 200


def step_rows(gpu, setups) -> list[dict]:
    rows = []
    for label, lora, weights in setups:
        for engine in ("streaming", "all_graphs"):
            config = TrainConfig(**BASE, lora=lora, objective_options={"n_t": N_T[0]})
            session = Session(config, target=Target("cuda", gpu), weights_dtype=weights, engine=engine)
            batching = MicroBatching(config.objective.micro_batch)
            with session:
                rollout = session.rollout(prompts=1, group_size=config.run.group_size, prompt_length=PROMPT)
                probes = probe_n_t(config, rollout.batch.num_rollouts, batching.micro_batch)
                line = two_pass_line(batching)  # the probes take two passes, as every n_t above the micro-batch
                fresh = session.updates(rollout.batch, n_t=probes[0], batching=line)
                low, high = (session.updates(rollout.batch, n_t=x, batching=line) for x in probes)
                direct = {n_t: session.updates(rollout.batch, n_t=n_t, batching=batching) for n_t in N_T
                          if one_pass(config, batching.micro_batch, n_t, allowed=batching.one_pass)}
            lines = {"rollout": ((1, rollout.phase.peak), (2, rollout.phase.peak))}
            for n_t in N_T:
                phases = dict(direct[n_t]) if n_t in direct else {
                    name: extrapolate(low[name], high[name], *probes, n_t, fresh[name]) for name in UPDATE_PHASES}
                phases["rollout"] = rollout.phase
                peak = max(p.peak for p in phases.values() if p.runs)
                worst = max((p for p in phases.values() if p.runs), key=lambda p: p.peak).name
                rows.append(dict(setup=label, engine=engine, n_t=n_t, peak_gb=peak / 1e9, fits=peak <= gpu.memory,
                                 worst_phase=worst, step_s=sum(p.costs.seconds for p in phases.values() if p.runs),
                                 step_roofline_s=sum(p.costs.roofline_seconds for p in phases.values() if p.runs),
                                 update_gb=phases["inner update"].peak / 1e9))
            for name in UPDATE_PHASES:
                if high[name].runs:
                    with_fresh = extrapolate(low[name], high[name], *probes, probes[1] + 1, fresh[name])
                    at_high = extrapolate(low[name], high[name], *probes, probes[1], fresh[name])
                    lines[name] = ((probes[1], at_high.peak), (probes[1] + 1, with_fresh.peak))
            largest = _solve(gpu.memory, None, lines, minimum=1, maximum=MAX_N_T)
            for row in rows[-len(N_T):]:
                row["largest_n_t"] = largest
            print(json.dumps(rows[-1]), flush=True)
    return rows


def rollout_rows(gpu) -> list[dict]:
    rows = []
    for batch in (1, 8):
        for cache in ("none", "prefix", "dual"):
            for compile in (False, True):
                config = TrainConfig(**{**BASE, "cache": cache}, lora=False, compile=compile)
                with Session(config, target=Target("cuda", gpu), weights_dtype=torch.bfloat16,
                             optimizer=False) as session:
                    rollout = session.rollout(prompts=batch, group_size=1, prompt_length=PROMPT)
                    phase, weight_bytes = rollout.phase, session.weight_bytes
                seconds = phase.costs.seconds
                rows.append(dict(batch=batch, cache=cache, compiled=compile, nfe=rollout.nfe, peak_gb=phase.peak / 1e9,
                                 kv_cache_gb=phase.category_peaks["kv_cache"] / 1e9, tflop=phase.costs.flops / 1e12,
                                 gb_moved=phase.costs.bytes / 1e9, seconds=seconds,
                                 roofline_s=phase.costs.roofline_seconds,
                                 floor_s=rollout.nfe * weight_bytes / gpu.bandwidth,
                                 kernels_per_step=phase.costs.kernels / rollout.nfe,
                                 tokens_per_s=batch * BASE["gen_length"] / seconds))
                print(json.dumps(rows[-1]), flush=True)
    return rows


FLASH = ["--model", "llada2-flash", "--parallel", "fsdp2", "--expert-parallel", "8", "--gen-length", "256",
         "--block-length", "32", "--diffusion-steps", "256", "--cache", "block", "--micro-batch", "8",
         "--gradient-checkpointing", "true", "--search", "false"]
PARALLEL_PLANS = {
    "llada2-flash LoRA, 8 H100": FLASH + ["--lora", "true", "--gpus", "8", "--gpu", "h100", "--prompts-per-step", "8",
                                         "--group-size", "8"],
    "llada2-flash full, 16 H200 (2 nodes)": FLASH + ["--gpus", "16", "--gpu", "h200", "--prompts-per-step", "16",
                                                     "--group-size", "8"],
    "llada2-flash full, 16 H200 (2 nodes), reference offload": FLASH + ["--gpus", "16", "--gpu", "h200",
                                                                        "--prompts-per-step", "16", "--group-size",
                                                                        "8", "--reference-offload", "true"],
    "llada2-flash full, 8 H200": FLASH + ["--gpus", "8", "--gpu", "h200", "--prompts-per-step", "8", "--group-size",
                                         "8"],
    # offload takes FSDP2's shards, and one expert group's experts are whole: two groups of 4, the experts sharded
    "llada2-flash full, 8 H200, offload": FLASH + ["--gpus", "8", "--gpu", "h200", "--prompts-per-step", "8",
                                                  "--group-size", "8", "--fsdp-offload", "true",
                                                  "--expert-parallel", "4"],
    "llada-8b full, 8 H100": ["--model", "llada-8b", "--parallel", "fsdp2", "--gpus", "8", "--gpu", "h100",
                              "--prompts-per-step", "8", "--group-size", "8", "--prompt-length", "200",
                              "--gen-length", "256", "--block-length", "32", "--diffusion-steps", "128", "--cache",
                              "dual", "--micro-batch", "8", "--gradient-checkpointing", "true", "--search", "false"],
}


def parallel_rows(names) -> list[dict]:
    """Each plan of PARALLEL_PLANS named, through the `plan` command's own parsing, as a row (and its text)."""
    from dllm_fast.planning.cli import parallel_settings_of, plan_parser
    from dllm_fast.planning.planner import plan_step
    from dllm_fast.planning.report import text
    from dllm_fast.train.cli import config_from_arguments, parse

    rows = []
    for name in names:
        argv = PARALLEL_PLANS[name]
        args = parse(plan_parser(argv), argv)
        config = config_from_arguments(args)
        plan = plan_step(config, gpu=args.gpu, prompt_length=args.prompt_length, search=False,
                         parallel=parallel_settings_of(args, config))
        print(text(plan), flush=True)
        parallel, rollout = plan.parallel_plan, plan.phases["rollout"]
        worst = max((p for p in plan.phases.values() if p.runs), key=lambda p: p.peak)
        rows.append(dict(plan=name, command="python -m dllm_fast plan " + " ".join(argv), fits=plan.fits,
                         peak_gb=plan.peak / 1e9, peak_phase=worst.name, spare_gb=(plan.capacity - plan.peak) / 1e9,
                         spare=(plan.capacity - plan.peak) / plan.capacity, step_s=plan.step_seconds,
                         rollout_path=parallel.rollout_path, copy_gb=parallel.copy_bytes / 1e9,
                         copy_kept=parallel.copy_kept, rollout_s=rollout.costs.seconds,
                         rollout_communication=parallel.rollout_communication_share,
                         alternatives_gb={k: v / 1e9 for k, v in parallel.alternatives.items()},
                         memory_gb={n: {c: v / 1e9 for c, v in p.memory.items()} for n, p in plan.phases.items()
                                    if p.runs},
                         communication_s={n: c.seconds for n, c in parallel.collectives.items()}))
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("memory_gb", "command")}), flush=True)
    return rows


def markdown(rows: list[dict], columns: list[str]) -> str:
    def cell(value):
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, float):
            return f"{value:,.2f}" if value < 1000 else f"{value:,.0f}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="h100", choices=list(GPUS))
    parser.add_argument("--tables", nargs="+", default=["step", "rollout"], choices=["step", "rollout", "parallel"])
    parser.add_argument("--plans", nargs="+", default=list(PARALLEL_PLANS), choices=list(PARALLEL_PLANS),
                        metavar="NAME", help="the plans of the parallel table (default: all)")
    add_results_dir_argument(parser)
    args = parser.parse_args()
    gpu = GPUS[args.gpu]
    results = {}
    if "step" in args.tables:
        setups = [("LoRA, bf16 weights", True, torch.bfloat16), ("full, bf16 weights", False, torch.bfloat16),
                  ("LoRA, as train loads it (train/precision.py)", True, None)]
        results["step"] = step_rows(gpu, setups)
        print(markdown(results["step"], ["setup", "engine", "n_t", "peak_gb", "fits", "worst_phase", "update_gb",
                                          "step_s", "step_roofline_s", "largest_n_t"]))
    if "rollout" in args.tables:
        results["rollout"] = rollout_rows(gpu)
        print(markdown(results["rollout"], ["batch", "cache", "compiled", "nfe", "peak_gb", "kv_cache_gb", "tflop",
                                             "gb_moved", "seconds", "roofline_s", "floor_s", "kernels_per_step",
                                             "tokens_per_s"]))
    if "parallel" in args.tables:
        results["parallel"] = parallel_rows(args.plans)
        print(markdown(results["parallel"], ["plan", "fits", "peak_gb", "peak_phase", "spare", "step_s",
                                              "rollout_path", "rollout_s", "rollout_communication"]))
    from dllm_fast.planning.calibration import DEFAULT

    config = dict(gpu=args.gpu, prompt_length=PROMPT, n_t=N_T, **BASE, label="planner estimate",
                  calibration=DEFAULT.name)
    for name, rows in results.items():
        if name == "parallel":  # each row names its GPUs and settings in its command
            labels = dict(label="planner estimate", calibration=DEFAULT.name)
            print(f"wrote {write_results('plan_parallel', labels, rows, args.results_dir)}")
        else:
            print(f"wrote {write_results(f'plan_{name}_{args.gpu}', config, rows, args.results_dir)}")


if __name__ == "__main__":
    main()
