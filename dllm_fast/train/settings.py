"""The trainer's settings by role, as verl nests its configuration: `RunSettings` (what runs, where, for how long),
`ModelSettings`, `RolloutSettings` (the fields of dllm_fast.rollout's GenerateConfig), `ObjectiveSettings`,
`OptimSettings`, `LoraSettings` and `EvalSettings`. TrainConfig (config.py) holds one of each.

Every field is also a flat option, the name its command-line flag, a flat config file and `TrainConfig(lr=...)`
spell it: a field's own name, or the `key` its `option` names where the section alone would not say what it is
(`lora.rank` is `lora_rank`, `--lora-rank`). `OPTIONS` maps each flat key to its section and field, in --help
order. Each section checks its own values (types, ranges, its fields together) when built, and its messages name
the flags; what needs several sections or the model is TrainConfig's to check.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from dllm_fast.train.typed import read_value
from dllm_fast.validation import check_float, check_int, nearest_multiples

SCHEDULES = ("constant", "cosine", "linear")
PARALLEL = ("ddp", "fsdp2")
ROLLOUT_WEIGHTS = ("auto", "gathered", "sharded")  # train/rollout_weights.py
# A setting the run decides for its device: `--compile auto`, `--micro-batch auto`.
AUTO = "auto"
Auto = Literal["auto"]
# --micro-batch auto on CPU, and the micro-batch a planner fit starts from.
DEFAULT_MICRO_BATCH = 64
# Sizes beyond these are mistakes, not runs: refused at once instead of minutes of silence.
MAX_ROLLOUTS_PER_STEP = 2**20
MAX_INNER_UPDATES = 2**10
MAX_SEED = 2**63 - 1


def option(default=dataclasses.MISSING, *, help: str, key: str | None = None, choices: str | tuple | None = None,
           factory=None, metavar: str | None = None, names: str | None = None, example: str = ""):
    """A settings field with its one-line description. `key`: its flat name (flag, flat file key, keyword of
    TrainConfig) when it is not the field's own; `choices`, a tuple of values or the name of a registry
    (`objectives`, `tasks`, `caches`, `remasking`) that the command line lists; `names`, a registry of names the
    field takes besides other values (`presets`); `metavar` names its value there; `example`, a value as a file
    writes it, for the message of a wrong one."""
    metadata = {"help": help, "key": key, "choices": choices, "metavar": metavar, "names": names, "example": example}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def flag(key: str) -> str:
    """A flat option's command-line flag: inner_updates -> --inner-updates."""
    return "--" + key.replace("_", "-")


