"""Rollout throughput and memory: the reference sampler against dllm_fast's cache modes, side by side.

    python benchmarks/bench_rollout.py                 # CPU: small preset, batch 4, prompt 64, gen 128, block 32, 64 steps
    python benchmarks/bench_rollout.py --device cuda   # GPU: llada-8b shapes (random bf16), batch 1 and 8,
                                                       #      prompt 200, gen 256, block 32, 128 steps, + roofline

Providers: reference (LLaDA generate.py port: full recompute, full logits), dllm_fast with cache none, prefix,
dual, and dual with threshold 0.9. Each provider runs in a fresh process on the same random model (same seed),
so its peak memory is its own: peak resident memory above the post-warm-up baseline on CPU,
torch.cuda.max_memory_allocated on GPU. Tokens/s counts B * gen_length generated tokens per second of
generate(). Greedy decoding (T = 0) by default, so every cached mode's agreement with cache="none" is
reported, and whether cache="none" reproduces the reference token for token.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, synchronize, write_results  # noqa: E402

PROVIDERS = {
    "reference": dict(backend="reference", cache="none"),
    "dllm_fast none": dict(cache="none"),
    "dllm_fast prefix": dict(cache="prefix"),
    "dllm_fast dual": dict(cache="dual"),
    "dllm_fast dual+t0.9": dict(cache="dual", threshold=0.9),
}

# Peak dense bf16 FLOP/s and HBM bandwidth (bytes/s) used for the roofline bound.
GPU_PEAKS = {"H100": (989.4e12, 3.35e12), "H200": (989.4e12, 4.8e12)}


def run_provider(name: str, settings: dict) -> dict:
    """In a fresh process: build the model, warm up, then time one rollout and record its peak memory."""
    import dllm_fast
    from dllm_fast import reference
    from dllm_fast.memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss
    from dllm_fast.models import LLaDAConfig, LLaDAModel

    device = torch.device(settings["device"])
    model = LLaDAModel.with_random_weights(LLaDAConfig.preset(settings["preset"]), device=device,
                                           dtype=getattr(torch, settings["dtype"]), seed=settings["seed"]).eval()
    B, P = settings["batch"], settings["prompt"]
    generator = torch.Generator(device).manual_seed(settings["seed"] + 1)
    prompts = torch.randint(0, model.config.mask_token_id, (B, P), device=device, generator=generator)
    options = dict(PROVIDERS[name])
    generate = reference.generate if options.pop("backend", None) == "reference" else dllm_fast.generate
    steps = None if "threshold" in options else settings["steps"]
    kwargs = dict(gen_length=settings["gen"], block_length=settings["block"], steps=steps,
                  temperature=settings["temperature"], **options)

    warm = dict(kwargs, gen_length=settings["block"], steps=None if steps is None else 1)
    generate(model, prompts, generator=torch.Generator(device).manual_seed(0), **warm)
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    else:
        reset_peak_rss()
        baseline = current_rss_bytes()
    start = time.perf_counter()
    result = generate(model, prompts, generator=torch.Generator(device).manual_seed(0), **kwargs)
    synchronize(device)
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()) - baseline
    return dict(seconds=seconds, nfe=result.nfe, peak_mb=peak / 2**20,
                tokens_per_s=B * settings["gen"] / seconds, completion=result.completion_ids.cpu().tolist())


def roofline_seconds(config, settings: dict, mode: str, peaks) -> float:
    """Lower bound on one rollout: per forward, max(FLOPs / peak FLOP/s, bytes / bandwidth), with bf16 weights
    read once per forward, the LM head applied to the masked block positions only, and the KV cache read."""
    flops_peak, bandwidth = peaks
    d, V, layers = config.d_model, config.vocab_size, config.n_layers
    per_token_body = 2 * layers * (4 * d * d + 3 * d * config.mlp_hidden_size)
    weight_bytes = 2 * (layers * (4 * d * d + 3 * d * config.mlp_hidden_size) + V * d)
    B, P, G, block = settings["batch"], settings["prompt"], settings["gen"], settings["block"]
    total, steps_per_block = P + G, settings["steps"] // (G // block)
    seconds = 0.0
    for b in range(G // block):
        start = P + b * block
        for step in range(steps_per_block):
            refresh = mode == "none" or step == 0
            queries = total if refresh else (total - start if mode == "prefix" else block)
            masked = block - step * block // steps_per_block
            flops = B * queries * (per_token_body + 4 * layers * total * d) + 2 * B * masked * V * d
            kv_bytes = 0 if mode == "none" else 2 * 2 * layers * B * total * d
            seconds += max(flops / flops_peak, (weight_bytes + kv_bytes) / bandwidth)
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, nargs="+", help="batch sizes (default: by device)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS))
    args = parser.parse_args()
    if args.device == "cuda":
        base = dict(preset="llada-8b", dtype="bfloat16", prompt=200, gen=256, block=32, steps=128)
        batches = args.batch or [1, 8]
    else:
        base = dict(preset="small", dtype="float32", prompt=64, gen=128, block=32, steps=64)
        batches = args.batch or [4]
    context = multiprocessing.get_context("spawn")
    rows = []
    for batch in batches:
        settings = dict(base, device=args.device, batch=batch, temperature=args.temperature, seed=0)
        results = {}
        for name in args.providers:
            with context.Pool(1) as pool:
                results[name] = pool.apply(run_provider, (name, settings))
            print(f"batch {batch} {name}: {results[name]['tokens_per_s']:.1f} tok/s", flush=True)
        reference_speed = results["reference"]["tokens_per_s"] if "reference" in results else None
        none_tokens = results.get("dllm_fast none", {}).get("completion")
        peaks = None
        if args.device == "cuda":
            from dllm_fast.models import LLaDAConfig

            name = torch.cuda.get_device_name()
            peaks = next((v for k, v in GPU_PEAKS.items() if k in name), None)
        for name, r in results.items():
            row = dict(batch=batch, provider=name, seconds=r["seconds"], nfe=r["nfe"], tokens_per_s=r["tokens_per_s"],
                       peak_mb=r["peak_mb"])
            if reference_speed:
                row["speedup_vs_reference"] = r["tokens_per_s"] / reference_speed
            if none_tokens is not None:
                a, b = torch.tensor(r["completion"]), torch.tensor(none_tokens)
                row["agree_with_none"] = (a == b).double().mean().item()
            if peaks is not None and name.startswith("dllm_fast"):
                mode = PROVIDERS[name]["cache"]
                if "threshold" not in PROVIDERS[name]:
                    bound = roofline_seconds(LLaDAConfig.preset(settings["preset"]), settings, mode, peaks)
                    row["roofline_s"] = bound
                    row["vs_roofline"] = r["seconds"] / bound
            rows.append(row)
        if "reference" in results and none_tokens is not None:
            print(f"batch {batch}: dllm_fast none token-identical to the reference: "
                  f"{results['reference']['completion'] == none_tokens}")
    print_table(rows, ["batch", "provider", "seconds", "nfe", "tokens_per_s", "peak_mb", "speedup_vs_reference",
                       "agree_with_none", "roofline_s", "vs_roofline"])
    config = dict(base, batches=batches, temperature=args.temperature, providers=args.providers)
    print(f"wrote {write_results(f'rollout_{args.device}', config, rows)}")


if __name__ == "__main__":
    main()
