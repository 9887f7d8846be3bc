"""Best-fit padding proven, not trusted (issue 32, item 2): `validate` refuses a row whose
`.ds.pad` exceeds the row, a padding total that disagrees with the sidecars and a shard entry
without its pad checksum; `--against` proves each shard's padding, position by position, and the
total, against the plan; the readers refuse a best-fit epoch without its padding; and the
loader's masks are checked against the plan's row table, not against `.ds.pad`."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import xxhash
from click.testing import CliRunner

from conftest import random_docs, require, shuffle_run, write_source
from tokpack.formats.errors import TokpackError
from tokpack.formats.reading import canonical_bytes, read_manifest
from tokpack.formats.constants import PAD_DTYPE
from tokpack.formats.shards import PackedSource
from tokpack.loader.reader import SampleReader
from tokpack.packer.cli import main
from tokpack.shuffle.packed.replay import TokenPool
from tokpack.shuffle.packed.packed_plan import packed_plan_from_manifest
from tokpack.shuffle.packed.table import row_padding, whole_table

SEQ = 63
ROW = SEQ + 1


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("pad-src")
    rng = np.random.default_rng(11)
    return [
        write_source(root / "a", random_docs(rng, 300, 1000, 0, 1, 120)),
        write_source(root / "b", random_docs(rng, 80, 1000, 0, 1, 300)),
    ]


@pytest.fixture(scope="module")
def run(sources, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pad-run") / "run"
    shuffle_run(
        [str(s) for s in sources],
        str(out),
        weights=["2", "1"],
        seq_len=SEQ,
        seed=5,
        epochs=[0],
        samples=300,
        shard_samples=128,
        memory=64 << 20,
        packing="best-fit",
    )
    return out


@pytest.fixture
def copy(run, tmp_path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(run, dst)
    return dst


def validate(path: Path, sources=()) -> tuple[int, str]:
    against = [a for s in sources for a in ("--against", str(s))]
    res = CliRunner().invoke(main, ["validate", str(path), *against])
    return res.exit_code, res.output


STATUS = re.compile(r"^(OK|CORRUPT|UNVERIFIED|INCOMPLETE)(: | (run|epoch|source|slice|directory) )")


def problem_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line and not STATUS.match(line)]


def edit_manifest(edir: Path, change) -> None:
    m = json.loads((edir / "tokpack.json").read_text())
    change(m)
    (edir / "tokpack.json").write_bytes(canonical_bytes(m))


def write_pad(edir: Path, shard: int, pad: np.ndarray, total_too: bool = False) -> None:
    """Writes shard's `.ds.pad` and reseals its checksum (and, with total_too, the epoch's
    padding_tokens): a fault that every checksum agrees with."""
    f = edir / f"{shard:05d}.ds.pad"
    before = int(np.fromfile(f, PAD_DTYPE).sum(dtype=np.int64))
    pad.astype(PAD_DTYPE).tofile(f)

    def change(m):
        m["shards"][shard]["pad_xxh3_128"] = xxhash.xxh3_128_hexdigest(f.read_bytes())
        if total_too:
            m["packing"]["padding_tokens"] += int(pad.sum(dtype=np.int64)) - before

    edit_manifest(edir, change)


def test_a_sound_best_fit_run_passes_both(run, sources):
    code, out = validate(run)
    assert code == 0, out
    code, out = validate(run, sources)
    assert code == 0, out


def test_padding_longer_than_its_row_is_one_line(copy):
    edir = copy / "epoch-00000"
    pad = np.fromfile(edir / "00001.ds.pad", PAD_DTYPE)
    pad[7] = 1 << 30
    write_pad(edir, 1, pad)
    code, out = validate(copy)
    lines = problem_lines(out)
    assert code == 1 and len(lines) == 1, out
    assert "00001.ds.pad [row 7]" in lines[0] and "padding longer than its row" in lines[0], out
    assert f"at most {ROW}" in lines[0] and str(1 << 30) in lines[0]


def test_a_row_of_only_padding_is_not_too_long(copy):
    """The bound is the row (seq_len + 1), not less: a comparison off by one fails this."""
    edir = copy / "epoch-00000"
    pad = np.fromfile(edir / "00000.ds.pad", PAD_DTYPE)
    pad[0] = ROW
    write_pad(edir, 0, pad, total_too=True)
    assert "padding longer" not in validate(copy)[1]
    pad[0] = ROW + 1
    write_pad(edir, 0, pad, total_too=True)
    assert "padding longer" in validate(copy)[1]


def test_the_padding_total_must_be_the_sidecars_sum(copy, sources):
    edir = copy / "epoch-00000"
    edit_manifest(edir, lambda m: m["packing"].__setitem__("padding_tokens", m["packing"]["padding_tokens"] + 1))
    code, out = validate(copy)
    lines = problem_lines(out)
    assert code == 1 and len(lines) == 1 and "packing.padding_tokens" in lines[0], out
    assert "padding total disagrees with the padding sidecars" in lines[0]


def test_padding_moved_inside_a_shard_fails_against_the_plan(copy, sources):
    """Two rows' padding swapped, checksums resealed, the total unchanged: every recorded
    figure agrees, so only the plan can tell; the loader would mask the wrong tokens."""
    edir = copy / "epoch-00000"
    pad = np.fromfile(edir / "00001.ds.pad", PAD_DTYPE)
    i, j = (int(x) for x in np.flatnonzero(pad != pad[0])[:1].tolist() + [0])
    pad[[i, j]] = pad[[j, i]]
    write_pad(edir, 1, pad)
    assert validate(copy)[0] == 0  # the files agree with their manifest
    code, out = validate(copy, sources)
    lines = problem_lines(out)
    assert code == 1 and len(lines) == 1, out
    assert "shards[1].pad_xxh3_128" in lines[0] and "padding is not where its plan puts it" in lines[0], out


def test_zeroed_padding_fails_against_the_plan(copy, sources):
    edir = copy / "epoch-00000"
    pad = np.fromfile(edir / "00000.ds.pad", PAD_DTYPE)
    write_pad(edir, 0, np.zeros_like(pad), total_too=True)
    assert validate(copy)[0] == 0
    code, out = validate(copy, sources)
    lines = problem_lines(out)
    assert code == 1 and len(lines) == 1, out
    assert "packing.padding_tokens" in lines[0] and "padding is not where its plan puts it" in lines[0], out


def test_a_shard_entry_without_its_pad_checksum_is_corrupt_and_refused(copy):
    torch = require("torch", "pip install torch")  # noqa: F841
    from tokpack.loader.torch_adapter import TokpackDataset

    edir = copy / "epoch-00000"
    edit_manifest(edir, lambda m: m["shards"][2].pop("pad_xxh3_128"))
    code, out = validate(copy)
    assert code == 1 and "shards[2].pad_xxh3_128" in out and "lacks its padding sidecar" in out, out
    for opener in (
        lambda: SampleReader.open(copy),
        lambda: SampleReader.open(edir),
        lambda: next(iter(TokpackDataset(copy, micro_batch=4))),
    ):
        with pytest.raises(TokpackError) as e:
            opener()
        assert "lacks its padding sidecar" in str(e.value) and "shards[2].pad_xxh3_128" in str(e.value)
        assert "\n" not in str(e.value)


def test_a_missing_pad_file_is_corrupt_and_refused_at_open(copy):
    torch = require("torch", "pip install torch")  # noqa: F841
    from tokpack.loader.torch_adapter import TokpackDataset

    (copy / "epoch-00000" / "00002.ds.pad").unlink()
    code, out = validate(copy)
    assert code == 1 and "00002.ds.pad" in out and "no such file" in out, out
    for opener in (lambda: SampleReader.open(copy), lambda: next(iter(TokpackDataset(copy, micro_batch=4)))):
        with pytest.raises(TokpackError) as e:
            opener()
        assert "padding sidecar listed in the manifest is missing" in str(e.value) and "00002.ds.pad" in str(e.value)
        assert "\n" not in str(e.value)


def test_the_loaders_masks_are_the_plans(run, sources):
    """loss_mask and labels as the best-fit plan's own row table gives them (row_padding of
    the replayed table, the rows TokenPool builds), compared with what TokpackDataset and
    SampleReader yield: `.ds.pad` is not consulted for the expectation."""
    require("torch", "pip install torch")
    from tokpack.loader.torch_adapter import TokpackDataset

    m = read_manifest(run / "epoch-00000", kind="epoch")
    opened = [PackedSource.open(s) for s in sources]
    plan = packed_plan_from_manifest(m, opened)
    table = whole_table(plan, opened)
    planned_pad = row_padding(table, plan.samples, ROW).astype(np.int64)
    planned_rows = TokenPool(plan, opened).rows(table, 0, plan.samples, ROW, plan.pad_id).astype(np.int64)
    assert planned_pad.max() > 0 and planned_pad.min() < planned_pad.max()  # the test has padding to place
    reader = SampleReader.open(run)
    assert np.array_equal(reader.padding(0, plan.samples).astype(np.int64), planned_pad)
    mb, seen = 4, 0
    for b, batch in enumerate(TokpackDataset(run, micro_batch=mb, at_end="stop")):
        g = slice(mb * b, mb * b + mb)
        real = np.arange(1, ROW)[None, :] < (ROW - planned_pad[g])[:, None]  # label j is token j + 1
        assert np.array_equal(batch["loss_mask"].numpy(), real.astype(np.int64))
        assert np.array_equal(batch["labels"].numpy(), np.where(real, planned_rows[g, 1:], -100))
        assert np.array_equal(batch["input_ids"].numpy(), planned_rows[g, :-1])
        seen += 1
    assert seen == plan.samples // mb
