"""One update's gradient for each objective: time and memory against n_t, streaming vs keeping every graph.

    python benchmarks/bench_objectives.py                         # CPU: `small` preset, N = 8, P = 64, L = 128
    python benchmarks/bench_objectives.py --device cuda --lora    # GPU: llada-8b shapes, random bf16 weights, LoRA

N sequences (groups of 4, random tokens, rewards 0/1, two rows ending early with EOS padding), each objective
with its own sampler at its default n_t and at --nt. The measured operation is the objective's gradient at the
first inner update of a step: the old policy is the current one (lp_old scored beforehand, untimed), the reference
a perturbed copy (lp_ref scored beforehand). Providers, side by side at an equal micro-batch of (sequence, sample)
pairs:

    all_graphs    objective.loss(score(model, ..., micro_batch)) then backward: every micro-batch's graph kept
                  alive until the end (what a trainer without the engine does);
    streaming     objective.backward(...): the likelihood engine, pass 1 without graph, pass 2 one micro-batch's
                  graph at a time (separable objectives: one pass);
    streaming_lp  objective.backward(..., lp=lp_old): the current lp is known at the first inner update, so pass 1
                  is skipped (separable objectives have no pass 1: same as streaming).

Memory: `saved` is the peak of the bytes autograd keeps for backward alive at once (parameters excluded); `peak`
is the resident peak of a fresh process above its post-warm-up baseline (gradients freed, as by the trainer's
zero_grad, so the peak includes the gradients) on CPU (MALLOC_MMAP_THRESHOLD_=64 KiB, so
freed activations leave the heap), torch.cuda.max_memory_allocated on CUDA. Ratios: time per sample against
all_graphs at the same n_t, and memory against the same provider at the smallest n_t.
"""

from __future__ import annotations

import argparse
import copy
import functools
import sys
from pathlib import Path

import torch

from dllm_fast import objectives
from dllm_fast.contracts import RolloutBatch, completion_mask
from dllm_fast.likelihood import score
from dllm_fast.objectives import InnerUpdate
from dllm_fast.models import LLaDAConfig, LLaDAModel

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from common import (  # noqa: E402
    Provider, add_ratio, add_results_dir_argument, print_table, run_sweep, time_call, training_memory, write_results,
)

GROUP = 4
LORA_TARGETS = r".*blocks\.\d+\.(q_proj|k_proj|v_proj|up_proj)$"  # what d1/SPG's LoRA effectively adapts


class Case:
    """The model, the rollouts, the objective's masks and the old/reference lp for one point."""

    def __init__(self, point: dict):
        self.device = torch.device(point["device"])
        dtype = getattr(torch, point["dtype"])
        config = LLaDAConfig.preset(point["preset"])
        self.model = LLaDAModel.with_random_weights(config, dtype=dtype, device=self.device, seed=point["seed"])
        reference = None
        self.objective = objectives.get(point["objective"], n_t=point["n_t"])
        if self.objective.needs_reference:
            reference = perturbed(self.model, seed=point["seed"] + 7)
        if point["lora"]:
            import peft

            lora = peft.LoraConfig(r=point["lora_rank"], lora_alpha=point["lora_rank"] // 2, lora_dropout=0.0,
                                   target_modules=LORA_TARGETS, init_lora_weights=False)
            self.model = peft.get_peft_model(self.model, lora)
        self.batch = rollouts(config, point, self.device)
        self.masks = self.objective.draw_masks(self.batch, generator=torch.Generator().manual_seed(point["seed"]),
                                               eos_token_id=config.eos_token_id)
        self.micro_batch = point["micro_batch"]
        scoring = dict(micro_batch=self.micro_batch, attention_mask=self.batch.attention_mask)
        with torch.no_grad():
            self.lp_old = score(self.model, self.batch.sequences, self.masks, **scoring)
            self.lp_ref = None if reference is None else score(reference, self.batch.sequences, self.masks,
                                                               **scoring)
        self.inputs = self.objective.prepare(self.batch, self.masks, lp_old=self.lp_old, lp_ref=self.lp_ref)

    def parameters(self):
        return list(self.model.parameters())


def perturbed(model, seed: int, scale: float = 0.02):
    other = copy.deepcopy(model)
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * p.float().std() * torch.randn(p.shape, generator=generator, device=p.device).to(p.dtype))
    return other.requires_grad_(False)


