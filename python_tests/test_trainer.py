"""The trainer: configuration, LoRA targets, a short run's outputs, every objective, bad rewards, and a run killed
with SIGKILL that resumes to exactly the parameters of an uninterrupted one."""

import inspect
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dllm_fast
from dllm_fast import objectives
from dllm_fast.models import LLaDAConfig, LLaDAModel
from dllm_fast.tasks import get_task, register_task
from dllm_fast.tasks.sudoku4 import Sudoku4
from dllm_fast.models.llada import LORA_TARGETS
from dllm_fast.train import TrainConfig, train
from dllm_fast.train.cli import parse_overrides
from dllm_fast.train.run import add_lora, load_model_and_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

# A small, fast run of the embedded default: 2 prompts x G = 4 per step, a 16-puzzle test split.
QUICK = dict(steps=2, prompts_per_step=2, group_size=4, eval_every=2, checkpoint_every=1, eval_examples=16,
             progress=False, plot=False, threads=1)


def quick_config(tmp_path, **overrides):
    return TrainConfig(**{**QUICK, "output_dir": str(tmp_path / "run"), **overrides})


def test_config_from_file_and_command_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("objective: bgpo\nlr: 0.001\nobjective_options:\n  n_t: 4\n")
    config = TrainConfig.from_file(path, **parse_overrides(["--lr", "2e-4", "--eval-gen-lengths", "24", "48",
                                                            "--lora", "true", "--threshold", "none"]))
    assert (config.objective.name, config.optim.lr, config.objective.options) == ("bgpo", 2e-4, {"n_t": 4})
    assert config.eval.gen_lengths == [24, 48] and config.lora.enabled is True and config.rollout.threshold is None
    (tmp_path / "run.json").write_text(json.dumps({"steps": 3}))
    assert TrainConfig.from_file(tmp_path / "run.json").run.steps == 3
    with pytest.raises(ValueError, match="unknown training option --learning-rate"):
        parse_overrides(["--learning-rate", "1"])
    with pytest.raises(ValueError, match="--steps = 'many' must be an integer"):
        parse_overrides(["--steps", "many"])
    with pytest.raises(ValueError, match=r"unknown training option\(s\) \['stepz'\]"):
        TrainConfig.from_dict({"stepz": 1})
    with pytest.raises(ValueError, match="--group-size=0 must be an int >= 1"):  # messages name the flag
        TrainConfig(group_size=0)


def test_default_lora_targets_wrap_every_llada_module_but_not_the_lm_head():
    peft = pytest.importorskip("peft")
    model = LLaDAModel(LLaDAConfig.preset("tiny"))
    wrapped = add_lora(model, TrainConfig(lora=True))
    lora_layer = peft.tuners.lora.LoraLayer
    for block in model.transformer["blocks"]:
        for name in LORA_TARGETS:
            assert isinstance(getattr(block, name), lora_layer), name
    assert not isinstance(model.transformer["ff_out"], lora_layer)  # the LM head, read directly by the fused ops
    assert all("lora_" in n for n, p in wrapped.named_parameters() if p.requires_grad)


def test_a_short_run_writes_metrics_checkpoint_and_curves(tmp_path):
    result = train(quick_config(tmp_path, plot=True, objective="bgpo", objective_options={"n_t": 2}))
    out = Path(result.output_dir)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ("reward_mean", "reward_std", "accuracy", "loss", "grad_norm", "completion_length",
                "rollout_tokens_per_s", "step_seconds", "peak_memory_mib", "zero_std_fraction", "ratio_mean"):
        assert key in rows[1] and math.isfinite(rows[1][key]), key
    assert "eval_accuracy@24" in rows[0] and "eval_accuracy@24" in rows[2]
    assert set(result.base_accuracy) == set(result.final_accuracy) == {24}
    assert (out / "curves.png").stat().st_size > 1000
    assert (out / "checkpoint" / "state.pt").is_file() and (out / "checkpoint" / "model" / "config.json").is_file()


# Objectives whose defaults the embedded LLaDA rollout does not meet (the plain run refuses them: see
# test_objectives_engine_family_training) run on the setup they need.
OWN_SETUP = {"ebpo": dict(model="sdar-sudoku4", block_length=4, cache="block"),  # a block model
             "justgrpo": dict(block_length=1, diffusion_steps=24),  # left-to-right rollouts
             "vrpo_dpo": dict(task="sudoku4_pairs")}  # preference pairs


