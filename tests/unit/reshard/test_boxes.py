from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refitplane.reshard.boxes import (
    Box,
    box_numel,
    contains,
    format_box,
    intersect,
    split_rows,
    subtract,
    within_shape,
)

pytestmark = pytest.mark.unit


@st.composite
def boxes_in(draw: st.DrawFn, shape: tuple[int, ...]) -> Box:
    out = []
    for n in shape:
        a = draw(st.integers(0, n - 1))
        b = draw(st.integers(a + 1, n))
        out.append((a, b))
    return tuple(out)


@st.composite
def shape_and_two_boxes(draw: st.DrawFn) -> tuple[tuple[int, ...], Box, Box]:
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    return shape, draw(boxes_in(shape)), draw(boxes_in(shape))


def _mask(shape: tuple[int, ...], box: Box) -> np.ndarray:
    m = np.zeros(shape, dtype=np.int64)
    m[tuple(slice(a, b) for a, b in box)] = 1
    return m


@given(shape_and_two_boxes())
def test_subtract_and_intersect_partition_the_box(case: tuple[tuple[int, ...], Box, Box]) -> None:
    shape, a, b = case
    parts = subtract(a, b)
    total = sum((_mask(shape, p) for p in parts), np.zeros(shape, dtype=np.int64))
    common = intersect(a, b)
    if common is not None:
        total += _mask(shape, common)
        assert contains(a, common)
        assert contains(b, common)
    assert np.array_equal(total, _mask(shape, a))  # exactly once, nothing outside a


@given(st.data())
def test_split_rows_covers_once_within_budget(data: st.DataObject) -> None:
    shape = tuple(data.draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    box = data.draw(boxes_in(shape))
    budget = data.draw(st.integers(1, 40))
    parts = split_rows(box, budget)
    total = sum((_mask(shape, p) for p in parts), np.zeros(shape, dtype=np.int64))
    assert np.array_equal(total, _mask(shape, box))
    assert all(box_numel(p) <= budget for p in parts)


def test_helpers() -> None:
    assert format_box(((0, 4), (2, 3))) == "[0:4, 2:3]"
    assert within_shape(((0, 4),), (4,))
    assert not within_shape(((0, 5),), (4,))
    assert box_numel(()) == 1  # a scalar holds one element
    assert split_rows(((0, 10), (0, 10)), 30) == [
        ((0, 3), (0, 10)),
        ((3, 6), (0, 10)),
        ((6, 9), (0, 10)),
        ((9, 10), (0, 10)),
    ]
