"""The error of a bf16/fp16 fused LM head against fp64, next to the naive path's in the same dtype (issue 28 item 1).

Providers, on the same inputs (logits with a std of about 2, a partial last chunk):
    naive      torch in the model's dtype: logits, log_softmax and autograd's gradient GEMMs all in it;
    dllm_fast  masked_logprobs_grad (the known-gradient walk; grad_weight added into a zero buffer of the model's
               dtype): d(logits) rounded once to the model's dtype for the gradient GEMMs, fp32 accumulation;
    tf32       the same with tf32_grad_gemms=True: d(logits) kept in fp32 (TF32 GEMMs on CUDA, fp32 on CPU).
Each is run by the CPU kernel and by the CUDA kernel in the host emulator (--devices), whose cuBLAS rounds
TF32 inputs as tensor cores do. Errors: the largest absolute error against the fp64 oracle (the tests' measure,
bounded there by 2x naive), and the relative error ||x - x64|| / ||x64||.

    python benchmarks/measure_lm_head_precision.py
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_results  # noqa: E402

from dllm_fast import reference  # noqa: E402
from dllm_fast.ops import masked_logprobs_grad  # noqa: E402


def inputs(M, d, V, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, d, generator=gen).to(dtype)
    weight = (torch.randn(V, d, generator=gen) * 2 / d**0.5).to(dtype)
    targets = torch.randint(0, V, (M,), generator=gen)
    upstream = torch.randn(M, generator=gen).to(dtype).float()  # representable in dtype
    return hidden, weight, targets, upstream


def naive(hidden, weight, targets, upstream):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp = torch.log_softmax(h @ w.T, dim=-1).gather(1, targets[:, None]).squeeze(1)
    return (logp.detach(), *torch.autograd.grad(logp, (h, w), upstream.to(hidden.dtype)))


def fused(hidden, weight, targets, upstream, tf32, chunk):
    buffer = torch.zeros_like(weight)
    logp, grad_hidden = masked_logprobs_grad(hidden, weight, targets, upstream, grad_weight=buffer,
                                             chunk_size=chunk, tf32_grad_gemms=tf32)
    return logp, grad_hidden, buffer


def errors(got, truth) -> dict:
    out = {}
    for name, x, t in zip(("logp", "grad_hidden", "grad_weight"), got, truth):
        diff = x.double() - t
        out[f"{name}_max"] = diff.abs().max().item()
        out[f"{name}_rel"] = (diff.norm() / t.norm()).item()
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=128)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--v", type=int, default=4000)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    parser.add_argument("--devices", nargs="+", default=["cpu", "emulated_cuda"], choices=["cpu", "emulated_cuda"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        hidden, weight, targets, upstream = inputs(args.m, args.d, args.v, dtype, args.seed)
        truth = reference.masked_logprobs_grad(hidden.double(), weight.double(), targets, upstream.double())
        rows.append(dict(dtype=dtype_name, device="cpu", provider="naive",
                         **errors(naive(hidden, weight, targets, upstream), truth)))
        for device in args.devices:
            context = contextlib.nullcontext()
            if device == "emulated_cuda":
                from dllm_fast.testing.emulation import emulated_cuda

                context = emulated_cuda()
            with context:
                for provider, tf32 in (("dllm_fast", False), ("tf32", True)):
                    got = fused(hidden, weight, targets, upstream, tf32, args.chunk)
                    rows.append(dict(dtype=dtype_name, device=device, provider=provider, **errors(got, truth)))
    columns = ["dtype", "device", "provider", "logp_max", "grad_hidden_max", "grad_weight_max", "logp_rel",
               "grad_hidden_rel", "grad_weight_rel"]
    print_table(rows, columns)
    config = dict(M=args.m, d=args.d, V=args.v, chunk=args.chunk, seed=args.seed)
    print(f"wrote {write_results('lm_head_precision', config, rows, args.results_dir)}")


if __name__ == "__main__":
    main()
