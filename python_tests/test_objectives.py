"""The objectives: values and lp-gradients against their loop-written reference twins for every option, exact
parameter gradients through the engine against naive autograd, the papers' properties, and bad input."""

import copy

import pytest
import torch

from dllm_fast import objectives, reference
from dllm_fast.contracts import RolloutBatch, completion_mask
from dllm_fast.likelihood import BackwardHooks, MicroBatching, elbo, eubo, score
from dllm_fast.likelihood.samplers import SAMPLERS
from dllm_fast.models import LLaDAConfig, LLaDAModel
from dllm_fast.objectives import InnerUpdate, LossInputs

pytestmark = pytest.mark.usefixtures("one_thread")

P, L, G = 4, 10, 2
# mdpo trains on its StepBatch (the rollout's rewarded steps), not a rollout batch: test_mdpo.py runs these
# checks (twin, gradcheck, engine vs naive autograd, micro-batches, bounds) on it.
# d_treerpo trains on a tree rollout's edges (a TreeBatch): python_tests/test_d_treerpo.py tests it the same ways.
NAMES = [name for name in objectives.available() if name not in ("mdpo", "d_treerpo")]
ARGS = {  # which constants each reference twin takes, and the config options it understands
    "diffu_grpo": (("lp_old", "lp_ref"), ("epsilon", "beta", "normalization", "normalize_per", "dual_clip",
                                          "scale_rewards", "std_epsilon")),
    "wd1": ((), ("psi", "negative_term")),
    "vrpo_ol": (("lp_old",), ("std_epsilon", "scale_rewards")),
    "bgpo": (("lp_old",), ("std_epsilon", "scale", "clip_epsilon", "dual_clip", "aggregation")),
    "spg": ((), ("bound", "beta", "omega", "normalization", "normalize_per")),
    "espo": (("lp_old", "lp_ref"), ("epsilon_low", "epsilon_high", "beta", "advantage", "scale_rewards",
                                    "kl_estimator", "length")),
    "rspo": (("lp_ref",), ("lam", "center", "scale_rewards")),
    "coupled_grpo": (("lp_old", "lp_ref"), ("epsilon", "beta", "advantage", "scale_rewards", "normalize_per")),
    "gdpo": (("lp_old",), ("epsilon_low", "epsilon_high", "scale_rewards")),
    "tracerl": (("lp_old",), ("epsilon", "beta")),
    # -- EBPO, JustGRPO, offline VRPO --
    "ebpo": (("lp_old", "lp_ref"), ("epsilon_low", "epsilon_high", "beta", "kl_estimator", "std_epsilon")),
    "justgrpo": (("lp_old",), ("epsilon", "normalization", "dual_clip", "std_epsilon")),
    "vrpo_dpo": (("lp_ref",), ("beta", "normalization")),
    # -- CJ-GRPO --
    "cj_grpo": (("lp_old", "lp_ref", "unmask_step"), ("epsilon", "beta", "normalization", "scale_rewards",
                                                       "std_epsilon", "dual_clip")),
}
VARIANTS = [  # (name, overrides): every default, plus each documented option
    *[(name, {}) for name in NAMES],
    ("diffu_grpo", {"normalization": "sequence", "epsilon": 0.05}),
    ("diffu_grpo", {"beta": 0.0}),
    ("diffu_grpo", {"normalize_per": "micro_batch", "micro_batch_rows": 2}),
    ("diffu_grpo", {"normalize_per": "micro_batch", "normalization": "sequence", "micro_batch_rows": 3,
                    "dual_clip": 1.5, "scale_rewards": True, "epsilon": 0.05}),
    ("diffu_grpo", {"preset": "dare"}),
    ("wd1", {"psi": 2.5}),
    ("wd1", {"negative_term": False}),
    ("vrpo_ol", {"scale_rewards": False}),
    ("bgpo", {"scale": "padded_length", "clip_epsilon": 0.2, "dual_clip": 3.0}),
    ("bgpo", {"scale": "response_length", "clip_epsilon": 0.05}),
    ("bgpo", {"aggregation": "length_weighted", "micro_batch_rows": 2}),
    ("bgpo", {"preset": "dare", "micro_batch_rows": 3}),
    ("spg", {"bound": "eubo", "beta": 1.5}),
    ("spg", {"bound": "elbo"}),
    ("spg", {"bound": "zero"}),
    ("spg", {"normalization": "token"}),
    ("spg", {"normalization": "token", "normalize_per": "micro_batch", "micro_batch_rows": 2}),
    ("spg", {"normalize_per": "micro_batch", "micro_batch_rows": 3, "preset": "sudoku"}),
    ("espo", {"advantage": "leave_one_out", "epsilon_low": 0.01, "epsilon_high": 0.02, "beta": 0.1}),
    ("espo", {"count": "eos"}),  # the ratio is still normalised by the fixed width L, not the response length
    ("espo", {"scale_rewards": True, "kl_estimator": "k1", "beta": 0.1}),
    ("espo", {"kl_estimator": "k3", "length": "counted", "beta": 0.1, "count": "eos"}),
    ("espo", {"preset": "countdown"}),
    ("rspo", {"center": "group", "scale_rewards": True, "lam": 0.5}),
    ("rspo", {"center": "micro_batch", "micro_batch_rows": 2, "lam": 0.5}),
    ("rspo", {"center": "micro_batch", "micro_batch_rows": 3}),
    ("coupled_grpo", {"normalize_per": "micro_batch", "micro_batch_rows": 2, "advantage": "mean",
                      "scale_rewards": True}),
    ("coupled_grpo", {"beta": 0.0, "epsilon": 0.1}),
    ("gdpo", {"quadrature_points": 2, "scale_rewards": True, "epsilon_low": 0.05}),
    ("tracerl", {"shrink": 2}),
    ("tracerl", {"beta": 0.0, "shrink": 1, "epsilon": 0.05}),
    # -- EBPO (on one block: the tiny model is bidirectional), JustGRPO, offline VRPO --
    ("ebpo", {"beta": 0.1, "kl_estimator": "k3", "epsilon_low": 0.05}),
    ("ebpo", {"beta": 0.1, "kl_estimator": "k1", "count": "all"}),
    ("justgrpo", {"normalization": "sequence", "dual_clip": 2.0, "count": "eos"}),
    ("vrpo_dpo", {"normalization": "none", "sampler": "random_t"}),
    # -- CJ-GRPO --
    ("cj_grpo", {"normalization": "transition", "dual_clip": 2.0, "scale_rewards": True, "epsilon": 0.05}),
    ("cj_grpo", {"micro_batch_rows": 3, "shrink": 2}),  # preset="dare": python_tests/test_cj_grpo.py
]


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return LLaDAModel(LLaDAConfig.preset("tiny")).double()


