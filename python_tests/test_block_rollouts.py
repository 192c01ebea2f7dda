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
from dllm_fast.rollout.step import denoise_step

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
@pytest.mark.parametrize("cache", ["block", "none"])
def test_the_compiled_step_gives_eager_tokens_and_compiles_once_per_kind_of_step(cache, monkeypatch):
    """Compiled (aot_eager: dynamo's capture without code generation) with fullgraph: one graph per fed width
    (the first block's, the blocks that store the previous one, the others), reused by later calls."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(denoise_step, fullgraph=True, dynamic=False, backend=counter)
    monkeypatch.setattr("dllm_fast.rollout.blocks.compiled_step", lambda device_type: step)
    model = sdar(dtype=torch.float32)
    ids, mask = prompts(B=4)
    config = dict(gen_length=12, block_length=4, steps=6, temperature=1.0, cache=cache, record_unmask_step=True)
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
