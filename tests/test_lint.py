"""ruff keeps the tree formatted and within its rules (pyproject.toml [tool.ruff]): at most 10
arguments a function, complexity 20, no private name imported from another module."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def ruff(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("ruff")
    if exe is None:
        pytest.fail("ruff is not installed: the test extra pins it (pip install -e '.[test]')")
    return subprocess.run([exe, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_the_tree_is_formatted():
    done = ruff("format", "--check", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_tree_passes_ruff_check():
    done = ruff("check", "--output-format", "concise", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_function_of_eleven_arguments_is_refused(tmp_path):
    """The rules are on: a mutant that widens a signature fails the check under the project's
    own configuration (a file outside the tree, so that the whole-tree checks never see it)."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f(a, b, c, d, e, f, g, h, i, j, k):\n    return a\n")
    done = ruff("check", "--output-format", "concise", "--config", str(REPO / "pyproject.toml"), str(probe))
    assert done.returncode == 1 and "too-many-arguments" in done.stdout, done.stdout
