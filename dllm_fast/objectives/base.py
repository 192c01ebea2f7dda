"""What every objective shares: its config, the constants of one update, and the one entry point.

An objective is data plus a pure function. Its config dataclass holds the paper's defaults, including the mask
sampler and n_t it needs. `prepare` turns a RolloutBatch (and the old and reference policies' lp on the same
masks) into `LossInputs`, the constants of one update; `loss(lp, inputs)` is a differentiable function of the
current policy's lp [N, n_t, L] alone. Separable objectives (a sum of per-(sequence, sample) terms) also give
`pair_loss`, which lets the engine skip its scoring pass; so does `sequence_local` (a sum of per-sequence terms:
the engine differentiates each micro-batch's whole sequences in its own graph).

One rollout batch feeds one or more inner updates. `Objective.plan_updates(model, batch, ...)` is the one place
that plans them: it draws each update's masks and scores the old policy on the masks of the updates that run after
the policy has moved. `Objective.backward(model, batch, update, ...)` runs one update: it scores the reference
policy if its lp is not given, runs the streaming backward (exact gradient, memory independent of n_t) and returns
the loss and the stats. The trainer and the TRL adapter both call these two; neither re-derives the plan.

On-policy convention: with no old policy's lp (`InnerUpdate.lp_old` is None), the old policy is the current one,
old = stop_gradient(current). Ratios are then exactly 1 and the gradient is the first-step gradient: this is the
first inner update of every on-policy step, and what d1 does with one inner update. Its scoring pass is then the
only one: the old policy's lp of an update before any optimizer step is never scored separately. This is the
exact path, and the plan takes it for every update before the policy moves: scoring the current policy again
with another micro-batch (or batch composition) changes lp in its last bits, so a rescored "old" policy gives
ratios of 1 +- 1e-15, which a clip interval of width 0 (ESPO's countdown epsilon) already treats as moved. An
update whose current lp is known (`InnerUpdate.lp`) uses it for every objective, separable ones included, so
lp_old=lp gives ratios of exactly 1 too.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import torch

from dllm_fast.contracts import RolloutBatch, block_length, check_reference_model, unwrap_model
from dllm_fast.likelihood import (MonteCarloMasks, Separable, SequenceLocal, sample_masks, score,
                                  streaming_backward)
from dllm_fast.likelihood.gradients import all_or_nothing
from dllm_fast.likelihood.mask_spec import MaskSpec
from dllm_fast.likelihood.samplers import SAMPLERS
from dllm_fast.likelihood.settings import BackwardHooks, MicroBatching
from dllm_fast.objectives.advantages import BASELINES, group_advantages, zero_std_fraction
from dllm_fast.validation import check_bool, check_choice, check_float, check_int


def mask_defaults(**settings: Any) -> Any:
    """An objective config's `masks` field with its paper's mask settings (the other MaskSpec fields default)."""
    return field(default_factory=functools.partial(MaskSpec, **settings))


@dataclass
class ObjectiveConfig:
    """What an objective needs besides its own options. Subclasses add their own fields with their paper's defaults.

    masks: the likelihood estimator's mask settings (`MaskSpec`: sampler, n_t, count, block_length,
    perturb_prob, quadrature_points, coupled_t_min, coupled_t_max, shrink), set in a subclass with
    `mask_defaults(...)`. Each is also an option of its own: `objectives.get("vrpo_ol", n_t=8)`,
    `config.with_options(n_t=8)`, and reads as `config.n_t`. The settings' rules (e.g. complementary pairs need
    an even n_t) are the samplers' (`MaskSpec.validate`).

    advantage, scale_rewards, std_epsilon, population_std: the group-relative advantage
    (`objectives.group_advantages`: baseline, std scaling, the std's epsilon and kind), which every objective
    takes from these; a subclass re-declares them with its paper's defaults.

    A field's `metadata["help"]` is its one-line description on the command line (`train --objective NAME
    --help`, from `options()`); a subclass that re-declares one of these fields keeps the description given here.
    """

    masks: MaskSpec = field(default_factory=MaskSpec, metadata={"help": "the mask settings (MaskSpec)"})
    advantage: str = field(default="mean", metadata={"help": "group baseline: mean, or leave_one_out (RLOO)"})
    scale_rewards: bool = field(default=False, metadata={"help": "divide advantages by the group std + std_epsilon"})
    std_epsilon: float = field(default=1e-6, metadata={"help": "added to the group std when scale_rewards"})
    population_std: bool = field(default=False, metadata={"help": "scale by the population std (TraceRL's z-score) "
                                                                  "instead of the unbiased one"})

    def __post_init__(self) -> None:
        if not isinstance(self.masks, MaskSpec):
            raise TypeError(f"masks must be a MaskSpec, got {type(self.masks).__name__}; or set its fields (n_t, "
                            "sampler, ...) as options.")
        self.masks.validate()
        check_choice("advantage", self.advantage, BASELINES)
        check_bool("scale_rewards", self.scale_rewards)
        check_float("std_epsilon", self.std_epsilon, minimum=0.0)
        check_bool("population_std", self.population_std)

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """Every option a caller may set: the mask settings, `masks` itself, and the config's own fields."""
        return (*MaskSpec.names(), *(f.name for f in dataclasses.fields(cls)))

    @classmethod
    def default_masks(cls) -> MaskSpec:
        """The mask settings of this config's defaults (nothing validated, nothing built)."""
        return next(f for f in dataclasses.fields(cls) if f.name == "masks").default_factory()

    @classmethod
    def split(cls, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Options -> (the mask settings among them, the rest)."""
        names = MaskSpec.names()
        return ({k: v for k, v in options.items() if k in names}, {k: v for k, v in options.items() if k not in names})

    @classmethod
    def masks_of(cls, options: dict[str, Any], masks: MaskSpec | None = None) -> tuple[MaskSpec, dict[str, Any]]:
        """Options -> (the mask settings they give over `masks` (default: the config's defaults; an option `masks`
        replaces it), unchecked; the other options)."""
        settings, own = cls.split(options)
        masks = own.pop("masks", cls.default_masks() if masks is None else masks)
        if not isinstance(masks, MaskSpec):
            raise TypeError(f"masks must be a MaskSpec, got {type(masks).__name__}; or set its fields (n_t, "
                            "sampler, ...) as options.")
        return dataclasses.replace(masks, **settings), own

    def with_options(self, **options: Any) -> ObjectiveConfig:
        """A copy with `options` set (mask settings by their own names, on top of a given `masks`), checked."""
        masks, own = self.masks_of(options, self.masks)
        return dataclasses.replace(self, masks=masks, **own)  # re-runs the checks

    def options(self) -> dict[str, tuple[Any, str]]:
        """Each option's value and one-line description (the mask settings first), for `--help`."""
        shared = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(ObjectiveConfig)}
        described = {f.name: (getattr(self.masks, f.name), f.metadata.get("help", ""))
                     for f in dataclasses.fields(MaskSpec)}
        for config_field in dataclasses.fields(self):
            if config_field.name != "masks":
                described[config_field.name] = (getattr(self, config_field.name),
                                                config_field.metadata.get("help") or shared.get(config_field.name, ""))
        return described


# Each mask setting reads through the config (config.n_t is config.masks.n_t); set them with with_options.
for _setting in MaskSpec.names():
    setattr(ObjectiveConfig, _setting, property(lambda self, _name=_setting: getattr(self.masks, _name),
                                                doc=f"masks.{_setting}"))


@dataclass(frozen=True, eq=False)
class LossInputs:
    """The constants of one update: everything the loss needs besides the current policy's lp.

    masks: the stored masks lp is scored on. advantages: [N] float64. batch: the rollouts.
    lp_old, lp_ref: [N, n_t, L] of the old and reference policies on `masks`, or None (on-policy old; no
    reference needed). extra: per-objective constants computed once in `prepare`. None of them depends on how
    the pairs are cut into model calls: an option that normalises per micro-batch names its own rows
    (`micro_batch_rows`).
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


@dataclass(frozen=True, eq=False)
class InnerUpdate:
    """One inner update of a rollout batch, as `Objective.plan_updates` plans it.

    masks: the Monte Carlo masks every policy is scored on for this update.
    lp_old: the old policy's lp [N, n_t, L] on `masks`, scored before the policy moved; None: the policy has not
        moved since the rollout, so old = current (on-policy).
    lp: the current policy's lp on `masks` when it is already known; the engine then skips its scoring pass
        (two-pass objectives). The plan leaves it None: an update before any optimizer step is on-policy and its
        scoring pass is its only one. Give it when you hold the current lp yourself.
    """

    masks: MonteCarloMasks
    lp_old: torch.Tensor | None = None
    lp: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.masks, MonteCarloMasks):
            raise TypeError(f"InnerUpdate.masks must be a MonteCarloMasks (objective.draw_masks(...)), got "
                            f"{type(self.masks).__name__}.")


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
    # A sum of per-sequence terms (d loss / d lp[n] reads lp[n] alone): the engine may skip its scoring pass
    # (likelihood.SequenceLocal). An objective that centres or normalises by other sequences' lp values is not.
    sequence_local: ClassVar[bool] = False
    uses_old_policy: ClassVar[bool] = False  # a ratio to the old policy (reads lp_old; on-policy without it)
    # Named settings of the official scripts, e.g. a task's (`objectives.get("spg", preset="sudoku")`); options
    # given beside a preset override it.
    presets: ClassVar[dict[str, dict[str, Any]]] = {}
    # Trains on stored preference pairs instead of rollouts (offline VRPO/DPO): batches of groups of two whose
    # rewards say which is preferred (objectives.preference_batch); the trainer takes them from a preference task
    # (train/pairs.py), and a trainer that only rolls out (TRL's GRPOTrainer) refuses it.
    preference_pairs: ClassVar[bool] = False

    def __init__(self, config: ObjectiveConfig | None = None, *, preset: str | None = None, **overrides: Any):
        if config is None:
            config = self.Config()
        elif not isinstance(config, self.Config):
            raise TypeError(f"{self.name} takes a {self.Config.__name__}, got {type(config).__name__}.")
        overrides = self.resolve_options(preset, overrides)
        self.config = config.with_options(**overrides) if overrides else config

    @classmethod
    def resolve_options(cls, preset: str | None, options: dict[str, Any]) -> dict[str, Any]:
        """The options `preset` sets with `options` over them, every name checked."""
        if preset is not None:
            if preset not in cls.presets:
                known = ", ".join(cls.presets) or "none"
                raise ValueError(f"{cls.name} has no preset {preset!r}; its presets: {known}.")
            options = {**cls.presets[preset], **options}
        names = cls.Config.option_names()
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ValueError(f"{cls.name} has no option {', '.join(map(repr, unknown))}; its options are "
                             f"{sorted(set(names))}.")
        return options

    @classmethod
    def mask_spec(cls, *, preset: str | None = None, **options: Any) -> MaskSpec:
        """The mask settings `objectives.get(name, preset=preset, **options)` would use, without building it (its
        n_t unchecked: `MaskSpec.valid_n_t` searches it)."""
        return cls.Config.masks_of(cls.resolve_options(preset, options))[0]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"

    # -- what each objective defines --------------------------------------------------------------------------
    @property
    def needs_reference(self) -> bool:
        """Whether the loss reads the reference policy's lp (a KL term, RSPO's relative score)."""
        return False

    @property
    def needs_unmask_step(self) -> bool:
        """Whether the masks replay the rollout's decoding order: the batch must carry `unmask_step`, so roll out
        with `generate(..., record_unmask_step=True)`."""
        return self.config.sampler == "trajectory"

    def check_model(self, model) -> None:
        """Raise, naming the fix, unless this objective's estimator suits `model` (the policy, or its meta-device
        skeleton): a block sampler needs a block-diffusion model. Trainers call it before any work."""
        sampler = self.config.sampler
        if SAMPLERS[sampler].model_blocks and block_length(model) is None:
            raise ValueError(f"{self.name} with sampler={sampler!r} estimates a block-diffusion model's ELBO, block "
                             f"by block, but the policy ({type(unwrap_model(model)).__name__}) attends to the whole "
                             "sequence; use a block-diffusion model (SDAR, LLaDA2) or a sampler such as "
                             "'stratified_l'.")

    def check_rollouts(self, config) -> None:
        """Raise, naming the fix, unless rollouts decoded with `config` (a GenerateConfig) are what this objective's
        likelihood assumes (JustGRPO's left-to-right order); most objectives take any."""

    def advantages(self, batch: RolloutBatch) -> torch.Tensor:
        """[N] float64 group-relative advantages, as the config's advantage options set them (each objective's
        defaults are its paper's or code's)."""
        c = self.config
        return group_advantages(batch.rewards, batch.group_size, baseline=c.advantage,
                                scale="std" if c.scale_rewards else "none", std_epsilon=c.std_epsilon,
                                unbiased=not c.population_std)

    def loss(self, lp: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
        """The loss to minimise, a differentiable function of the current policy's lp [N, n_t, L]."""
        if not self.separable:
            raise NotImplementedError(f"{type(self).__name__} must define loss(lp, inputs).")
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

    def inert_sequences(self, inputs: LossInputs) -> torch.Tensor | None:
        """Sequence-local objectives: [N] bool, the sequences whose loss terms are constant in lp for every lp
        (e.g. zero advantage and no KL term), which the engine scores without a graph; None: none known."""
        return None

    def extra(self, batch: RolloutBatch, masks: MonteCarloMasks) -> dict[str, Any]:
        """Constants of one update beyond advantages and old/ref lp (e.g. normalisers), computed once."""
        return {}

    # -- shared machinery -------------------------------------------------------------------------------------
    def draw_masks(self, batch: RolloutBatch, *, generator: torch.Generator, eos_token_id: int | None,
                   model_block_length: int | None = None) -> MonteCarloMasks:
        """The Monte Carlo masks this objective's estimator needs, for the batch's sequences. model_block_length:
        the policy's block size when it is a block-diffusion model (contracts.block_length), which the
        block samplers ("block_elbo", "block_cells", "block_row_t") cut the completion by (plan_updates and
        backward pass it)."""
        spec = self.config.masks
        unmask_step = None
        if SAMPLERS[spec.sampler].model_blocks:
            if model_block_length is None:
                raise ValueError(f"{self.name} with sampler={spec.sampler!r} estimates a block-diffusion model's "
                                 "ELBO, block by block: the policy must be one (model.block_length, e.g. SDAR), "
                                 "passed as model_block_length; for a bidirectional model use e.g. 'stratified_l'.")
            spec = spec.replace(block_length=model_block_length)
        if spec.sampler == "trajectory":
            if batch.unmask_step is None:
                raise ValueError(f"{self.name} replays the rollout's decoding states, but the batch has no "
                                 "unmask_step: roll out with generate(..., record_unmask_step=True) and build the "
                                 "batch with RolloutBatch.from_generation.")
            unmask_step = batch.unmask_step
        return sample_masks(batch.sequences, spec, prompt_length=batch.prompt_length, generator=generator,
                            eos_token_id=eos_token_id, attention_mask=batch.attention_mask, unmask_step=unmask_step)

    def check_masks(self, masks: MonteCarloMasks, batch: RolloutBatch) -> None:
        if not isinstance(masks, MonteCarloMasks):
            raise TypeError(f"masks must be a MonteCarloMasks, got {type(masks).__name__}.")
        if masks.sampler != self.config.sampler:
            raise ValueError(f"masks were drawn with sampler={masks.sampler!r} but {self.name} uses "
                             f"sampler={self.config.sampler!r}; draw them with objective.draw_masks(...) or set "
                             f"the objective's sampler.")
        if masks.n_t != self.config.n_t and not SAMPLERS[masks.sampler].data_n_t:  # e.g. trajectory: one per state
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
        _check_batch(batch)
        self.check_masks(masks, batch)
        return self._loss_inputs(batch, masks, lp_old, lp_ref)

    def _loss_inputs(self, batch: RolloutBatch, masks: MonteCarloMasks, lp_old, lp_ref) -> LossInputs:
        """`prepare` on masks already checked against the batch."""
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

    def plan_updates(self, model, batch: RolloutBatch, *, moved: Sequence[bool], generator: torch.Generator,
                     micro_batch: int | MicroBatching) -> list[InnerUpdate]:
        """Plan the inner updates of one rollout batch: one `InnerUpdate` per entry of `moved`, in order.

        Each update's masks are drawn now from `generator`. moved[k] says whether an optimizer step will have
        been taken between the rollout and update k (the trainer's mu inner updates: [False, True, ..., True]; a
        host trainer that accumulates gradients marks the uses that come after its next optimizer step). For
        those, an objective with a ratio to the old policy needs the old policy's lp on their masks: it is scored
        here, now, before the policy moves (no gradient; wrap the call in the autocast the updates run under).
        An update with moved[k] False is on-policy: nothing is scored for it, and the engine's scoring pass is
        its only one.
        """
        _check_batch(batch)
        moved = [bool(m) for m in moved]
        if not moved:
            raise ValueError("moved lists no inner update; give one entry per inner update of this batch.")
        batching = MicroBatching.of(micro_batch)
        eos_token_id = getattr(unwrap_model(model), "eos_token_id", None)
        updates = []
        for moved_before in moved:
            masks = self.draw_masks(batch, generator=generator, eos_token_id=eos_token_id,
                                    model_block_length=block_length(model))
            lp_old = None
            if moved_before and self.uses_old_policy:
                with torch.no_grad():
                    lp_old = _score(model, batch, masks, batching)
            updates.append(InnerUpdate(masks, lp_old=lp_old))
        return updates

    def backward(self, model, batch: RolloutBatch, update: InnerUpdate | None = None, *,
                 micro_batch: int | MicroBatching, generator: torch.Generator | None = None,
                 lp_ref: torch.Tensor | None = None, ref_model=None,
                 hooks: BackwardHooks | None = None) -> ObjectiveOutput:
        """Accumulate this objective's exact gradient for one inner update into the model's `.grad`; return the
        loss and the stats. All or nothing, as `streaming_backward`: a failure or an interrupt anywhere in the
        call, the stats included, leaves every `.grad` bit-identical to what it was before the call.

        Args:
            model: the current policy (model contract; PEFT and DDP wrappers work).
            batch: the rollouts with rewards (RolloutBatch).
            update: the update's masks and old policy's lp, from `plan_updates` (or `InnerUpdate(masks, ...)`
                with masks from `draw_masks`). None: masks drawn from `generator`, on-policy.
            micro_batch: (sequence, sample) pairs per backward graph, or a `MicroBatching` that also sets the
                no-grad scoring calls and the LM head's vocabulary chunk; memory scales with it, not with n_t.
            generator: draws the masks when no `update` is given (an explicit torch.Generator).
            lp_ref: the reference policy's lp on the update's masks (KL terms, RSPO). Without it, `ref_model` is
                scored, or, for a PEFT model, the model with its adapters disabled.
            ref_model: the reference policy to score when lp_ref is not given.
            hooks: `BackwardHooks` (sync_gradients, grad_sync, backward), the data-parallel and host-trainer
                hooks of `streaming_backward`.
        """
        _check_batch(batch)
        batching = MicroBatching.of(micro_batch)
        if update is None:
            if generator is None:
                raise ValueError("pass generator=torch.Generator().manual_seed(seed) to draw the masks, or an "
                                 "update (objective.plan_updates(...), or InnerUpdate(masks, lp_old=...)).")
            core = unwrap_model(model)
            update = InnerUpdate(self.draw_masks(batch, generator=generator,
                                                 eos_token_id=getattr(core, "eos_token_id", None),
                                                 model_block_length=block_length(model)))
        elif not isinstance(update, InnerUpdate):
            raise TypeError(f"update must be an InnerUpdate (from objective.plan_updates(...)), got "
                            f"{type(update).__name__}.")
        masks = update.masks
        self.check_masks(masks, batch)
        if self.needs_reference and lp_ref is None:
            lp_ref = self.reference_lp(model, batch, masks, micro_batch=batching, ref_model=ref_model)
        inputs = self._loss_inputs(batch, masks, update.lp_old, lp_ref)
        engine = dict(micro_batch=batching, attention_mask=batch.attention_mask, hooks=hooks)

        def run() -> ObjectiveOutput:
            if self.separable and update.lp is None:  # a known current lp goes through the two-pass route
                value, lp_now = streaming_backward(
                    model, batch.sequences, masks, Separable(lambda rows, n, j: self.pair_loss(rows, n, j, inputs)),
                    **engine)
            elif self.sequence_local and update.lp is None:  # the other sequences' rows hold the old lp (ratio 1)
                local = SequenceLocal(lambda x: self.loss(x, inputs), fill=update.lp_old,
                                      inert=self.inert_sequences(inputs))
                value, lp_now = streaming_backward(model, batch.sequences, masks, local, **engine)
            else:
                value, lp_now = streaming_backward(model, batch.sequences, masks, lambda x: self.loss(x, inputs),
                                                   lp=update.lp, **engine)
            with torch.no_grad():
                stats = {name: float(v) for name, v in self.stats(lp_now, inputs).items()}
            stats.update(loss=float(value), zero_std_fraction=zero_std_fraction(batch.rewards, batch.group_size),
                         advantage_abs_mean=float(inputs.advantages.abs().mean()))
            return ObjectiveOutput(loss=value, stats=stats, masks=masks, lp=lp_now)

        return all_or_nothing(model, run)  # the stats too: an interrupt there leaves .grad as before the call

    def reference_lp(self, model, batch: RolloutBatch, masks: MonteCarloMasks, *, micro_batch: int | MicroBatching,
                     ref_model=None) -> torch.Tensor:
        """The reference policy's lp on `masks`, without a graph, as `backward` scores it when given no lp_ref:
        `ref_model`, or for a PEFT model the model with its adapters disabled."""
        with torch.no_grad():
            return self._score_reference(model, ref_model, batch, masks, MicroBatching.of(micro_batch))

    def _score_reference(self, model, ref_model, batch, masks, batching: MicroBatching) -> torch.Tensor:
        if ref_model is not None:
            check_reference_model(model, ref_model)
            return _score(ref_model, batch, masks, batching)
        core = unwrap_model(model)
        if hasattr(core, "disable_adapter"):  # PEFT: the reference is the base model
            with core.disable_adapter():
                return _score(model, batch, masks, batching)
        raise ValueError(f"{self.name} needs a reference policy: {self._reference_hint()}")


def _score(model, batch: RolloutBatch, masks: MonteCarloMasks, batching: MicroBatching) -> torch.Tensor:
    """A policy's lp on the batch's masks without a graph, in the no-grad scoring calls' micro-batches."""
    return score(model, batch.sequences, masks, micro_batch=batching, attention_mask=batch.attention_mask)


def _check_batch(batch) -> None:
    if not isinstance(batch, RolloutBatch):
        raise TypeError(f"batch must be a dllm_fast.RolloutBatch (RolloutBatch.from_generation(result, "
                        f"rewards, group_size=G)), got {type(batch).__name__}.")


# ---------------------------------------------------------------------------------------------------------
# Terms shared by several objectives


def clipped_surrogate(ratio: torch.Tensor, advantage: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """PPO's pessimistic surrogate min(ratio A, clip(ratio, 1 - low, 1 + high) A), elementwise (to maximise)."""
    return torch.minimum(ratio * advantage, ratio.clamp(1.0 - low, 1.0 + high) * advantage)


def clipped(ratio: torch.Tensor, advantage: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Where the clip is active (the surrogate's gradient is zero): ratio above 1 + high with A > 0, or below
    1 - low with A < 0."""
    return ((ratio > 1.0 + high) & (advantage > 0)) | ((ratio < 1.0 - low) & (advantage < 0))


def dual_clipped(gain: torch.Tensor, advantage: torch.Tensor, c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual-clip PPO (Ye et al. 2020; DARE's compute_policy_loss, dllm_core_algos.py L382-454): for A < 0 the
    surrogate (to maximise) is bounded below by c A, so a ratio far above 1 cannot grow the loss without bound.
    Returns the bounded surrogate and where the bound is active."""
    negative = advantage < 0
    floor = c * advantage
    return torch.where(negative, torch.maximum(gain, floor), gain), negative & (gain < floor)


def kl_k3(log_ratio_ref: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(current || ref) from log(p_ref / p): exp(x) - x - 1 >= 0."""
    return torch.expm1(log_ratio_ref) - log_ratio_ref


def safe_exp(x: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """exp(x) where `where`, 1 elsewhere: the unused branch of a torch.where must not overflow (inf * 0 = NaN in
    its gradient)."""
    return torch.exp(torch.where(where, x, torch.zeros((), dtype=x.dtype, device=x.device)))


def check_epsilon(name: str, value: float) -> float:
    return check_float(name, value, minimum=0.0, hint="clip range; 0 pins the ratio's interval to [1, 1]")


def check_dual_clip(value: float | None) -> None:
    """DARE's dual clip: None (off) or a bound above 1 on a negative advantage's ratio term."""
    if value is not None:
        check_float("dual_clip", value, minimum=1.0, open_minimum=True, hint="DARE uses 3; it must exceed 1")


NORMALIZE_PER = ("batch", "micro_batch")


def micro_batch_index(masks: MonteCarloMasks, rows: int | None) -> torch.Tensor:
    """[N] int64: the micro-batch each sequence falls in when the loss batch is cut, in order, into micro-batches
    of `rows` whole sequences; all 0 for None (the whole batch is one micro-batch). The official d1 and SPG code
    and DARE normalise within each device micro-batch and average the micro-batches' losses (gradient
    accumulation, data parallelism); here the rows are the objective's own (`micro_batch_rows`), never the
    engine's memory micro-batch, so that a memory setting never changes the loss."""
    index = torch.arange(masks.num_sequences, device=masks.weight.device)
    return index // rows if rows is not None else torch.zeros_like(index)


def micro_batch_sums(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[N] values -> [N]: the sum over each sequence's micro-batch (`micro_batch_index`)."""
    totals = torch.zeros(int(index.max()) + 1, dtype=values.dtype, device=values.device).index_add(0, index, values)
    return totals[index]


def check_micro_batch_rows(rows: int | None, per_micro_batch: bool, setting: str) -> None:
    """micro_batch_rows (sequences per normalisation micro-batch) is required while `setting` (e.g.
    "normalize_per='micro_batch'") cuts the loss batch: rows taken from the memory micro-batch would let a
    memory setting change the loss."""
    if rows is not None:
        check_int("micro_batch_rows", rows, minimum=1, hint="sequences per normalisation micro-batch")
    elif per_micro_batch:
        raise ValueError(f"{setting} needs micro_batch_rows, the sequences per normalisation micro-batch (e.g. 6, "
                         "one group of d1's recipe): the objective names its own rows, so that the memory "
                         "micro-batch (--micro-batch) never changes the loss. Give micro_batch_rows, or "
                         "normalise over the whole batch (the default).")
