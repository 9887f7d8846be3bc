"""How `shuffle --to-nodes` is launched on a cluster (issue 33 item 8, docs/CLUSTER.md): inside a
Slurm allocation with `mpirun`, and refused when the launcher started N processes that MPI sees
as N singletons (an srun without PMIx for this MPI), each of which would otherwise take itself
for the only node and write a whole epoch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_executors import slurm_unavailable
from test_mpi import (
    EVERY_LINE,
    K,
    M,
    MEMORY,
    NODES,
    REPO,
    assert_same_slices,
    mpirun,
    source,  # noqa: F401 (fixture)
    staged,
)
from tokpack.packer.transport import LAUNCHER_SIZES

ENV = dict(
    os.environ,
    PYTHONPATH=str(REPO),
    OMPI_ALLOW_RUN_AS_ROOT="1",
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
    TOKPACK_PROGRESS="0",
)


def shuffle_args(source: Path, run: Path, dest: str, memory: str = MEMORY) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tokpack",
        "shuffle",
        str(source),
        "--seq-len",
        "63",
        "--seed",
        "5",
        "--epochs",
        "2",
        "--shard-samples",
        "12",
        "-o",
        str(run),
        "--to-nodes",
        dest,
        "--ranks-per-node",
        str(K),
        "--micro-batch",
        str(M),
        "--memory",
        memory,
    ]


@pytest.mark.parametrize("var", LAUNCHER_SIZES)
def test_a_process_alone_in_mpi_whose_launcher_started_several_is_refused(source, tmp_path, var):
    mpirun()  # mpi4py and its MPI are here: the process starts as MPI's singleton
    run, dest = tmp_path / "run", tmp_path / "node{node}"
    env = {k: v for k, v in ENV.items() if k not in LAUNCHER_SIZES}
    done = subprocess.run(
        shuffle_args(source, run, str(dest)), capture_output=True, text=True, timeout=120, env={**env, var: "4"}
    )
    assert done.returncode == 1, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert var in lines[0] and "MPI sees this one alone" in lines[0] and "mpirun -n N" in lines[0]
    assert not run.exists() and not (tmp_path / "node0").exists()
    # launched as one process of one (the launcher says 1), the same command runs
    ok = subprocess.run(
        shuffle_args(source, run, str(dest), "4MiB"), capture_output=True, text=True, timeout=120, env={**env, var: "1"}
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (tmp_path / "node0" / "tokpack.json").is_file()


def _slurm() -> None:
    if (reason := slurm_unavailable()) is not None:
        pytest.skip(reason)


def test_srun_that_starts_singletons_is_refused_on_every_task(source, tmp_path):
    """`srun --mpi=none -n 2`: Slurm starts 2 tasks that MPI cannot join (what an srun without
    PMIx does): both refuse, and nothing is written."""
    _slurm()
    mpirun()
    run = tmp_path / "run"
    done = subprocess.run(
        ["srun", "--mpi=none", "-n", "2", "--time", "5", *shuffle_args(source, run, str(tmp_path / "node{node}"))],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert done.returncode != 0
    refusals = [line for line in done.stderr.splitlines() if "SLURM_STEP_NUM_TASKS" in line]
    assert len(refusals) == 2 and all("MPI sees this one alone" in line for line in refusals), done.stderr
    assert not run.exists() and not (tmp_path / "node0").exists()


def test_the_cluster_batch_script_runs_mpirun_in_the_allocation_and_equals_stage(source, tmp_path):
    """docs/CLUSTER.md's launch: `mpirun` inside an sbatch allocation (here a one-node Slurm
    and 4 processes on it); the slices equal shuffle + stage --node of each node."""
    _slurm()
    exe = mpirun()
    args = [str(source), "--seq-len", "63", "--seed", "5", "--epochs", "2", "--shard-samples", "12"]
    ref, dests = staged(tmp_path, args)
    run = tmp_path / "exchanged"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\nset -euo pipefail\n"
        f"{exe} -n {NODES} --oversubscribe --map-by ppr:{NODES}:node "
        + " ".join(shuffle_args(source, run, str(tmp_path / "node{node}")))
        + "\n"
    )
    log = tmp_path / "job.log"
    done = subprocess.run(
        ["sbatch", "--wait", "-n", "1", "--time", "10", "-o", str(log), str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        env=ENV,
    )
    assert done.returncode == 0, (done.stderr, log.read_text() if log.exists() else "")
    assert_same_slices(ref, dests, run, tmp_path / "node")


def test_a_later_epoch_by_like_equals_the_run_written_whole(source, tmp_path):
    """`shuffle --like RUN --epoch 1 --to-nodes ...`: the next epoch from RUN's own settings (the
    command every hint proposes), byte for byte what shuffle + stage --node give for both epochs."""
    exe = mpirun()
    args = [str(source), "--seq-len", "63", "--seed", "5", "--shard-samples", "12"]
    ref, dests = staged(tmp_path, [*args, "--epochs", "2"])
    run, dest = tmp_path / "exchanged", str(tmp_path / "node{node}")
    nodes = [exe, "--oversubscribe", "-n", str(NODES), sys.executable, "-m", "tokpack", "shuffle"]
    slices = ["--to-nodes", dest, "--ranks-per-node", str(K), "--micro-batch", str(M), "--memory", MEMORY]
    first = subprocess.run(
        [*nodes, *args, "--epoch", "0", "-o", str(run), *slices], capture_output=True, text=True, timeout=300, env=ENV
    )
    assert first.returncode == 0, first.stderr[-2000:]
    later = subprocess.run(
        [*nodes, "--like", str(run), "--epoch", "1", *slices], capture_output=True, text=True, timeout=300, env=ENV
    )
    assert later.returncode == 0, later.stderr[-2000:]
    assert_same_slices(ref, dests, run, tmp_path / "node")
    # a setting --like takes from the run, given as well, is refused on every process
    twice = subprocess.run(
        [*nodes[:2], *EVERY_LINE, *nodes[2:], "--like", str(run), "--epoch", "2", "--seed", "6", *slices],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert twice.returncode != 0 and twice.stderr.count("--seed") >= NODES, twice.stderr[-2000:]
    assert not any((tmp_path / f"node{n}" / "epoch-00002").exists() for n in range(NODES))


def test_a_node_without_rows_and_a_micro_batch_past_its_bound(source, tmp_path):
    """A global batch larger than the epoch leaves node 1 no rows (it crashed allocating an empty
    store, and node 0 waited in a collective until killed): both slices equal stage --node's.
    W*m past MAX_GLOBAL_BATCH is one line on every process before anything is written."""
    from test_mpi import cli, tree

    exe = mpirun()
    args = [str(source), "--seq-len", "63", "--seed", "5", "--epochs", "1"]
    nodes = [exe, "--oversubscribe", "-n", "2", sys.executable, "-m", "tokpack", "shuffle", *args]
    run = tmp_path / "run"
    cli("shuffle", *args, "-o", run)
    m = 10**6
    done = subprocess.run(
        [
            *nodes,
            "-o",
            str(tmp_path / "exchanged"),
            "--to-nodes",
            str(tmp_path / "node{node}"),
            "--ranks-per-node",
            "1",
            "--micro-batch",
            str(m),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for n in range(2):
        cli("stage", run, tmp_path / f"staged{n}", "--node", f"{n}/2", "--ranks-per-node", 1, "--micro-batch", m)
        have, want = tree(tmp_path / f"node{n}"), tree(tmp_path / f"staged{n}")
        have.pop("tokpack.json"), want.pop("tokpack.json")  # the root names its RUN
        assert have == want, n
    assert json.loads((tmp_path / "node1" / "epoch-00000" / "tokpack.json").read_text())["tokens"] == 0  # no rows
    big = subprocess.run(
        [
            *nodes[:2],
            *EVERY_LINE,
            *nodes[2:],
            "-o",
            str(tmp_path / "big"),
            "--to-nodes",
            str(tmp_path / "big{node}"),
            "--ranks-per-node",
            "1",
            "--micro-batch",
            str(10**15),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    lines = [x for x in big.stderr.splitlines() if x.startswith("tokpack: error:")]
    assert big.returncode != 0 and len(lines) == 2 and all("global batch (W*m) is too large" in x for x in lines)
    assert not (tmp_path / "big").exists() and not (tmp_path / "big0").exists()


def test_a_kept_copy_edited_after_it_was_kept_is_copied_again_not_trained_on(source, tmp_path):
    """Node 0 keeps its source shards and the next one, whose first rows its last windows read
    and no other check of this node covers. That copy edited (same size) before epoch 1: epoch 1
    copies it again from the source and its bytes are shuffle + stage's (it trained on the
    edited byte before: node 1's slice held a row that no source holds)."""
    from test_mpi import cli, tree

    exe = mpirun()
    args = [str(source), "--seq-len", "63", "--seed", "5", "--shard-samples", "12"]
    run = tmp_path / "run"
    cli("shuffle", *args, "--epochs", 2, "-o", run)
    nodes = [
        exe,
        "--oversubscribe",
        "-n",
        "2",
        sys.executable,
        "-m",
        "tokpack",
        "shuffle",
        *args,
        "-o",
        str(tmp_path / "exchanged"),
        "--to-nodes",
        str(tmp_path / "node{node}"),
        "--ranks-per-node",
        "1",
        "--micro-batch",
        "2",
        "--keep-sources",
        str(tmp_path / "kept{node}"),
    ]
    first = subprocess.run([*nodes, "--epoch", "0"], capture_output=True, text=True, timeout=120, env=ENV)
    assert first.returncode == 0, first.stderr[-2000:]
    copy = max((tmp_path / "kept0").glob("*/*.ds"))  # node 0's last kept shard: the one after its part
    original = copy.read_bytes()
    edited = bytearray(original)
    edited[2] ^= 1  # its first row: the one node 0's last window runs into
    copy.write_bytes(bytes(edited))
    later = subprocess.run([*nodes, "--epoch", "1"], capture_output=True, text=True, timeout=120, env=ENV)
    assert later.returncode == 0, later.stderr[-2000:]
    assert copy.read_bytes() == original
    for n in range(2):
        cli("stage", run, tmp_path / f"staged{n}", "--node", f"{n}/2", "--ranks-per-node", 1, "--micro-batch", 2)
        have, want = tree(tmp_path / f"node{n}"), tree(tmp_path / f"staged{n}")
        have.pop("tokpack.json"), want.pop("tokpack.json")
        assert have == want, n


