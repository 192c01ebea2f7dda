"""What every objective shares: its config, the constants of one update, and the one entry point.

An objective is data plus a pure function. Its config dataclass holds the paper's defaults, including the mask
sampler and n_t it needs. `prepare` turns a RolloutBatch (and the old and reference policies' lp on the same
masks) into `LossInputs`, the constants of one update; `loss(lp, inputs)` is a differentiable function of the
current policy's lp [N, n_t, L] alone. Separable objectives (a sum of per-(sequence, sample) terms) also give
`pair_loss`, which lets the engine skip its scoring pass.

`Objective.backward(model, batch, ...)` is the entry point that the trainer, the TRL adapter and the VeRL loss
all call: it draws the masks, scores the old and reference policies if their lp is not given, runs the streaming
backward (exact gradient, memory independent of n_t) and returns the loss and the stats.

On-policy convention: with no old policy (neither `lp_old` nor `old_model`), the old policy is the current one,
old = stop_gradient(current). Ratios are then exactly 1 and the gradient is the first-step gradient: this is the
first inner update of every on-policy step, and what d1 does with one inner update.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, ContextManager

import torch

from dllm_fast.contracts import RolloutBatch, unwrap_model
from dllm_fast.likelihood import MonteCarloMasks, sample_masks, score, streaming_backward
from dllm_fast.likelihood.masks import COUNT_MODES, SAMPLERS
from dllm_fast.objectives.advantages import group_advantages, zero_std_fraction
from dllm_fast.validation import check_choice, check_float, check_int, check_probability


@dataclass
class ObjectiveConfig:
    """The likelihood estimator an objective needs. Subclasses add their own fields with their paper's defaults.

    n_t: Monte Carlo masks per sequence. sampler: one of dllm_fast.likelihood.SAMPLERS. count: which completion
    positions count ("eos": through the first EOS; "all": every position). block_length, perturb_prob: the
    "block" and "mean_field" samplers' settings.
    """

    n_t: int = 1
    sampler: str = "stratified_l"
    count: str = "eos"
    block_length: int = 32
    perturb_prob: float = 0.15

    def __post_init__(self) -> None:
        check_int("n_t", self.n_t, minimum=1, hint="Monte Carlo masks per sequence")
        check_choice("sampler", self.sampler, SAMPLERS)
        check_choice("count", self.count, COUNT_MODES)
        check_int("block_length", self.block_length, minimum=1)
        check_probability("perturb_prob", self.perturb_prob)
        if self.sampler == "complementary" and self.n_t % 2:
            raise ValueError(f"n_t={self.n_t} must be even for sampler='complementary' (masks come in pairs).")


@dataclass(frozen=True, eq=False)
class LossInputs:
    """The constants of one update: everything the loss needs besides the current policy's lp.

    masks: the stored masks lp is scored on. advantages: [N] float64. batch: the rollouts.
    lp_old, lp_ref: [N, n_t, L] of the old and reference policies on `masks`, or None (on-policy old; no
    reference needed). extra: per-objective constants computed once in `prepare`.
    """

    masks: MonteCarloMasks
    batch: RolloutBatch
    advantages: torch.Tensor
    lp_old: torch.Tensor | None = None
    lp_ref: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def old(self, lp: torch.Tensor) -> torch.Tensor:
        """The old policy's lp: the given constant, or (on-policy) the current lp without gradient."""
        return lp.detach() if self.lp_old is None else self.lp_old.to(lp.dtype)

    def ref(self, lp: torch.Tensor) -> torch.Tensor:
        if self.lp_ref is None:
            raise ValueError("this objective needs the reference policy's lp; pass lp_ref=, ref_model=, or a PEFT "
                             "model (its adapters disabled are the reference).")
        return self.lp_ref.to(lp.dtype)

    def advantage(self, lp: torch.Tensor) -> torch.Tensor:
        return self.advantages.to(device=lp.device, dtype=lp.dtype)


