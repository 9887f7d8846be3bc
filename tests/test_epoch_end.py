"""The end of a `shuffle --to-nodes` epoch (tokpack.packer.exchange._write_and_hash): in memory
the owned shards are hashed on a thread of their own while the slice's rank files are written;
a failed write stops the hashing and is raised; out of core the two follow each other."""

from __future__ import annotations

import threading

import pytest

from tokpack.packer.exchange import _write_and_hash


def test_in_memory_the_hashing_runs_while_the_slice_is_written():
    started, done = threading.Event(), []

    def hash_owned(stop=None):
        started.set()
        done.append(threading.current_thread() is not threading.main_thread())
        return ["owned"]

    def write():
        assert started.wait(10), "the owned shards' hashing did not start while the slice was written"
        return ["slice"]

    assert _write_and_hash(write, hash_owned, at_once=True) == (["slice"], ["owned"])
    assert done == [True]


def test_a_failed_write_stops_the_hashing_and_is_raised():
    stopped = threading.Event()

    def hash_owned(stop=None):
        while not stop.is_set():  # a shard at a time, as hash_owned_shards checks `stop`
            stop.wait(0.01)
        stopped.set()
        return []

    def write():
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        _write_and_hash(write, hash_owned, at_once=True)
    assert stopped.is_set()  # and its thread is gone before the error is raised
    assert not [t for t in threading.enumerate() if t.name.startswith("hash_owned")]


def test_out_of_core_they_follow_each_other_on_the_calling_thread():
    order = []

    def write():
        order.append(("write", threading.current_thread() is threading.main_thread()))
        return 1

    def hash_owned(stop=None):
        order.append(("hash_owned", threading.current_thread() is threading.main_thread()))
        return 2

    assert _write_and_hash(write, hash_owned, at_once=False) == (1, 2)
    assert order == [("write", True), ("hash_owned", True)]
