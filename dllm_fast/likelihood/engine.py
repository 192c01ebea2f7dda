"""The streaming backward engine: the exact gradient of any objective of `lp`, in memory independent of n_t.

Every published objective is a differentiable function of the small tensor lp[N, n_t, L] (old and reference
log-probs on the same masks enter as constants). By the chain rule,

    d objective / d theta = sum_{n,j,i} coef[n,j,i] * d lp[n,j,i] / d theta,   coef = d objective / d lp,

so the engine (1) scores lp without a graph, (2) gets coef by autograd on lp alone, and (3) recomputes lp one
micro-batch of (sequence, sample) pairs at a time and backpropagates (coef * lp).sum(), freeing each
micro-batch's graph before the next. Peak memory is one micro-batch's graph, whatever n_t is. An objective that
is a sum of per-pair terms (BGPO's bound) needs no coef: the separable path scores and backpropagates each
micro-batch once, skipping pass 1.

An objective that couples pairs only within a sequence (`SequenceLocal`: ESPO's sequence ratio and KL, VRPO-OL,
SPG, GDPO, coupled GRPO) skips pass 1 too. Its loss is a sum of per-sequence terms, so d loss / d lp[n] depends on
lp[n] alone: a micro-batch that holds every pair of its sequences scores them with a graph, takes their coef from
the loss evaluated with their rows in place (the other sequences' rows hold any finite constant), and
backpropagates (coef * lp).sum() at once. The gradient is the two-pass one, with one forward fewer per pair (about a
third of a LoRA update's work). Micro-batches then hold whole sequences (at most micro_batch pairs); when n_t exceeds micro_batch, or
under `MicroBatching(one_pass=False)`, the two passes run.

Memory is flat in n_t with the gradients included: across micro-batches, gradients accumulate in place into
`.grad`. The LM head's and the embeddings' [V, d] gradients are added straight into their `.grad` (the fused op
and `gradients.embedding_grads_in_place`) rather than built as a new [V, d] tensor each micro-batch for autograd
to add. Pass 2 knows every lp's coefficient before its forward, so the fused LM head computes its gradient while
it walks the vocabulary (three GEMMs per chunk: logits, grad_hidden, grad_weight), with the rows' normaliser
taken from pass 1's lp, and the body receives grad_hidden through a surrogate; under a host-owned backward
(`BackwardHooks.backward`, which may scale the loss) the head's gradient is added in its backward instead.

Pass 2 must recompute exactly what pass 1 scored. With active dropout (e.g. PEFT's lora_dropout in training
mode) the engine therefore records the RNG state before each pass-1 micro-batch and replays it in pass 2 over
the same micro-batches, as activation checkpointing does; the gradient stays exact for the dropout masks drawn.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, NamedTuple

import torch

from dllm_fast.contracts import accumulate_dtype, data_parallel, mixed_dtypes_named, unwrap_model
from dllm_fast.likelihood.compiled import known_gradient_compiled
from dllm_fast.likelihood.masks import MonteCarloMasks
from dllm_fast.likelihood.gradients import all_or_nothing, embedding_grads_in_place
from dllm_fast.likelihood.scoring import (
    PairBatch, aligned_call_count, check_inputs, ids_checked_once, pair_batches, score_batch_of_pairs,
    score_pairs_with_known_gradient, sequence_batches,
)
from dllm_fast.likelihood.settings import BackwardHooks, MicroBatching


@dataclass(frozen=True)
class Separable:
    """An objective that is a sum of per-(sequence, sample) terms (BGPO's bound, d1's token terms), which
    `streaming_backward` differentiates in one pass: `terms(lp_pairs, sequence_index, sample_index) -> 0-dim
    tensor`, the terms of b pairs whose rows are lp_pairs [b, L] (sequence_index [b], sample_index [b] int64 say
    which (n, j) each row is). The full objective must be the sum of these calls over any partition of the
    N * n_t pairs."""

    terms: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

    def __post_init__(self) -> None:
        if not callable(self.terms):
            raise TypeError(f"Separable takes the objective's terms, a callable, got {type(self.terms).__name__}.")


@dataclass(frozen=True)
class SequenceLocal:
    """An objective of the whole lp [N, n_t, L] that is a sum of per-sequence terms: `loss(lp) -> 0-dim tensor`,
    whose gradient with respect to lp[n] depends on lp[n] alone (and constants). `streaming_backward`
    differentiates it in one pass where micro-batches can hold whole sequences (module docstring), else in two.

    fill: [N, n_t, L] values the rows of the sequences outside a micro-batch hold while its loss is differentiated
        (None: zeros). Their values never reach the gradient; give finite ones that keep the loss finite, e.g. the
        old policy's lp (ratios of 1).
    inert: [N] bool, sequences whose terms are constant in lp for every lp (e.g. zero advantage and no KL term):
        they are scored without a graph, for the value and the returned lp only. None: none known.
    """

    loss: Callable[[torch.Tensor], torch.Tensor]
    fill: torch.Tensor | None = None
    inert: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not callable(self.loss):
            raise TypeError(f"SequenceLocal takes the objective's loss, a callable, got {type(self.loss).__name__}.")


class BackwardResult(NamedTuple):
    """What `streaming_backward` returns: the objective's value (detached 0-dim tensor; fp32, or fp64 for an fp64
    model) and the current policy's lp [N, n_t, L] (detached), which costs nothing extra."""

    value: torch.Tensor
    lp: torch.Tensor


