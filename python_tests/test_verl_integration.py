"""The VeRL adapter: dllm_fast objectives under VeRL's policy-loss signature. The mapping is tested here without
verl (a hand-written token PPO loss, micro-batch and data-parallel invariance, the rejections); registration and
agreement with verl's own vanilla PPO loss run only where verl is installed."""

import os
import subprocess
import sys
import types

import pytest
import torch

from dllm_fast import objectives
from dllm_fast.integrations import verl as adapter

pytestmark = pytest.mark.usefixtures("one_thread")


def micro_batch(N=6, T=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(N, T, dtype=torch.long)
    mask[1, 3:] = 0
    mask[4, 1:] = 0
    old = -torch.rand(N, T, generator=generator, dtype=torch.float64) * 3
    new = (old + 0.3 * torch.randn(N, T, generator=generator, dtype=torch.float64)).clamp_max(0)
    advantage = torch.randn(N, 1, generator=generator, dtype=torch.float64).expand(N, T).clone()
    return old, new.requires_grad_(True), advantage, mask  # padded positions hold values too, as in VeRL


def token_ppo(old, new, advantage, mask, epsilon):
    """PPO's clipped surrogate per token, averaged over the valid tokens (verl's vanilla loss, token-mean)."""
    ratio = torch.exp(new - old)
    terms = -torch.minimum(ratio * advantage, ratio.clamp(1 - epsilon, 1 + epsilon) * advantage)
    return (terms * mask).sum() / mask.sum()


def test_diffu_grpo_is_token_ppo_on_the_given_log_probs():
    old, new, advantage, mask = micro_batch()
    objective = objectives.get("diffu_grpo", beta=0.0, epsilon=0.2)
    loss, metrics = adapter.policy_loss(objective, old, new, advantage, mask)
    want = token_ppo(old, new, advantage, mask, 0.2)
    torch.testing.assert_close(loss, want)
    (got_grad,) = torch.autograd.grad(loss, new)
    (want_grad,) = torch.autograd.grad(want, new)
    torch.testing.assert_close(got_grad, want_grad)
    assert (got_grad[mask == 0] == 0).all() and got_grad.abs().sum() > 0
    assert 0 < metrics["dllm_fast/clip_fraction"] < 1


def test_vrpo_ol_is_the_sequence_ratio_of_the_summed_log_probs():
    old, new, advantage, mask = micro_batch()
    loss, _ = adapter.policy_loss(objectives.get("vrpo_ol"), old, new, advantage, mask)
    ratio = torch.exp(((new - old) * mask).sum(-1))  # one mean-field sample: the ELBO is the masked sum
    torch.testing.assert_close(loss, -(ratio * advantage[:, 0]).mean())


def test_coupled_grpo_is_token_ppo_on_its_per_token_estimates():
    """The actor hands coupled-GRPO's per-token estimate as log_prob: the loss is token PPO with its eps 0.5."""
    old, new, advantage, mask = micro_batch()
    loss, _ = adapter.policy_loss(objectives.get("coupled_grpo", beta=0.0), old, new, advantage, mask)
    torch.testing.assert_close(loss, token_ppo(old, new, advantage, mask, 0.5))


def test_gdpo_is_one_length_normalised_ratio_per_sequence():
    """GDPO's per-position SDMC contributions sum to the ELBO: rho = exp(sum (new - old) / L_n), clipped at 0.2, as
    NeMo RL's sequence_level_importance_ratios computes it (the masked mean of the per-position log ratios)."""
    old, new, advantage, mask = micro_batch()
    loss, _ = adapter.policy_loss(objectives.get("gdpo"), old, new, advantage, mask)
    ratio = torch.exp(((new - old) * mask).sum(-1) / mask.sum(-1))
    a = advantage[:, 0]
    torch.testing.assert_close(loss, -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a).mean())


@pytest.mark.parametrize("name", adapter.SUPPORTED)
def test_micro_batches_and_ranks_sum_to_the_global_batch(name):
    """VeRL sums micro-batch losses and averages over data-parallel ranks; with its global batch info the pieces
    must add up to the objective on the whole batch, for sequence- and token-normalised objectives alike."""
    objective = [o for o in adapter.default_objectives() if o.name == name][0]
    old, new, advantage, mask = micro_batch()
    whole, _ = adapter.policy_loss(objective, old, new, advantage, mask)
    for dp_size, pieces in ((1, [slice(0, 2), slice(2, 6)]), (2, [slice(0, 3), slice(3, 6)])):
        info = {"dp_size": dp_size, "batch_num_tokens": int(mask.sum()), "global_batch_size": mask.shape[0]}
        config = types.SimpleNamespace(global_batch_info=info)
        parts = [adapter.policy_loss(objective, old[r], new[r], advantage[r], mask[r], config=config)[0]
                 for r in pieces]
        torch.testing.assert_close(sum(parts) / dp_size, whole)


def test_unsupported_settings_are_named():
    old, new, advantage, mask = micro_batch()
    with pytest.raises(ValueError, match="'wd1' cannot run as a VeRL policy loss"):
        adapter.policy_loss(objectives.get("wd1"), old, new, advantage, mask)
    with pytest.raises(ValueError, match="'tracerl' cannot run as a VeRL policy loss"):
        adapter.policy_loss(objectives.get("tracerl"), old, new, advantage, mask)
    with pytest.raises(ValueError, match=r"objectives.get\('diffu_grpo', beta=0.0\).*use_kl_loss"):
        adapter.policy_loss(objectives.get("diffu_grpo"), old, new, advantage, mask)
    objective = adapter.default_objectives()[0]
    with pytest.raises(ValueError, match="rollout_is_weights"):
        adapter.policy_loss(objective, old, new, advantage, mask, rollout_is_weights=torch.ones_like(old))
    with pytest.raises(ValueError, match=r"advantages has shape \(6, 1\)"):
        adapter.policy_loss(objective, old, new, advantage[:, :1], mask)
    config = types.SimpleNamespace(global_batch_info={"dp_size": 2})
    with pytest.raises(ValueError, match="dp_size=2 but no batch_num_tokens"):
        adapter.policy_loss(objective, old, new, advantage, mask, config=config)
    with pytest.raises(ValueError, match="is not a log-probability"):
        adapter.policy_loss(objective, -old, new, advantage, mask)


