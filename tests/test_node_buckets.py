"""A node's rows out of core (tokpack.packer.node_store.Buckets): each bucket read back on a
thread while the caller writes the one before, within the memory node_epoch.memory_plan gives
the buckets, a bad bucket one TokpackError in the caller's thread, and no thread left behind;
under MPI, each bucket file read back once."""

from __future__ import annotations

import os
import threading
import tracemalloc
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import random_docs, write_source
from probes import AUDIT_SITE, audit_env, audited
from test_mpi import OUT_OF_CORE, REPO, summaries, to_nodes

from tokpack.formats.errors import TokpackError
from tokpack.packer import node_store
from tokpack.packer.node_store import Buckets
from tokpack.packer.node_epoch import bucket_row_bytes
from tokpack.packer.pieces import WIRE_PIECE
from tokpack.shuffle.steps import Layout

DTYPE = np.dtype(np.uint16)


def filled(tmp_path, buckets: int, rows: int, row_tokens: int, seed: int = 0):
    """Buckets of `rows` rows each, every row one whole piece, put in a random order as the rounds
    put them; returns (the Buckets, the rows expected in store order)."""
    rng = np.random.default_rng(seed)
    n = buckets * rows
    ne = SimpleNamespace(plan=SimpleNamespace(row_tokens=row_tokens), job=SimpleNamespace(token_dtype=DTYPE))
    starts = np.arange(0, n + 1, rows, dtype=np.int64)
    lay = Layout(1, starts, np.array([0, buckets], dtype=np.int64), 0, str(tmp_path / "ooc-node"), [])
    stores = Buckets(ne, lay, pad_id=0)
    tokens = rng.integers(1, 50000, n * row_tokens).astype(DTYPE)
    at = rng.permutation(n)
    pieces = np.zeros(n, WIRE_PIECE)
    pieces["g"], pieces["length"] = at, row_tokens
    pad = np.full(n, row_tokens, dtype=np.int64)
    for part in np.array_split(np.arange(n), 3):  # three rounds
        stores.put(pad, at[part], pieces[part], tokens, part * row_tokens)
    stores.finish()
    expected = np.empty((n, row_tokens), DTYPE)
    expected[at] = tokens.reshape(n, row_tokens)
    assert not pad.any()
    return stores, expected


def readers() -> list:
    return [t for t in threading.enumerate() if t.name.startswith("tokpack-bucket-read")]


def test_the_next_bucket_is_read_while_the_caller_has_this_one(tmp_path, monkeypatch):
    """When the caller gets bucket k, bucket k+1's read has begun (on another thread), and not
    k+2's; the rows are those put, in order, across calls (the slice's, then the owned rows');
    no thread is left once the last bucket is taken."""
    stores, expected = filled(tmp_path, 5, 8, 16)
    started = {b: threading.Event() for b in range(5)}
    read = node_store.read_bucket

    def recording(lay, b, *args):
        started[b].set()
        return read(lay, b, *args)

    monkeypatch.setattr(node_store, "read_bucket", recording)
    got = []
    for lo, hi in ((0, 24), (24, 40)):
        for a, rows in stores.rows(lo, hi):
            b = a // 8
            if b + 1 < 5:
                assert started[b + 1].wait(10), f"bucket {b + 1} not begun while the caller has bucket {b}"
            if b + 2 < 5:
                assert not started[b + 2].is_set()
            got.append(rows.copy())
    assert np.array_equal(np.concatenate(got), expected)
    for t in readers():
        t.join(10)
    assert not readers()
    assert not list((tmp_path / "ooc-node").rglob("*.rows"))  # each removed once read


def test_two_buckets_at_once_stay_within_what_the_plan_gives_them(tmp_path):
    """Python's and numpy's allocations while the buckets are read back and written (a copy of
    one rank's rows as RankFiles makes one, an EOS mask) stay within the rows' share of --memory that
    memory_plan counts (bucket_row_bytes a row of a bucket), with the next bucket in memory too."""
    rows, row_tokens = 64, 4096
    stores, expected = filled(tmp_path, 6, rows, row_tokens)
    budget = rows * bucket_row_bytes(row_tokens * DTYPE.itemsize)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        for a, got in stores.rows(0, len(expected)):
            copy = got[np.arange(0, len(got), 2)]  # one rank's rows of two, copied
            mask = copy == 0
            assert np.array_equal(copy, expected[a : a + len(got) : 2]) and not mask.all()
            del copy, mask
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    bucket = rows * row_tokens * DTYPE.itemsize
    assert 2 * bucket <= peak <= budget, (peak, bucket, budget)


