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

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tokpack.formats.errors import TokpackError
from tokpack.formats.guard import physical_memory, space_needs
from tokpack.formats.manifest import MANIFEST, canonical_bytes, epoch_dir_name, source_manifest
from tokpack.packer.shared import ExecutorConfig, Result, as_paths, optional_field, weighted_sources

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


def _result(command: str, output: str, passes: list[dict], needs: list[tuple], config: ExecutorConfig,
            disk_mbps: float | None, concurrent: bool, **fields) -> PlanResult:
    """`passes` get their predicted seconds; `concurrent`: whether tasks running at once have a
    disk each (slurm, ray), so a pass of T tasks moves its bytes min(T, workers) times faster."""
    space = [{"path": str(path), "filesystem": str(where), "needed_bytes": needed, "free_bytes": free,
              "enough": needed <= free} for path, where, needed, free in space_needs(needs)]
    if disk_mbps is not None and disk_mbps <= 0:
        raise TokpackError("disk throughput must be positive", where="--disk-mbps", expected="> 0", found=disk_mbps)
    mbps, disk = (float(disk_mbps), "given") if disk_mbps else measure_disk(Path(space[0]["filesystem"]))
    for p in passes:
        at_once = 1 if not concurrent else p["tasks"] if config.workers == 1 else min(config.workers, p["tasks"])
        moved = p["read_bytes"] + p["written_bytes"]
        p["seconds"] = None if mbps is None else round(max(moved / (mbps * 1e6) / at_once,
                                                           p.get("decode_seconds") or p.get("pack_seconds") or 0), 1)
    from tokpack.packer.executors import runs_in_process

    startup = COMMAND_START_SECONDS + (0 if runs_in_process(config) else EXECUTOR_START_SECONDS * len(passes))
    total = None if mbps is None else round(sum(p["seconds"] for p in passes) + startup, 1)
    return PlanResult(command=command, output=str(output), passes=passes, space=space, workers=config.workers,
                      executor=config.executor, disk_mbps=mbps, disk=disk, startup_seconds=startup,
                      predicted_seconds=total, **fields)


def _pass(name: str, tasks: int, memory: int | None, read: int, written: int, **extra) -> dict:
    return {"name": name, **extra, "tasks": tasks, "memory_per_task": memory, "read_bytes": read,
            "written_bytes": written}


def _local(paths: list[str]) -> list[str]:
    """The local paths (`file://` URLs included) a plan reads or writes next to; other URLs are refused."""
    from tokpack.packer.executors import local_path

    for p in paths:
        if local_path(p) is None:
            raise TokpackError("tokpack plan reads local paths", file=p, expected="a local path or a virtual source",
                               found="a URL", hint="plan with a local copy of the manifests, or a virtual: source")
    return [local_path(p) for p in paths]


# ------------------------------------------------------------------------ the commands