def test_registration_without_verl_says_how_to_install(monkeypatch):
    for name in [name for name in sys.modules if name == "verl" or name.startswith("verl.")] + ["verl"]:
        monkeypatch.setitem(sys.modules, name, None)  # also where another test imported verl already
    with pytest.raises(ImportError, match=r"pip install verl>=0.9"):
        adapter.register_verl_losses()


def test_registered_losses_run_under_verls_own_call():
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    names = adapter.register_verl_losses()
    assert names == [f"dllm_fast_{n}" for n in adapter.SUPPORTED]
    old, new, advantage, mask = micro_batch()
    config = core_algos.ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2, clip_ratio=0.2,
                                    clip_ratio_low=0.2, clip_ratio_high=0.2)
    kwargs = dict(old_log_prob=old, log_prob=new, advantages=advantage, response_mask=mask.bool(),
                  loss_agg_mode="token-mean", config=config, rollout_is_weights=None)
    ours, metrics = core_algos.get_policy_loss_fn("dllm_fast_diffu_grpo")(**kwargs)
    theirs, _ = core_algos.get_policy_loss_fn("vanilla")(**kwargs)
    # diffu_grpo registers with d1's epsilon 0.5; with verl's 0.2 it is verl's vanilla PPO, dual clip aside
    adapter.register_verl_losses(objectives.get("diffu_grpo", beta=0.0, epsilon=0.2), prefix="test_")
    same, _ = core_algos.get_policy_loss_fn("test_diffu_grpo")(**kwargs)
    torch.testing.assert_close(same.double(), theirs.double())
    assert torch.isfinite(ours) and "dllm_fast/ratio_mean" in metrics
    for name in names:
        loss, _ = core_algos.get_policy_loss_fn(name)(**kwargs)
        assert torch.isfinite(loss) and loss.requires_grad


def test_the_plugin_registers_in_every_process_that_imports_verl():
    pytest.importorskip("verl")
    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES="dllm_fast.integrations.verl_plugin",
               PYTHONPATH=os.pathsep.join(sys.path))
    code = "import verl.trainer.ppo.core_algos as c; print(sorted(k for k in c.POLICY_LOSS_REGISTRY if 'dllm' in k))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == str(sorted(adapter.PREFIX + n for n in adapter.SUPPORTED)), out.stderr[-2000:]


# -- bad input (issue 45.1): every argument of the loss is checked, each error naming it -------------------------

def espo():
    return [o for o in adapter.default_objectives() if o.name == "espo"][0]


def with_info(**info):
    full = {"dp_size": 1, "batch_num_tokens": 100, "global_batch_size": 12, **info}
    return types.SimpleNamespace(global_batch_info=full)


@pytest.mark.parametrize("field", adapter.losses.GLOBAL_FIELDS)
@pytest.mark.parametrize("value", [-1, 0, -3.0, float("nan"), float("inf"), "12", [12], True, 2.5, object()])
def test_global_batch_info_fields_are_positive_whole_numbers(field, value):
    old, new, advantage, mask = micro_batch()
    with pytest.raises(ValueError, match=f"global_batch_info {field}="):
        adapter.policy_loss(espo(), old, new, advantage, mask, config=with_info(**{field: value}))


@pytest.mark.parametrize("name", adapter.SUPPORTED)
def test_global_counts_below_the_micro_batch_are_refused(name):
    objective = [o for o in adapter.default_objectives() if o.name == name][0]
    old, new, advantage, mask = micro_batch()
    with pytest.raises(ValueError, match="global_batch_size=5 is smaller than this micro-batch's 6 sequences"):
        adapter.policy_loss(objective, old, new, advantage, mask, config=with_info(global_batch_size=5))
    tokens = int(mask.sum())
    with pytest.raises(ValueError, match=f"batch_num_tokens={tokens - 1} is smaller than this micro-batch's "
                                         f"{tokens} response tokens"):
        adapter.policy_loss(objective, old, new, advantage, mask, config=with_info(batch_num_tokens=tokens - 1))


def test_global_counts_of_numpy_and_torch_scalars_are_read_as_ints():
    np = pytest.importorskip("numpy")
    old, new, advantage, mask = micro_batch()
    as_ints, _ = adapter.policy_loss(espo(), old, new, advantage, mask, config=with_info(global_batch_size=12))
    for value in (np.int64(12), torch.tensor(12), 12.0):
        loss, _ = adapter.policy_loss(espo(), old, new, advantage, mask, config=with_info(global_batch_size=value))
        assert loss.item() == as_ints.item()
    torch.testing.assert_close(as_ints * 2, adapter.policy_loss(espo(), old, new, advantage, mask)[0])


def test_loss_scale_factor_is_refused():
    old, new, advantage, mask = micro_batch()
    with pytest.raises(ValueError, match="loss_scale_factor"):
        adapter.policy_loss(espo(), old, new, advantage, mask, config=with_info(loss_scale_factor=512))


@pytest.mark.parametrize("argument", ["log_prob", "old_log_prob"])
@pytest.mark.parametrize("row,value", [(0, float("nan")), (3, float("inf")), (5, float("-inf")), (2, 0.5),
                                       (3, 1e-3)])
