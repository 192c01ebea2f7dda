"""The planner on N GPUs under torchrun (dllm_fast/planning/parallel.py): one rank's share of the prompts, FSDP2's
shards plus the units it holds unsharded, DDP's buckets, and the collectives' time. Tiny presets."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest

from dllm_fast.planning.accounting import Target
from dllm_fast.planning.gpus import GPUS
from dllm_fast.planning.parallel import layout
from dllm_fast.planning.planner import plan_step
from dllm_fast.planning.step import Session
from dllm_fast.train.config import TrainConfig

SHARDED = ("parameters", "gradients", "optimizer_state")


def config(**overrides) -> TrainConfig:
    values = dict(model="tiny", prompts_per_step=4, group_size=2, gen_length=8, block_length=8, diffusion_steps=4,
                  micro_batch=8, objective="vrpo_ol", objective_options={"n_t": 2}, bf16=False, parallel="fsdp2")
    return TrainConfig(**{**values, **overrides})


def plan(world: int, **overrides):
    return plan_step(config(**overrides), gpu="h200", prompt_length=8, search=False, world=world)


@functools.cache
def planned(world: int, prompts: int = 4, parallel: str = "fsdp2"):
    """The plan of one GPU of `world` for a step of `prompts` prompts (cached: the tests share them)."""
    return plan(world, prompts_per_step=prompts, parallel=parallel)


def share(world: int):
    """One process's plan of a rank's share of the prompts: what a rank of `world` runs, unsharded."""
    return planned(1, 4 // world)


WORLDS = [2, pytest.param(4, marks=pytest.mark.slow)]  # N = 4 plans twice more (about 3 s)


@pytest.fixture(scope="module")
def shape():
    return layout(Session(config(), target=Target("cuda", GPUS["h200"])))


def sharded_as_fsdp2(phase, single, shape, world: int) -> dict[str, int]:
    """The expected parameters, gradients and optimizer state of one GPU at a phase's peak (parallel.py's model)."""
    held = shape.root + 2 * shape.unit if phase.forwards else 0
    grads = shape.root_trained + 2 * shape.unit_trained if phase.grad_forwards else 0
    return {"parameters": single["parameters"] - shape.parameters + -(-shape.parameters // world) + held,
            "gradients": -(-single["gradients"] // world) + grads,
            "optimizer_state": -(-single["optimizer_state"] // world)}


@pytest.mark.parametrize("world", WORLDS)
def test_fsdp2_shards_parameters_gradients_and_optimizer_state(world, shape):
    """At each phase's peak: the policy's parameters, gradients and AdamW state at 1/N of the rank's step on one
    process, plus the root's unit and two of the largest layer units where the policy runs (and their gradients
    in a backward); parameters and optimizer state at 1/N of one process's whole step (they do not depend on the
    prompts)."""
    for name, phase in planned(world).phases.items():
        if not phase.runs:
            continue
        assert phase.grad_forwards <= phase.runs  # one backward per update here: gradients sharded
        single = share(world).phases[name]
        expected = sharded_as_fsdp2(phase, single.memory, shape, world)
        assert {c: phase.memory[c] for c in SHARDED} == expected
        assert phase.memory["optimizer_state"] == -(-planned(1).phases[name].memory["optimizer_state"] // world)
        assert phase.peak - sum(phase.memory.values()) == single.peak - sum(single.memory.values())
        others = set(phase.memory) - set(SHARDED) - ({"temporaries"} if name == "optimizer step" else set())
        assert all(phase.memory[c] == single.memory[c] for c in others)
    assert 0 < shape.unit < shape.parameters and shape.root > 0
    assert planned(world).phases["inner update"].grad_forwards == 1
    assert planned(world).peak < planned(1).peak


def test_fsdp2_gradients_stay_whole_when_an_update_accumulates(shape):
    """Several backwards in one update accumulate unsharded gradients (set_requires_gradient_sync(False))."""
    several, single = plan(2, micro_batch=2), plan(1, prompts_per_step=2, micro_batch=2)
    update = several.phases["inner update"]
    assert update.grad_forwards > update.runs
    assert update.memory["gradients"] == single.phases["inner update"].memory["gradients"]
    assert update.memory["optimizer_state"] == -(-single.phases["inner update"].memory["optimizer_state"] // 2)


@pytest.mark.parametrize("world", WORLDS)
def test_rank_plans_its_share_of_the_prompts(world):
    """Each rank rolls out prompts_per_step / N prompts: the rollout's FLOPs are 1/N of one GPU's."""
    many, one = planned(world), planned(1)
    assert many.phases["rollout"].costs.flops == pytest.approx(one.phases["rollout"].costs.flops / world, rel=0.02)
    assert many.shapes["rollouts"] == one.shapes["rollouts"] // world
    assert many.world == world and many.parallel == "fsdp2" and many.config.run.prompts_per_step == 4


def test_communication_counts_every_forward_and_is_none_on_one_gpu(shape):
    """FSDP2 all-gathers the weights for every call of the policy (each denoising step of the rollout) and every
    backward; one GPU communicates nothing."""
    plans = {1: planned(1), 2: planned(2)}
    assert plans[1].communication == {} and plans[1].world == 1
    rollout = plans[2].phases["rollout"]
    assert rollout.forwards == 4 and rollout.grad_forwards == 0  # 4 denoising steps, no cache
    seconds = plans[2].communication["rollout"]
    assert seconds == pytest.approx(4 * shape.parameters / 2 / 360e9)
    assert plans[2].communication["inner update"] > 0
    assert all(p.costs.seconds >= plans[2].communication.get(name, 0) for name, p in plans[2].phases.items() if p.runs)


def test_ddp_keeps_whole_replicas_and_adds_the_buckets(shape):
    """DDP: every rank holds the whole model; the reducer's buckets copy every trained gradient; one all-reduce
    of the gradients per optimizer step, in the update."""
    ddp = planned(2, parallel="ddp")
    one = share(2)
    for name, phase in ddp.phases.items():
        if phase.runs:
            assert phase.memory["parameters"] == one.phases[name].memory["parameters"]
            assert phase.memory["gradients"] == one.phases[name].memory["gradients"] + shape.trained
    assert set(ddp.communication) == {n for n, p in ddp.phases.items() if p.runs}
    assert ddp.communication["inner update"] == pytest.approx(2 * 0.5 * shape.trained / 360e9)
    assert ddp.communication["rollout"] == 0


@pytest.mark.parametrize("arguments, message", [
    (["--prompts-per-step", "3", "--gpus", "2"], "--prompts-per-step 3 must be a multiple of --gpus 2"),
    (["--gpus", "0"], "--gpus '0' must be a whole number of GPUs"),
])
def test_refusals_name_the_flag(arguments, message, capsys):
    from dllm_fast.planning import cli

    with pytest.raises(SystemExit) as exit:
        cli.main(["--model", "tiny", "--parallel", "fsdp2", *arguments])
    assert exit.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_llada2_flash_full_fine_tune_plans_on_eight_h200s_with_fsdp2():
    """Issue 39: the planner plans a llada2-flash full fine-tune on 8 H200s with FSDP2 (memory per GPU, step time),
    labelled as estimates (about 15 s of CPU)."""
    import json

    result = subprocess.run([sys.executable, "-m", "dllm_fast", "plan", "--model", "llada2-flash", "--parallel",
                             "fsdp2", "--gpus", "8", "--gpu", "h200", "--prompts-per-step", "8", "--group-size", "8",
                             "--gen-length", "256", "--block-length", "32", "--diffusion-steps", "256", "--cache",
                             "block", "--micro-batch", "8", "--gradient-checkpointing", "true", "--search", "false",
                             "--json"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["world"] == 8 and plan["parallel"] == "fsdp2" and plan["label"].startswith("PLANNER ESTIMATE")
    assert plan["peak_bytes"] > 0 and plan["fits"] in (True, False) and plan["step_seconds"] > 0
    assert plan["shapes"]["rollouts"] == 8 and plan["communication_seconds"]["rollout"] > 0
    assert "per GPU of 8, FSDP2" in plan["summary"]
