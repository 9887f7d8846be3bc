"""`tokpack stage` writes over its own copy only (issue 32, item 4).

A whole-run copy (with or without --shards-of), a copy of an epoch or source, and a node slice
(--ranks or --node) each refuse a DEST that holds another kind of copy, or another run's copy,
finished or left unfinished by a killed stage: one line naming what DEST holds, exit 1, and DEST
byte for byte as it was. A restage of the same copy, and the rerun of a killed one, still work.
The free-space check counts every file the stage writes (rank files and their .index, .rows,
.pad and .metadata, manifests), measured here against a faked free space.
"""

from __future__ import annotations

import json
import shutil
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import random_docs, shuffle_run, write_source
from tokpack.formats.errors import TokpackError
from tokpack.formats.constants import MANIFEST
from tokpack.formats.names import epoch_dir_name
from tokpack.packer.cli import main
from tokpack.packer.slicing import plan_slice, stage_slice
from tokpack.packer.stage_dest import FS_BLOCK, bytes_to_write, on_disk
from tokpack.packer.stage_plan import Source, make_plan
from tokpack.packer.staging import stage

SEQ, W, M = 63, 4, 3


def make_run(out: Path, sources, seed: int = 0, packing: str | None = None, samples=None) -> Path:
    shuffle_run(
        [str(s) for s in sources],
        str(out),
        seq_len=SEQ,
        seed=seed,
        epochs=[0, 1],
        samples=samples,
        tokens=None,
        shard_samples=12,
        memory=8 << 20,
        jitter=False,
        log=None,
        packing=packing,
    )
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A run, another run of the same source (another seed), a best-fit run, and finished
    copies of the first: whole, a slice of ranks 0-1, a slice of ranks 2-3."""
    root = tmp_path_factory.mktemp("dest")
    src = write_source(root / "src", random_docs(np.random.default_rng(3), 200, 1000, 0), docs_per_shard=40)
    rng = np.random.default_rng(5)
    mixed = [
        write_source(root / "big", random_docs(rng, 120, 1000, 0, 30, 60)),
        write_source(root / "small", random_docs(rng, 40, 1000, 0, 1, 300)),
    ]
    out = dict(
        run=make_run(root / "run", [src]),
        other=make_run(root / "other", [src], seed=1),
        packed=make_run(root / "packed", mixed, seed=9, packing="best-fit", samples=120),
        src=src,
    )
    stage(str(out["run"]), root / "whole")
    stage_slice(str(out["run"]), root / "slice01", ranks="0-1", world_size=W, micro_batch=M)
    stage_slice(str(out["run"]), root / "slice23", ranks="2-3", world_size=W, micro_batch=M)
    stage(str(out["other"]), root / "other-whole")
    out.update(
        whole=root / "whole", slice01=root / "slice01", slice23=root / "slice23", other_whole=root / "other-whole"
    )
    return out


def tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "tokpack.lock"
    }


def copy_of(path: Path, to: Path, unfinish=()) -> Path:
    """A copy of a finished DEST, with the manifests `unfinish` names removed (a stage killed
    before writing them)."""
    shutil.copytree(path, to)
    for rel in unfinish:
        (to / rel).unlink()
    return to


def refused(args, dest: Path, *words: str) -> str:
    """Runs the CLI: exit 1, one tokpack line (no traceback) with `words` (what DEST holds), DEST unchanged."""
    before = tree(dest)
    res = CliRunner().invoke(main, [str(a) for a in args])
    lines = [x for x in res.output.splitlines() if x.startswith("tokpack")]
    assert res.exit_code == 1 and len(lines) == 1 and "Traceback" not in res.output, res.output
    assert all(w in lines[0] for w in words), lines[0]
    assert tree(dest) == before
    return lines[0]


def slice_args(run, dest, form="ranks"):
    sel = ["--ranks", "0-1", "--world-size", W] if form == "ranks" else ["--node", "0/2", "--ranks-per-node", 2]
    return ["stage", run, dest, *sel, "--micro-batch", M]


# ------------------------------------------------------------------ another kind of copy


@pytest.mark.parametrize("form", ["ranks", "node"])
@pytest.mark.parametrize(
    "unfinish",
    [(), (MANIFEST,), (MANIFEST, f"{epoch_dir_name(1)}/{MANIFEST}")],
    ids=["finished", "no-run-manifest", "one-epoch-manifest"],
)
def test_a_node_slice_into_a_whole_run_copy_is_refused(runs, tmp_path, form, unfinish):
    """The issue's case: the slice replaced the copy's epoch manifests, and the copy could no
    longer resume. Now nothing is written and the line says what DEST holds."""
    dest = copy_of(runs["whole"], tmp_path / "d", unfinish)
    words = "a whole-run copy of the run with seed 0" if not unfinish else "an unfinished whole-run copy"
    refused(slice_args(runs["run"], dest, form), dest, words)
    assert stage(str(runs["run"]), dest).ok  # and the copy still resumes
    assert tree(dest) == tree(runs["whole"])


def test_a_node_slice_into_shard_files_without_a_manifest_is_refused(runs, tmp_path):
    dest = tmp_path / "d"
    (dest / epoch_dir_name(0)).mkdir(parents=True)
    shutil.copy(runs["run"] / epoch_dir_name(0) / "00000.ds", dest / epoch_dir_name(0))
    refused(slice_args(runs["run"], dest), dest, "an unfinished whole-run copy", "00000.ds")
    dest = tmp_path / "d2"
    dest.mkdir()
    shutil.copy(runs["src"] / "00000.ds", dest)
    refused(slice_args(runs["run"], dest), dest, "an unfinished copy of a source or epoch")


@pytest.mark.parametrize(
    "unfinish",
    [(), (MANIFEST,), (MANIFEST, f"{epoch_dir_name(0)}/{MANIFEST}", f"{epoch_dir_name(1)}/{MANIFEST}")],
    ids=["finished", "no-slice-manifest", "rank-files-only"],
)
@pytest.mark.parametrize("how", ["whole", "shards-of"])
def test_a_whole_run_stage_into_a_node_slice_is_refused(runs, tmp_path, unfinish, how):
    dest = copy_of(runs["slice01"], tmp_path / "d", unfinish)
    words = (
        "a node slice of ranks 0-1 of 4"
        if not unfinish
        else "an unfinished node slice of ranks 0-1 of 4"
        if len(unfinish) == 1
        else "an unfinished node slice (epoch-00000/rank-00000.ds"
    )
    extra = ["--shards-of", "0/4", "--micro-batch", M] if how == "shards-of" else []
    refused(["stage", runs["run"], dest, *extra], dest, words)


def test_an_epoch_or_a_source_into_a_run_copy_is_refused(runs, tmp_path):
    dest = copy_of(runs["whole"], tmp_path / "d", (MANIFEST,))
    refused(["stage", runs["run"] / epoch_dir_name(0), dest], dest, "an unfinished whole-run copy")
    refused(["stage", runs["src"], dest], dest, "an unfinished whole-run copy")
    refused(["stage", runs["src"], runs["whole"]], runs["whole"], "a whole-run copy of the run with seed 0")


def test_an_epoch_into_an_unfinished_source_copy_and_back_is_refused(runs, tmp_path):
    """Found by tests/test_fuzz.py: without a root manifest, a source's and an epoch's shards
    have the same names (00000.ds ...); an epoch staged over an unfinished source copy replaced
    its files. Now a shard file whose size is not this copy's, or that this copy does not list,
    is another directory's."""
    src_copy = tmp_path / "src-copy"
    stage(str(runs["src"]), src_copy)
    dest = copy_of(src_copy, tmp_path / "d", (MANIFEST,))
    refused(
        ["stage", runs["run"] / epoch_dir_name(0), dest],
        dest,
        "an unfinished copy of another directory",
        "00000.ds",
        "bytes, this copy's is",
    )
    epoch_copy = tmp_path / "epoch-copy"
    stage(str(runs["run"] / epoch_dir_name(0)), epoch_copy)
    dest = copy_of(epoch_copy, tmp_path / "e", (MANIFEST,))
    refused(["stage", runs["src"], dest], dest, "an unfinished copy of another directory")
    assert stage(str(runs["run"] / epoch_dir_name(0)), dest).copied_files == 0  # its own: resumed in place
    assert tree(dest) == tree(epoch_copy)