def test_log_probs_that_are_not_log_probabilities_name_the_row(argument, row, value):
    old, new, advantage, mask = micro_batch()
    tensors = {"old_log_prob": old.clone(), "log_prob": new.detach().clone()}
    tensors[argument][row, 0] = value
    with pytest.raises(ValueError, match=f"{argument} row {row} \\(position 0\\) holds"):
        adapter.policy_loss(espo(), tensors["old_log_prob"], tensors["log_prob"].requires_grad_(), advantage, mask)


def test_values_where_the_mask_scores_nothing_are_not_read():
    old, new, advantage, mask = micro_batch()
    base, _ = adapter.policy_loss(espo(), old, new, advantage, mask)
    old, new2 = old.clone(), new.detach().clone()
    old[1, 4], new2[4, 3] = float("nan"), 7.0  # padding (mask 0) may hold anything, as in verl
    loss, _ = adapter.policy_loss(espo(), old, new2.requires_grad_(), advantage, mask)
    torch.testing.assert_close(loss, base)


@pytest.mark.parametrize("row", [0, 2, 5])
def test_advantages_that_vary_within_a_row_are_refused_naming_the_estimators(row):
    old, new, advantage, mask = micro_batch()
    advantage = advantage.clone()
    advantage[row, 0] += 0.5
    with pytest.raises(ValueError, match=f"advantages vary within row {row}.*grpo, grpo_vectorized, rloo"):
        adapter.policy_loss(espo(), old, new, advantage, mask)
    advantage[row, 0] = float("nan")
    with pytest.raises(ValueError, match=f"advantages row {row} \\(position 0\\) is nan"):
        adapter.policy_loss(espo(), old, new, advantage, mask)


def test_advantages_may_differ_where_the_mask_scores_nothing():
    old, new, advantage, mask = micro_batch()
    base, _ = adapter.policy_loss(espo(), old, new, advantage, mask)
    advantage = advantage.clone()
    advantage[1, 4] = 99.0  # beyond row 1's response: verl zeroes it there, others may not
    torch.testing.assert_close(adapter.policy_loss(espo(), old, new, advantage, mask)[0], base)


@pytest.mark.parametrize("value", [0.5, 2, -1, 1.0001])
def test_response_masks_other_than_zero_or_one_are_refused(value):
    old, new, advantage, mask = micro_batch()
    mask = mask.double()
    mask[2, 1] = value
    with pytest.raises(ValueError, match=r"response_mask\[2, 1\] ="):
        adapter.policy_loss(espo(), old, new, advantage, mask)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.float32, torch.float64])
def test_a_zero_one_mask_of_any_dtype_gives_the_same_loss(dtype):
    old, new, advantage, mask = micro_batch()
    base, _ = adapter.policy_loss(espo(), old, new, advantage, mask)
    torch.testing.assert_close(adapter.policy_loss(espo(), old, new, advantage, mask.to(dtype))[0], base)


@pytest.mark.parametrize("name", adapter.SUPPORTED)
def test_an_empty_row_contributes_nothing_and_counts_as_a_sequence(name):
    """A row without response tokens: finite loss, zero gradient on that row, and the loss is the objective on the
    other rows, counted as one more sequence of zero loss (sequence-normalised) or not at all (token-normalised),
    so micro-batches holding empty rows still add up to the global batch."""
    objective = [o for o in adapter.default_objectives() if o.name == name][0]
    old, new, advantage, mask = micro_batch()
    mask = mask.clone()
    mask[2] = 0
    loss, _ = adapter.policy_loss(objective, old, new, advantage, mask)
    assert torch.isfinite(loss)
    (grad,) = torch.autograd.grad(loss, new)
    assert (grad[2] == 0).all() and torch.isfinite(grad).all() and grad.abs().sum() > 0
    rest = [0, 1, 3, 4, 5]
    without, _ = adapter.policy_loss(objective, old[rest], new[rest], advantage[rest], mask[rest])
    scale = 1.0 if adapter.token_normalised(objective) else 5 / 6
    torch.testing.assert_close(loss, without * scale)
    info = {"dp_size": 1, "batch_num_tokens": int(mask.sum()), "global_batch_size": 6}
    config = types.SimpleNamespace(global_batch_info=info)
    parts = [adapter.policy_loss(objective, old[r], new[r], advantage[r], mask[r], config=config)[0]
             for r in (slice(0, 3), slice(3, 6))]
    torch.testing.assert_close(sum(parts), loss)


@pytest.mark.parametrize("name", adapter.SUPPORTED)
@pytest.mark.parametrize("rows", [0, 3])
def test_an_empty_micro_batch_gives_zero_loss_and_zero_gradient(name, rows):
    objective = [o for o in adapter.default_objectives() if o.name == name][0]
    old, new, advantage, mask = micro_batch()
    new = new.detach()[:rows].clone().requires_grad_()
    empty = torch.zeros(rows, mask.shape[1], dtype=torch.long)
    loss, metrics = adapter.policy_loss(objective, old[:rows], new, advantage[:rows], empty,
                                        config=with_info(batch_num_tokens=10))
    assert loss.item() == 0.0 and metrics == {}
    loss.backward()
    assert new.grad is not None and (new.grad == 0).all()


