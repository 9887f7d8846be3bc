"""The trust boundary of what a manifest names (docs/COMMANDS.md, "Containment"): every name
stays inside its dataset's folder, only regular files are opened, and a manifest is parsed
strictly and bounded by every command, which then refuses what `validate` calls CORRUPT.

Each case runs real `tokpack` processes with an audit hook (`sys.addaudithook`) that records
every `open` of a file under the outside folder, so "refused" also means "never opened"."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import random_docs, require, shuffle_run, write_source
from probes import default_sigint
from tokpack.formats.errors import TokpackError
from tokpack.formats.constants import LOCK_NAME
from tokpack.formats.constants import MANIFEST
from tokpack.formats.names import epoch_dir_name
from tokpack.loader.reader import SampleReader

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 60  # a refusal takes a second; a command blocked on a FIFO would take forever

# The CLI with an audit hook: each `open` of a path under $WATCH is written to $SEEN at exit.
PROBE = """
import atexit, json, os, sys
watch, seen = os.path.realpath(os.environ["WATCH"]), []
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.realpath(os.fsdecode(args[0]))
        if path == watch or path.startswith(watch + os.sep):
            seen.append(path)
sys.addaudithook(hook)
atexit.register(lambda: open(os.environ["SEEN"], "w").write(json.dumps(seen)))
from tokpack.packer.cli import main
main()
"""


def tokpack(tmp_path: Path, *args, watch: Path | None = None) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Runs `tokpack ARGS`; returns the process and the files under `watch` it opened."""
    seen = tmp_path / f"seen-{len(list(tmp_path.glob('seen-*')))}.json"
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        TOKPACK_LOG_DIR=str(tmp_path / "crash-logs"),
        WATCH=str(watch or tmp_path / "nothing-watched"),
        SEEN=str(seen),
    )
    r = subprocess.run(
        [sys.executable, "-c", PROBE, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=TIMEOUT,
    )
    return r, json.loads(seen.read_text()) if seen.exists() else []


def in_process(tmp_path: Path, *args) -> subprocess.CompletedProcess:
    """`tokpack ARGS` through click's runner in this process (no audit hook: for cases that
    check only the exit status and what is said), as a CompletedProcess; an exception that
    escaped the command is a bug, reported as exit 70 with its traceback."""
    import traceback

    from click.testing import CliRunner

    from tokpack.packer.cli import main

    r = CliRunner().invoke(main, [str(a) for a in args], env={"TOKPACK_LOG_DIR": str(tmp_path / "crash-logs")})
    code, err = r.exit_code, r.stderr
    if r.exc_info is not None and not isinstance(r.exception, SystemExit):
        code, err = 70, err + "".join(traceback.format_exception(*r.exc_info))
    return subprocess.CompletedProcess(args, code, r.stdout, err)


def one_line(r: subprocess.CompletedProcess) -> str:
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    return lines[0]


def corrupt(r: subprocess.CompletedProcess) -> str:
    """validate's report: exit 1 and at least one CORRUPT line; returns the report."""
    assert r.returncode == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    assert "CORRUPT" in r.stderr and "internal error" not in r.stderr, r.stderr
    return r.stderr


def edit(directory: Path, fn) -> None:
    m = json.loads((directory / MANIFEST).read_text())
    fn(m)
    (directory / MANIFEST).write_text(json.dumps(m))


@pytest.fixture(scope="module")
def pristine_data(tmp_path_factory) -> Path:
    """`data`'s three folders, made once for the module; tests get copies."""
    base = tmp_path_factory.mktemp("containment-data")
    src = write_source(base / "src", random_docs(np.random.default_rng(5), 150, 1000, 0))
    run = base / "run"
    shuffle_run([str(src)], str(run), seq_len=31, seed=1, epochs=[0], shard_samples=40, memory=8 << 20, log=None)
    outside = base / "outside"
    outside.mkdir()
    shutil.copy(src / "00000.ds", outside / "x.ds")
    epoch = run / epoch_dir_name(0)
    shutil.copy(epoch / "00000.ds", outside / "e.ds")
    for suffix in (".index", ".metadata"):
        shutil.copy(src / f"00000.ds{suffix}", outside / f"x.ds{suffix}")
        shutil.copy(epoch / f"00000.ds{suffix}", outside / f"e.ds{suffix}")
    return base


@pytest.fixture
def data(pristine_data, tmp_path):
    """A 3-shard source, a run of one epoch shuffled from it, and an `outside` folder holding a
    copy of shard 0 of each (same bytes, same size): what a hostile manifest would point at.
    A copy of the module's, in this test's folder; the run's manifests name this copy's source."""
    old, new = json.dumps(str(pristine_data))[1:-1], json.dumps(str(tmp_path))[1:-1]
    for name in ("src", "run", "outside"):
        shutil.copytree(pristine_data / name, tmp_path / name)
    for f in (tmp_path / "run").rglob("*.json"):
        f.write_text(f.read_text().replace(old, new))
    assert str(pristine_data) not in "".join(f.read_text() for f in tmp_path.rglob("*.json"))
    return tmp_path / "src", tmp_path / "run", tmp_path / "outside"


def _set_shard_path(directory: Path, path: str) -> None:
    edit(directory, lambda m: m["shards"][0].__setitem__("path", path))


# ---------------------------------------------------------------- names out of the folder


def test_source_shard_path_climbing_out_is_refused_by_shuffle_and_inspect(data, tmp_path):
    src, _, outside = data
    _set_shard_path(src, "../outside/x.ds")
    for args in (
        ["shuffle", src, "-o", tmp_path / "out", "--seq-len", 31, "--seed", 1, "--epochs", 1],
        ["inspect", src],
    ):
        r, opened = tokpack(tmp_path, *args, watch=outside)
        line = one_line(r)
        assert "[shards[0].path]" in line and "'../outside/x.ds'" in line and "HINT" in line, line
        assert opened == [], opened  # refused before the outside file was opened
    assert not (tmp_path / "out" / epoch_dir_name(0)).exists()


def test_epoch_shard_path_absolute_is_refused_by_read_and_the_reader(data, tmp_path):
    _, run, outside = data
    epoch = run / epoch_dir_name(0)
    _set_shard_path(epoch, str(outside / "e.ds"))
    for args in (["read", run], ["read", run, "--verify"], ["read", epoch, "--verify"]):
        r, opened = tokpack(tmp_path, *args, watch=outside)
        line = one_line(r)
        assert "[shards[0].path]" in line and "an absolute path" in line, line
        assert opened == [], opened
    for path in (run, epoch):
        with pytest.raises(TokpackError, match=r"\[shards\[0\]\.path\]"):
            SampleReader.open(path, verify=True)
    require("torch", "pip install torch")
    from tokpack.loader.torch_adapter import TokpackDataset

    with pytest.raises(TokpackError, match=r"\[shards\[0\]\.path\]"):
        TokpackDataset(run)


def test_validate_reports_a_path_out_as_corrupt_without_opening_it(data, tmp_path):
    src, run, outside = data
    _set_shard_path(src, "../outside/x.ds")
    _set_shard_path(run / epoch_dir_name(0), str(outside / "e.ds"))
    for target in (src, run):
        r, opened = tokpack(tmp_path, "validate", target, "--workers", 2, watch=outside)
        report = corrupt(r)
        assert "[shards[0].path]" in report, report
        assert opened == [], opened  # neither opened nor hashed


def test_symlinked_shard_pointing_outside_is_refused(data, tmp_path):
    src, run, outside = data
    (src / "00000.ds").unlink()
    (src / "00000.ds").symlink_to(outside / "x.ds")
    epoch = run / epoch_dir_name(0)
    (epoch / "00000.ds.index").unlink()
    (epoch / "00000.ds.index").symlink_to(outside / "e.ds.index")  # a sibling file counts too
    for args in (
        ["shuffle", src, "-o", tmp_path / "out", "--seq-len", 31, "--seed", 1, "--epochs", 1],
        ["inspect", src],
        ["stage", src, tmp_path / "dest"],
        ["read", run, "--verify"],
        ["stage", run, tmp_path / "dest2"],
    ):
        r, opened = tokpack(tmp_path, *args, watch=outside)
        line = one_line(r)
        assert "a symlink to" in line and "outside the folder" in line, line
        assert opened == [], (args, opened)
    r, opened = tokpack(tmp_path, "validate", src, run, watch=outside)
    assert "a symlink to" in corrupt(r) and opened == []


def test_symlinked_epoch_directory_pointing_outside_is_refused(data, tmp_path):
    _, run, _ = data
    elsewhere = tmp_path / "elsewhere"
    shutil.move(run / epoch_dir_name(0), elsewhere)
    (run / epoch_dir_name(0)).symlink_to(elsewhere)
    for args in (["read", run], ["stage", run, tmp_path / "dest"]):
        r, opened = tokpack(tmp_path, *args, watch=elsewhere)
        assert "[epochs (" in one_line(r) and opened == [], (r.stderr, opened)
    r, opened = tokpack(tmp_path, "validate", run, watch=elsewhere)
    assert "outside the folder" in corrupt(r) and opened == []


def test_symlink_inside_the_dataset_is_fine(data, tmp_path):
    """A shard that is a symlink to a file elsewhere in its own folder is still inside it."""
    src, _, _ = data
    (src / "store").mkdir()
    shutil.move(src / "00001.ds", src / "store" / "00001.ds")
    (src / "00001.ds").symlink_to("store/00001.ds")
    r, _ = tokpack(tmp_path, "validate", src)
    assert r.returncode == 0, r.stderr
    r, _ = tokpack(
        tmp_path, "shuffle", src, "-o", tmp_path / "out", "--seq-len", 31, "--seed", 1, "--epochs", 1, "--memory", "8M"
    )
    assert r.returncode == 0, r.stderr
    r, _ = tokpack(tmp_path, "stage", src, tmp_path / "dest")
    assert r.returncode == 0, r.stderr


# -------------------------------------------------------------------- regular files only


def test_fifo_shard_in_the_folder_is_refused_promptly(data, tmp_path):
    """A FIFO where a shard's file should be: validate (a pool of workers) and stage (threads)
    finish within the timeout with a line naming it, instead of blocking forever."""
    src, run, _ = data
    (src / "00001.ds.metadata").unlink()
    os.mkfifo(src / "00001.ds.metadata")
    epoch = run / epoch_dir_name(0)
    (epoch / "00001.ds").unlink()
    os.mkfifo(epoch / "00001.ds")
    for target in (src, run):
        r, _ = tokpack(tmp_path, "validate", target, "--workers", 2)
        assert "a FIFO" in corrupt(r), r.stderr
        r, _ = tokpack(tmp_path, "stage", target, tmp_path / f"dest-{target.name}")
        assert "a FIFO" in one_line(r)
    r, _ = tokpack(tmp_path, "read", run, "--count", 200)
    assert "a FIFO" in one_line(r)


def test_fifo_reached_through_dotdot_is_refused_promptly(data, tmp_path):
    src, _, outside = data
    for suffix in ("", ".metadata"):  # validate used to open the metadata, and block there
        os.mkfifo(outside / f"pipe.ds{suffix}")
    shutil.copy(src / "00000.ds.index", outside / "pipe.ds.index")
    _set_shard_path(src, "../outside/pipe.ds")
    r, _ = tokpack(tmp_path, "validate", src, "--workers", 2)
    assert "[shards[0].path]" in corrupt(r)
    r, _ = tokpack(tmp_path, "stage", src, tmp_path / "dest")
    assert "[shards[0].path]" in one_line(r)


# ------------------------------------------------------------ strict, bounded manifests


def _damage(kind: str, path: Path) -> None:
    """One hostile manifest, written as raw text (json.dumps could not write most of them)."""
    text = path.read_text()
    m = json.loads(text)
    if kind == "nan":
        text = text.replace(f'"tokens": {m["tokens"]}', '"tokens": NaN', 1)
    elif kind == "1e400":
        text = text.replace(f'"tokens": {m["tokens"]}', '"tokens": 1e400', 1)
    elif kind == "10**400":
        text = text.replace(f'"tokens": {m["tokens"]}', '"tokens": 1' + "0" * 400, 1)
    elif kind == "list for object":
        m["shards"][0] = [m["shards"][0]["path"]]
        text = json.dumps(m)
    elif kind == "deep":
        text = text[:-2] + ', "note": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
    elif kind == "eos -1":
        m["eos_id"] = -1
        text = json.dumps(m)
    path.write_text(text)
    if kind == "300 MB":  # valid JSON (whitespace may follow), refused by its size before a byte is read
        with open(path, "ab") as f:
            block = b" " * (1 << 20)
            for _ in range(300):
                f.write(block)


DAMAGE = ["nan", "1e400", "10**400", "list for object", "deep", "300 MB", "eos -1"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_manifest_is_one_line_for_every_command(data, tmp_path, kind):
    """Each kind of damage runs one of the seven commands as a real process (a different one
    for each kind, so every command and every kind runs once as its own process) and the other
    six in this process: the same CLI code and the same lines, without six interpreter starts."""
    src, run, _ = data
    _damage(kind, src / MANIFEST)
    _damage(kind, run / epoch_dir_name(0) / MANIFEST)
    own_process = DAMAGE.index(kind) % 7

    def command(i, *args):
        return tokpack(tmp_path, *args)[0] if i == own_process else in_process(tmp_path, *args)

    for i, args in enumerate(
        (
            ["shuffle", src, "-o", tmp_path / "out", "--seq-len", 31, "--seed", 1, "--epochs", 1],
            ["inspect", src],
            ["stage", src, tmp_path / "dest"],
            ["read", run],
            ["inspect", run],
            ["stage", run, tmp_path / "d2"],
        )
    ):
        line = one_line(command(i, *args))  # exit 1, not 2 ("a bug in tokpack")
        assert "tokpack.json" in line and "HINT" in line, line
    report = corrupt(command(6, "validate", src, run))
    for directory in (src, run / epoch_dir_name(0)):
        assert f"CORRUPT {directory / MANIFEST}" in report, report


def test_shuffle_refuses_what_validate_calls_corrupt(data, tmp_path):
    """Each manifest-level problem validate reports stops shuffle too, with the same field."""
    src, _, _ = data
    cases = {
        "eos_id": lambda m: m.__setitem__("eos_id", m["vocab_size"]),
        "dtype": lambda m: m.__setitem__("dtype", "uint32"),
        "token_size": lambda m: m.__setitem__("token_size", 4),
        "tokens": lambda m: m.__setitem__("tokens", m["tokens"] + 1),
        "shards[1].path": lambda m: m["shards"][1].__setitem__("path", m["shards"][0]["path"]),
    }
    original = (src / MANIFEST).read_text()
    for field, damage in cases.items():
        edit(src, damage)
        r, _ = tokpack(tmp_path, "validate", src, "--quick")
        assert f"[{field}]" in corrupt(r), r.stderr
        r, _ = tokpack(tmp_path, "shuffle", src, "-o", tmp_path / "out", "--seq-len", 31, "--seed", 1, "--epochs", 1)
        assert f"[{field}]" in one_line(r)
        (src / MANIFEST).write_text(original)


def test_run_whose_epoch_samples_contradict_its_epochs_is_corrupt(tmp_path):
    src = write_source(tmp_path / "src", random_docs(np.random.default_rng(5), 150, 1000, 0))
    run = tmp_path / "run"
    shuffle_run([str(src)], str(run), seq_len=31, seed=1, epochs=[0, 1], shard_samples=40, memory=8 << 20, log=None)
    n = json.loads((run / MANIFEST).read_text())["samples"]
    edit(run, lambda m: m.update(samples=n, epoch_samples=[n, n - 1]))
    r, _ = tokpack(tmp_path, "validate", run)
    assert "epoch size differs from its run's" in corrupt(r), r.stderr
    r, _ = tokpack(tmp_path, "read", run)
    assert "epoch size differs from its run's" in one_line(r)


# ------------------------------------------------------ signals stop blocked workers

# A worker that never returns, as a read from a hung network mount would not: injected into the
# child only. The command must still end soon after SIGTERM or Ctrl-C. Both graces are shortened,
# in the order they have (a stopped pool waits for its running calls, then the unwinding prints and
# releases the lock, then the process leaves whatever its threads do): 0.5 s and 2 s, not 2 s and 5 s.
BLOCKED = """
import os, sys, threading
from pathlib import Path
import {module} as target
def blocked(*args, **kwargs):
    Path(os.environ["BLOCKED"]).touch()
    threading.Event().wait()
target.{name} = blocked
import tokpack.formats.io.reads, tokpack.packer.cli
tokpack.formats.io.reads.STOP_GRACE, tokpack.packer.cli.EXIT_GRACE_SECONDS = 0.5, 2.0
from tokpack.packer.cli import main
main()
"""


@pytest.mark.parametrize(
    "command, module, name",
    [
        ("validate", "tokpack.packer.validation", "check_shard"),
        ("stage", "tokpack.packer.staging", "_Stager.run_job"),
    ],
)
@pytest.mark.parametrize("sig, status, said", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupt")])
def test_signal_stops_a_command_whose_workers_are_blocked(data, tmp_path, command, module, name, sig, status, said):
    src, _, _ = data
    args = ["validate", src, "--workers", "2"] if command == "validate" else ["stage", src, tmp_path / "dest"]
    marker = tmp_path / "blocked"
    proc = subprocess.Popen(
        [sys.executable, "-c", BLOCKED.format(module=module, name=name), *map(str, args)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT), BLOCKED=str(marker)),
        preexec_fn=default_sigint,
    )
    try:
        for _ in range(600):  # up to a minute for the first worker to block
            if marker.exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert marker.exists(), proc.communicate()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=TIMEOUT)  # blocked forever before: the threads were joined
    finally:
        proc.kill()
    assert proc.returncode == status and said in err and "Traceback" not in err, (proc.returncode, err)
    assert not (tmp_path / "dest" / LOCK_NAME).exists()  # unwound before it left: the lock is released
