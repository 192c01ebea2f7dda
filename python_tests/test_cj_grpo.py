"""CJ-GRPO: the loss against its twin where the official per-step pooling and DARE's per-transition mean differ
(uneven steps), fp64 gradcheck, and the notes' properties on real rollouts: every completion position is an
action of exactly one state; on-policy with k tokens a step in every row the gradient is REINFORCE on the
trajectory's token likelihood, -(1/(N L)) sum_n A_n grad sum_s log p(x_n,s+1[U_ns] | x_ns), the k3 term adding
nothing at theta = ref; one state (K = 1) is diffu-GRPO's mean-field loss without prompt perturbation."""

import copy

import pytest
import torch
import torch.nn.functional as F

import dllm_fast
from dllm_fast import objectives
from dllm_fast.contracts import RolloutBatch, completion_mask
from dllm_fast.models import LLaDAConfig, LLaDAModel
from dllm_fast.objectives import InnerUpdate
from dllm_fast.reference import objectives as twins

pytestmark = pytest.mark.usefixtures("one_thread")

P, L, G = 3, 8, 2


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return LLaDAModel(LLaDAConfig.preset("tiny")).double()


def uneven_batch(model, rewards=(1.0, 0.0, 0.5, 0.25)):
    """Four rollouts whose steps unmask different numbers of tokens per row (a threshold's rollouts), row 1 ending
    in EOS padding, row 2 left-padded."""
    gen = torch.Generator().manual_seed(0)
    sequences = torch.randint(0, 100, (4, P + L), generator=gen)
    sequences[1, P + 5:] = model.eos_token_id
    attention_mask = torch.ones_like(sequences)
    attention_mask[2, 0] = 0
    unmask_step = torch.tensor([[0, 0, 0, 1, 2, 2, 3, 3], [0, 1, 1, 1, 1, 2, 3, 3],
                                [1, 1, 0, 2, 2, 2, 2, 3], [0, 0, 0, 0, 0, 0, 0, 4]])
    return RolloutBatch(sequences, attention_mask, P, completion_mask(sequences[:, P:], model.eos_token_id),
                        torch.tensor(rewards), G, unmask_step)


def random_lp(masks, seed):
    values = -0.05 - 2.0 * torch.rand(masks.scored.shape, generator=torch.Generator().manual_seed(seed),
                                      dtype=torch.float64)
    return torch.where(masks.scored, values, 0.0)


@pytest.mark.parametrize("options", [dict(), dict(normalization="transition"), dict(micro_batch_rows=2),
                                     dict(preset="dare")], ids=["step", "transition", "rows", "dare"])
def test_the_loss_matches_its_twin_where_the_normalisations_differ(options):
    model = tiny_model()
    batch = uneven_batch(model)
    objective = objectives.get("cj_grpo", **options)
    masks = objective.draw_masks(batch, generator=torch.Generator(), eos_token_id=model.eos_token_id)
    lp_old, lp_ref = random_lp(masks, 1), random_lp(masks, 2)
    inputs = objective.prepare(batch, masks, lp_old=lp_old, lp_ref=lp_ref if objective.needs_reference else None)
    lp = random_lp(masks, 0).requires_grad_(True)
    c = objective.config
    want = twins.cj_grpo(lp, masks, batch.rewards, G, lp_old, lp_ref, unmask_step=batch.unmask_step,
                         epsilon=c.epsilon, beta=c.beta, normalization=c.normalization, rows=c.micro_batch_rows,
                         scale_rewards=c.scale_rewards, std_epsilon=c.std_epsilon, dual_clip=c.dual_clip)
    got = objective.loss(lp, inputs)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    grads = [torch.autograd.grad(value, lp)[0] for value in (got, want)]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-14)
    other = objectives.get("cj_grpo", **{**options, "normalization": "step" if c.normalization != "step"
                                          else "transition"})
    assert not torch.isclose(got, other.loss(lp, other.prepare(batch, masks, lp_old=lp_old, lp_ref=lp_ref)))
    reads = masks.targets
    assert torch.autograd.gradcheck(lambda x: objective.loss(lp.detach().masked_scatter(reads, x), inputs),
                                    lp.detach()[reads].clone().requires_grad_(True))


def rollouts(model, rewards=(1.0, 0.0, 0.0, 0.5), **settings):
    ids = torch.randint(0, 100, (2, P), generator=torch.Generator().manual_seed(3)).repeat_interleave(G, 0)
    out = dllm_fast.generate(model, ids, gen_length=L, block_length=4, temperature=1.0, record_unmask_step=True,
                             generator=torch.Generator().manual_seed(0), **settings)
    return RolloutBatch.from_generation(out, torch.tensor(rewards), group_size=G)


