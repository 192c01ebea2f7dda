"""MaskSpec (the mask settings as one object), the sampler registry's n_t rules, and the objectives' configs that
embed a MaskSpec: valid n_t by arithmetic agrees with building and catching, every parity rule is the papers'."""

import dataclasses

import pytest
import torch

from dllm_fast import objectives
from dllm_fast.likelihood import SAMPLERS, MaskSpec, register_sampler, sample_masks
from dllm_fast.likelihood.samplers import Drawn, NTRule

pytestmark = pytest.mark.usefixtures("one_thread")


def build_and_catch(name, n_t, *, down, limit, **options):
    """What nearest_valid_n_t did before it was arithmetic: build the objective at each candidate n_t, in order,
    and return the first one whose config raises no ValueError."""
    step = -1 if down else 1
    for candidate in range(max(1, n_t), 0 if down else limit + 1, step):
        try:
            objectives.get(name, **{**options, "n_t": candidate})
        except ValueError:
            continue
        return candidate
    return None


def option_grid():
    """Per objective: its defaults, a preset, and every sampler (gauss with several node counts)."""
    for name in objectives.available():
        yield name, {}
        for preset in objectives.presets(name):
            yield name, {"preset": preset}
        for sampler in SAMPLERS:
            if sampler == "gauss":
                for points in (None, 1, 2, 3, 5):
                    yield name, {"sampler": sampler, "quadrature_points": points}
            else:
                yield name, {"sampler": sampler, "count": "all"}


@pytest.mark.parametrize("name, options", list(option_grid()), ids=lambda v: str(v))
def test_nearest_valid_n_t_is_arithmetic_that_agrees_with_building(name, options, monkeypatch):
    limit = 23
    expected = {(n_t, down): build_and_catch(name, n_t, down=down, limit=limit, **options)
                for n_t in range(0, 20) for down in (False, True)}
    built = []
    monkeypatch.setattr(type(objectives.get(name)), "__init__",
                        lambda *a, **k: built.append(1) or pytest.fail("nearest_valid_n_t built an objective"))
    for (n_t, down), want in expected.items():
        assert objectives.nearest_valid_n_t(name, n_t, down=down, limit=limit, **options) == want, (n_t, down)
    assert not built


def papers_rule(sampler, quadrature_points, n_t):
    """The samplers' n_t rules as the papers state them, written independently of the registry."""
    if sampler == "complementary":  # ESPO / DiffuCoder: a mask and its complement
        return n_t % 2 == 0
    if sampler == "coupled":  # DiffuCoder: the full mask plus lambda complementary pairs, 1 + 2 lambda
        return n_t % 2 == 1
    if sampler == "gauss":  # GDPO: n_t / K draws at each of K Gauss nodes (K = n_t by default)
        return quadrature_points is None or n_t % quadrature_points == 0
    if sampler == "trajectory":  # TraceRL: the samples are the rollout's states; n_t stays 1
        return n_t == 1
    if sampler == "autoregressive":  # JustGRPO: a sample per completion position; n_t stays 1
        return n_t == 1
    if sampler == "recorded_state":  # MDPO: each row is one recorded decoding state
        return n_t == 1
    if sampler == "tree_edge":  # d-TreeRPO: each tree edge scored once, on its parent's canvas
        return n_t == 1
    return True


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("points", [None, 2, 3])
def test_each_samplers_rule_is_its_papers(sampler, points):
    for n_t in range(1, 25):
        spec = MaskSpec(n_t=n_t, sampler=sampler, quadrature_points=points)
        if papers_rule(sampler, points, n_t):
            assert spec.validate() is spec
        else:
            with pytest.raises(ValueError, match=f"n_t={n_t}"):
                spec.validate()


def test_valid_n_t_by_hand():
    assert MaskSpec(sampler="complementary").valid_n_t(5) == 6
    assert MaskSpec(sampler="complementary").valid_n_t(5, down=True) == 4
    assert MaskSpec(sampler="complementary").valid_n_t(1, down=True) is None
    assert MaskSpec(sampler="coupled").valid_n_t(4) == 5
    assert MaskSpec(sampler="gauss", quadrature_points=3).valid_n_t(7) == 9
    assert MaskSpec(sampler="gauss", quadrature_points=3).valid_n_t(8, limit=8) is None
    assert MaskSpec(sampler="trajectory").valid_n_t(4) is None
    assert MaskSpec(sampler="trajectory").valid_n_t(4, down=True) == 1
    assert MaskSpec(n_t=7).valid_n_t() == 7
    with pytest.raises(ValueError, match="sampler='uniform' is not one of"):
        MaskSpec(sampler="uniform").valid_n_t(2)


