"""`tokpack plan shuffle ... --to-nodes DEST --nodes N` (issue 33, item 7): what each node of
`mpirun -n N tokpack shuffle ... --to-nodes DEST` reads, exchanges, keeps and needs. Its figures
are checked against a real 4-process run: what each process reports (--json), the files it
writes (slice and RUN), and the source shards it opens (the audit hook of tests/audit_site)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import random_docs, write_source
from probes import AUDIT_SITE
from test_mpi import K, M, MEMORY, NODES, REPO, SEQ, mpirun, summaries
from tokpack.formats.constants import MANIFEST, NODES_SIDECAR
from tokpack.formats.constants import PAD_SUFFIX, ROWS_SUFFIX
from tokpack.packer.cli import main

SPEEDS = ["--disk-mbps", 1000, "--shared-mbps", 4000]  # given: no disk probe


def plan_json(run: Path, dest: str, *args, nodes: int = NODES) -> dict:
    res = CliRunner().invoke(
        main,
        [
            "plan",
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
            "--nodes",
            str(nodes),
            *map(str, SPEEDS),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["ok"] and out["nodes"] == nodes and len(out["per_node"]) == nodes
    return out


def audited(tmp: Path, run: Path, dest: str, *args) -> tuple[dict[int, dict], dict[int, set[str]]]:
    """The real run, 4 processes, each recording what it opens under `tmp`: each process's
    summary, and per node the source shard files (.ds) it opened (a process is the node whose
    DEST it writes)."""
    log = tmp / f"audit-{len(list(tmp.glob('audit-*')))}.log"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO), AUDIT_SITE]),
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
        TOKPACK_PROGRESS="0",
        TOKPACK_AUDIT_LOG=str(log),
        TOKPACK_AUDIT_ROOT=str(tmp),
    )
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
        str(run),
        "--to-nodes",
        dest,
        "--ranks-per-node",
        str(K),
        "--micro-batch",
        str(M),
        "--json",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    node_of, opened = {}, defaultdict(set)
    for line in log.read_text().splitlines():
        pid, event, path, *_ = line.split("\t")
        for n in range(NODES):
            if path.startswith(dest.replace("{node}", str(n)) + "/"):
                node_of[pid] = n
        if event == "open" and path.endswith(".ds") and "/src" in path:
            opened[pid].add(path)
        # an owned epoch shard's tokens and index are hashed for RUN's manifest, never written
        name = path.rsplit("/", 1)[-1]
        assert not (
            event == "open" and "/.tokpack-work/" in path and (".ds.tmp-" in name or ".ds.index.tmp-" in name)
        ), path
    by_node = defaultdict(set)
    for pid, paths in opened.items():
        by_node[node_of[pid]] |= paths
    return summaries(done), by_node


def sizes(folder: Path, suffix: str) -> int:
    return sum(p.stat().st_size for p in folder.rglob(f"*{suffix}") if p.is_file())


def shard_bytes(source: Path) -> int:
    return sum(p.stat().st_size for p in source.glob("*.ds"))


def check_against_the_run(tmp: Path, source: Path, args: list, padded: bool) -> dict:
    """Plan, then the run: per node, its rows and rounds (--json), its rank files' sizes, the
    source shards it opened; RUN's files' sizes."""
    run, dest = tmp / "run", str(tmp / "node{node}")
    plan = plan_json(run, dest, *args)
    real, opened = audited(tmp, run, dest, *args)
    shards = json.loads((source / MANIFEST).read_text())["shards"]
    for n, p in enumerate(plan["per_node"]):
        got = real[n]["epochs_detail"]
        assert [e["epoch"] for e in p["epochs"]] == [d["epoch"] for d in got]
        for e, d in zip(p["epochs"], got):
            assert e["rows"] == d["rows_kept"] and e["slice_token_bytes"] == 2 * d["tokens_kept"]  # uint16
        slice_dir = tmp / f"node{n}"
        assert sizes(slice_dir, ".ds") == sum(e["slice_token_bytes"] for e in p["epochs"]) > 0
        assert sizes(slice_dir, ROWS_SUFFIX) == sum(e["slice_rows_bytes"] for e in p["epochs"])
        assert sizes(slice_dir, PAD_SUFFIX) == sum(e["slice_pad_bytes"] for e in p["epochs"])
        assert (sizes(slice_dir, PAD_SUFFIX) > 0) == padded
        # the index is counted at the epoch's mean fragments a row: within 10% of the node's
        assert abs(sizes(slice_dir, ".ds.index") - sum(e["slice_index_bytes"] for e in p["epochs"])) <= 0.1 * sizes(
            slice_dir, ".ds.index"
        )
        # what it reads from the shared filesystem: whole source shards, which it opens (the
        # window after its last may start in the next one, of which it reads at most a row)
        planned = sum(e["source_bytes"] for e in p["epochs"])
        assert p["shared_source_bytes"] == planned and p["local_source_bytes"] == 0
        each = {e["source_bytes"] for e in p["epochs"]}.pop()  # every epoch: the same sources, the same part
        read = sum(int(s["tokens"]) * 2 for s in shards if str(source / s["path"]) in opened[n])
        assert each <= read <= each + max(int(s["tokens"]) * 2 for s in shards)
        assert p["local_needed_bytes"] >= sum(f.stat().st_size for f in slice_dir.rglob("*") if f.is_file())
        assert p["sent_bytes"] > 0 and p["received_bytes"] > 0 and p["predicted_seconds"] > 0
    # the epoch's rounds: every process takes part until the last has sent all
    for i, e in enumerate(plan["epochs"]):
        assert {s["epochs_detail"][i]["rounds"] for s in real.values()} == {e["rounds"]} and e["rounds"] > 1
    # every source shard the epochs use, once over all nodes: exactly the sources' token bytes
    for i in range(len(plan["epochs"])):
        assert sum(p["epochs"][i]["source_bytes"] for p in plan["per_node"]) == shard_bytes(source)
    # RUN's small files, byte for byte their sizes
    files = plan["run_files"]
    assert files["manifests_bytes"] == sum(p.stat().st_size for p in run.rglob(MANIFEST))
    assert files["rows_bytes"] == sizes(run, ROWS_SUFFIX) and files["pad_bytes"] == sizes(run, PAD_SUFFIX)
    assert files["nodes_sidecar_bytes"] == (run / NODES_SIDECAR).stat().st_size
    assert files["bytes"] == sum(p.stat().st_size for p in run.rglob("*") if p.is_file() and p.name != "tokpack.lock")
    assert sum(p["shared_written_bytes"] for p in plan["per_node"]) == files["rows_bytes"] + files["pad_bytes"]
    return plan


@pytest.fixture
def source(tmp_path) -> Path:
    return write_source(tmp_path / "src", random_docs(np.random.default_rng(3), 200, 1000, 0), docs_per_shard=40)


def test_windows_plan_agrees_with_the_exchange(source, tmp_path):
    plan = check_against_the_run(
        tmp_path,
        source,
        [source, "--seq-len", SEQ, "--seed", 5, "--epochs", 2, "--shard-samples", 12, "--memory", MEMORY],
        padded=False,
    )
    assert all(d["exchanged_exact"] for p in plan["per_node"] for d in p["epochs"])
    assert all(e["rounds_exact"] for e in plan["epochs"])


def test_best_fit_plan_agrees_with_the_exchange(source, tmp_path):
    plan = check_against_the_run(
        tmp_path,
        source,
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
            "--memory",
            MEMORY,
            "--packing",
            "best-fit",
        ],
        padded=True,
    )
    assert not any(d["exchanged_exact"] for p in plan["per_node"] for d in p["epochs"])


def test_a_later_epoch_from_kept_sources_reads_no_source_byte_from_shared(source, tmp_path):
    """--keep-sources: the first epoch reads each node's part from shared and copies it (with
    the next shard) to its DIR, the bytes the run reports copying; the later epoch, planned once
    DIR holds them, reads 0 source bytes from shared (only RUN's manifests), and the run opens no
    shared source shard."""
    run, dest, keep = tmp_path / "run", str(tmp_path / "node{node}"), str(tmp_path / "kept{node}")
    args = [source, "--seq-len", SEQ, "--seed", 5, "--shard-samples", 12, "--memory", MEMORY, "--keep-sources", keep]
    first = plan_json(run, dest, *args, "--epoch", 0)
    real, _ = audited(tmp_path, run, dest, *args, "--epoch", 0)
    for n, p in enumerate(first["per_node"]):
        assert p["kept_copied_bytes"] == real[n]["epochs_detail"][0]["source_bytes_kept_now"] == p["kept_source_bytes"]
        assert (
            p["shared_source_bytes"] == p["kept_copied_bytes"]
            and p["local_source_bytes"] == p["epochs"][0]["source_bytes"]
        )
    later = plan_json(run, dest, *args, "--epoch", 1)
    real, opened = audited(tmp_path, run, dest, *args, "--epoch", 1)
    for n, p in enumerate(later["per_node"]):
        assert p["shared_source_bytes"] == 0 and p["kept_copied_bytes"] == 0
        assert real[n]["epochs_detail"][0]["source_bytes_kept_now"] == 0
        assert not {f for f in opened[n] if f.startswith(str(source))}  # the kept copies only
        assert p["local_source_bytes"] == p["epochs"][0]["source_bytes"]
        assert 0 < p["shared_manifest_bytes"] < 1 << 16
    assert sum(p["local_source_bytes"] for p in later["per_node"]) == shard_bytes(source)


def test_more_nodes_than_source_shards_gives_nodes_that_read_nothing(source, tmp_path):
    """5 source shards, 8 nodes: 3 read nothing and still receive their rows; a DEST this machine
    does not see has no free space to show, and without --disk-mbps no disk time."""
    args = [
        "plan",
        "shuffle",
        source,
        "--seq-len",
        SEQ,
        "--seed",
        5,
        "--epochs",
        1,
        "-o",
        tmp_path / "run",
        "--to-nodes",
        "/nonexistent-tokpack-node{node}/slice",
        "--ranks-per-node",
        K,
        "--micro-batch",
        M,
        "--nodes",
        8,
        "--shared-mbps",
        4000,
    ]
    res = CliRunner().invoke(main, [*map(str, args), "--json"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)
    idle = [p["node"] for p in plan["per_node"] if p["shared_source_bytes"] == 0]
    assert len(idle) == 3 and all(p["received_bytes"] > 0 and p["slice_bytes"] > 0 for p in plan["per_node"])
    assert sum(p["shared_source_bytes"] for p in plan["per_node"]) == shard_bytes(source)
    assert any(
        f"{'node' if len(idle) == 1 else 'nodes'} {', '.join(map(str, idle))} read no source shard" in w
        for w in plan["warnings"]
    )
    assert all(p["space"] == "not visible" for p in plan["per_node"]) and plan["space"] == []
    assert plan["disk_mbps"] is None and "give --disk-mbps" in plan["disk"] and plan["predicted_seconds"] is None
    assert not (tmp_path / "run").exists()
    text = CliRunner().invoke(main, [str(a) for a in args])
    assert text.exit_code == 0 and "not visible" in text.stdout and "read no source shard" in text.stderr


def test_the_human_report_and_the_disk_probe(source, tmp_path):
    """Without --disk-mbps the disk is probed in DEST's filesystem, and the first line says so;
    one row a node, the slowest node's time the run's; nothing else written."""
    res = CliRunner().invoke(
        main,
        [
            str(a)
            for a in (
                "plan",
                "shuffle",
                source,
                "--seq-len",
                SEQ,
                "--seed",
                5,
                "--epochs",
                1,
                "-o",
                tmp_path / "run",
                "--to-nodes",
                tmp_path / "node{node}",
                "--ranks-per-node",
                K,
                "--micro-batch",
                M,
                "--nodes",
                NODES,
                "--shared-mbps",
                4000,
                "--nic-mbps",
                100,
            )
        ],
    )
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert "--to-nodes" in lines[0] and "disk probe" in lines[0]
    head = next(i for i, line in enumerate(lines) if line.split()[:3] == ["node", "shared", "read"])
    assert [line.split()[0] for line in lines[head + 1 : head + 1 + NODES]] == [str(n) for n in range(NODES)]
    assert "RUN (shared filesystem) gets" in res.stdout and "no token file" in res.stdout
    assert "network 100 MB/s a node" in res.stdout and "measured" in res.stdout and "slowest node's" in res.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize(
    "drop, add, line",
    [
        ("--nodes", [], "plan shuffle --to-nodes needs --nodes N, --ranks-per-node K and --micro-batch M"),
        ("--micro-batch", [], "plan shuffle --to-nodes needs --nodes N, --ranks-per-node K and --micro-batch M"),
        ("--ranks-per-node", [], "plan shuffle --to-nodes needs --nodes N, --ranks-per-node K and --micro-batch M"),
        ("--to-nodes", [], "go with --to-nodes DEST"),
        (None, ["--scratch", "/tmp/s"], "--to-nodes writes no scratch to the shared filesystem; drop --scratch"),
        (None, ["--holdout", "0.1", "--packing", "best-fit"], "drop --like/--holdout"),
    ],
)
def test_misuse_is_one_usage_line(source, tmp_path, drop, add, line):
    opts = {"--to-nodes": str(tmp_path / "n{node}"), "--ranks-per-node": K, "--micro-batch": M, "--nodes": NODES}
    opts.pop(drop, None)
    res = CliRunner().invoke(
        main,
        [
            "plan",
            "shuffle",
            str(source),
            "--seq-len",
            str(SEQ),
            "--seed",
            "5",
            "--epochs",
            "1",
            "-o",
            str(tmp_path / "run"),
            *[str(x) for kv in opts.items() for x in kv],
            *add,
        ],
    )
    assert res.exit_code == 2 and "Traceback" not in res.output
    errors = [x for x in res.output.splitlines() if x.startswith("Error:")]
    assert len(errors) == 1 and line in errors[0], res.output
    assert not (tmp_path / "run").exists()


def test_a_large_epoch_counts_a_sample_of_its_windows_close_to_all(monkeypatch, tmp_path):
    """Beyond EXACT_WINDOWS windows the sends are counted on every k-th block and scaled: within
    2% of the exact count here (each row sent once, to its node: no owner's copy, spread evenly,
    to dilute the sample's error), and said to be estimates; the kept rows stay exact."""
    from tokpack.packer import plan_nodes
    from tokpack.packer.api import plan

    kw = dict(
        seq_len=63,
        seed=1,
        epochs=1,
        to_nodes=str(tmp_path / "n{node}"),
        ranks_per_node=K,
        micro_batch=M,
        nodes=NODES,
        memory=1 << 30,
        shared_mbps=4000,
        disk_mbps=1000,
    )
    spec = "virtual:tokens=50M,documents=100K,dtype=uint16,shard_tokens=5M"
    exact = plan("shuffle", spec, str(tmp_path / "run"), **kw)
    monkeypatch.setattr(plan_nodes, "EXACT_WINDOWS", 1 << 16)
    monkeypatch.setattr(plan_nodes, "SAMPLE_BLOCK", 1 << 10)
    sampled = plan("shuffle", spec, str(tmp_path / "run"), **kw)
    assert exact.epochs[0]["rounds_exact"] and not sampled.epochs[0]["rounds_exact"]
    for a, b in zip(exact.per_node, sampled.per_node):
        assert a["epochs"][0]["exchanged_exact"] and not b["epochs"][0]["exchanged_exact"]
        for key in ("sent_bytes", "received_bytes"):
            assert abs(b[key] - a[key]) <= 0.02 * a[key], (key, a[key], b[key])
        assert a["slice_bytes"] == b["slice_bytes"] and a["shared_source_bytes"] == b["shared_source_bytes"]
    assert abs(sampled.epochs[0]["rounds"] - exact.epochs[0]["rounds"]) <= 1


def test_rows_that_do_not_fit_memory_are_planned_out_of_core(source, tmp_path):
    """--memory 20KiB: every node orders its rows out of core (tests/test_mpi.py OUT_OF_CORE);
    the plan's rounds are the real run's and its scratch counts the bucket files, every row of
    the slice with its record (the owned shards' rows are not sent to their owner). --memory 8KiB: not even out of core, which
    the exchange refuses (test_too_little_memory_is_one_line_per_node_and_writes_no_slice): no rounds."""
    plan = check_against_the_run(
        tmp_path,
        source,
        [source, "--seq-len", SEQ, "--seed", 5, "--epochs", 1, "--shard-samples", 12, "--memory", "20KiB"],
        padded=False,
    )
    for p in plan["per_node"]:
        e = p["epochs"][0]
        assert not e["fits_memory"] and e["rounds"] is not None
        stored = e["rows"] * (SEQ + 1) * 2  # uint16 rows
        assert (
            p["out_of_core_bytes"] > stored == e["slice_token_bytes"] and p["scratch_bytes"] >= p["out_of_core_bytes"]
        )
    tiny = plan_json(
        tmp_path / "other",
        str(tmp_path / "other{node}"),
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
    assert tiny["epochs"][0]["rounds"] is None
    assert any("the rows of every node" in w and "even out of core" in w for w in tiny["warnings"])
    roomy = plan_json(
        tmp_path / "other",
        str(tmp_path / "other{node}"),
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
        MEMORY,
    )
    assert all(p["out_of_core_bytes"] == 0 and p["epochs"][0]["fits_memory"] for p in roomy["per_node"])


def test_a_two_stage_schedule_plan_agrees_with_the_exchange(source, tmp_path):
    """Epochs of different sizes and sources: each epoch's rows and rounds, each node's rank files,
    RUN's files; each epoch's source bytes over the nodes are its stage's shards."""
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
    run, dest, args = (
        tmp_path / "run",
        str(tmp_path / "node{node}"),
        ["--schedule", tmp_path / "run.yaml", "--memory", MEMORY],
    )
    plan = plan_json(run, dest, *args)
    real, _ = audited(tmp_path, run, dest, *args)
    assert [e["samples"] for e in plan["epochs"]] == [496, 95]
    for i, e in enumerate(plan["epochs"]):
        assert {s["epochs_detail"][i]["rounds"] for s in real.values()} == {e["rounds"]}
    for n, p in enumerate(plan["per_node"]):
        assert [(e["rows"], e["slice_token_bytes"]) for e in p["epochs"]] == [
            (d["rows_kept"], 2 * d["tokens_kept"]) for d in real[n]["epochs_detail"]
        ]
        assert sizes(tmp_path / f"node{n}", ".ds") == sum(e["slice_token_bytes"] for e in p["epochs"])
    assert [sum(p["epochs"][i]["source_bytes"] for p in plan["per_node"]) for i in range(2)] == [
        shard_bytes(source),
        shard_bytes(source) + shard_bytes(other),
    ]
    assert plan["run_files"]["bytes"] == sum(
        p.stat().st_size for p in run.rglob("*") if p.is_file() and p.name != "tokpack.lock"
    )