def streaming_backward(
    model,
    sequences: torch.Tensor,
    masks: MonteCarloMasks,
    objective: Callable[[torch.Tensor], torch.Tensor] | Separable | SequenceLocal,
    *,
    micro_batch: int | MicroBatching,
    attention_mask: torch.Tensor | None = None,
    lp: torch.Tensor | None = None,
    hooks: BackwardHooks | None = None,
) -> BackwardResult:
    """Backpropagate `objective` of the current policy's lp into the model's `.grad`, micro-batch by micro-batch.

    Gradients accumulate into `.grad` of whatever requires grad in `model` (full weights or LoRA adapters),
    exactly as `objective(score(model, ...)).backward()` would (with the same RNG state), activation
    checkpointing and dropout included.

    Args:
        model: the model contract (see `score`); the current policy. A DistributedDataParallel wrapper works:
            forwards go through it, attributes are read from `.module`.
        sequences: [N, P + L] token ids, completion in the last L positions.
        masks: stored masks from `sample_masks`; score the old and reference policies on the same object.
        objective:
            - `objective(lp) -> 0-dim tensor`, lp [N, n_t, L] (a leaf that requires grad), on the two-pass path.
              Any differentiable function: exp of ELBO differences, log-mean-exp EUBO, clipped ratios.
            - `Separable(terms)`: a sum of per-pair terms (to look up advantages, old lp, weights by pair), on the
              one-pass path described above, which has no pass 1 (score_micro_batch does not apply). Pairs with
              nothing masked are passed with all-zero rows and no model call.
            - `SequenceLocal(loss, fill, inert)`: a sum of per-sequence terms, in one pass when n_t <= micro_batch
              (micro-batches of whole sequences, at most micro_batch pairs each; score_micro_batch applies to the
              inert sequences only), else in two. Its gradient equals the two-pass one.
        micro_batch: (sequence, sample) pairs per recomputed graph, or a `MicroBatching` that also sets pass 1's
            model calls (score_micro_batch; it must equal micro_batch under active dropout), the vocabulary
            chunk of the fused LM head and compiled micro-batches. Peak memory scales with micro_batch, not with
            n_t. Pass 2 skips the pairs whose coefficients are all zero (e.g. zero advantage); with active
            dropout it skips only whole micro-batches, since it must replay pass 1's batches.
        attention_mask: optional [N, P + L], passed to the model (left-padded prompts).
        lp: the current policy's lp on these masks when it is already known (the policy has not moved since it
            was scored). Pass 1 is skipped; the gradient is identical. Not with a `Separable` objective (no pass
            1 to skip) nor with active dropout (pass 2 could not replay the draws lp was scored under). Like pass 1's
            lp, it also gives pass 2 each row's normaliser (its target logit minus lp): an lp off by d nats for
            a row (scored with other weights) would scale that row's softmax term in the LM head weight's
            gradient by e^d, on top of the coefficients being taken at the wrong point.
        hooks: `BackwardHooks`, how a data-parallel wrapper or a host trainer takes part in each backward
            (sync_gradients, grad_sync, backward). Every rank must make the same calls: a rank with nothing to
            backpropagate still runs one zero-weighted backward so that the collective happens.

    Gradients are all or nothing: if the objective raises or returns a non-finite value or coefficient, if a
    micro-batch fails, or if the call is interrupted (KeyboardInterrupt) at any point, every `.grad` is left
    bit-identical to what it was before the call, so an optimizer never steps on a partial gradient. Gradients
    accumulate in place into `.grad` as the call runs. After `zero_grad(set_to_none=True)` this costs nothing (a
    failure resets them to None); gradients that already exist are copied on entry, one extra gradient-sized
    buffer for the duration of the call. Gradients that live outside `.grad` (DeepSpeed ZeRO through
    `backward=`) are not covered.

    Returns:
        `BackwardResult(value, lp)`: the objective's value, a detached 0-dim tensor (fp32, or fp64 for an fp64
        model), and the current policy's lp [N, n_t, L] (detached), e.g. for logging.
    """
    batching, hooks = MicroBatching.of(micro_batch), hooks if hooks is not None else BackwardHooks()
    check_inputs(model, sequences, masks, attention_mask=attention_mask)
    separable = isinstance(objective, Separable)
    local = objective if isinstance(objective, SequenceLocal) else None
    if local is not None:
        objective = local.loss
        _check_sequence_local(local, masks)
    if not separable and not callable(objective):
        raise TypeError(f"objective must be callable (or Separable(terms)), got {type(objective).__name__}.")
    if separable and lp is not None:
        raise ValueError("lp= skips pass 1, which a Separable objective does not run; drop lp, or pass the "
                         "objective of the whole lp.")
    backward_pass = _Backward(model, hooks)
    replay = backward_pass.replay
    if replay and not separable and batching.scoring != batching.micro_batch:
        raise ValueError(f"score_micro_batch={batching.score_micro_batch} differs from micro_batch="
                         f"{batching.micro_batch}, but the model has active dropout, so pass 2 must replay pass 1's "
                         "micro-batches; drop score_micro_batch, or call model.eval() / set the dropout to 0.")
    if replay and batching.compile and not separable:
        raise ValueError("MicroBatching(compile=True) with active dropout: pass 2 must replay the random numbers "
                         "pass 1 drew, which a compiled graph draws differently; call model.eval() / set the "
                         "dropout to 0, or use compile=False.")
    if lp is not None:
        if replay:
            raise ValueError("lp= was given but the model has active dropout: pass 2 cannot replay the dropout "
                             "masks lp was scored under. Drop lp, or call model.eval() / set the dropout to 0.")
        masks.check_lp(lp, "lp")
        lp = lp.detach().to(accumulate_dtype(unwrap_model(model).lm_head_weight.dtype))

    def run():
        # inside the guard: nothing interruptible follows its last backward
        with mixed_dtypes_named(model), ids_checked_once(model, sequences):
            if separable:
                return _separable(model, sequences, masks, objective.terms, batching, attention_mask,
                                  backward_pass)
            # One pass when a micro-batch can hold a whole sequence's samples: decided by the shapes alone, so that
            # every data-parallel rank takes the same path (and makes the same collectives)
            if local is not None and lp is None and batching.one_pass and masks.n_t <= batching.micro_batch:
                needed = None if local.inert is None else ~local.inert.to(device=sequences.device, dtype=torch.bool)
                batches = sequence_batches(masks, batching.micro_batch, among=needed)
                return _one_pass(model, sequences, masks, local, batches, batching, attention_mask, backward_pass)
            return _two_pass(model, sequences, masks, objective, batching, attention_mask, lp, backward_pass)

    return BackwardResult(*all_or_nothing(model, run))


