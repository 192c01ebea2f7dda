"""The Triton kernel of the LM head: one tile of logits = hidden @ W_chunk^T (a GEMM on the tensor cores) whose
epilogue reduces or differentiates the softmax in registers, so that no [M, V] logits ever reach memory.

One kernel, two epilogues (MODE, a compile-time constant):

- MODE_LSE (the forward): each [BM, BN] tile of logits leaves one number per row, the tile's logsumexp
  (m + log sum exp(z - m)), in a [M, tiles] buffer, and the target's logit where the tile holds it. The host
  folds the tiles with one torch.logsumexp per chunk ([M, C / BN] floats: 64 a row at C = 16384, BN = 256).
- MODE_GRAD (the known-gradient walk): with the rows' logsumexp known, each tile writes d(logits) = g_target *
  onehot - g_softmax * exp(z - lse), computed in fp32 and rounded once to the model's dtype (bf16), the tile's
  sum of exp(z - lse) (the measured normaliser S, 1 for an exact lse) and the target's logit. The gradient GEMMs
  then read that bf16 chunk in cuBLAS (torch.mm), at cuBLAS's own rate.

The walk over a vocabulary chunk of C columns is then three GEMMs and no other pass over [M, C]
(ops/logprobs_triton.py):

    this kernel:  d(logits)[M, C] (bf16)  = epilogue(hidden[M, d] @ W[v0:v0+C, d]^T)      2 M C d FLOPs
    torch.mm:     grad_hidden[M, d]       += d(logits) @ W[v0:v0+C]                        2 M C d FLOPs
    torch.mm:     grad_W[v0:v0+C, d]      += d(logits)^T @ hidden   (a trained head only)   2 M C d FLOPs

and the lean forward + backward four (MODE_LSE's pass, then the walk with its lse).

Design for sm_90 (H100 / H200), bf16, M = 8192, d = 4096, V = 126464 (chunks of 16384 columns: 8 of them):

- Tiles BM x BN x BK = 128 x 256 x 64, 8 warps (two warpgroups, each holding a 64 x 256 wgmma accumulator: 128
  fp32 registers a thread), 3 stages: 48 KB of operands a stage (A 16 KB, B 32 KB), 144 KB in flight, plus the
  64 KB bf16 d(logits) tile staged for its TMA store: 208 KB of the 227 KB of shared memory, one CTA an SM. 128 x
  256 is the largest tile whose accumulator leaves registers for the epilogue; it does 2 * 128 * 256 / ((128 +
  256) * 2) = 85 FLOP per byte brought from L2 (9.4 TB/s of L2 at 800 TFLOP/s: near what the H100's L2 gives,
  the usual reason Triton's GEMMs trail cuBLAS's multicast clusters by 5-10%). GROUP_M = 8: eight row tiles
  (8 MB of hidden) sweep the chunk's columns together, so each 2 MB weight tile is read from HBM once per group
  (the weight chunk 8 times, 1 GB a chunk: 1,000 FLOP per HBM byte, far above the H200's ridge of 206).
- Operands arrive by TMA (host-made tensor descriptors, USE_DESC) on sm_90 for 16-bit operands with rows
  16-byte aligned; by masked pointer loads otherwise (older GPUs, fp32/fp64, odd widths).
- The epilogue adds per element a subtraction, an exp2 (MUFU: 16 a clock an SM, 2,048 clocks a tile), an int32
  compare with the row's target, the bf16 conversion and a 64 KB TMA store: about 4,000 clocks a tile against
  about 81,000 for its 2 * 128 * 256 * 4096 FLOPs at torch.mm's 800 TFLOP/s (4,096 dense bf16 FLOP a clock an
  SM at peak). Not overlapped with the next tile's mainloop (one CTA an SM, no warp specialisation): 5%.
  MODE_LSE's epilogue is two row reductions and stores a float a row: 2-3%.
- Expected, by this arithmetic: the kernel at 88-93% of torch.mm on the same chunk shapes (the mainloop at
  93-97% of cuBLAS's, less the epilogue), at the issue's 90% line. Chunks of 16384 columns also cost both 3% of
  wave quantisation (4,096 tiles on 132 SMs: 31.03 waves). The GPU run's sweep (benchmarks/bench_logprob.py
  --triton-sweep, SM90_SWEEP) times the alternatives: persistent (a program an SM looping over tiles), 256 x
  128, 128 x 128 with 4 warps, and 128 x 128 in 2 stages (96 KB: two CTAs an SM, one's epilogue under the
  other's mainloop); DLLM_FAST_TRITON_HEAD_TILES picks one without a code change.
- Bytes beyond the GEMMs' operands, per walk: d(logits) written once (2.1 GB) and read by each gradient GEMM
  (4.1 GB, inside those compute-bound GEMMs); grad_hidden's fp32 accumulation, which torch cannot do in cuBLAS
  for bf16 operands (addmm's out_dtype wants its addend in the operands' dtype), through an fp32 [M, d] product
  and one add a chunk: 16 bytes an entry, 4.3 GB, about 1 ms at 4.1 TB/s; grad_W's rows are added in cuBLAS
  (beta = 1, bf16 C read and rounded once). Walk, logsumexp known, trained head: 11.4-12.0 ms (kernel) + 2 x
  10.6 (cuBLAS) + about 1.5 (accumulation, per-row work, launches) = 34-35 ms against naive PyTorch's 47.3 ms
  (1.36-1.39x); frozen head 23-24 ms; the lean forward + backward or the walk without the logsumexp 45-46 ms
  (1.03x). Design arithmetic from run 2's torch.mm timing, not measurements.

The interpreter (TRITON_INTERPRET=1 set before triton is imported; CPU tensors) runs the same source: tests
exercise the TMA and the pointer paths, grid and persistent, there. Two of its bf16 operations differ from the
GPU's (Triton 3.9): tl.dot multiplies the raw bits of bf16 operands, and fp32 -> bf16 truncates. So in the
interpreter (UPCAST) bf16 tiles are widened to fp32 before the dot (products of bf16 numbers are exact in fp32:
the sums are the tensor cores', up to the order of the fp32 additions), and d(logits) is rounded to nearest even
by hand before its store, as the GPU rounds it.

Triton is imported only when a kernel is first launched: importing this module needs none (the planner prices
the kernels on fake tensors without it).
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass

import torch

MODE_LSE, MODE_GRAD = 0, 1
tl = None  # triton.language once a kernel is built (_compiled): the kernel source's global


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration. persistent: one program per SM (times `programs_per_sm`) looping over tiles,
    else one program per tile."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    persistent: bool = False

    def label(self) -> str:
        kind = "persistent" if self.persistent else "grid"
        return (f"{self.block_m}x{self.block_n}x{self.block_k} g{self.group_m} w{self.num_warps} "
                f"s{self.num_stages} {kind}")


# sm_90 (H100/H200), bf16: see the module docstring. The sweep's candidates: each fits 227 KB of shared memory.
SM90 = TileConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3)
SM90_SWEEP = (
    SM90,
    TileConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3, persistent=True),
    TileConfig(256, 128, 64, group_m=8, num_warps=8, num_stages=3),
    TileConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=4),
    TileConfig(128, 128, 64, group_m=8, num_warps=4, num_stages=4),
    TileConfig(128, 128, 64, group_m=8, num_warps=4, num_stages=2),  # 96 KB: two CTAs an SM, epilogues overlapped
    TileConfig(128, 256, 32, group_m=8, num_warps=8, num_stages=4),
)
# sm_80 / sm_89 (A100, L40S): 4 stages of 128 x 128 x 32 with cp.async.
SM80 = TileConfig(128, 128, 32, group_m=8, num_warps=4, num_stages=4)
# The interpreter: tiles small enough that the tests' tiny shapes span several (masked edges, the GROUP_M order),
# large enough that its per-program cost (tens of milliseconds) stays a few seconds a test.
INTERPRETER = TileConfig(32, 64, 32, group_m=2, num_warps=4, num_stages=1)


def default_config(device: torch.device) -> TileConfig:
    """The tile configuration for tensors on `device` (a CUDA device's compute capability; the interpreter for
    CPU tensors). DLLM_FAST_TRITON_HEAD_TILES="BMxBNxBK,group,warps,stages[,persistent]" overrides it (the GPU
    run's sweep)."""
    override = os.environ.get("DLLM_FAST_TRITON_HEAD_TILES")
    if override:
        return parse_config(override)
    if device.type != "cuda":
        return INTERPRETER
    major, _ = torch.cuda.get_device_capability(device)
    return SM90 if major >= 9 else SM80


def planned_config(device_type: str) -> TileConfig:
    """The configuration a plan prices for a device type (the planner runs fake CPU tensors for a GPU): sm_90's
    for "cuda", the interpreter's otherwise."""
    return SM90 if device_type == "cuda" else INTERPRETER


def parse_config(text: str) -> TileConfig:
    """"128x256x64,8,8,3" or "128x256x64,8,8,3,persistent" -> TileConfig."""
    try:
        parts = [p.strip() for p in text.split(",")]
        bm, bn, bk = (int(x) for x in parts[0].lower().split("x"))
        group, warps, stages = (int(x) for x in parts[1:4])
        persistent = len(parts) > 4 and parts[4] == "persistent"
        if len(parts) > 5 or (len(parts) == 5 and not persistent):
            raise ValueError
    except ValueError:
        raise ValueError(f"DLLM_FAST_TRITON_HEAD_TILES={text!r}: expected 'BMxBNxBK,group_m,num_warps,num_stages' "
                         "with an optional ',persistent', e.g. '128x256x64,8,8,3'.") from None
    return TileConfig(bm, bn, bk, group, warps, stages, persistent)


def tiles_per_row(columns: int, config: TileConfig) -> int:
    """The per-row partials a launch over `columns` columns writes (one per column tile)."""
    return -(-columns // config.block_n)


def triton_importable() -> bool:
    """Whether `import triton` works here (it ships with torch's CUDA wheels on Linux)."""
    return _triton() is not None


def compiles_for(device: torch.device) -> bool:
    """Whether the kernels serve `device`: a CUDA device of compute capability 8.0 or more (bf16 tensor cores),
    triton importable and not in its interpreter, and a first small bf16 call of both epilogues (compiled with the
    device's tiles) agrees with torch. That probe runs once per device, eagerly; a failure warns once, naming it,
    and the callers choose the compiled kernels instead. (Inside torch.compile's tracing, a device not yet probed
    is taken on trust: its first eager call probes it.)"""
    if device.type != "cuda" or not torch.cuda.is_available() or not triton_importable() or interpreting():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(index)[0] < 8:
        return False
    if index not in _PROBED:
        if torch.compiler.is_compiling():
            return True
        _PROBED[index] = _probe(torch.device("cuda", index))
    return _PROBED[index]


_PROBED: dict[int, bool] = {}  # CUDA device index -> whether the probe passed


def _probe(device: torch.device) -> bool:
    """Both epilogues on 64 bf16 rows of width 64 against 300 columns, against torch in fp32."""
    rows, width, vocab = 64, 64, 300
    try:
        gen = torch.Generator().manual_seed(0)
        hidden = torch.randn(rows, width, generator=gen).to(device, torch.bfloat16)
        weight = (torch.randn(vocab, width, generator=gen) / 4).to(device, torch.bfloat16)
        targets = torch.randint(0, vocab, (rows,), generator=gen).to(device)
        logits = hidden.float() @ weight.float().T
        config = default_config(device)
        found = torch.full((rows,), float("nan"), device=device)
        lse = chunk_logsumexp(hidden, weight, targets, 0, found, config)
        grad = torch.empty(rows, vocab, dtype=torch.bfloat16, device=device)
        ones = torch.ones(rows, device=device)
        sums = chunk_softmax_grad(hidden, weight, targets, 0, lse, ones, ones, grad, found, config)
        want = torch.nn.functional.one_hot(targets, vocab) - torch.softmax(logits, 1)
        ok = (torch.allclose(lse, logits.logsumexp(1), rtol=1e-4, atol=1e-4)
              and torch.allclose(found, logits.gather(1, targets[:, None]).squeeze(1), rtol=1e-4, atol=1e-4)
              and torch.allclose(sums, torch.ones_like(sums), atol=1e-3)
              and torch.allclose(grad.float(), want, rtol=1e-2, atol=1e-3))
        reason = "its results differ from torch's"
    except Exception as error:  # noqa: BLE001 (any failure to compile or run: the compiled kernels take over)
        ok, reason = False, f"{type(error).__name__}: {error}"
    if not ok:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        warnings.warn(f"The Triton LM-head kernels fail on {name} ({reason}); the compiled kernels are used "
                      "instead (backend='triton' still forces them).", stacklevel=3)
    return ok


@functools.cache
def _triton():
    try:
        import triton
        import triton.language  # noqa: F401
    except ImportError:
        return None
    return triton


def missing_triton_message() -> str:
    return ("the Triton LM-head kernels need the triton package (it ships with torch's CUDA wheels on Linux; "
            "`pip install triton` elsewhere)")


# ---------------------------------------------------------------------------------------------------------
# The kernel source: triton.jit builds it when first launched (compiled, or interpreted under TRITON_INTERPRET=1).

def _head_kernel(a, b, targets, lse, g_target, g_softmax, dl, partial, target_logit,
                 M, N, v0, ld_dl,
                 K: tl.constexpr, MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP_M: tl.constexpr, USE_DESC: tl.constexpr, UPCAST: tl.constexpr,
                 FP64: tl.constexpr, EXACT_DOT: tl.constexpr, PERSISTENT: tl.constexpr):
    """a: hidden [M, K]; b: the weight chunk [N, K] (tensors, or TMA descriptors under USE_DESC, as is dl);
    targets [M] int64 (absolute ids; the chunk starts at column v0); partial [M, cdiv(N, BN)] (the tile's
    logsumexp under MODE_LSE, its sum of exp(z - lse) under MODE_GRAD); target_logit [M], written where the
    target falls in this chunk; lse, g_target, g_softmax [M] and dl [M, ld_dl] (MODE_GRAD only). One tile a
    program, or (PERSISTENT) each program the tiles pid, pid + programs, ... K (the width) is a compile-time
    constant: one model, one width, and a loop over it that needs no run-time bound."""
    pid = tl.program_id(0)
    if PERSISTENT:
        tiles = ((M + BM - 1) // BM) * ((N + BN - 1) // BN)  # (not tl.cdiv: a library call costs the interpreter)
        tile = pid
        while tile < tiles:
            _tile(tile, a, b, targets, lse, g_target, g_softmax, dl, partial, target_logit, M, N, v0, ld_dl,
                  K, MODE, BM, BN, BK, GROUP_M, USE_DESC, UPCAST, FP64, EXACT_DOT)
            tile += tl.num_programs(0)
    else:
        _tile(pid, a, b, targets, lse, g_target, g_softmax, dl, partial, target_logit, M, N, v0, ld_dl,
              K, MODE, BM, BN, BK, GROUP_M, USE_DESC, UPCAST, FP64, EXACT_DOT)


def _head_tile(tile, a, b, targets, lse, g_target, g_softmax, dl, partial, target_logit, M, N, v0, ld_dl,
               K: tl.constexpr, MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               GROUP_M: tl.constexpr, USE_DESC: tl.constexpr, UPCAST: tl.constexpr, FP64: tl.constexpr,
               EXACT_DOT: tl.constexpr):
    """One [BM, BN] tile of the chunk's logits and its epilogue (the arguments: _head_kernel's)."""
    acc_type = tl.float64 if FP64 else tl.float32
    tiles_m = (M + BM - 1) // BM
    tiles_n = (N + BN - 1) // BN
    group = GROUP_M * tiles_n
    # GROUP_M row tiles sweep the columns together: each weight tile is read from L2 by GROUP_M programs.
    first_m = (tile // group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (tile % group) % group_rows
    pid_n = (tile % group) // group_rows
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < M
    col_ok = cols < N

    acc = tl.zeros((BM, BN), dtype=acc_type)
    ks = tl.arange(0, BK)
    for k in range(0, K, BK):
        if USE_DESC:
            x = a.load([pid_m * BM, k])
            y = b.load([pid_n * BN, k])
        else:
            k_ok = (k + ks) < K
            x = tl.load(a + rows.to(tl.int64)[:, None] * K + (k + ks)[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            y = tl.load(b + cols.to(tl.int64)[:, None] * K + (k + ks)[None, :],
                        mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            y = y.to(tl.float32)
        if EXACT_DOT:
            acc = tl.dot(x, tl.trans(y), acc, input_precision="ieee", out_dtype=acc_type)
        else:
            acc = tl.dot(x, tl.trans(y), acc)

    # The target's column in this tile (-1 where it is elsewhere; int32, one register a compare): its logit
    # is read from the accumulator.
    target = tl.load(targets + rows, mask=row_ok, other=-1) - v0
    found = (target >= pid_n * BN) & (target < pid_n * BN + BN) & (target < N)
    column = tl.where(found, target - pid_n * BN, -1).to(tl.int32)
    hit = tl.arange(0, BN)[None, :] == column[:, None]
    tl.store(target_logit + rows, tl.sum(tl.where(hit, acc, 0.0), axis=1), mask=row_ok & found)
    partial_at = partial + rows.to(tl.int64) * tiles_n + pid_n
    if MODE == 0:
        z = tl.where(col_ok[None, :], acc, float("-inf"))
        top = tl.max(z, axis=1)
        shift = tl.where(top == float("-inf"), 0.0, top)  # a tile without a finite logit sums to 0
        if FP64:
            total = tl.sum(tl.exp(z - shift[:, None]), axis=1)
        else:
            total = tl.sum(tl.exp2((z - shift[:, None]) * 1.4426950408889634), axis=1)
        tl.store(partial_at, shift + tl.log(total), mask=row_ok)
    else:
        row_lse = tl.load(lse + rows, mask=row_ok, other=0.0)
        onehot = tl.load(g_target + rows, mask=row_ok, other=0.0)
        softmax = tl.load(g_softmax + rows, mask=row_ok, other=0.0)
        if FP64:
            e = tl.exp(acc - row_lse[:, None])
        else:
            e = tl.exp2((acc - row_lse[:, None]) * 1.4426950408889634)
        e = tl.where(col_ok[None, :], e, 0.0)
        grad = tl.where(hit, onehot[:, None], 0.0) - softmax[:, None] * e
        tl.store(partial_at, tl.sum(e, axis=1), mask=row_ok)
        if UPCAST:  # the interpreter truncates fp32 to bf16: round to nearest even first, as the GPU does
            bits = grad.to(tl.uint32, bitcast=True)
            grad = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        if USE_DESC:
            dl.store([pid_m * BM, pid_n * BN], grad.to(dl.dtype))
        else:
            tl.store(dl + rows.to(tl.int64)[:, None] * ld_dl + cols[None, :], grad.to(dl.dtype.element_ty),
                     mask=row_ok[:, None] & col_ok[None, :])


_tile = None  # _head_tile as triton.jit built it (_compiled): the kernel source's global


@functools.cache
def _compiled():
    """The kernel as triton.jit builds it: compiled for the GPU, or run by the interpreter when TRITON_INTERPRET=1
    was set before triton was imported (the interpreter cannot mix with compiled kernels in one process: triton's
    own library functions are built in one mode or the other when it is imported)."""
    global tl, _tile
    triton = _triton()
    if triton is None:
        raise RuntimeError(missing_triton_message() + ".")
    tl = triton.language  # the kernel's globals, bound before triton.jit reads the source
    _tile = triton.jit(_head_tile)
    return triton.jit(_head_kernel)


def interpreting() -> bool:
    """Whether triton runs kernels in its interpreter (TRITON_INTERPRET=1 when it was imported)."""
    triton = _triton()
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_runnable(device: torch.device) -> None:
    """Raise, naming the way out, when the kernels cannot run on tensors of `device` here."""
    if _triton() is None:
        raise RuntimeError(f"backend='triton' was requested, but {missing_triton_message()}.")
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(f"backend='triton' runs the Triton kernels on CUDA tensors, and on {device.type} tensors "
                           "only in triton's interpreter: set TRITON_INTERPRET=1 before triton is imported (the "
                           "tests do), or use backend='compiled' on the CPU.")


def uses_tma(tensors, device: torch.device) -> bool:
    """Whether the operands can arrive by TMA: sm_90+, 16-bit elements (a 64-element K tile is one 128-byte
    swizzled row), each row's bytes and each base address 16-byte aligned."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    return all(t.element_size() == 2 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
               for t in tensors)


def _launch(mode, hidden, w_chunk, targets, v0, partial, target_logit, config: TileConfig, *, lse=None,
            g_target=None, g_softmax=None, dl=None, tma: bool | None = None) -> None:
    triton = _triton()
    if triton is None:
        raise RuntimeError(missing_triton_message() + ".")
    device = hidden.device
    interpreted = interpreting()
    kernel = _compiled()
    M, K = hidden.shape
    N = w_chunk.shape[0]
    operands = [hidden, w_chunk] + ([dl] if dl is not None else [])
    use_desc = uses_tma(operands, device) if tma is None else tma
    a, b, d_out = hidden, w_chunk, dl
    if use_desc:
        from triton.tools.tensor_descriptor import TensorDescriptor

        a = TensorDescriptor.from_tensor(hidden, [config.block_m, config.block_k])
        b = TensorDescriptor.from_tensor(w_chunk, [config.block_n, config.block_k])
        if dl is not None:
            d_out = TensorDescriptor(dl, list(dl.shape), list(dl.stride()), [config.block_m, config.block_n])
    if dl is None:  # MODE_LSE: the gradient arguments are never read
        d_out, lse, g_target, g_softmax = partial, partial, partial, partial
    tiles = triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n)
    programs = tiles
    if config.persistent:  # one program per SM (the interpreter: 3, so that each loops over several tiles)
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 3
        programs = min(tiles, sms)
    dtype = hidden.dtype
    kernel[(programs,)](
        a, b, targets, lse, g_target, g_softmax, d_out, partial, target_logit,
        M, N, v0, dl.stride(0) if dl is not None else 0,
        K=K, MODE=mode, BM=config.block_m, BN=config.block_n, BK=config.block_k, GROUP_M=config.group_m,
        PERSISTENT=config.persistent,
        USE_DESC=use_desc, UPCAST=interpreted and dtype == torch.bfloat16,
        FP64=dtype == torch.float64, EXACT_DOT=dtype in (torch.float32, torch.float64) or interpreted,
        num_warps=config.num_warps, num_stages=config.num_stages)


def chunk_logsumexp(hidden, w_chunk, targets, v0: int, target_logit, config: TileConfig, *,
                    tma: bool | None = None) -> torch.Tensor:
    """[M] logsumexp of hidden @ w_chunk^T (MODE_LSE), and target_logit[i] set where row i's target lies in
    [v0, v0 + len(w_chunk)). One kernel, then one reduction over the [M, tiles] partials."""
    M, N = hidden.shape[0], w_chunk.shape[0]
    partial = torch.empty(M, tiles_per_row(N, config), dtype=target_logit.dtype, device=hidden.device)
    _launch(MODE_LSE, hidden, w_chunk, targets, v0, partial, target_logit, config, tma=tma)
    return torch.logsumexp(partial, dim=1)


def chunk_softmax_grad(hidden, w_chunk, targets, v0: int, lse, g_target, g_softmax, dl, target_logit,
                       config: TileConfig, *, tma: bool | None = None) -> torch.Tensor:
    """Writes dl[M, N] = g_target * onehot(target) - g_softmax * exp(hidden @ w_chunk^T - lse) (rounded once to
    dl's dtype) and target_logit where the target lies in the chunk; returns each row's sum of exp(z - lse)
    over the chunk (MODE_GRAD). One kernel, then one reduction over the [M, tiles] partials."""
    M, N = hidden.shape[0], w_chunk.shape[0]
    partial = torch.empty(M, tiles_per_row(N, config), dtype=target_logit.dtype, device=hidden.device)
    _launch(MODE_GRAD, hidden, w_chunk, targets, v0, partial, target_logit, config, lse=lse, g_target=g_target,
            g_softmax=g_softmax, dl=dl, tma=tma)
    return partial.sum(dim=1)
