"""`tokpack inspect`: totals, source shares, document lengths and batch diversity before and
after a real shuffle, checked against brute-force recomputation on constructed corpora."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import random_docs, shuffle_run, write_source
from tokpack.formats.errors import TokpackError
from tokpack.formats.constants import MANIFEST
from tokpack.formats.names import epoch_dir_name
from tokpack.loader.reader import SampleReader
from tokpack.packer.cli import main
from tokpack.packer.doc_lengths import LengthHistogram
from tokpack.packer.inspection import report_lines
from tokpack.packer.api import inspect as inspect_dir

L = 31  # seq_len: samples of 32 tokens
BATCH = 16


def inspect(directory, **kw) -> dict:
    return inspect_dir(directory, **kw).to_json()


def shuffle(out, sources, epochs=1, **kw):
    shuffle_run(
        [str(s) for s in sources],
        str(out),
        seq_len=L,
        seed=5,
        epochs=list(range(epochs)),
        shard_samples=kw.pop("shard_samples", 100),
        memory=8 << 20,
        **kw,
    )
    return out


@pytest.fixture(scope="module")
def huge_doc_run(tmp_path_factory):
    """One 20,000-token document first, then 300 short ones (about 57% vs 43% of the tokens)."""
    tmp = tmp_path_factory.mktemp("huge")
    rng = np.random.default_rng(11)
    huge = random_docs(rng, 1, 1000, 0, min_len=20000, max_len=20001)
    small = random_docs(rng, 300, 1000, 0, min_len=20, max_len=80)
    docs = huge + small
    src = write_source(tmp / "src", docs, docs_per_shard=60)
    run = shuffle(tmp / "run", [src], epochs=2)
    return run, src, docs


def doc_ids_of_stream(docs):
    return np.concatenate([np.full(len(d), i) for i, d in enumerate(docs)])


def brute_stats(id_rows):
    """(distinct, max share) for one batch given each token's document id."""
    ids = np.concatenate(id_rows)
    _, counts = np.unique(ids, return_counts=True)
    return len(counts), counts.max() / len(ids)


def test_huge_document_before_and_after(huge_doc_run):
    run, src, docs = huge_doc_run
    report = inspect(run, batch_size=BATCH, batches=20)
    div = report["batch_diversity"]
    assert div["document_identity"] == "plan"
    before, after = div["before"], div["after"]
    assert before["batches"] == after["batches"] == 20
    # Before: the first batches lie inside the huge document.
    assert before["max_doc_share"] == [1.0] * 20
    assert before["distinct_documents"] == [1] * 20
    # After: each batch holds about the huge document's fraction of the corpus.
    fraction = len(docs[0]) / sum(len(d) for d in docs)
    assert abs(np.mean(after["max_doc_share"]) - fraction) < 0.08
    assert max(after["max_doc_share"]) < 0.95
    assert np.mean(after["distinct_documents"]) > 4


def test_diversity_matches_brute_force(huge_doc_run):
    """Every per-batch figure, recomputed from the token stream and the epoch's bytes alone
    (samples are matched to source windows by content, not through the plan)."""
    run, src, docs = huge_doc_run
    report = inspect(run, batch_size=BATCH, batches=30, epoch=1)
    div = report["batch_diversity"]
    assert div["epoch"] == 1
    stream = np.concatenate(docs).astype("<u2")
    ids = doc_ids_of_stream(docs)
    row = L + 1
    n = len(stream) // row
    windows = stream[: n * row].reshape(n, row)
    by_bytes = {windows[i].tobytes(): i for i in range(n)}
    assert len(by_bytes) == n  # random tokens: every window is unique
    m = json.loads((run / epoch_dir_name(1) / MANIFEST).read_text())
    epoch = np.concatenate([np.fromfile(run / epoch_dir_name(1) / s["path"], dtype="<u2") for s in m["shards"]])
    epoch = epoch.reshape(-1, row)
    for b in range(30):
        w_before = range(b * BATCH, (b + 1) * BATCH)
        d, s = brute_stats([ids[w * row : (w + 1) * row] for w in w_before])
        assert div["before"]["distinct_documents"][b] == d
        assert div["before"]["max_doc_share"][b] == pytest.approx(s, abs=1e-6)
        w_after = [by_bytes[epoch[g].tobytes()] for g in range(b * BATCH, (b + 1) * BATCH)]
        d, s = brute_stats([ids[w * row : (w + 1) * row] for w in w_after])
        assert div["after"]["distinct_documents"][b] == d
        assert div["after"]["max_doc_share"][b] == pytest.approx(s, abs=1e-6)


