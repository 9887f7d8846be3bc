"""The suite reads the project's own files only (issue 43, item 1): a virtual environment made
inside the clone (`python -m venv .venv`, the common habit), a build folder or a venv of another
name holds other projects' Python, possibly in a syntax this Python cannot parse, and a test that
parsed every .py under the checkout failed on it. Every test that reads the source tree lists it
through conftest.project_files; these tests put such folders in a copy of the checkout and run the
scanning tests there."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, project_files

# Newer syntax (PEP 695, Python 3.12) and a Python 2 print, so that it fails to parse on every
# Python 3; "outbox" is a word tests/test_outputs.py looks for in the project's modules.
NEWER = 'def f[T](x):  # outbox\n    return x\n\nprint "no"\n'
# Where a clone holds files that are not the project's: a venv made in it (ignored by
# .gitignore), a venv of another name (not ignored: git would list it), a build's copy of a package.
FOREIGN = {
    ".venv/lib/python3.11/site-packages/newer.py": NEWER,
    ".venv/pyvenv.cfg": "home = /usr/bin\n",
    "tools-env/lib/python3.11/site-packages/newer.py": NEWER,
    "tools-env/pyvenv.cfg": "home = /usr/bin\n",
    "build/lib/tokpack/formats/newer.py": NEWER,
    "build/lib/tokpack/formats/__init__.py": "",
}
# The tests that read the source tree (every file calling project_files is here: see below),
# each a node id or a file with a -k expression.
SCANNING = [
    "tests/test_layout.py",
    "tests/test_newcomer.py::test_a_count_in_a_line_takes_its_plural_never_s_in_parentheses",
    "tests/test_outputs.py::test_only_the_seam_knows_about_the_store_plumbing",
    "tests/test_words.py::test_api_md_lists_every_result_class_with_its_module",
    "tests/test_units.py::test_docs_use_token_units_for_token_counts",
    "tests/test_commands_md.py::test_every_link_into_commands_md_lands_on_a_heading",
]
SLOW = "not test_bench_scripts_see_the_project_packages"  # a subprocess per bench script; lists, never parses


def _git(root: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True, capture_output=True
    )


def _clone(dest: Path, git: bool) -> Path:
    """The checkout's own files copied to dest, plus FOREIGN; a git checkout of them when git."""
    for path in project_files():
        (dest / path.relative_to(REPO)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest / path.relative_to(REPO))
    for name, text in FOREIGN.items():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_text(text)
    if git:
        _git(dest, "init", "-q")
        _git(dest, "add", "-A")
        _git(dest, "commit", "-qm", "clone")
    return dest


def _pytest(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_the_foreign_file_does_not_parse_here():
    """The poison is real: a walker that reached it would stop with a SyntaxError."""
    with pytest.raises(SyntaxError):
        ast.parse(NEWER)


@pytest.mark.parametrize("git", [True, False], ids=["git checkout", "unpacked folder"])
def test_project_files_lists_no_venv_build_or_cache(tmp_path, git):
    """In a git checkout (the venv named other than .venv is tracked there: git add -A took it)
    and in a folder git does not know, the listing is the project's files and nothing else."""
    if git and shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = tmp_path / "clone"
    (root / "formats" / "__pycache__").mkdir(parents=True)
    (root / "formats" / "__init__.py").write_text("")
    (root / "formats" / "__pycache__" / "stale.py").write_text(NEWER)
    (root / "README.md").write_text("tokpack\n")
    (root / ".gitignore").write_text(".venv/\n/build/\n__pycache__/\n")
    for name, text in FOREIGN.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    if git:
        _git(root, "init", "-q")
        _git(root, "add", "-A")
        _git(root, "commit", "-qm", "clone")
        _git(root, "add", "-f", ".venv/lib/python3.11/site-packages/newer.py")  # even a forced add is not ours
        (root / "formats" / "new.py").write_text("x = 1\n")  # new, not yet added: the project's
    listed = {p.relative_to(root).as_posix() for p in project_files(root=root)}
    assert listed == {".gitignore", "README.md", "formats/__init__.py"} | ({"formats/new.py"} if git else set())
    assert [p.name for p in project_files("formats", pattern="*.py", root=root)] == ["__init__.py"] + (
        ["new.py"] if git else []
    )


def test_every_test_that_reads_the_tree_is_run_below():
    """A test file that lists the tree through project_files is one of SCANNING's, so the run in a
    clone with a venv covers it."""
    scanning = {
        p.relative_to(REPO).as_posix()
        for p in project_files("tests", pattern="test_*.py", recursive=False)
        if "project_files(" in p.read_text() and p.name != Path(__file__).name
    }
    assert scanning == {s.split("::")[0] for s in SCANNING}


def test_the_scanning_tests_pass_with_a_venv_inside_the_clone(tmp_path):
    """The issue's case: a clone (a git checkout) holding .venv, a venv of another name and a
    build folder, each with a file of newer syntax: the scanning tests pass there. The same file
    in one of the project's folders fails them, so they do read what they list."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = _clone(tmp_path / "clone", git=True)
    done = _pytest(root, "-k", SLOW, *SCANNING)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]
    (root / "formats" / "newer.py").write_text(NEWER)
    broken = _pytest(root, "tests/test_layout.py::test_imports_flow_one_way")
    assert broken.returncode == 1 and "SyntaxError" in broken.stdout, broken.stdout[-3000:]
