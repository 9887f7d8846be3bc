"""The packed plan (`--packing best-fit`): whole documents packed into rows by best-fit
decreasing, per source and per pass, then the rows of all sources permuted globally.

Specified in docs/COMMANDS.md, "Best-fit packing", and pinned by tests/test_packing.py; the
names follow it (R = L + 1, D_s, rho_{s,p}, G, R_{s,p}, c_s, sigma_e).

Unlike the window plan (O(#sources), shuffle.plan.EpochPlan), a packed plan is materialised:
its row table (per output row, the pieces of documents it holds) is computed from the sources'
document lengths (their `.ds.index`), O(documents) in memory, and checksummed; the checksum is
recorded in the epoch manifest so `validate --against` proves the epoch is this table's.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, replace

import numpy as np
import xxhash

from formats.errors import TokpackError
from formats.io import map_file
from formats.manifest import hash_hex64, order_hash_terms, row_hashes
from formats.shards import PackedSource

from .permutation import Bijection
from .plan import EpochPlan, mixture, replay_hashes, shard_count_checked

PACKED_ALGORITHM = "tokpack-bfd-feistel6-splitmix-xxh3-v1"  # the `shuffle` name of a packed epoch
PACKINGS = ("concat", "best-fit")
# A group's documents and rows are held while it is packed (about 60 bytes a document); at 2^22
# tokens the padding of web-like lengths is under 0.5% at seq_len 4096 (BENCHMARKS.md, "Best-fit
# packing"), and a group is a few MB of plan state, far inside any --memory.
DEFAULT_GROUP_TOKENS = 1 << 22
_BIG = 1 << 40  # BFD keys: remaining capacity * _BIG + row, so one sorted int list orders by (capacity, row)

# The row table: one record per piece (a document, or a fragment of one, inside one row), in
# output order: by output row g, then offset in the row. Its bytes are what `table_xxh3_128` hashes.
PIECE = np.dtype([("g", "<u8"), ("row_offset", "<u4"), ("source", "<u4"), ("doc", "<u8"), ("doc_offset", "<u8"),
                  ("length", "<u4")])


# -------------------------------------------------------------------- documents


@functools.lru_cache(maxsize=8)
def _doc_table(path: str, fingerprint: str) -> tuple[np.ndarray, np.ndarray]:
    src = PackedSource.open(path, check_sizes=False)
    return doc_table(src)


def doc_table(src: PackedSource) -> tuple[np.ndarray, np.ndarray]:
    """(first token in the stream, length) of every document of a source, from its `.ds.index`.
    Checked: each shard's index ends at its token count and increases strictly."""
    starts, lengths = [], []
    for k, shard in enumerate(src.shards):
        ends = src.doc_ends(k).astype(np.int64)
        n = int(shard["tokens"])
        if len(ends) and (ends[-1] != n or np.any(np.diff(ends) <= 0) or ends[0] <= 0):
            raise TokpackError("source index does not describe its shard", file=src.path / f"{shard['path']}.index",
                               expected=f"strictly increasing ends up to {n}", found=f"{len(ends)} entries",
                               hint="run `tokpack validate` on the source")
        first = np.concatenate([[0], ends[:-1]])
        starts.append(first + int(src.shard_starts[k]))
        lengths.append(ends - first)
    cat = (lambda a: np.concatenate(a) if a else np.zeros(0, np.int64))
    return cat(starts), cat(lengths)


def documents_of(src: PackedSource) -> tuple[np.ndarray, np.ndarray]:
    if str(src.path).startswith("virtual:"):
        raise TokpackError("best-fit packing needs the documents of the source", file=src.path,
                           hint="plan a best-fit run on packed sources, not virtual ones")
    starts, lengths = _doc_table(str(src.path), src.fingerprint)
    _LENGTHS[src.fingerprint] = lengths
    return starts, lengths


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


