"""The owner's role in `shuffle --to-nodes` (tokpack.packer.owned_shards): an owned epoch shard's
row hashes and padding reach RUN through RUN's Output (the one sink, formats/outputs.py) and are
read back from the node's scratch through the gate (formats/io.py), never copied past them."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

from tokpack.formats.errors import TokpackError
from tokpack.formats.outputs import EpochShardFormat, LocalOutput
from tokpack.formats.shards import EpochShardWriter
from tokpack.packer.owned_shards import hash_owned_shards

SEQ = 7
ROW = SEQ + 1
PER_SHARD = 5


class Rows:
    """A node's stores in memory (store_rows numbering), as node_store.InMemory gives them."""

    def __init__(self, rows: np.ndarray):
        self.rows_of = rows

    def rows(self, lo: int, hi: int):
        yield lo, self.rows_of[lo:hi]


def node(shards: int, owned: list[int]):
    job = SimpleNamespace(
        plan=SimpleNamespace(epoch=0),
        shard_range=lambda i: (i * PER_SHARD, (i + 1) * PER_SHARD),
        shard_file=lambda i: f"{i:05d}.ds",
    )
    base = np.full(shards, -1, dtype=np.int64)
    base[owned] = np.arange(len(owned)) * PER_SHARD
    return SimpleNamespace(job=job, owned=owned, owned_base=base, positions=np.zeros(0, dtype=np.int64))


def owned_rows(tmp_path, padded: bool):
    ne = node(4, [1, 3])
    rng = np.random.default_rng(7)
    rows = rng.integers(1, 1000, (2 * PER_SHARD, ROW)).astype(np.uint16)
    pad = rng.integers(0, 3, 2 * PER_SHARD).astype(np.int64)
    fmt = EpochShardFormat(np.dtype(np.uint16), SEQ, 0, "tok", padded=padded)
    return ne, Rows(rows), pad, fmt, tmp_path / "dest" / ".tokpack-work" / "owned", tmp_path / "run" / "epoch-00000"


@pytest.mark.parametrize("padded", [False, True])
def test_an_owned_shards_row_hashes_reach_run_through_its_output(tmp_path, monkeypatch, padded):
    """Every file the owner puts in RUN is committed by RUN's Output (Output.commit_file): a
    recording Output sees each `.ds.rows` (and best-fit `.ds.pad`), and RUN holds nothing else."""
    committed = []
    original = LocalOutput.commit_file

    def recording(self, tmp, final):
        committed.append(os.path.relpath(final, tmp_path))
        original(self, tmp, final)

    monkeypatch.setattr(LocalOutput, "commit_file", recording)
    ne, stores, pad, fmt, scratch, run_epoch = owned_rows(tmp_path, padded)
    entries = hash_owned_shards(ne, stores, pad, scratch, run_epoch, fmt)
    suffixes = [".rows", ".pad"] if padded else [".rows"]
    want = [f"run/epoch-00000/{i:05d}.ds{s}" for i in (1, 3) for s in suffixes]
    assert committed == want
    assert sorted(p.name for p in run_epoch.iterdir()) == sorted(os.path.basename(w) for w in want)
    assert [i for i, _ in entries] == [1, 3] and all("rows_xxh3_128" in e for _, e in entries)
    assert list(scratch.iterdir()) == []  # the owned shards' files in scratch are gone once sent


def test_a_row_hashes_file_swapped_for_a_link_in_scratch_is_refused_by_the_gate(tmp_path, monkeypatch):
    """A `.ds.rows` in the node's scratch that is a link to a file elsewhere (the same bytes) is
    refused at its read (the gate: a file stays inside its folder), not copied into RUN."""
    close = EpochShardWriter.close

    def close_then_link(self):
        entry = close(self)
        made = self.directory / f"{self.name}.rows"
        outside = self.directory.parent / f"elsewhere-{self.name}.rows"
        made.rename(outside)
        made.symlink_to(outside)
        return entry

    monkeypatch.setattr(EpochShardWriter, "close", close_then_link)
    ne, stores, pad, fmt, scratch, run_epoch = owned_rows(tmp_path, False)
    with pytest.raises(TokpackError, match="outside its folder"):
        hash_owned_shards(ne, stores, pad, scratch, run_epoch, fmt)
    assert not any(run_epoch.iterdir())  # no file, no temporary left in RUN


def test_a_row_hashes_file_changed_in_scratch_is_refused_against_its_entry(tmp_path, monkeypatch):
    """A `.ds.rows` that differs from what its writer hashed (a bad local disk) is one line naming
    it, and RUN gets nothing of it."""
    close = EpochShardWriter.close

    def close_then_damage(self):
        entry = close(self)
        made = self.directory / f"{self.name}.rows"
        data = bytearray(made.read_bytes())
        data[0] ^= 1
        made.write_bytes(bytes(data))
        return entry

    monkeypatch.setattr(EpochShardWriter, "close", close_then_damage)
    ne, stores, pad, fmt, scratch, run_epoch = owned_rows(tmp_path, False)
    with pytest.raises(TokpackError, match="00001.ds.rows") as e:
        hash_owned_shards(ne, stores, pad, scratch, run_epoch, fmt)
    assert "\n" not in str(e.value)
    assert not any(run_epoch.iterdir())
