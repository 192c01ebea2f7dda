"""The shapes that cross layers: the model contract, what a rollout returns, and what an objective consumes.

This module imports only torch, so the fast paths (sampling, likelihood, objectives) and their plain-PyTorch
twins in `dllm_fast/reference/` both build on it without importing each other.

    rollout  --GenerationResult-->  rewards  --RolloutBatch-->  objective (scores lp on stored masks)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch


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
    """

    sequences: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    nfe: int
    attention_mask: torch.Tensor | None = None
    unmask_step: torch.Tensor | None = None

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
    rewards: [N] float, finite.
    group_size: G; rows [g * G, (g + 1) * G) are the G completions of prompt g.
    unmask_step: [N, L] int64 or None: the 0-based denoising forward at which the rollout unmasked each
        completion position (`generate(..., record_unmask_step=True)`); what trajectory objectives (TraceRL)
        replay. None when not recorded.
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor | None
    prompt_length: int
    completion_mask: torch.Tensor
    rewards: torch.Tensor
    group_size: int
    unmask_step: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.sequences, torch.Tensor) or self.sequences.dim() != 2:
            raise ValueError(f"RolloutBatch.sequences must be a [N, P + L] tensor of token ids, got "
                             f"{_describe(self.sequences)}.")
        N, S = self.sequences.shape
        if N == 0:
            raise ValueError("RolloutBatch has no rollouts (N = 0); roll out at least one group.")
        if isinstance(self.prompt_length, bool) or not isinstance(self.prompt_length, int) or not (
                0 <= self.prompt_length < S):
            raise ValueError(f"RolloutBatch.prompt_length={self.prompt_length!r} must be an int in [0, {S}) so "
                             "that the completion is not empty.")
        L = S - self.prompt_length
        if self.attention_mask is not None and tuple(self.attention_mask.shape) != (N, S):
            raise ValueError(f"RolloutBatch.attention_mask has shape {tuple(self.attention_mask.shape)}; it must "
                             f"match sequences, {(N, S)}.")
        if (not isinstance(self.completion_mask, torch.Tensor) or self.completion_mask.dtype != torch.bool
                or tuple(self.completion_mask.shape) != (N, L)):
            raise ValueError(f"RolloutBatch.completion_mask must be a bool [N, L] = [{N}, {L}] tensor, got "
                             f"{_describe(self.completion_mask)}.")
        if (not isinstance(self.rewards, torch.Tensor) or not self.rewards.is_floating_point()
                or tuple(self.rewards.shape) != (N,)):
            raise ValueError(f"RolloutBatch.rewards must be a float [N] = [{N}] tensor, got "
                             f"{_describe(self.rewards)}; build it with RolloutBatch.from_generation.")
        check_group_size(self.group_size, N)
        check_finite_rewards(self.rewards, self.group_size)
        if self.unmask_step is not None:
            check_unmask_step(self.unmask_step, (N, L))

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
        rewards = torch.as_tensor(rewards, device=sequences.device)
        if not rewards.is_floating_point():
            rewards = rewards.to(torch.float32)
        if rewards.dim() != 1 or rewards.shape[0] != sequences.shape[0]:
            raise ValueError(f"rewards has shape {tuple(rewards.shape)}; give one reward per rollout, "
                             f"[{sequences.shape[0]}].")
        unmask_step = getattr(result, "unmask_step", None)
        if unmask_step is not None:
            check_unmask_step(unmask_step, tuple(result.completion_ids.shape), forwards=result.nfe)
        return cls(sequences=sequences, attention_mask=result.attention_mask, prompt_length=result.prompt_length,
                   completion_mask=result.completion_mask, rewards=rewards, group_size=group_size,
                   unmask_step=unmask_step)

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
                            self.rewards[rows], self.group_size, steps)

    def to(self, device: torch.device | str) -> "RolloutBatch":
        mask = None if self.attention_mask is None else self.attention_mask.to(device)
        steps = None if self.unmask_step is None else self.unmask_step.to(device)
        return RolloutBatch(self.sequences.to(device), mask, self.prompt_length, self.completion_mask.to(device),
                            self.rewards.to(device), self.group_size, steps)


def check_group_size(group_size, num_rollouts: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be an int >= 1 (completions per prompt).")
    if num_rollouts % group_size:
        raise ValueError(f"group_size={group_size} does not divide the {num_rollouts} rollouts; every prompt group "
                         f"must be complete (N = prompts x G), e.g. drop the last {num_rollouts % group_size}.")


def check_unmask_step(unmask_step, shape: tuple[int, int], forwards: int | None = None) -> None:
    """An unmask-step record: int64 [N, L], each step in [0, forwards) (the rollout's nfe, when known)."""
    if (not isinstance(unmask_step, torch.Tensor) or unmask_step.dtype != torch.int64
            or tuple(unmask_step.shape) != tuple(shape)):
        raise ValueError(f"unmask_step must be an int64 [N, L] = {list(shape)} tensor (one denoising step per "
                         f"completion position), got {_describe(unmask_step)}.")
    if unmask_step.numel() == 0:
        return
    low, high = (int(v) for v in torch.stack((unmask_step.min(), unmask_step.max())).tolist())
    if low < 0 or (forwards is not None and high >= forwards):
        bad = (unmask_step < 0) if low < 0 else (unmask_step >= forwards)
        n, i = (int(v) for v in bad.nonzero()[0])
        limit = f"[0, {forwards})" if forwards is not None else ">= 0"
        raise ValueError(f"unmask_step[{n}, {i}] = {int(unmask_step[n, i])} is not a denoising step {limit}: "
                         "steps count the rollout's forwards from 0.")


def check_finite_rewards(rewards: torch.Tensor, group_size: int) -> None:
    """Raise naming the first non-finite reward, its prompt group and its completion."""
    bad = ~torch.isfinite(rewards)
    if bad.any():
        row = int(bad.nonzero()[0])
        value = float(rewards[row])
        raise ValueError(f"rewards[{row}] is {value} (prompt group {row // group_size}, completion "
                         f"{row % group_size}); every reward must be finite: fix the reward function for that "
                         "rollout, or drop its group.")


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} of shape {tuple(value.shape)}"
    return type(value).__name__
