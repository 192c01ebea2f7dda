"""d-TreeRPO (objectives/d_treerpo.py): the edges of a tree rollout, the loss against its plain-PyTorch twin (value,
lp gradient, fp64 gradcheck), the engine's gradient against naive autograd, and the notes' self-distillation
property (one positive child, tau -> 0: -mean_j log p(child_j | parent))."""

import copy

import pytest
import torch

import dllm_fast
from dllm_fast import objectives, reference
from dllm_fast.likelihood import score
from dllm_fast.models import LLaDAConfig, LLaDAModel
from dllm_fast.objectives import InnerUpdate
from dllm_fast.objectives.d_treerpo import DECODED_BY_EDGE, TreeBatch, distillation_schedule, tree_batch
from dllm_fast.rollout.config import GenerateConfig
from dllm_fast.rollout.tree import TreeShape, tree_rollout

P, G = 3, 8


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LLaDAModel(LLaDAConfig.preset("tiny")).double()


@pytest.fixture(scope="module")
def tree(model):
    """Two prompts, 2 root children, branch 2, depth 2 (6 edges and 4 leaves each), sampled at T = 1."""
    ids = torch.randint(0, 120, (2, P), generator=torch.Generator().manual_seed(1))
    config = GenerateConfig(gen_length=G, block_length=4, steps=4, temperature=1.0)
    with torch.no_grad():
        return tree_rollout(dllm_fast.generate, model.eval(), ids, None, config,
                            TreeShape(branch=2, contraction=2, root_children=2),
                            generator=torch.Generator().manual_seed(3))


LEAF_REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])


def edges(model, tree, step=0):
    return tree_batch(tree, LEAF_REWARDS, eos_token_id=model.eos_token_id, mask_token_id=model.mask_token_id,
                      train_step=step)


def perturbed(model, seed, scale=0.05):
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * p.std().nan_to_num(0.0) * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return other


def test_tree_batch_holds_each_edge_with_its_act_positions_and_advantage(model, tree):
    batch = edges(model, tree)
    assert isinstance(batch, TreeBatch) and batch.num_rollouts == 12 and batch.group_size == 6
    mask = model.mask_token_id
    for row in range(12):
        node = int(tree.edges[torch.sort(tree.prompt[tree.edges], stable=True).indices][row])
        child, above = tree.canvases[node, P:], tree.canvases[tree.parent[node], P:]
        first_eos = (child == model.eos_token_id).nonzero()
        end = int(first_eos[0]) if len(first_eos) else G - 1
        act = (above == mask) & (child != mask) & (torch.arange(G) <= end)
        assert torch.equal(batch.unmask_step[row] == DECODED_BY_EDGE, act)
        assert int(batch.sibling_group[row]) == int(tree.parent[node])
    # leaves (1, 0 | 1, 1) under prompt 0's two root children: V = 0.5, 1, A = -0.5, +0.5
    assert batch.advantages[:2].tolist() == [-0.5, 0.5]
    assert batch.advantages[2:6].tolist() == [1.0, -1.0, 0.0, 0.0]


def with_advantages(batch, advantages):
    fields = {name: getattr(batch, name) for name in batch.__dataclass_fields__}
    return TreeBatch(**{**fields, "advantages": torch.tensor(advantages, dtype=torch.float64)})


def draw(objective, model, batch):
    return objective.draw_masks(batch, generator=torch.Generator().manual_seed(0), eos_token_id=model.eos_token_id)


def twin(objective, lp, inputs):
    c, batch = objective.config, inputs.batch
    return reference.objectives.d_treerpo(
        lp, inputs.masks, batch.advantages, batch.sibling_group, batch.sequences[:, P:], inputs.lp_old, inputs.lp_ref,
        epsilon=c.epsilon, beta=c.beta, sd_lambda=inputs.extra["sd_lambda"], sd_tau=inputs.extra["sd_tau"])


