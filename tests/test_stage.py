"""`tokpack stage`: verified, resumable, partial (by ranks) copies, from any fsspec path."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from click.testing import CliRunner

from tokpack.formats.errors import TokpackError
from tokpack.formats.io.writes import TMP_MARK
from tokpack.formats.constants import MANIFEST, STAGE_SIDECAR
from tokpack.formats.names import epoch_dir_name
from tokpack.formats.slices import RankRows
from tokpack.formats.shards import shard_suffixes
from tokpack.packer.cli import main
from tokpack.packer.stage_plan import parse_epochs, parse_ranks, shards_for_ranks
from tokpack.packer.staging import stage
from conftest import random_docs, write_source


def make_run(out: Path, source: Path, seq_len: int, shard_samples: int, epochs: int, seed: int = 0) -> Path:
    """A real shuffled run of `source` (in-memory path, one local task)."""
    from conftest import shuffle_run

    shuffle_run(
        [str(source)],
        str(out),
        seq_len=seq_len,
        seed=seed,
        epochs=list(range(epochs)),
        samples=None,
        tokens=None,
        shard_samples=shard_samples,
        memory=8 << 20,
        jitter=False,
        log=None,
    )
    return out


@pytest.fixture
def run_dir(tmp_path):
    docs = random_docs(np.random.default_rng(3), 200, 1000, 0)
    src = write_source(tmp_path / "src", docs, docs_per_shard=40)
    return make_run(tmp_path / "run", src, seq_len=63, shard_samples=12, epochs=2), src


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def listed_files(root: Path) -> set[str]:
    """Every file the manifests of `root` list (shards with index/metadata), plus the manifests."""
    out = set()

    def add(rel_dir: str):
        m = json.loads((root / rel_dir / MANIFEST).read_text())
        out.add(os.path.join(rel_dir, MANIFEST) if rel_dir else MANIFEST)
        for s in m.get("shards") or []:
            for suffix in shard_suffixes(s):
                out.add(os.path.join(rel_dir, s["path"] + suffix) if rel_dir else s["path"] + suffix)
        return m

    m = add("")
    for e in m.get("epochs") or []:
        add(epoch_dir_name(e))
    return out


def test_stage_source_is_byte_identical(small_source, tmp_path):
    src, _ = small_source
    summary = stage(src, tmp_path / "dst", workers=3, block=1 << 12)
    assert tree(tmp_path / "dst") == tree(src)
    assert summary.copied_files == 3 * 3 and summary.skipped_files == 0
    assert summary.bytes_copied == sum(len(b) for k, b in tree(src).items() if k != MANIFEST)


def test_stage_run_copies_listed_files_only_and_manifests(run_dir, tmp_path):
    run, _ = run_dir
    (run / "stray.txt").write_text("not listed")
    stage(run, tmp_path / "dst", workers=2)
    got = tree(tmp_path / "dst")
    assert set(got) == listed_files(run)
    assert all(got[k] == (run / k).read_bytes() for k in got)
    from tokpack.packer import validate

    assert validate(tmp_path / "dst").ok


def test_resume_skips_verified_and_replaces_corrupt(small_source, tmp_path):
    src, _ = small_source
    dst = tmp_path / "dst"
    stage(src, dst, workers=2, block=5000)  # blocks not page-aligned: hashed through shifted maps
    # A corrupt file of the right size, a missing one, and a leftover temporary file.
    bad = dst / "00001.ds"
    data = bytearray(bad.read_bytes())
    data[10] ^= 0xFF
    bad.write_bytes(bytes(data))
    (dst / "00002.ds.index").unlink()
    (dst / f"00000.ds{TMP_MARK}123-deadbeef").write_bytes(b"junk")
    summary = stage(src, dst, workers=2, block=5000)
    assert summary.copied_files == 2
    assert summary.skipped_files == 7
    assert summary.bytes_verified_in_place > 0
    assert tree(dst) == tree(src)


def test_corrupt_source_fails_and_leaves_no_manifest(small_source, tmp_path):
    src, _ = small_source
    p = src / "00002.ds"
    data = bytearray(p.read_bytes())
    data[-3] ^= 0x01
    p.write_bytes(bytes(data))
    dst = tmp_path / "dst"
    with pytest.raises(TokpackError, match="checksum mismatch") as e:
        stage(src, dst, workers=2)
    assert "00002.ds" in str(e.value)
    assert not (dst / MANIFEST).exists()
    assert not (dst / "00002.ds").exists()  # never left under its final name
    assert not [p for p in dst.iterdir() if TMP_MARK in p.name]


def test_interrupted_copy_leaves_incomplete_dest(small_source, tmp_path, monkeypatch):
    """A crash mid-stage: no manifest at DEST, so nothing can take the copy for complete."""
    from tokpack.packer.staging import _Stager

    src, _ = small_source
    dst = tmp_path / "dst"
    stage(src, dst)
    calls = {"n": 0}
    real = _Stager._copy

    def crash_on_second(self, rel, tmp, size, digest):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(self, rel, tmp, size, digest)

    (dst / "00000.ds").write_bytes(b"x")  # forces a rewrite, which must first retract the manifest
    (dst / "00001.ds").write_bytes(b"y")
    monkeypatch.setattr(_Stager, "_copy", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        stage(src, dst, workers=1)
    assert not (dst / MANIFEST).exists()
    monkeypatch.undo()
    stage(src, dst)
    assert tree(dst) == tree(src)


def test_unreachable_and_bad_sources(tmp_path):
    with pytest.raises(TokpackError, match="no tokpack.json"):
        stage(tmp_path / "nope", tmp_path / "dst")
    with pytest.raises(TokpackError, match="nosuchproto://bucket/x: unknown URL scheme.*HINT: check the URL"):
        stage("nosuchproto://bucket/x", tmp_path / "dst2")
    assert not (tmp_path / "dst2").exists()
    (tmp_path / "notjson").mkdir()
    (tmp_path / "notjson" / MANIFEST).write_text("{")
    with pytest.raises(TokpackError, match="not valid JSON"):
        stage(tmp_path / "notjson", tmp_path / "dst3")
    assert not (tmp_path / "dst3" / MANIFEST).exists()


def test_missing_source_shard(small_source, tmp_path):
    src, _ = small_source
    (src / "00001.ds.index").unlink()
    with pytest.raises(TokpackError, match="missing"):
        stage(src, tmp_path / "dst")
    assert not (tmp_path / "dst" / MANIFEST).exists()


def test_refuses_dest_holding_other_data(small_source, tmp_path):
    src, _ = small_source
    other = write_source(tmp_path / "other", random_docs(np.random.default_rng(9), 20, 1000, 0))
    stage(other, tmp_path / "dst")
    with pytest.raises(TokpackError, match="different tokpack directory"):
        stage(src, tmp_path / "dst")


def test_fsspec_source(small_source, tmp_path):
    """Any fsspec URL: here the in-memory filesystem, which goes through fsspec's buffered files."""
    import fsspec

    src, _ = small_source
    fs = fsspec.filesystem("memory")
    for p in src.iterdir():
        fs.pipe(f"/stagetest/src/{p.name}", p.read_bytes())
    try:
        stage("memory://stagetest/src", tmp_path / "dst", workers=2)
    finally:
        fs.rm("/stagetest", recursive=True)
    assert tree(tmp_path / "dst") == tree(src)
    stage(f"file://{src}", tmp_path / "dst2")  # through datatrove's DataFolder, local filesystem
    assert tree(tmp_path / "dst2") == tree(src)


