"""The out-of-core engine's placement (which row goes where), tested directly: RowStore.gather
against plain indexing, the order pass's refusals of scatter files that do not place every row
of their bucket exactly once (each whole line), and the buffers a pass frees for the next.
Small and fast: scripts/mutation.sh runs the engine's mutants against this file first."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import xxhash

from conftest import random_docs, write_source
from formats.errors import TokpackError
from shuffle import engine
from shuffle.engine import RowStore, shuffle_run

L = 31  # 32-token rows
ROW_BYTES = (L + 1) * 2
HINT = ". HINT: delete OUT/.tokpack-work and rerun"


def rows(values) -> np.ndarray:
    """Rows of 4 bytes holding their own number, as np.void (what the engine moves)."""
    return np.asarray(values, dtype="<u4").view(np.dtype((np.void, 4)))


def numbers(void_rows: np.ndarray) -> list[int]:
    return np.ascontiguousarray(void_rows).view("<u4").tolist()


# ------------------------------------------------------------------ RowStore.gather


STORE_PARTS = [[0, 1, 2], [], [3], [4, 5, 6, 7]]  # an empty part is dropped; starts 0, 3, 4, 8


@pytest.mark.parametrize("idx", [
    [5, 0, 7, 3, 1, 6, 2, 4],  # every part, interleaved
    [4, 6, 5],  # one part, not the first
    [1],  # one row
    [3],  # a part of one row
    [2, 2, 7, 0, 0],  # repeats, across parts
    [7, 6, 5, 4, 3, 2, 1, 0],
])
def test_gather_is_indexing_of_the_concatenated_rows(idx):
    store = RowStore([rows(p) for p in STORE_PARTS])
    assert len(store) == 8 and store.starts.tolist() == [0, 3, 4, 8]
    out, tmp = rows(np.full(10, 99)), rows(np.full(10, 98))
    got = store.gather(np.array(idx, dtype=np.int64), out, tmp)
    assert numbers(got) == idx
    assert numbers(out[len(idx):]) == [99] * (10 - len(idx))  # nothing written past the chunk


def test_gather_of_nothing_is_empty():
    store = RowStore([rows(p) for p in STORE_PARTS])
    out = rows(np.full(4, 99))
    assert len(store.gather(np.zeros(0, dtype=np.int64), out, rows(np.zeros(4)))) == 0
    assert numbers(out) == [99] * 4


@pytest.mark.parametrize("bad", [[8], [0, -1], [3, 9, 1]])
def test_gather_refuses_an_index_out_of_range(bad):
    store = RowStore([rows(p) for p in STORE_PARTS])
    with pytest.raises(IndexError, match="row index out of range"):
        store.gather(np.array(bad, dtype=np.int64), rows(np.zeros(4)), rows(np.zeros(4)))


# ------------------------------------------------------------------ order pass refusals


KW = dict(seq_len=L, seed=4, epochs=[0], memory=4096, shard_samples=150, tasks=2)


@pytest.fixture
def scattered(tmp_path, monkeypatch):
    """A run stopped after its scatter pass (as a crash would): the bucket files and the tasks'
    done records are on disk, no shard is written. Returns (sources, out, order run)."""
    web = write_source(tmp_path / "web", random_docs(np.random.default_rng(7), 150, 1000, 0))
    code = write_source(tmp_path / "code", random_docs(np.random.default_rng(8), 40, 1000, 0), docs_per_shard=15)
    srcs, out = [str(web), str(code)], tmp_path / "run"
    real_order = engine.OrderStep.run

    def stop(self, *a, **k):
        raise OSError("simulated crash after the scatter pass")

    monkeypatch.setattr(engine.OrderStep, "run", stop)
    with pytest.raises(TokpackError, match="simulated crash"):
        shuffle_run(srcs, str(out), **KW)
    monkeypatch.setattr(engine.OrderStep, "run", real_order)
    return srcs, out


def bucket_files(out: Path, b: int) -> list[Path]:
    return sorted(out.rglob(f"b{b:07d}.rows"))


def reseal(rows_file: Path) -> None:
    """Records the bucket files' current checksums in their task's done JSON, as a scatter bug
    (not a crash) would have written them: only the placement checks can then see the damage."""
    done = rows_file.parent.with_suffix(".json")
    record = json.loads(done.read_text())
    b = str(int(rows_file.stem[1:]))
    record["xxh3_64"][b] = [xxhash.xxh3_64_hexdigest(rows_file.read_bytes()),
                            xxhash.xxh3_64_hexdigest(rows_file.with_suffix(".pos").read_bytes())]
    done.write_text(json.dumps(record))


def refusal(srcs, out) -> str:
    with pytest.raises(TokpackError) as err:
        shuffle_run(srcs, str(out), **KW)
    assert not (out / "epoch-00000" / "tokpack.json").exists()
    return str(err.value)


def work_dir(out: Path) -> str:
    (layout,) = {str(p.parent.parent) for p in out.rglob("b*.rows")}
    return layout


def test_scatter_files_short_of_a_row_are_refused(scattered):
    """Half a row moved from one task's file of a bucket to the other's: the bytes held add up
    (so the rerun goes straight to the order pass) but the whole rows are one short."""
    srcs, out = scattered
    lay = work_dir(out)
    a, b = bucket_files(out, 0)
    n = (a.stat().st_size + b.stat().st_size) // ROW_BYTES
    data_a, half = a.read_bytes(), ROW_BYTES // 2
    a.write_bytes(data_a[:-half])
    b.write_bytes(b.read_bytes() + data_a[-half:])
    reseal(a)
    reseal(b)
    assert refusal(srcs, out) == (f"{lay} [bucket 0]: scatter files do not cover their bucket; "
                                  f"expected {n} rows, found {n - 1} rows{HINT}")


def test_scatter_file_holding_a_row_of_another_bucket_is_refused(scattered):
    srcs, out = scattered
    lay = work_dir(out)
    f = bucket_files(out, 1)[0]
    pos = np.fromfile(f.with_suffix(".pos"), dtype="<i8")
    pos[-1] = 0  # output position 0 is in bucket 0
    pos.tofile(f.with_suffix(".pos"))
    reseal(f)
    assert refusal(srcs, out) == f"{lay} [bucket 1]: scatter file holds a row of another bucket{HINT}"


@pytest.mark.parametrize("end", ["first", "last"])
def test_scatter_file_holding_a_position_past_its_bucket_is_refused(scattered, end):
    """One past the bucket's last position, and one before its first: both are another
    bucket's, so the check must be exact at both ends."""
    srcs, out = scattered
    lay = work_dir(out)
    starts = {}
    for b in (1, 2):
        starts[b] = min(int(np.fromfile(p.with_suffix(".pos"), dtype="<i8").min()) for p in bucket_files(out, b))
    f = bucket_files(out, 1)[0]
    pos = np.fromfile(f.with_suffix(".pos"), dtype="<i8")
    pos[0] = starts[2] if end == "last" else starts[1] - 1
    pos.tofile(f.with_suffix(".pos"))
    reseal(f)
    assert refusal(srcs, out) == f"{lay} [bucket 1]: scatter file holds a row of another bucket{HINT}"


