"""`tokpack pack`: round trips from every input format, written by real writers (datatrove's
DocumentTokenizer / DocumentTokenizerMerger / MegatronDocumentTokenizer, megatron-core's
IndexedDatasetBuilder, pyarrow, HF datasets, numpy), worker-count independence, resume,
and every bad-input case of issue 2 through the CLI."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import EOS_TOKEN, generate_texts, random_docs, require
from tokpack.formats import outputs
from tokpack.formats.errors import TokpackError
from tokpack.formats.constants import MANIFEST
from tokpack.formats.shards import PackedSource
from tokpack.packer.cli import main
from tokpack.packer import packing
from conftest import pack

MEGATRON_CORE = "pip install -e '.[test]' installs megatron-core"
SMALL_BLOCK = 512  # bytes: forces many blocks per file, so block seams are exercised


def cli(*args):
    return CliRunner().invoke(main, ["pack", *map(str, args)])


def packed_docs(out) -> list[list[int]]:
    """Every document of the packed source `out`, in stream order: its tokens cut at its shards' index entries."""
    src = PackedSource.open(out)
    tokens = src.read_into(0, np.empty(src.tokens, src.dtype)).tolist()
    ends = [0, *(int(src.shard_starts[i]) + end for i in range(len(src.shards)) for end in src.doc_ends(i).tolist())]
    return [tokens[a:b] for a, b in zip(ends, ends[1:])]


def write_text_jsonl(folder: Path, files: int, docs: int, seed: int = 0, words=None) -> list[list[str]]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for k in range(files):
        texts = generate_texts(docs, seed=seed + k, max_words=60)
        if words is not None:
            rng = np.random.default_rng(seed + k)
            texts = [" ".join(words[i] for i in rng.integers(0, len(words), rng.integers(1, 40))) for _ in range(docs)]
        with open(folder / f"part{k}.jsonl", "w") as f:
            for i, t in enumerate(texts):
                f.write(json.dumps({"text": t, "id": f"{k}-{i}"}) + "\n")
        out.append(texts)
    return out


def dt_tokenize(text_dir: Path, out: Path, tokenizer, **kw) -> Path:
    """datatrove's own reader and tokenizer, one rank per JSONL file, as an executor would run them."""
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens.tokenizer import DocumentTokenizer

    files = sorted(p.name for p in text_dir.glob("*.jsonl"))
    for rank, name in enumerate(files):
        reader = JsonlReader(str(text_dir), glob_pattern=name)
        DocumentTokenizer(str(out), tokenizer_name_or_path=str(tokenizer), eos_token=EOS_TOKEN, **kw).run(
            reader.run(None, 0, 1), rank=rank, world_size=len(files)
        )
    return out


def read_dt_folder(folder: Path) -> list[list[int]]:
    """The documents of a datatrove folder, read straight from its files (name order)."""
    docs = []
    for ds in sorted(folder.glob("*.ds")):
        size = int(Path(f"{ds}.metadata").read_text().split("\n")[0].rsplit("|", 1)[1])
        tokens = np.fromfile(ds, dtype="<u2" if size == 2 else "<u4")
        prev = 0
        for end in np.fromfile(f"{ds}.index", dtype="<u8").tolist():
            docs.append(tokens[prev:end].tolist())
            prev = end
    return docs


def encode_all(tokenizer_path, texts: list[str]) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    eos = tok.token_to_id(EOS_TOKEN)
    return [tok.encode(t).ids + [eos] for t in texts]


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_path):
    """4 JSONL text files and their datatrove tokenizations (shuffled and unshuffled)."""
    root = tmp_path_factory.mktemp("corpus")
    texts = write_text_jsonl(root / "text", files=4, docs=25)
    shuffled = dt_tokenize(root / "text", root / "dt", tokenizer_path, seed=3)
    plain = dt_tokenize(
        root / "text", root / "dt_plain", tokenizer_path, shuffle_documents=False, save_loss_metadata=True
    )
    return {"root": root, "texts": texts, "dt": shuffled, "dt_plain": plain}


# ------------------------------------------------------------------------ datatrove


def test_datatrove_doc_shuffled_round_trip(corpus, tokenizer_path, tmp_path):
    dt = corpus["dt"]
    assert sorted(p.name for p in dt.glob("*.ds"))[0] == "00000_00000_doc_shuffled.ds"
    res = cli(dt, "-o", tmp_path / "out", "--shard-tokens", 700, "--json")
    assert res.exit_code == 0, res.output + res.stderr
    summary = json.loads(res.stdout)
    written = read_dt_folder(dt)
    assert packed_docs(tmp_path / "out") == written
    assert sorted(written) == sorted(encode_all(tokenizer_path, sum(corpus["texts"], [])))
    m = json.loads((tmp_path / "out" / MANIFEST).read_text())
    from tokenizers import Tokenizer

    assert m["vocab_size"] == Tokenizer.from_file(str(tokenizer_path)).get_vocab_size()  # from the metadata's tokenizer
    assert (m["eos_id"], m["dtype"], summary["format"], summary["eos_appended"]) == (0, "uint16", "datatrove", 0)
    assert summary["tokens"] == sum(map(len, written)) and summary["shards"] == len(m["shards"]) > 4
    for s in m["shards"]:  # at most --shard-tokens, unless one document is larger
        assert s["tokens"] <= 700 or s["documents"] == 1
    # a shard never spans input files: each input's documents are a run of whole shards
    per_input = [len(np.fromfile(f"{p}.index", dtype="<u8")) for p in sorted(dt.glob("*.ds"))]
    bounds = set(np.cumsum([s["documents"] for s in m["shards"]]).tolist())
    assert set(np.cumsum(per_input).tolist()) <= bounds


def test_datatrove_unshuffled_and_merger_keep_order(corpus, tokenizer_path, tmp_path):
    from datatrove.pipeline.tokens.merger import DocumentTokenizerMerger

    plain = corpus["dt_plain"]
    assert sorted(p.name for p in plain.glob("*.ds"))[0] == "00000_unshuffled.ds"
    expected = encode_all(tokenizer_path, sum(corpus["texts"], []))
    pack([str(plain)], str(tmp_path / "a"), block_bytes=SMALL_BLOCK, shard_tokens=1000)
    assert packed_docs(tmp_path / "a") == expected
    src = PackedSource.open(tmp_path / "a")
    loss = b"".join((tmp_path / "a" / f"{s['path']}.loss").read_bytes() for s in src.shards)
    assert loss == b"\x01" * src.tokens  # datatrove wrote ones; carried along per token
    merged = tmp_path / "merged"
    DocumentTokenizerMerger(
        str(plain), str(merged), save_filename="name", shuffle=False, max_tokens_per_file=1500, progress=False
    ).run()
    assert sorted(p.name for p in merged.glob("*.ds"))[0] == "000_name.ds"
    pack([str(merged)], str(tmp_path / "b"))
    assert packed_docs(tmp_path / "b") == expected


def test_datatrove_uint32(tmp_path):
    """A >65536-word vocabulary makes datatrove write uint32 tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(70000)]
    tok = Tokenizer(
        models.WordLevel({EOS_TOKEN: 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([EOS_TOKEN])
    tok_path = tmp_path / "big.json"
    tok.save(str(tok_path))
    texts = write_text_jsonl(tmp_path / "text", files=2, docs=20, words=words[-500:])
    dt = dt_tokenize(tmp_path / "text", tmp_path / "dt", tok_path, shuffle_documents=False)
    assert (dt / "00000_unshuffled.ds.metadata").read_text().split("\n")[0].endswith("|4")
    summary = pack([str(dt)], str(tmp_path / "out"), block_bytes=SMALL_BLOCK)
    assert summary.dtype == "uint32" and summary.vocab_size == 70002
    assert packed_docs(tmp_path / "out") == encode_all(tok_path, sum(texts, []))
    assert max(max(d) for d in packed_docs(tmp_path / "out")) > 65536


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(block=st.integers(2, 5000), shard=st.integers(1, 4000))
def test_output_independent_of_block_size(corpus, tmp_path_factory, block, shard):
    """Memory (the read block) never changes the bytes; shards respect --shard-tokens."""
    tmp = tmp_path_factory.mktemp("blocks")
    pack([str(corpus["dt"])], str(tmp / "a"), shard_tokens=shard, block_bytes=block)
    pack([str(corpus["dt"])], str(tmp / "b"), shard_tokens=shard)
    assert tree_bytes(tmp / "a") == tree_bytes(tmp / "b")
    assert packed_docs(tmp / "a") == read_dt_folder(corpus["dt"])
    for s in json.loads((tmp / "a" / MANIFEST).read_text())["shards"]:
        assert s["tokens"] <= shard or s["documents"] == 1


def test_packed_source_read_by_datatrove_folder_dataset(corpus, tmp_path):
    from datatrove.utils.dataset import DatatroveFolderDataset

    pack([str(corpus["dt"])], str(tmp_path / "out"), shard_tokens=900)
    seq = 32
    ds = DatatroveFolderDataset(str(tmp_path / "out"), seq_len=seq, token_size=2, recursive=False)
    got = np.concatenate([ds[i]["input_ids"].numpy() for i in range(len(ds))])
    src = PackedSource.open(tmp_path / "out")
    expected = []
    for s in src.shards:  # datatrove cuts seq_len+1 windows per file
        t = np.fromfile(tmp_path / "out" / s["path"], dtype="<u2")
        expected.append(t[: len(t) // (seq + 1) * (seq + 1)])
    assert len(ds) > 10 and np.array_equal(got, np.concatenate(expected))


def test_link_of_datatrove_tokenizer_output(corpus, tmp_path):
    """What datatrove's DocumentTokenizer writes (EOS on every document, a loss mask beside it)
    is linked whole by pack --link, and the result is a copying pack's, byte for byte."""
    for name in ("dt", "dt_plain"):
        assert cli(corpus[name], "-o", tmp_path / f"{name}-copy").exit_code == 0
        res = cli(corpus[name], "-o", tmp_path / f"{name}-link", "--link", "--json")
        assert res.exit_code == 0, res.output
        summary = json.loads(res.stdout)
        assert tree_bytes(tmp_path / f"{name}-copy") == tree_bytes(tmp_path / f"{name}-link")
        assert summary["link_notes"] == [] and summary["copied_bytes"] == 0
        assert summary["linked_files"] == (3 if name == "dt_plain" else 2) * len(list(corpus[name].glob("*.ds")))


def test_workers_give_identical_bytes(corpus, tmp_path):
    assert len(list(corpus["dt"].glob("*.ds"))) >= 4
    for w in (1, 4):
        res = cli(corpus["dt"], "-o", tmp_path / f"w{w}", "--shard-tokens", 500, "--workers", w, "--json")
        assert res.exit_code == 0, res.stderr
    assert tree_bytes(tmp_path / "w1") == tree_bytes(tmp_path / "w4")
    assert not (tmp_path / "w4" / ".tokpack-work").exists()


def test_killed_run_resumes_to_identical_output(corpus, tmp_path, monkeypatch):
    pack([str(corpus["dt"])], str(tmp_path / "ref"), shard_tokens=600)
    real = packing.PackStep.pack_file

    def dies_on_file_2(self, i):
        if i == 2:
            raise KeyboardInterrupt
        return real(self, i)

    monkeypatch.setattr(packing.PackStep, "pack_file", dies_on_file_2)
    with pytest.raises(KeyboardInterrupt):
        pack([str(corpus["dt"])], str(tmp_path / "out"), shard_tokens=600)
    work = tmp_path / "out" / ".tokpack-work"
    assert (work / "part-00001.json").exists() and not (tmp_path / "out" / MANIFEST).exists()
    assert not list((tmp_path / "out").glob("*.ds"))  # nothing under a final name
    done = (work / "part-00000" / "00000.ds").stat().st_mtime_ns
    monkeypatch.setattr(packing.PackStep, "pack_file", real)

    calls = []
    real_manifest = outputs.write_manifest  # pack's manifest is written by its Output

    def dies_before_manifest(*a, **kw):  # killed between the shard renames and tokpack.json
        calls.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(outputs, "write_manifest", dies_before_manifest)
    with pytest.raises(KeyboardInterrupt):
        pack([str(corpus["dt"])], str(tmp_path / "out"), shard_tokens=600)
    assert calls and (work / "finalize.json").exists()
    monkeypatch.setattr(outputs, "write_manifest", real_manifest)
    summary = pack([str(corpus["dt"])], str(tmp_path / "out"), shard_tokens=600)
    assert summary.status == "packed"
    assert tree_bytes(tmp_path / "ref") == tree_bytes(tmp_path / "out")
    assert not work.exists()
    # rerun of a complete pack: nothing redone
    again = cli(corpus["dt"], "-o", tmp_path / "out", "--shard-tokens", 600, "--json")
    assert again.exit_code == 0 and json.loads(again.stdout)["status"] == "already complete"
    assert (tmp_path / "out" / "00000.ds").stat().st_mtime_ns == done  # part 0 was reused, not rewritten


