"""Shuffle run orchestration with resume: `shuffle_run` plans every epoch asked for, checks
that OUT holds the same run (or none), and writes each epoch through `run_epoch`, which picks
the in-memory or out-of-core path (shuffle/steps.py) and runs its passes with the injected
`run_passes`.

Every task is idempotent: a finished task leaves a done JSON (written last) in the work
folder `OUT/.tokpack-work/`, and a rerun skips it. The epoch manifest is written after every
shard is done, then the run manifest; the work folder is removed last.

What an epoch holds in memory and on disk is here too: whether it runs in memory (its packing's
`memory_path`), each out-of-core task's budget, its planned manifest, its bytes and scratch, and
the peak bytes a run writes on OUT's filesystem (checked before a byte is written, and reported
by `tokpack plan shuffle`). What a run decides before it writes, its records, and whether OUT
holds the same run are tokpack.shuffle.run_setup's.
"""

from __future__ import annotations

import contextlib
import shutil
import time
import uuid
from pathlib import Path

from tokpack.formats.errors import TokpackError
from tokpack.formats.constants import WORK_DIR, MANIFEST
from tokpack.formats.guard import bytes_under, check_space, is_no_space, locked_output
from tokpack.formats.io.gate import read_record
from tokpack.formats.io.writes import remove_tmp_files
from tokpack.formats.io.progress_log import progress_on
from tokpack.formats.outputs import LocalOutput, Output
from tokpack.formats.names import epoch_dir_name, metadata_text
from tokpack.formats.reading import canonical_bytes
from tokpack.formats.shards import PackedSource, is_own_file, shard_suffixes
from tokpack.formats.units import counted

from . import packings
from .sources import is_virtual
from .spec import ShuffleSpec
from .epoch_job import EpochJob, source_changed_error
from .steps import Layout, make_layout
from .run_setup import epoch_manifest_of, job_epoch_manifest, setup_run


def epoch_layout(job: EpochJob, *, memory: int, workers: int, tasks: int | None) -> Layout | None:
    """The out-of-core layout of the epoch's passes, or None when it runs in memory."""
    if packings.of_plan(job.plan).memory_path(job, memory)[1] <= memory:
        return None
    return make_layout(job, task_budget(memory, workers), tasks or workers)


