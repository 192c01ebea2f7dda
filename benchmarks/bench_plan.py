"""The planner against measurement: what `python -m dllm_fast plan` predicts for a call, next to what the
benchmarks measure for the same call. Two modes.

On CPU, at small shapes, planned memory and FLOPs against measured ones:

    python benchmarks/bench_plan.py                       # small preset, fp32, the cases below
    python benchmarks/bench_plan.py --cases scoring update

Cases (each runs the same code in the planner's fake world and for real):
    scoring   likelihood.score of N sequences x n_t masks under no_grad (the old / reference scoring pass);
    update    streaming_backward of VRPO-OL on N sequences x n_t masks, gradients already allocated (the engine's
              update, as bench_elbo's two_pass runs it);
    rollout   dllm_fast.generate with the dual cache, greedy (bench_rollout's CPU setting).

Memory, measured as the benchmarks do (dllm_fast.memory, benchmarks/common.py): the resident peak of a fresh
process above its baseline after a warm-up run, with MALLOC_MMAP_THRESHOLD_=64 KiB so that freed tensors leave
the heap; and for the update the most saved-for-backward bytes alive at once (parameters excluded). Planned: the
phase's peak above the memory alive when it started, and its largest activations. FLOPs: the planner's count of a
forward and backward of the model (with the fused LM head on the masked rows) against an analytic count.

On a GPU (no GPU needed: every number is a PLANNER ESTIMATE made on fake tensors), time:

    python benchmarks/bench_plan.py --gpu h200            # each recorded H200 point: recorded, predicted, ratio;
                                                          # then the estimates nothing has measured yet
    python benchmarks/bench_plan.py --gpu h200 --fit      # fit the calibration again and print how
    python benchmarks/bench_plan.py --gpu h200 --preset llada-8b --lora --prompt 200 --completion 512 --nt 16 \
        --micro-batch 8 --provider naive two_pass [--json]   # bench_elbo's case: predicted ms per sample

The recorded points are the first GPU run's (dllm_fast.planning.calibration.RECORDED, run 1: fitted), the
second's and the fourth's (RECORDED_AFTER and RECORDED_RUN_4: predicted by the fit, not in it); the calls are
dllm_fast.planning.predict's, each the benchmark's own call run on fake tensors. The estimates: the fused head
with bf16 gradient GEMMs (issue 28) against naive and the known-gradient walk; LLaDA-8B rollouts at batch 8,
eager and compiled (CUDA graphs); the engine's two_pass against naive at equal pairs per graph.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from common import (  # noqa: E402
    Provider, add_results_dir_argument, measure_in_fresh_process, print_table, saved_bytes, write_results,
)

MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(64 << 10)}


@dataclass
class State:
    model: object
    sequences: torch.Tensor
    masks: object
    point: dict


def inputs(model, point: dict) -> State:
    """The case's sequences and masks, drawn from seeded generators (the same values real or fake)."""
    from dllm_fast.likelihood import sample_masks

    generator = torch.Generator().manual_seed(point["seed"])
    length = point["prompt"] + point["completion"]
    sequences = torch.randint(0, model.mask_token_id, (point["sequences"], length), generator=generator)
    masks = sample_masks(sequences, prompt_length=point["prompt"], n_t=point["n_t"], sampler="stratified_l",
                         count="all", generator=torch.Generator().manual_seed(point["seed"] + 1))
    return State(model, sequences, masks, point)


def vrpo_ol(masks):
    from dllm_fast.likelihood import elbo

    def objective(lp):
        value = elbo(lp, masks)
        return -torch.exp(value - value.detach()).sum()

    return objective


def run_scoring(state: State):
    from dllm_fast.likelihood import score

    with torch.no_grad():
        return score(state.model, state.sequences, state.masks, micro_batch=state.point["micro_batch"])


def run_update(state: State):
    from dllm_fast.likelihood import streaming_backward

    state.model.zero_grad(set_to_none=False)  # gradients stay allocated: part of the baseline, as in bench_elbo
    return streaming_backward(state.model, state.sequences, state.masks, vrpo_ol(state.masks),
                              micro_batch=state.point["micro_batch"])


