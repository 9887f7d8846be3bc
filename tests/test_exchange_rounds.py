"""The exchange's rounds (packer/transport.py `exchange_rounds`) under MPI: an item's tokens are a
read buffer that the reading thread refills once the next item is asked for, so a round must
send an item's pieces before it asks for the next one; an item larger than a round is sent over
several rounds; a process with nothing to read still takes part. Every row reaches its
destination once, with its own tokens."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from test_mpi import REPO, mpi_env, mpirun

SCRIPT = """
import json, sys, threading, time
import numpy as np
from mpi4py import MPI
from tokpack.packer.pieces import WIRE_PIECE
from tokpack.packer.transport import exchange_rounds

comm = MPI.COMM_WORLD
me, N = comm.Get_rank(), comm.Get_size()
ROW = 6
sizes = json.loads(sys.argv[1])  # rows of each item, by process
per_round = int(sys.argv[2]) * ROW
HELD = sys.argv[3] == "held"  # a mapping's tokens (best-fit): a round may take several items
SLOW = float(sys.argv[4])  # seconds a delivery takes before it reads what it was given


def tokens_of(g):
    return (np.asarray(g)[:, None] * 7 + np.arange(ROW)) % 65000


def reads():
    # Two buffers in turn, as the read-ahead thread fills them; asking for the next item spoils
    # the last one's buffer (the thread would be reading into it), so a late use of it shows.
    bufs = [np.zeros(64 * ROW, np.uint16) for _ in range(2)]
    first = 0
    for i, n in enumerate(sizes[me]):
        buf = bufs[i % 2]
        g = me * 1000 + first + np.arange(n)
        first += n
        order = np.random.default_rng(i).permutation(n)  # the rows in the block in another order than g
        buf[: n * ROW].reshape(n, ROW)[order] = tokens_of(g)
        pieces = np.zeros(n, WIRE_PIECE)
        pieces["g"], pieces["length"] = g, ROW
        yield pieces, buf[: n * ROW], order.astype(np.int64) * ROW, HELD
        if not HELD:
            buf[:] = 65535
        else:
            bufs[i % 2] = np.zeros(64 * ROW, np.uint16)  # a held item's tokens stay as they are


got = {}
threads = set()


def deliver(pieces, tokens):
    threads.add(threading.current_thread() is threading.main_thread())
    time.sleep(SLOW)  # meanwhile the next round is received: into the other buffer, not this one
    ends = np.cumsum(pieces["length"].astype(np.int64))
    for g, end in zip(pieces["g"].tolist(), ends.tolist()):
        assert g not in got, f"row {g} twice"
        got[g] = tokens[end - ROW : end].tolist()


route = lambda pieces: (pieces["g"] % N, np.arange(len(pieces)))
rounds = exchange_rounds(comm, MPI, reads(), per_round, ROW, np.uint16, route, deliver)
want = {}
for p in range(N):
    g = p * 1000 + np.arange(sum(sizes[p]))
    for x in g[g % N == me].tolist():
        want[x] = tokens_of([x])[0].tolist()
print(json.dumps({"rank": me, "rounds": rounds, "same": got == want, "rows": len(got), "main": sorted(threads)}), flush=True)
"""


@pytest.mark.parametrize(
    "sizes, per_round, held, rounds, slow",
    [
        ([[5, 1, 9], [], [3, 3], [12]], 4, "reused", 6, 0),  # items split over rounds (9 rows: 3 rounds of 4)
        ([[2], [2, 2, 2, 2], [1], [2]], 8, "reused", 4, 0),  # a round takes one reused buffer's item, however small
        ([[2], [2, 2, 2, 2], [1], [2]], 8, "held", 1, 0),  # held items: as many as a round holds
        ([[5, 1, 9], [], [3, 3], [12]], 4, "held", 4, 0),  # 15 rows in rounds of 4
        # each delivery slow: the next round is sent and received meanwhile, into the other buffer
        ([[5, 1, 9], [], [3, 3], [12]], 4, "reused", 6, 0.05),
    ],
)
def test_every_row_reaches_its_node_once_with_its_tokens(tmp_path, sizes, per_round, held, rounds, slow):
    """... and each round's tokens are delivered on a thread of their own (not the main thread,
    which goes on with the next round), from a buffer the next round does not receive into."""
    script = tmp_path / "rounds.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [
            mpirun(),
            "--oversubscribe",
            "-n",
            "4",
            sys.executable,
            str(script),
            json.dumps(sizes),
            str(per_round),
            held,
            str(slow),
        ],
        capture_output=True,
        text=True,
        env=mpi_env(),
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 4, done.stdout
    total = sum(sum(s) for s in sizes)
    assert all(x["same"] for x in lines), lines
    assert sum(x["rows"] for x in lines) == total
    assert {x["rounds"] for x in lines} == {rounds}, lines
    assert all(x["main"] == [False] for x in lines if x["rows"]), lines