@pytest.mark.parametrize("changes, message", [
    (dict(n_t=0), "n_t=0 must be an int >= 1"),
    (dict(count="first"), "count='first' is not one of"),
    (dict(block_length=0), "block_length=0 must be an int >= 1"),
    (dict(perturb_prob=-0.1), r"perturb_prob=-0.1 must be in \[0.0, 1.0\] \(a probability"),
    (dict(shrink=0), "shrink=0 must be an int >= 1"),
    (dict(quadrature_points=0, sampler="gauss"), "quadrature_points=0 must be an int >= 1"),
    (dict(coupled_t_min=0.9), "coupled_t_min=0.9, coupled_t_max=0.8 must satisfy"),
])
def test_validate_names_the_setting(changes, message):
    with pytest.raises(ValueError, match=message):
        MaskSpec(**changes).validate()


def test_sample_masks_takes_a_spec_or_its_keywords_alike():
    sequences = torch.randint(0, 50, (3, 14), generator=torch.Generator().manual_seed(0))
    spec = MaskSpec(n_t=3, sampler="coupled", count="all", coupled_t_min=0.3, coupled_t_max=0.6)
    by_spec = sample_masks(sequences, spec, prompt_length=4, generator=torch.Generator().manual_seed(1))
    by_keywords = sample_masks(sequences, prompt_length=4, generator=torch.Generator().manual_seed(1), n_t=3,
                               sampler="coupled", count="all", t_range=(0.3, 0.6))
    assert torch.equal(by_spec.masked, by_keywords.masked) and torch.equal(by_spec.weight, by_keywords.weight)
    with pytest.raises(TypeError, match="not both"):
        sample_masks(sequences, spec, prompt_length=4, generator=torch.Generator(), n_t=3)
    with pytest.raises(TypeError, match="unknown mask setting 'nt'"):
        sample_masks(sequences, prompt_length=4, generator=torch.Generator(), sampler="coupled", n_t=3, nt=3)


def test_a_registered_sampler_works_everywhere():
    """A new sampler with its own n_t rule: validated, searched, drawn, and usable by any objective."""
    def every_third(uniform, canvas, spec):
        N, L = canvas.counted.shape
        chosen = canvas.expanded(spec.n_t).clone()
        chosen[..., 1::3] = False
        chosen &= canvas.counted[:, None, :]
        weight = torch.ones(N, spec.n_t, dtype=torch.float64)
        return Drawn(chosen, weight, torch.ones_like(weight))

    register_sampler("test_every_third", every_third, n_t_rule=lambda spec: NTRule(step=3, message="n_t={n_t} x"))
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_sampler("test_every_third", every_third)
        assert MaskSpec(sampler="test_every_third").valid_n_t(4) == 6
        assert objectives.nearest_valid_n_t("rspo", 4, sampler="test_every_third") == 6
        with pytest.raises(ValueError, match="n_t=4 x"):
            objectives.get("rspo", sampler="test_every_third", n_t=4)
        sequences = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
        masks = sample_masks(sequences, MaskSpec(n_t=3, sampler="test_every_third", count="all"), prompt_length=3,
                             generator=torch.Generator())
        assert masks.sampler == "test_every_third" and not masks.masked[:, :, 3 + 1].any()
        assert masks.masked[:, :, 3].all()
    finally:
        SAMPLERS.pop("test_every_third")