# ------------------------------------------------------------------ another run's copy


@pytest.mark.parametrize("unfinish", [(), (MANIFEST,)], ids=["finished", "unfinished"])
def test_a_whole_run_stage_into_another_runs_copy_is_refused(runs, tmp_path, unfinish):
    dest = copy_of(runs["other_whole"], tmp_path / "d", unfinish)
    refused(["stage", runs["run"], dest], dest, "whole-run copy", "seed 1")


def test_an_unfinished_copy_of_another_run_holding_other_epochs_is_refused(runs, tmp_path):
    """DEST holds epoch 1 of another run, unfinished: staging epoch 0 of this run writes no file
    of epoch 1, yet the run manifest it ends with would vouch for a mix of two runs."""
    dest = copy_of(runs["other_whole"], tmp_path / "d", (MANIFEST,))
    shutil.rmtree(dest / epoch_dir_name(0))
    refused(["stage", runs["run"], dest, "--epochs", "0"], dest, "another run", "seed 1")
    # the same run's other epoch is this copy's: staged with another --epochs selection
    mine = copy_of(runs["whole"], tmp_path / "mine", (MANIFEST,))
    shutil.rmtree(mine / epoch_dir_name(0))
    assert stage(str(runs["run"]), mine, epochs="0").ok


def test_a_node_slice_into_a_slice_of_another_run_or_other_ranks_is_refused(runs, tmp_path):
    other = tmp_path / "other-slice"
    stage_slice(str(runs["other"]), other, ranks="0-1", world_size=W, micro_batch=M)
    for unfinish in [(MANIFEST,), (MANIFEST, f"{epoch_dir_name(1)}/{MANIFEST}")]:
        dest = copy_of(other, tmp_path / f"o{len(unfinish)}", unfinish)
        refused(slice_args(runs["run"], dest), dest, "slice of another run", "run.seed")
        dest = copy_of(runs["slice23"], tmp_path / f"r{len(unfinish)}", unfinish)
        refused(slice_args(runs["run"], dest), dest, "slice for other ranks")
    # rank files of other ranks, no manifest at all: a slice of ranks 2-3 killed in its first epoch
    dest = copy_of(runs["slice23"], tmp_path / "bare", (MANIFEST, *(f"{epoch_dir_name(e)}/{MANIFEST}" for e in (0, 1))))
    refused(slice_args(runs["run"], dest), dest, "other ranks", "rank-00002.ds")


