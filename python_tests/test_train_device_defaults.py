"""What a run decides for its device (issue 29): the dtype of every weight (train/precision.py), --micro-batch auto
(the planner's fit on CUDA, 64 on CPU, refused where it would change a loss), --compile auto (rollouts compiled on
CUDA), and a whole step's report (rollout tokens/s, update pairs/s, compile seconds, peak memory per phase) on the
synthetic task. CUDA-only branches run here with the device's answers monkeypatched (its name, its free memory)
or on meta/fake tensors; what needs a GPU itself (CUDA graphs, max_memory_allocated) is left to the GPU run."""

import dataclasses
import importlib
import json
from pathlib import Path

import pytest
import torch

from dllm_fast import objectives
from dllm_fast.models import LLaDAConfig, LLaDAModel
from dllm_fast.train import TrainConfig, train
from dllm_fast.train.distributed import Ranks
from dllm_fast.train.precision import training_models, training_precision

run_module = importlib.import_module("dllm_fast.train.run")
config_module = importlib.import_module("dllm_fast.train.config")
pytestmark = pytest.mark.usefixtures("one_thread")

QUICK = dict(steps=2, prompts_per_step=2, group_size=4, eval_every=10, checkpoint_every=10, eval_examples=4,
             progress=False, plot=False, threads=1)


# -- precision --------------------------------------------------------------------------------------------------

def test_the_precision_follows_the_compute_dtype():
    """bf16 compute (default on CUDA): frozen weights bf16, trained ones fp32; none (default on CPU): all fp32."""
    cuda, cpu = training_precision(TrainConfig(), "cuda"), training_precision(TrainConfig(), "cpu")
    assert (cuda.compute, cuda.trainable, cuda.frozen) == (torch.bfloat16, torch.float32, torch.bfloat16)
    assert (cpu.compute, cpu.trainable, cpu.frozen) == (None, torch.float32, torch.float32)
    assert training_precision(TrainConfig(bf16=False), "cuda") == cpu
    assert training_precision(TrainConfig(bf16=True), "cpu") == cuda
    assert cuda.base_dtype(lora=True) == torch.bfloat16 and cuda.base_dtype(lora=False) == torch.float32
    assert training_precision(TrainConfig(), "cuda", weights=torch.bfloat16).trainable == torch.bfloat16


def test_a_lora_model_of_llada_8b_on_meta_has_a_bf16_base_and_fp32_adapters():
    """The run's LoRA model, built on the meta device as train builds it on CUDA: every base weight (embedding,
    norms, LM head) bf16 and frozen, every adapter weight fp32 and trained; the base's bytes are LLaDA-8B's 16 GB.
    The adapters stay fp32 (master weights): AdamW's relative updates of ~lr are far below bf16's 2^-8."""
    pytest.importorskip("peft")
    config = TrainConfig(model="llada-8b", lora=True, lora_rank=128)
    precision = training_precision(config, "cuda")
    with torch.device("meta"):
        base = LLaDAModel(LLaDAConfig.preset("llada-8b")).to(precision.base_dtype(lora=True))
        policy, reference = training_models(base, config, precision, needs_reference=True)
    assert reference is None  # the base with its adapters disabled is the reference
    frozen = [p for n, p in policy.named_parameters() if "lora_" not in n]
    adapters = [p for n, p in policy.named_parameters() if "lora_" in n]
    assert frozen and adapters
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in frozen)
    assert all(p.dtype == torch.float32 and p.requires_grad for p in adapters)
    assert 15.5e9 < sum(p.numel() * p.element_size() for p in frozen) < 16.5e9
    with pytest.raises(ValueError, match=r"load it in bf16"):
        with torch.device("meta"):
            training_models(LLaDAModel(LLaDAConfig.preset("tiny")), config, precision, needs_reference=True)


def test_a_full_fine_tune_trains_fp32_master_weights_against_a_bf16_reference_copy():
    config = TrainConfig(model="tiny")
    precision = training_precision(config, "cuda")
    base = LLaDAModel.with_random_weights(LLaDAConfig.preset("tiny"), seed=0)
    policy, reference = training_models(base, config, precision, needs_reference=True)
    assert policy is base and all(p.dtype == torch.float32 and p.requires_grad for p in policy.parameters())
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in reference.parameters())
    for (name, p), (_, r) in zip(policy.named_parameters(), reference.named_parameters()):
        assert torch.equal(r, p.detach().to(torch.bfloat16)), name
        assert r.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
    assert not reference.training


def test_the_planner_counts_the_weights_train_keeps():
    """The plan's weights are the run's: LLaDA-8B LoRA streams ~16 GB per forward under bf16 compute (the
    rollout's weight-streaming floor half of fp32's)."""
    from dllm_fast.planning.accounting import Target
    from dllm_fast.planning.gpus import gpu
    from dllm_fast.planning.step import Session

    bytes_by_compute = {}
    for bf16 in (None, False):
        config = TrainConfig(model="llada-8b", lora=True, bf16=bf16)
        session = Session(config, target=Target("cuda", gpu("h200")), optimizer=False)
        bytes_by_compute[bf16] = session.weight_bytes
    assert bytes_by_compute[None] <= 17e9
    assert bytes_by_compute[None] * 2 == pytest.approx(bytes_by_compute[False], rel=0.01)


