"""What an epoch shard's owner accepts of its rows' facts in `shuffle --to-nodes`
(tokpack.packer.owned_facts.received): each owned row's facts exactly once, from the process that
keeps the row, its EOS columns as many as counted and inside the row; anything else from a peer
is one line naming that node, never an entry built from it."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from tokpack.formats.errors import TokpackError
from tokpack.formats.shards import fragment_ends
from tokpack.packer.owned_facts import FACT, received

ROW = 6  # tokens a row
PER = 4  # rows a shard
WORLD = 2  # processes; this one (0) owns shards 0 and 2 (rows 0-3, 8-11) of 4


def owner():
    job = SimpleNamespace(shard_samples=PER, plan=SimpleNamespace(epoch=0))
    return SimpleNamespace(
        job=job,
        plan=SimpleNamespace(row_tokens=ROW, samples=4 * PER),
        world=WORLD,
        me=0,
        procs=1,
        owned_rows=2 * PER,
        owner_of=lambda g: (g // PER) % WORLD,
        keeper_of=lambda g: g % WORLD,  # row g is written by process g mod 2
    )


def facts(rng):
    """{g: (hash, pad, EOS columns)} of process 0's owned rows."""
    out = {}
    for g in [*range(0, PER), *range(2 * PER, 3 * PER)]:
        cols = np.sort(rng.choice(np.arange(1, ROW + 1), rng.integers(0, 3), replace=False)).astype(np.uint32)
        out[g] = (int(rng.integers(1, 1 << 63)), int(rng.integers(0, 3)), cols)
    return out


def wire(sent: dict[int, list[tuple]]):
    """(records, columns, counts) as send_each hands them to the owner: grouped by sender."""
    recs, cols, recv = [], [], np.zeros((WORLD, 2), np.int64)
    for s in range(WORLD):
        for g, (h, pad, c) in sent.get(s, []):
            recs.append((g, h, pad, len(c)))
            cols.append(c)
            recv[s] += (1, len(c))
    got = np.array(recs, dtype=FACT)
    return got, np.concatenate(cols) if cols else np.zeros(0, np.uint32), recv


def by_keeper(f: dict) -> dict[int, list[tuple]]:
    sent: dict[int, list[tuple]] = {}
    for g, fact in sorted(f.items(), reverse=True):  # in no particular order
        sent.setdefault(g % WORLD, []).append((g, fact))
    return sent


def test_the_facts_of_every_owned_row_once_give_each_shard_in_order():
    f = facts(np.random.default_rng(1))
    out = list(received(owner(), 0, *wire(by_keeper(f))))
    assert [i for i, *_ in out] == [0, 2]
    for i, ends, hashes, pads in out:
        rows = range(i * PER, (i + 1) * PER)
        assert hashes.tolist() == [f[g][0] for g in rows] and pads.tolist() == [f[g][1] for g in rows]
        want = sorted(
            {k * ROW + int(c) for k, g in enumerate(rows) for c in f[g][2]} | {k * ROW for k in range(1, PER + 1)}
        )
        assert ends.tolist() == want


def refused(sent, what: str, row: int, node: str = "node 1"):
    with pytest.raises(TokpackError, match=f"sample {row}\\]: {node} sent wrong row facts.*: {what}") as e:
        list(received(owner(), 0, *wire(sent)))
    assert str(e.value).count("\n") == 0


def test_a_row_whose_facts_come_twice_is_refused_naming_the_sender():
    f = facts(np.random.default_rng(2))
    sent = by_keeper(f)
    sent[1].append((9, f[9]))
    refused(sent, "a row twice", 9)


def test_a_row_whose_facts_are_missing_is_refused_naming_its_keeper():
    f = facts(np.random.default_rng(3))
    sent = by_keeper(f)
    sent[1] = [x for x in sent[1] if x[0] != 11]
    refused(sent, "no facts for a row it keeps", 11)


def test_facts_from_a_process_that_does_not_keep_the_row_are_refused():
    f = facts(np.random.default_rng(4))
    sent = by_keeper(f)
    moved = next(x for x in sent[0] if x[0] == 2)
    sent[0].remove(moved)
    sent[1].append(moved)  # row 2 is process 0's to write
    refused(sent, "a row it does not keep", 2)


def test_facts_of_a_row_another_process_owns_are_refused():
    f = facts(np.random.default_rng(5))
    sent = by_keeper(f)
    sent[1].append((5, f[1]))  # shard 1 (rows 4-7) is process 1's
    refused(sent, "a row it does not keep, or not this owner's", 5)


@pytest.mark.parametrize("cols", [[0], [ROW + 1], [3, 3], [4, 2]])
def test_eos_columns_outside_their_row_or_out_of_order_are_refused(cols):
    f = facts(np.random.default_rng(6))
    f[9] = (f[9][0], f[9][1], np.array(cols, np.uint32))
    refused(by_keeper(f), "EOS columns or padding outside the row", 9)


