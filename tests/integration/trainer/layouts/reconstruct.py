"""Parent-side checks: rebuild every checkpoint tensor from the ranks' boxes and views."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from refitplane.reshard.boxes import Box, box_numel, full_box, to_slices
from refitplane.reshard.layout import Layout, LayoutBuilder, TensorSpec, merge_layouts
from refitplane.reshard.plan import Plan
from refitplane.reshard.planner import build_plan
from refitplane.reshard.shards import dtype_name


@dataclass(frozen=True)
class Piece:
    rank: int
    name: str
    shape: tuple[int, ...]
    box: Box
    data: torch.Tensor


def save_pieces(path: Path, rank: int, shards: Any) -> None:
    """In a worker: copy out what the views hold (the copies are for checking only)."""
    rows = [
        (sv.spec.name, list(sv.spec.shape), [list(r) for r in sv.box], sv.tensor.clone())
        for sv in shards
    ]
    torch.save({"rank": rank, "pieces": rows}, path)


def load_pieces(directory: Path) -> list[Piece]:
    pieces: list[Piece] = []
    for f in sorted(directory.glob("rank*.pt")):
        doc = torch.load(f, weights_only=True)
        for name, shape, box, data in doc["pieces"]:
            pieces.append(
                Piece(doc["rank"], name, tuple(shape), tuple((a, b) for a, b in box), data)
            )
    return pieces


def checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


@dataclass(frozen=True)
class Coverage:
    tensors: int
    pieces: int
    elements: int
    replicated_elements: int


def check_reconstruction(expected: dict[str, torch.Tensor], pieces: list[Piece]) -> Coverage:
    """Every expected element is held, by exact values; nothing else is published.

    Elements held by several ranks are replicas (data-parallel copies, the tied
    embedding on two pipeline stages); each copy must equal the checkpoint too.
    """
    published = {p.name for p in pieces}
    assert published == set(expected), (
        f"missing: {sorted(set(expected) - published)}; extra: {sorted(published - set(expected))}"
    )
    counts = {name: torch.zeros(t.shape, dtype=torch.int32) for name, t in expected.items()}
    for p in pieces:
        want = expected[p.name]
        assert p.shape == tuple(want.shape), (p.name, p.shape, tuple(want.shape))
        assert p.data.dtype == want.dtype, (p.name, p.data.dtype, want.dtype)
        region = to_slices(p.box)
        assert torch.equal(p.data, want[region]), f"{p.name} {p.box} on rank {p.rank} differs"
        counts[p.name][region] += 1
    replicated = 0
    for name, c in counts.items():
        assert int(c.min()) >= 1, f"{name}: {int((c == 0).sum())} elements held by no rank"
        replicated += int((c > 1).sum())
    return Coverage(
        tensors=len(expected),
        pieces=len(pieces),
        elements=sum(t.numel() for t in expected.values()),
        replicated_elements=replicated,
    )


def source_layout(pieces: list[Piece]) -> Layout:
    per_rank: dict[int, LayoutBuilder] = {}
    for p in pieces:
        spec = TensorSpec.create(p.name, p.shape, dtype_name(p.data.dtype))
        per_rank.setdefault(p.rank, LayoutBuilder()).add(spec, p.rank, p.box)
    return merge_layouts(b.build() for b in per_rank.values())


def plan_to_single_rank(pieces: list[Piece]) -> Plan:
    """Plan from the union of the ranks' layouts to one rank that needs everything whole."""
    source = source_layout(pieces)
    target_rank = max(source.ranks()) + 1
    target = LayoutBuilder()
    for t in source:
        target.add(t.spec, target_rank, full_box(t.spec.shape))
    plan = build_plan(source, target.build())
    moved = sum(box_numel(piece.box) for link in plan.links for piece in link.pieces)
    assert moved == sum(t.spec.numel for t in source), "the plan does not move every element once"
    return plan
