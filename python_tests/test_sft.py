"""Masked-diffusion SFT: the fused loss against its full-logits reference (values and gradients, fp64), the
LLaDA noise, and the batch layout."""

import pytest
import torch

from dllm_fast import reference
from dllm_fast.models import LLaDAConfig, LLaDAModel
from dllm_fast.sft import draw_sft_masks, encode_sft_batch, sft_loss


def tiny_model(dtype=torch.float64):
    return LLaDAModel.with_random_weights(LLaDAConfig.preset("tiny"), dtype=dtype, seed=1)


def clean_batch(model, batch=5, prompt=6, completion=9, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.eot_token_id, (batch, prompt + completion), generator=generator)


def gradients(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("padded", [False, True])
def test_sft_loss_matches_the_reference_in_value_and_gradient(one_thread, padded):
    model = tiny_model()
    sequences = clean_batch(model)
    attention_mask = None
    if padded:  # left padding on two prompts
        attention_mask = torch.ones_like(sequences)
        attention_mask[0, :2] = 0
        attention_mask[3, :4] = 0
        sequences = sequences.masked_fill(attention_mask == 0, model.eos_token_id)
    masks = draw_sft_masks(sequences, prompt_length=6, generator=torch.Generator().manual_seed(3))
    fast = sft_loss(model, sequences, masks, attention_mask=attention_mask, micro_batch=2)
    fast.backward()
    fast_grads = gradients(model)
    model.zero_grad(set_to_none=True)
    naive = reference.sft.sft_loss(model, sequences, masks, attention_mask=attention_mask)
    naive.backward()
    assert fast.dtype == torch.float64
    torch.testing.assert_close(fast, naive, rtol=1e-12, atol=1e-12)
    for name, grad in gradients(model).items():
        torch.testing.assert_close(fast_grads[name], grad, rtol=1e-10, atol=1e-12, msg=name)


def test_sft_loss_is_llada_formula_on_a_hand_built_mask(one_thread):
    """One masked token per row with p = 0.5: loss = mean over rows of -log p(x) / 0.5 / L."""
    model = tiny_model()
    sequences = clean_batch(model, batch=2, prompt=3, completion=4)
    masks = draw_sft_masks(sequences, prompt_length=3, generator=torch.Generator().manual_seed(0))
    masked = torch.zeros_like(masks.masked)
    masked[0, 0, 4] = masked[1, 0, 6] = True
    half = torch.full_like(masks.t, 0.5)
    masks = type(masks)(masked=masked, counted=masks.counted, weight=1 / half, t=half,
                        num_masked=masked[..., 3:].sum(-1), prompt_length=3, sampler=masks.sampler)
    with torch.no_grad():
        noisy = sequences.masked_fill(masked[:, 0], model.mask_token_id)
        logp = torch.log_softmax(model.logits(noisy), -1)
        expected = -(logp[0, 4, sequences[0, 4]] + logp[1, 6, sequences[1, 6]]) / 0.5 / 4 / 2
        torch.testing.assert_close(sft_loss(model, sequences, masks), expected)


def test_sft_masks_follow_llada_noise():
    sequences = torch.zeros(4000, 10 + 50, dtype=torch.long)
    masks = draw_sft_masks(sequences, prompt_length=10, generator=torch.Generator().manual_seed(0), eps=0.1)
    p = masks.t[:, 0]
    assert not masks.masked[:, 0, :10].any(), "the prompt is never masked"
    assert masks.counted.all()
    assert p.min() >= 0.1 and p.max() <= 1.0
    torch.testing.assert_close(masks.weight[:, 0], 1 / p)
    assert abs(p.mean().item() - 0.55) < 0.02  # (1 - eps) t + eps with t ~ U(0, 1)
    rate = masks.masked[:, 0, 10:].double().mean(-1)
    assert abs((rate - p).mean().item()) < 0.01 and (rate - p).abs().max() < 0.4
    again = draw_sft_masks(sequences, prompt_length=10, generator=torch.Generator().manual_seed(0), eps=0.1)
    assert torch.equal(again.masked, masks.masked)


def test_sft_masks_reject_bad_arguments():
    sequences = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="prompt_length=5"):
        draw_sft_masks(sequences, prompt_length=5, generator=torch.Generator())
    with pytest.raises(ValueError, match="eps=0.0"):
        draw_sft_masks(sequences, prompt_length=2, generator=torch.Generator(), eps=0.0)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        draw_sft_masks(sequences, prompt_length=2, generator=0)


class CharacterTokenizer:
    """Each character is its ASCII code; pad 0."""

    pad_token_id, eos_token_id = 0, 0

    def __call__(self, text, add_special_tokens):
        assert not add_special_tokens
        return {"input_ids": [ord(c) for c in text]}


def test_encode_sft_batch_layout():
    batch = encode_sft_batch(CharacterTokenizer(), ["ab", "abcd"], ["x", "yz"], completion_length=4,
                             eos_token_id=1, eot_token_id=2)
    a, b, c, d, x, y, z = (ord(ch) for ch in "abcdxyz")
    assert batch.prompt_length == 4
    assert batch.sequences.tolist() == [[1, 1, a, b, x, 2, 1, 1], [a, b, c, d, y, z, 2, 1]]
    assert batch.attention_mask.tolist() == [[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8]
    same = encode_sft_batch(CharacterTokenizer(), ["ab", "cd"], ["x", "y"], completion_length=3, eos_token_id=1)
    assert same.attention_mask is None and same.sequences.tolist() == [[a, b, x, 1, 1], [c, d, y, 1, 1]]
    with pytest.raises(ValueError, match="completion 1 takes 3 tokens.*at least 4"):
        encode_sft_batch(CharacterTokenizer(), ["a", "b"], ["x", "yz"], completion_length=3, eos_token_id=1,
                         eot_token_id=2)
