"""What a command holds does not grow with a source's number of shards (issue 42, item 7's rule
beyond validate): a front-to-back read of a source's windows keeps open the shards of the block
it reads, not every shard it has read (a 50,000-shard source held 50,000 files open); an
opened source (PackedSource: shuffle, inspect, plan, validate --against) holds its manifest's
text, not a dict per shard entry."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from tests.conftest import random_docs, write_source
from tokpack.formats.builders import source_manifest
from tokpack.formats.constants import MANIFEST
from tokpack.formats.names import shard_digits, shard_name
from tokpack.formats.reading import read_manifest, write_manifest
from tokpack.formats.shards import PackedSource
from tokpack.shuffle.source_windows import iter_source_windows


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_reading_a_sources_windows_keeps_open_only_the_shards_of_its_block(tmp_path):
    """200 one-document shards read a window at a time: at most a few files open at once (the
    block's and the next one's, asked of the kernel ahead), where every shard read stayed open
    until the source's last window; the windows are the source's tokens, in order."""
    docs = random_docs(np.random.default_rng(3), 200, 1000, 0, min_len=40, max_len=60)
    src = PackedSource.open(write_source(tmp_path / "s", docs, docs_per_shard=1))
    row = 16
    windows = src.tokens // row
    plan = SimpleNamespace(sources=[SimpleNamespace(windows=windows, offset=0)], row_tokens=row)
    tokens = np.concatenate(docs).astype(src.dtype)
    for mapped in (False, True):
        base, most, got = _open_files(), 0, []
        for a, rows in iter_source_windows(plan, 0, src, block_bytes=row * src.dtype.itemsize, mapped=mapped):
            most = max(most, _open_files() - base)
            got.append((a, np.array(rows).reshape(-1)))
        assert [a for a, _ in got] == list(range(windows)), mapped
        assert np.array_equal(np.concatenate([r for _, r in got]), tokens[: windows * row]), mapped
        assert len(src.shards) == 200 and most <= 6, f"{most} files open at once reading 200 shards (mapped={mapped})"


MEASURE_OPEN = """
import sys, tracemalloc
from tokpack.formats.shards import PackedSource
tracemalloc.start()
opened = PackedSource.open(sys.argv[1], check_sizes=False)
print(*tracemalloc.get_traced_memory())
"""


def test_an_opened_source_holds_its_manifests_text_not_a_dict_per_entry(tmp_path):
    """A source of 20,000 shard entries (a 4.9 MB manifest): PackedSource.open held 13.3 MB
    (2.7 times the text: a dict per entry) and peaked at 21.9 MB (4.5 times); its entries are
    now read from the text as used: 5.4 MB held, 10.1 MB at the peak, the same entries."""
    src = write_source(tmp_path / "s", random_docs(np.random.default_rng(1), 20, 1000, 0))
    entry, n = read_manifest(src)["shards"][0], 20_000
    entries = [{**entry, "path": shard_name(i, shard_digits(n))} for i in range(n)]
    write_manifest(src, source_manifest(entries, np.dtype("<u2"), 1000, 0, "test-tokenizer"))
    size = (src / MANIFEST).stat().st_size
    # measured in a fresh interpreter: in this one, what earlier tests left (the interned
    # strings' table growing, 3.7 MB at once) would be counted as the source's
    child = subprocess.run([sys.executable, "-c", MEASURE_OPEN, str(src)], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    held, peak = map(int, child.stdout.split())
    opened = PackedSource.open(src, check_sizes=False)  # the entries name files never written
    assert held < 1.5 * size, f"an opened {size / 2**20:.1f} MB source held {held / 2**20:.1f} MB"
    assert peak < 3 * size, f"opening a {size / 2**20:.1f} MB source peaked at {peak / 2**20:.1f} MB"
    assert list(opened.shards) == entries and opened.shards[-1] == entries[-1] and len(opened.shards) == n
    assert opened.tokens == n * entry["tokens"] and opened.manifest["shards"] is opened.shards


def test_stage_queues_a_few_copies_ahead_not_a_future_per_file(tmp_path, monkeypatch):
    """stage of a 60-shard source (180 files) with 2 workers: at most 4 a worker queued or
    running at once, where every file had its future from the start (a 50,000-shard source
    held 230 MB of them); the copy is the source, byte for byte."""
    from tokpack.packer import staging
    from tokpack.packer.api import stage

    docs = random_docs(np.random.default_rng(5), 60, 1000, 0, min_len=20, max_len=40)
    src = write_source(tmp_path / "s", docs, docs_per_shard=1)
    live, most, lock = [0], [0], threading.Lock()

    def ended(_):
        with lock:
            live[0] -= 1

    class Counted(staging.ThreadPool):
        def submit(self, fn, *args, **kw):
            with lock:
                live[0] += 1
                most[0] = max(most[0], live[0])
            future = super().submit(fn, *args, **kw)
            future.add_done_callback(ended)
            return future

    monkeypatch.setattr(staging, "ThreadPool", Counted)
    stage(src, tmp_path / "dst", workers=2)
    files = sorted(p.name for p in src.iterdir())
    assert len(files) == 181 and files == sorted(p.name for p in (tmp_path / "dst").iterdir())
    assert all((src / f).read_bytes() == (tmp_path / "dst" / f).read_bytes() for f in files)
    assert most[0] <= 8, f"{most[0]} copies queued at once for 180 files"


def test_stage_holds_the_copy_jobs_of_its_queued_copies_not_one_per_file(tmp_path, monkeypatch):
    """stage of a 100-shard source (300 files) with 2 workers: at most the 8 queued copies' jobs
    and the rest of one shard's files are alive at once, where every file had its CopyJob from
    the plan to the end (150,000 files held 60 MB, with their entries); the copy is the source."""
    from tokpack.packer import stage_plan
    from tokpack.packer.api import stage

    docs = random_docs(np.random.default_rng(6), 100, 1000, 0, min_len=20, max_len=40)
    src = write_source(tmp_path / "s", docs, docs_per_shard=1)
    live, most, lock = [0], [0], threading.Lock()

    class Counted(stage_plan.CopyJob):
        def __init__(self, *args):
            super().__init__(*args)
            with lock:
                live[0] += 1
                most[0] = max(most[0], live[0])

        def __del__(self):
            with lock:
                live[0] -= 1

    monkeypatch.setattr(stage_plan, "CopyJob", Counted)
    r = stage(src, tmp_path / "dst", workers=2)
    files = sorted(p.name for p in src.iterdir())
    assert r.files == len(files) == 301 and files == sorted(p.name for p in (tmp_path / "dst").iterdir())
    assert all((src / f).read_bytes() == (tmp_path / "dst" / f).read_bytes() for f in files)
    assert most[0] <= 4 * 2 + 3, f"{most[0]} copy jobs alive at once for 300 files"


def test_inspect_of_a_source_reads_no_dict_per_shard_entry(small_source, monkeypatch):
    """inspect of a source reads its manifest as PackedSource does, its shard entries from the
    text as used: it read it whole first (every entry a dict, held to the end: 30 MB of 104 at
    the peak for a 50,000-shard source), then PackedSource read it again."""
    from tokpack.formats import reading
    from tokpack.packer.api import inspect

    src, docs = small_source
    whole = []
    parse = reading.strict_json

    def recorded(raw, path, what="manifest"):
        whole.append(str(path))
        return parse(raw, path, what)

    monkeypatch.setattr(reading, "strict_json", recorded)
    r = inspect(src)
    assert r.kind == "source" and r.totals["shards"] == 3 and r.totals["documents"] == len(docs)
    assert r.document_lengths["documents"] == len(docs)
    assert whole == [], whole


MEASURE_LENGTHS = """
import sys, tracemalloc
from tokpack.formats.shards import PackedSource
from tokpack.packer import doc_lengths
src = PackedSource.open(sys.argv[1], check_sizes=False)
size = doc_lengths.regular_size(src.path / (src.shards[0]["path"] + ".index"))
doc_lengths.regular_size = lambda path: size  # every entry's index is the first's: only it is written
tracemalloc.start()
per = []
whole = doc_lengths.document_lengths([src], max_documents=1, per_source=per).report()
print(tracemalloc.get_traced_memory()[1], whole["documents"], whole["sampled_from_documents"], per[0]["documents"])
"""


def test_inspects_document_lengths_hold_a_count_a_shard_not_its_path_and_blocks(tmp_path):
    """inspect's document lengths of a 50,000-shard source: a list of index paths, of sizes and
    of blocks peaked at 22.2 MB (440 bytes a shard, beside its 1 MB of histograms); a document
    count a shard (8 bytes) is held now, each entry read again as its blocks are read: 4.1 MB
    (pathlib's interned names among it: their table grows once).
    Sampled down to one block (max_documents=1) and each index's size given, so that only the
    first shard is written and read: what is measured is what is held a shard."""
    src = write_source(tmp_path / "s", random_docs(np.random.default_rng(2), 3, 1000, 0))
    entry, n = read_manifest(src)["shards"][0], 50_000
    entries = [{**entry, "path": shard_name(i, shard_digits(n))} for i in range(n)]
    (src / f"{entry['path']}.index").rename(src / f"{entries[0]['path']}.index")
    write_manifest(src, source_manifest(entries, np.dtype("<u2"), 1000, 0, "test-tokenizer"))
    child = subprocess.run([sys.executable, "-c", MEASURE_LENGTHS, str(src)], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    peak, documents, of, first = map(int, child.stdout.split())
    assert (documents, of, first) == (3, 3 * n, 3)  # the first shard's block, for the corpus and its source
    assert peak < 8 << 20, f"document lengths of {n:,} shards peaked at {peak / 2**20:.1f} MB"


def _limited(soft: int, hard: int | None = None):
    """preexec_fn: the child's open-files limits (hard None: left as it is)."""

    def limit():
        import resource

        h = resource.getrlimit(resource.RLIMIT_NOFILE)[1] if hard is None else hard
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, h))

    return limit


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory):
    """A source of 300 one-document shards, and its in-memory shuffles (concat, best-fit) run
    with no limit of ours: the bytes each limited run must give."""
    root = tmp_path_factory.mktemp("fds")
    docs = random_docs(np.random.default_rng(7), 300, 1000, 0, min_len=20, max_len=40)
    src = write_source(root / "src", docs, docs_per_shard=1)
    want = {}
    for packing in ("concat", "best-fit"):
        out = root / f"free-{packing}"
        assert subprocess.run(_shuffle_cmd(src, out, packing), capture_output=True).returncode == 0
        want[packing] = (out / "epoch-00000" / "00000.ds").read_bytes()
    return root, src, want


