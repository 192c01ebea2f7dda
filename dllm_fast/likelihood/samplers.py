"""The mask samplers: a registry of named samplers, each how it draws and which n_t it accepts.

A sampler is registered once (`register_sampler`) with its draw function and its n_t rule (`NTRule`): the only
place a sampler's parity rule is written. `MaskSpec.validate` and `MaskSpec.valid_n_t` (mask_spec.py) read it, so
an objective's config, `sample_masks` and the planner's n_t search agree by construction. The draw functions take
uniform draws (`Uniform`, one explicit generator), the `Canvas` (which positions count and which prompt tokens may
be masked) and the `MaskSpec`, and return a `Drawn`; `masks.draw_masks` turns it into a `MonteCarloMasks`.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from dllm_fast.contracts import MAX_PAIRS

COUNT_MODES = ("eos", "all")


@dataclass(frozen=True)
class NTRule:
    """The n_t a sampler accepts: n_t >= 1 with n_t % step == remainder, and at most `largest` (None: no bound).
    message: the error for any other n_t, with "{n_t}" where the value goes."""

    step: int = 1
    remainder: int = 0
    largest: int | None = None
    message: str = ""

    def accepts(self, n_t: int) -> bool:
        return n_t >= 1 and n_t % self.step == self.remainder % self.step and (
            self.largest is None or n_t <= self.largest)

    def nearest(self, n_t: int, *, down: bool = False, limit: int = 1 << 16) -> int | None:
        """The accepted n_t nearest max(1, n_t): at or above it and at most `limit`, or (down) at or below it;
        None when there is none."""
        start = max(1, n_t)
        if down:
            top = start if self.largest is None else min(start, self.largest)
            found = top - (top - self.remainder) % self.step
            return found if found >= 1 else None
        found = start + (self.remainder - start) % self.step
        return found if found <= (limit if self.largest is None else min(limit, self.largest)) else None


ANY_N_T = NTRule()


def any_n_t(spec) -> NTRule:
    """The rule of a sampler that takes any n_t >= 1."""
    return ANY_N_T


class Drawn(NamedTuple):
    """What a draw function returns. chosen: [N, n_t, L] bool, the counted completion positions each sample
    masks and its estimate reads; weight [N, n_t] (or [N, n_t, L]) and t [N, n_t]: see MonteCarloMasks.
    prompt_masked: [N, n_t, P] bool (None: no prompt token masked). completion_masked: [N, n_t, L] bool, every
    masked completion position (None: chosen plus the positions that do not count). target: the positions read
    when they are not all the scored ones ("trajectory")."""

    chosen: torch.Tensor
    weight: torch.Tensor
    t: torch.Tensor
    prompt_masked: torch.Tensor | None = None
    completion_masked: torch.Tensor | None = None
    target: torch.Tensor | None = None


@dataclass(frozen=True)
class Canvas:
    """What a draw reads besides the settings. counted: [N, L] bool, the completion positions that count (each row
    at least one); prompt_real: [N, P] bool, the prompt tokens that may be masked (not padding); unmask_step:
    [N, L] int64 or None, the rollout's decoding step of each completion position ("trajectory")."""

    counted: torch.Tensor
    prompt_real: torch.Tensor
    unmask_step: torch.Tensor | None = None

    @property
    def lengths(self) -> torch.Tensor:
        """[N] L_n, the counted positions of each row."""
        return self.counted.sum(-1)

    def expanded(self, n_t: int) -> torch.Tensor:
        """counted as [N, n_t, L]."""
        N, L = self.counted.shape
        return self.counted[:, None, :].expand(N, n_t, L)


