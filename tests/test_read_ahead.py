"""Issue 43, item 4: without DataLoader workers, a TokpackDataset's next batch is made by one
background thread while the step runs (read_ahead, on by default). The batches are the same,
byte for byte; a state saved mid-iteration is the position after the batches handed out, so a
resume is exact; at most one batch is made ahead; no thread outlives the iteration."""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from conftest import random_docs, shuffle_run, wait_until, write_source
from tokpack.formats.errors import TokpackError
from tokpack.loader.read_ahead import ReadAhead
from tokpack.loader.torch_adapter import TokpackDataset

SEQ, N, M = 15, 48, 2
STEPS = N // M
THREAD = "tokpack-read-ahead"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("read-ahead")
    src = write_source(base / "src", random_docs(np.random.default_rng(11), 120, 1000, 0))
    out = {}
    for kind, kw in (("window", {}), ("best-fit", {"packing": "best-fit"})):
        shuffle_run(
            [str(src)],
            str(base / kind),
            seq_len=SEQ,
            seed=3,
            epochs=[0],
            samples=N,
            shard_samples=8,
            memory=8 << 20,
            **kw,
        )
        out[kind] = base / kind
    return out


@pytest.fixture(autouse=True)
def no_thread_of_an_earlier_test():
    """Each test here counts read-ahead threads: none may be left from a test run before it in
    this process. A loader another module's test left in a reference cycle (a `pytest.raises`
    ExceptionInfo keeps the test's frame, and the loaders in it, alive) holds its thread parked
    until the garbage collector frees the cycle, as test_no_thread_outlives_its_iteration proves
    it then does: collected first. One left after that is a leak, and fails here."""
    gc.collect()
    assert threads_left() == []


