"""Rollout throughput and memory: the reference sampler against dllm_fast's cache modes, side by side.

    python benchmarks/bench_rollout.py                 # CPU: small preset, batch 4, prompt 64, gen 128, block 32, 64 steps
    python benchmarks/bench_rollout.py --device cuda   # GPU: llada-8b shapes (random bf16), batch 1 and 8,
                                                       #      prompt 200, gen 256, block 32, 128 steps, + roofline
    python benchmarks/bench_rollout.py --interleaved 5 # eager vs compiled per cache mode, alternating calls
    python benchmarks/bench_rollout.py --count-kernels # eager kernels per denoising step and per layer, cache
                                                       #      none/prefix/dual, LLaDA-8B's 32 layers made narrow
    python benchmarks/bench_rollout.py --before /tmp/rollout_before --rounds 3
                                                       # eager providers against another checkout, in turns

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

--count-kernels counts only (no timing): eager kernels per denoising step for cache none, prefix and dual on
LLaDA-8B made narrow (`narrow_config`: its 32 layers and 32 heads, width 128, a 1,024-token vocabulary; the count
depends on neither width nor vocabulary), bf16, batch 1, a one-block prompt and two blocks of the GPU point's
schedule (16 steps a block: the same share of refreshing steps, so the same average; lengths change no count),
on --device; per layer from the difference with a 1-layer model. --before TREE times the eager dllm_fast providers of this
benchmark with dllm_fast imported from another checkout built in place (`git archive <commit> | tar -x -C
TREE`, the built extension copied or built there), each provider in fresh processes, trees taking turns over
--rounds rounds; the ratio is before's seconds over this tree's.
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
    Provider, add_ratio, add_results_dir_argument, measure_in_fresh_process, measure_in_tree, print_table, run_sweep,
    write_results,
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

# The shapes of a run: LLaDA-8B's on a GPU (random bf16 weights), the small preset's on CPU.
GPU_POINT = dict(preset="llada-8b", dtype="bfloat16", prompt=200, gen=256, block=32, steps=128)
CPU_POINT = dict(preset="small", dtype="float32", prompt=64, gen=128, block=32, steps=64)

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
    if point.get("lora_rank"):
        model = with_lora(model, point["lora_rank"], point["seed"])
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


def with_lora(model, rank: int, seed: int):
    """The model as train's LoRA runs roll out with it: PEFT adapters of rank `rank` on every block projection
    (alpha 32, train's default), fp32 master weights on the frozen base, B drawn at the scale of A so the
    deltas are not zero (PEFT starts B at 0, which would hide nothing of their cost but their values)."""
    import peft

    from dllm_fast.models.llada import LORA_TARGETS

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=32, target_modules=model.lora_target_pattern(LORA_TARGETS))
    model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.data = parameter.data.float()
                if "lora_B" in name:
                    parameter.normal_(0.0, 1.0 / parameter.shape[1] ** 0.5)
    return model.eval()


def _generate(rollout: Rollout, kwargs: dict):
    generator = torch.Generator(rollout.prompts.device).manual_seed(0)
    # train rolls a LoRA policy on a bf16 base out under bf16 autocast (fp32 adapters)
    autocast = hasattr(rollout.model, "peft_config") and rollout.model.lm_head_weight.dtype == torch.bfloat16
    with torch.autocast(rollout.prompts.device.type, dtype=torch.bfloat16, enabled=autocast):
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


# Ops that launch no kernel on a GPU: views, allocations, no-op conversions, type queries. (An op with children
# counts what its children launch; one in this set counts nothing of its own even when its children launch none.)
NO_KERNEL = {"aten::view", "aten::_unsafe_view", "aten::as_strided", "aten::expand", "aten::slice", "aten::select",
             "aten::unsqueeze", "aten::squeeze", "aten::transpose", "aten::t", "aten::permute", "aten::detach",
             "aten::alias", "aten::lift_fresh", "aten::empty", "aten::empty_strided", "aten::empty_like",
             "aten::resize_", "aten::resolve_conj", "aten::resolve_neg", "aten::split", "aten::chunk",
             "aten::unbind", "aten::narrow", "aten::_reshape_alias", "aten::reshape", "aten::contiguous", "aten::to",
             "aten::_to_copy", "aten::split_with_sizes", "aten::expand_as", "aten::view_as", "aten::promote_types",
             "aten::result_type", "aten::movedim", "aten::unflatten", "aten::flatten", "aten::type_as"}
# Ops a GPU runs as one kernel whatever the CPU's decomposition, so that a count on a CPU trace is the CUDA one:
# rms_norm is torch's fused kernel on CUDA (its CPU form is pow, mean, add, rsqrt, mul and casts), and a mean is
# one reduction (on CPU a sum, a division and the scalar's conversions).
ONE_KERNEL_ON_GPU = {"aten::rms_norm", "aten::mean"}
STEP_RANGE = "dllm_fast.denoise_step"


def count_step_kernels(run: Callable[[], Any], by_op: dict | None = None) -> float:
    """Kernels a denoising step launches, on average over the steps of `run()` (a generate call), counted on the
    profiler's CPU trace: in each step, every op whose sub-calls launch nothing, except views, allocations and
    type queries (NO_KERNEL); a dllm_fast op, an inductor-generated kernel (named on the trace with inductor's
    cpp.enable_kernel_profile) and an op of ONE_KERNEL_ON_GPU count as one. `by_op`, if given, receives the
    average count per step of each op name."""
    generate_module = importlib.import_module("dllm_fast.rollout.sampler")

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
    tally: dict[str, int] = {}
    total = sum(_launches(child, tally) for step in steps for child in step.cpu_children)
    if by_op is not None:
        by_op.update({name: count / max(len(steps), 1) for name, count in sorted(tally.items())})
    return total / max(len(steps), 1)


def _launches(event, tally: dict[str, int]) -> int:
    """Kernels launched by an op of the trace and its sub-calls (each counted in `tally` by the op's name)."""
    if event.name.startswith("dllm_fast::") or "cpp_fused" in event.name or event.name in ONE_KERNEL_ON_GPU:
        tally[event.name] = tally.get(event.name, 0) + 1
        return 1
    inner = sum(_launches(child, tally) for child in event.cpu_children)
    if inner or event.name in NO_KERNEL or not event.name.startswith("aten::"):
        return inner
    tally[event.name] = tally.get(event.name, 0) + 1
    return 1


def narrow_config(config, width: int = 128, vocabulary: int = 1024):
    """`config` with its layers (and head count) but a narrow body and a small vocabulary, for counting kernels:
    d_model `width`, MLP 3 * width, the special ids the vocabulary's last ones."""
    return dataclasses.replace(
        config, d_model=width, mlp_hidden_size=3 * width, vocab_size=vocabulary, embedding_size=vocabulary,
        mask_token_id=vocabulary - 1, eos_token_id=vocabulary - 2, pad_token_id=vocabulary - 2,
        eot_token_id=vocabulary - 3)


def narrow_config_of(base: dict):
    from dllm_fast.models import LLaDAConfig

    return narrow_config(LLaDAConfig.preset(base["preset"]))


def counted_run(base: dict) -> dict:
    """The run count_kernels profiles: a one-block prompt and two blocks of `base`'s steps per block."""
    steps_per_block = base["steps"] // (base["gen"] // base["block"])
    return dict(prompt=base["block"], gen=2 * base["block"], steps=2 * steps_per_block, batch=1)


def count_kernels(base: dict, caches=("none", "prefix", "dual")) -> list[dict]:
    """Eager kernels per denoising step of each cache mode on the narrow form of `base`'s preset (batch 1), and
    per layer (against a 1-layer model): one row per cache mode, with the per-step count of each op."""
    import dllm_fast
    from dllm_fast.models import LLaDAModel

    config = narrow_config_of(base)
    device, dtype = torch.device(base["device"]), getattr(torch, base["dtype"])
    # A one-block prompt and two blocks of the point's steps per block: the same share of refreshing steps, so
    # the same average count (it depends on neither length), in a fraction of the time on a CPU.
    shape = counted_run(base)
    prompts = torch.randint(0, config.mask_token_id - 1, (1, shape["prompt"]), device=device,
                            generator=torch.Generator(device).manual_seed(1))
    rows = []
    for cache in caches:
        run = dict(gen_length=shape["gen"], block_length=base["block"], steps=shape["steps"], cache=cache)
        counts, ops = {}, {}
        for layers in (config.n_layers, 1):
            model = LLaDAModel.with_random_weights(dataclasses.replace(config, n_layers=layers), dtype=dtype,
                                                   device=device).eval()
            dllm_fast.generate(model, prompts, **run)  # warm-up
            by_op = {} if layers == config.n_layers else None
            counts[layers] = count_step_kernels(lambda: dllm_fast.generate(model, prompts, **run), by_op)
            ops = by_op if by_op is not None else ops
        per_layer = (counts[config.n_layers] - counts[1]) / (config.n_layers - 1)
        rows.append(dict(cache=cache, layers=config.n_layers, kernels_per_step=counts[config.n_layers],
                         kernels_per_layer=per_layer, outside_layers=counts[1] - per_layer, ops_per_step=ops))
        print(f"cache {cache}: {counts[config.n_layers]:.1f} kernels per step, {per_layer:.2f} per layer", flush=True)
    return rows


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


def before_and_after(points: list[dict], names: list[str], before: str, rounds: int) -> list[dict]:
    """Each eager provider with dllm_fast from this checkout and from `before`, each run in a fresh process,
    the two trees taking turns for `rounds` rounds: median seconds of each and before's over this tree's."""
    here = Path(__file__).resolve().parents[1]
    rows = []
    for point in points:
        for name in names:
            seconds = {"after": [], "before": []}
            for round_ in range(rounds):
                order = (("after", here), ("before", before))
                for label, tree in order if round_ % 2 == 0 else order[::-1]:
                    out = measure_in_tree("bench_rollout", name, point, tree)
                    seconds[label].append(out["timing"].median_s)
            after_s, before_s = (statistics.median(seconds[label]) for label in ("after", "before"))
            rows.append(dict(batch=point["batch"], provider=name, status="ok", before_s=before_s, after_s=after_s,
                             speedup=before_s / after_s, rounds=rounds))
            print(f"batch {point['batch']} {name}: {before_s:.3f} s before, {after_s:.3f} s after", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, nargs="+", help="batch sizes (default: by device)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS))
    parser.add_argument("--interleaved", type=int, metavar="ROUNDS", default=0,
                        help="instead of the providers: eager vs compiled in one process per cache mode, ROUNDS "
                             "alternating pairs of calls (robust to a shared machine's drifting load)")
    parser.add_argument("--count-kernels", action="store_true",
                        help="instead of timing: eager kernels per denoising step and per layer, cache none/prefix/"
                             "dual, on LLaDA-8B made narrow (its 32 layers, width 128; batch 1, bf16)")
    parser.add_argument("--before", metavar="TREE",
                        help="time the eager dllm_fast providers here and with dllm_fast from checkout TREE (built "
                             "in place), in fresh processes taking turns")
    parser.add_argument("--rounds", type=int, default=3, help="with --before: turns per tree (default 3)")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="roll out a LoRA policy as train does: PEFT adapters of this rank on every block "
                             "projection, fp32 on the bf16 base, under bf16 autocast (default 0: none)")
    add_results_dir_argument(parser)
    args = parser.parse_args()
    if args.device == "cuda":
        base, batches = GPU_POINT, args.batch or [1, 8]
    else:
        base, batches = CPU_POINT, args.batch or [4]
    points = [dict(base, device=args.device, batch=batch, temperature=args.temperature, seed=0,
                   lora_rank=args.lora_rank) for batch in batches]
    if args.count_kernels:
        rows = count_kernels(dict(GPU_POINT, device=args.device))
        print_table(rows, ["cache", "layers", "kernels_per_step", "kernels_per_layer", "outside_layers"])
        import dllm_fast

        config = dict(GPU_POINT, counted=counted_run(GPU_POINT),
                      narrow=dataclasses.asdict(narrow_config_of(GPU_POINT)), package=dllm_fast.__file__)
        print(f"wrote {write_results(f'rollout_kernels_{args.device}', config, rows, args.results_dir)}")
        return
    if args.before:
        names = [name for name in args.providers if name.startswith("dllm_fast")]
        rows = before_and_after(points, names, args.before, args.rounds)
        print_table(rows, ["batch", "provider", "before_s", "after_s", "speedup", "rounds"])
        config = dict(base, batches=batches, temperature=args.temperature, before=args.before, rounds=args.rounds)
        print(f"wrote {write_results(f'rollout_before_after_{args.device}', config, rows, args.results_dir)}")
        return
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
    config = dict(base, batches=batches, temperature=args.temperature, providers=args.providers,
                  lora_rank=args.lora_rank)
    print(f"wrote {write_results(f'rollout_{args.device}', config, rows, args.results_dir)}")


if __name__ == "__main__":
    main()
