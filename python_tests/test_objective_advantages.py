"""The advantage options every objective shares (ObjectiveConfig.advantage, scale_rewards, std_epsilon,
population_std): one implementation, each objective's paper's or code's defaults, and every option working on
every objective (none is accepted and ignored)."""

import pytest
import torch

from dllm_fast import objectives
from dllm_fast.contracts import RolloutBatch
from dllm_fast.reference.objectives import advantages as reference_advantages

# Each objective's default advantage: (baseline, scaled by the std, the std's epsilon, unbiased std), from its
# module docstring (the paper's or the official code's choice).
DEFAULTS = {
    "diffu_grpo": ("mean", False, 1e-6, True),         # d1: r - mean, the std logged but never divided by
    "wd1": ("mean", False, 1e-6, True),
    "vrpo_ol": ("mean", True, 1e-6, True),             # BGPO Eq. 18
    "bgpo": ("mean", True, 1e-6, True),                # BGPO Eq. 18
    "spg": ("mean", False, 1e-6, True),
    "espo": ("mean", False, 1e-4, True),               # the paper's mean; its code's 1e-4 when scaled
    "rspo": ("mean", False, 1e-4, True),
    "coupled_grpo": ("leave_one_out", False, 1e-4, True),  # DiffuCoder's code hard-codes leave-one-out
    "gdpo": ("mean", False, 1e-6, True),               # Dr. GRPO
    "tracerl": ("mean", True, 0.0, False),             # z-score with the population std
    "ebpo": ("mean", True, 1e-6, True),                # DARE's GRPO z-score
    "justgrpo": ("mean", True, 1e-4, True),            # the official (r - mean) / (std + 1e-4)
    "vrpo_dpo": ("mean", False, 1e-6, True),           # none enters its loss (pairs): the options are refused
    # -- CJ-GRPO --
    "cj_grpo": ("mean", False, 1e-6, True),            # the official r - group mean, no std
}
# mdpo's advantage is its own, per denoising step over the group, computed on the whole step record before the
# steps are selected (objectives.mdpo.step_advantages, tested in test_mdpo.py); the shared options are refused.
# d_treerpo's is a tree's sibling advantage, carried by its TreeBatch (rollout/tree.py, test_tree_rollout.py).
OWN_ADVANTAGE = {"mdpo", "d_treerpo"}
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.5, 2.0, 2.0, 2.0, 2.0, 0.25, 3.0, -1.0, 0.0])


def batch_of(rewards, group_size=4):
    N = rewards.shape[0]
    return RolloutBatch(torch.zeros(N, 3, dtype=torch.long), None, 0, torch.ones(N, 3, dtype=torch.bool), rewards,
                        group_size)


def expected(baseline, scaled, epsilon, unbiased):
    return torch.tensor(reference_advantages(REWARDS.tolist(), 4, baseline=baseline,
                                             scale="std" if scaled else "none", std_epsilon=epsilon,
                                             unbiased=unbiased), dtype=torch.float64)


def test_every_objective_is_listed():
    assert set(DEFAULTS) | OWN_ADVANTAGE == set(objectives.available())


@pytest.mark.parametrize("name", DEFAULTS)
def test_default_advantages_are_each_papers(name):
    objective = objectives.get(name)
    c = objective.config
    assert (c.advantage, c.scale_rewards, c.std_epsilon, not c.population_std) == DEFAULTS[name]
    torch.testing.assert_close(objective.advantages(batch_of(REWARDS)), expected(*DEFAULTS[name]),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", DEFAULTS)
@pytest.mark.parametrize("baseline, scaled, epsilon, population", [
    ("leave_one_out", False, 1e-6, False), ("mean", True, 1e-3, False), ("leave_one_out", True, 0.0, True),
])
def test_advantage_options_apply_to_every_objective(name, baseline, scaled, epsilon, population):
    options = dict(advantage=baseline, scale_rewards=scaled, std_epsilon=epsilon, population_std=population)
    if objectives.get(name).preference_pairs:  # no advantage enters a preference loss: refused, never ignored
        with pytest.raises(ValueError, match="has no advantage"):
            objectives.get(name, **options)
        return
    objective = objectives.get(name, **options)
    torch.testing.assert_close(objective.advantages(batch_of(REWARDS)),
                               expected(baseline, scaled, epsilon, not population), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("option, value", [("advantage", "median"), ("scale_rewards", "yes"),
                                           ("std_epsilon", -1.0), ("population_std", 1)])
def test_bad_advantage_options_are_refused_by_name(option, value):
    with pytest.raises((ValueError, TypeError), match=option):
        objectives.get("wd1", **{option: value})


def test_one_advantages_implementation():
    """No objective re-implements the shared advantage: they differ only in their configs' defaults."""
    from dllm_fast.objectives.base import Objective

    for name in set(objectives.available()) - OWN_ADVANTAGE:
        assert type(objectives.get(name)).advantages is Objective.advantages, name
