"""Shuffle run orchestration with resume: `shuffle_run` plans every epoch asked for, checks
that OUT holds the same run (or none), and writes each epoch through `run_epoch`, which picks
the in-memory or out-of-core path (shuffle/steps.py) and runs its passes with the injected
`run_passes`.

Every task is idempotent: a finished task leaves a done JSON (written last) in the work
folder `OUT/.tokpack-work/`, and a rerun skips it. The epoch manifest is written after every
shard is done, then the run manifest; the work folder is removed last.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import xxhash

from tokpack.formats.errors import TokpackError
from tokpack.formats.guard import LOCK_NAME, WORK_DIR, bytes_under, check_space, is_no_space, locked_output
from tokpack.formats.io import MAX_RECORD_BYTES, TMP_MARK, read_limited, remove_tmp_files
from tokpack.formats.outputs import LocalOutput, Output
from tokpack.formats.manifest import (
    HOLDOUT_DIR,
    MANIFEST,
    NODES_SIDECAR,
    canonical_bytes,
    dtype_name,
    epoch_dir_name,
    epoch_manifest,
    metadata_text,
    read_manifest,
    run_manifest,
)
from tokpack.formats.builders import ShuffleFields, TokenHeader
from tokpack.formats.packing import PackingRecord, holdout_recorded
from tokpack.formats.numbering import shuffle_command
from tokpack.formats.shards import PackedSource, is_own_file, shard_suffixes
from tokpack.formats.units import at_most, counted, parse_weight, weight_text

from . import packings
from .holdout import parse_holdout
from .plan import EpochPlan, SamplePlan, is_virtual, open_source, source_location
from .schedule import RunPlan, Schedule, same_source_twice
from .spec import ShuffleSpec
from .steps import ORDER_ROW_OVERHEAD, EpochJob, Layout, make_layout, source_changed_error

DEFAULT_SHARD_BYTES = 1 << 30  # default --shard-samples: about 1 GiB of samples per shard
# Output shards one command plans and writes (each three files and a manifest entry): past this, the
# numbers asked for (--samples, --tokens, --epochs, --shard-samples) are a typo, not a run.
MAX_SHARDS = 10**6
MIN_BUCKET_ROWS = 8  # below this many rows per bucket the out-of-core path spends its time per bucket, not per byte


def open_sources(paths: list[str]) -> list[PackedSource]:
    sources = [open_source(p) for p in paths]
    first = sources[0]
    for src in sources[1:]:
        for field in ("dtype", "vocab_size", "eos_id"):
            if src.manifest.get(field) != first.manifest.get(field):
                raise TokpackError(
                    "sources disagree",
                    file=src.path,
                    where=field,
                    expected=f"{first.manifest.get(field)} (as in {first.path})",
                    found=src.manifest.get(field),
                    hint="mix only sources packed with the same tokenizer and dtype",
                )
    seen: dict = {}
    for src in sources:  # every window would appear twice, and epochs could not tell the copies apart
        for key in (("path", src.path.resolve()), ("fingerprint", src.fingerprint)):
            if key in seen:
                raise same_source_twice(src.path, key[0], seen[key])
            seen[key] = src.path
    return sources


def min_memory(row_bytes: int, workers: int) -> int:
    """The smallest --memory that gives each worker's buckets MIN_BUCKET_ROWS rows (the chunk
    ring takes at most half of a task's budget, see make_layout)."""
    return workers * 2 * MIN_BUCKET_ROWS * (row_bytes + ORDER_ROW_OVERHEAD)


def _weights_key(weights: list[str | None]) -> list[str] | None:
    """Weights as exact shares of their sum: only the ratios decide an epoch, so 7/3 and
    0.7/0.3 are the same run."""
    if all(w is None for w in weights):
        return None
    fr = [parse_weight(w, "weight") if w is not None else None for w in weights]
    total = sum(f for f in fr if f is not None)
    return [None if f is None else str(f / total if total else f) for f in fr]


