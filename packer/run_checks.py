"""`tokpack validate` of a run (tokpack.packer.validation runs it): every epoch it lists is there
and agrees with the run (its schedule, size, settings and sources), unlisted epoch folders and a
partial stage are named, and RUN/holdout/ is checked as an epoch.
"""

from __future__ import annotations

from array import array

from pathlib import Path

from tokpack.formats.errors import TokpackError
from tokpack.formats.io.gate import contained
from tokpack.formats.checks import chain_start, EPOCH_DIR, check_manifest
from tokpack.formats.constants import EPOCH, HOLDOUT_DIR, MANIFEST, STAGE_SIDECAR
from tokpack.formats.names import epoch_dir_name
from tokpack.formats.reading import partial_stage_absent
from tokpack.formats.fields import type_ok
from tokpack.formats.hashes import xxh3_128_file
from tokpack.formats.numbering import EpochNumbering, shuffle_command
from tokpack.formats.packing import run_holdout
from tokpack.formats.shard_scan import Problem
from tokpack.formats.shards import tokens_on_nodes
from tokpack.formats.slices import epoch_disagreements, holdout_disagreements

from .dir_checks import Dir, DirReport, check_row_hashes, plan_dir


def _scheduled_epochs(path: Path, m: dict, rep: DirReport) -> list[dict] | None:
    """A scheduled run's recorded schedule (docs/FORMAT.md, "Schedules") as, per epoch, each run
    source's `samples`, `weight` and `cursor` (the samples the epochs before took from it); None
    for a run without one, or one too broken to follow (reported). Also checks the schedule file
    against its recorded checksum."""
    if m.get("schedule") is None:
        return None
    mfile, sched, sizes, n = str(path / MANIFEST), m["schedule"], m.get("epoch_samples"), len(m["sources"])
    try:
        per_epoch, taken = [], [0] * n
        for e, entry in enumerate(sched):
            idx, weights, counts = entry["sources"], entry["weights"], entry["samples"]
            if not (
                len(idx) == len(weights) == len(counts)
                and all(0 <= i < n for i in idx)
                and all(type_ok(c, int) and c >= 0 for c in counts)
            ):
                raise ValueError(e)
            row = {"samples": [0] * n, "weight": [None] * n, "cursor": list(taken)}
            for i, w, c in zip(idx, weights, counts):
                row["samples"][i], row["weight"][i] = c, w
            if sum(counts) != sizes[e]:
                rep.add(
                    mfile,
                    f"epoch_samples[{e}]",
                    f"{sum(counts)} (schedule[{e}].samples summed)",
                    sizes[e],
                    "scheduled epoch size wrong",
                )
            taken = [t + c for t, c in zip(taken, row["samples"])]
            per_epoch.append(row)
        if len(sizes) != len(sched) or m.get("samples") != 0:
            raise ValueError(len(sched))
    except (KeyError, TypeError, ValueError, IndexError) as e:
        rep.add(
            mfile,
            "schedule",
            "per epoch {stage, sources, weights, samples}, one per epoch_samples entry, and samples 0",
            f"a malformed entry ({e})",
            "scheduled run manifest malformed",
        )
        return None
    file = Path(str(m.get("schedule_file")))
    if not file.is_file():
        rep.add(
            mfile,
            "schedule_file",
            "the schedule file the run was made from",
            f"no file {file}",
            "schedule file not found: the run's schedule is not checked against it",
            unverified=True,
            hint="give the run's schedule file back its path, or ignore this if it is gone for good",
        )
    elif xxh3_128_file(file) != m.get("schedule_xxh3_128"):
        rep.add(
            file,
            "xxh3_128",
            f"{m.get('schedule_xxh3_128')} (recorded in {mfile})",
            xxh3_128_file(file),
            "schedule file changed since the run was made; the run follows the schedule it recorded",
            hint="restore the file the run was made from, or write the new schedule to another run directory",
        )
    return per_epoch


