"""The trainer's configuration: one flat dataclass, loadable from a YAML or JSON file, with command-line overrides.

    python -m dllm_fast train --task sudoku4 --objective espo --model sudoku4 --config run.yaml --lr 1e-4

Precedence: the dataclass defaults, then the file, then `--key value` flags. Every field is a flag (see
`dllm_fast.train.cli`), described by the `help` of its field below; `choices` name the registry a value must come
from.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dllm_fast.contracts import MAX_PAIRS
from dllm_fast.train.typed import check_type
from dllm_fast.validation import check_float, check_int

SCHEDULES = ("constant", "cosine", "linear")
PARALLEL = ("ddp", "fsdp2")
# A setting the run decides for its device: `--compile auto`, `--micro-batch auto`.
AUTO = "auto"
Auto = Literal["auto"]
# --micro-batch auto on CPU, and the micro-batch a planner fit starts from.
DEFAULT_MICRO_BATCH = 64


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
                                        "with random weights (the tokenizer's vocabulary and special ids)",
                        metavar="NAME|DIR", names="presets")
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
    micro_batch: int | Auto = option(AUTO, help="(sequence, sample) pairs per backward graph; memory scales with "
                                              "it. auto: on CUDA the largest the planner fits in 90% of the free "
                                              f"memory (see dllm_fast.train.micro_batch), on CPU {DEFAULT_MICRO_BATCH}",
                                     metavar="N|auto")
    score_micro_batch: int | None = option(None, help="pairs per model call when scoring without a graph "
                                                      "(default: --micro-batch)")
    chunk_size: int | None = option(None, help="vocabulary rows per chunk of the fused LM head (default: by device)")

    # Rollouts (dllm_fast.generate).
    gen_length: int = option(24, help="tokens generated per completion")
    block_length: int = option(24, help="block of semi-autoregressive decoding (divides --gen-length); for a "
                                        "block-diffusion model its attention block: a preset takes it, a "
                                        "checkpoint's own must match")
    diffusion_steps: int | None = option(12, help="denoising steps per completion (none: with --threshold; both: "
                                                  "SDAR's dynamic rule on block-diffusion models)")
    temperature: float = option(1.0, help="rollout sampling temperature (0: greedy)")
    remasking: str = option("low_confidence", help="which positions a step unmasks", choices="remasking")
    cache: str = option("none", help="KV-cache mode of the rollouts (Fast-dLLM)", choices="caches")
    threshold: float | None = option(None, help="confidence threshold of parallel decoding, in (0, 1]")
    compile: bool | Auto = option(AUTO, help="true: compile each denoising step of the rollouts (torch.compile; "
                                             "CUDA graphs on GPU) and each scoring micro-batch whole; the first "
                                             "ones compile (metrics: compile_seconds). auto: the rollouts on CUDA, "
                                             "where CUDA graphs pay, nothing on CPU",
                                  metavar="true|false|auto")

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
        """Every field's type, then its range and its consistency with the others; errors name the flag."""
        for name, value in vars(self).items():
            setattr(self, name, _typed(name, value, flag(name)))
        for name in ("steps", "prompts_per_step", "group_size", "inner_updates", "gen_length",
                     "block_length", "checkpoint_every", "eval_every", "eval_batch_size", "lora_rank",
                     "lora_alpha"):
            check_int(flag(name), getattr(self, name), minimum=1)
        if self.micro_batch != AUTO:
            check_int("--micro-batch", self.micro_batch, minimum=1, hint="or auto")
        for name in ("score_micro_batch", "chunk_size", "threads", "eval_examples", "diffusion_steps"):
            if getattr(self, name) is not None:
                check_int(flag(name), getattr(self, name), minimum=1)
        check_int("--seed", self.seed, minimum=0, maximum=MAX_SEED)
        check_int("--warmup-steps", self.warmup_steps, minimum=0)
        check_float("--lr", self.lr, minimum=0.0, maximum=1.0, open_minimum=True,
                    hint="AdamW's learning rates lie around 1e-6 to 1e-3")
        check_float("--grad-clip", self.grad_clip, minimum=0.0, open_minimum=True)
        check_float("--weight-decay", self.weight_decay, minimum=0.0)
        if self.lr * self.weight_decay >= 1.0:
            raise ValueError(f"--lr {self.lr} x --weight-decay {self.weight_decay} = {self.lr * self.weight_decay:g}: "
                             "AdamW multiplies the weights by 1 - lr x weight_decay at every step, which must stay "
                             "positive; lower --weight-decay (e.g. 0.01 to 0.1).")
        check_float("--temperature", self.temperature, minimum=0.0, hint="0 is greedy")
        check_float("--lora-dropout", self.lora_dropout, minimum=0.0, maximum=1.0, open_maximum=True)
        if self.threshold is not None:
            check_float("--threshold", self.threshold, minimum=0.0, maximum=1.0, open_minimum=True)
        if len(self.betas) != 2:
            raise ValueError(f"--betas {' '.join(map(str, self.betas))} must be two numbers (AdamW's beta1 beta2).")
        for beta in self.betas:
            check_float("--betas", beta, minimum=0.0, maximum=1.0, open_maximum=True)
        if not self.eval_gen_lengths:
            raise ValueError("--eval-gen-lengths must list at least one generation length.")
        for length in self.eval_gen_lengths:
            check_int("--eval-gen-lengths", length, minimum=1)
        if not self.output_dir.strip():
            raise ValueError("--output-dir is empty; name the run directory (e.g. runs/default).")
        for name in ("schedule", "parallel", "objective", "task", "cache", "remasking"):
            choices = field_choices(_FIELDS[name])
            if getattr(self, name) not in choices:
                raise ValueError(f"{flag(name)} {getattr(self, name)!r} is not one of {', '.join(choices)}.")
        self._check_consistency()
        self._check_setup()

    def _check_setup(self) -> None:
        """The objective and the task with their options, the model and the tokenizer: built or found without
        loading any weight, so that a wrong name fails before anything runs."""
        from dllm_fast import objectives
        from dllm_fast.tasks import get_task

        with _prefixed("--objective-options"):
            objective = objectives.get(self.objective, **self.objective_options)
        samples = self.prompts_per_step * self.group_size * objective.config.n_t
        if samples > MAX_PAIRS:  # the library's own bound (sample_masks refuses more)
            raise ValueError(f"--prompts-per-step {self.prompts_per_step} x --group-size {self.group_size} x "
                             f"{self.objective}'s n_t {objective.config.n_t} = {samples} Monte Carlo samples per "
                             f"update, more than {MAX_PAIRS} (2^20); lower n_t (--objective-options "
                             "'{\"n_t\": 4}') or the rollouts per step.")
        with _prefixed("--task-options"):
            get_task(self.task, **task_options(self))
        from dllm_fast.train.sources import check_device, model_source

        model_source(self)
        check_device(self.device)
        if self.lora and importlib.util.find_spec("peft") is None:
            raise ValueError("--lora true needs the peft package, which is missing here; install it with "
                             "`pip install peft` (dllm_fast depends on it: `pip install -e .` installs it).")

    def _check_consistency(self) -> None:
        if self.parallel == "fsdp2" and self.lora:
            raise ValueError("--parallel fsdp2 shards a full fine-tune; with --lora true use --parallel ddp.")
        if self.resume and self.overwrite:
            raise ValueError("--resume true continues the run in --output-dir and --overwrite true replaces it; "
                             "give one of them.")
        if self.gen_length % self.block_length:
            raise ValueError(f"--gen-length {self.gen_length} is not a multiple of --block-length "
                             f"{self.block_length}; choose a block length that divides it.")
        blocks = self.gen_length // self.block_length
        from dllm_fast.train.sources import block_diffusion_model

        if self.threshold is not None and self.diffusion_steps is not None and not block_diffusion_model(self):
            raise ValueError(f"--threshold {self.threshold} sets the steps adaptively; pass --diffusion-steps none "
                             "with it (or drop --threshold for a fixed schedule; both together are SDAR's dynamic "
                             "rule, for block-diffusion models).")
        if self.threshold is None and self.diffusion_steps is None:
            raise ValueError("--diffusion-steps none needs --threshold (adaptive steps); give one of them.")
        if self.diffusion_steps is not None:
            if self.diffusion_steps % blocks:
                raise ValueError(f"--diffusion-steps {self.diffusion_steps} is not a multiple of the {blocks} "
                                 "blocks (--gen-length / --block-length); use e.g. --diffusion-steps "
                                 f"{blocks * max(1, self.diffusion_steps // blocks)}.")
            if self.diffusion_steps > self.gen_length:
                raise ValueError(f"--diffusion-steps {self.diffusion_steps} exceeds --gen-length {self.gen_length}: "
                                 "a step unmasks at least one token, so steps beyond the completion's length run no "
                                 f"model call; use at most {self.gen_length}.")
        rollouts = self.prompts_per_step * self.group_size
        if rollouts > MAX_ROLLOUTS_PER_STEP:
            raise ValueError(f"--prompts-per-step {self.prompts_per_step} x --group-size {self.group_size} = "
                             f"{rollouts} rollouts per step, more than {MAX_ROLLOUTS_PER_STEP} (2^20); lower them.")
        if self.inner_updates > MAX_INNER_UPDATES:
            raise ValueError(f"--inner-updates {self.inner_updates} is more than {MAX_INNER_UPDATES} optimizer steps "
                             "per rollout batch (papers use 1-12); lower it.")

    # -- loading --------------------------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> "TrainConfig":
        """Load a YAML (.yaml/.yml) or JSON file of field values, then apply `overrides`. Every value of the file
        is checked for its field's type, naming the file and the key."""
        values = read_config_file(path)
        return cls.from_dict({**values, **overrides})

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TrainConfig":
        unknown = sorted(set(values) - set(_FIELDS))
        if unknown:
            close = difflib.get_close_matches(unknown[0], list(_FIELDS), n=1)
            raise ValueError(f"unknown training option(s) {unknown}"
                             f"{f' (did you mean {close[0]}?)' if close else ''}; the options are {sorted(_FIELDS)}.")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def generate_config(self, device_type: str):
        """The rollouts' settings as one GenerateConfig, for a run on `device_type` (which --compile auto needs):
        what the trainer, its evaluation, the planner and the TRL rollout function decode with."""
        from dllm_fast.rollout.config import GenerateConfig

        return GenerateConfig(gen_length=self.gen_length, block_length=self.block_length,
                              steps=self.diffusion_steps, temperature=self.temperature, remasking=self.remasking,
                              cache=self.cache, threshold=self.threshold,
                              compile=compiles_rollouts(self, device_type))