def perturbed(model, scale=0.05, seed=1):
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * p.std().nan_to_num(0.0) * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return other


def rollout_batch(model, rewards=(1.0, 0.0, 0.25, 0.75), seed=0):
    """N = 4 rollouts in groups of 2: row 0 ends early with EOS padding, row 3 has a left-padded prompt. Each
    decoded its completion in a random order, two positions per step (the unmask_step TraceRL replays)."""
    gen = torch.Generator().manual_seed(seed)
    sequences = torch.randint(0, 120, (len(rewards), P + L), generator=gen)
    sequences[0, P + 6:] = model.eos_token_id
    attention_mask = torch.ones_like(sequences)
    attention_mask[-1, :2] = 0
    completion = sequences[:, P:]
    unmask_step = torch.rand(len(rewards), L, generator=gen).argsort(-1).argsort(-1) // 2
    return RolloutBatch(sequences, attention_mask, P, completion_mask(completion, model.eos_token_id),
                        torch.tensor(rewards), G, unmask_step)


def make(name, **overrides):
    """The objective with test-sized estimator settings: n_t >= 4 (5 for the coupled sampler's full mask and
    pairs; trajectory states and autoregressive positions follow from the rollout), blocks of 4, and a block
    model's samplers (EBPO's) replaced by one block of the whole completion."""
    sampler = overrides.get("sampler", objectives.get(name).config.sampler)
    base = {"n_t": {"coupled": 5, "trajectory": 1, "autoregressive": 1}.get(sampler, 4)}
    if sampler == "block":
        base["block_length"] = 4
    if SAMPLERS[sampler].model_blocks:  # the tiny model is bidirectional: one block, the whole completion
        base["sampler"] = "stratified_l"
    return objectives.get(name, **{**base, **overrides})


def draw(objective, model, batch, seed=2):
    return objective.draw_masks(batch, generator=torch.Generator().manual_seed(seed), eos_token_id=model.eos_token_id)


