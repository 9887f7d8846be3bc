"""The project's layout rules: data flows packer -> shuffle -> formats and packer -> loader ->
formats, and the bench scripts import the project's packages, not their namesakes in bench/."""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import project_files

REPO = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
PACKAGES = SETUPTOOLS["packages"]
FOLDERS = SETUPTOOLS["package-dir"]  # installed name -> folder in the repository
# The subpackages under the one `tokpack.` namespace, by their short name (formats, shuffle, ...)
TOP_PACKAGES = {name.split(".")[1] for name in PACKAGES if name.count(".") == 1}
# loader/ is what a trainer imports (the reader, the slice reader, the torch adapter): the format
# only. packer's commands use it (`read`, `inspect`); shuffle does not.
ALLOWED = {"formats": set(), "loader": {"formats"}, "shuffle": {"formats"}, "packer": {"formats", "shuffle", "loader"}}


def subpackage(name: str) -> str | None:
    """`tokpack.formats.io` -> `formats`; None for a name outside tokpack's subpackages."""
    parts = name.split(".")
    return parts[1] if parts[0] == "tokpack" and len(parts) > 1 and parts[1] in TOP_PACKAGES else None


def project_imports(path: Path) -> set[str]:
    """The project subpackages a module imports, at any depth (lazy imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found |= {subpackage(name) for name in names} - {None}
    return found


def test_everything_installs_under_one_namespace():
    """Nothing lands in site-packages as a top-level formats, shuffle or packer: every package is
    tokpack or under it, each mapped from the layout's folder of the same name."""
    assert all(name == "tokpack" or name.startswith("tokpack.") for name in PACKAGES), PACKAGES
    assert {name: FOLDERS[name] for name in FOLDERS if name != "tokpack"} == {f"tokpack.{p}": p for p in TOP_PACKAGES}
    for name in PACKAGES:  # a subpackage of a mapped one (formats.inputs) is its folder's subfolder
        top = ".".join(name.split(".")[:2])
        folder = REPO / FOLDERS[top] / Path(*name.split(".")[2:])
        assert (folder / "__init__.py").is_file(), name
    for folder in sorted(TOP_PACKAGES):  # every package folder in the tree is listed
        for init in project_files(folder, pattern="__init__.py"):
            dotted = ".".join(("tokpack",) + init.parent.relative_to(REPO).parts)
            assert dotted in PACKAGES, f"{init.parent.relative_to(REPO)} is not in pyproject's packages"


def test_no_module_imports_the_old_top_level_names():
    """`from formats...` would find PyPI's `formats` (or nothing) once installed: every absolute
    import of the project's code goes through `tokpack.`."""
    wrong = []
    trees = (*TOP_PACKAGES, "tokpack", "tests", "bench", "examples", "scripts")
    for path in project_files(*trees, pattern="*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                else []
            )
            wrong += [
                f"{path.relative_to(REPO)}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in TOP_PACKAGES
            ]
    assert not wrong, wrong


def test_imports_flow_one_way():
    assert set(ALLOWED) == TOP_PACKAGES
    wrong = []
    for package, allowed in ALLOWED.items():
        for module in project_files(package, pattern="*.py"):
            extra = project_imports(module) - allowed - {package}
            if extra:
                wrong.append(f"{module.relative_to(REPO)} imports {sorted(extra)}")
    assert not wrong, wrong


# Issue 40: a module of one idea stays readable whole; past this, it holds two and is split by idea.
MOST_LINES = 700


def test_no_product_module_is_over_its_line_bound():
    long = []
    for package in ALLOWED:
        for module in project_files(package, pattern="*.py"):
            lines = len(module.read_text().splitlines())
            if lines > MOST_LINES:
                long.append(f"{module.relative_to(REPO)}: {lines} lines")
    assert not long, long


def test_format_layer_has_no_logging_or_executor_dependency():
    """formats/ is the file format: reading and writing it needs neither datatrove nor loguru
    (their logging set-up lives with the steps that import datatrove, shuffle/sinks.py); nor does
    loader/, which a trainer imports."""
    wrong = []
    for module in project_files("formats", "loader", pattern="*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module
                else []
            )
            wrong += [
                f"{module.relative_to(REPO)} imports {n}" for n in names if n.split(".")[0] in ("datatrove", "loguru")
            ]
    assert not wrong, wrong


