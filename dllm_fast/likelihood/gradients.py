"""Where the engine's gradients go: straight into `.grad`, and back to exactly what they were if a call fails.

- `embedding_grads_in_place(model)`: while active, every trainable `nn.Embedding` adds its weight's gradient
  straight into `weight.grad` (an index_add of the looked-up rows). Autograd's own embedding backward builds a
  dense [V, d] gradient that AccumulateGrad then adds into `.grad`: from the second micro-batch on, a
  gradient-sized temporary (LLaDA's embedding is as large as its LM head). The LM head's counterpart lives in
  the fused op's faces (`dllm_fast.ops.logprobs`).
- `all_or_nothing(model, body)`: a failure or an interrupt anywhere in `body()` leaves every `.grad`
  bit-identical to what it was on entry.

Both keep each weight's AccumulateGrad node in the graph (it runs with no gradient), so the hooks that DDP and
FSDP2 put there still fire, on the complete `.grad`, in the backward that synchronises.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator, TypeVar

import torch
import torch.nn.functional as F

from dllm_fast.ops.logprobs import trainable_leaf, weight_grad_buffer

T = TypeVar("T")

# The parameters (by id) whose `.grad` an enclosing all_or_nothing call restores, one entry per active call. A
# dict changed in place by one store and one delete (no call: no interrupt can land inside either) rather than
# a ContextVar re-set, whose `set` returns before the `try` that would undo it.
_GUARDED: contextvars.ContextVar[dict[object, frozenset[int]] | None] = contextvars.ContextVar(
    "dllm_fast_guarded_grads", default=None)


def all_or_nothing(model, body: Callable[[], T]) -> T:
    """`body()`, with every trainable parameter's `.grad` restored on any exception (KeyboardInterrupt included)
    it raises; returns its result.

    Gradients that are None on entry are simply reset to None: no copy. Gradients that already exist are copied
    on entry (one gradient-sized buffer per parameter for the duration of the call, the price of accumulating
    into existing gradients all-or-nothing) and the copies are put back on failure. Inside, gradients accumulate
    in place into `.grad`, so a data-parallel all-reduce in the body's last backward sees the whole sum. Nested
    calls over the same parameters (Objective.backward around streaming_backward) cost nothing more.

    A function rather than a context manager, so that no interrupt can land where the guard is set but its
    `try` not yet entered, nor after the body succeeded but before the call returns: a context manager's
    `__enter__` and `__exit__` are Python calls, and a Ctrl-C lands at any Python call (python_tests/
    test_interrupts.py sweeps every objective). The guard's own record is one dict store before the `try` and one
    delete in its `finally`, neither of which can be interrupted.
    """
    guarded = _guarded_calls()
    taken = frozenset().union(*guarded.values())
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in taken]
    kept = [None if p.grad is None else p.grad.clone() for p in params]
    token = object()
    guarded[token] = frozenset(id(p) for p in params)
    try:
        return body()
    except BaseException:
        for p, grad in zip(params, kept):
            p.grad = grad
        raise
    finally:
        del guarded[token]


def _guarded_calls() -> dict[object, frozenset[int]]:
    """This context's record of active all_or_nothing calls (made on first use)."""
    guarded = _GUARDED.get()
    if guarded is None:
        guarded = {}
        _GUARDED.set(guarded)
    return guarded


@contextlib.contextmanager
def embedding_grads_in_place(model) -> Iterator[None]:
    """While active, trainable embeddings of `model` accumulate their weight's gradient into `.grad` in place.

    Applies to `nn.Embedding` modules whose weight is a trainable leaf, without max_norm (it renormalises the
    weight in the forward), scale_grad_by_freq or sparse gradients; the others keep autograd's path. Rows of
    padding_idx get no gradient, as in nn.Embedding. A backward's upstream scale is honoured.
    """
    handles = []
    try:  # registered inside: an interrupt between two registrations must not leave the first ones behind
        for module in in_place_embeddings(model):
            handles.append(module.register_forward_hook(_lookup_with_grad_in_place, with_kwargs=True))
        yield
    finally:
        try:
            _remove(handles)
        except BaseException:  # an interrupt landed in it: finish it (removing twice is harmless), then go on
            _remove(handles)
            raise


def _remove(handles) -> None:
    for handle in handles:
        handle.remove()


def in_place_embeddings(model) -> list[torch.nn.Embedding]:
    """The embeddings of `model` that `embedding_grads_in_place` makes accumulate into `.grad` in place."""
    return [module for module in model.modules() if _in_place_capable(module)]


def _in_place_capable(module: torch.nn.Module) -> bool:
    return (isinstance(module, torch.nn.Embedding) and module.weight.requires_grad and module.max_norm is None
            and not module.scale_grad_by_freq and not module.sparse)


def _lookup_with_grad_in_place(module: torch.nn.Embedding, args, kwargs, output):
    weight = module.weight  # read at forward time: FSDP2 has swapped in the unsharded parameter
    if not (torch.is_grad_enabled() and trainable_leaf(weight)):
        return output
    ids = args[0] if args else kwargs["input"]
    return _EmbeddingGradInPlace.apply(ids, weight, module.padding_idx)


class _EmbeddingGradInPlace(torch.autograd.Function):
    """F.embedding whose backward index_adds the rows' gradients into `weight.grad` and returns none for it."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx):
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_output):
        (ids,) = ctx.saved_tensors
        buffer = weight_grad_buffer(ctx.weight)
        flat_ids = ids.reshape(-1)
        rows = grad_output.reshape(flat_ids.shape[0], -1).to(buffer.dtype)
        if ctx.padding_idx is not None:
            rows = rows.masked_fill((flat_ids == ctx.padding_idx)[:, None], 0)
        buffer.index_add_(0, flat_ids, rows)
        return None, None, None
