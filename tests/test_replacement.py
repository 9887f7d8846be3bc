"""A node's rows rebuilt from the sources alone (tokpack.packer.replacement), on RUNs of
`shuffle --to-nodes` under `mpirun --oversubscribe -n 4` (issue 33, items 3, 4 and 6): a
replacement node within --memory, part by part, byte for byte the exchange's slice;
`validate SLICE --against RUN` proving the slice's rows and order from the sources; later epochs
from kept sources opening nothing in the shared source folder."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import random_docs, write_source
from test_mpi import K, M, MEMORY, NODES, SEQ, cli, to_nodes, tree
from tokpack.formats.constants import MANIFEST
from tokpack.formats.names import epoch_dir_name
from tokpack.packer.cli import main

ROW_BYTES = (SEQ + 1) * 2  # uint16 tokens
# A replacement node's budget: about 46 rows a part (replacement.part_rows_of), a few hundred a node and epoch.
SMALL = 80 << 10


def exchanged(root, *args, epochs: int = 2):
    """A source and the RUN --to-nodes wrote from it (node slices at root/node{n})."""
    source = write_source(root / "src", random_docs(np.random.default_rng(3), 200, 1000, 0), docs_per_shard=40)
    run = root / "exchanged"
    done = to_nodes(
        run,
        str(root / "node{node}"),
        source,
        "--seq-len",
        SEQ,
        "--seed",
        5,
        "--epochs",
        epochs,
        "--shard-samples",
        12,
        "--memory",
        MEMORY,
        *args,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return source, run


@pytest.fixture(scope="module")
def windows(tmp_path_factory):
    root = tmp_path_factory.mktemp("windows")
    return (root, *exchanged(root))


@pytest.fixture(scope="module")
def best_fit(tmp_path_factory):
    root = tmp_path_factory.mktemp("best_fit")
    return (root, *exchanged(root, "--packing", "best-fit", epochs=1))


def node_rows(dest) -> list[int]:
    return [
        sum(s["samples"] for s in json.loads(p.read_text())["shards"]) for p in sorted(dest.glob(f"epoch-*/{MANIFEST}"))
    ]


def replace_node(run, dest, node: int, memory: int = SMALL) -> dict:
    return json.loads(
        cli(
            "stage",
            run,
            dest,
            "--node",
            f"{node}/{NODES}",
            "--ranks-per-node",
            K,
            "--micro-batch",
            M,
            "--memory",
            memory,
            "--json",
        )
    )


def test_a_best_fit_replacement_node_reads_its_rows_pages_not_every_source_shard_whole(tmp_path):
    """A best-fit replacement node mapped each source shard and read it in whole (as the in-memory
    engine does): a node of N read the whole source, N times its share. It reads the pages its
    rows' documents lie in (asked of the kernel ahead): node 1 of 4 read 68% of the source's
    pages here (its quarter of the documents, spread over them), and all of them before."""
    from probes import page_cache

    docs = random_docs(np.random.default_rng(3), 2000, 1000, 0, min_len=200, max_len=1800)
    source = write_source(tmp_path / "src", docs, docs_per_shard=500)
    run = tmp_path / "run"
    args = ("--seq-len", 1023, "--seed", 5, "--epochs", 1, "--packing", "best-fit", "--memory", "64MiB")
    done = to_nodes(run, str(tmp_path / "node{node}"), source, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    shards = sorted(source.glob("*.ds"))
    assert page_cache(shards, evict=True)[0] == 0  # nothing of the source in memory: what is next is read
    got = replace_node(run, tmp_path / "again", 1, memory=64 << 20)
    assert got["ok"] and tree(tmp_path / "again") == tree(tmp_path / "node1")
    resident, pages = page_cache(shards)
    assert resident < 0.8 * pages, f"a replacement node of 1/4 read {resident} of the source's {pages} pages"


@pytest.mark.parametrize("kind", ["windows", "best_fit"])
def test_a_replacement_node_within_memory_rebuilds_the_exchanges_slice_part_by_part(kind, request, tmp_path):
    """stage --node on a --to-nodes RUN with a --memory far below the node's rows: several parts
    an epoch, none larger than --memory allows, the exchange's bytes, read amplification <= 1.3."""
    root, _, run = request.getfixturevalue(kind)
    summary = replace_node(run, tmp_path / "again", 2)
    assert tree(tmp_path / "again") == tree(root / "node2")
    rows = node_rows(root / "node2")
    assert summary["part_rows"] * 2 * ROW_BYTES <= SMALL  # a part's rows, twice (read order, position order)
    assert all(summary["part_rows"] < n for n in rows), (summary, rows)  # the node's rows are never held at once
    assert summary["parts"] >= sum(-(-n // summary["part_rows"]) for n in rows)
    assert summary["read_amplification"] <= 1.3, summary
    assert summary["reads"] > 0 and summary["read_depth"] > 1, summary  # in flight together
    if kind == "windows":
        assert summary["read_amplification"] > 1  # every row read once, and RUN's row hashes
        assert summary["reads"] < sum(rows), summary  # adjacent windows: a read (best-fit: a request a run of pieces)
    assert not (tmp_path / "again" / ".tokpack-work").exists()


@pytest.mark.parametrize("kind", ["windows", "best_fit"])
def test_a_replacement_node_of_several_processes_rebuilds_the_same_slice(kind, request, tmp_path):
    """`stage --workers 2` on a --to-nodes RUN: two processes each rebuild the rank files of half
    the node's ranks, within --memory / 2 each; the slice is the exchange's, byte for byte, and
    the figures add up to the one-process rebuild's."""
    root, _, run = request.getfixturevalue(kind)
    one = replace_node(run, tmp_path / "one", 1)
    base = ["stage", run, tmp_path / "two", "--node", f"1/{NODES}", "--ranks-per-node", K, "--micro-batch", M]
    two = json.loads(cli(*base, "--memory", 2 * SMALL, "--workers", 2, "--json"))
    assert tree(tmp_path / "two") == tree(root / "node1") == tree(tmp_path / "one")
    assert two["part_rows"] == one["part_rows"]  # each process plans with half of --memory
    assert two["bytes_kept"] == one["bytes_kept"] and two["parts"] >= one["parts"], (one, two)
    assert not (tmp_path / "two" / ".tokpack-work").exists()


def test_ctrl_c_of_a_replacement_node_of_several_processes_is_one_line_and_a_rerun_gives_its_bytes(windows, tmp_path):
    """Ctrl-C reaches the terminal's whole process group: the command's process says one line
    and stops its rebuilding processes (they run in sessions of their own, so none prints a
    traceback of its own, and none outlives it); the rerun gives the exchange's slice."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from test_mpi import REPO

    root, _, run = windows
    dest = tmp_path / "again"
    cmd = [sys.executable, "-m", "tokpack", "stage", str(run), str(dest), "--node", f"1/{NODES}"]
    cmd += ["--ranks-per-node", str(K), "--micro-batch", str(M), "--workers", "2"]
    import uuid

    from probes import MARK, cmdline, marked

    token = uuid.uuid4().hex  # this command's processes only: another test's may run meanwhile
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKPACK_PROGRESS": "0", MARK: token}

    def rebuilding() -> list[int]:
        return [pid for pid in marked(token) if b"tokpack.packer.replacement" in cmdline(pid)]

    job = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    deadline = time.monotonic() + 60
    while not rebuilding() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert job.poll() is None, "the command ended before its rebuilding processes started"
    os.killpg(job.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the foreground process group
    _, err = job.communicate(timeout=60)
    assert job.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines() == [
        "tokpack: interrupted; rerun the same command to resume"
    ], err
    time.sleep(0.5)
    assert rebuilding() == []  # stopped with the command, not left running
    replace_node(run, dest, 1)
    assert tree(dest) == tree(root / "node1")


def _rows_read(run, tmp_path, monkeypatch, positions_of, pause: float = 0.0):
    """SourceRows.rows of epoch 0 at `positions_of(samples)`, every row checked against RUN's row
    hashes; returns (the reads issued: preadv calls and the streams' own read_into calls, the
    most in flight at once, the reader's counts)."""
    import threading
    import time

    from tokpack.formats.reading import read_manifest
    from tokpack.formats.shards import PackedSource
    from tokpack.packer import source_reads
    from tokpack.packer.replacement import SourceRows

    calls, flying, lock = [], [0, 0], threading.Lock()

    def counted(fn):
        def run(*args, **kw):
            with lock:
                calls.append(1)
                flying[0] += 1
                flying[1] = max(flying[1], flying[0])
            try:
                time.sleep(pause)
                return fn(*args, **kw)
            finally:
                with lock:
                    flying[0] -= 1

        return run

    monkeypatch.setattr(source_reads, "preadv_all", counted(source_reads.preadv_all))
    monkeypatch.setattr(PackedSource, "read_into", counted(PackedSource.read_into))
    d = run / epoch_dir_name(0)
    m = read_manifest(d, kind="epoch")
    source = SourceRows(d, m, 16 << 20, tmp_path / "work")
    try:
        positions = positions_of(int(m["samples"]))
        assert source.part_rows >= len(positions)
        source.check(positions, *source.rows(positions))  # each row's hash is RUN's
        reader = (source.reader.reads, source.reader.bytes)
    finally:
        source.close()
    return len(calls), flying[1], reader, len(positions), source.sources[0]


def test_a_replacement_node_merges_adjacent_windows_into_one_ranged_read(windows, tmp_path, monkeypatch):
    """Every position of an epoch in one part (a node holding them all, one source read once): the
    part's windows are adjacent in source order, so they are one ranged read a source shard (and
    one a window across two shards), not one a window. On main the reads were one request at a
    time (a read per run of adjacent windows, by read_into)."""
    _, _, run = windows
    reads, _, (counted, nbytes), rows, src = _rows_read(run, tmp_path, monkeypatch, lambda n: np.arange(n))
    assert reads == counted <= 2 * len(src.shards) and reads < rows / 4, (reads, rows)
    assert nbytes == rows * ROW_BYTES  # no byte twice, no gap


def test_a_replacement_node_merges_small_gaps_and_keeps_reads_in_flight(windows, tmp_path, monkeypatch):
    """Runs of 31 adjacent windows a window apart: each gap is read and dropped (1/62 of the bytes
    beside it), one read a shard; every other position (random windows): many reads (a one-window gap is not
    merged but beside 16 adjacent ones), several in flight at once (on main: one at a time)."""
    _, _, run = windows
    holes = lambda n: np.flatnonzero(np.arange(n) % 32 != 31)  # noqa: E731
    reads, _, (counted, nbytes), rows, src = _rows_read(run, tmp_path, monkeypatch, holes)
    assert reads == counted <= 2 * len(src.shards), (reads, rows)
    assert rows * ROW_BYTES < nbytes <= rows * ROW_BYTES * 1.04  # the holes inside a read
    every_other = lambda n: np.arange(0, n, 2)  # noqa: E731
    reads, in_flight, (counted, nbytes), rows, _ = _rows_read(run, tmp_path, monkeypatch, every_other, 0.01)
    assert reads == counted > rows / 4 and rows * ROW_BYTES <= nbytes <= rows * ROW_BYTES * 1.13
    assert in_flight > 1, in_flight


def test_a_stream_not_read_as_local_shard_files_gives_the_same_rows(windows, tmp_path, monkeypatch):
    """A URL source or --holdout's stream of kept documents is read by its own read_into, a call
    a run of adjacent windows, in the same threads (no gap merged): every row still RUN's."""
    from tokpack.packer import source_reads

    _, _, run = windows
    monkeypatch.setattr(source_reads, "local_shards", lambda stream: False)
    holes = lambda n: np.flatnonzero(np.arange(n) % 32 != 31)  # noqa: E731
    reads, in_flight, (counted, nbytes), rows, _ = _rows_read(run, tmp_path, monkeypatch, holes, 0.01)
    assert reads == counted and nbytes == rows * ROW_BYTES and in_flight > 1, (reads, in_flight)


def test_a_replacement_node_with_too_little_memory_is_one_line(windows, tmp_path):
    _, _, run = windows
    res = CliRunner().invoke(
        main,
        [
            "stage",
            str(run),
            str(tmp_path / "x"),
            "--node",
            f"1/{NODES}",
            "--ranks-per-node",
            str(K),
            "--micro-batch",
            str(M),
            "--memory",
            "1KiB",
        ],
    )
    assert res.exit_code == 1 and "--memory is too small" in res.output, res.output
    res = CliRunner().invoke(main, ["stage", str(run), str(tmp_path / "y"), "--memory", "1MiB"])
    assert res.exit_code == 1 and "--memory applies only to a replacement node" in res.output, res.output


def test_a_replacement_node_refuses_another_runs_epoch_and_an_unlisted_one(windows, tmp_path):
    """RUN's epoch 1 replaced by another --to-nodes run's (another seed): the replacement node
    rebuilt that run's epoch 1 from the sources into a slice whose manifest names this run
    (validate --against RUN: OK). An epoch RUN does not list was `FileNotFoundError ... check
    the path`. Each is now one line before anything is written."""
    _, _, run = windows
    _, other = exchanged(tmp_path / "other", "--seed", 6)
    mixed = tmp_path / "mixed"
    shutil.copytree(run, mixed)
    shutil.rmtree(mixed / epoch_dir_name(1))
    shutil.copytree(other / epoch_dir_name(1), mixed / epoch_dir_name(1))
    node = ["--node", f"1/{NODES}", "--ranks-per-node", str(K), "--micro-batch", str(M)]
    for source, more, words in [
        (mixed, [], ("epoch manifest belongs to another run", f"{epoch_dir_name(1)}/{MANIFEST} [seed]")),
        (run, ["--epochs", "7"], ("epochs not in this run", "tokpack shuffle --like")),
    ]:
        dest = tmp_path / f"d{len(more)}"
        res = CliRunner().invoke(main, ["stage", str(source), str(dest), *node, *more])
        lines = [x for x in res.output.splitlines() if x.startswith("tokpack")]
        assert res.exit_code == 1 and len(lines) == 1 and all(w in lines[0] for w in words), res.output
        assert not list(dest.glob("epoch-*")) and not (dest / MANIFEST).exists()


def test_a_copy_or_a_slice_cut_from_token_files_of_a_run_on_the_nodes_is_one_line_naming_the_node_stage(
    windows, tmp_path
):
    """A RUN of --to-nodes holds row hashes, its tokens on the nodes: a whole-run copy, --shards-of,
    --ranks/--world-size, an epoch alone and --node with --start-sample (not a replacement node)
    each said "file listed in the manifest is missing ... restore it", the copy after making
    DEST's epoch folders. Now one line saying where the tokens are and the --node stage that
    rebuilds a node's slice; DEST not made."""
    _, _, run = windows
    node = ["--node", f"1/{NODES}", "--ranks-per-node", str(K), "--micro-batch", str(M)]
    for i, (source, more) in enumerate(
        [
            (run, []),
            (run, ["--shards-of", "0/8", "--micro-batch", str(M)]),
            (run, ["--ranks", "0-1", "--world-size", "8", "--micro-batch", str(M)]),
            (run, [*node, "--start-sample", "3"]),
            (run / epoch_dir_name(0), []),
        ]
    ):
        dest = tmp_path / f"d{i}"
        res = CliRunner().invoke(main, ["stage", str(source), str(dest), *more])
        lines = [x for x in res.output.splitlines() if x.startswith("tokpack")]
        assert res.exit_code == 1 and len(lines) == 1, res.output
        assert "token files are on the nodes" in lines[0] and "--node n/N" in lines[0], lines[0]
        assert not dest.exists(), sorted(dest.rglob("*"))


# ------------------------------------------------------------------ validate SLICE --against RUN, from the sources


def rank_rows(dest, e: int, r: int):
    """Rank r's rows of epoch e in the slice at `dest`, their padding (best-fit) and epoch positions."""
    from tokpack.formats.slices import RankRows

    root = json.loads((dest / MANIFEST).read_text())
    m = json.loads((dest / epoch_dir_name(e) / MANIFEST).read_text())
    f = dest / epoch_dir_name(e) / f"rank-{r:05d}.ds"
    tokens = np.fromfile(f, dtype="<u2").reshape(-1, SEQ + 1)
    pad_file = f.with_name(f.name + ".pad")
    pad = np.fromfile(pad_file, dtype="<u4") if pad_file.exists() else None
    rows = RankRows(root["world_size"], root["micro_batch"], root["batch_phase"])
    positions = np.concatenate(list(rows.node_positions(m["first_sample"], m["samples"], (r, r), 1 << 20)))
    assert len(positions) == len(tokens)
    return tokens, pad, positions


def rewrite_rank_file(dest, e: int, r: int, tokens, pad, run=None) -> None:
    """Rank r's file of epoch e rewritten with `tokens` (and `pad`) by the epoch shard writer, and
    the slice epoch's manifest entry with it: every checksum of the slice consistent again. With
    `run`: the slice epoch records RUN's epoch manifest as it is now (after a forged RUN)."""
    import xxhash

    from tokpack.formats.outputs import EpochShardFormat, LocalOutput
    from tokpack.formats.slices import RankRows
    from tokpack.packer.rank_files import RankFiles

    root = json.loads((dest / MANIFEST).read_text())
    d = dest / epoch_dir_name(e)
    m = json.loads((d / MANIFEST).read_text())
    _, _, positions = rank_rows(dest, e, r)
    fmt = EpochShardFormat(np.dtype("<u2"), SEQ, root["eos_id"], root["tokenizer"], padded=pad is not None)
    files = RankFiles(
        LocalOutput(),
        d,
        RankRows(root["world_size"], root["micro_batch"], root["batch_phase"]),
        m["first_sample"],
        (r, r),
        e,
        fmt,
    )
    files.add(positions, tokens, pad)
    (entry,) = files.close()
    m["shards"] = [entry if s["rank"] == r else s for s in m["shards"]]
    if run is not None:
        m["epoch_xxh3_128"] = xxhash.xxh3_128_hexdigest((run / epoch_dir_name(e) / MANIFEST).read_bytes())
    LocalOutput().finish(d, m)


def forge_run_swap(run, e: int, p: int, q: int) -> None:
    """RUN's row hashes (and padding) of epoch positions p and q, one epoch shard's, swapped and
    their checksums rewritten: RUN as consistent as if the exchange had written it so."""
    import xxhash

    from tokpack.formats.outputs import LocalOutput

    d = run / epoch_dir_name(e)
    em = json.loads((d / MANIFEST).read_text())
    per = em["shard_samples"]
    assert p // per == q // per
    entry = em["shards"][p // per]
    for suffix, dtype, key in ((".rows", "<u8", "rows_xxh3_128"), (".pad", "<u4", "pad_xxh3_128")):
        f = d / f"{entry['path']}{suffix}"
        if f.exists():
            values = np.fromfile(f, dtype=dtype)
            values[[p % per, q % per]] = values[[q % per, p % per]]
            f.write_bytes(values.tobytes())
            entry[key] = xxhash.xxh3_128_hexdigest(values.tobytes())
    LocalOutput().finish(d, em)


def validate_against(dest, run) -> tuple[int, str]:
    res = CliRunner().invoke(main, ["validate", str(dest), "--against", str(run)])
    return res.exit_code, res.output


@pytest.mark.parametrize("kind", ["windows", "best_fit"])
def test_validate_against_run_proves_an_untouched_slice_from_the_sources(kind, request, monkeypatch):
    """The untouched slice passes; and it is the sources that were read: every row of every rank
    file rebuilt from them (SourceRows.rows asked for each row once)."""
    from tokpack.packer.replacement import SourceRows

    root, _, run = request.getfixturevalue(kind)
    asked = []
    real = SourceRows.rows
    monkeypatch.setattr(
        SourceRows, "rows", lambda self, positions: (asked.append(len(positions)), real(self, positions))[1]
    )
    code, out = validate_against(root / "node1", run)
    assert code == 0 and "0 problems" in out, out
    assert sum(asked) == sum(node_rows(root / "node1"))


@pytest.mark.parametrize("kind", ["windows", "best_fit"])
def test_validate_against_run_fails_two_rows_swapped_with_every_checksum_consistent(kind, request, tmp_path):
    """Two rows of one rank file swapped; the rank file, its .index/.rows/.pad and the slice
    manifest rewritten, and RUN's row hashes (and padding) swapped too, with their checksums:
    `validate SLICE` and `validate RUN` pass, and only the replay from the sources can tell.
    validate --against RUN fails, naming the rank file, the row and its epoch position."""
    root, _, run = request.getfixturevalue(kind)
    dest, forged = tmp_path / "node1", tmp_path / "run"
    shutil.copytree(root / "node1", dest)
    shutil.copytree(run, forged)
    tokens, pad, positions = rank_rows(dest, 0, 3)
    i, j = 1, 2  # one micro-batch: positions p, p+1 in one epoch shard
    assert (tokens[i] != tokens[j]).any()
    forge_run_swap(forged, 0, int(positions[i]), int(positions[j]))
    tokens[[i, j]] = tokens[[j, i]]
    if pad is not None:
        pad[[i, j]] = pad[[j, i]]
    rewrite_rank_file(dest, 0, 3, tokens, pad, run=forged)
    assert "0 problems" in cli("validate", dest)
    assert "0 problems" in cli("validate", forged)
    code, out = validate_against(dest, forged)
    assert code == 1, out
    line = " ".join(out.split())
    assert "rank-00003.ds" in line and f"row {i}" in line and f"sample {int(positions[i])}" in line, out
    assert "replayed from the sources" in line and "(2 rows differ)" in line, out
    assert "differs from the run's sample" not in line, out  # RUN's row hashes were forged: they cannot tell


@pytest.mark.parametrize("kind", ["windows", "best_fit"])
def test_validate_against_run_fails_a_row_replaced_by_another_source_window(kind, request, tmp_path):
    """A row of rank 2's file replaced by another window of the source (a row of rank 3's, with
    its padding), the slice's checksums consistent: validate --against RUN names row and position."""
    root, _, run = request.getfixturevalue(kind)
    e = 1 if kind == "windows" else 0
    dest = tmp_path / "node1"
    shutil.copytree(root / "node1", dest)
    tokens, pad, positions = rank_rows(dest, e, 2)
    other, other_pad, _ = rank_rows(dest, e, 3)
    i = len(tokens) // 2
    tokens[i] = other[5]
    if pad is not None:
        pad[i] = other_pad[5]
    rewrite_rank_file(dest, e, 2, tokens, pad)
    assert "0 problems" in cli("validate", dest)
    code, out = validate_against(dest, run)
    assert code == 1, out
    line = " ".join(out.split())
    assert "rank-00002.ds" in line and f"row {i}" in line and f"sample {int(positions[i])}" in line, out
    assert "replayed from the sources" in line, out


# ------------------------------------------------------------------ later epochs from kept sources


@pytest.mark.parametrize("packing", ["windows", "best-fit"])
def test_a_later_epoch_from_kept_sources_opens_no_file_in_the_shared_source_folder(packing, tmp_path):
    """--keep-sources DIR{node}: epoch 0 keeps each process's part of the sources; epoch 1, every
    MPI process under an audit hook (tests/audit_site) recording each file it opens, opens none
    in the shared source folder (best-fit: the row table is rebuilt from the kept manifests and
    `.ds.index` files), and its slices are still the exchange's (a replacement node's bytes)."""
    from probes import AUDIT_SITE, audit_env, audited

    from test_mpi import REPO

    source = write_source(
        tmp_path / "shared" / "src", random_docs(np.random.default_rng(3), 200, 1000, 0), docs_per_shard=40
    )
    args = [source, "--seq-len", SEQ, "--seed", 5, "--shard-samples", 12, "--memory", MEMORY]
    if packing == "best-fit":
        args += ["--packing", "best-fit"]
    run, dest, keep = tmp_path / "exchanged", str(tmp_path / "node{node}"), str(tmp_path / "kept{node}")
    done = to_nodes(run, dest, *args, "--epoch", 0, "--keep-sources", keep)
    assert done.returncode == 0, done.stderr[-3000:]
    log = tmp_path / "audit.log"
    hook = {"PYTHONPATH": f"{AUDIT_SITE}:{REPO}", **audit_env(log, tmp_path)}
    done = to_nodes(run, dest, *args, "--epoch", 1, "--keep-sources", keep, env=hook)
    assert done.returncode == 0, done.stderr[-3000:]
    opened = [a for a in audited(log) if a.event == "open"]
    pids = {a.pid for a in opened if a.path.startswith(str(tmp_path / "kept"))}
    assert len(pids) >= 4, opened[:5]  # the hook ran in every MPI process: each read its kept copies
    shared = sorted({a.path for a in opened if a.path.startswith(f"{source}/") or a.path == str(source)})
    assert shared == [], shared[:10]
    # RUN's manifests name the shared source folder, byte for byte `tokpack shuffle`'s
    ref = tmp_path / "shuffled"
    cli("shuffle", *args, "--epoch", 1, "-o", ref)
    e1 = f"{epoch_dir_name(1)}/{MANIFEST}"
    assert (run / e1).read_bytes() == (ref / e1).read_bytes()
    assert json.loads((run / MANIFEST).read_text())["sources"] == json.loads((ref / MANIFEST).read_text())["sources"]
    again = tmp_path / "again"
    cli("stage", run, again, "--node", f"3/{NODES}", "--ranks-per-node", K, "--micro-batch", M, "--epochs", "1")
    assert tree(again / epoch_dir_name(1)) == tree(tmp_path / "node3" / epoch_dir_name(1))


def test_validate_against_run_without_its_sources_cannot_prove_the_slice(windows, monkeypatch):
    """The sources gone (or unreadable): nothing can replay the plan, and validate says so in one
    problem naming the epoch, rather than passing on RUN's row hashes alone."""
    from tokpack.formats.errors import TokpackError
    from tokpack.packer import replacement

    root, source, run = windows

    def gone(path, check_sizes=True):
        raise TokpackError("source directory not found", file=path)

    monkeypatch.setattr(replacement, "open_source", gone)
    code, out = validate_against(root / "node1", run)
    line = " ".join(out.split())
    assert code == 1 and "cannot replay epoch 0 from the sources" in line and str(source) in line, out


@pytest.mark.parametrize("text", ["not json", '{"/data/src": "../elsewhere"}', '["a"]'])
def test_a_damaged_kept_sources_record_is_one_line_naming_it(text, tmp_path):
    from tokpack.formats.errors import TokpackError
    from tokpack.packer.kept_sources import KEPT_RECORD, kept_copies

    (tmp_path / KEPT_RECORD).write_text(text)
    with pytest.raises(TokpackError, match="kept sources' record") as e:
        kept_copies(tmp_path)
    assert str(tmp_path / KEPT_RECORD) in str(e.value) and "\n" not in str(e.value)
