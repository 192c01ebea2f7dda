"""Mask samplers: which positions they mask and count, their weights, replayability and input checks."""

import math

import pytest
import torch

from dllm_fast.likelihood import SAMPLERS, counted_positions, draw_masks, sample_masks, token_estimate
from dllm_fast.likelihood.masks import RANDOM_SAMPLERS
from dllm_fast.likelihood.samplers import gauss_legendre

EOS, MASK = 126, 127  # the tiny preset's ids


pytestmark = pytest.mark.usefixtures("one_thread")


def make_sequences(N=4, P=3, L=10, eos_at=(None, 4, 0, 9), seed=0):
    gen = torch.Generator().manual_seed(seed)
    sequences = torch.randint(0, 100, (N, P + L), generator=gen)
    for n, position in enumerate(eos_at[:N]):
        if position is not None:
            sequences[n, P + position:] = EOS  # an answer, then EOS padding
    return sequences


def synthetic_unmask_step(N, L, per_step=2, seed=3):
    """A decoding order: each row unmasks its positions in a random order, per_step of them per forward."""
    order = torch.rand(N, L, generator=torch.Generator().manual_seed(seed)).argsort(-1).argsort(-1)
    return order // per_step


def draw(sampler, sequences=None, P=3, n_t=6, seed=1, **kwargs):
    """sample_masks with a sampler's own constraints met: an odd n_t for "coupled", a decoding order for
    "trajectory", no n_t for the samplers whose samples follow from the sequences."""
    sequences = make_sequences(P=P) if sequences is None else sequences
    if sampler == "coupled" and n_t % 2 == 0:
        n_t += 1
    if sampler == "trajectory":
        kwargs.setdefault("unmask_step", synthetic_unmask_step(*sequences[:, P:].shape))
    if sampler in ("recorded_state", "tree_edge"):  # MDPO's state (0 given, >= 1 masked); an edge's stages 0-2
        kwargs.setdefault("unmask_step", synthetic_unmask_step(*sequences[:, P:].shape, per_step=1) %
                          (2 if sampler == "recorded_state" else 3))
        n_t = 1
    if SAMPLERS[sampler].data_n_t:  # trajectory's states, autoregressive's positions: from the sequences
        n_t = None
    return sample_masks(sequences, prompt_length=P, n_t=n_t, sampler=sampler,
                        generator=torch.Generator().manual_seed(seed), eos_token_id=EOS, **kwargs)


def test_counted_positions_up_to_first_eos_or_all():
    completion = torch.tensor([[5, 6, EOS, EOS, 7], [EOS, 1, 2, 3, 4], [1, 2, 3, 4, 5]])
    counted = counted_positions(completion, eos_token_id=EOS, count="eos")
    assert counted.tolist() == [[True, True, True, False, False], [True, False, False, False, False], [True] * 5]
    assert counted_positions(completion, eos_token_id=None, count="all").all()


@pytest.mark.parametrize("sampler", RANDOM_SAMPLERS)
def test_replayable_from_the_generator_alone(sampler):
    """Same seed, same masks; another seed, other masks; the global RNG is neither used nor reseeded."""
    state = torch.get_rng_state()
    first, again, other = draw(sampler, seed=5), draw(sampler, seed=5), draw(sampler, seed=6)
    assert torch.equal(torch.get_rng_state(), state)
    for name in ("masked", "weight", "t", "num_masked", "counted"):
        assert torch.equal(getattr(first, name), getattr(again, name))
    assert not torch.equal(first.masked, other.masked)


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("count", ["eos", "all"])
def test_structure_common_to_all_samplers(sampler, count):
    P = 3
    sequences = make_sequences(P=P)
    masks = draw(sampler, sequences, P=P, n_t=8, count=count)
    N, n_t, L = 4, masks.n_t, 10
    assert masks.masked.shape == (N, n_t, P + L) and masks.t.shape == (N, n_t)
    per_position = SAMPLERS[sampler].model_blocks  # the block samplers: a weight per position
    assert masks.weight.shape == ((N, n_t, L) if per_position else (N, n_t))
    counted = counted_positions(sequences[:, P:], eos_token_id=EOS, count=count)
    assert torch.equal(masks.counted, counted)
    assert torch.equal(masks.num_counted, counted.sum(-1))
    completion = masks.masked[..., P:]
    if sampler not in ("trajectory", "recorded_state"):  # a replayed state shows the padding decoded by then
        assert completion[~counted[:, None, :].expand(N, n_t, L)].all(), "positions that do not count stay masked"
    assert torch.equal(masks.num_masked, masks.targets.sum(-1))
    assert not (masks.targets & ~masks.scored).any()
    if sampler in ("random_t", "stratified_l", "complementary", "gauss", "coupled", "trajectory"):
        assert not masks.masked[..., :P].any(), "ELBO samplers never mask the prompt"
    assert (masks.weight >= 0).all() and torch.isfinite(masks.weight).all()