def plan_shuffle(sources, output, *, seq_len: int | None = None, seed: int | None = None, epochs=None,
                 samples: int | None = None, tokens: int | None = None, shard_samples: int | None = None,
                 memory: int = 4 << 30, jitter: bool = False, executor: ExecutorConfig | None = None,
                 disk_mbps: float | None = None, schedule=None, scratch=None, packing: str | None = None,
                 pad_id: int | None = None, like=None, holdout=None) -> PlanResult:
    """What `shuffle` with these arguments would do (`like`: as shuffle's, tokpack.shuffle.like). A source may be virtual:
    `virtual:tokens=11T,documents=5.5B,dtype=uint16` (shuffle/plan.py, virtual_source). `schedule`:
    a schedule file instead of sources and their settings (every epoch unless `epochs` says).
    `scratch` is taken as shuffle takes it, and is unused: only a URL output writes there, and
    a plan's output is local."""
    from tokpack.shuffle.packings import figures_shown, of_plan
    from tokpack.shuffle.steps import BUCKETS_PER_FOLDER
    from tokpack.shuffle.run import (bytes_to_write, epoch_bytes, epoch_layout, memory_path, planned_epoch_manifest,
                             repeat_warnings, run_manifest_of, scratch_bytes, setup_run, task_budget)

    from tokpack.shuffle.schedule import epoch_numbers, read_schedule

    if like is not None:
        from tokpack.shuffle.like import apply_like

        s = apply_like({"like": like, "output": output, "epochs": epochs, "sources": sources, "seq_len": seq_len,
                        "seed": seed, "samples": samples, "tokens": tokens, "shard_samples": shard_samples,
                        "jitter": jitter, "schedule": schedule, "packing": packing, "pad_id": pad_id,
                        "holdout": holdout})
        sources, output, seq_len, seed, samples, tokens = (s[k] for k in ("sources", "output", "seq_len", "seed",
                                                                          "samples", "tokens"))
        shard_samples, jitter, schedule, packing, pad_id, holdout = (
            s[k] for k in ("shard_samples", "jitter", "schedule", "packing", "pad_id", "holdout"))
    config = executor or ExecutorConfig()
    scheduled = read_schedule(schedule) if schedule is not None else None
    paths, weights = weighted_sources(sources) if scheduled is None else ([], None)
    *paths, output = _local(paths + [str(output)])
    if epochs is None and scheduled is None:
        epochs = 1
    setup = setup_run(paths, str(output), weights=weights, seq_len=seq_len, seed=seed,
                      epochs=epoch_numbers(epochs),
                      samples=samples, tokens=tokens, shard_samples=shard_samples, memory=memory, jitter=jitter,
                      workers=config.workers, schedule=scheduled, packing=packing, pad_id=pad_id,
                      holdout=holdout)
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
            details.append({"epoch": epoch, "stage": stage, "path": "complete already", "samples": plan.samples,
                            "sources": report})
            continue
        read = sum(src.tokens * src.dtype.itemsize for src, sp in zip(opened, plan.sources) if sp.samples)
        manifest = planned_epoch_manifest(job, opened)
        written[epoch] = manifest
        size = epoch_bytes(job, manifest)
        manifests[f"{epoch_dir_name(epoch)}/{MANIFEST}"] = len(canonical_bytes(manifest))
        layout = epoch_layout(job, memory=memory, workers=config.workers, tasks=config.tasks)
        detail = {"epoch": epoch, "stage": stage, "path": "in-memory" if layout is None else "out-of-core",
                  "samples": plan.samples, "shards": job.n_shards, "output_bytes": size, "sources": report}
        entry, tokens = of_plan(plan), plan.samples * plan.row_tokens
        # What the summary will show of its rows: a padded packing's counted now (its passes packed once more).
        fig = None if entry.figures is None else entry.figures(plan, opened, memory)
        detail["packing"] = figures_shown(entry, tokens, 0 if fig is None else fig.padding_tokens,
                                          {} if fig is None else fig.fields())
        table, table_estimate = 0, entry.table_estimate
        if table_estimate is not None:  # first the row table, built in the work folder within --memory
            est = table_estimate(job, opened)
            table = est["table_bytes"]
            detail.update(table_pieces=est["pieces"], table_bytes=table)
            passes.append(_pass("table", 1, memory, table, table, epoch=epoch, pack_seconds=est["pack_seconds"]))
        if layout is None:
            detail["memory_bytes"] = memory_path(job, memory)[1]
            if ram is not None and detail["memory_bytes"] > ram:
                warnings.append(f"epoch {epoch} runs in memory (it fits --memory {memory:,}) and needs "
                                f"{_size(detail['memory_bytes'])}, more than this machine's {_size(ram)} of RAM. HINT: "
                                f"give a --memory below the RAM (e.g. {ram // 2:,}) to run it out of core")
            passes.append(_pass("in-memory", 1, detail["memory_bytes"], read, size, epoch=epoch))
        else:
            budget, scratch = task_budget(memory, config.workers), scratch_bytes(job)
            detail.update(scatter_tasks=layout.tasks, buckets=len(layout.bucket_starts) - 1,
                          bucket_files=2 * layout.tasks * (len(layout.bucket_starts) - 1),
                          files_per_folder=2 * min(BUCKETS_PER_FOLDER, len(layout.bucket_starts) - 1), scratch_bytes=scratch,
                          max_bucket_rows=layout.max_bucket, scatter_block_rows=layout.block_rows)
            buckets, bucket_files = buckets + detail["buckets"], bucket_files + detail["bucket_files"]
            passes += [_pass("scatter", layout.tasks, budget, read, scratch - table, epoch=epoch),
                       _pass("order", job.n_shards, budget, scratch - table, size, epoch=epoch)]
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
        "shuffle", str(output), passes, [(output, bytes_to_write(setup.jobs, opened, memory))], config, disk_mbps,
        config.executor != "local", path=",".join(paths_taken) or "none",
        shards=sum(d.get("shards", 0) for d in details), manifests=manifests,
        samples_per_epoch=sizes.pop() if len(sizes) == 1 else None,
        sources=[{"name": sp.name, "path": sp.path, "tokens": sp.tokens, "windows": sp.windows, "samples": sp.samples,
                  "passes": plan.passes(i), "first_pass": plan.first_pass(i)} for i, sp in enumerate(plan.sources)],
        epochs=details, buckets=buckets if bucket_files else None, bucket_files=bucket_files or None,
        holdout=None if setup.holdout is None else {  # its bytes are in `space`, with the epochs'
            "path": setup.holdout.epoch_dir, "samples": setup.holdout.plan.samples, "shards": setup.holdout.n_shards,
            "sources": setup.holdout.plan.source_report()},
        warnings=warnings or None)