@pytest.mark.parametrize("argument", ["old_log_prob", "log_prob", "advantages", "response_mask"])
def test_arguments_of_the_wrong_type_or_shape_are_named(argument):
    np = pytest.importorskip("numpy")
    old, new, advantage, mask = micro_batch()
    given = {"old_log_prob": old, "log_prob": new, "advantages": advantage, "response_mask": mask}
    call = lambda **change: adapter.policy_loss(espo(), **{**given, **change})  # noqa: E731
    with pytest.raises(TypeError, match=f"{argument} must be a torch.Tensor of shape \\[batch, response_length\\]"
                                        ".*numpy.ndarray"):
        call(**{argument: given[argument].detach().numpy()})
    with pytest.raises(ValueError, match=f"{argument} must have shape \\[batch, response_length\\], got "
                                         r"\(6, 5, 1\) \(3-D\)"):
        call(**{argument: given[argument].detach()[:, :, None]})
    if argument != "log_prob":
        with pytest.raises(ValueError, match=f"{argument} has shape \\(6, 4\\) but log_prob \\(6, 5\\)"):
            call(**{argument: given[argument].detach()[:, :4]})
    if argument != "response_mask":
        with pytest.raises(TypeError, match=f"{argument} must have a floating dtype.*torch.int64"):
            call(**{argument: given[argument].detach().long()})


@pytest.mark.parametrize("setting,value", [("loss_agg_mode", "seq-mean-token-mean"), ("clip_ratio", 0.28),
                                           ("clip_ratio_high", 0.28), ("clip_ratio_low", 0.1), ("clip_ratio_c", 10.0)])
def test_verl_settings_the_objective_replaces_are_refused(setting, value):
    old, new, advantage, mask = micro_batch()
    config = types.SimpleNamespace(global_batch_info={}, **({} if setting == "loss_agg_mode" else {setting: value}))
    kwargs = {"loss_agg_mode": value} if setting == "loss_agg_mode" else {}
    with pytest.raises(ValueError, match=f"actor.{setting}={value!r} is verl's own loss setting"):
        adapter.policy_loss(espo(), old, new, advantage, mask, config=config, **kwargs)


def test_objectives_normalising_in_their_own_micro_batches_are_refused():
    old, new, advantage, mask = micro_batch()
    objective = objectives.get("diffu_grpo", beta=0.0, normalize_per="micro_batch", micro_batch_rows=2)
    with pytest.raises(ValueError, match="micro_batch_rows=2 normalises within micro-batches of its own"):
        adapter.policy_loss(objective, old, new, advantage, mask)


# -- the actor engine's settings and batch conversion (no verl needed: integrations/verl/settings.py, batch.py) ----

from dllm_fast.integrations.verl import batch as verl_batch  # noqa: E402
from dllm_fast.integrations.verl import settings as verl_settings  # noqa: E402
from dllm_fast.likelihood import elbo  # noqa: E402

SECTION = "actor_rollout_ref.model.override_config.dllm_fast"


def test_the_section_builds_the_objective_with_its_options():
    settings = verl_settings.EngineSettings.from_section({"objective": "vrpo_ol", "options": {"n_t": 6},
                                                         "micro_batch": 12, "seed": 3})
    assert settings.objective.name == "vrpo_ol" and settings.objective.config.n_t == 6
    assert (settings.micro_batch, settings.seed, settings.check_advantages) == (12, 3, True)
    assert verl_settings.EngineSettings.from_section(None).objective.name == "espo"
    assert verl_settings.EngineSettings.from_section({"objective": "spg", "preset": "sudoku"}).objective.config.n_t \
        == objectives.get("spg", preset="sudoku").config.n_t


@pytest.mark.parametrize("section,message", [
    ({"objectiv": "espo"}, f"{SECTION} has no key 'objectiv'"),
    ({"objective": "ppo"}, f"{SECTION}.objective='ppo' is not a dllm_fast objective; available: diffu_grpo"),
    ({"objective": 3}, f"{SECTION}.objective=3 is not a dllm_fast objective"),
    ({"options": [1]}, f"{SECTION}.options must be a mapping"),
    ({"objective": "espo", "options": {"n_t": 3}}, f"{SECTION} \\(objective 'espo'\\): n_t=3 must be even"),
    ({"objective": "espo", "options": {"nt": 4}}, f"{SECTION} \\(objective 'espo'\\): espo has no option 'nt'"),
    ({"objective": "espo", "preset": "nope"}, f"{SECTION} \\(objective 'espo'\\): espo has no preset 'nope'"),
    ({"micro_batch": 0}, f"{SECTION}.micro_batch=0 must be an int >= 1"),
    ({"micro_batch": "8"}, f"{SECTION}.micro_batch='8' must be an int >= 1"),
    ({"micro_batch": True}, f"{SECTION}.micro_batch=True must be an int >= 1"),
    ({"seed": -1}, f"{SECTION}.seed=-1 must be an int >= 0"),
    ({"check_advantages": "yes"}, f"{SECTION}.check_advantages='yes' must be true or false"),
    ({"rollout": 0.9}, f"{SECTION}.rollout must be a mapping"),
    ([1, 2], f"{SECTION} must be a mapping"),
])
def test_bad_sections_are_refused_naming_the_key(section, message):
    with pytest.raises((TypeError, ValueError), match=message):
        verl_settings.EngineSettings.from_section(section)


