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


def kernels_per_step(layers: int, by_op: dict | None = None, dtype=torch.float32, **kwargs) -> float:
    config = LLaDAConfig.preset("tiny")
    config.n_layers = layers
    model = LLaDAModel(config).to(dtype).eval()
    ids, mask = prompts("cpu", [4, 7])
    run = dict(gen_length=12, block_length=4, steps=6, **kwargs)
    dllm_fast.generate(model, ids, mask, **run)  # warm-up (compiles when asked)
    return bench_rollout.count_step_kernels(lambda: dllm_fast.generate(model, ids, mask, **run), by_op)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("cache", ["none", "dual"])
def test_eager_kernels_grow_by_one_layers_worth_per_layer(cache, dtype, one_thread):
    """Each layer adds the same kernels, at most 15 (issue 29: at most 20): 2 RMSNorms (one kernel each on a GPU;
    a second each for the bf16 scale), 4 GEMMs (fused QKV, attention output, fused gate-up, MLP output), RoPE on
    queries and keys together (one dllm_fast::rope; the composite took 3), attention, the KV-cache write (one copy
    for keys and values), SiLU, the gate product and 2 residual adds. Views, allocations and type queries do not
    count."""
    ops = [{}, {}, {}]
    counts = [kernels_per_step(layers, ops[layers - 1], dtype, cache=cache) for layers in (1, 2, 3)]
    per_layer = counts[1] - counts[0]
    assert counts[2] - counts[1] == per_layer, counts
    layer_ops = {name: ops[1][name] - ops[0].get(name, 0) for name in ops[1]}
    assert layer_ops["aten::mm"] == 4 and layer_ops["aten::rms_norm"] == 2, layer_ops
    assert layer_ops["aten::_scaled_dot_product_flash_attention_for_cpu"] == 1, layer_ops
    written = {"none": 0, "dual": 1}[cache]  # cached steps write with a copy_, refreshes with index_copy_ or copy_
    scales = 2 if dtype == torch.bfloat16 else 0
    assert layer_ops["dllm_fast::rope"] == 1, layer_ops
    assert per_layer == 12 + written + scales, (per_layer, layer_ops)


@pytest.mark.compile
@pytest.mark.slow
def test_compiled_steps_launch_several_times_fewer_kernels(one_thread):
    """(The shapes and configuration of test_generate_compiled's inductor test, whose graphs inductor's cache
    then holds.)"""
    from torch._inductor import config as inductor_config

    torch._dynamo.reset()
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        eager, compiled = (kernels_per_step(2, cache="prefix", compile=compile) for compile in (False, True))
    torch._dynamo.reset()
    # More than the 4 GEMMs and the attention of each layer and the 2 dllm_fast ops: the fused kernels count too.
    assert 5 * 2 + 2 < compiled < eager / 3, (eager, compiled)


def test_the_profile_sorts_the_h200s_kernels_by_kind():
    """profile_rollout.py's classifier on kernel names the H200's trace printed: cuDNN's attention carries sm90_
    like cuBLAS's GEMMs (it was counted as a GEMM), dllm_fast's kernels and inductor's are their own kinds."""
    import profile_rollout

    names = {
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1_kernel0_0":
            "attention",
        "nvjet_sm90_tst_192x128_64x5_1x2_h_bz_coopB_TNT": "gemm",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": "gemm",
        "void dllm_fast::cuda::(anonymous namespace)::rope_kernel<__nv_bfloat16, float>(__nv_bfloat16 const*)":
            "dllm_fast",
        "triton_poi_fused__unsafe_view_mul_silu_split_5": "inductor",
        "void at::native::index_elementwise_kernel<128, 4, at::native::index_copy_kernel_impl<>>": "copy",
        "void at::native::roll_cuda_kernel<float>(float const*, float*, long)": "elementwise",
    }
    assert {name: profile_rollout.kind_of(name) for name in names} == names