@dataclass(frozen=True)
class Sampler:
    """A registered sampler. draw(uniform, canvas, spec) -> Drawn; n_t_rule(spec) -> the NTRule of its n_t (given
    its other settings); random: whether it draws from the generator (trajectory replays the rollout);
    model_blocks: whether it cuts the completion by the policy's own blocks (a block-diffusion model's
    block_length, which the objective sets as spec.block_length); data_n_t: whether its sample count follows
    from the sequences instead of n_t (trajectory's states, autoregressive's positions; n_t stays 1)."""

    name: str
    draw: Callable[..., Drawn]
    n_t_rule: Callable[..., NTRule] = any_n_t
    random: bool = True
    model_blocks: bool = False
    data_n_t: bool = False


SAMPLERS: dict[str, Sampler] = {}


def register_sampler(name: str, draw: Callable[..., Drawn], *, n_t_rule: Callable[..., NTRule] | None = None,
                     random: bool = True, model_blocks: bool = False, data_n_t: bool = False) -> Sampler:
    """Make a sampler available by `name` to MaskSpec, sample_masks and every objective's `sampler` option.
    draw(uniform: Uniform, canvas: Canvas, spec: MaskSpec) -> Drawn; n_t_rule(spec) -> NTRule (default: any
    n_t >= 1); random, model_blocks, data_n_t: see `Sampler`."""
    if not isinstance(name, str) or not name or not callable(draw):
        raise TypeError(f"register_sampler takes a name (str) and a draw function, got {name!r}, {draw!r}.")
    if name in SAMPLERS:
        raise ValueError(f"a sampler named {name!r} is already registered.")
    SAMPLERS[name] = Sampler(name, draw, n_t_rule or any_n_t, random, model_blocks, data_n_t)
    return SAMPLERS[name]


def check_pairs(sequences: int, n_t: int) -> None:
    """N * n_t (sequence, sample) pairs within MAX_PAIRS, the trainer's bound per update."""
    if sequences * n_t > MAX_PAIRS:
        raise ValueError(f"{sequences} sequences x n_t={n_t} = {sequences * n_t} (sequence, sample) pairs, more than "
                         f"{MAX_PAIRS} (2^20, the trainer's bound per update); lower n_t or draw masks for fewer "
                         "sequences at a time.")


# ---------------------------------------------------------------------------------------------------------
# The built-in samplers


def _random_t(uniform: Uniform, canvas: Canvas, spec) -> Drawn:
    N, L = canvas.counted.shape
    t = 1.0 - uniform(N, spec.n_t)  # (0, 1]: the weight 1/t stays finite
    chosen = (uniform(N, spec.n_t, L) < t[..., None]) & canvas.expanded(spec.n_t)
    return Drawn(chosen, 1.0 / t, t)


def _stratified_l(uniform: Uniform, canvas: Canvas, spec) -> Drawn:
    lengths = canvas.lengths
    size = _stratified(uniform, lengths, spec.n_t) + 1  # l in 1..L_n
    chosen = _random_subset(uniform, canvas.expanded(spec.n_t), size)
    return Drawn(chosen, lengths[:, None].double() / size, size / lengths[:, None].double())


