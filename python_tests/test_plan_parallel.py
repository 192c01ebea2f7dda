"""The planner on N GPUs under torchrun (dllm_fast/planning/parallel.py): one GPU's memory by category and its
collectives per phase, against hand counts on a hand-made layout (FSDP2's shards, units held unsharded, the
gather-once copy, expert parallelism's all-to-alls, links inside and across nodes, offload, what would fit), the
model calls a real plan counts (tiny presets), DDP's buckets, and the refusals, named."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from dllm_fast.planning.accounting import CATEGORIES, Costs
from dllm_fast.planning.gpus import GPUS, LATENCY
from dllm_fast.planning.layout import Elements, Layout, ParallelSettings
from dllm_fast.planning.parallel import Sizes, layout, per_gpu
from dllm_fast.planning.planner import plan_step
from dllm_fast.planning.step import MODEL_CALLS, PhasePlan
from dllm_fast.train.config import TrainConfig
from dllm_fast.train.rollout_rule import ROLLOUT_MARGIN

H200 = GPUS["h200"]
NVLINK, NETWORK = H200.interconnect, H200.internode
# fp32 master weights, bf16 frozen ones, FSDP2's bf16 gathers and fp32 reductions, bf16 activations
SIZES = Sizes(trained=4, frozen=2, gather=2, reduce=4, activation=2, session_trained=2)


def dense_layout(**overrides) -> Layout:
    """A full fine-tune of 1,000 dense elements: a root of 200 (embedding, head), two layer units of 400, a
    reference copy of the same shape, 64 bytes of buffers."""
    values = dict(trained=Elements(1000), frozen=Elements(), root_trained=Elements(200), root_frozen=Elements(),
                  unit_trained=Elements(400), unit_frozen=Elements(), reference=Elements(1000),
                  reference_root=Elements(200), reference_unit=Elements(400), copy=Elements(1000), buffers=64,
                  units=3)
    return Layout(**{**values, **overrides})


def moe_layout() -> Layout:
    """The same with a rank's own routed experts: 800 elements, 400 in each layer unit, in 2 MoE layers (top-2 of
    width 8)."""
    return dense_layout(trained=Elements(1000, 800), unit_trained=Elements(400, 400), reference=Elements(),
                        reference_root=Elements(), reference_unit=Elements(), copy=Elements(1000, 800), moe_layers=2,
                        top_k=2, hidden=8)


def phase(name: str, *, calls: dict | None = None, seconds: float = 1.0, gradients: int = 0,
          optimizer: int = 10, temporaries: int = 0) -> PhasePlan:
    """A rank's phase as a plan leaves it: its memory at the peak (activations 100, KV cache 10), its settled
    time and its model calls."""
    memory = dict.fromkeys(CATEGORIES, 0)
    memory.update(parameters=9999, gradients=gradients, optimizer_state=optimizer, activations=100, kv_cache=10,
                  temporaries=temporaries)
    costs = Costs(closed=seconds, synced=True)
    return PhasePlan(name, runs=1, peak=sum(memory.values()), memory=memory, costs=costs,
                     model_calls={**dict.fromkeys(MODEL_CALLS, 0), **(calls or {})})


def step(rollout_calls=4, rollout_tokens=64, grad_calls=1, grad_tokens=32, reference_calls=0) -> dict:
    phases = {"rollout": phase("rollout", calls={"policy": rollout_calls, "policy_tokens": rollout_tokens})}
    phases["old-policy scoring"] = PhasePlan("old-policy scoring")
    phases["reference scoring"] = (phase("reference scoring", calls={"reference": reference_calls,
                                                                     "reference_tokens": 16 * reference_calls})
                                   if reference_calls else PhasePlan("reference scoring"))
    phases["inner update"] = phase("inner update", gradients=5,
                                   calls={"policy_grad": grad_calls, "policy_grad_tokens": grad_tokens})
    phases["optimizer step"] = phase("optimizer step", gradients=5, temporaries=400, seconds=0.5)
    return phases


def run(shape: Layout, gpu=H200, sizes: Sizes = SIZES, checkpointing: bool = False, **settings):
    phases = step(reference_calls=2 if shape.reference.total else 0)
    out = per_gpu(phases, shape, ParallelSettings(parallel="fsdp2", **{"world": 4, **settings}), gpu, sizes,
                  checkpointing=checkpointing)
    return phases, out


def test_fsdp2_memory_by_category_against_hand_counts():
    """4 GPUs, the copy gathered and kept: shards at 1/4 in their stored dtypes (fp32 trained, bf16 reference),
    the copy (1,000 x 2 bytes) beside them, the root and two units unsharded in bf16 where a model runs on
    per-layer gathers, and in a backward their gradients in fp32; AdamW's moments at 2 x the shard."""
    phases, out = run(dense_layout())
    shards = 64 + 250 * 4 + 250 * 2  # buffers, the policy's fp32 shards, the reference's bf16 shards
    assert out.rollout_path == "gathered" and out.copy_kept and out.copy_bytes == 2000
    assert phases["rollout"].memory == dict(parameters=shards + 2000, gradients=0, optimizer_state=2000,
                                            activations=100, kv_cache=10, temporaries=0)
    assert phases["reference scoring"].memory["parameters"] == shards + (200 + 2 * 400) * 2 + 2000
    update = phases["inner update"].memory
    assert update["parameters"] == shards + (200 + 2 * 400) * 2 + 2000
    assert update["gradients"] == 250 * 4 + (200 + 2 * 400) * 4  # the shards, and the units in flight in fp32
    assert update["optimizer_state"] == 2000
    # AdamW's foreach temporaries, planned on 1,000 bf16 weights: at the 1,000 fp32 bytes of the shards
    assert phases["optimizer step"].memory["temporaries"] == round(400 * 1000 / 2000)
    for p in phases.values():
        if p.runs:
            assert p.peak == sum(p.memory.values())