def test_a_run_holding_another_runs_epoch_is_refused_by_every_stage(runs, tmp_path):
    """RUN's epoch 1 replaced by another run's (another seed; validate calls RUN CORRUPT): a
    whole-run copy, a --shards-of copy and a node slice each staged it beside this run's epoch 0,
    and a slice staged before took it as this run's epoch 1, rewritten (validate --against RUN
    said OK). Each now refuses RUN in one line before writing, naming the epoch's manifest."""
    mixed = copy_of(runs["run"], tmp_path / "mixed")
    shutil.rmtree(mixed / epoch_dir_name(1))
    shutil.copytree(runs["other"] / epoch_dir_name(1), mixed / epoch_dir_name(1))
    where = f"{epoch_dir_name(1)}/{MANIFEST}"
    for i, sel in enumerate(
        [[], ["--epochs", "1"], ["--shards-of", "0/4", "--micro-batch", M], slice_args(mixed, "x", "node")[3:]]
    ):
        refused(["stage", mixed, tmp_path / f"d{i}", *sel], tmp_path / f"d{i}", "another run", where, "seed")
        assert not (tmp_path / f"d{i}").exists() or not any((tmp_path / f"d{i}").iterdir())
    # RUN changed between two stages of one slice: the slice is left as it was
    dest = copy_of(runs["slice01"], tmp_path / "slice")
    refused(slice_args(mixed, dest, "node"), dest, "another run", where)


@pytest.mark.parametrize("selection", [[], ["--epochs", "0"]])
def test_a_stage_into_the_directory_it_stages_is_refused(runs, tmp_path, selection):
    """DEST the run itself (or a link to it): every file was "in place", and the run's own
    manifests were rewritten as the copy's: with --epochs 0 the run listed epoch 0 alone,
    its epoch 1 dropped (validate: INCOMPLETE, a reader never fed it)."""
    run = copy_of(runs["run"], tmp_path / "run")
    (tmp_path / "link").symlink_to(run)
    for dest in (run, tmp_path / "link"):
        refused(["stage", run, dest, *selection], run, "DEST is the directory being staged")
    assert tree(run) == tree(runs["run"])


