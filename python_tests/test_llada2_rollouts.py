"""generate on LLaDA2: greedy tokens with the exact block KV cache (the prompt's whole blocks prefilled) equal the
decoder that recomputes every block with the dense block-causal mask on the fp64 twin (reference/llada2.py), one
unpadded prompt at a time, at batch 1 and 8 with left padding, under the official generate's rules (a fixed
transfer schedule, the same with its confidence threshold, a threshold alone); the EOS early stop; every expert
provider and the compiled step give the same tokens; the kernels a mixture-of-experts layer launches."""

import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import dllm_fast
from dllm_fast.models import LLaDA2Config, LLaDA2Model
from dllm_fast.models.moe import grouped_mm_available
from dllm_fast.reference import llada2 as reference
from dllm_fast.rollout.step import denoise_step
from test_block_rollouts import alone_and_among_copies

pytestmark = pytest.mark.usefixtures("one_thread")

MASK, EOS = 127, 126
SCHEDULES = {
    "schedule": dict(steps=8),  # 2 steps per block of 4, remainder first, the most confident first
    "schedule and threshold": dict(steps=8, threshold=0.05),  # the official rule: all above it, at least the count
    "threshold": dict(threshold=0.1),  # Fast-dLLM: the most confident plus all at or above
}


def llada2(dtype=torch.float64, seed=1, **overrides):
    config = LLaDA2Config(**{**LLaDA2Config.preset("llada2-tiny").__dict__, "extra": {}, **overrides})
    return LLaDA2Model.with_random_weights(config, dtype=dtype, seed=seed).eval()


