"""EBPO, JustGRPO and offline VRPO (DPO): each loss against its plain-PyTorch twin (values, gradients, fp64
gradcheck), the engine's gradient against naive autograd, memory flat in n_t, their samplers, and the notes'
properties: VRPO's log 2 at theta = ref with shared masks (and not with redrawn ones), JustGRPO's exp(sum lp) as the
probability that block-1 decoding emits y (by enumeration), EBPO on one block as VRPO-OL, EBPO's clipped rows."""

import copy
import dataclasses
import itertools
import math

import pytest
import torch

import dllm_fast
from dllm_fast import objectives, reference
from dllm_fast.contracts import RolloutBatch, completion_mask
from dllm_fast.likelihood import elbo, sample_masks, score
from dllm_fast.memory import track_live_saved_tensors
from dllm_fast.models import LLaDAConfig, LLaDAModel, SDARConfig, SDARModel
from dllm_fast.objectives import preference_batch
from dllm_fast.reference import likelihood as reference_likelihood, objectives as twins, sdar as reference_sdar

pytestmark = pytest.mark.usefixtures("one_thread")

P, L, N, G = 5, 8, 4, 2
MASK, EOS = 127, 126  # sdar-tiny's; LLaDA's tiny preset: below


def rollouts(eos: int = EOS, n: int = N, seed: int = 0):
    """N completions, row 0 ending early at an EOS, row 1 with left padding."""
    gen = torch.Generator().manual_seed(seed)
    sequences = torch.randint(0, 100, (n, P + L), generator=gen)
    sequences[0, P + 5:] = eos
    attention_mask = torch.ones_like(sequences)
    attention_mask[1, :2] = 0
    return sequences, attention_mask


def batch_of(sequences, attention_mask, eos, rewards=(1.0, 0.0, 0.25, 1.0)):
    return RolloutBatch(sequences, attention_mask, P, completion_mask(sequences[:, P:], eos),
                        torch.tensor(rewards[:sequences.shape[0]]), group_size=G)


def draw(sequences, attention_mask, sampler, n_t=3, eos=EOS, seed=0, block_length=4, **settings):
    return sample_masks(sequences, prompt_length=P, sampler=sampler, n_t=None if sampler == "autoregressive" else n_t,
                        generator=torch.Generator().manual_seed(seed), eos_token_id=eos, block_length=block_length,
                        attention_mask=attention_mask, **settings)