def _shuffle_cmd(src, out, packing: str, *more: str) -> list[str]:
    args = ["shuffle", str(src), "-o", str(out), "--seq-len", "16", "--seed", "1", "--epochs", "1"]
    return [sys.executable, "-m", "tokpack", *args, "--packing", packing, *more]


def test_a_source_of_more_shards_than_the_soft_open_files_limit_shuffles_in_memory(many_shards):
    """The in-memory steps map every shard at once, and Python before 3.13 holds a file a
    mapping: a source of 1,500 shards failed with EMFILE at the usual soft limit of 1,024. The
    gate, meeting EMFILE, raises the soft limit to the hard one and opens again (gate.more_files)."""
    root, src, want = many_shards
    for packing in ("concat", "best-fit"):
        out = root / f"soft-{packing}"
        r = subprocess.run(_shuffle_cmd(src, out, packing), capture_output=True, text=True, preexec_fn=_limited(128))
        assert r.returncode == 0, r.stderr
        assert (out / "epoch-00000" / "00000.ds").read_bytes() == want[packing]


def test_past_the_hard_limit_it_is_one_line_naming_the_limit_and_out_of_core_needs_few_files(many_shards):
    """Past the hard limit too (200 files, for 300 shards), the in-memory step of windows is one
    line whose hint names the limit and --memory; best-fit's (its TokenPool maps at most half the
    hard limit of shards, then maps them as its pieces need them) gives the bytes of an unlimited
    run; out of core (a smaller --memory) holds open only the shards of the block it reads (here
    tiny ones, about 150 a block): the same bytes."""
    root, src, want = many_shards
    for packing in ("concat", "best-fit"):
        out = root / f"hard-{packing}"
        r = subprocess.run(
            _shuffle_cmd(src, out, packing), capture_output=True, text=True, preexec_fn=_limited(200, 200)
        )
        if packing == "best-fit":
            assert r.returncode == 0, r.stderr
            assert (out / "epoch-00000" / "00000.ds").read_bytes() == want[packing]
            # every shard is still checked whole, those past the mapped ones too: a flipped
            # byte in the last shard is refused
            bad = root / "hard-bad-src"
            shutil.copytree(src, bad)
            last = sorted(bad.glob("*.ds"))[-1]
            data = bytearray(last.read_bytes())
            data[0] ^= 1
            last.write_bytes(bytes(data))
            r = subprocess.run(
                _shuffle_cmd(bad, root / "hard-bad", packing),
                capture_output=True,
                text=True,
                preexec_fn=_limited(200, 200),
            )
            assert r.returncode == 1 and last.name in r.stderr and "Traceback" not in r.stderr, r.stderr
        else:
            errors = [x for x in r.stderr.splitlines() if x.startswith("tokpack: error:")]
            assert r.returncode == 1 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
            assert "Too many open files" in errors[0] and "HINT: raise the open-files limit (`ulimit -Hn`" in errors[0]
            assert not (out / "tokpack.json").exists() and not (out / "epoch-00000" / "tokpack.json").exists()
        out = root / f"ooc-{packing}"
        more = ("--memory", "64KiB")
        r = subprocess.run(
            _shuffle_cmd(src, out, packing, *more), capture_output=True, text=True, preexec_fn=_limited(200, 200)
        )
        assert r.returncode == 0, r.stderr
        assert (out / "epoch-00000" / "00000.ds").read_bytes() == want[packing]


