"""`tokpack validate`: the manifest and directory checks of packed sources, runs and epochs
(node slices: tokpack.packer.slice_validation), the entry point that runs them with
tokpack.formats.shard_scan over every shard, `--against`, and the report (its text and exit
codes: docs/COMMANDS.md, "Validating").

A manifest is checked for schema, version, byte-exact form, sums and cross-field rules, and
its directory for holding the listed files and only those; a run's epochs must agree with the
run. `--against` replays each epoch's plan over the given sources and compares the sample
multiset hash and each shard's order hash (which sample sits at which position); that replay is
shuffle's (tokpack.shuffle.plan.replay_hashes), which the caller (tokpack.packer.api.validate)
passes in: this module imports nothing from shuffle/.
"""

from __future__ import annotations

import json
import re
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from tokpack.formats.errors import TokpackError
from tokpack.formats.io import TMP_MARK, ThreadPool, as_path, contained, name_problem, progress, read_limited
from tokpack.formats.manifest import (
    LOSS_SUFFIX,
    chain_start,
    EPOCH_DIR,
    HOLDOUT_DIR,
    KINDS,
    MANIFEST,
    MASK64,
    MAX_MANIFEST_BYTES,
    STAGE_SIDECAR,
    canonical_bytes,
    check_manifest,
    dtype_from_name,
    epoch_dir_name,
    has_pad,
    hash_hex64,
    partial_stage_absent,
    read_manifest,
    rows_padded,
    type_ok,
    xxh3_128_file,
    strict_json,
)
from tokpack.formats.numbering import EpochNumbering
from tokpack.formats.shard_scan import Findings, Problem, ShardJob, check_shard, problem_line, worst_status
from tokpack.formats.shards import (
    PAD_DTYPE,
    PAD_SUFFIX,
    ROWS_SUFFIX,
    PackedSource,
    contained_shard,
    shard_suffixes,
    tokens_on_nodes,
)
from tokpack.formats.slices import SLICE

from .slice_validation import slice_against_run, slice_shard_jobs

# One shard file rarely has more than a few independent faults worth reading about;
# past this many lines the rest are counted, not listed.
MAX_PROBLEMS_PER_FILE = 5
# A directory lists its first problems and counts the rest: a manifest of 1.5M broken shard
# entries had 9M problems, and validate grew to 3.3 GB holding them (issue 32).
MAX_PROBLEMS_LISTED = 100
SHARD_FILE = re.compile(r".*\.ds(\.index|\.metadata|\.loss|\.pad|\.rows)?$")


class ProblemList(list):
    """A directory's problems, bounded: the first MAX_PROBLEMS_LISTED are kept (at most
    MAX_PROBLEMS_PER_FILE of one file), the rest only counted (`total` counts all); the first
    unlisted problem of each severity is kept too, so the status is the gravest of all."""

    def __init__(self, problems=()):
        super().__init__()
        self.total = 0  # every problem added, listed or not
        self.per_file: dict[str, int] = {}  # problems added per file that has a listed one (bounded with the list)
        self.unlisted_first: dict[str, Problem] = {}  # severity -> its first unlisted problem
        self.extend(problems)

    def append(self, p: Problem) -> None:
        self.total += 1
        n = self.per_file.get(p.file)
        if n is None and len(self) < MAX_PROBLEMS_LISTED:
            n = self.per_file[p.file] = 0
        if n is not None:
            self.per_file[p.file] = n + 1
            if n < MAX_PROBLEMS_PER_FILE and len(self) < MAX_PROBLEMS_LISTED:
                super().append(p)
                return
        self.unlisted_first.setdefault(p.severity, p)

    def extend(self, problems) -> None:
        for p in problems:
            self.append(p)

    def __iadd__(self, problems):
        self.extend(problems)
        return self

    @property
    def status(self) -> str:
        return worst_status([*self, *self.unlisted_first.values()])

    def summarised(self, where) -> "ProblemList":
        """The listed problems, then one line per file with more than it lists and one for the
        rest of directory `where`; `total` and the status stay those of every problem."""
        out = ProblemList()
        listed: dict[str, int] = {}
        for p in self:
            list.append(out, p)
            listed[p.file] = listed.get(p.file, 0) + 1
        counted = sum(listed.values())
        for f, n in self.per_file.items():
            if n > listed.get(f, 0):
                list.append(out, Problem(f, None, None, None, f"{n - listed.get(f, 0)} more problems in this file"))
                counted += n - listed.get(f, 0)
        if self.total > counted:
            list.append(
                out,
                Problem(
                    str(where),
                    None,
                    None,
                    None,
                    f"{self.total - counted:,} more problems in other files of this directory, "
                    f"not listed (the report lists the first {MAX_PROBLEMS_LISTED})",
                ),
            )
        out.total, out.per_file, out.unlisted_first = self.total, dict(self.per_file), dict(self.unlisted_first)
        return out