def test_loss_matches_the_twin_in_value_and_lp_gradient_and_passes_gradcheck(model, tree):
    objective = objectives.get("d_treerpo", self_distillation_steps=10, self_distillation_lambda=0.5)
    # inside the schedules (lambda and tau between their ends); siblings with two positive advantages, so that
    # q mixes children
    batch = with_advantages(edges(model, tree, step=6), [0.3, 0.7, 1.0, -1.0, 0.2, 0.5, -0.4, 0.9, 0.0, 0.0, 0.6, 0.6])
    masks = draw(objective, model, batch)
    gen = torch.Generator().manual_seed(5)
    scored = masks.target
    lp = torch.where(scored, -(0.05 + 3 * torch.rand(scored.shape, generator=gen, dtype=torch.float64)), 0.0)
    lp_old = torch.where(scored, lp + 0.6 * torch.randn(scored.shape, generator=gen, dtype=torch.float64), 0.0)
    lp_ref = torch.where(scored, lp + 0.3 * torch.randn(scored.shape, generator=gen, dtype=torch.float64), 0.0)
    inputs = objective.prepare(batch, masks, lp_old=lp_old.clamp_max(0), lp_ref=lp_ref.clamp_max(0))
    assert inputs.extra["sd_pairs"] > 0 and 0 < inputs.extra["sd_lambda"] < 0.5
    x = lp.clone().requires_grad_(True)
    got = objective.loss(x, inputs)
    (got_grad,) = torch.autograd.grad(got, x)
    y = lp.clone().requires_grad_(True)
    want = twin(objective, y, inputs)
    (want_grad,) = torch.autograd.grad(want, y)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)
    ratio_clipped = ((lp - inputs.lp_old).abs() > 0.4)[scored]
    assert ratio_clipped.any() and not ratio_clipped.all()  # both sides of the clip are exercised
    assert torch.autograd.gradcheck(lambda z: objective.loss(z, inputs), (lp.clone().requires_grad_(True),))


@pytest.mark.slow  # a few seconds (imports, the model's setup)
def test_engine_gradient_equals_naive_autograd(model, tree):
    objective = objectives.get("d_treerpo", self_distillation_steps=10)
    batch = edges(model, tree, step=8)
    masks = draw(objective, model, batch)
    with torch.no_grad():
        lp_old = score(perturbed(model, 3), batch.sequences, masks, micro_batch=16)
        lp_ref = score(perturbed(model, 4), batch.sequences, masks, micro_batch=16)
    inputs = objective.prepare(batch, masks, lp_old=lp_old, lp_ref=lp_ref)
    trainable = [p for p in model.parameters() if p.requires_grad]
    naive = objective.loss(reference.likelihood.score_naive(model, batch.sequences, masks, None), inputs)
    want = torch.autograd.grad(naive, trainable)
    model.zero_grad(set_to_none=True)
    out = objective.backward(model, batch, InnerUpdate(masks, lp_old=lp_old), micro_batch=5, lp_ref=lp_ref)
    torch.testing.assert_close(out.loss, naive.detach(), rtol=1e-10, atol=1e-12)
    for p, g in zip(trainable, want):
        torch.testing.assert_close(p.grad, g, rtol=1e-8, atol=1e-12)
    model.zero_grad(set_to_none=True)


def test_self_distillation_with_one_positive_child_and_tau_to_zero_is_its_mean_nll(model, tree):
    """The notes' property, on the model itself: at t = T (tau = 1e-6), a parent whose only positive child is k
    gives L_SD = -mean_j log p(child_j | parent), from the full softmax at the parent's canvas."""
    objective = objectives.get("d_treerpo", beta=0.0, self_distillation_steps=5, self_distillation_lambda=1.0)
    batch = with_advantages(edges(model, tree, step=5), [-0.5, 0.5] + [0.0] * 10)  # one positive child of root 0
    masks = draw(objective, model, batch)
    assert distillation_schedule(5, lambda_max=1.0, gamma=2.0, tau_max=2.0, tau_power=0.7, steps=5) == (1.0, 1e-6)
    out = objective.backward(model, batch, micro_batch=12, generator=torch.Generator().manual_seed(0))
    node = int(tree.edges[torch.sort(tree.prompt[tree.edges], stable=True).indices][1])
    parent = tree.canvases[tree.parent[node]]
    with torch.no_grad():
        logits = torch.nn.functional.linear(model(parent[None]), model.lm_head_weight)[0, P:]
    log_p = torch.log_softmax(logits, -1)
    act = masks.target[1, 0]
    want = -log_p[act].gather(1, batch.sequences[1, P:][act][:, None]).mean()
    assert out.stats["self_distillation"] == pytest.approx(float(want), rel=1e-10)
    model.zero_grad(set_to_none=True)


def test_a_plain_rollout_batch_is_refused_naming_the_tree(model, tree):
    objective = objectives.get("d_treerpo")
    batch = edges(model, tree)
    plain = dllm_fast.RolloutBatch(batch.sequences, None, P, batch.completion_mask, batch.rewards, 6)
    with pytest.raises(TypeError, match="d_treerpo trains on the edges of a tree rollout: pass a TreeBatch"):
        draw(objective, model, plain)
    with pytest.raises(ValueError, match="n_t=2 does not apply with sampler='tree_edge'"):
        objectives.get("d_treerpo", n_t=2)


