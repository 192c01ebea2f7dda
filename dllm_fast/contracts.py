"""The shapes that cross layers: the model contract, what a rollout returns, and what an objective consumes.

This module imports only torch and the boundary checks (dllm_fast.validation, which imports only torch), so the
fast paths (sampling, likelihood, objectives) and their plain-PyTorch twins in `dllm_fast/reference/` both build on
it without importing each other.

    rollout  --GenerationResult-->  rewards  --RolloutBatch-->  objective (scores lp on stored masks)
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from dllm_fast.validation import check_binary_mask, data_checks_enabled, non_binary

# Rewards travel as float32 (in a RolloutBatch, in TRL), which holds every integer only up to 2^24, and objectives
# whose advantage is not divided by the group's std scale the gradient by the rewards' spread (near 1e30 it
# overflows, near 1e300 their losses do). One bound for every objective, the trainer and TRL alike
# (dllm_fast.tasks.rewards reads it).
MAX_ABS_REWARD = float(2**24)
# (sequence, sample) pairs one draw of Monte Carlo masks may hold: the trainer's bound per update (its rollouts per
# step times n_t); sizes beyond it are mistakes, refused at once instead of minutes of silence.
MAX_PAIRS = 2**20


@runtime_checkable
class DiffusionLM(Protocol):
    """What dllm_fast needs of a masked diffusion language model.

    - ``model(input_ids [B, S], attention_mask=None) -> hidden [B, S, d]``, the final norm applied and the LM
      head left out, so that the fused ops apply the head only where it is needed. Cache modes of `generate`
      also call ``model.new_cache(batch, capacity)`` and pass ``cache=``, ``cache_start=``, ``attend_length=``.
    - ``lm_head_weight`` [V, d].
    - ``mask_token_id`` and ``eos_token_id`` (``eot_token_id`` for `confidence_eos_eot_inf`).
    - ``logit_shift``: 0 when the hidden state at position i predicts token i (LLaDA), 1 when it predicts token
      i + 1 (Dream). Sampling and scoring read the hidden state of position i - logit_shift for token i.

    - ``block_length`` (block-diffusion models only, e.g. SDAR): the model attends block-causally in blocks of
      this many positions, aligned to each row's first real token (see `block_length`); its forward also takes
      ``clean_length=`` for the two-stream layout likelihoods score in. Bidirectional models have none.

    A PEFT-wrapped model satisfies it through attribute forwarding.
    """

    mask_token_id: int
    eos_token_id: int
    logit_shift: int

    @property
    def lm_head_weight(self) -> torch.Tensor: ...

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor: ...


LOGIT_SHIFTS = (0, 1)


def logit_shift(model) -> int:
    """The model's `logit_shift` (0 when it does not declare one, as LLaDA-style models need not), checked."""
    shift = getattr(unwrap_model(model), "logit_shift", 0)
    if isinstance(shift, bool) or shift not in LOGIT_SHIFTS:
        raise ValueError(f"model.logit_shift={shift!r} must be 0 (hidden at i predicts token i, LLaDA) or 1 "
                         "(hidden at i predicts token i + 1, Dream).")
    return int(shift)


