"""The planner against measurement, on CPU at small shapes: what `python -m dllm_fast plan` predicts for a call,
next to what the benchmarks measure for the same call.

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
"""

from __future__ import annotations

import argparse
import functools
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(POINTS), choices=list(POINTS))
    parser.add_argument("--preset", default="small")
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    add_results_dir_argument(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for case in args.cases:
        point = dict(POINTS[case], case=case, preset=args.preset, device="cpu", seed=0)
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
    config = dict(preset=args.preset, dtype="float32", points=POINTS, malloc=MALLOC)
    print(f"wrote {write_results('plan_cpu', config, rows, args.results_dir)}")


if __name__ == "__main__":
    main()
