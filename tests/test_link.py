"""`pack --link` (issue 35, item 4): an input that already is its shard's bytes is hard-linked
(else reflinked, else copied with a note) once verified; the manifest and every file's bytes
are a copying pack's; the same file reached twice is still refused; nothing a link shares is
ever written through, by a later --overwrite (with or without --link), a killed-and-rerun
pack, a shuffle, a stage or a validate."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import shuffle_run
from tokpack.formats import outputs
from tokpack.formats.errors import TokpackError
from tokpack.formats.shards import PackedSource, contained_shard
from tokpack.packer import linking, packing
from tokpack.packer.api import plan, stage, validate
from tokpack.packer.cli import main
from conftest import pack

EOS, VOCAB = 0, 1000
OPTS = dict(eos_id=EOS, vocab_size=VOCAB)


def write_dt(
    folder: Path, files: int = 3, docs: int = 40, seed: int = 0, loss: bool = False, eos_every_doc: bool = True
) -> Path:
    """A datatrove folder written as datatrove lays it out: uint16 tokens, uint64 ends, metadata."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for k in range(files):
        lens = rng.integers(1, 60, docs)
        tokens = rng.integers(1, VOCAB, int(lens.sum())).astype("<u2")
        ends = np.cumsum(lens)
        tokens[ends - 1] = EOS
        if not eos_every_doc and k == 1:
            tokens[ends[3] - 1] = 7  # one document of file 1 lacks its EOS
        name = folder / f"{k:05d}_unshuffled.ds"
        tokens.tofile(name)
        ends.astype("<u8").tofile(f"{name}.index")
        Path(f"{name}.metadata").write_text(f"gpt2|2\n{len(tokens)}\n{len(tokens)}T")
        if loss:
            rng.integers(0, 2, len(tokens)).astype(np.uint8).tofile(f"{name}.loss")
    return folder


