"""A shuffle run's setup: opens the sources and OUT's run (if any), checks they agree, and decides
every epoch asked for before a byte is written (`setup_run`, its `RunSetup`): `tokpack shuffle`
(tokpack.shuffle.run) runs it, `tokpack plan shuffle` (tokpack.packer.planning) reports it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import xxhash

from tokpack.formats.errors import TokpackError
from tokpack.formats.constants import WORK_DIR, HOLDOUT_DIR, MANIFEST
from tokpack.formats.outputs import LocalOutput, Output
from tokpack.formats.names import dtype_name, epoch_dir_name
from tokpack.formats.reading import read_manifest
from tokpack.formats.numbering import shuffle_command
from tokpack.formats.shards import PackedSource
from tokpack.formats.units import at_most, weight_text

from . import packings
from .holdout import parse_holdout
from .plan import EpochPlan
from .sources import open_source, source_location
from .schedule import RunPlan, Schedule, same_source_twice
from .spec import ShuffleSpec
from .steps import ORDER_ROW_OVERHEAD
from .epoch_job import EpochJob
from .run_records import (
    check_same_run,
    existing_run,
    params_of_manifest,
    refuse_foreign_files,
    run_params_of,
    schedule_params_of,
    source_content,
    weights_key,
)


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
    done_epochs = []
    if (out / MANIFEST).exists():
        done_epochs = list(read_manifest(out, kind="run")["epochs"])

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
            like = shuffle_command({"kind": "run"}, out, epoch) if (out / MANIFEST).exists() else None
            check_same_run(existing, run_params or params, out, like)
        existing = run_params or params
        edir = out / epoch_dir_name(epoch)
        job = None
        if (edir / MANIFEST).exists():
            m = read_manifest(edir, kind="epoch")
            check_same_run(params_of_manifest(m), params, edir)
            if source_content(m.get("sources")) != source_content(plan.source_entries()):
                raise TokpackError(
                    "epoch directory holds a different epoch",
                    file=edir,
                    where="sources",
                    hint="delete that epoch directory or use another -o",
                )
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