def random_lp(masks, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    values = -scale * torch.rand(masks.scored.shape, generator=gen, dtype=torch.float64) - 0.05
    return torch.where(masks.scored, values, torch.zeros((), dtype=torch.float64))


def value_and_grad(loss_fn, lp, masks):
    """The loss and its gradient at the scored positions (lp is a constant 0 elsewhere: the engine drops the rest)."""
    lp = lp.clone().requires_grad_(True)
    value = loss_fn(lp)
    (grad,) = torch.autograd.grad(value, lp)
    return value.detach(), grad * masks.scored


def inputs_for(objective, batch, masks, lp_old=None, lp_ref=None):
    return objective.prepare(batch, masks, lp_old=lp_old, lp_ref=lp_ref)


# ---------------------------------------------------------------------------------------------------------
# The losses against their twins


EBPO_CASES = [dict(), dict(sampler="block_row_t"), dict(sampler="block_elbo"), dict(beta=0.1, kl_estimator="k1"),
              dict(beta=0.1, kl_estimator="k2"), dict(beta=0.1, kl_estimator="k3", epsilon_low=0.1, epsilon_high=0.3),
              dict(count="all")]


@pytest.mark.parametrize("options", EBPO_CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_ebpo_matches_its_twin(options):
    """The log-space clip against PPO's min(rho A, clip(rho) A) written directly, off-policy so that rows clip on
    both sides; KL estimators on E - E_ref."""
    sequences, attention_mask = rollouts()
    batch = batch_of(sequences, attention_mask, EOS)
    objective = objectives.get("ebpo", n_t=3, **options)
    masks = draw(sequences, attention_mask, objective.config.sampler, count=objective.config.count)
    lp = random_lp(masks, 0, scale=0.3)
    lp_old, lp_ref = random_lp(masks, 1, scale=0.3), random_lp(masks, 2, scale=0.3)
    inputs = inputs_for(objective, batch, masks, lp_old, lp_ref if objective.needs_reference else None)
    got = value_and_grad(lambda x: objective.loss(x, inputs), lp, masks)
    c = objective.config
    want = value_and_grad(lambda x: twins.ebpo(x, masks, batch.rewards, G, lp_old, lp_ref, epsilon_low=c.epsilon_low,
                                               epsilon_high=c.epsilon_high, beta=c.beta,
                                               kl_estimator=c.kl_estimator), lp, masks)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    stats = objective.stats(lp, inputs)
    assert 0 < float(stats["clip_fraction"]) < 1  # both branches exercised
    if not options or "beta" in options:
        assert torch.autograd.gradcheck(lambda x: objective.loss(x, inputs), lp.clone().requires_grad_(True))


@pytest.mark.parametrize("options", [dict(), dict(normalization="sequence"), dict(dual_clip=3.0, epsilon=0.1),
                                     dict(count="eos")], ids=["official", "sequence", "dual_clip", "eos"])
def test_justgrpo_matches_its_twin(options):
    sequences, attention_mask = rollouts(LLaDAConfig.preset("tiny").eos_token_id)
    batch = batch_of(sequences, attention_mask, LLaDAConfig.preset("tiny").eos_token_id, rewards=(1.0, 0.0, 0.5, 0.5))
    objective = objectives.get("justgrpo", **options)
    masks = draw(sequences, attention_mask, "autoregressive", eos=batch_eos(), count=objective.config.count)
    lp, lp_old = random_lp(masks, 0, scale=0.5), random_lp(masks, 1, scale=0.5)
    inputs = inputs_for(objective, batch, masks, lp_old)
    got = value_and_grad(lambda x: objective.loss(x, inputs), lp, masks)
    c = objective.config
    want = value_and_grad(lambda x: twins.justgrpo(x, masks, batch.rewards, G, lp_old, epsilon=c.epsilon,
                                                   normalization=c.normalization, dual_clip=c.dual_clip), lp, masks)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if not options:  # gradcheck on the positions a sample reads (the others do not enter the loss)
        reads = masks.targets
        assert torch.autograd.gradcheck(lambda x: objective.loss(lp.masked_scatter(reads, x), inputs),
                                        lp[reads].clone().requires_grad_(True))


def batch_eos():
    return LLaDAConfig.preset("tiny").eos_token_id


@pytest.mark.parametrize("options", [dict(), dict(normalization="none", beta=0.05), dict(sampler="stratified_l")],
                         ids=["padded", "raw", "floor_stratified"])
def test_vrpo_dpo_matches_its_twin(options):
    """Pair 0's chosen completion first, pair 1's second (the larger reward marks it)."""
    sequences, attention_mask = rollouts(batch_eos())
    batch = batch_of(sequences, attention_mask, batch_eos(), rewards=(1.0, 0.0, 0.25, 1.0))
    objective = objectives.get("vrpo_dpo", **options)
    masks = objective.draw_masks(batch, generator=torch.Generator().manual_seed(0), eos_token_id=batch_eos())
    lp, lp_ref = random_lp(masks, 0), random_lp(masks, 2)
    inputs = inputs_for(objective, batch, masks, lp_ref=lp_ref)
    got = value_and_grad(lambda x: objective.loss(x, inputs), lp, masks)
    c = objective.config
    want = value_and_grad(lambda x: twins.vrpo_dpo(x, masks, batch.rewards, 2, lp_ref, beta=c.beta,
                                                   normalization=c.normalization), lp, masks)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: objective.loss(x, inputs), lp.clone().requires_grad_(True))


# ---------------------------------------------------------------------------------------------------------
# The samplers


def test_block_cells_stratifies_the_sequences_cells_with_one_offset():
    """DARE's masks: every block with counted positions masked in every sample, m in 1..v, the cells (sample-major)
    at noise levels (o + c / C) mod 1 for one offset o: some o is consistent with every cell's m. A sampler that
    draws each cell independently, or orders the cells block-major, fails (break-checked)."""
    sequences, attention_mask = rollouts(n=3, seed=4)
    for seed in range(8):
        masks = draw(sequences, attention_mask, "block_cells", n_t=4, seed=seed)
        for n in range(3):
            blocks = block_ids(masks, attention_mask, n)
            sizes = {b: int(((blocks == b) & masks.counted[n]).sum()) for b in blocks.unique().tolist()}
            present = [b for b in sorted(sizes) if sizes[b] > 0]
            cells = [(j, b) for j in range(4) for b in present]  # sample-major
            counts = [int((masks.scored[n, j] & (blocks == b)).sum()) for j, b in cells]
            assert all(1 <= m <= sizes[b] for m, (_, b) in zip(counts, cells))
            weights = [float(masks.weight[n, j][(blocks == b) & masks.counted[n]][0]) for j, b in cells]
            assert weights == [sizes[b] / m for m, (_, b) in zip(counts, cells)]
            assert consistent_offset(counts, [sizes[b] for _, b in cells])


def block_ids(masks, attention_mask, n, block_length=4):
    first = int(attention_mask[n].nonzero()[0])
    absolute = (P + torch.arange(L) - first) // block_length
    return absolute - absolute[0]


def consistent_offset(counts, sizes, grid=4000):
    """Whether some o in [0, 1) puts every cell c's u = (o + c / C) mod 1 in [(m - 1) / v, m / v) (m = v: [.., 1])."""
    C = len(counts)
    o = torch.arange(grid, dtype=torch.float64) / grid
    u = torch.remainder(o[:, None] + torch.arange(C, dtype=torch.float64)[None, :] / C, 1.0)
    m = torch.tensor(counts, dtype=torch.float64)
    v = torch.tensor(sizes, dtype=torch.float64)
    inside = (u >= (m - 1) / v) & ((u < m / v) | (m == v))
    return bool(inside.all(-1).any())


def test_block_row_t_shares_a_samples_noise_level_across_its_blocks():
    """Equal-size blocks of one sample mask the same count; the samples' counts are stratified over the rows."""
    sequences = torch.randint(0, 100, (2, P + L), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(sequences)
    attention_mask[:, :1] = 0  # blocks from column 1: the completion's blocks [0, 4) and [4, 8) (positions 5..12)
    masks = draw(sequences, attention_mask, "block_row_t", n_t=4, count="all")
    blocks = block_ids(masks, attention_mask, 0)
    for n in range(2):
        counts = [[int((masks.scored[n, j] & (blocks == b)).sum()) for b in (0, 1)] for j in range(4)]
        assert all(a == b for a, b in counts)
        assert sorted(a for a, _ in counts) == [1, 2, 3, 4]  # n_t = v = 4 stratified levels: one per count
    cells = draw(sequences, attention_mask, "block_cells", n_t=4, count="all")
    assert any(int((cells.scored[n, j] & (blocks == 0)).sum()) != int((cells.scored[n, j] & (blocks == 1)).sum())
               for n in range(2) for j in range(4))


def test_the_autoregressive_family_masks_the_suffix_and_reads_one_position():
    sequences, attention_mask = rollouts(batch_eos())
    for count, n_t in (("all", L), ("eos", L)):  # row 0 counts 6 positions, the others all 8
        masks = draw(sequences, attention_mask, "autoregressive", eos=batch_eos(), count=count)
        assert masks.n_t == n_t and masks.sampler == "autoregressive"
        completion = masks.masked[..., P:]
        for j in range(n_t):
            assert completion[:, j].eq((torch.arange(L) >= j) | ~masks.counted).all()
            assert masks.target[:, j].eq((torch.arange(L) == j) & masks.counted).all()
        assert not masks.masked[..., :P].any()
        assert (masks.weight == n_t).all()
        lp = random_lp(masks)
        torch.testing.assert_close(elbo(lp, masks), torch.stack([lp[n].diagonal()[:L].sum() for n in range(N)]))
    with pytest.raises(ValueError, match="sampler='autoregressive'"):
        sample_masks(sequences, prompt_length=P, sampler="autoregressive", n_t=4, generator=torch.Generator())


def test_stratified_linspace_draws_dares_counts():
    """x_j = ((round(k + j v / n) - 1) mod v) + 1 for one k in 1..v, x_j random counted positions, w = v / x."""
    sequences, attention_mask = rollouts(batch_eos())
    for seed in range(10):
        masks = draw(sequences, attention_mask, "stratified_linspace", n_t=4, eos=batch_eos(), seed=seed)
        for n in range(N):
            v = int(masks.counted[n].sum())
            x = masks.num_masked[n].tolist()
            assert any(x == [int((round(k + j * v / 4) - 1) % v) + 1 for j in range(4)] for k in range(1, v + 1))
            assert masks.weight[n].tolist() == [v / m for m in x]


# ---------------------------------------------------------------------------------------------------------
# The notes' properties


def llada(dtype=torch.float64, seed=0):
    return LLaDAModel.with_random_weights(LLaDAConfig.preset("tiny"), dtype=dtype, seed=seed)


def sdar(dtype=torch.float64, seed=1):
    model = SDARModel.with_random_weights(SDARConfig.preset("sdar-tiny"), dtype=dtype, seed=seed)
    model.block_length = 4
    return model


def perturbed(model, scale=0.05, seed=1):
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * p.std().nan_to_num(0.0) * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return other


def gradients(model):
    return [p.grad.clone() for p in model.parameters()]


def relative_error(got, want):
    diff = sum(((g - w) ** 2).sum() for g, w in zip(got, want)).sqrt()
    return float(diff / sum((w**2).sum() for w in want).sqrt())


def pairs_of(model):
    sequences, attention_mask = rollouts(model.eos_token_id)
    prompt_mask = attention_mask[0::2, :P]
    return preference_batch(sequences[0::2, :P], sequences[0::2, P:], sequences[1::2, P:],
                            eos_token_id=model.eos_token_id, prompt_attention_mask=prompt_mask)


def test_vrpo_at_the_reference_with_shared_masks_is_log_2_with_the_dpo_gradient():
    """theta = ref, the reference scored on the policy's masks: every score is exactly 0, loss = log 2 and the
    gradient -(beta / 2) (grad B(y_w) - grad B(y_l)) / R averaged over pairs (autograd through naive scoring,
    1e-10). With masks redrawn for the reference the scores are not 0: the variance VRPO's sharing removes."""
    model = llada()
    batch = pairs_of(model)
    objective = objectives.get("vrpo_dpo")
    masks = objective.draw_masks(batch, generator=torch.Generator().manual_seed(0), eos_token_id=model.eos_token_id)
    from dllm_fast.objectives import InnerUpdate

    model.zero_grad(set_to_none=True)
    out = objective.backward(model, batch, InnerUpdate(masks), micro_batch=3, ref_model=copy.deepcopy(model))
    assert abs(float(out.loss) - math.log(2)) < 1e-12
    assert out.stats["preference_score_mean"] == 0.0
    engine = gradients(model)
    lp = reference_likelihood.score_naive(model, batch.sequences, masks, batch.attention_mask)
    bound = elbo(lp, masks)
    beta, R, K = objective.config.beta, masks.completion_length, batch.num_rollouts // 2
    want = torch.autograd.grad(-(beta / 2) * (bound[0::2] - bound[1::2]).sum() / (R * K), list(model.parameters()))
    assert relative_error(engine, want) < 1e-10
    redrawn = objective.draw_masks(batch, generator=torch.Generator().manual_seed(1), eos_token_id=model.eos_token_id)
    with torch.no_grad():
        own = elbo(score(model, batch.sequences, masks, micro_batch=8, attention_mask=batch.attention_mask), masks)
        other = elbo(score(model, batch.sequences, redrawn, micro_batch=8, attention_mask=batch.attention_mask),
                     redrawn)
    scores = beta * ((own - other)[0::2] - (own - other)[1::2]) / R
    assert (scores.abs() > 1e-3).all()


def test_vrpo_refuses_what_is_not_preference_pairs():
    model = llada()
    sequences, attention_mask = rollouts(model.eos_token_id)
    objective = objectives.get("vrpo_dpo")
    groups_of_four = RolloutBatch(sequences, attention_mask, P, completion_mask(sequences[:, P:], model.eos_token_id),
                                  torch.tensor([1.0, 0.0, 0.5, 0.25]), group_size=4)
    with pytest.raises(ValueError, match="groups of two .*group_size 4.*preference_batch"):
        objective.backward(model, groups_of_four, micro_batch=4, generator=torch.Generator(), ref_model=model)
    tie = batch_of(sequences, attention_mask, model.eos_token_id, rewards=(1.0, 0.0, 0.5, 0.5))
    with pytest.raises(ValueError, match=r"pair 1 \(rows 2 and 3\) has two equal rewards"):
        objective.backward(model, tie, micro_batch=4, generator=torch.Generator(), ref_model=model)
    with pytest.raises(ValueError, match="vrpo_dpo has no advantage .*scale_rewards does not apply"):
        objectives.get("vrpo_dpo", scale_rewards=True)


class ToyLM(torch.nn.Module):
    """A bidirectional toy with three decodable tokens (0, 1, 2 = EOS) and the mask token (3) outside its LM head,
    so that a rollout decodes exactly softmax(logits): each position's hidden state mixes the sequence's mean."""

    mask_token_id, eos_token_id, eot_token_id = 3, 2, None

    def __init__(self, d=6, positions=8, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Parameter(torch.randn(4, d, generator=gen, dtype=torch.float64))
        self.position = torch.nn.Parameter(torch.randn(positions, d, generator=gen, dtype=torch.float64))
        self.mix = torch.nn.Parameter(torch.randn(d, d, generator=gen, dtype=torch.float64))
        self.head = torch.nn.Parameter(2 * torch.randn(3, d, generator=gen, dtype=torch.float64))

    @property
    def lm_head_weight(self):
        return self.head

    def forward(self, input_ids, attention_mask=None):
        x = self.embed[input_ids] + self.position[: input_ids.shape[1]]
        return torch.tanh(x + x.mean(1, keepdim=True) @ self.mix)


def test_justgrpos_likelihood_is_the_probability_that_block_1_decoding_emits_y():
    """Enumerate all 27 completions of 3 tokens: exp(sum_j lp[n, j, j]) sums to 1, equals the left-to-right
    product of plain softmaxes (reference.objectives.autoregressive_logprob), and is the frequency with which
    generate(block_length=1, steps=3, temperature=1) emits each of them (3000 rollouts each, within 4 sigma).
    Reading any sample's other positions, or masking the prefix too, fails (break-checked)."""
    model = ToyLM()
    prompt = torch.tensor([0, 1])
    completions = torch.tensor(list(itertools.product(range(3), repeat=3)))
    sequences = torch.cat([prompt.expand(27, 2), completions], dim=1)
    masks = sample_masks(sequences, prompt_length=2, sampler="autoregressive", n_t=None, count="all",
                         generator=torch.Generator())
    with torch.no_grad():
        probability = torch.exp(elbo(score(model, sequences, masks, micro_batch=81), masks))
        exact = torch.stack([reference.objectives.autoregressive_logprob(model, prompt, y).exp() for y in completions])
    torch.testing.assert_close(probability.sum(), torch.tensor(1.0, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(probability, exact, rtol=1e-12, atol=1e-14)
    draws = 27 * 3000
    out = dllm_fast.generate(model, prompt.expand(draws, 2), gen_length=3, block_length=1, steps=3, temperature=1.0,
                             generator=torch.Generator().manual_seed(0))
    index = (out.completion_ids * torch.tensor([9, 3, 1])).sum(-1)
    frequency = torch.bincount(index, minlength=27).double() / draws
    sigma = (probability * (1 - probability) / draws).sqrt()
    assert ((frequency - probability).abs() < 4 * sigma + 1e-4).all(), (frequency - probability).abs().max()


def test_justgrpo_refuses_rollouts_that_are_not_left_to_right():
    from dllm_fast.rollout.config import GenerateConfig

    objective = objectives.get("justgrpo")
    objective.check_rollouts(GenerateConfig(gen_length=24, block_length=1, steps=24))
    with pytest.raises(ValueError, match="--block-length 1 --diffusion-steps 24"):
        objective.check_rollouts(GenerateConfig(gen_length=24, block_length=24, steps=12))


def test_ebpo_on_one_block_is_vrpo_ol_with_discrete_weights():
    """One block holding the whole completion: E is VRPO-OL's ELBO on the same masks with the per-sample weights
    L_n / m, and on-policy EBPO's loss and gradient are VRPO-OL's (-(1/N) sum A grad E)."""
    sequences, attention_mask = rollouts()
    batch = batch_of(sequences, attention_mask, EOS)
    masks = draw(sequences, attention_mask, "block_cells", n_t=4, block_length=64)  # one block: the whole sequence
    weight = masks.num_counted[:, None].double() / masks.num_masked.double()
    assert torch.equal(masks.weight, torch.where(masks.counted[:, None, :], weight[..., None], 0.0))
    plain = dataclasses.replace(masks, weight=weight, sampler="stratified_l")
    lp = random_lp(masks)
    torch.testing.assert_close(elbo(lp, masks), elbo(lp, plain), rtol=1e-15, atol=0)
    ebpo, vrpo = objectives.get("ebpo", n_t=4), objectives.get("vrpo_ol", n_t=4, sampler="stratified_l")
    got = value_and_grad(lambda x: ebpo.loss(x, inputs_for(ebpo, batch, masks)), lp, masks)
    want = value_and_grad(lambda x: vrpo.loss(x, inputs_for(vrpo, batch, plain)), lp, masks)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-15)


def test_ebpo_rows_past_the_clip_have_exactly_zero_gradient_and_never_overflow():
    """A > 0 with E - E_old > log(1 + eps) and A < 0 with E - E_old < log(1 - eps): the row's gradient is exactly 0,
    also for a log-ratio of 1e4 (exp would overflow); the other rows' is not."""
    sequences, attention_mask = rollouts()
    batch = batch_of(sequences, attention_mask, EOS)  # advantages +, -, -, +
    objective = objectives.get("ebpo", n_t=3)
    masks = draw(sequences, attention_mask, "block_cells")
    lp = random_lp(masks) - torch.where(masks.scored, 1.0, 0.0).double()  # room for lp_old above it
    lengths = elbo(torch.where(masks.scored, 1.0, 0.0).double(), masks)  # E of lp = 1 everywhere
    shift = torch.tensor([math.log(1.2) + 1e-3, math.log(0.8) - 1e-3, 0.05, 1e4], dtype=torch.float64)
    lp_old = lp - torch.where(masks.scored, (shift / lengths)[:, None, None], 0.0)
    inputs = inputs_for(objective, batch, masks, lp_old)
    torch.testing.assert_close(objective.log_ratio(lp, inputs), shift, rtol=1e-9, atol=1e-9)
    value, grad = value_and_grad(lambda x: objective.loss(x, inputs), lp, masks)
    assert math.isfinite(float(value))
    per_row = grad.abs().sum((1, 2))
    assert per_row[0] == 0 and per_row[1] == 0 and per_row[3] == 0 and per_row[2] > 0



# ---------------------------------------------------------------------------------------------------------
# The engine: gradients against naive autograd, memory


def sdar_naive(model, sequences, masks, attention_mask):
    lp = reference_sdar.block_logprobs(dict(model.named_parameters()), model.config, sequences, masks.masked, P,
                                       attention_mask, model.mask_token_id)
    return lp * masks.scored


@pytest.mark.parametrize("micro_batch", [2, 8], ids=["two_pass", "one_pass"])
def test_ebpo_engine_gradient_equals_naive_autograd_on_a_block_model(micro_batch):
    """sdar-tiny in fp64, the old policy moved (rows clip) and a k3 KL to a reference: the streaming gradient
    (two passes, or one with whole sequences per micro-batch) = autograd through per-block naive scoring."""
    model = sdar()
    old, ref = perturbed(model, 0.3, seed=1), perturbed(model, 0.05, seed=2)
    sequences, attention_mask = rollouts()
    batch = batch_of(sequences, attention_mask, EOS)
    objective = objectives.get("ebpo", n_t=3, beta=0.05, kl_estimator="k3")
    masks = objective.draw_masks(batch, generator=torch.Generator().manual_seed(0), eos_token_id=EOS,
                                 model_block_length=4)
    with torch.no_grad():
        lp_old = score(old, sequences, masks, micro_batch=8, attention_mask=attention_mask)
        lp_ref = score(ref, sequences, masks, micro_batch=8, attention_mask=attention_mask)
    inputs = objective.prepare(batch, masks, lp_old=lp_old, lp_ref=lp_ref)
    loss = objective.loss(sdar_naive(model, sequences, masks, attention_mask), inputs)
    want = torch.autograd.grad(loss, list(model.parameters()))
    from dllm_fast.objectives import InnerUpdate

    model.zero_grad(set_to_none=True)
    out = objective.backward(model, batch, InnerUpdate(masks, lp_old=lp_old), micro_batch=micro_batch, lp_ref=lp_ref)
    assert 0 < out.stats["clip_fraction"] < 1
    torch.testing.assert_close(out.loss, loss.detach(), rtol=1e-12, atol=1e-12)
    assert relative_error(gradients(model), want) < 1e-10


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_justgrpo_engine_gradient_equals_naive_autograd(temperature):
    """L forwards per sequence in the engine's one separable pass = autograd through naive scoring of every
    autoregressive mask at once; the learner's temperature divides the logits in both (break-checked: a hook that
    multiplies instead fails)."""
    from dllm_fast.objectives import InnerUpdate
    from dllm_fast.objectives.justgrpo import tempered

    model, old = llada(), None
    old = perturbed(model, 0.3, seed=1)
    sequences, attention_mask = rollouts(model.eos_token_id)
    batch = batch_of(sequences, attention_mask, model.eos_token_id)
    objective = objectives.get("justgrpo", temperature=temperature)
    masks = objective.draw_masks(batch, generator=torch.Generator(), eos_token_id=model.eos_token_id)
    with torch.no_grad(), tempered(old, temperature):
        lp_old = score(old, sequences, masks, micro_batch=16, attention_mask=attention_mask)
    inputs = objective.prepare(batch, masks, lp_old=lp_old)
    with tempered(model, temperature):
        loss = objective.loss(reference_likelihood.score_naive(model, sequences, masks, attention_mask), inputs)
    want = torch.autograd.grad(loss, list(model.parameters()))
    model.zero_grad(set_to_none=True)
    out = objective.backward(model, batch, InnerUpdate(masks, lp_old=lp_old), micro_batch=5)
    torch.testing.assert_close(out.loss, loss.detach(), rtol=1e-12, atol=1e-12)
    assert relative_error(gradients(model), want) < 1e-10
    if temperature != 1.0:  # log softmax(logits / T): the plain scoring of a model whose LM head is divided by T
        scaled = copy.deepcopy(model)
        with torch.no_grad():
            scaled.lm_head_weight.div_(temperature)
            want_lp = score(scaled, sequences, masks, micro_batch=16, attention_mask=attention_mask)
            plain = score(model, sequences, masks, micro_batch=16, attention_mask=attention_mask)
        torch.testing.assert_close(out.lp, want_lp, rtol=1e-12, atol=1e-12)
        assert not torch.allclose(plain, out.lp)


def test_justgrpo_memory_is_flat_in_its_n_t():
    """JustGRPO's n_t is the completion length: with every row counting 8 positions (n_t = 8) the engine's live
    saved tensors peak where they do with 2 (rows ending at their second token, n_t = 2): one micro-batch's graph.
    Naive scoring of every mask at once grows with n_t (the check that the measure sees the difference)."""
    model = llada(torch.float32)
    sequences, attention_mask = rollouts(model.eos_token_id)
    short = sequences.clone()
    short[:, P + 1:] = model.eos_token_id
    peaks = {}
    for name, rows, count in (("long", sequences, "all"), ("short", short, "eos")):
        batch = batch_of(rows, attention_mask, model.eos_token_id)
        objective = objectives.get("justgrpo", count=count)
        masks = objective.draw_masks(batch, generator=torch.Generator(), eos_token_id=model.eos_token_id)
        with track_live_saved_tensors(model.parameters()) as saved:
            objective.backward(model, batch, micro_batch=1, generator=torch.Generator())
        peaks[name, "engine"] = saved.peak
        with track_live_saved_tensors(model.parameters()) as saved:
            reference_likelihood.score_naive(model, rows, masks, attention_mask).sum().backward()
        peaks[name, "naive"] = saved.peak
        peaks[name, "n_t"] = masks.n_t
    assert peaks["long", "n_t"] == L and peaks["short", "n_t"] == 2
    assert peaks["long", "engine"] <= 1.05 * peaks["short", "engine"], peaks
    assert peaks["long", "naive"] >= 3 * peaks["short", "naive"], peaks
