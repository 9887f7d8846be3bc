"""Best-fit packing (`--packing best-fit`, shuffle/packed.py): the packing rules, golden values
of the plan, the engine's bytes, the loader's document boundaries and masks, and the replay
of `validate --against`."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import xxhash
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import random_docs, require, shuffle_run, write_source
from tokpack.formats.errors import TokpackError
from tokpack.formats.reading import canonical_bytes, read_manifest
from tokpack.formats.constants import PAD_DTYPE
from tokpack.formats.shards import PackedSource
from tokpack.loader.reader import SampleReader, cu_seqlens, document_masks, positions_from_eos
from tokpack.packer.api import validate
from tokpack.packer.cli import main
from tokpack.shuffle.packed.packed_plan import (
    PACKED_ALGORITHM,
    PackedOptions,
    packed_epoch_plan,
    packed_plan_from_manifest,
)
from tokpack.shuffle.packed.table import PIECE, cut_problems, row_padding, whole_table
from tokpack.shuffle.packed.replay import TokenPool
from tokpack.shuffle.packed.passes import best_fit_decreasing, documents_of, pack_pass, source_pass
from tokpack.shuffle.permutation import Bijection
from tokpack.shuffle.schedule import RunPlan, Schedule, Stage


def table_hash(table: np.ndarray) -> str:
    """A row table's xxh3_128 as `packing.table_xxh3_128` records it: of its PIECE records' bytes."""
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(table).tobytes())


# ------------------------------------------------------------------ the packing rules


def test_best_fit_decreasing_by_hand():
    # Row 8. Decreasing: 6 opens row 0 (room 2); 5 fits nowhere, opens row 1 (room 3); 4 opens
    # row 2; 3 goes to the row with the least room that holds it: row 1; 2 to row 0.
    row, offset, rows = best_fit_decreasing(np.array([5, 3, 4, 2, 6]), np.arange(5), 8)
    assert rows == 3
    assert row.tolist() == [1, 1, 2, 0, 0] and offset.tolist() == [0, 5, 0, 6, 0]


def _best_fit_by_the_rule(tails, positions, row_tokens):
    """BFD as docs/COMMANDS.md states it, one piece at a time over a plain list of rooms."""
    room, row, offset = [], [0] * len(tails), [0] * len(tails)
    for i in sorted(range(len(tails)), key=lambda i: (-int(tails[i]), int(positions[i]))):
        fits = [r for r, left in enumerate(room) if left >= tails[i]]
        r = min(fits, key=lambda r: (room[r], r)) if fits else len(room)
        if not fits:
            room.append(row_tokens)
        row[i], offset[i] = r, row_tokens - room[r]
        room[r] -= int(tails[i])
    return row, offset, len(room)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), row_tokens=st.integers(1, 40))
def test_best_fit_decreasing_is_the_rule(data, row_tokens):
    """The pieces longer than half a row are placed without the loop (each opens a row); the
    result is the rule's, piece by piece, ties included."""
    tails = np.array(data.draw(st.lists(st.integers(1, row_tokens), max_size=60)), np.int64)
    positions = np.array(data.draw(st.permutations(range(len(tails)))), np.int64)
    row, offset, rows = best_fit_decreasing(tails, positions, row_tokens)
    assert (row.tolist(), offset.tolist(), rows) == _best_fit_by_the_rule(tails, positions, row_tokens)


def test_best_fit_ties_go_to_the_lowest_row_and_the_earliest_document():
    # The 5s in position order open rows 0 and 1 (room 3 each); the first 2 by position goes to
    # the lower of the two equally full rows, the second to the row with the least room left.
    row, offset, rows = best_fit_decreasing(np.array([5, 5, 2, 2]), np.array([1, 0, 3, 2]), 8)
    assert rows == 2 and row.tolist() == [1, 0, 1, 0] and offset.tolist() == [0, 0, 5, 5]


