"""The rotary-embedding op (dllm_fast.ops.rope) against its plain-PyTorch twin and the composite it replaced in a
LLaDA block: the same values bit for bit on every backend and device, the checks that name the bad argument, and
one kernel in a denoising step where the composite took three."""

import pytest
import torch
from torch.library import opcheck

from dllm_fast import ops, reference
from dllm_fast.models.layers import apply_rope, rope_tables

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def qkv_and_tables(B=2, L=5, H=4, Hkv=2, D=16, dtype=torch.bfloat16, device="cpu", start=3):
    """A fused QKV projection viewed as heads [B, L, H + 2 Hkv, D] (large positions: angles of many turns) and
    the tables of its positions."""
    qkv = (torch.randn(B, L, H + 2 * Hkv, D, dtype=torch.float64) * 3).to(dtype).to(device)
    positions = torch.arange(start, start + 9 * L, 9, device=device).expand(B, L)
    accumulate = torch.float64 if dtype == torch.float64 else torch.float32
    return qkv, rope_tables(positions, D, 10000.0, accumulate)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotated", [0, 3, 6, 8])
def test_rope_equals_the_twin_and_the_composite_bit_for_bit(device, dtype, rotated):
    qkv, tables = qkv_and_tables(dtype=dtype, device=device)
    out = ops.rope(qkv, tables, rotated)
    twin = reference.rope(qkv.cpu(), tables.cpu(), rotated)
    assert out.shape == qkv.shape and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out.cpu(), twin)
    composite = torch.cat((apply_rope(qkv[:, :, :rotated], tables), qkv[:, :, rotated:]), dim=2)
    assert torch.equal(out, composite)
    assert torch.equal(out[:, :, rotated:], qkv[:, :, rotated:])  # the heads past rotated_heads are copied


def test_rope_matches_rotate_half_written_out(device):
    """The tables' folded signs and the roll are rotate-half RoPE: x * cos + cat(-x2, x1) * sin, in fp64."""
    qkv, tables = qkv_and_tables(dtype=torch.float64, device=device, H=2, Hkv=1)
    B, L, heads, D = qkv.shape
    positions = torch.arange(3, 3 + 9 * L, 9, dtype=torch.float64, device=device)
    inverse = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64, device=device) / D)
    angles = torch.cat([positions[:, None] * inverse] * 2, dim=-1)[None, :, None]  # [1, L, 1, D]
    x1, x2 = qkv[..., :D // 2], qkv[..., D // 2:]
    expected = qkv * angles.cos() + torch.cat((-x2, x1), dim=-1) * angles.sin()
    torch.testing.assert_close(ops.rope(qkv, tables, heads), expected, rtol=1e-12, atol=1e-12)


def test_rope_takes_strided_activations_and_broadcast_tables(device):
    """A view into a wider projection (the layout a fused GEMM's output has) and tables shared by the batch
    (stride 0) give what contiguous copies give."""
    wide, tables = qkv_and_tables(H=6, Hkv=2, device=device)
    view = wide[:, :, 1:9]
    shared = tables[:, :1].expand(2, 2, *tables.shape[2:])
    out = ops.rope(view, shared, 5)
    assert torch.equal(out, ops.rope(view.contiguous(), shared.contiguous(), 5))
    assert torch.equal(out, reference.rope(view, shared, 5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D, offset", [(16, 0), (12, 0), (16, 1), (6, 0)])
def test_rope_at_every_alignment(device, dtype, D, offset):
    """The CUDA kernel moves the widest aligned packs the layout allows (16 bytes; 2 elements when D / 2 or a
    stride is not a multiple of that; 1 when a pointer is off by an element): each width gives the twin's bits."""
    qkv, tables = qkv_and_tables(D=D, dtype=dtype, device=device)
    flat = torch.zeros(qkv.numel() + offset, dtype=dtype, device=device)
    shifted = flat[offset:].view(qkv.shape)
    shifted.copy_(qkv)
    out = ops.rope(shifted, tables, 5)
    assert torch.equal(out.cpu(), reference.rope(qkv.cpu(), tables.cpu(), 5))


def test_rope_with_a_gradient_runs_the_differentiable_twin():
    qkv, tables = qkv_and_tables(B=1, L=3, H=2, Hkv=1, D=4, dtype=torch.float64)
    qkv.requires_grad_()
    assert torch.autograd.gradcheck(lambda x: ops.rope(x, tables, 3), (qkv,))
    with torch.no_grad():
        assert torch.equal(ops.rope(qkv, tables, 3), reference.rope(qkv, tables, 3))


@pytest.mark.parametrize("case, message", [
    ("three_dims", "x must be a \\[B, L, heads, D\\] tensor"),
    ("odd_d", "D = 5 must be even"),
    ("int_x", "x must be one of"),
    ("table_dtype", "tables must be torch.float32 of shape"),
    ("table_shape", "tables must be torch.float32 of shape \\(2, 2, 5, 1, 16\\)"),
    ("too_many_heads", "rotated_heads=9 must be an int in \\[0, 8\\]"),
    ("negative_heads", "rotated_heads=-1"),
])
def test_rope_names_the_bad_argument(case, message):
    qkv, tables = qkv_and_tables()
    args = {"three_dims": (qkv[0], tables, 2), "odd_d": (torch.randn(2, 5, 8, 5), tables, 2),
            "int_x": (qkv.long(), tables, 2), "table_dtype": (qkv, tables.double(), 2),
            "table_shape": (qkv, tables[:, :, :4], 2), "too_many_heads": (qkv, tables, 9),
            "negative_heads": (qkv, tables, -1)}[case]
    with pytest.raises((ValueError, TypeError), match=message):
        ops.rope(*args)


def test_rope_op_registration_passes_opcheck():
    qkv, tables = qkv_and_tables()
    opcheck(torch.ops.dllm_fast.rope.default, (qkv, tables, 6))
    opcheck(torch.ops.dllm_fast.rope.default, (qkv.float(), tables, 0))


def test_a_denoising_step_rotates_with_the_op_and_tokens_match_the_composite(monkeypatch):
    """Without a gradient a LLaDA block calls the op once (per layer and call), and a greedy rollout through it
    decodes the tokens the composite decodes."""
    from dllm_fast import generate
    from dllm_fast.models import LLaDAConfig, LLaDAModel
    from dllm_fast.ops import twins

    model = LLaDAModel.with_random_weights(LLaDAConfig.preset("tiny"), seed=0).eval()
    prompts = torch.randint(0, model.mask_token_id, (2, 6))
    options = dict(gen_length=8, block_length=4, steps=4, temperature=0.0, cache="dual")
    calls = []
    real = torch.ops.dllm_fast.rope

    def counting(*args):
        calls.append(args[2])
        return real(*args)

    monkeypatch.setattr(torch.ops.dllm_fast, "rope", counting)
    fused = generate(model, prompts, **options).completion_ids
    assert calls and set(calls) == {model.config.n_heads + model.config.n_kv_heads}
    monkeypatch.setattr(torch.ops.dllm_fast, "rope", lambda x, tables, heads: twins.rope(x, tables, heads))
    assert torch.equal(generate(model, prompts, **options).completion_ids, fused)
