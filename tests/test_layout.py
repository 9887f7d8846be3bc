"""The project's layout rules: data flows packer -> shuffle -> formats, and the bench scripts,
which run with bench/ first on sys.path, never hide a project package."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

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


def test_bench_scripts_do_not_shadow_project_packages():
    stems = {p.stem for p in (REPO / "bench").glob("*.py")}
    assert stems.isdisjoint(PACKAGES), stems & set(PACKAGES)
    # As the bench scripts see it: bench/ first on sys.path, then the whole CLI imported.
    code = (f"import sys; sys.path[:0] = [{str(REPO / 'bench')!r}, {str(REPO)!r}]\n"
            "import packer.cli, packer.executors, shuffle.engine, formats.validate")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO / "bench")
    assert done.returncode == 0, done.stderr
