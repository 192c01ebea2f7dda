"""Fused masked log-probs against the naive LM head + log-softmax + gather, forward and backward.

    python benchmarks/bench_logprob.py                 # CPU: d=512, V=126464, M in {256, 2048}
    python benchmarks/bench_logprob.py --device cuda   # GPU: d=4096, V=126464, M in {2048, 8192}, bf16
    python benchmarks/bench_logprob.py --roofline --threads 1      # GEMM efficiency against torch.mm, by chunk

Results go to benchmarks/results/<name>.new.json (untracked, beside the recorded <name>.json), so an exploratory
run leaves the repository clean; --record writes the recorded <name>.json itself (and --name picks the name).

Providers, side by side in one run:
    naive      log_softmax((hidden @ W.T).float()).gather(targets): the [M, V] logits live through backward;
    dllm_fast  dllm_fast.masked_logprobs: chunked over V, backward recomputes the chunks (bf16: its gradient
               GEMMs in bf16 with fp32 accumulation);
    dllm_fast_tf32  the same with tf32_grad_gemms=True, the gradient GEMMs in TF32 on fp32 copies (the path
               before issue 28; --device cuda only: on CPU it computes what dllm_fast does).
Time is the median (and the minimum) of --repeats calls after a warm-up. Memory is the peak above baseline
during forward + backward: resident memory of a fresh subprocess on CPU, torch.cuda.max_memory_allocated on
GPU; both include the gradients themselves (grad_W is [V, d]). "saved" is what autograd keeps for backward.
Inputs are realistic: logits have a std of about 2.

--roofline measures GEMM efficiency at each M and vocabulary chunk: achieved FLOP/s of the fused ops against
torch.mm(hidden, W.T) at the same M, d, V (the logits GEMM, 2 M d V FLOPs, [M, V] written out), all timed in turns
(minimum of --repeats rounds). masked_logprobs_grad with a known logsumexp does 3 GEMMs per chunk (6 M d V
FLOPs: logits, grad_hidden, grad_weight added into a buffer), the forward 1 (2 M d V), the ordinary backward 3
(it recomputes the logits). "vs mm" is the fused op's FLOP/s over torch.mm's; "vs mm_block" over torch.mm's
on a block of 4096 rows of W (the same GEMM without the [M, V] output leaving the cache: closer to what this
machine's GEMM can do); "default" marks the chunk that dllm_fast.ops.default_chunk_size picks for the device.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

import dllm_fast
import dllm_fast.ops

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    Provider, add_ratio, add_results_dir_argument, peak_extra_bytes, print_table, run_sweep, saved_bytes, time_call,
    time_interleaved, write_results,
)

VOCAB = 126464
MM_BLOCK = 4096  # --roofline: torch.mm on this many rows of W, an output that stays in cache: the GEMM's own rate


def naive(hidden, weight, targets):
    return torch.log_softmax((hidden @ weight.T).float(), dim=-1).gather(1, targets[:, None]).squeeze(1)


def fused(hidden, weight, targets):
    return dllm_fast.masked_logprobs(hidden, weight, targets)


def fused_tf32(hidden, weight, targets):
    return dllm_fast.masked_logprobs(hidden, weight, targets, tf32_grad_gemms=True)


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


PROVIDERS = {p.name: p for p in (logprob_provider("naive", naive), logprob_provider("dllm_fast", fused),
                                  logprob_provider("dllm_fast_tf32", fused_tf32))}


def measure(provider: Provider, point: dict, repeats: int) -> dict:
    device = point["device"]
    inputs = provider.prepare(point)
    fwd = time_call(lambda: provider.modes["fwd"](inputs), device, repeats=repeats)
    full = time_call(lambda: provider.run(inputs), device, repeats=repeats)
    saved = saved_bytes(lambda: provider.run(inputs))
    peak = peak_extra_bytes(provider, point, inputs)
    return dict(fwd_ms=fwd.median_s * 1e3, fwd_bwd_ms=full.median_s * 1e3, fwd_min_ms=fwd.min_s * 1e3,
                fwd_bwd_min_ms=full.min_s * 1e3, peak_mb=peak / 2**20, saved_mb=saved / 2**20)


def roofline(args, sizes, d, dtype) -> None:
    """GEMM efficiency of the fused ops against torch.mm at the same M, d, V, for each vocabulary chunk."""
    device = torch.device(args.device)
    rows = []
    for M in sizes:
        inputs = make_inputs(dict(device=args.device, M=M, d=d, V=VOCAB, dtype=dtype))
        hidden, weight, targets = (inputs[k].detach() for k in ("hidden", "weight", "targets"))
        upstream = inputs["upstream"].to(hidden.dtype)
        lse = torch.ops.dllm_fast.masked_logprobs(hidden, weight, targets, 4096)[1]
        buffer = torch.zeros_like(weight)
        default = dllm_fast.ops.default_chunk_size(M, VOCAB, device)
        chunks = sorted(set(args.chunks) | {default})
        block = weight[:MM_BLOCK]
        runs = {("torch.mm", 0): lambda: torch.mm(hidden, weight.T),
                ("torch.mm_block", MM_BLOCK): lambda: torch.mm(hidden, block.T)}
        for chunk in chunks:
            runs[("grad", chunk)] = functools.partial(torch.ops.dllm_fast.masked_logprobs_grad, hidden, weight,
                                                      targets, upstream, lse, buffer, chunk)
            runs[("forward", chunk)] = functools.partial(torch.ops.dllm_fast.masked_logprobs, hidden, weight,
                                                         targets, chunk)
            runs[("backward", chunk)] = functools.partial(
                torch.ops.dllm_fast.masked_logprobs_backward, upstream, None, hidden, weight, targets, lse, chunk,
                [True, True])
        if args.device == "cuda":  # the gradient GEMMs in TF32, as before issue 28, at the default chunk
            runs[("grad_tf32", default)] = functools.partial(torch.ops.dllm_fast.masked_logprobs_grad, hidden,
                                                             weight, targets, upstream, lse, buffer, default, True)
        for run in runs.values():
            run()  # warm-up
        timings = time_interleaved(runs, device, repeats=args.repeats)
        gemm = 2 * M * d * VOCAB
        flops = {"torch.mm": gemm, "torch.mm_block": 2 * M * d * MM_BLOCK, "grad": 3 * gemm, "forward": gemm,
                 "backward": 3 * gemm, "grad_tf32": 3 * gemm}
        mm_rate = gemm / timings[("torch.mm", 0)].min_s
        block_rate = flops["torch.mm_block"] / timings[("torch.mm_block", MM_BLOCK)].min_s
        for (op, chunk), timing in timings.items():
            rate = flops[op] / timing.min_s
            rows.append(dict(M=M, d=d, V=VOCAB, op=op, chunk=chunk or None,
                             default=op not in ("torch.mm", "torch.mm_block") and chunk == default,
                             ms=timing.min_s * 1e3, median_ms=timing.median_s * 1e3, gflops=rate / 1e9,
                             vs_mm=rate / mm_rate, vs_mm_block=rate / block_rate, status="ok"))
        del buffer
    print_table(rows, ["M", "op", "chunk", "default", "ms", "gflops", "vs_mm", "vs_mm_block"])
    config = dict(sizes=sizes, d=d, V=VOCAB, dtype=f"torch.{dtype}", repeats=args.repeats, chunks=args.chunks,
                  threads=torch.get_num_threads())
    name = results_name(args, f"logprob_roofline_{args.device}")
    print(f"wrote {write_results(name, config, rows, args.results_dir)}")


def results_name(args, default: str) -> str:
    """The results file's name: --name, else the recorded `default` under --record, else `default`.new, written
    beside the recorded results (git ignores benchmarks/results/*.new.json)."""
    name = args.name or default
    return name if args.record else f"{name}.new"


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--m", type=int, nargs="+", help="rows to score (default: by device)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--roofline", action="store_true", help="GEMM efficiency against torch.mm, by chunk")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768],
                        help="--roofline: vocabulary chunks to try (the device's default is added)")
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's default)")
    parser.add_argument("--name", help="results file name (default: logprob[_roofline]_<device>)")
    parser.add_argument("--record", action="store_true",
                        help="write the recorded results file <name>.json (default: <name>.new.json beside it)")
    add_results_dir_argument(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        sizes, d, dtype = args.m or [2048, 8192], 4096, "bfloat16"
    else:
        sizes, d, dtype = args.m or [256, 2048], 512, "float32"
    if args.roofline:
        return roofline(args, sizes, d, dtype)
    points = [dict(device=args.device, M=M, d=d, V=VOCAB, dtype=dtype) for M in sizes]
    providers = [PROVIDERS[name] for name in ("naive", "dllm_fast", "dllm_fast_tf32")
                 if name != "dllm_fast_tf32" or args.device == "cuda"]
    rows = run_sweep(points, providers, functools.partial(measure, repeats=args.repeats),
                     row_keys=("M", "d", "V", "dtype"))
    for name, metric in (("speedup_fwd_bwd", "fwd_bwd_ms"), ("memory_ratio", "peak_mb")):
        add_ratio(rows, name, metric, baseline={"provider": "naive"}, match=("M",), invert=True)
    print_table(rows, ["M", "d", "dtype", "provider", "status", "fwd_ms", "fwd_bwd_ms", "peak_mb", "saved_mb",
                       "speedup_fwd_bwd", "memory_ratio"])
    config = dict(sizes=sizes, d=d, V=VOCAB, dtype=f"torch.{dtype}", repeats=args.repeats)
    print(f"wrote {write_results(results_name(args, f'logprob_{args.device}'), config, rows, args.results_dir)}")


if __name__ == "__main__":
    main()
