"""The GPUs a plan can be made for: vendors' published peak dense FLOP/s, memory bandwidth and memory size.

Every figure is the vendor's datasheet value without structured sparsity (NVIDIA's tables print the sparse
figure with an asterisk, twice the dense one). Memory is the vendor's nominal size in 10^9 bytes, a little below
what the device reports (HBM stacks are sized in GiB), and the difference is left as headroom for the CUDA
context and the caching allocator. Sources:

- H100 SXM, H100 PCIe, H100 NVL: NVIDIA H100 Tensor Core GPU datasheet,
  https://www.nvidia.com/en-us/data-center/h100/ (BF16 1,979 / 1,513 / 1,671 TFLOPS with sparsity; TF32 989 /
  756 / 835; FP32 67 / 51 / 60 TFLOPS; 3.35 / 2.0 / 3.9 TB/s; 80 / 80 / 94 GB).
- H200 SXM: NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/ (BF16 1,979
  TFLOPS with sparsity, TF32 989, FP32 67; 4.8 TB/s; 141 GB).
- A100 SXM 80GB and 40GB: NVIDIA A100 Tensor Core GPU datasheet,
  https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
  (BF16 312 TFLOPS dense, TF32 156, FP32 19.5; 2,039 GB/s for 80GB, 1,555 GB/s for 40GB).
- L40S: NVIDIA L40S datasheet, https://www.nvidia.com/en-us/data-center/l40s/ (BF16 362.05 TFLOPS dense, TF32
  183, FP32 91.6; 864 GB/s; 48 GB GDDR6).

`interconnect`: the bus bandwidth (bytes/s per GPU, NCCL's busbw) a plan on several GPUs communicates at. An
assumption, not fitted: about 80% of one direction of the GPU-to-GPU link, what NCCL typically reaches on large
messages. NVLink 4 (H100/H200 SXM): 900 GB/s both directions, 450 each, so 360 GB/s; H100 NVL's NVLink bridge
600 GB/s (240); A100 SXM's NVLink 3 600 GB/s (240); PCIe Gen5 x16 (H100 PCIe) 64 GB/s a direction (51); PCIe
Gen4 x16 (L40S) 32 GB/s a direction (25.6). 0: unknown.

The links of a plan on several nodes (`planning/links.py`), named here and each overridable from `plan`'s flags:

- `internode`: the bus bandwidth of a collective whose ranks span nodes, per GPU. An assumption, not fitted: one
  400 Gb/s NIC per GPU (ConnectX-7 InfiniBand NDR, as in DGX/HGX H100 and H200 nodes; 200 Gb/s HDR in DGX A100),
  50 GB/s a direction, of which NCCL reaches about 80% on large messages: 40 GB/s (A100: 20). 0 for parts sold
  without a reference node design (PCIe, NVL, L40S): give `--inter-node-bandwidth`.
- `host_link`: host-device copies (`--fsdp-offload true`), about 80% of one direction of the GPU's PCIe link:
  Gen5 x16 (H100, H200) 64 GB/s, 51.2; Gen4 x16 (A100, L40S) 32 GB/s, 25.6.
- `LATENCY`: seconds a collective costs beyond its bytes (NCCL's launch and its ring's hops, small messages): an
  assumption of about 15 us inside an NVLink node and 30 us across nodes (NCCL's measured small-message latencies
  on such nodes are of that order); every collective pays it once.
- `HOST_MEMORY_BANDWIDTH`: the bytes/s a node's CPUs stream through host memory for an optimizer step run on the
  host (`--fsdp-offload true`), shared by the node's GPUs' ranks. An assumption: two sockets of 8 DDR5-4800
  channels peak at 614 GB/s; PyTorch's CPU AdamW reaches about half: 300 GB/s.
- `GPUS_PER_NODE`: 8, the HGX/DGX node (`--gpus-per-node`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GPU:
    """Peak dense FLOP/s by kind of arithmetic, bandwidth in bytes/s, memory in bytes."""

    name: str
    description: str
    bf16_flops: float  # tensor cores, bf16 and fp16 inputs
    tf32_flops: float  # tensor cores, fp32 inputs with TF32 allowed (off by default in PyTorch)
    fp32_flops: float  # CUDA cores: fp32 GEMMs and anything else in fp32
    bandwidth: float
    memory: int
    interconnect: float = 0.0  # bus bandwidth between GPUs, bytes/s (see the module docstring)
    internode: float = 0.0  # bus bandwidth per GPU of a collective across nodes, bytes/s (0: unknown)
    host_link: float = 0.0  # host-device copies, bytes/s a direction

    def peak_flops(self, dtype: torch.dtype, compute: str | None = None, *, allow_tf32: bool = False) -> float:
        """The peak a GEMM with operands of `dtype` can reach, with products in `compute` ("fp32": accumulated in
        fp32, on the tensor cores for bf16/fp16 operands; "tf32": fp32 operands rounded to TF32 for the tensor
        cores; "fp64"). compute None: what PyTorch's matmul does, TF32 only when allow_tf32
        (torch.backends.cuda.matmul.allow_tf32, off by default). fp64 runs at about half the fp32 rate on these
        parts."""
        if dtype in (torch.bfloat16, torch.float16):
            return self.bf16_flops
        if dtype == torch.float64 or compute == "fp64":
            return self.fp32_flops / 2
        if compute is None:
            compute = "tf32" if allow_tf32 else "fp32"
        return self.tf32_flops if compute == "tf32" else self.fp32_flops


_T, _G = 1e12, 1e9
GPUS: dict[str, GPU] = {gpu.name: gpu for gpu in (
    GPU("h100", "NVIDIA H100 SXM 80GB", 989.4 * _T, 494.7 * _T, 66.9 * _T, 3.35e12, 80 * _G, 360e9, 40e9, 51.2e9),
    GPU("h100-pcie", "NVIDIA H100 PCIe 80GB", 756.5 * _T, 378.0 * _T, 51.2 * _T, 2.0e12, 80 * _G, 51.2e9, 0.0,
        51.2e9),
    GPU("h100-nvl", "NVIDIA H100 NVL 94GB", 835.5 * _T, 417.5 * _T, 60.0 * _T, 3.9e12, 94 * _G, 240e9, 0.0, 51.2e9),
    GPU("h200", "NVIDIA H200 SXM 141GB", 989.4 * _T, 494.7 * _T, 66.9 * _T, 4.8e12, 141 * _G, 360e9, 40e9, 51.2e9),
    GPU("a100-80gb", "NVIDIA A100 SXM 80GB", 312.0 * _T, 156.0 * _T, 19.5 * _T, 2.039e12, 80 * _G, 240e9, 20e9,
        25.6e9),
    GPU("a100-40gb", "NVIDIA A100 SXM 40GB", 312.0 * _T, 156.0 * _T, 19.5 * _T, 1.555e12, 40 * _G, 240e9, 20e9,
        25.6e9),
    GPU("l40s", "NVIDIA L40S 48GB", 362.05 * _T, 183.0 * _T, 91.6 * _T, 864e9, 48 * _G, 25.6e9, 0.0, 25.6e9),
)}
GPUS_PER_NODE = 8
LATENCY = {"intra": 15e-6, "inter": 30e-6}  # seconds a collective costs beyond its bytes, inside / across nodes
HOST_MEMORY_BANDWIDTH = 300e9  # bytes/s a node's CPUs stream for an optimizer step on the host


def gpu(name: str) -> GPU:
    """The GPU named `name` (case-insensitive; h100 is the SXM part)."""
    key = name.lower()
    if key not in GPUS:
        raise ValueError(f"--gpu {name!r} is not a GPU the planner knows; choose one of {', '.join(GPUS)}.")
    return GPUS[key]