@dataclass
class ObjectiveOutput:
    """What `Objective.backward` returns. loss: the objective's value (detached 0-dim tensor). stats: floats for
    logging. masks, lp: the masks drawn and the current policy's lp on them (detached)."""

    loss: torch.Tensor
    stats: dict[str, float]
    masks: MonteCarloMasks
    lp: torch.Tensor


class Objective:
    """Base class of the published objectives. Subclasses set `name`, `Config` and implement `loss` (and
    `pair_loss` when `separable`), `stats`, and optionally `advantages` and `needs_reference`."""

    name: ClassVar[str] = ""
    Config: ClassVar[type[ObjectiveConfig]] = ObjectiveConfig
    separable: ClassVar[bool] = False
    uses_old_policy: ClassVar[bool] = False  # a ratio to the old policy (reads lp_old; on-policy without it)

    def __init__(self, config: ObjectiveConfig | None = None, **overrides: Any):
        if config is None:
            config = self.Config()
        elif not isinstance(config, self.Config):
            raise TypeError(f"{self.name} takes a {self.Config.__name__}, got {type(config).__name__}.")
        if overrides:
            names = {f.name for f in dataclasses.fields(self.Config)}
            unknown = sorted(set(overrides) - names)
            if unknown:
                raise ValueError(f"{self.name} has no option {', '.join(map(repr, unknown))}; its options are "
                                 f"{sorted(names)}.")
            config = dataclasses.replace(config, **overrides)  # re-runs the config's checks
        self.config = config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"

    # -- what each objective defines --------------------------------------------------------------------------
    @property
    def needs_reference(self) -> bool:
        """Whether the loss reads the reference policy's lp (a KL term, RSPO's relative score)."""
        return False

    def advantages(self, batch: RolloutBatch) -> torch.Tensor:
        """[N] float64. Default: reward minus the group mean, no std (d1, wd1, SPG)."""
        return group_advantages(batch.rewards, batch.group_size)

    def loss(self, lp: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
        """The loss to minimise, a differentiable function of the current policy's lp [N, n_t, L]."""
        if not self.separable:
            raise NotImplementedError(f"{type(self).__name__} must define loss(lp, inputs).")
        masks = inputs.masks
        N, n_t, L = lp.shape
        sequence = torch.arange(N, device=lp.device).repeat_interleave(n_t)
        sample = torch.arange(n_t, device=lp.device).repeat(N)
        return self.pair_loss(lp.reshape(N * n_t, L), sequence, sample, inputs)

    def pair_loss(self, lp_pairs: torch.Tensor, sequence: torch.Tensor, sample: torch.Tensor,
                  inputs: LossInputs) -> torch.Tensor:
        """Separable objectives: the loss's terms for some (sequence, sample) pairs; rows lp_pairs [b, L]."""
        raise NotImplementedError(f"{type(self).__name__} is not separable.")

    def stats(self, lp: torch.Tensor, inputs: LossInputs) -> dict[str, torch.Tensor]:
        """Diagnostics at the current lp (ratios, clip fraction, KL, bound values), as 0-dim tensors."""
        return {}

    def extra(self, batch: RolloutBatch, masks: MonteCarloMasks) -> dict[str, Any]:
        """Constants of one update beyond advantages and old/ref lp (e.g. normalisers), computed once."""
        return {}

    # -- shared machinery -------------------------------------------------------------------------------------
    def draw_masks(self, batch: RolloutBatch, *, generator: torch.Generator, eos_token_id: int | None,
                   ) -> MonteCarloMasks:
        """The Monte Carlo masks this objective's estimator needs, for the batch's sequences."""
        c = self.config
        return sample_masks(batch.sequences, prompt_length=batch.prompt_length, n_t=c.n_t, sampler=c.sampler,
                            generator=generator, eos_token_id=eos_token_id, count=c.count,
                            attention_mask=batch.attention_mask, block_length=c.block_length,
                            perturb_prob=c.perturb_prob)

    def check_masks(self, masks: MonteCarloMasks, batch: RolloutBatch) -> None:
        if not isinstance(masks, MonteCarloMasks):
            raise TypeError(f"masks must be a MonteCarloMasks, got {type(masks).__name__}.")
        if masks.sampler != self.config.sampler:
            raise ValueError(f"masks were drawn with sampler={masks.sampler!r} but {self.name} uses "
                             f"sampler={self.config.sampler!r}; draw them with objective.draw_masks(...) or set "
                             f"the objective's sampler.")
        if masks.n_t != self.config.n_t:
            raise ValueError(f"masks hold n_t={masks.n_t} samples per sequence but {self.name} is configured with "
                             f"n_t={self.config.n_t}; draw them with objective.draw_masks(...).")
        if masks.num_sequences != batch.num_rollouts or masks.prompt_length != batch.prompt_length:
            raise ValueError(f"masks cover {masks.num_sequences} sequences with prompt length "
                             f"{masks.prompt_length}, the batch {batch.num_rollouts} with prompt length "
                             f"{batch.prompt_length}; draw masks for this batch.")
        masks.check_sequences(batch.sequences)

    def prepare(self, batch: RolloutBatch, masks: MonteCarloMasks, *, lp_old: torch.Tensor | None = None,
                lp_ref: torch.Tensor | None = None) -> LossInputs:
        """The constants of one update. lp_old / lp_ref must have been scored on `masks` (checked)."""
        if not isinstance(batch, RolloutBatch):
            raise TypeError(f"batch must be a dllm_fast.RolloutBatch (RolloutBatch.from_generation(result, "
                            f"rewards, group_size=G)), got {type(batch).__name__}.")
        self.check_masks(masks, batch)
        if lp_old is not None:
            masks.check_lp(lp_old, "lp_old")
        if lp_ref is not None:
            masks.check_lp(lp_ref, "lp_ref")
        elif self.needs_reference:
            raise ValueError(f"{self.name} needs the reference policy's lp on the same masks (lp_ref=); "
                             f"{self._reference_hint()}")
        advantages = self.advantages(batch).to(batch.sequences.device)
        return LossInputs(masks=masks, batch=batch, advantages=advantages, lp_old=lp_old, lp_ref=lp_ref,
                          extra=self.extra(batch, masks))

    def _reference_hint(self) -> str:
        return "give ref_model= or lp_ref=, or a PEFT model (the reference is the model with its adapters disabled)."

    def backward(
        self,
        model,
        batch: RolloutBatch,
        *,
        micro_batch: int,
        generator: torch.Generator | None = None,
        masks: MonteCarloMasks | None = None,
        lp: torch.Tensor | None = None,
        lp_old: torch.Tensor | None = None,
        lp_ref: torch.Tensor | None = None,
        old_model=None,
        ref_model=None,
        score_micro_batch: int | None = None,
        chunk_size: int | None = None,
        sync_gradients: bool = True,
        grad_sync: Callable[[], ContextManager] | None = None,
        backward: Callable[[torch.Tensor], None] | None = None,
    ) -> ObjectiveOutput:
        """Accumulate this objective's exact gradient into the model's `.grad`; return the loss and stats.

        Args:
            model: the current policy (model contract; PEFT and DDP wrappers work).
            batch: the rollouts with rewards (RolloutBatch).
            micro_batch: (sequence, sample) pairs per backward graph; memory scales with it, not with n_t.
            generator: draws the masks when `masks` is not given (an explicit torch.Generator).
            masks: masks from `draw_masks` to reuse (e.g. those lp_old was scored on).
            lp: the current policy's lp on `masks` if already known (e.g. = lp_old at the first inner update):
                two-pass objectives skip their scoring pass. Ignored by separable ones, which need none.
            lp_old: the old policy's lp on `masks`. Without it and without `old_model`, old = current (on-policy).
            lp_ref: the reference policy's lp on `masks` (KL terms, RSPO). Without it, `ref_model` is scored,
                or, for a PEFT model, the model with its adapters disabled.
            old_model, ref_model: policies to score when lp_old / lp_ref are not given.
            score_micro_batch, chunk_size: as in `streaming_backward` and `score`.
            sync_gradients, grad_sync, backward: data-parallel and host-trainer hooks of `streaming_backward`.
        """
        core = unwrap_model(model)
        if masks is None:
            if generator is None:
                raise ValueError("pass generator=torch.Generator().manual_seed(seed) to draw the masks, or masks=.")
            masks = self.draw_masks(batch, generator=generator, eos_token_id=getattr(core, "eos_token_id", None))
        mask = batch.attention_mask
        scoring = dict(micro_batch=score_micro_batch or micro_batch, attention_mask=mask, chunk_size=chunk_size)
        self.check_masks(masks, batch)
        if lp_old is None and old_model is not None:
            with torch.no_grad():
                lp_old = score(old_model, batch.sequences, masks, **scoring)
        if self.needs_reference and lp_ref is None:
            with torch.no_grad():
                lp_ref = self._score_reference(model, ref_model, batch, masks, scoring)
        inputs = self.prepare(batch, masks, lp_old=lp_old, lp_ref=lp_ref)
        engine = dict(micro_batch=micro_batch, attention_mask=mask, chunk_size=chunk_size, return_lp=True,
                      sync_gradients=sync_gradients, grad_sync=grad_sync, backward=backward)
        if self.separable:
            value, lp_now = streaming_backward(
                model, batch.sequences, masks, lambda rows, n, j: self.pair_loss(rows, n, j, inputs),
                separable=True, **engine)
        else:
            value, lp_now = streaming_backward(model, batch.sequences, masks, lambda x: self.loss(x, inputs), lp=lp,
                                               score_micro_batch=score_micro_batch, **engine)
        with torch.no_grad():
            stats = {name: float(v) for name, v in self.stats(lp_now, inputs).items()}
        stats.update(loss=float(value), zero_std_fraction=zero_std_fraction(batch.rewards, batch.group_size),
                     advantage_abs_mean=float(inputs.advantages.abs().mean()))
        return ObjectiveOutput(loss=value, stats=stats, masks=masks, lp=lp_now)

    def _score_reference(self, model, ref_model, batch, masks, scoring) -> torch.Tensor:
        if ref_model is not None:
            return score(ref_model, batch.sequences, masks, **scoring)
        core = unwrap_model(model)
        if hasattr(core, "disable_adapter"):  # PEFT: the reference is the base model
            with core.disable_adapter():
                return score(model, batch.sequences, masks, **scoring)
        raise ValueError(f"{self.name} needs a reference policy: {self._reference_hint()}")


# ---------------------------------------------------------------------------------------------------------
# Terms shared by several objectives


def clipped_surrogate(ratio: torch.Tensor, advantage: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """PPO's pessimistic surrogate min(ratio A, clip(ratio, 1 - low, 1 + high) A), elementwise (to maximise)."""
    return torch.minimum(ratio * advantage, ratio.clamp(1.0 - low, 1.0 + high) * advantage)


def clipped(ratio: torch.Tensor, advantage: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Where the clip is active (the surrogate's gradient is zero): ratio above 1 + high with A > 0, or below
    1 - low with A < 0."""
    return ((ratio > 1.0 + high) & (advantage > 0)) | ((ratio < 1.0 - low) & (advantage < 0))


def kl_k3(log_ratio_ref: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(current || ref) from log(p_ref / p): exp(x) - x - 1 >= 0."""
    return torch.expm1(log_ratio_ref) - log_ratio_ref


def safe_exp(x: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """exp(x) where `where`, 1 elsewhere: the unused branch of a torch.where must not overflow (inf * 0 = NaN in
    its gradient)."""
    return torch.exp(torch.where(where, x, torch.zeros((), dtype=x.dtype, device=x.device)))


def check_epsilon(name: str, value: float) -> float:
    return check_float(name, value, minimum=0.0, hint="clip range; 0 pins the ratio's interval to [1, 1]")
