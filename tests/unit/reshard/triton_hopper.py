"""Compiling a Triton kernel for Hopper (sm_90) on a machine without a GPU, and reading the
registers per thread ptxas gave it."""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _source(kernel: Any, args: Mapping[str, str], constexprs: Mapping[str, Any]) -> Any:
    """The kernel's arguments typed by `args`, every other one a constexpr: from `constexprs`,
    else its default (a launch fills those in; ASTSource does not), else None (an unused
    argument left out)."""
    from triton.compiler import ASTSource

    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}
    signature = {name: args.get(name, "constexpr") for name in kernel.arg_names}
    return ASTSource(fn=kernel, signature=signature, constexprs=defaults | dict(constexprs))


def compiles_for_hopper(
    kernel: Any, args: Mapping[str, str], constexprs: Mapping[str, Any], warps: int = 4
) -> str | None:
    """Compile `kernel` for sm_90 with argument types `args`, `constexprs` and `warps` per
    program; asserts PTX came out and returns it (or, where ptxas is missing, None: the
    front end ran without error)."""
    import triton
    from triton.backends.compiler import GPUTarget

    source = _source(kernel, args, constexprs)
    try:
        compiled = triton.compile(
            source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}
        )
    except RuntimeError as exc:  # no ptxas on this machine: the front end still ran
        if "ptxas" not in str(exc).lower():
            raise
        return None
    assert "ptx" in compiled.asm
    return str(compiled.asm["ptx"])


def registers_on_hopper(
    kernel: Any, args: Mapping[str, str], constexprs: Mapping[str, Any], warps: int = 4
) -> int:
    """Registers per thread ptxas gives `kernel` on sm_90a: its PTX (Triton's, from the
    cache or compiled now) assembled again by the ptxas Triton uses there, with Triton's
    register-allocation flag (`-v` prints the count; Triton's own run is skipped on a
    cache hit)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptx = compiles_for_hopper(kernel, args, constexprs, warps)
    assert ptx is not None, "no ptxas here"
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        done = subprocess.run(
            [get_ptxas(90).path, "-v", "--regAllocOptLevel=2", "--gpu-name=sm_90a",
             str(source), "-o", str(Path(tmp) / "kernel.cubin")],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.findall(r"Used (\d+) registers", done.stderr + done.stdout)
    assert found, f"no register count in ptxas' output:\n{done.stderr[-2000:]}"
    return int(found[-1])
