"""GPU checks of dllm_fast: CUDA against CPU on the same weights, compiled against eager on CUDA.

    python3 benchmarks/gpu_smoke.py OUT_DIR          # from the project root, on a machine with a GPU

Checks (each prints one JSON line, appended to OUT_DIR/smoke.jsonl, and never stops the others): the build; the
ops (masked_logprobs in fp32 and bf16 against fp64, sample_tokens at T = 0 and T = 1, the Gumbel-max law);
generate in every cache mode, CUDA against CPU and against the reference sampler; the engine's streaming
gradient, CUDA against CPU and against naive autograd; compiled (CUDA graphs) against eager generate. TF32 off.
DRY=1 runs it on the CPU (a check of the script itself). benchmarks/gpu_run.sh runs it.
"""
import json
import os
import sys
import time
import traceback

import torch

OUT = sys.argv[1] if len(sys.argv) > 1 else "."
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
lines = open(f"{OUT}/smoke.jsonl", "a")


def record(name, **kw):
    kw["check"] = name
    print(json.dumps(kw), flush=True)
    lines.write(json.dumps(kw) + "\n"); lines.flush()


def check(fn):
    t = time.perf_counter()
    try:
        fn()
    except Exception as e:  # noqa
        record(fn.__name__, status="error", error=f"{type(e).__name__}: {e}"[:2000],
               trace=traceback.format_exc()[-3000:], seconds=time.perf_counter() - t)


import dllm_fast  # noqa: E402
from dllm_fast.models import LLaDAConfig, LLaDAModel  # noqa: E402

cpu, gpu = torch.device("cpu"), torch.device("cpu" if os.environ.get("DRY") else "cuda")


def sync():
    if gpu.type == "cuda":
        torch.cuda.synchronize()


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def build():
    record("build_info", info={k: str(v) for k, v in dllm_fast.build_info().items()},
           gpu=torch.cuda.get_device_name() if gpu.type == "cuda" else "none", torch=torch.__version__)


def ops():
    g = torch.Generator().manual_seed(0)
    M, d, V = 300, 256, 5000
    h = torch.randn(M, d, generator=g, dtype=torch.float64) * 0.5
    W = torch.randn(V, d, generator=g, dtype=torch.float64) * 0.1
    t = torch.randint(0, V, (M,), generator=g)
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        res = {}
        for dev in (cpu, gpu):
            hh = h.to(dev, dt).requires_grad_(); WW = W.to(dev, dt).requires_grad_()
            lp = dllm_fast.masked_logprobs(hh, WW, t.to(dev))
            (lp * torch.linspace(-1, 1, M, device=dev)).sum().backward()
            res[dev.type] = (lp.detach(), hh.grad, WW.grad)
        hr = h.clone().requires_grad_(); Wr = W.clone().requires_grad_()
        lpr = torch.log_softmax(hr @ Wr.T, -1).gather(1, t[:, None])[:, 0]
        (lpr * torch.linspace(-1, 1, M, dtype=torch.float64)).sum().backward()
        out[str(dt)] = dict(lp_cuda_vs_fp64=rel(res["cuda"][0], lpr.detach()), lp_cpu_vs_fp64=rel(res["cpu"][0], lpr.detach()),
                            gh_cuda_vs_fp64=rel(res["cuda"][1], hr.grad), gW_cuda_vs_fp64=rel(res["cuda"][2], Wr.grad),
                            gW_cpu_vs_fp64=rel(res["cpu"][2], Wr.grad))
    # sampling at T=0 equals argmax on the GPU
    hs = h[:64].float().to(gpu); Ws = W.float().to(gpu)
    tok, conf = dllm_fast.sample_tokens(hs, Ws, temperature=0.0, seed=1, offset=0)
    ref = (hs @ Ws.T).argmax(-1)
    out["sample_T0_argmax_agree"] = (tok == ref).double().mean().item()
    tok1, _ = dllm_fast.sample_tokens(hs, Ws, temperature=1.0, seed=1, offset=0)
    tok2, _ = dllm_fast.sample_tokens(hs, Ws, temperature=1.0, seed=1, offset=0)
    out["sample_T1_deterministic"] = bool(torch.equal(tok1, tok2))
    # Gumbel-max law on a small vocabulary: empirical frequencies vs softmax
    logits_W = torch.randn(8, 16, generator=g).to(gpu)
    hidden = torch.eye(16, device=gpu)[:1].repeat(20000, 1)
    toks, _ = dllm_fast.sample_tokens(hidden, logits_W, temperature=1.0, seed=7, offset=0)
    freq = torch.bincount(toks, minlength=8).double() / toks.numel()
    p = torch.softmax(logits_W[:, 0].double(), 0)
    out["gumbel_tv_distance"] = 0.5 * (freq.cpu() - p.cpu()).abs().sum().item()
    record("ops", status="ok", **out)


