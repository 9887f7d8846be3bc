"""Issue 43, item 4: a batch crosses from a DataLoader worker as one tensor (one shared buffer
holding every field), and the main process sees the same fields, bit for bit, as without workers."""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from conftest import random_docs, shuffle_run, wait_until, write_source
from torch.utils.data import default_convert

from tokpack.loader.handoff import PREFIX, SHM_DIR
from tokpack.loader.torch_adapter import Batch, TokpackDataset

SEQ, N, M = 15, 48, 2


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("handoff")
    src = write_source(base / "src", random_docs(np.random.default_rng(7), 120, 1000, 0))
    shuffle_run(
        [str(src)], str(base / "run"), seq_len=SEQ, seed=3, epochs=[0], samples=N, shard_samples=8, memory=8 << 20
    )
    return base / "run"


def storages(batch: dict) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in batch.values()}


def buffers(batch: dict) -> int:
    """How many separate blocks of memory hold the batch's fields: a field that views a storage
    of its own over a buffer's bytes (handoff._views: another dtype) counts with that buffer."""
    spans = sorted((s.data_ptr(), s.data_ptr() + s.nbytes()) for s in (t.untyped_storage() for t in batch.values()))
    ends = []
    for start, end in spans:
        if ends and start < ends[-1]:
            ends[-1] = max(ends[-1], end)
        else:
            ends.append(end)
    return len(ends)


@pytest.mark.parametrize("kw", [{}, {"max_documents": 6}, {"positions": None}])
def test_a_workers_batch_is_one_buffer_with_the_same_fields(run, kw):
    plain = list(TokpackDataset(run, micro_batch=M, at_end="stop", **kw))
    loader = StatefulDataLoader(TokpackDataset(run, micro_batch=M, at_end="stop", **kw), batch_size=None, num_workers=2)
    got = list(loader)
    assert len(got) == len(plain) == N // M
    for a, b in zip(plain, got):
        assert isinstance(b, dict) and list(a) == list(b)
        for key in a:
            assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape and torch.equal(a[key], b[key]), key
        assert buffers(b) == 1  # every field a view of the one buffer that crossed


@pytest.mark.parametrize("kw", [{}, {"max_documents": 6}])
def test_a_workers_batch_saves_with_torch_save(run, kw, tmp_path):
    """A user saves a batch to debug a loss spike: `torch.save(dict(batch))` of a DataLoader
    worker's batch raised "Cannot save multiple tensors or storages that view the same data as
    different types" (its int64 and int32 fields viewed one buffer's storage); it saves, and
    loads (weights_only, torch's default) as the same fields."""
    loader = StatefulDataLoader(TokpackDataset(run, micro_batch=M, at_end="stop", **kw), batch_size=None, num_workers=2)
    for k, batch in enumerate(loader):
        assert {t.dtype for t in batch.values()} == {torch.int64, torch.int32}  # both dtypes, in one buffer
        torch.save(dict(batch), tmp_path / f"{k}.pt")
        saved = torch.load(tmp_path / f"{k}.pt", weights_only=True)
        assert list(saved) == list(batch) and all(torch.equal(saved[key], batch[key]) for key in batch)
        assert all(saved[key].dtype == batch[key].dtype for key in batch)
        if k == 2:
            break


def test_a_batch_pickles_as_one_tensor_until_a_field_changes():
    """A worker's batch crosses once by its buffer's name in /dev/shm (the receiver opens it and
    removes the name); pickled again, as that one buffer; once a field changes, field by field."""
    arrays = {"input_ids": np.arange(6, dtype=np.int64).reshape(2, 3), "cu_seqlens": np.array([0, 3, 6], np.int32)}
    arrays["consumed_samples"] = np.array(4, dtype=np.int64)
    batch = Batch.packed(arrays)
    assert batch["input_ids"].untyped_storage().is_shared()
    # what a DataLoader worker sends (batch_size=None: default_convert copies the dict, same views)
    sent = pickle.dumps(default_convert(batch))
    names = [f for f in os.listdir(SHM_DIR) if f.startswith(f"{PREFIX}{os.getpid()}-")]
    assert len(names) == 1 and f"{SHM_DIR}/{names[0]}".encode() in sent
    again = pickle.loads(sent)
    assert not os.path.exists(f"{SHM_DIR}/{names[0]}")  # the receiver removed the name
    assert type(again) is Batch and list(again) == list(arrays) and buffers(again) == 1
    for key, value in arrays.items():
        assert np.array_equal(again[key].numpy(), value) and again[key].numpy().dtype == value.dtype
    assert again["input_ids"].untyped_storage().is_shared()  # torch's shared memory: it crosses on as any tensor
    again["input_ids"][0, 0] = 9
    assert int(batch["input_ids"][0, 0]) == 9  # one buffer, mapped in both
    rebuild, (buffer, layout) = batch.__reduce__()  # the name went once: now the buffer itself
    assert isinstance(buffer, torch.Tensor) and buffer.untyped_storage().is_shared()
    twice = pickle.loads(pickle.dumps(again))
    assert all(torch.equal(twice[k], again[k]) for k in again) and buffers(twice) == 1
    batch["input_ids"] = batch["input_ids"] + 1  # a collate_fn's change: pickled as it now is
    changed = pickle.loads(pickle.dumps(batch))
    assert np.array_equal(changed["input_ids"].numpy()[0, 1:], arrays["input_ids"][0, 1:] + 1)
    assert len(storages(changed)) == 3


