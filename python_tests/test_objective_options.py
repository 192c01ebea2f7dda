"""Each reproduction option and each new objective against a value worked out by hand on a tiny batch (the
numbers in the comments), besides the loop-written twins of test_objectives.py: a twin written from the same
reading could share its mistake, a hand-computed number from the paper's or the code's formula cannot."""

import math

import pytest
import torch

from dllm_fast import objectives
from dllm_fast.contracts import RolloutBatch
from dllm_fast.likelihood import MonteCarloMasks

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(objective, scored, rewards, group_size=2, weight=None, counted=None, lp_old=None, lp_ref=None,
         t=None):
    """LossInputs for hand-built masks: scored [N, n_t, L] is what each sample masks (prompt length 0), weights 1
    unless given; counted defaults to every position some sample scores."""
    scored = torch.tensor(scored, dtype=torch.bool)
    N, n_t, L = scored.shape
    counted = scored.any(1) if counted is None else torch.tensor(counted, dtype=torch.bool)
    weight = torch.ones(N, n_t, dtype=torch.float64) if weight is None else torch.tensor(weight, dtype=torch.float64)
    masks = MonteCarloMasks(masked=scored | ~counted[:, None, :], counted=counted, weight=weight,
                            t=torch.ones_like(weight) if t is None else torch.tensor(t, dtype=torch.float64),
                            num_masked=scored.sum(-1), prompt_length=0, sampler=objective.config.sampler)
    batch = RolloutBatch(torch.zeros(N, L, dtype=torch.long), None, 0, counted.clone(),
                         torch.tensor(rewards, dtype=torch.float32), group_size)
    return objective.prepare(batch, masks, lp_old=lp_old, lp_ref=lp_ref)


def lp_of(values):
    return torch.tensor(values, dtype=torch.float64)


def value_and_coef(objective, inputs, lp):
    lp = lp.clone().requires_grad_(True)
    value = objective.loss(lp, inputs)
    (coef,) = torch.autograd.grad(value, lp)
    return value.item(), coef


# ---------------------------------------------------------------------------------------------------------
# d1


FOUR_ROWS = [[[1, 1]], [[1, 0]], [[1, 1]], [[1, 1]]]  # n_t = 1: tokens per row 2, 1, 2, 2


def test_d1_normalised_per_micro_batch():
    """rewards (1, 0, 1, 0): A = (.5, -.5, .5, -.5); on-policy, beta 0, so each token's term is -A.
    Batch: (-1 + .5 - 1 + 1) / 7 = -1/14. Micro-batches of 2 rows: [(-1 + .5) / 3 + (-1 + 1) / 4] / 2 = -1/12;
    the row-1 token's coefficient .5 / 3 / 2 = 1/12."""
    lp = lp_of([[[-1.0, -2.0]], [[-0.5, 0.0]], [[-1.5, -0.2]], [[-0.3, -0.4]]])
    d1 = objectives.get("diffu_grpo", beta=0.0)
    assert value_and_coef(d1, tiny(d1, FOUR_ROWS, [1, 0, 1, 0]), lp)[0] == pytest.approx(-1 / 14, abs=1e-15)
    per_micro = objectives.get("diffu_grpo", beta=0.0, normalize_per="micro_batch", micro_batch_rows=2)
    value, coef = value_and_coef(per_micro, tiny(per_micro, FOUR_ROWS, [1, 0, 1, 0]), lp)
    assert value == pytest.approx(-1 / 12, abs=1e-15)
    assert coef[1, 0, 0].item() == pytest.approx(1 / 12, abs=1e-15)


