"""`tokpack plan shuffle|pack|stage`: what the command would do, from the planning code the
command itself runs, with nothing written (docs/COMMANDS.md, "Planning a run").

Each plan_* function calls its command's own setup (tokpack.shuffle.run.setup_run and epoch_layout,
tokpack.packer.pack_setup.setup_pack, tokpack.packer.stage_plan.make_plan) and byte counts, then predicts the wall
time: each pass moves the bytes it reads and writes at the disk throughput, over the tasks
that run at once on separate disks (slurm, ray: one node each) or over one disk (local: its
workers share it). The throughput is `disk_mbps`, or is measured in about two seconds by
writing (fsync'd) and reading back a temporary file next to the output, removed at once: the
only file a plan touches.

This module plans pack, stage and shuffle; plan shuffle --to-nodes is tokpack.packer.plan_nodes,
the result, the disk's measure, the time model and the text printed tokpack.packer.plan_result.
"""

from __future__ import annotations

import os
from pathlib import Path

from tokpack.formats.guard import physical_memory
from tokpack.formats.constants import MANIFEST
from tokpack.formats.reading import canonical_bytes
from tokpack.formats.names import epoch_dir_name
from tokpack.packer.shared import ExecutorConfig, as_paths
from tokpack.packer.plan_nodes import plan_to_nodes, planned, shuffle_figures
from tokpack.packer.plan_result import PARQUET_VALUES_PER_CORE_S, PlanResult, local_only
from tokpack.packer.plan_result import plan_pass, planned_result, size_text

