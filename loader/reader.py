"""The training-side reader: rank r of W, micro-batch m, from any sample, in O(1) state.

An epoch directory is a flat array of samples of `seq_len + 1` tokens, cut into shards of
`shard_samples` rows (docs/FORMAT.md). Several epochs (a run's `epochs`, in order, or a
list of epoch directories) are chained into one stream. Sample g of that stream sits at a
byte offset computed from g and a shard table of O(#shards) integers, so the reader never
builds anything that grows with the step count.

In a run directory, g is the run's consumed-sample number: it lies in epoch g div N
(`EpochNumbering`), whichever epochs are written, so writing a missing epoch later never
moves a sample. A list of epoch directories is numbered from 0 in the order given.

Order (Megatron's pretraining sampler): from consumed sample G, global batch b is the
chained samples [G + b*W*m, G + (b+1)*W*m) and rank r takes [r*m, (r+1)*m) of it. The
order of the stream does not depend on W, so resuming with another W (same global batch,
same G) continues the same sequence. Only complete global batches are served: the stream
stops when fewer than W*m samples remain, so every rank stops at the same step; where the
written epochs end, a stream raises the line `tokpack read` prints there (or stops, asked to).

This module holds the opening of a run, the numbering of its samples and the streams; its I/O
is tokpack.loader.shard_files (`ShardFiles`, SampleReader's base) and its batch assembly
tokpack.loader.assembly, whose public names it re-exports.

This module must not import torch (nor datatrove.utils.dataset, which imports it).
"""

from __future__ import annotations

import importlib
import itertools
import numbers
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from tokpack.formats import arguments
from tokpack.formats.arguments import flag, text, tokens, whole
from tokpack.formats.errors import TokpackError
from tokpack.formats.io.paths import as_path, is_url
from tokpack.formats.io.gate import read_limited
from tokpack.formats.constants import EPOCH, MANIFEST, MAX_EPOCHS, NODES_SIDECAR, RUN, RUN_KEYS, SLICE
from tokpack.formats.reading import partial_stage_absent, read_manifest, strict_json
from tokpack.formats.numbering import EpochNumbering, shuffle_command
from tokpack.formats.packing import holdout_recorded
from tokpack.formats.shards import row_segments, tokens_on_nodes
from tokpack.formats.slices import RankRows, contained_epoch_dir, epoch_disagreements, run_digest
from tokpack.formats.units import counted

from .assembly import (  # noqa: F401 -- re-exported: tests, docs and users import them from here
    cu_seqlens,
    document_masks,
    fixed_boundaries,
    micro_batch,
    most_documents,
    positions_from_eos,
    positions_from_starts,
)
from .shard_files import ShardFiles, chain_table, no_such_sample

# One contiguous read when the rank's rows are contiguous (W == 1): large enough to keep a
# disk or NFS busy, small enough not to matter next to a training process.
BLOCK_BYTES = 4 << 20
# How far ahead the kernel is asked to fetch (posix_fadvise WILLNEED) when rows are strided.
READAHEAD_BYTES = 8 << 20
# Tokens a block of `most_documents`'s scan: its position arrays (several bytes a token) stay
# about a MB, within what `tokpack inspect --memory` allows beside its plan.
SCAN_TOKENS = 1 << 16


class StreamState(RankRows):
    """Everything needed to continue a rank's stream: a handful of integers. Its RankRows (which
    samples rank r reads): W ranks of m samples a global batch, from G = `start`, the chained
    samples consumed before this stream began (Megatron's consumed_samples)."""

    def __init__(self, start: int, step: int, rank: int, world_size: int, micro_batch: int, stride: int, end_step: int):
        super().__init__(world_size, micro_batch, start)
        self.step = step  # next global batch b to serve, counted from `start`
        self.rank = rank  # r: this rank takes rows [r*m, (r+1)*m) of every global batch
        self.stride = stride  # steps advance by this (DataLoader workers split a rank's steps round-robin)
        self.end_step = end_step  # first step not served: the chained stream ends, or the caller's count

    def first_sample(self, step: int) -> int:
        """Chained index of this rank's first row in global batch `step`."""
        return self.first(self.rank, step)

    def consumed_after(self, step: int) -> int:
        """consumed_samples once every rank has trained on global batch `step`."""
        return self.first(0, step + 1)