def test_d1_dual_clip_and_std_scaled_advantage():
    """One token with A < 0 and ratio 5 (lp - lp_old = log 5), eps 0.2: PPO's term is -min(5 A, 1.2 A) = -5 A;
    DARE's dual clip c = 3 bounds it at -3 A. Rewards (0, 1): A_0 = -.5 / (std + 1e-6), std = sqrt(.5)."""
    scored = [[[1]], [[1]]]
    lp_old = lp_of([[[-2.0]], [[-1.0]]])
    lp = lp_of([[[-2.0 + math.log(5)]], [[-1.0]]])
    plain = objectives.get("diffu_grpo", beta=0.0, epsilon=0.2)
    inputs = tiny(plain, scored, [0, 1], lp_old=lp_old)
    assert inputs.advantages.tolist() == [-0.5, 0.5]
    assert value_and_coef(plain, inputs, lp)[0] == pytest.approx((5 * 0.5 - 0.5) / 2, abs=1e-12)
    dual = objectives.get("diffu_grpo", beta=0.0, epsilon=0.2, dual_clip=3.0)
    value, coef = value_and_coef(dual, tiny(dual, scored, [0, 1], lp_old=lp_old), lp)
    assert value == pytest.approx((3 * 0.5 - 0.5) / 2, abs=1e-12)
    assert coef[0, 0, 0] == 0  # the bound is flat in the ratio
    scaled = objectives.get("diffu_grpo", scale_rewards=True)
    advantage = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(tiny(scaled, scored, [0, 1], lp_ref=lp_old).advantages,
                               torch.tensor([-advantage, advantage], dtype=torch.float64), rtol=1e-15, atol=0)
    dare = objectives.get("diffu_grpo", preset="dare")
    assert (dare.config.epsilon, dare.config.dual_clip, dare.config.scale_rewards, dare.config.beta) == \
        (0.2, 3.0, True, 0.0)


# ---------------------------------------------------------------------------------------------------------
# wd1, VRPO-OL, BGPO


def test_wd1_psi_and_positive_only():
    """G = 2, rewards (1, 0): A = (.5, -.5). w+ = softmax(psi A) = (s(psi), s(-psi)) with s the logistic, w- the
    reverse; log pi = (l0, l1). Loss (-w+_0 + w-_0) l0 + (-w+_1 + w-_1) l1 = -tanh(psi/2) l0 + tanh(psi/2) l1;
    positive-only: -s(psi) l0 - s(-psi) l1."""
    lp = lp_of([[[-1.0, -2.0]], [[-0.5, -0.25]]])
    l0, l1 = -3.0, -0.75
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    for psi in (1.0, 2.0):
        objective = objectives.get("wd1", psi=psi)
        want = -math.tanh(psi / 2) * l0 + math.tanh(psi / 2) * l1
        assert value_and_coef(objective, tiny(objective, [[[1, 1]], [[1, 1]]], [1, 0]), lp)[0] == \
            pytest.approx(want, abs=1e-12)
    positive = objectives.get("wd1", psi=2.0, negative_term=False)
    assert value_and_coef(positive, tiny(positive, [[[1, 1]], [[1, 1]]], [1, 0]), lp)[0] == \
        pytest.approx(-sigmoid(2.0) * l0 - sigmoid(-2.0) * l1, abs=1e-12)


def test_vrpo_ol_unscaled_advantage():
    """ELBO = sum lp (weight 1); rewards (1, 0) give A = (.5, -.5) unscaled, (.5, -.5) / (sqrt(.5) + 1e-6) scaled.
    ELBO - ELBO_old = (.2, -.1): loss = -(e^.2 .5 - e^-.1 .5) / 2."""
    objective = objectives.get("vrpo_ol", n_t=1, scale_rewards=False)
    lp_old = lp_of([[[-1.0, -1.0]], [[-2.0, -1.0]]])
    lp = lp_of([[[-0.9, -0.9]], [[-2.0, -1.1]]])
    inputs = tiny(objective, [[[1, 1]], [[1, 1]]], [1, 0], lp_old=lp_old)
    assert value_and_coef(objective, inputs, lp)[0] == pytest.approx(-(math.exp(0.2) - math.exp(-0.1)) * 0.25,
                                                                     abs=1e-12)
    scaled = objectives.get("vrpo_ol", n_t=1)
    factor = 1 / (math.sqrt(0.5) + 1e-6)
    assert value_and_coef(scaled, tiny(scaled, [[[1, 1]], [[1, 1]]], [1, 0], lp_old=lp_old), lp)[0] == \
        pytest.approx(-(math.exp(0.2) - math.exp(-0.1)) * 0.25 * factor, abs=1e-12)