def run_rollout(state: State):
    import dllm_fast

    point = state.point
    prompts = state.sequences[:, :point["prompt"]]
    return dllm_fast.generate(state.model, prompts, gen_length=point["completion"], block_length=point["block"],
                              steps=point["steps"], cache="dual", temperature=0.0)


RUNS = {"scoring": run_scoring, "update": run_update, "rollout": run_rollout}


def setup_real(point: dict) -> State:
    from dllm_fast.models import LLaDAConfig, LLaDAModel

    model = LLaDAModel.with_random_weights(LLaDAConfig.preset(point["preset"]), dtype=torch.float32, seed=0)
    if point["case"] == "rollout":
        model.eval()
    return inputs(model, point)


def run_real(state: State):
    return RUNS[state.point["case"]](state)


def planned(point: dict) -> dict:
    """The planner's numbers for the case: the call run in a planning session on this CPU (no GPU)."""
    from dllm_fast.planning.accounting import Target
    from dllm_fast.planning.step import Session
    from dllm_fast.train.config import TrainConfig

    config = TrainConfig(model=point["preset"], bf16=False)
    session = Session(config, target=Target("cpu"), weights_dtype=torch.float32)
    with session:
        model = session.policy
        if point["case"] == "rollout":
            model.eval()
        state = inputs(model, point)
        run_real(state)  # the warm-up the measurement makes too
        phase, _ = session.measure(point["case"], lambda: run_real(state))
        flops = session.measure("flops", functools.partial(forward_backward, state))[0].costs.flops
    return dict(planned_peak_mib=(phase.peak - phase.start) / 2**20,
                planned_saved_mib=(phase.category_peaks["activations"]) / 2**20,
                planned_flops=flops)


def forward_backward(state: State) -> None:
    """One forward and backward of the model on the sequences with the first sample's masks, the fused LM head on
    the masked rows: the unit of the engine's pass 2."""
    from dllm_fast.ops import masked_logprobs

    model, masks, P = state.model, state.masks, state.point["prompt"]
    noisy = state.sequences.masked_fill(masks.masked[:, 0], model.mask_token_id)
    hidden = model(noisy)
    rows, positions = masks.scored[:, 0].nonzero(as_tuple=True)
    logp = masked_logprobs(hidden[rows, P + positions], model.lm_head_weight, state.sequences[rows, P + positions])
    logp.sum().backward()


def analytic_flops(state: State) -> float:
    """FLOPs of `forward_backward` by hand: every linear layer 2 per multiply-add forward and twice that backward;
    attention's QK^T and AV forward, and backward 2.5 times forward (flash attention recomputes the scores); the
    LM head forward on the M masked rows, and backward its recompute plus both gradients."""
    from dllm_fast.models import LLaDAConfig

    config = LLaDAConfig.preset(state.point["preset"])
    B, S = state.sequences.shape
    d, h, layers, V = config.d_model, config.mlp_hidden_size, config.n_layers, config.vocab_size
    M = int(state.masks.scored[:, 0].sum())
    linear = 2 * B * S * layers * (4 * d * d + 3 * d * h)
    attention = 4 * B * S * S * d * layers
    head = 2 * M * V * d
    return 3 * linear + 3.5 * attention + 4 * head


def measured(point: dict) -> dict:
    provider = Provider(point["case"], setup_real, run_real)
    row = dict(measured_peak_mib=measure_in_fresh_process(provider, point, env=MALLOC)["peak_bytes"] / 2**20)
    if point["case"] == "update":
        state = provider.prepare(point)
        row["measured_saved_mib"] = saved_bytes(lambda: run_real(state), live=True,
                                                exclude=list(state.model.parameters())) / 2**20
        row["analytic_flops"] = analytic_flops(state)
    return row


