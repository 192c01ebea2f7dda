"""The `train` command: every TrainConfig setting is a flag, described by its field's help, with its choices, grouped
by the section that holds it (run, model, rollout, objective, optim, lora, eval).

    python -m dllm_fast train --help                        # every option, its default and its choices
    python -m dllm_fast train --objective spg --help        # and the objective's own options, the paper's defaults
    python -m dllm_fast train --config run.yaml --lr 2e-5   # a YAML/JSON file, then flags over it

Flags are spelled `--inner-updates` (or `--inner_updates`); dict fields take JSON (`--objective-options
'{"beta": 1.5}'`), list fields one or more values (`--eval-gen-lengths 24 48`), booleans true/false, optional
fields none. `add_config_arguments` and `config_from_arguments` are the flags and their reading for any command
that takes a training configuration (the planner's `plan` takes the same flags as `train`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import sys
import textwrap
import typing
from pathlib import Path

from dllm_fast.train.config import TrainConfig, read_config_file
from dllm_fast.train.settings import OPTIONS, SECTIONS, Option, field_choices, flag, registry_choices
from dllm_fast.train.typed import element_type, is_list, read_value

PROG = "python -m dllm_fast train"
DESCRIPTION = """RL training. With no options: the embedded default, RL from a tiny sudoku4 model on CPU, printing
base vs final greedy test accuracy and writing the curves (python -m dllm_fast train --help for this list)."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are ValueErrors (one line each) instead of a usage dump and an exit."""

    def error(self, message: str):
        raise ValueError(re.sub(r"^argument [^:]+: (?=--)", "", message))


def add_config_arguments(parser: argparse.ArgumentParser, argv: typing.Sequence[str] = ()) -> None:
    """Add `--config FILE` and one flag per TrainConfig setting to `parser`, in one group per section. With
    `--objective NAME` in `argv`, the help also lists that objective's own options and their defaults."""
    parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS, help="a YAML or JSON file of options, flat (lr: 1e-4) or nested "
                                                         "by section (optim: {lr: 1e-4}); the file's values, then "
                                                         "the flags, override the defaults")
    groups = {name: parser.add_argument_group(f"{name} settings (config.{name})", _summary(cls))
              for name, cls in SECTIONS.items()}
    for key, setting in OPTIONS.items():
        groups[setting.section].add_argument(setting.flag, **_argument(setting))
    objective = _given(argv, "--objective")
    parser.epilog = objective_help(objective) if objective else (
        "`--objective NAME --help` also lists that objective's own options and their defaults.")


def _argument(setting: Option) -> dict:
    """argparse's keywords for one setting's flag."""
    kind = element_type(setting.hint)
    options = dict(dest=setting.key, default=argparse.SUPPRESS, help=_help_line(setting.field), action=_Store,
                   type=value_converter(setting.key, setting.hint),
                   metavar=setting.field.metadata.get("metavar") or _metavar(kind, field_choices(setting.field)))
    if is_list(setting.hint):
        options["nargs"] = "+"
    return options


class _Store(argparse._StoreAction):
    """A setting's flag: its values read as its type (a list's each by argparse's `type`, then the list whole, so
    that `--lora-targets none` is None). Given twice, the last one counts, as on any command line (a wrapper's
    flags override its base's); a config file's repeated key is refused instead (config.read_config_file)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if isinstance(values, list) and self.dest in OPTIONS:  # `--lora-targets none`: the list as a whole
            try:
                values = read_value(OPTIONS[self.dest].hint, values, flag(self.dest))
            except TypeError as error:
                raise argparse.ArgumentError(None, str(error)) from None
        setattr(namespace, self.dest, values)


def _summary(cls: type) -> str:
    """A section's --help line: its docstring's first sentence."""
    return " ".join((cls.__doc__ or "").split()).split(": ")[0].split(". ")[0].rstrip(".") + "."


def config_from_arguments(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of parsed flags: the defaults, then --config's file, then the flags given. With --resume
    true and a checkpoint in --output-dir, the saved run's configuration, of which only the options that may change
    on resume (CHANGEABLE_ON_RESUME) may be given differently."""
    given = {key: getattr(args, key) for key in OPTIONS if hasattr(args, key)}
    config_file = getattr(args, "config", None)
    if config_file:
        given = {**read_config_file(config_file), **given}
    if given.get("resume"):
        from dllm_fast.files import settled_directory
        from dllm_fast.train.checkpoint import CHECKPOINT
        from dllm_fast.train.resume import CONFIG, resumed_config, saved_config
        from dllm_fast.train.run_dir import RunDirectory

        checkpoint = RunDirectory(given.get("output_dir", OPTIONS["output_dir"].field.default)).path(CHECKPOINT)
        if settled_directory(checkpoint).is_dir():
            return resumed_config(saved_config(checkpoint), given, str(checkpoint / CONFIG))
    return TrainConfig.from_dict(given)