def verl_config(**changes):
    """The smallest verl PPO config selecting the engine, with dotted `changes` applied."""
    config = {"data": {"train_batch_size": 4},
              "algorithm": {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": False, "use_kl_in_reward": False},
              "trainer": {"balance_batch": False, "nnodes": 1, "n_gpus_per_node": 2},
              "actor_rollout_ref": {
                  "model": {"model_type": "dllm_fast", "override_config": {"dllm_fast": {"objective": "espo"}}},
                  "rollout": {"n": 4, "temperature": 1.0},
                  "actor": {"strategy": "fsdp2", "ppo_mini_batch_size": 4, "loss_agg_mode": "token-mean",
                            "clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0,
                            "entropy_coeff": 0, "use_kl_loss": False, "shuffle": False,
                            "policy_loss": {"loss_mode": "vanilla"}}}}
    for dotted, value in changes.items():
        node, *path, last = [config] + dotted.split("__")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return config


def test_a_config_that_selects_the_engine_is_checked_and_one_that_does_not_is_left_alone():
    assert verl_settings.check_verl_config(verl_config()).objective.name == "espo"
    assert verl_settings.check_verl_config(verl_config(actor_rollout_ref__model__model_type="language_model")) is None


@pytest.mark.parametrize("change,message", [
    ({"actor_rollout_ref__actor__strategy": "fsdp"}, "actor_rollout_ref.actor.strategy='fsdp'.*set .*=fsdp2"),
    ({"actor_rollout_ref__actor__loss_agg_mode": "seq-mean-token-sum"}, "actor.loss_agg_mode='seq-mean-token-sum'"),
    ({"actor_rollout_ref__actor__clip_ratio": 0.28}, "actor.clip_ratio=0.28 is verl's own loss setting"),
    ({"actor_rollout_ref__actor__clip_ratio_high": 0.28}, "actor.clip_ratio_high=0.28"),
    ({"actor_rollout_ref__actor__policy_loss": {"loss_mode": "gspo"}}, "policy_loss.loss_mode='gspo'"),
    ({"actor_rollout_ref__actor__entropy_coeff": 0.01}, "entropy_coeff=0.01"),
    ({"actor_rollout_ref__actor__use_kl_loss": True}, "use_kl_loss=true"),
    ({"actor_rollout_ref__actor__shuffle": True}, "actor_rollout_ref.actor.shuffle=true"),
    ({"algorithm__adv_estimator": "gae"}, "algorithm.adv_estimator='gae' is not an outcome estimator.*grpo"),
    ({"algorithm__adv_estimator": "reinforce_plus_plus"}, "adv_estimator='reinforce_plus_plus'"),
    ({"algorithm__use_kl_in_reward": True}, "algorithm.use_kl_in_reward=true"),
    ({"algorithm__norm_adv_by_std_in_grpo": True}, "algorithm.adv_estimator=grpo algorithm.norm_adv_by_std_in_grpo="
                                                   "true does not compute espo's advantages.*set algorithm.adv_"
                                                   "estimator=grpo algorithm.norm_adv_by_std_in_grpo=false"),
    ({"algorithm__adv_estimator": "rloo"}, "adv_estimator=rloo does not compute espo's"),
    ({"algorithm__rollout_correction": {"bypass_mode": True}}, "rollout_correction.bypass_mode=true"),
    ({"actor_rollout_ref__rollout__n": 1}, "actor_rollout_ref.rollout.n=1"),
    ({"trainer__use_v1": False, "trainer__balance_batch": True}, "trainer.balance_batch=true"),
    ({"actor_rollout_ref__actor__ppo_mini_batch_size": 2}, "ppo_mini_batch_size=2 with 2 data-parallel ranks.*set "
                                                          "ppo_mini_batch_size=data.train_batch_size \\(4\\)"),
    ({"data__train_batch_size": 3, "actor_rollout_ref__actor__ppo_mini_batch_size": 3},
     "data.train_batch_size=3 prompts for 2 data-parallel ranks.*multiple of 2"),
    ({"actor_rollout_ref__model__override_config": {"dllm_fast": {"objective": "espo", "rollout": {
        "temperature": 0.7}}}}, "rollout.temperature=0.7 but actor_rollout_ref.rollout.temperature=1.0"),
    ({"actor_rollout_ref__model__override_config": {"dllm_fast": {"objective": "nope"}}}, "objective='nope'"),
])
def test_verl_settings_the_engine_would_override_are_refused_naming_them(change, message):
    with pytest.raises(ValueError, match=message):
        verl_settings.check_verl_config(verl_config(**change))


def test_balance_batch_is_harmless_with_one_rank_and_one_mini_batch():
    """The legacy trainer reads trainer.balance_batch; verl's V1 trainer does not (it balances by length always)."""
    one = verl_config(trainer__balance_batch=True, trainer__n_gpus_per_node=1, trainer__use_v1=False)
    assert verl_settings.check_verl_config(one) is not None
    with pytest.raises(ValueError, match="trainer.balance_batch=true"):
        verl_settings.check_verl_config({**one, "data": {"train_batch_size": 8}})
    assert verl_settings.check_verl_config(verl_config(trainer__balance_batch=True)) is not None  # V1, 2 ranks


def test_one_rank_under_verls_v1_trainer_may_cut_the_step_into_mini_batches():
    one = verl_config(trainer__n_gpus_per_node=1, data__train_batch_size=8,
                      actor_rollout_ref__actor__ppo_mini_batch_size=2)
    assert verl_settings.check_verl_config(one) is not None


def test_the_advantage_settings_named_for_each_objective():
    named = {name: verl_settings.advantage_estimator_for(objectives.get(name)) for name in objectives.available()}
    assert named["espo"] == "algorithm.adv_estimator=grpo algorithm.norm_adv_by_std_in_grpo=false"
    assert named["bgpo"] == "algorithm.adv_estimator=grpo algorithm.norm_adv_by_std_in_grpo=true"
    assert named["coupled_grpo"] == "algorithm.adv_estimator=rloo"
    assert named["tracerl"] is None  # TraceRL's population-std z-score is none of verl's


def verl_rows(eos=9, pad=0):
    """A verl actor batch of 2 prompts x 3 completions in the order verl's shuffling might leave them."""
    generator = torch.Generator().manual_seed(1)
    P, R = 3, 5
    prompts = torch.randint(10, 50, (2, P), generator=generator).repeat_interleave(3, 0)
    prompts[:3, 0] = pad
    responses = torch.randint(10, 50, (6, R), generator=generator)
    lengths = torch.tensor([5, 2, 5, 3, 5, 5])
    responses[1, 1], responses[3, 2] = eos, eos
    response_mask = (torch.arange(R)[None] < lengths[:, None]).long()
    responses = responses.masked_fill(response_mask == 0, pad)
    attention = torch.cat([torch.ones(6, P, dtype=torch.long), response_mask], 1)
    attention[:3, 0] = 0
    rewards = torch.zeros(6, R)
    rewards[torch.arange(6), lengths - 1] = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.25])
    order = [0, 3, 1, 4, 2, 5]
    uid = [f"p{row // 3}" for row in range(6)]
    return {"prompts": prompts[order], "responses": responses[order], "attention_mask": attention[order],
            "response_mask": response_mask[order], "token_level_rewards": rewards[order],
            "uid": [uid[i] for i in order]}


