"""`tokpack plan`: what shuffle, pack and stage would do, from the planning code they run, with
nothing written. Each plan is checked against a real run of the engine on the same corpus:
the task counts the engine hands its executor, the bucket files and shards it makes, and the
bytes it leaves on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from conftest import random_docs, shuffle_run, write_source
from probes import AUDIT_SITE, audit_env, audited
from tokpack.formats.constants import LOCK_NAME, WORK_DIR
from tokpack.packer import ExecutorConfig, pack, plan, stage
from tokpack.packer.executors import pass_runner

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN, SHARD_SAMPLES = 63, 1000  # 128-byte rows, 5 shards an epoch
INCIDENT = "virtual:tokens=11T,documents=5.5B,dtype=uint16"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """2000 documents (about 300k tokens) in 10 source shards."""
    return write_source(
        tmp_path_factory.mktemp("plan") / "src",
        random_docs(np.random.default_rng(3), 2000, 1000, 0),
        docs_per_shard=200,
    )


def listing(path: Path) -> dict:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))}


def file_bytes(path: Path, pattern: str = "*") -> int:
    return sum(p.stat().st_size for p in path.rglob(pattern) if p.is_file())


def recording_runner(out: Path, workers: int, seen: list[dict]):
    """The real pass runner, one pass at a time, noting after each what the engine asked for
    (tasks) and what it left in the work folder (scatter done files, bucket files)."""
    real = pass_runner(ExecutorConfig(workers=workers))

    def run_passes(passes):
        for step, tasks, name, logs in passes:
            real([(step, tasks, name, logs)])
            work = out / WORK_DIR
            buckets = [p for p in work.glob("*/ooc-*/scatter-*/*/b*") if p.suffix in (".rows", ".pos")]
            seen.append(
                {
                    "pass": name.rsplit("-", 1)[1],
                    "tasks": tasks,
                    "scatter_done": len(list(work.glob("*/ooc-*/scatter-*.json"))),
                    "bucket_files": len(buckets),
                    "bucket_ids": {p.stem for p in buckets},
                    "bucket_bytes": sum(p.stat().st_size for p in buckets),
                    "most_per_folder": max(Counter(p.parent for p in buckets).values(), default=0),
                }
            )

    return run_passes


@pytest.mark.parametrize(
    "memory, workers, tasks",
    [(4 << 30, 1, None), (64 << 10, 1, 1), (64 << 10, 2, 2)],
    ids=["in-memory", "out-of-core-1-task", "out-of-core-2-workers"],
)
def test_plan_counts_and_bytes_equal_the_engine_run(corpus, tmp_path, memory, workers, tasks):
    out = tmp_path / "run"
    config = ExecutorConfig(workers=workers, tasks=tasks)
    kw = dict(seq_len=SEQ_LEN, seed=5, shard_samples=SHARD_SAMPLES, memory=memory)
    planned = plan("shuffle", str(corpus), str(out), epochs=2, executor=config, disk_mbps=500, **kw)
    assert not out.exists()

    seen: list[dict] = []
    result = shuffle_run(
        [str(corpus)],
        str(out),
        epochs=[0, 1],
        workers=workers,
        tasks=tasks,
        run_passes=recording_runner(out, workers, seen),
        **kw,
    )

    assert planned.samples_per_epoch == result["samples_per_epoch"]
    assert planned.path == result["path"]
    assert [e["shards"] for e in planned.epochs] == [d["shards"] for d in result["epochs_detail"]]
    assert planned.shards == len(list(out.glob("epoch-*/*.ds")))
    # The tasks of every pass, as the engine handed them to its executor.
    assert [(p["name"].replace("-", ""), p["tasks"]) for p in planned.passes] == [(s["pass"], s["tasks"]) for s in seen]
    if planned.path == "out-of-core":
        scatters = [s for s in seen if s["pass"] == "scatter"]
        for e, s in zip(planned.epochs, scatters):
            assert e["scatter_tasks"] == s["scatter_done"] == s["tasks"]
            assert e["buckets"] == len(s["bucket_ids"])
            assert e["bucket_files"] == s["bucket_files"]  # every task's rows reach every bucket here
            assert e["files_per_folder"] == s["most_per_folder"] == 2 * e["buckets"]
            assert abs(e["scratch_bytes"] - s["bucket_bytes"]) <= 0.01 * s["bucket_bytes"]
    # The space prediction against what the run left: every epoch's files and the manifests.
    on_disk = file_bytes(out)
    predicted = sum(e["output_bytes"] for e in planned.epochs) + planned.manifests["tokpack.json"]
    assert abs(predicted - on_disk) <= 0.01 * on_disk, (predicted, on_disk)
    (space,) = planned.space
    assert space["needed_bytes"] >= 0.99 * on_disk and space["enough"]
    for name, size in planned.manifests.items():
        assert abs(size - (out / name).stat().st_size) <= 0.01 * size, name


@pytest.mark.parametrize(
    "executor, workers, at_once",
    [("local", 2, lambda tasks: 1), ("slurm", 3, lambda tasks: min(3, tasks)), ("ray", 1, lambda tasks: tasks)],
)
def test_plan_seconds_are_bytes_over_the_disks_working_at_once(corpus, tmp_path, executor, workers, at_once):
    """A pass's predicted seconds: its bytes at --disk-mbps, shared by the tasks that run at once
    on separate disks (Slurm and Ray: up to --workers, or every task; local: one disk)."""
    config = ExecutorConfig(executor=executor, workers=workers)
    planned = plan(
        "shuffle",
        str(corpus),
        str(tmp_path / "run"),
        seq_len=SEQ_LEN,
        seed=5,
        epochs=2,
        shard_samples=SHARD_SAMPLES,
        memory=64 << 10,
        executor=config,
        disk_mbps=2.5,
    )
    assert len({p["tasks"] for p in planned.passes}) > 1 and planned.disk == "given" and planned.disk_mbps == 2.5
    for p in planned.passes:
        assert p["seconds"] == round((p["read_bytes"] + p["written_bytes"]) / 2.5e6 / at_once(p["tasks"]), 1), p
    # plus the start-up: the command's, and datatrove's executor's for each pass it runs
    from tokpack.packer.executors import runs_in_process
    from tokpack.packer.plan_result import COMMAND_START_SECONDS, EXECUTOR_START_SECONDS

    startup = COMMAND_START_SECONDS + (0 if runs_in_process(config) else EXECUTOR_START_SECONDS * len(planned.passes))
    assert planned.startup_seconds == startup and startup > COMMAND_START_SECONDS
    assert planned.predicted_seconds == round(sum(p["seconds"] for p in planned.passes) + startup, 1)
    assert (planned.workers, planned.executor) == (workers, executor)


def test_plan_writes_nothing_and_measures_the_disk(corpus, tmp_path):
    """Without --disk-mbps the disk is measured with a file removed at once: the directory
    listing is the same after, no OUT, no lock. A run's complete epoch is reported as such."""
    out = tmp_path / "run"
    before = listing(tmp_path)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokpack.packer.cli",
            "plan",
            "shuffle",
            str(corpus),
            "-o",
            str(out),
            "--seq-len",
            str(SEQ_LEN),
            "--seed",
            "5",
            "--epochs",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["disk"].startswith("measured") and report["disk_mbps"] > 0 and report["predicted_seconds"] >= 0
    assert listing(tmp_path) == before and not out.exists()

    shuffle_run([str(corpus)], str(out), seq_len=SEQ_LEN, seed=5, epochs=[0])
    before = listing(tmp_path)
    again = plan("shuffle", str(corpus), str(out), seq_len=SEQ_LEN, seed=5, epochs=[0, 1], disk_mbps=100)
    assert listing(tmp_path) == before and not (out / LOCK_NAME).exists()
    assert [e["path"] for e in again.epochs] == ["complete already", "in-memory"]
    assert "epoch-00000/tokpack.json" not in again.manifests and "epoch-00001/tokpack.json" in again.manifests
    # What stops the shuffle stops its plan, with the same line: here, another seed for the same OUT.
    proc = tokpack(
        "plan",
        "shuffle",
        str(corpus),
        "-o",
        str(out),
        "--seq-len",
        str(SEQ_LEN),
        "--seed",
        "6",
        "--epoch",
        "1",
        "--disk-mbps",
        "100",
        cwd=tmp_path,
    )
    assert proc.returncode == 1 and "output directory holds a different run" in proc.stderr, proc.stderr
    assert listing(tmp_path) == before