def plan_pack(inputs, output, *, input_format: str = "auto", column: str | None = None, dtype: str | None = None,
              tokenizer: str | None = None, eos_id: int | None = None, vocab_size: int | None = None,
              overwrite: bool = False, shard_tokens: int = 1 << 30, executor: ExecutorConfig | None = None,
              disk_mbps: float | None = None, scratch=None, link: bool = False) -> PlanResult:
    """What `pack` with these arguments would do: one task per input file, its shards of at most
    `shard_tokens` tokens cut at document ends (so at least tokens / shard_tokens of them).
    `scratch`: as in plan_shuffle, unused. `link`: which bytes pack --link would link, not copy
    (a datatrove input whose documents do not all end with EOS is found only by the scan, and copied)."""
    from tokpack.formats.inputs.tables import PARQUET_DECODE_THREADS
    from tokpack.packer.packing import known_tokens, pack_tasks, setup_pack

    config = executor or ExecutorConfig()
    *paths, output = _local(as_paths(inputs) + [str(output)])
    out = Path(output).absolute()
    setup = setup_pack(paths, out, input_format=input_format, column=column, dtype=dtype, tokenizer=tokenizer,
                       eos_id=eos_id, vocab_size=vocab_size, overwrite=overwrite, shard_tokens=shard_tokens,
                       link=link)
    done = setup.state == "complete"
    counts = [known_tokens(f) for f in setup.files]
    shards = [] if done or None in counts else [-(-n // shard_tokens) for n in counts]
    written = 0 if done else setup.bytes_to_write(out)
    manifests = {}
    if shards:  # the source manifest with placeholder checksums: its size, to a few bytes

        def size(n: int) -> int:
            entries = [{"path": f"{i:05d}.ds", "tokens": shard_tokens, "bytes": shard_tokens * setup.out_dtype.itemsize,
                        "documents": 0, "xxh3_128": "0" * 32, "index_xxh3_128": "0" * 32,
                        "metadata_xxh3_128": "0" * 32} for i in range(n)]
            return len(canonical_bytes(source_manifest(
                entries, setup.out_dtype, setup.vocab, setup.eos, setup.tok_name, inputs=setup.request["inputs"],
                shard_tokens=int(shard_tokens), eos_appended=0, empty_documents_dropped=0, created_by="tokpack",
                request=setup.request)))

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
    return _result("pack", str(output), passes, [(out, written)], config, disk_mbps, config.executor != "local",
                   path=setup.fmt, shards=sum(shards), manifests=manifests, copy_bytes=links and links.copy,
                   link_bytes=links and links.hardlink, reflink_bytes=links and links.reflink,
                   link_notes=links.notes if links and link else None)


def plan_stage(directory, dest, *, workers: int = 4, epochs=None, ranks=None, micro_batch: int = 1,
               world_size: int | None = None, node=None, ranks_per_node: int | None = None, start_sample: int = 0,
               disk_mbps: float | None = None, shards_of=None, memory: int | None = None) -> PlanResult:
    """What `stage` with these arguments would do: every file is read once (hashed), the ones not
    in place at DEST are written; the copy threads share DEST's disk. A node slice (world_size
    or node): the bytes its node keeps and reads, by arithmetic on the run's manifests.
    `memory` (stage's, a replacement node's budget) changes none of these bytes."""
    from tokpack.packer.staging import (STAGE_BLOCK, Source, in_place, bytes_to_copy, bytes_to_write, make_plan, parse_epochs,
                                parse_ranks, whole_copy_note, whole_shard_ranks)

    ranks = whole_shard_ranks(shards_of, ranks, world_size, node)
    (dest,) = _local([str(dest)])
    if world_size is not None or node is not None:
        from tokpack.packer.slicing import CHUNK_BYTES, plan_slice

        sp = plan_slice(Source(str(directory)), ranks, world_size, micro_batch, node, ranks_per_node, start_sample,
                        epochs)
        kept, read = sum(sp.kept.values()), sum(sp.read.values())
        passes = [_pass("slice", len(sp.epochs), CHUNK_BYTES, read, kept)]
        manifests = {MANIFEST: 0, **{f"{epoch_dir_name(e)}/{MANIFEST}": 0 for e in sp.epochs}}
        a, b = sp.ranks
        need = sum(sp.written.values()) + sp.root_bytes  # stage's own space check: every file it writes
        return _result("stage", str(dest), passes, [(Path(dest), need)], ExecutorConfig(workers=workers), disk_mbps,
                       False, path=f"node slice of ranks {a}-{b} of {sp.world_size}", shards=(b - a + 1) * len(sp.epochs),
                       manifests=manifests, bytes_per_node=kept,
                       read_amplification=round(read / kept, 4) if kept else None,
                       note=None if all(sp.by_rows.values()) else
                       "epochs written before row hashes are verified by reading their shards whole")
    src = Source(str(directory))
    kind, plans = make_plan(src, parse_epochs(epochs), parse_ranks(ranks), micro_batch)
    dest = Path(dest)
    jobs = [j for p in plans for j in p.jobs]
    copy = bytes_to_copy(dest, plans)
    passes = [_pass("copy", len(jobs), STAGE_BLOCK, sum(j.size or 0 for j in jobs), copy,
                    files_in_place=sum(in_place(dest / j.rel, j.size) for j in jobs))]
    manifests = {f"{p.rel}/{MANIFEST}".lstrip("/"): len(canonical_bytes(p.manifest)) for p in plans}
    return _result("stage", str(dest), passes, [(dest, bytes_to_write(dest, plans))], ExecutorConfig(workers=workers),
                   disk_mbps, False,
                   path=kind, shards=sum(j.rel.endswith(".ds") for j in jobs), manifests=manifests,
                   note=whole_copy_note(plans, parse_ranks(ranks), micro_batch, src.path, str(dest)))


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

    shards = f"{r.shards:,} shard(s)"
    if r.command == "pack":
        shards = f"at least {shards}" if r.shards else "shards unknown (the inputs do not tell their token count)"
    written = ("nothing written" if not r.disk.startswith("measured") else  # the probe's file: gone, but written
               "no output written (the disk probe wrote and read back a temporary file; --disk-mbps skips it)")
    lines = [f"plan {r.command} -> {r.output}: {r.path}, {shards}; {written}"]
    if r.samples_per_epoch is not None:
        lines.append(f"  samples per epoch: {r.samples_per_epoch:,}")
    tokens = {s["name"]: s["tokens"] for s in r.sources or []}
    for e in r.epochs or []:
        extra = "" if e["path"] != "out-of-core" else (
            f", {e['scatter_tasks']} scatter tasks, {e['buckets']:,} buckets (at most {e['bucket_files']:,} bucket "
            f"files), {_size(e['scratch_bytes'])} scratch")
        if "table_bytes" in e:
            extra += f", row table of ~{e['table_pieces']:,} pieces ({_size(e['table_bytes'])} scratch)"
        stage = "" if e["stage"] is None else f" (stage {e['stage']})"
        lines.append(f"  epoch {e['epoch']}{stage}: {e['path']}, {e['samples']:,} samples, {e.get('shards', 0):,} "
                     "shards" + extra)
        unit = e["packing"]["unit"] if "packing" in e else "windows"  # a best-fit pass's rows, or windows
        if "packing" in e:
            lines.append(f"    packing: {shown_line(e['packing'])}")
        lines += [f"    source {s['name']}: {s['samples']:,} samples of {s['windows']:,} {unit}"
                  + " a pass" * (unit != "windows")
                  + (f" ({tokens[s['name']]:,} tokens)" if s["name"] in tokens else "")
                  + f", {s['passes']} pass(es) from pass {s['first_pass']}, {s['repeats']:,} " + ("repeated" if s.get("repeat_unit", "samples") == "samples"
                                                                    else f"{s['repeat_unit']} repeated")
                  for s in e["sources"]]
    if r.holdout is not None:
        h = r.holdout
        lines.append(f"  holdout: {h['samples']:,} samples of held-out documents, {h['shards']:,} shard(s), written "
                     f"once to {h['path']} (" + ", ".join(f"{s['name']} {s['samples']:,}" for s in h["sources"]) + ")")
    for p in r.passes:
        memory = "no set memory bound" if p["memory_per_task"] is None else f"{_size(p['memory_per_task'])} memory"
        lines.append(f"  pass {p['name']}{'' if 'epoch' not in p else ' (epoch %d)' % p['epoch']}: {p['tasks']:,} "
                     f"task(s), {memory} per task, reads {_size(p['read_bytes'])}, writes "
                     f"{_size(p['written_bytes'])}, {_duration(p['seconds'])}"
                     + (f" (decoding Parquet: {_duration(p['decode_seconds'])})" if p.get("decode_seconds") else "")
                     + (f" (packing: {_duration(p['pack_seconds'])})" if p.get("pack_seconds") else ""))
    for s in r.space:
        lines.append(f"  space on {s['filesystem']}: needs {_size(s['needed_bytes'])} (scratch included), "
                     f"{_size(s['free_bytes'])} free: {'enough' if s['enough'] else 'NOT ENOUGH'}")
    if r.bytes_per_node is not None:
        lines.append(f"  node slice: keeps {_size(r.bytes_per_node)} on the node, reads "
                     f"{_size(r.passes[0]['read_bytes'])} (read amplification {r.read_amplification}x)")
    if r.note:
        lines.append(f"  note: {r.note}")
    if r.copy_bytes is not None:
        lines.append(f"  shard files: copies {_size(r.copy_bytes)}, links {_size(r.link_bytes)} (hard links)"
                     + (f", reflinks {_size(r.reflink_bytes)} where its filesystem allows, else copies it"
                        if r.reflink_bytes else ""))
        lines += [f"    {note}" for note in r.link_notes or []]
    lines += [f"  manifest {name}: {n:,} bytes" for name, n in r.manifests.items() if n]
    lines.append(f"  predicted wall time: {_duration(r.predicted_seconds)} ({r.executor}, {r.workers} worker(s), disk "
                 f"{r.disk_mbps if r.disk_mbps is not None else '?'} MB/s {r.disk}; {r.startup_seconds:.1f} s of it "
                 "start-up)")
    return lines
