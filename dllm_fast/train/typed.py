"""Settings of a declared type, read one way wherever they come from: a command-line flag, a YAML or JSON config
file, config.json on resume, or `TrainConfig(...)` in Python. The same value is accepted or refused whichever way
it arrives, with the place it came from in the message.

The rule: a value already of its field's type is taken as it is; any other value is read from its text, exactly as
the flag reads that text. A YAML file's scalars are their text as written (`compile: 1` reads as `--compile 1`,
`steps: '10'` as `--steps 10`, `micro_batch: Auto` as `--micro-batch Auto`); a JSON or Python number or boolean is
its JSON spelling (1, 1e-05, true). One reader per type (`read_value` picks it from the field's hint):

- bool: true/false, yes/no, on/off or 1/0, in any case;
- int: decimal digits with an optional sign (and _ between digits), never a bool nor a float such as 2.0;
- float: a decimal number (1e-4, 0.5, 3); its range is the field's own check;
- str: the text (a path is its string, a number its spelling);
- None, for an optional field: none, null, ~ or nothing;
- a field's word (`int | Literal["auto"]`): the word in any case;
- list: a sequence of the element's values, or one value (a list of one, as a flag given one value is);
- dict: a mapping with string keys (values as its notation types them), or a JSON object's text (the flag's form).
"""

from __future__ import annotations

import json
import math
import os
import re
import reprlib
import types
import typing
from typing import Any


def _short_repr() -> reprlib.Repr:
    """Values as messages show them: a value read from a file may be large, and its message stays one short line."""
    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxdict, short.maxstring, short.maxother = 2, 4, 4, 60, 60
    return short


_repr = _short_repr().repr


class Scalar(str):
    """A config file's scalar: its text as written (what every reader but a mapping's reads), the value its notation
    gives it (`typed`, what a mapping setting such as --objective-options holds), and whether it was written plain
    (unquoted: messages show a number so written as it was)."""

    typed: Any
    plain: bool

    def __new__(cls, text: str, typed: Any = None, plain: bool = True) -> "Scalar":
        scalar = super().__new__(cls, text)
        scalar.typed, scalar.plain = typed, plain
        return scalar


def shown(value: Any) -> str:
    """A value as a message shows it: a file's unquoted number, boolean or null as written, anything else as its
    short repr (text quoted)."""
    if isinstance(value, Scalar):
        written = str.__str__(value)
        return written if value.plain and written and not isinstance(value.typed, str) else repr(written)
    return _repr(plain_value(value))


def plain_value(value: Any) -> Any:
    """A file's value as its notation types it (Scalar -> its typed value, recursively), for settings that hold
    what their notation says (a mapping of an objective's options)."""
    if isinstance(value, Scalar):
        return value.typed
    if isinstance(value, dict):
        return {plain_value(key): plain_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_value(item) for item in value]
    return value


def read_value(hint, value: Any, where: str, *, example: str = "") -> Any:
    """`value` as a field of type `hint` holds it (see the module docstring), or a TypeError naming `where` (a
    flag, or a file and key), the value and what it must be."""
    words = literal_words(hint)
    kind = _kind(hint)
    if _is_list(kind) and _optional(hint) and isinstance(value, (list, tuple)) and len(value) == 1 and (
            isinstance(value[0], str) and value[0].strip().lower() in _NULL_WORDS):
        value = value[0]  # `--lora-targets none`: one flag value that says none
    if value is None or (isinstance(value, str) and _optional(hint) and value.strip().lower() in _NULL_WORDS):
        if _optional(hint):
            return None
        raise TypeError(f"{where} is {'null' if value is None else shown(value)}; it needs {_describe(kind, words)}.")
    if words and isinstance(value, str) and value.strip().lower() in words:
        return value.strip().lower()
    if _is_list(kind):
        element = (typing.get_args(kind) or (str,))[0]
        if isinstance(value, dict):
            raise TypeError(f"{where} = {shown(value)} must be a list of {_PLURAL.get(element, 'values')}"
                            f"{f', e.g. {example}' if example else ''}.")
        if isinstance(value, (list, tuple)):
            return [_scalar(element, item, f"{where}[{index}]", words=()) for index, item in enumerate(value)]
        return [_scalar(element, value, where, words=())]  # one value: a list of one, as the flag reads it
    if kind is dict or typing.get_origin(kind) is dict:
        return _mapping(value, where)
    return _scalar(kind, value, where, words=words)