def test_epochs_selection_restricts_run_manifest(run_dir, tmp_path):
    run, _ = run_dir
    dst = tmp_path / "dst"
    summary = stage(run, dst, epochs="1")
    m = json.loads((dst / MANIFEST).read_text())
    assert m["epochs"] == [1] and summary.epochs == [1]
    e1 = json.loads((run / epoch_dir_name(1) / MANIFEST).read_text())
    assert m["tokens"] == e1["tokens"]  # the run's totals cover the epochs it lists
    assert not (dst / epoch_dir_name(0)).exists()
    assert tree(dst / epoch_dir_name(1)) == tree(run / epoch_dir_name(1))
    summary = stage(run, dst, epochs="0,1")  # the same run, more epochs: epoch 1 is verified in place
    assert json.loads((dst / MANIFEST).read_text()) == json.loads((run / MANIFEST).read_text())
    assert summary.skipped_files > 0 and summary.copied_files > 0
    with pytest.raises(TokpackError, match="not in this run"):
        stage(run, tmp_path / "dst2", epochs="0-5")


def test_parsers():
    assert parse_epochs("0-2,5") == [0, 1, 2, 5]
    assert parse_epochs(None) is None
    assert parse_ranks("1,3/4") == ([1, 3], 4)
    assert parse_ranks("0-2/8") == ([0, 1, 2], 8)
    for bad in ("4/4", "1", "a/2", "/2"):
        with pytest.raises(TokpackError):
            parse_ranks(bad)
    with pytest.raises(TokpackError):
        parse_epochs("x")


