"""Memory and time of the Monte Carlo ELBO objective's forward + backward against n_t, naive vs streaming.

    python benchmarks/bench_elbo.py                          # CPU: `small` preset, prompt 64 + completion 256
    python benchmarks/bench_elbo.py --device cuda            # GPU: llada-8b shapes, prompt 200 + completion 512,
    python benchmarks/bench_elbo.py --device cuda --lora     #      random bf16 weights, full fine-tune or LoRA;
                                                             #      streaming at equal pairs per graph and fitted
    python benchmarks/bench_elbo.py --sequences 4 --micro-batch 2 --nt 1 2 32 --providers two_pass separable \
        --before /tmp/engine_before                         # memory flat in n_t, before and after a change
    python benchmarks/bench_elbo.py --interleaved 5 --sequences 2 --nt 8 --micro-batch 8 --prompt 32 \
        --completion 64                                     # two_pass eager vs compiled, alternating calls

--sequences sequences (default 1), n_t stratified_l masks over each completion (every position counts),
on-policy objectives (the old policy's ELBO is the current one, detached, so no extra scoring pass is needed).
Gradients are None when each run starts (--grads none, as the trainer leaves them: the peak includes the
gradients the run allocates) or already allocated (--grads existing: accumulating into them; the engine's
all-or-nothing guarantee then keeps one copy). Providers, side by side:

    naive       dllm_fast.reference.likelihood.score_naive: all n_t pairs in one graph through the full
                [n_t, P + L, V] logits and log_softmax, then VRPO-OL's exp(ELBO - ELBO_old) * A, backward;
    all_graphs  the same graph but through the fused LM head (dllm_fast.likelihood.score, one micro-batch):
                an honest baseline for the streaming paths, which use the same scoring;
    two_pass    dllm_fast.likelihood.streaming_backward on the same objective, `--micro-batch` pairs per graph;
    separable   streaming_backward(Separable(terms)) on BGPO's per-sample linear bound (BGPO Eq. 13);
    compiled    two_pass with MicroBatching(compile=True): each micro-batch's forward and pass 2's backward as
                torch.compile(fullgraph=True) graphs (inductor), pairs and scored rows padded to power-of-two
                buckets; its warm-up also runs the point's own masks, so that every bucket is compiled before
                timing (the compile time is not in the timed runs; --interleaved reports it);
    <p>@before  with --before TREE: provider p (two_pass, separable) of this benchmark with dllm_fast imported
                from another checkout, built in place (`git archive 5649a7b | tar -x -C /tmp/engine_before`,
                then `python setup.py build_ext --inplace` there), timed and measured in a fresh process.

--micro-batch takes one or more settings, each a number of (sequence, sample) pairs per streamed graph or
    equal   the pairs of naive's one graph (sequences x n_t): two_pass against naive at equal pairs per graph;
    fitted  the largest micro-batch the planner fits in 90% of the device's free memory (what `train --micro-batch
            auto` picks, dllm_fast/train/micro_batch.py), planned once at the sweep's largest n_t for a LoRA or full
            fine-tune of --preset at these lengths (vrpo_ol, 2 sequences; a tokenizer of the preset's vocabulary);
            --fit-gpu NAME plans for one of the planner's GPUs instead of the device (for a CPU dry run).
The GPU preset's default is `equal fitted`, the CPU's 1. naive and all_graphs do not depend on it and run once per
n_t. For the streaming providers, kernels_per_micro_batch (pass 2's forward and backward, profiler CPU trace as
bench_rollout counts them) and syncs_per_micro_batch (host syncs inside pass 1's and pass 2's micro-batches,
dllm_fast.testing.syncs; the engine's few per call are outside them) come with each row.

Time is the median (and the minimum) of --repeats runs after a warm-up, reported per MC sample. Memory:
  - saved: the peak of the bytes autograd keeps for backward and that are alive at once during one full run
    (track_live_saved_tensors, parameters excluded): every graph for naive/all_graphs, one micro-batch's graph
    for the streaming paths;
  - peak: on CPU the resident peak of a fresh subprocess above its baseline (after a warm-up run on one fully
    masked sample per sequence, which touches the largest per-sample buffers; gradients then freed or kept as
    --grads says); on CUDA
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
import contextlib
import dataclasses
import functools
import importlib
import statistics
import sys
from pathlib import Path

import torch

from dllm_fast import reference
from dllm_fast.likelihood import MicroBatching, Separable, elbo, sample_masks, score, streaming_backward
from dllm_fast.models import LLaDAConfig, LLaDAModel
from dllm_fast.testing.syncs import SyncCounter
from dllm_fast.train.metrics import compile_seconds

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from bench_rollout import _launches  # noqa: E402
from common import (  # noqa: E402
    Provider, add_ratio, add_results_dir_argument, measure_in_tree, print_table, run_sweep, time_call, training_memory,
    write_results,
)

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
    """One model and one sequence, shared by every provider and n_t of a sweep; the masks for each n_t."""

    def __init__(self, *, preset, prompt, completion, device, dtype, lora, lora_rank, checkpointing, sequences=1,
                 seed=0):
        self.device = torch.device(device)
        self.model = build_model(preset, self.device, dtype, lora=lora, lora_rank=lora_rank,
                                 checkpointing=checkpointing, seed=seed)
        self.prompt = prompt
        config = LLaDAConfig.preset(preset)
        gen = torch.Generator(device=self.device).manual_seed(seed + 1)
        self.sequences = torch.randint(0, config.mask_token_id, (sequences, prompt + completion), generator=gen,
                                       device=self.device)
        self._masks = {}

    def masks(self, n_t: int):
        if n_t not in self._masks:
            self._masks[n_t] = sample_masks(self.sequences, prompt_length=self.prompt, n_t=n_t,
                                            sampler="stratified_l", count="all",
                                            generator=torch.Generator(device=self.device).manual_seed(n_t))
        return self._masks[n_t]

    def fully_masked(self):
        """One sample per sequence with every completion position masked: the most rows through the LM head."""
        return sample_masks(self.sequences, prompt_length=self.prompt, n_t=1, sampler="mean_field", count="all",
                            perturb_prob=0.0, generator=torch.Generator(device=self.device).manual_seed(0))

    def parameters(self):
        return [p for p in self.model.parameters()]


CASE_KEYS = ("preset", "prompt", "completion", "device", "dtype", "lora", "lora_rank", "checkpointing", "sequences")


@functools.lru_cache(maxsize=1)
def cached_case(*values) -> Case:
    """The sweep's one Case (model and sequence), built once per process and shared by every provider."""
    settings = dict(zip(CASE_KEYS, values))
    settings["dtype"] = getattr(torch, settings["dtype"])
    return Case(**settings)