def best_fit_decreasing(tails: np.ndarray, positions: np.ndarray, row_tokens: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Packs pieces of lengths `tails` (each <= row_tokens) into rows: in order of length
    descending, ties by `positions` ascending, each into the row with the least room that
    still holds it (ties: the lowest row), else into a new row. Returns (row, offset) per
    piece and the row count."""
    order = np.lexsort((positions, -tails))
    row = np.empty(len(tails), np.int64)
    offset = np.empty(len(tails), np.int64)
    keys: list[int] = []  # rows with room left, as remaining * _BIG + row, sorted
    rows = 0
    for i, t in zip(order.tolist(), tails[order].tolist()):
        j = bisect.bisect_left(keys, t * _BIG)
        if j < len(keys):
            rem, r = divmod(keys.pop(j), _BIG)
        else:
            rem, r = row_tokens, rows
            rows += 1
        row[i], offset[i] = r, row_tokens - rem
        if rem > t:
            bisect.insort(keys, (rem - t) * _BIG + r)
    return row, offset, rows


def pack_pass(lengths: np.ndarray, perm: Bijection, row_tokens: int, group_tokens: int) -> PassRows:
    """One pass over a source whose documents have `lengths`: documents in the order of `perm`,
    cut into groups of >= group_tokens tokens (the last may be smaller); per group, the full-row
    fragments of documents longer than a row first, then the best-fit rows of the remaining
    pieces (see best_fit_decreasing)."""
    d = len(lengths)
    order = perm.forward(np.arange(d, dtype=np.int64))  # position k holds document order[k]
    lens = lengths[order]
    cum = np.cumsum(lens)
    parts, rows, a = [], 0, 0
    while a < d:
        base = int(cum[a - 1]) if a else 0
        b = min(d, int(np.searchsorted(cum, base + group_tokens, side="left")) + 1)
        gl, gd = lens[a:b], order[a:b]
        full = gl // row_tokens
        tail = gl - full * row_tokens
        # Full rows: one per row_tokens of each long document, in permuted order.
        nf = int(full.sum())
        f_doc = np.repeat(gd, full)
        f_k = np.arange(nf, dtype=np.int64) - np.repeat(np.cumsum(full) - full, full)
        parts.append((rows + np.arange(nf, dtype=np.int64), np.zeros(nf, np.int64), f_doc, f_k * row_tokens,
                      np.full(nf, row_tokens, np.int64)))
        rows += nf
        has = np.flatnonzero(tail)
        r, off, nb = best_fit_decreasing(tail[has], np.arange(a, b, dtype=np.int64)[has], row_tokens)
        parts.append((rows + r, off, gd[has], full[has] * row_tokens, tail[has]))
        rows += nb
        a = b
    cols = [np.concatenate([p[i] for p in parts]) if parts else np.zeros(0, np.int64) for i in range(5)]
    srt = np.lexsort((cols[1], cols[0]))
    return PassRows(rows, *(c[srt] for c in cols))


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


@dataclass(frozen=True)
class PackedPlan:
    """A packed epoch (see the module docstring). Implements shuffle.plan.SamplePlan."""

    seed: int
    epoch: int
    seq_len: int
    samples: int
    sources: tuple[PackedSourcePlan, ...]
    group_tokens: int
    pad_id: int
    jitter: bool = False

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
        sp = self.sources[s]
        if sp.passes < 2:
            return 0
        lo, hi = self.chain_start(s), self.chain_start(s) + sp.samples
        at, keys = pass_start(self, s, sp.first_pass), []
        for p in range(sp.first_pass, sp.first_pass + sp.passes):
            pr = source_pass(self, s, p)
            sel = (pr.row >= lo - at) & (pr.row < hi - at)
            keys.append(np.stack([pr.doc[sel], pr.doc_offset[sel]], axis=1))
            at += pr.rows
        keys = np.concatenate(keys)
        return int(len(keys) - len(np.unique(keys, axis=0)))

    def source_report(self) -> list[dict]:
        return [{"name": s.name, "path": s.path, "fingerprint": s.fingerprint, "weight": s.weight,
                 "samples": s.samples, "windows": s.windows, "passes": s.passes, "first_pass": s.first_pass,
                 "repeats": self.repeats(i)} for i, s in enumerate(self.sources)]

    def source_entries(self) -> list[dict]:
        return [{"name": s.name, "path": s.path, "fingerprint": s.fingerprint, "weight": s.weight,
                 "samples": s.samples, "first_pass": s.first_pass, "passes": s.passes, "windows": s.windows,
                 "tokens": s.tokens, "offset": 0, "dropped_tokens": 0, "documents": s.documents,
                 **({} if s.cursor is None else {"cursor": s.cursor})} for s in self.sources]

    def packing_entry(self, table_hash: str, padding: int) -> dict:
        """The epoch manifest's `packing` object."""
        return {"method": "best-fit", "group_tokens": self.group_tokens, "pad_id": self.pad_id,
                "padding_tokens": padding, "table_xxh3_128": table_hash}

    def table(self, sources: list[PackedSource]) -> np.ndarray:
        """The row table (PIECE records in output order). O(pieces) memory."""
        order = self.order()
        out = []
        for s, sp in enumerate(self.sources):
            if not sp.samples:
                continue
            documents_of(sources[s])
            lo, hi = self.chain_start(s), self.chain_start(s) + sp.samples
            at = pass_start(self, s, sp.first_pass)  # chain position of pass first_pass's row 0
            for p in range(sp.first_pass, sp.first_pass + sp.passes):
                pr = source_pass(self, s, p)
                a, b = max(lo - at, 0), min(hi - at, pr.rows)
                sel = np.flatnonzero((pr.row >= a) & (pr.row < b))
                q = sp.base + (at + pr.row[sel] - lo)
                rec = np.empty(len(sel), PIECE)
                rec["g"] = order.forward(q)
                rec["row_offset"], rec["source"] = pr.row_offset[sel], s
                rec["doc"], rec["doc_offset"], rec["length"] = pr.doc[sel], pr.doc_offset[sel], pr.length[sel]
                out.append(rec)
                at += pr.rows
        table = np.concatenate(out) if out else np.zeros(0, PIECE)
        return table[np.lexsort((table["row_offset"], table["g"]))]


def table_hash(table: np.ndarray) -> str:
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(table).tobytes())


