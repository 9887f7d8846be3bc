"""Progress in a log: when stderr is not a terminal (sbatch, nohup, CI), every long command writes
one plain line at a fixed interval (what it does, done/total, MB/s, ETA), set by --log-interval or
$TOKPACK_PROGRESS; 0 turns it off. Real `tokpack` processes with stderr to a pipe, slowed in
the child so that a small interval sees them mid-run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from io import StringIO
from pathlib import Path

import numpy as np
import pytest

from conftest import random_docs, wait_until, write_source
from tokpack.formats.io import progress_log as io  # the progress module: its bars and log lines
from tokpack.formats.errors import TokpackError

ROOT = Path(__file__).resolve().parents[1]
VOCAB, EOS = 1000, 0

# Each long command's per-item work made slow in the child only: a shard written, checked,
# staged, an input block packed.
SLOWED = """
import time
import tokpack.shuffle.steps as steps, tokpack.packer.validation as checks
import tokpack.packer.packing as packing, tokpack.packer.staging as staging
PAUSE = 0.15
write, check, blocks, copy = steps.EpochJob.write_shard, checks.check_shard, packing.read_blocks, staging._Stager.run_job
def slow_write(self, *a, **k):
    time.sleep(PAUSE); return write(self, *a, **k)
def slow_check(*a, **k):
    time.sleep(PAUSE); return check(*a, **k)
def slow_blocks(*a, **k):
    for b in blocks(*a, **k):  # a small file is one block
        time.sleep(3 * PAUSE); yield b
def slow_copy(self, job):
    time.sleep(PAUSE); return copy(self, job)
