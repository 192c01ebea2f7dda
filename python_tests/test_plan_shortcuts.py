"""The planner's shortcuts (issue 41 item 5: an 8B plan in a minute) leave every plan as it was: a plan made fast
equals the plan made the slow way (Session(fast=False)) number for number, and each shortcut's key tells apart
what it must (gradients that differ, a launch queue filled differently, ops it may not take). Also the fixes that
came with them: the rollout's KV cache stays fake, and tolist of the step's data is one host read. Tiny presets."""

from __future__ import annotations

import functools

import pytest
import torch

from dllm_fast.likelihood import MicroBatching
from dllm_fast.planning import planner
from dllm_fast.planning.accounting import Target
from dllm_fast.planning.fake import PlanningFakeMode, is_constant
from dllm_fast.planning.gpus import gpu
from dllm_fast.planning.report import as_dict
from dllm_fast.planning.step import PhasePlan, Session
from dllm_fast.train import step as train_step
from dllm_fast.train.config import TrainConfig

H100 = Target("cuda", gpu("h100"))
TINY = dict(prompts_per_step=2, group_size=4, gen_length=16, block_length=8, diffusion_steps=4, micro_batch=4)
# (model, options): a full fine-tune of the LLaDA family with the dual cache and two inner updates (each with
# its optimizer step); a LoRA SDAR with the block cache and gradient checkpointing (replayed calls reach the
# adapters' parameters, and recompute in backward).
SETUPS = {
    "llada full dual mu=2": dict(model="tiny", cache="dual", inner_updates=2, objective="vrpo_ol",
                                 objective_options={"n_t": 8}),
    "sdar lora block": dict(model="sdar-tiny", lora=True, lora_rank=4, block_length=4, diffusion_steps=16,
                            cache="block", gradient_checkpointing=True),
}


def plan_dict(config: TrainConfig, fast: bool, monkeypatch) -> dict:
    with monkeypatch.context() as patch:
        patch.setattr(planner, "Session", functools.partial(Session, fast=fast))
        result = as_dict(planner.plan_step(config, gpu="h100", prompt_length=12))
    result.pop("planning_seconds")
    return result


@pytest.mark.slow  # two whole plans with their searches: about 10 s each on 2 cores
@pytest.mark.parametrize("setup", list(SETUPS))
def test_a_fast_plan_is_the_slow_plan_number_for_number(setup, monkeypatch):
    """The whole plan (every phase's peak and memory by category, FLOPs, bytes, kernels, syncs, seconds, and the
    largest settings the search finds) is the same with the shortcuts as without."""
    config = TrainConfig(**{**TINY, **SETUPS[setup]})
    assert plan_dict(config, True, monkeypatch) == plan_dict(config, False, monkeypatch)


def phase_numbers(phase: PhasePlan) -> tuple:
    c = phase.costs
    return (phase.peak, phase.memory, phase.category_peaks, c.flops, c.bytes, c.kernels, c.syncs, c.seconds,
            c.device_seconds, c.host_seconds)


def optimizer_steps(fast: bool, prepare) -> tuple[list[tuple], Session]:
    """The optimizer-step phases of a tiny LoRA session, each after `prepare(session, k)` set the gradients."""
    config = TrainConfig(model="tiny", lora=True, lora_rank=4, **TINY)
    numbers = []
    with Session(config, target=H100, fast=fast) as s:
        optimization = train_step.Optimization(s.trainable, s.optimizer, config.optim.grad_clip)
        for k in range(3):
            prepare(s, k)
            phase = PhasePlan("optimizer step")
            s.optimizer_step(optimization, phase)
            numbers.append(phase_numbers(phase))
    return numbers, s


def test_an_optimizer_step_replays_only_with_the_same_gradients():
    """A step with every gradient, one with half of them, then every one again: the third replays the first,
    the second is run (its work is smaller); each equals the step run op by op."""
    def prepare(s, k):
        with s.mode.fake_factories():  # gradients made without a kernel: the launch queue is the same each time
            for i, p in enumerate(s.trainable):
                p.grad = torch.empty(p.shape) if k != 1 or i % 2 == 0 else None

    fast, session = optimizer_steps(True, prepare)
    slow, _ = optimizer_steps(False, prepare)
    assert fast == slow
    assert fast[1] != fast[0] and fast[2] == fast[0]
    assert len(session._recorded.records) == 2


