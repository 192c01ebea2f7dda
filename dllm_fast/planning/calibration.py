"""How far real kernels run below the datasheet, and what the host spends launching them: the few fitted factors
that turn the planner's roofline (gpus.py) into a time estimate.

A kernel's device time is max(FLOPs / (peak of its type x GEMM efficiency), bytes / (bandwidth x bandwidth
efficiency)); a fused op (dllm_fast::masked_logprobs and its kin) runs its GEMMs and then its chunk traffic one
after another. The host launches each kernel of eager PyTorch (Python, the dispatcher, cudaLaunchKernel) for
`eager_launch` seconds; a CUDA graph (a compiled rollout step) costs `graph_launch` per replay and nothing per
kernel. Host and device overlap between host syncs (the launch queue runs ahead), so a stretch of work between two
syncs takes max(host, device); the queue holds `launch_queue` launches, so a stretch also ends when it is full
(accounting.py).

`H200_FIT` is fitted on the first GPU run (H200_RUN below; the points in RECORDED), one factor per physical
cause, each from the points it dominates (`python benchmarks/bench_plan.py --gpu h200 --fit` redoes it and
prints the derivation):

- tensor_core, tf32, bandwidth: least squares (relative) over the 8 points of the LM head, naive PyTorch and the
  fused op, forward and forward + backward, each point's device time split by what bounds each kernel: bf16
  GEMMs, the fused backward's TF32 gradient GEMMs (the CUDA kernels at b7790f6), and memory traffic (naive's fp32
  logits and log-softmax, the fused op's chunk logits);
- eager_launch: the 8B dual-cache rollout, host-bound but for the steps that refresh the cache (the kernels per
  step its code launched, `kernels_then`, at the measured time);
- fp32: the `small` preset's compiled rollout without a cache (device-bound; its GEMMs in fp32, TF32 off);
- graph_launch: the `small` preset's compiled dual-cache rollout (CUDA graphs), host-bound.

The other recorded points (the 8B rollout without a cache, the small preset's eager rollouts, the engine's
two_pass against naive) check the fit without entering it. The factors are assumed to carry over to the other
GPUs of gpus.py (Hopper parts alike; an A100 or an L40S may differ), and the host costs to any host of the H200
run's kind (16 cores); graph_launch, fitted on a 4-layer model, to a 32-layer one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Calibration:
    """Achieved fractions of the datasheet peaks, and host seconds per launch (see the module docstring)."""

    name: str
    tensor_core: float  # GEMMs with bf16/fp16 operands (fp32 accumulation), fraction of the dense peak
    tf32: float  # GEMMs on fp32 operands rounded to TF32
    fp32: float  # GEMMs in fp32 on the CUDA cores (and fp64)
    bandwidth: float  # memory-bound kernels, fraction of the HBM bandwidth
    eager_launch: float  # host seconds per kernel eager PyTorch launches
    graph_launch: float  # host seconds per CUDA graph replay (a compiled rollout step: guards, replay)
    # launches the host may queue ahead of the GPU before cudaLaunchKernel blocks: CUDA's pending-launch queue per
    # stream, about 1,000 entries (not fitted; NVIDIA developer forums, "CUDA stream are blocked when launch lots
    # of kernels (>1000)", https://forums.developer.nvidia.com/t/68937)
    launch_queue: int = 1024
    # torch._grouped_mm (a mixture of experts' routed GEMMs) against a dense GEMM of the same FLOPs: not fitted (no
    # grouped GEMM has been timed here). CUTLASS's grouped GEMMs reach about 80% of a dense GEMM's rate on H100 at
    # LLaDA2's expert widths (hundreds of rows an expert); an assumption until a GPU run measures it.
    grouped_gemm: float = 0.8

    def gemm_efficiency(self, dtype: torch.dtype, compute: str) -> float:
        if dtype in (torch.bfloat16, torch.float16):
            return self.tensor_core
        return self.tf32 if compute == "tf32" else self.fp32


# The datasheet roofline: every kernel at its peak, launches free (the planner before issue 28).
ROOFLINE = Calibration("roofline", tensor_core=1.0, tf32=1.0, fp32=1.0, bandwidth=1.0, eager_launch=0.0,
                       graph_launch=0.0)

# Fitted on the H200 run (see the module docstring; bench_plan.py --fit prints how). Refitted when the planner's
# kernel count was corrected (a view by another name, rms_norm's CPU form and the composite ops it counted unlike
# the GPU: accounting.py) and the host's run-ahead bounded by the launch queue: eager_launch 19.1 -> 19.7 us (the
# 8B dual rollout at its corrected 1,472 kernels a step, the refreshing steps GPU-bound), fp32 0.47 -> 0.46 (the
# small preset's compiled rollout without a cache no longer moves the bytes of views and of rms_norm's CPU form).
H200_FIT = Calibration("h200-2026-11-26", tensor_core=0.69, tf32=0.55, fp32=0.46, bandwidth=0.86,
                       eager_launch=19.7e-6, graph_launch=1.72e-3)

DEFAULT = H200_FIT


H200_RUN = ("NVIDIA H200 SXM 141GB, driver 580.159.04, CUDA 13.0, torch 2.11.0+cu130, 16 CPU cores, commit b7790f6, "
            "2026-11-26 (../shared/gpu/measurements-h200-2026-11-26.md)")
# The second run, after issues 28 and 29: the bf16 gradient GEMMs, 17-kernel layers, compiled 8B rollouts. Its
# points (RECORDED_AFTER) entered no fit: the model fitted on the first run predicted them (benchmarks/RESULTS.md).
H200_RUN_2 = ("NVIDIA H200 SXM 141GB, driver 580.159.04, CUDA 13.0, torch 2.11.0+cu130, 16 CPU cores, the code of "
              "commit c0a5d6b, 2026-11-26 15:10-15:30 UTC (benchmarks/gpu_run.sh; benchmarks/RESULTS.md)")


# The fourth run, after dllm_fast::rope: its points (RECORDED_RUN_4) entered no fit either.
H200_RUN_4 = ("NVIDIA H200 SXM 141GB, driver 580.159.04, CUDA 13.0, torch 2.11.0+cu130, 16 CPU cores, the code of "
              "commits 9d33caf and 6da75b7, 2026-11-26 22:24-22:40 UTC (benchmarks/gpu_run.sh; benchmarks/RESULTS.md)")


@dataclass(frozen=True)
class Recorded:
    """One number the H200 run measured, and the calls that took it (dllm_fast.planning.predict): kind "head" or
    "rollout", `value` the median seconds of `predict.<kind>(gpu, **options)`; kind "engine", `value` two_pass's
    time per sample over naive's (bench_elbo --lora, micro-batch 1). kernels_per_step: bench_rollout's count,
    where it has one (run 1's by that time's rule, which also counted type queries, promote_types and
    result_type, as kernels). For the eager points of run 1, on the code the GPU ran (b7790f6, before issue 29's
    fused layers): kernels_then, the kernels that code launched as today's planner counts them (run on that code;
    for the rollouts bench_rollout's rule of today counts the same on it within 0.1%): a rollout's per step, an
    engine point's per call of each provider; so that the launch cost is checked against the kernels that were
    launched (predict.recorded's "predicted_then"). planned_kernels_then: a rollout's count by the planner of the
    time (it took `_unsafe_view`, a view, for a kernel: 7 a layer), kept as recorded. rope_kernel: whether the
    code measured rotated queries and keys with dllm_fast::rope (f611502 on); before, every point ran the three-op
    composite, and is predicted running it (its bytes are most of what that kernel removed)."""

    name: str
    kind: str
    options: dict = field(hash=False)
    value: float
    kernels_per_step: float | None = None
    planned_kernels_then: float | None = None
    kernels_then: float | dict[str, float] | None = field(default=None, hash=False)
    rope_kernel: bool = False


def _head(M: int, provider: str, backward: bool, ms: float, tf32_grad_gemms: bool = True) -> Recorded:
    # At b7790f6 the fused backward's two gradient GEMMs ran in TF32 on fp32 copies (tf32_grad_gemms).
    name = f"head {provider} {'forward + backward' if backward else 'forward'} M={M}"
    return Recorded(name, "head", dict(M=M, provider=provider, backward=backward,
                                       tf32_grad_gemms=tf32_grad_gemms and provider == "dllm_fast"), ms / 1e3)


_SMALL = dict(preset="small", batch=8, prompt=64, gen=128, block=32, steps=64, dtype=torch.float32)

RECORDED = (
    # bench_logprob.py --device cuda: bf16, d = 4096, V = 126464, median of 3
    _head(2048, "naive", False, 4.48), _head(2048, "naive", True, 11.4),
    _head(2048, "dllm_fast", False, 3.65), _head(2048, "dllm_fast", True, 23.8),
    _head(8192, "naive", False, 17.6), _head(8192, "naive", True, 48.1),
    _head(8192, "dllm_fast", False, 14.5), _head(8192, "dllm_fast", True, 91.5),
    # bench_rollout.py --device cuda --batch 8: LLaDA-8B shapes, random bf16 weights, prompt 200, gen 256,
    # block 32, 128 steps, T = 0 (the reference sampler is not planned: it reads the logits it samples from)
    Recorded("rollout 8B none, eager", "rollout", dict(cache="none"), 14.68, kernels_per_step=1538,
             planned_kernels_then=1622.3, kernels_then=1405.3),
    Recorded("rollout 8B dual, eager", "rollout", dict(cache="dual"), 4.13, kernels_per_step=1653,
             planned_kernels_then=1689.2, kernels_then=1472.2),
    # planned_kernels_then: the planner's count on b7790f6's code (planner branch 3dde9fa, predict.recorded);
    # kernels_then: today's planner (the count of accounting.py's rules) run on 3dde9fa's tree (b7790f6's models);
    # bench_rollout's rule of today on that tree, CPU: 1406.0, 1472.8, 205.8, 195.0
    # smoke.py generate_compiled: the small preset in fp32 (TF32 off), batch 8, prompt 64, gen 128, 64 steps
    Recorded("rollout small dual, eager", "rollout", dict(_SMALL, cache="dual"), 0.341, planned_kernels_then=227.3,
             kernels_then=206.3),
    Recorded("rollout small dual, compiled", "rollout", dict(_SMALL, cache="dual", compile=True), 0.111),
    Recorded("rollout small none, eager", "rollout", dict(_SMALL, cache="none"), 0.241, planned_kernels_then=216.4,
             kernels_then=195.4),
    Recorded("rollout small none, compiled", "rollout", dict(_SMALL, cache="none", compile=True), 0.176),
    # bench_elbo.py --device cuda --lora (r128 on q, k, v, up; bf16; prompt 200 + completion 512), micro-batch 1
    # kernels_then: each provider's kernels per call, today's planner on 3dde9fa's tree
    Recorded("engine two_pass / naive per sample, n_t=1", "engine", dict(n_t=1, micro_batch=1), 1.85,
             kernels_then=dict(naive=5184, two_pass=7379)),
    Recorded("engine two_pass / naive per sample, n_t=16", "engine", dict(n_t=16, micro_batch=1), 2.5,
             kernels_then=dict(naive=5184, two_pass=121304)),
)

_8B_ROLLOUT = dict(preset="llada-8b", batch=8, prompt=200, gen=256, block=32, steps=128, cache="dual")

# The second H200 run (H200_RUN_2), on today's code: entered no fit (see above).
RECORDED_AFTER = (
    # peers_logprob.py: forward + backward, bf16, d = 4096, V = 126464, median of 5; the gradients in bf16 GEMMs
    *(_head(M, provider, True, ms, tf32_grad_gemms=False) for M, provider, ms in (
        (2048, "naive", 11.53), (2048, "dllm_fast", 13.73), (2048, "dllm_grad", 15.18),
        (2048, "dllm_grad_lse", 13.37), (8192, "naive", 47.26), (8192, "dllm_fast", 56.12),
        (8192, "dllm_grad", 58.99), (8192, "dllm_grad_lse", 43.18))),
    # bench_rollout.py --device cuda --batch 8 (as in RECORDED), eager and compiled (CUDA graphs)
    Recorded("rollout 8B dual, eager (17-kernel layers)", "rollout", dict(_8B_ROLLOUT), 2.416, kernels_per_step=603.8),
    Recorded("rollout 8B dual, compiled", "rollout", dict(_8B_ROLLOUT, compile=True), 1.966),
    # gpu_smoke.py generate_compiled (as in RECORDED)
    Recorded("rollout small dual, eager (17-kernel layers)", "rollout", dict(_SMALL, cache="dual"), 0.161),
    Recorded("rollout small dual, compiled (17-kernel layers)", "rollout", dict(_SMALL, cache="dual", compile=True),
             0.107),
    Recorded("rollout small none, eager (17-kernel layers)", "rollout", dict(_SMALL, cache="none"), 0.238),
    Recorded("rollout small none, compiled (17-kernel layers)", "rollout", dict(_SMALL, cache="none", compile=True),
             0.180),
    # bench_elbo.py --device cuda --lora --micro-batch equal: naive and two_pass with n_t pairs per graph
    Recorded("engine two_pass / naive per sample, n_t=1, micro-batch 1", "engine", dict(n_t=1, micro_batch=1), 1.65),
    Recorded("engine two_pass / naive per sample, n_t=16, micro-batch 16", "engine", dict(n_t=16, micro_batch=16),
             1.35),
)

# The fourth H200 run (H200_RUN_4), bench_rollout.py --device cuda --batch 8 as above, queries and keys rotated by
# dllm_fast::rope: its first kernel (9d33caf: a block per row, a tenth of the bandwidth; profiled at 0.85 ms a
# compiled step) and its 16-byte packs (6da75b7). The planner prices the op at its bytes, so it predicts both
# compiled points alike. The eager point is the second call's machine (host-bound: the first call's, same code but
# the kernel, ran eager dual in 3.45 s).
RECORDED_RUN_4 = (
    Recorded("rollout 8B dual, compiled (rope kernel, a block per row)", "rollout", dict(_8B_ROLLOUT, compile=True),
             1.763, rope_kernel=True),
    Recorded("rollout 8B dual, compiled (rope kernel, 16-byte packs)", "rollout", dict(_8B_ROLLOUT, compile=True),
             1.706, rope_kernel=True),
    Recorded("rollout 8B dual, eager (rope kernel, 16-byte packs)", "rollout", dict(_8B_ROLLOUT), 2.38,
             kernels_per_step=539.8, rope_kernel=True),
)