class _Backward:
    """Runs each micro-batch's backward, letting only the last one of the call all-reduce across ranks."""

    def __init__(self, model, hooks: BackwardHooks):
        self.run = hooks.backward if hooks.backward is not None else torch.Tensor.backward
        self.grad_sync = hooks.grad_sync if hooks.grad_sync is not None else default_grad_sync(model)
        self.sync_gradients = hooks.sync_gradients
        # Pass 2 must recompute exactly what pass 1 scored: with active dropout it replays pass 1's RNG states.
        self.replay = has_active_dropout(model)
        # Only a plain loss.backward() is known to backpropagate with a unit upstream gradient, which the LM
        # head's gradient computed in the forward (logprobs_with_known_gradient) relies on.
        self.unit_upstream = hooks.backward is None

    @property
    def distributed(self) -> bool:
        return self.grad_sync is not None

    def aligned(self, count: int, device: torch.device) -> int:
        """The most micro-batches any rank runs: ranks with fewer pad with zero-weighted ones."""
        return aligned_call_count(count, device, self.distributed)

    def step(self, last: bool):
        """The context for one micro-batch's forward and backward: DDP decides in the forward whether the next
        backward all-reduces, so both run inside its no_sync unless this is the call's last backward."""
        if self.grad_sync is None or (last and self.sync_gradients):
            return contextlib.nullcontext()
        return self.grad_sync()

    def __call__(self, loss: torch.Tensor) -> None:
        self.run(loss)


