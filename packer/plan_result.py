"""What `tokpack plan` returns (`PlanResult`) and how it predicts a time: the disk's throughput,
given or measured next to the output (`measure_disk`, the only file a plan touches), each pass's
seconds at that throughput over the tasks that run at once, and the start-up costs; the paths a
plan takes (local only); and the text it prints (`report_lines`: a PlanResult as lines for
humans, with a table of the nodes for plan shuffle --to-nodes). tokpack.packer.planning and
plan_nodes build on it.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tokpack.formats.errors import TokpackError
from tokpack.formats.guard import space_needs
from tokpack.formats.io.paths import local_path
from tokpack.formats.units import counted
from tokpack.packer.shared import ExecutorConfig, Result, optional_field

MEASURE_BYTES = 256 << 20  # at most this much is written, then read back, to measure the disk
MEASURE_SECONDS = 1.0  # per direction
MEASURE_BLOCK = 8 << 20
# Decoding a Parquet list column runs at about this many values a second per core (BENCHMARKS.md,
# "Parquet decoded row group by row group in parallel": 150-190 MB/s of list<uint16>): a pack of
# Parquet is CPU-bound, not disk-bound, and a plan that counted bytes only predicted 1 s for 16 s.
PARQUET_VALUES_PER_CORE_S = 80e6
# Start-up, which dominates a small run (BENCHMARKS.md): the command itself ("tokpack pack
# start-up", 0.44 s), and each pass run through datatrove's executor rather than in the
# command's process ("datatrove executor start-up", 1.5-2 s: its import, its manager, the workers).
COMMAND_START_SECONDS = 0.5
EXECUTOR_START_SECONDS = 1.75


@dataclass
class PlanResult(Result):
    """What `tokpack plan ... --json` prints."""

    command: str  # shuffle | pack | stage
    output: str
    path: str  # shuffle: in-memory and/or out-of-core; pack: the input format; stage: the kind copied
    shards: int  # output shards (pack: at least this many, or 0 when the inputs' token counts are unknown)
    passes: list[dict]  # in order: name, epoch (shuffle), tasks, memory_per_task (pack: null), read_bytes,
    # written_bytes, decode_seconds (pack of Parquet: its CPU-bound list decoding), pack_seconds (shuffle
    # --packing best-fit: the "table" pass packing its documents on one core), seconds
    space: list[dict]  # per target filesystem: path, filesystem, needed_bytes, free_bytes, enough
    manifests: dict  # manifest file under the output -> bytes
    workers: int
    executor: str
    disk_mbps: float | None  # read + write throughput the prediction uses
    disk: str  # where disk_mbps comes from
    startup_seconds: float  # of predicted_seconds: the command's start, and datatrove's executor's per pass
    predicted_seconds: float | None
    samples_per_epoch: int | None = optional_field()  # shuffle: when every epoch planned has one size
    sources: list[dict] | None = optional_field()  # shuffle: per source of the first epoch planned
    epochs: list[dict] | None = optional_field()  # shuffle: per epoch asked for: its stage, samples, path, shards,
    # and per source what it takes (the `sources` of shuffle's epochs_detail)
    warnings: list[str] | None = optional_field()  # shuffle: the repeat warnings shuffle would give, and
    # an in-memory epoch larger than this machine's RAM
    buckets: int | None = optional_field()  # shuffle, out of core: over every epoch
    bucket_files: int | None = optional_field()  # at most: each scatter task writes 2 files per bucket its rows reach
    holdout: dict | None = optional_field()  # shuffle --holdout: RUN/holdout/ when this command would write it
    bytes_per_node: int | None = optional_field()  # stage, node slice: bytes its rank files hold
    read_amplification: float | None = optional_field()  # stage, node slice: bytes read / bytes kept
    note: str | None = optional_field()  # stage: one line worth knowing before it runs (e.g. a whole-run copy)
    # pack: the shard files' bytes (.ds, .ds.index, .ds.loss) it copies; with --link, those it
    # hard-links (on the output's filesystem), those it reflinks where their filesystem allows
    # (else copies), each once its scan verifies it, and per input it copies, why
    copy_bytes: int | None = optional_field()
    link_bytes: int | None = optional_field()
    reflink_bytes: int | None = optional_field()
    link_notes: list[str] | None = optional_field()
    # shuffle --to-nodes DEST: the command's layout (dest, ranks_per_node, micro_batch, world_size,
    # keep_sources, memory), and per node (per_node) its bytes read from the shared filesystem and
    # from its disk, sent and received, its disk needed against its free space ("not visible"
    # where this machine does not see DEST), its seconds; RUN's small files (run_files); the
    # shared filesystem's throughput (aggregate, shared by the nodes reading at once) and the NIC's
    nodes: int | None = optional_field()
    to_nodes: dict | None = optional_field()
    per_node: list[dict] | None = optional_field()
    run_files: dict | None = optional_field()
    slowest_node: int | None = optional_field()
    shared_mbps: float | None = optional_field()
    shared: str | None = optional_field()
    nic_mbps: float | None = optional_field()


# ------------------------------------------------------------------------ the disk


def measure_disk(directory: Path) -> tuple[float | None, str]:
    """(MB/s, how it was found) of a sequential write, fsync'd, then a read of the same file
    with its pages dropped from the cache, in `directory`; the file is removed before return."""
    try:
        fd, name = tempfile.mkstemp(prefix=".tokpack-plan-", dir=directory)
        moved, block = 0, memoryview(os.urandom(MEASURE_BLOCK))
        try:
            os.unlink(name)  # gone from the directory at once; the open descriptor keeps the data
            t0 = time.perf_counter()
            while moved < MEASURE_BYTES and time.perf_counter() - t0 < MEASURE_SECONDS:
                moved += os.write(fd, block)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the read-back comes from the disk
            read, buf = 0, bytearray(MEASURE_BLOCK)
            while n := os.preadv(fd, [buf], read):
                read += n
            seconds = time.perf_counter() - t0
        finally:
            os.close(fd)
    except OSError as e:
        return None, f"not measured ({e.strerror or e} in {directory}); give --disk-mbps"
    return round(2 * moved / 1e6 / seconds, 1), f"measured: {moved >> 20} MiB written and read back in {directory}"


def planned_result(
    command: str,
    output: str,
    passes: list[dict],
    needs: list[tuple],
    config: ExecutorConfig,
    disk_mbps: float | None,
    own_workers: bool = False,
    **fields,
) -> PlanResult:
    """`passes` get their predicted seconds: tasks running at once on slurm or ray have a disk
    each, so there a pass of T tasks moves its bytes min(T, workers) times faster. `own_workers`: the
    command runs its `config.workers` itself (stage: threads, a replacement node: processes), never
    through datatrove's executor."""
    space = space_report(needs)
    mbps, disk = (float(disk_mbps), "given") if disk_mbps else measure_disk(Path(space[0]["filesystem"]))
    concurrent = config.executor != "local"
    for p in passes:
        at_once = 1 if not concurrent else p["tasks"] if config.workers == 1 else min(config.workers, p["tasks"])
        moved = p["read_bytes"] + p["written_bytes"]
        p["seconds"] = (
            None
            if mbps is None
            else round(max(moved / (mbps * 1e6) / at_once, p.get("decode_seconds") or p.get("pack_seconds") or 0), 1)
        )
    from tokpack.packer.executors import runs_in_process

    in_process = own_workers or runs_in_process(config)
    startup = COMMAND_START_SECONDS + (0 if in_process else EXECUTOR_START_SECONDS * len(passes))
    total = None if mbps is None else round(sum(p["seconds"] for p in passes) + startup, 1)
    return PlanResult(
        command=command,
        output=str(output),
        passes=passes,
        space=space,
        workers=config.workers,
        executor=config.executor,
        disk_mbps=mbps,
        disk=disk,
        startup_seconds=startup,
        predicted_seconds=total,
        **fields,
    )


