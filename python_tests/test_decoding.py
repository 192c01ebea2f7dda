"""The shared meaning of a generate call: cache policies, remasking rules, and their use by both samplers."""

import pytest
import torch

import dllm_fast
from dllm_fast import reference
from dllm_fast.rollout import (CACHE_POLICIES, REMASKING, CachePolicy, DualCache, Remasking, cache_policy,
                               remasking_rule)
from test_generate import ScriptedModel, eos_prone_table, prompts, tiny_model, unmask_steps

SAMPLERS = [dllm_fast.generate, reference.generate]


def fed_lengths(model, sampler, *args, **kwargs):
    lengths = []
    hook = model.register_forward_pre_hook(lambda module, inputs: lengths.append(inputs[0].shape[1]))
    result = sampler(model, *args, **kwargs)
    hook.remove()
    return lengths, result


def test_the_registries_hold_the_published_modes():
    assert list(CACHE_POLICIES) == ["none", "prefix", "dual"]
    assert list(REMASKING) == ["low_confidence", "random"]
    assert cache_policy("dual") is CACHE_POLICIES["dual"] and remasking_rule("random") is REMASKING["random"]
    with pytest.raises(ValueError, match="cache='paged' is not one of"):
        cache_policy("paged")
    with pytest.raises(ValueError, match="remasking='entropy' is not one of"):
        remasking_rule("entropy")


@pytest.mark.parametrize("cache", list(CACHE_POLICIES))
@pytest.mark.parametrize("steps", [16, 32])
def test_the_policy_spans_are_what_the_samplers_feed(cache, steps, one_thread):
    """policy.fed_span (what a roofline or a planner counts) gives exactly the forwards both samplers run, and
    what each feeds; a block is left once complete, so extra steps per block run no forward."""
    model = tiny_model("cpu")
    ids, mask = prompts("cpu", [5, 8])
    policy = CACHE_POLICIES[cache]
    expected = []
    for block in range(4):  # 4 blocks of 4 tokens, one token a step: 4 useful forwards a block
        start = 8 + 4 * block
        expected += [policy.fed_span(start, start + 4, 24, step) for step in range(4)]
    for sampler in SAMPLERS:
        lengths, result = fed_lengths(model, sampler, ids, mask, gen_length=16, block_length=4, steps=steps,
                                      cache=cache)
        assert lengths == [hi - lo for lo, hi in expected]
        assert result.nfe == 16
    refreshed = [policy.refreshes(step) for step in range(4)]
    assert refreshed == [True] + [cache == "none"] * 3


class DualCacheRefreshedEveryOtherStep(DualCache):
    """A new policy is one class: the dual cache, refreshed at every other step instead of once per block."""

    name = "dual-every-other-step"

    def refreshes(self, step):
        return step % 2 == 0


def test_a_new_cache_policy_is_one_class(one_thread):
    model = tiny_model("cpu")
    ids, mask = prompts("cpu", [5, 8])
    policy = DualCacheRefreshedEveryOtherStep()
    kwargs = dict(gen_length=8, block_length=4, steps=8, cache=policy)
    (fused_fed, fused), (plain_fed, plain) = (fed_lengths(model, sampler, ids, mask, **kwargs) for sampler in SAMPLERS)
    assert torch.equal(fused.sequences, plain.sequences)
    assert fused_fed == plain_fed == [16, 4, 16, 4] * 2


class LeftToRight(Remasking):
    """A new remasking rule is one class: unmask the leftmost masked positions first."""

    name = "left_to_right"
    uses_model_confidence = False

    def scores(self, confidence, *, fed_shape, fed_positions, generator, device):
        if fed_positions is None:
            fed_positions = torch.arange(fed_shape[1], device=device).expand(fed_shape)
        return -fed_positions.double()


def test_a_new_remasking_rule_is_one_class(one_thread):
    table = eos_prone_table(2, 16, torch.Generator().manual_seed(0))
    runs = []
    for sampler in SAMPLERS:
        model = ScriptedModel(table)
        result = sampler(model, torch.tensor([[1, 2]]), gen_length=8, block_length=4, steps=8, remasking=LeftToRight())
        runs.append(result.sequences)
        assert unmask_steps(model.canvases, model.mask_token_id)[0, 2:].tolist() == list(range(8))
    assert torch.equal(*runs)


def test_policies_and_rules_describe_themselves():
    assert repr(CACHE_POLICIES["prefix"]) == "PrefixCache()" and repr(REMASKING["random"]) == "RandomRemasking()"
    assert isinstance(DualCacheRefreshedEveryOtherStep(), CachePolicy)
    with pytest.raises(NotImplementedError):
        CachePolicy().reused_span(0, 4, 8)