def max_positions(model) -> int | None:
    """The most positions (prompt plus completion) the model takes: its `max_sequence_length` (LLaDA's config
    field; HFDiffusionLM reads max_position_embeddings), or None when it declares none."""
    limit = getattr(unwrap_model(model), "max_sequence_length", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def check_positions(model, length: int, what: str, fix: str) -> None:
    """Raise unless `length` positions (`what` they are) fit the model's positions; `fix` says what to lower."""
    limit = max_positions(model)
    if limit is not None and length > limit:
        raise ValueError(f"{what} need {length} positions; the model has {limit} (max_sequence_length). {fix}")


# How torch and dllm_fast's ops word two dtypes meeting in one operation.
_DTYPE_CLASHES = ("have the same dtype", "expected scalar type", "must share one of", "should be the same dtype",
                  "dtype mismatch", "same dtype as")


@contextlib.contextmanager
def mixed_dtypes_named(model):
    """Within the block, an error from two dtypes meeting in one operation of `model`'s computation, raised while
    its floating-point parameters hold several dtypes, is re-raised as a TypeError that says so, with the dtypes
    and the fix ("expected m1 and m2 to have the same dtype" names neither). Other errors pass unchanged."""
    try:
        yield
    except (RuntimeError, TypeError) as error:
        if not any(clash in str(error) for clash in _DTYPE_CLASHES):
            raise
        counts: dict[torch.dtype, int] = {}
        for parameter in model.parameters():
            if parameter.is_floating_point():
                counts[parameter.dtype] = counts.get(parameter.dtype, 0) + 1
        if len(counts) < 2:
            raise
        held = ", ".join(f"{count} in {dtype}" for dtype, count in sorted(counts.items(), key=lambda kv: -kv[1]))
        raise TypeError(f"the model's parameters hold several dtypes ({held}), and two of them met in one "
                        f"operation ({' '.join(str(error).split())[:160]}); convert the whole model to one dtype, "
                        "e.g. model.to(torch.float32) or model.to(torch.bfloat16).") from error


def block_length(model) -> int | None:
    """The block size of a block-diffusion model's block-causal attention, or None for a bidirectional model
    (LLaDA, Dream). Rollouts then decode block by block against the exact KV cache of earlier blocks, and
    likelihoods score each block given the clean blocks before it."""
    value = getattr(unwrap_model(model), "block_length", None)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"model.block_length={value!r} must be a positive int (a block-diffusion model's block "
                         "size) or None (a bidirectional model).")
    return value


