"""Rollout throughput and memory: the reference sampler against dllm_fast's cache modes, side by side.

    python benchmarks/bench_rollout.py                 # CPU: small preset, batch 4, prompt 64, gen 128, block 32, 64 steps
    python benchmarks/bench_rollout.py --device cuda   # GPU: llada-8b shapes (random bf16), batch 1 and 8,
                                                       #      prompt 200, gen 256, block 32, 128 steps, + roofline
    python benchmarks/bench_rollout.py --interleaved 5 # eager vs compiled per cache mode, alternating calls

Providers: reference (LLaDA generate.py port: full recompute, full logits), dllm_fast with cache none, prefix,
dual, and dual with threshold 0.9, and each cache mode compiled (generate(compile=True): the denoising step
through torch.compile, inductor; CUDA graphs on a GPU). Each provider runs in a fresh process on the same random
model (same seed), so its peak memory is its own: peak resident memory above the post-warm-up baseline on CPU,
torch.cuda.max_memory_allocated on GPU. Tokens/s counts B * gen_length generated tokens per second of
generate(). Greedy decoding (T = 0) by default, so every cached mode's agreement with cache="none" is
reported, and whether cache="none" reproduces the reference token for token.

A compiled provider's warm-up is a whole call (it compiles every kind of step); compile_s is the time
torch.compile spent in it (dynamo and inductor). kernels/step counts, on the profiler's CPU trace of one more call, the kernels a
denoising step launches (see `count_step_kernels`): eager, every aten op that computes; compiled, inductor's
fused kernels plus the ops it leaves outside (GEMMs, attention, dllm_fast's ops). That count is the launch
overhead a CUDA graph removes on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from dllm_fast.rollout import CACHE_POLICIES, masked_count_schedule

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    Provider, add_ratio, add_results_dir_argument, measure_in_fresh_process, print_table, run_sweep, write_results,
)

# What each provider passes to generate(); "backend": "reference" selects dllm_fast.reference.generate.
GENERATE_OPTIONS = {
    "reference": dict(backend="reference", cache="none"),
    "dllm_fast none": dict(cache="none"),
    "dllm_fast prefix": dict(cache="prefix"),
    "dllm_fast dual": dict(cache="dual"),
    "dllm_fast dual+t0.9": dict(cache="dual", threshold=0.9),
    "compiled none": dict(cache="none", compile=True),
    "compiled prefix": dict(cache="prefix", compile=True),
    "compiled dual": dict(cache="dual", compile=True),
}

# Peak dense bf16 FLOP/s and HBM bandwidth (bytes/s) used for the roofline bound.
GPU_PEAKS = {"H100": (989.4e12, 3.35e12), "H200": (989.4e12, 4.8e12)}


@dataclasses.dataclass
class Rollout:
    """A random model, its prompts, and the generate() call of one provider."""

    model: Any
    prompts: torch.Tensor
    generate: Callable
    kwargs: dict
    warm_up_kwargs: dict


def setup_rollout(options: dict, point: dict) -> Rollout:
    import dllm_fast
    from dllm_fast import reference
    from dllm_fast.models import LLaDAConfig, LLaDAModel

    device = torch.device(point["device"])
    model = LLaDAModel.with_random_weights(LLaDAConfig.preset(point["preset"]), device=device,
                                           dtype=getattr(torch, point["dtype"]), seed=point["seed"]).eval()
    generator = torch.Generator(device).manual_seed(point["seed"] + 1)
    prompts = torch.randint(0, model.config.mask_token_id, (point["batch"], point["prompt"]), device=device,
                            generator=generator)
    options = dict(options)
    generate = reference.generate if options.pop("backend", None) == "reference" else dllm_fast.generate
    steps = None if "threshold" in options else point["steps"]
    kwargs = dict(gen_length=point["gen"], block_length=point["block"], steps=steps,
                  temperature=point["temperature"], **options)
    warm_up_kwargs = dict(kwargs, gen_length=point["block"], steps=None if steps is None else 1)  # one block
    if options.get("compile"):  # every kind of step compiles in the warm-up: a whole call
        from torch._inductor import config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True  # name each fused kernel on the profiler trace
        warm_up_kwargs = kwargs
    return Rollout(model, prompts, generate, kwargs, warm_up_kwargs)


def _generate(rollout: Rollout, kwargs: dict):
    generator = torch.Generator(rollout.prompts.device).manual_seed(0)
    return rollout.generate(rollout.model, rollout.prompts, generator=generator, **kwargs)


@dataclasses.dataclass
class Outcome:
    result: Any
    rollout: Rollout


def run_rollout(rollout: Rollout) -> Outcome:
    return Outcome(_generate(rollout, rollout.kwargs), rollout)


def warm_up_rollout(rollout: Rollout) -> None:
    _generate(rollout, rollout.warm_up_kwargs)


def rollout_summary(outcome: Outcome) -> dict:
    """What the parent process keeps of the timed run; for dllm_fast providers also the kernels per step of one
    more (profiled) call."""
    result, rollout = outcome.result, outcome.rollout
    kernels = None
    if rollout.generate is not _reference_generate():
        kernels = count_step_kernels(lambda: _generate(rollout, rollout.kwargs))
    return dict(nfe=result.nfe, completion=result.completion_ids.cpu().tolist(), compile_s=compile_seconds(),
                kernels_per_step=kernels)


def compile_seconds() -> float:
    """Wall seconds this process has spent in torch.compile (dynamo and inductor, every frame)."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(compilation_time_metrics.get("_compile.compile_inner", []))