def test_weights_match_the_documented_formulas():
    for sampler in ("stratified_l", "block"):
        masks = draw(sampler, n_t=8)
        lengths = masks.num_counted[:, None].double()
        torch.testing.assert_close(masks.weight, lengths / masks.num_masked, rtol=0, atol=1e-12)
        torch.testing.assert_close(masks.t, masks.num_masked / lengths, rtol=0, atol=1e-12)
    masks = draw("random_t", n_t=8)
    torch.testing.assert_close(masks.weight * masks.t, torch.ones_like(masks.t), rtol=0, atol=1e-12)
    assert ((masks.t > 0) & (masks.t <= 1)).all()
    masks = draw("complementary", n_t=8)
    sizes = masks.num_masked.double()
    expected = torch.where(sizes > 0, (masks.num_counted[:, None] + 1) / sizes.clamp_min(1), 0.0)
    torch.testing.assert_close(masks.weight, expected, rtol=0, atol=1e-12)
    masks = draw("mean_field", n_t=2)
    assert (masks.weight == 1).all() and torch.equal(masks.num_masked, masks.num_counted[:, None].expand(4, 2))


def test_stratified_l_covers_every_size_once_when_n_t_equals_length():
    sequences = make_sequences(N=3, L=10, eos_at=(None, None, None))
    masks = draw("stratified_l", sequences, n_t=10)
    for n in range(3):
        assert sorted(masks.num_masked[n].tolist()) == list(range(1, 11))


def test_stratified_l_sizes_are_uniform_chi_square():
    """Each l_j is marginally uniform on 1..L_n (chi-square, 9 dof; the 1e-4 critical value is 33.7)."""
    L, copies, n_t = 10, 600, 3
    sequences = make_sequences(N=1, L=L, eos_at=(None,)).expand(copies, -1)
    sizes = draw("stratified_l", sequences, n_t=n_t).num_masked  # [copies, n_t]
    for j in range(n_t):
        counts = torch.bincount(sizes[:, j] - 1, minlength=L).double()
        chi2 = ((counts - copies / L) ** 2 / (copies / L)).sum().item()
        assert chi2 < 33.7, f"sample {j}: chi2 = {chi2:.1f}"
    # the test has power: sizes drawn as 1 + floor(U * L) ** 2 / L would not be uniform
    skewed = (1 + (torch.rand(copies, generator=torch.Generator().manual_seed(0)) * L) ** 2 / L).long()
    counts = torch.bincount(skewed - 1, minlength=L).double()
    assert ((counts - copies / L) ** 2 / (copies / L)).sum().item() > 33.7


def test_stratified_subsets_are_uniform_over_positions():
    """Given l, the masked positions are a uniform subset: each position is masked l/L of the time."""
    L, copies = 8, 2000
    sequences = make_sequences(N=1, L=L, eos_at=(None,)).expand(copies, -1)
    masks = draw("stratified_l", sequences, n_t=1)
    rate = masks.scored[:, 0].double().mean(0)  # E[l/L] = (L+1)/(2L) for every position
    expected = (L + 1) / (2 * L)
    standard_error = math.sqrt(expected * (1 - expected) / copies)
    assert ((rate - expected).abs() < 4.5 * standard_error).all(), rate


def test_complementary_pairs_partition_the_counted_positions():
    masks = draw("complementary", n_t=8)
    scored = masks.scored
    first, second = scored[:, 0::2], scored[:, 1::2]
    assert not (first & second).any()
    assert torch.equal(first | second, masks.counted[:, None, :].expand_as(first))


