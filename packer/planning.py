"""`tokpack plan shuffle|pack|stage`: what the command would do, from the planning code the
command itself runs, with nothing written (docs/COMMANDS.md, "Planning a run").

Each plan_* function calls its command's own setup (tokpack.shuffle.run.setup_run and epoch_layout,
tokpack.packer.packing.setup_pack, tokpack.packer.staging.make_plan) and byte counts, then predicts the wall
time: each pass moves the bytes it reads and writes at the disk throughput, over the tasks
that run at once on separate disks (slurm, ray: one node each) or over one disk (local: its
workers share it). The throughput is `disk_mbps`, or is measured in about two seconds by
writing (fsync'd) and reading back a temporary file next to the output, removed at once: the
only file a plan touches.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokpack.formats.errors import TokpackError
from tokpack.formats.guard import physical_memory, space_needs
from tokpack.formats.manifest import MANIFEST, canonical_bytes, epoch_dir_name, source_manifest
from tokpack.formats.units import counted
from tokpack.packer.shared import ExecutorConfig, Result, as_paths, optional_field

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
    except OSError as e:
        return None, f"not measured ({e.strerror or e} in {directory}); give --disk-mbps"
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
    except OSError as e:
        return None, f"not measured ({e.strerror or e} in {directory}); give --disk-mbps"
    finally:
        os.close(fd)
    return round(2 * moved / 1e6 / seconds, 1), f"measured: {moved >> 20} MiB written and read back in {directory}"


def _result(
    command: str,
    output: str,
    passes: list[dict],
    needs: list[tuple],
    config: ExecutorConfig,
    disk_mbps: float | None,
    concurrent: bool,
    **fields,
) -> PlanResult:
    """`passes` get their predicted seconds; `concurrent`: whether tasks running at once have a
    disk each (slurm, ray), so a pass of T tasks moves its bytes min(T, workers) times faster."""
    space = [
        {
            "path": str(path),
            "filesystem": str(where),
            "needed_bytes": needed,
            "free_bytes": free,
            "enough": needed <= free,
        }
        for path, where, needed, free in space_needs(needs)
    ]
    if disk_mbps is not None and disk_mbps <= 0:
        raise TokpackError("disk throughput must be positive", where="--disk-mbps", expected="> 0", found=disk_mbps)
    mbps, disk = (float(disk_mbps), "given") if disk_mbps else measure_disk(Path(space[0]["filesystem"]))
    for p in passes:
        at_once = 1 if not concurrent else p["tasks"] if config.workers == 1 else min(config.workers, p["tasks"])
        moved = p["read_bytes"] + p["written_bytes"]
        p["seconds"] = (
            None
            if mbps is None
            else round(max(moved / (mbps * 1e6) / at_once, p.get("decode_seconds") or p.get("pack_seconds") or 0), 1)
        )
    from tokpack.packer.executors import runs_in_process

    startup = COMMAND_START_SECONDS + (0 if runs_in_process(config) else EXECUTOR_START_SECONDS * len(passes))
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


def _pass(name: str, tasks: int, memory: int | None, read: int, written: int, **extra) -> dict:
    return {
        "name": name,
        **extra,
        "tasks": tasks,
        "memory_per_task": memory,
        "read_bytes": read,
        "written_bytes": written,
    }


def _local(paths: list[str]) -> list[str]:
    """The local paths (`file://` URLs included) a plan reads or writes next to; other URLs are refused."""
    from tokpack.packer.executors import local_path

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


# ------------------------------------------------------------------------ the commands


def check_nodes(given: dict, nodes, shared_mbps, nic_mbps, executor) -> tuple:
    """plan shuffle's --to-nodes arguments (shuffle's keywords `given`, and the machine's figures),
    checked as the CLI's option types check them, before any file is read: (nodes, shared_mbps,
    nic_mbps) parsed."""
    from tokpack.formats import arguments

    if given.get("to_nodes") is None:
        if any(v is not None for v in (nodes, shared_mbps, nic_mbps)) or any(
            given.get(k) is not None for k in ("ranks_per_node", "micro_batch", "keep_sources")
        ):
            raise TokpackError(
                "--nodes, --ranks-per-node, --micro-batch, --keep-sources, --shared-mbps and --nic-mbps "
                "go with --to-nodes DEST",
                where="to_nodes",
            )
        return nodes, shared_mbps, nic_mbps
    # the API's arguments checked as the CLI's option types check them (tokpack.packer.api.ARGUMENTS)
    nodes, ranks_per_node, micro_batch = (
        arguments.whole(v, name, least=1)
        for v, name in (
            (nodes, "nodes"),
            (given.get("ranks_per_node"), "ranks_per_node"),
            (given.get("micro_batch"), "micro_batch"),
        )
    )
    shared_mbps, nic_mbps = (
        arguments.positive_number(v, name) for v, name in ((shared_mbps, "shared_mbps"), (nic_mbps, "nic_mbps"))
    )
    if None in (nodes, ranks_per_node, micro_batch):
        raise TokpackError(
            "plan shuffle --to-nodes needs the nodes, ranks a node and micro-batch",
            where="--nodes/--ranks-per-node/--micro-batch",
            expected="all three",
            found={"nodes": nodes, "ranks_per_node": ranks_per_node, "micro_batch": micro_batch},
        )
    if (
        given.get("like") is not None
        or given.get("holdout") is not None
        or (executor is not None and executor.executor != "local")
    ):
        raise TokpackError(
            "shuffle --to-nodes takes its sources and settings, not --like, --holdout or an --executor",
            where="--like/--holdout/--executor",
        )
    return nodes, shared_mbps, nic_mbps


def plan_shuffle(
    spec,
    *,
    executor: ExecutorConfig | None = None,
    disk_mbps: float | None = None,
    nodes: int | None = None,
    shared_mbps: float | None = None,
    nic_mbps: float | None = None,
) -> PlanResult:
    """What `shuffle` of the ShuffleSpec `spec` (tokpack.shuffle.spec; tokpack.plan("shuffle", ...)
    builds it from shuffle's keywords) would do. A source may be virtual:
    `virtual:tokens=11T,documents=5.5B,dtype=uint16` (shuffle/plan.py, virtual_source). With
    `spec.nodes` (shuffle --to-nodes DEST) and `nodes`, and optionally `shared_mbps`, `nic_mbps`:
    `shuffle --to-nodes` on that many nodes, per node (plan_to_nodes)."""
    if spec.nodes is not None:
        return plan_to_nodes(spec, nodes=nodes, shared_mbps=shared_mbps, nic_mbps=nic_mbps, disk_mbps=disk_mbps)
    from tokpack.shuffle.packings import figures_shown, of_plan
    from tokpack.shuffle.steps import BUCKETS_PER_FOLDER
    from tokpack.shuffle.run import (
        bytes_to_write,
        epoch_bytes,
        epoch_layout,
        memory_path,
        planned_epoch_manifest,
        repeat_warnings,
        run_manifest_of,
        scratch_bytes,
        setup_run,
        task_budget,
    )

    memory = spec.memory
    config = executor or ExecutorConfig()
    *paths, output = _local(list(spec.sources) + [str(spec.output)])
    setup = setup_run(spec.with_settings(sources=paths), str(output), workers=config.workers)
    opened = setup.sources
    passes, details, manifests, written, warnings = [], [], {}, {}, []
    ram = physical_memory()
    buckets = bucket_files = 0
    for epoch, plan, job in setup.todo:
        stage, report = setup.runplan.stage_name(epoch), plan.source_report()
        if setup.runplan.schedule.file is not None:  # a schedule's epoch lists every source; show its stage's
            report = [r for r in report if r["samples"] or r["weight"] is not None]
        warnings += repeat_warnings(epoch, report, stage)
        if job is None:
            details.append(
                {"epoch": epoch, "stage": stage, "path": "complete already", "samples": plan.samples, "sources": report}
            )
            continue
        read = sum(src.tokens * src.dtype.itemsize for src, sp in zip(opened, plan.sources) if sp.samples)
        manifest = planned_epoch_manifest(job, opened)
        written[epoch] = manifest
        size = epoch_bytes(job, manifest)
        manifests[f"{epoch_dir_name(epoch)}/{MANIFEST}"] = len(canonical_bytes(manifest))
        layout = epoch_layout(job, memory=memory, workers=config.workers, tasks=config.tasks)
        detail = {
            "epoch": epoch,
            "stage": stage,
            "path": "in-memory" if layout is None else "out-of-core",
            "samples": plan.samples,
            "shards": job.n_shards,
            "output_bytes": size,
            "sources": report,
        }
        entry, tokens = of_plan(plan), plan.samples * plan.row_tokens
        # What the summary will show of its rows: a padded packing's counted now (its passes packed once more).
        fig = None if entry.figures is None else entry.figures(plan, opened, memory)
        detail["packing"] = figures_shown(
            entry, tokens, 0 if fig is None else fig.padding_tokens, {} if fig is None else fig.fields()
        )
        table, table_estimate = 0, entry.table_estimate
        if table_estimate is not None:  # first the row table, built in the work folder within --memory
            est = table_estimate(job, opened)
            table = est["table_bytes"]
            detail.update(table_pieces=est["pieces"], table_bytes=table)
            passes.append(_pass("table", 1, memory, table, table, epoch=epoch, pack_seconds=est["pack_seconds"]))
        if layout is None:
            detail["memory_bytes"] = memory_path(job, memory)[1]
            if ram is not None and detail["memory_bytes"] > ram:
                warnings.append(
                    f"epoch {epoch} runs in memory (it fits --memory {memory:,}) and needs "
                    f"{_size(detail['memory_bytes'])}, more than this machine's {_size(ram)} of RAM. HINT: "
                    f"give a --memory below the RAM (e.g. {ram // 2:,}) to run it out of core"
                )
            passes.append(_pass("in-memory", 1, detail["memory_bytes"], read, size, epoch=epoch))
        else:
            budget, scratch = task_budget(memory, config.workers), scratch_bytes(job)
            detail.update(
                scatter_tasks=layout.tasks,
                buckets=len(layout.bucket_starts) - 1,
                bucket_files=2 * layout.tasks * (len(layout.bucket_starts) - 1),
                files_per_folder=2 * min(BUCKETS_PER_FOLDER, len(layout.bucket_starts) - 1),
                scratch_bytes=scratch,
                max_bucket_rows=layout.max_bucket,
                scatter_block_rows=layout.block_rows,
            )
            buckets, bucket_files = buckets + detail["buckets"], bucket_files + detail["bucket_files"]
            passes += [
                _pass("scatter", layout.tasks, budget, read, scratch - table, epoch=epoch),
                _pass("order", job.n_shards, budget, scratch - table, size, epoch=epoch),
            ]
        details.append(detail)
    if written:
        run = run_manifest_of(written, setup.todo[-1][1], setup.weights, opened, setup.shard_samples, setup.runplan)
        manifests[MANIFEST] = len(canonical_bytes(run))
    from tokpack.shuffle.packed import release_passes

    release_passes()  # the best-fit passes the plan packed and kept: a caller's process does not keep them
    plan = setup.todo[0][1]
    sizes = {d["samples"] for d in details}
    paths_taken = sorted({d["path"] for d in details if "shards" in d})
    return _result(
        "shuffle",
        str(output),
        passes,
        [(output, bytes_to_write(setup.jobs, opened, memory))],
        config,
        disk_mbps,
        config.executor != "local",
        path=",".join(paths_taken) or "none",
        shards=sum(d.get("shards", 0) for d in details),
        manifests=manifests,
        samples_per_epoch=sizes.pop() if len(sizes) == 1 else None,
        sources=[
            {
                "name": sp.name,
                "path": sp.path,
                "tokens": sp.tokens,
                "windows": sp.windows,
                "samples": sp.samples,
                "passes": plan.passes(i),
                "first_pass": plan.first_pass(i),
            }
            for i, sp in enumerate(plan.sources)
        ],
        epochs=details,
        buckets=buckets if bucket_files else None,
        bucket_files=bucket_files or None,
        holdout=None
        if setup.holdout is None
        else {  # its bytes are in `space`, with the epochs'
            "path": setup.holdout.epoch_dir,
            "samples": setup.holdout.plan.samples,
            "shards": setup.holdout.n_shards,
            "sources": setup.holdout.plan.source_report(),
        },
        warnings=warnings or None,
    )


def plan_pack(
    inputs,
    output,
    options=None,
    *,
    executor: ExecutorConfig | None = None,
    disk_mbps: float | None = None,
) -> PlanResult:
    """What `pack` with these arguments would do: one task per input file, its shards of at most
    `shard_tokens` tokens cut at document ends (so at least tokens / shard_tokens of them).
    `scratch`: as in plan_shuffle, unused. `link`: which bytes pack --link would link, not copy
    (a datatrove input whose documents do not all end with EOS is found only by the scan, and copied)."""
    from tokpack.formats.inputs.tables import PARQUET_DECODE_THREADS
    from tokpack.packer.packing import PackOptions, known_tokens, pack_tasks, setup_pack

    options = options or PackOptions()
    shard_tokens, link = options.shard_tokens, options.link

    config = executor or ExecutorConfig()
    *paths, output = _local(as_paths(inputs) + [str(output)])
    out = Path(output).absolute()
    setup = setup_pack(paths, out, options)
    done = setup.state == "complete"
    counts = [known_tokens(f) for f in setup.files]
    shards = [] if done or None in counts else [-(-n // shard_tokens) for n in counts]
    written = 0 if done else setup.bytes_to_write(out)
    manifests = {}
    if shards:  # the source manifest with placeholder checksums: its size, to a few bytes

        def size(n: int) -> int:
            entries = [
                {
                    "path": f"{i:05d}.ds",
                    "tokens": shard_tokens,
                    "bytes": shard_tokens * setup.out_dtype.itemsize,
                    "documents": 0,
                    "xxh3_128": "0" * 32,
                    "index_xxh3_128": "0" * 32,
                    "metadata_xxh3_128": "0" * 32,
                }
                for i in range(n)
            ]
            return len(
                canonical_bytes(
                    source_manifest(
                        entries,
                        setup.out_dtype,
                        setup.vocab,
                        setup.eos,
                        setup.tok_name,
                        inputs=setup.request["inputs"],
                        shard_tokens=int(shard_tokens),
                        eos_appended=0,
                        empty_documents_dropped=0,
                        created_by="tokpack",
                        request=setup.request,
                    )
                )
            )

        # Entries of one size: two tell them all, so a tiny --shard-tokens costs no list of entries.
        manifests[MANIFEST] = size(1) + (sum(shards) - 1) * (size(2) - size(1))
    tasks = 0 if done else pack_tasks(len(setup.files), config)
    # No option bounds a pack task's memory: a read block plus what the input's decoder holds.
    passes = [] if done else [_pass("pack", tasks, None, sum(f.size for f in setup.files), written)]
    decoded = sum(n for f, n in zip(setup.files, counts) if f.format == "parquet" and n)
    if passes and decoded:  # tasks at once, each decoding PARQUET_DECODE_THREADS row groups at once
        at_once = min(config.workers, tasks) if config.workers > 1 or config.executor == "local" else tasks
        cores = at_once * PARQUET_DECODE_THREADS
        if config.executor == "local":
            cores = min(cores, os.cpu_count() or 1)
        passes[0]["decode_seconds"] = round(decoded / (PARQUET_VALUES_PER_CORE_S * cores), 3)
    links = None if done else setup.links(out)
    return _result(
        "pack",
        str(output),
        passes,
        [(out, written)],
        config,
        disk_mbps,
        config.executor != "local",
        path=setup.fmt,
        shards=sum(shards),
        manifests=manifests,
        copy_bytes=links and links.copy,
        link_bytes=links and links.hardlink,
        reflink_bytes=links and links.reflink,
        link_notes=links.notes if links and link else None,
    )


def plan_stage(directory, dest, selection: dict, *, disk_mbps: float | None = None) -> PlanResult:
    """What `stage` with these arguments would do: every file is read once (hashed), the ones not
    in place at DEST are written; the copy threads share DEST's disk. A node slice (world_size
    or node): the bytes its node keeps and reads, by arithmetic on the run's manifests.
    `selection`: stage's other keywords, all of them (tokpack.packer.api.plan binds them to stage's
    signature); its `memory` (a replacement node's budget) changes none of these bytes."""
    workers, epochs, ranks, micro_batch = (selection[k] for k in ("workers", "epochs", "ranks", "micro_batch"))
    world_size, node, ranks_per_node = selection["world_size"], selection["node"], selection["ranks_per_node"]
    start_sample, shards_of = selection["start_sample"], selection["shards_of"]
    from tokpack.packer.staging import (
        STAGE_BLOCK,
        Source,
        in_place,
        bytes_to_copy,
        bytes_to_write,
        make_plan,
        parse_epochs,
        parse_ranks,
        whole_copy_note,
        whole_shard_ranks,
    )

    ranks = whole_shard_ranks(shards_of, ranks, world_size, node)
    (dest,) = _local([str(dest)])
    if world_size is not None or node is not None:
        from tokpack.packer.slicing import CHUNK_BYTES, plan_slice

        sp = plan_slice(
            Source(str(directory)), ranks, world_size, micro_batch, node, ranks_per_node, start_sample, epochs
        )
        kept, read = sum(sp.kept.values()), sum(sp.read.values())
        passes = [_pass("slice", len(sp.epochs), CHUNK_BYTES, read, kept)]
        manifests = {MANIFEST: 0, **{f"{epoch_dir_name(e)}/{MANIFEST}": 0 for e in sp.epochs}}
        a, b = sp.ranks
        need = sum(sp.written.values()) + sp.root_bytes  # stage's own space check: every file it writes
        return _result(
            "stage",
            str(dest),
            passes,
            [(Path(dest), need)],
            ExecutorConfig(workers=workers),
            disk_mbps,
            False,
            path=f"node slice of ranks {a}-{b} of {sp.world_size}",
            shards=(b - a + 1) * len(sp.epochs),
            manifests=manifests,
            bytes_per_node=kept,
            read_amplification=round(read / kept, 4) if kept else None,
            note=None
            if all(sp.by_rows.values())
            else "epochs written before row hashes are verified by reading their shards whole",
        )
    src = Source(str(directory))
    kind, plans = make_plan(src, parse_epochs(epochs), parse_ranks(ranks), micro_batch)
    dest = Path(dest)
    jobs = [j for p in plans for j in p.jobs]
    copy = bytes_to_copy(dest, plans)
    passes = [
        _pass(
            "copy",
            len(jobs),
            STAGE_BLOCK,
            sum(j.size or 0 for j in jobs),
            copy,
            files_in_place=sum(in_place(dest / j.rel, j.size) for j in jobs),
        )
    ]
    manifests = {f"{p.rel}/{MANIFEST}".lstrip("/"): len(canonical_bytes(p.manifest)) for p in plans}
    return _result(
        "stage",
        str(dest),
        passes,
        [(dest, bytes_to_write(dest, plans))],
        ExecutorConfig(workers=workers),
        disk_mbps,
        False,
        path=kind,
        shards=sum(j.rel.endswith(".ds") for j in jobs),
        manifests=manifests,
        note=whole_copy_note(plans, parse_ranks(ranks), micro_batch, src.path, str(dest)),
    )


# ------------------------------------------------------------------------ for humans


def _size(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"


def report_lines(r: PlanResult) -> list[str]:
    """The human summary of a plan; nothing has been written."""
    from tokpack.shuffle.packings import shown_line

    if r.per_node is not None:
        return _nodes_lines(r)

    shards = counted(r.shards, "shard")
    if r.command == "pack":
        shards = f"at least {shards}" if r.shards else "shards unknown (the inputs do not tell their token count)"
    written = (
        "nothing written"
        if not r.disk.startswith("measured")
        # the probe's file: gone, but written
        else "no output written (the disk probe wrote and read back a temporary file; --disk-mbps skips it)"
    )
    lines = [f"plan {r.command} -> {r.output}: {r.path}, {shards}; {written}"]
    if r.samples_per_epoch is not None:
        lines.append(f"  samples per epoch: {r.samples_per_epoch:,}")
    tokens = {s["name"]: s["tokens"] for s in r.sources or []}
    for e in r.epochs or []:
        extra = (
            ""
            if e["path"] != "out-of-core"
            else (
                f", {e['scatter_tasks']} scatter tasks, {e['buckets']:,} buckets (at most {e['bucket_files']:,} bucket "
                f"files), {_size(e['scratch_bytes'])} scratch"
            )
        )
        if "table_bytes" in e:
            extra += f", row table of ~{e['table_pieces']:,} pieces ({_size(e['table_bytes'])} scratch)"
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
            + ("repeated" if s.get("repeat_unit", "samples") == "samples" else f"{s['repeat_unit']} repeated")
            for s in e["sources"]
        ]
    if r.holdout is not None:
        h = r.holdout
        lines.append(
            f"  holdout: {h['samples']:,} samples of held-out documents, {counted(h['shards'], 'shard')}, written "
            f"once to {h['path']} (" + ", ".join(f"{s['name']} {s['samples']:,}" for s in h["sources"]) + ")"
        )
    for p in r.passes:
        memory = "no set memory bound" if p["memory_per_task"] is None else f"{_size(p['memory_per_task'])} memory"
        lines.append(
            f"  pass {p['name']}{'' if 'epoch' not in p else ' (epoch %d)' % p['epoch']}: "
            f"{counted(p['tasks'], 'task')}, {memory} per task, reads {_size(p['read_bytes'])}, writes "
            f"{_size(p['written_bytes'])}, {_duration(p['seconds'])}"
            + (f" (decoding Parquet: {_duration(p['decode_seconds'])})" if p.get("decode_seconds") else "")
            + (f" (packing: {_duration(p['pack_seconds'])})" if p.get("pack_seconds") else "")
        )
    for s in r.space:
        lines.append(
            f"  space on {s['filesystem']}: needs {_size(s['needed_bytes'])} (scratch included), "
            f"{_size(s['free_bytes'])} free: {'enough' if s['enough'] else 'NOT ENOUGH'}"
        )
    if r.bytes_per_node is not None:
        lines.append(
            f"  node slice: keeps {_size(r.bytes_per_node)} on the node, reads "
            f"{_size(r.passes[0]['read_bytes'])} (read amplification {r.read_amplification}x)"
        )
    if r.note:
        lines.append(f"  note: {r.note}")
    if r.copy_bytes is not None:
        lines.append(
            f"  shard files: copies {_size(r.copy_bytes)}, links {_size(r.link_bytes)} (hard links)"
            + (
                f", reflinks {_size(r.reflink_bytes)} where its filesystem allows, else copies it"
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


def _nodes_lines(r: PlanResult) -> list[str]:
    """plan shuffle --to-nodes: a line per epoch, a table of the nodes, RUN's files, the time."""
    t = r.to_nodes
    written = (
        "nothing written"
        if not (r.disk.startswith("measured") or (r.shared or "").startswith("measured"))
        else "no output written (the disk probe wrote and read back a temporary file; --disk-mbps and "
        "--shared-mbps skip it)"
    )
    lines = [
        f"plan shuffle -> {r.output} --to-nodes {t['dest']}: {counted(r.nodes, 'node')} of {t['ranks_per_node']} ranks "
        f"(W = {t['world_size']}), micro-batch {t['micro_batch']}; {written}"
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
    head = (
        "node",
        "shared read",
        "local read",
        "sent",
        "received",
        "slice",
        "kept sources",
        "scratch",
        "needs",
        "free",
        "time",
    )
    table = [head]
    for p in r.per_node:
        space = p["space"]
        free = (
            "not visible"
            if space == "not visible"
            else ", ".join(f"{_size(s['free_bytes'])}{'' if s['enough'] else ' NOT ENOUGH'}" for s in space)
        )
        table.append(
            (
                str(p["node"]),
                *(
                    _size(p[k])
                    for k in (
                        "shared_source_bytes",
                        "local_source_bytes",
                        "sent_bytes",
                        "received_bytes",
                        "slice_bytes",
                        "kept_source_bytes",
                        "scratch_bytes",
                        "local_needed_bytes",
                    )
                ),
                free,
                _duration(p["predicted_seconds"]),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    if any(not d["exchanged_exact"] for p in r.per_node for d in p["epochs"]):
        lines.append(
            "  (sent and received are estimates: of a best-fit epoch, whose row table that places each "
            "piece only the command builds; of a large epoch, from a sample of its windows)"
        )
    if any(p["out_of_core_bytes"] for p in r.per_node):
        lines.append(
            "  (scratch includes the bucket files of an out-of-core order: every row of the node's slice and "
            "owned shards, with its record)"
        )
    f = r.run_files
    lines.append(
        f"  RUN (shared filesystem) gets {_size(f['bytes'])}: manifests {f['manifests_bytes']:,} bytes, "
        f"row hashes {_size(f['rows_bytes'])}"
        + (f", padding {_size(f['pad_bytes'])}" if f["pad_bytes"] else "")
        + f", {f['nodes_sidecar_bytes']:,} bytes of sidecar; no token file"
    )
    slow = "" if r.slowest_node is None else f"the slowest node's, node {r.slowest_node}; "
    lines.append(
        f"  predicted wall time: {_duration(r.predicted_seconds)} ({slow}shared filesystem "
        f"{r.shared_mbps if r.shared_mbps is not None else '?'} MB/s {r.shared}, for all nodes; "
        f"network {r.nic_mbps:g} MB/s a node; disk {r.disk_mbps if r.disk_mbps is not None else '?'} MB/s "
        f"{r.disk}; {r.startup_seconds:.1f} s of it start-up)"
    )
    return lines


# ------------------------------------------------------------------------ straight to the nodes


NIC_MBPS = 25_000.0  # --nic-mbps default: a node's InfiniBand/RoCE link (issue 33, "25-50 GB/s a node")
# Windows taken through the epoch's permutation to count each node's sends exactly (about 4 s
# on one core); beyond, every k-th block of SAMPLE_BLOCK windows, and the counts scaled.
EXACT_WINDOWS = 1 << 25
SAMPLE_BLOCK = 1 << 18


def _visible(path: Path) -> Path | None:
    """`path`, or its nearest existing parent below the root, when this machine sees one: a
    node-local DEST seen from a login node is usually not there (its root, "/", is this
    machine's and says nothing of the node's disk)."""
    p = Path(path).absolute()
    for q in (p, *p.parents):
        if q.exists():
            return q if q != Path(q.anchor) else None
    return None


def _rate(given: float | None, option: str, where: Path | None, measured: dict) -> tuple[float | None, str]:
    """(MB/s, how it was found): given, or measured in `where` (once a filesystem), or unknown."""
    if given is not None:
        if given <= 0:
            raise TokpackError("throughput must be positive", where=option, expected="> 0", found=given)
        return float(given), "given"
    if where is None:
        return None, f"not measured (not visible from here); give {option}"
    dev = os.stat(where).st_dev
    if dev not in measured:
        measured[dev] = measure_disk(where)
    mbps, how = measured[dev]
    return mbps, how if mbps is not None else how.replace("--disk-mbps", option)


def _node_epoch_figures(
    job, manifest: dict, figures, first: int, nodes: int, ranks_per_node: int, micro_batch: int, memory: int
) -> list[dict]:
    """Each node's part of one epoch, from the exchange's own arithmetic (tokpack.packer.exchange):
    its NodeEpoch (the slice's positions, the owned shards, keep_bytes), its runs of source
    shards (split_shards), round_tokens, and the destinations exchange_epoch sends each piece to
    (the node that reads its row, and its shard's owner when that is another node)."""
    from tokpack.formats.shards import U64
    from tokpack.formats.slices import RankRows
    from tokpack.packer.node_epoch import NodeEpoch
    from tokpack.packer.node_epoch import memory_plan
    from tokpack.packer.pieces import WIRE_PIECE
    from tokpack.packer.slicing import slice_files, slice_ranks
    from tokpack.shuffle import packings
    from tokpack.shuffle.steps import shard_segments

    plan, entry = job.plan, packings.of_plan(job.plan)
    padded = entry.padded  # document pieces from a row table, and padding
    sources = job.open_sources()
    rows = RankRows(nodes * ranks_per_node, micro_batch, 0)
    item, row = job.token_dtype.itemsize, plan.row_tokens
    table = entry.table_estimate(job, sources) if entry.table_estimate is not None else None
    data_tokens = plan.samples * row - (figures.padding_tokens if figures is not None else 0)
    per_row = int(manifest["fragments"]) / max(1, plan.samples)  # the index's fragments, at the epoch's mean
    out, nes = [], []
    for n in range(nodes):
        a, b, _ = slice_ranks(node=f"{n}/{nodes}", ranks_per_node=ranks_per_node, micro_batch=micro_batch)
        # the row table itself is the command's to build (plan_shuffle counts it by table_estimate)
        ne = NodeEpoch(job, sources, rows, first, n, nodes, (a, b), {})
        nes.append(ne)
        shards = [(s, k) for s, k0, k1 in ne.runs() for k in range(k0, k1)]
        read = sum(int(sources[s].shards[k]["tokens"]) * sources[s].dtype.itemsize for s, k in shards)
        kept_shards = [(s, k) for s, ks in ne.kept_shards().items() for k in ks]
        rank_rows = [rows.rows(r, first, first + plan.samples) for r in range(a, b + 1)]  # as plan_slice counts
        if sum(rank_rows) != len(ne.positions):  # what the exchange keeps is what stage --node would
            raise TokpackError(
                "internal error: a node's rows differ from its ranks' counts",
                where=f"node {n}",
                hint="report this with the command line",
            )
        tokens = len(ne.positions) * job.row_bytes
        index = sum(U64.itemsize * max(k, math.ceil(k * per_row)) for k in rank_rows)  # as slice_files counts it
        owned_sizes = [job.shard_range(i)[1] - job.shard_range(i)[0] for i in ne.owned]
        try:
            per_round, bucket_rows = memory_plan(ne, memory)
        except TokpackError:
            per_round = bucket_rows = None  # not even out of core: the command refuses it
        out.append(
            {
                "node": n,
                "ranks": [a, b],
                "source_shards": len(shards),
                "source_bytes": read,
                # (fingerprint, shard file, bytes): where exchange.keep_sources keeps it, under DIR
                "kept_shards": sorted(
                    (
                        sources[s].fingerprint,
                        sources[s].shards[k].get("path", str(k)),  # virtual: none
                        int(sources[s].shards[k]["tokens"]) * sources[s].dtype.itemsize,
                    )
                    for s, k in kept_shards
                ),
                "epoch_source_shards": sum(len(sources[s].shards) for s, sp in enumerate(plan.sources) if sp.samples),
                "rows": len(ne.positions),
                "rank_rows": rank_rows,
                "slice_token_bytes": tokens,
                "slice_rows_bytes": U64.itemsize * len(ne.positions),
                "slice_pad_bytes": 4 * len(ne.positions) if padded else 0,
                "slice_index_bytes": index,
                # what stage --node's space check counts for these rank files
                "slice_on_disk": sum(slice_files(k, job.row_bytes, per_row, padded) for k in rank_rows),
                "owned_shards": len(ne.owned),
                "owned_rows": ne.owned_rows,
                # each owned shard's row hashes (and padding) in scratch, copied to RUN; its tokens and
                # index are only hashed (owned_shards.hash_owned_shards)
                "owned_bytes": ne.owned_rows * (U64.itemsize + 4 * padded),
                "owned_peak": max([k * (U64.itemsize + 4 * padded) for k in owned_sizes], default=0),
                "run_rows_bytes": U64.itemsize * ne.owned_rows,
                "run_pad_bytes": 4 * ne.owned_rows if padded else 0,
                "keep_bytes": ne.keep_bytes,
                "per_round_tokens": per_round,
                # out of core: every store row (slice, then owned shards) goes through DEST's bucket
                # files once, its tokens and a piece record (a window: one; best-fit: about one a document piece)
                "bucket_bytes": 0 if bucket_rows is None else ne.store_rows * (job.row_bytes + WIRE_PIECE.itemsize),
                "table_bytes": table["table_bytes"] if table else 0,
            }
        )
        # What follows needs each node's destinations, not its positions (8 bytes a row of the
        # epoch over all nodes: 21 GB for 11T tokens of 4096-token rows)
        ne.positions = np.zeros(0, dtype=np.int64)  # not a view: that would keep the whole array
    # What each node m reads (pieces, tokens: a row of an upsampled source once per use) and
    # sends to each node d (pieces[m, d], tokens[m, d]).
    pieces = np.zeros((nodes, nodes), dtype=np.int64)
    moved = np.zeros((nodes, nodes), dtype=np.int64)
    reads = np.zeros((nodes, 2), dtype=np.int64)
    exact = not padded
    if not padded:
        segments = [shard_segments(plan, sources, ne.runs()) for ne in nes]
        windows = sum(w1 - w0 for segs in segments for _, w0, w1, _, _ in segs)
        # Every window through the epoch's permutation, up to EXACT_WINDOWS of them (a few
        # seconds); a larger epoch's through every k-th block of them, scaled: an estimate
        every = max(1, -(-windows // EXACT_WINDOWS))
        exact = every == 1
        for m, ne in enumerate(nes):
            seen = taken = 0
            for s, w0, w1, _, _ in segments[m]:
                for c in range(w0, w1, SAMPLE_BLOCK):
                    seen += min(w1, c + SAMPLE_BLOCK) - c
                    if (c - w0) // SAMPLE_BLOCK % every:
                        continue
                    taken += min(w1, c + SAMPLE_BLOCK) - c
                    for _, _, g in plan.outputs_of(s, np.arange(c, min(w1, c + SAMPLE_BLOCK), dtype=np.int64)):
                        _count_sends(pieces[m], ne, g)
                        reads[m] += (len(g), len(g) * row)
            if taken and taken < seen:
                pieces[m] = np.round(pieces[m] * (seen / taken)).astype(np.int64)
                reads[m] = np.round(reads[m] * (seen / taken)).astype(np.int64)
        moved = pieces * row
    else:  # which node reads which piece is in the row table, which only the command builds: the
        # table's pieces and data tokens spread over the nodes by their source bytes, and over
        # the destinations as exchange_epoch sends the epoch's rows
        total = sum(f["source_bytes"] for f in out) or 1
        dests, every, taken = np.zeros(nodes, dtype=np.int64), max(1, -(-plan.samples // EXACT_WINDOWS)), 0
        for c in range(0, plan.samples, SAMPLE_BLOCK * every):  # a large epoch's: every k-th block
            g = np.arange(c, min(plan.samples, c + SAMPLE_BLOCK), dtype=np.int64)
            _count_sends(dests, nes[0], g)  # a row's destinations do not depend on who sends it
            taken += len(g)
        share = dests / max(1, taken)  # per destination: copies it gets of a piece sent
        for m, f in enumerate(out):
            part = f["source_bytes"] / total
            reads[m] = (round(table["pieces"] * part), round(data_tokens * part))
            pieces[m] = np.round(share * reads[m, 0]).astype(np.int64)
            moved[m] = np.round(share * reads[m, 1]).astype(np.int64)
    wire = pieces * WIRE_PIECE.itemsize + moved * item
    for n, f in enumerate(out):
        others = [d for d in range(nodes) if d != n]
        f["sent_bytes"] = int(wire[n, others].sum())
        f["received_bytes"] = int(wire[others, n].sum())
        f["to_itself_bytes"] = int(wire[n, n])  # Alltoallv's part to itself: no network
        f["exchanged_exact"] = exact
        # Rounds: every process takes part until the last has sent all; a round takes whole pieces
        # up to its per_round tokens, and one piece more while under it (exchange_epoch's cut).
        p, (k, t) = f["per_round_tokens"], reads[n].tolist()
        f["rounds"] = None if p is None else 0 if not t else -(-k // -(-p // row)) if not padded else -(-t // p)
        f["rounds_exact"] = exact
    return out


def _planned_manifest(job, sources, memory: int):
    """(the epoch manifest as RUN will get it but for its checksums and fragment counts, the
    epoch's row figures or None): a best-fit epoch's with its packing's fields (its padding
    counted by packing its passes once more, as plan shuffle shows it) and each shard's
    pad_xxh3_128, which --to-nodes RUNs hold (tokpack.shuffle.run.epoch_manifest_of)."""
    from tokpack.shuffle import packings
    from tokpack.shuffle.run import epoch_manifest_of, planned_epoch_manifest

    manifest, entry = planned_epoch_manifest(job, sources), packings.of_plan(job.plan)
    if entry.figures is None:
        return manifest, None
    fig = entry.figures(job.plan, sources, memory)
    shards = [{**s, "pad_xxh3_128": "0" * 32} for s in manifest["shards"]]
    return epoch_manifest_of(
        job, shards, {"table_xxh3_128": "0" * 32, "padding": fig.padding_tokens, "figures": fig.fields()}
    ), fig


def _count_sends(counts: np.ndarray, ne, g: np.ndarray) -> None:
    """Adds to counts[d] the pieces of rows `g` sent to node d: to the node that reads the row,
    and to its shard's owner when that is another node (exchange_epoch's destinations)."""
    to_node, to_owner = ne.node_of(g), ne.owner_of(g)
    counts += np.bincount(to_node, minlength=len(counts)) + np.bincount(
        to_owner[to_owner != to_node], minlength=len(counts)
    )


def plan_to_nodes(
    spec,
    *,
    nodes: int,
    shared_mbps: float | None = None,
    nic_mbps: float | None = None,
    disk_mbps: float | None = None,
) -> PlanResult:
    """What `mpirun -n NODES tokpack shuffle ... --to-nodes DEST` would do, per node (docs/COMMANDS.md,
    "Straight to the nodes"): from the exchange's own arithmetic (_node_epoch_figures), then the
    time of each node's shared-filesystem, network and local-disk bytes; the slowest node's is the run's."""
    from tokpack.formats.manifest import nodes_sidecar
    from tokpack.formats.slices import RankRows
    from tokpack.packer.node_dest import dest_template, node_dest
    from tokpack.packer.node_dest import run_numbering
    from tokpack.shuffle import packings
    from tokpack.packer.slicing import SLICE_ENTRY_BYTES, SLICE_HEADER_BYTES
    from tokpack.packer.staging import on_disk
    from tokpack.shuffle.packed import release_passes
    from tokpack.shuffle.run import run_manifest_of, setup_run
    from tokpack.packer.slicing import slice_ranks

    dest, keep_sources, memory = spec.nodes.dest, spec.nodes.keep_sources, spec.memory
    ranks_per_node, micro_batch = spec.nodes.ranks_per_node, spec.nodes.micro_batch
    slice_ranks(node=f"0/{nodes}", ranks_per_node=ranks_per_node, micro_batch=micro_batch)  # before a list a node
    nic = float(nic_mbps or NIC_MBPS)
    *paths, output = _local(list(spec.sources) + [str(spec.output)])
    if "://" in str(dest) or (keep_sources is not None and "://" in str(keep_sources)):
        raise TokpackError(
            "--to-nodes writes local directories",
            where="--to-nodes/--keep-sources",
            hint="RUN is a shared-filesystem path, DEST a node-local one",
        )
    out = Path(output)
    setup = setup_run(spec.with_settings(sources=paths), str(output), workers=1)
    numbering = run_numbering(setup, out)
    opened = setup.sources
    RankRows(nodes * ranks_per_node, micro_batch, 0)  # its checks (tokpack.formats.slices) before any arithmetic
    dests = [node_dest(dest, n) for n in range(nodes)]
    keeps = [None if keep_sources is None else node_dest(keep_sources, n) for n in range(nodes)]
    notes: list[str] = []
    # The kept sources already there: seen, or, where DIR is not visible, assumed for a later
    # epoch (RUN lists one already: the command that wrote it kept them).
    have: list[dict] = [{} for _ in range(nodes)]
    assumed = keep_sources is not None and any(_visible(k) is None for k in keeps) and bool(setup.done_epochs)
    zero = (
        "shared_source_bytes",
        "shared_manifest_bytes",
        "shared_written_bytes",
        "local_source_bytes",
        "kept_copied_bytes",
        "sent_bytes",
        "received_bytes",
        "slice_bytes",
        "slice_on_disk",
        "kept_source_bytes",
        "scratch_bytes",
        "scratch_written_bytes",
        "out_of_core_bytes",
        "local_written_bytes",
        "local_read_bytes",
    )
    totals = [{**dict.fromkeys(zero, 0), "epochs": []} for _ in range(nodes)]
    details, manifests, written_manifests, run_rows = [], {}, {}, {"rows_bytes": 0, "pad_bytes": 0}
    for epoch, plan, job in setup.todo:
        if job is None:
            details.append({"epoch": epoch, "path": "complete already", "samples": plan.samples})
            continue
        manifest, padding = _planned_manifest(job, opened, memory)
        written_manifests[epoch] = manifest
        manifests[f"{epoch_dir_name(epoch)}/{MANIFEST}"] = len(canonical_bytes(manifest))
        figures = _node_epoch_figures(
            job, manifest, padding, numbering.first(epoch), nodes, ranks_per_node, micro_batch, memory
        )
        rounds = [f["rounds"] for f in figures]
        padded = any(f["slice_pad_bytes"] for f in figures)
        details.append(
            {
                "epoch": epoch,
                "path": "to-nodes",
                "samples": plan.samples,
                "shards": job.n_shards,
                "rounds": None if None in rounds else max(rounds),
                "rounds_exact": all(f["rounds_exact"] for f in figures),
                "packing": packings.of_plan(plan).name,
                # best-fit: which node reads a piece is in the row table only the command builds
                "rounds_bound": "at least" if padded else "estimated",
            }
        )
        idle = [f["node"] for f in figures if not f["source_shards"]]
        if idle:  # split_shards gives at most one process a shard
            notes.append(
                f"epoch {epoch}: {'node' if len(idle) == 1 else 'nodes'} {', '.join(map(str, idle))} read no source shard (the epoch uses "
                f"{figures[0]['epoch_source_shards']} source "
                f"shards, fewer than {nodes} nodes); they still receive their rows"
            )
        big = [f for f in figures if f["per_round_tokens"] is None]
        if big:
            names = (
                "every node"
                if len(big) == nodes
                else ("node " if len(big) == 1 else "nodes ") + ", ".join(str(f["node"]) for f in big)
            )
            notes.append(
                f"epoch {epoch}: the rows of {names} (up to {_size(max(f['keep_bytes'] for f in big))} "
                f"with the owned shards) do not fit --memory {_size(memory)}, even out of core: shuffle "
                "--to-nodes refuses such a node; give more --memory or more nodes"
            )
        run_rows["rows_bytes"] += sum(f["run_rows_bytes"] for f in figures)
        run_rows["pad_bytes"] += sum(f["run_pad_bytes"] for f in figures)
        for n, f in enumerate(figures):
            t = totals[n]
            kept_now = 0
            if keeps[n] is not None:
                for fingerprint, name, size in f["kept_shards"]:
                    there = keeps[n] / fingerprint / name
                    if (
                        (fingerprint, name) not in have[n]
                        and not assumed
                        and not (there.is_file() and there.stat().st_size == size)
                    ):
                        kept_now += size  # kept_sources._keep_shard copies it: read from shared, written here
                    have[n][fingerprint, name] = size
                t["kept_source_bytes"] = sum(have[n].values())
            from_shared = 0 if keeps[n] is not None else f["source_bytes"]
            local = f["source_bytes"] if keeps[n] is not None else 0
            ooc = f["bucket_bytes"]
            slice_bytes = f["slice_token_bytes"] + f["slice_rows_bytes"] + f["slice_pad_bytes"] + f["slice_index_bytes"]
            scratch = f["owned_peak"] + f["table_bytes"] + ooc
            scratch_written = f["owned_bytes"] + f["table_bytes"] + ooc
            t["shared_source_bytes"] += from_shared + kept_now
            t["shared_written_bytes"] += f["run_rows_bytes"] + f["run_pad_bytes"]
            t["local_source_bytes"] += local
            t["kept_copied_bytes"] += kept_now
            t["sent_bytes"] += f["sent_bytes"]
            t["received_bytes"] += f["received_bytes"]
            t["slice_bytes"] += slice_bytes
            t["slice_on_disk"] += f["slice_on_disk"] + on_disk(
                SLICE_HEADER_BYTES + SLICE_ENTRY_BYTES * len(f["rank_rows"])
            )
            t["scratch_bytes"] = max(t["scratch_bytes"], scratch)
            t["scratch_written_bytes"] += scratch_written
            t["out_of_core_bytes"] = max(t["out_of_core_bytes"], ooc)
            t["local_written_bytes"] += kept_now + slice_bytes + scratch_written
            t["local_read_bytes"] += local + f["table_bytes"] + ooc
            t["epochs"].append(
                {
                    "epoch": epoch,
                    "source_shards": f["source_shards"],
                    "source_bytes": f["source_bytes"],
                    "from": "kept sources" if keeps[n] is not None else "shared filesystem",
                    "kept_copied_bytes": kept_now,
                    "rows": f["rows"],
                    "rank_rows": f["rank_rows"],
                    "slice_token_bytes": f["slice_token_bytes"],
                    "slice_rows_bytes": f["slice_rows_bytes"],
                    "slice_pad_bytes": f["slice_pad_bytes"],
                    "slice_index_bytes": f["slice_index_bytes"],
                    "owned_shards": f["owned_shards"],
                    "owned_rows": f["owned_rows"],
                    "run_rows_bytes": f["run_rows_bytes"],
                    "run_pad_bytes": f["run_pad_bytes"],
                    "sent_bytes": f["sent_bytes"],
                    "received_bytes": f["received_bytes"],
                    "to_itself_bytes": f["to_itself_bytes"],
                    "exchanged_exact": f["exchanged_exact"],
                    "keep_bytes": f["keep_bytes"],
                    "fits_memory": f["per_round_tokens"] is not None and not f["bucket_bytes"],
                    "out_of_core_bytes": ooc,
                    "rounds": f["rounds"],
                }
            )
    if written_manifests:
        run = run_manifest_of(
            written_manifests, setup.todo[-1][1], setup.weights, opened, setup.shard_samples, setup.runplan
        )
        manifests[MANIFEST] = len(canonical_bytes(run))
    release_passes()  # the best-fit passes the plan packed: a caller's process does not keep them
    for t in totals:  # each process reads RUN's manifests back, the run's once an epoch (exchange.commit_slice_epoch)
        t["shared_manifest_bytes"] = sum(manifests.values()) + manifests.get(MANIFEST, 0) * max(
            0, len(written_manifests) - 1
        )
    # the sidecar names node 0's DEST, as process 0 writes it (exchange._declare_nodes)
    sidecar = len(canonical_bytes(nodes_sidecar(nodes, ranks_per_node, micro_batch, dest_template(dest))))
    run_files = {"manifests_bytes": sum(manifests.values()), "nodes_sidecar_bytes": sidecar, **run_rows}
    run_files["bytes"] = sum(run_files.values())
    if assumed:
        notes.append(
            "--keep-sources DIR is not visible from here and RUN lists epochs already: the sources are "
            "taken as kept by the command that wrote them"
        )
    # Throughputs: given, or measured where this machine sees the filesystem (one probe each).
    measured: dict = {}
    seen = [_visible(d) for d in dests]
    disk, disk_how = _rate(disk_mbps, "--disk-mbps", next((p for p in seen if p is not None), None), measured)
    shared, shared_how = _rate(shared_mbps, "--shared-mbps", _visible(out), measured)
    readers = max(1, sum(1 for t in totals if t["shared_source_bytes"]))
    per_node = []
    for n, t in enumerate(totals):
        need = t["slice_on_disk"] + t["scratch_bytes"]
        space = "not visible"
        if seen[n] is not None:
            needs = [(dests[n], need)] + (
                [(keeps[n], t["kept_source_bytes"])] if keeps[n] is not None and _visible(keeps[n]) is not None else []
            )
            space = [
                {"path": str(p), "filesystem": str(w), "needed_bytes": nb, "free_bytes": free, "enough": nb <= free}
                for p, w, nb, free in space_needs(needs)
            ]
        # The nodes read the shared filesystem at once: each gets its share of --shared-mbps.
        shared_s = (
            None
            if shared is None
            else (
                t["shared_source_bytes"] / (shared * 1e6 / readers)
                + (t["shared_manifest_bytes"] + t["shared_written_bytes"]) / (shared * 1e6 / nodes)
            )
        )
        network_s = max(t["sent_bytes"], t["received_bytes"]) / (nic * 1e6)  # full duplex
        disk_s = None if disk is None else (t["local_read_bytes"] + t["local_written_bytes"]) / (disk * 1e6)
        seconds = (
            None
            if shared_s is None or disk_s is None
            else round(shared_s + network_s + disk_s + COMMAND_START_SECONDS, 1)
        )
        per_node.append(
            {
                "node": n,
                "dest": str(dests[n]),
                "keep_sources": None if keeps[n] is None else str(keeps[n]),
                **t,
                "local_needed_bytes": need + t["kept_source_bytes"],
                "space": space,
                "shared_seconds": None if shared_s is None else round(shared_s, 1),
                "network_seconds": round(network_s, 1),
                "disk_seconds": None if disk_s is None else round(disk_s, 1),
                "predicted_seconds": seconds,
            }
        )
    times = [p["predicted_seconds"] for p in per_node]
    slowest = None if None in times else max(range(nodes), key=lambda n: times[n])
    sizes = {d["samples"] for d in details}
    return PlanResult(
        command="shuffle",
        output=str(output),
        path="to-nodes",
        shards=sum(d.get("shards", 0) for d in details),
        passes=[],
        space=[dict(s, node=p["node"]) for p in per_node if isinstance(p["space"], list) for s in p["space"]],
        manifests=manifests,
        workers=nodes,
        executor="mpi",
        disk_mbps=disk,
        disk=disk_how,
        startup_seconds=COMMAND_START_SECONDS,
        predicted_seconds=None if slowest is None else times[slowest],
        samples_per_epoch=sizes.pop() if len(sizes) == 1 else None,
        epochs=details,
        nodes=nodes,
        to_nodes={
            "dest": str(dest),
            "ranks_per_node": ranks_per_node,
            "micro_batch": micro_batch,
            "world_size": nodes * ranks_per_node,
            "keep_sources": keep_sources,
            "memory": memory,
        },
        per_node=per_node,
        run_files=run_files,
        slowest_node=slowest,
        shared_mbps=shared,
        shared=shared_how,
        nic_mbps=nic,
        warnings=notes or None,
    )