@dataclass(kw_only=True)
class DirReport(Findings):
    """What validation found in one directory (a run's epochs get their own)."""

    problems: ProblemList = field(default_factory=ProblemList)  # bounded: the first problems, and a count

    path: Path  # the directory
    kind: str | None = None  # "source", "run", "epoch", or None when the manifest is unreadable
    manifest: dict | None = None  # its tokpack.json, when readable
    shard_orders: dict[str, int] = field(default_factory=dict)  # epoch: order hash recomputed per shard path

    @property
    def status(self) -> str:
        return self.problems.status


@dataclass
class ValidationReport:
    dirs: list[DirReport]  # every directory checked, runs before their epochs

    @property
    def problems(self) -> list[Problem]:
        return [p for d in self.dirs for p in d.problems]

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class _Dir:
    report: DirReport  # filled in as checks run
    jobs: list[ShardJob]  # shard checks still to run
    partial: bool = False  # some shards absent by a partial stage: no whole-epoch sums to check


def _open_manifest(path: Path, rep: DirReport, kinds) -> dict | None:
    try:
        manifest = read_manifest(path, kind=kinds, checked=False)  # every problem reported, not the first
    except TokpackError as e:
        rep.problems.append(Problem.from_error(e))
        return None
    raw = read_limited(path / MANIFEST, MAX_MANIFEST_BYTES, "manifest")
    if raw != canonical_bytes(json.loads(raw)):  # as written, before earlier keys are renamed
        rep.add(
            path / MANIFEST,
            "bytes",
            "the JSON text tokpack writes",
            "different bytes (edited after writing?)",
            "manifest text was altered",
        )
    rep.manifest = manifest
    rep.kind = manifest["kind"]
    rep.saw(len(raw))
    return manifest


def _check_listing(path: Path, shards: list[dict], rep: DirReport) -> None:
    """The directory holds no shard file the manifest does not list (the names were checked): a
    sidecar its entry does not record (a `.ds.pad` beside a window shard) is unlisted too."""
    # an unlisted loss mask has the shard scan's own line (formats/shard_scan.py)
    allowed = {s["path"] + suffix for s in shards for suffix in (*shard_suffixes(s), LOSS_SUFFIX)}
    for p in sorted(path.iterdir()):
        if TMP_MARK in p.name:
            continue  # a killed writer's leftover: never data
        if SHARD_FILE.match(p.name) and p.name not in allowed:
            rep.add(
                p, None, "only the files listed in the manifest", "an unlisted file", "file not listed in the manifest"
            )


def _check_row_hashes(path: Path, shards: list[dict], rep: DirReport, quick: bool) -> None:
    """An epoch of `shuffle --to-nodes` holds its shards' row hashes only: each `.ds.rows` has
    one xxh3-64 per sample, its recorded checksum, and sums to the shard's multiset_hash (its
    rows are proven in each node slice, by `validate SLICE --against RUN`)."""
    for s in shards:
        f = path / f"{s['path']}{ROWS_SUFFIX}"
        want = 8 * int(s["samples"])
        try:
            data = read_limited(f, want, "row hashes")
        except TokpackError as e:
            rep.problems.append(Problem.from_error(e))
            continue
        rep.saw(len(data))
        if len(data) != want:
            rep.add(f, "size", f"{want} bytes (8 a sample)", f"{len(data)} bytes", "row hashes cut short")
        elif not quick and xxhash.xxh3_128_hexdigest(data) != s["rows_xxh3_128"]:
            rep.add(f, "rows_xxh3_128", s["rows_xxh3_128"], xxhash.xxh3_128_hexdigest(data), "row hashes damaged")
        elif not quick and hash_hex64(int(np.frombuffer(data, "<u8").sum(dtype=np.uint64))) != s["multiset_hash"]:
            rep.add(
                f,
                "multiset_hash",
                s["multiset_hash"],
                "another sum of the row hashes",
                "row hashes disagree with the shard's multiset hash",
            )


