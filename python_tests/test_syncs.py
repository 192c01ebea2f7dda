"""dllm_fast.testing.syncs counts host syncs; generate's syncs per step, per block and per call are pinned at their
documented values (dllm_fast/rollout/sampler.py), for each cache policy and for threshold decoding."""

import pytest
import torch

import dllm_fast
from dllm_fast.models import LLaDAConfig, LLaDAModel
from dllm_fast.testing.syncs import SyncCounter
from dllm_fast.validation import values_checked
from test_generate import ScriptedModel, eos_prone_table, prompts, tiny_model

VALUES = torch.tensor([2, 0, 1])

# (what the code does, the syncs it costs): every kind of value read the module docstring lists.
CASES = [
    ("item", lambda t: t[0].item(), {"aten._local_scalar_dense": 1}),
    ("int", lambda t: int(t.sum()), {"aten._local_scalar_dense": 1}),
    ("truth value", lambda t: bool((t > 0).any()), {"aten._local_scalar_dense": 1}),
    ("equal", lambda t: torch.equal(t, t), {"aten.equal": 1}),
    ("allclose", lambda t: torch.allclose(t.float(), t.float()), {"aten.allclose": 1}),
    ("nonzero", lambda t: t.nonzero(), {"aten.nonzero": 1}),
    ("where(cond)", lambda t: torch.where(t > 0), {"aten.nonzero": 1}),
    ("masked_select", lambda t: t.masked_select(t > 0), {"aten.masked_select": 1}),
    ("boolean index", lambda t: t[t > 0], {"aten.index": 1}),
    ("boolean index_put", lambda t: t.clone().__setitem__(t > 0, 5), {"aten.index_put_": 1}),
    ("unique", lambda t: t.unique(), {"aten._unique2": 1}),
    ("bincount", lambda t: t.bincount(), {"aten.bincount": 1}),
    ("repeat_interleave", lambda t: torch.repeat_interleave(t), {"aten.repeat_interleave": 1}),
    ("tolist", lambda t: t.tolist(), {"Tensor.tolist": 1}),
    ("numpy", lambda t: t.numpy(), {"Tensor.numpy": 1}),
    ("cpu", lambda t: t.cpu(), {"Tensor.cpu": 1}),
    # Not syncs: arithmetic, reductions left on the device, integer indexing, sizes known in advance.
    ("arithmetic", lambda t: (t * 2 + 1).sum(), {}),
    ("integer index", lambda t: t[t.flip(0)], {}),
    ("repeat_interleave with output_size", lambda t: torch.repeat_interleave(t, output_size=3), {}),
    ("sort and gather", lambda t: t.gather(0, t.argsort()), {}),
    ("shape", lambda t: t.shape[0] + t.numel(), {}),
]


@pytest.mark.parametrize("name, code, expected", CASES, ids=[case[0] for case in CASES])
def test_each_kind_of_value_read_is_one_sync_and_nothing_else_is(name, code, expected):
    with SyncCounter() as syncs:
        code(VALUES)
    assert syncs.by_op() == expected
    if expected:
        assert all(site.startswith("python_tests/test_syncs.py:") for site in syncs.by_site())


def test_the_counter_names_where_each_sync_comes_from():
    with SyncCounter() as syncs:
        VALUES.tolist()
        VALUES.tolist()
    assert syncs.count == 2 and len(syncs.by_site()) == 2
    assert "in test_the_counter_names_where_each_sync_comes_from" in next(iter(syncs.by_site()))


# -- generate's syncs, pinned ----------------------------------------------------------------------------------
# At the boundary: one read of the prompt checks (generate) and one of LLaDAModel's token-id check. Then, with a
# fixed schedule, none per step and one per block (the non-finite check); threshold decoding one per step and none
# more per block; threshold decoding with assumed_steps_per_block none per step and one per block.
BOUNDARY = 2
FIXED_PER_STEP, FIXED_PER_BLOCK = 0, 1
THRESHOLD_PER_STEP, THRESHOLD_PER_BLOCK = 1, 0
ASSUMED_PER_STEP, ASSUMED_PER_BLOCK = 0, 1