def test_verl_rows_become_whole_groups_with_the_canvas_restored():
    data = verl_rows()
    rows = verl_batch.rows_from_verl(data, eos_token_id=9, device=torch.device("cpu"), grouped=True)
    assert rows.order == [0, 2, 4, 1, 3, 5] and rows.batch.group_size == 3 and rows.uids == ["p0"] * 3 + ["p1"] * 3
    completion = rows.batch.completion_ids
    assert (completion[1, 2:] == 9).all() and (completion[3, 3:] == 9).all()  # past each response: EOS, attended
    assert rows.batch.completion_mask.sum(-1).tolist() == [5, 2, 5, 3, 5, 5]
    assert rows.batch.attention_mask[:, 3:].all() and not rows.batch.attention_mask[:3, 0].any()
    torch.testing.assert_close(rows.batch.rewards, torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.25]))


def test_mini_batches_that_cut_a_group_are_refused_naming_the_settings():
    data = verl_rows()
    half = {k: v[:4] for k, v in data.items()}  # p0 x2, p1 x2 of 3 each
    with pytest.raises(ValueError, match="holds 2 of prompt 'p0''s 3 completions.*trainer.balance_batch=false"):
        verl_batch.rows_from_verl(half, eos_token_id=9, device=torch.device("cpu"), grouped=True,
                                  group_sizes=verl_batch.Counter(data["uid"]))
    uneven = {k: v[:5] for k, v in data.items()}
    with pytest.raises(ValueError, match="prompt groups of this mini-batch differ in size"):
        verl_batch.rows_from_verl(uneven, eos_token_id=9, device=torch.device("cpu"), grouped=True)
    without = {k: v for k, v in data.items() if k != "token_level_rewards"}
    with pytest.raises(KeyError, match="no 'token_level_rewards'"):
        verl_batch.rows_from_verl(without, eos_token_id=9, device=torch.device("cpu"), grouped=True)
    with pytest.raises(KeyError, match="no 'dllm_fast_unmask_step'"):
        verl_batch.rows_from_verl(data, eos_token_id=9, device=torch.device("cpu"), grouped=True, unmask_step=True)


def v1_rows(eos=9, pad=0):
    """verl_rows as verl's V1 trainer hands them to the actor: each row its own tokens in nested tensors (the prompt
    unpadded, the response the rollout's whole canvas, EOS after its end), no attention_mask, the rewards as
    `rm_scores`, the advantages nested, the rollout's own fields in each row's `extra_fields`."""
    data = verl_rows(eos=eos, pad=pad)
    P = data["prompts"].shape[1]
    prompt_real = data["attention_mask"][:, :P].bool()
    canvas = data["responses"].masked_fill(data["response_mask"] == 0, eos)
    steps = torch.arange(canvas.numel()).view(canvas.shape) % canvas.shape[1]

    def nested(rows):
        return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)

    return {"prompts": nested(p[m] for p, m in zip(data["prompts"], prompt_real)), "responses": nested(canvas),
            "response_mask": nested(torch.ones_like(canvas)), "rm_scores": nested(data["token_level_rewards"]),
            "advantages": nested(torch.zeros(canvas.shape)), "uid": data["uid"],
            "extra_fields": [{verl_batch.UNMASK_STEP_KEY: row.numpy(), verl_batch.FORWARDS_KEY: 5, "global_steps": 1}
                             for row in steps]}


def test_verl_v1_nested_rows_read_as_the_padded_rows_they_hold():
    """verl 0.9's V1 trainer hands the actor nested rows without attention_mask (its FSDP engine reads the lengths
    from the rows); they give the padded layout's batch, rows, keys and masks."""
    padded = verl_batch.rows_from_verl(verl_rows(), eos_token_id=9, device=torch.device("cpu"), grouped=True)
    data = v1_rows()
    # verl stacks a field whose rows have one length (here the responses, the whole canvas) into a plain tensor
    stacked = {**data, "responses": torch.nested.to_padded_tensor(data["responses"], 0)}
    nested, dense = [verl_batch.rows_from_verl(d, eos_token_id=9, device=torch.device("cpu"), grouped=True,
                                               unmask_step=True) for d in (data, stacked)]
    assert torch.equal(dense.batch.sequences, nested.batch.sequences) and dense.keys == nested.keys
    assert nested.order == padded.order and nested.uids == padded.uids and nested.keys == padded.keys
    assert torch.equal(nested.batch.sequences, padded.batch.sequences)
    assert torch.equal(nested.batch.attention_mask, padded.batch.attention_mask)
    assert torch.equal(nested.batch.completion_mask, padded.batch.completion_mask)
    torch.testing.assert_close(nested.batch.rewards, padded.batch.rewards)  # from rm_scores
    assert nested.prompt_lengths.tolist() == [2, 2, 2, 3, 3, 3] and nested.response_lengths.tolist() == [5] * 6
    steps = torch.stack([torch.as_tensor(row[verl_batch.UNMASK_STEP_KEY]) for row in data["extra_fields"]])
    assert torch.equal(nested.batch.unmask_step, steps[nested.order]) and nested.batch.forwards == 5
    objective = objectives.get("espo")
    model = types.SimpleNamespace(eos_token_id=9)
    ours = verl_batch.row_masks(objective, nested.batch, nested.keys, seed=3, model=model)
    theirs = verl_batch.row_masks(objective, padded.batch, padded.keys, seed=3, model=model)
    assert torch.equal(ours.masked, theirs.masked)
    assert verl_batch.verl_advantages(data, nested).tolist() == [0.0] * 6
    values = verl_batch.verl_token_values(torch.ones(6, 5, dtype=torch.float64), nested)
    assert values.offsets().diff().tolist() == [2 + 5, 3 + 5, 2 + 5, 3 + 5, 2 + 5, 3 + 5]  # verl's row order