def _check_pads(path: Path, shards: list[dict], rep: DirReport, row: int | None = None) -> int | None:
    """A best-fit epoch shard's `.ds.pad`: one uint32 per sample, each <= the sample's `row`
    tokens, matching its recorded checksum. Returns the padding summed over every shard, or None
    when some `.ds.pad` could not be read whole."""
    total = 0
    for i, s in enumerate(shards):
        if not isinstance(s, dict) or not has_pad(s) or not isinstance(s.get("path"), str):
            continue
        f = path / f"{s['path']}{PAD_SUFFIX}"
        want = int(s.get("samples", -1)) * PAD_DTYPE.itemsize
        try:
            data = read_limited(f, max(want, 0), "padding sidecar")
        except TokpackError as e:
            rep.problems.append(Problem.from_error(e))
            total = None
            continue
        except FileNotFoundError:
            rep.add(f, None, "the padding sidecar the manifest lists", "no such file", "shard file missing")
            total = None
            continue
        rep.saw(len(data))  # counted with the shard's other files
        if len(data) != want:
            rep.add(
                f, "size", f"{want} bytes (4 per sample)", f"{len(data)} bytes", "padding sidecar has the wrong size"
            )
            total = None
            continue
        if xxhash.xxh3_128_hexdigest(data) != s["pad_xxh3_128"]:
            rep.add(f, "xxh3_128", s["pad_xxh3_128"], xxhash.xxh3_128_hexdigest(data), "checksum mismatch")
        pads = np.frombuffer(data, PAD_DTYPE)
        over = np.flatnonzero(pads > row) if row is not None else []
        if len(over):  # the loader would mask more than the row: its padding cannot be the row's
            rep.add(
                f,
                f"row {int(over[0])}",
                f"at most {row} padding tokens (seq_len + 1)",
                int(pads[over[0]]),
                f"padding longer than its row ({len(over)} row{'s' * (len(over) != 1)})",
                hint="restore the .ds.pad from a good copy, or shuffle the epoch again",
            )
            total = None  # no total to compare: the row is already wrong
        if total is not None:
            total += int(pads.sum(dtype=np.int64))
    return total


def _check_padding(path: Path, m: dict, rep: DirReport) -> None:
    """A best-fit epoch (rows_padded): every shard entry lists its `.ds.pad` (without one the
    loader would serve padding as tokens), each fits its row, and together they sum to the
    recorded `packing.padding_tokens`."""
    shards = [s for s in m.get("shards") or [] if isinstance(s, dict)]
    row = m["seq_len"] + 1 if type_ok(m.get("seq_len"), int) else None
    mfile = path / MANIFEST
    if rows_padded(m):
        for i, s in enumerate(shards):
            if not has_pad(s):
                rep.add(
                    mfile,
                    f"shards[{i}].pad_xxh3_128",
                    "the checksum of the shard's .ds.pad (a best-fit epoch)",
                    "none",
                    "best-fit epoch shard lacks its padding sidecar: the loader would train on padding",
                    hint="restore the epoch from a good copy, or shuffle it again",
                )
    total = _check_pads(path, shards, rep, row)
    recorded = m.get("packing", {}).get("padding_tokens") if rows_padded(m) else None
    if total is not None and recorded is not None and all(has_pad(s) for s in shards) and total != recorded:
        rep.add(
            mfile,
            "packing.padding_tokens",
            f"{total} (the sum of the shards' .ds.pad)",
            recorded,
            "padding total disagrees with the padding sidecars",
        )


