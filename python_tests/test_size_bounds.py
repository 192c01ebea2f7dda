"""Sizes a public function takes are bounded as the trainer bounds its own (issue 32 items 4 and 10): refused at
once with the value and the fix, instead of minutes of silence or a model run past its positions. Each bound is
stated in the function's docstring."""

import time

import pytest
import torch

import dllm_fast
from dllm_fast import reference
from dllm_fast.likelihood import sample_masks, score
from dllm_fast.models import LLaDAConfig, LLaDAModel

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LLaDAModel(LLaDAConfig.preset("tiny"))  # 512 positions


def prompts(length, rows=1):
    return torch.randint(0, 100, (rows, length), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("sampler", [dllm_fast.generate, reference.generate], ids=["fused", "reference"])
@pytest.mark.parametrize("length, options, message", [
    (4000, dict(gen_length=8, block_length=8, steps=8),
     r"prompts of 4000 tokens \(their padded length\) plus gen_length=8 need 4008 positions; the model has 512 "
     r"\(max_sequence_length\). Shorten the prompts"),
    (4, dict(gen_length=20000, block_length=32, steps=20000),
     r"prompts of 4 tokens .* plus gen_length=20000 need 20004 positions; the model has 512 .* Lower gen_length to "
     r"at most 508"),
    (4, dict(gen_length=8, block_length=8, steps=2**31),
     r"steps=2147483648 exceeds 2147483647 \(2\^31 - 1, the noise key's step word\).* use at most 8"),
])
def test_generate_refuses_sizes_beyond_its_bounds_at_once(model, sampler, length, options, message):
    started = time.perf_counter()
    with pytest.raises(ValueError, match=message):
        sampler(model, prompts(length), **options)
    assert time.perf_counter() - started < 30  # refused before any work (the old code ran for minutes)


@pytest.mark.parametrize("sampler", [dllm_fast.generate, reference.generate], ids=["fused", "reference"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_steps_beyond_the_completion_cost_nothing(model, sampler, temperature):
    """Issue 32 item 10: steps=10**8 took 49 s for 8 tokens (a 10**8-step schedule was built). Steps past a block's
    completion never run, so the call costs what steps=gen_length costs, with the same tokens."""
    options = dict(gen_length=16, block_length=8, temperature=temperature)
    started = time.perf_counter()
    many = sampler(model, prompts(4, rows=2), steps=10**8, generator=torch.Generator().manual_seed(3), **options)
    assert time.perf_counter() - started < 30
    few = sampler(model, prompts(4, rows=2), steps=16, generator=torch.Generator().manual_seed(3), **options)
    assert many.nfe == few.nfe == 16
    if temperature == 0:  # with T > 0 the noise is keyed by the schedule's step, which differs
        assert torch.equal(many.sequences, few.sequences)


def test_generate_still_fills_the_positions_exactly(model):
    out = dllm_fast.generate(model, prompts(500), gen_length=12, block_length=12, steps=12)
    assert out.sequences.shape == (1, 512)


def test_the_hf_adapter_declares_its_positions():
    from dllm_fast.models import HFDiffusionLM
    from test_hf_diffusion import TinyDreamConfig, TinyDreamModel

    config = TinyDreamConfig()
    config.max_position_embeddings = 16
    adapter = HFDiffusionLM(TinyDreamModel(config))
    assert adapter.max_sequence_length == 16
    with pytest.raises(ValueError, match=r"need 20 positions; the model has 16"):
        dllm_fast.generate(adapter, prompts(4), gen_length=16, block_length=16, steps=16)


def test_score_refuses_sequences_longer_than_the_models_positions(model):
    sequences = torch.randint(0, 100, (1, 600))
    masks = sample_masks(sequences, prompt_length=4, n_t=1, sampler="random_t", count="all",
                         generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"sequences of 600 tokens need 600 positions; the model has 512 .* Score "
                                         r"shorter sequences"):
        score(model, sequences, masks, micro_batch=1)


def test_sample_masks_refuses_more_pairs_than_the_trainer_allows():
    sequences = torch.randint(0, 100, (4, 10))
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"4 sequences x n_t=300000 = 1200000 \(sequence, sample\) pairs, more than "
                                         r"1048576 \(2\^20"):
        sample_masks(sequences, prompt_length=2, n_t=300_000, sampler="random_t", count="all",
                     generator=torch.Generator().manual_seed(0))
    assert time.perf_counter() - started < 30


@pytest.mark.parametrize("function", [dllm_fast.generate, score, sample_masks])
def test_each_bound_is_stated_in_the_docstring(function):
    assert "Bound" in function.__doc__ and "2^" in function.__doc__
