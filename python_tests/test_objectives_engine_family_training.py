"""EBPO, JustGRPO and offline VRPO in the trainer, the planner, TRL's adapter and the training benchmark: `train`
runs JustGRPO and VRPO on the LLaDA embedded default without NaN (EBPO on sdar-tiny: test_block_training's every
objective, and on the SDAR sudoku4 model: test_embedded_sdar_model), refuses what cannot work before any work (EBPO on a bidirectional model, JustGRPO without
left-to-right rollouts, VRPO without pairs, VRPO through TRL), and reads preference pairs from JSONL."""

import json
import math
import os

import pytest
import torch

from dllm_fast import objectives
from dllm_fast.tasks import get_task
from dllm_fast.train import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")

QUICK = dict(steps=1, prompts_per_step=2, group_size=2, eval_every=10, checkpoint_every=10, eval_examples=2,
             progress=False, plot=False, threads=1, task_options={"num_train": 64, "num_test": 8})


def quick(tmp_path, **overrides):
    return TrainConfig(**{**QUICK, "output_dir": str(tmp_path / "run"), **overrides})


def finite(row):
    return all(math.isfinite(v) for v in row.values() if isinstance(v, float))


@pytest.mark.slow
def test_justgrpo_and_vrpo_train_the_embedded_default(tmp_path):
    """JustGRPO left to right (block 1, a step a token), offline VRPO on sudoku4_pairs for two inner updates: finite
    rows and gradients; VRPO's first update is at the reference (score 0, loss log 2)."""
    result = train(quick(tmp_path / "j", objective="justgrpo", block_length=1, diffusion_steps=24, group_size=4))
    row = result.history[-1]
    assert finite(row) and row["grad_norm"] > 0 and row["log_likelihood_mean"] < 0
    result = train(quick(tmp_path / "v", objective="vrpo_dpo", task="sudoku4_pairs", inner_updates=2))
    rows = [r for r in result.history if "loss" in r]
    assert finite(rows[-1]) and rows[-1]["grad_norm"] > 0 and rows[-1]["rollout_tokens_per_s"] == 0
    assert rows[-1]["reward_mean"] == 0.5  # the pairs' own rewards: 1 chosen, 0 rejected


def test_what_cannot_work_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="ebpo estimates a block-diffusion model's composite ELBO.*sdar-sudoku4"):
        train(quick(tmp_path, objective="ebpo"))
    with pytest.raises(ValueError, match="--block-length 1 --diffusion-steps 24"):
        train(quick(tmp_path, objective="justgrpo"))
    with pytest.raises(ValueError, match="--objective vrpo_dpo trains on preference pairs.*--task sudoku4_pairs"):
        train(quick(tmp_path, objective="vrpo_dpo"))
    assert not (tmp_path / "run").exists()


def test_sudoku4_pairs_pair_each_puzzle_with_its_solution_and_a_wrong_grid():
    task = get_task("sudoku4_pairs", num_train=200)
    examples = task.train_examples(seed=3)
    assert examples == task.train_examples(seed=3)
    for example in examples:
        chosen, rejected = task.pair(example)
        assert task.correct(example, chosen) and not task.correct(example, rejected)
        digits = "".join(c for c in rejected if c.isdigit())
        assert all(p == "0" or p == d for p, d in zip(example.data["puzzle"], digits))  # the givens kept
    assert task.test_examples()[0].question == get_task("sudoku4", prompt_style="grid").test_examples()[0].question
    with pytest.raises(ValueError, match="prompt_style='d1'"):
        get_task("sudoku4_pairs", prompt_style="d1")


