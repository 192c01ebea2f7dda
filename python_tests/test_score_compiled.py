"""MicroBatching(compile=True): the scoring micro-batch (model, scored rows, fused LM head) and pass 2's forward
and backward compile whole (fullgraph: a graph break is an error), one graph per (pairs, rows) bucket and never
one per micro-batch or call; lp and the gradients are eager's.

The capture and recompile checks run dynamo with the aot_eager backend (no code generation); one test runs the
shipped path, inductor, whose C++ code generation takes ~10-20 s a graph on 2 cores.
"""

import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from dllm_fast.likelihood import (MicroBatching, Separable, active_pairs, compiled as compiled_module, sample_masks,
                                  score, streaming_backward)
from test_likelihood_engine import perturbed, tiny_model

pytestmark = [pytest.mark.compile, pytest.mark.usefixtures("one_thread")]
P, L, N_T = 4, 6, 3


@pytest.fixture
def counter(monkeypatch):
    """Both scoring graphs compiled with aot_eager through one compile counter."""
    torch._dynamo.reset()
    count = CompileCounterWithBackend("aot_eager")
    graphs = {name: torch.compile(getattr(compiled_module, name), fullgraph=True, dynamic=False, backend=count)
              for name in ("score_padded", "known_gradient_padded")}
    monkeypatch.setattr(compiled_module, "compiled", lambda name, backend="inductor": graphs[name])
    yield count
    torch._dynamo.reset()


def rollouts(N=4, prompt_length=P, seed=0):
    """Sequences without EOS and with left padding in the last one: every completion position counts."""
    gen = torch.Generator().manual_seed(seed)
    sequences = torch.randint(0, 120, (N, prompt_length + L), generator=gen)
    attention_mask = torch.ones_like(sequences)
    attention_mask[-1, :2] = 0
    return sequences, attention_mask


def stratified(sequences, seed, prompt_length=P):
    """stratified_l with n_t = 3 over L = 6 counted positions: the three samples of a sequence mask l = (1, 3, 5)
    or (2, 4, 6) positions, so a micro-batch of one sequence's 3 pairs scores 9 or 12 rows: one bucket (16)."""
    return sample_masks(sequences, prompt_length=prompt_length, n_t=N_T, sampler="stratified_l", eos_token_id=126,
                        generator=torch.Generator().manual_seed(seed))


def test_scoring_compiles_once_and_never_recompiles_across_micro_batches_calls_and_prompt_lengths(counter):
    """Warm-up: the first micro-batch compiles the one graph (3 pairs, 16 rows). Then 3 calls with other masks
    and a call with longer prompts (the sequence length is dynamic) compile nothing (error_on_recompile); the
    rows per micro-batch differ (9 or 12) and every lp equals eager's."""
    model = tiny_model(torch.float32)
    torch._dynamo.utils.counters.clear()
    calls = [rollouts(seed=seed) + (P,) for seed in range(4)] + [rollouts(prompt_length=P + 3, seed=9) + (P + 3,)]
    masks = [stratified(sequences, seed, prompt_length) for seed, (sequences, _, prompt_length) in enumerate(calls)]
    rows = {int(m.scored[n].sum()) for m in masks for n in range(m.num_sequences)}
    assert rows == {9, 12}  # the premise: micro-batches with different numbers of scored rows

    def lp(index, compile):
        sequences, attention_mask, _ = calls[index]
        with torch.no_grad():
            return score(model, sequences, masks[index], micro_batch=MicroBatching(N_T, compile=compile),
                         attention_mask=attention_mask)

    compiled = [lp(0, True)]
    assert counter.frame_count == 1
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled += [lp(index, True) for index in range(1, len(calls))]
    assert counter.frame_count == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    for index, got in enumerate(compiled):
        torch.testing.assert_close(got, lp(index, False), rtol=1e-5, atol=1e-5)
    assert got.ne(0).sum() == masks[-1].scored.sum()  # padded rows and pairs left nothing behind


@pytest.mark.slow
def test_random_masks_compile_one_graph_per_bucket(counter):
    """random_t masks: the rows per micro-batch vary freely, yet there is one graph per (pairs, rows) bucket
    (powers of two), far fewer than micro-batches, and a short last micro-batch is padded."""
    model = tiny_model(torch.float32)
    sequences, attention_mask = rollouts(N=5)
    micro_batches, buckets = 0, set()
    for seed in range(3):
        masks = sample_masks(sequences, prompt_length=P, n_t=N_T, sampler="random_t", eos_token_id=126,
                             generator=torch.Generator().manual_seed(seed))
        for batch in active_pairs(masks).split(4):
            pairs = compiled_module.bucket(len(batch), 4)
            buckets.add((pairs, compiled_module.bucket(int(masks.scored.flatten(0, 1)[batch].sum()), pairs * L)))
            micro_batches += 1
        with torch.no_grad():
            got = score(model, sequences, masks, micro_batch=MicroBatching(4, compile=True),
                        attention_mask=attention_mask)
            want = score(model, sequences, masks, micro_batch=4, attention_mask=attention_mask)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == len(buckets) <= micro_batches // 2