def test_an_optimizer_step_replays_only_at_the_same_launch_queue():
    """Launches queued since the last sync decide where the launch queue fills up inside the step (the host then
    waits for the GPU): a step entered with the queue nearly full is not the replay of one entered empty."""
    def prepare(s, k):
        with s.mode.fake_factories():
            for p in s.trainable:
                p.grad = torch.empty(p.shape)
        if k == 1:  # nearly fill the queue with kernels of no consequence
            with s.mode.fake_factories():
                x = torch.empty(8)
            for _ in range(s.target.calibration.launch_queue - 8):
                x = x + 1

    fast, session = optimizer_steps(True, prepare)
    slow, _ = optimizer_steps(False, prepare)
    assert fast == slow
    assert len(session._recorded.records) == 2  # entered with a few launches queued, and nearly full


OPS_ON_CONSTANTS = {
    "arithmetic": lambda a, b: a * 2 + b,
    "comparison": lambda a, b: a > b,
    "gather rows": lambda a, b: a[torch.tensor([2, 0])],
    "view": lambda a, b: a.view(-1),
    "slice": lambda a, b: a[1:, ::2],
    "transpose": lambda a, b: a.t(),
    "expand": lambda a, b: a[:1].expand(5, -1),
    "cat": lambda a, b: torch.cat([a, b]),
    "tuple out": lambda a, b: torch.sort(a, dim=1),
    "nonzero": lambda a, b: (a > 3).nonzero(),
    "reduction": lambda a, b: a.sum(0),
    "to dtype": lambda a, b: a.to(torch.float64),
    "in place": lambda a, b: a.add_(b),
    "random": lambda a, b: torch.bernoulli(a.float() / 10, generator=torch.Generator().manual_seed(0)),
    "beyond the constant limit": lambda a, b: a.reshape(-1)[:1].expand(1 << 20),
    "the input itself": lambda a, b: torch.ops.aten.lift_fresh.default(a),
    "views of a new constant": lambda a, b: (lambda c: (c, c[1:], c.t(), c[1:].unsqueeze(0)))(a * 2),
    "written in place": lambda a, b: (lambda c: (c, c[0], c[1:].add_(b[1:]), c))(a * 2),
    "a fake value written into a view's base": lambda a, b: (lambda c, v: (c.copy_(fake_like(c)), v))(
        *(lambda c: (c, c[0]))(a * 2)),
}


def fake_like(t: torch.Tensor) -> torch.Tensor:
    """A fake tensor of t's shape and dtype that is no constant (a value the model would compute)."""
    with t.fake_mode.fake_factories():
        return torch.empty(t.shape, dtype=t.dtype)


def run_on_constants(shortcut: bool, name: str):
    mode = PlanningFakeMode(shortcut_constants=shortcut, constant_bytes=1 << 12)
    with mode:
        a = torch.arange(12).reshape(3, 4)
        b = torch.ones(3, 4, dtype=torch.long)
        out = OPS_ON_CONSTANTS[name](a, b)
    storages, objects = {}, {}  # which tensor (a, b, then the outputs in order) first had each storage, object
    results = []
    for index, t in enumerate((a, b, *(out if isinstance(out, tuple) else (out,)))):
        owner = storages.setdefault(t.untyped_storage()._cdata, index), objects.setdefault(id(t), index)
        value = t.constant.tolist() if is_constant(t) else None
        results.append((tuple(t.shape), t.stride(), t.dtype, t.storage_offset(), t.untyped_storage().nbytes(),
                        value, owner))
    return results[2:], results[:2]


@pytest.mark.parametrize("name", list(OPS_ON_CONSTANTS))
def test_ops_on_constants_give_fake_tensor_modes_results(name):
    """Each op on constants alone gives, through the shortcut, what FakeTensorMode's own constant propagation
    gives: shapes, strides, dtypes, values, which input's storage a view shares, and what an in-place op leaves;
    a random op or an output over the constant limit is left to FakeTensorMode (no constant out)."""
    fast, slow = run_on_constants(True, name), run_on_constants(False, name)
    assert fast == slow
    values = [value for *_, value, _ in fast[0]]
    if name in ("random", "beyond the constant limit", "a fake value written into a view's base"):
        assert values[-1] is None
    else:
        assert all(value is not None for value in values)


MIXED_OPS = {  # x: a model output (fake, no value); a, b: constants
    "arithmetic": lambda x, a, b: x * a,
    "gather rows": lambda x, a, b: x[b[:, 0]],
    "where": lambda x, a, b: torch.where(a > 5, x, x * 2),
    "masked_fill": lambda x, a, b: x.masked_fill(a > 5, 0),
    "index_put": lambda x, a, b: x.index_put((b[:, 0],), x[:3]),
    "a boolean mask (its count is data)": lambda x, a, b: x[a > 5],
    "repeat counts (data)": lambda x, a, b: x.repeat_interleave(b[:, 0] + 1, dim=0),
    "a view of the output": lambda x, a, b: (lambda y: (y, y[1:]))(x + a),
}