def test_block_masking_structure_and_perturbation_rate():
    P, L, block_length, blocks = 6, 16, 4, 4
    copies = 400
    sequences = make_sequences(N=1, P=P, L=L, eos_at=(None,)).expand(copies, -1)
    # Without perturbation: clean blocks, then the chosen block with 1..4 masked, then fully masked blocks;
    # with n_t == number of blocks, stratification picks every block exactly once per sequence.
    masks = draw("block", sequences, P=P, n_t=blocks, block_length=block_length, perturb_prob=0.0)
    per_block = masks.scored.view(copies, blocks, blocks, block_length).sum(-1)  # [copies, n_t, blocks]
    chosen = (per_block > 0).long().argmax(-1)
    index = torch.arange(blocks)
    assert (per_block[index < chosen[..., None]] == 0).all()
    assert (per_block[index > chosen[..., None]] == block_length).all()
    within = per_block.gather(-1, chosen[..., None])
    assert ((within >= 1) & (within <= block_length)).all()
    assert (chosen.sort(-1).values == index).all()
    assert not masks.masked[..., :P].any()
    # With perturbation p: E[masked] = mean_b [4 (3 - b) + E[l] + 4 p b] = 8.5 + 6 p; the prompt rate is p.
    p = 0.3
    masks = draw("block", sequences, P=P, n_t=blocks, block_length=block_length, perturb_prob=p)
    masked = masks.num_masked.double()
    z = (masked.mean() - (8.5 + 6 * p)) / (masked.std() / math.sqrt(masked.numel()))
    assert abs(z) < 4.5, z
    prompt = masks.masked[..., :P].double()
    assert abs(prompt.mean().item() - p) < 4.5 * math.sqrt(p * (1 - p) / prompt.numel())


def test_mean_field_masks_the_completion_and_perturbs_real_prompt_tokens_only():
    P, L, copies, p = 8, 5, 500, 0.15
    sequences = make_sequences(N=1, P=P, L=L, eos_at=(None,)).expand(copies, -1)
    attention_mask = torch.ones_like(sequences)
    attention_mask[:, :3] = 0  # left padding
    masks = draw("mean_field", sequences, P=P, n_t=1, attention_mask=attention_mask)
    assert masks.masked[..., P:].all()
    assert not masks.masked[..., :3].any(), "padding is never masked"
    rate = masks.masked[..., 3:P].double().mean().item()
    assert abs(rate - p) < 4.5 * math.sqrt(p * (1 - p) / (copies * (P - 3)))


def test_masks_follow_the_sequences_device_and_move():
    masks = draw("stratified_l")
    moved = masks.to("cpu")
    assert torch.equal(moved.masked, masks.masked) and moved.sampler == "stratified_l"


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(n_t=0), ValueError, "n_t=0 must be an int >= 1"),
        (dict(sampler="complementary", n_t=3), ValueError, "n_t=3 must be even"),
        (dict(sampler="uniform"), ValueError, "sampler='uniform' is not one of"),
        (dict(generator=0), TypeError, "generator must be a torch.Generator, got int"),
        (dict(prompt_length=13), ValueError, "prompt_length=13 must be an int in \\[0, 13\\)"),
        (dict(count="first"), ValueError, "count='first' is not one of"),
        (dict(eos_token_id=None), ValueError, "count='eos' needs eos_token_id"),
        (dict(sampler="block", block_length=0), ValueError, "block_length=0 must be an int >= 1"),
        (dict(sampler="block", perturb_prob=1.5), ValueError, "perturb_prob=1.5 must be in \\[0.0, 1.0\\] \\(a probability"),
        (dict(attention_mask=torch.ones(4, 5)), ValueError, "attention_mask has shape \\(4, 5\\)"),
    ],
)
def test_bad_input_names_the_value(kwargs, error, message):
    arguments = dict(prompt_length=3, n_t=4, sampler="stratified_l", generator=torch.Generator(),
                     eos_token_id=EOS)
    arguments.update(kwargs)
    with pytest.raises(error, match=message):
        sample_masks(make_sequences(), **arguments)


