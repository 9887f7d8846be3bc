"""`tokpack shuffle SOURCES... -o RUN --to-nodes DEST --ranks-per-node K --micro-batch M` (issue 33):
each epoch goes from the sources straight to the nodes' local disks, P processes per node under
MPI (`mpirun -n N*P --map-by ppr:P:node`, `srun`; issue 41: P from --procs-per-node or the
launcher, tokpack.packer.node_procs), and RUN on the shared filesystem gets only small files.
A node's processes share its DEST (its leader, process 0, locks it and writes its manifests),
its kept sources and its --memory (each plans with --memory / P); the bytes do not depend on P.

Process p of node n (world process q = n*P + p of N*P):

1. plans the epoch exactly as `tokpack shuffle` does (tokpack.shuffle.run.setup_run: the same
   plan, permutation and packing registry), so every process knows where every row goes;
2. reads a disjoint, contiguous part of the sources: the runs of whole source shards that
   tokpack.shuffle.steps.split_shards gives scatter task q of N*P, sequentially, verifying each
   source shard's xxh3_128 from the bytes it reads (ShardHashes, as the scatter pass does);
3. sends every row, tagged with its output position g, with `Alltoallv` in rounds whose buffers
   fit what its memory leaves beside the rows it keeps, once: to the node whose ranks read g
   (tokpack.formats.slices.RankRows: the arithmetic `stage --node` uses), at the process of that
   node that writes the file of g's rank (NodeEpoch.keeper_of, NodeEpoch.routes);
4. puts the rows it receives in training order, in memory when they fit, else out of
   core through bucket files in its scratch in DEST (tokpack.packer.node_store.Buckets: the scatter/order
   engine's Layout and best-fit bucket files, read back a bucket at a time), and writes its
   ranks' files of node n's slice into DEST through tokpack.packer.rank_files.RankFiles, the
   bytes `stage RUN DEST --node n/N` writes (in memory, windows: each row as soon as a round
   completes it, at its place, the files open since the rounds began: node_store.open_slice_files);
   the pass that writes each row's `.ds.rows` and `.ds.index` keeps its facts too (its xxh3-64,
   its EOS columns; tokpack.packer.owned_facts.KeptFacts), with its padding;
5. sends each row's facts to the owner of its epoch shard (shard i: world process i mod N*P),
   in rounds of small arrays (owned_facts.send_facts), and, as the owner of some epoch shards,
   builds each one's manifest entry from its rows' facts, checked as they arrive (each row once,
   from the process that keeps it), through the epoch shard writer (`hashed_only`: no token is
   asked for, its index only hashed), exactly as `tokpack shuffle` records it, and writes of it
   only the row hashes (`.ds.rows`, 8 bytes a sample, and a best-fit shard's `.ds.pad`), which go
   to RUN through its Output (owned_facts.OwnedShards). So RUN's epoch manifest is byte for
   byte the one `tokpack shuffle` writes, the slice's manifests are those `stage --node` writes,
   and RUN holds no token bytes. A row crosses the network once; its owner gets a few dozen
   bytes of it (the issue's 25 GB/s a node is not what binds), and holds none of its tokens.

Process 0 writes RUN's manifests (the epoch's after every owner's entries, then the run's);
then each node's leader reads them back (a few KiB from the shared filesystem) and commits its
slice epoch's manifest (its processes' rank files gathered over the node's communicator, in
rank order), then its slice's root. A best-fit epoch moves document pieces instead of
rows (a window is a piece of a whole row): every process builds the row table in its DEST's
scratch, and the rows are assembled, with their padding, where they arrive.

A rerun resumes (`_resumed_setup`): the epochs complete on every node are skipped, the others
written again on every node. `--keep-sources DIR` keeps each process's source shards on its
node's disk for the later epochs (a folder a node, whose shared files its leader keeps first).
`stage RUN DEST --node n/N` on such a RUN (a replacement node) is tokpack.packer.replacement:
the node's rows rebuilt from the sources, checked against RUN's row hashes.

SIGTERM to one process is one line naming its node, and which of its processes when it has
several (tokpack.packer.transport.OnSigterm); a SIGKILL is named by the launcher; a node stopped,
frozen or cut off for --stall-timeout is one line naming it (tokpack.packer.stall).

The modules, each one idea, data flowing one way: this one (the entry points, an epoch's steps
and what they report; node_procs: a node's P processes, their communicator) ->
tokpack.packer.node_epoch (what a process reads, keeps and owns, its pieces from the sources;
the memory plan) -> transport (MPI: failures as one line, the rounds), node_store (the node's
rows, in memory or out of core; write_slice_epoch), owned_facts (the rows' facts to their
owners, the owner's role), kept_sources (--keep-sources), stage_dest (DEST beside RUN),
rank_files and pieces. The replacement node (tokpack.packer.replacement) shares rank_files and
stage_dest.

Not yet (docs/COMMANDS.md, "Straight to the nodes"): a batch phase (`--start-sample`).
"""

