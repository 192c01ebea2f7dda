"""Where a rollout's denoising step spends the GPU: one generate call under the CUDA profiler, its kernels by kind.

    python benchmarks/profile_rollout.py --device cuda                  # LLaDA-8B shapes, batch 8, dual, eager
    python benchmarks/profile_rollout.py --device cuda --compile        # the same call compiled (CUDA graphs)
    python benchmarks/profile_rollout.py --results-dir benchmarks/results   # CPU: small preset, CPU activity only

bench_rollout.py says how fast a rollout is; this says why. It runs bench_rollout's point (random weights, same
prompts and schedule), warms up with a whole call, times one call (wall seconds per denoising step), then
profiles one more call and reports per denoising step: the GPU's busy time (sum of kernel durations), the idle
share of the profiled wall (the host keeping the GPU waiting), kernels launched, and the busy time by kind of
kernel (attention, GEMMs, dllm_fast's fused ops, inductor's generated kernels, copies, other elementwise), with
the 15 largest kernels by name and torch.mm's TFLOP/s alone at the step's GEMM shapes. On CPU the trace has no
device activity: the table lists the CPU's leaf ops instead (a check that the script runs, not a profile).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rollout import CPU_POINT, GPU_POINT, run_rollout, setup_rollout  # noqa: E402
from common import add_results_dir_argument, write_results  # noqa: E402

# Substrings of CUDA kernel names, first match wins: what kind of work a kernel is.
KINDS = (  # attention first: cuDNN's attention kernels carry sm90_ in their names too
    ("attention", ("flash", "fmha", "attention", "efficient", "sdpa")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "splitk")),
    ("dllm_fast", ("dllm_fast", "sample_tokens", "logprob", "lm_head", "select_transfer")),
    ("inductor", ("triton_",)),
    ("copy", ("copy", "memcpy", "memset", "cat", "index")),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, needles in KINDS:
        if any(needle in lowered for needle in needles):
            return kind
    return "elementwise"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_call(rollout, device: torch.device) -> dict:
    """Kernels of one generate call, by name: (device seconds, count); and the call's wall seconds under the
    profiler."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    synchronize(device)
    with torch.profiler.profile(activities=activities) as profile:
        start = time.perf_counter()
        outcome = run_rollout(rollout)
        synchronize(device)
        wall = time.perf_counter() - start
    kernels: dict[str, list] = {}

    def add(name: str, seconds: float) -> None:
        entry = kernels.setdefault(name, [0.0, 0])
        entry[0] += seconds
        entry[1] += 1

    events = profile.events()
    if device.type == "cuda":  # kernels, memcpy and memset on the GPU's timeline (not the mirrored annotations)
        for event in events:
            if event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False):
                add(event.name, event.device_time_total * 1e-6)
        if not kernels:  # an older trace format: the kernels hang off their launching CPU events
            for event in events:
                for kernel in getattr(event, "kernels", []):
                    add(kernel.name, kernel.duration * 1e-6)
    else:  # no device timeline: the CPU's leaf ops
        for event in events:
            if not event.cpu_children and event.name.startswith(("aten::", "dllm_fast::")):
                add(event.name, event.cpu_time_total * 1e-6)
    return dict(kernels=kernels, wall=wall, nfe=int(outcome.result.nfe))


