"""`tokpack validate`: the manifest and directory checks of packed sources, runs and epochs
(one directory's: tokpack.packer.dir_checks; a run's: tokpack.packer.run_checks; node slices:
tokpack.packer.slice_validation), the entry point that runs them with
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

import errno
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from tokpack.formats.errors import TokpackError
from tokpack.formats.io.reads import ThreadPool
from tokpack.formats.io.paths import as_path, local_path
from tokpack.formats.io.progress_log import progress
from tokpack.formats.constants import EPOCH, MANIFEST, MASK64, RUN, SLICE
from tokpack.formats.hashes import hash_hex64
from tokpack.formats.reading import manifest_kind
from tokpack.formats.shard_scan import Findings, Problem, check_shard, problem_line, worst_status
from tokpack.formats.shards import PackedSource
from tokpack.packer.shared import Result

from .dir_checks import Dir, DirReport, ValidationReport, plan_dir
from .run_checks import check_run
from .run_proof import on_nodes, prove_on_nodes
from .slice_validation import slice_against_run

# OSErrors of this machine, not of the data: the command fails in one line naming the cause (no
# open files left, no memory), never a CORRUPT verdict on a sound dataset
NOT_THE_DATAS = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


def _number_samples(plan: list[Dir]) -> None:
    """Each epoch shard's job its first sample's output position, to sum its order hash."""
    for d in plan:
        if d.report.kind == EPOCH and d.jobs:  # jobs exist only for a manifest whose fields are sound
            per = d.report.manifest["shard_samples"]
            if per * len(d.jobs.shards) < 2**63:  # else no position fits: an edited shard_samples has its own line
                d.jobs.number_samples(per)


def validate_dirs(
    paths: list[str | Path],
    quick: bool = False,
    workers: int = 1,
    show_progress: bool | None = None,
    order: bool = False,
) -> ValidationReport:
    """Validates sources, runs (with their epochs) and epoch directories. Never raises for bad data.
    `order` (full mode): also each epoch shard's order hash, for `--against` to compare."""
    plan: list[Dir] = []  # every manifest read and its manifest-level checks run: the shard jobs to run
    for p in paths:
        path = as_path(p)
        d = plan_dir(path, quick)
        plan.append(d)
        if d.report.kind == RUN:
            check_run(path, d.report.manifest, d.report, quick, plan)
    if order and not quick:
        _number_samples(plan)
    # Each job made when its turn comes, twice (its size first), never all held: a manifest of
    # 1.5M entries held a ShardJob and an entry dict each (issue 42, item 7).
    jobs = lambda: ((d, j) for d in plan for j in d.jobs)  # noqa: E731
    count = sum(len(d.jobs) for d in plan)
    total = sum(j.size() for _, j in jobs()) if not quick else count
    recomputed: dict[int, int | None] = {}  # an epoch's multiset so far: None once a shard has none

    def merge(d, job, res) -> None:  # each shard's findings as it ends, in job order: the report is deterministic
        d.report.problems += res.problems
        d.report.files += res.files
        d.report.bytes += res.bytes
        so_far = recomputed.get(id(d), 0)
        recomputed[id(d)] = None if so_far is None or res.multiset is None else so_far + res.multiset
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
                if e.errno in NOT_THE_DATAS:
                    raise
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
        if workers > 1 and count > 1:
            with ThreadPool(workers) as pool:  # Ctrl-C, SIGTERM: the shards not started are dropped
                pending: deque = deque()  # a few calls ahead of the merge, not one future per shard
                for item in jobs():
                    pending.append(pool.submit(run, item))
                    if len(pending) >= 4 * workers:
                        merge(*pending.popleft().result())
                while pending:
                    merge(*pending.popleft().result())
        else:
            for item in jobs():
                merge(*run(item))
    for d in plan:
        rep, m = d.report, d.report.manifest
        # every shard scanned: one refused before its scan (a link out of the folder) has its own
        # line, and the sum without it would blame the samples of every other shard
        whole = len(d.jobs) == len(getattr(d.jobs, "shards", d.jobs))
        if rep.kind == EPOCH and d.jobs and not quick and not d.partial and whole:
            multiset = recomputed.get(id(d), 0)
            if multiset is not None:
                rep.multiset = multiset & MASK64
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


def _place(path) -> Path | str:
    """Where a source is, to compare a recorded path with one given: a local folder resolved, a
    URL (an object store's, which pathlib cannot hold) as written."""
    local = local_path(path)
    return Path(local).resolve() if local is not None else str(path).rstrip("/")


