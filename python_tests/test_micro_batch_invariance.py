"""A memory setting never changes a loss (issue 30 item 4): for every objective and every option set that cuts the
loss batch into normalisation micro-batches, the loss, the stats and the parameter gradient of
`Objective.backward` are the same whatever `MicroBatching` cuts the (sequence, sample) pairs into model calls,
in float64 on the tiny model. An objective that normalises per micro-batch names its own rows
(`micro_batch_rows`), and is refused without them."""

import pytest
import torch

from dllm_fast import objectives
from dllm_fast.likelihood import MicroBatching, score
from dllm_fast.objectives import InnerUpdate
from test_objectives import draw, make, perturbed, relative_error, rollout_batch, tiny_model, trainable

pytestmark = pytest.mark.usefixtures("one_thread")

# Each objective with its paper's defaults, plus every option that normalises or centres per micro-batch (rows
# of 3 sequences do not divide N = 4: uneven micro-batches) and the presets that set one.
TREE = "d_treerpo"  # a TreeBatch of tree edges: python_tests/test_d_treerpo.py (engine at micro-batch 5)
VARIANTS = [
    *[(name, {}) for name in objectives.available() if name not in ("mdpo", TREE)],  # mdpo's StepBatch: test_mdpo.py
    ("diffu_grpo", {"normalize_per": "micro_batch", "micro_batch_rows": 3}),
    ("diffu_grpo", {"normalize_per": "micro_batch", "micro_batch_rows": 1, "normalization": "sequence"}),
    ("diffu_grpo", {"preset": "dare"}),
    ("bgpo", {"aggregation": "length_weighted", "micro_batch_rows": 3}),
    ("bgpo", {"preset": "dare"}),
    ("spg", {"normalize_per": "micro_batch", "micro_batch_rows": 3, "normalization": "token"}),
    ("spg", {"normalize_per": "micro_batch", "micro_batch_rows": 1}),
    ("rspo", {"center": "micro_batch", "micro_batch_rows": 3}),
    ("rspo", {"center": "group"}),
    ("coupled_grpo", {"normalize_per": "micro_batch", "micro_batch_rows": 3}),
    ("espo", {"preset": "countdown"}),
    ("cj_grpo", {"micro_batch_rows": 3}),  # the official step pooling per micro-batch of rows
]
# One pair per graph; 3 per graph and 5 per scoring call (neither divides N n_t); every pair in one graph, 2
# per scoring call.
SETTINGS = [MicroBatching(1), MicroBatching(3, score_micro_batch=5), MicroBatching(64, score_micro_batch=2)]
PER_MICRO_BATCH = [("diffu_grpo", "normalize_per", "micro_batch"), ("spg", "normalize_per", "micro_batch"),
                   ("coupled_grpo", "normalize_per", "micro_batch"), ("bgpo", "aggregation", "length_weighted"),
                   ("rspo", "center", "micro_batch")]


def test_the_variants_cover_every_objective_and_every_per_micro_batch_mode():
    assert {name for name, _ in VARIANTS} == set(objectives.available()) - {"mdpo", TREE}
    for name, option, mode in PER_MICRO_BATCH:
        assert any(n == name and o.get(option, objectives.presets(name).get(o.get("preset"), {}).get(option)) == mode
                   for n, o in VARIANTS), (name, option)


@pytest.mark.parametrize("name, overrides", VARIANTS)
def test_loss_stats_and_gradient_are_the_same_at_every_micro_batch(name, overrides):
    """Off-policy (the old policy's lp from other weights, so ratios and clips are live) with the reference
    policy scored by `Objective.backward` itself in the setting's scoring calls."""
    model = tiny_model()
    objective = make(name, **overrides)
    batch = rollout_batch(model)
    masks = draw(objective, model, batch)
    ref_model = perturbed(model, seed=4) if objective.needs_reference else None
    with torch.no_grad():
        lp_old = score(perturbed(model, seed=3), batch.sequences, masks, micro_batch=7,
                       attention_mask=batch.attention_mask)
    assert masks.num_sequences * masks.n_t <= SETTINGS[-1].micro_batch  # the last setting: all pairs at once
    runs = []
    for batching in SETTINGS:
        model.zero_grad(set_to_none=True)
        out = objective.backward(model, batch, InnerUpdate(masks, lp_old=lp_old), micro_batch=batching,
                                 ref_model=ref_model)
        runs.append((out, [p.grad.clone() for p in trainable(model)]))
    (first, first_grads), *others = runs
    assert sum(g.abs().sum() for g in first_grads) > 0
    for batching, (out, grads) in zip(SETTINGS[1:], others):
        torch.testing.assert_close(out.loss, first.loss, rtol=1e-12, atol=1e-14, msg=f"loss at {batching}")
        assert relative_error(grads, first_grads) < 1e-10, f"gradient at {batching}"
        assert out.stats.keys() == first.stats.keys()
        for key, value in out.stats.items():
            assert value == pytest.approx(first.stats[key], rel=1e-10, abs=1e-13), (key, batching)
        torch.testing.assert_close(out.lp, first.lp, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("name, option, mode", PER_MICRO_BATCH)
def test_a_per_micro_batch_mode_without_its_rows_is_refused(name, option, mode):
    """Rows taken from the memory micro-batch would let a memory setting change the loss."""
    with pytest.raises(ValueError, match=rf"{option}='{mode}' needs micro_batch_rows"):
        objectives.get(name, **{option: mode})
    assert objectives.get(name, **{option: mode, "micro_batch_rows": 2}).config.micro_batch_rows == 2
