"""A node's rows out of core (`shuffle --to-nodes` when its stores do not fit --memory): bucket
files in DEST's scratch, laid out as the scatter/order engine's Layout (one scatter task: this
process) and written and read back as the best-fit scatter and order passes do (RECORD,
read_bucket), each bucket a contiguous range of the node's store rows (NodeEpoch.store_rows)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import xxhash

from tokpack.formats.errors import TokpackError
from tokpack.formats.io.gate import open_append
from tokpack.formats.io.writes import write_bytes_atomic
from tokpack.packer.node_epoch import NodeEpoch, memory_plan
from tokpack.packer.pieces import gather
from tokpack.shuffle.packed.table import RECORD
from tokpack.shuffle.packed_step import read_bucket  # the order pass's reader, for windows and pieces alike
from tokpack.shuffle.steps import Layout


def bucket_layout(ne: NodeEpoch, memory: int, work: Path) -> Layout | None:
    """The out-of-core Layout in `work` (DEST's scratch) of a node whose stores do not fit
    --memory, else None (in memory)."""
    bucket_rows = memory_plan(ne, memory)[1]
    return None if bucket_rows is None else _layout(ne, bucket_rows, work)


def _layout(ne: NodeEpoch, bucket_rows: int, work: Path) -> Layout:
    """The out-of-core stores as the scatter/order engine's Layout (one scatter task: this
    process): buckets of at most `bucket_rows` store rows, each a contiguous range of the
    slice's positions or of one owned shard's rows (shard_buckets: each owned shard's first
    bucket), so each is read back, whole, in the order its writer takes it."""
    starts, firsts = [], []

    def cut(a: int, n: int) -> None:
        nb = -(-n // bucket_rows)
        starts.extend(a + (j * n) // nb for j in range(nb))

    cut(0, len(ne.positions))
    for i in ne.owned:
        firsts.append(len(starts))
        g0, g1 = ne.job.shard_range(i)
        cut(len(ne.positions) + int(ne.owned_base[i]), g1 - g0)
    firsts.append(len(starts))
    starts.append(ne.store_rows)
    return Layout(1, np.array(starts, dtype=np.int64), np.array(firsts, dtype=np.int64), 0, str(work / "ooc-node"), [])


class Buckets:
    """The node's two stores out of core: each received piece appended to its bucket's files
    (Layout.bucket_file of task 0: the tokens in `.rows`, a RECORD in `.pos`, their store row in
    the record's g), as the best-fit scatter pass writes them, with each file's xxh3_64 in the
    task's records; read back a bucket at a time by the best-fit order pass's read_bucket
    (checked against those records) and removed once read."""

    def __init__(self, ne: NodeEpoch, layout: Layout, pad_id: int):
        self.lay, self.row_tokens, self.pad_id, self.dtype = layout, ne.plan.row_tokens, pad_id, ne.job.token_dtype
        self.counts = np.zeros(len(layout.bucket_starts) - 1, np.int64)
        self.hashes: dict[int, list] = {}
        shutil.rmtree(layout.dir, ignore_errors=True)  # a killed run's: the epoch is redone whole
        layout.task_dir(0).mkdir(parents=True)

    def put(self, pad, at, pieces, tokens, starts) -> None:
        lengths = pieces["length"].astype(np.int64)
        np.subtract.at(pad, at, lengths)
        bucket = np.searchsorted(self.lay.bucket_starts, at, side="right") - 1
        order = np.argsort(bucket, kind="stable")
        cuts = np.flatnonzero(np.diff(bucket[order])) + 1
        for x, y in zip([0, *cuts.tolist()], [*cuts.tolist(), len(order)]):
            sel = order[x:y]
            b = int(bucket[sel[0]])
            rec = np.empty(len(sel), RECORD)
            rec["g"], rec["row_offset"], rec["length"] = at[sel], pieces["row_offset"][sel], lengths[sel]
            payloads = (gather(tokens, starts[sel], lengths[sel], self.row_tokens), rec)
            self.lay.bucket_file(0, b, "rows").parent.mkdir(exist_ok=True)
            for ext, payload, h in zip(
                ("rows", "pos"), payloads, self.hashes.setdefault(b, [xxhash.xxh3_64(), xxhash.xxh3_64()])
            ):
                raw = memoryview(payload).cast("B")
                with open_append(self.lay.bucket_file(0, b, ext), folder=self.lay.dir) as f:
                    f.write(raw)
                h.update(raw)
            self.counts[b] += len(sel)

    def finish(self) -> None:
        records = np.zeros((len(self.counts), 3), dtype="<u8")
        for b, (hr, hp) in self.hashes.items():
            records[b] = self.counts[b], hr.intdigest(), hp.intdigest()
        write_bytes_atomic(self.lay.task_records(0), records.tobytes())

    def rows(self, lo: int, hi: int):
        """(first store row, rows) of each bucket in [lo, hi) (bucket boundaries), in order."""
        starts = self.lay.bucket_starts
        b = int(np.searchsorted(starts, lo))
        if lo < hi and (b >= len(starts) - 1 or int(starts[b]) != lo):
            raise TokpackError(
                "internal error: a node's rows were asked across its buckets",
                where=f"row {lo}",
                hint="report this with the command line",
            )
        while b < len(starts) - 1 and int(starts[b]) < hi:
            want = self.lay.recorded(0, range(b, b + 1))[0, 1:]
            yield (
                int(starts[b]),
                read_bucket(self.lay, b, [want], self.row_tokens, self.pad_id, self.dtype, self._check),
            )
            for ext in ("rows", "pos"):
                self.lay.bucket_file(0, b, ext).unlink(missing_ok=True)
            b += 1

    def _check(self, t: int, path, want, found: int) -> None:
        if found != int(want):
            raise TokpackError(
                "a bucket file in this node's scratch does not match the checksum written with it",
                file=path,
                where="xxh3_64",
                expected=f"{int(want):016x}",
                found=f"{found:016x}",
                hint="check this node's local disk, then rerun the same command (the epoch is written again)",
            )
