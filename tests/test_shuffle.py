"""`tokpack shuffle`: permutations, plans, both engine paths, determinism, crash safety, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

from conftest import random_docs, shuffle_run, write_source
from tokpack.formats import outputs
from tokpack.formats.errors import IncompleteError, TokpackError
from tokpack.formats.hashes import row_hashes
from tokpack.formats.reading import read_manifest
from tokpack.formats.shards import PackedSource
from tokpack.packer.validation import validate_dirs
from tokpack.shuffle import run, steps
from tokpack.shuffle.permutation import Bijection, derive_key
from tokpack.shuffle.plan import EpochPlan, SourcePlan, epoch_plan, replay_hashes
from tokpack.shuffle.mixture import largest_remainder

REPO = Path(__file__).resolve().parents[1]
L = 31  # seq_len of most tests: 32-token rows


# ------------------------------------------------------------------ helpers


def source_windows(path, seq_len=L, offset=0) -> np.ndarray:
    src = PackedSource.open(path)
    toks = np.concatenate([np.fromfile(path / s["path"], dtype=src.dtype) for s in src.shards])[offset:]
    w = len(toks) // (seq_len + 1)
    return toks[: w * (seq_len + 1)].reshape(w, seq_len + 1)


def epoch_rows(epoch_dir, seq_len=L) -> np.ndarray:
    m = read_manifest(epoch_dir, kind="epoch")
    toks = np.concatenate([np.fromfile(Path(epoch_dir) / s["path"], dtype="<u2") for s in m["shards"]])
    return toks.reshape(-1, seq_len + 1)


def dir_files(path) -> dict[str, bytes]:
    path = Path(path)
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def as_set(rows) -> Counter:
    return Counter(r.tobytes() for r in rows)


@pytest.fixture
def sources(tmp_path):
    """Two sources of different sizes: 'big' (3 shards) and 'small'."""
    big = write_source(tmp_path / "big", random_docs(np.random.default_rng(7), 150, 1000, 0))
    small = write_source(tmp_path / "small", random_docs(np.random.default_rng(8), 40, 1000, 0), docs_per_shard=15)
    return big, small


# ------------------------------------------------------------------ permutation


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), seed=st.integers(-(2**63), 2**63 - 1))
def test_bijection_is_a_permutation_with_inverse(n, seed):
    b = Bijection(n, "t", seed)
    y = b.forward(np.arange(n))
    assert np.array_equal(np.sort(y), np.arange(n))
    assert np.array_equal(b.inverse(y), np.arange(n))


def test_bijection_is_pinned_across_machines():
    # Golden values: the permutation is part of the on-disk contract (same bytes on any machine).
    assert derive_key("epoch", 1, 0, "round", 0) == 0xFCEBAA6D6BE42509
    assert Bijection(10, "epoch", 1, 0).forward(np.arange(10)).tolist() == [1, 0, 6, 2, 9, 7, 8, 3, 4, 5]
    assert Bijection(1000, "window", 7, 0, 3).forward(np.arange(5)).tolist() == [916, 106, 531, 447, 179]
    assert Bijection(10, "epoch", 2, 0).forward(np.arange(10)).tolist() != [1, 0, 6, 2, 9, 7, 8, 3, 4, 5]


# ------------------------------------------------------------------ plan


def test_largest_remainder_is_exact():
    from fractions import Fraction

    assert largest_remainder([Fraction(1), Fraction(1), Fraction(1)], 10) == [4, 3, 3]
    assert largest_remainder([Fraction(1, 3), Fraction(2, 3)], 7) == [2, 5]
    assert sum(largest_remainder([Fraction(7, 10), Fraction(2, 10), Fraction(1, 10)], 1001)) == 1001


def test_weighted_counts_chain_and_passes(sources):
    big, small = sources
    srcs = [PackedSource.open(big), PackedSource.open(small)]
    seen = {0: [], 1: []}
    for e in range(4):
        plan = epoch_plan(srcs, seq_len=L, seed=3, epoch=e, weights=["1", "3"], samples=400)
        assert [sp.samples for sp in plan.sources] == [100, 300]
        s, w, p = plan.locate(np.arange(plan.samples))
        for i in (0, 1):
            assert (s == i).sum() == plan.sources[i].samples
            order = np.argsort(plan.order().inverse(np.flatnonzero(s == i)))
            seen[i].extend(w[s == i][order].tolist())
            passes = set(p[s == i].tolist())
            assert min(passes) == plan.first_pass(i) and len(passes) == plan.passes(i)
    for i, src in enumerate(srcs):
        W = plan.sources[i].windows
        chain = seen[i]
        for a in range(0, len(chain) - W + 1, W):  # every full pass is a permutation: no repeat before exhaustion
            assert sorted(chain[a : a + W]) == list(range(W))
        assert len(set(chain[(len(chain) // W) * W :])) == len(chain) % W
    # the small source (W < 300) is upsampled: epoch 0 already spans 2 passes, recorded as such
    assert plan.sources[1].windows < 300 and plan.passes(1) >= 2


def test_locate_and_outputs_of_agree(sources):
    big, small = sources
    srcs = [PackedSource.open(big), PackedSource.open(small)]
    plan = epoch_plan(srcs, seq_len=L, seed=5, epoch=2, weights=["2", "1"], samples=1500)
    where = {}
    for s, sp in enumerate(plan.sources):
        for _, rows, g in plan.outputs_of(s, np.arange(sp.windows)):
            for r, gg in zip(rows.tolist(), g.tolist()):
                assert gg not in where
                where[gg] = (s, r)
    assert sorted(where) == list(range(plan.samples))
    s, w, _ = plan.locate(np.arange(plan.samples))
    assert [where[g] for g in range(plan.samples)] == list(zip(s.tolist(), w.tolist()))


# ------------------------------------------------------------------ exactly once, both paths


@pytest.mark.parametrize("memory", [1 << 30, 6000])
def test_unweighted_epoch_holds_every_window_once(sources, tmp_path, memory):
    big, small = sources
    out = tmp_path / "out"
    summary = shuffle_run(
        [str(big), str(small)], str(out), seq_len=L, seed=1, epochs=[0], memory=memory, shard_samples=90
    )
    assert summary["path"] == ("in-memory" if memory > 1e6 else "out-of-core")
    windows = np.concatenate([source_windows(big), source_windows(small)])
    rows = epoch_rows(out / "epoch-00000")
    assert as_set(rows) == as_set(windows)
    m = read_manifest(out / "epoch-00000", kind="epoch")
    assert m["samples"] == len(windows) and m["tokens"] == len(windows) * (L + 1)
    assert m["sample_multiset_hash"] == f"{int(row_hashes(windows).sum(dtype=np.uint64)):016x}"
    assert (
        m["sample_multiset_hash"]
        == replay_hashes(m, [PackedSource.open(small), PackedSource.open(big)], order=False)[0]
    )
    assert [s["samples"] for s in m["shards"]][:-1] == [90] * (len(m["shards"]) - 1)
    total = sum(PackedSource.open(p).tokens for p in (big, small))
    assert m["dropped_tokens"] == total - len(windows) * (L + 1)
    run = read_manifest(out, kind="run")
    assert run["epochs"] == [0] and run["seed"] == 1 and run["samples"] == len(windows)


def test_windows_spanning_several_shards(tmp_path):
    """Shards smaller than a window: windows cross two or more shard boundaries."""
    docs = random_docs(np.random.default_rng(5), 120, 1000, 0, min_len=3, max_len=12)
    src = write_source(tmp_path / "tiny", docs, docs_per_shard=2)
    for memory in (1 << 30, 3000):
        out = tmp_path / f"out{memory}"
        shuffle_run([str(src)], str(out), seq_len=63, seed=3, epochs=[0], memory=memory, jitter=True)
        m = read_manifest(out / "epoch-00000", kind="epoch")
        wins = source_windows(src, seq_len=63, offset=m["jitter_offsets"][0])[: m["samples"]]
        assert as_set(epoch_rows(out / "epoch-00000", seq_len=63)) == as_set(wins)
    assert dir_files(tmp_path / f"out{1 << 30}") == dir_files(tmp_path / "out3000")


def test_weighted_epoch_matches_plan_and_expected_hash(sources, tmp_path):
    big, small = sources
    out = tmp_path / "out"
    shuffle_run(
        [str(big), str(small)],
        str(out),
        weights=["0.25", "0.75"],
        seq_len=L,
        seed=9,
        epochs=[0, 1],
        samples=1000,
        memory=8000,
        shard_samples=128,
    )
    srcs = [PackedSource.open(big), PackedSource.open(small)]
    wins = [source_windows(big), source_windows(small)]
    for e in (0, 1):
        m = read_manifest(out / f"epoch-{e:05d}", kind="epoch")
        assert [s["samples"] for s in m["sources"]] == [250, 750]
        plan = EpochPlan.from_manifest(m, srcs)
        s, w, _ = plan.locate(np.arange(1000))
        expected = np.stack([wins[si][wi] for si, wi in zip(s.tolist(), w.tolist())])
        assert np.array_equal(epoch_rows(out / f"epoch-{e:05d}"), expected)
        assert m["sample_multiset_hash"] == replay_hashes(m, srcs, order=False)[0]
        assert m["sources"][1]["passes"] >= 2  # upsampled: window repeats only across passes


def test_jitter_shifts_windows_per_epoch(sources, tmp_path):
    big, _ = sources
    out = tmp_path / "out"
    shuffle_run([str(big)], str(out), seq_len=L, seed=4, epochs=[0, 1, 2], jitter=True, memory=5000, shard_samples=200)
    ms = [read_manifest(out / f"epoch-{e:05d}", kind="epoch") for e in range(3)]
    offsets = [m["jitter_offsets"][0] for m in ms]
    assert all(0 <= o <= L for o in offsets) and len(set(offsets)) > 1
    assert len({m["samples"] for m in ms}) == 1
    tokens = PackedSource.open(big).tokens
    for m, o in zip(ms, offsets):
        wins = source_windows(big, offset=o)[: m["samples"]]
        assert as_set(epoch_rows(out / f"epoch-{m['epoch']:05d}")) == as_set(wins)
        assert m["dropped_tokens"] == tokens - m["samples"] * (L + 1)


# ------------------------------------------------------------------ determinism


def test_bytes_identical_for_workers_memory_and_path(sources, tmp_path):
    big, small = sources
    args = ([str(big), str(small)],)
    kw = dict(weights=["1", "2"], seq_len=L, seed=11, epochs=[0, 1], samples=900, shard_samples=70)
    variants = {
        "inmem": dict(memory=1 << 30, workers=1),
        "ooc-w1": dict(memory=9000, workers=1),
        "ooc-w4": dict(memory=9000, workers=4),
        "ooc-tiny": dict(memory=1500, workers=1, tasks=3),
    }
    trees = {}
    for name, v in variants.items():
        out = tmp_path / name
        summary = shuffle_run(*args, str(out), **kw, **v)
        assert summary["path"] == ("in-memory" if name == "inmem" else "out-of-core")
        trees[name] = dir_files(out)
    ref = trees.pop("inmem")
    assert any(k.endswith(".ds") for k in ref)
    for name, tree in trees.items():
        assert tree == ref, name


def test_real_datatrove_executor_with_workers(sources, tmp_path):
    """Through the CLI and datatrove's LocalPipelineExecutor (pickled steps, 2 processes)."""
    big, small = sources
    ref = tmp_path / "ref"
    shuffle_run([str(big), str(small)], str(ref), seq_len=L, seed=2, epochs=[0], memory=7000, shard_samples=150)
    out = tmp_path / "cli"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokpack.packer.cli",
            "shuffle",
            str(big),
            str(small),
            "-o",
            str(out),
            "--seq-len",
            str(L),
            "--seed",
            "2",
            "--epochs",
            "1",
            "--memory",
            "14000",
            "--shard-samples",
            "150",
            "--workers",
            "2",
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["path"] == "out-of-core"
    assert dir_files(out) == dir_files(ref)


