"""A source's windows read front to back, a block at a time, a thread ahead of the caller
(shuffle's scatter pass, the replay of an epoch's hashes, and shuffle --to-nodes' reads):
into two reused buffers, or, `mapped`, as views of the shards' page cache cut at their ends."""

from __future__ import annotations

import numpy as np

from tokpack.formats.io.gate import IO_BLOCK
from tokpack.formats.io.reads import read_ahead
from tokpack.formats.shards import PackedSource


def iter_source_windows(
    plan,  # shuffle.plan.EpochPlan (not imported: it imports this module)
    s: int,
    src: PackedSource,
    block_bytes: int = IO_BLOCK,
    w0: int = 0,
    w1: int | None = None,
    bufs: list[np.ndarray] | None = None,
    on_read=None,
    mapped: bool = False,
):
    """Sequential reads of windows [w0, w1) of source s, `block_bytes` at a time, alternating
    between two reused buffers: a thread reads the next block while the caller works on this
    one. Yields (first window, [rows, L+1] token view); a view is valid until the next item.
    `mapped`: every view stays valid as long as the caller holds it, and none is a copy where it
    can be helped: blocks are cut at the source's shard ends, a block inside one shard is a view
    of its page-cache pages (PackedSource.mapped, read in by the thread all the same), and a
    window across a shard's end (or a block of a file that cannot be mapped) is read into an
    array of its own. `on_read(first token, tokens)` is called in the reading thread on each
    block read; `src` a held-out split's stream (EpochPlan.stream), on each raw range of it, in
    raw offsets (the sweep's checksums are of the raw shards)."""
    sp = plan.sources[s]
    w1 = sp.windows if w1 is None else w1
    row = plan.row_tokens
    per = max(1, block_bytes // (row * src.dtype.itemsize))
    if mapped:
        per, bufs = min(per, max(w1 - w0, 1)), [None, None]  # two blocks ahead at most, as with buffers
    elif bufs is None:
        bufs = [np.empty(min(per, max(w1 - w0, 1)) * row, dtype=src.dtype) for _ in range(2)]
    per = per if mapped else len(bufs[0]) // row
    handles: dict = {}  # used by the reading thread only
    maps = getattr(src, "mapped", None) if mapped else None
    starts = getattr(src, "shard_starts", None)  # `handles`' keys are shards of these starts (a held-out stream's too)
    ends = starts if maps is not None else None

    def blocks():
        for a in range(w0, w1, per):
            b = min(w1, a + per)
            yield from [(b - a, a)] if ends is None else _cut_at(ends, sp.offset, row, a, b)

    ahead_of = getattr(src, "will_need", None)  # a source's shards (a held-out stream's reads are its own)

    def fill(buf, n, a):
        if starts is not None:  # the shards before this block's are never read again: closed, not one held a shard
            first = int(np.searchsorted(starts, sp.offset + a * row, side="right")) - 1
            for k in [k for k in handles if k < first]:
                handles.pop(k).close()
        view = None if maps is None else maps(sp.offset + a * row, n * row, handles)
        if view is None:
            view = buf[: n * row] if buf is not None else np.empty(n * row, dtype=src.dtype)
            src.read_into(sp.offset + a * row, view, handles)
        if ahead_of is not None and a + n < w1:  # the next block from the disk while this one is hashed and used
            ahead_of(sp.offset + (a + n) * row, min(per, w1 - a - n) * row, handles)
        if on_read is not None and hasattr(src, "raw_pieces"):
            for raw, x, y in src.raw_pieces(sp.offset + a * row, len(view)):
                on_read(raw, view[x:y])
        elif on_read is not None:
            on_read(sp.offset + a * row, view)
        return view.reshape(n, row)

    ahead = read_ahead(blocks(), fill, bufs)
    try:
        for rows, a in ahead:
            yield a, rows
    finally:
        ahead.close()  # stops the reading thread before its files close
        for f in handles.values():
            f.close()


def _cut_at(ends: np.ndarray, offset: int, row: int, a: int, b: int):
    """Windows [a, b) (of row tokens from stream token `offset`) as (count, first) blocks none of
    which crosses a shard end of `ends` but a window that does, alone."""
    lo = a
    inside = ends[(ends > offset + a * row) & (ends < offset + b * row)]
    for t in inside.tolist():
        w = (t - offset) // row  # the window holding token t
        if w < lo:  # a shard shorter than a window: that window is already out, alone
            continue
        if w > lo:
            yield w - lo, lo
        lo = w + 1 if (t - offset) % row else w
        if lo > w:
            yield 1, w
    if b > lo:
        yield b - lo, lo