def test_overwrite_replaces_a_different_source(corpus, tmp_path):
    out = tmp_path / "out"
    assert cli(corpus["dt"], "-o", out).exit_code == 0
    res = cli(corpus["dt"], "-o", out, "--shard-tokens", 300)
    assert res.exit_code == 1 and "different packed source" in res.stderr
    res = cli(corpus["dt"], "-o", out, "--shard-tokens", 300, "--overwrite", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["status"] == "packed"
    assert json.loads((out / MANIFEST).read_text())["shard_tokens"] == 300


# ------------------------------------------------------------------------- megatron


def test_megatron_from_datatrove_writer(corpus, tokenizer_path, tmp_path):
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens.megatron_tokenizer import MegatronDocumentTokenizer

    text = corpus["root"] / "text"
    for rank, name in enumerate(sorted(p.name for p in text.glob("*.jsonl"))[:2]):
        MegatronDocumentTokenizer(
            str(tmp_path / "mg"), tokenizer_name_or_path=str(tokenizer_path), eos_token=EOS_TOKEN
        ).run(JsonlReader(str(text), glob_pattern=name).run(None, 0, 1), rank=rank, world_size=2)
    expected = encode_all(tokenizer_path, corpus["texts"][0] + corpus["texts"][1])
    summary = pack([str(tmp_path / "mg")], str(tmp_path / "a"), eos_id=0, vocab_size=600, block_bytes=SMALL_BLOCK)
    assert summary.format == "megatron" and packed_docs(tmp_path / "a") == expected
    pack([str(tmp_path / "mg" / "00000_tokens")], str(tmp_path / "b"), eos_id=0, vocab_size=600)  # a path prefix
    assert packed_docs(tmp_path / "b") == expected[:25]
    indexed = require("megatron.core.datasets.indexed_dataset", MEGATRON_CORE)
    mds = indexed.IndexedDataset(str(tmp_path / "mg" / "00000_tokens"))
    assert [mds[i].tolist() for i in range(len(mds))] == expected[:25]


MEGATRON_DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float64", "float32", "uint16"]


@pytest.mark.parametrize("dtype", MEGATRON_DTYPES)
def test_megatron_every_dtype_code(dtype, tmp_path):
    """megatron-core's own writer for every dtype code; documents of several sequences;
    megatron-core's reader cross-checks what we read."""
    idx_mod = require("megatron.core.datasets.indexed_dataset", MEGATRON_CORE)
    rng = np.random.default_rng(1)
    docs = []
    builder = idx_mod.IndexedDatasetBuilder(str(tmp_path / "d.bin"), dtype=getattr(np, dtype))
    for k in range(40):
        body = rng.integers(1, 120, size=int(rng.integers(0, 30))).tolist()
        doc = body + ([0] if k % 3 else [])  # every third document lacks EOS
        cut = len(doc) // 2
        builder.add_document(np.array(doc), [cut, len(doc) - cut] if k % 2 else [len(doc)])
        docs.append(doc)
    builder.finalize(str(tmp_path / "d.idx"))
    mds = idx_mod.IndexedDataset(str(tmp_path / "d"))
    di = mds.document_indices
    megatron_docs = [
        np.concatenate([mds[s] for s in range(di[d], di[d + 1])] or [np.zeros(0)]).tolist() for d in range(len(di) - 1)
    ]
    assert megatron_docs == docs
    summary = pack([str(tmp_path / "d")], str(tmp_path / "out"), eos_id=0, vocab_size=128, block_bytes=64)
    expected = [d if d[-1:] == [0] else d + [0] for d in docs if d]
    assert packed_docs(tmp_path / "out") == expected
    assert summary.empty_documents_dropped == sum(1 for d in docs if not d)
    assert summary.eos_appended == sum(1 for d in docs if d and d[-1] != 0)


@pytest.mark.parametrize("block", [16, 1 << 20], ids=["small-blocks", "one-block"])
def test_megatron_sequences_out_of_order(block, tmp_path):
    """A .bin whose sequences are not stored back to back (reversed, with gaps, one pair
    adjacent), as an .idx may legally point: pack reads each sequence at its pointer, and
    megatron-core's own reader agrees."""
    import struct

    indexed = require("megatron.core.datasets.indexed_dataset", MEGATRON_CORE)
    rng = np.random.default_rng(4)
    seqs = [rng.integers(1, 500, size=int(rng.integers(1, 12))).astype(np.uint16) for _ in range(9)]
    for k in (1, 4, 8):
        seqs[k][-1] = 0  # documents end at sequences 1, 4 and 8
    doc_index = [0, 2, 5, 9]
    blob, ptrs = b"", [0] * len(seqs)
    for k in [8, 7, 5, 6, 4, 3, 2, 1, 0]:  # 5 then 6 back to back, everything else reversed
        blob += b"\xff\xff" * int(rng.integers(0, 3)) if k != 6 else b""  # gaps of junk tokens
        ptrs[k] = len(blob)
        blob += seqs[k].tobytes()
    (tmp_path / "m.bin").write_bytes(blob)
    with open(tmp_path / "m.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(seqs), len(doc_index)))
        f.write(
            np.array([len(x) for x in seqs], dtype=np.int32).tobytes()
            + np.array(ptrs, dtype=np.int64).tobytes()
            + np.array(doc_index, dtype=np.int64).tobytes()
        )
    expected = [np.concatenate(seqs[a:b]).tolist() for a, b in zip(doc_index, doc_index[1:])]
    mds = indexed.IndexedDataset(str(tmp_path / "m"))
    assert [
        np.concatenate([mds[i] for i in range(a, b)]).tolist() for a, b in zip(doc_index, doc_index[1:])
    ] == expected
    pack([str(tmp_path / "m")], str(tmp_path / "out"), eos_id=0, vocab_size=500, block_bytes=block)
    assert packed_docs(tmp_path / "out") == expected


def megatron_core_docs(
    path: Path, docs: list[list[int]], split=lambda k, doc: [len(doc)], dtype=np.uint16, multimodal: bool = False
) -> Path:
    """`docs` written by megatron-core's own IndexedDatasetBuilder; `split(k, doc)` gives the
    sequence lengths of document k ([] = a document of no sequences)."""
    indexed = require("megatron.core.datasets.indexed_dataset", MEGATRON_CORE)
    builder = indexed.IndexedDatasetBuilder(f"{path}.bin", dtype=dtype, multimodal=multimodal)
    for k, doc in enumerate(docs):
        lengths = split(k, doc)
        builder.add_document(np.array(doc, dtype=dtype), lengths, modes=[k % 3] * len(lengths) if multimodal else None)
    builder.finalize(f"{path}.idx")
    return path


def test_megatron_index_read_in_chunks(monkeypatch, tmp_path):
    """Indexes longer than one chunk of entries are read chunk by chunk, in check and in read:
    a 3-entry chunk puts chunk seams inside documents of several sequences and between empty
    ones; the packed documents, the manifest's input size and the errors of later chunks are
    exactly those of one chunk."""
    from tokpack.formats.inputs import megatron_bin

    rng = np.random.default_rng(9)
    docs = [rng.integers(1, 120, size=int(rng.integers(0, 12))).tolist() + [0] * (k % 4 > 0) for k in range(40)]
    split = lambda k, doc: [] if not doc else [len(doc) // 2, len(doc) - len(doc) // 2] if k % 2 else [len(doc)]
    m = megatron_core_docs(tmp_path / "m", docs, split)
    expected = normalised(docs)
    monkeypatch.setattr(megatron_bin, "INDEX_CHUNK", 3)
    for block in (8, 64, 1 << 20):
        pack([str(m)], str(tmp_path / f"out{block}"), eos_id=0, vocab_size=128, block_bytes=block)
        assert packed_docs(tmp_path / f"out{block}") == expected
    manifest = json.loads((tmp_path / "out8" / MANIFEST).read_text())
    size = m.with_suffix(".bin").stat().st_size + m.with_suffix(".idx").stat().st_size
    assert manifest["inputs"] == [{"path": str(m.with_suffix(".bin")), "size": size, "format": "megatron"}]

    idx = m.with_suffix(".idx").read_bytes()
    sequences = int(np.frombuffer(idx, "<u8", count=1, offset=18)[0])
    size7 = int(np.frombuffer(idx, "<i4", count=1, offset=34 + 4 * 7)[0])
    bad = bytearray(idx)
    at = 34 + 4 * sequences + 8 * 7  # pointer of sequence 7, in the third chunk
    bad[at : at + 8] = np.int64(1 << 20).tobytes()
    m.with_suffix(".idx").write_bytes(bytes(bad))
    line = one_error_line(cli(m, "-o", tmp_path / "bad1", "--eos-id", 0, "--vocab-size", 128))
    assert line.endswith(
        f"m.idx [sequence 7]: Megatron sequence lies outside the .bin; expected pointer >= 0, "
        f"size >= 0, pointer + size*2 <= {m.with_suffix('.bin').stat().st_size} (the .bin size), "
        f"found pointer {1 << 20}, size {size7}. HINT: the .bin is truncated or belongs to another .idx"
    ), line
    doc_off = 34 + 12 * sequences
    di = np.frombuffer(idx, "<i8", offset=doc_off).copy()
    di[2] = di[3] + 1  # entry 3 (second chunk) below entry 2 (end of the first)
    m.with_suffix(".idx").write_bytes(idx[:doc_off] + di.tobytes())
    line = one_error_line(cli(m, "-o", tmp_path / "bad2", "--eos-id", 0, "--vocab-size", 128))
    assert line.endswith(
        f"m.idx [document index 3]: Megatron document indices decrease or exceed the sequence count; "
        f"expected non-decreasing, <= {sequences}, found {di[3]}"
    ), line


def test_megatron_gap_after_a_shorter_sequence(tmp_path):
    """Pointers evenly spaced by the first sequence's size while a later sequence is shorter:
    the gap after it holds a junk token, which pack must skip (megatron-core agrees)."""
    import struct

    indexed = require("megatron.core.datasets.indexed_dataset", MEGATRON_CORE)
    (tmp_path / "m.bin").write_bytes(np.array([5, 6, 7, 999, 8, 0], dtype="<u2").tobytes())
    with open(tmp_path / "m.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 3, 2))
        f.write(
            np.array([2, 1, 2], "<i4").tobytes()
            + np.array([0, 4, 8], "<i8").tobytes()
            + np.array([0, 3], "<i8").tobytes()
        )
    mds = indexed.IndexedDataset(str(tmp_path / "m"))
    assert np.concatenate([mds[i] for i in range(3)]).tolist() == [5, 6, 7, 8, 0]
    pack([str(tmp_path / "m")], str(tmp_path / "out"), eos_id=0, vocab_size=16)
    assert packed_docs(tmp_path / "out") == [[5, 6, 7, 8, 0]]


@pytest.mark.parametrize("layout", ["back-to-back", "out-of-order"])
def test_megatron_bin_truncated_while_reading(layout, tmp_path):
    """A .bin that shrinks after the checks (another process rewriting it) is named in the error."""
    from tokpack.formats.inputs.discover import check_input, discover, read_blocks

    docs = [[1, 2, 0], [3, 4, 5, 0]]
    m = megatron_core_docs(tmp_path / "m", docs)
    if layout == "out-of-order":  # the second document first in the .bin
        idx = bytearray(m.with_suffix(".idx").read_bytes())
        idx[34 + 8 : 34 + 24] = np.array([8, 0], "<i8").tobytes()
        m.with_suffix(".idx").write_bytes(bytes(idx))
        m.with_suffix(".bin").write_bytes(np.array([3, 4, 5, 0, 1, 2, 0], "<u2").tobytes())
    _, (f,) = discover([str(m)])
    check_input(f)
    with open(m.with_suffix(".bin"), "r+b") as fh:
        fh.truncate(10)
    with pytest.raises(TokpackError) as e:
        list(read_blocks(f, eos_id=0))
    assert str(e.value).startswith(f"{m.with_suffix('.bin')} [token ") and "file ended early" in str(e.value)


def test_megatron_bad_id_names_document_and_token_offset(tmp_path):
    """A block of only empty documents (no sequences, so no pointer) comes first; the bad id's
    document number and token offset in the .bin are exact."""
    docs = [[], [], list(range(1, 21)), [5, 600, 0]]
    m = megatron_core_docs(tmp_path / "m", docs, lambda k, doc: [len(doc)] if doc else [])
    line = one_error_line(cli(m, "-o", tmp_path / "out", "--eos-id", 0, "--vocab-size", 500))
    assert line.endswith(
        "m.bin [document 3, token offset 21]: token id at or above vocab_size; expected < 500, "
        "found 600. HINT: pass the right --vocab-size or --tokenizer, or fix the input"
    ), line
    with pytest.raises(TokpackError) as e:  # blocks of 8 ids: the bad document is the fourth block's first
        pack([str(m)], str(tmp_path / "small"), eos_id=0, vocab_size=500, block_bytes=16)
    assert f"{m.with_suffix('.bin')} [document 3, token offset 21]: token id at or above" in str(e.value)
    pack([str(m)], str(tmp_path / "ok"), eos_id=0, vocab_size=601, block_bytes=16)
    assert packed_docs(tmp_path / "ok") == [list(range(1, 21)) + [0], [5, 600, 0]]


def test_megatron_multimodal_index(monkeypatch, tmp_path):
    """A multimodal index (one mode byte per sequence after the document indices) reads as text."""
    from tokpack.formats.inputs import megatron_bin

    docs = [[3, 4, 0], [5, 6, 7, 8, 0], [9, 0]] * 4
    m = megatron_core_docs(tmp_path / "m", docs, lambda k, doc: [2, len(doc) - 2], multimodal=True)
    pack([str(m)], str(tmp_path / "out"), eos_id=0, vocab_size=16)
    assert packed_docs(tmp_path / "out") == docs
    monkeypatch.setattr(megatron_bin, "INDEX_CHUNK", 3)  # the last chunk of document indices is short
    pack([str(m)], str(tmp_path / "chunked"), eos_id=0, vocab_size=16, block_bytes=8)
    assert packed_docs(tmp_path / "chunked") == docs


# ------------------------------------------------------------ parquet, arrow, HF


def varied_docs(seed=0, n=60, hi=500):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, hi, size=int(rng.integers(0, 50))).tolist() for _ in range(n)]
    return [d + [0] if i % 4 else d for i, d in enumerate(docs)]  # some lack EOS, some are empty


def normalised(docs):
    return [d if d[-1] == 0 else d + [0] for d in docs if d]


@pytest.mark.parametrize(
    "list_type", [pa.large_list(pa.int32()), pa.list_(pa.uint16(), 3)], ids=["large_list", "fixed_size_list"]
)
def test_parquet_large_and_fixed_size_lists(list_type, tmp_path):
    """Token columns written as large_list or fixed_size_list, as some writers do."""
    docs = [[5, 6, 0], [7, 8, 9], [1, 0, 2]]
    pq.write_table(pa.table({"input_ids": pa.array(docs, type=list_type)}), tmp_path / "x.parquet")
    pack([str(tmp_path / "x.parquet")], str(tmp_path / "out"), eos_id=0, vocab_size=16)
    assert packed_docs(tmp_path / "out") == [[5, 6, 0], [7, 8, 9, 0], [1, 0, 2, 0]]


def test_parquet_round_trip_with_missing_eos_and_empty_docs(tmp_path):
    docs = varied_docs()
    table = pa.table({"other": list(range(len(docs))), "input_ids": pa.array(docs, type=pa.list_(pa.int32()))})
    (tmp_path / "pq").mkdir()
    pq.write_table(table.slice(0, 30), tmp_path / "pq" / "a.parquet", row_group_size=7)
    pq.write_table(table.slice(30), tmp_path / "pq" / "b.parquet", row_group_size=7)
    res = cli(tmp_path / "pq", "-o", tmp_path / "out", "--eos-id", 0, "--vocab-size", 500, "--json")
    assert res.exit_code == 0, res.stderr
    s = json.loads(res.stdout)
    assert packed_docs(tmp_path / "out") == normalised(docs)
    assert (s["format"], s["dtype"]) == ("parquet", "uint16")
    assert s["empty_documents_dropped"] == sum(1 for d in docs if not d)
    assert s["eos_appended"] == sum(1 for d in docs if d and d[-1] != 0)
    assert s["tokens"] == sum(map(len, normalised(docs)))  # no token lost


def test_parquet_row_groups_decoded_in_parallel_pack_as_one_at_a_time(tmp_path, monkeypatch):
    """Row groups decoded several at once come out in file order: the same packed bytes, and
    the same error line for a null id in a late row group, as decoding one at a time."""
    import tokpack.formats.inputs.tables as tables

    docs = varied_docs(seed=4)
    (tmp_path / "pq").mkdir()
    pq.write_table(
        pa.table({"input_ids": pa.array(docs, type=pa.list_(pa.int32()))}),
        tmp_path / "pq" / "a.parquet",
        row_group_size=3,
    )
    bad = [list(d) for d in docs]
    bad[-2] = [1, None, 0]
    pq.write_table(
        pa.table({"input_ids": pa.array(bad, type=pa.list_(pa.int32()))}), tmp_path / "bad.parquet", row_group_size=3
    )
    assert pq.ParquetFile(tmp_path / "pq" / "a.parquet").num_row_groups > 8
    outs, errors = [], []
    for threads in (1, 3):
        monkeypatch.setattr(tables, "PARQUET_DECODE_THREADS", threads)
        pack([str(tmp_path / "pq")], str(tmp_path / f"out{threads}"), eos_id=0, vocab_size=500)
        outs.append({p.name: p.read_bytes() for p in (tmp_path / f"out{threads}").iterdir()})
        with pytest.raises(TokpackError) as err:
            pack([str(tmp_path / "bad.parquet")], str(tmp_path / f"bad{threads}"), eos_id=0, vocab_size=500)
        errors.append(str(err.value))
        assert not (tmp_path / f"bad{threads}" / "tokpack.json").exists()
    assert outs[0] == outs[1] and packed_docs(tmp_path / "out3") == normalised(docs)
    assert errors[0] == errors[1] and "null token id" in errors[0] and f"row {len(docs) - 2}]" in errors[0]


def test_parquet_null_rows_and_null_ids(tmp_path):
    """A null list is an empty document (dropped and counted); a null id inside a list is an
    error naming the column and its row."""
    docs = [[i % 50 + 1, 0] for i in range(10000)]
    rows = [None if i in (3, 8500) else d for i, d in enumerate(docs)]
    pq.write_table(pa.table({"input_ids": pa.array(rows, type=pa.list_(pa.int32()))}), tmp_path / "ok.parquet")
    s = pack([str(tmp_path / "ok.parquet")], str(tmp_path / "ok"), eos_id=0, vocab_size=64)
    assert packed_docs(tmp_path / "ok") == [d for r, d in zip(rows, docs) if r is not None]
    assert s.empty_documents_dropped == 2
    rows[9000] = [7, 99, 0]  # in the second record batch, after two null rows
    pq.write_table(pa.table({"input_ids": pa.array(rows, type=pa.list_(pa.int32()))}), tmp_path / "v.parquet")
    line = one_error_line(cli(tmp_path / "v.parquet", "-o", tmp_path / "v", "--eos-id", 0, "--vocab-size", 64))
    assert line.endswith(
        "v.parquet [document 9000, token offset 17997]: token id at or above vocab_size; expected "
        "< 64, found 99. HINT: pass the right --vocab-size or --tokenizer, or fix the input"
    ), line
    rows[9000] = [7, None, 0]
    pq.write_table(pa.table({"input_ids": pa.array(rows, type=pa.list_(pa.int32()))}), tmp_path / "x.parquet")
    line = one_error_line(cli(tmp_path / "x.parquet", "-o", tmp_path / "out", "--eos-id", 0, "--vocab-size", 64))
    assert line.endswith(
        "x.parquet [column 'input_ids', row 9000]: null token id in a list; expected "
        "integers, found null. HINT: drop or fill the nulls before packing"
    ), line


def test_hf_save_to_disk_and_arrow_file(tmp_path, tokenizer_path):
    docs = varied_docs(seed=2, hi=200)  # below the test tokenizer's vocabulary
    try:
        import datasets

        datasets.Dataset.from_dict({"input_ids": docs}).save_to_disk(str(tmp_path / "hf"))
    except ImportError:  # the arrow stream layout save_to_disk writes
        (tmp_path / "hf").mkdir()
        with pa.ipc.new_stream(
            str(tmp_path / "hf" / "data-00000-of-00001.arrow"), pa.schema({"input_ids": pa.list_(pa.int64())})
        ) as w:
            w.write_table(pa.table({"input_ids": docs}))
        (tmp_path / "hf" / "state.json").write_text(
            json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
        )
    s = pack([str(tmp_path / "hf")], str(tmp_path / "out"), tokenizer=str(tokenizer_path))
    assert packed_docs(tmp_path / "out") == normalised(docs) and s.format == "parquet"
    with pa.OSFile(str(tmp_path / "f.arrow"), "wb") as sink:
        with pa.ipc.new_file(sink, pa.schema({"ids": pa.list_(pa.uint16())})) as w:
            w.write_table(pa.table({"ids": pa.array(docs, type=pa.list_(pa.uint16()))}), max_chunksize=9)
    pack([str(tmp_path / "f.arrow")], str(tmp_path / "out2"), column="ids", eos_id=0)
    assert packed_docs(tmp_path / "out2") == normalised(docs)


# ------------------------------------------------------------- numpy and jsonl


def test_npy_and_raw_split_at_eos(tmp_path):
    docs = [d for d in varied_docs(seed=3) if d]
    stream = np.concatenate([np.array(d) for d in docs])  # documents lacking EOS merge with the next
    np.save(tmp_path / "t.npy", stream.astype(np.uint16))
    s = pack([str(tmp_path / "t.npy")], str(tmp_path / "a"), eos_id=0, block_bytes=64)
    ends = np.flatnonzero(stream == 0) + 1
    expected = [x.tolist() for x in np.split(stream, ends) if len(x)]
    expected = normalised(expected)
    assert packed_docs(tmp_path / "a") == expected and s.vocab_size == 65536
    stream.astype(np.int32).tofile(tmp_path / "t.tok")
    res = cli(
        tmp_path / "t.tok",
        "-o",
        tmp_path / "b",
        "--format",
        "numpy",
        "--dtype",
        "int32",
        "--eos-id",
        0,
        "--vocab-size",
        1000,
    )
    assert res.exit_code == 0, res.stderr
    assert packed_docs(tmp_path / "b") == expected


@contextlib.contextmanager
def finishes_within(seconds: int, what: str):
    """Fails the test, instead of hanging it, when the block does not return in time (a reader
    that stops making progress loops forever)."""

    def hung(signum, frame):
        raise AssertionError(f"{what} did not finish within {seconds} s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("block", [4, 6, 64], ids=lambda b: f"block{b}B")
def test_npy_and_raw_last_document_without_eos(block, tmp_path):
    """The tokens after a file's last EOS are a document of their own, whole, with EOS appended;
    a file with no EOS at all is one document. Small blocks put the file's end inside a block
    holding earlier EOS and inside one holding none."""
    for name, stream, expected in [
        ("tail", [5, 6, 0, 7, 8, 9], [[5, 6, 0], [7, 8, 9, 0]]),
        ("none", [7, 8, 9, 4, 3], [[7, 8, 9, 4, 3, 0]]),
    ]:
        np.save(tmp_path / f"{name}.npy", np.array(stream, dtype=np.uint16))
        with finishes_within(60, f"pack of {name}.npy"):
            s = pack(
                [str(tmp_path / f"{name}.npy")],
                str(tmp_path / f"{name}-npy"),
                eos_id=0,
                vocab_size=16,
                block_bytes=block,
            )
        assert packed_docs(tmp_path / f"{name}-npy") == expected and s.eos_appended == 1
        np.array(stream, dtype="<u4").tofile(tmp_path / f"{name}.tok")
        res = cli(
            tmp_path / f"{name}.tok",
            "-o",
            tmp_path / f"{name}-raw",
            "--format",
            "numpy",
            "--dtype",
            "uint32",
            "--eos-id",
            0,
            "--vocab-size",
            16,
        )
        assert res.exit_code == 0, res.stderr
        assert packed_docs(tmp_path / f"{name}-raw") == expected


def test_npy_document_longer_than_the_read_buffer(tmp_path):
    """A document many blocks long grows the reader's buffer until it fits (a reader that stops
    growing it reads nothing more and never returns: the alarm turns that into a failure)."""
    rng = np.random.default_rng(7)
    docs = [rng.integers(1, 500, 1000).tolist() + [0], [3, 4, 0], rng.integers(1, 500, 300).tolist()]
    np.save(tmp_path / "t.npy", np.concatenate([np.array(d) for d in docs]).astype(np.uint16))
    with finishes_within(60, "pack of a 1001-token document"):
        pack([str(tmp_path / "t.npy")], str(tmp_path / "out"), eos_id=0, vocab_size=500, block_bytes=64)
    assert packed_docs(tmp_path / "out") == [docs[0], docs[1], docs[2] + [0]]


@pytest.mark.parametrize("variant", ["big-endian", "v2.0 header", "v3.0 header", "2-D C order", "1-D Fortran flag"])
def test_npy_header_variants(variant, tmp_path):
    """.npy layouts besides the common little-endian 1-D version 1.0 one pack to the same documents."""
    tokens = np.array([5, 6, 0, 7, 8, 0, 9], dtype="<u4")
    with open(tmp_path / "t.npy", "wb") as f:
        if variant == "big-endian":
            np.lib.format.write_array(f, tokens.astype(">u4"), version=(1, 0))
        elif variant == "2-D C order":
            np.lib.format.write_array(f, tokens[:6].reshape(2, 3), version=(1, 0))
        elif variant == "1-D Fortran flag":  # other writers may set it: one axis has one order
            np.lib.format.write_array_header_1_0(f, {"descr": "<u4", "fortran_order": True, "shape": (7,)})
            f.write(tokens.tobytes())
        else:
            np.lib.format.write_array(f, tokens, version={"v2.0 header": (2, 0), "v3.0 header": (3, 0)}[variant])
    s = pack([str(tmp_path / "t.npy")], str(tmp_path / "out"), eos_id=0, vocab_size=16)
    expected = [[5, 6, 0], [7, 8, 0]] + ([] if variant == "2-D C order" else [[9, 0]])
    assert packed_docs(tmp_path / "out") == expected and s.eos_appended == len(expected) - 2


def test_jsonl_token_lists(tmp_path):
    docs = varied_docs(seed=4)
    with open(tmp_path / "t.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"ids": d, "meta": "x"}) + "\n")
    res = cli(tmp_path / "t.jsonl", "-o", tmp_path / "out", "--column", "ids", "--eos-id", 0, "--vocab-size", 500)
    assert res.exit_code == 0, res.stderr
    assert "detected format jsonl" in res.stderr
    assert packed_docs(tmp_path / "out") == normalised(docs)


def test_jsonl_blocks_blank_lines_and_empty_lists(tmp_path):
    """Token lists read in blocks of any size, blank lines between them, and a last block
    holding only empty lists; a bad id in a later block names its document and token offset."""
    docs = varied_docs(seed=6, n=30) + [[], []]
    with open(tmp_path / "t.jsonl", "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps(d) + ("\n\n" if i % 7 == 0 else "\n"))
    for block in (8, 64, 1 << 20):
        s = pack(
            [str(tmp_path / "t.jsonl")], str(tmp_path / f"out{block}"), eos_id=0, vocab_size=500, block_bytes=block
        )
        assert packed_docs(tmp_path / f"out{block}") == normalised(docs)
        assert s.empty_documents_dropped == sum(1 for d in docs if not d)
    (tmp_path / "v.jsonl").write_text("[1, 2, 0]\n" * 5 + "[3, 700, 0]\n")
    for block in (16, 1 << 20):  # the bad id in a block of its own, or in the one last block
        with pytest.raises(TokpackError) as e:
            pack([str(tmp_path / "v.jsonl")], str(tmp_path / "v"), eos_id=0, vocab_size=500, block_bytes=block)
        assert str(e.value).endswith(
            "v.jsonl [document 5, token offset 16]: token id at or above vocab_size; "
            "expected < 500, found 700. HINT: pass the right --vocab-size or --tokenizer, "
            "or fix the input"
        )


@pytest.mark.parametrize(
    "bad, expected",
    [
        (
            "5",
            "[line 8, key 'input_ids']: JSONL line has no token list; expected a list of token ids, found int. "
            "HINT: pass --column with the key holding the token ids",
        ),
        (
            '{"ids": [2, 0]}',
            "[line 8, key 'input_ids']: JSONL line has no token list; expected a list of token ids, "
            "found no such key. HINT: pass --column with the key holding the token ids",
        ),
        (
            '{"input_ids": [3, -2, "x"]}',
            "[line 8 (document 6), position 2]: token id is not a 64-bit integer; "
            "expected an integer in [-2^63, 2^64), found 'x'",
        ),
        (
            '{"input_ids": [4, true, 0]}',
            "[line 8 (document 6), position 1]: token id is not a 64-bit integer; expected "
            "an integer in [-2^63, 2^64), found True",
        ),
        (
            "[false, 0]",
            "[line 8 (document 6), position 0]: token id is not a 64-bit integer; expected an integer in "
            "[-2^63, 2^64), found False",
        ),
        (
            "[1, [2, 3], 0]",
            "[line 8 (document 6), position 1]: token id is not a 64-bit integer; expected an integer in "
            "[-2^63, 2^64), found [2, 3]",
        ),
        (
            "[1, 18446744073709551616]",
            "[line 8 (document 6), position 1]: token id is not a 64-bit integer; expected an "
            "integer in [-2^63, 2^64), found 18446744073709551616",
        ),
        (
            '{"input_ids": 5}',
            "[line 8, key 'input_ids']: JSONL line has no token list; expected a list of token ids, "
            "found int. HINT: pass --column with the key holding the token ids",
        ),
        (
            "[-9223372036854775808, 18446744073709551615]",
            "[lines 6-8]: token ids do not fit one integer type; expected "
            "ids in [0, 2^64), found ids from -9223372036854775808 to "
            "18446744073709551615",
        ),
    ],
    ids=[
        "not-a-list",
        "no-key",
        "string-id",
        "true",
        "false",
        "nested-list",
        "2^64",
        "int-under-key",
        "int64-and-uint64",
    ],
)
def test_jsonl_bad_ids_name_line_and_position(bad, expected, tmp_path):
    """Six good lines (one blank line among them, so line and document numbers differ) read in
    blocks of 3 ids (lines 1-2, 4-5 exactly 3, 6-8), then a bad one on line 8: the error names
    its line, document and position exactly."""
    (tmp_path / "x.jsonl").write_text("[1, 0]\n[2, 0]\n\n[3, 0]\n[4]\n[5]\n[6]\n" + bad + "\n")
    with pytest.raises(TokpackError) as e:
        pack([str(tmp_path / "x.jsonl")], str(tmp_path / "out"), eos_id=0, vocab_size=500, block_bytes=24)
    assert str(e.value) == f"{tmp_path / 'x.jsonl'} {expected}"
    assert not (tmp_path / "out" / MANIFEST).exists()


def test_jsonl_bool_ids_refused_anywhere_in_a_block(tmp_path):
    """A true/false on one line of a block is found even when the block's later lines spell none."""
    (tmp_path / "x.jsonl").write_text("[3, 0]\n[true, 1]\n[2, 0]\n")
    with pytest.raises(TokpackError) as e:
        pack([str(tmp_path / "x.jsonl")], str(tmp_path / "out"), eos_id=0, vocab_size=500)
    assert str(e.value).endswith(
        "x.jsonl [line 2 (document 1), position 0]: token id is not a 64-bit integer; "
        "expected an integer in [-2^63, 2^64), found True"
    )


def test_raw_text_jsonl_and_parquet(corpus, tokenizer_path, tmp_path):
    texts = corpus["texts"]
    res = cli(corpus["root"] / "text", "-o", tmp_path / "a", "--tokenizer", tokenizer_path, "--workers", 2)
    assert res.exit_code == 0, res.stderr
    assert "detected format text" in res.stderr
    assert packed_docs(tmp_path / "a") == encode_all(tokenizer_path, sum(texts, []))
    pq.write_table(pa.table({"body": texts[0]}), tmp_path / "t.parquet")
    pack(
        [str(tmp_path / "t.parquet")],
        str(tmp_path / "b"),
        tokenizer=str(tokenizer_path),
        column="body",
        input_format="text",
    )
    assert packed_docs(tmp_path / "b") == encode_all(tokenizer_path, texts[0])


# ---------------------------------------------------------------------- bad input


def copy_dt(corpus, tmp_path) -> Path:
    dst = tmp_path / "in"
    shutil.copytree(corpus["dt"], dst)
    return dst


def first_ds(folder: Path) -> Path:
    return sorted(folder.glob("*.ds"))[0]


def megatron_pair(tmp_path, code=8, n=5) -> Path:
    """A small .bin/.idx written from the format spec (the header fields are what we corrupt)."""
    import struct

    sizes = np.full(n, 4, dtype=np.int32)
    (np.arange(n * 4, dtype=np.uint16) % 7).tofile(tmp_path / "m.bin")
    with open(tmp_path / "m.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, n, n + 1))
        f.write(
            sizes.tobytes() + (np.arange(n, dtype=np.int64) * 8).tobytes() + np.arange(n + 1, dtype=np.int64).tobytes()
        )
    return tmp_path / "m"


def bad_vocab(c, t):
    return [c["dt"], "--vocab-size", 50]


def bad_ds_size(c, t):
    d = copy_dt(c, t)
    with open(first_ds(d), "ab") as f:
        f.write(b"\x01")
    return [d]


def bad_index_order(c, t):
    d = copy_dt(c, t)
    idx = Path(f"{first_ds(d)}.index")
    a = np.fromfile(idx, dtype="<u8")
    a[[1, 2]] = a[[2, 1]]
    a.tofile(idx)
    return [d]


def bad_index_repeated(c, t):
    d = copy_dt(c, t)
    idx = Path(f"{first_ds(d)}.index")
    a = np.fromfile(idx, dtype="<u8")
    a[3] = a[2]  # a repeated end: an empty document that still "ends" right after an EOS
    a.tofile(idx)
    return [d]


def bad_index_huge(c, t):
    d = copy_dt(c, t)
    idx = Path(f"{first_ds(d)}.index")
    a = np.fromfile(idx, dtype="<u8")
    a[2:4] = 2**64 - 5, 2**64 - 4  # past int64 (negative, read as signed): the first such is named
    a.tofile(idx)
    return [d]


def bad_index_last(c, t):
    d = copy_dt(c, t)
    idx = Path(f"{first_ds(d)}.index")
    np.fromfile(idx, dtype="<u8")[:-1].tofile(idx)
    return [d]


def bad_cut_at_a_document(c, t):
    """.ds and .ds.index cut short at one document's end (a copy stopped short): they agree; only
    the count datatrove's .ds.metadata records shows the lost tokens."""
    d = copy_dt(c, t)
    ds = first_ds(d)
    ends = np.fromfile(f"{ds}.index", dtype="<u8")[:3]
    ends.tofile(f"{ds}.index")
    np.fromfile(ds, dtype="<u2")[: int(ends[-1])].tofile(ds)
    return [d]


def bad_hf_shard_missing(c, t):
    """A save_to_disk folder of 3 arrow files copied without its second: the other two packed
    alone, a third of the rows lost in silence."""
    (t / "hf").mkdir()
    names = [f"data-0000{i}-of-00003.arrow" for i in range(3)]
    for name in names[::2]:
        with pa.ipc.new_stream(str(t / "hf" / name), pa.schema({"input_ids": pa.list_(pa.int64())})) as w:
            w.write_table(pa.table({"input_ids": [[1, 2, 0]]}))
    (t / "hf" / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    return [t / "hf", "--eos-id", 0, "--vocab-size", 10]


def bad_megatron_magic(c, t):
    p = megatron_pair(t)
    b = bytearray(p.with_suffix(".idx").read_bytes())
    b[0:3] = b"XXX"
    p.with_suffix(".idx").write_bytes(bytes(b))
    return [p, "--eos-id", 0]


def bad_megatron_version(c, t):
    p = megatron_pair(t)
    b = bytearray(p.with_suffix(".idx").read_bytes())
    b[9] = 2
    p.with_suffix(".idx").write_bytes(bytes(b))
    return [p, "--eos-id", 0]


def bad_megatron_dtype(c, t):
    return [megatron_pair(t, code=9), "--eos-id", 0]


def bad_megatron_dtype_high(c, t):
    return [megatron_pair(t, code=200), "--eos-id", 0]  # the code is an unsigned byte


def bad_megatron_pointers(c, t):
    p = megatron_pair(t)
    with open(p.with_suffix(".bin"), "r+b") as f:
        f.truncate(20)
    return [p, "--eos-id", 0]


def _megatron_doc_index(t, values):
    """megatron_pair with its document index array (n + 1 = 6 entries) replaced."""
    p = megatron_pair(t)
    b = bytearray(p.with_suffix(".idx").read_bytes())
    b[-48:] = np.array(values, dtype=np.int64).tobytes()
    p.with_suffix(".idx").write_bytes(bytes(b))
    return [p, "--eos-id", 0]


def bad_megatron_idx_size(c, t):
    p = megatron_pair(t)
    with open(p.with_suffix(".idx"), "ab") as f:
        f.write(b"\x00" * 3)
    return [p, "--eos-id", 0]


def bad_megatron_bin_size(c, t):
    p = megatron_pair(t)
    with open(p.with_suffix(".bin"), "ab") as f:
        f.write(b"\x00")  # half a uint16 token
    return [p, "--eos-id", 0]


def bad_megatron_doc_start(c, t):
    return _megatron_doc_index(t, [1, 1, 2, 3, 4, 5])


def bad_megatron_doc_decrease(c, t):
    return _megatron_doc_index(t, [0, 2, 1, 3, 4, 5])


def bad_megatron_doc_end(c, t):
    return _megatron_doc_index(t, [0, 1, 2, 3, 4, 4])


def _megatron_idx_patch(t, offset, data: bytes):
    """megatron_pair (5 sequences of 4 uint16 tokens, 6 document indices) with idx bytes patched."""
    p = megatron_pair(t)
    b = bytearray(p.with_suffix(".idx").read_bytes())
    b[offset : offset + len(data)] = data
    p.with_suffix(".idx").write_bytes(bytes(b))
    return [p, "--eos-id", 0]


def bad_megatron_short_header(c, t):
    p = megatron_pair(t)
    p.with_suffix(".idx").write_bytes(p.with_suffix(".idx").read_bytes()[:20])
    return [p, "--eos-id", 0]


def bad_megatron_no_documents(c, t):
    import struct

    p = megatron_pair(t)
    idx = p.with_suffix(".idx").read_bytes()
    p.with_suffix(".idx").write_bytes(idx[:9] + struct.pack("<QBQQ", 1, 8, 5, 0) + idx[34:-48])
    return [p, "--eos-id", 0]


def bad_megatron_negative_pointer(c, t):
    return _megatron_idx_patch(t, 34 + 20 + 8 * 3, np.int64(-8).tobytes())


def bad_megatron_negative_size(c, t):
    return _megatron_idx_patch(t, 34, np.int32(-4).tobytes())  # sequence 0: the first one checked


def bad_megatron_doc_exceeds(c, t):
    return _megatron_doc_index(t, [0, 1, 2, 3, 7, 5])


def bad_megatron_dir_idx_missing(c, t):
    """A folder of Megatron pairs, one .idx left behind by a copy: its .bin was skipped in silence."""
    for name in ("a", "b"):
        (t / name).mkdir()
        megatron_pair(t / name).with_suffix(".bin").rename(t / f"{name}.bin")
        (t / name / "m.idx").rename(t / f"{name}.idx")
    (t / "b.idx").unlink()
    return [t, "--eos-id", 0]


def bad_megatron_bin_alone(c, t):
    p = megatron_pair(t)
    p.with_suffix(".idx").unlink()
    return [p.with_suffix(".bin"), "--format", "megatron", "--eos-id", 0]


def bad_npy_header(c, t):
    (t / "x.npy").write_bytes(b"\x93NUMPY\x01\x00garbage")
    return [t / "x.npy", "--eos-id", 0, "--vocab-size", 10]


def bad_raw_no_dtype(c, t):
    (t / "x.tok").write_bytes(b"\x01\x00\x00\x00")
    return [t / "x.tok", "--format", "numpy", "--eos-id", 0, "--vocab-size", 10]


def bad_npy_float(c, t):
    np.save(t / "x.npy", np.array([1.0, 2.0, 0.0], dtype=np.float32))
    return [t / "x.npy", "--eos-id", 0, "--vocab-size", 10]


def bad_npy_fortran(c, t):
    np.save(t / "x.npy", np.asfortranarray(np.array([[1, 2, 0], [3, 4, 0]], dtype=np.int32)))
    return [t / "x.npy", "--eos-id", 0, "--vocab-size", 10]


def bad_npy_truncated(c, t):
    np.save(t / "x.npy", np.array([3, 4, 0, 5, 6, 0], dtype=np.int32))  # 128-byte header + 24 bytes
    (t / "x.npy").write_bytes((t / "x.npy").read_bytes()[:-2])
    return [t / "x.npy", "--eos-id", 0, "--vocab-size", 10]


def bad_raw_dtype_not_integer(c, t):
    (t / "x.tok").write_bytes(b"\x01\x00\x00\x00")
    return [t / "x.tok", "--format", "numpy", "--dtype", "float32", "--eos-id", 0, "--vocab-size", 10]


def bad_raw_size(c, t):
    (t / "x.tok").write_bytes(b"\x01\x00\x00\x00\x00")
    return [t / "x.tok", "--format", "numpy", "--dtype", "uint16", "--eos-id", 0, "--vocab-size", 10]


def bad_jsonl_line(c, t):
    (t / "x.jsonl").write_text('{"input_ids": [1, 0]}\n{"input_ids": [2, \n')
    return [t / "x.jsonl", "--eos-id", 0, "--vocab-size", 10]


def bad_jsonl_nested(c, t):
    (t / "x.jsonl").write_text('{"input_ids": [1, [2, 3], 0]}\n')
    return [t / "x.jsonl", "--eos-id", 0, "--vocab-size", 10]


def bad_jsonl_nested_equal(c, t):
    (t / "x.jsonl").write_text('{"input_ids": [[1, 2], [3, 4]]}\n')  # numpy makes it a 2-D int array
    return [t / "x.jsonl", "--eos-id", 0, "--vocab-size", 10]


def bad_jsonl_gz_truncated(c, t):
    import gzip

    data = gzip.compress(b"".join(b'{"input_ids": [1, 2, 0]}\n' for _ in range(2000)))
    (t / "x.jsonl.gz").write_bytes(data[: len(data) // 2])  # a copy cut short
    return [t / "x.jsonl.gz", "--eos-id", 0, "--vocab-size", 10]


def bad_jsonl_not_gzip(c, t):
    (t / "x.jsonl.gz").write_text('{"input_ids": [1, 2, 0]}\n')
    return [t / "x.jsonl.gz", "--eos-id", 0, "--vocab-size", 10]


def bad_jsonl_not_utf8(c, t):
    (t / "x.jsonl").write_bytes(b'{"input_ids": [1, 2, 0]}\n\xff\xfe{}\n')
    return [t / "x.jsonl", "--eos-id", 0, "--vocab-size", 10]


def bad_parquet_missing(c, t):
    pq.write_table(pa.table({"tokens": [[1, 2, 0]]}), t / "x.parquet")
    return [t / "x.parquet", "--eos-id", 0]


def bad_parquet_type(c, t):
    pq.write_table(pa.table({"input_ids": [["a", "b"]]}), t / "x.parquet")
    return [t / "x.parquet", "--eos-id", 0]


def bad_parquet_corrupt_page(c, t):
    pq.write_table(pa.table({"input_ids": [[1, 2, 0]] * 5000}), t / "x.parquet", row_group_size=1000)
    b = bytearray((t / "x.parquet").read_bytes())
    b[200:260] = bytes(60)  # inside a compressed data page: the footer still reads
    (t / "x.parquet").write_bytes(bytes(b))
    return [t / "x.parquet", "--eos-id", 0, "--vocab-size", 10]


def bad_arrow_stream_truncated(c, t):
    with pa.ipc.new_stream(str(t / "x.arrow"), pa.schema({"input_ids": pa.list_(pa.int64())})) as w:
        for _ in range(5):
            w.write_table(pa.table({"input_ids": [[1, 2, 0]] * 1000}))
    data = (t / "x.arrow").read_bytes()
    (t / "x.arrow").write_bytes(data[: len(data) // 2 + 7])  # a copy cut short inside a batch
    return [t / "x.arrow", "--eos-id", 0, "--vocab-size", 10]


def bad_negative(c, t):
    np.save(t / "x.npy", np.array([3, 4, 0, -2, 5, 0], dtype=np.int32))
    return [t / "x.npy", "--eos-id", 0]


def bad_empty_file(c, t):
    (t / "x.jsonl").write_text("")
    return [t / "x.jsonl", "--eos-id", 0, "--vocab-size", 10]


def bad_empty_dir(c, t):
    (t / "empty").mkdir()
    return [t / "empty"]


def bad_mixed_dtypes(c, t):
    d = copy_dt(c, t)
    meta = Path(f"{first_ds(d)}.metadata")
    lines = meta.read_text().split("\n")
    meta.write_text("\n".join([lines[0].rsplit("|", 1)[0] + "|4"] + lines[1:]))
    # keep sizes coherent as uint32 so only the dtype mix is wrong
    ds = first_ds(d)
    np.fromfile(ds, dtype="<u2").astype("<u4").tofile(ds)
    return [d]


def bad_mixed_vocab(c, t):
    d = copy_dt(c, t)
    meta = Path(f"{first_ds(d)}.metadata")
    meta.write_text("other-tokenizer" + meta.read_text()[meta.read_text().rindex("|") :])
    return [d]


def bad_mixed_megatron(c, t):
    (t / "a").mkdir(), (t / "b").mkdir()
    return [megatron_pair(t / "a", code=8), megatron_pair(t / "b", code=4), "--eos-id", 0]


def bad_tokenizer_not_local(c, t):
    return [c["dt"], "--tokenizer", "gpt2"]


def bad_eos_unknown(c, t):
    return [megatron_pair(t)]


def bad_vocab_unknown(c, t):
    (t / "x.jsonl").write_text('{"input_ids": [1, 2, 0]}\n')
    return [t / "x.jsonl", "--eos-id", 0]


BAD = [
    bad_vocab,
    bad_ds_size,
    bad_index_order,
    bad_index_repeated,
    bad_index_huge,
    bad_index_last,
    bad_cut_at_a_document,
    bad_hf_shard_missing,
    bad_megatron_magic,
    bad_megatron_version,
    bad_megatron_dtype,
    bad_megatron_dtype_high,
    bad_megatron_pointers,
    bad_megatron_idx_size,
    bad_megatron_bin_size,
    bad_megatron_doc_start,
    bad_megatron_doc_decrease,
    bad_megatron_doc_end,
    bad_megatron_short_header,
    bad_megatron_no_documents,
    bad_megatron_negative_pointer,
    bad_megatron_negative_size,
    bad_megatron_doc_exceeds,
    bad_megatron_dir_idx_missing,
    bad_megatron_bin_alone,
    bad_npy_header,
    bad_raw_no_dtype,
    bad_npy_float,
    bad_npy_fortran,
    bad_npy_truncated,
    bad_raw_dtype_not_integer,
    bad_raw_size,
    bad_jsonl_line,
    bad_jsonl_nested,
    bad_jsonl_nested_equal,
    bad_jsonl_gz_truncated,
    bad_jsonl_not_gzip,
    bad_jsonl_not_utf8,
    bad_parquet_missing,
    bad_parquet_type,
    bad_parquet_corrupt_page,
    bad_arrow_stream_truncated,
    bad_negative,
    bad_empty_file,
    bad_empty_dir,
    bad_mixed_dtypes,
    bad_mixed_vocab,
    bad_mixed_megatron,
    bad_tokenizer_not_local,
    bad_eos_unknown,
    bad_vocab_unknown,
]
WHAT = {
    "bad_vocab": ["at or above vocab_size", "document", "token offset"],
    "bad_ds_size": ["not a multiple of the token size"],
    "bad_index_order": ["does not increase", "entry 2"],
    "bad_index_repeated": ["does not increase", "entry 3"],
    "bad_index_huge": ["does not increase", "[entry 2]", f"found {2**64 - 5}"],
    "bad_index_last": ["last entry differs"],
    "bad_hf_shard_missing": [
        "data-00001-of-00003.arrow [state.json _data_files]: a file the dataset's state.json lists is missing; "
        "expected 3 files, found 1 missing. HINT: the dataset folder is incomplete"
    ],
    "bad_cut_at_a_document": [
        ".ds [tokens]: .ds token count differs from its .ds.metadata; expected ",
        ".ds.metadata), found ",
        "HINT: the .ds and its .ds.index are truncated",
    ],
    "bad_megatron_magic": [
        "m.idx [byte 0]: not a Megatron index: wrong magic; expected b'MMIDIDX\\x00\\x00', found "
        "b'XXXDIDX\\x00\\x00'. HINT: pass the .idx written with the .bin (Megatron's MMIDIDX format)"
    ],
    "bad_megatron_version": ["m.idx [byte 9 (version)]: unsupported Megatron index version; expected 1, found 2"],
    "bad_megatron_dtype": [
        "m.idx [byte 17 (dtype code)]: unknown Megatron dtype code; expected 1-8 (uint8 int8 int16 "
        "int32 int64 float64 float32 uint16), found 9"
    ],
    "bad_megatron_dtype_high": [
        "m.idx [byte 17 (dtype code)]: unknown Megatron dtype code; expected 1-8 (uint8 "
        "int8 int16 int32 int64 float64 float32 uint16), found 200"
    ],
    "bad_megatron_pointers": [
        "m.idx [sequence 2]: Megatron sequence lies outside the .bin; expected pointer >= 0, "
        "size >= 0, pointer + size*2 <= 20 (the .bin size), found pointer 16, size 4. HINT: the "
        ".bin is truncated or belongs to another .idx"
    ],
    "bad_megatron_idx_size": [
        "m.idx [size]: Megatron .idx size does not match its counts; expected 142 bytes for 5 "
        "sequences and 6 document indices, found 145 bytes. HINT: the index is truncated or corrupt"
    ],
    "bad_megatron_bin_size": [
        "m.bin [size]: Megatron .bin size is not a multiple of the token size; expected a "
        "multiple of 2 (uint16), found 41 bytes"
    ],
    "bad_megatron_short_header": [
        "m.idx [header]: Megatron index header is truncated; expected 34 bytes, found 20 "
        "bytes. HINT: the index is truncated or corrupt"
    ],
    "bad_megatron_no_documents": [
        "m.idx [document count]: Megatron .idx has no document indices; expected >= 1, found 0"
    ],
    "bad_megatron_negative_pointer": [
        "m.idx [sequence 3]: Megatron sequence lies outside the .bin; expected "
        "pointer >= 0, size >= 0, pointer + size*2 <= 40 (the .bin size), found "
        "pointer -8, size 4."
    ],
    "bad_megatron_negative_size": [
        "m.idx [sequence 0]: Megatron sequence lies outside the .bin; expected "
        "pointer >= 0, size >= 0, pointer + size*2 <= 40 (the .bin size), found "
        "pointer 0, size -4."
    ],
    "bad_megatron_doc_exceeds": [
        "m.idx [document index 4]: Megatron document indices decrease or exceed the sequence "
        "count; expected non-decreasing, <= 5, found 7"
    ],
    "bad_megatron_doc_start": [
        "m.idx [document index 0]: Megatron document indices do not start at 0; expected 0, found 1"
    ],
    "bad_megatron_doc_decrease": [
        "m.idx [document index 2]: Megatron document indices decrease or exceed the sequence count; "
        "expected non-decreasing, <= 5, found 1"
    ],
    "bad_megatron_doc_end": [
        "m.idx [document index 5]: Megatron document indices do not end at the sequence count; expected 5, found 4"
    ],
    "bad_megatron_dir_idx_missing": [
        "b.bin [.idx]: Megatron .bin without its .idx; expected b.idx beside it, found none. HINT: copy the missing .idx"
    ],
    "bad_megatron_bin_alone": ["m.bin [.idx]: Megatron .bin without its .idx; expected m.idx beside it, found none."],
    "bad_npy_header": ["x.npy [header]: unreadable .npy header; expected a numpy .npy file, found "],
    "bad_raw_no_dtype": [
        "x.tok [--dtype]: raw token file needs --dtype; expected uint8 | int8 | uint16 | int16 | "
        "uint32 | int32 | uint64 | int64. HINT: pass --dtype"
    ],
    "bad_npy_float": [
        "x.npy [dtype]: .npy array is not of an integer type; expected an integer dtype, found float32. "
        "HINT: token ids must be integers"
    ],
    "bad_npy_fortran": ["x.npy [header]: .npy array is in Fortran order; expected C order, found Fortran order"],
    "bad_npy_truncated": [
        "x.npy [size]: .npy size does not match its header; expected 152 bytes, found 150 bytes. "
        "HINT: the file is truncated"
    ],
    "bad_raw_dtype_not_integer": [
        "x.tok [--dtype]: raw token file needs an integer --dtype; expected uint8 | int8 | uint16 | "
        "int16 | uint32 | int32 | uint64 | int64, found float32. HINT: pass --dtype with "
        "the width"
    ],
    "bad_raw_size": [
        "x.tok [size]: raw token file size is not a multiple of the token size; expected a multiple of 2 "
        "bytes (uint16), found 5 bytes"
    ],
    "bad_jsonl_line": ["x.jsonl [line 2]: invalid JSON; expected a JSON object, found "],
    "bad_jsonl_nested": [
        "x.jsonl [line 1 (document 0), position 1]: token id is not a 64-bit integer; expected an "
        "integer in [-2^63, 2^64), found [2, 3]"
    ],
    "bad_jsonl_nested_equal": [
        "x.jsonl [line 1 (document 0), position 0]: token id is not a 64-bit integer; "
        "expected an integer in [-2^63, 2^64), found [1, 2]"
    ],
    "bad_jsonl_gz_truncated": [
        "x.jsonl.gz [after line ",
        "]: damaged gzip stream; expected a complete gzip file, found Compressed file ended before the "
        "end-of-stream marker was reached. HINT: the file is truncated or corrupt",
    ],
    "bad_jsonl_not_gzip": [
        "x.jsonl.gz [after line 0]: damaged gzip stream; expected a complete gzip file, found Not a gzipped file"
    ],
    "bad_jsonl_not_utf8": [
        "x.jsonl [after line 0]: not UTF-8 text; expected UTF-8 JSON lines, found invalid start byte (b'\\xff\\xfe{}')"
    ],
    "bad_parquet_missing": [
        "x.parquet [column 'input_ids']: column not found; expected input_ids, found columns "
        "['tokens']. HINT: pass --column with the right column name"
    ],
    "bad_parquet_type": [
        "x.parquet [column 'input_ids']: column is not a list of integers; expected list<int>, found "
        "list<element: string>. HINT: pass --column with the token-id column"
    ],
    "bad_parquet_corrupt_page": [
        "x.parquet [after row ",
        "]: unreadable parquet data; expected a readable parquet file, found ",
        "HINT: the file is corrupt or truncated",
    ],
    "bad_arrow_stream_truncated": [
        "x.arrow [after row 2000]: unreadable arrow data; expected a readable arrow file, found Expected to be able to read"
    ],
    "bad_negative": ["negative token id", "document 1"],
    "bad_empty_file": ["empty input"],
    "bad_empty_dir": ["no input files"],
    "bad_mixed_dtypes": ["mixed token dtypes"],
    "bad_mixed_vocab": ["mixed vocabularies"],
    "bad_mixed_megatron": ["mixed token dtypes"],
    "bad_tokenizer_not_local": ["not a local file"],
    "bad_eos_unknown": ["EOS id unknown", "--eos-id"],
    "bad_vocab_unknown": ["vocabulary size unknown", "--vocab-size"],
}


@pytest.mark.parametrize("case", BAD, ids=lambda f: f.__name__)
def test_bad_input_is_one_line_and_no_output(case, corpus, tmp_path):
    args = case(corpus, tmp_path)
    out = tmp_path / "out"
    res = cli(*args, "-o", out)
    assert res.exit_code == 1, (res.output, res.stderr)
    lines = [x for x in res.stderr.splitlines() if not x.startswith("tokpack pack: detected")]
    assert len(lines) == 1 and lines[0].startswith("tokpack: error: "), res.stderr
    assert "Traceback" not in res.stderr
    for word in WHAT[case.__name__]:
        assert word in lines[0]
    assert not (out / MANIFEST).exists()
    assert not out.exists() or not list(out.rglob("*.ds"))


def test_missing_optional_module_is_one_line(monkeypatch, tmp_path):
    """A dependency missing at run time is named with the install hint, exit 1, no traceback."""

    def needs_tokenizers(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'tokenizers'", name="tokenizers")

    monkeypatch.setattr(packing, "pack", needs_tokenizers)
    r = CliRunner().invoke(main, ["pack", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out")])
    assert r.exit_code == 1
    assert r.stderr.strip().splitlines() == [
        "tokpack: error: this command needs the module 'tokenizers', which is not installed. HINT: pip install tokenizers"
    ]
    assert "Traceback" not in r.output


# ------------------------------------------------ known tokenizer names, --dtype


def write_named_datatrove(folder: Path, name: str = "gpt2", n: int = 30) -> list[list[int]]:
    """A datatrove folder written by datatrove's own TokenizedFile under a hub tokenizer name
    (datatrove's default is gpt2): uint16 ids below 50257, each document ending with EOS 50256.
    Nothing loads or downloads the tokenizer."""
    from datatrove.pipeline.tokens.tokenizer import TokenizedFile

    docs = [d.tolist() for d in random_docs(np.random.default_rng(5), n, 50257, 50256)]
    f = TokenizedFile(str(folder), "00000_unshuffled.ds", tokenizer_name_or_path=name, save_final_metadata=True)
    for d in docs:
        f.write(d, None)
    f.close()
    return docs


def one_error_line(res) -> str:
    assert res.exit_code == 1, (res.output, res.stderr)
    assert "Traceback" not in res.output + res.stderr
    lines = [x for x in res.stderr.splitlines() if not x.startswith("tokpack pack: detected")]
    assert len(lines) == 1 and lines[0].startswith("tokpack: error: "), res.stderr
    return lines[0]


@pytest.mark.parametrize("name", ["gpt2", "openai-community/gpt2"])
def test_known_tokenizer_in_datatrove_metadata(name, tmp_path):
    docs = write_named_datatrove(tmp_path / "dt", name)
    assert (tmp_path / "dt" / "00000_unshuffled.ds.metadata").read_text().startswith(f"{name}|2\n")
    res = cli(tmp_path / "dt", "-o", tmp_path / "a")
    assert res.exit_code == 0, res.stderr
    assert f"EOS id 50256 from the known tokenizer {name!r}" in res.stderr
    m = json.loads((tmp_path / "a" / MANIFEST).read_text())
    assert (m["eos_id"], m["vocab_size"], m["dtype"], m["tokenizer"]) == (50256, 50257, "uint16", name)
    assert packed_docs(tmp_path / "a") == docs and m["eos_appended"] == 0
    # explicit options win over the table: an EOS id its documents do not end with is refused
    # (they all end with 50256) unless --append-eos asks for one after each
    line = one_error_line(cli(tmp_path / "dt", "-o", tmp_path / "b", "--eos-id", 7, "--vocab-size", 60000))
    assert "expected 7 (--eos-id), found 50256 ending all" in line, line
    res = cli(tmp_path / "dt", "-o", tmp_path / "b", "--eos-id", 7, "--vocab-size", 60000, "--append-eos")
    assert res.exit_code == 0, res.stderr
    assert "known tokenizer" not in res.stderr
    m = json.loads((tmp_path / "b" / MANIFEST).read_text())
    assert (m["eos_id"], m["vocab_size"], m["eos_appended"]) == (7, 60000, len(docs))


def dtype_datatrove(t):
    write_named_datatrove(t / "dt")
    return [t / "dt"], "uint16"


def dtype_megatron(t):
    return [megatron_pair(t), "--eos-id", 0], "uint16"


def dtype_npy(t):
    np.save(t / "x.npy", np.array([3, 4, 0, 5, 0], dtype=np.int32))
    return [t / "x.npy", "--eos-id", 0, "--vocab-size", 10], "int32"


def dtype_parquet(t):
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2, 0], [3, 0]], type=pa.list_(pa.int32()))}), t / "x.parquet")
    return [t / "x.parquet", "--eos-id", 0, "--vocab-size", 10], "int32"


def dtype_arrow(t):
    with pa.OSFile(str(t / "x.arrow"), "wb") as sink:
        with pa.ipc.new_file(sink, pa.schema({"input_ids": pa.list_(pa.uint16())})) as w:
            w.write_table(pa.table({"input_ids": pa.array([[1, 2, 0], [3, 0]], type=pa.list_(pa.uint16()))}))
    return [t / "x.arrow", "--eos-id", 0], "uint16"


@pytest.mark.parametrize(
    "case", [dtype_datatrove, dtype_megatron, dtype_npy, dtype_parquet, dtype_arrow], ids=lambda f: f.__name__
)
def test_dtype_option_must_match_the_inputs_own_dtype(case, tmp_path):
    args, own = case(tmp_path)
    wrong = "uint32" if own != "uint32" else "uint16"
    line = one_error_line(cli(*args, "--dtype", wrong, "-o", tmp_path / "bad"))
    assert "[--dtype]" in line and f"expected {own}, found {wrong}" in line and "drop --dtype" in line
    assert not (tmp_path / "bad").exists()
    res = cli(*args, "--dtype", own, "-o", tmp_path / "ok")
    assert res.exit_code == 0, res.stderr
    assert (tmp_path / "ok" / MANIFEST).exists()


def test_dtype_option_refused_for_jsonl_and_text(tmp_path, tokenizer_path):
    (tmp_path / "ids.jsonl").write_text('{"input_ids": [1, 2, 0]}\n')
    line = one_error_line(
        cli(tmp_path / "ids.jsonl", "--eos-id", 0, "--vocab-size", 10, "--dtype", "uint16", "-o", tmp_path / "a")
    )
    assert "[--dtype]" in line and "only to raw token files" in line and "jsonl" in line
    (tmp_path / "text.jsonl").write_text('{"text": "the corpus"}\n')
    line = one_error_line(
        cli(tmp_path / "text.jsonl", "--tokenizer", tokenizer_path, "--dtype", "uint16", "-o", tmp_path / "b")
    )
    assert "only to raw token files" in line and "text" in line
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_dtype_option_still_reads_datatrove_without_metadata(tmp_path):
    """Without .ds.metadata the token size is unknown, so --dtype is what tells it."""
    docs = write_named_datatrove(tmp_path / "dt")
    (tmp_path / "dt" / "00000_unshuffled.ds.metadata").unlink()
    res = cli(tmp_path / "dt", "--dtype", "uint16", "--eos-id", 50256, "--vocab-size", 50257, "-o", tmp_path / "out")
    assert res.exit_code == 0, res.stderr
    assert packed_docs(tmp_path / "out") == docs


# ------------------------------------------------------------ durable shard files


@pytest.mark.parametrize("where", ["tmp", "shm"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pieces=st.lists(st.one_of(st.integers(0, 5000), st.integers(4090, 40000)), max_size=8),
    skew=st.sampled_from([0, 1, 512, 4095]),
)
def test_durable_file_writes_exact_bytes(tmp_path, monkeypatch, where, pieces, skew):
    """O_DIRECT with staging of unaligned data, the padded last block and the truncate, or
    the buffered fallback (tmpfs may refuse O_DIRECT): the file and its hash are exactly the
    bytes written, whatever the piece sizes and their alignment in memory. The staging
    buffer is shrunk to 16 KiB so that small pieces cross it."""
    import xxhash

    from tokpack.formats.io.writes import DurableFile
    from tokpack.formats.io import writes

    monkeypatch.setattr(writes, "DIRECT_STAGING", 16 << 10)

    base = tmp_path if where == "tmp" or not Path("/dev/shm").is_dir() else Path("/dev/shm")
    final = base / f"durable-{where}-{skew}.ds"
    data = np.random.default_rng(len(pieces) + skew).integers(0, 256, sum(pieces) + skew, dtype=np.uint8)
    f = DurableFile(final, direct=True)
    try:
        at = skew
        for n in pieces:
            f.write(data[at : at + n])
            at += n
        digest = f.commit()
        assert f.direct == _takes_o_direct(base)  # the direct path ran wherever it can, and never fell back
        assert final.read_bytes() == data[skew:].tobytes()
        assert digest == xxhash.xxh3_128_hexdigest(data[skew:].tobytes())
        assert not [p for p in base.iterdir() if p.name.startswith(final.name) and p != final]
    finally:
        final.unlink(missing_ok=True)


def _takes_o_direct(directory: Path) -> bool:
    import os

    probe = directory / "probe-o-direct"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def test_durable_file_abort_leaves_nothing(tmp_path):
    from tokpack.formats.io.writes import DurableFile

    f = DurableFile(tmp_path / "x.ds", direct=True)
    f.write(b"\1" * 10000)
    f.abort()
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ issue 32 item 7: bad data says so


def _warned(res) -> list[str]:
    return [x for x in res.stderr.splitlines() if "HINT" in x and not x.startswith("tokpack: error")]


def test_a_large_raw_input_without_eos_warns(tmp_path):
    """A raw file packed with the wrong --eos-id became '1 document' of 3.4M tokens with no word:
    it warns on stderr and in --json; the same file with EOS in it, or a small one, does not."""
    rng = np.random.default_rng(3)
    n = packing.ONE_DOCUMENT_TOKENS + 10
    raw = rng.integers(1, 1000, n).astype("<u2")
    raw.tofile(tmp_path / "train.bin")
    res = cli(
        tmp_path / "train.bin", "-o", tmp_path / "a", "--dtype", "uint16", "--eos-id", "0", "--vocab-size", "1000"
    )
    assert res.exit_code == 0, res.stderr
    [line] = _warned(res)
    assert "train.bin: no EOS id 0 in its" in line and f"{n:,} tokens" in line and "--eos-id" in line
    res = CliRunner().invoke(
        main,
        [
            "pack",
            str(tmp_path / "train.bin"),
            "-o",
            str(tmp_path / "j"),
            "--dtype",
            "uint16",
            "--eos-id",
            "0",
            "--vocab-size",
            "1000",
            "--json",
        ],
    )
    assert res.exit_code == 0 and json.loads(res.stdout)["warnings"] == [line], res.stdout
    with_eos = raw.copy()
    with_eos[::5000] = 0
    with_eos.tofile(tmp_path / "ok.bin")
    raw[: packing.ONE_DOCUMENT_TOKENS // 2].tofile(tmp_path / "small.bin")
    for name in ("ok.bin", "small.bin"):
        res = cli(
            tmp_path / name,
            "-o",
            tmp_path / name.replace(".", "-"),
            "--dtype",
            "uint16",
            "--eos-id",
            "0",
            "--vocab-size",
            "1000",
        )
        assert res.exit_code == 0 and not _warned(res), res.stderr


def test_documents_that_all_end_with_another_id_are_refused_unless_append_eos(tmp_path):
    """A gpt2 datatrove input (EOS 50256) packed with --eos-id 0 got an EOS appended to each of
    its documents, exit 0 with a warning, so CI passed it (issue 42, item 8). It is one error
    line now (the input, the EOS id expected, the id found ending every document, both ways
    out), exit 1, with no manifest and no shard left in OUT; --append-eos (append_eos=True)
    packs it as before. The right id, and documents ending with assorted ids, pack as before."""
    import tokpack

    write_named_datatrove(tmp_path / "dt", "gpt2", 40)
    write_named_datatrove(tmp_path / "dt2", "gpt2", 40)
    for args in ([], [tmp_path / "dt2", "--workers", "2"]):  # the task's check, in this process and in workers
        line = one_error_line(cli(tmp_path / "dt", "-o", tmp_path / "a", "--eos-id", "0", *args))
        assert "00000_unshuffled.ds [last token of each of its 40 documents]: no document ends with the EOS id" in line
        assert "expected 0 (--eos-id), found 50256 ending all 40" in line, line
        assert "pass --eos-id 50256" in line and "--append-eos" in line, line
        assert not (tmp_path / "a").exists()  # nothing that could pass for data, not even the folder
    rows = lambda docs: "".join(json.dumps({"input_ids": d.tolist()}) + "\n" for d in docs)  # noqa: E731
    (tmp_path / "good.jsonl").write_text(rows(random_docs(np.random.default_rng(2), 30, 1000, 0)))
    (tmp_path / "bad.jsonl").write_text(
        rows([np.append(d[:-1], 7) for d in random_docs(np.random.default_rng(3), 9, 7, 0)])
    )
    line = one_error_line(
        cli(
            tmp_path / "good.jsonl",
            tmp_path / "bad.jsonl",
            "-o",
            tmp_path / "a",
            "--eos-id",
            "0",
            "--vocab-size",
            "1000",
        )
    )
    assert "bad.jsonl [last token of each of its 9 documents]" in line and "found 7 ending all 9" in line, line
    assert not (tmp_path / "a").exists()
    (tmp_path / "kept").mkdir()  # an OUT that existed keeps nothing of the refused pack either
    res = cli(tmp_path / "dt", "-o", tmp_path / "kept", "--eos-id", "0", "--json")
    assert res.exit_code == 1 and "no document ends with the EOS id" in res.stdout + res.stderr
    assert list((tmp_path / "kept").iterdir()) == []
    with pytest.raises(TokpackError, match="found 50256 ending all 40"):
        tokpack.pack([str(tmp_path / "dt")], str(tmp_path / "api"), eos_id=0)
    assert not (tmp_path / "api").exists()

    res = cli(
        tmp_path / "dt", tmp_path / "dt2", "-o", tmp_path / "b", "--eos-id", "0", "--append-eos", "--workers", "2"
    )
    assert res.exit_code == 0 and not _warned(res), res.stderr
    m = json.loads((tmp_path / "b" / MANIFEST).read_text())
    assert m["eos_appended"] == 80 and m["documents"] == 80 and m["request"]["append_eos"] is True
    assert all(d[-2:] == [50256, 0] for d in packed_docs(tmp_path / "b"))
    r = tokpack.pack([str(tmp_path / "dt"), str(tmp_path / "dt2")], str(tmp_path / "api"), eos_id=0, append_eos=True)
    assert r.eos_appended == 80 and r.warnings == [] and r.fingerprint == m["fingerprint"]
    # the accepted pack is not taken for a rerun of the refused one
    line = one_error_line(cli(tmp_path / "dt", "-o", tmp_path / "b", "--eos-id", "0"))
    assert "already holds a different packed source" in line
    line = one_error_line(cli(tmp_path / "dt", "-o", tmp_path / "b", "--eos-id", "0", "--overwrite"))
    assert "found 50256 ending all 40" in line and not (tmp_path / "b" / MANIFEST).exists()

    res = cli(tmp_path / "dt", "-o", tmp_path / "c")  # EOS 50256 from the metadata: nothing appended
    assert res.exit_code == 0 and not _warned(res), res.stderr
    c = json.loads((tmp_path / "c" / MANIFEST).read_text())
    assert c["eos_appended"] == 0 and "append_eos" not in c["request"]  # the request as before
    docs = [d[:-1] for d in random_docs(np.random.default_rng(1), 40, 1000, 0)]  # no EOS, assorted last ids
    (tmp_path / "x.jsonl").write_text("".join(json.dumps({"input_ids": d.tolist()}) + "\n" for d in docs))
    res = cli(tmp_path / "x.jsonl", "-o", tmp_path / "d", "--eos-id", "0", "--vocab-size", "1000")
    assert res.exit_code == 0 and not _warned(res), res.stderr
    assert json.loads((tmp_path / "d" / MANIFEST).read_text())["eos_appended"] == 40
    (tmp_path / "one.jsonl").write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n")  # one document says nothing
    res = cli(tmp_path / "one.jsonl", "-o", tmp_path / "e", "--eos-id", "0", "--vocab-size", "1000")
    assert res.exit_code == 0 and not _warned(res), res.stderr


def test_an_unknown_vocabulary_is_recorded_as_unknown_and_named_by_validate(tmp_path):
    """Without --vocab-size or a tokenizer the id check is only the dtype's width: the manifest
    says `vocab_known: false` (a known vocabulary writes no such field, so manifests are as
    before), pack says so naming the hub tokenizer its metadata names, and validate names it."""
    import tokpack

    write_named_datatrove(tmp_path / "dt", "meta-llama/Meta-Llama-3-8B", 20)
    res = cli(tmp_path / "dt", "-o", tmp_path / "a", "--eos-id", "50256")
    assert res.exit_code == 0, res.stderr
    [line] = _warned(res)
    assert "vocabulary size unknown" in line and "'meta-llama/Meta-Llama-3-8B'" in line and "--vocab-size" in line
    m = json.loads((tmp_path / "a" / MANIFEST).read_text())
    assert m["vocab_known"] is False and m["vocab_size"] == 65536
    r = tokpack.pack([str(tmp_path / "dt")], str(tmp_path / "api"), eos_id=50256)
    assert r.warnings == [line] and json.loads((tmp_path / "api" / MANIFEST).read_text())["vocab_known"] is False
    res = CliRunner().invoke(main, ["validate", str(tmp_path / "a")])
    assert res.exit_code == 0 and "vocabulary unknown: ids checked only against the token width, 65536" in res.output
    v = tokpack.validate([str(tmp_path / "a")])
    assert v.ok and v.dirs[0]["vocab_known"] is False
    res = cli(tmp_path / "dt", "-o", tmp_path / "k", "--eos-id", "50256", "--vocab-size", "128256")
    assert res.exit_code == 0 and not _warned(res), res.stderr
    assert "vocab_known" not in json.loads((tmp_path / "k" / MANIFEST).read_text())
    res = CliRunner().invoke(main, ["validate", str(tmp_path / "k")])
    assert res.exit_code == 0 and "vocabulary unknown" not in res.output


def test_a_hub_tokenizer_in_datatrove_metadata_is_named_in_the_eos_error(tmp_path):
    write_named_datatrove(tmp_path / "dt", "meta-llama/Meta-Llama-3-8B", 5)
    line = one_error_line(cli(tmp_path / "dt", "-o", tmp_path / "a"))
    assert "EOS id unknown" in line and "names the tokenizer 'meta-llama/Meta-Llama-3-8B'" in line
    assert (
        "HINT: pass --eos-id N, the end-of-document id of meta-llama/Meta-Llama-3-8B" in line and "--tokenizer" in line
    )
    assert not (tmp_path / "a").exists()


def test_inputs_inside_the_output_are_refused_and_kept(tmp_path):
    """`pack out/*.ds -o out --overwrite` (a glob over an old pack's own shards) deleted the old
    pack, its inputs, then failed on the missing files: every token lost. An input inside -o is
    refused before anything is written or deleted, through a symlink too."""
    np.array([3, 4, 0, 5, 6, 7, 0], dtype=np.uint16).tofile(tmp_path / "x.tok")
    opts = ["--dtype", "uint16", "--eos-id", "0", "--vocab-size", "10"]
    out = tmp_path / "out"
    assert cli(tmp_path / "x.tok", "-o", out, *opts).exit_code == 0
    before = tree_bytes(out)
    (tmp_path / "via").symlink_to(out)
    for shards in ([out / "00000.ds"], [tmp_path / "via" / "00000.ds"]):
        for extra in ([], ["--overwrite"]):
            res = cli(*shards, "-o", out, "--shard-tokens", 3, *extra)
            line = one_error_line(res)
            assert "00000.ds [INPUT]: an input lies inside the output directory" in line, line
            assert tree_bytes(out) == before
    res = CliRunner().invoke(main, ["pack", str(out / "00000.ds"), "-o", str(out), "--overwrite", "--json"])
    assert res.exit_code == 1 and json.loads(res.stdout)["ok"] is False and tree_bytes(out) == before
    assert cli(out / "00000.ds", "-o", tmp_path / "elsewhere", "--eos-id", 0, "--vocab-size", 10).exit_code == 0


def write_datatrove(ds: Path, docs: list[list[int]]) -> None:
    """A uint16 datatrove file `ds` (with its index and metadata) holding `docs`."""
    ds.parent.mkdir(parents=True, exist_ok=True)
    np.array([t for d in docs for t in d], dtype="<u2").tofile(ds)
    np.cumsum([len(d) for d in docs]).astype("<u8").tofile(f"{ds}.index")
    Path(f"{ds}.metadata").write_text(f"tok|2\n{sum(map(len, docs))}")


@pytest.mark.parametrize("link", [False, True])
def test_an_input_rewritten_in_place_between_a_kill_and_its_rerun_is_packed_again(tmp_path, monkeypatch, link):
    """A pack killed after input 0's part, input 0 then rewritten in place at its size (the request
    records sizes only), resumed: the rerun kept input 0's old part, a packed source of tokens no
    input holds any more. The part is packed again: the output is a fresh pack's of the new inputs."""
    folder = tmp_path / "in"
    for i in range(3):
        write_datatrove(folder / f"f{i}.ds", [[i + 1, 5, 0], [7, 8, 9, 0]])
    opts = {"eos_id": 0, "vocab_size": 20, "link": link}
    real = packing.PackStep.pack_file

    def dies_on_file_2(self, i):
        if i == 2:
            raise KeyboardInterrupt
        return real(self, i)

    monkeypatch.setattr(packing.PackStep, "pack_file", dies_on_file_2)
    with pytest.raises(KeyboardInterrupt):
        pack([str(folder)], str(tmp_path / "out"), **opts)
    assert (tmp_path / "out" / ".tokpack-work" / "part-00000.json").exists()
    monkeypatch.setattr(packing.PackStep, "pack_file", real)
    ds = folder / "f0.ds"
    size = ds.stat().st_size
    with open(ds, "r+b") as fh:  # in place, as datatrove's "wb" rerun or dd conv=notrunc does
        fh.write(np.array([4, 6, 0, 3, 8, 9, 0], dtype="<u2").tobytes())
    assert ds.stat().st_size == size
    pack([str(folder)], str(tmp_path / "out"), **opts)
    pack([str(folder)], str(tmp_path / "fresh"), **opts)
    assert packed_docs(tmp_path / "out")[:2] == [[4, 6, 0], [3, 8, 9, 0]]
    assert tree_bytes(tmp_path / "out") == tree_bytes(tmp_path / "fresh")


def test_shard_named_files_of_no_pack_are_not_deleted_by_overwrite(tmp_path, monkeypatch):
    """A folder holding a user's 00000.ds, .ds.index, .ds.metadata (no tokpack.json, no work
    folder) was called 'an unfinished pack of other inputs', HINT --overwrite, which deleted them.
    Refused, with or without --overwrite, the files kept. A replace killed while clearing an old
    pack leaves its tokpack.json (deleted last), so --overwrite still finishes it."""
    write_datatrove(tmp_path / "in" / "a.ds", [[1, 5, 0], [7, 8, 9, 0]])
    mine = tmp_path / "mine"
    write_datatrove(mine / "00000.ds", [[2, 2, 0]])
    before = tree_bytes(mine)
    for extra in ([], ["--overwrite"]):
        line = one_error_line(cli(tmp_path / "in", "-o", mine, "--eos-id", 0, "--vocab-size", 10, *extra))
        assert "output directory holds shard-named files but no tokpack.json" in line, line
        assert "found 00000.ds, 00000.ds.index, 00000.ds.metadata" in line and "--overwrite" not in line
        assert tree_bytes(mine) == before
    out = tmp_path / "out"
    assert cli(tmp_path / "in", "-o", out, "--eos-id", 0, "--vocab-size", 10, "--shard-tokens", 3).exit_code == 0
    real_clear, real_unlink, real_iterdir = packing.clear_output, Path.unlink, Path.iterdir

    def killed_after_one_file(directory):  # listing tokpack.json first, as a directory may
        def unlink(self, *a, **kw):
            real_unlink(self, *a, **kw)
            raise KeyboardInterrupt

        with monkeypatch.context() as m:
            m.setattr(Path, "unlink", unlink)
            m.setattr(Path, "iterdir", lambda self: iter(sorted(real_iterdir(self), key=lambda p: p.name != MANIFEST)))
            real_clear(directory)

    monkeypatch.setattr(packing, "clear_output", killed_after_one_file)
    with pytest.raises(KeyboardInterrupt):
        pack([str(tmp_path / "in")], str(out), eos_id=0, vocab_size=10, overwrite=True)
    assert (out / MANIFEST).exists()
    monkeypatch.setattr(packing, "clear_output", real_clear)
    assert cli(tmp_path / "in", "-o", out, "--eos-id", 0, "--vocab-size", 10, "--overwrite").exit_code == 0
    assert packed_docs(out) == [[1, 5, 0], [7, 8, 9, 0]]


def test_an_input_written_to_while_pack_reads_it_is_refused(tmp_path, monkeypatch):
    """An input rewritten in place while a copying pack read it (a datatrove rerun into the input
    folder) gave shards of old and new bytes mixed, in silence; pack --link refused the same. It
    fails in one line, with no part record, and a rerun packs the input as it now is."""
    ds = tmp_path / "in" / "a.ds"
    write_datatrove(ds, [[1, 5, 0], [7, 8, 9, 0]] * 40)
    real = packing.read_blocks

    def written_after_the_first_block(f, *a, **kw):
        blocks = real(f, *a, **kw)
        yield next(blocks)
        before = ds.stat().st_mtime_ns
        with open(ds, "r+b") as fh:  # in place, the size kept
            fh.write(np.array([2, 6, 0], dtype="<u2").tobytes())
        os.utime(ds, ns=(before, before + 10**9))  # a clock tick later, however coarse the filesystem's
        yield from blocks

    monkeypatch.setattr(packing, "read_blocks", written_after_the_first_block)
    res = cli(tmp_path / "in", "-o", tmp_path / "out", "--eos-id", 0, "--vocab-size", 10)
    line = one_error_line(res)
    assert "a.ds: input changed while pack read it" in line and "HINT: rerun once nothing writes" in line, line
    assert not (tmp_path / "out" / MANIFEST).exists()
    assert not list((tmp_path / "out").rglob("part-*.json"))
    monkeypatch.setattr(packing, "read_blocks", real)
    assert cli(tmp_path / "in", "-o", tmp_path / "out", "--eos-id", 0, "--vocab-size", 10).exit_code == 0
    assert packed_docs(tmp_path / "out")[:2] == [[2, 6, 0], [7, 8, 9, 0]]