def test_bucket_sizes():
    assert [compiled_module.bucket(n, 8) for n in range(9)] == [1, 1, 2, 4, 4, 8, 8, 8, 8]
    assert [compiled_module.bucket(n, 6) for n in (3, 5, 6)] == [4, 6, 6]  # the cap is a bucket itself


def objectives(model, sequences, masks, attention_mask):
    """A nonlinear two-pass objective (VRPO-OL-like exp of the ELBO ratio) and a separable one, off-policy."""
    with torch.no_grad():
        lp_old = score(perturbed(model), sequences, masks, micro_batch=4, attention_mask=attention_mask)
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0])

    def two_pass(lp):
        return -(advantages * ((lp - lp_old).sum((1, 2)) / (N_T * L)).exp()).mean()

    def separable(rows, n, j):
        return -(advantages[n, None] * (rows - lp_old[n, j]).exp() * masks.scored[n, j]).sum() / 10

    return two_pass, separable


@pytest.mark.parametrize("separable", [False, True])
@pytest.mark.slow
def test_streaming_backward_gradients_equal_eager(counter, separable):
    """Two-pass (pass 1 scored, pass 2 forward + backward compiled, the LM head's gradient added in the forward
    graph, the embedding's in the backward graph) and separable: the value and every parameter's gradient are
    eager's, over 2 calls whose gradients accumulate; the second call compiles nothing new."""
    model = tiny_model(torch.float32)
    sequences, attention_mask = rollouts()
    results = []
    for compile in (True, False):
        policy = copy.deepcopy(model)
        values = []
        for call, seed in enumerate((1, 2)):
            masks = stratified(sequences, seed)
            objective = objectives(policy, sequences, masks, attention_mask)[separable]
            with torch._dynamo.config.patch(error_on_recompile=call > 0):
                values.append(streaming_backward(policy, sequences, masks,
                                                 Separable(objective) if separable else objective,
                                                 micro_batch=MicroBatching(N_T, compile=compile),
                                                 attention_mask=attention_mask).value)
        results.append((values, [p.grad for p in policy.parameters()]))
    assert counter.frame_count == (1 if separable else 2)
    (values, grads), (eager_values, eager_grads) = results
    torch.testing.assert_close(values, eager_values, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, eager_grads):
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * float(want.abs().max()))


@pytest.mark.slow
def test_inductor_compiled_engine_equals_eager():
    """The shipped path (inductor): the two-pass engine's value, lp and gradients are eager's."""
    torch._dynamo.reset()
    model = tiny_model(torch.float32)
    sequences, attention_mask = rollouts()
    masks = stratified(sequences, 3)
    objective = objectives(model, sequences, masks, attention_mask)[0]
    results = []
    for compile in (True, False):
        policy = copy.deepcopy(model)
        value, lp = streaming_backward(policy, sequences, masks, objective,
                                       micro_batch=MicroBatching(N_T, compile=compile), attention_mask=attention_mask)
        results.append((value, lp, [p.grad for p in policy.parameters()]))
    torch._dynamo.reset()
    (value, lp, grads), (eager_value, eager_lp, eager_grads) = results
    torch.testing.assert_close(value, eager_value, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp, eager_lp, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


def test_compile_with_active_dropout_in_the_two_pass_engine_is_refused():
    model = tiny_model(torch.float32)
    model.dropout = torch.nn.Dropout(0.1)  # an active dropout module anywhere in the model
    model.train()
    sequences, attention_mask = rollouts()
    masks = stratified(sequences, 1)
    with pytest.raises(ValueError, match=r"compile=True\) with active dropout.*model.eval\(\)"):
        streaming_backward(model, sequences, masks, lambda lp: lp.sum(), micro_batch=MicroBatching(3, compile=True))
    with pytest.raises(TypeError, match="compile='yes' must be True or False"):
        MicroBatching(3, compile="yes")
    with pytest.raises(TypeError, match="compile=1 must be True or False"):
        MicroBatching(3, compile=1)


@pytest.mark.slow
def test_compiled_micro_batches_read_nothing_back_either(counter, monkeypatch):
    """The compiled path finds each micro-batch's scored rows (eagerly, before its graph, which holds no host
    read: fullgraph) with the count the engine read once per call, so preparing a micro-batch syncs nothing, in
    pass 1 and pass 2. (SyncCounter's dispatch mode cannot stay on around a compiled call: it is entered around
    each micro-batch's preparation only.)"""
    from dllm_fast.testing.syncs import SyncCounter

    prepared = []
    original = compiled_module.pad_pairs

    def counted(*args, **kwargs):
        with SyncCounter() as syncs:
            out = original(*args, **kwargs)
        prepared.append(syncs.count)
        return out

    monkeypatch.setattr(compiled_module, "pad_pairs", counted)
    model = tiny_model(torch.float32)
    sequences, attention_mask = rollouts()
    masks = stratified(sequences, 0)

    def objective(lp):
        return -(lp.sum(-1) * torch.tensor([1.0, -1.0, 0.5, 2.0])[:, None]).sum()

    streaming_backward(model, sequences, masks, objective, micro_batch=MicroBatching(2, compile=True),
                       attention_mask=attention_mask)
    assert len(prepared) == 2 * 6 and sum(prepared) == 0  # 12 pairs in micro-batches of 2, both passes
