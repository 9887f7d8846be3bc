"""A node is P processes (issue 41, item 1): `shuffle --to-nodes --procs-per-node P` under
`mpirun -n N*P` (here 4 processes as 2 nodes of 2, on one machine) writes each node's slice
byte for byte as `tokpack shuffle` then `stage RUN DEST --node n/N`, whatever P: windows and
best-fit, in memory and out of core, a first epoch and a later one from the node's kept sources
(also when P changed between them); RUN's files (its sidecar says N nodes) are those of P = 1."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import random_docs, write_source
from probes import AUDIT_SITE, hashed
from test_mpi import K, M, REPO, SEQ, cli, to_nodes
from tokpack.formats.constants import MANIFEST, NODES_SIDECAR
from tokpack.formats.reading import canonical_bytes
from tokpack.formats.builders import nodes_sidecar
from tokpack.formats.shards import PAD_SUFFIX, ROWS_SUFFIX
from tokpack.packer.node_procs import launcher_procs

N, P = 2, 2  # 4 processes: 2 nodes of 2
IN_MEMORY, OUT_OF_CORE = "4MiB", "40KiB"  # --memory, the node's: each process plans with half


def _args(source: Path, packing: str, *more) -> list:
    return [source, "--seq-len", SEQ, "--seed", 5, "--shard-samples", 12, "--packing", packing, *more]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ppn")
    return write_source(root / "src", random_docs(np.random.default_rng(3), 200, 1000, 0), docs_per_shard=40)


@pytest.fixture(scope="module")
def staged(source, tmp_path_factory):
    """packing -> (RUN of `tokpack shuffle`, 3 epochs; its `stage --node n/2` slices): what every
    --to-nodes run here must equal, made once a packing."""
    made = {}

    def get(packing: str):
        if packing not in made:
            tmp = tmp_path_factory.mktemp(f"staged-{packing}")
            run = tmp / "run"
            cli("shuffle", *_args(source, packing, "--epochs", 3), "-o", run)
            dests = [tmp / f"staged{n}" for n in range(N)]
            for n, d in enumerate(dests):
                cli("stage", run, d, "--node", f"{n}/{N}", "--ranks-per-node", K, "--micro-batch", M)
            made[packing] = run, dests
        return made[packing]

    return get


def _sums(root: Path, run: Path | None = None) -> dict[str, str]:
    """Every file under `root`, sha256; a slice's root manifest without the RUN it names."""
    out = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file() or p.name == "tokpack.lock":
            continue
        data = p.read_bytes()
        if run is not None and p == root / MANIFEST:
            root_manifest = json.loads(data)
            assert root_manifest.pop("source") == str(run.absolute())
            data = canonical_bytes(root_manifest)
        out[str(p.relative_to(root))] = hashlib.sha256(data).hexdigest()
    return out


def _assert_equal(tmp: Path, exchanged: Path, staged_run: Path, dests: list[Path], epochs: list[int]) -> None:
    """Each node's DEST holds `epochs` byte for byte as `stage --node n/2` (every file's sha256),
    RUN the manifests and row hashes of `tokpack shuffle` and the sidecar of 2 nodes."""
    for n, want in enumerate(dests):
        have = _sums(tmp / f"node{n}", exchanged)
        expected = {
            name: digest
            for name, digest in _sums(want, staged_run).items()
            if name == MANIFEST or int(name.split("/")[0].split("-")[1]) in epochs
        }
        if set(epochs) != {0, 1, 2}:  # the staged root lists every epoch; compare it below
            expected.pop(MANIFEST), have.pop(MANIFEST)
        assert have == expected, n
        root = json.loads((tmp / f"node{n}" / MANIFEST).read_text())
        assert root["ranks"] == [n * K + r for r in range(K)] and set(epochs) <= set(root["epochs"])
    files = {str(p.relative_to(exchanged)) for p in exchanged.rglob("*") if p.is_file() and p.name != "tokpack.lock"}
    sidecar = (exchanged / NODES_SIDECAR).read_bytes()
    assert sidecar == canonical_bytes(nodes_sidecar(N, K, M, str(tmp.absolute() / "node{node}")))  # N, not N*P
    files.discard(NODES_SIDECAR)
    assert files and all(f.endswith((MANIFEST, ROWS_SUFFIX, PAD_SUFFIX)) for f in files), sorted(files)
    for f in files:
        if f != MANIFEST:
            assert (exchanged / f).read_bytes() == (staged_run / f).read_bytes(), f
    assert not any((tmp / f"node{n}" / ".tokpack-work").exists() for n in range(N))  # every process's scratch gone