def test_collectives_per_phase_against_hand_counts():
    """The copy: one all-gather of each of the 3 units, 3/4 of its 2,000 bytes, not hidden; the update's
    backward: each layer unit gathered for its forward and again for its backward, the root once, and one
    reduce-scatter a unit of the fp32 gradients; the reference: its layers at each of its 2 calls, its root once.
    A phase takes max(compute, prefetched collectives) + the rest."""
    phases, out = run(dense_layout())
    rollout = out.collectives["rollout"]
    assert (rollout.all_gathers, rollout.all_gather_bytes) == (3, 1500)
    assert rollout.exposed == pytest.approx(1500 / NVLINK + 3 * LATENCY["intra"]) and rollout.overlapped == 0
    assert phases["rollout"].costs.seconds == pytest.approx(1.0 + rollout.exposed)
    update = out.collectives["inner update"]
    assert update.all_gathers == 2 * 2 + 1
    assert update.all_gather_bytes == pytest.approx(0.75 * (2 * 800 * 2 + 200 * 2))
    assert (update.reduce_scatters, update.reduce_scatter_bytes) == (3, 0.75 * 1000 * 4)
    assert update.overlapped == pytest.approx((0.75 * 3600 + 0.75 * 4000) / NVLINK + 8 * LATENCY["intra"])
    assert phases["inner update"].costs.seconds == pytest.approx(1.0)  # hidden behind the second of compute
    reference = out.collectives["reference scoring"]
    assert (reference.all_gathers, reference.all_gather_bytes) == (2 * 2 + 1, 0.75 * (2 * 800 * 2 + 200 * 2))
    assert out.rollout_communication_share == pytest.approx(rollout.seconds / phases["rollout"].costs.seconds)


def test_per_forward_path_when_the_copy_does_not_fit():
    """A GPU whose memory the copy would overflow: the rollout runs on per-layer gathers (its layers' units at
    every forward, the root once), holding the root and two units; the reason says so."""
    shape = dense_layout()
    roomy_phases, roomy = run(shape)
    small = dataclasses.replace(H200, memory=int(roomy_phases["rollout"].peak / ROLLOUT_MARGIN) - 1)
    phases, out = run(shape, gpu=small)
    assert out.rollout_path == "sharded" and "would be" in out.rollout_reason and not out.copy_kept
    rollout = out.collectives["rollout"]
    assert (rollout.all_gathers, rollout.exposed) == (4 * 2 + 1, 0.0)
    assert rollout.all_gather_bytes == pytest.approx(0.75 * (4 * 800 * 2 + 200 * 2))
    assert phases["rollout"].memory["parameters"] == 64 + 1500 + 1000 * 2
    assert roomy.rollout_path == "gathered"
    forced = run(shape, rollout_weights="sharded")[1]
    assert forced.rollout_path == "sharded" and forced.rollout_reason == "--rollout-weights sharded"