@pytest.mark.parametrize("what", ["run", "src", "epoch", "shards-of", "node"])
def test_a_folder_of_other_files_is_refused_and_left_as_it_was(runs, tmp_path, what):
    """A whole-run, source or epoch stage into a folder of a user's files (a home-like folder)
    wrote the copy among them and exit 0, where shuffle -o and pack -o refuse such a folder; a
    node slice refused it, but with "DEST already holds a different tokpack directory... HINT:
    remove DEST", which would delete the user's files. Every form now gives one line naming the
    folder and what is there, HINT an empty folder or a previous stage destination; DEST is left
    byte for byte as it was. An empty folder and a previous destination are still taken."""
    home = tmp_path / "home"
    (home / "docs").mkdir(parents=True)
    (home / "docs" / "a.txt").write_text("mine")
    (home / "notes.txt").write_text("mine too")
    args = {
        "run": ["stage", runs["run"], home],
        "src": ["stage", runs["src"], home],
        "epoch": ["stage", runs["run"] / epoch_dir_name(0), home],
        "shards-of": ["stage", runs["run"], home, "--shards-of", "0/2", "--micro-batch", M],
        "node": slice_args(runs["run"], home, "node"),
    }[what]
    line = refused(args, home, f"{home}: DEST is a folder of other files, not a stage destination")
    assert "found 2 entries a stage did not write (docs, notes.txt)" in line, line
    assert "HINT: give a new or empty DEST, or the folder a previous stage wrote" in line and "remove DEST" not in line
    (home / "notes.txt").unlink()
    shutil.rmtree(home / "docs")
    assert CliRunner().invoke(main, [str(a) for a in args]).exit_code == 0  # empty: taken
    assert CliRunner().invoke(main, [str(a) for a in args]).exit_code == 0  # its own destination: restaged


# ------------------------------------------------------------------ its own copy: restaged, resumed


def test_own_unfinished_copies_resume_with_identical_bytes(runs, tmp_path):
    """A stage killed before its manifests (or before a rank file's commit) is this copy's:
    the rerun finishes it with the bytes of an uninterrupted stage."""
    dest = copy_of(runs["slice01"], tmp_path / "s", (MANIFEST, f"{epoch_dir_name(1)}/{MANIFEST}"))
    (dest / epoch_dir_name(1) / "rank-00001.ds").unlink()
    res = stage_slice(str(runs["run"]), dest, node="0/2", ranks_per_node=2, micro_batch=M)
    assert res.epochs_in_place == [0] and res.epochs_staged == [1]
    assert tree(dest) == tree(runs["slice01"])
    assert stage_slice(str(runs["run"]), dest, ranks="0-1", world_size=W, micro_batch=M).epochs_in_place == [0, 1]
    dest = copy_of(runs["whole"], tmp_path / "w", (MANIFEST, f"{epoch_dir_name(0)}/{MANIFEST}"))
    (dest / epoch_dir_name(0) / "00003.ds").unlink()
    assert stage(str(runs["run"]), dest).copied_files == 1  # the shard; the others verified in place
    assert tree(dest) == tree(runs["whole"])


# ------------------------------------------------------------------ free space: every file


def fake_free(monkeypatch, free: int) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(free, 0, free))


def disk_use(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file() and p.name != "tokpack.lock")


@pytest.mark.parametrize("run", ["run", "packed"])
def test_a_slice_whose_sidecars_do_not_fit_is_refused_before_its_first_epoch(runs, tmp_path, monkeypatch, run):
    """Free space for every token byte of the slice, not for its .index, .rows, .pad, .metadata
    and manifests: refused before an epoch is written (was: found full mid-stage after two
    epochs). With exactly what the check counts free, the stage runs, and what it counted
    covers what the files take on this disk."""
    sp = plan_slice(Source(str(runs[run])), ranks="0-1", world_size=W, micro_batch=M)
    tokens = sum(sp.kept.values())
    need = sum(sp.written.values()) + sp.root_bytes
    assert need > tokens + FS_BLOCK * 3 * 2 * len(sp.epochs)  # .index, .rows, .metadata: a block at least each
    dest = tmp_path / "s"
    fake_free(monkeypatch, tokens + FS_BLOCK)
    refused(
        ["stage", runs[run], dest, "--ranks", "0-1", "--world-size", W, "--micro-batch", M],
        dest,
        "not enough free space",
        str(need),
    )
    assert not dest.exists() or not [p for p in dest.rglob("*") if p.name != "tokpack.lock"]
    fake_free(monkeypatch, need - 1)
    with pytest.raises(TokpackError, match="not enough free space"):
        stage_slice(str(runs[run]), dest, ranks="0-1", world_size=W, micro_batch=M)
    fake_free(monkeypatch, need)
    stage_slice(str(runs[run]), dest, ranks="0-1", world_size=W, micro_batch=M)
    monkeypatch.undo()
    # the index is counted at the epoch's mean fragments a row: within a block a rank file of what it takes
    assert disk_use(dest) <= need + FS_BLOCK * 2 * len(sp.epochs), (disk_use(dest), need)
    if run == "packed":
        assert any(p.name.endswith(".ds.pad") for p in dest.rglob("*"))