def naive_trajectory_gradient(model, batch, advantages):
    """-(1/N) sum_n A_n (1/K) sum_s grad log p(x_n,s+1[U_ns] | x_ns) / |U_ns|: a forward on each state's canvas (the
    positions unmasked at or after step s masked), full logits. With k tokens a step in every row (K k = L) this is
    the notes' -(1/(N L)) sum_n A_n grad sum_s log p(...); ASS's 1, 2, 4, ... weigh each step by its own count."""
    N = batch.sequences.shape[0]
    total = 0.0
    for n in range(N):
        steps = batch.unmask_step[n].unique().tolist()
        for s in steps:
            canvas = batch.sequences[n].clone()
            later = torch.cat([torch.zeros(P, dtype=torch.bool), batch.unmask_step[n] >= s])
            canvas[later] = model.mask_token_id
            logp = torch.log_softmax(F.linear(model(canvas[None]), model.lm_head_weight)[0], -1)
            now = torch.cat([torch.zeros(P, dtype=torch.bool), batch.unmask_step[n] == s]).nonzero()[:, 0]
            total = total + float(advantages[n]) * logp[now, batch.sequences[n, now]].sum() / (len(now) * len(steps))
    loss = -total / N
    return loss, torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.parametrize("settings", [dict(steps=4), dict(unmask_schedule="ass", eos_schedule=(0.01, 1.0))],
                         ids=["two a step", "eoser-ass"])
def test_on_policy_the_gradient_is_reinforce_on_the_trajectory(settings):
    model = tiny_model()
    batch = rollouts(model, **settings)
    objective = objectives.get("cj_grpo", beta=0.0)
    masks = objective.draw_masks(batch, generator=torch.Generator(), eos_token_id=model.eos_token_id)
    assert (masks.targets.sum(1) == 1).all()  # each completion position is the action of exactly one state
    per_step = torch.stack([(batch.unmask_step == s).sum(1) for s in batch.unmask_step.unique()], 1)
    assert (per_step == per_step[:1]).all()  # every row unmasks the same count at each step
    _, want = naive_trajectory_gradient(model, batch, objective.advantages(batch))
    model.zero_grad(set_to_none=True)
    out = objective.backward(model, batch, InnerUpdate(masks), micro_batch=3)
    got = [p.grad for p in model.parameters()]
    diff = sum(((g - w) ** 2).sum() for g, w in zip(got, want)).sqrt() / sum((w ** 2).sum() for w in want).sqrt()
    assert diff < 1e-10
    # the k3 term vs a reference equal to the policy: zero in value and gradient
    model.zero_grad(set_to_none=True)
    with_kl = objectives.get("cj_grpo").backward(model, batch, InnerUpdate(masks), micro_batch=3,
                                                  ref_model=copy.deepcopy(model))
    diff = sum(((p.grad - w) ** 2).sum() for p, w in zip(model.parameters(), want)).sqrt()
    assert diff / sum((w ** 2).sum() for w in want).sqrt() < 1e-10
    assert with_kl.loss.item() == pytest.approx(out.loss.item(), abs=1e-14) and with_kl.stats["kl"] == 0.0
    assert out.loss.item() == pytest.approx(0.0, abs=1e-14)  # ratios 1, k tokens a step: -mean A, 0 per group


def test_one_state_is_diffu_grpos_mean_field_loss_without_prompt_perturbation():
    model, reference = tiny_model(), tiny_model(seed=1)
    batch = rollouts(model, steps=4)
    cj = objectives.get("cj_grpo", shrink=L)  # every step merged: one state, the whole completion masked
    d1 = objectives.get("diffu_grpo", perturb_prob=0.0, count="all")
    results = []
    for objective in (cj, d1):
        masks = objective.draw_masks(batch, generator=torch.Generator().manual_seed(0),
                                     eos_token_id=model.eos_token_id)
        model.zero_grad(set_to_none=True)
        out = objective.backward(model, batch, InnerUpdate(masks), micro_batch=4, ref_model=reference)
        results.append((out.loss, [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-12, atol=1e-14)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)


def test_bad_options_are_named():
    with pytest.raises(ValueError, match=r"normalization='token' is not one of \('step', 'transition'\)"):
        objectives.get("cj_grpo", normalization="token")
    with pytest.raises(ValueError, match="dual_clip=1.0 must be"):
        objectives.get("cj_grpo", dual_clip=1.0)
    with pytest.raises(ValueError, match="micro_batch_rows=0"):
        objectives.get("cj_grpo", micro_batch_rows=0)