def test_validate_against_replays_a_source_of_more_shards_than_the_hard_open_files_limit(many_shards):
    """`validate --against` of 300 tiny shards at a hard limit of 100 files: best-fit's replay
    mapped every shard (TokenPool) and the windows' sweep kept every shard a block touched open
    (read_into's handles), so both met EMFILE and called a sound epoch CORRUPT ("the manifest
    was edited"). Both now hold a bounded number: OK, as without a limit (the replayed hashes
    equal the recorded ones: a piece taken from a wrong mapping would not)."""
    root, src, _ = many_shards
    for packing in ("concat", "best-fit"):
        epoch = root / f"free-{packing}" / "epoch-00000"
        cmd = [sys.executable, "-m", "tokpack", "validate", str(epoch), "--against", str(src)]
        r = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=_limited(100, 100), timeout=120)
        assert r.returncode == 0 and "CORRUPT" not in r.stdout + r.stderr, (packing, r.stdout, r.stderr)
        assert r.stdout.splitlines()[-1].startswith("OK:"), r.stdout


def test_validate_past_every_bound_is_one_line_naming_the_limit_not_corrupt(many_shards):
    """At a hard limit of 40 files, below what even the bounded reads hold (64 handles): EMFILE
    is this machine's, not the data's: one line whose hint names the limit, exit 1, never a
    CORRUPT verdict (a problem blamed on a sound source, or on its epoch's manifest)."""
    root, src, _ = many_shards
    epoch = root / "free-concat" / "epoch-00000"
    cmd = [sys.executable, "-m", "tokpack", "validate", str(epoch), "--against", str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=_limited(40, 40), timeout=120)
    errors = [x for x in r.stderr.splitlines() if x.startswith("tokpack: error:")]
    assert r.returncode == 1 and len(errors) == 1 and "Traceback" not in r.stderr, (r.stdout, r.stderr)
    assert "Too many open files" in errors[0] and "HINT: raise the open-files limit" in errors[0]
    assert "CORRUPT" not in r.stdout + r.stderr, r.stdout