def test_the_size_check_counts_the_weights_in_the_dtypes_they_are_kept_in(monkeypatch):
    """LLaDA-8B with LoRA needs its bf16 base (15 GiB), a full fine-tune fp32 weights, gradients and moments and a
    bf16 reference copy; a device with 10 GiB free is refused naming them."""
    with torch.device("meta"):
        skeleton = LLaDAModel(LLaDAConfig.preset("llada-8b"))
    monkeypatch.setattr(run_module, "free_memory", lambda device: 10 * 2**30)
    for lora, expected in ((True, r"its weights in bf16 take about 14\.9 GiB"),
                           (False, r"weights, gradients and AdamW's two moments in fp32 and the reference copy in "
                                   r"bf16 take about 134\.4 GiB")):
        config = TrainConfig(model="llada-8b", lora=lora)
        with pytest.raises(ValueError, match=expected):
            run_module.check_sizes(config, skeleton, torch.device("cuda"), Ranks(), True,
                                   training_precision(config, "cuda"))


@pytest.mark.slow  # a LoRA training run, about 10 s on 2 cores
def test_a_bf16_lora_run_keeps_its_base_in_bf16_and_saves_fp32_adapters(tmp_path):
    """--bf16 true on CPU runs the CUDA default's precision for real: the base bf16, the adapters fp32 (trained
    and saved as trained), and the adapters move."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    config = TrainConfig(**{**QUICK, "steps": 1}, output_dir=str(tmp_path / "run"), model="tiny", task="synthetic",
                         lora=True, bf16=True, objective="espo")
    run = run_module.Run(dataclasses.replace(config, output_dir=str(tmp_path / "built")))
    assert {p.dtype for n, p in run.core.named_parameters() if "lora_" not in n} == {torch.bfloat16}
    assert {p.dtype for n, p in run.core.named_parameters() if "lora_" in n} == {torch.float32}
    result = train(config)
    adapter = load_file(str(Path(result.output_dir) / "checkpoint" / "adapter" / "adapter_model.safetensors"))
    assert adapter and {t.dtype for t in adapter.values()} == {torch.float32}
    assert any(t.abs().max() > 0 for name, t in adapter.items() if "lora_B" in name)  # trained (B starts at 0)


# -- --micro-batch auto -----------------------------------------------------------------------------------------

def fit_config(**overrides):
    return TrainConfig(**{**dict(model="tiny", task="synthetic", task_options={"prompt_length": 16},
                                 prompts_per_step=2, group_size=4, gen_length=8, block_length=8, diffusion_steps=4,
                                 lora=True, progress=False), **overrides})


def test_micro_batch_auto_is_the_default_and_64_on_cpu():
    config = fit_config()
    assert config.objective.micro_batch == "auto"
    assert run_module.auto_micro_batch(config, torch.device("cpu"), Ranks())[0] == 64


@pytest.mark.slow
def test_micro_batch_auto_on_cuda_is_the_planners_largest_that_fits_with_a_margin(monkeypatch):
    """On a (monkeypatched) H200 with 4.5 MB free, the run's micro-batch is the planner's answer for 90% of it: a
    planned step at that micro-batch fits in 4.05 MB, one at a quarter more does not."""
    from dllm_fast.planning.gpus import gpu
    from dllm_fast.planning.planner import plan_step
    from dllm_fast.train import micro_batch as fit_module

    free = 4_500_000
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 141 * 10**9))
    config = fit_config()
    micro_batch, note = run_module.auto_micro_batch(config, torch.device("cuda"), Ranks())
    assert "NVIDIA H200" in note and f"{fit_module.MARGIN * free / 1e9:.1f} GB" in note
    budget = dataclasses.replace(gpu("h200"), memory=int(fit_module.MARGIN * free))
    assert 2 <= micro_batch < 64
    assert plan_step(dataclasses.replace(config, micro_batch=micro_batch), gpu=budget, search=False).fits
    larger = micro_batch + max(1, micro_batch // 4)
    assert not plan_step(dataclasses.replace(config, micro_batch=larger), gpu=budget, search=False).fits


@pytest.mark.parametrize("name, options", [("spg", {"normalize_per": "micro_batch"}),
                                           ("diffu_grpo", {"normalize_per": "micro_batch"}),
                                           ("coupled_grpo", {"normalize_per": "micro_batch"}),
                                           ("bgpo", {"aggregation": "length_weighted"}),
                                           ("rspo", {"center": "micro_batch"})])
def test_an_automatic_micro_batch_never_changes_a_loss_that_normalises_per_micro_batch(name, options, monkeypatch):
    """An objective that normalises per micro-batch names its own rows (micro_batch_rows): without them the
    config is refused, whatever --micro-batch is, and with them the GPU's fitted micro-batch is taken as it is
    (python_tests/test_micro_batch_invariance.py shows the loss is then the same at every micro-batch)."""
    from dllm_fast.train import micro_batch as fit_module

    monkeypatch.setattr(fit_module, "fitted_micro_batch", lambda config, device: (7, "fitted"))
    for micro_batch in ("auto", 4):
        with pytest.raises(ValueError, match=r"needs micro_batch_rows.*memory micro-batch \(--micro-batch\) never "
                                             r"changes the loss"):
            fit_config(objective=name, objective_options=options, micro_batch=micro_batch)
    config = fit_config(objective=name, objective_options={**options, "micro_batch_rows": 2})
    assert run_module.auto_micro_batch(config, torch.device("cuda"), Ranks())[0] == 7
    assert run_module.auto_micro_batch(config, torch.device("cpu"), Ranks())[0] == 64
    assert objectives.get(name).config.micro_batch_rows is None  # each paper's default normalises per batch


# -- --compile auto and a whole step's report ---------------------------------------------------------------

def test_compile_auto_compiles_the_rollouts_on_cuda_and_nothing_on_cpu():
    auto, on, off = TrainConfig(), TrainConfig(compile=True), TrainConfig(compile=False)
    assert auto.rollout.compile == "auto"
    assert config_module.compiles_rollouts(auto, "cuda") and not config_module.compiles_rollouts(auto, "cpu")
    assert config_module.compiles_rollouts(on, "cpu") and not config_module.compiles_rollouts(off, "cuda")
    assert auto.generate_config("cuda").compile and not auto.generate_config("cpu").compile
    assert not config_module.compiles_scoring(auto) and config_module.compiles_scoring(on)
    with pytest.raises(ValueError, match="--compile = .sometimes. must be true or false or auto"):
        from dllm_fast.train.cli import parse_overrides
        parse_overrides(["--compile", "sometimes"])


@pytest.mark.compile
@pytest.mark.slow
def test_a_compiled_first_rollout_reports_its_compile_time_apart(tmp_path, monkeypatch):
    """With the rollouts compiled (as --compile auto does on CUDA: the run's GenerateConfig asks compiles_rollouts
    with its device, answered True here), the first step's row holds the compile time and the second compiles nothing."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from dllm_fast.rollout.step import denoise_step

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(denoise_step, fullgraph=True, dynamic=False, backend=counter)
    monkeypatch.setattr(importlib.import_module("dllm_fast.rollout.sampler"), "compiled_step", lambda device: step)
    asked = []
    monkeypatch.setattr(config_module, "compiles_rollouts",
                        lambda config, device_type: asked.append((config.rollout.compile, device_type)) or True)
    result = train(fit_config(**QUICK, output_dir=str(tmp_path / "run")))
    rows = [row for row in result.history if "loss" in row]
    assert asked == [("auto", "cpu")] and counter.frame_count == 1
    assert rows[0]["compile_seconds"] > 0 and rows[1]["compile_seconds"] == 0
    torch._dynamo.reset()