def _packing_of(plan: SamplePlan) -> dict | None:
    return packings.of_plan(plan).run_fields(plan)


def _run_params(plan: SamplePlan, weights, shard_samples: int) -> dict:
    """What must match for two invocations to belong to the same run."""
    return {
        "shuffle": plan.algorithm,
        "packing": _packing_of(plan),
        "fingerprints": [sp.fingerprint for sp in plan.sources],
        "weights": _weights_key(weights),
        "seq_len": plan.seq_len,
        "seed": plan.seed,
        "jitter": plan.jitter,
        "samples": plan.samples,
        "shard_samples": shard_samples,
        **({} if getattr(plan, "holdout", None) is None else {"holdout": plan.holdout}),
    }


def _schedule_params(runplan: RunPlan, sources: list[PackedSource], shard_samples: int) -> dict:
    """What must match for two invocations to belong to the same run made from a schedule file."""
    fields = runplan.manifest_fields()
    sc = runplan.schedule
    packing = runplan.packing
    return {
        "shuffle": packing.shuffle,
        "packing": packing.settings(sources, **runplan.options),
        "fingerprints": [src.fingerprint for src in sources],
        "weights": None,
        "seq_len": sc.seq_len,
        "seed": sc.seed,
        "jitter": sc.jitter,
        "samples": 0,
        "shard_samples": shard_samples,
        "epoch_samples": fields["epoch_samples"],
        "schedule": _schedule_key(fields["schedule"]),
        **({} if runplan.options.get("holdout") is None else {"holdout": runplan.options["holdout"]}),
    }


def _schedule_key(entries) -> list | None:
    """A run's schedule with its weights as exact shares, as `_weights_key` does for a run's."""
    return None if entries is None else [{**e, "weights": _weights_key(e.get("weights") or [])} for e in entries]


def _params_of_manifest(m: dict) -> dict:
    ws = m.get("weights") if m.get("kind") == "run" else [s.get("weight") for s in m.get("sources", [])]
    ws = ws if ws is not None else [None] * len(m.get("sources", []))
    return {
        "fingerprints": [s.get("fingerprint") for s in m.get("sources", [])],
        "weights": _weights_key(ws),
        "given_weights": ws,  # as the run wrote them
        "jitter": bool(m.get("jitter")),
        "schedule": _schedule_key(m.get("schedule")),
        "given_schedule": m.get("schedule"),  # as the run wrote it
        "shuffle": m.get("shuffle"),
        "packing": None if PackingRecord.of(m) is None else PackingRecord.of(m).settings(),
        **{key: m.get(key) for key in ("seq_len", "seed", "samples", "shard_samples", "epoch_samples")},
        "holdout": holdout_recorded(m)[0],  # formats.packing knows where each packing records it
    }


def _check_same_run(found: dict, wanted: dict, where: Path, like: str | None = None) -> None:
    """`wanted`: the _run_params (or _schedule_params) of this invocation; `like`: the command
    that writes the epoch asked for with the run's own settings, when `where` is a run."""
    # --holdout first (absent: none): it changes a schedule's sizes too, and is then the cause to name
    keys = ["holdout", *(k for k in wanted if k != "holdout")]
    if (
        found.get("holdout") == wanted.get("holdout")
        and found.get("schedule") is not None
        and wanted.get("schedule") is not None
    ):
        old, new = found["schedule"], wanted["schedule"]
        for e in range(max(len(old), len(new))):
            a, b = (old[e] if e < len(old) else None), (new[e] if e < len(new) else None)
            if a != b:
                raise TokpackError(
                    "the schedule differs from the one the run was made with",
                    file=where,
                    where=f"epoch {e}",
                    expected=a or "no such epoch",
                    found=b or "no such epoch",
                    hint="restore the run's schedule file (its xxh3_128 is in the run manifest), "
                    "or write the new schedule to another -o",
                )
    for key in keys:
        if found.get(key) != wanted.get(key):
            raise TokpackError(
                "output directory holds a different run",
                file=where,
                where=key,
                expected=wanted.get(key),
                found=found.get(key),
                hint="use another -o, delete it, or repeat the run's exact sources, weights, "
                "--seq-len, --seed, --jitter, --packing, --holdout, --samples/--tokens and --shard-samples"
                + (f"; to add the epoch with the run's own settings: `{like}`" if like else ""),
            )


