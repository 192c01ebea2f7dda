"""generate's resume option (rollout.Resume(canvas, start_step, num_steps); rollout/resume.py): a run stopped at
step b and resumed there decodes the uninterrupted run's tokens, in the fused sampler and its reference twin; bad values are
refused naming them."""

import pytest
import torch

import dllm_fast
from dllm_fast import reference
from dllm_fast.models import LLaDAConfig, LLaDAModel
from dllm_fast.rollout import Resume


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return LLaDAModel(LLaDAConfig.preset("tiny")).to(dtype=torch.float64).eval()


def prompts(lengths, pad_id=126, seed=1):
    torch.manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_id)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(0, 120, (length,))
        mask[row, width - length:] = 1
    return ids, mask


SETTINGS = dict(gen_length=12, block_length=4, steps=6)  # 3 blocks of 2 steps


def run(sampler, model, ids, mask, seed=0, **kwargs):
    return sampler(model, ids, mask, generator=torch.Generator().manual_seed(seed), **{**SETTINGS, **kwargs})


@pytest.mark.parametrize("sampler,cache,boundaries", [
    (dllm_fast.generate, "none", (1, 4)),
    (reference.generate, "none", (3,)),
    pytest.param(dllm_fast.generate, "none", (2, 3, 5), marks=pytest.mark.slow),
    pytest.param(dllm_fast.generate, "prefix", (2, 4), marks=pytest.mark.slow),
    pytest.param(dllm_fast.generate, "dual", (2, 4), marks=pytest.mark.slow),
    pytest.param(reference.generate, "dual", (2,), marks=pytest.mark.slow),
], ids=["fused-none", "reference-none", "fused-none-more", "fused-prefix", "fused-dual", "reference-dual"])
def test_resuming_at_a_step_gives_the_uninterrupted_greedy_tokens(sampler, cache, boundaries):
    """Stopped after b of the 6 steps (inside a block at odd b) and resumed there: the uninterrupted tokens. The
    caches resume at block boundaries (even b)."""
    model, (ids, mask) = tiny_model(), prompts([3, 5])
    whole = run(sampler, model, ids, mask, cache=cache)
    for b in boundaries:
        part = run(sampler, model, ids, mask, cache=cache, resume=Resume(num_steps=b))
        masked = (part.completion_ids == model.mask_token_id).sum(dim=1)
        assert masked.tolist() == [12 - 2 * b] * 2  # 4 tokens per block over 2 steps: 2 a step
        rest = run(sampler, model, ids, mask, cache=cache, resume=Resume(part.sequences, b))
        assert torch.equal(rest.sequences, whole.sequences), b
        assert part.nfe + rest.nfe == whole.nfe


def test_resumed_in_pieces_at_temperature_with_the_same_generator_state():
    """The noise is keyed by the call's key, the schedule's step, the row and the position: resumed pieces
    sampled with a generator in the first call's state give the uninterrupted run's tokens at T > 0."""
    model, (ids, mask) = tiny_model(), prompts([3, 5, 4])
    whole = run(dllm_fast.generate, model, ids, mask, seed=5, temperature=1.0)
    canvas, done = None, 0
    for piece in (1, 3, 2):
        part = run(dllm_fast.generate, model, ids, mask, seed=5, temperature=1.0,
                   resume=Resume(canvas, done, piece))
        canvas, done = part.sequences, done + piece
    assert torch.equal(canvas, whole.sequences)
    other = run(dllm_fast.generate, model, ids, mask, seed=6, temperature=1.0)
    assert not torch.equal(other.sequences, whole.sequences)  # the seed matters: the check can fail


def test_fused_and_reference_resume_alike():
    model, (ids, mask) = tiny_model(), prompts([2, 6])
    part = run(dllm_fast.generate, model, ids, mask, resume=Resume(num_steps=3))
    fused = run(dllm_fast.generate, model, ids, mask, resume=Resume(part.sequences, 3, 2))
    plain = run(reference.generate, model, ids, mask, resume=Resume(part.sequences, 3, 2))
    assert torch.equal(fused.sequences, plain.sequences)
    assert fused.nfe == plain.nfe == 2


def test_bad_resume_values_are_refused_naming_them():
    model, (ids, mask) = tiny_model(), prompts([3, 5])
    part = run(dllm_fast.generate, model, ids, mask, resume=Resume(num_steps=2))
    canvas = part.sequences
    with pytest.raises(ValueError, match=r"resume.start_step=7 must be an int in \[0, 6\]"):
        run(dllm_fast.generate, model, ids, mask, resume=Resume(canvas, 7))
    with pytest.raises(ValueError, match=r"resume.num_steps=5 must be an int in \[0, 4\]"):
        run(dllm_fast.generate, model, ids, mask, resume=Resume(canvas, 2, 5))
    with pytest.raises(ValueError, match=r"resume.canvas must be the \[B, P \+ gen_length\] = \[2, 17\]"):
        run(dllm_fast.generate, model, ids, mask, resume=Resume(canvas[:, :-1], 2))
    with pytest.raises(ValueError, match=r"resume.canvas\[0\] holds 4 mask tokens in block 1.*leaves 2"):
        run(dllm_fast.generate, model, ids, mask, resume=Resume(canvas, 3))
    other = canvas.clone()
    other[1, 2] = (other[1, 2] + 1) % 100
    with pytest.raises(ValueError, match=r"resume.canvas\[1, :5\] differs from input_ids\[1\]"):
        run(dllm_fast.generate, model, ids, mask, resume=Resume(other, 2))
    with pytest.raises(ValueError, match="resume.start_step=2 resumes a partly decoded canvas"):
        run(dllm_fast.generate, model, ids, mask, resume=Resume(start_step=2))
    with pytest.raises(ValueError, match=r"cache='prefix' refreshes.*resume.start_step=3 is step 1 of block 1"):
        run(dllm_fast.generate, model, ids, mask, cache="prefix", resume=Resume(run(
            dllm_fast.generate, model, ids, mask, resume=Resume(num_steps=3)).sequences, 3))
    with pytest.raises(ValueError, match="threshold decoding has no fixed schedule"):
        dllm_fast.generate(model, ids, mask, gen_length=12, block_length=4, threshold=0.9, resume=Resume(canvas, 2))
    with pytest.raises(ValueError, match="record_unmask_step=True"):
        run(dllm_fast.generate, model, ids, mask, resume=Resume(canvas, 2), record_unmask_step=True)
    with pytest.raises(TypeError, match=r"resume must be a dllm_fast.rollout.Resume"):
        run(dllm_fast.generate, model, ids, mask, resume=(canvas, 2))
