"""The exchange's copies of pieces (packer/pieces.py `gather`, `place`, `copy_pieces`):
whole rows as rows, long pieces a slice each, short ones by a bounded index of their tokens;
every path against a brute copy, and the rows' unfilled counts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokpack.formats.outputs import EpochShardFormat
from tokpack.packer import pieces as pieces_module
from tokpack.packer import rank_files
from tokpack.packer.pieces import WIRE_PIECE, gather, place


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=60),
    st.integers(0, 2**32 - 1),
    st.sampled_from([1, 7, 1 << 20]),
    st.sampled_from([1, 1 << 40]),
)
def test_pieces_are_gathered_and_placed_as_a_brute_copy(lengths, seed, chunk, long_piece):
    rng = np.random.default_rng(seed)
    lengths = np.array(lengths, dtype=np.int64)
    src = rng.integers(0, 60000, int(lengths.sum()) + 50).astype(np.uint16)
    starts = np.sort(rng.integers(0, 50, len(lengths))) + np.cumsum(lengths) - lengths  # in order, gaps between
    saved = pieces_module.RANGE_CHUNK, pieces_module.LONG_PIECE
    # a slice a piece (LONG_PIECE 1), or by index (LONG_PIECE 2^40) cut every 1 or 7 tokens or not
    pieces_module.RANGE_CHUNK, pieces_module.LONG_PIECE = chunk, long_piece
    try:
        got = gather(src, starts, lengths, 301)
        want = np.concatenate([src[a : a + n] for a, n in zip(starts, lengths)])
        assert got.tolist() == want.tolist()
        # placed into rows of 320 tokens, each piece at its own row and offset
        row = 320
        store = np.full((len(lengths), row), 9, dtype=np.uint16)
        pad = np.full(len(lengths), row, dtype=np.int64)
        pieces = np.zeros(len(lengths), WIRE_PIECE)
        pieces["length"] = lengths
        pieces["row_offset"] = rng.integers(0, row - lengths + 1)
        at = rng.permutation(len(lengths))
        place(store, pad, at, pieces, src, starts)
        brute = np.full((len(lengths), row), 9, dtype=np.uint16)
        for i, (a, n) in enumerate(zip(starts, lengths)):
            brute[at[i], pieces["row_offset"][i] : pieces["row_offset"][i] + n] = src[a : a + n]
        assert (store == brute).all() and (pad[at] == row - lengths).all()
    finally:
        pieces_module.RANGE_CHUNK, pieces_module.LONG_PIECE = saved


def test_whole_rows_move_as_rows_and_a_row_filled_twice_shows_in_its_count():
    row = 5
    tokens = np.arange(4 * row, dtype=np.uint16)
    starts = np.array([3, 0, 2]) * row
    lengths = np.full(3, row, dtype=np.int64)
    assert gather(tokens, starts, lengths, row).reshape(-1, row).tolist() == [
        list(range(15, 20)),
        list(range(0, 5)),
        list(range(10, 15)),
    ]
    store = np.zeros((3, row), dtype=np.uint16)
    pad = np.full(3, row, dtype=np.int64)
    pieces = np.zeros(3, WIRE_PIECE)
    pieces["length"] = row
    place(store, pad, np.array([2, 0, 2]), pieces, tokens, starts)  # row 2 twice, row 1 never
    assert pad.tolist() == [0, row, -row]  # exchange_epoch refuses both (min < 0, max > 0)
    assert store[0].tolist() == list(range(0, 5)) and store[2].tolist() == list(range(10, 15))


def test_a_writer_is_handed_bounded_bytes_of_rows_whatever_their_length(monkeypatch):
    """The rows a rank file's writer gets at once, gathered in a temporary with their EOS mask and
    index, are at most MAX_CHUNK_BYTES (at least one row), as the scatter/order engine's writers,
    not a fixed count of rows: 16,384 rows of seq_len 4096 were 134 MB at once, past the fixed
    allowance beside --memory (bench/rounds.py at 1 GiB: peak RSS 273 MB over --memory)."""
    monkeypatch.setattr(rank_files, "MAX_CHUNK_BYTES", 5 * 8194)

    class Writer:
        def __init__(self):
            self.tokens, self.index, self.pad = [], [], None

        def write_tokens(self, t):
            self.tokens.append(np.array(t))

        def write_known_index(self, n, ends, hashes):
            self.index.append(n)

        def write_pad(self, p):
            self.pad = np.array(p)

    for row, want in ((4097, 5), (40000, 1)):  # 5 rows of 8,194 bytes a time; a row longer than the bound alone
        rows = np.random.default_rng(row).integers(0, 60000, (23, row)).astype(np.uint16)
        sel = np.array([3, 0, 22, 5, 5, 9, 1, 17, 2, 11, 4, 8], dtype=np.int64)
        pad = np.arange(23, dtype=np.int64)
        w = Writer()
        fmt = EpochShardFormat(np.dtype("<u2"), row - 1, 0, "gpt2", padded=True)
        rank_files.write_rows(w, fmt, rows, pad, sel)
        assert [len(t) for t in w.tokens] == [want] * (len(sel) // want) + (
            [len(sel) % want] if len(sel) % want else []
        )
        assert w.index == [len(t) for t in w.tokens]
        assert np.concatenate(w.tokens).tolist() == rows[sel].tolist() and w.pad.tolist() == pad[sel].tolist()


def test_a_round_reads_at_most_max_round_bytes_whatever_memory_allows():
    """--memory sets the rounds only up to MAX_ROUND_BYTES of tokens a process reads (2 rounds of
    256 MiB moved 91-101 MB/s a process, 8 of 64 MiB 198-232: bench/rounds.py), and never below
    MIN_ROUND_ROWS rows, however long a row."""
    from types import SimpleNamespace

    from tokpack.packer.node_epoch import MAX_ROUND_BYTES, MIN_ROUND_ROWS, memory_plan

    def node(row_tokens):
        job = SimpleNamespace(
            token_dtype=np.dtype(np.uint16),
            plan=SimpleNamespace(row_tokens=row_tokens, epoch=0),
            row_bytes=2 * row_tokens,
        )
        return SimpleNamespace(job=job, keep_bytes=1 << 20, index_bytes=1 << 10, store_rows=100)

    assert memory_plan(node(4097), 1 << 40) == (MAX_ROUND_BYTES // 2, None)
    assert memory_plan(node(4097), (1 << 20) + 34 * 50_000) == (
        50_000,
        None,
    )  # below the cap: --memory's (34 bytes a token: 5 copies of 2, 24 of arithmetic)
    long_row = MAX_ROUND_BYTES  # tokens: 4 rows are 8x the cap
    assert memory_plan(node(long_row), 1 << 40) == (MIN_ROUND_ROWS * long_row, None)


@pytest.mark.parametrize("runs", [1, 2, 7, 300])
def test_whole_rows_placed_by_runs_of_the_receive_buffer_equal_a_row_by_row_copy(runs):
    """`place` copies each run of consecutive buffer rows as one view (a sender's block for this
    node, then its owned rows), and short runs by index: both give what a row-by-row copy gives,
    wherever the runs start and whatever the rows' destinations."""
    rng = np.random.default_rng(runs)
    row, R = 16, 600
    tokens = rng.integers(0, 1000, R * row).astype(np.uint16)
    blocks = np.array_split(rng.permutation(R) if runs == 300 else np.arange(R), runs)
    order = np.concatenate([blocks[i] for i in rng.permutation(len(blocks))])  # runs out of buffer order
    pieces = np.zeros(R, WIRE_PIECE)
    pieces["length"] = row
    at = rng.permutation(2 * R)[:R]
    store, pad = np.zeros((2 * R, row), np.uint16), np.full(2 * R, row, np.int64)
    place(store, pad, at, pieces, tokens, order * row)
    want = np.zeros_like(store)
    for k, i in enumerate(order):
        want[at[k]] = tokens[i * row : (i + 1) * row]
    assert np.array_equal(store, want)
    assert (pad[at] == 0).all() and (np.delete(pad, at) == row).all()


def test_pieces_are_gathered_into_a_given_buffer_and_one_beyond_its_tokens_is_refused():
    """The rounds gather into their reused send buffer (`out`): its first tokens are the pieces',
    the rest untouched; whole rows go through np.take without its index check (which would copy
    through a temporary), so a piece outside `tokens` is refused before, not clipped to a row
    that is there."""
    row = 5
    tokens = np.arange(4 * row, dtype=np.uint16)
    out = np.full(100, 7, dtype=np.uint16)
    got = gather(tokens, np.array([15, 0]), np.array([5, 5]), row, out)
    assert np.shares_memory(got, out) and got.tolist() == [*range(15, 20), *range(5)]
    assert out[10:].tolist() == [7] * 90
    got = gather(tokens, np.array([2, 11]), np.array([3, 4]), row, out)  # pieces, not rows
    assert np.shares_memory(got, out) and got.tolist() == [2, 3, 4, 11, 12, 13, 14]
    for start in (20, -5, 17):
        with pytest.raises(IndexError, match="beyond its 20 tokens"):
            gather(tokens, np.array([0, start]), np.array([5, 5]), row, out)
