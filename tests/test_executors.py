"""pack and shuffle on datatrove's real executors: Local (more tasks than workers, a task
SIGKILLed midway then rerun), a local Ray cluster, and a one-node Slurm cluster
(scripts/slurm-local.sh); plus file:// and memory:// paths. Every run must give the bytes of
the default in-process run."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import random_docs, require, write_source
from tokpack.packer.cli import main
from tokpack.packer.executors import PROJECT_ROOT, join_path, parse_sbatch_args
from tokpack.packer.shared import ExecutorConfig
from tokpack.formats.io.paths import local_path

# 300 documents, 718 samples of 64 tokens: 8 output shards of 100 samples, out of core at 64 KiB.
SHUFFLE = ["--seq-len", "63", "--seed", "3", "--epochs", "1", "--shard-samples", "100", "--memory", "64KiB"]
KILL_RANK = 3  # the order task killed midway in the recovery test


def cli(*args: str) -> dict:
    r = CliRunner().invoke(main, [*map(str, args), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout.strip().splitlines()[-1])


def tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` by relative path (the run must have removed its work folder)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def without_paths(files: dict[str, bytes]) -> dict[str, object]:
    """Manifests minus where the sources lay (a staged copy lives elsewhere); data files as is."""

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k != "path"}
        return [strip(v) for v in x] if isinstance(x, list) else x

    return {k: strip(json.loads(v)) if k.endswith("tokpack.json") else v for k, v in files.items()}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    docs = random_docs(np.random.default_rng(5), 300, 1000, 0)
    return write_source(tmp_path_factory.mktemp("exec") / "src", docs, docs_per_shard=100)


@pytest.fixture(scope="module")
def reference(source, tmp_path_factory) -> dict[str, bytes]:
    """The default: local executor, one worker, natural task counts."""
    out = tmp_path_factory.mktemp("ref") / "run"
    summary = cli("shuffle", source, "-o", out, *SHUFFLE)
    assert summary["path"] == "out-of-core" and summary["samples_per_epoch"] == 718
    files = tree(out)
    assert len([f for f in files if f.endswith(".ds")]) == 8
    return files


@pytest.fixture(scope="module")
def npy_inputs(tmp_path_factory) -> list[Path]:
    """Three token files for pack (one pack task each): EOS-terminated documents, vocab 1000."""
    d = tmp_path_factory.mktemp("npy")
    rng = np.random.default_rng(11)
    paths = []
    for i in range(3):
        p = d / f"part{i}.npy"
        np.save(p, np.concatenate(random_docs(rng, 40 + 10 * i, 1000, 0)).astype(np.uint16))
        paths.append(p)
    return paths


@pytest.fixture(scope="module")
def pack_reference(npy_inputs, tmp_path_factory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("packref") / "src"
    cli("pack", *npy_inputs, "-o", out, "--eos-id", "0", "--vocab-size", "1000", "--shard-tokens", "3000")
    return tree(out)


# ------------------------------------------------------------------------------ local


def test_local_more_tasks_than_workers(source, reference, npy_inputs, pack_reference, tmp_path):
    out = tmp_path / "run"
    summary = cli("shuffle", source, "-o", out, *SHUFFLE, "--workers", "2", "--tasks", "5")
    assert summary["path"] == "out-of-core"
    assert tree(out) == reference
    packed = tmp_path / "packed"
    cli(
        "pack",
        *npy_inputs,
        "-o",
        packed,
        "--eos-id",
        "0",
        "--vocab-size",
        "1000",
        "--shard-tokens",
        "3000",
        "--workers",
        "2",
    )
    assert tree(packed) == pack_reference


KILLER = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {root!r})
    from datatrove.pipeline.base import PipelineStep
    from tokpack.packer.executors import ExecutorConfig, pass_runner
    from tokpack.shuffle.run import shuffle_run
    from tokpack.shuffle.spec import ShuffleSpec

    class KillMidway(PipelineStep):
        # Runs the wrapped step; in rank {rank} SIGKILLs the whole process right after the
        # task's first committed file, before its done-file and datatrove's completion marker.
        name = "kill midway"

        def __init__(self, step):
            super().__init__()
            self.step = step

        def run(self, data=None, rank=0, world_size=1):
            if rank == {rank}:
                replace = os.replace
                def replace_then_die(*args, **kwargs):
                    replace(*args, **kwargs)
                    os.kill(os.getpid(), signal.SIGKILL)
                os.replace = replace_then_die
            return self.step.run(data, rank, world_size)

    # datatrove's LocalPipelineExecutor with one worker runs in this process: the kill takes the driver down too
    inner = pass_runner(ExecutorConfig(workers=1, in_process=False))

    def run_passes(passes):
        inner([(KillMidway(step) if job_name.endswith("-order") else step, tasks, job_name, logging_dir)
               for step, tasks, job_name, logging_dir in passes])

    spec = ShuffleSpec.given_as(sources=[{src!r}], seq_len=63, seed=3, epochs=[0], shard_samples=100, memory=64 << 10)
    shuffle_run(spec, {out!r}, workers=2, tasks=5, run_passes=run_passes)
    """
)


