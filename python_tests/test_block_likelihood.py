"""Likelihoods of block-diffusion models: lp[N, n_t, L] from the one-forward two-stream scoring equals per-block
naive scoring (reference/sdar.py), eager and compiled; the streaming engine's gradient equals fp64 autograd through
the naive scoring; memory stays flat in n_t; and the block_elbo sampler (a noise level per block) is the
block ELBO's unbiased estimate."""

import copy
import math

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from dllm_fast import objectives
from dllm_fast.contracts import RolloutBatch, completion_mask
from dllm_fast.likelihood import (MicroBatching, Separable, compiled as compiled_module, elbo, eubo, sample_masks,
                                  score, streaming_backward, token_estimate)
from dllm_fast.testing.memory import track_allocations
from dllm_fast.models import LLaDAConfig, LLaDAModel, SDARConfig, SDARModel
from dllm_fast.reference import likelihood as reference_likelihood, sdar as reference

pytestmark = pytest.mark.usefixtures("one_thread")

MASK, EOS = 127, 126
N, P, L = 4, 7, 10


def sdar(dtype=torch.float64, seed=1, **overrides):
    config = SDARConfig(**{**SDARConfig.preset("sdar-tiny").__dict__, "extra": {}, **overrides})
    return SDARModel.with_random_weights(config, dtype=dtype, seed=seed)


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