def _check_scheduled_epoch(efile: str, e: int, em: dict, sched: list[dict] | None, add) -> None:
    """Epoch e of a scheduled run against the run's schedule: its size, weights and per-source
    samples, and that each source's chain continues exactly where the epochs before left it."""
    if sched is None or not isinstance(em.get("sources"), list):
        return
    if e >= len(sched):
        add(efile, "epoch", f"< {len(sched)} (the schedule's epochs)", e, "epoch is not in the run's schedule")
        return
    row = sched[e]
    if em.get("samples") != sum(row["samples"]):
        add(
            efile,
            "samples",
            f"{sum(row['samples'])} (epoch_samples[{e}])",
            em.get("samples"),
            "epoch size differs from the run's schedule",
        )
    for i, src in enumerate(em["sources"][: len(row["samples"])]):
        if not isinstance(src, dict):
            continue
        c, at = row["samples"][i], row["cursor"][i]
        for key, want in (("weight", row["weight"][i]), ("samples", c)):
            if src.get(key) != want:
                add(
                    efile,
                    f"sources[{i}].{key}",
                    f"{want!r} (schedule[{e}])",
                    repr(src.get(key)),
                    "epoch source differs from the run's schedule",
                )
        start = src.get("cursor", chain_start(e, c))
        if c and type_ok(start, int) and start != at:
            why = (
                (
                    f"windows at chain positions {start}..{min(at, start + c) - 1} were taken before; a window is "
                    f"taken twice before its source is exhausted"
                )
                if start < at
                else "windows of its chain skipped"
            )
            add(
                efile,
                f"sources[{i}].cursor",
                f"{at} (what epochs 0..{e - 1} took from {src.get('name')})",
                start,
                f"source chain not contiguous across the schedule: {why}",
            )


def check_run(path: Path, m: dict, rep: DirReport, quick: bool, plan: list["Dir"]) -> None:
    mfile = str(path / MANIFEST)
    before = rep.problems.total
    check_manifest(m, path, rep.add)
    if rep.problems.total > before:
        return
    sched = _scheduled_epochs(path, m, rep)
    epochs = m["epochs"]
    numbering = EpochNumbering.of_run(m, path)
    listed = {epoch_dir_name(e) for e in epochs}
    for p in sorted(path.iterdir()):
        if p.is_dir() and EPOCH_DIR.match(p.name) and p.name not in listed:
            rep.add(
                p,
                None,
                "an epoch listed in the run's `epochs`",
                "an unlisted epoch directory",
                "epoch not yet recorded in the run manifest (interrupted shuffle?); rerun it",
                incomplete=True,
            )
    try:  # shuffle --holdout's held-out documents: an epoch directory of the run, never listed
        held = contained(path, HOLDOUT_DIR, manifest=mfile, where=f"epochs ({HOLDOUT_DIR})", regular=False)
    except TokpackError as err:  # a symlink out of the run: another run's split; reported, never opened
        rep.problems.append(Problem.from_error(err))
    else:
        if (held / MANIFEST).is_file():
            d = plan_dir(held, quick, kinds="epoch")
            plan.append(d)
            hm = d.report.manifest
            if hm is not None and hm.get("kind") == EPOCH:  # well formed, but this run's split?
                for where, expected, got, message in holdout_disagreements(m, hm):
                    d.report.add(held / MANIFEST, where, expected, got, message, hint=holdout_hint(m, path))
    # A `stage --ranks` copy: its absent shards are one problem, not one line per file.
    absent = partial_stage_absent(path)
    if absent:
        rep.add(
            path / STAGE_SIDECAR,
            "missing_shards",
            "every shard of the run",
            f"{len(absent)} shards absent, {next(iter(absent.values()))}",
            "partial stage: serves only the ranks it was staged for",
            # by design, not damage: the default hint ("the data changed after it was written") sent users to restore it
            hint="a `stage --shards-of r/W` copy holds the shards of those ranks only: train only those ranks on it, "
            "or stage the run into it again without --shards-of to make it whole",
        )
    totals = [0, 0, 0]  # tokens, documents, readable epochs
    for e in epochs:
        try:
            sub = contained(path, epoch_dir_name(e), manifest=mfile, where=f"epochs ({e})", regular=False)
        except TokpackError as err:  # a symlink out of the run: reported, never opened
            rep.problems.append(Problem.from_error(err))
            continue
        if not sub.is_dir():
            rep.add(sub, None, "the epoch directory listed in the run manifest", "no such directory", "epoch missing")
            continue
        d = plan_dir(sub, quick, kinds="epoch")
        if absent and d.jobs:  # a partial stage: its absent shards dropped by index, no job held a shard
            kept = array("q", (i for i in d.jobs.indices if str(sub / d.jobs.shards[i]["path"]) not in absent))
            d.jobs.indices, d.partial = kept, len(kept) < len(d.jobs)
        if d.jobs and tokens_on_nodes(sub, d.jobs.entries()):  # shuffle --to-nodes: the tokens are in node slices
            check_row_hashes(sub, d.jobs.entries(), d.report, quick)
            d.jobs, d.partial = [], True
        plan.append(d)
        em = d.report.manifest
        if em is None or em.get("kind") != EPOCH:
            continue
        efile = str(sub / MANIFEST)
        _check_epoch_of_run(m, e, em, efile, sched, numbering, d.report.add)
        totals[0] += em.get("tokens", 0) if type_ok(em.get("tokens"), int) else 0
        totals[1] += em.get("fragments", 0) if type_ok(em.get("fragments"), int) else 0
        totals[2] += 1
    if totals[2] == len(epochs):
        for i, key in enumerate(("tokens", "fragments")):
            if type_ok(m.get(key), int) and m[key] != totals[i]:
                rep.add(mfile, key, f"{totals[i]} (sum over its epochs)", m[key], f"run {key} count wrong")