def _missing_sources(m: dict, given: dict[str, PackedSource], mfile: str) -> Problem | None:
    """UNVERIFIED, naming each source of the epoch that `--against` did not give: without all of
    them the plan cannot be replayed. Nothing is known to be wrong with the epoch."""
    by_path = {_place(s.path): s for s in given.values()}
    missing, paths = [], []
    for e in m["sources"]:
        e = e if isinstance(e, dict) else {}
        fp = e.get("fingerprint")
        if (
            isinstance(fp, str) and fp in given or e.get("samples") == 0
        ):  # a source of a scheduled run that this epoch does not use
            continue
        text = f"{e.get('name', '?')} (fingerprint {fp})"
        same_place = by_path.get(_place(e["path"])) if e.get("path") else None
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


def _against(report: ValidationReport, against: list[str], replay, source_rows=None) -> list[Problem]:
    """For every readable epoch: its sources are among `against` (by fingerprint), the multiset
    hash of the windows the plan assigns it equals the epoch's, and so does the order hash of
    every shard the scan read (`replay(manifest, sources)` gives the planned multiset hash and
    per-shard order hashes). A problem with an epoch goes into that epoch's report, so its
    status line says it too; the problems returned are those of the `against` sources that
    cannot be opened. An epoch of a --to-nodes RUN is proven from its row hashes
    (tokpack.packer.run_proof, `source_rows` rebuilding its rows where they differ)."""
    sources, problems = [], []
    for a in against:
        try:
            sources.append(PackedSource.open(a))
        except TokpackError as e:
            problems.append(Problem.from_error(e))
    given = {s.fingerprint: s for s in sources}
    for d in report.dirs:
        m = d.manifest
        if d.kind != EPOCH or m is None or not isinstance(m.get("sources"), list):
            continue
        mfile = str(d.path / MANIFEST)
        missing = _missing_sources(m, given, mfile)
        if missing is not None:
            d.problems.append(missing)
            continue
        nodes = on_nodes(d)  # shuffle --to-nodes: RUN holds row hashes, no samples to scan
        try:
            expected, orders = replay(m, sources)
        except (TokpackError, OSError) as e:
            if isinstance(e, OSError) and e.errno in NOT_THE_DATAS:
                raise
            if nodes and prove_on_nodes(d, None, source_rows):
                continue  # the position the replay's refusal comes from, named in one line
            err = e if isinstance(e, TokpackError) else TokpackError(f"cannot replay the plan: {e}", file=e.filename)
            d.add(err.file or mfile, err.where, err.expected, err.found, err.message)
            continue
        # an edited field: a count too large, a row of 0 tokens, a range outside the source
        except (LookupError, TypeError, ValueError, ArithmeticError):
            if any(p.file == mfile for p in d.problems):
                continue  # a manifest already reported broken cannot drive the replay
            raise  # from a manifest that passed every check: a bug in tokpack, not in the data
        if nodes and prove_on_nodes(d, orders, source_rows):
            continue
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
    scanned = lambda s: isinstance(s, dict) and isinstance(s.get("path"), str) and s["path"] in found  # noqa: E731
    wrong = [i for i, s in enumerate(shards) if scanned(s) and found[s["path"]] != planned[i]]
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
    kind = manifest_kind(given)
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
        f"a {manifest_kind(given)}",
        "cannot replay epochs from it: --against takes the packed sources of a run",
        hint="give --against each packed source the run was shuffled from (its tokpack.json `sources`)",
        unverified=True,
    )


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


@dataclass
class ValidateResult(Result):
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
    SourceRows, given by the caller too; see slice_against_run), and so is, where its row hashes
    differ from the plan's, an epoch of such a RUN (tokpack.packer.run_proof)."""
    t0 = time.perf_counter()
    against = list(against or [])
    known = {as_path(x).resolve() for x in dirs}
    # A slice's --against is its run: compared by row hashes, not validated whole.
    slice_runs = [a for a in against if manifest_kind(a) == RUN] if any(manifest_kind(x) == SLICE for x in dirs) else []
    against = [a for a in against if a not in slice_runs]
    unmatched = []
    if against and all(manifest_kind(x) == SLICE for x in dirs):  # sources with nothing to check them against
        unmatched, against = against, []
    not_sources = [_not_a_source(a) for a in against if manifest_kind(a) not in (None, "source")]
    against = [a for a in against if manifest_kind(a) in (None, "source")]
    extra = [a for a in against if as_path(a).resolve() not in known]
    report = validate_dirs(
        list(dirs) + extra, quick=quick, workers=workers, show_progress=show_progress, order=bool(against)
    )
    extra_problems = _against(report, against, replay, source_rows) if against else []
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
                **({"proven": d.proven} if d.proven else {}),
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
            f"{', quick' if r.quick else ''}{vocab}{'; ' + d['proven'] if d.get('proven') else ''})"
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
    runs = sum(manifest_kind(a) == RUN for a in paths)
    return " and ".join(
        f"{n} {name}{'s' * (n != 1)}" for n, name in ((len(paths) - runs, "source"), (runs, "run")) if n
    )