class _Settings:
    """A section: each field read as its type by the one reader of every setting (typed.read_value: a value that is
    not of the type reads from its text as its flag would; a path becomes its string), then its own `check`."""

    def __post_init__(self) -> None:
        for config_field in dataclasses.fields(self):
            key = config_field.metadata.get("key") or config_field.name
            value = read_value(_hints(type(self))[config_field.name], getattr(self, config_field.name), flag(key),
                               example=config_field.metadata.get("example", ""))
            object.__setattr__(self, config_field.name, value)
        self.check()

    def check(self) -> None:
        """The section's ranges and the consistency of its fields; errors name the flags."""


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@dataclass
class RunSettings(_Settings):
    """What runs, where and for how long: the task, the step's size, the device, the run directory and its
    checkpoints, and the reporting."""

    task: str = option("sudoku4", help="the task to train on", choices="tasks")
    task_options: dict = option(help="the task's options as JSON, e.g. '{\"train_path\": \"train.jsonl\"}'",
                                factory=dict)
    output_dir: str = option("runs/default", help="run directory: metrics.jsonl, config.json, checkpoint/, "
                                                  "curves.png", metavar="DIR")
    seed: int = option(0, help="seeds the data order, rollouts, masks and any random weights")
    device: str = option("auto", help="torch device; auto: cuda when available", metavar="DEVICE")
    threads: int | None = option(None, help="CPU threads (default: torch's)")
    parallel: str = option("ddp", help="under torchrun: ddp (whole replicas), or fsdp2 (sharded weights, LoRA's frozen base too)",
                           choices=PARALLEL)
    expert_parallel: int = option(1, help="under torchrun, LLaDA2: ranks an expert group spans; each holds "
                                          "num_experts / N of every MoE layer's routed experts, and tokens move to "
                                          "them by all-to-all (train/expert_parallel.py; default: 1, none)",
                                  metavar="N")
    rollout_weights: str = option("auto", help="under --parallel fsdp2, what rollouts run on: gathered (a plain copy "
                                               "of the weights gathered once a step), sharded (FSDP2's per-layer "
                                               "gathers at every forward), or auto (gathered when it fits beside "
                                               "the rollout, train/rollout_weights.py)", choices=ROLLOUT_WEIGHTS)
    fsdp_offload: bool = option(False, help="under --parallel fsdp2: FSDP2's CPUOffloadPolicy on the policy (and "
                                            "the reference copy): shards, gradients and AdamW state in host memory, "
                                            "each unit copied to the GPU when gathered, AdamW stepping on the host")
    reference_offload: bool = option(False, help="under --parallel fsdp2, a full fine-tune's reference copy: its "
                                                 "shards in host memory (CPUOffloadPolicy), copied to the GPU at each "
                                                 "forward (with LoRA the reference is the policy's base: refused)")
    steps: int = option(300, help="optimisation steps (each: rollouts, then the inner updates)")
    prompts_per_step: int = option(8, help="prompts per step (a multiple of the number of ranks)")
    group_size: int = option(8, help="G: completions per prompt")
    checkpoint_every: int = option(50, help="steps between checkpoints (and the last step)")
    resume: bool = option(False, help="continue from --output-dir's checkpoint")
    overwrite: bool = option(False, help="start afresh in an --output-dir that holds another run's checkpoint")
    plot: bool = option(True, help="write curves.png at the end")
    progress: bool = option(True, help="show a progress bar")

    def check(self) -> None:
        for name in ("steps", "prompts_per_step", "group_size", "checkpoint_every"):
            check_int(flag(name), getattr(self, name), minimum=1)
        if self.threads is not None:
            check_int("--threads", self.threads, minimum=1)
        check_int("--seed", self.seed, minimum=0, maximum=MAX_SEED)
        check_int("--expert-parallel", self.expert_parallel, minimum=1)
        if not self.output_dir.strip():
            raise ValueError("--output-dir is empty; name the run directory (e.g. runs/default).")
        check_choice(self, "parallel")
        check_choice(self, "rollout_weights")
        for name in ("fsdp_offload", "reference_offload"):
            if getattr(self, name) and self.parallel != "fsdp2":
                raise ValueError(f"{flag(name)} true offloads FSDP2's shards to the host; add --parallel fsdp2 (and "
                                 "launch under torchrun), or leave it false.")
        check_choice(self, "task")
        if self.resume and self.overwrite:
            raise ValueError("--resume true continues the run in --output-dir and --overwrite true replaces it; "
                             "give one of them.")
        rollouts = self.prompts_per_step * self.group_size
        if rollouts > MAX_ROLLOUTS_PER_STEP:
            raise ValueError(f"--prompts-per-step {self.prompts_per_step} x --group-size {self.group_size} = "
                             f"{rollouts} rollouts per step, more than {MAX_ROLLOUTS_PER_STEP} (2^20); lower them.")


@dataclass
class ModelSettings(_Settings):
    """The policy: which model and tokenizer, its precision and its memory."""

    name: str = option("sudoku4", key="model", help="'sudoku4' (the embedded default), 'sdar-sudoku4' (the embedded "
                                                    "block-diffusion model), a checkpoint directory, or a preset with "
                                                    "random weights (the tokenizer's vocabulary and special ids)",
                       metavar="NAME|DIR", names="presets")
    tokenizer: str | None = option(None, help="tokenizer directory (default: the model's; the embedded one for "
                                              "presets)", metavar="DIR")
    bf16: bool | None = option(None, help="autocast to bf16 (default: on CUDA, not on CPU)")
    gradient_checkpointing: bool = option(False, help="recompute each block in backward")
    allow_external_links: bool = option(False, help="load a checkpoint whose files are symbolic links out of its "
                                                    "directory (by default it reads only its own files; a Hugging "
                                                    "Face cache snapshot's links into its blobs/ are its own)")


