"""The datatrove steps that write a best-fit epoch (tokpack.shuffle.packed) from the row table
tokpack.shuffle.packed.build_table wrote in the epoch's work folder. In memory: one task reads every
used source once (verifying each shard's xxh3_128 against its manifest), then, reading the
table one output shard at a time, assembles each shard's rows from the documents, padding each row's tail
with the pad id, and writes them in output order through EpochJob.write_shard, with the
shard's `.pad` sidecar. One read, one write, as the window shuffle's InMemoryStep.

Memory: the used sources' tokens, one output shard's part of the row table (read from the
table build_table wrote in the work folder) and the chunks of rows in flight. shuffle/run.py
runs an epoch here only when that fits `--memory`; otherwise out of core: PackedScatterStep
then PackedOrderStep, the window shuffle's two passes and bucket layout (tokpack.shuffle.steps.Layout)
over document pieces, each scatter task reading only its source shards' files of the table.
"""

from __future__ import annotations

import os
from io import BufferedReader
from pathlib import Path

import numpy as np
import xxhash

from tokpack.formats.io.gate import map_file, open_read, read_array

from .packed.passes import DOC, document_count, kept_pass_bytes
from .packed.table import PIECE_STATE_BYTES, RECORD, TABLE_PIECE_BYTES, PackedTable, build_table, row_padding
from .packed.replay import TokenPool
from .packed.packed_plan import epoch_pieces
from .epoch_job import RING, EpochJob, Step
from .steps import OrderStep, ScatterStep, bucket_damaged

GATHER_TOKENS = 1 << 20  # tokens of rows assembled per call


def prepare_table(job: EpochJob, memory: int) -> dict:
    """The epoch's row table, materialised in its work folder (`packing/`) by build_table
    within `memory`: its folder, xxh3_128 and padding tokens, for the steps and the manifest."""
    path = Path(job.work_dir) / "packing"
    # the kept passes (packed.iter_pass) count against the budget while the table is built (which drops them)
    built = build_table(job.plan, job.open_sources(), path, max(1, memory - kept_pass_bytes()), progress=job.bar)
    return {
        "table": str(path),
        "table_xxh3_128": built.table_xxh3_128,
        "padding": built.padding,
        "figures": built.figures,
    }


def packed_memory(job, sources) -> int:
    """Bytes the in-memory best-fit path holds for the epoch `job`: the used sources' tokens,
    one shard's pieces of the row table, and the chunks in flight."""
    plan = job.plan
    used = [s for s, sp in enumerate(plan.sources) if sp.samples]
    tokens = sum(sources[s].tokens for s in used)
    docs = sum(int(sources[s].manifest.get("documents", 0)) for s in used)
    itemsize = job.token_dtype.itemsize
    per_row = 2 + plan.row_tokens * docs // max(1, tokens)  # pieces a row, about
    chunk = RING * GATHER_TOKENS * itemsize  # in flight: RING chunks
    return tokens * itemsize + min(job.shard_samples, plan.samples) * (per_row * PIECE_STATE_BYTES + 12) + chunk


# Pieces (documents or fragments) best_fit_decreasing and its group work place a second, on one
# core: 500,000-600,000 measured on 20-token documents (BENCHMARKS.md, "Best-fit packing: out of
# core"), 1.6M on web-like lengths since the pieces longer than half a row skip the loop
# (BENCHMARKS.md, "Best-fit packing: an upsampled epoch"): plan takes a rate between.
PACK_PIECES_PER_S = 8e5
# Pieces of the epoch's table a second, built (build_table) and copied into rows (TokenPool.rows):
# per piece work in the interpreter that a window epoch does not have (BENCHMARKS.md, "Best-fit
# packing: an upsampled epoch").
TABLE_PIECES_PER_S = 5e5
PASS_PIECE_BYTES = 56  # a kept pass, per piece: seven int64 columns (tokpack.shuffle.packed.iter_pass)


