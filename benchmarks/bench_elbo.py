"""Memory and time of the Monte Carlo ELBO objective's forward + backward against n_t, naive vs streaming.

    python benchmarks/bench_elbo.py                          # CPU: `small` preset, prompt 64 + completion 256
    python benchmarks/bench_elbo.py --device cuda            # GPU: llada-8b shapes, prompt 200 + completion 512,
    python benchmarks/bench_elbo.py --device cuda --lora     #      random bf16 weights, full fine-tune or LoRA

One sequence, n_t stratified_l masks over its completion (every position counts), on-policy objectives (the
old policy's ELBO is the current one, detached, so no extra scoring pass is needed). Providers, side by side:

    naive       dllm_fast.reference.likelihood.score_naive: all n_t pairs in one graph through the full
                [n_t, P + L, V] logits and log_softmax, then VRPO-OL's exp(ELBO - ELBO_old) * A, backward;
    all_graphs  the same graph but through the fused LM head (dllm_fast.likelihood.score, one micro-batch):
                an honest baseline for the streaming paths, which use the same scoring;
    two_pass    dllm_fast.likelihood.streaming_backward on the same objective, `--micro-batch` pairs per graph;
    separable   streaming_backward(separable=True) on BGPO's per-sample linear bound (BGPO Eq. 13).

Time is the median of --repeats runs after one warm-up per provider, reported per MC sample. Memory:
  - saved: the peak of the bytes autograd keeps for backward and that are alive at once during one full run
    (track_live_saved_tensors, parameters excluded): every graph for naive/all_graphs, one micro-batch's graph
    for the streaming paths;
  - peak: on CPU the resident peak of a fresh subprocess above its baseline (after a warm-up run on one fully
    masked sample, which allocates the gradients and the largest per-sample buffers); on CUDA
    torch.cuda.max_memory_allocated above what was allocated before the run. The CPU subprocess runs with
    MALLOC_MMAP_THRESHOLD_=64 KiB, so that freed tensors go back to the OS: with glibc's default (dynamic,
    up to 32 MiB) threshold the `small` preset's 0.6 MiB activations stay in the heap once freed and RSS counts
    allocator retention (a step of about +10-20% from the second micro-batch on) rather than live memory;
    --default-malloc measures it that way.
On CPU, naive is skipped where its logits alone would exceed --naive-max-gib; on CUDA an out-of-memory error is
caught and reported (at warm-up, or at the n_t where it happened), and larger n_t are not tried for that
provider.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from dllm_fast import reference
from dllm_fast.likelihood import elbo, sample_masks, score, streaming_backward
from dllm_fast.memory import peak_extra_rss, track_live_saved_tensors
from dllm_fast.models import LLaDAConfig, LLaDAModel

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from common import print_table, synchronize, write_results  # noqa: E402

PROVIDERS = ("naive", "all_graphs", "two_pass", "separable")
ADVANTAGE = 1.0
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "up_proj"]  # what d1/SPG's LoRA effectively adapts in LLaDA


def build_model(preset: str, device: torch.device, dtype: torch.dtype, *, lora: bool, lora_rank: int,
                checkpointing: bool, seed: int = 0):
    """Random weights at a realistic scale, allocated directly in `dtype` on `device`."""
    model = LLaDAModel.with_random_weights(LLaDAConfig.preset(preset), dtype=dtype, device=device, seed=seed)
    model.set_gradient_checkpointing(checkpointing)
    if lora:
        import peft

        config = peft.LoraConfig(r=lora_rank, lora_alpha=lora_rank // 2, target_modules=LORA_TARGETS,
                                 lora_dropout=0.0, init_lora_weights=False)
        model = peft.get_peft_model(model, config)
    return model


def vrpo_ol(masks):
    """-(exp(ELBO - ELBO_old) * A) with ELBO_old = ELBO detached (on-policy): BGPO Eq. 7."""

    def objective(lp):
        value = elbo(lp, masks)
        return -(torch.exp(value - value.detach()) * ADVANTAGE).sum()

    return objective


def bgpo_bound(masks):
    """BGPO Eq. 13 per (sequence, sample) pair: -(1 + d_j) A / n_t (A >= 0) or -exp(d_j) A / n_t (A < 0)."""

    def objective(lp_pairs, sequence_index, sample_index):
        ell = masks.weight[sequence_index, sample_index].to(lp_pairs.dtype) * lp_pairs.sum(-1)
        d = ell - ell.detach()
        g = (1 + d) * ADVANTAGE if ADVANTAGE >= 0 else torch.exp(d) * ADVANTAGE
        return -g.sum() / masks.n_t

    return objective


class Case:
    """One model, one sequence and the masks for each n_t; runs a provider's forward + backward."""

    def __init__(self, *, preset, prompt, completion, device, dtype, lora, lora_rank, checkpointing, micro_batch,
                 score_micro_batch=None, seed=0):
        self.device = torch.device(device)
        self.model = build_model(preset, self.device, dtype, lora=lora, lora_rank=lora_rank,
                                 checkpointing=checkpointing, seed=seed)
        self.micro_batch, self.score_micro_batch = micro_batch, score_micro_batch
        self.prompt = prompt
        config = LLaDAConfig.preset(preset)
        gen = torch.Generator(device=self.device).manual_seed(seed + 1)
        self.sequences = torch.randint(0, config.mask_token_id, (1, prompt + completion), generator=gen,
                                       device=self.device)
        self._masks = {}

    def masks(self, n_t: int):
        if n_t not in self._masks:
            self._masks[n_t] = sample_masks(self.sequences, prompt_length=self.prompt, n_t=n_t,
                                            sampler="stratified_l", count="all",
                                            generator=torch.Generator(device=self.device).manual_seed(n_t))
        return self._masks[n_t]

    def parameters(self):
        return [p for p in self.model.parameters()]

    def warm_up(self, provider: str) -> None:
        """One run on a single fully masked sample: allocates the gradients and the largest per-sample buffers
        (the most rows through the LM head), so a later peak measures transient memory, not first touches."""
        full = sample_masks(self.sequences, prompt_length=self.prompt, n_t=1, sampler="mean_field", count="all",
                            perturb_prob=0.0, generator=torch.Generator(device=self.device).manual_seed(0))
        self.run(provider, 1, masks=full)

    def run(self, provider: str, n_t: int, masks=None) -> None:
        self.model.zero_grad(set_to_none=False)  # gradients stay allocated: they are part of the baseline
        masks = masks if masks is not None else self.masks(n_t)
        if provider == "naive":
            vrpo_ol(masks)(reference.likelihood.score_naive(self.model, self.sequences, masks)).backward()
        elif provider == "all_graphs":
            lp = score(self.model, self.sequences, masks, micro_batch=masks.n_t)
            vrpo_ol(masks)(lp).backward()
        elif provider == "two_pass":
            streaming_backward(self.model, self.sequences, masks, vrpo_ol(masks), micro_batch=self.micro_batch,
                               score_micro_batch=self.score_micro_batch)
        elif provider == "separable":
            streaming_backward(self.model, self.sequences, masks, bgpo_bound(masks), micro_batch=self.micro_batch,
                               separable=True)
        else:
            raise ValueError(f"provider={provider!r} is not one of {PROVIDERS}.")

    def saved_bytes(self, provider: str, n_t: int) -> int:
        """Peak bytes saved for backward and alive at once during one full run (parameters excluded)."""
        with track_live_saved_tensors(exclude=self.parameters()) as saved:
            self.run(provider, n_t)
        return saved.peak