POINTS = {
    "scoring": dict(sequences=4, prompt=64, completion=256, n_t=8, micro_batch=8),
    "update": dict(sequences=1, prompt=64, completion=256, n_t=8, micro_batch=2),
    "rollout": dict(sequences=4, prompt=64, completion=128, block=32, steps=64, n_t=1, micro_batch=1),
}


def gpu_points(gpu: str, names: list[str] | None = None) -> list[dict]:
    """Each recorded point (or those named) with the planner's prediction and their ratio."""
    from dllm_fast.planning import predict
    from dllm_fast.planning.calibration import RECORDED, RECORDED_AFTER, RECORDED_RUN_4

    rows = []
    runs = [(1, p) for p in RECORDED] + [(2, p) for p in RECORDED_AFTER] + [(4, p) for p in RECORDED_RUN_4]
    for run, point in runs:
        if names and point.name not in names:
            continue
        predicted = predict.recorded(point, gpu)
        unit = "x naive" if point.kind == "engine" else "s"
        row = dict(run=run, point=point.name, recorded=point.value, predicted=predicted.pop("predicted"), unit=unit,
                   **predicted)
        # run 1 ran b7790f6's layers: its eager points compared at the kernels that code launched (predicted_then)
        row["ratio"] = row.get("predicted_then", row["predicted"]) / row["recorded"]
        if point.kernels_per_step is not None:
            row["recorded_kernels_per_step"] = point.kernels_per_step
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def gpu_estimates(gpu: str) -> list[dict]:
    """The PLANNER ESTIMATES nothing has measured yet (see the module docstring)."""
    from dllm_fast.planning import predict

    rows = []

    def add(name, value, unit, **parts):
        rows.append(dict(estimate=name, value=value, unit=unit, **parts))
        print(json.dumps(rows[-1]), flush=True)

    for M in (2048, 8192):
        naive = predict.head(gpu, M=M, provider="naive", backward=True).seconds
        for provider in ("dllm_fast", "dllm_grad", "dllm_grad_lse"):
            for tf32 in ((False, True) if provider == "dllm_fast" else (False,)):
                fused = predict.head(gpu, M=M, provider=provider, backward=True, tf32_grad_gemms=tf32).seconds
                label = {"dllm_fast": "masked_logprobs fwd+bwd", "dllm_grad": "masked_logprobs_grad",
                         "dllm_grad_lse": "masked_logprobs_grad, logsumexp known"}[provider]
                add(f"head {label}{' (TF32 gradients)' if tf32 else ''} M={M}, bf16", 1e3 * fused, "ms",
                    naive_ms=1e3 * naive, speedup_vs_naive=naive / fused)
    for compile in (False, True):
        costs, nfe = predict.rollout(gpu, cache="dual", compile=compile)
        add(f"rollout 8B dual, batch 8, {'compiled' if compile else 'eager'}", 8 * 256 / costs.seconds, "tokens/s",
            seconds=costs.seconds, device_s=costs.device_seconds, host_s=costs.host_seconds,
            kernels_per_step=costs.kernels / nfe, roofline_s=costs.roofline_seconds)
    for n_t in (16,):
        naive = predict.engine(gpu, provider="naive", n_t=n_t, micro_batch=n_t).seconds / n_t
        two_pass = predict.engine(gpu, provider="two_pass", n_t=n_t, micro_batch=n_t).seconds / n_t
        add(f"engine two_pass / naive per sample, n_t={n_t}, micro-batch {n_t} (equal pairs per graph)",
            two_pass / naive, "x naive", naive_ms_per_sample=1e3 * naive, two_pass_ms_per_sample=1e3 * two_pass)
    return rows


