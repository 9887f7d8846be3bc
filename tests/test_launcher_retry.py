"""tests/conftest.py's run_launching_again: an MPI job whose launcher failed to start (Open
MPI's exit 213, its PMIx listener) is launched again; anything else, even from mpirun, is
returned as it came, once."""

from __future__ import annotations

import subprocess
from pathlib import Path

import conftest


def _fake_mpirun(tmp_path: Path, failures: int, code: int = 213, text: str = conftest.LAUNCHER_FAILED) -> Path:
    """An executable named mpirun that fails `failures` times (counted in a file), then prints ok."""
    counter = tmp_path / "count"
    counter.write_text("0")
    exe = tmp_path / "mpirun"
    exe.write_text(
        "#!/bin/sh\n"
        f"n=$(cat {counter}); echo $((n + 1)) > {counter}\n"
        f'if [ "$n" -lt {failures} ]; then echo "{text}" >&2; exit {code}; fi\n'
        "echo ok\n"
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
