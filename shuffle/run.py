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
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

import xxhash

from formats.errors import TokpackError
from formats.guard import LOCK_NAME, WORK_DIR, bytes_under, check_space, is_no_space, locked_output
from formats.io import TMP_MARK, remove_tmp_files
from formats.manifest import (MANIFEST, dtype_name, epoch_dir_name, epoch_manifest, read_manifest, run_manifest,
                              write_manifest)
from formats.shards import SHARD_SUFFIXES, PackedSource

from .plan import PLAN_ALGORITHM, EpochPlan, parse_weight
from .schedule import RunPlan, Schedule
from .steps import (CHUNKS_IN_BUDGET, ORDER_ROW_OVERHEAD, EpochJob, InMemoryStep, Layout, OrderStep, ScatterStep,
                    make_layout, source_changed_error)

DEFAULT_SHARD_BYTES = 1 << 30  # default --shard-samples: about 1 GiB of samples per shard
ROW_FACTS_BYTES = 32  # RowFragments per row in memory: first-EOS index, hash, and about one EOS column
MIN_BUCKET_ROWS = 8  # below this many rows per bucket the out-of-core path spends its time per bucket, not per byte
EPOCH_SHARD_SUFFIXES = tuple(s for s in SHARD_SUFFIXES if s != ".loss")  # an epoch's shards carry no loss mask


def open_sources(paths: list[str]) -> list[PackedSource]:
    sources = [PackedSource.open(p) for p in paths]
    first = sources[0]
    for src in sources[1:]:
        for field in ("dtype", "vocab_size", "eos_id"):
            if src.manifest.get(field) != first.manifest.get(field):
                raise TokpackError(
                    "sources disagree", file=src.path, where=field,
                    expected=f"{first.manifest.get(field)} (as in {first.path})", found=src.manifest.get(field),
                    hint="mix only sources packed with the same tokenizer and dtype")
    seen: dict = {}
    for src in sources:  # every window would appear twice, and epochs could not tell the copies apart
        for key in (("path", src.path.resolve()), ("fingerprint", src.fingerprint)):
            if key in seen:
                raise TokpackError("the same source is given twice", file=src.path, where="SOURCE",
                                   expected="each source once", found=f"the same {key[0]} as {seen[key]}",
                                   hint="give each source once; to draw more from it, raise its weight")
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


def _run_params(plan: EpochPlan, weights, shard_samples: int) -> dict:
    """What must match for two invocations to belong to the same run."""
    return {
        "fingerprints": [sp.fingerprint for sp in plan.sources],
        "weights": _weights_key(weights),
        "seq_len": plan.seq_len,
        "seed": plan.seed,
        "jitter": plan.jitter,
        "samples": plan.samples,
        "shard_samples": shard_samples,
    }


def _schedule_params(runplan: RunPlan, sources: list[PackedSource], shard_samples: int) -> dict:
    """What must match for two invocations to belong to the same run made from a schedule file."""
    fields = runplan.manifest_fields()
    sc = runplan.schedule
    return {"fingerprints": [src.fingerprint for src in sources], "weights": None, "seq_len": sc.seq_len,
            "seed": sc.seed, "jitter": sc.jitter, "samples": 0, "shard_samples": shard_samples,
            "epoch_samples": fields["epoch_samples"], "schedule": _schedule_key(fields["schedule"])}


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
        **{key: m.get(key) for key in ("seq_len", "seed", "samples", "shard_samples", "epoch_samples")},
    }


def _check_same_run(found: dict, wanted: dict, where: Path) -> None:
    """`wanted`: the _run_params (or _schedule_params) of this invocation."""
    if found.get("schedule") is not None and wanted.get("schedule") is not None:
        old, new = found["schedule"], wanted["schedule"]
        for e in range(max(len(old), len(new))):
            a, b = (old[e] if e < len(old) else None), (new[e] if e < len(new) else None)
            if a != b:
                raise TokpackError("the schedule differs from the one the run was made with", file=where,
                                   where=f"epoch {e}", expected=a or "no such epoch", found=b or "no such epoch",
                                   hint="restore the run's schedule file (its xxh3_128 is in the run manifest), "
                                   "or write the new schedule to another -o")
    for key in wanted:
        if found[key] != wanted[key]:
            raise TokpackError(
                "output directory holds a different run", file=where, where=key, expected=wanted[key],
                found=found[key], hint="use another -o, delete it, or repeat the run's exact sources, weights, "
                "--seq-len, --seed, --jitter, --samples/--tokens and --shard-samples")