def _existing_run(out: Path, to: Output = LocalOutput()) -> dict | None:
    """Parameters of the run already in OUT (run manifest, else any complete epoch), or None.
    To a bucket, OUT holds the state fetched from the store, and the store what else is there."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise TokpackError("output is not a directory", file=out)
    if (out / MANIFEST).exists():
        return _params_of_manifest(read_manifest(out, kind="run"))
    kept = to.where(out)
    listed = kept if kept.exists() else out
    foreign = [
        p.name
        for p in listed.iterdir()
        if not (
            p.name.startswith("epoch-")
            or p.name in (WORK_DIR, LOCK_NAME, HOLDOUT_DIR, NODES_SIDECAR)
            or TMP_MARK in p.name
        )
    ]
    if foreign:
        raise TokpackError(
            "output directory is not a tokpack run",
            file=out,
            where="contents",
            expected="no files, or a run's tokpack.json and epoch-NNNNN/",
            found=", ".join(sorted(foreign)[:5]),
            hint="choose an empty or new -o directory",
        )
    for p in sorted(out.glob("epoch-*/" + MANIFEST)):
        return _params_of_manifest(read_manifest(p.parent, kind="epoch"))
    return None


def _run_manifest(
    out: Path,
    plan: EpochPlan,
    weights,
    sources: list[PackedSource],
    shard_samples: int,
    epochs: list[int],
    runplan: RunPlan,
) -> dict:
    written = {
        e: read_manifest(out / epoch_dir_name(e), kind="epoch")
        for e in epochs
        if (out / epoch_dir_name(e) / MANIFEST).exists()
    }
    created = read_manifest(out, kind="run") if (out / MANIFEST).exists() else None
    return run_manifest_of(written, plan, weights, sources, shard_samples, runplan, created)


def run_manifest_of(
    written: dict,
    plan: EpochPlan,
    weights,
    sources: list[PackedSource],
    shard_samples: int,
    runplan: RunPlan,
    created: dict | None = None,
) -> dict:
    """The run manifest over the epoch manifests `written`; `created`: the run's manifest so far,
    whose schedule fields (fixed when the run was created, maybe spelled otherwise) it keeps."""
    first = sources[0].manifest
    entries = plan.source_entries()
    scheduled = runplan.schedule.file is not None  # the weights and sizes are per epoch, in `schedule`
    extra = runplan.manifest_fields() if scheduled else None
    if scheduled and created is not None:
        extra = {key: created.get(key) for key in extra}
    if _packing_of(plan) is not None:
        extra = {**(extra or {}), "packing": _packing_of(plan)}
    if packings.of_plan(plan).run_holdout(plan):
        extra = {**(extra or {}), **packings.of_plan(plan).run_holdout(plan)}
    return run_manifest(
        written,
        TokenHeader(sources[0].dtype, first["vocab_size"], first["eos_id"], first.get("tokenizer", "")),
        ShuffleFields(
            seed=plan.seed,
            seq_len=plan.seq_len,
            samples=0 if scheduled else plan.samples,
            shard_samples=shard_samples,
            jitter=plan.jitter,
            shuffle=plan.algorithm,
        ),
        sources=[{**e, "weight": None} for e in entries] if scheduled else entries,
        weights=None if scheduled or all(w is None for w in weights) else list(weights),
        extra=extra,
    )


def memory_path(job: EpochJob, memory: int) -> tuple[int, int]:
    """(bytes of the windows to hold, bytes the in-memory path holds with its chunk buffers): the
    epoch runs in memory when the latter fits `memory`. Each packing says (a best-fit epoch: what
    its in-memory path holds, twice)."""
    return packings.of_plan(job.plan).memory_path(job, memory)


def task_budget(memory: int, workers: int) -> int:
    """Out of core, the bytes each of `workers` concurrent tasks may use."""
    return max(1, memory // workers)


def epoch_layout(job: EpochJob, *, memory: int, workers: int, tasks: int | None) -> Layout | None:
    """The out-of-core layout of the epoch's passes, or None when it runs in memory."""
    if memory_path(job, memory)[1] <= memory:
        return None
    return make_layout(job, task_budget(memory, workers), tasks or workers)


