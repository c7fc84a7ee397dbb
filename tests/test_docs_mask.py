"""The docs test masks what varies run to run (numbers, hashes) the same way whatever the value happens to be."""

from __future__ import annotations

import pytest
from _docs import is_table_header, mask


@pytest.mark.parametrize(("one", "other"), [
    ('"build": 0.123456,', '"build": 0.12345,'),      # a six-digit fraction is a number, not a hash
    ("region #c9daa1", "region #123456"),               # an all-digit hash masks as a lettered one
    ("bytes 1,234,567 in", "bytes 98765 in"),
    ("took 1e-05 s", "took 0.25 s"),
    ("key 9daa1c0f done", "key 3 done"),
    # whether a candidate is skipped as slower by its kernels depends on the machine's timings
    ("12 timed, 0 rejected, 1 slower by their kernels in 0.71s (max)", "13 timed, 0 rejected in 0.62s (max)"),
])
def test_values_that_differ_mask_alike(one, other):
    assert mask(one) == mask(other)


@pytest.mark.parametrize(("one", "other"), [
    ("gemm+bias", "gemm+gelu"),
    ("decade", "facade"),                               # words of hex letters are words
    ("x1 plan", "x2 plan"),                             # a name's digits are part of the name
])
def test_words_stay_words(one, other):
    assert mask(one) != mask(other)


def test_a_plan_tables_header_is_checked_a_search_logs_tie_is_not():
    """A measured sample must print its plan table's header; a tie line (whose prose names bytes and launches)
    depends on the machine's noise and is not required."""
    assert is_table_header("   plan                             bytes  launches  reg_peak  est_us  meas_us    verdict")
    assert not is_table_header("Tie [4] | ratio 0.990 [0.959, 1.026] in 24 rounds | kept [4], the cost model's "
                               "choice (fewer bytes, launches)")