def _reference_generate():
    from dllm_fast import reference

    return reference.generate


# Ops that launch no kernel on a GPU: views, allocations, no-op conversions.
NO_KERNEL = {"aten::view", "aten::_unsafe_view", "aten::as_strided", "aten::expand", "aten::slice", "aten::select",
             "aten::unsqueeze", "aten::squeeze", "aten::transpose", "aten::t", "aten::permute", "aten::detach",
             "aten::alias", "aten::lift_fresh", "aten::empty", "aten::empty_strided", "aten::empty_like",
             "aten::resize_", "aten::resolve_conj", "aten::resolve_neg", "aten::split", "aten::chunk",
             "aten::unbind", "aten::narrow", "aten::_reshape_alias", "aten::reshape", "aten::contiguous", "aten::to",
             "aten::_to_copy", "aten::split_with_sizes", "aten::expand_as", "aten::view_as"}
STEP_RANGE = "dllm_fast.denoise_step"


def count_step_kernels(run: Callable[[], Any]) -> float:
    """Kernels a denoising step launches, on average over the steps of `run()` (a generate call), counted on the
    profiler's CPU trace: in each step, every op whose sub-calls launch nothing, except views and allocations
    (NO_KERNEL); a dllm_fast op and an inductor-generated kernel (named on the trace with inductor's
    cpp.enable_kernel_profile) count as one."""
    generate_module = importlib.import_module("dllm_fast.rollout.generate")  # the package exports the function

    def traced(step):
        def run_step(*args):
            with torch.profiler.record_function(STEP_RANGE):
                return step(*args)
        return run_step

    eager_step, compiled_step = generate_module.denoise_step, generate_module.compiled_step
    with contextlib.ExitStack() as restore:
        restore.callback(setattr, generate_module, "denoise_step", eager_step)
        restore.callback(setattr, generate_module, "compiled_step", compiled_step)
        generate_module.denoise_step = traced(eager_step)
        generate_module.compiled_step = lambda device_type: traced(compiled_step(device_type))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            run()
    steps = [event for event in profile.events() if event.name == STEP_RANGE]
    return sum(_launches(child) for step in steps for child in step.cpu_children) / max(len(steps), 1)


def _launches(event) -> int:
    """Kernels launched by an op of the trace and its sub-calls."""
    if event.name.startswith("dllm_fast::") or "cpp_fused" in event.name:
        return 1
    inner = sum(_launches(child) for child in event.cpu_children)
    if inner:
        return inner
    return int(event.name.startswith("aten::") and event.name not in NO_KERNEL)


PROVIDERS = {
    name: Provider(name, setup=functools.partial(setup_rollout, options), run=run_rollout, warm_up=warm_up_rollout)
    for name, options in GENERATE_OPTIONS.items()
}


