"""One epoch of `shuffle --to-nodes` on one process (tokpack.packer.exchange): what it reads
(its runs of whole source shards, in order, cut into pieces of output rows with their tokens by
`source_pieces`: a window is a piece of a whole row, as the scatter pass reads the plan's
windows; a best-fit epoch's pieces are its documents', by the row table's files of each source
shard, as the best-fit scatter pass reads them; every source shard verified as it is read),
what it keeps (its ranks' part of the node's slice, in increasing position order) and owns
(epoch shards i with i mod N*P the process: their rows' facts, not their rows, come to it),
each piece's one destination, and the memory plan (`memory_plan`: a round's tokens, and
whether its rows fit in memory or go out of core to bucket files). A node is P processes
(tokpack.packer.node_procs): process p of node n is world process q = n*P + p; it reads part q
of N*P of the sources and keeps the rows of the node's ranks r with (r - a) mod P = p (a: the
node's first rank), so a row reaches its node once, at the process that writes its rank file.
With P = 1 a process is its node. `plan shuffle --to-nodes` asks the same object (P = 1)."""

from __future__ import annotations


import numpy as np
import xxhash

from tokpack.formats.errors import TokpackError
from tokpack.formats.io.gate import map_file
from tokpack.formats.slices import RankRows
from tokpack.packer.phases import lapped, phase
from tokpack.packer.pieces import WIRE_PIECE
from tokpack.packer.transport import MAX_MESSAGE_BYTES
from tokpack.shuffle import packings
from tokpack.shuffle.packed.table import RECORD
from tokpack.shuffle.source_windows import iter_source_windows
from tokpack.shuffle.steps import shard_segments, split_shards
from tokpack.shuffle.epoch_job import ShardHashes, source_changed_error

# Rows a round's buffers hold at least: fewer, and the exchange spends its time per round.
MIN_ROUND_ROWS = 4
# Token bytes a process reads a round, at most, whatever --memory allows: a round's buffers are
# fresh memory, and larger ones cost more per byte to fault in than they save in rounds (bench/
# rounds.py, BENCHMARKS.md "Straight to the nodes"); at 48 nodes a round still sends megabytes a peer.
MAX_ROUND_BYTES = 64 << 20


# EOS tokens a token where no source says (a virtual source without documents): a document end
# every 512 tokens.
DEFAULT_EOS_PER_TOKEN = 1 / 512


def fact_row_bytes(row_tokens: int, eos_per_token: float = DEFAULT_EOS_PER_TOKEN) -> int:
    """Bytes a slice row's facts take in its keeper's memory, from its rank file's write until
    its owner has them (tokpack.packer.owned_facts): its xxh3-64, EOS count, first EOS column's
    place and its order among the facts' rounds (29 in all, 32 here), and 8 bytes an EOS column
    (4, held twice while they are laid out in order), `eos_per_token` of its tokens."""
    return 32 + 8 * int(row_tokens * eos_per_token)


def eos_per_token(sources) -> float:
    """The most EOS tokens a token of any of `sources` (opened sources: their manifests' documents
    over their tokens; every document of a packed source ends with an EOS): a row's EOS columns
    planned from the densest source, so that a corpus of short documents is planned as such.
    DEFAULT_EOS_PER_TOKEN where no source says."""
    found = [
        int(m["documents"]) / int(m["tokens"])
        for m in (getattr(src, "manifest", None) for src in sources)
        if isinstance(m, dict)
        and isinstance(m.get("documents"), int)
        and isinstance(m.get("tokens"), int)
        and m["tokens"] > 0
    ]
    return max(found) if found else DEFAULT_EOS_PER_TOKEN