def literal_words(hint) -> tuple[str, ...]:
    """The words a `T | Literal["word", ...]` hint accepts besides values of T (none for other hints)."""
    return tuple(word for h in typing.get_args(hint) if typing.get_origin(h) is typing.Literal
                 for word in typing.get_args(h))


def element_type(hint):
    """The type one command-line value is read as: list[int] -> int, int | None -> int, dict -> dict."""
    kind = _kind(hint)
    if _is_list(kind):
        return (typing.get_args(kind) or (str,))[0]
    return dict if kind is dict or typing.get_origin(kind) is dict else kind


def is_list(hint) -> bool:
    return _is_list(_kind(hint))


def _kind(hint):
    """The hint without None and its Literal words: `int | Literal["auto"] | None` -> int."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [h for h in typing.get_args(hint)
                if h is not type(None) and typing.get_origin(h) is not typing.Literal]
        return rest[0] if len(rest) == 1 else hint
    return hint


def _optional(hint) -> bool:
    return type(None) in typing.get_args(hint)


def _is_list(kind) -> bool:
    return kind is list or typing.get_origin(kind) is list


_NULL_WORDS = ("none", "null", "~", "")
_TRUE_WORDS, _FALSE_WORDS = ("true", "yes", "on", "1"), ("false", "no", "off", "0")
_INT_TEXT = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*")


def _text(value: Any) -> str | None:
    """The text a value is read from when it is not of its field's type: a string itself, a path its string, a
    JSON or Python number or boolean its JSON spelling; None for anything else (a list, a mapping, an object)."""
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (bool, int, float)):
        return json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else repr(value)
    if hasattr(value, "item") and getattr(value, "shape", None) == ():  # a NumPy or torch scalar
        return _text(value.item())
    return None


def _scalar(kind, value, where: str, *, words: tuple[str, ...]):
    also = "".join(f" or {word}" for word in words)
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = _text(value)
        if text is not None and text.strip().lower() in _TRUE_WORDS + _FALSE_WORDS:
            return text.strip().lower() in _TRUE_WORDS
        raise TypeError(f"{where} = {shown(value)} must be true or false{also}.")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        text = _text(value) if not isinstance(value, bool) else None
        if text is not None and _INT_TEXT.fullmatch(text.strip()):
            return int(text.strip())
        raise TypeError(f"{where} = {shown(value)} must be an integer{also}.")
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        text = _text(value) if not isinstance(value, bool) else None
        if text is not None and text.isascii():
            try:
                return float(text)
            except ValueError:
                pass
        raise TypeError(f"{where} = {shown(value)} must be a number{also}.")
    text = _text(value)
    if text is None:
        raise TypeError(f"{where} = {shown(value)} must be a string{also}.")
    return text


def _mapping(value, where: str) -> dict:
    given = value
    if isinstance(value, str):  # a JSON object's text, as the flag takes it
        try:
            value = json.loads(str.__str__(value))
        except json.JSONDecodeError as error:
            raise TypeError(f"{where} = {shown(value)} must be a mapping of option names to values (a JSON object, "
                            f"e.g. '{{\"n_t\": 4}}'); it is no JSON ({error}).") from None
    if not isinstance(value, dict):
        raise TypeError(f"{where} = {shown(given)} must be a mapping of option names to values (JSON object), "
                        "e.g. {\"n_t\": 4}, not a " + ("list" if isinstance(value, (list, tuple)) else
                                                       type(plain_value(value)).__name__) + ".")
    value = plain_value(value)
    bad = [key for key in value if not isinstance(key, str)]
    if bad:
        raise TypeError(f"{where} has the key {_repr(bad[0])}; option names are strings.")
    return dict(value)


def _describe(kind, words: tuple[str, ...] = ()) -> str:
    text = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(kind, "a value")
    if _is_list(kind):
        text = f"a list of {_PLURAL.get((typing.get_args(kind) or (str,))[0], 'values')}"
    if kind is dict or typing.get_origin(kind) is dict:
        text = "a mapping of option names to values"
    return text + "".join(f" or {word}" for word in words)


_PLURAL = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}