@settings(max_examples=300, deadline=None)
@given(
    world=st.integers(1, 9),
    micro=st.integers(1, 7),
    data=st.data(),
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=30),
    offset=st.integers(0, 10_000),
    bounded=st.booleans(),
)
def test_shards_for_ranks_matches_brute_force(world, micro, data, sizes, offset, bounded):
    ranks = sorted(data.draw(st.sets(st.integers(0, world - 1), min_size=1)))
    period = world * micro
    end = offset + sum(sizes) if bounded else None
    got = shards_for_ranks(sizes, offset, ranks, RankRows(world, micro), end)
    limit = end // period * period if bounded else float("inf")  # complete global batches only
    start = offset
    for n, keep in zip(sizes, got):
        touched = any((p % period) // micro in ranks for p in range(start, start + n) if p < limit)
        assert keep == (touched or n == 0)
        start += n


def test_stage_ranks_copies_only_their_shards(run_dir, tmp_path):
    run, _ = run_dir
    world, micro, ranks = 5, 8, [3]
    dst = tmp_path / "dst"
    summary = stage(run, dst, ranks="3/5", micro_batch=micro)
    assert summary.partial and summary.shards_skipped > 0
    period = world * micro
    epochs = json.loads((run / MANIFEST).read_text())["epochs"]
    total = sum(json.loads((run / epoch_dir_name(e) / MANIFEST).read_text())["samples"] for e in epochs)
    chained = 0
    for e in epochs:
        m = json.loads((run / epoch_dir_name(e) / MANIFEST).read_text())
        # The manifests stay the source's; presence follows the rank's sample positions.
        assert (dst / epoch_dir_name(e) / MANIFEST).read_bytes() == (run / epoch_dir_name(e) / MANIFEST).read_bytes()
        for s in m["shards"]:
            positions = range(chained, chained + s["samples"])
            needed = any((p % period) // micro in ranks for p in positions if p < total // period * period)
            assert (dst / epoch_dir_name(e) / s["path"]).exists() == needed
            chained += s["samples"]
    from tokpack.packer import validate

    report = validate(dst).to_json()
    assert not report["ok"]  # a partial copy never passes for the whole run...
    # ...and says so in one line, while the shards it holds are still checked in full.
    assert [p["message"] for p in report["problems"]] == ["partial stage: serves only the ranks it was staged for"]
    assert f"{summary.shards_skipped} shards absent" in report["problems"][0]["found"]
    # its hint names the partial stage, not damage ("the data changed after it was written; restore it")
    assert "--shards-of" in report["problems"][0]["hint"] and "restore" not in report["problems"][0]["hint"]
    side = json.loads((dst / STAGE_SIDECAR).read_text())
    assert side["stages"] == [{"ranks": [3], "world_size": 5, "micro_batch": 8}]
    assert sum(len(v) for v in side["missing_shards"].values()) == summary.shards_skipped
    # Completing the copy later removes the partial marker.
    summary = stage(run, dst)
    assert not summary.partial and not (dst / STAGE_SIDECAR).exists()
    assert set(tree(dst)) == listed_files(run)


def test_ranks_select_what_the_real_reader_feeds_them(run_dir, tmp_path):
    """The shards a --ranks stage copies are exactly those the project's reader reads for
    those ranks from the whole run (same Megatron convention, epochs chained)."""
    from tokpack.loader.reader import SampleReader

    run, _ = run_dir
    world, micro, ranks = 4, 5, [1]
    dst = tmp_path / "dst"
    stage(run, dst, ranks="1/4", micro_batch=micro)
    reader = SampleReader.open(run)
    read = set()
    for r in ranks:
        for item in reader.rank_samples(r, world, micro):
            m = json.loads((run / epoch_dir_name(item.epoch) / MANIFEST).read_text())
            read.add((item.epoch, m["shards"][item.sample // m["shard_samples"]]["path"]))
    staged = {(int(p.parent.name.split("-")[1]), p.name) for p in dst.glob("epoch-*/*.ds")}
    assert staged == read and len(staged) < len(list(run.glob("epoch-*/*.ds")))

    # The partial copy serves its rank exactly as the whole run does...
    partial = SampleReader.open(dst)
    want = [(i.epoch, i.sample, i.tokens.tobytes()) for i in reader.rank_samples(1, world, micro)]
    assert [(i.epoch, i.sample, i.tokens.tobytes()) for i in partial.rank_samples(1, world, micro)] == want
    # ...and a rank it was not staged for fails on the first absent shard, saying why.
    with pytest.raises(TokpackError, match="left out by a partial stage"):
        list(partial.rank_samples(0, world, micro))


def test_ranks_on_source_is_an_error(small_source, tmp_path):
    src, _ = small_source
    with pytest.raises(TokpackError, match="not to a packed source"):
        stage(src, tmp_path / "dst", ranks="0/2")


def test_cli_stage_json_and_error(small_source, tmp_path):
    src, _ = small_source
    r = CliRunner().invoke(main, ["stage", str(src), str(tmp_path / "dst"), "--workers", "2", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["copied_files"] == 9
    r = CliRunner().invoke(main, ["stage", str(tmp_path / "missing"), str(tmp_path / "d2")])
    assert r.exit_code == 1
    assert "Traceback" not in r.output and "no tokpack.json" in r.output


def test_stage_epoch_dir_and_loss_files(run_dir, tmp_path):
    run, _ = run_dir
    stage(run / epoch_dir_name(1), tmp_path / "e1")
    assert tree(tmp_path / "e1") == tree(run / epoch_dir_name(1))
    # A packed source with a loss mask: the .ds.loss files travel and are verified too.
    from tokpack.formats.shards import SourceShardWriter
    from tokpack.formats.builders import source_manifest
    from tokpack.formats.reading import write_manifest
    from tokpack.formats.names import shard_name

    src = tmp_path / "lsrc"
    src.mkdir()
    w = SourceShardWriter(src, shard_name(0), np.dtype("<u2"), "t", with_loss=True)
    w.write(np.array([5, 6, 0, 7, 0], dtype="<u2"), np.array([3, 5]), loss=np.array([0, 1, 1, 1, 1], dtype=np.uint8))
    write_manifest(src, source_manifest([w.close()], np.dtype("<u2"), 1000, 0, "t"))
    summary = stage(src, tmp_path / "ldst")
    assert summary.copied_files == 4
    assert tree(tmp_path / "ldst") == tree(src)
    (src / "00000.ds.loss").write_bytes(b"\x01" * 5)
    with pytest.raises(TokpackError, match="checksum mismatch"):
        stage(src, tmp_path / "ldst2")


def test_falls_back_to_user_space_copy(small_source, tmp_path, monkeypatch):
    """Where copy_file_range is refused (e.g. across filesystems), the read+write path copies."""
    src, _ = small_source
    calls = {"n": 0}

    def refuse(*args):
        calls["n"] += 1
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    stage(src, tmp_path / "dst", workers=1, block=1 << 12)
    assert calls["n"] == 1  # refused once, then not tried again
    assert tree(tmp_path / "dst") == tree(src)


def test_cli_stage_epochs_and_ranks(run_dir, tmp_path):
    run, _ = run_dir
    r = CliRunner().invoke(
        main,
        ["stage", str(run), str(tmp_path / "d"), "--epochs", "1", "--shards-of", "1/4", "--micro-batch", "5", "--json"],
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["epochs"] == [1] and out["partial"] and out["ranks"] == [1] and out["world_size"] == 4
    r = CliRunner().invoke(main, ["stage", str(run), str(tmp_path / "d2"), "--ranks", "4/4"])
    assert r.exit_code == 1 and "bad --ranks" in r.output


@pytest.mark.parametrize("selection", [[], ["--shards-of", "1/4", "--micro-batch", "5"]], ids=["whole", "shards-of"])
def test_start_sample_without_a_node_slice_is_refused_not_ignored(run_dir, tmp_path, selection):
    """--start-sample moves the batch grid, and with it the shards ranks r of W read: a
    --shards-of copy ignored it (exit 0, the shards of the grid from 0), and the rank found a
    shard absent when training resumed. Now one line before anything is written."""
    run, _ = run_dir
    r = CliRunner().invoke(main, ["stage", str(run), str(tmp_path / "d"), *selection, "--start-sample", "7", "--json"])
    assert r.exit_code == 1, r.output
    err = json.loads(r.output.splitlines()[0])["error"]  # the one object; the line on stderr follows
    assert err["message"] == "--start-sample applies only to a node slice" and "--world-size" in err["hint"]
    assert not (tmp_path / "d").exists()
    # plan stage says what stage would do: the same line
    args = ["plan", "stage", str(run), str(tmp_path / "d"), *selection, "--start-sample", "7", "--disk-mbps", "100"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1 and "--start-sample applies only to a node slice" in r.output, r.output


def test_unwritable_dest_is_one_clear_error(small_source, tmp_path):
    src, _ = small_source
    (tmp_path / "file").write_text("x")
    with pytest.raises(TokpackError, match="cannot create"):
        stage(src, tmp_path / "file" / "sub")
    with pytest.raises(TokpackError, match="not a directory"):
        stage(src, tmp_path / "file")


@pytest.mark.parametrize("kernel_copy", [True, False], ids=["copy_file_range", "read-write"])
def test_a_source_file_cut_short_after_its_check_is_refused_and_never_kept(
    small_source, tmp_path, monkeypatch, kernel_copy
):
    """A source file truncated after the gate checked its size (at its open) and before its copy
    read it: where a checksum vouches for the file, its mismatch says so first; for a file whose
    entry records its size only (here every job's checksum left out), the byte count copied
    against that size is the one check left. One line naming the file and both sizes; the short
    copy is neither committed nor left as a temporary, and DEST gets no manifest."""
    import dataclasses

    from tokpack.packer import stage_plan

    src, _ = small_source
    victim, cut = "00001.ds", 7
    size = (src / victim).stat().st_size
    listed, real_open = stage_plan.shard_jobs, stage_plan.Source.open

    def sizes_only(*args, **kwargs):
        jobs, skipped = listed(*args, **kwargs)
        return [dataclasses.replace(j, checksum=None, rows=None) for j in jobs], skipped

    def open_then_cut(self, rel, recorded=None):
        f = real_open(self, rel, recorded)  # the gate's size check passes here
        if rel == victim:
            os.truncate(src / victim, recorded - cut)
        return f

    monkeypatch.setattr(stage_plan, "shard_jobs", sizes_only)
    monkeypatch.setattr(stage_plan.Source, "open", open_then_cut)
    if not kernel_copy:  # as across filesystems: the read+write path copies

        def refuse(*args):
            raise OSError(errno.EXDEV, "cross-device")

        monkeypatch.setattr(os, "copy_file_range", refuse)
    dst = tmp_path / "dst"
    with pytest.raises(TokpackError) as err:
        stage(src, dst, workers=1)
    e = err.value
    assert (e.message, e.file, e.where, e.expected, e.found, e.hint) == (
        "file size does not match the manifest",
        str(src / victim),
        "size",
        f"{size} bytes",
        f"{size - cut} bytes",
        stage_plan.SOURCE_HINT,
    ), str(e)
    assert "\n" not in str(e)
    assert not (dst / victim).exists()
    assert not [p for p in dst.iterdir() if TMP_MARK in p.name]
    assert not (dst / MANIFEST).exists()
