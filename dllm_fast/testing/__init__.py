"""Test tooling, kept out of the product: nothing under dllm_fast imports it, except `DLLM_FAST_BACKEND=emulated_cuda`
(a test-only backend) in ops/backend.py.

- `emulation`: csrc/cuda's kernels run on the CPU by a host emulator (`python -m dllm_fast.testing.emulation`);
- `syncs`: `SyncCounter` counts host syncs on the CPU, with the lines that cause them;
- `memory`: the peak of torch's allocator over a block and the peak resident memory of a fresh process.
"""