def _existing_run(out: Path) -> dict | None:
    """Parameters of the run already in OUT (run manifest, else any complete epoch), or None."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise TokpackError("output is not a directory", file=out)
    if (out / MANIFEST).exists():
        return _params_of_manifest(read_manifest(out, kind="run"))
    foreign = [p.name for p in out.iterdir()
               if not (p.name.startswith("epoch-") or p.name in (WORK_DIR, LOCK_NAME) or TMP_MARK in p.name)]
    if foreign:
        raise TokpackError("output directory is not a tokpack run", file=out, where="contents",
                           expected="no files, or a run's tokpack.json and epoch-NNNNN/", found=", ".join(sorted(foreign)[:5]),
                           hint="choose an empty or new -o directory")
    for p in sorted(out.glob("epoch-*/" + MANIFEST)):
        return _params_of_manifest(read_manifest(p.parent, kind="epoch"))
    return None


def _run_manifest(out: Path, plan: EpochPlan, weights, sources: list[PackedSource], shard_samples: int,
                  epochs: list[int], runplan: RunPlan) -> dict:
    first = sources[0].manifest
    written = {e: read_manifest(out / epoch_dir_name(e), kind="epoch") for e in epochs
               if (out / epoch_dir_name(e) / MANIFEST).exists()}
    entries = plan.source_entries()
    scheduled = runplan.schedule.file is not None  # the weights and sizes are per epoch, in `schedule`
    extra = runplan.manifest_fields() if scheduled else None
    if scheduled and (out / MANIFEST).exists():  # fixed when the run was created (the same schedule, maybe respelled)
        old = read_manifest(out, kind="run")
        extra = {key: old.get(key) for key in extra}
    return run_manifest(
        written, sources[0].dtype, first["vocab_size"], first["eos_id"], first.get("tokenizer", ""),
        sources=[{**e, "weight": None} for e in entries] if scheduled else entries,
        weights=None if scheduled or all(w is None for w in weights) else list(weights),
        seq_len=plan.seq_len, seed=plan.seed, jitter=plan.jitter, samples=0 if scheduled else plan.samples,
        shard_samples=shard_samples, shuffle=PLAN_ALGORITHM, extra=extra)


def _memory_path(job: EpochJob, memory: int) -> tuple[int, bool]:
    """(bytes of the windows to hold, whether they fit `memory` so the epoch runs in memory)."""
    needed = sum(sp.windows for sp in job.plan.sources if sp.samples) * (job.row_bytes + ROW_FACTS_BYTES)
    return needed, needed + CHUNKS_IN_BUDGET * job.chunk_rows(memory) * job.row_bytes <= memory


def _bytes_to_write(jobs: list[EpochJob], sources: list[PackedSource], memory: int) -> int:
    """Peak bytes on OUT's filesystem while these epochs are written, less what a resumed run has
    there already: the epochs written before, then this epoch's shards with, out of core, its
    bucket scratch (every output row and its 8-byte position), of which the order pass deletes
    each shard's part once the shard is written: the peak is the scratch plus the first shard."""
    docs_per_token = sum(int(s.manifest.get("documents", 0)) for s in sources) / max(
        1, sum(int(s.manifest.get("tokens", 0)) for s in sources))
    peak = written = 0
    for job in jobs:
        rows = job.plan.samples
        # .ds rows, plus an 8-byte index entry per fragment: a sample is cut at each document end
        epoch = rows * job.row_bytes + 8 * int(rows * (1 + docs_per_token * job.plan.row_tokens))
        have = bytes_under(job.epoch_dir) + bytes_under(job.work_dir)
        during = epoch
        if not _memory_path(job, memory)[1]:
            during = rows * (job.row_bytes + 8) + epoch * min(1, job.shard_samples / max(rows, 1))
        peak = max(peak, written + max(0, during - have))
        written += max(0, epoch - have)
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
        record = json.loads(marker.read_text())
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
    work = Path(job.work_dir)
    Path(job.epoch_dir).mkdir(parents=True, exist_ok=True)
    remove_tmp_files(job.epoch_dir)
    # A fresh name per invocation: our own done files decide what is skipped, so datatrove's
    # completion markers from an earlier attempt (maybe with another layout) must never match.
    attempt = uuid.uuid4().hex[:8]
    logs = work / "logs" / attempt
    needed, in_memory = _memory_path(job, memory)
    name = f"{epoch_dir_name(plan.epoch)}-{attempt}"
    job.source_changed_path.unlink(missing_ok=True)  # an earlier attempt's: this one reads the sources again
    shards_left = [i for i in range(job.n_shards) if job.shard_done(i) is None]
    try:
        layout = None
        if not shards_left:  # a rerun after every shard finished: only the manifest is missing
            log(f"epoch {plan.epoch}: all {job.n_shards} shards already written; writing the manifest")
        elif in_memory:
            log(f"epoch {plan.epoch}: {plan.samples} samples, in memory ({needed / 2**20:.1f} MiB of windows)")
            with _source_check(job, None):
                run_passes([(InMemoryStep(job, budget=memory), 1, f"{name}-inmemory", str(logs / "inmemory"))])
        else:
            budget = max(1, memory // workers)
            layout = make_layout(job, budget, tasks or workers)
            log(f"epoch {plan.epoch}: {plan.samples} samples, out of core ({needed / 2**20:.1f} MiB of windows, "
                f"{layout.tasks} scatter tasks, {len(layout.bucket_starts) - 1} buckets, {job.n_shards} shards)")
            passes = [(ScatterStep(job, layout), layout.tasks, f"{name}-scatter", str(logs / "scatter")),
                      (OrderStep(job, layout, budget), job.n_shards, f"{name}-order", str(logs / "order"))]
            if all(layout.task_done(t).exists() for t in range(layout.tasks)):
                if all(layout.holds_rows_of(i, job.row_bytes) for i in shards_left):
                    passes = passes[1:]  # a rerun after the scatter pass finished: no array of no-op tasks
                    log(f"epoch {plan.epoch}: scatter pass already done; {len(shards_left)} shards left to order")
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
        for d in work.glob("ooc-*"):
            shutil.rmtree(d, ignore_errors=True)
        remove_tmp_files(job.epoch_dir)
        raise TokpackError(f"disk full while writing epoch {plan.epoch}; its scratch files were removed",
                           file=job.epoch_dir, expected="free space", found="No space left on device",
                           hint="free some space (or choose another -o), then rerun the same command; "
                           "finished shards are kept") from e
    entries = []
    for i in range(job.n_shards):
        done = job.done_path(i)
        if not done.exists():
            raise TokpackError("output shard did not complete", file=Path(job.epoch_dir) / job.shard_file(i),
                               hint="rerun the same command; completed shards are kept")
        entries.append(json.loads(done.read_text()))
    keep = {e["path"] + ext for e in entries for ext in EPOCH_SHARD_SUFFIXES}
    for p in Path(job.epoch_dir).iterdir():  # leftovers of an earlier, different attempt
        if p.is_file() and p.name not in keep:
            p.unlink()
    sources = job.open_sources()
    manifest = epoch_manifest(
        entries, job.token_dtype, sources[0].vocab_size, job.eos_id, job.tokenizer, tokens=plan.samples * plan.row_tokens,
        epoch=plan.epoch, seed=plan.seed, seq_len=plan.seq_len, samples=plan.samples, shard_samples=job.shard_samples,
        dropped_tokens=plan.dropped_tokens(), jitter=plan.jitter, sources=plan.source_entries(), shuffle=PLAN_ALGORITHM)
    write_manifest(job.epoch_dir, manifest)
    shutil.rmtree(work, ignore_errors=True)
    return {"epoch": plan.epoch, "path": "in-memory" if in_memory else "out-of-core", "samples": plan.samples,
            "shards": job.n_shards, "sample_multiset_hash": manifest["sample_multiset_hash"]}


@locked_output("shuffle")
def shuffle_run(
    sources: list[str],
    output: str,
    *,
    weights: list[str | None] | None = None,
    seq_len: int | None = None,
    seed: int | None = None,
    epochs: list[int] | None,
    samples: int | None = None,
    tokens: int | None = None,
    shard_samples: int | None = None,
    memory: int = 4 << 30,
    jitter: bool = False,
    log=None,
    workers: int = 1,
    tasks: int | None = None,
    run_passes,
    progress: bool | None = None,
    schedule: Schedule | None = None,
) -> dict:
    """Writes OUT/epoch-NNNNN/ for each epoch (skipping complete identical ones) and the run
    manifest. `memory` is the total budget: the out-of-core path gives each of `workers`
    concurrent tasks memory // workers. `progress`: tqdm bars on stderr (default: when it is a
    terminal and TOKPACK_PROGRESS is not 0). `weights`: one per source, as given ("0.25", "1/3"),
    or None. `run_passes([(step, tasks, job_name, logging_dir), ...])` runs dependent passes in
    order (packer.executors.pass_runner makes one). Returns a summary dict, with per-source counts of
    every epoch written and a warning per source an epoch repeats windows of (packer.api.shuffle
    takes URLs and returns it as a ShuffleResult). `schedule`: the run's stages (shuffle.schedule),
    instead of `sources`, `weights`, `seq_len`, `seed`, `samples`, `tokens` and `jitter`; `epochs`
    None: every epoch of the schedule."""
    t0 = time.perf_counter()
    log = log or (lambda line: None)
    if progress is None:
        progress = sys.stderr.isatty() and os.environ.get("TOKPACK_PROGRESS", "1") != "0"
    if schedule is not None:
        seq_len, seed, jitter, sources = schedule.seq_len, schedule.seed, schedule.jitter, schedule.paths
        shard_samples = shard_samples or schedule.shard_samples
    paths, weights = list(sources), list(weights or [None] * len(sources))
    opened = open_sources(paths)
    out = Path(output)
    first = opened[0].manifest
    dtype = dtype_name(opened[0].dtype)
    row_bytes = (seq_len + 1) * opened[0].dtype.itemsize
    floor = min_memory(row_bytes, workers)
    if memory < floor:  # one bucket per handful of samples: hours of per-bucket overhead
        raise TokpackError("--memory is too small to shuffle", where="--memory", expected=f">= {floor} bytes",
                           found=f"{memory} bytes", hint=f"give --memory {floor} or more ({MIN_BUCKET_ROWS} samples "
                           f"of {row_bytes} bytes per bucket, per worker); more memory is faster")
    existing = _existing_run(out)
    if (existing is not None and existing.get("given_weights") is not None
            and existing["fingerprints"] == [src.fingerprint for src in opened]
            and existing["weights"] == _weights_key(weights)):
        weights = list(existing["given_weights"])  # equal as ratios: the run's manifests keep one spelling
    if shard_samples is None:
        shard_samples = existing["shard_samples"] if existing else max(1, DEFAULT_SHARD_BYTES // row_bytes)
    names = [Path(p).resolve().name for p in paths]
    runplan = RunPlan(schedule or Schedule.of_flags(paths, weights, seq_len=seq_len, seed=seed, samples=samples,
                                                    tokens=tokens, jitter=jitter), opened, names)
    run_params = None if schedule is None or schedule.file is None else _schedule_params(runplan, opened, shard_samples)
    if run_params is not None and existing is not None and existing["schedule"] == run_params["schedule"]:
        spelled = {e["stage"]: e["weights"] for e in existing["given_schedule"]}  # equal as ratios: keep the run's
        runplan = RunPlan(replace(schedule, stages=tuple(replace(st, weights=tuple(spelled[st.name]))
                                                         for st in schedule.stages)), opened, names)
    if epochs is None:
        epochs = list(range(runplan.schedule.epochs or 1))
    done_epochs, skipped, summaries = [], [], []
    if (out / MANIFEST).exists():
        done_epochs = list(read_manifest(out, kind="run")["epochs"])
    todo = []  # (epoch, plan, job or None when the epoch is complete already): planned before any write
    for epoch in epochs:
        plan = runplan.epoch_plan(epoch)
        plan = replace(plan, sources=tuple(replace(sp, path=str(Path(sp.path).resolve())) for sp in plan.sources))
        params = _run_params(plan, [sp.weight for sp in plan.sources], shard_samples)
        if existing is not None:
            _check_same_run(existing, run_params or params, out)
        existing = run_params or params
        edir = out / epoch_dir_name(epoch)
        job = None
        if (edir / MANIFEST).exists():
            m = read_manifest(edir, kind="epoch")
            _check_same_run(_params_of_manifest(m), params, edir)
            if _content(m.get("sources")) != _content(plan.source_entries()):
                raise TokpackError("epoch directory holds a different epoch", file=edir, where="sources",
                                   hint="delete that epoch directory or use another -o")
        else:
            key = xxhash.xxh3_64_hexdigest(json.dumps([params, plan.source_entries(), PLAN_ALGORITHM, dtype]).encode())
            job = EpochJob(plan, tuple(str(Path(p).resolve()) for p in paths), dtype, int(first["eos_id"]),
                           first.get("tokenizer", ""), str(edir), str(out / WORK_DIR / f"{edir.name}-{key}"),
                           shard_samples, progress=bool(progress), main_pid=os.getpid())
        todo.append((epoch, plan, job))
    check_space([(out, _bytes_to_write([j for _, _, j in todo if j], opened, memory))], "shuffle",
                hint="free some space there, choose another -o, or write fewer epochs per command (--epoch E)")
    if run_params is not None and todo and not (out / MANIFEST).exists():  # its sample numbering, fixed at creation
        out.mkdir(parents=True, exist_ok=True)
        write_manifest(out, _run_manifest(out, todo[0][1], weights, opened, shard_samples, done_epochs, runplan))
    for epoch, plan, job in todo:
        out.mkdir(parents=True, exist_ok=True)
        if job is None:
            skipped.append(epoch)
            # A kill while the finished epoch's scratch was being removed leaves part of it.
            for stale in (out / WORK_DIR).glob(f"{epoch_dir_name(epoch)}-*"):
                shutil.rmtree(stale, ignore_errors=True)
            log(f"epoch {epoch}: already complete, skipped")
        else:
            summary = run_epoch(job, memory=memory, workers=workers, tasks=tasks, run_passes=run_passes, log=log)
            summary["sources"] = plan.source_report()
            summaries.append(summary)
        done_epochs = sorted(set(done_epochs) | {epoch})
        write_manifest(out, _run_manifest(out, plan, weights, opened, shard_samples, done_epochs, runplan))
    work = out / WORK_DIR
    if work.exists() and not any(work.iterdir()):
        work.rmdir()
    return {
        "output": str(out),
        "epochs": done_epochs,
        "written": [s["epoch"] for s in summaries],
        "skipped": skipped,
        "samples_per_epoch": existing["samples"] if existing else 0,
        "seq_len": seq_len,
        "shard_samples": shard_samples,
        "path": ",".join(sorted({s["path"] for s in summaries})) or "none",
        "seconds": round(time.perf_counter() - t0, 3),
        "epochs_detail": summaries,
        "warnings": [w for summary in summaries for w in repeat_warnings(summary["epoch"], summary["sources"])],
    }


def repeat_warnings(epoch: int, report: list[dict]) -> list[str]:
    """One line per source whose windows this epoch holds more than once."""
    lines = []
    for r in report:
        if not r["repeats"]:
            continue
        span = f"pass {r['first_pass']}" if r["passes"] == 1 else f"passes {r['first_pass']}-{r['first_pass'] + r['passes'] - 1}"
        why = ("it has fewer windows than its share of the epoch; lower its weight or --samples/--tokens, or add data"
               if r["samples"] > r["windows"] else "the epoch ends one pass over it and starts the next, and the "
               "two passes' orders differ; epochs that are whole passes (no --samples/--tokens/weights) never repeat")
        lines.append(f"epoch {epoch}: source {r['name']} ({r['path']}) is used more than once: {r['repeats']} of its "
                     f"{r['samples']} samples repeat a window ({r['windows']} windows, {span}). HINT: {why}")
    return lines


def _content(entries) -> list[dict]:
    """Source entries without where the sources lay: moving a source does not change an epoch."""
    return [{k: v for k, v in e.items() if k not in ("path", "name")} for e in entries or []]
