"""Mixture-of-experts layers (LLaDA2's): a sigmoid router with an expert bias and grouped top-k, routed SwiGLU
experts run as grouped GEMMs over the tokens sorted by expert, and a shared expert.

Routing, for each token x (`route`; the official LLaDA2 gate's order of operations and rounding):

    s = sigmoid(x W_r^T)                            in fp32 (router_dtype; fp64 for an fp64 model), no autocast
    b = s + expert_bias                             the bias steers the choice, never the weights
    group score = sum of each group's 2 best b;  keep the topk_group best groups (torch.topk, sorted=False)
    chosen = the top_k best b among the kept groups' experts (torch.topk, sorted: the largest first)
    w = s[chosen] / (sum s[chosen] + 1e-20) x routed_scaling_factor     (no normalisation when top_k = 1)
    y = sum_j w_j expert_{chosen_j}(x) + shared_expert(x)

The same torch ops with the same shapes, flags and dtypes as the official code, so the choice is the same,
exact ties included (torch.topk breaks ties by its own rule, which this reproduces by calling it the same way on
the same values). The weighted sum runs in the weights' dtype over the top_k slots in their chosen order, then
rounds to the activations' dtype, as the official code does. Mask tokens are routed like any other token.

Experts (`Experts`): every expert's gate and up projections are one stacked parameter [E, 2I, d] and its down
projection another, [E, d, I]; their state-dict entries keep the official per-expert names
(`experts.<e>.gate_proj.weight` ...) through LLaDA2Model's checkpoint hooks. A forward sorts the (token, slot)
pairs by expert (a stable argsort) and runs each projection for all experts at once:

- "grouped_mm": torch._grouped_mm over the sorted rows with per-expert offsets, no host sync; the default wherever
  it takes the rows: bf16 on CUDA (one grouped-GEMM kernel), under torch.compile and on fake tensors (the planner
  prices it as one grouped GEMM), and bf16, fp16 or fp32 in eager CPU mode (its CPU kernel, a GEMM per expert
  that has rows, without the loop's host syncs: near the loop's rollouts at llada2-mini's widths, and 4-5x the
  padded form's, benchmarks/bench_moe_rollout.py);
- "bmm": the sorted rows padded per expert into [E, cap, d] and multiplied by batched GEMMs (cap: the most rows
  any expert has, one host read; the tokens' count, a bound, where no value can be read: compiled or fake, E / k
  times the work). The default where torch._grouped_mm does not run (fp64; fp32 on CUDA, compiled or fake);
- "loop": one GEMM per expert that has rows, the official code's inference loop (host syncs; a benchmark baseline,
  never the default).

No Python loop over experts runs in a forward except under "loop". Under autocast, experts compute in the
autocast dtype (the rows and weights are cast once), as nn.Linear experts would.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch._guards import detect_fake_mode

from dllm_fast.models.layers import at_least_fp32, fuse_linears, projection_outputs

EXPERT_PROVIDERS = ("auto", "grouped_mm", "bmm", "loop")
NORMALISATION_EPSILON = 1e-20  # the official gate's


# -- routing ----------------------------------------------------------------------------------------------------

def route(x: torch.Tensor, weight: torch.Tensor, expert_bias: torch.Tensor, *, top_k: int, n_group: int,
          topk_group: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen [T, top_k] int64, weights [T, top_k] in the router's dtype, scores [T, E]) for tokens x [T, d]:
    the module docstring's equations, with the official gate's ops."""
    dtype = at_least_fp32(x.dtype)
    with torch.autocast(x.device.type, enabled=False):  # router_dtype fp32: no bf16 GEMM under autocast
        logits = F.linear(x.to(dtype), weight.to(dtype))
    scores = torch.sigmoid(logits)
    biased = scores + expert_bias
    T, E = biased.shape
    group_scores = biased.view(T, n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
    groups = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, groups, False)
    candidates = biased.view(T, n_group, -1).masked_fill(dropped.unsqueeze(-1), float("-inf")).view(T, E)
    chosen = torch.topk(candidates, k=top_k, dim=-1)[1]
    picked = torch.gather(scores, dim=1, index=chosen)
    weights = picked / (picked.sum(dim=-1, keepdim=True) + NORMALISATION_EPSILON) if top_k > 1 else picked
    return chosen, weights * scaling, scores


class Router(nn.Module):
    """The official `mlp.gate`: `weight` [E, d] and the `expert_bias` buffer [E] (in the checkpoint; set by the
    auxiliary-loss-free balancing of pre-training, not by gradients)."""

    def __init__(self, config):
        super().__init__()
        self.top_k, self.n_group, self.topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        chosen, weights, _ = route(x, self.weight, self.expert_bias, top_k=self.top_k, n_group=self.n_group,
                                   topk_group=self.topk_group, scaling=self.scaling)
        return chosen, weights