def setup(point: dict):
    """(case, masks, whether gradients exist when a run starts, the streaming providers' MicroBatching)."""
    case = cached_case(*(point[key] for key in CASE_KEYS))
    batching = MicroBatching(point["micro_batch"], score_micro_batch=point["score_micro_batch"])
    return case, case.masks(point["n_t"]), point["grads"] == "existing", batching


# One function per provider: forward + backward of the objective on (case, masks), the streaming ones cut as
# `batching` says.


def naive(case: Case, masks, batching: MicroBatching) -> None:
    vrpo_ol(masks)(reference.likelihood.score_naive(case.model, case.sequences, masks)).backward()


def all_graphs(case: Case, masks, batching: MicroBatching) -> None:
    vrpo_ol(masks)(score(case.model, case.sequences, masks, micro_batch=masks.n_t)).backward()


def two_pass(case: Case, masks, batching: MicroBatching) -> None:
    streaming_backward(case.model, case.sequences, masks, vrpo_ol(masks), micro_batch=batching)


def separable(case: Case, masks, batching: MicroBatching) -> None:
    streaming_backward(case.model, case.sequences, masks, Separable(bgpo_bound(masks)), micro_batch=batching)


def compiled(case: Case, masks, batching: MicroBatching) -> None:
    streaming_backward(case.model, case.sequences, masks, vrpo_ol(masks),
                       micro_batch=dataclasses.replace(batching, compile=True))