def _to_nodes(many_shards, name: str, limit=None, packing: str = "concat") -> list:
    """`shuffle --to-nodes` of the 300 shards, 2 processes (`limit`: their preexec_fn) to
    RUN root/run-`name`: its node slices' files (path below root/nodes-`name`, bytes)."""
    from test_mpi import mpi_env, mpirun

    root, src, _ = many_shards
    dest = root / f"nodes-{name}" / "n{node}"
    args = ["--ranks-per-node", "1", "--micro-batch", "1", "--to-nodes", str(dest)]
    cmd = [mpirun(), "--oversubscribe", "-n", "2", *_shuffle_cmd(src, root / f"run-{name}", packing, *args)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), preexec_fn=limit, timeout=120)
    assert r.returncode == 0, r.stderr
    files = sorted((root / f"nodes-{name}").rglob("*.ds"))
    return [(f.relative_to(root / f"nodes-{name}"), f.read_bytes()) for f in files]


@pytest.fixture(scope="module")
def free_to_nodes(many_shards):
    """The unlimited --to-nodes run (RUN root/run-free) and its node slices' files."""
    return many_shards[0] / "run-free", _to_nodes(many_shards, "free")


def _replacement(run, dest, limit=None) -> tuple:
    """A replacement node (stage --node 0/2 on RUN `run`) into `dest`: (its process, its files' (name, bytes))."""
    args = ["--node", "0/2", "--ranks-per-node", "1", "--micro-batch", "1"]
    cmd = [sys.executable, "-m", "tokpack", "stage", str(run), str(dest), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=limit, timeout=120)
    return r, [(f.name, f.read_bytes()) for f in sorted(dest.rglob("*.ds"))]