def test_expert_parallel_shards_experts_by_group_and_counts_all_to_alls():
    """EP 2 of 4 ranks: a rank's 800 expert elements sharded over its 2 expert replicas, the dense ones over all 4;
    the copy holds both (the experts are shards); each forward's 2 MoE layers dispatch and combine its tokens x
    top-2 x width 8 in bf16, half of it off the rank; a backward with checkpointing runs them 3 times."""
    phases, out = run(moe_layout(), expert_parallel=2, checkpointing=True)
    assert phases["rollout"].memory["optimizer_state"] == 2 * (250 + 400) * 4
    assert out.copy_bytes == (1000 + 800) * 2
    rollout = out.collectives["rollout"]
    assert rollout.all_to_alls == 4 * 2 * 2 and rollout.all_to_all_bytes == 64 * 2 * 8 * 2 * 0.5 * 2 * 2
    assert rollout.all_gathers == 3 * 2  # each unit's dense part over 4 ranks, its experts over their 2 shards
    assert rollout.all_gather_bytes == pytest.approx(0.75 * 2000 + 0.5 * 1600)
    update = out.collectives["inner update"]
    assert update.all_to_alls == 1 * 2 * 6 and update.all_to_all_bytes == 32 * 2 * 8 * 2 * 0.5 * 2 * 6
    assert update.exposed == pytest.approx(update.all_to_all_bytes / NVLINK + 12 * LATENCY["intra"])


def test_expert_group_of_the_whole_world_keeps_experts_whole_and_shared():
    """EP 4 of 4: the experts are whole on their rank (not sharded, not in the copy, not gathered); fp32 trained
    experts are cast to bf16 at every forward (time, and one layer's cast at a time)."""
    phases, out = run(moe_layout(), expert_parallel=4)
    assert out.copy_bytes == 1000 * 2
    assert phases["rollout"].memory["optimizer_state"] == 2 * (250 + 800) * 4
    assert out.collectives["rollout"].all_gathers == 3
    assert phases["rollout"].memory["temporaries"] == 800 // 2 * 2
    assert out.collectives["rollout"].exposed > out.collectives["rollout"].all_to_all_bytes / NVLINK


def test_collectives_across_nodes_run_at_the_network_bandwidth():
    """16 GPUs in 2 nodes of 8: FSDP2's groups span the nodes, so their bytes go at the network's 40 GB/s a GPU
    and its latency; an expert group inside a node keeps its all-to-alls on NVLink."""
    _, out = run(dense_layout(), world=16)
    rollout = out.collectives["rollout"]
    assert rollout.exposed == pytest.approx(2000 * 15 / 16 / NETWORK + 3 * LATENCY["inter"])
    _, moe = run(moe_layout(), world=16, expert_parallel=8)
    update = moe.collectives["inner update"]
    assert update.exposed == pytest.approx(update.all_to_all_bytes / NVLINK + update.all_to_alls * LATENCY["intra"])
    assert "across nodes 40 GB/s" in " ".join(moe.notes)
    slow = run(dense_layout(), world=16, inter_node_bandwidth=10e9)[1]
    assert slow.collectives["rollout"].exposed == pytest.approx(2000 * 15 / 16 / 10e9 + 3 * LATENCY["inter"])


def test_offload_moves_the_states_to_the_host():
    """--fsdp-offload true: no shards, gradients' shards or AdamW state on the GPU; every unshard copies the
    shards in, every backward's gradients out; AdamW streams 28 bytes a trained element through the host's memory,
    shared by the node's ranks."""
    phases, out = run(dense_layout(), fsdp_offload=True)
    assert phases["rollout"].memory["parameters"] == 64 + 2000 and phases["rollout"].memory["optimizer_state"] == 0
    assert phases["inner update"].memory["gradients"] == (200 + 2 * 400) * 4
    assert phases["optimizer step"].memory["temporaries"] == 0
    optimizer = out.collectives["optimizer step"]
    assert optimizer.exposed == pytest.approx(250 * 28 / (300e9 / 4))
    assert phases["optimizer step"].costs.seconds == pytest.approx(optimizer.exposed)
    assert out.collectives["rollout"].host_bytes == 250 * 4 and out.host_bytes == 250 * 4 * 4 + 250 * 2


def test_what_would_fit_when_nothing_does():
    """A GPU too small for the step: the peaks with bf16 states, with offload, with both, and with the reference's
    shards on the host, from this plan's categories."""
    shape = dense_layout()
    tiny = dataclasses.replace(H200, memory=4000)
    phases, out = run(shape, gpu=tiny)
    peak = max(p.peak for p in phases.values() if p.runs)
    assert peak > 4000
    assert set(out.alternatives) == {"--weights-dtype bfloat16", "--fsdp-offload true",
                                     "--weights-dtype bfloat16 --fsdp-offload true", "--reference-offload true"}
    assert out.alternatives["--fsdp-offload true"] < peak
    assert out.alternatives["--reference-offload true"] == peak - 1000 // 4 * 2  # the reference's bf16 shard
    assert out.alternatives["--weights-dtype bfloat16 --fsdp-offload true"] <= out.alternatives["--fsdp-offload true"]