def run(backward, state) -> None:
    case, masks, existing, batching = state
    case.model.zero_grad(set_to_none=not existing)  # None, or allocated and part of the baseline
    backward(case, masks, batching)


def warm_up(backward, state) -> None:
    """One run on a fully masked sample per sequence: touches the largest per-sample buffers, so a later peak
    measures transient memory, not first touches; the gradients it allocates stay only with --grads existing."""
    case, _, existing, batching = state
    run(backward, (case, case.fully_masked(), existing, batching))
    case.model.zero_grad(set_to_none=not existing)


def warm_up_compiled(state) -> None:
    """warm_up, then one run on the point's own masks: every (pairs, rows) bucket it needs is compiled."""
    warm_up(compiled, state)
    run(compiled, state)


PROVIDERS = {
    backward.__name__: Provider(backward.__name__, setup=setup, run=functools.partial(run, backward),
                                warm_up=functools.partial(warm_up, backward))
    for backward in (naive, all_graphs, two_pass, separable)
} | {"compiled": Provider("compiled", setup=setup, run=functools.partial(run, compiled), warm_up=warm_up_compiled)}


def interleaved_compiled(point: dict, rounds: int) -> dict:
    """two_pass eager against compiled in one process, calls alternating (ABBA order) so that a machine whose
    load drifts slows both alike: median seconds of each, their ratio, the compile time (torch.compile's own,
    in the first compiled call), the kernels per pass-2 micro-batch of each (profiler CPU trace), and the
    largest gradient difference relative to the largest gradient."""
    state = setup(point)
    case = state[0]
    grads = {}
    compiling = compile_seconds()
    for backward in (compiled, two_pass):  # the first compiled call compiles every bucket of these masks
        run(backward, state)
        grads[backward.__name__] = [p.grad.clone() for p in case.parameters() if p.grad is not None]
    compiling = compile_seconds() - compiling
    scale = max(float(g.abs().max()) for g in grads["two_pass"])
    difference = max(float((a - b).abs().max()) for a, b in zip(grads["compiled"], grads["two_pass"])) / scale
    seconds = {"two_pass": [], "compiled": []}
    for round_ in range(rounds):
        for backward in (two_pass, compiled) if round_ % 2 == 0 else (compiled, two_pass):
            timing = time_call(lambda: run(backward, state), point["device"], warmup=0, repeats=1)
            seconds[backward.__name__].append(timing.median_s)
    eager_s, compiled_s = (statistics.median(seconds[name]) for name in ("two_pass", "compiled"))
    return dict(n_t=point["n_t"], status="ok", eager_s=eager_s, compiled_s=compiled_s, speedup=eager_s / compiled_s,
                compile_s=compiling, grad_rel_diff=difference, rounds=rounds,
                kernels_per_micro_batch_eager=count_micro_batch_kernels(lambda: run(two_pass, state)),
                kernels_per_micro_batch_compiled=count_micro_batch_kernels(lambda: run(compiled, state)))


MICRO_BATCH_RANGE = "dllm_fast.pass_2_micro_batch"


def count_micro_batch_kernels(call) -> float:
    """Kernels a pass-2 micro-batch (forward and backward; the separable path's one pass) launches, on average over
    the micro-batches of `call()`, counted on the profiler's CPU trace as bench_rollout counts a denoising step's:
    the ops inside
    each micro-batch's range (the forward in the engine's thread, the backward in autograd's), with inductor's
    kernels named by cpp.enable_kernel_profile."""
    from torch._inductor import config as inductor_config

    engine = importlib.import_module("dllm_fast.likelihood.engine")
    with contextlib.ExitStack() as restore:
        for name in ("score_pairs_with_known_gradient", "known_gradient_compiled", "_score_with_grad"):
            original = getattr(engine, name)
            restore.callback(setattr, engine, name, original)
            setattr(engine, name, _traced(original))
        restore.enter_context(inductor_config.patch({"cpp.enable_kernel_profile": True}))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            call()
    events = profile.events()
    ranges = [event for event in events if event.name == MICRO_BATCH_RANGE]
    backward = [event for event in events if event.name.startswith("autograd::engine::evaluate_function")]
    tally: dict[str, int] = {}
    forward = sum(_launches(child, tally) for event in ranges for child in event.cpu_children)
    return (forward + sum(_launches(event, tally) for event in backward)) / max(len(ranges), 1)