def _split(data, rows):
    """verl's rows `rows` of a batch: a rank's share after verl's dispatch."""
    out = {}
    for key, value in data.items():
        if isinstance(value, torch.Tensor) and value.is_nested:
            out[key] = torch.nested.as_nested_tensor([value.unbind()[i] for i in rows], layout=torch.jagged)
        elif isinstance(value, torch.Tensor):
            out[key] = value[rows]
        else:
            out[key] = [value[i] for i in rows]
    return out


@pytest.mark.parametrize("layout", ["padded", "v1"])
def test_ranks_holding_parts_of_groups_train_whole_groups_with_the_same_rows(layout):
    """verl's V1 trainer hands each data-parallel rank part of every prompt group; the ranks send their rows and
    each trains the same number of whole groups: the batch, keys (so masks) and advantages are those of the whole
    batch's rows, and every row is trained once."""
    data = verl_rows() if layout == "padded" else v1_rows()
    data["advantages"] = (torch.arange(6.0)[:, None] * torch.ones(1, 5)).masked_fill(
        torch.as_tensor(verl_rows()["response_mask"]) == 0, 0.0)
    if layout == "v1":
        data["advantages"] = torch.nested.as_nested_tensor(list(torch.arange(6.0)[:, None].expand(6, 5)),
                                                           layout=torch.jagged)
    unmask = layout == "v1"
    whole = verl_batch.rows_from_verl(data, eos_token_id=9, device=torch.device("cpu"), grouped=True,
                                      unmask_step=unmask)
    parts = [verl_batch.portable_rows(_split(data, rows), rewards=True, advantages=True, unmask_step=unmask)
             for rows in ([0, 1, 2], [3, 4, 5])]  # p0 p1 p0 | p1 p0 p1
    sizes = verl_batch.Counter(data["uid"])
    trained = []
    for rank in range(2):
        share = verl_batch.rows_of_portable(verl_batch.share_of_groups(parts, rank, sizes))
        rows = verl_batch.rows_from_verl(share, eos_token_id=9, device=torch.device("cpu"), grouped=True,
                                         group_sizes=sizes, unmask_step=unmask)
        assert rows.batch.group_size == 3 and len(set(rows.uids)) == 1
        k = [whole.uids.index(rows.uids[0]) + i for i in range(3)]  # the whole batch's rows of this group
        assert rows.keys == [whole.keys[i] for i in k]
        torch.testing.assert_close(rows.batch.sequences, whole.batch.sequences[k][:, -rows.batch.sequences.shape[1]:])
        torch.testing.assert_close(rows.batch.rewards, whole.batch.rewards[k])
        torch.testing.assert_close(verl_batch.verl_advantages(share, rows), verl_batch.verl_advantages(data, whole)[k])
        if unmask:
            assert torch.equal(rows.batch.unmask_step, whole.batch.unmask_step[k])
        trained += rows.keys
    assert sorted(trained) == sorted(whole.keys)


def test_ranks_holding_whole_groups_keep_their_rows_and_groups_cut_by_mini_batches_are_refused():
    data = verl_rows()
    sizes = verl_batch.Counter(data["uid"])
    p0, p1 = [i for i, u in enumerate(data["uid"]) if u == "p0"], [i for i, u in enumerate(data["uid"]) if u == "p1"]
    parts = [verl_batch.portable_rows(_split(data, rows), rewards=True, advantages=False, unmask_step=False)
             for rows in (p1, p0)]
    assert verl_batch.share_of_groups(parts, 0, sizes) is parts[0]  # whole groups: each rank keeps its own
    cut = [verl_batch.portable_rows(_split(data, rows), rewards=True, advantages=False, unmask_step=False)
           for rows in ([0, 1], [2, 3])]  # 2 of p0's 3, 2 of p1's 3: the rest in another mini-batch
    with pytest.raises(ValueError, match="holds 2 of prompt 'p0''s 3 completions.*ppo_mini_batch_size=data.train_"
                                         "batch_size"):
        verl_batch.share_of_groups(cut, 0, sizes)
    three = [verl_batch.portable_rows(_split(data, rows), rewards=True, advantages=False, unmask_step=False)
             for rows in ([0, 1], [2, 3], [4, 5])]  # 2 groups over 3 ranks
    with pytest.raises(ValueError, match="2 prompt groups, which 3 ranks cannot share evenly.*multiple of 3"):
        verl_batch.share_of_groups(three, 0, sizes)


