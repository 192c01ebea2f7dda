"""The planner at extreme sizes (issue 45 item 2): a micro-batch above the step's pairs plans as the pairs do, and
an op on the step's real data whose output no constant may hold (a [B, L, L] block-causal mask of long prompts)
is computed fake, never allocated on the host."""

from __future__ import annotations

import pytest
import torch

from dllm_fast.planning.fake import DEFAULT_CONSTANT_BYTES, PlanningFakeMode, fake_world, is_constant
from dllm_fast.train.config import TrainConfig, micro_batching


def peak_rss_after(run) -> int:
    """Bytes the process's resident memory peaked above where it was, while `run()` ran (Linux: VmHWM, reset
    through /proc/self/clear_refs)."""

    def status(key: str) -> int:
        with open("/proc/self/status") as lines:
            return next(int(line.split()[1]) << 10 for line in lines if line.startswith(key))

    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    before = status("VmRSS")
    run()
    return status("VmHWM") - before


L = 8200  # a [8, L, L] bool is 538 MB, above the 256 MB a constant may hold


# Ops on the step's small real data whose outputs are device-scale: the block-causal mask's kinds of op.
LARGE_FROM_SMALL = {
    "broadcast and": lambda keep, columns: keep[:, None, :] & keep[:, :, None],
    "outer comparison": lambda keep, columns: columns[None, :] <= columns[:, None],
    "broadcast sum": lambda keep, columns: keep.to(torch.int8)[:, None, :] + keep.to(torch.int8)[:, :, None],
    "expanded copy": lambda keep, columns: keep[:, None, :].expand(8, L, L).contiguous(),
    "repeat": lambda keep, columns: keep.repeat(1, L),
    "where": lambda keep, columns: torch.where(keep[:, None, :] & keep[:, :, None], 1, 0).to(torch.bool),
}


@pytest.mark.skipif(not open("/proc/self/status").read().count("VmHWM"), reason="needs Linux's /proc")
@pytest.mark.parametrize("shortcut", [True, False], ids=["shortcuts", "fake_mode_path"])
@pytest.mark.parametrize("name", LARGE_FROM_SMALL)
def test_an_op_on_real_data_too_large_for_a_constant_is_never_computed(name, shortcut):
    """It used to be computed on the values first (and then found too large to keep): a real [64, 32064, 32064]
    mask, the CPU allocator's error, and minutes for --prompt-length 8000. Now its shape is known first: the
    output is fake, and nothing device-sized is allocated."""
    mode = PlanningFakeMode(shortcut_constants=shortcut)
    with fake_world(mode):
        keep = torch.ones(8, L, dtype=torch.bool)
        columns = torch.arange(3 * L)  # [3L, 3L] is 605 MB
        assert is_constant(keep) and is_constant(columns)
        out = []
        grown = peak_rss_after(lambda: out.append(LARGE_FROM_SMALL[name](keep, columns)))
    assert out[0].numel() * out[0].element_size() > DEFAULT_CONSTANT_BYTES
    assert not is_constant(out[0])
    assert grown < 64 << 20, f"{name} allocated {grown >> 20} MiB on the host"


@pytest.mark.parametrize("name", LARGE_FROM_SMALL)
def test_the_same_ops_on_small_data_stay_real(name):
    """The guard of the guard: below the constant limit the step's data stays real (its values steer the step)."""
    mode = PlanningFakeMode(constant_bytes=DEFAULT_CONSTANT_BYTES)
    small = {"expanded copy": lambda keep, columns: keep[:, None, :].expand(8, 64, 64).contiguous(),
             "repeat": lambda keep, columns: keep.repeat(1, 64)}
    op = small.get(name, LARGE_FROM_SMALL[name])
    expected = op(torch.ones(8, 64, dtype=torch.bool), torch.arange(64))
    with fake_world(mode):
        out = op(torch.ones(8, 64, dtype=torch.bool), torch.arange(64))
        assert is_constant(out)
    assert torch.equal(out.constant, expected)


def tiny_config(**overrides) -> TrainConfig:
    values = dict(model="tiny", prompts_per_step=2, group_size=4, gen_length=16, block_length=8, diffusion_steps=4,
                  micro_batch=4, objective="vrpo_ol", bf16=False)
    return TrainConfig(**{**values, **overrides})


@pytest.mark.parametrize("objective, options, pairs", [
    ("vrpo_ol", {}, 8 * 4),  # n_t = 4 a sequence, 8 rollouts
    ("bgpo", {"n_t": 16}, 8 * 16),
    ("diffu_grpo", {}, 8 * 1),
    ("tracerl", {}, 8 * 4),  # its samples are the decoding states: at most one a step, 4 steps
    ("justgrpo", {}, 8 * 16),  # one a completion position
    ("vrpo_dpo", {}, 2 * 2 * 4),  # a chosen and a rejected completion a prompt, whatever the group size
])
@pytest.mark.parametrize("asked, score", [(10**5, None), (10**3, 10**5), ("pairs+1", "pairs+7"), (3, 10**4)])
def test_a_micro_batch_above_the_pairs_is_planned_at_the_pairs(objective, options, pairs, asked, score):
    """--micro-batch (and --score-micro-batch) above the step's (sequence, sample) pairs are planned at the pairs,
    as the engine runs them (every pair in one micro-batch); at or below them they are planned as given."""
    from dllm_fast.planning.planner import step_pairs, within_the_pairs

    asked = pairs + 1 if asked == "pairs+1" else asked
    score = pairs + 7 if score == "pairs+7" else score
    config = tiny_config(objective=objective, objective_options=options, micro_batch=asked, score_micro_batch=score)
    assert step_pairs(config) == pairs
    batching = within_the_pairs(config, micro_batching(config, auto=4))
    assert batching.micro_batch == min(asked, pairs)
    assert batching.scoring == min(score if score is not None else asked, pairs)


@pytest.mark.slow
@pytest.mark.parametrize("objective, options, engine", [("vrpo_ol", {}, "streaming"), ("bgpo", {"n_t": 16}, "streaming"),
                                                        ("vrpo_ol", {}, "two_pass")])
@pytest.mark.parametrize("asked", [10**5, "pairs+1"])
def test_a_plan_at_a_micro_batch_above_the_pairs_is_the_plan_at_the_pairs(objective, options, engine, asked):
    """`plan --micro-batch 100000` took 461 s and 8 GB (its probes were planned at 100,000 pairs a micro-batch)
    for numbers that --micro-batch 1000 gave in 17 s. Now the plan is the pairs' plan: the same memory, time and
    work (the same calls run on fake tensors), and a note says it was lowered."""
    from dllm_fast.planning.gpus import GPU
    from dllm_fast.planning.planner import plan_step, step_pairs

    gpu = GPU("roomy", "test GPU", 1e12, 1e12, 1e12, 1e12, 10**12)
    config = tiny_config(objective=objective, objective_options=options)
    pairs = step_pairs(config)
    asked = pairs + 1 if asked == "pairs+1" else asked
    plans = [plan_step(tiny_config(objective=objective, objective_options=options, micro_batch=m), gpu=gpu,
                       prompt_length=8, engine=engine, search=False) for m in (pairs, asked)]
    at_pairs, above = plans
    assert above.shapes == at_pairs.shapes and above.shapes["micro_batch"] == pairs
    assert above.peak == at_pairs.peak and above.step_seconds == at_pairs.step_seconds
    assert [p.calls_run + p.calls_replayed for p in above.phases.values()] == [
        p.calls_run + p.calls_replayed for p in at_pairs.phases.values()]
    assert any(f"--micro-batch {asked} " in note and f"planned at {pairs}" in note for note in above.notes)