def _complementary(uniform: Uniform, canvas: Canvas, spec) -> Drawn:
    counted, lengths, n_t = canvas.counted, canvas.lengths, spec.n_t
    N, L = counted.shape
    size = _stratified(uniform, lengths + 1, n_t // 2)  # l in 0..L_n
    first = _random_subset(uniform, canvas.expanded(n_t // 2), size)
    second = counted[:, None, :] & ~first
    chosen = torch.stack((first, second), dim=2).reshape(N, n_t, L)
    sizes = chosen.sum(-1).double()
    weight = torch.where(sizes > 0, (lengths[:, None] + 1) / sizes.clamp_min(1), 0.0)
    return Drawn(chosen, weight, sizes / (lengths[:, None] + 1))


def _perturbed_prompt(uniform: Uniform, canvas: Canvas, spec) -> torch.Tensor:
    N, P = canvas.prompt_real.shape
    return (uniform(N, spec.n_t, P) < spec.perturb_prob) & canvas.prompt_real[:, None]


def _block(uniform: Uniform, canvas: Canvas, spec) -> Drawn:
    chosen = _block_masks(uniform, canvas.counted, spec.n_t, spec.block_length, spec.perturb_prob)
    prompt_masked = _perturbed_prompt(uniform, canvas, spec)
    m = chosen.sum(-1).double()
    lengths = canvas.lengths[:, None]
    return Drawn(chosen, lengths / m, m / lengths, prompt_masked=prompt_masked)


def _mean_field(uniform: Uniform, canvas: Canvas, spec) -> Drawn:
    chosen = canvas.expanded(spec.n_t).clone()
    prompt_masked = _perturbed_prompt(uniform, canvas, spec)
    weight = torch.ones(chosen.shape[:2], dtype=torch.float64, device=chosen.device)
    return Drawn(chosen, weight, torch.ones_like(weight), prompt_masked=prompt_masked)


def _gauss(uniform: Uniform, canvas: Canvas, spec) -> Drawn:
    return Drawn(*_gauss_masks(uniform, canvas.expanded(spec.n_t), canvas.lengths, spec.n_t,
                               spec.quadrature_points or spec.n_t))


def _block_elbo(uniform: Uniform, canvas: Canvas, spec) -> Drawn:
    chosen, weight = _block_elbo_masks(uniform, canvas.counted, canvas.prompt_real, spec.n_t, spec.block_length)
    return Drawn(chosen, weight, chosen.sum(-1).double() / canvas.lengths[:, None])


def _coupled(uniform: Uniform, canvas: Canvas, spec) -> Drawn:
    return Drawn(*_coupled_masks(uniform, canvas.counted, spec.n_t, (spec.coupled_t_min, spec.coupled_t_max)))


def _trajectory(uniform: Uniform, canvas: Canvas, spec) -> Drawn:
    unmask_step, counted = canvas.unmask_step, canvas.counted
    if unmask_step is None:
        raise ValueError("sampler='trajectory' replays the rollout's decoding order: pass unmask_step (a "
                         "RolloutBatch from generate(..., record_unmask_step=True)).")
    if unmask_step.dtype != torch.int64 or tuple(unmask_step.shape) != tuple(counted.shape):
        raise ValueError(f"unmask_step must be int64 [N, L] = {list(counted.shape)}, got {unmask_step.dtype} "
                         f"of shape {tuple(unmask_step.shape)}.")
    return _trajectory_masks(counted, unmask_step.to(counted.device), spec.shrink)


def _even(spec) -> NTRule:
    return NTRule(step=2, message="n_t={n_t} must be even for sampler='complementary' (samples come in pairs).")


def _odd(spec) -> NTRule:
    return NTRule(step=2, remainder=1, message="n_t={n_t} must be odd for sampler='coupled': the full mask plus "
                                               "complementary pairs (1 + 2 lambda; DiffuCoder uses 3).")


def _nodes(spec) -> NTRule:
    points = spec.quadrature_points
    return NTRule(step=points or 1, message=f"quadrature_points={points!r} must be an int >= 1 that divides "
                                            "n_t={n_t} (n_t / quadrature_points mask draws per Gauss node).")


def _states(spec) -> NTRule:
    return NTRule(largest=1, message="n_t={n_t} does not apply with sampler='trajectory': its samples are the "
                                     "rollout's decoding states (their number follows from shrink); leave n_t at 1.")


for _name, _draw, _rule in (("random_t", _random_t, None), ("stratified_l", _stratified_l, None),
                            ("complementary", _complementary, _even), ("block", _block, None),
                            ("mean_field", _mean_field, None), ("gauss", _gauss, _nodes), ("coupled", _coupled, _odd)):
    register_sampler(_name, _draw, n_t_rule=_rule)
register_sampler("block_elbo", _block_elbo, model_blocks=True)
register_sampler("trajectory", _trajectory, n_t_rule=_states, random=False, data_n_t=True)


# ---------------------------------------------------------------------------------------------------------
# Their pieces


class Uniform:
    """Uniform draws from one generator on its own device, moved to the masks' device."""

    def __init__(self, generator: torch.Generator, device: torch.device):
        self.generator, self.device = generator, device

    def __call__(self, *shape: int) -> torch.Tensor:
        values = torch.rand(*shape, generator=self.generator, device=self.generator.device, dtype=torch.float64)
        return values.to(self.device)


def _stratified(uniform: Uniform, counts: torch.Tensor, n: int) -> torch.Tensor:
    """[N] counts c -> [N, n] values in 0..c-1, each uniform, spread evenly: (k + floor(j c / n)) mod c."""
    k = (uniform(counts.shape[0]) * counts).long().clamp_max(counts - 1)
    offsets = (torch.arange(n, device=counts.device)[None, :] * counts[:, None]) // n
    return (k[:, None] + offsets) % counts[:, None]


def _random_subset(uniform: Uniform, eligible: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    """A uniformly random subset of `size[...]` eligible positions: eligible [..., L] bool -> [..., L] bool."""
    keys = uniform(*eligible.shape).masked_fill(~eligible, 2.0)  # ineligible positions rank last
    ranks = keys.argsort(dim=-1).argsort(dim=-1)
    return ranks < size[..., None]


def _block_masks(uniform: Uniform, counted: torch.Tensor, n_t: int, block_length: int, perturb_prob: float):
    """SPG's block masking of the counted completion positions: [N, L] -> chosen [N, n_t, L] bool."""
    N, L = counted.shape
    device = counted.device
    block_of = torch.arange(L, device=device) // block_length  # [L]
    num_blocks = int(block_of[-1]) + 1
    padded = torch.nn.functional.pad(counted, (0, num_blocks * block_length - L))
    has_counted = padded.view(N, num_blocks, block_length).any(-1)
    ordinal = _stratified(uniform, has_counted.sum(-1), n_t)  # among the blocks holding counted positions
    rank = has_counted.long().cumsum(-1) - 1  # ordinal of each counted block
    hit = (rank[:, None, :] == ordinal[..., None]) & has_counted[:, None, :]
    chosen_block = hit.long().argmax(-1)  # [N, n_t]

    position_block = block_of[None, None, :]
    in_block = (position_block == chosen_block[..., None]) & counted[:, None, :]
    valid = in_block.sum(-1)  # v >= 1
    size = (uniform(N, n_t) * valid).long().clamp_max(valid - 1) + 1  # l in 1..v
    within = _random_subset(uniform, in_block, size)
    later = position_block > chosen_block[..., None]
    earlier = (position_block < chosen_block[..., None]) & (uniform(N, n_t, L) < perturb_prob)
    return (within | later | earlier) & counted[:, None, :]


def _block_elbo_masks(uniform: Uniform, counted: torch.Tensor, prompt_real: torch.Tensor, n_t: int, block_length: int):
    """The block ELBO's masks: chosen [N, n_t, L] bool and the per-position weights [N, n_t, L] (v / l of the
    position's block; 0 off the counted positions). Blocks align to each row's first real token."""
    N = counted.shape[0]
    block, sizes = _model_blocks(counted, prompt_real, block_length)
    blocks = sizes.shape[1]
    size = _stratified(uniform, sizes.clamp_min(1).reshape(-1), n_t).view(N, blocks, n_t).transpose(1, 2) + 1  # l
    return _block_subsets(uniform, counted, block, sizes, size)


def _model_blocks(counted: torch.Tensor, prompt_real: torch.Tensor, block_length: int):
    """The completion cut into the model's blocks, aligned to each row's first real token: block [N, L] int64 (0 for
    the completion's first block, which may hold the prompt's tail) and sizes [N, blocks] int64 (v, the counted
    positions of each block)."""
    N, L = counted.shape
    P, device = prompt_real.shape[1], counted.device
    first = torch.where(prompt_real.any(1), prompt_real.to(torch.int8).argmax(1), P)  # [N]
    absolute = torch.div(P + torch.arange(L, device=device)[None, :] - first[:, None], block_length,
                         rounding_mode="floor")
    block = absolute - absolute[:, :1]  # [N, L]: 0 for the completion's first block
    blocks = int(block.max()) + 1
    sizes = torch.zeros(N, blocks, dtype=torch.long, device=device).index_put_(
        (torch.arange(N, device=device)[:, None].expand(N, L), block), counted.long(), accumulate=True)  # v
    return block, sizes


def _block_subsets(uniform: Uniform, counted: torch.Tensor, block: torch.Tensor, sizes: torch.Tensor,
                   size: torch.Tensor):
    """size [N, n_t, blocks] (in 1..v) random counted positions of each block masked: chosen [N, n_t, L] bool and
    the per-position weights v / size of the position's block (0 off the counted positions)."""
    N, L = counted.shape
    n_t, blocks, device = size.shape[1], sizes.shape[1], counted.device
    # A uniformly random l-subset of each block's counted positions: rank the positions by (block, key), counted
    # ones first within a block, and keep the first l of each block.
    keys = torch.where(counted[:, None, :], uniform(N, n_t, L), 2.0) + 4.0 * block[:, None, :]
    rank = keys.argsort(-1).argsort(-1)
    block_start = torch.full((N, blocks), L, dtype=torch.long, device=device).scatter_reduce(
        1, block, torch.arange(L, device=device).expand(N, L), reduce="amin")
    within = rank - block_start.gather(1, block)[:, None, :]
    index = block[:, None, :].expand(N, n_t, L)
    chosen = (within < size.gather(2, index)) & counted[:, None, :]
    weight = sizes.gather(1, block)[:, None, :].double() / size.gather(2, index).double()
    return chosen, torch.where(counted[:, None, :], weight, 0.0)


def gauss_legendre(points: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K-point Gauss-Legendre rule on [0, 1]: nodes t_k and weights c_k (sum 1), float64, by Golub-Welsch
    (the eigenvalues of the Legendre recurrence's Jacobi matrix; weights from the first eigenvector components)."""
    k = torch.arange(1, points, dtype=torch.float64)
    off_diagonal = k / torch.sqrt(4 * k**2 - 1)
    jacobi = torch.diag(off_diagonal, 1) + torch.diag(off_diagonal, -1)
    nodes, vectors = torch.linalg.eigh(jacobi)
    return (nodes + 1) / 2, vectors[0] ** 2  # [-1, 1] -> [0, 1]; weights 2 v_0^2 on [-1, 1] halve


def _gauss_masks(uniform: Uniform, counted3: torch.Tensor, lengths: torch.Tensor, n_t: int, points: int):
    """GDPO's SDMC masks: n_t / points exact-size draws at each Gauss node (node-major order)."""
    N = counted3.shape[0]
    nodes, node_weights = (v.to(counted3.device) for v in gauss_legendre(points))
    t = nodes.repeat_interleave(n_t // points)[None, :].expand(N, n_t)
    size = torch.minimum((t * lengths[:, None]).floor().long().clamp_min(1), lengths[:, None])
    chosen = _random_subset(uniform, counted3, size)
    weight = (points * node_weights / nodes).repeat_interleave(n_t // points)[None, :].expand(N, n_t)
    return chosen, weight.clone(), t.clone()


def _coupled_masks(uniform: Uniform, counted: torch.Tensor, n_t: int, t_range: tuple[float, float]):
    """DiffuCoder's masks: the full completion, then complementary Bernoulli(t) pairs, t ~ U[t_range]."""
    N, L = counted.shape
    pairs = (n_t - 1) // 2
    low, high = t_range
    rate = low + (high - low) * uniform(N, pairs)  # [N, pairs]
    first = (uniform(N, pairs, L) < rate[..., None]) & counted[:, None, :]
    second = counted[:, None, :] & ~first
    chosen = torch.cat((counted[:, None, :], torch.stack((first, second), dim=2).reshape(N, 2 * pairs, L)), dim=1)
    t = torch.cat((torch.ones(N, 1, dtype=torch.float64, device=counted.device),
                   torch.stack((rate, 1 - rate), dim=2).reshape(N, 2 * pairs)), dim=1)
    weight = n_t / (pairs + 1) / t  # every counted token is scored once per group (full mask, each pair)
    return chosen, weight, t


def _trajectory_masks(counted: torch.Tensor, unmask_step: torch.Tensor, shrink: int) -> Drawn:
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
    weight = torch.full((N, n_t), float(n_t), dtype=torch.float64, device=counted.device)
    t = (completion_masked & counted[:, None, :]).sum(-1).double() / counted.sum(-1, keepdim=True)
    return Drawn(chosen, weight, t, completion_masked=completion_masked, target=chosen)


# ---------------------------------------------------------------------------------------------------------
# EBPO's, JustGRPO's and offline VRPO's samplers (objectives/ebpo.py, justgrpo.py, vrpo_dpo.py)
#
# - ``block_cells`` (EBPO as DARE reads the LLaDA2.1 report; dllm_core_algos.py _forward_process_ebpo): block
#   models. The completion is cut into the model's blocks as ``block_elbo`` cuts it; every block holding counted
#   positions is masked in every sample. Sequence n has C_n = n_t B_n (sample, block) cells (B_n blocks with
#   counted positions), ordered sample-major, c = j B_n + r (r the block's ordinal); one uniform offset o_n per
#   sequence gives cell c the noise level u = (o_n + c / C_n) mod 1 (each u uniform on its own, the C_n spread
#   evenly), and m = min(floor(u v) + 1, v) of the block's v counted positions are masked, uniformly at random.
#   w = v / m per position, so the ELBO is mean_j sum_b sum_{i in b masked} lp / p_jb with p_jb = m_jb / v_b
#   (DARE's composite ELBO). Sample-major order puts a sample's blocks 1 / C_n apart: their noise levels are
#   nearly shared, the samples' spread over [0, 1).
# - ``block_row_t``: the same with one noise level per sample shared by its blocks, u_j = (o_n + j / n_t) mod 1
#   and m_jb = min(floor(u_j v_b) + 1, v_b) (EBPO read as one t per composite forward). ``block_elbo`` is the third
#   reading: a noise level per (sample, block), stratified across the n_t samples of each (sequence, block).
# - ``autoregressive`` (JustGRPO): the exact left-to-right likelihood. Sample j masks completion positions
#   i >= j and reads (`target`) position j alone, weight n_t, so `elbo` is sum_j lp[n, j, j] = log pi_AR(y): the
#   log-probability that decoding one token per step from left to right (block_length 1) emits y. Deterministic;
#   n_t is the most counted positions any row has (count "all": L; "eos": rows shorter than the longest get empty
#   samples). Scoring computes lp at every masked counted position of a sample (L (L + 1) / 2 rows of the LM head
#   per sequence for L forwards), of which the estimate reads one.
# - ``stratified_linspace`` (offline VRPO as DARE implements it, dllm_core_algos.py _forward_process_vrpo):
#   ``stratified_l`` with DARE's rounding: k ~ U{1..L_n}, x_j = ((round(k + j L_n / n_t) - 1) mod L_n) + 1 masked
#   counted positions chosen uniformly, w = L_n / x_j.


def _block_cells(uniform: Uniform, canvas: Canvas, spec) -> Drawn:
    counted, n_t = canvas.counted, spec.n_t
    block, sizes = _model_blocks(counted, canvas.prompt_real, spec.block_length)
    present = sizes > 0  # [N, blocks]
    ordinal = present.long().cumsum(-1) - 1  # r: the block's rank among the sequence's blocks with counted positions
    cells = (n_t * present.sum(-1)).double()  # C_n
    offset = uniform(counted.shape[0])  # o_n
    cell = torch.arange(n_t, device=counted.device)[None, :, None] * present.sum(-1)[:, None, None] + ordinal[:, None]
    noise = torch.remainder(offset[:, None, None] + cell.double() / cells[:, None, None], 1.0)  # [N, n_t, blocks]
    return _cells_drawn(uniform, counted, block, sizes, noise)


def _block_row_t(uniform: Uniform, canvas: Canvas, spec) -> Drawn:
    counted, n_t = canvas.counted, spec.n_t
    block, sizes = _model_blocks(counted, canvas.prompt_real, spec.block_length)
    offset = uniform(counted.shape[0])
    rows = torch.arange(n_t, device=counted.device, dtype=torch.float64)[None, :] / n_t
    noise = torch.remainder(offset[:, None] + rows, 1.0)[..., None].expand(-1, -1, sizes.shape[1])
    return _cells_drawn(uniform, counted, block, sizes, noise)


def _cells_drawn(uniform: Uniform, counted, block, sizes, noise) -> Drawn:
    """Each cell's noise level u [N, n_t, blocks] as DARE's mask count m = min(floor(u v) + 1, v) of its block."""
    v = sizes[:, None, :].expand_as(noise)
    size = torch.minimum((noise * v).floor().long() + 1, v.clamp_min(1))
    chosen, weight = _block_subsets(uniform, counted, block, sizes, size)
    return Drawn(chosen, weight, chosen.sum(-1).double() / _row_lengths(counted))


def _row_lengths(counted: torch.Tensor) -> torch.Tensor:
    """[N, 1] float64 counted positions of each row, for a sample's masked fraction t."""
    return counted.sum(-1, keepdim=True).double()


def _autoregressive(uniform: Uniform, canvas: Canvas, spec) -> Drawn:
    counted = canvas.counted
    N, L = counted.shape
    n_t = int(canvas.lengths.max())  # the counted positions are a prefix of the completion (count "all" or "eos")
    check_pairs(N, n_t)
    position = torch.arange(L, device=counted.device)
    sample = torch.arange(n_t, device=counted.device)[:, None]
    # mask j: positions i >= j (and, as every sampler keeps them, the positions that do not count)
    completion_masked = (position[None, :] >= sample)[None] | ~counted[:, None, :]
    target = (position[None, :] == sample)[None] & counted[:, None, :]  # and reads position j
    weight = torch.full((N, n_t), float(n_t), dtype=torch.float64, device=counted.device)
    t = (completion_masked & counted[:, None, :]).sum(-1).double() / _row_lengths(counted)
    return Drawn(target, weight, t, completion_masked=completion_masked, target=target)


def _stratified_linspace(uniform: Uniform, canvas: Canvas, spec) -> Drawn:
    lengths, n_t = canvas.lengths, spec.n_t
    v = lengths[:, None].double()
    k = (uniform(lengths.shape[0]) * lengths).long().clamp_max(lengths - 1)[:, None] + 1  # k ~ U{1..L_n}
    steps = torch.arange(n_t, device=lengths.device, dtype=torch.float64)[None, :]
    x = torch.round(k.double() + steps * v / n_t).long()
    size = torch.remainder(x - 1, lengths[:, None]) + 1  # in 1..L_n
    chosen = _random_subset(uniform, canvas.expanded(n_t), size)
    return Drawn(chosen, v / size, size / v)


def _positions(spec) -> NTRule:
    return NTRule(largest=1, message="n_t={n_t} does not apply with sampler='autoregressive': it scores one sample "
                                     "per completion position (n_t follows from the completions); leave n_t at 1.")


register_sampler("block_cells", _block_cells, model_blocks=True)
register_sampler("block_row_t", _block_row_t, model_blocks=True)
register_sampler("autoregressive", _autoregressive, n_t_rule=_positions, random=False, data_n_t=True)
register_sampler("stratified_linspace", _stratified_linspace)


# ---------------------------------------------------------------------------------------------------------
# MDPO's sampler (objectives/mdpo.py)
#
# - ``recorded_state``: one sample per row, a decoding state the rollout recorded: the completion positions whose
#   `unmask_step` is 0 are the state's given tokens, every later one (unmask_step >= 1) is masked and read. MDPO's
#   step batch re-bases each row's steps on the state it trains on (objectives.mdpo: a row is the rollout's canvas
#   before forward t, with unmask_step - t + 1 clamped at 0), so the sample is the canvas x_t exactly, and the
#   sequence scored is x_hat_t, the model's one-step prediction there. Like ``trajectory`` it reveals the given
#   non-counted positions (the state is the rollout's own); w = 1, t = the masked fraction of counted positions.
#   Deterministic.


def _recorded_state(uniform: Uniform, canvas: Canvas, spec) -> Drawn:
    counted, unmask_step = canvas.counted, canvas.unmask_step
    if unmask_step is None:
        raise ValueError("sampler='recorded_state' reads the state from unmask_step (0: given, >= 1: masked); "
                         "build the batch with objectives.mdpo's step_batch (from generate(..., "
                         "record_step_predictions=True)).")
    masked = (unmask_step.to(counted.device) >= 1)[:, None, :]
    chosen = masked & counted[:, None, :]
    N = counted.shape[0]
    weight = torch.ones(N, 1, dtype=torch.float64, device=counted.device)
    t = chosen.sum(-1).double() / _row_lengths(counted)
    return Drawn(chosen, weight, t, completion_masked=masked, target=chosen)


def _one_state(spec) -> NTRule:
    return NTRule(largest=1, message="n_t={n_t} does not apply with sampler='recorded_state': each row is one "
                                     "recorded decoding state; leave n_t at 1.")


register_sampler("recorded_state", _recorded_state, n_t_rule=_one_state, random=False, data_n_t=True)
# d-TreeRPO's sampler (objectives/d_treerpo.py)
#
# - ``tree_edge`` (d-TreeRPO's per-edge transition, THU-BPM dtreerpo_trainer.py L165-214): each sequence is one
#   edge of a tree rollout (rollout/tree.py), its child's canvas, and `unmask_step` gives each completion
#   position's stage relative to the edge: 0 decoded before it (visible in the parent), 1 decoded by it and read,
#   2 masked in the parent and not read (still masked in the child, or decoded after the child's first EOS). The
#   one sample masks stages 1 and 2, which is the parent's canvas, and reads stage 1: lp_i = log p(child_i |
#   parent), one forward on the parent. Weight 1, n_t 1, deterministic. Scoring also returns lp at the masked
#   stage-2 positions (the token the batch holds there), which the estimate ignores.


def _tree_edge(uniform: Uniform, canvas: Canvas, spec) -> Drawn:
    stage, counted = canvas.unmask_step, canvas.counted
    if stage is None:
        raise ValueError("sampler='tree_edge' scores the edges of a tree rollout: pass unmask_step, each position's "
                         "stage relative to its edge (objectives.d_treerpo.tree_batch builds it).")
    if tuple(stage.shape) != tuple(counted.shape) or bool(((stage < 0) | (stage > 2)).any()):
        raise ValueError(f"sampler='tree_edge' needs unmask_step [N, L] = {list(counted.shape)} of edge stages 0, 1 "
                         "or 2 (before the edge, decoded by it, masked and not read).")
    stage = stage.to(counted.device)
    chosen = ((stage == 1) & counted)[:, None, :]
    completion_masked = (stage >= 1)[:, None, :] | ~counted[:, None, :]
    N = counted.shape[0]
    weight = torch.ones((N, 1), dtype=torch.float64, device=counted.device)
    t = (completion_masked & counted[:, None, :]).sum(-1).double() / _row_lengths(counted)
    return Drawn(chosen, weight, t, completion_masked=completion_masked, target=chosen)


def _one_edge(spec) -> NTRule:
    return NTRule(largest=1, message="n_t={n_t} does not apply with sampler='tree_edge': each edge is scored once, "
                                     "on its parent's canvas; leave n_t at 1.")


register_sampler("tree_edge", _tree_edge, n_t_rule=_one_edge, random=False)
