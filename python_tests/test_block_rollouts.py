"""generate on a block-diffusion model: greedy tokens with the exact block KV cache equal a decoder that recomputes
every block from scratch with the dense block-causal mask, one unpadded prompt at a time (reference/sdar.py), at
batch 1 and batch 8 with left padding, for the official generate's remasking rules; the compiled step gives
eager's tokens; the decoding order is recorded for TraceRL; bad calls are refused by name."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import dllm_fast
from dllm_fast.contracts import RolloutBatch
from dllm_fast.likelihood import sample_masks
from dllm_fast.models import LLaDAConfig, LLaDAModel, SDARConfig, SDARModel
from dllm_fast.reference import sdar as reference
from dllm_fast.rollout.blocks import AFTER_COMPLETION, Layout, _row_base
from dllm_fast.rollout.step import denoise_step, position_words

pytestmark = pytest.mark.usefixtures("one_thread")

MASK, EOS = 127, 126
SCHEDULES = {
    "static": dict(steps=8),  # low_confidence_static, 2 steps per block of 4
    "static, a step per token": dict(steps=16),
    "dynamic": dict(steps=8, threshold=0.05),  # low_confidence_dynamic: at least the schedule, all above 0.05
    "threshold": dict(threshold=0.1),  # Fast-dLLM: the most confident plus all at or above
}


def sdar(dtype=torch.float64, seed=1):
    return SDARModel.with_random_weights(SDARConfig.preset("sdar-tiny"), dtype=dtype, seed=seed).eval()


def prompts(B=8, P=11, seed=0):
    """Left-padded prompts: row n has n padding positions, so every offset of a block of 4 occurs."""
    ids = torch.randint(0, 120, (B, P), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for n in range(B):
        mask[n, :n] = 0
    return ids.masked_fill(mask == 0, EOS), mask


def naive(model, ids, mask, gen_length=16, **schedule):
    return reference.generate(dict(model.named_parameters()), model.config, ids, mask, gen_length=gen_length,
                              mask_token_id=MASK, **schedule)


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("cache", ["block", "none"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_greedy_tokens_equal_the_decoder_that_recomputes_every_block(batch, cache, schedule):
    model = sdar()
    ids, mask = prompts(B=8)
    ids, mask = ids[-batch:], mask[-batch:]  # batch 1: the most padded row
    out = dllm_fast.generate(model, ids, mask, gen_length=16, block_length=4, cache=cache,
                             **SCHEDULES[schedule])
    assert torch.equal(out.completion_ids, naive(model, ids, mask, **SCHEDULES[schedule]))
    assert torch.equal(out.sequences[:, :ids.shape[1]], ids) and (out.completion_ids != MASK).all()


def test_kv_reuse_changes_no_token_in_fp32_and_records_the_same_order():
    model = sdar(dtype=torch.float32, seed=3)
    ids, mask = prompts(B=8, P=13, seed=2)
    for schedule in SCHEDULES.values():
        reused, recomputed = (dllm_fast.generate(model, ids, mask, gen_length=16, block_length=4, cache=cache,
                                                 record_unmask_step=True, **schedule) for cache in ("block", "none"))
        assert torch.equal(reused.sequences, recomputed.sequences)
        assert torch.equal(reused.unmask_step, recomputed.unmask_step) and reused.nfe == recomputed.nfe


def test_sampling_is_reproducible_and_independent_of_the_batch_padding():
    """T > 0: the noise is keyed by (step in the block, row, completion position), so a prompt padded further
    (a longer common prompt length) samples the same tokens in the same row."""
    model = sdar()
    ids, mask = prompts(B=4, P=9)
    wider = torch.cat([torch.full((4, 5), EOS), ids], dim=1)
    wider_mask = torch.cat([torch.zeros(4, 5, dtype=torch.long), mask], dim=1)
    runs = [dllm_fast.generate(model, i, m, gen_length=12, block_length=4, steps=6, temperature=1.0, cache="block",
                               generator=torch.Generator().manual_seed(7))
            for i, m in ((ids, mask), (ids, mask), (wider, wider_mask))]
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
    assert torch.equal(runs[0].completion_ids, runs[2].completion_ids)
    other = dllm_fast.generate(model, ids, mask, gen_length=12, block_length=4, steps=6, temperature=1.0,
                               generator=torch.Generator().manual_seed(8))
    assert not torch.equal(other.completion_ids, runs[0].completion_ids)


def test_the_decoding_order_is_recorded_block_by_block_for_tracerl():
    model = sdar()
    ids, mask = prompts(B=4)
    out = dllm_fast.generate(model, ids, mask, gen_length=16, block_length=4, cache="block", record_unmask_step=True,
                             **SCHEDULES["dynamic"])
    steps = out.unmask_step
    assert (steps >= 0).all() and (steps < out.nfe).all()
    pad = (mask == 0).sum(1)
    for n in range(4):
        block = (torch.arange(16) + ids.shape[1] - int(pad[n])) // 4  # each completion position's block
        blocks = block.unique().tolist()
        for b, after in zip(blocks, blocks[1:]):  # every step of a block comes before the next block's
            assert steps[n][block == b].max() < steps[n][block == after].min()
    batch = RolloutBatch.from_generation(out, torch.arange(4.0), group_size=2)
    masks = sample_masks(batch.sequences, prompt_length=batch.prompt_length, n_t=None, sampler="trajectory",
                         generator=torch.Generator(), eos_token_id=EOS, attention_mask=batch.attention_mask,
                         unmask_step=batch.unmask_step)
    assert masks.n_t <= out.nfe and masks.sampler == "trajectory"
    # each state's tokens lie in one block: its context is the clean earlier blocks, as the rollout's was
    for n in range(4):
        block = (torch.arange(16) + ids.shape[1] - int(pad[n])) // 4
        for j in range(masks.n_t):
            assert block[masks.targets[n, j]].unique().numel() <= 1


@pytest.mark.compile
@pytest.mark.slow  # torch.compile, about 15 s a case on 2 cores
@pytest.mark.parametrize("cache, full_last_block", [("block", False), ("none", False), ("block", True)])
def test_the_compiled_step_gives_eager_tokens_and_compiles_once_per_kind_of_step(cache, full_last_block, monkeypatch):
    """Compiled (aot_eager: dynamo's capture without code generation) with fullgraph: one graph per fed width
    (the first block's, the blocks that store the previous one, the others), reused by later calls."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(denoise_step, fullgraph=True, dynamic=False, backend=counter)
    monkeypatch.setattr("dllm_fast.rollout.blocks.compiled_step", lambda device_type: step)
    model = sdar(dtype=torch.float32)
    ids, mask = prompts(B=4)
    config = dict(gen_length=12, block_length=4, steps=6, temperature=1.0, cache=cache, record_unmask_step=True,
                  full_last_block=full_last_block)
    for seed in range(2):
        eager = dllm_fast.generate(model, ids, mask, generator=torch.Generator().manual_seed(seed), **config)
        compiled = dllm_fast.generate(model, ids, mask, compile=True, generator=torch.Generator().manual_seed(seed),
                                      **config)
        assert torch.equal(eager.sequences, compiled.sequences) and torch.equal(eager.unmask_step,
                                                                                compiled.unmask_step)
        if seed == 0:
            graphs = counter.frame_count
    assert counter.frame_count == graphs <= 3
    torch._dynamo.reset()


def test_the_other_options_apply_to_block_models():
    """Random remasking, EOS never sampled, EOS and EoT unmasked last: every position decoded, no EOS sampled."""
    model = sdar()
    ids, mask = prompts(B=3)
    for options in (dict(remasking="random", temperature=1.0), dict(logits_eos_inf=True),
                    dict(confidence_eos_eot_inf=True, threshold=0.5)):
        out = dllm_fast.generate(model, ids, mask, gen_length=8, block_length=4, cache="block",
                                 generator=torch.Generator().manual_seed(0),
                                 **({"steps": 4} if "threshold" not in options else {}), **options)
        assert (out.completion_ids != MASK).all()
        if options.get("logits_eos_inf"):
            assert (out.completion_ids != EOS).all()


def test_bad_calls_are_refused_by_name():
    model = sdar()
    ids, mask = prompts(B=2)
    with pytest.raises(ValueError, match=r"block_length=8, but the model attends in blocks of 4"):
        dllm_fast.generate(model, ids, mask, gen_length=16, block_length=8, steps=8)
    with pytest.raises(ValueError, match="classifier-free guidance is not implemented for block-diffusion"):
        dllm_fast.generate(model, ids, mask, gen_length=16, block_length=4, steps=8, cfg_scale=1.0)
    with pytest.raises(ValueError, match="cache='prefix' is Fast-dLLM's approximate cache"):
        dllm_fast.generate(model, ids, mask, gen_length=16, block_length=4, steps=8, cache="prefix")
    llada = LLaDAModel.with_random_weights(LLaDAConfig.preset("tiny"))
    with pytest.raises(ValueError, match="cache='block' keeps the exact keys and values of finished blocks"):
        dllm_fast.generate(llada, ids, mask, gen_length=16, block_length=4, steps=8, cache="block")
    with pytest.raises(ValueError, match="steps=8 is ignored when threshold is set"):  # dynamic: block models only
        dllm_fast.generate(llada, ids, mask, gen_length=16, block_length=4, steps=8, threshold=0.5)


def test_generate_plans_on_fake_tensors():
    """The planner runs generate on fake tensors: no value is read (a fixed schedule; a threshold with
    assumed_steps_per_block)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = SDARModel.with_random_weights(SDARConfig.preset("sdar-tiny"))
        ids = torch.randint(0, 100, (2, 9))
        out = dllm_fast.generate(model, ids, torch.ones_like(ids), gen_length=8, block_length=4, steps=4,
                                 cache="block", record_unmask_step=True)
        assert out.completion_ids.shape == (2, 8)
        out = dllm_fast.generate(model, ids, None, gen_length=8, block_length=4, threshold=0.9,
                                 assumed_steps_per_block=2, cache="block")
        assert out.nfe == 3 * 2  # the widest layout: 3 blocks of 2 assumed steps


# -- issue 40: what bounds a block rollout's forwards; the planner's count; the official full last block --------

def mixed_prompts(lengths, P=None, seed=0):
    """Left-padded prompts of the given real lengths."""
    P = P or max(lengths)
    ids = torch.randint(0, 120, (len(lengths), P), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros_like(ids)
    for n, length in enumerate(lengths):
        mask[n, P - length:] = 1
    return ids.masked_fill(mask == 0, EOS), mask


@pytest.mark.parametrize("lengths", [[5, 4], [4, 5], [5, 6, 7, 8], [9, 9], [8, 8], [3, 4, 5, 6, 7, 8, 9, 10]])
@pytest.mark.parametrize("schedule", [dict(steps=8), dict(steps=4), dict(steps=2), dict(threshold=0.5),
                                      dict(steps=4, threshold=0.3)], ids=["8", "4", "2", "threshold", "dynamic"])
@pytest.mark.parametrize("full_last_block", [False, True])
def test_a_block_rollouts_forwards_are_bounded_as_generate_says(lengths, schedule, full_last_block):
    """Issue 40 item 1: each row's blocks align to its own first token, so a batch mixing alignments runs more
    forwards than gen_length (11 for gen_length 8 here): the bound is gen_length / block_length + 2 windows of
    min(steps per block, block_length) forwards; nfe is the count and every unmask_step lies below it; a batch
    whose rows share one alignment stays within the positions it decodes (gen_length, or with full_last_block
    the rest of the last block too)."""
    from dllm_fast.rollout.blocks import max_block_forwards
    from dllm_fast.rollout.plan import check_generate_args

    model = sdar()
    ids, mask = mixed_prompts(lengths)
    settings = dict(gen_length=8, block_length=4, cache="block", record_unmask_step=True,
                    full_last_block=full_last_block, **schedule)
    out = dllm_fast.generate(model, ids, mask, **settings)
    plan = check_generate_args(model, ids, mask, dllm_fast.GenerateConfig(**{
        k: v for k, v in settings.items() if k != "record_unmask_step"}))
    assert out.nfe <= max_block_forwards(plan, 8, 4)
    assert (out.unmask_step >= 0).all() and (out.unmask_step < out.nfe).all()
    if len({length % 4 for length in lengths}) == 1:  # one alignment: a forward unmasks a token of every row
        decoded = 8 + (-(lengths[0] + 8)) % 4 if full_last_block else 8  # and the rest of a whole last block
        assert out.nfe <= decoded and (out.unmask_step < decoded).all()
    batch = RolloutBatch.from_generation(out, torch.arange(float(len(lengths))), group_size=1)
    masks = sample_masks(batch.sequences, prompt_length=batch.prompt_length, n_t=None, sampler="trajectory",
                         generator=torch.Generator(), eos_token_id=EOS, attention_mask=batch.attention_mask,
                         unmask_step=batch.unmask_step)
    assert masks.n_t <= out.nfe


def test_the_issues_batch_runs_eleven_forwards_for_eight_tokens():
    model = sdar()
    ids, mask = mixed_prompts([5, 4])
    out = dllm_fast.generate(model, ids, mask, gen_length=8, block_length=4, steps=8, cache="block",
                             record_unmask_step=True)
    assert out.nfe == 11 and int(out.unmask_step.max()) == 10
    with pytest.raises(ValueError, match=r"pass forwards=GenerationResult.nfe .* block-diffusion batch mixed"):
        RolloutBatch(out.sequences, out.attention_mask, ids.shape[1], out.completion_mask, torch.zeros(2), 1,
                     out.unmask_step)
    RolloutBatch(out.sequences, out.attention_mask, ids.shape[1], out.completion_mask, torch.zeros(2), 1,
                 out.unmask_step, forwards=out.nfe)


@pytest.mark.parametrize("lengths, gen_length, block, steps", [
    ([8, 8], 8, 4, 8), ([6, 6], 8, 4, 8), ([5, 6], 8, 4, 8), ([8, 8], 8, 8, 8), ([5, 12, 9], 12, 4, 6),
    ([7, 7, 7], 16, 4, 4)])
@pytest.mark.parametrize("full_last_block", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_on_the_planners_constant_prompts_the_forward_count_is_the_real_one(lengths, gen_length, block, steps,
                                                                              full_last_block):
    """Issue 40 item 4: on fake tensors the planner counted 12 or 16 forwards for an SDAR rollout whose real run
    takes 8 (the widest layout, every window its full steps)."""
    from dllm_fast.planning.fake import PlanningFakeMode

    settings = dict(gen_length=gen_length, block_length=block, steps=steps, cache="block",
                    full_last_block=full_last_block)
    model = sdar(dtype=torch.float32)
    model.block_length = block
    ids, mask = mixed_prompts(lengths)
    real = dllm_fast.generate(model, ids, mask, **settings).nfe
    with PlanningFakeMode():
        fake_model = SDARModel.with_random_weights(SDARConfig.preset("sdar-tiny"))
        fake_model.block_length = block
        fake_ids, fake_mask = mixed_prompts(lengths)  # made in the mode: constants, as the planner's prompts
        planned = dllm_fast.generate(fake_model, fake_ids, fake_mask, **settings).nfe
    assert planned == real


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("cache", ["block", "none"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_the_full_last_block_equals_the_decoder_that_decodes_whole_blocks(batch, cache, schedule):
    """Issue 40 item 14: the official generate decodes a whole last block (its positions after the completion are
    masked and decoded too); full_last_block=True does, as the twin does (reference/sdar.py)."""
    model = sdar()
    ids, mask = prompts(B=8)
    ids, mask = ids[-batch:], mask[-batch:]
    out = dllm_fast.generate(model, ids, mask, gen_length=16, block_length=4, cache=cache, full_last_block=True,
                             **SCHEDULES[schedule])
    assert torch.equal(out.completion_ids, naive(model, ids, mask, full_last_block=True, **SCHEDULES[schedule]))


def test_the_full_last_block_changes_only_the_last_blocks_of_rows_whose_completion_ends_inside_one():
    """At T > 0 the noise of the completion's positions is the default's, so only a partial last block (its
    extra masked positions attend and are attended) can sample other tokens; a row whose completion ends on a
    block boundary decodes exactly the same."""
    model = sdar()
    ids, mask = prompts(B=8)
    runs = [dllm_fast.generate(model, ids, mask, gen_length=16, block_length=4, steps=16, temperature=1.0,
                               full_last_block=full, record_unmask_step=True,
                               generator=torch.Generator().manual_seed(3)) for full in (False, True)]
    differ = runs[0].completion_ids != runs[1].completion_ids
    real = mask.sum(1)
    for n in range(8):
        tail = (int(real[n]) + 16) % 4  # completion positions in the last, partial block
        last_block = torch.arange(16) >= 16 - tail if tail else torch.zeros(16, dtype=torch.bool)
        assert not differ[n][~last_block].any(), n
        if not tail:
            assert torch.equal(runs[0].unmask_step[n], runs[1].unmask_step[n])
    assert differ.any() and runs[1].nfe >= runs[0].nfe


def test_full_last_block_is_a_boolean_and_the_default_is_the_completions_end():
    model = sdar()
    ids, mask = prompts(B=2)
    assert dllm_fast.GenerateConfig(gen_length=8, block_length=4).full_last_block is False
    with pytest.raises(TypeError, match=r"full_last_block=1 must be True or False"):
        dllm_fast.generate(model, ids, mask, gen_length=8, block_length=4, steps=4, full_last_block=1)
    llada = LLaDAModel.with_random_weights(LLaDAConfig.preset("tiny"))  # its last block is whole anyway
    runs = [dllm_fast.generate(llada, ids, mask, gen_length=8, block_length=4, steps=4, full_last_block=full)
            for full in (False, True)]
    assert torch.equal(runs[0].sequences, runs[1].sequences)


@pytest.mark.parametrize("full_last_block", [False, True])
def test_every_decoded_position_of_a_batch_has_its_own_noise_word(full_last_block):
    """Two positions with one word would draw one Gumbel noise: a full last block's extra positions are set apart
    from every row's completion words (a flag bit), which stay the default's."""
    ids, mask = mixed_prompts([3, 4, 5, 6, 7, 8, 9, 10])
    layout = Layout.of(ids, mask, 8, 4, read=True, full_last_block=full_last_block)
    columns = torch.arange(layout.width)[None].expand(8, -1)
    words = position_words(_row_base(layout, 8, 4, full_last_block), columns)
    decoded = words[layout.decoded]
    assert decoded.unique().numel() == decoded.numel() and (decoded >= 0).all()
    # Below 2^32 but for the after-completion flag, which the step word (bits 32 and up) never reaches.
    assert ((decoded & ~AFTER_COMPLETION) < 2**32).all() and (decoded[decoded >= 2**32] >= AFTER_COMPLETION).all()
    default = position_words(_row_base(layout, 8, 4), columns)
    assert torch.equal(words.gather(1, layout.completion_columns), default.gather(1, layout.completion_columns))


@pytest.mark.parametrize("full_last_block", [False, True])
@pytest.mark.parametrize("gen_length", [4, 6, 8, 12])
def test_a_rows_noise_words_do_not_depend_on_the_rows_after_it(full_last_block, gen_length):
    """Issue 45 item 4: row n of a batch draws the noise it draws in any batch that holds the same first n + 1
    rows, whatever follows (a full last block's extra positions were keyed past the whole batch's completions)."""
    ids, mask = mixed_prompts([3, 4, 5, 6, 7, 8, 9, 10], P=10)
    words = []
    for B in range(1, 9):
        layout = Layout.of(ids[:B], mask[:B], gen_length, 4, read=True, full_last_block=full_last_block)
        columns = torch.arange(layout.width)[None].expand(B, -1)
        words.append(position_words(_row_base(layout, gen_length, 4, full_last_block), columns)
                     .masked_fill(~layout.decoded, -1))
    for B in range(1, 8):  # the canvas widens with the rows' shifts; row n decodes within its own width
        assert torch.equal(words[B][:B, :words[B - 1].shape[1]], words[B - 1]), B


def alone_and_among_copies(model, seeds, full_last_block, copies=3):
    """How many of `seeds` give a prompt (of 2 to 7 tokens, so its completion ends anywhere in a block) another
    sample alone than as row 0 of `copies` copies of itself, at T = 1."""
    differ = 0
    for seed in seeds:
        ids = torch.randint(0, 120, (1, 2 + seed % 6), generator=torch.Generator().manual_seed(seed))
        options = dict(gen_length=8, block_length=4, steps=8, temperature=1.0, full_last_block=full_last_block)
        alone, among = (dllm_fast.generate(model, batch, None, generator=torch.Generator().manual_seed(seed),
                                           **options).completion_ids[0]
                        for batch in (ids, ids.expand(copies, -1).contiguous()))
        differ += not torch.equal(alone, among)
    return differ


@pytest.mark.slow
@pytest.mark.parametrize("full_last_block", [False, True])
def test_a_prompt_samples_alone_what_it_samples_as_row_0_of_copies(full_last_block):
    """Issue 45 item 4 (SDAR: 5 of 12 seeds differed with full_last_block): generate's promise that a row's sample
    does not depend on its batch, over 12 seeds."""
    assert alone_and_among_copies(sdar(), range(12), full_last_block) == 0


@pytest.mark.parametrize("gen_length", [5, 7])
@pytest.mark.parametrize("full_last_block", [False, True])
def test_any_gen_length_decodes_as_the_decoder_that_recomputes_every_block(gen_length, full_last_block):
    """Issue 45 item 7: the official generate takes any gen_length; so does a block-diffusion model's: its last
    block partial (or whole with full_last_block), steps a multiple of the blocks rounded up; the forwards stay
    within max_block_forwards and bound unmask_step."""
    from dllm_fast.rollout.blocks import max_block_forwards
    from dllm_fast.rollout.plan import check_generate_config

    model = sdar()
    ids, mask = prompts(B=4)
    for schedule in (dict(steps=4), dict(steps=8, threshold=0.05), dict(threshold=0.1)):
        config = dllm_fast.GenerateConfig(gen_length=gen_length, block_length=4, full_last_block=full_last_block,
                                          **schedule)
        out = dllm_fast.generate(model, ids, mask, config=config, record_unmask_step=True)
        expected = naive(model, ids, mask, gen_length=gen_length, full_last_block=full_last_block, **schedule)
        assert torch.equal(out.completion_ids, expected), schedule
        bound = max_block_forwards(check_generate_config(model, config), gen_length, 4)
        assert (out.unmask_step < out.nfe).all() and out.nfe <= bound
    with pytest.raises(ValueError, match=r"steps=3 is not a multiple of the number of blocks 2 .*rounded up"):
        dllm_fast.generate(model, ids, mask, gen_length=gen_length, block_length=4, steps=3)