class NodeEpoch:
    """One epoch on one process: what it reads, what it keeps, what it owns."""

    def __init__(
        self,
        job,
        sources,
        rows: RankRows,
        first: int,
        node: int,
        nodes: int,
        ranks: tuple[int, int],
        prepared: dict,
        procs: tuple[int, int] = (0, 1),
    ):
        """`node` of `nodes`, of `ranks` (its first and last); `procs`: (p, P), this process's
        place among its node's P (node_procs)."""
        self.job, self.plan, self.sources, self.prepared = job, job.plan, sources, prepared
        self.rows, self.first, self.node, self.nodes, self.ranks = rows, first, node, nodes, ranks
        self.proc, self.procs = procs
        self.me, self.world = node * self.procs + self.proc, nodes * self.procs  # this process, all of them
        self.per_node = ranks[1] - ranks[0] + 1
        # the node's ranks whose rank files this process writes
        self.mine = range(ranks[0] + self.proc, ranks[1] + 1, self.procs)
        # The packing answers how its rows are built: from a row table's document pieces (with
        # padding), or windows the plan locates.
        self.entry = packings.of_plan(job.plan)
        self.padded = self.entry.padded
        # The slice: its epoch positions in increasing order (every rank's, mixed), as stage --node plans them.
        parts = list(rows.node_positions(first, self.plan.samples, ranks, max(1, (8 << 20) // 8)))
        if self.procs > 1:  # this process's ranks' among them
            parts = [pos[(rows.rank_of(pos + first) - ranks[0]) % self.procs == self.proc] for pos in parts]
        self.positions = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        # The epoch shards this process owns (their manifest entries and row hashes for RUN): their
        # rows are not sent here, only each row's facts (tokpack.packer.owned_facts), once its
        # keeper has written it.
        self.owned = list(range(self.me, job.n_shards, self.world))
        self.owned_rows = sum(job.shard_range(i)[1] - job.shard_range(i)[0] for i in self.owned)
        # The store (the slice's rows), each row's tokens still unfilled (its padding, once every
        # piece is in), the positions, and each row's facts for its owner (fact_row_bytes).
        P = len(self.positions)
        self.facts_bytes = fact_row_bytes(self.plan.row_tokens, eos_per_token(sources)) * P  # after the rounds only
        self.keep_bytes = P * (job.row_bytes + 8) + 8 * P + self.facts_bytes
        # Out of core the store is bucket files: what stays in memory is the positions and the
        # unfilled counts (beside a round's buffers, then beside two buckets and the facts).
        self.index_bytes = 8 * P + 8 * P

    @property
    def store_rows(self) -> int:
        """Rows of the process's store: its part of the node's slice, in position order."""
        return len(self.positions)

    def disk_bytes(self, out_of_core: bool) -> int:
        """DEST's bytes at the peak: the rank files (rows, row hashes, index about a fragment a
        row) and the owned shards' row hashes and padding (their entries built from their rows'
        facts, owned_facts.OwnedShards); out of core, the bucket files too: every slice row with two
        RECORDs (about one piece a row)."""
        P, rb = len(self.positions), self.job.row_bytes
        small = P * (16 + 4 * self.padded) + self.owned_rows * (8 + 4 * self.padded)
        # out of core a bucket is removed once read, as the rank files grow: the buckets' bytes
        # are the peak, the slice's rows among them
        return small + (P * (rb + 2 * RECORD.itemsize) if out_of_core else P * rb)

    def node_of(self, g: np.ndarray) -> np.ndarray:
        return self.rows.rank_of(g + self.first) // self.per_node

    def keeper_of(self, g: np.ndarray) -> np.ndarray:
        """The process that writes row g's rank file: of its node, the one whose ranks hold g's."""
        if self.procs == 1:
            return self.node_of(g)
        r = self.rows.rank_of(g + self.first)
        node = r // self.per_node
        return node * self.procs + (r - node * self.per_node) % self.procs

    def owner_of(self, g: np.ndarray) -> np.ndarray:
        """The process that owns row g's epoch shard (shard i: process i mod N*P)."""
        return (g // self.job.shard_samples) % self.world

    def routes(self, pieces: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(destination process of each copy, the piece it is): each piece goes once, to the
        process that writes its row's rank file (its shard's owner gets the row's facts from
        that process after the rounds: tokpack.packer.owned_facts)."""
        return self.keeper_of(pieces["g"]), np.arange(len(pieces))

    def runs(self, q: int | None = None) -> list[tuple[int, int, int]]:
        """This process's (or process `q`'s) part of the sources: runs (source, first shard, end
        shard) of whole shards."""
        q = self.me if q is None else q
        runs = split_shards(self.plan, self.sources, self.world)
        return runs[q] if q < len(runs) else []  # fewer source shards than processes: none

    def kept_shards(self) -> dict[int, set[int]]:
        """source -> the shards --keep-sources keeps of it: those this process reads, and the next
        one, which its last windows may run into, unless another process of its node reads it
        (that one keeps it) (also what `plan shuffle --to-nodes` counts)."""
        need: dict[int, set[int]] = {}
        for s, k0, k1 in self.runs():
            need.setdefault(s, set()).update(range(k0, min(k1 + 1, len(self.sources[s].shards))))
        first = self.node * self.procs
        for q in range(first, first + self.procs):
            for s, k0, k1 in self.runs(q) if q != self.me else ():
                need.get(s, set()).difference_update(range(k0, k1))
        return need


def source_pieces(ne, tokens: int, mapped: bool = True):
    """(pieces, tokens, starts, held): every piece process `ne.me` reads, about `tokens` tokens at a
    time, in read order, each with its output row g, offset in the row and length (WIRE_PIECE),
    its tokens tokens[start:][:length]. `tokens` is a mapping of the source's pages (windows,
    `mapped`: a read block's, shuffle.source_windows.iter_source_windows; best-fit: the shard's), valid
    after the next item (`held`), or (windows, not `mapped`) the read buffer, valid until the
    next item, as transport.exchange_rounds sends them. A window is a piece of a whole row; one
    the epoch uses twice comes twice. Windows are mapped in memory, not out of core: there the
    mappings cost more CPU than the reads' copies save (measured: 5% of an epoch's, in the
    rank files' write after the rounds)."""
    if ne.padded:
        yield from _document_pieces(ne, ne.runs(), tokens)
        return
    plan, job = ne.plan, ne.job
    row = plan.row_tokens
    for s, w0, w1, k0, k1 in shard_segments(plan, ne.sources, ne.runs()):
        # Shards --keep-sources hashed just now, as it copied or verified them, are not hashed
        # again: an empty run of shards to hash, which takes what it is fed and checks nothing.
        hashed = set(range(k0, k1)) <= getattr(ne.sources[s], "hashed", frozenset())
        shards = ShardHashes(ne.sources[s], k0, k0 if hashed else k1, _changed)
        for a, block in iter_source_windows(
            plan,
            s,
            ne.sources[s],
            max(1, tokens // row) * job.row_bytes,
            w0=w0,
            w1=w1,
            on_read=lapped("read", shards.feed),
            mapped=mapped,
        ):  # the read-ahead thread's CPU (its reads and their hashes) is the read phase's
            out = list(plan.outputs_of(s, np.arange(a, a + len(block), dtype=np.int64)))
            if out:  # one item a block (its windows a source upsampled uses several times, each as often)
                pieces = np.zeros(sum(len(sel) for _, sel, _ in out), WIRE_PIECE)
                pieces["g"], pieces["length"] = np.concatenate([g for _, _, g in out]), row
                # The block itself, not a copy: a mapping of the source's pages (or an array of
                # its own where it crosses a shard's end), which stays valid (`held`: a round
                # takes the pieces of as many blocks as it holds); or the read buffer, which the
                # read-ahead thread refills once the next block is asked for (a round sends one
                # block's pieces first).
                yield (
                    pieces,
                    block.reshape(-1),
                    np.concatenate([sel for _, sel, _ in out]).astype(np.int64) * row,
                    mapped,
                )
        shards.finish()


def _document_pieces(ne, runs, tokens: int):
    """A best-fit epoch's pieces, by the row table's files of each source shard (as the
    best-fit scatter pass reads them), each shard mapped and verified whole first."""
    job = ne.job
    built = ne.entry.open_table(ne.prepared["table"], ne.prepared["table_xxh3_128"])
    for s, k0, k1 in runs:
        src = ne.sources[s]
        for k in range(k0, k1):
            n = int(src.shards[k]["tokens"])
            with phase("read", n * src.dtype.itemsize):
                data = map_file(src.path / src.shards[k]["path"], 0, n * src.dtype.itemsize).view(src.dtype)
                # a shard --keep-sources hashed just now, as it copied or verified it, is not hashed again
                found = (
                    src.shards[k]["xxh3_128"] if k in getattr(src, "hashed", ()) else xxhash.xxh3_128_hexdigest(data)
                )
            if found != src.shards[k]["xxh3_128"]:
                _changed(src.path / src.shards[k]["path"], src.shards[k]["xxh3_128"], found)
            chunk = max(1, tokens // max(1, job.plan.row_tokens // 4))
            for found_pieces in built.shard_pieces(s, k, chunk):
                pieces = np.zeros(len(found_pieces), WIRE_PIECE)
                for f in ("g", "row_offset", "length"):
                    pieces[f] = found_pieces[f]
                yield pieces, data, found_pieces["local"].astype(np.int64), True  # the shard's mapping: held
            del data


def _changed(shard, expected: str, found: str):
    raise source_changed_error({"shard": str(shard), "expected": expected, "found": found})


# Bytes of index arithmetic per token a round moves (tokpack.packer.pieces.ranges' temporaries, one call at a time).
TOKEN_OVERHEAD = 24
# What a process holds beside --memory, whatever the epoch's size: the interpreter, numpy,
# mpi4py and MPI's own buffers, RANGE_CHUNK tokens of index arithmetic, MAX_CHUNK_BYTES of rows
# on their way to a writer with their EOS mask and index (bench/nodes.py and bench/rounds.py
# measure it, BENCHMARKS.md "Straight to the nodes"; tests/test_mpi.py holds every process to it).
MEMORY_ALLOWANCE = 256 << 20
# Bytes per row of a bucket read back, beyond 4 copies of its tokens (the bucket's rows, the
# tokens read from its file, RankFiles' copy of one rank's rows, the index's EOS mask and more):
# its records and the rank and index arithmetic.
BUCKET_ROW_OVERHEAD = 128


def bucket_row_bytes(row_bytes: int) -> int:
    """--memory a row of a bucket takes out of core: two buckets are in memory at once (the one
    written, its 4 copies, and the next one read back meanwhile on a thread, node_store.
    BucketRead: its rows, records and arithmetic); at a handover, 3 buckets' rows (the one done,
    the one given, the next one begun), which this covers as well."""
    return 4 * row_bytes + BUCKET_ROW_OVERHEAD + row_bytes + BUCKET_ROW_OVERHEAD


def memory_plan(ne: NodeEpoch, memory: int) -> tuple[int, int | None]:
    """(tokens a process sends per round, rows a bucket out of core or None in memory); what
    `plan shuffle --to-nodes` reports too. A round holds what it read, its send buffer (each
    piece once, to its keeper), what it receives (about as much), what waits for the next round
    and what the round before received (delivered meanwhile, transport.exchange_rounds), each
    token with its index arithmetic. In memory when the node's stores fit beside a round's
    buffers; else out of core (node_store.bucket_layout): the rounds append what they receive
    to bucket files in DEST's scratch (one more copy a token), and the buckets, read back in
    order once the rounds are done (the next one read while one is written: two in memory,
    bucket_row_bytes), take what the positions, unfilled counts and the rows' facts (which the
    rounds do not hold: they are taken as the rank files are written) leave of --memory.
    Raises when even that does not fit."""
    job = ne.job
    # read, sent, received, waiting for the next round, and the round before still being delivered
    per_token = 5 * job.token_dtype.itemsize + TOKEN_OVERHEAD
    least = MIN_ROUND_ROWS * job.plan.row_tokens
    limit = min(MAX_MESSAGE_BYTES // job.token_dtype.itemsize, max(MAX_ROUND_BYTES // job.token_dtype.itemsize, least))
    t = min((memory - ne.keep_bytes) // per_token, limit)
    if t >= least:
        return int(t), None
    budget = memory - ne.index_bytes
    per_token += job.token_dtype.itemsize + 8  # the copy appended to a bucket file, its index
    t = min(budget // per_token, limit)
    bucket_rows = (budget - ne.facts_bytes) // bucket_row_bytes(job.row_bytes)
    if t < least or bucket_rows < MIN_ROUND_ROWS:
        need = ne.index_bytes + max(
            per_token * least, ne.facts_bytes + MIN_ROUND_ROWS * bucket_row_bytes(job.row_bytes)
        )
        whose = "node" if ne.procs == 1 else "process"  # a process of P plans with --memory / P
        raise TokpackError(
            f"this {whose}'s rows of epoch {job.plan.epoch} do not fit --memory, even out of core",
            where="--memory",
            expected=f">= {need} bytes ({ne.index_bytes} for the positions and unfilled counts of "
            f"the {whose}'s {ne.store_rows} rows, the rest for a round's buffers, or for their facts "
            f"({ne.facts_bytes}) and a bucket of {MIN_ROUND_ROWS} rows)",
            found=f"{memory} bytes"
            + ("" if ne.procs == 1 else f" (--memory / {ne.procs}: the node's processes share it)"),
            hint="give more --memory, or more nodes",
        )
    return int(t), int(bucket_rows)