@dataclass
class Sample:
    """One sample as a rank is fed it (for `tokpack read` and tests)."""

    epoch: int  # epoch number
    sample: int  # index of the sample within its epoch
    index: int  # index in the chained stream
    tokens: np.ndarray  # seq_len + 1 tokens
    split: str | None = None  # "holdout": of RUN/holdout/, the held-out split (`epoch`, its manifest's, names no epoch)


def _schedule_end_hint(numbering: EpochNumbering, run_dir=None) -> str:
    """Where a scheduled run's chain ends, and how to train longer (no `shuffle --epoch` can
    write an epoch past its schedule)."""
    k = len(numbering.planned)
    run = "the run's schedule" if run_dir is None else f"the schedule of run {run_dir}"
    return (
        f"{run} plans {k} epoch{'s' * (k != 1)}, ending at sample {numbering.first(k)}: "
        "to train longer, add a stage to the schedule"
    )


# The readers of the directory kinds that are neither a run nor an epoch, by manifest kind: the
# one table SampleReader.open dispatches through (module, class; the class's `open_dir` builds
# it). Each subclasses SampleReader, so this module names it and imports it only when a directory
# of its kind is opened (an import of it here would be a cycle), as tokpack/__init__.py's _PUBLIC
# names the public API: nothing registers itself by being imported.
READERS: dict[str, tuple[str, str]] = {SLICE: ("tokpack.loader.slice_reader", "SliceReader")}


def reader_class(kind: str) -> type:
    """The SampleReader subclass that reads a directory of manifest kind `kind` (a key of READERS)."""
    module, name = READERS[kind]
    return getattr(importlib.import_module(module), name)


