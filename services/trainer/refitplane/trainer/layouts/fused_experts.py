"""Per-expert checkpoint names for the fused expert tensors of `transformers` 5.x MoE models.

transformers 5 keeps a Qwen2/Qwen3-MoE layer's experts as two 3-D parameters,
`mlp.experts.gate_up_proj` `[E, 2F, H]` (gate rows, then up rows) and
`mlp.experts.down_proj` `[E, H, F]`, but `save_pretrained` writes (and vLLM's
`load_weights` reads) one tensor per expert: `mlp.experts.{e}.{gate,up,down}_proj.weight`.
A held box of a fused tensor splits into boxes of those per-expert tensors, each still a
view of the same local memory.
"""

from __future__ import annotations

import re

from refitplane.errors import LayoutError
from refitplane.reshard.boxes import format_box
from refitplane.trainer.layouts.held import HeldSlice

_FUSED = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def is_fused_experts(name: str) -> bool:
    return _FUSED.match(name) is not None


def unfuse_experts(held: HeldSlice) -> list[HeldSlice]:
    """Split a held box of a fused expert tensor into per-expert boxes (other names pass)."""
    match = _FUSED.match(held.name)
    if match is None:
        return [held]
    if len(held.shape) != 3:
        raise LayoutError(
            f"fused experts tensor must be 3-D [experts, rows, cols], got {list(held.shape)}",
            tensor=held.name,
            field="shape",
        )
    prefix, kind = match["prefix"], match["kind"]
    (e0, e1), (r0, r1), cols = held.box
    _, rows, width = held.shape
    out: list[HeldSlice] = []
    if kind == "down_proj":
        for e in range(e0, e1):
            out.append(
                HeldSlice(
                    f"{prefix}.{e}.down_proj.weight",
                    (rows, width),
                    ((r0, r1), cols),
                    held.view[e - e0],
                )
            )
        return out
    if rows % 2:
        raise LayoutError(
            f"gate_up_proj has {rows} rows, not gate and up halves of equal size",
            tensor=held.name,
            box=format_box(held.box),
            field="shape",
        )
    ffn = rows // 2
    for e in range(e0, e1):
        for part, lo in (("gate_proj", 0), ("up_proj", ffn)):
            a, b = max(r0, lo), min(r1, lo + ffn)
            if a < b:
                out.append(
                    HeldSlice(
                        f"{prefix}.{e}.{part}.weight",
                        (ffn, width),
                        ((a - lo, b - lo), cols),
                        held.view[e - e0, a - r0 : b - r0],
                    )
                )
    return out