def tree(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def inputs_state(folder: Path) -> dict[str, tuple]:
    """Per input file: its bytes, inode, link count and mtime."""
    return {
        p.name: (p.read_bytes(), p.stat().st_ino, p.stat().st_nlink, p.stat().st_mtime_ns)
        for p in sorted(folder.iterdir())
    }


def links_of(folder: Path) -> dict[str, int]:
    return {name: st[2] for name, st in inputs_state(folder).items()}


def cli(*args):
    return CliRunner().invoke(main, [*map(str, args)])


@pytest.fixture
def dt(tmp_path) -> Path:
    return write_dt(tmp_path / "in")


def test_link_gives_a_copying_packs_manifest_and_bytes(dt, tmp_path):
    copy = pack([str(dt)], str(tmp_path / "copy"), **OPTS)
    res = cli("pack", dt, "-o", tmp_path / "link", "--link", "--eos-id", EOS, "--vocab-size", VOCAB, "--json")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert tree(tmp_path / "copy") == tree(tmp_path / "link")  # tokpack.json included
    assert summary["fingerprint"] == copy.fingerprint and "linked_files" not in copy.to_json()
    ds_bytes = sum(p.stat().st_size for p in dt.iterdir() if not p.name.endswith(".metadata"))
    assert summary["linked_files"] == 6 and summary["linked_bytes"] == ds_bytes
    assert summary["copied_bytes"] == summary["reflinked_bytes"] == 0 and summary["link_notes"] == []
    for k in range(3):
        for suffix in ("", ".index"):
            shard, src = tmp_path / "link" / f"{k:05d}.ds{suffix}", dt / f"{k:05d}_unshuffled.ds{suffix}"
            assert os.lstat(shard).st_ino == src.stat().st_ino and stat.S_ISREG(os.lstat(shard).st_mode)
            assert src.stat().st_nlink == 2
        # pack's own metadata text is written, never linked
        assert (tmp_path / "link" / f"{k:05d}.ds.metadata").stat().st_nlink == 1
    assert not any(p.is_symlink() for p in (tmp_path / "link").iterdir())
    # the gate takes a hard link as the regular file it is, at its recorded size
    src = PackedSource.open(tmp_path / "link")
    assert [contained_shard(src.path, s, i).name for i, s in enumerate(src.shards)] == [
        "00000.ds",
        "00001.ds",
        "00002.ds",
    ]
    assert validate([tmp_path / "link"]).ok
    assert cli("validate", tmp_path / "link").exit_code == 0
    # the flag is not part of the request: a copy and a link are the same pack
    again = pack([str(dt)], str(tmp_path / "copy"), link=True, **OPTS)
    assert again.status == "already complete" and again.linked_files == 0


def test_link_with_a_loss_mask(tmp_path):
    dt = write_dt(tmp_path / "in", loss=True)
    pack([str(dt)], str(tmp_path / "copy"), **OPTS)
    linked = pack([str(dt)], str(tmp_path / "link"), link=True, **OPTS)
    assert tree(tmp_path / "copy") == tree(tmp_path / "link") and linked.linked_files == 9
    assert (dt / "00000_unshuffled.ds.loss").stat().st_nlink == 2


def test_same_file_reached_twice_is_still_refused(dt, tmp_path):
    for suffix in ("", ".index", ".metadata"):
        os.link(dt / f"00000_unshuffled.ds{suffix}", tmp_path / f"again.ds{suffix}")
    res = cli(
        "pack", dt, tmp_path / "again.ds", "-o", tmp_path / "out", "--link", "--eos-id", EOS, "--vocab-size", VOCAB
    )
    assert res.exit_code == 1 and "the same input file is given twice" in res.stderr
    # a shard of a linked pack is its input: packing both again is the same file twice
    pack([str(dt)], str(tmp_path / "link"), link=True, **OPTS)
    res = cli(
        "pack",
        dt / "00000_unshuffled.ds",
        tmp_path / "link" / "00000.ds",
        "-o",
        tmp_path / "out2",
        "--link",
        "--eos-id",
        EOS,
        "--vocab-size",
        VOCAB,
    )
    assert res.exit_code == 1 and "the same input file is given twice" in res.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()


def test_nothing_a_link_shares_is_written_through(dt, tmp_path, monkeypatch):
    before = inputs_state(dt)
    unchanged = {n: (b, i, m) for n, (b, i, _, m) in before.items()}

    def same_bytes(nlink_ds: int):
        now = inputs_state(dt)
        assert {n: (b, i, m) for n, (b, i, _, m) in now.items()} == unchanged
        assert {n: st[2] for n, st in now.items()} == {n: 1 if n.endswith(".metadata") else nlink_ds for n in now}

    out = tmp_path / "out"
    pack([str(dt)], str(out), link=True, **OPTS)
    same_bytes(2)
    # a shuffle, a stage and a validate of the linked source read it only
    shuffle_run([str(out)], str(tmp_path / "run"), seq_len=16, seed=1, epochs=[0, 1])
    assert validate([tmp_path / "run"], against=[out]).ok
    stage(out, tmp_path / "staged")
    assert validate([tmp_path / "staged"]).ok and tree(tmp_path / "staged") == tree(out)
    same_bytes(2)
    # --overwrite with --link: a different pack (cut into shards: copied), then the linked one again
    pack([str(dt)], str(out), link=True, overwrite=True, shard_tokens=100, **OPTS)
    same_bytes(1)
    pack([str(dt)], str(out), link=True, overwrite=True, **OPTS)
    same_bytes(2)
    # --overwrite without --link: the links are unlinked, a copy written beside the input
    pack([str(dt)], str(out), overwrite=True, shard_tokens=500, **OPTS)
    same_bytes(1)
    assert validate([out]).ok
    # killed after linking two inputs, then killed before the manifest, then rerun
    ref = tmp_path / "ref"
    pack([str(dt)], str(ref), **OPTS)
    real = packing.PackStep.pack_file

    def dies_on_file_2(self, i):
        if i == 2:
            raise KeyboardInterrupt
        return real(self, i)

    fresh = tmp_path / "fresh"
    monkeypatch.setattr(packing.PackStep, "pack_file", dies_on_file_2)
    with pytest.raises(KeyboardInterrupt):
        pack([str(dt)], str(fresh), link=True, **OPTS)
    assert (fresh / ".tokpack-work" / "part-00001.json").exists()
    monkeypatch.setattr(packing.PackStep, "pack_file", real)
    real_manifest = outputs.write_manifest

    def dies_before_manifest(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(outputs, "write_manifest", dies_before_manifest)
    with pytest.raises(KeyboardInterrupt):
        pack([str(dt)], str(fresh), link=True, **OPTS)
    monkeypatch.setattr(outputs, "write_manifest", real_manifest)
    done = pack([str(dt)], str(fresh), link=True, **OPTS)
    assert done.status == "packed" and tree(fresh) == tree(ref)
    assert done.linked_files == 6  # finished from the finishing record, which kept the parts' figures
    same_bytes(2)
    # the overwrite of a linked pack by a copying one, killed mid-way and rerun
    monkeypatch.setattr(packing.PackStep, "pack_file", dies_on_file_2)
    with pytest.raises(KeyboardInterrupt):
        pack([str(dt)], str(fresh), overwrite=True, shard_tokens=50, **OPTS)
    monkeypatch.setattr(packing.PackStep, "pack_file", real)
    pack([str(dt)], str(fresh), overwrite=True, shard_tokens=50, **OPTS)
    same_bytes(1)
    assert validate([fresh]).ok


def test_an_input_pack_cannot_link_is_copied_with_a_note(tmp_path):
    dt = write_dt(tmp_path / "in", eos_every_doc=False)
    copy = pack([str(dt)], str(tmp_path / "copy"), **OPTS)
    res = cli("pack", dt, "-o", tmp_path / "link", "--link", "--eos-id", EOS, "--vocab-size", VOCAB)
    assert res.exit_code == 0, res.output
    assert tree(tmp_path / "copy") == tree(tmp_path / "link") and copy.eos_appended == 1
    assert "00001_unshuffled.ds: copied: a document does not end with EOS" in res.stderr
    assert links_of(dt)["00001_unshuffled.ds"] == 1 and links_of(dt)["00000_unshuffled.ds"] == 2
    # tokens stored wider than the input's, and an input cut into several shards: copied
    wide = pack([str(dt)], str(tmp_path / "wide"), link=True, eos_id=EOS, vocab_size=70000)
    assert wide.linked_files == 0 and all("stored as uint32" in n for n in wide.link_notes)
    cut = pack([str(dt)], str(tmp_path / "cut"), link=True, shard_tokens=300, **OPTS)
    assert cut.linked_files == 0 and all("--shard-tokens 300" in n for n in cut.link_notes)
    assert tree(tmp_path / "cut") == tree(pack_dir(dt, tmp_path / "cut-copy", shard_tokens=300))


def pack_dir(dt: Path, out: Path, **kw) -> Path:
    pack([str(dt)], str(out), **OPTS, **kw)
    return out


def test_across_filesystems_a_reflink_else_a_copy(dt, tmp_path, monkeypatch):
    ref = pack_dir(dt, tmp_path / "ref")

    real_link = os.link

    def cross_device(src, dst, **kw):  # the input on another filesystem than the output
        if ".tokpack-work" in str(dst):
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        return real_link(src, dst, **kw)

    monkeypatch.setattr(os, "link", cross_device)
    clones = []

    def clone(fd_out, request, fd_in):  # what FICLONE gives: a new inode with the source's bytes
        assert request == linking.FICLONE
        clones.append(fd_out)
        os.copy_file_range(fd_in, fd_out, os.fstat(fd_in).st_size)

    monkeypatch.setattr(linking.fcntl, "ioctl", clone)
    res = pack([str(dt)], str(tmp_path / "reflinked"), link=True, **OPTS)
    assert tree(ref) == tree(tmp_path / "reflinked") and len(clones) == 6
    assert res.linked_files == 6 and res.reflinked_bytes == res.linked_bytes > 0 and res.copied_bytes == 0
    assert links_of(dt)["00000_unshuffled.ds"] == 1  # a reflink shares extents, not the inode

    def no_clone(fd_out, request, fd_in):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(linking.fcntl, "ioctl", no_clone)
    res = pack([str(dt)], str(tmp_path / "copied"), link=True, **OPTS)
    assert tree(ref) == tree(tmp_path / "copied") and res.linked_files == 0 and res.copied_bytes > 0
    assert len(res.link_notes) == 3 and all(
        "no hard link (Invalid cross-device link) and no reflink" in n for n in res.link_notes
    )
    assert not [p for p in (tmp_path / "copied").iterdir() if ".tmp-" in p.name]


def test_a_bad_id_under_link_is_the_copying_packs_error(tmp_path):
    dt = write_dt(tmp_path / "in")
    tokens = np.fromfile(dt / "00001_unshuffled.ds", dtype="<u2")
    tokens[5] = VOCAB + 3
    tokens.tofile(dt / "00001_unshuffled.ds")
    errors = []
    for name, link in (("copy", False), ("link", True)):
        with pytest.raises(TokpackError) as e:
            pack([str(dt)], str(tmp_path / name), link=link, **OPTS)
        errors.append(str(e.value))
        assert not (tmp_path / name).exists()
    assert errors[0] == errors[1] and "00001_unshuffled.ds [document" in errors[1]
    assert set(links_of(dt).values()) == {1}


def test_an_input_changed_while_linked_is_refused(dt, tmp_path, monkeypatch):
    real = linking.xxh3_128_file

    def edits_the_input(index):  # the user's own tool writes into the input mid-pack (the scan's last read)
        result = real(index)
        with open(str(index).removesuffix(".index"), "r+b") as fh:  # the shard: a hard link to the input
            fh.write(b"\x01\x00")
        return result

    monkeypatch.setattr(linking, "xxh3_128_file", edits_the_input)
    with pytest.raises(TokpackError, match="input changed while pack --link read it"):
        pack([str(dt)], str(tmp_path / "out"), link=True, **OPTS)
    assert set(links_of(dt).values()) == {1} and not (tmp_path / "out").exists()


def test_plan_pack_reports_the_bytes_it_links_and_copies(dt, tmp_path):
    shard_files = sum(p.stat().st_size for p in dt.iterdir() if not p.name.endswith(".metadata"))
    linked = plan("pack", [str(dt)], str(tmp_path / "out"), link=True, disk_mbps=500, **OPTS)
    assert (linked.link_bytes, linked.copy_bytes, linked.reflink_bytes) == (shard_files, 0, 0)
    assert linked.passes[0]["written_bytes"] == 0 and linked.space[0]["needed_bytes"] == 0
    assert linked.passes[0]["read_bytes"] == shard_files  # it still reads every byte it links
    copied = plan("pack", [str(dt)], str(tmp_path / "out"), disk_mbps=500, **OPTS)
    assert (copied.link_bytes, copied.copy_bytes) == (0, shard_files) and copied.link_notes is None
    cut = plan("pack", [str(dt)], str(tmp_path / "out"), link=True, shard_tokens=100, disk_mbps=500, **OPTS)
    assert cut.copy_bytes == shard_files and len(cut.link_notes) == 3
    res = cli(
        "plan", "pack", dt, "-o", tmp_path / "out", "--link", "--eos-id", EOS, "--vocab-size", VOCAB, "--disk-mbps", 500
    )
    assert res.exit_code == 0 and "shard files: copies 0.0 KiB, links" in res.stdout
    assert not (tmp_path / "out").exists()


def test_an_in_place_edit_of_the_input_later_is_what_validate_reports(dt, tmp_path):
    """Why --link is not the default (docs/COMMANDS.md): a hard link shares the inode, so a later
    in-place write to the input (a datatrove rerun into the same folder opens it with "wb")
    changes the packed source; validate's checksums are what catch it."""
    out = tmp_path / "out"
    pack([str(dt)], str(out), link=True, **OPTS)
    copy = pack_dir(dt, tmp_path / "copy")
    data = (dt / "00001_unshuffled.ds").read_bytes()
    with open(dt / "00001_unshuffled.ds", "wb") as f:  # same size, one token changed, in place
        f.write(data[:10] + bytes([data[10] ^ 1]) + data[11:])
    assert not validate([out]).ok
    assert validate([copy]).ok  # a copy is not changed through its input
