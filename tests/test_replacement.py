"""A node's rows rebuilt from the sources alone (tokpack.packer.replacement), on RUNs of
`shuffle --to-nodes` under `mpirun --oversubscribe -n 4` (issue 33, items 3, 4 and 6): a
replacement node within --memory, part by part, byte for byte the exchange's slice;
`validate SLICE --against RUN` proving the slice's rows and order from the sources; later epochs
from kept sources opening nothing in the shared source folder."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import random_docs, write_source
from test_mpi import K, M, MEMORY, NODES, SEQ, cli, to_nodes, tree
from tokpack.formats.manifest import MANIFEST, epoch_dir_name
from tokpack.packer.cli import main

ROW_BYTES = (SEQ + 1) * 2  # uint16 tokens
# A replacement node's budget: about 46 rows a part (replacement.part_rows_of), a few hundred a node and epoch.
SMALL = 80 << 10


def exchanged(root, *args, epochs: int = 2):
    """A source and the RUN --to-nodes wrote from it (node slices at root/node{n})."""
    source = write_source(root / "src", random_docs(np.random.default_rng(3), 200, 1000, 0), docs_per_shard=40)
    run = root / "exchanged"
    done = to_nodes(run, str(root / "node{node}"), source, "--seq-len", SEQ, "--seed", 5, "--epochs", epochs,
                    "--shard-samples", 12, "--memory", MEMORY, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return source, run


@pytest.fixture(scope="module")
def windows(tmp_path_factory):
    root = tmp_path_factory.mktemp("windows")
    return (root, *exchanged(root))


@pytest.fixture(scope="module")
def best_fit(tmp_path_factory):
    root = tmp_path_factory.mktemp("best_fit")
    return (root, *exchanged(root, "--packing", "best-fit", epochs=1))


def node_rows(dest) -> list[int]:
    return [sum(s["samples"] for s in json.loads(p.read_text())["shards"])
            for p in sorted(dest.glob(f"epoch-*/{MANIFEST}"))]


def replace_node(run, dest, node: int, memory: int = SMALL) -> dict:
    return json.loads(cli("stage", run, dest, "--node", f"{node}/{NODES}", "--ranks-per-node", K,
                          "--micro-batch", M, "--memory", memory, "--json"))


@pytest.mark.parametrize("kind", ["windows", "best_fit"])
def test_a_replacement_node_within_memory_rebuilds_the_exchanges_slice_part_by_part(kind, request, tmp_path):
    """stage --node on a --to-nodes RUN with a --memory far below the node's rows: several parts
    an epoch, none larger than --memory allows, the exchange's bytes, read amplification <= 1.3."""
    root, _, run = request.getfixturevalue(kind)
    summary = replace_node(run, tmp_path / "again", 2)
    assert tree(tmp_path / "again") == tree(root / "node2")
    rows = node_rows(root / "node2")
    assert summary["part_rows"] * 2 * ROW_BYTES <= SMALL  # a part's rows, twice (read order, position order)
    assert all(summary["part_rows"] < n for n in rows), (summary, rows)  # the node's rows are never held at once
    assert summary["parts"] >= sum(-(-n // summary["part_rows"]) for n in rows)
    assert summary["read_amplification"] <= 1.3, summary
    if kind == "windows":
        assert summary["read_amplification"] > 1  # every row read once, and RUN's row hashes
    assert not (tmp_path / "again" / ".tokpack-work").exists()


def test_a_replacement_node_merges_adjacent_windows_into_one_ranged_read(windows, tmp_path, monkeypatch):
    """Every position of an epoch in one part (a node holding them all, one source read once): the
    part's windows are adjacent in source order, so they are one ranged read, not one per window."""
    from tokpack.formats.manifest import read_manifest
    from tokpack.formats.shards import PackedSource
    from tokpack.packer.replacement import SourceRows

    _, _, run = windows
    calls = []
    real = PackedSource.read_into
    monkeypatch.setattr(PackedSource, "read_into", lambda self, start, out, handles=None: (
        calls.append(len(out)), real(self, start, out, handles))[1])
    d = run / epoch_dir_name(0)
    m = read_manifest(d, kind="epoch")
    source = SourceRows(d, m, 16 << 20, tmp_path / "work")
    try:
        positions = np.arange(int(m["samples"]), dtype=np.int64)
        assert source.part_rows >= len(positions)
        source.check(positions, *source.rows(positions))  # each row's hash is RUN's
    finally:
        source.close()
    assert calls == [len(positions) * (SEQ + 1)], calls[:5]


def test_a_replacement_node_with_too_little_memory_is_one_line(windows, tmp_path):
    _, _, run = windows
    res = CliRunner().invoke(main, ["stage", str(run), str(tmp_path / "x"), "--node", f"1/{NODES}",
                                    "--ranks-per-node", str(K), "--micro-batch", str(M), "--memory", "1KiB"])
    assert res.exit_code == 1 and "--memory is too small" in res.output, res.output
    res = CliRunner().invoke(main, ["stage", str(run), str(tmp_path / "y"), "--memory", "1MiB"])
    assert res.exit_code == 1 and "--memory applies only to a replacement node" in res.output, res.output
