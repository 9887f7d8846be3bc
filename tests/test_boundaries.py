"""Document boundaries a trainer takes as they are (issue 34): the same keys on a best-fit and a
window epoch, fixed shapes with `max_documents`, the row with too many documents refused by
name, and Megatron's `eod_mask_loss`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import random_docs, require, shuffle_run, write_source
from tokpack.formats.errors import TokpackError
from tokpack.loader.reader import SampleReader, cu_seqlens, micro_batch, most_documents, positions_from_eos

SEQ = 63  # a sample is 64 tokens; inputs and labels 63
EOS = 0
BASE_KEYS = {"input_ids", "labels", "position_ids", "loss_mask", "cu_seqlens", "consumed_samples"}
FIXED_KEYS = BASE_KEYS | {"max_seqlen", "doc_lens", "max_doc_lens"}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("boundary-src")
    rng = np.random.default_rng(34)
    return [
        write_source(root / "a", random_docs(rng, 300, 1000, EOS, 1, 40)),
        write_source(root / "b", random_docs(rng, 40, 1000, EOS, 1, 200)),
    ]


def _run(sources, out: Path, packing: str) -> Path:
    shuffle_run(
        [str(s) for s in sources],
        str(out),
        weights=["2", "1"],
        seq_len=SEQ,
        seed=3,
        epochs=[0, 1],
        samples=96,
        shard_samples=40,
        memory=64 << 20,
        packing=packing,
    )
    return out


@pytest.fixture(scope="module")
def best_fit(sources, tmp_path_factory) -> Path:
    return _run(sources, tmp_path_factory.mktemp("bf") / "run", "best-fit")


@pytest.fixture(scope="module")
def window(sources, tmp_path_factory) -> Path:
    return _run(sources, tmp_path_factory.mktemp("win") / "run", "concat")


def dataset(path, **kw):
    require("torch", "pip install torch")
    from tokpack.loader.torch_adapter import TokpackDataset

    return TokpackDataset(path, **{"micro_batch": 4, "at_end": "stop", **kw})


def segment_counts(path: Path) -> list[int]:
    """Each row's segment count (documents, and its padding), row by row through the reader."""
    reader = SampleReader.open(path)
    counts = []
    for g in range(reader.total_samples):
        rows = reader.read(g, 1)
        counts.append(most_documents(reader.micro_batch(rows, positions_from_eos(rows, EOS), g)["position_ids"]))
    return counts


def most_in_run(path: Path) -> int:
    return max(segment_counts(path))


def test_every_epoch_kind_yields_the_same_keys(best_fit, window):
    """A varlen loop written for a best-fit run runs on a window run: no KeyError on cu_seqlens."""
    for path in (best_fit, window):
        for batch in dataset(path):
            assert set(batch) == BASE_KEYS, path
            assert str(batch["cu_seqlens"].dtype) == "torch.int32"
    # A window epoch has no padding: every label counts, and its boundaries are its EOS tokens.
    for b, batch in enumerate(dataset(window)):
        rows = SampleReader.open(window).read(4 * b, 4).astype(np.int64)
        assert batch["loss_mask"].numpy().all() and np.array_equal(batch["labels"].numpy(), rows[:, 1:])
        starts = np.ones((4, SEQ), bool)
        starts[:, 1:] = rows[:, : SEQ - 1] == EOS  # a document starts after each EOS input, and at a row start
        assert np.array_equal(batch["cu_seqlens"].numpy(), np.append(np.flatnonzero(starts), 4 * SEQ))


