"""Fault soak: kill tokpack at random moments and count what survived (issue 17).

    python bench/soak.py [--kills 500] [--seed 0] [--quick] [--work DIR]

On a small corpus, each kill picks a command (pack; shuffle in memory and out of core, with
--workers 1 and 2; stage; validate), a signal (SIGKILL, SIGTERM, SIGINT) and a moment drawn
uniformly over that command's measured uninterrupted duration, and sends it; draws go on until
--kills signals have reached a running command. Then:
- orphans: a process of the killed command (found by an environment marker every descendant
  inherits) still running 5 s after the kill;
- false OK: `tokpack validate` exits 0 on the killed command's output while that output is not
  byte-identical to an uninterrupted run's (half-done output accepted as complete);
- the same command is rerun: it must finish (exit 0), and its output must be byte-identical to the
  uninterrupted run's (for validate: the same verdict and report).
Besides kills, it starts two identical commands on one output at a random offset (both may
finish, or the second may be refused in one line; the output must end complete and identical),
and runs `tokpack read` while a shuffle writes (a read that succeeds must serve the right
samples; one that fails must fail in one line).

The table's first rows (runs, kills, kills per signal and per command) describe the soak; every
other count must be zero, or the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

sys.path[0] = str(
    Path(__file__).resolve().parents[1]
)  # the repo, not bench/, where shuffle.py would hide the shuffle package
from bench.common import REPO, machine_line, make_datatrove_corpus, print_table  # noqa: E402
from tokpack.packer.lifetime import marked  # noqa: E402

CORPUS_BYTES = 1 << 20  # small on purpose: many short runs, each killed somewhere in its life
QUICK_KILLS = 3
# --quick draws from the commands that take a few seconds here; the out-of-core --workers 2
# shuffle (four datatrove passes, each starting a worker pool) takes about 20 s.
QUICK_CASES = ("pack", "shuffle in memory w2", "shuffle out of core w1", "stage", "validate")
GONE_WITHIN = 5.0  # seconds a killed command's processes may take to end
SIGNALS = [signal.SIGKILL, signal.SIGTERM, signal.SIGINT]
MARK = "TOKPACK_SOAK_MARK"

# Two commands on one output: every writing command holds a lock on its output, so a second
# command started while the first runs must be refused with exit 1 and a line naming the lock.
REFUSAL_MUST_NAME: str | None = "lock"
REFUSE_WHEN_OVERLAPPING = True

# Tallies that must stay zero (the rest describe the soak).
MUST_BE_ZERO = [
    "orphans",
    "false OKs",
    "reruns failed",
    "reruns different",
    "concurrent unsafe",
    "reader false OKs",
    "reader crashes",
]


@dataclass
class Case:
    name: str
    argv: list[str]  # "{out}" stands for the output directory
    writes: bool = True
    seconds: float = 0.0  # uninterrupted duration, measured
    reference: object = None  # the uninterrupted output (files) or report


@dataclass
class Tally:
    counts: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    def add(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def problem(self, key: str, what: str) -> None:
        self.add(key)
        self.notes.append(f"{key}: {what}")
        print(f"soak: {key}: {what}", file=sys.stderr, flush=True)


def tree(root: Path) -> dict[str, bytes]:
    return (
        {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
        if root.exists()
        else {}
    )


class Runner:
    def __init__(self, work: Path):
        self.work = work
        self.runs = 0
        self.leftovers = []  # commands that ended normally and still left processes

    def start(self, argv: list[str], out: Path) -> tuple[subprocess.Popen, str, Path]:
        token = uuid.uuid4().hex
        env = {**os.environ, MARK: token, "PYTHONPATH": str(REPO)}
        log = self.work / "logs" / f"{token}.log"
        log.parent.mkdir(exist_ok=True)
        args = [a.replace("{out}", str(out)) for a in argv]
        with open(log, "wb") as f:  # a file, not a pipe: a leftover process would hold a pipe open
            # SIGINT back to default in the child: the soak run as a background job (nohup) inherits it
            # ignored, and a SIGINT sent before tokpack takes it back would then be lost.
            proc = subprocess.Popen(
                [sys.executable, "-m", "tokpack.packer.cli", *args],
                env=env,
                stdout=f,
                stderr=f,
                cwd=self.work,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )
        self.runs += 1
        return proc, token, log

    def run(self, argv: list[str], out: Path, timeout: float = 900) -> tuple[int, str]:
        proc, token, log = self.start(argv, out)
        rc = proc.wait(timeout=timeout)
        if self.reap(token):
            self.leftovers.append(" ".join(argv[:1]))
        return rc, log.read_text(errors="replace")

    def reap(self, token: str) -> list[int]:
        """Waits up to GONE_WITHIN for the command's processes to end; kills and returns those left."""
        deadline = time.monotonic() + GONE_WITHIN
        left = marked(MARK, token)
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = marked(MARK, token)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left


