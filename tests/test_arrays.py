"""`maxsim_cli.arrays`: numpy and Arrow arrays into each other without pyarrow's pandas bridge, equal to
what ``pa.array`` and ``to_numpy`` give."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from maxsim_cli.arrays import array_values, numbers, strings_array, values_array

DTYPES = [np.int8, np.int32, np.int64, np.uint64, np.float16, np.float32, np.float64]


@pytest.mark.parametrize("dtype", DTYPES)
def test_numbers_both_ways(dtype) -> None:
    values = (np.arange(-5, 12) * 3).astype(dtype)
    arrow = values_array(values)
    assert arrow.equals(pa.array(values)) and arrow.null_count == 0
    back = array_values(arrow)
    assert back.dtype == values.dtype and np.array_equal(back, values)
    # a slice starts past the buffer's first value; its view must too
    assert np.array_equal(array_values(arrow.slice(3, 7)), values[3:10])
    assert array_values(arrow.slice(4, 0)).shape == (0,)


def test_values_array_flattens_and_keeps_its_bytes() -> None:
    grid = np.arange(12, dtype=np.int64).reshape(3, 4)
    assert values_array(grid).to_pylist() == list(range(12))
    assert values_array(grid[:, 1]).to_pylist() == [1, 5, 9]  # a strided view is copied first
    assert len(values_array(np.zeros(0, dtype=np.int32))) == 0


def test_array_values_refuses_nulls_and_other_types() -> None:
    with pytest.raises(ValueError, match="nulls"):
        array_values(pa.array([1, None, 3]))
    with pytest.raises(ValueError, match="bool"):
        array_values(pa.array([True, False]))
    assert np.isnan(numbers(pa.array([1.0, None]))[1])  # the fallback keeps to_numpy's NaN
    assert numbers(pa.array([True, False])).tolist() == [True, False]


@pytest.mark.parametrize(
    "items",
    [
        [],
        ["d1"],
        ["", "a", "ünï", "日本語", "emoji 🙂", 'q"uote', "back\\slash"],
        [f"doc{i}" for i in range(1000)],
    ],
)
@pytest.mark.parametrize("large", [True, False], ids=["large_string", "string"])
def test_strings_array_equals_pa_array(items: list[str], large: bool) -> None:
    kind = pa.large_string() if large else pa.string()
    built = strings_array(items, large=large)
    assert built.type == kind
    assert built.equals(pa.array(items, type=kind))
    assert built.to_pylist() == items


@pytest.mark.parametrize("large", [True, False], ids=["large_string", "string"])
def test_strings_array_refuses_what_pa_array_refuses(large: bool) -> None:
    """A lone surrogate is not Unicode: left to pa.array, which raises as it always did."""
    with pytest.raises((pa.ArrowInvalid, UnicodeEncodeError)):
        strings_array(["ok", "\ud800"], large=large)