def test_ddp_keeps_whole_replicas_and_adds_the_buckets():
    """DDP: every rank holds the whole model; the reducer's buckets copy every trained gradient; one all-reduce
    of the gradients per optimizer step, in the update."""
    phases = step()
    out = per_gpu(phases, dense_layout(), ParallelSettings(world=2, parallel="ddp"), H200, SIZES)
    assert phases["inner update"].memory["gradients"] == 5 + 4000
    assert phases["rollout"].memory["parameters"] == 9999
    assert out.collectives["inner update"].all_reduce_bytes == 2 * 0.5 * 4000
    assert out.communication["rollout"] == 0


def test_ddp_with_expert_parallelism_prices_what_train_runs():
    """DDP with expert groups of 2 on 4 ranks (train/expert_parallel.py: DDP ignores the routed experts): the
    buckets and the update's all-reduce hold the 1,000 dense trained elements only, the optimizer step all-reduces
    the rank's 800 expert elements over their 2 replicas, and every forward's MoE layers run the all-to-alls of
    FSDP2's plan; an expert group spanning two nodes runs them at the network's bandwidth."""
    phases = step()
    out = per_gpu(phases, moe_layout(), ParallelSettings(world=4, parallel="ddp", expert_parallel=2), H200, SIZES)
    assert phases["inner update"].memory["gradients"] == 5 + 1000 * 4
    assert out.collectives["inner update"].all_reduce_bytes == 2 * 0.75 * 4000
    optimizer = out.collectives["optimizer step"]
    assert (optimizer.all_reduces, optimizer.all_reduce_bytes) == (1, 2 * 0.5 * 3200)
    fsdp = run(moe_layout(), expert_parallel=2)[1]
    for name in ("rollout", "inner update"):
        ddp_moves, fsdp_moves = out.collectives[name], fsdp.collectives[name]
        assert (ddp_moves.all_to_alls, ddp_moves.all_to_all_bytes) == (fsdp_moves.all_to_alls,
                                                                       fsdp_moves.all_to_all_bytes) != (0, 0)
    assert "DDP ignores them" in out.notes[0]
    wide = per_gpu(step(), moe_layout(), ParallelSettings(world=16, parallel="ddp", expert_parallel=16), H200, SIZES)
    update = wide.collectives["inner update"]
    assert update.exposed == pytest.approx(update.all_to_all_bytes / NETWORK + update.all_to_alls * LATENCY["inter"])


