"""bench/train_loop.py (issue 34, item 4): its --quick run gives every loader and start a row
with all of its numbers. Never how fast: the figures are the benchmark's, on a shared machine."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "train_loop.py"
NUMBERS = ["first batch s", "wait ms", "median ms", "wait %", "tokens/s", "peak RSS MiB"]  # bench/train_loop.NUMBERS
PEERS = {
    "datatrove": "datatrove DatatroveFolderDataset",
    "streaming": "MosaicML streaming StreamingDataset",
    "litdata": "litdata StreamingDataset",
}


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900
    )


def test_quick_run_gives_every_loader_and_start_its_numbers(tmp_path):
    out = tmp_path / "rows.json"
    done = run(tmp_path, "--quick", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    measured = [r for r in rows if not r.get("_absent") and "_table" not in r]
    for r in measured:
        for column in NUMBERS:
            value = r.get(column)
            assert isinstance(value, (int, float)) and math.isfinite(value) and value >= 0, (r["loader"], column, r)
        assert 0 <= r["wait %"] <= 100, r  # a share of the step, whatever the machine's speed
        # the start was checked against the data (the floor has none)
        assert r["loader"].startswith("floor") or "first row = data row" in r["note"], r
    tokpack = {(r["workers"], r["start step"]) for r in measured if r["loader"].startswith("tokpack")}
    assert tokpack == {(w, s) for w in (0, 2) for s in ("0", "3,200,000")}
    # the hand-off's floor, beside them in the same run: one tensor of the batch's bytes a step
    assert sorted(r["workers"] for r in measured if r["loader"].startswith("floor")) == [0, 2]
    for module, name in PEERS.items():
        mine = [r for r in rows if r.get("loader", "").startswith(name)]
        if importlib.util.find_spec(module) is None:  # not installed: one row saying so, no figures
            assert [r.get("_absent") for r in mine] == [True] and "not installed" in mine[0]["note"], mine
        else:
            assert sorted(r["start step"] for r in mine) == ["0", "3,200,000"] and not any(
                r.get("_absent") for r in mine
            ), mine
    partition = [r for r in rows if r.get("_table") == "partition"]  # MosaicML's start cost by epoch size
    assert len(partition) == (3 if importlib.util.find_spec("streaming") else 0), partition
    for r in partition:
        assert all(isinstance(r.get(c), float) and r[c] >= 0 for c in ("partition s", "partition MiB")), r
    assert "| loader" in done.stdout and "first batch s" in done.stdout  # the printed table


def test_an_epoch_smaller_than_two_global_batches_is_refused_in_one_line(tmp_path):
    """The loop needs rows for a first batch and a timed step of the 576-row global batch."""
    done = run(tmp_path, "--size", "1MiB", "--loaders", "tokpack")
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0 and "fewer than 2 global batches of 576" in done.stderr, done.stderr


def test_an_unknown_loader_is_refused(tmp_path):
    done = run(tmp_path, "--quick", "--loaders", "tokpack,nosuch")
    assert done.returncode == 2 and "unknown loaders ['nosuch']" in done.stderr.strip().splitlines()[-1], done.stderr
