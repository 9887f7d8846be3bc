"""Under --json a failure's hint is in `"hint"` (issue 43), whatever failed: a value click
refused through tokpack's parser of quantities, a missing module, Ctrl-C. The one line on
stderr stays the line a human reads: `message. HINT: hint`."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

import tokpack.packer.api
from conftest import random_docs, write_source
from tokpack.packer.cli import main


def failed(*args) -> tuple[int, dict | None, str]:
    r = CliRunner().invoke(main, [str(a) for a in args])
    out = r.stdout.strip()
    return r.exit_code, json.loads(out)["error"] if out else None, r.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_source(tmp_path_factory.mktemp("hint") / "src", random_docs(np.random.default_rng(1), 40, 1000, 0))


CASES = {
    "pack --shard-tokens 1GiB": lambda s, t: ["pack", s, "-o", t / "p", "--shard-tokens", "1GiB"],
    "shuffle --memory lots": lambda s, t: [
        "shuffle",
        s,
        "-o",
        t / "r",
        "--seq-len",
        15,
        "--seed",
        1,
        "--epochs",
        1,
        "--memory",
        "lots",
    ],
    "read --consumed-tokens 1GiB": lambda s, t: ["read", s, "--consumed-tokens", "1GiB"],
    "inspect --memory 5 apples": lambda s, t: ["inspect", s, "--memory", "5 apples"],
}


@pytest.mark.parametrize("case", CASES)
def test_a_quantity_refused_by_click_has_its_hint_in_hint(case, source, tmp_path):
    args = CASES[case](source, tmp_path)
    code, error, _ = failed(*args, "--json")
    code_human, none, line = failed(*args)
    assert code == code_human == 2 and none is None
    assert error["hint"] and "HINT" not in error["message"], error
    assert line == f"Error: {error['message']}. HINT: {error['hint']}"  # the human line, as before


USAGE_ERRORS = {  # click's own refusals: (arguments, the option at fault or None)
    "missing argument": (["validate"], None),
    "missing option": (["pack", "in"], "--output"),
    "no such option": (["stage", "a", "b", "--bogus"], None),
    "not an integer": (["shuffle", "s", "-o", "r", "--seq-len", "abc", "--seed", 1, "--epochs", 1], "--seq-len"),
    "not a choice": (["pack", "in", "-o", "out", "--executor", "slurmm"], "--executor"),
    "a usage check": (["shuffle", "s", "--seq-len", 5, "--seed", 1, "--epochs", 1], None),
}


@pytest.mark.parametrize("case", USAGE_ERRORS)
def test_a_usage_error_says_what_to_do_in_hint_and_names_its_option(case):
    """A usage error's JSON had "hint": null where its line says "Try '... --help' for help.",
    and no "where" for the option click refused (tokpack's own errors name it there)."""
    args, option = USAGE_ERRORS[case]
    code, error, _ = failed(*args, "--json")
    assert code == 2 and error["hint"] == f"see `main {args[0]} --help`", error
    assert error["where"] == option and "HINT" not in error["message"], error


@pytest.mark.parametrize(
    "raised,message,hint,code",
    [
        (KeyboardInterrupt(), "interrupted", "rerun the same command to resume", 130),
        (
            ModuleNotFoundError("no s3fs", name="s3fs"),
            "this command needs the module 's3fs', which is not installed",
            "pip install s3fs",
            1,
        ),
    ],
)
def test_validate_interrupted_or_missing_a_module_has_its_hint_in_hint(
    raised, message, hint, code, source, monkeypatch
):
    def validate(*args, **kw):
        raise raised

    monkeypatch.setattr(tokpack.packer.api, "validate", validate)
    got, error, line = failed("validate", source, "--json")
    assert got == code
    assert (error["message"], error["hint"]) == (message, hint)
    expected = {
        130: "tokpack: interrupted; rerun the same command to resume",
        1: "tokpack: error: this command needs the module 's3fs', which is not installed. HINT: pip install s3fs",
    }
    assert line == expected[code]  # the human line is the one it always was


# Ctrl-C while the command's modules load (the first ~0.2 s), before the command's own handler:
# the import is made to raise it, as SIGINT would there.
_STOPPED_LOADING = """
import sys
class Stop:
    def find_spec(self, name, path=None, target=None):
        if name == "tokpack.packer.cli":
            raise KeyboardInterrupt
sys.meta_path.insert(0, Stop())
sys.argv = ["tokpack", *sys.argv[1:]]
from tokpack.__main__ import main
main()
"""


@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_while_the_command_loads_is_one_line_no_traceback(as_json, tmp_path):
    import subprocess
    import sys

    args = ["validate", str(tmp_path), *(["--json"] if as_json else [])]
    r = subprocess.run([sys.executable, "-c", _STOPPED_LOADING, *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 130
    assert r.stderr == "tokpack: interrupted before the command began; nothing was written\n"
    if as_json:
        out = json.loads(r.stdout)
        assert out["ok"] is False and out["error"]["error"] == "KeyboardInterrupt"
    else:
        assert r.stdout == ""


def test_the_console_script_is_the_guarded_launcher():
    import tomllib
    from pathlib import Path

    scripts = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["tokpack"] == "tokpack.__main__:main"


_BLAS_THREADS = """
import os, sys
sys.argv = ["tokpack", "--version"]
from tokpack.__main__ import main
try:
    main()
except SystemExit:
    pass
print(os.environ.get("OPENBLAS_NUM_THREADS"), file=sys.stderr)
"""


@pytest.mark.parametrize("given, kept", [(None, "1"), ("4", "4")])
def test_the_command_starts_no_blas_pool_unless_the_user_asks(given, kept):
    """The console script sets OPENBLAS_NUM_THREADS=1 before numpy loads (the command does no
    linear algebra; an idle pool's threads cost about 0.1 s of CPU a process, times every MPI
    process), and keeps a value the user set."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if given is not None:
        env["OPENBLAS_NUM_THREADS"] = given
    r = subprocess.run([sys.executable, "-c", _BLAS_THREADS], capture_output=True, text=True, env=env, timeout=60)
    assert r.stderr.strip().splitlines()[-1] == kept, r.stderr
