"""`tokpack validate`: formats.validate's checks plus `--against`, which recomputes through the
shuffle plan what each epoch must contain and compares sample multiset hashes."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from formats.errors import TokpackError
from formats.manifest import MANIFEST
from formats.shards import PackedSource
from formats.validate import Problem, ValidationReport, validate_dirs, worst_status

from .plan import expected_multiset_hash


def _missing_sources(m: dict, given: dict[str, PackedSource], mfile: str) -> Problem | None:
    """UNVERIFIED, naming each source of the epoch that `--against` did not give: without all of
    them the plan cannot be replayed. Nothing is known to be wrong with the epoch."""
    by_path = {Path(s.path).resolve(): s for s in given.values()}
    missing, paths = [], []
    for e in m["sources"]:
        e = e if isinstance(e, dict) else {}
        fp = e.get("fingerprint")
        if fp in given:
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
    return Problem(mfile, "sources", f"--against for each of its {n} source{'s' * (n != 1)}",
                   "none for " + "; ".join(missing),
                   "epoch holds samples from a source not given to --against; its content is not verified",
                   hint="give every source the epoch was shuffled from, as it was then: "
                        + " ".join(f"--against {p}" for p in paths), unverified=True)


def _against(report: ValidationReport, against: list[str]) -> list[Problem]:
    """For every readable epoch: its sources are among `against` (by fingerprint) and the
    multiset hash of the windows the plan assigns it equals the epoch's. A problem with an
    epoch goes into that epoch's report, so its status line says it too; the problems
    returned are those of the `against` sources that cannot be opened."""
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
            expected = expected_multiset_hash(m, sources)
        except (TokpackError, OSError) as e:
            err = e if isinstance(e, TokpackError) else TokpackError(f"cannot replay the plan: {e}", file=e.filename)
            d.problems.append(Problem(err.file or mfile, err.where, err.expected, err.found, err.message))
            continue
        except (KeyError, TypeError, ValueError):
            if any(p.file == mfile for p in d.problems):
                continue  # a manifest already reported broken cannot drive the replay
            raise  # from a manifest that passed every check: a bug in tokpack, not in the data
        if expected != m.get("sample_multiset_hash"):
            d.problems.append(Problem(mfile, "sample_multiset_hash", f"{expected} (replayed from the sources)",
                                      f"{m.get('sample_multiset_hash')} (recorded in {MANIFEST})",
                                      "epoch does not hold the samples its plan assigns (dropped/duplicated/altered)"))
    return problems


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


@dataclass
class ValidateResult:
    """What `validate --json` prints: `ok`, the gravest `status` ("ok", "corrupt", "incomplete",
    "unverified"), each problem and each directory checked."""

    ok: bool
    status: str
    quick: bool
    problems: list[dict]  # Problem.to_json()
    dirs: list[dict]  # path, kind, status, problems (a count), files, bytes
    files: int
    bytes: int
    seconds: float
    mb_per_s: float
    against: list[str]

    def to_json(self) -> dict:
        return asdict(self)


def validate_all(dirs: list[str], quick: bool = False, against: list[str] | None = None, workers: int = 1,
                 show_progress: bool | None = None) -> ValidateResult:
    """Validates each directory (source, run or epoch); with `against`, also those sources and
    every epoch's content through its plan."""
    t0 = time.perf_counter()
    against = list(against or [])
    known = {Path(x).resolve() for x in dirs}
    extra = [a for a in against if Path(a).resolve() not in known]
    report = validate_dirs(list(dirs) + extra, quick=quick, workers=workers, show_progress=show_progress)
    extra_problems = _against(report, against) if against else []
    seconds = time.perf_counter() - t0
    problems = report.problems + extra_problems
    return ValidateResult(
        ok=not problems,
        status=worst_status(problems),
        quick=quick,
        problems=[p.to_json() for p in problems],
        dirs=[{"path": str(d.path), "kind": d.kind, "status": d.status, "problems": len(d.problems),
               "files": d.files, "bytes": d.bytes} for d in report.dirs],
        files=report.files,
        bytes=report.bytes,
        seconds=round(seconds, 4),
        mb_per_s=round(report.bytes / 1e6 / max(seconds, 1e-9), 1),
        against=against,
    )


def report_lines(r: ValidateResult) -> list[str]:
    """The report for humans: each problem, each directory's status, then the verdict."""
    lines = [f"{p['severity'].upper()} " + str(TokpackError(p["message"], file=p["file"], where=p["where"],
                                                          expected=p["expected"], found=p["found"], hint=p["hint"]))
             for p in r.problems]
    for d in r.dirs:
        what = d["kind"] or "directory"
        n = d["problems"]
        lines.append(f"OK {what} {d['path']} ({d['files']} files, {_size(d['bytes'])}{', quick' if r.quick else ''})"
                     if d["status"] == "ok" else f"{d['status'].upper()} {what} {d['path']}: {n} problem{'s' * (n != 1)}")
    n = len(r.problems)
    lines.append(
        f"{r.status.upper()}: {len(r.dirs)} director{'ies' if len(r.dirs) != 1 else 'y'}, "
        f"{r.files} files, {_size(r.bytes)} in {r.seconds:.2f} s ({r.mb_per_s:.0f} MB/s), {n} problem{'s' * (n != 1)}"
        + (", quick (no checksums, no token scan)" if r.quick else "")
        + (f", against {len(r.against)} source(s)" if r.against else "")
    )
    return lines