def docs_per_token(sources: list[PackedSource]) -> float:
    return sum(int(s.manifest.get("documents", 0)) for s in sources) / max(
        1, sum(int(s.manifest.get("tokens", 0)) for s in sources)
    )


def planned_epoch_manifest(job: EpochJob, sources: list[PackedSource]) -> dict:
    """The epoch manifest as the run will write it, but for its checksums and its fragment
    counts, which are estimates (a sample is cut at each document end: one fragment per sample
    plus the sources' documents per token): its size is the written one's to a few bytes."""
    plan, per_row = job.plan, 1 + docs_per_token(sources) * job.plan.row_tokens
    entries = []
    for i in range(job.n_shards):
        g0, g1 = job.shard_range(i)
        entries.append(
            {
                "path": job.shard_file(i),
                "tokens": (g1 - g0) * plan.row_tokens,
                "bytes": (g1 - g0) * job.row_bytes,
                "samples": g1 - g0,
                "xxh3_128": "0" * 32,
                "index_xxh3_128": "0" * 32,
                "rows_xxh3_128": "0" * 32,
                "metadata_xxh3_128": "0" * 32,
                "multiset_hash": "0" * 16,
                "fragments": int((g1 - g0) * per_row),
            }
        )
    return epoch_manifest(
        entries,
        TokenHeader(job.token_dtype, sources[0].vocab_size, job.eos_id, job.tokenizer),
        # the default packing's name whatever the packing: `plan` has always
        # counted a planned epoch manifest's bytes so
        ShuffleFields(
            seed=plan.seed,
            seq_len=plan.seq_len,
            samples=plan.samples,
            shard_samples=job.shard_samples,
            jitter=plan.jitter,
            shuffle=packings.named(packings.DEFAULT).shuffle,
        ),
        tokens=plan.samples * plan.row_tokens,
        epoch=plan.epoch,
        dropped_tokens=plan.dropped_tokens(),
        sources=plan.source_entries(),
    )


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


def scratch_bytes(job: EpochJob, out_of_core: bool = True) -> int:
    """The epoch's scratch, as its packing counts it: out of core, the window shuffle's buckets
    hold every output row and its 8-byte position; a best-fit epoch's also its row table, in
    memory or not (tokpack.shuffle.packed_step.packed_scratch_bytes)."""
    return packings.of_plan(job.plan).scratch_bytes(job, out_of_core)


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
        if memory_path(job, memory)[1] > memory:
            during = scratch_bytes(job) + shard
        else:
            during += scratch_bytes(job, out_of_core=False)
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
        record = json.loads(read_limited(marker, MAX_RECORD_BYTES, "record"))
        marker.unlink()
        if layout is not None:
            shutil.rmtree(layout.dir, ignore_errors=True)
        work, edir = Path(job.work_dir), Path(job.epoch_dir)
        if not any(work.glob("done/*.json")):  # nothing an earlier attempt finished: leave no trace
            shutil.rmtree(work, ignore_errors=True)
        for d in (edir, work.parent):
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
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
    needed, held = memory_path(job, memory)
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
            layout = epoch_layout(job, memory=memory, workers=workers, tasks=tasks)
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