@dataclass
class RolloutSettings(_Settings):
    """How completions are decoded (dllm_fast.generate): GenerateConfig's fields by its names, with the trainer's
    defaults (`steps` is --diffusion-steps; `compile` may be auto, and true compiles scoring too); `generate_config`
    is the GenerateConfig itself."""

    gen_length: int = option(24, help="tokens generated per completion")
    block_length: int = option(24, help="block of semi-autoregressive decoding (divides --gen-length); for a "
                                        "block-diffusion model its attention block: a preset takes it, a "
                                        "checkpoint's own must match")
    steps: int | None = option(12, key="diffusion_steps",
                               help="denoising steps per completion (none: with --threshold; both: SDAR's dynamic "
                                    "rule on block-diffusion models)")
    temperature: float = option(1.0, help="rollout sampling temperature (0: greedy)")
    remasking: str = option("low_confidence", help="which positions a step unmasks", choices="remasking")
    cache: str = option("none", help="KV-cache mode of the rollouts (Fast-dLLM)", choices="caches")
    threshold: float | None = option(None, help="confidence threshold of parallel decoding, in (0, 1]")
    compile: bool | Auto = option(AUTO, help="true: compile each denoising step of the rollouts (torch.compile; "
                                             "CUDA graphs on GPU) and each scoring micro-batch whole; the first "
                                             "ones compile (metrics: compile_seconds). auto: the rollouts on CUDA, "
                                             "where CUDA graphs pay, nothing on CPU",
                                  metavar="true|false|auto")
    full_last_block: bool = option(False, help="block-diffusion models: decode each completion's last block whole, "
                                               "as the official SDAR generate does (its positions after the "
                                               "completion are decoded, then dropped, and change its tokens); "
                                               "default: the last block ends with the completion")
    eos_early_stop: bool = option(False, help="block-diffusion models: decode no further block once every "
                                              "completion's finished blocks hold an EOS (LLaDA2's generate; the "
                                              "completions up to their first EOS are unchanged, and rollouts of "
                                              "short answers take fewer forwards); default: every block decoded")
    # -- CJ-GRPO's decoders (generate's unmask_schedule and eos_schedule) --
    unmask_schedule: str = option("even", help="tokens a step unmasks: even (LLaDA's split of each block over its "
                                               "steps) or ass (CJ-GRPO: 2^s at step s of a block, floor(log2 "
                                               "block) steps a block: --diffusion-steps none or that count)")
    eos_schedule: list[float] | None = option(None, help="EOSER (CJ-GRPO): GAMMA_MIN GAMMA_MAX, a sampled EOS "
                                                         "ranked by its confidence times a factor rising over a "
                                                         "block's steps (official: 0.01 1.0); none: off",
                                              metavar="GAMMA")

    def check(self) -> None:
        check_int("--gen-length", self.gen_length, minimum=1)
        check_int("--block-length", self.block_length, minimum=1)
        if self.steps is not None:
            check_int("--diffusion-steps", self.steps, minimum=1)
        check_float("--temperature", self.temperature, minimum=0.0, hint="0 is greedy")
        if self.threshold is not None:
            check_float("--threshold", self.threshold, minimum=0.0, maximum=1.0, open_minimum=True)
        check_choice(self, "cache")
        check_choice(self, "remasking")
        if self.gen_length % self.block_length:
            raise ValueError(f"--gen-length {self.gen_length} is not a multiple of --block-length "
                             f"{self.block_length}; pass " + " or ".join(
                                 f"--gen-length {n}" for n in nearest_multiples(self.gen_length, self.block_length))
                             + ", or a block length that divides it.")
        if self.unmask_schedule not in ("even", "ass"):  # rollout.plan.UNMASK_SCHEDULES
            raise ValueError(f"--unmask-schedule {self.unmask_schedule!r} is not one of 'even', 'ass'.")
        if self.eos_schedule is not None and len(self.eos_schedule) != 2:
            raise ValueError(f"--eos-schedule takes two factors, GAMMA_MIN GAMMA_MAX (e.g. 0.01 1.0), got "
                             f"{self.eos_schedule!r}.")
        if self.unmask_schedule == "ass" and self.steps is not None and self.steps != self.decoding_steps():
            raise ValueError(f"--diffusion-steps {self.steps} does not fit --unmask-schedule ass, whose blocks of "
                             f"{self.block_length} take floor(log2 {self.block_length}) steps each (2^s tokens at "
                             f"step s): pass --diffusion-steps {self.decoding_steps()} or none.")
        if self.threshold is None and self.steps is None and self.unmask_schedule != "ass":
            raise ValueError("--diffusion-steps none needs --threshold (adaptive steps); give one of them.")
        if self.steps is not None:
            blocks = self.gen_length // self.block_length
            if self.steps % blocks:
                raise ValueError(f"--diffusion-steps {self.steps} is not a multiple of the {blocks} blocks "
                                 "(--gen-length / --block-length); use e.g. --diffusion-steps "
                                 f"{blocks * max(1, self.steps // blocks)}.")
            if self.steps > self.gen_length:
                raise ValueError(f"--diffusion-steps {self.steps} exceeds --gen-length {self.gen_length}: a step "
                                 "unmasks at least one token, so steps beyond the completion's length run no model "
                                 f"call; use at most {self.gen_length}.")

    def decoding_steps(self) -> int | None:
        """The rollout's denoising steps: --diffusion-steps, or under --unmask-schedule ass the blocks times
        floor(log2 --block-length) (rollout.plan.ass_steps); None under --threshold alone."""
        if self.unmask_schedule == "ass":
            return -(-self.gen_length // self.block_length) * max(1, self.block_length.bit_length() - 1)
        return self.steps

    def generate_config(self, *, compile: bool):
        """These settings as the GenerateConfig that decodes them, `compile` being what --compile means on the run's
        device (config.compiles_rollouts)."""
        from dllm_fast.rollout.config import GenerateConfig

        return GenerateConfig(gen_length=self.gen_length, block_length=self.block_length, steps=self.steps,
                              temperature=self.temperature, remasking=self.remasking, cache=self.cache,
                              threshold=self.threshold, compile=compile, full_last_block=self.full_last_block,
                              eos_early_stop=self.eos_early_stop, unmask_schedule=self.unmask_schedule,
                              eos_schedule=None if self.eos_schedule is None else tuple(self.eos_schedule))


@dataclass
class ObjectiveSettings(_Settings):
    """What each step optimises and how its likelihoods are computed: the objective with its options, the inner
    updates, and the micro-batches the engine scores and backpropagates in."""

    name: str = option("espo", key="objective", help="the RL objective (the one that gained most on the embedded "
                                                     "default)", choices="objectives")
    options: dict = option(key="objective_options", help="the objective's options as JSON, e.g. '{\"n_t\": 4}'; "
                                                         "`--objective NAME --help` lists them", factory=dict)
    inner_updates: int = option(1, help="mu: optimizer steps per rollout batch")
    micro_batch: int | Auto = option(AUTO, help="(sequence, sample) pairs per backward graph; memory scales with "
                                              "it. auto: on CUDA the largest the planner fits in 90% of the free "
                                              f"memory (see dllm_fast.train.micro_batch), on CPU {DEFAULT_MICRO_BATCH}",
                                     metavar="N|auto")
    score_micro_batch: int | None = option(None, help="pairs per model call when scoring without a graph "
                                                      "(default: --micro-batch)")
    chunk_size: int | None = option(None, help="vocabulary rows per chunk of the fused LM head (default: by device)")

    def check(self) -> None:
        check_int("--inner-updates", self.inner_updates, minimum=1)
        if self.micro_batch != AUTO:
            check_int("--micro-batch", self.micro_batch, minimum=1, hint="or auto")
        for name in ("score_micro_batch", "chunk_size"):
            if getattr(self, name) is not None:
                check_int(flag(name), getattr(self, name), minimum=1)
        check_choice(self, "name")
        if self.inner_updates > MAX_INNER_UPDATES:
            raise ValueError(f"--inner-updates {self.inner_updates} is more than {MAX_INNER_UPDATES} optimizer steps "
                             "per rollout batch (papers use 1-12); lower it.")


@dataclass
class OptimSettings(_Settings):
    """AdamW and its learning-rate schedule."""

    lr: float = option(1e-4, help="AdamW learning rate")
    weight_decay: float = option(0.0, help="AdamW weight decay")
    betas: list[float] = option(help="AdamW beta1 beta2", factory=lambda: [0.9, 0.99], example="[0.9, 0.99]")
    grad_clip: float = option(1.0, help="gradient-norm clip")
    warmup_steps: int = option(0, help="linear warm-up, in optimizer steps")
    schedule: str = option("constant", help="learning-rate schedule after the warm-up", choices=SCHEDULES)

    def check(self) -> None:
        check_int("--warmup-steps", self.warmup_steps, minimum=0)
        check_float("--lr", self.lr, minimum=0.0, maximum=1.0, open_minimum=True,
                    hint="AdamW's learning rates lie around 1e-6 to 1e-3")
        check_float("--grad-clip", self.grad_clip, minimum=0.0, open_minimum=True)
        check_float("--weight-decay", self.weight_decay, minimum=0.0)
        if self.lr * self.weight_decay >= 1.0:
            raise ValueError(f"--lr {self.lr} x --weight-decay {self.weight_decay} = {self.lr * self.weight_decay:g}: "
                             "AdamW multiplies the weights by 1 - lr x weight_decay at every step, which must stay "
                             "positive; lower --weight-decay (e.g. 0.01 to 0.1).")
        if len(self.betas) != 2:
            raise ValueError(f"--betas {' '.join(map(str, self.betas))} must be two numbers (AdamW's beta1 beta2).")
        for beta in self.betas:
            check_float("--betas", beta, minimum=0.0, maximum=1.0, open_maximum=True)
        check_choice(self, "schedule")


@dataclass
class LoraSettings(_Settings):
    """LoRA adapters (PEFT) instead of a full fine-tune."""

    enabled: bool = option(False, key="lora", help="train LoRA adapters (PEFT); the reference is the model "
                                                   "without them")
    rank: int = option(16, key="lora_rank", help="LoRA rank")
    alpha: int = option(32, key="lora_alpha", help="LoRA alpha")
    dropout: float = option(0.0, key="lora_dropout", help="LoRA dropout, in [0, 1)")
    targets: list[str] | None = option(None, key="lora_targets", help="module names to adapt (default: every one "
                                                                      "the model family allows)", metavar="MODULE",
                                       example="[q_proj, v_proj]")
    merge_rollouts: bool = option(False, key="lora_merge_rollouts",
                                  help="roll out through a copy of the adapted weights with the adapters merged in "
                                       "(one GEMM a projection; the copy's memory, 14 GB at LLaDA-8B with every "
                                       "projection adapted; equal to the adapters in exact arithmetic)")

    def check(self) -> None:
        check_int("--lora-rank", self.rank, minimum=1)
        check_int("--lora-alpha", self.alpha, minimum=1)
        check_float("--lora-dropout", self.dropout, minimum=0.0, maximum=1.0, open_maximum=True)


@dataclass
class EvalSettings(_Settings):
    """The periodic greedy evaluation on the task's test split."""

    every: int = option(100, key="eval_every", help="steps between greedy evaluations (and the last step)")
    gen_lengths: list[int] = option(key="eval_gen_lengths", help="generation lengths to evaluate at",
                                    factory=lambda: [24], example="[24, 48]")
    examples: int | None = option(None, key="eval_examples", help="test examples to evaluate on (default: the "
                                                                  "whole test split)")
    batch_size: int = option(256, key="eval_batch_size", help="prompts per evaluation batch")

    def check(self) -> None:
        check_int("--eval-every", self.every, minimum=1)
        check_int("--eval-batch-size", self.batch_size, minimum=1)
        if self.examples is not None:
            check_int("--eval-examples", self.examples, minimum=1)
        if not self.gen_lengths:
            raise ValueError("--eval-gen-lengths must list at least one generation length.")
        for length in self.gen_lengths:
            check_int("--eval-gen-lengths", length, minimum=1)


# The sections of a TrainConfig, by the name it holds each under, in --help order.
SECTIONS: dict[str, type[_Settings]] = {
    "run": RunSettings, "model": ModelSettings, "rollout": RolloutSettings, "objective": ObjectiveSettings,
    "optim": OptimSettings, "lora": LoraSettings, "eval": EvalSettings}


@dataclass(frozen=True)
class Option:
    """One setting as the flat world names it: `key` (lora_rank) is `section`'s field `name` (lora.rank)."""

    key: str
    section: str
    name: str
    field: dataclasses.Field
    hint: Any

    @property
    def flag(self) -> str:
        return flag(self.key)

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def example(self) -> str:
        return self.field.metadata.get("example", "")


def _options() -> dict[str, Option]:
    options = {}
    for section, cls in SECTIONS.items():
        for config_field in dataclasses.fields(cls):
            key = config_field.metadata.get("key") or config_field.name
            assert key not in options, f"two settings take the flat name {key}"
            options[key] = Option(key, section, config_field.name, config_field, _hints(cls)[config_field.name])
    return options


OPTIONS: dict[str, Option] = _options()  # every flat option, by its key, in --help order


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


def check_choice(settings: _Settings, name: str) -> None:
    """A field with `choices` holds one of them, or a ValueError naming its flag."""
    config_field = next(f for f in dataclasses.fields(settings) if f.name == name)
    choices = field_choices(config_field)
    value = getattr(settings, name)
    if value not in choices:
        raise ValueError(f"{flag(config_field.metadata.get('key') or name)} {value!r} is not one of "
                         f"{', '.join(choices)}.")
