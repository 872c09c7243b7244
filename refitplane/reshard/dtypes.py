"""Dtype names as they appear in layouts, with their sizes. No torch import here."""

from __future__ import annotations

from typing import Final

from refitplane.errors import LayoutError

ITEMSIZE: Final[dict[str, int]] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

_ALIASES: Final[dict[str, str]] = {
    "float": "float32",
    "double": "float64",
    "half": "float16",
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    "long": "int64",
    "int": "int32",
}


def canonical_dtype(name: str, *, tensor: str | None = None) -> str:
    """Normalise a dtype name (`torch.bfloat16`, `bf16`, `bfloat16` → `bfloat16`)."""
    short = name.removeprefix("torch.")
    short = _ALIASES.get(short, short)
    if short not in ITEMSIZE:
        known = ", ".join(sorted(ITEMSIZE))
        raise LayoutError(f"unknown dtype {name!r} (known: {known})", tensor=tensor, field="dtype")
    return short


def itemsize(name: str) -> int:
    return ITEMSIZE[name]
