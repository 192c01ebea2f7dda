"""One update's gradient for each objective: time and memory against n_t, streaming vs the official loss code's way.

    python benchmarks/bench_objectives.py                         # CPU: `small` preset, N = 8, P = 64, L = 128
    python benchmarks/bench_objectives.py --device cuda --lora    # GPU: llada-8b shapes, random bf16 weights, LoRA
    python benchmarks/bench_objectives.py --objectives espo spg --sequences 4 --prompt 32 --completion 64 \
        --nt 4 16 --providers full_logits streaming --threads 1 --no-rss      # issue 23: streaming vs full logits

N sequences (groups of 4, random tokens, rewards 0/1, two rows ending early with EOS padding), each objective
with its own sampler at its default n_t and at --nt (default 1, 2 and 32, each rounded up to the nearest n_t the
objective accepts; from n_t = 2 on, the default micro-batch of 8 pairs is below N * n_t, so gradients
accumulate over micro-batches). The measured operation is one objective update's gradient,
the reference policy a perturbed copy (lp_ref scored beforehand), at one of two inner updates (--updates):

    first   the first inner update of a step: on-policy (old = current), and the current lp is known (the
            engine gets it as lp=, InnerUpdate(masks, lp=...)), so the engine skips its scoring pass;
    later   a later inner update: the old policy is another perturbed copy (lp_old scored beforehand, untimed)
            and the current lp is not known: the engine scores it in its first pass.

Providers, side by side at an equal micro-batch of (sequence, sample) pairs:

    full_logits   what the official trainers (d1, SPG, ESPO) compute: per Monte Carlo sample, the full
                  [N, P + L, V] logits of the N noisy sequences, log_softmax in fp32 and gather, every sample's
                  graph kept, then the objective's loss and one backward;
    all_graphs    objective.loss(score(model, ..., micro_batch)) then backward: the fused LM head on the scored
                  positions only, every micro-batch's graph kept alive until the end;
    streaming     objective.backward(...): the likelihood engine (pass 1 without graph unless lp is known, pass 2
                  one micro-batch's graph at a time with the LM head's gradient computed in its forward;
                  separable objectives: one pass);
    streaming@before  with --before TREE: streaming with dllm_fast imported from another checkout built in place
                  (e.g. the commit before a change: `git archive 5649a7b | tar -x -C /tmp/engine_before`, then
                  `python setup.py build_ext --inplace` there), timed and measured in a fresh process.

Time: the providers of a point are timed in turns (--repeats rounds after one warm-up each), so that a shared
machine's load weighs on all alike; ms per sample is the update's time / n_t. Memory: `saved` is the peak of the
bytes autograd keeps for backward alive at once (parameters excluded); `peak` is the resident peak of a fresh
process above its post-warm-up baseline (gradients None, as the trainer's zero_grad leaves them, so the peak
includes the gradients) on CPU (MALLOC_MMAP_THRESHOLD_=64 KiB, so freed activations leave the heap),
torch.cuda.max_memory_allocated on CUDA. Ratios: time against full_logits and all_graphs at the same point,
memory against the same provider at the smallest n_t.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import sys
import types
from pathlib import Path

import torch

from dllm_fast import objectives, reference
from dllm_fast.contracts import RolloutBatch, completion_mask
from dllm_fast.likelihood import score
from dllm_fast.models import LLaDAConfig, LLaDAModel
from dllm_fast.objectives import InnerUpdate

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from common import (  # noqa: E402
    Provider, add_ratio, add_results_dir_argument, free_memory, measure_in_tree, print_table, progress,
    saved_bytes, peak_extra_bytes, time_interleaved, write_results,
)

GROUP = 4
LORA_TARGETS = r".*blocks\.\d+\.(q_proj|k_proj|v_proj|up_proj)$"  # what d1/SPG's LoRA effectively adapts
BEFORE = "@before"


class Case:
    """The model, the rollouts, the objective's masks and the current, old and reference lp for one point."""

    def __init__(self, point: dict):
        self.device = torch.device(point["device"])
        dtype = getattr(torch, point["dtype"])
        config = LLaDAConfig.preset(point["preset"])
        self.model = LLaDAModel.with_random_weights(config, dtype=dtype, device=self.device, seed=point["seed"])
        self.objective = objectives.get(point["objective"], n_t=point["n_t"])
        others = {}
        if self.objective.needs_reference:
            others["ref"] = perturbed(self.model, seed=point["seed"] + 7)
        if point["update"] == "later" and self.objective.uses_old_policy:
            others["old"] = perturbed(self.model, seed=point["seed"] + 8)
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
            self.lp_now = score(self.model, self.batch.sequences, self.masks, **scoring)
            lp = {name: score(other, self.batch.sequences, self.masks, **scoring) for name, other in others.items()}
        self.lp_old, self.lp_ref = lp.get("old"), lp.get("ref")
        self.first = point["update"] == "first"
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
    # The decoding order trajectory objectives (TraceRL) replay: two positions unmasked per forward, in a random
    # order per sequence, as generate(record_unmask_step=True) records it.
    unmask_step = torch.stack([torch.randperm(L, generator=generator) // 2 for _ in range(N)])
    sequences = sequences.to(device)
    return RolloutBatch(sequences, None, P, completion_mask(sequences[:, P:], config.eos_token_id),
                        rewards.to(device), GROUP, unmask_step=unmask_step.to(device))


@functools.lru_cache(maxsize=1)
def _case(point_json: str) -> Case:
    return Case(json.loads(point_json))


def setup(point: dict) -> Case:
    """The point's Case, built once per process and shared by every provider of the point."""
    return _case(json.dumps(point, sort_keys=True))


def full_logits_lp(model, sequences: torch.Tensor, masks, attention_mask) -> torch.Tensor:
    """lp [N, n_t, L] as the official trainers get it: one forward of the N noisy sequences per Monte Carlo sample,
    full logits, log_softmax, gather (dllm_fast.reference.likelihood.score_naive on that sample), graphs kept."""
    samples = []
    for j in range(masks.n_t):
        sample = types.SimpleNamespace(masked=masks.masked[:, j:j + 1], counted=masks.counted,
                                       prompt_length=masks.prompt_length)
        samples.append(reference.likelihood.score_naive(model, sequences, sample, attention_mask))
    return torch.cat(samples, dim=1)


def run_full_logits(case: Case) -> None:
    case.model.zero_grad(set_to_none=True)  # as the trainer does before each update
    lp = full_logits_lp(case.model, case.batch.sequences, case.masks, case.batch.attention_mask)
    case.objective.loss(lp, case.inputs).backward()


def run_all_graphs(case: Case) -> None:
    case.model.zero_grad(set_to_none=True)
    lp = score(case.model, case.batch.sequences, case.masks, micro_batch=case.micro_batch,
               attention_mask=case.batch.attention_mask)
    case.objective.loss(lp, case.inputs).backward()


def run_streaming(case: Case) -> None:
    case.model.zero_grad(set_to_none=True)
    update = InnerUpdate(case.masks, lp_old=case.lp_old, lp=case.lp_now if case.first else None)
    case.objective.backward(case.model, case.batch, update, lp_ref=case.lp_ref, micro_batch=case.micro_batch)


def warm_up(run, case: Case) -> None:
    """One run, then the gradients freed: the memory baseline holds the model, not its gradients, so every
    provider's peak counts the gradients it allocates (the same for all) plus what it keeps for backward."""
    run(case)
    case.model.zero_grad(set_to_none=True)


def provider(name: str, run) -> Provider:
    return Provider(name, setup, run, warm_up=functools.partial(warm_up, run))


PROVIDERS = {p.name: p for p in [
    provider("full_logits", run_full_logits),
    provider("all_graphs", run_all_graphs),
    provider("streaming", run_streaming),
]}


def measure_point(args, point: dict, providers: list[Provider]) -> list[dict]:
    """Rows of every provider at one point: their runs timed in turns, then each one's memory."""
    keys = {key: point[key] for key in ("objective", "n_t", "default_nt", "update")}
    here = [p for p in providers if not p.name.endswith(BEFORE)]
    rows = []
    if here:
        case = setup(point)
        for p in here:
            p.warm_up(case)
        timings = time_interleaved({p.name: functools.partial(p.run, case) for p in here}, point["device"],
                                   repeats=args.repeats)
        for p in here:
            timing = timings[p.name]
            row = keys | dict(provider=p.name, status="ok", seconds=timing.median_s, min_seconds=timing.min_s,
                              ms_per_sample=1e3 * timing.median_s / point["n_t"],
                              pairs=int((case.masks.num_masked > 0).sum()))
            if not args.no_saved:
                row["saved_mib"] = saved_bytes(functools.partial(p.run, case), live=True,
                                               exclude=case.parameters()) / 2**20
            rows.append(row)
    if not args.no_rss:
        env = {} if args.default_malloc else {"MALLOC_MMAP_THRESHOLD_": str(64 << 10)}
        for row, p in zip(rows, here):
            row["peak_mib"] = peak_extra_bytes(p, point, env=env) / 2**20
    for p in providers:
        if p.name.endswith(BEFORE):
            out = measure_in_tree("bench_objectives", p.name.removesuffix(BEFORE), point, args.before,
                                  repeats=args.repeats, env={} if args.default_malloc else
                                  {"MALLOC_MMAP_THRESHOLD_": str(64 << 10)})
            rows.append(keys | dict(provider=p.name, status="ok", seconds=out["timing"].median_s,
                                    min_seconds=out["timing"].min_s,
                                    ms_per_sample=1e3 * out["timing"].median_s / point["n_t"],
                                    peak_mib=out["peak_bytes"] / 2**20))
    _case.cache_clear()
    free_memory(point)
    for row in rows:
        print(progress(row), flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--objectives", nargs="+", default=list(objectives.available()),
                        choices=objectives.available())
    parser.add_argument("--nt", type=int, nargs="+", default=[1, 2, 32],
                        help="MC samples per sequence, besides each objective's default (each rounded up to the "
                             "nearest the objective accepts: even for complementary pairs, odd for coupled masks)")
    parser.add_argument("--no-default-nt", action="store_true", help="only the --nt values, not each default")
    parser.add_argument("--updates", nargs="+", default=["first", "later"], choices=["first", "later"],
                        help="which inner update (see the docstring)")
    parser.add_argument("--providers", nargs="+", default=["all_graphs", "streaming"], choices=list(PROVIDERS))
    parser.add_argument("--before", help="also run streaming with dllm_fast from this checkout (built in place)")
    parser.add_argument("--max-nt", type=json.loads, default=None,
                        help='skip a provider above an n_t, as JSON, e.g. \'{"full_logits": 16}\' (default: none on '
                             'CUDA, where out-of-memory is caught; {"full_logits": 16, "all_graphs": 32} on CPU)')
    parser.add_argument("--preset", help="model preset (default: small on CPU, llada-8b on CUDA)")
    parser.add_argument("--sequences", type=int, default=8, help="N rollouts, in groups of 4")
    parser.add_argument("--prompt", type=int, help="P (default: 64 on CPU, 200 on CUDA)")
    parser.add_argument("--completion", type=int, help="L (default: 128 on CPU, 256 on CUDA)")
    parser.add_argument("--micro-batch", type=int, default=8, help="(sequence, sample) pairs per graph")
    parser.add_argument("--lora", action="store_true", help="LoRA (q, k, v, up) instead of a full fine-tune")
    parser.add_argument("--lora-rank", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="timed rounds (each provider once per round)")
    parser.add_argument("--no-rss", action="store_true", help="CPU: skip the fresh-process resident-peak runs")
    parser.add_argument("--no-saved", action="store_true", help="skip the saved-for-backward run")
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
    limits = args.max_nt if args.max_nt is not None else ({} if cuda else {"full_logits": 16, "all_graphs": 32})
    providers = [PROVIDERS[name] for name in args.providers]
    if args.before:
        providers.append(dataclasses.replace(PROVIDERS["streaming"], name="streaming" + BEFORE))
    rows = []
    for name in args.objectives:
        default = objectives.get(name).config
        values = sorted(set(args.nt) | (set() if args.no_default_nt else {default.n_t}))
        accepted = {n: objectives.nearest_valid_n_t(name, n, limit=max(values) * 4) for n in values}
        for asked in [n for n, found in accepted.items() if found is None]:  # e.g. tracerl: n_t follows shrink
            print(f"{name}: no n_t >= {asked} applies (its samples are set otherwise); skipped")
        for n_t in dict.fromkeys(n for n in accepted.values() if n is not None):
            for update in args.updates:
                point = dict(device=args.device, preset=preset, dtype=dtype, objective=name, n_t=n_t,
                             default_nt=n_t == default.n_t, update=update, sequences=args.sequences, prompt=prompt,
                             completion=completion, micro_batch=args.micro_batch, lora=args.lora,
                             lora_rank=args.lora_rank, seed=args.seed)
                running = [p for p in providers if n_t <= limits.get(p.name.removesuffix(BEFORE), n_t)]
                rows += [dict(objective=name, n_t=n_t, default_nt=point["default_nt"], update=update,
                              provider=p.name, status=f"skipped: n_t > {limits[p.name.removesuffix(BEFORE)]}")
                         for p in providers if p not in running]
                rows += measure_point(args, point, running)
    for baseline in ("full_logits", "all_graphs"):
        add_ratio(rows, f"speedup_vs_{baseline}", "ms_per_sample", baseline={"provider": baseline},
                  match=("objective", "n_t", "update"), invert=True)
    for name in args.objectives:
        smallest = min(r["n_t"] for r in rows if r["objective"] == name)
        for metric in ("saved_mib", "peak_mib"):
            add_ratio([r for r in rows if r["objective"] == name], f"{metric.split('_')[0]}_vs_smallest_nt", metric,
                      baseline={"n_t": smallest}, match=("provider", "update"))
    columns = ["objective", "n_t", "update", "provider", "status", "ms_per_sample", "speedup_vs_full_logits",
               "speedup_vs_all_graphs", "saved_mib", "saved_vs_smallest_nt", "peak_mib", "peak_vs_smallest_nt"]
    print_table(rows, columns)
    name = args.name or "objectives_" + args.device + ("_lora" if args.lora else "")
    config = {k: v for k, v in vars(args).items() if k not in ("name", "results_dir")} | dict(
        preset=preset, prompt=prompt, completion=completion, dtype=dtype, group_size=GROUP)
    print(f"wrote {write_results(name, config, rows, args.results_dir)}")


if __name__ == "__main__":
    main()
