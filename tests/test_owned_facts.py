"""What an epoch shard's owner accepts of its rows' facts in `shuffle --to-nodes`
(tokpack.packer.owned_facts.received): each owned row's facts exactly once, from the process that
keeps the row, its EOS columns as many as counted and inside the row; anything else from a peer
is one line naming that node, never an entry built from it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tokpack.formats.errors import TokpackError
from tokpack.packer.owned_facts import FACT, fragment_ends, received

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
