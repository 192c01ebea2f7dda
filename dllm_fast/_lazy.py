"""Package attributes loaded on first use (PEP 562), so that importing a package to list names (`train --help`)
does not import the torch-heavy modules behind them."""

from __future__ import annotations

import importlib
import sys
from typing import Callable


def lazy_attributes(package: str, exports: dict[str, str]) -> Callable[[str], object]:
    """A module-level `__getattr__` for `package`: `name` is imported from `package.<exports[name]>` when first
    read, then kept as an ordinary attribute."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
