"""formats/io/memory.py `anonymous`: a zero-filled private mapping; `populate=True` faults its
pages in at once (the node store, written whole), by MADV_POPULATE_WRITE after the huge pages
are asked for, or by MAP_POPULATE where the kernel does not know that advice; and
formats/shards.py `eos_columns`, whose search for EOS tokens looks at 8-byte words first."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokpack.formats.io import memory
from tokpack.formats.shards import eos_columns

MiB = 1 << 20


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/statm is Linux's")
@pytest.mark.parametrize("advice", [True, False])
def test_a_populated_buffer_is_resident_and_zero_either_way(monkeypatch, advice):
    if not advice:  # a kernel before 5.14 refuses the advice: MAP_POPULATE instead
        monkeypatch.setattr(memory, "_populated", lambda m: False)
    before = resident()
    buf = memory.anonymous(64 * MiB, populate=True)
    grown = resident() - before
    assert len(buf) == 64 * MiB and grown >= 60 * MiB, grown  # faulted in at once, before any write
    assert not buf.any()
    lazy_before = resident()
    lazy = memory.anonymous(64 * MiB)
    assert resident() - lazy_before < 8 * MiB and not lazy[:: 1 << 16].any()


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 40),
    st.sampled_from([1, 3, 8, 4097]),
    st.sampled_from([1, 2, 9, 500, 10**9]),
    st.integers(0, 2**32 - 1),
)
def test_eos_columns_equal_a_look_at_every_token(rows, width, every, seed):
    """Sparse (the words' first look), dense (a plain look at every byte) and a tail of the last
    len % 8 tokens: every EOS found, row by row, in order."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 9, (rows, width)).astype(np.uint16)
    tokens[rng.random(tokens.shape) < 1 / every] = 0
    counts, cols = eos_columns(tokens, 0)
    want_rows, want_cols = np.nonzero(tokens == 0)
    assert counts.tolist() == np.bincount(want_rows, minlength=rows).tolist()
    assert cols.tolist() == (want_cols + 1).tolist()
