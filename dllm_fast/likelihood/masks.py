"""The stored Monte Carlo masks (`MonteCarloMasks`) and what draws them (`sample_masks`, `draw_masks`).

Every sampler draws from an explicit `torch.Generator` (never the global RNG) and returns a `MonteCarloMasks`.
Replaying is reusing that object: the current, old and reference policies are scored on it, so they see
identical masks by construction, however they are chunked into micro-batches.

Layout. Sequences are `[N, P + L]`: a common prompt length P (prompts left-padded) and the completion in the
last L positions. For each sequence n and sample j the object records which of the P + L positions are replaced
by the mask token, the sample's ELBO weight, and its noise level.

Which completion positions count (`counted[N, L]`, see `counted_positions`):

- ``count="eos"`` (d1, SPG, wd1): positions up to and including the first EOS; all L when there is none;
- ``count="all"`` (LLaDA SFT, ESPO): all L positions, EOS padding included.

Positions that do not count are never scored, and every sampler keeps them masked. The estimate is then an
ELBO of the marginal likelihood of the counted prefix (masking marginalises a position out), and the model
cannot read the answer's length off the EOS padding. SPG's code masks them the same way.

The samplers (random_t, stratified_l, complementary, block, mean_field, gauss, coupled, block_elbo, trajectory),
their weights and the n_t each accepts are in samplers.py, their registry; the settings travel as one `MaskSpec`
(mask_spec.py).

Prompt tokens are never scored; only ``block`` and ``mean_field`` mask them. Left padding (attention_mask == 0)
is never masked.
"""

from __future__ import annotations

import math

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from dllm_fast.contracts import completion_mask
from dllm_fast.likelihood.mask_spec import MaskSpec
from dllm_fast.likelihood.samplers import COUNT_MODES, SAMPLERS, Canvas, Uniform, check_pairs

# Samplers that draw from the generator (trajectory replays the rollout instead).
RANDOM_SAMPLERS = tuple(name for name, sampler in SAMPLERS.items() if sampler.random)


