"""Test tooling, kept out of the product: nothing else under dllm_fast imports it.

- `emulation`: csrc/cuda's kernels run on the CPU by a host emulator (`python -m dllm_fast.testing.emulation`
  builds it; `--run` runs a whole program on it);
- `syncs`: `SyncCounter` counts host syncs on the CPU, with the lines that cause them;
- `memory`: the peak of torch's allocator over a block and the peak resident memory of a fresh process.
"""
