"""A node's rows out of core (`shuffle --to-nodes` when its stores do not fit --memory): bucket
files in DEST's scratch, laid out as the scatter/order engine's Layout (one scatter task: this
process) and written and read back as the best-fit scatter and order passes do (RECORD,
read_bucket), each bucket a contiguous range of the process's slice rows (NodeEpoch.store_rows).
Each bucket's bytes are written once (the rounds) and read once (`Buckets.rows`, on a thread a
bucket ahead of its writer: node_epoch.memory_plan counts both buckets)."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import numpy as np
import xxhash

from tokpack.formats.errors import TokpackError
from tokpack.formats.io.gate import open_append
from tokpack.formats.io.memory import Buffer
from tokpack.formats.io.writes import write_bytes_atomic
from tokpack.packer.node_epoch import NodeEpoch
from tokpack.packer.phases import active, timed
from tokpack.packer.pieces import gather
from tokpack.shuffle.packed.table import RECORD
from tokpack.shuffle.packed_step import read_bucket  # the order pass's reader, for windows and pieces alike
from tokpack.shuffle.steps import Layout


def bucket_layout(ne: NodeEpoch, bucket_rows: int | None, work: Path) -> Layout | None:
    """The out-of-core Layout in `work` (DEST's scratch) of a process whose store does not fit
    --memory (memory_plan's `bucket_rows`), else None (in memory): the scatter/order engine's
    (one scatter task: this process), buckets of at most bucket_rows rows, each a contiguous
    range of its positions, read back, whole, in order (its one "shard": shard_buckets [0, buckets))."""
    if bucket_rows is None:
        return None
    n = len(ne.positions)
    nb = -(-n // bucket_rows)
    starts = [(j * n) // nb for j in range(nb)]
    firsts = [0, len(starts)]
    starts.append(ne.store_rows)
    return Layout(1, np.array(starts, dtype=np.int64), np.array(firsts, dtype=np.int64), 0, str(work / "ooc-node"), [])


class Buckets:
    """The process's store out of core: each received piece appended to its bucket's files
    (Layout.bucket_file of task 0: the tokens in `.rows`, a RECORD in `.pos`, their store row in
    the record's g), as the best-fit scatter pass writes them, with each file's xxh3_64 in the
    task's records; read back a bucket at a time by the best-fit order pass's read_bucket
    (checked against those records) and removed once read."""

    def __init__(self, ne: NodeEpoch, layout: Layout, pad_id: int):
        self.lay, self.row_tokens, self.pad_id, self.dtype = layout, ne.plan.row_tokens, pad_id, ne.job.token_dtype
        self.counts = np.zeros(len(layout.bucket_starts) - 1, np.int64)
        self.hashes: dict[int, list] = {}
        self.ahead: BucketRead | None = None  # the next bucket, read back while the caller has this one
        # a bucket's pieces of a round, gathered before they are appended: the same pages every
        # time (fresh memory each time cost the kernel's zeroing of it, as much as the copy)
        self.gathered = Buffer(self.dtype, "bucket-put")
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
            out = self.gathered.ensure(int(lengths[sel].sum()))
            payloads = (gather(tokens, starts[sel], lengths[sel], self.row_tokens, out), rec)
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

    def close(self, failed: bool = False) -> None:
        """Nothing runs behind the rounds (a bucket's read back is rows' own: BucketRead)."""

    def rows(self, lo: int, hi: int):
        """(first store row, rows) of each bucket in [lo, hi) (bucket boundaries), in order. The
        caller takes the buckets in store row order, each once: while it writes one, the next
        is read back on a thread (BucketRead), across calls too, so the epoch takes the longer of
        the two, not their sum. Each step counts as `bucket_read`, however the caller's own phase
        is named."""
        return timed("bucket_read", self._rows(lo, hi), lambda item: item[1].nbytes)

    def _rows(self, lo: int, hi: int):
        starts = self.lay.bucket_starts
        b = int(np.searchsorted(starts, lo))
        if lo < hi and (b >= len(starts) - 1 or int(starts[b]) != lo):
            raise TokpackError(
                "internal error: a node's rows were asked across its buckets",
                where=f"row {lo}",
                hint="report this with the command line",
            )
        while b < len(starts) - 1 and int(starts[b]) < hi:
            rows = self._take(b)
            if b + 2 < len(starts):  # the next bucket read while the caller has this one
                self.ahead = BucketRead(self._read, b + 1)
            try:
                yield int(starts[b]), rows
            except BaseException:  # the caller failed: the read ahead ends by itself, its rows dropped
                self.ahead = None
                raise
            b += 1

    def _take(self, b: int) -> np.ndarray:
        """Bucket b's rows: the read ahead's (waited for; its failure raised here), or read now."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead.b == b:
            return ahead.result()
        if ahead is not None:  # another bucket's (not asked in order): its files are done with first
            ahead.thread.join()
        return self._read(b)

    def _read(self, b: int) -> np.ndarray:
        """Bucket b's rows from its files, checked against its records; its files removed."""
        want = self.lay.recorded(0, range(b, b + 1))[0, 1:]
        rows = read_bucket(self.lay, b, [want], self.row_tokens, self.pad_id, self.dtype, self._check)
        for ext in ("rows", "pos"):
            self.lay.bucket_file(0, b, ext).unlink(missing_ok=True)
        return rows

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


class BucketRead:
    """`read(b)` on a thread of its own (the read is I/O and its hash and placement release the
    GIL for most of it): its CPU to the epoch's bucket_read phase (tokpack.packer.phases; the
    main thread's wait for it counts there too); its rows, or its failure raised in the thread
    that asks for them (`result`): a bad bucket is the one line it always was, not a thread's
    traceback. The thread ends with the read, whether or not its rows are asked for."""

    def __init__(self, read, b: int):
        self.b, self.rows, self.error = b, None, None
        self.thread = threading.Thread(
            target=self._run, args=(read, active()), name=f"tokpack-bucket-read-{b}", daemon=True
        )
        self.thread.start()

    def _run(self, read, phases) -> None:
        try:
            self.rows = read(self.b)
        except BaseException as e:  # noqa: BLE001 - raised in the asking thread, by result()
            self.error = e
        finally:
            if phases is not None:
                phases.lap("bucket_read", 0)  # its bytes: counted as the caller takes them

    def result(self) -> np.ndarray:
        self.thread.join()
        rows, error, self.rows, self.error = self.rows, self.error, None, None
        if error is not None:
            raise error
        return rows
