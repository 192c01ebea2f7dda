"""The engine's one-pass path for sequence-local objectives (issue 38 item 4): a micro-batch of whole sequences
differentiates their loss in its own graph, with no scoring pass; its gradient, value, lp and stats equal the
two-pass engine's (fp64), it makes one forward per micro-batch, and it falls back to two passes when a sequence's
pairs do not fit in a micro-batch."""

import pytest
import torch

from dllm_fast import objectives
from dllm_fast.likelihood import BackwardHooks, MicroBatching, SequenceLocal, elbo, score, streaming_backward
from dllm_fast.objectives import InnerUpdate
from test_objectives import (VARIANTS, draw, make, perturbed, random_lp, relative_error, rollout_batch, tiny_model,
                             trainable)

pytestmark = pytest.mark.usefixtures("one_thread")

LOCAL = [(name, overrides) for name, overrides in VARIANTS if objectives.get(name).sequence_local]
REWARDS = (1.0, 0.0, 0.5, 0.5)  # the second group's rewards are equal: zero advantages (inert without a KL term)


class Counted(torch.nn.Module):
    """The model, counting its forward calls with and without a graph."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, []

    def forward(self, *args, **kwargs):
        self.calls.append(torch.is_grad_enabled())
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)


def test_the_sequence_local_objectives_are_those_without_cross_sequence_terms():
    marked = {name for name in objectives.available() if objectives.get(name).sequence_local}
    assert marked == {"espo", "vrpo_ol", "spg", "gdpo", "coupled_grpo", "ebpo"}
    assert not any(objectives.get(name).separable for name in marked)


def constants(model, objective, batch, masks):
    with torch.no_grad():
        lp_old = score(perturbed(model, seed=3), batch.sequences, masks, micro_batch=16,
                       attention_mask=batch.attention_mask)
        lp_ref = score(perturbed(model, seed=4), batch.sequences, masks, micro_batch=16,
                       attention_mask=batch.attention_mask) if objective.needs_reference else None
    return lp_old, lp_ref


def run(model, objective, batch, update, lp_ref, batching):
    model.zero_grad(set_to_none=True)
    out = objective.backward(model, batch, update, micro_batch=batching, lp_ref=lp_ref)
    return out, [p.grad.clone() for p in trainable(model)]


@pytest.mark.parametrize("name, overrides", LOCAL)
@pytest.mark.parametrize("on_policy", [True, False])
def test_one_pass_equals_two_passes_float64(name, overrides, on_policy):
    """Left padding, EOS padding, a zero-advantage group; micro-batches of one sequence, of two sequences and a
    pair to spare, and of every pair."""
    model = tiny_model()
    objective = make(name, **overrides)
    batch = rollout_batch(model, rewards=REWARDS)
    masks = draw(objective, model, batch)
    lp_old, lp_ref = constants(model, objective, batch, masks)
    update = InnerUpdate(masks, lp_old=None if on_policy else lp_old)
    n_t = masks.n_t
    want, want_grads = run(model, objective, batch, update, lp_ref, MicroBatching(n_t, one_pass=False))
    for micro_batch in (n_t, 2 * n_t + 1, 64):
        got, grads = run(model, objective, batch, update, lp_ref, MicroBatching(micro_batch))
        assert relative_error(grads, want_grads) < 1e-10, micro_batch
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(got.lp, want.lp, rtol=1e-12, atol=1e-14)
        assert got.stats == pytest.approx(want.stats, rel=1e-10, abs=1e-14)


@pytest.mark.parametrize("beta, two_pass_graphs, graph_calls, plain_calls", [(0.1, 2, 2, 0), (0.0, 1, 1, 1)])
def test_one_forward_per_micro_batch_and_inert_sequences_without_a_graph(beta, two_pass_graphs, graph_calls,
                                                                          plain_calls):
    """N = 4 sequences, n_t = 4, micro-batches of 9 pairs: two sequences each. Two passes: 16 pairs scored in 2
    calls, then recomputed in 2 (in 1 without a KL term: the zero-advantage group's coefficients are 0). One pass:
    the 2 micro-batches alone; without a KL term the zero-advantage group is inert, so one micro-batch with a
    graph and its two sequences (8 pairs) in one call without."""
    inner = tiny_model()
    objective = make("espo", beta=beta)
    batch = rollout_batch(inner, rewards=REWARDS)
    masks = draw(objective, inner, batch)
    lp_ref = constants(inner, objective, batch, masks)[1]
    counted = Counted(inner)
    _, want = run(counted, objective, batch, InnerUpdate(masks), lp_ref, MicroBatching(9, one_pass=False))
    assert counted.calls.count(True) == two_pass_graphs and counted.calls.count(False) == 2
    counted.calls.clear()
    _, got = run(counted, objective, batch, InnerUpdate(masks), lp_ref, MicroBatching(9))
    assert counted.calls.count(True) == graph_calls and counted.calls.count(False) == plain_calls
    assert relative_error(got, want) < 1e-10


def test_two_passes_when_a_sequence_does_not_fit_a_micro_batch():
    inner = tiny_model()
    objective = make("vrpo_ol")  # n_t = 4
    batch = rollout_batch(inner)
    masks = draw(objective, inner, batch)
    counted = Counted(inner)
    _, want = run(counted, objective, batch, InnerUpdate(masks), None, MicroBatching(3, one_pass=False))
    two_passes, counted.calls = counted.calls, []
    _, got = run(counted, objective, batch, InnerUpdate(masks), None, MicroBatching(3))
    assert counted.calls == two_passes and two_passes.count(False) >= 5  # 14-16 active pairs by 3, twice
    assert relative_error(got, want) == 0


def test_a_known_current_lp_keeps_the_two_pass_route():
    """lp= already skips the scoring pass; the two-pass route then also skips zero-weighted pairs."""
    inner = tiny_model()
    objective = make("gdpo")
    batch = rollout_batch(inner, rewards=REWARDS)
    masks = draw(objective, inner, batch)
    with torch.no_grad():
        lp_now = score(inner, batch.sequences, masks, micro_batch=16, attention_mask=batch.attention_mask)
    counted = Counted(inner)
    run(counted, objective, batch, InnerUpdate(masks, lp_old=lp_now, lp=lp_now), None, MicroBatching(8))
    assert counted.calls == [True]  # the two sequences of the first group; the second has zero advantages


@pytest.mark.parametrize("name, overrides", LOCAL)
def test_each_sequences_gradient_reads_its_own_lp_alone(name, overrides):
    """What the one-pass path relies on (SequenceLocal): d loss / d lp[n] does not change when the other
    sequences' lp do; and an inert sequence's is exactly 0. RSPO, which centres by the batch, fails the first."""
    model = tiny_model()
    objective = make(name, **overrides)
    batch = rollout_batch(model, rewards=REWARDS)
    masks = draw(objective, model, batch)
    lp_ref = random_lp(masks, 12, high=3.5) if objective.needs_reference else None
    for lp_old in (None, random_lp(masks, 11, high=3.0)):
        inputs = objective.prepare(batch, masks, lp_old=lp_old, lp_ref=lp_ref)
        lp = random_lp(masks, 10).requires_grad_(True)
        (grad,) = torch.autograd.grad(objective.loss(lp, inputs), lp)
        other = random_lp(masks, 13)
        for n in range(masks.num_sequences):
            moved = other.clone()
            moved[n] = lp[n].detach()
            moved.requires_grad_(True)
            (moved_grad,) = torch.autograd.grad(objective.loss(moved, inputs), moved)
            torch.testing.assert_close(moved_grad[n] * masks.scored[n], grad[n] * masks.scored[n], rtol=1e-12,
                                       atol=1e-15)
        inert = objective.inert_sequences(inputs)
        if inert is not None:
            assert inert.any()
            assert not (grad[inert] * masks.scored[inert]).any()


def test_a_batch_centred_objective_is_not_sequence_local():
    objective = make("rspo", lam=0.5)
    model = tiny_model()
    batch = rollout_batch(model)
    masks = draw(objective, model, batch)
    inputs = objective.prepare(batch, masks, lp_ref=random_lp(masks, 12))
    lp = random_lp(masks, 10).requires_grad_(True)
    (grad,) = torch.autograd.grad(objective.loss(lp, inputs), lp)
    moved = lp.detach().clone()
    moved[1:] = random_lp(masks, 13)[1:]
    moved.requires_grad_(True)
    (moved_grad,) = torch.autograd.grad(objective.loss(moved, inputs), moved)
    assert not torch.allclose(moved_grad[0], grad[0])
    assert not objective.sequence_local


def test_only_the_last_backward_synchronises_and_failures_leave_gradients_untouched():
    model = tiny_model()
    objective = make("vrpo_ol")
    batch = rollout_batch(model)
    masks = draw(objective, model, batch)
    inputs = objective.prepare(batch, masks)
    synced, depth = [], [0]

    class NoSync:
        def __enter__(self):
            depth[0] += 1

        def __exit__(self, *args):
            depth[0] -= 1

    def backward(loss):
        synced.append(depth[0] == 0)
        loss.backward()

    local = SequenceLocal(lambda lp: objective.loss(lp, inputs))
    model.zero_grad(set_to_none=True)
    streaming_backward(model, batch.sequences, masks, local, micro_batch=8, attention_mask=batch.attention_mask,
                       hooks=BackwardHooks(grad_sync=NoSync, backward=backward))
    assert synced == [False, True]
    before = [p.grad.clone() for p in trainable(model)]

    def overflowing(lp):  # a finite value, a NaN gradient on the second micro-batch's sequences (inf * 0)
        return objective.loss(lp, inputs) + torch.sqrt((lp[2:] * 0).sum())

    with pytest.raises(FloatingPointError, match="not finite at"):
        streaming_backward(model, batch.sequences, masks, SequenceLocal(overflowing), micro_batch=8,
                           attention_mask=batch.attention_mask)
    assert all(torch.equal(p.grad, b) for p, b in zip(trainable(model), before))


def test_bad_fill_and_inert_are_named():
    model = tiny_model()
    objective = make("vrpo_ol")
    batch = rollout_batch(model)
    masks = draw(objective, model, batch)

    def loss(lp):
        return -elbo(lp, masks).sum()

    for local, words in ((SequenceLocal(loss, fill=torch.zeros(4, 4)), "SequenceLocal.fill"),
                         (SequenceLocal(loss, inert=torch.zeros(4)), "SequenceLocal.inert"),
                         (SequenceLocal(loss, inert=torch.zeros(3, dtype=torch.bool)), r"\(4,\)")):
        with pytest.raises(ValueError, match=words):
            streaming_backward(model, batch.sequences, masks, local, micro_batch=8)
    with pytest.raises(TypeError, match="callable"):
        SequenceLocal(None)