def parse_overrides(arguments: typing.Sequence[str]) -> dict:
    """`["--lr", "1e-4", "--lora", "true", "--eval-gen-lengths", "24", "48"]` -> typed field values."""
    parser = new_parser()
    add_config_arguments(parser)
    args = parse(parser, arguments)
    return {key: getattr(args, key) for key in OPTIONS if hasattr(args, key)}


def new_parser(**options) -> argparse.ArgumentParser:
    """A parser that raises ValueError (one line) on a bad option, and knows no abbreviations."""
    return _Parser(allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter, **options)


def parse(parser: argparse.ArgumentParser, arguments: typing.Sequence[str]) -> argparse.Namespace:
    """Parse `arguments`, accepting `--inner_updates` for `--inner-updates`; an unknown option is a ValueError
    that names it (and the option it may have meant)."""
    args, unknown = parser.parse_known_args(_dashed(arguments))
    if unknown:
        first = next((a for a in unknown if a.startswith("-")), unknown[0])
        if not first.startswith("--"):
            raise ValueError(f"expected an option such as --lr, got {first!r}.")
        known = [setting.flag for setting in OPTIONS.values()] + ["--config"]
        close = difflib.get_close_matches(first.split("=")[0], known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(f"unknown training option {first}{hint}; `{PROG} --help` lists the options.")
    return args


# -- the command --------------------------------------------------------------------------------------------
def main(argv: typing.Sequence[str] = ()) -> None:
    """`python -m dllm_fast train ...`. A bad option, value or run directory is one line on stderr (exit status
    2), found before anything is written; an error while training is one line too (exit status 1). --debug shows
    the traceback instead."""
    argv = list(argv)
    debug = "--debug" in argv
    parser = new_parser(prog=PROG, description=DESCRIPTION)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    add_config_arguments(parser, argv)
    try:
        config = config_from_arguments(parse(parser, argv))
    except (ValueError, TypeError, OSError) as error:
        if debug:
            raise
        print(f"{PROG}: {' '.join(str(error).split())}", file=sys.stderr)
        raise SystemExit(2) from None
    from dllm_fast.train.loop import train
    from dllm_fast.train.metrics import PLOT

    try:
        result = train(config)
    except KeyboardInterrupt:
        if debug:
            raise
        from dllm_fast.files import settled_directory
        from dllm_fast.train.checkpoint import CHECKPOINT

        if settled_directory(Path(config.run.output_dir) / CHECKPOINT).is_dir():
            print(f"{PROG}: interrupted; the checkpoint in {config.run.output_dir} is intact (continue from it with "
                  "--resume true).", file=sys.stderr)
        else:
            print(f"{PROG}: interrupted before the run's first checkpoint: there is none to continue from; start the "
                  "run again.", file=sys.stderr)
        raise SystemExit(130) from None
    except (ValueError, TypeError, OSError, RuntimeError, FloatingPointError, MemoryError) as error:
        if debug:
            raise
        if getattr(error, "refused_setting", False):  # found before the run started: a bad option, as above
            print(f"{PROG}: {' '.join(str(error).split())}", file=sys.stderr)
            raise SystemExit(2) from None
        print(f"{PROG}: {_plain(error)} (--debug shows the traceback)", file=sys.stderr)
        raise SystemExit(1) from None
    if result.rank != 0:
        return
    for length in sorted(result.final_accuracy):
        base, final = result.base_accuracy.get(length, float("nan")), result.final_accuracy[length]
        print(f"greedy test accuracy at {length} tokens: base {base:.3f} -> final {final:.3f} ({final - base:+.3f})")
    written = f"metrics, checkpoint and {PLOT}" if config.run.plot else "metrics and checkpoint"
    ran = result.steps - result.resumed_at
    done = f"{ran} step{'s' * (ran != 1)}"
    if result.resumed_at:  # this process's steps and time, not the run's
        done += f" (resumed at step {result.resumed_at}; the run is at step {result.steps})"
    print(f"{done} in {result.seconds:.0f} s; {written} in {result.output_dir}")


def _plain(error: BaseException) -> str:
    """An error of a run as one line; running out of memory names the options that size the run."""
    text = " ".join(str(error).split())
    if isinstance(error, MemoryError) or "OutOfMemory" in type(error).__name__ or "can't allocate memory" in text:
        return (f"out of memory ({text[:200]}); lower --micro-batch, --score-micro-batch, --eval-batch-size, "
                "--prompts-per-step, --group-size or the objective's n_t (--objective-options).")
    return text


def objective_help(name: str) -> str:
    """The objective's one-line summary and its options with their defaults (its paper's), for --help."""
    from dllm_fast import objectives

    if name not in objectives.available():
        return f"unknown objective {name!r}; the objectives are {', '.join(objectives.available())}."
    objective = objectives.get(name)
    module = sys.modules[type(objective).__module__]
    summary = (module.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
    lines = [textwrap.fill(f"objective {name}: {summary}", width=100), "",
             f"its options, with the paper's defaults (set them with --objective-options '{{\"name\": value}}'):"]
    for option, (value, description) in objective.config.options().items():
        default = f"{option}={value!r}"
        lines.append(f"  {default:<28} {description}".rstrip())
    for preset, options in objectives.presets(name).items():  # named settings of the official scripts
        settings = ", ".join(f"{key}={value!r}" for key, value in options.items())
        lines.append(f"  preset {preset!r}: {settings} (--objective-options '{{\"preset\": \"{preset}\"}}')")
    return "\n".join(lines)


# -- flags of fields ----------------------------------------------------------------------------------------
def _help_line(config_field: dataclasses.Field) -> str:
    default = (config_field.default_factory() if config_field.default_factory is not dataclasses.MISSING
               else config_field.default)
    text = config_field.metadata.get("help", "")
    choices = field_choices(config_field)
    if choices:
        text += f"; one of {', '.join(map(str, choices))}"
    if config_field.metadata.get("names"):
        text += f" ({', '.join(registry_choices(config_field.metadata['names']))})"
    if "default:" not in text:  # a help line may say what its default means itself
        shown = "none" if default is None else (json.dumps(default) if isinstance(default, (dict, bool)) else
                                                " ".join(map(str, default)) if isinstance(default, list) else default)
        text += f" (default: {shown})"
    return text.replace("%", "%%")


def _metavar(kind, choices) -> str:
    if choices:
        return "NAME"
    return {bool: "true|false", int: "N", float: "X", dict: "JSON"}.get(kind, "TEXT")


def value_converter(name: str, hint, optional: bool = False):
    """argparse's `type` for a setting of type `hint` (None too with `optional`; one command-line value, a list's
    each): the one reader of every setting (typed.read_value), so a flag, a config file and Python read the same
    text alike. The planner's own flags read their values with it too."""
    hint = hint | None if optional else hint
    option, kind = flag(name), element_type(hint)
    element = kind if is_list(hint) else hint  # a list's values one by one; _Store reads the list whole

    def convert(value: str):
        try:
            return read_value(element, value, option)
        except TypeError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = getattr(kind, "__name__", "value")
    return convert


def _dashed(arguments: typing.Sequence[str]) -> list[str]:
    """`--inner_updates` -> `--inner-updates` (the flat key spelt with underscores), other tokens as given."""
    out = []
    for token in arguments:
        head, sep, tail = token.partition("=")
        if head.startswith("--") and head[2:] in OPTIONS:
            token = flag(head[2:]) + sep + tail
        out.append(token)
    return out


def _given(argv: typing.Sequence[str], option: str) -> str | None:
    """The value of `option` in raw arguments (the last one given), or None."""
    value = None
    for index, token in enumerate(argv):
        if token == option and index + 1 < len(argv):
            value = argv[index + 1]
        elif token.startswith(option + "="):
            value = token.split("=", 1)[1]
    return value