def _traced(function):
    def traced(*args, **kwargs):
        with torch.profiler.record_function(MICRO_BATCH_RANGE):
            return function(*args, **kwargs)
    return traced


def count_micro_batch_syncs(call, compiled: bool = False) -> float:
    """Host syncs (dllm_fast.testing.syncs) inside the engine's micro-batches of `call()`, pass 1's and pass 2's (eager:
    the forward and pass 2's backward; compiled: the eager preparation of each micro-batch, since the counter's
    dispatch mode cannot stay on around a compiled graph, which holds no host read anyway), on average per
    micro-batch; the engine's syncs per call (input checks, the pairs' schedule, finiteness) are outside them."""
    counted = {"syncs": 0, "micro_batches": 0}

    def counting(function, backward=False):
        def wrapped(*args, **kwargs):
            with SyncCounter() as syncs:
                out = function(*args, **kwargs)
            counted["syncs"] += syncs.count
            counted["micro_batches"] += not backward
            return out
        return wrapped

    engine = importlib.import_module("dllm_fast.likelihood.engine")
    targets = [(importlib.import_module("dllm_fast.likelihood.compiled"), "pad_pairs", False)] if compiled else [
        (engine, "score_batch_of_pairs", False), (engine, "score_pairs_with_known_gradient", False),
        (engine._Backward, "__call__", True)]
    with contextlib.ExitStack() as restore:
        for owner, name, backward in targets:
            original = getattr(owner, name)
            restore.callback(setattr, owner, name, original)
            setattr(owner, name, counting(original, backward))
        call()
    return counted["syncs"] / max(counted["micro_batches"], 1)


