"""Fused masked log-probs against the naive LM head + log-softmax + gather, forward and backward.

    python benchmarks/bench_logprob.py                 # CPU: d=512, V=126464, M in {256, 2048}
    python benchmarks/bench_logprob.py --device cuda   # GPU: d=4096, V=126464, M in {2048, 8192}, bf16
    python benchmarks/bench_logprob.py --roofline --threads 1      # GEMM efficiency against torch.mm, by chunk

Results go to benchmarks/results/<name>.new.json (untracked, beside the recorded <name>.json), so an exploratory
run leaves the repository clean; --record writes the recorded <name>.json itself (and --name picks the name).

Providers, side by side in one run:
    naive      log_softmax((hidden @ W.T).float()).gather(targets): the [M, V] logits live through backward;
    dllm_fast  dllm_fast.masked_logprobs(backend="compiled"): chunked over V, backward recomputes the chunks
               (bf16: its gradient GEMMs in bf16 with fp32 accumulation): the C++/CUDA kernels;
    dllm_fast_tf32  the same with tf32_grad_gemms=True, the gradient GEMMs in TF32 on fp32 copies (the path
               before issue 28; --device cuda only: on CPU it computes what dllm_fast does);
    dllm_fast_triton  masked_logprobs(backend="triton"): the Triton kernel's GEMM with the softmax in its
               epilogue, cuBLAS for the gradient GEMMs (issue 38; what auto takes on CUDA for bf16; --device cuda).
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

With triton importable on CUDA, --roofline adds the Triton path (issue 38), at the compiled default chunk, twice
it (the Triton default: bf16 d(logits) take half the bytes) and 32768: "torch.mm_chunks" (torch.mm of each chunk's
logits into a [M, C] buffer: the Triton kernel's shapes), "triton_kernel_grad" and "triton_kernel_lse" (the kernel
alone over the vocabulary, with its d(logits) or logsumexp epilogue: "vs_mm_same" is its rate over torch.mm_chunks'
at that chunk, the issue's 90%), "triton_grad" (the walk with the logsumexp known: 3 GEMMs, grad_weight into a
buffer), "triton_grad_frozen" (no weight gradient, LoRA: 2 GEMMs), "triton_forward" (1) and "triton_backward"
(3), and "mm3" (three torch.mm of the walk's shapes: the floor). --triton-sweep times the two kernel rows for
every sm_90 tile configuration of ops/triton_head.py (SM90_SWEEP), each checked against the default's d(logits).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

import torch

import dllm_fast
import dllm_fast.ops
from dllm_fast.ops import triton_head

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
    return dllm_fast.masked_logprobs(hidden, weight, targets, backend="compiled")


def fused_tf32(hidden, weight, targets):
    return dllm_fast.masked_logprobs(hidden, weight, targets, tf32_grad_gemms=True, backend="compiled")


def fused_triton(hidden, weight, targets):
    return dllm_fast.masked_logprobs(hidden, weight, targets, backend="triton")


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
                                  logprob_provider("dllm_fast_tf32", fused_tf32),
                                  logprob_provider("dllm_fast_triton", fused_triton))}


def measure(provider: Provider, point: dict, repeats: int) -> dict:
    device = point["device"]
    inputs = provider.prepare(point)
    fwd = time_call(lambda: provider.modes["fwd"](inputs), device, repeats=repeats)
    full = time_call(lambda: provider.run(inputs), device, repeats=repeats)
    saved = saved_bytes(lambda: provider.run(inputs))
    peak = peak_extra_bytes(provider, point, inputs)
    return dict(fwd_ms=fwd.median_s * 1e3, fwd_bwd_ms=full.median_s * 1e3, fwd_min_ms=fwd.min_s * 1e3,
                fwd_bwd_min_ms=full.min_s * 1e3, peak_mb=peak / 2**20, saved_mb=saved / 2**20)


# GEMMs of 2 M d V FLOPs each run (the ops' rows); the roofline multiplies them out.
TRITON_GEMMS = {"torch.mm_chunks": 1, "triton_kernel_grad": 1, "triton_kernel_lse": 1, "triton_grad": 3,
                "triton_grad_frozen": 2, "triton_forward": 1, "triton_backward": 3, "mm3": 3}


def chunk_views(weight, chunk):
    return [weight[v0:v0 + chunk] for v0 in range(0, weight.shape[0], chunk)]


def mm_chunks(hidden, weight, chunk, out):
    """torch.mm of each chunk's logits into one [M, chunk] buffer: the Triton kernel's GEMM shapes and output."""
    for w in chunk_views(weight, chunk):
        torch.mm(hidden, w.T, out=out[:, :w.shape[0]])


def kernel_grad(hidden, weight, targets, lse, upstream, chunk, out, config):
    """The Triton kernel alone with its d(logits) epilogue, over the vocabulary (no gradient GEMMs)."""
    found = torch.empty(hidden.shape[0], device=hidden.device)
    for v0, w in zip(range(0, weight.shape[0], chunk), chunk_views(weight, chunk)):
        triton_head.chunk_softmax_grad(hidden, w, targets, v0, lse, upstream, upstream, out[:, :w.shape[0]], found,
                                       config)


def kernel_lse(hidden, weight, targets, chunk, config):
    """The Triton kernel alone with its logsumexp epilogue, over the vocabulary."""
    found = torch.empty(hidden.shape[0], device=hidden.device)
    for v0, w in zip(range(0, weight.shape[0], chunk), chunk_views(weight, chunk)):
        triton_head.chunk_logsumexp(hidden, w, targets, v0, found, config)


def mm3(hidden, weight, out):
    """The walk's three GEMMs in torch.mm, whole: logits [M, V], grad_hidden [M, d], grad_weight [V, d]."""
    torch.mm(hidden, weight.T, out=out)
    torch.mm(out, weight)
    torch.mm(out.T, hidden)