def test_bgpo_length_weighted_micro_batches():
    """On-policy the bound of sequence n is A_n (d = 0). Rewards (1, 0, 1, 0): A = +-a, a = .5 / (sqrt(.5) +
    1e-6); counted lengths (2, 1, 2, 2). DARE's token-mean per micro-batch of 2: -[(2a - a) / 3 + (2a - 2a) / 4]
    / 2 = -a / 6; the plain mean is 0 (A sums to zero)."""
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    lp = lp_of([[[-1.0, -2.0]], [[-0.5, 0.0]], [[-1.5, -0.2]], [[-0.3, -0.4]]])
    weighted = objectives.get("bgpo", n_t=1, aggregation="length_weighted", micro_batch_rows=2)
    assert value_and_coef(weighted, tiny(weighted, FOUR_ROWS, [1, 0, 1, 0]), lp)[0] == pytest.approx(-a / 6,
                                                                                                   abs=1e-12)
    plain = objectives.get("bgpo", n_t=1)
    assert value_and_coef(plain, tiny(plain, FOUR_ROWS, [1, 0, 1, 0]), lp)[0] == pytest.approx(0.0, abs=1e-15)
    # with micro-batches of one sequence (DARE's recipe) the weighting is the plain mean
    single = objectives.get("bgpo", n_t=1, aggregation="length_weighted", micro_batch_rows=1)
    assert value_and_coef(single, tiny(single, FOUR_ROWS, [1, 0, 1, 0]), lp)[0] == pytest.approx(0.0, abs=1e-15)


# ---------------------------------------------------------------------------------------------------------
# SPG


def test_spg_defaults_presets_and_the_no_negative_term_ablation():
    """Paper's main setting beta 1.5, Sudoku 1.0. bound="zero": rewards (1, 0) give A = (.5, -.5) and only the
    positive sequence's ELBO counts: -(.5 ELBO_0) / 2 with ELBO_0 = sum lp (weight 1) = -3."""
    assert objectives.get("spg").config.beta == 1.5
    assert objectives.get("spg", preset="sudoku").config.beta == 1.0
    assert objectives.get("spg", preset="sudoku", beta=2.0).config.beta == 2.0  # options override a preset
    objective = objectives.get("spg", n_t=1, bound="zero")
    lp = lp_of([[[-1.0, -2.0]], [[-0.5, -0.25]]])
    value, coef = value_and_coef(objective, tiny(objective, [[[1, 1]], [[1, 1]]], [1, 0]), lp)
    assert value == pytest.approx(-(0.5 * -3.0) / 2, abs=1e-15)
    assert (coef[1] == 0).all() and (coef[0] == -0.25).all()


def test_spg_token_normalisation_per_micro_batch():
    """normalization="token": Lhat_n = ELBO_n / L_n and the weighting sum_n A Lhat |C_n| / sum |C| = sum_n A ELBO_n
    / sum |C|. Rewards (1, 1, 1, 0) (groups of 2): A = (0, 0, .5, -.5), only rows 2, 3 count; with ELBO weights 1,
    ELBO = (-3, -.5, -1.7, -.7) and the mixture for the negative row; take bound "elbo" to keep it linear. Batch:
    -(.5 (-1.7) - .5 (-.7)) / 7 = .5/7; micro-batches of 2: -[0 / 3 + (.5 (-1.7) - .5 (-.7)) / 4] / 2 = .5/8."""
    lp = lp_of([[[-1.0, -2.0]], [[-0.5, 0.0]], [[-1.5, -0.2]], [[-0.3, -0.4]]])
    batch = objectives.get("spg", n_t=1, bound="elbo", normalization="token")
    assert value_and_coef(batch, tiny(batch, FOUR_ROWS, [1, 1, 1, 0]), lp)[0] == pytest.approx(0.5 / 7, abs=1e-15)
    micro = objectives.get("spg", n_t=1, bound="elbo", normalization="token", normalize_per="micro_batch",
                           micro_batch_rows=2)
    assert value_and_coef(micro, tiny(micro, FOUR_ROWS, [1, 1, 1, 0]), lp)[0] == pytest.approx(0.5 / 8, abs=1e-15)


