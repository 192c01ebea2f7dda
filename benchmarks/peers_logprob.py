"""Anchor benchmark: per-token log-probs through the LM head, forward + backward with a per-token upstream
gradient, bf16, d = 4096, V = 126464, on one GPU, against the Triton peers. Providers side by side in one process,
timed in turns (median of 5), with peak memory and the error against an fp32 oracle on 512 rows:

  naive          log_softmax((h @ W.T).float()).gather  (the [M, V] logits live through backward)
  dllm_fast      dllm_fast.masked_logprobs(backend="compiled"): the C++/CUDA kernels (forward, then backward
                 recomputing chunks)
  dllm_grad      dllm_fast.ops.masked_logprobs_grad (upstream gradient known first), compiled: its logsumexp pass,
                 then one walk of 3 GEMMs per chunk
  dllm_grad_lse  the same with the rows' logsumexp known, as the engine's pass 2 calls it (3 GEMMs per chunk)
  dllm_grad_lse_frozen  the same without the weight's gradient (a frozen head, LoRA: 2 GEMMs per chunk)
  triton, triton_grad, triton_grad_lse, triton_grad_lse_frozen   the four above on backend="triton" (issue 38:
                 the logits GEMM in a Triton kernel with the softmax in its epilogue, cuBLAS for the gradient
                 GEMMs; what auto takes on CUDA for bf16), when triton compiles for the GPU
  cce            cut_cross_entropy.linear_cross_entropy(reduction="none", impl="cce")  (Apple, Triton)
  cce_exact      the same, impl="cce_kahan_full_c_full_e" (no gradient skipping)
  liger          liger_kernel fused linear cross entropy (reduction="none")             (LinkedIn, Triton)

    python3 benchmarks/peers_logprob.py OUT_JSON [M ...]     # default M: 2048 8192

The peers' wheels are not part of the project: benchmarks/gpu_run.sh installs them from a folder beside it; a
peer that does not import is left out. On a machine without a GPU it runs the dllm_fast providers at d = 256,
V = 8192 in fp32 (a check of the script itself).
"""
import json
import sys
import time

import torch

OUT = sys.argv[1]
MS = [int(x) for x in sys.argv[2:]] or [2048, 8192]
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
d, V, dt = 4096, 126464, torch.bfloat16
if dev.type == "cpu":
    d, V, dt = 256, 8192, torch.float32
rows = []
KNOWN = {}  # the rows' logsumexp at the current M, for dllm_grad_lse (scored before the timed calls)


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


def peak_reset():
    if dev.type == "cuda":
        torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return 0


def peak(base):
    return (torch.cuda.max_memory_allocated() - base) / 2**20 if dev.type == "cuda" else float("nan")


