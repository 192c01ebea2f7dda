"""Monte Carlo mask samplers and the stored mask object they return.

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

Write L_n for the number of counted positions of sequence n. The samplers and their weights w (the ELBO is
``mean_j w_j * sum_{i masked and counted} log p(x_i | noisy_j)``, see estimators.py):

- ``random_t`` (BGPO Eq. 4-5, ESPO Eq. 2): t ~ U(0, 1], each counted position masked independently with
  probability t, w = 1/t. Unbiased for the ELBO. Its variance is infinite (log-divergent near t = 0; the
  self-normalised sample mean still obeys the central limit theorem); prefer ``stratified_l``.
- ``stratified_l`` (LLaDA, ESPO Eq. 3): l ~ U{1..L_n} masked counted positions chosen uniformly, w = L_n / l.
  Stratified across the n_t samples of each sequence: k ~ U{0..L_n-1}, l_j = (k + floor(j L_n / n_t)) mod L_n
  + 1, so each l_j is uniform on its own and the n_t draws spread over 1..L_n. Stratification is per sequence,
  never across a micro-batch, so chunking cannot change the masks. Unbiased for the ELBO.
- ``complementary`` (ESPO Eq. 32-34, after DiffuCoder): n_t is even; samples 2m and 2m+1 are a pair. The first
  masks l ~ U{0..L_n} counted positions (stratified across the pairs of a sequence as above, over L_n + 1
  values); the second masks exactly the other counted positions. w = (L_n + 1) / |M| (0 for an empty mask).
  Each half is unbiased, so each pair is an antithetic unbiased estimate in which every counted token is
  scored once.
- ``block`` (SPG's block-wise masking): the completion is cut into blocks of `block_length`; sample j picks a
  block b_j among those holding counted positions (stratified per sequence like ``stratified_l``), masks
  l ~ U{1..v} of its v counted positions, masks every later block entirely, and masks each counted position of
  the earlier blocks and each real prompt token independently with probability `perturb_prob` (0.15).
  w = L_n / m_j with m_j the masked counted completion positions, perturbed ones included: SPG's code averages
  over exactly those, with t_j = m_j / L_n. Not an unbiased estimate of the uniform-masking ELBO.
- ``mean_field`` (d1): the whole completion masked, each real prompt token masked with probability
  `perturb_prob` (0.15). w = 1; with n_t = 1 the ELBO is d1's one-step sum of log-probs.

Prompt tokens are never scored; only ``block`` and ``mean_field`` mask them. Left padding (attention_mask == 0)
is never masked.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch

from dllm_fast.contracts import completion_mask

SAMPLERS = ("random_t", "stratified_l", "complementary", "block", "mean_field")
COUNT_MODES = ("eos", "all")


@dataclass(frozen=True, eq=False)  # tensors: compare fields explicitly, never with ==
class MonteCarloMasks:
    """n_t stored masks for each of N sequences of length P + L (P = prompt_length).

    Attributes:
        masked: [N, n_t, P + L] bool, True where sample j of sequence n replaces the token by the mask token.
        counted: [N, L] bool, completion positions that count (scored when masked).
        weight: [N, n_t] float64, the sample's ELBO weight w_j (1/t, L_n/l, (L_n+1)/|M|, L_n/m or 1).
        t: [N, n_t] float64, the noise level the weight came from (t, l/L_n, |M|/(L_n+1), m/L_n or 1).
        num_masked: [N, n_t] int64, masked counted completion positions of each sample.
        prompt_length: P.
        sampler: the name of the sampler that drew them.
        fingerprint: [N, 2] int64 hash of the sequences they were drawn for (`sequence_fingerprint`), or None
            (masks drawn from explicit inputs by `draw_masks`). Scoring checks it, so masks drawn for other
            sequences of the same shape are rejected instead of scoring the wrong positions.
    """

    masked: torch.Tensor
    counted: torch.Tensor
    weight: torch.Tensor
    t: torch.Tensor
    num_masked: torch.Tensor
    prompt_length: int
    sampler: str
    fingerprint: torch.Tensor | None = None

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
            if value.shape != (N, n_t):
                raise ValueError(f"MonteCarloMasks.{name} must be [N, n_t] = [{N}, {n_t}], "
                                 f"got shape {tuple(value.shape)}.")
        if self.fingerprint is not None and tuple(self.fingerprint.shape) != (N, 2):
            raise ValueError(f"MonteCarloMasks.fingerprint must be [N, 2] = [{N}, 2], got shape "
                             f"{tuple(self.fingerprint.shape)}.")

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
    def num_counted(self) -> torch.Tensor:
        """[N] int64: L_n, the counted completion positions of each sequence (per-token normalisers)."""
        return self.counted.sum(-1)

    def to(self, device: torch.device | str) -> "MonteCarloMasks":
        return MonteCarloMasks(
            masked=self.masked.to(device), counted=self.counted.to(device), weight=self.weight.to(device),
            t=self.t.to(device), num_masked=self.num_masked.to(device), prompt_length=self.prompt_length,
            sampler=self.sampler, fingerprint=None if self.fingerprint is None else self.fingerprint.to(device),
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
            raise ValueError(f"{name}[{n}, {j}, {i}] = {float(lp[n, j, i])} but these masks score nothing there: "
                             f"{name} was scored on other masks. Score every policy on the same MonteCarloMasks.")
        bad = ~torch.isfinite(lp) | (lp > 0)
        if bad.any():
            n, j, i = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"{name}[{n}, {j}, {i}] = {float(lp[n, j, i])} is not a log-probability (finite, "
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
    *,
    prompt_length: int,
    n_t: int,
    sampler: str,
    generator: torch.Generator,
    eos_token_id: int | None = None,
    count: str = "eos",
    attention_mask: torch.Tensor | None = None,
    block_length: int = 32,
    perturb_prob: float = 0.15,
) -> MonteCarloMasks:
    """Draw n_t masks per sequence with one of `SAMPLERS` (see the module docstring for each).

    Args:
        sequences: [N, P + L] token ids; the completion is the last L = P + L - prompt_length positions.
        prompt_length: P, the common (left-padded) prompt length.
        n_t: Monte Carlo samples per sequence (even for "complementary").
        sampler: "random_t", "stratified_l", "complementary", "block" or "mean_field".
        generator: the only source of randomness. Draws happen on its device, then move to sequences' device.
        eos_token_id, count: which completion positions count (see `counted_positions`).
        attention_mask: optional [N, P + L]; prompt padding (0) is never masked.
        block_length, perturb_prob: SPG's block size and the prompt/earlier-block perturbation probability
            ("block"); the prompt perturbation probability ("mean_field"). Ignored by the other samplers.

    Returns:
        MonteCarloMasks on sequences' device.
    """
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
    counted = counted_positions(sequences[:, prompt_length:], eos_token_id=eos_token_id, count=count)
    prompt_real = (
        torch.ones(sequences.shape[0], prompt_length, dtype=torch.bool, device=sequences.device)
        if attention_mask is None else attention_mask[:, :prompt_length].bool()
    )
    masks = draw_masks(sampler, counted, n_t, generator=generator, prompt_real=prompt_real,
                       block_length=block_length, perturb_prob=perturb_prob)
    masks = dataclasses.replace(masks, fingerprint=sequence_fingerprint(sequences))
    masks._remember(sequences)  # drawn for them: later checks against the same tensor cost nothing
    return masks


def draw_masks(
    sampler: str,
    counted: torch.Tensor,
    n_t: int,
    *,
    generator: torch.Generator,
    prompt_real: torch.Tensor,
    block_length: int = 32,
    perturb_prob: float = 0.15,
) -> MonteCarloMasks:
    """The samplers on explicit inputs: counted [N, L] bool and prompt_real [N, P] bool (maskable prompt tokens)."""
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler={sampler!r} is not one of {SAMPLERS}.")
    if isinstance(n_t, bool) or not isinstance(n_t, int) or n_t < 1:
        raise ValueError(f"n_t={n_t!r} must be an int >= 1 (Monte Carlo samples per sequence).")
    if sampler == "complementary" and n_t % 2:
        raise ValueError(f"n_t={n_t} must be even for sampler='complementary' (samples come in pairs).")
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}; masks are drawn "
                        "only from an explicit generator, e.g. torch.Generator().manual_seed(seed).")
    if isinstance(block_length, bool) or not isinstance(block_length, int) or block_length < 1:
        raise ValueError(f"block_length={block_length!r} must be a positive int.")
    if not 0.0 <= perturb_prob <= 1.0:
        raise ValueError(f"perturb_prob={perturb_prob!r} must be a probability in [0, 1].")
    if not counted.any(-1).all():
        raise ValueError("every sequence needs at least one counted completion position.")
    device = counted.device
    draw = _Draw(generator, device)
    N, L = counted.shape
    lengths = counted.sum(-1)  # L_n
    counted3 = counted[:, None, :].expand(N, n_t, L)

    prompt_masked = torch.zeros(N, n_t, prompt_real.shape[1], dtype=torch.bool, device=device)
    if sampler == "random_t":
        t = 1.0 - draw.uniform(N, n_t)  # (0, 1]: the weight 1/t stays finite
        chosen = (draw.uniform(N, n_t, L) < t[..., None]) & counted3
        weight = 1.0 / t
    elif sampler == "stratified_l":
        size = _stratified(draw, lengths, n_t) + 1  # l in 1..L_n
        chosen = _random_subset(draw, counted3, size)
        weight = lengths[:, None].double() / size
        t = size / lengths[:, None].double()
    elif sampler == "complementary":
        size = _stratified(draw, lengths + 1, n_t // 2)  # l in 0..L_n
        first = _random_subset(draw, counted[:, None, :].expand(N, n_t // 2, L), size)
        second = counted[:, None, :] & ~first
        chosen = torch.stack((first, second), dim=2).reshape(N, n_t, L)
        sizes = chosen.sum(-1).double()
        weight = torch.where(sizes > 0, (lengths[:, None] + 1) / sizes.clamp_min(1), 0.0)
        t = sizes / (lengths[:, None] + 1)
    elif sampler == "block":
        chosen = _block_masks(draw, counted, n_t, block_length, perturb_prob)
        prompt_masked = (draw.uniform(N, n_t, prompt_real.shape[1]) < perturb_prob) & prompt_real[:, None]
        m = chosen.sum(-1).double()
        weight = lengths[:, None] / m
        t = m / lengths[:, None]
    else:  # mean_field
        chosen = counted3.clone()
        prompt_masked = (draw.uniform(N, n_t, prompt_real.shape[1]) < perturb_prob) & prompt_real[:, None]
        weight = torch.ones(N, n_t, dtype=torch.float64, device=device)
        t = torch.ones_like(weight)

    completion_masked = chosen | ~counted3  # positions that do not count stay masked
    return MonteCarloMasks(
        masked=torch.cat((prompt_masked, completion_masked), dim=-1),
        counted=counted.clone(),
        weight=weight.double(),
        t=t.double(),
        num_masked=chosen.sum(-1),
        prompt_length=prompt_real.shape[1],
        sampler=sampler,
    )


class _Draw:
    """Uniform draws from one generator on its own device, moved to the masks' device."""

    def __init__(self, generator: torch.Generator, device: torch.device):
        self.generator, self.device = generator, device

    def uniform(self, *shape: int) -> torch.Tensor:
        values = torch.rand(*shape, generator=self.generator, device=self.generator.device, dtype=torch.float64)
        return values.to(self.device)


