"""The gate (docs/COMMANDS.md, "The gate"; issue 32, item 1) for the files written after issue 24:
a node slice's rank files and epoch folders, and the run files `stage --ranks` and
`validate SLICE --against RUN` read. A file linked out of its folder, or longer or shorter than
its manifest records, is one line and exit 1 (a CORRUPT line for validate), and nothing outside
is opened (an audit hook sees every open: tests/test_containment.tokpack)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import random_docs, require, shuffle_run, write_source
from test_containment import corrupt, one_line, tokpack
from tokpack.formats.errors import TokpackError
from tokpack.formats.constants import MANIFEST
from tokpack.formats.names import epoch_dir_name
from tokpack.formats.slices import rank_file_name
from tokpack.packer.slicing import stage_slice

SEQ, W, M = 31, 4, 3
SLICE = ["--ranks", "0-1", "--world-size", W, "--micro-batch", M]
NODE = ["--node", "0/2", "--ranks-per-node", 2, "--micro-batch", M]  # the same ranks, by node
READ = ["--rank", 1, "--world-size", W, "--micro-batch", M, "--count", 8]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A best-fit run of two epochs (every shard has .ds.rows and .ds.pad) and the slice of
    ranks 0-1 staged from it."""
    base = tmp_path_factory.mktemp("gate")
    rng = np.random.default_rng(8)
    src = write_source(base / "src", random_docs(rng, 120, 1000, 0, 5, 50))
    shuffle_run(
        [str(src)],
        str(base / "run"),
        seq_len=SEQ,
        seed=3,
        epochs=[0, 1],
        samples=None,
        shard_samples=20,
        memory=8 << 20,
        packing="best-fit",
        jitter=False,
        log=None,
    )
    stage_slice(str(base / "run"), base / "slice", ranks="0-1", world_size=W, micro_batch=M)
    shard = json.loads((base / "run" / epoch_dir_name(1) / MANIFEST).read_text())["shards"][0]
    assert {"rows_xxh3_128", "pad_xxh3_128"} <= set(shard), shard
    return base


@pytest.fixture
def data(pristine, tmp_path):
    """This test's copy: (run, slice, outside), outside holding a copy of every file of the
    run's and the slice's epoch 0 (same bytes: what a link out would point at)."""
    for name in ("src", "run", "slice"):
        subprocess.run(["cp", "-a", str(pristine / name), str(tmp_path / name)], check=True)
    # the manifests keep naming the pristine source and run: the slice's record of its run's epoch
    # manifests (epoch_xxh3_128) holds only for their bytes as written
    outside = tmp_path / "outside"
    for name in ("run", "slice"):
        shutil.copytree(tmp_path / name / epoch_dir_name(0), outside / name)
    return tmp_path / "run", tmp_path / "slice", outside


def link_out(path: Path, target: Path) -> None:
    path.unlink()
    path.symlink_to(target)


def nothing_staged(dest: Path) -> bool:
    return not dest.exists() or not any(dest.rglob("*"))


def refused_by_the_slice_readers(tmp_path: Path, run: Path, s: Path, watch: Path) -> None:
    """read, validate, validate --against RUN and TokpackDataset all refuse the slice, and none
    opens a file under `watch`."""
    r, opened = tokpack(tmp_path, "read", s, *READ, watch=watch)
    assert "outside" in one_line(r) and opened == [], (r.stderr, opened)
    for args in ((), ("--against", run)):
        r, opened = tokpack(tmp_path, "validate", s, *args, watch=watch)
        assert "outside" in corrupt(r) and opened == [], (args, r.stderr, opened)
    require("torch", "pip install torch")
    from tokpack.loader.torch_adapter import TokpackDataset

    with pytest.raises(TokpackError, match="outside"):
        next(iter(TokpackDataset(s, rank=1, world_size=W, micro_batch=M, positions="index")))


@pytest.mark.parametrize("victim", [rank_file_name(1), rank_file_name(1) + ".pad", rank_file_name(1) + ".index"])
def test_a_rank_file_linked_out_of_the_slice_is_refused(data, tmp_path, victim):
    """Before the gate, `read` served a rank file linked to a byte-identical copy outside the
    slice, and `validate` (with or without --against) passed it."""
    run, s, outside = data
    link_out(s / epoch_dir_name(0) / victim, outside / "slice" / victim)
    refused_by_the_slice_readers(tmp_path, run, s, outside)