def test_the_rollouts_fields_missing_from_some_v1_rows_are_named():
    data = v1_rows()
    del data["extra_fields"][2][verl_batch.UNMASK_STEP_KEY]
    with pytest.raises(KeyError, match="'dllm_fast_unmask_step'.*not of row 2"):
        verl_batch.rows_from_verl(data, eos_token_id=9, device=torch.device("cpu"), grouped=False, unmask_step=True)
    data["extra_fields"] = [{} for _ in data["extra_fields"]]
    with pytest.raises(KeyError, match="no 'dllm_fast_unmask_step'"):
        verl_batch.rows_from_verl(data, eos_token_id=9, device=torch.device("cpu"), grouped=False, unmask_step=True)
    del data["responses"]
    with pytest.raises(KeyError, match="no 'responses'"):
        verl_batch.rows_from_verl(data, eos_token_id=9, device=torch.device("cpu"), grouped=False)


@pytest.mark.parametrize("name", ["espo", "bgpo", "spg", "gdpo"])
def test_a_rows_masks_do_not_depend_on_the_batch_it_is_in(name):
    """Each row's masks come from its own seed: the scoring's batch, the update's mini-batch, another rank's share
    or another order give the same masks for the same row."""
    objective = objectives.get(name)
    data = verl_rows()
    model = types.SimpleNamespace(eos_token_id=9)
    whole = verl_batch.rows_from_verl(data, eos_token_id=9, device=torch.device("cpu"), grouped=False)
    masks = verl_batch.row_masks(objective, whole.batch, whole.keys, seed=5, model=model)
    for rows in ([4, 1], [5, 0, 3]):
        part = verl_batch.rows_from_verl({k: [v[i] for i in rows] if isinstance(v, list) else v[rows]
                                          for k, v in data.items()}, eos_token_id=9, device=torch.device("cpu"),
                                         grouped=False)
        some = verl_batch.row_masks(objective, part.batch, part.keys, seed=5, model=model)
        assert torch.equal(some.masked, masks.masked[rows]) and torch.equal(some.weight, masks.weight[rows])
    other = verl_batch.row_masks(objective, whole.batch, whole.keys, seed=6, model=model)
    assert not torch.equal(other.masked, masks.masked)


@pytest.mark.parametrize("name", ["wd1", "diffu_grpo", "spg", "espo"])
def test_a_rows_masks_do_not_depend_on_how_far_its_batch_pads_the_prompts(name):
    """verl's V1 rows carry their prompts unpadded, so a rank holding only short prompts pads them less than one
    process holding the whole batch: the masks on a row's own tokens are the same either way (wd1, diffu-GRPO and
    SPG perturb the prompt, a draw per prompt position; the padding is never masked)."""
    objective = objectives.get(name)
    model = types.SimpleNamespace(eos_token_id=9)
    data = v1_rows()
    whole = verl_batch.rows_from_verl(data, eos_token_id=9, device=torch.device("cpu"), grouped=False)
    short = [r for r, uid in enumerate(data["uid"]) if uid == "p0"]  # the prompts one token shorter
    part = verl_batch.rows_from_verl(_split(data, short), eos_token_id=9, device=torch.device("cpu"), grouped=False)
    assert part.batch.prompt_length == whole.batch.prompt_length - 1 and part.keys == [whole.keys[r] for r in short]
    ours = verl_batch.row_masks(objective, part.batch, part.keys, seed=5, model=model)
    theirs = verl_batch.row_masks(objective, whole.batch, whole.keys, seed=5, model=model)
    assert not theirs.masked[short][:, :, 0].any()  # the padding position
    assert torch.equal(ours.masked, theirs.masked[short][:, :, 1:])
    assert torch.equal(ours.weight, theirs.weight[short]) and torch.equal(ours.t, theirs.t[short])
    theirs.check_sequences(whole.batch.sequences)  # the fingerprints are the padded rows'
    if name != "espo":
        assert bool(ours.masked[:, :, :part.batch.prompt_length].any())  # the prompts are perturbed


def test_per_token_values_sum_to_the_elbo_and_sit_where_verl_reads_them():
    objective = objectives.get("espo")
    rows = verl_batch.rows_from_verl(verl_rows(), eos_token_id=9, device=torch.device("cpu"), grouped=True)
    masks = verl_batch.row_masks(objective, rows.batch, rows.keys, seed=0, model=types.SimpleNamespace(eos_token_id=9))
    lp = -torch.rand(masks.scored.shape, dtype=torch.float64) * masks.scored
    values = verl_batch.per_token(lp, masks)
    torch.testing.assert_close(values.sum(-1), elbo(lp, masks))
    nested = verl_batch.verl_token_values(values, rows)
    for k, r in enumerate(rows.order):
        p, q = int(rows.prompt_lengths[k]), int(rows.response_lengths[k])
        row = nested[r]
        assert row.shape == (p + q,) and torch.equal(row[p - 1:p - 1 + q], values[k, :q])


def test_an_omegaconf_config_is_checked_as_its_dict():
    omegaconf = pytest.importorskip("omegaconf", reason="omegaconf comes with verl")
    config = omegaconf.OmegaConf.create(verl_config())
    assert verl_settings.check_verl_config(config).objective.name == "espo"
    config.actor_rollout_ref.actor.clip_ratio = 0.3
    with pytest.raises(ValueError, match="actor.clip_ratio=0.3"):
        verl_settings.check_verl_config(config)


def test_the_engine_module_without_verl_says_what_it_needs(monkeypatch):
    for name in [name for name in sys.modules if name == "verl" or name.startswith("verl.")] + ["verl"]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "dllm_fast.integrations.verl.engine", raising=False)
    with pytest.raises(ImportError, match=r"needs verl>=0.9,<0.10 \(see docs/integrations.md"):
        import dllm_fast.integrations.verl.engine  # noqa: F401