from __future__ import annotations

import os
import resource
import shutil
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from tokpack.formats.errors import TokpackError
from tokpack.formats.guard import OutputLock, check_space, holder_name
from tokpack.formats.io.gate import read_limited
from tokpack.formats.io.progress_log import progress
from tokpack.formats.io.writes import write_bytes_atomic
from tokpack.formats.constants import EPOCH, MANIFEST, NODES_SIDECAR, WORK_DIR
from tokpack.formats.reading import canonical_bytes, parse_manifest
from tokpack.formats.names import epoch_dir_name
from tokpack.formats.builders import nodes_sidecar
from tokpack.formats.outputs import EpochShardFormat, LocalOutput, Output
from tokpack.formats.slices import RankRows, slice_epoch_manifest
from tokpack.packer.agreement import agree, agree_sources
from tokpack.packer.kept_sources import keep_sources, kept_copies, kept_folder
from tokpack.packer.stage_dest import (
    dest_template,
    finish_slice_root,
    local_dirs,
    node_dest,
    own_dest,
    read_raw,
    run_numbering,
    slice_epoch_here,
    slice_root_of_run,
)
from tokpack.packer.node_epoch import NodeEpoch, memory_plan, source_pieces
from tokpack.packer.node_procs import Node, node_of_process
from tokpack.packer.node_store import Buckets, InMemory, bucket_layout, open_slice_files, receive
from tokpack.packer.node_store import write_slice_epoch, write_through_pays
from tokpack.packer.owned_facts import KeptFacts, OwnedShards, send_facts
from tokpack.packer.phases import Phases, collecting, count, phase, process_cpu, timed
from tokpack.packer.rank_files import ready_epoch_dir
from tokpack.packer.stage_plan import slice_ranks
from tokpack.packer.stall import DEFAULT_STALL_TIMEOUT, StallWatch, progressed
from tokpack.packer.transport import OnSigterm, exchange_rounds, world
from tokpack.shuffle import packings
from tokpack.shuffle.sources import use_kept_sources
from tokpack.shuffle.run import run_summary
from tokpack.shuffle.run_setup import epoch_manifest_of, setup_run
from tokpack.shuffle.spec import ShuffleSpec
from tokpack.shuffle.steps import Layout


def exchange_epoch(
    comm, MPI, ne: NodeEpoch, per_round: int, layout: Layout | None = None, shown: bool = False, files=None
):
    """The rounds (tokpack.packer.transport.exchange_rounds) of this process's pieces
    (node_epoch.source_pieces), each to the process that keeps its row (NodeEpoch.routes), what
    arrives put in its store (node_store.receive; `files`, its rank files open for the rounds:
    node_store.open_slice_files, which are written as rows complete and removed if the rounds
    fail). Returns (the store: in memory, or bucket files by `layout`, both read by `rows(lo,
    hi)` in store_rows numbering; the slice's padding, rounds)."""
    job, row = ne.job, ne.plan.row_tokens
    pad_id = ne.plan.pad_id if ne.padded else 0
    stores = None

    def deliver(got_pieces, got_tokens):
        with phase("place" if layout is None else "bucket_write", got_tokens.nbytes):
            receive(ne, stores, pad, got_pieces, got_tokens)
        progressed()  # a round done: the heartbeats (tokpack.packer.stall) say how far this process is

    def routes(pieces):
        routed = ne.routes(pieces)
        count("route", int(pieces["length"][routed[1]].sum()) * job.token_dtype.itemsize)
        return routed

    try:
        stores = InMemory(ne, pad_id, files) if layout is None else Buckets(ne, layout, pad_id)
        # Tokens of each row still unfilled: 0 for every window at the end, a best-fit row's padding.
        pad = np.full(ne.store_rows, row, dtype=np.int64)
        with reading_bar(ne, shown) as bar:
            size = lambda item: int(item[0]["length"].sum(dtype=np.int64)) * job.token_dtype.itemsize  # noqa: E731
            reads = counted(timed("cut", source_pieces(ne, per_round, layout is None), size), bar, size)
            with phase("route"):
                rounds = exchange_rounds(comm, MPI, reads, per_round, row, job.token_dtype, routes, deliver, ne.procs)
        stores.finish()
        stores.close()
        if len(pad) and (pad.min() < 0 or (not ne.padded and pad.max() > 0)):
            raise TokpackError(
                "internal error: the exchange filled a row of this node wrongly",
                where=f"epoch {job.plan.epoch}",
                hint="report this with the command line",
            )
    except BaseException:
        if stores is not None:  # its writes behind stopped before its files are removed
            stores.close(failed=True)
        if files is not None:
            files.abort()
        raise
    return stores, pad, rounds