def test_scatter_files_holding_a_position_twice_are_refused(scattered):
    srcs, out = scattered
    lay = work_dir(out)
    f = bucket_files(out, 2)[0]
    pos = np.fromfile(f.with_suffix(".pos"), dtype="<i8")
    assert len(pos) >= 2
    pos[1] = pos[0]
    pos.tofile(f.with_suffix(".pos"))
    reseal(f)
    assert refusal(srcs, out) == f"{lay} [bucket 2]: scatter files hold a position twice{HINT}"


# ------------------------------------------------------------------ buffers


def test_passes_free_the_buffers_the_next_pass_does_not_use(scattered, monkeypatch):
    """The order pass frees the scatter pass's four buffers before it takes its own, and the
    next scatter frees the order's inverse, so one process never holds two passes' budgets."""
    srcs, out = scattered
    scatter_names = {"scatter-in0", "scatter-in1", "scatter-out0", "scatter-out1"}
    assert scatter_names <= set(engine._BUFFERS)
    held_by_name: dict[str, list[set]] = {}
    real_reused = engine.reused

    def reused(name, nbytes):
        held_by_name.setdefault(name, []).append(set(engine._BUFFERS))
        return real_reused(name, nbytes)

    monkeypatch.setattr(engine, "reused", reused)
    shuffle_run(srcs, str(out), **{**KW, "epochs": [0, 1]})
    assert held_by_name["inverse"] and held_by_name["scatter-in0"]
    assert all(not scatter_names & held for held in held_by_name["inverse"])
    assert all("inverse" not in held for held in held_by_name["scatter-in0"])
    assert not scatter_names & set(engine._BUFFERS)