@dataclass(frozen=True, eq=False)  # tensors: compare fields explicitly, never with ==
class MonteCarloMasks:
    """n_t stored masks for each of N sequences of length P + L (P = prompt_length).

    Attributes:
        masked: [N, n_t, P + L] bool, True where sample j of sequence n replaces the token by the mask token.
        counted: [N, L] bool, completion positions that count (scored when masked).
        weight: [N, n_t] float64, the sample's ELBO weight w_j (1/t, L_n/l, (L_n+1)/|M|, L_n/m, 1, K c_k/t_k,
            the coupled weights or n_t; see the module docstring); or [N, n_t, L], a weight per position, for a
            sampler whose noise level varies within a sample ("block_elbo"). `weighted_sum` applies either.
        t: [N, n_t] float64, the noise level the weight came from (t, l/L_n, |M|/(L_n+1), m/L_n, 1, t_k, the
            pair's t, or the state's masked fraction of counted positions).
        num_masked: [N, n_t] int64, the positions each sample's estimate reads (`targets`): its masked counted
            completion positions, except for "trajectory".
        prompt_length: P.
        sampler: the name of the sampler that drew them.
        fingerprint: [N, 2] int64 hash of the sequences they were drawn for (`sequence_fingerprint`), or None
            (masks drawn from explicit inputs by `draw_masks`). Scoring checks it, so masks drawn for other
            sequences of the same shape are rejected instead of scoring the wrong positions.
        target: [N, n_t, L] bool, the scored positions each sample's estimate reads, or None: all of them. Only
            "trajectory" sets it: a state reads the tokens decoded during it, while the later ones are masked
            (and scored, so their lp is there) only as context.
    """

    masked: torch.Tensor
    counted: torch.Tensor
    weight: torch.Tensor
    t: torch.Tensor
    num_masked: torch.Tensor
    prompt_length: int
    sampler: str
    fingerprint: torch.Tensor | None = None
    target: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.masked.dim() != 3 or self.masked.dtype != torch.bool:
            raise ValueError(f"MonteCarloMasks.masked must be a bool [N, n_t, P + L] tensor, got "
                             f"{self.masked.dtype} of shape {tuple(self.masked.shape)}.")
        N, n_t, S = self.masked.shape
        L = S - self.prompt_length
        if self.counted.shape != (N, L) or self.counted.dtype != torch.bool:
            raise ValueError(f"MonteCarloMasks.counted must be bool [N, L] = [{N}, {L}], got "
                             f"{self.counted.dtype} of shape {tuple(self.counted.shape)}.")
        for name in ("weight", "t", "num_masked"):
            value = getattr(self, name)
            if value.shape != (N, n_t) and not (name == "weight" and value.shape == (N, n_t, L)):
                raise ValueError(f"MonteCarloMasks.{name} must be [N, n_t] = [{N}, {n_t}], "
                                 f"got shape {tuple(value.shape)}.")
        if self.fingerprint is not None and tuple(self.fingerprint.shape) != (N, 2):
            raise ValueError(f"MonteCarloMasks.fingerprint must be [N, 2] = [{N}, 2], got shape "
                             f"{tuple(self.fingerprint.shape)}.")
        if self.target is not None and (self.target.dtype != torch.bool or tuple(self.target.shape) != (N, n_t, L)):
            raise ValueError(f"MonteCarloMasks.target must be bool [N, n_t, L] = [{N}, {n_t}, {L}], got "
                             f"{self.target.dtype} of shape {tuple(self.target.shape)}.")

    @property
    def num_sequences(self) -> int:
        return self.masked.shape[0]

    @property
    def n_t(self) -> int:
        return self.masked.shape[1]

    @property
    def completion_length(self) -> int:
        return self.masked.shape[2] - self.prompt_length

    @property
    def scored(self) -> torch.Tensor:
        """[N, n_t, L] bool: completion positions that are masked and counted, i.e. where lp is nonzero."""
        return self.masked[..., self.prompt_length:] & self.counted[:, None, :]

    @property
    def targets(self) -> torch.Tensor:
        """[N, n_t, L] bool: the scored positions the estimators read (`scored`, unless `target` narrows it)."""
        return self.scored if self.target is None else self.target

    @property
    def num_counted(self) -> torch.Tensor:
        """[N] int64: L_n, the counted completion positions of each sequence (per-token normalisers)."""
        return self.counted.sum(-1)

    def to(self, device: torch.device | str) -> "MonteCarloMasks":
        return MonteCarloMasks(
            masked=self.masked.to(device), counted=self.counted.to(device), weight=self.weight.to(device),
            t=self.t.to(device), num_masked=self.num_masked.to(device), prompt_length=self.prompt_length,
            sampler=self.sampler, fingerprint=None if self.fingerprint is None else self.fingerprint.to(device),
            target=None if self.target is None else self.target.to(device),
        )

    def rows(self, start: int, end: int) -> "MonteCarloMasks":
        """The masks of sequences [start, end): e.g. one data-parallel rank's share of masks drawn for the
        whole batch, so that every world size sees the same masks."""
        if not 0 <= start < end <= self.num_sequences:
            raise ValueError(f"rows({start}, {end}) must satisfy 0 <= start < end <= {self.num_sequences}.")
        part = slice(start, end)
        return MonteCarloMasks(
            masked=self.masked[part], counted=self.counted[part], weight=self.weight[part], t=self.t[part],
            num_masked=self.num_masked[part], prompt_length=self.prompt_length, sampler=self.sampler,
            fingerprint=None if self.fingerprint is None else self.fingerprint[part],
            target=None if self.target is None else self.target[part],
        )

    def check_sequences(self, sequences: torch.Tensor) -> None:
        """Raise unless `sequences` are the ones these masks were drawn for (when a fingerprint was recorded).

        The fingerprint syncs with the host, so a tensor that matched once is remembered (weakly, with its
        version counter): scoring the old, reference and current policies on the sequences the masks were drawn
        for computes it once, at the draw. Changing the tensor in place makes it be checked again."""
        if self.fingerprint is None or self._matched(sequences):
            return
        mismatch = (sequence_fingerprint(sequences) != self.fingerprint.to(sequences.device)).any(-1)
        if mismatch.any():
            row = int(mismatch.nonzero()[0])
            raise ValueError(f"sequences[{row}] is not the sequence these masks were drawn for (its fingerprint "
                             "differs): draw masks for these sequences with sample_masks, and score every policy "
                             "on the sequences they were drawn for.")
        self._remember(sequences)

    def _matched(self, sequences: torch.Tensor) -> bool:
        matched = self.__dict__.get("_matched_sequences")
        return matched is not None and matched[0]() is sequences and matched[1] == sequences._version

    def _remember(self, sequences: torch.Tensor) -> None:
        object.__setattr__(self, "_matched_sequences", (weakref.ref(sequences), sequences._version))

    def check_lp(self, lp: torch.Tensor, name: str = "lp") -> None:
        """Raise unless `lp` [N, n_t, L] could have been scored on these masks: right shape, floating point,
        finite, <= 0, and exactly 0 wherever these masks score nothing. Catches log-probs scored on another
        draw (its nonzero pattern differs)."""
        expected = (self.num_sequences, self.n_t, self.completion_length)
        if not isinstance(lp, torch.Tensor) or tuple(lp.shape) != expected:
            shape = tuple(lp.shape) if isinstance(lp, torch.Tensor) else type(lp).__name__
            raise ValueError(f"{name} must be [N, n_t, L] = {list(expected)} (scored on these masks), got {shape}.")
        if not lp.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {lp.dtype}.")
        stray = (lp != 0) & ~self.scored.to(lp.device)
        if stray.any():
            n, j, i = (int(v) for v in stray.nonzero()[0])
            value = float(lp[n, j, i].detach())
            if not math.isfinite(value):  # a non-finite value says nothing about which masks scored it
                raise ValueError(f"{name}[{n}, {j}, {i}] = {value} where these masks score nothing (lp is 0 "
                                 f"there); {name} holds a non-finite value: check the scoring that produced it, "
                                 "and leave unscored positions at 0.")
            raise ValueError(f"{name}[{n}, {j}, {i}] = {value} but these masks score nothing there: "
                             f"{name} was scored on other masks. Score every policy on the same MonteCarloMasks.")
        bad = ~torch.isfinite(lp) | (lp > 0)
        if bad.any():
            n, j, i = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"{name}[{n}, {j}, {i}] = {float(lp[n, j, i].detach())} is not a log-probability (finite, "
                             "<= 0).")


