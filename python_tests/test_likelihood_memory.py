"""The engine's memory with the gradients included: what torch allocates during the micro-batch loop stays at the
gradients themselves plus one micro-batch, whatever n_t and however many micro-batches accumulate (issue 16).

The model has a large vocabulary next to a tiny body (as LLaDA's 126k vocabulary next to its width), so a
gradient-sized temporary of the LM head or of the embedding, [V, d], is far larger than everything else a
micro-batch allocates."""

import dataclasses

import pytest
import torch

from dllm_fast import objectives
from dllm_fast.contracts import RolloutBatch, completion_mask
from dllm_fast.likelihood import BackwardHooks, MicroBatching, Separable, elbo, sample_masks, streaming_backward
from dllm_fast.testing.memory import track_allocations
from dllm_fast.models import LLaDAConfig, LLaDAModel
from dllm_fast.objectives import InnerUpdate

pytestmark = pytest.mark.usefixtures("one_thread")

P, L, N = 4, 10, 4
VOCAB = 16384  # [V, d] = 4 MiB in fp32; the body's weights are 0.2 MiB
BATCHING = MicroBatching(2, chunk_size=256)  # pairs per graph, below N * n_t; vocabulary chunk


def wide_vocabulary_model():
    config = dataclasses.replace(LLaDAConfig.preset("tiny"), vocab_size=VOCAB, embedding_size=None)
    return LLaDAModel.with_random_weights(config, seed=0)


def rollouts(model):
    gen = torch.Generator().manual_seed(0)
    sequences = torch.randint(0, 120, (N, P + L), generator=gen)
    sequences[0, P + 6:] = model.eos_token_id
    return sequences


def head_bytes(model):
    return model.lm_head_weight.numel() * model.lm_head_weight.element_size()


def gradient_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def allocated_peak(model, run):
    """Peak bytes torch allocates during run(), gradients None on entry (as the trainer leaves them)."""
    model.zero_grad(set_to_none=True)
    run()  # warm-up: lazy initialisations of the libraries are not the engine's
    model.zero_grad(set_to_none=True)
    with track_allocations() as allocated:
        run()
    assert model.lm_head_weight.grad is not None and model.transformer["wte"].weight.grad is not None
    return allocated.peak


def two_pass(model, sequences, masks, **hooks):
    advantages = torch.tensor([1.0, -0.5, 0.25, -0.75])

    def vrpo_ol(lp):
        value = elbo(lp, masks)
        return -(torch.exp(value - value.detach()) * advantages).mean()

    return lambda: streaming_backward(model, sequences, masks, vrpo_ol, micro_batch=BATCHING,
                                      hooks=BackwardHooks(**hooks))


def separable(model, sequences, masks):
    return lambda: streaming_backward(model, sequences, masks, Separable(lambda lp, n, j: -lp.sum()),
                                      micro_batch=BATCHING)


@pytest.mark.parametrize("path", ["two_pass", "two_pass_host_backward", "separable"])
def test_the_micro_batch_loop_allocates_the_gradients_once_and_no_gradient_sized_temporary(path):
    """Removing the in-place accumulation of the LM head's gradient (or of the embedding's) fails this: every
    micro-batch from the second on then builds a [V, d] gradient for autograd to add into .grad."""
    model = wide_vocabulary_model()
    sequences = rollouts(model)
    peaks = {}
    for n_t in (1, 8):
        masks = sample_masks(sequences, prompt_length=P, n_t=n_t, sampler="stratified_l", count="all",
                             generator=torch.Generator().manual_seed(n_t))
        if path == "separable":
            run = separable(model, sequences, masks)
        else:
            run = two_pass(model, sequences, masks,
                           **({"backward": torch.Tensor.backward} if path == "two_pass_host_backward" else {}))
        peaks[n_t] = allocated_peak(model, run)
    gradients = gradient_bytes(model)  # allocated by the call itself: .grad was None on entry
    for n_t, peak in peaks.items():
        assert gradients <= peak < gradients + head_bytes(model) // 4, (n_t, peak, gradients)
    assert abs(peaks[8] - peaks[1]) < head_bytes(model) // 8, peaks


@pytest.mark.slow  # every objective traced, about 15 s on 2 cores
def test_an_objective_update_allocates_no_gradient_sized_temporary():
    model = wide_vocabulary_model()
    sequences = rollouts(model)
    batch = RolloutBatch(sequences, None, P, completion_mask(sequences[:, P:], model.eos_token_id),
                         torch.tensor([1.0, 0.0, 0.5, 0.25]), 2)
    for name in ("espo", "spg", "bgpo"):
        objective = objectives.get(name, n_t=4, **({"beta": 0.0} if name == "espo" else {}))
        update = InnerUpdate(objective.draw_masks(batch, generator=torch.Generator().manual_seed(1),
                                                  eos_token_id=model.eos_token_id))
        peak = allocated_peak(model, lambda: objective.backward(model, batch, update, micro_batch=BATCHING))
        assert peak < gradient_bytes(model) + head_bytes(model) // 4, (name, peak)


def test_gradients_that_exist_on_entry_cost_one_copy_and_no_more():
    """The documented price of all-or-nothing when accumulating into existing gradients: one copy of them."""
    model = wide_vocabulary_model()
    sequences = rollouts(model)
    masks = sample_masks(sequences, prompt_length=P, n_t=4, sampler="stratified_l", count="all",
                         generator=torch.Generator().manual_seed(0))
    run = two_pass(model, sequences, masks)
    run()
    with track_allocations() as allocated:
        run()
    gradients = gradient_bytes(model)
    assert gradients <= allocated.peak < gradients + head_bytes(model) // 4