def measure(provider: Provider, point: dict) -> dict:
    """In a fresh process, so that each provider's peak memory is its own: build, warm up, time one rollout."""
    out = measure_in_fresh_process(provider, point, repeats=1, summarize=rollout_summary)
    seconds, summary = out["timing"].median_s, out["summary"]
    print(f"batch {point['batch']} {provider.name}: {point['batch'] * point['gen'] / seconds:.1f} tok/s", flush=True)
    compiled = GENERATE_OPTIONS[provider.name].get("compile", False)
    return dict(seconds=seconds, nfe=summary["nfe"], tokens_per_s=point["batch"] * point["gen"] / seconds,
                peak_mb=out["peak_bytes"] / 2**20, completion=summary["completion"],
                compile_s=summary["compile_s"] if compiled else None, kernels_per_step=summary["kernels_per_step"])


def planned_steps(policy, prompt_length: int, gen_length: int, block_length: int, steps_per_block: int):
    """(positions fed, masked positions of the block) of every step a fixed schedule runs, in order; steps that
    would unmask nothing are skipped, as generate() skips them."""
    total = prompt_length + gen_length
    for block in range(gen_length // block_length):
        start = prompt_length + block * block_length
        masked = block_length
        for step, count in enumerate(masked_count_schedule(block_length, steps_per_block)):
            if masked == 0:
                break
            lo, hi = policy.fed_span(start, start + block_length, total, step)
            yield hi - lo, masked
            masked -= count


def roofline_seconds(config, point: dict, cache: str, peaks) -> float:
    """Lower bound on one rollout: per forward the cache policy plans, max(FLOPs / peak FLOP/s, bytes /
    bandwidth), with bf16 weights read once per forward, the LM head applied to the block's masked positions only,
    and the KV cache read when the policy keeps one."""
    flops_peak, bandwidth = peaks
    d, V, layers = config.d_model, config.vocab_size, config.n_layers
    per_token_body = 2 * layers * (4 * d * d + 3 * d * config.mlp_hidden_size)
    weight_bytes = 2 * (layers * (4 * d * d + 3 * d * config.mlp_hidden_size) + V * d)
    B, P, G, block = point["batch"], point["prompt"], point["gen"], point["block"]
    total, steps_per_block = P + G, point["steps"] // (G // block)
    policy = CACHE_POLICIES[cache]
    seconds = 0.0
    for fed, masked in planned_steps(policy, P, G, block, steps_per_block):
        flops = B * fed * (per_token_body + 4 * layers * total * d) + 2 * B * masked * V * d
        kv_bytes = 2 * 2 * layers * B * total * d if policy.uses_cache else 0
        seconds += max(flops / flops_peak, (weight_bytes + kv_bytes) / bandwidth)
    return seconds


def add_compiled_ratios(rows: list[dict]) -> None:
    """speedup_vs_eager: a compiled provider's tokens/s over the eager provider of its cache mode (same batch),
    and whether their tokens agree (agree_with_eager)."""
    for row in rows:
        cache = GENERATE_OPTIONS[row["provider"]].get("cache")
        if not GENERATE_OPTIONS[row["provider"]].get("compile") or row["status"] != "ok":
            continue
        eager = next((r for r in rows if r["provider"] == f"dllm_fast {cache}" and r["batch"] == row["batch"]
                      and r["status"] == "ok"), None)
        if eager is not None:
            row["speedup_vs_eager"] = row["tokens_per_s"] / eager["tokens_per_s"]
            row["agree_with_eager"] = row["completion"] == eager["completion"]


def add_agreement_and_roofline(rows: list[dict], points: list[dict]) -> None:
    """agree_with_none: the fraction of tokens equal to cache="none"'s at the same batch; on a known GPU, the
    roofline bound of each fixed-schedule dllm_fast provider and how far above it the run is."""
    peaks = None
    if points[0]["device"] == "cuda":
        peaks = next((v for k, v in GPU_PEAKS.items() if k in torch.cuda.get_device_name()), None)
    for point in points:
        at_batch = {r["provider"]: r for r in rows if r["batch"] == point["batch"] and r["status"] == "ok"}
        none_tokens = at_batch.get("dllm_fast none", {}).get("completion")
        for name, row in at_batch.items():
            if none_tokens is not None:
                same = torch.tensor(row["completion"]) == torch.tensor(none_tokens)
                row["agree_with_none"] = same.double().mean().item()
            options = GENERATE_OPTIONS[name]
            if peaks is not None and options.get("backend") != "reference" and "threshold" not in options:
                from dllm_fast.models import LLaDAConfig

                config = LLaDAConfig.preset(point["preset"])
                row["roofline_s"] = roofline_seconds(config, point, options["cache"], peaks)
                row["vs_roofline"] = row["seconds"] / row["roofline_s"]
        if "reference" in at_batch and none_tokens is not None:
            print(f"batch {point['batch']}: dllm_fast none token-identical to the reference: "
                  f"{at_batch['reference']['completion'] == none_tokens}")


def interleaved_compiled(point: dict, cache: str, rounds: int) -> dict:
    """Eager against compiled generate() for one cache mode in one process, calls alternating (ABBA order) so
    that a machine whose load drifts slows both alike: median seconds of each, their ratio, the compile time
    (torch.compile's own, during the first compiled call), and whether the tokens agree."""
    rollout = setup_rollout(dict(cache=cache), point)
    compiled_kwargs = dict(rollout.kwargs, compile=True)
    eager_tokens = _generate(rollout, rollout.kwargs).completion_ids  # also the eager warm-up
    compiling = compile_seconds()
    compiled_tokens = _generate(rollout, compiled_kwargs).completion_ids
    compiling = compile_seconds() - compiling
    seconds = {"eager": [], "compiled": []}
    for round_ in range(rounds):
        order = ("eager", "compiled") if round_ % 2 == 0 else ("compiled", "eager")
        for mode in order:
            started = time.perf_counter()
            _generate(rollout, compiled_kwargs if mode == "compiled" else rollout.kwargs)
            seconds[mode].append(time.perf_counter() - started)
    eager_s, compiled_s = (statistics.median(seconds[mode]) for mode in ("eager", "compiled"))
    return dict(batch=point["batch"], cache=cache, status="ok", eager_s=eager_s, compiled_s=compiled_s,
                speedup=eager_s / compiled_s, compile_s=compiling,
                tokens_equal=bool(torch.equal(eager_tokens, compiled_tokens)), rounds=rounds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, nargs="+", help="batch sizes (default: by device)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS))
    parser.add_argument("--interleaved", type=int, metavar="ROUNDS", default=0,
                        help="instead of the providers: eager vs compiled in one process per cache mode, ROUNDS "
                             "alternating pairs of calls (robust to a shared machine's drifting load)")
    add_results_dir_argument(parser)
    args = parser.parse_args()
    if args.device == "cuda":
        base = dict(preset="llada-8b", dtype="bfloat16", prompt=200, gen=256, block=32, steps=128)
        batches = args.batch or [1, 8]
    else:
        base = dict(preset="small", dtype="float32", prompt=64, gen=128, block=32, steps=64)
        batches = args.batch or [4]
    points = [dict(base, device=args.device, batch=batch, temperature=args.temperature, seed=0) for batch in batches]
    if args.interleaved:
        rows = [interleaved_compiled(point, cache, args.interleaved) for point in points for cache in CACHE_POLICIES]
        print_table(rows, ["batch", "cache", "eager_s", "compiled_s", "speedup", "compile_s", "tokens_equal"])
        config = dict(base, batches=batches, temperature=args.temperature, rounds=args.interleaved)
        print(f"wrote {write_results(f'rollout_interleaved_{args.device}', config, rows, args.results_dir)}")
        return
    rows = run_sweep(points, [PROVIDERS[name] for name in args.providers], measure, row_keys=("batch",))
    add_ratio(rows, "speedup_vs_reference", "tokens_per_s", baseline={"provider": "reference"}, match=("batch",))
    add_compiled_ratios(rows)
    add_agreement_and_roofline(rows, points)
    for row in rows:
        row.pop("completion", None)
    print_table(rows, ["batch", "provider", "status", "seconds", "nfe", "tokens_per_s", "peak_mb",
                       "speedup_vs_reference", "speedup_vs_eager", "agree_with_eager", "compile_s", "kernels_per_step",
                       "agree_with_none", "roofline_s", "vs_roofline"])
    config = dict(base, batches=batches, temperature=args.temperature, providers=args.providers)
    print(f"wrote {write_results(f'rollout_{args.device}', config, rows, args.results_dir)}")


if __name__ == "__main__":
    main()