# -- the trainer, the planner and TRL ------------------------------------------------------------------------


@pytest.mark.slow  # a few seconds (imports, the model's setup)
def test_train_refuses_tree_rollouts_the_settings_cannot_decode_before_any_work(tmp_path):
    from dllm_fast.train import TrainConfig, train

    config = TrainConfig(objective="d_treerpo", threshold=0.9, steps=1, diffusion_steps=None,
                         output_dir=str(tmp_path / "run"), progress=False, plot=False)
    with pytest.raises(ValueError, match="--objective d_treerpo .*tree rollouts branch at fixed steps"):
        train(config)
    config = TrainConfig(objective="d_treerpo", steps=1, diffusion_steps=12, cache="prefix",
                         objective_options={"tree_contraction": 5}, output_dir=str(tmp_path / "run"),
                         progress=False, plot=False)
    with pytest.raises(ValueError, match="cache='prefix' resumes only at block boundaries"):
        train(config)
    assert not (tmp_path / "run").exists()


def counted_train_step(monkeypatch, config):
    """One real `train` step of `config`, with every model forward counted (calls and tokens) by phase: the rollout
    (train_step.roll_out) and the update (train_step.run_update: reference scoring without gradients, the inner
    update with them). The evaluations' forwards are not counted. Returns (counts, the step's metrics row)."""
    from dllm_fast.train import train
    from dllm_fast.train import step as train_step

    counts = {key: 0 for key in ("rollout", "rollout_tokens", "reference", "reference_tokens", "grad", "grad_tokens")}
    phase = [None]

    def in_phase(name, function):
        def run(*args, **kwargs):
            phase[0] = name
            try:
                return function(*args, **kwargs)
            finally:
                phase[0] = None
        return run

    forward = torch.nn.Module.__call__

    def counted(self, *args, **kwargs):  # the planner's count: a forward pre-hook on the model (planning/step.py)
        ids = args[0] if args else kwargs.get("input_ids")
        if phase[0] is not None and torch.is_tensor(ids):
            kind = "rollout" if phase[0] == "rollout" else "grad" if torch.is_grad_enabled() else "reference"
            counts[kind] += 1
            counts[kind + "_tokens"] += ids.numel()
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(LLaDAModel, "__call__", counted, raising=False)  # the embedded default's model
    monkeypatch.setattr(train_step, "roll_out", in_phase("rollout", train_step.roll_out))
    monkeypatch.setattr(train_step, "run_update", in_phase("update", train_step.run_update))
    result = train(config)
    return counts, [row for row in result.history if "step_seconds" in row][0]


@pytest.mark.slow  # a planned step and a real one on the embedded default, about 20 s on 2 cores
def test_plan_prices_the_tree_as_train_runs_it(monkeypatch, tmp_path):
    """plan on the embedded default: its rollout is the tree train grows (one resumed generate call per level,
    every level's nodes as rows: 12 forwards over 8 x 4 and 8 x 16 rows), and its updates score the 160 edges
    once each (reference without gradients, the update with them), call for call and token for token with a real
    train step of the same settings; the edges are the step's update pairs."""
    from dllm_fast.planning.planner import plan_step
    from dllm_fast.train import TrainConfig

    config = TrainConfig(objective="d_treerpo", steps=1, eval_examples=2, output_dir=str(tmp_path / "run"),
                         progress=False, plot=False, threads=1)
    plan = plan_step(config, gpu=None, search=False)
    counts, row = counted_train_step(monkeypatch, config)
    shape = objectives.get("d_treerpo").tree_shape()
    edges = config.run.prompts_per_step * shape.edges_per_prompt()
    assert plan.shapes["rollouts"] == row["update_pairs"] == edges == 160
    assert plan.shapes["tree"] == {"edges": 20, "leaves": 16}
    rollout = plan.phases["rollout"].model_calls
    assert plan.nfe == rollout["policy"] == counts["rollout"] == 12
    assert rollout["policy_tokens"] == counts["rollout_tokens"] == 6 * (8 * 4 + 8 * 16) * (plan.prompt_length + 24)
    reference = plan.phases["reference scoring"].model_calls
    assert reference["reference"] + reference["policy"] == counts["reference"]
    assert reference["reference_tokens"] + reference["policy_tokens"] == counts["reference_tokens"]
    update = plan.phases["inner update"].model_calls
    assert update["policy_grad"] == counts["grad"] and update["policy_grad_tokens"] == counts["grad_tokens"]
    assert counts["reference_tokens"] >= edges * (plan.prompt_length + 24)  # every edge scored at least once


