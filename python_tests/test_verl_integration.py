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
    monkeypatch.setitem(sys.modules, "verl", None)
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
