"""The trainer's configuration: one flat dataclass, loadable from a YAML or JSON file, with command-line overrides.

    python -m dllm_fast train --task sudoku4 --objective espo --model sudoku4 --config run.yaml --lr 1e-4

Precedence: the dataclass defaults, then the file, then `--key value` flags. Every field is a flag
(`--inner-updates` or `--inner_updates`); dict fields take JSON (`--objective-options '{"beta": 1.5}'`), list fields
one or more values (`--eval-gen-lengths 24 48`), booleans true/false.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dllm_fast.validation import check_choice, check_float, check_int

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out")
SCHEDULES = ("constant", "cosine", "linear")
PARALLEL = ("ddp", "fsdp2")


@dataclass
class TrainConfig:
    # What to train: the embedded default (sudoku4) unless told otherwise.
    task: str = "sudoku4"
    task_options: dict = field(default_factory=dict)
    objective: str = "espo"      # the objective that gained most on the embedded default (benchmarks/RESULTS.md)
    objective_options: dict = field(default_factory=dict)
    model: str = "sudoku4"          # "sudoku4" (embedded), a checkpoint directory, or a preset (tiny, small, llada-8b)
    tokenizer: str | None = None    # default: the model's directory (the embedded tokenizer for presets)
    output_dir: str = "runs/default"
    seed: int = 0
    device: str = "auto"            # auto: cuda when available
    threads: int | None = None      # CPU threads (None: torch's default)

    # The loop.
    steps: int = 300
    prompts_per_step: int = 8
    group_size: int = 8             # G completions per prompt
    inner_updates: int = 1          # mu: optimizer steps per rollout batch
    micro_batch: int = 64           # (sequence, sample) pairs per backward graph

    # Rollouts (dllm_fast.generate).
    gen_length: int = 24
    block_length: int = 24
    diffusion_steps: int | None = 12
    temperature: float = 1.0
    remasking: str = "low_confidence"
    cache: str = "none"
    threshold: float | None = None

    # Optimisation.
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.99])
    grad_clip: float = 1.0
    warmup_steps: int = 0
    schedule: str = "constant"

    # Setups.
    lora: bool = False
    lora_rank: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_targets: list = field(default_factory=lambda: list(LORA_TARGETS))
    gradient_checkpointing: bool = False
    bf16: bool | None = None        # None: autocast to bf16 on CUDA, fp32 on CPU
    parallel: str = "ddp"           # under torchrun: "ddp", or "fsdp2" (full fine-tunes; sharded weights)

    # State and reporting.
    checkpoint_every: int = 50
    resume: bool = False            # continue from output_dir's checkpoint
    overwrite: bool = False         # start afresh in an output_dir that holds another run's checkpoint
    eval_every: int = 100
    eval_gen_lengths: list = field(default_factory=lambda: [24])
    eval_examples: int | None = None  # None: the whole test split
    eval_batch_size: int = 256
    plot: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "group_size", "inner_updates", "micro_batch", "gen_length",
                     "block_length", "checkpoint_every", "eval_every", "eval_batch_size", "lora_rank",
                     "lora_alpha"):
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
        unknown = sorted(set(self.lora_targets) - set(LORA_TARGETS))
        if unknown:
            raise ValueError(f"lora_targets holds {unknown}; LLaDA's adaptable modules are {list(LORA_TARGETS)}.")

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


def parse_overrides(arguments: list[str]) -> dict[str, Any]:
    """`["--lr", "1e-4", "--lora", "true", "--eval-gen-lengths", "24", "48"]` -> typed field values."""
    hints = typing.get_type_hints(TrainConfig)
    values: dict[str, Any] = {}
    index = 0
    while index < len(arguments):
        flag = arguments[index]
        if not flag.startswith("--"):
            raise ValueError(f"expected an option such as --lr, got {flag!r}.")
        name = flag[2:].replace("-", "_")
        if name not in hints:
            raise ValueError(f"unknown training option {flag}; the options are "
                             f"{sorted('--' + n.replace('_', '-') for n in hints)}.")
        index += 1
        raw = []
        while index < len(arguments) and not arguments[index].startswith("--"):
            raw.append(arguments[index])
            index += 1
        values[name] = _convert(name, hints[name], raw)
    return values


def _convert(name: str, hint, raw: list[str]) -> Any:
    origin = typing.get_origin(hint)
    options = typing.get_args(hint)
    if hint is list or origin is list:
        if not raw:
            raise ValueError(f"--{name} needs at least one value.")
        return [_scalar(name, value) for value in raw]
    if len(raw) != 1:
        raise ValueError(f"--{name} takes one value, got {raw}.")
    value = raw[0]
    if hint is dict or origin is dict:
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"--{name} takes a JSON object, e.g. '{{\"beta\": 1.5}}'; got {value!r} ({error}).")
        if not isinstance(parsed, dict):
            raise ValueError(f"--{name} takes a JSON object, got {value!r}.")
        return parsed
    if value.lower() in ("none", "null") and type(None) in options:
        return None
    base = next((t for t in (bool, int, float, str) if t is hint or t in options), str)
    if base is bool:
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"--{name} takes true or false, got {value!r}.")
        return value.lower() in ("true", "1", "yes")
    try:
        return base(value)
    except ValueError:
        raise ValueError(f"--{name} takes {'an integer' if base is int else 'a number'}, got {value!r}.") from None


def _scalar(name: str, value: str):
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            continue
    return value
