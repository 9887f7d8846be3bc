"""Rank files written during the rounds (issue 41, item 3): in memory, a windows epoch of
`shuffle --to-nodes` opens its rank files before its rounds and writes each row to its place as
soon as a round completes it (RankFiles.place, tokpack.formats.io.writes.PlacedFile); after the
rounds their tokens are only hashed and indexed, in order. The files are byte for byte those
written after the rounds, and the tokens reach the disk once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import random_docs, write_source
from tokpack.formats.errors import TokpackError
from tokpack.formats.io import writes
from tokpack.formats.io.writes import PAGE, TMP_MARK, PlacedFile, RowPages
from tokpack.formats.outputs import EpochShardFormat, LocalOutput
from tokpack.formats.slices import RankRows
from tokpack.packer.rank_files import RankFiles

SEQ = 63


def rank_files(d: Path, rows: RankRows, first: int, placed: bool, seq: int = SEQ) -> RankFiles:
    fmt = EpochShardFormat(np.dtype("<u2"), seq, 0, "gpt2", placed=placed)
    return RankFiles(LocalOutput(), d, rows, first, (2, 3), 0, fmt)


@pytest.mark.parametrize("iov_max", [2, writes.IOV_MAX])  # a run of more pieces than a pwritev takes: in parts
@pytest.mark.parametrize("seq", [SEQ, 1000, 4096])  # rows of 128 bytes (32 a page), 2002 and 8194 (across pages)
def test_rows_placed_in_any_order_give_the_files_written_in_order(tmp_path, monkeypatch, seq, iov_max):
    """The rows of ranks 2-3 placed in a shuffled order over several calls (as rounds complete
    them) give the files RankFiles writes from the same rows in order: each temporary token file
    holds every row at its place before `add` sees them, each of its pages written once, whole
    (but the file's last), and add + close write the index, row hashes and metadata but no token
    byte again."""
    rows, first, n = RankRows(8, 3, 5), 17, 400
    positions = np.array([g for g in range(n) if rows.rank_of(g + first) in (2, 3)], dtype=np.int64)
    store = np.random.default_rng(1).integers(1, 60000, (len(positions), seq + 1)).astype(np.uint16)
    store[::7, 5] = 0  # EOS tokens: fragments in the index

    want = rank_files(tmp_path / "in-order", rows, first, placed=False, seq=seq)
    want.add(positions, store, None)
    want_entries = want.close()

    files = rank_files(tmp_path / "placed", rows, first, placed=True, seq=seq)
    files.reserve(n)
    regions, real_write_at = {}, PlacedFile.write_at

    def write_at(self, offset, pieces, length):
        regions.setdefault(self.tmp.name, []).append((offset, length))
        return real_write_at(self, offset, pieces, length)

    monkeypatch.setattr(PlacedFile, "write_at", write_at)
    monkeypatch.setattr(writes, "IOV_MAX", iov_max)
    order = np.random.default_rng(2).permutation(len(positions))
    for part in np.array_split(order, 5):  # a round's rows: any of the slice's, in any order
        files.place(positions[part], store, part)
    monkeypatch.undo()
    for r in (2, 3):  # before add: the temporary token file holds rank r's rows in order, at its final size
        (tmp,) = (tmp_path / "placed").glob(f"rank-{r:05d}.ds{TMP_MARK}*")
        mine = store[rows.rank_of(positions + first) == r]
        assert tmp.read_bytes() == mine.tobytes()
        size, at = mine.nbytes, 0
        for offset, length in sorted(regions[tmp.name]):  # each byte once, each write whole pages
            assert offset == at and offset % PAGE == 0 and (length % PAGE == 0 or offset + length == size)
            at += length
        assert at == size

    written = []
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: written.append(len(data)) or real_write(fd, data))
    files.add(positions[:100], store[:100], None)  # in as many parts as suit the caller
    files.add(positions[100:], store[100:], None)
    entries = files.close()
    monkeypatch.undo()

    assert entries == want_entries
    for name in sorted(os.listdir(tmp_path / "in-order")):
        assert (tmp_path / "placed" / name).read_bytes() == (tmp_path / "in-order" / name).read_bytes(), name
    assert not [p for p in os.listdir(tmp_path / "placed") if TMP_MARK in p]
    # the index and the row hashes, not the tokens (the metadata is written by write_bytes_atomic)
    sidecars = sum(
        os.path.getsize(p) for p in (tmp_path / "placed").glob("rank-*.ds.*") if p.suffix in (".index", ".rows")
    )
    assert sum(written) == sidecars


def test_rows_missing_or_placed_twice_are_refused_at_commit(tmp_path, monkeypatch):
    """A placed file commits only when the bytes placed are exactly the bytes hashed and its
    size: a row never placed (a hole of zeros) or its bytes written twice would give a wrong
    file; a row placed twice is refused at once. A short write is completed."""
    row = bytes(range(10))
    for places in ([0], [0, 1, 1]):
        f = PlacedFile(tmp_path / "x.ds")
        f.reserve(2, 10)
        for i in places:
            f.write_at(10 * i, [memoryview(row)], 10)
        f.write(row * 2)
        with pytest.raises(TokpackError, match="written in place are not the bytes hashed"):
            f.commit()
        f.abort()
        assert not list(tmp_path.iterdir())
    f = PlacedFile(tmp_path / "x.ds")
    f.reserve(2, 10)
    f.place(memoryview(row * 2), np.array([10]), np.array([0]))
    with pytest.raises(TokpackError, match="a row was placed twice"):
        f.place(memoryview(row * 2), np.array([10, 0]), np.array([0, 1]))
    real = os.pwritev
    monkeypatch.setattr(os, "pwritev", lambda fd, pieces, at: real(fd, [pieces[0][:3]], at))  # 3 bytes of a run
    f.place(memoryview(row * 2), np.array([0]), np.array([1]))
    monkeypatch.undo()
    f.write(row * 2)
    f.commit()
    assert (tmp_path / "x.ds").read_bytes() == row * 2


@pytest.mark.parametrize("row_bytes", [1, 7, 128, 1000, 4095, 4096, 4097, 8194, 3 * 4096 + 5])
@pytest.mark.parametrize("rows", [1, 2, 5, 37])
def test_each_page_is_written_once_when_its_rows_are_in(row_bytes, rows):
    """Rows completed in a random order, a random number at a time: each page's bytes are
    given once, whole (but the file's last), in the call that completes its last row, and they
    are those rows' bytes."""
    rng = np.random.default_rng(row_bytes * 100 + rows)
    data = rng.integers(0, 256, rows * row_bytes + 11, dtype=np.uint8)
    where = rng.permutation(rows) * row_bytes + rng.integers(0, 12)  # each row's bytes somewhere in data
    pages, size, got = RowPages(rows, row_bytes), rows * row_bytes, np.zeros(rows * row_bytes, dtype=np.int64)
    order, done = rng.permutation(rows), np.zeros(rows, dtype=bool)
    for part in np.array_split(order, rng.integers(1, rows + 1)):
        lo, hi, (a, b), cuts = pages.add(part, where[part])
        done[part] = True
        for k in range(len(lo)):
            assert lo[k] % PAGE == 0 and (hi[k] % PAGE == 0 or hi[k] == size)
            assert (not k or lo[k] > hi[k - 1]) and (b[cuts[k] : cuts[k + 1]] - a[cuts[k] : cuts[k + 1]]).sum() == hi[
                k
            ] - lo[k]
            got[lo[k] : hi[k]] += 1
            run = np.concatenate([data[x:y] for x, y in zip(a[cuts[k] : cuts[k + 1]], b[cuts[k] : cuts[k + 1]])])
            rows_at = np.arange(lo[k], hi[k]) // row_bytes
            assert (run == data[where[rows_at] + np.arange(lo[k], hi[k]) % row_bytes]).all()
        # every page whose rows are all in is written by now, and no other
        for p in range(0, size, PAGE):
            assert bool(got[p]) == bool(done[p // row_bytes : (min(p + PAGE, size) - 1) // row_bytes + 1].all())
    assert (got == 1).all()


def test_file_rows_are_each_samples_row_in_its_ranks_file():
    for w, m, phase in ((4, 2, 0), (8, 3, 5), (3, 5, 7), (1, 1, 0)):
        rows = RankRows(w, m, phase)
        for first in (0, 1, 13, 40):
            g = np.arange(first, first + 200)
            want = [rows.rows(int(rows.rank_of(x)), first, int(x)) for x in g]
            assert rows.file_rows(first, g).tolist() == want


HOOK = """
import runpy, shutil, sys
from pathlib import Path
import tokpack.packer.exchange as ex
import tokpack.packer.node_store as ns

ns.WRITE_THROUGH = True  # whatever this machine's cores (write_through_pays)

copies, original = Path(sys.argv.pop(1)), ex.write_slice_epoch


def write_slice_epoch(output, d, ne, *more):
    # this process's rank files' temporary token files as the rounds left them, before its
    # write phase (another process of the node may be renaming its own meanwhile)
    for tmp in [t for r in ne.mine for t in Path(d).glob(f"rank-{r:05d}.ds.tmp-*")]:
        to = copies / Path(d).parent.name / Path(d).name / tmp.name.split(".tmp-")[0]
        to.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tmp, to)
    return original(output, d, ne, *more)


ex.write_slice_epoch = write_slice_epoch
sys.argv[0] = "tokpack"
runpy.run_module("tokpack", run_name="__main__")
"""


@pytest.mark.parametrize("procs", [1, 2])
def test_the_rounds_leave_every_rank_file_written_before_the_write_phase(tmp_path, procs):
    """4 MPI processes (4 nodes, or 2 nodes of 2 processes), windows in memory, 2 epochs of
    several rounds: when the write phase starts, each rank file's temporary token file already
    holds the tokens of the rank file committed after it, byte for byte."""
    from test_mpi import mpi_env, mpirun

    source = write_source(tmp_path / "src", random_docs(np.random.default_rng(3), 200, 1000, 0), docs_per_shard=40)
    (tmp_path / "hook.py").write_text(HOOK)
    copies, dest = tmp_path / "copies", tmp_path / "node{node}"
    cmd = [mpirun(), "--oversubscribe", "-n", "4", sys.executable, str(tmp_path / "hook.py"), str(copies)]
    cmd += ["shuffle", str(source), "--seq-len", str(SEQ), "--seed", "2", "--epochs", "2", "--shard-samples", "100"]
    cmd += ["-o", str(tmp_path / "run"), "--to-nodes", str(dest), "--ranks-per-node", "2"]
    cmd += ["--micro-batch", "3", "--procs-per-node", str(procs), "--memory", f"{64 * procs}KiB", "--json"]

    done = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    info = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert all(e["rounds"] > 1 and e["buckets"] == 0 for s in info for e in s["epochs_detail"])  # in memory
    assert all(e["phases"]["write_through"]["bytes"] > 0 for s in info for e in s["epochs_detail"])
    nodes = 4 // procs
    finals = sorted(tmp_path.glob("node*/epoch-*/rank-*.ds"))
    assert len(finals) == 2 * 2 * nodes  # 2 epochs, 2 ranks a node
    for final in finals:
        copy = copies / final.parent.parent.name / final.parent.name / final.name
        assert copy.read_bytes() == final.read_bytes(), final


def test_the_write_through_is_taken_where_the_host_has_cores_to_spare(monkeypatch):
    """On by itself only with CORES_A_PROCESS cores a process of the host (this 2-core machine's
    4 processes: off, where it made the epoch slower); WRITE_THROUGH forces it either way."""
    import tokpack.packer.node_store as ns

    monkeypatch.setattr(ns, "WRITE_THROUGH", None)
    assert not ns.write_through_pays(2, 4) and not ns.write_through_pays(None, 1)
    assert not ns.write_through_pays(23, 8) and ns.write_through_pays(24, 8) and ns.write_through_pays(96, 8)
    monkeypatch.setattr(ns, "WRITE_THROUGH", True)
    assert ns.write_through_pays(2, 4)
    monkeypatch.setattr(ns, "WRITE_THROUGH", False)
    assert not ns.write_through_pays(96, 1)


SITE = """
import os, threading
import tokpack.packer.node_store as ns
import tokpack.packer.rank_files as rf

ns.WRITE_THROUGH = True  # whatever this machine's cores
place = rf.RankFiles.place


def placed_behind(self, *args):
    if threading.current_thread() is threading.main_thread():  # the rounds' own thread: a mark
        open(os.environ["MAIN_MARK"], "a").close()
    return place(self, *args)


rf.RankFiles.place = placed_behind
"""


def test_written_through_equals_shuffle_then_stage_node(tmp_path):
    """With the write-through forced on (this machine's cores leave it off: write_through_pays),
    4 processes' slices, two epochs of several rounds, are byte for byte shuffle + stage --node,
    and the rounds wrote the tokens (phase write_through), never on the rounds' thread."""
    from test_mpi import REPO, assert_same_slices, staged, summaries, to_nodes

    source = write_source(tmp_path / "src", random_docs(np.random.default_rng(3), 200, 1000, 0), docs_per_shard=40)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE)
    args = [source, "--seq-len", 16, "--seed", 5, "--epochs", 2, "--shard-samples", 12]
    run, dests = staged(tmp_path, args)
    exchanged = tmp_path / "exchanged"
    env = {"PYTHONPATH": f"{site}{os.pathsep}{REPO}", "MAIN_MARK": str(tmp_path / "placed-on-main")}
    done = to_nodes(exchanged, str(tmp_path / "node{node}"), *args, "--memory", "64KiB", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    details = [d for s in summaries(done).values() for d in s["epochs_detail"]]
    assert len(details) == 8 and all(d["rounds"] > 1 and d["phases"]["write_through"]["bytes"] > 0 for d in details)
    assert_same_slices(run, dests, exchanged, tmp_path / "node")
    assert not (tmp_path / "placed-on-main").exists()  # the rows were written behind, on a thread of their own


FAILING = """
import errno, os
import tokpack.packer.node_store as ns
import tokpack.formats.io.writes as writes

ns.WRITE_THROUGH = True
write_at = writes.PlacedFile.write_at
calls = [0]


def full(self, *args):
    calls[0] += 1
    if calls[0] > 1:  # the disk fills up after the first write behind the rounds
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.tmp))
    return write_at(self, *args)


writes.PlacedFile.write_at = full
"""


def test_a_failed_write_behind_the_rounds_stops_the_job_in_one_line_and_leaves_no_temporary(tmp_path):
    """A write of the writing thread that fails (a full disk) is raised in the rounds' thread:
    each process stops with one line naming the error, no traceback, and no temporary rank file
    or slice manifest is left that could pass for data."""
    from test_mpi import REPO, to_nodes

    source = write_source(tmp_path / "src", random_docs(np.random.default_rng(3), 200, 1000, 0), docs_per_shard=40)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAILING)
    args = [source, "--seq-len", 16, "--seed", 5, "--epochs", 1, "--shard-samples", 12, "--memory", "64KiB"]
    env = {"PYTHONPATH": f"{site}{os.pathsep}{REPO}"}
    done = to_nodes(tmp_path / "run", str(tmp_path / "node{node}"), *args, env=env, every_line=True)
    assert done.returncode != 0
    assert "No space left on device" in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
    left = [p for p in tmp_path.glob("node*/**/*") if p.is_file() and (".tmp-" in p.name or p.suffix == ".ds")]
    assert left == [], left