def model_pair(preset="tiny", seed=0):
    m_cpu = LLaDAModel.with_random_weights(LLaDAConfig.preset(preset), device="cpu", dtype=torch.float32, seed=seed).eval()
    import copy
    m_gpu = copy.deepcopy(m_cpu).to(gpu)
    return m_cpu, m_gpu


def generate_cross_device():
    m_cpu, m_gpu = model_pair("small")
    V = m_cpu.config.mask_token_id
    prompts = torch.randint(0, V, (4, 32), generator=torch.Generator().manual_seed(3))
    out = {}
    kw = dict(gen_length=64, block_length=32, steps=32, temperature=0.0)
    for cache in ("none", "prefix", "dual"):
        a = dllm_fast.generate(m_cpu, prompts, **kw, cache=cache).completion_ids
        b = dllm_fast.generate(m_gpu, prompts.to(gpu), **kw, cache=cache).completion_ids.cpu()
        out[f"{cache}_cpu_vs_cuda_agree"] = (a == b).double().mean().item()
    from dllm_fast import reference  # a submodule the package does not import by itself

    r = reference.generate(m_gpu, prompts.to(gpu), **kw).completion_ids.cpu()
    b = dllm_fast.generate(m_gpu, prompts.to(gpu), **kw, cache="none").completion_ids.cpu()
    out["none_vs_reference_cuda_agree"] = (r == b).double().mean().item()
    t = dllm_fast.generate(m_gpu, prompts.to(gpu), gen_length=64, block_length=32, steps=None, threshold=0.9, temperature=0.0, cache="dual")
    out["threshold_nfe"] = int(t.nfe)
    record("generate_cross_device", status="ok", **out)


def generate_compiled():
    _, m = model_pair("small")
    V = m.config.mask_token_id
    out = {}
    for B in (8,):
        prompts = torch.randint(0, V, (B, 64), generator=torch.Generator().manual_seed(4)).to(gpu)
        kw = dict(gen_length=128, block_length=32, steps=64, temperature=0.0)
        for cache in ("dual", "none"):
            e = dllm_fast.generate(m, prompts, **kw, cache=cache)  # warm-up
            sync(); t0 = time.perf_counter()
            e = dllm_fast.generate(m, prompts, **kw, cache=cache); sync()
            eager_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            c = dllm_fast.generate(m, prompts, **kw, cache=cache, compile=True); sync()
            first_s = time.perf_counter() - t0
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                c = dllm_fast.generate(m, prompts, **kw, cache=cache, compile=True); sync()
                times.append(time.perf_counter() - t0)
            out[f"{cache}_B{B}"] = dict(eager_s=eager_s, compiled_first_s=first_s, compiled_s=min(times),
                                       speedup=eager_s / min(times),
                                       tokens_equal=bool(torch.equal(e.completion_ids, c.completion_ids)))
            record("generate_compiled_partial", **{f"{cache}_B{B}": out[f"{cache}_B{B}"]})
    record("generate_compiled", status="ok", **out)


def engine_cross_device():
    from dllm_fast.likelihood import sample_masks, score, elbo, streaming_backward
    m_cpu, m_gpu = model_pair("small", seed=1)
    m_cpu.train(); m_gpu.train()
    V = m_cpu.config.mask_token_id
    N, P, L = 4, 16, 48
    seq = torch.randint(0, V, (N, P + L), generator=torch.Generator().manual_seed(5))
    adv = torch.tensor([1.0, -0.5, 0.25, -0.75])
    grads = {}
    for m, dev in ((m_cpu, cpu), (m_gpu, gpu)):
        s = seq.to(dev)
        masks = sample_masks(s, prompt_length=P, n_t=8, sampler="stratified_l", generator=torch.Generator().manual_seed(0),
                             eos_token_id=m.eos_token_id, count="eos")
        with torch.no_grad():
            lp_old = score(m, s, masks, micro_batch=8)
        a = adv.to(dev)

        def objective(lp):
            return -(torch.exp(elbo(lp, masks) - elbo(lp_old, masks)) * a).mean()
        m.zero_grad(set_to_none=True)
        streaming_backward(m, s, masks, objective, micro_batch=4)
        grads[dev.type] = torch.cat([p.grad.flatten().double().cpu() for p in m.parameters() if p.grad is not None])
        if dev.type == "cuda":
            # naive autograd on the same GPU
            m.zero_grad(set_to_none=True)
            lp = score(m, s, masks, micro_batch=32)
            objective(lp).backward()
            naive = torch.cat([p.grad.flatten().double().cpu() for p in m.parameters() if p.grad is not None])
    record("engine_cross_device", status="ok", grad_cuda_vs_cpu=rel(grads["cuda"], grads["cpu"]),
           grad_cuda_stream_vs_naive=rel(grads["cuda"], naive), grad_norm=grads["cpu"].norm().item())


for fn in (build, ops, generate_cross_device, engine_cross_device, generate_compiled):
    check(fn)