def unwrap_model(model):
    """The module that carries the model contract's attributes: DistributedDataParallel's `.module`, else the model.

    Forward calls still go through the wrapper (so that DDP sees them); only attributes are read here."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module
    return model


def check_reference_model(model, ref_model) -> None:
    """Raise unless `ref_model` can score `model`'s sequences as a reference policy: the same vocabulary (LM head
    rows), mask and EOS ids and logit_shift. A reference with another vocabulary scores other tokens, and its KL
    is meaningless however finite it looks."""
    policy, reference = unwrap_model(model), unwrap_model(ref_model)
    differing = [f"{name} {getattr(reference, name, None)} (the policy's: {getattr(policy, name, None)})"
                 for name in ("mask_token_id", "eos_token_id")
                 if getattr(reference, name, None) != getattr(policy, name, None)]
    if logit_shift(reference) != logit_shift(policy):
        differing.append(f"logit_shift {logit_shift(reference)} (the policy's: {logit_shift(policy)})")
    rows, policy_rows = reference.lm_head_weight.shape[0], policy.lm_head_weight.shape[0]
    if rows != policy_rows:
        differing.insert(0, f"a vocabulary of {rows} tokens (the policy's: {policy_rows})")
    if differing:
        raise ValueError(f"ref_model has {', '.join(differing)}; a reference policy must share the policy's "
                         "tokenizer: pass a copy of the initial policy (or lp_ref= scored on the same masks).")


def data_parallel(model) -> bool:
    """Whether `model` is a data-parallel wrapper whose calls involve collectives: DistributedDataParallel, or a
    module sharded with FSDP2's fully_shard."""
    return isinstance(model, torch.nn.parallel.DistributedDataParallel) or hasattr(model,
                                                                                  "set_requires_gradient_sync")


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype log-probs are accumulated and returned in: fp64 for fp64 inputs (exact tests), else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def completion_mask(completion: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """[N, L] token ids -> [N, L] bool: True up to and including each row's first EOS (all True without one).

    The one definition of which completion tokens are real: rollouts report it, objectives normalise by it, and
    the likelihood engine's ``count="eos"`` scores exactly these positions.
    """
    is_eos = (completion == eos_token_id).to(torch.int64)
    return (is_eos.cumsum(dim=-1) - is_eos) == 0


@dataclass
class GenerationResult:
    """What a rollout returns.

    sequences: [B, P + G] prompt (as given, left padding included) followed by the completion.
    completion_ids: [B, G] the generated tokens.
    completion_mask: [B, G] bool, True up to and including the first EOS (all True if there is none).
    nfe: number of model forward calls (a CFG step counts once: one forward of the doubled batch).
    attention_mask: [B, P + G] (1 = token, 0 = left padding), or None when the prompts had no padding mask.
    unmask_step: [B, G] int64, for each completion position the 0-based index of the denoising forward that
        unmasked it (the nfe count before that forward, counted across blocks); None unless the rollout was
        asked to record it (generate(record_unmask_step=True); TraceRL's trajectory order).
    step_predictions: [B, K, G] int64 (K = nfe), MDPO's one-step predictions: at forward k, the canvas before it
        with every masked completion position filled by the model's sample (argmax at T = 0); the canvas x_k itself
        is the positions with unmask_step >= k masked. None unless generate(record_step_predictions=True).
    step_confidence: [B, K, G] float32, the sampled tokens' confidences at those masked positions (as the sampler
        ranks them: softmax of the unscaled logits), 0 at the positions already decoded before forward k; None
        unless recorded.
    """

    sequences: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    nfe: int
    attention_mask: torch.Tensor | None = None
    unmask_step: torch.Tensor | None = None
    step_predictions: torch.Tensor | None = None
    step_confidence: torch.Tensor | None = None

    @property
    def prompt_length(self) -> int:
        return self.sequences.shape[1] - self.completion_ids.shape[1]


@dataclass(frozen=True, eq=False)  # holds tensors: compare fields explicitly
class RolloutBatch:
    """Rollouts with their rewards: what every objective consumes.

    sequences: [N, P + L] prompt (left-padded to the common length P) followed by the completion.
    attention_mask: [N, P + L] (1 = token, 0 = padding) or None (no padding).
    prompt_length: P.
    completion_mask: [N, L] bool, up to and including the first EOS (`completion_mask`).
    rewards: [N] float, finite, within +-MAX_ABS_REWARD (2^24).
    group_size: G; rows [g * G, (g + 1) * G) are the G completions of prompt g.
    unmask_step: [N, L] int64 or None: the 0-based denoising forward at which the rollout unmasked each
        completion position (`generate(..., record_unmask_step=True)`); what trajectory objectives (TraceRL)
        replay. None when not recorded.
    forwards: with unmask_step, the rollout's forward count (`GenerationResult.nfe`; from_generation sets it)
        or a bound on it: every step lies in [0, forwards). None: L, which bounds every rollout whose rows share
        one block alignment and decode only their L positions (a forward unmasks at least one of each row's); give
        it when the record was cut to fewer positions than were generated, or for a block-diffusion batch of prompts
        of different lengths or with full_last_block (up to L + 2 block_length forwards: rollout/blocks.py).

    Every field is checked on construction like the trainer's own inputs, each error naming the field, the value
    and the fix: sequences int64/int32 token ids >= 0; attention_mask bool or integer 0/1 (floats refused: 0.5
    would read as a token to one consumer and padding to another), left-padded, each completion position
    attended; completion_mask bool with each row's first position counted (as `completion_mask` gives); rewards
    a real float tensor; every tensor on the sequences' (real, not meta) device. The checks that read values
    cost one host sync and are skipped where values cannot be read (fake tensors, torch.compile tracing).
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor | None
    prompt_length: int
    completion_mask: torch.Tensor
    rewards: torch.Tensor
    group_size: int
    unmask_step: torch.Tensor | None = None
    forwards: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.sequences, torch.Tensor) or self.sequences.dim() != 2:
            raise ValueError(f"RolloutBatch.sequences must be a [N, P + L] tensor of token ids, got "
                             f"{_describe(self.sequences)}.")
        if self.sequences.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"RolloutBatch.sequences holds {self.sequences.dtype}; token ids are int64 (or int32): "
                            "use sequences.long() on integer-valued ids.")
        N, S = self.sequences.shape
        if N == 0:
            raise ValueError("RolloutBatch has no rollouts (N = 0); roll out at least one group.")
        if isinstance(self.prompt_length, bool) or not isinstance(self.prompt_length, int) or not (
                0 <= self.prompt_length < S):
            raise ValueError(f"RolloutBatch.prompt_length={self.prompt_length!r} must be an int in [0, {S}) so "
                             "that the completion is not empty.")
        L = S - self.prompt_length
        if self.attention_mask is not None:
            check_binary_mask("RolloutBatch.attention_mask", self.attention_mask, shape=(N, S),
                              device=self.sequences.device, check_values=False)
        if (not isinstance(self.completion_mask, torch.Tensor) or self.completion_mask.dtype != torch.bool
                or tuple(self.completion_mask.shape) != (N, L)):
            raise ValueError(f"RolloutBatch.completion_mask must be a bool [N, L] = [{N}, {L}] tensor, got "
                             f"{_describe(self.completion_mask)}.")
        check_rewards_tensor(self.rewards, N)
        check_group_size(self.group_size, N)
        if self.unmask_step is not None:
            check_unmask_step(self.unmask_step, (N, L))
            if self.forwards is not None:
                check_forwards(self.forwards)
        elif self.forwards is not None:
            raise ValueError(f"RolloutBatch.forwards={self.forwards!r} bounds unmask_step, which is None; drop it.")
        _check_same_device(self)
        if data_checks_enabled(self.sequences, self.attention_mask, self.completion_mask, self.rewards,
                               self.unmask_step):
            self._check_values()

    def _check_values(self) -> None:
        """The checks that read values, in one host sync (a failure then reads more, to name the position)."""
        P, L = self.prompt_length, self.completion_length
        forwards = self.forwards if self.forwards is not None else L
        flags = {"negative id": self.sequences < 0, "empty completion": ~self.completion_mask[:, 0]}
        if self.attention_mask is not None:
            real = self.attention_mask != 0
            flags.update({"non-binary": non_binary(self.attention_mask), "completion not attended": ~real[:, P:]})
            if P:
                prompt = real[:, :P]
                flags["not left-padded"] = prompt != prompt.to(torch.int8).cummax(dim=1).values.bool()
        flags.update({"non-finite reward": ~torch.isfinite(self.rewards),
                      "reward beyond bound": self.rewards.abs() > MAX_ABS_REWARD})
        if self.unmask_step is not None:
            flags["step out of range"] = (self.unmask_step < 0) | (self.unmask_step >= forwards)
        found = dict(zip(flags, torch.stack([flag.any() for flag in flags.values()]).tolist()))
        if found["negative id"]:
            n, i = _first(flags["negative id"])
            raise ValueError(f"RolloutBatch.sequences[{n}, {i}] = {int(self.sequences[n, i])}; token ids are >= 0.")
        if found["empty completion"]:
            n = int((~self.completion_mask[:, 0]).nonzero()[0])
            raise ValueError(f"RolloutBatch.completion_mask[{n}, 0] is False; a completion counts its tokens up to "
                             "and including the first EOS, so its first position always counts: build the mask "
                             "with dllm_fast.contracts.completion_mask(completion_ids, eos_token_id).")
        if found.get("non-binary"):
            check_binary_mask("RolloutBatch.attention_mask", self.attention_mask, shape=tuple(self.sequences.shape),
                              device=self.sequences.device)
        if found.get("not left-padded"):
            n = int(flags["not left-padded"].any(-1).nonzero()[0])
            raise ValueError(f"RolloutBatch.attention_mask row {n} is not left-padded in the prompt (zeros, then "
                             "ones); pad prompts on the left, as generate expects them.")
        if found.get("completion not attended"):
            n, i = _first(flags["completion not attended"])
            raise ValueError(f"RolloutBatch.attention_mask[{n}, {P + i}] = 0 is in the completion (position {i}); "
                             "every completion position is attended (1), as in sampling.")
        if found["non-finite reward"] or found["reward beyond bound"]:
            check_rewards(self.rewards, self.group_size)
        if found.get("step out of range"):
            check_unmask_step(self.unmask_step, (self.num_rollouts, L), forwards=forwards,
                              bound="the rollout's forwards" if self.forwards is not None else
                              "the completion's positions: each forward unmasks at least one; pass forwards="
                              "GenerationResult.nfe when the record was cut to fewer positions than were generated, "
                              "or a block-diffusion batch mixed prompt lengths or decoded full last blocks")

    @classmethod
    def from_generation(
        cls,
        result: GenerationResult,
        rewards: torch.Tensor | Sequence[float],
        *,
        group_size: int,
    ) -> "RolloutBatch":
        """Pair a `generate` result with one reward per row. Rows must come in contiguous groups of
        `group_size` completions of the same prompt (repeat each prompt G times before generating)."""
        sequences = result.sequences
        rewards = rewards_tensor(rewards, sequences.shape[0], sequences.device)
        unmask_step = getattr(result, "unmask_step", None)
        return cls(sequences=sequences, attention_mask=result.attention_mask, prompt_length=result.prompt_length,
                   completion_mask=result.completion_mask, rewards=rewards, group_size=group_size,
                   unmask_step=unmask_step, forwards=None if unmask_step is None else result.nfe)

    @property
    def num_rollouts(self) -> int:
        return self.sequences.shape[0]

    @property
    def num_groups(self) -> int:
        return self.num_rollouts // self.group_size

    @property
    def completion_length(self) -> int:
        """L, the padded completion width."""
        return self.sequences.shape[1] - self.prompt_length

    @property
    def completion_ids(self) -> torch.Tensor:
        return self.sequences[:, self.prompt_length:]

    @property
    def completion_lengths(self) -> torch.Tensor:
        """[N] int64: the real completion tokens of each row (through the first EOS)."""
        return self.completion_mask.sum(-1)

    def grouped(self, values: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [N / G, G, ...]: a view with one row per prompt group."""
        return values.view(self.num_groups, self.group_size, *values.shape[1:])

    def groups(self, start: int, end: int) -> "RolloutBatch":
        """Prompt groups [start, end) as a batch of their own (rows start * G .. end * G - 1), e.g. one
        data-parallel rank's share: advantages stay within complete groups."""
        if not 0 <= start < end <= self.num_groups:
            raise ValueError(f"groups({start}, {end}) must satisfy 0 <= start < end <= {self.num_groups}.")
        rows = slice(start * self.group_size, end * self.group_size)
        mask = None if self.attention_mask is None else self.attention_mask[rows]
        steps = None if self.unmask_step is None else self.unmask_step[rows]
        return RolloutBatch(self.sequences[rows], mask, self.prompt_length, self.completion_mask[rows],
                            self.rewards[rows], self.group_size, steps, self.forwards)

    def to(self, device: torch.device | str) -> "RolloutBatch":
        mask = None if self.attention_mask is None else self.attention_mask.to(device)
        steps = None if self.unmask_step is None else self.unmask_step.to(device)
        return RolloutBatch(self.sequences.to(device), mask, self.prompt_length, self.completion_mask.to(device),
                            self.rewards.to(device), self.group_size, steps, self.forwards)


def check_group_size(group_size, num_rollouts: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be an int >= 1 (completions per prompt).")
    if num_rollouts % group_size:
        raise ValueError(f"group_size={group_size} does not divide the {num_rollouts} rollouts; every prompt group "
                         f"must be complete (N = prompts x G), e.g. drop the last {num_rollouts % group_size}.")


def check_unmask_step(unmask_step, shape: tuple[int, int], forwards: int | None = None,
                      bound: str = "the rollout's forwards") -> None:
    """An unmask-step record: int64 [N, L]; with `forwards`, each step in [0, forwards) (`bound` says what limits
    it). The value check reads the record (one host sync)."""
    if (not isinstance(unmask_step, torch.Tensor) or unmask_step.dtype != torch.int64
            or tuple(unmask_step.shape) != tuple(shape)):
        raise ValueError(f"unmask_step must be an int64 [N, L] = {list(shape)} tensor (one denoising step per "
                         f"completion position), got {_describe(unmask_step)}.")
    if unmask_step.numel() == 0 or forwards is None:
        return
    bad = (unmask_step < 0) | (unmask_step >= forwards)
    if bad.any():
        n, i = _first(bad)
        raise ValueError(f"unmask_step[{n}, {i}] = {int(unmask_step[n, i])} is not a denoising step in "
                         f"[0, {forwards}) ({bound}): steps count the rollout's forwards from 0.")


def check_forwards(forwards) -> None:
    if isinstance(forwards, bool) or not isinstance(forwards, int) or forwards < 1:
        raise ValueError(f"RolloutBatch.forwards={forwards!r} must be an int >= 1: the rollout's forward count "
                         "(GenerationResult.nfe), which every unmask_step lies below.")


def rewards_tensor(rewards, num_rollouts: int, device: torch.device) -> torch.Tensor:
    """One reward per rollout as a float tensor on `device` (integers and bools become float32), or a TypeError /
    ValueError naming what was given and what a reward must be."""
    if isinstance(rewards, torch.Tensor):
        if rewards.is_complex():
            raise TypeError(f"rewards is a {rewards.dtype} tensor; a reward is one real number per rollout.")
        tensor = rewards
    else:
        if rewards is None or isinstance(rewards, (str, bytes, dict)) or not hasattr(rewards, "__len__"):
            shown = repr(rewards)
            raise TypeError(f"rewards={shown if len(shown) <= 80 else shown[:77] + '...'} (a {type(rewards).__name__}) "
                            f"must hold one real number per rollout: a [{num_rollouts}] tensor or a list of "
                            f"{num_rollouts} floats.")
        try:
            tensor = torch.as_tensor(rewards)
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(f"rewards must hold one real number per rollout ({num_rollouts} of them), got "
                            f"{type(rewards).__name__} that torch reads as none ({error}).") from None
        if tensor.is_complex() or not (tensor.is_floating_point() or tensor.dtype in _INTEGER_DTYPES):
            raise TypeError(f"rewards holds {tensor.dtype}; a reward is one real number per rollout.")
    if tensor.device.type == "meta":
        raise ValueError("rewards is on the meta device and holds no values; compute them on a real device.")
    tensor = tensor.to(device)
    if not tensor.is_floating_point():
        tensor = tensor.to(torch.float32)
    if tensor.dim() != 1 or tensor.shape[0] != num_rollouts:
        raise ValueError(f"rewards has shape {tuple(tensor.shape)}; give one reward per rollout, [{num_rollouts}].")
    return tensor


_INTEGER_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def check_rewards_tensor(rewards, num_rollouts: int) -> None:
    """A float [N] tensor on a real device (the values are checked by `check_rewards`)."""
    if (not isinstance(rewards, torch.Tensor) or not rewards.is_floating_point()
            or tuple(rewards.shape) != (num_rollouts,)):
        raise ValueError(f"RolloutBatch.rewards must be a float [N] = [{num_rollouts}] tensor, got "
                         f"{_describe(rewards)}; build it with RolloutBatch.from_generation.")


def check_rewards(rewards: torch.Tensor, group_size: int) -> None:
    """Raise naming the first reward that is not finite or lies beyond +-MAX_ABS_REWARD, with its prompt group
    and its completion (one host sync)."""
    bad = ~torch.isfinite(rewards) | (rewards.abs() > MAX_ABS_REWARD)
    if not bad.any():
        return
    row = int(bad.nonzero()[0])
    value = float(rewards[row])
    where = f"rewards[{row}] is {value:.6g} (prompt group {row // group_size}, completion {row % group_size})"
    if math.isfinite(value):
        raise ValueError(f"{where}, beyond the reward range [-2^24, 2^24] every objective accepts; rescale the "
                         "rewards (advantages are relative within a group, so dividing every reward by a constant "
                         "keeps their ranking).")
    raise ValueError(f"{where}; every reward must be finite: fix the reward function for that rollout, or drop its "
                     "group.")


def _check_same_device(batch: "RolloutBatch") -> None:
    device = batch.sequences.device
    if device.type == "meta":
        raise ValueError("RolloutBatch.sequences is on the meta device and holds no tokens; pass real rollouts.")
    for name in ("attention_mask", "completion_mask", "rewards", "unmask_step"):
        tensor = getattr(batch, name)
        if tensor is not None and tensor.device.type == "meta":
            raise ValueError(f"RolloutBatch.{name} is on the meta device and holds no values; compute it on "
                             f"{device}, where sequences are.")
        if tensor is not None and tensor.device != device:
            raise ValueError(f"RolloutBatch.{name} is on {tensor.device} but sequences on {device}; move it with "
                             f".to({str(device)!r}) (or build the batch with RolloutBatch.from_generation).")


def _first(flags: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(v) for v in flags.nonzero()[0])


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} of shape {tuple(value.shape)}"
    return type(value).__name__
