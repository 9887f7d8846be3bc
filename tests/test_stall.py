"""A stalled node stops `shuffle --to-nodes` within a bound (issue 41, item 5): one process
stopped by SIGSTOP mid-epoch, and the others, with `--stall-timeout 3`, stop the job within
seconds with one line naming that node; the rerun then gives the bytes of a clean run. On main
the others wait for it forever (the job's timeout below fails the test)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import random_docs, start_job, write_source
from test_mpi import (
    K,
    M,
    NODES,
    REPO,
    SEQ,
    assert_every_rank_exits,
    assert_same_slices,
    mpi_env,
    mpirun,
    staged,
    summaries,
    to_nodes,
)
from tokpack.formats.guard import process_state
from tokpack.formats.constants import MANIFEST
from tokpack.formats.names import epoch_dir_name
from tokpack.packer.cli import main

VICTIM = 2
BOUND = 30  # seconds: the job's end after the stop, a bound on a hang (the timeout is 3 s)


def _command(run: Path, dest: str, args: list) -> list[str]:
    cmd = [mpirun(), "--oversubscribe", "-n", str(NODES), sys.executable, "-m", "tokpack", "shuffle"]
    cmd += [*map(str, args), "-o", str(run), "--to-nodes", dest, "--ranks-per-node", str(K)]
    return [*cmd, "--micro-batch", str(M), "--json"]


def _rank_pid(kids: list[str], rank: int) -> int | None:
    for k in kids:
        try:
            if f"OMPI_COMM_WORLD_RANK={rank}\0".encode() in Path(f"/proc/{k}/environ").read_bytes():
                return int(k)
        except OSError:
            pass
    return None


def _complete(tmp: Path) -> list[int]:
    """The epochs whose slice is committed on every node (the rerun keeps those)."""
    return [
        e for e in range(2) if all((tmp / f"node{n}" / epoch_dir_name(e) / MANIFEST).exists() for n in range(NODES))
    ]


def test_a_node_stopped_by_sigstop_stops_the_job_with_one_line_naming_it_and_a_rerun_gives_the_same_bytes(tmp_path):
    source = write_source(tmp_path / "src", random_docs(np.random.default_rng(4), 1500, 1000, 0), docs_per_shard=150)
    args = [source, "--seq-len", SEQ, "--seed", 6, "--epochs", 2, "--shard-samples", 100]
    run, dests = staged(tmp_path, args)
    env = mpi_env()
    exchanged, dest = tmp_path / "exchanged", str(tmp_path / "node{node}")
    slow = [*args, "--memory", "64KiB", "--stall-timeout", 3]  # out of core, many rounds
    # Every node's epoch 0 committed before the stop, not the victim's alone: a node's commit
    # (three fsyncs) can take seconds on a loaded disk, and the stop would then find it unfinished.
    job = start_job(_command(exchanged, dest, slow), env, lambda: _complete(tmp_path) != [], "every node's epoch 0")
    victim = None
    try:
        time.sleep(0.2)  # inside epoch 1 (its exchange: 53 rounds, about 0.5 s here)
        kids = subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True).stdout.split()
        victim = _rank_pid(kids, VICTIM)
        assert victim is not None and job.poll() is None, "node 2 finished before it could be stopped"
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            _, err = job.communicate(timeout=BOUND)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job still waits for the stopped node {BOUND} s later")
        took = time.monotonic() - stopped
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
        if victim is not None and process_state(victim) not in (None, "Z", "X"):
            os.kill(victim, signal.SIGKILL)
            os.kill(victim, signal.SIGCONT)
    assert job.returncode != 0 and "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("tokpack")]
    assert len(lines) == 1 and lines[0].startswith(f"tokpack: error: node {VICTIM} stalled: no progress for "), err[
        -3000:
    ]
    rounds = int(lines[0].split("its last after ")[1].split()[0])
    assert rounds >= 53, lines[0]  # epoch 0's 53 rounds, and perhaps some of epoch 1's
    assert "--stall-timeout 3" in lines[0] and "HINT: " in lines[0] and "rerun" in lines[0]
    assert 2.5 <= took < BOUND, took  # the last heartbeat came up to timeout/10 before the stop
    assert_every_rank_exits(kids)
    complete = _complete(tmp_path)  # [0]; [0, 1] had the victim finished epoch 1 before its stop
    assert complete[:1] == [0], complete
    done = to_nodes(exchanged, dest, *args, "--memory", "64KiB")  # the default timeout
    assert done.returncode == 0, done.stderr[-3000:]
    skipped = {n: s["skipped"] for n, s in summaries(done).items()}
    assert skipped == dict.fromkeys(range(NODES), complete), (skipped, lines[0])  # complete on every node: kept
    assert_same_slices(run, dests, exchanged, tmp_path / "node")


def test_the_stall_timeout_is_refused_without_to_nodes_and_when_not_a_positive_number(tmp_path):
    given = ["--seq-len", "7", "--seed", "1", "--epoch", "0"]
    res = CliRunner().invoke(main, ["shuffle", "src", "-o", str(tmp_path / "run"), *given, "--stall-timeout", "3"])
    assert res.exit_code == 2 and "--stall-timeout go with --to-nodes DEST" in res.output, res.output
    res = CliRunner().invoke(
        main, ["shuffle", "src", "-o", str(tmp_path / "run"), *given, "--to-nodes", "d", "--stall-timeout", "0"]
    )
    assert res.exit_code == 2 and "--stall-timeout" in res.output, res.output
    from tokpack.formats.errors import TokpackError
    from tokpack.packer.api import shuffle

    with pytest.raises(TokpackError, match=r"\[stall_timeout\]: out of range; expected a number > 0"):
        shuffle("src", tmp_path / "run", to_nodes="d", ranks_per_node=1, micro_batch=1, stall_timeout=float("nan"))
    with pytest.raises(TokpackError, match="--stall-timeout go with --to-nodes DEST"):
        shuffle("src", tmp_path / "run", seq_len=7, seed=1, stall_timeout=5)


WAITER = """
import os, sys, time
from mpi4py import MPI
from tokpack.packer.transport import together
comm = MPI.COMM_WORLD
if comm.Get_rank() == 1:
    # node 0 is at `together` (its file): where it is, known, not guessed from the time its imports
    # took, which on a loaded machine may be seconds more than node 1's
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.01)
    time.sleep(2)  # working (reading, writing): not in MPI
t, cpu = time.monotonic(), time.process_time()
if comm.Get_rank() == 0:
    open(sys.argv[1], "w").close()
together(comm, lambda: None)  # every step the nodes take together ends this way
if comm.Get_rank() == 0:
    print(f"{time.monotonic() - t:.3f} {time.process_time() - cpu:.3f}", flush=True)
"""


def test_a_process_waiting_for_a_peer_does_not_burn_a_core(tmp_path):
    """Node 1 works for 2 s while node 0 waits for it in `together`: node 0 naps (a nonblocking
    barrier tested between naps), using a few percent of a core; on main it polled in MPI's
    allgather, a core at 100% (or its share of one on a loaded machine)."""
    script = tmp_path / "waiter.py"
    script.write_text(WAITER)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    done = subprocess.run(
        [mpirun(), "--oversubscribe", "-n", "2", sys.executable, str(script), str(tmp_path / "node0-waits")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    waited, cpu = map(float, done.stdout.split())
    assert waited >= 1.5 and cpu < 0.1, (waited, cpu)
