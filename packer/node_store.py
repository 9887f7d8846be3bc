"""A process's store of one epoch of `shuffle --to-nodes` (NodeEpoch.store_rows): its part of the
node's slice, in position order (the rows of the epoch shards it owns are not here: their facts
come to it after the rounds, tokpack.packer.owned_facts). In memory (InMemory,
every row at once) or out of core (Buckets); both take a round's
pieces (`receive`: each at its store row and offset) and give their rows back in order
(`rows(lo, hi)`), with each row's unfilled count (its padding, once every piece is in); the
slice's rows go to its rank files (`write_slice_epoch`). In memory, a windows epoch's rank files
are open during the rounds (`open_slice_files`): each slice row is written to its place in its
rank's file as soon as it is complete, so the local disk works while the rounds go on, and
after them its tokens are only hashed and indexed in order (issue 41, item 3).

Out of core (when its store does not fit --memory) the rows are bucket files in DEST's
scratch, laid out as the scatter/order engine's Layout (one scatter task: this process) and
written and read back as the best-fit scatter and order passes do (RECORD, read_bucket), each
bucket a contiguous range of the process's slice rows. Each bucket's bytes are written once
(the rounds) and read once (`Buckets.rows`, on a thread a bucket ahead of its writer:
node_epoch.memory_plan counts both buckets)."""

from __future__ import annotations

import shutil
import threading
from contextlib import suppress
from dataclasses import replace
from pathlib import Path

import numpy as np

from tokpack.formats.errors import TokpackError
from tokpack.formats.io.memory import Buffer, anonymous
from tokpack.formats.io.reads import Worker
from tokpack.formats.io.writes import write_bytes_atomic
from tokpack.formats.outputs import EpochShardFormat, Output
from tokpack.packer.node_epoch import NodeEpoch
from tokpack.packer.phases import active, phase, timed
from tokpack.packer.pieces import gather, place
from tokpack.packer.rank_files import RankFiles
from tokpack.shuffle.packed.table import RECORD
from tokpack.shuffle.packed_step import read_bucket  # the order pass's reader, for windows and pieces alike
from tokpack.shuffle.steps import BucketFiles, Layout


# Whether an in-memory windows epoch writes its rank files during the rounds (open_slice_files):
# None: where the host has the cores for it (write_through_pays); True, False: always, never.
WRITE_THROUGH: bool | None = None
# Cores a process needs for the write-through to pay: its main thread, its read-ahead thread and
# its writing thread (the rows' pwrites into the page cache, 0.6-0.8 ns of CPU a byte; the
# kernel's writeback besides). Measured here (2 cores, 4 processes, ext4 on a VM disk; 256 MiB and
# 3 GiB of windows): with every core busy the epoch was slower (0.79 -> 0.91 s, 8.7 -> 13.4 s),
# the final fsync taking as long as the O_DIRECT write it replaces. Where the cores are free the
# disk works while the rounds go on: a later epoch's 458 GB slice at 48 nodes is 3.8 minutes of a
# 2 GB/s disk taken off the end (tokpack.packer.node_model).
CORES_A_PROCESS = 3
BEHIND = 2  # rounds whose completed rows wait for the writing thread (their indices only: no rows copied)


def write_through_pays(cores: int | None, on_host: int) -> bool:
    """Whether the rank files are written during the rounds on a host of `cores` cores running
    `on_host` of the job's processes (WRITE_THROUGH, when it is None)."""
    if WRITE_THROUGH is not None:
        return WRITE_THROUGH
    return bool(cores) and cores >= CORES_A_PROCESS * max(1, on_host)


def open_slice_files(
    output: Output, d: Path, ne: NodeEpoch, fmt: EpochShardFormat, layout: Layout | None, through: bool = True
) -> RankFiles | None:
    """This process's rank files of the epoch, open before its rounds, each token file at its
    final size, when the rounds can write them (`placed`): in memory, windows. None otherwise:
    a best-fit row's padding is in only when every piece is, and out of core the rows are in
    order only when the buckets are read back; those are written after the rounds."""
    if layout is not None or fmt.padded or not through:
        return None
    files = slice_files(output, d, ne, replace(fmt, placed=True))
    try:
        files.reserve(ne.plan.samples)
    except BaseException:
        files.abort()
        raise
    return files


def slice_files(output: Output, d: Path, ne: NodeEpoch, fmt: EpochShardFormat) -> RankFiles:
    """This process's rank files of node n's epoch (all of them when the node is one process; a
    node of several processes has its leader ready `d` first: rank_files.ready_epoch_dir)."""
    mine = None if ne.procs == 1 else ne.mine
    return RankFiles(output, d, ne.rows, ne.first, ne.ranks, ne.plan.epoch, fmt, mine)


