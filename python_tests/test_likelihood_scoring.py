"""Scoring lp[N, n_t, L] through the fused LM head against the naive full-logits reference."""

import pytest
import torch

from dllm_fast import likelihood, reference
from dllm_fast.likelihood import SAMPLERS, active_pairs, sample_masks, score
from dllm_fast.models import LLaDAConfig, LLaDAModel

P, L = 5, 11


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return LLaDAModel(LLaDAConfig.preset("tiny")).to(dtype)


def batch(model, N=3, seed=0):
    """Left-padded prompts and completions with EOS padding; attention_mask marks the padding."""
    gen = torch.Generator().manual_seed(seed)
    sequences = torch.randint(0, 120, (N, P + L), generator=gen)
    attention_mask = torch.ones_like(sequences)
    attention_mask[1, :2] = 0
    sequences[1, :2] = model.eos_token_id  # pad id
    sequences[0, P + 7:] = model.eos_token_id
    return sequences, attention_mask


def masks_for(model, sequences, sampler="stratified_l", n_t=4, seed=1, **kwargs):
    if sampler == "coupled":  # the full mask and pairs: the samples' count is odd
        n_t -= 1
    if sampler == "trajectory":  # four states, each decoding its row's next positions in a random order
        order = torch.rand(sequences.shape[0], L, generator=torch.Generator().manual_seed(seed)).argsort(-1)
        n_t, kwargs["unmask_step"] = None, order.argsort(-1) * 4 // L
    elif sampler in ("recorded_state", "tree_edge"):  # MDPO's state (0 given, >= 1 masked); an edge's stages 0-2
        order = torch.rand(sequences.shape[0], L, generator=torch.Generator().manual_seed(seed)).argsort(-1)
        recorded = sampler == "recorded_state"
        n_t, kwargs["unmask_step"] = (None if recorded else 1), order % (2 if recorded else 3)
    elif SAMPLERS.get(sampler).data_n_t:  # its samples follow from the sequences (autoregressive: one a position)
        n_t = None
    return sample_masks(sequences, prompt_length=P, n_t=n_t, sampler=sampler,
                        generator=torch.Generator().manual_seed(seed), eos_token_id=model.eos_token_id, **kwargs)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_matches_the_naive_reference_in_float64(sampler):
    model = tiny_model()
    sequences, attention_mask = batch(model)
    masks = masks_for(model, sequences, sampler, n_t=4, block_length=4)
    with torch.no_grad():
        expected = reference.likelihood.score_naive(model, sequences, masks, attention_mask)
        for micro_batch in (1, 5, 100):
            lp = score(model, sequences, masks, micro_batch=micro_batch, attention_mask=attention_mask)
            assert lp.dtype == torch.float64 and lp.shape == (3, masks.n_t, L)
            torch.testing.assert_close(lp, expected, rtol=1e-12, atol=1e-12)
    assert (lp[~masks.scored] == 0).all() and (lp[masks.scored] < 0).all()


def test_gradients_match_the_reference_under_grad_mode():
    model = tiny_model()
    sequences, attention_mask = batch(model)
    masks = masks_for(model, sequences, "complementary", n_t=4)
    upstream = torch.randn(3, 4, L, dtype=torch.float64)
    params = list(model.parameters())
    got = torch.autograd.grad((score(model, sequences, masks, micro_batch=3, attention_mask=attention_mask)
                               * upstream).sum(), params)
    want = torch.autograd.grad((reference.likelihood.score_naive(model, sequences, masks, attention_mask)
                                * upstream).sum(), params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_fp32_model_gives_fp32_lp_close_to_the_reference():
    model = tiny_model(torch.float32)
    sequences, attention_mask = batch(model)
    masks = masks_for(model, sequences, "random_t")
    with torch.no_grad():
        lp = score(model, sequences, masks, micro_batch=2, attention_mask=attention_mask)
        expected = reference.likelihood.score_naive(model, sequences, masks, attention_mask)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, expected, rtol=1e-5, atol=1e-5)


def test_pairs_with_nothing_masked_are_not_run():
    """An empty complementary half needs no forward: the model sees only the active pairs."""
    model = tiny_model()
    sequences, _ = batch(model)
    masks = masks_for(model, sequences, "complementary", n_t=8, count="all")
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(args[0].shape[0]),
                                             with_kwargs=True)
    with torch.no_grad():
        score(model, sequences, masks, micro_batch=100)
    handle.remove()
    assert sum(calls) == active_pairs(masks).numel() == int((masks.num_masked > 0).sum())


