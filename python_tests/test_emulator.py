"""The host emulator of the CUDA kernels (python_tests/emulation) tested on its own kernels (python_tests/emulation/selftest.cu):
threads that cooperate, and the mistakes it must report by the kernel's name instead of hanging."""

import os
import subprocess
import sys

import pytest
import torch

from dllm_fast.testing import emulation

pytestmark = pytest.mark.emulated_cuda


@pytest.fixture(scope="module")
def emulated():
    return emulation.load()


def selftest(data, kernel, blocks, threads):
    return torch.ops.dllm_fast_emulated.emulator_selftest(data, kernel, blocks, threads)


@pytest.mark.parametrize("threads", [1, 32, 40, 256])
def test_threads_cooperate_through_shared_memory_and_barriers(emulated, threads):
    data = torch.arange(3 * threads, dtype=torch.float32)
    out = selftest(data, "rotate_through_shared", 3, threads).view(3, threads)
    assert torch.equal(out, data.view(3, threads).roll(-1, dims=1))


@pytest.mark.parametrize("threads", [32, 33, 57, 64, 1024])
def test_warp_collectives_exchange_among_the_lanes_of_the_mask(emulated, threads):
    """Shuffles (down, xor, index, up) and ballots over full and partial warps, against the definitions."""
    x = torch.randn(threads)
    out = selftest(torch.cat([x, torch.zeros(5 * threads)]), "warp_collectives", 1, threads)[threads:].view(threads, 5)
    for warp in range(0, threads, 32):
        values = x[warp:warp + 32]
        lanes = len(values)
        torch.testing.assert_close(out[warp:warp + lanes, 0][0], values.sum())  # lane 0 holds the sum
        butterfly = values.clone()  # the kernel's xor loop, lanes beyond the warp's last adding nothing
        for lane_mask in (1, 2, 4, 8, 16):
            butterfly = torch.stack([butterfly[lane] + (butterfly[lane ^ lane_mask] if lane ^ lane_mask < lanes else 0)
                                     for lane in range(lanes)])
        torch.testing.assert_close(out[warp:warp + lanes, 1], butterfly, rtol=1e-5, atol=1e-5)
        assert torch.equal(out[warp:warp + lanes, 2], values[3 % lanes].expand(lanes))
        torch.testing.assert_close(out[warp:warp + lanes, 3], values.cumsum(0), rtol=1e-5, atol=1e-5)
        ballot = sum(1 << lane for lane in range(lanes) if values[lane] > 0)
        assert (out[warp:warp + lanes, 4] == float(ballot)).all()


def test_atomics_are_atomic(emulated):
    blocks, threads = 5, 70
    out = selftest(torch.zeros(1 + 4 * blocks), "atomics", blocks, threads)
    assert out[0] == blocks * threads
    per_counter = [len(range(i, threads, 4)) for i in range(4)]
    assert out[1:].view(blocks, 4).tolist() == [per_counter] * blocks


@pytest.mark.parametrize("kernel, threads, message", [
    ("exit_before_barrier", 32, r"threads 0, 2, .* wait at the __syncthreads\(\) at selftest.cu:\d+, which threads "
                                r"1, 3, .* never reach: they have exited"),
    ("divergent_barriers", 32, r"threads wait at different __syncthreads\(\): thread 0 at selftest.cu:\d+, "
                               r"thread 1 at selftest.cu:\d+"),
    ("barrier_against_shuffle", 32, r"deadlock: no thread can go on; threads 0-15 wait at the __syncthreads\(\) .*"
                                    r"threads 16-31 wait in warp collectives"),
    ("shuffle_with_exited_lane", 32, r"thread \(31, 0, 0\): exited while lane 0 of its warp waits for it in "
                                     r"__shfl_down_sync at selftest.cu:\d+"),
    ("shuffle_past_the_block", 33, r"mask 0xffffffff: the mask names lanes 1-31, which this warp does not have"),
    ("read_unwritten_shared", 4, r"thread \(0, 0, 0\): reads element 1 of a shared float\[8\] that no thread of "
                                 r"this block has written"),
    ("read_without_barrier", 4, r"thread \(1, 0, 0\): reads element 0 of a shared float\[8\], written by thread 0 "
                                r"since the last __syncthreads\(\) \(a race"),
    ("write_after_read_without_barrier", 4, r"thread \(1, 0, 0\): writes element 1 of a shared float\[8\], read by "
                                            r"thread 0 since the last __syncthreads\(\) \(a race"),
    ("shared_index_out_of_bounds", 9, r"thread \(8, 0, 0\): shared memory index 8 is outside its array \[0, 8\)"),
])
def test_mistakes_are_reported_with_the_kernel_name(emulated, kernel, threads, message):
    with pytest.raises(RuntimeError, match=rf"unspecified launch failure \(emulated\): kernel {kernel}, block "
                                           rf"\(0, 0, 0\) of grid \(1, 1, 1\) with {threads} threads.*{message}"):
        selftest(torch.zeros(64), kernel, 1, threads)


def test_a_bad_launch_configuration_is_rejected(emulated):
    with pytest.raises(RuntimeError, match=r"invalid configuration argument \(emulated\): kernel "
                                           r"rotate_through_shared: block \(1025, 1, 1\) is not a valid block"):
        selftest(torch.zeros(2048), "rotate_through_shared", 1, 1025)
    emulated.set_grid_limit_x(4)
    try:
        with pytest.raises(RuntimeError, match=r"grid \(5, 1, 1\) is not a valid grid: gridDim.x in \[1, 4\]"):
            selftest(torch.zeros(5 * 32), "rotate_through_shared", 5, 32)
    finally:
        emulated.set_grid_limit_x(2**31 - 1)
    with pytest.raises(RuntimeError, match="no self-test kernel named nonsense"):
        selftest(torch.zeros(4), "nonsense", 1, 1)


@pytest.mark.skipif(emulation.enabled() != "asan",
                    reason="needs the AddressSanitizer build (DLLM_FAST_EMULATED_CUDA=asan)")
def test_an_out_of_bounds_read_is_reported_by_address_sanitizer(emulated):
    code = ("import torch; from dllm_fast.testing import emulation; emulation.load(); "
            "torch.ops.dllm_fast_emulated.emulator_selftest(torch.zeros(8), 'read_past_the_end', 1, 4)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, timeout=600)
    assert run.returncode != 0
    assert "heap-buffer-overflow" in run.stderr and "read_past_the_end" in run.stderr, run.stderr[-3000:]


def test_the_launch_arithmetic_stays_within_the_grid_limit(emulated):
    """Unit test of the launchers' grid sizes (csrc/cuda/launch.cuh) around gridDim.x's limit of 2^31 - 1: no
    tensor of 2^31 rows needed. Beyond the limit the kernels stride over the rows."""
    limit = 2**31 - 1
    assert emulated.grid_limit_x() == limit
    for rows, blocks in [(0, 1), (1, 1), (257, 257), (limit - 1, limit - 1), (limit, limit), (limit + 1, limit),
                         (2**32 + 5, limit), (2**40, limit)]:
        assert emulated.row_grid(rows, limit) == blocks
    for items, blocks in [(1, 1), (256, 1), (257, 2), (256 * limit, limit), (256 * limit + 1, limit), (2**50, limit)]:
        assert emulated.item_grid(items, 256, limit) == blocks