@pytest.mark.parametrize("name", objectives.available())
@pytest.mark.slow
def test_every_objective_trains_without_nan(tmp_path, name):
    objective = objectives.get(name)
    small = {"n_t": 2} if objective.config.n_t > 2 and objective.config.sampler != "coupled" else {}
    config = quick_config(tmp_path, objective=name, objective_options=small, steps=1, inner_updates=2,
                          eval_every=10, checkpoint_every=10, eval_examples=4, **OWN_SETUP.get(name, {}))
    if objective.needs_unmask_step and "record_unmask_step" not in inspect.signature(dllm_fast.generate).parameters:
        with pytest.raises(ValueError, match=f"--objective {name} replays the rollout's decoding order"):
            train(config)  # refused before any work until generate records the decoding order
        return
    result = train(config)
    row = result.history[-1]
    assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row


@pytest.mark.slow
def test_lora_run_trains_only_adapters_and_uses_the_base_as_reference(tmp_path):
    pytest.importorskip("peft")
    result = train(quick_config(tmp_path, objective="rspo", lora=True, lora_rank=4, steps=1, eval_every=10))
    assert math.isfinite(result.history[-1]["loss"]) and result.history[-1]["delta_var"] >= 0
    assert (Path(result.output_dir) / "checkpoint" / "adapter" / "adapter_config.json").is_file()


def test_checkpointing_and_bf16_autocast_run_on_cpu(tmp_path):
    result = train(quick_config(tmp_path, gradient_checkpointing=True, bf16=True, steps=1, eval_every=10))
    assert math.isfinite(result.history[-1]["loss"])


class NaNReward(Sudoku4):
    name = "nan_sudoku4"

    def reward_components(self, example, completion):
        return {"broken": float("nan")}


def test_a_nan_reward_names_the_prompt(tmp_path, monkeypatch):
    from dllm_fast.assets import SUDOKU4_TASK_OPTIONS
    from dllm_fast.tasks import base

    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))  # registered for this test only
    register_task("nan_sudoku4", lambda **options: NaNReward(**options))
    with pytest.raises(ValueError, match=r"reward component 'broken' returned nan; a reward must be finite, for "
                                         r"example 0 \('"):
        train(quick_config(tmp_path, task="nan_sudoku4", task_options=SUDOKU4_TASK_OPTIONS, steps=1))


@pytest.mark.slow
def test_a_new_run_never_replaces_an_earlier_runs_checkpoint_unless_told(tmp_path):
    config = quick_config(tmp_path, steps=1, eval_every=10, checkpoint_every=1)
    train(config)
    checkpoint = Path(config.run.output_dir) / "checkpoint"
    written = {p: p.read_bytes() for p in checkpoint.rglob("*") if p.is_file()}
    with pytest.raises(FileExistsError, match="--resume true.*--overwrite true"):
        train(config)
    assert {p: p.read_bytes() for p in checkpoint.rglob("*") if p.is_file()} == written
    assert train(quick_config(tmp_path, steps=1, eval_every=10, checkpoint_every=1, overwrite=True)).steps == 1


@pytest.mark.slow
def test_zero_variance_groups_are_kept_and_counted(tmp_path):
    # Greedy rollouts: every completion of a prompt is the same, so every group has zero reward variance.
    result = train(quick_config(tmp_path, temperature=0.0, steps=1, eval_every=10))
    row = result.history[-1]
    assert row["zero_std_fraction"] == 1.0 and row["loss"] == 0.0 and row["grad_norm"] == 0.0


def final_parameters(output_dir):
    model, _ = load_model_and_tokenizer(TrainConfig(model=str(Path(output_dir) / "checkpoint" / "model")), "cpu")
    return model.state_dict()


def final_adapter(output_dir):
    """A LoRA run's adapter weights, as its checkpoint holds them."""
    from safetensors.torch import load_file

    return load_file(str(Path(output_dir) / "checkpoint" / "adapter" / "adapter_model.safetensors"))


def run_cli(output_dir, *extra):
    flags = []
    for key, value in {**QUICK, "steps": 6, "eval_every": 6, "checkpoint_every": 1}.items():
        flags += [f"--{key.replace('_', '-')}", str(value).lower() if isinstance(value, bool) else str(value)]
    return [sys.executable, "-m", "dllm_fast", "train", "--output-dir", str(output_dir), "--objective", "espo",
            *flags, *extra]


