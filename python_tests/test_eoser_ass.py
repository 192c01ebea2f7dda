"""CJ-GRPO's decoders as generate options: unmask_schedule="ass" (2^s tokens at step s of a block) and eos_schedule
(EOSER: a sampled EOS ranks by its confidence times a factor rising over the block's steps), token for token
against their plain-PyTorch twins (reference/eoser_ass.py, through reference.generate and reference/sdar.py) on
LLaDA's caches (none, prefix, dual) and on block models (SDAR, LLaDA2; block cache and none); bad values refused
by name."""

import dataclasses

import pytest
import torch

import dllm_fast
from dllm_fast import reference
from dllm_fast.models import LLaDA2Config, LLaDA2Model, LLaDAConfig, LLaDAModel, SDARConfig, SDARModel
from dllm_fast.reference import eoser_ass, llada2 as reference_llada2, sdar as reference_sdar
from dllm_fast.rollout import Resume, eos_factors, unmask_counts
from dllm_fast.rollout.plan import ass_steps

pytestmark = pytest.mark.usefixtures("one_thread")

EOSER = (0.01, 1.0)  # the official eoser-ass gammas


def llada(eos=10):
    """The tiny LLaDA, its EOS a token its greedy completions are full of, so that EOSER has EOS to rank."""
    torch.manual_seed(0)
    return LLaDAModel(dataclasses.replace(LLaDAConfig.preset("tiny"), eos_token_id=eos)).double().eval()