def test_a_bad_bucket_read_on_the_thread_is_one_error_in_the_callers(tmp_path, monkeypatch):
    """A bucket file changed on disk, read back on the reading thread: the caller gets one
    TokpackError naming the file when it asks for that bucket (the ones before it intact), no
    thread's traceback is printed, and no thread is left."""
    stores, expected = filled(tmp_path, 4, 8, 16)
    bad = stores.lay.bucket_file(0, 2, "rows")
    raw = bytearray(bad.read_bytes())
    raw[5] ^= 1
    bad.write_bytes(bytes(raw))
    hooked = []
    monkeypatch.setattr(threading, "excepthook", hooked.append)
    got = []
    with pytest.raises(TokpackError) as e:
        for a, rows in stores.rows(0, 32):
            got.append(a)
    assert got == [0, 8]
    assert "does not match the checksum" in str(e.value) and str(bad) in str(e.value)
    assert "\n" not in str(e.value)
    for t in readers():
        t.join(10)
    assert not readers() and not hooked


def test_a_caller_that_fails_leaves_no_thread_behind(tmp_path):
    """The caller fails while it has a bucket: the read ahead ends by itself (its rows dropped)."""
    stores, _ = filled(tmp_path, 4, 8, 16)
    with pytest.raises(RuntimeError):
        for _ in stores.rows(0, 32):
            raise RuntimeError("the writer failed")
    for t in readers():
        t.join(10)
    assert not readers() and stores.ahead is None


def test_each_bucket_file_is_read_back_once_and_removed(tmp_path):
    """4 processes out of core, every Python process's opens recorded (tests/audit_site): each
    bucket file is appended to by the rounds, opened for reading once (the bytes a bucket holds:
    written once, read once) and removed; nothing else reads it."""
    source = write_source(tmp_path / "src", random_docs(np.random.default_rng(3), 200, 1000, 0), docs_per_shard=40)
    log = tmp_path / "audit.log"
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), AUDIT_SITE]), **audit_env(log, tmp_path)}
    args = [source, "--seq-len", 63, "--seed", 2, "--epochs", 1, "--shard-samples", 12, "--memory", OUT_OF_CORE]
    done = to_nodes(tmp_path / "run", str(tmp_path / "node{node}"), *args, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    buckets = sum(s["epochs_detail"][0]["buckets"] for s in summaries(done).values())
    reads, writes, removed = Counter(), Counter(), Counter()
    for a in audited(log):
        if "/ooc-node/" in a.path and a.path.endswith((".rows", ".pos")):
            if a.event == "os.remove":
                removed[a.path] += 1
            elif a.event == "open":
                (writes if a.writes else reads)[a.path] += 1
    assert buckets > 4 * 4 and len(writes) == 2 * buckets, (buckets, len(writes))
    assert reads == Counter(dict.fromkeys(writes, 1)), reads
    assert removed == Counter(dict.fromkeys(writes, 1))


def _appended(tmp_path, n: int = 8, row_tokens: int = 5):
    """Buckets (2 of 4 rows) given n whole rows in one round, finish not yet called; their files."""
    ne = SimpleNamespace(plan=SimpleNamespace(row_tokens=row_tokens), job=SimpleNamespace(token_dtype=DTYPE))
    lay = Layout(1, np.arange(0, n + 1, 4, dtype=np.int64), np.array([0, 2], dtype=np.int64), 0, str(tmp_path), [])
    stores = Buckets(ne, lay, pad_id=0)
    pieces = np.zeros(n, WIRE_PIECE)
    pieces["g"], pieces["length"] = np.arange(n), row_tokens
    tokens = np.arange(1, n * row_tokens + 1, dtype=DTYPE)
    stores.put(np.full(n, row_tokens, dtype=np.int64), np.arange(n), pieces, tokens, np.arange(n) * row_tokens)
    return stores, lay, [f for pair in stores.files.files.values() for f in pair]


def test_a_full_disk_at_the_bucket_files_last_flush_is_raised_by_finish(tmp_path):
    """The bucket files' last buffered bytes reach the disk as finish closes them: a full disk
    there is finish's error (the exchange's disk-full line), before the task's records are
    written."""
    import errno

    stores, lay, opened = _appended(tmp_path)
    real = stores.files.close

    def full():
        real()
        raise OSError(errno.ENOSPC, "No space left on device")

    stores.files.close = full
    with pytest.raises(OSError) as raised:
        stores.finish()
    assert raised.value.errno == errno.ENOSPC and opened
    assert not os.path.exists(lay.task_records(0))  # no records for bucket files a full disk cut short


def test_rounds_that_failed_close_the_bucket_files_silently(tmp_path):
    """close(failed=True), the exchange's after a failure in the rounds: the files closed, what
    closing them meets suppressed (the failure under way is the one reported)."""
    stores, _, opened = _appended(tmp_path)
    stores.close(failed=True)
    assert opened and all(f.closed for f in opened)
    stores, _, opened = _appended(tmp_path / "again")

    def broken():
        raise OSError("closing failed")

    stores.files.close = broken
    stores.close(failed=True)  # no error of its own