@pytest.mark.parametrize("kind", ["best_fit", "window"])
def test_fixed_shapes_hold_the_same_boundaries(kind, request):
    path = request.getfixturevalue(kind)
    K = most_in_run(path)
    m, L = 4, SEQ
    free, fixed = dataset(path), dataset(path, max_documents=K)
    shapes = set()
    for a, b in zip(free, fixed):
        assert set(b) == FIXED_KEYS
        for key in a:
            if key != "cu_seqlens":
                assert np.array_equal(a[key].numpy(), b[key].numpy()), key  # the rest is unchanged
        cu, fcu = a["cu_seqlens"].numpy(), b["cu_seqlens"].numpy()
        n = len(cu) - 1  # segments in the micro-batch
        assert fcu.shape == (m * K + 1,) and fcu.dtype == np.int32
        assert np.array_equal(fcu[: n + 1], cu) and (fcu[n:] == m * L).all()  # padded by repeating the total
        lens = np.diff(cu)
        assert int(b["max_seqlen"]) == lens.max() and b["max_seqlen"].ndim == 0
        doc_lens = b["doc_lens"].numpy()
        assert doc_lens.shape == (m, K) and doc_lens.dtype == np.int32
        assert (doc_lens.sum(axis=1) == L).all()  # each row is its segments
        assert np.array_equal(doc_lens[doc_lens > 0], lens)  # row by row, in order, then zeros
        for row in doc_lens:
            k = np.count_nonzero(row)
            assert (row[:k] > 0).all() and (row[k:] == 0).all()
        assert np.array_equal(b["max_doc_lens"].numpy(), doc_lens.max(axis=1))
        shapes.add(tuple((key, tuple(v.shape)) for key, v in sorted(b.items())))
    assert len(shapes) == 1  # whatever the rows hold


def test_a_row_with_more_documents_than_k_is_named(best_fit):
    K = most_in_run(best_fit)
    reader = SampleReader.open(best_fit)
    first = segment_counts(best_fit).index(K)  # the first row holding K segments: too many for K - 1
    with pytest.raises(TokpackError) as err:
        for _ in dataset(best_fit, max_documents=K - 1):
            pass
    epoch, sample = reader.locate(first)
    text = str(err.value)
    assert f"sample {first} (epoch {epoch}, sample {sample})" in text, text
    assert f"{K} documents" in text and f"at most {K - 1} documents" in text, text
    assert "tokpack inspect" in text and "\n" not in text


def test_eod_mask_loss_drops_the_label_after_each_eos(best_fit, window):
    """The label at an EOS input is the next document's first token; its loss counts unless
    eod_mask_loss (Megatron's) is on. Nothing else changes."""
    for path in (best_fit, window):
        for a, b in zip(dataset(path), dataset(path, eod_mask_loss=True)):
            eos = a["input_ids"].numpy() == EOS
            real = a["loss_mask"].numpy().astype(bool)
            assert np.array_equal(b["loss_mask"].numpy(), (real & ~eos).astype(np.int64))
            assert np.array_equal(b["labels"].numpy(), np.where(real & ~eos, a["labels"].numpy(), -100))
            for key in ("input_ids", "position_ids", "cu_seqlens"):
                assert np.array_equal(a[key].numpy(), b[key].numpy())
        # Without it, an in-row EOS's label is a real token whose loss counts.
        batch = next(iter(dataset(path)))
        inside = (batch["input_ids"].numpy() == EOS) & batch["loss_mask"].numpy().astype(bool)
        assert inside.any() and (batch["labels"].numpy()[inside] >= 0).all()


def test_boundary_options_are_checked(best_fit):
    for kw, line in [
        ({"max_documents": 0}, "max_documents"),
        ({"max_documents": 2.5}, "max_documents"),
        ({"max_documents": 4, "positions": None}, "need positions"),
        ({"eod_mask_loss": "yes"}, "eod_mask_loss"),
    ]:
        with pytest.raises(TokpackError, match=line):
            dataset(best_fit, **kw)


def test_fixed_boundaries_by_hand():
    rows = np.array([[5, 6, 0, 7, 0, 0, 0], [1, 2, 3, 4, 5, 6, 0]])
    out = micro_batch(rows, np.array([2, 0], np.uint32), np.zeros_like(rows), EOS, max_documents=4)
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]
    assert out["cu_seqlens"].tolist() == [0, 3, 5, 6, 12, 12, 12, 12, 12]
    assert out["doc_lens"].tolist() == [[3, 2, 1, 0], [6, 0, 0, 0]]
    assert out["max_doc_lens"].tolist() == [3, 6] and int(out["max_seqlen"]) == 6
    assert out["loss_mask"].tolist() == [[1, 1, 1, 1, 0, 0], [1] * 6]
    free = micro_batch(rows, np.array([2, 0], np.uint32), np.zeros_like(rows), EOS)
    assert free["cu_seqlens"].tolist() == cu_seqlens(free["position_ids"]).tolist() == [0, 3, 5, 6, 12]
    with pytest.raises(TokpackError, match=r"\[sample 7\]: .*at most 2 documents.*found 3 documents"):
        micro_batch(rows, np.array([2, 0], np.uint32), np.zeros_like(rows), EOS, max_documents=2, first_row=7)


