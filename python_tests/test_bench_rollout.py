"""bench_rollout's kernel count per denoising step: what the profiler's CPU trace says a step launches."""

import sys
from pathlib import Path

import pytest
import torch

import dllm_fast
from dllm_fast.models import LLaDAConfig, LLaDAModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_rollout  # noqa: E402
from test_generate import prompts  # noqa: E402


def kernels_per_step(layers: int, **kwargs) -> float:
    config = LLaDAConfig.preset("tiny")
    config.n_layers = layers
    model = LLaDAModel(config).eval()
    ids, mask = prompts("cpu", [4, 7])
    run = dict(gen_length=12, block_length=4, steps=6, **kwargs)
    dllm_fast.generate(model, ids, mask, **run)  # warm-up (compiles when asked)
    return bench_rollout.count_step_kernels(lambda: dllm_fast.generate(model, ids, mask, **run))


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_eager_kernels_grow_by_one_layers_worth_per_layer(cache, one_thread):
    """Each layer adds the same ops (2 norms, 7 GEMMs, RoPE, attention, residuals): a constant number of kernels,
    about 40 (views and allocations do not count)."""
    counts = [kernels_per_step(layers, cache=cache) for layers in (1, 2, 3)]
    per_layer = counts[1] - counts[0]
    assert counts[2] - counts[1] == per_layer and 30 <= per_layer <= 50, counts


@pytest.mark.compile
def test_compiled_steps_launch_several_times_fewer_kernels(one_thread):
    """(The shapes and configuration of test_generate_compiled's inductor test, whose graphs inductor's cache
    then holds.)"""
    from torch._inductor import config as inductor_config

    torch._dynamo.reset()
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        eager, compiled = (kernels_per_step(2, cache="prefix", compile=compile) for compile in (False, True))
    torch._dynamo.reset()
    # More than the 7 GEMMs and the attention of each layer and the 2 dllm_fast ops: the fused kernels count too.
    assert 8 * 2 + 2 < compiled < eager / 3, (eager, compiled)
