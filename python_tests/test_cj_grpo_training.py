"""CJ-GRPO in the trainer, the planner and TRL's adapter: `train --objective cj_grpo` on the embedded default with
its paper's decoders (--unmask-schedule ass --eos-schedule 0.01 1.0) without NaN, a mismatched --diffusion-steps
refused before any work, `plan` pricing the ASS rollout's own step count, and TRL's loop on eoser-ass rollouts."""

import math
import os

import pytest
import torch

from dllm_fast import objectives
from dllm_fast.train import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")

QUICK = dict(steps=1, prompts_per_step=2, group_size=2, eval_every=10, checkpoint_every=10, eval_examples=2,
             progress=False, plot=False, threads=1, task_options={"num_train": 64, "num_test": 8})
EOSER_ASS = dict(unmask_schedule="ass", diffusion_steps=None, eos_schedule=[0.01, 1.0])


def quick(tmp_path, **overrides):
    return TrainConfig(**{**QUICK, "output_dir": str(tmp_path / "run"), "objective": "cj_grpo", **overrides})


@pytest.mark.slow
def test_cj_grpo_trains_the_embedded_default_on_eoser_ass_rollouts(tmp_path):
    """24 tokens in one block: ASS's floor(log2 24) = 4 steps, each a state; two inner updates (the second off the
    rollout's policy, with lp_old): finite rows and a gradient."""
    result = train(quick(tmp_path, inner_updates=2, **EOSER_ASS))
    rows = [row for row in result.history if "loss" in row]
    assert rows and all(math.isfinite(v) for row in rows for v in row.values() if isinstance(v, float))
    assert rows[-1]["grad_norm"] > 0 and rows[-1]["states_per_sequence"] == 4


def test_a_diffusion_step_count_ass_cannot_take_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match=r"--diffusion-steps 12 does not fit --unmask-schedule ass.*"
                                         r"--diffusion-steps 4 or none"):
        quick(tmp_path, unmask_schedule="ass")
    with pytest.raises(ValueError, match="--unmask-schedule 'doubling' is not one of"):
        quick(tmp_path, unmask_schedule="doubling")
    with pytest.raises(ValueError, match="--eos-schedule takes two factors"):
        quick(tmp_path, eos_schedule=[0.5])
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_plan_prices_the_ass_rollouts_steps_as_states(tmp_path):
    from dllm_fast.planning import plan_step

    config = quick(tmp_path, micro_batch=8, inner_updates=2, **EOSER_ASS)
    plan = plan_step(config, gpu="h100", prompt_length=31, search=False)
    assert config.rollout.decoding_steps() == 4
    assert plan.phases["rollout"].runs == 1 and plan.phases["inner update"].runs == 2
    assert plan.phases["reference scoring"].runs == 2 and plan.phases["old-policy scoring"].runs == 1


@pytest.mark.slow
def test_trl_trains_cj_grpo_on_eoser_ass_rollouts(tmp_path):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from trl import GRPOConfig

    from dllm_fast.integrations import trl_example
    from dllm_fast.integrations.trl import DiffusionGRPOTrainer, make_rollout_func
    from dllm_fast.models import LLaDAConfig, LLaDAModel

    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, num_generations=4, per_device_train_batch_size=8,
                      gradient_accumulation_steps=1, max_completion_length=8, learning_rate=1e-3, temperature=1.0,
                      logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=0,
                      dataloader_num_workers=0)
    dataset = Dataset.from_list([{"prompt": p} for p in ["a1 b70 a5", "b99 b64", "a10 a11 a12 b100", "b80"]])
    torch.manual_seed(0)
    run = DiffusionGRPOTrainer(model=LLaDAModel(LLaDAConfig.preset("tiny")), reward_funcs=[trl_example.a_words_reward],
                               args=args, train_dataset=dataset, processing_class=trl_example.build_tokenizer(),
                               objective=objectives.get("cj_grpo", beta=0.0),
                               rollout_func=make_rollout_func(block_length=8, unmask_schedule="ass",
                                                              eos_schedule=(0.01, 1.0)))
    run.train()
    rows = [row for row in run.state.log_history if "loss" in row]
    assert len(rows) == 1 and math.isfinite(rows[0]["loss"])
    assert rows[0]["objective/states_per_sequence"] == 3  # 8 tokens: 1, 2, 5
    assert run._unmask_step is not None
