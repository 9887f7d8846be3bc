"""One epoch's job and the base of the passes that write it (tokpack.shuffle.steps, and best-fit's
tokpack.shuffle.packed_step): EpochJob holds everything a task needs and writes a shard through
the Output's writer (EpochJob.write_shard, the one place an epoch shard is written); Step is a
datatrove pass over it; RowStore and ShardHashes are the rows a task holds and the checksums of
the source shards it reads.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import xxhash

from tokpack.formats.errors import TokpackError
from tokpack.formats.io.gate import IO_BLOCK, read_record
from tokpack.formats.io.reads import Worker
from tokpack.formats.io.memory import lent
from tokpack.formats.io.progress_log import progress
from tokpack.formats.io.writes import write_bytes_atomic
from tokpack.formats.names import dtype_from_name, shard_digits, shard_name
from tokpack.formats.outputs import EpochShardFormat, LocalOutput, Output, ShardPlace
from tokpack.formats.shards import PackedSource

from .plan import EpochPlan
from .sources import open_source
from .sinks import app_sinks_kept

# Importing datatrove's logging module removes every loguru sink; the application's must stay.
with app_sinks_kept():
    import datatrove.utils.logging  # noqa: F401
    from datatrove.pipeline.base import PipelineStep

MAX_CHUNK_BYTES = 8 << 20  # rows gathered and written per call: big enough for sequential I/O
RING = 4  # chunk buffers: one being gathered while up to RING-1 are indexed or written
CHUNKS_IN_BUDGET = RING + 3  # the ring, the gather scratch and the shard writer's temporaries
SOURCE_CHANGED = "source-changed.json"  # in the epoch's work folder: a task found a source shard edited since pack


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
        data = tokens.reshape(-1)[max(0, self.pos - start) :]
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
    progress: bool = False  # bars (lines in a log), shown only by tasks running in the process that asked for them
    main_pid: int = 0  # that process
    output: Output = LocalOutput()  # where the shards go (tokpack.formats.outputs): a folder, a bucket

    @property
    def show_progress(self) -> bool | None:
        """progress()'s `enabled`: None (a bar, or lines in a log) in the process that asked, else False."""
        return None if self.progress and os.getpid() == self.main_pid else False

    def bar(self, total: int, desc: str, unit: str = "B", **options):
        """A bar of one phase of the epoch (a pass, a step of its table), shown as show_progress says:
        a phase, so that a log names it, not the one before it, as soon as it begins."""
        return progress(total, desc, unit=unit, enabled=self.show_progress, phase=True, **options)

    def write_shards(self, todo: list[int], shard) -> None:
        """An in-memory path's shards `todo`, in order, under one bar: shard i written from
        `shard(i)`, its blocks and its padding (write_shard's)."""
        desc, shard_bytes = f"epoch {self.plan.epoch}: write", self.shard_samples * self.row_bytes
        with self.bar(len(todo), desc, "shard", unit_bytes=shard_bytes) as bar:
            for i in todo:
                self.write_shard(i, *shard(i))
                bar.update(1)

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

    def check_source_shard(self, src: PackedSource, k: int, found: str) -> None:
        """Source shard k of `src` read whole hashed to `found` (xxh3_128): source_changed unless
        it is what `pack` recorded."""
        shard = src.shards[k]
        if found != shard["xxh3_128"]:
            self.source_changed(src.path / shard["path"], shard["xxh3_128"], found)

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
        """The sources, as the plan's windows are cut from them: a window plan with --holdout
        reads each source's stream of the documents it keeps (EpochPlan.stream)."""
        opened = [open_source(p, check_sizes=False) for p in self.source_paths]
        stream = getattr(self.plan, "stream", None)
        return opened if stream is None else [stream(s, src) for s, src in enumerate(opened)]

    def done_entry(self, i: int) -> dict | None:
        """The manifest entry recorded when shard i was committed (and sent, to a bucket)."""
        return read_record(self.done_path(i))  # a damaged record: the shard is written again

    def shard_done(self, i: int) -> dict | None:
        """The shard's manifest entry if it was committed and recorded and is still there."""
        entry = self.done_entry(i)
        return (
            entry if entry is not None and self.output.has(self.epoch_dir, entry, self.token_dtype.itemsize) else None
        )

    def write_shard(self, i: int, blocks, pad: np.ndarray | None = None) -> dict:
        """Writes shard i from `blocks` (an iterator, in output order, of np.void row arrays, or
        of (rows, RowFragments, their store rows) when the rows' index is known already) through
        the Output's writer, which commits every file and records it as done. `pad`: a best-fit
        epoch's padding per row (read only after the last block), for the `.pad` sidecar."""
        g0, g1 = self.shard_range(i)
        fmt = EpochShardFormat(self.token_dtype, self.plan.seq_len, self.eos_id, self.tokenizer, padded=pad is not None)
        place = ShardPlace(
            self.epoch_dir,
            self.shard_file(i),
            i,
            epoch=self.plan.epoch,
            samples=(g0, g1),
            record=str(self.done_path(i)),
        )
        writer = self.output.open_shard(place, fmt)
        try:
            # Three stages overlap: gathering chunk c (here), indexing and hashing an earlier
            # chunk (CPU) and writing one to disk (I/O), each stage in order. `blocks` fills RING
            # buffers round robin, so at most RING-1 chunks may be in flight.
            with Worker(RING - 1) as disk, Worker(RING - 1) as index:
                for item in blocks:
                    if isinstance(item, tuple):
                        rows, facts, idx = item
                        index.submit(lambda n, f, i: writer.write_known_index(n, *f.of(i)), len(rows), facts, idx)
                    else:
                        rows = item
                        index.submit(writer.write_index, rows)
                    disk.submit(writer.write_tokens, rows)
            if writer.samples != g1 - g0:
                raise TokpackError(
                    "internal error: shard row count", where=f"shard {i}", expected=g1 - g0, found=writer.samples
                )
            if pad is not None:
                writer.write_pad(pad)
            return writer.close()  # its files, then the record (to a bucket: sent in that order)
        except BaseException:
            writer.abort()
            raise

    def chunk_rows(self, budget: int) -> int:
        return max(1, min(MAX_CHUNK_BYTES, budget // (2 * CHUNKS_IN_BUDGET)) // self.row_bytes)

    @contextlib.contextmanager
    def chunk_ring(self, budget: int) -> Iterator[tuple[list[np.ndarray], np.ndarray]]:
        """RING output buffers used round robin, plus one gather scratch buffer, all reused."""
        with lent("chunk", self.chunk_rows(budget) * self.row_bytes, RING + 1) as bufs:
            *ring, tmp = (b.view(self.row_void) for b in bufs)
            yield ring, tmp


class Step(PipelineStep):
    """A pass over one epoch: its tasks share the job, the out-of-core layout (if any) and the
    bytes each task may use beyond the interpreter."""

    type = "tokpack"

    def __init__(self, job: EpochJob, layout=None, budget: int = 0, prepared: dict | None = None):
        # layout: tokpack.shuffle.steps.Layout; prepared: what the packing built first (Packing.prepare)
        super().__init__()
        self.job, self.layout, self.budget, self.prepared = job, layout, budget, prepared
        self._bar = None  # one bar for the whole pass, in the submitting process only

    def __getstate__(self):
        return {**self.__dict__, "_bar": None}

    def bar(self, total: int, desc: str, unit: str = "B"):
        """The pass's bar (EpochJob.bar), opened by its first task here."""
        if self._bar is None:
            self._bar = self.job.bar(total, desc, unit)
        return self._bar

    def close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def source_changed_error(record: dict) -> TokpackError:
    return TokpackError(
        "source shard changed since it was packed; no epoch written",
        file=record["shard"],
        where="xxh3_128",
        expected=record["expected"],
        found=record["found"],
        hint="re-pack the source, or restore the file it was packed as",
    )