def test_epoch_added_later_equals_epoch_of_full_run(sources, tmp_path):
    big, small = sources
    full, part = tmp_path / "full", tmp_path / "part"
    kw = dict(seq_len=L, seed=6, memory=7000, shard_samples=100)
    shuffle_run([str(big), str(small)], str(full), epochs=[0, 1, 2], **kw)
    shuffle_run([str(big), str(small)], str(part), epochs=[2], **kw)
    assert dir_files(part / "epoch-00002") == dir_files(full / "epoch-00002")
    shuffle_run([str(big), str(small)], str(part), epochs=[0], **kw)
    assert read_manifest(part, kind="run")["epochs"] == [0, 2]
    before = (part / "epoch-00000" / "tokpack.json").stat().st_mtime_ns
    summary = shuffle_run([str(big), str(small)], str(part), epochs=[0, 1], **kw)
    assert summary["skipped"] == [0] and summary["written"] == [1]
    assert (part / "epoch-00000" / "tokpack.json").stat().st_mtime_ns == before
    assert dir_files(part) == dir_files(full)
    assert not (part / run.WORK_DIR).exists()


PEAK_SCRIPT = """
import json, sys
from tokpack.packer.executors import ExecutorConfig, pass_runner
from tokpack.shuffle.run import shuffle_run
from tokpack.shuffle.spec import ShuffleSpec
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
base = status("VmRSS:")
spec = ShuffleSpec.given_as(sources=[sys.argv[1]], seq_len=2047, seed=1, epochs=[0], memory=int(sys.argv[3]))
summary = shuffle_run(spec, sys.argv[2], run_passes=pass_runner(ExecutorConfig()))
print(json.dumps({"growth": status("VmHWM:") - base, "path": summary["path"]}))
"""