def test_compile_auto_leaves_tree_rollouts_eager_on_cuda():
    """--compile auto compiles rollouts on CUDA, but a tree's resumed calls run eagerly (generate refuses
    resume under compile): auto must leave d_treerpo's rollouts eager, or train and plan refuse the default."""
    from dllm_fast.train import TrainConfig
    from dllm_fast.train.config import compiles_rollouts

    assert not compiles_rollouts(TrainConfig(objective="d_treerpo"), "cuda")
    assert compiles_rollouts(TrainConfig(objective="espo"), "cuda")
    assert compiles_rollouts(TrainConfig(objective="d_treerpo", compile=True), "cuda")  # asked for: refused later


@pytest.mark.slow  # a plan with the search, about a minute on a loaded 2-core machine
def test_micro_batch_auto_fits_the_tree_step_by_the_plan():
    """--micro-batch auto on a GPU is the planner's fit, for d_treerpo too now that plan prices its trees."""
    from dllm_fast.planning.gpus import gpu
    from dllm_fast.train import TrainConfig
    from dllm_fast.train.micro_batch import fitted_micro_batch

    fitted, note = fitted_micro_batch(TrainConfig(objective="d_treerpo"), gpu=gpu("h200"))
    assert fitted >= 160 and "the largest the planner fits" in note


@pytest.mark.slow  # a few seconds (the tiny model's setup and plan)
def test_plan_refuses_trees_the_settings_cannot_decode_naming_the_setting(capsys):
    from dllm_fast.planning import cli

    with pytest.raises(SystemExit):
        cli.main(["--objective", "d_treerpo", "--model", "tiny", "--threshold", "0.9", "--diffusion-steps", "none"])
    assert "--objective d_treerpo with --model 'tiny': tree rollouts branch at fixed steps" in capsys.readouterr().err


@pytest.mark.slow  # a few seconds (imports, the model's setup)
def test_trl_refuses_it_naming_why(model):
    pytest.importorskip("trl")
    from dllm_fast.integrations.trl import DiffusionGRPOTrainer

    with pytest.raises(ValueError, match="'d_treerpo' trains on the edges of tree rollouts.*cannot branch them"):
        DiffusionGRPOTrainer(model=model, reward_funcs=[lambda **_: [0.0]], objective="d_treerpo")


def test_self_distillation_is_the_kl_from_the_childrens_mixture_to_the_full_softmax_at_the_parent(model, tree):
    """Several positive children at tau = 1: L_SD = mean_(parent, j) sum_v q_j(v) (log q_j(v) - log p(v | parent))
    over the whole vocabulary at the parent's canvas, which the objective reads off the children's lp."""
    steps = 10
    objective = objectives.get("d_treerpo", beta=0.0, self_distillation_steps=steps, self_distillation_lambda=1.0,
                               self_distillation_tau=2.0, self_distillation_tau_power=1.0)
    batch = with_advantages(edges(model, tree, step=5), [0.3, 0.7, 1.0, 0.4, 0.2, 0.5, -0.4, 0.9, 0.0, 0.0, 0.6, 0.1])
    lam, tau = objective.schedule(5)
    assert tau == pytest.approx(1.0)
    out = objective.backward(model, batch, micro_batch=12, generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    act = draw(objective, model, batch).target[:, 0]
    total, pairs = 0.0, 0
    for group in batch.sibling_group.unique().tolist():
        rows = [r for r in range(12) if int(batch.sibling_group[r]) == group and batch.advantages[r] > 0]
        if not rows:
            continue
        weights = torch.softmax(batch.advantages[rows] / tau, 0)
        parent = tree.canvases[group]
        with torch.no_grad():
            log_p = torch.log_softmax(torch.nn.functional.linear(model(parent[None]), model.lm_head_weight)[0, P:], -1)
        for j in range(G):
            holders = [(w, int(batch.sequences[r, P + j])) for w, r in zip(weights, rows) if act[r, j]]
            if not holders:
                continue
            q = torch.zeros(log_p.shape[-1], dtype=torch.float64)
            for w, token in holders:
                q[token] += w / sum(h[0] for h in holders)
            kept = q > 0
            total += float((q[kept] * (q[kept].log() - log_p[j, kept])).sum())
            pairs += 1
    assert pairs > 3
    assert out.stats["self_distillation"] == pytest.approx(total / pairs, rel=1e-10)
