"""The hand-off contracts: RolloutBatch's checks, the one completion mask, and logit_shift in sampling and scoring."""

import pytest
import torch

import dllm_fast
from dllm_fast import likelihood, reference
from dllm_fast.contracts import DiffusionLM, GenerationResult, RolloutBatch, completion_mask, logit_shift
from dllm_fast.likelihood.samplers import SAMPLERS
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


# -- every field checked like the trainer's inputs (issue 32 items 5 and 11) ----------------------------------------

def fields(**overrides):
    """The fields of a valid batch of 4 rollouts (P = 3, L = 6, groups of 2), with `overrides`."""
    result = rollout()
    values = dict(sequences=result.sequences, attention_mask=torch.ones(4, 9, dtype=torch.long), prompt_length=3,
                  completion_mask=result.completion_mask, rewards=torch.tensor([1.0, 0.0, 0.5, 0.5]), group_size=2)
    return {**values, **overrides}


def with_value(name, index, value):
    tensor = fields()[name].clone()
    tensor[index] = value
    return {name: tensor}


@pytest.mark.parametrize("overrides, error, message", [
    ({"attention_mask": torch.full((4, 9), 0.5)}, TypeError,
     r"RolloutBatch.attention_mask has dtype torch.float32; it must be bool or an integer dtype holding 0 and 1"),
    (with_value("attention_mask", (2, 1), 2), ValueError, r"RolloutBatch.attention_mask\[2, 1\] = 2; a mask holds only"),
    (with_value("attention_mask", (1, 5), 0), ValueError,
     r"RolloutBatch.attention_mask\[1, 5\] = 0 is in the completion \(position 2\)"),
    (with_value("attention_mask", (3, 2), 0), ValueError, r"attention_mask row 3 is not left-padded"),
    ({"attention_mask": torch.ones(4, 8, dtype=torch.long)}, ValueError,
     r"RolloutBatch.attention_mask has shape \(4, 8\), expected \(4, 9\)"),
    ({"sequences": fields()["sequences"].float()}, TypeError, r"RolloutBatch.sequences holds torch.float32"),
    (with_value("sequences", (0, 4), -3), ValueError, r"RolloutBatch.sequences\[0, 4\] = -3; token ids are >= 0"),
    (with_value("completion_mask", (2, 0), False), ValueError,
     r"RolloutBatch.completion_mask\[2, 0\] is False; .*completion_mask\(completion_ids, eos_token_id\)"),
    ({"rewards": "1, 0, 0.5, 0.5"}, ValueError, r"RolloutBatch.rewards must be a float \[N\] = \[4\] tensor, got str"),
    ({"rewards": None}, ValueError, r"RolloutBatch.rewards must be a float \[N\] = \[4\] tensor, got NoneType"),
    ({"rewards": torch.zeros(4, device="meta")}, ValueError, r"RolloutBatch.rewards is on the meta device"),
    ({"rewards": torch.tensor([1.0, -1e300, 0.0, 0.0], dtype=torch.float64)}, ValueError,
     r"rewards\[1\] is -1e\+300 \(prompt group 0, completion 1\), beyond the reward range \[-2\^24, 2\^24\]"),
    ({"unmask_step": torch.full((4, 6), 2**62)}, ValueError,
     r"unmask_step\[0, 0\] = 4611686018427387904 is not a denoising step in \[0, 6\)"),
    ({"unmask_step": torch.zeros(4, 6, dtype=torch.long), "forwards": 0}, ValueError,
     r"RolloutBatch.forwards=0 must be an int >= 1"),
    ({"forwards": 3}, ValueError, r"RolloutBatch.forwards=3 bounds unmask_step, which is None"),
])
def test_every_field_is_checked_naming_the_value_and_the_fix(overrides, error, message):
    with pytest.raises(error, match=message):
        RolloutBatch(**fields(**overrides))


def test_a_float_attention_mask_no_longer_trains_as_if_it_were_all_ones():
    """Issue 32 item 5: a mask of 0.5 gave the all-ones mask's loss (one consumer read it as tokens)."""
    with pytest.raises(TypeError, match="float"):
        RolloutBatch(**fields(attention_mask=torch.full((4, 9), 0.5)))
    assert RolloutBatch(**fields()).attention_mask.dtype == torch.long  # 0/1 integers stay as given


def test_unmask_steps_are_bounded_by_the_rollouts_forwards():
    """Issue 32 item 5: steps up to 2**62 were accepted, and tracerl trained on them."""
    steps = torch.arange(6).repeat(4, 1) // 2  # 3 forwards, 2 positions each
    assert RolloutBatch(**fields(unmask_step=steps)).forwards is None  # within L = 6
    assert RolloutBatch(**fields(unmask_step=steps, forwards=3)).forwards == 3
    with pytest.raises(ValueError, match=r"unmask_step\[0, 4\] = 2 is not a denoising step in \[0, 2\) \(the "
                                         r"rollout's forwards\)"):
        RolloutBatch(**fields(unmask_step=steps, forwards=2))
    result = rollout()
    result.unmask_step, result.nfe = steps, 3
    batch = RolloutBatch.from_generation(result, [1.0, 0.0, 0.5, 0.5], group_size=2)
    assert batch.forwards == 3 and batch.groups(1, 2).forwards == 3 and batch.to("cpu").forwards == 3


