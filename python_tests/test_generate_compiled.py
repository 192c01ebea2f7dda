"""generate(compile=True): the denoising step compiles whole (torch.compile fullgraph, a graph break is an
error), one graph per kind of step (refreshing / reusing the cache) serves every block, step and call, and the
tokens are eager's.

The capture and the recompile checks run with dynamo and the aot_eager backend (no code generation, seconds);
two configurations run the shipped path, inductor, whose C++ code generation takes ~30 s a graph on 2 cores.
"""

import importlib

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import dllm_fast
from dllm_fast.rollout.step import denoise_step
from test_generate import prompts, tiny_model

pytestmark = pytest.mark.compile
generate_module = importlib.import_module("dllm_fast.rollout.sampler")

CONFIGS = {
    "none": dict(cache="none", steps=9),
    "prefix T=1 random record": dict(cache="prefix", steps=9, temperature=1.0, remasking="random",
                                     record_unmask_step=True),
    "dual T=1 cfg": dict(cache="dual", steps=9, temperature=1.0, cfg_scale=1.0),
    "prefix threshold": dict(cache="prefix", threshold=0.5),
    "dual threshold record eos": dict(cache="dual", threshold=0.5, record_unmask_step=True, logits_eos_inf=True,
                                      confidence_eos_eot_inf=True),
}


def calls(model, batches, config, compile, first_seed=0):
    """generate on each batch of prompts, with the generator seeded first_seed, first_seed + 1, ..."""
    return [dllm_fast.generate(model, ids, mask, gen_length=12, block_length=4, compile=compile,
                               generator=torch.Generator().manual_seed(seed), **config)
            for seed, (ids, mask) in enumerate(batches, start=first_seed)]


def same_outputs(a, b) -> bool:
    records = (a.unmask_step is None and b.unmask_step is None) or torch.equal(a.unmask_step, b.unmask_step)
    return torch.equal(a.sequences, b.sequences) and a.nfe == b.nfe and records


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# One configuration in the fast suite; the others (about 10 s each on 2 cores) are slow.
@pytest.mark.parametrize("name", [n if n == "none" else pytest.param(n, marks=pytest.mark.slow) for n in CONFIGS])
def test_the_step_compiles_whole_once_per_kind_of_step(name, fresh_dynamo, monkeypatch, one_thread):
    """Warm-up: the first call compiles one graph per kind of step (3 blocks of 3 or more steps: one graph for all).
    Then 3 calls with other prompts and seeds compile nothing (error_on_recompile) and reuse the first call's
    buffers (one KV cache: a CUDA graph replays on the same addresses), and every call gives eager's tokens (each
    result its own copy)."""
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(denoise_step, fullgraph=True, dynamic=False, backend=counter)
    monkeypatch.setattr(generate_module, "compiled_step", lambda device_type: step)
    config = CONFIGS[name]
    model = tiny_model("cpu", head_scale=4.0)
    caches = []
    new_cache = model.new_cache
    monkeypatch.setattr(model, "new_cache", lambda *args: caches.append(new_cache(*args)) or caches[-1])
    torch.manual_seed(1)
    batches = [prompts("cpu", [3, 6]) for _ in range(4)]
    compiled = calls(model, batches[:1], config, compile=True)
    assert counter.frame_count == (1 if config["cache"] == "none" else 2)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled += calls(model, batches[1:], config, compile=True, first_seed=1)
    assert counter.frame_count == (1 if config["cache"] == "none" else 2)
    assert len(caches) == (0 if config["cache"] == "none" else 1)
    eager = calls(model, batches, config, compile=False)
    assert all(same_outputs(a, b) for a, b in zip(compiled, eager))
    assert len({tuple(result.sequences.flatten().tolist()) for result in eager}) == 4  # the calls differ


@pytest.mark.parametrize("name, config", [("prefix T=0", dict(cache="prefix", steps=6)),
                                          ("dual T=1 random record", dict(cache="dual", steps=6, temperature=1.0,
                                                                          remasking="random",
                                                                          record_unmask_step=True))])