def _stratified(draw: _Draw, counts: torch.Tensor, n: int) -> torch.Tensor:
    """[N] counts c -> [N, n] values in 0..c-1, each uniform, spread evenly: (k + floor(j c / n)) mod c."""
    k = (draw.uniform(counts.shape[0]) * counts).long().clamp_max(counts - 1)
    offsets = (torch.arange(n, device=counts.device)[None, :] * counts[:, None]) // n
    return (k[:, None] + offsets) % counts[:, None]


def _random_subset(draw: _Draw, eligible: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    """A uniformly random subset of `size[...]` eligible positions: eligible [..., L] bool -> [..., L] bool."""
    keys = draw.uniform(*eligible.shape).masked_fill(~eligible, 2.0)  # ineligible positions rank last
    ranks = keys.argsort(dim=-1).argsort(dim=-1)
    return ranks < size[..., None]


def _block_masks(draw: _Draw, counted: torch.Tensor, n_t: int, block_length: int, perturb_prob: float):
    """SPG's block masking of the counted completion positions: [N, L] -> chosen [N, n_t, L] bool."""
    N, L = counted.shape
    device = counted.device
    block_of = torch.arange(L, device=device) // block_length  # [L]
    num_blocks = int(block_of[-1]) + 1
    padded = torch.nn.functional.pad(counted, (0, num_blocks * block_length - L))
    has_counted = padded.view(N, num_blocks, block_length).any(-1)
    ordinal = _stratified(draw, has_counted.sum(-1), n_t)  # among the blocks holding counted positions
    rank = has_counted.long().cumsum(-1) - 1  # ordinal of each counted block
    hit = (rank[:, None, :] == ordinal[..., None]) & has_counted[:, None, :]
    chosen_block = hit.long().argmax(-1)  # [N, n_t]

    position_block = block_of[None, None, :]
    in_block = (position_block == chosen_block[..., None]) & counted[:, None, :]
    valid = in_block.sum(-1)  # v >= 1
    size = (draw.uniform(N, n_t) * valid).long().clamp_max(valid - 1) + 1  # l in 1..v
    within = _random_subset(draw, in_block, size)
    later = position_block > chosen_block[..., None]
    earlier = (position_block < chosen_block[..., None]) & (draw.uniform(N, n_t, L) < perturb_prob)
    return (within | later | earlier) & counted[:, None, :]