def _check_data_manifest(path: Path, m: dict, rep: DirReport, quick: bool) -> list[ShardJob]:
    """The manifest checks (tokpack.formats.manifest.check_manifest, which every command applies) and the
    listing; returns the shard jobs (empty if the manifest cannot drive them)."""
    usable = check_manifest(m, path, rep.add)
    shards = m.get("shards") if isinstance(m.get("shards"), list) else []
    if all(isinstance(s, dict) and name_problem(s.get("path")) is None for s in shards):
        _check_listing(path, shards, rep)
        _check_padding(path, m, rep)
    if not usable:
        return []
    kind = m["kind"]
    dtype = dtype_from_name(m["dtype"])
    row = m["seq_len"] + 1 if kind == "epoch" else None
    jobs = []
    for i, s in enumerate(shards):
        if name_problem(s["path"]):
            continue  # reported by check_manifest; never opened
        try:
            contained_shard(path, s, i)
        except TokpackError as e:  # a symlink out of the folder: reported, never opened
            rep.problems.append(Problem.from_error(e))
            continue
        jobs.append(ShardJob(path, s, kind, dtype, m["vocab_size"], m["eos_id"], m["tokenizer"], row, quick))
    return jobs


def _source_keys(sources: list) -> list:
    """What identifies a run's or epoch's sources: their fingerprints in order."""
    return [s.get("fingerprint") if isinstance(s, dict) else s for s in sources]


# Fields a run and each of its epochs must agree on (when both record them).
RUN_KEYS = (
    "dtype",
    "token_size",
    "vocab_size",
    "eos_id",
    "tokenizer",
    "seq_len",
    "seed",
    "jitter",
    "samples",
    "shard_samples",
    "shuffle",
)


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