def test_lora_model_and_its_disabled_adapter():
    """A PEFT-wrapped model satisfies the contract; with the adapter disabled it scores as the base model."""
    peft = pytest.importorskip("peft")
    model = tiny_model()
    sequences, attention_mask = batch(model)
    masks = masks_for(model, sequences, "block", block_length=4)
    with torch.no_grad():
        base = score(model, sequences, masks, micro_batch=4, attention_mask=attention_mask)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "up_proj"],
                             init_lora_weights=False)
    wrapped = peft.get_peft_model(model, config)
    with torch.no_grad():
        adapted = score(wrapped, sequences, masks, micro_batch=4, attention_mask=attention_mask)
        expected = reference.likelihood.score_naive(wrapped, sequences, masks, attention_mask)
        with wrapped.disable_adapter():
            disabled = score(wrapped, sequences, masks, micro_batch=4, attention_mask=attention_mask)
    torch.testing.assert_close(adapted, expected, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(adapted, base)
    torch.testing.assert_close(disabled, base, rtol=0, atol=0)


def test_bad_input_names_the_value():
    model = tiny_model()
    sequences, attention_mask = batch(model)
    masks = masks_for(model, sequences)
    with pytest.raises(ValueError, match=r"sequences has shape \(2, 16\) but masks were drawn for \(3, 16\)"):
        score(model, sequences[:2], masks, micro_batch=1)
    with pytest.raises(ValueError, match=r"sequences must be a \[N, P \+ L\] tensor"):
        score(model, sequences[0], masks, micro_batch=1)
    with pytest.raises(TypeError, match="sequences must hold int64 token ids, got torch.float32"):
        score(model, sequences.float(), masks, micro_batch=1)
    with pytest.raises(ValueError, match="micro_batch=0 must be an int >= 1"):
        score(model, sequences, masks, micro_batch=0)
    with pytest.raises(TypeError, match="masks must be a MonteCarloMasks"):
        score(model, sequences, masks.masked, micro_batch=1)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(3, 4\)"):
        score(model, sequences, masks, micro_batch=1, attention_mask=attention_mask[:, :4])
    in_prompt = sequences.clone()
    in_prompt[2, 3] = model.mask_token_id
    with pytest.raises(ValueError, match=r"sequences\[2, 3\] \(in the prompt\) is the mask token id 127"):
        score(model, in_prompt, masks, micro_batch=1)
    in_completion = sequences.clone()
    in_completion[0, P + 1] = model.mask_token_id
    with pytest.raises(ValueError, match=r"sequences\[0, 6\] \(in the completion\) is the mask token id"):
        score(model, in_completion, masks, micro_batch=1)
    # a mask id on a padded position is not a token: allowed
    padded = sequences.clone()
    padded[1, 0] = model.mask_token_id
    with torch.no_grad():
        score(model, padded, masks_for(model, padded), micro_batch=4, attention_mask=attention_mask)


def test_masks_drawn_for_other_sequences_are_rejected():
    """Issue 10 (7): masks of the right shape drawn for other sequences would score the wrong positions (their
    counted positions come from the other sequences' EOS); the recorded fingerprint catches it."""
    model = tiny_model()
    sequences, attention_mask = batch(model)
    masks = masks_for(model, sequences)
    other = sequences.clone()
    other[2, P + 3] = (other[2, P + 3] + 1) % 100
    with pytest.raises(ValueError, match=r"sequences\[2\] is not the sequence these masks were drawn for"):
        score(model, other, masks, micro_batch=2, attention_mask=attention_mask)
    with pytest.raises(ValueError, match=r"sequences\[2\] is not the sequence these masks were drawn for"):
        likelihood.streaming_backward(model, other, masks, lambda lp: -lp.sum(), micro_batch=2)
    moved = masks.to("cpu")
    assert torch.equal(moved.fingerprint, masks.fingerprint)
    with torch.no_grad():  # the sequences they were drawn for still score
        score(model, sequences, moved, micro_batch=2, attention_mask=attention_mask)