@pytest.mark.parametrize("settings, message", [
    (dict(world=2, parallel="ddp", fsdp_offload=True), "--fsdp-offload true plans FSDP2 on several GPUs"),
    (dict(world=4, parallel="fsdp2", expert_parallel=3), "--expert-parallel 3 must divide --gpus 4"),
    (dict(world=1, parallel="ddp", expert_parallel=2), "--expert-parallel 2 must divide --gpus 1"),
    (dict(world=12, parallel="fsdp2"), "--gpus 12 is not a whole number of nodes of --gpus-per-node 8"),
    (dict(world=1, parallel="fsdp2", fsdp_offload=True), "--fsdp-offload true plans FSDP2 on several GPUs"),
    (dict(world=2, parallel="fsdp2", inter_node_bandwidth=0.0), "--inter-node-bandwidth 0.0 must be a positive"),
    (dict(world=2, parallel="fsdp2", rollout_weights="once"), "--rollout-weights 'once' is not one of"),
])
def test_settings_refusals_name_the_flag(settings, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ParallelSettings(**settings)


def test_unknown_network_bandwidth_is_refused_across_nodes():
    pcie = GPUS["h100-pcie"]
    with pytest.raises(ValueError, match="give --inter-node-bandwidth"):
        per_gpu(step(), dense_layout(), ParallelSettings(world=16, parallel="fsdp2"), pcie, SIZES)


# -- real plans of tiny presets -----------------------------------------------------------------------------

def config(**overrides) -> TrainConfig:
    values = dict(model="tiny", prompts_per_step=4, group_size=2, gen_length=8, block_length=8, diffusion_steps=4,
                  micro_batch=8, objective="vrpo_ol", objective_options={"n_t": 2}, parallel="fsdp2")
    return TrainConfig(**{**values, **overrides})


def planned(world: int):
    return plan_step(config(), gpu="h200", prompt_length=8, search=False, world=world)


@pytest.mark.slow  # several planned steps, about 10 s on 2 cores
def test_a_rank_plans_its_share_and_counts_its_model_calls():
    """2 GPUs of a 4-prompt step: each rank rolls out 2 prompts x G = 2 rows (4 denoising forwards of 16 tokens
    each), on bf16 weights (FSDP2's gathers); its update is one backward; the per-GPU shards are the tiny model's
    parameters (counted here by name) over 2."""
    plan = planned(2)
    calls = plan.phases["rollout"].model_calls
    assert calls["policy"] == 4 and calls["policy_tokens"] == 4 * 4 * 16
    update = plan.phases["inner update"].model_calls
    assert update["policy_grad"] == 1 and update["policy_grad_tokens"] == 2 * 4 * 16  # n_t 2 x 4 rows, one pass
    assert plan.shapes["rollouts"] == 4 and plan.world == 2 and plan.config.run.prompts_per_step == 4
    from dllm_fast.models import LLaDAConfig, LLaDAModel

    model = LLaDAModel(LLaDAConfig.preset("tiny"))
    total = sum(p.numel() for p in model.parameters())
    blocks = sum(p.numel() for name, p in model.named_parameters() if name.startswith("transformer.blocks."))
    largest = max(sum(p.numel() for p in block.parameters()) for block in model.transformer["blocks"])
    shape = plan_layout()
    assert shape.trained == Elements(total) and shape.root_trained == Elements(total - blocks)
    assert shape.unit_trained == Elements(largest) and shape.units == len(model.transformer["blocks"]) + 1
    assert plan.parallel_plan.rollout_path == "gathered" and plan.parallel_plan.copy_bytes == total * 2
    assert plan.phases["rollout"].memory["optimizer_state"] == 2 * -(-total // 2) * 4


@functools.cache
def plan_layout() -> Layout:
    from dllm_fast.planning.accounting import Target
    from dllm_fast.planning.step import Session

    return layout(Session(config(), target=Target("cuda", H200)))


@pytest.mark.parametrize("arguments, message", [
    (["--prompts-per-step", "3", "--gpus", "2"], "--prompts-per-step 3 must be a multiple of --gpus 2"),
    (["--gpus", "0"], "--gpus '0' must be a whole number of GPUs"),
    (["--gpus", "2", "--expert-parallel", "2"], "--expert-parallel 2: the model has no routed experts"),
    (["--gpus", "2", "--gpus-per-node", "0"], "--gpus-per-node '0' must be a whole number"),
    (["--gpus", "2", "--intra-node-bandwidth", "-1"], "--intra-node-bandwidth '-1' must be a positive bandwidth"),
])
def test_cli_refusals_name_the_flag(arguments, message, capsys):
    from dllm_fast.planning import cli

    with pytest.raises(SystemExit) as exit:
        cli.main(["--model", "tiny", "--parallel", "fsdp2", "--prompt-length", "8", *arguments])
    assert exit.value.code in (1, 2) and message in capsys.readouterr().err


@pytest.mark.slow
def test_expert_parallel_rank_plans_its_own_experts():
    """llada2-tiny (16 experts, top-4) on 2 GPUs with --expert-parallel 2: the rank's model holds 8 experts a
    MoE layer; its rollout's all-to-alls are 2 a MoE layer a forward, of its tokens x top-4 x width 64 in bf16."""
    plan = plan_step(config(model="llada2-tiny", block_length=4), gpu="h200", prompt_length=8, search=False,
                     parallel=ParallelSettings(world=2, parallel="fsdp2", expert_parallel=2))
    from dllm_fast.models.llada2 import LLaDA2Model

    reference = LLaDA2Model.preset_config("llada2-tiny")
    moe_layers = sum(reference.is_moe_layer(i) for i in range(reference.num_hidden_layers))
    rollout = plan.phases["rollout"]
    tokens = rollout.model_calls["policy_tokens"]
    c = plan.parallel_plan.collectives["rollout"]
    assert c.all_to_alls == rollout.model_calls["policy"] * moe_layers * 2
    assert c.all_to_all_bytes == pytest.approx(tokens * 4 * 64 * 2 * 0.5 * moe_layers * 2)
    assert plan.parallel_plan.copy_bytes > 0 and "its E/2" in " ".join(plan.notes)