def triton_runs(hidden, weight, targets, upstream, lse, buffer, chunks) -> dict:
    ops, config = torch.ops.dllm_fast, triton_head.default_config(hidden.device)
    g = upstream.float()
    whole = torch.empty(hidden.shape[0], weight.shape[0], dtype=hidden.dtype, device=hidden.device)
    runs = {("mm3", 0): functools.partial(mm3, hidden, weight, whole)}
    for chunk in chunks:
        out = torch.empty(hidden.shape[0], chunk, dtype=hidden.dtype, device=hidden.device)
        runs[("torch.mm_chunks", chunk)] = functools.partial(mm_chunks, hidden, weight, chunk, out)
        runs[("triton_kernel_grad", chunk)] = functools.partial(kernel_grad, hidden, weight, targets, lse, g, chunk,
                                                                out, config)
        runs[("triton_kernel_lse", chunk)] = functools.partial(kernel_lse, hidden, weight, targets, chunk, config)
        runs[("triton_grad", chunk)] = functools.partial(ops.masked_logprobs_grad_triton, hidden, weight, targets, g,
                                                         lse, buffer, chunk)
        runs[("triton_grad_frozen", chunk)] = functools.partial(ops.masked_logprobs_grad_triton, hidden, weight,
                                                                targets, g, lse, None, chunk)
        runs[("triton_forward", chunk)] = functools.partial(ops.masked_logprobs_triton, hidden, weight, targets, chunk)
        runs[("triton_backward", chunk)] = functools.partial(ops.masked_logprobs_backward_triton, g, None, hidden,
                                                             weight, targets, lse, chunk, [True, True])
    return runs


