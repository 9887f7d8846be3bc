"""The datatrove steps that write an epoch plan's shards into `OUT/epoch-NNNNN/` (shuffle/run.py
runs them, through the injected `run_passes`), on the job and base step of
tokpack.shuffle.epoch_job:

- in memory (the needed windows of every source fit `--memory`), InMemoryStep: one task maps
  each source shard read-only and reads it ahead in one sequential sweep (MADV_POPULATE_READ),
  computing each row's fragment ends and hash (RowFragments) while the next shard is read; then
  it gathers each output chunk with `np.take(..., mode="clip")` on `np.void` row views and
  writes it. One read, one write. Mapping the page cache instead of `readinto` a private buffer
  avoids touching fresh anonymous memory, which is slow (BENCHMARKS.md, "Figures cited by the
  code": fresh memory).
- out of core: a ScatterStep pass (tasks split by input range: runs of whole source shards)
  reads the sources sequentially and appends every row, with its output position g, to the
  file of its bucket (a contiguous output range that fits the per-task budget and never spans
  an output shard); an OrderStep pass (one task per output shard) maps each bucket's files,
  places rows by g and writes the shard sequentially. Two reads, two writes.

Both verify what they read: each source shard's xxh3_128 is computed over the bytes the
sweep reads anyway and compared with the source manifest (a same-size edit since `pack`
fails the epoch, see EpochJob.source_changed). Each scatter task records every bucket file's
xxh3_64 in its binary records table (`scatter-TTTTT.records`: rows and the two checksums per
bucket, Layout.task_records), written before its done JSON; the order pass reads its buckets'
entries and checks each file against them before it trusts it.

In both, a tokpack.formats.io.Worker per stage keeps the disk and both cores busy: reading ahead,
gathering, indexing and writing (shard data with O_DIRECT, see tokpack.formats.io.DurableFile) overlap,
through rings of buffers lent by the tokpack.formats.io pool.

Every task is idempotent: a finished task leaves a done JSON (written last) in the epoch's work
folder, and a rerun skips it.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import xxhash

from tokpack.formats.errors import TokpackError
from tokpack.formats.io.reads import Worker
from tokpack.formats.io.memory import drop_buffers, lent
from tokpack.formats.io.gate import map_file, open_append, read_array, regular_size
from tokpack.formats.io.writes import write_bytes_atomic
from tokpack.formats.shards import PackedSource, RowFragments

from .epoch_job import (
    CHUNKS_IN_BUDGET,
    EpochJob,
    RowStore,
    ShardHashes,
    Step,
)
from .plan import EpochPlan
from .source_windows import iter_source_windows

MAX_BLOCK_BYTES = 64 << 20  # scatter read block, unless the buckets need larger (ROWS_PER_APPEND)
RECORD_BYTES = 24  # a scatter task's record of one bucket: rows, xxh3_64 of its rows file and of its positions file
ROWS_PER_APPEND = 32  # a scatter block large enough for this many rows per bucket on average, when memory allows
SCATTER_ROW_OVERHEAD = 256  # bytes of index arrays per row of a scatter block (Feistel temporaries)
ORDER_ROW_OVERHEAD = 24  # g, inverse and arange entries per bucket row
MAX_OPEN_BUCKET_FILES = 128
# Buckets whose files share a folder of a scatter task's: a task's rows reach every bucket, so
# without the fan-out its folder would hold 2 x buckets files (40,980 for the 11T-token run,
# and growing with the corpus); with it, at most 2 x BUCKETS_PER_FOLDER.
BUCKETS_PER_FOLDER = 1024
LOCATE_BATCH = 1 << 18  # output positions located per call (8 bytes each, a few arrays)
ROW_FACTS_BYTES = 32  # RowFragments per row in memory: first-EOS index, hash, and about one EOS column


class InMemoryStep(Step):
    """One task: read every needed window once, then gather each shard in output order."""

    name = "shuffle in memory"

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        job, plan = self.job, self.job.plan
        todo = [i for i in range(rank, job.n_shards, world_size) if job.shard_done(i) is None]
        if not todo:
            return
        drop_buffers("scatter", "inverse")
        row_base = np.zeros(len(plan.sources), dtype=np.int64)  # first store row of each source
        parts, total = [], 0
        sources = job.open_sources()
        # The fragment index and row hashes are computed per part while the next part is read:
        # the read waits on the disk, so this costs no time, and writing then needs no pass
        # over the tokens besides the gather.
        facts = RowFragments(plan.row_tokens)
        # Each shard's checksum is computed over the mapped bytes in a thread of its own (xxh3
        # outruns the disk and releases the GIL: BENCHMARKS.md, "Figures cited by the code"), and
        # checked before anything is written.
        with (
            job.bar(
                sum(sp.windows for sp in plan.sources if sp.samples) * job.row_bytes, f"epoch {plan.epoch}: read"
            ) as read_bar,
            Worker() as helper,
            Worker() as hasher,
        ):
            hashed = []
            for s, sp in enumerate(plan.sources):
                if sp.samples:
                    row_base[s] = total
                    total += sp.windows

                    def on_shard(k, whole, src=sources[s]):
                        hashed.append((src, k, hasher.submit(xxhash.xxh3_128_hexdigest, whole)))

                    for part in source_rows(sources[s], sp.offset, sp.windows, plan.row_tokens, on_shard):
                        parts.append(part)
                        helper.submit(facts.add, part, job.token_dtype, job.eos_id)
                        read_bar.update(part.nbytes)
            helper.drain()
            for src, k, f in hashed:
                job.check_source_shard(src, k, f.result())
        facts.finish()
        store = RowStore(parts)
        with job.chunk_ring(self.budget) as (ring, tmp):
            rows = len(tmp)

            def blocks(i):
                g0, g1 = job.shard_range(i)
                c = 0
                # Locate in batches much larger than a chunk: the Feistel rounds are many small numpy
                # calls, whose fixed cost dominated when they ran once per chunk. (Gathering alternate
                # chunks in two threads measured slower: the copy is bound by memory bandwidth.)
                for a0 in range(g0, g1, max(rows, LOCATE_BATCH)):
                    b0 = min(g1, a0 + max(rows, LOCATE_BATCH))
                    s, window, _ = plan.locate(np.arange(a0, b0, dtype=np.int64))
                    idx = row_base[s] + window
                    for a in range(0, b0 - a0, rows):
                        chunk = idx[a : a + rows]
                        yield store.gather(chunk, ring[c % len(ring)], tmp), facts, chunk
                        c += 1

            job.write_shards(todo, lambda i: (blocks(i), None))


def source_rows(src: PackedSource, offset: int, windows: int, row_tokens: int, on_shard=None) -> Iterator[np.ndarray]:
    """Windows [0, windows) of a source starting at token `offset`, as np.void row arrays in
    window order, each yielded once read: a mapped view per shard for the windows inside it,
    and a small copy for each window that crosses a shard boundary. Every shard is mapped
    whole and handed to `on_shard(k, bytes)` once read (to verify it). A held-out split's stream
    (EpochPlan.stream, its `raw` source): each raw shard is mapped and handed over as well, and
    the windows that end in it are gathered from its runs into a buffer of their own."""
    raw = getattr(src, "raw", src)
    stream, ts = raw is not src, src.dtype.itemsize
    void = np.dtype((np.void, row_tokens * ts))
    w = 0
    for k, shard in enumerate(raw.shards):
        t0, t1 = int(src.shard_starts[k]), int(src.shard_starts[k + 1])
        while not stream and w < windows and offset + w * row_tokens < t0:  # starts in an earlier shard
            row = np.empty(row_tokens, dtype=src.dtype)
            src.read_into(offset + w * row_tokens, row)
            yield row.view(void)
            w += 1
        first = w
        last = min(windows, max(first, (t1 - offset) // row_tokens))  # windows that end inside this shard
        whole = map_file(raw.path / shard["path"], 0, int(shard["tokens"]) * ts)
        if on_shard is not None:
            on_shard(k, whole)
        if last > first and stream:
            rows = np.empty((last - first) * row_tokens, dtype=src.dtype)
            yield src.read_into(offset + first * row_tokens, rows).view(void)
        elif last > first:
            start = (offset + first * row_tokens - t0) * ts
            yield whole[start : start + (last - first) * row_tokens * ts].view(void)
        w = last
    if w != windows:
        what = "stream" if stream else "source"
        raise TokpackError(f"internal error: {what} windows", file=raw.path, expected=windows, found=w)


@dataclass
class Layout:
    """How the out-of-core path splits an epoch. Any layout gives the same bytes."""

    tasks: int  # scatter tasks (split by input range)
    bucket_starts: np.ndarray  # int64 output position where each bucket starts, plus N at the end
    shard_buckets: np.ndarray  # first bucket of each shard, plus the bucket count at the end
    block_rows: int  # scatter read block, in rows
    dir: str  # OUT/.tokpack-work/epoch-.../ooc-<layout key>
    task_shards: list  # per task: its input range, as runs (source, first shard, end shard) of whole shards

    @property
    def max_bucket(self) -> int:
        return int(np.diff(self.bucket_starts).max())

    def task_dir(self, t: int) -> Path:
        return Path(self.dir) / f"scatter-{t:05d}"

    def task_done(self, t: int) -> Path:
        return Path(self.dir) / f"scatter-{t:05d}.json"

    def scatter_done(self, t: int) -> bool:
        """Task t's records are written (then its done file, last)."""
        return self.task_done(t).exists() and self.task_records(t).exists()

    def task_records(self, t: int) -> Path:
        """Scatter task t's record per bucket: rows, xxh3_64 of its rows file and of its
        positions file, three little-endian uint64 a bucket, in bucket order (0s: none)."""
        return Path(self.dir) / f"scatter-{t:05d}.records"

    def recorded(self, t: int, buckets: range) -> np.ndarray:
        """Task t's records of `buckets` only: an order task reads its own buckets' records, a
        few bytes each, not the whole table (which grows with the bucket count)."""
        table = read_array(self.task_records(t), "<u8", 3 * len(buckets), RECORD_BYTES * buckets.start, folder=self.dir)
        if len(table) != 3 * len(buckets):  # written whole and atomically: only damage cuts it short
            self.task_done(t).unlink(missing_ok=True)
            raise TokpackError(
                "scatter task's records are cut short",
                file=self.task_records(t),
                where=f"buckets {buckets.start}..{buckets.stop - 1}",
                expected=f"{RECORD_BYTES * buckets.stop} bytes at least",
                found=f"{os.path.getsize(self.task_records(t))} bytes",
                hint="rerun the same command: the scatter task that wrote it runs again",
            )
        return table.reshape(-1, 3)

    def bucket_file(self, t: int, b: int, ext: str) -> Path:
        """Task t's rows (ext "rows") or their output positions ("pos") of bucket b."""
        return self.task_dir(t) / f"{b // BUCKETS_PER_FOLDER:04d}" / f"b{b:07d}.{ext}"

    def buckets_of(self, i: int) -> range:
        """The buckets of output shard i."""
        return range(int(self.shard_buckets[i]), int(self.shard_buckets[i + 1]))

    def finish_task(self, t: int, counts: dict[int, int], hashes: dict) -> None:
        """Scatter task t's records (`counts`: rows per bucket written; `hashes`: its two files'
        xxh3_64 of each), then its done file, last."""
        table = np.zeros((len(self.bucket_starts) - 1, 3), dtype="<u8")
        for b, n in counts.items():
            table[b] = n, hashes[b][0].intdigest(), hashes[b][1].intdigest()
        write_bytes_atomic(self.task_records(t), table.tobytes(), fsync=True)
        write_bytes_atomic(self.task_done(t), json.dumps({"task": t, "buckets": len(table)}).encode(), fsync=True)

    def remove_buckets(self, buckets: range) -> None:
        """Every task's files of `buckets`: once their shard is written, they are no longer needed."""
        for b in buckets:
            for t in range(self.tasks):
                for ext in ("rows", "pos"):
                    self.bucket_file(t, b, ext).unlink(missing_ok=True)

    def holds_rows_of(self, i: int, row_bytes: int) -> bool:
        """Whether the bucket files still hold every row of output shard i (the order pass
        deletes them once the shard is written)."""
        for b in self.buckets_of(i):
            files = [self.bucket_file(t, b, "rows") for t in range(self.tasks)]
            held = sum(os.path.getsize(f) for f in files if f.exists())
            if held != int(self.bucket_starts[b + 1] - self.bucket_starts[b]) * row_bytes:
                return False
        return True