# ---------------------------------------------------------------------------------------------------------
# ESPO, RSPO


def test_espo_reward_scaling_kl_estimators_and_counted_length():
    """One group of 2, rewards (1, 0), ELBO weight 1, L = 3 positions, counted lengths (3, 2).
    scale_rewards: A = +-.5 / (sqrt(.5) + 1e-4). KL (beta 1, on-policy): d = ELBO - ELBO_ref = (.3, -.2);
    k2 = d^2 / 2, k3 = e^-d + d - 1, summed / (N L) = / 6, or / (N L_n) with length="counted"; k1's value is d
    and its gradient (1 + d) dELBO."""
    scored = [[[1, 1, 1]], [[1, 1, 0]]]
    counted = [[1, 1, 1], [1, 1, 0]]
    lp = lp_of([[[-1.0, -1.0, -1.0]], [[-0.5, -0.5, 0.0]]])
    lp_ref = lp_of([[[-1.1, -1.1, -1.1]], [[-0.4, -0.4, 0.0]]])
    d = [0.3, -0.2]
    scaled = objectives.get("espo", n_t=1, sampler="random_t", count="eos", scale_rewards=True, beta=0.0)
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert tiny(scaled, scored, [1, 0], counted=counted).advantages.tolist() == pytest.approx([a, -a], abs=1e-15)
    for estimator, per_sequence in (("k2", [x**2 / 2 for x in d]), ("k3", [math.exp(-x) + x - 1 for x in d]),
                                    ("k1", d)):
        objective = objectives.get("espo", n_t=1, sampler="random_t", count="eos", kl_estimator=estimator, beta=1.0)
        inputs = tiny(objective, scored, [1, 1], counted=counted, lp_ref=lp_ref)  # A = 0: the KL term alone
        value, coef = value_and_coef(objective, inputs, lp)
        assert value == pytest.approx(sum(per_sequence) / 6, abs=1e-12), estimator
        counted_length = objectives.get("espo", n_t=1, sampler="random_t", count="eos", kl_estimator=estimator,
                                        beta=1.0, length="counted")
        inputs = tiny(counted_length, scored, [1, 1], counted=counted, lp_ref=lp_ref)
        assert value_and_coef(counted_length, inputs, lp)[0] == \
            pytest.approx((per_sequence[0] / 3 + per_sequence[1] / 2) / 2, abs=1e-12), estimator
        if estimator == "k1":
            assert coef[0, 0, 0].item() == pytest.approx((1 + 0.3) / 6, abs=1e-12)
    # the counted length in the ratio: ELBO - ELBO_old = (.3, .2) over L_n = (3, 2) -> rho = e^.1 for both
    objective = objectives.get("espo", n_t=1, sampler="random_t", count="eos", length="counted", beta=0.0,
                               epsilon_low=1.0, epsilon_high=1.0)
    lp_old = lp_of([[[-1.1, -1.1, -1.1]], [[-0.6, -0.6, 0.0]]])
    inputs = tiny(objective, scored, [1, 0], counted=counted, lp_old=lp_old)
    assert objective.ratio(lp, inputs).tolist() == pytest.approx([math.exp(0.1)] * 2, abs=1e-12)


