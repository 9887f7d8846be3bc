"""A held-out split (issue 35, item 7, its first part): `shuffle --packing best-fit --holdout F`
sets whole documents of each source aside from every epoch, chosen from the seed alone
(tokpack.shuffle.holdout); `validate --against` replays the epoch without them; weights,
schedules and `--like` keep working; the held-out documents are written once as RUN/holdout/, an
epoch directory that tokpack's reader, TokpackDataset and datatrove read. Not yet: window
(concat) runs, which refuse --holdout in one line."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import random_docs, write_source
from tokpack.formats.errors import TokpackError
from tokpack.formats.manifest import epoch_dir_name, read_manifest, write_manifest
from tokpack.formats.shards import PackedSource
from tokpack.packer.cli import main
from tokpack.shuffle.holdout import parse_holdout
from tokpack.shuffle.packed import doc_table, held_out, packed_plan_from_manifest

SEQ = 63
EOS = 0


def cli(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res.exit_code, res.stdout, res.stderr


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("holdout")
    docs = {"web": random_docs(np.random.default_rng(5), 160, 1000, EOS, max_len=150),
            "code": random_docs(np.random.default_rng(6), 80, 1000, EOS, max_len=90)}
    for name, d in docs.items():
        write_source(root / name, d, docs_per_shard=40)
    return root, docs


def test_parse_holdout_takes_a_fraction_or_a_token_count():
    assert parse_holdout("0.01") == {"fraction": "1/100"} and parse_holdout("1%") == {"fraction": "1/100"}
    assert parse_holdout("5M") == {"tokens": 5_000_000} and parse_holdout("20000") == {"tokens": 20000}
    assert parse_holdout(None) is None
    for bad in ("0.0", "1.5", "100%", "abc", "0", "-1%"):
        with pytest.raises(TokpackError) as e:
            parse_holdout(bad)
        assert "--holdout" in str(e.value) and "\n" not in str(e.value)


def test_the_held_out_documents_come_from_the_seed_and_the_source_alone(corpus):
    root, docs = corpus
    web = PackedSource.open(root / "web")
    h = held_out(web, {"fraction": "1/10"}, 1)
    assert h.held == math.ceil(len(docs["web"]) / 10)
    held = h.held_documents()
    assert len(set(held.tolist())) == h.held and h.is_held(held).all()
    assert h.is_held(np.arange(len(docs["web"]))).sum() == h.held
    assert held.tolist() != held_out(web, {"fraction": "1/10"}, 2).held_documents().tolist()  # another seed
    # a token count: the fewest documents, in the holdout's order, that hold that many tokens
    _, lengths = doc_table(web)
    order = h.order().forward(np.arange(len(lengths)))
    t = held_out(web, {"tokens": 2000}, 1)
    assert lengths[order[: t.held]].sum() >= 2000 > lengths[order[: t.held - 1]].sum()
    with pytest.raises(TokpackError, match="would hold out every document"):
        held_out(web, {"tokens": 10**9}, 1)


def rows_of(epoch: Path) -> list[bytes]:
    m = read_manifest(epoch)
    return [np.fromfile(epoch / s["path"], "<u2").tobytes() for s in m["shards"]]


def test_no_epoch_holds_a_held_out_document_and_validate_against_replays_it(corpus, tmp_path):
    root, docs = corpus
    run = tmp_path / "run"
    code, out, err = cli("shuffle", f"{root / 'web'}=0.7", f"{root / 'code'}=0.3", "-o", run, "--seq-len", SEQ,
                         "--seed", 4, "--epochs", 2, "--packing", "best-fit", "--holdout", "10%", "--samples", 300,
                         "--json")
    assert code == 0, err
    for e in (0, 1):
        epoch = run / epoch_dir_name(e)
        m = read_manifest(epoch)
        assert m["packing"]["holdout"] == {"fraction": "1/10"}
        sources = [PackedSource.open(root / n) for n in ("web", "code")]
        plan = packed_plan_from_manifest(m, sources)
        table = plan.table(sources)
        for s, name in enumerate(("web", "code")):
            h = held_out(sources[s], {"fraction": "1/10"}, 4)
            assert m["sources"][s]["held_documents"] == h.held > 0
            assert not h.is_held(table["doc"][table["source"] == s].astype(np.int64)).any()
            # and in the epoch's bytes: no held-out document (of a row or less: whole in one row) is in a row
            data = b"".join(rows_of(epoch))
            short = [d for i, d in enumerate(docs[name]) if i in set(h.held_documents().tolist()) and len(d) <= SEQ]
            assert short and not any(d.astype("<u2").tobytes() in data for d in short)
    code, out, err = cli("validate", run, "--against", root / "web", "--against", root / "code")
    assert code == 0, out + err
    # a rerun with another holdout is another run
    code, _, err = cli("shuffle", f"{root / 'web'}=0.7", f"{root / 'code'}=0.3", "-o", run, "--seq-len", SEQ,
                       "--seed", 4, "--epoch", 2, "--packing", "best-fit", "--holdout", "20%", "--samples", 300)
    assert code == 1 and "different run" in err and "holdout" in err
    # --like keeps the holdout: epoch 2 as the full command writes it
    code, _, err = cli("shuffle", "--like", run, "--epoch", 2)
    assert code == 0, err
    ref = tmp_path / "ref"
    code, _, err = cli("shuffle", f"{root / 'web'}=0.7", f"{root / 'code'}=0.3", "-o", ref, "--seq-len", SEQ,
                       "--seed", 4, "--epoch", 2, "--packing", "best-fit", "--holdout", "10%", "--samples", 300)
    assert code == 0, err
    assert rows_of(run / epoch_dir_name(2)) == rows_of(ref / epoch_dir_name(2))


def test_an_epoch_that_holds_the_held_out_documents_fails_validate_against(corpus, tmp_path):
    """An epoch shuffled without the holdout, its manifest edited to claim one: the replay
    builds the rows without the held-out documents, and the epoch's rows are not those."""
    root, _ = corpus
    code, _, err = cli("shuffle", root / "web", "-o", tmp_path / "run", "--seq-len", SEQ, "--seed", 4, "--epochs", 1,
                       "--packing", "best-fit")
    assert code == 0, err
    epoch = tmp_path / "run" / epoch_dir_name(0)
    m = read_manifest(epoch)
    write_manifest(epoch, {**m, "packing": {**m["packing"], "holdout": {"fraction": "1/10"}},
                           "sources": [{**m["sources"][0], "held_documents": 16}]})
    code, out, err = cli("validate", epoch, "--against", root / "web")
    assert code == 1 and "CORRUPT" in out + err