class SampleReader(ShardFiles):
    """Sequential reader over chained epoch directories. Open with `SampleReader.open(path)`.
    Its I/O, and the checks of each shard (its size at open, its checksum with `verify=True`): ShardFiles."""

    numbering: EpochNumbering | None = None  # a run's numbering; None: chain order from 0
    run: tuple[str, dict] | None = None  # (run directory, run manifest), for the command hints
    splits: tuple[str | None, ...] = ()  # each chained epoch's: "holdout" for RUN/holdout/, else None

    # ----------------------------------------------------------------- opening

    @classmethod
    def open(cls, path: str | Path | Sequence[str | Path], verify: bool = False) -> "SampleReader":
        """A run directory (its epochs in the order of its manifest's `epochs`), one epoch
        directory, or a list of either, chained in the order given."""
        flag(verify, "verify")
        paths = arguments.paths(path, "path")  # None or an int: one line, not a TypeError from list()
        epochs: list[tuple[Path, dict]] = []
        absent: dict[str, str] = {}
        numbering = run = None
        for p in paths:
            p = as_path(p)
            manifest = read_manifest(p, kind=(RUN, EPOCH, *READERS))
            if manifest["kind"] in READERS:  # a node slice (loader/slice_reader.py): its ranks' rows, the run's numbers
                if len(paths) != 1:
                    raise TokpackError(
                        "a node slice is read on its own, not chained",
                        file=p,
                        where="paths",
                        expected="one slice directory",
                        found=len(paths),
                    )
                return reader_class(manifest["kind"]).open_dir(p, manifest, verify=verify)
            absent.update(partial_stage_absent(p))
            if manifest["kind"] == EPOCH:
                if tokens_on_nodes(p, manifest.get("shards") or []):  # an epoch of such a run: no token file here
                    raise on_nodes_error(p.parent)
                epochs.append((p, manifest))
                continue
            if not is_url(str(p)) and (p / NODES_SIDECAR).is_file():  # its tokens are on the nodes, not here
                raise on_nodes_error(p)
            listed = manifest.get("epochs")
            if not isinstance(listed, list) or not listed:
                raise TokpackError(
                    "run manifest lists no epochs",
                    file=p / MANIFEST,
                    where="epochs",
                    expected="a non-empty list",
                    found=listed,
                    hint=f"write one with `{shuffle_command(manifest, p, 0)}`",
                )
            if len(paths) == 1:  # a run on its own: its consumed-sample numbers (a chain of several counts from 0)
                numbering, run = EpochNumbering.of_run(manifest, p), (str(p), manifest)
            for e in sorted(int(e) for e in listed):
                d = contained_epoch_dir(p, e)
                m = read_manifest(d, kind=EPOCH)
                if "seq_len" in manifest and int(m.get("seq_len", -1)) != int(manifest["seq_len"]):
                    raise TokpackError(
                        "epoch seq_len differs from its run",
                        file=d / MANIFEST,
                        where="seq_len",
                        expected=manifest["seq_len"],
                        found=m.get("seq_len"),
                    )
                _epoch_of_run(d, e, m, manifest)
                if numbering is not None and not (numbering.has(e) and int(m.get("samples", -1)) == numbering.size(e)):
                    raise TokpackError(
                        "epoch size differs from its run's",
                        file=d / MANIFEST,
                        where="samples",
                        expected=numbering.size(e) if numbering.has(e) else "no such epoch in the run's plan",
                        found=m.get("samples"),
                        hint="the epoch belongs to another run; run `tokpack validate` on the run",
                    )
                epochs.append((d, m))
        return cls.from_manifests(epochs, verify=verify, absent=absent, numbering=numbering, run=run)

    @classmethod
    def from_manifests(
        cls,
        epochs: Sequence[tuple[str | Path, dict]],
        verify: bool = False,
        absent: dict[str, str] | None = None,
        numbering: EpochNumbering | None = None,
        run: tuple[str, dict] | None = None,
    ) -> "SampleReader":
        """Builds the reader from (epoch directory, epoch manifest) pairs, chained in order
        (`chain_table`). With a run's `numbering`, epoch e starts at sample numbering.first(e)
        (epochs in increasing order); without one, each epoch starts where the one before it ends.

        The manifests may be built in memory: a test or benchmark can describe a huge
        "virtual" epoch whose shard entries all name one small or sparse real file.
        """
        reader = cls(*chain_table(epochs, absent, numbering), verify=verify)
        reader.numbering, reader.run = numbering, run
        reader.splits = tuple("holdout" if holdout_recorded(m)[1] else None for _, m in epochs)
        return reader

    # -------------------------------------------------------------- positions

    @property
    def run_digest(self) -> int | None:
        """The identity of the run this reader serves (formats.slices.run_digest), None for a
        chain of epoch directories: what a loader state records of the run it was saved over."""
        return None if self.run is None else run_digest(self.run[1])

    @property
    def epochs(self) -> list[int]:
        return list(self.table.epochs)

    def start_from(self, start_sample: int | None = None, consumed_tokens: int | None = None) -> int:
        """The chained sample G to start from: `start_sample`, or `consumed_tokens // seq_len`
        (each sample trains seq_len tokens). O(1); nothing is replayed. G may be the end of
        the chain; a G in an epoch that is not written is an error naming the command."""
        if start_sample is not None and consumed_tokens is not None:
            raise TokpackError("give at most one of start_sample and consumed_tokens", where="start")
        if isinstance(start_sample, numbers.Integral) and not isinstance(start_sample, bool) and start_sample < 0:
            raise TokpackError("start must not be negative", where="start sample", found=start_sample)
        start_sample = whole(start_sample, "start_sample")
        consumed_tokens = tokens(consumed_tokens, "consumed_tokens")
        g = start_sample if start_sample is not None else (consumed_tokens or 0) // self.seq_len
        if g == self.total_samples or self.table.epoch_pos_of(g) >= 0:
            return g
        missing = self.numbering.locate(g) if self.numbering is not None else None
        if missing is not None:
            raise self.missing_epoch_error(g, missing[0])
        if self.run is not None:  # the run was passed, and its schedule's epochs all end before g
            hint = _schedule_end_hint(self.numbering)
        elif self.splits[-1:] == ("holdout",):  # no epoch follows RUN/holdout/ (was: "write more epochs")
            hint = f"the held-out split ends at sample {self.total_samples:,} (no command adds to it): start below it"
        else:
            parent = as_path(self.table.epoch_dirs[-1]).parent  # the run, when the epochs are still in it
            run = {"kind": RUN} if (parent / MANIFEST).is_file() else {}
            nxt, numbering = max(self.table.epochs) + 1, None
            if run:
                with suppress(TokpackError, OSError):  # a run manifest this reader cannot read: the generic hint
                    numbering = EpochNumbering.of_run(read_manifest(parent), parent)
            if numbering is not None and not numbering.has(nxt):  # a schedule that ends with these epochs
                hint = _schedule_end_hint(numbering, parent)
            else:
                hint = f"write more epochs (`{shuffle_command(run, parent, nxt)}`) or pass the run directory"
        raise TokpackError(
            "start is beyond the end of the chained epochs",
            file=self.table.epoch_dirs[-1],
            where="start sample",
            expected=f"0..{self.total_samples}",
            found=g,
            hint=hint,
        )

    def missing_epoch_error(self, g: int, epoch: int) -> TokpackError:
        """Sample g lies in `epoch`, which this run does not hold (yet): say which command writes it."""
        run_dir, run = self.run if self.run is not None else (self.table.epoch_dirs[-1], {})
        hint = f"write it with `{shuffle_command(run, run_dir, epoch)}`"
        message, expected = (
            f"sample {g} is in epoch {epoch}, which is not written yet",
            f"epoch {epoch} among the run's epochs",
        )
        if epoch >= MAX_EPOCHS:  # no run holds it (no command writes it): the start given is not this run's count
            message = f"sample {g} is in epoch {epoch}, past the last epoch a run holds ({MAX_EPOCHS - 1:,})"
            expected = "a start in the run's epochs"
            hint = (
                f"check the start (--start-sample, or --consumed-tokens, which starts at sample tokens // "
                f"{self.seq_len}, the seq_len)"
            )
        later = [pos for pos, first in enumerate(self.table.epoch_starts) if first > g]
        if later:  # e.g. a staged copy of some epochs: the user may mean a written one
            hint += (
                f", or start at a written epoch (epoch {self.table.epochs[later[0]]} "
                f"starts at sample {int(self.table.epoch_starts[later[0]])})"
            )
        return TokpackError(
            message,
            file=run_dir,
            where=f"epoch {epoch}",
            expected=expected,
            found=self.epochs,
            hint=hint,
        )

    def locate(self, g: int) -> tuple[int, int]:
        """Chained sample g -> (epoch number, sample index within that epoch)."""
        pos = self.table.epoch_pos_of(whole(g, "g", optional=False))
        if pos < 0:
            raise no_such_sample(g, self.table.epochs)
        return self.table.epochs[pos], int(g - self.table.epoch_starts[pos])

    def _split_at(self, g: int) -> str | None:
        """The split chained sample g is of ("holdout": RUN/holdout/), None for an epoch's."""
        pos = self.table.epoch_pos_of(g)
        return self.splits[pos] if 0 <= pos < len(self.splits) else None

    def epoch_sample(self, g: int) -> tuple[int, int]:
        """(epoch, sample) naming any position G, also one past the last written sample (a
        resume point): the run's numbering, else the chain's (the end is the last epoch's size)."""
        g = whole(g, "g", optional=False)
        if self.numbering is not None:
            where = self.numbering.locate(g)
            if where is not None:
                return where
        pos = self.table.epoch_pos_of(g)
        if pos < 0:
            pos = len(self.table.epochs) - 1
        return self.table.epochs[pos], int(g - self.table.epoch_starts[pos])

    def position(self, epoch: int, sample: int) -> int:
        """(epoch number, sample within it) -> chained index; sample may equal the epoch's size.
        In a run the epoch need not be written (the position is the run's; reading it is not)."""
        epoch, sample = whole(epoch, "epoch", optional=False), whole(sample, "sample", least=None, optional=False)
        if self.numbering is not None and self.numbering.has(epoch):
            first, size = self.numbering.first(epoch), self.numbering.size(epoch)
        else:
            try:
                pos = self.table.epochs.index(epoch)
            except ValueError:
                raise TokpackError(
                    "epoch not in this reader's chain", where="epoch", expected=self.table.epochs, found=epoch
                ) from None
            first = int(self.table.epoch_starts[pos])
            size = int(self.table.epoch_ends[pos]) - first
        if not 0 <= sample <= size:
            raise TokpackError("sample outside its epoch", where=f"epoch {epoch}", expected=f"0..{size}", found=sample)
        return first + sample

    def steps(self, world_size: int, micro_batch: int, start: int = 0) -> int:
        """Complete global batches from chained sample `start` before the chain ends or an
        epoch is missing (the stream stops, or raises `missing_epoch_error`, there)."""
        _, world_size, micro_batch = stream_shape(0, world_size, micro_batch)  # steps(0, 1) divided by zero
        start = whole(start, "start", optional=False)
        return RankRows(world_size, micro_batch, start).batches(self.table.reachable_end(start))

    def blocked_at(self, start: int) -> int | None:
        """Where the stream from `start` meets an epoch that is not written, or None when it
        runs to the end of the chain."""
        end = self.table.reachable_end(start)
        return end if end < self.total_samples else None

    def require_batch(self, world_size: int, micro_batch: int, start: int) -> None:
        """One global batch of W*m samples must be left from `start`, else one line why not."""
        if not self.steps(world_size, micro_batch, start):
            raise self.end_error(world_size, micro_batch, start)

    def end_error(self, world_size: int, micro_batch: int, start: int) -> TokpackError:
        """Why no global batch of W*m samples is left from `start` (an epoch not written there,
        or the end of the chain, with the command that writes the next epoch): the line `tokpack
        read` prints at that sample, and what a stream that reaches it raises."""
        gap = self.blocked_at(start)
        if gap is not None:
            return self.missing_epoch_error(gap, self.epoch_sample(gap)[0])
        left = self.total_samples - start
        hint = "start earlier, or use a smaller --world-size/--micro-batch"
        if self.numbering is not None and self.numbering.locate(self.total_samples) is not None:
            nxt = self.epoch_sample(self.total_samples)[0]
            hint += f", or write the next epoch: `{shuffle_command(self.run[1], self.run[0], nxt)}`"
        where = self.run[0] if self.run is not None else self.table.epoch_dirs[-1]
        return TokpackError(
            "less than one global batch left to read",
            file=where,
            where=f"sample {start}",
            expected=f"{counted(world_size * micro_batch, 'sample')} (W*m)",
            found=f"{left} left",
            hint=hint,
        )

    # ---------------------------------------------------------- batch assembly

    def micro_batch(
        self,
        rows: np.ndarray,
        positions: np.ndarray | None,
        g: int,
        *,
        max_documents: int | None = None,
        eod_mask_loss: bool = False,
    ) -> dict:
        """The training arrays (`micro_batch`, same keys on every epoch) of chained rows
        [g, g+m) as a stream yielded them: `rows`, and `positions` (None for a stream without).

            stream = reader.batches(r, W, m, start, positions="eos")
            for rows, pos in stream:
                arrays = reader.micro_batch(rows, pos, stream.state.first_sample(stream.last_step), max_documents=K)
        """
        if not isinstance(rows, np.ndarray) or rows.ndim != 2 or rows.shape[1] != self.row_tokens:
            raise TokpackError(  # other rows gave arrays of another length, without a word
                "micro_batch takes the rows a stream of this reader yields",
                where="rows",
                expected=f"an array [m, {self.row_tokens}] (seq_len + 1 tokens a row)",
                found=f"shape {getattr(rows, 'shape', type(rows).__name__)}",
            )
        pad = self._unchecked_padding(g, len(rows)) if self.packed else None
        return micro_batch(
            rows,
            pad,
            positions,
            self.eos_id,
            max_documents=max_documents,
            eod_mask_loss=eod_mask_loss,
            first_row=g,
            locate=self.locate,
        )

    def most_documents(self, start: int = 0, stop: int | None = None) -> tuple[int, int]:
        """(largest segment count of a row, first chained row that has it) over rows [start,
        stop) (default: the whole chain), read in blocks of SCAN_TOKENS: one pass, O(1) memory.
        The smallest `max_documents` these rows take: a row's segments as `micro_batch` counts
        them (documents of its inputs, and its padding as one)."""
        stop = self.total_samples if stop is None else stop
        start, n = self.rows_within(start, whole(stop, "stop", optional=False) - whole(start, "start", optional=False))
        stop = start + n
        best, where = 0, start
        block = max(1, SCAN_TOKENS // self.row_tokens)
        for g in range(start, stop, block):
            rows = self.read(g, min(block, stop - g))
            if self.packed:
                pos = document_masks(rows, self.padding(g, len(rows)), self.eos_id)[0]
            else:
                pos = positions_from_eos(rows, self.eos_id)
            counts = row_segments(*np.nonzero(pos == 0), len(rows), self.row_tokens)
            i = int(counts.argmax())  # the first row of the block with its largest count
            if counts[i] > best:
                best, where = int(counts[i]), g + i
        return best, where

    # ------------------------------------------------------------------ streams

    def batches(  # noqa: PLR0913 -- the public stream's keywords, each one setting, as packer/api.py's
        self,
        rank: int,
        world_size: int,
        micro_batch: int,
        start: int = 0,
        *,
        positions: str | None = None,
        steps: int | None = None,
        worker: int = 0,
        num_workers: int = 1,
        copy: bool = True,
        first_step: int | None = None,
        at_end: str = "error",
    ) -> "RankStream":
        """Rank r's micro-batches from chained sample `start`: arrays [m, seq_len+1] of the token
        dtype, or (tokens, positions) pairs with positions="eos" or "index".

        `worker`/`num_workers` split the rank's steps round-robin (step b goes to worker
        b % num_workers), for DataLoader workers; `first_step` (default: `worker`) resumes a
        worker's share. `copy=False` yields views of a reused buffer, valid until the next item.
        A stream that reaches an epoch that is not written raises `missing_epoch_error` there.
        One that runs out of written samples before `steps` (None: no count) raises `end_error`
        there, the line `tokpack read` prints at that sample, so a job resumed past the written
        epochs fails instead of training zero steps; `at_end="stop"` ends the stream there.
        """
        rank, world_size, micro_batch = stream_shape(rank, world_size, micro_batch)
        num_workers = whole(num_workers, "num_workers", least=1, optional=False)
        worker = whole(worker, "worker", optional=False)
        steps = whole(steps, "steps")
        if worker >= num_workers:
            raise TokpackError("worker is out of range", where="worker", expected=f"0..{num_workers - 1}", found=worker)
        first_step = worker if first_step is None else whole(first_step, "first_step")
        if first_step % num_workers != worker:
            raise TokpackError(
                "a worker's first step is not its own",
                where="first_step",
                expected=f"a step b with b % {num_workers} == {worker} (worker {worker} of {num_workers})",
                found=first_step,
            )
        text(positions, "positions", choices=(None, "eos", "index"))
        text(at_end, "at_end", optional=False, choices=AT_END)
        if positions == "eos" and self.eos_id is None:
            raise TokpackError(
                "positions from EOS need eos_id, and the epoch manifest has none",
                where="eos_id",
                hint="use positions='index'",
            )
        start = self.start_from(start_sample=start)
        self.serves(rank, world_size, micro_batch, start)
        end = self.steps(world_size, micro_batch, start)
        # The written samples end before the caller's count: an error there (or a stop, when asked).
        short = steps is None or steps > end
        state = StreamState(start, first_step, rank, world_size, micro_batch, num_workers, end if short else steps)
        return RankStream(self, state, positions=positions, copy=copy, at_end=at_end if short else None)

    def serves(self, rank: int, world_size: int, micro_batch: int, start: int) -> None:
        """Raises when this reader cannot serve that rank's stream (a node slice of other ranks)."""

    def rank_samples(
        self, rank: int, world_size: int, micro_batch: int, start: int = 0, count: int | None = None
    ) -> Iterator[Sample]:
        """The samples rank r is fed, one by one, from chained sample `start`; at most `count`,
        as `tokpack read` prints them: no global batch left at `start` is `end_error`, and the
        samples stop at the end of the written epochs (an epoch not written is an error)."""
        count = whole(count, "count")
        if count == 0:
            return
        rank, world_size, micro_batch = stream_shape(rank, world_size, micro_batch)
        self.require_batch(world_size, micro_batch, self.start_from(start_sample=start))
        steps = None if count is None else -(-count // micro_batch)
        stream = self.batches(rank, world_size, micro_batch, start, steps=steps, at_end="stop")

        def samples() -> Iterator[Sample]:
            for rows in stream:
                g = stream.state.first_sample(stream.last_step)
                for j in range(len(rows)):
                    yield Sample(*self.locate(g + j), g + j, rows[j], self._split_at(g + j))

        yield from itertools.islice(samples(), count)


# What a stream does where the written samples end: raise `end_error` (the default), or stop.
AT_END = ("error", "stop")


def stream_shape(rank, world_size, micro_batch) -> tuple[int, int, int]:
    """(r, W, m) checked as `read --rank/--world-size/--micro-batch` are: 0 <= r < W, m >= 1."""
    world_size = whole(world_size, "world_size", least=1, optional=False)
    micro_batch = whole(micro_batch, "micro_batch", least=1, optional=False)
    rank = whole(rank, "rank", optional=False)
    if rank >= world_size:
        raise TokpackError("rank is out of range", where="rank", expected=f"0..{world_size - 1}", found=rank)
    return rank, world_size, micro_batch


class RankStream:
    """Iterator over one rank's micro-batches (`SampleReader.batches` builds it, checking its
    arguments). Its position is `state`: a few integers."""

    def __init__(
        self, reader: SampleReader, state: StreamState, *, positions: str | None, copy: bool, at_end: str | None
    ):
        self.reader = reader  # the shared reader (shard table, open files)
        self.state = state
        self.positions = positions  # None, "eos" or "index"
        self.copy = copy  # False: yield views of a reused buffer
        self.at_end = at_end  # `batches`' at_end; None: the caller's count of steps ends the stream first
        self.last_step = -1  # global batch of the last item yielded
        m, L = state.micro_batch, reader.row_tokens
        # W == 1 and one worker: the rank's rows are contiguous; read large blocks and slice them.
        self._contiguous = state.world_size == 1 and state.stride == 1
        rows = max(1, BLOCK_BYTES // (m * reader.row_bytes)) * m if self._contiguous else m
        self._buf = np.empty((rows, L), dtype=reader.dtype)  # reused read buffer
        self._buf_start = -1  # chained index of _buf's first row (contiguous mode), -1 when empty
        self._buf_rows = 0  # valid rows in _buf
        # Strided ranks: advise the kernel this many steps ahead.
        self._ahead = max(1, min(64, READAHEAD_BYTES // (m * reader.row_bytes)))
        self._advised = -1  # strided: last step advised; contiguous: chained row advised up to

    def __iter__(self) -> "RankStream":
        return self

    def __next__(self):
        st = self.state
        if st.step >= st.end_step:
            if self.at_end is not None:
                end = st.first(0, st.end_step)  # the first global batch not served
                if self.at_end == "error" or self.reader.blocked_at(end) is not None:
                    raise self.reader.end_error(st.world_size, st.micro_batch, end)
            raise StopIteration
        step = st.step
        g = st.first_sample(step)
        m = st.micro_batch
        r = self.reader
        if self._contiguous:
            if not (self._buf_start <= g and g + m <= self._buf_start + self._buf_rows):
                last = st.first_sample(st.end_step - 1) + m  # end of this stream's rows
                n = min(len(self._buf), last - g)
                # Keep two blocks in flight ahead of the one being read, so the disk never idles.
                ahead = min(last, g + 3 * len(self._buf))
                lo = max(self._advised, g + n)
                if ahead > lo:
                    r.advise(lo, ahead - lo)
                    self._advised = ahead
                r.read_into(g, self._buf[:n])
                self._buf_start, self._buf_rows = g, n
            rows = self._buf[g - self._buf_start : g - self._buf_start + m]
            if self.copy:
                rows = rows.copy()
        else:
            rows = np.empty((m, r.row_tokens), dtype=r.dtype) if self.copy else self._buf
            r.read_into(g, rows)
            first = max(self._advised + st.stride, step + st.stride)
            for s in range(first, min(st.end_step, step + st.stride * (self._ahead + 1)), st.stride):
                r.advise(st.first_sample(s), m)
                self._advised = s
        st.step += st.stride
        self.last_step = step
        if self.positions is None:
            return rows
        if self.positions == "eos":
            return rows, positions_from_eos(rows, r.eos_id)
        return rows, r.index_positions(g, m)


def _epoch_of_run(d: Path, e: int, m: dict, run: dict) -> None:
    """An epoch of another run put in a run's place (reshuffled with another seed, of other
    sources) has the run's shape but other samples: refused at open, at the first setting or
    source fingerprint where validate finds it is not the run's (formats.slices.
    epoch_disagreements). Its size is the numbering's check (a schedule's epochs differ in size);
    the other fields validate compares name no other samples."""
    for where, expected, found, message in epoch_disagreements(run, e, m):
        if where == "samples" or where not in RUN_KEYS and not where.endswith(".fingerprint"):
            continue
        raise TokpackError(
            message,
            file=d / MANIFEST,
            where=where,
            expected=expected,
            found=found,
            hint="the epoch was replaced or belongs elsewhere; run `tokpack validate` on the run",
        )


def on_nodes_error(run_dir: Path) -> TokpackError:
    """The line for a run written by `shuffle --to-nodes` (or an epoch of it) opened for its
    tokens: they are in the node slices, and the line names where."""
    return TokpackError(
        "this run's tokens are in node slices (shuffle --to-nodes), not in the run",
        file=run_dir / NODES_SIDECAR,
        where="dest",
        expected="a node slice",
        found="a run that holds manifests and row hashes only",
        hint=f"open this node's slice, written to {_nodes_dest(run_dir / NODES_SIDECAR)} "
        "({node}: the node's number), e.g. `tokpack read DEST ...`",
    )


def _nodes_dest(sidecar: Path) -> str:
    """The --to-nodes DEST a run's sidecar names (with {node}), or "the --to-nodes DEST"."""
    try:  # the sidecar is a format file: read strictly, as every manifest is
        dest = strict_json(read_limited(sidecar, 1 << 16, "sidecar"), sidecar, "sidecar").get("dest")
    except (TokpackError, ValueError, AttributeError):
        dest = None
    return dest if isinstance(dest, str) and len(dest) < 4096 else "the --to-nodes DEST"
