"""A killed tokpack leaves no process behind (issue 17): local workers, forkserver and resource
tracker, a local Ray cluster, Slurm jobs. And tokpack leaves an application's loguru sinks alone.

Every process the command started is found by a marker the test puts in the command's
environment (each descendant inherits it, /proc/PID/environ shows it), so nothing here depends
on how tokpack or datatrove arrange their processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from conftest import random_docs, require, write_source
from probes import MARK, cmdline, describe, marked
from tokpack.packer.executors import PROJECT_ROOT

GONE_WITHIN = 5.0  # seconds the issue allows the killed command's processes to end
SHUFFLE = ["--seq-len", "63", "--seed", "3", "--shard-samples", "100", "--memory", "64KiB"]


def wait_for(condition, what: str, timeout: float = 120.0, proc: subprocess.Popen | None = None):
    """Polls `condition` until it returns something true; fails if `proc` ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = condition()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the command ended (exit {proc.returncode}) before {what}")
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture
def start(tmp_path):
    """Starts `python -m tokpack.packer.cli ARGS` with a marker of its own; at teardown, whatever a failed
    test left running (the command, its processes) is killed."""
    started = []

    def run(args: list[str]) -> tuple[subprocess.Popen, str]:
        token = uuid.uuid4().hex
        env = {**os.environ, MARK: token, "PYTHONPATH": PROJECT_ROOT}
        with open(tmp_path / f"cmd-{token[:8]}.log", "wb") as log:  # not a pipe: a leftover would hold it open
            proc = subprocess.Popen(
                [sys.executable, "-m", "tokpack.packer.cli", *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=tmp_path,
            )
        started.append((proc, token))
        return proc, token

    yield run
    for proc, token in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in marked(token):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def assert_nothing_left(token: str) -> None:
    deadline = time.monotonic() + GONE_WITHIN
    left = marked(token)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = marked(token)
    for pid in left:  # do not leave them to the next test
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"still running {GONE_WITHIN} s after the kill: {describe(left)}"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """About 7,000 samples of 64 tokens: an out-of-core shuffle of a few epochs takes seconds."""
    docs = random_docs(np.random.default_rng(5), 3000, 1000, 0)
    return write_source(tmp_path_factory.mktemp("lifetime") / "src", docs, docs_per_shard=200)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_shuffle_with_two_workers_leaves_no_process(source, tmp_path, start, sig):
    proc, token = start(
        ["shuffle", str(source), "-o", str(tmp_path / "run"), *SHUFFLE, "--epochs", "4", "--workers", "2"]
    )

    # Pool workers are the forkserver's children: once one runs, every kind of process is there.
    def pool_running():
        pids = set(marked(token))
        return any(_parent(p) in pids and _parent(p) != proc.pid for p in pids)

    wait_for(pool_running, "the worker pool started", proc=proc)
    proc.send_signal(sig)
    assert proc.wait() in (-sig, 128 + sig)  # killed, or (SIGTERM) handled and exited with 143
    assert_nothing_left(token)


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def test_killed_shuffle_on_a_local_ray_cluster_leaves_no_process(source, tmp_path, start):
    require("ray", "pip install -e '.[test]'")
    proc, token = start(
        [
            "shuffle",
            str(source),
            "-o",
            str(tmp_path / "run"),
            *SHUFFLE,
            "--epochs",
            "2",
            "--executor",
            "ray",
            "--workers",
            "2",
        ]
    )

    def raylet_running():
        return any(b"raylet" in cmdline(p) for p in marked(token))

    wait_for(raylet_running, "the local Ray cluster started", timeout=300, proc=proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert_nothing_left(token)


def test_killed_shuffle_on_slurm_leaves_no_job_and_no_process(source, tmp_path, start):
    from test_executors import slurm_unavailable

    if (reason := slurm_unavailable()) is not None:
        pytest.skip(reason)
    proc, token = start(
        [
            "shuffle",
            str(source),
            "-o",
            str(tmp_path / "run"),
            *SHUFFLE,
            "--epochs",
            "4",
            "--executor",
            "slurm",
            "--workers",
            "2",
            "--time",
            "00:10:00",
            "--mem",
            "0.5",
            "--logging-dir",
            str(tmp_path / "logs"),
        ]
    )

    def submitted():  # this test's jobs: the ones submitted from its folder
        out = subprocess.run(["squeue", "-h", "-o", "%A|%Z"], capture_output=True, text=True).stdout
        return sorted({line.split("|")[0] for line in out.splitlines() if line.endswith("|" + str(tmp_path))})

    jobs = wait_for(submitted, "a job in squeue", timeout=300, proc=proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    def left_queue():
        return not submitted()

    wait_for(left_queue, "the jobs to leave squeue", timeout=60)
    states = " ".join(
        subprocess.run(["scontrol", "show", "job", j], capture_output=True, text=True).stdout for j in jobs
    )
    assert "JobState=CANCELLED" in states, states  # cancelled, not left to finish on its own
    assert_nothing_left(token)


APP = textwrap.dedent(
    """
    from loguru import logger

    received = []
    logger.remove()
    app_sink = logger.add(received.append, format="{{message}}")

    from tokpack.packer import ExecutorConfig, shuffle

    if __name__ == "__main__":  # the forkserver imports this file too
        for n, config in enumerate([ExecutorConfig(workers=1, in_process=False), ExecutorConfig(workers=2)]):
            shuffle([{src!r}], f"{out}-{{n}}", seq_len=63, seed=3, epochs=[0], shard_samples=1000,
                    memory=64 << 10, executor=config)
            logger.info(f"application message {{n}}")
        handlers = sorted(logger._core.handlers)
        print(repr(received))
        print(handlers == [app_sink], handlers)
    """
)


def test_application_loguru_sink_survives_import_and_executor_runs(source, tmp_path):
    script = tmp_path / "app.py"
    script.write_text(APP.format(src=str(source), out=str(tmp_path / "run")))
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": PROJECT_ROOT},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    received, same = done.stdout.splitlines()[-2:]
    assert "application message 0" in received and "application message 1" in received, done.stdout
    assert same.startswith("True"), same  # nothing of tokpack's or datatrove's is left behind


def test_rerun_after_a_kill_during_cleanup_removes_the_scratch(source, tmp_path):
    """Found by bench/soak.py: a kill after an epoch's manifest, while its scratch folder was
    being removed, left part of the folder; the rerun skipped the complete epoch and kept it."""
    from click.testing import CliRunner

    from tokpack.packer.cli import main

    out = tmp_path / "run"
    args = ["shuffle", str(source), "-o", str(out), *SHUFFLE, "--epochs", "1", "--workers", "1"]
    assert CliRunner().invoke(main, args).exit_code == 0
    complete = sorted(p.relative_to(out) for p in out.rglob("*"))
    stale = out / ".tokpack-work" / "epoch-00000-0123456789abcdef" / "buckets"
    stale.mkdir(parents=True)
    (stale / "00000.bin").write_bytes(b"half-removed scratch")
    assert CliRunner().invoke(main, args).exit_code == 0
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == complete


def test_pack_killed_before_its_request_is_recorded_reruns(tmp_path):
    """Found by bench/soak.py: a pack killed between creating OUT/.tokpack-work and writing its
    request.json (here: only the temp file of that write exists) was refused on rerun as "an
    unfinished pack of other inputs"."""
    from click.testing import CliRunner

    from tokpack.packer.cli import main

    docs = random_docs(np.random.default_rng(3), 40, 1000, 0)
    src = write_source(tmp_path / "src", docs)
    inputs = sorted(str(p) for p in src.glob("*.ds"))
    args = ["pack", *inputs, "-o", str(tmp_path / "packed"), "--eos-id", "0", "--vocab-size", "1000"]
    reference = CliRunner().invoke(main, args)
    assert reference.exit_code == 0, reference.output
    expected = {
        p.relative_to(tmp_path / "packed"): p.read_bytes() for p in (tmp_path / "packed").rglob("*") if p.is_file()
    }
    out = tmp_path / "killed"
    (out / ".tokpack-work").mkdir(parents=True)
    (out / ".tokpack-work" / "request.json.tmp-123").write_bytes(b'{"inp')
    args[args.index(str(tmp_path / "packed"))] = str(out)
    rerun = CliRunner().invoke(main, args)
    assert rerun.exit_code == 0, rerun.output
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == expected


def test_pack_killed_after_its_manifest_leaves_no_scratch_on_rerun(tmp_path):
    """Found by bench/soak.py (seed 0, 500 kills): a pack killed after writing tokpack.json and
    before removing OUT/.tokpack-work left the scratch folder; the rerun found the pack complete
    and kept it."""
    from click.testing import CliRunner

    from tokpack.packer.cli import main

    docs = random_docs(np.random.default_rng(4), 40, 1000, 0)
    src = write_source(tmp_path / "src", docs)
    out = tmp_path / "packed"
    args = ["pack", *sorted(str(p) for p in src.glob("*.ds")), "-o", str(out), "--eos-id", "0", "--vocab-size", "1000"]
    assert (first := CliRunner().invoke(main, args)).exit_code == 0, first.output
    expected = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    (out / ".tokpack-work" / "part-00000").mkdir(parents=True)
    (out / ".tokpack-work" / "request.json").write_text("{}")
    (out / ".tokpack-work" / "part-00000" / "000_x.ds").write_bytes(b"\0" * 64)
    rerun = CliRunner().invoke(main, args)
    assert rerun.exit_code == 0, rerun.output
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == expected
    assert not (out / ".tokpack-work").exists()