def test_a_schedule_keeps_its_holdout_across_stages(corpus, tmp_path):
    root, _ = corpus
    (tmp_path / "run.yaml").write_text(
        f"seq_len: {SEQ}\nseed: 3\npacking: best-fit\nstages:\n"
        f"  - {{name: a, epochs: 1, sources: {{{root / 'web'}: 1}}}}\n"
        f"  - {{name: b, tokens: 6K, sources: {{{root / 'web'}: 0.5, {root / 'code'}: 0.5}}}}\n")
    code, out, err = cli("shuffle", "--schedule", tmp_path / "run.yaml", "-o", tmp_path / "run", "--holdout", "5%",
                         "--json")
    assert code == 0, err
    sources = [PackedSource.open(root / n) for n in ("web", "code")]
    for e in (0, 1):
        m = read_manifest(tmp_path / "run" / epoch_dir_name(e))
        table = packed_plan_from_manifest(m, sources).table(sources)
        for s in (0, 1):
            h = held_out(sources[s], {"fraction": "1/20"}, 3)
            assert not h.is_held(table["doc"][table["source"] == s].astype(np.int64)).any()
    code, out, err = cli("validate", tmp_path / "run", "--against", root / "web", "--against", root / "code")
    assert code == 0, out + err


def test_holdout_is_refused_where_it_cannot_hold(corpus, tmp_path):
    root, _ = corpus
    code, _, err = cli("shuffle", root / "web", "-o", tmp_path / "w", "--seq-len", SEQ, "--seed", 1, "--epochs", 1,
                       "--holdout", "0.1")
    assert code == 1 and "concat packing cannot yet" in err and "--packing best-fit" in err
    code, _, err = cli("shuffle", root / "web", "-o", tmp_path / "w", "--seq-len", SEQ, "--seed", 1, "--epochs", 1,
                       "--packing", "best-fit", "--holdout", "2")
    assert code == 0, err  # 2 tokens: the first document in the holdout's order
    code, _, err = cli("shuffle", root / "web", "-o", tmp_path / "x", "--seq-len", SEQ, "--seed", 1, "--epochs", 1,
                       "--packing", "best-fit", "--holdout", "1T")
    assert code == 1 and "would hold out every document" in err
    assert not (tmp_path / "x").exists()