# ------------------------------------------------------------------------ the commands


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
        planned_epoch_manifest,
        repeat_warnings,
        task_budget,
    )
    from tokpack.shuffle.run_setup import setup_run

    memory = spec.memory
    config = executor or ExecutorConfig()
    *paths, output = local_only(list(spec.sources) + [str(spec.output)])
    setup = setup_run(spec.with_settings(sources=paths), str(output), workers=config.workers)
    opened = setup.sources
    passes, details, written, warnings = [], [], {}, []
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
        written[epoch] = planned(manifest)
        size = epoch_bytes(job, manifest)
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
            passes.append(plan_pass("table", 1, memory, table, table, epoch=epoch, pack_seconds=est["pack_seconds"]))
        if layout is None:
            detail["memory_bytes"] = entry.memory_path(job, memory)[1]
            if ram is not None and detail["memory_bytes"] > ram:
                warnings.append(
                    f"epoch {epoch} runs in memory (it fits --memory {memory:,}) and needs "
                    f"{size_text(detail['memory_bytes'])}, more than this machine's {size_text(ram)} of RAM. HINT: "
                    f"give a --memory below the RAM (e.g. {ram // 2:,}) to run it out of core"
                )
            passes.append(plan_pass("in-memory", 1, detail["memory_bytes"], read, size, epoch=epoch))
        else:
            budget, scratch = task_budget(memory, config.workers), entry.scratch_bytes(job, True)
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
                plan_pass("scatter", layout.tasks, budget, read, scratch - table, epoch=epoch),
                plan_pass("order", job.n_shards, budget, scratch - table, size, epoch=epoch),
            ]
        details.append(detail)
    figures = shuffle_figures(setup, written, details)
    plan = setup.todo[0][1]
    paths_taken = sorted({d["path"] for d in details if "shards" in d})
    return planned_result(
        "shuffle",
        str(output),
        passes,
        [(output, bytes_to_write(setup.jobs, opened, memory))],
        config,
        disk_mbps,
        path=",".join(paths_taken) or "none",
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
        **figures,
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
    `shard_tokens` tokens cut at document ends (so at least tokens / shard_tokens of them). With
    `options.link`: which bytes pack --link would link, not copy (a datatrove input whose
    documents do not all end with EOS is found only by the scan, and copied)."""
    from tokpack.formats.inputs.tables import PARQUET_DECODE_THREADS
    from tokpack.packer.pack_setup import PackOptions, known_tokens, pack_tasks, setup_pack

    options = options or PackOptions()
    shard_tokens = options.shard_tokens
    config = executor or ExecutorConfig()
    *paths, output = local_only(as_paths(inputs) + [str(output)])
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
            return len(canonical_bytes(setup.manifest(entries, "tokpack")))

        # Entries of one size: two tell them all, so a tiny --shard-tokens costs no list of entries.
        manifests[MANIFEST] = size(1) + (sum(shards) - 1) * (size(2) - size(1))
    tasks = 0 if done else pack_tasks(len(setup.files), config)
    # No option bounds a pack task's memory: a read block plus what the input's decoder holds.
    passes = [] if done else [plan_pass("pack", tasks, None, sum(f.size for f in setup.files), written)]
    decoded = sum(n for f, n in zip(setup.files, counts) if f.format == "parquet" and n)
    if passes and decoded:  # tasks at once, each decoding PARQUET_DECODE_THREADS row groups at once
        at_once = min(config.workers, tasks) if config.workers > 1 or config.executor == "local" else tasks
        cores = at_once * PARQUET_DECODE_THREADS
        if config.executor == "local":
            cores = min(cores, os.cpu_count() or 1)
        passes[0]["decode_seconds"] = round(decoded / (PARQUET_VALUES_PER_CORE_S * cores), 3)
    links = None if done else setup.links(out)
    return planned_result(
        "pack",
        str(output),
        passes,
        [(out, written)],
        config,
        disk_mbps,
        path=setup.fmt,
        shards=sum(shards),
        manifests=manifests,
        copy_bytes=links and links.copy,
        link_bytes=links and links.hardlink,
        reflink_bytes=links and links.reflink,
        link_notes=links.notes if links and options.link else None,
    )


def plan_stage(directory, dest, selection: dict, *, disk_mbps: float | None = None) -> PlanResult:
    """What `stage` with these arguments would do: every file is read once (hashed), the ones not
    in place at DEST are written; the copy threads share DEST's disk. A node slice (world_size
    or node): the bytes its node keeps and reads, by arithmetic on the run's manifests.
    `selection`: stage's other keywords, all of them (tokpack.packer.api.plan binds them to stage's
    signature); its `memory` (a replacement node's budget) changes none of these bytes."""
    workers, epochs, ranks, micro_batch = (selection[k] for k in ("workers", "epochs", "ranks", "micro_batch"))
    workers = workers or 4  # stage's copy threads (its default)
    world_size, node, ranks_per_node = selection["world_size"], selection["node"], selection["ranks_per_node"]
    start_sample, shards_of = selection["start_sample"], selection["shards_of"]
    from tokpack.packer.stage_dest import in_place, bytes_to_copy, bytes_to_write
    from tokpack.packer.stage_plan import STAGE_BLOCK, Source, make_plan, parse_epochs, parse_ranks, whole_shard_ranks
    from tokpack.packer.staging import whole_copy_note

    ranks = whole_shard_ranks(shards_of, ranks, world_size, node, start_sample, ranks_per_node)
    (dest,) = local_only([str(dest)])
    src = Source(str(directory))
    if world_size is not None or node is not None:
        from tokpack.packer.slicing import CHUNK_BYTES, plan_slice

        sp = plan_slice(src, ranks, world_size, micro_batch, node, ranks_per_node, start_sample, epochs)
        kept, read = sum(sp.kept.values()), sum(sp.read.values())
        passes = [plan_pass("slice", len(sp.epochs), CHUNK_BYTES, read, kept)]
        manifests = {MANIFEST: 0, **{f"{epoch_dir_name(e)}/{MANIFEST}": 0 for e in sp.epochs}}
        a, b = sp.ranks
        need = sum(sp.written.values()) + sp.root_bytes  # stage's own space check: every file it writes
        fields = dict(
            path=f"node slice of ranks {a}-{b} of {sp.world_size}",
            shards=(b - a + 1) * len(sp.epochs),
            bytes_per_node=kept,
            read_amplification=round(read / kept, 4) if kept else None,
            note=None
            if all(sp.by_rows.values())
            else "epochs written before row hashes are verified by reading their shards whole",
        )
    else:
        kind, plans = make_plan(src, parse_epochs(epochs), parse_ranks(ranks), micro_batch)
        dest = Path(dest)
        jobs = lambda: (j for p in plans for j in p.jobs)  # each made as its turn comes (stage_plan.CopyJobs)
        passes = [
            plan_pass(
                "copy",
                sum(len(p.jobs) for p in plans),
                STAGE_BLOCK,
                sum(j.size or 0 for j in jobs()),
                bytes_to_copy(dest, plans),
                files_in_place=sum(in_place(dest / j.rel, j.size) for j in jobs()),
            )
        ]
        manifests = {f"{p.rel}/{MANIFEST}".lstrip("/"): len(canonical_bytes(p.manifest)) for p in plans}
        need = bytes_to_write(dest, plans)
        fields = dict(
            path=kind,
            shards=sum(j.rel.endswith(".ds") for j in jobs()),
            note=whole_copy_note(plans, parse_ranks(ranks), micro_batch, src.path, str(dest)),
        )
    return planned_result(
        "stage",
        str(dest),
        passes,
        [(Path(dest), need)],
        ExecutorConfig(workers=workers),
        disk_mbps,
        own_workers=True,  # stage runs its workers itself (copy threads, or a replacement node's processes)
        manifests=manifests,
        **fields,
    )
