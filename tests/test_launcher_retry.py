"""tests/conftest.py's run_launching_again and start_job: an MPI job whose launcher failed to
start (Open MPI's exit 213, its PMIx listener) is launched again; anything else, even from
mpirun, is returned as it came (start_job: fails the test), once."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import conftest


def _fake_mpirun(
    tmp_path: Path, failures: int, code: int = 213, text: str = conftest.LAUNCHER_FAILED, then: str = "echo ok"
) -> Path:
    """An executable named mpirun that fails `failures` times (counted in a file), then runs `then`."""
    counter = tmp_path / "count"
    counter.write_text("0")
    exe = tmp_path / "mpirun"
    exe.write_text(
        "#!/bin/sh\n"
        f"n=$(cat {counter}); echo $((n + 1)) > {counter}\n"
        f'if [ "$n" -lt {failures} ]; then echo "{text}" >&2; exit {code}; fi\n'
        f"{then}\n"
    )
    exe.chmod(0o755)
    return exe


def test_a_launcher_that_failed_to_start_is_launched_again(tmp_path):
    exe = _fake_mpirun(tmp_path, failures=2)
    r = subprocess.run([str(exe), "-n", "4"], capture_output=True, text=True)
    assert (r.returncode, r.stdout) == (0, "ok\n")
    assert (tmp_path / "count").read_text().strip() == "3"


def test_any_other_failure_is_the_tests_at_once(tmp_path):
    for code, text in ((1, conftest.LAUNCHER_FAILED), (213, "a process of the job failed")):
        sub = tmp_path / f"{code}"
        sub.mkdir()
        exe = _fake_mpirun(sub, failures=5, code=code, text=text)
        r = subprocess.run([str(exe)], capture_output=True, text=True)
        assert r.returncode == code and (sub / "count").read_text().strip() == "1"


def test_a_background_job_whose_launcher_failed_to_start_is_started_again_and_returned_ready(tmp_path):
    ready = tmp_path / "ready"
    exe = _fake_mpirun(tmp_path, failures=2, then=f"touch {ready}; exec sleep 60")
    job = conftest.start_job([str(exe)], dict(os.environ), ready.exists, "ready")
    try:
        assert job.poll() is None and ready.exists()
        assert (tmp_path / "count").read_text().strip() == "3"
    finally:
        job.kill()
        job.communicate()


@pytest.mark.parametrize(
    ("failures", "code", "text", "launches"),
    [(5, 213, conftest.LAUNCHER_FAILED, "3"), (5, 1, conftest.LAUNCHER_FAILED, "1"), (5, 213, "a process failed", "1")],
)
def test_a_background_job_that_ends_before_it_is_ready_fails_the_test_with_its_stderr(
    tmp_path, failures, code, text, launches
):
    exe = _fake_mpirun(tmp_path, failures=failures, code=code, text=text)
    with pytest.raises(pytest.fail.Exception) as failed:
        conftest.start_job([str(exe)], dict(os.environ), (tmp_path / "never").exists, "the lock")
    assert f"the lock: the job ended (exit {code})" in str(failed.value) and text in str(failed.value)
    assert (tmp_path / "count").read_text().strip() == launches


@pytest.fixture(scope="module")
def bench_common():
    """bench/common.py as a module, with the repository on sys.path only while importing it."""
    saved = list(sys.path)
    sys.path.insert(0, str(conftest.REPO))
    try:
        return importlib.import_module("bench.common")
    finally:
        sys.path[:] = saved


def test_a_benchmarks_launcher_that_failed_to_start_is_launched_again_and_measured_once(tmp_path, bench_common):
    """run_all --quick (in .ci/run) times mpirun through bench/common.run_measured: a launcher
    that failed to start is launched again there too, told by the same exit status and text."""
    assert (bench_common.LAUNCHER_EXIT, bench_common.LAUNCHER_FAILED) == (213, conftest.LAUNCHER_FAILED)
    exe = _fake_mpirun(tmp_path, failures=2)
    m = bench_common.run_measured(f"{exe} -n 4", cold=False)
    assert m.returncode == 0 and (tmp_path / "count").read_text().strip() == "3"


@pytest.mark.parametrize(
    ("code", "text", "launches"),
    [(213, conftest.LAUNCHER_FAILED, "3"), (1, conftest.LAUNCHER_FAILED, "1"), (213, "a process failed", "1")],
)
def test_a_benchmarks_job_that_keeps_failing_is_its_error_with_the_launchers_stderr(
    tmp_path, bench_common, code, text, launches
):
    exe = _fake_mpirun(tmp_path, failures=5, code=code, text=text)
    with pytest.raises(RuntimeError) as failed:
        bench_common.run_measured(str(exe), cold=False)
    assert f"failed with {code}" in str(failed.value) and text in str(failed.value)
    assert (tmp_path / "count").read_text().strip() == launches