def test_to_nodes_raises_its_soft_open_files_limit_too(many_shards, free_to_nodes):
    """`shuffle --to-nodes` (not a locked_output command: its lock is the exchange's) in memory
    maps its sources' shards as well: 2 processes at a soft limit of 128 for 300 shards give
    the node slices an unlimited run gives, and a replacement node at 100 rebuilds node 0's; at a
    hard limit of 128, a node's line names the limit."""
    from test_mpi import mpi_env, mpirun

    root, src, _ = many_shards
    run, free = free_to_nodes
    slices = [free, _to_nodes(many_shards, "soft", _limited(128))]
    assert len(slices[0]) == 2 and slices[0] == slices[1]
    # the replacement node (stage --node on that RUN) reads every shard too: node 0's slice again
    r, rebuilt = _replacement(run, root / "rebuilt", _limited(100))
    assert r.returncode == 0, r.stderr
    assert rebuilt == [(name.name, data) for name, data in slices[0] if name.parts[0] == "n0"]
    args = ["--ranks-per-node", "1", "--micro-batch", "1", "--to-nodes", str(root / "nodes-hard" / "n{node}")]
    cmd = [mpirun(), "--oversubscribe", "-n", "2", *_shuffle_cmd(src, root / "run-hard", "concat", *args)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), preexec_fn=_limited(128, 128), timeout=120)
    errors = [x for x in r.stderr.splitlines() if x.startswith("tokpack: error:")]
    assert r.returncode != 0 and errors and "Traceback" not in r.stderr, r.stderr
    assert all("Too many open files" in x and "HINT: raise the open-files limit" in x for x in errors), errors


def test_a_replacement_node_reads_a_source_of_more_shards_than_the_hard_open_files_limit(many_shards, free_to_nodes):
    """A replacement node's reader (packer.source_reads) kept a descriptor for every source shard
    it read, and 300 shards failed at a hard limit of 100 files (EMFILE): sources of 20,000-100,000
    shards meet clusters' hard limits of 4,096-65,536. It holds at most half the hard limit (and 64) of them now,
    and rebuilds node 0's slice at that limit, the bytes of a rebuild without one (and of the
    slice the run wrote)."""
    root = many_shards[0]
    run, slices = free_to_nodes
    free, want = _replacement(run, root / "rebuilt-free")
    assert free.returncode == 0, free.stderr
    assert want and want == [(name.name, data) for name, data in slices if name.parts[0] == "n0"]
    r, got = _replacement(run, root / "rebuilt-hard", _limited(100, 100))
    assert r.returncode == 0 and "Too many open files" not in r.stderr, r.stderr
    assert got == want