def _same_padding(sums, padding: int, epoch: int) -> None:
    if sums[0] != padding or sums[1] != padding:
        raise TokpackError(
            "internal error: the exchange's rows do not hold the row table's padding",
            where=f"epoch {epoch}",
            expected=padding,
            found=sums,
            hint="report this with the command line",
        )


def shuffle_to_nodes(spec: ShuffleSpec, *, log=None) -> dict:
    """Process n of MPI's N writes node n's slice of each epoch of `spec` into its
    `spec.nodes.dest` (`{node}` -> n); RUN (`spec.output`) gets the run's manifests and row hashes.
    `spec.nodes.keep_sources`: a local folder (`{node}` -> n) where the process keeps the source
    shards it reads, and reads them from in later epochs. Returns this process's summary."""
    stop = OnSigterm()
    try:
        return _shuffle_to_nodes(stop, spec, log)
    finally:
        stop.restore()


def _shuffle_to_nodes(stop: OnSigterm, spec: ShuffleSpec, log) -> dict:
    output, dest, keep_sources = spec.output, spec.nodes.dest, spec.nodes.keep_sources
    MPI, comm = world()
    agree(comm, spec)  # before anything is written (and before the node's layout): every process runs this spec
    node = node_of_process(MPI, comm, spec.nodes.procs_per_node)
    n, N = node.n, node.N
    stop.attach(MPI, comm, node.P)
    log = log if node.q == 0 else None  # process 0's lines and bars stand for every node's
    t0 = time.perf_counter()
    a, b, w = slice_ranks(node=f"{n}/{N}", ranks_per_node=spec.nodes.ranks_per_node, micro_batch=spec.nodes.micro_batch)
    local_dirs("--to-nodes/-o", dest, output)  # as given: a Path made of s3://b/d is a local s3:/b/d
    template = dest_template(dest)
    dest = node_dest(dest, n)
    out = Path(output)
    # A process's scratch (buckets, row table, owned shards on their way): DEST's, its own
    # folder there when the node's processes share DEST
    scratch = dest / WORK_DIR if node.P == 1 else dest / WORK_DIR / f"process-{node.p}"
    locks, mine = stop.locks, []
    stall = spec.nodes.stall_timeout
    watch = StallWatch(MPI, comm, DEFAULT_STALL_TIMEOUT if stall is None else stall, stop, node.P)
    try:

        def lock():  # the node's DEST is its leader's to lock
            if node.q == 0:
                locks.append(OutputLock(str(out), holder_name("shuffle")).acquire())
            if node.leader:
                locks.append(OutputLock(str(dest), holder_name("shuffle")).acquire())
                mine.append(dest / WORK_DIR)

        # before any write
        keep = node.together(lambda: kept_folder(keep_sources, n, dest, out, spec.sources, spec.schedule))
        node.together(lock)
        if not node.leader:
            mine.append(scratch)
        if keep is not None:  # kept copies from an earlier epoch: planned from them, the shared source folders unread
            node.together(lambda: use_kept_sources(kept_copies(keep, out)))
        return _run(node, spec, out, (dest, scratch), template, (a, b), w, keep, log, t0)
    finally:
        watch.close()
        for d in mine:  # DEST is this command's: its scratch (buckets, row table) goes, whatever happened
            shutil.rmtree(d, ignore_errors=True)
        for held in reversed(locks):
            held.release()


