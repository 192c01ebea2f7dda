"""The settings that travel with a backward through the layers, one object each: how the work is cut into model
calls (`MicroBatching`), and how a data-parallel wrapper or a host trainer takes part in each backward
(`BackwardHooks`). The trainer and the planner (train/config.py's `micro_batching`) and the TRL adapter build
them once and pass them down unchanged through `Objective.backward` to `score` and `streaming_backward`; the
public faces that also take a plain number of pairs convert it once, with `MicroBatching.of`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from dllm_fast.validation import check_bool, check_int


@dataclass(frozen=True)
class MicroBatching:
    """How N * n_t (sequence, sample) pairs are cut into model calls.

    micro_batch: pairs per backward graph; peak memory scales with it, not with n_t.
    score_micro_batch: pairs per model call where lp is scored without a graph (the engine's pass 1, the old and
        reference policies); None: micro_batch. Under active dropout pass 1 must replay pass 2's micro-batches,
        so it must then equal micro_batch.
    chunk_size: vocabulary chunk of the fused LM head (None: sized for the device).
    compile: run each micro-batch's forward (model, scored rows, fused LM head), and pass 2's backward, as
        torch.compile(fullgraph=True) graphs, its pairs and scored rows padded to a few buckets
        (likelihood/compiled.py); the first micro-batch of each bucket compiles. Not with active dropout in the
        two-pass engine (its pass 2 replays pass 1's random numbers, which a compiled graph draws differently).
    one_pass: let an objective whose loss couples pairs only within a sequence (`SequenceLocal`: ESPO, VRPO-OL,
        SPG, GDPO, coupled GRPO) skip the engine's scoring pass: each micro-batch then holds whole sequences and
        differentiates their loss in its own graph (likelihood/engine.py). False: always the two passes (to
        compare them; the gradient is the same).
    """

    micro_batch: int
    score_micro_batch: int | None = None
    chunk_size: int | None = None
    compile: bool = False
    one_pass: bool = True

    def __post_init__(self) -> None:
        check_int("micro_batch", self.micro_batch, minimum=1, hint="(sequence, sample) pairs per backward graph")
        if self.score_micro_batch is not None:
            check_int("score_micro_batch", self.score_micro_batch, minimum=1,
                      hint="(sequence, sample) pairs per model call")
        if self.chunk_size is not None:
            check_int("chunk_size", self.chunk_size, minimum=1, hint="vocabulary rows per chunk of the LM head")
        check_bool("compile", self.compile)
        check_bool("one_pass", self.one_pass)

    @classmethod
    def of(cls, value: "int | MicroBatching") -> "MicroBatching":
        """`value` itself, or MicroBatching(value) for a plain number of pairs per graph: a public face's one
        conversion (`score`, `streaming_backward`, `Objective.backward`); inside, the object travels."""
        return value if isinstance(value, MicroBatching) else cls(value)

    @property
    def scoring(self) -> int:
        """Pairs per model call when scoring without a graph."""
        return self.score_micro_batch if self.score_micro_batch is not None else self.micro_batch


@dataclass(frozen=True)
class BackwardHooks:
    """How a data-parallel wrapper or a host trainer takes part in the backwards of one call.

    sync_gradients: whether the call all-reduces its gradients in data-parallel training. True: only its last
        backward synchronises (one all-reduce per call, not one per micro-batch); False: none does (accumulating
        over several calls before an optimizer step; the last of them passes True). An FSDP2 module reduce-scatters
        at every backward either way (its gradients accumulate sharded, never whole).
    grad_sync: a factory of the context manager that suspends gradient synchronisation, entered around every
        backward that must not all-reduce. None: `model.no_sync` for DistributedDataParallel, nothing for an
        FSDP2 module (engine.default_grad_sync) or a single process.
    backward: called as `backward(loss)` instead of `loss.backward()`, for host trainers that own the backward
        (e.g. `accelerator.backward`).
    """

    sync_gradients: bool = True
    grad_sync: Callable[[], ContextManager] | None = None
    backward: Callable[[torch.Tensor], None] | None = None

    def __post_init__(self) -> None:
        check_bool("sync_gradients", self.sync_gradients)
        if self.grad_sync is not None and not callable(self.grad_sync):
            raise TypeError(f"grad_sync must be callable (a context-manager factory such as model.no_sync), got "
                            f"{type(self.grad_sync).__name__}.")
        if self.backward is not None and not callable(self.backward):
            raise TypeError(f"backward must be callable (e.g. accelerator.backward), got "
                            f"{type(self.backward).__name__}.")
