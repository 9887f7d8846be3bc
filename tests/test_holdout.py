"""A held-out split (issue 35, item 7): `shuffle --holdout F` sets whole documents of each source
aside from every epoch, chosen from the seed alone (tokpack.shuffle.holdout); `validate --against`
replays the epoch without them; weights, schedules and `--like` keep working; the held-out
documents are written once as RUN/holdout/, an epoch directory that tokpack's reader,
TokpackDataset and datatrove read. Both packings: best-fit rows of the kept documents, and the
default concat windows cut from each source's stream of its kept documents (the second half
of this file, over documents whose tokens name them)."""

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
from tokpack.formats.names import epoch_dir_name
from tokpack.formats.reading import read_manifest, write_manifest
from tokpack.formats.shards import PackedSource
from tokpack.packer.cli import main
from tokpack.shuffle.holdout import Holdout, parse_holdout
from tokpack.shuffle.packed.passes import doc_table
from tokpack.shuffle.packed.packed_plan import held_out, packed_plan_from_manifest
from tokpack.shuffle.packed.table import whole_table

SEQ = 63
EOS = 0


def cli(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res.exit_code, res.stdout, res.stderr


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("holdout")
    docs = {
        "web": random_docs(np.random.default_rng(5), 160, 1000, EOS, max_len=150),
        "code": random_docs(np.random.default_rng(6), 80, 1000, EOS, max_len=90),
    }
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
    code, out, err = cli(
        "shuffle",
        f"{root / 'web'}=0.7",
        f"{root / 'code'}=0.3",
        "-o",
        run,
        "--seq-len",
        SEQ,
        "--seed",
        4,
        "--epochs",
        2,
        "--packing",
        "best-fit",
        "--holdout",
        "10%",
        "--samples",
        300,
        "--json",
    )
    assert code == 0, err
    for e in (0, 1):
        epoch = run / epoch_dir_name(e)
        m = read_manifest(epoch)
        assert m["packing"]["holdout"] == {"fraction": "1/10"}
        sources = [PackedSource.open(root / n) for n in ("web", "code")]
        plan = packed_plan_from_manifest(m, sources)
        table = whole_table(plan, sources)
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
    code, _, err = cli(
        "shuffle",
        f"{root / 'web'}=0.7",
        f"{root / 'code'}=0.3",
        "-o",
        run,
        "--seq-len",
        SEQ,
        "--seed",
        4,
        "--epoch",
        2,
        "--packing",
        "best-fit",
        "--holdout",
        "20%",
        "--samples",
        300,
    )
    assert code == 1 and "different run" in err and "holdout" in err
    # --like keeps the holdout: epoch 2 as the full command writes it
    code, _, err = cli("shuffle", "--like", run, "--epoch", 2)
    assert code == 0, err
    ref = tmp_path / "ref"
    code, _, err = cli(
        "shuffle",
        f"{root / 'web'}=0.7",
        f"{root / 'code'}=0.3",
        "-o",
        ref,
        "--seq-len",
        SEQ,
        "--seed",
        4,
        "--epoch",
        2,
        "--packing",
        "best-fit",
        "--holdout",
        "10%",
        "--samples",
        300,
    )
    assert code == 0, err
    assert rows_of(run / epoch_dir_name(2)) == rows_of(ref / epoch_dir_name(2))


def test_an_epoch_that_holds_the_held_out_documents_fails_validate_against(corpus, tmp_path):
    """An epoch shuffled without the holdout, its manifest edited to claim one: the replay
    builds the rows without the held-out documents, and the epoch's rows are not those."""
    root, _ = corpus
    code, _, err = cli(
        "shuffle",
        root / "web",
        "-o",
        tmp_path / "run",
        "--seq-len",
        SEQ,
        "--seed",
        4,
        "--epochs",
        1,
        "--packing",
        "best-fit",
    )
    assert code == 0, err
    epoch = tmp_path / "run" / epoch_dir_name(0)
    m = read_manifest(epoch)
    write_manifest(
        epoch,
        {
            **m,
            "packing": {**m["packing"], "holdout": {"fraction": "1/10"}},
            "sources": [{**m["sources"][0], "held_documents": 16}],
        },
    )
    code, out, err = cli("validate", epoch, "--against", root / "web")
    assert code == 1 and "CORRUPT" in out + err


def test_a_schedule_keeps_its_holdout_across_stages(corpus, tmp_path):
    root, _ = corpus
    (tmp_path / "run.yaml").write_text(
        f"seq_len: {SEQ}\nseed: 3\npacking: best-fit\nstages:\n"
        f"  - {{name: a, epochs: 1, sources: {{{root / 'web'}: 1}}}}\n"
        f"  - {{name: b, tokens: 6K, sources: {{{root / 'web'}: 0.5, {root / 'code'}: 0.5}}}}\n"
    )
    code, out, err = cli(
        "shuffle", "--schedule", tmp_path / "run.yaml", "-o", tmp_path / "run", "--holdout", "5%", "--json"
    )
    assert code == 0, err
    sources = [PackedSource.open(root / n) for n in ("web", "code")]
    for e in (0, 1):
        m = read_manifest(tmp_path / "run" / epoch_dir_name(e))
        table = whole_table(packed_plan_from_manifest(m, sources), sources)
        for s in (0, 1):
            h = held_out(sources[s], {"fraction": "1/20"}, 3)
            assert not h.is_held(table["doc"][table["source"] == s].astype(np.int64)).any()
    code, out, err = cli("validate", tmp_path / "run", "--against", root / "web", "--against", root / "code")
    assert code == 0, out + err


def test_holdout_is_refused_where_it_cannot_hold(corpus, tmp_path):
    root, _ = corpus
    code, _, err = cli(
        "shuffle",
        root / "web",
        "-o",
        tmp_path / "w",
        "--seq-len",
        SEQ,
        "--seed",
        1,
        "--epochs",
        1,
        "--packing",
        "best-fit",
        "--holdout",
        "2",
    )
    assert code == 0, err  # 2 tokens: the first document in the holdout's order
    code, _, err = cli(
        "shuffle",
        root / "web",
        "-o",
        tmp_path / "x",
        "--seq-len",
        SEQ,
        "--seed",
        1,
        "--epochs",
        1,
        "--packing",
        "best-fit",
        "--holdout",
        "1T",
    )
    assert code == 1 and "would hold out every document" in err
    assert not (tmp_path / "x").exists()


def test_the_held_out_documents_are_written_once_as_an_epoch_directory(corpus, tmp_path):
    root, docs = corpus
    run = tmp_path / "run"
    args = [
        f"{root / 'web'}=0.7",
        f"{root / 'code'}=0.3",
        "-o",
        run,
        "--seq-len",
        SEQ,
        "--seed",
        4,
        "--packing",
        "best-fit",
        "--holdout",
        "10%",
        "--samples",
        300,
    ]
    code, out, err = cli("shuffle", *args, "--epochs", 1, "--json")
    assert code == 0, err
    result = json.loads(out)
    held_dir = run / "holdout"
    assert result["holdout"]["path"] == str(held_dir) and result["holdout"]["samples"] > 0
    m = read_manifest(held_dir)
    assert m["kind"] == "epoch" and m["packing"]["split"] == "holdout"
    sources = [PackedSource.open(root / n) for n in ("web", "code")]
    table = whole_table(packed_plan_from_manifest(m, sources), sources)
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
    code = (
        "import json\nfrom datatrove.utils.dataset import DatatroveFolderDataset\n"
        f"ds = DatatroveFolderDataset({str(held_dir)!r}, {SEQ}, filename_pattern='*.ds', token_size=2)\n"
        "print(len(ds), json.dumps(ds[0]['input_ids'].tolist()))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    n, first = r.stdout.split(" ", 1)
    assert int(n) == m["samples"] and json.loads(first) == reader.read(0)[0].tolist()
    code, out, err = cli("inspect", run, "--json")
    assert code == 0, err
    assert json.loads(out)["holdout"]["samples"] == m["samples"]
    assert [s["held_documents"] for s in json.loads(out)["holdout"]["sources"]] == [
        held_out(src, {"fraction": "1/10"}, 4).held for src in sources
    ]
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
    args = [
        root / "web",
        "-o",
        tmp_path / "run",
        "--seq-len",
        SEQ,
        "--seed",
        4,
        "--epochs",
        1,
        "--packing",
        "best-fit",
        "--holdout",
        "3K",
    ]
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


# ---------------------------------------------------------------------- concat (the default packing)
#
# Document i of source "a" is tokens 1 + i (its length varies) then EOS; source "b"'s are
# 1001 + i: every token but EOS names its document, so an epoch's content is checked by value.


def _named_docs(first: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.append(np.full(int(rng.integers(5, 140)), first + i, dtype=np.int64), EOS) for i in range(n)]


@pytest.fixture(scope="module")
def named(tmp_path_factory):
    root = tmp_path_factory.mktemp("holdout_concat")
    docs = {"a": _named_docs(1, 300, 11), "b": _named_docs(1001, 120, 12)}
    for name, d in docs.items():
        write_source(root / name, d, vocab_size=2000, docs_per_shard=70)
    return root, docs


def _held_values(root, docs, spec, seed) -> dict[str, set]:
    """Per source, the token values of its held-out documents (the one rule, Holdout.is_held)."""
    out = {}
    for name, first in (("a", 1), ("b", 1001)):
        h = held_out(PackedSource.open(root / name), spec, seed)
        assert h.held > 0
        out[name] = {first + int(i) for i in h.held_documents()}
    return out


def _values(folder: Path) -> set:
    return set(
        np.concatenate([np.fromfile(folder / s["path"], "<u2") for s in read_manifest(folder)["shards"]]).tolist()
    ) - {EOS}


def _windows(stream: np.ndarray, offset: int, row: int, w: int) -> list[bytes]:
    return sorted(stream[offset + k * row : offset + (k + 1) * row].astype("<u2").tobytes() for k in range(w))


def _rows(folder: Path) -> list[bytes]:
    row = (SEQ + 1) * 2
    data = b"".join(rows_of(folder))
    return sorted(data[i : i + row] for i in range(0, len(data), row))


def _tree(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and ".tokpack-work" not in p.parts
    }


def test_concat_windows_are_cut_from_the_stream_of_the_kept_documents(named, tmp_path):
    """A whole-pass epoch holds exactly the windows of each source's kept documents, concatenated
    (Megatron's --split), with jitter; RUN/holdout/ exactly those of the held-out documents; no
    token of a held-out document is in any training epoch; validate --against proves both."""
    root, docs = named
    run = tmp_path / "run"
    code, out, err = cli(
        "shuffle",
        root / "a",
        "-o",
        run,
        "--seq-len",
        SEQ,
        "--seed",
        5,
        "--epochs",
        2,
        "--jitter",
        "--holdout",
        "5%",
        "--json",
    )
    assert code == 0, err
    held = _held_values(root, docs, {"fraction": "1/20"}, 5)["a"]
    a = PackedSource.open(root / "a")
    h = held_out(a, {"fraction": "1/20"}, 5)
    kept_stream = np.concatenate([d for i, d in enumerate(docs["a"]) if i + 1 not in held])
    held_stream = np.concatenate([d for i, d in enumerate(docs["a"]) if i + 1 in held])
    for e in (0, 1):
        epoch = run / epoch_dir_name(e)
        m = read_manifest(epoch)
        src = m["sources"][0]
        assert m["holdout"] == {"fraction": "1/20"} and "packing" not in m  # windows: no padding, no .ds.pad
        assert (src["documents"], src["held_documents"], src["tokens"], src["held_tokens"]) == (
            len(docs["a"]),
            h.held,
            len(kept_stream),
            len(held_stream),
        )
        assert _values(epoch).isdisjoint(held) and _values(epoch)  # by content: no held-out token
        assert src["windows"] == (len(kept_stream) - SEQ) // (SEQ + 1)  # jitter: W_s of the stream's tokens
        assert _rows(epoch) == _windows(kept_stream, src["offset"], SEQ + 1, src["windows"])  # all of the kept stream's
    assert (
        read_manifest(run / epoch_dir_name(0))["sources"][0]["offset"]
        != read_manifest(run / epoch_dir_name(1))["sources"][0]["offset"]
    )  # jitter moved the windows
    hm = read_manifest(run / "holdout")
    assert hm["holdout"] == {"fraction": "1/20", "split": "holdout"} and hm["sources"][0]["offset"] == 0
    assert _values(run / "holdout") <= held and _rows(run / "holdout") == _windows(
        held_stream, 0, SEQ + 1, len(held_stream) // (SEQ + 1)
    )
    assert read_manifest(run)["holdout"] == {"fraction": "1/20"}
    code, out, err = cli("validate", run, "--against", root / "a")
    assert code == 0 and f"OK epoch {run / 'holdout'}" in out, out + err


def test_concat_holdout_reads_like_an_epoch(named, tmp_path):
    root, docs = named
    run = tmp_path / "run"
    code, out, err = cli(
        "shuffle", root / "a", root / "b", "-o", run, "--seq-len", SEQ, "--seed", 2, "--epochs", 1, "--holdout", "10%"
    )
    assert code == 0, err
    n = read_manifest(run / "holdout")["samples"]
    assert f"holdout: {n} samples of held-out documents in {run / 'holdout'} (read it as an epoch" in out
    from tokpack.loader.reader import SampleReader

    held_dir = run / "holdout"
    m = read_manifest(held_dir)
    reader = SampleReader.open(held_dir)
    assert reader.total_samples == m["samples"] == sum(s["samples"] for s in m["sources"]) > 0
    values = _held_values(root, docs, {"fraction": "1/10"}, 2)
    assert set(reader.read(0, m["samples"]).reshape(-1).tolist()) - {EOS} <= values["a"] | values["b"]
    code = (
        "import json\nfrom datatrove.utils.dataset import DatatroveFolderDataset\n"
        f"ds = DatatroveFolderDataset({str(held_dir)!r}, {SEQ}, filename_pattern='*.ds', token_size=2)\n"
        "print(len(ds), json.dumps(ds[0]['input_ids'].tolist()))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    n, first = r.stdout.split(" ", 1)
    assert int(n) == m["samples"] and json.loads(first) == reader.read(0)[0].tolist()
    code, out, err = cli("inspect", run, "--json")
    assert code == 0 and json.loads(out)["holdout"]["samples"] == m["samples"], err
    assert json.loads(out)["batch_diversity"]["document_identity"] == "plan"  # each sample found in its stream


@pytest.mark.parametrize("memory", ["64MiB", "1MiB"])  # in memory, and out of core (several buckets)
def test_concat_holdout_is_deterministic_on_one_and_two_workers(named, tmp_path, memory):
    root, _ = named
    trees = []
    for workers in (1, 2):
        run = tmp_path / f"run{workers}"
        code, out, err = cli(
            "shuffle",
            f"{root / 'a'}=0.6",
            f"{root / 'b'}=0.4",
            "-o",
            run,
            "--seq-len",
            SEQ,
            "--seed",
            9,
            "--epochs",
            2,
            "--holdout",
            "3K",
            "--samples",
            400,
            "--memory",
            memory,
            "--shard-samples",
            150,
            "--workers",
            workers,
            "--json",
        )
        assert code == 0, err
        trees.append(_tree(run))
    assert trees[0] == trees[1] and any(k.startswith("holdout/") for k in trees[0])


def test_concat_holdout_with_weights_and_a_rerun_and_like(named, tmp_path):
    """Weights over the kept windows; a rerun with another holdout, or none, is another run;
    --like adds an epoch byte for byte as the full command writes it."""
    root, docs = named
    run = tmp_path / "run"
    args = [
        f"{root / 'a'}=0.7",
        f"{root / 'b'}=0.3",
        "-o",
        run,
        "--seq-len",
        SEQ,
        "--seed",
        4,
        "--samples",
        500,
        "--holdout",
        "4%",
    ]
    code, out, err = cli("shuffle", *args, "--epochs", 2, "--json")
    assert code == 0, err
    values = _held_values(root, docs, {"fraction": "1/25"}, 4)
    for e in (0, 1):
        m = read_manifest(run / epoch_dir_name(e))
        assert [s["samples"] for s in m["sources"]] == [350, 150]  # the weights' shares
        assert _values(run / epoch_dir_name(e)).isdisjoint(values["a"] | values["b"])
    code, out, err = cli("validate", run, "--against", root / "a", "--against", root / "b")
    assert code == 0, out + err
    for other in (["--holdout", "5%"], []):
        code, _, err = cli("shuffle", *args[:-2], *other, "--epoch", 2)
        assert code == 1 and "different run" in err and "holdout" in err and "\n" not in err.strip(), err
    code, _, err = cli("shuffle", "--like", run, "--epoch", 2)
    assert code == 0, err
    ref = tmp_path / "ref"
    code, _, err = cli("shuffle", *args[:2], "-o", ref, *args[4:], "--epoch", 2)
    assert code == 0, err
    assert _tree(run / epoch_dir_name(2)) == _tree(ref / epoch_dir_name(2))
    assert read_manifest(run / epoch_dir_name(2))["holdout"] == {"fraction": "1/25"}


def test_concat_holdout_keeps_across_a_two_stage_schedule(named, tmp_path):
    root, docs = named
    (tmp_path / "run.yaml").write_text(
        f"seq_len: {SEQ}\nseed: 3\nstages:\n"
        f"  - {{name: a, epochs: 1, sources: {{{root / 'a'}: 1}}}}\n"
        f"  - {{name: b, tokens: 20K, sources: {{{root / 'a'}: 0.5, {root / 'b'}: 0.5}}}}\n"
    )
    run = tmp_path / "run"
    code, out, err = cli("shuffle", "--schedule", tmp_path / "run.yaml", "-o", run, "--holdout", "5%", "--json")
    assert code == 0, err
    values = _held_values(root, docs, {"fraction": "1/20"}, 3)
    for e in (0, 1):
        m = read_manifest(run / epoch_dir_name(e))
        assert m["holdout"] == {"fraction": "1/20"} and [s["held_documents"] for s in m["sources"]] == [
            held_out(PackedSource.open(root / n), {"fraction": "1/20"}, 3).held for n in ("a", "b")
        ]
        assert _values(run / epoch_dir_name(e)).isdisjoint(values["a"] | values["b"])
    assert read_manifest(run / epoch_dir_name(1))["sources"][1]["samples"] > 0
    code, out, err = cli("validate", run, "--against", root / "a", "--against", root / "b")
    assert code == 0, out + err
    code, _, err = cli("shuffle", "--schedule", tmp_path / "run.yaml", "-o", run)  # without its holdout
    assert code == 1 and "different run" in err and "holdout" in err


def test_validate_against_catches_a_concat_epoch_that_holds_a_held_out_document(named, tmp_path, monkeypatch):
    """A mutant stream that reads the source's raw tokens at the stream's offsets (the gaps not
    skipped): its epochs' manifests are exactly the right ones, its bytes hold held-out
    documents, and the replay says so."""
    from tokpack.shuffle import holdout as holdout_mod

    root, docs = named
    run = tmp_path / "run"
    with monkeypatch.context() as mp:
        mp.setattr(holdout_mod.KeptStream, "raw_pieces", lambda self, start, count: iter([(start, 0, count)]))
        code, _, err = cli(
            "shuffle", root / "a", "-o", run, "--seq-len", SEQ, "--seed", 5, "--epochs", 1, "--holdout", "5%"
        )
    assert code == 0, err
    held = _held_values(root, docs, {"fraction": "1/20"}, 5)["a"]
    assert not _values(run / epoch_dir_name(0)).isdisjoint(held)  # the mutant did put one in
    code, out, err = cli("validate", run / epoch_dir_name(0))
    assert code == 0, out + err  # its own checksums agree: only the replay can tell
    code, out, err = cli("validate", run / epoch_dir_name(0), "--against", root / "a")
    assert code == 1 and "CORRUPT" in out + err and "multiset" in out + err, out + err
    # and a manifest that claims fewer held-out documents than the run's --holdout is refused by name
    m = read_manifest(run / epoch_dir_name(0))
    write_manifest(run / epoch_dir_name(0), {**m, "sources": [{**m["sources"][0], "held_documents": 1}]})
    code, out, err = cli("validate", run / epoch_dir_name(0), "--against", root / "a")
    assert code == 1 and "held_documents" in out + err, out + err


def test_concat_holdout_misuse_is_one_line(named, tmp_path):
    root, _ = named
    base = [root / "a", "-o", tmp_path / "r", "--seq-len", SEQ, "--seed", 1, "--epochs", 1]
    code, _, err = cli("shuffle", *base, "--holdout", "1T")
    assert code == 1 and "would hold out every document" in err and not (tmp_path / "r").exists()
    code, _, err = cli(
        "shuffle", *base, "--holdout", "2%", "--to-nodes", tmp_path / "dest", "--ranks-per-node", 1, "--micro-batch", 1
    )
    assert code == 2 and "--to-nodes does not write a held-out split" in err and not (tmp_path / "r").exists()
    code, _, err = cli("shuffle", *base, "--holdout", "2%")
    assert code == 0, err
    code, _, err = cli(
        "shuffle",
        "--like",
        tmp_path / "r",
        "--epoch",
        1,
        "--to-nodes",
        tmp_path / "dest",
        "--ranks-per-node",
        1,
        "--micro-batch",
        1,
    )
    assert code == 2 and "--to-nodes does not write a held-out split" in err
    code, _, err = cli(
        "shuffle", *base[:-2], "--epoch", 1, "--to-nodes", tmp_path / "dest", "--ranks-per-node", 1, "--micro-batch", 1
    )  # into the run, without its holdout: another run
    assert code == 1 and "different run" in err and "[holdout]" in err and not (tmp_path / "dest").exists()
    code, _, err = cli(
        "shuffle", root / "a", "-o", tmp_path / "few", "--seq-len", 1000, "--seed", 1, "--epochs", 1, "--holdout", "2"
    )  # one document, of at most 140 tokens
    assert code == 1 and "fewer tokens of a source than one window" in err and "\n" not in err.strip()
    assert not (tmp_path / "few").exists()
    planned = [*base[:2], tmp_path / "p", *base[3:], "--holdout", "2%"]
    code, out, err = cli("plan", "shuffle", *planned, "--disk-mbps", 100, "--json")
    assert code == 0, err
    code, written, err = cli("shuffle", *planned, "--json")
    assert code == 0, err
    assert json.loads(out)["holdout"]["samples"] == json.loads(written)["holdout"]["samples"] > 0
    code, _, err = cli(
        "plan",
        "shuffle",
        "virtual:tokens=1M,documents=1K,dtype=uint16",
        "-o",
        tmp_path / "v",
        "--seq-len",
        SEQ,
        "--seed",
        1,
        "--epochs",
        1,
        "--holdout",
        "2%",
        "--disk-mbps",
        100,
    )
    assert code == 1 and "--holdout needs the documents of the source" in err


def test_a_packing_without_a_holdout_plan_refuses_holdout_in_one_line(named, tmp_path):
    """A registered packing whose entry has no `holdout` plan cannot leave documents out."""
    from dataclasses import replace

    from tokpack.shuffle import packings

    root, _ = named
    packings.register(replace(packings.WINDOWS, name="no-holdout", shuffle="test-no-holdout-v1", holdout=None))
    try:
        code, _, err = cli(
            "shuffle",
            root / "a",
            "-o",
            tmp_path / "r",
            "--seq-len",
            SEQ,
            "--seed",
            1,
            "--epochs",
            1,
            "--packing",
            "no-holdout",
            "--holdout",
            "1%",
        )
    finally:
        packings.unregister("no-holdout")
    assert code == 1 and "no-holdout packing cannot" in err and "--packing concat or best-fit" in err, err
    assert "\n" not in err.strip() and not (tmp_path / "r").exists()


@pytest.mark.parametrize("split", [False, True])
def test_a_kept_stream_reads_as_the_concatenation_of_its_documents(tmp_path, split):
    """KeptStream against the plain concatenation, at random ranges, over shards of 3 documents
    with half of them held out (some shards keep none, or only held-out ones)."""
    from tokpack.shuffle.holdout import KeptStream

    docs = _named_docs(1, 40, 21)
    write_source(tmp_path / "s", docs, vocab_size=2000, docs_per_shard=3)
    src = PackedSource.open(tmp_path / "s")
    h = held_out(src, {"fraction": "1/2"}, 8)
    h = Holdout(h.documents, h.held, h.seed, h.fingerprint, split)
    held = set(h.held_documents().tolist())
    want = np.concatenate([d for i, d in enumerate(docs) if (i in held) == split])
    stream = KeptStream(src, h)
    assert stream.tokens == len(want) and 0 in np.diff(stream.shard_starts)  # a shard with nothing in the stream
    rng = np.random.default_rng(3)
    for _ in range(200):
        a = int(rng.integers(0, len(want)))
        n = int(rng.integers(0, len(want) - a + 1))
        out = np.empty(n, dtype=src.dtype)
        assert np.array_equal(stream.read_into(a, out), want[a : a + n])
        pieces = list(stream.raw_pieces(a, n))  # increasing raw ranges that tile the request
        assert [x for _, x, _ in pieces] == [0, *[y for _, _, y in pieces[:-1]]][: len(pieces)]
        assert (pieces[-1][2] if pieces else 0) == n
        assert all(r1 >= r0 + (y0 - x0) for (r0, x0, y0), (r1, _, _) in zip(pieces, pieces[1:]))
    with pytest.raises(IndexError):
        stream.read_into(len(want) - 1, np.empty(2, dtype=src.dtype))


@pytest.mark.parametrize("packing", ["concat", "best-fit"])
def test_a_copy_of_the_run_brings_its_holdout_and_a_rank_copy_does_not(corpus, tmp_path, packing):
    """`stage RUN DEST` (a copy of the run, or of some of its epochs) copies RUN/holdout/ too,
    verified, so eval reads it beside the training epochs; `--shards-of` (a training rank's
    shards) leaves it. A rerun finds it in place."""
    root, _ = corpus
    run, dest = tmp_path / "run", tmp_path / "dest"
    code, _, err = cli(
        "shuffle",
        root / "web",
        root / "code",
        "-o",
        run,
        "--seq-len",
        SEQ,
        "--seed",
        3,
        "--epochs",
        2,
        "--holdout",
        "10%",
        "--packing",
        packing,
    )
    assert code == 0, err
    code, out, err = cli("stage", run, dest, "--epochs", "1", "--json")
    assert code == 0, err
    assert json.loads(out)["epochs"] == [1]  # the held-out folder is not a training epoch
    held = sorted(p.name for p in (run / "holdout").iterdir())
    assert sorted(p.name for p in (dest / "holdout").iterdir()) == held and "tokpack.json" in held
    for name in held:
        assert (dest / "holdout" / name).read_bytes() == (run / "holdout" / name).read_bytes(), name
    code, out, err = cli("validate", dest)
    assert code == 0 and "0 problems" in out, out + err
    damaged = next(p for p in (dest / "holdout").glob("*.ds"))
    damaged.write_bytes(bytes([damaged.read_bytes()[0] ^ 1]) + damaged.read_bytes()[1:])
    code, out, err = cli("stage", run, dest, "--epochs", "1", "--json")  # a rerun: verified, the damaged file recopied
    assert code == 0 and json.loads(out)["copied_files"] == 1, out + err
    assert damaged.read_bytes() == (run / "holdout" / damaged.name).read_bytes()
    code, _, err = cli("stage", run, tmp_path / "ranks", "--shards-of", "0/2", "--micro-batch", 2)
    assert code == 0, err
    assert not (tmp_path / "ranks" / "holdout").exists()


@pytest.mark.parametrize("packing", ["concat", "best-fit"])
def test_read_names_the_held_out_split_not_epoch_0(corpus, tmp_path, packing):
    """`tokpack read RUN/holdout` labelled its rows "epoch 0 sample S" (its manifest's epoch
    number), as if the held-out split were the run's first epoch, and past its end said "write
    more epochs": it is no epoch. Its rows are now "held-out split sample S", its JSON adds
    "split": "holdout" (as inspect's), and its end says no command adds to it. The run's own
    epoch 0 reads as before."""
    root, _ = corpus
    run = tmp_path / "run"
    code, _, err = cli(
        "shuffle", root / "web", "-o", run, "--seq-len", SEQ, "--seed", 4, "--epochs", 1, "--holdout", "10%",
        "--packing", packing,
    )  # fmt: skip
    assert code == 0, err
    n = read_manifest(run / "holdout")["samples"]
    code, out, err = cli("read", run / "holdout", "--count", 2)
    assert code == 0 and out.startswith("held-out split sample 0 rank 0: [") and "epoch" not in out, (out, err)
    code, out, err = cli("read", run / "holdout", "--count", 1, "--json")
    first = json.loads(out)
    assert code == 0 and first["split"] == "holdout" and first["sample"] == 0, out
    code, out, err = cli("read", run / "holdout", "--start-sample", n + 5)
    assert code == 1 and "write more epochs" not in err and f"held-out split ends at sample {n:,}" in err, err
    code, out, err = cli("read", run, "--count", 1, "--json")
    assert code == 0 and "split" not in json.loads(out) and json.loads(out)["epoch"] == 0, out
    code, out, err = cli("read", run, "--count", 1)
    assert code == 0 and out.startswith("epoch 0 sample 0 rank 0: ["), out


def _with_holdout_of(run: Path, other: Path, into: Path) -> Path:
    """`run` copied to `into`, its holdout/ replaced by `other`'s (or added, when it had none)."""
    import shutil

    shutil.copytree(run, into)
    shutil.rmtree(into / "holdout", ignore_errors=True)
    shutil.copytree(other / "holdout", into / "holdout")
    return into


@pytest.mark.parametrize(
    "ours, theirs, where",
    [
        (["--seed", 4], ["--seed", 5], "[seed]"),  # another seed: other documents held out
        (["--seed", 4], ["--seed", 4, "--holdout", "20%"], "[holdout]"),
        (
            ["--seed", 4, "--packing", "best-fit"],
            ["--seed", 4, "--packing", "best-fit", "--pad-id", 3],
            "[packing.pad_id]",
        ),
        (["--seed", 4, "--holdout", None], ["--seed", 4], "[holdout]"),  # a run without one: a stray split
    ],
)
def test_validate_and_stage_refuse_a_holdout_of_another_run(corpus, tmp_path, ours, theirs, where):
    """RUN/holdout/ copied in from another run is well formed, so it passed validate (and was
    staged beside the run's epochs) though its documents are not the ones this run held out:
    eval on it measures documents the run trained on. Validate names the field, stage refuses
    before writing, the run's own split still passes."""
    root, _ = corpus

    def shuffle(args, out):
        opts = {"--holdout": "10%", **dict(zip(args[::2], args[1::2]))}
        flat = [str(x) for k, v in opts.items() if v is not None for x in (k, v)]
        code, _, err = cli("shuffle", root / "web", "-o", out, "--seq-len", SEQ, "--samples", 100, "--epochs", 1, *flat)
        assert code == 0, err
        return out

    run, other = shuffle(ours, tmp_path / "ours"), shuffle(theirs, tmp_path / "theirs")
    if (run / "holdout").exists():
        code, out, err = cli("validate", run)
        assert code == 0, out + err
    mixed = _with_holdout_of(run, other, tmp_path / "mixed")
    code, out, err = cli("validate", mixed)
    lines = [ln for ln in (out + err).splitlines() if ln.startswith("CORRUPT /")]
    assert code == 1 and len(lines) == 1, out + err
    assert f"{mixed / 'holdout' / 'tokpack.json'} {where}" in lines[0] and "HINT:" in lines[0]
    fix = f"tokpack shuffle --like {mixed} --epoch 0" if (run / "holdout").exists() else "without --holdout"
    assert fix in lines[0]
    if (run / "holdout").exists():  # stage copies the split only of a run that records one
        code, out, err = cli("stage", mixed, tmp_path / "staged")
        assert code == 1 and where in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "staged").exists()