def check_pass(lengths: np.ndarray, pr, row_tokens: int) -> None:
    """Every document of the pass exactly once, in pieces covering it; rows hold <= row_tokens,
    pieces back to back from offset 0; only documents longer than a row are cut, into full
    rows and one tail."""
    order = np.lexsort((pr.doc_offset, pr.doc))
    doc, off, ln = pr.doc[order], pr.doc_offset[order], pr.length[order]
    assert np.array_equal(np.unique(doc), np.arange(len(lengths)))
    first = np.r_[True, doc[1:] != doc[:-1]]
    assert np.all(off[first] == 0)
    assert np.all(off[~first] == (off + ln)[np.r_[~first[1:], False]])  # each piece starts where the last ended
    last = np.r_[doc[1:] != doc[:-1], True]
    assert np.array_equal((off + ln)[last], lengths)
    table = np.zeros(len(pr.row), PIECE)
    table["g"], table["row_offset"], table["doc"] = pr.row, pr.row_offset, pr.doc
    table["doc_offset"], table["length"] = pr.doc_offset, pr.length
    assert cut_problems(table, {0: lengths}, row_tokens) == []
    fill = np.bincount(pr.row, weights=pr.length, minlength=pr.rows)
    assert fill.max() <= row_tokens and fill.min() > 0
    starts = np.r_[True, pr.row[1:] != pr.row[:-1]]
    assert np.all(pr.row_offset[starts] == 0)
    assert np.all(pr.row_offset[~starts] == (pr.row_offset + pr.length)[np.r_[~starts[1:], False]])


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.one_of(st.integers(1, 40), st.integers(40, 200)), min_size=1, max_size=120),
    row_tokens=st.integers(2, 64),
    group=st.integers(1, 600),
    seed=st.integers(0, 3),
)
def test_a_pass_holds_every_document_once_and_cuts_only_long_ones(lengths, row_tokens, group, seed):
    lengths = np.array(lengths, dtype=np.int64)
    pr = pack_pass(lengths, Bijection(len(lengths), "docs", seed, 0, 0), row_tokens, group)
    check_pass(lengths, pr, row_tokens)
    # A document that fits a row is never cut; a long one is cut into len // row full rows and a tail.
    per_doc = np.bincount(pr.doc, minlength=len(lengths))
    assert np.array_equal(per_doc, lengths // row_tokens + (lengths % row_tokens > 0))


def test_a_cut_that_was_not_needed_is_named():
    lengths = np.array([10, 20], dtype=np.int64)
    t = np.zeros(3, PIECE)
    t["g"], t["row_offset"], t["doc"], t["doc_offset"], t["length"] = (
        [0, 0, 1],
        [0, 10, 0],
        [0, 1, 1],
        [0, 0, 8],
        [10, 8, 12],
    )
    assert cut_problems(t, {0: lengths}, 32) == ["a document that fits a row is cut"]


# ------------------------------------------------------------------ golden plan values

SEQ_LEN, SEED, ROW = 31, 1234, 32


def golden_docs(seed: int, n: int, longest: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        d = rng.integers(1, 1000, size=int(rng.integers(1, longest)))
        d[-1] = 0
        out.append(d)
    return out


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> list[PackedSource]:
    root = tmp_path_factory.mktemp("packed-golden")
    return [
        PackedSource.open(write_source(root / "a", golden_docs(11, 60, 50))),
        PackedSource.open(write_source(root / "b", golden_docs(12, 20, 90))),
    ]


# epoch -> per source (c_s, R_{s,0}, first pass, passes, rows of those passes), table checksum, padding
GOLDEN = {
    0: ([(10, 46, 0, 1, (46,)), (30, 37, 0, 1, (37,))], "08f888dc0562d9a7c5aa029348cbe31f", 122),
    1: ([(10, 46, 0, 1, (46,)), (30, 37, 0, 2, (37, 36))], "525cf51602bbad067283b0007d0bbbe5", 121),
}
# The first pieces of epoch 0: (g, row offset, source, document, offset in it, length).
GOLDEN_PIECES = [
    (0, 0, 1, 18, 32, 17),
    (1, 0, 1, 9, 32, 32),
    (2, 0, 1, 16, 0, 32),
    (3, 0, 0, 11, 32, 10),
    (4, 0, 0, 1, 0, 24),
    (4, 24, 0, 20, 32, 5),
]


@pytest.mark.parametrize("epoch", [0, 1])
def test_golden_packed_plan(golden, epoch):
    plan = packed_epoch_plan(
        golden,
        seq_len=SEQ_LEN,
        seed=SEED,
        epoch=epoch,
        weights=["1", "3"],
        samples=40,
        options=PackedOptions(group_tokens=256),
    )
    sources, checksum, padding = GOLDEN[epoch]
    assert [(s.samples, s.windows, s.first_pass, s.passes, s.pass_rows) for s in plan.sources] == sources
    table = whole_table(plan, golden)
    assert table_hash(table) == checksum
    assert int(row_padding(table, plan.samples, ROW).sum()) == padding
    if epoch == 0:
        assert [tuple(int(x) for x in r) for r in table[:6]] == GOLDEN_PIECES


# ------------------------------------------------------------------ chains, weights, schedules


def chain_rows(plan, s: int) -> list[tuple]:
    """Source s's pieces in this epoch as its chain gives them: (chain position, row offset,
    document, offset, length), from the passes alone."""
    lo = plan.chain_start(s)
    out, at, p = [], 0, 0
    while at < lo + plan.sources[s].samples:
        pr = source_pass(plan, s, p)
        for r, ro, d, do, n in zip(
            pr.row.tolist(), pr.row_offset.tolist(), pr.doc.tolist(), pr.doc_offset.tolist(), pr.length.tolist()
        ):
            if lo <= at + r < lo + plan.sources[s].samples:
                out.append((at + r, ro, d, do, n))
        at, p = at + pr.rows, p + 1
    return sorted(out)


def table_rows(plan, table, s: int) -> list[tuple]:
    """The same, read back from the epoch's row table through sigma_e^-1."""
    sel = table[table["source"] == s]
    q = plan.order().inverse(sel["g"].astype(np.int64))
    pos = q - plan.sources[s].base + plan.chain_start(s)
    return sorted(
        zip(
            pos.tolist(),
            sel["row_offset"].tolist(),
            sel["doc"].tolist(),
            sel["doc_offset"].tolist(),
            sel["length"].tolist(),
        )
    )


@pytest.fixture(scope="module")
def corpus3(tmp_path_factory) -> list[PackedSource]:
    root = tmp_path_factory.mktemp("packed-mix")
    rng = np.random.default_rng(3)
    return [
        PackedSource.open(write_source(root / name, random_docs(rng, n, 1000, 0, 1, longest)))
        for name, n, longest in (("web", 80, 120), ("code", 30, 300), ("math", 15, 40))
    ]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    weights=st.lists(st.integers(1, 9), min_size=3, max_size=3),
    samples=st.integers(3, 200),
    seq_len=st.sampled_from([15, 63, 127]),
    seed=st.integers(0, 1000),
)
def test_epochs_follow_each_chain_once_per_pass(corpus3, weights, samples, seq_len, seed):
    """Each epoch takes chain positions [cursor, cursor + c_s) of each source, and the chain is
    its passes back to back, each pass every document once (test above): so every document
    (or fragment) is used once per pass, with any weights."""
    for epoch in range(3):
        plan = packed_epoch_plan(
            corpus3,
            seq_len=seq_len,
            seed=seed,
            epoch=epoch,
            weights=[str(w) for w in weights],
            samples=samples,
            options=PackedOptions(group_tokens=500),
        )
        table = whole_table(plan, corpus3)
        assert len(np.unique(table["g"])) == plan.samples == samples
        for s in range(3):
            assert table_rows(plan, table, s) == chain_rows(plan, s)
        assert cut_problems(table, {s: documents_of(src)[1] for s, src in enumerate(corpus3)}, seq_len + 1) == []


def test_a_schedule_keeps_each_chain_across_stages(corpus3):
    paths = [str(s.path) for s in corpus3]
    sched = Schedule(
        31,
        7,
        (
            Stage("a", tuple(paths[:2]), ("1", "1"), 2, samples=50),
            Stage("b", tuple(paths), ("1", "2", "1"), 1, samples=70),
        ),
        packing="best-fit",
    )
    run = RunPlan(sched, corpus3, ["web", "code", "math"])
    taken = [0, 0, 0]
    for epoch in range(3):
        plan = run.epoch_plan(epoch)
        assert plan.algorithm == PACKED_ALGORITHM and plan.samples == (50 if epoch < 2 else 70)
        table = whole_table(plan, corpus3)
        for s in range(3):
            assert plan.chain_start(s) == taken[s]  # the chain goes on where the last stage left it
            assert table_rows(plan, table, s) == chain_rows(plan, s)
            taken[s] += plan.sources[s].samples
    assert taken[2] == plan.sources[2].samples  # math joins in stage b, at the start of its chain


# ------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("packed-src")
    rng = np.random.default_rng(5)
    return [
        write_source(root / "big", random_docs(rng, 400, 1000, 0, 1, 150)),
        write_source(root / "small", random_docs(rng, 60, 1000, 0, 1, 400)),
    ]


def shuffle_packed(sources, out, **kw):
    args = dict(
        weights=["2", "1"],
        seq_len=63,
        seed=9,
        epochs=[0, 1],
        samples=500,
        shard_samples=128,
        memory=64 << 20,
        packing="best-fit",
    )
    args.update(kw)
    return shuffle_run([str(s) for s in sources], str(out), **args)


@pytest.fixture(scope="module")
def run(sources, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("packed-run") / "run"
    shuffle_packed(sources, out)
    return out


def test_rows_are_the_planned_documents_with_padding(run, sources):
    opened = [PackedSource.open(s) for s in sources]
    for e in (0, 1):
        edir = run / f"epoch-{e:05d}"
        m = read_manifest(edir, kind="epoch")
        assert m["shuffle"] == PACKED_ALGORITHM and m["packing"]["pad_id"] == 0
        plan = packed_plan_from_manifest(m, opened)
        table = whole_table(plan, opened)
        assert table_hash(table) == m["packing"]["table_xxh3_128"]
        want = TokenPool(plan, opened).rows(table, 0, plan.samples, 64, plan.pad_id)
        got = np.concatenate([np.fromfile(edir / s["path"], "<u2") for s in m["shards"]])
        assert got.size == plan.samples * 64  # every row exactly seq_len + 1 tokens
        assert np.array_equal(got.reshape(-1, 64), want)
        pad = np.concatenate([np.fromfile(edir / f"{s['path']}.pad", PAD_DTYPE) for s in m["shards"]])
        assert (
            np.array_equal(pad, row_padding(table, plan.samples, 64))
            and int(pad.sum()) == m["packing"]["padding_tokens"]
        )
        tails = got.reshape(-1, 64)[np.arange(64)[None, :] >= 64 - pad[:, None].astype(np.int64)]
        assert np.all(tails == 0)  # padded with the pad id (EOS by default)
        # No document that fits a row is cut: each such document is in one row, whole.
        assert cut_problems(table, {s: documents_of(o)[1] for s, o in enumerate(opened)}, 64) == []


def test_index_boundaries_are_the_eos_positions(run):
    m = read_manifest(run / "epoch-00000", kind="epoch")
    for s in m["shards"]:
        tokens = np.fromfile(run / "epoch-00000" / s["path"], "<u2").reshape(-1, 64)
        ends = tokens == 0
        ends[:, -1] = True
        idx = np.fromfile(run / "epoch-00000" / f"{s['path']}.index", "<u8")
        assert np.array_equal(idx, np.flatnonzero(ends.ravel()) + 1)


@pytest.mark.parametrize(
    "kw",
    [
        dict(workers=2),
        dict(memory=16 << 20, tasks=3),
        dict(memory=1 << 20, tasks=3),
        dict(memory=1 << 20, workers=2, shard_samples=50),
    ],
)
def test_bytes_do_not_depend_on_workers_or_memory(run, sources, tmp_path, kw):
    """In memory, and out of core (1 MiB: scatter the pieces to buckets, then order them) with
    several scatter tasks and workers: the same bytes."""
    out = tmp_path / "again"
    summary = shuffle_packed(sources, out, **kw)
    assert summary["path"] == ("out-of-core" if kw.get("memory") == 1 << 20 else "in-memory")
    if "shard_samples" in kw:  # other shards: the same rows in the same order
        for e in ("epoch-00000", "epoch-00001"):
            assert np.array_equal(SampleReader.open(out / e).read(0, 500), SampleReader.open(run / e).read(0, 500))
        return
    for e in ("epoch-00000", "epoch-00001"):
        for f in sorted((run / e).iterdir()):
            assert (out / e / f.name).read_bytes() == f.read_bytes(), f
    assert not (out / ".tokpack-work").exists()


def test_a_rerun_with_another_packing_is_refused(run, sources):
    with pytest.raises(TokpackError, match="different run") as e:
        shuffle_packed(sources, run, packing="concat", epochs=[2])
    assert e.value.where in ("shuffle", "packing")
    with pytest.raises(TokpackError, match="different run"):
        shuffle_packed(sources, run, pad_id=5, epochs=[2])


def test_the_cli_writes_a_best_fit_run_and_validate_replays_it(sources, tmp_path):
    out = tmp_path / "cli"
    res = CliRunner().invoke(
        main,
        [
            "shuffle",
            *map(str, sources),
            "-o",
            str(out),
            "--seq-len",
            "63",
            "--seed",
            "3",
            "--epochs",
            "1",
            "--packing",
            "best-fit",
            "--pad-id",
            "7",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    assert read_manifest(out, kind="run")["packing"] == {"method": "best-fit", "group_tokens": 1 << 22, "pad_id": 7}
    against = [a for s in sources for a in ("--against", str(s))]
    res = CliRunner().invoke(main, ["validate", str(out), *against])
    assert res.exit_code == 0, res.output
    # The manifest says another group size than the one the rows were packed with: the replayed
    # row table differs from the recorded one.
    edir = out / "epoch-00000"
    m = json.loads((edir / "tokpack.json").read_text())
    m["packing"]["group_tokens"] = 200
    (edir / "tokpack.json").write_bytes(canonical_bytes(m))
    res = CliRunner().invoke(main, ["validate", str(out), *against])
    assert res.exit_code == 1 and "row table is not the one its plan packs" in res.output


def test_validate_catches_a_damaged_pad_sidecar(run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    f = copy / "epoch-00000" / "00000.ds.pad"
    pad = np.fromfile(f, PAD_DTYPE)
    pad[3] += 1
    pad.tofile(f)
    res = CliRunner().invoke(main, ["validate", str(copy)])
    assert res.exit_code == 1 and "00000.ds.pad" in res.output and "checksum mismatch" in res.output


# ------------------------------------------------------------------ the loader


def test_document_masks_by_hand():
    rows = np.array([[5, 6, 0, 7, 0, 0, 0], [1, 2, 3, 4, 5, 6, 0]])
    pos, real = document_masks(rows, np.array([2, 0], PAD_DTYPE), 0)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5, 6]]
    assert real.tolist() == [[True] * 5 + [False] * 2, [True] * 7]
    assert cu_seqlens(pos).tolist() == [0, 3, 5, 7, 14]


def test_tokpack_dataset_masks(run, sources):
    torch = require("torch", "pip install torch")
    from tokpack.loader.torch_adapter import TokpackDataset

    reader = SampleReader.open(run)
    m = read_manifest(run / "epoch-00000", kind="epoch")
    opened = [PackedSource.open(s) for s in sources]
    table = whole_table(packed_plan_from_manifest(m, opened), opened)
    ds = TokpackDataset(run, micro_batch=4)
    for b, batch in zip(range(5), ds):
        rows = reader.read(4 * b, 4).astype(np.int64)
        pad = reader.padding(4 * b, 4).astype(np.int64)
        assert np.array_equal(pad, row_padding(table, m["samples"], 64)[4 * b : 4 * b + 4])
        real = np.arange(1, 64)[None, :] < 64 - pad[:, None]  # the label of input j is token j + 1
        assert np.array_equal(batch["loss_mask"].numpy(), real.astype(np.int64))
        assert np.array_equal(batch["labels"].numpy(), np.where(real, rows[:, 1:], -100))
        pos = batch["position_ids"].numpy()
        # Positions restart after every EOS of a document (datatrove's convention) ...
        eos = positions_from_eos(rows, 0)[:, :-1]
        inside = np.arange(63)[None, :] < 64 - pad[:, None]
        assert np.array_equal(pos[inside], eos[inside])
        # ... and the padding is one segment: cu_seqlens has one boundary per document start.
        cu = batch["cu_seqlens"].numpy()
        assert cu[0] == 0 and cu[-1] == 4 * 63 and np.array_equal(np.diff(cu) > 0, np.ones(len(cu) - 1, bool))
        assert np.array_equal(cu[:-1], np.flatnonzero(pos.reshape(-1) == 0))
        assert batch["input_ids"].dtype == torch.int64


def test_datatrove_reads_a_best_fit_epoch_in_order(run):
    require("datatrove", "pip install datatrove")
    from datatrove.utils.dataset import DatatroveFolderDataset

    edir = run / "epoch-00000"
    ds = DatatroveFolderDataset(str(edir), seq_len=63, token_size=2, recursive=False, return_positions=True)
    reader = SampleReader.open(edir)
    assert len(ds) == reader.total_samples
    for g in range(len(ds)):
        item = ds[g]
        assert np.array_equal(item["input_ids"].numpy(), reader.read(g)[0].astype(np.int64))
        # datatrove's positions from the .ds.index: a restart after each EOS (a pad token that
        # is EOS is a document of one token to it; TokpackDataset makes the padding one segment).
        assert np.array_equal(item["positions"].numpy(), reader.index_positions(g, 1)[0])


def test_plan_shuffle_reports_a_best_fit_epoch(sources, tmp_path):
    res = CliRunner().invoke(
        main,
        [
            "plan",
            "shuffle",
            *map(str, sources),
            "-o",
            str(tmp_path / "p"),
            "--seq-len",
            "63",
            "--seed",
            "3",
            "--epochs",
            "1",
            "--packing",
            "best-fit",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    assert got["path"] == "in-memory" and not (tmp_path / "p").exists()
    opened = [PackedSource.open(s) for s in sources]
    plan = packed_epoch_plan(opened, seq_len=63, seed=3, epoch=0)
    assert got["samples_per_epoch"] == plan.samples == sum(s.windows for s in plan.sources)


@pytest.mark.parametrize("memory", [64 << 20, 1 << 20])
def test_plan_shuffle_predicts_the_row_tables_scratch(sources, tmp_path, memory):
    """The plan's "table" pass and its scratch, estimated from the sources' counts, against the
    files build_table writes for the same epoch: at least them, within 3x."""
    from tokpack.packer.api import plan
    from tokpack.packer.plan_result import report_lines
    from tokpack.shuffle.packed.table import build_table

    weights = {str(sources[0]): "2", str(sources[1]): "1"}
    got = plan(
        "shuffle",
        weights,
        tmp_path / "p",
        seq_len=63,
        seed=9,
        samples=500,
        shard_samples=128,
        memory=memory,
        packing="best-fit",
        disk_mbps=100,
    )
    (epoch,) = got.epochs
    assert epoch["path"] == ("in-memory" if memory == 64 << 20 else "out-of-core")
    table = next(p for p in got.passes if p["name"] == "table")
    assert (
        table["written_bytes"] == epoch["table_bytes"]
        and table["pack_seconds"] > 0
        and table["memory_per_task"] == memory
    )
    assert table["seconds"] == round(max(2 * table["written_bytes"] / 100e6, table["pack_seconds"]), 1)
    opened = [PackedSource.open(s) for s in sources]
    plan = packed_epoch_plan(opened, seq_len=63, seed=9, epoch=0, weights=["2", "1"], samples=500)
    built = build_table(plan, opened, tmp_path / "packing", memory)
    written = sum(f.stat().st_size for f in (tmp_path / "packing").iterdir())
    pieces = (tmp_path / "packing" / "table").stat().st_size // PIECE.itemsize
    assert pieces <= epoch["table_pieces"] <= 3 * pieces
    assert written <= epoch["table_bytes"] <= 3 * written, (written, epoch["table_bytes"])
    assert built.padding >= 0
    # The space check counts the table with the epoch (and out of core with the buckets).
    assert got.space[0]["needed_bytes"] >= epoch["output_bytes"] + epoch["table_bytes"]
    assert any("row table of ~" in line for line in report_lines(got))
    assert not (tmp_path / "p").exists()


def test_a_schedule_declares_best_fit(sources, tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text(
        f"seq_len: 63\nseed: 4\npacking: best-fit\nstages:\n"
        f"  - name: a\n    epochs: 1\n    sources: {{{sources[0]}: 1}}\n"
        f"  - name: b\n    epochs: 1\n    sources: {{{sources[0]}: 1, {sources[1]}: 1}}\n"
    )
    res = CliRunner().invoke(main, ["shuffle", "--schedule", str(yaml_file), "-o", str(tmp_path / "run")])
    assert res.exit_code == 0, res.output
    run = read_manifest(tmp_path / "run", kind="run")
    assert run["shuffle"] == PACKED_ALGORITHM and run["packing"]["method"] == "best-fit"
    e1 = read_manifest(tmp_path / "run" / "epoch-00001", kind="epoch")
    assert e1["sources"][0]["cursor"] == read_manifest(tmp_path / "run" / "epoch-00000", kind="epoch")["samples"]
    against = [a for s in sources for a in ("--against", str(s))]
    res = CliRunner().invoke(main, ["validate", str(tmp_path / "run"), *against])
    assert res.exit_code == 0, res.output
    yaml_file.write_text(yaml_file.read_text().replace("packing: best-fit", "packing: best"))
    res = CliRunner().invoke(main, ["shuffle", "--schedule", str(yaml_file), "-o", str(tmp_path / "other")])
    assert res.exit_code == 1 and "unknown packing" in res.output and "Traceback" not in res.output


def brute_repeats(plan, table, s: int) -> int:
    """Rows of source s in the epoch's table holding a piece (doc, doc_offset) that a row earlier
    in its chain holds: from the table alone, each row's chain position by sigma_e's inverse."""
    sel = table[table["source"] == s]
    sp = plan.sources[s]
    chain = plan.order().inverse(sel["g"].astype(np.int64)) - sp.base + plan.chain_start(s)
    first = {}
    for c, d, o in sorted(zip(chain.tolist(), sel["doc"].tolist(), sel["doc_offset"].tolist())):
        first.setdefault((d, o), c)
    return len(
        {c for c, d, o in zip(chain.tolist(), sel["doc"].tolist(), sel["doc_offset"].tolist()) if first[d, o] < c}
    )


def test_repeats_count_the_rows_an_upsampled_epoch_holds_twice(corpus3):
    """Issue 42: `repeats` counted document pieces, so it could exceed the samples; it counts
    the rows (samples) holding a piece an earlier row of the source holds, out of the samples."""
    plan = packed_epoch_plan(corpus3, seq_len=63, seed=2, epoch=0, weights=["1", "1", "4"], samples=300)
    table = whole_table(plan, corpus3)
    for s, r in enumerate(plan.source_report()):
        assert r["repeats"] == brute_repeats(plan, table, s) <= r["samples"]
        assert r["repeat_unit"] == "rows" and r["repeat_total"] in (None, r["samples"])
    assert plan.source_report()[2]["repeats"] > 0  # math is upsampled


@pytest.mark.parametrize("epoch", [0, 1, 3])
@pytest.mark.parametrize("samples,weights", [(300, ["1", "1", "4"]), (120, ["1", "1", "1"]), (900, ["1", "2", "9"])])
def test_repeats_by_whole_passes_are_the_brute_count(corpus3, epoch, samples, weights):
    """The repeat count takes a shortcut when the epoch's first pass of a source is whole
    (every pass holds the same pieces); otherwise it compares the keys of its first two
    passes. Both are the count of the table's rows holding a piece an earlier row holds."""
    plan = packed_epoch_plan(corpus3, seq_len=63, seed=2, epoch=epoch, weights=weights, samples=samples)
    table = whole_table(plan, corpus3)
    for s in range(3):
        repeats, total = plan.repeat_counts(s)
        assert repeats == brute_repeats(plan, table, s), (s, plan.sources[s])
        assert total in (None, plan.sources[s].samples)
        assert (total is None) == (plan.sources[s].passes < 2)


def test_a_best_fit_repeat_warning_counts_one_unit(corpus3, tmp_path):
    """Issue 32: the line said '198 of its 100 samples repeat': a count of pieces over a total
    of samples. Issue 42: both are rows (the samples), in shuffle's summary, its warning and plan's."""
    from tokpack.shuffle.run import repeat_warnings

    plan = packed_epoch_plan(corpus3, seq_len=63, seed=2, epoch=0, weights=["1", "1", "4"], samples=300)
    report = plan.source_report()
    math = report[2]
    samples = plan.sources[2].samples
    assert math["repeat_total"] == samples and 0 < math["repeats"] < samples
    [line] = repeat_warnings(0, report)
    assert f"{math['repeats']} of its {samples} rows repeat a piece" in line and "pieces repeat" not in line
    args = ["--seq-len", "63", "--seed", "2", "--epochs", "1", "--samples", "300", "--packing", "best-fit"]
    srcs = [f"{p.path}={w}" for p, w in zip(corpus3, ["1", "1", "4"])]
    for command in (["shuffle"], ["plan", "shuffle"]):
        res = CliRunner().invoke(main, [*command, *srcs, "-o", str(tmp_path / "o"), *args])
        assert res.exit_code == 0, res.output
        warned = [x for x in res.stderr.splitlines() if "more than once" in x]
        assert len(warned) == 1 and f"{math['repeats']} of its {samples} rows" in warned[0], res.stderr
        assert f"{math['repeats']:,} rows repeated" in res.stdout or f"{math['repeats']} rows repeated" in res.stdout, (
            res.stdout
        )


def test_an_upsampled_best_fit_epoch_packs_each_pass_once(tmp_path, monkeypatch):
    """Issue 32's cliff: an epoch drawing a source n times packed its n passes three times (the
    plan's row counts, the repeat count, the row table) and made a scratch folder per pass.
    Each pass is now packed once, with no folder when its documents fit; the bytes are the same."""
    import collections

    from tokpack.shuffle.packed import packed_plan, passes
    from tokpack.shuffle.packed import table as table_mod

    rng = np.random.default_rng(11)
    srcs = [
        write_source(tmp_path / "big", random_docs(rng, 300, 1000, 0, 1, 200)),
        write_source(tmp_path / "tiny", random_docs(rng, 20, 1000, 0, 1, 200)),
    ]
    passes._PASSES.clear()
    passes._PASSES_BYTES[0] = 0
    packed_plan._ROWS.clear()
    # the passes packed one by one (a source of one group a pass takes no pass: test_bestfit_repeated.py)
    monkeypatch.setattr(packed_plan, "one_group_passes", lambda *a, **k: None)
    calls, folders = collections.Counter(), []
    real_pack, real_scratch = passes._pack_pass, passes.scratch
    monkeypatch.setattr(passes, "_pack_pass", lambda src, s, p, *a: calls.update([(s, p)]) or real_pack(src, s, p, *a))
    for mod in (passes, packed_plan, table_mod):  # each module that makes a scratch folder
        monkeypatch.setattr(mod, "scratch", lambda folder=None: folders.append(folder) or real_scratch(folder))
    out = tmp_path / "run"
    shuffle_run(
        [str(p) for p in srcs],
        str(out),
        weights=["1", "1"],
        seq_len=63,
        seed=4,
        epochs=[0],
        samples=1200,
        memory=64 << 20,
        packing="best-fit",
    )
    m = read_manifest(out / "epoch-00000", kind="epoch")
    assert m["sources"][1]["passes"] >= 10  # tiny is drawn many times
    assert calls and max(calls.values()) == 1, calls.most_common(3)
    assert len(calls) == sum(e["passes"] for e in m["sources"])
    assert len([f for f in folders if f is None]) <= 2  # the repeat count's folders, one a source at most
    # the same bytes as packed without the kept passes
    passes._PASSES.clear()
    passes._PASSES_BYTES[0] = 0
    monkeypatch.setattr(
        passes,
        "_PASSES",
        type("Never", (dict,), {"__setitem__": lambda *a: None, "move_to_end": lambda *a: None})(),
    )
    other = tmp_path / "again"
    shuffle_run(
        [str(p) for p in srcs],
        str(other),
        weights=["1", "1"],
        seq_len=63,
        seed=4,
        epochs=[0],
        samples=1200,
        memory=64 << 20,
        packing="best-fit",
    )
    for f in sorted((out / "epoch-00000").iterdir()):
        assert f.read_bytes() == (other / "epoch-00000" / f.name).read_bytes(), f.name
    assert max(calls.values()) > 1  # without them, passes are packed again


def test_plan_counts_the_pieces_an_upsampled_epoch_packs(tmp_path, monkeypatch):
    """Issue 32: plan predicted 0.9 s for a best-fit epoch drawing a source many times that took
    27 s. Its time is pieces over measured rates (BENCHMARKS.md, "Best-fit packing: an upsampled
    epoch"); the pieces are now the passes' own counts: each pass the epoch touches packed once
    (as the engine does: test_an_upsampled_best_fit_epoch_packs_each_pass_once) and the
    table's pieces, both equal to what the engine packs and writes."""
    from tokpack.packer.api import plan
    from tokpack.shuffle.packed import packed_plan, passes
    from tokpack.shuffle.packed_step import PACK_PIECES_PER_S, TABLE_PIECES_PER_S

    rng = np.random.default_rng(12)
    srcs = [
        write_source(tmp_path / "big", random_docs(rng, 300, 1000, 0, 1, 200)),
        write_source(tmp_path / "tiny", random_docs(rng, 20, 1000, 0, 1, 200)),
    ]
    packed_plan._ROWS.clear()
    packed_plan._PIECES.clear()
    passes._PASSES.clear()
    passes._PASSES_BYTES[0] = 0
    monkeypatch.setattr(packed_plan, "one_group_passes", lambda *a, **k: None)  # passes packed one by one
    packed, real_pack = [], passes._pack_pass

    def counting(*a):
        for group in real_pack(*a):
            packed.append(len(group[2][0]))
            yield group

    monkeypatch.setattr(passes, "_pack_pass", counting)
    got = plan(
        "shuffle",
        {str(srcs[0]): "1", str(srcs[1]): "1"},
        tmp_path / "p",
        seq_len=63,
        seed=4,
        samples=1200,
        memory=64 << 20,
        packing="best-fit",
        disk_mbps=100,
    )
    table = next(p for p in got.passes if p["name"] == "table")
    packed_by_plan = sum(packed)
    assert not passes._PASSES  # plan keeps no pass once it has reported
    opened = [PackedSource.open(p) for p in srcs]
    plan = packed_epoch_plan(opened, seq_len=63, seed=4, epoch=0, weights=["1", "1"], samples=1200)
    assert plan.sources[1].passes >= 10
    pieces = len(whole_table(plan, opened))
    assert sum(packed) > packed_by_plan  # the table packed its passes again: none was kept
    assert table["pack_seconds"] == round(packed_by_plan / PACK_PIECES_PER_S + pieces / TABLE_PIECES_PER_S, 3)


@pytest.mark.parametrize("memory", [64 << 20, 1 << 20])
def test_a_source_edited_since_pack_fails_a_best_fit_epoch(sources, tmp_path, memory):
    copies = [tmp_path / p.name for p in sources]
    for p, c in zip(sources, copies):
        shutil.copytree(p, c)
    f = copies[1] / "00000.ds"
    data = bytearray(f.read_bytes())
    data[10] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(TokpackError, match="source shard changed since it was packed"):
        shuffle_packed(copies, tmp_path / "out", epochs=[0], memory=memory)
    assert not (tmp_path / "out" / "epoch-00000" / "tokpack.json").exists()


def test_inspect_identifies_documents_through_the_packed_plan(run):
    res = CliRunner().invoke(main, ["inspect", str(run), "--json"])
    assert res.exit_code == 0, res.output
    diversity = json.loads(res.output)["batch_diversity"]
    assert diversity["document_identity"] == "plan" and "note" not in diversity


# ------------------------------------------------------------------ validate's fault table on a best-fit run


@pytest.fixture(scope="module")
def fault_base(tmp_path_factory) -> Path:
    """test_validate's src/, run/ and other/, shuffled with --packing best-fit."""
    import tests.test_validate as tv

    root = tmp_path_factory.mktemp("bfd-validate-base")
    docs = random_docs(np.random.default_rng(3), 60, tv.VOCAB, tv.EOS, max_len=120)
    write_source(root / "src", docs, vocab_size=tv.VOCAB, eos_id=tv.EOS, docs_per_shard=20)
    for name, seed, epochs in (("run", 1, [0, 1]), ("other", 2, [0])):
        shuffle_run(
            [str(root / "src")],
            str(root / name),
            seq_len=tv.SEQ_LEN,
            seed=seed,
            epochs=epochs,
            shard_samples=tv.SHARD_SAMPLES,
            memory=64 << 20,
            packing="best-fit",
        )
    return root


def test_validate_catches_every_fault_of_its_table_on_a_best_fit_run(fault_base, tmp_path):
    """Each of test_validate's faults, injected into a best-fit run, is reported: by a full
    validation, and with --against by the replay of the packed plan."""
    import tests.test_validate as tv

    clean = tv.validate_all(
        [str(fault_base / "run")], quick=False, against=[str(fault_base / "src")], show_progress=False
    )
    assert clean["ok"], clean["lines"]
    missed = []
    for i, (fault, (target, inject)) in enumerate(tv.FAULTS.items()):
        env = tmp_path / f"f{i}"
        for name in ("src", "run", "other"):
            shutil.copytree(fault_base / name, env / name)
        inject(env)
        r = tv.detect(env, target)
        if not r["against"]["ok"] and (fault in tv.NEEDS_AGAINST or not r["full"]["ok"]):
            continue
        missed.append(fault)
    assert missed == []


def test_stage_copies_the_padding_sidecars(run, tmp_path):
    from tokpack.packer.api import stage, validate

    stage(run, tmp_path / "staged")
    for e in ("epoch-00000", "epoch-00001"):
        for f in (run / e).glob("*.pad"):
            assert (tmp_path / "staged" / e / f.name).read_bytes() == f.read_bytes()
    assert validate(tmp_path / "staged").ok
    reader = SampleReader.open(tmp_path / "staged")
    assert np.array_equal(reader.padding(0, 50), SampleReader.open(run).padding(0, 50))


def test_an_empty_source_is_refused_in_one_line(sources, tmp_path):
    empty = write_source(tmp_path / "empty", [])
    with pytest.raises(TokpackError, match="source holds no documents"):
        shuffle_packed([sources[0], empty], tmp_path / "out", epochs=[0])


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(1, 90), min_size=3, max_size=60),
    per_shard=st.integers(1, 20),
    seq_len=st.sampled_from([15, 31]),
    out_of_core=st.booleans(),
    seed=st.integers(0, 99),
)
def test_a_written_epoch_holds_every_document_once(tmp_path_factory, lengths, per_shard, seq_len, out_of_core, seed):
    """End to end, in memory or out of core: epoch 0 without weights is pass 0, so its rows,
    read back and cut by the row table, give every document of the source exactly once, and
    the bytes after the pieces are padding."""
    root = tmp_path_factory.mktemp("e2e")
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(1, 1000, size=n - 1), 0) for n in lengths]
    src = write_source(root / "src", docs, docs_per_shard=per_shard)
    shuffle_run(
        [str(src)],
        str(root / "run"),
        seq_len=seq_len,
        seed=seed,
        epochs=[0],
        shard_samples=7,
        memory=(1 << 20) if out_of_core else (64 << 20),
        packing="best-fit",
    )
    edir = root / "run" / "epoch-00000"
    m = read_manifest(edir, kind="epoch")
    opened = PackedSource.open(src)
    table = whole_table(packed_plan_from_manifest(m, [opened]), [opened])
    rows = SampleReader.open(edir).read(0, m["samples"])
    pad = SampleReader.open(edir).padding(0, m["samples"]).astype(np.int64)
    got: dict[int, list] = {}
    for g, off, d, doff, n in zip(
        *(table[k].astype(np.int64).tolist() for k in ("g", "row_offset", "doc", "doc_offset", "length"))
    ):
        got.setdefault(d, []).append((doff, rows[g, off : off + n]))
    assert sorted(got) == list(range(len(docs)))
    for d, pieces in got.items():
        assert np.array_equal(np.concatenate([p for _, p in sorted(pieces, key=lambda x: x[0])]), docs[d])
    fill = np.bincount(table["g"].astype(np.int64), weights=table["length"], minlength=m["samples"])
    assert np.array_equal(fill.astype(np.int64), seq_len + 1 - pad)
    assert all(np.all(rows[g, seq_len + 1 - p :] == 0) for g, p in enumerate(pad.tolist()))


def test_jitter_with_best_fit_is_refused(sources, tmp_path):
    res = CliRunner().invoke(
        main,
        [
            "shuffle",
            *map(str, sources),
            "-o",
            str(tmp_path / "j"),
            "--seq-len",
            "63",
            "--seed",
            "3",
            "--epochs",
            "1",
            "--packing",
            "best-fit",
            "--jitter",
        ],
    )
    assert res.exit_code == 1 and "--jitter" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "j").exists()


@pytest.mark.parametrize("command", ["shuffle", "plan"])
@pytest.mark.parametrize("packing_in", ["file", "flag"])
def test_a_schedules_jitter_with_best_fit_is_refused(sources, tmp_path, command, packing_in):
    """jitter: true in a schedule meets best-fit in the same file (refused where the file is
    read) or from --packing (refused once the two are merged): one line, never a run whose
    manifest records jitter its best-fit rows do not have."""
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text(
        "seq_len: 63\nseed: 4\njitter: true\n"
        + ("packing: best-fit\n" if packing_in == "file" else "")
        + f"stages:\n  - name: a\n    epochs: 1\n    sources: {{{sources[0]}: 1}}\n"
    )
    args = [
        command,
        *(["shuffle"] if command == "plan" else []),
        "--schedule",
        str(yaml_file),
        "-o",
        str(tmp_path / "run"),
    ]
    res = CliRunner().invoke(main, args + (["--packing", "best-fit"] if packing_in == "flag" else []))
    assert res.exit_code == 1 and "jitter shifts windows; best-fit packing has none" in res.output, res.output
    assert str(yaml_file) in res.output and "Traceback" not in res.output
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", [["shuffle"], ["plan", "shuffle"]])
@pytest.mark.parametrize("packing", [[], ["--packing", "concat"]])
def test_pad_id_without_best_fit_is_refused(sources, tmp_path, command, packing):
    """Issue 32: a window epoch has no padding, so a --pad-id it silently ignored looked like a
    setting the run keeps. Refused in one line before anything is written, CLI and API alike."""
    res = CliRunner().invoke(
        main,
        [
            *command,
            *map(str, sources),
            "-o",
            str(tmp_path / "w"),
            "--seq-len",
            "63",
            "--seed",
            "3",
            "--epochs",
            "1",
            "--pad-id",
            "5",
            *packing,
        ],
    )
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 1 and len(lines) == 1 and "Traceback" not in res.output, res.output
    assert "[--pad-id]" in lines[0] and "found 5" in lines[0] and "--packing best-fit" in lines[0]
    assert not (tmp_path / "w").exists()


def test_pad_id_without_best_fit_is_refused_by_the_api_and_a_schedule(sources, tmp_path):
    import tokpack

    with pytest.raises(TokpackError, match=r"\[--pad-id\].*concat packing has no padding"):
        tokpack.shuffle([str(s) for s in sources], str(tmp_path / "a"), seq_len=63, seed=3, epochs=1, pad_id=5)
    yaml_file = tmp_path / "s.yaml"
    yaml_file.write_text(
        f"seq_len: 63\nseed: 3\nstages:\n  - name: s\n    epochs: 1\n    sources: {{{sources[0]}: 1}}\n"
    )
    res = CliRunner().invoke(
        main, ["shuffle", "--schedule", str(yaml_file), "-o", str(tmp_path / "s"), "--pad-id", "5"]
    )
    assert res.exit_code == 1 and "packing: best-fit in the schedule" in res.stderr, res.output
    assert not (tmp_path / "a").exists() and not (tmp_path / "s").exists()
    # with best-fit it applies, and the run records it
    shuffle_packed(sources, tmp_path / "b", epochs=[0], pad_id=5)
    assert read_manifest(tmp_path / "b", kind="run")["packing"]["pad_id"] == 5


def test_order_proof_catches_two_rows_swapped_in_a_best_fit_epoch(fault_base, tmp_path):
    """Two rows of a best-fit shard swapped, with its index, padding sidecar and manifest entry
    rewritten to agree: every checksum, the multiset and the row table still hold; only the
    order proof of `validate --against` sees that the rows are not where the plan put them."""
    import tests.test_validate as tv
    from tokpack.formats.shards import EpochShardWriter

    for name in ("src", "run"):
        shutil.copytree(fault_base / name, tmp_path / name)
    epoch = tmp_path / "run" / "epoch-00000"
    m = tv.load(epoch)
    entry = m["shards"][0]
    rows = np.fromfile(epoch / entry["path"], dtype="<u2").reshape(-1, tv.SEQ_LEN + 1)
    pad = np.fromfile(epoch / (entry["path"] + ".pad"), dtype="<u4")
    a, b = 0, next(i for i in range(1, len(rows)) if not np.array_equal(rows[i], rows[0]))
    rows[[a, b]], pad[[a, b]] = rows[[b, a]], pad[[b, a]]
    for suffix in ("", ".index", ".metadata"):
        (epoch / (entry["path"] + suffix)).unlink()
    w = EpochShardWriter(epoch, entry["path"], np.dtype("<u2"), tv.SEQ_LEN, tv.EOS, m["tokenizer"], padded=True)
    w.write_rows(rows)
    w.write_pad(pad)
    new = w.close()  # its fragments and pad_xxh3_128 too
    m["shards"][0] = {k: new.get(k, v) for k, v in entry.items()}
    m["fragments"] = sum(s["fragments"] for s in m["shards"])
    tv.save(epoch, m)

    assert validate(str(epoch)).ok, validate(str(epoch)).to_json()["problems"]
    r = validate(str(epoch), against=[str(tmp_path / "src")])
    assert not r.ok
    (p,) = r.to_json()["problems"]
    assert (Path(p["file"]).name, p["where"]) == (entry["path"], "order_hash"), p
    assert p["message"].startswith("sample order differs from the plan (1 of ")


# ------------------------------------------------------------------ out of core: the plan on disk


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 90), min_size=1, max_size=150),
    per_shard=st.integers(1, 40),
    row_tokens=st.sampled_from([8, 32]),
    group=st.integers(1, 400),
    memory=st.integers(1, 3000),
    seed=st.integers(0, 5),
)
def test_a_pass_packed_out_of_core_is_the_pass_packed_in_memory(
    tmp_path_factory, lengths, per_shard, row_tokens, group, memory, seed
):
    """Documents permuted through bucket files (a budget of a few documents) and packed group
    by group give the pieces pack_pass gives with every document in memory."""
    import tokpack.shuffle.packed.passes as packed

    root = tmp_path_factory.mktemp("ooc-pass")
    docs = [np.append(np.full(n - 1, 5), 0) for n in lengths]
    src = PackedSource.open(write_source(root / "src", docs, docs_per_shard=per_shard))
    want = pack_pass(np.array(lengths, np.int64), Bijection(len(lengths), "docs", seed, 1, 2), row_tokens, group)
    chunk, packed.MIN_CHUNK = packed.MIN_CHUNK, 1  # chunks of memory // DOC_STATE_BYTES documents
    try:
        got = list(packed.iter_pass(src, 1, 2, seed, row_tokens, group, memory, str(root)))
    finally:
        packed.MIN_CHUNK = chunk
    assert sum(n for _, n, _ in got) == want.rows
    cols = [np.concatenate([g[2][i] for g in got]) for i in range(7)]
    for c, w in zip(cols, (want.row, want.row_offset, want.doc, want.doc_offset, want.length)):
        assert np.array_equal(c, w)
    starts = np.r_[0, np.cumsum(lengths)[:-1]]
    assert np.array_equal(cols[5], starts[cols[2]] + cols[3]) and np.array_equal(cols[6], np.array(lengths)[cols[2]])
    assert not list(root.glob("docs-*"))  # the bucket files are gone once read