def flag(name: str) -> str:
    """A field's command-line flag: inner_updates -> --inner-updates."""
    return "--" + name.replace("_", "-")


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_HINTS = typing.get_type_hints(TrainConfig)
# Sizes beyond these are mistakes, not runs: refused at once instead of minutes of silence.
MAX_ROLLOUTS_PER_STEP = 2**20
MAX_INNER_UPDATES = 2**10
MAX_SEED = 2**63 - 1
_EXAMPLES = {"betas": "[0.9, 0.99]", "eval_gen_lengths": "[24, 48]", "lora_targets": "[q_proj, v_proj]"}


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The field values of a YAML or JSON config file, each checked for its field's type (the message names the
    file and the key)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist.")
    if path.suffix not in (".yaml", ".yml", ".json"):
        raise ValueError(f"config file {path} must end in .yaml, .yml or .json.")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"config file {path} has {path.stat().st_size} bytes; a training config is a few KB (at "
                         f"most {MAX_CONFIG_BYTES}). Check that --config names the right file.")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"config file {path} is not UTF-8 text ({error}).") from None
    if path.suffix == ".json":
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"config file {path} is not valid JSON: {error}.") from None
    else:
        import yaml

        try:
            values = yaml.load(text, Loader=_config_loader())
        except yaml.YAMLError as error:
            raise ValueError(f"config file {path} is not valid YAML: {' '.join(str(error).split())}") from None
        values = {} if values is None else values
    if not isinstance(values, dict):
        raise ValueError(f"config file {path} must hold a mapping of option names to values, got a "
                         f"{type(values).__name__}.")
    unknown = sorted(str(k) for k in values if k not in _FIELDS)
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(_FIELDS), n=1)
        raise ValueError(f"config file {path}: unknown option(s) {unknown}"
                         f"{f' (did you mean {close[0]}?)' if close else ''}; the options are {sorted(_FIELDS)}.")
    return {key: _typed(key, value, f"{path}: {key}", from_file=True) for key, value in values.items()}