# -- experts ----------------------------------------------------------------------------------------------------

class Experts(nn.Module):
    """E SwiGLU experts of width I: `gate_up_proj` [E, 2I, d] (each expert's gate rows, then its up rows) and
    `down_proj` [E, d, I], the nn.Linear (out, in) layout of the official per-expert weights, stacked."""

    def __init__(self, num_experts: int, hidden_size: int, width: int):
        super().__init__()
        self.num_experts, self.hidden_size, self.width = num_experts, hidden_size, width
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * width, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, width))

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                provider: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """(y [T, d] in x's dtype, rows per expert [E] int64) for tokens x [T, d] routed to `chosen` [T, k] with
        `weights` [T, k]."""
        T, k = chosen.shape
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs by expert
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).index_add_(
            0, flat, torch.ones_like(flat))
        out = self.sorted_rows(x.index_select(0, order // k), counts, flat.index_select(0, order), T, provider)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=order.device))
        unsorted = out.index_select(0, inverse)  # back to (token, slot) order
        y = (unsorted.view(T, k, -1).to(weights.dtype) * weights.unsqueeze(-1)).sum(dim=1)
        return y.to(x.dtype), counts

    def sorted_rows(self, rows: torch.Tensor, counts: torch.Tensor, experts: torch.Tensor, tokens: int,
                    provider: str = "auto") -> torch.Tensor:
        """Each row's expert output [R, d] in the compute dtype, for `rows` [R, d] sorted by their expert
        `experts` [R] (this module's indices), `counts` [E] rows per expert; `tokens` bounds an expert's rows
        where none can be read (the "bmm" provider's cap). Expert parallelism calls it on a rank's received rows."""
        compute = rows.dtype
        if torch.is_autocast_enabled(rows.device.type):
            compute = torch.get_autocast_dtype(rows.device.type)
        rows = rows.to(compute)
        gate_up, down = self.gate_up_proj.to(compute), self.down_proj.to(compute)
        provider = choose_provider(provider, rows, self.width)
        return _PROVIDERS[provider](rows, counts, experts, gate_up, down, tokens)


def grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


def choose_provider(provider: str, rows: torch.Tensor, width: int) -> str:
    """The provider "auto" stands for (see the module docstring), or `provider` checked."""
    if provider not in EXPERT_PROVIDERS:
        raise ValueError(f"experts provider {provider!r} is not one of {EXPERT_PROVIDERS}.")
    if provider != "auto":
        if provider == "grouped_mm" and not _grouped_mm_takes(rows, width):
            raise ValueError(f"experts provider 'grouped_mm' needs torch._grouped_mm (torch >= 2.8), bf16 rows (or "
                             f"fp16/fp32 in eager CPU mode) and widths whose rows are 16-byte aligned (hidden "
                             f"{rows.shape[-1]}, expert {width} in {rows.dtype}); use 'bmm'.")
        return provider
    return "grouped_mm" if _grouped_mm_takes(rows, width) else "bmm"


def _grouped_mm_takes(rows: torch.Tensor, width: int) -> bool:
    """Whether torch._grouped_mm runs these rows: bf16 on CUDA, under torch.compile and on fake tensors (its CUDA
    kernel's and its meta kernel's rule); bf16, fp16 or fp32 in eager CPU mode (its reference kernel); rows and
    widths 16-byte aligned."""
    eager_cpu = rows.device.type == "cpu" and not torch.compiler.is_compiling() and detect_fake_mode(rows) is None
    dtypes = (torch.bfloat16, torch.float16, torch.float32) if eager_cpu else (torch.bfloat16,)
    if not grouped_mm_available() or rows.dtype not in dtypes:
        return False
    size = rows.element_size()
    return (rows.shape[-1] * size) % 16 == 0 and (width * size) % 16 == 0


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _grouped(rows, counts, experts, gate_up, down, tokens):
    offsets = counts.cumsum(0).to(torch.int32)
    hidden = _swiglu(torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offsets))
    return torch._grouped_mm(hidden, down.transpose(1, 2), offs=offsets)


def _padded(rows, counts, experts, gate_up, down, tokens):
    """Rows sorted by expert, padded to [E, cap, d]: slot = rank within the expert."""
    E = counts.shape[0]
    readable = not torch.compiler.is_compiling() and detect_fake_mode(rows) is None
    cap = max(int(counts.max()), 1) if readable else tokens  # an expert takes each token at most once
    starts = counts.cumsum(0) - counts
    slot = torch.arange(rows.shape[0], device=rows.device) - starts.index_select(0, experts)
    padded = rows.new_zeros(E, cap, rows.shape[-1]).index_put((experts, slot), rows)
    hidden = _swiglu(torch.bmm(padded, gate_up.transpose(1, 2)))
    return torch.bmm(hidden, down.transpose(1, 2))[experts, slot]


def _loop(rows, counts, experts, gate_up, down, tokens):
    outputs, start = [], 0
    for e, count in enumerate(counts.tolist()):
        if count:
            part = rows[start:start + count]
            outputs.append(F.linear(_swiglu(F.linear(part, gate_up[e])), down[e]))
            start += count
    return torch.cat(outputs) if outputs else rows.new_zeros(0, down.shape[1])


_PROVIDERS = {"grouped_mm": _grouped, "bmm": _padded, "loop": _loop}


# -- the layer --------------------------------------------------------------------------------------------------

class SwiGLU(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), gate and up one GEMM (layers.fuse_linears) under their official
    names: the dense layers' MLP and the shared expert."""

    def __init__(self, hidden_size: int, width: int):
        super().__init__()
        fuse_linears(self, "fused_gate_up", {"gate_proj": width, "up_proj": width}, hidden_size)
        self.down_proj = nn.Linear(width, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = projection_outputs(x, self.fused_gate_up, (self.gate_proj, self.up_proj)).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class MixtureOfExperts(nn.Module):
    """The official `mlp` of a mixture-of-experts layer: `gate` (Router), `experts`, `shared_experts` (when the
    config has them). `provider` picks the experts' GEMMs (EXPERT_PROVIDERS; "auto" by default). While a
    `router_load` context is open, each eager forward adds its rows per expert to `load`."""

    def __init__(self, config):
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        if config.num_shared_experts is not None:
            self.shared_experts = SwiGLU(config.hidden_size, config.moe_intermediate_size * config.num_shared_experts)
        self.provider = "auto"
        self.load: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        chosen, weights = self.gate(tokens)
        y, counts = self.experts(tokens, chosen, weights, self.provider)
        if self.load is not None and not torch.compiler.is_compiling():
            self.load.add_(counts)
        y = y.view(shape)
        if hasattr(self, "shared_experts"):
            y = y + self.shared_experts(x)
        return y


# -- balance statistics -----------------------------------------------------------------------------------------

@contextlib.contextmanager
def router_load(model):
    """Count the rows each expert of each mixture-of-experts layer of `model` receives in the eager forwards run
    inside (no host sync; compiled forwards are not counted). Yields a RouterLoad (empty for a model without
    experts); read `.metrics()` after the block."""
    layers = [m for m in model.modules() if isinstance(m, MixtureOfExperts)]
    load = RouterLoad([m.experts.num_experts for m in layers])
    for layer, counts in zip(layers, load.counts):
        layer.load = counts.to(layer.gate.weight.device)
    try:
        yield load
    finally:
        load.counts = [layer.load for layer in layers]
        for layer in layers:
            layer.load = None


class RouterLoad:
    """Rows per expert, one [E] int64 tensor per mixture-of-experts layer (router_load fills them)."""

    def __init__(self, experts: list[int]):
        self.counts = [torch.zeros(e, dtype=torch.long) for e in experts]

    def metrics(self) -> dict[str, float]:
        """Balance of the counted forwards, averaged over the layers (empty without experts or rows):
        router_load_max: the busiest expert's rows over the mean (1 is perfect balance); router_load_cv: the
        coefficient of variation of the rows per expert; router_idle_experts: the fraction of experts that got
        no row. One host sync."""
        counts = [c for c in self.counts if c.numel()]
        if not counts:
            return {}
        stacked = [c.double().cpu() for c in counts]  # one read of every layer
        if sum(float(c.sum()) for c in stacked) == 0:
            return {}
        rows = [(c.max() / c.mean(), c.std(unbiased=False) / c.mean(), (c == 0).double().mean())
                for c in stacked if c.sum() > 0]
        return {name: float(sum(r[i] for r in rows) / len(rows))
                for i, name in enumerate(("router_load_max", "router_load_cv", "router_idle_experts"))}


def expected_active_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Experts that receive at least one of `tokens` tokens when each picks top_k of num_experts uniformly: the
    experts whose weights a forward streams (the planner's estimate; a balanced router is close to uniform)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens) if tokens else 0.0


__all__ = ["EXPERT_PROVIDERS", "Experts", "MixtureOfExperts", "Router", "RouterLoad", "SwiGLU",
           "expected_active_experts", "grouped_mm_available", "route", "router_load"]
