"""A --to-nodes RUN proven by `validate RUN --against SOURCES` (issue 42, item 3): RUN holds only
each shard's row hashes (and best-fit padding), and each position's row hash is proven against
the row the plan puts there, rebuilt from the sources, as a materialised run's order is. On main,
rows swapped in RUN's `.ds.rows` with the manifest's checksums rewritten to match passed with OK:
no order proof was made for such a RUN. Each test that tampers with RUN fails on main."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import xxhash
from click.testing import CliRunner

from conftest import random_docs, write_source
from test_mpi import MEMORY, NODES, SEQ, to_nodes
from tokpack.formats.constants import MANIFEST
from tokpack.formats.reading import canonical_bytes
from tokpack.formats.names import epoch_dir_name
from tokpack.formats.hashes import hash_hex64
from tokpack.packer.cli import main

E0 = epoch_dir_name(0)
PER = 12  # --shard-samples: several shards, so rows can be swapped across two of them


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("nodes-proof")
    return write_source(root / "src", random_docs(np.random.default_rng(7), 120, 1000, 0), docs_per_shard=30)


@pytest.fixture(scope="module", params=["windows", "best-fit"])
def run(request, source, tmp_path_factory) -> tuple[str, Path]:
    """A --to-nodes RUN of 4 MPI processes (epoch 0), windows or best-fit."""
    root = tmp_path_factory.mktemp(f"nodes-proof-{request.param}")
    args = [source, "--seq-len", SEQ, "--seed", 5, "--shard-samples", PER, "--memory", MEMORY, "--epoch", 0]
    if request.param == "best-fit":
        args += ["--packing", "best-fit"]
    done = to_nodes(root / "run", str(root / "node{node}"), *args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not list((root / "run" / E0).glob("*.ds"))  # no token file in RUN: the case proven here
    return request.param, root / "run"


@pytest.fixture
def copy(run, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run[1], out)
    return out


def _validate(*args) -> tuple[int, list[str]]:
    res = CliRunner().invoke(main, ["validate", *map(str, args)])
    return res.exit_code, res.output.splitlines()


def _problems(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith(("CORRUPT /", "MISSING /", "INCOMPLETE /", "UNVERIFIED /"))]


def _rewrite(epoch: Path, edit) -> dict:
    """`edit(manifest, folder)` changes RUN's files; the manifest is written back as tokpack
    writes it (canonical bytes), so only a proof from the sources can tell."""
    m = json.loads((epoch / MANIFEST).read_text())
    edit(m, epoch)
    (epoch / MANIFEST).write_bytes(canonical_bytes(m))
    return m


def _rows(epoch: Path, m: dict, i: int) -> np.ndarray:
    return np.fromfile(epoch / f"{m['shards'][i]['path']}.rows", dtype="<u8")


def _put_rows(epoch: Path, m: dict, i: int, h: np.ndarray) -> None:
    s = m["shards"][i]
    (epoch / f"{s['path']}.rows").write_bytes(h.tobytes())
    s["rows_xxh3_128"] = xxhash.xxh3_128_hexdigest(h.tobytes())
    s["multiset_hash"] = hash_hex64(int(h.sum(dtype=np.uint64)))


def test_an_intact_to_nodes_run_is_proven_and_says_so(run, source):
    packing, path = run
    code, lines = _validate(path, "--against", source)
    assert code == 0, lines
    said = [line for line in lines if line.startswith(f"OK epoch {path / E0} ")]
    want = "order, content and padding proven" if packing == "best-fit" else "order and content proven"
    assert len(said) == 1 and want in said[0] and "from its row hashes against the sources" in said[0], lines
    res = CliRunner().invoke(main, ["validate", str(path), "--against", str(source), "--json"])
    dirs = {d["path"]: d for d in json.loads(res.output)["dirs"]}
    assert want in dirs[str(path / E0)]["proven"] and "proven" not in dirs[str(path)]
    # without --against nothing is proven, and nothing is claimed
    code, lines = _validate(path)
    assert code == 0 and not [line for line in lines if "proven" in line], lines


def test_rows_swapped_with_checksums_rewritten_are_refused_in_one_line(copy, source):
    """The issue's attack: two rows of shard 0 swapped in RUN's `.ds.rows`, the manifest's
    checksums rewritten to match (on main: OK)."""
    epoch = copy / E0
    kept = {}

    def swap(m, folder):
        h = _rows(folder, m, 0)
        kept.update(a=int(h[3]), b=int(h[7]))
        h[[3, 7]] = h[[7, 3]]
        _put_rows(folder, m, 0, h)

    m = _rewrite(epoch, swap)
    code, lines = _validate(copy, "--against", source)
    problems = _problems(lines)
    assert code == 1 and len(problems) == 1, lines
    line = problems[0]
    assert line.startswith(f"CORRUPT {epoch / m['shards'][0]['path']}.rows [row 3 (epoch 0, sample 3)]:"), line
    assert f"expected {kept['a']:016x} (the row the plan puts there" in line and f"found {kept['b']:016x}" in line
    assert "(2 rows differ in 1 shard)" in line and "HINT: " in line and "restore RUN" in line


def test_rows_swapped_across_two_shards_name_the_first_position(copy, source):
    """A row of shard 0 and one of shard 1 exchanged, each shard's checksums and multiset hash
    rewritten (the epoch's multiset is unchanged): one line at shard 0's position."""
    epoch = copy / E0

    def swap(m, folder):
        h0, h1 = _rows(folder, m, 0), _rows(folder, m, 1)
        h0[5], h1[2] = h1[2], h0[5]
        _put_rows(folder, m, 0, h0)
        _put_rows(folder, m, 1, h1)

    m = _rewrite(epoch, swap)
    code, lines = _validate(copy, "--against", source)
    problems = _problems(lines)
    assert code == 1 and len(problems) == 1, lines
    assert problems[0].startswith(f"CORRUPT {epoch / m['shards'][0]['path']}.rows [row 5 (epoch 0, sample 5)]:")
    assert "(2 rows differ in 2 shards)" in problems[0]


def test_a_duplicated_row_with_every_hash_rewritten_is_one_line_at_its_position(copy, source):
    """Row 7 replaced by a copy of row 3, and the shard's and epoch's multiset hashes rewritten:
    one line naming position 7 (not a second line for the multiset the replay disagrees with)."""
    epoch = copy / E0

    def duplicate(m, folder):
        h = _rows(folder, m, 0)
        delta = int(h[3]) - int(h[7])
        h[7] = h[3]
        _put_rows(folder, m, 0, h)
        m["sample_multiset_hash"] = hash_hex64(int(m["sample_multiset_hash"], 16) + delta)

    m = _rewrite(epoch, duplicate)
    code, lines = _validate(copy, "--against", source)
    problems = _problems(lines)
    assert code == 1 and len(problems) == 1, lines
    assert problems[0].startswith(f"CORRUPT {epoch / m['shards'][0]['path']}.rows [row 7 (epoch 0, sample 7)]:")


def test_best_fit_padding_moved_with_its_checksum_rewritten_names_the_row(run, copy, source):
    """A padding token moved between two rows of RUN's `.ds.pad` (total unchanged), its checksum
    rewritten: one line naming RUN's `.ds.pad` and the first row (on main: the manifest's
    `pad_xxh3_128`, no position)."""
    if run[0] != "best-fit":
        pytest.skip("windows have no padding")
    epoch = copy / E0
    where = {}

    def move(m, folder):
        for s in m["shards"]:
            f = folder / f"{s['path']}.pad"
            p = np.fromfile(f, dtype="<u4")
            nz = np.flatnonzero(p[:-1] > 0)
            if len(nz):
                j = int(nz[0])
                p[j] -= 1
                p[j + 1] += 1
                f.write_bytes(p.tobytes())
                s["pad_xxh3_128"] = xxhash.xxh3_128_hexdigest(p.tobytes())
                where.update(file=f, row=j, g=m["shards"].index(s) * PER + j, want=int(p[j]) + 1)
                return
        pytest.fail("no padded row to move")

    _rewrite(epoch, move)
    code, lines = _validate(copy, "--against", source)
    problems = _problems(lines)
    assert code == 1 and len(problems) == 1, lines
    assert problems[0].startswith(f"CORRUPT {where['file']} [row {where['row']} (epoch 0, sample {where['g']})]:")
    assert f"expected {where['want']} padding tokens" in problems[0] and f"found {where['want'] - 1}." in problems[0]


def test_each_node_slice_still_validates_against_the_run(run):
    """`validate DEST --against RUN` of every node's slice: the slice proof is unchanged."""
    path = run[1]
    for n in range(NODES):
        code, lines = _validate(path.parent / f"node{n}", "--against", path)
        assert code == 0, lines
        assert lines[-1].startswith("OK: 1 directory") and lines[-1].endswith("against 1 run"), lines


def test_without_the_row_rebuilder_a_swap_is_still_one_line_naming_the_shard(copy, source):
    """validate_all without `source_rows` (an API caller that gives only the replay): the order
    hash of shard 0's `.ds.rows` differs from the replay's, one line naming RUN's file."""
    from tokpack.packer.validation import validate_all
    from tokpack.shuffle.packings import replay

    epoch = copy / E0

    def swap(m, folder):
        h = _rows(folder, m, 0)
        h[[3, 7]] = h[[7, 3]]
        _put_rows(folder, m, 0, h)

    m = _rewrite(epoch, swap)
    res = validate_all([str(copy)], against=[str(source)], replay=replay, source_rows=None)
    assert not res.ok and len(res.problems) == 1, res.problems
    p = res.problems[0]
    assert p["file"] == f"{epoch / m['shards'][0]['path']}.rows" and p["where"] == "order_hash", p
    assert "1 of" in p["message"], p
