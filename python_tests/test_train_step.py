"""One step (issue 30 item 1): the trainer, the planner's fake-tensor session and the TRL trainer all run the
phases of dllm_fast.train.step, so what the planner plans is what the trainers run. Each caller is observed
through the shared module's phase functions, in order."""

import contextlib
import os

import pytest
import torch

from dllm_fast.train import step as train_step


@pytest.fixture
def phases(monkeypatch):
    """Every call of the shared step's phase functions, by name, in order."""
    calls = []

    def recorded(name, function):
        def call(*args, **kwargs):
            calls.append(name)
            return function(*args, **kwargs)
        return call

    for name in ("roll_out", "plan_updates", "inner_update", "optimizer_step"):
        monkeypatch.setattr(train_step, name, recorded(name, getattr(train_step, name)))
    return calls


def one_step(inner_updates, *, optimizer=True):
    calls = ["roll_out", "plan_updates"]
    for _ in range(inner_updates):
        calls += ["inner_update", "optimizer_step"] if optimizer else ["inner_update"]
    return calls


@pytest.mark.slow
def test_the_trainer_runs_the_shared_step(tmp_path, phases):
    from test_trainer import quick_config

    from dllm_fast.train import train

    train(quick_config(tmp_path, steps=1, inner_updates=2, eval_every=10, checkpoint_every=10, eval_examples=4,
                       objective="espo", objective_options={"n_t": 2}))
    assert phases == one_step(2)


@pytest.mark.parametrize("engine", ["streaming", pytest.param("all_graphs", marks=pytest.mark.slow)])
@pytest.mark.parametrize("fast", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_the_planner_plans_the_shared_step(phases, engine, fast):
    """The planner runs the shared phases in order, after priming AdamW's state with two of train's optimizer
    steps (planning/step._prime_optimizer); fast (the planner's default), an optimizer step identical to one it ran
    (the same gradients) is replayed from its record instead of run again (planning/replay.py)."""
    from dllm_fast.likelihood import MicroBatching
    from dllm_fast.planning.accounting import Target
    from dllm_fast.planning.step import Session
    from dllm_fast.train import TrainConfig

    config = TrainConfig(model="tiny", prompts_per_step=1, group_size=2, gen_length=8, block_length=4,
                         diffusion_steps=4, micro_batch=4, objective="espo", inner_updates=2, bf16=False)
    with Session(config, target=Target("cpu"), engine=engine, fast=fast) as session:
        rollout = session.rollout(prompts=1, group_size=2, prompt_length=8)
        planned = session.updates(rollout.batch, n_t=2, batching=MicroBatching(4))
    replayed = ["roll_out", "plan_updates", "inner_update", "optimizer_step", "inner_update"]  # the second step
    assert phases == ["optimizer_step"] * 2 + (replayed if fast else one_step(2))
    # every update phase of the shared step was accounted (espo: a ratio and a KL to the reference)
    assert all(planned[name].runs == 2 for name in ("reference scoring", "inner update", "optimizer step"))
    assert planned["old-policy scoring"].runs == 1


def test_the_trl_trainer_runs_the_shared_phases_and_steps_its_own_optimizer(tmp_path, phases):
    """TRL owns its loop (accelerate clips and steps the optimizer, gradient accumulation decides when): the
    shared rollout, plan and inner update run, the optimizer step is TRL's."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from dllm_fast.integrations import trl_example

    trainer = trl_example.build_trainer(str(tmp_path), objective="diffu_grpo", steps=1)
    trainer.train()
    assert phases == one_step(1, optimizer=False)


def test_hooks_wrap_each_phase_in_order():
    """A phase hook sees the five phases of a step in order, with the reference scored before each update."""
    from test_objectives import make, perturbed, rollout_batch, tiny_model

    from dllm_fast.likelihood import MicroBatching
    from dllm_fast.rollout.config import GenerateConfig

    seen = []

    @contextlib.contextmanager
    def phase(name):
        seen.append(name)
        yield

    hooks = train_step.StepHooks(phase=phase)
    model = tiny_model()
    input_ids = torch.randint(0, 100, (2, 4))
    rollout = train_step.roll_out(model, input_ids, torch.ones_like(input_ids),
                                  GenerateConfig(gen_length=4, block_length=4, steps=4),
                                  generator=torch.Generator().manual_seed(0), record_unmask_step=False, hooks=hooks)
    assert rollout.completion_ids.shape == (2, 4) and model.training  # eval while sampling, then as it was
    objective, batch = make("espo"), rollout_batch(model)
    plan = train_step.plan_updates(objective, model, batch, moved=train_step.moved_after_first(2),
                                   generator=torch.Generator().manual_seed(1), batching=MicroBatching(3), hooks=hooks)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimization = train_step.Optimization(trainable, torch.optim.SGD(trainable, lr=0.1), grad_clip=1.0)
    for update in plan:
        train_step.run_update(objective, model, batch, update, batching=MicroBatching(3), optimization=optimization,
                              ref_model=perturbed(model), hooks=hooks)
    assert seen == ["rollout", "old-policy scoring"] + ["reference scoring", "inner update", "optimizer step"] * 2
    assert all(p.grad is None for p in trainable)  # zeroed to None after each step


def test_a_non_finite_gradient_norm_takes_no_step():
    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.tensor([float("nan"), 1.0])
    optimization = train_step.Optimization([weight], torch.optim.SGD([weight], lr=1.0), grad_clip=1.0)
    with pytest.raises(FloatingPointError, match="the gradient norm is nan at step 3; no update was taken"):
        train_step.optimizer_step(optimization, when=" at step 3")
    assert weight.grad is None and torch.equal(weight.detach(), torch.ones(2))