def test_a_best_fit_replacement_node_maps_a_bounded_number_of_shards_past_the_hard_limit(many_shards):
    """A best-fit replacement node's TokenPool mapped every source shard (a file each, before
    Python 3.13) and its reader kept every file it asked the kernel for: 300 shards failed at a
    hard limit of 100. The two now share half the limit (a quarter each, at least 16), and node
    0's slice rebuilt at that limit is the one the run wrote."""
    root = many_shards[0]
    slices = _to_nodes(many_shards, "free-bf", packing="best-fit")
    want = [(name.name, data) for name, data in slices if name.parts[0] == "n0"]
    assert want
    r, got = _replacement(root / "run-free-bf", root / "rebuilt-bf-hard", _limited(100, 100))
    assert r.returncode == 0 and "Too many open files" not in r.stderr, r.stderr
    assert got == want


def test_a_replacement_nodes_reader_closes_idle_shards_past_its_bound_and_reads_the_same_rows(many_shards, monkeypatch):
    """SourceReader at a bound of 2 and of 40 open shard files, for 300 shards read by 32 threads:
    the least recently used idle file is closed (never one a thread reads, nor one twice), a
    read_into's own file counts (at most the bound open, or one a thread at a bound of 2), the rows are
    the stream's own (read_into) and an unbounded reader's; close leaves none open."""
    import time

    from tokpack.formats import shards
    from tokpack.packer import source_reads
    from tokpack.packer.source_reads import READ_DEPTH, SourceReader

    def slow(fd, views, offset, read=source_reads.preadv_all):  # a read as long as a disk's: threads overlap
        time.sleep(0.002)
        return read(fd, views, offset)

    peak, counting = [0], threading.Lock()

    def opened(path, size, gate=source_reads.regular_fd):  # the files open with each new one
        fd = gate(path, size=size)
        with counting:  # one listdir at a time: its own descriptor is one
            peak[0] = max(peak[0], _open_files() - 1)
        return fd

    monkeypatch.setattr(source_reads, "preadv_all", slow)
    monkeypatch.setattr(source_reads, "regular_fd", opened)
    src = PackedSource.open(many_shards[1])
    row = 4
    ust = np.arange(0, src.tokens - row, 3 * row, dtype=np.int64)  # every third window: a read a shard or two
    us = np.zeros(len(ust), dtype=np.int64)
    want = np.stack([src.read_into(int(a), np.empty(row, dtype=src.dtype)) for a in ust])

    def open_read(path, *args, gate=shards.open_read, **rules):  # a row across two shards: its file open a while
        f = gate(path, *args, **rules)
        time.sleep(0.002)
        return f

    monkeypatch.setattr(shards, "open_read", open_read)
    before = _open_files()
    got = []
    for bound in (2, 40, None):
        reader = SourceReader()
        reader.max_open = bound or reader.max_open
        peak[0] = 0
        try:
            for _ in range(2):  # the second fill reopens what the first closed
                buf = np.empty((len(ust), row), dtype=src.dtype)
                reader.fill([src], us, ust, row, buf)
                got.append(buf)
                assert len(reader.fds) <= (bound or len(src.shards))
            assert reader.max_in_flight > 1
            held = len(reader.fds)
        finally:
            reader.close()
        assert _open_files() == before
        # files kept from read to read. At a bound of 2 none need be: two threads in read_into at
        # once (a row across two shards; their files count) close every idle one, and nothing
        # opens one again after the last such read. Past READ_DEPTH, bound - 32 or more stay.
        assert held <= bound if bound else held == len(src.shards), held
        assert bound is not None and bound <= READ_DEPTH or held > 0, (bound, held)
        assert bound is None or peak[0] - before <= max(bound, READ_DEPTH), (bound, peak[0] - before)
    assert all(np.array_equal(g, want) for g in got)