def _resumed_setup(node: Node, out: Path, dest: Path, ranks, w, micro_batch, sources, options):
    """setup_run on every process, after a rerun's bookkeeping: an epoch RUN lists but some node
    lacks (killed before its slice was committed) is written again, whole, on every node, with
    the same bytes: process 0 withdraws its RUN epoch manifest first (rewritten identically)."""
    previous = node.together(lambda: own_dest(dest, out, ranks, w, micro_batch))
    setup = node.together(lambda: setup_run(sources, str(out), to=LocalOutput(), **options))
    # before a rerun's bookkeeping writes: every node reads the same data
    agree_sources(node.comm, setup.sources, node.P)
    numbering = run_numbering(setup, out)
    written = [(e, plan) for e, plan, job in setup.todo if job is None]
    here = node.together(
        lambda: [
            slice_epoch_here(out, dest, e, numbering.first(e), plan.samples, ranks, w, micro_batch)
            for e, plan in written
        ],
    )
    everywhere = np.logical_and.reduce(
        np.array(node.comm.allgather(here), dtype=bool).reshape(node.comm.Get_size(), -1), axis=0
    )
    again = [e for (e, _), ok in zip(written, everywhere.tolist()) if not ok]
    if again:
        if node.q == 0:
            for e in again:
                LocalOutput().unfinish(out / epoch_dir_name(e))
        node.comm.Barrier()
        setup = node.together(lambda: setup_run(sources, str(out), to=LocalOutput(), **options))
    return setup, previous


def _declare_nodes(out: Path, nodes: int, k: int, micro_batch: int, dest: str) -> None:
    """Before any epoch: RUN says its tokens are on the nodes (validate then expects no token
    file in its epochs; without this sidecar, token files that are not there are missing)."""
    out.mkdir(parents=True, exist_ok=True)
    sidecar = canonical_bytes(nodes_sidecar(nodes, k, micro_batch, dest))
    path = out / NODES_SIDECAR
    if not path.is_file() or read_limited(path, 1 << 16, "sidecar") != sidecar:
        write_bytes_atomic(path, sidecar)


