"""Pieces of rows and their tokens, as `shuffle --to-nodes` moves them (tokpack.packer.exchange):
the wire record, and the copies that gather pieces into a send buffer and place them in their
rows (whole rows as rows, long pieces a slice each, short ones by a bounded index of their
tokens). Pure numpy: no file, no MPI."""

from __future__ import annotations

import numpy as np

# A piece on the wire (and in a round's buffers): its output row g, where in the row it goes,
# its tokens' count; the tokens travel back to back in a buffer of their own. Not the row
# table's PIECE (tokpack.shuffle.packed, which also says where the piece's document is) nor a
# bucket file's RECORD (tokpack.shuffle.packed_step, the same fields with an unsigned g): g is
# signed here because the node arithmetic around it (store rows, positions) is int64.
WIRE_PIECE = np.dtype([("g", "<i8"), ("row_offset", "<u4"), ("length", "<u4")])

# Pieces at least this long on average are copied one slice each (a best-fit epoch's documents:
# hundreds of tokens); shorter ones by an index of their tokens, RANGE_CHUNK tokens at a time.
LONG_PIECE = 128
RANGE_CHUNK = 1 << 20
# Whole rows placed as runs of the receive buffer when the runs average at least this many rows.
MIN_RUN_ROWS = 8


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indices start..start+length-1 of every (start, length), back to back."""
    total = int(lengths.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    return np.arange(total, dtype=np.int64) - np.repeat(ends - lengths - starts, lengths)


def whole_rows(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, row: int) -> bool:
    """Whether every piece is a whole row at a row boundary of `tokens` (every window is): then
    pieces move as rows, one copy a row, not by an index of every token."""
    return len(tokens) % row == 0 and bool((lengths == row).all()) and not (starts % row).any()


def gather(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, row: int, out: np.ndarray | None = None):
    """The pieces' tokens (start, length in `tokens`), back to back, in `out` (its first
    lengths.sum() tokens; a new array where none is given)."""
    n = int(lengths.sum())
    out = np.empty(n, tokens.dtype) if out is None else out[:n]
    if len(starts) and (int(starts.min()) < 0 or int((starts + lengths).max()) > len(tokens)):
        raise IndexError(f"a piece beyond its {len(tokens)} tokens")  # np.take below does not check
    if whole_rows(tokens, starts, lengths, row) and out.dtype == tokens.dtype:
        # Into `out` at once: np.take checking its indices would copy through a temporary.
        np.take(tokens.reshape(-1, row), starts // row, axis=0, out=out.reshape(-1, row), mode="clip")
        return out
    copy_pieces(out, np.cumsum(lengths) - lengths, tokens, starts, lengths)
    return out


def copy_pieces(
    dst: np.ndarray, dst_starts: np.ndarray, src: np.ndarray, src_starts: np.ndarray, lengths: np.ndarray
) -> None:
    """dst[dst_starts[i]:][:lengths[i]] = src[src_starts[i]:][:lengths[i]] for every piece i, with
    no index array larger than RANGE_CHUNK tokens (a fixed allowance, whatever the round)."""
    if not len(lengths):
        return
    if lengths.mean() >= LONG_PIECE:
        for d, a, n in zip(dst_starts.tolist(), src_starts.tolist(), lengths.tolist()):
            dst[d : d + n] = src[a : a + n]
        return
    ends = np.cumsum(lengths)
    cuts = [
        0,
        *np.searchsorted(ends, np.arange(RANGE_CHUNK, int(ends[-1]), RANGE_CHUNK), side="right").tolist(),
        len(lengths),
    ]
    for lo, hi in zip(cuts, cuts[1:]):
        if hi > lo:
            dst[ranges(dst_starts[lo:hi], lengths[lo:hi])] = src[ranges(src_starts[lo:hi], lengths[lo:hi])]


def place(
    store: np.ndarray, pad: np.ndarray, at: np.ndarray, pieces: np.ndarray, tokens: np.ndarray, starts: np.ndarray
) -> None:
    """Each piece's tokens into its row `at` of `store`, at its offset; the row's unfilled count goes down."""
    lengths = pieces["length"].astype(np.int64)
    row = store.shape[1]
    if not pieces["row_offset"].any() and whole_rows(tokens, starts, lengths, row):
        # Whole rows arrive back to back (every piece received is placed: one run, the receive
        # buffer, unless a caller places some of them): each run is a view of the buffer, copied
        # once into its store rows, where indexing the buffer by row would copy every row twice
        # (a temporary, then the store). Runs of a few rows cost more in Python than the
        # temporary: indexed at once then.
        src, idx = tokens.reshape(-1, row), starts // row
        cuts = [0, *(np.flatnonzero(np.diff(idx) != 1) + 1).tolist(), len(idx)]
        if len(cuts) > 2 + len(idx) // MIN_RUN_ROWS:
            store[at] = src[idx]
            cuts = []
        for a, b in zip(cuts, cuts[1:]):
            store[at[a:b]] = src[idx[a] : idx[a] + b - a]
    else:
        copy_pieces(store.reshape(-1), at * row + pieces["row_offset"].astype(np.int64), tokens, starts, lengths)
    np.subtract.at(pad, at, lengths)  # a row filled twice goes below 0: exchange_epoch's check