def test_a_whole_run_stage_counts_its_sidecars_and_manifests(runs, tmp_path, monkeypatch):
    src = Source(str(runs["run"]))
    _, plans = make_plan(src)
    tokens = sum(j.size for p in plans for j in p.jobs if j.rel.endswith(".ds"))
    dest = tmp_path / "w"
    need = bytes_to_write(dest, plans)
    assert need > tokens + FS_BLOCK * sum(len(p.jobs) for p in plans) // 2  # sidecars: a block at least each
    fake_free(monkeypatch, tokens + FS_BLOCK)
    refused(["stage", runs["run"], dest], dest, "not enough free space")
    assert not dest.exists() or not [p for p in dest.rglob("*") if p.name != "tokpack.lock"]
    fake_free(monkeypatch, need)
    stage(str(runs["run"]), dest)
    monkeypatch.undo()
    assert disk_use(dest) <= need
    # a restage writes the manifests only (its files are in place): what they take is what it counts
    assert bytes_to_write(dest, plans) == sum(on_disk((dest / p.rel / MANIFEST).stat().st_size) for p in plans)


def test_plan_stage_counts_what_the_space_check_counts(runs, tmp_path):
    """`tokpack plan stage` reports the space stage's check asks for (one count, not two)."""
    from tokpack.packer import api

    sp = plan_slice(Source(str(runs["run"])), ranks="0-1", world_size=W, micro_batch=M)
    got = api.plan("stage", runs["run"], tmp_path / "s", ranks="0-1", world_size=W, micro_batch=M, disk_mbps=100)
    assert got.to_json()["space"][0]["needed_bytes"] == sum(sp.written.values()) + sp.root_bytes
    _, plans = make_plan(Source(str(runs["run"])))
    got = api.plan("stage", runs["run"], tmp_path / "w", disk_mbps=100)
    assert got.to_json()["space"][0]["needed_bytes"] == bytes_to_write(tmp_path / "w", plans)


def test_a_best_fit_shard_without_its_pad_checksum_is_not_staged_as_unpadded(runs, tmp_path):
    """Found by tests/test_fuzz.py: a best-fit run's shard entry without `pad_xxh3_128` was
    staged into a node slice with zero padding, so the slice trained on the padding as tokens.
    Now one line naming the entry, before anything is written."""
    import json

    from tokpack.formats.reading import canonical_bytes

    run = tmp_path / "packed"
    shutil.copytree(runs["packed"], run)
    m = json.loads((run / epoch_dir_name(1) / MANIFEST).read_text())
    del m["shards"][1]["pad_xxh3_128"]
    (run / epoch_dir_name(1) / MANIFEST).write_bytes(canonical_bytes(m))
    dest = tmp_path / "s"
    line = refused(
        ["stage", run, dest, "--ranks", "0-1", "--world-size", W, "--micro-batch", M],
        tmp_path / "s",
        "lacks its padding sidecar",
        "shards[1].pad_xxh3_128",
        f"{epoch_dir_name(1)}/{MANIFEST}",
    )
    assert "HINT" in line
    assert not dest.exists() or not [p for p in dest.rglob("*") if p.name != "tokpack.lock"]


def test_a_file_url_dest_is_the_local_path_it_names(runs, tmp_path):
    """DEST file:///path is the local path /path (docs/CLUSTER.md), as for every other path
    argument: it was refused as "DEST must be a local path ... found a URL". The copy and the
    slice are those of the plain path."""
    for args, plain in (
        ([], runs["whole"]),
        (["--ranks", "0-1", "--world-size", W, "--micro-batch", M], runs["slice01"]),
    ):
        dest = tmp_path / f"dest-{len(args)}"
        res = CliRunner().invoke(main, [str(a) for a in ["stage", runs["run"], f"file://{dest}", *args]])
        assert res.exit_code == 0, res.output
        assert tree(dest) == tree(plain)


@pytest.mark.parametrize("node", ["/2", "2/2", "x/2"])
def test_a_bad_node_says_what_to_give(runs, tmp_path, node):
    """--node "$SLURM_NODEID/2" outside a Slurm job is --node /2: the line had no HINT."""
    res = CliRunner().invoke(
        main,
        [
            "stage",
            str(runs["run"]),
            str(tmp_path / "d"),
            "--node",
            node,
            "--ranks-per-node",
            "2",
            "--micro-batch",
            "2",
            "--json",
        ],
    )
    assert res.exit_code == 1, res.output
    error = json.loads(res.stdout)["error"]
    assert (error["message"], error["found"].split(",")[0]) == ("bad --node", node), error
    assert error["hint"] and "$SLURM_NODEID/$SLURM_NNODES" in error["hint"], error
    assert not (tmp_path / "d").exists()
