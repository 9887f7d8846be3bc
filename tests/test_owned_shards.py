"""The owner's role in `shuffle --to-nodes` (tokpack.packer.owned_facts.OwnedShards): an owned epoch shard's
entry built from its rows' facts (owned_facts) is the one its rows give; its row hashes and
padding reach RUN through RUN's Output (the one sink, formats/outputs.py) and are read back from
the node's scratch through the gate (formats/io.py), never copied past them."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

from tokpack.formats.errors import TokpackError
from tokpack.formats.outputs import EpochShardFormat, LocalOutput
from tokpack.formats.shards import EpochShardWriter
from tokpack.formats.shards import fragment_ends
from tokpack.packer.owned_facts import OwnedShards
from tokpack.packer.rank_files import row_facts

SEQ = 7
ROW = SEQ + 1
PER_SHARD = 5


def node(shards: int, owned: list[int]):
    job = SimpleNamespace(
        plan=SimpleNamespace(epoch=0),
        shard_range=lambda i: (i * PER_SHARD, (i + 1) * PER_SHARD),
        shard_file=lambda i: f"{i:05d}.ds",
    )
    return SimpleNamespace(job=job, owned=owned)


def owned_rows(tmp_path, padded: bool):
    ne = node(4, [1, 3])
    rng = np.random.default_rng(7)
    rows = rng.integers(0, 4, (2 * PER_SHARD, ROW)).astype(np.uint16)  # EOS (0) often, at a row's end too
    rows[0, -1] = 0
    pad = rng.integers(0, 3, 2 * PER_SHARD).astype(np.int64)
    fmt = EpochShardFormat(np.dtype(np.uint16), SEQ, 0, "tok", padded=padded)
    return ne, rows, pad, fmt, tmp_path / "dest" / ".tokpack-work" / "owned", tmp_path / "run" / "epoch-00000"


def entries_from_facts(ne, rows, pad, fmt, scratch, run_epoch, cut: int = 2) -> list:
    """Each owned shard fed, `cut` rows a call, the facts its keepers send (rank_files.row_facts's
    EOS counts and columns, made fragment ends as the owner makes them)."""
    owned = OwnedShards(ne.job, fmt, scratch, run_epoch)
    for k, i in enumerate(ne.owned):
        for a in range(k * PER_SHARD, (k + 1) * PER_SHARD, cut):
            b = min(a + cut, (k + 1) * PER_SHARD)
            hashes, counts, cols, _ = row_facts(rows[a:b], fmt.dtype, ROW, fmt.eos_id)
            owned.add(i, fragment_ends(counts.astype(np.int64), cols.astype(np.int64), ROW), hashes, pad[a:b])
    return owned.entries


@pytest.mark.parametrize("padded", [False, True])
def test_an_owned_shards_entry_from_its_rows_facts_is_the_one_its_rows_give(tmp_path, padded):
    """The entry and the `.ds.rows`/`.ds.pad` the owner builds from its rows' facts are, byte for
    byte, those the epoch shard writer gives from the rows themselves (`tokpack shuffle`'s)."""
    ne, rows, pad, fmt, scratch, run_epoch = owned_rows(tmp_path, padded)
    entries = entries_from_facts(ne, rows, pad, fmt, scratch, run_epoch, cut=3)
    for k, (i, entry) in enumerate(entries):
        whole = tmp_path / "whole"
        whole.mkdir(exist_ok=True)
        writer = EpochShardWriter(whole, f"{i:05d}.ds", np.uint16, SEQ, 0, "tok", padded=padded)
        writer.write_rows(rows[k * PER_SHARD : (k + 1) * PER_SHARD])
        if padded:
            writer.write_pad(pad[k * PER_SHARD : (k + 1) * PER_SHARD])
        assert entry == writer.close()
        for suffix in [".rows", ".pad"] if padded else [".rows"]:
            assert (run_epoch / f"{i:05d}.ds{suffix}").read_bytes() == (whole / f"{i:05d}.ds{suffix}").read_bytes()


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
    ne, rows, pad, fmt, scratch, run_epoch = owned_rows(tmp_path, padded)
    entries = entries_from_facts(ne, rows, pad, fmt, scratch, run_epoch)
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
    ne, rows, pad, fmt, scratch, run_epoch = owned_rows(tmp_path, False)
    with pytest.raises(TokpackError, match="outside its folder"):
        entries_from_facts(ne, rows, pad, fmt, scratch, run_epoch)
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
    ne, rows, pad, fmt, scratch, run_epoch = owned_rows(tmp_path, False)
    with pytest.raises(TokpackError, match="00001.ds.rows") as e:
        entries_from_facts(ne, rows, pad, fmt, scratch, run_epoch)
    assert "\n" not in str(e.value)
    assert not any(run_epoch.iterdir())
