"""Best-fit's documents and passes (tokpack.shuffle.packed): a source's documents read from its
`.ds.index`, permuted per pass by rho_{s,p} (in memory, or through bucket files within a budget),
cut into groups and packed by best-fit decreasing. A pass read whole is kept while it fits a
quarter of the caller's budget (iter_pass), since an epoch needs each of its passes three times.
A source whose pass is one group is read and packed once for all its passes (OneGroupPasses).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import functools
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from tokpack.formats.errors import TokpackError
from tokpack.formats.io.gate import open_append, read_array, regular_size
from tokpack.formats.shards import PackedSource

from ..holdout import Holdout
from ..permutation import Bijection, inverse_each

_BIG = 1 << 40  # BFD keys: remaining capacity * _BIG + row, so one sorted int list orders by (capacity, row)

# -------------------------------------------------------------------- documents

# Plan state per document while a pass's documents are permuted out of core: a DOC record in
# its bucket file and the arrays that place it (about 4x the record).
DOC = np.dtype([("k", "<u8"), ("doc", "<u8"), ("start", "<u8"), ("length", "<u8")])
DOC_STATE_BYTES = 4 * DOC.itemsize
MIN_CHUNK = 1 << 12  # documents (or pieces) per chunk at the least, whatever the budget


def scratch(folder=None):
    """A scratch folder removed after use: in `folder` (an epoch's work folder), else in the
    system's temporary folder (a plan made before any output exists)."""
    return tempfile.TemporaryDirectory(prefix="tokpack-plan-", dir=folder)


@functools.lru_cache(maxsize=8)
def _doc_table(path: str, fingerprint: str) -> tuple[np.ndarray, np.ndarray]:
    return doc_table(PackedSource.open(path, check_sizes=False))


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
    check_real(src)
    return _doc_table(str(src.path), src.fingerprint)


def check_real(src: PackedSource) -> None:
    if str(src.path).startswith("virtual:"):
        raise TokpackError(
            "best-fit packing needs the documents of the source",
            file=src.path,
            hint="plan a best-fit run on packed sources, not virtual ones",
        )


_DOCS: dict = {}  # the last source's (start, length) per document that fit in memory, and its _pass_key


def permuted_documents(src: PackedSource, perm: Bijection | None, memory: int, folder: str | None):
    """The source's documents in the order of `perm` (position k holds document perm(k)), as
    chunks (doc, start, length) in position order. Bounded by `memory`: when the documents do
    not fit it, each is appended, with its position k, to the bucket file of its range of k
    (in `folder`, else in a scratch folder of its own, made only then: making and removing a
    folder per pass cost more than packing a small pass), and each bucket is read back and
    placed: one write and one read of 32 bytes a document."""
    check_real(src)
    d = document_count(src)
    if d == 0:
        return
    chunk = max(MIN_CHUNK, memory // DOC_STATE_BYTES)
    if d <= chunk:
        key = _pass_key(src, 0, 0, 0, 0, 0)
        if _DOCS.get("key") != key:  # each pass of a source drawn many times reads the same index
            _DOCS.update(key=key, docs=doc_table(src))
        start, length = _DOCS["docs"]
        doc = perm.forward(np.arange(d, dtype=np.int64))
        yield doc, start[doc], length[doc]
        return
    with scratch() if folder is None else contextlib.nullcontext(folder) as where:
        buckets = Buckets(Path(where), "docs")
        for docs, start, length in source_documents(src, chunk):
            k = perm.inverse(docs)
            rec = np.empty(len(k), DOC)
            rec["k"], rec["doc"], rec["start"], rec["length"] = k, docs, start, length
            buckets.append(k // chunk, rec)
        for b in range(-(-d // chunk)):
            f = buckets.file(b)
            rec = read_array(f, DOC, folder=buckets.folder)
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
    order = perm.forward(np.arange(len(lengths), dtype=np.int64))
    groups = list(_packed_groups([(order, order, lengths[order])] if len(lengths) else [], row_tokens, group_tokens))
    cols = [np.concatenate([g[2][i] for g in groups]) if groups else np.zeros(0, np.int64) for i in range(5)]
    return PassRows(sum(g[1] for g in groups), *cols)


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
    _ONE_GROUP.clear()


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


def _pack_pass(src, s, p, seed, row_tokens, group_tokens, memory, scratch, holdout):
    """iter_pass's pass (its arguments), packed afresh."""
    perm = Bijection(max(document_count(src), 1), "docs", seed, s, p)
    docs = permuted_documents(src, perm, memory, scratch)
    if holdout is not None:
        docs = ([c[~out] for c in chunk] for chunk in docs for out in [holdout.left_out(chunk[0])])
    return _packed_groups(docs, row_tokens, group_tokens)


def _packed_groups(docs, row_tokens: int, group_tokens: int):
    """A pass's permuted documents (chunks of (doc, start, length)) cut into groups (pass_groups),
    each packed by pack_group: iter_pass's groups."""
    rows = 0
    for a, gd, gs, gl in pass_groups(docs, group_tokens):
        r, ro, which, do, ln, n = pack_group(gl, np.arange(a, a + len(gl), dtype=np.int64), row_tokens)
        yield rows, n, (rows + r, ro, gd[which], do, ln, gs[which] + do, gl[which])
        rows += n


# -------------------------------------------------------------------- a source of one group a pass


@dataclass(frozen=True, eq=False)
class OneGroupPasses:
    """Every pass over a source whose pass is one group (its tokens, but for its shortest
    document, fewer than G: no prefix of any order reaches G). Such passes all hold the same
    pieces in the same rows at the same offsets: best-fit decreasing places tails by length,
    and the lengths are the pass's whatever its order; the order only decides which document
    takes a full row's place (in position order) and which of equal tails takes which slot
    (ties by position). So the rows are counted and best-fit packed once, and a batch of
    passes is the order's choices for all of them at once (inverse_each): a source drawn
    20,000 times costs what its rows cost, not 20,000 packings (issue 42). The pieces are
    those pack_group gives each pass, in its order."""

    n: int  # the order's domain: D_s
    doc: np.ndarray  # the documents a pass holds (held-out ones dropped), ascending
    start: np.ndarray  # each one's first token in the stream
    length: np.ndarray
    full_of: np.ndarray  # the full rows of each
    full_docs: np.ndarray  # which of them have full rows (indices into doc)
    tail_docs: np.ndarray  # which have a tail, by tail length descending
    tail_rank: np.ndarray  # of each of tail_docs: how many distinct tail lengths are longer
    slot_row: np.ndarray  # per tail slot, in (row, offset) order: its row after the full rows
    slot_offset: np.ndarray
    slot_of: np.ndarray  # per slot in that order, its place in tail_docs' order
    full_rows: int
    rows: int  # R_{s,p}, every pass
    row_tokens: int
    fixed: bool  # no choice is left to the order: every pass is the same

    @property
    def pieces(self) -> int:
        """Pieces a pass holds."""
        return self.full_rows + len(self.tail_docs)

    def batch(self, memory: int) -> int:
        """Passes a call of `place` holds within `memory`: a dozen int64 columns a piece, and a
        document's position and sort (16 columns, the bound counted for both)."""
        return max(1, memory // (128 * (self.pieces + len(self.doc))))

    def place(self, seed: int, s: int, p0: int, p1: int) -> tuple[np.ndarray, ...]:
        """Passes [p0, p1) of source s: (pass, row in the pass, row_offset, doc, doc_offset,
        length, first token in the stream, the document's length) per piece, passes in order,
        each pass's pieces by (row, row_offset), as pack_group orders them."""
        count, nf = p1 - p0, self.full_rows
        if self.fixed or count == 0:
            full = np.broadcast_to(self.full_docs, (count, len(self.full_docs)))
            tails = np.broadcast_to(self.tail_docs, (count, len(self.tail_docs)))
        else:
            pos = inverse_each(self.n, ("docs", seed, s), range(p0, p1), self.doc)  # each document's position
            full = self.full_docs[np.argsort(pos[:, self.full_docs], axis=1, kind="stable")]
            key = self.tail_rank * self.n + pos[:, self.tail_docs]  # tail descending, then position
            tails = self.tail_docs[np.argsort(key, axis=1, kind="stable")]
        counts = self.full_of[full].ravel()
        which_full = np.repeat(full.ravel(), counts).reshape(count, nf)
        first = (np.cumsum(self.full_of[full], axis=1) - self.full_of[full]).ravel()
        fragment = np.arange(nf, dtype=np.int64) - np.repeat(first, counts).reshape(count, nf)
        which_tail = tails[:, self.slot_of]
        which = np.concatenate([which_full, which_tail], axis=1)
        r = self.row_tokens
        doc_offset = np.concatenate([fragment * r, self.full_of[which_tail] * r], axis=1)
        length = np.concatenate(
            [np.full((count, nf), r, np.int64), self.length[which_tail] - self.full_of[which_tail] * r], axis=1
        )
        m = self.pieces
        row = np.tile(np.concatenate([np.arange(nf, dtype=np.int64), nf + self.slot_row]), count)
        offset = np.tile(np.concatenate([np.zeros(nf, np.int64), self.slot_offset]), count)
        which, doc_offset, length = which.ravel(), doc_offset.ravel(), length.ravel()
        return (
            np.repeat(np.arange(p0, p1, dtype=np.int64), m),
            row,
            offset,
            self.doc[which],
            doc_offset,
            length,
            self.start[which] + doc_offset,
            self.length[which],
        )


def one_group_passes(
    src: PackedSource, row_tokens: int, group_tokens: int, memory: int, holdout: "Holdout | None" = None
) -> OneGroupPasses | None:
    """The source's passes as OneGroupPasses when its pass is one group and its documents fit
    `memory` (as permuted_documents holds them), else None (each pass packed by iter_pass)."""
    key = (*_pass_key(src, 0, 0, 0, row_tokens, group_tokens), holdout)
    if key not in _ONE_GROUP:
        _ONE_GROUP[key] = _one_group(src, row_tokens, group_tokens, holdout)
        while len(_ONE_GROUP) > 8:  # a plan's sources; each is O(documents), dropped with the kept passes
            _ONE_GROUP.pop(next(iter(_ONE_GROUP)))
    found = _ONE_GROUP[key]
    return found if found is not None and found.n <= max(MIN_CHUNK, memory // DOC_STATE_BYTES) else None


_ONE_GROUP: dict[tuple, "OneGroupPasses | None"] = {}


def _one_group(src: PackedSource, row_tokens: int, group_tokens: int, holdout) -> OneGroupPasses | None:
    check_real(src)
    d = document_count(src)
    if d == 0 or src.tokens - 1 >= group_tokens:  # cheap refusals before any read (a document holds a token)
        return None
    doc, (start, length) = np.arange(d, dtype=np.int64), doc_table(src)
    if holdout is not None:
        keep = ~holdout.left_out(doc)
        doc, start, length = doc[keep], start[keep], length[keep]
    if not len(doc) or int(length.sum()) - int(length.min()) >= group_tokens:
        return None
    full_of, tail = length // row_tokens, length % row_tokens
    full_docs = np.flatnonzero(full_of)
    has = np.flatnonzero(tail)
    tail_docs = has[np.argsort(-tail[has], kind="stable")]
    sorted_tails = tail[tail_docs]
    _, tail_rank = np.unique(-sorted_tails, return_inverse=True)
    # best-fit decreasing of the tails in that order (ties already broken: positions 0, 1, ...)
    row, offset, opened = best_fit_decreasing(sorted_tails, np.arange(len(has), dtype=np.int64), row_tokens)
    slot_of = np.lexsort((offset, row))
    nf = int(full_of.sum())
    return OneGroupPasses(
        n=max(d, 1),
        doc=doc,
        start=start,
        length=length,
        full_of=full_of,
        full_docs=full_docs,
        tail_docs=tail_docs,
        tail_rank=tail_rank.astype(np.int64).ravel(),
        slot_row=row[slot_of],
        slot_offset=offset[slot_of],
        slot_of=slot_of,
        full_rows=nf,
        rows=nf + opened,
        row_tokens=row_tokens,
        fixed=len(full_docs) <= 1 and len(np.unique(sorted_tails)) == len(sorted_tails),
    )


def source_pass(plan, s: int, p: int) -> PassRows:
    """Pass p over source s, in memory (O(documents): for tests and small tools): its documents
    permuted by rho_{s,p} = Bijection(D_s, "docs", seed, s, p)."""
    lengths = documents_of(PackedSource.open(plan.sources[s].path, check_sizes=False))[1]
    return pack_pass(
        lengths, Bijection(max(len(lengths), 1), "docs", plan.seed, s, p), plan.row_tokens, plan.group_tokens
    )


class Buckets:
    """Append-only numbered scratch files in a folder: records of several buckets at once, each
    run to its own file; `hashed`: each file's xxh3_64 kept as it is written (`hashes`)."""

    def __init__(self, folder, stem: str, hashed: bool = False):
        self.folder, self.stem, self.seen = folder, stem, set()
        self.hashes: dict[int, xxhash.xxh3_64] | None = {} if hashed else None
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
            raw = records[x:y].tobytes()
            with open_append(self.file(b), folder=self.folder) as out:
                out.write(raw)
            if self.hashes is not None:
                self.hashes.setdefault(b, xxhash.xxh3_64()).update(raw)

    def names(self) -> list[int]:
        return sorted(self.seen)

    def read(self, b: int, dtype) -> np.ndarray:
        f = self.file(b)
        if not f.exists():
            return np.zeros(0, dtype)
        data = read_array(f, dtype, folder=self.folder)
        f.unlink()
        return data