def test_totals_shares_and_lengths(tmp_path):
    rng = np.random.default_rng(2)
    a = random_docs(rng, 120, 1000, 0, max_len=200)
    b = random_docs(rng, 40, 1000, 0, max_len=60)
    sa = write_source(tmp_path / "a", a, docs_per_shard=50)
    sb = write_source(tmp_path / "b", b)
    run = shuffle(tmp_path / "run", [sa, sb], weights=["3", "1"], samples=400)
    report = inspect(run, batch_size=8, batches=4)
    t = report["totals"]
    assert t["samples"] == 400 and t["tokens"] == 400 * (L + 1) and t["seq_len"] == L
    assert t["source_documents"] == 160
    shares = {s["name"]: s["share"] for s in report["epochs"][0]["sources"]}
    assert shares == {"a": 0.75, "b": 0.25}
    lengths = np.array([len(d) for d in a + b])
    dl = report["document_lengths"]
    assert dl["documents"] == 160 and dl["max"] == lengths.max() and dl["min"] == lengths.min()
    assert dl["mean"] == pytest.approx(lengths.mean(), abs=0.01)
    for q in (0.1, 0.5, 0.9, 0.99):
        assert dl["quantiles"][f"p{round(q * 100)}"] == np.quantile(lengths, q, method="lower")
    assert sum(h["documents"] for h in dl["histogram"]) == 160
    assert any("a 75.0%" in line for line in report_lines(inspect_dir(run, batch_size=8, batches=4)))
    assert report["batch_diversity"]["document_identity"] == "plan"


def test_length_histogram_long_documents():
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(1, 5000, 3000), rng.integers(70000, 3_000_000, 500)])
    h = LengthHistogram()
    for part in np.array_split(lengths, 7):  # streamed in blocks
        h.add(part)
    r = h.report()
    assert r["documents"] == 3500 and r["max"] == lengths.max() and r["tokens"] == lengths.sum()
    for q in (0.5, 0.9, 0.99):
        exact = np.quantile(lengths, q, method="lower")
        assert abs(h.quantile(q) - exact) <= 0.012 * exact
    assert sum(b["documents"] for b in r["histogram"]) == 3500
    assert sum(h.plot_bins()[1]) == 3500


def test_jittered_epoch_uses_the_plan(tmp_path):
    docs = random_docs(np.random.default_rng(8), 120, 1000, 0)
    src = write_source(tmp_path / "s", docs)
    run = shuffle(tmp_path / "run", [src], epochs=2, jitter=True)
    report = inspect(run, batch_size=8, batches=5, epoch=1)
    assert report["batch_diversity"]["document_identity"] == "plan"  # every sample matched its planned window
    assert report["batch_diversity"]["after"]["batches"] == 5


def test_eos_fallback_when_sources_unreachable(tmp_path, huge_doc_run):
    run, src, docs = huge_doc_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    # Point the epoch at a path that does not exist: the plan cannot be used.
    for p in (copy / MANIFEST, copy / epoch_dir_name(0) / MANIFEST):
        m = json.loads(p.read_text())
        for s in m["sources"]:
            s["path"] = str(tmp_path / "gone")
            s["name"] = "gone"
        p.write_text(json.dumps(m))
    report = inspect(copy, batch_size=BATCH, batches=5)
    div = report["batch_diversity"]
    assert div["document_identity"] == "eos" and "before" not in div
    assert report["unreachable_sources"] == ["gone"]
    m = json.loads((copy / epoch_dir_name(0) / MANIFEST).read_text())
    epoch = np.concatenate([np.fromfile(copy / epoch_dir_name(0) / s["path"], dtype="<u2") for s in m["shards"]])
    rows = epoch.reshape(-1, L + 1)
    for b in range(5):
        frag = []
        for r in rows[b * BATCH : (b + 1) * BATCH]:
            cuts = np.flatnonzero(r == 0) + 1
            cuts = np.unique(np.append(cuts, L + 1))
            frag.extend(np.diff(np.concatenate([[0], cuts])).tolist())
        assert div["after"]["distinct_documents"][b] == len(frag)
        assert div["after"]["max_doc_share"][b] == pytest.approx(max(frag) / (BATCH * (L + 1)), abs=1e-6)