def rollouts(config: LLaDAConfig, point: dict, device: torch.device) -> RolloutBatch:
    generator = torch.Generator().manual_seed(point["seed"] + 1)
    N, P, L = point["sequences"], point["prompt"], point["completion"]
    sequences = torch.randint(0, config.mask_token_id, (N, P + L), generator=generator)
    sequences[0, P + L // 2:] = config.eos_token_id  # two answers that end early: EOS padding
    sequences[N // 2, P + L // 4:] = config.eos_token_id
    rewards = (torch.rand(N, generator=generator) > 0.5).float()
    rewards[::GROUP] = 1.0 - rewards[1::GROUP]  # no group without a learning signal
    sequences = sequences.to(device)
    return RolloutBatch(sequences, None, P, completion_mask(sequences[:, P:], config.eos_token_id),
                        rewards.to(device), GROUP)


def setup(point: dict) -> Case:
    return Case(point)


def run_all_graphs(case: Case) -> None:
    case.model.zero_grad(set_to_none=True)  # as the trainer does before each update
    lp = score(case.model, case.batch.sequences, case.masks, micro_batch=case.micro_batch,
               attention_mask=case.batch.attention_mask)
    case.objective.loss(lp, case.inputs).backward()


def run_streaming(case: Case, known_lp: bool) -> None:
    # Into existing gradients the engine would keep them aside for its all-or-nothing guarantee (one more buffer).
    case.model.zero_grad(set_to_none=True)
    update = InnerUpdate(case.masks, lp_old=case.lp_old, lp=case.lp_old if known_lp else None)
    case.objective.backward(case.model, case.batch, update, lp_ref=case.lp_ref, micro_batch=case.micro_batch)


def warm_up(run, case: Case) -> None:
    """One run, then the gradients freed: the memory baseline holds the model, not its gradients, so every
    provider's peak counts the gradients it allocates (the same for all) plus what it keeps for backward."""
    run(case)
    case.model.zero_grad(set_to_none=True)


def provider(name: str, run) -> Provider:
    return Provider(name, setup, run, warm_up=functools.partial(warm_up, run))


PROVIDERS = {p.name: p for p in [
    provider("all_graphs", run_all_graphs),
    provider("streaming", functools.partial(run_streaming, known_lp=False)),
    provider("streaming_lp", functools.partial(run_streaming, known_lp=True)),
]}


def measure(args, provider: Provider, point: dict) -> dict:
    case = provider.prepare(point)
    timing = time_call(lambda: provider.run(case), point["device"], warmup=0, repeats=args.repeats)
    row = dict(seconds=timing.median_s, ms_per_sample=1e3 * timing.median_s / point["n_t"],
               pairs=int((case.masks.num_masked > 0).sum()))
    return row | training_memory(provider, point, case, exclude=case.parameters(), resident_peak=not args.no_rss,
                                 default_malloc=args.default_malloc)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--objectives", nargs="+", default=list(objectives.available()),
                        choices=objectives.available())
    parser.add_argument("--nt", type=int, nargs="+", default=[1, 8, 32],
                        help="MC samples per sequence, besides each objective's default (odd values are rounded up "
                             "to even for complementary masks)")
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS))
    parser.add_argument("--all-graphs-max-nt", type=int, default=None,
                        help="skip all_graphs above this n_t (default: none on CUDA, where OOM is caught; 32 on CPU)")
    parser.add_argument("--preset", help="model preset (default: small on CPU, llada-8b on CUDA)")
    parser.add_argument("--sequences", type=int, default=8, help="N rollouts, in groups of 4")
    parser.add_argument("--prompt", type=int, help="P (default: 64 on CPU, 200 on CUDA)")
    parser.add_argument("--completion", type=int, help="L (default: 128 on CPU, 256 on CUDA)")
    parser.add_argument("--micro-batch", type=int, default=8, help="(sequence, sample) pairs per graph")
    parser.add_argument("--lora", action="store_true", help="LoRA (q, k, v, up) instead of a full fine-tune")
    parser.add_argument("--lora-rank", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--no-rss", action="store_true", help="CPU: skip the fresh-process resident-peak runs")
    parser.add_argument("--default-malloc", action="store_true", help="CPU: glibc's dynamic mmap threshold")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", help="results file name (default: objectives_<device>[_lora])")
    add_results_dir_argument(parser)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if args.threads:
        torch.set_num_threads(args.threads)
    preset = args.preset or ("llada-8b" if cuda else "small")
    prompt = args.prompt if args.prompt is not None else (200 if cuda else 64)
    completion = args.completion or (256 if cuda else 128)
    dtype = "bfloat16" if cuda else "float32"
    points = []
    for name in args.objectives:
        default = objectives.get(name).config
        for n_t in sorted(set(args.nt) | {default.n_t}):
            n_t += n_t % 2 if default.sampler == "complementary" else 0
            point = dict(device=args.device, preset=preset, dtype=dtype, objective=name, n_t=n_t,
                         default_nt=n_t == default.n_t, sequences=args.sequences, prompt=prompt,
                         completion=completion, micro_batch=args.micro_batch, lora=args.lora,
                         lora_rank=args.lora_rank, seed=args.seed)
            if point not in points:
                points.append(point)
    limit = args.all_graphs_max_nt if args.all_graphs_max_nt is not None else (None if cuda else 32)

    def skip(provider, point):
        if provider.name == "all_graphs" and limit is not None and point["n_t"] > limit:
            return f"skipped: n_t > --all-graphs-max-nt {limit}"
        return None

    rows = run_sweep(points, [PROVIDERS[p] for p in args.providers], functools.partial(measure, args),
                     row_keys=("objective", "n_t", "default_nt"), skip=skip)
    add_ratio(rows, "time_vs_all_graphs", "ms_per_sample", baseline={"provider": "all_graphs"},
              match=("objective", "n_t"))
    for name in args.objectives:
        smallest = min(r["n_t"] for r in rows if r["objective"] == name)
        for metric in ("saved_mib", "peak_mib"):
            add_ratio([r for r in rows if r["objective"] == name], f"{metric.split('_')[0]}_vs_smallest_nt", metric,
                      baseline={"n_t": smallest}, match=("provider",))
    columns = ["objective", "n_t", "provider", "status", "ms_per_sample", "time_vs_all_graphs", "saved_mib",
               "saved_vs_smallest_nt", "peak_mib", "peak_vs_smallest_nt"]
    print_table(rows, columns)
    name = args.name or "objectives_" + args.device + ("_lora" if args.lora else "")
    config = {k: v for k, v in vars(args).items() if k not in ("name", "results_dir")} | dict(
        preset=preset, prompt=prompt, completion=completion, dtype=dtype, group_size=GROUP)
    print(f"wrote {write_results(name, config, rows, args.results_dir)}")


if __name__ == "__main__":
    main()
