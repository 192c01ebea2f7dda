"""Building blocks of Llama-style diffusion transformers, shared by the model families (LLaDA; SDAR-style block
diffusion): RMSNorm, rotary embeddings, projections fused into one GEMM yet addressable by their official names,
and attention over a KV cache's span.

Each piece computes what the official models compute, in the same order of roundings, with as few kernels as
eager PyTorch allows: a denoising step runs every layer, and on a GPU the host's dispatch of each op, not the
FLOPs, bounds an eager step (benchmarks/bench_rollout.py counts them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """Norms and RoPE run in fp32; an fp64 model (gradcheck, exact tests) keeps fp64."""
    return torch.promote_types(dtype, torch.float32)


# -- RMSNorm ----------------------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)), normalized in at least fp32 and rounded to x's dtype before the scale: LLaDA's (and
    Llama's) order, two roundings in bf16. torch's rms_norm is one kernel on CUDA; it scales before rounding, so a
    bf16 input takes the scale as a second kernel (the tokens stay those of the official model)."""
    shape = (x.shape[-1],)
    if x.dtype == at_least_fp32(x.dtype) and weight.dtype == x.dtype:
        return F.rms_norm(x, shape, weight, eps)
    return F.rms_norm(x, shape, None, eps) * weight



class ConfigTokenIds:
    """The model contract's special ids, as every native family reads them from its config."""

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def eos_token_id(self) -> int:
        return self.config.eos_token_id

    @property
    def eot_token_id(self) -> int | None:
        return self.config.eot_token_id

class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


# -- Rotary embeddings (rotate-half, non-interleaved; angles in at least fp32) ----------------------------------

def _inverse_frequencies(head_dim: int, theta: float, dtype: torch.dtype, device) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=dtype) / head_dim
    return torch.reciprocal(theta**exponents)