def cases_for(packed: Path, corpus: Path, run: Path) -> list[Case]:
    shuffle = [
        "shuffle",
        str(packed),
        "-o",
        "{out}",
        "--seq-len",
        "511",
        "--seed",
        "7",
        "--epochs",
        "2",
        "--shard-samples",
        "250",
    ]
    ooc = ["--memory", "384KiB"]  # under half the windows: the out-of-core path
    return [
        Case("pack", ["pack", str(corpus), "-o", "{out}", "--eos-id", "0", "--shard-tokens", "300000", "--json"]),
        Case("shuffle in memory w1", [*shuffle, "--workers", "1", "--json"]),
        Case("shuffle in memory w2", [*shuffle, "--workers", "2", "--json"]),
        Case("shuffle out of core w1", [*shuffle, *ooc, "--workers", "1", "--json"]),
        Case("shuffle out of core w2", [*shuffle, *ooc, "--workers", "2", "--json"]),
        Case("stage", ["stage", str(run), "{out}", "--workers", "2", "--json"]),
        Case("validate", ["validate", str(run), "--json"], writes=False),
    ]


def verdict(rc: int, text: str) -> object:
    """What validate said, minus timings: its exit status, status, problems and what it checked."""
    try:
        report = json.loads(text.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return rc, None
    return rc, {k: report.get(k) for k in ("ok", "status", "problems", "dirs", "files", "bytes")}


def one_line_refusal(rc: int, text: str, must_name: str | None = None) -> bool:
    lines = [line for line in text.splitlines() if line.startswith("tokpack: error:")]
    named = must_name is None or any(must_name in line for line in lines)
    return rc == 1 and "Traceback" not in text and len(lines) == 1 and named


def wrote_nothing(text: str) -> bool:
    """Whether a command's --json summary says it found its output complete and wrote nothing."""
    try:
        report = json.loads(text.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return False
    return (
        report.get("status") == "already complete"
        or report.get("written") == []
        or (report.get("kind") is not None and report.get("copied_files") == 0)
    )


def kill_once(r: Runner, t: Tally, case: Case, sig: int, at: float, out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    started = time.monotonic()
    proc, token, _ = r.start(case.argv, out)
    deadline = started + at
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(min(0.01, max(0.0, deadline - time.monotonic())))
    if proc.returncode is not None and proc.returncode == 0:
        # The machine is faster now than when the duration was measured: later moments are drawn
        # over the shorter one, so that fewer commands end before their signal.
        case.seconds = min(case.seconds, time.monotonic() - started)
    if proc.poll() is None:
        proc.send_signal(sig)
        t.add("kills")
        t.add(f"kills {signal.Signals(sig).name}")
        t.add(f"kills: {case.name}")
    else:
        t.add("finished before the signal")
    proc.wait(timeout=900)
    left = r.reap(token)
    if left:
        t.problem(
            "orphans", f"{len(left)} process(es) of {case.name} left after {signal.Signals(sig).name} at {at:.2f} s"
        )
    if case.writes:
        rc, text = r.run(["validate", str(out), "--json"], out)
        complete = tree(out) == case.reference
        if rc == 0 and not complete:
            t.problem(
                "false OKs", f"validate accepted {case.name}'s output after {signal.Signals(sig).name} at {at:.2f} s"
            )
    rc, text = r.run(case.argv, out)
    if rc != 0:
        t.problem(
            "reruns failed",
            f"{case.name} after {signal.Signals(sig).name} at {at:.2f} s: exit {rc}: {text.strip().splitlines()[-1:]}",
        )
        return
    after = tree(out) if case.writes else verdict(rc, text)
    if after == case.reference:
        t.add("reruns identical")
    else:
        which = (
            sorted(k for k in set(after) | set(case.reference) if after.get(k) != case.reference.get(k))
            if case.writes
            else [after]
        )
        t.problem("reruns different", f"{case.name} after {signal.Signals(sig).name} at {at:.2f} s: {which[:5]}")


def concurrent_once(r: Runner, t: Tally, case: Case, offset: float, out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    a, ta, la = r.start(case.argv, out)
    time.sleep(offset)
    overlapping = a.poll() is None
    b, tb, lb = r.start(case.argv, out)
    results = [(p.wait(timeout=900), log.read_text(errors="replace")) for p, log in ((a, la), (b, lb))]
    for token in (ta, tb):
        if r.reap(token):
            t.problem("orphans", f"two {case.name} on one output left processes")
    t.add("concurrent pairs")
    t.add("concurrent pairs overlapping" if overlapping else "concurrent pairs one after the other")
    (rc_a, text_a), (rc_b, text_b) = results
    wrong = []
    for who, (rc, text) in (("first", results[0]), ("second", results[1])):
        if rc != 0 and not one_line_refusal(rc, text, REFUSAL_MUST_NAME):
            wrong.append(f"{who} exit {rc}: {text.strip().splitlines()[-1:]}")
    # Whichever command gets the lock second is refused, or (if the first has released it) finds
    # the output complete and writes nothing; so when both succeed, one of them wrote nothing.
    # Process lifetimes cannot tell this: a worker pool outlives the lock by a fraction of a second.
    if REFUSE_WHEN_OVERLAPPING and rc_a == 0 and rc_b == 0 and not (wrote_nothing(text_a) or wrote_nothing(text_b)):
        wrong.append("both commands wrote the output (neither was refused, neither found it complete)")
    if rc_b != 0:
        t.add("concurrent second refused")
    if rc_a == 0 or rc_b == 0:
        if tree(out) != case.reference:
            wrong.append("output differs from one run's")
        rc, _ = r.run(["validate", str(out), "--json"], out)
        if rc != 0:
            wrong.append("output does not validate")
    else:
        wrong.append("neither command finished")
    if wrong:
        t.problem("concurrent unsafe", f"{case.name} at offset {offset:.2f} s: {'; '.join(wrong)}")


def readers_once(r: Runner, t: Tally, case: Case, reference_read: tuple, out: Path, rng: random.Random) -> None:
    shutil.rmtree(out, ignore_errors=True)
    writer, token, _ = r.start(case.argv, out)
    time.sleep(rng.uniform(0, case.seconds / 2))
    while writer.poll() is None:
        rc, text = r.run(["read", str(out), "--count", "8", "--json"], out)
        t.add("reads during writes")
        if rc == 0:
            if text != reference_read[1]:
                t.problem("reader false OKs", f"read served other samples while {case.name} wrote")
        elif not one_line_refusal(rc, text) or rc != 1:
            t.problem("reader crashes", f"read exit {rc} while {case.name} wrote: {text.strip().splitlines()[-1:]}")
    writer.wait()
    if r.reap(token):
        t.problem("orphans", f"{case.name} (with readers) left processes")


def main(
    _size=None, quick: bool = False, *, kills: int | None = None, seed: int = 0, work: Path | None = None
) -> list[dict]:
    """`_size` is bench/run_all.py's corpus size, unused: the soak's corpus is small by design."""
    kills = kills if kills is not None else QUICK_KILLS if quick else 500
    rng = random.Random(seed)
    own = work is None
    work = Path(work or tempfile.mkdtemp(prefix="tokpack-soak-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    r, t = Runner(work), Tally()
    try:
        corpus = make_datatrove_corpus(work / "corpus", CORPUS_BYTES, files=4, mean_doc=600, seed=seed)
        packed, run = work / "packed", work / "run"
        cases = cases_for(packed, corpus, run)
        by_name = {c.name: c for c in cases}
        if quick:
            cases = [c for c in cases if c.name in QUICK_CASES]
        # Drawn up front (twice as many as asked, for the commands that end before their signal),
        # so that the same seed draws the same kills whatever the machine's speed.
        plan = [(rng.choice(cases), rng.choice(SIGNALS), rng.random()) for _ in range(2 * kills)]
        writers = [c for c in cases if c.writes]
        pairs = [(rng.choice(writers), rng.random()) for _ in range(max(1, kills // 10))]
        reads = [rng.choice([c for c in writers if c.name.startswith("shuffle")]) for _ in range(max(1, kills // 25))]
        # Uninterrupted runs: the reference outputs and durations, of the commands drawn (all of
        # them in a full soak). pack first (shuffle reads its output), then a shuffle whose output
        # stage and validate read.
        drawn = {c.name for c, _, _ in plan} | {c.name for c, _ in pairs} | {c.name for c in reads}
        drawn |= {"pack", "shuffle in memory w1"}
        for case in by_name.values():
            if case.name not in drawn:
                continue
            out = (
                packed
                if case.name == "pack"
                else run
                if case.name == "shuffle in memory w1"
                else work / "ref" / case.name
            )
            shutil.rmtree(out, ignore_errors=True)
            start = time.perf_counter()
            rc, text = r.run(case.argv, out)
            case.seconds = time.perf_counter() - start
            if rc != 0:
                raise RuntimeError(f"uninterrupted {case.name} failed (exit {rc}): {text[-500:]}")
            case.reference = tree(out) if case.writes else verdict(rc, text)
            if case.name.startswith("shuffle") and case.reference != by_name["shuffle in memory w1"].reference:
                raise RuntimeError(f"uninterrupted {case.name} differs from shuffle in memory w1")
        reference_read = r.run(["read", str(run), "--count", "8", "--json"], run)
        calibrated = time.perf_counter()

        kill_seconds = []
        for i, (case, sig, u) in enumerate(plan):
            if t.counts.get("kills", 0) >= kills:
                break
            at = u * case.seconds
            k0 = time.perf_counter()
            kill_once(r, t, case, sig, at, work / "kill")
            kill_seconds.append(time.perf_counter() - k0)
            print(
                f"soak: draw {i + 1}, {t.counts.get('kills', 0)}/{kills} kills: {case.name}, {signal.Signals(sig).name} at {at:.2f} s "
                f"({kill_seconds[-1]:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
        for case, u in pairs:
            concurrent_once(r, t, case, u * case.seconds, work / "pair")
        for case in reads:
            readers_once(r, t, case, reference_read, work / "readers", rng)
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)

    for command in r.leftovers:
        t.problem("orphans", f"tokpack {command} ended normally and left processes")
    total = time.perf_counter() - t0
    per_kill = sum(kill_seconds) / len(kill_seconds) if kill_seconds else 0.0
    c = t.counts
    rows = [
        {"case": "runs (tokpack commands)", "count": r.runs, "note": ""},
        {
            "case": "kills",
            "count": c.get("kills", 0),
            "note": f"{c.get('finished before the signal', 0)} more finished before their signal",
        },
    ]
    rows += [{"case": f"kills {s.name}", "count": c.get(f"kills {s.name}", 0), "note": ""} for s in SIGNALS]
    rows += [
        {
            "case": f"kills: {case.name}",
            "count": c.get(f"kills: {case.name}", 0),
            "note": f"uninterrupted {case.seconds:.1f} s" if case.seconds else "not drawn",
        }
        for case in by_name.values()
    ]
    rows.append(
        {"case": "reruns identical", "count": c.get("reruns identical", 0), "note": f"of {len(kill_seconds)} reruns"}
    )
    rows.append(
        {
            "case": "concurrent pairs",
            "count": c.get("concurrent pairs", 0),
            "note": f"{c.get('concurrent pairs overlapping', 0)} overlapping, "
            f"{c.get('concurrent second refused', 0)} second refused",
        }
    )
    rows.append({"case": "reads during writes", "count": c.get("reads during writes", 0), "note": ""})
    rows += [{"case": key, "count": c.get(key, 0), "note": "must be 0"} for key in MUST_BE_ZERO]
    for row in rows:
        row["wall s"] = None
    print(
        f"{machine_line()}; seed {seed}; {kills} kills; {per_kill:.1f} s per kill; calibration "
        f"{calibrated - t0:.0f} s; total {total:.0f} s"
    )
    print_table(
        f"tokpack fault soak (python bench/soak.py --kills {kills} --seed {seed})", rows, ["case", "count", "note"]
    )
    bad = {key: c.get(key, 0) for key in MUST_BE_ZERO if c.get(key, 0)}
    if bad:
        raise RuntimeError(f"soak found {bad}: " + " | ".join(t.notes[:5]))
    rows.append({"case": "seconds per kill", "wall s": per_kill, "note": f"total {total:.0f} s"})
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=None, help=f"kills to make [default: 500; {QUICK_KILLS} with --quick]")
    ap.add_argument("--seed", type=int, default=0, help="seed of the commands, signals and moments chosen")
    ap.add_argument("--quick", action="store_true", help="a few kills: the CI smoke run")
    ap.add_argument("--work", default=None, help="scratch folder [default: a new temp dir, removed at the end]")
    a = ap.parse_args()
    try:
        main(quick=a.quick, kills=a.kills, seed=a.seed, work=Path(a.work) if a.work else None)
    except RuntimeError as e:
        print(f"soak: {e}", file=sys.stderr)
        sys.exit(1)
