"""formats/io/ (reads, memory): the read-until-full and buffer-ownership rules every reader relies on."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from tokpack.formats.io.reads import Worker, read_full
from tokpack.formats.io.memory import drop_buffers, give_buffers, lent, take_buffer


def test_read_full_waits_through_short_reads_and_stops_at_end_of_file():
    r, w = os.pipe()

    def writer():  # a pipe hands out what has arrived: each readinto returns a piece
        for piece in (b"abc", b"defg", b"hij"):
            os.write(w, piece)
            time.sleep(0.05)
        os.close(w)

    t = threading.Thread(target=writer)
    t.start()
    with os.fdopen(r, "rb", buffering=0) as f:
        buf = bytearray(8)
        assert read_full(f, memoryview(buf)) == 8
        assert bytes(buf) == b"abcdefgh"
        rest = bytearray(8)
        assert read_full(f, memoryview(rest)) == 2  # end of file: fewer, not an endless loop
        assert bytes(rest[:2]) == b"ij"
    t.join()


def test_read_full_at_an_offset_reads_there_without_moving_the_file_position(tmp_path):
    path = tmp_path / "data"
    path.write_bytes(bytes(range(100)))
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(10)
        assert read_full(fd, memoryview(buf), 95) == 5
        assert bytes(buf[:5]) == bytes(range(95, 100))
        assert read_full(fd, memoryview(buf), 40) == 10
        assert bytes(buf) == bytes(range(40, 50))
        assert os.lseek(fd, 0, os.SEEK_CUR) == 0
    finally:
        os.close(fd)


def test_a_taken_buffer_is_never_handed_out_twice_and_comes_back_after_give():
    a, b = take_buffer(np.uint32), take_buffer(np.uint32)
    assert a is not b
    a.ensure(1000)[:] = 7
    give_buffers([a])
    again = take_buffer(np.uint32)
    assert again is a and len(again.ensure(10)) >= 1000  # the same pages, not fresh memory
    assert take_buffer(np.uint32) is not a
    give_buffers([again, b])


def test_worker_runs_calls_in_order_waits_for_the_oldest_beyond_its_depth_and_raises_a_failure():
    gate, done = threading.Event(), []
    with Worker(2) as worker:
        worker.submit(gate.wait)
        worker.submit(done.append, 1)
        threading.Timer(0.2, gate.set).start()
        worker.submit(done.append, 2)  # two pending: waits until the first (the gate) has run
        assert gate.is_set() and len(worker.pending) <= 2
    assert done == [1, 2]
    with pytest.raises(ZeroDivisionError):
        with Worker() as worker:
            worker.submit(lambda: 1 / 0)


def test_pooled_buffers_of_one_use_stay_apart_from_others_and_are_dropped_together():
    with lent("test-use-a", 1000, 2) as (x, y):
        assert len(x) == len(y) == 1000 and x.ctypes.data != y.ctypes.data
        x[:], y[:] = 1, 1
    a = take_buffer(np.uint8, "test-use-a")
    assert a.ensure(1000)[0] == 1  # given back when the block ended: the same pages again
    give_buffers([a])
    assert take_buffer(np.uint8, "test-use-b") is not a
    drop_buffers("test-use-a")
    assert take_buffer(np.uint8, "test-use-a") is not a


@pytest.mark.parametrize("rerun_scratch", ["scratch", "fresh"])
def test_rerun_from_the_same_scratch_after_an_interrupted_send_completes_the_store(
    tmp_path, monkeypatch, rerun_scratch
):
    """A shuffle to a store killed while sending its manifests leaves them committed in the
    scratch folder but not in the store. The rerun from the same scratch must not take those
    local manifests for finished work: it drops them (Outbox.fetch_state), writes again what
    the store lacks and sends the manifests, so the store holds the whole run, as a fresh one.
    From a fresh scratch (another machine), the state it fetches spares the sent shards."""
    import fsspec

    from conftest import random_docs, write_source
    from tokpack.formats.io.writes import Outbox
    from tokpack.packer import shuffle

    src = write_source(tmp_path / "src", random_docs(np.random.default_rng(3), 60, 1000, 0))
    fs = fsspec.filesystem("memory")
    kw = dict(seq_len=31, seed=1, epochs=2, memory=64 << 10)
    real_send = Outbox.send

    def send_all_but_manifests(self, *files, keep=False):
        if any(str(f).endswith("tokpack.json") for f in files):
            raise KeyboardInterrupt  # killed before a manifest reached the store
        return real_send(self, *files, keep=keep)

    try:
        monkeypatch.setattr(Outbox, "send", send_all_but_manifests)
        with pytest.raises(KeyboardInterrupt):
            shuffle(src, "memory://io-test/run", scratch=tmp_path / "scratch", **kw)
        assert not [f for f in fs.find("/io-test/run") if f.endswith("tokpack.json")]
        assert list((tmp_path / "scratch").rglob("tokpack.json"))  # committed here, never sent
        sent = [str(f) for f in fs.find("/io-test/run") if f.endswith(".ds")]
        assert sent  # epoch 0's shards went before its manifest
        resent = []

        def counting_send(self, *files, keep=False):
            resent.extend(str(self.remote_of(f)) for f in files if str(f).endswith(".ds"))
            return real_send(self, *files, keep=keep)

        monkeypatch.setattr(Outbox, "send", counting_send)
        again = shuffle(src, "memory://io-test/run", scratch=tmp_path / rerun_scratch, **kw)
        got = {f[len("/io-test/run/") :]: fs.cat(f) for f in fs.find("/io-test/run")}
    finally:
        if fs.exists("/io-test"):
            fs.rm("/io-test", recursive=True)
    shuffle(src, tmp_path / "ref", **kw)
    ref = {
        p.relative_to(tmp_path / "ref").as_posix(): p.read_bytes() for p in (tmp_path / "ref").rglob("*") if p.is_file()
    }
    assert again.written == [0, 1]
    assert not {r.split("://", 1)[1].lstrip("/") for r in resent} & {s.lstrip("/") for s in sent}, resent
    assert {k for k in got if k.endswith("tokpack.json")} == {
        "tokpack.json",
        "epoch-00000/tokpack.json",
        "epoch-00001/tokpack.json",
    }
    assert {k: v for k, v in got.items() if k.endswith(".ds")} == {k: v for k, v in ref.items() if k.endswith(".ds")}


def test_iter_mapped_gives_the_whole_file_in_blocks_across_windows_and_refuses_another_size(tmp_path, monkeypatch):
    """formats.io.gate.iter_mapped (--keep-sources' copies and checks): every byte once, in order,
    no block over its size, across several map windows and a tail; a file not of the size given
    is refused before a byte is given; a URL's file gives the same bytes."""
    import fsspec

    from tokpack.formats.errors import TokpackError
    from tokpack.formats.io import gate

    monkeypatch.setattr(gate, "MAP_WINDOW", 3 * 4096 + 100)  # windows of 12 KiB: offsets stay aligned
    data = np.random.default_rng(1).integers(0, 256, 5 * 4096 + 123, dtype=np.uint8).tobytes()
    path = tmp_path / "f"
    path.write_bytes(data)
    for block in (1000, 4096, 1 << 20):
        pieces = [bytes(view) for view in gate.iter_mapped(path, len(data), block)]
        assert b"".join(pieces) == data and max(map(len, pieces)) <= block
    (tmp_path / "empty").write_bytes(b"")
    assert list(gate.iter_mapped(tmp_path / "empty", 0, 10)) == []
    with pytest.raises(TokpackError, match="size"):
        next(gate.iter_mapped(path, len(data) + 1, 4096))
    with fsspec.open("memory://iter-mapped/f", "wb") as f:
        f.write(data)
    assert b"".join(bytes(v) for v in gate.iter_mapped("memory://iter-mapped/f", len(data), 1000)) == data


def test_a_mapped_block_of_a_shard_cut_short_since_it_was_opened_is_one_line_naming_it(tmp_path):
    """PackedSource.mapped (the exchange's reads): a shard shorter than its manifest says by the
    time its block is mapped is refused (never a mapping past its end, whose read would kill the
    process with SIGBUS); a block across a shard's end is not mapped (None: read instead)."""
    from conftest import random_docs, write_source
    from tokpack.formats.errors import TokpackError
    from tokpack.formats.shards import PackedSource

    src = PackedSource.open(
        write_source(tmp_path / "src", random_docs(np.random.default_rng(2), 40, 1000, 0), docs_per_shard=20)
    )
    first = int(src.shard_starts[1])
    handles: dict = {}
    view = src.mapped(0, first, handles)
    assert view.tolist() == np.fromfile(src.path / src.shards[0]["path"], dtype=src.dtype).tolist()
    assert src.mapped(first - 1, 2, handles) is None  # across the first shard's end
    os.truncate(src.path / src.shards[1]["path"], 10)
    with pytest.raises(TokpackError, match="shard shorter than its manifest says") as e:
        src.mapped(first, 100, handles)
    assert e.value.file == str(src.path / src.shards[1]["path"]) and e.value.where == "size"
    line = str(e.value)
    assert "\n" not in line and "expected >= " in line and "found 10 bytes" in line and "tokpack validate" in line
    for f in handles.values():
        f.close()