def row_padding(table: np.ndarray, samples: int, row_tokens: int) -> np.ndarray:
    """Padding tokens at the end of each output row (uint32)."""
    used = np.bincount(table["g"].astype(np.int64), weights=table["length"].astype(np.float64), minlength=samples)
    return (row_tokens - used.astype(np.int64)).astype("<u4")


_LENGTHS: dict[str, np.ndarray] = {}  # fingerprint -> document lengths, filled by documents_of


@functools.lru_cache(maxsize=16)
def _pass_cached(fingerprint: str, seed: int, s: int, p: int, row_tokens: int, group_tokens: int) -> PassRows:
    lengths = _LENGTHS[fingerprint]
    return pack_pass(lengths, Bijection(max(len(lengths), 1), "docs", seed, s, p), row_tokens, group_tokens)


def source_pass(plan, s: int, p: int) -> PassRows:
    """Pass p over source s: its documents permuted by rho_{s,p} = Bijection(D_s, "docs", seed, s, p).
    The source's documents must have been read (documents_of) first."""
    return _pass_cached(plan.sources[s].fingerprint, plan.seed, s, p, plan.row_tokens, plan.group_tokens)


def pass_start(plan, s: int, p: int) -> int:
    """Chain position of the first row of pass p: the rows of passes 0..p-1."""
    return sum(source_pass(plan, s, k).rows for k in range(p))


def _locate_chain(plan, s: int, lo: int, n: int) -> tuple[int, int, tuple[int, ...]]:
    """(first pass, passes, their row counts) covering chain positions [lo, lo + n)."""
    p, at = 0, 0
    while True:
        r = source_pass(plan, s, p).rows
        if at + r > lo:
            break
        at, p = at + r, p + 1
    first, counts = p, []
    while at < lo + n:
        r = source_pass(plan, s, p).rows
        counts.append(r)
        at, p = at + r, p + 1
    return first, len(counts), tuple(counts)


def packed_epoch_plan(sources: list[PackedSource], *, seq_len: int, seed: int, epoch: int,
                      weights: list[str | None] | None = None, samples: int | None = None,
                      tokens: int | None = None, names: list[str] | None = None,
                      group_tokens: int = DEFAULT_GROUP_TOKENS, pad_id: int | None = None,
                      cursors: list[int | None] | None = None, counts: list[int] | None = None) -> PackedPlan:
    """The packed plan of one epoch. c_s: as the window plan apportions samples, with R_{s,0}
    (the rows of pass 0) in place of W_s. `counts` (a schedule's per-source samples) overrides it."""
    if not sources:
        raise TokpackError("no sources given", hint="tokpack shuffle SOURCE[=WEIGHT]... -o OUT --packing best-fit")
    pad = sources[0].eos_id if pad_id is None else int(pad_id)
    if not 0 <= pad < sources[0].vocab_size:
        raise TokpackError("pad id outside the vocabulary", where="--pad-id", expected=f"0..{sources[0].vocab_size - 1}",
                           found=pad, hint="leave --pad-id out to pad with the EOS id")
    stub = PackedPlan(int(seed), int(epoch), int(seq_len), 0, tuple(
        PackedSourcePlan(s, "", str(src.path), src.fingerprint, None, src.tokens, 0, 0, 0, 0)
        for s, src in enumerate(sources)), int(group_tokens), pad)
    lengths = [documents_of(src)[1] for src in sources]
    rows0 = [source_pass(stub, s, 0).rows for s in range(len(sources))]
    for src, rows in zip(sources, rows0):
        if rows == 0:  # its chain would hold nothing to take
            raise TokpackError("source holds no documents", file=src.path, where="documents",
                               expected=">= 1 document", found=0, hint="drop this source")
    weights = list(weights) if weights is not None else [None] * len(sources)
    if counts is None:
        counts = mixture(sources, weights, rows0, samples=samples, tokens=tokens, seq_len=seq_len)[1]
    plans, base = [], 0
    for s, src in enumerate(sources):
        cursor = None if cursors is None else cursors[s]
        sp = PackedSourcePlan(s, names[s] if names else src.path.name, str(src.path), src.fingerprint,
                              None if weights[s] is None else str(weights[s]), src.tokens, len(lengths[s]), rows0[s],
                              counts[s], base, cursor)
        plans.append(sp)
        base += counts[s]
    plan = replace(stub, samples=base, sources=tuple(plans))
    located = []
    for s, sp in enumerate(plan.sources):
        if sp.samples:
            first, k, rows = _locate_chain(plan, s, plan.chain_start(s), sp.samples)
            sp = replace(sp, first_pass=first, passes=k, pass_rows=rows)
        located.append(sp)
    plan = replace(plan, sources=tuple(located))
    return plan