def default_grad_sync(model) -> Callable[[], ContextManager] | None:
    """The context around every backward of a call but the last (when it synchronises): DDP's `no_sync`, which
    defers the all-reduce to the last backward; for an FSDP2 module, none that suspends anything: each backward
    reduce-scatters into the sharded gradients, where the micro-batches accumulate (the same sum as one reduction
    at the end), so that a rank never holds whole gradients (`set_requires_gradient_sync(False)` would accumulate
    them unsharded); None for a model that does not synchronise."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.no_sync
    if data_parallel(model):  # torch.distributed.fsdp.FSDPModule (fully_shard)
        return contextlib.nullcontext
    return None


def has_active_dropout(model) -> bool:
    """Whether the forward draws random numbers: a dropout module with p > 0 in training mode."""
    return any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 and m.training
               for m in model.modules())


def _two_pass(model, sequences: torch.Tensor, masks: MonteCarloMasks, objective, batching: MicroBatching,
              attention_mask, lp: torch.Tensor | None, backward_pass: _Backward):
    device = sequences.device
    N, n_t, L = masks.num_sequences, masks.n_t, masks.completion_length
    micro_batch, replay = batching.micro_batch, backward_pass.replay
    scoring_batch = micro_batch if replay else batching.scoring
    batches = pair_batches(masks, scoring_batch) if lp is None or replay else []

    def score_batch(batch: PairBatch):
        return score_batch_of_pairs(model, sequences, masks, batch, batching, capacity=scoring_batch,
                                    attention_mask=attention_mask)

    rng_states = []
    if lp is None:
        with torch.no_grad():  # pass 1
            lp = torch.zeros(N * n_t, L, dtype=accumulate_dtype(unwrap_model(model).lm_head_weight.dtype),
                             device=device)
            calls = backward_pass.aligned(len(batches), device)  # agreed before the first (FSDP2's forwards gather)
            for batch in batches:
                if replay:
                    rng_states.append(_rng_state(device))
                lp[batch.pairs] = score_batch(batch)
            for _ in range(calls - len(batches)):  # other ranks' calls
                score_batch(batches[-1])
    lp = lp.reshape(N, n_t, L).clone().requires_grad_(True)
    with torch.enable_grad():
        loss = _scalar(objective(lp), "objective(lp)")
    value = loss.detach()
    _check_finite_value(value, "objective(lp)")
    if not loss.requires_grad:
        return value, lp.detach()  # the objective does not depend on lp: no gradient
    (coef,) = torch.autograd.grad(loss, lp, allow_unused=True)
    lp = lp.detach()
    if coef is None:
        return value, lp
    # lp is a constant 0 where nothing is scored, so coef there carries no gradient.
    coef = torch.where(masks.scored, coef, torch.zeros((), dtype=coef.dtype, device=coef.device))
    if not torch.isfinite(coef).all():
        raise FloatingPointError(
            f"d objective / d lp is not finite at {int((~torch.isfinite(coef)).sum())} scored positions "
            f"(objective value {value.item()}); check the objective for overflow (e.g. exp of a large ELBO "
            "difference) before stepping."
        )
    coef_rows = coef.reshape(-1, L)
    needed = coef_rows.ne(0).any(-1)  # pairs whose gradient weight is zero are skipped
    # pass 2: (pairs, RNG state to replay, gradient weight); zero-weighted entries only keep ranks in step
    if replay:  # the same micro-batches as pass 1, each under the RNG state it was scored with
        after_pass_1 = _rng_state(device)
        kept = needed.tolist()  # one host read: which of pass 1's micro-batches have a gradient weight
        pass_2 = [(batch, state, 1.0) for batch, state in zip(batches, rng_states)
                  if any(kept[p] for p in batch.indices)]
    else:
        pass_2 = [(batch, None, 1.0) for batch in pair_batches(masks, micro_batch, among=needed)]
    if backward_pass.distributed:  # every rank runs the same number of backwards; the last one all-reduces
        total = backward_pass.aligned(max(len(pass_2), 1), device)
        filler = pass_2[0][0] if pass_2 else (batches or pair_batches(masks, micro_batch))[0]
        pass_2 += [(filler, rng_states[0] if replay else None, 0.0)] * (total - len(pass_2))
    lp_rows = lp.view(-1, L)
    with torch.enable_grad(), embedding_grads_in_place(model):
        for index, (batch, state, weight) in enumerate(pass_2):
            if state is not None:
                _set_rng_state(state, device)
            pairs = batch.pairs
            with backward_pass.step(last=index == len(pass_2) - 1):
                if backward_pass.unit_upstream and batching.compile:
                    loss = known_gradient_compiled(model, sequences, masks, pairs, coef_rows[pairs] * weight,
                                                   lp_rows[pairs], capacity=micro_batch,
                                                   attention_mask=attention_mask, chunk_size=batching.chunk_size,
                                                   rows=batch.rows)
                elif backward_pass.unit_upstream:
                    loss, _ = score_pairs_with_known_gradient(model, sequences, masks, pairs, coef_rows[pairs] * weight,
                                                              lp_rows[pairs], attention_mask=attention_mask,
                                                              chunk_size=batching.chunk_size, rows=batch.rows)
                else:
                    lp_batch = _score_with_grad(model, sequences, masks, batch, batching, attention_mask)
                    loss = (coef_rows[pairs] * lp_batch).sum() * weight
                if loss.requires_grad:
                    backward_pass(loss)
    if replay:
        _set_rng_state(after_pass_1, device)  # later draws continue as if pass 2 had drawn nothing
    return value, lp


def _one_pass(model, sequences: torch.Tensor, masks: MonteCarloMasks, objective: SequenceLocal,
              batches: list[PairBatch], batching: MicroBatching, attention_mask, backward_pass: _Backward):
    """A sequence-local objective's gradient, each micro-batch (whole sequences) scored and backpropagated once."""
    device = sequences.device
    N, n_t, L = masks.num_sequences, masks.n_t, masks.completion_length
    lp = torch.zeros(N * n_t, L, dtype=accumulate_dtype(unwrap_model(model).lm_head_weight.dtype), device=device)
    # The other sequences' rows: the given fill, or lp as scored so far (zeros, then earlier micro-batches' rows)
    fill = lp if objective.fill is None else objective.fill.detach().to(lp.dtype).reshape(N * n_t, L)
    scored = masks.scored.reshape(N * n_t, L)
    zero = torch.zeros((), dtype=lp.dtype, device=device)
    idle = []  # the inert sequences' pairs: their terms carry no gradient, so they are scored without a graph
    if objective.inert is not None:
        among = objective.inert.to(device=device, dtype=torch.bool).repeat_interleave(n_t)
        idle = pair_batches(masks, batching.scoring, among=among)
    not_finite = torch.zeros((), dtype=torch.int64, device=device)  # read once, at the end (one host sync)
    total = backward_pass.aligned(len(batches), device)
    with torch.enable_grad(), embedding_grads_in_place(model):
        for index in range(total):
            padding = index >= len(batches)  # keeps this rank in step with ranks that have more micro-batches
            batch = (batches or idle)[-1] if padding else batches[index]
            pairs = batch.pairs
            with backward_pass.step(last=index == total - 1):
                lp_batch = _score_with_grad(model, sequences, masks, batch, batching, attention_mask)
                rows, coef = lp_batch.detach(), None
                if not padding:
                    leaf = rows.clone().requires_grad_(True)
                    loss = _scalar(objective.loss(fill.index_put((pairs,), leaf).view(N, n_t, L)), "objective(lp)")
                    if loss.requires_grad:
                        (coef,) = torch.autograd.grad(loss, leaf, allow_unused=True)
                if coef is not None:
                    coef = torch.where(scored[pairs], coef, zero)  # lp is a constant 0 where nothing is scored
                    not_finite += (~torch.isfinite(coef)).sum()
                    backward_pass((coef * lp_batch).sum())
                elif backward_pass.distributed and lp_batch.requires_grad:
                    backward_pass((lp_batch * 0).sum())  # nothing to backpropagate: still join the collectives
            if not padding:
                lp[pairs] = rows
    with torch.no_grad():
        # every rank makes the same number of model calls (agreed before the first: FSDP2's forwards gather)
        calls = backward_pass.aligned(len(idle), device) if objective.inert is not None else 0
        for index in range(calls):
            batch = idle[index] if index < len(idle) else (idle or batches)[-1]
            rows = score_batch_of_pairs(model, sequences, masks, batch, batching, capacity=batching.scoring,
                                        attention_mask=attention_mask)
            if index < len(idle):
                lp[batch.pairs] = rows
        lp = lp.view(N, n_t, L)
        value = _scalar(objective.loss(lp), "objective(lp)").detach()
    _check_finite_value(value, "objective(lp)")
    count = int(not_finite)
    if count:
        raise FloatingPointError(
            f"d objective / d lp is not finite at {count} scored positions (objective value {value.item()}); "
            "check the objective for overflow (e.g. exp of a large ELBO difference) before stepping."
        )
    return value, lp