def test_source_only(tmp_path):
    docs = random_docs(np.random.default_rng(4), 50, 1000, 0)
    src = write_source(tmp_path / "s", docs, docs_per_shard=20)
    report = inspect(src)
    assert report["totals"] == {"tokens": sum(map(len, docs)), "documents": 50, "shards": 3}
    assert "batch_diversity" not in report
    report = inspect(src, seq_len=15, batch_size=4, batches=3)
    assert report["batch_diversity"]["before"]["batches"] == 3


def test_plot_png(huge_doc_run, tmp_path):
    run, _, _ = huge_doc_run
    out = tmp_path / "inspect.png"
    report = inspect(run, batch_size=BATCH, batches=20, plot=str(out))
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert report["plot"] == str(out)


def test_plot_without_matplotlib(huge_doc_run, tmp_path, monkeypatch):
    run, _, _ = huge_doc_run
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    with pytest.raises(TokpackError, match="pip install matplotlib"):
        inspect(run, plot=str(tmp_path / "x.png"))
    assert not (tmp_path / "x.png").exists()


def test_plot_to_a_url_is_refused_before_the_work_and_file_urls_are_local(huge_doc_run, tmp_path, monkeypatch):
    """--plot s3://b/x.png ran the whole analysis, then failed in matplotlib with 'No such file
    or directory (ENOENT). HINT: check the path'; --plot file:///path is the local /path."""
    import tokpack.packer.inspection as inspection

    run, _, _ = huge_doc_run
    monkeypatch.setattr(inspection, "read_manifest", lambda *a, **k: pytest.fail("read before --plot was checked"))
    with pytest.raises(TokpackError, match=r"s3://b/x\.png \[--plot\]: --plot writes a local file.*HINT: "):
        inspect(run, plot="s3://b/x.png")
    monkeypatch.undo()
    report = inspect(run, batch_size=BATCH, batches=2, plot=f"file://{tmp_path / 'x.png'}")
    assert (tmp_path / "x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and report["plot"] == str(tmp_path / "x.png")


def test_cli_inspect(huge_doc_run):
    run, _, _ = huge_doc_run
    r = CliRunner().invoke(main, ["inspect", str(run), "--batch-size", "16", "--batches", "3", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    assert rep["batch_diversity"]["before"]["batches"] == 3
    r = CliRunner().invoke(main, ["inspect", str(run), "--batch-size", "16", "--batches", "3"])
    assert r.exit_code == 0 and "batches before" in r.output and "after (epoch 0, plan)" in r.output
    r = CliRunner().invoke(main, ["inspect", str(run), "--epoch", "7"])
    assert r.exit_code == 1 and "epoch not in this run" in r.output


def test_document_lengths_sample_large_corpora(tmp_path, monkeypatch):
    """Above the cap, evenly spaced blocks of the indexes are read, not all of them; the
    sample's mean stays close to the corpus's, and the report says it was sampled."""
    from tokpack.formats.shards import PackedSource
    from tokpack.packer import doc_lengths

    rng = np.random.default_rng(3)
    docs = random_docs(rng, 4000, 1000, 0, max_len=60)
    src = PackedSource.open(write_source(tmp_path / "src", docs, docs_per_shard=500))
    full = doc_lengths.document_lengths([src]).report()
    assert full["documents"] == 4000 and "sampled_from_documents" not in full
    monkeypatch.setattr(doc_lengths, "INDEX_BLOCK", 100)
    sampled = doc_lengths.document_lengths([src], max_documents=1000).report()
    assert sampled["documents"] == 1000 and sampled["sampled_from_documents"] == 4000
    assert abs(sampled["mean"] - full["mean"]) < 0.1 * full["mean"]


def test_inspect_of_a_best_fit_epoch_stays_within_its_memory(tmp_path, monkeypatch):
    """`inspect --memory M` on a best-fit epoch whose row table is several times M: its Python
    heap (tracemalloc, which counts numpy's buffers) peaks below the table, since the table is
    built on disk within M and only the batches' rows are read back; reading the table whole,
    as inspect once did, peaks above it. The report is the one that whole table gives."""
    import tracemalloc

    import tokpack.shuffle.packed.packed_plan as packed
    from tokpack.formats.reading import read_manifest
    from tokpack.formats.shards import PackedSource
    from tokpack.packer.diversity import DOC_ID_SHIFT, _series, batch_stats
    from tokpack.shuffle.packed.table import PIECE, whole_table
    from tokpack.shuffle.packed.replay import TokenPool
    from tokpack.shuffle.packed.packed_plan import packed_plan_from_manifest

    monkeypatch.setattr(packed, "DEFAULT_GROUP_TOKENS", 1 << 14)  # a group's plan state: small beside the table
    rng = np.random.default_rng(3)
    lens = rng.integers(2, 40, size=160_000)
    tokens = rng.integers(1, 999, size=int(lens.sum())).astype(np.uint16)
    tokens[np.cumsum(lens) - 1] = 0
    src = write_source(tmp_path / "src", np.split(tokens, np.cumsum(lens)[:-1]), docs_per_shard=20_000)
    out = tmp_path / "run"
    shuffle_run(
        [str(src)], str(out), seq_len=63, seed=3, epochs=[0], shard_samples=8192, memory=256 << 20, packing="best-fit"
    )
    table_bytes = PIECE.itemsize * len(lens)  # at least a piece a document
    budget = 1 << 20
    assert table_bytes > 5 * budget

    tracemalloc.start()
    try:
        report = inspect_dir(out, memory=budget).to_json()
        bounded = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    after = report["batch_diversity"]["after"]
    assert report["batch_diversity"]["document_identity"] == "plan" and after["batches"] == 64
    assert bounded < table_bytes, (bounded, table_bytes)

    # The table read whole (as inspect read it before): the same series, and a peak above the table.
    edir = out / "epoch-00000"
    m = read_manifest(edir, kind="epoch")
    opened = [PackedSource.open(src)]
    tracemalloc.start()
    try:
        plan = packed_plan_from_manifest(m, opened, budget)
        table = whole_table(plan, opened)
        pool = TokenPool(plan, opened)
        reader = SampleReader.from_manifests([(edir, m)])
        stats = []
        for b in range(64):
            g0, g1 = b * 64, (b + 1) * 64
            assert np.array_equal(reader.read(g0, 64), pool.rows(table, g0, g1, plan.row_tokens, plan.pad_id))
            t = table[slice(*np.searchsorted(table["g"], [g0, g1]))]
            ids = (t["source"].astype(np.int64) << DOC_ID_SHIFT) + t["doc"].astype(np.int64)
            stats.append(batch_stats([(ids, t["length"].astype(np.int64))]))
        whole = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert _series(stats) == after
    assert whole > table_bytes > bounded, (whole, table_bytes, bounded)


def _dead_pid() -> int:
    """The pid of a process that has exited (reaped): a killed command's, as its lock names it."""
    import subprocess

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_an_epoch_a_killed_shuffle_left_unfinished_is_reported_with_how_to_finish_it(tmp_path):
    """A shuffle SIGKILLed while writing epoch 1 of 2 leaves the run listing epoch 0, epoch-00001/
    holding a shard and a temporary, and its lock: inspect says epoch 1 is unfinished and gives the
    killed command to rerun (the lock's); without a lock, `--like`, which does finish it."""
    import shlex
    import socket

    from tokpack.formats.constants import WORK_DIR

    src = write_source(tmp_path / "src", random_docs(np.random.default_rng(3), 120, 1000, 0), docs_per_shard=40)
    run = shuffle(tmp_path / "run", [src], epochs=1)
    assert inspect(run).get("unfinished") is None  # a complete run: no such field
    # folders no shuffle writes (epoch_dir_name's five digits only): not unfinished epochs, whose
    # hint would be a `--like --epoch 999999999999999` that shuffle refuses
    for name in ("epoch-999999999999999", "epoch-1", "epoch-123456"):
        (run / name).mkdir()
        (run / WORK_DIR).mkdir(exist_ok=True)
        (run / WORK_DIR / f"{name}-9c69ed282550ed2a").mkdir()
    assert inspect(run).get("unfinished") is None
    left = run / epoch_dir_name(1)
    left.mkdir()
    shutil.copy(run / epoch_dir_name(0) / "00000.ds", left / "00000.ds")
    (left / "00000.ds.rows.tmp-4242-0123abcd").write_bytes(b"\0" * 8)

    report = inspect(run)
    assert report["totals"]["epochs"] == [0]  # the complete epoch, reported as before
    like = f"tokpack shuffle --like {run} --epoch 1"
    assert report["unfinished"] == {
        "epochs": [1],
        "holdout": False,
        "command": like,
        "running": False,
        "to_nodes": False,
    }
    r = CliRunner().invoke(main, ["inspect", str(run)])
    assert r.exit_code == 0 and "unfinished: epoch 1 (begun, not committed" in r.output and like in r.output
    r = CliRunner().invoke(main, ["inspect", str(run), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["unfinished"]["epochs"] == [1]

    killed = f"tokpack shuffle {src} -o {run} --seq-len {L} --seed 5 --epochs 2"
    lock = {"host": socket.gethostname(), "pid": _dead_pid(), "start": None, "since": 0, "command": killed}
    (run / "tokpack.lock").write_text(json.dumps(lock))
    assert inspect(run)["unfinished"]["command"] == killed  # the command the user ran, rerun as it was
    (run / "tokpack.lock").unlink()

    r = CliRunner().invoke(main, shlex.split(like)[1:])  # the hint given finishes the run
    assert r.exit_code == 0, r.output
    assert inspect(run).get("unfinished") is None and inspect(run)["totals"]["epochs"] == [0, 1]


def test_a_shuffle_still_writing_an_epoch_is_named_not_told_to_rerun(tmp_path):
    """An epoch's scratch alone (the scatter, before its folder) while the lock's holder runs: the
    epoch is being written, by that command."""
    import os
    import socket

    from tokpack.formats.constants import WORK_DIR
    from tokpack.formats.guard import process_start

    src = write_source(tmp_path / "src", random_docs(np.random.default_rng(4), 60, 1000, 0), docs_per_shard=30)
    run = shuffle(tmp_path / "run", [src], epochs=1)
    (run / WORK_DIR / f"{epoch_dir_name(2)}-9c69ed282550ed2a").mkdir(parents=True)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "start": process_start(os.getpid())}
    (run / "tokpack.lock").write_text(json.dumps({**me, "command": "tokpack shuffle --like R --epoch 2"}))
    result = inspect_dir(run)
    assert result.unfinished == {
        "epochs": [2],
        "holdout": False,
        "command": "tokpack shuffle --like R --epoch 2",
        "running": True,
        "to_nodes": False,
    }
    assert any("epoch 2, being written now by" in line for line in report_lines(result))


def test_an_unfinished_holdout_or_to_nodes_epoch_is_reported_and_finished_as_it_was_launched(tmp_path):
    """RUN/holdout/ begun and not committed (written after the epochs) is unfinished too; a
    `--to-nodes` run's epoch is finished by its job under its launcher (its lock names process 0's
    command line; `--like` writes no node slices, so it is not offered)."""
    src = write_source(tmp_path / "src", random_docs(np.random.default_rng(6), 60, 1000, 0), docs_per_shard=30)
    run = shuffle(tmp_path / "run", [src], epochs=1)
    (run / "holdout").mkdir()
    (run / "holdout" / "00000.ds.tmp-77-0123abcd").write_bytes(b"")
    u = inspect(run)["unfinished"]
    assert u["holdout"] is True and u["epochs"] == [] and u["command"] is None and u["to_nodes"] is False
    assert "unfinished: the held-out split (begun" in report_lines(inspect_dir(run))[1]
    shutil.rmtree(run / "holdout")

    (run / "tokpack-nodes.json").write_text(json.dumps({"format": "tokpack-nodes", "dest": "/nvme/{node}"}))
    (run / epoch_dir_name(1)).mkdir()
    u = inspect(run)["unfinished"]
    assert u == {"epochs": [1], "holdout": False, "command": None, "running": False, "to_nodes": True}
    line = report_lines(inspect_dir(run))[1]
    assert "rerun the shuffle command that wrote the run under the launcher that started it" in line, line
    assert "--like" not in line
