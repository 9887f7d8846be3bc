"""The out-of-core engine's placement (which row goes where), tested directly: RowStore.gather
against plain indexing, the order pass's refusals of scatter files that do not place every row
of their bucket exactly once (each whole line), and the buffers a pass frees for the next.
Small and fast: scripts/mutation.sh runs the engine's mutants against this file first."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import xxhash

from conftest import random_docs, shuffle_run, write_source
from tokpack.formats.errors import TokpackError
from tokpack.formats.io import memory as io  # the reusable buffers
from tokpack.formats.constants import WORK_DIR
from tokpack.shuffle import epoch_job, run, run_setup, steps
from tokpack.shuffle.epoch_job import RowStore

L = 31  # 32-token rows
ROW_BYTES = (L + 1) * 2
HINT = ". HINT: delete OUT/.tokpack-work and rerun"
# The layout of the run of KW over `scattered`'s sources (913 samples), computed once.
GOLDEN_SHARDS = 7
GOLDEN_BUCKET_STARTS = [*range(0, 901, 25), 913]
GOLDEN_SHARD_BUCKETS = [0, 6, 12, 18, 24, 30, 36, 37]
GOLDEN_TASK_SHARDS = [[(0, 0, 1)], [(0, 1, 3), (1, 0, 3)]]
GOLDEN_LAYOUT_DIR = "ooc-1d358156b66ee3de"


def rows(values) -> np.ndarray:
    """Rows of 4 bytes holding their own number, as np.void (what the engine moves)."""
    return np.asarray(values, dtype="<u4").view(np.dtype((np.void, 4)))


def numbers(void_rows: np.ndarray) -> list[int]:
    return np.ascontiguousarray(void_rows).view("<u4").tolist()


# ------------------------------------------------------------------ RowStore.gather


STORE_PARTS = [[0, 1, 2], [], [3], [4, 5, 6, 7]]  # an empty part is dropped; starts 0, 3, 4, 8


@pytest.mark.parametrize(
    "idx",
    [
        [5, 0, 7, 3, 1, 6, 2, 4],  # every part, interleaved
        [4, 6, 5],  # one part, not the first
        [1],  # one row
        [3],  # a part of one row
        [2, 2, 7, 0, 0],  # repeats, across parts
        [7, 6, 5, 4, 3, 2, 1, 0],
    ],
)
def test_gather_is_indexing_of_the_concatenated_rows(idx):
    store = RowStore([rows(p) for p in STORE_PARTS])
    assert len(store) == 8 and store.starts.tolist() == [0, 3, 4, 8]
    out, tmp = rows(np.full(10, 99)), rows(np.full(10, 98))
    got = store.gather(np.array(idx, dtype=np.int64), out, tmp)
    assert numbers(got) == idx
    assert numbers(out[len(idx) :]) == [99] * (10 - len(idx))  # nothing written past the chunk


def test_gather_of_nothing_is_empty():
    store = RowStore([rows(p) for p in STORE_PARTS])
    out = rows(np.full(4, 99))
    assert len(store.gather(np.zeros(0, dtype=np.int64), out, rows(np.zeros(4)))) == 0
    assert numbers(out) == [99] * 4


def test_gather_of_nothing_from_an_empty_store_is_empty():
    store = RowStore([rows([]), rows([])])
    assert len(store) == 0 and len(store.gather(np.zeros(0, dtype=np.int64), rows([]), rows([]))) == 0


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
    real_order = steps.OrderStep.run

    def stop(self, *a, **k):
        raise OSError("simulated crash after the scatter pass")

    monkeypatch.setattr(steps.OrderStep, "run", stop)
    with pytest.raises(TokpackError, match="simulated crash"):
        shuffle_run(srcs, str(out), **KW)
    monkeypatch.setattr(steps.OrderStep, "run", real_order)
    return srcs, out


def bucket_files(out: Path, b: int) -> list[Path]:
    return sorted(out.rglob(f"b{b:07d}.rows"))


def reseal(rows_file: Path) -> None:
    """Records the bucket files' current checksums in their task's done JSON, as a scatter bug
    (not a crash) would have written them: only the placement checks can then see the damage."""
    records = scatter_folder(rows_file).with_suffix(".records")
    table = np.fromfile(records, dtype="<u8").reshape(-1, 3)
    b = int(rows_file.stem[1:])
    table[b, 1:] = [
        xxhash.xxh3_64_intdigest(rows_file.read_bytes()),
        xxhash.xxh3_64_intdigest(rows_file.with_suffix(".pos").read_bytes()),
    ]
    table.tofile(records)


def refusal(srcs, out) -> str:
    with pytest.raises(TokpackError) as err:
        shuffle_run(srcs, str(out), **KW)
    assert not (out / "epoch-00000" / "tokpack.json").exists()
    return str(err.value)


def scatter_folder(bucket_file: Path) -> Path:
    """The folder of the scatter task that wrote a bucket file (scatter-TTTTT/FFFF/bBBBBBBB.rows)."""
    return next(p for p in bucket_file.parents if p.name.startswith("scatter-"))


def work_dir(out: Path) -> str:
    (layout,) = {str(scatter_folder(p).parent) for p in out.rglob("b*.rows")}
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
    assert refusal(srcs, out) == (
        f"{lay} [bucket 0]: scatter files do not cover their bucket; expected {n} rows, found {n - 1} rows{HINT}"
    )


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


def pooled_uses() -> set[str]:
    return {use for use, _ in io._FREE_BUFFERS}


def test_passes_free_the_buffers_the_next_pass_does_not_use(scattered, monkeypatch):
    """The order pass frees the scatter pass's buffers before it takes its own, and the next
    scatter frees the order's inverse, so one process never holds two passes' budgets."""
    srcs, out = scattered
    pooled_when_lent: dict[str, list[set]] = {}
    real_lent = steps.lent

    def lent(use, nbytes, count=1):
        pooled_when_lent.setdefault(use, []).append(pooled_uses())
        return real_lent(use, nbytes, count)

    monkeypatch.setattr(steps, "lent", lent)
    shuffle_run(srcs, str(out), **{**KW, "epochs": [0, 1]})
    assert pooled_when_lent["inverse"] and pooled_when_lent["scatter"]
    assert all("scatter" not in pooled for pooled in pooled_when_lent["inverse"])
    assert all("inverse" not in pooled for pooled in pooled_when_lent["scatter"])
    assert "scatter" not in pooled_uses()


def test_no_scatter_buffer_outlives_its_pass(tmp_path, monkeypatch):
    """The scatter pass borrows exactly four buffers (two in, two out), and they go once the
    order pass starts: a fifth would be held, unused, through every later pass of the process."""
    web = write_source(tmp_path / "web", random_docs(np.random.default_rng(7), 150, 1000, 0))
    counts = []
    real_lent = steps.lent

    def lent(use, nbytes, count=1):
        if use == "scatter":
            counts.append(count)
        return real_lent(use, nbytes, count)

    monkeypatch.setattr(steps, "lent", lent)
    shuffle_run([str(web)], str(tmp_path / "run"), **KW)
    assert counts and set(counts) == {4}
    assert "scatter" not in pooled_uses()


def bucket_file_opens(monkeypatch) -> list[tuple[str, object, Path]]:
    """Records (thread name, file, path) for each bucket file the scatter pass opens to append
    (through the gate's open_append, the real one)."""
    opened = []
    real_open = steps.open_append

    def spy(path, **k):
        f = real_open(path, **k)
        if str(path).endswith((".rows", ".pos")):
            opened.append((threading.current_thread().name, f, Path(path)))
        return f

    monkeypatch.setattr(steps, "open_append", spy)
    return opened


def test_scatter_keeps_at_most_the_limit_of_bucket_files_open(tmp_path, monkeypatch):
    """With the limit at 2 buckets, no more than 2 (rows, pos) pairs are open at once (the
    limit keeps a scatter task under the open-files ulimit) and the epoch is the same bytes."""
    web = write_source(tmp_path / "web", random_docs(np.random.default_rng(7), 150, 1000, 0))
    ref = tmp_path / "ref"
    shuffle_run([str(web)], str(ref), **KW)
    monkeypatch.setattr(steps, "MAX_OPEN_BUCKET_FILES", 2)
    opened = bucket_file_opens(monkeypatch)
    most = 0
    spy = steps.open_append

    def counting(path, **k):
        nonlocal most
        f = spy(path, **k)
        most = max(most, sum(not g.closed for _, g, _ in opened))
        return f

    monkeypatch.setattr(steps, "open_append", counting)
    out = tmp_path / "run"
    shuffle_run([str(web)], str(out), **KW)
    assert len(opened) > 8 and most == 4  # the limit is reached, never passed
    assert dir_bytes(out) == dir_bytes(ref)


def test_one_thread_appends_to_the_bucket_files(scattered, tmp_path, monkeypatch):
    """Appends run in order in one disk thread: two at once could interleave one block's rows
    with another's positions in a bucket's pair of files."""
    srcs, _ = scattered
    opened = bucket_file_opens(monkeypatch)
    shuffle_run(srcs, str(tmp_path / "again"), **KW)
    threads_by_task: dict[str, set] = {}
    for name, _, path in opened:
        threads_by_task.setdefault(scatter_folder(path).name, set()).add(name)
    assert len(opened) > 8 and len(threads_by_task) == 2
    assert all(len(threads) == 1 for threads in threads_by_task.values()), threads_by_task
    assert threading.main_thread().name not in set().union(*threads_by_task.values())


def dir_bytes(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file() and WORK_DIR not in p.parts
    }


# ------------------------------------------------------------------ layout and source rows


def captured_layout(srcs, out, monkeypatch, **kw):
    """(job, budget, tasks, layout) of the real run's make_layout call."""
    calls = []
    real = steps.make_layout

    def spy(job, budget, tasks):
        calls.append((job, budget, tasks, real(job, budget, tasks)))
        return calls[-1][-1]

    monkeypatch.setattr(run, "make_layout", spy)
    shuffle_run(srcs, str(out), **{**KW, **kw})
    (call,) = calls
    return call


def test_layout_of_a_small_budget_is_pinned(scattered, tmp_path, monkeypatch):
    """Buckets, shards' first buckets, the scatter block and the tasks' input ranges of one run
    (4 KiB budget, 2 tasks, 5 shards of up to 150 samples), computed once and written here."""
    srcs, _ = scattered
    job, budget, tasks, lay = captured_layout(srcs, tmp_path / "again", monkeypatch)
    assert (budget, tasks, job.row_bytes, job.n_shards) == (4096, 2, ROW_BYTES, GOLDEN_SHARDS)
    assert lay.bucket_starts.tolist() == GOLDEN_BUCKET_STARTS
    assert lay.shard_buckets.tolist() == GOLDEN_SHARD_BUCKETS
    assert (lay.tasks, lay.block_rows, lay.task_shards) == (2, 8, GOLDEN_TASK_SHARDS)
    assert lay.max_bucket == max(np.diff(GOLDEN_BUCKET_STARTS))
    assert Path(lay.dir).parent == Path(job.work_dir) and Path(lay.dir).name == GOLDEN_LAYOUT_DIR


def test_scatter_block_of_a_large_budget_is_whole_rows(scattered, tmp_path, monkeypatch):
    """With a budget far above the data, the scatter block is capped at MAX_BLOCK_BYTES in
    whole rows (62-byte rows do not divide it), one bucket per shard."""
    srcs, _ = scattered
    job, _, _, _ = captured_layout(srcs, tmp_path / "again", monkeypatch, seq_len=30)
    lay = steps.make_layout(job, 1 << 40, 3)
    assert job.row_bytes == 62 and type(lay.block_rows) is int
    assert lay.block_rows == steps.MAX_BLOCK_BYTES // 62 == 1082401
    assert lay.shard_buckets.tolist() == list(range(job.n_shards + 1))
    assert lay.bucket_starts.tolist() == [i * 150 for i in range(job.n_shards)] + [job.plan.samples]


def test_scatter_block_grows_with_the_bucket_count_within_the_budget(scattered, tmp_path, monkeypatch):
    """Below MAX_BLOCK_BYTES, the scatter block is ROWS_PER_APPEND rows per bucket (of all the
    epoch's buckets, not its shards), capped by what the budget holds; a block sized from
    another count only costs time, so the sizes are asserted here."""
    srcs, _ = scattered
    job, _, _, _ = captured_layout(srcs, tmp_path / "again", monkeypatch)
    rb = job.row_bytes
    # Scaled down so this small epoch reaches the regime of a large one: a block set by the bucket count.
    monkeypatch.setattr(steps, "MAX_BLOCK_BYTES", 4 * rb)
    monkeypatch.setattr(steps, "ROWS_PER_APPEND", 2)
    bucket_bound = 0
    for budget in (8 << 10, 16 << 10, 32 << 10, 64 << 10, 1 << 20, 1 << 40):
        lay = steps.make_layout(job, budget, 2)
        buckets = len(lay.bucket_starts) - 1
        fits = budget // (4 * rb + steps.SCATTER_ROW_OVERHEAD)
        assert lay.block_rows * (4 * rb + steps.SCATTER_ROW_OVERHEAD) <= max(budget, 4 * rb + 256)
        assert lay.block_rows == max(1, min(steps.ROWS_PER_APPEND * buckets, fits))
        bucket_bound += buckets > job.n_shards and steps.ROWS_PER_APPEND * buckets <= fits
    assert bucket_bound  # some budget had more buckets than shards, and the block followed them


def test_scatter_task_borrows_blocks_of_its_own_rows_at_most(scattered, tmp_path, monkeypatch):
    """A scatter task's four buffers hold min(block, its largest input run) rows each: a task
    of few windows does not take a whole block of memory, and none takes less than it reads."""
    import dataclasses

    srcs, _ = scattered
    job, _, _, lay = captured_layout(srcs, tmp_path / "again", monkeypatch)
    sizes = []
    real_lent = steps.lent

    def lent(use, nbytes, count=1):
        sizes.append(nbytes) if use == "scatter" else None
        return real_lent(use, nbytes, count)

    monkeypatch.setattr(steps, "lent", lent)
    runs = [
        max(b - a for _, a, b, _, _ in steps.shard_segments(job.plan, job.open_sources(), lay.task_shards[t]))
        for t in range(lay.tasks)
    ]
    assert len(set(runs)) > 1
    for block in (min(runs), max(runs) + 7):  # a block between the tasks' runs, and one above both
        again = dataclasses.replace(lay, block_rows=block, dir=str(tmp_path / f"block-{block}"))
        sizes.clear()
        for t in range(again.tasks):
            steps.ScatterStep(job, again).scatter(t)
        assert sizes == [min(block, n) * job.row_bytes for n in runs]


def test_source_rows_refuses_more_windows_than_the_source_holds(tmp_path):
    """An internal check: asked for windows past the source's end, source_rows says how many
    it was asked for and how many it found instead of yielding short."""
    web = write_source(tmp_path / "web", random_docs(np.random.default_rng(7), 150, 1000, 0))
    (src,) = run_setup.open_sources([str(web)])
    whole = int(src.tokens) // 32
    got = sum(len(part) for part in steps.source_rows(src, 0, whole, 32))
    assert got == whole
    with pytest.raises(TokpackError) as err:
        sum(len(part) for part in steps.source_rows(src, 0, whole + 1, 32))
    assert str(err.value) == f"{web}: internal error: source windows; expected {whole + 1}, found {whole}"


def test_pass_bars_count_every_byte_once(scattered, tmp_path, monkeypatch):
    """Each out-of-core pass's bar: the scatter's total is the bytes of the sources it reads and
    it advances by the windows read, each once; the order's total is the bytes of the epoch and
    it ends at exactly 100%. (The scatter bar ends short of its total by the tokens no window
    takes, here 9: reported, not pinned as right.)"""
    srcs, _ = scattered
    bars = []

    class Bar:
        def __init__(self, total, desc):
            self.total, self.desc, self.done = total, desc, 0

        def update(self, n=1):
            self.done += n

        def close(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def spy(total, desc, unit="B", enabled=None, phase=False):
        assert phase  # a pass's bar ends the lines of the pass before it
        bars.append(Bar(total, desc))
        return bars[-1]

    monkeypatch.setattr(epoch_job, "progress", spy)  # every bar of an epoch is its job's (EpochJob.bar)
    shuffle_run(srcs, str(tmp_path / "again"), **KW)
    source_bytes = sum(
        (Path(s) / m["path"]).stat().st_size
        for s in srcs
        for m in json.loads((Path(s) / "tokpack.json").read_text())["shards"]
    )
    assert [(b.desc, b.total, b.done) for b in bars] == [
        ("epoch 0: scatter", source_bytes, 913 * ROW_BYTES),
        ("epoch 0: order buckets, write shards", 913 * ROW_BYTES, 913 * ROW_BYTES),
    ]


@pytest.mark.parametrize("damage", ["last rows file", "records entry", "records table cut short"])
def test_order_pass_checks_every_bucket_file_against_its_tasks_records(scattered, damage):
    """The records table (rows, xxh3_64 of rows and of positions, per bucket and scatter task)
    is what the order pass checks the scratch files against, for every task and bucket, not
    only the first: a damaged file, or a damaged record, is refused, then the scatter task that
    wrote it runs again and the epoch is the reference bytes."""
    srcs, out = scattered
    lay = Path(work_dir(out))
    tables = sorted(lay.glob("scatter-*.records"))
    assert len(tables) == 2
    firsts = set(GOLDEN_SHARD_BUCKETS)  # the layout of this run (test_layout_of_a_small_budget_is_pinned)
    if damage == "last rows file":  # of the last task, in a bucket that is not its shard's first
        victim = [f for f in sorted(out.rglob("scatter-00001/*/b*.rows")) if int(f.stem[1:]) not in firsts][-1]
        raw = bytearray(victim.read_bytes())
        raw[-1] ^= 0x01
        victim.write_bytes(raw)
    else:
        victim = tables[-1]
        table = np.fromfile(victim, dtype="<u8").reshape(-1, 3)
        b = [int(b) for b in np.flatnonzero(table[:, 0]) if b not in firsts][-1]  # one it wrote rows to
        if damage == "records entry":
            table[b, 1] ^= 1
            table.tofile(victim)
        else:
            victim.write_bytes(table[:b].tobytes())
    message = refusal(srcs, out)
    assert "scatter" in message and ("rerun" in message or "delete" in message), message
    shuffle_run(srcs, str(out), **KW)
    assert (out / "epoch-00000" / "tokpack.json").exists()