def _check_sequence_local(objective: SequenceLocal, masks: MonteCarloMasks) -> None:
    N, n_t, L = masks.num_sequences, masks.n_t, masks.completion_length
    if objective.fill is not None:
        fill = objective.fill
        if not isinstance(fill, torch.Tensor) or tuple(fill.shape) != (N, n_t, L) or not fill.is_floating_point():
            got = f"{fill.dtype} {tuple(fill.shape)}" if isinstance(fill, torch.Tensor) else type(fill).__name__
            raise ValueError(f"SequenceLocal.fill must be a floating-point [N, n_t, L] = {(N, n_t, L)} tensor (e.g. "
                             f"the old policy's lp on these masks), got {got}.")
    if objective.inert is not None:
        inert = objective.inert
        if not isinstance(inert, torch.Tensor) or tuple(inert.shape) != (N,) or inert.dtype != torch.bool:
            got = f"{inert.dtype} {tuple(inert.shape)}" if isinstance(inert, torch.Tensor) else type(inert).__name__
            raise ValueError(f"SequenceLocal.inert must be a bool [N] = ({N},) tensor (sequences whose terms do not "
                             f"depend on lp), got {got}.")


def _rng_state(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _set_rng_state(states: list[torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)


def _score_with_grad(model, sequences, masks, batch: PairBatch, batching: MicroBatching, attention_mask):
    """A micro-batch's lp rows with their graph, the LM head's gradient going straight into its .grad."""
    return score_batch_of_pairs(model, sequences, masks, batch, batching, capacity=batching.micro_batch,
                                attention_mask=attention_mask, grad_into_weight=True)


def _separable(model, sequences: torch.Tensor, masks: MonteCarloMasks, objective, batching: MicroBatching,
               attention_mask, backward_pass: _Backward):
    n_t, L = masks.n_t, masks.completion_length
    dtype = accumulate_dtype(unwrap_model(model).lm_head_weight.dtype)
    device = sequences.device
    batches = pair_batches(masks, batching.micro_batch)
    value = torch.zeros((), dtype=dtype, device=device)
    lp = torch.zeros(masks.num_sequences * n_t, L, dtype=dtype, device=device)
    total = backward_pass.aligned(len(batches), device)
    losses = []  # each micro-batch's value, checked for finiteness once at the end (a check each is a host sync;
    # a non-finite one's gradient is discarded with the rest by all_or_nothing)
    with torch.enable_grad(), embedding_grads_in_place(model):
        for index in range(total):
            padding = index >= len(batches)  # keeps this rank in step with ranks that have more micro-batches
            batch = batches[-1] if padding else batches[index]
            pairs = batch.pairs
            with backward_pass.step(last=index == total - 1):
                lp_batch = _score_with_grad(model, sequences, masks, batch, batching, attention_mask)
                if padding:
                    loss = (lp_batch * 0).sum()
                else:
                    loss = _scalar(objective(lp_batch, pairs // n_t, pairs % n_t), "objective(lp_pairs, ...)")
                if loss.requires_grad:
                    backward_pass(loss)
                elif backward_pass.distributed and lp_batch.requires_grad:
                    backward_pass((lp_batch * 0).sum())  # the objective ignores lp: still join the collectives
            if not padding:
                losses.append(loss.detach())
                lp[pairs] = lp_batch.detach()
    if losses:
        finite = torch.isfinite(torch.stack(losses))
        if not finite.all():
            first = int((~finite).nonzero()[0])
            _check_finite_value(losses[first], "objective(lp_pairs, ...)", batches[first].pairs, n_t)
        for loss in losses:
            value += loss
    idle = torch.ones(masks.num_sequences * n_t, dtype=torch.bool, device=device)
    for batch in batches:
        idle[batch.pairs] = False
    idle = idle.nonzero().squeeze(-1)
    if idle.numel():
        with torch.no_grad():  # their lp is exactly 0 and constant: they add value, never gradient
            zeros = torch.zeros(idle.numel(), L, dtype=dtype, device=device)
            idle_value = _scalar(objective(zeros, idle // n_t, idle % n_t), "objective(lp_pairs, ...)").detach()
            _check_finite_value(idle_value, "objective(lp_pairs, ...)", idle, n_t)
            value += idle_value
    return value, lp.view(masks.num_sequences, n_t, L)


def _check_finite_value(value: torch.Tensor, call: str, pairs: torch.Tensor | None = None, n_t: int = 1) -> None:
    if torch.isfinite(value):
        return
    where = ""
    if pairs is not None:
        where = " on pairs (sequence, sample) " + ", ".join(f"({int(p) // n_t}, {int(p) % n_t})" for p in pairs[:4])
        where += " ..." if len(pairs) > 4 else ""
    raise FloatingPointError(f"{call} is {value.item()}{where}; no gradient was kept. Check the objective for "
                             "overflow (e.g. exp of a large log-ratio) or non-finite constants (advantages, old lp).")


def _scalar(loss, call: str) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"{call} must return a 0-dim tensor (the loss to minimise), got {got}; reduce it "
                         "with .sum() or .mean().")
    if not loss.is_floating_point():
        raise TypeError(f"{call} must return a floating-point tensor, got {loss.dtype}.")
    return loss
