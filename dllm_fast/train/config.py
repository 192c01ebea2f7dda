"""The trainer's configuration: `TrainConfig`, one settings object per role (dllm_fast.train.settings), loadable
from a YAML or JSON file, with command-line overrides.

    python -m dllm_fast train --task sudoku4 --objective espo --model sudoku4 --config run.yaml --lr 1e-4

    config = TrainConfig(model="small", lr=1e-3, gen_length=32)            # flat keywords, as the flags name them
    config = TrainConfig(optim={"lr": 1e-3}, rollout=RolloutSettings(gen_length=32, block_length=32))
    config.optim.lr, config.rollout.gen_length, config.lora.rank           # what the library reads

The sections are the source of truth: `run`, `model`, `rollout`, `objective`, `optim`, `lora` and `eval`. Every
setting also has a flat key (its flag without the dashes: `lr`, `gen_length`, `lora_rank`), which `TrainConfig(...)`,
`from_dict` and config files accept beside, or instead of, the nested form (`optim: {lr: 1e-4}`); one setting
given both ways is an error naming it. config.json is written nested; a flat one (runs of earlier versions) loads
too. Precedence: the defaults, then the file, then `--key value` flags. Every setting is a flag (see
`dllm_fast.train.cli`), described by the `help` of its field; `choices` name the registry a value must come from.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from dllm_fast.contracts import MAX_PAIRS
from dllm_fast.train.settings import (AUTO, OPTIONS, SECTIONS, EvalSettings, LoraSettings, ModelSettings,
                                      ObjectiveSettings, OptimSettings, RolloutSettings, RunSettings)
from dllm_fast.train.typed import Scalar, plain_value, read_value, shown
from dllm_fast.validation import nearest_multiples

__all__ = ["TrainConfig", "RunSettings", "ModelSettings", "RolloutSettings", "ObjectiveSettings", "OptimSettings",
           "LoraSettings", "EvalSettings", "read_config_file", "task_options", "compiles_rollouts",
           "compiles_scoring", "micro_batching", "check_block_length", "take_block_length"]


@dataclass(init=False)
class TrainConfig:
    """A training run's settings by role. Built from sections (objects or mappings of their fields) and/or flat
    keywords; then checked as a whole: what needs several sections, the objective, the task, the model's files
    and the device (without loading any weight), so that a wrong name fails before anything runs."""

    run: RunSettings = field(default_factory=RunSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    objective: ObjectiveSettings = field(default_factory=ObjectiveSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    lora: LoraSettings = field(default_factory=LoraSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)

    def __init__(self, **settings: Any) -> None:
        """`TrainConfig(lr=1e-3, rollout={"gen_length": 32, "block_length": 32}, lora=LoraSettings(...))`: flat
        keys, sections as mappings or objects, or both; an unknown key is a TypeError naming the closest one."""
        values = flat_values(settings, _keyword_error)
        by_section: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for key, (value, _) in values.items():
            by_section[OPTIONS[key].section][OPTIONS[key].name] = value
        for name, cls in SECTIONS.items():
            setattr(self, name, cls(**by_section[name]))
        self._check_consistency()
        self._check_setup()

    def _check_consistency(self) -> None:
        """What no one section can check alone."""
        rollout = self.rollout
        from dllm_fast.train.sources import block_diffusion_model, check_cache

        check_cache(self.model, rollout.cache)
        if self.run.reference_offload and self.lora.enabled:
            raise ValueError("--reference-offload true moves a full fine-tune's reference copy to the host; with "
                             "--lora true the reference is the policy's own base with its adapters disabled (no "
                             "copy to offload): leave it false, or offload the whole model with --fsdp-offload true.")

        if rollout.eos_early_stop and not block_diffusion_model(self.model):
            raise ValueError(f"--eos-early-stop true stops a block-diffusion model's rollout once every completion "
                             f"holds an EOS; --model {self.model.name} decodes bidirectionally (its later positions "
                             "are decoded together with the earlier ones): drop it, or use a block-diffusion model.")
        if rollout.threshold is not None and rollout.steps is not None and not block_diffusion_model(self.model):
            raise ValueError(f"--threshold {rollout.threshold} sets the steps adaptively; pass --diffusion-steps none "
                             "with it (or drop --threshold for a fixed schedule; both together are SDAR's dynamic "
                             "rule, for block-diffusion models).")

    def _check_setup(self) -> None:
        """The objective and the task with their options, the model and the tokenizer: built or found without
        loading any weight, so that a wrong name fails before anything runs."""
        from dllm_fast import objectives
        from dllm_fast.tasks import get_task

        run = self.run
        with _prefixed("--objective-options"):
            objective = objectives.get(self.objective.name, **self.objective.options)
        if run.reference_offload and not objective.needs_reference:
            raise ValueError(f"--reference-offload true offloads the reference copy, and --objective "
                             f"{self.objective.name} (as configured) uses no reference; leave it false.")
        samples = run.prompts_per_step * run.group_size * objective.config.n_t
        if samples > MAX_PAIRS:  # the library's own bound (sample_masks refuses more)
            raise ValueError(f"--prompts-per-step {run.prompts_per_step} x --group-size {run.group_size} x "
                             f"{self.objective.name}'s n_t {objective.config.n_t} = {samples} Monte Carlo samples "
                             f"per update, more than {MAX_PAIRS} (2^20); lower n_t (--objective-options "
                             "'{\"n_t\": 4}') or the rollouts per step.")
        with _prefixed("--task-options"):
            get_task(run.task, **task_options(self))
        from dllm_fast.train.sources import check_device, model_source

        model_source(self.model, self.lora)
        check_device(run.device)
        from dllm_fast.ops.backend import environment_backend

        environment_backend()  # a bad DLLM_FAST_BACKEND is refused here, before a run directory is made
        if self.lora.enabled and importlib.util.find_spec("peft") is None:
            raise ValueError("--lora true needs the peft package, which is missing here; install it with "
                             "`pip install peft` (dllm_fast depends on it: `pip install -e .` installs it).")

    # -- loading and saving -----------------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> "TrainConfig":
        """Load a YAML (.yaml/.yml) or JSON file of settings, flat or nested, then apply `overrides` (flat keys).
        Every value of the file is checked for its field's type, naming the file and the key."""
        return cls.from_dict({**read_config_file(path), **overrides})

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TrainConfig":
        """The configuration of a mapping, flat (`{"lr": 1e-4}`), nested (`{"optim": {"lr": 1e-4}}`, as `to_dict`
        writes it) or both; an unknown key is a ValueError naming the closest one."""
        return cls(**{key: value for key, (value, _) in flat_values(values, _option_error).items()})

    def to_dict(self) -> dict[str, Any]:
        """Nested, section by section: what config.json holds, and what `from_dict` reads back to an equal config."""
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat key (`lr`, `lora_rank`), in --help order: what the command line and the resume
        check compare option by option."""
        return {key: getattr(getattr(self, option.section), option.name) for key, option in OPTIONS.items()}

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with `changes` (flat keys or sections, as the constructor takes them) over this one's settings,
        checked again."""
        changed = {key: value for key, (value, _) in flat_values(changes, _keyword_error).items()}
        return TrainConfig(**{**self.flat(), **changed})

    def generate_config(self, device_type: str):
        """The rollouts' settings as one GenerateConfig, for a run on `device_type` (which --compile auto needs):
        what the trainer, its evaluation, the planner and the TRL rollout function decode with."""
        return self.rollout.generate_config(compile=compiles_rollouts(self, device_type))