def packed_plan_from_manifest(manifest: dict, sources: list[PackedSource]) -> PackedPlan:
    """The packed plan an epoch manifest was written from, against the opened sources (matched
    by fingerprint, in any order)."""
    pk = manifest.get("packing")
    if not isinstance(pk, dict) or pk.get("method") != "best-fit":
        raise TokpackError("packed epoch without its packing", where="packing", expected="{method: best-fit, ...}",
                           found=pk)
    entries = manifest.get("sources") or []
    pool = {s.fingerprint: s for s in sources}
    ordered, counts, cursors, weights, names = [], [], [], [], []
    for i, e in enumerate(entries):
        src = pool.get(e.get("fingerprint"))
        if src is None:
            raise TokpackError("source of the epoch not given", where=f"sources[{i}] ({e.get('name')})",
                               expected=f"a source with fingerprint {e.get('fingerprint')}",
                               found=", ".join(str(p.path) for p in sources) or "none",
                               hint="pass every source the epoch was shuffled from, unchanged")
        ordered.append(src)
        counts.append(int(e["samples"]))
        cursors.append(e.get("cursor"))
        weights.append(e.get("weight"))
        names.append(e.get("name", ""))
    plan = packed_epoch_plan(ordered, seq_len=int(manifest["seq_len"]), seed=int(manifest["seed"]),
                             epoch=int(manifest["epoch"]), weights=weights, names=names,
                             group_tokens=int(pk["group_tokens"]), pad_id=int(pk["pad_id"]),
                             cursors=None if all(c is None for c in cursors) else cursors, counts=counts)
    if plan.samples != int(manifest["samples"]):
        raise TokpackError("epoch manifest source samples do not add up", where="sources[].samples",
                           expected=manifest["samples"], found=plan.samples)
    return plan


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
        self.doc_starts = {s: documents_of(sources[s])[0] for s in used}

    def rows(self, table: np.ndarray, g0: int, g1: int, row_tokens: int, pad_id: int) -> np.ndarray:
        """Output rows [g0, g1) as an [n, row_tokens] token array."""
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
            start = self.doc_starts[s][t["doc"][sel].astype(np.int64)] + t["doc_offset"][sel].astype(np.int64)
            k = np.searchsorted(self.part_starts[s], start, side="right") - 1
            part[sel], local[sel] = self.first[s] + k, start - self.part_starts[s][k]
        dest = (t["g"].astype(np.int64) - g0) * row_tokens + t["row_offset"].astype(np.int64)
        # One slice copy per piece: pieces are documents, hundreds of tokens or more, and a loop
        # of memcpys measured 6x faster than gathering through per-token index arrays.
        flat, parts = out.reshape(-1), self.parts
        for d, p, s, n in zip(dest.tolist(), part.tolist(), local.tolist(), t["length"].tolist()):
            flat[d: d + n] = parts[p][s: s + n]
        return out


# -------------------------------------------------------------------- verification


