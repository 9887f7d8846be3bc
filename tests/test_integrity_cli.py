"""One writer per output directory, free space checked before the first byte, and one line
(one JSON object under --json) for every failure: real `tokpack` processes, real signals, real
tmpfs and read-only mounts (root only; skipped with the reason otherwise)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import random_docs, write_source
from probes import default_sigint, ignore_sigint
from tokpack.formats.constants import LOCK_NAME
from tokpack.formats.guard import process_start

ROOT = Path(__file__).resolve().parents[1]
SHUFFLE = ["--seq-len", "127", "--seed", "1", "--epochs", "1"]

# A tokpack process that stops itself (SIGSTOP) just before it writes its first epoch, holding
# its lock: the test then acts while it is provably mid-run, with no timing guesses.
PAUSED = """
import os, signal, sys
import tokpack.shuffle.run
run_epoch = tokpack.shuffle.run.run_epoch
def paused(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGSTOP)
    return run_epoch(*args, **kwargs)
tokpack.shuffle.run.run_epoch = paused
from tokpack.packer.cli import main
main()
"""

# A bug injected into the child process only: a function of tokpack raises what a bug raises.
BUGGY = """
import sys
import {module} as target
def broken(*args, **kwargs):
    raise {exc}("injected bug")
target.{name} = broken
from tokpack.packer.cli import main
main()
"""


def child_env(tmp_path: Path) -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), TOKPACK_LOG_DIR=str(tmp_path / "crash-logs"))


def tokpack(tmp_path: Path, *args, code: str | None = None) -> subprocess.CompletedProcess:
    head = [sys.executable, "-c", code] if code else [sys.executable, "-m", "tokpack.packer.cli"]
    return subprocess.run(
        head + [str(a) for a in args], capture_output=True, text=True, cwd=ROOT, env=child_env(tmp_path)
    )


def start_paused(tmp_path: Path, *args, preexec_fn=default_sigint) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", PAUSED, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=child_env(tmp_path),
        preexec_fn=preexec_fn,
    )
    _, status = os.waitpid(proc.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), "the paused shuffle ended before its first epoch"
    return proc


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def json_failure(stdout: str) -> dict:
    obj = json.loads(stdout)  # exactly one object: json.loads refuses anything after it
    assert obj["ok"] is False and obj["error"]["message"], obj
    return obj["error"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A small source (80 KB) and a larger one (8 MB, 10 shards)."""
    base = tmp_path_factory.mktemp("sources")
    small = write_source(base / "small", random_docs(np.random.default_rng(7), 150, 1000, 0))
    big = write_source(
        base / "big", random_docs(np.random.default_rng(8), 20000, 1000, 0, max_len=400), docs_per_shard=2000
    )
    return small, big


@contextlib.contextmanager
def mounted(path: Path, options: str):
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def write_lock(out: Path, **holder) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    holder = {"host": socket.gethostname(), "since": 0, "command": "tokpack shuffle the-other-one", **holder}
    (out / LOCK_NAME).write_text(json.dumps(holder))
    return holder


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# ------------------------------------------------------------------------------ the lock


def test_second_shuffle_on_one_output_fails_at_once_and_the_first_is_undisturbed(sources, tmp_path):
    small, big = sources
    out = tmp_path / "run"
    first = start_paused(tmp_path, "shuffle", big, "-o", out, *SHUFFLE, "--memory", "1MiB")
    try:
        holder = json.loads((out / LOCK_NAME).read_text())
        assert holder["pid"] == first.pid and holder["start"] == process_start(first.pid)
        second = tokpack(
            tmp_path, "shuffle", small, "-o", out, "--seq-len", "63", "--seed", "2", "--epochs", "1", "--json"
        )
        assert second.returncode == 1
        line = one_line(second.stderr)
        assert f"pid {first.pid}" in line and "in use by another tokpack command" in line and LOCK_NAME in line
        assert "shuffle" in json_failure(second.stdout)["message"]
    finally:
        os.kill(first.pid, signal.SIGCONT)
    _, err = first.communicate()
    assert first.returncode == 0, err
    assert not (out / LOCK_NAME).exists()
    check = tokpack(tmp_path, "validate", out)
    assert check.returncode == 0, check.stderr
    run = json.loads((out / "tokpack.json").read_text())
    assert run["seed"] == 1 and run["seq_len"] == 127