API_TO_NODES = """
import json, sys
import tokpack
source, run, dest, k, m, memory = sys.argv[1:]
result = tokpack.shuffle(
    source, run, seq_len=63, seed=5, epochs=2, shard_samples=12, memory=memory, packing="best-fit",
    to_nodes=dest, ranks_per_node=int(k), micro_batch=int(m),
)
print(json.dumps(result))
"""


def test_the_python_api_runs_to_nodes_as_the_cli_does(source, tmp_path):
    """`tokpack.shuffle(..., to_nodes=DEST, ranks_per_node=K, micro_batch=M)` under mpirun (issue 40):
    every node's slice and every file of RUN byte for byte the CLI's `shuffle --to-nodes`, and one
    summary a process."""
    from test_mpi import tree

    from tokpack.formats.constants import NODES_SIDECAR

    mpi = [mpirun(), "--oversubscribe", "-n", str(NODES)]
    cli_run, api_run = tmp_path / "cli-run", tmp_path / "api-run"
    args = shuffle_args(source, cli_run, str(tmp_path / "cli{node}"))
    args[5:5] = ["--packing", "best-fit"]  # after the SOURCE: the slices' padding too
    done = subprocess.run([*mpi, *args, "--json"], capture_output=True, text=True, timeout=180, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    script = [
        sys.executable,
        "-c",
        API_TO_NODES,
        str(source),
        str(api_run),
        str(tmp_path / "api{node}"),
        str(K),
        str(M),
    ]
    done = subprocess.run([*mpi, *script, MEMORY], capture_output=True, text=True, timeout=180, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    summaries = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted(s["node"] for s in summaries) == list(range(NODES)) and all(s["epochs"] == [0, 1] for s in summaries)
    assert_same_slices(cli_run, [tmp_path / f"cli{n}" for n in range(NODES)], api_run, tmp_path / "api")
    want, have = tree(cli_run), tree(api_run)
    assert sorted(want) == sorted(have) and any(name.endswith(".ds.pad") for name in want)
    for name in want:  # the sidecar names each run's own DEST
        if name == NODES_SIDECAR:
            assert json.loads(have[name])["dest"] == str(tmp_path / "api{node}")
            assert {**json.loads(have[name]), "dest": None} == {**json.loads(want[name]), "dest": None}
        else:
            assert have[name] == want[name], name