def test_rspo_centres_within_micro_batches():
    """delta_n = (ELBO - ELBO_ref) / L_n with L_n = 2: (.4, .2, -.2, .6) -> centred per micro-batch of 2:
    (.1, -.1, -.4, .4); weights A - lam sg(delta_hat), rewards (1, 0, 1, 0), lam .5: A = (.5, -.5, .5, -.5)."""
    lp = lp_of([[[-1.0, -1.0]], [[-1.0, -1.0]], [[-1.0, -1.0]], [[-1.0, -1.0]]])
    lp_ref = lp_of([[[-1.4, -1.4]], [[-1.2, -1.2]], [[-0.8, -0.8]], [[-1.6, -1.6]]])
    objective = objectives.get("rspo", n_t=1, center="micro_batch", micro_batch_rows=2, lam=0.5)
    inputs = tiny(objective, [[[1, 1]]] * 4, [1, 0, 1, 0], lp_ref=lp_ref)
    _, delta_hat = objective.relative_score(lp, inputs)
    assert delta_hat.tolist() == pytest.approx([0.1, -0.1, -0.4, 0.4], abs=1e-12)
    weights = [0.5 - 0.05, -0.5 + 0.05, 0.5 + 0.2, -0.5 - 0.2]
    want = -sum(w * h for w, h in zip(weights, [0.1, -0.1, -0.4, 0.4])) / 4
    assert value_and_coef(objective, inputs, lp)[0] == pytest.approx(want, abs=1e-12)


# ---------------------------------------------------------------------------------------------------------
# coupled-GRPO, GDPO, TraceRL


def test_coupled_grpo_by_hand():
    """One pair (n_t = 3, t = .25): weights 3/2 (1, 4, 4/3); per-token estimate (lp_full + 4 lp_first + 4/3
    lp_second) / 2. One token of each row: row 0 in the first half, row 1 in the second. Rewards (1, 0), the
    leave-one-out advantage r_i - r_j = (1, -1). Off-policy: the estimates move by (+.1, +.2) (first-half
    lp .05 up for row 0: 2 x .05; second-half lp .3 up for row 1: 2/3 x .3); eps .5 keeps both ratios unclipped:
    loss = -(e^.1 1 + e^.2 (-1)) / 2 tokens."""
    scored = [[[1], [1], [0]], [[1], [0], [1]]]
    weight = [[1.5, 6.0, 2.0], [1.5, 6.0, 2.0]]
    objective = objectives.get("coupled_grpo", beta=0.0)
    lp_old = lp_of([[[-1.0], [-0.5], [0.0]], [[-2.0], [0.0], [-0.6]]])
    lp = lp_of([[[-1.0], [-0.45], [0.0]], [[-2.0], [0.0], [-0.3]]])
    inputs = tiny(objective, scored, [1, 0], weight=weight, lp_old=lp_old, t=[[1, .25, .75]] * 2)
    assert inputs.advantages.tolist() == [1.0, -1.0]
    value, coef = value_and_coef(objective, inputs, lp)
    assert value == pytest.approx(-(math.exp(0.1) - math.exp(0.2)) / 2, abs=1e-12)
    # d loss / d lp_first of row 0 = -A e^.1 * (4 / 2) / 2 tokens
    assert coef[0, 1, 0].item() == pytest.approx(-math.exp(0.1) * 2 / 2, abs=1e-12)


def test_gdpo_by_hand():
    """One Gauss node (t = 1/2, c = 1): weight c / t = 2, ELBO = 2 sum lp. Counted lengths (2, 1); ELBO - ELBO_old =
    2 (.1, -.05) so rho = (e^{.2 / 2}, e^{-.1 / 1}); rewards (1, 0): A = (.5, -.5), eps .2 leaves both inside:
    loss = -(.5 e^.1 - .5 e^-.1) / 2."""
    objective = objectives.get("gdpo", n_t=1)
    lp_old = lp_of([[[-1.0, -1.0]], [[-1.0, 0.0]]])
    lp = lp_of([[[-0.95, -0.95]], [[-1.05, 0.0]]])
    inputs = tiny(objective, [[[1, 1]], [[1, 0]]], [1, 0], weight=[[2.0], [2.0]], counted=[[1, 1], [1, 0]],
                  lp_old=lp_old)
    assert objective.ratio(lp, inputs).tolist() == pytest.approx([math.exp(0.1), math.exp(-0.1)], abs=1e-12)
    assert value_and_coef(objective, inputs, lp)[0] == pytest.approx(-(0.5 * math.exp(0.1) - 0.5 * math.exp(-0.1))
                                                                     / 2, abs=1e-12)


