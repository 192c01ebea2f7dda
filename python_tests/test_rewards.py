"""Rewards (issue 17, item 9): what a reward function may return, the same for the native trainer and the TRL
adapter; advantages that stay exact for huge finite rewards."""

import json
import math

import numpy as np
import pytest
import torch

from dllm_fast import objectives
from dllm_fast.contracts import RolloutBatch
from dllm_fast.objectives.advantages import group_advantages
from dllm_fast.tasks import register_task
from dllm_fast.tasks.rewards import MAX_ABS_REWARD, reward_value
from dllm_fast.tasks.sudoku4 import Sudoku4
from dllm_fast.train import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")

REWARDS = torch.tensor([0.0, 1.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 3.0, -1.0, 0.5, 7.0], dtype=torch.float64)


# -- what a reward is -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [
    (1, 1.0), (0.25, 0.25), (True, 1.0), (np.float32(0.5), 0.5), (np.int64(3), 3.0), (np.array(2.5), 2.5),
    (torch.tensor(0.75), 0.75), (torch.tensor(4, dtype=torch.int32), 4.0), (-MAX_ABS_REWARD, -MAX_ABS_REWARD),
])
def test_numbers_and_numpy_or_torch_scalars_are_rewards(value, expected):
    result = reward_value(value, "reward function 'f'")
    assert type(result) is float and result == expected
    json.dumps(result)  # what metrics.jsonl writes


@pytest.mark.parametrize("value, error, message", [
    ("1.0", TypeError, r"reward function 'f' returned '1.0' \(a str\); a reward is one real number"),
    (None, TypeError, r"reward function 'f' returned None \(a NoneType\)"),
    ([1.0], TypeError, r"reward function 'f' returned \[1.0\] \(a list\)"),
    (torch.ones(2), TypeError, r"returned tensor\(\[1., 1.\]\) \(a Tensor\)"),
    (1 + 2j, TypeError, r"\(a complex\)"),
    (math.nan, ValueError, r"reward function 'f' returned nan; a reward must be finite"),
    (-math.inf, ValueError, r"returned -inf; a reward must be finite"),
    (1e30, ValueError, r"returned 1e\+30, beyond the reward range \[-2\^24, 2\^24\]"),
])
def test_anything_else_is_refused_naming_the_function(value, error, message):
    with pytest.raises(error, match=message):
        reward_value(value, "reward function 'f'")


# -- advantages of huge finite rewards --------------------------------------------------------------------------

def test_ordinary_rewards_give_the_textbook_advantages_bit_for_bit():
    """The scaled computation changes nothing where the plain one is exact (the trainer's runs stay identical)."""
    grouped = REWARDS.view(3, 4)
    centred = grouped - grouped.mean(-1, keepdim=True)
    assert torch.equal(group_advantages(REWARDS, 4), centred.reshape(-1))
    assert torch.equal(group_advantages(REWARDS, 4, baseline="leave_one_out"), (centred * (4 / 3)).reshape(-1))
    std = grouped.std(-1, keepdim=True)
    assert torch.equal(group_advantages(REWARDS, 4, scale="std"), (centred / (std + 1e-6)).reshape(-1))
    assert torch.equal(group_advantages(REWARDS.float(), 4, scale="std", std_epsilon=1e-4),
                       (centred / (std + 1e-4)).reshape(-1))


@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
@pytest.mark.parametrize("power", [-900, -20, 20, 500, 990])
def test_std_scaled_advantages_do_not_depend_on_the_rewards_scale(baseline, power):
    """c / std is scale-free, bit for bit under a power-of-two scale; the std of rewards near 1e300 used to
    overflow to inf and zero every advantage."""
    unscaled = group_advantages(REWARDS, 4, baseline=baseline, scale="std", std_epsilon=0.0)
    scaled = group_advantages(REWARDS * 2.0**power, 4, baseline=baseline, scale="std", std_epsilon=0.0)
    assert torch.equal(scaled, unscaled)
    mean_baseline = group_advantages(REWARDS * 2.0**power, 4, baseline=baseline)
    assert torch.equal(mean_baseline, group_advantages(REWARDS, 4, baseline=baseline) * 2.0**power)


def test_an_epsilon_keeps_its_meaning_in_reward_units():
    for scale in (1.0, 1e-3, 1e300):
        expected = REWARDS.view(3, 4) - REWARDS.view(3, 4).mean(-1, keepdim=True)
        expected = expected / (REWARDS.view(3, 4).std(-1, keepdim=True) + 1e-6 / scale)
        torch.testing.assert_close(group_advantages(REWARDS * scale, 4, scale="std", std_epsilon=1e-6),
                                   expected.reshape(-1), rtol=1e-12, atol=0)


def test_a_rollout_batch_refuses_rewards_beyond_the_bound_for_every_objective():
    """vrpo_ol and bgpo learned from rewards near 1e300 (their advantages are scale-free) while six other
    objectives overflowed: RolloutBatch now refuses them for all (issue 32; test_contracts checks every objective
    at the bound)."""
    with pytest.raises(ValueError, match=r"rewards\[1\] is 1e\+300 .*beyond the reward range"):
        RolloutBatch(sequences=torch.zeros(12, 3, dtype=torch.long), attention_mask=None, prompt_length=1,
                     completion_mask=torch.ones(12, 2, dtype=torch.bool), rewards=REWARDS * 1e300, group_size=4)


