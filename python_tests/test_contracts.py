"""The hand-off contracts: RolloutBatch's checks, the one completion mask, and logit_shift in sampling and scoring."""

import pytest
import torch

import dllm_fast
from dllm_fast import likelihood, reference
from dllm_fast.contracts import DiffusionLM, GenerationResult, RolloutBatch, completion_mask, logit_shift
from dllm_fast.models import LLaDAConfig, LLaDAModel

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return LLaDAModel(LLaDAConfig.preset("tiny")).double().eval()


class ShiftedByOne(torch.nn.Module):
    """A Dream-style view of a LLaDA model: its hidden state at i is the LLaDA state at i + 1, so it predicts
    token i + 1 from position i (logit_shift = 1) and must give the same tokens and log-probs."""

    logit_shift = 1

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.mask_token_id, self.eos_token_id = inner.mask_token_id, inner.eos_token_id

    @property
    def lm_head_weight(self):
        return self.inner.lm_head_weight

    def new_cache(self, batch, capacity):
        return self.inner.new_cache(batch, capacity)

    def forward(self, input_ids, attention_mask=None):
        hidden = self.inner(input_ids, attention_mask=attention_mask)
        return torch.cat([hidden[:, 1:], torch.full_like(hidden[:, :1], float("nan"))], dim=1)


def rollout(N=4, P=3, L=6, eos=126):
    sequences = torch.randint(0, 100, (N, P + L))
    sequences[1, P + 2] = eos
    sequences[1, P + 4] = eos
    return GenerationResult(sequences, sequences[:, P:], completion_mask(sequences[:, P:], eos), nfe=1)


def test_models_satisfy_the_protocol():
    model = tiny_model()
    assert isinstance(model, DiffusionLM) and logit_shift(model) == 0
    assert logit_shift(ShiftedByOne(model)) == 1


def test_logit_shift_is_checked():
    class Odd(ShiftedByOne):
        logit_shift = 2

    with pytest.raises(ValueError, match="logit_shift=2"):
        logit_shift(Odd(tiny_model()))


def test_completion_mask_is_the_likelihood_engines_eos_count():
    result = rollout()
    counted = likelihood.counted_positions(result.completion_ids, eos_token_id=126, count="eos")
    assert torch.equal(counted, result.completion_mask)
    assert result.completion_mask[1].tolist() == [True, True, True, False, False, False]


def test_rollout_batch_from_generation():
    result = rollout()
    batch = RolloutBatch.from_generation(result, [1.0, 0.0, 0.5, 0.5], group_size=2)
    assert batch.prompt_length == 3 and batch.num_groups == 2 and batch.completion_length == 6
    assert batch.rewards.dtype == torch.float32
    assert torch.equal(batch.completion_lengths, result.completion_mask.sum(-1))
    assert batch.grouped(batch.rewards).tolist() == [[1.0, 0.0], [0.5, 0.5]]
    with pytest.raises(Exception):
        batch.group_size = 4  # frozen


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_rewards_name_the_row(bad):
    rewards = [1.0, 0.0, bad, 0.5]
    with pytest.raises(ValueError, match=r"rewards\[2\] is .*prompt group 1, completion 0"):
        RolloutBatch.from_generation(rollout(), rewards, group_size=2)


def test_group_size_must_divide_the_rollouts():
    with pytest.raises(ValueError, match="group_size=3 does not divide the 4 rollouts"):
        RolloutBatch.from_generation(rollout(), [0.0] * 4, group_size=3)
    with pytest.raises(ValueError, match="group_size=0"):
        RolloutBatch.from_generation(rollout(), [0.0] * 4, group_size=0)
    with pytest.raises(ValueError, match="one reward per rollout"):
        RolloutBatch.from_generation(rollout(), [0.0] * 3, group_size=1)


def test_generate_result_carries_the_attention_mask_into_the_batch():
    model = tiny_model()
    ids = torch.randint(0, 100, (2, 4))
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    for sampler in (dllm_fast.generate, reference.generate):
        result = sampler(model, ids, mask, gen_length=4, block_length=4, steps=2)
        assert result.attention_mask.tolist() == [[0, 1, 1, 1, 1, 1, 1, 1], [1] * 8]
        batch = RolloutBatch.from_generation(result, torch.tensor([1.0, 0.0]), group_size=2)
        assert batch.attention_mask is result.attention_mask


@pytest.mark.parametrize("sampler", [dllm_fast.generate, reference.generate])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sampling_honours_logit_shift(sampler, temperature):
    model = tiny_model()
    ids = torch.randint(0, 100, (2, 5))
    kwargs = dict(gen_length=8, block_length=4, steps=4, temperature=temperature)
    want = sampler(model, ids, generator=torch.Generator().manual_seed(3), **kwargs)
    got = sampler(ShiftedByOne(model), ids, generator=torch.Generator().manual_seed(3), **kwargs)
    assert torch.equal(got.sequences, want.sequences)


def test_caches_need_an_unshifted_model():
    with pytest.raises(ValueError, match="logit_shift=0"):
        dllm_fast.generate(ShiftedByOne(tiny_model()), torch.randint(0, 100, (1, 3)), gen_length=4,
                           block_length=4, steps=2, cache="prefix")


def test_scoring_honours_logit_shift():
    model = tiny_model()
    sequences = torch.randint(0, 100, (2, 9))
    masks = likelihood.sample_masks(sequences, prompt_length=3, n_t=3, sampler="stratified_l", count="all",
                                    generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = likelihood.score(model, sequences, masks, micro_batch=2)
        got = likelihood.score(ShiftedByOne(model), sequences, masks, micro_batch=2)
        naive = reference.likelihood.score_naive(ShiftedByOne(model), sequences, masks)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(naive, want, rtol=1e-12, atol=1e-12)
    assert want.abs().sum() > 0
