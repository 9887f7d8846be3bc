"""A shuffle run's setup and records. The setup opens the sources and OUT's run (if any), checks
they agree, and decides every epoch asked for before a byte is written (`setup_run`, its
`RunSetup`): `tokpack shuffle` (tokpack.shuffle.run) runs it, `tokpack plan shuffle`
(tokpack.packer.planning) reports it. The records say what OUT holds: whether it holds the same
run as this invocation (its parameters against the run's or an epoch's manifest), what else it
may hold, and the run and epoch manifests written as epochs finish (tokpack.shuffle.run writes them).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import xxhash

from tokpack.formats.errors import TokpackError
from tokpack.formats.constants import EPOCH, HOLDOUT_DIR, LOCK_NAME, MANIFEST, NODES_SIDECAR, RUN, WORK_DIR
from tokpack.formats.io.writes import TMP_MARK
from tokpack.formats.outputs import LocalOutput, Output
from tokpack.formats.names import EPOCH_DIR_PREFIX, dtype_name, epoch_dir_name
from tokpack.formats.builders import epoch_manifest, run_manifest, ShuffleFields, TokenHeader
from tokpack.formats.reading import read_manifest
from tokpack.formats.numbering import shuffle_command
from tokpack.formats.packing import PackingRecord, holdout_recorded
from tokpack.formats.shards import PackedSource, is_own_file
from tokpack.formats.units import at_most, parse_weight, weight_text

from . import packings
from .holdout import parse_holdout
from .plan import EpochPlan, SamplePlan
from .sources import open_source, source_location
from .schedule import RunPlan, Schedule, same_source_twice
from .spec import ShuffleSpec
from .steps import ORDER_ROW_OVERHEAD
from .epoch_job import EpochJob


DEFAULT_SHARD_BYTES = 1 << 30  # default --shard-samples: about 1 GiB of samples per shard
# Output shards one command plans and writes (each three files and a manifest entry): past this, the
# numbers asked for (--samples, --tokens, --epochs, --shard-samples) are a typo, not a run.
MAX_SHARDS = 10**6
MIN_BUCKET_ROWS = 8  # below this many rows per bucket the out-of-core path spends its time per bucket, not per byte


def open_sources(paths: list[str]) -> list[PackedSource]:
    sources = [open_source(p) for p in paths]
    first = sources[0]
    for src in sources[1:]:
        for name in ("dtype", "vocab_size", "eos_id"):
            if src.manifest.get(name) != first.manifest.get(name):
                raise TokpackError(
                    "sources disagree",
                    file=src.path,
                    where=name,
                    expected=f"{first.manifest.get(name)} (as in {first.path})",
                    found=src.manifest.get(name),
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


@dataclass
class RunSetup:
    """What a shuffle invocation will do, decided before it writes a byte: `shuffle_run` runs it,
    `tokpack plan shuffle` (packer/planning.py) reports it."""

    sources: list[PackedSource]  # opened, in command-line order
    weights: list[str | None]  # as the run spells them
    shard_samples: int
    done_epochs: list[int]  # listed by OUT's run manifest already
    todo: list[tuple[int, EpochPlan, EpochJob | None]]  # per epoch asked for; no job: complete already
    runplan: RunPlan  # the run's stages (one, for a run made with flags), planning any epoch
    run_params: dict | None  # a run made from a schedule file: its schedule, fixed when the run is created
    holdout: EpochJob | None = None  # RUN/holdout/ to write (shuffle --holdout), once: None when written or none
    # each written epoch manifest's totals, by its directory, with the file's (inode, size, mtime)
    # they were read at: the run manifest is rewritten after every epoch, over all written ones
    totals: dict = field(default_factory=dict)

    @property
    def jobs(self) -> list[EpochJob]:
        return [job for _, _, job in self.todo if job is not None] + ([self.holdout] if self.holdout else [])

    def written_run_manifest(self, out: Path, plan: EpochPlan, epochs: list[int]) -> dict:
        """The run manifest over `epochs`' manifests written in `out`, keeping what its own says.
        Each is read and checked in turn, and only its totals kept (all of them at once held a dict
        per shard of every epoch: 1.3 MiB an epoch of 2,000 shards, at every epoch a rerun skips);
        a manifest unchanged since it was read is not read again (E epochs read E(E+1)/2 of them)."""
        written = {}
        for e in epochs:
            edir = out / epoch_dir_name(e)
            if not (edir / MANIFEST).exists():
                continue
            st = (edir / MANIFEST).stat()
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
            if self.totals.get(edir, (None,))[0] != key:
                self.totals[edir] = key, epoch_totals(read_manifest(edir, kind=EPOCH))
            written[e] = self.totals[edir][1]
        return self.run_manifest(written, plan, read_manifest(out, kind=RUN) if (out / MANIFEST).exists() else None)

    def run_manifest(self, written: dict, plan: EpochPlan, created: dict | None = None) -> dict:
        """The run manifest over the epoch manifests `written`; `created`: the run's manifest so far,
        whose schedule fields (fixed when the run was created, maybe spelled otherwise) it keeps."""
        first = self.sources[0].manifest
        entries = plan.source_entries()
        scheduled = self.runplan.schedule.file is not None  # the weights and sizes are per epoch, in `schedule`
        extra = self.runplan.manifest_fields() if scheduled else None
        if scheduled and created is not None:
            extra = {key: created.get(key) for key in extra}
        entry = packings.of_plan(plan)
        packing, holdout = entry.run_fields(plan), entry.run_holdout(plan)
        if packing is not None or holdout:
            extra = {**(extra or {}), **({} if packing is None else {"packing": packing}), **holdout}
        return run_manifest(
            written,
            TokenHeader(self.sources[0].dtype, first["vocab_size"], first["eos_id"], first.get("tokenizer", "")),
            _shuffle_fields(plan, 0 if scheduled else plan.samples, self.shard_samples, plan.algorithm),
            sources=[{**e, "weight": None} for e in entries] if scheduled else entries,
            weights=None if scheduled or all(w is None for w in self.weights) else list(self.weights),
            extra=extra,
        )


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
    existing = existing_run(out, to)
    if (
        existing is not None
        and existing.get("given_weights") is not None
        and existing["fingerprints"] == [src.fingerprint for src in opened]
        and existing["weights"] == weights_key(weights)
    ):
        weights = list(existing["given_weights"])  # equal as ratios: the run's manifests keep one spelling
    if shard_samples is None:
        shard_samples = existing["shard_samples"] if existing else max(1, DEFAULT_SHARD_BYTES // row_bytes)
    recorded = [source_location(p) for p in (spec.sources or paths)]
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in recorded]

    def run_plan(sc: Schedule) -> RunPlan:
        return RunPlan(sc, opened, names, pad_id=pad_id, memory=memory, holdout=holdout)

    runplan = run_plan(
        schedule
        or Schedule.of_flags(
            paths, weights, seq_len=seq_len, seed=seed, samples=samples, tokens=tokens, jitter=jitter, packing=packing
        )
    )
    run_params = (
        None if schedule is None or schedule.file is None else schedule_params_of(runplan, opened, shard_samples)
    )
    if run_params is not None and existing is not None and existing["schedule"] == run_params["schedule"]:
        spelled = {e["stage"]: e["weights"] for e in existing["given_schedule"]}  # equal as ratios: keep the run's
        runplan = run_plan(
            replace(schedule, stages=tuple(replace(st, weights=tuple(spelled[st.name])) for st in schedule.stages))
        )
    if epochs is None:
        epochs = list(range(runplan.schedule.epochs or 1))
    done_epochs = list(read_manifest(out, kind=RUN)["epochs"]) if (out / MANIFEST).exists() else []

    def new_job(plan, folder: Path, identity: list) -> EpochJob:
        """The job writing `plan` into `folder`, its work folder named by the hash of `identity`."""
        refuse_foreign_files(folder, to)
        key = xxhash.xxh3_64_hexdigest(json.dumps(identity).encode())
        locations = tuple(source_location(p) for p in paths)
        work = out / WORK_DIR / f"{folder.name}-{key}"
        eos, tokenizer = int(first["eos_id"]), first.get("tokenizer", "")
        return EpochJob(
            plan,
            locations,
            dtype,
            eos,
            tokenizer,
            str(folder),
            str(work),
            shard_samples,
            progress=bool(progress),
            main_pid=os.getpid(),
            output=to,
        )

    todo = []  # (epoch, plan, job or None when the epoch is complete already): planned before any write
    # the first epoch asked that the run lacks, for the hint of a different run: one it holds would write nothing
    held_epochs = set(done_epochs)
    lacks = next((e for e in epochs if e not in held_epochs), None)
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
        params = run_params_of(plan, [sp.weight for sp in plan.sources], shard_samples)
        if existing is not None:
            like = (
                shuffle_command({"kind": RUN}, out, lacks) if (out / MANIFEST).exists() and lacks is not None else None
            )
            check_same_run(existing, run_params or params, out, like)
        existing = run_params or params
        edir = out / epoch_dir_name(epoch)
        job = None
        if (edir / MANIFEST).exists():
            check_written_epoch(edir, params, plan)
        else:
            job = new_job(plan, edir, [params, plan.source_entries(), plan.algorithm, dtype])
        todo.append((epoch, plan, job))
    held = None
    if holdout is not None and not (out / HOLDOUT_DIR / MANIFEST).exists():  # written once, with the first epochs
        hp = used.holdout(
            opened, seq_len=seq_len, seed=seed, holdout=holdout, names=names, memory=memory, pad_id=pad_id
        )
        hp = replace(hp, sources=tuple(replace(sp, path=recorded[sp.index]) for sp in hp.sources))
        held = new_job(hp, out / HOLDOUT_DIR, [hp.source_entries(), hp.algorithm, dtype, seq_len])
    return RunSetup(opened, weights, shard_samples, done_epochs, todo, runplan, run_params, held)


# -------------------------------------------------------------------- the run's records


def weights_key(weights: list[str | None]) -> list[str] | None:
    """Weights as exact shares of their sum: only the ratios decide an epoch, so 7/3 and
    0.7/0.3 are the same run."""
    if all(w is None for w in weights):
        return None
    fr = [parse_weight(w, "weight") if w is not None else None for w in weights]
    total = sum(f for f in fr if f is not None)
    return [None if f is None else str(f / total if total else f) for f in fr]


def run_params_of(plan: SamplePlan, weights, shard_samples: int) -> dict:
    """What must match for two invocations to belong to the same run."""
    return {
        "shuffle": plan.algorithm,
        "packing": packings.of_plan(plan).run_fields(plan),
        "fingerprints": [sp.fingerprint for sp in plan.sources],
        "weights": weights_key(weights),
        "seq_len": plan.seq_len,
        "seed": plan.seed,
        "jitter": plan.jitter,
        "samples": plan.samples,
        "shard_samples": shard_samples,
        **({} if getattr(plan, "holdout", None) is None else {"holdout": plan.holdout}),
    }


def schedule_params_of(runplan: RunPlan, sources: list[PackedSource], shard_samples: int) -> dict:
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
    """A run's schedule with its weights as exact shares, as `weights_key` does for a run's."""
    return None if entries is None else [{**e, "weights": weights_key(e.get("weights") or [])} for e in entries]


def params_of_manifest(m: dict) -> dict:
    ws = m.get("weights") if m.get("kind") == RUN else [s.get("weight") for s in m.get("sources", [])]
    ws = ws if ws is not None else [None] * len(m.get("sources", []))
    return {
        "fingerprints": [s.get("fingerprint") for s in m.get("sources", [])],
        "weights": weights_key(ws),
        "given_weights": ws,  # as the run wrote them
        "jitter": bool(m.get("jitter")),
        "schedule": _schedule_key(m.get("schedule")),
        "given_schedule": m.get("schedule"),  # as the run wrote it
        "shuffle": m.get("shuffle"),
        "packing": None if PackingRecord.of(m) is None else PackingRecord.of(m).settings(),
        **{key: m.get(key) for key in ("seq_len", "seed", "samples", "shard_samples", "epoch_samples")},
        "holdout": holdout_recorded(m)[0],  # formats.packing knows where each packing records it
    }


def check_same_run(found: dict, wanted: dict, where: Path, like: str | None = None) -> None:
    """`wanted`: the run_params_of (or schedule_params_of) of this invocation; `like`: the command
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
                # a setting one side lacks (no --holdout, no weights) is said: a None would drop it from the line
                expected=f"no {key}" if wanted.get(key) is None else wanted.get(key),
                found=f"no {key}" if found.get(key) is None else found.get(key),
                hint="use another -o, delete it, or repeat the run's exact sources, weights, "
                "--seq-len, --seed, --jitter, --packing, --holdout, --samples/--tokens and --shard-samples"
                + (f"; to add the epoch with the run's own settings: `{like}`" if like else ""),
            )