def test_a_whole_step_on_the_synthetic_task_reports_speed_and_each_phases_memory(tmp_path):
    """The throughput run's shape on a tiny preset (what the GPU run does at LLaDA-8B's): LoRA, rewards that
    differ within every group, every pair with a gradient weight; metrics.jsonl holds rollout tokens/s, update
    pairs/s, the micro-batch, the compile time (none on CPU) and the peak memory of each phase."""
    pytest.importorskip("peft")
    result = train(fit_config(**QUICK, output_dir=str(tmp_path / "run"), objective_options={"n_t": 2},
                              temperature=1.0))
    rows = [json.loads(line) for line in (Path(result.output_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss" in row]
    assert len(steps) == 2
    for row in steps:
        assert row["reward_std"] > 0 and row["zero_std_fraction"] == 0  # every group's rewards differ
        assert row["rollout_tokens_per_s"] > 0 and row["update_pairs"] == 8 * 2 and row["update_pairs_per_s"] > 0
        assert row["micro_batch"] == 64 and row["compile_seconds"] == 0
        peaks = [row[f"peak_memory_{phase}_mib"] for phase in ("rollout", "scoring", "update")]
        assert all(peak > 0 for peak in peaks) and row["peak_memory_mib"] == max(peaks)
        assert row["grad_norm"] > 0


def test_micro_batch_auto_resumes_with_the_micro_batch_it_ran_with(tmp_path):
    """A checkpoint records the micro-batch; --micro-batch auto resumes with it rather than refitting to the free
    memory of the moment (which would cut the pairs otherwise: no bit-for-bit continuation). Here the checkpoint
    says 5, as a GPU's fit might have."""
    config = fit_config(**{**QUICK, "steps": 1, "checkpoint_every": 1}, output_dir=str(tmp_path / "run"))
    train(config)
    path = tmp_path / "run" / "checkpoint" / "state.pt"
    state = torch.load(path, weights_only=True)
    assert state["micro_batch"] == 64
    torch.save({**state, "micro_batch": 5}, path)
    resumed = run_module.Run(dataclasses.replace(config, steps=2, resume=True))
    assert resumed.batching.micro_batch == 5
    torch.save({**state, "micro_batch": 0}, path)
    with pytest.raises(ValueError, match="its micro-batch is 0"):
        run_module.Run(dataclasses.replace(config, steps=2, resume=True))