def random_lp(masks, seed, low=0.05, high=4.0):
    """Log-probs in [-high, -low] where the masks score, 0 elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    values = -(low + (high - low) * torch.rand(masks.scored.shape, generator=gen, dtype=torch.float64))
    return torch.where(masks.scored, values, 0.0)


def reference_loss(objective, lp, inputs):
    takes, options = ARGS[objective.name]
    constants = {"lp_old": inputs.lp_old, "lp_ref": inputs.lp_ref, "unmask_step": inputs.batch.unmask_step}
    kwargs = {name: getattr(objective.config, name) for name in options}
    if hasattr(objective.config, "micro_batch_rows"):  # the objective's own rows (None: the whole batch)
        kwargs["rows"] = objective.config.micro_batch_rows
    function = getattr(reference.objectives, objective.name)
    return function(lp, inputs.masks, inputs.batch.rewards, inputs.batch.group_size,
                    **{k: constants[k] for k in takes}, **kwargs)


def constants(objective, masks, on_policy=False):
    lp_old = None if on_policy else random_lp(masks, 11, high=3.0)
    lp_ref = random_lp(masks, 12, high=3.5) if objective.needs_reference else None
    return lp_old, lp_ref


@pytest.mark.parametrize("name, overrides", VARIANTS)
@pytest.mark.parametrize("on_policy", [False, True])
def test_loss_matches_the_reference_twin_in_value_and_lp_gradient(name, overrides, on_policy):
    model = tiny_model()
    objective = make(name, **overrides)
    batch = rollout_batch(model)
    masks = draw(objective, model, batch)
    lp_old, lp_ref = constants(objective, masks, on_policy)
    inputs = objective.prepare(batch, masks, lp_old=lp_old, lp_ref=lp_ref)
    lp = random_lp(masks, 10).requires_grad_(True)
    value = objective.loss(lp, inputs)
    (grad,) = torch.autograd.grad(value, lp)
    lp_twin = lp.detach().clone().requires_grad_(True)
    want = reference_loss(objective, lp_twin, inputs)
    (want_grad,) = torch.autograd.grad(want, lp_twin)
    torch.testing.assert_close(value, want, rtol=1e-10, atol=1e-12)
    scored = masks.scored  # lp is a constant 0 elsewhere (the engine drops those coefficients)
    torch.testing.assert_close(grad * scored, want_grad * scored, rtol=1e-9, atol=1e-12)
    assert (grad * scored).abs().sum() > 0


def relative_error(got, want):
    diff = sum(((g - w) ** 2).sum() for g, w in zip(got, want)).sqrt()
    return (diff / sum((w**2).sum() for w in want).sqrt()).item()


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("name, overrides", VARIANTS)
def test_engine_gradient_equals_naive_autograd(name, overrides):
    """Issue 8: per objective, fp64, n_t >= 4, left padding, EOS padding, micro-batch 3 not dividing N n_t = 16."""
    model = tiny_model()
    objective = make(name, **overrides)
    batch = rollout_batch(model)
    masks = draw(objective, model, batch)
    with torch.no_grad():
        lp_old = score(perturbed(model, seed=3), batch.sequences, masks, micro_batch=16,
                       attention_mask=batch.attention_mask)
        lp_ref = score(perturbed(model, seed=4), batch.sequences, masks, micro_batch=16,
                       attention_mask=batch.attention_mask) if objective.needs_reference else None
    inputs = objective.prepare(batch, masks, lp_old=lp_old, lp_ref=lp_ref)
    naive = objective.loss(reference.likelihood.score_naive(model, batch.sequences, masks, batch.attention_mask),
                           inputs)
    want = torch.autograd.grad(naive, trainable(model))
    model.zero_grad(set_to_none=True)
    out = objective.backward(model, batch, InnerUpdate(masks, lp_old=lp_old), micro_batch=3, lp_ref=lp_ref)
    got = [p.grad for p in trainable(model)]
    torch.testing.assert_close(out.loss, naive.detach(), rtol=1e-10, atol=1e-12)
    assert relative_error(got, want) < 1e-6
    assert out.stats["loss"] == pytest.approx(naive.item())


@pytest.mark.parametrize("name", ["vrpo_ol", "espo", "rspo", "spg", "diffu_grpo", "coupled_grpo", "gdpo", "tracerl"])
def test_known_current_lp_gives_the_same_gradient(name):
    """The first inner update: lp_old is the current policy's lp; passing it as lp= skips the scoring pass."""
    model = tiny_model()
    objective = make(name)
    batch = rollout_batch(model)
    masks = draw(objective, model, batch)
    with torch.no_grad():
        lp_now = score(model, batch.sequences, masks, micro_batch=16, attention_mask=batch.attention_mask)
        lp_ref = score(perturbed(model, seed=4), batch.sequences, masks, micro_batch=16,
                       attention_mask=batch.attention_mask) if objective.needs_reference else None
    grads = []
    for lp in (None, lp_now):
        model.zero_grad(set_to_none=True)
        out = objective.backward(model, batch, InnerUpdate(masks, lp_old=lp_now, lp=lp), micro_batch=3,
                                 lp_ref=lp_ref)
        grads.append([p.grad.clone() for p in trainable(model)])
    assert relative_error(grads[1], grads[0]) < 1e-12
    assert out.stats.get("ratio_mean", 1.0) == 1.0 and out.stats.get("ratio_max", 1.0) == 1.0