@pytest.mark.parametrize("holder", ["dead pid", "reused pid"])
def test_stale_lock_is_taken_over_with_one_line(sources, tmp_path, holder):
    small, _ = sources
    out = tmp_path / "run"
    if holder == "dead pid":
        stale = write_lock(out, pid=dead_pid(), start="1")
    else:  # this pid is alive, but it is not the process that took the lock
        stale = write_lock(out, pid=os.getpid(), start=str(int(process_start(os.getpid())) + 1))
    r = tokpack(tmp_path, "shuffle", small, "-o", out, "--seq-len", "63", "--seed", "1", "--epochs", "1")
    assert r.returncode == 0, r.stderr
    taken = [line for line in r.stderr.splitlines() if "stale lock" in line]
    assert len(taken) == 1 and f"pid {stale['pid']}" in taken[0], r.stderr
    assert not (out / LOCK_NAME).exists()
    assert tokpack(tmp_path, "validate", out).returncode == 0


def test_lock_temporaries_of_killed_commands_are_removed(sources, tmp_path):
    """Found by bench/soak.py (seed 0, 500 kills): a shuffle killed between writing the lock's
    temporary file and linking it left `.tokpack.lock.tmp-PID-...`; the rerun kept it. A
    temporary of a live process (another command taking the lock right now) stays."""
    small, _ = sources
    out = tmp_path / "run"
    out.mkdir()
    gone = dead_pid()
    (out / f".{LOCK_NAME}.tmp-{gone}-0badc0de").write_text(json.dumps({"host": socket.gethostname(), "pid": gone}))
    (out / f".{LOCK_NAME}.tmp-{dead_pid()}-0a1fd0e0").write_bytes(b'{"ho')  # killed mid-write
    alive = {"host": socket.gethostname(), "pid": os.getpid(), "start": process_start(os.getpid())}
    (out / f".{LOCK_NAME}.tmp-{os.getpid()}-feedf00d").write_text(json.dumps(alive))
    r = tokpack(tmp_path, "shuffle", small, "-o", out, "--seq-len", "63", "--seed", "1", "--epochs", "1")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.glob(f".{LOCK_NAME}*")) == [f".{LOCK_NAME}.tmp-{os.getpid()}-feedf00d"]


@pytest.mark.parametrize("command", ["pack", "shuffle", "stage"])
@pytest.mark.parametrize("where", ["this host", "another host"])
def test_held_lock_refuses_pack_shuffle_and_stage(sources, tmp_path, command, where):
    small, _ = sources
    out = tmp_path / "out"
    if where == "this host":  # this test's own process: alive, and the lock names its start time
        held = write_lock(out, pid=os.getpid(), start=process_start(os.getpid()))
    else:
        held = write_lock(out, host="node-elsewhere", pid=dead_pid(), start="1")
    args = {
        "pack": ["pack", small / "00000.ds", "-o", out, "--eos-id", "0", "--vocab-size", "1000"],
        "shuffle": ["shuffle", small, "-o", out, "--seq-len", "63", "--seed", "1", "--epochs", "1"],
        "stage": ["stage", small, out],
    }[command]
    r = tokpack(tmp_path, *args, "--json")
    assert r.returncode == 1
    line = one_line(r.stderr)
    assert f"pid {held['pid']}" in line and "tokpack shuffle the-other-one" in line
    if where == "another host":
        assert "node-elsewhere" in line and f"delete {out / LOCK_NAME}" in line
    json_failure(r.stdout)
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # nothing written, the holder's lock kept
    assert json.loads((out / LOCK_NAME).read_text()) == held


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_lock_released_on_ctrl_c_and_sigterm_and_the_rerun_completes(sources, tmp_path, sig, status):
    _, big = sources
    out = tmp_path / "run"
    args = ["shuffle", big, "-o", out, *SHUFFLE, "--memory", "1MiB"]
    proc = start_paused(tmp_path, *args)
    assert (out / LOCK_NAME).exists()
    os.kill(proc.pid, sig)
    os.kill(proc.pid, signal.SIGCONT)
    _, err = proc.communicate()
    assert proc.returncode == status, err
    assert "rerun" in one_line(err)
    assert not (out / LOCK_NAME).exists()
    again = tokpack(tmp_path, *args)
    assert again.returncode == 0, again.stderr
    assert tokpack(tmp_path, "validate", out).returncode == 0


