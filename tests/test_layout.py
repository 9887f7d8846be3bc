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
TOP_PACKAGES = {name.split(".")[0] for name in PACKAGES}
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
        found |= {name.split(".")[0] for name in names} & TOP_PACKAGES
    return found


def test_imports_flow_one_way():
    assert set(ALLOWED) == TOP_PACKAGES
    wrong = []
    for package, allowed in ALLOWED.items():
        for module in sorted((REPO / package).rglob("*.py")):
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
            "import packer.cli, packer.executors, shuffle.run, formats.dir_checks")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO / "bench")
    assert done.returncode == 0, done.stderr[-2000:]


def test_require_skips_only_for_an_absent_tool(tmp_path, monkeypatch):
    """tests/conftest.require: an absent tool skips with its install hint; a tool that is there
    but fails to import, or a tokpack module, is never turned into a skip."""
    from conftest import require

    with pytest.raises(pytest.skip.Exception, match=r"no_such_tool_4f2a is not installed \(apt-get install it\)"):
        require("no_such_tool_4f2a", "apt-get install it")
    (tmp_path / "broken_tool_4f2a").mkdir()
    (tmp_path / "broken_tool_4f2a" / "__init__.py").write_text("import no_such_dependency_4f2a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_4f2a"):
        require("broken_tool_4f2a", "pip install broken-tool")
    for module in ("shuffle.run", "formats"):
        with pytest.raises(ValueError, match="part of tokpack"):
            require(module, "")
    assert require("numpy", "pip install numpy").__name__ == "numpy"


BROAD = {"Exception", "BaseException", "ImportError", "ModuleNotFoundError"}


def test_tests_do_not_skip_on_import_errors():
    """No importorskip and no import guarded by `except Exception`/`except ImportError` that
    returns or skips: a skip must name a missing tool (conftest.require or an explicit reason)."""
    for path in sorted((REPO / "tests").glob("test_*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip":
                assert False, f"{path.name}:{node.lineno}: importorskip skips on any import error; use conftest.require"
            broad = node.type is None or any(isinstance(t, ast.Name) and t.id in BROAD for t in ast.walk(node.type)) \
                if isinstance(node, ast.ExceptHandler) else False
            if broad and isinstance(node.body[0], (ast.Return, ast.Pass)):
                assert False, f"{path.name}:{node.lineno}: an import or any error turned into a silent return"