def test_the_gate_raises_the_soft_limit_at_emfile_and_tries_once_more(monkeypatch):
    """gate.more_files: an EMFILE raises the soft limit (to the hard one; 2^20 for an unlimited
    hard one) and calls again, once, as it does when another thread raised it since; any other
    error, or EMFILE when the limit was never raised and cannot be, stands as it came."""
    import errno
    import resource

    from tokpack.formats.io import gate

    monkeypatch.setattr(gate, "_RAISED", False)
    limits, set_to = [(1024, 4096)], []
    monkeypatch.setattr(resource, "getrlimit", lambda _: limits[0])
    monkeypatch.setattr(resource, "setrlimit", lambda _, v: set_to.append(v))

    def failing(*codes):
        left = list(codes)

        def call(x):
            if left:
                raise OSError(left.pop(0), "failed")
            return x

        return call

    assert gate.more_files(failing(errno.EMFILE), 7) == 7 and set_to == [(4096, 4096)]
    with pytest.raises(OSError) as twice:
        gate.more_files(failing(errno.EMFILE, errno.EMFILE), 7)
    assert twice.value.errno == errno.EMFILE and len(set_to) == 2
    with pytest.raises(OSError) as other:
        gate.more_files(failing(errno.ENOENT), 7)
    assert other.value.errno == errno.ENOENT and len(set_to) == 2
    limits[0] = (1024, resource.RLIM_INFINITY)
    assert gate.raise_open_files_limit() and set_to[-1] == (1 << 20, resource.RLIM_INFINITY)
    from tokpack.packer.source_reads import MIN_OPEN, max_open  # a reader keeps half the hard limit open

    assert max_open() == 1 << 19
    limits[0] = (1024, 100)
    assert max_open() == MIN_OPEN == 64
    limits[0] = (1024, resource.RLIM_INFINITY)
    limits[0] = (4096, 4096)  # raised by another thread after this call failed: made again
    assert gate.more_files(failing(errno.EMFILE), 7) == 7 and len(set_to) == 3
    monkeypatch.setattr(gate, "_RAISED", False)  # at the hard limit, never raised: EMFILE stands
    with pytest.raises(OSError):
        gate.more_files(failing(errno.EMFILE), 7)
    assert len(set_to) == 3 and not gate.raise_open_files_limit()


def test_a_rerun_holds_one_written_epochs_manifest_at_a_time(tmp_path, monkeypatch):
    """A rerun over written epochs reads and checks each one's manifest (a dict per shard entry):
    before the run, and for the run manifest it writes after every epoch. It held every epoch's
    at once (4 epochs of 2,000 shards, each 1.35 MiB read: 6.8 MiB at the peak, 3.0 MiB for one
    epoch); now one at a time (3.0 MiB for 4 epochs as for one). The run manifest is the same bytes."""
    import weakref

    from tests.conftest import shuffle_run
    from tokpack.formats.constants import EPOCH
    from tokpack.shuffle import run_setup

    src = write_source(tmp_path / "s", random_docs(np.random.default_rng(2), 40, 1000, 0))
    out = tmp_path / "run"
    kw = dict(seq_len=7, seed=3, samples=30, shard_samples=10, memory=8 << 20)
    shuffle_run([str(src)], str(out), epochs=[0, 1, 2, 3], **kw)
    before = (out / MANIFEST).read_bytes()

    class Held(dict):  # a dict a weak reference can follow: when the last user lets it go
        pass

    live, most, reads, read = [0], [0], [0], run_setup.read_manifest

    def counted(directory, kind=None, checked=True):
        if kind != EPOCH:
            return read(directory, kind, checked)
        held = Held(read(directory, kind, checked))
        live[0] += 1
        reads[0] += 1
        most[0] = max(most[0], live[0])
        weakref.finalize(held, lambda: live.__setitem__(0, live[0] - 1))
        return held

    monkeypatch.setattr(run_setup, "read_manifest", counted)
    r = shuffle_run([str(src)], str(out), epochs=[0, 1, 2, 3], **kw)
    assert r["skipped"] == [0, 1, 2, 3] and (out / MANIFEST).read_bytes() == before
    assert reads[0] >= 8 and most[0] == 1, f"{most[0]} epoch manifests held at once over {reads[0]} reads"
    # each read twice: checked before the run, and once for the run manifest, however many times
    # that is rewritten (after every epoch: 4 + 1 + 2 + 3 + 4 reads, E(E+1)/2 for E epochs)
    assert reads[0] == 8, f"{reads[0]} reads of 4 epoch manifests"
    r = shuffle_run([str(src)], str(out), epochs=[0, 1, 2, 3, 4], **kw)  # and one written after them
    assert r["written"] == [4] and r["epochs"] == [0, 1, 2, 3, 4]
    assert reads[0] >= 8 + 9 and most[0] == 1, f"{most[0]} epoch manifests held at once over {reads[0]} reads"
    assert reads[0] == 8 + 9, f"{reads[0] - 8} reads of 5 epoch manifests, one of them new"


