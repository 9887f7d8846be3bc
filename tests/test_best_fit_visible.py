"""Best-fit visible (issue 35, item 5): shuffle's summary (human and --json), `inspect` (human
and --json) and `plan shuffle` show the packing method, the padding (tokens and %), the
documents cut and the most documents a row holds (its padding counted as one, as the loader
counts segments), and call best-fit's samples rows, not windows. Each figure is checked
against the epoch's own bytes: its rows and their `.ds.pad`, and the sources' documents."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import random_docs, write_source
from tokpack.formats.names import epoch_dir_name
from tokpack.formats.reading import read_manifest
from tokpack.loader.reader import document_masks
from tokpack.packer.cli import main

SEQ = 63  # a row is 64 tokens: documents of 1..300 tokens give whole documents, cut ones and padding
EOS, PAD = 0, 5


def cli(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res.exit_code, res.stdout, res.stderr


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("visible")
    # No long document ends in a tail of under 4 tokens: so short a tail (say the EOS alone)
    # could be the tail of several documents, and the bytes would not say which was cut.
    docs = {
        name: [
            d
            for d in random_docs(np.random.default_rng(seed), n, 1000, EOS, max_len=longest)
            if len(d) <= SEQ + 1 or len(d) % (SEQ + 1) not in (1, 2, 3)
        ]
        for name, seed, n, longest in (("web", 3, 150, 200), ("code", 4, 60, 120))
    }
    for name, d in docs.items():
        write_source(root / name, d, docs_per_shard=40)
    return root, docs


def epoch_rows(epoch: Path) -> tuple[np.ndarray, np.ndarray]:
    """The epoch's rows [n, SEQ + 1] and each row's padding, read from its shards' bytes."""
    m = read_manifest(epoch)
    rows = [np.fromfile(epoch / s["path"], "<u2").reshape(-1, SEQ + 1) for s in m["shards"]]
    pads = [np.fromfile(epoch / (s["path"] + ".pad"), "<u4") for s in m["shards"]]
    return np.concatenate(rows), np.concatenate(pads)


def figures_of_the_bytes(epoch: Path, docs: dict) -> dict:
    """The figures, from the rows alone: padding from .ds.pad; a row's pieces split after each
    EOS (a source document holds one EOS, at its end); a piece that is no whole source document
    is a cut one, found inside the one long document that holds it."""
    rows, pads = epoch_rows(epoch)
    whole = {d.astype("<u2").tobytes() for ds in docs.values() for d in ds}
    long = [
        (name, i, d.astype("<u2").tobytes()) for name, ds in docs.items() for i, d in enumerate(ds) if len(d) > SEQ + 1
    ]
    cut, most = set(), 0
    for row, pad in zip(rows, pads):
        real = row[: len(row) - int(pad)]
        ends = [int(j) + 1 for j in np.flatnonzero(real == EOS)]
        if not ends or ends[-1] != len(real):
            ends.append(len(real))  # a cut document's piece that fills the row to its end
        pieces = [real[a:b] for a, b in zip([0, *ends[:-1]], ends)]
        # a row's segments as a trainer sees them: the pieces and the padding that start at an
        # input (a piece or padding that starts at the row's last token is a label only)
        most = max(most, sum(a < SEQ for a in [0, *ends[:-1]]) + (len(real) < SEQ))
        for piece in pieces:
            raw = piece.tobytes()
            if raw not in whole:
                row = 2 * (SEQ + 1)  # bytes: a cut document's pieces start at multiples of a row
                holders = [
                    (name, i)
                    for name, i, d in long
                    if (
                        d.endswith(raw)
                        if piece[-1] == EOS
                        # its tail, else a full row of it
                        else any(d[k : k + len(raw)] == raw for k in range(0, len(d), row))
                    )
                ]
                assert len(holders) == 1
                cut.add(holders[0])
    positions, _ = document_masks(rows, pads, EOS)  # the loader's segments agree
    assert int((positions[:, :-1] == 0).sum(axis=1).max()) == most
    padding = int(pads.sum())
    return {
        "method": "best-fit",
        "unit": "rows",
        "padding_tokens": padding,
        "padding_percent": round(100 * padding / rows.size, 3),
        "documents_cut": len(cut),
        "max_documents_per_row": most,
    }