def naive_logits_bytes(n_t: int, length: int, vocab: int) -> int:
    """Logits, their fp32 log_softmax and its gradient: what the naive path allocates beyond the model."""
    return 3 * n_t * length * vocab * 4


def cpu_peak_extra(args, provider: str, n_t: int) -> int:
    setup = f"""
import sys
sys.path.insert(0, {str(BENCH_DIR)!r})
import bench_elbo as b
case = b.Case(preset={args.preset!r}, prompt={args.prompt}, completion={args.completion}, device="cpu",
              dtype=torch.float32, lora={args.lora}, lora_rank={args.lora_rank},
              checkpointing={args.checkpointing}, micro_batch={args.micro_batch},
              score_micro_batch={args.score_micro_batch})
case.masks({n_t})
case.warm_up({provider!r})  # threads, allocator, the gradients and the largest per-sample buffers
"""
    saved_environment = os.environ.copy()
    if not args.default_malloc:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 << 10)
    try:
        return peak_extra_rss(setup, f"case.run({provider!r}, {n_t})", threads=torch.get_num_threads())
    finally:
        os.environ.clear()
        os.environ.update(saved_environment)


def measure(case: Case, args, provider: str, n_t: int) -> dict:
    device = case.device
    masks = case.masks(n_t)
    row = dict(n_t=n_t, provider=provider, pairs_scored=int((masks.num_masked > 0).sum()))
    samples = []
    for _ in range(args.repeats):
        synchronize(device)
        start = time.perf_counter()
        case.run(provider, n_t)
        synchronize(device)
        samples.append(time.perf_counter() - start)
    seconds = statistics.median(samples)
    row.update(seconds=seconds, ms_per_sample=1e3 * seconds / n_t)
    row["saved_mib"] = case.saved_bytes(provider, n_t) / 2**20
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        case.run(provider, n_t)
        torch.cuda.synchronize(device)
        row["peak_mib"] = (torch.cuda.max_memory_allocated(device) - before) / 2**20
    elif not args.no_rss:
        row["peak_mib"] = cpu_peak_extra(args, provider, n_t) / 2**20
    return row


def free_memory(case: Case) -> None:
    gc.collect()
    if case.device.type == "cuda":
        torch.cuda.empty_cache()