def table_estimate(job, sources) -> dict:
    """What building the epoch's row table (tokpack.shuffle.packed.build_table) costs, from the sources'
    document and token counts (their manifests, else their index sizes), without packing:
    `pieces` in the table (each row holds its tokens' documents and at most one more piece,
    the fragment or tail cut at a row's end); `table_bytes` its peak in the work folder (the
    build's buckets of rows and by-shard files, then the table, its starts and the by-shard
    files, plus the bucket files of the largest pass's documents); `packed_pieces` the pieces
    packed: once each pass the epoch touches when the passes fit a quarter of the plan's budget
    (the plan packs a pass to count its rows and keeps it for the table: tokpack.shuffle.packed.
    iter_pass; a source drawn several times is such), else twice; the `pack_seconds` that takes,
    with the table's build and the rows' assembly (per piece of the table)."""
    plan, pieces, packed, taken, largest = job.plan, 0, 0, 0, 0
    for s, sp in enumerate(plan.sources):
        if not sp.samples:
            continue
        src = sources[s]
        docs = int(src.manifest.get("documents") or document_count(src))
        per_token = docs / max(1, src.tokens)
        in_rows = int(sp.samples * (plan.row_tokens * per_token + 1))
        pieces += in_rows
        # the passes' own counts when the plan packed them here (it has, to count their rows)
        packed_s, taken_s = epoch_pieces(plan, s) or (sp.passes * (docs + src.tokens // plan.row_tokens), in_rows)
        kept = packed_s * PASS_PIECE_BYTES <= plan.memory // 4
        packed += (1 if kept else 2) * packed_s
        taken += taken_s
        largest = max(largest, docs)
    return {
        "pieces": pieces,
        "table_bytes": pieces * TABLE_PIECE_BYTES + largest * DOC.itemsize,
        "packed_pieces": packed,
        "pack_seconds": round(packed / PACK_PIECES_PER_S + taken / TABLE_PIECES_PER_S, 3),
    }


def packed_scratch_bytes(job, sources, out_of_core: bool) -> int:
    """Peak scratch of a best-fit epoch: its row table, and out of core also the bucket files
    (every output token and a RECORD per piece)."""
    est = table_estimate(job, sources)
    buckets = job.plan.samples * job.row_bytes + est["pieces"] * RECORD.itemsize if out_of_core else 0
    return est["table_bytes"] + buckets


class PackedInMemoryStep(Step):
    """One task: the row table, the sources read once, then every shard in output order."""

    name = "shuffle best-fit in memory"

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        job, plan = self.job, self.job.plan
        todo = [i for i in range(rank, job.n_shards, world_size) if job.shard_done(i) is None]
        if not todo:
            return
        sources = job.open_sources()
        built = PackedTable.open(self.prepared["table"], self.prepared["table_xxh3_128"])

        def check(src, k, tokens):
            job.check_source_shard(src, k, xxhash.xxh3_128_hexdigest(tokens))

        pool = TokenPool(plan, sources, check)
        rows = max(1, GATHER_TOKENS // plan.row_tokens)

        def shard(i):  # its rows, assembled from its pieces a chunk at a time, and their padding
            g0, g1 = job.shard_range(i)
            table, starts = built.rows(g0, g1)
            at = range(g0, g1, rows)
            chunks = (pool.rows(table, a, min(g1, a + rows), plan.row_tokens, plan.pad_id, starts) for a in at)
            return (c.reshape(-1).view(job.row_void) for c in chunks), row_padding(table, g1 - g0, plan.row_tokens, g0)

        job.write_shards(todo, shard)


# ---------------------------------------------------------------------- out of core

# A scatter record (the tokens are in the rows file, in record order): tokpack.shuffle.packed's RECORD.


class PackedScatterStep(ScatterStep):
    """Task t reads its source shards in order (each verified, once, by one task) and appends each
    piece they hold to the files of its output bucket: bBBBBBBB.rows (the tokens) and .pos (RECORD)."""

    name = "shuffle best-fit scatter"

    def fill(self, t: int, sources, files) -> None:
        job, plan, lay = self.job, self.job.plan, self.layout
        built = PackedTable.open(self.prepared["table"], self.prepared["table_xxh3_128"])
        scatter_bar = self.scatter_bar(sources)
        # Pieces read per chunk: their records, sort arrays and tokens fit half the task's budget
        # (the shard being read is mapped beside them).
        chunk = max(1, self.budget // 2 // (PIECE_STATE_BYTES + plan.row_tokens * job.token_dtype.itemsize))
        for s, k in [(s, k) for s, k0, k1 in lay.task_shards[t] for k in range(k0, k1)]:
            src = sources[s]
            n = int(src.shards[k]["tokens"])
            data = map_file(src.path / src.shards[k]["path"], 0, n * src.dtype.itemsize).view(src.dtype)
            job.check_source_shard(src, k, xxhash.xxh3_128_hexdigest(data))
            for pieces in built.shard_pieces(s, k, chunk):
                bucket = np.searchsorted(lay.bucket_starts, pieces["g"].astype(np.int64), side="right") - 1
                sel = np.lexsort((pieces["row_offset"], pieces["g"], bucket))
                cuts = np.flatnonzero(np.diff(bucket[sel])) + 1
                for run in np.split(sel, cuts):
                    rec = pieces[run][list(RECORD.names)].astype(RECORD)
                    tokens = np.concatenate(
                        [data[a : a + m] for a, m in zip(pieces["local"][run].tolist(), rec["length"].tolist())]
                    )
                    files.append(int(bucket[run[0]]), len(run), tokens, rec)
            scatter_bar.update(n * src.dtype.itemsize)
            del data


def holds_pieces_of(layout, i: int) -> bool:
    """Whether the bucket files still hold every piece of output shard i that the scatter tasks
    recorded (the order pass deletes them once the shard is written): as Layout.holds_rows_of,
    by the pieces' records, since a bucket's token files hold no padding."""
    buckets = layout.buckets_of(i)
    for t in range(layout.tasks):
        for b, n in zip(buckets, layout.recorded(t, buckets)[:, 0].tolist()):
            pos = layout.bucket_file(t, b, "pos")
            if (os.path.getsize(pos) if pos.exists() else 0) != n * RECORD.itemsize:
                return False
    return True


class PackedOrderStep(OrderStep):
    """Task i writes output shard i: each of its buckets' pieces is read back and placed in its row."""

    name = "shuffle best-fit order"

    def write(self, i: int, buckets: range) -> None:
        job = self.job
        g0, g1 = job.shard_range(i)
        # Filled while write_shard consumes the buckets, and read by it only after the last.
        pad = np.full(g1 - g0, job.plan.row_tokens, dtype=np.int64)
        with job.chunk_ring(self.budget) as (ring, _):
            job.write_shard(
                i, self.chunks(buckets, ring, lambda b, records: self._piece_rows(b, records, pad, g0)), pad=pad
            )

    def _piece_rows(self, b: int, records: list, pad: np.ndarray, g0: int):
        """Bucket b's rows (read_bucket's), as np.void rows; `pad` gets their padding."""
        plan = self.job.plan
        wants = [r[1:] for r in records]
        rows = read_bucket(
            self.layout, b, wants, plan.row_tokens, plan.pad_id, self.job.token_dtype, self._check_file, pad, g0
        )
        rows = rows.reshape(-1).view(self.job.row_void)

        def take(a: int, c: int, out: np.ndarray) -> np.ndarray:
            out[: c - a] = rows[a:c]
            return out[: c - a]

        return take


def read_bucket(
    lay,
    b: int,
    wants: list,
    row_tokens: int,
    pad_id: int,
    dtype: np.dtype,
    check_file,
    pad: np.ndarray | None = None,
    g0: int = 0,
) -> np.ndarray:
    """Bucket b's rows (row_tokens a row, pad_id where no piece lands), placed from the pieces
    every task appended to its files (the tokens in `.rows`, a RECORD each in `.pos`), each file
    checked against the xxh3_64 its task recorded (`wants[t]`: rows file's, pos file's; `check_file(t, path,
    want, found)` raises on a mismatch); `pad[g - g0]`, if given, goes down by each piece's length.
    PackedOrderStep reads its buckets with it, and shuffle --to-nodes (tokpack.packer.exchange) a
    node's out-of-core buckets."""
    start, n = int(lay.bucket_starts[b]), int(lay.bucket_starts[b + 1] - lay.bucket_starts[b])
    rows = np.full((n, row_tokens), pad_id, dtype=dtype)
    flat = rows.reshape(-1)
    for t in range(lay.tasks):
        f = lay.bucket_file(t, b, "rows")
        if not f.exists():
            continue
        want = wants[t]
        raw = read_array(f.with_suffix(".pos"), np.uint8, folder=lay.dir)
        check_file(t, f.with_suffix(".pos"), want[1], xxhash.xxh3_64_intdigest(raw))
        rec = np.frombuffer(raw, dtype=RECORD)
        local = rec["g"].astype(np.int64) - start
        if len(local) and (local.min() < 0 or local.max() >= n):
            raise bucket_damaged("scatter file holds a piece of another bucket", f, b)
        dest = local * row_tokens + rec["row_offset"].astype(np.int64)
        length = rec["length"].astype(np.int64)
        whole = (length == row_tokens) & (rec["row_offset"] == 0)
        ends = np.cumsum(length)
        # The tokens are read a chunk of whole pieces at a time (not the file at once: the
        # bucket's rows take the budget already), hashed as they are read.
        h, i = xxhash.xxh3_64(), 0
        with BufferedReader(open_read(f, folder=lay.dir)) as fh:
            while i < len(rec):
                first = int(ends[i - 1]) if i else 0
                j = max(i + 1, int(np.searchsorted(ends, first + GATHER_TOKENS, side="right")))
                need = (int(ends[j - 1]) - first) * dtype.itemsize
                data = fh.read(need)
                h.update(data)
                if len(data) != need:  # cut short: its checksum below says so
                    break
                tokens = np.frombuffer(data, dtype=dtype)
                if whole[i:j].all():  # whole rows (a window epoch's, out of core on a node): placed at once
                    rows[local[i:j]] = tokens.reshape(j - i, row_tokens)
                else:
                    for d, a, m in zip(
                        dest[i:j].tolist(), (ends[i:j] - length[i:j] - first).tolist(), length[i:j].tolist()
                    ):
                        flat[d : d + m] = tokens[a : a + m]
                i = j
            h.update(fh.read())
        check_file(t, f, want[0], h.intdigest())
        if pad is not None:
            np.subtract.at(pad, local + start - g0, length)
    return rows