_FINGERPRINT_PRIME = 2**31 - 1
_fingerprint_multipliers: dict[tuple[int, str], torch.Tensor] = {}


def sequence_fingerprint(sequences: torch.Tensor) -> torch.Tensor:
    """[N, S] token ids -> [N, 2] int64: two position-weighted sums modulo 2^31 - 1 with fixed pseudo-random
    multipliers. Equal sequences give equal fingerprints; different ones collide with probability ~2^-62."""
    S = sequences.shape[1]
    key = (S, str(sequences.device))
    multipliers = _fingerprint_multipliers.get(key)
    if multipliers is None:
        generator = torch.Generator().manual_seed(20251122)
        multipliers = torch.randint(1, _FINGERPRINT_PRIME, (2, S), generator=generator).to(sequences.device)
        _fingerprint_multipliers[key] = multipliers
    tokens = sequences.long() % _FINGERPRINT_PRIME  # each product stays below 2^62, each sum below 2^63
    return ((tokens[:, None, :] * multipliers) % _FINGERPRINT_PRIME).sum(-1) % _FINGERPRINT_PRIME


def counted_positions(completion: torch.Tensor, *, eos_token_id: int | None, count: str = "eos") -> torch.Tensor:
    """Which completion positions count: [N, L] token ids -> [N, L] bool.

    count="eos": `dllm_fast.contracts.completion_mask`, positions up to and including the first `eos_token_id`
    (all of them if there is none), the same mask a rollout reports; count="all": every position.
    """
    if count not in COUNT_MODES:
        raise ValueError(f"count={count!r} is not one of {COUNT_MODES}.")
    if count == "all":
        return torch.ones_like(completion, dtype=torch.bool)
    if eos_token_id is None:
        raise ValueError("count='eos' needs eos_token_id (e.g. model.eos_token_id); or pass count='all'.")
    return completion_mask(completion, eos_token_id)