MAX_CONFIG_BYTES = 2**20


def _config_loader():
    """YAML's safe loader without aliases: `*name` can repeat a node exponentially (a "billion laughs" file that
    takes minutes and gigabytes to expand), and a config file has no use for it."""
    import yaml

    class ConfigLoader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed in a dllm_fast "
                                                  "config; write the value out", self.peek_event().start_mark)
            return super().compose_node(parent, index)

    return ConfigLoader


def _typed(name: str, value: Any, where: str, *, from_file: bool = False) -> Any:
    return check_type(_HINTS[name], value, where, from_file=from_file, example=_EXAMPLES.get(name, ""))


# The registries a field's `choices` may name; imported when asked (they need torch).
def registry_choices(name: str) -> tuple[str, ...]:
    if name == "objectives":
        from dllm_fast import objectives

        return tuple(objectives.available())
    if name == "tasks":
        from dllm_fast.tasks import available_tasks

        return tuple(available_tasks())
    if name == "caches":
        from dllm_fast.rollout.cache import BLOCK_CACHE_POLICIES, CACHE_POLICIES

        return tuple(CACHE_POLICIES) + tuple(BLOCK_CACHE_POLICIES)
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


# -- what the names of a config mean ----------------------------------------------------------------------------
def task_options(config: TrainConfig) -> dict[str, Any]:
    """--task-options, and for the embedded model on its own task the prompt style it was trained on."""
    options = dict(config.task_options)
    if config.task == "sudoku4" and config.model == "sudoku4":
        from dllm_fast.assets import SUDOKU4_TASK_OPTIONS

        options = {**SUDOKU4_TASK_OPTIONS, **options}
    return options