def test_batches_in_flight_when_a_loader_stops_leave_nothing_in_shared_memory(run):
    """The names of the batches a loader stopped early never took are removed as its workers exit."""
    loader = StatefulDataLoader(TokpackDataset(run, micro_batch=M, at_end="stop"), batch_size=None, num_workers=2)
    it = iter(loader)
    pids = [w.pid for w in it._workers]
    got = [next(it) for _ in range(3)]
    assert int(got[-1]["consumed_samples"]) == 3 * M

    def left():
        return [f for f in os.listdir(SHM_DIR) if any(f.startswith(f"{PREFIX}{pid}-") for pid in pids)]

    # the batches asked for ahead, made and sent, not yet taken: waited for (a loaded machine may take
    # a while), then a little longer for the other worker's
    wait_until(left, "a batch made ahead in /dev/shm")
    time.sleep(0.2)
    assert left()
    it._shutdown_workers()
    del it, loader
    assert left() == []


def _rows(rng, m: int, width: int, dtype, eos: int, p: float) -> np.ndarray:
    rows = rng.integers(0, 7, size=(m, width)).astype(dtype)
    rows[rng.random(rows.shape) < p] = eos
    return rows


@pytest.mark.parametrize("seq_len", [1, 2, 3, 15, 4096])
@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_a_window_batch_written_in_place_holds_micro_batchs_values(seq_len, dtype):
    """WindowBatch (the loader's window-epoch path: every field written once into the buffer the
    batch is handed over in) gives micro_batch's values, dtypes and shapes, on rows with EOS at a
    row's first and last token, runs of EOS, rows of EOS only and rows without any; its scratch
    arrays are reused from batch to batch."""
    from tokpack.loader.assembly import I64, WindowBatch, micro_batch, positions_from_eos

    rng = np.random.default_rng(seq_len)
    m, eos = 3, 5
    for positions in (True, False):
        window = WindowBatch(m, seq_len, eos if positions else None)
        for p in (0.0, 0.05, 0.5, 1.0):
            rows = _rows(rng, m, seq_len + 1, dtype, eos, p)
            rows[0, 0] = rows[-1, -1] = eos
            if seq_len > 1:
                rows[1, -2] = eos  # the last input is an EOS: its label starts the next document
            want = micro_batch(rows, None, positions_from_eos(rows, eos) if positions else None, eos)
            starts = window.starts(rows)
            fields = window.fields(starts) + [("consumed_samples", I64, ())]
            batch, out = Batch.empty(fields, shared=False)
            window.fill(out, rows, starts)
            out[-1][...] = 7
            assert list(batch) == [*want, "consumed_samples"]
            for key, value in want.items():
                got = batch[key].numpy()
                assert got.dtype == value.dtype and got.shape == value.shape and np.array_equal(got, value), key
            assert int(batch["consumed_samples"]) == 7


