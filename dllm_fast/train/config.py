"""The trainer's configuration: one flat dataclass, loadable from a YAML or JSON file, with command-line overrides.

    python -m dllm_fast train --task sudoku4 --objective espo --model sudoku4 --config run.yaml --lr 1e-4

Precedence: the dataclass defaults, then the file, then `--key value` flags. Every field is a flag (see
`dllm_fast.train.cli`), described by the `help` of its field below; `choices` name the registry a value must come
from.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dllm_fast.validation import check_choice, check_float, check_int

SCHEDULES = ("constant", "cosine", "linear")
PARALLEL = ("ddp", "fsdp2")


def option(default=dataclasses.MISSING, *, help: str, choices: str | tuple | None = None, factory=None,
           metavar: str | None = None, names: str | None = None):
    """A config field with its one-line description; `choices` is a tuple of values or the name of a registry
    (`objectives`, `tasks`, `caches`, `remasking`) that the command line lists; `names`, a registry of names the
    field takes besides other values (`presets`); `metavar` names its value there."""
    metadata = {"help": help, "choices": choices, "metavar": metavar, "names": names}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class TrainConfig:
    # What to train: the embedded default (sudoku4) unless told otherwise.
    task: str = option("sudoku4", help="the task to train on", choices="tasks")
    task_options: dict = option(help="the task's options as JSON, e.g. '{\"train_path\": \"train.jsonl\"}'",
                                factory=dict)
    objective: str = option("espo", help="the RL objective (the one that gained most on the embedded default)",
                            choices="objectives")
    objective_options: dict = option(help="the objective's options as JSON, e.g. '{\"n_t\": 4}'; "
                                          "`--objective NAME --help` lists them", factory=dict)
    model: str = option("sudoku4", help="'sudoku4' (the embedded default), a checkpoint directory, or a preset "
                                        "with random weights", metavar="NAME|DIR", names="presets")
    tokenizer: str | None = option(None, help="tokenizer directory (default: the model's; the embedded one for "
                                              "presets)", metavar="DIR")
    output_dir: str = option("runs/default", help="run directory: metrics.jsonl, config.json, checkpoint/, "
                                                  "curves.png", metavar="DIR")
    seed: int = option(0, help="seeds the data order, rollouts, masks and any random weights")
    device: str = option("auto", help="torch device; auto: cuda when available", metavar="DEVICE")
    threads: int | None = option(None, help="CPU threads (default: torch's)")

    # The loop.
    steps: int = option(300, help="optimisation steps (each: rollouts, then the inner updates)")
    prompts_per_step: int = option(8, help="prompts per step (a multiple of the number of ranks)")
    group_size: int = option(8, help="G: completions per prompt")
    inner_updates: int = option(1, help="mu: optimizer steps per rollout batch")
    micro_batch: int = option(64, help="(sequence, sample) pairs per backward graph; memory scales with it")
    score_micro_batch: int | None = option(None, help="pairs per model call when scoring without a graph "
                                                      "(default: --micro-batch)")
    chunk_size: int | None = option(None, help="vocabulary rows per chunk of the fused LM head (default: by device)")

    # Rollouts (dllm_fast.generate).
    gen_length: int = option(24, help="tokens generated per completion")
    block_length: int = option(24, help="block of semi-autoregressive decoding (divides --gen-length)")
    diffusion_steps: int | None = option(12, help="denoising steps per completion (none: with --threshold)")
    temperature: float = option(1.0, help="rollout sampling temperature (0: greedy)")
    remasking: str = option("low_confidence", help="which positions a step unmasks", choices="remasking")
    cache: str = option("none", help="KV-cache mode of the rollouts (Fast-dLLM)", choices="caches")
    threshold: float | None = option(None, help="confidence threshold of parallel decoding, in (0, 1]")

    # Optimisation.
    lr: float = option(1e-4, help="AdamW learning rate")
    weight_decay: float = option(0.0, help="AdamW weight decay")
    betas: list[float] = option(help="AdamW beta1 beta2", factory=lambda: [0.9, 0.99])
    grad_clip: float = option(1.0, help="gradient-norm clip")
    warmup_steps: int = option(0, help="linear warm-up, in optimizer steps")
    schedule: str = option("constant", help="learning-rate schedule after the warm-up", choices=SCHEDULES)

    # Setups.
    lora: bool = option(False, help="train LoRA adapters (PEFT); the reference is the model without them")
    lora_rank: int = option(16, help="LoRA rank")
    lora_alpha: int = option(32, help="LoRA alpha")
    lora_dropout: float = option(0.0, help="LoRA dropout, in [0, 1)")
    lora_targets: list[str] | None = option(None, help="module names to adapt (default: every one the model "
                                                       "family allows)", metavar="MODULE")
    gradient_checkpointing: bool = option(False, help="recompute each block in backward")
    bf16: bool | None = option(None, help="autocast to bf16 (default: on CUDA, not on CPU)")
    parallel: str = option("ddp", help="under torchrun: ddp, or fsdp2 (full fine-tunes; sharded weights)",
                           choices=PARALLEL)

    # State and reporting.
    checkpoint_every: int = option(50, help="steps between checkpoints (and the last step)")
    resume: bool = option(False, help="continue from --output-dir's checkpoint")
    overwrite: bool = option(False, help="start afresh in an --output-dir that holds another run's checkpoint")
    eval_every: int = option(100, help="steps between greedy evaluations (and the last step)")
    eval_gen_lengths: list[int] = option(help="generation lengths to evaluate at", factory=lambda: [24])
    eval_examples: int | None = option(None, help="test examples to evaluate on (default: the whole test split)")
    eval_batch_size: int = option(256, help="prompts per evaluation batch")
    plot: bool = option(True, help="write curves.png at the end")
    progress: bool = option(True, help="show a progress bar")

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "group_size", "inner_updates", "micro_batch", "gen_length",
                     "block_length", "checkpoint_every", "eval_every", "eval_batch_size", "lora_rank",
                     "lora_alpha"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("score_micro_batch", "chunk_size"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum=1)
        check_int("seed", self.seed, minimum=0)
        check_int("warmup_steps", self.warmup_steps, minimum=0)
        for name in ("lr", "grad_clip"):
            check_float(name, getattr(self, name), minimum=0.0, open_minimum=True)
        check_float("weight_decay", self.weight_decay, minimum=0.0)
        check_float("temperature", self.temperature, minimum=0.0)
        check_float("lora_dropout", self.lora_dropout, minimum=0.0, maximum=1.0, open_maximum=True)
        check_choice("schedule", self.schedule, SCHEDULES)
        check_choice("parallel", self.parallel, PARALLEL)
        if self.parallel == "fsdp2" and self.lora:
            raise ValueError("parallel='fsdp2' shards a full fine-tune; with lora=true use parallel='ddp'.")
        if len(self.betas) != 2:
            raise ValueError(f"betas={self.betas!r} must be two numbers (AdamW's beta1, beta2).")
        if not self.eval_gen_lengths:
            raise ValueError("eval_gen_lengths must list at least one generation length.")

    # -- loading --------------------------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> "TrainConfig":
        """Load a YAML (.yaml/.yml) or JSON file of field values, then apply `overrides`."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist.")
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            values = yaml.safe_load(text) or {}
        elif path.suffix == ".json":
            values = json.loads(text)
        else:
            raise ValueError(f"config file {path} must end in .yaml, .yml or .json.")
        if not isinstance(values, dict):
            raise ValueError(f"config file {path} must hold a mapping of field names to values, got "
                             f"{type(values).__name__}.")
        return cls.from_dict({**values, **overrides})

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown training option(s) {unknown}; the options are {sorted(names)}.")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def flag(name: str) -> str:
    """A field's command-line flag: inner_updates -> --inner-updates."""
    return "--" + name.replace("_", "-")


# The registries a field's `choices` may name; imported when asked (they need torch).
def registry_choices(name: str) -> tuple[str, ...]:
    if name == "objectives":
        from dllm_fast import objectives

        return tuple(objectives.available())
    if name == "tasks":
        from dllm_fast.tasks import available_tasks

        return tuple(available_tasks())
    if name == "caches":
        from dllm_fast.rollout.cache import CACHE_POLICIES

        return tuple(CACHE_POLICIES)
    if name == "remasking":
        from dllm_fast.rollout.remasking import REMASKING

        return tuple(REMASKING)
    if name == "presets":
        from dllm_fast.models.loading import PRESETS

        return tuple(PRESETS)
    raise KeyError(f"no registry named {name!r}")


def field_choices(config_field: dataclasses.Field) -> tuple | None:
    """The values a field may take, when they are a fixed set (its own tuple or a registry's names)."""
    choices = config_field.metadata.get("choices")
    return registry_choices(choices) if isinstance(choices, str) else choices