class _prefixed:
    """Re-raise a ValueError, TypeError or FileNotFoundError of the block with the flag its value came from."""

    def __init__(self, option: str):
        self.option = option

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if isinstance(error, (ValueError, TypeError, FileNotFoundError)):
            raise type(error)(f"{self.option}: {error}") from None
        return False


def compiles_rollouts(config: TrainConfig, device_type: str) -> bool:
    """Whether the rollouts run through the compiled denoising step: --compile true, or auto on CUDA (CUDA graphs
    replay a step without the host's per-kernel dispatch: 3.07x on dual-cache rollouts of the `small` preset on an
    H200; on CPU there is no launch overhead to save and compiling costs seconds)."""
    return config.compile is True or (config.compile == AUTO and device_type == "cuda")


def compiles_scoring(config: TrainConfig) -> bool:
    """Whether scoring micro-batches compile: --compile true only (auto leaves them eager: their graphs, padded
    to buckets, were not measured to pay on a GPU, and refuse active LoRA dropout)."""
    return config.compile is True


def micro_batching(config: TrainConfig, *, auto: int):
    """--micro-batch, --score-micro-batch, --chunk-size and the scoring half of --compile, packed once into the
    `MicroBatching` that travels unchanged to the engine (the trainer's and the planner's). auto: what
    --micro-batch auto stands for here (the device's fit in train, the default in a plan)."""
    from dllm_fast.likelihood.settings import MicroBatching

    return MicroBatching(auto if config.micro_batch == AUTO else config.micro_batch, config.score_micro_batch,
                         config.chunk_size, compile=compiles_scoring(config))


def check_block_length(config: TrainConfig, model, *, evaluated: bool = True) -> None:
    """A block-diffusion model decodes and scores in its own blocks (contracts.block_length): a checkpoint's
    (config.json block_size, the size it was trained with) must be --block-length; a preset's random weights were
    trained with none, so it takes --block-length (`take_block_length`). Every generation length (with
    `evaluated`, the evaluation's too) is a whole number of blocks."""
    from dllm_fast.contracts import block_length
    from dllm_fast.models.loading import PRESETS

    size = block_length(model)
    if size is None:
        return
    if config.model not in PRESETS and size != config.block_length:
        raise ValueError(f"--block-length {config.block_length}, but --model {config.model} is a block-diffusion "
                         f"model trained with blocks of {size} (its config.json block_size), which its rollouts "
                         f"and likelihoods use; pass --block-length {size}.")
    evaluations = [("--eval-gen-lengths", n) for n in config.eval_gen_lengths] if evaluated else []
    for option, length in [("--gen-length", config.gen_length)] + evaluations:
        if length % config.block_length:
            raise ValueError(f"{option} {length} is not a multiple of --block-length {config.block_length}, the "
                             "block-diffusion model's block: every completion is decoded in whole blocks.")


def take_block_length(config: TrainConfig, model) -> None:
    """A block-diffusion preset (random weights) attends in blocks of --block-length."""
    from dllm_fast.contracts import block_length
    from dllm_fast.models.loading import PRESETS

    if block_length(model) is not None and config.model in PRESETS:
        model.block_length = config.block_length