def test_eos_columns_more_than_the_records_count_are_refused():
    f = facts(np.random.default_rng(7))
    got, cols, recv = wire(by_keeper(f))
    recv[1, 1] += 1
    with pytest.raises(TokpackError, match="node 1 sent wrong row facts.*EOS columns"):
        received(owner(), 0, got, np.concatenate([cols, [1]]).astype(np.uint32), recv)


def test_fragment_ends_hold_an_eos_at_a_rows_end_once():
    ends = fragment_ends(np.array([2, 0, 1]), np.array([2, ROW, ROW - 1]), ROW)
    assert ends.tolist() == [2, ROW, 2 * ROW, 2 * ROW + ROW - 1, 3 * ROW]


class _World:
    """W processes in threads, as MPI's collectives give them to send_each: each call a step all
    take together (a barrier before and after the board is read)."""

    def __init__(self, size: int):
        self.size, self.barrier, self.board = size, threading.Barrier(size, timeout=30), [None] * size


class _Comm:
    def __init__(self, world: _World, rank: int):
        self.world, self.rank = world, rank

    def Get_size(self) -> int:
        return self.world.size

    def _swap(self, mine, take) -> None:
        self.world.board[self.rank] = mine
        self.world.barrier.wait()
        take(self.world.board)
        self.world.barrier.wait()

    def Ialltoall(self, send, recv):
        def take(board):
            for s, theirs in enumerate(board):
                recv[s] = theirs[self.rank]

        self._swap(np.array(send), take)
        return SimpleNamespace(Test=lambda: True)

    def Alltoallv(self, send, recv):
        buf, counts, displs, _ = send
        out, _, rdispls, _ = recv

        def take(board):
            for s, (theirs, c, d) in enumerate(board):
                out[rdispls[s] : rdispls[s] + c[self.rank]] = theirs[d[self.rank] : d[self.rank] + c[self.rank]]

        self._swap((np.array(buf), counts, displs), take)


