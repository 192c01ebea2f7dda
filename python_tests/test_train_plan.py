"""The one inner-update plan (Objective.plan_updates), the bundled engine settings, and checks made once per update:
masks checked once per backward and fingerprinted once per update."""

import pytest
import torch

from dllm_fast import objectives
from dllm_fast.likelihood import BackwardHooks, MicroBatching, masks as masks_module, score
from dllm_fast.objectives import InnerUpdate, Objective
from test_objectives import draw, make, perturbed, relative_error, rollout_batch, tiny_model, trainable

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_plan_draws_each_updates_masks_and_scores_the_old_policy_only_after_a_move():
    model = tiny_model()
    batch = rollout_batch(model)
    objective = make("espo")
    plan = objective.plan_updates(model, batch, moved=[False, True, True], generator=torch.Generator().manual_seed(2),
                                  micro_batch=3)
    again = torch.Generator().manual_seed(2)  # the same generator, drawn update by update
    for update in plan:
        want = objective.draw_masks(batch, generator=again, eos_token_id=model.eos_token_id)
        assert torch.equal(update.masks.masked, want.masked) and update.lp is None
    assert plan[0].lp_old is None  # before any optimizer step: on-policy, its scoring pass is the only one
    for update in plan[1:]:
        with torch.no_grad():
            want = score(model, batch.sequences, update.masks, micro_batch=16, attention_mask=batch.attention_mask)
        torch.testing.assert_close(update.lp_old, want, rtol=1e-12, atol=1e-12)
    # A ratio-free objective never needs the old policy.
    wd1 = make("wd1").plan_updates(model, batch, moved=[False, True], generator=torch.Generator(), micro_batch=3)
    assert [u.lp_old for u in wd1] == [None, None]
    with pytest.raises(ValueError, match="moved lists no inner update"):
        objective.plan_updates(model, batch, moved=[], generator=torch.Generator(), micro_batch=3)


@pytest.mark.parametrize("name", ["espo", "vrpo_ol", "diffu_grpo", "bgpo"])
def test_an_unmoved_update_is_the_first_update_with_the_old_policy_scored(name):
    """Why the plan scores nothing before the first optimizer step: on-policy (lp_old None) gives the gradient of
    the old policy scored separately and handed over as the known current lp."""
    model = tiny_model()
    batch = rollout_batch(model)
    objective = make(name)
    masks = draw(objective, model, batch)
    reference_model = perturbed(model, seed=4)
    with torch.no_grad():
        lp_now = score(model, batch.sequences, masks, micro_batch=16, attention_mask=batch.attention_mask)
    results = []
    for update in (InnerUpdate(masks), InnerUpdate(masks, lp_old=lp_now, lp=None if objective.separable else lp_now)):
        model.zero_grad(set_to_none=True)
        out = objective.backward(model, batch, update, micro_batch=3, ref_model=reference_model)
        results.append((out, [p.grad.clone() for p in trainable(model)]))
    (first, first_grads), (second, second_grads) = results
    torch.testing.assert_close(first.loss, second.loss, rtol=1e-12, atol=1e-12)
    assert relative_error(first_grads, second_grads) < 1e-10


def test_masks_are_fingerprinted_once_per_update_and_checked_once_per_backward(monkeypatch):
    """The fingerprint syncs with the host: computed when the masks are drawn, never again for the same
    sequences (old policy, reference, engine); check_masks runs once per backward."""
    model = tiny_model()
    batch = rollout_batch(model)
    objective = make("espo")  # a ratio to the old policy and a KL to the reference: every scoring path runs
    fingerprints, checks = [], []
    fingerprint = masks_module.sequence_fingerprint
    monkeypatch.setattr(masks_module, "sequence_fingerprint", lambda s: fingerprints.append(1) or fingerprint(s))
    check_masks = Objective.check_masks
    monkeypatch.setattr(Objective, "check_masks", lambda self, m, b: checks.append(1) or check_masks(self, m, b))
    plan = objective.plan_updates(model, batch, moved=[False, True], generator=torch.Generator().manual_seed(0),
                                  micro_batch=3)
    for update in plan:
        objective.backward(model, batch, update, micro_batch=3, ref_model=perturbed(model))
    assert len(fingerprints) == len(plan) and len(checks) == len(plan)
    # Sequences changed in place after the draw are checked again (and caught).
    batch.sequences[0, 0] = (batch.sequences[0, 0] + 1) % 100
    with pytest.raises(ValueError, match=r"sequences\[0\] is not the sequence these masks were drawn for"):
        objective.backward(model, batch, plan[0], micro_batch=3, ref_model=perturbed(model))


@pytest.mark.slow
def test_the_trainer_plans_its_updates_through_the_objective(tmp_path, monkeypatch):
    from test_trainer import quick_config

    from dllm_fast.train import train

    calls = []
    plan_updates = Objective.plan_updates
    monkeypatch.setattr(Objective, "plan_updates", lambda self, *a, **k: calls.append(k["moved"]) or
                        plan_updates(self, *a, **k))
    train(quick_config(tmp_path, steps=1, inner_updates=3, eval_every=10, checkpoint_every=10, eval_examples=4,
                       objective="vrpo_ol", objective_options={"n_t": 2}))
    assert calls == [[False, True, True]]


def test_bundled_settings_check_their_fields():
    assert MicroBatching.of(4) == MicroBatching(4) and MicroBatching(4, 8).scoring == 8
    assert MicroBatching(4).scoring == 4
    with pytest.raises(ValueError, match="micro_batch=0 must be an int >= 1"):
        MicroBatching(0)
    with pytest.raises(TypeError, match="chunk_size=1.5 must be an int"):
        MicroBatching(4, chunk_size=1.5)
    with pytest.raises(TypeError, match="backward must be callable"):
        BackwardHooks(backward="accelerator")
    with pytest.raises(TypeError, match="sync_gradients=1 must be True or False"):
        BackwardHooks(sync_gradients=1)
    with pytest.raises(TypeError, match="update must be an InnerUpdate"):
        make("vrpo_ol").backward(tiny_model(), rollout_batch(tiny_model()), "masks", micro_batch=2)


def test_a_separable_objective_takes_the_whole_bundle():
    """score_micro_batch sets the no-grad scoring calls; a separable objective has none in the engine, so the same
    MicroBatching the trainer passes every objective gives the same gradient there."""
    model = tiny_model()
    batch = rollout_batch(model)
    objective = make("bgpo")
    masks = draw(objective, model, batch)
    grads = []
    for micro_batch in (3, MicroBatching(3, score_micro_batch=7, chunk_size=50)):
        model.zero_grad(set_to_none=True)
        objective.backward(model, batch, InnerUpdate(masks), micro_batch=micro_batch)
        grads.append([p.grad.clone() for p in trainable(model)])
    assert relative_error(grads[1], grads[0]) < 1e-12
    assert objectives.available()
