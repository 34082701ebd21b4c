"""The window table: worked example, edge cases and a property test over every stream length."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ar_slicing.algorithms.windows import (
    n_windows,
    read_window_table,
    window_table,
    write_window_table,
)
from ar_slicing.errors import ArSliceError


def rows(n_tokens, window):
    t = window_table(n_tokens, window)
    return list(zip(t["window_id"].tolist(), t["start"].tolist(), t["n_targets"].tolist()))


def test_docstring_example_ten_tokens_window_four():
    assert rows(10, 4) == [(0, 0, 4), (1, 4, 4), (2, 8, 1)]


def test_design_example_is_one_full_window():
    # stream 5 6 7 8 5 6 9 5 6 (9 tokens), L = 8: one window, 8 targets
    assert rows(9, 8) == [(0, 0, 8)]


def test_exact_multiple_has_no_empty_trailing_window():
    # 9 tokens = 8 targets = exactly two windows of 4; the last token is window 1's last target
    assert rows(9, 4) == [(0, 0, 4), (1, 4, 4)]


def test_streams_of_zero_and_one_token_have_no_windows():
    for n in (0, 1):
        assert rows(n, 2048) == []
        assert n_windows(n, 2048) == 0


def test_stream_shorter_than_one_window_is_one_partial_window():
    assert rows(5, 2048) == [(0, 0, 4)]
    assert rows(2, 2048) == [(0, 0, 1)]


def test_window_of_one_makes_every_target_its_own_window():
    assert rows(4, 1) == [(0, 0, 1), (1, 1, 1), (2, 2, 1)]


def test_window_of_two():
    assert rows(6, 2) == [(0, 0, 2), (1, 2, 2), (2, 4, 1)]
    assert rows(5, 2) == [(0, 0, 2), (1, 2, 2)]


@pytest.mark.parametrize("bad", [0, -3, 2.5, 2**31])
def test_bad_window_lengths_are_refused(bad):
    with pytest.raises(ArSliceError, match="window length"):
        window_table(10, bad)


@given(n_tokens=st.integers(0, 400), window=st.integers(1, 50))
def test_every_target_is_in_exactly_one_window(n_tokens, window):
    t = window_table(n_tokens, window)
    covered = [np.arange(start + 1, start + 1 + k) for start, k in zip(t["start"], t["n_targets"])]
    covered = np.concatenate(covered) if covered else np.zeros(0, np.int64)
    np.testing.assert_array_equal(covered, np.arange(1, max(n_tokens, 1)))
    assert np.array_equal(t["window_id"], np.arange(len(t["window_id"])))
    assert np.array_equal(t["start"], t["window_id"].astype(np.int64) * window)
    if len(t["n_targets"]):
        assert (t["n_targets"][:-1] == window).all()
        assert 1 <= t["n_targets"][-1] <= window


def test_window_table_file_round_trips_with_the_contract_schema(tmp_path):
    path = tmp_path / "windows.parquet"
    assert write_window_table(path, 10, 4) == 3
    schema = pq.read_schema(path)
    assert [(f.name, str(f.type)) for f in schema] == [
        ("window_id", "int32"),
        ("start", "int64"),
        ("n_targets", "int32"),
    ]
    back = read_window_table(path)
    assert back["n_targets"].tolist() == [4, 4, 1]
    assert list(tmp_path.iterdir()) == [path]  # nothing temporary left behind