ZERO_WIDTH_CLIP = {"diffu_grpo": {"epsilon": 0.0}, "espo": {"epsilon_low": 0.0, "epsilon_high": 0.0},
                   "coupled_grpo": {"epsilon": 0.0}, "gdpo": {"epsilon_low": 0.0, "epsilon_high": 0.0},
                   "tracerl": {"epsilon": 0.0}, "cj_grpo": {"epsilon": 0.0}}


@pytest.mark.parametrize("name", [n for n in NAMES if objectives.get(n).uses_old_policy])
def test_on_policy_ratios_are_exactly_one_at_any_micro_batch(name):
    """Issue 22 item 3: before the policy moves the plan leaves lp_old out, and old = stop_gradient(current) makes
    every ratio exactly 1 however the pairs are cut into model calls. So a clip interval of width 0 (ESPO's
    countdown epsilon) never fires on-policy, and the first-step gradient is the unclipped one."""
    model = tiny_model()
    batch = rollout_batch(model)
    narrow, wide = make(name, **ZERO_WIDTH_CLIP.get(name, {})), make(name)
    (update,) = narrow.plan_updates(model, batch, moved=[False], generator=torch.Generator().manual_seed(5),
                                    micro_batch=4)
    assert update.lp_old is None
    reference_grads = None
    for objective in (wide, narrow):
        for batching in (MicroBatching(1), MicroBatching(3, score_micro_batch=5), MicroBatching(16)):
            model.zero_grad(set_to_none=True)
            out = objective.backward(model, batch, update, micro_batch=batching, ref_model=perturbed(model))
            assert out.stats["ratio_mean"] == 1.0 and out.stats["ratio_max"] == 1.0, (objective, batching)
            assert out.stats.get("clip_fraction", 0.0) == 0.0
            grads = [p.grad.clone() for p in trainable(model)]
            reference_grads = reference_grads or grads
            assert relative_error(grads, reference_grads) < 1e-10, (objective, batching)


@pytest.mark.parametrize("name, overrides", VARIANTS)
def test_head_gradient_in_the_forward_equals_the_ordinary_ops_gradient_fp32(name, overrides):
    """Issue 23: the engine's LM head gradient computed in pass 2's forward (lse from pass 1's lp, or from lp=),
    or in the backward under a host-owned backward, equals today's path, autograd through the ordinary fused
    op, within fp32's tolerance, for every objective."""
    model = tiny_model().float()
    objective = make(name, **overrides)
    batch = rollout_batch(model)
    masks = draw(objective, model, batch)
    with torch.no_grad():
        lp_now = score(model, batch.sequences, masks, micro_batch=16, attention_mask=batch.attention_mask)
        lp_old = score(perturbed(model, seed=3), batch.sequences, masks, micro_batch=16,
                       attention_mask=batch.attention_mask)
        lp_ref = score(perturbed(model, seed=4), batch.sequences, masks, micro_batch=16,
                       attention_mask=batch.attention_mask) if objective.needs_reference else None
    inputs = objective.prepare(batch, masks, lp_old=lp_old, lp_ref=lp_ref)
    ordinary = objective.loss(score(model, batch.sequences, masks, micro_batch=3,
                                    attention_mask=batch.attention_mask), inputs)
    want = torch.autograd.grad(ordinary, trainable(model))
    runs = {"in_forward": {}, "host_backward": {"hooks": BackwardHooks(backward=torch.Tensor.backward)}}
    if not objective.separable:
        runs["known_lp"] = {"update": InnerUpdate(masks, lp_old=lp_old, lp=lp_now)}
    for run, options in runs.items():
        model.zero_grad(set_to_none=True)
        update = options.pop("update", InnerUpdate(masks, lp_old=lp_old))
        objective.backward(model, batch, update, micro_batch=3, lp_ref=lp_ref, **options)
        assert relative_error([p.grad for p in trainable(model)], want) < 2e-6, run


# ---------------------------------------------------------------------------------------------------------
# Properties from the papers