def triton_sweep(hidden, weight, targets, upstream, lse, chunk, repeats) -> list[dict]:
    """The two kernel rows at `chunk` for every sm_90 tile configuration (sm_80's on older GPUs), each one's
    d(logits) checked against the default configuration's (max_diff: 0 unless the fp32 sums differ at a tie)."""
    device = hidden.device
    M, d, V = hidden.shape[0], hidden.shape[1], weight.shape[0]
    if device.type != "cuda":  # the interpreter (a check of this function): its tiles, grid and persistent
        configs = (triton_head.INTERPRETER, dataclasses.replace(triton_head.INTERPRETER, persistent=True))
    elif torch.cuda.get_device_capability(device)[0] >= 9:
        configs = triton_head.SM90_SWEEP
    else:
        configs = (triton_head.SM80,)
    g, gemm = upstream.float(), 2 * M * d * V
    out = torch.empty(M, chunk, dtype=hidden.dtype, device=device)
    mm_s = time_interleaved({"mm": functools.partial(mm_chunks, hidden, weight, chunk, out)}, device,
                            repeats=repeats)["mm"].min_s
    reference_grad = torch.empty_like(out)
    kernel_grad(hidden, weight[:chunk], targets, lse, g, chunk, reference_grad, triton_head.default_config(device))
    rows = []
    for config in configs:
        row = dict(M=M, d=d, V=V, op="triton_sweep", chunk=chunk, tiles=config.label())
        try:
            check = torch.empty_like(out)
            kernel_grad(hidden, weight[:chunk], targets, lse, g, chunk, check, config)
            runs = {"grad": functools.partial(kernel_grad, hidden, weight, targets, lse, g, chunk, out, config),
                    "lse": functools.partial(kernel_lse, hidden, weight, targets, chunk, config)}
            for run in runs.values():
                run()
            timings = time_interleaved(runs, device, repeats=repeats)
            row.update(grad_ms=timings["grad"].min_s * 1e3, lse_ms=timings["lse"].min_s * 1e3,
                       mm_chunks_ms=mm_s * 1e3, grad_vs_mm_same=mm_s / timings["grad"].min_s,
                       lse_vs_mm_same=mm_s / timings["lse"].min_s, gflops_grad=gemm / timings["grad"].min_s / 1e9,
                       max_diff=(check.float() - reference_grad.float()).abs().max().item(), status="ok")
        except Exception as error:  # a configuration that does not compile (shared memory, registers) is reported
            row.update(status=f"{type(error).__name__}: {error}"[:200])
        rows.append(row)
    print_table(rows, ["tiles", "grad_ms", "lse_ms", "mm_chunks_ms", "grad_vs_mm_same", "lse_vs_mm_same", "max_diff",
                       "status"])
    return rows


def roofline(args, sizes, d, dtype) -> None:
    """GEMM efficiency of the fused ops against torch.mm at the same M, d, V, for each vocabulary chunk."""
    device = torch.device(args.device)
    with_triton = args.device == "cuda" and triton_head.compiles_for(device)
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
        triton_default = None
        if with_triton:
            triton_default = dllm_fast.ops.default_chunk_size(M, VOCAB, device, hidden.element_size())
            runs.update(triton_runs(hidden, weight, targets, upstream, lse, buffer,
                                    sorted({default, triton_default, 32768})))
        for run in runs.values():
            run()  # warm-up
        timings = time_interleaved(runs, device, repeats=args.repeats)
        gemm = 2 * M * d * VOCAB
        flops = {"torch.mm": gemm, "torch.mm_block": 2 * M * d * MM_BLOCK, "grad": 3 * gemm, "forward": gemm,
                 "backward": 3 * gemm, "grad_tf32": 3 * gemm, **{op: n * gemm for op, n in TRITON_GEMMS.items()}}
        mm_rate = gemm / timings[("torch.mm", 0)].min_s
        block_rate = flops["torch.mm_block"] / timings[("torch.mm_block", MM_BLOCK)].min_s
        for (op, chunk), timing in timings.items():
            rate = flops[op] / timing.min_s
            same = timings.get(("torch.mm_chunks", chunk))
            rows.append(dict(M=M, d=d, V=VOCAB, op=op, chunk=chunk or None,
                             default=op not in ("torch.mm", "torch.mm_block", "mm3") and chunk in (
                                 triton_default if op.startswith("triton") else default,),
                             ms=timing.min_s * 1e3, median_ms=timing.median_s * 1e3, gflops=rate / 1e9,
                             vs_mm=rate / mm_rate, vs_mm_block=rate / block_rate,
                             vs_mm_same=rate / (gemm / same.min_s) if same is not None else None, status="ok"))
        if with_triton and args.triton_sweep:
            rows += triton_sweep(hidden, weight, targets, upstream, lse, triton_default, args.repeats)
        del buffer
    print_table(rows, ["M", "op", "chunk", "default", "ms", "gflops", "vs_mm", "vs_mm_same", "vs_mm_block"])
    config = dict(sizes=sizes, d=d, V=VOCAB, dtype=f"torch.{dtype}", repeats=args.repeats, chunks=args.chunks,
                  threads=torch.get_num_threads(), triton=with_triton,
                  triton_tiles=triton_head.default_config(device).label() if with_triton else None)
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
    parser.add_argument("--triton-sweep", action="store_true",
                        help="--roofline on CUDA: time the Triton kernel for every sm_90 tile configuration too")
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
    on_gpu = args.device == "cuda"
    providers = [PROVIDERS[name] for name in ("naive", "dllm_fast", "dllm_fast_tf32", "dllm_fast_triton")
                 if name in ("naive", "dllm_fast") or (on_gpu and (name != "dllm_fast_triton"
                                                                   or triton_head.compiles_for(torch.device("cuda"))))]
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
