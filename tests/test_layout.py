"""The project's layout rules: data flows packer -> shuffle -> formats, and the bench scripts
import the project's packages, not their namesakes in bench/."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
ALLOWED = {"formats": set(), "shuffle": {"formats"}, "packer": {"formats", "shuffle"}}


def project_imports(path: Path) -> set[str]:
    """The project packages a module imports, at any depth (lazy imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found |= {name.split(".")[0] for name in names} & set(PACKAGES)
    return found


def test_imports_flow_one_way():
    assert set(ALLOWED) == set(PACKAGES)
    wrong = []
    for package, allowed in ALLOWED.items():
        for module in sorted((REPO / package).glob("*.py")):
            extra = project_imports(module) - allowed - {package}
            if extra:
                wrong.append(f"{module.relative_to(REPO)} imports {sorted(extra)}")
    assert not wrong, wrong


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "bench").glob("*.py")))
def test_bench_scripts_see_the_project_packages(script):
    """Run as `python bench/X.py`, Python puts bench/ first on sys.path, where bench/shuffle.py
    would hide the shuffle package; each script must take bench/ off the path itself."""
    code = (f"import runpy, sys; sys.path[0] = {str(REPO / 'bench')!r}\n"
            f"runpy.run_path({str(REPO / 'bench' / script)!r}, run_name='bench_script')\n"
            "import packer.cli, packer.executors, shuffle.engine, formats.validate")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO / "bench")
    assert done.returncode == 0, done.stderr[-2000:]