def check_written_epoch(edir: Path, params: dict, plan: EpochPlan) -> None:
    """The epoch OUT holds in `edir` is `plan`'s, of the run `params` describe. Its manifest (a dict
    per shard) is read in here, so it goes before the next epoch's is read."""
    m = read_manifest(edir, kind=EPOCH)
    check_same_run(params_of_manifest(m), params, edir)
    if source_content(m.get("sources")) != source_content(plan.source_entries()):
        raise TokpackError(
            "epoch directory holds a different epoch",
            file=edir,
            where="sources",
            hint="delete that epoch directory or use another -o",
        )


def existing_run(out: Path, to: Output = LocalOutput()) -> dict | None:
    """Parameters of the run already in OUT (run manifest, else any complete epoch), or None.
    To a bucket, OUT holds the state fetched from the store, and the store what else is there."""
    if not out.exists():
        return None
    if not out.is_dir():
        # the line the lock's guard gives shuffle (formats.guard): plan, which takes no lock, gets it here
        raise TokpackError("output exists and is not a directory", file=out, hint="choose another -o")
    if (out / MANIFEST).exists():
        try:
            return params_of_manifest(read_manifest(out, kind=RUN))
        except TokpackError as e:
            if e.where != "kind":
                raise
            # -o a source or an epoch: the format's line says which kind, not what to do
            raise e.with_hint(
                f"-o takes a run directory (a new one, or one shuffle wrote), not a tokpack {e.found}: choose another -o"
            ) from None
    kept = to.where(out)
    listed = kept if kept.exists() else out
    foreign = [
        p.name
        for p in listed.iterdir()
        if not (
            p.name.startswith(EPOCH_DIR_PREFIX)
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
    for p in sorted(out.glob(f"{EPOCH_DIR_PREFIX}*/{MANIFEST}")):
        return params_of_manifest(read_manifest(p.parent, kind=EPOCH))
    return None


def epoch_totals(manifest: dict) -> dict:
    """What a run manifest sums of an epoch's manifest (formats.builders.run_manifest)."""
    return {"tokens": manifest["tokens"], "fragments": manifest["fragments"]}


def _shuffle_fields(plan: SamplePlan, samples: int, shard_samples: int, shuffle: str) -> ShuffleFields:
    """What the run's and the epochs' manifests record of how `plan`'s samples were made."""
    return ShuffleFields(plan.seed, plan.seq_len, samples, shard_samples, plan.jitter, shuffle)


def job_epoch_manifest(job: EpochJob, entries: list[dict], shuffle: str) -> dict:
    """An epoch manifest of `job`'s plan over its shards' entries, naming `shuffle` as its
    algorithm: the written epoch's (epoch_manifest_of) and the one `plan` sizes (run.planned_epoch_manifest)."""
    plan = job.plan
    sources = job.open_sources()
    return epoch_manifest(
        entries,
        TokenHeader(job.token_dtype, sources[0].vocab_size, job.eos_id, job.tokenizer),
        _shuffle_fields(plan, plan.samples, job.shard_samples, shuffle),
        tokens=plan.samples * plan.row_tokens,
        epoch=plan.epoch,
        dropped_tokens=plan.dropped_tokens(),
        sources=plan.source_entries(),
    )


def epoch_manifest_of(job: EpochJob, entries: list[dict], prepared) -> dict:
    """The epoch's manifest over its shards' entries (in order); `prepared`: what its packing
    built first (packings.Packing.prepare). shuffle --to-nodes (tokpack.packer.exchange) writes the same."""
    manifest = job_epoch_manifest(job, entries, job.plan.algorithm)
    manifest.update(packings.of_plan(job.plan).epoch_fields(job.plan, prepared))
    return manifest


def refuse_foreign_files(edir: Path, to: Output) -> None:
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


def source_content(entries) -> list[dict]:
    """Source entries without where the sources lay: moving a source does not change an epoch."""
    return [{k: v for k, v in e.items() if k not in ("path", "name")} for e in entries or []]