class InMemory:
    """The process's store in memory (store_rows numbering). Written through (`files`), the
    rows each round completes go to their rank files on a thread of their own (a Worker, at most
    BEHIND rounds pending), so their pwrites' CPU is not the main thread's: a completed window
    row is never written again, so the thread reads it from the store as it is, no copy."""

    def __init__(self, ne: NodeEpoch, pad_id: int, files: RankFiles | None = None):
        self.positions, self.files = ne.positions, files
        self.behind = None if files is None else Worker(depth=BEHIND)
        shape, dtype = (ne.store_rows, ne.plan.row_tokens), ne.job.token_dtype
        # every row is written: its pages faulted in at once, not one by one as the rounds land
        nbytes = shape[0] * shape[1] * dtype.itemsize
        self.rows_of = (
            anonymous(nbytes, populate=True).view(dtype).reshape(shape) if nbytes else np.empty(shape, dtype)
        )  # a node without rows this epoch
        if ne.padded and pad_id:  # best-fit rows end in padding (windows fill every row; zero: as mapped)
            self.rows_of[:] = pad_id

    def put(self, pad, at, pieces, tokens, starts) -> None:
        place(self.rows_of, pad, at, pieces, tokens, starts)
        if self.files is None:
            return
        slice_rows = np.unique(at)
        done = slice_rows[pad[slice_rows] == 0]  # complete now, and never again (a row filled twice is refused)
        if len(done):
            self.behind.submit(self._write, self.positions[done], done)

    def _write(self, positions: np.ndarray, done: np.ndarray) -> None:
        with phase("write_through", len(done) * self.rows_of[:1].nbytes):
            self.files.place(positions, self.rows_of, done)

    def finish(self) -> None:
        """Every row written through is in its file (a failed write raised here)."""
        if self.behind is not None:
            self.behind.drain()

    def close(self, failed: bool = False) -> None:
        """The writing thread ended: after its pending writes, or (`failed`) after the one under way."""
        if self.behind is not None:
            behind, self.behind = self.behind, None
            behind.__exit__(BaseException if failed else None, None, None)

    def rows(self, lo: int, hi: int):
        yield lo, self.rows_of[lo:hi]


def receive(ne: NodeEpoch, stores, pad: np.ndarray, got_pieces: np.ndarray, got_tokens: np.ndarray) -> None:
    """A round's pieces for this process into its store, each at its slice row."""
    g = got_pieces["g"]
    if not len(g):
        return
    at = np.searchsorted(ne.positions, g)
    if at.max() >= len(ne.positions) or (ne.positions[at] != g).any() or (ne.keeper_of(g) != ne.me).any():
        raise TokpackError(
            "internal error: a row was sent to a process whose ranks do not read it", where=f"epoch {ne.job.plan.epoch}"
        )
    lengths = got_pieces["length"].astype(np.int64)
    stores.put(pad, at, got_pieces, got_tokens, np.cumsum(lengths) - lengths)


def write_slice_epoch(
    output: Output, d: Path, ne: NodeEpoch, stores, pad: np.ndarray, fmt: EpochShardFormat, files=None, facts=None
) -> list[dict]:
    """This process's rank files of node n's epoch (slice_files), from its rows in epoch order
    (the stores' slice rows, all at once in memory, a bucket at a time out of core): rank r's
    are those of its positions rank r reads, in increasing order (what stage --node writes), with
    their padding (best-fit: the `.ds.pad` beside them). `files`: open since the rounds, their
    tokens written (open_slice_files): here they are indexed, not written again. `facts`: a
    collector of each row's facts for its epoch shard's owner (owned_facts.KeptFacts), which the
    rank files' one pass over the rows gives (RankFiles.facts)."""
    files = slice_files(output, d, ne, fmt) if files is None else files
    files.facts = facts
    try:
        for a, rows in stores.rows(0, len(ne.positions)):
            files.add(ne.positions[a : a + len(rows)], rows, pad[a : a + len(rows)])
        return files.close()
    except BaseException:
        files.abort()
        raise


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
    """The process's store out of core: each received piece appended to its bucket's files by
    the best-fit scatter pass's BucketFiles (task 0: the tokens in `.rows`, a RECORD in `.pos`,
    their store row in the record's g), with each file's xxh3_64 in the task's records; read
    back a bucket at a time by the best-fit order pass's read_bucket (checked against those
    records) and removed once read."""

    def __init__(self, ne: NodeEpoch, layout: Layout, pad_id: int):
        self.lay, self.row_tokens, self.pad_id, self.dtype = layout, ne.plan.row_tokens, pad_id, ne.job.token_dtype
        self.files = BucketFiles(layout, 0)
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
            rec = np.empty(len(sel), RECORD)
            rec["g"], rec["row_offset"], rec["length"] = at[sel], pieces["row_offset"][sel], lengths[sel]
            out = self.gathered.ensure(int(lengths[sel].sum()))
            tokens_of = gather(tokens, starts[sel], lengths[sel], self.row_tokens, out)
            self.files.append(int(bucket[sel[0]]), len(sel), tokens_of, rec)

    def finish(self) -> None:
        """The bucket files closed, their records written (not fsync'd: the command's own scratch)."""
        self.files.close()
        records = np.zeros((len(self.lay.bucket_starts) - 1, 3), dtype="<u8")
        for b, (hr, hp) in self.files.hashes.items():
            records[b] = self.files.counts[b], hr.intdigest(), hp.intdigest()
        write_bytes_atomic(self.lay.task_records(0), records.tobytes())

    def close(self, failed: bool = False) -> None:
        """The bucket files closed, should the rounds have failed (nothing runs behind them: a
        bucket's read back is rows' own, BucketRead). After `finish`, which closed them and
        raised what their last flush met (a full disk), there is nothing to do."""
        if failed:
            with suppress(OSError):  # a failure is being raised: the files are dropped with the scratch
                self.files.close()

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
