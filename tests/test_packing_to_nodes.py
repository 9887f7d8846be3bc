"""The toy third packing (tests/ordered_packing.py) through `shuffle --to-nodes` under 4 MPI
processes: every process registers it (a plug-in is loaded in each process, here by a wrapper
that registers it before the CLI parses), and the node engine asks the registry, not the
packing's name, how its rows are built and sent. Its slices equal shuffle + stage --node, and a
replacement node rebuilds one from the sources alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_mpi import K, M, NODES, SEQ, assert_no_token_bytes, assert_same_slices, mpirun, staged, summaries, tree
from tokpack.shuffle import packings

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

# The plug-in's one registry line, in every process, then the `tokpack` command as given.
WRAPPER = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); "
    "from ordered_packing import ORDERED; from tokpack.shuffle import packings; packings.register(ORDERED); "
    "from tokpack.packer.cli import main; main(sys.argv[1:], prog_name='tokpack')"
)


@pytest.fixture
def ordered():
    from ordered_packing import ORDERED

    packings.register(ORDERED)
    try:
        yield ORDERED
    finally:
        packings.unregister(ORDERED.name)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    import numpy as np

    from conftest import random_docs, write_source

    root = tmp_path_factory.mktemp("ordered-nodes")
    return write_source(root / "src", random_docs(np.random.default_rng(5), 120, 1000, 0), docs_per_shard=30)


def test_a_toy_packing_runs_through_to_nodes_and_a_replacement_node(ordered, source, tmp_path):
    args = [source, "--seq-len", SEQ, "--seed", 3, "--epochs", 2, "--shard-samples", 12, "--packing", ordered.name]
    run, dests = staged(tmp_path, args)
    exchanged = tmp_path / "exchanged"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    env["TOKPACK_PROGRESS"] = "0"
    cmd = [mpirun(), "--oversubscribe", "-n", str(NODES), sys.executable, "-c", WRAPPER, str(TESTS), "shuffle"]
    cmd += [*map(str, args), "-o", str(exchanged), "--to-nodes", str(tmp_path / "node{node}")]
    cmd += ["--ranks-per-node", str(K), "--micro-batch", str(M), "--memory", "64KiB", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(summaries(done)) == list(range(NODES))
    assert_same_slices(run, dests, exchanged, tmp_path / "node")
    assert_no_token_bytes(exchanged, run)

    # node 2 lost: a replacement rebuilds its slice from the sources and RUN's row hashes alone
    from click.testing import CliRunner

    from tokpack.packer.cli import main

    again = tmp_path / "replacement2"
    res = CliRunner().invoke(
        main,
        [
            str(a)
            for a in ("stage", exchanged, again, "--node", f"2/{NODES}", "--ranks-per-node", K, "--micro-batch", M)
        ],
    )
    assert res.exit_code == 0, res.output
    a, b = tree(again), tree(tmp_path / "node2")
    assert a == b