@pytest.mark.parametrize("kind", ["best_fit", "window"])
def test_inspect_reports_the_k_a_run_takes(kind, request):
    """`tokpack inspect` names the largest document count of a row of the epoch: exactly the
    smallest max_documents that reads the whole epoch (one less is refused)."""
    from tokpack.packer.api import inspect
    from tokpack.packer.inspection import report_lines

    path = request.getfixturevalue(kind)
    counts = segment_counts(path)
    epoch0 = SampleReader.open(path / "epoch-00000").total_samples
    want = max(counts[:epoch0])
    assert inspect(path, epoch=0).documents_per_row is None  # a pass over the epoch only when asked
    result = inspect(path, epoch=0, documents_per_row=True)
    assert result.documents_per_row == {"epoch": 0, "max": want, "sample": counts.index(want)}
    line = next(x for x in report_lines(result) if "documents per row (epoch" in x)
    assert f"at most {want} " in line and f"max_documents={want}" in line
    epoch = path / "epoch-00000"
    for _ in dataset(epoch, max_documents=want):
        pass
    with pytest.raises(TokpackError, match="more documents than max_documents"):
        for _ in dataset(epoch, max_documents=want - 1):
            pass


def test_eod_mask_loss_needs_an_eos_id():
    rows = np.array([[5, 6, 0, 7, 0, 0, 0]])
    with pytest.raises(TokpackError, match="eod_mask_loss needs eos_id"):
        micro_batch(rows, None, None, None, eod_mask_loss=True)


def _rows_of(lengths: list[int], n: int) -> list[np.ndarray]:
    """n documents of each length (EOS last, no other EOS), interleaved."""
    rng = np.random.default_rng(35)
    return [np.append(rng.integers(1, 1000, size=k - 1), EOS) for _ in range(n) for k in lengths]


@pytest.mark.parametrize("case", ["fixture", "padded", "unpadded"])
def test_the_manifests_documents_per_row_is_the_count_the_loader_makes(case, best_fit, tmp_path):
    """One count of a row's documents (formats/shards.py row_segments): the epoch manifest's
    max_documents_per_row (counted from the pieces at shuffle time) equals what `tokpack inspect
    --documents-per-row` finds in the epoch's bytes through the loader, the smallest
    max_documents that reads it. A segment that starts at a row's last token is a label only and
    no segment of its inputs: the manifest counted it (18 against the loader's 17 on the
    fixture's epoch 1; 2 against 1 on rows of 63 + 1 tokens, and on rows of 63 tokens and one of
    padding)."""
    import json

    from click.testing import CliRunner

    from tokpack.formats.names import epoch_dir_name
    from tokpack.formats.reading import read_manifest
    from tokpack.packer.cli import main

    if case == "fixture":
        run, epochs = best_fit, (0, 1)
    else:  # a row of SEQ + 1 = 64 tokens: a 63-token document, then a 1-token one (an EOS alone) or padding
        src = write_source(tmp_path / "src", _rows_of([SEQ, 1] if case == "unpadded" else [SEQ], 40))
        run, epochs = tmp_path / "run", (0,)
        shuffle_run(
            [str(src)], str(run), seq_len=SEQ, seed=3, epochs=[0], shard_samples=16, memory=64 << 20, packing="best-fit"
        )
    for e in epochs:
        packing = read_manifest(run / epoch_dir_name(e))["packing"]
        r = CliRunner().invoke(main, ["inspect", str(run), "--epoch", str(e), "--documents-per-row", "--json"])
        assert r.exit_code == 0, r.output
        scanned = json.loads(r.stdout)["documents_per_row"]
        assert packing["max_documents_per_row"] == scanned["max"], (case, e)
        assert (packing["padding_tokens"] > 0) == (case != "unpadded")
    if case != "fixture":
        assert packing["max_documents_per_row"] == 1  # the 1-token segment starts at the label-only token
