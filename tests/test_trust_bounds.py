"""The trust boundary, bounds and ownership (issue 24, items 3-5): a count a user types is
checked by arithmetic before anything its size is allocated; a command deletes only files it
wrote; the exit status says whose fault a failure is.

Every command here runs as a subprocess under an address-space limit and a timeout, as a typo
would run on a shared node: a bound checked after allocating shows as a MemoryError (an internal
error, exit 70) or a timeout, not as the one line and exit 1 asserted here."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import random_docs, shuffle_run, write_source

REPO = Path(__file__).resolve().parents[1]
MEMORY_LIMIT = 3 << 30  # address space of each command: far above what any of these needs when bounded
TIMEOUT = 120  # a hang guard only; nothing is asserted about time


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def tokpack(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packer.cli", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=TIMEOUT, preexec_fn=_limit_memory, env={**os.environ, **(env or {})})


def refused(r: subprocess.CompletedProcess, *says: str) -> str:
    """The failure is one line with exit 1 (data or arguments), naming what `says` lists."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("tokpack: error:"), r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr
    for text in says:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    """(a packed source of 496 windows of 64 tokens, a two-epoch run shuffled from it)."""
    root = tmp_path_factory.mktemp("bounds")
    docs = random_docs(np.random.default_rng(3), 200, 1000, 0)
    src = write_source(root / "src", docs, docs_per_shard=40)
    shuffle_run([str(src)], str(root / "run"), seq_len=63, seed=0, epochs=[0, 1], samples=None, tokens=None,
                shard_samples=12, memory=8 << 20, jitter=False, log=None)
    return src, root / "run"


# ------------------------------------------------------------------ item 3: bounded by arithmetic


@pytest.mark.parametrize("option, value, says", [
    ("--epochs", "0-100000000000", ["100,000,000,000", "99,999"]),  # a range is never expanded before its check
    ("--epochs", "3-5", ["epochs not in this run"]),
    ("--ranks", "0-99999999/100000000", ["world size", "100,000,000", "1,048,576"]),
    ("--ranks", "0-99999999/1000", ["bad --ranks", "[0, 1000)"]),
])
def test_stage_selection_is_bounded_before_it_is_expanded(data, tmp_path, option, value, says):
    _, run = data
    refused(tokpack("stage", run, tmp_path / "dest", option, value), *says)
    assert not (tmp_path / "dest").exists()  # the lock and the folder it made are gone again


SHUFFLE = ["--seq-len", "63", "--seed", "1", "--memory", "1MiB"]


@pytest.mark.parametrize("args, says", [
    (["--epochs", "1", "--samples", str(10**15)], ["passes over one source", "100,000"]),
    (["--epochs", "1", "--tokens", "1000T"], ["passes over one source", "15,873,015,873,015"]),
    (["--epochs", "1", "--samples", str(10**7), "--shard-samples", "1"], ["number of output shards", "10,000,000",
                                                                          "1,000,000"]),
    (["--epochs", str(10**12)], ["epoch count", "1,000,000,000,000", "100,000"]),
    (["--epoch", str(10**12)], ["epoch number", "99,999"]),
    # 496 windows each used 100,000+ times: the out-of-core passes would loop per repeat
    (["--epochs", "1", "--samples", str(496 * 100_001)], ["passes over one source", "100,000"]),
])
def test_shuffle_counts_are_bounded_before_allocation(data, tmp_path, args, says):
    src, _ = data
    refused(tokpack("shuffle", src, "-o", tmp_path / "out", *SHUFFLE, *args), *says)
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.mark.parametrize("args, says", [
    (["--epochs", str(10**12)], ["epoch count"]),
    (["--epochs", "1", "--samples", str(10**7), "--shard-samples", "1"], ["number of output shards"]),
    (["--epochs", "1", "--samples", str(496 * 100_001)], ["passes over one source"]),
])
def test_plan_shuffle_is_bounded_too(data, tmp_path, args, says):
    src, _ = data
    refused(tokpack("plan", "shuffle", src, "-o", tmp_path / "out", *SHUFFLE, "--disk-mbps", "100", *args), *says)


def _schedule(tmp_path: Path, src: Path, body: str) -> Path:
    path = tmp_path / "schedule.yaml"
    path.write_text(f"seq_len: 63\nseed: 1\nstages:\n{body.replace('SRC', str(src))}")
    return path


def test_schedule_alias_bomb_is_refused(data, tmp_path):
    src, _ = data
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x","x"]']
    lines += [f"{chr(ord('b') + i)}: &{chr(ord('b') + i)} [{','.join(['*' + chr(ord('a') + i)] * 10)}]"
              for i in range(8)]  # 10^9 strings once expanded
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + f"\nseq_len: 63\nseed: 1\nstages: [{{name: a, sources: {{{src}: 1}}, epochs: 1}}]\n")
    refused(tokpack("shuffle", "--schedule", bomb, "-o", tmp_path / "out", "--memory", "1MiB"), "alias", "line 2")


@pytest.mark.parametrize("body, says", [
    ("  - {name: a, sources: {SRC: 1}, epochs: 1000000000000}\n", ["epoch count", "100,000"]),
    ("".join(f"  - {{name: s{i}, sources: {{SRC: 1}}, epochs: 1000}}\n" for i in range(101)), ["epoch count"]),
    ("  - {name: a, sources: {SRC: 1}, tokens: 1000T}\n", ["passes over one source"]),
], ids=["epochs-10^12", "101-stages-of-1000-epochs", "tokens-1000T"])
def test_schedule_sizes_are_bounded(data, tmp_path, body, says):
    src, _ = data
    refused(tokpack("shuffle", "--schedule", _schedule(tmp_path, src, body), "-o", tmp_path / "out",
                    "--memory", "1MiB"), *says)


def test_huge_schedule_file_is_not_read_whole(data, tmp_path):
    src, _ = data
    path = _schedule(tmp_path, src, "  - {name: a, sources: {SRC: 1}, epochs: 1}\n")
    with open(path, "a") as f:
        f.write("#" * (2 << 20) + "\n")
    refused(tokpack("shuffle", "--schedule", path, "-o", tmp_path / "out"), "schedule file size", "1,048,576")


@pytest.mark.parametrize("args", [
    ["--start-sample", str(10**18)],
    ["--world-size", str(10**12), "--rank", "5"],
    ["--micro-batch", str(10**12)],
])
def test_read_positions_beyond_the_run_are_refused(data, args):
    _, run = data
    refused(tokpack("read", run, *args))


def test_read_count_is_a_limit_not_an_allocation(data):
    _, run = data
    r = tokpack("read", run, "--count", str(10**18))
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 2 * 496  # every sample of both epochs, then the end of the run
