"""What an epoch shard's owner needs of its rows in `shuffle --to-nodes` (tokpack.packer.exchange),
and how it gets it: not the rows (they go only to their keepers, the processes that write their
rank files) but each row's facts, which its keeper computes once as it writes the row's rank
file (rank_files.row_facts: the `.ds.rows` and `.ds.index` of the rank file come from the same
pass): its xxh3-64, its padding and its EOS columns (1 + the column of each EOS token; the row's
end is implied). With them the owner (world process q of N*P owns the epoch shards i with
i mod N*P = q) builds each shard's manifest entry (OwnedShards) through the epoch shard writer
(`hashed_only`: no token is asked for, write_known_index and write_pad) in its DEST's scratch,
the same bytes as from the rows themselves, exactly as `tokpack shuffle` records it, and sends
of it to RUN only the row hashes (`.ds.rows`) and a best-fit shard's padding (`.ds.pad`),
through RUN's Output.

The keeper holds its slice rows' facts (KeptFacts, node_epoch.fact_row_bytes a row), then every
process takes part in the same `fact_rounds(ne)` rounds: in round j each keeper sends to each
owner, with one exchange of small arrays (transport.send_each: a FACT record a row, then the
EOS columns), the facts of the rows at places [j*FACT_ROWS, (j+1)*FACT_ROWS) of that owner's
owned rows (its shards in increasing order, their rows in order): an owner holds one round's
facts at a time, whatever the epoch's size. What arrives is checked before it is used
(`received`): every record from the keeper of its row, for a row of this owner's round, each
row exactly once, the EOS columns as many as the records count, each within its row and
increasing; else one line naming the node that sent it (or that should have).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import xxhash

from tokpack.formats.errors import TokpackError
from tokpack.formats.io.gate import open_new, open_read
from tokpack.formats.io.writes import tmp_path
from tokpack.formats.outputs import EpochShardFormat, LocalOutput, Output, ShardPlace
from tokpack.formats.constants import PAD_SUFFIX, ROWS_SUFFIX
from tokpack.formats.shards import fragment_ends, shard_files
from tokpack.packer.node_epoch import NodeEpoch
from tokpack.packer.pieces import ranges
from tokpack.packer.transport import process_name, send_each

# A row's facts on the wire: its epoch position g, its xxh3-64, its padding tokens, its EOS
# count; its EOS columns travel back to back in an array of their own (uint32 each).
FACT = np.dtype([("g", "<i8"), ("hash", "<u8"), ("pad", "<u4"), ("eos", "<u4")])
# Rows of facts an owner receives a round at most (about 60 MB with a dozen EOS a row).
FACT_ROWS = 1 << 20
COPY_BLOCK = 8 << 20  # the copy to RUN's buffer (a shard's row hashes: 8 bytes a row)


class KeptFacts:
    """A keeper's facts of its slice rows (NodeEpoch.positions), given by its rank files as they
    are written (rank_files.RankFiles.facts), in any order of rows; `finish` lays their EOS
    columns out in slice order."""

    def __init__(self, positions: np.ndarray):
        self.positions = positions
        self.hashes = np.zeros(len(positions), np.uint64)
        self.counts = np.zeros(len(positions), np.uint32)
        self.given = np.zeros(len(positions), bool)
        self.cols = np.zeros(0, np.uint32)
        self.starts = np.zeros(len(positions), np.int64)
        self._parts: list = []  # (slice rows, their EOS columns)

    def add(self, positions: np.ndarray, hashes: np.ndarray, counts: np.ndarray, cols: np.ndarray) -> None:
        idx = np.searchsorted(self.positions, positions)
        self.hashes[idx], self.counts[idx], self.given[idx] = hashes, counts, True
        self._parts.append((idx, cols))

    def finish(self) -> None:
        if not self.given.all():
            raise TokpackError(
                "internal error: a row of this process's slice was written without its facts",
                where=f"sample {int(self.positions[np.flatnonzero(~self.given)[0]])}",
                hint="report this with the command line",
            )
        counts = self.counts.astype(np.int64)
        self.starts = np.cumsum(counts) - counts
        self.cols = np.empty(int(counts.sum()), np.uint32)
        for idx, cols in self._parts:
            self.cols[ranges(self.starts[idx], counts[idx])] = cols
        self._parts = []


def owned_place(ne: NodeEpoch, g: np.ndarray) -> np.ndarray:
    """Row g's place among its owner's owned rows (its shards i, i + N*P, ... in order, their
    rows in order): every shard before the epoch's last is full."""
    per = ne.job.shard_samples
    i = g // per
    return (i // ne.world) * per + g - i * per


def fact_rounds(ne: NodeEpoch) -> int:
    """The rounds of facts every process takes part in: the most owned rows any process has, a
    round's FACT_ROWS at a time."""
    sizes = [ne.job.shard_range(i)[1] - ne.job.shard_range(i)[0] for i in range(ne.job.n_shards)]
    most = np.bincount(np.arange(len(sizes)) % ne.world, weights=sizes, minlength=ne.world).max() if sizes else 0
    return -(-int(most) // FACT_ROWS)


def send_facts(comm, MPI, ne: NodeEpoch, kept: KeptFacts, pad: np.ndarray, owned: OwnedShards) -> None:
    """The rounds: this process's rows' facts to their owners, its owned rows' facts from their
    keepers into `owned` (one shard's entry after another). Every process takes part in every
    round; one that failed (a peer's facts refused, its scratch's disk full) goes on sending its
    own, so that none is left waiting, and raises its failure after the last round."""
    g = ne.positions
    key = owned_place(ne, g) // FACT_ROWS * ne.world + ne.owner_of(g)
    order = np.argsort(key, kind="stable")  # by round, then owner; each owner's rows in increasing g
    rounds = fact_rounds(ne)
    cuts = np.searchsorted(key[order], np.arange(rounds + 1) * ne.world)
    del key  # what stays a row: its facts and its place in `order` (node_epoch.fact_row_bytes)
    failure = None
    for j in range(rounds):
        which = order[cuts[j] : cuts[j + 1]]
        dest = ne.owner_of(g[which])
        rec = np.empty(len(which), FACT)
        rec["g"], rec["hash"], rec["pad"], rec["eos"] = g[which], kept.hashes[which], pad[which], kept.counts[which]
        cols = kept.cols[ranges(kept.starts[which], kept.counts[which].astype(np.int64))]
        sent_cols = np.bincount(dest, weights=kept.counts[which], minlength=ne.world)
        counts = np.stack([np.bincount(dest, minlength=ne.world), sent_cols], axis=1)
        (got, got_cols), recv = send_each(comm, MPI, [rec, cols], counts)
        if failure is not None:
            continue
        try:
            for i, ends, hashes, pads in received(ne, j, got, got_cols, recv):
                owned.add(i, ends, hashes, pads)
        except Exception as e:  # noqa: BLE001 - raised after the last round, where every process is
            failure = e
    if failure is not None:
        owned.abort()
        raise failure


def _refused(ne: NodeEpoch, sender: int, what: str, row: int | None = None) -> TokpackError:
    return TokpackError(
        f"{process_name(sender, ne.procs)} sent wrong row facts for the epoch shards this process owns: {what}",
        where=f"epoch {ne.job.plan.epoch}" + ("" if row is None else f", sample {row}"),
        hint="rerun the same command (the epoch is written again); if it happens again, report it with the "
        "command line",
    )


def received(ne: NodeEpoch, j: int, got: np.ndarray, got_cols: np.ndarray, recv: np.ndarray):
    """Round j's facts this owner received (FACT records and EOS columns, each grouped by sender,
    recv[s]: the counts sender s sent), checked at once: raises, naming the node, on anything a
    keeper could not have sent. Returns (in a generator) each owned shard's part the round
    covers, in order: (shard, its rows' fragment ends relative to the first of them, their
    hashes, their padding)."""
    sender = np.repeat(np.arange(len(recv)), recv[:, 0])
    eos = got["eos"].astype(np.int64)
    for s in np.flatnonzero(np.bincount(sender, weights=eos, minlength=len(recv)) != recv[:, 1]).tolist():
        raise _refused(ne, s, f"{int(recv[s, 1])} EOS columns for rows that count them otherwise")
    order = _in_order(ne, j, got["g"], sender)
    counts = eos[order]
    cols = got_cols[ranges((np.cumsum(eos) - eos)[order], counts)].astype(np.int64)
    pads = got["pad"][order]
    _check_columns(ne, counts, cols, pads, order, got["g"], sender)
    return _shards(ne, got["g"][order], got["hash"][order], pads, counts, cols)


def _in_order(ne: NodeEpoch, j: int, g: np.ndarray, sender: np.ndarray) -> np.ndarray:
    """The received records' order by their rows' places, once each is known to come from its
    row's keeper, for a row of this owner's round j, each row of the round exactly once."""
    lo = j * FACT_ROWS
    hi = max(lo, min(lo + FACT_ROWS, ne.owned_rows))  # none once its owned rows are done
    inside = (g >= 0) & (g < ne.plan.samples)
    gi = np.where(inside, g, 0)
    place = owned_place(ne, gi)
    bad = ~inside | (ne.owner_of(gi) != ne.me) | (ne.keeper_of(gi) != sender) | (place < lo) | (place >= hi)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise _refused(ne, int(sender[k]), "a row it does not keep, or not this owner's in this round", int(g[k]))
    order = np.argsort(place, kind="stable")
    place = place[order]
    dup = np.flatnonzero(place[1:] == place[:-1])
    if len(dup):
        k = int(order[dup[0] + 1])
        raise _refused(ne, int(sender[k]), "a row twice", int(g[k]))
    if len(place) != hi - lo:
        row = _row_at(ne, int(np.setdiff1d(np.arange(lo, hi), place)[0]))
        raise _refused(ne, int(ne.keeper_of(np.array([row]))[0]), "no facts for a row it keeps", row)
    return order


def _check_columns(ne, counts, cols, pads, order, g, sender) -> None:
    """Each row's EOS columns within it (1..row tokens) and increasing, its padding within it."""
    width = ne.plan.row_tokens
    ends = np.cumsum(counts)
    first = np.zeros(len(cols), bool)
    first[(ends - counts)[counts > 0]] = True
    wrong = (cols < 1) | (cols > width) | (~first & (np.diff(cols, prepend=0) <= 0))
    rows = np.concatenate(
        [np.searchsorted(ends, np.flatnonzero(wrong)[:1], side="right"), np.flatnonzero(pads > width)[:1]]
    )
    if len(rows):
        k = int(order[int(rows.min())])
        raise _refused(ne, int(sender[k]), "EOS columns or padding outside the row", int(g[k]))


def _shards(ne: NodeEpoch, g, hashes, pads, counts, cols):
    width = ne.plan.row_tokens
    shard = g // ne.job.shard_samples
    cuts = [0, *(np.flatnonzero(np.diff(shard)) + 1).tolist(), len(g)]
    col_at = np.concatenate([[0], np.cumsum(counts)])
    for a, b in zip(cuts, cuts[1:]):
        if b > a:
            ends = fragment_ends(counts[a:b], cols[col_at[a] : col_at[b]], width)
            yield int(shard[a]), ends, hashes[a:b], pads[a:b]


def _row_at(ne: NodeEpoch, place: int) -> int:
    """The epoch position of this owner's owned row at `place` (owned_place's inverse)."""
    per = ne.job.shard_samples
    return (ne.me + (place // per) * ne.world) * per + place % per


class OwnedShards:
    """The owned epoch shards of one epoch, each fed its rows' facts in order (`add`, in as
    many calls as the facts' rounds cut them into), its entry built as its last row is in
    (`close` of its writer), its row hashes (and padding) sent to RUN and its files in
    `scratch` removed; RUN's Output a LocalOutput (RUN is a shared filesystem's folder)."""

    def __init__(self, job, fmt: EpochShardFormat, scratch: Path, run_epoch: Path):
        self.job, self.fmt = job, replace(fmt, hashed_only=True)
        self.scratch, self.run_epoch = scratch, run_epoch
        self.output = LocalOutput()
        self.writers: dict[int, tuple] = {}  # shard -> (its place, its writer, rows given so far)
        self.entries: list[tuple[int, dict]] = []
        self.padding = 0  # the padding tokens of every row given: the epoch's cross-check (exchange)
        scratch.mkdir(parents=True, exist_ok=True)
        run_epoch.mkdir(parents=True, exist_ok=True)

    def add(self, i: int, ends: np.ndarray, hashes: np.ndarray, pad: np.ndarray) -> None:
        """Shard i's next rows: their fragment ends (relative to the first of them), hashes and
        padding; the shard is done once its last row is in."""
        if i not in self.writers:
            g0, g1 = self.job.shard_range(i)
            place = ShardPlace(
                str(self.scratch), self.job.shard_file(i), i, epoch=self.job.plan.epoch, samples=(g0, g1)
            )
            self.writers[i] = (place, LocalOutput().open_shard(place, self.fmt), 0)
        place, writer, done = self.writers[i]
        writer.write_known_index(len(hashes), ends, hashes)
        if self.fmt.padded:
            writer.write_pad(pad)
        self.padding += int(pad.sum())
        done += len(hashes)
        self.writers[i] = (place, writer, done)
        if done == place.samples[1] - place.samples[0]:
            del self.writers[i]
            try:
                entry = writer.close()
            except BaseException:
                writer.abort()
                raise
            send_to_run(self.output, self.scratch, self.run_epoch, entry)
            for f in place.files(entry):
                f.unlink(missing_ok=True)
            self.entries.append((i, entry))

    def abort(self) -> None:
        """The shards begun and not done: their temporary files gone."""
        for _, writer, _ in self.writers.values():
            writer.abort()
        self.writers = {}


def send_to_run(output: Output, scratch: Path, run_epoch: Path, entry: dict) -> None:
    """An owned shard's row hashes (and best-fit padding), written in `scratch`, to RUN's epoch
    folder through `output`: each read through the gate at the size its entry records, checked
    against its entry's checksum as it is copied, written under a temporary name and committed
    (Output.commit_file). Its token file, index and metadata stay on the nodes."""
    for suffix, size, key in shard_files(entry):
        if suffix not in (ROWS_SUFFIX, PAD_SUFFIX):
            continue
        name = f"{entry['path']}{suffix}"
        tmp, h = tmp_path(run_epoch / name), xxhash.xxh3_128()
        try:
            with open_read(scratch / name, size=size, what="sidecar") as fin, open_new(tmp) as fout:
                buf = memoryview(bytearray(min(max(size, 1), COPY_BLOCK)))
                while n := fin.readinto(buf):
                    h.update(buf[:n])
                    fout.write(buf[:n])
            if h.hexdigest() != entry[key]:
                raise TokpackError(
                    "a file of an owned epoch shard changed in this node's scratch",
                    file=scratch / name,
                    where=key,
                    expected=entry[key],
                    found=h.hexdigest(),
                    hint="check this node's local disk, then rerun the same command (the epoch is written again)",
                )
            output.commit_file(tmp, run_epoch / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