PLAN_INCIDENT = """
import json, sys
from tokpack.packer import ExecutorConfig, plan
r = plan("shuffle", sys.argv[1], sys.argv[2], seq_len=4096, seed=1, epochs=1, memory=3 << 40, disk_mbps=2000,
         executor=ExecutorConfig(executor="slurm", workers=48, tasks=48))
print(json.dumps(r.to_json()))
"""


def test_the_incidents_11T_corpus_plans_without_touching_disk(tmp_path):
    """The 11T-token, 48-node run, planned from a virtual source: no file is opened for writing
    and no directory made (an audit hook watches the whole process)."""
    log = tmp_path / "audit.log"
    proc = subprocess.run(
        [sys.executable, "-c", PLAN_INCIDENT, INCIDENT, str(tmp_path / "nowhere" / "run")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([AUDIT_SITE, str(ROOT)]), **audit_env(log, "/")},
    )
    assert proc.returncode == 0, proc.stderr
    assert [a for a in audited(log) if a.writes] == []
    r = json.loads(proc.stdout)
    samples = 11 * 10**12 // 4097
    assert r["samples_per_epoch"] == samples and r["path"] == "out-of-core"
    shard_samples = (1 << 30) // (4097 * 2)
    assert r["shards"] == -(-samples // shard_samples)
    scatter, order = r["passes"]
    assert (scatter["tasks"], order["tasks"]) == (48, r["shards"])
    assert scatter["memory_per_task"] == (3 << 40) // 48
    assert scatter["read_bytes"] == 11 * 10**12 * 2 and scatter["written_bytes"] == samples * (4097 * 2 + 8)
    assert r["epochs"][0]["buckets"] == r["shards"]  # a 1 GiB shard fits a 64 GiB task: one bucket each
    assert r["bucket_files"] == 2 * 48 * r["shards"]
    assert r["predicted_seconds"] > 0 and not (tmp_path / "nowhere").exists()


def tokpack(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokpack.packer.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.parametrize(
    "source, said",
    [
        ("virtual:tokens=11T,docs=5B,dtype=uint16", "[docs]: bad virtual source"),
        (
            "virtual:tokens=24TB,documents=5B,dtype=uint16",
            "'24TB' is not a count (tokens= of the virtual source): it is a byte size",
        ),
        ("virtual:tokens=11T,dtype=uint16", "[documents]: bad virtual source"),
        ("virtual:tokens=11T,documents=5B,dtype=int8", "unknown token dtype"),
    ],
)
def test_a_bad_virtual_source_is_one_line(tmp_path, source, said):
    proc = tokpack(
        "plan",
        "shuffle",
        source,
        "-o",
        str(tmp_path / "run"),
        "--seq-len",
        "4096",
        "--seed",
        "1",
        "--epochs",
        "1",
        "--disk-mbps",
        "100",
        cwd=tmp_path,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_shuffle_refuses_a_virtual_source(tmp_path):
    proc = tokpack(
        "shuffle",
        INCIDENT,
        "-o",
        str(tmp_path / "run"),
        "--seq-len",
        "4096",
        "--seed",
        "1",
        "--epochs",
        "1",
        cwd=tmp_path,
    )
    assert proc.returncode == 1 and "a virtual source has no data to shuffle" in proc.stderr
    assert "tokpack plan shuffle" in proc.stderr and list(tmp_path.iterdir()) == []


def test_a_weighted_virtual_source(tmp_path):
    """`SOURCE=WEIGHT` on a virtual source: the weight follows its last key=value."""
    proc = tokpack(
        "plan",
        "shuffle",
        "virtual:tokens=3B,documents=1M,dtype=uint16,eos_id=0=3",
        "virtual:tokens=1B,documents=1M,dtype=uint16=1",
        "-o",
        str(tmp_path / "run"),
        "--seq-len",
        "4096",
        "--seed",
        "1",
        "--epochs",
        "1",
        "--tokens",
        "4B",
        "--disk-mbps",
        "100",
        "--json",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    samples = [s["samples"] for s in r["sources"]]
    assert sum(samples) == 4 * 10**9 // 4096 and abs(samples[0] / samples[1] - 3) < 1e-3
    assert [s["name"] for s in r["sources"]] == [
        "virtual:tokens=3B,documents=1M,dtype=uint16,eos_id=0",
        "virtual:tokens=1B,documents=1M,dtype=uint16",
    ]


def test_plan_pack_and_stage_equal_the_runs(corpus, tmp_path):
    """pack: one task per input file, a shard per file under --shard-tokens, the bytes it writes;
    stage: the files and bytes it copies."""
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    for p in corpus.glob("0000[0-3].ds*"):  # four datatrove files (.ds, .index, .metadata)
        (inputs / p.name).write_bytes(p.read_bytes())
    planned = plan(
        "pack",
        str(inputs),
        str(tmp_path / "packed"),
        eos_id=0,
        vocab_size=1000,
        disk_mbps=100,
        executor=ExecutorConfig(workers=2),
    )
    assert not (tmp_path / "packed").exists()
    packed = pack(str(inputs), tmp_path / "packed", eos_id=0, vocab_size=1000, executor=ExecutorConfig(workers=2))
    (p,) = planned.passes
    assert (planned.path, p["tasks"], planned.shards) == ("datatrove", 4, packed.shards)
    on_disk = file_bytes(tmp_path / "packed")
    assert abs(p["written_bytes"] + planned.manifests["tokpack.json"] - on_disk) <= 0.01 * on_disk
    assert abs(planned.manifests["tokpack.json"] - (tmp_path / "packed/tokpack.json").stat().st_size) <= 0.05 * on_disk

    run = tmp_path / "run"
    shuffle_run([str(corpus)], str(run), seq_len=SEQ_LEN, seed=5, epochs=[0, 1], shard_samples=SHARD_SAMPLES)
    planned = plan("stage", str(run), str(tmp_path / "copy"), epochs="1", disk_mbps=100)
    assert not (tmp_path / "copy").exists()
    copied = stage(str(run), tmp_path / "copy", epochs="1")
    (p,) = planned.passes
    assert abs(p["written_bytes"] - copied.bytes_copied) <= 0.01 * copied.bytes_copied  # all but .ds.metadata
    assert p["tasks"] + 2 == copied.files
    assert planned.shards == len(list((tmp_path / "copy").glob("epoch-*/*.ds")))
    assert planned.manifests == {
        name: (tmp_path / "copy" / name).stat().st_size for name in ("epoch-00001/tokpack.json", "tokpack.json")
    }


def test_bucket_files_fan_out_into_bounded_folders(corpus, tmp_path, monkeypatch):
    """A scatter task's bucket files are spread over folders of BUCKETS_PER_FOLDER buckets, as
    plan says, and the epoch's bytes do not depend on the fan-out."""
    import tokpack.shuffle.steps

    kw = dict(seq_len=SEQ_LEN, seed=5, shard_samples=SHARD_SAMPLES, memory=64 << 10)
    shuffle_run([str(corpus)], str(tmp_path / "plain"), epochs=[0], **kw)
    monkeypatch.setattr(tokpack.shuffle.steps, "BUCKETS_PER_FOLDER", 2)
    planned = plan("shuffle", str(corpus), str(tmp_path / "fanned"), epochs=1, disk_mbps=500, **kw)
    assert planned.epochs[0]["buckets"] > 2 and planned.epochs[0]["files_per_folder"] == 4
    seen: list[dict] = []
    shuffle_run(
        [str(corpus)],
        str(tmp_path / "fanned"),
        epochs=[0],
        run_passes=recording_runner(tmp_path / "fanned", 1, seen),
        **kw,
    )
    assert seen[0]["pass"] == "scatter" and seen[0]["most_per_folder"] == 4
    assert len({p.parent for p in (tmp_path / "fanned").rglob("b*.rows")}) == 0  # scratch gone after the run
    epoch = "epoch-00000"
    assert {p.name: p.read_bytes() for p in (tmp_path / "plain" / epoch).iterdir()} == {
        p.name: p.read_bytes() for p in (tmp_path / "fanned" / epoch).iterdir()
    }


def test_plan_pack_of_parquet_counts_tokens_from_the_footer(tmp_path):
    """Parquet input: the plan reads the token count from the file's footer (the row groups'
    value counts of the list column), so it predicts the shards, the bytes and a CPU-bound time
    instead of 0 shards and the disk time of nothing written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(7)
    docs = [rng.integers(1, 1000, rng.integers(1, 400)).tolist() for _ in range(3000)]  # no EOS: one is appended each
    path = tmp_path / "docs.parquet"
    pq.write_table(
        pa.table({"input_ids": pa.array(docs, pa.list_(pa.uint16())), "id": range(len(docs))}), path, row_group_size=700
    )
    tokens = sum(map(len, docs))
    kw = dict(eos_id=0, vocab_size=1000, shard_tokens=100_000)
    planned = plan("pack", str(path), str(tmp_path / "packed"), disk_mbps=100, **kw)
    packed = pack(str(path), tmp_path / "packed", **kw)
    (p,) = planned.passes
    assert packed.tokens == tokens + len(docs)  # the EOS appended, which the footer does not count
    assert planned.shards == -(-tokens // kw["shard_tokens"]) and packed.shards >= planned.shards >= 1
    assert abs(p["written_bytes"] - packed.bytes) <= 0.15 * packed.bytes
    assert p["decode_seconds"] > 0 and p["seconds"] >= round(p["decode_seconds"], 1)


def test_plan_into_an_output_that_is_a_file_is_the_commands_line_with_its_hint(corpus, tmp_path):
    """`plan shuffle -o FILE` said only "FILE: output is not a directory" (no HINT; `"hint": null`
    under --json), where shuffle says the output exists and is not a directory and to choose
    another one."""
    from click.testing import CliRunner

    from tokpack.packer.cli import main

    out = tmp_path / "afile"
    out.write_text("mine")
    args = [str(corpus), "-o", str(out), "--seq-len", "15", "--seed", "1", "--epochs", "1", "--json"]
    for command in (["plan", "shuffle", *args, "--disk-mbps", "100"], ["shuffle", *args]):
        res = CliRunner().invoke(main, command)
        error = json.loads(res.stdout)["error"]
        assert res.exit_code == 1 and error["message"] == "output exists and is not a directory", (command, error)
        assert error["file"] == str(out) and error["hint"], (command, error)
    assert out.read_text() == "mine"


def test_plan_stage_adds_no_executor_start_up(corpus, tmp_path):
    """plan stage predicted 1.75 s of datatrove's executor start-up (its default 4 workers, as
    for pack or shuffle with --workers 4), though stage copies in its own threads and starts
    no executor: a copy of a second took 2.2 s on paper. Only the command's start remains."""
    from tokpack.packer.plan_result import COMMAND_START_SECONDS

    run = tmp_path / "run"
    shuffle_run([str(corpus)], str(run), seq_len=SEQ_LEN, seed=5, epochs=[0], shard_samples=SHARD_SAMPLES)
    for workers in (None, 8):
        planned = plan("stage", str(run), str(tmp_path / "copy"), workers=workers, disk_mbps=100)
        assert planned.startup_seconds == COMMAND_START_SECONDS and planned.workers == (workers or 4)
