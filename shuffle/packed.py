"""The packed plan (`--packing best-fit`): whole documents packed into rows by best-fit
decreasing, per source and per pass, then the rows of all sources permuted globally.

Specified in docs/COMMANDS.md, "Best-fit packing", and pinned by tests/test_packing.py; the
names follow it (R = L + 1, D_s, rho_{s,p}, G, R_{s,p}, c_s, sigma_e).

Unlike the window plan (O(#sources), tokpack.shuffle.plan.EpochPlan), a packed plan is materialised:
its row table (per output row, the pieces of documents it holds) is computed from the sources'
document lengths (their `.ds.index`) and checksummed; the checksum is recorded in the epoch
manifest so `validate --against` proves the epoch is this table's. The table is O(documents),
so a shuffle builds it on disk in the epoch's work folder within --memory (build_table) and
each task reads only its rows' or its source shard's part (PackedTable); the plan object
itself holds row counts per source and pass, O(#sources x passes).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import functools
import json
import os
from dataclasses import dataclass, field, replace

import numpy as np
import xxhash

from tokpack.formats.errors import TokpackError
from tokpack.formats.constants import DEFAULT_PLAN_MEMORY, PAD_DTYPE
from tokpack.formats.packing import holdout_recorded, record_holdout
from tokpack.formats.io import (
    map_file,
    open_append,
    open_new,
    read_array,
    read_record,
    regular_size,
    write_bytes_atomic,
)
from tokpack.formats.manifest import hash_hex64, order_hash_terms, row_hashes
from tokpack.formats.shards import PackedSource, row_segments

from .holdout import Holdout, holdout_of
from .permutation import Bijection
from .plan import EpochPlan, check_passes, mixture, shard_count_checked

BEST_FIT = "best-fit"  # its `--packing` name (tokpack.shuffle.packings), and a run's `packing.method`
PACKED_ALGORITHM = "tokpack-bfd-feistel6-splitmix-xxh3-v1"  # the `shuffle` name of a packed epoch
# A group's documents and rows are held while it is packed (about 60 bytes a document); at 2^22
# tokens the padding of web-like lengths is under 0.5% at seq_len 4096 (BENCHMARKS.md, "Best-fit
# packing"), and a group is a few MB of plan state, far inside any --memory.
DEFAULT_GROUP_TOKENS = 1 << 22
_BIG = 1 << 40  # BFD keys: remaining capacity * _BIG + row, so one sorted int list orders by (capacity, row)

# The row table: one record per piece (a document, or a fragment of one, inside one row), in
# output order: by output row g, then offset in the row. Its bytes are what `table_xxh3_128` hashes.
PIECE = np.dtype(
    [("g", "<u8"), ("row_offset", "<u4"), ("source", "<u4"), ("doc", "<u8"), ("doc_offset", "<u8"), ("length", "<u4")]
)


# -------------------------------------------------------------------- documents

# Plan state per document while a pass's documents are permuted out of core: a DOC record in
# its bucket file and the arrays that place it (about 4x the record).
DOC = np.dtype([("k", "<u8"), ("doc", "<u8"), ("start", "<u8"), ("length", "<u8")])
DOC_STATE_BYTES = 4 * DOC.itemsize
MIN_CHUNK = 1 << 12  # documents (or pieces) per chunk at the least, whatever the budget


def _scratch(folder=None):
    """A scratch folder removed after use: in `folder` (an epoch's work folder), else in the
    system's temporary folder (a plan made before any output exists)."""
    import tempfile

    return tempfile.TemporaryDirectory(prefix="tokpack-plan-", dir=folder)


@functools.lru_cache(maxsize=8)
def _doc_table(path: str, fingerprint: str) -> tuple[np.ndarray, np.ndarray]:
    src = PackedSource.open(path, check_sizes=False)
    return doc_table(src)


def doc_table(src: PackedSource) -> tuple[np.ndarray, np.ndarray]:
    """(first token in the stream, length) of every document of a source, from its `.ds.index`.
    O(documents): for tests and small tools; the engines stream (source_documents)."""
    parts = list(source_documents(src, max(1, document_count(src))))
    return tuple(np.concatenate([q[i] for q in parts]) if parts else np.zeros(0, np.int64) for i in (1, 2))


def document_count(src: PackedSource) -> int:
    """D_s, from the sizes of the shards' `.ds.index` files (8 bytes a document end)."""
    return sum(document_count_of(src.path / f"{sh['path']}.index") for sh in src.shards)


def source_documents(src: PackedSource, chunk: int):
    """The source's documents in stream order, `chunk` at a time: (document numbers, first
    token in the stream, lengths), read from each shard's `.ds.index` in pieces. Checked: each
    shard's index ends at its token count and increases strictly."""
    doc = 0
    for k, shard in enumerate(src.shards):
        f, n = src.path / f"{shard['path']}.index", int(shard["tokens"])
        count, prev = document_count_of(f), 0
        for a in range(0, count, chunk):
            ends = read_array(f, "<u8", count=min(chunk, count - a), offset=8 * a).astype(np.int64)
            first = np.concatenate([[prev], ends[:-1]])
            last = a + len(ends) == count
            if len(ends) != min(chunk, count - a) or np.any(ends <= first) or (last and ends[-1] != n) or ends[-1] > n:
                raise TokpackError(
                    "source index does not describe its shard",
                    file=f,
                    expected=f"strictly increasing ends up to {n}",
                    found=f"{count} entries",
                    hint="run `tokpack validate` on the source",
                )
            yield np.arange(doc, doc + len(ends), dtype=np.int64), first + int(src.shard_starts[k]), ends - first
            doc, prev = doc + len(ends), int(ends[-1])


def document_count_of(index_file) -> int:
    """Documents a shard's `.ds.index` lists (8 bytes a document end)."""
    try:
        return regular_size(index_file) // 8
    except FileNotFoundError:
        raise TokpackError(
            "source shard's document index is missing",
            file=index_file,
            expected="the shard's .ds.index (best-fit packing reads each document's end)",
            hint="restore the file, or re-pack the source; `tokpack validate` checks it",
        ) from None


def documents_of(src: PackedSource) -> tuple[np.ndarray, np.ndarray]:
    _check_real(src)
    starts, lengths = _doc_table(str(src.path), src.fingerprint)
    _LENGTHS[src.fingerprint] = lengths
    return starts, lengths


def _check_real(src: PackedSource) -> None:
    if str(src.path).startswith("virtual:"):
        raise TokpackError(
            "best-fit packing needs the documents of the source",
            file=src.path,
            hint="plan a best-fit run on packed sources, not virtual ones",
        )


_DOCS: dict = {}  # the last source's (start, length) per document that fit in memory, and its _pass_key


def permuted_documents(src: PackedSource, perm: Bijection | None, memory: int, scratch: str | None):
    """The source's documents in the order of `perm` (position k holds document perm(k)), as
    chunks (doc, start, length) in position order. Bounded by `memory`: when the documents do
    not fit it, each is appended, with its position k, to the bucket file of its range of k
    (in `scratch`), and each bucket is read back and placed: one write and one read of 32
    bytes a document."""
    _check_real(src)
    d = document_count(src)
    if d == 0:
        return
    chunk = max(MIN_CHUNK, memory // DOC_STATE_BYTES)
    if d <= chunk:
        key = _pass_key(src, 0, 0, 0, 0, 0)
        if _DOCS.get("key") != key:  # each pass of a source drawn many times reads the same index
            parts = list(source_documents(src, d))
            _DOCS.update(key=key, docs=tuple(np.concatenate([q[i] for q in parts]) for i in (1, 2)))
        start, length = _DOCS["docs"]
        doc = perm.forward(np.arange(d, dtype=np.int64))
        yield doc, start[doc], length[doc]
        return
    from pathlib import Path

    folder = Path(scratch)
    nb = -(-d // chunk)
    for docs, start, length in source_documents(src, chunk):
        k = perm.inverse(docs)
        rec = np.empty(len(k), DOC)
        rec["k"], rec["doc"], rec["start"], rec["length"] = k, docs, start, length
        b = k // chunk
        rec, b = rec[np.argsort(b, kind="stable")], np.sort(b)
        cuts = np.flatnonzero(np.diff(b)) + 1
        for x, y in zip([0, *cuts.tolist()], [*cuts.tolist(), len(b)]):
            with open_append(folder / f"docs-{int(b[x]):07d}", folder=folder) as out:
                out.write(rec[x:y].tobytes())
    for b in range(nb):
        f = folder / f"docs-{b:07d}"
        rec = read_array(f, DOC, folder=folder)
        f.unlink()
        k0, n = b * chunk, min(chunk, d - b * chunk)
        local = rec["k"].astype(np.int64) - k0
        if len(rec) != n or np.any(np.bincount(local, minlength=n) != 1):  # only damage to our own scratch
            raise TokpackError(
                "packing scratch file is damaged",
                file=f,
                expected=f"{n} documents",
                found=len(rec),
                hint="rerun the same command",
            )
        out = np.empty(n, DOC)
        out[local] = rec
        del rec
        yield out["doc"].astype(np.int64), out["start"].astype(np.int64), out["length"].astype(np.int64)


def pass_groups(chunks, group_tokens: int):
    """Cuts a pass's permuted documents (chunks of (doc, start, length) in position order) into
    groups: from position a, up to and including the first document at which the group's
    tokens reach group_tokens (the last group may hold fewer). Yields (first position, doc,
    start, length) per group; holds at most one chunk and one group."""
    pos = 0  # position of the first pending document
    pend = [np.zeros(0, np.int64)] * 3
    chunks = iter(chunks)
    final = False
    while not final:
        nxt = next(chunks, None)
        if nxt is None:
            final = True
        else:
            pend = [np.concatenate([p, c]) for p, c in zip(pend, nxt)]
        cum, a = np.cumsum(pend[2]), 0
        while a < len(cum):
            base = int(cum[a - 1]) if a else 0
            i = int(np.searchsorted(cum, base + group_tokens, side="left"))
            if i >= len(cum) and not final:
                break
            b = min(len(cum), i + 1)
            yield (pos + a, *(p[a:b] for p in pend))
            a = b
        pend, pos = [p[a:] for p in pend], pos + a


def pack_group(gl: np.ndarray, positions: np.ndarray, row_tokens: int) -> tuple[np.ndarray, ...]:
    """One group (its documents' lengths `gl`, in permuted order, and their positions): the
    full-row fragments of documents longer than a row first, in permuted order, then the
    best-fit rows of the remaining pieces (see best_fit_decreasing). Returns (row, row_offset,
    which document of the group, doc_offset, length) per piece, sorted by (row, row_offset),
    and the row count."""
    full = gl // row_tokens
    tail = gl - full * row_tokens
    nf = int(full.sum())
    f_which = np.repeat(np.arange(len(gl), dtype=np.int64), full)
    f_k = np.arange(nf, dtype=np.int64) - np.repeat(np.cumsum(full) - full, full)
    has = np.flatnonzero(tail)
    r, off, nb = best_fit_decreasing(tail[has], positions[has], row_tokens)
    cols = [
        np.concatenate(c)
        for c in (
            (np.arange(nf, dtype=np.int64), nf + r),
            (np.zeros(nf, np.int64), off),
            (f_which, has),
            (f_k * row_tokens, full[has] * row_tokens),
            (np.full(nf, row_tokens, np.int64), tail[has]),
        )
    ]
    srt = np.lexsort((cols[1], cols[0]))
    return (*(c[srt] for c in cols), nf + nb)


# -------------------------------------------------------------------- one pass


@dataclass(frozen=True)
class PassRows:
    """The rows of one pass over one source: pieces sorted by (row, row_offset)."""

    rows: int  # R_{s,p}
    row: np.ndarray  # int64 per piece
    row_offset: np.ndarray  # int64
    doc: np.ndarray  # int64: document index in the source
    doc_offset: np.ndarray  # int64: first token of the piece within its document
    length: np.ndarray  # int64


def best_fit_decreasing(
    tails: np.ndarray, positions: np.ndarray, row_tokens: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Packs pieces of lengths `tails` (each <= row_tokens) into rows: in order of length
    descending, ties by `positions` ascending, each into the row with the least room that
    still holds it (ties: the lowest row), else into a new row. Returns (row, offset) per
    piece and the row count."""
    order = np.lexsort((positions, -tails))
    sorted_t = tails[order]
    n = len(tails)
    row = np.empty(n, np.int64)
    offset = np.empty(n, np.int64)
    # Pieces longer than half a row come first in this order and each opens a row (every row
    # opened before holds a piece at least as long, so has less room than the piece): placed at
    # once. Only the rest take the loop, the best-fit epoch's cost (issue 32's cliff).
    big = int(np.count_nonzero(2 * sorted_t > row_tokens))
    row[order[:big]] = np.arange(big)
    offset[order[:big]] = 0
    room = (row_tokens - sorted_t[:big]).astype(np.int64)
    has = np.flatnonzero(room > 0)
    keys: list[int] = np.sort(room[has] * _BIG + has).tolist()  # rows with room left, as remaining * _BIG + row
    rows = big
    rest_row, rest_offset = [0] * (n - big), [0] * (n - big)
    find, insort = bisect.bisect_left, bisect.insort
    for k, t in enumerate(sorted_t[big:].tolist()):
        j = find(keys, t * _BIG)
        if j < len(keys):
            rem, r = divmod(keys.pop(j), _BIG)
        else:
            rem, r = row_tokens, rows
            rows += 1
        rest_row[k], rest_offset[k] = r, row_tokens - rem
        if rem > t:
            insort(keys, (rem - t) * _BIG + r)
    row[order[big:]] = rest_row
    offset[order[big:]] = rest_offset
    return row, offset, rows


def pack_pass(lengths: np.ndarray, perm: Bijection, row_tokens: int, group_tokens: int) -> PassRows:
    """One pass over a source whose documents have `lengths`, in memory: documents in the order
    of `perm`, cut into groups (pass_groups), each packed by pack_group."""
    d = len(lengths)
    order = perm.forward(np.arange(d, dtype=np.int64))
    parts, rows = [], 0
    for a, gd, _, gl in pass_groups([(order, order, lengths[order])] if d else [], group_tokens):
        r, ro, which, do, ln, n = pack_group(gl, np.arange(a, a + len(gl), dtype=np.int64), row_tokens)
        parts.append((rows + r, ro, gd[which], do, ln))
        rows += n
    cols = [np.concatenate([p[i] for p in parts]) if parts else np.zeros(0, np.int64) for i in range(5)]
    return PassRows(rows, *cols)


# Passes packed already, kept whole while they fit a quarter of the caller's budget (least
# recently used first out). An epoch that draws a source n times needs its n passes three
# times (plan: their rows; the repeat count; the row table), and packing them is the epoch's
# cost (a Python best-fit loop per piece): without it an upsampled best-fit epoch packed every
# pass three times (BENCHMARKS.md, "Best-fit packing"). A pass's pieces are a function of the
# key alone; the key holds the index files' sizes and times, so an edited source is packed anew.
_PASSES: "collections.OrderedDict[tuple, list]" = collections.OrderedDict()
_PASSES_BYTES = [0]


def kept_pass_bytes() -> int:
    """Bytes the kept passes hold now."""
    return _PASSES_BYTES[0]


def release_passes() -> None:
    """Drops the kept passes: once an epoch's table is built its steps need none, and --memory
    is theirs (the row counts stay: a few bytes a pass)."""
    _PASSES.clear()
    _PASSES_BYTES[0] = 0
    _DOCS.clear()


def _pass_key(src: PackedSource, s: int, p: int, seed: int, row_tokens: int, group_tokens: int) -> tuple:
    stamp = []
    for sh in src.shards:
        try:
            st = os.stat(src.path / f"{sh['path']}.index")
            stamp.append((st.st_size, st.st_mtime_ns, st.st_ino))
        except OSError:
            stamp.append(None)
    return (src.fingerprint, str(src.path), s, p, seed, row_tokens, group_tokens, tuple(stamp))


def iter_pass(
    src: PackedSource,
    s: int,
    p: int,
    seed: int,
    row_tokens: int,
    group_tokens: int,
    memory: int,
    scratch: str | None,
    holdout: "Holdout | None" = None,
):
    """Pass p over source s, group by group, bounded by `memory` (permuted_documents) and a
    group: (first row of the group in the pass, row count, and per piece: row in the pass,
    row_offset, doc, doc_offset, length, first token in the stream, the document's length).
    `holdout`: documents left out of the pass before it is packed (never in any row). A pass
    read to its end is kept (_PASSES) when it fits a quarter of `memory` (without a holdout:
    the cache's key does not name one)."""
    key = _pass_key(src, s, p, seed, row_tokens, group_tokens) if holdout is None else None
    kept = _PASSES.get(key) if key is not None else None
    if kept is not None:
        _PASSES.move_to_end(key)
        yield from kept
        return
    cap, size, kept = max(0, memory) // 4, 0, ([] if key is not None else None)
    for group in _pack_pass(src, s, p, seed, row_tokens, group_tokens, memory, scratch, holdout):
        if kept is not None:
            size += sum(c.nbytes for c in group[2])
            if size <= cap:
                for c in group[2]:
                    c.flags.writeable = False  # shared by every later reader of the pass
                kept.append(group)
            else:
                kept = None
        yield group
    if kept is not None:  # read to its end
        _PASSES[key] = kept
        _PASSES_BYTES[0] += size
        while _PASSES_BYTES[0] > cap and _PASSES:
            _, old = _PASSES.popitem(last=False)
            _PASSES_BYTES[0] -= sum(c.nbytes for g in old for c in g[2])


def _pack_pass(
    src: PackedSource,
    s: int,
    p: int,
    seed: int,
    row_tokens: int,
    group_tokens: int,
    memory: int,
    scratch: str | None,
    holdout: "Holdout | None" = None,
):
    perm = Bijection(max(document_count(src), 1), "docs", seed, s, p)
    docs = permuted_documents(src, perm, memory, scratch)
    if holdout is not None:
        docs = ([c[~out] for c in chunk] for chunk in docs for out in [holdout.left_out(chunk[0])])
    rows = 0
    for a, gd, gs, gl in pass_groups(docs, group_tokens):
        r, ro, which, do, ln, n = pack_group(gl, np.arange(a, a + len(gl), dtype=np.int64), row_tokens)
        yield rows, n, (rows + r, ro, gd[which], do, ln, gs[which] + do, gl[which])
        rows += n


# -------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class PackedSourcePlan:
    """One source's share of a packed epoch; `windows` holds R_{s,0} (the rows of pass 0, the
    basis of the mixture), so the manifest's source fields keep their meaning for the summary."""

    index: int
    name: str
    path: str
    fingerprint: str
    weight: str | None
    tokens: int
    documents: int  # D_s
    windows: int  # R_{s,0}
    samples: int  # c_s
    base: int
    cursor: int | None = None
    offset: int = 0  # no jitter: kept so the manifest fields of both plans agree
    first_pass: int = 0
    passes: int = 0
    pass_rows: tuple[int, ...] = ()  # R_{s,p} for the passes this epoch touches
    held: int = 0  # k_s: its documents held out of every epoch (tokpack.shuffle.holdout)


@dataclass(frozen=True)
class PackedPlan:
    """A packed epoch (see the module docstring). Implements tokpack.shuffle.plan.SamplePlan."""

    seed: int
    epoch: int
    seq_len: int
    samples: int
    sources: tuple[PackedSourcePlan, ...]
    group_tokens: int
    pad_id: int
    jitter: bool = False
    holdout: dict | None = None  # `--holdout` as recorded (tokpack.shuffle.holdout.parse_holdout), or None
    split: bool = False  # the plan of RUN/holdout/: the held-out documents only (one pass over them)
    # The budget (bytes) its own work keeps within: counting a pass's rows permutes the pass's
    # documents within it, and so do the row table and the repeat count.
    memory: int = field(default=DEFAULT_PLAN_MEMORY, compare=False, repr=False)

    # The same chains and the same epoch order as the window plan.
    row_tokens = EpochPlan.row_tokens
    chain_start = EpochPlan.chain_start
    order = EpochPlan.order

    @property
    def algorithm(self) -> str:
        return PACKED_ALGORITHM

    def dropped_tokens(self) -> int:
        return 0

    def first_pass(self, s: int) -> int:
        return self.sources[s].first_pass

    def passes(self, s: int) -> int:
        return self.sources[s].passes

    def repeats(self, s: int) -> int:
        """Pieces (documents or fragments) of source s this epoch holds more than once: nonzero
        when its chain range spans more than one pass (upsampled, or straddling two)."""
        return self.repeat_counts(s)[0]

    def repeat_counts(self, s: int) -> tuple[int, int | None]:
        """(the pieces of source s that repeat a piece the epoch holds already, the epoch's
        pieces of s): one unit, pieces, for both (a pass's rows are packed afresh, so a
        row never repeats a row; its pieces do). The total is None when no pass repeats (not
        counted). Out of core: the epoch's pieces of s go to bucket files by document range,
        and each bucket counts its duplicates."""
        sp = self.sources[s]
        if sp.passes < 2:
            return 0, None
        src = PackedSource.open(sp.path, check_sizes=False)
        memory = self.memory
        # A document is cut the same way in every pass (full rows, then its tail), so every pass
        # holds the same pieces, once each: when the epoch takes one pass whole, the distinct
        # pieces are that pass's, and only the pieces counted per pass are needed (no keys).
        lo, hi = self.chain_start(s), self.chain_start(s) + sp.samples
        starts = [pass_start(self, s, sp.first_pass, src)]
        for p in range(sp.first_pass, sp.first_pass + sp.passes):
            starts.append(starts[-1] + pass_rows(self, s, p, src))
        if any(lo <= x and y <= hi for x, y in zip(starts, starts[1:])):
            taken = whole = 0
            for p, at, end in zip(range(sp.first_pass, sp.first_pass + sp.passes), starts, starts[1:]):
                a, b = lo - at, hi - at
                with _pass_scratch(src, memory) as d:
                    n = sum(
                        int(((row >= a) & (row < b)).sum())
                        for _, _, (row, *_) in iter_pass(
                            src, s, p, self.seed, self.row_tokens, self.group_tokens, memory, d, self.holdout_of(s)
                        )
                    )
                if lo <= at and end <= hi:
                    whole = n
                taken += n
            return taken - whole, taken
        per = max(
            MIN_CHUNK,
            memory // (KEY.itemsize * 4 * sp.passes * (1 + src.tokens // max(1, sp.documents * self.row_tokens))),
        )
        with _scratch() as d:
            from pathlib import Path

            files = Buckets(Path(d), "keys")
            pieces = 0
            for _, ro, doc, do, *_ in chain_pieces(self, s, src, memory, d):
                keys = np.empty(len(doc), KEY)
                keys["doc"], keys["doc_offset"] = doc, do
                files.append(doc // per, keys)
                pieces += len(doc)
            repeats = 0
            for b in files.names():
                keys = files.read(b, KEY)
                repeats += len(keys) - len(np.unique(keys))
            return int(repeats), int(pieces)

    def source_report(self) -> list[dict]:
        """As the window plan's, but `repeats` counts document pieces, out of `repeat_total`
        pieces (`repeat_unit` names the unit for the summary and the warnings)."""
        report = []
        for i, s in enumerate(self.sources):
            repeats, pieces = self.repeat_counts(i)
            report.append(
                {
                    "name": s.name,
                    "path": s.path,
                    "fingerprint": s.fingerprint,
                    "weight": s.weight,
                    "samples": s.samples,
                    "windows": s.windows,
                    "passes": s.passes,
                    "first_pass": s.first_pass,
                    "repeats": repeats,
                    "repeat_total": pieces,
                    "repeat_unit": "document pieces",
                }
            )
        return report

    def source_entries(self) -> list[dict]:
        return [
            {
                "name": s.name,
                "path": s.path,
                "fingerprint": s.fingerprint,
                "weight": s.weight,
                "samples": s.samples,
                "first_pass": s.first_pass,
                "passes": s.passes,
                "windows": s.windows,
                "tokens": s.tokens,
                "offset": 0,
                "dropped_tokens": 0,
                "documents": s.documents,
                **({} if s.cursor is None else {"cursor": s.cursor}),
                **({} if self.holdout is None else {"held_documents": s.held}),
            }
            for s in self.sources
        ]

    def packing_entry(self, table_hash: str, padding: int, figures: dict | None = None) -> dict:
        """The epoch manifest's `packing` object; `figures`: RowFigures.fields() of its rows."""
        return {
            "method": BEST_FIT,
            "group_tokens": self.group_tokens,
            "pad_id": self.pad_id,
            "padding_tokens": padding,
            "table_xxh3_128": table_hash,
            **(figures or {}),
            **record_holdout(self.holdout, self.split, padded=True),
        }

    def holdout_of(self, s: int) -> "Holdout | None":
        """Source s's held-out documents (None: it holds none out)."""
        sp = self.sources[s]
        return Holdout(sp.documents, sp.held, self.seed, sp.fingerprint, self.split) if sp.held else None

    def table(self, sources: list[PackedSource]) -> np.ndarray:
        """The row table (PIECE records in output order), read whole: O(pieces) memory, for
        tests and small tools."""
        with self.table_rows(sources) as built:
            return read_array(built.folder / TABLE_FILE, PIECE, folder=built.folder)

    @contextlib.contextmanager
    def table_rows(self, sources: list[PackedSource]):
        """The row table, built by build_table within the plan's memory in a temporary folder
        (removed after use) and read back by ranges of rows (PackedTable.rows, a bucket of rows
        at a time): `inspect` reads the rows of its batches so."""
        with _scratch() as d:
            from pathlib import Path

            yield build_table(self, sources, Path(d) / "packing", self.memory)


def table_hash(table: np.ndarray) -> str:
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(table).tobytes())


def row_padding(table: np.ndarray, samples: int, row_tokens: int, g0: int = 0) -> np.ndarray:
    """Padding tokens at the end of each output row g0.. g0 + samples - 1 (uint32), from the
    pieces of those rows."""
    used = np.bincount(table["g"].astype(np.int64) - g0, weights=table["length"].astype(np.float64), minlength=samples)
    return (row_tokens - used.astype(np.int64)).astype(PAD_DTYPE)


_LENGTHS: dict[str, np.ndarray] = {}  # fingerprint -> document lengths, filled by documents_of


@functools.lru_cache(maxsize=16)
def _pass_cached(fingerprint: str, seed: int, s: int, p: int, row_tokens: int, group_tokens: int) -> PassRows:
    lengths = _LENGTHS[fingerprint]
    return pack_pass(lengths, Bijection(max(len(lengths), 1), "docs", seed, s, p), row_tokens, group_tokens)


def source_pass(plan, s: int, p: int) -> PassRows:
    """Pass p over source s, in memory (O(documents): for tests and small tools): its documents
    permuted by rho_{s,p} = Bijection(D_s, "docs", seed, s, p)."""
    sp = plan.sources[s]
    documents_of(PackedSource.open(sp.path, check_sizes=False))
    return _pass_cached(sp.fingerprint, plan.seed, s, p, plan.row_tokens, plan.group_tokens)


_ROWS: dict[tuple, int] = {}  # _rows_key -> R_{s,p}
_PIECES: dict[tuple, int] = {}  # the same key -> the pass's pieces


def _rows_key(plan, s: int, p: int) -> tuple:
    """What pass p over source s's rows depend on: the source, the seed, the row and group sizes, and
    the documents held out of it."""
    sp = plan.sources[s]
    return (sp.fingerprint, plan.seed, s, p, plan.row_tokens, plan.group_tokens, sp.held, plan.split)


def _pass_scratch(src: PackedSource, memory: int):
    """A scratch folder for a pass only when its documents do not fit `memory`
    (permuted_documents), else None: making and removing a folder per pass cost more than
    packing a small pass."""
    spills = document_count(src) > max(MIN_CHUNK, memory // DOC_STATE_BYTES)
    return _scratch() if spills else contextlib.nullcontext(None)


def pass_rows(plan, s: int, p: int, src: PackedSource) -> int:
    """R_{s,p}, the rows of pass p over source s: the pass is packed group by group (iter_pass,
    bounded by the plan's memory) and counted; the count is kept."""
    key = _rows_key(plan, s, p)
    if key not in _ROWS:
        rows = pieces = 0
        with _pass_scratch(src, plan.memory) as d:
            for _, n, (row, *_) in iter_pass(
                src, s, p, plan.seed, plan.row_tokens, plan.group_tokens, plan.memory, d, plan.holdout_of(s)
            ):
                rows, pieces = rows + n, pieces + len(row)
        _ROWS[key], _PIECES[key] = rows, pieces
    return _ROWS[key]


def epoch_pieces(plan, s: int) -> tuple[int, int] | None:
    """(pieces packed in the passes of source s this epoch touches, pieces of s the epoch
    takes, each partial pass counted by its share of rows): known once the plan has counted
    those passes' rows in this process (pass_rows), else None. For `tokpack plan`'s time."""
    sp = plan.sources[s]
    lo, hi = plan.chain_start(s), plan.chain_start(s) + sp.samples
    packed = taken = 0.0
    at = None
    for p in range(sp.first_pass, sp.first_pass + sp.passes):
        key = _rows_key(plan, s, p)
        if key not in _PIECES:
            return None
        if at is None:
            at = sum(_ROWS.get(_rows_key(plan, s, k), 0) for k in range(p))
        rows, pieces = _ROWS[key], _PIECES[key]
        share = max(0, min(hi, at + rows) - max(lo, at)) / max(1, rows)
        packed, taken, at = packed + pieces, taken + pieces * share, at + rows
    return int(packed), int(taken)


def pass_start(plan, s: int, p: int, src: PackedSource) -> int:
    """Chain position of the first row of pass p: the rows of passes 0..p-1."""
    return sum(pass_rows(plan, s, k, src) for k in range(p))


def _locate_chain(plan, s: int, lo: int, n: int, src: PackedSource) -> tuple[int, int, tuple[int, ...]]:
    """(first pass, passes, their row counts) covering chain positions [lo, lo + n)."""
    p, at = 0, 0
    while True:
        r = pass_rows(plan, s, p, src)
        if at + r > lo:
            break
        at, p = at + r, p + 1
    first, counts = p, []
    while at < lo + n:
        r = pass_rows(plan, s, p, src)
        counts.append(r)
        at, p = at + r, p + 1
    return first, len(counts), tuple(counts)


def packed_epoch_plan(
    sources: list[PackedSource],
    *,
    seq_len: int,
    seed: int,
    epoch: int,
    weights: list[str | None] | None = None,
    samples: int | None = None,
    tokens: int | None = None,
    names: list[str] | None = None,
    group_tokens: int | None = None,
    pad_id: int | None = None,
    cursors: list[int | None] | None = None,
    counts: list[int] | None = None,
    memory: int = DEFAULT_PLAN_MEMORY,
    holdout: dict | None = None,
    split: bool = False,
) -> PackedPlan:
    """The packed plan of one epoch. c_s: as the window plan apportions samples, with R_{s,0}
    (the rows of pass 0) in place of W_s. `counts` (a schedule's per-source samples) overrides it.
    `memory`: the plan's budget (bytes; shuffle's --memory), within which it counts its passes."""
    if not sources:
        raise TokpackError("no sources given", hint="tokpack shuffle SOURCE[=WEIGHT]... -o OUT --packing best-fit")
    pad = sources[0].eos_id if pad_id is None else int(pad_id)
    if not 0 <= pad < sources[0].vocab_size:
        raise TokpackError(
            "pad id outside the vocabulary",
            where="--pad-id",
            expected=f"0..{sources[0].vocab_size - 1}",
            found=pad,
            hint="leave --pad-id out to pad with the EOS id",
        )
    for src in sources:
        _check_real(src)
    documents = [document_count(src) for src in sources]
    held = [held_out(src, holdout, seed, memory).held for src in sources]
    stub = PackedPlan(
        int(seed),
        int(epoch),
        int(seq_len),
        0,
        tuple(
            PackedSourcePlan(
                s, "", str(src.home), src.fingerprint, None, src.tokens, documents[s], 0, 0, 0, held=held[s]
            )
            for s, src in enumerate(sources)
        ),
        int(group_tokens or DEFAULT_GROUP_TOKENS),
        pad,
        holdout=holdout,
        split=bool(split),
        memory=max(1, int(memory)),
    )
    rows0 = [pass_rows(stub, s, 0, src) for s, src in enumerate(sources)]
    for src, rows in zip(sources, rows0):
        if rows == 0:  # its chain would hold nothing to take
            raise TokpackError(
                "source holds no documents",
                file=src.path,
                where="documents",
                expected=">= 1 document",
                found=0,
                hint="drop this source",
            )
    weights = list(weights) if weights is not None else [None] * len(sources)
    if counts is None:
        counts = mixture(sources, weights, rows0, samples=samples, tokens=tokens, seq_len=seq_len)[1]
    check_passes(sources, counts, rows0, "rows a pass")
    plans, base = [], 0
    for s, src in enumerate(sources):
        cursor = None if cursors is None else cursors[s]
        sp = PackedSourcePlan(
            s,
            names[s] if names else src.home.name,
            str(src.home),
            src.fingerprint,
            None if weights[s] is None else str(weights[s]),
            src.tokens,
            documents[s],
            rows0[s],
            counts[s],
            base,
            cursor,
            held=held[s],
        )
        plans.append(sp)
        base += counts[s]
    plan = replace(stub, samples=base, sources=tuple(plans))
    located = []
    for s, sp in enumerate(plan.sources):
        if sp.samples:
            first, k, rows = _locate_chain(plan, s, plan.chain_start(s), sp.samples, sources[s])
            sp = replace(sp, first_pass=first, passes=k, pass_rows=rows)
        located.append(sp)
    plan = replace(plan, sources=tuple(located))
    return plan


def packed_plan_from_manifest(
    manifest: dict, sources: list[PackedSource], memory: int = DEFAULT_PLAN_MEMORY
) -> PackedPlan:
    """The packed plan an epoch manifest was written from, against the opened sources (matched
    by fingerprint, in any order); `memory`: its budget, as in packed_epoch_plan."""
    pk = manifest.get("packing")
    if not isinstance(pk, dict) or pk.get("method") != BEST_FIT:
        raise TokpackError(
            "packed epoch without its packing", where="packing", expected=f"{{method: {BEST_FIT}, ...}}", found=pk
        )
    entries = manifest.get("sources") or []
    pool = {s.fingerprint: s for s in sources}
    ordered, counts, cursors, weights, names = [], [], [], [], []
    for i, e in enumerate(entries):
        src = pool.get(e.get("fingerprint"))
        if src is None:
            raise TokpackError(
                "source of the epoch not given",
                where=f"sources[{i}] ({e.get('name')})",
                expected=f"a source with fingerprint {e.get('fingerprint')}",
                found=", ".join(str(p.path) for p in sources) or "none",
                hint="pass every source the epoch was shuffled from, unchanged",
            )
        ordered.append(src)
        counts.append(int(e["samples"]))
        cursors.append(e.get("cursor"))
        weights.append(e.get("weight"))
        names.append(e.get("name", ""))
    holdout, split = holdout_recorded(manifest)
    plan = packed_epoch_plan(
        ordered,
        seq_len=int(manifest["seq_len"]),
        seed=int(manifest["seed"]),
        epoch=int(manifest["epoch"]),
        weights=weights,
        names=names,
        group_tokens=int(pk["group_tokens"]),
        pad_id=int(pk["pad_id"]),
        cursors=None if all(c is None for c in cursors) else cursors,
        counts=counts,
        memory=memory,
        holdout=holdout,
        split=split,
    )
    if plan.samples != int(manifest["samples"]):
        raise TokpackError(
            "epoch manifest source samples do not add up",
            where="sources[].samples",
            expected=manifest["samples"],
            found=plan.samples,
        )
    return plan


# -------------------------------------------------------------------- the row table on disk

# What the build writes in its folder (OUT/.tokpack-work/epoch-.../packing/, shuffle/run.py):
TABLE_FILE = "table"  # the row table: PIECE records in output order; its xxh3_128 is table_xxh3_128
STARTS_FILE = "starts"  # per piece of the table, its first token in its source's stream (<u8)
INDEX_FILE = "index"  # per bucket of rows: first piece, xxh3_64 of its table part and of its starts part
BUILT_FILE = "built.json"  # written last: the checksum, padding, bucket rows, and the by-shard files' xxh3_64
# A piece as a scatter task reads it from its source shard's file (source-SSSS-KKKKKK): output
# row, offset in the row, length, first token in the shard.
SHARD_PIECE = np.dtype([("g", "<u8"), ("row_offset", "<u4"), ("length", "<u4"), ("local", "<u8")])
_BUILD = np.dtype(PIECE.descr + [("start", "<u8")])  # a piece while the table is built
KEY = np.dtype([("doc", "<u8"), ("doc_offset", "<u8")])  # a piece's identity in its source
PIECE_STATE_BYTES = 4 * _BUILD.itemsize  # a buffered piece and the arrays that sort it
TABLE_PIECE_BYTES = _BUILD.itemsize + SHARD_PIECE.itemsize  # on disk a piece, at the build's peak and after it


class Buckets:
    """Append-only numbered scratch files in a folder: records of several buckets at once, each
    run to its own file."""

    def __init__(self, folder, stem: str):
        self.folder, self.stem, self.seen = folder, stem, set()
        folder.mkdir(parents=True, exist_ok=True)

    def file(self, b: int):
        return self.folder / f"{self.stem}-{b:07d}"

    def append(self, bucket: np.ndarray, records: np.ndarray) -> None:
        order = np.argsort(bucket, kind="stable")
        bucket, records = bucket[order], records[order]
        cuts = np.flatnonzero(np.diff(bucket)) + 1
        for x, y in zip([0, *cuts.tolist()], [*cuts.tolist(), len(bucket)]):
            b = int(bucket[x])
            self.seen.add(b)
            with open_append(self.file(b), folder=self.folder) as out:
                out.write(records[x:y].tobytes())

    def names(self) -> list[int]:
        return sorted(self.seen)

    def read(self, b: int, dtype) -> np.ndarray:
        f = self.file(b)
        if not f.exists():
            return np.zeros(0, dtype)
        data = read_array(f, dtype, folder=self.folder)
        f.unlink()
        return data


@dataclass
class RowFigures:
    """What the summaries show of a best-fit epoch's rows (shuffle's summary and manifest,
    `inspect`, `plan`), counted over the pieces chain_pieces yields: one call per group of
    one pass, which holds every piece of its rows and of its documents, so each count is exact
    without holding the table."""

    row_tokens: int
    padding_tokens: int = 0
    documents_cut: int = 0  # documents longer than a row, cut into pieces, that the epoch holds a piece of
    max_documents_per_row: int = 0  # the most segments of one row (its pieces, its padding one more),
    # counted as the loader counts them (formats/shards.py row_segments: a segment starting at the
    # row's last token, a label only, is not one): the smallest max_documents that reads the epoch

    def add(self, q: np.ndarray, offset: np.ndarray, doc: np.ndarray, length: np.ndarray, full: np.ndarray) -> None:
        """One group's pieces: output position, offset in its row, document, length, the document's length."""
        if not len(q):
            return
        _, row = np.unique(q, return_inverse=True)
        pad = self.row_tokens - np.bincount(row, weights=length.astype(np.float64)).astype(np.int64)
        self.padding_tokens += int(pad.sum())
        padded = np.flatnonzero(pad > 0)  # a row's padding is one segment, after its pieces
        segments = row_segments(
            np.concatenate([row, padded]),
            np.concatenate([offset, self.row_tokens - pad[padded]]),
            len(pad),
            self.row_tokens,
        )
        self.max_documents_per_row = max(self.max_documents_per_row, int(segments.max()))
        self.documents_cut += int(np.unique(doc[length < full]).size)

    def fields(self) -> dict:
        """The epoch manifest's `packing` fields of these figures (padding_tokens is recorded apart)."""
        return {"documents_cut": self.documents_cut, "max_documents_per_row": self.max_documents_per_row}


def row_figures(plan, sources: list[PackedSource], memory: int) -> RowFigures:
    """The epoch's RowFigures without building its table (`plan shuffle`): its passes packed
    once more, group by group, within `memory`."""
    figures = RowFigures(plan.row_tokens)
    with _scratch() as d:
        for s, sp in enumerate(plan.sources):
            if sp.samples:
                for q, ro, doc, _, ln, _, full in chain_pieces(plan, s, sources[s], memory, d):
                    figures.add(q, ro, doc, ln, full)
    return figures


def chain_pieces(plan, s: int, src: PackedSource, memory: int, scratch: str | None):
    """The pieces of source s this epoch takes, group by group: (chain-derived output position
    q = base + chain position - cursor, row_offset, doc, doc_offset, length, first token in
    the stream, the document's length), passes packed by iter_pass."""
    sp = plan.sources[s]
    lo, hi = plan.chain_start(s), plan.chain_start(s) + sp.samples
    at = pass_start(plan, s, sp.first_pass, src)
    for p in range(sp.first_pass, sp.first_pass + sp.passes):
        a, b = lo - at, hi - at  # the pass's rows this epoch takes
        for first, n, (row, *rest) in iter_pass(
            src, s, p, plan.seed, plan.row_tokens, plan.group_tokens, memory, scratch, plan.holdout_of(s)
        ):
            if first + n <= a:
                continue
            if first >= b:
                break
            sel = np.flatnonzero((row >= a) & (row < b))
            yield (sp.base + at + row[sel] - lo, *(c[sel] for c in rest))
        at += pass_rows(plan, s, p, src)


@dataclass(frozen=True)
class PackedTable:
    """A row table build_table wrote: read by ranges of output rows, or by source shard."""

    folder: object  # pathlib.Path
    table_xxh3_128: str
    padding: int
    bucket_rows: int
    problems: tuple[str, ...]
    shard_files: dict  # "S-K" -> xxh3_64 of source shard (S, K)'s pieces file
    figures: dict = field(default_factory=dict)  # RowFigures.fields() of the table's rows

    @classmethod
    def open(cls, folder, expected: str | None = None) -> "PackedTable":
        from pathlib import Path

        folder = Path(folder)
        built = read_record(folder / BUILT_FILE, folder=folder)
        if built is None:
            raise TokpackError(
                "packing table in the work folder is missing or damaged",
                file=folder / BUILT_FILE,
                hint="rerun the same command",
            )
        if expected is not None and built["table_xxh3_128"] != expected:
            raise TokpackError(
                "packing table in the work folder is not this epoch's",
                file=folder / BUILT_FILE,
                where="table_xxh3_128",
                expected=expected,
                found=built["table_xxh3_128"],
                hint="rerun the same command",
            )
        return cls(
            folder,
            built["table_xxh3_128"],
            int(built["padding"]),
            int(built["bucket_rows"]),
            tuple(built["problems"]),
            built["shard_files"],
            built.get("figures") or {},
        )

    def rows(self, g0: int, g1: int) -> tuple[np.ndarray, np.ndarray]:
        """(PIECE records, their first tokens in the stream) of output rows [g0, g1), sorted by
        (g, row_offset): only the buckets of rows that hold them are read, each checked."""
        if g1 <= g0:
            return np.zeros(0, PIECE), np.zeros(0, np.int64)
        b0, b1 = g0 // self.bucket_rows, (g1 - 1) // self.bucket_rows + 1
        index = read_array(self.folder / INDEX_FILE, "<u8", 3 * (b1 - b0 + 1), 24 * b0, folder=self.folder)
        if len(index) != 3 * (b1 - b0 + 1):
            raise TokpackError(
                "packing table index is cut short", file=self.folder / INDEX_FILE, hint="rerun the same command"
            )
        index = index.reshape(-1, 3)
        a, n = int(index[0, 0]), int(index[-1, 0] - index[0, 0])
        table = read_array(self.folder / TABLE_FILE, PIECE, n, PIECE.itemsize * a, folder=self.folder)
        starts = read_array(self.folder / STARTS_FILE, "<u8", n, 8 * a, folder=self.folder)
        for k in range(b1 - b0):
            x, y = int(index[k, 0]) - a, int(index[k + 1, 0]) - a
            for name, part, want in ((TABLE_FILE, table[x:y], index[k, 1]), (STARTS_FILE, starts[x:y], index[k, 2])):
                if len(table) != n or len(starts) != n or xxhash.xxh3_64_intdigest(part.tobytes()) != int(want):
                    raise TokpackError(
                        "packing table in the work folder is damaged",
                        file=self.folder / name,
                        where=f"rows {(b0 + k) * self.bucket_rows}..",
                        expected=f"xxh3_64 {int(want):016x}",
                        hint="rerun the same command",
                    )
        x, y = np.searchsorted(table["g"], [g0, g1])
        return table[x:y], starts[x:y].astype(np.int64)

    def shard_pieces(self, s: int, k: int, chunk: int):
        """The pieces in source shard (s, k) (SHARD_PIECE), `chunk` at a time, checked against
        the recorded xxh3_64 once read whole (a caller keeps nothing until then)."""
        f = self.folder / f"source-{s:04d}-{k:06d}"
        want = self.shard_files.get(f"{s}-{k}")
        if want is None:
            return
        size = regular_size(f, folder=self.folder)
        h, count = xxhash.xxh3_64(), size // SHARD_PIECE.itemsize
        for a in range(0, count, chunk):
            rec = read_array(f, SHARD_PIECE, min(chunk, count - a), SHARD_PIECE.itemsize * a, folder=self.folder)
            h.update(rec.tobytes())
            yield rec
        if h.intdigest() != int(want) or regular_size(f, folder=self.folder) != count * SHARD_PIECE.itemsize:
            raise TokpackError(
                "packing table in the work folder is damaged",
                file=f,
                where="xxh3_64",
                expected=f"{int(want):016x}",
                found=f"{h.intdigest():016x}",
                hint="rerun the same command",
            )


def build_table(plan: PackedPlan, sources: list[PackedSource], folder, memory: int) -> PackedTable:
    """Writes the epoch's row table into `folder`, bounded by `memory` (plus a group): each
    source's passes are packed group by group (chain_pieces) and each piece, given its output
    row g = sigma_e(q), is appended to the scratch file of its bucket of output rows and to
    the file of the source shard that holds it; then each bucket, in output order, is sorted by
    (g, row_offset) and appended to the table, whose xxh3_128 is computed as it is written.
    Atomic: written under a temporary name, renamed whole; BUILT_FILE last."""
    import shutil
    from pathlib import Path

    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(folder, ignore_errors=True)
    order = plan.order()
    used = [s for s, sp in enumerate(plan.sources) if sp.samples]
    docs = sum(max(1, plan.sources[s].documents) for s in used)
    per_row = 2 + plan.row_tokens * docs // max(1, sum(sources[s].tokens for s in used))  # pieces a row, about
    cap = max(MIN_CHUNK, memory // PIECE_STATE_BYTES)  # pieces buffered, and pieces of a bucket of rows
    bucket_rows = max(1, cap // per_row)
    tmp.mkdir(parents=True)
    rows_files, shard_files = Buckets(tmp / "rows", "rows"), Buckets(tmp / "shards", "s")
    shard_hashes: dict[int, xxhash.xxh3_64] = {}
    first_shard = np.cumsum([0] + [len(src.shards) for src in sources])
    buffered, held, problems = [], 0, set()
    figures = RowFigures(plan.row_tokens)

    def flush():
        rec = np.concatenate(buffered)
        buffered.clear()
        rows_files.append(rec["g"].astype(np.int64) // bucket_rows, rec)
        src = rec["source"].astype(np.int64)
        key, local = np.empty(len(rec), np.int64), np.empty(len(rec), np.int64)
        for s in np.unique(src).tolist():
            sel = src == s
            k = np.searchsorted(sources[s].shard_starts, rec["start"][sel].astype(np.int64), side="right") - 1
            key[sel], local[sel] = first_shard[s] + k, rec["start"][sel].astype(np.int64) - sources[s].shard_starts[k]
        out = np.empty(len(rec), SHARD_PIECE)
        out["g"], out["row_offset"], out["length"], out["local"] = rec["g"], rec["row_offset"], rec["length"], local
        order_ = np.argsort(key, kind="stable")
        key, out = key[order_], out[order_]
        cuts = np.flatnonzero(np.diff(key)) + 1
        for x, y in zip([0, *cuts.tolist()], [*cuts.tolist(), len(key)]):
            raw = out[x:y].tobytes()
            b = int(key[x])
            with open_append(shard_files.file(b), folder=shard_files.folder) as f:
                f.write(raw)
            shard_hashes.setdefault(b, xxhash.xxh3_64()).update(raw)

    with _scratch(tmp) as perm_scratch:
        for s in used:
            for q, ro, doc, do, ln, start, full in chain_pieces(plan, s, sources[s], memory, perm_scratch):
                problems.update(_cut_problems(ln, do, ro, full, plan.row_tokens))
                figures.add(q, ro, doc, ln, full)
                rec = np.empty(len(q), _BUILD)
                rec["g"], rec["row_offset"], rec["source"] = order.forward(q), ro, s
                rec["doc"], rec["doc_offset"], rec["length"], rec["start"] = doc, do, ln, start
                buffered.append(rec)
                held += len(rec)
                if held >= cap:
                    flush()
                    held = 0
    if buffered:
        flush()
    nb = -(-plan.samples // bucket_rows)
    index = np.zeros((nb + 1, 3), "<u8")
    h, padding, pieces = xxhash.xxh3_128(), 0, 0
    with open_new(tmp / TABLE_FILE) as tf, open_new(tmp / STARTS_FILE) as sf:
        for b in range(nb):
            rec = rows_files.read(b, _BUILD)
            rec = rec[np.lexsort((rec["row_offset"], rec["g"]))]
            table = np.empty(len(rec), PIECE)
            for name in PIECE.names:
                table[name] = rec[name]
            raw, starts = table.tobytes(), rec["start"].astype("<u8").tobytes()
            tf.write(raw)
            sf.write(starts)
            h.update(raw)
            index[b] = pieces, xxhash.xxh3_64_intdigest(raw), xxhash.xxh3_64_intdigest(starts)
            g0, g1 = b * bucket_rows, min(plan.samples, (b + 1) * bucket_rows)
            if len(rec) and (int(rec["g"][0]) < g0 or int(rec["g"][-1]) >= g1):
                raise TokpackError("internal error: a piece in another bucket of rows", where=f"rows {g0}..{g1}")
            padding += (g1 - g0) * plan.row_tokens - int(rec["length"].astype(np.int64).sum())
            pieces += len(rec)
    index[nb, 0] = pieces
    write_bytes_atomic(tmp / INDEX_FILE, index.tobytes())
    shutil.rmtree(tmp / "rows", ignore_errors=True)
    names = {}
    for b, hs in shard_hashes.items():
        s = int(np.searchsorted(first_shard, b, side="right")) - 1
        shard_files.file(b).rename(tmp / f"source-{s:04d}-{b - int(first_shard[s]):06d}")
        names[f"{s}-{b - int(first_shard[s])}"] = hs.intdigest()
    shutil.rmtree(tmp / "shards", ignore_errors=True)
    built = {
        "table_xxh3_128": h.hexdigest(),
        "padding": padding,
        "bucket_rows": bucket_rows,
        "problems": sorted(problems),
        "shard_files": names,
        "figures": figures.fields(),
    }
    write_bytes_atomic(tmp / BUILT_FILE, json.dumps(built).encode(), fsync=False)
    tmp.rename(folder)
    release_passes()  # what reads the table (the engine's steps, a replay, inspect) needs no pass
    return PackedTable.open(folder)


# -------------------------------------------------------------------- building rows


class TokenPool:
    """Every used source's shards, memory-mapped (the page cache, no fresh memory), for the
    in-memory engine and the replay. A piece never spans two shards (no document does)."""

    def __init__(self, plan: PackedPlan, sources: list[PackedSource], on_shard=None):
        used = [s for s, sp in enumerate(plan.sources) if sp.samples]
        self.dtype = sources[0].dtype
        self.parts: list[np.ndarray] = []  # mapped shards, in (source, shard) order
        self.first: dict[int, int] = {}  # source -> its first part
        self.part_starts: dict[int, np.ndarray] = {}  # source -> stream offset of each of its shards
        for s in used:
            src = sources[s]
            self.first[s] = len(self.parts)
            self.part_starts[s] = src.shard_starts
            for k, shard in enumerate(src.shards):
                n = int(shard["tokens"])
                part = map_file(src.path / shard["path"], 0, n * src.dtype.itemsize).view(src.dtype)
                if on_shard is not None:
                    on_shard(src, k, part)
                self.parts.append(part)
        self.sources = sources

    def rows(
        self, table: np.ndarray, g0: int, g1: int, row_tokens: int, pad_id: int, starts: np.ndarray | None = None
    ) -> np.ndarray:
        """Output rows [g0, g1) as an [n, row_tokens] token array. `starts`: each piece's first
        token in its source's stream (PackedTable.rows); None: from the sources' whole document
        tables (documents_of, O(documents): tests and small tools)."""
        out = np.full((g1 - g0, row_tokens), pad_id, dtype=self.dtype)
        a, b = np.searchsorted(table["g"], [g0, g1])
        t = table[a:b]
        if not len(t):
            return out
        src = t["source"].astype(np.int64)
        part = np.empty(len(t), np.int64)
        local = np.empty(len(t), np.int64)
        for s in np.unique(src).tolist():
            sel = src == s
            if starts is None:
                start = documents_of(self.sources[s])[0][t["doc"][sel].astype(np.int64)] + t["doc_offset"][sel].astype(
                    np.int64
                )
            else:
                start = starts[a:b][sel]
            k = np.searchsorted(self.part_starts[s], start, side="right") - 1
            part[sel], local[sel] = self.first[s] + k, start - self.part_starts[s][k]
        dest = (t["g"].astype(np.int64) - g0) * row_tokens + t["row_offset"].astype(np.int64)
        # One slice copy per piece: pieces are documents, hundreds of tokens or more, and a loop
        # of memcpys measured 6x faster than gathering through per-token index arrays.
        flat, parts = out.reshape(-1), self.parts
        for d, p, s, n in zip(dest.tolist(), part.tolist(), local.tolist(), t["length"].tolist()):
            flat[d : d + n] = parts[p][s : s + n]
        return out


# -------------------------------------------------------------------- verification


def cut_problems(table: np.ndarray, lengths: dict[int, np.ndarray], row_tokens: int) -> list[str]:
    """The packing rules a row table must keep (_cut_problems), each broken one named once;
    `lengths`: each source's document lengths."""
    if not len(table):
        return []
    src, doc = table["source"].astype(np.int64), table["doc"].astype(np.int64)
    full = np.empty(len(table), np.int64)
    for s, ls in lengths.items():
        sel = src == s
        full[sel] = ls[doc[sel]]
    return _cut_problems(
        table["length"].astype(np.int64),
        table["doc_offset"].astype(np.int64),
        table["row_offset"].astype(np.int64),
        full,
        row_tokens,
    )


def _cut_problems(
    length: np.ndarray, off: np.ndarray, row_offset: np.ndarray, full: np.ndarray, row_tokens: int
) -> list[str]:
    """Per piece (its length, offset in its document, offset in its row, its document's
    length): every piece of a document longer than a row but its tail is a full row at a
    multiple of row_tokens, and a document that fits a row is whole in one row."""
    problems = []
    fits = full <= row_tokens
    if np.any(fits & ((length != full) | (off != 0))):
        problems.append("a document that fits a row is cut")
    long = ~fits
    tail = full - (full // row_tokens) * row_tokens
    is_tail = long & (off == full - tail) & (tail > 0)
    if np.any(long & ~is_tail & ((length != row_tokens) | (off % row_tokens != 0) | (row_offset != 0))):
        problems.append("a long document is cut other than into full rows and its tail")
    if np.any(is_tail & (length != tail)):
        problems.append("a long document's tail has the wrong length")
    return problems


def packed_replay(
    manifest: dict, sources: list[PackedSource], order: bool = True, memory: int = DEFAULT_PLAN_MEMORY
) -> tuple[str, list[int], str, list[str], "PlannedPadding", dict]:
    """(sample multiset hash, each output shard's order hash (with `order`), row table checksum,
    packing rule problems, the planned padding, the RowFigures fields of its rows) of a packed epoch, recomputed from its manifest's parameters and its
    sources alone, within `memory`. Rows are rebuilt in output order, so the order terms need no inverse."""
    plan = packed_plan_from_manifest(manifest, sources, memory)
    per, listed = shard_count_checked(manifest, plan.samples) if order else (1, 0)
    by_fp = {s.fingerprint: s for s in sources}
    opened = [by_fp[sp.fingerprint] for sp in plan.sources]
    pool = TokenPool(plan, opened)
    total, step = 0, 1 << 14
    shard_orders = np.zeros(listed, dtype=np.uint64)
    pads = PlannedPadding(per if order else max(plan.samples, 1))
    with _scratch() as d:
        from pathlib import Path

        built = build_table(plan, opened, Path(d) / "packing", plan.memory)
        for g0 in range(0, plan.samples, step):
            g1 = min(plan.samples, g0 + step)
            table, starts = built.rows(g0, g1)
            for s, sp in enumerate(plan.sources):  # the proof that no held-out document is in a row
                held = plan.holdout_of(s)
                if held is not None and held.left_out(table["doc"][table["source"] == s].astype(np.int64)).any():
                    raise TokpackError(
                        "a document of the other split is in the epoch",
                        where=f"sources[{s}] ({sp.name})",
                        expected="a training epoch: no held-out document; RUN/holdout/: only those",
                        hint="the epoch is not its plan's: shuffle it again",
                    )
            pads.add(row_padding(table, g1 - g0, plan.row_tokens, g0))
            hashes = row_hashes(pool.rows(table, g0, g1, plan.row_tokens, plan.pad_id, starts))
            total += int(hashes.sum(dtype=np.uint64))
            if order:  # uint64 sums wrap: mod 2^64
                g = np.arange(g0, g1, dtype=np.int64)
                np.add.at(shard_orders, g // per, order_hash_terms(g, hashes))
    return hash_hex64(total), shard_orders.tolist(), built.table_xxh3_128, list(built.problems), pads, built.figures


class PlannedPadding:
    """The padding the plan gives each output row, as each shard's `.ds.pad` checksum and the
    epoch's total: what proves, position by position, the padding the loader will mask (validate
    checks each `.ds.pad` against its recorded checksum; this checks that checksum against the
    plan). Rows arrive in output order; memory: one shard's hasher."""

    def __init__(self, per: int):
        self.per, self.rows, self.total = per, 0, 0
        self.digests: list[str] = []
        self._h = xxhash.xxh3_128()

    def add(self, pad: np.ndarray) -> None:
        self.total += int(pad.sum(dtype=np.int64))
        while len(pad):
            k = min(len(pad), self.per - self.rows % self.per)
            self._h.update(pad[:k].tobytes())
            self.rows, pad = self.rows + k, pad[k:]
            if self.rows % self.per == 0:
                self.digests.append(self._h.hexdigest())
                self._h = xxhash.xxh3_128()

    def problem(self, manifest: dict) -> tuple | None:
        """(field, expected, found) of the first place the manifest's padding is not the plan's."""
        if self.rows % self.per:
            self.digests.append(self._h.hexdigest())
            self._h = xxhash.xxh3_128()
        recorded = (manifest.get("packing") or {}).get("padding_tokens")
        if recorded != self.total:
            return "packing.padding_tokens", f"{self.total} (replayed from the sources)", recorded
        for i, (s, want) in enumerate(zip(manifest.get("shards") or [], self.digests)):
            if not isinstance(s, dict) or s.get("pad_xxh3_128") != want:
                found = s.get("pad_xxh3_128") if isinstance(s, dict) else s
                return f"shards[{i}].pad_xxh3_128", f"{want} (the padding its plan gives the rows, replayed)", found
        return None


def replay_packed(
    manifest: dict, sources: list[PackedSource], order: bool = True, memory: int = DEFAULT_PLAN_MEMORY
) -> tuple[str, list[int]]:
    """`validate --against`'s replay of a packed epoch (tokpack.shuffle.packings): (multiset
    hash, per-shard order hashes), as `plan.replay_hashes`. Its row table must also hash to the
    recorded `packing.table_xxh3_128` and keep the packing rules; either failure is one
    TokpackError, and so must each shard's recorded padding (PlannedPadding)."""
    multiset, orders, table_sum, problems, pads, figures = packed_replay(manifest, sources, order, memory)
    recorded = (manifest.get("packing") or {}).get("table_xxh3_128")
    if problems:
        raise TokpackError(
            problems[0], where="packing", expected="the best-fit packing rules", found="; ".join(problems)
        )
    if table_sum != recorded:
        raise TokpackError(
            "epoch's row table is not the one its plan packs",
            where="packing.table_xxh3_128",
            expected=f"{table_sum} (replayed from the sources)",
            found=recorded,
        )
    for key, want in figures.items():  # what the summaries show of the rows: recorded by older epochs or not
        found = (manifest.get("packing") or {}).get(key, want)
        if found != want:
            raise TokpackError(
                "epoch's recorded row figures are not its rows'",
                where=f"packing.{key}",
                expected=f"{want} (replayed from the sources)",
                found=found,
                hint="restore the epoch's manifest from a good copy, or shuffle it again",
            )
    padding = pads.problem(manifest) if order else None
    if padding:
        where, expected, found = padding
        raise TokpackError(
            "epoch's padding is not where its plan puts it: the loader would mask other tokens",
            where=where,
            expected=expected,
            found=found,
            hint="restore the epoch's .ds.pad files and manifest from a good copy, or shuffle it again",
        )
    return multiset, orders


def plan_options(pad_id: int | None = None, group_tokens: int | None = None) -> dict:
    """The options of a packed plan a run gives (None: the default)."""
    return {k: v for k, v in (("pad_id", pad_id), ("group_tokens", group_tokens)) if v is not None}


def packing_settings(
    sources: list[PackedSource], pad_id: int | None = None, group_tokens: int | None = None, holdout: dict | None = None
) -> dict:
    """What a packed run records (and a rerun must repeat) of its packing, from its options."""
    return {
        "method": BEST_FIT,
        "group_tokens": int(group_tokens or DEFAULT_GROUP_TOKENS),
        "pad_id": sources[0].eos_id if pad_id is None else int(pad_id),
        **record_holdout(holdout, padded=True),
    }


def run_packing(plan: PackedPlan) -> dict:
    """The same, of a planned epoch (the run manifest's `packing`)."""
    return {
        "method": BEST_FIT,
        "group_tokens": plan.group_tokens,
        "pad_id": plan.pad_id,
        **record_holdout(plan.holdout, padded=True),
    }


def holdout_plan(
    sources: list[PackedSource], *, seq_len: int, seed: int, holdout: dict, names: list[str], memory: int, **options
) -> PackedPlan:
    """The plan of RUN/holdout/: one pass over each source's held-out documents, best-fit packed
    and ordered as an epoch is (epoch 0's keys), all of them (no weights, no --samples)."""
    return packed_epoch_plan(
        sources, seq_len=seq_len, seed=seed, epoch=0, names=names, memory=memory, holdout=holdout, split=True, **options
    )


def held_out(src: PackedSource, spec: dict | None, seed: int, memory: int = DEFAULT_PLAN_MEMORY) -> "Holdout":
    """Source `src`'s held-out documents for `--holdout` `spec` (a token count reads the
    documents' lengths in the holdout's order, within `memory`)."""
    key = (src.fingerprint, int(seed), repr(spec))
    if key in _HELD:
        return _HELD[key]

    def lengths_in_order(order):
        with _scratch() as d:
            for _, _, lengths in permuted_documents(src, order, memory, d):
                yield lengths

    _HELD[key] = holdout_of(src, spec, seed, document_count(src), lengths_in_order)
    return _HELD[key]


_HELD: dict[tuple, "Holdout"] = {}  # (fingerprint, seed, spec) -> its Holdout: planned once per process


def chained_packed_plan(
    plan: PackedPlan, *, members, sources, names, cursors, weights, counts, memory, **options
) -> PackedPlan:  # options: pad_id, group_tokens, holdout
    """An epoch of a schedule of several stages: every source of the schedule, each chain from
    its cursor over packed rows, the stage's samples from each (`counts`)."""
    return packed_epoch_plan(
        sources,
        seq_len=plan.seq_len,
        seed=plan.seed,
        epoch=plan.epoch,
        weights=weights,
        names=names,
        cursors=cursors,
        counts=counts,
        memory=memory,
        **options,
    )
