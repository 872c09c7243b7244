"""Loading a Triton kernel on first use. The kernel modules (`checksum_kernel`,
`chunk_copy_kernel`, `copy_sums_kernel`) import Triton at the top; the modules that launch
them name them here instead, and where Triton is not installed get None and take their
torch path."""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any

from refitplane.errors import InvalidArgument


def launch_setting(name: str, default: int, lowest: int, highest: int) -> int:
    """A launch setting from the environment (a kernel's shape, the posting loop's group
    taper), a power of two (or 0) from `lowest` to `highest` (read once, at import; settings
    for measuring one shape against another)."""
    raw = os.environ.get(name, "").strip()
    value = int(raw) if raw.isdigit() else (default if not raw else -1)
    if not lowest <= value <= highest or value & (value - 1):
        raise InvalidArgument(
            f"{name} must be a power of two from {lowest} to {highest}, got {raw!r}", field=name
        )
    return value


@functools.cache
def load_kernel(module: str, name: str) -> Any:
    """The `@triton.jit` function `name` of `module` (compiled on its first launch), or None
    where Triton cannot be imported."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return None
