"""generate runs on fake tensors (FakeTensorMode, as `python -m dllm_fast plan` runs it): at LLaDA-8B shapes in
bf16, with no memory and no host sync, for every cache policy, and for threshold decoding with an assumed number
of steps per block."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import dllm_fast
from dllm_fast.models import LLaDAConfig, LLaDAModel
from dllm_fast.validation import data_checks_enabled
from test_generate import prompts


@pytest.fixture(scope="module")
def fake_llada_8b():
    mode = FakeTensorMode()
    with mode:
        model = LLaDAModel.with_random_weights(LLaDAConfig.preset("llada-8b"), dtype=torch.bfloat16).eval()
    return mode, model


# The other caches and the threshold schedule at 8B shapes are slow (about 8 s each on 2 cores).
@pytest.mark.parametrize("cache, schedule", [("none", dict(steps=4))] + [
    pytest.param(cache, schedule, marks=pytest.mark.slow)
    for cache, schedule in [("prefix", dict(steps=4)), ("dual", dict(steps=4)),
                            ("dual", dict(threshold=0.9, assumed_steps_per_block=3))]])
def test_generate_runs_at_llada_8b_shapes_on_fake_tensors(fake_llada_8b, cache, schedule):
    mode, model = fake_llada_8b
    assert isinstance(model.lm_head_weight, FakeTensor) and model.lm_head_weight.dtype == torch.bfloat16
    with mode:
        ids = torch.randint(0, 1000, (8, 40))
        mask = torch.ones(8, 40, dtype=torch.long)
        result = dllm_fast.generate(model, ids, mask, gen_length=64, block_length=32, temperature=1.0, cache=cache,
                                    record_unmask_step=True, generator=torch.Generator().manual_seed(0), **schedule)
    assert isinstance(result.sequences, FakeTensor)
    assert result.sequences.shape == (8, 104) and result.completion_ids.shape == (8, 64)
    assert result.unmask_step.shape == (8, 64) and result.unmask_step.dtype == torch.int64
    assert result.nfe == 2 * schedule.get("assumed_steps_per_block", 2)


def test_threshold_decoding_on_fake_tensors_asks_for_an_assumed_step_count(fake_llada_8b):
    mode, model = fake_llada_8b
    with mode, pytest.raises(ValueError, match="pass assumed_steps_per_block=N to plan it"):
        dllm_fast.generate(model, torch.randint(0, 1000, (1, 8)), gen_length=32, block_length=32, threshold=0.9)


def test_a_fake_run_has_the_real_runs_shapes():
    model = LLaDAModel(LLaDAConfig.preset("tiny")).eval()
    ids, mask = prompts("cpu", [3, 6])
    kwargs = dict(gen_length=8, block_length=4, steps=4, cache="dual", record_unmask_step=True)
    real = dllm_fast.generate(model, ids, mask, **kwargs)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = dllm_fast.generate(model, ids, mask, **kwargs)
    for field in ("sequences", "completion_ids", "completion_mask", "attention_mask", "unmask_step"):
        assert (getattr(fake, field).shape, getattr(fake, field).dtype) == (getattr(real, field).shape,
                                                                            getattr(real, field).dtype)
    assert fake.nfe == real.nfe


def test_value_checks_run_only_where_values_can_be_read():
    real = torch.ones(3)
    assert data_checks_enabled(real) and data_checks_enabled()
    assert not data_checks_enabled(real.to("meta"))
    with FakeTensorMode():
        fake = torch.ones(3)
        assert not data_checks_enabled(fake) and not data_checks_enabled()
    assert not data_checks_enabled(fake)
