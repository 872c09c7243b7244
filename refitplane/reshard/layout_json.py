"""The public JSON form of a layout (documented in docs/layout-format.md).

    {"tensors": [
      {"name": "model.embed_tokens.weight", "shape": [8, 4], "dtype": "bfloat16",
       "mesh": {"shape": [2, 2], "ranks": [0, 1, 2, 3]},
       "placements": [{"shard": 0}, "replicate"]},
      {"name": "model.norm.weight", "shape": [4], "dtype": "float32",
       "boxes": {"0": [[[0, 4]]], "1": [[[0, 2]], [[2, 4]]]}}
    ]}

Each entry gives a tensor's spec plus a DTensor-style description (`mesh` + `placements`),
explicit `boxes` per rank, or both. A name may appear in several entries; they merge.
Errors name the JSON path of the bad field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from refitplane.errors import LayoutError
from refitplane.reshard.boxes import Box
from refitplane.reshard.layout import Layout, LayoutBuilder, TensorSpec
from refitplane.reshard.placements import DeviceMesh, Placement, Replicate, Shard


def _fail(path: str, message: str, tensor: str | None = None) -> LayoutError:
    return LayoutError(f"{path}: {message}", tensor=tensor, field=path)


def _int(value: Any, path: str, tensor: str | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(path, f"expected an integer, got {value!r}", tensor)
    return value


def _int_list(value: Any, path: str, tensor: str | None) -> list[int]:
    if not isinstance(value, list):
        raise _fail(path, f"expected a list of integers, got {type(value).__name__}", tensor)
    return [_int(v, f"{path}[{i}]", tensor) for i, v in enumerate(value)]


def _placement(value: Any, path: str, tensor: str | None) -> Placement:
    if value == "replicate" or value == {"replicate": True}:
        return Replicate()
    if isinstance(value, dict) and set(value) == {"shard"}:
        return Shard(_int(value["shard"], f"{path}.shard", tensor))
    raise _fail(path, f'expected "replicate" or {{"shard": <dim>}}, got {value!r}', tensor)


def _box(value: Any, path: str, tensor: str | None) -> Box:
    if not isinstance(value, list):
        raise _fail(path, f"expected a list of [start, stop] pairs, got {value!r}", tensor)
    out = []
    for i, pair in enumerate(value):
        if not isinstance(pair, list) or len(pair) != 2:
            raise _fail(f"{path}[{i}]", f"expected [start, stop], got {pair!r}", tensor)
        out.append(
            (_int(pair[0], f"{path}[{i}][0]", tensor), _int(pair[1], f"{path}[{i}][1]", tensor))
        )
    return tuple(out)


def _add_entry(builder: LayoutBuilder, entry: Any, path: str) -> None:
    if not isinstance(entry, dict):
        raise _fail(path, "expected an object")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise _fail(f"{path}.name", "missing or not a non-empty string")
    unknown = set(entry) - {"name", "shape", "dtype", "mesh", "placements", "boxes"}
    if unknown:
        raise _fail(path, f"unknown field(s) {sorted(unknown)}", name)
    if "shape" not in entry or "dtype" not in entry:
        raise _fail(path, "needs both 'shape' and 'dtype'", name)
    if not isinstance(entry["dtype"], str):
        raise _fail(f"{path}.dtype", f"expected a string, got {entry['dtype']!r}", name)
    spec = TensorSpec.create(name, _int_list(entry["shape"], f"{path}.shape", name), entry["dtype"])
    builder.add_spec(spec)
    has_mesh = "mesh" in entry or "placements" in entry
    if has_mesh:
        mesh_obj = entry.get("mesh")
        if not isinstance(mesh_obj, dict) or "shape" not in mesh_obj:
            raise _fail(f"{path}.mesh", "expected {'shape': [...], 'ranks': [...]}", name)
        mesh_shape = _int_list(mesh_obj["shape"], f"{path}.mesh.shape", name)
        ranks = mesh_obj.get("ranks")
        mesh = DeviceMesh.create(
            mesh_shape,
            None if ranks is None else _int_list(ranks, f"{path}.mesh.ranks", name),
            tensor=name,
        )
        raw_placements = entry.get("placements")
        if not isinstance(raw_placements, list):
            raise _fail(
                f"{path}.placements", "expected a list with one placement per mesh dimension", name
            )
        placements = [
            _placement(p, f"{path}.placements[{i}]", name) for i, p in enumerate(raw_placements)
        ]
        builder.add_placements(spec, mesh, placements)
    if "boxes" in entry:
        boxes = entry["boxes"]
        if not isinstance(boxes, dict):
            raise _fail(f"{path}.boxes", 'expected {"<rank>": [box, ...]}', name)
        for key, rank_boxes in boxes.items():
            try:
                rank = int(key)
            except (TypeError, ValueError):
                raise _fail(f"{path}.boxes", f"rank key {key!r} is not an integer", name) from None
            if not isinstance(rank_boxes, list):
                raise _fail(f"{path}.boxes.{key}", "expected a list of boxes", name)
            for i, raw in enumerate(rank_boxes):
                builder.add(spec, rank, _box(raw, f"{path}.boxes.{key}[{i}]", name))
    if not has_mesh and "boxes" not in entry:
        raise _fail(path, "needs 'mesh' + 'placements' or 'boxes'", name)


def parse_layout(doc: Any) -> Layout:
    """Build a validated layout from the JSON document (already decoded)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("tensors"), list):
        raise _fail("tensors", 'the document must be {"tensors": [...]}')
    builder = LayoutBuilder()
    for i, entry in enumerate(doc["tensors"]):
        _add_entry(builder, entry, f"tensors[{i}]")
    return builder.build()


def load_layout(path: str | Path) -> Layout:
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise LayoutError(f"{path}: not valid JSON ({exc})", field=str(path)) from None
    return parse_layout(doc)


def dump_layout(layout: Layout) -> dict[str, Any]:
    """The explicit-boxes JSON form (round-trips through `parse_layout`)."""
    tensors = []
    for t in layout:
        boxes: Mapping[str, list[list[list[int]]]] = {
            str(rank): [[[start, stop] for start, stop in box] for box in rank_boxes]
            for rank, rank_boxes in sorted(t.boxes.items())
        }
        tensors.append(
            {
                "name": t.spec.name,
                "shape": list(t.spec.shape),
                "dtype": t.spec.dtype,
                "boxes": boxes,
            }
        )
    return {"tensors": tensors}