def space_report(needs: list[tuple]) -> list[dict]:
    """Each target filesystem of `needs` ((path, bytes) pairs) with its free space: a plan's `space`."""
    return [
        {"path": str(p), "filesystem": str(w), "needed_bytes": n, "free_bytes": free, "enough": n <= free}
        for p, w, n, free in space_needs(needs)
    ]


def plan_pass(name: str, tasks: int, memory: int | None, read: int, written: int, **extra) -> dict:
    return {
        "name": name,
        **extra,
        "tasks": tasks,
        "memory_per_task": memory,
        "read_bytes": read,
        "written_bytes": written,
    }


def local_only(paths: list[str]) -> list[str]:
    """The local paths (`file://` URLs included) a plan reads or writes next to; other URLs are refused."""
    for p in paths:
        if local_path(p) is None:
            raise TokpackError(
                "tokpack plan reads local paths",
                file=p,
                expected="a local path or a virtual source",
                found="a URL",
                hint="plan with a local copy of the manifests, or a virtual: source",
            )
    return [local_path(p) for p in paths]


def size_text(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


# ------------------------------------------------------------------------ the text


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"


def repeated(source: dict) -> str:
    """'repeated' after an epoch's source's count of repeats (a plan's and shuffle's lines): a count
    of samples; a count in another unit names it (best-fit: pieces)."""
    unit = source.get("repeat_unit", "samples")
    return "repeated" if unit == "samples" else f"{unit} repeated"


def _written(r: PlanResult) -> str:
    """What a plan wrote: nothing, but when it measured a throughput, the probe's file (gone, but written)."""
    if not (r.disk.startswith("measured") or (r.shared or "").startswith("measured")):
        return "nothing written"
    skip = "--disk-mbps skips it" if r.per_node is None else "--disk-mbps and --shared-mbps skip it"
    return f"no output written (the disk probe wrote and read back a temporary file; {skip})"


def report_lines(r: PlanResult) -> list[str]:
    """The human summary of a plan; nothing has been written."""
    from tokpack.shuffle.packings import shown_line

    if r.per_node is not None:
        return _nodes_lines(r)

    shards = counted(r.shards, "shard")
    if r.command == "pack":
        shards = f"at least {shards}" if r.shards else "shards unknown (the inputs do not tell their token count)"
    lines = [f"plan {r.command} -> {r.output}: {r.path}, {shards}; {_written(r)}"]
    if r.samples_per_epoch is not None:
        lines.append(f"  samples per epoch: {r.samples_per_epoch:,}")
    tokens = {s["name"]: s["tokens"] for s in r.sources or []}
    for e in r.epochs or []:
        extra = ""
        if e["path"] == "out-of-core":
            extra = (
                f", {e['scatter_tasks']} scatter tasks, {e['buckets']:,} buckets (at most {e['bucket_files']:,} bucket "
                f"files), {size_text(e['scratch_bytes'])} scratch"
            )
        if "table_bytes" in e:
            extra += f", row table of ~{e['table_pieces']:,} pieces ({size_text(e['table_bytes'])} scratch)"
        stage = "" if e["stage"] is None else f" (stage {e['stage']})"
        lines.append(
            f"  epoch {e['epoch']}{stage}: {e['path']}, {e['samples']:,} samples, {e.get('shards', 0):,} shards" + extra
        )
        unit = e["packing"]["unit"] if "packing" in e else "windows"  # a best-fit pass's rows, or windows
        if "packing" in e:
            lines.append(f"    packing: {shown_line(e['packing'])}")
        lines += [
            f"    source {s['name']}: {s['samples']:,} samples of {s['windows']:,} {unit}"
            + " a pass" * (unit != "windows")
            + (f" ({tokens[s['name']]:,} tokens)" if s["name"] in tokens else "")
            + f", {counted(s['passes'], 'pass', plural='passes')} from pass {s['first_pass']}, {s['repeats']:,} "
            + repeated(s)
            for s in e["sources"]
        ]
    if r.holdout is not None:
        h = r.holdout
        lines.append(
            f"  holdout: {h['samples']:,} samples of held-out documents, {counted(h['shards'], 'shard')}, written "
            f"once to {h['path']} (" + ", ".join(f"{s['name']} {s['samples']:,}" for s in h["sources"]) + ")"
        )
    for p in r.passes:
        memory = "no set memory bound" if p["memory_per_task"] is None else f"{size_text(p['memory_per_task'])} memory"
        lines.append(
            f"  pass {p['name']}{'' if 'epoch' not in p else ' (epoch %d)' % p['epoch']}: "
            f"{counted(p['tasks'], 'task')}, {memory} per task, reads {size_text(p['read_bytes'])}, writes "
            f"{size_text(p['written_bytes'])}, {_duration(p['seconds'])}"
            + (f" (decoding Parquet: {_duration(p['decode_seconds'])})" if p.get("decode_seconds") else "")
            + (f" (packing: {_duration(p['pack_seconds'])})" if p.get("pack_seconds") else "")
        )
    for s in r.space:
        lines.append(
            f"  space on {s['filesystem']}: needs {size_text(s['needed_bytes'])} (scratch included), "
            f"{size_text(s['free_bytes'])} free: {'enough' if s['enough'] else 'NOT ENOUGH'}"
        )
    if r.bytes_per_node is not None:
        lines.append(
            f"  node slice: keeps {size_text(r.bytes_per_node)} on the node, reads "
            f"{size_text(r.passes[0]['read_bytes'])} (read amplification {r.read_amplification}x)"
        )
    if r.note:
        lines.append(f"  note: {r.note}")
    if r.copy_bytes is not None:
        lines.append(
            f"  shard files: copies {size_text(r.copy_bytes)}, links {size_text(r.link_bytes)} (hard links)"
            + (
                f", reflinks {size_text(r.reflink_bytes)} where its filesystem allows, else copies it"
                if r.reflink_bytes
                else ""
            )
        )
        lines += [f"    {note}" for note in r.link_notes or []]
    lines += [f"  manifest {name}: {n:,} bytes" for name, n in r.manifests.items() if n]
    lines.append(
        f"  predicted wall time: {_duration(r.predicted_seconds)} ({r.executor}, {counted(r.workers, 'worker')}, disk "
        f"{r.disk_mbps if r.disk_mbps is not None else '?'} MB/s {r.disk}; {r.startup_seconds:.1f} s of it "
        "start-up)"
    )
    return lines


# the node table's columns of bytes: heading -> field of a per_node entry
_NODE_SIZES = {
    "shared read": "shared_source_bytes",
    "local read": "local_source_bytes",
    "sent": "sent_bytes",
    "received": "received_bytes",
    "slice": "slice_bytes",
    "kept sources": "kept_source_bytes",
    "scratch": "scratch_bytes",
    "needs": "local_needed_bytes",
}


def _nodes_lines(r: PlanResult) -> list[str]:
    """plan shuffle --to-nodes: a line per epoch, a table of the nodes, RUN's files, the time."""
    t = r.to_nodes
    lines = [
        f"plan shuffle -> {r.output} --to-nodes {t['dest']}: {counted(r.nodes, 'node')} of {t['ranks_per_node']} ranks "
        f"(W = {t['world_size']}), micro-batch {t['micro_batch']}; {_written(r)}"
    ]
    for e in r.epochs:
        if e["path"] != "to-nodes":
            lines.append(f"  epoch {e['epoch']}: {e['path']}, {e['samples']:,} samples")
            continue
        rounds = (
            "rounds unknown (a node's rows do not fit --memory)"
            if e["rounds"] is None
            else (
                counted(e["rounds"], "exchange round")
                + ("" if e["rounds_exact"] else " at least" if e["rounds_bound"] == "at least" else " (estimated)")
            )
        )
        lines.append(
            f"  epoch {e['epoch']}: {e['packing']}, {e['samples']:,} samples, {e['shards']:,} epoch shards, {rounds}"
        )
    head = ("node", *_NODE_SIZES, "free", "time")
    table = [head]
    for p in r.per_node:
        space = p["space"]
        free = (
            "not visible"
            if space == "not visible"
            else ", ".join(f"{size_text(s['free_bytes'])}{'' if s['enough'] else ' NOT ENOUGH'}" for s in space)
        )
        sizes = [size_text(p[k]) for k in _NODE_SIZES.values()]
        table.append((str(p["node"]), *sizes, free, _duration(p["predicted_seconds"])))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    if any(not d["exchanged_exact"] for p in r.per_node for d in p["epochs"]):
        lines.append(
            "  (sent and received are estimates: of a best-fit epoch, whose row table that places each "
            "piece only the command builds; of a large epoch, from a sample of its windows)"
        )
    if any(p["out_of_core_bytes"] for p in r.per_node):
        lines.append(
            "  (scratch includes the bucket files of an out-of-core order: every row of the node's slice, "
            "with its record)"
        )
    f = r.run_files
    lines.append(
        f"  RUN (shared filesystem) gets {size_text(f['bytes'])}: manifests {f['manifests_bytes']:,} bytes, "
        f"row hashes {size_text(f['rows_bytes'])}"
        + (f", padding {size_text(f['pad_bytes'])}" if f["pad_bytes"] else "")
        + f", {f['nodes_sidecar_bytes']:,} bytes of sidecar; no token file"
    )
    slow = (
        ""
        if r.slowest_node is None
        else f"the slowest node's, node {r.slowest_node}, bound by {r.to_nodes['binding']}; "
    )
    lines.append(
        f"  predicted wall time: {_duration(r.predicted_seconds)} ({slow}shared filesystem "
        f"{r.shared_mbps if r.shared_mbps is not None else '?'} MB/s {r.shared}, for all nodes; "
        f"network {r.nic_mbps:g} MB/s a node; disk {r.disk_mbps if r.disk_mbps is not None else '?'} MB/s "
        f"{r.disk}; {r.startup_seconds:.1f} s of it start-up)"
    )
    return lines
