"""The reader of a node slice (docs/FORMAT.md, "Node slices"): a SampleReader over the rank
files of ranks A..B that serves the run's consumed-sample numbers, the rows of its ranks only.
Which rows a rank reads is tokpack.formats.slices' arithmetic (`RankRows`).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Iterator

from tokpack.formats.errors import TokpackError
from tokpack.formats.io.paths import as_path
from tokpack.formats.constants import MANIFEST, PAD_SUFFIX, SLICE_EPOCH
from tokpack.formats.names import dtype_from_name
from tokpack.formats.packing import has_pad
from tokpack.formats.reading import read_manifest
from tokpack.formats.checks import row_bytes_of
from tokpack.formats.numbering import EpochNumbering
from tokpack.formats.shards import contained_shard
from tokpack.formats.slices import (
    RankRows,
    contained_epoch_dir,
    missing_padding,
    slice_epoch_problems,
    rank_file_name,
    stage_command,
)

from .reader import SampleReader
from .shard_files import ShardTable, listed_size, no_such_sample, shard_error

_RESTAGE = "stage the slice again: the same command resumes"


class SliceReader(SampleReader):
    """A SampleReader over a node slice: the run's consumed-sample numbers, the rows of its ranks only."""

    @classmethod
    def open_dir(cls, path: str | Path, root: dict, verify: bool = False) -> "SliceReader":
        path = as_path(path)
        ranks = [int(r) for r in root["ranks"]]
        numbering = EpochNumbering.of_run(root["run"], path)
        rows = RankRows(root["world_size"], root["micro_batch"], root["batch_phase"])
        row_bytes = row_bytes_of(root)
        table, placed = ShardTable(), []  # (start, end, epoch, folder) of each epoch
        for e in sorted(int(e) for e in root.get("epochs") or []):
            d = contained_epoch_dir(path, e)
            m = read_manifest(d, kind=SLICE_EPOCH)
            first, n = numbering.first(e), numbering.size(e)
            for _, err in slice_epoch_problems(d, root, m, e, first, n, rows):
                raise err
            for r, s in zip(ranks, m["shards"]):
                f = d / rank_file_name(r)
                want = rows.rows(r, first, first + n) * row_bytes
                contained_shard(d, s, ranks.index(r), regular=False)
                # A FIFO or device in its place: refused here, in one line.
                listed_size(f, "rank file", want, (_RESTAGE, _RESTAGE), "slice manifest")
                err = missing_padding(d, root, s)
                if err is not None:
                    raise err
                pad = f.with_name(f.name + PAD_SUFFIX)
                if has_pad(s) and not os.path.lexists(pad):  # found by tests/test_fuzz.py: `read` served a
                    # slice whose padding file was gone. Present at open; its type and size are the gate's
                    # at its first read (`read` opens no sidecar).
                    raise shard_error(
                        "padding sidecar listed in the slice manifest is missing",
                        pad,
                        hint=_RESTAGE,
                    )
                table.add(str(f), s, want // row_bytes)
            placed.append((first, first + n, e, str(d)))
        if not placed:
            raise TokpackError(
                "node slice holds no epoch",
                file=path / MANIFEST,
                where="epochs",
                expected="a non-empty list",
                found=root.get("epochs"),
                hint="stage the slice again",
            )
        table.place(*map(list, zip(*placed)))
        reader = cls(table, int(root["seq_len"]), dtype_from_name(root["dtype"]), int(root["eos_id"]), verify=verify)
        reader.numbering, reader.run = numbering, (root.get("source") or str(path), root["run"])
        reader.slice_path, reader.slice = str(path), root
        reader.rank_rows, reader.slice_ranks = rows, ranks
        return reader

    def _refused(self, message: str, rank: int, world_size: int, micro_batch: int, phase: int) -> TokpackError:
        """One line: what the slice holds, and the command that restages this node, in place of the
        slice, for the stream asked for: the slice's count of ranks, the one holding `rank`."""
        manifest, path = self.slice, self.slice_path
        ranks = manifest["ranks"]
        source = manifest.get("source") or "RUN"
        k = len(ranks)
        first = max(0, ranks[0] + (rank - ranks[0]) // k * k)
        last = min(first + k, world_size) - 1
        here = str(path).rstrip("/")
        return TokpackError(
            message,
            file=path,
            where="rank/world_size/micro_batch",
            expected=f"ranks {ranks[0]}-{ranks[-1]} of world size {manifest['world_size']}, "
            f"micro-batch {manifest['micro_batch']}"
            + (f", global batches from sample {manifest['batch_phase']} mod W*m" if manifest["batch_phase"] else ""),
            found=f"rank {rank} of world size {world_size}, micro-batch {micro_batch}",
            hint=f"restage this node's slice for that stream: `rm -r {shlex.quote(here)} && "
            + stage_command(source, here, first, last, world_size, micro_batch, phase)
            + "`",
        )

    def serves(self, rank: int, world_size: int, micro_batch: int, start: int) -> None:
        """Refuses, in one line, a stream this slice does not hold."""
        rr, phase = self.rank_rows, start % (world_size * micro_batch)
        if (world_size, micro_batch) != (rr.world_size, rr.micro_batch) or rank not in self.slice_ranks:
            raise self._refused("this node slice does not hold that rank's rows", rank, world_size, micro_batch, phase)
        if RankRows(world_size, micro_batch, start).phase != rr.phase:  # the same W*m: phase is start's, mod it
            message = f"this node slice serves global batches starting at samples = {rr.phase} mod {rr.global_batch}"
            raise self._refused(f"{message}, not at {start}", rank, world_size, micro_batch, phase)

    def _segments(self, g: int, n: int) -> Iterator[tuple[int, int, int]]:
        """Chained rows [g, g+n) -> (rank file, row in it, rows): split at epoch ends and where
        the rank changes; a row of a rank outside the slice is an error."""
        rr, table, k_ranks = self.rank_rows, self.table, len(self.slice_ranks)
        while n > 0:
            pos = table.epoch_pos_of(g)
            if pos < 0:
                raise no_such_sample(g, table.epochs)
            r = rr.rank_of(g)
            if r not in self.slice_ranks:
                message = f"sample {g} is read by rank {r}, which this node slice does not hold"
                raise self._refused(message, r, rr.world_size, rr.micro_batch, rr.phase)
            k = min(n, int(table.epoch_ends[pos]) - g, rr.run_left(g))
            yield pos * k_ranks + (r - self.slice_ranks[0]), rr.rows(r, int(table.epoch_starts[pos]), g), k
            g += k
            n -= k