@pytest.mark.parametrize("padded", [False, True])
def test_the_facts_rounds_give_every_owner_the_entries_its_rows_give(tmp_path, monkeypatch, padded):
    """3 processes, 40 rows in shards of 6 (the last of 4), each row kept by one process and its
    shard owned by another or the same, 2 rows a round (the owners' rows unequal, 16, 12 and 12:
    the last two rounds bring two owners nothing): each owner's entries and `.ds.rows`/`.ds.pad` are those the epoch shard writer gives
    from the rows themselves."""
    from tokpack.formats.outputs import EpochShardFormat
    from tokpack.formats.shards import EpochShardWriter
    from tokpack.packer import owned_facts
    from tokpack.packer.owned_facts import OwnedShards
    from tokpack.packer.rank_files import row_facts

    monkeypatch.setattr(owned_facts, "FACT_ROWS", 2)
    W, n, per, width = 3, 40, 6, 9
    rng = np.random.default_rng(8)
    rows = rng.integers(0, 3, (n, width)).astype(np.uint16)  # EOS (0) often
    pads = rng.integers(0, 4, n) if padded else np.zeros(n, np.int64)
    fmt = EpochShardFormat(np.dtype(np.uint16), width - 1, 0, "tok", padded=padded)
    shards = -(-n // per)
    job = SimpleNamespace(
        shard_samples=per,
        n_shards=shards,
        plan=SimpleNamespace(epoch=0),
        shard_range=lambda i: (i * per, min(n, (i + 1) * per)),
        shard_file=lambda i: f"{i:05d}.ds",
    )
    keeper = (np.arange(n) * 7) % W
    world, done, failed = _World(W), {}, []

    def process(q: int) -> None:
        try:
            positions = np.flatnonzero(keeper == q)
            owned = [i for i in range(shards) if i % W == q]
            ne = SimpleNamespace(
                job=job,
                plan=SimpleNamespace(row_tokens=width, samples=n),
                world=W,
                me=q,
                procs=1,
                positions=positions,
                owned=owned,
                owned_rows=sum(job.shard_range(i)[1] - job.shard_range(i)[0] for i in owned),
                owner_of=lambda g: (g // per) % W,
                keeper_of=lambda g: (g * 7) % W,
            )
            kept = owned_facts.KeptFacts(positions)
            for part in (positions[::2], positions[1::2]):  # rows given in any order, as rank files give them
                hashes, counts, cols, _ = row_facts(rows[part], fmt.dtype, width, 0)
                kept.add(part, hashes, counts, cols)
            kept.finish()
            out = OwnedShards(job, fmt, tmp_path / f"scratch{q}", tmp_path / "run")
            owned_facts.send_facts(_Comm(world, q), SimpleNamespace(BYTE=None), ne, kept, pads[positions], out)
            done[q] = out.entries
        except BaseException as e:  # noqa: BLE001 - the test's failure, below
            failed.append(e)
            world.barrier.abort()

    threads = [threading.Thread(target=process, args=(q,)) for q in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failed, failed
    assert owned_facts.fact_rounds(SimpleNamespace(job=job, world=W)) == 8
    whole = tmp_path / "whole"
    whole.mkdir()
    for q in range(W):
        assert [i for i, _ in done[q]] == [i for i in range(shards) if i % W == q]
        for i, entry in done[q]:
            g0, g1 = job.shard_range(i)
            writer = EpochShardWriter(whole, f"{i:05d}.ds", np.uint16, width - 1, 0, "tok", padded=padded)
            writer.write_rows(rows[g0:g1])
            if padded:
                writer.write_pad(pads[g0:g1])
            assert entry == writer.close()
            for suffix in [".rows", ".pad"] if padded else [".rows"]:
                assert (tmp_path / "run" / f"{i:05d}.ds{suffix}").read_bytes() == (
                    whole / f"{i:05d}.ds{suffix}"
                ).read_bytes()


def test_the_facts_are_planned_from_the_densest_sources_documents(tmp_path):
    """node_epoch.eos_per_token: a row's EOS columns planned from the sources' documents a token
    (each document ends with one EOS), the densest source's, not a fixed guess: a corpus of
    short documents is planned with the columns it holds."""
    from conftest import random_docs, write_source

    from tokpack.packer.node_epoch import DEFAULT_EOS_PER_TOKEN, eos_per_token, fact_row_bytes
    from tokpack.shuffle.sources import open_source

    rng = np.random.default_rng(3)
    short = open_source(write_source(tmp_path / "short", random_docs(rng, 400, 1000, 0, 5, 30)))
    long = open_source(write_source(tmp_path / "long", random_docs(rng, 40, 1000, 0, 500, 900)))
    tokens = np.concatenate([np.fromfile(short.path / s["path"], dtype=short.dtype) for s in short.shards])
    measured = float((tokens == 0).mean())  # EOS a token, as the rows' facts will count them
    assert eos_per_token([long, short]) == pytest.approx(measured) and measured > 1 / 30
    assert eos_per_token([long]) < measured
    assert eos_per_token([]) == DEFAULT_EOS_PER_TOKEN  # a source that says nothing: the guess
    row = 4097
    assert fact_row_bytes(row, eos_per_token([long, short])) == 32 + 8 * int(row * measured)
    assert fact_row_bytes(row, eos_per_token([long, short])) > 4 * fact_row_bytes(row)
    # and a process's plan holds them so (NodeEpoch.facts_bytes, in keep_bytes and the buckets' budget)
    from tokpack.formats.slices import RankRows
    from tokpack.packer.node_epoch import NodeEpoch
    from tokpack.shuffle.plan import PLAN_ALGORITHM

    job = SimpleNamespace(
        plan=SimpleNamespace(samples=64, algorithm=PLAN_ALGORITHM, row_tokens=row),
        row_bytes=2 * row,
        n_shards=4,
        shard_samples=16,
        shard_range=lambda i: (i * 16, (i + 1) * 16),
        token_dtype=np.dtype(np.uint16),
    )
    ne = NodeEpoch(job, [long, short], RankRows(4, 2, 0), 0, 0, 2, (0, 1), {})
    assert ne.facts_bytes == len(ne.positions) * fact_row_bytes(row, measured) > 0


def test_a_slice_row_written_without_its_facts_is_an_internal_error_naming_it():
    """KeptFacts.finish: every row of the slice must have had its facts taken as its rank file was
    written; one that did not would leave its owner without them (and is named)."""
    from tokpack.packer.owned_facts import KeptFacts

    kept = KeptFacts(np.array([3, 8, 11], dtype=np.int64))
    kept.add(np.array([11, 3]), np.array([7, 9], np.uint64), np.array([1, 0], np.uint32), np.array([5], np.uint32))
    with pytest.raises(TokpackError, match="without its facts") as e:
        kept.finish()
    assert e.value.where == "sample 8"
    kept.add(np.array([8]), np.array([4], np.uint64), np.array([2], np.uint32), np.array([1, 2], np.uint32))
    kept.finish()
    assert kept.hashes.tolist() == [9, 4, 7] and kept.cols.tolist() == [1, 2, 5]


def test_fragment_ends_and_eos_columns_equal_the_index_a_writer_scans_from_the_rows():
    """formats.shards.eos_columns + fragment_ends (the rank files' facts, RowFragments.of) give
    the index EpochShardWriter.write_index scans from the tokens: after each EOS, every row end."""
    from tokpack.formats.shards import eos_columns

    rng = np.random.default_rng(5)
    for width in (1, 2, 7, 64):
        tokens = rng.integers(0, 3, size=(rng.integers(0, 40), width))  # EOS (0) often, at row ends too
        counts, cols = eos_columns(tokens, 0)
        mask = tokens == 0
        mask[:, -1] = True
        assert fragment_ends(counts, cols, width).tolist() == (np.flatnonzero(mask.ravel()) + 1).tolist()