def fitted_micro_batch(args, n_t: int, device: torch.device) -> int:
    """The micro-batch `train --micro-batch auto` would pick for this benchmark's model and lengths (see the module
    docstring): the planner's largest that fits 90% of the free memory."""
    import tempfile

    from dllm_fast.assets.char_tokenizer import build_char_tokenizer, save_tokenizer
    from dllm_fast.planning.gpus import gpu as planner_gpu
    from dllm_fast.train import TrainConfig
    from dllm_fast.train.micro_batch import device_gpu, fitted_micro_batch as fit

    vocabulary = tempfile.mkdtemp(prefix="bench_elbo_vocab_")  # the preset's output layer, not the embedded one's
    save_tokenizer(build_char_tokenizer(vocab_size=LLaDAConfig.preset(args.preset).vocab_size), vocabulary)
    config = TrainConfig(model=args.preset, tokenizer=vocabulary, lora=args.lora, lora_rank=args.lora_rank,
                         lora_alpha=max(1, args.lora_rank // 2), lora_targets=LORA_TARGETS,
                         gradient_checkpointing=args.checkpointing, bf16=device.type == "cuda",
                         objective="vrpo_ol", objective_options={"n_t": n_t}, prompts_per_step=1,
                         group_size=max(2, args.sequences), gen_length=args.completion, block_length=args.completion,
                         diffusion_steps=1, score_micro_batch=args.score_micro_batch, progress=False)
    gpu = planner_gpu(args.fit_gpu) if args.fit_gpu else device_gpu(device)
    micro_batch, note = fit(config, gpu=gpu, prompt_length=args.prompt)
    print(note, flush=True)
    return micro_batch


def naive_logits_bytes(pairs: int, length: int, vocab: int) -> int:
    """Logits, their fp32 log_softmax and its gradient: what the naive path allocates beyond the model."""
    return 3 * pairs * length * vocab * 4


STREAMING = ("two_pass", "separable", "compiled")


def skip(args, provider: Provider, point: dict) -> str | None:
    """naive and all_graphs run at the first micro-batch setting only (they do not depend on it); naive on CPU is
    skipped where its logits alone would exceed --naive-max-gib."""
    if provider.name.removesuffix(BEFORE) not in STREAMING and point["setting"] != str(args.micro_batch[0]):
        return "skipped: no micro-batch (see the first setting's row)"
    if provider.name != "naive" or point["device"] != "cpu":
        return None
    vocab = LLaDAConfig.preset(point["preset"]).vocab_size
    need = naive_logits_bytes(point["sequences"] * point["n_t"], point["prompt"] + point["completion"], vocab)
    if need > args.naive_max_gib * 2**30:
        return f"skipped: logits need {need / 2**30:.1f} GiB > --naive-max-gib"
    return None


BEFORE = "@before"


def measure(args, provider: Provider, point: dict) -> dict:
    n_t = point["n_t"]
    if provider.name.endswith(BEFORE):
        env = {} if args.default_malloc else {"MALLOC_MMAP_THRESHOLD_": str(64 << 10)}
        out = measure_in_tree("bench_elbo", provider.name.removesuffix(BEFORE), point, args.before,
                              repeats=args.repeats, env=env)
        timing = out["timing"]
        return dict(seconds=timing.median_s, ms_per_sample=1e3 * timing.median_s / n_t,
                    min_ms_per_sample=1e3 * timing.min_s / n_t, peak_mib=out["peak_bytes"] / 2**20)
    state = provider.prepare(point)
    case, masks = state[:2]
    timing = time_call(lambda: provider.run(state), point["device"], warmup=0, repeats=args.repeats)
    row = dict(pairs_scored=int((masks.num_masked > 0).sum()), seconds=timing.median_s,
               ms_per_sample=1e3 * timing.median_s / n_t, min_ms_per_sample=1e3 * timing.min_s / n_t)
    if provider.name in STREAMING:
        row["kernels_per_micro_batch"] = count_micro_batch_kernels(lambda: provider.run(state))
        row["syncs_per_micro_batch"] = count_micro_batch_syncs(lambda: provider.run(state),
                                                               compiled=provider.name == "compiled")
    return row | training_memory(provider, point, state, exclude=case.parameters(), resident_peak=not args.no_rss,
                                 default_malloc=args.default_malloc)


def micro_batch_setting(value: str) -> str:
    if value in ("equal", "fitted") or (value.isdigit() and int(value) >= 1):
        return value
    raise argparse.ArgumentTypeError(f"--micro-batch takes pairs per graph (a number >= 1), equal or fitted; got "
                                     f"{value!r}.")


def sweep_points(args, case_settings: dict) -> list[dict]:
    """One point per (micro-batch setting, n_t), the setting resolved to a number of pairs per graph."""
    fitted = None
    if "fitted" in args.micro_batch:
        fitted = fitted_micro_batch(args, max(args.nt), torch.device(args.device))
    points = []
    for setting in args.micro_batch:
        for n_t in args.nt:
            micro_batch = {"equal": args.sequences * n_t, "fitted": fitted}.get(setting) or int(setting)
            points.append(dict(case_settings, n_t=n_t, setting=setting, micro_batch=micro_batch))
    return points


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--nt", type=int, nargs="+", help="MC samples per sequence (default: by device)")
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS))
    parser.add_argument("--preset", help="model preset (default: small on CPU, llada-8b on CUDA)")
    parser.add_argument("--prompt", type=int, help="prompt length (default: 64 on CPU, 200 on CUDA)")
    parser.add_argument("--completion", type=int, help="completion length (default: 256 on CPU, 512 on CUDA)")
    parser.add_argument("--sequences", type=int, default=1, help="sequences N (default 1)")
    parser.add_argument("--grads", choices=["none", "existing"], default="none",
                        help="gradients when a run starts: none (as the trainer leaves them) or existing")
    parser.add_argument("--before", help="also run two_pass/separable with dllm_fast from this checkout (built in "
                        "place), in fresh processes: e.g. /tmp/engine_before")
    parser.add_argument("--micro-batch", type=micro_batch_setting, nargs="+",
                        help="(sequence, sample) pairs per streamed graph: numbers, equal, fitted (default: equal "
                             "fitted on CUDA, 1 on CPU; see the module docstring)")
    parser.add_argument("--fit-gpu", help="with fitted: plan for this GPU of the planner's table instead of the "
                                          "device (e.g. h200, for a dry run on CPU)")
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
    parser.add_argument("--interleaved", type=int, metavar="ROUNDS", default=0,
                        help="instead of the providers: two_pass eager vs compiled in one process, ROUNDS "
                             "alternating pairs of calls (robust to a shared machine's drifting load)")
    add_results_dir_argument(parser)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if args.threads:
        torch.set_num_threads(args.threads)
    args.nt = args.nt or ([1, 2, 4, 8, 16, 32, 64, 128, 256] if cuda else [1, 2, 4, 8, 16, 32, 64])
    args.preset = args.preset or ("llada-8b" if cuda else "small")
    args.prompt = args.prompt if args.prompt is not None else (200 if cuda else 64)
    args.completion = args.completion or (512 if cuda else 256)
    args.repeats = args.repeats or (3 if cuda else 1)
    args.micro_batch = args.micro_batch or (["equal", "fitted"] if cuda else ["1"])
    dtype = "bfloat16" if cuda else "float32"

    case_settings = dict(preset=args.preset, prompt=args.prompt, completion=args.completion, device=args.device,
                         dtype=dtype, lora=args.lora, lora_rank=args.lora_rank, checkpointing=args.checkpointing,
                         score_micro_batch=args.score_micro_batch, sequences=args.sequences, grads=args.grads)
    points = sweep_points(args, case_settings)
    if args.interleaved:
        rows = [interleaved_compiled(point, args.interleaved) for point in points]
        print_table(rows, ["n_t", "eager_s", "compiled_s", "speedup", "compile_s", "grad_rel_diff",
                           "kernels_per_micro_batch_eager", "kernels_per_micro_batch_compiled"])
        name = args.name or f"elbo_interleaved_{args.device}"
        config = {k: v for k, v in vars(args).items() if k not in ("name", "results_dir")} | dict(dtype=dtype)
        print(f"wrote {write_results(name, config, rows, args.results_dir)}")
        return
    providers = [PROVIDERS[name] for name in args.providers]
    if args.before:
        providers += [dataclasses.replace(PROVIDERS[name], name=name + BEFORE) for name in args.providers
                      if name in ("two_pass", "separable")]
    rows = run_sweep(points, providers, functools.partial(measure, args), row_keys=("n_t", "setting", "micro_batch"),
                     skip=functools.partial(skip, args))
    # Time per sample against naive and all_graphs at the same n_t; peak and saved against the first n_t.
    for baseline in ("naive", "all_graphs"):
        add_ratio(rows, f"time_vs_{baseline}", "ms_per_sample", baseline={"provider": baseline}, match=("n_t",))
    first = min(args.nt)
    for field in ("peak_mib", "saved_mib"):
        add_ratio(rows, f"{field.split('_')[0]}_vs_nt{first}", field, baseline={"n_t": first},
                  match=("provider", "setting"))
    columns = ["n_t", "setting", "micro_batch", "provider", "status", "ms_per_sample", "time_vs_naive",
               "time_vs_all_graphs", "saved_mib", f"saved_vs_nt{first}", "peak_mib", f"peak_vs_nt{first}",
               "kernels_per_micro_batch", "syncs_per_micro_batch"]
    print_table(rows, columns)
    name = args.name or "elbo_" + args.device + ("_lora" if args.lora else "") + ("_ckpt" if args.checkpointing else "")
    config = {k: v for k, v in vars(args).items() if k not in ("name", "results_dir")} | dict(
        dtype=f"torch.{dtype}", sampler="stratified_l")
    print(f"wrote {write_results(name, config, rows, args.results_dir)}")


if __name__ == "__main__":
    main()
