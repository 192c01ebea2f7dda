"""Config values of a declared type, from a file, the command line or Python: checked strictly (a boolean is true or
false, never the string "false"), with the place the value came from in the message."""

from __future__ import annotations

import os
import reprlib
import typing
from typing import Any



def _short_repr() -> reprlib.Repr:
    """Values as messages show them: a value read from a file may be large, and its message stays one short line."""
    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxdict, short.maxstring, short.maxother = 2, 4, 4, 60, 60
    return short


_shown = _short_repr().repr


def check_type(hint, value: Any, where: str, *, from_file: bool = False, example: str = "") -> Any:
    """`value` as a field of type `hint` holds it, or a TypeError naming `where` (a flag, or a file and key).
    Booleans must be true or false themselves: the strings "false" or "no" are refused, never read as true. A
    file's number written as a string that YAML does not read as one (1e-4) is taken as that number."""
    optional = type(None) in typing.get_args(hint)
    if value is None:
        if optional:
            return None
        raise TypeError(f"{where} is null; it needs {_describe(hint)}.")
    words = literal_words(hint)  # `int | Literal["auto"]`: the word, or a value of the other type
    if words:
        if isinstance(value, str) and value in words:
            return value
        hint = next(h for h in typing.get_args(hint) if typing.get_origin(h) is not typing.Literal)
        if isinstance(value, str) and hint is not str:
            raise TypeError(f"{where} = {_shown(value)} must be {_describe(hint)} or {' or '.join(words)}.")
        try:
            return check_type(hint, value, where, from_file=from_file, example=example)
        except TypeError as error:
            raise TypeError(f"{str(error).rstrip('.')}, or {' or '.join(words)}.") from None
    kind = next(h for h in typing.get_args(hint) if h is not type(None)) if optional else hint
    origin = typing.get_origin(kind)
    if origin is list or kind is list:
        element = typing.get_args(kind)[0] if typing.get_args(kind) else str
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise TypeError(f"{where} = {_shown(value)} must be a list of {_PLURAL[element]}"
                            f"{f', e.g. {example}' if example else ''}.")
        return [_scalar(element, item, f"{where}[{index}]", from_file) for index, item in enumerate(value)]
    if kind is dict or origin is dict:
        if not isinstance(value, dict):
            raise TypeError(f"{where} = {_shown(value)} must be a mapping of option names to values (JSON object), "
                            "e.g. {\"n_t\": 4}, not a " + type(value).__name__ + ".")
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{where} has the key {_shown(bad[0])}; option names are strings.")
        return dict(value)
    return _scalar(kind, value, where, from_file)


def literal_words(hint) -> tuple[str, ...]:
    """The words a `T | Literal["word", ...]` hint accepts besides values of T (none for other hints)."""
    return tuple(word for h in typing.get_args(hint) if typing.get_origin(h) is typing.Literal
                 for word in typing.get_args(h))


def _scalar(kind, value, where: str, from_file: bool):
    if kind is bool:
        if not isinstance(value, bool):
            quoted = " (a string: write true or false without quotes)" if isinstance(value, str) else ""
            raise TypeError(f"{where} = {_shown(value)} must be true or false{quoted}.")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{where} = {_shown(value)} must be an integer.")
        return value
    if kind is float:
        if from_file and isinstance(value, str):
            try:
                value = float(value)  # YAML 1.1 reads 1e-4 (no dot) as a string
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{where} = {_shown(value)} must be a number.")
        return float(value)
    if isinstance(value, os.PathLike):  # a pathlib.Path for --output-dir, --model, --tokenizer from Python
        value = os.fspath(value)
    if not isinstance(value, str):
        raise TypeError(f"{where} = {_shown(value)} must be a string.")
    return value


def _describe(kind) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(kind, "a value")


_PLURAL = {int: "integers", float: "numbers", str: "strings"}
