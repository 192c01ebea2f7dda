"""Fused masked log-probs against the naive LM head + log-softmax + gather, forward and backward.

    python benchmarks/bench_logprob.py                 # CPU: d=512, V=126464, M in {256, 2048}
    python benchmarks/bench_logprob.py --device cuda   # GPU: d=4096, V=126464, M in {2048, 8192}, bf16

Providers, side by side in one run:
    naive      log_softmax((hidden @ W.T).float()).gather(targets): the [M, V] logits live through backward;
    dllm_fast  dllm_fast.masked_logprobs: chunked over V, backward recomputes the chunks.
Time is the median of --repeats calls after a warm-up. Memory is the peak above baseline during forward +
backward: resident memory of a fresh subprocess on CPU, torch.cuda.max_memory_allocated on GPU; both include
the gradients themselves (grad_W is [V, d]). Inputs are realistic: logits have a std of about 2.
"""

from __future__ import annotations

import argparse
import sys

import torch

import dllm_fast
from dllm_fast.memory import count_saved_tensors, peak_extra_rss

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from common import cuda_peak_extra_bytes, print_table, time_call, write_results  # noqa: E402

VOCAB = 126464


def naive(hidden, weight, targets):
    return torch.log_softmax((hidden @ weight.T).float(), dim=-1).gather(1, targets[:, None]).squeeze(1)


def fused(hidden, weight, targets):
    return dllm_fast.masked_logprobs(hidden, weight, targets)


PROVIDERS = {"naive": naive, "dllm_fast": fused}


def make_inputs(M, d, V, device, dtype, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(M, d, device=device, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(V, d, device=device, generator=gen) * (2 / d**0.5)).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (M,), device=device, generator=gen)
    return hidden, weight, targets


def forward_backward(provider, hidden, weight, targets, upstream):
    hidden.grad = weight.grad = None
    provider(hidden, weight, targets).backward(upstream)


def cpu_peak_extra(name, M, d, V, dtype) -> int:
    setup = f"""
import sys
sys.path.insert(0, {str(__import__("pathlib").Path(__file__).resolve().parent)!r})
import bench_logprob as b
h, w, t = b.make_inputs({M}, {d}, {V}, torch.device("cpu"), {dtype})
up = torch.ones({M})
b.forward_backward(b.PROVIDERS[{name!r}], *b.make_inputs(8, {d}, 1024, torch.device("cpu"), {dtype}), torch.ones(8))
"""
    return peak_extra_rss(setup, f"b.forward_backward(b.PROVIDERS[{name!r}], h, w, t, up)")


def run(device: torch.device, sizes: list[int], d: int, dtype: torch.dtype, repeats: int) -> list[dict]:
    rows = []
    for M in sizes:
        hidden, weight, targets = make_inputs(M, d, VOCAB, device, dtype)
        upstream = torch.randn(M, device=device)
        results = {}
        for name, provider in PROVIDERS.items():
            fwd = time_call(lambda: provider(hidden.detach(), weight.detach(), targets), device, repeats=repeats)
            full = time_call(lambda: forward_backward(provider, hidden, weight, targets, upstream), device,
                             repeats=repeats)
            with count_saved_tensors() as saved:
                provider(hidden, weight, targets)
            if device.type == "cuda":
                peak = cuda_peak_extra_bytes(lambda: forward_backward(provider, hidden, weight, targets, upstream),
                                             device)
            else:
                peak = cpu_peak_extra(name, M, d, VOCAB, dtype)
            results[name] = dict(fwd_ms=fwd * 1e3, fwd_bwd_ms=full * 1e3, peak_mb=peak / 2**20,
                                 saved_mb=saved.bytes / 2**20)
        for name, r in results.items():
            base = results["naive"]
            rows.append(dict(M=M, d=d, V=VOCAB, dtype=str(dtype).replace("torch.", ""), provider=name, **r,
                             speedup_fwd_bwd=base["fwd_bwd_ms"] / r["fwd_bwd_ms"],
                             memory_ratio=base["peak_mb"] / r["peak_mb"]))
        del hidden, weight, targets
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--m", type=int, nargs="+", help="rows to score (default: by device)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        sizes, d, dtype = args.m or [2048, 8192], 4096, torch.bfloat16
    else:
        sizes, d, dtype = args.m or [256, 2048], 512, torch.float32
    rows = run(device, sizes, d, dtype, args.repeats)
    print_table(rows, ["M", "d", "dtype", "provider", "fwd_ms", "fwd_bwd_ms", "peak_mb", "saved_mb",
                       "speedup_fwd_bwd", "memory_ratio"])
    path = write_results(f"logprob_{device.type}", dict(sizes=sizes, d=d, V=VOCAB, dtype=str(dtype),
                                                         repeats=args.repeats), rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