def test_objective_configs_embed_a_mask_spec():
    objective = objectives.get("vrpo_ol", n_t=8, sampler="stratified_l", scale_rewards=False)
    assert objective.config.masks == MaskSpec(n_t=8, sampler="stratified_l")
    assert (objective.config.n_t, objective.config.sampler) == (8, "stratified_l")  # read through
    given = MaskSpec(n_t=2, sampler="complementary", count="all")
    assert objectives.get("espo", masks=given).config.masks == given
    assert objectives.get("espo", masks=given, n_t=6).config.masks == dataclasses.replace(given, n_t=6)
    assert objectives.get("spg", preset="sudoku").config.masks == objectives.get("spg").config.masks
    with pytest.raises(ValueError, match="n_t=3 must be even for sampler='complementary'"):
        objectives.get("espo", n_t=3)
    with pytest.raises(ValueError, match="espo has no option 'nt'"):
        objectives.get("espo", nt=3)
    with pytest.raises(TypeError, match="masks must be a MaskSpec"):
        objectives.get("espo", masks={"n_t": 2})
    assert objectives.nearest_valid_n_t("vrpo_ol", 3, masks=MaskSpec(sampler="complementary")) == 4
    with pytest.raises(TypeError, match="masks must be a MaskSpec"):
        objectives.nearest_valid_n_t("vrpo_ol", 3, masks={"sampler": "complementary"})
    with pytest.raises(ValueError, match="vrpo_ol has no option 'nt'"):
        objectives.nearest_valid_n_t("vrpo_ol", 3, nt=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        objective.config.masks.n_t = 3  # one object that travels: changed only through with_options
    assert objective.config.with_options(n_t=2).masks.n_t == 2 and objective.config.n_t == 8


def test_trainer_objective_options_set_mask_settings():
    from dllm_fast.train.config import TrainConfig

    config = TrainConfig(objective="bgpo", objective_options={"n_t": 16, "sampler": "stratified_l"})
    built = objectives.get(config.objective.name, **config.objective.options)
    assert built.config.masks == MaskSpec(n_t=16, sampler="stratified_l")


# -- issue 40: n_t and the settings are what their names say, or refused by name ------------------------------------

NOT_INTEGERS = [2.5, float("nan"), float("inf"), True, False, "3", None.__class__, [3], 3.0]


@pytest.mark.parametrize("sampler", sorted(set(SAMPLERS) - {"trajectory"}) + ["trajectory"])
@pytest.mark.parametrize("n_t", NOT_INTEGERS, ids=repr)
def test_valid_n_t_refuses_what_is_not_an_integer(sampler, n_t):
    """Issue 40 item 3: valid_n_t(2.5) gave 3, NaN 1, True 1 (54 cases over 9 samplers); item 11: a string said
    "'>' not supported between 'str' and 'int'"."""
    spec = MaskSpec(sampler=sampler, n_t=1)
    with pytest.raises(TypeError, match=r"n_t=.* must be an int"):
        spec.valid_n_t(n_t)
    with pytest.raises(TypeError, match=r"n_t=.* must be an int"):
        spec.valid_n_t(n_t, down=True)


@pytest.mark.parametrize("name", ["espo", "vrpo_ol", "coupled_grpo", "gdpo", "tracerl"])
@pytest.mark.parametrize("n_t", [2.5, float("nan"), True, "3"], ids=repr)
def test_nearest_valid_n_t_refuses_what_is_not_an_integer(name, n_t):
    with pytest.raises(TypeError, match=r"n_t=.* must be an int"):
        objectives.nearest_valid_n_t(name, n_t)


def test_the_search_bounds_are_checked_too():
    spec = MaskSpec(sampler="complementary", n_t=2)
    assert spec.valid_n_t(3) == 4 and spec.valid_n_t(3, down=True) == 2 and spec.valid_n_t(-5) == 2
    with pytest.raises(TypeError, match=r"down='yes' must be True or False"):
        spec.valid_n_t(3, down="yes")
    with pytest.raises(ValueError, match=r"limit=0 must be an int >= 1"):
        spec.valid_n_t(3, limit=0)
    with pytest.raises(TypeError, match=r"limit=2.5 must be an int"):
        objectives.nearest_valid_n_t("espo", 3, limit=2.5)


@pytest.mark.parametrize("changes, message", [
    (dict(perturb_prob=True), r"perturb_prob=True must be a finite number in \[0.0, 1.0\] \(a probability"),
    (dict(perturb_prob=False), r"perturb_prob=False must be a finite number"),
    (dict(perturb_prob="0.15"), r"perturb_prob='0.15' must be a finite number"),
    (dict(perturb_prob=float("nan")), r"perturb_prob=nan must be a finite number"),
    (dict(block_length=True), r"block_length=True must be an int >= 1"),
    (dict(block_length=4.0), r"block_length=4.0 must be an int >= 1"),
    (dict(coupled_t_min=True), r"coupled_t_min=True must be a finite number"),
])
def test_mask_settings_of_the_wrong_kind_are_refused_by_name(changes, message):
    with pytest.raises((TypeError, ValueError), match=message):
        MaskSpec(sampler="mean_field", **changes).validate()
    with pytest.raises((TypeError, ValueError), match=message):
        MaskSpec(sampler="mean_field", **changes).valid_n_t(2)


@pytest.mark.parametrize("t_range", [(0.1, 0.5, 0.9), (0.5,), 0.5, "ab", {"low": 0.2, "high": 0.8}, None],
                         ids=repr)
def test_t_range_must_be_two_rates(t_range):
    """Issue 40 item 11: t_range=(a, b, c) said "too many values to unpack"."""
    with pytest.raises(ValueError, match=r"t_range=.* must be two masking rates \(low, high\), e\.g\. "
                                         r"t_range=\(0\.2, 0\.8\)"):
        MaskSpec.of(sampler="coupled", n_t=3, t_range=t_range)
    assert MaskSpec.of(sampler="coupled", n_t=3, t_range=[0.3, 0.7]).t_range == (0.3, 0.7)
