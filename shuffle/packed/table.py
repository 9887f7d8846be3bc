"""Best-fit's row table (tokpack.shuffle.packed): per output row the pieces of documents it
holds, built on disk in the epoch's work folder within a budget (build_table) and read back by
ranges of rows or by source shard (PackedTable); its checksum is the epoch's `table_xxh3_128`.
Also the figures the summaries show of the rows (RowFigures) and the packing rules a table keeps.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from tokpack.formats.constants import PAD_DTYPE
from tokpack.formats.errors import TokpackError
from tokpack.formats.io.gate import open_new, read_array, read_record, regular_size
from tokpack.formats.io import progress_log
from tokpack.formats.io.writes import write_bytes_atomic
from tokpack.formats.shards import PackedSource, row_segments

from .packed_plan import PackedPlan, chain_pieces
from .passes import MIN_CHUNK, Buckets, release_passes, scratch


# The row table: one record per piece (a document, or a fragment of one, inside one row), in
# output order: by output row g, then offset in the row. Its bytes are what `table_xxh3_128` hashes.
PIECE = np.dtype(
    [("g", "<u8"), ("row_offset", "<u4"), ("source", "<u4"), ("doc", "<u8"), ("doc_offset", "<u8"), ("length", "<u4")]
)

# A piece where its tokens go: output row, offset in the row, length. The scatter pass's bucket
# records (`.pos`, tokpack.shuffle.packed_step), and the head of a piece read from a source shard's file.
RECORD = np.dtype([("g", "<u8"), ("row_offset", "<u4"), ("length", "<u4")])


# -------------------------------------------------------------------- the row table on disk

# What the build writes in its folder (OUT/.tokpack-work/epoch-.../packing/, shuffle/run.py):
TABLE_FILE = "table"  # the row table: PIECE records in output order; its xxh3_128 is table_xxh3_128
STARTS_FILE = "starts"  # per piece of the table, its first token in its source's stream (<u8)
INDEX_FILE = "index"  # per bucket of rows: first piece, xxh3_64 of its table part and of its starts part
BUILT_FILE = "built.json"  # written last: the checksum, padding, bucket rows, and the by-shard files' xxh3_64
# A piece as a scatter task reads it from its source shard's file (source-SSSS-KKKKKK): output
# row, offset in the row, length, first token in the shard.
SHARD_PIECE = np.dtype(RECORD.descr + [("local", "<u8")])
_BUILD = np.dtype(PIECE.descr + [("start", "<u8")])  # a piece while the table is built
PIECE_STATE_BYTES = 4 * _BUILD.itemsize  # a buffered piece and the arrays that sort it
TABLE_PIECE_BYTES = _BUILD.itemsize + SHARD_PIECE.itemsize  # on disk a piece, at the build's peak and after it


def row_padding(table: np.ndarray, samples: int, row_tokens: int, g0: int = 0) -> np.ndarray:
    """Padding tokens at the end of each output row g0.. g0 + samples - 1 (uint32), from the
    pieces of those rows."""
    used = np.bincount(table["g"].astype(np.int64) - g0, weights=table["length"].astype(np.float64), minlength=samples)
    return (row_tokens - used.astype(np.int64)).astype(PAD_DTYPE)


@dataclass
class RowFigures:
    """What the summaries show of a best-fit epoch's rows (shuffle's summary and manifest,
    `inspect`, `plan`), counted over the pieces chain_pieces yields: one call per group of
    one pass (or batch of whole passes), which holds every piece of its rows and of its
    documents, so each count is exact without holding the table."""

    row_tokens: int
    padding_tokens: int = 0
    documents_cut: int = 0  # documents longer than a row, cut into pieces, that the epoch holds a piece of
    max_documents_per_row: int = 0  # the most segments of one row (its pieces, its padding one more),
    # counted as the loader counts them (formats/shards.py row_segments: a segment starting at the
    # row's last token, a label only, is not one): the smallest max_documents that reads the epoch

    def add(
        self,
        q: np.ndarray,
        offset: np.ndarray,
        doc: np.ndarray,
        length: np.ndarray,
        full: np.ndarray,
        passes: np.ndarray,
    ) -> None:
        """Pieces holding every piece of their rows and documents (a group, or a batch of
        passes): output position, offset in its row, document, length, the document's length,
        and the pass of each, for a document cut counts once a pass."""
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
        cut = length < full
        d, p = doc[cut].astype(np.int64), passes[cut]
        at = np.lexsort((d, p))
        d, p = d[at], p[at]
        self.documents_cut += int(np.count_nonzero((d[1:] != d[:-1]) | (p[1:] != p[:-1]))) + (len(d) > 0)

    def fields(self) -> dict:
        """The epoch manifest's `packing` fields of these figures (padding_tokens is recorded apart)."""
        return {"documents_cut": self.documents_cut, "max_documents_per_row": self.max_documents_per_row}


