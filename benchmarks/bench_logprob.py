"""Fused masked log-probs against the naive LM head + log-softmax + gather, forward and backward.

    python benchmarks/bench_logprob.py                 # CPU: d=512, V=126464, M in {256, 2048}
    python benchmarks/bench_logprob.py --device cuda   # GPU: d=4096, V=126464, M in {2048, 8192}, bf16

Providers, side by side in one run:
    naive      log_softmax((hidden @ W.T).float()).gather(targets): the [M, V] logits live through backward;
    dllm_fast  dllm_fast.masked_logprobs: chunked over V, backward recomputes the chunks.
Time is the median (and the minimum) of --repeats calls after a warm-up. Memory is the peak above baseline
during forward + backward: resident memory of a fresh subprocess on CPU, torch.cuda.max_memory_allocated on
GPU; both include the gradients themselves (grad_W is [V, d]). "saved" is what autograd keeps for backward.
Inputs are realistic: logits have a std of about 2.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

import dllm_fast

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    Provider, add_ratio, add_results_dir_argument, peak_extra_bytes, print_table, run_sweep, saved_bytes, time_call,
    write_results,
)

VOCAB = 126464


def naive(hidden, weight, targets):
    return torch.log_softmax((hidden @ weight.T).float(), dim=-1).gather(1, targets[:, None]).squeeze(1)


def fused(hidden, weight, targets):
    return dllm_fast.masked_logprobs(hidden, weight, targets)


def make_inputs(point: dict) -> dict:
    """hidden [M, d] and weight [V, d] (requiring grad), targets [M] and the upstream gradient, seeded."""
    M, d, V, device = point["M"], point["d"], point["V"], torch.device(point["device"])
    dtype = getattr(torch, point["dtype"])
    gen = torch.Generator(device=device).manual_seed(point.get("seed", 0))
    hidden = torch.randn(M, d, device=device, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(V, d, device=device, generator=gen) * (2 / d**0.5)).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (M,), device=device, generator=gen)
    upstream = torch.randn(M, device=device, generator=gen)
    return dict(hidden=hidden, weight=weight, targets=targets, upstream=upstream)


def forward(logprobs, inputs: dict):
    return logprobs(inputs["hidden"].detach(), inputs["weight"].detach(), inputs["targets"])


def forward_backward(logprobs, inputs: dict) -> None:
    hidden, weight = inputs["hidden"], inputs["weight"]
    hidden.grad = weight.grad = None
    logprobs(hidden, weight, inputs["targets"]).backward(inputs["upstream"])


def warm_up(logprobs, inputs: dict) -> None:
    """Threads and libraries on a small problem (8 rows, 1024 columns), so no full-size buffer stays cached."""
    hidden = inputs["hidden"]
    dtype = str(hidden.dtype).removeprefix("torch.")
    small = dict(device=str(hidden.device), M=8, d=hidden.shape[1], V=1024, dtype=dtype)
    forward_backward(logprobs, make_inputs(small))


def logprob_provider(name: str, logprobs) -> Provider:
    return Provider(name, setup=make_inputs, run=functools.partial(forward_backward, logprobs),
                    warm_up=functools.partial(warm_up, logprobs), modes={"fwd": functools.partial(forward, logprobs)})


PROVIDERS = {p.name: p for p in (logprob_provider("naive", naive), logprob_provider("dllm_fast", fused))}


def measure(provider: Provider, point: dict, repeats: int) -> dict:
    device = point["device"]
    inputs = provider.prepare(point)
    fwd = time_call(lambda: provider.modes["fwd"](inputs), device, repeats=repeats)
    full = time_call(lambda: provider.run(inputs), device, repeats=repeats)
    saved = saved_bytes(lambda: provider.run(inputs))
    peak = peak_extra_bytes(provider, point, inputs)
    return dict(fwd_ms=fwd.median_s * 1e3, fwd_bwd_ms=full.median_s * 1e3, fwd_min_ms=fwd.min_s * 1e3,
                fwd_bwd_min_ms=full.min_s * 1e3, peak_mb=peak / 2**20, saved_mb=saved / 2**20)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--m", type=int, nargs="+", help="rows to score (default: by device)")
    parser.add_argument("--repeats", type=int, default=3)
    add_results_dir_argument(parser)
    args = parser.parse_args()
    if args.device == "cuda":
        sizes, d, dtype = args.m or [2048, 8192], 4096, "bfloat16"
    else:
        sizes, d, dtype = args.m or [256, 2048], 512, "float32"
    points = [dict(device=args.device, M=M, d=d, V=VOCAB, dtype=dtype) for M in sizes]
    rows = run_sweep(points, list(PROVIDERS.values()), functools.partial(measure, repeats=args.repeats),
                     row_keys=("M", "d", "V", "dtype"))
    for name, metric in (("speedup_fwd_bwd", "fwd_bwd_ms"), ("memory_ratio", "peak_mb")):
        add_ratio(rows, name, metric, baseline={"provider": "naive"}, match=("M",), invert=True)
    print_table(rows, ["M", "d", "dtype", "provider", "status", "fwd_ms", "fwd_bwd_ms", "peak_mb", "saved_mb",
                       "speedup_fwd_bwd", "memory_ratio"])
    config = dict(sizes=sizes, d=d, V=VOCAB, dtype=f"torch.{dtype}", repeats=args.repeats)
    print(f"wrote {write_results(f'logprob_{args.device}', config, rows, args.results_dir)}")


if __name__ == "__main__":
    main()
