"""Small checks for values at the public boundary. Each raises with the argument's name, the value it got, and
what it needs, so that every layer words the same mistake the same way. Check a value once, where it enters."""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Iterable

import torch
from torch._guards import detect_fake_mode


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


def nearest_multiples(value: int, unit: int) -> tuple[int, ...]:
    """The multiples of `unit` nearest `value`, below (when above 0) and above: what an error message offers."""
    lower = value // unit * unit
    return (lower, lower + unit) if lower else (lower + unit,)


def check_same_device(where: str, **tensors: torch.Tensor | None) -> torch.device:
    """Every given tensor (None skipped) on one real device, the first one's; returns that device. A tensor on
    meta holds no data, and one on another device would win the dispatch, so each is named."""
    given = [(name, tensor) for name, tensor in tensors.items() if tensor is not None]
    for name, tensor in given:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(tensor).__name__}.")
        if tensor.device.type == "meta":
            raise ValueError(f"{where}: {name} is on the meta device and holds no data; pass a tensor on a real "
                             "device (load or initialise the weights first).")
    first_name, first = given[0]
    for name, tensor in given[1:]:
        if tensor.device != first.device:
            raise ValueError(f"{where}: {name} is on {tensor.device} but {first_name} on {first.device}; move it "
                             f"with .to({first_name}.device).")
    return first.device


# Below this temperature sampling is greedy. logits / T would leave fp32's range for |logit| > T * 3.4e38 (and
# 1 / T itself overflows below 2.9e-39), while the Gumbel noise (|g| < 23) can no longer move the argmax unless
# two logits lie within 23 * T of each other.
GREEDY_BELOW_TEMPERATURE = 1e-30


def check_temperature(name: str, value) -> float:
    """A sampling temperature: a finite number >= 0. Returns the temperature to sample at: 0.0 (greedy) when
    value < GREEDY_BELOW_TEMPERATURE, where softmax(logits / T) is the argmax up to exact ties."""
    temperature = check_float(name, value, minimum=0.0,
                              hint="0 is greedy; infinity is not supported, a large finite T is near-uniform")
    return 0.0 if temperature < GREEDY_BELOW_TEMPERATURE else temperature


def check_threshold(name: str, value) -> float:
    """A confidence threshold in (0, 1]."""
    return check_float(name, value, minimum=0.0, maximum=1.0, open_minimum=True)


def check_binary_mask(name: str, mask, *, shape: tuple[int, ...], device: torch.device,
                      check_values: bool = True) -> torch.Tensor:
    """A 0/1 mask of `shape` on `device`: bool, or an integer dtype holding only 0 and 1. Floats are rejected:
    0.5 would read as True to one consumer and as 0 to another. Returns it as bool. check_values=False skips
    the one check that reads the values (a host sync), for a caller that batches it with others
    (`non_binary(mask)`)."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of 0/1 (or bool), got {type(mask).__name__}.")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(mask.shape)}, expected {tuple(shape)}.")
    if mask.device != torch.device(device):
        raise ValueError(f"{name} is on {mask.device} but must be on {device}; move it with .to({str(device)!r}).")
    if mask.is_floating_point() or mask.is_complex():
        raise TypeError(f"{name} has dtype {mask.dtype}; it must be bool or an integer dtype holding 0 and 1 "
                        f"(convert a float mask with {name}.round().long() if it is meant to be 0/1).")
    if check_values and mask.dtype != torch.bool:
        bad = non_binary(mask)
        if bad.any():
            index = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(f"{name}[{', '.join(map(str, index))}] = {int(mask[index])}; a mask holds only 0 "
                             "(padding) and 1 (token).")
    return mask.to(torch.bool)


def non_binary(mask: torch.Tensor) -> torch.Tensor:
    """Where a 0/1 mask holds another value (all False for a bool mask); no host sync."""
    return (mask != 0) & (mask != 1) if mask.dtype != torch.bool else torch.zeros_like(mask)


# -- when a check may read tensor values ----------------------------------------------------------------------
# A check that reads values (`.item()`, `nonzero`, the truth value of a tensor, `tolist`) is a host sync: the host
# waits for the device. Such checks run at public boundaries, once per call, and only where
# `data_checks_enabled` says they can; a hot loop (a denoising step) never runs one.

_VALUES_CHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar("dllm_fast_values_checked", default=False)


def data_checks_enabled(*tensors: torch.Tensor | None) -> bool:
    """Whether a check that reads the values of `tensors` may run here. No when:

    - torch.compile is tracing (a value read would break the graph, and a CUDA graph cannot hold a sync);
    - a tensor holds no data: a fake tensor (FakeTensorMode, as the planner runs it), a meta tensor, or any tensor
      while a FakeTensorMode is active;
    - inside `values_checked()`: the public entry point has checked these values already (generate checks the
      prompts once, so the model forward does not check them again at every denoising step).

    Otherwise yes. A skipped check is skipped, not deferred: the caller of a compiled or fake run owns its inputs."""
    if torch.compiler.is_compiling():  # first: dynamo folds it to a constant and traces nothing below
        return False
    if _VALUES_CHECKED.get():
        return False
    given = [tensor for tensor in tensors if isinstance(tensor, torch.Tensor)]
    if any(tensor.is_meta for tensor in given):
        return False
    return detect_fake_mode(given) is None


@contextlib.contextmanager
def values_checked():
    """Within this context, inner layers skip their value checks (`data_checks_enabled` is False): the caller
    has checked the values at its boundary, and the loop it runs would otherwise repeat a host sync per step."""
    previous = _VALUES_CHECKED.get()
    try:  # set inside: an interrupt right after set() (where a Ctrl-C lands) must not leave the checks off
        _VALUES_CHECKED.set(True)
        yield
    finally:
        _VALUES_CHECKED.set(previous)