def many_docs(path: Path, n: int) -> Path:
    rng = np.random.default_rng(1)
    lens = rng.integers(2, 40, size=n)
    tokens = rng.integers(1, 999, size=int(lens.sum())).astype(np.uint16)
    ends = np.cumsum(lens)
    tokens[ends - 1] = 0
    return write_source(path, np.split(tokens, ends[:-1]), docs_per_shard=4000)


OOC_CHILD = """
import sys
import tokpack.shuffle.packed.packed_plan
tokpack.shuffle.packed.packed_plan.DEFAULT_GROUP_TOKENS = 1 << 14
from tokpack.packer.api import shuffle
shuffle([sys.argv[1]], sys.argv[2], seq_len=63, seed=3, epochs=1, shard_samples=4096, memory=1 << 20,
        packing="best-fit", progress=False)
# This process's peak RSS: VmHWM, since ru_maxrss keeps the forking parent's peak across exec.
print(next(int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith("VmHWM:")))
"""


def test_the_memory_of_an_out_of_core_best_fit_epoch_does_not_grow_with_its_documents(tmp_path, monkeypatch):
    """At --memory 1 MiB, a corpus of 8x the documents (its row table about 6x --memory) peaks
    at about the same RSS as the small one (measured +2 MB): the table is on disk, and each
    task reads its part. (The old engine held the table, the document tables and the passes:
    +28 MB.) The bytes are the in-memory run's."""
    import subprocess
    import sys

    import tokpack.shuffle.packed.packed_plan as packed

    peaks, big = [], None
    for n in (20_000, 160_000):
        src = many_docs(tmp_path / f"src{n}", n)
        res = subprocess.run(
            [sys.executable, "-c", OOC_CHILD, str(src), str(tmp_path / f"ooc{n}")],
            cwd=Path.cwd(),
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(Path.cwd())},
        )
        assert res.returncode == 0, res.stderr
        peaks.append(int(res.stdout.split()[-1]))
        big = src
    m = read_manifest(tmp_path / "ooc160000" / "epoch-00000", kind="epoch")
    table_bytes = PIECE.itemsize * 160_000  # a piece a document: none is longer than a row
    assert table_bytes > 5 * (1 << 20)
    assert peaks[1] - peaks[0] < table_bytes, peaks
    monkeypatch.setattr(packed, "DEFAULT_GROUP_TOKENS", 1 << 14)
    shuffle_run(
        [str(big)],
        str(tmp_path / "inmem"),
        seq_len=63,
        seed=3,
        epochs=[0],
        shard_samples=4096,
        memory=256 << 20,
        packing="best-fit",
    )
    assert read_manifest(tmp_path / "inmem" / "epoch-00000", kind="epoch")["packing"] == m["packing"]
    for f in sorted((tmp_path / "inmem" / "epoch-00000").iterdir()):
        assert (tmp_path / "ooc160000" / "epoch-00000" / f.name).read_bytes() == f.read_bytes(), f