def gemm_rates(config, batch: int, block: int, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """torch.mm alone at a dual step's GEMM shapes (batch x block rows): achieved TFLOP/s, for comparison with
    the GEMMs inside the step."""
    rows, width = batch * block, config.d_model
    kv = config.n_kv_heads * config.head_dim
    shapes = {"qkv": (width, width + 2 * kv), "attn_out": (width, width),
              "gate_up": (width, 2 * config.mlp_hidden_size), "down": (config.mlp_hidden_size, width)}
    out = []
    for name, (k, n) in shapes.items():
        a = torch.randn(rows, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        for _ in range(3):
            torch.mm(a, b)
        synchronize(device)
        repeats = 20
        start = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, b)
        synchronize(device)
        seconds = (time.perf_counter() - start) / repeats
        out.append(dict(gemm=name, m=rows, k=k, n=n, us=round(seconds * 1e6, 1),
                        tflops=round(2 * rows * k * n / seconds / 1e12, 1)))
    return out


def summarize(profiled: dict, timed_wall: float) -> dict:
    nfe, kernels = profiled["nfe"], profiled["kernels"]
    busy = sum(seconds for seconds, _ in kernels.values())
    by_kind: dict[str, list] = {}
    for name, (seconds, count) in kernels.items():
        entry = by_kind.setdefault(kind_of(name), [0.0, 0])
        entry[0] += seconds
        entry[1] += count
    top = sorted(kernels.items(), key=lambda item: -item[1][0])[:15]
    return dict(
        nfe=nfe, wall_ms_per_step=1e3 * timed_wall / nfe, profiled_wall_ms_per_step=1e3 * profiled["wall"] / nfe,
        busy_ms_per_step=1e3 * busy / nfe, idle_share=max(0.0, 1 - busy / profiled["wall"]),
        kernels_per_step=sum(count for _, count in kernels.values()) / nfe,
        by_kind={kind: dict(ms_per_step=1e3 * seconds / nfe, kernels_per_step=count / nfe,
                            share=seconds / busy if busy else 0.0)
                 for kind, (seconds, count) in sorted(by_kind.items(), key=lambda item: -item[1][0])},
        top=[dict(name=name[:110], ms_per_step=1e3 * seconds / nfe, per_step=count / nfe)
             for name, (seconds, count) in top])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, default=None, help="prompts (default: 8 on cuda, 4 on cpu)")
    parser.add_argument("--cache", default="dual", choices=["none", "prefix", "dual"])
    parser.add_argument("--compile", action="store_true", help="generate(compile=True)")
    add_results_dir_argument(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    point = dict(GPU_POINT if device.type == "cuda" else CPU_POINT, device=args.device, seed=0, temperature=0.0,
                 batch=args.batch or (8 if device.type == "cuda" else 4))
    options = dict(cache=args.cache, compile=args.compile)
    rollout = setup_rollout(options, point)
    run_rollout(rollout)  # the warm-up is a whole call: every shape of the timed call (and its compile) seen once
    synchronize(device)
    start = time.perf_counter()
    outcome = run_rollout(rollout)
    synchronize(device)
    timed_wall = time.perf_counter() - start
    summary = summarize(profile_call(rollout, device), timed_wall)
    summary.update(point=point, cache=args.cache, compile=args.compile,
                   tokens_per_s=point["batch"] * point["gen"] / timed_wall, nfe_timed=int(outcome.result.nfe))
    if device.type == "cuda":
        summary["gemm_alone"] = gemm_rates(rollout.model.config, point["batch"], point["block"], device,
                                           getattr(torch, point["dtype"]))
    label = f"{'compiled' if args.compile else 'eager'} {args.cache}"
    print(f"{label}: {summary['tokens_per_s']:.0f} tokens/s; per step: wall {summary['wall_ms_per_step']:.2f} ms, "
          f"busy {summary['busy_ms_per_step']:.2f} ms (idle {100 * summary['idle_share']:.0f}% under the profiler), "
          f"{summary['kernels_per_step']:.0f} kernels")
    for kind, row in summary["by_kind"].items():
        print(f"  {kind:<12} {row['ms_per_step']:7.3f} ms/step {100 * row['share']:5.1f}%  "
              f"{row['kernels_per_step']:6.1f} kernels/step")
    for row in summary["top"]:
        print(f"    {row['ms_per_step']:7.3f} ms/step x{row['per_step']:6.1f}  {row['name']}")
    for row in summary.get("gemm_alone", []):
        print(f"  mm alone {row['gemm']:<8} {row['m']}x{row['k']}x{row['n']}: {row['us']} us, {row['tflops']} TFLOP/s")
    top = summary.pop("top")
    write_results(f"profile_rollout_{args.device}_{label.replace(' ', '_')}", summary, top, args.results_dir)


if __name__ == "__main__":
    main()
