"""The attention call of a dual-cache denoising step, by SDPA backend: which kernel serves a block's queries
against the cached keys fastest (issue 38 item 3: attention was 0.97 ms of the compiled step's 13.3 busy ms at
LLaDA-8B, batch 8; 32 calls, one a layer).

    python benchmarks/bench_attention.py --device cuda      # batch 8, 32 heads, 32 queries, 456 keys, D 128, bf16
    python benchmarks/bench_attention.py --device cuda --batch 8 32
    python benchmarks/bench_attention.py                    # CPU: a smoke run at a small shape (math backend)

The keys and values are what layers.attention gets from the KV cache: strided views of a layer's
[B, capacity, 2 * heads, D] buffer (a position's keys and values side by side), the queries a view of the fused
QKV projection. Providers: torch's own choice (what the step runs today), each SDPA backend forced (cudnn,
flash, efficient, math), the same on contiguous keys and values, and flash split in two along the keys (the two
halves folded into the batch, so twice the thread blocks, merged by their logsumexp: the split-KV form of
flash-decoding, for a block's few queries). Each is timed over --calls calls between CUDA events after a warm-up,
and checked against math in fp32 (max abs difference). per_step_ms = 32 layers x the call's time. On CPU the
flash providers are torch's CPU flash kernel: a check of the split form's arithmetic, not a timing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_results_dir_argument, print_table, write_results  # noqa: E402

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
LAYERS = 32


def inputs(batch: int, heads: int, queries: int, keys: int, dim: int, dtype, device):
    """q [B, H, Q, D] as a view of a fused projection; k, v [B, H, S, D] as views of a dual cache's layer."""
    generator = torch.Generator(device).manual_seed(0)
    qkv = torch.randn(batch, queries, 3 * heads, dim, generator=generator, device=device, dtype=dtype)
    cache = torch.randn(batch, keys, 2 * heads, dim, generator=generator, device=device, dtype=dtype)
    q = qkv[:, :, :heads].transpose(1, 2)
    k, v = cache[:, :, :heads].transpose(1, 2), cache[:, :, heads:].transpose(1, 2)
    return q, k, v, cache


def split_flash(q, cache, heads: int, splits: int = 2):
    """Flash attention over `splits` key ranges at once (each range a batch entry of its own), merged by the
    ranges' logsumexp. cache [B, S, 2H, D] with S divisible by splits (a view: the ranges are consecutive)."""
    B, S, _, D = cache.shape
    parts = cache.view(B * splits, S // splits, 2 * heads, D)
    k, v = parts[:, :, :heads].transpose(1, 2), parts[:, :, heads:].transpose(1, 2)
    queries = q.unsqueeze(1).expand(B, splits, *q.shape[1:]).reshape(B * splits, *q.shape[1:])
    flash = torch.ops.aten._scaled_dot_product_flash_attention if q.is_cuda else \
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = flash(queries, k, v)[:2]
    out = out.view(B, splits, *out.shape[1:]).float()
    lse = lse.view(B, splits, *lse.shape[1:])  # [B, splits, H, Q]
    weights = torch.softmax(lse, dim=1).unsqueeze(-1)
    return (weights * out).sum(1).to(q.dtype)


def providers(q, k, v, cache, heads: int, device):
    def forced(backend, contiguous=False):
        key, value = (k.contiguous(), v.contiguous()) if contiguous else (k, v)

        def call():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, key, value)
        return call

    found = {"default": lambda: F.scaled_dot_product_attention(q, k, v)}
    names = ["cudnn", "flash", "efficient", "math"] if device.type == "cuda" else ["math"]
    for name in names:
        found[name] = forced(BACKENDS[name])
        found[name + " contiguous"] = forced(BACKENDS[name], contiguous=True)
    if cache.shape[1] % 2 == 0:
        found["flash split-2"] = lambda: split_flash(q, cache, heads)
    return found


def time_call(call, calls: int, device) -> float:
    """Seconds per call: CUDA events around `calls` calls on a GPU, wall time on CPU."""
    for _ in range(3):
        call()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(calls):
            call()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / calls
    import time

    began = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - began) / calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, nargs="+", help="sequences (default: 8 on cuda, 2 on cpu)")
    parser.add_argument("--queries", type=int, default=32, help="the block's positions (default 32)")
    parser.add_argument("--keys", type=int, default=None, help="cached positions (default: 456 on cuda, 64 on cpu)")
    parser.add_argument("--calls", type=int, default=200)
    add_results_dir_argument(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    heads, dim = (32, 128) if cuda else (4, 32)
    keys = args.keys or (456 if cuda else 64)
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    for batch in args.batch or ([8] if cuda else [2]):
        q, k, v, cache = inputs(batch, heads, args.queries, keys, dim, dtype, device)
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        for name, call in providers(q, k, v, cache, heads, device).items():
            row = dict(batch=batch, provider=name)
            try:
                error = (call().float() - want).abs().max().item()
                seconds = time_call(call, args.calls, device)
            except RuntimeError as failure:  # a backend that does not take this shape or layout
                rows.append(dict(row, status=f"unsupported: {str(failure).splitlines()[0][:80]}"))
                continue
            rows.append(dict(row, status="ok", us_per_call=seconds * 1e6, per_step_ms=LAYERS * seconds * 1e3,
                             max_abs_error=error))
        base = next((r for r in rows if r["batch"] == batch and r["provider"] == "default" and r["status"] == "ok"),
                    None)
        for row in rows:
            if base is not None and row["batch"] == batch and row["status"] == "ok":
                row["speedup_vs_default"] = base["us_per_call"] / row["us_per_call"]
    print_table(rows, ["batch", "provider", "status", "us_per_call", "per_step_ms", "speedup_vs_default",
                       "max_abs_error"])
    config = dict(device=args.device, heads=heads, queries=args.queries, keys=keys, dim=dim, dtype=str(dtype),
                  calls=args.calls)
    print(f"wrote {write_results(f'attention_{args.device}', config, rows, args.results_dir)}")


if __name__ == "__main__":
    main()
