"""Likelihoods of LLaDA2: lp[N, n_t, L] from the one-forward two-stream scoring equals per-block scoring on the fp64
twin (reference/llada2.py: a forward per block on [the clean earlier blocks, the block noisy]) to 1e-12; the
streaming engine's gradient equals fp64 autograd through the per-block scoring to 1e-10 (the router's weights and
the experts included); memory stays flat in n_t; the one-pass engine equals the two-pass one."""

import copy

import pytest
import torch

from dllm_fast.likelihood import MicroBatching, Separable, elbo, sample_masks, score, streaming_backward
from dllm_fast.models import LLaDA2Config, LLaDA2Model
from dllm_fast.reference import llada2 as reference
from dllm_fast.testing.memory import track_allocations

pytestmark = pytest.mark.usefixtures("one_thread")

MASK, EOS = 127, 126
N, P, L = 4, 7, 10


def llada2(dtype=torch.float64, seed=1, **overrides):
    config = LLaDA2Config(**{**LLaDA2Config.preset("llada2-tiny").__dict__, "extra": {}, **overrides})
    return LLaDA2Model.with_random_weights(config, dtype=dtype, seed=seed)


def rollouts(seed=0):
    """Left padding of 0..3 positions (every alignment of a block of 4), an EOS ending row 1 early."""
    gen = torch.Generator().manual_seed(seed)
    sequences = torch.randint(0, 120, (N, P + L), generator=gen)
    mask = torch.ones_like(sequences)
    for n in range(N):
        mask[n, :n] = 0
    sequences = sequences.masked_fill(mask == 0, EOS)
    sequences[1, P + 6:] = EOS
    return sequences, mask


def draw(sequences, mask, sampler, n_t=3, seed=0):
    extra = {}
    if sampler == "trajectory":
        extra = dict(n_t=None, unmask_step=torch.arange(L).repeat(N, 1) // 2)
    return sample_masks(sequences, prompt_length=P, sampler=sampler, generator=torch.Generator().manual_seed(seed),
                        eos_token_id=EOS, attention_mask=mask, block_length=4, **({"n_t": n_t} | extra))


def naive(model, sequences, masks, mask):
    lp = reference.block_logprobs(reference.official_weights(model), model.config, sequences, masks.masked, P, mask,
                                  MASK)
    return lp * masks.scored


@pytest.mark.parametrize("sampler", ["stratified_l", "block_elbo", "mean_field", "trajectory"])
def test_the_two_stream_forward_equals_per_block_scoring(sampler):
    """All blocks of a pair in one two-stream forward = a forward per block (mean_field also masks prompt tokens,
    which every block sees masked)."""
    model = llada2()
    sequences, mask = rollouts()
    masks = draw(sequences, mask, sampler)
    with torch.no_grad():
        lp = score(model, sequences, masks, micro_batch=5, attention_mask=mask)
        torch.testing.assert_close(lp, naive(model, sequences, masks, mask), rtol=0, atol=1e-12)
    assert (lp[masks.scored] < 0).all()


@pytest.mark.parametrize("separable", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_the_engine_gradient_equals_fp64_autograd_through_per_block_scoring(separable):
    """A nonlinear objective (VRPO-OL's exp of the ELBO) two-pass, or a separable one, micro-batch 2 < N n_t: every
    parameter's gradient (router, stacked experts, shared experts, attention, embeddings) to 1e-10."""
    model = llada2()
    sequences, mask = rollouts()
    masks = draw(sequences, mask, "block_elbo", n_t=3)
    advantages = torch.tensor([1.0, -0.5, 0.25, -0.75], dtype=torch.float64)

    def objective(lp):
        value = elbo(lp, masks)
        return -(torch.exp(value - value.detach()) * advantages).mean()

    def pair_objective(lp_pairs, sequence, sample):
        return -(lp_pairs.sum(-1) * advantages[sequence]).sum() / 3

    expected_model = copy.deepcopy(model)
    lp = reference.block_logprobs(reference.official_weights(expected_model), expected_model.config, sequences,
                                  masks.masked, P, mask, MASK) * masks.scored
    loss = pair_objective(lp.view(N * 3, L), torch.arange(N).repeat_interleave(3), None) if separable else objective(lp)
    loss.backward()
    if separable:
        value, _ = streaming_backward(model, sequences, masks, Separable(pair_objective), micro_batch=2,
                                      attention_mask=mask)
    else:
        value, _ = streaming_backward(model, sequences, masks, objective, micro_batch=2, attention_mask=mask)
    torch.testing.assert_close(value, loss.detach(), rtol=0, atol=1e-10)
    for (name, p), q in zip(model.named_parameters(), expected_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-10, msg=name)
    assert model.moe_layers()[0].gate.weight.grad.abs().max() > 0  # the router learns through its weights


@pytest.mark.slow
def test_memory_is_flat_in_n_t():
    """The engine's peak at n_t = 8 is at most 1.05 times its peak at n_t = 1 (torch's allocator, as
    test_likelihood_memory measures it): the gradients and one micro-batch's two-stream graph, whatever n_t. (8 draws
    against 1: a graph or a buffer kept per draw, or per micro-batch, would be at least 8 of them.)"""
    model = llada2(dtype=torch.float32, vocab_size=16384, mask_token_id=16383, eos_token_id=16382,
                   pad_token_id=16382)
    sequences = torch.randint(0, 16000, (N, P + L), generator=torch.Generator().manual_seed(0))
    advantages = torch.tensor([1.0, -0.5, 0.25, -0.75])
    peaks = {}
    for n_t in (1, 8):
        masks = sample_masks(sequences, prompt_length=P, n_t=n_t, sampler="block_elbo", count="all",
                             block_length=4, generator=torch.Generator().manual_seed(n_t))

        def objective(lp, masks=masks):
            value = elbo(lp, masks)
            return -(torch.exp(value - value.detach()) * advantages).mean()

        def run(objective=objective, masks=masks):
            streaming_backward(model, sequences, masks, objective, micro_batch=MicroBatching(2, chunk_size=256))

        model.zero_grad(set_to_none=True)
        run()
        model.zero_grad(set_to_none=True)
        with track_allocations() as allocated:
            run()
        peaks[n_t] = allocated.peak
    gradients = sum(p.numel() * p.element_size() for p in model.parameters())
    assert gradients <= peaks[1] and peaks[8] <= 1.05 * peaks[1], peaks


@pytest.mark.parametrize("name", ["espo", "spg"])
def test_one_pass_engine_equals_two_passes_on_llada2(name):
    """The one-pass engine (a micro-batch holding a sequence's every mask differentiates its loss in one graph)
    on LLaDA2's block-causal attention and experts: loss, lp and gradient equal the two-pass engine's (fp64)."""
    from dllm_fast.objectives import InnerUpdate
    from test_objectives import draw as draw_masks, make, relative_error, rollout_batch
    from test_one_pass_engine import REWARDS, constants, run

    model = llada2()
    objective = make(name)
    batch = rollout_batch(model, rewards=REWARDS)
    masks = draw_masks(objective, model, batch)
    lp_old, lp_ref = constants(model, objective, batch, masks)
    update = InnerUpdate(masks, lp_old=lp_old)
    want, want_grads = run(model, objective, batch, update, lp_ref, MicroBatching(masks.n_t, one_pass=False))
    got, grads = run(model, objective, batch, update, lp_ref, MicroBatching(2 * masks.n_t))
    assert relative_error(grads, want_grads) < 1e-10
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got.lp, want.lp, rtol=1e-12, atol=1e-14)