def draw(sequences, mask, sampler, n_t=3, seed=0, block_length=4):
    extra = {}
    if sampler == "trajectory":
        extra = dict(n_t=None, unmask_step=torch.arange(L).repeat(N, 1) // 2)
    return sample_masks(sequences, prompt_length=P, sampler=sampler, generator=torch.Generator().manual_seed(seed),
                        eos_token_id=EOS, attention_mask=mask, block_length=block_length,
                        **({"n_t": n_t} | extra))


def naive(model, sequences, masks, mask):
    lp = reference.block_logprobs(dict(model.named_parameters()), model.config, sequences, masks.masked, P, mask, MASK)
    return lp * masks.scored


@pytest.mark.parametrize("sampler", ["stratified_l", "block_elbo", "mean_field", "block", "coupled", "trajectory"])
def test_one_forward_per_pair_equals_per_block_scoring(sampler):
    """All blocks of a pair in one two-stream forward = a forward per block on [the earlier blocks clean, the block
    noisy]; mean_field and block also mask prompt tokens (seen masked by every block)."""
    model = sdar()
    sequences, mask = rollouts()
    masks = draw(sequences, mask, sampler)
    with torch.no_grad():
        lp = score(model, sequences, masks, micro_batch=5, attention_mask=mask)
        torch.testing.assert_close(lp, naive(model, sequences, masks, mask), rtol=0, atol=1e-12)
    assert (lp[masks.scored] < 0).all()


def test_per_block_scoring_differs_from_scoring_the_noisy_sequence_in_one_plain_forward():
    """The comparison has power: one forward on the noisy sequence (earlier blocks noisy too) is another value."""
    model = sdar()
    sequences, mask = rollouts()
    masks = draw(sequences, mask, "stratified_l")
    noisy = sequences[:, None].expand(-1, 3, -1).masked_fill(masks.masked, MASK).reshape(3 * N, -1)
    with torch.no_grad():
        hidden = model(noisy, attention_mask=mask.repeat_interleave(3, 0))
        plain = torch.log_softmax(model.logits(noisy, mask.repeat_interleave(3, 0)), -1)
        plain = plain.gather(-1, sequences.repeat_interleave(3, 0)[..., None])[..., 0][:, P:].view(N, 3, L)
        assert hidden.shape[0] == 3 * N
        two_stream = score(model, sequences, masks, micro_batch=12, attention_mask=mask)
    assert ((plain * masks.scored - two_stream).abs() > 1e-3).any()


@pytest.mark.compile
@pytest.mark.slow
def test_compiled_scoring_equals_eager(monkeypatch):
    """The two-stream forward captures whole (aot_eager, fullgraph): one micro-batch bucket, one graph. (Pass 2's
    compiled forward and backward run the same denoising_hidden; their capture costs minutes on 2 cores.)"""
    torch._dynamo.reset()
    count = CompileCounterWithBackend("aot_eager")
    graph = torch.compile(compiled_module.score_padded, fullgraph=True, dynamic=False, backend=count)
    monkeypatch.setattr(compiled_module, "compiled", lambda name, backend="inductor": graph)
    model = sdar(dtype=torch.float32)
    sequences, mask = rollouts()
    masks = draw(sequences, mask, "block_elbo")
    with torch.no_grad():
        eager = score(model, sequences, masks, micro_batch=16, attention_mask=mask)
        compiled = score(model, sequences, masks, micro_batch=MicroBatching(16, compile=True), attention_mask=mask)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    assert count.frame_count == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("separable", [False, True])
def test_the_engine_gradient_equals_fp64_autograd_through_per_block_scoring(separable):
    """A nonlinear objective (VRPO-OL's exp of the ELBO) two-pass, or a separable one, micro-batch 2 < N n_t."""
    model = sdar()
    sequences, mask = rollouts()
    masks = draw(sequences, mask, "block_elbo", n_t=3)
    advantages = torch.tensor([1.0, -0.5, 0.25, -0.75], dtype=torch.float64)

    def objective(lp):
        value = elbo(lp, masks)
        return -(torch.exp(value - value.detach()) * advantages).mean()

    def pair_objective(lp_pairs, sequence, sample):
        return -(lp_pairs.sum(-1) * advantages[sequence]).sum() / 3

    expected_model = copy.deepcopy(model)
    lp = reference.block_logprobs(dict(expected_model.named_parameters()), expected_model.config, sequences,
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


@pytest.mark.slow
def test_memory_is_flat_in_n_t():
    """The engine's peak at n_t = 8 is at most 1.05 times its peak at n_t = 1 (torch's allocator, as
    test_likelihood_memory measures it): the gradients and one micro-batch's two-stream graph, whatever n_t. (8 draws
    against 1: a graph or a buffer kept per draw, or per micro-batch, would be at least 8 of them.)"""
    model = sdar(dtype=torch.float32, vocab_size=16384, mask_token_id=16383, eos_token_id=16382, eot_token_id=None)
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


def exact_block_elbo(values, counted, blocks):
    """sum over blocks of sum_{l=1..v} (1/l) E_{|M|=l}[sum_{i in M} f_i(l)] for f_i(l) = values_i (1 + l): every
    counted position of a block is in M with probability l / v."""
    total = 0.0
    for block in blocks.unique():
        inside = (blocks == block) & counted
        v = int(inside.sum())
        for l in range(1, v + 1):
            total += (1 / l) * (l / v) * float(values[inside].sum()) * (1 + l)
    return total


def test_block_elbo_is_unbiased_for_the_block_elbo_and_its_weights_are_per_block():
    """The masked count l of each block is marginally uniform on 1..v and its weight v / l; averaging the
    estimate of a score that depends on the block's l matches the exact block ELBO within 4 standard errors."""
    copies, n_t, b = 3000, 2, 4
    sequences = torch.randint(0, 100, (1, 3 + 9)).expand(copies, -1)
    mask = torch.ones_like(sequences)
    mask[:, 0] = 0  # one padding column: the completion starts at position 2, mid-block
    masks = sample_masks(sequences, prompt_length=3, n_t=n_t, sampler="block_elbo", count="all", block_length=b,
                         attention_mask=mask, generator=torch.Generator().manual_seed(0))
    blocks = (torch.arange(9) + 3 - 1) // b
    assert blocks.tolist() == [0, 0, 1, 1, 1, 1, 2, 2, 2]
    values = -torch.linspace(0.5, 2.0, 9, dtype=torch.float64)
    l_of = torch.zeros(copies, n_t, 9, dtype=torch.float64)
    for block in (0, 1, 2):
        inside = blocks == block
        count = masks.scored[..., inside].sum(-1)
        v = int(inside.sum())
        assert (count >= 1).all() and (count <= v).all()
        torch.testing.assert_close(masks.weight[..., inside], (v / count.double())[..., None].expand(-1, -1, v))
        if v > 1:
            frequencies = torch.bincount(count.flatten() - 1, minlength=v).double() / count.numel()
            assert (frequencies - 1 / v).abs().max() < 0.03, frequencies
        l_of[..., inside] = count.double()[..., None]
    lp = (values * (1 + l_of)) * masks.scored
    estimates = elbo(lp, masks)
    exact = exact_block_elbo(values, torch.ones(9, dtype=torch.bool), blocks)
    assert abs(float(estimates.mean()) - exact) < 4 * float(estimates.std()) / math.sqrt(copies), (estimates.mean(), exact)
    # the weights matter: one weight per sample (the whole completion's v / l) is biased here
    per_sample = (lp.sum(-1) * (9 / masks.scored.sum(-1).double())).mean(-1)
    assert abs(float(per_sample.mean()) - exact) > 8 * float(per_sample.std()) / math.sqrt(copies)


def test_estimators_read_per_position_weights_as_their_references():
    sequences, mask = rollouts()
    masks = draw(sequences, mask, "block_elbo", n_t=4)
    lp = -torch.rand(N, 4, L, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * masks.scored
    torch.testing.assert_close(elbo(lp, masks), reference_likelihood.mc_elbo(lp, masks), rtol=0, atol=1e-12)
    torch.testing.assert_close(eubo(lp, masks), reference_likelihood.mc_eubo(lp, masks), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(token_estimate(lp, masks).sum(-1), elbo(lp, masks), rtol=0, atol=1e-12)


def test_block_elbo_needs_a_block_model():
    sequences, mask = rollouts()
    batch = RolloutBatch(sequences, mask, P, completion_mask(sequences[:, P:], EOS), torch.arange(4.0), 2)
    objective = objectives.get("espo", sampler="block_elbo", n_t=2, beta=0.0)
    llada = LLaDAModel.with_random_weights(LLaDAConfig.preset("tiny"))
    with pytest.raises(ValueError, match="sampler='block_elbo' estimates a block-diffusion model's ELBO"):
        objective.backward(llada, batch, micro_batch=4, generator=torch.Generator())
    model = sdar(dtype=torch.float32)
    out = objective.backward(model, batch, micro_batch=4, generator=torch.Generator().manual_seed(0))
    assert out.masks.weight.dim() == 3 and math.isfinite(out.stats["loss"])
