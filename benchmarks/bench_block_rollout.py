"""Block-diffusion rollouts (SDAR shapes): dllm_fast.generate's exact block KV cache against recomputing the
whole canvas every step, side by side.

    python benchmarks/bench_block_rollout.py                  # CPU: sdar-1.7b's widths and vocabulary, 2 of its
                                                              #      28 layers, fp32, batch 2, prompt 32, gen 32
    python benchmarks/bench_block_rollout.py --layers 28 --device cuda --dtype bfloat16 --batch 1 8 \\
        --prompt 200 --gen 256                               # GPU: the whole sdar-1.7b
    python benchmarks/bench_block_rollout.py --preset sdar-8b --layers 36 --device cuda --dtype bfloat16 \\
        --batch 8 --prompt 200 --gen 256 --providers "dllm_fast block" "compiled block"   # SDAR-8B, eager and compiled

Providers (all dllm_fast.generate on one random model, the same seed): cache="none" (every step recomputes the
whole canvas with the block-causal mask: no reuse), cache="block" (the prompt's whole blocks prefilled once, each
step feeds its block against the cached keys and values of the earlier ones; a finished block is stored by the
next block's first step), cache="block" with SDAR's dynamic rule (threshold 0.9 with the steps), and
cache="block" compiled (generate(compile=True): each denoising step one torch.compile graph, a CUDA graph on a
GPU; its warm-up call compiles, and the timed call after it does not). Blocks of 4
and a step per token by default (the official generate's defaults: block_length 4, denoising_steps 4). Each
provider runs in a fresh process (its peak resident memory above the post-warm-up baseline is its own); tokens/s
counts B * gen generated tokens per second of generate(); greedy, so each provider's agreement with cache="none"
is reported (the cache is exact: fixed-schedule providers agree token for token).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    Provider, add_ratio, add_results_dir_argument, measure_in_fresh_process, print_table, run_sweep, write_results,
)

GENERATE_OPTIONS = {
    "dllm_fast none": dict(cache="none"),
    "dllm_fast block": dict(cache="block"),
    "dllm_fast block dynamic t0.9": dict(cache="block", threshold=0.9),
    "compiled block": dict(cache="block", compile=True),
}


@dataclasses.dataclass
class Rollout:
    model: Any
    prompts: torch.Tensor
    kwargs: dict


def setup_rollout(options: dict, point: dict) -> Rollout:
    from dllm_fast.models import SDARConfig, SDARModel

    config = dataclasses.replace(SDARConfig.preset(point["preset"]), num_hidden_layers=point["layers"],
                                 block_size=point["block"])
    device = torch.device(point["device"])
    model = SDARModel.with_random_weights(config, dtype=getattr(torch, point["dtype"]), device=device,
                                          seed=point["seed"]).eval()
    generator = torch.Generator(device).manual_seed(point["seed"] + 1)
    vocabulary = min(151643, model.mask_token_id)  # ordinary tokens (the tiny preset's mask id ends its table)
    prompts = torch.randint(0, vocabulary, (point["batch"], point["prompt"]), device=device, generator=generator)
    kwargs = dict(gen_length=point["gen"], block_length=point["block"], steps=point["steps"], **options)
    return Rollout(model, prompts, kwargs)


def run_rollout(rollout: Rollout):
    import dllm_fast

    return dllm_fast.generate(rollout.model, rollout.prompts, **rollout.kwargs)


def summary(result) -> dict:
    return dict(nfe=result.nfe, completion=result.completion_ids.cpu().tolist())


PROVIDERS = {name: Provider(name, setup=functools.partial(setup_rollout, options), run=run_rollout)
             for name, options in GENERATE_OPTIONS.items()}


def measure(provider: Provider, point: dict) -> dict:
    out = measure_in_fresh_process(provider, point, repeats=1, summarize=summary)
    seconds = out["timing"].median_s
    return dict(seconds=seconds, nfe=out["summary"]["nfe"], tokens_per_s=point["batch"] * point["gen"] / seconds,
                peak_mb=out["peak_bytes"] / 2**20, completion=out["summary"]["completion"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--preset", default="sdar-1.7b", choices=["sdar-tiny", "sdar-1.7b", "sdar-8b"])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the preset kept (its widths stay)")
    parser.add_argument("--batch", type=int, nargs="+", default=[2])
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--gen", type=int, default=32)
    parser.add_argument("--block", type=int, default=4)
    parser.add_argument("--steps-per-block", type=int, default=4)
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS))
    add_results_dir_argument(parser)
    args = parser.parse_args()
    base = dict(device=args.device, dtype=args.dtype, preset=args.preset, layers=args.layers, prompt=args.prompt,
                gen=args.gen, block=args.block, steps=args.steps_per_block * args.gen // args.block, seed=0)
    points = [dict(base, batch=batch) for batch in args.batch]
    rows = run_sweep(points, [PROVIDERS[name] for name in args.providers], measure, row_keys=("batch",))
    add_ratio(rows, "speedup_vs_none", "tokens_per_s", baseline={"provider": "dllm_fast none"}, match=("batch",))
    add_ratio(rows, "speedup_vs_eager", "tokens_per_s", baseline={"provider": "dllm_fast block"}, match=("batch",))
    for column, baseline in (("agree_with_none", "dllm_fast none"), ("agree_with_eager", "dllm_fast block")):
        for row in rows:
            reference = next((r for r in rows if r["provider"] == baseline and r["batch"] == row["batch"]
                              and r["status"] == "ok"), None)
            if row["status"] == "ok" and reference is not None:
                same = torch.tensor(row["completion"]) == torch.tensor(reference["completion"])
                row[column] = same.double().mean().item()
    for row in rows:
        row.pop("completion", None)
    print_table(rows, ["batch", "provider", "status", "seconds", "nfe", "tokens_per_s", "peak_mb", "speedup_vs_none",
                       "speedup_vs_eager", "agree_with_none", "agree_with_eager"])
    path = write_results(f"block_rollout_{args.device}", dict(base, batches=args.batch), rows, args.results_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