@pytest.fixture(scope="module")
def run(corpus):
    """Two best-fit runs: one pass over each source per epoch (every long document is cut in
    it), and a weighted one whose epochs take part of a pass: each epoch's chain stays inside
    pass 0 of each source, so a document is in an epoch at most once and the bytes can name
    each cut one (a document in two passes of one epoch is counted once per pass)."""
    root, _ = corpus
    out = {}
    for name, args in (
        ("whole", [root / "web", root / "code"]),
        ("weighted", [f"{root / 'web'}=0.6", f"{root / 'code'}=0.4", "--samples", 40]),
    ):
        code, stdout, err = cli(
            "shuffle",
            *args,
            "-o",
            root / name,
            "--seq-len",
            SEQ,
            "--seed",
            9,
            "--epochs",
            2,
            "--packing",
            "best-fit",
            "--pad-id",
            PAD,
            "--shard-samples",
            64,
            "--json",
        )
        assert code == 0, err
        out[name] = json.loads(stdout)
    return root, out


@pytest.mark.parametrize("name", ["whole", "weighted"])
def test_the_shuffle_summary_and_the_manifest_give_the_figures_of_the_epochs_bytes(corpus, run, name):
    root, docs = corpus
    _, results = run
    details = results[name]["epochs_detail"]
    assert results[name]["packing"] == "best-fit" and [d["epoch"] for d in details] == [0, 1]
    for d in details:
        epoch = root / name / epoch_dir_name(d["epoch"])
        assert all(s["passes"] == 1 for s in read_manifest(epoch)["sources"])
        want = figures_of_the_bytes(epoch, docs)
        assert d["packing"] == want
        assert want["documents_cut"] > 0
        if name == "whole":  # a pass's first rows are its long documents' full rows: the padding comes later
            assert want["padding_tokens"] > 0 and want["max_documents_per_row"] > 2
        recorded = read_manifest(epoch)["packing"]
        assert {k: recorded[k] for k in ("padding_tokens", "documents_cut", "max_documents_per_row")} == {
            k: want[k] for k in ("padding_tokens", "documents_cut", "max_documents_per_row")
        }
    if name == "whole":  # every long document of both sources is cut in each epoch
        assert all(
            d["packing"]["documents_cut"] == sum(len(x) > SEQ + 1 for ds in docs.values() for x in ds) for d in details
        )


def test_the_human_summary_says_best_fit_rows_and_its_figures(corpus, tmp_path):
    root, docs = corpus
    code, out, err = cli(
        "shuffle",
        root / "web",
        "-o",
        tmp_path / "r",
        "--seq-len",
        SEQ,
        "--seed",
        9,
        "--epochs",
        1,
        "--packing",
        "best-fit",
        "--pad-id",
        PAD,
    )
    assert code == 0, err
    f = figures_of_the_bytes(tmp_path / "r" / epoch_dir_name(0), {"web": docs["web"]})
    epoch_line = next(x for x in out.splitlines() if x.startswith("epoch 0:"))
    assert epoch_line.endswith(
        f"; best-fit rows, padding {f['padding_tokens']:,} tokens ({f['padding_percent']:g}%), "
        f"{f['documents_cut']} documents cut, at most {f['max_documents_per_row']} documents per row "
        "(padding counted as one)"
    )
    source_line = next(x for x in out.splitlines() if x.startswith('epoch 0, source "web"'))
    assert " rows a pass, " in source_line and "window" not in out
    assert "packing: best-fit" in out