def test_draw_masks_rejects_sequences_without_counted_positions():
    with pytest.raises(ValueError, match="at least one counted"):
        draw_masks("stratified_l", torch.zeros(2, 4, dtype=torch.bool), 2, generator=torch.Generator(),
                   prompt_real=torch.ones(2, 1, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------------------
# gauss (GDPO), coupled (DiffuCoder), trajectory (TraceRL)


def test_gauss_legendre_nodes_and_weights():
    """By hand: the 2- and 3-point rules on [0, 1]; and any K-point rule integrates t^m exactly for m <= 2K - 1."""
    nodes, weights = gauss_legendre(2)
    torch.testing.assert_close(nodes, torch.tensor([0.5 - 0.5 / math.sqrt(3), 0.5 + 0.5 / math.sqrt(3)],
                                                   dtype=torch.float64), rtol=0, atol=1e-15)
    torch.testing.assert_close(weights, torch.tensor([0.5, 0.5], dtype=torch.float64), rtol=0, atol=1e-15)
    nodes, weights = gauss_legendre(3)
    half_gap = 0.5 * math.sqrt(3 / 5)
    torch.testing.assert_close(nodes, torch.tensor([0.5 - half_gap, 0.5, 0.5 + half_gap], dtype=torch.float64),
                               rtol=0, atol=1e-15)
    torch.testing.assert_close(weights, torch.tensor([5 / 18, 8 / 18, 5 / 18], dtype=torch.float64), rtol=0,
                               atol=1e-15)
    for points in (1, 2, 3, 5, 8):
        nodes, weights = gauss_legendre(points)
        for power in range(2 * points):
            assert (weights * nodes**power).sum().item() == pytest.approx(1 / (power + 1), abs=1e-13)
        assert abs((weights * nodes ** (2 * points)).sum().item() - 1 / (2 * points + 1)) > 1e-11  # not beyond


def test_gauss_masks_are_exact_size_draws_at_the_nodes_with_quadrature_weights():
    masks = draw("gauss", n_t=6, quadrature_points=3)  # 2 draws per node, node-major
    nodes, weights = gauss_legendre(3)
    lengths = masks.num_counted[:, None].double()
    t = nodes.repeat_interleave(2)[None].expand(4, 6)
    torch.testing.assert_close(masks.t, t, rtol=0, atol=0)
    assert torch.equal(masks.num_masked, torch.minimum((t * lengths).floor().clamp_min(1), lengths).long())
    torch.testing.assert_close(masks.weight, (3 * weights / nodes).repeat_interleave(2)[None].expand(4, 6),
                               rtol=0, atol=1e-14)
    # The ELBO is sum_k (c_k / t_k) times the mean over the node's draws of the summed lp.
    lp = -torch.rand(masks.scored.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    lp = lp * masks.scored
    by_hand = sum(float(weights[k] / nodes[k]) * (lp[:, 2 * k].sum(-1) + lp[:, 2 * k + 1].sum(-1)) / 2
                  for k in range(3))
    torch.testing.assert_close(token_estimate(lp, masks).sum(-1), by_hand, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="quadrature_points=4 must be an int >= 1 that divides n_t=6"):
        draw("gauss", n_t=6, quadrature_points=4)


def test_coupled_masks_are_the_full_mask_and_complementary_pairs():
    masks = draw("coupled", n_t=5)  # lambda = 2 pairs
    counted = masks.counted[:, None, :]
    scored = masks.scored
    assert torch.equal(scored[:, 0], masks.counted)
    for first, second in ((1, 2), (3, 4)):
        assert not (scored[:, first] & scored[:, second]).any()
        assert torch.equal(scored[:, first] | scored[:, second], counted[:, 0])
        torch.testing.assert_close(masks.t[:, second], 1 - masks.t[:, first], rtol=0, atol=1e-15)
    rates = masks.t[:, 1::2]
    assert ((rates >= 0.2) & (rates <= 0.8)).all()
    torch.testing.assert_close(masks.weight, 5 / 3 / masks.t, rtol=0, atol=1e-14)
    # DiffuCoder's per-token estimate (Eq. 13, lambda = 1): (lp_full + lp_1 / t + lp_2 / (1 - t)) / 2.
    masks = draw("coupled", n_t=3)
    lp = -torch.rand(masks.scored.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    lp = lp * masks.scored
    t = masks.t[:, 1:2]
    by_hand = (lp[:, 0] + lp[:, 1] / t + lp[:, 2] / (1 - t)) / 2
    torch.testing.assert_close(token_estimate(lp, masks), by_hand, rtol=1e-12, atol=1e-14)


def test_coupled_rate_matches_the_drawn_t():
    """Each counted position falls in the pair's first mask with probability t (a Bernoulli draw per position)."""
    L, copies = 12, 1500
    sequences = make_sequences(N=1, L=L, eos_at=(None,)).expand(copies, -1)
    masks = draw("coupled", sequences, n_t=3)
    excess = (masks.scored[:, 1].double().mean(-1) - masks.t[:, 1]).mean().item()
    assert abs(excess) < 4.5 * math.sqrt(0.25 / (L * copies)), excess


def test_trajectory_replays_the_decoding_states_by_hand():
    P, L = 2, 6
    sequences = torch.randint(0, 100, (2, P + L), generator=torch.Generator().manual_seed(0))
    sequences[1, P + 4:] = EOS  # counted: positions 0..4
    unmask_step = torch.tensor([[0, 0, 1, 1, 2, 2],     # two per step, left to right
                                [2, 1, 0, 0, 3, 1]])    # EOS padding (position 5) decoded at step 1
    masks = sample_masks(sequences, prompt_length=P, n_t=None, sampler="trajectory", generator=torch.Generator(),
                         eos_token_id=EOS, unmask_step=unmask_step)
    assert masks.n_t == 4  # row 1 has steps 0, 1, 2, 3; row 0 has 3 states and one empty sample
    completion = masks.masked[..., P:].int().tolist()
    assert completion[0] == [[1] * 6, [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1], [0] * 6]
    assert completion[1] == [[1] * 6, [1, 1, 0, 0, 1, 1], [1, 0, 0, 0, 1, 0], [0, 0, 0, 0, 1, 0]]
    targets = masks.targets.int().tolist()
    assert targets[0] == [[1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1], [0] * 6]
    assert targets[1] == [[0, 0, 1, 1, 0, 0], [0, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 1, 0]]
    assert not masks.masked[..., :P].any()
    assert (masks.weight == 4).all() and masks.num_masked.tolist() == [[2, 2, 2, 0], [2, 1, 1, 1]]
    # shrink merges consecutive steps: states {0, 1} and {2, 3} of row 1
    merged = sample_masks(sequences, prompt_length=P, n_t=None, sampler="trajectory", generator=torch.Generator(),
                          eos_token_id=EOS, unmask_step=unmask_step, shrink=2)
    assert merged.n_t == 2
    assert merged.targets[1].int().tolist() == [[0, 1, 1, 1, 0, 0], [1, 0, 0, 0, 1, 0]]
    assert merged.masked[1, :, P:].int().tolist() == [[1] * 6, [1, 0, 0, 0, 1, 0]]
    # every counted token is read exactly once along the trajectory, whatever shrink
    for replay in (masks, merged):
        assert torch.equal(replay.targets.sum(1), replay.counted.long())


def test_trajectory_inputs_are_checked():
    sequences = make_sequences()
    base = dict(prompt_length=3, sampler="trajectory", generator=torch.Generator(), eos_token_id=EOS)
    with pytest.raises(ValueError, match="pass unmask_step"):
        sample_masks(sequences, n_t=None, **base)
    steps = synthetic_unmask_step(4, 10)
    with pytest.raises(ValueError, match="n_t=2 does not apply to sampler='trajectory'"):
        sample_masks(sequences, n_t=2, unmask_step=steps, **base)
    with pytest.raises(ValueError, match=r"unmask_step has shape \(4, 9\)"):
        sample_masks(sequences, n_t=None, unmask_step=steps[:, :9], **base)
    with pytest.raises(ValueError, match="unmask_step must be int64"):
        sample_masks(sequences, n_t=None, unmask_step=steps.int(), **base)
    bad = steps.clone()
    bad[2, 5] = -1
    with pytest.raises(ValueError, match=r"unmask_step\[2, 5\] = -1 is negative"):
        sample_masks(sequences, n_t=None, unmask_step=bad, **base)
    with pytest.raises(ValueError, match="shrink=0 must be an int >= 1"):
        sample_masks(sequences, n_t=None, unmask_step=steps, shrink=0, **base)
    with pytest.raises(ValueError, match="n_t=4 must be odd for sampler='coupled'"):
        sample_masks(sequences, prompt_length=3, n_t=4, sampler="coupled", generator=torch.Generator(),
                     eos_token_id=EOS)
    with pytest.raises(ValueError, match=r"coupled_t_min=0.0, coupled_t_max=0.8 must satisfy"):
        sample_masks(sequences, prompt_length=3, n_t=3, sampler="coupled", generator=torch.Generator(),
                     eos_token_id=EOS, t_range=(0.0, 0.8))