def padded_prompts(B, P, seed=0, pad=120):
    ids = torch.randint(0, 120, (B, P), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for n in range(B):
        mask[n, :n] = 0
    return ids.masked_fill(mask == 0, pad), mask


def test_the_schedules_are_the_official_ones():
    for b in (1, 2, 3, 4, 7, 8, 12, 16, 128):
        K = ass_steps(b)
        assert K == eoser_ass.ass_steps(b)
        counts = unmask_counts(b, K, "ass")
        assert counts == eoser_ass.ass_transfer_schedule(torch.ones(1, b, dtype=torch.bool), K)[0].tolist()
        assert sum(counts) == b and all(c > 0 for c in counts)
    assert unmask_counts(128, 7, "ass") == [1, 2, 4, 8, 16, 32, 65]  # 2^s, the last step the rest
    for ass in (False, True):
        schedule = "ass" if ass else "even"
        for K in (1, 3, 7):
            assert eos_factors(EOSER, K, schedule) == pytest.approx(
                [eoser_ass.eos_factor(s, K, EOSER, ass) for s in range(K)], abs=0, rel=1e-15)
    assert eos_factors((0.0, 1.0), 3, "even") == [0.0, 0.5, 1.0]
    assert eos_factors(EOSER, 2, "ass") == pytest.approx([0.01 + 0.99 / 4, 0.01 + 0.99 * 3 / 4])


OPTIONS = {
    "ass": dict(unmask_schedule="ass"),
    "eoser-ass": dict(unmask_schedule="ass", eos_schedule=EOSER),
    "eoser, even": dict(steps=8, eos_schedule=(0.0, 1.0)),
}


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("options", list(OPTIONS))
def test_llada_rollouts_equal_the_twin_token_for_token(cache, options):
    model = llada()
    ids, mask = padded_prompts(3, 5)
    run = dict(gen_length=16, block_length=8, cache=cache, **OPTIONS[options])
    fused = dllm_fast.generate(model, ids, mask, **run)
    assert torch.equal(fused.sequences, reference.generate(model, ids, mask, **run).sequences)
    assert fused.nfe == (2 * 3 if "steps" not in run else 8)  # ASS: log2(8) = 3 steps per block


def test_eoser_defers_the_eos_and_changes_the_rollout():
    """The guard: with EOSER the EOS the plain schedule decodes first comes later, and the tokens change."""
    model = llada()
    ids, mask = padded_prompts(3, 5)
    run = dict(gen_length=16, block_length=16, steps=16, record_unmask_step=True)  # one token a step: the order
    plain = dllm_fast.generate(model, ids, mask, **run)
    eoser = dllm_fast.generate(model, ids, mask, eos_schedule=(0.0, 1.0), **run)
    eos = model.eos_token_id
    assert not torch.equal(plain.sequences, eoser.sequences)
    first_plain = plain.unmask_step.masked_fill(plain.completion_ids != eos, 99).min(dim=1).values
    first_eoser = eoser.unmask_step.masked_fill(eoser.completion_ids != eos, 99).min(dim=1).values
    assert (first_eoser > first_plain).all()
    assert torch.equal(eoser.sequences, reference.generate(model, ids, mask, eos_schedule=(0.0, 1.0),
                                                           **{k: v for k, v in run.items()
                                                              if k != "record_unmask_step"}).sequences)


def test_ass_unmasks_two_to_the_s_tokens_at_step_s():
    model = llada()
    ids, mask = padded_prompts(2, 5)
    out = dllm_fast.generate(model, ids, mask, gen_length=16, block_length=8, unmask_schedule="ass",
                             temperature=1.0, generator=torch.Generator().manual_seed(0), record_unmask_step=True)
    per_step = torch.stack([(out.unmask_step == s).sum(dim=1) for s in range(out.nfe)], dim=1)
    assert per_step.tolist() == [[1, 2, 5, 1, 2, 5]] * 2


@pytest.mark.parametrize("sampler", [dllm_fast.generate, reference.generate], ids=["fused", "reference"])
def test_ass_rollouts_resume_at_ass_counts(sampler):
    """resume=Resume(...) under ASS: a canvas stopped inside a block holds ASS's counts (1 + 2 of a block of 8 after
    two steps; even's would be 3 + 3), and resuming there decodes the uninterrupted greedy tokens."""
    model = llada()
    ids, mask = padded_prompts(2, 5)
    run = dict(gen_length=16, block_length=8, unmask_schedule="ass", eos_schedule=EOSER)  # 3 steps a block
    whole = sampler(model, ids, mask, **run)
    for stop, masked in ((2, 16 - 3), (4, 16 - 8 - 1)):
        part = sampler(model, ids, mask, resume=Resume(num_steps=stop), **run)
        assert (part.completion_ids == model.mask_token_id).sum(dim=1).tolist() == [masked] * 2
        rest = sampler(model, ids, mask, resume=Resume(part.sequences, stop), **run)
        assert torch.equal(rest.sequences, whole.sequences), stop


def test_ass_on_a_partial_last_block_equals_the_twin():
    """gen_length not a multiple of the block (main's partial last block): ASS takes ceil(G / b) blocks of
    floor(log2 b) steps, the partial block running its schedule until it is decoded, as the twin does."""
    build, twin, weights = BLOCK_MODELS["sdar"]
    torch.manual_seed(1)
    model = build().eval()
    b = model.block_length
    ids, mask = padded_prompts(2, 9, pad=model.eos_token_id)
    G = 2 * b + b // 2
    fused = dllm_fast.generate(model, ids, mask, gen_length=G, block_length=b, cache="block",
                               unmask_schedule="ass", eos_schedule=EOSER)
    expected = twin.generate(weights(model), model.config, ids, mask, gen_length=G, mask_token_id=model.mask_token_id,
                             eos_token_id=model.eos_token_id, unmask_schedule="ass", eos_schedule=EOSER)
    assert torch.equal(fused.completion_ids, expected)
    with pytest.raises(ValueError, match=rf"3 block\(s\) \(gen_length / block_length, rounded up\) take "
                                         rf"steps={3 * ass_steps(b)}"):
        dllm_fast.generate(model, ids, mask, gen_length=G, block_length=b, unmask_schedule="ass",
                           steps=2 * ass_steps(b))


# Each family's tiny model with its EOS a token its greedy completions are full of, its twin and its weights.
BLOCK_MODELS = {
    "sdar": (lambda: SDARModel(dataclasses.replace(SDARConfig.preset("sdar-tiny"), eos_token_id=51)).double(),
             reference_sdar, lambda model: dict(model.named_parameters())),
    "llada2": (lambda: LLaDA2Model(dataclasses.replace(LLaDA2Config.preset("llada2-tiny"), eos_token_id=16)).double(),
               reference_llada2, reference_llada2.official_weights),
}


# Where EOSER changes the block model's greedy tokens (the others rank the EOS first at either factor).
EOSER_CHANGES = {("sdar", "eoser, even"), ("llada2", "eoser-ass"), ("llada2", "eoser, even")}
FAST_BLOCK_RUNS = (("sdar", "block", "eoser-ass"), ("sdar", "none", "eoser, even"), ("llada2", "block", "eoser-ass"))


@pytest.mark.parametrize("family, cache, options", [  # the twins recompute every block: about 1 s a run
    pytest.param(family, cache, options, marks=() if (family, cache, options) in FAST_BLOCK_RUNS else pytest.mark.slow)
    for family in BLOCK_MODELS for cache in ("block", "none") for options in OPTIONS])
def test_block_model_rollouts_equal_the_twin_token_for_token(family, cache, options):
    build, twin, weights = BLOCK_MODELS[family]
    torch.manual_seed(1)
    model = build().eval()
    b = model.block_length
    ids, mask = padded_prompts(2, 9, pad=model.eos_token_id)
    settings = dict(OPTIONS[options])
    if "steps" in settings:
        settings["steps"] = 2 * (16 // b)  # two steps a block
    fused = dllm_fast.generate(model, ids, mask, gen_length=16, block_length=b, cache=cache, **settings)
    expected = twin.generate(weights(model), model.config, ids, mask, gen_length=16,
                             mask_token_id=model.mask_token_id, eos_token_id=model.eos_token_id, **settings)
    assert torch.equal(fused.completion_ids, expected)
    if (family, options) in EOSER_CHANGES:
        settings.pop("eos_schedule")
        assert not torch.equal(fused.completion_ids, dllm_fast.generate(model, ids, mask, gen_length=16, block_length=b,
                                                                        cache=cache, **settings).completion_ids)


@pytest.mark.parametrize("settings, message", [
    (dict(unmask_schedule="doubling"), r"unmask_schedule='doubling' is not one of \('even', 'ass'\)"),
    (dict(unmask_schedule="ass", steps=8), r"steps=8 does not fit unmask_schedule='ass'.*steps=6"),
    (dict(unmask_schedule="ass", steps=None, threshold=0.9), r"unmask_schedule='ass' is a fixed schedule"),
    (dict(steps=None, threshold=0.9, eos_schedule=EOSER), r"threshold decoding has no fixed K"),
    (dict(steps=8, remasking="random", eos_schedule=EOSER), r"remasking='random' does not read"),
    (dict(steps=8, confidence_eos_eot_inf=True, eos_schedule=EOSER), r"confidence_eos_eot_inf=True both set"),
    (dict(steps=8, eos_schedule=0.5), r"eos_schedule=0.5 must be None or a pair"),
    (dict(steps=8, eos_schedule=(0.1, -1.0)), r"eos_schedule\[1\]=-1.0 must be >= 0.0"),
])
def test_bad_values_are_refused_by_name(settings, message):
    model = llada()
    ids, _ = padded_prompts(1, 3)
    with pytest.raises(ValueError, match=message):
        dllm_fast.generate(model, ids, gen_length=16, block_length=8, **settings)
