"""A process's store of one epoch of `shuffle --to-nodes` (NodeEpoch.store_rows): its part of the
node's slice, in position order (the rows of the epoch shards it owns are not here: their facts
come to it after the rounds, tokpack.packer.owned_facts). In memory (InMemory,
every row at once) or out of core (tokpack.packer.node_buckets.Buckets); both take a round's
pieces (`receive`: each at its store row and offset) and give their rows back in order
(`rows(lo, hi)`), with each row's unfilled count (its padding, once every piece is in); the
slice's rows go to its rank files (`write_slice_epoch`). In memory, a windows epoch's rank files
are open during the rounds (`open_slice_files`): each slice row is written to its place in its
rank's file as soon as it is complete, so the local disk works while the rounds go on, and
after them its tokens are only hashed and indexed in order (issue 41, item 3)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from tokpack.formats.errors import TokpackError
from tokpack.formats.io.memory import anonymous
from tokpack.formats.io.reads import Worker
from tokpack.formats.outputs import EpochShardFormat, Output
from tokpack.packer.node_epoch import NodeEpoch
from tokpack.packer.phases import phase
from tokpack.packer.pieces import place
from tokpack.packer.rank_files import RankFiles
from tokpack.shuffle.steps import Layout


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
    job, P = ne.job, len(ne.positions)
    glen = got_pieces["length"].astype(np.int64)
    gstart = np.cumsum(glen) - glen
    g = got_pieces["g"]
    at = np.searchsorted(ne.positions, g)
    if len(g) and (at.max() >= P or (ne.positions[at] != g).any() or (ne.keeper_of(g) != ne.me).any()):
        raise TokpackError(
            "internal error: a row was sent to a process whose ranks do not read it", where=f"epoch {job.plan.epoch}"
        )
    if len(g):
        stores.put(pad, at, got_pieces, got_tokens, gstart)


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