@pytest.mark.slow
def test_pairs_read_from_jsonl_train(tmp_path):
    """The documented format: {"prompt", "chosen", "rejected"} a line; a bad line names its file and line; a
    completion too long for --gen-length names the pair and the fix."""
    lines = [{"prompt": "1200\n0000\n0000\n0001", "chosen": "<answer>1234</answer>", "rejected": "<answer>4321</answer>"},
             {"prompt": "0034\n0000\n0000\n4000", "chosen": "<answer>1234</answer>", "rejected": "<answer>1111</answer>"}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    options = {"train_path": str(path), "test_path": str(path)}
    task = get_task("pairs_jsonl", **options)
    assert task.pair(task.test_examples()[0]) == ("<answer>1234</answer>", "<answer>4321</answer>")
    assert task.reward(task.test_examples()[0], " <answer>1234</answer>") == 1.0
    config = dict(QUICK, objective="vrpo_dpo", task="pairs_jsonl", task_options=options)
    result = train(TrainConfig(**config, output_dir=str(tmp_path / "run")))
    assert finite(result.history[-1])
    with pytest.raises(ValueError, match=r"at least 8 \(the chosen completion of .*pairs.jsonl:\d\); .*raise --gen-length"):
        train(TrainConfig(**{**config, "gen_length": 6, "block_length": 6, "diffusion_steps": 6,
                             "eval_gen_lengths": [6]}, output_dir=str(tmp_path / "short")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "chosen": "y"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1 lacks the field 'rejected'"):
        get_task("pairs_jsonl", train_path=str(bad)).train_examples()


@pytest.mark.slow
def test_plan_prices_offline_vrpo_without_a_rollout(tmp_path):
    from dllm_fast.planning import plan_step

    plan = plan_step(TrainConfig(objective="vrpo_dpo", task="sudoku4_pairs", prompts_per_step=2, micro_batch=8,
                                 output_dir=str(tmp_path / "p")), gpu="h100", prompt_length=31, search=False)
    assert plan.phases["rollout"].runs == 0 and plan.phases["inner update"].runs == 1
    assert plan.phases["reference scoring"].runs == 1


@pytest.mark.slow
def test_trl_trains_justgrpo_and_ebpo_and_refuses_what_it_cannot(tmp_path):
    """JustGRPO with left-to-right rollouts on the tiny LLaDA model and EBPO on sdar-tiny through TRL's loop: finite
    losses. Refused at construction: vrpo_dpo (no rollout), EBPO on a bidirectional model, JustGRPO with block-4
    rollouts."""
    pytest.importorskip("trl")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from trl import GRPOConfig

    from dllm_fast.integrations import trl_example
    from dllm_fast.integrations.trl import DiffusionGRPOTrainer, make_rollout_func
    from dllm_fast.models import LLaDAConfig, LLaDAModel, SDARConfig, SDARModel

    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, num_generations=4, per_device_train_batch_size=8,
                      gradient_accumulation_steps=1, max_completion_length=8, learning_rate=1e-3, temperature=1.0,
                      logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=0,
                      dataloader_num_workers=0)
    dataset = Dataset.from_list([{"prompt": p} for p in ["a1 b70 a5", "b99 b64", "a10 a11 a12 b100", "b80"]])

    def trainer(model, objective, rollout):
        return DiffusionGRPOTrainer(model=model, reward_funcs=[trl_example.a_words_reward], args=args,
                                    train_dataset=dataset, processing_class=trl_example.build_tokenizer(),
                                    objective=objective, rollout_func=rollout)

    torch.manual_seed(0)
    llada, sdar = LLaDAModel(LLaDAConfig.preset("tiny")), SDARModel.with_random_weights(SDARConfig.preset("sdar-tiny"))
    with pytest.raises(ValueError, match="trains on stored preference pairs.*--task sudoku4_pairs"):
        trainer(llada, "vrpo_dpo", make_rollout_func())
    with pytest.raises(ValueError, match="ebpo estimates a block-diffusion model's composite ELBO"):
        trainer(llada, "ebpo", make_rollout_func())
    with pytest.raises(ValueError, match="block_length 1"):
        trainer(llada, "justgrpo", make_rollout_func(block_length=4, steps=8))
    for model, objective, rollout in ((llada, objectives.get("justgrpo"), make_rollout_func(block_length=1, steps=8)),
                                      (sdar, objectives.get("ebpo", n_t=2), make_rollout_func(steps=8, cache="block"))):
        run = trainer(model, objective, rollout)
        run.train()
        rows = [row for row in run.state.log_history if "loss" in row]
        assert len(rows) == 1 and math.isfinite(rows[0]["loss"])


def test_the_training_benchmark_takes_the_new_objectives_and_the_sdar_model(tmp_path):
    """bench_training.py's settings for each objective and model are a configuration train accepts."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_training

    for model in bench_training.MODELS:
        for name in ("ebpo", "justgrpo", "vrpo_dpo"):
            if name == "justgrpo" and model == "sdar-sudoku4":
                continue  # its blocks of 4 are not left to right (the run fails and is listed so)
            TrainConfig(objective=name, output_dir=str(tmp_path / name), **bench_training.model_settings(model),
                        **bench_training.objective_settings(name))