def test_packages_register_nothing_on_import():
    """A package's __init__ imports only what it exports: no module is imported for a side effect
    (formats/__init__.py once imported slices so that the slice reader registered itself), and
    importing the format imports no slice code and no loader. Readers are found through
    tokpack.loader.reader's READERS, each a SampleReader of the loader package."""
    for folder in sorted(TOP_PACKAGES):
        init = REPO / folder / "__init__.py"
        tree = ast.parse(init.read_text())
        exported = next(
            (
                ast.literal_eval(n.value)
                for n in tree.body
                if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in n.targets)
            ),
            [],
        )
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("tokpack")):
                unused = [a.asname or a.name for a in node.names if (a.asname or a.name) not in exported]
                assert not unused, f"{folder}/__init__.py imports {unused} without exporting them"
            assert not (isinstance(node, ast.Import) and any(a.name.startswith("tokpack") for a in node.names)), (
                f"{folder}/__init__.py:{node.lineno} imports a module for its side effect"
            )
    code = (
        "import sys, tokpack.formats\n"
        "print(sorted(m for m in sys.modules if m.startswith(('tokpack.loader', 'tokpack.formats.slices'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0 and done.stdout.split() == ["[]"], done.stderr[-2000:] or done.stdout
    from tokpack.loader.reader import READERS, SampleReader, reader_class

    for kind, (module, _) in READERS.items():
        assert module.startswith("tokpack.loader.") and issubclass(reader_class(kind), SampleReader), kind


def project_modules() -> dict[str, Path]:
    """Every module of the project's packages by dotted name (a package by its own name)."""
    modules = {}
    for package in sorted(TOP_PACKAGES):
        for path in project_files(package, pattern="*.py"):
            parts = ("tokpack",) + path.relative_to(REPO).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def module_imports(name: str, path: Path, modules) -> set[str]:
    """The project modules `name` imports: at the top, in a function, or under TYPE_CHECKING
    (a lazy import still ties the two modules together: a cycle through one is a cycle).
    `from P import m` counts as importing the module P.m when there is one, else P."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names} & set(modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found |= {target} if target in modules else {base} & set(modules)
    return found - {name}


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: module_imports(name, path, modules) for name, path in modules.items()}


def test_module_imports_have_no_cycle():
    """No two project modules import each other, directly or round a circle, lazily or not: the
    shared types live in a leaf (tokpack.packer.shared) that the API and its stages both import."""
    try:
        list(graphlib.TopologicalSorter(import_graph()).static_order())
    except graphlib.CycleError as cycle:
        assert False, f"import cycle: {' -> '.join(reversed(cycle.args[1]))}"


def _defined_at_top(path: Path) -> tuple[set[str], set[str]]:
    """The names a module defines itself (def, class, assignment) and those it only imports."""
    defined, imported = set(), set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            imported |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return defined, imported - defined


def borrowed_names(modules: dict[str, Path], root: Path = REPO) -> list[str]:
    """`from M import x` (or `from .M import x`) where module M only imports x: the name has a
    home elsewhere, and a reader (or the next change) following it lands in a module that does
    not hold it."""
    found = []
    for name, path in sorted(modules.items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            source = modules.get(base)
            if source is None or source.name == "__init__.py":  # a package may gather its names
                continue
            _, only_imported = _defined_at_top(source)
            for alias in node.names:
                if alias.name in only_imported:
                    found.append(f"{path.relative_to(root)}:{node.lineno} takes {alias.name} through {base}")
    return found


def test_each_name_is_imported_from_its_home():
    """A name is imported from the module that defines it, not through one that imports it."""
    assert borrowed_names(project_modules()) == []


def test_the_home_check_sees_a_borrowed_name(tmp_path):
    (tmp_path / "pkg").mkdir()
    files = {
        "tokpack.home": ("home.py", "def f():\n    pass\n"),
        "tokpack.middle": ("middle.py", "from tokpack.home import f\n\n\ndef g():\n    return f()\n"),
        "tokpack.user": ("user.py", "from tokpack.middle import f, g\n"),
        "tokpack.pkg.near": ("pkg/near.py", "from tokpack.home import f\n"),
        "tokpack.pkg.rel": ("pkg/rel.py", "from .near import f\n"),
    }
    for rel, text in files.values():
        (tmp_path / rel).write_text(text)
    modules = {name: tmp_path / rel for name, (rel, _) in files.items()}
    assert borrowed_names(modules, tmp_path) == [
        "pkg/rel.py:1 takes f through tokpack.pkg.near",
        "user.py:1 takes f through tokpack.middle",
    ]


def test_import_graph_sees_lazy_and_relative_imports():
    """The graph the cycle check walks holds the imports a cycle could hide in."""
    graph = import_graph()
    assert "tokpack.packer.shared" in graph["tokpack.packer.api"]  # top-level `from X import Y`
    assert "tokpack.packer.executors" in graph["tokpack.packer.api"]  # an import inside a function
    assert "tokpack.packer.lifetime" in graph["tokpack.packer.executors"]  # `from packer import lifetime`: the module
    assert "tokpack.formats.io.reads" in graph["tokpack.formats.inputs"]  # relative, in a package's __init__
    assert "tokpack.formats.errors" in graph["tokpack.formats.units"]  # relative, in a module
    assert graph["tokpack.packer.shared"] == set()
    assert "tokpack.loader.reader" in graph["tokpack.loader.slice_reader"]  # relative, in the loader


@pytest.mark.parametrize("script", [p.name for p in project_files("bench", pattern="*.py", recursive=False)])
def test_bench_scripts_see_the_project_packages(script):
    """Run as `python bench/X.py`, Python puts bench/ first on sys.path, where bench/shuffle.py
    would hide the shuffle package; each script must take bench/ off the path itself."""
    code = (
        f"import runpy, sys; sys.path[0] = {str(REPO / 'bench')!r}\n"
        f"runpy.run_path({str(REPO / 'bench' / script)!r}, run_name='bench_script')\n"
        "import tokpack.packer.cli, tokpack.packer.executors, tokpack.shuffle.run, tokpack.packer.validation"
    )
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
    for module in ("tokpack.shuffle.run", "tokpack.formats", "tokpack"):
        with pytest.raises(ValueError, match="part of tokpack"):
            require(module, "")
    assert require("numpy", "pip install numpy").__name__ == "numpy"


BROAD = {"Exception", "BaseException", "ImportError", "ModuleNotFoundError"}


def test_tests_do_not_skip_on_import_errors():
    """No importorskip and no import guarded by `except Exception`/`except ImportError` that
    returns or skips: a skip must name a missing tool (conftest.require or an explicit reason)."""
    for path in project_files("tests", pattern="test_*.py", recursive=False):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip":
                assert False, f"{path.name}:{node.lineno}: importorskip skips on any import error; use conftest.require"
            broad = (
                node.type is None or any(isinstance(t, ast.Name) and t.id in BROAD for t in ast.walk(node.type))
                if isinstance(node, ast.ExceptHandler)
                else False
            )
            if broad and isinstance(node.body[0], (ast.Return, ast.Pass)):
                assert False, f"{path.name}:{node.lineno}: an import or any error turned into a silent return"


# ------------------------------------------------------------------ every open goes through the gate

# tokpack.formats.io's modules that open files: the gate (docs/COMMANDS.md, "The gate") and the
# durable writers (each opens only the file it writes). io's other modules are checked as any other.
GATE_MODULES = {"formats/io/gate.py", "formats/io/writes.py"}
# Calls that open a file by name, whatever the receiver is called (`np` and `numpy` alike).
OPENERS = {
    "open",
    "os.open",
    "os.fdopen",
    "io.open",
    "builtins.open",
    "np.fromfile",
    "numpy.fromfile",
    "np.memmap",
    "numpy.memmap",
    "np.load",
    "numpy.load",
    "mmap.mmap",
    "gzip.open",
    "bz2.open",
    "lzma.open",
}
# Methods that read a file whatever object they are called on: pathlib's (a Path receiver cannot
# be told from another statically, so any receiver counts), and `.open` on anything that is not
# a class (SampleReader.open, PackedSource.open and PackedTable.open construct tokpack's readers).
READING_METHODS = {"read_bytes", "read_text", "open"}
# What may open a file outside the gate, each with why it is not a dataset file (or is gated already).
GATE_ALLOWED = {
    ("packer/cli_report.py", "open"): "the CLI's crash log in $TOKPACK_LOG_DIR, written by tokpack for the user",
    ("packer/cli_report.py", "os.open"): "/dev/null, put under stdout once its reader closed it (`| head`): no file",
    ("packer/executors.py", "logging_dir.open"): "datatrove's folder of an executor's own task logs",
    ("packer/executors.py", "folder.open"): "datatrove's folders: an executor's completion markers, and the remote "
    "side of a download (the local copy is then read through the gate)",
    ("packer/executors.py", "fs.open"): "the remote side of a download (an fsspec object, not a local file)",
    ("packer/stage_plan.py", "self.open"): "stage_plan.Source.open, which opens through the gate",
    ("packer/staging.py", "self.src.open"): "staging.Source.open, which opens through the gate",
    ("formats/inputs/jsonl.py", "gzip.open"): "decompresses a stream the gate opened (its argument is a file object)",
    ("formats/io/memory.py", "mmap.mmap"): "an anonymous mapping (descriptor -1): memory, no file",
    ("loader/handoff.py", "os.open"): "a batch's buffer in /dev/shm (shared memory, made by a DataLoader worker "
    "and opened by the training process by its name): memory, no dataset file",
    ("formats/io/paths.py", "self.read_bytes"): "RemotePath.read_text over its read_bytes: an object in a bucket",
    ("formats/io/progress_log.py", "_LOG_LINES.open"): "the progress log's registry of open bars, no file",
}


def ungated_opens(path: Path, source: str | None = None) -> list[str]:
    """The calls in a product module that open a file outside the gate, as 'file:line call'.
    Enforceable statically: calls of the names in OPENERS, and of READING_METHODS on any
    receiver but a class; a call whose first argument is a literal /proc/ path (a process's
    own status, not a dataset file) is fine. Not enforceable: opens done by C code given a
    path (pyarrow; the inputs pass it a file the gate opened) or hidden behind a variable
    bound to `open`."""
    rel = path.relative_to(REPO).as_posix()
    found = []
    for node in ast.walk(ast.parse(source if source is not None else path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        method = node.func.attr if isinstance(node.func, ast.Attribute) else None
        if name not in OPENERS and method not in READING_METHODS:
            continue
        if method == "open" and isinstance(node.func.value, ast.Name) and node.func.value.id[:1].isupper():
            continue  # a class's constructor (SampleReader.open ...)
        first = node.args[0] if node.args else None
        literal = (
            first.value
            if isinstance(first, ast.Constant)
            else first.values[0].value
            if isinstance(first, ast.JoinedStr) and first.values and isinstance(first.values[0], ast.Constant)
            else None
        )
        if isinstance(literal, str) and literal.startswith("/proc/"):
            continue
        if (rel, name) in GATE_ALLOWED:
            continue
        found.append(f"{rel}:{node.lineno} {name}(...)")
    return found


def product_modules() -> list[Path]:
    """Every module of the installed subpackages (formats, shuffle, packer and any added later)
    but the gate's own."""
    return sorted(
        p for p in project_files(*TOP_PACKAGES, pattern="*.py") if p.relative_to(REPO).as_posix() not in GATE_MODULES
    )


def test_every_open_of_a_file_goes_through_the_gate():
    """Product code opens files only through tokpack.formats.io (containment, regular files,
    the recorded size: docs/COMMANDS.md, "The gate"); the allowed exceptions are not dataset
    files, each with its reason in GATE_ALLOWED."""
    wrong = [hit for module in product_modules() for hit in ungated_opens(module)]
    assert not wrong, (
        "open these through tokpack.formats.io (open_read, read_array, map_file, read_limited, "
        f"regular_fd, open_append, open_new) or allow them in GATE_ALLOWED with a reason: {wrong}"
    )
    assert all((REPO / m).is_file() for m in GATE_MODULES)
    used = {
        (m.relative_to(REPO).as_posix(), ast.unparse(n.func))
        for m in product_modules()
        for n in ast.walk(ast.parse(m.read_text()))
        if isinstance(n, ast.Call)
    }
    assert set(GATE_ALLOWED) <= used, f"allowed but no longer there (remove them): {set(GATE_ALLOWED) - used}"


@pytest.mark.parametrize(
    "stray",
    [
        "open(path, 'rb')",
        "np.fromfile(f, dtype='<u8')",
        "os.open(p, os.O_RDONLY)",
        "mmap.mmap(fd, 0)",
        "Path(p).read_bytes()",
        "p.read_text()",
        "p.open('rb')",
        "numpy.memmap(f)",
        "open(f'/tmp/{x}')",
    ],
)
@pytest.mark.parametrize("rel", ["shuffle/steps.py", "formats/io/reads.py"])
def test_the_gate_check_sees_a_stray_open(stray, rel):
    """The check catches each kind of open it claims to, in any product module, io's own modules
    but the gate and the writers included."""
    module = REPO / rel
    assert module in product_modules() and ungated_opens(module, module.read_text()) == []
    hits = ungated_opens(module, module.read_text() + f"\n\ndef stray(p, f, fd, x):\n    return {stray}\n")
    assert len(hits) == 1 and hits[0].startswith(f"{rel}:"), hits