def sweep(case: Case, args) -> list[dict]:
    vocab = case.model.lm_head_weight.shape[0]
    length = case.sequences.shape[1]
    rows, failed = [], {}  # provider -> why it no longer runs
    for provider in args.providers:  # one warm-up per provider (threads, allocator, gradients)
        try:
            case.warm_up(provider)
        except torch.cuda.OutOfMemoryError:
            failed[provider] = "oom at warm-up (one fully masked sample)"
        free_memory(case)
    for n_t in args.nt:
        for provider in args.providers:
            if provider in failed:
                rows.append(dict(n_t=n_t, provider=provider, status=failed[provider]))
                continue
            if provider == "naive" and case.device.type == "cpu":
                need = naive_logits_bytes(n_t, length, vocab)
                if need > args.naive_max_gib * 2**30:
                    rows.append(dict(n_t=n_t, provider=provider,
                                     status=f"skipped: logits need {need / 2**30:.1f} GiB > --naive-max-gib"))
                    continue
            try:
                row = measure(case, args, provider, n_t)
                row["status"] = "ok"
            except torch.cuda.OutOfMemoryError:
                failed[provider] = f"oom at n_t={n_t}"
                row = dict(n_t=n_t, provider=provider, status="oom")
            free_memory(case)
            rows.append(row)
            print(_progress(row), flush=True)
    add_ratios(rows)
    return rows


def add_ratios(rows: list[dict]) -> None:
    """Time per sample against naive and all_graphs at the same n_t; peak and saved against n_t = 1."""
    by_key = {(r["n_t"], r["provider"]): r for r in rows if r.get("status") == "ok"}
    first = min(r["n_t"] for r in rows)
    for (n_t, provider), row in by_key.items():
        for baseline in ("naive", "all_graphs"):
            other = by_key.get((n_t, baseline))
            if other:
                row[f"time_vs_{baseline}"] = row["ms_per_sample"] / other["ms_per_sample"]
        start = by_key.get((first, provider))
        if start:
            for field in ("peak_mib", "saved_mib"):
                if field in row and start.get(field):
                    row[f"{field.split('_')[0]}_vs_nt{first}"] = row[field] / start[field]


def _progress(row: dict) -> str:
    return "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--nt", type=int, nargs="+", help="MC samples per sequence (default: by device)")
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    parser.add_argument("--preset", help="model preset (default: small on CPU, llada-8b on CUDA)")
    parser.add_argument("--prompt", type=int, help="prompt length (default: 64 on CPU, 200 on CUDA)")
    parser.add_argument("--completion", type=int, help="completion length (default: 256 on CPU, 512 on CUDA)")
    parser.add_argument("--micro-batch", type=int, default=1, help="(sequence, sample) pairs per streamed graph")
    parser.add_argument("--score-micro-batch", type=int, help="pairs per no-grad call in pass 1 (default: "
                        "--micro-batch)")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (q,k,v,up) instead of all weights")
    parser.add_argument("--lora-rank", type=int, default=128)
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing in every block")
    parser.add_argument("--repeats", type=int, help="timed runs per point (default: 1 on CPU, 3 on CUDA)")
    parser.add_argument("--naive-max-gib", type=float, default=6.0,
                        help="CPU: skip naive where its logits would need more than this")
    parser.add_argument("--no-rss", action="store_true", help="CPU: skip the peak-RSS subprocess runs")
    parser.add_argument("--default-malloc", action="store_true",
                        help="CPU: measure RSS with glibc's dynamic mmap threshold (counts allocator retention)")
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's default)")
    parser.add_argument("--name", help="results file name (default: elbo_<device>[_lora][_ckpt])")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if args.threads:
        torch.set_num_threads(args.threads)
    args.nt = args.nt or ([1, 2, 4, 8, 16, 32, 64, 128, 256] if cuda else [1, 2, 4, 8, 16, 32, 64])
    args.preset = args.preset or ("llada-8b" if cuda else "small")
    args.prompt = args.prompt if args.prompt is not None else (200 if cuda else 64)
    args.completion = args.completion or (512 if cuda else 256)
    args.repeats = args.repeats or (3 if cuda else 1)
    dtype = torch.bfloat16 if cuda else torch.float32

    case = Case(preset=args.preset, prompt=args.prompt, completion=args.completion, device=args.device,
                dtype=dtype, lora=args.lora, lora_rank=args.lora_rank, checkpointing=args.checkpointing,
                micro_batch=args.micro_batch, score_micro_batch=args.score_micro_batch)
    rows = sweep(case, args)
    columns = ["n_t", "provider", "status", "ms_per_sample", "time_vs_naive", "time_vs_all_graphs", "saved_mib",
               "saved_vs_nt1", "peak_mib", "peak_vs_nt1"]
    print_table(rows, columns)
    name = args.name or "elbo_" + args.device + ("_lora" if args.lora else "") + ("_ckpt" if args.checkpointing else "")
    config = {k: v for k, v in vars(args).items() if k != "name"} | dict(dtype=str(dtype), sequences=1,
                                                                          sampler="stratified_l")
    print(f"wrote {write_results(name, config, rows)}")


if __name__ == "__main__":
    main()
