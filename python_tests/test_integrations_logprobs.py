"""Per-token mean-field diffusion log-probs for host trainers' hooks (dllm_fast.integrations.logprobs)."""

import pytest
import torch

from dllm_fast.integrations.logprobs import mean_field_logprobs
from dllm_fast.models import LLaDAConfig, LLaDAModel

pytestmark = pytest.mark.usefixtures("one_thread")


def test_mean_field_logprobs_share_masks_across_batchings():
    torch.manual_seed(0)
    model = LLaDAModel(LLaDAConfig.preset("tiny")).double().eval()
    ids = torch.randint(0, 100, (4, 9))
    attention = torch.ones_like(ids)
    attention[0, :2] = 0  # prompt padding
    attention[1, 7:] = 0  # completion padding after its end
    with torch.no_grad():
        logps = mean_field_logprobs(model, ids, attention, 4, perturb_prob=0.5, seed=3, micro_batch=2)
        flipped = mean_field_logprobs(model, ids.flip(0), attention.flip(0), 4, perturb_prob=0.5, seed=3,
                                      micro_batch=3)
        other_seed = mean_field_logprobs(model, ids, attention, 4, perturb_prob=0.5, seed=4, micro_batch=2)
    torch.testing.assert_close(flipped.flip(0).double(), logps.double())
    assert (logps[1, 2:] == 0).all() and (logps[1, :2] < 0).all() and (logps[[0, 2, 3]] < 0).all()
    assert not torch.equal(logps, other_seed)  # the prompt perturbation follows the seed


def test_without_prompt_perturbation_it_is_the_all_masked_log_softmax():
    torch.manual_seed(0)
    model = LLaDAModel(LLaDAConfig.preset("tiny")).double().eval()
    ids = torch.randint(0, 100, (3, 8))
    attention = torch.ones_like(ids)
    attention[0, :1] = 0
    attention[2, 6:] = 0
    with torch.no_grad():
        got = mean_field_logprobs(model, ids, attention, 3, perturb_prob=0.0, seed=0, micro_batch=2)
        noisy = ids.clone()
        noisy[:, 5:] = model.config.mask_token_id
        seen = attention.clone()
        seen[:, 5:] = 1  # the completion is attended to whole, as during sampling
        want = model.logits(noisy, attention_mask=seen)[:, 5:].log_softmax(-1).gather(-1, ids[:, 5:, None])[..., 0]
    torch.testing.assert_close(got.double(), torch.where(attention[:, 5:].bool(), want, 0.0), rtol=1e-6, atol=1e-6)