# A shuffle that stops itself (SIGSTOP) once its result is printed: {where} is after the summary
# (inside the command), in an atexit handler that runs before tokpack's own (the interpreter
# still runs Python handlers), or in one that runs after it (the teardown, where the interpreter
# puts back each Python handler's default action).
DONE_PAUSED = """
import atexit, os, signal, sys
def pause():
    os.kill(os.getpid(), signal.SIGSTOP)
if {where!r} == "teardown":
    atexit.register(pause)
import tokpack.packer.cli_write as cli_write
from tokpack.packer.cli import main
if {where!r} == "exit":
    atexit.register(pause)
if {where!r} == "printed":
    emit = cli_write.emit
    def emit_then_pause(*args, **kwargs):
        emit(*args, **kwargs)
        sys.stdout.flush()
        pause()
    cli_write.emit = emit_then_pause
main()
"""


@pytest.mark.parametrize("where", ["printed", "exit", "teardown"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_after_the_result_is_printed_leaves_the_success_as_it_is(sources, tmp_path, where, sig):
    """A shuffle --json that had printed {"ok": true, ...} (its epochs committed, its lock
    released) and then got SIGTERM (a scheduler's end, `timeout`) exited 143, and printed a
    second object, {"ok": false, "error": "Terminated"...}, when the signal came before the
    command returned: a finished run reported as stopped, the one-object rule broken. The stop
    now changes nothing: status 0, the one object, no line."""
    small, _ = sources
    out = tmp_path / "run"
    code = DONE_PAUSED.format(where=where)
    args = [sys.executable, "-c", code, "shuffle", small, "-o", out, *SHUFFLE, "--json"]
    proc = subprocess.Popen(
        [str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env=child_env(tmp_path), preexec_fn=default_sigint,
    )  # fmt: skip
    _, status = os.waitpid(proc.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), "the shuffle ended before it paused"
    os.kill(proc.pid, sig)
    os.kill(proc.pid, signal.SIGCONT)
    stdout, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and err == "", (proc.returncode, stdout, err)
    assert json.loads(stdout)["ok"] is True and stdout.count("\n") == 1, stdout  # exactly one object
    assert tokpack(tmp_path, "validate", out).returncode == 0 and not (out / LOCK_NAME).exists()


def test_ctrl_c_stops_a_command_started_with_sigint_ignored(sources, tmp_path):
    """A background job of a non-interactive shell (nohup, `cmd &` in a script) inherits SIGINT
    ignored; tokpack takes it back at start, so that SIGINT still stops it: 130, the usual line,
    the lock released."""
    _, big = sources
    out = tmp_path / "run"
    proc = start_paused(tmp_path, "shuffle", big, "-o", out, *SHUFFLE, "--memory", "1MiB", preexec_fn=ignore_sigint)
    os.kill(proc.pid, signal.SIGINT)
    os.kill(proc.pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert one_line(err) == "tokpack: interrupted; rerun the same command to resume"
    assert not (out / LOCK_NAME).exists()


def test_lock_released_after_an_error_mid_run(sources, tmp_path):
    _, big = sources
    src = tmp_path / "src"
    shutil.copytree(big, src)
    out = tmp_path / "run"
    proc = start_paused(tmp_path, "shuffle", src, "-o", out, *SHUFFLE)
    assert (out / LOCK_NAME).exists()
    (src / "00003.ds").unlink()  # the source loses a shard while the shuffle runs
    os.kill(proc.pid, signal.SIGCONT)
    _, err = proc.communicate()
    errors = [line for line in err.splitlines() if line.startswith("tokpack")]
    assert proc.returncode == 1 and len(errors) == 1 and "00003.ds" in errors[0] and "Traceback" not in err, err
    assert not (out / LOCK_NAME).exists()


def test_readers_ignore_the_lock_file(sources, tmp_path):
    """A run being extended holds its lock: `validate` and `read` of the epochs already there
    see no stray file."""
    small, _ = sources
    out = tmp_path / "run"
    assert (
        tokpack(tmp_path, "shuffle", small, "-o", out, "--seq-len", "63", "--seed", "1", "--epochs", "1").returncode
        == 0
    )
    write_lock(out, pid=os.getpid(), start=process_start(os.getpid()))
    assert tokpack(tmp_path, "validate", out).returncode == 0
    assert tokpack(tmp_path, "read", out, "--count", "1").returncode == 0


# ------------------------------------------------------------------------------ free space


def test_space_checked_before_the_first_byte(sources, tmp_path):
    small, big = sources
    run = tmp_path / "run"
    assert tokpack(tmp_path, "shuffle", big, "-o", run, *SHUFFLE).returncode == 0
    with mounted(tmp_path / "small-fs", "size=4m") as fs:
        cases = [
            ["shuffle", big, "-o", fs / "run", *SHUFFLE, "--memory", "1MiB"],
            ["stage", run, fs / "staged"],
            ["pack", big, "-o", fs / "packed", "--eos-id", "0", "--vocab-size", "1000"],
        ]
        for args in cases:
            r = tokpack(tmp_path, *args, "--json")
            assert r.returncode == 1, r.stderr
            line = one_line([x for x in r.stderr.splitlines() if "detected format" not in x][0])
            assert f"not enough free space for tokpack {args[0]}" in line and "MiB free" in line and str(fs) in line
            # both sides in bytes, the shortfall readable however small (not two equal "x MiB")
            needed, free = map(int, re.search(r"\((\d+) bytes, scratch.*found .*\((\d+) bytes\) on", line).groups())
            assert 0 <= free < needed, line
            json_failure(r.stdout)
            assert list(fs.iterdir()) == [], args  # not one byte written


def test_disk_filled_mid_run_gives_one_line_and_removes_the_scratch(sources, tmp_path):
    _, big = sources
    with mounted(tmp_path / "fs", "size=24m") as fs:
        out = fs / "run"
        args = ["shuffle", big, "-o", out, *SHUFFLE, "--memory", "1MiB"]  # out of core: bucket scratch
        proc = start_paused(tmp_path, *args, "--json")
        try:
            # another process fills the disk after the space check passed
            free_mib = shutil.disk_usage(fs).free // 2**20
            subprocess.run(
                ["dd", "if=/dev/zero", f"of={fs / 'filler'}", "bs=1M", f"count={free_mib - 1}"],
                capture_output=True,
                check=True,
            )
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        stdout, err = proc.communicate()
        assert proc.returncode == 1, err
        line = one_line(err)
        assert "No space left on device" in line and "scratch files were removed" in line
        json_failure(stdout)
        left = [p for p in out.rglob("*") if p.is_file()]
        assert not [p for p in left if p.suffix in (".rows", ".pos") or ".tmp-" in p.name], left
        assert not list(out.rglob("ooc-*")) and not (out / LOCK_NAME).exists()
        (fs / "filler").unlink()
        again = tokpack(tmp_path, *args)
        assert again.returncode == 0, again.stderr
        assert tokpack(tmp_path, "validate", out).returncode == 0


# ------------------------------------------------------------------ one line, never a traceback


@pytest.mark.parametrize("command", ["pack", "shuffle"])
def test_read_only_output_is_one_line(sources, tmp_path, command):
    small, _ = sources
    with mounted(tmp_path / "ro", "ro,size=1m") as ro:
        args = {
            "pack": ["pack", small, "-o", ro / "out"],
            "shuffle": ["shuffle", small, "-o", ro / "out", "--seq-len", "63", "--seed", "1", "--epochs", "1"],
        }
        r = tokpack(tmp_path, *args[command], "--json")
        assert r.returncode == 1
        line = one_line(r.stderr)
        assert "Read-only file system" in line and str(ro / "out") in line
        assert "Read-only" in json.dumps(json_failure(r.stdout))


@pytest.mark.parametrize("command", ["pack", "shuffle"])
def test_immutable_output_directory_is_one_line(sources, tmp_path, command):
    small, _ = sources
    out = tmp_path / "frozen"
    out.mkdir()
    if subprocess.run(["chattr", "+i", str(out)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here (needs root and a filesystem supporting it)")
    try:
        args = {
            "pack": ["pack", small, "-o", out],
            "shuffle": ["shuffle", small, "-o", out, "--seq-len", "63", "--seed", "1", "--epochs", "1"],
        }
        r = tokpack(tmp_path, *args[command], "--json")
        assert r.returncode == 1
        line = [x for x in r.stderr.splitlines() if "detected format" not in x]
        assert len(line) == 1 and "Traceback" not in r.stderr and "Operation not permitted" in line[0], r.stderr
        json_failure(r.stdout)
    finally:
        subprocess.run(["chattr", "-i", str(out)], capture_output=True)


@pytest.mark.parametrize("command", ["validate", "pack", "shuffle"])
def test_symlink_loop_is_one_line(sources, tmp_path, command):
    small, _ = sources
    loop = tmp_path / "loop"
    loop.symlink_to(loop.name)
    args = {
        "validate": ["validate", loop],
        "pack": ["pack", small, "-o", loop],
        "shuffle": ["shuffle", small, "-o", loop, "--seq-len", "63", "--seed", "1", "--epochs", "1"],
    }[command]
    r = tokpack(tmp_path, *args, "--json")
    assert r.returncode == 1
    line = [x for x in r.stderr.splitlines() if "detected format" not in x]
    assert len(line) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "ELOOP" in line[0] and str(loop) in line[0]
    assert "ELOOP" in json.dumps(json_failure(r.stdout))


def test_inspect_of_a_non_increasing_index_is_one_line(sources, tmp_path):
    small, _ = sources
    bad = tmp_path / "bad"
    shutil.copytree(small, bad)
    index = np.fromfile(bad / "00000.ds.index", dtype="<u8")
    index[3], index[4] = index[4], index[3]
    index.tofile(bad / "00000.ds.index")
    r = tokpack(tmp_path, "inspect", bad, "--json")
    assert r.returncode == 1
    line = one_line(r.stderr)
    assert "00000.ds.index [entry 4]" in line and "not increasing" in line and "HINT" in line
    assert json_failure(r.stdout)["where"] == "entry 4"


def test_a_bug_in_tokpack_exits_70_with_its_traceback_in_a_log(sources, tmp_path):
    small, _ = sources
    out = tmp_path / "run"
    code = BUGGY.format(module="tokpack.shuffle.run_setup", name="open_sources", exc="KeyError")
    r = tokpack(
        tmp_path, "shuffle", small, "-o", out, "--seq-len", "63", "--seed", "1", "--epochs", "1", "--json", code=code
    )
    assert r.returncode == 70  # EX_SOFTWARE: not 1 (bad data) nor 2 (usage)
    line = one_line(r.stderr)
    assert "internal error (a bug in tokpack): KeyError: 'injected bug'" in line
    logs = list((tmp_path / "crash-logs").glob("crash-*.log"))
    assert len(logs) == 1 and str(logs[0]) in line
    text = logs[0].read_text()
    assert "Traceback" in text and "injected bug" in text and "open_sources" in text
    assert "bug in tokpack" in json_failure(r.stdout)["message"]
    assert not out.exists()  # the lock, and the directory it created, are gone
    debug = tokpack(
        tmp_path, "--debug", "shuffle", small, "-o", out, "--seq-len", "63", "--seed", "1", "--epochs", "1", code=code
    )
    assert debug.returncode == 70 and "Traceback" in debug.stderr and "KeyError: 'injected bug'" in debug.stderr


def test_validate_never_reports_its_own_bug_as_corrupt(sources, tmp_path):
    small, _ = sources
    code = BUGGY.format(module="tokpack.packer.validation", name="validate_all", exc="TypeError")
    r = tokpack(tmp_path, "validate", small, "--json", code=code)
    assert r.returncode == 70
    line = one_line(r.stderr)
    assert "internal error (a bug in tokpack): TypeError" in line and "CORRUPT" not in r.stderr + r.stdout
    json_failure(r.stdout)


@pytest.mark.parametrize(
    "args",
    [
        ["shuffle", "SRC", "-o", "OUT", "--seq-len", "63", "--seed", "1"],  # neither --epochs nor --epoch
        ["shuffle", "SRC", "-o", "OUT", "--seed", "1", "--epochs", "1"],  # --seq-len missing
        ["validate", "SRC", "--no-such-option"],
    ],
)
def test_usage_errors_still_print_one_json_object(sources, tmp_path, args):
    small, _ = sources
    args = [str(small) if a == "SRC" else str(tmp_path / "out") if a == "OUT" else a for a in args]
    r = tokpack(tmp_path, *args, "--json")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    json_failure(r.stdout)


def test_disk_filled_while_staging_a_node_slice_is_one_line_and_leaves_no_partial_rank_file(sources, tmp_path):
    """The space check counts every file of the slice (it passes here); another process then
    fills the disk, leaving just the slice's token bytes free, before epoch 0's rows are
    written. The write runs out of space: one line naming the epoch folder, no temporary left
    to fill the disk, and the rerun with space completes and validates."""
    from tokpack.packer.slicing import plan_slice
    from tokpack.packer.stage_plan import Source

    _, big = sources
    run = tmp_path / "run"
    assert tokpack(tmp_path, "shuffle", big, "-o", run, *SHUFFLE).returncode == 0
    stage = ["stage", run, None, "--ranks", "0", "--world-size", "2", "--micro-batch", "4"]
    sp = plan_slice(Source(str(run)), ranks="0", world_size=2, micro_batch=4)
    kept, need = sum(sp.kept.values()), sum(sp.written.values()) + sp.root_bytes
    # the stage stops itself once the space check has passed, as each epoch's rows start
    paused = PAUSED.replace(
        "import tokpack.shuffle.run\nrun_epoch = tokpack.shuffle.run.run_epoch",
        "import tokpack.packer.slicing as mod\nrun_epoch = mod._EpochStager.run",
    ).replace("tokpack.shuffle.run.run_epoch = paused", "mod._EpochStager.run = paused")
    assert paused.count("mod.") == 2
    with mounted(tmp_path / "fs", f"size={need // 2**20 + 2}m") as fs:
        stage[2] = fs / "slice"
        proc = subprocess.Popen(
            [sys.executable, "-c", paused, *map(str, stage)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=child_env(tmp_path),
            preexec_fn=default_sigint,
        )
        try:
            _, status = os.waitpid(proc.pid, os.WUNTRACED)
            assert os.WIFSTOPPED(status), "the stage ended before its first epoch"
            free = shutil.disk_usage(fs).free
            subprocess.run(
                ["dd", "if=/dev/zero", f"of={fs / 'filler'}", "bs=4096", f"count={(free - kept - 16384) // 4096}"],
                capture_output=True,
                check=True,
            )
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        _, err = proc.communicate()
        assert proc.returncode == 1, err
        line = one_line(err)
        assert "disk full while staging epoch 0" in line and str(fs / "slice" / "epoch-00000") in line, line
        assert not [p for p in (fs / "slice").rglob("*") if p.is_file()]  # no partial rank file, no manifest
        (fs / "filler").unlink()
        assert tokpack(tmp_path, *stage).returncode == 0
        assert tokpack(tmp_path, "validate", fs / "slice", "--against", run).returncode == 0


@pytest.mark.parametrize("damage", [b"{not json", b"[1, 2]", b'{"message": 5}'])
def test_a_damaged_pack_task_error_record_is_one_line_naming_it(tmp_path, damage):
    """A pack task's error record (part-N.error.json, its message for the user) that is damaged
    (truncated, not an object, no message) is one line naming the record, not a crash; the work
    folder goes, as with any task's error."""
    from tokpack.formats.errors import TokpackError
    from tokpack.formats.outputs import LocalOutput
    from tokpack.packer import packing

    work, out = tmp_path / "out" / ".work", tmp_path / "out"
    work.mkdir(parents=True)
    (work / "part-00000.error.json").write_bytes(damage)
    with pytest.raises(TokpackError) as e:
        packing._raise_task_error(work, out, True, None, LocalOutput())
    assert "error record is damaged" in str(e.value) and "part-00000.error.json" in str(e.value)
    assert not out.exists()


@pytest.mark.parametrize("damage", [b"{not json", b"[1]", b'{"shard": "a"}'])
def test_a_damaged_source_changed_marker_leaves_the_tasks_own_failure(tmp_path, damage):
    """The marker a shuffle task leaves when a source shard changed, damaged: the task's own
    failure stands (not a KeyError or a JSON error), and the marker is gone."""
    from types import SimpleNamespace

    from tokpack.shuffle import run

    work = tmp_path / "work" / "epoch-00000"
    work.mkdir(parents=True)
    marker = work / "source-changed.json"
    marker.write_bytes(damage)
    job = SimpleNamespace(source_changed_path=marker, work_dir=str(work), epoch_dir=str(tmp_path / "run" / "e"))
    with pytest.raises(RuntimeError, match="task 0 of 1 failed"):
        with run._source_check(job, None):
            raise RuntimeError("task 0 of 1 failed")
    assert not marker.exists()


def test_a_reader_that_closes_stdout_ends_the_command_quietly_with_141(sources, tmp_path):
    """`tokpack read RUN | head -1`: the reader took what it wanted and left. The command stops
    as a Unix tool stopped by SIGPIPE (141 for `set -o pipefail`), with no line on stderr: not
    "error: Broken pipe" (exit 1), nor Python's "Exception ignored ... BrokenPipeError"."""
    small, _ = sources
    run = tmp_path / "run"
    assert (
        tokpack(tmp_path, "shuffle", small, "-o", run, "--seq-len", "63", "--seed", "1", "--epochs", "1").returncode
        == 0
    )
    for as_json in ([], ["--json"]):
        cmd = [sys.executable, "-m", "tokpack.packer.cli", "read", str(run), "--count", "100000", *as_json]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=child_env(tmp_path))
        first = proc.stdout.readline()
        proc.stdout.close()  # as `head -1` does once it has its line
        err = proc.stderr.read()
        proc.wait(timeout=120)
        assert first.startswith(b"{" if as_json else b"epoch 0 sample 0") and (proc.returncode, err) == (141, b""), err


def test_a_broken_pipe_that_is_not_stdout_is_one_line(sources, tmp_path):
    """A broken pipe to something else (a socket to a store) is an error of the environment:
    one line and exit 1, while stdout is open."""
    small, _ = sources
    code = BUGGY.format(module="tokpack.shuffle.run_setup", name="open_sources", exc="BrokenPipeError")
    r = tokpack(
        tmp_path, "shuffle", small, "-o", tmp_path / "run", "--seq-len", "63", "--seed", "1", "--epochs", "1", code=code
    )
    assert r.returncode == 1 and one_line(r.stderr).startswith("tokpack: error: injected bug"), r.stderr
