"""MaskSpec: the settings of the Monte Carlo masks as one object (which sampler, how many samples, which positions
count, and each sampler's own settings).

    spec = MaskSpec(sampler="complementary", n_t=4, count="all").validate()
    masks = sample_masks(sequences, spec, prompt_length=P, generator=g)
    spec.valid_n_t(5)                       # 6: the nearest n_t at or above 5 that these settings accept

An objective's config embeds one (`ObjectiveConfig.masks`). Which n_t a sampler accepts is its registered
`NTRule` (samplers.py), so `validate` and `valid_n_t` are arithmetic on the settings, written once per sampler.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dllm_fast.likelihood.samplers import COUNT_MODES, SAMPLERS, NTRule
from dllm_fast.validation import check_bool, check_choice, check_float, check_int


@dataclass(frozen=True)
class MaskSpec:
    """The mask settings. A field's `metadata["help"]` is its line in `train --objective NAME --help`.

    n_t: Monte Carlo masks per sequence (a sampler may restrict it: `n_t_rule`). count: which completion
    positions count ("eos": through the first EOS; "all": every position). block_length, perturb_prob: the
    "block" and "mean_field" samplers' settings ("block_elbo" takes the model's block length); quadrature_points
    the "gauss" sampler's; coupled_t_min and coupled_t_max the "coupled" sampler's; shrink the "trajectory"
    sampler's (whose samples are the rollout's decoding states: n_t stays 1).
    """

    n_t: int = field(default=1, metadata={"help": "Monte Carlo masks per sequence"})
    sampler: str = field(default="stratified_l", metadata={"help": "mask sampler: " + ", ".join(SAMPLERS)})
    count: str = field(default="eos", metadata={"help": "completion positions that count: eos (through the "
                                                         "first EOS) or all"})
    block_length: int = field(default=32, metadata={"help": "block size of the block sampler (block_elbo takes "
                                                            "the model's)"})
    perturb_prob: float = field(default=0.15, metadata={"help": "probability of masking a prompt token (block, "
                                                                "mean_field) or an earlier block's (block)"})
    quadrature_points: int | None = field(default=None, metadata={
        "help": "Gauss-Legendre nodes of the gauss sampler (default n_t: one mask per node)"})
    coupled_t_min: float = field(default=0.2, metadata={"help": "lowest masking rate of the coupled sampler's pairs"})
    coupled_t_max: float = field(default=0.8, metadata={"help": "highest masking rate of the coupled sampler's "
                                                                 "pairs"})
    shrink: int = field(default=1, metadata={"help": "decoding steps merged per state of the trajectory sampler"})

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def of(cls, spec: MaskSpec | None = None, **settings: Any) -> MaskSpec:
        """A validated MaskSpec: `spec`, or one from `sample_masks`' keyword settings (sampler and n_t required;
        t_range=(low, high) for the coupled rates; n_t=None for "trajectory" and "autoregressive", whose samples
        follow from the sequences)."""
        if spec is not None:
            if settings:
                raise TypeError(f"give the mask settings as a MaskSpec or as keywords, not both (got spec and "
                                f"{', '.join(sorted(settings))}).")
            if not isinstance(spec, MaskSpec):
                raise TypeError(f"spec must be a MaskSpec, got {type(spec).__name__}.")
            return spec.validate()
        if "sampler" not in settings or "n_t" not in settings:
            raise TypeError("give the mask settings: a MaskSpec, or sampler= and n_t= (and the sampler's own).")
        if "t_range" in settings:
            t_range = settings.pop("t_range")
            if isinstance(t_range, (str, bytes, dict)) or not isinstance(t_range, (tuple, list)) or len(t_range) != 2:
                raise ValueError(f"t_range={t_range!r} must be two masking rates (low, high), e.g. t_range=(0.2, 0.8) "
                                 "(DiffuCoder's).")
            settings.update(coupled_t_min=t_range[0], coupled_t_max=t_range[1])
        sampler = SAMPLERS.get(settings["sampler"]) if isinstance(settings["sampler"], str) else None
        if sampler is not None and sampler.data_n_t:
            if settings["n_t"] is not None:
                what = ("the rollout's decoding states (set shrink)" if sampler.name == "trajectory"
                        else "determined by the sequences")
                raise ValueError(f"n_t={settings['n_t']!r} does not apply to sampler={sampler.name!r}: its samples "
                                 f"are {what}; pass n_t=None.")
            settings["n_t"] = 1
        unknown = sorted(set(settings) - set(cls.names()))
        if unknown:
            raise TypeError(f"unknown mask setting {', '.join(map(repr, unknown))}; the settings are "
                            f"{', '.join(cls.names())} (and t_range).")
        return cls(**settings).validate()

    def replace(self, **changes: Any) -> MaskSpec:
        """A copy with `changes`, validated."""
        return dataclasses.replace(self, **changes).validate()

    @property
    def t_range(self) -> tuple[float, float]:
        return self.coupled_t_min, self.coupled_t_max

    def n_t_rule(self) -> NTRule:
        """Which n_t the sampler accepts with these settings (its registered rule)."""
        return SAMPLERS[self.sampler].n_t_rule(self)

    def validate(self) -> MaskSpec:
        """Raise on any setting out of range, naming it; return self."""
        self.check_settings()
        check_int("n_t", self.n_t, minimum=1, hint="Monte Carlo masks per sequence")
        rule = self.n_t_rule()
        if not rule.accepts(self.n_t):
            raise ValueError(rule.message.format(n_t=self.n_t))
        return self

    def check_settings(self) -> None:
        """Every setting but n_t (which `valid_n_t` searches)."""
        check_choice("sampler", self.sampler, SAMPLERS)
        check_choice("count", self.count, COUNT_MODES)
        check_int("block_length", self.block_length, minimum=1, hint="the block sampler's block size")
        check_float("perturb_prob", self.perturb_prob, minimum=0.0, maximum=1.0,
                    hint="a probability, e.g. 0.15 (d1's); True or False are not probabilities")
        check_int("shrink", self.shrink, minimum=1, hint="decoding steps merged per state; TraceRL uses 8 for "
                                                         "LLaDA, 1 for block models")
        if self.quadrature_points is not None:
            check_int("quadrature_points", self.quadrature_points, minimum=1, hint="Gauss-Legendre nodes")
        check_float("coupled_t_min", self.coupled_t_min)
        check_float("coupled_t_max", self.coupled_t_max)
        if not 0.0 < self.coupled_t_min <= self.coupled_t_max < 1.0:
            raise ValueError(f"coupled_t_min={self.coupled_t_min}, coupled_t_max={self.coupled_t_max} must satisfy "
                             "0 < min <= max < 1 (the coupled pairs' masking rates; DiffuCoder uses 0.2 and 0.8).")

    def valid_n_t(self, n_t: int | None = None, *, down: bool = False, limit: int = 1 << 16) -> int | None:
        """The n_t nearest `n_t` (default: this spec's) that these settings accept: at or above it and at most
        `limit`, or at or below it with down=True (from max(1, n_t)); None when there is none. Arithmetic on the
        sampler's rule (complementary pairs: even; the full mask plus pairs: odd; gauss: a multiple of
        quadrature_points; trajectory: 1)."""
        self.check_settings()
        if n_t is not None:
            check_int("n_t", n_t, hint="Monte Carlo masks per sequence; the search starts from max(1, n_t)")
        check_bool("down", down)
        check_int("limit", limit, minimum=1, hint="the largest n_t searched")
        return self.n_t_rule().nearest(self.n_t if n_t is None else n_t, down=down, limit=limit)