# -- flat and nested keys -----------------------------------------------------------------------------------------
def flat_values(values: dict[str, Any], unknown: Callable[[str, list[str]], Exception],
                lines: dict[str, int] | None = None) -> dict[str, tuple[Any, str]]:
    """Settings given flat (`lr`), nested (`optim: {lr: ...}`, a mapping or a section object) or both, by flat key:
    {key: (value, the key as it was given)}. A section's name with a mapping (or its object) is the section, with
    any other value the flat setting of that name (`lora: true`, `model: small`). The same setting given both flat
    and in a mapping is a ValueError naming both (with their `lines` in a file, by the key as given); a section
    object is a base that both override (so that `dataclasses.replace(config, lr=...)` works). An unknown name is
    `unknown(name, the valid names)`."""
    out: dict[str, tuple[Any, str]] = {}
    base: dict[str, tuple[Any, str]] = {}  # a section object's values, which any other way of giving them overrides
    lines = lines or {}

    def at(spelt: str) -> str:
        return f" (line {lines[spelt]})" if spelt in lines else ""

    def put(key: str, value: Any, spelt: str) -> None:
        if key in out:
            first = out[key][1]
            raise ValueError(f"{OPTIONS[key].path} is given twice, as {first}{at(first)} and as {spelt}{at(spelt)}; "
                             f"keep one (flat: {key}, nested: {OPTIONS[key].path}).")
        out[key] = (value, spelt)

    for name, value in values.items():
        section = SECTIONS.get(name) if isinstance(name, str) else None
        if section is not None and isinstance(value, (dict, section)):
            fields = {f.name: f for f in dataclasses.fields(section)}
            if not isinstance(value, dict):
                base.update({f.metadata.get("key") or f.name: (getattr(value, f.name), f"{name}.{f.name}")
                             for f in fields.values()})
                continue
            for field_name, item in value.items():
                if field_name not in fields:
                    raise unknown(f"{name}.{field_name}", [f"{name}.{other}" for other in fields])
                put(fields[field_name].metadata.get("key") or field_name, item, f"{name}.{field_name}")
        elif name in OPTIONS:
            put(name, value, name)
        elif section is not None:  # `run: 3`: a section that is neither a mapping nor a flat setting
            raise TypeError(f"{name} = {shown(value)} must be a mapping of the {name} settings (e.g. "
                            f"{name}: {{{next(iter(f.name for f in dataclasses.fields(section)))}: ...}}).")
        else:
            raise unknown(str(name), list(OPTIONS) + list(SECTIONS))
    return {**base, **out}