def _run(tmp: Path, args: list, n: int = N * P, procs: int = P, env: dict | None = None):
    done = to_nodes(tmp / "exchanged", str(tmp / "node{node}"), *args, "--procs-per-node", procs, n=n, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted((s["node"], s["process"]) for s in lines) == [(q // procs, q % procs) for q in range(n)]
    return lines


# The modules that hash source bytes: --keep-sources as it copies or verifies a shard; the
# exchange's reads (windows: ShardHashes, fed the blocks read; best-fit: each shard mapped whole).
KEPT, READS = "tokpack.packer.kept_sources", ("tokpack.shuffle.epoch_job", "tokpack.packer.node_epoch")


@pytest.mark.parametrize("packing", ["concat", "best-fit"])
def test_each_source_byte_is_hashed_once_an_epoch_with_kept_sources(source, staged, tmp_path, packing):
    """Issue 41 item 2, "each byte is hashed once": a shard --keep-sources hashed just now, as it
    copied or verified it, is not hashed again by the epoch's reads (each process's xxh3_128 feeds
    counted by module, tests/audit_site). One command of epochs 0-1: epoch 0's copies are hashed
    as they are made and its reads hash nothing; epoch 1's copies, verified earlier in the command,
    are not hashed again before it, so its reads hash every source shard once. A later command's
    epoch 2 hashes each kept file as it verifies it, and its reads nothing. Every epoch still equals
    shuffle + stage --node n/2 (on main, the reads hash every shard in every epoch)."""
    run, dests = staged(packing)
    keep = ["--keep-sources", str(tmp_path / "kept{node}"), "--memory", IN_MEMORY]
    shard_bytes = sum(p.stat().st_size for p in source.glob("*.ds"))
    logs = [tmp_path / "hashed-0.log", tmp_path / "hashed-1.log"]
    lines = _run(tmp_path, [*_args(source, packing, "--epochs", 2), *keep], env=_hash_env(logs[0]))
    kept = sum(s["epochs_detail"][0]["source_bytes_kept_now"] for s in lines)
    assert all(d["source_bytes_kept_now"] == 0 for s in lines for d in s["epochs_detail"][1:])
    fed = hashed(logs[0])
    assert fed.get(KEPT) == kept > 0
    assert sum(fed.get(m, 0) for m in READS) == shard_bytes  # epoch 1's reads, each shard once
    _run(tmp_path, [*_args(source, packing, "--epoch", 2), *keep], env=_hash_env(logs[1]))
    fed = hashed(logs[1])
    files = [p for n in range(N) for p in (tmp_path / f"kept{n}").glob("*/*.ds*") if p.suffix in (".ds", ".index")]
    assert fed.get(KEPT) == sum(p.stat().st_size for p in files) >= shard_bytes
    assert sum(fed.get(m, 0) for m in READS) == 0
    _assert_equal(tmp_path, tmp_path / "exchanged", run, dests, [0, 1, 2])


def _hash_env(log: Path) -> dict:
    return {"PYTHONPATH": os.pathsep.join([str(REPO), AUDIT_SITE]), "TOKPACK_HASH_LOG": str(log)}


@pytest.mark.parametrize("memory", [IN_MEMORY, OUT_OF_CORE])
@pytest.mark.parametrize("packing", ["concat", "best-fit"])
def test_two_nodes_of_two_processes_equal_shuffle_then_stage_node(source, staged, tmp_path, packing, memory):
    """4 processes as 2 nodes x 2, two epochs: each node's DEST is byte for byte `stage --node
    n/2`'s; each process wrote its ranks' files (rank r by process (r - a) mod 2) and moved its
    part of the rows; out of core, through bucket files in its own scratch."""
    run, dests = staged(packing)
    lines = _run(tmp_path, [*_args(source, packing, "--epochs", 2), "--memory", memory])
    _assert_equal(tmp_path, tmp_path / "exchanged", run, dests, [0, 1])
    for s in lines:
        assert s["nodes"] == N and s["procs_per_node"] == P and s["ranks"] == [s["node"] * K, s["node"] * K + 1]
        for d in s["epochs_detail"]:
            assert d["rows_kept"] > 0 and d["rounds"] >= 1
            assert (d["buckets"] > 0) == (memory == OUT_OF_CORE), d
    # a node's rows: its two processes' together, each row once
    for n in range(N):
        for e in (0, 1):
            rows = sum(s["epochs_detail"][e]["rows_kept"] for s in lines if s["node"] == n)
            slice_epoch = json.loads((tmp_path / f"node{n}" / f"epoch-0000{e}" / MANIFEST).read_text())
            assert rows == sum(sh["samples"] for sh in slice_epoch["shards"])


@pytest.mark.parametrize("packing", ["concat", "best-fit"])
def test_a_later_epoch_from_the_nodes_kept_sources_whatever_p_was_before(source, tmp_path, packing):
    """--keep-sources is a folder a node: epoch 0 as 2 nodes x 2 keeps each process's source
    shards there (its leader the manifests, best-fit's document indexes and the record, once);
    epoch 1, the shared shards overwritten, reads the kept copies alone; epoch 2, the shards
    back, as 2 nodes x 1 from the same folders; a rerun of epoch 0 as 2 x 2 skips it. Every
    epoch equals shuffle + stage --node n/2."""
    work = tmp_path / "src"  # a copy of its own: its shards are overwritten below
    shutil.copytree(source, work)
    run = tmp_path / "run"  # RUN's manifests name the sources' paths: shuffled from this copy
    cli("shuffle", *_args(work, packing, "--epochs", 3), "-o", run)
    dests = [tmp_path / f"staged{n}" for n in range(N)]
    for n, d in enumerate(dests):
        cli("stage", run, d, "--node", f"{n}/{N}", "--ranks-per-node", K, "--micro-batch", M)
    keep = ["--keep-sources", str(tmp_path / "kept{node}"), "--memory", IN_MEMORY]
    lines = _run(tmp_path, [*_args(work, packing, "--epoch", 0), *keep])
    shard_bytes = sum(p.stat().st_size for p in work.glob("*.ds"))
    kept = sum(s["epochs_detail"][0]["source_bytes_kept_now"] for s in lines)
    assert shard_bytes <= kept < 2 * shard_bytes  # each process its part, and the shard after it at most once a node
    for n in range(N):
        assert (tmp_path / f"kept{n}" / "kept-sources.json").is_file()
        assert not [p for p in (tmp_path / f"kept{n}").rglob("*") if ".tmp-" in p.name]
    saved = {p: p.read_bytes() for p in work.glob("*.ds")}
    for p in saved:
        p.write_bytes(bytes(p.stat().st_size))  # any read of a shared shard fails its checksum
    lines = _run(tmp_path, [*_args(work, packing, "--epoch", 1), *keep])
    assert all(s["epochs_detail"][0]["source_bytes_kept_now"] == 0 for s in lines)
    for p, data in saved.items():
        p.write_bytes(data)
    _run(tmp_path, [*_args(work, packing, "--epoch", 2), *keep], n=N, procs=1)
    _assert_equal(tmp_path, tmp_path / "exchanged", run, dests, [0, 1, 2])
    lines = _run(tmp_path, [*_args(work, packing, "--epoch", 0), *keep])
    assert all(s["skipped"] == [0] and not s["epochs_detail"] for s in lines), lines
    _assert_equal(tmp_path, tmp_path / "exchanged", run, dests, [0, 1, 2])


def test_four_nodes_of_one_process_are_unchanged(source, staged, tmp_path):
    """--procs-per-node 1 (the default on one host): 4 processes are 4 nodes, each its own DEST,
    as `stage --node n/4`; RUN's files but for its sidecar (4 nodes) those of 2 nodes x 2."""
    run, _ = staged("concat")
    args = [*_args(source, "concat", "--epochs", 2), "--memory", IN_MEMORY]
    lines = _run(tmp_path, args, procs=1)
    assert all(s["procs_per_node"] == 1 and s["process"] == 0 and s["nodes"] == 4 for s in lines)
    for n in range(4):
        staged_n = tmp_path / f"staged{n}"
        cli("stage", run, staged_n, "--node", f"{n}/4", "--ranks-per-node", K, "--micro-batch", M, "--epochs", "0-1")
        assert {k: v for k, v in _sums(tmp_path / f"node{n}", tmp_path / "exchanged").items() if k != MANIFEST} == {
            k: v for k, v in _sums(staged_n, run).items() if k != MANIFEST
        }
    assert json.loads((tmp_path / "exchanged" / NODES_SIDECAR).read_text())["nodes"] == 4
    files = [
        p for p in (tmp_path / "exchanged").rglob("*") if p.is_file() and p.name not in ("tokpack.lock", NODES_SIDECAR)
    ]
    assert files and all(p.name.endswith((MANIFEST, ROWS_SUFFIX)) for p in files)
    for p in files:
        if p.name != MANIFEST or p.parent.name.startswith("epoch-"):  # RUN's own lists only epochs 0-1
            assert p.read_bytes() == (run / p.relative_to(tmp_path / "exchanged")).read_bytes(), p


def test_a_world_not_a_multiple_of_the_procs_per_node_is_refused_in_one_line(source, tmp_path):
    """3 processes as nodes of 2: every process refuses, before anything is written."""
    done = to_nodes(
        tmp_path / "run",
        str(tmp_path / "node{node}"),
        *_args(source, "concat", "--epoch", 0),
        "--procs-per-node",
        2,
        n=3,
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = {line for line in done.stderr.splitlines() if line.startswith("tokpack: error:")}
    assert len(lines) == 1, done.stderr[-3000:]
    line = lines.pop()
    assert "the world of 3 processes is not nodes of 2 processes each" in line and "--procs-per-node" in line
    assert "ppr:P:node" in line
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob("node*"))


def test_p_from_the_launcher_is_the_processes_a_host_in_blocks_else_one():
    """Each process's host (named by its first process): P is the count a host when the hosts
    are several blocks of as many; one host (tests, --oversubscribe), uneven or interleaved hosts: 1."""
    assert launcher_procs([0, 0, 0, 0, 4, 4, 4, 4]) == 4
    assert launcher_procs([0, 0, 2, 2, 4, 4]) == 2
    assert launcher_procs([0, 0, 0, 0]) == 1  # one host
    assert launcher_procs([0, 1, 0, 1]) == 1  # round robin (--map-by node)
    assert launcher_procs([0, 0, 0, 3]) == 1  # uneven
    assert launcher_procs([0, 0, 2, 2, 2, 2]) == 1  # a host of two blocks
    assert launcher_procs([0]) == 1


def _epoch(procs: tuple[int, int], node: int = 0, nodes: int = 3, k: int = 4, m: int = 2):
    """A NodeEpoch of 200 samples in shards of 16 (no sources: routes and positions only)."""
    from types import SimpleNamespace

    from tokpack.formats.slices import RankRows
    from tokpack.packer.node_epoch import NodeEpoch
    from tokpack.shuffle.plan import PLAN_ALGORITHM

    samples, shard = 200, 16
    job = SimpleNamespace(
        plan=SimpleNamespace(samples=samples, algorithm=PLAN_ALGORITHM, row_tokens=8),
        row_bytes=16,
        n_shards=-(-samples // shard),
        shard_samples=shard,
        shard_range=lambda i: (i * shard, min(samples, (i + 1) * shard)),
        token_dtype=np.dtype(np.uint16),
    )
    ranks = (node * k, node * k + k - 1)
    return NodeEpoch(job, [], RankRows(nodes * k, m, 0), 7, node, nodes, ranks, {}, procs)


def test_a_row_reaches_its_node_once_at_the_process_writing_its_ranks_file():
    """3 nodes of 2 processes, 4 ranks a node: each row goes once, to one process of the node
    whose ranks read it (process p writes ranks a+p, a+p+2), not to its shard's owner (process
    i mod 6, which gets its facts later); the node's processes' positions split the node's as
    P = 1 keeps them; owned shards spread."""
    from tokpack.packer.pieces import WIRE_PIECE

    whole = [_epoch((0, 1), n) for n in range(3)]
    parts = {(n, p): _epoch((p, 2), n) for n in range(3) for p in range(2)}
    for n in range(3):
        mine = [parts[n, p].positions for p in range(2)]
        assert sorted(np.concatenate(mine).tolist()) == whole[n].positions.tolist()
        assert not set(mine[0].tolist()) & set(mine[1].tolist())
        for p in range(2):
            ranks = whole[n].rows.rank_of(parts[n, p].positions + 7)
            assert set(ranks.tolist()) <= set(parts[n, p].mine) and list(parts[n, p].mine) == [4 * n + p, 4 * n + p + 2]
    pieces = np.zeros(200, WIRE_PIECE)
    pieces["g"] = np.arange(200)
    dest, which = parts[0, 0].routes(pieces)
    for g in range(200):
        to = dest[which == g].tolist()
        node = int(whole[0].node_of(np.array([g]))[0])
        keeper = [q for q in to if q // 2 == node and g in parts[node, q % 2].positions]
        owner = (g // 16) % 6
        assert len(keeper) == 1 and to == keeper, (g, to)
        assert g // 16 in parts[owner // 2, owner % 2].owned  # the owner builds its shard's entry
    assert sorted(i for e in parts.values() for i in e.owned) == list(range(13))
    # P = 1: to the node only (the shard's owner node, shard i: node i mod N, gets its facts)
    dest, which = whole[0].routes(pieces)
    assert dest[which == 5].tolist() == [int(whole[0].node_of(np.array([5]))[0])]


def test_a_failure_names_the_node_and_its_process(source, tmp_path):
    """--memory is the node's: 2 processes a node each plan with half, and too little is one
    line a process, naming its node (not its world rank) and which of the node's processes."""
    done = to_nodes(
        tmp_path / "run",
        str(tmp_path / "node{node}"),
        *_args(source, "concat", "--epoch", 0),
        "--memory",
        "20KiB",
        "--procs-per-node",
        P,
        n=N * P,
        every_line=True,
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("tokpack: error:")]
    for q in range(N * P):
        mine = [line for line in lines if f"node {q // P} (process {q % P}): this process's rows of epoch 0" in line]
        assert len(mine) == 1, lines
        assert "found 10240 bytes (--memory / 2: the node's processes share it)" in mine[0], mine
    assert not list(tmp_path.glob("node*/epoch-*/*.ds"))


class _World:
    """MPI's world as node_of_process sees it, from process `rank`, each process on `hosts[q]`
    (a host named by its first process): no MPI needed."""

    COMM_TYPE_SHARED = "shared"

    def __init__(self, rank: int, hosts: list[int]):
        self.rank, self.hosts = rank, hosts

    def Get_size(self):
        return len(self.hosts)

    def Get_rank(self):
        return self.rank

    def Split_type(self, kind, key):
        from types import SimpleNamespace

        members = [q for q, h in enumerate(self.hosts) if h == self.hosts[self.rank]]
        return SimpleNamespace(allgather=lambda q: members, Free=lambda: None)

    def allgather(self, value):  # each process's own first process on its host
        return [min(r for r, h in enumerate(self.hosts) if h == self.hosts[q]) for q in range(len(self.hosts))]

    def Split(self, color, key):
        return ("node", color)


def test_a_node_whose_processes_are_on_two_hosts_is_refused_on_every_process():
    """--procs-per-node 2 with processes dealt round robin over 2 hosts (`--map-by node`): node 0
    would be processes 0 and 1, on two hosts; every process refuses with the same line. In
    blocks (`--map-by ppr:2:node`) each process gets its node, process and node communicator."""
    from tokpack.formats.errors import TokpackError
    from tokpack.packer.node_procs import node_of_process
    from tokpack.packer.transport import process_name

    lines = set()
    for q in range(4):
        with pytest.raises(TokpackError) as e:
            node_of_process(_World, _World(q, [0, 1, 0, 1]), 2)
        lines.add(str(e.value))
    assert len(lines) == 1 and "the processes of node 0 are not on one host: processes 0 and 1" in lines.pop()
    for q in range(4):
        node = node_of_process(_World, _World(q, [0, 0, 2, 2]), None)  # P from the launcher: 2
        assert (node.n, node.p, node.N, node.P, node.local, process_name(node.q, node.P)) == (
            q // 2,
            q % 2,
            2,
            2,
            ("node", q // 2),
            f"node {q // 2} (process {q % 2})",
        )
    assert node_of_process(_World, _World(1, [0, 1, 0, 1]), None).P == 1  # round robin: each process a node
