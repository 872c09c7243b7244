"""Compiling a Triton kernel for Hopper (sm_90) on a machine without a GPU."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def compiles_for_hopper(
    kernel: Any, args: Mapping[str, str], constexprs: Mapping[str, Any]
) -> str | None:
    """Compile `kernel` for sm_90 with argument types `args` and `constexprs`; asserts PTX
    came out and returns it (or, where ptxas is missing, None: the front end ran without
    error)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**args, **dict.fromkeys(constexprs, "constexpr")}
    src = ASTSource(fn=kernel, signature=signature, constexprs=dict(constexprs))
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    except RuntimeError as exc:  # no ptxas on this machine: the front end still ran
        if "ptxas" not in str(exc).lower():
            raise
        return None
    assert "ptx" in compiled.asm
    return str(compiled.asm["ptx"])