def refuse_epoch_of_another_run(m: dict, run_dir: str, e: int, em: dict, efile: str) -> None:
    """One line at the first way epoch e's manifest `em` disagrees with its run's `m`, as
    validate finds it (its schedule aside). A stage refuses such a run before writing: an epoch
    reshuffled with another seed or sources, copied in or edited, staged beside the run's other
    epochs, would be served as this run's."""
    found = []
    _check_epoch_of_run(
        m, e, em, efile, None, EpochNumbering.of_run(m, run_dir), lambda *problem: found.append(problem)
    )
    if found:
        file, where, expected, got, message = found[0]
        raise TokpackError(
            message,
            file=file,
            where=where,
            expected=expected,
            found=got,
            hint=f"the epoch was written by another run or edited: run `tokpack validate {run_dir}`, then restore "
            f"the epoch, or remove its folder and rewrite it with `{shuffle_command(m, run_dir, e)}`",
        )


def holdout_hint(m: dict, run_dir) -> str:
    """What to do about a RUN/holdout/ that is not the run's: a rerun writes a missing one."""
    first = m["epochs"][0] if m.get("epochs") else 0
    if run_holdout(m) is None:
        return f"the run was made without --holdout: {Path(run_dir) / HOLDOUT_DIR} is another run's; remove it"
    return (
        f"{Path(run_dir) / HOLDOUT_DIR} was written by another run or edited: restore the run's own, or remove "
        f"the folder and write it again with `{shuffle_command(m, run_dir, first)}`"
    )


def refuse_holdout_of_another_run(m: dict, run_dir: str, hm: dict, hfile: str) -> None:
    """One line at the first way RUN/holdout/'s manifest `hm` disagrees with its run's `m`, as
    validate finds it: a stage that copied another run's split beside the run's epochs would
    hand eval documents the run trained on."""
    for where, expected, got, message in holdout_disagreements(m, hm):
        raise TokpackError(
            message, file=hfile, where=where, expected=expected, found=got, hint=holdout_hint(m, run_dir)
        )


def _check_epoch_of_run(m: dict, e: int, em: dict, efile: str, sched, numbering: EpochNumbering, add) -> None:
    """Epoch e's manifest `em` against its run's `m`: its schedule, its size, the settings and
    sources they share, its number; each disagreement through `add`."""
    _check_scheduled_epoch(efile, e, em, sched, add)
    if (
        "epoch_samples" in m
        and "schedule" not in m
        and not (numbering.has(e) and em.get("samples") == numbering.size(e))
    ):
        add(
            efile,
            "samples",
            f"{numbering.size(e)} (the run's epoch_samples)" if numbering.has(e) else "no such epoch in the run's plan",
            em.get("samples"),
            "epoch size differs from its run's",
        )
    for where, expected, found, message in epoch_disagreements(m, e, em):
        add(efile, where, expected, found, message)
