"""A node slice's rank files of one epoch (RankFiles), fed its rows in increasing epoch position:
what `shuffle --to-nodes` writes on each node (tokpack.packer.exchange) and what a replacement
node writes from the sources (tokpack.packer.replacement), the bytes `stage RUN DEST --node n/N`
writes, however the rows were cut into calls."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tokpack.formats.errors import TokpackError
from tokpack.formats.hashes import row_hashes
from tokpack.formats.io.writes import remove_tmp_files
from tokpack.formats.outputs import EpochShardFormat, Output, ShardPlace
from tokpack.formats.shards import eos_columns, fragment_ends
from tokpack.formats.slices import RankRows, rank_file_name
from tokpack.shuffle.epoch_job import MAX_CHUNK_BYTES


class RankFiles:
    """A node slice's rank files of one epoch, open together and fed its rows in increasing epoch
    position, in as many calls as suit the caller (all at once from memory, or part by part from
    an out-of-core order or a replacement node's reads): each rank file gets its rows in the
    order stage --node writes them, so the bytes do not depend on how the rows were cut."""

    def __init__(
        self, output: Output, d: Path, rows: RankRows, first: int, ranks, epoch: int, fmt: EpochShardFormat, mine=None
    ):
        """`mine`: the ranks of `ranks` whose files this process writes, `d` readied before
        (ready_epoch_dir: by its node's leader when its processes share them); None: every
        rank's, `d` readied here."""
        self.rows, self.first, self.fmt, self.last = rows, first, fmt, -1
        # each row's facts (its xxh3-64 and EOS columns, computed once as its index is written)
        # given to this collector too (`add(positions, hashes, counts, cols)`): what its epoch
        # shard's owner needs of it (tokpack.packer.owned_facts); None: not kept
        self.facts = None
        if mine is None:
            ready_epoch_dir(output, d)
        self.writers = {}
        try:
            for r in range(ranks[0], ranks[1] + 1) if mine is None else mine:
                self.writers[r] = output.open_shard(ShardPlace(str(d), rank_file_name(r), r, epoch=epoch, rank=r), fmt)
        except BaseException:
            self.abort()
            raise

    def add(self, positions: np.ndarray, keep: np.ndarray, pad: np.ndarray | None) -> None:
        """The rows `keep` (with their padding `pad`, best-fit) at epoch `positions`, increasing
        and after every position added before."""
        if not len(positions):
            return
        if int(positions[0]) <= self.last or (len(positions) > 1 and (np.diff(positions) <= 0).any()):
            raise TokpackError(
                "internal error: a node's rows reached its rank files out of order",
                where=f"sample {int(positions[0])}",
                hint="report this with the command line",
            )
        self.last = int(positions[-1])
        rank = self.rows.rank_of(positions + self.first)
        for r, writer in self.writers.items():
            write_rows(writer, self.fmt, keep, pad, np.flatnonzero(rank == r), self.facts, positions)

    def reserve(self, samples: int) -> None:
        """A `placed` format's (EpochShardFormat.placed): each rank file's tokens at their final
        size, for an epoch of `samples` samples, so that its rows may reach it (`place`) before
        `add` hashes and indexes them in order."""
        for r, writer in self.writers.items():
            writer.reserve(self.rows.rows(r, self.first, self.first + samples))

    def place(self, positions: np.ndarray, store: np.ndarray, which: np.ndarray) -> None:
        """Rows `store[which]`, complete and left unchanged until `add`, at epoch `positions` (any
        order, each once an epoch; `store` the same array each call), written at their place in
        their rank's file (`placed`) as soon as the pages they share with their neighbours are
        complete: the disk takes them while the caller goes on, instead of all at the end, each
        page once. Each row is written from `store` itself (slices of its bytes: no copy)."""
        if not len(positions):
            return
        g = positions + self.first
        rank, at = self.rows.rank_of(g), self.rows.file_rows(self.first, g)
        rb = store.shape[1] * store.itemsize
        flat = memoryview(store.reshape(-1).view(np.uint8))
        for r, writer in self.writers.items():
            sel = np.flatnonzero(rank == r)
            writer.write_at(flat, which[sel] * rb, at[sel])

    def close(self) -> list[dict]:
        return [{**wr.close(), "rank": r} for r, wr in self.writers.items()]

    def abort(self) -> None:
        for wr in self.writers.values():
            wr.abort()


def ready_epoch_dir(output: Output, d: Path) -> None:
    """`d`, a slice epoch's folder, ready for its rank files: there, its manifest withdrawn (the
    epoch is incomplete until they are all written), a killed run's temporary files gone."""
    d.mkdir(parents=True, exist_ok=True)
    output.unfinish(d)
    remove_tmp_files(d)


def row_facts(rows: np.ndarray, dtype, row_tokens: int, eos_id: int) -> tuple:
    """(each row's xxh3-64, its EOS count, the EOS columns (1 + the column of each, row by row,
    uint32), the fragment ends relative to the first row as EpochShardWriter.write_known_index
    takes them) of `rows`, from one pass over their tokens (formats.shards.eos_columns; the ends
    from the EOS found, fragment_ends, not from a second look at the rows)."""
    tokens = np.ascontiguousarray(rows).view(np.dtype(dtype).newbyteorder("<")).reshape(len(rows), row_tokens)
    counts, cols = eos_columns(tokens, eos_id)
    return row_hashes(tokens), counts.astype(np.uint32), cols.astype(np.uint32), fragment_ends(counts, cols, row_tokens)


def write_rows(writer, fmt: EpochShardFormat, rows: np.ndarray, pad, sel, facts=None, positions=None) -> None:
    """Rows `sel` of `rows` (with their padding `pad`, a padded format) to `writer`,
    MAX_CHUNK_BYTES at a time (at least a row), as the scatter/order engine hands its writers
    rows: bounded temporaries whatever the rows' length. The index from the rows' facts
    (row_facts: one pass over their tokens), which `facts` gets too where there is one, the
    rows at epoch `positions`."""
    step = max(1, MAX_CHUNK_BYTES // max(1, rows[:1].nbytes))
    for c in range(0, len(sel), step):
        at = sel[c : c + step]
        t = rows[at]
        writer.write_tokens(t)
        hashes, counts, cols, ends = row_facts(t, fmt.dtype, fmt.seq_len + 1, fmt.eos_id)
        writer.write_known_index(len(t), ends, hashes)
        if facts is not None:
            facts.add(positions[at], hashes, counts, cols)
    if fmt.padded:
        writer.write_pad(pad[sel])