def fit(gpu: str) -> None:
    """Fit the calibration's factors, each from the points it dominates (calibration.py's docstring), and print
    the derivation: the GEMM and bandwidth efficiencies by least squares over the fused head's and naive's points
    (their device time split by what bounds each kernel, at the datasheet peaks); then, one at a time on the full
    model, eager_launch on the host-bound 8B dual rollout, fp32 on the small preset's compiled none rollout
    (device-bound, fp32 GEMMs) and graph_launch on its compiled dual rollout."""
    import dataclasses as dc

    import numpy

    from dllm_fast.planning import predict
    from dllm_fast.planning.calibration import DEFAULT, RECORDED, ROOFLINE

    heads = [p for p in RECORDED if p.kind == "head"]
    factors = ("tensor_core", "tf32", "bandwidth")
    matrix, target = [], []
    for point in heads:
        split = {}
        predict.head(gpu, calibration=ROOFLINE, split=split, **point.options)
        matrix.append([split.get(name, 0.0) / point.value for name in factors])
        target.append(1.0)
        print(f"{point.name}: {point.value * 1e3:.2f} ms = " + " + ".join(
            f"{split.get(name, 0.0) * 1e3:.2f} ms / {name}" for name in factors))
    inverse, *_ = numpy.linalg.lstsq(numpy.array(matrix), numpy.array(target), rcond=None)
    calibration = dc.replace(DEFAULT, name="fit", **{name: float(1 / x) for name, x in zip(factors, inverse)})
    print("least squares (relative): " + ", ".join(f"{name} {getattr(calibration, name):.3f}" for name in factors))

    def solve(name: str, point_name: str, *, grows: bool, rounds: int = 4):
        """Scale one factor until the point's prediction meets its recording (time grows with the factor when
        `grows`, e.g. a launch cost, and shrinks with it otherwise, e.g. an efficiency)."""
        nonlocal calibration
        point = next(p for p in RECORDED if p.name == point_name)
        for _ in range(rounds):
            values = predict.recorded(point, gpu, calibration)
            predicted = values.get("predicted_then", values["predicted"])  # eager rollouts: the code recorded
            ratio = point.value / predicted
            print(f"  {name} = {getattr(calibration, name):.4g}: {point_name} predicted {predicted:.4g} s, "
                  f"recorded {point.value:.4g} s")
            if abs(ratio - 1) < 0.005:
                break
            value = getattr(calibration, name) * (ratio if grows else 1 / ratio)
            calibration = dc.replace(calibration, **{name: value})
        print(f"{name}: {getattr(calibration, name):.4g}")

    solve("eager_launch", "rollout 8B dual, eager", grows=True)
    for _ in range(2):  # graph_launch and fp32 share the small preset's compiled points
        solve("fp32", "rollout small none, compiled", grows=False)
        solve("graph_launch", "rollout small dual, compiled", grows=True)
    print(f"fitted: {calibration}")


def engine_case(args) -> list[dict]:
    """bench_elbo's case flags: the planner's ms per sample for each provider and n_t."""
    from dllm_fast.planning import predict

    rows = []
    for n_t in args.nt:
        for provider in args.provider:
            costs = predict.engine(args.gpu, provider=provider, n_t=n_t, micro_batch=args.micro_batch,
                                   preset=args.preset or "llada-8b", prompt=args.prompt, completion=args.completion,
                                   lora=args.lora, lora_rank=args.lora_rank, sequences=args.sequences)
            rows.append(dict(n_t=n_t, provider=provider, micro_batch=args.micro_batch,
                             ms_per_sample=1e3 * costs.seconds / n_t, device_ms=1e3 * costs.device_seconds,
                             host_ms=1e3 * costs.host_seconds, kernels=costs.kernels, host_syncs=costs.syncs))
    for row in rows:
        naive = next((r for r in rows if r["provider"] == "naive" and r["n_t"] == row["n_t"]), None)
        row["time_vs_naive"] = row["ms_per_sample"] / naive["ms_per_sample"] if naive else None
    return rows