def rope_tables(position_ids: torch.Tensor, head_dim: int, theta: float,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tables `apply_rope` multiplies by, once per forward: [2, B, L, 1, head_dim] in `dtype` (fp32, or fp64
    for fp64 models) for positions [B, L] and activations laid out [B, L, heads, head_dim] (a fused QKV GEMM's
    output, viewed). Entry 0 is cos(angle); entry 1 is sin(angle) on the first half and -sin(angle) on the
    second, the signs of rotate-half moved onto the table (and rolled with it, see apply_rope)."""
    freqs = position_ids.to(dtype)[..., None] * _inverse_frequencies(head_dim, theta, dtype, position_ids.device)
    cos, sin = freqs.cos(), freqs.sin()
    tables = torch.cat((cos, cos, sin, -sin), dim=-1)  # [B, L, 2 * head_dim]
    return tables.unflatten(-1, (2, 1, head_dim)).movedim(-3, 0)


def apply_rope(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [B, L, heads, D] (queries and keys together: one call for both), computed in the
    tables' dtype and rounded once to x's: a product with both tables, a roll, a sum (differentiable; without a
    gradient, dllm_fast.ops.rope computes the same values in one kernel).

    x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1), equals x * cos + roll(x * s) where
    s = cat(sin, -sin) (tables[1]) and roll moves the halves: the same products and sums, bit for bit."""
    products = x.unsqueeze(0) * tables  # [2, B, L, heads, D]
    return (products[0] + products[1].roll(x.shape[-1] // 2, dims=-1)).to(x.dtype)


def rotary_tables(
    position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [B, 1, L, head_dim] in `dtype`, for positions [B, L] and activations [B, H, L, D] (the layout
    of `apply_rotary`; `rope_tables` and `apply_rope` launch fewer kernels)."""
    freqs = position_ids.to(dtype)[..., None] * _inverse_frequencies(head_dim, theta, dtype, position_ids.device)
    angles = torch.cat((freqs, freqs), dim=-1)[:, None]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [B, H, L, D] with `rotary_tables`' cos and sin, computed in at least fp32 and returned
    in x's dtype (the same values as `apply_rope`)."""
    wide = x.to(at_least_fp32(x.dtype))
    first, second = wide.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return (wide * cos + rotated * sin).to(x.dtype)


# -- Attention ------------------------------------------------------------------------------------------------

# SDPA's memory-efficient kernel (the one a bias allows on CUDA) copies a bias whose rows are not 16-aligned.
_BIAS_ALIGNMENT = 16


def padding_bias(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, S] mask (1 = real token) -> additive attention bias [B, 1, 1, S]: 0 on real keys, dtype-min on padding.

    Made once per forward and shared by every layer: SDPA would turn a boolean mask into this bias in every layer
    (one more kernel each). Its rows are 16-aligned in memory, so the memory-efficient kernel takes it as is."""
    B, S = attention_mask.shape
    aligned = -(-S // _BIAS_ALIGNMENT) * _BIAS_ALIGNMENT
    bias = torch.zeros((B, 1, 1, aligned), dtype=dtype, device=attention_mask.device)[..., :S]
    return bias.masked_fill_(attention_mask[:, None, None, :] == 0, torch.finfo(dtype).min)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Bidirectional SDPA: q [B, H, L, D], k and v [B, Hkv, S, D] (strided views of a cache or a fused projection
    are fine: the last dim is contiguous), bias None or additive [B, 1, 1, S]. Without a bias the flash kernel
    applies (on CUDA, in bf16/fp16), with one the memory-efficient kernel. Grouped-query attention shares each
    key head among H / Hkv query heads: inside the kernel without a bias; with one (the memory-efficient kernel
    has no grouped form) by repeating the keys."""
    if k.shape[1] != q.shape[1]:
        if bias is None:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


# -- Fused projections -----------------------------------------------------------------------------------------

class FusedLinear(nn.Module):
    """One weight [sum(out_features), in_features] behind several bias-free projections of the same input (q, k
    and v; gate and up): one GEMM instead of one per projection (vLLM fuses at load time the same way).

    The weight is the only parameter; each part is a `ProjectionSlice` registered by its official name (see
    `fuse_linears`), whose weight is a view of its rows. The parts, not this module, appear in state dicts, under
    their official names and shapes, so checkpoints keep the official layout. `named_parameters` shows the fused
    weight (an optimizer updates it whole, which is the same update as the parts')."""

    def __init__(self, in_features: int, out_features: Sequence[int]):
        super().__init__()
        self.in_features = in_features
        self.out_features = tuple(out_features)
        self.weight = nn.Parameter(torch.empty(sum(self.out_features), in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        pass  # the parts save their rows under their own names

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # The fused weight is not required (the parts load it), but loads when present: torch.distributed's
        # set_model_state_dict adds each parameter under its own name before the parts overwrite the rows.
        if prefix + "weight" in state_dict:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class _FusedRows(torch.Tensor):
    """A view of some rows of a fused weight that a `.data = tensor` assignment writes through (PEFT's
    merge(safe_merge=True) and DoRA's unmerge assign `base_layer.weight.data`): the values are copied into the
    fused weight, where an ordinary view would be rebound and the fused weight left unchanged."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # results of ops on it are plain tensors

    @property
    def data(self):
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if value.shape != self.shape:
            raise ValueError(f"cannot assign a tensor of shape {tuple(value.shape)} to the rows of a fused weight "
                             f"of shape {tuple(self.shape)}; the fused projections keep their shapes.")
        with torch.no_grad():
            torch.Tensor.data.__get__(self).copy_(value)


class ProjectionSlice(nn.Linear):
    """Rows [start, stop) of a FusedLinear's weight, as an nn.Linear without a parameter of its own.

    PEFT adapts it like any nn.Linear (LoRA wraps it as the wrapper's base_layer); its `weight` is a view of the
    fused weight, so in-place merges reach the fused weight, and its state-dict entry is its rows, under its own
    name (`...q_proj.weight`, or `...q_proj.base_layer.weight` inside a PEFT wrapper, as for an nn.Linear).

    forward(x, base_output=None): with `base_output` (its rows of the fused GEMM's output, computed once for all
    parts by the owning block) it returns that instead of recomputing it; a PEFT wrapper passes the keyword
    through to its base layer and adds its own delta, so LoRA, disable_adapter and merged adapters behave as on a
    plain nn.Linear while the base GEMM stays fused."""

    def __init__(self, fused: FusedLinear, start: int, stop: int):
        nn.Module.__init__(self)
        self.in_features, self.out_features = fused.in_features, stop - start
        self.register_parameter("bias", None)
        self.start, self.stop = start, stop
        self.__dict__["fused"] = fused  # not a submodule: the owner registers the fused weight once

    @property
    def weight(self) -> torch.Tensor:
        rows = self.fused.weight[self.start:self.stop]
        return rows.as_subclass(_FusedRows) if type(rows) is torch.Tensor else rows

    def forward(self, x: torch.Tensor, base_output: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.fused.weight[self.start:self.stop]) if base_output is None else base_output

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        rows = self.fused.weight[self.start:self.stop]
        destination[prefix + "weight"] = rows if keep_vars else rows.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k != key)
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            return
        value = state_dict[key]
        if tuple(value.shape) != (self.out_features, self.in_features):
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                              f"checkpoint, the shape in current model is {(self.out_features, self.in_features)}.")
            return
        fused = self.fused
        if local_metadata.get("assign_to_params_buffers", False) and (
                fused.weight.device != value.device or fused.weight.dtype != value.dtype):
            # assign=True: the fused weight takes the parts' dtype and device (a meta skeleton gets memory); the
            # first part to load allocates it, NaN until every part has written its rows.
            full = torch.full(fused.weight.shape, float("nan"), dtype=value.dtype, device=value.device)
            fused.weight = nn.Parameter(full, requires_grad=fused.weight.requires_grad)
        with torch.no_grad():
            _copy_rows(fused.weight, self.start, value)


def _copy_rows(weight: torch.Tensor, start: int, value: torch.Tensor) -> None:
    """weight[start : start + len(value)] = value, also where weight is a DTensor sharded by rows (FSDP2) and
    value whole: each rank copies the rows it holds."""
    if not _is_dtensor(weight):
        weight[start:start + value.shape[0]].copy_(value)
        return
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if _is_dtensor(value):
        value = value.full_tensor()
    local = weight.to_local()
    shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    if any(o != 0 for o in offset[1:]) or tuple(shape[1:]) != tuple(weight.shape[1:]):
        raise NotImplementedError(f"loading the parts of a fused weight sharded as {weight.placements}: only "
                                  "sharding by rows (FSDP2's Shard(0)) is supported.")
    lo, hi = max(start, offset[0]), min(start + value.shape[0], offset[0] + shape[0])
    if lo < hi:
        local[lo - offset[0]:hi - offset[0]].copy_(value[lo - start:hi - start].to(local.device))


def _is_dtensor(tensor: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def fuse_linears(owner: nn.Module, fused_name: str, parts: dict[str, int], in_features: int) -> FusedLinear:
    """Register on `owner` a FusedLinear `fused_name` and, after it, one ProjectionSlice per part (name -> out
    features, in order): owner.<name> is an nn.Linear over the part's rows. Registration order keeps the
    state-dict order of separate nn.Linear parts (the fused module saves nothing of its own), and each part is
    initialised as an nn.Linear of its own would be, in the same order (kaiming-uniform rows drawn part by part):
    a model built after torch.manual_seed gets the weights it had with separate layers."""
    fused = FusedLinear(in_features, list(parts.values()))
    owner.add_module(fused_name, fused)
    start = 0
    for name, out in parts.items():
        part = ProjectionSlice(fused, start, start + out)
        part.reset_parameters()
        owner.add_module(name, part)
        start += out
    return fused


def projection_outputs(x: torch.Tensor, fused: FusedLinear, parts: Sequence[nn.Module]) -> torch.Tensor:
    """The fused GEMM's output [..., sum(out)] for input x, with any adapter of a part (a PEFT wrapper in place of
    its ProjectionSlice) added to that part's rows. Without adapters: one GEMM. With plain LoRA wrappers
    (`lora_deltas`): the same GEMM, each wrapper's deltas added in place into its rows, the values PEFT's forward
    gives, without the concatenation (nor, in the backward, a zero-filled full-width gradient per part). Otherwise
    each wrapper gets its base rows through `base_output`, and one concatenation. A part replaced by a module that
    does not wrap its ProjectionSlice (e.g. a plain nn.Linear) is called alone."""
    base = F.linear(x, fused.weight)
    if all(isinstance(part, ProjectionSlice) for part in parts):
        return base
    lean = []
    for part in parts:
        if isinstance(part, ProjectionSlice):
            continue
        deltas = lora_deltas(part, x) if isinstance(getattr(part, "base_layer", None), ProjectionSlice) else None
        if deltas is None or any(delta.dtype != base.dtype for delta in deltas):
            break
        lean.append((part.base_layer, deltas))
    else:
        for inner, deltas in lean:
            rows = base[..., inner.start:inner.stop]
            for delta in deltas:
                rows.add_(delta)  # PEFT's `result = result + delta`, in place: the same rounding
        return base
    outputs = []
    for part in parts:
        inner = wrapped_slice(part)
        if inner is None:
            outputs.append(part(x))
            continue
        rows = base[..., inner.start:inner.stop]
        outputs.append(rows if part is inner else part(x, base_output=rows))
    return torch.cat(outputs, dim=-1)


def adapted_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x) for an nn.Linear, or for a PEFT LoRA wrapper of one its base output with `lora_deltas` added (the
    values PEFT's forward gives, without its copies of x under autocast)."""
    deltas = lora_deltas(module, x) if isinstance(getattr(module, "base_layer", None), nn.Linear) else None
    if deltas is None:
        return module(x)
    out = module.base_layer(x)
    if any(delta.dtype != out.dtype for delta in deltas):
        return module(x)
    for delta in deltas:
        out = out + delta
    return out


def lora_deltas(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor] | None:
    """What a PEFT LoRA wrapper adds to its base layer's output for input x, one delta per active adapter in
    PEFT's order, each computed as PEFT's forward computes it: lora_B(lora_A(x)) * scaling. None when `module` is
    not such a wrapper in its plain state (merged, adapters disabled, a variant such as DoRA, active dropout), or
    when x's dtype is not the adapters' and autocast is off: the caller then calls the module.

    PEFT first casts x to the adapters' dtype (fp32 master weights on a bf16 base), which autocast then casts
    back: bf16 -> fp32 is exact, so under autocast x goes in as it is, saving two copies of x (and two of its
    gradient) per adapter."""
    lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
    if not isinstance(lora_a, nn.ModuleDict) or not isinstance(lora_b, nn.ModuleDict):
        return None
    if getattr(module, "merged", True) or getattr(module, "disable_adapters", True):
        return None
    variants, dora = getattr(module, "lora_variant", {}), getattr(module, "use_dora", {})
    autocast = torch.is_autocast_enabled(x.device.type)
    deltas = []
    for name in module.active_adapters:
        if name not in lora_a.keys():
            continue
        dropout = module.lora_dropout[name]
        if name in variants or dora.get(name, False) or not (
                isinstance(dropout, nn.Identity) or (isinstance(dropout, nn.Dropout) and not dropout.training)):
            return None
        if not autocast and x.dtype != lora_a[name].weight.dtype:
            return None
        scaling = module.scaling[name]
        if _power_of_two(scaling):  # on the rank-wide hidden: the same values (a power of two scales exactly, the
            deltas.append(lora_b[name](lora_a[name](x) * scaling))  # GEMM's products and sums with it), a
        else:  # kernel over [rows, r] instead of [rows, out_features], forward and backward
            deltas.append(lora_b[name](lora_a[name](x)) * scaling)
    return deltas


def _power_of_two(value) -> bool:
    return isinstance(value, (int, float)) and value > 0 and math.frexp(value)[0] == 0.5


def wrapped_slice(part: nn.Module) -> ProjectionSlice | None:
    """The ProjectionSlice `part` is or wraps (through PEFT's `base_layer` chain), or None."""
    while not isinstance(part, ProjectionSlice):
        part = getattr(part, "base_layer", None)
        if part is None:
            return None
    return part