def count_syncs(model, ids, mask, **kwargs):
    with SyncCounter() as syncs:
        result = dllm_fast.generate(model, ids, mask, **kwargs)
    return syncs, result


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("gen_length, block_length, steps", [(8, 8, 4), (16, 8, 8), (16, 4, 16), (24, 8, 6)])
def test_a_fixed_schedule_syncs_once_per_block_and_never_per_step(cache, gen_length, block_length, steps,
                                                                  one_thread):
    model = tiny_model("cpu", torch.float32)
    ids, mask = prompts("cpu", [3, 6])
    syncs, result = count_syncs(model, ids, mask, gen_length=gen_length, block_length=block_length, steps=steps,
                                cache=cache, temperature=1.0, generator=torch.Generator().manual_seed(0))
    blocks = gen_length // block_length
    assert result.nfe == steps
    assert syncs.count == BOUNDARY + blocks * FIXED_PER_BLOCK + result.nfe * FIXED_PER_STEP, syncs


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_threshold_decoding_syncs_once_per_step(cache, one_thread):
    model = tiny_model("cpu", torch.float32, head_scale=8.0)
    ids, mask = prompts("cpu", [3, 6])
    syncs, result = count_syncs(model, ids, mask, gen_length=16, block_length=8, threshold=0.6, cache=cache)
    assert 2 < result.nfe < 16  # several tokens per step in some steps: the count is not the fixed schedule's
    assert syncs.count == BOUNDARY + 2 * THRESHOLD_PER_BLOCK + result.nfe * THRESHOLD_PER_STEP, syncs


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_assumed_steps_per_block_take_threshold_decodings_sync_out_of_the_steps(cache, one_thread):
    """With threshold 1e-9 every masked position passes, so a block completes in one step: assuming 1 step per
    block is right, and the block-end check confirms it."""
    model = tiny_model("cpu", torch.float32)
    ids, mask = prompts("cpu", [3, 6])
    kwargs = dict(gen_length=16, block_length=8, threshold=1e-9, cache=cache)
    syncs, assumed = count_syncs(model, ids, mask, assumed_steps_per_block=1, **kwargs)
    assert assumed.nfe == 2
    assert syncs.count == BOUNDARY + 2 * ASSUMED_PER_BLOCK + assumed.nfe * ASSUMED_PER_STEP, syncs
    assert torch.equal(assumed.sequences, dllm_fast.generate(model, ids, mask, **kwargs).sequences)


def test_a_wrong_assumption_of_steps_is_named(one_thread):
    model = tiny_model("cpu", torch.float32)
    ids, mask = prompts("cpu", [3, 6])
    with pytest.raises(ValueError, match=r"assumed_steps_per_block=1 left \d+ masked positions in block 0"):
        dllm_fast.generate(model, ids, mask, gen_length=8, block_length=8, threshold=1.0, assumed_steps_per_block=1)
    with pytest.raises(ValueError, match="with a fixed schedule .* drop it"):
        dllm_fast.generate(model, ids, mask, gen_length=8, block_length=8, steps=8, assumed_steps_per_block=2)
    with pytest.raises(ValueError, match="assumed_steps_per_block=9 must be an int in \\[1, 8\\]"):
        dllm_fast.generate(model, ids, mask, gen_length=8, block_length=8, threshold=0.9, assumed_steps_per_block=9)


def test_recording_the_unmask_step_costs_no_sync(one_thread):
    model = tiny_model("cpu", torch.float32)
    ids, mask = prompts("cpu", [3, 6])
    kwargs = dict(gen_length=16, block_length=8, steps=8, cache="dual")
    off, _ = count_syncs(model, ids, mask, **kwargs)
    on, result = count_syncs(model, ids, mask, record_unmask_step=True, **kwargs)
    assert on.by_site() == off.by_site() and result.unmask_step is not None


