"""What one process of `shuffle --to-nodes` reads (tokpack.packer.exchange): its runs of whole
source shards (NodeEpoch.runs), in order, cut into pieces of output rows (WIRE_PIECE) with
their tokens: a window is a piece of a whole row (the plan's windows, as the scatter pass reads
them); a best-fit epoch's pieces are its documents' (the row table's files of each source shard,
as the best-fit scatter pass reads them). Every source shard is verified as it is read."""

from __future__ import annotations

import numpy as np
import xxhash

from tokpack.formats.io.gate import map_file
from tokpack.packer.phases import lapped, phase
from tokpack.packer.pieces import WIRE_PIECE
from tokpack.shuffle.source_windows import iter_source_windows
from tokpack.shuffle.steps import ShardHashes, shard_segments
from tokpack.shuffle.epoch_job import source_changed_error


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