def test_peak_memory_stays_within_budget_for_10x_data(tmp_path):
    docs = random_docs(np.random.default_rng(2), 700, 50000, 0, min_len=10_000, max_len=30_000)
    src = write_source(tmp_path / "src", docs, vocab_size=50000, docs_per_shard=200)
    data = PackedSource.open(src).tokens * 2
    memory = data // 10
    proc = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(src), str(tmp_path / "out"), str(memory)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["path"] == "out-of-core"
    assert result["growth"] <= memory + (8 << 20), (result["growth"], memory)
    assert read_manifest(tmp_path / "out" / "epoch-00000")["samples"] == PackedSource.open(src).tokens // 2048


def test_in_memory_choice_counts_every_window_the_path_holds(sources, tmp_path):
    """The in-memory path holds every window of each source it samples, not only the samples
    the epoch takes: with a budget below the windows (far above the samples), the epoch goes
    out of core, and with room for the windows it stays in memory."""
    big, small = sources
    windows = sum(PackedSource.open(s).tokens // (L + 1) for s in (big, small))
    holds = windows * ((L + 1) * 2 + steps.ROW_FACTS_BYTES)  # rows and their facts, before chunk buffers
    kw = dict(seq_len=L, seed=1, epochs=[0], samples=windows // 5)
    assert (
        shuffle_run([str(big), str(small)], str(tmp_path / "tight"), memory=holds * 9 // 10, **kw)["path"]
        == "out-of-core"
    )
    assert (
        shuffle_run([str(big), str(small)], str(tmp_path / "room"), memory=holds + (64 << 20), **kw)["path"]
        == "in-memory"
    )


# ------------------------------------------------------------------ randomness


def big_plan(n_windows=(60_000, 40_000), seed=0, epoch=0) -> EpochPlan:
    srcs, base = [], 0
    for i, w in enumerate(n_windows):
        srcs.append(SourcePlan(i, f"s{i}", f"/s{i}", f"fp{i}", None, w * 8, 0, w, w, base))
        base += w
    return EpochPlan(seed, epoch, 7, False, base, tuple(srcs))


def spearman(a, b) -> float:
    ra, rb = np.argsort(np.argsort(a)).astype(float), np.argsort(np.argsort(b)).astype(float)
    return float(np.corrcoef(ra, rb)[0, 1])


def test_order_passes_simple_statistics():
    plan = big_plan()
    n = plan.samples
    s, w, _ = plan.locate(np.arange(n))
    src_pos = np.array([sp.base for sp in plan.sources])[s] + w  # position in the unshuffled stream
    adjacent = np.abs(np.diff(src_pos)) == 1
    assert adjacent.sum() <= 20  # expected about 2 (fraction ~ 2/N)
    assert abs(spearman(src_pos, np.arange(n))) < 5 / np.sqrt(n)
    # the two sources are mixed evenly along the epoch: source-0 share per tenth of the epoch
    share = [(s[a : a + n // 10] == 0).mean() for a in range(0, n, n // 10)]
    assert max(abs(x - 0.6) for x in share) < 0.02
    # different epochs and seeds give different, uncorrelated orders
    s1, w1, _ = big_plan(epoch=1).locate(np.arange(n))
    s2, w2, _ = big_plan(seed=1).locate(np.arange(n))
    for other in (
        np.array([sp.base for sp in plan.sources])[s1] + w1,
        np.array([sp.base for sp in plan.sources])[s2] + w2,
    ):
        assert (other == src_pos).mean() < 0.01
        assert abs(spearman(other, src_pos)) < 5 / np.sqrt(n)


def test_epochs_and_seeds_differ_on_disk(sources, tmp_path):
    big, _ = sources
    a, b = tmp_path / "a", tmp_path / "b"
    shuffle_run([str(big)], str(a), seq_len=L, seed=1, epochs=[0, 1], memory=1 << 30)
    shuffle_run([str(big)], str(b), seq_len=L, seed=2, epochs=[0], memory=1 << 30)
    e0, e1, f0 = epoch_rows(a / "epoch-00000"), epoch_rows(a / "epoch-00001"), epoch_rows(b / "epoch-00000")
    assert as_set(e0) == as_set(e1) == as_set(f0)
    assert (e0 != e1).any(axis=1).mean() > 0.9 and (e0 != f0).any(axis=1).mean() > 0.9


# ------------------------------------------------------------------ datatrove compatibility


def test_datatrove_folder_dataset_reads_the_epoch_in_order(sources, tmp_path):
    from datatrove.utils.dataset import DatatroveFolderDataset  # imports torch: only here

    big, small = sources
    out = tmp_path / "out"
    shuffle_run([str(big), str(small)], str(out), seq_len=L, seed=1, epochs=[0], memory=5000, shard_samples=64)
    rows = epoch_rows(out / "epoch-00000")
    ds = DatatroveFolderDataset(str(out / "epoch-00000"), seq_len=L, token_size=2)
    assert len(ds) == len(rows)
    got = np.stack([np.asarray(ds[i]["input_ids"]) for i in range(len(ds))])
    assert np.array_equal(got, rows.astype(got.dtype))


# ------------------------------------------------------------------ crash safety


def test_failure_midway_then_rerun_is_identical(sources, tmp_path, monkeypatch):
    big, small = sources
    kw = dict(seq_len=L, seed=8, epochs=[0], memory=5000, shard_samples=60)
    ref = tmp_path / "ref"
    shuffle_run([str(big), str(small)], str(ref), **kw)
    out = tmp_path / "out"
    real = steps.EpochJob.write_shard
    calls = []

    def failing(self, i, blocks):
        calls.append(i)
        if len(calls) == 4:
            next(iter(blocks))
            raise OSError("simulated crash")
        return real(self, i, blocks)

    monkeypatch.setattr(steps.EpochJob, "write_shard", failing)
    with pytest.raises(TokpackError, match="simulated crash"):  # an OSError in a task is the user's to fix
        shuffle_run([str(big), str(small)], str(out), **kw)
    with pytest.raises(IncompleteError):
        read_manifest(out / "epoch-00000")
    monkeypatch.setattr(steps.EpochJob, "write_shard", real)
    calls.clear()
    written, scattered = [], []
    monkeypatch.setattr(
        steps.EpochJob, "write_shard", lambda self, i, blocks: (written.append(i), real(self, i, blocks))
    )
    monkeypatch.setattr(steps.ScatterStep, "run", lambda self, *a, **k: scattered.append(a))
    shuffle_run([str(big), str(small)], str(out), **kw)
    assert dir_files(out) == dir_files(ref)
    # The rerun ran no scatter tasks (that pass had finished) and rewrote only the unfinished shards.
    n_shards = len(read_manifest(out / "epoch-00000")["shards"])
    assert scattered == [] and sorted(written) == list(range(3, n_shards)) and n_shards > 4


def test_rerun_with_other_settings_after_a_failure_leaves_no_scratch_of_the_first(sources, tmp_path, monkeypatch):
    """An out-of-core attempt stopped mid-epoch, then the epoch written with another seed: the
    first attempt's bucket scratch (its own work folder) can never be resumed, and is removed
    with the epoch's, not left in OUT for good."""
    big, small = sources
    kw = dict(seq_len=L, epochs=[0], memory=5000, shard_samples=60)
    ref = tmp_path / "ref"
    shuffle_run([str(big), str(small)], str(ref), seed=9, **kw)
    out = tmp_path / "out"
    real = steps.EpochJob.write_shard

    def failing(self, i, blocks):
        raise OSError("simulated crash")

    monkeypatch.setattr(steps.EpochJob, "write_shard", failing)
    with pytest.raises(TokpackError, match="simulated crash"):
        shuffle_run([str(big), str(small)], str(out), seed=8, **kw)
    assert any((out / run.WORK_DIR).rglob("*.rows"))  # the first attempt's scratch, kept for a rerun
    monkeypatch.setattr(steps.EpochJob, "write_shard", real)
    shuffle_run([str(big), str(small)], str(out), seed=9, **kw)
    assert dir_files(out) == dir_files(ref)
    assert not (out / run.WORK_DIR).exists()


@pytest.mark.parametrize("shard", ["kept", "deleted", "edited"])
def test_rerun_after_every_shard_writes_only_what_is_missing(sources, tmp_path, monkeypatch, shard):
    """Killed before the manifest: the rerun writes just the manifest. If a written shard was
    lost meanwhile (its bucket files are gone by then), the scatter pass runs again for it. A
    shard edited by hand at the same size is kept, and validate reports it."""
    big, small = sources
    kw = dict(seq_len=L, seed=8, epochs=[0], memory=5000, shard_samples=60)
    ref = tmp_path / "ref"
    shuffle_run([str(big), str(small)], str(ref), **kw)
    out = tmp_path / "out"
    real_manifest, real_write, real_scatter = outputs.write_manifest, steps.EpochJob.write_shard, steps.ScatterStep.run

    def killed_before_manifest(path, manifest, **kw):
        raise OSError("simulated crash")

    monkeypatch.setattr(outputs, "write_manifest", killed_before_manifest)  # every manifest shuffle writes
    with pytest.raises(OSError, match="simulated crash"):
        shuffle_run([str(big), str(small)], str(out), **kw)
    monkeypatch.setattr(outputs, "write_manifest", real_manifest)
    victim = sorted((out / "epoch-00000").glob("*.ds"))[1]
    if shard == "edited":
        raw = bytearray(victim.read_bytes())
        raw[5] ^= 1
        victim.write_bytes(raw)
    elif shard == "deleted":
        victim.unlink()
    ran = []
    monkeypatch.setattr(
        steps.EpochJob, "write_shard", lambda self, i, blocks: (ran.append(i), real_write(self, i, blocks))[1]
    )
    monkeypatch.setattr(
        steps.ScatterStep, "run", lambda self, *a, **k: (ran.append("scatter"), real_scatter(self, *a, **k))[1]
    )
    logged = []
    summary = shuffle_run([str(big), str(small)], str(out), log=logged.append, **kw)
    assert ran == (["scatter", 1] if shard == "deleted" else [])
    # the summary and a log line say what the rerun reused
    n_shards = len(list((out / "epoch-00000").glob("*.ds")))
    assert summary["reused_shards"] == summary["epochs_detail"][0]["shards_reused"] == n_shards - len(ran[1:])
    assert summary["bytes_written"] == sum(victim.stat().st_size for _ in ran[1:])
    if shard == "deleted":
        assert f"epoch 0: resuming: {n_shards - 1} of {n_shards} shards were written by an earlier attempt" in "".join(
            logged
        )
    if shard == "edited":
        report = validate_dirs([out], workers=1, show_progress=False)
        assert not report.ok and str(victim) in {p.file for p in report.problems}, [p.line() for p in report.problems]
        assert any("checksum" in p.message for p in report.problems), [p.line() for p in report.problems]
        return
    assert dir_files(out) == dir_files(ref)


@pytest.mark.parametrize("kill_at", ["scatter", "order"])
def test_sigkill_then_rerun_is_identical(tmp_path, kill_at):
    big = write_source(tmp_path / "src", random_docs(np.random.default_rng(3), 200, 1000, 0, max_len=300))
    kw = dict(seq_len=15, seed=5, epochs=[0], memory=2048, shard_samples=200)
    ref = tmp_path / "ref"
    shuffle_run([str(big)], str(ref), **kw)  # in process: the bytes do not depend on how it runs
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "tokpack.packer.cli",
        "shuffle",
        str(big),
        "-o",
        str(out),
        "--seq-len",
        "15",
        "--seed",
        "5",
        "--epochs",
        "1",
        "--memory",
        "2KiB",
        "--shard-samples",
        "200",
        "--json",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pattern = "*/ooc-*/scatter-00000/*/*.pos" if kill_at == "scatter" else "*/done/*.json"
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if any((out / run.WORK_DIR).glob(pattern)):
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.002)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    with pytest.raises(IncompleteError):
        read_manifest(out / "epoch-00000")
    assert not (out / "tokpack.json").exists()
    shuffle_run([str(big)], str(out), **kw)
    assert dir_files(out) == dir_files(ref)


# ------------------------------------------------------------------ bad input


def run_cli(*args):
    from tokpack.packer.cli import main

    result = CliRunner().invoke(main, ["shuffle", *map(str, args)])
    return result


@pytest.mark.parametrize(
    "case",
    ["unknown", "dtype", "vocab", "seq_len", "weight_text", "weight_zero", "weight_partial", "other_run", "not_a_run"],
)
def test_bad_input_is_one_line_and_exit_1(sources, tmp_path, case):
    big, small = sources
    out = tmp_path / "out"
    base = ["-o", out, "--seq-len", L, "--seed", 1, "--epochs", 1]
    if case == "unknown":
        args = [tmp_path / "nope", *base]
    elif case == "dtype":
        wide = write_source(tmp_path / "wide", random_docs(np.random.default_rng(1), 20, 70000, 0), vocab_size=70000)
        args = [big, wide, *base]
    elif case == "vocab":
        other = write_source(tmp_path / "v2", random_docs(np.random.default_rng(1), 20, 900, 0), vocab_size=900)
        args = [big, other, *base]
    elif case == "seq_len":
        args = [big, "-o", out, "--seq-len", 10**6, "--seed", 1, "--epochs", 1]
    elif case == "weight_text":
        args = [f"{big}=abc", f"{small}=1", *base]
    elif case == "weight_zero":
        args = [f"{big}=0", f"{small}=0.0", *base]
    elif case == "weight_partial":
        args = [f"{big}=1", small, *base]
    elif case == "other_run":
        shuffle_run([str(big)], str(out), seq_len=L, seed=1, epochs=[0], memory=1 << 30)
        args = [big, "-o", out, "--seq-len", L, "--seed", 2, "--epoch", 1]
    else:
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        args = [big, *base]
    result = run_cli(*args)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tokpack: error:"), result.stderr
    assert "Traceback" not in result.output
    if case == "other_run":
        assert "seed" in lines[0] and read_manifest(out, kind="run")["epochs"] == [0]


def test_a_source_shard_cut_short_is_one_line_naming_it_before_anything_is_written(sources, tmp_path):
    """PackedSource.open checks each listed shard's size through the gate: the line names the
    shard, its size field, the manifest's bytes and the file's, and points at the source; without
    that check the read fails later naming a descriptor ("3 [size]: file shorter than expected")."""
    big, _ = sources
    shard = sorted(Path(big).glob("*.ds"))[1]
    size = shard.stat().st_size
    os.truncate(shard, size - 10)
    out = tmp_path / "out"
    result = run_cli(big, "-o", out, "--seq-len", L, "--seed", 1, "--epochs", 1)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert result.stderr.strip().splitlines() == [
        f"tokpack: error: {shard} [size]: shard size does not match the manifest; expected {size} bytes, found "
        f"{size - 10} bytes. HINT: the shard was truncated or replaced; run `tokpack validate` on the source"
    ], result.stderr
    assert not (out / "tokpack.json").exists() and not list(
        out.glob("epoch-*/*.ds")
    )  # nothing that could pass for data


def test_a_different_run_line_says_what_each_side_lacks_and_proposes_an_epoch_the_run_lacks(sources, tmp_path):
    """A shuffle into a run made with other settings: a setting one side does not have (no
    --holdout, no weights) was left out of the line ("expected {'fraction': '1/100'}." and no
    "found"), and the --like hint proposed the first epoch asked even when the run held it (a
    command that writes nothing). The line names both sides; the hint names the first epoch asked
    that the run lacks, and none when it holds every one."""
    big, small = sources
    out = tmp_path / "out"
    shuffle_run([str(big)], str(out), seq_len=L, seed=1, epochs=[0, 1], memory=1 << 30)
    base = [big, "-o", out, "--seq-len", L, "--seed", 1]
    for args, where, expected, found in (
        ([*base, "--epochs", 2, "--holdout", "1%"], "holdout", "{'fraction': '1/100'}", "no holdout"),
        ([f"{big}=0.5", *base[1:], "--epochs", 2], "weights", "['1']", "no weights"),
    ):
        line = run_cli(*args).stderr.strip()
        assert f"[{where}]: output directory holds a different run; expected {expected}, found {found}." in line, line
    line = run_cli(*base[:-1], 2, "--epochs", 2).stderr.strip()
    assert "[seed]" in line and "--like" not in line, line
    line = run_cli(*base[:-1], 2, "--epochs", 4).stderr.strip()
    assert line.endswith(f"`tokpack shuffle --like {out} --epoch 2`"), line
    assert read_manifest(out, kind="run")["epochs"] == [0, 1]
