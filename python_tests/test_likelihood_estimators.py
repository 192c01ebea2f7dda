"""Estimators as pure functions of lp: against the plain reference formulas, values and gradients."""

import math

import pytest
import torch

from dllm_fast import reference
from dllm_fast.likelihood import SAMPLERS, elbo, eubo, eubo_per_position, mean_field, mixture, sample_masks

P, L = 3, 9


pytestmark = pytest.mark.usefixtures("one_thread")


def lp_and_masks(sampler, n_t=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    sequences = torch.randint(0, 50, (3, P + L), generator=gen)
    sequences[1, P + 5:] = 99  # EOS
    options = {}
    if sampler == "coupled":
        n_t += 1 - n_t % 2  # the full mask and pairs
    if sampler == "trajectory":  # two positions decoded per step, in a random order
        n_t, options["unmask_step"] = None, torch.rand(3, L, generator=gen).argsort(-1).argsort(-1) // 2
    if sampler in ("recorded_state", "tree_edge"):  # MDPO's state (0 given, >= 1 masked); an edge's stages 0-2
        stages = 2 if sampler == "recorded_state" else 3
        n_t, options["unmask_step"] = 1, torch.rand(3, L, generator=gen).argsort(-1).argsort(-1) % stages
    if SAMPLERS[sampler].data_n_t:  # e.g. autoregressive: a sample per position
        n_t = None
    masks = sample_masks(sequences, prompt_length=P, n_t=n_t, sampler=sampler, eos_token_id=99, generator=gen,
                         block_length=3, **options)
    lp = -3 * torch.rand(masks.scored.shape, generator=gen, dtype=torch.float64) * masks.scored
    return lp.requires_grad_(), masks


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_elbo_and_eubo_match_the_plain_formulas(sampler):
    lp, masks = lp_and_masks(sampler)
    for ours, plain in ((elbo(lp, masks), reference.likelihood.mc_elbo(lp, masks)),
                        (eubo(lp, masks, 1.5), reference.likelihood.mc_eubo(lp, masks, 1.5))):
        torch.testing.assert_close(ours, plain, rtol=1e-12, atol=1e-12)
        upstream = torch.randn(3, dtype=torch.float64)
        got, = torch.autograd.grad(ours, lp, upstream)
        want, = torch.autograd.grad(plain, lp, upstream)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_elbo_is_the_weighted_sum_by_hand():
    lp, masks = lp_and_masks("stratified_l")
    n = 1
    by_hand = sum(masks.num_counted[n].item() / masks.num_masked[n, j].item() * lp[n, j].sum().item()
                  for j in range(masks.n_t)) / masks.n_t
    assert elbo(lp, masks)[n].item() == pytest.approx(by_hand, rel=1e-12)


def test_eubo_drops_never_masked_positions_with_finite_gradients():
    lp, masks = lp_and_masks("stratified_l", n_t=1)  # one sample: most positions are never masked
    values, present = eubo_per_position(lp, masks, beta=1.0)
    assert torch.equal(present, masks.scored[:, 0])
    assert (values[~present] == 0).all()
    # with a single sample and beta = 1, EUBO_i = log(w) + lp_i at each masked position
    expected = torch.where(present, masks.weight.log() + lp[:, 0], 0.0)
    torch.testing.assert_close(values, expected, rtol=1e-12, atol=1e-12)
    grad, = torch.autograd.grad(values.sum(), lp)
    assert torch.isfinite(grad).all() and (grad[~masks.scored] == 0).all()


def test_eubo_is_stable_in_log_space():
    """Very negative log-probs: exp(beta * lp) underflows in the direct form, the log-space form stays finite."""
    lp, masks = lp_and_masks("complementary")
    scaled = (lp.detach() * 400).requires_grad_()
    values = eubo(scaled, masks, beta=2.0)
    assert torch.isfinite(values).all()
    assert not torch.isfinite(reference.likelihood.mc_eubo(scaled, masks, 2.0)).all()
    assert torch.isfinite(torch.autograd.grad(values.sum(), scaled)[0]).all()


def test_mixture_and_mean_field():
    lp, masks = lp_and_masks("block")
    torch.testing.assert_close(mixture(lp, masks, beta=1.5, omega=0.25),
                               0.25 * eubo(lp, masks, 1.5) + 0.75 * elbo(lp, masks))
    torch.testing.assert_close(mixture(lp, masks, omega=0.0), elbo(lp, masks))
    lp, masks = lp_and_masks("mean_field", n_t=1)
    torch.testing.assert_close(mean_field(lp, masks), lp[:, 0].sum(-1))
    torch.testing.assert_close(mean_field(lp, masks), elbo(lp, masks))
    assert torch.equal(masks.num_counted, torch.tensor([L, 6, L]))


def test_beta_controls_sharpening():
    """EUBO(beta) is nondecreasing in beta for a fixed sample set (power mean inequality on exp(lp))."""
    lp, masks = lp_and_masks("stratified_l", n_t=8)
    lp = lp.detach()
    values = [eubo_per_position(lp, masks, beta)[0] for beta in (0.5, 1.0, 2.0)]
    # (1/b) log mean w e^{b lp} with the weights normalised is a power mean; compare on normalised weights
    weight = masks.weight[..., None] * masks.scored
    normaliser = weight.mean(1).clamp_min(1e-300).log()
    means = [v - normaliser / b for v, b in zip(values, (0.5, 1.0, 2.0))]
    present = masks.scored.any(1)
    assert (means[0][present] <= means[1][present] + 1e-12).all()
    assert (means[1][present] <= means[2][present] + 1e-12).all()
    assert math.isfinite(values[0].sum().item())
