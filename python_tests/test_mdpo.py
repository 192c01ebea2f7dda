"""MDPO: generate's step record (x_hat_t equals the model's prediction on the recorded canvas; recording leaves the
rollout's tokens unchanged; what cannot record is refused), the per-step advantage on the notes' example, the
top-k step selection and the loss against their plain-PyTorch twins (values, gradients, fp64 gradcheck), the notes'
on-policy gradient, and the engine's gradient against naive autograd on the step batch."""

import copy

import pytest
import torch

import dllm_fast
from dllm_fast import objectives
from dllm_fast.contracts import RolloutBatch
from dllm_fast.likelihood import score
from dllm_fast.models import LLaDAConfig, LLaDAModel, SDARConfig, SDARModel
from dllm_fast.objectives.mdpo import select_steps, step_advantages
from dllm_fast.reference import likelihood as reference_likelihood, objectives as twins

pytestmark = pytest.mark.usefixtures("one_thread")

G, GEN, BLOCK = 2, 8, 4


def llada(dtype=torch.float64, seed=0):
    return LLaDAModel.with_random_weights(LLaDAConfig.preset("tiny"), dtype=dtype, seed=seed).eval()


def prompts(lengths=(3, 3, 5, 5), seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), 126)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(0, 120, (length,), generator=gen)
        mask[row, width - length:] = 1
    return ids, mask


def recorded(model, temperature=1.0, **settings):
    ids, mask = prompts()
    config = dict(gen_length=GEN, block_length=BLOCK, steps=4, temperature=temperature, **settings)
    return dllm_fast.generate(model, ids, mask, generator=torch.Generator().manual_seed(0),
                              record_step_predictions=True, **config), config


def step_rewards_of(result):
    """A toy reward of every recorded prediction: its share of one token id (several distinct values per step)."""
    return (result.step_predictions % 3 == 0).double().mean(-1)


def step_batch_of(model, objective, temperature=1.0):
    result, _ = recorded(model, temperature)
    rewards = step_rewards_of(result)
    batch = RolloutBatch.from_generation(result, rewards[:, -1], group_size=G)
    return objective.step_batch(batch, result.step_predictions, result.step_confidence, rewards,
                                eos_token_id=model.eos_token_id, rollout_temperature=temperature), result


# ---------------------------------------------------------------------------------------------------------
# generate's step record


@pytest.mark.parametrize("cache", ["none", "prefix"])
def test_recorded_prediction_is_the_models_prediction_on_the_recorded_canvas(cache):
    """Greedy: at every forward t, x_hat_t is x_t (the final tokens with unmask_step >= t masked) with each masked
    position filled by the argmax of a plain forward on x_t (the mask id excluded), and the confidence is its
    softmax probability; the positions unmasked at t take x_hat_t's token (break-checked: recording the samples
    of the block's positions only, the later ones left masked, fails). The prefix cache's steps after a block's first reuse the prefix's keys
    from that refresh (Fast-dLLM's approximation), so there the plain forward is the one of each block's first
    step (forwards 0 and 2)."""
    model = llada()
    result, _ = recorded(model, temperature=0.0, cache=cache)
    P = result.prompt_length
    K = result.nfe
    assert result.step_predictions.shape == (4, K, GEN) and K == 4
    for t in range(K) if cache == "none" else (0, 2):
        masked = result.unmask_step >= t
        canvas = result.sequences.clone()
        canvas[:, P:][masked] = model.mask_token_id
        with torch.no_grad():
            logits = torch.nn.functional.linear(model(canvas, attention_mask=result.attention_mask),
                                                model.lm_head_weight)[:, P:]
        logits[..., model.mask_token_id] = -torch.inf
        want = torch.where(masked, logits.argmax(-1), canvas[:, P:])
        assert torch.equal(result.step_predictions[:, t], want)
        probability = torch.softmax(logits, -1).gather(-1, want[..., None])[..., 0]
        torch.testing.assert_close(result.step_confidence[:, t], torch.where(masked, probability, 0.0),
                                   rtol=1e-10, atol=1e-12)
        decoded = result.unmask_step == t
        assert torch.equal(result.step_predictions[:, t][decoded], result.completion_ids[decoded])