def test_a_model_without_its_own_token_check_costs_one_boundary_sync(one_thread):
    table = eos_prone_table(2, 16, torch.Generator().manual_seed(0))
    with SyncCounter() as syncs:
        dllm_fast.generate(ScriptedModel(table), torch.tensor([[1, 2]]), gen_length=16, block_length=8, steps=4)
    assert syncs.count == (BOUNDARY - 1) + 2 * FIXED_PER_BLOCK


def test_the_model_checks_token_ids_once_per_call_not_per_step(one_thread):
    """LLaDAModel's token-id check reads the ids (one sync); inside generate's loop (values_checked) it is off."""
    model = LLaDAModel(LLaDAConfig.preset("tiny")).eval()
    ids = torch.randint(0, 120, (2, 5))
    with torch.no_grad():
        with SyncCounter() as checked:
            model(ids)
        with values_checked(), SyncCounter() as trusted:
            model(ids)
    assert checked.by_op() == {"Tensor.tolist": 1} and trusted.count == 0


# -- the likelihood engine's syncs, pinned ---------------------------------------------------------------------
# Per call, whatever the micro-batch: the input checks (one read), the model's token-id check on CPU inputs (one
# read, once for the call's sequences), one read of the pairs' scored counts per pass that cuts micro-batches
# (`pair_batches`), and the finiteness of the objective's value and of its coefficients (two-pass) or of the
# micro-batches' values (separable, which also finds the pairs that score nothing: one nonzero). Per micro-batch,
# in pass 1 and in pass 2: none.
ENGINE_BOUNDARY = 2
PER_PASS = 1
TWO_PASS_CHECKS, SEPARABLE_CHECKS = 2, 2
PER_MICRO_BATCH = 0


def engine_case():
    from dllm_fast.likelihood import sample_masks

    model = LLaDAModel.with_random_weights(LLaDAConfig.preset("tiny"), seed=0)
    sequences = torch.randint(0, 100, (3, 12), generator=torch.Generator().manual_seed(0))
    masks = sample_masks(sequences, prompt_length=4, n_t=4, sampler="random_t", count="all",
                         generator=torch.Generator().manual_seed(1))
    return model, sequences, masks


@pytest.mark.parametrize("micro_batch", [1, 5, 64])
def test_the_engine_syncs_a_fixed_number_of_times_per_call_and_never_per_micro_batch(micro_batch, one_thread):
    from dllm_fast.likelihood import Separable, elbo, score, streaming_backward

    model, sequences, masks = engine_case()
    batches = -(-int((masks.num_masked > 0).sum()) // micro_batch)
    assert batches >= (10 if micro_batch == 1 else 1)

    def objective(lp):
        value = elbo(lp, masks)
        return -(torch.exp(value - value.detach()) * torch.tensor([1.0, -0.5, 2.0])).sum()

    with SyncCounter() as two_pass:
        streaming_backward(model, sequences, masks, objective, micro_batch=micro_batch)
    assert two_pass.count == ENGINE_BOUNDARY + 2 * PER_PASS + TWO_PASS_CHECKS + 2 * batches * PER_MICRO_BATCH, \
        two_pass.by_site()
    with SyncCounter() as separable:
        streaming_backward(model, sequences, masks, Separable(lambda lp, n, j: lp.sum()), micro_batch=micro_batch)
    assert separable.count == ENGINE_BOUNDARY + PER_PASS + SEPARABLE_CHECKS + batches * PER_MICRO_BATCH, \
        separable.by_site()
    with torch.no_grad(), SyncCounter() as scoring:
        score(model, sequences, masks, micro_batch=micro_batch)
    assert scoring.count == ENGINE_BOUNDARY + PER_PASS + batches * PER_MICRO_BATCH, scoring.by_site()