@pytest.mark.slow
def test_inductor_compiled_rollouts_equal_eager(name, config, fresh_dynamo, one_thread):
    """The shipped path (inductor): tokens equal eager's at T = 0, and at T = 1 with the same seed; no recompile
    across calls."""
    from torch._inductor import config as inductor_config

    model = tiny_model("cpu", torch.float32, head_scale=4.0)
    torch.manual_seed(2)
    batches = [prompts("cpu", [4, 7]) for _ in range(3)]
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):  # as test_bench_rollout: one cached graph
        compiled = calls(model, batches[:1], config, compile=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled += calls(model, batches[1:], config, compile=True, first_seed=1)
    eager = calls(model, batches, config, compile=False)
    assert all(same_outputs(a, b) for a, b in zip(compiled, eager))


def test_a_host_sync_in_the_step_is_a_capture_error(fresh_dynamo, monkeypatch, one_thread):
    """fullgraph: a value read inside the step (here the old per-step token check) fails the capture instead
    of silently splitting the graph."""

    def step_with_a_sync(model, state, *args):
        if state.canvas.max().item() > 10**9:
            raise ValueError("unreachable")
        return denoise_step(model, state, *args)

    step = torch.compile(step_with_a_sync, fullgraph=True, backend="aot_eager")
    monkeypatch.setattr(generate_module, "compiled_step", lambda device_type: step)
    model = tiny_model("cpu")
    ids, mask = prompts("cpu", [3])
    with pytest.raises(torch._dynamo.exc.UserError, match="data-dependent"):
        dllm_fast.generate(model, ids, mask, gen_length=4, block_length=4, steps=2, compile=True)


def test_compile_must_be_a_bool():
    model = tiny_model("cpu")
    ids, mask = prompts("cpu", [3])
    with pytest.raises(TypeError, match="compile='yes' must be True or False"):
        dllm_fast.generate(model, ids, mask, gen_length=4, block_length=4, steps=2, compile="yes")


@pytest.mark.slow
def test_train_with_compile_true_compiles_its_rollouts_and_scoring(tmp_path, fresh_dynamo, monkeypatch):
    """--compile true reaches the trainer's rollouts and its scoring micro-batches (the engine's passes): both
    compile, and the run is the run without it. With LoRA: PEFT's wrapping leaves no hook dynamo cannot trace
    (its input-embedding hook broke the 8B rollout's graph on the H200). (The run without LoRA takes the same
    trainer path to the compiled step and engine; those compile without PEFT in
    test_the_step_compiles_whole_once_per_kind_of_step and test_score_compiled.py.)"""
    lora = True
    from test_trainer import quick_config

    from dllm_fast.likelihood import compiled as scoring_module
    from dllm_fast.train import train

    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(denoise_step, fullgraph=True, dynamic=False, backend=counter)
    monkeypatch.setattr(generate_module, "compiled_step", lambda device_type: step)
    scoring_counter = CompileCounterWithBackend("aot_eager")
    graphs = {name: torch.compile(getattr(scoring_module, name), fullgraph=True, dynamic=False,
                                  backend=scoring_counter) for name in ("score_padded", "known_gradient_padded")}
    monkeypatch.setattr(scoring_module, "compiled", lambda name, backend="inductor": graphs[name])
    runs = [train(quick_config(tmp_path / str(compile), compile=compile, steps=2, eval_every=10, lora=lora,
                               checkpoint_every=10, plot=False)) for compile in (True, False)]
    assert counter.frame_count == 1  # the trainer's default cache="none": one kind of step
    assert scoring_counter.frame_count >= 1
    keys = ("reward_mean", "loss", "completion_length")
    trained = [[[row[k] for k in keys] for row in run.history if "loss" in row] for run in runs]
    assert len(trained[0]) == 2
    for compiled, eager in zip(*trained):  # the same rollouts and rewards; the loss to rounding (aot_eager's
        assert compiled[0] == eager[0] and compiled[2] == eager[2]  # decompositions may round differently)
        assert compiled[1] == pytest.approx(eager[1], rel=1e-6, abs=1e-12)