def epoch_manifest_of(job: EpochJob, entries: list[dict], prepared) -> dict:
    """The epoch's manifest over its shards' entries (in order); `prepared`: what its packing
    built first (packings.Packing.prepare). shuffle --to-nodes (tokpack.packer.exchange) writes the same."""
    plan = job.plan
    sources = job.open_sources()
    manifest = epoch_manifest(
        entries,
        TokenHeader(job.token_dtype, sources[0].vocab_size, job.eos_id, job.tokenizer),
        ShuffleFields(
            seed=plan.seed,
            seq_len=plan.seq_len,
            samples=plan.samples,
            shard_samples=job.shard_samples,
            jitter=plan.jitter,
            shuffle=plan.algorithm,
        ),
        tokens=plan.samples * plan.row_tokens,
        epoch=plan.epoch,
        dropped_tokens=plan.dropped_tokens(),
        sources=plan.source_entries(),
    )
    manifest.update(packings.of_plan(plan).epoch_fields(plan, prepared))
    return manifest


@dataclass
class RunSetup:
    """What a shuffle invocation will do, decided before it writes a byte: `shuffle_run` runs it,
    `tokpack plan shuffle` (packer/planning.py) reports it."""

    sources: list[PackedSource]  # opened, in command-line order
    weights: list[str | None]  # as the run spells them
    shard_samples: int
    done_epochs: list[int]  # listed by OUT's run manifest already
    todo: list[tuple[int, EpochPlan, EpochJob | None]]  # per epoch asked for; no job: complete already
    params: dict | None  # what makes two invocations the same run
    runplan: RunPlan  # the run's stages (one, for a run made with flags), planning any epoch
    run_params: dict | None  # a run made from a schedule file: its schedule, fixed when the run is created
    holdout: EpochJob | None = None  # RUN/holdout/ to write (shuffle --holdout), once: None when written or none

    @property
    def jobs(self) -> list[EpochJob]:
        return [job for _, _, job in self.todo if job is not None] + ([self.holdout] if self.holdout else [])