def gpu_main(args) -> None:
    from dllm_fast.planning.calibration import DEFAULT, H200_RUN, H200_RUN_2

    label = "PLANNER ESTIMATE (fake tensors, calibration " + DEFAULT.name + ")"
    if args.fit:
        fit(args.gpu)
        return
    if args.provider:
        rows = engine_case(args)
        if args.json:
            print(json.dumps(dict(label=label, gpu=args.gpu, rows=rows), indent=2))
        else:
            print(label)
            print_table(rows, ["n_t", "provider", "micro_batch", "ms_per_sample", "time_vs_naive", "device_ms",
                               "host_ms", "kernels", "host_syncs"])
        return
    points = gpu_points(args.gpu, args.points)
    estimates = [] if args.points else gpu_estimates(args.gpu)
    if args.json:
        print(json.dumps(dict(label=label, recorded_on=[H200_RUN, H200_RUN_2], points=points, estimates=estimates),
                         indent=2))
        return
    print(f"{label}; recorded: run 1 {H200_RUN}; run 2 {H200_RUN_2}")
    print_table(points, ["run", "point", "unit", "recorded", "predicted", "ratio", "device_s", "host_s",
                         "kernels_per_step", "recorded_kernels_per_step"])
    if estimates:
        print_table(estimates, ["estimate", "value", "unit", "naive_ms", "speedup_vs_naive", "seconds",
                                "kernels_per_step", "naive_ms_per_sample", "two_pass_ms_per_sample"])
    config = dict(gpu=args.gpu, calibration=DEFAULT.name, recorded_on=[H200_RUN, H200_RUN_2], label=label)
    print(f"wrote {write_results(f'plan_{args.gpu}', config, points + estimates, args.results_dir)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(POINTS), choices=list(POINTS))
    parser.add_argument("--preset", help="model preset (default: small on CPU, llada-8b for --gpu's engine case)")
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    gpu = parser.add_argument_group("time on a GPU (planner estimates, no GPU needed)")
    gpu.add_argument("--gpu", help="plan for this GPU (dllm_fast.planning.GPUS), e.g. h200")
    gpu.add_argument("--fit", action="store_true", help="fit the calibration on the recorded points")
    gpu.add_argument("--points", nargs="+", metavar="NAME", help="only these recorded points")
    gpu.add_argument("--json", action="store_true", help="print JSON instead of tables")
    engine = parser.add_argument_group("bench_elbo's case (with --gpu): the engine's predicted ms per sample")
    engine.add_argument("--provider", "--providers", nargs="+", choices=["naive", "two_pass"],
                        help="naive and/or two_pass (bench_elbo's providers)")
    engine.add_argument("--nt", type=int, nargs="+", default=[16], help="MC samples per sequence (default 16)")
    engine.add_argument("--micro-batch", type=int, default=1, help="(sequence, sample) pairs per streamed graph")
    engine.add_argument("--prompt", type=int, default=200, help="prompt length (default 200)")
    engine.add_argument("--completion", type=int, default=512, help="completion length (default 512)")
    engine.add_argument("--sequences", type=int, default=1, help="sequences N (default 1)")
    engine.add_argument("--lora", action="store_true", help="train LoRA adapters (q,k,v,up) instead of all weights")
    engine.add_argument("--lora-rank", type=int, default=128)
    add_results_dir_argument(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.gpu:
        gpu_main(args)
        return
    rows = []
    for case in args.cases:
        point = dict(POINTS[case], case=case, preset=args.preset or "small", device="cpu", seed=0)
        row = dict(case=case) | planned(point) | measured(point)
        row["peak_ratio"] = row["planned_peak_mib"] / row["measured_peak_mib"]
        if "measured_saved_mib" in row:
            row["saved_ratio"] = row["planned_saved_mib"] / row["measured_saved_mib"]
        if "analytic_flops" in row:
            row["flops_ratio"] = row["planned_flops"] / row["analytic_flops"]
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        rows.append(row)
    print_table(rows, ["case", "planned_peak_mib", "measured_peak_mib", "peak_ratio", "planned_saved_mib",
                       "measured_saved_mib", "saved_ratio", "planned_flops", "analytic_flops", "flops_ratio"])
    config = dict(preset=args.preset or "small", dtype="float32", points=POINTS, malloc=MALLOC)
    print(f"wrote {write_results('plan_cpu', config, rows, args.results_dir)}")


if __name__ == "__main__":
    main()
