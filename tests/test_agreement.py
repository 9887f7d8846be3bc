"""Every process of a `shuffle --to-nodes` job proves it runs the same shuffle before anything is
written (issue 42, item 1). On main, a node started with another --epochs hung the job, another
--pad-id exited 0 with that node's rows padded otherwise than RUN records, another --seed was
"internal error: the exchange filled a row of this node wrongly": here each is one line on every
process naming the node and the setting, exit 2, and neither RUN nor any DEST holds a file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import random_docs, write_source
from test_mpi import K, M, MEMORY, SEQ, mpi_env, mpirun
from tokpack.packer.agreement import MismatchError, disagreement, spec_facts
from tokpack.shuffle.spec import NodesSpec, ShuffleSpec


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("agree")
    rng = np.random.default_rng(11)
    a = write_source(root / "a", random_docs(rng, 120, 600, 0), docs_per_shard=40)
    b = write_source(root / "b", random_docs(rng, 80, 600, 0), docs_per_shard=40)
    return a, b


def _command(a: Path, b: Path, run: Path, dest: str, **change) -> list[str]:
    settings = {
        "--seq-len": SEQ,
        "--seed": 5,
        "--epochs": 2,
        "--memory": MEMORY,
        "--ranks-per-node": K,
        "--micro-batch": M,
        "--packing": "best-fit",
        "--pad-id": 7,
        "--shard-samples": 12,
        **change,
    }
    first = change.pop("sources", [f"{a}=2", f"{b}=1"])
    args = [str(x) for kv in settings.items() if kv[0] != "sources" for x in kv]
    return [sys.executable, "-m", "tokpack", "shuffle", *first, "-o", str(run), "--to-nodes", dest, *args]


def _launch(commands: list[list[str]]) -> subprocess.CompletedProcess:
    """One MPI job of len(commands) processes, process k started with commands[k] (MPMD), as a
    wrapper script that passes one node other options would."""
    env = mpi_env()
    cmd = [mpirun(), "--oversubscribe", "--enable-recovery"]
    for k, c in enumerate(commands):
        cmd += [*([":"] if k else []), "-n", "1", *c]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def _written(tmp_path: Path) -> list[str]:
    return [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()]


# (the option, what one node is given instead, the words naming it in the line)
DIFFERENT = [
    ("--seed", 6, "--seed"),
    ("--epochs", 3, "--epochs"),
    ("--pad-id", 9, "--pad-id"),
    ("--seq-len", SEQ + 1, "--seq-len"),
    ("--memory", "96KiB", "--memory"),
    ("--packing", "concat", "--packing"),
    ("--ranks-per-node", K + 1, "--ranks-per-node"),
    ("--micro-batch", M + 1, "--micro-batch"),
    ("sources", None, "the sources' weights"),
]


@pytest.mark.parametrize("option,other,named", DIFFERENT, ids=[d[0] for d in DIFFERENT])
def test_a_node_started_with_another_setting_is_one_line_on_every_process(sources, tmp_path, option, other, named):
    a, b = sources
    run, dest = tmp_path / "run", str(tmp_path / "node{node}")
    odd = {option: other} if option != "sources" else {"sources": [f"{a}=1", f"{b}=1"]}
    done = _launch([_command(a, b, run, dest), _command(a, b, run, dest, **odd)])
    lines = [line for line in done.stderr.splitlines() if line.startswith("tokpack: error:")]
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 2 and lines[0] == lines[1], done.stderr[-2000:]  # the same line on every process
    assert f"[{named}]" in lines[0] and "on node 1" in lines[0] and "as on node 0" in lines[0], lines[0]
    assert "Traceback" not in done.stderr
    assert _written(tmp_path) == []  # before anything is written: no RUN, no DEST, no lock


def test_four_processes_name_the_one_that_differs(sources, tmp_path):
    a, b = sources
    run, dest = tmp_path / "run", str(tmp_path / "node{node}")
    same = _command(a, b, run, dest)
    done = _launch([same, same, _command(a, b, run, dest, **{"--seed": 99}), same])
    lines = [line for line in done.stderr.splitlines() if line.startswith("tokpack: error:")]
    assert done.returncode == 2 and len(lines) == 4 and len(set(lines)) == 1, done.stderr[-2000:]
    assert "99 on node 2" in lines[0] and "node 0" in lines[0] and "node 1" not in lines[0].split("found")[1]


def test_the_same_settings_run_and_write(sources, tmp_path):
    a, b = sources
    run, dest = tmp_path / "run", str(tmp_path / "node{node}")
    same = _command(a, b, run, dest)
    done = _launch([same, same])
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "node0" / "tokpack.json").is_file() and (tmp_path / "node1" / "tokpack.json").is_file()


# ------------------------------------------------------------------ what a peer sends, checked


def _facts(tmp_path: Path, **change) -> dict[str, str]:
    spec = ShuffleSpec(
        sources=(str(tmp_path),), output="run", seq_len=64, seed=1, nodes=NodesSpec(dest="d", ranks_per_node=1)
    )
    return {**spec_facts(spec, "1.0"), **change}


@pytest.mark.parametrize(
    "hostile",
    [None, [], "seed", {1: "x"}, {"seed": 5}, {"seed": "x" * (1 << 17)}, {"k%d" % i: "v" for i in range(10**5)}],
    ids=["none", "list", "str", "int-key", "int-value", "huge-value", "huge-dict"],
)
def test_a_malformed_peer_description_is_named_not_compared(tmp_path, hostile):
    e = disagreement([_facts(tmp_path), hostile])
    assert isinstance(e, MismatchError) and "node 1 sent a malformed" in str(e)


def test_sources_that_differ_or_the_version_are_named(sources, tmp_path):
    """What each process opened (a node's view of the shared folder, or its kept copies) is
    compared by fingerprint; the version by text."""
    from types import SimpleNamespace

    from tokpack.packer.agreement import agree_sources

    class Comm:  # allgather as MPI's, each process's facts in node order
        def __init__(self, *others):
            self.others = others

        def allgather(self, mine):
            return [mine, *self.others]

    a, b = sources
    opened = [SimpleNamespace(path=a, fingerprint="f" * 32), SimpleNamespace(path=b, fingerprint="e" * 32)]
    agree_sources(Comm({"source 0": "f" * 32, "source 1": "e" * 32}), opened)  # the same: no error
    with pytest.raises(MismatchError, match=r"read different data as source 1 .*0{32} on node 1"):
        agree_sources(Comm({"source 0": "f" * 32, "source 1": "0" * 32}), opened)
    spec = ShuffleSpec(sources=(str(a),), output="run", seq_len=64, seed=1)
    mine = spec_facts(spec, "1.0")
    assert "tokpack's version" in str(disagreement([mine, {**mine, "version": "0.9"}]))
    assert disagreement([mine, dict(mine)]) is None


# ------------------------------------------------------------------ a property over every setting

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


SETTINGS = ("seed", "epochs", "pad_id", "memory", "nodes.micro_batch")


@settings(max_examples=200, deadline=None)
@given(
    nodes=st.integers(2, 9),
    odd_node=st.integers(0, 8),
    setting=st.sampled_from(SETTINGS),
    value=st.text(min_size=1, max_size=20),
)
def test_any_one_node_with_any_other_value_is_named(nodes, odd_node, setting, value):
    """Whatever setting one node holds otherwise, whatever the value, that node is named (the
    others hold the most common value), with the option's name and both values."""
    from tokpack.packer.agreement import OPTION

    base = {"version": "1", **{k: "0" for k in SETTINGS}}
    odd_node %= nodes
    if value == base[setting]:
        value += "x"
    gathered = [dict(base) for _ in range(nodes)]
    gathered[odd_node][setting] = value
    e = disagreement(gathered)
    if nodes == 2:  # a tie: node 0's value is taken as the job's
        assert isinstance(e, MismatchError) and "on node" in str(e)
        return
    assert isinstance(e, MismatchError)
    assert f"{value} on node {odd_node}" in e.found and e.where == OPTION[setting], str(e)
    assert disagreement([dict(base) for _ in range(nodes)]) is None