def test_the_held_out_documents_are_written_once_as_an_epoch_directory(corpus, tmp_path):
    root, docs = corpus
    run = tmp_path / "run"
    args = [f"{root / 'web'}=0.7", f"{root / 'code'}=0.3", "-o", run, "--seq-len", SEQ, "--seed", 4,
            "--packing", "best-fit", "--holdout", "10%", "--samples", 300]
    code, out, err = cli("shuffle", *args, "--epochs", 1, "--json")
    assert code == 0, err
    result = json.loads(out)
    held_dir = run / "holdout"
    assert result["holdout"]["path"] == str(held_dir) and result["holdout"]["samples"] > 0
    m = read_manifest(held_dir)
    assert m["kind"] == "epoch" and m["packing"]["split"] == "holdout"
    sources = [PackedSource.open(root / n) for n in ("web", "code")]
    table = packed_plan_from_manifest(m, sources).table(sources)
    data = b"".join(rows_of(held_dir))
    for s, name in enumerate(("web", "code")):
        h = held_out(sources[s], {"fraction": "1/10"}, 4)
        ids = table["doc"][table["source"] == s].astype(np.int64)
        assert h.is_held(ids).all() and set(ids.tolist()) == set(h.held_documents().tolist())  # all, and only
        short = [d for i, d in enumerate(docs[name]) if i in set(h.held_documents().tolist()) and len(d) <= SEQ]
        assert all(d.astype("<u2").tobytes() in data for d in short)
    # read like an epoch: tokpack's reader and TokpackDataset, and datatrove's folder dataset
    from tokpack.loader.reader import SampleReader
    from tokpack.loader.torch_adapter import TokpackDataset

    reader = SampleReader.open(held_dir)
    assert reader.total_samples == m["samples"]
    assert SampleReader.open(run).total_samples == 300  # the run's stream holds no held-out row
    batch = next(iter(TokpackDataset(held_dir, micro_batch=2)))
    assert batch["input_ids"].shape == (2, SEQ) and "loss_mask" in batch
    code = ("import json\nfrom datatrove.utils.dataset import DatatroveFolderDataset\n"
            f"ds = DatatroveFolderDataset({str(held_dir)!r}, {SEQ}, filename_pattern='*.ds', token_size=2)\n"
            "print(len(ds), json.dumps(ds[0]['input_ids'].tolist()))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    n, first = r.stdout.split(" ", 1)
    assert int(n) == m["samples"] and json.loads(first) == reader.read(0)[0].tolist()
    code, out, err = cli("inspect", run, "--json")
    assert code == 0, err
    assert json.loads(out)["holdout"]["samples"] == m["samples"]
    assert [s["held_documents"] for s in json.loads(out)["holdout"]["sources"]] == [
        held_out(src, {"fraction": "1/10"}, 4).held for src in sources]
    # written once: a later command adds epochs and leaves it as it is
    before = {p.name: p.read_bytes() for p in held_dir.iterdir()}
    code, out, err = cli("shuffle", "--like", run, "--epoch", 1, "--json")
    assert code == 0, err
    assert "holdout" not in json.loads(out) and {p.name: p.read_bytes() for p in held_dir.iterdir()} == before
    # validate RUN --against checks it with the epochs; a held-out folder that claims to be training is refused
    code, out, err = cli("validate", run, "--against", root / "web", "--against", root / "code")
    assert code == 0 and f"OK epoch {held_dir}" in out, out + err
    packing = {k: v for k, v in m["packing"].items() if k != "split"}
    write_manifest(held_dir, {**m, "packing": packing})
    code, out, err = cli("validate", held_dir, "--against", root / "web", "--against", root / "code")
    assert code == 1 and "CORRUPT" in out + err


def test_plan_shuffle_names_the_holdout_folder_it_would_write(corpus, tmp_path):
    root, _ = corpus
    args = [root / "web", "-o", tmp_path / "run", "--seq-len", SEQ, "--seed", 4, "--epochs", 1, "--packing",
            "best-fit", "--holdout", "3K"]
    code, out, err = cli("plan", "shuffle", *args, "--disk-mbps", 100, "--json")
    assert code == 0, err
    planned = json.loads(out)["holdout"]
    code, out, err = cli("shuffle", *args, "--json")
    assert code == 0, err
    written = json.loads(out)["holdout"]
    assert (planned["samples"], planned["shards"]) == (written["samples"], written["shards"]) and planned["samples"] > 0
    again = [a if a != "--epochs" else "--epoch" for a in args]  # epoch 1, into the run
    code, out, _ = cli("plan", "shuffle", *again, "--disk-mbps", 100, "--json")
    assert code == 0 and "holdout" not in json.loads(out)  # written already: not again