def test_a_damaged_row_table_in_the_work_folder_is_refused(golden, tmp_path):
    from tokpack.shuffle.packed.table import PackedTable, build_table

    plan = packed_epoch_plan(
        golden,
        seq_len=SEQ_LEN,
        seed=SEED,
        epoch=0,
        weights=["1", "3"],
        samples=40,
        options=PackedOptions(group_tokens=256),
    )
    built = build_table(plan, golden, tmp_path / "packing", 1 << 20)
    assert built.table_xxh3_128 == GOLDEN[0][1] and built.padding == GOLDEN[0][2]
    table, _ = built.rows(0, plan.samples)
    assert table_hash(table) == GOLDEN[0][1]
    assert [tuple(int(x) for x in r) for r in built.rows(4, 5)[0][:2]] == GOLDEN_PIECES[4:]  # row 4 alone
    f = tmp_path / "packing" / "table"
    data = bytearray(f.read_bytes())
    data[40] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(TokpackError, match="packing table in the work folder is damaged"):
        PackedTable.open(tmp_path / "packing", GOLDEN[0][1]).rows(0, 5)


@pytest.mark.parametrize("damage", ["flipped", "cut short"])
def test_a_damaged_best_fit_bucket_file_is_refused_then_redone(run, sources, tmp_path, monkeypatch, damage):
    """The order pass reads a bucket's tokens a chunk at a time, hashing them as it goes: a
    bucket file damaged after the scatter pass (here, the last one of the last task) is
    refused in one line before its shard is written; the rerun scatters again and writes the
    reference bytes."""
    import tokpack.shuffle.steps as steps

    out, real = tmp_path / "again", steps.OrderStep.run

    def crash(self, *a, **k):
        raise OSError("simulated crash after the scatter pass")

    monkeypatch.setattr(steps.OrderStep, "run", crash)
    with pytest.raises(TokpackError, match="simulated crash"):
        shuffle_packed(sources, out, memory=1 << 20, tasks=2, epochs=[0])
    monkeypatch.setattr(steps.OrderStep, "run", real)
    victim = sorted(out.rglob("scatter-00001/*/b*.rows"))[-1]
    raw = bytearray(victim.read_bytes())
    if damage == "flipped":
        raw[-1] ^= 1
    else:
        del raw[-3:]
    victim.write_bytes(bytes(raw))
    with pytest.raises(TokpackError, match="does not match the checksum its task recorded") as err:
        shuffle_packed(sources, out, memory=1 << 20, tasks=2, epochs=[0])
    assert str(victim) in str(err.value)
    shuffle_packed(sources, out, memory=1 << 20, tasks=2, epochs=[0])
    for f in sorted((run / "epoch-00000").iterdir()):
        assert (out / "epoch-00000" / f.name).read_bytes() == f.read_bytes(), f