def test_inspect_shows_each_epochs_figures_and_the_runs(corpus, run):
    root, docs = corpus
    code, out, err = cli("inspect", root / "whole", "--json")
    assert code == 0, err
    report = json.loads(out)
    per_epoch = [figures_of_the_bytes(root / "whole" / epoch_dir_name(e), docs) for e in (0, 1)]
    assert [e["packing"] for e in report["epochs"]] == per_epoch and per_epoch[0]["padding_tokens"] > 0
    padding = sum(f["padding_tokens"] for f in per_epoch)
    assert report["packing"] == {
        "method": "best-fit",
        "unit": "rows",
        "padding_tokens": padding,
        "padding_percent": round(100 * padding / report["totals"]["tokens"], 3),
        "documents_cut": sum(f["documents_cut"] for f in per_epoch),
        "max_documents_per_row": max(f["max_documents_per_row"] for f in per_epoch),
    }
    code, out, err = cli("inspect", root / "whole")
    assert code == 0, err
    lines = out.splitlines()
    p = report["packing"]
    assert (
        f"  packing: best-fit rows, padding {p['padding_tokens']:,} tokens ({p['padding_percent']:g}%), "
        f"{p['documents_cut']} documents cut, at most {p['max_documents_per_row']} documents per row "
        "(padding counted as one) (over 2 epochs)"
    ) in lines
    for e, f in enumerate(per_epoch):
        line = next(x for x in lines if x.startswith(f"  epoch {e}:"))
        assert line.endswith(
            f"; padding {f['padding_tokens']:,} tokens ({f['padding_percent']:g}%), "
            f"{f['documents_cut']} documents cut, at most {f['max_documents_per_row']} documents "
            "per row"
        )
    assert "window" not in out.split("batches before")[0]
    code, out, _ = cli("inspect", root / "whole" / epoch_dir_name(1), "--json")
    assert json.loads(out)["packing"] == per_epoch[1]


def test_plan_shows_the_figures_the_shuffle_then_writes(corpus, run, tmp_path):
    root, _ = corpus
    _, results = run
    args = [
        root / "web",
        root / "code",
        "-o",
        tmp_path / "p",
        "--seq-len",
        SEQ,
        "--seed",
        9,
        "--epochs",
        2,
        "--packing",
        "best-fit",
        "--pad-id",
        PAD,
        "--shard-samples",
        64,
        "--disk-mbps",
        100,
    ]
    code, out, err = cli("plan", "shuffle", *args, "--json")
    assert code == 0, err
    assert [e["packing"] for e in json.loads(out)["epochs"]] == [
        d["packing"] for d in results["whole"]["epochs_detail"]
    ]
    code, out, err = cli("plan", "shuffle", *args)
    assert code == 0, err
    first = results["whole"]["epochs_detail"][0]["packing"]
    assert (
        f"    packing: best-fit rows, padding {first['padding_tokens']:,} tokens ({first['padding_percent']:g}%), "
        f"{first['documents_cut']} documents cut, at most {first['max_documents_per_row']} documents per row "
        "(padding counted as one)"
    ) in out.splitlines()
    assert " rows a pass " in out and "window" not in out
    assert not (tmp_path / "p").exists()


def test_a_window_run_says_concat_windows_and_no_padding(corpus, tmp_path):
    root, _ = corpus
    code, out, err = cli(
        "shuffle", root / "web", "-o", tmp_path / "w", "--seq-len", SEQ, "--seed", 1, "--epochs", 1, "--json"
    )
    assert code == 0, err
    result = json.loads(out)
    assert result["packing"] == "concat"
    assert result["epochs_detail"][0]["packing"] == {
        "method": "concat",
        "unit": "windows",
        "padding_tokens": 0,
        "padding_percent": 0.0,
    }
    code, out, _ = cli("inspect", tmp_path / "w")
    assert "  packing: concat windows" in out.splitlines()
    code, out, _ = cli(
        "plan",
        "shuffle",
        root / "web",
        "-o",
        tmp_path / "w2",
        "--seq-len",
        SEQ,
        "--seed",
        1,
        "--epochs",
        1,
        "--disk-mbps",
        100,
    )
    assert "    packing: concat windows" in out.splitlines()


def test_validate_against_checks_the_recorded_figures(corpus, run, tmp_path):
    """The figures are the rows': `validate --against` recounts them from the sources, and a
    manifest edited to show others fails there, naming the field."""
    import shutil

    from tokpack.formats.reading import write_manifest

    root, _ = corpus
    epoch = tmp_path / "e"
    shutil.copytree(root / "whole" / epoch_dir_name(0), epoch)
    sources = [root / "web", root / "code"]
    assert cli("validate", epoch, *[a for s in sources for a in ("--against", s)])[0] == 0
    m = read_manifest(epoch)
    for key in ("documents_cut", "max_documents_per_row"):
        write_manifest(epoch, {**m, "packing": {**m["packing"], key: m["packing"][key] + 1}})
        code, out, err = cli("validate", epoch, *[a for s in sources for a in ("--against", s)])
        assert code == 1 and f"packing.{key}" in out + err and "replayed from the sources" in out + err
    write_manifest(epoch, m)