def test_dreams_recorded_prediction_reads_the_shifted_logits():
    """Dream predicts position i from hidden state i - 1 (logit_shift 1): its record is that prediction on x_t."""
    from dllm_fast.models import DreamConfig, DreamModel

    model = DreamModel.with_random_weights(DreamConfig.preset("dream-tiny"), dtype=torch.float64, seed=0).eval()
    ids = torch.randint(0, 100, (2, 4), generator=torch.Generator().manual_seed(0))
    result = dllm_fast.generate(model, ids, None, gen_length=GEN, block_length=BLOCK, steps=4,
                                record_step_predictions=True)
    for t in range(result.nfe):
        masked = result.unmask_step >= t
        canvas = result.sequences.clone()
        canvas[:, 4:][masked] = model.mask_token_id
        with torch.no_grad():
            logits = torch.nn.functional.linear(model(canvas), model.lm_head_weight)[:, 3:-1]
        logits[..., model.mask_token_id] = -torch.inf
        assert torch.equal(result.step_predictions[:, t], torch.where(masked, logits.argmax(-1), canvas[:, 4:]))


@pytest.mark.parametrize("settings", [dict(cache="none"), dict(cache="prefix"), dict(cache="none", steps=None,
                                      threshold=0.05), dict(cache="dual", block_length=GEN), dict(cfg_scale=1.0),
                                      dict(remasking="random")], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_recording_leaves_the_sampled_rollout_unchanged(settings):
    """T = 1: the recorded call decodes the tokens (and unmask_step, nfe) of the unrecorded one; the noise is keyed
    by position, so predicting the later blocks too changes no sample."""
    model = llada(torch.float32)
    ids, mask = prompts()
    config = dict(gen_length=GEN, block_length=BLOCK, steps=4, temperature=1.0)
    config.update(settings)
    plain = dllm_fast.generate(model, ids, mask, generator=torch.Generator().manual_seed(3), record_unmask_step=True,
                               **config)
    record = dllm_fast.generate(model, ids, mask, generator=torch.Generator().manual_seed(3),
                                record_step_predictions=True, **config)
    assert torch.equal(plain.sequences, record.sequences) and plain.nfe == record.nfe
    assert torch.equal(plain.unmask_step, record.unmask_step)
    assert record.step_predictions.shape == (4, record.nfe, GEN)
    assert record.step_predictions.ne(model.mask_token_id).all()  # every masked position was predicted


@pytest.mark.parametrize("model_kind, settings, message", [
    ("llada", dict(compile=True), "compile=False"),
    ("llada", dict(cache="dual"), "cache='prefix' or 'none'"),
    ("sdar", dict(cache="block"), "block-diffusion model"),
    ("llada2", dict(cache="none"), "block-diffusion model"),
])
def test_what_cannot_record_every_step_is_refused(model_kind, settings, message):
    if model_kind == "sdar":
        model = SDARModel.with_random_weights(SDARConfig.preset("sdar-tiny"), dtype=torch.float32, seed=1)
        model.block_length = BLOCK
    elif model_kind == "llada2":
        from dllm_fast.models import LLaDA2Config, LLaDA2Model

        model = LLaDA2Model.with_random_weights(LLaDA2Config.preset("llada2-tiny"), dtype=torch.float32, seed=0)
        model.block_length = BLOCK
    else:
        model = llada(torch.float32)
    ids, mask = prompts()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        dllm_fast.generate(model, ids, mask, gen_length=GEN, block_length=BLOCK, steps=4,
                           record_step_predictions=True, **settings)


# ---------------------------------------------------------------------------------------------------------
# The advantage, the selection and the loss against their twins


def test_step_advantage_is_the_notes_example():
    """r = [[0, 1, 1], [1, 1, 0]] (G 2, K 3): a = [[2, 3, 2], [2.5, 1, 0]], A = +-1/sqrt(2) up to the 1e-4."""
    r = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    want = torch.tensor([[-0.7069, 0.7071, 0.7071], [0.7069, -0.7071, -0.7071]], dtype=torch.float64)
    torch.testing.assert_close(step_advantages(r, 2), want, rtol=0, atol=1e-4)
    torch.testing.assert_close(step_advantages(r, 2), torch.tensor(twins.mdpo_step_advantages(r, 2),
                                                                   dtype=torch.float64), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("variant", ["official", "reward", "future_mean", "difference"])
def test_step_advantages_and_selection_match_their_twins(variant):
    r = torch.rand(6, 5, generator=torch.Generator().manual_seed(1)).round(decimals=1)
    got = step_advantages(r, 3, variant=variant, std_epsilon=1e-6)
    want = torch.tensor(twins.mdpo_step_advantages(r, 3, variant=variant, std_epsilon=1e-6), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for per in ("rollout", "batch"):
        assert select_steps(got, 2, per=per).tolist() == twins.mdpo_select_steps(want.tolist(), 2, per=per)
    assert select_steps(got, 9).shape == (6, 5)  # k above K: every step


def loss_case(options):
    model = llada()
    objective = objectives.get("mdpo", top_k_steps=2, **options)
    batch, _ = step_batch_of(model, objective)
    masks = objective.draw_masks(batch, generator=torch.Generator(), eos_token_id=model.eos_token_id)
    gen = torch.Generator().manual_seed(0)
    lp, lp_old, lp_ref = (torch.where(masks.scored, -torch.rand(masks.scored.shape, generator=gen,
                                                                dtype=torch.float64) - 0.05, 0.0) for _ in range(3))
    return objective, batch, masks, lp, lp_old, lp_ref


@pytest.mark.parametrize("options", [dict(), dict(confidence="recorded", epsilon=0.1), dict(beta=0.0),
                                     dict(top_k_per="batch", step_advantage="future_mean")],
                         ids=["official", "recorded_confidence", "no_kl", "dare_topk"])
def test_mdpo_loss_matches_its_twin(options):
    """Off-policy (lp_old given, so that the clip acts) with the reference's KL: value and gradient at 1e-12; fp64
    gradcheck on the read positions (break-checked: lambda_t = L / |M_t| dropped from the surrogate fails)."""
    objective, batch, masks, lp, lp_old, lp_ref = loss_case(options)
    inputs = objective.prepare(batch, masks, lp_old=lp_old, lp_ref=lp_ref)
    c = objective.config
    confidence = batch.step_confidence if c.confidence == "recorded" else None

    def twin(x):
        return twins.mdpo(x, masks, batch.step_advantages, batch.rollouts, lp_old, lp_ref, epsilon=c.epsilon,
                          beta=c.beta, confidence=confidence)

    for fn in (lambda x: objective.loss(x, inputs), twin):
        x = lp.clone().requires_grad_(True)
        value = fn(x)
        (grad,) = torch.autograd.grad(value, x)
        if fn is twin:
            torch.testing.assert_close((value, grad), got, rtol=1e-12, atol=1e-12)
        got = (value.detach(), grad)
    reads = masks.targets
    assert reads.any()
    assert torch.autograd.gradcheck(lambda x: objective.loss(lp.masked_scatter(reads, x), inputs),
                                    lp[reads].clone().requires_grad_(True))


def test_on_policy_gradient_is_the_notes_reinforce_on_the_prediction_probability():
    """On-policy with conf = p(x_hat): d loss / d lp_i = -A_t (L / |M_t|^2) p_i / N at x_t's masked positions (the
    gradient of -A_t (L / |M_t|^2) sum_i pi(x_hat_i | x_t), divided by the rollouts), beta 0."""
    objective, batch, masks, lp, _, _ = loss_case(dict(beta=0.0))
    inputs = objective.prepare(batch, masks)
    x = lp.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(objective.loss(x, inputs), x)
    M = masks.targets[:, 0].sum(-1).double() + 1e-4
    want = -batch.step_advantages[:, None] * GEN / M[:, None] ** 2 * lp[:, 0].exp() / batch.rollouts
    torch.testing.assert_close(grad[:, 0], torch.where(masks.targets[:, 0], want, 0.0), rtol=1e-12, atol=1e-15)


def test_the_step_batch_holds_x_hat_given_x_t():
    """Row (n, t): the sequence is x_hat_nt, its one sample masks exactly x_t's masked positions, the advantage and
    the reward are A_nt and r_nt of the selected steps."""
    model = llada()
    objective = objectives.get("mdpo", top_k_steps=3)
    batch, result = step_batch_of(model, objective)
    masks = objective.draw_masks(batch, generator=torch.Generator(), eos_token_id=model.eos_token_id)
    rewards = step_rewards_of(result)
    advantages = step_advantages(rewards, G)
    P = result.prompt_length
    assert batch.num_rollouts == 4 * 3 and batch.rollouts == 4
    for row, (n, t) in enumerate(zip(batch.source_row.tolist(), batch.step.tolist())):
        assert torch.equal(batch.sequences[row, P:], result.step_predictions[n, t])
        assert torch.equal(masks.masked[row, 0, P:], result.unmask_step[n] >= t)
        assert not masks.masked[row, 0, :P].any()
        assert float(batch.step_advantages[row]) == float(advantages[n, t])
        assert float(batch.rewards[row]) == pytest.approx(float(rewards[n, t]))
    assert batch.step.view(4, 3).tolist() == select_steps(advantages, 3).tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_mdpo_engine_gradient_equals_naive_autograd(temperature):
    """The engine's streaming gradient through backward (the reference's KL scored inside, every policy at the
    rollout's temperature) = autograd through naive scoring of the step batch at 1e-10."""
    from dllm_fast.objectives.justgrpo import tempered

    model = llada()
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * p.std().nan_to_num(0.0) * torch.randn(p.shape, generator=torch.Generator().manual_seed(1),
                                                                dtype=p.dtype))
    objective = objectives.get("mdpo", top_k_steps=2)
    batch, _ = step_batch_of(model, objective, temperature)
    masks = objective.draw_masks(batch, generator=torch.Generator(), eos_token_id=model.eos_token_id)
    with torch.no_grad(), tempered(ref, temperature):
        lp_ref = score(ref, batch.sequences, masks, micro_batch=16, attention_mask=batch.attention_mask)
    inputs = objective.prepare(batch, masks, lp_ref=lp_ref)
    model.train()
    with tempered(model, temperature):
        loss = objective.loss(reference_likelihood.score_naive(model, batch.sequences, masks, batch.attention_mask),
                              inputs)
    want = torch.autograd.grad(loss, list(model.parameters()))
    model.zero_grad(set_to_none=True)
    out = objective.backward(model, batch, micro_batch=3, ref_model=ref)
    torch.testing.assert_close(out.loss, loss.detach(), rtol=1e-12, atol=1e-12)
    diff = sum(((p.grad - w) ** 2).sum() for p, w in zip(model.parameters(), want)).sqrt()
    assert float(diff / sum((w ** 2).sum() for w in want).sqrt()) < 1e-10


def test_mdpo_refuses_what_is_not_its_step_batch():
    model = llada()
    result, _ = recorded(model)
    batch = RolloutBatch.from_generation(result, torch.zeros(4), group_size=G)
    objective = objectives.get("mdpo")
    with pytest.raises(TypeError, match="step batch"):
        objective.backward(model, batch, micro_batch=4)
    with pytest.raises(ValueError, match=r"step_rewards must be a \[4, 4\]"):
        objective.step_batch(batch, result.step_predictions, result.step_confidence, torch.zeros(4, 3),
                             eos_token_id=model.eos_token_id, rollout_temperature=1.0)
    with pytest.raises(ValueError, match="advantage"):
        objectives.get("mdpo", advantage="leave_one_out")
    with pytest.raises(ValueError, match="greedy"):
        objective.check_rollouts(dllm_fast.GenerateConfig(gen_length=8, block_length=4, steps=4, temperature=0.0))


def test_mdpo_is_the_same_at_every_micro_batch_and_finite_at_the_reward_bound():
    """The loss, stats and gradient do not depend on the memory micro-batch (one row per graph vs all); step
    rewards at +-2^24 give finite advantages, loss and gradients (break-checked: normalising by the rows of a
    micro-batch instead of the rollouts fails)."""
    model = llada()
    objective = objectives.get("mdpo", top_k_steps=2)
    batch, result = step_batch_of(model, objective)
    ref = copy.deepcopy(model)
    model.train()
    runs = []
    for micro_batch in (1, 64):
        model.zero_grad(set_to_none=True)
        out = objective.backward(model, batch, micro_batch=micro_batch, ref_model=ref)
        runs.append((out.loss, out.stats, [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=1e-12, atol=1e-14)
    assert runs[0][1].keys() == runs[1][1].keys()
    for a, b in zip(runs[0][2], runs[1][2]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)
    huge = torch.tensor([2.0**24, -2.0**24, 0.0, 2.0**24], dtype=torch.float64)[:, None].expand(4, result.nfe)
    huge = huge * torch.tensor([1.0, -1.0, 0.5, 1.0])[None, :result.nfe].double()
    plain = RolloutBatch.from_generation(result, huge[:, -1], group_size=G)
    bound = objective.step_batch(plain, result.step_predictions, result.step_confidence, huge,
                                 eos_token_id=model.eos_token_id, rollout_temperature=1.0)
    assert torch.isfinite(bound.step_advantages).all()
    model.zero_grad(set_to_none=True)
    out = objective.backward(model, bound, micro_batch=8, ref_model=ref)
    assert torch.isfinite(out.loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_verl_refuses_mdpo_naming_the_trainer():
    from dllm_fast.integrations.verl.settings import EngineSettings

    with pytest.raises(ValueError, match="python -m dllm_fast train --objective mdpo"):
        EngineSettings.from_section({"objective": "mdpo"})


@pytest.mark.slow  # imports TRL (seconds)
def test_trl_refuses_mdpo_naming_the_alternatives():
    pytest.importorskip("trl")
    from dllm_fast.integrations.trl import DiffusionGRPOTrainer

    with pytest.raises(ValueError, match="record_step_predictions=True"):
        DiffusionGRPOTrainer(llada(torch.float32), lambda completions, **kwargs: [0.0] * len(completions),
                             objective="mdpo")


def test_the_trainer_rewards_every_steps_prediction_once_per_distinct_text():
    """train/step_rewards.py: the N x K predictions decoded through their first EOS and rewarded by the task, a
    text repeated within a prompt's group rewarded once (break-checked: keying the cache by text alone, across
    prompts, fails)."""
    from dllm_fast.train.step_rewards import decode_step_predictions, step_rewards

    class Tokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    class Task:
        name = "count"
        calls = []

        def reward(self, example, completion):
            self.calls.append((example, completion))
            return float(len(completion)) + example

    result = type("R", (), {"step_predictions": torch.tensor([[[5, 9, 1], [5, 9, 1]], [[7, 2, 2], [5, 9, 1]]])})()
    texts = decode_step_predictions(Tokenizer(), result, eos_token_id=9)
    assert texts == [["5 9", "5 9"], ["7 2 2", "5 9"]]
    task = Task()
    rewards = step_rewards(task, [0.0, 100.0], 1, texts, "step 1")
    assert rewards.tolist() == [[3.0, 3.0], [105.0, 103.0]]
    assert task.calls == [(0.0, "5 9"), (100.0, "7 2 2"), (100.0, "5 9")]


def test_a_step_batchs_groups_are_step_batches_of_their_rollouts():
    """groups() keeps the step fields of a prompt's rows and its rollouts (the loss's normaliser): the two halves'
    losses add up to the whole batch's (each / its own rollouts, so halved)."""
    model = llada()
    objective = objectives.get("mdpo", top_k_steps=2, beta=0.0)
    batch, _ = step_batch_of(model, objective)
    halves = [batch.groups(0, 1), batch.groups(1, 2)]
    assert [h.rollouts for h in halves] == [2, 2] and torch.equal(halves[1].step, batch.step[4:])
    losses = []
    for part in (batch, *halves):
        model.zero_grad(set_to_none=True)
        losses.append(objective.backward(model, part, micro_batch=8).loss)
    torch.testing.assert_close(losses[0], (losses[1] + losses[2]) / 2, rtol=1e-12, atol=1e-14)