def task_budget(memory: int, workers: int) -> int:
    """Out of core, the bytes each of `workers` concurrent tasks may use."""
    return max(1, memory // workers)


def planned_epoch_manifest(job: EpochJob, sources: list[PackedSource]) -> dict:
    """The epoch manifest as the run will write it, but for its checksums and its fragment
    counts, which are estimates (a sample is cut at each document end: one fragment per sample
    plus the sources' documents per token): its size is the written one's to a few bytes."""
    docs, tokens = (sum(int(s.manifest.get(k, 0)) for s in sources) for k in ("documents", "tokens"))
    plan, per_row = job.plan, 1 + docs / max(1, tokens) * job.plan.row_tokens
    entries = []
    for i in range(job.n_shards):
        g0, g1 = job.shard_range(i)
        entries.append(
            {
                "path": job.shard_file(i),
                "tokens": (g1 - g0) * plan.row_tokens,
                "bytes": (g1 - g0) * job.row_bytes,
                "samples": g1 - g0,
                "index_xxh3_128": "0" * 32,
                "rows_xxh3_128": "0" * 32,
                "metadata_xxh3_128": "0" * 32,
                "multiset_hash": "0" * 16,
                "fragments": int((g1 - g0) * per_row),
            }
        )
    # the default packing's name whatever the packing: `plan` has always counted a planned
    # epoch manifest's bytes so
    return job_epoch_manifest(job, entries, packings.named(packings.DEFAULT).shuffle)


def epoch_bytes(job: EpochJob, manifest: dict) -> int:
    """Bytes of the epoch directory its planned manifest describes: each shard's rows, its
    index (8 bytes a fragment), its row hashes (8 bytes a sample), its .ds.metadata, and the manifest."""
    meta = sum(
        len(metadata_text(job.tokenizer, job.token_dtype.itemsize, s["tokens"]).encode()) for s in manifest["shards"]
    )
    return (
        manifest["tokens"] * job.token_dtype.itemsize
        + 8 * manifest["fragments"]
        + 8 * manifest["samples"]
        + meta
        + len(canonical_bytes(manifest))
    )


def bytes_to_write(jobs: list[EpochJob], sources: list[PackedSource], memory: int, workers: int = 1) -> int:
    """Peak bytes on OUT's filesystem while these epochs are written, less what a resumed run has
    there already: the epochs written before, then this epoch's files with, out of core, its
    bucket scratch, of which the order pass deletes each shard's part once the shard is
    written: the peak is the scratch plus the first shard. To a bucket, the local folder holds
    the scratch and a shard per worker at most, each sent and removed once committed."""
    peak = written = 0
    for job in jobs:
        epoch = epoch_bytes(job, planned_epoch_manifest(job, sources))
        shard = epoch * min(1, job.shard_samples / max(job.plan.samples, 1))
        have = bytes_under(job.epoch_dir) + bytes_under(job.work_dir)
        during = job.output.local_need(epoch, workers * shard)
        entry = packings.of_plan(job.plan)
        if entry.memory_path(job, memory)[1] > memory:
            during = entry.scratch_bytes(job, True) + shard
        else:
            during += entry.scratch_bytes(job, False)
        peak = max(peak, written + max(0, during - have))
        written += job.output.local_need(max(0, epoch - have), 0)
    return int(max(peak, written))


@contextlib.contextmanager
def _source_check(job: EpochJob, layout: Layout | None):
    """A task that found a changed source shard left a marker: whatever the executor made of
    the task's failure, the user gets the marker's one line, and the scatter output that came
    from the changed source is deleted."""
    try:
        yield
    except BaseException:
        marker = job.source_changed_path
        if not marker.exists():
            raise
        record = read_record(marker)
        marker.unlink()
        if layout is not None:
            shutil.rmtree(layout.dir, ignore_errors=True)
        work, edir = Path(job.work_dir), Path(job.epoch_dir)
        if not any(work.glob("done/*.json")):  # nothing an earlier attempt finished: leave no trace
            shutil.rmtree(work, ignore_errors=True)
        for d in (edir, work.parent):
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        if record is None or not {"shard", "expected", "found"} <= record.keys():
            raise  # a damaged marker names no shard: the task's own failure stands
        raise source_changed_error(record) from None


def run_epoch(job: EpochJob, *, memory: int, workers: int, tasks: int | None, run_passes, log) -> dict:
    """Writes one epoch directory (all shards, then its manifest). Returns a summary."""
    plan = job.plan
    packing = packings.of_plan(plan)
    work = Path(job.work_dir)
    Path(job.epoch_dir).mkdir(parents=True, exist_ok=True)
    remove_tmp_files(job.epoch_dir)
    # A fresh name per invocation: our own done files decide what is skipped, so datatrove's
    # completion markers from an earlier attempt (maybe with another layout) must never match.
    attempt = uuid.uuid4().hex[:8]
    logs = work / "logs" / attempt
    needed, held = packing.memory_path(job, memory)
    in_memory = held <= memory
    prepared = packing.prepare(job, memory)  # what its steps need built first (best-fit: the row table)
    name = f"{epoch_dir_name(plan.epoch)}-{attempt}"
    job.source_changed_path.unlink(missing_ok=True)  # an earlier attempt's: this one reads the sources again
    shards_left = [i for i in range(job.n_shards) if job.shard_done(i) is None]
    reused = job.n_shards - len(shards_left)
    if shards_left and reused:
        log(
            f"epoch {plan.epoch}: resuming: {reused} of {job.n_shards} shards were written by an earlier "
            f"attempt and are reused; {len(shards_left)} left to write"
        )
    try:
        layout = None
        if not shards_left:  # a rerun after every shard finished: only the manifest is missing
            log(
                f"epoch {plan.epoch}: {'all ' * (job.n_shards != 1)}{counted(job.n_shards, 'shard')} already written; "
                "writing the manifest"
            )
        elif in_memory:
            step, label, words = packing.in_memory(job, prepared, memory, needed, held)
            log(f"epoch {plan.epoch}: writing {plan.samples} samples, {words}")
            with _source_check(job, None):
                run_passes([(step, 1, f"{name}-{label}", str(logs / label))])
        else:
            budget = task_budget(memory, workers)
            layout = make_layout(job, budget, tasks or workers)
            log(
                f"epoch {plan.epoch}: writing {plan.samples} samples, out of core ({needed / 2**20:.1f} MiB of windows, "
                f"{counted(layout.tasks, 'scatter task')}, {counted(len(layout.bucket_starts) - 1, 'bucket')}, "
                f"{counted(job.n_shards, 'shard')})"
            )
            scatter, order = packing.out_of_core(job, layout, prepared, budget)
            passes = [
                (scatter, layout.tasks, f"{name}-scatter", str(logs / "scatter")),
                (order, job.n_shards, f"{name}-order", str(logs / "order")),
            ]
            if all(layout.scatter_done(t) for t in range(layout.tasks)):
                if all(packing.scattered(job, layout, i) for i in shards_left):
                    passes = passes[1:]  # a rerun after the scatter pass finished: no array of no-op tasks
                    log(
                        f"epoch {plan.epoch}: scatter pass already done; {counted(len(shards_left), 'shard')} left to order"
                    )
                else:  # a written shard was lost after its bucket files went: scatter again
                    shutil.rmtree(layout.dir)
            try:
                with _source_check(job, layout):
                    run_passes(passes)  # on Slurm both passes are queued at once, order after scatter
            finally:
                for step, *_ in passes:
                    step.close_bar()
    except BaseException as e:
        if not is_no_space(e):
            raise
        # Out of space: the bucket scratch and any half-written shard go, so the disk is not left
        # full; the finished shards (and their done markers) stay for the rerun.
        for d in [*work.glob("ooc-*"), work / "packing", work / "packing.tmp"]:
            shutil.rmtree(d, ignore_errors=True)
        remove_tmp_files(job.epoch_dir)
        raise TokpackError(
            f"disk full while writing epoch {plan.epoch}; its scratch files were removed",
            file=job.epoch_dir,
            expected="free space",
            found="No space left on device",
            hint="free some space (or choose another -o), then rerun the same command; finished shards are kept",
        ) from e
    entries = []
    for i in range(job.n_shards):
        entry = job.done_entry(i)
        if entry is None:
            raise TokpackError(
                "output shard did not complete",
                file=Path(job.epoch_dir) / job.shard_file(i),
                hint="rerun the same command; completed shards are kept",
            )
        entries.append(entry)
    keep = {e["path"] + ext for e in entries for ext in shard_suffixes(e)}
    for edir in {Path(job.epoch_dir), job.output.where(job.epoch_dir)}:  # here, and where its shards went
        for p in list(edir.iterdir()) if edir.is_dir() else []:  # leftovers of an earlier, different attempt
            if p.name not in keep and is_own_file(p):
                p.unlink()
    manifest = epoch_manifest_of(job, entries, prepared)
    job.output.finish(job.epoch_dir, manifest)
    job.output.remove_tree(work)
    return {
        "epoch": plan.epoch,
        "path": "in-memory" if in_memory else "out-of-core",
        "samples": plan.samples,
        "shards": job.n_shards,
        "shards_reused": reused,
        "bytes_written": sum(entries[i]["bytes"] for i in shards_left),
        "sample_multiset_hash": manifest["sample_multiset_hash"],
        "packing": packings.shown(manifest),
    }


@locked_output("shuffle")
def shuffle_run(
    spec: ShuffleSpec,
    output: str,
    *,
    local: list[str] | None = None,
    log=None,
    workers: int = 1,
    tasks: int | None = None,
    run_passes,
    progress: bool | None = None,
    to: Output = LocalOutput(),
) -> dict:
    """Writes OUT/epoch-NNNNN/ for each epoch of `spec` (tokpack.shuffle.spec; skipping complete
    identical ones) and the run manifest. `spec.memory` is the total budget: the out-of-core path
    gives each of `workers` concurrent tasks memory // workers. `local`: the local copies of
    `spec.sources` when they are URLs (the manifests record the sources as the spec names them:
    plan.source_location, a local path resolved, an object-store URL as given). `progress`: bars
    on stderr, lines in a log (tokpack.formats.io.progress; default: unless TOKPACK_PROGRESS is off).
    `run_passes([(step, tasks, job_name, logging_dir), ...])` runs dependent passes in order
    (tokpack.packer.executors.pass_runner makes one). `to`: where the run goes
    (tokpack.formats.outputs; to a bucket, `output` is its local folder and holds the state fetched
    from the store). Returns a summary dict, with per-source counts of every epoch written and a
    warning per source an epoch repeats windows of (tokpack.packer.api.shuffle takes URLs and
    returns it as a ShuffleResult)."""
    t0 = time.perf_counter()
    log = log or (lambda line: None)
    memory = spec.memory
    if progress is None:
        progress = progress_on()
    virtual = [p for p in (spec.sources if local is None else local) if is_virtual(p)]
    if virtual:
        raise TokpackError(
            "a virtual source has no data to shuffle",
            file=virtual[0],
            where="SOURCE",
            expected="a packed source directory",
            hint="plan it instead: tokpack plan shuffle ...",
        )
    setup = setup_run(spec, output, local=local, workers=workers, progress=bool(progress), to=to)
    out = Path(output)
    done_epochs, runplan, skipped, summaries = setup.done_epochs, setup.runplan, [], []
    # The samples alone, by arithmetic, before the exact count below spends time per shard.
    check_space(
        [(out, sum(job.plan.samples * job.row_bytes for job in setup.jobs) - bytes_under(out))],
        "shuffle",
        hint="ask for fewer samples, free some space there, or choose another -o",
    )
    check_space(
        [(out, bytes_to_write(setup.jobs, setup.sources, memory, workers))],
        "shuffle",
        hint="free some space there, choose another -o, or write fewer epochs per command (--epoch E)",
    )
    # a scheduled run's manifest, before any epoch: its numbering, fixed at creation
    if setup.run_params is not None and setup.todo and not (out / MANIFEST).exists():
        out.mkdir(parents=True, exist_ok=True)
        to.finish(out, setup.written_run_manifest(out, setup.todo[0][1], done_epochs))
    for epoch, plan, job in setup.todo:
        out.mkdir(parents=True, exist_ok=True)
        if job is None:
            skipped.append(epoch)
            log(f"epoch {epoch}: already complete, skipped")
        else:
            report = plan.source_report()  # before the epoch's table: it counts repeats from the passes kept
            summary = run_epoch(job, memory=memory, workers=workers, tasks=tasks, run_passes=run_passes, log=log)
            summary["stage"] = runplan.stage_name(epoch)
            summary["sources"] = report
            summaries.append(summary)
        # The epoch is complete: no work folder of its number can be resumed any more, neither
        # what a kill left while its scratch was being removed nor an interrupted attempt's with
        # other settings (another seed, --seq-len...), which would otherwise hold its scratch for good.
        for stale in (out / WORK_DIR).glob(f"{epoch_dir_name(epoch)}-*"):
            to.remove_tree(stale)
        done_epochs = sorted(set(done_epochs) | {epoch})
        to.finish(out, setup.written_run_manifest(out, plan, done_epochs))
    held = None
    if setup.holdout is not None:  # the held-out documents, an epoch directory of their own (never listed)
        log(f"holdout: writing {setup.holdout.plan.samples} samples of held-out documents to {setup.holdout.epoch_dir}")
        held = run_epoch(setup.holdout, memory=memory, workers=workers, tasks=tasks, run_passes=run_passes, log=log)
        held.update(
            path=str(to.shown(Path(setup.holdout.epoch_dir).absolute())),
            stage=None,
            sources=setup.holdout.plan.source_report(),
        )
    work = out / WORK_DIR
    if work.exists() and not any(work.iterdir()):
        work.rmdir()
    seconds = time.perf_counter() - t0
    # as pack's: the same folder whatever the job's cwd
    return run_summary(setup, to.shown(out.absolute()), done_epochs, summaries, skipped, seconds, held)


def run_summary(
    setup, output: str, epochs: list[int], summaries: list[dict], skipped: list[int], seconds: float, holdout=None
) -> dict:
    """A run's summary: the epochs written (`summaries`, run_epoch's), `skipped` and `epochs`, all
    the run holds; `shuffle --to-nodes` reports the same fields (tokpack.packer.exchange)."""
    written = sum(s["bytes_written"] for s in summaries)
    sizes = [setup.runplan.epoch_plan(e).samples for e in epochs]  # a schedule's stages differ in size
    return {
        "output": output,
        "epochs": epochs,
        "written": [s["epoch"] for s in summaries],
        "skipped": skipped,
        "reused_shards": sum(s["shards_reused"] for s in summaries),
        "samples_per_epoch": sizes[0] if len(set(sizes)) == 1 else None,
        "epoch_samples": sizes,
        "seq_len": setup.runplan.schedule.seq_len,
        "shard_samples": setup.shard_samples,
        "packing": setup.runplan.packing.name,
        "holdout": holdout,
        "path": ",".join(sorted({s["path"] for s in summaries})) or "none",
        "bytes_written": written,
        "seconds": round(seconds, 3),
        "mb_per_s": round(written / 1e6 / seconds, 1) if seconds > 0 and written else None,
        "epochs_detail": summaries,
        "warnings": [w for s in summaries for w in repeat_warnings(s["epoch"], s["sources"], s["stage"])],
    }


def repeat_warnings(epoch: int, report: list[dict], stage: str | None = None) -> list[str]:
    """One line per source whose windows this epoch holds more than once. `stage`: the epoch's
    stage in a schedule (None: a run made with flags), whose sizes and weights are the file's."""
    lines = []
    for r in report:
        if not r["repeats"]:
            continue
        span = (
            f"pass {r['first_pass']}"
            if r["passes"] == 1
            else f"passes {r['first_pass']}-{r['first_pass'] + r['passes'] - 1}"
        )
        if stage is None:
            why = (
                "it has fewer windows than its share of the epoch; lower its weight or --samples/--tokens, or add data"
                if r["samples"] > r["windows"]
                else "the epoch ends one pass over it and starts the next, "
                "and the two passes' orders differ; epochs that are whole passes (no --samples/--tokens/weights) "
                "never repeat"
            )
        else:
            why = (
                f"the schedule's stages take more than its windows; in the schedule file lower its weight or "
                f"the size of stage {stage!r} (or of the stages before it), or add data"
            )
        where = f"epoch {epoch}" if stage is None else f"epoch {epoch} (stage {stage})"
        # the count and its total in one unit: samples (a window plan's), or document pieces (best-fit's,
        # whose passes are packed afresh, so only pieces repeat)
        unit, total = r.get("repeat_unit", "samples"), r.get("repeat_total", r["samples"])
        what = (
            f"repeat a window ({r['windows']} windows, {span})"
            if unit == "samples"
            else f"repeat a piece the epoch holds already ({r['samples']} samples, {span})"
        )
        lines.append(
            f"{where}: source {r['name']} ({r['path']}) is used more than once: {r['repeats']} of its "
            f"{total} {unit} {what}. HINT: {why}"
        )
    return lines
