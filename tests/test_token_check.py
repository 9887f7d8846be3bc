"""An epoch shard's token file is vouched for by its row hashes (issue 41 item 2): since the
change, an epoch's and a slice epoch's shard entries record no `xxh3_128`; `.ds.rows`, checked
against `rows_xxh3_128`, proves the file row by row (formats/token_check.py). `tokpack validate`,
`tokpack stage` (a whole-shard copy) and the loader with verify=True each catch one flipped
byte of such a file, naming the file and the row; epochs written before (entries WITH
`xxh3_128`, with or without row hashes) still validate, stage and read, and a flipped byte there
is still caught by the whole-file checksum; an entry with neither checksum is refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tokpack.formats.constants import MANIFEST
from tokpack.formats.errors import TokpackError
from tokpack.formats.hashes import hash_hex64, row_hashes
from tokpack.formats.names import epoch_dir_name
from tokpack.formats.shards import EpochShardWriter, RowFragments
from tokpack.formats.token_check import RowDigest
from tokpack.loader.reader import SampleReader
from tokpack.packer.staging import stage
from tokpack.packer.validation import validate_dirs
from tests.conftest import as_written_before, random_docs, write_source
from tests.test_validate import EOS, ROW, SHARD_SAMPLES, VOCAB, make_run

ROW_BYTES = ROW * 2  # uint16 tokens
SHARD = "00001.ds"  # the shard whose byte is flipped, of epoch 0
ROW_FLIPPED = 5  # the row of it the byte is in
BYTE = ROW_FLIPPED * ROW_BYTES + 7


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("token-check")
    docs = random_docs(np.random.default_rng(11), 60, VOCAB, EOS, max_len=120)
    src = write_source(root / "src", docs, vocab_size=VOCAB, eos_id=EOS, docs_per_shard=20)
    make_run(Path(src), root / "run", seed=3, epochs=[0, 1])
    return root


@pytest.fixture
def run(made, tmp_path) -> Path:
    """A fresh copy of the run, as this tokpack writes it: entries without xxh3_128."""
    shutil.copytree(made / "run", tmp_path / "run")
    return tmp_path / "run"


def _entries(epoch: Path) -> list[dict]:
    return json.loads((epoch / MANIFEST).read_bytes())["shards"]


def _flip(run: Path) -> Path:
    shard = run / epoch_dir_name(0) / SHARD
    data = bytearray(shard.read_bytes())
    data[BYTE] ^= 0x01
    shard.write_bytes(bytes(data))
    return shard


def _old(run: Path, row_hashes: bool) -> None:
    for e in (0, 1):
        as_written_before(run / epoch_dir_name(e), row_hashes=row_hashes)
    m = json.loads((run / epoch_dir_name(0) / MANIFEST).read_bytes())
    assert all("xxh3_128" in s and ("rows_xxh3_128" in s) == row_hashes for s in m["shards"])


def _problems(run: Path) -> list[tuple[str, str | None, str]]:
    report = validate_dirs([run])
    return [(Path(p.file).name, p.where, p.message) for p in report.problems]


ROW_LINE = (SHARD, f"row {ROW_FLIPPED} (byte {ROW_FLIPPED * ROW_BYTES})", "checksum mismatch")


# ------------------------------------------------------------------ the writer


def test_epoch_entries_record_no_token_checksum(run):
    for e in (0, 1):
        for s in _entries(run / epoch_dir_name(e)):
            assert "xxh3_128" not in s and list(s)[:6] == [
                "path",
                "tokens",
                "bytes",
                "samples",
                "index_xxh3_128",
                "rows_xxh3_128",
            ]
    assert validate_dirs([run]).ok


def test_hashed_only_writer_needs_no_token_and_records_the_same_entry(tmp_path):
    """What --to-nodes' owner does: write_known_index and write_pad alone, no token, no `.ds`
    written or hashed; the entry is the one the writer of the rows themselves records."""
    rng = np.random.default_rng(2)
    rows = rng.integers(1, VOCAB, size=(SHARD_SAMPLES, ROW), dtype=np.uint16)
    rows[rows % 7 == 0] = EOS
    pad = rng.integers(0, 4, size=SHARD_SAMPLES, dtype=np.uint32)
    (tmp_path / "full").mkdir()
    (tmp_path / "only").mkdir()
    full = EpochShardWriter(tmp_path / "full", "00000.ds", np.dtype("<u2"), ROW - 1, EOS, "t", padded=True)
    full.write_rows(rows)
    full.write_pad(pad)
    facts = RowFragments(ROW)
    facts.add(rows.view(np.dtype((np.void, ROW_BYTES))).ravel(), np.dtype("<u2"), EOS)
    facts.finish()
    ends, hashes = facts.of(np.arange(SHARD_SAMPLES))
    only = EpochShardWriter(tmp_path / "only", "00000.ds", np.dtype("<u2"), ROW - 1, EOS, "t", True, hashed_only=True)
    only.write_known_index(SHARD_SAMPLES, ends, hashes)
    only.write_pad(pad)
    entry = only.close()
    assert entry == full.close()
    assert entry["bytes"] == SHARD_SAMPLES * ROW_BYTES and "xxh3_128" not in entry
    assert sorted(p.name for p in (tmp_path / "only").iterdir()) == [
        "00000.ds.metadata",
        "00000.ds.pad",
        "00000.ds.rows",
    ]


def test_row_digest_names_the_row_whatever_the_pieces(tmp_path):
    """The digest takes the bytes in pieces of any size (a copy's blocks, a map's ranges): a row
    cut between two pieces is hashed whole, and the row that differs is the one named."""
    rng = np.random.default_rng(4)
    rows = rng.integers(0, 255, size=(40, 33), dtype=np.uint8)
    recorded = row_hashes(rows)
    data = bytearray(rows.tobytes())
    data[17 * 33 + 32] ^= 0x80  # the last byte of row 17
    for cut in (1, 5, 32, 33, 34, 100, 4096):
        d = RowDigest(recorded, 33)
        for a in range(0, len(data), cut):
            d.update(memoryview(data)[a : a + cut])
        where, expected, found = d.problem()
        assert where == f"row 17 (byte {17 * 33})", cut
        assert expected.startswith(f"xxh3_64 {hash_hex64(int(recorded[17]))}") and found != expected
        whole = RowDigest(recorded, 33)
        whole.update(rows.tobytes())
        assert whole.problem() is None
    short = RowDigest(recorded, 33)
    short.update(rows.tobytes()[:-1])
    assert short.problem()[0] == "row 39"


# ------------------------------------------------------------------ (a) new form: a flipped byte


def test_validate_names_the_file_and_the_row(run):
    _flip(run)
    found = _problems(run)
    # the multiset hash sees a changed sample too, but only the row hashes say which
    assert ROW_LINE in found, found
    assert not any(where == "xxh3_128" for _, where, _ in found), found


def test_stage_refuses_the_copy_naming_the_row(run, tmp_path):
    shard = _flip(run)
    for block in (1000, 4 << 20):  # blocks that cut rows, and one that holds the shard
        with pytest.raises(TokpackError) as err:
            stage(run, tmp_path / f"dest-{block}", block=block)
        e = err.value
        assert (e.message, e.file, e.where) == (
            "checksum mismatch while copying",
            str(shard),
            f"row {ROW_FLIPPED} (byte {ROW_FLIPPED * ROW_BYTES})",
        ), str(e)
        assert not (tmp_path / f"dest-{block}" / MANIFEST).exists()


def test_stage_checks_a_copy_already_in_place_row_by_row(run, tmp_path):
    """A rerun keeps a file already at DEST once verified, row by row: the intact shards stay, the
    one with a changed byte is copied again, and only it."""
    dest = tmp_path / "dest"
    stage(run, dest)
    _flip(dest)
    again = stage(run, dest)
    assert again.copied_files == 1 and again.skipped_files == again.files - 1 - 3  # files counts 3 manifests
    assert (dest / epoch_dir_name(0) / SHARD).read_bytes() == (run / epoch_dir_name(0) / SHARD).read_bytes()


def _flip_rows(run) -> Path:
    """A bit of epoch 0's SHARD's `.ds.rows` changed (its row ROW_FLIPPED's hash): the file."""
    rows = run / epoch_dir_name(0) / (SHARD + ".rows")
    data = bytearray(rows.read_bytes())
    data[8 * ROW_FLIPPED] ^= 1
    rows.write_bytes(bytes(data))
    return rows


def test_stage_refuses_row_hashes_that_are_not_the_manifests(run, tmp_path):
    rows = _flip_rows(run)
    with pytest.raises(TokpackError) as err:
        stage(run, tmp_path / "dest")
    assert (err.value.file, err.value.where) == (str(rows), "rows_xxh3_128"), str(err.value)


def test_loader_with_verify_names_the_file_and_the_row(run):
    shard = _flip(run)
    first = SHARD_SAMPLES  # epoch 0's shard 1 starts at sample SHARD_SAMPLES
    assert SampleReader.open(run).read(first, 1).shape == (1, ROW)  # sizes right: only a check can tell
    r = SampleReader.open(run, verify=True)
    r.read(0, 1)  # shard 0 is intact
    with pytest.raises(TokpackError) as err:
        r.read(first, 1)
    assert (err.value.file, err.value.where) == (
        str(shard),
        f"row {ROW_FLIPPED} (byte {ROW_FLIPPED * ROW_BYTES})",
    ), str(err.value)


def test_slice_reader_with_verify_names_the_rank_file_and_the_row(run, tmp_path):
    from tokpack.formats.slices import rank_file_name
    from tokpack.packer.slicing import stage_slice

    s = tmp_path / "slice"
    stage_slice(str(run), s, ranks="0-1", world_size=2, micro_batch=2)
    f = s / epoch_dir_name(0) / rank_file_name(1)
    assert all("xxh3_128" not in e for e in _entries(s / epoch_dir_name(0)))
    data = bytearray(f.read_bytes())
    data[3 * ROW_BYTES + 1] ^= 1
    f.write_bytes(bytes(data))
    r = SampleReader.open(s, verify=True)
    with pytest.raises(TokpackError) as err:
        for _ in r.batches(1, 2, 2, 0, at_end="stop"):
            pass
    assert (err.value.file, err.value.where) == (str(f), f"row 3 (byte {3 * ROW_BYTES})"), str(err.value)
    assert (rank_file_name(1), f"row 3 (byte {3 * ROW_BYTES})", "checksum mismatch") in _problems(s)


# ------------------------------------------------------------------ (b) the form written before


@pytest.mark.parametrize("row_hashes", [True, False], ids=["with-row-hashes", "before-row-hashes"])
def test_an_old_form_epoch_validates_stages_and_reads(run, tmp_path, row_hashes):
    _old(run, row_hashes)
    assert validate_dirs([run]).ok
    stage(run, tmp_path / "dest")
    for p in run.rglob("*"):
        if p.is_file() and p.name != "tokpack.lock":
            assert (tmp_path / "dest" / p.relative_to(run)).read_bytes() == p.read_bytes(), p
    r = SampleReader.open(run, verify=True)
    assert r.read(0, r.total_samples).shape == (r.total_samples, ROW)


@pytest.mark.parametrize("row_hashes", [True, False], ids=["with-row-hashes", "before-row-hashes"])
def test_an_old_form_epoch_still_catches_a_flipped_byte_by_its_checksum(run, tmp_path, row_hashes):
    _old(run, row_hashes)
    shard = _flip(run)
    assert (SHARD, "xxh3_128", "checksum mismatch") in _problems(run)
    with pytest.raises(TokpackError) as err:
        stage(run, tmp_path / "dest")
    assert (err.value.file, err.value.where) == (str(shard), "xxh3_128"), str(err.value)
    r = SampleReader.open(run, verify=True)
    with pytest.raises(TokpackError, match="checksum mismatch") as err:
        r.read(SHARD_SAMPLES, 1)
    assert (err.value.file, err.value.where) == (str(shard), "xxh3_128"), str(err.value)


# ------------------------------------------------------------------ (c) neither checksum


def _without_both(epoch: Path, i: int) -> None:
    path = epoch / MANIFEST
    m = json.loads(path.read_bytes())
    m["shards"][i].pop("xxh3_128", None)
    del m["shards"][i]["rows_xxh3_128"]
    path.write_bytes(json.dumps(m, indent=1).encode() + b"\n")


NEITHER = ("shards[1].rows_xxh3_128", "field 'rows_xxh3_128' or 'xxh3_128'", "neither", "manifest field missing")


@pytest.mark.parametrize("form", ["new", "old"])
def test_an_epoch_entry_with_neither_checksum_is_refused(run, tmp_path, form):
    if form == "old":
        _old(run, True)
    _without_both(run / epoch_dir_name(0), 1)
    report = validate_dirs([run])
    assert [(p.where, p.expected, p.found, p.message) for p in report.problems if p.file.endswith(MANIFEST)] == [
        NEITHER
    ], [p.line() for p in report.problems]
    for refused in (lambda: SampleReader.open(run, verify=True), lambda: stage(run, tmp_path / "dest")):
        with pytest.raises(TokpackError) as err:
            refused()
        assert (err.value.where, err.value.message) == (NEITHER[0], NEITHER[3]) and "\n" not in str(err.value)


def test_a_slice_epoch_entry_with_neither_checksum_is_refused(run, tmp_path):
    from tokpack.packer.slicing import stage_slice

    s = tmp_path / "slice"
    stage_slice(str(run), s, ranks="0-1", world_size=2, micro_batch=2)
    _without_both(s / epoch_dir_name(0), 1)
    assert [
        (p.where, p.expected, p.found, p.message) for p in validate_dirs([s]).problems if p.file.endswith(MANIFEST)
    ] == [NEITHER]
    with pytest.raises(TokpackError) as err:
        SampleReader.open(s)
    assert (err.value.where, err.value.message) == (NEITHER[0], NEITHER[3]), str(err.value)


def test_stage_names_the_rows_field_whichever_of_its_checks_sees_a_changed_rows_file_first(run, tmp_path, monkeypatch):
    """A `.ds.rows` unlike its manifest's is seen by the token file's row check (which reads it
    first) or by its own copy, whichever of stage's threads comes first: both name the manifest's
    field `rows_xxh3_128` (test_stage_refuses_row_hashes_that_are_not_the_manifests). Here only
    its own copy can see it (the token file's job left out); it named `xxh3_128`, the token
    file's field, before."""
    from tokpack.packer import stage_plan

    listed = stage_plan.shard_jobs

    def without_the_token_file(*args, **kwargs):
        jobs, skipped = listed(*args, **kwargs)
        return [j for j in jobs if not j.rel.endswith("/" + SHARD)], skipped

    monkeypatch.setattr(stage_plan, "shard_jobs", without_the_token_file)
    rows = _flip_rows(run)
    with pytest.raises(TokpackError) as err:
        stage(run, tmp_path / "dest")
    e = err.value
    assert (e.message, e.file, e.where) == ("checksum mismatch while copying", str(rows), "rows_xxh3_128"), str(e)
