"""Loading a Triton kernel on first use. The kernel modules (`checksum_kernel`,
`chunk_copy_kernel`, `copy_sums_kernel`) import Triton at the top; the modules that launch
them name them here instead, and where Triton is not installed get None and take their
torch path."""

from __future__ import annotations

import functools
import importlib
from typing import Any


@functools.cache
def load_kernel(module: str, name: str) -> Any:
    """The `@triton.jit` function `name` of `module` (compiled on its first launch), or None
    where Triton cannot be imported."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return None