def sample_masks(
    sequences: torch.Tensor,
    spec: MaskSpec | None = None,
    *,
    prompt_length: int,
    generator: torch.Generator,
    eos_token_id: int | None = None,
    attention_mask: torch.Tensor | None = None,
    unmask_step: torch.Tensor | None = None,
    **settings: Any,
) -> MonteCarloMasks:
    """Draw n_t masks per sequence with the sampler and settings of `spec` (samplers.py describes each).

    Args:
        sequences: [N, P + L] token ids; the completion is the last L = P + L - prompt_length positions.
        spec: the mask settings (`MaskSpec`: sampler, n_t, count, the sampler's own). Or give them as keywords
            instead (`settings`): sampler=, n_t= (None for "trajectory", whose sample count is its number of
            states), count=, block_length=, perturb_prob=, quadrature_points=, t_range=(low, high), shrink=.
        prompt_length: P, the common (left-padded) prompt length.
        generator: the only source of randomness. Draws happen on its device, then move to sequences' device.
        eos_token_id: the EOS id count="eos" counts through (see `counted_positions`).
        attention_mask: optional [N, P + L]; prompt padding (0) is never masked.
        unmask_step: "trajectory": [N, L] int64 step at which the rollout unmasked each completion position
            (`RolloutBatch.unmask_step`).

    Returns:
        MonteCarloMasks on sequences' device.

    Bound: N * n_t (for "trajectory", N times the most states of a row) within contracts.MAX_PAIRS (2^20, the
    trainer's bound per update), refused naming the sizes and the fix.
    """
    spec = MaskSpec.of(spec, **settings)
    if not isinstance(sequences, torch.Tensor) or sequences.dim() != 2:
        shape = tuple(sequences.shape) if isinstance(sequences, torch.Tensor) else type(sequences).__name__
        raise ValueError(f"sequences must be a [N, P + L] tensor of token ids, got {shape}.")
    if isinstance(prompt_length, bool) or not isinstance(prompt_length, int) or not (
        0 <= prompt_length < sequences.shape[1]
    ):
        raise ValueError(f"prompt_length={prompt_length!r} must be an int in [0, {sequences.shape[1]}) "
                         f"so that the completion (the last positions of sequences) is not empty.")
    if attention_mask is not None and attention_mask.shape != sequences.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; it must match sequences, "
                         f"{tuple(sequences.shape)}.")
    counted = counted_positions(sequences[:, prompt_length:], eos_token_id=eos_token_id, count=spec.count)
    prompt_real = (
        torch.ones(sequences.shape[0], prompt_length, dtype=torch.bool, device=sequences.device)
        if attention_mask is None else attention_mask[:, :prompt_length].bool()
    )
    if unmask_step is not None and tuple(unmask_step.shape) != tuple(counted.shape):
        raise ValueError(f"unmask_step has shape {tuple(unmask_step.shape)}; it must be [N, L] = "
                         f"{list(counted.shape)}, one step per completion position.")
    masks = draw_masks(spec, counted, generator=generator, prompt_real=prompt_real, unmask_step=unmask_step)
    masks = dataclasses.replace(masks, fingerprint=sequence_fingerprint(sequences))
    masks._remember(sequences)  # drawn for them: later checks against the same tensor cost nothing
    return masks


def draw_masks(spec: MaskSpec | str, counted: torch.Tensor, n_t: int | None = None, *, generator: torch.Generator,
               prompt_real: torch.Tensor, unmask_step: torch.Tensor | None = None, **settings: Any) -> MonteCarloMasks:
    """The samplers on explicit inputs: counted [N, L] bool and prompt_real [N, P] bool (maskable prompt tokens).
    spec: a MaskSpec, or a sampler's name with n_t and the other settings as keywords (as `sample_masks`);
    spec.count is not read (counted is given)."""
    if isinstance(spec, MaskSpec):
        spec = MaskSpec.of(spec, **settings, **({} if n_t is None else {"n_t": n_t}))
    else:
        spec = MaskSpec.of(sampler=spec, n_t=n_t, **settings)
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}; masks are drawn "
                        "only from an explicit generator, e.g. torch.Generator().manual_seed(seed).")
    if not counted.any(-1).all():
        raise ValueError("every sequence needs at least one counted completion position.")
    sampler = SAMPLERS[spec.sampler]
    if sampler.random:
        check_pairs(counted.shape[0], spec.n_t)
    drawn = sampler.draw(Uniform(generator, counted.device), Canvas(counted, prompt_real, unmask_step), spec)
    N, n_t, L = drawn.chosen.shape
    prompt_masked = drawn.prompt_masked
    if prompt_masked is None:
        prompt_masked = torch.zeros(N, n_t, prompt_real.shape[1], dtype=torch.bool, device=counted.device)
    completion_masked = drawn.completion_masked
    if completion_masked is None:
        completion_masked = drawn.chosen | ~counted[:, None, :]  # positions that do not count stay masked
    return MonteCarloMasks(
        masked=torch.cat((prompt_masked, completion_masked), dim=-1),
        counted=counted.clone(),
        weight=drawn.weight.double(),
        t=drawn.t.double(),
        num_masked=drawn.chosen.sum(-1),
        prompt_length=prompt_real.shape[1],
        sampler=spec.sampler,
        target=drawn.target,
    )


def weighted_sum(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum_i w values_i over the last dim, [..., L] -> [...]: `weight` per sample ([...]) or per position
    ([..., L], the "block_elbo" sampler's)."""
    if weight.dim() == values.dim():
        return (values * weight).sum(-1)
    return values.sum(-1) * weight
