"""The fused sampling ops against their plain-PyTorch twins: tokens, confidences, distribution, selection."""

import math

import pytest
import torch
from torch.library import opcheck

from dllm_fast import ops, reference
from dllm_fast.ops.twins import gumbel_from_words, philox4x32_10


def head(N, d, V, device, dtype=torch.float32, scale=1.0):
    hidden = torch.randn(N, d, device=device).to(dtype)
    weight = (torch.randn(V, d, device=device) * scale * 2 / d**0.5).to(dtype)
    return hidden, weight


def test_philox_known_answers():
    """Random123's published Philox4x32-10 test vectors (the compiled kernels share the same stream)."""
    vectors = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]
    for counter, key, expected in vectors:
        words = philox4x32_10([torch.tensor([c]) for c in counter], key)
        assert tuple(int(w) for w in words) == expected


@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0, 1.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_sample_tokens_matches_reference(device, temperature, dtype):
    hidden, weight = head(48, 16, 1003, device, dtype)
    row_ids = torch.randint(0, 10**9, (48,), device=device)
    kwargs = dict(temperature=temperature, seed=2**40 + 17, offset=9, row_ids=row_ids, suppress_ids=[5, 900],
                  confidence_exclude_ids=[7])
    tokens, confidence = ops.sample_tokens(hidden, weight, chunk_size=100, **kwargs)  # chunks that split quads
    ref_tokens, ref_confidence = ops.sample_tokens(hidden, weight, backend="reference", **kwargs)
    assert torch.equal(tokens, ref_tokens)
    assert confidence.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(confidence, ref_confidence, rtol=1e-5, atol=1e-7)
    assert not torch.isin(tokens, torch.tensor([5, 900], device=device)).any()
    assert (confidence[tokens == 7] == 0).all()


@pytest.mark.parametrize("backend", [None, "reference"])
def test_weights_that_train_are_read_as_constants(device, backend):
    """A LoRA- or fully-trained head samples as its values say (no autograd error, no gradient out), on every
    backend alike."""
    hidden, weight = head(6, 8, 40, device)
    want = ops.sample_tokens(hidden, weight, temperature=1.0, seed=3, backend=backend)
    got = ops.sample_tokens(hidden.requires_grad_(), weight.requires_grad_(), temperature=1.0, seed=3,
                            backend=backend)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not got[1].requires_grad


def test_greedy_ties_go_to_the_lowest_id(device):
    hidden = torch.ones(3, 4, device=device)
    weight = torch.zeros(10, 4, device=device)
    weight[[2, 6, 8]] = 1.0  # three equal maxima
    tokens, confidence = ops.sample_tokens(hidden, weight, chunk_size=4)
    assert tokens.tolist() == [2, 2, 2]
    torch.testing.assert_close(confidence, torch.full((3,), math.e**4 / (3 * math.e**4 + 7), device=device))


@pytest.mark.slow_to_emulate  # 40k rows; the emulated kernel's tokens match the reference's draw for draw
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_token_distribution_is_softmax_over_temperature(device, temperature):
    """Chi-square goodness of fit of 40k samples against softmax(logits / T), with one suppressed id."""
    V, samples, suppressed = 7, 40_000, 3
    hidden = torch.randn(1, 8, device=device).expand(samples, 8).contiguous()
    weight = torch.randn(V, 8, device=device)
    tokens, _ = ops.sample_tokens(hidden, weight, temperature=temperature, seed=1234, offset=3,
                                  suppress_ids=[suppressed])
    logits = (hidden[0] @ weight.T).double() / temperature
    logits[suppressed] = float("-inf")
    expected = torch.softmax(logits, dim=0).cpu() * samples
    observed = torch.bincount(tokens.cpu(), minlength=V).double()
    assert observed[suppressed] == 0
    keep = torch.arange(V) != suppressed
    chi2 = (((observed - expected)[keep]) ** 2 / expected[keep]).sum().item()
    assert chi2 < 27.86  # the 1e-4 upper quantile of chi-square with 5 degrees of freedom