@pytest.mark.slow
def test_a_run_killed_mid_step_resumes_to_the_uninterrupted_parameters(tmp_path):
    """SIGKILL after the step-2 checkpoint, while a later step runs; --resume finishes; the parameters equal those of
    an uninterrupted run with the same seed, bit for bit."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    uninterrupted = tmp_path / "uninterrupted"
    subprocess.run(run_cli(uninterrupted), check=True, env=env, capture_output=True)

    killed = tmp_path / "killed"
    process = subprocess.Popen(run_cli(killed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    state = killed / "checkpoint" / "state.pt"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        if state.is_file() and torch.load(state, weights_only=False)["step"] >= 2:
            break
        time.sleep(0.05)
    assert process.poll() is None, "the run finished before it could be killed"
    process.send_signal(signal.SIGKILL)
    process.wait()
    step_at_kill = torch.load(state, weights_only=False)["step"]
    assert 2 <= step_at_kill < 6
    subprocess.run(run_cli(killed, "--resume", "true"), check=True, env=env, capture_output=True)

    want, got = final_parameters(uninterrupted), final_parameters(killed)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    rows = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]  # no duplicated steps from before the crash


@pytest.mark.distributed
# DDP's checkpoint from rank 0 and resume on every rank, through the same command line, is guarded by
# test_expert_parallel.py's torchrun test (DDP beside DDP with expert parallelism, stopped and resumed bit for bit)
@pytest.mark.parametrize("parallel, lora", [("fsdp2", False), ("fsdp2", True)], ids=["fsdp2", "fsdp2-lora"])
@pytest.mark.slow
def test_torchrun_checkpoints_from_rank_0_and_resumes_every_rank(tmp_path, parallel, lora):
    """2 gloo processes under torchrun: rank 0 writes the checkpoint (weights gathered from FSDP2's shards: the
    whole model, or LoRA's adapters alone), and a run stopped after step 2 and resumed to step 3 ends with the
    parameters of an uninterrupted 3-step run. A single process refuses to resume the 2 ranks' checkpoint."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def torchrun(output_dir, steps, *extra):
        command = run_cli(output_dir, "--steps", str(steps), "--parallel", parallel, "--eval-every", "3",
                          "--lora", str(lora).lower(), *extra)
        # --standalone: the rendezvous takes a free port (a fixed one collides with a run beside this one)
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    *command[1:]]
        subprocess.run(launcher, check=True, env=env, capture_output=True, timeout=600)

    torchrun(tmp_path / "whole", 3)
    torchrun(tmp_path / "split", 2)
    assert torch.load(tmp_path / "split" / "checkpoint" / "state.pt", weights_only=False)["world"] == 2
    torchrun(tmp_path / "split", 3, "--resume", "true")
    parameters = final_adapter if lora else final_parameters
    want, got = parameters(tmp_path / "whole"), parameters(tmp_path / "split")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    if lora:  # the adapters trained (LoRA's B starts at zero)
        assert any(value.abs().sum() > 0 for name, value in want.items() if "lora_B" in name)
    rows = [json.loads(line) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and "eval_accuracy@24" in rows[2]
    if parallel == "fsdp2":  # another number of ranks: refused, saying why and what to do instead
        one = subprocess.run(run_cli(tmp_path / "split", "--steps", "4", "--parallel", parallel, "--eval-every", "3",
                                     "--lora", str(lora).lower(), "--resume", "true"),
                             env=env, capture_output=True, text=True, timeout=600)
        assert one.returncode != 0 and "was written by 2 ranks; resume it with the same number of ranks" in one.stderr


def test_the_progress_bar_says_compiling_on_the_first_step_only(tmp_path, monkeypatch):
    """The first rollout of a process compiles the denoising step; the bar said "compiling" before every step
    (it compared the step with the run's step, which each step advances)."""
    from dllm_fast.train import loop

    postfixes = []

    class Bar:
        def __init__(self, steps, **kwargs):
            self.steps = steps

        def __iter__(self):
            return iter(self.steps)

        def set_postfix_str(self, text):
            postfixes.append(text)

        def set_postfix(self, **values):
            postfixes.append("values")

    class CompiledRun(loop.Run):  # the message only; the rollouts themselves stay eager (fast on CPU)
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.compiled_rollouts = True

    monkeypatch.setattr(loop, "progress_bar", Bar)
    monkeypatch.setattr(loop, "Run", CompiledRun)
    train(quick_config(tmp_path, steps=3, checkpoint_every=3, eval_every=3))
    assert postfixes == ["compiling the rollouts' denoising step", "values", "values", "values"]