def setup_run(
    spec: ShuffleSpec,
    output: str,
    *,
    local: list[str] | None = None,
    workers: int = 1,
    progress: bool = False,
    to: Output = LocalOutput(),
) -> RunSetup:
    """Opens the sources and OUT's run (if any), checks they agree, and plans every epoch of
    `spec`, each plan within its memory. Writes nothing in OUT (a best-fit plan counts its rows in
    a temporary folder). `local`, `to`: as in shuffle_run; `workers`: the out-of-core tasks at
    once (each gets memory // workers)."""
    packing = packings.named(spec.packing).name
    schedule = spec.checked_schedule()  # a setting the schedule file declares, given too: refused here
    seq_len, seed, jitter, pad_id, memory = spec.seq_len, spec.seed, spec.jitter, spec.pad_id, spec.memory
    shard_samples, samples, tokens, epochs = spec.shard_samples, spec.samples, spec.tokens, spec.asked_epochs()
    paths, weights = list(spec.sources if local is None else local), spec.weights
    used = packings.named(schedule.packing if schedule is not None else packing)
    if pad_id is not None and not used.padded:
        # a window epoch has no padding: a --pad-id it ignored would look like a setting the run keeps
        padded = [n for n in packings.names() if packings.named(n).padded]
        asked = "the schedule's packing" if schedule is not None else "--packing"
        raise TokpackError(
            f"--pad-id applies to {' or '.join(padded)} packing; {used.name} packing has no padding",
            where="--pad-id",
            expected=f"no --pad-id with {asked} {used.name}",
            found=pad_id,
            hint="drop --pad-id, or pack with "
            + " or ".join(
                (f"packing: {n} in the schedule" if schedule is not None else f"--packing {n}") for n in padded
            ),
        )
    if schedule is not None:
        seq_len, seed, jitter, paths = schedule.seq_len, schedule.seed, schedule.jitter, schedule.paths
        shard_samples = shard_samples or schedule.shard_samples
    # On the packing and jitter that will run: a schedule's jitter meets --packing only here.
    packings.check_jitter(
        used.name,
        jitter,
        "--jitter" if schedule is None or schedule.file is None else "jitter",
        getattr(schedule, "file", None),
    )
    holdout = parse_holdout(spec.holdout)
    if holdout is not None and not used.holdout:  # a registered packing that cannot leave documents out
        raise TokpackError(
            f"--holdout sets whole documents aside; {used.name} packing cannot",
            where="--holdout",
            hint=f"use --packing {packings.DEFAULT} or best-fit with --holdout",
        )
    # 70% is recorded as 0.7 is (formats.units.weight_text): the same weights, the same manifests
    paths, weights = list(paths), [None if w is None else weight_text(w) for w in weights or [None] * len(paths)]
    opened = open_sources(paths)
    out = Path(output)
    first = opened[0].manifest
    dtype = dtype_name(opened[0].dtype)
    row_bytes = (seq_len + 1) * opened[0].dtype.itemsize
    floor = min_memory(row_bytes, workers)
    if memory < floor:  # one bucket per handful of samples: hours of per-bucket overhead
        raise TokpackError(
            "--memory is too small to shuffle",
            where="--memory",
            expected=f">= {floor} bytes",
            found=f"{memory} bytes",
            hint=f"give --memory {floor} or more ({MIN_BUCKET_ROWS} samples "
            f"of {row_bytes} bytes per bucket, per worker); more memory is faster",
        )
    existing = _existing_run(out, to)
    if (
        existing is not None
        and existing.get("given_weights") is not None
        and existing["fingerprints"] == [src.fingerprint for src in opened]
        and existing["weights"] == _weights_key(weights)
    ):
        weights = list(existing["given_weights"])  # equal as ratios: the run's manifests keep one spelling
    if shard_samples is None:
        shard_samples = existing["shard_samples"] if existing else max(1, DEFAULT_SHARD_BYTES // row_bytes)
    recorded = [source_location(p) for p in (spec.sources or paths)]
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in recorded]
    runplan = RunPlan(
        schedule
        or Schedule.of_flags(
            paths, weights, seq_len=seq_len, seed=seed, samples=samples, tokens=tokens, jitter=jitter, packing=packing
        ),
        opened,
        names,
        pad_id=pad_id,
        memory=memory,
        holdout=holdout,
    )
    run_params = None if schedule is None or schedule.file is None else _schedule_params(runplan, opened, shard_samples)
    if run_params is not None and existing is not None and existing["schedule"] == run_params["schedule"]:
        spelled = {e["stage"]: e["weights"] for e in existing["given_schedule"]}  # equal as ratios: keep the run's
        runplan = RunPlan(
            replace(schedule, stages=tuple(replace(st, weights=tuple(spelled[st.name])) for st in schedule.stages)),
            opened,
            names,
            pad_id=pad_id,
            memory=memory,
            holdout=holdout,
        )
    if epochs is None:
        epochs = list(range(runplan.schedule.epochs or 1))
    done_epochs = []
    if (out / MANIFEST).exists():
        done_epochs = list(read_manifest(out, kind="run")["epochs"])
    todo = []  # (epoch, plan, job or None when the epoch is complete already): planned before any write
    shards = 0
    for epoch in epochs:
        plan = runplan.epoch_plan(epoch)
        shards += -(-plan.samples // shard_samples)
        at_most(
            shards,
            MAX_SHARDS,
            f"number of output shards (through epoch {epoch}, {plan.samples:,} samples of {shard_samples:,} per shard)",
            where="--samples/--tokens/--shard-samples",
            hint="ask for fewer samples or epochs per command (--epoch E), or raise --shard-samples",
        )
        plan = replace(plan, sources=tuple(replace(sp, path=recorded[sp.index]) for sp in plan.sources))
        params = _run_params(plan, [sp.weight for sp in plan.sources], shard_samples)
        if existing is not None:
            like = shuffle_command({"kind": "run"}, out, epoch) if (out / MANIFEST).exists() else None
            _check_same_run(existing, run_params or params, out, like)
        existing = run_params or params
        edir = out / epoch_dir_name(epoch)
        job = None
        if (edir / MANIFEST).exists():
            m = read_manifest(edir, kind="epoch")
            _check_same_run(_params_of_manifest(m), params, edir)
            if _content(m.get("sources")) != _content(plan.source_entries()):
                raise TokpackError(
                    "epoch directory holds a different epoch",
                    file=edir,
                    where="sources",
                    hint="delete that epoch directory or use another -o",
                )
        else:
            _refuse_foreign_files(edir, to)
            key = xxhash.xxh3_64_hexdigest(json.dumps([params, plan.source_entries(), plan.algorithm, dtype]).encode())
            job = EpochJob(
                plan,
                tuple(source_location(p) for p in paths),
                dtype,
                int(first["eos_id"]),
                first.get("tokenizer", ""),
                str(edir),
                str(out / WORK_DIR / f"{edir.name}-{key}"),
                shard_samples,
                progress=bool(progress),
                main_pid=os.getpid(),
                output=to,
            )
        todo.append((epoch, plan, job))
    held = None
    if holdout is not None and not (out / HOLDOUT_DIR / MANIFEST).exists():  # written once, with the first epochs
        hp = used.holdout(
            opened, seq_len=seq_len, seed=seed, holdout=holdout, names=names, memory=memory, pad_id=pad_id
        )
        hp = replace(hp, sources=tuple(replace(sp, path=recorded[sp.index]) for sp in hp.sources))
        hdir = out / HOLDOUT_DIR
        _refuse_foreign_files(hdir, to)
        key = xxhash.xxh3_64_hexdigest(json.dumps([hp.source_entries(), hp.algorithm, dtype, seq_len]).encode())
        held = EpochJob(
            hp,
            tuple(source_location(p) for p in paths),
            dtype,
            int(first["eos_id"]),
            first.get("tokenizer", ""),
            str(hdir),
            str(out / WORK_DIR / f"{HOLDOUT_DIR}-{key}"),
            shard_samples,
            progress=bool(progress),
            main_pid=os.getpid(),
            output=to,
        )
    return RunSetup(opened, weights, shard_samples, done_epochs, todo, existing, runplan, run_params, held)


def _refuse_foreign_files(edir: Path, to: Output) -> None:
    """An epoch folder about to be written may hold what an earlier attempt left (replaced or
    removed as it finishes), and nothing else: anything else is refused before a byte is written."""
    for where in {edir, to.where(edir)}:
        foreign = sorted(p.name for p in where.iterdir() if not is_own_file(p)) if where.is_dir() else []
        if foreign:
            raise TokpackError(
                "epoch directory holds files tokpack did not write",
                file=where / foreign[0],
                expected="only the epoch's shards and tokpack.json",
                found=", ".join(foreign[:5]),
                hint="move them out of the run (shuffle replaces what is in epoch-NNNNN/), or choose another -o",
            )


@locked_output("shuffle")
def shuffle_run(
    spec: ShuffleSpec | list[str],
    output: str,
    *,
    local: list[str] | None = None,
    log=None,
    workers: int = 1,
    tasks: int | None = None,
    run_passes,
    progress: bool | None = None,
    to: Output = LocalOutput(),
    **settings,
) -> dict:
    """Writes OUT/epoch-NNNNN/ for each epoch of `spec` (tokpack.shuffle.spec; skipping complete
    identical ones) and the run manifest. `spec.memory` is the total budget: the out-of-core path
    gives each of `workers` concurrent tasks memory // workers. `local`: the local copies of
    `spec.sources` when they are URLs (the manifests record the sources as the spec names them:
    plan.source_location, a local path resolved, an object-store URL as given). `progress`: bars
    on stderr, lines in a log (tokpack.formats.io.progress; default: unless TOKPACK_PROGRESS is 0).
    `run_passes([(step, tasks, job_name, logging_dir), ...])` runs dependent passes in order
    (tokpack.packer.executors.pass_runner makes one). `to`: where the run goes
    (tokpack.formats.outputs; to a bucket, `output` is its local folder and holds the state fetched
    from the store). Returns a summary dict, with per-source counts of every epoch written and a
    warning per source an epoch repeats windows of (tokpack.packer.api.shuffle takes URLs and
    returns it as a ShuffleResult). Tests and benchmarks may give the sources and the spec's
    settings as keywords instead (`shuffle_run(paths, out, seq_len=..., seed=..., epochs=[0])`)."""
    if not isinstance(spec, ShuffleSpec):
        spec = ShuffleSpec.given_as(sources=spec, **settings)
    t0 = time.perf_counter()
    log = log or (lambda line: None)
    memory = spec.memory
    if progress is None:
        progress = os.environ.get("TOKPACK_PROGRESS", "1") != "0"
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
    out, opened, weights, shard_samples = Path(output), setup.sources, setup.weights, setup.shard_samples
    done_epochs, runplan, skipped, summaries = setup.done_epochs, setup.runplan, [], []
    # The samples alone, by arithmetic, before the exact count below spends time per shard.
    check_space(
        [(out, sum(job.plan.samples * job.row_bytes for job in setup.jobs) - bytes_under(out))],
        "shuffle",
        hint="ask for fewer samples, free some space there, or choose another -o",
    )
    check_space(
        [(out, bytes_to_write(setup.jobs, opened, memory, workers))],
        "shuffle",
        hint="free some space there, choose another -o, or write fewer epochs per command (--epoch E)",
    )
    if (
        setup.run_params is not None and setup.todo and not (out / MANIFEST).exists()
    ):  # its numbering, fixed at creation
        out.mkdir(parents=True, exist_ok=True)
        to.finish(out, _run_manifest(out, setup.todo[0][1], weights, opened, shard_samples, done_epochs, runplan))
    for epoch, plan, job in setup.todo:
        out.mkdir(parents=True, exist_ok=True)
        if job is None:
            skipped.append(epoch)
            # A kill while the finished epoch's scratch was being removed leaves part of it.
            for stale in (out / WORK_DIR).glob(f"{epoch_dir_name(epoch)}-*"):
                to.remove_tree(stale)
            log(f"epoch {epoch}: already complete, skipped")
        else:
            report = plan.source_report()  # before the epoch's table: it counts repeats from the passes kept
            summary = run_epoch(job, memory=memory, workers=workers, tasks=tasks, run_passes=run_passes, log=log)
            summary["stage"] = runplan.stage_name(epoch)
            summary["sources"] = report
            summaries.append(summary)
        done_epochs = sorted(set(done_epochs) | {epoch})
        to.finish(out, _run_manifest(out, plan, weights, opened, shard_samples, done_epochs, runplan))
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
    written = sum(s["bytes_written"] for s in summaries)
    sizes = epoch_samples(runplan, done_epochs)
    return {
        "output": to.shown(out.absolute()),  # as pack's: the same folder whatever the job's cwd
        "epochs": done_epochs,
        "written": [s["epoch"] for s in summaries],
        "skipped": skipped,
        "reused_shards": sum(s["shards_reused"] for s in summaries),
        "samples_per_epoch": sizes[0] if len(set(sizes)) == 1 else None,
        "epoch_samples": sizes,
        "seq_len": runplan.schedule.seq_len,
        "shard_samples": shard_samples,
        "packing": runplan.packing.name,
        "holdout": None if setup.holdout is None else held,
        "path": ",".join(sorted({s["path"] for s in summaries})) or "none",
        "bytes_written": written,
        "seconds": round(seconds, 3),
        "mb_per_s": round(written / 1e6 / seconds, 1) if seconds > 0 and written else None,
        "epochs_detail": summaries,
        "warnings": [
            w for summary in summaries for w in repeat_warnings(summary["epoch"], summary["sources"], summary["stage"])
        ],
    }


def epoch_samples(runplan: RunPlan, epochs: list[int]) -> list[int]:
    """The samples of each of `epochs` (a schedule's stages differ in size)."""
    return [runplan.epoch_plan(e).samples for e in epochs]


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


def _content(entries) -> list[dict]:
    """Source entries without where the sources lay: moving a source does not change an epoch."""
    return [{k: v for k, v in e.items() if k not in ("path", "name")} for e in entries or []]