def test_bgpo_equals_vrpo_ol_on_policy_in_value_and_gradient():
    model = tiny_model()
    batch = rollout_batch(model)
    bgpo, vrpo = make("bgpo", n_t=6), make("vrpo_ol", n_t=6)
    masks = draw(bgpo, model, batch)
    results = []
    for objective in (bgpo, vrpo):
        model.zero_grad(set_to_none=True)
        out = objective.backward(model, batch, InnerUpdate(masks), micro_batch=5)  # on-policy: old = current
        results.append((out.loss, [p.grad.clone() for p in trainable(model)]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-12, atol=1e-12)
    assert relative_error(results[0][1], results[1][1]) < 1e-10
    assert results[0][0].item() == pytest.approx(-bgpo.advantages(batch).mean().item(), abs=1e-12)


def test_bgpo_lower_bounds_vrpo_ol_per_sequence_off_policy():
    model = tiny_model()
    batch = rollout_batch(model, rewards=(1.0, 0.0, 0.0, 0.5))
    bgpo, vrpo = make("bgpo", n_t=6), make("vrpo_ol", n_t=6)
    masks = draw(bgpo, model, batch)
    lp, lp_old = random_lp(masks, 20), random_lp(masks, 21)
    inputs = bgpo.prepare(batch, masks, lp_old=lp_old)
    advantage = inputs.advantage(lp)
    gain, _, _ = bgpo.sample_terms(lp, lp_old, masks.weight, inputs.extra["divisor"][:, None], advantage[:, None])
    lower = gain.mean(-1)  # R_lb per sequence
    exact = torch.exp(vrpo.log_ratio(lp, vrpo.prepare(batch, masks, lp_old=lp_old))) * advantage
    assert (lower <= exact + 1e-12).all()
    assert (lower < exact - 1e-6).any()  # off-policy the bound is strict somewhere


@pytest.mark.parametrize("name", ["espo", "diffu_grpo", "coupled_grpo", "gdpo", "tracerl"])
def test_ratios_are_one_on_policy(name):
    model = tiny_model()
    objective = make(name)
    batch = rollout_batch(model)
    masks = draw(objective, model, batch)
    with torch.no_grad():  # the old policy is the current one, scored on the same masks with another chunking
        lp_old = score(model, batch.sequences, masks, micro_batch=5, attention_mask=batch.attention_mask)
        lp_ref = score(perturbed(model), batch.sequences, masks, micro_batch=5, attention_mask=batch.attention_mask)
    out = objective.backward(model, batch, InnerUpdate(masks, lp_old=lp_old), micro_batch=3, lp_ref=lp_ref)
    assert out.stats["ratio_mean"] == pytest.approx(1.0, abs=1e-12)
    assert out.stats["ratio_max"] == pytest.approx(1.0, abs=1e-12)
    assert out.stats["clip_fraction"] == 0.0


def lp_coefficients(objective, inputs, lp):
    """d loss / d lp on the scored positions (lp is a constant 0 elsewhere; the engine drops those)."""
    lp = lp.clone().requires_grad_(True)
    (coef,) = torch.autograd.grad(objective.loss(lp, inputs), lp)
    return coef * inputs.masks.scored


def test_first_step_gradient_of_diffu_grpo_is_token_reinforce():
    """On-policy with beta = 0, d loss / d lp_nji = -A_n s_nji / sum(s): REINFORCE on every scored token."""
    model = tiny_model()
    objective = make("diffu_grpo", beta=0.0)
    batch = rollout_batch(model)
    masks = draw(objective, model, batch)
    inputs = objective.prepare(batch, masks)
    coef = lp_coefficients(objective, inputs, random_lp(masks, 5))
    advantage = inputs.advantages[:, None, None]
    torch.testing.assert_close(coef, -advantage * masks.scored / masks.scored.sum(), rtol=1e-12, atol=1e-15)


def test_first_step_gradient_of_espo_is_the_length_normalised_elbo_gradient():
    """On-policy with beta = 0: d loss / d lp_nji = -(1/N) A_n w_nj / (n_t L) on scored positions."""
    model = tiny_model()
    objective = make("espo", beta=0.0)
    batch = rollout_batch(model)
    masks = draw(objective, model, batch)
    inputs = objective.prepare(batch, masks)
    coef = lp_coefficients(objective, inputs, random_lp(masks, 5))
    N, n_t = masks.num_sequences, masks.n_t
    want = -inputs.advantages[:, None, None] * masks.weight[..., None] * masks.scored / (N * n_t * L)
    torch.testing.assert_close(coef, want, rtol=1e-12, atol=1e-15)


def test_first_step_gradient_of_coupled_grpo_is_token_reinforce_through_the_estimate():
    """On-policy with beta = 0, d loss / d lp_nji = -A_n w_nj / (n_t C) with C the batch's counted tokens: REINFORCE
    on each token's coupled estimate (Eq. 13), which reads every counted token once per group (full mask, pairs)."""
    model = tiny_model()
    objective = make("coupled_grpo", beta=0.0)
    batch = rollout_batch(model)
    masks = draw(objective, model, batch)
    assert torch.equal(masks.scored.sum(1), masks.counted * (masks.n_t + 1) // 2)
    inputs = objective.prepare(batch, masks)
    coef = lp_coefficients(objective, inputs, random_lp(masks, 5))
    want = -inputs.advantages[:, None, None] * masks.weight[..., None] * masks.scored / (
        masks.n_t * masks.counted.sum())
    torch.testing.assert_close(coef, want, rtol=1e-12, atol=1e-15)


def test_first_step_gradient_of_gdpo_is_the_length_normalised_sdmc_elbo_gradient():
    """On-policy: d loss / d lp_nji = -(1/N) A_n w_nj / (n_t L_n), w_nj = K c_k / t_k at sample j's node."""
    model = tiny_model()
    objective = make("gdpo")
    batch = rollout_batch(model)
    masks = draw(objective, model, batch)
    inputs = objective.prepare(batch, masks)
    coef = lp_coefficients(objective, inputs, random_lp(masks, 5))
    N, n_t = masks.num_sequences, masks.n_t
    want = -inputs.advantages[:, None, None] * masks.weight[..., None] * masks.scored / (
        N * n_t * masks.num_counted[:, None, None])
    torch.testing.assert_close(coef, want, rtol=1e-12, atol=1e-15)


def test_first_step_gradient_of_tracerl_reads_each_states_own_tokens():
    """On-policy: d loss / d lp_nji = -A_n / (R |T_nj|) on the tokens state j decoded, 0 on the later tokens it
    holds masked as context (their lp is scored but not read); R the batch's non-empty states."""
    model = tiny_model()
    objective = make("tracerl", shrink=1)
    batch = rollout_batch(model)
    masks = draw(objective, model, batch)
    inputs = objective.prepare(batch, masks)
    coef = lp_coefficients(objective, inputs, random_lp(masks, 5))
    target = masks.targets
    states = (target.sum(-1) > 0).sum()
    want = -inputs.advantages[:, None, None] * target / (states * target.sum(-1, keepdim=True).clamp_min(1))
    torch.testing.assert_close(coef, want, rtol=1e-12, atol=1e-15)
    assert (masks.scored & ~target).any() and (coef[masks.scored & ~target] == 0).all()


def test_tracerl_needs_the_rollouts_decoding_order():
    model = tiny_model()
    batch = rollout_batch(model)
    plain = RolloutBatch(batch.sequences, batch.attention_mask, P, batch.completion_mask, batch.rewards, G)
    objective = make("tracerl")
    assert objective.needs_unmask_step and not make("espo").needs_unmask_step
    with pytest.raises(ValueError, match=r"tracerl replays the rollout's decoding states.*record_unmask_step=True"):
        objective.backward(model, plain, micro_batch=4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="n_t=4 does not apply with sampler='trajectory'"):
        objectives.get("tracerl", n_t=4)


@pytest.mark.parametrize("normalization", ["paper", "token"])
def test_spg_mixture_endpoints_are_its_branches(normalization):
    model = tiny_model()
    batch = rollout_batch(model)
    base = make("spg", normalization=normalization)
    masks = draw(base, model, batch)
    inputs = base.prepare(batch, masks)
    lp = random_lp(masks, 7)
    for omega, bound in ((0.0, "elbo"), (1.0, "eubo")):
        mixed, pure = make("spg", omega=omega, normalization=normalization), make("spg", bound=bound,
                                                                                   normalization=normalization)
        torch.testing.assert_close(mixed.loss(lp, inputs), pure.loss(lp, inputs), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(lp_coefficients(mixed, inputs, lp), lp_coefficients(pure, inputs, lp),
                                   rtol=1e-12, atol=1e-14)


def test_spg_eubo_gradient_is_the_confidence_weighted_form():
    """SPG Proposition 1: d EUBO_n / d lp_nji = w_j p_nji^beta / sum_k w_k p_nki^beta over the samples that mask
    position i, a confidence weighting of the ELBO's per-sample gradient. In the loss it is scaled by -A_n / N."""
    model = tiny_model()
    beta = 1.5
    objective = make("spg", bound="eubo", beta=beta, n_t=6)
    batch = rollout_batch(model, rewards=(0.0, 1.0, 0.0, 1.0))  # A = -0.5, 0.5, -0.5, 0.5
    masks = draw(objective, model, batch)
    inputs = objective.prepare(batch, masks)
    lp = random_lp(masks, 8)
    confidence = torch.where(masks.scored, masks.weight[..., None] * torch.exp(beta * lp), 0.0)
    weights = confidence / confidence.sum(1, keepdim=True).clamp_min(1e-300)
    x = lp.clone().requires_grad_(True)
    (direct,) = torch.autograd.grad(eubo(x, masks, beta).sum(), x)
    torch.testing.assert_close(direct * masks.scored, weights, rtol=1e-12, atol=1e-15)
    coef = lp_coefficients(objective, inputs, lp)
    negative = inputs.advantages < 0
    want = -inputs.advantages[:, None, None] * weights / masks.num_sequences
    torch.testing.assert_close(coef[negative], want[negative], rtol=1e-12, atol=1e-15)


def test_rspo_gradient_equals_the_quadratic_objective_and_weights_are_zero_sum():
    model = tiny_model()
    objective = make("rspo", lam=0.3)
    batch = rollout_batch(model)
    masks = draw(objective, model, batch)
    lp_ref = random_lp(masks, 30)
    inputs = objective.prepare(batch, masks, lp_ref=lp_ref)
    lp = random_lp(masks, 31)
    advantage = inputs.advantages

    def quadratic(x, detach_centre):
        delta = (elbo(x, masks) - elbo(lp_ref, masks)) / masks.num_counted
        centre = delta.mean().detach() if detach_centre else delta.mean()
        return -(advantage * delta).mean() + 0.3 / 2 * ((delta - centre) ** 2).mean()

    coef = lp_coefficients(objective, inputs, lp)
    for detach_centre in (True, False):  # equal with detached centring; also undetached, as sum(A) = 0
        x = lp.clone().requires_grad_(True)
        (want,) = torch.autograd.grad(quadratic(x, detach_centre), x)
        torch.testing.assert_close(coef, want * masks.scored, rtol=1e-10, atol=1e-14)
    weights = objective.weights(lp, inputs)
    assert abs(weights.sum().item()) < 1e-12 and advantage.abs().sum() > 0
    assert (weights != advantage).all()  # the feedback term is active


def test_rspo_gradient_vanishes_at_its_fixed_point():
    """delta_hat = A / lambda: every weight, hence the gradient, is zero (Proposition 4.2)."""
    model = tiny_model()
    objective = make("rspo", lam=1.0)
    batch = rollout_batch(model)
    masks = draw(objective, model, batch)
    advantage = objective.advantages(batch)
    lp = random_lp(masks, 40, low=1.0)
    # E is linear in lp and each sample's weights sum its scored positions to L_n, so shifting the scored lp of
    # sequence n by a_n moves delta_n by exactly a_n.
    lp_ref = torch.where(masks.scored, lp - advantage[:, None, None] / 1.0, 0.0)
    inputs = objective.prepare(batch, masks, lp_ref=lp_ref)
    _, delta_hat = objective.relative_score(lp, inputs)
    torch.testing.assert_close(delta_hat, advantage, rtol=1e-10, atol=1e-12)
    assert lp_coefficients(objective, inputs, lp).abs().max() < 1e-12


def test_clipping_zeroes_the_gradient_outside_the_interval():
    model = tiny_model()
    batch = rollout_batch(model)
    # diffu-GRPO, token level: tokens whose ratio left [1 - eps, 1 + eps] in the advantage's direction get none.
    d1 = make("diffu_grpo", beta=0.0, epsilon=0.2)
    masks = draw(d1, model, batch)
    lp_old = random_lp(masks, 50)
    lp = torch.where(masks.scored, lp_old + 0.5 * torch.randn(masks.scored.shape, dtype=torch.float64,
                                                              generator=torch.Generator().manual_seed(1)), 0.0)
    inputs = d1.prepare(batch, masks, lp_old=lp_old)
    coef = lp_coefficients(d1, inputs, lp)
    ratio, advantage = torch.exp(lp - lp_old), inputs.advantages[:, None, None]
    outside = masks.scored & (((ratio > 1.2) & (advantage > 0)) | ((ratio < 0.8) & (advantage < 0)))
    inside = masks.scored & ~outside & (advantage != 0)
    assert outside.any() and inside.any()
    assert (coef[outside] == 0).all() and (coef[inside] != 0).all()
    # ESPO, sequence level.
    espo = make("espo", beta=0.0, epsilon_low=0.01, epsilon_high=0.01)
    masks = draw(espo, model, batch)
    lp_old = random_lp(masks, 51)
    shifts = torch.tensor([2.0, -2.0, 0.001, -3.0], dtype=torch.float64)[:, None, None]  # per-sequence moves
    lp = torch.where(masks.scored, (lp_old + shifts * 0.1).clamp_max(-1e-3), 0.0)
    inputs = espo.prepare(batch, masks, lp_old=lp_old)
    coef = lp_coefficients(espo, inputs, lp)
    ratio, advantage = espo.ratio(lp, inputs), inputs.advantages
    for n in range(4):
        out = (ratio[n] > 1.01 and advantage[n] > 0) or (ratio[n] < 0.99 and advantage[n] < 0)
        assert (coef[n].abs().sum() == 0) == bool(out or advantage[n] == 0), (n, ratio[n], advantage[n])


# ---------------------------------------------------------------------------------------------------------
# Bad input


def test_zero_std_groups_are_kept_with_zero_advantage():
    model = tiny_model()
    batch = rollout_batch(model, rewards=(1.0, 1.0, 0.0, 1.0))
    for name in NAMES:
        if objectives.get(name).preference_pairs:  # no advantage; a tied pair prefers nothing and is refused
            continue
        objective = make(name)
        advantage = objective.advantages(batch)
        assert torch.isfinite(advantage).all() and (advantage[:2] == 0).all(), name
        out = objective.backward(model, batch, micro_batch=8, generator=torch.Generator().manual_seed(0),
                                 ref_model=perturbed(model))
        assert out.stats["zero_std_fraction"] == 0.5 and all(map(torch.isfinite, map(torch.tensor,
                                                                                      out.stats.values()))), name
        model.zero_grad(set_to_none=True)


def test_bad_input_names_the_value():
    model = tiny_model()
    batch = rollout_batch(model)
    bgpo = make("bgpo")
    masks = draw(bgpo, model, batch)
    with pytest.raises(ValueError, match=r"rewards\[1\] is nan"):
        RolloutBatch(batch.sequences, batch.attention_mask, P, batch.completion_mask,
                     torch.tensor([1.0, float("nan"), 0.0, 0.0]), G)
    with pytest.raises(ValueError, match="group_size=3 does not divide the 4 rollouts"):
        RolloutBatch(batch.sequences, batch.attention_mask, P, batch.completion_mask, batch.rewards, 3)
    with pytest.raises(ValueError, match="masks were drawn with sampler='random_t' but spg uses sampler='block'"):
        make("spg").backward(model, batch, InnerUpdate(masks), micro_batch=2)
    with pytest.raises(ValueError, match="masks hold n_t=4 samples per sequence but bgpo is configured with n_t=8"):
        make("bgpo", n_t=8).backward(model, batch, InnerUpdate(masks), micro_batch=2)
    other = draw(bgpo, model, batch, seed=99)
    with torch.no_grad():
        lp_other = score(model, batch.sequences, other, micro_batch=8, attention_mask=batch.attention_mask)
    with pytest.raises(ValueError, match="lp_old was scored on other masks"):
        bgpo.backward(model, batch, InnerUpdate(masks, lp_old=lp_other), micro_batch=2)
    with torch.no_grad():
        lp_nan = score(model, batch.sequences, masks, micro_batch=8, attention_mask=batch.attention_mask)
    n, j, i = (int(v) for v in (~masks.scored).nonzero()[0])
    lp_nan[n, j, i] = float("nan")  # a NaN where nothing is scored: a scoring bug, not other masks
    with pytest.raises(ValueError, match=rf"lp_old\[{n}, {j}, {i}\] = nan where these masks score nothing .* "
                                         "holds a non-finite value"):
        bgpo.backward(model, batch, InnerUpdate(masks, lp_old=lp_nan), micro_batch=2)
    with pytest.raises(ValueError, match="rspo needs a reference policy"):
        make("rspo").backward(model, batch, micro_batch=2, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="pass generator="):
        bgpo.backward(model, batch, micro_batch=2)
    with pytest.raises(ValueError, match="unknown objective 'grpo'; available: diffu_grpo, wd1"):
        objectives.get("grpo")
    with pytest.raises(ValueError, match="bgpo has no option 'epsilon'"):
        objectives.get("bgpo", epsilon=0.2)
    with pytest.raises(ValueError, match=r"n_t=3 must be even for sampler='complementary'"):
        objectives.get("espo", n_t=3)
    with pytest.raises(TypeError, match="batch must be a dllm_fast.RolloutBatch"):
        bgpo.prepare(batch.sequences, masks)


def test_peft_reference_is_the_model_with_adapters_disabled():
    peft = pytest.importorskip("peft")
    base = tiny_model()
    batch = rollout_batch(base)
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, init_lora_weights=False,
                                                      target_modules=["q_proj", "v_proj"]))
    objective = make("rspo")
    masks = draw(objective, base, batch)
    with torch.no_grad(), model.disable_adapter():
        lp_ref = score(model, batch.sequences, masks, micro_batch=8, attention_mask=batch.attention_mask)
    implicit = objective.backward(model, batch, InnerUpdate(masks), micro_batch=4)
    explicit = objective.backward(model, batch, InnerUpdate(masks), micro_batch=4, lp_ref=lp_ref)
    assert implicit.stats == explicit.stats and implicit.stats["delta_var"] > 0


def test_inputs_hold_the_constants_and_registry_round_trips():
    model = tiny_model()
    batch = rollout_batch(model)
    for name in NAMES:
        objective = objectives.get(name)
        assert objectives.get(name, **vars(objective.config)).config == objective.config
        assert objective.name == name and objective.config.n_t >= 1
    inputs = make("wd1").prepare(batch, draw(make("wd1"), model, batch))
    assert isinstance(inputs, LossInputs) and inputs.lp_old is None