def test_the_run_manifest_follows_an_epoch_manifest_that_changed_since_it_was_read(tmp_path):
    """An epoch manifest's totals are read once for the run manifest, and again when its file is
    another than the one read (another inode, size or time): never a stale total."""
    from tests.conftest import shuffle_run
    from tokpack.formats.constants import EPOCH
    from tokpack.shuffle.run_setup import setup_run
    from tokpack.shuffle.spec import ShuffleSpec

    src = write_source(tmp_path / "s", random_docs(np.random.default_rng(2), 40, 1000, 0))
    out = tmp_path / "run"
    kw = dict(seq_len=7, seed=3, samples=30, shard_samples=10)
    shuffle_run([str(src)], str(out), epochs=[0, 1], memory=8 << 20, **kw)
    setup = setup_run(ShuffleSpec(sources=(str(src),), output=str(out), epochs=(0, 1), **kw), str(out))
    plan = setup.todo[0][1]
    assert setup.written_run_manifest(out, plan, [0, 1])["tokens"] == 2 * 30 * 8
    other = tmp_path / "other"  # epoch 1 of 40 samples in its place: another manifest at that path
    shuffle_run([str(src)], str(other), epochs=[1], memory=8 << 20, **{**kw, "samples": 40})
    shutil.rmtree(out / "epoch-00001")
    shutil.copytree(other / "epoch-00001", out / "epoch-00001")
    assert read_manifest(out / "epoch-00001", kind=EPOCH)["tokens"] == 40 * 8
    assert setup.written_run_manifest(out, plan, [0, 1])["tokens"] == (30 + 40) * 8


@pytest.mark.parametrize("nodes", [None, 2])
def test_plan_shuffle_keeps_no_planned_manifest_per_epoch(tmp_path, monkeypatch, nodes):
    """`plan shuffle` (and its --nodes) kept every epoch's planned manifest, a dict per shard, to
    size the manifests at the end: epochs x shards. It keeps each one's size and totals; the
    figures are the same (the manifests' sizes against what a shuffle writes)."""
    import weakref

    import tokpack
    from tokpack.packer import plan_nodes, planning
    from tokpack.shuffle import run

    src = write_source(tmp_path / "s", random_docs(np.random.default_rng(2), 40, 1000, 0))
    kw = dict(seq_len=7, seed=3, samples=30, shard_samples=10, memory=8 << 20, epochs=[0, 1, 2, 3])

    class Held(dict):  # a dict a weak reference can follow: when the last user lets it go
        pass

    live, most = [0], [0]

    def counted(*args):
        held = Held(made(*args))
        live[0] += 1
        weakref.finalize(held, lambda: live.__setitem__(0, live[0] - 1))
        return held

    def at_figures(figures):
        def wrapped(*args):
            most[0] = max(most[0], live[0])
            return figures(*args)

        return wrapped

    made = run.planned_epoch_manifest  # imported by the plans as they run
    monkeypatch.setattr(run, "planned_epoch_manifest", counted)
    monkeypatch.setattr(planning, "shuffle_figures", at_figures(plan_nodes.shuffle_figures))
    monkeypatch.setattr(plan_nodes, "shuffle_figures", at_figures(plan_nodes.shuffle_figures))
    extra = (
        {} if nodes is None else dict(nodes=nodes, to_nodes=str(tmp_path / "n{node}"), ranks_per_node=1, micro_batch=1)
    )
    result = tokpack.plan("shuffle", [str(src)], str(tmp_path / "run"), disk_mbps=100, **extra, **kw)
    assert live[0] <= 1 and most[0] <= 1, f"{most[0]} planned epoch manifests held at the end of the plan"
    if nodes is None:  # what the plan says of the manifests is what the shuffle writes
        tokpack.shuffle([str(src)], str(tmp_path / "run"), **kw)
        assert result.manifests == {name: (tmp_path / "run" / name).stat().st_size for name in result.manifests}
        assert len(result.manifests) == 5