def test_tracerl_by_hand():
    """Row 0 has two states reading 2 and 1 tokens, row 1 one state of 2 tokens: R = 3 states. Rewards (1, 0): the
    population z-score is (1, -1). On-policy each state's mean surrogate is A: loss = -(1 + 1 - 1) / 3; the
    coefficient of a token is -A / (R |T|). The KL to the old policy adds beta sum k3 per state: with lp one
    .1 below lp_old on row 1's tokens, k3 = e^.1 - .1 - 1 each."""
    objective = objectives.get("tracerl", beta=0.0)
    target = torch.tensor([[[1, 1, 0], [0, 0, 1]], [[1, 1, 0], [0, 0, 0]]], dtype=torch.bool)
    N, n_t, L = target.shape
    counted = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    masked = torch.tensor([[[1, 1, 1], [0, 0, 1]], [[1, 1, 1], [0, 0, 0]]], dtype=torch.bool)
    weight = torch.full((N, n_t), 2.0, dtype=torch.float64)
    masks = MonteCarloMasks(masked=masked, counted=counted, weight=weight, t=torch.ones_like(weight),
                            num_masked=target.sum(-1), prompt_length=0, sampler="trajectory", target=target)
    batch = RolloutBatch(torch.zeros(N, L, dtype=torch.long), None, 0, counted.clone(), torch.tensor([1.0, 0.0]), 2)
    lp = lp_of([[[-1.0, -2.0, -0.5], [0.0, 0.0, -0.3]], [[-0.4, -0.6, 0.0], [0.0, 0.0, 0.0]]])
    inputs = objective.prepare(batch, masks)
    assert inputs.advantages.tolist() == [1.0, -1.0]
    value, coef = value_and_coef(objective, inputs, lp)
    assert value == pytest.approx(-1 / 3, abs=1e-15)
    assert coef[0, 0, 0].item() == pytest.approx(-1 / 6, abs=1e-15)
    assert coef[0, 1, 2].item() == pytest.approx(-1 / 3, abs=1e-15)
    assert coef[0, 0, 2] == 0  # masked as context in state 0, read in state 1 only
    with_kl = objectives.get("tracerl", beta=0.5)
    lp_old = torch.where(target, lp, 0.0)
    lp_old[1, 0, :2] += 0.1
    inputs = with_kl.prepare(batch, masks, lp_old=torch.where(masks.scored, lp_old, 0.0) + 0.0 * lp)
    k3 = math.exp(0.1) - 0.1 - 1
    ratio = math.exp(-0.1)
    want = (-1 - 1 + ratio * 1 + 0.5 * 2 * k3) / 3  # row 1: ratio e^-.1 with A = -1 is unclipped
    assert value_and_coef(with_kl, inputs, lp)[0] == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("name, options, asked, up, down", [
    ("espo", {}, 3, 4, 2),                          # complementary pairs: even
    ("coupled_grpo", {}, 2, 3, 1),                  # a full mask plus pairs: odd
    ("gdpo", {"quadrature_points": 3}, 4, 6, 3),    # a multiple of its Gauss-Legendre nodes
    ("vrpo_ol", {}, 5, 5, 5),                       # any n_t
])
def test_nearest_valid_n_t_asks_the_objective(name, options, asked, up, down):
    assert objectives.nearest_valid_n_t(name, asked, **options) == up
    assert objectives.nearest_valid_n_t(name, asked, down=True, **options) == down
    objectives.get(name, n_t=up, **options)  # accepted as found