def test_noise_depends_on_seed_offset_and_row_id_only(device):
    hidden, weight = head(32, 8, 500, device)
    base = dict(temperature=1.0, seed=3, offset=4)
    tokens, _ = ops.sample_tokens(hidden, weight, **base)
    permutation = torch.randperm(32, device=device)
    permuted, _ = ops.sample_tokens(hidden[permutation], weight, row_ids=permutation, **base)
    assert torch.equal(permuted, tokens[permutation])  # keyed by row id, not by position in the batch
    assert not torch.equal(ops.sample_tokens(hidden, weight, **{**base, "offset": 5})[0], tokens)
    assert not torch.equal(ops.sample_tokens(hidden, weight, **{**base, "seed": 4})[0], tokens)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chunks_without_a_confidence_logit_add_nothing(device, temperature):
    """The kernels' shared online logsumexp: leading chunks whose ids are all suppressed or excluded from the
    confidence softmax (so all -inf there) must leave the confidence finite and equal to the reference's."""
    hidden, weight = head(10, 8, 30, device)
    kwargs = dict(temperature=temperature, seed=5, suppress_ids=[0, 1, 2, 3], confidence_exclude_ids=[4, 5, 6, 7])
    tokens, confidence = ops.sample_tokens(hidden, weight, chunk_size=4, **kwargs)
    ref_tokens, ref_confidence = ops.sample_tokens(hidden, weight, backend="reference", **kwargs)
    assert torch.equal(tokens, ref_tokens)
    assert torch.isfinite(ref_confidence).all()
    torch.testing.assert_close(confidence, ref_confidence, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("rule", ["counts", "threshold"])
def test_select_transfer_matches_reference(device, rule):
    confidence = torch.rand(6, 20, device=device)
    confidence[:, 5:9] = 0.5  # ties
    candidates = torch.rand(6, 20, device=device) > 0.3
    candidates[4] = False  # a row with nothing left to unmask
    counts = torch.tensor([1, 3, 0, 20, 2, 5], device=device)
    kwargs = dict(counts=counts) if rule == "counts" else dict(threshold=0.5)
    chosen = ops.select_transfer(confidence, candidates, **kwargs)
    assert torch.equal(chosen, ops.select_transfer(confidence, candidates, backend="reference", **kwargs))
    assert not (chosen & ~candidates).any() and not chosen[4].any()
    if rule == "counts":
        assert torch.equal(chosen.sum(1), torch.minimum(counts, candidates.sum(1)))
    else:
        assert (chosen.sum(1)[candidates.any(1)] >= 1).all()


def test_select_transfer_ties_go_to_the_lowest_position(device):
    confidence = torch.tensor([[0.2, 0.9, 0.9, 0.9, 0.1]], device=device)
    candidates = torch.ones(1, 5, dtype=torch.bool, device=device)
    chosen = ops.select_transfer(confidence, candidates, counts=torch.tensor([2], device=device))
    assert chosen.tolist() == [[False, True, True, False, False]]


def test_opcheck(device):
    hidden, weight = head(6, 8, 50, device)
    rows = torch.arange(6, device=device)
    opcheck(torch.ops.dllm_fast.sample_tokens.default, (hidden, weight, rows, 0.7, 11, 2, [1], [2], 16))
    confidence, candidates = torch.rand(3, 9, device=device), torch.rand(3, 9, device=device) > 0.5
    counts = torch.tensor([1, 2, 3], device=device)
    opcheck(torch.ops.dllm_fast.select_transfer.default, (confidence, candidates, counts, -1.0))
    opcheck(torch.ops.dllm_fast.select_transfer.default, (confidence, candidates, counts, 0.4))


def test_a_negative_count_is_refused_where_values_are_read(device):
    """Issue 32: the kernels take counts[b] < 0 as 0 (nothing unmasked, silently); the face names it. Where
    values are not read (values_checked(), torch.compile), the count is trusted and selects nothing."""
    from dllm_fast.validation import values_checked

    confidence = torch.rand(3, 6, device=device)
    candidates = torch.ones(3, 6, dtype=torch.bool, device=device)
    counts = torch.tensor([2, -1, 7], device=device)
    with pytest.raises(ValueError, match=r"counts\[1\] = -1 is negative"):
        ops.select_transfer(confidence, candidates, counts=counts)
    with values_checked():
        chosen = ops.select_transfer(confidence, candidates, counts=counts)
    assert chosen.sum(1).tolist() == [2, 0, 6]  # a count above the candidates unmasks them all


def test_bad_input_is_named():
    hidden, weight = head(4, 8, 20, "cpu")
    with pytest.raises(ValueError, match=r"suppress_ids\[0\]=20 must be an int in \[0, 19\]"):
        ops.sample_tokens(hidden, weight, suppress_ids=[20])
    with pytest.raises(TypeError, match=r"suppress_ids takes a list of token ids \(e.g. \[3\] for one id\), got int 3"):
        ops.sample_tokens(hidden, weight, suppress_ids=3)
    assert torch.equal(ops.sample_tokens(hidden, weight, suppress_ids=torch.tensor([1, 2]))[0],
                       ops.sample_tokens(hidden, weight, suppress_ids=[1, 2])[0])  # a tensor of ids is a list
    with pytest.raises(ValueError, match="temperature=-1.0 must be >= 0"):
        ops.sample_tokens(hidden, weight, temperature=-1.0)
    with pytest.raises(ValueError, match="every token is suppressed"):
        ops.sample_tokens(hidden, weight, suppress_ids=range(20))
    with pytest.raises(ValueError, match=r"row_ids must be an integer \[N\] = \[4\]"):
        ops.sample_tokens(hidden, weight, row_ids=torch.arange(3))
    with pytest.raises(ValueError, match="exactly one of counts"):
        ops.select_transfer(torch.rand(2, 3), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"threshold=1.5 must be in \(0.0, 1.0\]"):
        ops.select_transfer(torch.rand(2, 3), torch.ones(2, 3, dtype=torch.bool), threshold=1.5)


# ---------------------------------------------------------------------------------------------------------
# Hardening (issue 10): devices, temperature extremes, non-finite values, chunk sizes


@pytest.mark.parametrize("argument", ["hidden", "lm_head_weight", "row_ids"])
def test_sample_tokens_rejects_a_meta_tensor_by_name(argument):
    """A meta tensor used to win the dispatch and return uninitialised memory on CPU."""
    hidden, weight = head(4, 8, 20, "cpu")
    args = dict(hidden=hidden, lm_head_weight=weight, row_ids=torch.arange(4))
    args[argument] = args[argument].to("meta")
    with pytest.raises(ValueError, match=f"sample_tokens: {argument} is on the meta device"):
        ops.sample_tokens(args.pop("hidden"), args.pop("lm_head_weight"), **args)


@pytest.mark.parametrize("argument", ["confidence", "candidates", "counts"])
def test_select_transfer_rejects_a_meta_tensor_by_name(argument):
    args = dict(confidence=torch.rand(2, 3), candidates=torch.ones(2, 3, dtype=torch.bool),
                counts=torch.ones(2, dtype=torch.long))
    args[argument] = args[argument].to("meta")
    with pytest.raises(ValueError, match=f"select_transfer: {argument} is on the meta device"):
        ops.select_transfer(args.pop("confidence"), args.pop("candidates"), **args)


@pytest.mark.cuda
def test_tensors_on_two_devices_are_named():
    hidden, weight = head(4, 8, 20, "cuda")
    with pytest.raises(ValueError, match="row_ids is on cpu but hidden on cuda"):
        ops.sample_tokens(hidden, weight, row_ids=torch.arange(4))
    with pytest.raises(ValueError, match="counts is on cpu but confidence on cuda"):
        ops.select_transfer(torch.rand(2, 3, device="cuda"), torch.ones(2, 3, dtype=torch.bool, device="cuda"),
                            counts=torch.ones(2, dtype=torch.long))


@pytest.mark.parametrize("backend", ["compiled", "reference"])
@pytest.mark.parametrize("temperature", [1e-31, 1e-39, 1e-45, 5e-324])
def test_a_vanishing_temperature_is_greedy(device, backend, temperature):
    """fp32 1/T overflows below 2.9e-39 (and logits / T far earlier): such temperatures are the argmax."""
    hidden, weight = head(64, 16, 500, device, scale=5.0)
    greedy = ops.sample_tokens(hidden, weight, backend=backend)
    tiny = ops.sample_tokens(hidden, weight, temperature=temperature, seed=5, backend=backend)
    assert torch.equal(tiny[0], greedy[0])
    torch.testing.assert_close(tiny[1], greedy[1])


@pytest.mark.parametrize("temperature", [float("inf"), float("nan")])
def test_an_infinite_temperature_is_rejected(temperature):
    hidden, weight = head(4, 8, 20, "cpu")
    with pytest.raises(ValueError, match="temperature=.* must be a finite number >= 0"):
        ops.sample_tokens(hidden, weight, temperature=temperature)


@pytest.mark.parametrize("temperature", [1e30, 1e300])
def test_a_huge_temperature_samples_uniformly_the_same_in_both_backends(device, temperature):
    """1/T underflows to 0: the sample is uniform over the tokens not suppressed, never a suppressed one
    (the reference used to turn suppressed -inf logits into NaN scores, which won its argmax)."""
    hidden, weight = head(4000, 8, 5, device)
    kwargs = dict(temperature=temperature, seed=9, suppress_ids=[0, 3])
    tokens, _ = ops.sample_tokens(hidden, weight, **kwargs)
    assert torch.equal(tokens, ops.sample_tokens(hidden, weight, backend="reference", **kwargs)[0])
    counts = torch.bincount(tokens.cpu(), minlength=5)
    assert counts[0] == counts[3] == 0
    assert counts[[1, 2, 4]].min() > 1200  # about 1333 each


def test_excluding_every_token_from_the_confidence_gives_zero_in_both_backends(device):
    hidden, weight = head(6, 8, 8, device)
    for backend in ("compiled", "reference"):
        _, confidence = ops.sample_tokens(hidden, weight, confidence_exclude_ids=range(8), backend=backend)
        assert torch.equal(confidence, torch.zeros_like(confidence))


@pytest.mark.parametrize("backend", ["compiled", "reference"])
def test_a_nan_logit_raises_naming_the_row_and_token(device, backend):
    """A NaN row of the LM head is never sampled, but it used to make every confidence NaN silently."""
    hidden, weight = head(5, 8, 20, device)
    weight[13] = float("nan")
    with pytest.raises(ValueError, match="row 0 has a non-finite confidence: its logit of token 13 is nan"):
        ops.sample_tokens(hidden, weight, backend=backend)
    tokens, confidence = ops.sample_tokens(hidden, weight, backend=backend, check_finite=False)
    assert confidence.isnan().all() and not (tokens == 13).any()
    _, confidence = ops.sample_tokens(hidden, weight, suppress_ids=[13], backend=backend)  # removed first
    assert torch.isfinite(confidence).all()


@pytest.mark.parametrize("backend", ["compiled", "reference"])
def test_a_non_finite_hidden_state_raises_naming_the_row(device, backend):
    hidden, weight = head(5, 8, 20, device)
    hidden[3, 2] = float("inf")
    with pytest.raises(ValueError, match=r"hidden\[3\] holds NaN or inf"):
        ops.sample_tokens(hidden, weight, temperature=1.0, backend=backend)


@pytest.mark.parametrize("backend", ["compiled", "reference"])
def test_select_transfer_nan_raises_or_ranks_last(device, backend):
    confidence = torch.tensor([[0.5, float("nan"), 0.7, 0.1], [0.2, 0.3, float("nan"), 0.9]], device=device)
    candidates = torch.tensor([[True, True, True, True], [True, True, False, True]], device=device)
    counts = torch.tensor([3, 3], device=device)
    with pytest.raises(ValueError, match=r"confidence\[0, 1\] is NaN"):
        ops.select_transfer(confidence, candidates, counts=counts, backend=backend)
    chosen = ops.select_transfer(confidence, candidates, counts=counts, check_finite=False, backend=backend)
    assert chosen.tolist() == [[True, False, True, True], [True, True, False, True]]
    chosen = ops.select_transfer(confidence[:1], candidates[:1], threshold=0.9, check_finite=False, backend=backend)
    assert chosen.tolist() == [[False, False, True, False]]


def test_a_chunk_size_beyond_int64_means_the_whole_vocabulary():
    hidden, weight = head(6, 8, 50, "cpu")
    for backend in ("compiled", "reference"):
        huge = ops.sample_tokens(hidden, weight, temperature=1.0, chunk_size=2**70, backend=backend)
        default = ops.sample_tokens(hidden, weight, temperature=1.0, backend=backend)
        assert torch.equal(huge[0], default[0])
    with pytest.raises(TypeError, match="chunk_size=1.5 must be an int"):
        ops.sample_tokens(hidden, weight, chunk_size=1.5)


def test_bad_scalars_are_named():
    hidden, weight = head(4, 8, 20, "cpu")
    with pytest.raises(ValueError, match=r"offset=4294967296 must be an int in \[0, 4294967295\]"):
        ops.sample_tokens(hidden, weight, offset=2**32)
    with pytest.raises(TypeError, match="seed=1.0 must be an int"):
        ops.sample_tokens(hidden, weight, seed=1.0)
    with pytest.raises(ValueError, match=r"row_ids must be an integer \[N\] = \[4\]"):
        ops.sample_tokens(hidden, weight, row_ids=torch.arange(4.0))
    with pytest.raises(ValueError, match=r"counts must be an integer \[B\] = \[2\]"):
        ops.select_transfer(torch.rand(2, 3), torch.ones(2, 3, dtype=torch.bool), counts=torch.ones(2))
    with pytest.raises(ValueError, match=r"threshold=nan must be a finite number in \(0.0, 1.0\]"):
        ops.select_transfer(torch.rand(2, 3), torch.ones(2, 3, dtype=torch.bool), threshold=float("nan"))


# ---------------------------------------------------------------------------------------------------------
# Issue 19: the CPU kernel, the CUDA kernel (emulated) and the reference agree, at the edges too


def test_philox_words_near_2_32_give_finite_gumbel_noise():
    """uniform_open(w) used to round to exactly 1.0 for w >= 0xFFFFFF80, whose Gumbel noise is then -inf: a
    token that can never win its draw (about 3e-8 per token)."""
    words = torch.arange(0xFFFFFF00, 0x100000000, dtype=torch.int64)
    noise = gumbel_from_words(words)
    assert torch.isfinite(noise).all()
    assert noise[-128:].min() > -3.0  # the words closest to 2^32 give the smallest noise, about -2.8


# (row id, column): under seed 0 and offset 0, Philox gives that column of that row a word >= 0xFFFFFF80.
EXTREME_WORDS = [(5150801, 0), (8459372, 3)]


@pytest.mark.parametrize("backend", ["compiled", "reference"])
@pytest.mark.parametrize("row_id, column", EXTREME_WORDS)
def test_a_token_whose_philox_word_is_near_2_32_can_be_sampled(device, backend, row_id, column):
    words = philox4x32_10([torch.tensor([0]), torch.tensor([row_id]), torch.tensor([0]), torch.tensor([0])], (0, 0))
    assert int(words[column]) >= 0xFFFFFF80  # the case this test is about
    hidden, weight = head(1, 8, 4, device)
    others = [token for token in range(4) if token != column]
    tokens, confidence = ops.sample_tokens(hidden, weight, temperature=1.0, seed=0, offset=0,
                                           row_ids=torch.tensor([row_id], device=device), suppress_ids=others,
                                           backend=backend)
    assert tokens.tolist() == [column]
    torch.testing.assert_close(confidence, torch.ones(1, device=device))


@pytest.mark.parametrize("backend", ["compiled", "reference"])
@pytest.mark.parametrize("temperature", [2e-30, 1e-25, 1e-12, 0.5])
def test_a_tiny_temperature_samples_the_argmax_even_for_huge_logits(device, backend, temperature):
    """logits / T used to overflow fp32 just above the greedy cutoff (T >= 1e-30): every huge logit became +inf
    and the lowest id won instead of the argmax."""
    hidden = torch.full((3, 1), 1e9, device=device)
    weight = torch.tensor([[1.0], [3.0], [2.0]], device=device)
    tokens, confidence = ops.sample_tokens(hidden, weight, temperature=temperature, seed=3, backend=backend)
    assert tokens.tolist() == [1, 1, 1]
    assert torch.equal(confidence, torch.ones(3, device=device))


@pytest.mark.parametrize("backend", ["compiled", "reference"])
def test_a_row_without_a_finite_score_gives_token_minus_one_on_every_backend(device, backend):
    """The CPU kernel used to raise where the CUDA kernel returns token -1: both return it now (check_finite
    raises for both, naming the row)."""
    hidden, weight = head(4, 8, 20, device)
    hidden[2] = float("nan")
    tokens, confidence = ops.sample_tokens(hidden, weight, temperature=1.0, check_finite=False, backend=backend)
    assert tokens[2] == -1 and confidence[2].isnan()
    assert (tokens[[0, 1, 3]] >= 0).all() and torch.isfinite(confidence[[0, 1, 3]]).all()
    raw = torch.ops.dllm_fast.sample_tokens(hidden, weight, torch.arange(4, device=device), 0.0, 0, 0, [], [], 16)
    assert raw[0][2] == -1 and raw[1][2].isnan()
    with pytest.raises(ValueError, match=r"hidden\[2\] holds NaN or inf"):
        ops.sample_tokens(hidden, weight, backend=backend)


def test_more_than_eight_ids_per_list_are_refused_on_every_device(device):
    """The CUDA kernel takes the lists by value (8 ids each); the face refuses longer lists on every device."""
    hidden, weight = head(2, 8, 30, device)
    with pytest.raises(ValueError, match=r"suppress_ids holds 9 distinct ids; at most 8"):
        ops.sample_tokens(hidden, weight, suppress_ids=range(9))
    with pytest.raises(ValueError, match=r"confidence_exclude_ids holds 10 distinct ids; at most 8"):
        ops.sample_tokens(hidden, weight, confidence_exclude_ids=range(10))
    tokens, _ = ops.sample_tokens(hidden, weight, suppress_ids=[1, 1, 1, 2, 3, 4, 5, 6, 7, 8])  # 8 distinct
    assert not torch.isin(tokens, torch.arange(1, 9, device=device)).any()


def nan_last_ranks_expected(confidence, candidates, counts, threshold):
    """select_transfer's definition: a NaN confidence ranks as -inf, -0.0 as 0.0; ties to the lowest position."""
    keys = torch.nan_to_num(confidence.double(), nan=float("-inf")) + 0.0
    chosen = torch.zeros_like(candidates)
    for b in range(confidence.shape[0]):
        order = sorted((j for j in range(confidence.shape[1]) if candidates[b, j]), key=lambda j: (-keys[b, j], j))
        for rank, j in enumerate(order):
            chosen[b, j] = (rank == 0 or keys[b, j] >= threshold) if threshold >= 0 else rank < counts[b]
    return chosen


@pytest.mark.parametrize("n", [1, 33, 257, 1000])
@pytest.mark.parametrize("threshold", [-1.0, 0.25])
def test_select_transfer_called_directly_ranks_nan_as_minus_inf(device, n, threshold):
    """The raw op (no face in front to replace NaN) on every device: NaN ranks below every number and ties with
    -inf by position, -0.0 ties with 0.0; ties, empty rows, counts of 0, negative or beyond the candidates."""
    rows = 6
    confidence = torch.rand(rows, n, device=device).round(decimals=1)  # many ties
    confidence[torch.rand(rows, n, device=device) < 0.1] = float("nan")
    confidence[torch.rand(rows, n, device=device) < 0.05] = float("-inf")
    confidence[torch.rand(rows, n, device=device) < 0.05] = -0.0
    candidates = torch.rand(rows, n, device=device) < 0.8
    candidates[1] = False
    counts = torch.tensor([1, 3, 0, n, -2, n // 2 + 1], device=device)
    for dtype in (torch.float32, torch.float64):
        conf = confidence.to(dtype)
        chosen = torch.ops.dllm_fast.select_transfer(conf, candidates, counts, threshold)
        assert torch.equal(chosen.cpu(), nan_last_ranks_expected(conf.cpu(), candidates.cpu(), counts.cpu(), threshold))
        twin = reference.select_transfer(conf, candidates, counts, threshold if threshold >= 0 else None)
        assert torch.equal(chosen, twin)


@pytest.mark.parametrize("vocab", [1, 33, 257])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_of_1_33_and_257_columns_match_the_reference(device, vocab, temperature):
    """One chunk of V columns: the CUDA kernel's partial warps and blocks (V not a multiple of 4 or 32)."""
    hidden, weight = head(5, 8, vocab, device)
    kwargs = dict(temperature=temperature, seed=12, row_ids=torch.arange(100, 105, device=device))
    tokens, confidence = ops.sample_tokens(hidden, weight, chunk_size=vocab, **kwargs)
    ref_tokens, ref_confidence = ops.sample_tokens(hidden, weight, backend="reference", **kwargs)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(confidence, ref_confidence, rtol=1e-5, atol=1e-7)