def threads_left(timeout_s: float = 60.0) -> list[threading.Thread]:
    """The read-ahead threads still alive after up to `timeout_s` (a thread's end is not instant,
    and on a loaded machine not quick either: this returns as soon as none is left)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [t for t in threading.enumerate() if t.name.startswith(THREAD)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.01)


def same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a
    )


def loader(run: Path, read_ahead: bool, **kw) -> StatefulDataLoader:
    ds = TokpackDataset(run, micro_batch=M, at_end="stop", read_ahead=read_ahead, **kw)
    return StatefulDataLoader(ds, batch_size=None, num_workers=0)


KINDS = [("window", {}), ("window", {"positions": None}), ("best-fit", {}), ("window", {"max_documents": 8})]


@pytest.mark.parametrize("kind,kw", KINDS)
def test_read_ahead_gives_the_same_batches_as_without(runs, kind, kw):
    without = list(loader(runs[kind], False, **kw))
    got = list(loader(runs[kind], True, **kw))
    assert len(got) == len(without) == STEPS
    assert all(same(a, b) for a, b in zip(without, got))
    assert threads_left() == []


def test_read_ahead_makes_one_batch_ahead_and_no_more(runs):
    """While the consumer holds batch k, the thread has made batch k + 1 (the reader has read its
    rows) and nothing after it, however long the consumer takes."""
    ds = TokpackDataset(runs["window"], micro_batch=M, at_end="stop")
    it = iter(ds)
    next(it)
    for k in range(1, 4):
        wait_until(lambda: ds._stream.last_step >= k, f"the thread made batch {k}")  # a busy machine: give it time
        assert ds._stream.last_step == k, "the thread made the next batch"
        time.sleep(0.2)  # far longer than a batch takes: a thread not bounded would run on
        assert ds._stream.last_step == k, "and only that one"
        batch = next(it)
        assert int(batch["consumed_samples"]) == (k + 1) * M
    it.close()
    assert threads_left() == []


@pytest.mark.parametrize("kind,kw", KINDS[:3])
@pytest.mark.parametrize("taken", [0, 1, 5, STEPS - 1, STEPS])
def test_a_state_saved_with_read_ahead_resumes_to_the_bit(runs, kind, kw, taken):
    """The StatefulDataLoader's state after `taken` batches with read-ahead (the thread has made
    batch taken + 1 by then) is the state without it, and a loader resumed from it gives the rest
    of the batches, byte for byte."""
    reference = loader(runs[kind], False, **kw)
    ahead = loader(runs[kind], True, **kw)
    ref_it, it = iter(reference), iter(ahead)
    for _ in range(taken):
        assert same(next(ref_it), next(it))
    if 0 < taken < STEPS:  # the thread has made its batch ahead (none before the first, none past the last)
        made = ahead.dataset  # the loader's dataset, iterated in this process (no workers)
        wait_until(lambda: made._stream.last_step == taken, f"the thread made batch {taken}")
    state = ahead.state_dict()
    assert state == reference.state_dict()
    assert TokpackDataset.consumed_samples(state) == taken * M
    rest = list(ref_it)
    for read_ahead in (True, False):
        resumed = loader(runs[kind], read_ahead, **kw)
        resumed.load_state_dict(state)
        got = list(resumed)
        assert len(got) == len(rest) == STEPS - taken
        assert all(same(a, b) for a, b in zip(rest, got))
    del it, ahead  # the loader keeps its last iterator (for its state_dict): both go
    assert threads_left() == []


def test_a_dataset_state_follows_the_batches_handed_out(runs):
    ds = TokpackDataset(runs["window"], micro_batch=M, at_end="stop")
    it = iter(ds)
    for k in range(1, 4):
        batch = next(it)
        # the thread has made the batch after it: the state must not follow that one
        wait_until(lambda: ds._stream.last_step >= k, f"the thread made batch {k}")
        assert ds.state_dict()["consumed_samples"] == k * M == int(batch["consumed_samples"])
    del it
    assert threads_left() == []


def test_no_thread_outlives_its_iteration(runs):
    before = set(threading.enumerate())  # a thread of an earlier test (a progress writer) may end meanwhile
    # exhausted
    assert len(list(loader(runs["window"], True))) == STEPS
    assert threads_left() == []
    # a loop left early, the iterator dropped
    for i, _ in enumerate(TokpackDataset(runs["window"], micro_batch=M, at_end="stop")):
        if i == 2:
            break
    assert threads_left() == []
    # a StatefulDataLoader's iterator dropped mid-way, and one kept in a reference cycle
    ldr = loader(runs["window"], True)
    it = iter(ldr)
    next(it)
    assert [t.name for t in threading.enumerate() if t.name.startswith(THREAD)] == [THREAD]
    del it, ldr
    assert threads_left() == []
    ldr = loader(runs["window"], True)
    it = iter(ldr)
    next(it)
    cycle = [it]
    cycle.append(cycle)
    del it, ldr, cycle
    gc.collect()
    assert threads_left() == []
    assert set(threading.enumerate()) <= before  # none new


def test_an_error_comes_where_its_batch_would_have(runs):
    """at_end="error": the batches, then the end's one line at the same next() as without."""
    for read_ahead in (False, True):
        ds = TokpackDataset(runs["window"], micro_batch=M, read_ahead=read_ahead)
        it = iter(ds)
        got = [next(it) for _ in range(STEPS)]
        assert int(got[-1]["consumed_samples"]) == N
        with pytest.raises(TokpackError, match="epoch"):
            next(it)
        with pytest.raises(StopIteration):
            next(it)
    assert threads_left() == []


def test_read_ahead_must_be_a_bool(runs):
    with pytest.raises(TokpackError, match="read_ahead"):
        TokpackDataset(runs["window"], micro_batch=M, read_ahead=1)


def test_read_ahead_thread_is_bounded_and_stops_on_close():
    made = []

    def items():
        for i in range(100):
            made.append(i)
            yield i

    ra = ReadAhead(items())
    assert next(ra) == 0
    wait_until(lambda: len(made) > 1, "the thread made item 1")  # a loaded machine may take a while
    time.sleep(0.1)  # a thread not bounded would run on meanwhile
    assert made == [0, 1]  # one ahead of the consumer
    ra.close()
    assert not ra.alive and made == [0, 1]


@pytest.mark.parametrize("read_ahead", [False, True])
def test_an_iterator_closed_after_the_modules_names_are_cleared_is_quiet(runs, monkeypatch, read_ahead):
    """An iterator left suspended until the interpreter's exit is closed after the modules' names
    are cleared (None): its close must not raise ("Exception ignored ... catching classes that do
    not inherit from BaseException" was printed at exit)."""
    import tokpack.loader.read_ahead as ra_module
    import tokpack.loader.torch_adapter as ta_module

    it = iter(TokpackDataset(runs["window"], micro_batch=M, at_end="stop", read_ahead=read_ahead))
    next(it)
    for module in (ta_module, ra_module):
        for name in ("TokpackError", "WorkerError", "ReadAhead", "get_worker_info", "sys", "threading", "queue"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, None)
    it.close()
    monkeypatch.undo()
    assert threads_left() == []