def providers():
    import dllm_fast
    from dllm_fast.ops import masked_logprobs_grad, triton_head
    p = {}
    backends = ["compiled"] + (["triton"] if triton_head.compiles_for(dev) else [])

    def naive(h, W, t, g):
        h = h.detach().requires_grad_(); W = W.detach().requires_grad_()
        lp = torch.log_softmax((h @ W.T).float(), -1).gather(1, t[:, None])[:, 0]
        lp.backward(g)
        return lp.detach(), h.grad, W.grad
    p["naive"] = naive

    for backend in backends:
        name = {"compiled": "dllm", "triton": "triton"}[backend]

        def fused(h, W, t, g, backend=backend):
            h = h.detach().requires_grad_(); W = W.detach().requires_grad_()
            lp = dllm_fast.masked_logprobs(h, W, t, backend=backend)
            lp.backward(g)
            return lp.detach(), h.grad, W.grad
        p["dllm_fast" if backend == "compiled" else "triton"] = fused

        def known(h, W, t, g, backend=backend):
            gw = torch.zeros_like(W)
            lp, gh = masked_logprobs_grad(h, W, t, g, grad_weight=gw, backend=backend)
            return lp, gh, gw
        p[f"{name}_grad"] = known

        def known_lse(h, W, t, g, backend=backend):
            gw = torch.zeros_like(W)
            lp, gh = masked_logprobs_grad(h, W, t, g, lse=KNOWN["lse"], grad_weight=gw, backend=backend)
            return lp, gh, gw
        p[f"{name}_grad_lse"] = known_lse

        def known_lse_frozen(h, W, t, g, backend=backend):
            lp, gh = masked_logprobs_grad(h, W, t, g, lse=KNOWN["lse"], backend=backend)
            return lp, gh, None
        p[f"{name}_grad_lse_frozen"] = known_lse_frozen
    try:
        from cut_cross_entropy import linear_cross_entropy

        def cce(h, W, t, g):
            h = h.detach().requires_grad_(); W = W.detach().requires_grad_()
            nll = linear_cross_entropy(h, W, t, reduction="none", impl="cce")
            (-nll).backward(g)
            return -nll.detach(), h.grad, W.grad
        if dev.type == "cuda":
            p["cce"] = cce

        def cce_exact(h, W, t, g):
            h = h.detach().requires_grad_(); W = W.detach().requires_grad_()
            nll = linear_cross_entropy(h, W, t, reduction="none", impl="cce_kahan_full_c_full_e")
            (-nll).backward(g)
            return -nll.detach(), h.grad, W.grad
        if dev.type == "cuda":
            p["cce_exact"] = cce_exact
    except Exception as e:  # noqa
        print("no cce:", e)
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        def liger(h, W, t, g):
            h = h.detach().requires_grad_(); W = W.detach().requires_grad_()
            nll = liger_fused_linear_cross_entropy(h, W, t, reduction="none")
            (-nll).backward(g)
            return -nll.detach(), h.grad, W.grad
        if dev.type == "cuda":
            p["liger"] = liger
    except Exception as e:  # noqa
        print("no liger:", e)
    return p


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


P = providers()
for M in MS:
    gen = torch.Generator(dev).manual_seed(0)
    h = (torch.randn(M, d, device=dev, generator=gen) * 1.0).to(dt)
    W = (torch.randn(V, d, device=dev, generator=gen) * (2.0 / d ** 0.5)).to(dt)   # logits std ~2
    t = torch.randint(0, V, (M,), device=dev, generator=gen)
    g = torch.randn(M, device=dev, generator=gen)
    from dllm_fast.ops import default_chunk_size
    KNOWN["lse"] = torch.ops.dllm_fast.masked_logprobs(h, W, t, default_chunk_size(M, V, dev))[1]
    # fp32 oracle on a slice of rows (memory): the first 512 rows
    k = min(M, 512)
    hr = h[:k].float().requires_grad_(); Wr = W.float().requires_grad_()
    lpr = torch.log_softmax(hr @ Wr.T, -1).gather(1, t[:k, None])[:, 0]
    lpr.backward(g[:k])
    oracle = (lpr.detach(), hr.grad.detach(), None)
    del hr, Wr, lpr
    times = {n: [] for n in P}
    peaks, errs = {}, {}
    for n, f in P.items():  # warm-up + memory + error
        try:
            base = peak_reset()
            lp, gh, gw = f(h, W, t, g); sync()
            peaks[n] = peak(base)
            errs[n] = dict(lp=rel(lp[:k], oracle[0]), grad_h=rel(gh[:k], oracle[1]))
            del lp, gh, gw
        except Exception as e:  # noqa
            errs[n] = dict(error=f"{type(e).__name__}: {e}"[:300])
    live = [n for n in P if "error" not in errs[n]]
    for r in range(5):
        for n in (live if r % 2 == 0 else live[::-1]):
            sync(); t0 = time.perf_counter()
            out = P[n](h, W, t, g); sync()
            times[n].append(time.perf_counter() - t0)
            del out
    for n in P:
        ms = sorted(times[n])[len(times[n]) // 2] * 1e3 if times[n] else None
        row = dict(M=M, d=d, V=V, dtype=str(dt), provider=n, ms=ms, peak_mib=peaks.get(n), **errs[n])
        rows.append(row); print(json.dumps(row), flush=True)
    json.dump(rows, open(OUT, "w"), indent=1)