def row_figures(plan, sources: list[PackedSource], memory: int) -> RowFigures:
    """The epoch's RowFigures without building its table (`plan shuffle`): its passes packed
    once more, group by group, within `memory`."""
    figures = RowFigures(plan.row_tokens)
    with scratch() as d:
        for s, sp in enumerate(plan.sources):
            if sp.samples:
                for q, ro, doc, _, ln, _, full, p in chain_pieces(plan, s, sources[s], memory, d):
                    figures.add(q, ro, doc, ln, full, p)
    return figures


DAMAGED = "packing table in the work folder is damaged"


def table_damaged(message: str, file, **fields) -> TokpackError:
    """A row table in the work folder that is not what build_table wrote: built again by a rerun."""
    return TokpackError(message, file=file, hint="rerun the same command", **fields)


@dataclass(frozen=True)
class PackedTable:
    """A row table build_table wrote: read by ranges of output rows, or by source shard."""

    folder: Path
    table_xxh3_128: str
    padding: int
    bucket_rows: int
    problems: tuple[str, ...]
    shard_files: dict  # "S-K" -> xxh3_64 of source shard (S, K)'s pieces file
    figures: dict = field(default_factory=dict)  # RowFigures.fields() of the table's rows

    @classmethod
    def open(cls, folder, expected: str | None = None) -> "PackedTable":
        folder = Path(folder)
        built = read_record(folder / BUILT_FILE, folder=folder)
        if built is None:
            raise table_damaged("packing table in the work folder is missing or damaged", folder / BUILT_FILE)
        if expected is not None and built["table_xxh3_128"] != expected:
            raise table_damaged(
                "packing table in the work folder is not this epoch's",
                folder / BUILT_FILE,
                where="table_xxh3_128",
                expected=expected,
                found=built["table_xxh3_128"],
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
            raise table_damaged("packing table index is cut short", self.folder / INDEX_FILE)
        index = index.reshape(-1, 3)
        a, n = int(index[0, 0]), int(index[-1, 0] - index[0, 0])
        table = read_array(self.folder / TABLE_FILE, PIECE, n, PIECE.itemsize * a, folder=self.folder)
        starts = read_array(self.folder / STARTS_FILE, "<u8", n, 8 * a, folder=self.folder)
        for k in range(b1 - b0):
            x, y = int(index[k, 0]) - a, int(index[k + 1, 0]) - a
            for name, part, want in ((TABLE_FILE, table[x:y], index[k, 1]), (STARTS_FILE, starts[x:y], index[k, 2])):
                if len(table) != n or len(starts) != n or xxhash.xxh3_64_intdigest(part.tobytes()) != int(want):
                    where, expected = f"rows {(b0 + k) * self.bucket_rows}..", f"xxh3_64 {int(want):016x}"
                    raise table_damaged(DAMAGED, self.folder / name, where=where, expected=expected)
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
            raise table_damaged(
                DAMAGED, f, where="xxh3_64", expected=f"{int(want):016x}", found=f"{h.intdigest():016x}"
            )


def shard_places(sources: list[PackedSource], first_shard, source: np.ndarray, start: np.ndarray):
    """(shard, numbered through the sources from each one's `first_shard[s]`, and first token in
    it) of pieces of sources `source` starting at stream tokens `start`: no piece spans two
    shards (no document does)."""
    shard, local = np.empty(len(start), np.int64), np.empty(len(start), np.int64)
    for s in np.unique(source).tolist():
        sel = source == s
        k = np.searchsorted(sources[s].shard_starts, start[sel], side="right") - 1
        shard[sel], local[sel] = first_shard[s] + k, start[sel] - sources[s].shard_starts[k]
    return shard, local


def build_table(plan: PackedPlan, sources: list[PackedSource], folder, memory: int, progress=None) -> PackedTable:
    """Writes the epoch's row table into `folder`, bounded by `memory` (plus a group): each
    source's passes are packed group by group (chain_pieces) and each piece, given its output
    row g = sigma_e(q), is appended to the scratch file of its bucket of output rows and to
    the file of the source shard that holds it; then each bucket, in output order, is sorted by
    (g, row_offset) and appended to the table, whose xxh3_128 is computed as it is written.
    Atomic: written under a temporary name, renamed whole; BUILT_FILE last. `progress(total, desc)`:
    a bar of each of the two phases (tokpack.formats.io.progress's), else none."""
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
    rows_files, shard_files = Buckets(tmp / "rows", "rows"), Buckets(tmp / "shards", "s", hashed=True)
    first_shard = np.cumsum([0] + [len(src.shards) for src in sources])
    buffered, held, problems = [], 0, set()
    figures = RowFigures(plan.row_tokens)

    def flush():
        rec = np.concatenate(buffered)
        buffered.clear()
        rows_files.append(rec["g"].astype(np.int64) // bucket_rows, rec)
        key, local = shard_places(sources, first_shard, rec["source"].astype(np.int64), rec["start"].astype(np.int64))
        out = np.empty(len(rec), SHARD_PIECE)
        out["g"], out["row_offset"], out["length"], out["local"] = rec["g"], rec["row_offset"], rec["length"], local
        shard_files.append(key, out)

    progress = progress or functools.partial(progress_log.progress, enabled=False)  # no bar
    row_bytes = plan.row_tokens * sources[used[0]].dtype.itemsize if used else 0
    # the epoch's token bytes, less its padding: the bar ends short of its total by the padding
    packing_bar = progress(plan.samples * row_bytes, f"epoch {plan.epoch}: pack rows")
    with scratch(tmp) as perm_scratch, packing_bar:
        for s in used:
            for q, ro, doc, do, ln, start, full, p in chain_pieces(plan, s, sources[s], memory, perm_scratch):
                packing_bar.update(int(ln.astype(np.int64).sum()) * sources[s].dtype.itemsize)
                problems.update(_cut_problems(ln, do, ro, full, plan.row_tokens))
                figures.add(q, ro, doc, ln, full, p)
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
    with (
        open_new(tmp / TABLE_FILE) as tf,
        open_new(tmp / STARTS_FILE) as sf,
        progress(nb, f"epoch {plan.epoch}: sort the row table", "bucket") as sort_bar,
    ):
        for b in range(nb):
            sort_bar.update(1)
            rec = rows_files.read(b, _BUILD)
            rec = rec[np.lexsort((rec["row_offset"], rec["g"]))]
            raw, starts = rec[list(PIECE.names)].astype(PIECE).tobytes(), rec["start"].astype("<u8").tobytes()
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
    for b, hs in shard_files.hashes.items():
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


def whole_table(plan: PackedPlan, sources: list[PackedSource]) -> np.ndarray:
    """The row table (PIECE records in output order), read whole: O(pieces) memory, for
    tests and small tools."""
    with table_rows(plan, sources) as built:
        return read_array(built.folder / TABLE_FILE, PIECE, folder=built.folder)


@contextlib.contextmanager
def table_rows(plan: PackedPlan, sources: list[PackedSource]):
    """The row table, built by build_table within the plan's memory in a temporary folder
    (removed after use) and read back by ranges of rows (PackedTable.rows, a bucket of rows
    at a time)."""
    with scratch() as d:
        yield build_table(plan, sources, Path(d) / "packing", plan.memory)