def test_a_missing_document_index_is_one_line(sources, tmp_path):
    copy = tmp_path / "small"
    shutil.copytree(sources[1], copy)
    (copy / "00000.ds.index").unlink()
    res = CliRunner().invoke(
        main,
        [
            "shuffle",
            str(copy),
            "-o",
            str(tmp_path / "out"),
            "--seq-len",
            "63",
            "--seed",
            "1",
            "--epochs",
            "1",
            "--packing",
            "best-fit",
        ],
    )
    assert res.exit_code == 1 and "document index is missing" in res.output and "00000.ds.index" in res.output
    assert "Traceback" not in res.output and not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", [["shuffle"], ["plan", "shuffle"]])
def test_a_pad_id_outside_the_vocabulary_is_refused(sources, tmp_path, command):
    """A pad id the model's embedding cannot index (>= vocab_size, 1000 here) would crash
    training hours in, at the first padded row: refused in one line before anything is
    written, naming --pad-id, the vocabulary's range and the id; the API alike. The last id
    of the vocabulary is taken."""
    import tokpack

    args = [*command, *map(str, sources), "-o", str(tmp_path / "w"), "--seq-len", "63", "--seed", "3"]
    args += ["--epochs", "1", "--packing", "best-fit", "--pad-id"]
    res = CliRunner().invoke(main, [*args, "1000"])
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 1 and len(lines) == 1 and "Traceback" not in res.output, res.output
    assert "[--pad-id]" in lines[0] and "expected 0..999, found 1000" in lines[0] and "HINT:" in lines[0]
    assert not (tmp_path / "w").exists()
    with pytest.raises(TokpackError, match=r"\[--pad-id\].*expected 0\.\.999, found 1000"):
        tokpack.shuffle(
            [str(s) for s in sources],
            str(tmp_path / "a"),
            seq_len=63,
            seed=3,
            epochs=1,
            packing="best-fit",
            pad_id=1000,
        )
    assert not (tmp_path / "a").exists()
    res = CliRunner().invoke(main, [*args, "999"])
    assert res.exit_code == 0, res.output
