"""The permutation engine: carries out an epoch plan into `OUT/epoch-NNNNN/`.

Two paths, both datatrove `PipelineStep`s run through the injected `run_passes`:

- in memory (the needed windows of every source fit `--memory`): one task maps each source
  shard read-only and reads it ahead in one sequential sweep (MADV_POPULATE_READ), computing
  each row's fragment ends and hash (RowFragments) while the next shard is read; then it
  gathers each output chunk with `np.take(..., mode="clip")` on `np.void` row views and writes
  it. One read, one write. Mapping the page cache instead of `readinto` a private buffer
  avoids touching fresh anonymous memory, which costs 1.5-3 s/GiB on these VMs.
- out of core: a SCATTER pass (tasks split by input range: runs of whole source shards)
  reads the sources sequentially and appends every row, with its output position g, to the
  file of its bucket (a
  contiguous output range that fits the per-task budget and never spans an output shard);
  an ORDER pass (one task per output shard) maps each bucket's files, places rows by g and
  writes the shard sequentially. Two reads, two writes.

Both verify what they read: each source shard's xxh3_128 is computed over the bytes the
sweep reads anyway and compared with the source manifest (a same-size edit since `pack`
fails the epoch, see EpochJob.source_changed). Bucket files carry their xxh3_64 in the scatter task's
done JSON, checked by the order pass before it trusts them.

In both, a thread per stage keeps the disk and both cores busy: reading ahead, gathering,
indexing and writing (shard data with O_DIRECT, see formats.manifest.DurableFile) overlap,
through rings of reused buffers.

Every task is idempotent: a finished task leaves a done JSON (written last) in the work
folder `OUT/.tokpack-work/`, and a rerun skips it. The epoch manifest is written after every
shard is done, then the run manifest; the work folder is removed last.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import sys
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import xxhash

from formats.errors import TokpackError, task_failed
from formats.guard import LOCK_NAME, WORK_DIR, bytes_under, check_space, is_no_space, locked_output
from formats.manifest import (
    IO_BLOCK,
    MANIFEST,
    dtype_from_name,
    dtype_name,
    epoch_dir_name,
    epoch_manifest,
    iter_file_blocks,
    progress,
    TMP_MARK,
    read_manifest,
    remove_tmp_files,
    run_manifest,
    shard_digits,
    shard_name,
    write_bytes_atomic,
    write_manifest,
)
from formats.shards import EpochShardWriter, PackedSource, RowFragments, shard_on_disk
from formats.sinks import app_sinks_kept

from .plan import PLAN_ALGORITHM, EpochPlan, epoch_plan, iter_source_windows, parse_weight

# Importing datatrove's logging module removes every loguru sink; the application's must stay.
with app_sinks_kept():
    import datatrove.utils.logging  # noqa: F401
    from datatrove.pipeline.base import PipelineStep

DEFAULT_SHARD_BYTES = 1 << 30  # default --shard-samples: about 1 GiB of samples per shard
MAX_CHUNK_BYTES = 8 << 20  # rows gathered and written per call: big enough for sequential I/O
RING = 4  # chunk buffers: one being gathered while up to RING-1 are indexed or written
CHUNKS_IN_BUDGET = RING + 3  # the ring, the gather scratch and the shard writer's temporaries
MAX_BLOCK_BYTES = 64 << 20  # scatter read block
SCATTER_ROW_OVERHEAD = 256  # bytes of index arrays per row of a scatter block (Feistel temporaries)
ORDER_ROW_OVERHEAD = 24  # g, inverse and arange entries per bucket row
MAX_OPEN_BUCKET_FILES = 128
ROW_FACTS_BYTES = 32  # RowFragments per row in memory: first-EOS index, hash, and about one EOS column
MIN_BUCKET_ROWS = 8  # below this many rows per bucket the out-of-core path spends its time per bucket, not per byte
SOURCE_CHANGED = "source-changed.json"  # in the epoch's work folder: a task found a source shard edited since pack


# ---------------------------------------------------------------------- buffers


def alloc(nbytes: int) -> np.ndarray:
    """A zero-copy uint8 buffer backed by an anonymous mmap with transparent huge pages
    requested: first-touch page faults cost about half of plain 4 KiB pages here."""
    nbytes = max(int(nbytes), 1)
    # MAP_PRIVATE: Python's default for anonymous maps is MAP_SHARED, which a forked worker
    # would share with its parent, and the two would overwrite each other's rows.
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return np.frombuffer(m, dtype=np.uint8)


_BUFFERS: dict[str, np.ndarray] = {}  # per-process reuse: fresh pages cost 1.5-3 s/GiB here


def reused(name: str, nbytes: int) -> np.ndarray:
    """A buffer of at least `nbytes` that later tasks in this process get back (its pages are
    already faulted in). Only the largest buffer per name is kept."""
    buf = _BUFFERS.get(name)
    if buf is None or buf.nbytes < nbytes:
        _BUFFERS.pop(name, None)
        buf = _BUFFERS[name] = alloc(nbytes)
    return buf[: max(int(nbytes), 1)]


def release(*names: str) -> None:
    """Frees cached buffers another pass needs no more, so passes run in one process never
    hold more than one pass's budget."""
    for name in names:
        _BUFFERS.pop(name, None)


LOCATE_BATCH = 1 << 18  # output positions located per call (8 bytes each, a few arrays)
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14


def map_file(path: Path, offset: int, length: int) -> np.ndarray:
    """Bytes [offset, offset+length) of a file, memory-mapped read-only and read ahead in one
    sequential sweep. Mapping the page cache costs no fresh memory, unlike a read into a buffer."""
    if length <= 0:
        return np.empty(0, dtype=np.uint8)
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), offset + length - start, prot=mmap.PROT_READ, offset=start)
    view = np.frombuffer(m, dtype=np.uint8)
    if not _populate(view.ctypes.data, len(m)):  # older kernels: a sequential read fills the page cache
        for _ in iter_file_blocks(path, bytearray(IO_BLOCK), offset, length):
            pass
    return view[offset - start : offset - start + length]


def _load_madvise():
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


_MADVISE = _load_madvise()


def _populate(address: int, length: int) -> bool:
    """MADV_POPULATE_READ: reads the mapping in with the kernel's read-ahead. Called through
    ctypes, which releases the GIL for the second it takes (mmap.madvise holds it), so other
    threads work on the parts already read."""
    return _MADVISE is not None and _MADVISE(address, length, MADV_POPULATE_READ) == 0