def run_mixed(shortcut: bool, name: str):
    mode = PlanningFakeMode(shortcut_constants=shortcut)
    with mode:
        a = torch.arange(12).reshape(3, 4)
        b = torch.ones(3, 4, dtype=torch.long)
        x = fake_like(a.float())
        out = MIXED_OPS[name](x, a, b)
    storages = {}
    return [(tuple(t.shape), t.stride(), t.dtype, t.storage_offset(), is_constant(t),
             storages.setdefault(t.untyped_storage()._cdata, index))
            for index, t in enumerate((x, a, b, *(out if isinstance(out, tuple) else (out,))))]


@pytest.mark.parametrize("name", list(MIXED_OPS))
def test_ops_on_constants_and_model_outputs_give_fake_tensor_modes_results(name):
    """An op on constants and a model output gives, with the constants' values left out (so that FakeTensorMode's
    cache serves it), what it gives with them; an op that needs the values (a boolean mask) gets them."""
    assert run_mixed(True, name) == run_mixed(False, name)


def test_the_kv_cache_is_fake_not_host_memory():
    """The rollout's KV cache holds model outputs the plan never reads: it stays fake whatever its size (it was
    a real constant under the constant limit, e.g. 89 MB a layer at sdar-8b's 64 rollouts, zeroed on the host)."""
    config = TrainConfig(model="tiny", cache="dual", **TINY)
    with Session(config, target=H100) as s:
        before = s.accountant.memory["kv_cache"]
        cache = s.base.new_cache(4, 32)
        tensors = cache.tensors() + cache.keys + cache.values
        assert not any(is_constant(t) for t in tensors)
        assert s.accountant.memory["kv_cache"] - before == sum(t.numel() * t.element_size() for t in cache.tensors())


def test_tolist_of_the_steps_data_is_one_host_read():
    """tolist of a constant on the device is one copy to the host: one sync and no kernel (it was read element
    by element: a kernel and a sync each), as dllm_fast.testing.syncs counts it; of an empty one, none."""
    config = TrainConfig(model="tiny", **TINY)
    with Session(config, target=H100) as s:
        counts = torch.arange(100) % 7
        phase, value = s.measure("read", counts.tolist)
        assert value == [i % 7 for i in range(100)]
        assert (phase.costs.syncs, phase.costs.kernels, phase.costs.bytes) == (1, 0, 0)
        phase, value = s.measure("read", torch.zeros(0, dtype=torch.long).tolist)
        assert value == [] and phase.costs.syncs == 0


@pytest.mark.slow  # whole replayed steps, about 10 s on 2 cores
def test_replayed_calls_link_parameters_only_while_they_have_no_gradient():
    """With LoRA, a replayed forward of the whole model takes only the adapters' parameters still without a
    gradient into the graph (or one, to stay in it), and its backward costs what running it costs."""
    config = TrainConfig(model="tiny", lora=True, lora_rank=4, **TINY)
    phases = {}
    for fast in (True, False):
        with Session(config, target=H100, fast=fast) as s:
            batch = s.rollout(prompts=2, group_size=4, prompt_length=8).batch
            phases[fast] = [phase_numbers(p) for p in
                            s.updates(batch, n_t=8, batching=MicroBatching(4)).values() if p.runs]
            assert s.replayer.calls["replayed"] > 0
    assert phases[True] == phases[False]


@pytest.mark.parametrize("suffix", ["", "_triton"])
def test_the_heads_log_probs_are_the_assumed_values_on_either_backend(suffix):
    """The Triton head's ops (backend="triton") give the step the assumed log-probs as the compiled ops do, so a
    plan under DLLM_FAST_BACKEND=triton steers by the same data."""
    import dllm_fast.ops  # noqa: F401 (the op faces define the Triton ops)

    mode = PlanningFakeMode()
    with mode:
        hidden, weight = mode.from_tensor(torch.zeros(6, 8)), mode.from_tensor(torch.zeros(40, 8))  # no values
        targets = torch.zeros(6, dtype=torch.long)
        logp, _ = getattr(torch.ops.dllm_fast, f"masked_logprobs{suffix}")(hidden, weight, targets, 16)
        walk_logp, _ = getattr(torch.ops.dllm_fast, f"masked_logprobs_grad{suffix}")(
            hidden, weight, targets, torch.empty(6), None, None, 16)
    for out in (logp, walk_logp):
        assert is_constant(out) and bool((out.constant == mode.assumptions.logprob).all()), suffix