steps.EpochJob.write_shard, checks.check_shard, packing.read_blocks = slow_write, slow_check, slow_blocks
staging._Stager.run_job = slow_copy
from tokpack.packer.cli import main
main()
"""

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
NUMBER = r"[\d,]+(?:\.\d+)?"
ETA = r"ETA (?:\d+d )?\d+:\d\d:\d\d|ETA unknown"
LINE = re.compile(
    rf"^(?P<stamp>{STAMP}) tokpack: (?P<what>.+?): (?P<done>{NUMBER})/(?P<total>{NUMBER}) "
    rf"(?P<unit>MB|GB|TB|shards) \((?P<pct>{NUMBER})%\), (?P<rate>{NUMBER}) MB/s, (?P<eta>{ETA})$"
)


def tokpack(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SLOWED, *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def progress_lines(stderr: str) -> list[re.Match]:
    lines = [line for line in stderr.splitlines() if re.match(rf"^{STAMP} tokpack: ", line)]
    matched = [LINE.match(line) for line in lines]
    assert lines and all(matched), stderr  # every progress line has every field
    return matched


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    base = tmp_path_factory.mktemp("progress")
    docs = random_docs(np.random.default_rng(3), 400, VOCAB, EOS)
    src = write_source(base / "src", docs, docs_per_shard=50)
    corpus = base / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"input_ids": d[d != EOS].tolist()}) + "\n" for d in docs))
    (base / "more.jsonl").write_text(corpus.read_text())
    run = base / "run"
    r = tokpack(
        "shuffle",
        src,
        "-o",
        run,
        "--seq-len",
        31,
        "--seed",
        1,
        "--epochs",
        1,
        "--shard-samples",
        300,
        "--log-interval",
        0,
    )
    assert r.returncode == 0, r.stderr
    return base, src, corpus, run


@pytest.mark.parametrize("command", ["pack", "shuffle", "validate", "stage"])
def test_every_long_command_writes_a_progress_line_at_the_interval(data, tmp_path, command):
    base, src, corpus, run = data
    args = {
        "pack": ["pack", corpus, base / "more.jsonl", "-o", tmp_path / "out", "--eos-id", EOS, "--vocab-size", VOCAB],
        "shuffle": [
            "shuffle",
            src,
            "-o",
            tmp_path / "out",
            "--seq-len",
            31,
            "--seed",
            2,
            "--epochs",
            1,
            "--shard-samples",
            300,
        ],
        "validate": ["validate", run],
        "stage": ["stage", run, tmp_path / "out", "--workers", 1],
    }[command]
    started = time.monotonic()
    r = tokpack(*args, "--log-interval", 0.2)
    took = time.monotonic() - started
    assert r.returncode == 0, r.stderr
    lines = progress_lines(r.stderr)
    what = {"pack": "pack: 2 files", "shuffle": "epoch 0: write", "validate": "validate", "stage": "stage"}[command]
    assert what in {m["what"] for m in lines}, r.stderr
    # about one line per interval: at least two while it ran, never more than its time allows
    assert 2 <= len(lines) <= took / 0.2 + 1, (len(lines), took)
    done = [float(m["done"].replace(",", "")) for m in lines if m["what"] == what]
    assert done == sorted(done)  # done/total only grows
    assert all(float(m["total"].replace(",", "")) > 0 and 0 <= float(m["pct"]) <= 100 for m in lines)
    assert "\r" not in r.stderr  # a log keeps every line: no bar redrawn in place


def test_the_interval_comes_from_the_environment_and_zero_turns_it_off(data, tmp_path):
    base, src, corpus, run = data
    by_env = tokpack("validate", run, env={"TOKPACK_PROGRESS": "0.2"})
    assert by_env.returncode == 0 and progress_lines(by_env.stderr)
    for off in (["--log-interval", 0], []):  # 0, and the default 30 s for a job of a few seconds
        r = tokpack("validate", run, *off, env={"TOKPACK_PROGRESS": "0"} if off else None)
        assert r.returncode == 0 and " tokpack: validate:" not in r.stderr, r.stderr
    # the option wins over the environment
    r = tokpack("validate", run, "--log-interval", 0.2, env={"TOKPACK_PROGRESS": "0"})
    assert progress_lines(r.stderr)


def test_json_keeps_stderr_quiet_unless_lines_are_asked_for(data, tmp_path):
    base, src, corpus, run = data
    quiet = tokpack("validate", run, "--json")
    assert quiet.returncode == 0 and quiet.stderr == "" and json.loads(quiet.stdout)["ok"] is True
    asked = tokpack("validate", run, "--json", "--log-interval", 0.2)
    assert json.loads(asked.stdout)["ok"] is True and progress_lines(asked.stderr)


HINT = (
    "set TOKPACK_PROGRESS to off, bar, log or a number of seconds between two lines in a log (0: none), "
    "or unset it for a bar on a terminal and a line every 30 s in a log"
)


def test_a_bad_interval_is_one_line(data, tmp_path):
    base, src, corpus, run = data
    r = tokpack("validate", run, env={"TOKPACK_PROGRESS": "soon"})
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "tokpack: error: [$TOKPACK_PROGRESS]: not a number of seconds; expected a number of seconds >= 0, "
        f"<= 86,400, found 'soon'. HINT: {HINT}"
    ]
    # the former variable: read, with one warning line
    old = tokpack("validate", run, env={"TOKPACK_LOG_INTERVAL": "soon"})
    assert old.returncode == 1 and old.stderr.strip().splitlines() == [
        "tokpack: warning: $TOKPACK_LOG_INTERVAL is deprecated; use TOKPACK_PROGRESS=SECONDS (or off, bar, log)",
        "tokpack: error: [$TOKPACK_LOG_INTERVAL]: not a number of seconds; expected a number of seconds >= 0, "
        f"<= 86,400, found 'soon'. HINT: {HINT}",
    ]
    assert tokpack("validate", run, "--log-interval", "-1").returncode == 2


def test_a_line_says_what_done_total_rate_and_eta(monkeypatch):
    """A fake clock: 1 GB of 4 GB in 10 s is 100 MB/s and 30 s left; a bar counted in shards
    gives MB/s from a shard's bytes; with nothing done yet the ETA is unknown."""
    now = [100.0]
    bar = io._LogBar(4 * 10**9, "stage", "B", 3600, clock=lambda: now[0])
    try:
        assert bar.line().endswith(" tokpack: stage: 0.0/4,000.0 MB (0.0%), 0.0 MB/s, ETA unknown")
        bar.update(10**9)
        now[0] += 10
        assert LINE.match(bar.line())
        assert bar.line().endswith(" tokpack: stage: 1,000.0/4,000.0 MB (25.0%), 100.0 MB/s, ETA 0:00:30")
    finally:
        bar.close()
    shards = io._LogBar(16, "epoch 3: write", "shard", 3600, unit_bytes=50 * 10**6, clock=lambda: now[0])
    try:
        shards.update(4)
        now[0] += 2
        assert shards.line().endswith(" tokpack: epoch 3: write: 4/16 shards (25.0%), 100.0 MB/s, ETA 0:00:06")
    finally:
        shards.close()
    big = io._LogBar(3 * 10**13, "validate", "B", 3600, clock=lambda: now[0])
    big.update(10**13)
    now[0] += 86400
    assert big.line().endswith(": 10.0/30.0 TB (33.3%), 115.7 MB/s, ETA 2d 0:00:00")
    big.close()


