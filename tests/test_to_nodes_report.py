"""`shuffle --to-nodes` reports what `tokpack shuffle` reports of the same epochs (issue 42, item 5).
On main its summary, --json and `plan` omitted the warnings of sources drawn more than once, its
summary lacked a plain shuffle's fields, and it wrote no progress line in a log."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import random_docs, write_source
from test_mpi import K, M, MEMORY, SEQ, mpi_env, mpirun, summaries, to_nodes
from tokpack.packer.api import ShuffleResult
from tokpack.packer.cli import main

N = 2


@pytest.fixture(scope="module")
def upsampled(tmp_path_factory) -> list[str]:
    """A big source and a tiny one weighted 1:1: the tiny one is drawn several passes an epoch."""
    root = tmp_path_factory.mktemp("report")
    rng = np.random.default_rng(5)
    big = write_source(root / "big", random_docs(rng, 300, 600, 0), docs_per_shard=60)
    tiny = write_source(root / "tiny", random_docs(rng, 6, 300, 0), docs_per_shard=6)
    return [f"{big}=1", f"{tiny}=1", "--seq-len", str(SEQ), "--seed", "3", "--shard-samples", "16", "--epochs", "2"]


def _json(*args) -> dict:
    done = CliRunner().invoke(main, [*map(str, args), "--json"])
    assert done.exit_code == 0, done.output
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("packing", ["concat", "best-fit"])
def test_the_summary_holds_a_plain_shuffles_fields_and_warnings(upsampled, tmp_path, packing):
    args = [*upsampled, "--packing", packing, "--memory", MEMORY]
    plain = _json("shuffle", *args, "-o", tmp_path / "plain")
    assert plain["warnings"], plain  # the case: a source drawn more than once
    done = to_nodes(tmp_path / "run", str(tmp_path / "node{node}"), *args, n=N)
    assert done.returncode == 0, done.stderr[-2000:]
    info = summaries(done)
    fields = {f for f in ShuffleResult.__dataclass_fields__ if f not in ("seconds", "ok")}
    for node, s in info.items():
        assert fields <= set(s), (node, fields - set(s))
        assert s["warnings"] == plain["warnings"]
        for key in ("epochs", "written", "samples_per_epoch", "epoch_samples", "seq_len", "shard_samples", "packing"):
            assert s[key] == plain[key], key
        for mine, theirs in zip(s["epochs_detail"], plain["epochs_detail"]):
            for key in ("epoch", "samples", "shards", "sample_multiset_hash", "packing", "stage", "sources"):
                assert mine[key] == theirs[key], key
            assert mine["path"] == "to-nodes"
    # the nodes' slices hold the epochs' bytes between them
    assert (
        sum(s["bytes_written"] for s in info.values()) == sum(d["bytes_written"] for d in plain["epochs_detail"])
        or packing == "concat"
    )


def test_the_text_summary_gives_the_warnings_once_and_progress_in_a_log(upsampled, tmp_path):
    plain = _json("shuffle", *upsampled, "--memory", MEMORY, "-o", tmp_path / "plain")
    done = to_nodes(
        tmp_path / "run",
        str(tmp_path / "node{node}"),
        *upsampled,
        "--memory",
        MEMORY,
        n=N,
        env={"TOKPACK_PROGRESS": "0.01"},
        json_out=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    warnings = [line for line in done.stderr.splitlines() if line.startswith("tokpack: warning:")]
    assert warnings == [f"tokpack: warning: {w}" for w in plain["warnings"]], done.stderr[-2000:]  # once, not a node
    assert 'epoch 1, source "tiny"' in done.stdout and "to-nodes" in done.stdout
    assert "node 1 of 2" in done.stdout and "node 0 of 2" in done.stdout
    progress = [line for line in done.stderr.splitlines() if "read and exchange (node 0)" in line]
    assert progress and "MB" in progress[0], done.stderr[-2000:]
    # the total is about the bytes it sends: the last line is near the end, never past it
    assert 90 <= float(progress[-1].split("(")[-1].split("%")[0]) <= 100, progress[-1]
    assert "writing the slice's rank files" in done.stderr


def test_plan_to_nodes_gives_the_warnings_shuffle_gives(upsampled, tmp_path):
    plain = _json("plan", "shuffle", *upsampled, "-o", tmp_path / "plain")
    nodes = _json(
        "plan",
        "shuffle",
        *upsampled,
        "-o",
        tmp_path / "run",
        "--to-nodes",
        tmp_path / "node{node}",
        "--nodes",
        N,
        "--ranks-per-node",
        K,
        "--micro-batch",
        M,
    )
    assert plain["warnings"] and set(plain["warnings"]) <= set(nodes["warnings"]), nodes["warnings"]


def test_the_summary_says_ok_first_as_every_commands_json(upsampled, tmp_path):
    """docs/COMMANDS.md: every command's --json starts with "ok": true; `shuffle --to-nodes`'s
    (and the dict tokpack.shuffle(..., to_nodes=...) returns, the same object) had no "ok", so a
    script reading `["ok"]` of each command's line failed on it. One process, one node: no MPI."""
    nodes = ["--to-nodes", tmp_path / "n{node}", "--ranks-per-node", K, "--micro-batch", M]
    done = _json("shuffle", *upsampled, "--memory", MEMORY, "-o", tmp_path / "run", *nodes)
    assert next(iter(done)) == "ok" and done["ok"] is True, list(done)[:3]
    assert done["nodes"] == 1 and done["epochs"] == [0, 1]


def _one_node(cwd, *args) -> subprocess.CompletedProcess:
    """`shuffle --to-nodes` as one process of one node, run from `cwd` (where a relative path lands)."""
    command = [mpirun(), "-n", "1", sys.executable, "-m", "tokpack", "shuffle", *map(str, args), "--json"]
    return subprocess.run(command, capture_output=True, text=True, env=mpi_env(), cwd=cwd, timeout=120)


@pytest.mark.parametrize("option", ["--to-nodes", "--keep-sources"])
def test_a_url_for_a_node_folder_is_refused_not_written_to_a_local_s3_folder(upsampled, tmp_path, option):
    """--to-nodes s3://b/nodes (or --keep-sources s3://b/keep): the URL was made a Path, s3:/b/...,
    which no longer looked like a URL, and the node's slice (or its kept sources) went to the local
    folder ./s3:/b/... of the working directory; now the one line, exit 1, nothing written."""
    (tmp_path / "cwd").mkdir()
    dest = "s3://b/nodes" if option == "--to-nodes" else str(tmp_path / "node{node}")
    args = [*upsampled, "-o", tmp_path / "run", "--to-nodes", dest, "--ranks-per-node", K, "--micro-batch", M]
    if option == "--keep-sources":
        args += ["--keep-sources", "s3://b/keep"]
    done = _one_node(tmp_path / "cwd", *args)
    assert done.returncode == 1, done.stderr[-2000:]
    error = json.loads(done.stdout)["error"]
    assert option in error["where"] and "writes" in error["message"] and "local director" in error["message"], error
    assert not any((tmp_path / "cwd").iterdir()) and not (tmp_path / "run").exists()
