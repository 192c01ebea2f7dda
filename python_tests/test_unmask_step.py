"""generate(record_unmask_step=True): the forward at which each completion position was unmasked (TraceRL's
trajectory order). Replaying the record gives exactly the masks every forward was fed, in every cache mode, with
a fixed schedule (whose per-forward counts it reproduces) and with threshold decoding."""

import pytest
import torch

import dllm_fast
from dllm_fast.rollout import masked_count_schedule
from test_generate import ScriptedModel, eos_prone_table, prompts, tiny_model, unmask_steps


def fed_canvases(model, run):
    """Run `run()` and return its result and, per forward, (first position fed, ids fed of the first B rows)."""
    fed = []

    def hook(module, args, kwargs):
        start = kwargs.get("cache_start", 0)
        fed.append((int(start), args[0].clone()))

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        result = run()
    finally:
        handle.remove()
    return result, fed


SCHEDULES = {"2 per step": dict(steps=8), "1 per step": dict(steps=16), "steps > tokens": dict(steps=32),
             "threshold": dict(threshold=0.5),
             "threshold, cfg": dict(threshold=0.5, cfg_scale=1.0), "random": dict(steps=8, remasking="random")}


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_replaying_the_record_gives_the_masks_every_forward_saw(cache, schedule, one_thread):
    model = tiny_model("cpu", head_scale=4.0)
    ids, mask = prompts("cpu", [3, 6])
    B, P = ids.shape
    result, fed = fed_canvases(model, lambda: dllm_fast.generate(
        model, ids, mask, gen_length=16, block_length=8, cache=cache, temperature=1.0, record_unmask_step=True,
        generator=torch.Generator().manual_seed(0), **SCHEDULES[schedule]))
    when = result.unmask_step
    assert when.shape == (B, 16) and when.dtype == torch.int64
    assert len(fed) == result.nfe and when.min() >= 0 and when.max() < result.nfe
    for forward, (start, canvas) in enumerate(fed):
        span = slice(max(start, P) - start, canvas.shape[1])  # the completion positions fed
        completion = slice(max(start, P) - P, start - P + canvas.shape[1])
        assert torch.equal(canvas[:B, span] == model.mask_token_id, when[:, completion] >= forward), forward
    if "steps" in SCHEDULES[schedule]:  # each forward unmasks the schedule's count in every row (steps that would
        per_block = [k for k in masked_count_schedule(8, SCHEDULES[schedule]["steps"] // 2) if k]  # unmask 0 skip)
        for row in when:
            assert torch.bincount(row, minlength=result.nfe).tolist() == per_block * 2


def test_the_record_is_the_order_the_canvases_show(one_thread):
    """Against the canvases a context-free model was fed (the helper the EOS tests use)."""
    table = eos_prone_table(2, 16, torch.Generator().manual_seed(0))
    model = ScriptedModel(table)
    result = dllm_fast.generate(model, torch.tensor([[1, 2]]), gen_length=16, block_length=8, threshold=0.3,
                                record_unmask_step=True)
    assert torch.equal(result.unmask_step, unmask_steps(model.canvases, model.mask_token_id)[:, 2:])


def test_nothing_is_recorded_unless_asked(one_thread):
    model = tiny_model("cpu")
    ids, mask = prompts("cpu", [3])
    kwargs = dict(gen_length=8, block_length=4, steps=4)
    plain = dllm_fast.generate(model, ids, mask, **kwargs)
    recorded = dllm_fast.generate(model, ids, mask, record_unmask_step=True, **kwargs)
    assert plain.unmask_step is None
    assert torch.equal(plain.sequences, recorded.sequences)
    with pytest.raises(TypeError, match="record_unmask_step=1 must be True or False"):
        dllm_fast.generate(model, ids, mask, record_unmask_step=1, **kwargs)