def test_a_symlinked_slice_epoch_folder_is_refused(data, tmp_path):
    run, s, _ = data
    elsewhere = tmp_path / "elsewhere"
    shutil.move(s / epoch_dir_name(0), elsewhere)
    (s / epoch_dir_name(0)).symlink_to(elsewhere)
    refused_by_the_slice_readers(tmp_path, run, s, elsewhere)


@pytest.mark.parametrize("suffix", ["", ".rows", ".pad"])
def test_a_run_file_linked_out_is_refused_by_stage_ranks_and_validate_against(data, tmp_path, suffix):
    """Before the gate, `stage --ranks` (and --node) followed a run's .ds, .ds.rows or .ds.pad
    linked out of the run, and `validate SLICE --against RUN` compared against it."""
    run, s, outside = data
    name = f"00000.ds{suffix}"
    link_out(run / epoch_dir_name(0) / name, outside / "run" / name)
    for i, how in enumerate((SLICE, NODE)):
        dest = tmp_path / f"dest-{i}"
        r, opened = tokpack(tmp_path, "stage", run, dest, *how, watch=outside)
        line = one_line(r)
        assert "a symlink to" in line and "outside the folder" in line and name in line, line
        assert opened == [] and nothing_staged(dest), (opened, list(dest.rglob("*")))
    r, opened = tokpack(tmp_path, "validate", s, "--against", run, watch=outside)
    assert "outside the folder" in corrupt(r) and opened == [], (r.stderr, opened)


@pytest.mark.parametrize("suffix", ["", ".rows", ".pad"])
@pytest.mark.parametrize("change", [800, -8])
def test_a_run_file_longer_or_shorter_than_recorded_is_refused_before_anything_is_written(
    data, tmp_path, suffix, change
):
    """Before the gate, `stage --ranks` took a run file 800 bytes longer than its manifest
    records; one cut short was found only when read, after epoch 0 had been staged. The damaged
    file is in epoch 1: the refusal comes before epoch 0 is written."""
    run, _, _ = data
    f = run / epoch_dir_name(1) / f"00000.ds{suffix}"
    size = f.stat().st_size
    raw = f.read_bytes()
    f.write_bytes(raw + bytes(range(200)) * 4 if change > 0 else raw[: size + change])
    for i, how in enumerate((SLICE, NODE)):
        dest = tmp_path / f"dest-{i}"
        r, _ = tokpack(tmp_path, "stage", run, dest, *how)
        line = one_line(r)
        assert f.name in line and "size does not match the manifest" in line and "HINT" in line, line
        assert f"expected {size} bytes, found {size + change} bytes" in line, line
        assert nothing_staged(dest), list(dest.rglob("*"))


def test_a_file_swapped_for_another_size_after_its_check_is_refused_on_the_descriptor(tmp_path, monkeypatch):
    """regular_fd checks the path, opens it, then checks the descriptor again: a file replaced in
    between (here: the path check skipped, as if the swap came right after it) is still refused,
    as one line naming its size, and the descriptor is closed; the same for a FIFO on append."""
    import os

    from tokpack.formats.io import gate

    f = tmp_path / "00000.ds"
    f.write_bytes(b"x" * 10)
    monkeypatch.setattr(gate, "regular_size", lambda path, **rules: rules.get("size"))
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(TokpackError) as e:
        gate.regular_fd(f, size=12, what="shard")
    assert "size" in str(e.value) and "12 bytes" in str(e.value) and "10 bytes" in str(e.value), str(e.value)
    assert len(os.listdir("/proc/self/fd")) == before
    assert os.read(fd := gate.regular_fd(f, size=10), 10) == b"x" * 10
    os.close(fd)
    fifo = tmp_path / "work" / "b.rows"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    with pytest.raises(TokpackError) as e:
        gate.open_append(fifo, folder=tmp_path / "work")
    assert "regular" in str(e.value).lower() or "fifo" in str(e.value).lower(), str(e.value)
