"""The verl engine's old-policy scoring with entropies (integrations/verl/entropy.py, no verl needed): the log-probs
are `likelihood.score`'s, and each completion position's entropy is the policy's predictive entropy there,
averaged over the samples whose mask scores it, computed here from the model's full logits in plain PyTorch."""

import os

import pytest
import torch

import dllm_fast
from dllm_fast import objectives
from dllm_fast.contracts import RolloutBatch, completion_mask
from dllm_fast.integrations.verl import entropy as verl_entropy
from dllm_fast.likelihood import MicroBatching, score
from dllm_fast.models.loading import load_model

pytestmark = pytest.mark.slow  # fp64 model calls per (sequence, sample) for the plain-PyTorch entropies

MODEL = os.path.join(os.path.dirname(dllm_fast.__file__), "assets", "sudoku4")


@pytest.fixture(scope="module")
def scored():
    torch.manual_seed(0)
    model = load_model(MODEL, dtype=torch.float64, device="cpu").eval()
    generator = torch.Generator().manual_seed(0)
    P, L = 5, 6
    sequences = torch.randint(0, 50, (3, P + L), generator=generator)
    sequences[2, P + 3:] = model.eos_token_id  # a completion that ends early: positions past EOS are not counted
    batch = RolloutBatch(sequences=sequences, attention_mask=None, prompt_length=P,
                         completion_mask=completion_mask(sequences[:, P:], model.eos_token_id),
                         rewards=torch.zeros(3), group_size=3)
    objective = objectives.get("espo", n_t=4, count="eos")
    masks = objective.draw_masks(batch, generator=generator, eos_token_id=model.eos_token_id)
    with torch.no_grad():
        lp, entropy = verl_entropy.score_with_entropy(model, sequences, masks, micro_batch=MicroBatching(3))
    return model, sequences, masks, lp, entropy


def test_the_log_probs_are_the_scorers(scored):
    model, sequences, masks, lp, _ = scored
    with torch.no_grad():
        want = score(model, sequences, masks, micro_batch=MicroBatching(5))
    torch.testing.assert_close(lp, want, rtol=0, atol=1e-12)


def test_each_positions_entropy_is_the_mean_over_the_samples_that_score_it(scored):
    model, sequences, masks, _, entropy = scored
    N, n_t, L = masks.num_sequences, masks.n_t, masks.completion_length
    P = masks.prompt_length
    total = torch.zeros(N, L, dtype=torch.float64)
    with torch.no_grad():
        for n in range(N):
            for j in range(n_t):
                noisy = sequences[n].masked_fill(masks.masked[n, j], model.mask_token_id)[None]
                logits = model(noisy)[0, P:] @ model.lm_head_weight.T
                p = logits.softmax(-1)
                total[n] += torch.where(masks.scored[n, j], -(p * p.log()).sum(-1), 0.0)
    samples = masks.scored.sum(1)
    want = total / samples.clamp_min(1)
    torch.testing.assert_close(entropy, want, rtol=0, atol=1e-10)
    assert torch.isfinite(entropy).all()
    assert (entropy[samples > 0] > 0).all() and (entropy[samples == 0] == 0).all()
    assert (samples[2, 4:] == 0).all()  # past the early EOS nothing is scored


def test_it_needs_no_grad(scored):
    model, sequences, masks, _, _ = scored
    with pytest.raises(RuntimeError, match="under torch.no_grad"):
        verl_entropy.score_with_entropy(model, sequences, masks, micro_batch=4)


def test_under_bf16_autocast_the_entropies_are_fp32_as_the_log_probs(scored):
    """The engine scores under verl's bf16 autocast: the entropies are computed in the head's fp32, like lp."""
    model, sequences, masks, lp64, entropy64 = scored
    model32 = load_model(MODEL, dtype=torch.float32, device="cpu").eval()
    with torch.no_grad(), torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        lp, entropy = verl_entropy.score_with_entropy(model32, sequences, masks, micro_batch=MicroBatching(4))
    assert lp.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(entropy.double(), entropy64, rtol=0, atol=0.1)
