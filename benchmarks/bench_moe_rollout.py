"""Mixture-of-experts block-diffusion rollouts (LLaDA2 shapes): the routed experts as grouped GEMMs, as sorted
batched GEMMs and as the official code's per-expert loop, side by side; and the eager kernels of one
mixture-of-experts layer.

    python benchmarks/bench_moe_rollout.py                    # CPU: llada2-mini's widths (2048, 256 experts of
                                                              # 512, top-8, a shared expert), 2 of its 20 layers
                                                              # (the dense one and a MoE one), a 16,384-token
                                                              # vocabulary, fp32, batch 1 and 4, prompt 32, gen 32
    python benchmarks/bench_moe_rollout.py --count-kernels    # eager kernels of one MoE layer, by op
    python benchmarks/bench_moe_rollout.py --device cuda --dtype bfloat16 --layers 20 --vocab 157184 \\
        --batch 1 8 --prompt 200 --gen 256                   # GPU: the whole llada2-mini

Providers (dllm_fast.generate on one random model, the same seed, cache="block", the official generate's rule:
blocks of 32, threshold 0.95 with a fixed schedule of --steps-per-block steps): the model's `experts_provider`
"grouped_mm" (torch._grouped_mm over the tokens sorted by expert; on CPU its reference kernel), "bmm" (the sorted
tokens padded per expert into one batched GEMM per projection; the CPU default) and "loop" (one GEMM per expert
that has tokens, a host sync per layer: the official code's inference path). Each provider runs in a fresh process;
tokens/s counts B * gen generated tokens per second of generate(); greedy, so each provider's agreement with
"loop" is reported.
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

EXPERT_PROVIDERS = ("grouped_mm", "bmm", "loop")
# The eager kernels one MoE layer launches with grouped GEMMs (test_llada2_rollouts pins it; measured with
# --count-kernels): routing 17 (the fp32 router GEMM, sigmoid, bias add, the groups' top-2 and their sum, the
# groups' top-k, the dropped groups' mask and fill, the experts' top-k, gather, normalise, scale), dispatch 10
# (sort by expert, rows per expert, offsets, gather the rows), the two grouped GEMMs with SiLU and the product
# between them, the unsort and the weighted sum, the shared expert (2 GEMMs, SiLU, product) and the sum with it.
# The sorted batched GEMMs ("bmm") launch 51 (the padding, and a host read of the largest expert's rows); the
# per-expert loop 3 GEMMs and 2 elementwise kernels per expert that has tokens.
MOE_LAYER_KERNELS = 41


@dataclasses.dataclass
class Rollout:
    model: Any
    prompts: torch.Tensor
    kwargs: dict


def model_config(point: dict):
    from dllm_fast.models import LLaDA2Config

    vocab = point["vocab"]
    return dataclasses.replace(LLaDA2Config.preset(point["preset"]), num_hidden_layers=point["layers"],
                               block_size=point["block"], vocab_size=vocab, mask_token_id=vocab - 1,
                               eos_token_id=vocab - 2, pad_token_id=vocab - 2)


def setup_rollout(provider: str, point: dict) -> Rollout:
    from dllm_fast.models import LLaDA2Model

    device = torch.device(point["device"])
    model = LLaDA2Model.with_random_weights(model_config(point), dtype=getattr(torch, point["dtype"]), device=device,
                                            seed=point["seed"]).eval()
    model.experts_provider = provider
    generator = torch.Generator(device).manual_seed(point["seed"] + 1)
    prompts = torch.randint(0, point["vocab"] - 3, (point["batch"], point["prompt"]), device=device,
                            generator=generator)
    kwargs = dict(gen_length=point["gen"], block_length=point["block"], steps=point["steps"], threshold=0.95,
                  cache="block")
    return Rollout(model, prompts, kwargs)


def run_rollout(rollout: Rollout):
    import dllm_fast

    return dllm_fast.generate(rollout.model, rollout.prompts, **rollout.kwargs)


def summary(result) -> dict:
    return dict(nfe=result.nfe, completion=result.completion_ids.cpu().tolist())


PROVIDERS = {name: Provider(name, setup=functools.partial(setup_rollout, name), run=run_rollout)
             for name in EXPERT_PROVIDERS}


def measure(provider: Provider, point: dict) -> dict:
    out = measure_in_fresh_process(provider, point, repeats=1, summarize=summary)
    seconds = out["timing"].median_s
    return dict(seconds=seconds, nfe=out["summary"]["nfe"], tokens_per_s=point["batch"] * point["gen"] / seconds,
                peak_mb=out["peak_bytes"] / 2**20, completion=out["summary"]["completion"])


def moe_layer_kernels(model, tokens: int) -> tuple[int, dict[str, int]]:
    """(kernels, kernels by op) one mixture-of-experts layer of `model` launches in an eager forward of `tokens`
    tokens, counted on the profiler's CPU trace as bench_rollout.count_step_kernels counts a step's; a grouped GEMM
    is one kernel, as on CUDA (the CPU runs it as a GEMM per expert)."""
    import bench_rollout

    one_kernel = bench_rollout.ONE_KERNEL_ON_GPU
    bench_rollout.ONE_KERNEL_ON_GPU = one_kernel | {"aten::_grouped_mm"}
    try:
        return _layer_kernels(bench_rollout, model, tokens)
    finally:
        bench_rollout.ONE_KERNEL_ON_GPU = one_kernel


def _layer_kernels(bench_rollout, model, tokens: int) -> tuple[int, dict[str, int]]:
    layer = model.moe_layers()[0]
    x = torch.randn(1, tokens, model.config.hidden_size, dtype=model.dtype, device=model.device)
    with torch.no_grad():
        layer(x)  # warm-up
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            with torch.profiler.record_function("moe layer"):
                layer(x)
    ranges = [event for event in profile.events() if event.name == "moe layer"]
    tally: dict[str, int] = {}
    total = sum(bench_rollout._launches(child, tally) for child in ranges[0].cpu_children)
    return total, tally


def count_kernels(args) -> None:
    from dllm_fast.models import LLaDA2Model

    rows = []
    for provider in EXPERT_PROVIDERS:
        point = dict(preset=args.preset, layers=2, block=args.block, vocab=1024, seed=0)
        config = dataclasses.replace(model_config(point), hidden_size=128, intermediate_size=256,
                                     moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=32)
        model = LLaDA2Model.with_random_weights(config, dtype=getattr(torch, args.dtype), device=args.device)
        model.experts_provider = provider
        total, by_op = moe_layer_kernels(model, tokens=args.block * args.batch[0])
        rows.append(dict(provider=provider, experts=config.num_experts, kernels=total,
                         ops=", ".join(f"{name.removeprefix('aten::')} {count}" for name, count in by_op.items())))
    print_table(rows, ["provider", "experts", "kernels", "ops"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--preset", default="llada2-mini", choices=["llada2-tiny", "llada2-mini", "llada2-flash"])
    parser.add_argument("--layers", type=int, default=2, help="layers of the preset kept (its widths stay)")
    parser.add_argument("--vocab", type=int, default=16384, help="vocabulary (the preset's is 157,184)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--gen", type=int, default=32)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--steps-per-block", type=int, default=8)
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS))
    parser.add_argument("--count-kernels", action="store_true", help="only count one MoE layer's eager kernels")
    add_results_dir_argument(parser)
    args = parser.parse_args()
    if args.count_kernels:
        count_kernels(args)
        return
    base = dict(device=args.device, dtype=args.dtype, preset=args.preset, layers=args.layers, vocab=args.vocab,
                prompt=args.prompt, gen=args.gen, block=args.block,
                steps=args.steps_per_block * args.gen // args.block, seed=0)
    points = [dict(base, batch=batch) for batch in args.batch]
    rows = run_sweep(points, [PROVIDERS[name] for name in args.providers], measure, row_keys=("batch",))
    add_ratio(rows, "speedup_vs_loop", "tokens_per_s", baseline={"provider": "loop"}, match=("batch",))
    for row in rows:
        reference = next((r for r in rows if r["provider"] == "loop" and r["batch"] == row["batch"]
                          and r["status"] == "ok"), None)
        if row["status"] == "ok" and reference is not None:
            same = torch.tensor(row["completion"]) == torch.tensor(reference["completion"])
            row["agree_with_loop"] = same.double().mean().item()
    for row in rows:
        row.pop("completion", None)
    print_table(rows, ["batch", "provider", "status", "seconds", "nfe", "tokens_per_s", "peak_mb", "speedup_vs_loop",
                       "agree_with_loop"])
    path = write_results(f"moe_rollout_{args.device}", dict(base, batches=args.batch), rows, args.results_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
