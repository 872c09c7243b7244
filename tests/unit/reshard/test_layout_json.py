from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from refitplane.errors import LayoutError
from refitplane.reshard.layout_json import dump_layout, load_layout, parse_layout

pytestmark = pytest.mark.unit

EXAMPLE = {
    "tensors": [
        {
            "name": "model.embed_tokens.weight",
            "shape": [8, 4],
            "dtype": "bfloat16",
            "mesh": {"shape": [2, 2], "ranks": [0, 1, 2, 3]},
            "placements": [{"shard": 0}, "replicate"],
        },
        {
            "name": "model.norm.weight",
            "shape": [4],
            "dtype": "float32",
            "boxes": {"0": [[[0, 4]]], "1": [[[0, 2]], [[2, 4]]]},
        },
    ]
}


def test_example_parses_and_round_trips() -> None:
    layout = parse_layout(EXAMPLE)
    emb = layout.tensors["model.embed_tokens.weight"]
    assert emb.boxes == {
        0: (((0, 4), (0, 4)),),
        1: (((0, 4), (0, 4)),),
        2: (((4, 8), (0, 4)),),
        3: (((4, 8), (0, 4)),),
    }
    assert layout.tensors["model.norm.weight"].boxes[1] == (((0, 2),), ((2, 4),))
    again = parse_layout(json.loads(json.dumps(dump_layout(layout))))
    assert again.digest == layout.digest


def test_checked_in_examples_load() -> None:
    root = Path(__file__).resolve().parents[3] / "examples" / "layouts"
    files = sorted(root.glob("*.json"))
    assert files
    for f in files:
        assert len(load_layout(f)) > 0


def _with(entry: dict[str, Any]) -> dict[str, Any]:
    return {"tensors": [entry]}


@pytest.mark.parametrize(
    ("doc", "field", "message"),
    [
        ({"tensor": []}, "tensors", "must be"),
        (_with({"shape": [2], "dtype": "bfloat16", "boxes": {}}), "tensors[0].name", "missing"),
        (
            _with({"name": "w", "shape": [2, "x"], "dtype": "bfloat16", "boxes": {}}),
            "tensors[0].shape[1]",
            "expected an integer",
        ),
        (
            _with({"name": "w", "shape": [2], "dtype": 3, "boxes": {}}),
            "tensors[0].dtype",
            "expected a string",
        ),
        (_with({"name": "w", "shape": [2], "dtype": "bfloat16"}), "tensors[0]", "needs 'mesh'"),
        (
            _with({"name": "w", "shape": [2], "dtype": "bfloat16", "boxes": {"a": []}}),
            "tensors[0].boxes",
            "rank key 'a'",
        ),
        (
            _with({"name": "w", "shape": [2], "dtype": "bfloat16", "boxes": {"0": [[[0, 1, 2]]]}}),
            "tensors[0].boxes.0[0][0]",
            "expected [start, stop]",
        ),
        (
            _with(
                {
                    "name": "w",
                    "shape": [2],
                    "dtype": "bfloat16",
                    "mesh": {"shape": [2]},
                    "placements": ["sideways"],
                }
            ),
            "tensors[0].placements[0]",
            'expected "replicate"',
        ),
        (
            _with(
                {
                    "name": "w",
                    "shape": [2],
                    "dtype": "bfloat16",
                    "mesh": {"shape": [2]},
                    "placements": [{"shard": 0}],
                    "extra": 1,
                }
            ),
            "tensors[0]",
            "unknown field",
        ),
    ],
)
def test_errors_name_the_json_path(doc: dict[str, Any], field: str, message: str) -> None:
    with pytest.raises(LayoutError) as err:
        parse_layout(doc)
    assert err.value.field == field
    assert message in str(err.value)


def test_box_errors_name_rank_and_box() -> None:
    doc = _with({"name": "w", "shape": [4], "dtype": "bfloat16", "boxes": {"3": [[[0, 9]]]}})
    with pytest.raises(
        LayoutError, match=r"tensor 'w', rank 3, box \[0:9\]: box out of range for shape \[4\]"
    ):
        parse_layout(doc)


def test_mesh_errors() -> None:
    dup = _with(
        {
            "name": "w",
            "shape": [4],
            "dtype": "bfloat16",
            "mesh": {"shape": [2], "ranks": [1, 1]},
            "placements": ["replicate"],
        }
    )
    with pytest.raises(LayoutError, match=r"rank\(s\) \[1\] more than once"):
        parse_layout(dup)
    empty = _with(
        {"name": "w", "shape": [4], "dtype": "bfloat16", "mesh": {"shape": []}, "placements": []}
    )
    with pytest.raises(LayoutError, match="non-empty"):
        parse_layout(empty)


def test_invalid_json_file(tmp_path: Path) -> None:
    p = tmp_path / "bad.json"
    p.write_text("{nope")
    with pytest.raises(LayoutError, match="not valid JSON"):
        load_layout(p)
