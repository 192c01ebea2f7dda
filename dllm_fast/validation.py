"""Small checks for values at the public boundary. Each raises with the argument's name, the value it got, and
what it needs, so that every layer words the same mistake the same way. Check a value once, where it enters."""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch


def check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None,
              hint: str = "") -> int:
    """An int (not a bool) in [minimum, maximum]; returns it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be an int{_range(minimum, maximum)}{_hint(hint)}.")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name}={value!r} must be an int{_range(minimum, maximum)}{_hint(hint)}.")
    return value


def check_float(name: str, value: Any, *, minimum: float | None = None, maximum: float | None = None,
                open_minimum: bool = False, open_maximum: bool = False, hint: str = "") -> float:
    """A finite real number (int or float, not bool) in the given interval; returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number{_interval(minimum, maximum, open_minimum, open_maximum)}"
                         f"{_hint(hint)}.")
    value = float(value)
    low_bad = minimum is not None and (value <= minimum if open_minimum else value < minimum)
    high_bad = maximum is not None and (value >= maximum if open_maximum else value > maximum)
    if low_bad or high_bad:
        raise ValueError(f"{name}={value!r} must be{_interval(minimum, maximum, open_minimum, open_maximum)}"
                         f"{_hint(hint)}.")
    return value


def check_probability(name: str, value: Any, hint: str = "") -> float:
    return check_float(name, value, minimum=0.0, maximum=1.0, hint=hint)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False.")
    return value


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {choices}.")
    return value


def check_tensor(name: str, value: Any, *, dim: int | None = None, dtypes: Iterable[torch.dtype] | None = None,
                 device: torch.device | None = None) -> torch.Tensor:
    """A tensor with the given number of dimensions, one of `dtypes`, on `device` (a meta tensor never passes
    unless `device` is meta: it holds no data)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}.")
    if dim is not None and value.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(value.shape)}.")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if value.dtype not in dtypes:
            raise TypeError(f"{name} has dtype {value.dtype}; it must be one of {dtypes}.")
    if device is not None and value.device != torch.device(device):
        raise ValueError(f"{name} is on {value.device} but must be on {device}; move it with .to({str(device)!r}).")
    if device is None and value.device.type == "meta":
        raise ValueError(f"{name} is on the meta device and holds no data; pass a tensor on a real device.")
    return value


def _range(minimum, maximum) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""


def _interval(minimum, maximum, open_minimum, open_maximum) -> str:
    if minimum is None and maximum is None:
        return ""
    if minimum is not None and maximum is not None:
        return f" in {'(' if open_minimum else '['}{minimum}, {maximum}{')' if open_maximum else ']'}"
    if minimum is not None:
        return f" {'>' if open_minimum else '>='} {minimum}"
    return f" {'<' if open_maximum else '<='} {maximum}"


def _hint(hint: str) -> str:
    return f" ({hint})" if hint else ""