def _check_run(path: Path, m: dict, rep: DirReport, quick: bool, plan: list["_Dir"]) -> None:
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
    held = path / HOLDOUT_DIR
    if (held / MANIFEST).is_file():  # shuffle --holdout's held-out documents: an epoch directory, never listed
        plan.append(_plan_dir(held, quick, kinds="epoch"))
    # A `stage --ranks` copy: its absent shards are one problem, not one line per file.
    absent = partial_stage_absent(path)
    if absent:
        rep.add(
            path / STAGE_SIDECAR,
            "missing_shards",
            "every shard of the run",
            f"{len(absent)} shards absent, {next(iter(absent.values()))}",
            "partial stage: serves only the ranks it was staged for",
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
        d = _plan_dir(sub, quick, kinds="epoch")
        present = [j for j in d.jobs if str(j.directory / j.entry["path"]) not in absent]
        d.jobs, d.partial = present, len(present) < len(d.jobs)
        if d.jobs and tokens_on_nodes(
            sub, [j.entry for j in d.jobs]
        ):  # shuffle --to-nodes: the tokens are in node slices
            _check_row_hashes(sub, [j.entry for j in d.jobs], d.report, quick)
            d.jobs, d.partial = [], True
        plan.append(d)
        em = d.report.manifest
        if em is None or em.get("kind") != "epoch":
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
    for key in RUN_KEYS:
        if key in m and key in em and em[key] != m[key] and not (key == "samples" and "schedule" in m):
            add(efile, key, f"{m[key]!r} (the run's)", repr(em[key]), "epoch manifest belongs to another run")
    esrc = em.get("sources") if isinstance(em.get("sources"), list) else []
    if len(esrc) == len(m["sources"]):
        for i, (a, b) in enumerate(zip(m["sources"], esrc)):
            if isinstance(a, dict) and isinstance(b, dict):
                for key in sorted(a.keys() & b.keys() - ({"weight"} if "schedule" in m else set())):
                    if a[key] != b[key]:
                        add(
                            efile,
                            f"sources[{i}].{key}",
                            f"{a[key]!r} (the run's)",
                            repr(b[key]),
                            "epoch source differs from the run's",
                        )
                if (
                    isinstance(m.get("weights"), list)
                    and i < len(m["weights"])
                    and "weight" in b
                    and m["weights"][i] != b["weight"]
                ):
                    add(
                        efile,
                        f"sources[{i}].weight",
                        repr(m["weights"][i]),
                        repr(b["weight"]),
                        "epoch weight differs from the run's",
                    )
    if em.get("epoch") != e:
        add(efile, "epoch", e, em.get("epoch"), "epoch manifest belongs to another epoch")
    if isinstance(em.get("sources"), list) and _source_keys(em["sources"]) != _source_keys(m["sources"]):
        add(
            efile,
            "sources",
            _source_keys(m["sources"]),
            _source_keys(em["sources"]),
            "epoch was shuffled from other sources than its run",
        )


def _plan_dir(path: Path, quick: bool, kinds=None) -> _Dir:
    rep = DirReport(path=path)
    d = _Dir(rep, [])
    if not path.exists():
        rep.add(path, None, None, None, "no such directory", missing=True, hint="check the path or URL")
        return d
    if not path.is_dir():
        rep.add(
            path,
            None,
            "a tokpack directory",
            "a file",
            "not a directory",
            hint="pass the directory that holds tokpack.json",
        )
        return d
    m = _open_manifest(path, rep, kinds or (*KINDS, SLICE))
    if m is None:
        return d
    if m["kind"] in ("source", "epoch"):
        d.jobs = _check_data_manifest(path, m, rep, quick)
    elif m["kind"] == SLICE:  # a node slice: its rank files are checked as epoch shards
        d.jobs = slice_shard_jobs(path, m, rep, quick) if check_manifest(m, path, rep.add) else []
        row = m["seq_len"] + 1 if type_ok(m.get("seq_len"), int) else None
        for job in d.jobs:  # a slice of a best-fit run: each rank file's padding sidecar
            _check_pads(job.directory, [job.entry], rep, row)
    return d


def plan_validation(paths: list[str | Path], quick: bool) -> list[_Dir]:
    """Reads every manifest and runs the manifest-level checks; returns the shard jobs to run."""
    plan: list[_Dir] = []
    for p in paths:
        path = as_path(p)
        d = _plan_dir(path, quick)
        plan.append(d)
        if d.report.kind == "run":
            _check_run(path, d.report.manifest, d.report, quick, plan)
    return plan


def validate_dirs(
    paths: list[str | Path],
    quick: bool = False,
    workers: int = 1,
    show_progress: bool | None = None,
    order: bool = False,
) -> ValidationReport:
    """Validates sources, runs (with their epochs) and epoch directories. Never raises for bad data.
    `order` (full mode): also each epoch shard's order hash, for `--against` to compare."""
    plan = plan_validation(paths, quick)
    if order and not quick:
        for d in plan:
            if d.report.kind == "epoch" and d.jobs:  # jobs exist only for a manifest whose fields are sound
                m = d.report.manifest
                first = {s["path"]: i * m["shard_samples"] for i, s in enumerate(m["shards"])}
                for job in d.jobs:
                    job.first_sample = first[job.entry["path"]]
    jobs = [(d, j) for d in plan for j in d.jobs]
    total = sum(j.size() for _, j in jobs) if not quick else len(jobs)
    recomputed: dict[int, list] = {}

    def merge(d, job, res) -> None:  # each shard's findings as it ends, in job order: the report is deterministic
        d.report.problems += res.problems
        d.report.files += res.files
        d.report.bytes += res.bytes
        recomputed.setdefault(id(d), []).append(res.multiset)
        if res.order is not None:
            d.report.shard_orders[job.entry["path"]] = res.order

    with progress(
        total, "validate" + (" --quick" if quick else ""), unit="B" if not quick else "shard", enabled=show_progress
    ) as bar:

        def run(item):
            d, job = item
            try:
                res = check_shard(job)
            # Only an unreadable file is the data's fault (manifests were checked before their
            # shards); any other exception is a bug in tokpack and must not be blamed on the data.
            except TokpackError as e:  # e.g. a FIFO where a file should be: its own line
                res = Findings()
                res.problems.append(Problem.from_error(e))
            except OSError as e:
                res = Findings()
                res.add(
                    job.directory / job.entry["path"],
                    None,
                    "a checkable shard",
                    f"{type(e).__name__}: {e}",
                    "cannot check shard",
                )
            bar.update(job.size() if not quick else 1)
            return d, job, res

        # merged as they end, never all held: a shard's findings are dropped once counted
        if workers > 1 and len(jobs) > 1:
            with ThreadPool(workers) as pool:  # Ctrl-C, SIGTERM: the shards not started are dropped
                pending: deque = deque()  # a few calls ahead of the merge, not one future per shard
                for item in jobs:
                    pending.append(pool.submit(run, item))
                    if len(pending) >= 4 * workers:
                        merge(*pending.popleft().result())
                while pending:
                    merge(*pending.popleft().result())
        else:
            for item in jobs:
                merge(*run(item))
    for d in plan:
        rep, m = d.report, d.report.manifest
        if rep.kind == "epoch" and d.jobs and not quick and not d.partial:
            parts = recomputed.get(id(d), [])
            if all(x is not None for x in parts):
                rep.multiset = sum(parts) & MASK64
                if (
                    isinstance(m.get("sample_multiset_hash"), str)
                    and hash_hex64(rep.multiset) != m["sample_multiset_hash"]
                ):
                    rep.add(
                        rep.path,
                        "sample_multiset_hash",
                        f"{m['sample_multiset_hash']} (recorded in {MANIFEST})",
                        hash_hex64(rep.multiset) + " (recomputed from the samples)",
                        "the epoch's samples are not the ones recorded",
                    )
    for d in plan:  # one broken field can break every shard entry: a few lines per file, the rest counted
        d.report.problems = d.report.problems.summarised(d.report.path)
    return ValidationReport([d.report for d in plan])


def _missing_sources(m: dict, given: dict[str, PackedSource], mfile: str) -> Problem | None:
    """UNVERIFIED, naming each source of the epoch that `--against` did not give: without all of
    them the plan cannot be replayed. Nothing is known to be wrong with the epoch."""
    by_path = {Path(s.path).resolve(): s for s in given.values()}
    missing, paths = [], []
    for e in m["sources"]:
        e = e if isinstance(e, dict) else {}
        fp = e.get("fingerprint")
        if fp in given or e.get("samples") == 0:  # a source of a scheduled run that this epoch does not use
            continue
        text = f"{e.get('name', '?')} (fingerprint {fp})"
        same_place = by_path.get(Path(str(e.get("path", ""))).resolve()) if e.get("path") else None
        if same_place is not None:  # given by path, but its content is not the one shuffled
            text += f", changed since the shuffle: {same_place.path} now has fingerprint {same_place.fingerprint}"
        missing.append(text)
        paths.append(str(e.get("path") or e.get("name", "?")))
    if not missing:
        return None
    n = len(m["sources"])
    return Problem(
        mfile,
        "sources",
        f"--against for each of its {n} source{'s' * (n != 1)}",
        "none for " + "; ".join(missing),
        "epoch holds samples from a source not given to --against; its content is not verified",
        hint="give every source the epoch was shuffled from, as it was then: "
        + " ".join(f"--against {p}" for p in paths),
        unverified=True,
    )


def _against(report: ValidationReport, against: list[str], replay) -> list[Problem]:
    """For every readable epoch: its sources are among `against` (by fingerprint), the multiset
    hash of the windows the plan assigns it equals the epoch's, and so does the order hash of
    every shard the scan read (`replay(manifest, sources)` gives the planned multiset hash and
    per-shard order hashes). A problem with an epoch goes into that epoch's report, so its
    status line says it too; the problems returned are those of the `against` sources that
    cannot be opened."""
    sources, problems = [], []
    for a in against:
        try:
            sources.append(PackedSource.open(a))
        except TokpackError as e:
            problems.append(Problem.from_error(e))
    given = {s.fingerprint: s for s in sources}
    for d in report.dirs:
        m = d.manifest
        if d.kind != "epoch" or m is None or not isinstance(m.get("sources"), list):
            continue
        mfile = str(d.path / MANIFEST)
        missing = _missing_sources(m, given, mfile)
        if missing is not None:
            d.problems.append(missing)
            continue
        try:
            expected, orders = replay(m, sources)
        except (TokpackError, OSError) as e:
            err = e if isinstance(e, TokpackError) else TokpackError(f"cannot replay the plan: {e}", file=e.filename)
            d.add(err.file or mfile, err.where, err.expected, err.found, err.message)
            continue
        except (KeyError, TypeError, ValueError):
            if any(p.file == mfile for p in d.problems):
                continue  # a manifest already reported broken cannot drive the replay
            raise  # from a manifest that passed every check: a bug in tokpack, not in the data
        if expected != m.get("sample_multiset_hash"):
            d.add(
                mfile,
                "sample_multiset_hash",
                f"{expected} (replayed from the sources)",
                f"{m.get('sample_multiset_hash')} (recorded in {MANIFEST})",
                "epoch does not hold the samples its plan assigns (dropped/duplicated/altered)",
            )
        _order_problem(d, orders)
    return problems


def _order_problem(d: DirReport, planned: list[int]) -> None:
    """One line for an epoch whose shards, as scanned, do not hold the samples at the positions
    its plan gives them: it names the first such shard and counts the others."""
    shards = d.manifest["shards"]
    found = d.shard_orders
    wrong = [i for i, s in enumerate(shards) if s["path"] in found and found[s["path"]] != planned[i]]
    if not wrong:
        return
    i = wrong[0]
    d.add(
        d.path / shards[i]["path"],
        "order_hash",
        f"{hash_hex64(planned[i])} (replayed from the sources)",
        f"{hash_hex64(found[shards[i]['path']])} (from its samples)",
        f"sample order differs from the plan ({len(wrong)} of {len(found)} shards checked differ)",
        hint="the epoch's samples are not at the positions its seed and epoch give them: restore the epoch "
        "from a good copy, or shuffle it again from the same sources, seed and epoch",
    )


def _slice_without_run(d: DirReport, given) -> Problem:
    """A slice is compared with its run only: `--against` anything else would compare nothing
    and pass."""
    kind = _kind(given)
    return Problem(
        str(given),
        "--against",
        "the run the slice was staged from",
        f"a {kind}" if kind else "no tokpack directory",
        f"cannot compare node slice {d.path} with it: a slice is compared only with its run",
        hint=f"give --against the run directory it was staged from ({d.manifest.get('source') or 'RUN'})",
        unverified=True,
    )


def _not_a_source(given) -> Problem:
    """A run, an epoch or a slice given to `--against` of a run or epoch: epochs are replayed
    from packed sources only, so it is refused in one line rather than validated as a source."""
    return Problem(
        str(given),
        "--against",
        "a packed source the epochs were shuffled from",
        f"a {_kind(given)}",
        "cannot replay epochs from it: --against takes the packed sources of a run",
        hint="give --against each packed source the run was shuffled from (its tokpack.json `sources`)",
        unverified=True,
    )


def _kind(path) -> str | None:
    try:
        manifest = as_path(path) / MANIFEST
        return strict_json(read_limited(manifest, MAX_MANIFEST_BYTES, "manifest"), manifest).get("kind")
    except (TokpackError, OSError, AttributeError):
        return None


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


@dataclass
class ValidateResult:
    """What `validate --json` prints: `ok`, the gravest `status` ("ok", "corrupt", "missing", "incomplete",
    "unverified"), each problem and each directory checked."""

    ok: bool
    status: str
    quick: bool
    problems: list[dict]  # Problem.to_json(): each directory's first MAX_PROBLEMS_LISTED, then count lines
    dirs: list[dict]  # path, kind, status, problems (a count of all), files, bytes
    files: int
    bytes: int
    seconds: float
    mb_per_s: float
    against: list[str]
    problems_total: int | None = None  # every problem found, listed or counted (None: len(problems))

    def to_json(self) -> dict:
        return asdict(self)


def validate_all(
    dirs: list[str],
    quick: bool = False,
    against: list[str] | None = None,
    workers: int = 1,
    show_progress: bool | None = None,
    replay=None,
    source_rows=None,
) -> ValidateResult:
    """Validates each directory (source, run or epoch); with `against`, also those sources and
    every epoch's content and order through its plan, replayed by `replay` (tokpack.shuffle.plan's
    replay_hashes, given by the caller: this layer does not import shuffle). A slice against a
    --to-nodes RUN is proven from the sources by `source_rows` (tokpack.packer.replacement's
    SourceRows, given by the caller too; see slice_against_run)."""
    t0 = time.perf_counter()
    against = list(against or [])
    known = {as_path(x).resolve() for x in dirs}
    # A slice's --against is its run: compared by row hashes, not validated whole.
    slice_runs = [a for a in against if _kind(a) == "run"] if any(_kind(x) == SLICE for x in dirs) else []
    against = [a for a in against if a not in slice_runs]
    not_sources: list[Problem] = []
    if against and all(_kind(x) == SLICE for x in dirs):  # sources with nothing to check them against
        unmatched, against = against, []
    else:
        unmatched = []
        not_sources = [_not_a_source(a) for a in against if _kind(a) not in (None, "source")]
        against = [a for a in against if _kind(a) in (None, "source")]
    extra = [a for a in against if as_path(a).resolve() not in known]
    report = validate_dirs(
        list(dirs) + extra, quick=quick, workers=workers, show_progress=show_progress, order=bool(against)
    )
    extra_problems = _against(report, against, replay) if against else []
    for d in report.dirs:
        if d.kind == SLICE and d.manifest is not None:
            for run in slice_runs:
                slice_against_run(d.path, d.manifest, run, d, source_rows=source_rows)
            if not slice_runs and (against or unmatched):
                d.problems.append(_slice_without_run(d, (against or unmatched)[0]))
    against += slice_runs
    seconds = time.perf_counter() - t0
    problems = not_sources + report.problems + extra_problems
    nbytes = sum(d.bytes for d in report.dirs)
    unlisted = [p for d in report.dirs for p in d.problems.unlisted_first.values()]
    return ValidateResult(
        ok=not problems,
        status=worst_status(problems + unlisted),
        quick=quick,
        problems=[p.to_json() for p in problems],
        problems_total=len(not_sources) + sum(d.problems.total for d in report.dirs) + len(extra_problems),
        dirs=[
            {
                "path": str(d.path),
                "kind": d.kind,
                "status": d.status,
                "problems": d.problems.total,
                "files": d.files,
                "bytes": d.bytes,
                **({"vocab_known": False, "vocab_size": d.manifest.get("vocab_size")} if _vocab_unknown(d) else {}),
            }
            for d in report.dirs
        ],
        files=sum(d.files for d in report.dirs),
        bytes=nbytes,
        seconds=round(seconds, 4),
        mb_per_s=round(nbytes / 1e6 / max(seconds, 1e-9), 1),
        against=against,
    )


def _vocab_unknown(d: DirReport) -> bool:
    """A source packed without a vocabulary (its manifest's `vocab_known: false`): its ids were
    checked only against the input dtype's width, which the report says."""
    return isinstance(d.manifest, dict) and d.manifest.get("vocab_known") is False


def report_lines(r: ValidateResult) -> list[str]:
    """The report for humans: each problem, each directory's status, then the verdict."""
    lines = [problem_line(p) for p in r.problems]
    for d in r.dirs:
        what = d["kind"] or "directory"
        n = d["problems"]
        vocab = (
            ""
            if d.get("vocab_known", True)
            else (f"; vocabulary unknown: ids checked only against the token width, {d['vocab_size']}")
        )
        lines.append(
            f"OK {what} {d['path']} ({d['files']} file{'s' * (d['files'] != 1)}, {_size(d['bytes'])}"
            f"{', quick' if r.quick else ''}{vocab})"
            if d["status"] == "ok"
            else f"{d['status'].upper()} {what} {d['path']}: {n} problem{'s' * (n != 1)}"
        )
    n = len(r.problems) if r.problems_total is None else r.problems_total
    lines.append(
        f"{r.status.upper()}: {len(r.dirs)} director{'ies' if len(r.dirs) != 1 else 'y'}, "
        f"{r.files} file{'s' * (r.files != 1)}, {_size(r.bytes)} in {r.seconds:.2f} s ({r.mb_per_s:.0f} MB/s), {n} problem{'s' * (n != 1)}"
        + (", quick (no checksums, no token scan)" if r.quick else "")
        + (f", against {_against_text(r.against)}" if r.against else "")
    )
    return lines


def _against_text(paths: list[str]) -> str:
    """What --against named: sources, and the runs slices were checked against ("1 run", not "1 source(s)")."""
    runs = sum(_kind(a) == "run" for a in paths)
    return " and ".join(
        f"{n} {name}{'s' * (n != 1)}" for n, name in ((len(paths) - runs, "source"), (runs, "run")) if n
    )
