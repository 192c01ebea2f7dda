"""Run a few, extrapolate the rest: identical module calls are run once on fake tensors and replayed after.

A step repeats identical work: the 32 blocks of a forward, the denoising steps of a block, the engine's
micro-batches. Two calls of a module with the same input shapes and dtypes, the same grad, autocast and adapter
state (and, for a module whose weights autocast caches, whether it is its first call in the autocast region) do
the same arithmetic and allocate the same memory. `Replayer` wraps a module's forward: the first call of each
kind runs and is recorded (its costs, its peak above the memory at entry, the output's shape, the memory it leaves
alive: saved activations and autocast's cast cache); its backward is recorded when autograd runs it (the ops
executed by the nodes the call created). Later calls of the same kind run no op of the module: they allocate the
output, hold the recorded memory (activations in the graph until backward, cast caches until the region ends),
and add the recorded costs and peaks to the ledger; their backward returns gradients of the inputs' shapes and
new gradients for parameters that have none (accumulation into existing ones adds no memory, and its cost is in
the recorded backward).

A grad-mode call is replayed only once the backward of its recorded call is known; a backward replayed before
that (all-graphs scoring runs every forward before the first backward) is settled when the recorded one runs,
at the memory that was alive when it ran.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from dllm_fast.planning.accounting import CATEGORIES, Accountant, Costs, Mark, flat_values
from dllm_fast.planning.fake import PlanningFakeMode

_ACCUMULATE = "torch::autograd::AccumulateGrad"


@dataclass
class CallRecord:
    """One recorded call of a kind."""

    forward: Costs
    forward_peak: dict[str, int]
    output_shape: tuple[int, ...]
    output_dtype: torch.dtype
    activations: int  # held by the graph after the call (saved for backward, leaves that will get a .grad)
    kept: dict[str, int]  # memory alive after the call until the autocast region ends (cached parameter casts)
    parameters: tuple[str, ...] = ()  # names of the module's parameters the call's backward reaches
    backward: Costs | None = None
    backward_peak: dict[str, int] | None = None
    pending: list = field(default_factory=list)  # (memory alive, marks) of backwards replayed before it ran


@dataclass
class _Open:
    """A recorded call whose backward is running."""

    record: CallRecord
    mark: Mark


class Replayer:
    """Wraps modules' forwards to replay identical calls (see the module docstring). `state` returns whatever
    else decides what a call computes (e.g. whether LoRA adapters are enabled)."""

    def __init__(self, accountant: Accountant, mode: PlanningFakeMode, state=lambda: None, *,
                 link_all_parameters: bool = False):
        """link_all_parameters: a replayed call takes every parameter its backward reaches into the graph, not
        only those without a gradient (the same plan, slower: for tests)."""
        self.accountant, self.mode = accountant, mode
        self.link_all_parameters = link_all_parameters
        self.state = state
        self.records: dict[tuple, CallRecord] = {}
        self.calls = {"run": 0, "replayed": 0}
        self._region_seen: set[int] = set()
        self._region_kept: list[torch.Tensor] = []
        self._signature: dict[int, tuple] = {}
        self._named: dict[int, dict[str, torch.nn.Parameter]] = {}
        self._first_trainable: dict[int, torch.nn.Parameter | None] = {}
        self._last_real: dict[int, bool] = {}
        self._last_key: dict[int, tuple] = {}
        self._grad_kinds_seen: set[tuple] = set()
        self._owners: dict[int, list[CallRecord]] = {}  # autograd node sequence number -> recorded calls
        self._param_owner: dict[int, list[CallRecord]] = {}  # id(parameter) -> recorded calls awaiting backward
        self._open: list[_Open] = []
        accountant.before_op = self._before_op

    # -- installation -------------------------------------------------------------------------------------
    def install(self, module: torch.nn.Module) -> None:
        """Replay identical calls of `module` from now on."""
        original = module.forward
        named = dict(module.named_parameters())
        self._signature[id(module)] = (type(module).__qualname__, tuple(
            (tuple(p.shape), p.dtype, p.requires_grad) for p in named.values()))
        self._named[id(module)] = named
        self._first_trainable[id(module)] = next((p for p in named.values() if p.requires_grad), None)

        def forward(*args, **kwargs):
            return self._call(module, original, args, kwargs)

        module.forward = forward

    @contextlib.contextmanager
    def region(self):
        """An autocast region (a phase): casts cached in it, and the first calls that made them, end with it."""
        self._new_region()
        try:
            yield
        finally:
            self._close_all()
            self._new_region()

    def _new_region(self) -> None:
        self._region_seen.clear()
        self._region_kept.clear()

    # -- calls --------------------------------------------------------------------------------------------
    def _key(self, module, args, kwargs) -> tuple:
        parts = []
        for value in flat_values((args, kwargs)):
            if isinstance(value, torch.Tensor):
                parts.append((tuple(value.shape), value.dtype, value.requires_grad))
            elif hasattr(value, "keys") and hasattr(value, "capacity"):  # a KV cache: its size, not its identity
                parts.append(("kv", value.batch, value.capacity, value.keys[0].dtype))
            else:
                parts.append(value)
        grad = torch.is_grad_enabled()
        autocast = torch.is_autocast_enabled("cpu")
        trainable = self._first_trainable[id(module)]
        return (self._signature[id(module)], tuple(parts), grad, autocast,
                torch.get_autocast_dtype("cpu") if autocast else None, module.training,
                getattr(module, "gradient_checkpointing", None), self.state(), id(module) not in self._region_seen,
                grad and trainable is not None and trainable.grad is not None)

    def _call(self, module, original, args, kwargs):
        recomputing = torch._C._current_graph_task_id() != -1  # activation checkpointing recomputes in backward
        if recomputing:
            if self._last_real.get(id(module), True):
                return original(*args, **kwargs)
            return self._replay(module, self.records[self._last_key[id(module)]], args, kwargs)
        key = self._key(module, args, kwargs)
        self._last_key[id(module)] = key
        self._region_seen.add(id(module))
        record = self.records.get(key)
        grad = torch.is_grad_enabled()
        if record is None or (grad and record.backward is None and not self._known_kind(key)):
            self._last_real[id(module)] = True
            self.calls["run"] += 1
            return self._run(module, original, key, args, kwargs)
        self._last_real[id(module)] = False
        self.calls["replayed"] += 1
        return self._replay(module, record, args, kwargs)

    def _known_kind(self, key) -> bool:
        """A grad-mode kind run twice already replays before its backward is known (all-graphs scoring)."""
        if key in self._grad_kinds_seen:
            return True
        self._grad_kinds_seen.add(key)
        return False

    def _run(self, module, original, key, args, kwargs):
        accountant = self.accountant
        self._close_all()
        before = accountant.live_storages()
        mark = accountant.mark()
        out = original(*args, **kwargs)
        accountant.release(mark)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"the planner replays modules that return one tensor; {type(module).__name__} returned "
                            f"{type(out).__name__}.")
        after = dict(accountant.memory)
        left = {c: after[c] - mark.memory[c] for c in CATEGORIES}
        left["temporaries"] -= accountant.size_of(out)
        casts = accountant.cached_casts - before  # autocast's cache: alive until the region ends
        cached = accountant.size_of_storages(casts)
        cached_saved = accountant.size_of_storages(casts, "activations")
        left["activations"] -= cached_saved
        left["temporaries"] -= cached - cached_saved
        # With a graph, what the call leaves alive lives as long as the graph (saved tensors, and leaves such as
        # an embedding output PEFT makes require grad); without one, only the cast cache may stay.
        graph = out.grad_fn is not None
        held = max(0, left.pop("activations")) + (max(0, left["temporaries"]) if graph else 0)
        kept = {c: v for c, v in left.items() if v > 0 and not (graph and c == "temporaries")}
        if cached:
            kept["temporaries"] = kept.get("temporaries", 0) + cached
        record = CallRecord(forward=mark.costs, forward_peak=mark.peak_above(),
                            output_shape=tuple(out.shape), output_dtype=out.dtype, activations=held, kept=kept)
        if key not in self.records or self.records[key].backward is None:
            self.records[key] = record
        if out.grad_fn is not None:
            self._own_backward(record, module, out, args, kwargs)
        return out

    def _own_backward(self, record: CallRecord, module, out, args, kwargs) -> None:
        """Remember which autograd nodes the call made, so its backward's ops are recorded into it, and which of
        the module's parameters its backward reaches."""
        stop = {t.grad_fn for t in flat_values((args, kwargs)) if isinstance(t, torch.Tensor)}
        names = {id(p): name for name, p in self._named[id(module)].items()}
        reached, seen, queue = [], set(), [out.grad_fn]
        while queue:
            node = queue.pop()
            if node is None or node in stop or node in seen:
                continue
            seen.add(node)
            if node.name() == _ACCUMULATE:
                self._param_owner.setdefault(id(node.variable), []).append(record)
                if id(node.variable) in names:
                    reached.append(names[id(node.variable)])
                continue
            self._owners.setdefault(node._sequence_nr(), []).append(record)
            queue.extend(next_node for next_node, _ in node.next_functions)
        record.parameters = tuple(sorted(reached))

    def _before_op(self) -> None:
        """Called by the accountant before each op: open and close the recorded backwards it belongs to."""
        if not (self._owners or self._open):
            return
        node = torch._C._current_autograd_node() if torch._C._current_graph_task_id() != -1 else None
        owners = []
        if node is not None:
            if node.name() == _ACCUMULATE:
                owners = self._param_owner.get(id(node.variable), [])
            else:
                owners = self._owners.get(node._sequence_nr(), [])
        for entry in [o for o in self._open if not any(o.record is r for r in owners)]:
            self._close(entry)
        for record in owners:
            if not any(o.record is record for o in self._open):
                self._open.append(_Open(record, self.accountant.mark()))

    def _close(self, entry: _Open) -> None:
        accountant, record = self.accountant, entry.record
        self._open.remove(entry)
        accountant.release(entry.mark)
        costs, peak = entry.mark.costs, entry.mark.peak_above()
        if record.backward is None:
            record.backward, record.backward_peak = costs, peak
        else:  # a later backward of the same call: keep the larger
            record.backward_peak = {c: max(record.backward_peak[c], peak[c]) for c in CATEGORIES}
        for memory, marks in record.pending:
            accountant.add_costs(record.backward)
            accountant.assert_peak_at(memory, record.backward_peak, marks)
        record.pending.clear()
        for owners in (self._owners, self._param_owner):
            for key in [k for k, v in owners.items() if record in v]:
                owners[key] = [r for r in owners[key] if r is not record]
                if not owners[key]:
                    del owners[key]

    def _close_all(self) -> None:
        for entry in list(self._open):
            self._close(entry)

    def _replay(self, module, record: CallRecord, args, kwargs):
        accountant = self.accountant
        accountant.add_costs(record.forward)
        accountant.assert_peak(record.forward_peak)
        with self.mode.fake_factories():
            for category, size in record.kept.items():
                kept = torch.empty(size, dtype=torch.uint8)
                accountant.classify(kept, category)
                self._region_kept.append(kept)
            inputs = [t for t in flat_values((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
            named = self._named[id(module)]
            # The parameters without a gradient: the replayed backward makes theirs (accumulating into an existing
            # one adds no memory, and its cost is in the recorded backward), so the others need no edge in the
            # graph (hundreds of adapters' parameters per call with LoRA, an autograd input each), except one that
            # puts the call in the graph when nothing else does.
            reached = [named[name] for name in record.parameters]
            params = reached if self.link_all_parameters else [p for p in reached if p.grad is None] or reached[:1]
            if torch.is_grad_enabled() and (inputs or params):
                return _ReplayedCall.apply(self, record, len(inputs), *inputs, *params)
            return torch.empty(record.output_shape, dtype=record.output_dtype)


class _ReplayedCall(torch.autograd.Function):
    """A recorded call in the graph: holds its activations until backward, then replays the recorded backward."""

    @staticmethod
    def forward(ctx, replayer: Replayer, record: CallRecord, num_inputs: int, *tensors):
        ctx.replayer, ctx.record, ctx.num_inputs = replayer, record, num_inputs
        ctx.shapes = [(t.shape, t.dtype) for t in tensors]
        ctx.params = tensors[num_inputs:]
        ctx.save_for_backward(torch.empty(record.activations, dtype=torch.uint8))
        return torch.empty(record.output_shape, dtype=record.output_dtype)

    @staticmethod
    def backward(ctx, grad_output):
        replayer, record = ctx.replayer, ctx.record
        accountant = replayer.accountant
        if record.backward is not None:
            accountant.add_costs(record.backward)
            accountant.assert_peak(record.backward_peak)
        else:
            record.pending.append((dict(accountant.memory), accountant.active_marks()))
        with replayer.mode.fake_factories():
            grads = [torch.empty(shape, dtype=dtype) if ctx.needs_input_grad[3 + i] else None
                     for i, (shape, dtype) in enumerate(ctx.shapes[:ctx.num_inputs])]
            grads += [torch.empty(p.shape, dtype=p.dtype) if p.grad is None else None for p in ctx.params]
        return (None, None, None, *grads)


@dataclass
class WorkRecord:
    """The ledger of some work, relative to where it started: its costs, its memory above the start when the total
    peaked (`peak`) and each category's most above it (`category_peaks`), and what it left (`left`: memory after
    less memory before)."""

    costs: Costs
    peak: dict[str, int]
    category_peaks: dict[str, int]
    left: dict[str, int]


class RecordedWork:
    """Work whose ledger depends only on a key (e.g. an optimizer step: the trainable parameters' and gradients'
    shapes, dtypes and categories) is run once per key and replayed after: its costs and peaks added to the
    ledger as running it would, then `effects()` leaves the state it leaves (e.g. gradients set to None), checked
    against the recorded memory left. The key given is completed with the launches queued since the last sync,
    which decide where the launch queue fills up (accounting.Accountant._bound_run_ahead), so that the replayed
    costs are the run's exactly."""

    def __init__(self, accountant: Accountant, *, enabled: bool = True):
        """enabled=False runs the work every time (the same plan, slower: for tests)."""
        self.accountant = accountant
        self.enabled = enabled
        self.records: dict[tuple, WorkRecord] = {}

    def run(self, key: tuple, work, effects) -> bool:
        """Run `work()` or replay its record for `key`; True when replayed."""
        accountant = self.accountant
        key = (key, accountant.costs.open_launches)
        before = dict(accountant.memory)
        record = self.records.get(key) if self.enabled else None
        if record is None:
            mark = accountant.mark()
            try:
                work()
            finally:
                accountant.release(mark)
            self.records[key] = WorkRecord(
                mark.costs, mark.peak_above(), {c: mark.category_peaks[c] - mark.memory[c] for c in CATEGORIES},
                {c: accountant.memory[c] - before[c] for c in CATEGORIES})
            return False
        accountant.add_costs(record.costs)
        accountant.assert_peaks(record.peak, record.category_peaks)
        effects()
        left = {c: accountant.memory[c] - before[c] for c in CATEGORIES}
        if left != record.left:
            raise RuntimeError(f"planner: replayed work left {left} bytes by category where its run left "
                               f"{record.left}; its key {key[0]!r} misses something that decides its memory.")
        return True