def cut_problems(table: np.ndarray, lengths: dict[int, np.ndarray], row_tokens: int) -> list[str]:
    """The packing rules a row table must keep, each broken one named once: every piece of a
    document longer than a row but its tail is a full row at a multiple of row_tokens, and a
    document that fits a row is whole in one row."""
    problems = []
    if not len(table):
        return problems
    src, doc = table["source"].astype(np.int64), table["doc"].astype(np.int64)
    full = np.empty(len(table), np.int64)
    for s, ls in lengths.items():
        sel = src == s
        full[sel] = ls[doc[sel]]
    length, off = table["length"].astype(np.int64), table["doc_offset"].astype(np.int64)
    fits = full <= row_tokens
    if np.any(fits & ((length != full) | (off != 0))):
        problems.append("a document that fits a row is cut")
    long = ~fits
    tail = full - (full // row_tokens) * row_tokens
    is_tail = long & (off == full - tail) & (tail > 0)
    if np.any(long & ~is_tail & ((length != row_tokens) | (off % row_tokens != 0) | (table["row_offset"] != 0))):
        problems.append("a long document is cut other than into full rows and its tail")
    if np.any(is_tail & (length != tail)):
        problems.append("a long document's tail has the wrong length")
    return problems


def packed_replay(manifest: dict, sources: list[PackedSource], order: bool = True
                  ) -> tuple[str, list[int], str, list[str]]:
    """(sample multiset hash, each output shard's order hash (with `order`), row table checksum,
    packing rule problems) of a packed epoch, recomputed from its manifest's parameters and its
    sources alone. Rows are rebuilt in output order, so the order terms need no inverse."""
    plan = packed_plan_from_manifest(manifest, sources)
    per, listed = shard_count_checked(manifest, plan.samples) if order else (1, 0)
    by_fp = {s.fingerprint: s for s in sources}
    opened = [by_fp[sp.fingerprint] for sp in plan.sources]
    table = plan.table(opened)
    problems = cut_problems(table, {s: documents_of(opened[s])[1] for s, sp in enumerate(plan.sources) if sp.samples},
                            plan.row_tokens)
    pool = TokenPool(plan, opened)
    total, step = 0, 1 << 14
    shard_orders = np.zeros(listed, dtype=np.uint64)
    for g0 in range(0, plan.samples, step):
        g1 = min(plan.samples, g0 + step)
        hashes = row_hashes(pool.rows(table, g0, g1, plan.row_tokens, plan.pad_id))
        total += int(hashes.sum(dtype=np.uint64))
        if order:  # uint64 sums wrap: mod 2^64
            g = np.arange(g0, g1, dtype=np.int64)
            np.add.at(shard_orders, g // per, order_hash_terms(g, hashes))
    return hash_hex64(total), shard_orders.tolist(), table_hash(table), problems


def replay_hashes_any(manifest: dict, sources: list[PackedSource], order: bool = True) -> tuple[str, list[int]]:
    """`validate --against`'s replay for an epoch of either shuffle algorithm: (multiset hash,
    per-shard order hashes), as `plan.replay_hashes`. A packed epoch's row table must also hash
    to the recorded `packing.table_xxh3_128` and keep the packing rules; either failure is one
    TokpackError."""
    if manifest.get("shuffle") != PACKED_ALGORITHM:
        return replay_hashes(manifest, sources, order)
    multiset, orders, table_sum, problems = packed_replay(manifest, sources, order)
    recorded = (manifest.get("packing") or {}).get("table_xxh3_128")
    if problems:
        raise TokpackError(problems[0], where="packing", expected="the best-fit packing rules",
                           found="; ".join(problems))
    if table_sum != recorded:
        raise TokpackError("epoch's row table is not the one its plan packs", where="packing.table_xxh3_128",
                           expected=f"{table_sum} (replayed from the sources)", found=recorded)
    return multiset, orders


def packing_settings(packing: str, sources: list[PackedSource], pad_id: int | None = None,
                     group_tokens: int | None = None) -> dict | None:
    """What a run records (and a rerun must repeat) of its packing; None for concat."""
    if packing == "concat":
        return None
    if packing not in PACKINGS:
        raise TokpackError("unknown packing", where="--packing", expected=" or ".join(PACKINGS), found=packing)
    return {"method": packing, "group_tokens": int(group_tokens or DEFAULT_GROUP_TOKENS),
            "pad_id": sources[0].eos_id if pad_id is None else int(pad_id)}


def write_table(path, table: np.ndarray) -> str:
    """The row table, materialised for the engine (atomically); returns its checksum."""
    from formats.io import write_bytes_atomic

    write_bytes_atomic(path, np.ascontiguousarray(table).tobytes(), fsync=False)
    return table_hash(table)


def read_table(path, expected: str) -> np.ndarray:
    """The row table `write_table` wrote, checked against its checksum."""
    table = np.fromfile(path, dtype=PIECE)
    if table_hash(table) != expected:
        raise TokpackError("packing table in the work folder is damaged", file=path, where="xxh3_128",
                           expected=expected, found=table_hash(table), hint="rerun the same command")
    return table