# -- the native trainer ------------------------------------------------------------------------------------------

class ReturnsAs(Sudoku4):
    """sudoku4 whose reward is passed through `convert` (a NumPy scalar, a string, a huge number ...)."""

    convert = staticmethod(float)

    def reward(self, example, completion):
        return self.convert(super().reward(example, completion))


def train_with_reward(tmp_path, monkeypatch, convert):
    from dllm_fast.assets import SUDOKU4_TASK_OPTIONS
    from dllm_fast.tasks import base

    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))  # registered for this test only
    task = type("Custom", (ReturnsAs,), {"name": "custom_sudoku4", "convert": staticmethod(convert)})
    register_task("custom_sudoku4", lambda **options: task(**options))
    return train(TrainConfig(task="custom_sudoku4", task_options=SUDOKU4_TASK_OPTIONS, steps=1, prompts_per_step=2,
                             group_size=4, eval_every=1, eval_examples=4, progress=False, plot=False, threads=1,
                             output_dir=str(tmp_path / "run")))


@pytest.mark.slow  # a training run per reward type, about 10 s on 2 cores
def test_the_trainer_takes_numpy_and_torch_scalar_rewards(tmp_path, monkeypatch):
    result = train_with_reward(tmp_path, monkeypatch, lambda r: np.float32(r) if r < 0.5 else torch.tensor(r))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1] and result.steps == 1
    assert all(isinstance(row["eval_reward@24"], float) for row in rows)


@pytest.mark.parametrize("convert, error, message", [
    (str, TypeError, r"task 'custom_sudoku4''s reward returned '0.\d+' \(a str\).* for example 0 \("),
    *[pytest.param(*case, marks=pytest.mark.slow) for case in [  # a training run each
        (lambda r: None, TypeError, r"task 'custom_sudoku4''s reward returned None"),
        (lambda r: [r], TypeError, r"returned \[0.\d+\] \(a list\)"),
        (lambda r: 1e30 * (r + 1), ValueError, r"beyond the reward range \[-2\^24, 2\^24\]")]],
])
def test_the_trainer_refuses_other_rewards_naming_the_task(tmp_path, monkeypatch, convert, error, message):
    with pytest.raises(error, match=message):
        train_with_reward(tmp_path, monkeypatch, convert)


# -- TRL behaves alike -------------------------------------------------------------------------------------------

def test_trl_reward_functions_are_checked_as_the_trainer_checks_a_task():
    pytest.importorskip("trl")
    from dllm_fast.integrations.trl import checked_reward_function

    def scores(completions, **kwargs):
        return [np.float32(0.5), torch.tensor(1.0), None, 2]

    checked = checked_reward_function(scores)
    assert checked.__name__ == "scores"  # TRL logs rewards under the function's name
    assert checked(completions=["a"] * 4) == [0.5, 1.0, None, 2.0]
    for returned, error, message in (
            (["0.5"], TypeError, r"reward function 'broken' for completion 0 returned '0.5' \(a str\)"),
            ([[0.5]], TypeError, r"reward function 'broken' for completion 0 returned \[0.5\] \(a list\)"),
            ([0.0, 1e30], ValueError, r"reward function 'broken' for completion 1 returned 1e\+30, beyond the "
                                      r"reward range \[-2\^24, 2\^24\]"),
            ("0.5", TypeError, r"reward function 'broken' returned a str; it must return a list of rewards")):
        def broken(completions, returned=returned, **kwargs):
            return returned

        with pytest.raises(error, match=message):
            checked_reward_function(broken)(completions=["a"])


def test_trl_refuses_a_huge_reward_as_the_native_trainer_does(tmp_path):
    """Through TRL, 1e30 rewards used to zero the update silently (its clipping of an overflowing norm)."""
    pytest.importorskip("trl")
    from dllm_fast.integrations import trl_example

    def huge(completions, **kwargs):
        return [1e30 * (i + 1) for i in range(len(completions))]

    trainer = trl_example.build_trainer(str(tmp_path), objective="espo", steps=1, reward_funcs=[huge])
    with pytest.raises(ValueError, match=r"reward function 'huge' for completion 0 returned 1e\+30, beyond the reward "
                                         r"range \[-2\^24, 2\^24\]"):
        trainer.train()


def test_trl_names_every_function_when_none_scores_a_completion(tmp_path):
    pytest.importorskip("trl")
    from dllm_fast.integrations import trl_example

    def first(completions, **kwargs):
        return [None] + [1.0] * (len(completions) - 1)

    def second(completions, **kwargs):
        return [None] * len(completions)

    trainer = trl_example.build_trainer(str(tmp_path), steps=1, reward_funcs=[first, second])
    with pytest.raises(ValueError, match=r"every reward function \('first', 'second'\) returned None for completion "
                                         r"0 \(prompt group 0\)"):
        trainer.train()