def shard_segments(plan: EpochPlan, sources: list[PackedSource], runs) -> list[tuple[int, int, int, int, int]]:
    """(source, first window, end window, first shard, end shard) per run (source, first shard,
    end shard) of whole shards: the windows that start in those shards (split_shards' runs; a
    scatter task's, or a process's of shuffle --to-nodes), so each shard is read in full, and
    verified, by exactly one task."""
    out = []
    for s, k0, k1 in runs:
        sp, starts = plan.sources[s], sources[s].shard_starts
        first, end = (max(0, min(sp.windows, -(-(int(starts[k]) - sp.offset) // plan.row_tokens))) for k in (k0, k1))
        out.append((s, first, end, k0, k1))
    return out


def window_memory(job: EpochJob, memory: int) -> tuple[int, int]:
    """(bytes of the windows to hold, bytes InMemoryStep holds with its chunk buffers)."""
    needed = sum(sp.windows for sp in job.plan.sources if sp.samples) * (job.row_bytes + ROW_FACTS_BYTES)
    return needed, needed + CHUNKS_IN_BUDGET * job.chunk_rows(memory) * job.row_bytes


def make_layout(job: EpochJob, budget: int, tasks: int) -> Layout:
    """Buckets as large as the per-task budget allows (fewer buckets = larger scatter writes)."""
    rb, chunks = job.row_bytes, CHUNKS_IN_BUDGET * job.chunk_rows(budget) * job.row_bytes
    bucket_rows = max(1, (budget - chunks) // (rb + ORDER_ROW_OVERHEAD))
    starts, firsts = [], []
    for i in range(job.n_shards):
        g0, g1 = job.shard_range(i)
        nb = -(-(g1 - g0) // bucket_rows)
        firsts.append(len(starts))
        starts.extend(g0 + (j * (g1 - g0)) // nb for j in range(nb))
    firsts.append(len(starts))
    starts.append(job.plan.samples)
    bucket_starts = np.array(starts, dtype=np.int64)
    # With many buckets (a large epoch: one per shard at least), a 64 MiB block spreads to about
    # one row per bucket, and a row per append costs a file open each: the block grows, within
    # the budget, until the appends carry ROWS_PER_APPEND rows.
    wanted = max(MAX_BLOCK_BYTES // rb, ROWS_PER_APPEND * (len(bucket_starts) - 1))
    block_rows = max(1, min(wanted, budget // (4 * rb + SCATTER_ROW_OVERHEAD)))
    task_shards = split_shards(job.plan, job.open_sources(), tasks)
    key = xxhash.xxh3_64_hexdigest(f"{len(task_shards)}|{block_rows}|{task_shards}|".encode() + bucket_starts.tobytes())
    return Layout(
        len(task_shards),
        bucket_starts,
        np.array(firsts, dtype=np.int64),
        block_rows,
        str(Path(job.work_dir) / f"ooc-{key}"),
        task_shards,
    )


def split_shards(plan: EpochPlan, sources: list[PackedSource], tasks: int) -> list[list[tuple[int, int, int]]]:
    """The shards of the sources the epoch uses, in stream order, cut into at most `tasks`
    runs of about equal tokens (at most one task per shard)."""
    shards = [(s, k) for s, sp in enumerate(plan.sources) if sp.samples for k in range(len(sources[s].shards))]
    sizes = np.array([int(sources[s].shards[k]["tokens"]) for s, k in shards], dtype=np.int64)
    tasks = max(1, min(tasks, len(shards)))
    ends = np.cumsum(sizes) if len(sizes) else np.zeros(0, np.int64)
    cuts, prev = [0], 0
    for t in range(1, tasks):  # first shard of task t: where the t-th share of the tokens ends
        k = int(np.searchsorted(ends, int(ends[-1]) * t // tasks, side="right")) if len(ends) else 0
        prev = min(max(k, prev + 1), len(shards) - (tasks - t))
        cuts.append(prev)
    cuts.append(len(shards))
    out = []
    for a, b in zip(cuts, cuts[1:]):
        runs: list[tuple[int, int, int]] = []
        for s, k in shards[a:b]:
            if runs and runs[-1][0] == s and runs[-1][2] == k:
                runs[-1] = (s, runs[-1][1], k + 1)
            else:
                runs.append((s, k, k + 1))
        out.append(runs)
    return out


class BucketFiles:
    """Scatter task t's bucket files, appended to by one thread (two at once could interleave one
    block's rows with another's positions), at most MAX_OPEN_BUCKET_FILES buckets' open at once
    (the open-files ulimit), with the rows each bucket got. Each file's xxh3_64 as written is
    recorded in task_records and checked by the order pass: a file a crash cut short or garbled is
    caught without an fsync of every bucket file (which the done JSON, fsync'd, would otherwise
    have to wait for)."""

    def __init__(self, lay: Layout, t: int):
        self.lay, self.t = lay, t
        self.files: dict[int, tuple] = {}  # open (rows, pos) files per bucket
        self.counts: dict[int, int] = {}  # rows written per bucket
        self.hashes: dict[int, tuple] = {}  # per bucket written: xxh3_64 of its rows file and of its pos file

    def append(self, b: int, n: int, rows: np.ndarray, pos: np.ndarray) -> None:
        """`n` rows (or pieces) of bucket b: their tokens `rows` and their positions `pos`."""
        if b not in self.files:
            if len(self.files) >= MAX_OPEN_BUCKET_FILES:
                self.close()
            self.lay.bucket_file(self.t, b, "rows").parent.mkdir(exist_ok=True)
            self.files[b] = tuple(
                open_append(self.lay.bucket_file(self.t, b, ext), folder=self.lay.dir) for ext in ("rows", "pos")
            )
            self.hashes.setdefault(b, (xxhash.xxh3_64(), xxhash.xxh3_64()))
        for f, h, data in zip(self.files[b], self.hashes[b], (rows, pos)):
            raw = memoryview(data).cast("B")
            f.write(raw)
            h.update(raw)
        self.counts[b] = self.counts.get(b, 0) + n

    def close(self) -> None:
        for pair in self.files.values():
            for f in pair:
                f.close()
        self.files.clear()


class ScatterStep(Step):
    """Task t reads its input range sequentially and appends rows + output positions to the
    files of their buckets: scatter-TTTTT/bBBBBBB.rows and .pos (int64 g per row)."""

    name = "shuffle scatter"

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        for t in range(rank, self.layout.tasks, world_size):
            self.scatter(t)

    def scatter(self, t: int) -> None:
        """Scatter task t, unless its records are written: its folder made afresh, its bucket files
        filled (`fill`, each packing's), then its records and done file."""
        lay = self.layout
        if lay.scatter_done(t):
            return
        shutil.rmtree(lay.task_dir(t), ignore_errors=True)
        lay.task_dir(t).mkdir(parents=True)
        files = BucketFiles(lay, t)
        try:
            self.fill(t, self.job.open_sources(), files)
        finally:
            files.close()
        lay.finish_task(t, files.counts, files.hashes)

    def scatter_bar(self, sources: list[PackedSource]):
        """The pass's bar: the bytes of every source the epoch uses, each read by one task."""
        plan = self.job.plan
        return self.bar(
            sum(int(src.tokens) * src.dtype.itemsize for s, src in enumerate(sources) if plan.sources[s].samples),
            f"epoch {plan.epoch}: scatter",
        )

    def fill(self, t: int, sources: list[PackedSource], files: BucketFiles) -> None:
        job, plan, lay = self.job, self.job.plan, self.layout
        drop_buffers("inverse")
        segments = shard_segments(plan, sources, lay.task_shards[t])
        rows_in = max(1, min(lay.block_rows, max([b - a for _, a, b, _, _ in segments], default=1)))
        # Two input buffers (a thread reads one block ahead) and two output buffers (the disk
        # thread appends one to the bucket files while this thread sorts the next block).
        with lent("scatter", rows_in * job.row_bytes, 4) as bufs:
            inbufs = [b.view(job.token_dtype) for b in bufs[:2]]
            outbufs = [b.view(job.row_void) for b in bufs[2:]]
            scatter_bar = self.scatter_bar(sources)

            def append(out: np.ndarray, g: np.ndarray, runs: list[tuple[int, int, int]]) -> None:
                for b, x, y in runs:
                    files.append(b, y - x, out[x:y], g[x:y].astype("<i8"))

            used = 0  # output buffers filled so far
            with Worker(len(outbufs) - 1) as disk:  # the append of one buffer overlaps the fill of the other
                for s, w0, w1, k0, k1 in segments:
                    shards = ShardHashes(getattr(sources[s], "raw", sources[s]), k0, k1, job.source_changed)
                    for a, block in iter_source_windows(
                        plan, s, sources[s], w0=w0, w1=w1, bufs=inbufs, on_read=shards.feed
                    ):
                        scatter_bar.update(block.nbytes)
                        rows = block.reshape(-1).view(job.row_void)
                        windows = np.arange(a, a + len(rows), dtype=np.int64)
                        for _, sel, g in plan.outputs_of(s, windows):
                            bucket = np.searchsorted(lay.bucket_starts, g, side="right") - 1
                            order = np.argsort(bucket, kind="stable")
                            m = len(order)
                            out = outbufs[used % len(outbufs)]
                            used += 1
                            np.take(rows, sel[order], out=out[:m], mode="clip")
                            g, bucket = g[order], bucket[order]
                            cuts = np.flatnonzero(np.diff(bucket)) + 1
                            runs = [(int(bucket[x]), x, y) for x, y in zip([0, *cuts.tolist()], [*cuts.tolist(), m])]
                            disk.submit(append, out, g, runs)
                    shards.finish()


def bucket_damaged(message: str, file, b: int, **fields) -> TokpackError:
    """The one line for bucket b's scatter files holding what no scatter task wrote."""
    return TokpackError(message, file=file, where=f"bucket {b}", hint="delete OUT/.tokpack-work and rerun", **fields)


ORDER_PHASE = "order buckets, write shards"  # the out-of-core order pass, as progress names it


class OrderStep(Step):
    """Task i writes output shard i: each of its buckets is loaded, placed by g, written."""

    name = "shuffle order"

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        for i in range(rank, self.job.n_shards, world_size):
            self.order(i)

    def order_bar(self):
        """The order pass's bar, opened before its first bucket is read: what the pass does, named
        in the log from its start (the scatter pass's bar, finished, stays open until both end)."""
        job = self.job
        return self.bar(job.plan.samples * job.row_bytes, f"epoch {job.plan.epoch}: {ORDER_PHASE}")

    def order(self, i: int) -> None:
        """Task i: shard i written from its buckets (`write`, each packing's) unless it is done, then
        its buckets' files removed."""
        self.order_bar()
        if self.job.shard_done(i) is None:
            self.write(i, self.layout.buckets_of(i))
        self.layout.remove_buckets(self.layout.buckets_of(i))  # the shard is safe

    def chunks(self, buckets: range, ring: list[np.ndarray], bucket_rows) -> Iterator[np.ndarray]:
        """The rows of `buckets` in output order, copied into the `ring` buffers a chunk at a time
        (write_shard keeps up to RING - 1 chunks in flight: never a whole bucket). `bucket_rows(b,
        records)`: bucket b's rows, from the files every scatter task wrote of it (`records`: each
        task's record of it), as `take(a, c, out)`, which puts its rows [a, c) in `out`."""
        lay, count, bar = self.layout, 0, self.order_bar()  # count: chunks yielded, picks the ring buffer
        recorded = [lay.recorded(t, buckets) for t in range(lay.tasks)]
        for b in buckets:
            n = int(lay.bucket_starts[b + 1] - lay.bucket_starts[b])
            take = bucket_rows(b, [r[b - buckets.start] for r in recorded])
            for a in range(0, n, len(ring[0])):
                out = take(a, min(n, a + len(ring[0])), ring[count % len(ring)])
                count += 1
                yield out
                bar.update(len(out) * self.job.row_bytes)
            del take  # its maps go before the next bucket's are made

    def write(self, i: int, buckets: range) -> None:
        drop_buffers("scatter")
        cap = max(int(np.diff(self.layout.bucket_starts[buckets.start : buckets.stop + 1]).max()), 1)
        ramp = np.arange(cap, dtype=np.int64)
        with lent("inverse", cap * 8) as (inv,), self.job.chunk_ring(self.budget) as (ring, tmp):
            inv = inv.view(np.int64)
            self.job.write_shard(
                i, self.chunks(buckets, ring, lambda b, records: self._rows(b, records, inv, ramp, tmp))
            )

    def _rows(self, b: int, records: list, inv: np.ndarray, ramp: np.ndarray, tmp: np.ndarray):
        """Bucket b's files are mapped (no copy into fresh memory) and placed by g through the
        inverse permutation `inv`; its rows are gathered in output order, a chunk at a time."""
        job, lay = self.job, self.layout
        start, n = int(lay.bucket_starts[b]), int(lay.bucket_starts[b + 1] - lay.bucket_starts[b])
        parts, positions = [], []
        for t in range(lay.tasks):
            f = lay.bucket_file(t, b, "rows")
            if f.exists():
                files = (f, f.with_suffix(".pos"))
                rows, pos = (map_file(x, 0, regular_size(x, folder=lay.dir), folder=lay.dir) for x in files)
                # The bucket's files must be the bytes scatter task t wrote (their checksums in its records
                # table). If not (a crash after the task's records and done JSON reached the disk but
                # before its buffered bucket files did), that task is redone on the next run.
                for x, data, want in zip(files, (rows, pos), records[t][1:].tolist()):
                    self._check_file(t, x, want, xxhash.xxh3_64_intdigest(data))
                k = len(rows) // job.row_bytes
                parts.append(rows[: k * job.row_bytes].view(job.row_void))
                positions.append(pos[: k * 8].view("<i8"))
                del rows, pos  # the maps must go with `parts` (the store's), before the next bucket is mapped
        store = RowStore(parts)
        if len(store) != n:
            raise bucket_damaged(
                "scatter files do not cover their bucket",
                lay.dir,
                b,
                expected=f"{n} rows",
                found=f"{len(store)} rows",
            )
        inv[:n] = -1
        for pos, first in zip(positions, store.starts.tolist()):
            local = pos - start
            if len(local) and (local.min() < 0 or local.max() >= n):
                raise bucket_damaged("scatter file holds a row of another bucket", lay.dir, b)
            inv[local] = ramp[first : first + len(local)]
        if n and inv[:n].min() < 0:
            raise bucket_damaged("scatter files hold a position twice", lay.dir, b)
        return lambda a, c, out: store.gather(inv[a:c], out, tmp)

    def _check_file(self, t: int, path, want, found: int) -> None:
        """One bucket file of scatter task t hashed to `found`; its task recorded `want`."""
        if found != int(want):
            self.layout.task_done(t).unlink(missing_ok=True)
            raise TokpackError(
                "scatter bucket file does not match the checksum its task recorded",
                file=path,
                where="xxh3_64",
                expected=f"{int(want):016x}",
                found=f"{found:016x}",
                hint="rerun the same command: the scatter task that wrote it runs again",
            )
