"""A shuffle run's records, and what they say about OUT: whether OUT holds the same run as this
invocation (its parameters against the run's or an epoch's manifest), what else OUT may hold,
and the run and epoch manifests written as epochs finish. tokpack.shuffle.run_setup checks an
invocation with these; tokpack.shuffle.run writes the manifests.
"""

from __future__ import annotations

from pathlib import Path

from tokpack.formats.errors import TokpackError
from tokpack.formats.constants import LOCK_NAME, WORK_DIR, HOLDOUT_DIR, MANIFEST, NODES_SIDECAR
from tokpack.formats.io.writes import TMP_MARK
from tokpack.formats.outputs import LocalOutput, Output
from tokpack.formats.names import epoch_dir_name
from tokpack.formats.builders import epoch_manifest, run_manifest, ShuffleFields, TokenHeader
from tokpack.formats.reading import read_manifest
from tokpack.formats.packing import PackingRecord, holdout_recorded
from tokpack.formats.shards import PackedSource, is_own_file
from tokpack.formats.units import parse_weight

from . import packings
from .plan import EpochPlan, SamplePlan
from .schedule import RunPlan
from .epoch_job import EpochJob


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
    ws = m.get("weights") if m.get("kind") == "run" else [s.get("weight") for s in m.get("sources", [])]
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
                expected=wanted.get(key),
                found=found.get(key),
                hint="use another -o, delete it, or repeat the run's exact sources, weights, "
                "--seq-len, --seed, --jitter, --packing, --holdout, --samples/--tokens and --shard-samples"
                + (f"; to add the epoch with the run's own settings: `{like}`" if like else ""),
            )


def existing_run(out: Path, to: Output = LocalOutput()) -> dict | None:
    """Parameters of the run already in OUT (run manifest, else any complete epoch), or None.
    To a bucket, OUT holds the state fetched from the store, and the store what else is there."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise TokpackError("output is not a directory", file=out)
    if (out / MANIFEST).exists():
        return params_of_manifest(read_manifest(out, kind="run"))
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
        return params_of_manifest(read_manifest(p.parent, kind="epoch"))
    return None


def written_run_manifest(
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
    entry = packings.of_plan(plan)
    packing, holdout = entry.run_fields(plan), entry.run_holdout(plan)
    if packing is not None or holdout:
        extra = {**(extra or {}), **({} if packing is None else {"packing": packing}), **holdout}
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


def job_epoch_manifest(job: EpochJob, entries: list[dict], shuffle: str) -> dict:
    """An epoch manifest of `job`'s plan over its shards' entries, naming `shuffle` as its
    algorithm: the written epoch's (epoch_manifest_of) and the one `plan` sizes (run.planned_epoch_manifest)."""
    plan = job.plan
    sources = job.open_sources()
    return epoch_manifest(
        entries,
        TokenHeader(job.token_dtype, sources[0].vocab_size, job.eos_id, job.tokenizer),
        ShuffleFields(
            seed=plan.seed,
            seq_len=plan.seq_len,
            samples=plan.samples,
            shard_samples=job.shard_samples,
            jitter=plan.jitter,
            shuffle=shuffle,
        ),
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