def _lines_of(what: str) -> int:
    """The progress lines written so far (to the StringIO the test put in stderr) naming `what`."""
    return sum(f" tokpack: {what}: " in line for line in sys.stderr.getvalue().splitlines())


def _writer_gone() -> bool:
    return not any(t.name == "tokpack-progress-lines" for t in threading.enumerate())


def test_one_line_per_interval_for_the_outermost_step_still_running(monkeypatch):
    """pack's bar over all its files, not the file's; a finished pass's bar that stays open gives
    way to the next pass's. Each step waits for the lines it relies on, not a fixed time: a loaded
    machine may not run the writer thread for a while."""
    # a writer left by an earlier test's bar (dropped unclosed: it ends at its next line) has its own interval
    wait_until(lambda: io._LOG_LINES.stop is None and _writer_gone(), "an earlier test's writer to end")
    monkeypatch.setattr(sys, "stderr", StringIO())  # read while the writer writes (capsys's read could drop a line)
    started = time.monotonic()
    outer = io._LogBar(100, "pack: 2 file(s)", "B", 0.05)
    inner = io._LogBar(50, "pack a.jsonl", "B", 0.05)
    wait_until(lambda: _lines_of("pack: 2 file(s)") >= 3, "3 lines of the outer bar")
    outer.update(100)  # done: the next line is the inner bar's
    wait_until(lambda: _lines_of("pack a.jsonl") >= 3, "3 lines of the inner bar")
    inner.close()
    outer.close()
    wait_until(_writer_gone, "the writer thread's end once every bar is closed")
    took = time.monotonic() - started
    lines = sys.stderr.getvalue().splitlines()
    whats = [LINE.match(line)["what"] for line in lines]
    cut = whats.index("pack a.jsonl")
    assert set(whats[:cut]) == {"pack: 2 file(s)"} and set(whats[cut:]) == {"pack a.jsonl"}
    # one writer, not one per bar: a line every 0.05 s at most, however long the machine took
    assert 6 <= len(lines) <= took / 0.05 + 1, (lines, took)
    time.sleep(0.2)
    assert sys.stderr.getvalue().splitlines() == lines  # no line once every bar is closed


def test_a_bar_dropped_without_closing_writes_no_more_lines(monkeypatch):
    """As a tqdm bar closes when collected: a step that opened a bar and was dropped (a test that
    ran a step alone, a failed pass) leaves no writer printing its last state forever."""
    import gc

    monkeypatch.setattr(sys, "stderr", StringIO())
    bar = io._LogBar(100, "epoch 0: scatter", "B", 0.05)
    wait_until(lambda: _lines_of("epoch 0: scatter"), "a line of the open bar")
    del bar
    gc.collect()
    # the writer sees the bar gone at its next line (it may be writing one now) and ends
    wait_until(lambda: io._LOG_LINES.stop is None and _writer_gone(), "the writer's end once the bar was dropped")
    written = sys.stderr.getvalue()
    time.sleep(0.3)
    assert sys.stderr.getvalue() == written and io._LOG_LINES.stop is None


def test_log_interval_reads_the_environment(monkeypatch):
    monkeypatch.delenv(io.PROGRESS_ENV, raising=False)
    assert io.log_interval() == 30
    with io.logging_every(0.5):
        assert io.log_interval() == 0.5 and os.environ[io.PROGRESS_ENV] == "0.5"  # worker processes see it
        with io.logging_every(None):
            assert io.log_interval() == 0.5
    assert io.PROGRESS_ENV not in os.environ
    for bad in ("-1", "nan", "inf", "x"):
        monkeypatch.setenv(io.PROGRESS_ENV, bad)
        with pytest.raises(TokpackError, match="not a number of seconds|out of range"):
            io.log_interval()