@pytest.mark.parametrize("rewards, message", [
    ("1.0 0.0 0.5 0.5", r"rewards='1.0 0.0 0.5 0.5' \(a str\) must hold one real number per rollout: a \[4\] tensor"),
    (None, r"rewards=None \(a NoneType\) must hold one real number per rollout"),
    (torch.zeros(4, device="meta"), r"rewards is on the meta device and holds no values"),
    ([1.0, "a", 0.0, 0.0], r"rewards must hold one real number per rollout \(4 of them\), got list"),
    (torch.ones(4, dtype=torch.complex64), r"rewards is a torch.complex64 tensor"),
    ([1.0, 2.0**25, 0.0, 0.0], r"rewards\[1\] is 3.35544e\+07 .* beyond the reward range"),
])
def test_rewards_of_the_wrong_kind_are_refused_by_from_generation(rewards, message):
    with pytest.raises((TypeError, ValueError), match=message):
        RolloutBatch.from_generation(rollout(), rewards, group_size=2)


def test_every_objective_agrees_on_rewards_at_and_beyond_the_bound():
    """Issue 32 item 11: float64 rewards of +-1e300 made six objectives raise an overflow error that did not name
    the rewards, while wd1, vrpo_ol and bgpo returned finite gradients. Now the batch refuses them for all ten,
    and at the bound (+-2^24) every objective returns a finite loss and finite gradients."""
    from dllm_fast import objectives

    with pytest.raises(ValueError, match=r"rewards\[0\] is 1e\+300 .* beyond the reward range \[-2\^24, 2\^24\]"):
        RolloutBatch(**fields(rewards=torch.tensor([1e300, -1e300, 0.0, 1e300], dtype=torch.float64)))
    model = tiny_model()
    batch = RolloutBatch(**fields(rewards=torch.tensor([2.0**24, -2.0**24, 0.0, 2.0**24], dtype=torch.float64),
                                  unmask_step=torch.arange(6).repeat(4, 1)))
    for name in objectives.available():
        if name == "mdpo":  # trains on its StepBatch; its rewards at the bound: test_mdpo.py
            continue
        if name == "d_treerpo":  # a tree's edges, not rollouts with rewards: python_tests/test_d_treerpo.py
            continue
        sampler = objectives.get(name).config.sampler
        options = {} if SAMPLERS[sampler].data_n_t else {"n_t": 3 if sampler == "coupled" else 2}
        if SAMPLERS[sampler].model_blocks:  # a bidirectional model: one block, the whole completion
            options["sampler"] = "stratified_l"
        objective = objectives.get(name, **options, **({"block_length": 2} if sampler == "block" else {}))
        model.zero_grad(set_to_none=True)
        out = objective.backward(model, batch, micro_batch=4, generator=torch.Generator().manual_seed(0),
                                 ref_model=tiny_model(1))
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert torch.isfinite(out.loss) and grads and all(torch.isfinite(g).all() for g in grads), name


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


def mixed_model():
    model = LLaDAModel(LLaDAConfig.preset("tiny"))
    model.transformer.wte.double()  # one layer converted, the rest left in float32
    return model


MIXED = r"the model's parameters hold several dtypes \(\d+ in torch.float32, 1 in torch.float64\), and two of them met"


def test_a_model_of_mixed_dtypes_is_named_as_such_by_generate_score_and_backward():
    """Issue 32 item 11: "expected m1 and m2 to have the same dtype" named neither the model nor the fix."""
    from dllm_fast import objectives

    model = mixed_model()
    with pytest.raises(TypeError, match=MIXED + r".* model.to\(torch.float32\)"):
        dllm_fast.generate(model, torch.randint(0, 100, (1, 4)), gen_length=4, block_length=4, steps=4)
    batch = RolloutBatch.from_generation(rollout(), [1.0, 0.0, 0.5, 0.5], group_size=2)
    masks = likelihood.sample_masks(batch.sequences, prompt_length=3, n_t=2, sampler="random_t", count="all",
                                    generator=torch.Generator().manual_seed(0))
    with pytest.raises(TypeError, match=MIXED):
        likelihood.score(model, batch.sequences, masks, micro_batch=4)
    with pytest.raises(TypeError, match=MIXED):
        objectives.get("vrpo_ol", n_t=2).backward(model, batch, micro_batch=4,
                                                  generator=torch.Generator().manual_seed(0))
    assert all(p.grad is None for p in model.parameters())
