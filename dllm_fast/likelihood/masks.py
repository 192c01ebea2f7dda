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
- ``gauss`` (GDPO's semi-deterministic Monte Carlo, SDMC): the time integral of the ELBO,
  int_0^1 (1/t) E[sum_{i masked} log p] dt, on the K = `quadrature_points` Gauss-Legendre nodes t_k of [0, 1]
  with their weights c_k (sum 1); only the mask at each node is random: n_t / K draws per node, each masking
  exactly clamp(floor(t_k L_n), 1, L_n) counted positions chosen uniformly (GDPO's exact-k draw, as NVIDIA NeMo
  RL's SdmcElboEstimator). w = K c_k / t_k with the nominal t_k, so the ELBO is sum_k (c_k / t_k) times the mean
  over the node's draws. Deterministic in t, so its variance is the masks' alone.
- ``coupled`` (DiffuCoder's coupled sampling, Eq. 12-13): n_t = 1 + 2 lambda is odd. Sample 0 masks the whole
  completion; samples (2m + 1, 2m + 2) are a complementary pair: t ~ U[t_low, t_high] (0.2, 0.8) per sequence and
  pair, each counted position masked with probability t in the first, the other counted positions in the second.
  Every counted token is scored once in the full mask and once in each pair, and DiffuCoder's per-token estimate
  averages them: (lp_full + lp_first / t + lp_second / (1 - t)) / 2 for lambda = 1. The weights carry that
  average: w = n_t / (lambda + 1) times 1, 1/t or 1/(1 - t), so that `elbo` is the sum of the per-token estimates
  and the per-token estimate is sum_j w_j lp_j / n_t (`estimators.token_estimate`).
- ``block_elbo`` (the block-diffusion ELBO of BD3-LM and SDAR, for block models): the completion is cut into the
  model's blocks (`block_length` positions, aligned to each row's first real token as the model aligns them;
  the first may hold the prompt's tail); each block gets its own noise level in each sample: l ~ U{1..v} of its v
  counted positions masked, stratified across the n_t samples per (sequence, block) as ``stratified_l`` does
  per sequence, independently across blocks. The weight is per position, w = v / l of the position's block
  (`weight` is [N, n_t, L]); t is the sample's masked fraction of counted positions. A block model scores
  each block given the clean blocks before it, so the sum over blocks of the per-block l-form is unbiased for
  the block ELBO, sum_b E_t[(1/t) sum_{i in b masked} log p(x_i | x_<b, x_b masked at t)], and a block's
  estimate no longer shares its noise level with the others. (random_t, stratified_l and complementary are
  unbiased for it too, with one noise level per sample.)
- ``trajectory`` (TraceRL): replays the rollout's own decoding states from `unmask_step` [N, L] (the 0-based
  denoising forward at which generate unmasked each completion position). A row's distinct steps, in order,
  are merged `shrink` at a time (TraceRL's trajectory shrinkage s); state g masks every completion position
  unmasked at or after its first step and reads (`target`) the counted positions unmasked during it; the later
  ones are masked as context (scoring also returns their lp, which the estimators ignore). Unlike the other
  samplers it reveals the non-counted positions the rollout had already decoded (EOS padding), since the state
  is the rollout's own. n_t is the most states any row has (rows with fewer get empty samples); w = n_t, so
  `elbo` is the sum over states of the state's log-likelihood. Deterministic: the generator is not used.

Prompt tokens are never scored; only ``block`` and ``mean_field`` mask them. Left padding (attention_mask == 0)
is never masked.
"""

from __future__ import annotations

import math

import dataclasses
import weakref
from dataclasses import dataclass

import torch

from dllm_fast.contracts import MAX_PAIRS, completion_mask

SAMPLERS = ("random_t", "stratified_l", "complementary", "block", "mean_field", "gauss", "coupled", "block_elbo",
            "trajectory")
# Samplers that draw from the generator (trajectory replays the rollout instead).
RANDOM_SAMPLERS = SAMPLERS[:-1]
COUNT_MODES = ("eos", "all")


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
    quadrature_points: int | None = None,
    t_range: tuple[float, float] = (0.2, 0.8),
    unmask_step: torch.Tensor | None = None,
    shrink: int = 1,
) -> MonteCarloMasks:
    """Draw n_t masks per sequence with one of `SAMPLERS` (see the module docstring for each).

    Args:
        sequences: [N, P + L] token ids; the completion is the last L = P + L - prompt_length positions.
        prompt_length: P, the common (left-padded) prompt length.
        n_t: Monte Carlo samples per sequence (even for "complementary", odd for "coupled", a multiple of
            quadrature_points for "gauss"); None for "trajectory", whose sample count is its number of states.
        sampler: one of `SAMPLERS`.
        generator: the only source of randomness. Draws happen on its device, then move to sequences' device.
        eos_token_id, count: which completion positions count (see `counted_positions`).
        attention_mask: optional [N, P + L]; prompt padding (0) is never masked.
        block_length, perturb_prob: SPG's block size and the prompt/earlier-block perturbation probability
            ("block"); the prompt perturbation probability ("mean_field"). "block_elbo" takes the model's block
            size as block_length (model.block_length). Ignored by the other samplers.
        quadrature_points: "gauss": Gauss-Legendre nodes K (default n_t: one draw per node).
        t_range: "coupled": the interval the pairs' t is drawn from (DiffuCoder's code: 0.2 to 0.8).
        unmask_step, shrink: "trajectory": [N, L] int64 step at which the rollout unmasked each completion
            position (`RolloutBatch.unmask_step`), and the decoding steps merged per state.

    Returns:
        MonteCarloMasks on sequences' device.

    Bound: N * n_t (for "trajectory", N times the most states of a row) within contracts.MAX_PAIRS (2^20, the
    trainer's bound per update), refused naming the sizes and the fix.
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
    if unmask_step is not None and tuple(unmask_step.shape) != tuple(counted.shape):
        raise ValueError(f"unmask_step has shape {tuple(unmask_step.shape)}; it must be [N, L] = "
                         f"{list(counted.shape)}, one step per completion position.")
    masks = draw_masks(sampler, counted, n_t, generator=generator, prompt_real=prompt_real,
                       block_length=block_length, perturb_prob=perturb_prob, quadrature_points=quadrature_points,
                       t_range=t_range, unmask_step=unmask_step, shrink=shrink)
    masks = dataclasses.replace(masks, fingerprint=sequence_fingerprint(sequences))
    masks._remember(sequences)  # drawn for them: later checks against the same tensor cost nothing
    return masks


def check_pairs(sequences: int, n_t: int) -> None:
    """N * n_t (sequence, sample) pairs within MAX_PAIRS, the trainer's bound per update."""
    if sequences * n_t > MAX_PAIRS:
        raise ValueError(f"{sequences} sequences x n_t={n_t} = {sequences * n_t} (sequence, sample) pairs, more than "
                         f"{MAX_PAIRS} (2^20, the trainer's bound per update); lower n_t or draw masks for fewer "
                         "sequences at a time.")


def draw_masks(
    sampler: str,
    counted: torch.Tensor,
    n_t: int | None,
    *,
    generator: torch.Generator,
    prompt_real: torch.Tensor,
    block_length: int = 32,
    perturb_prob: float = 0.15,
    quadrature_points: int | None = None,
    t_range: tuple[float, float] = (0.2, 0.8),
    unmask_step: torch.Tensor | None = None,
    shrink: int = 1,
) -> MonteCarloMasks:
    """The samplers on explicit inputs: counted [N, L] bool and prompt_real [N, P] bool (maskable prompt tokens);
    the other arguments as in `sample_masks`."""
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler={sampler!r} is not one of {SAMPLERS}.")
    if sampler == "trajectory":
        if n_t is not None:
            raise ValueError(f"n_t={n_t!r} does not apply to sampler='trajectory': its samples are the rollout's "
                             "decoding states (set shrink); pass n_t=None.")
    elif isinstance(n_t, bool) or not isinstance(n_t, int) or n_t < 1:
        raise ValueError(f"n_t={n_t!r} must be an int >= 1 (Monte Carlo samples per sequence).")
    else:
        check_pairs(counted.shape[0], n_t)
    if sampler == "complementary" and n_t % 2:
        raise ValueError(f"n_t={n_t} must be even for sampler='complementary' (samples come in pairs).")
    if sampler == "coupled" and n_t % 2 == 0:
        raise ValueError(f"n_t={n_t} must be odd for sampler='coupled': the full mask plus complementary pairs "
                         "(1 + 2 lambda; DiffuCoder uses 3).")
    if sampler == "gauss":
        points = n_t if quadrature_points is None else quadrature_points
        if isinstance(points, bool) or not isinstance(points, int) or points < 1 or n_t % points:
            raise ValueError(f"quadrature_points={quadrature_points!r} must be an int >= 1 that divides n_t={n_t} "
                             "(n_t / quadrature_points mask draws per Gauss node).")
    if sampler == "coupled":
        low, high = t_range
        if not 0.0 < low <= high < 1.0:
            raise ValueError(f"t_range={t_range!r} must satisfy 0 < low <= high < 1 (the pairs' masking rates; "
                             "DiffuCoder uses (0.2, 0.8)).")
    if sampler == "trajectory":
        if unmask_step is None:
            raise ValueError("sampler='trajectory' replays the rollout's decoding order: pass unmask_step (a "
                             "RolloutBatch from generate(..., record_unmask_step=True)).")
        if unmask_step.dtype != torch.int64 or tuple(unmask_step.shape) != tuple(counted.shape):
            raise ValueError(f"unmask_step must be int64 [N, L] = {list(counted.shape)}, got {unmask_step.dtype} "
                             f"of shape {tuple(unmask_step.shape)}.")
        if isinstance(shrink, bool) or not isinstance(shrink, int) or shrink < 1:
            raise ValueError(f"shrink={shrink!r} must be an int >= 1 (decoding steps merged per state; TraceRL "
                             "uses 8 for LLaDA, 1 for block models).")
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
    if sampler == "trajectory":
        return _trajectory_masks(counted, unmask_step.to(device), shrink, prompt_real)
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
    elif sampler == "mean_field":
        chosen = counted3.clone()
        prompt_masked = (draw.uniform(N, n_t, prompt_real.shape[1]) < perturb_prob) & prompt_real[:, None]
        weight = torch.ones(N, n_t, dtype=torch.float64, device=device)
        t = torch.ones_like(weight)
    elif sampler == "gauss":
        chosen, weight, t = _gauss_masks(draw, counted3, lengths, n_t, quadrature_points or n_t)
    elif sampler == "block_elbo":
        chosen, weight = _block_elbo_masks(draw, counted, prompt_real, n_t, block_length)
        t = chosen.sum(-1).double() / lengths[:, None]
    else:  # coupled
        chosen, weight, t = _coupled_masks(draw, counted, n_t, t_range)

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


def _block_elbo_masks(draw: _Draw, counted: torch.Tensor, prompt_real: torch.Tensor, n_t: int, block_length: int):
    """The block ELBO's masks: chosen [N, n_t, L] bool and the per-position weights [N, n_t, L] (v / l of the
    position's block; 0 off the counted positions). Blocks align to each row's first real token."""
    N, L = counted.shape
    P, device = prompt_real.shape[1], counted.device
    first = torch.where(prompt_real.any(1), prompt_real.to(torch.int8).argmax(1), P)  # [N]
    absolute = torch.div(P + torch.arange(L, device=device)[None, :] - first[:, None], block_length,
                         rounding_mode="floor")
    block = absolute - absolute[:, :1]  # [N, L]: 0 for the completion's first block
    blocks = int(block.max()) + 1
    sizes = torch.zeros(N, blocks, dtype=torch.long, device=device).index_put_(
        (torch.arange(N, device=device)[:, None].expand(N, L), block), counted.long(), accumulate=True)  # v
    size = _stratified(draw, sizes.clamp_min(1).reshape(-1), n_t).view(N, blocks, n_t).transpose(1, 2) + 1  # l
    # A uniformly random l-subset of each block's counted positions: rank the positions by (block, key), counted
    # ones first within a block, and keep the first l of each block.
    keys = torch.where(counted[:, None, :], draw.uniform(N, n_t, L), 2.0) + 4.0 * block[:, None, :]
    rank = keys.argsort(-1).argsort(-1)
    block_start = torch.full((N, blocks), L, dtype=torch.long, device=device).scatter_reduce(
        1, block, torch.arange(L, device=device).expand(N, L), reduce="amin")
    within = rank - block_start.gather(1, block)[:, None, :]
    index = block[:, None, :].expand(N, n_t, L)
    chosen = (within < size.gather(2, index)) & counted[:, None, :]
    weight = sizes.gather(1, block)[:, None, :].double() / size.gather(2, index).double()
    return chosen, torch.where(counted[:, None, :], weight, 0.0)


def weighted_sum(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum_i w values_i over the last dim, [..., L] -> [...]: `weight` per sample ([...]) or per position
    ([..., L], the "block_elbo" sampler's)."""
    if weight.dim() == values.dim():
        return (values * weight).sum(-1)
    return values.sum(-1) * weight


def gauss_legendre(points: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K-point Gauss-Legendre rule on [0, 1]: nodes t_k and weights c_k (sum 1), float64, by Golub-Welsch
    (the eigenvalues of the Legendre recurrence's Jacobi matrix; weights from the first eigenvector components)."""
    k = torch.arange(1, points, dtype=torch.float64)
    off_diagonal = k / torch.sqrt(4 * k**2 - 1)
    jacobi = torch.diag(off_diagonal, 1) + torch.diag(off_diagonal, -1)
    nodes, vectors = torch.linalg.eigh(jacobi)
    return (nodes + 1) / 2, vectors[0] ** 2  # [-1, 1] -> [0, 1]; weights 2 v_0^2 on [-1, 1] halve


def _gauss_masks(draw: _Draw, counted3: torch.Tensor, lengths: torch.Tensor, n_t: int, points: int):
    """GDPO's SDMC masks: n_t / points exact-size draws at each Gauss node (node-major order)."""
    N = counted3.shape[0]
    nodes, node_weights = (v.to(counted3.device) for v in gauss_legendre(points))
    t = nodes.repeat_interleave(n_t // points)[None, :].expand(N, n_t)
    size = torch.minimum((t * lengths[:, None]).floor().long().clamp_min(1), lengths[:, None])
    chosen = _random_subset(draw, counted3, size)
    weight = (points * node_weights / nodes).repeat_interleave(n_t // points)[None, :].expand(N, n_t)
    return chosen, weight.clone(), t.clone()


def _coupled_masks(draw: _Draw, counted: torch.Tensor, n_t: int, t_range: tuple[float, float]):
    """DiffuCoder's masks: the full completion, then complementary Bernoulli(t) pairs, t ~ U[t_range]."""
    N, L = counted.shape
    pairs = (n_t - 1) // 2
    low, high = t_range
    rate = low + (high - low) * draw.uniform(N, pairs)  # [N, pairs]
    first = (draw.uniform(N, pairs, L) < rate[..., None]) & counted[:, None, :]
    second = counted[:, None, :] & ~first
    chosen = torch.cat((counted[:, None, :], torch.stack((first, second), dim=2).reshape(N, 2 * pairs, L)), dim=1)
    t = torch.cat((torch.ones(N, 1, dtype=torch.float64, device=counted.device),
                   torch.stack((rate, 1 - rate), dim=2).reshape(N, 2 * pairs)), dim=1)
    weight = n_t / (pairs + 1) / t  # every counted token is scored once per group (full mask, each pair)
    return chosen, weight, t


def _trajectory_masks(counted: torch.Tensor, unmask_step: torch.Tensor, shrink: int,
                      prompt_real: torch.Tensor) -> MonteCarloMasks:
    """TraceRL's states: per row, its distinct decoding steps merged `shrink` at a time; state g masks the
    positions unmasked at or after its first step and scores the counted ones unmasked during it."""
    N, L = counted.shape
    if (unmask_step < 0).any():
        n, i = (int(v) for v in (unmask_step < 0).nonzero()[0])
        raise ValueError(f"unmask_step[{n}, {i}] = {int(unmask_step[n, i])} is negative; steps count the "
                         "denoising forwards from 0.")
    # Rank of each position's step among its row's distinct steps: the state it belongs to is rank // shrink.
    order = unmask_step.sort(dim=-1).values
    distinct = torch.ones_like(order, dtype=torch.bool)
    distinct[:, 1:] = order[:, 1:] != order[:, :-1]
    ranks_sorted = distinct.long().cumsum(-1) - 1  # dense rank of each sorted step
    rank = torch.zeros_like(unmask_step)
    rank.scatter_(1, unmask_step.argsort(dim=-1, stable=True), ranks_sorted)
    state = rank // shrink  # [N, L]
    n_t = int(state.max()) + 1
    check_pairs(N, n_t)
    states = torch.arange(n_t, device=counted.device)[None, :, None]
    chosen = (state[:, None, :] == states) & counted[:, None, :]  # scored in state g
    completion_masked = state[:, None, :] >= states  # not yet decoded when state g starts
    num_masked = chosen.sum(-1)
    weight = torch.full((N, n_t), float(n_t), dtype=torch.float64, device=counted.device)
    t = (completion_masked & counted[:, None, :]).sum(-1).double() / counted.sum(-1, keepdim=True)
    prompt_masked = torch.zeros(N, n_t, prompt_real.shape[1], dtype=torch.bool, device=counted.device)
    return MonteCarloMasks(masked=torch.cat((prompt_masked, completion_masked), dim=-1), counted=counted.clone(),
                           weight=weight, t=t, num_masked=num_masked, prompt_length=prompt_real.shape[1],
                           sampler="trajectory", target=chosen)