def prompts(B=8, P=11, seed=0):
    """Left-padded prompts: row n has n padding positions, so every offset of a block of 4 occurs."""
    ids = torch.randint(0, 120, (B, P), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for n in range(B):
        mask[n, :n] = 0
    return ids.masked_fill(mask == 0, EOS), mask


def naive(model, ids, mask, gen_length=16, **schedule):
    return reference.generate(reference.official_weights(model), model.config, ids, mask, gen_length=gen_length,
                              mask_token_id=MASK, **schedule)


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_greedy_tokens_with_kv_reuse_equal_the_decoder_that_recomputes_every_block(batch, schedule):
    model = llada2()
    ids, mask = prompts(B=8)
    ids, mask = ids[-batch:], mask[-batch:]  # batch 1: the most padded row
    expected = naive(model, ids, mask, **SCHEDULES[schedule])
    for cache in ("block", "none"):
        out = dllm_fast.generate(model, ids, mask, gen_length=16, block_length=4, cache=cache, **SCHEDULES[schedule])
        assert torch.equal(out.completion_ids, expected), cache
    assert torch.equal(out.sequences[:, :ids.shape[1]], ids) and (out.completion_ids != MASK).all()


@pytest.mark.parametrize("full_last_block", [pytest.param(False, marks=pytest.mark.slow), True])
def test_the_last_block_whole_or_ended_at_the_completion_as_the_decoder_that_recomputes(full_last_block):
    """The official LLaDA2 generate decodes a whole last block (full_last_block=True); by default it ends with the
    completion. Blocks count from each row's first real token, so with prompts of 11 - n real tokens a completion
    of 16 ends mid-block in every row but those with n = 3 and 7, and the two differ."""
    model = llada2()
    ids, mask = prompts(B=8)
    expected = naive(model, ids, mask, gen_length=16, steps=8, full_last_block=full_last_block)
    out = dllm_fast.generate(model, ids, mask, gen_length=16, block_length=4, steps=8, cache="block",
                             full_last_block=full_last_block)
    assert torch.equal(out.completion_ids, expected)
    other = naive(model, ids, mask, gen_length=16, steps=8, full_last_block=not full_last_block)
    assert not torch.equal(other, expected)  # the option changes tokens here


def test_every_expert_provider_and_the_fp32_cache_give_the_same_tokens():
    model = llada2(dtype=torch.float32, seed=3)
    ids, mask = prompts(B=8, P=13, seed=2)
    outputs = []
    for provider in ["bmm", "loop"] + (["grouped_mm"] if grouped_mm_available() else []):
        model.experts_provider = provider
        for cache in ("block", "none"):
            outputs.append(dllm_fast.generate(model, ids, mask, gen_length=16, block_length=4, cache=cache,
                                              record_unmask_step=True, **SCHEDULES["schedule and threshold"]))
    for out in outputs[1:]:
        assert torch.equal(out.sequences, outputs[0].sequences)
        assert torch.equal(out.unmask_step, outputs[0].unmask_step) and out.nfe == outputs[0].nfe


def eos_prone(seed=9):
    """A model that ends completions early: the EOS row of the LM head is the row of the token it decodes most,
    scaled by 1.05, so EOS wins where that token would (rows end after 3 to 8 tokens)."""
    model = llada2(dtype=torch.float32, seed=seed)
    ids, mask = prompts(B=4, P=9)
    out = dllm_fast.generate(model, ids, mask, gen_length=32, block_length=4, steps=16, cache="block")
    with torch.no_grad():
        model.lm_head.weight[EOS] = 1.05 * model.lm_head.weight[torch.mode(out.completion_ids.flatten()).values]
    return model, ids, mask


def test_eos_early_stop_keeps_every_completion_up_to_its_eos_and_skips_the_rest():
    """LLaDA2's generate stops after a block once every row has ended: the completion up to and including each
    row's first EOS is the full rollout's, later positions are EOS, and fewer forwards ran."""
    model, ids, mask = eos_prone()
    settings = dict(gen_length=32, block_length=4, steps=16, threshold=0.95, cache="block", record_unmask_step=True)
    full = dllm_fast.generate(model, ids, mask, **settings)
    early = dllm_fast.generate(model, ids, mask, eos_early_stop=True, **settings)
    ends = full.completion_mask.sum(dim=1)
    assert (full.completion_ids == EOS).any(dim=1).all() and ends.max() <= 24, ends  # the test's premise
    assert early.nfe < full.nfe
    assert torch.equal(early.completion_mask, full.completion_mask)
    assert torch.equal(early.completion_ids[early.completion_mask.bool()], full.completion_ids[full.completion_mask.bool()])
    after = ~early.completion_mask.bool()  # after the first EOS: the decoded blocks' tokens, then EOS
    assert ((early.completion_ids == full.completion_ids) | (early.completion_ids == EOS))[after].all()
    assert (early.completion_ids[:, -8:] == EOS).all()  # the last two blocks were never decoded
    assert (early.unmask_step >= 0).all() and (early.unmask_step < early.nfe).all()
    with pytest.raises(ValueError, match="eos_early_stop=True stops a block-diffusion rollout"):
        from dllm_fast.models import LLaDAConfig, LLaDAModel
        dllm_fast.generate(LLaDAModel.with_random_weights(LLaDAConfig.preset("tiny")), ids, mask, gen_length=8,
                           block_length=4, steps=4, eos_early_stop=True)


@pytest.mark.compile
@pytest.mark.slow  # torch.compile, about 20 s on 2 cores
def test_the_compiled_step_gives_eager_tokens_with_grouped_gemm_experts(monkeypatch):
    """Compiled (aot_eager, fullgraph: the experts' grouped GEMM has no host sync), the tokens are eager's (which
    uses the sorted batched GEMMs on CPU)."""
    if not grouped_mm_available():
        pytest.skip("torch._grouped_mm is not in this torch")
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(denoise_step, fullgraph=True, dynamic=False, backend=counter)
    monkeypatch.setattr("dllm_fast.rollout.blocks.compiled_step", lambda device_type: step)
    model = llada2(dtype=torch.float32)
    ids, mask = prompts(B=4)
    config = dict(gen_length=12, block_length=4, steps=6, temperature=1.0, cache="block", record_unmask_step=True)
    eager = dllm_fast.generate(model, ids, mask, generator=torch.Generator().manual_seed(0), **config)
    compiled = dllm_fast.generate(model, ids, mask, compile=True, generator=torch.Generator().manual_seed(0),
                                  **config)
    assert torch.equal(eager.sequences, compiled.sequences) and torch.equal(eager.unmask_step, compiled.unmask_step)
    assert counter.frame_count <= 3
    torch._dynamo.reset()


def test_a_moe_layer_launches_a_fixed_number_of_eager_kernels():
    """The kernels one mixture-of-experts layer adds to an eager forward, counted as bench_rollout.py counts them
    (the profiler's CPU trace; views, allocations and type queries launch nothing): the same for every such layer
    whatever the experts' count, and no loop over experts (grouped_mm: one kernel per projection whatever E)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_moe_rollout

    counts = {}
    for experts in (16, 64):
        model = llada2(dtype=torch.float32, num_experts=experts, n_group=4)
        model.experts_provider = "grouped_mm" if grouped_mm_available() else "bmm"
        counts[experts] = bench_moe_rollout.moe_layer_kernels(model, tokens=32)
    assert counts[16] == counts[64], counts
    total, by_op = counts[16]
    assert by_op.get("aten::_grouped_mm", by_op.get("aten::bmm")) == 2, by_op
    if grouped_mm_available():
        assert total == bench_moe_rollout.MOE_LAYER_KERNELS, (total, by_op)


@pytest.mark.slow
@pytest.mark.parametrize("full_last_block", [False, True])
def test_a_prompt_samples_alone_what_it_samples_as_row_0_of_copies(full_last_block):
    """Issue 45 item 4 (LLaDA2: 2 of 12 seeds differed with full_last_block, as the official generate decodes):
    generate's promise that a row's sample does not depend on its batch, over 12 seeds."""
    assert alone_and_among_copies(llada2(), range(12), full_last_block) == 0
