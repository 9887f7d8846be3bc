"""Progress names each phase while it runs (issue 43, item 5): an out-of-core shuffle's log names
its order pass ("order buckets, write shards") while that runs, not the scatter pass it finished;
`pack` of raw text names its tokenizing phase. Real `tokpack` processes with stderr to a pipe,
slowed in the child so that a small interval sees each phase mid-run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import random_docs, write_source
from tokpack.formats.io import progress_log

ROOT = Path(__file__).resolve().parents[1]
STAMP = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d tokpack: "

# Each shard's writing (the order pass's own work) and each JSONL document read for tokenizing
# made slow in the child only.
SLOWED = """
import time
import tokpack.shuffle.epoch_job as epoch_job
from datatrove.pipeline.readers import JsonlReader
write, read_file = epoch_job.EpochJob.write_shard, JsonlReader.read_file
def slow_write(self, *a, **k):
    time.sleep(0.8); return write(self, *a, **k)
def slow_read(self, *a, **k):
    for doc in read_file(self, *a, **k):
        time.sleep(0.01); yield doc
epoch_job.EpochJob.write_shard, JsonlReader.read_file = slow_write, slow_read
from tokpack.packer.cli import main
if __name__ == "__main__":
    main()
"""


def tokpack(tmp_path, *args) -> subprocess.CompletedProcess:
    script = tmp_path / "slowed.py"  # a file, not -c: the local executor's workers import __main__
    script.write_text(SLOWED)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TOKPACK_PROGRESS", None)
    return subprocess.run(
        [sys.executable, str(script), *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env
    )


def phases(stderr: str) -> list[str]:
    """What each progress line says runs, in order."""
    return [
        re.sub(STAMP, "", line).split(": ", 1)[1].rsplit(": ", 1)[0]
        for line in stderr.splitlines()
        if re.match(STAMP, line)
    ]


@pytest.mark.parametrize("packing", ["concat", "best-fit"])
def test_an_out_of_core_shuffle_names_its_order_pass_while_it_runs(tmp_path, packing):
    docs = random_docs(np.random.default_rng(5), 3000, 1000, 0)
    src = write_source(tmp_path / "src", docs, docs_per_shard=500)
    r = tokpack(
        tmp_path,
        "shuffle", src, "-o", tmp_path / "run", "--seq-len", 127, "--seed", 1, "--epochs", 1,
        "--shard-samples", 1000, "--memory", "512KiB", "--packing", packing, "--log-interval", 0.2,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "out of core" in r.stderr, r.stderr
    said = phases(r.stderr)
    first = said.index("order buckets, write shards")  # the pass is named while its shards are written
    assert said.count("order buckets, write shards") >= 3, said  # 0.8 s a shard at 0.2 s a line
    assert "scatter" not in said[first:], said  # the finished scatter pass gives way at once


def test_pack_of_raw_text_names_its_tokenizing_phase(tmp_path):
    corpus = tmp_path / "text.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 30}) + "\n" for i in range(150)))
    r = tokpack(
        tmp_path, "pack", corpus, "-o", tmp_path / "packed", "--tokenizer", ROOT / "examples" / "tokenizer.json",
        "--log-interval", 0.2,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if re.match(STAMP + "tokenize text.jsonl: ", line)]
    assert len(lines) >= 3, r.stderr  # 1.5 s of reading at 0.2 s a line
    done = [float(re.search(r": ([\d.]+)/", line)[1]) for line in lines]
    assert done == sorted(done) and all(" MB (" in line for line in lines), lines


def test_best_fit_names_the_two_phases_of_its_row_table(tmp_path, monkeypatch):
    """Best-fit's row table is built before the epoch is written (in memory or out of core): its
    packing of the rows, then its sort, each a phase of its own."""
    from conftest import shuffle_run
    from tokpack.shuffle import epoch_job

    opened = []

    def spy(total, desc, unit="B", enabled=None, unit_bytes=None, phase=False):
        opened.append((desc, unit, phase))
        return progress_log._NoBar()

    monkeypatch.setattr(epoch_job, "progress", spy)
    src = write_source(tmp_path / "src", random_docs(np.random.default_rng(2), 300, 1000, 0))
    shuffle_run([str(src)], str(tmp_path / "run"), seq_len=63, seed=1, epochs=[0], packing="best-fit")
    assert opened[:2] == [("epoch 0: pack rows", "B", True), ("epoch 0: sort the row table", "bucket", True)]
