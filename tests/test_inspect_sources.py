"""`tokpack inspect` (issue 43): each source's document lengths, and RUN/holdout/ named as the
held-out split, not as "epoch 0"."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import random_docs, shuffle_run, write_source
from tokpack.formats.constants import HOLDOUT_DIR
from tokpack.formats.names import epoch_dir_name
from tokpack.packer import doc_lengths
from tokpack.packer.api import inspect
from tokpack.packer.inspection import report_lines

L = 31


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Two sources of different document lengths (short: 5-40 tokens, long: 100-400), a run
    mixing them 3:1 with a held-out split."""
    root = tmp_path_factory.mktemp("inspect-sources")
    rng = np.random.default_rng(4)
    docs = {
        "short": random_docs(rng, 300, 1000, 0, min_len=5, max_len=40),
        "long": random_docs(rng, 60, 1000, 0, min_len=100, max_len=400),
    }
    srcs = {name: write_source(root / name, d, docs_per_shard=70) for name, d in docs.items()}
    run = root / "run"
    shuffle_run(
        [str(srcs["short"]), str(srcs["long"])],
        str(run),
        weights=["3", "1"],
        samples=300,
        seq_len=L,
        seed=3,
        epochs=[0],
        shard_samples=100,
        memory=8 << 20,
        holdout="0.1",
    )
    return run, srcs, docs


def test_each_sources_document_lengths(mixed):
    """`document_lengths.sources` holds each source's figures, equal to its documents' own
    (quantiles as the whole corpus's are: the lower one); the lines name each source."""
    run, _, docs = mixed
    r = inspect(run, batch_size=8, batches=2)
    got = {d["name"]: d for d in r.document_lengths["sources"]}
    assert list(got) == ["short", "long"]
    for name, ds in docs.items():
        lengths = np.array([len(d) for d in ds])
        d = got[name]
        assert (d["documents"], d["min"], d["max"]) == (len(ds), lengths.min(), lengths.max())
        assert d["mean"] == pytest.approx(lengths.mean(), abs=0.01)
        for q in ("p50", "p99"):
            assert d["quantiles"][q] == np.quantile(lengths, int(q[1:]) / 100, method="lower")
        assert "sampled_from_documents" not in d
    assert r.document_lengths["documents"] == 360  # the whole corpus's, as before
    lines = report_lines(r)
    at = lines.index("  document length by source (tokens a document):")
    assert lines[at + 1].startswith(f"    short: mean {got['short']['mean']}  min {got['short']['min']}  p50 ")
    assert lines[at + 2].endswith(f"max {got['long']['max']}  (60 documents)")


def test_each_source_is_sampled_from_its_own_blocks(mixed, monkeypatch):
    """Above the cap the sources' figures come from the blocks drawn for the whole corpus, and a
    source none of whose blocks was drawn still gets one of its own; the whole corpus's figures
    are those of the drawn blocks alone."""
    from tokpack.formats.shards import PackedSource

    _, srcs, docs = mixed
    opened = [PackedSource.open(srcs["short"]), PackedSource.open(srcs["long"])]
    monkeypatch.setattr(doc_lengths, "INDEX_BLOCK", 20)
    per_source: list[dict] = []
    whole = doc_lengths.document_lengths(opened, max_documents=20, per_source=per_source).report()
    assert whole["documents"] == 20 and whole["sampled_from_documents"] == 360
    assert [d["sampled_from_documents"] for d in per_source] == [300, 60]
    assert all(d["documents"] == 20 for d in per_source)  # `long` had no block drawn: its first one
    long_lengths = [len(d) for d in docs["long"][:20]]
    assert (per_source[1]["min"], per_source[1]["max"]) == (min(long_lengths), max(long_lengths))


def test_a_block_drawn_at_a_sources_first_shard_is_that_sources(mixed, monkeypatch):
    """Two sources of 17 blocks each, 2 blocks drawn: blocks 0 and 17, each source's first (the
    second, shard 0 of the second source, lies just past the first source's shards: it is
    counted there, not in the first source, whose shards it is not)."""
    from tokpack.formats.shards import PackedSource

    _, srcs, docs = mixed
    opened = [PackedSource.open(srcs["short"]), PackedSource.open(srcs["short"])]
    monkeypatch.setattr(doc_lengths, "INDEX_BLOCK", 20)  # 4 shards of 70 documents and one of 20: 17 blocks
    per_source: list[dict] = []
    whole = doc_lengths.document_lengths(opened, max_documents=40, per_source=per_source).report()
    assert whole["documents"] == 40 and whole["sampled_from_documents"] == 600
    first = [len(d) for d in docs["short"][:20]]
    for d in per_source:
        assert (d["documents"], d["min"], d["max"]) == (20, min(first), max(first))


def test_the_held_out_split_is_named_so(mixed):
    """RUN/holdout/ is the held-out split, in every line that named it "epoch 0", and in --json;
    a training epoch of the same run is still "epoch 0"."""
    run, _, _ = mixed
    held = inspect(run / HOLDOUT_DIR, batch_size=4, batches=2)
    assert held.split == "holdout" and held.to_json()["split"] == "holdout"
    lines = report_lines(held)
    assert lines[0].startswith(f"held-out split {run / HOLDOUT_DIR} (RUN/holdout/")
    assert not any("epoch 0" in line or "epochs [0]" in line for line in lines), lines
    assert any(line.startswith("  held-out split: ") and " samples; " in line for line in lines)
    assert any(line.startswith("  batches after (held-out split, plan)") for line in lines), lines
    epoch = inspect(run / epoch_dir_name(0), batch_size=4, batches=2)
    assert epoch.split is None and "split" not in epoch.to_json()
    lines = report_lines(epoch)
    assert lines[0] == f"epoch {run / epoch_dir_name(0)}"
    assert any(line.startswith("  epoch 0: ") for line in lines)
    assert any(line.startswith("  batches after (epoch 0, plan)") for line in lines)