@pytest.mark.parametrize("shared", [False, True])
def test_an_empty_batch_holds_its_fields_written_through_its_arrays(shared):
    """Batch.empty: each field its own bytes, written through the numpy arrays it returns; a
    worker's (shared) is one buffer in shared memory, every field a view of it, and pickles as
    that buffer."""
    fields = [("a", np.dtype(np.int64), (2, 3)), ("b", np.dtype(np.int32), (3,)), ("c", np.dtype(np.int64), ())]
    batch, out = Batch.empty(fields, shared=shared)
    for i, array in enumerate(out):
        array[...] = np.arange(array.size).reshape(array.shape) + 10 * i
    assert [t.dtype for t in batch.values()] == [torch.int64, torch.int32, torch.int64]
    assert batch["a"].tolist() == [[0, 1, 2], [3, 4, 5]] and batch["b"].tolist() == [10, 11, 12]
    assert int(batch["c"]) == 20
    assert [t.data_ptr() for t in batch.values()] == [a.ctypes.data for a in out]  # the tensors are the arrays
    assert (buffers(batch), len(storages(batch))) == ((1, 2) if shared else (3, 3))  # int32 'b': its own storage
    if shared:
        assert batch["a"].untyped_storage().is_shared()
        again = pickle.loads(pickle.dumps(batch))
        assert all(torch.equal(again[k], batch[k]) for k in batch) and buffers(again) == 1


def test_without_workers_the_loader_never_pauses(run, monkeypatch):
    """The hand-off pause (HANDOFF_PAUSE_S) is a worker's: iterating in the training process
    itself (num_workers=0) never sleeps."""
    import tokpack.loader.torch_adapter as adapter

    def no_sleep(seconds):
        raise AssertionError(f"slept {seconds} s in the training process")

    monkeypatch.setattr(adapter.time, "sleep", no_sleep)
    for kw in ({}, {"positions": None}, {"max_documents": 6}):
        assert len(list(TokpackDataset(run, micro_batch=M, at_end="stop", **kw))) == N // M


EXIT_WITH_A_LOADER_RUNNING = """
import os, sys, time
from torchdata.stateful_dataloader import StatefulDataLoader
from tokpack.loader.torch_adapter import TokpackDataset
loader = StatefulDataLoader(TokpackDataset(sys.argv[1], micro_batch=2, at_end="stop"), batch_size=None, num_workers=2)
it = iter(loader)
got = [next(it) for _ in range(3)]
pids = [w.pid for w in it._workers]
deadline = time.monotonic() + 60  # batches in flight at the exit: waited for (a loaded machine may take a while)
while not (made := [f for f in os.listdir(sys.argv[2]) if f.startswith(tuple(f"{sys.argv[3]}{p}-" for p in pids))]):
    if time.monotonic() > deadline:
        break
    time.sleep(0.005)
time.sleep(0.2)  # the other worker's too
print(len(made), *pids)
"""


def test_a_training_process_that_exits_with_a_loader_running_leaves_nothing_in_shared_memory(run):
    """multiprocessing stops the workers of a loader still running at exit (SIGTERM: torch's
    handler exits at once): the batches they had in flight are removed after they are joined."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", EXIT_WITH_A_LOADER_RUNNING, str(run), SHM_DIR, PREFIX],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    made, *pids = out.stdout.split()
    assert len(pids) == 2 and int(made) > 0, out  # batches were in flight as it exited
    assert [f for f in os.listdir(SHM_DIR) if f.startswith(tuple(f"{PREFIX}{p}-" for p in pids))] == []
    assert "Exception ignored" not in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_names_left_by_processes_gone_are_removed_by_the_next_that_makes_one():
    """A worker killed outright leaves its batches in flight in /dev/shm; the next process that
    makes a batch buffer removes them once a minute old, and nothing of a running process's."""
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    old = time.time() - 3600
    made = {
        f"{PREFIX}{dead}-0-aaaaaaaa": old,  # gone, an hour old: removed
        f"{PREFIX}{dead}-1-bbbbbbbb": time.time(),  # gone, just made: kept (its maker may not be done)
        f"{PREFIX}{os.getpid()}-99999-cccccccc": old,  # this process's, running: kept
        f"tokpack-1{PREFIX[8:]}{dead}-2-dddddddd": old,  # another PID namespace's (a container's): kept
    }
    for name, when in made.items():
        with open(os.path.join(SHM_DIR, name), "wb") as f:
            f.write(b"x")
        os.utime(os.path.join(SHM_DIR, name), (when, when))
    try:
        code = "import numpy as np; from tokpack.loader.handoff import Batch; Batch.packed({'a': np.zeros(3)})"
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        left = {name for name in made if os.path.exists(os.path.join(SHM_DIR, name))}
        assert left == set(list(made)[1:])
    finally:
        for name in made:
            if os.path.exists(os.path.join(SHM_DIR, name)):
                os.unlink(os.path.join(SHM_DIR, name))