def test_local_task_killed_midway_then_rerun(source, reference, tmp_path):
    out = tmp_path / "run"
    script = tmp_path / "kill.py"
    script.write_text(KILLER.format(root=PROJECT_ROOT, rank=KILL_RANK, src=str(source), out=str(out)))
    log = tmp_path / "kill.log"
    with open(log, "wb") as f:  # not a pipe: the killed driver's orphans (datatrove's Manager) would hold it open
        proc = subprocess.Popen(
            [sys.executable, str(script)], stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        returncode = proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # those orphans: the session the test started, nothing else
    except ProcessLookupError:
        pass
    assert returncode == -signal.SIGKILL, log.read_text()[-2000:]
    assert not (out / "tokpack.json").exists()
    epoch = out / "epoch-00000"
    markers = sorted(p.name for p in out.glob(".tokpack-work/**/order/completions/*"))
    assert markers == [f"{i:05d}" for i in range(KILL_RANK)]  # ranks before the killed one finished
    done = {i: (epoch / f"{i:05d}.ds").stat().st_ino for i in range(KILL_RANK)}
    assert not (epoch / "tokpack.json").exists()
    assert any(epoch.glob(f"{KILL_RANK:05d}.ds*"))  # the killed task had begun writing its shard

    # Rerun the same command: only the unfinished order tasks run; the finished shards stay as they are.
    cli("shuffle", source, "-o", out, *SHUFFLE, "--workers", "2", "--tasks", "5")
    assert tree(out) == reference
    assert {i: (epoch / f"{i:05d}.ds").stat().st_ino for i in range(KILL_RANK)} == done


# ------------------------------------------------------------------------------ paths


def test_file_and_memory_urls(source, reference, tmp_path):
    out = tmp_path / "run"
    cli("shuffle", f"file://{source}", "-o", f"file://{out}", *SHUFFLE, "--workers", "2")
    assert tree(out) == reference

    import fsspec

    fs = fsspec.filesystem("memory")
    for p in source.iterdir():
        fs.pipe(f"/exec-test/src/{p.name}", p.read_bytes())
    try:
        # memory:// lives in one process: tasks in other processes would send their shards to
        # stores the command never sees, so that is refused before anything is written
        r = CliRunner().invoke(
            main,
            ["shuffle", "memory://exec-test/src", "-o", "memory://exec-test/run", *map(str, SHUFFLE), "--workers", "2"],
        )
        assert r.exit_code == 1 and "this store keeps its objects inside one process" in r.output, r.output
        assert not fs.exists("/exec-test/run")
        cli("shuffle", "memory://exec-test/src", "-o", "memory://exec-test/run", *SHUFFLE, "--workers", "1")
        got = {f[len("/exec-test/run/") :]: fs.cat(f) for f in fs.find("/exec-test/run")}
    finally:
        fs.rm("/exec-test", recursive=True)
    assert without_paths(got) == without_paths(reference)


def test_path_helpers():
    assert local_path("file:///data/x") == "/data/x"
    assert local_path("rel/x") == "rel/x"
    assert local_path("s3://bucket/x") is None
    assert join_path("s3://bucket/logs/", "pack") == "s3://bucket/logs/pack"
    assert parse_sbatch_args("account=ml,exclusive,--qos=high") == {"account": "ml", "exclusive": "", "qos": "high"}
    assert ExecutorConfig().executor == "local"


# ------------------------------------------------------------------------------ ray


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster (2 CPUs) for the module: starting Ray is the slow part."""
    ray = require("ray", "pip install 'ray[default]'")
    from tokpack.packer.executors import ray_connect

    started = not ray.is_initialized()
    ray_connect(ExecutorConfig(executor="ray", workers=2))
    assert ray.cluster_resources().get("CPU") == 2 or not started
    yield ray
    if started:
        ray.shutdown()


def test_ray_local_cluster(ray_cluster, source, reference, tmp_path):
    """The bytes of the local run; every rank of both passes marked complete once, each by one of
    the two rank runners, which serve both passes (not a new Ray worker per task: issue 27)."""
    out, logs = tmp_path / "run", tmp_path / "logs"
    cli(
        "shuffle",
        source,
        "-o",
        out,
        *SHUFFLE,
        "--executor",
        "ray",
        "--workers",
        "2",
        "--tasks",
        "3",
        "--logging-dir",
        logs,
    )
    assert tree(out) == reference
    markers = {
        p.parent.parent.name.rsplit("-", 1)[-1]: sorted(m.name for m in p.parent.glob("*"))
        for p in logs.glob("*/completions/*")
    }
    assert markers == {"scatter": [f"{r:05d}" for r in range(3)], "order": [f"{r:05d}" for r in range(8)]}
    runners = {m.read_text() for m in logs.glob("*/completions/*")}
    assert 1 <= len(runners) <= 2 and all(pid.isdigit() for pid in runners)


def test_ray_task_the_cluster_cannot_start_is_one_line(ray_cluster, source, tmp_path):
    """A runner asking for more than the cluster holds would wait forever: refused at once."""
    r = CliRunner().invoke(
        main,
        [
            "shuffle",
            str(source),
            "-o",
            str(tmp_path / "run"),
            *SHUFFLE,
            "--executor",
            "ray",
            "--workers",
            "2",
            "--mem",
            "100000",
        ],
    )
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "the Ray cluster cannot start one task" in r.output and "100000 GiB a task" in r.output, r.output
    assert not (tmp_path / "run" / "epoch-00000" / "tokpack.json").exists()


def test_a_ray_head_address_nobody_answers_at_is_one_line(source, tmp_path, monkeypatch):
    """--ray-address HOST:PORT (a head's GCS, `ray start --head`'s form) where nothing listens:
    ray.init retries it for ever (minutes of 'Failed to connect to GCS' lines, deaf to SIGTERM);
    tokpack says so in one line before calling it."""
    ray = require("ray", "pip install 'ray[default]'")
    from conftest import _free_port

    def init(*args, **kwargs):
        raise AssertionError("ray.init called with an address nothing answers at: it would retry for ever")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    address = f"127.0.0.1:{_free_port()}"  # nothing listens there once the probe socket is closed
    r = CliRunner().invoke(
        main,
        [
            "shuffle",
            str(source),
            "-o",
            str(tmp_path / "run"),
            *SHUFFLE,
            "--executor",
            "ray",
            "--ray-address",
            address,
            "--json",
        ],
    )
    assert r.exit_code == 1, r.output
    error = json.loads(r.stdout)["error"]
    assert error["where"] == "--ray-address" and f"nothing answers at {address}" in error["message"], error
    assert "ray status" in error["hint"]


def test_ray_without_an_address_starts_its_own_cluster_whatever_ray_address_says(source, reference, tmp_path):
    """--executor ray without --ray-address starts a local cluster (docs/CLUSTER.md); with
    $RAY_ADDRESS set (a Ray node's shell, a Ray job), ray.init joined that address and refused
    num_cpus: 'internal error (a bug in tokpack): ValueError: When connecting to an existing
    cluster, num_cpus and num_gpus must not be provided', exit 70."""
    require("ray", "pip install 'ray[default]'")
    from conftest import _free_port

    out = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "tokpack", "shuffle", str(source), "-o", str(out), *SHUFFLE, "--executor", "ray"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": PROJECT_ROOT, "RAY_ADDRESS": f"127.0.0.1:{_free_port()}"},
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert tree(out) == reference


def test_ray_ranks_run_in_contiguous_runs():
    """Every rank in exactly one run, in order, about RAY_CALLS_PER_WORKER runs a worker slot."""
    from tokpack.packer.executors import RAY_CALLS_PER_WORKER, rank_runs

    for ranks, slots in [(list(range(37)), 2), (list(range(2)), 2), ([3, 5, 6, 9], 1), (list(range(20490)), 96)]:
        runs = rank_runs(ranks, slots)
        assert [r for run in runs for r in run] == ranks
        assert len(runs) <= RAY_CALLS_PER_WORKER * slots
        assert len(runs) >= min(len(ranks), RAY_CALLS_PER_WORKER * slots) // 2
    assert len(rank_runs(list(range(37)), 2)) == 8 and rank_runs([], 2) == []


# ------------------------------------------------------------------------------ slurm


def slurm_unavailable() -> str | None:
    """Why the Slurm test cannot run here, or None."""
    if shutil.which("sbatch") is None:
        return "sbatch not found: apt-get install slurm-wlm munge, then scripts/slurm-local.sh start"
    # A node still completing the suite's previous Slurm job (state "comp", its epilog running)
    # is usable in seconds: waited for, up to 120 s, not skipped (CI once skipped a test for it).
    deadline = time.monotonic() + 120
    while True:
        try:
            r = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            return "sinfo did not answer within 30 s: the slurm controller is not responding"
        if r.returncode != 0:
            return f"slurm controller not reachable (scripts/slurm-local.sh start): {r.stderr.strip()}"
        states = [s.rstrip("*~#") for s in r.stdout.split()]
        if any(s in ("idle", "mix", "alloc") for s in states):
            return None
        if "comp" not in states or time.monotonic() > deadline:
            return f"no usable slurm node (node states: {states or 'none'}); see scripts/slurm-local.sh status"
        time.sleep(1)


def test_slurm_array_jobs(source, reference, npy_inputs, pack_reference, tmp_path):
    if (reason := slurm_unavailable()) is not None:
        pytest.skip(reason)
    out = tmp_path / "run"
    # 3 scatter tasks then 8 order tasks, each pass one array job; at most 2 tasks at a time.
    cli(
        "shuffle",
        source,
        "-o",
        out,
        *SHUFFLE,
        "--executor",
        "slurm",
        "--workers",
        "2",
        "--tasks",
        "3",
        "--logging-dir",
        tmp_path / "logs",
        "--time",
        "00:10:00",
        "--mem",
        "0.5",
    )
    assert tree(out) == reference
    scripts = sorted(tmp_path.glob("logs/*/launch_script.slurm"))
    assert len(scripts) == 2 and all("#SBATCH --array=0-" in s.read_text() for s in scripts)
    assert sum(1 for _ in tmp_path.glob("logs/*-order/completions/*")) == 8
    packed = tmp_path / "packed"
    cli(
        "pack",
        *npy_inputs,
        "-o",
        packed,
        "--eos-id",
        "0",
        "--vocab-size",
        "1000",
        "--shard-tokens",
        "3000",
        "--executor",
        "slurm",
        "--time",
        "00:10:00",
    )
    assert tree(packed) == pack_reference


def test_a_slurm_pass_names_its_tasks_done_in_a_log(source, reference, tmp_path):
    """`--executor slurm` in a log (nohup, a batch job): the command waited for the array jobs
    saying nothing at all, pass after pass; now each pass's line, tasks done of its tasks, no bar."""
    if (reason := slurm_unavailable()) is not None:
        pytest.skip(reason)
    out = tmp_path / "run"
    args = [*SHUFFLE, "--executor", "slurm", "--tasks", "2", "--time", "00:10:00", "--log-interval", "0.2"]
    r = subprocess.run(
        [sys.executable, "-m", "tokpack", "shuffle", str(source), "-o", str(out), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": PROJECT_ROOT},
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    said = [line.split(" tokpack: ", 1)[1] for line in r.stderr.splitlines() if ": slurm tasks: " in line]
    for name, tasks in (("scatter", 2), ("order", 8)):
        assert any(re.match(rf"epoch-00000-\w+-{name}: slurm tasks: \d+/{tasks} tasks", x) for x in said), said
    assert "\r" not in r.stderr and tree(out) == reference


def test_slurm_array_element_runs_several_small_tasks(source, tmp_path):
    """18 order tasks, at most 2 at a time: 6 array elements of 3 tasks each (SLURM_ELEMENTS_PER_WORKER
    per worker slot), not one element, and one Python and datatrove start, per task."""
    if (reason := slurm_unavailable()) is not None:
        pytest.skip(reason)
    args = [*SHUFFLE[:-4], "--shard-samples", "40", "--memory", "64KiB"]
    cli("shuffle", source, "-o", tmp_path / "ref", *args)
    expected = tree(tmp_path / "ref")
    out = tmp_path / "run"
    cli(
        "shuffle",
        source,
        "-o",
        out,
        *args,
        "--executor",
        "slurm",
        "--workers",
        "2",
        "--tasks",
        "3",
        "--logging-dir",
        tmp_path / "logs",
        "--time",
        "00:10:00",
        "--mem",
        "0.5",
    )
    assert tree(out) == expected and len([f for f in expected if f.endswith(".ds")]) == 18
    order_script = next(tmp_path.glob("logs/*-order/launch_script.slurm")).read_text()
    assert "#SBATCH --array=0-5%2" in order_script
    assert sum(1 for _ in tmp_path.glob("logs/*-order/completions/*")) == 18


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="sbatch not found (apt-get install slurm-wlm)")
def test_slurm_refused_job_is_one_line_error(source, tmp_path):
    r = CliRunner().invoke(
        main,
        [
            "shuffle",
            str(source),
            "-o",
            str(tmp_path / "run"),
            *SHUFFLE,
            "--executor",
            "slurm",
            "--partition",
            "any",
            "--sbatch-args",
            "no-such-option=1",
        ],
    )
    assert r.exit_code == 1
    assert "sbatch refused the epoch-00000-" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "run" / "tokpack.json").exists()


def test_forked_workers_do_not_share_buffers(source, reference, tmp_path):
    """Workers forked from a process that already ran a shuffle inherit its reused buffers;
    those are private mappings, so two workers never write into each other's rows."""
    from datatrove.executor import LocalPipelineExecutor

    from tokpack.shuffle.run import shuffle_run
    from tokpack.shuffle.spec import ShuffleSpec

    def forked(passes):
        for step, tasks, job_name, logging_dir in passes:
            LocalPipelineExecutor(
                [step], tasks=tasks, workers=2, logging_dir=str(logging_dir), start_method="fork"
            ).run()

    cli("shuffle", source, "-o", tmp_path / "warm", *SHUFFLE)  # fills this process's buffers
    spec = ShuffleSpec.given_as(
        sources=[str(source)], seq_len=63, seed=3, epochs=[0], shard_samples=100, memory=64 << 10
    )
    shuffle_run(spec, str(tmp_path / "run"), workers=2, tasks=5, run_passes=forked)
    assert tree(tmp_path / "run") == reference