class RowStore:
    """Rows held in several arrays (mapped files, small buffers) under one global row number."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = [p for p in parts if len(p)]  # np.void row arrays, in global row order
        self.starts = np.cumsum([0] + [len(p) for p in self.parts]).astype(np.int64)  # first row of each part

    def __len__(self) -> int:
        return int(self.starts[-1])

    def gather(self, idx: np.ndarray, out: np.ndarray, tmp: np.ndarray) -> np.ndarray:
        """out[i] = row idx[i]. `np.take(mode="clip")` per part (clip never buffers; the indices
        are in range by construction), then one scatter of the chunk when parts interleave."""
        n = len(idx)
        if n and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError("row index out of range")
        part = np.searchsorted(self.starts, idx, side="right") - 1
        if n == 0 or part[0] == part[-1] and (part == part[0]).all():
            k = int(part[0]) if n else 0
            return np.take(self.parts[k], idx - self.starts[k], out=out[:n], mode="clip") if n else out[:0]
        order = np.argsort(part, kind="stable")
        sorted_part = part[order]
        cuts = np.flatnonzero(np.diff(sorted_part)) + 1
        for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), n]):
            k = int(sorted_part[a])
            np.take(self.parts[k], idx[order[a:b]] - self.starts[k], out=tmp[a:b], mode="clip")
        out[order] = tmp[:n]
        return out[:n]


class ShardHashes:
    """xxh3_128 of source shards k0..k1-1, computed from their token stream fed in order (the
    bytes a sweep reads anyway); what the sweep skips (the head before its first window, the
    dropped tail) is read here. Each finished shard is compared with the source manifest."""

    def __init__(self, src: PackedSource, k0: int, k1: int, on_mismatch):
        self.src = src
        self.k, self.k1 = k0, k1  # shard being hashed, end of the run
        self.pos = int(src.shard_starts[k0])  # next stream token to hash
        self.end = int(src.shard_starts[k1])
        self.on_mismatch = on_mismatch  # (shard path, expected, found) -> raises
        self.hash = xxhash.xxh3_128()
        self._close_finished()

    def feed(self, start: int, tokens: np.ndarray) -> None:
        """`tokens`: contiguous stream tokens from token `start` (>= the last fed end)."""
        if start > self.pos:
            self._read_up_to(min(start, self.end))
        data = tokens.reshape(-1)[max(0, self.pos - start):]
        while len(data) and self.k < self.k1:
            take = min(len(data), int(self.src.shard_starts[self.k + 1]) - self.pos)
            self.hash.update(memoryview(np.ascontiguousarray(data[:take])).cast("B"))
            self.pos += take
            data = data[take:]
            self._close_finished()

    def finish(self) -> None:
        self._read_up_to(self.end)

    def _read_up_to(self, stop: int) -> None:
        buf = np.empty(min(max(stop - self.pos, 1), IO_BLOCK // self.src.dtype.itemsize), dtype=self.src.dtype)
        while self.pos < stop:
            n = min(len(buf), stop - self.pos)
            self.feed(self.pos, self.src.read_into(self.pos, buf[:n]))

    def _close_finished(self) -> None:
        while self.k < self.k1 and self.pos == int(self.src.shard_starts[self.k + 1]):
            found, shard = self.hash.hexdigest(), self.src.shards[self.k]
            if found != shard["xxh3_128"]:
                self.on_mismatch(self.src.path / shard["path"], shard["xxh3_128"], found)
            self.k += 1
            self.hash = xxhash.xxh3_128()


# ---------------------------------------------------------------------- one epoch


@dataclass
class EpochJob:
    """Everything a task needs to write its part of one epoch. Small and picklable."""

    plan: EpochPlan  # what goes where
    source_paths: tuple[str, ...]  # opened again inside each task
    dtype: str  # uint16 | uint32
    eos_id: int  # for the fragment index
    tokenizer: str  # for .ds.metadata
    epoch_dir: str  # OUT/epoch-NNNNN
    work_dir: str  # OUT/.tokpack-work/epoch-NNNNN-<key>
    shard_samples: int  # samples per output shard (the last may be short)
    progress: bool = False  # tqdm bars, shown only by tasks running in the process that asked for them
    main_pid: int = 0  # that process

    @property
    def show_progress(self) -> bool:
        return self.progress and os.getpid() == self.main_pid and sys.stderr.isatty()

    @property
    def source_changed_path(self) -> Path:
        return Path(self.work_dir) / SOURCE_CHANGED

    def source_changed(self, shard: Path, expected: str, found: str) -> None:
        """A task read a source shard whose bytes are not what `pack` recorded: leaves a marker the
        submitting process turns into one line (tasks elsewhere can only fail), and stops."""
        record = {"shard": str(shard), "expected": expected, "found": found}
        Path(self.work_dir).mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(self.source_changed_path, json.dumps(record).encode(), fsync=True)
        raise source_changed_error(record)

    @property
    def token_dtype(self) -> np.dtype:
        return dtype_from_name(self.dtype)

    @property
    def row_bytes(self) -> int:
        return self.plan.row_tokens * self.token_dtype.itemsize

    @property
    def row_void(self) -> np.dtype:
        return np.dtype((np.void, self.row_bytes))

    @property
    def n_shards(self) -> int:
        return -(-self.plan.samples // self.shard_samples)

    def shard_range(self, i: int) -> tuple[int, int]:
        return i * self.shard_samples, min(self.plan.samples, (i + 1) * self.shard_samples)

    def shard_file(self, i: int) -> str:
        return shard_name(i, shard_digits(self.n_shards))

    def done_path(self, i: int) -> Path:
        return Path(self.work_dir) / "done" / f"{self.shard_file(i)}.json"

    def open_sources(self) -> list[PackedSource]:
        return [PackedSource.open(p, check_sizes=False) for p in self.source_paths]

    def shard_done(self, i: int) -> dict | None:
        """The shard's manifest entry if it was committed and recorded and is still on disk."""
        done = self.done_path(i)
        if not done.exists():
            return None
        entry = json.loads(done.read_text())
        return entry if shard_on_disk(self.epoch_dir, entry, self.token_dtype.itemsize) else None

    def write_shard(self, i: int, blocks) -> dict:
        """Writes shard i from `blocks` (an iterator, in output order, of np.void row arrays, or
        of (rows, RowFragments, their store rows) when the rows' index is known already), then
        records it as done."""
        g0, g1 = self.shard_range(i)
        writer = EpochShardWriter(self.epoch_dir, self.shard_file(i), self.token_dtype, self.plan.seq_len,
                                  self.eos_id, self.tokenizer)
        try:
            # Three stages overlap: gathering chunk c (here), indexing and hashing an earlier
            # chunk (CPU) and writing one to disk (I/O), each stage in order. `blocks` fills RING
            # buffers round robin, so at most RING-1 chunks may be in flight.
            with ThreadPoolExecutor(1) as disk, ThreadPoolExecutor(1) as index:
                pending: deque = deque()
                for item in blocks:
                    if isinstance(item, tuple):
                        rows, facts, idx = item
                        indexed = index.submit(lambda n, f, i: writer.write_known_index(n, *f.of(i)), len(rows), facts, idx)
                    else:
                        rows = item
                        indexed = index.submit(writer.write_index, rows)
                    pending.append((disk.submit(writer.write_tokens, rows), indexed))
                    while len(pending) > RING - 1:
                        for f in pending.popleft():
                            f.result()
                while pending:
                    for f in pending.popleft():
                        f.result()
            if writer.samples != g1 - g0:
                raise TokpackError("internal error: shard row count", where=f"shard {i}",
                                   expected=g1 - g0, found=writer.samples)
            entry = writer.close()
        except BaseException:
            writer.abort()
            raise
        entry["fragments"] = os.path.getsize(Path(self.epoch_dir) / f"{entry['path']}.index") // 8
        self.done_path(i).parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(self.done_path(i), json.dumps(entry).encode(), fsync=True)
        return entry

    def chunk_rows(self, budget: int) -> int:
        return max(1, min(MAX_CHUNK_BYTES, budget // (2 * CHUNKS_IN_BUDGET)) // self.row_bytes)

    def chunk_ring(self, budget: int) -> tuple[list[np.ndarray], np.ndarray]:
        """RING output buffers used round robin, plus one gather scratch buffer, all reused."""
        nbytes = self.chunk_rows(budget) * self.row_bytes
        ring = [reused(f"chunk{j}", nbytes).view(self.row_void) for j in range(RING)]
        return ring, reused("gather-scratch", nbytes).view(self.row_void)


class _NoBar:
    """What a disabled bar does, without importing tqdm (0.1-0.2 s of start-up)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "B"):
    return progress(total, desc, unit=unit, enabled=True) if enabled else _NoBar()


class _Step(PipelineStep):
    type = "tokpack"

    def __init__(self, job: EpochJob):
        super().__init__()
        self.job = job
        self._bar = None  # one bar for the whole pass, in the submitting process only

    def __getstate__(self):
        return {**self.__dict__, "_bar": None}

    def bar(self, total: int, desc: str):
        if self._bar is None:
            self._bar = progress_bar(total, desc, self.job.show_progress)
        return self._bar

    def close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class InMemoryStep(_Step):
    """One task: read every needed window once, then gather each shard in output order."""

    name = "shuffle in memory"

    def __init__(self, job: EpochJob, budget: int):
        super().__init__(job)
        self.budget = budget  # bytes this task may use beyond the interpreter

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        job, plan = self.job, self.job.plan
        todo = [i for i in range(rank, job.n_shards, world_size) if job.shard_done(i) is None]
        if not todo:
            return
        release("scatter-in0", "scatter-in1", "scatter-out0", "scatter-out1", "inverse")
        row_base = np.zeros(len(plan.sources), dtype=np.int64)  # first store row of each source
        parts, total = [], 0
        sources = job.open_sources()
        # The fragment index and row hashes are computed per part while the next part is read:
        # the read waits on the disk, so this costs no time, and writing then needs no pass
        # over the tokens besides the gather.
        facts = RowFragments(plan.row_tokens)
        # Each shard's checksum is computed over the mapped bytes in a thread of its own (xxh3
        # runs at about 25 GB/s and releases the GIL), and checked before anything is written.
        with progress_bar(sum(sp.windows for sp in plan.sources if sp.samples) * job.row_bytes,
                          f"epoch {plan.epoch}: read", job.show_progress) as read_bar, \
                ThreadPoolExecutor(1) as helper, ThreadPoolExecutor(1) as hasher:
            added, hashed = [], []
            for s, sp in enumerate(plan.sources):
                if sp.samples:
                    row_base[s] = total
                    total += sp.windows

                    def on_shard(k, whole, src=sources[s]):
                        hashed.append((src, k, hasher.submit(xxhash.xxh3_128_hexdigest, whole)))

                    for part in source_rows(sources[s], sp.offset, sp.windows, plan.row_tokens, on_shard):
                        parts.append(part)
                        added.append(helper.submit(facts.add, part, job.token_dtype, job.eos_id))
                        read_bar.update(part.nbytes)
            for f in added:
                f.result()
            for src, k, f in hashed:
                if f.result() != src.shards[k]["xxh3_128"]:
                    job.source_changed(src.path / src.shards[k]["path"], src.shards[k]["xxh3_128"], f.result())
        facts.finish()
        store = RowStore(parts)
        ring, tmp = job.chunk_ring(self.budget)
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

        with progress_bar(len(todo), f"epoch {plan.epoch}: write", job.show_progress, unit="shard") as write_bar:
            for i in todo:
                job.write_shard(i, blocks(i))
                write_bar.update(1)


def source_rows(src: PackedSource, offset: int, windows: int, row_tokens: int, on_shard=None) -> Iterator[np.ndarray]:
    """Windows [0, windows) of a source starting at token `offset`, as np.void row arrays in
    window order, each yielded once read: a mapped view per shard for the windows inside it,
    and a small copy for each window that crosses a shard boundary. Every shard is mapped
    whole and handed to `on_shard(k, bytes)` once read (to verify it)."""
    ts = src.dtype.itemsize
    void = np.dtype((np.void, row_tokens * ts))
    w = 0
    for k, shard in enumerate(src.shards):
        t0, t1 = int(src.shard_starts[k]), int(src.shard_starts[k + 1])
        while w < windows and offset + w * row_tokens < t0:  # starts in an earlier shard, crosses into this one
            row = np.empty(row_tokens, dtype=src.dtype)
            src.read_into(offset + w * row_tokens, row)
            yield row.view(void)
            w += 1
        first = w
        last = min(windows, max(first, (t1 - offset) // row_tokens))  # windows that end inside this shard
        whole = map_file(src.path / shard["path"], 0, (t1 - t0) * ts)
        if on_shard is not None:
            on_shard(k, whole)
        if last > first:
            start = (offset + first * row_tokens - t0) * ts
            yield whole[start : start + (last - first) * row_tokens * ts].view(void)
            w = last
    if w != windows:
        raise TokpackError("internal error: source windows", file=src.path, expected=windows, found=w)


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

    def input_segments(self, plan: EpochPlan, sources: list[PackedSource], t: int) -> list[tuple[int, int, int, int, int]]:
        """Task t's input: (source, first window, end window, first shard, end shard) per run of
        whole shards. A task takes the windows that start in its shards, so each shard is read
        in full, and verified, by exactly one task."""
        out = []
        for s, k0, k1 in self.task_shards[t]:
            sp, starts = plan.sources[s], sources[s].shard_starts
            first, end = (max(0, min(sp.windows, -(-(int(starts[k]) - sp.offset) // plan.row_tokens))) for k in (k0, k1))
            out.append((s, first, end, k0, k1))
        return out

    def task_dir(self, t: int) -> Path:
        return Path(self.dir) / f"scatter-{t:05d}"

    def task_done(self, t: int) -> Path:
        return Path(self.dir) / f"scatter-{t:05d}.json"

    def holds_rows_of(self, i: int, row_bytes: int) -> bool:
        """Whether the bucket files still hold every row of output shard i (the order pass
        deletes them once the shard is written)."""
        for b in range(int(self.shard_buckets[i]), int(self.shard_buckets[i + 1])):
            files = [self.task_dir(t) / f"b{b:07d}.rows" for t in range(self.tasks)]
            held = sum(os.path.getsize(f) for f in files if f.exists())
            if held != int(self.bucket_starts[b + 1] - self.bucket_starts[b]) * row_bytes:
                return False
        return True


def make_layout(job: EpochJob, budget: int, tasks: int) -> Layout:
    """Buckets as large as the per-task budget allows (fewer buckets = larger scatter writes)."""
    rb, chunks = job.row_bytes, CHUNKS_IN_BUDGET * job.chunk_rows(budget) * job.row_bytes
    bucket_rows = max(1, (budget - chunks) // (rb + ORDER_ROW_OVERHEAD))
    block_rows = max(1, min(MAX_BLOCK_BYTES // rb, budget // (4 * rb + SCATTER_ROW_OVERHEAD)))
    starts, firsts = [], []
    for i in range(job.n_shards):
        g0, g1 = job.shard_range(i)
        nb = -(-(g1 - g0) // bucket_rows)
        firsts.append(len(starts))
        starts.extend(g0 + (j * (g1 - g0)) // nb for j in range(nb))
    firsts.append(len(starts))
    starts.append(job.plan.samples)
    bucket_starts = np.array(starts, dtype=np.int64)
    task_shards = split_shards(job.plan, job.open_sources(), tasks)
    key = xxhash.xxh3_64_hexdigest(f"{len(task_shards)}|{block_rows}|{task_shards}|".encode() + bucket_starts.tobytes())
    return Layout(len(task_shards), bucket_starts, np.array(firsts, dtype=np.int64), block_rows,
                  str(Path(job.work_dir) / f"ooc-{key}"), task_shards)


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


class ScatterStep(_Step):
    """Task t reads its input range sequentially and appends rows + output positions to the
    files of their buckets: scatter-TTTTT/bBBBBBB.rows and .pos (int64 g per row)."""

    name = "shuffle scatter"

    def __init__(self, job: EpochJob, layout: Layout):
        super().__init__(job)
        self.layout = layout

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        for t in range(rank, self.layout.tasks, world_size):
            self.scatter(t)

    def scatter(self, t: int) -> None:
        job, plan, lay = self.job, self.job.plan, self.layout
        done = lay.task_done(t)
        if done.exists():
            return
        release("inverse")
        tdir = lay.task_dir(t)
        shutil.rmtree(tdir, ignore_errors=True)
        tdir.mkdir(parents=True)
        sources = job.open_sources()
        segments = lay.input_segments(plan, sources, t)
        rows_in = max(1, min(lay.block_rows, max([b - a for _, a, b, _, _ in segments], default=1)))
        # Two input buffers (a thread reads one block ahead) and two output buffers (the disk
        # thread appends one to the bucket files while this thread sorts the next block).
        inbufs = [reused(f"scatter-in{j}", rows_in * job.row_bytes).view(job.token_dtype) for j in range(2)]
        outbufs = [reused(f"scatter-out{j}", rows_in * job.row_bytes).view(job.row_void) for j in range(2)]
        counts: dict[int, int] = {}  # rows written per bucket
        files: dict[int, tuple] = {}  # open (rows, pos) files per bucket; used by the disk thread only
        # xxh3_64 of each bucket's (rows, pos) file as written, recorded in the done JSON and
        # checked by the order pass: a file a crash cut short or garbled is caught without an
        # fsync of every bucket file (which the done JSON, fsync'd, would otherwise have to wait for).
        hashes: dict[int, tuple] = {}
        scatter_bar = self.bar(sum(int(src.tokens) * src.dtype.itemsize for s, src in enumerate(sources)
                                   if plan.sources[s].samples), f"epoch {plan.epoch}: scatter")

        def append(out: np.ndarray, g: np.ndarray, runs: list[tuple[int, int, int]]) -> None:
            for b, x, y in runs:
                if b not in files:
                    if len(files) >= MAX_OPEN_BUCKET_FILES:
                        for fr, fp in files.values():
                            fr.close()
                            fp.close()
                        files.clear()
                    files[b] = (open(tdir / f"b{b:07d}.rows", "ab"), open(tdir / f"b{b:07d}.pos", "ab"))
                    hashes.setdefault(b, (xxhash.xxh3_64(), xxhash.xxh3_64()))
                rows_bytes, pos_bytes = memoryview(out[x:y]).cast("B"), g[x:y].astype("<i8").tobytes()
                files[b][0].write(rows_bytes)
                files[b][1].write(pos_bytes)
                hashes[b][0].update(rows_bytes)
                hashes[b][1].update(pos_bytes)

        pending: deque = deque()  # appends submitted, oldest first
        used = 0  # output buffers filled so far
        try:
            with ThreadPoolExecutor(1) as disk:
                for s, w0, w1, k0, k1 in segments:
                    shards = ShardHashes(sources[s], k0, k1, job.source_changed)
                    for a, block in iter_source_windows(plan, s, sources[s], w0=w0, w1=w1, bufs=inbufs,
                                                        on_read=shards.feed):
                        scatter_bar.update(block.nbytes)
                        rows = block.reshape(-1).view(job.row_void)
                        windows = np.arange(a, a + len(rows), dtype=np.int64)
                        for _, sel, g in plan.outputs_of(s, windows):
                            bucket = np.searchsorted(lay.bucket_starts, g, side="right") - 1
                            order = np.argsort(bucket, kind="stable")
                            m = len(order)
                            while len(pending) >= len(outbufs):  # frees the buffer used two appends ago
                                pending.popleft().result()
                            out = outbufs[used % len(outbufs)]
                            used += 1
                            np.take(rows, sel[order], out=out[:m], mode="clip")
                            g, bucket = g[order], bucket[order]
                            cuts = np.flatnonzero(np.diff(bucket)) + 1
                            runs = [(int(bucket[x]), x, y) for x, y in zip([0, *cuts.tolist()], [*cuts.tolist(), m])]
                            for b, x, y in runs:
                                counts[b] = counts.get(b, 0) + (y - x)
                            pending.append(disk.submit(append, out, g, runs))
                    shards.finish()
                while pending:
                    pending.popleft().result()
        finally:
            for fr, fp in files.values():
                fr.close()
                fp.close()
        record = {"task": t, "rows": {str(k): v for k, v in sorted(counts.items())},
                  "xxh3_64": {str(k): [h.hexdigest() for h in hs] for k, hs in sorted(hashes.items())}}
        write_bytes_atomic(done, json.dumps(record).encode(), fsync=True)


class OrderStep(_Step):
    """Task i writes output shard i: each of its buckets is loaded, placed by g, written."""

    name = "shuffle order"

    def __init__(self, job: EpochJob, layout: Layout, budget: int):
        super().__init__(job)
        self.layout = layout
        self.budget = budget

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        for i in range(rank, self.job.n_shards, world_size):
            self.order(i)

    def _buckets(self, i: int) -> range:
        return range(int(self.layout.shard_buckets[i]), int(self.layout.shard_buckets[i + 1]))

    def order(self, i: int) -> None:
        job, lay = self.job, self.layout
        if job.shard_done(i) is None:
            release("scatter-in0", "scatter-in1", "scatter-out0", "scatter-out1")
            buckets = self._buckets(i)
            cap = max(int(np.diff(lay.bucket_starts[buckets.start: buckets.stop + 1]).max()), 1)
            inv = reused("inverse", cap * 8).view(np.int64)
            ramp = np.arange(cap, dtype=np.int64)
            ring, tmp = job.chunk_ring(self.budget)
            job.write_shard(i, self._blocks(i, inv, ramp, ring, tmp))
        for b in self._buckets(i):  # the shard is safe: its bucket files are no longer needed
            for t in range(lay.tasks):
                for ext in ("rows", "pos"):
                    (lay.task_dir(t) / f"b{b:07d}.{ext}").unlink(missing_ok=True)

    def _blocks(self, i, inv, ramp, ring, tmp):
        """Each bucket's files are mapped (no copy into fresh memory), placed by g through the
        inverse permutation `inv`, and gathered in output order chunk by chunk."""
        job, lay = self.job, self.layout
        count = 0  # chunks yielded: picks the ring buffer
        recorded = [json.loads(lay.task_done(t).read_text()).get("xxh3_64", {}) for t in range(lay.tasks)]
        order_bar = self.bar(job.plan.samples * job.row_bytes, f"epoch {job.plan.epoch}: order")
        for b in self._buckets(i):
            start, n = int(lay.bucket_starts[b]), int(lay.bucket_starts[b + 1] - lay.bucket_starts[b])
            parts, positions = [], []
            for t in range(lay.tasks):
                f = lay.task_dir(t) / f"b{b:07d}.rows"
                if f.exists():
                    k = os.path.getsize(f) // job.row_bytes
                    rows = map_file(f, 0, os.path.getsize(f))
                    pos = map_file(f.with_suffix(".pos"), 0, os.path.getsize(f.with_suffix(".pos")))
                    self._check_bucket(t, f, [rows, pos], recorded[t].get(str(b), [None, None]))
                    parts.append(rows[: k * job.row_bytes].view(job.row_void))
                    positions.append(pos[: k * 8].view("<i8"))
                    del rows, pos  # the maps must go with `parts` below, before the next bucket is mapped
            store = RowStore(parts)
            if len(store) != n:
                raise TokpackError("scatter files do not cover their bucket", file=lay.dir, where=f"bucket {b}",
                                   expected=f"{n} rows", found=f"{len(store)} rows",
                                   hint="delete OUT/.tokpack-work and rerun")
            inv[:n] = -1
            for pos, first in zip(positions, store.starts.tolist()):
                local = pos - start
                if len(local) and (local.min() < 0 or local.max() >= n):
                    raise TokpackError("scatter file holds a row of another bucket", file=lay.dir, where=f"bucket {b}",
                                       hint="delete OUT/.tokpack-work and rerun")
                inv[local] = ramp[first: first + len(local)]
            if n and inv[:n].min() < 0:
                raise TokpackError("scatter files hold a position twice", file=lay.dir, where=f"bucket {b}",
                                   hint="delete OUT/.tokpack-work and rerun")
            for a in range(0, n, len(tmp)):
                c = min(n, a + len(tmp))
                yield store.gather(inv[a:c], ring[count % len(ring)], tmp)
                order_bar.update((c - a) * job.row_bytes)
                count += 1
            del store, parts, positions

    def _check_bucket(self, t: int, rows_file: Path, data: list[np.ndarray], expected: list) -> None:
        """The bucket's files must be the bytes scatter task t wrote. If not (a crash after the
        task's done JSON reached the disk but before its buffered bucket files did), that task
        is redone on the next run."""
        for f, d, want in zip((rows_file, rows_file.with_suffix(".pos")), data, expected):
            found = xxhash.xxh3_64_hexdigest(d)
            if found != want:
                self.layout.task_done(t).unlink(missing_ok=True)
                raise TokpackError("scatter bucket file does not match the checksum its task recorded", file=f,
                                   where="xxh3_64", expected=want, found=found,
                                   hint="rerun the same command: the scatter task that wrote it runs again")


def source_changed_error(record: dict) -> TokpackError:
    return TokpackError("source shard changed since it was packed; no epoch written", file=record["shard"],
                        where="xxh3_128", expected=record["expected"], found=record["found"],
                        hint="re-pack the source, or restore the file it was packed as")


# ---------------------------------------------------------------------- the run


def _ranks_here(step, tasks: int, job_name: str, logging_dir) -> None:
    """Every rank in turn, here: the runner for callers that pass none (packer passes its own)."""
    for rank in range(tasks):
        try:
            step.run(None, rank, tasks)
        except OSError as e:
            raise task_failed(job_name, rank, tasks, e) from e


def open_sources(paths: list[str]) -> list[PackedSource]:
    sources = [PackedSource.open(p) for p in paths]
    first = sources[0]
    for src in sources[1:]:
        for field in ("dtype", "vocab_size", "eos_id"):
            if src.manifest.get(field) != first.manifest.get(field):
                raise TokpackError(
                    "sources disagree", file=src.path, where=field,
                    expected=f"{first.manifest.get(field)} (as in {first.path})", found=src.manifest.get(field),
                    hint="mix only sources packed with the same tokenizer and dtype")
    seen: dict = {}
    for src in sources:  # every window would appear twice, and epochs could not tell the copies apart
        for key in (("path", src.path.resolve()), ("fingerprint", src.fingerprint)):
            if key in seen:
                raise TokpackError("the same source is given twice", file=src.path, where="SOURCE",
                                   expected="each source once", found=f"the same {key[0]} as {seen[key]}",
                                   hint="give each source once; to draw more from it, raise its weight")
            seen[key] = src.path
    return sources


def min_memory(row_bytes: int, workers: int) -> int:
    """The smallest --memory that gives each worker's buckets MIN_BUCKET_ROWS rows (the chunk
    ring takes at most half of a task's budget, see make_layout)."""
    return workers * 2 * MIN_BUCKET_ROWS * (row_bytes + ORDER_ROW_OVERHEAD)


def _weights_key(weights: list[str | None]) -> list[str] | None:
    """Weights as exact shares of their sum: only the ratios decide an epoch, so 7/3 and
    0.7/0.3 are the same run."""
    if all(w is None for w in weights):
        return None
    fr = [parse_weight(w, "weight") if w is not None else None for w in weights]
    total = sum(f for f in fr if f is not None)
    return [None if f is None else str(f / total if total else f) for f in fr]


def _run_params(plan: EpochPlan, weights, shard_samples: int) -> dict:
    """What must match for two invocations to belong to the same run."""
    return {
        "fingerprints": [sp.fingerprint for sp in plan.sources],
        "weights": _weights_key(weights),
        "seq_len": plan.seq_len,
        "seed": plan.seed,
        "jitter": plan.jitter,
        "samples": plan.samples,
        "shard_samples": shard_samples,
    }


def _params_of_manifest(m: dict) -> dict:
    ws = m.get("weights") if m.get("kind") == "run" else [s.get("weight") for s in m.get("sources", [])]
    ws = ws if ws is not None else [None] * len(m.get("sources", []))
    return {
        "fingerprints": [s.get("fingerprint") for s in m.get("sources", [])],
        "weights": _weights_key(ws),
        "given_weights": ws,  # as the run wrote them
        "seq_len": m.get("seq_len"),
        "seed": m.get("seed"),
        "jitter": bool(m.get("jitter")),
        "samples": m.get("samples"),
        "shard_samples": m.get("shard_samples"),
    }


def _check_same_run(found: dict, wanted: dict, where: Path) -> None:
    for key in ("fingerprints", "weights", "seq_len", "seed", "jitter", "samples", "shard_samples"):
        if found[key] != wanted[key]:
            raise TokpackError(
                "output directory holds a different run", file=where, where=key, expected=wanted[key],
                found=found[key], hint="use another -o, delete it, or repeat the run's exact sources, weights, "
                "--seq-len, --seed, --jitter, --samples/--tokens and --shard-samples")


def _existing_run(out: Path) -> dict | None:
    """Parameters of the run already in OUT (run manifest, else any complete epoch), or None."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise TokpackError("output is not a directory", file=out)
    if (out / MANIFEST).exists():
        return _params_of_manifest(read_manifest(out, kind="run"))
    foreign = [p.name for p in out.iterdir()
               if not (p.name.startswith("epoch-") or p.name in (WORK_DIR, LOCK_NAME) or TMP_MARK in p.name)]
    if foreign:
        raise TokpackError("output directory is not a tokpack run", file=out, where="contents",
                           expected="no files, or a run's tokpack.json and epoch-NNNNN/", found=", ".join(sorted(foreign)[:5]),
                           hint="choose an empty or new -o directory")
    for p in sorted(out.glob("epoch-*/" + MANIFEST)):
        return _params_of_manifest(read_manifest(p.parent, kind="epoch"))
    return None


def _run_manifest(out: Path, plan: EpochPlan, weights, sources: list[PackedSource], shard_samples: int,
                  epochs: list[int]) -> dict:
    first = sources[0].manifest
    written = {e: read_manifest(out / epoch_dir_name(e), kind="epoch") for e in epochs
               if (out / epoch_dir_name(e) / MANIFEST).exists()}
    return run_manifest(
        written, sources[0].dtype, first["vocab_size"], first["eos_id"], first.get("tokenizer", ""),
        sources=plan.source_entries(), weights=None if all(w is None for w in weights) else list(weights),
        seq_len=plan.seq_len, seed=plan.seed, jitter=plan.jitter, samples=plan.samples, shard_samples=shard_samples,
        shuffle=PLAN_ALGORITHM)


def _memory_path(job: EpochJob, memory: int) -> tuple[int, bool]:
    """(bytes of the windows to hold, whether they fit `memory` so the epoch runs in memory)."""
    needed = sum(sp.windows for sp in job.plan.sources if sp.samples) * (job.row_bytes + ROW_FACTS_BYTES)
    return needed, needed + CHUNKS_IN_BUDGET * job.chunk_rows(memory) * job.row_bytes <= memory


def _bytes_to_write(jobs: list[EpochJob], sources: list[PackedSource], memory: int) -> int:
    """Peak bytes on OUT's filesystem while these epochs are written, less what a resumed run has
    there already: the epochs written before, then this epoch's shards with, out of core, its
    bucket scratch (every output row and its 8-byte position), of which the order pass deletes
    each shard's part once the shard is written: the peak is the scratch plus the first shard."""
    docs_per_token = sum(int(s.manifest.get("documents", 0)) for s in sources) / max(
        1, sum(int(s.manifest.get("tokens", 0)) for s in sources))
    peak = written = 0
    for job in jobs:
        rows = job.plan.samples
        # .ds rows, plus an 8-byte index entry per fragment: a sample is cut at each document end
        epoch = rows * job.row_bytes + 8 * int(rows * (1 + docs_per_token * job.plan.row_tokens))
        have = bytes_under(job.epoch_dir) + bytes_under(job.work_dir)
        during = epoch
        if not _memory_path(job, memory)[1]:
            during = rows * (job.row_bytes + 8) + epoch * min(1, job.shard_samples / max(rows, 1))
        peak = max(peak, written + max(0, during - have))
        written += max(0, epoch - have)
    return int(max(peak, written))


@contextlib.contextmanager
def _source_check(job: EpochJob, layout: Layout | None):
    """A task that found a changed source shard left a marker: whatever the executor made of
    the task's failure, the user gets the marker's one line, and the scatter output that came
    from the changed source is deleted."""
    try:
        yield
    except BaseException:
        marker = job.source_changed_path
        if not marker.exists():
            raise
        record = json.loads(marker.read_text())
        marker.unlink()
        if layout is not None:
            shutil.rmtree(layout.dir, ignore_errors=True)
        work, edir = Path(job.work_dir), Path(job.epoch_dir)
        if not any(work.glob("done/*.json")):  # nothing an earlier attempt finished: leave no trace
            shutil.rmtree(work, ignore_errors=True)
        for d in (edir, work.parent):
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        raise source_changed_error(record) from None


def run_epoch(job: EpochJob, *, memory: int, workers: int, tasks: int | None, run_passes, log) -> dict:
    """Writes one epoch directory (all shards, then its manifest). Returns a summary."""
    plan = job.plan
    work = Path(job.work_dir)
    Path(job.epoch_dir).mkdir(parents=True, exist_ok=True)
    remove_tmp_files(job.epoch_dir)
    # A fresh name per invocation: our own done files decide what is skipped, so datatrove's
    # completion markers from an earlier attempt (maybe with another layout) must never match.
    attempt = uuid.uuid4().hex[:8]
    logs = work / "logs" / attempt
    needed, in_memory = _memory_path(job, memory)
    name = f"{epoch_dir_name(plan.epoch)}-{attempt}"
    job.source_changed_path.unlink(missing_ok=True)  # an earlier attempt's: this one reads the sources again
    shards_left = [i for i in range(job.n_shards) if job.shard_done(i) is None]
    try:
        layout = None
        if not shards_left:  # a rerun after every shard finished: only the manifest is missing
            if log:
                log(f"epoch {plan.epoch}: all {job.n_shards} shards already written; writing the manifest")
        elif in_memory:
            if log:
                log(f"epoch {plan.epoch}: {plan.samples} samples, in memory ({needed / 2**20:.1f} MiB of windows)")
            with _source_check(job, None):
                run_passes([(InMemoryStep(job, memory), 1, f"{name}-inmemory", str(logs / "inmemory"))])
        else:
            budget = max(1, memory // workers)
            layout = make_layout(job, budget, tasks or workers)
            if log:
                log(f"epoch {plan.epoch}: {plan.samples} samples, out of core ({needed / 2**20:.1f} MiB of windows, "
                    f"{layout.tasks} scatter tasks, {len(layout.bucket_starts) - 1} buckets, {job.n_shards} shards)")
            passes = [(ScatterStep(job, layout), layout.tasks, f"{name}-scatter", str(logs / "scatter")),
                      (OrderStep(job, layout, budget), job.n_shards, f"{name}-order", str(logs / "order"))]
            if all(layout.task_done(t).exists() for t in range(layout.tasks)):
                if all(layout.holds_rows_of(i, job.row_bytes) for i in shards_left):
                    passes = passes[1:]  # a rerun after the scatter pass finished: no array of no-op tasks
                    if log:
                        log(f"epoch {plan.epoch}: scatter pass already done; {len(shards_left)} shards left to order")
                else:  # a written shard was lost after its bucket files went: scatter again
                    shutil.rmtree(layout.dir)
            try:
                with _source_check(job, layout):
                    run_passes(passes)  # on Slurm both passes are queued at once, order after scatter
            finally:
                for step, *_ in passes:
                    step.close_bar()
    except BaseException as e:
        if not is_no_space(e):
            raise
        # Out of space: the bucket scratch and any half-written shard go, so the disk is not left
        # full; the finished shards (and their done markers) stay for the rerun.
        for d in work.glob("ooc-*"):
            shutil.rmtree(d, ignore_errors=True)
        remove_tmp_files(job.epoch_dir)
        raise TokpackError(f"disk full while writing epoch {plan.epoch}; its scratch files were removed",
                           file=job.epoch_dir, expected="free space", found="No space left on device",
                           hint="free some space (or choose another -o), then rerun the same command; "
                           "finished shards are kept") from e
    entries = []
    for i in range(job.n_shards):
        done = job.done_path(i)
        if not done.exists():
            raise TokpackError("output shard did not complete", file=Path(job.epoch_dir) / job.shard_file(i),
                               hint="rerun the same command; completed shards are kept")
        entries.append(json.loads(done.read_text()))
    keep = {e["path"] + ext for e in entries for ext in ("", ".index", ".metadata")}
    for p in Path(job.epoch_dir).iterdir():  # leftovers of an earlier, different attempt
        if p.is_file() and p.name not in keep:
            p.unlink()
    sources = job.open_sources()
    manifest = epoch_manifest(
        entries, job.token_dtype, sources[0].vocab_size, job.eos_id, job.tokenizer, tokens=plan.samples * plan.row_tokens,
        epoch=plan.epoch, seed=plan.seed, seq_len=plan.seq_len, samples=plan.samples, shard_samples=job.shard_samples,
        dropped_tokens=plan.dropped_tokens(), jitter=plan.jitter, sources=plan.source_entries(), shuffle=PLAN_ALGORITHM)
    write_manifest(job.epoch_dir, manifest)
    shutil.rmtree(work, ignore_errors=True)
    return {"epoch": plan.epoch, "path": "in-memory" if in_memory else "out-of-core", "samples": plan.samples,
            "shards": job.n_shards, "sample_multiset_hash": manifest["sample_multiset_hash"]}


@locked_output("shuffle")
def shuffle_run(
    sources: list[str],
    output: str,
    *,
    weights: list[str | None] | None = None,
    seq_len: int,
    seed: int,
    epochs: list[int],
    samples: int | None = None,
    tokens: int | None = None,
    shard_samples: int | None = None,
    memory: int = 4 << 30,
    jitter: bool = False,
    log=None,
    workers: int = 1,
    tasks: int | None = None,
    run_passes=None,
    progress: bool | None = None,
) -> dict:
    """Writes OUT/epoch-NNNNN/ for each epoch (skipping complete identical ones) and the run
    manifest. `memory` is the total budget: the out-of-core path gives each of `workers`
    concurrent tasks memory // workers. `progress`: tqdm bars on stderr (default: when it is a
    terminal and TOKPACK_PROGRESS is not 0). `weights`: one per source, as given ("0.25", "1/3"),
    or None. `run_passes([(step, tasks, job_name, logging_dir), ...])` runs dependent passes in
    order (default: here, in this process). Returns a summary dict, with per-source counts of
    every epoch written and a warning per source an epoch repeats windows of (packer.api.shuffle
    takes URLs and returns it as a ShuffleResult)."""
    t0 = time.perf_counter()
    run_passes = run_passes or (lambda passes: [_ranks_here(*p) for p in passes])
    if progress is None:
        progress = sys.stderr.isatty() and os.environ.get("TOKPACK_PROGRESS", "1") != "0"
    paths, weights = list(sources), list(weights or [None] * len(sources))
    opened = open_sources(paths)
    out = Path(output)
    first = opened[0].manifest
    dtype = dtype_name(opened[0].dtype)
    row_bytes = (seq_len + 1) * opened[0].dtype.itemsize
    floor = min_memory(row_bytes, workers)
    if memory < floor:  # one bucket per handful of samples: hours of per-bucket overhead
        raise TokpackError("--memory is too small to shuffle", where="--memory", expected=f">= {floor} bytes",
                           found=f"{memory} bytes", hint=f"give --memory {floor} or more ({MIN_BUCKET_ROWS} samples "
                           f"of {row_bytes} bytes per bucket, per worker); more memory is faster")
    existing = _existing_run(out)
    if (existing is not None and existing.get("given_weights") is not None
            and existing["fingerprints"] == [src.fingerprint for src in opened]
            and existing["weights"] == _weights_key(weights)):
        weights = list(existing["given_weights"])  # equal as ratios: the run's manifests keep one spelling
    if shard_samples is None:
        shard_samples = existing["shard_samples"] if existing else max(1, DEFAULT_SHARD_BYTES // row_bytes)
    names = [Path(p).resolve().name for p in paths]
    done_epochs, skipped, summaries = [], [], []
    if (out / MANIFEST).exists():
        done_epochs = list(read_manifest(out, kind="run")["epochs"])
    todo = []  # (epoch, plan, job or None when the epoch is complete already): planned before any write
    for epoch in epochs:
        plan = epoch_plan(opened, seq_len=seq_len, seed=seed, epoch=epoch, weights=weights, samples=samples,
                          tokens=tokens, jitter=jitter, names=names)
        plan = _resolved_paths(plan)
        params = _run_params(plan, weights, shard_samples)
        if existing is not None:
            _check_same_run(existing, params, out)
        existing = params
        edir = out / epoch_dir_name(epoch)
        job = None
        if (edir / MANIFEST).exists():
            m = read_manifest(edir, kind="epoch")
            _check_same_run(_params_of_manifest(m), params, edir)
            if _content(m.get("sources")) != _content(plan.source_entries()):
                raise TokpackError("epoch directory holds a different epoch", file=edir, where="sources",
                                   hint="delete that epoch directory or use another -o")
        else:
            key = xxhash.xxh3_64_hexdigest(json.dumps([params, plan.source_entries(), PLAN_ALGORITHM, dtype]).encode())
            job = EpochJob(plan, tuple(str(Path(p).resolve()) for p in paths), dtype, int(first["eos_id"]),
                           first.get("tokenizer", ""), str(edir), str(out / WORK_DIR / f"{edir.name}-{key}"),
                           shard_samples, progress=bool(progress), main_pid=os.getpid())
        todo.append((epoch, plan, job))
    check_space([(out, _bytes_to_write([j for _, _, j in todo if j], opened, memory))], "shuffle",
                hint="free some space there, choose another -o, or write fewer epochs per command (--epoch E)")
    for epoch, plan, job in todo:
        out.mkdir(parents=True, exist_ok=True)
        if job is None:
            skipped.append(epoch)
            # A kill while the finished epoch's scratch was being removed leaves part of it.
            for stale in (out / WORK_DIR).glob(f"{epoch_dir_name(epoch)}-*"):
                shutil.rmtree(stale, ignore_errors=True)
            if log:
                log(f"epoch {epoch}: already complete, skipped")
        else:
            summary = run_epoch(job, memory=memory, workers=workers, tasks=tasks, run_passes=run_passes, log=log)
            summary["sources"] = plan.source_report()
            summaries.append(summary)
        done_epochs = sorted(set(done_epochs) | {epoch})
        write_manifest(out, _run_manifest(out, plan, weights, opened, shard_samples, done_epochs))
    work = out / WORK_DIR
    if work.exists() and not any(work.iterdir()):
        work.rmdir()
    return {
        "output": str(out),
        "epochs": done_epochs,
        "written": [s["epoch"] for s in summaries],
        "skipped": skipped,
        "samples_per_epoch": existing["samples"] if existing else 0,
        "seq_len": seq_len,
        "shard_samples": shard_samples,
        "path": ",".join(sorted({s["path"] for s in summaries})) or "none",
        "seconds": round(time.perf_counter() - t0, 3),
        "epochs_detail": summaries,
        "warnings": [w for summary in summaries for w in repeat_warnings(summary["epoch"], summary["sources"])],
    }


def repeat_warnings(epoch: int, report: list[dict]) -> list[str]:
    """One line per source whose windows this epoch holds more than once."""
    lines = []
    for r in report:
        if not r["repeats"]:
            continue
        span = f"pass {r['first_pass']}" if r["passes"] == 1 else f"passes {r['first_pass']}-{r['first_pass'] + r['passes'] - 1}"
        why = ("it has fewer windows than its share of the epoch; lower its weight or --samples/--tokens, or add data"
               if r["samples"] > r["windows"] else "the epoch ends one pass over it and starts the next, and the "
               "two passes' orders differ; epochs that are whole passes (no --samples/--tokens/weights) never repeat")
        lines.append(f"epoch {epoch}: source {r['name']} ({r['path']}) is used more than once: {r['repeats']} of its "
                     f"{r['samples']} samples repeat a window ({r['windows']} windows, {span}). HINT: {why}")
    return lines


def _content(entries) -> list[dict]:
    """Source entries without where the sources lay: moving a source does not change an epoch."""
    return [{k: v for k, v in e.items() if k not in ("path", "name")} for e in entries or []]


def _resolved_paths(plan: EpochPlan) -> EpochPlan:
    from dataclasses import replace

    return replace(plan, sources=tuple(replace(sp, path=str(Path(sp.path).resolve())) for sp in plan.sources))
