"""The fake world a plan runs in: the model's weights and everything computed from them are fake tensors (shapes,
dtypes and devices, no memory and no arithmetic), while the small data a step steers by is real.

A trainer step reads data on the host: token ids are range-checked, masks pick the rows to score, an objective's
value is checked for finiteness, the engine skips pairs whose gradient weight is zero. A fake tensor has no value
to read, so `PlanningFakeMode` keeps such tensors real, as FakeTensorMode's constants (a fake tensor that carries
its real value): every tensor created without fake inputs (prompts, masks, random draws from the trainer's
generators, lp buffers) and every result of ops on constants alone stays a constant, up to `constant_bytes`
per tensor. What the model computes cannot be known; the plan assumes (see `Assumptions`):

- model outputs are finite (isfinite is all True, isnan and isinf all False on fake tensors);
- `sample_tokens` draws the lowest token id it may return at every position, with confidence `confidence`
  (EOS, EoT and the mask token are avoided: completions fill their whole length, the most work for scoring);
- `masked_logprobs` returns log-prob `logprob` at every scored position.

Everything else (ratios, advantages, which pairs the engine scores) follows from these by real arithmetic.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._mode_utils import no_dispatch

from dllm_fast.planning.accounting import flat_values
from torch.utils._pytree import tree_map_only

_DEVICE = torch.ops.prim.device.default
_TO_COPY = torch.ops.aten._to_copy.default
_NEVER_PROPAGATED = {torch.ops.aten._nested_tensor_from_tensor_list.default}  # as FakeTensorMode
_NOT_CONSTANT = object()
# Real tensors above this size stay fake: no device-scale buffer is ever allocated on the host.
DEFAULT_CONSTANT_BYTES = 256 << 20


@dataclass(frozen=True)
class Assumptions:
    """What a plan assumes of the values a model computes (see the module docstring).

    confidence: the confidence of every sampled token; below a threshold decoder's threshold, a step unmasks one
        token (the most steps), at or above it the whole block at once.
    logprob: the log-probability masked_logprobs returns at every scored position.
    avoid_ids: token ids sampling never returns (EOS, EoT, the mask token), so completions never end early.
    """

    confidence: float = 0.5
    logprob: float = -1.0
    avoid_ids: frozenset[int] = frozenset()


class PlanningFakeMode(FakeTensorMode):
    """FakeTensorMode whose constants cover the step's small data (see the module docstring)."""

    def __init__(self, assumptions: Assumptions = Assumptions(), *, constant_bytes: int = DEFAULT_CONSTANT_BYTES,
                 shortcut_constants: bool = True):
        """shortcut_constants: an op on constants alone is computed without FakeTensorMode's cache attempt
        (`_on_constants`), one on constants and model outputs with the constants' values left out, so that
        FakeTensorMode's cache serves it (`_without_constants`); False runs both through FakeTensorMode's own
        path (the same results, slower: for tests)."""
        super().__init__()
        self.shortcut_constants = shortcut_constants
        self.assumptions = assumptions
        self.constant_bytes = constant_bytes
        self._assumed_outputs = _assumed_outputs()
        self._fake_factories = 0
        self._depth = 0  # > 1 inside another op's fake implementation (e.g. _to_copy's empty_strided)
        self._writes_nothing_table: dict = {}  # op -> _writes_nothing(op)

    def may_turn_const(self, t: torch.Tensor) -> bool:
        return (not self.is_our_fake(t) and t.device.type != "meta" and t.layout == torch.strided
                and t.numel() * t.element_size() <= self.constant_bytes)

    def dispatch(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:  # a tensor's .device: the hot path
            return super().dispatch(func, types, args, kwargs)
        kwargs = kwargs or {}
        tensors = [a for a in flat_values((args, kwargs)) if isinstance(a, torch.Tensor)]
        shadowed = None
        if tensors and self._outgrows_constants(func, tensors, args, kwargs):
            # computed on the constants' values, as both paths below would, it would allocate on the host what
            # no constant may hold (a [B, L, L] mask of long prompts): computed fake, without their values
            self._depth += 1
            try:
                return super().dispatch(func, types, _mapped(args, self._valueless),
                                        {name: _mapped(value, self._valueless) for name, value in kwargs.items()})
            finally:
                self._depth -= 1
        if tensors and self.shortcut_constants:
            out = self._on_constants(func, tensors, args, kwargs)
            if out is not _NOT_CONSTANT:
                return out
            shadowed = self._without_constants(func, tensors, args, kwargs)
        self._depth += 1
        try:
            if shadowed is None:
                out = super().dispatch(func, types, args, kwargs)
            else:
                try:
                    out = super().dispatch(func, types, *shadowed)
                except Exception:  # it needs their values (or fails with them too, and raises below)
                    out = super().dispatch(func, types, args, kwargs)
        finally:
            self._depth -= 1
        if not tensors:  # a factory: real when small enough
            return out if self._depth else self._real_factory(func, args, kwargs, out)
        assumed = self._assumed_outputs.get(func.overloadpacket)
        if assumed is not None and not all(is_constant(a) for a in tensors):
            return assumed(self, args, out)
        return out

    def _on_constants(self, func, tensors, args, kwargs):
        """An op whose tensor inputs are all constants of this mode, computed as FakeTensorMode's constant
        propagation computes it (the op on the values, each output a constant), without the cache-key attempt
        and argument flattening that precede it there: about a third of a plan's ops are on the step's small
        data. _NOT_CONSTANT leaves the op to FakeTensorMode: an op that writes its inputs, draws random numbers
        or changes a view in place, or one whose output cannot be a constant (it then runs again there, as an op
        that writes nothing may)."""
        if not self._writes_nothing(func) or torch.Tag.nondeterministic_seeded in func.tags:
            return _NOT_CONSTANT
        for t in tensors:
            if not (type(t) is FakeTensor and t.constant is not None and t.fake_mode is self):
                return _NOT_CONSTANT
        if func is _TO_COPY and kwargs.get("device") is not None and torch.device(kwargs["device"]).type != "cpu":
            return _NOT_CONSTANT  # as FakeTensorMode: no device initialised for a constant
        with no_dispatch():
            out = func(*_mapped(args, _value), **{name: _mapped(value, _value) for name, value in kwargs.items()})
        outputs = [t for t in flat_values(out) if isinstance(t, torch.Tensor)]
        if not all(self.may_turn_const(t) for t in outputs):
            return _NOT_CONSTANT
        if isinstance(out, torch.Tensor):
            return self._as_constant(out)
        return tree_map_only(torch.Tensor, self._as_constant, out)

    def _outgrows_constants(self, func, tensors, args, kwargs) -> bool:
        """Whether an op that writes nothing, on constants of this mode alone (which FakeTensorMode and
        `_on_constants` compute on their values), has an output larger than a constant may be: its shapes come
        from the op on meta tensors of the same shapes, before anything is allocated. An op whose output shape
        depends on the values (which meta cannot say) is left to the paths that compute it."""
        if not self._writes_nothing(func) or func is _TO_COPY or func.is_view:  # a view allocates nothing
            return False
        for t in tensors:
            if not (type(t) is FakeTensor and t.constant is not None and t.fake_mode is self):
                return False

        def meta(t):
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

        try:
            with no_dispatch():
                out = func(*_mapped(args, meta), **{name: _mapped(value, meta) for name, value in kwargs.items()})
        except Exception:  # noqa: BLE001 - no meta kernel, or a value-dependent shape
            return False
        return any(t.numel() * t.element_size() > self.constant_bytes
                   for t in flat_values(out) if isinstance(t, torch.Tensor))

    def _writes_nothing(self, func) -> bool:
        """Whether `func` is an aten or library op that writes none of its inputs, their values or their views'
        shapes (the ops the shortcuts below take)."""
        writes_nothing = self._writes_nothing_table.get(func)
        if writes_nothing is None:
            writes_nothing = self._writes_nothing_table[func] = (
                isinstance(func, torch._ops.OpOverload) and not func._schema.is_mutable
                and torch.Tag.inplace_view not in func.tags and func not in _NEVER_PROPAGATED)
        return writes_nothing

    def _without_constants(self, func, tensors, args, kwargs):
        """(args, kwargs) with each constant of this mode as a fake tensor without its value (on the same fake
        storage), for an op on constants and model outputs together that writes none of its inputs; None for
        other ops. Its output is no constant either way, and without constants FakeTensorMode's cache serves it
        (a constant input bypasses the cache: 0.6 ms an op instead of 0.1). An op that needs the values (a
        boolean mask's count) raises without them (DynamicOutputShapeException), and is run with them."""
        if not self._writes_nothing(func):
            return None
        constant = [type(t) is FakeTensor and t.constant is not None and t.fake_mode is self for t in tensors]
        if all(constant) or not any(constant):
            return None
        valueless = self._valueless
        return _mapped(args, valueless), {name: _mapped(value, valueless) for name, value in kwargs.items()}

    def _valueless(self, t):
        """A constant of this mode as a fake tensor without a value on the same fake storage; others as they are."""
        if type(t) is not FakeTensor or t.constant is None or t.fake_mode is not self:
            return t
        with no_dispatch():
            meta = torch.empty((), dtype=t.dtype, device="meta").set_(t.untyped_storage(), t.storage_offset(),
                                                                      t.shape, t.stride())
            return FakeTensor(self, meta, t.device)

    def _as_constant(self, real: torch.Tensor) -> FakeTensor:
        """The constant of an op's output `real`, as FakeTensorConverter.from_real_tensor(make_constant=True)
        makes it, at a seventh of the cost (20 against 160 us): the fake tensor already made of `real` if any;
        else one on the meta storage of `real`'s storage (a view of an input shares the input's), registered as
        from_real_tensor registers it (its meta storage and tensor, and its storage's constants, dropped when a
        fake value is written into them)."""
        converter = self.fake_tensor_converter
        known = converter._get_memo(real)
        if known is not None:
            return known
        storage = real.untyped_storage()
        if storage.nbytes() == 0:
            return converter.from_real_tensor(self, real, make_constant=True)
        meta_converter = converter.meta_converter
        storage_id = meta_converter.describer.get_storage_id(storage)
        meta_storage = meta_converter.storage_memo.get(storage_id)
        with no_dispatch():
            new = meta_storage is None
            if new:
                meta_storage = torch.UntypedStorage(storage.nbytes(), device="meta")
            meta = torch.empty((), dtype=real.dtype, device="meta").set_(meta_storage, real.storage_offset(),
                                                                         real.shape, real.stride())
            fake = FakeTensor(self, meta, real.device, constant=real)
        if new:
            meta_converter.storage_memo[storage_id] = fake.untyped_storage()
        converter.set_tensor_memo(real, fake)
        converter.add_constant_storage_mapping(fake)
        return fake

    @contextlib.contextmanager
    def fake_factories(self):
        """New tensors made without inputs stay fake inside the block, whatever their size (stand-ins for
        values the plan does not compute)."""
        self._fake_factories += 1
        try:
            yield
        finally:
            self._fake_factories -= 1

    def _real_factory(self, func, args, kwargs, out):
        if self._fake_factories or not isinstance(out, FakeTensor) or out.constant is not None:
            return out
        if out.device.type != "cpu":
            return out
        if out.numel() * out.element_size() > self.constant_bytes:
            return out
        with no_dispatch():
            real = func(*args, **kwargs)  # random factories draw from the caller's real generator
        return self.constant(real)

    def constant(self, real: torch.Tensor) -> FakeTensor:
        """A fake tensor of this mode that carries `real` (a CPU tensor) as its value."""
        return self.fake_tensor_converter.from_real_tensor(self, real, make_constant=True)

    def filled(self, shape, dtype: torch.dtype, value, *, broadcast: bool = False) -> FakeTensor:
        """A constant of `shape` and `dtype` holding `value` everywhere; with broadcast, one element expanded to
        the shape (no memory; for values nothing writes into)."""
        with no_dispatch():
            if broadcast:
                real = torch.full((), value, dtype=dtype).expand(tuple(shape))
            else:
                real = torch.full(tuple(shape), value, dtype=dtype)
        return self.constant(real)


def _mapped(tree, fn):
    """`tree` (an op's argument: a tensor, or a list or tuple of them) with fn(tensor) for each tensor."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_mapped(item, fn) for item in tree)
    return tree


def _value(t: FakeTensor) -> torch.Tensor:
    return t.constant


def is_constant(t: torch.Tensor) -> bool:
    return isinstance(t, FakeTensor) and t.constant is not None


def _assumed_outputs() -> dict:
    """op packet -> fn(mode, args, fake outputs) -> the outputs with assumed values, for the dllm_fast ops whose
    outputs are data the step reads (tokens and confidences steer decoding, log-probs feed the objective)."""
    if not hasattr(torch.ops, "dllm_fast") or not hasattr(torch.ops.dllm_fast, "sample_tokens"):
        return {}

    def sample_tokens(mode, args, out):
        tokens, confidence = out
        suppressed = set(args[6]) | set(args[7]) | set(mode.assumptions.avoid_ids)
        token = next(i for i in range(args[1].shape[0]) if i not in suppressed)
        return (mode.filled(tokens.shape, tokens.dtype, token),
                mode.filled(confidence.shape, confidence.dtype, mode.assumptions.confidence))

    def masked_logprobs(mode, args, out):
        logp, lse = out
        return mode.filled(logp.shape, logp.dtype, mode.assumptions.logprob), mode.filled(lse.shape, lse.dtype, 0.0)

    def masked_logprobs_grad(mode, args, out):  # (logp, grad_hidden): the log-probs are data, the gradient is not
        logp, grad_hidden = out
        return mode.filled(logp.shape, logp.dtype, mode.assumptions.logprob), grad_hidden

    ops = torch.ops.dllm_fast
    assumed = {ops.sample_tokens: sample_tokens, ops.masked_logprobs: masked_logprobs,
               ops.masked_logprobs_grad: masked_logprobs_grad}
    if hasattr(ops, "masked_logprobs_triton"):  # the Triton LM head's ops (backend="triton"), same outputs
        assumed.update({ops.masked_logprobs_triton: masked_logprobs,
                        ops.masked_logprobs_grad_triton: masked_logprobs_grad})
    return assumed


class FiniteValues(TorchFunctionMode):
    """isfinite / isnan / isinf of a fake, non-constant tensor answer as for finite values (constants), so that
    finiteness checks on model outputs pass and the data they steer stays known. isfinite decomposes into
    several ops below the Python API, so it is answered here, at the API. `count(kernels, bytes)`, if given,
    receives the work a GPU does for each answered check: isfinite is (x == x) * (x.abs() != inf), four
    elementwise kernels; isnan x != x, one; isinf x.abs() == inf, two (each reads x and writes a bool per
    element)."""

    _ANSWERS = {torch.isfinite: True, torch.Tensor.isfinite: True, torch.isnan: False, torch.Tensor.isnan: False,
                torch.isinf: False, torch.Tensor.isinf: False}
    _KERNELS = {torch.isfinite: 4, torch.Tensor.isfinite: 4, torch.isnan: 1, torch.Tensor.isnan: 1,
                torch.isinf: 2, torch.Tensor.isinf: 2}

    def __init__(self, mode: PlanningFakeMode, count=None):
        super().__init__()
        self.mode = mode
        self.count = count

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        answer = self._ANSWERS.get(func)
        if answer is not None and args and isinstance(args[0], FakeTensor) and not is_constant(args[0]):
            x = args[0]
            if self.count is not None and x.is_floating_point():  # an integer tensor's answer is a constant
                kernels = self._KERNELS[func]
                self.count(kernels, kernels * x.numel() * (x.element_size() + 1))
            return self.mode.filled(x.shape, torch.bool, answer, broadcast=True)
        return func(*args, **kwargs)


@contextlib.contextmanager
def constants_read_at_once(mode: PlanningFakeMode, read=None):
    """tolist of a constant of `mode` is its value, read from the host in one copy: `read(tensor)`, if given, is
    called once (one host sync on a GPU, as dllm_fast.testing.syncs counts it). FakeTensor.tolist, a Python
    method that no mode sees, would read each element on its own: an op and a host sync per element (a
    [512]-pair count read 512 times, 0.1 s of CPU). Other tensors' tolist is FakeTensor's."""
    original = FakeTensor.tolist

    def tolist(self):
        if self.constant is None or self.fake_mode is not mode:
            return original(self)
        if read is not None:
            read(self)
        with no_dispatch():
            return self.constant.tolist()

    FakeTensor.tolist = tolist
    try:
        yield
    finally:
        FakeTensor.tolist = original


@contextlib.contextmanager
def fake_world(mode: PlanningFakeMode, count=None, read=None):
    """Enter the fake mode, its finiteness answers (`count`: see FiniteValues) and its reads of constants
    (`read`: see constants_read_at_once)."""
    with mode, FiniteValues(mode, count), constants_read_at_once(mode, read):
        yield mode


def fake_module(module: torch.nn.Module, mode: PlanningFakeMode, device: str = "cpu") -> torch.nn.Module:
    """Replace the parameters and buffers of a module built on the meta device by fake tensors of `mode` on
    `device`, in place (tied tensors stay tied). Built on meta and converted once: nn.Module.to() cannot swap fake
    parameters, so dtypes, adapters and copies are all settled on meta first."""
    converter, memo = mode.fake_tensor_converter, {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            raise ValueError(f"fake_module needs a module on the meta device, found a tensor on {t.device}.")
        return converter.from_meta_and_device(mode, t, torch.device(device))

    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                if id(param) not in memo:
                    memo[id(param)] = torch.nn.Parameter(fake(param.data), requires_grad=param.requires_grad)
                sub._parameters[name] = memo[id(param)]
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None:
                if id(buffer) not in memo:
                    memo[id(buffer)] = fake(buffer)
                sub._buffers[name] = memo[id(buffer)]
    return module


def constants(mode: PlanningFakeMode, tree):
    """Every real CPU tensor in `tree` as a constant of `mode`."""
    return tree_map_only(torch.Tensor, lambda t: t if isinstance(t, FakeTensor) else mode.constant(t), tree)