def _run(node: Node, spec: ShuffleSpec, out: Path, dests, template: str, ranks, w, keep, log, t0) -> dict:
    comm, MPI, n, N, P = node.comm, node.MPI, node.n, node.N, node.P
    dest, scratch = dests
    shown, log = log is not None, log or (lambda line: None)
    # --memory is the node's: each of its P processes plans with its share
    k, micro_batch, memory = spec.nodes.ranks_per_node, spec.nodes.micro_batch, spec.memory // P
    # one process a node plans alone (workers=1), and says nothing of its progress
    sources, options = spec, {"workers": 1, "progress": False}
    setup, previous = _resumed_setup(node, out, dest, ranks, w, micro_batch, sources, options)
    rows = RankRows(w, micro_batch, 0)
    output: Output = LocalOutput()  # DEST is on the node
    numbering = run_numbering(setup, out)
    done_epochs = list(setup.done_epochs)
    node.together(lambda: _declare_nodes(out, N, k, micro_batch, template) if node.q == 0 else None)
    # a schedule's numbering, fixed at creation (process 0 alone writes RUN's manifest)
    if node.q == 0 and setup.run_params is not None and setup.todo and not (out / MANIFEST).exists():
        output.finish(out, setup.run_manifest({}, setup.todo[0][1]))
    summaries, skipped = [], []
    among = f"{N} nodes" if P == 1 else f"{N} nodes of {P} processes"
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
        job = replace(job, work_dir=str(scratch / Path(job.work_dir).name))
        report = plan.source_report()  # before the epoch's table, as a plain shuffle's summary counts it
        packing = packings.of_plan(plan)
        prepared = node.together(lambda: packing.prepare(job, memory))  # every process builds the same table
        fmt = EpochShardFormat(job.token_dtype, plan.seq_len, job.eos_id, job.tokenizer, padded=packing.padded)
        ne = NodeEpoch(job, job.open_sources(), rows, first, n, N, ranks, prepared, (node.p, P))
        kept = _keep(node, ne, keep)
        per_round, bucket_rows = node.together(lambda: memory_plan(ne, memory))
        layout = bucket_layout(ne, bucket_rows, Path(job.work_dir))
        disk = node.local.allreduce(ne.disk_bytes(layout is not None))  # the node's processes share DEST
        node.together(lambda: check_space([(dest, disk)], "shuffle", hint="free some space on this node's DEST"))
        d = dest / epoch_dir_name(epoch)
        if P > 1:  # the node's epoch folder readied once, before its processes open their rank files there
            node.together(lambda: ready_epoch_dir(output, d) if node.leader else None)
        phases, cpu0 = Phases(), process_cpu()  # this epoch's CPU by phase (tokpack.packer.phases)
        # in memory, windows, where the host has the cores: the rank files written during the
        # rounds (node_store.open_slice_files, write_through_pays)
        through = write_through_pays(os.cpu_count(), node.on_host)
        files = node.together(lambda: open_slice_files(output, d, ne, fmt, layout, through))
        with collecting(phases):
            stores, keep_pad, rounds = node.together(
                lambda: exchange_epoch(comm, MPI, ne, per_round, layout, shown, files)
            )
        log(f"shuffle --to-nodes: epoch {epoch}: {plan.samples} samples exchanged among {among} in {rounds} rounds")
        log(f"shuffle --to-nodes: epoch {epoch}: writing the slice's rank files, then the owned shards' entries")
        facts = KeptFacts(ne.positions)  # each row's facts, from the rank files' pass over it

        def write():
            with phase("write", len(ne.positions) * job.row_bytes):
                entries = write_slice_epoch(output, d, ne, stores, keep_pad, fmt, files, facts)
                facts.finish()
            return entries, OwnedShards(job, fmt, Path(job.work_dir) / "owned", Path(job.epoch_dir))

        def owners():  # the owner's role: each owned shard's entry from its rows' facts, its row hashes to RUN
            with phase("facts", ne.owned_rows * job.row_bytes):
                send_facts(comm, MPI, ne, facts, keep_pad, owned)

        with collecting(phases):
            entries, owned = node.together(write)
            stores = None  # freed before the owned shards' entries
            node.together(owners)
        if fmt.padded:  # every row is some node's and some owner's: both sums are the table's padding
            sums = comm.allreduce(np.array([keep_pad.sum(), owned.padding], dtype=np.int64)).tolist()
            node.together(lambda: _same_padding(sums, prepared["padding"], epoch))
        shutil.rmtree(scratch, ignore_errors=True)
        gathered = comm.gather(owned.entries, root=0)
        # the node's rank files, each process's, in rank order: the slice epoch manifest lists them so
        node_entries = sorted((e for part in node.local.allgather(entries) for e in part), key=lambda e: e["rank"])

        done_epochs = sorted(set(done_epochs) | {epoch})

        def run_manifests():  # process 0's
            by_shard = dict(entry for part in gathered for entry in part)
            manifest = epoch_manifest_of(job, [by_shard[i] for i in range(job.n_shards)], prepared)
            output.finish(job.epoch_dir, manifest)
            output.finish(out, setup.written_run_manifest(out, plan, done_epochs))

        node.together(lambda: run_manifests() if node.q == 0 else None)

        raw = node.together(lambda: read_raw(Path(job.epoch_dir) / MANIFEST))  # RUN's epoch manifest, as written
        manifest = node.together(lambda: parse_manifest(raw, job.epoch_dir, EPOCH))

        def commit_slice_epoch():  # the node's leader's, once every process of it wrote its rank files
            root = slice_root_of_run(out, ranks, w, micro_batch)[1]
            want = slice_epoch_manifest(root, epoch, plan.samples, first, raw)
            want["shards"] = node_entries
            want["tokens"] = sum(s["tokens"] for s in node_entries)
            output.finish(d, want)

        node.together(lambda: commit_slice_epoch() if node.leader else None)
        # A plain shuffle's epochs_detail entry (run_epoch's), its bytes those of this node's
        # slice, then what only a node has (its rounds, buckets...).
        summaries.append(
            {
                "epoch": job.plan.epoch,
                "path": "to-nodes",  # where the epoch's tokens went
                "samples": job.plan.samples,
                "shards": job.n_shards,
                "shards_reused": 0,
                "bytes_written": sum(int(e["bytes"]) for e in entries),
                "sample_multiset_hash": manifest["sample_multiset_hash"],
                "packing": packings.shown(manifest),
                "stage": setup.runplan.stage_name(epoch),
                "sources": report,
                "rounds": rounds,
                "buckets": 0 if layout is None else len(layout.bucket_starts) - 1,  # 0: in memory
                "rows_kept": sum(s["samples"] for s in entries),  # this process's (its node's, P = 1)
                "source_bytes_kept_now": kept,
                "tokens_kept": sum(s["tokens"] for s in entries),
                "seconds": round(time.perf_counter() - e0, 3),
                "phases": phases.summary(process_cpu() - cpu0),
            }
        )

    def commit_root():  # the node's leader's
        root = slice_root_of_run(out, ranks, w, micro_batch)[1]
        return finish_slice_root(output, dest, root, set(previous) | set(skipped) | {s["epoch"] for s in summaries})

    final = node.local.bcast(node.together(lambda: commit_root() if node.leader else None), root=0)
    log(
        f"shuffle --to-nodes: {N} node slices of ranks {k} a node{'' if P == 1 else f', {P} processes a node'}, "
        f"epochs {final['epochs']}; RUN {out} holds the manifests and row hashes"
    )
    seconds = time.perf_counter() - t0
    summary = run_summary(setup, str(out.absolute()), final["epochs"], summaries, skipped, seconds)
    del summary["seconds"], summary["epochs_detail"]  # this report's are last, after the node's own
    return {
        "ok": True,  # first, as every command's --json (docs/COMMANDS.md); a script tests it whatever it ran
        **summary,
        "node": n,
        "nodes": N,
        "process": node.p,
        "procs_per_node": P,
        "dest": str(dest),
        "run": str(out),
        "ranks": final["ranks"],
        "world_size": w,
        "micro_batch": micro_batch,
        "epochs_detail": summaries,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
        "cpu_s": round(process_cpu(), 3),  # user+sys of every thread since the process started (its epochs' "phases")
        "seconds": round(seconds, 3),
    }