def _closest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _keyword_error(name: str, valid: list[str]) -> Exception:
    return TypeError(f"TrainConfig() got an unexpected keyword argument {name!r}{_closest(name, valid)}; the "
                     f"settings are {sorted(OPTIONS)}, or the sections {', '.join(SECTIONS)}.")


def _option_error(name: str, valid: list[str]) -> Exception:
    return ValueError(f"unknown training option(s) [{name!r}]{_closest(name, valid)}; the options are "
                      f"{sorted(OPTIONS)}, or nested by section ({', '.join(SECTIONS)}).")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The settings of a YAML or JSON config file, flat or nested, by flat key, each read as its field's type by
    the one reader of every setting (typed.read_value: a value written as text reads as its flag would). A key or
    section given twice is refused naming both lines, as is one setting given both flat and nested."""
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
    values, lines = (_json_values if path.suffix == ".json" else _yaml_values)(text, path)
    if not isinstance(values, dict):
        raise ValueError(f"config file {path} must hold a mapping of option names to values, got a "
                         f"{type(plain_value(values)).__name__}.")

    def unknown(name: str, valid: list[str]) -> Exception:
        return ValueError(f"config file {path}: unknown option(s) [{name!r}]{_closest(name, valid)}; the options "
                          f"are {sorted(OPTIONS)}, or nested by section ({', '.join(SECTIONS)}).")

    try:
        given = flat_values(values, unknown, lines)
    except TypeError as error:
        raise TypeError(f"config file {path}: {error}") from None
    except ValueError as error:
        if str(error).startswith(f"config file {path}"):
            raise
        raise ValueError(f"config file {path}: {error}") from None
    return {key: read_value(OPTIONS[key].hint, value, f"{path}: {spelt}", example=OPTIONS[key].example)
            for key, (value, spelt) in given.items()}


MAX_CONFIG_BYTES = 2**20


def _repeated(path: Path, key: str, first: int, second: int) -> ValueError:
    return ValueError(f"config file {path}: {key} is given twice, on lines {first} and {second}; keep one (the "
                      "second would silently replace the first).")


def _yaml_values(text: str, path: Path) -> tuple[Any, dict[str, int]]:
    """A YAML file's mappings, lists and scalars (typed.Scalar: the text as written, with the value YAML gives it),
    and the line of every key by its dotted name. A repeated key is refused naming both lines."""
    import yaml

    loader = _config_loader()(text)
    lines: dict[str, int] = {}

    def tree(node, keys: tuple[str, ...]):
        if isinstance(node, yaml.MappingNode):
            out, seen = {}, {}
            for key_node, value_node in node.value:
                line = key_node.start_mark.line + 1
                if not isinstance(key_node, yaml.ScalarNode):
                    raise ValueError(f"config file {path}, line {line}: a key must be an option's name.")
                key = key_node.value
                dotted = ".".join((*keys, key))
                if key in seen:
                    raise _repeated(path, dotted, seen[key], line)
                seen[key] = lines[dotted] = line
                out[key] = tree(value_node, (*keys, key))
            return out
        if isinstance(node, yaml.SequenceNode):
            return [tree(item, keys) for item in node.value]
        typed = loader.construct_object(node, deep=True)
        if node.style is None and isinstance(typed, str) and _YAML12_FLOAT.fullmatch(node.value):
            typed = float(node.value)  # YAML 1.1 reads 1e-4 (no dot) as text; YAML 1.2 and JSON as a number
        return Scalar(node.value, typed, plain=node.style is None)

    try:
        node = loader.get_single_node()
        return ({} if node is None else tree(node, ())), lines
    except yaml.YAMLError as error:
        raise ValueError(f"config file {path} is not valid YAML: {' '.join(str(error).split())}") from None
    finally:
        loader.dispose()


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


_YAML12_FLOAT = re.compile(r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?")


class _RepeatedKey(Exception):
    pass


def _json_values(text: str, path: Path) -> tuple[Any, dict[str, int]]:
    """A JSON file's values and the line of every key by its dotted name. A repeated key is refused naming both
    lines."""
    def pairs(items):
        out = {}
        for key, value in items:
            if key in out:
                raise _RepeatedKey(key)
            out[key] = value
        return out

    try:
        values = json.loads(text, object_pairs_hook=pairs)
    except json.JSONDecodeError as error:
        raise ValueError(f"config file {path} is not valid JSON: {error}.") from None
    except _RepeatedKey:
        seen: dict[tuple[int, str], int] = {}
        for dotted, where, line in _json_key_lines(text):
            if (where, dotted) in seen:
                raise _repeated(path, dotted, seen[where, dotted], line) from None
            seen[where, dotted] = line
        raise
    return values, {dotted: line for dotted, _, line in _json_key_lines(text)}


_JSON_TOKEN = re.compile(r'"(?:[^"\\\n]|\\.)*"|[{}\[\]:,\n]')


def _json_key_lines(text: str) -> list[tuple[str, int, int]]:
    """(dotted key, the number of the object holding it, line) of every object key of a valid JSON text, in
    order (a list's objects are numbered apart, so two of them may hold the same key)."""
    found, stack, line, objects = [], [], 1, 0  # stack: [kind, keys, expecting a key, the last key, object number]
    for match in _JSON_TOKEN.finditer(text):
        token = match.group()
        if token == "\n":
            line += 1
        elif token in "{[":
            keys = () if not stack else (*stack[-1][1], stack[-1][3]) if stack[-1][0] == "{" else stack[-1][1]
            objects += 1
            stack.append([token, keys, True, None, objects])
        elif token in "}]":
            stack.pop()
        elif token in ",:":
            if stack and stack[-1][0] == "{":
                stack[-1][2] = token == ","
        elif stack and stack[-1][0] == "{" and stack[-1][2]:
            stack[-1][3] = json.loads(token)
            found.append((".".join((*stack[-1][1], stack[-1][3])), stack[-1][4], line))
    return found


# -- what the names of a config mean ----------------------------------------------------------------------------
def task_options(config: TrainConfig) -> dict[str, Any]:
    """--task-options, and for an embedded model on its own task the prompt style it was trained on."""
    from dllm_fast.assets import EMBEDDED_MODELS

    options = dict(config.run.task_options)
    if config.run.task == "sudoku4" and config.model.name in EMBEDDED_MODELS:
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
    auto = config.rollout.compile == AUTO and device_type == "cuda" and not records_step_predictions(config)
    return config.rollout.compile is True or (auto and not rolls_out_trees(config))


def records_step_predictions(config: TrainConfig) -> bool:
    """Whether the objective's rollouts record every step's prediction (MDPO), which runs the steps eagerly:
    --compile auto then leaves them uncompiled (generate refuses to record compiled steps)."""
    from dllm_fast import objectives

    return getattr(objectives.get(config.objective.name, **config.objective.options), "needs_step_predictions",
                   False)


def rolls_out_trees(config: TrainConfig) -> bool:
    """Whether the objective's rollouts are trees of resumed calls (d_treerpo, rollout/tree.py), which run eagerly:
    --compile auto then leaves them uncompiled (a compiled call keeps its buffers for the whole call)."""
    from dllm_fast import objectives

    return getattr(objectives.get(config.objective.name, **config.objective.options), "tree_shape", None) is not None


def compiles_scoring(config: TrainConfig) -> bool:
    """Whether scoring micro-batches compile: --compile true only (auto leaves them eager: their graphs, padded
    to buckets, were not measured to pay on a GPU, and refuse active LoRA dropout)."""
    return config.rollout.compile is True


def micro_batching(config: TrainConfig, *, auto: int):
    """--micro-batch, --score-micro-batch, --chunk-size and the scoring half of --compile, packed once into the
    `MicroBatching` that travels unchanged to the engine (the trainer's and the planner's). auto: what
    --micro-batch auto stands for here (the device's fit in train, the default in a plan)."""
    from dllm_fast.likelihood.settings import MicroBatching

    settings = config.objective
    return MicroBatching(auto if settings.micro_batch == AUTO else settings.micro_batch, settings.score_micro_batch,
                         settings.chunk_size, compile=compiles_scoring(config))


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
    block = config.rollout.block_length
    if config.model.name not in PRESETS and size != block:
        raise ValueError(f"--block-length {block}, but --model {config.model.name} is a block-diffusion "
                         f"model trained with blocks of {size} (its config.json block_size), which its rollouts "
                         f"and likelihoods use; pass --block-length {size}.")
    evaluations = [("--eval-gen-lengths", n) for n in config.eval.gen_lengths] if evaluated else []
    for option, length in [("--gen-length", config.rollout.gen_length)] + evaluations:
        if length % block:
            raise ValueError(f"{option} {length} is not a multiple of --block-length {block}, the "
                             "block-diffusion model's block: training decodes and scores whole blocks; pass "
                             f"{' or '.join(f'{option} {n}' for n in nearest_multiples(length, block))}.")


def take_block_length(config: TrainConfig, model) -> None:
    """A block-diffusion preset (random weights) attends in blocks of --block-length."""
    from dllm_fast.contracts import block_length
    from dllm_fast.models.loading import PRESETS

    if block_length(model) is not None and config.model.name in PRESETS:
        model.block_length = config.rollout.block_length
