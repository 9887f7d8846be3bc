"""The training-side reader (loader/reader.py), its torch adapter and `tokpack read`.

Epoch directories are written here with the real shard writer; every row is
`expected_row(epoch, g)`, so each assertion can tell WHICH sample came back.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

from tokpack.formats.errors import IncompleteError, TokpackError
from tokpack.formats.builders import ShuffleFields, TokenHeader, epoch_manifest, run_manifest
from tokpack.formats.names import epoch_dir_name, shard_name
from tokpack.formats.reading import write_manifest
from tokpack.formats.shards import EpochShardWriter
from tokpack.loader.reader import SampleReader, positions_from_eos

SEQ = 15  # a row is 16 tokens
EOS = 0
VOCAB = 1000


def expected_row(epoch: int, g: int, seq_len: int = SEQ) -> np.ndarray:
    """Row g of epoch e: token 0 names the sample, token 1 the epoch, the rest are
    pseudo-documents with EOS at seeded places."""
    rng = np.random.default_rng(epoch * 1_000_003 + g)
    row = rng.integers(1, VOCAB, size=seq_len + 1)
    row[2:][rng.random(seq_len - 1) < 0.15] = EOS
    row[0], row[1] = 1000 + g, 1 + epoch
    return row.astype(np.uint16)


def make_epoch(directory: Path, epoch: int, samples: int, shard_samples: int, seq_len: int = SEQ) -> Path:
    """An epoch directory as shuffle writes it (shards, index, metadata, manifest last), its
    manifest complete: every command checks it before use."""
    directory.mkdir(parents=True, exist_ok=True)
    shards = []
    for i, lo in enumerate(range(0, samples, shard_samples)):
        w = EpochShardWriter(directory, shard_name(i), np.uint16, seq_len, EOS, "test-tokenizer")
        w.write_rows(np.stack([expected_row(epoch, g, seq_len) for g in range(lo, min(samples, lo + shard_samples))]))
        entry = w.close()
        shards.append({**entry, "fragments": (directory / f"{entry['path']}.index").stat().st_size // 8})
    write_manifest(
        directory,
        epoch_manifest(
            shards,
            TokenHeader(np.dtype("<u2"), VOCAB, EOS, "test-tokenizer"),
            ShuffleFields(
                seed=1, seq_len=seq_len, samples=samples, shard_samples=shard_samples, jitter=False, shuffle="test"
            ),
            tokens=samples * (seq_len + 1),
            epoch=epoch,
            dropped_tokens=0,
            sources=[_source_entry(epoch, samples, seq_len)],
        ),
    )
    return directory


def _source_entry(epoch: int, samples: int, seq_len: int) -> dict:
    """One source that gives the epoch all its samples, one window each, in one pass."""
    return {
        "name": "src",
        "path": "src",
        "fingerprint": "0" * 32,
        "tokens": samples * (seq_len + 1),
        "weight": None,
        "samples": samples,
        "first_pass": epoch,
        "passes": 1,
        "windows": samples,
        "offset": 0,
        "dropped_tokens": 0,
    }


def make_run(out: Path, sizes: dict[int, int], shard_samples: int = 7) -> Path:
    epochs = {e: make_epoch(out / epoch_dir_name(e), e, n, shard_samples) for e, n in sizes.items()}
    # Epochs of different sizes: the run plans each one's size (epoch_samples), as FORMAT.md allows.
    equal = len(set(sizes.values())) == 1
    extra = {} if equal else {"epoch_samples": [sizes.get(e, 0) for e in range(max(sizes) + 1)]}
    manifests = {e: json.loads((d / "tokpack.json").read_text()) for e, d in epochs.items()}
    write_manifest(
        out,
        run_manifest(
            manifests,
            TokenHeader(np.dtype("<u2"), VOCAB, EOS, "test-tokenizer"),
            ShuffleFields(
                seed=1,
                seq_len=SEQ,
                samples=next(iter(sizes.values())) if equal else 0,
                shard_samples=shard_samples,
                jitter=False,
                shuffle="test",
            ),
            sources=[_source_entry(0, 1, SEQ)],
            weights=None,
            extra=extra,
        ),
    )
    return out


def chained(sizes: dict[int, int]) -> list[tuple[int, int]]:
    """(epoch, sample) of every sample of the chained stream, in order."""
    return [(e, s) for e in sorted(sizes) for s in range(sizes[e])]


def ids(rows: np.ndarray) -> list[tuple[int, int]]:
    """Which (epoch, sample) each row is, read back from its first two tokens."""
    return [(int(r[1]) - 1, int(r[0]) - 1000) for r in rows]


SIZES = {0: 53, 1: 41, 2: 30}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("reader") / "run", SIZES)


# ------------------------------------------------------------------- order


def test_reads_every_sample_in_chained_order(run_dir):
    r = SampleReader.open(run_dir)
    assert r.total_samples == sum(SIZES.values()) and r.epochs == [0, 1, 2] and r.seq_len == SEQ
    rows = np.concatenate(list(r.batches(0, 1, 4, at_end="stop")))
    order = chained(SIZES)
    usable = len(order) // 4 * 4  # only complete global batches are served
    assert ids(rows) == order[:usable]
    for (e, s), row in zip(order, rows):
        np.testing.assert_array_equal(row, expected_row(e, s))


def test_list_of_epoch_dirs_chains_in_given_order(run_dir):
    r = SampleReader.open([run_dir / epoch_dir_name(2), run_dir / epoch_dir_name(0)])
    assert r.epochs == [2, 0]
    assert ids(r.read(29, 2)) == [(2, 29), (0, 0)]  # crosses the epoch boundary


@settings(max_examples=40, deadline=None)
@given(world=st.integers(1, 5), micro=st.integers(1, 4), start=st.integers(0, 124))
def test_rank_slices_follow_megatron_formula(run_dir, world, micro, start):
    r = SampleReader.open(run_dir)
    order = chained(SIZES)
    per_rank = [list(r.batches(rank, world, micro, start, at_end="stop")) for rank in range(world)]
    steps = (len(order) - start) // (world * micro)
    assert all(len(p) == steps for p in per_rank)  # every rank stops at the same step
    for b in range(steps):
        batch = []
        for rank in range(world):
            got = ids(per_rank[rank][b])
            lo = start + b * world * micro + rank * micro
            assert got == order[lo : lo + micro]  # rank r takes [r*m, (r+1)*m) of global batch b
            batch += got
        # together the ranks cover the global batch exactly once
        assert sorted(batch) == order[start + b * world * micro : start + (b + 1) * world * micro]


@settings(max_examples=25, deadline=None)
@given(world=st.integers(1, 4), micro=st.integers(1, 3), skip=st.integers(0, 20), workers=st.integers(1, 3))
def test_resume_equals_skip(run_dir, world, micro, skip, workers):
    """Resuming at consumed sample G == reading from 0 and dropping the first G / (W*m) steps."""
    r = SampleReader.open(run_dir)
    full = list(r.batches(world - 1, world, micro, 0, at_end="stop"))
    skip = min(skip, len(full))
    g = skip * world * micro
    resumed = list(r.batches(world - 1, world, micro, g, at_end="stop"))
    assert [ids(x) for x in resumed] == [ids(x) for x in full[skip:]]
    # DataLoader-style worker split: interleaving the workers' items gives the same stream
    parts = [
        list(r.batches(world - 1, world, micro, g, worker=w, num_workers=workers, at_end="stop"))
        for w in range(workers)
    ]
    merged = [parts[i % workers][i // workers] for i in range(sum(map(len, parts)))]
    assert [ids(x) for x in merged] == [ids(x) for x in resumed]


def test_elastic_world_size_keeps_global_order(run_dir):
    """Same global batch (16) with W=4,m=2,accum=2 then W=8,m=2,accum=1 from the consumed count."""
    r = SampleReader.open(run_dir)
    order = chained(SIZES)

    def global_stream(world, micro, start, steps):
        ranks = [list(r.batches(k, world, micro, start, steps=steps)) for k in range(world)]
        return [s for b in range(steps) for k in range(world) for s in ids(ranks[k][b])]

    first = global_stream(4, 2, 0, 6)  # 3 optimizer steps of 16 samples
    consumed = 48
    second = global_stream(8, 2, consumed, 4)
    assert first + second == order[: consumed + 64]


def test_start_from_tokens_and_bounds(run_dir):
    r = SampleReader.open(run_dir)
    assert r.start_from() == 0
    assert r.start_from(consumed_tokens=SEQ * 60 + SEQ - 1) == 60
    assert r.locate(60) == (1, 7) and r.position(1, 7) == 60
    assert r.start_from(start_sample=r.total_samples) == r.total_samples
    assert list(r.batches(0, 1, 1, r.total_samples, at_end="stop")) == []  # asked to stop there
    with pytest.raises(TokpackError, match="beyond the end"):
        r.start_from(start_sample=r.total_samples + 1)


def test_positions_from_eos_and_index_agree_with_datatrove_convention(run_dir):
    r = SampleReader.open(run_dir)
    for world, micro, start in ((1, 1, 0), (2, 4, 5), (1, 3, 40)):  # every row, across shard and epoch ends
        pairs = list(r.batches(world - 1, world, micro, start, positions="index", at_end="stop"))
        assert len(pairs) == (r.total_samples - start) // (world * micro)
        for rows, pos in pairs:
            np.testing.assert_array_equal(pos, positions_from_eos(rows, EOS))
    for (rows_e, pos_e), (rows_i, pos_i) in zip(
        r.batches(1, 3, 5, 3, positions="eos", at_end="stop"), r.batches(1, 3, 5, 3, positions="index", at_end="stop")
    ):
        np.testing.assert_array_equal(rows_e, rows_i)
        np.testing.assert_array_equal(pos_e, pos_i)
        for row, pos in zip(rows_e, pos_e):
            expect, p = [], 0
            for j in range(len(row)):  # restart AFTER each EOS
                expect.append(p)
                p = 0 if row[j] == EOS else p + 1
            assert pos.tolist() == expect
    assert positions_from_eos(np.array([5, 0, 7, 8, 0, 0, 3]), 0).tolist() == [[0, 1, 0, 1, 2, 0, 0]]


# ------------------------------------------------------------- datatrove


@pytest.fixture(scope="module")
def shuffled_run(tmp_path_factory) -> tuple[Path, np.ndarray]:
    """A real run written by the shuffle engine: 2 epochs of a 3-shard packed source."""
    from conftest import (
        random_docs,
        shuffle_run,
        write_source,
    )  # the project's own engine: an import error must fail, not skip

    base = tmp_path_factory.mktemp("shuffled")
    docs = random_docs(np.random.default_rng(11), 150, VOCAB, EOS)
    src = write_source(base / "src", docs)
    shuffle_run([str(src)], str(base / "run"), seq_len=SEQ, seed=5, epochs=[0, 1], shard_samples=40)
    stream = np.concatenate(docs).astype(np.uint16)
    windows = stream[: len(stream) // (SEQ + 1) * (SEQ + 1)].reshape(-1, SEQ + 1)
    return base / "run", windows


def sort_rows(rows: np.ndarray) -> np.ndarray:
    return rows[np.lexsort(rows.T[::-1])]


def test_real_shuffled_run(shuffled_run):
    from tokpack.formats.hashes import hash_hex64, row_hashes
    from tokpack.formats.reading import read_manifest

    run, windows = shuffled_run
    r = SampleReader.open(run)
    n = len(windows)
    assert r.epochs == [0, 1] and r.total_samples == 2 * n
    world, micro = 3, 2
    parts = [list(r.batches(k, world, micro, 0, positions="index", at_end="stop")) for k in range(world)]
    rows = np.concatenate([parts[k][b][0] for b in range(len(parts[0])) for k in range(world)])
    np.testing.assert_array_equal(rows, r.read(0, len(rows)))  # ranks interleave into the chained stream
    epochs = [r.read(0, n), r.read(n, n)]
    for e, rows_e in enumerate(epochs):
        # each epoch holds every window of the source exactly once...
        np.testing.assert_array_equal(sort_rows(rows_e), sort_rows(windows))
        m = read_manifest(run / epoch_dir_name(e), kind="epoch")
        assert hash_hex64(int(row_hashes(rows_e).sum(dtype=np.uint64))) == m["sample_multiset_hash"]
    assert not np.array_equal(epochs[0], epochs[1])  # ...in an order of its own
    for b in range(len(parts[0])):  # the engine's .ds.index gives the same positions as EOS
        tokens, pos = parts[1][b]
        np.testing.assert_array_equal(pos, positions_from_eos(tokens, EOS))


def test_matches_datatrove_folder_dataset(run_dir, shuffled_run):
    """The contract: datatrove's own reader sees the same samples, in the same order, with
    the same positions: on one epoch, and on a real shuffled run read recursively (chained)."""
    real_run = shuffled_run[0]
    code = (
        "import json, sys, numpy as np\n"
        "from datatrove.utils.dataset import DatatroveFolderDataset\n"
        "out = []\n"
        f"for d, pattern in (({str(run_dir / epoch_dir_name(1))!r}, '.ds'), ({str(real_run)!r}, '**/*.ds')):\n"
        f"    ds = DatatroveFolderDataset(d, {SEQ}, filename_pattern=pattern, token_size=2, return_positions=True)\n"
        "    out.append([[ds[i]['input_ids'].tolist(), ds[i]['positions'].tolist()] for i in range(len(ds))])\n"
        "print(json.dumps(out))\n"
    )
    # a child process: datatrove.utils.dataset imports torch, which this reader must never need
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    for theirs, path in zip(json.loads(out.stdout), (run_dir / epoch_dir_name(1), real_run)):
        r = SampleReader.open(path)
        ours = [
            (rows[0].tolist(), pos[0].tolist()) for rows, pos in r.batches(0, 1, 1, positions="index", at_end="stop")
        ]
        assert len(ours) == r.total_samples > 0
        assert [tuple(x) for x in theirs] == ours


def test_reader_does_not_import_torch(run_dir):
    code = (
        "import sys\nfrom tokpack.loader.reader import SampleReader\n"
        f"r = SampleReader.open({str(run_dir)!r}); list(r.batches(0, 2, 2, 5, positions='index', at_end='stop'))\n"
        "bad = [m for m in ('torch', 'datatrove.utils.dataset') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


# ------------------------------------------------------------- bad data


def test_incomplete_directory(tmp_path):
    (tmp_path / "epoch-00000").mkdir()
    with pytest.raises(IncompleteError):
        SampleReader.open(tmp_path / "epoch-00000")


def test_missing_epoch_of_run_is_incomplete(tmp_path):
    run = make_run(tmp_path / "run", {0: 10, 1: 10})
    (run / epoch_dir_name(1) / "tokpack.json").unlink()
    with pytest.raises(IncompleteError, match="epoch-00001"):
        SampleReader.open(run)


@pytest.mark.parametrize("damage", ["truncate", "missing", "grow"])
def test_bad_shard_size_fails_at_open_naming_the_file(tmp_path, damage):
    run = make_run(tmp_path / "run", {0: 20, 1: 20})
    shard = run / epoch_dir_name(1) / "00002.ds"
    if damage == "missing":
        shard.unlink()
    else:
        os.truncate(shard, shard.stat().st_size + (-2 if damage == "truncate" else 32))
    with pytest.raises(TokpackError) as err:
        SampleReader.open(run)  # before any sample is returned
    assert str(shard) in str(err.value)
    assert ("missing" if damage == "missing" else "size") in str(err.value)


def test_verify_catches_flipped_byte_before_returning_its_data(tmp_path):
    run = make_run(tmp_path / "run", {0: 21})
    shard = run / epoch_dir_name(0) / "00001.ds"  # samples 7..13
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF  # token 5 of sample 7
    shard.write_bytes(bytes(data))
    unchecked = SampleReader.open(run)  # the size is right: only a checksum can tell
    assert not np.array_equal(unchecked.read(7, 1)[0], expected_row(0, 7))
    for world, before in ((2, [0, 2, 4, 6]), (1, [])):  # W=1 reads blocks spanning shards: fails first
        r = SampleReader.open(run, verify=True)
        got = []
        with pytest.raises(TokpackError, match="checksum mismatch") as err:
            for rows in r.batches(0, world, 1):
                assert np.array_equal(rows[0], expected_row(*ids(rows)[0]))
                got.append(ids(rows)[0])
        assert str(shard) in str(err.value)
        assert got == [(0, s) for s in before]  # only shard 0's samples came out, all intact
    from tokpack.packer.cli import main

    res = CliRunner().invoke(main, ["read", str(run), "--verify", "--world-size", "2", "--count", "20", "--json"])
    assert res.exit_code == 1 and str(shard) in res.output and "checksum mismatch" in res.output
    printed = [json.loads(x) for x in res.output.splitlines() if x.startswith('{"epoch')]
    assert [(x["epoch"], x["sample"]) for x in printed] == [(0, s) for s in (0, 2, 4, 6)]
    assert all(x["tokens"] == expected_row(0, x["sample"]).tolist() for x in printed)


# ------------------------------------------------------------- flat cost

GBS, SEQ_BIG = 576, 4096
NEAR, FAR = 32_000 * GBS, 3_200_000 * GBS


def virtual_reader(tmp_path: Path) -> SampleReader:
    """An epoch description of ~1.85e9 samples of 4097 tokens (15 TB) whose shards all name
    one sparse file: nothing of that volume is written."""
    shard_samples = 147_456  # divides both starts, so both begin at the same offset of the same file
    row_bytes = (SEQ_BIG + 1) * 2
    ds = tmp_path / "00000.ds"
    with open(ds, "wb") as f:
        f.truncate(shard_samples * row_bytes)  # sparse: reads zeros, occupies no disk
    n_shards = FAR // shard_samples + 2
    manifest = {
        "format": "tokpack",
        "version": 1,
        "kind": "epoch",
        "epoch": 0,
        "seq_len": SEQ_BIG,
        "dtype": "uint16",
        "token_size": 2,
        "eos_id": 1,
        "samples": n_shards * shard_samples,
        "shard_samples": shard_samples,
        "shards": [{"path": "00000.ds", "samples": shard_samples, "bytes": shard_samples * row_bytes}] * n_shards,
    }
    return SampleReader.from_manifests([(tmp_path, manifest)])


def test_flat_memory_and_reads_from_step_0_to_3_2_million(tmp_path):
    r = virtual_reader(tmp_path)
    assert r.total_samples > FAR + 10 * GBS

    def cost(start: int, world: int) -> tuple[int, int, int]:
        reads = r.reads
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        stream = r.batches(world - 1, world, GBS // world, start, positions="eos")
        for _ in range(3):
            tokens, pos = next(stream)
            assert tokens.shape == pos.shape == (GBS // world, SEQ_BIG + 1)
        peak = tracemalloc.get_traced_memory()[1] - before
        del stream, tokens, pos
        return peak, r.reads - reads, r.bytes_read

    tracemalloc.start()
    try:
        for world in (8, 1):  # strided ranks, and one contiguous rank (block reads)
            cost(0, world)  # warm up: open the file, first-call allocations
            zero, near, far = cost(0, world), cost(NEAR, world), cost(FAR, world)
            assert far[1] == near[1] == zero[1]  # same number of preads
            # The far start allocates no more than the near one or a fresh run. The slack is
            # Python's: an int above 2**30 takes 4 more bytes, and freelists shift a few dozen bytes.
            assert far[0] <= near[0] + 1024 and near[0] <= zero[0] + 1024
            assert far[0] < 64 << 20  # the rows themselves, not an index of 1.8e9 samples
    finally:
        tracemalloc.stop()


# ------------------------------------------------------------- torch, CLI


def test_a_stateful_dataloader_over_the_dataset_warns_nothing(run_dir):
    """torchdata 0.11 calls torch.set_vital, gone from torch 2.13: every loader printed a
    deprecation warning. None now, while building the loader and iterating it."""
    import warnings

    from torchdata.stateful_dataloader import StatefulDataLoader

    from tokpack.loader.torch_adapter import TokpackDataset

    ds = TokpackDataset(run_dir, micro_batch=2)
    with warnings.catch_warnings(record=True) as caught:  # entering resets the once-per-place registries
        loader = StatefulDataLoader(ds, batch_size=None)
        batch = next(iter(loader))
        loader.state_dict()
    assert [f"{w.filename}:{w.lineno}: {w.message}" for w in caught] == []
    assert int(batch["consumed_samples"]) == 2


def test_torch_adapter_workers_cover_each_sample_once_and_resume(run_dir):
    import torch
    from torch.utils.data import DataLoader

    from tokpack.loader.torch_adapter import TokpackDataset

    world, micro = 2, 3
    order = chained(SIZES)
    ds = TokpackDataset(run_dir, rank=1, world_size=world, micro_batch=micro, positions="eos", at_end="stop")
    batches = list(DataLoader(ds, batch_size=None, num_workers=2))
    steps = len(order) // (world * micro)
    assert len(batches) == steps
    for b, batch in enumerate(batches):
        lo = b * world * micro + micro
        expect = np.stack([expected_row(e, s) for e, s in order[lo : lo + micro]]).astype(np.int64)
        assert torch.equal(batch["input_ids"], torch.from_numpy(expect[:, :-1]))
        assert torch.equal(batch["labels"], torch.from_numpy(expect[:, 1:]))
        assert torch.equal(batch["position_ids"], torch.from_numpy(positions_from_eos(expect, EOS)[:, :-1]).long())
        assert int(batch["consumed_samples"]) == (b + 1) * world * micro

    state = ds.state_dict(batches[9])
    assert state == {"epoch": 1, "sample": 60 - 53, "consumed_samples": 60, "seq_len": SEQ, "run": ds.reader.run_digest}
    assert all(isinstance(v, int) for v in state.values())
    resumed = TokpackDataset(run_dir, rank=1, world_size=world, micro_batch=micro, positions="eos", at_end="stop")
    resumed.load_state_dict(json.loads(json.dumps(state)))
    rest = list(DataLoader(resumed, batch_size=None, num_workers=2))
    assert len(rest) == steps - 10
    for a, b in zip(rest, batches[10:]):
        assert torch.equal(a["input_ids"], b["input_ids"])
    # in-process iteration keeps the state by itself
    solo = TokpackDataset(run_dir, rank=0, world_size=1, micro_batch=4, positions=None)
    it = iter(solo)
    next(it), next(it)
    assert solo.state_dict() == {
        "epoch": 0,
        "sample": 8,
        "consumed_samples": 8,
        "seq_len": SEQ,
        "run": solo.reader.run_digest,
    }


def test_cli_read_json(run_dir):
    from tokpack.packer.cli import main

    res = CliRunner().invoke(
        main,
        [
            "read",
            str(run_dir),
            "--rank",
            "1",
            "--world-size",
            "2",
            "--micro-batch",
            "3",
            "--consumed-tokens",
            str(50 * SEQ + 3),
            "--count",
            "7",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in res.output.splitlines()]
    order = chained(SIZES)
    want = [order[50 + b * 6 + 3 + j] for b in range(3) for j in range(3)][:7]
    assert [(x["epoch"], x["sample"]) for x in lines] == want
    assert {x["rank"] for x in lines} == {1}
    for x in lines:
        assert x["tokens"] == expected_row(x["epoch"], x["sample"]).tolist()


def test_cli_read_errors_are_one_line(tmp_path):
    from tokpack.packer.cli import main

    run = make_run(tmp_path / "run", {0: 10})
    (run / epoch_dir_name(0) / "00001.ds").unlink()
    res = CliRunner().invoke(main, ["read", str(run)])
    assert res.exit_code == 1
    assert "00001.ds" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(main, ["read", str(tmp_path)])  # the folder holding the run: no tokpack directory
    assert res.exit_code == 1 and "not a tokpack directory" in res.output and "found 1 other file (run)" in res.output


# ------------------------------------------------------------- whole lines and edges


def test_shuffle_command_reads_the_run_settings_from_the_run():
    """The command a missing-epoch message names: --like, whatever options the run was made
    with (tests/test_like.py runs it); RUN when there is no run manifest to read them from."""
    from tokpack.formats.numbering import shuffle_command

    run = {
        "kind": "run",
        "sources": [{"path": "/d/web"}],
        "weights": ["0.7"],
        "seq_len": 15,
        "seed": 3,
        "samples": 100,
        "shard_samples": 7,
        "jitter": True,
        "packing": {"method": "best-fit"},
    }
    assert shuffle_command(run, "/r/run 1", 4) == "tokpack shuffle --like '/r/run 1' --epoch 4"
    assert shuffle_command({}, "/r/epoch-00001", 2) == "tokpack shuffle --like RUN --epoch 2"


def test_locate_refuses_the_end_of_the_chain_and_a_gap(tmp_path):
    """One past an epoch's last sample is in no epoch when nothing follows it (the end of the
    chain, or an epoch not written): locate refuses it, epoch_sample still names it."""
    run = make_run(tmp_path / "run", {0: 10, 1: 10, 2: 10})
    shutil.rmtree(run / epoch_dir_name(1))
    m = json.loads((run / "tokpack.json").read_text())
    m["epochs"] = [0, 2]
    write_manifest(run, m)
    reader = SampleReader.open(run)
    assert reader.locate(9) == (0, 9) and reader.locate(20) == (2, 0) and reader.locate(29) == (2, 9)
    for g in (10, 19, 30):
        with pytest.raises(TokpackError, match=rf"\[sample {g}\]: sample is in no epoch of this chain"):
            reader.locate(g)
    assert reader.epoch_sample(10) == (1, 0) and reader.epoch_sample(30) == (3, 0)


def test_reader_error_lines(tmp_path):
    """The whole line of each refusal of a position: what was asked, what the chain holds."""
    run = make_run(tmp_path / "run", {0: 10, 1: 10})
    d0 = run / epoch_dir_name(0)
    chain = SampleReader.open([d0])
    with pytest.raises(TokpackError) as err:
        chain.start_from(start_sample=11)
    assert str(err.value) == (
        f"{d0} [start sample]: start is beyond the end of the chained epochs; "
        f"expected 0..10, found 11. HINT: write more epochs (`tokpack shuffle --like {run} --epoch 1`) "
        "or pass the run directory"
    )
    with pytest.raises(TokpackError) as err:
        chain.position(1, 0)
    assert str(err.value) == "[epoch]: epoch not in this reader's chain; expected [0], found 1"
    with pytest.raises(TokpackError) as err:
        chain.position(0, 11)
    assert str(err.value) == "[epoch 0]: sample outside its epoch; expected 0..10, found 11"
    reader = SampleReader.open(run)
    with pytest.raises(TokpackError) as err:
        reader.start_from(start_sample=25)
    assert str(err.value) == (
        f"{run} [epoch 2]: sample 25 is in epoch 2, which is not written yet; expected epoch 2 among the "
        f"run's epochs, found [0, 1]. HINT: write it with `tokpack shuffle --like {run} --epoch 2`"
    )


def test_rank_samples_default_to_the_whole_stream_from_sample_0(run_dir):
    reader = SampleReader.open(run_dir)
    world, micro = 3, 2
    got = list(reader.rank_samples(1, world, micro))
    steps = sum(SIZES.values()) // (world * micro)
    assert len(got) == steps * micro
    assert [s.index for s in got[:4]] == [2, 3, 8, 9] and got[-1].index == (steps - 1) * world * micro + 3
    assert all(ids(s.tokens[None])[0] == (s.epoch, s.sample) for s in got)


def test_reader_keeps_at_most_max_open_files(tmp_path):
    """Reading across 12 shards one sample at a time: never more than MAX_OPEN_FILES shard
    files are open at once (a rank reading a long chain must not run out of descriptors)."""
    from tokpack.loader.shard_files import MAX_OPEN_FILES

    run = make_run(tmp_path / "run", {0: 40}, shard_samples=4)
    reader = SampleReader.open(run)
    before = len(os.listdir("/proc/self/fd"))
    most = 0
    for g in range(40):
        assert ids(reader.read(g)) == [(0, g)]
        most = max(most, len(os.listdir("/proc/self/fd")) - before)
    assert most == MAX_OPEN_FILES
    reader.close()


def test_shard_cut_short_after_open_is_one_line_not_other_bytes(tmp_path):
    """A shard truncated mid-row after the reader checked its size: the read stops at the end
    of the file with a line naming the byte, instead of filling the row with other bytes."""
    run = make_run(tmp_path / "run", {0: 14})
    shard = run / epoch_dir_name(0) / "00001.ds"  # samples 7..13, 32 bytes each
    reader = SampleReader.open(run)
    os.truncate(shard, 6 * 32 + 10)
    assert ids(reader.read(12)) == [(0, 12)]
    with pytest.raises(TokpackError) as err:
        reader.read(13)
    assert str(err.value).startswith(
        f"{shard} [byte {6 * 32 + 10}]: shard is shorter than its manifest says "
        "(changed while reading?); expected 22 more bytes, found end of file"
    )


def test_shard_replaced_after_open_is_one_line_not_other_samples(tmp_path):
    """A shard replaced after the reader's open by a file of its size (an epoch directory
    reshuffled in place, a file renamed over it) was read as the reader's own: other samples at
    the same offsets, also in a DataLoader worker, which opens the files afresh. Now the file's
    first open, in whatever process, names it; a file left as it was still reads."""
    from torch.utils.data import DataLoader

    from tokpack.loader.torch_adapter import TokpackDataset

    run = make_run(tmp_path / "run", {0: 14})
    other = make_run(tmp_path / "other", {1: 14})  # the same shapes, other samples
    shard = run / epoch_dir_name(0) / "00001.ds"  # samples 7..13
    reader = SampleReader.open(run)
    ds = TokpackDataset(run, micro_batch=7, start_sample=7, positions=None)
    shutil.copy(other / epoch_dir_name(1) / "00001.ds", shard.with_name("swap"))
    os.replace(shard.with_name("swap"), shard)
    assert ids(reader.read(0, 7)) == [(0, g) for g in range(7)]  # the other shard is as it was
    line = (
        f"{shard} [inode/mtime]: file was replaced or rewritten after the reader was opened: it may hold other samples"
    )
    with pytest.raises(TokpackError) as err:
        reader.read(7)
    assert str(err.value).startswith(line)
    with pytest.raises(TokpackError) as err:
        next(iter(DataLoader(ds, batch_size=None, num_workers=1)))
    assert str(err.value).startswith(line) and "\n" not in str(err.value)
    assert ids(SampleReader.open(run).read(7)) == [(1, 7)]  # a reader opened now reads the file as it is


def _edit_manifest(directory: Path, **fields) -> None:
    """Rewrites a manifest with some fields changed (None: removed), as another tool would."""
    m = json.loads((directory / "tokpack.json").read_text())
    for k, v in fields.items():
        if v is None:
            m.pop(k, None)
        else:
            m[k] = v
    write_manifest(directory, m)


# The hint of a manifest that tokpack.formats.checks.check_manifest refuses (every command applies it).
CHECKED = (
    ". HINT: the manifest was edited or damaged; restore it (or rerun the command that wrote it), and run "
    "`tokpack validate` on the directory"
)
OPEN_REFUSALS = [  # (directory edited, fields, the line after "<that directory>/tokpack.json ")
    (
        "run",
        {"epochs": []},
        "[epochs]: run manifest lists no epochs; expected a non-empty list, found []. "
        "HINT: write one with `tokpack shuffle --like {run} --epoch 0`",
    ),
    (
        "run",
        {"samples": None},
        "[samples]: manifest field missing; expected field 'samples', found no such field" + CHECKED,
    ),
    (
        "run",
        {"samples": 0},
        "[samples/epoch_samples]: run manifest does not say how many samples its epochs hold: "
        "samples is neither a positive count nor 0 with an epoch_samples list; expected a size "
        "for every epoch the run lists, found samples 0, epoch_samples None" + CHECKED,
    ),
    (
        "epoch-00001",
        {"seq_len": 14},
        "[shards[0].tokens]: shard token count wrong; expected 105 (samples x 15), found 112" + CHECKED,
    ),
    ("epoch-00001", {"samples": 9}, "[samples]: sample count wrong; expected 10 (sum over shards), found 9" + CHECKED),
    (
        "epoch-00001",
        {"token_size": 4},
        "[token_size]: token size disagrees with the dtype label; expected 2 (uint16), found 4" + CHECKED,
    ),
]


@pytest.mark.parametrize("target,fields,line", OPEN_REFUSALS, ids=[f"{t}:{next(iter(f))}" for t, f, _ in OPEN_REFUSALS])
def test_open_refusal_lines(tmp_path, target, fields, line):
    run = make_run(tmp_path / "run", {0: 10, 1: 10})
    directory = run if target == "run" else run / target
    _edit_manifest(directory, **fields)
    with pytest.raises(TokpackError) as err:
        SampleReader.open(run)
    assert str(err.value) == f"{directory / 'tokpack.json'} {line.format(run=run)}"


def test_epoch_numbering_refuses_an_epoch_past_its_plan():
    from tokpack.formats.numbering import EpochNumbering

    planned = EpochNumbering(None, [10, 12])
    assert (planned.size(1), planned.first(1), planned.first(2)) == (12, 10, 22)
    for ask in (planned.size, planned.first):
        with pytest.raises(TokpackError) as err:
            ask(3)
        assert str(err.value) == "[epoch]: epoch is not in the run's plan; expected 0..1 (epoch_samples), found 3"


def _edit_shard(directory: Path, k: int, **fields) -> None:
    m = json.loads((directory / "tokpack.json").read_text())
    m["shards"][k].update(fields)
    write_manifest(directory, m)


# Epochs 0 and 1 of 10 samples (shards of 7 and 3, 32-byte rows) chained as directories; epoch 1's
# manifest edited -> the line after "<epoch 1>/tokpack.json ".
CHAIN_REFUSALS = [
    (
        "eos_id",
        lambda d: _edit_manifest(d, eos_id=1),
        "[eos_id]: epochs cannot be chained: eos_id differs; expected 0, found 1. HINT: read these epochs separately",
    ),
    (
        "seq_len",
        lambda d: _edit_manifest(d, seq_len=14),
        "[shards[0].tokens]: shard token count wrong; expected 105 (samples x 15), found 112" + CHECKED,
    ),
    (
        "bytes",
        lambda d: _edit_shard(d, 1, bytes=97),
        "[shards[1]]: shard entry is inconsistent: bytes != samples * (seq_len+1) * token_size; expected 96, found 97",
    ),
    (
        "short shard",
        lambda d: _edit_shard(d, 0, samples=6, bytes=192),
        "[shards[0].tokens]: shard token count wrong; expected 96 (samples x 16), found 112" + CHECKED,
    ),
    (
        "samples",
        lambda d: _edit_manifest(d, samples=11),
        "[samples]: sample count wrong; expected 10 (sum over shards), found 11" + CHECKED,
    ),
]


@pytest.mark.parametrize("edit,line", [c[1:] for c in CHAIN_REFUSALS], ids=[c[0] for c in CHAIN_REFUSALS])
def test_chain_refusal_lines(tmp_path, edit, line):
    run = make_run(tmp_path / "run", {0: 10, 1: 10})
    d0, d1 = run / epoch_dir_name(0), run / epoch_dir_name(1)
    edit(d1)
    with pytest.raises(TokpackError) as err:
        SampleReader.open([d0, d1])
    assert str(err.value) == f"{d1 / 'tokpack.json'} {line}"


def test_run_epochs_out_of_order_are_refused(tmp_path):
    """from_manifests with a run's numbering takes epochs in increasing order; the check must
    compare each epoch with the one before it, not only with the first."""
    from tokpack.formats.numbering import EpochNumbering

    run = make_run(tmp_path / "run", {0: 10, 1: 10, 2: 10})
    pairs = [
        (run / epoch_dir_name(e), json.loads((run / epoch_dir_name(e) / "tokpack.json").read_text())) for e in (0, 2, 1)
    ]
    with pytest.raises(TokpackError) as err:
        SampleReader.from_manifests(pairs, numbering=EpochNumbering(10))
    assert str(err.value) == "[epochs]: a run's epochs must be chained in increasing order; found [0, 2, 1]"
    in_order = SampleReader.from_manifests(sorted(pairs, key=lambda p: p[0]), numbering=EpochNumbering(10))
    assert in_order.total_samples == 30 and ids(in_order.read(19, 2)) == [(1, 9), (2, 0)]


def test_shard_of_the_wrong_size_is_one_line(tmp_path):
    run = make_run(tmp_path / "run", {0: 10})
    shard = run / epoch_dir_name(0) / "00001.ds"  # 3 samples of 32 bytes
    os.truncate(shard, 95)
    with pytest.raises(TokpackError) as err:
        SampleReader.open(run)
    assert str(err.value) == (
        f"{shard} [size]: shard size does not match the manifest; expected 96 bytes, found "
        "95 bytes. HINT: the shard was truncated or replaced; run `tokpack validate` on the epoch"
    )


def test_torch_adapter_state_forms_resume_in_process(run_dir):
    """Each form load_state_dict takes resumes at the same sample, here in the main process
    (a DataLoader's workers run the same code out of reach of in-process checks): a position
    (epoch, sample), a consumed_samples count alone, and a worker's share (start, next step);
    a share saved with other workers or another global batch is refused."""
    from tokpack.formats.errors import TokpackError
    from tokpack.loader.torch_adapter import TokpackDataset

    def first(ds) -> list:
        return next(iter(ds))["input_ids"].tolist()

    def fresh():
        return TokpackDataset(run_dir, world_size=1, micro_batch=2, positions=None)

    want = first(TokpackDataset(run_dir, world_size=1, micro_batch=2, positions=None, start_sample=58))
    position = fresh().state_dict({"consumed_samples": 58})
    assert position["consumed_samples"] == 58 and position["epoch"] == 1
    for state in (
        {"epoch": position["epoch"], "sample": position["sample"]},
        {"consumed_samples": 58},
        {"start": 50, "next_step": 4, "worker": 0, "num_workers": 1, "global_batch": 2},
    ):
        ds = fresh()
        ds.load_state_dict(state)
        assert first(ds) == want, state
        assert ds.state_dict() == fresh().state_dict({"consumed_samples": 60}), state  # follows its own batches
    restart = (
        "restart from the consumed-sample count: TokpackDataset(..., start_sample=TokpackDataset."
        "consumed_samples(loader_state)) with a fresh StatefulDataLoader"
    )
    workers = (
        "[num_workers]: loader state was saved with another number of DataLoader workers; expected {}, found 1. "
        "HINT: use num_workers={}, or " + restart
    )
    # worker 1 of 1 worker cannot exist: refused as damaged when loaded, before any batch
    with pytest.raises(TokpackError) as err:
        fresh().load_state_dict({"start": 50, "next_step": 4, "worker": 1, "num_workers": 1, "global_batch": 2})
    assert str(err.value) == (
        "[next_step]: loader state is damaged: a worker's next step is not its own; expected a "
        "step b with b % 1 == 1 (worker 1 of 1), found 4. HINT: " + restart
    )
    for wrong, line in (
        ({"num_workers": 2}, workers.format(2, 2)),
        (
            {"global_batch": 4},
            "[global_batch]: loader state was saved with DataLoader workers and "
            "another global batch (W*m); expected 4, found 2. HINT: " + restart,
        ),
    ):
        ds = fresh()
        ds.load_state_dict({"start": 50, "next_step": 4, "worker": 0, "num_workers": 1, "global_batch": 2, **wrong})
        with pytest.raises(TokpackError) as err:
            first(ds)
        assert str(err.value) == line
    again = fresh()
    again.load_state_dict({"start": 50, "next_step": 4, "worker": 0, "num_workers": 1, "global_batch": 2})
    first(again)
    # a worker's share is used once: the next pass goes on from the dataset's own position
    assert first(again) == first(TokpackDataset(run_dir, world_size=1, micro_batch=2, positions=None, start_sample=60))