def _keep(node: Node, ne: NodeEpoch, keep: Path | None) -> int:
    """--keep-sources: this process's source shards (NodeEpoch.kept_shards) kept in `keep`, its
    node's folder (tokpack.packer.kept_sources), with the files every process of the node reads
    (the sources' manifests, a best-fit epoch's document indexes, the folder's record), kept by
    its leader first; from then on the epoch reads the sources there, not on the shared
    filesystem. Returns the bytes copied now."""
    if keep is None:
        return 0

    def kept(need: dict, shared: bool) -> int:
        ne.sources, copied = keep_sources(ne.sources, need, ne.padded, keep, shared)
        return copied

    copied = 0
    if node.P > 1:  # the others open the copies by the sources' manifests there
        copied = node.together(lambda: kept({}, True) if node.leader else 0)
    return copied + node.together(lambda: kept(ne.kept_shards(), node.P == 1))


# What `shuffle --to-nodes` reports (issue 42, item 5): what `tokpack shuffle` reports of the same
# epochs (the summary's fields, each epoch's per-source counts and packing figures, the warnings
# of sources drawn more than once), beside what only a node has (its slice, its rounds), and the
# progress of the epoch's phases while they run (a bar on a terminal, lines in a log: node 0's,
# whose share stands for every node's).


def reading_bar(ne, shown: bool):
    """The exchange's bar over the tokens this process reads and sends: of each source, the rows
    the epoch takes of it in proportion to this process's share of its tokens (exact for windows,
    about right for best-fit's documents)."""
    if not shown:
        return progress(None, "", enabled=False)
    share: dict[int, int] = {}
    for s, k0, k1 in ne.runs():
        share[s] = share.get(s, 0) + sum(int(ne.sources[s].shards[k]["tokens"]) for k in range(k0, k1))
    rows = 0.0
    for s, r in enumerate(ne.plan.source_report()):
        every = sum(int(sh["tokens"]) for sh in ne.sources[s].shards)
        rows += r["samples"] * share.get(s, 0) / every if every else 0
    total = int(rows * ne.job.row_bytes)
    return progress(total, f"shuffle --to-nodes: epoch {ne.plan.epoch}: read and exchange (node {ne.node})")


def counted(reads, bar, size):
    """`reads` as they pass, each item's `size(item)` bytes counted on `bar`."""
    for item in reads:
        bar.update(size(item))
        yield item
