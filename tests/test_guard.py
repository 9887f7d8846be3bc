"""formats/guard.py's output lock, in one process: what each command may remove, and when it
must refuse. (tests/test_integrity_cli.py drives the same lock through the commands.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from tokpack.formats.errors import TokpackError
from tokpack.formats.constants import LOCK_NAME
from tokpack.formats.guard import OutputLock, process_start, process_state


def holder(pid: int, token: str = "f" * 32, host: str | None = None) -> dict:
    return {
        "host": host or socket.gethostname(),
        "pid": pid,
        "start": process_start(pid),
        "since": 0.0,
        "command": "tokpack shuffle (another)",
        "token": token,
    }


@pytest.fixture
def other_live_process():
    """A process that is not this one and is alive for the test: a live holder."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_release_leaves_a_lock_that_is_no_longer_this_commands(tmp_path, other_live_process):
    """A command whose lock was taken over (it looked stale: a pid reused, a clock) must not
    delete its successor's lock when it finishes: that would let a third command in."""
    lock = OutputLock(tmp_path, "tokpack pack").acquire()
    successor = holder(other_live_process)
    (tmp_path / LOCK_NAME).write_text(json.dumps(successor))
    lock.release()
    assert json.loads((tmp_path / LOCK_NAME).read_text()) == successor
    with pytest.raises(TokpackError, match="in use by another tokpack command"):
        OutputLock(tmp_path, "tokpack shuffle").acquire()


def test_release_removes_this_commands_own_lock_and_the_folder_it_created(tmp_path):
    out = tmp_path / "new"
    lock = OutputLock(out, "tokpack pack").acquire()
    mine = json.loads((out / LOCK_NAME).read_text())
    assert mine["token"] == lock.token and mine["pid"] == os.getpid() and mine["command"] == "tokpack pack"
    lock.release()
    assert not out.exists()  # it wrote nothing: nothing is left
    kept = tmp_path / "kept"
    kept.mkdir()
    with OutputLock(kept, "tokpack pack"):
        (kept / "data").write_text("x")
    assert sorted(p.name for p in kept.iterdir()) == ["data"]


def test_nested_acquire_in_one_process_keeps_the_lock_until_the_outer_release(tmp_path):
    outer = OutputLock(tmp_path, "tokpack shuffle").acquire()
    inner = OutputLock(tmp_path, "tokpack shuffle").acquire()
    inner.release()
    assert (tmp_path / LOCK_NAME).exists()
    outer.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_another_thread_of_the_process_is_another_command(tmp_path):
    """Nesting is one thread's: two threads of one process (a notebook's thread pool running two
    shuffles to one -o) both took the lock, wrote the same epoch at once and left it CORRUPT
    (found through the Python API). The second thread is refused, as another process would be,
    and the holder keeps the lock."""
    held = OutputLock(tmp_path, "tokpack shuffle").acquire()
    seen = []

    def second():
        try:
            OutputLock(tmp_path, "tokpack shuffle").acquire()
            seen.append("acquired")
        except TokpackError as e:
            seen.append(str(e))

    t = threading.Thread(target=second)
    t.start()
    t.join()
    assert len(seen) == 1 and "in use by another tokpack command" in seen[0], seen
    assert "another thread of this process" in seen[0] and "\n" not in seen[0]
    assert (tmp_path / LOCK_NAME).exists()
    held.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_live_and_foreign_holders_refuse_and_a_dead_one_is_taken_over(tmp_path, other_live_process):
    path = tmp_path / LOCK_NAME
    path.write_text(json.dumps(holder(other_live_process)))
    with pytest.raises(TokpackError, match=f"pid {other_live_process}"):
        OutputLock(tmp_path, "tokpack pack").acquire()
    path.write_text(json.dumps(holder(1 << 22, host="another-host.example")))  # cannot be checked from here
    with pytest.raises(TokpackError, match="another-host.example") as err:
        OutputLock(tmp_path, "tokpack pack").acquire()
    assert str(path) in str(err.value)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path.write_text(json.dumps(holder(int(dead.stdout))))
    said = []
    lock = OutputLock(tmp_path, "tokpack pack", log=said.append).acquire()
    assert json.loads(path.read_text())["token"] == lock.token
    assert len(said) == 1 and "taking over the stale lock" in said[0]
    lock.release()


def test_refusals_are_whole_lines(tmp_path, other_live_process):
    """What a second command is told, field by field: the holder's host, pid, start time and
    command, the lock's path, and what to do."""
    path = tmp_path / LOCK_NAME
    path.write_text(json.dumps({**holder(other_live_process), "since": 0.0}))
    with pytest.raises(TokpackError) as err:
        OutputLock(tmp_path, "tokpack pack").acquire()
    assert str(err.value) == (
        f"{path}: output directory is in use by another tokpack command (host {socket.gethostname()}, pid "
        f"{other_live_process}, started 1970-01-01 00:00:00 UTC, command `tokpack shuffle (another)`). "
        "HINT: wait for it to finish, or write to another directory"
    )
    path.write_text(json.dumps({"host": "another-host.example", "pid": 5}))
    with pytest.raises(TokpackError) as err:
        OutputLock(tmp_path, "tokpack pack").acquire()
    assert str(err.value) == (
        f"{path}: output directory is in use by another tokpack command (host another-host.example, pid 5, "
        f"started ?, command `?`). HINT: wait for it to finish, or write to another directory; if no tokpack "
        f"command runs on another-host.example any more, delete {path}"
    )
    (tmp_path / "file").write_text("x")
    with pytest.raises(TokpackError) as err:
        OutputLock(tmp_path / "file", "tokpack pack").acquire()
    assert str(err.value) == f"{tmp_path / 'file'}: output exists and is not a directory. HINT: choose another path"
    with pytest.raises(TokpackError) as err:
        OutputLock(tmp_path / "file" / "out", "tokpack pack").acquire()
    assert str(err.value).startswith(
        f"{tmp_path / 'file' / 'out'}: cannot create the output directory; expected "
        "a directory tokpack can create, found "
    )
    assert str(err.value).endswith(". HINT: check the path (symbolic links included) and that it is writable")


def test_a_reused_pid_makes_the_lock_stale(tmp_path, other_live_process):
    """A holder whose pid now names another process (started at another time) is gone: the lock
    is taken over. The holder records its process's start for this."""
    lock = OutputLock(tmp_path, "tokpack pack").acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["start"] == process_start(os.getpid()) is not None
    lock.release()
    (tmp_path / LOCK_NAME).write_text(json.dumps({**holder(other_live_process), "start": "1"}))
    lock = OutputLock(tmp_path, "tokpack pack", log=lambda _: None).acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == lock.token
    lock.release()


def test_an_existing_empty_output_folder_is_kept(tmp_path):
    """Only a folder the lock created is removed when left empty; the user's stays."""
    (tmp_path / "mine").mkdir()
    OutputLock(tmp_path / "mine", "tokpack pack").acquire().release()
    assert (tmp_path / "mine").is_dir()
    OutputLock(tmp_path / "deep" / "er", "tokpack pack").acquire().release()  # parents made as needed
    assert not (tmp_path / "deep" / "er").exists()


def test_temporaries_of_dead_commands_are_removed_and_a_live_ones_kept(tmp_path, other_live_process):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = tmp_path / f".{LOCK_NAME}.tmp-{int(dead.stdout)}-abcdef12"  # killed while writing it: empty
    gone.write_text("")
    live = tmp_path / f".{LOCK_NAME}.tmp-{other_live_process}-abcdef12"
    live.write_text("")
    OutputLock(tmp_path, "tokpack pack").acquire().release()
    assert not gone.exists() and live.exists()


def test_a_holder_that_is_a_zombie_is_gone(tmp_path):
    """A holder killed but not yet reaped (a zombie: mpirun SIGKILLs a failed job's other ranks and
    exits without reaping them, so a rerun started at once meets them) holds nothing: the lock is
    taken over, not refused as in use."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        path = tmp_path / LOCK_NAME
        path.write_text(json.dumps(holder(proc.pid)))
        proc.kill()
        deadline = time.monotonic() + 10
        while process_state(proc.pid) != "Z":  # not reaped: a zombie
            assert time.monotonic() < deadline, "the killed process never became a zombie"
        said = []
        lock = OutputLock(tmp_path, "tokpack shuffle", log=said.append).acquire()
        assert json.loads(path.read_text())["token"] == lock.token
        assert len(said) == 1 and "taking over the stale lock" in said[0] and str(proc.pid) in said[0]
        lock.release()
    finally:
        proc.kill()
        proc.wait()


def test_a_holder_whose_main_thread_exited_alone_is_still_live(tmp_path):
    """A process whose leader thread exited by itself shows as a zombie while its other threads
    still run (and may write): the lock stays refused."""
    code = (
        "import ctypes, threading, time\nthreading.Thread(target=time.sleep, args=(60,)).start()\n"
        "print('ready', flush=True)\nctypes.CDLL(None).pthread_exit(None)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        deadline = time.monotonic() + 10
        while process_state(proc.pid) != "Z":
            assert time.monotonic() < deadline, "the leader thread never exited"
        (tmp_path / LOCK_NAME).write_text(json.dumps(holder(proc.pid)))
        with pytest.raises(TokpackError, match=f"in use by another tokpack command .*pid {proc.pid}"):
            OutputLock(tmp_path, "tokpack shuffle").acquire()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("pid", [2**31, 10**15, 2**63 + 5])
def test_a_holder_pid_past_any_the_kernel_gives_is_gone_not_a_traceback(tmp_path, pid):
    """A lock file (damaged, or hostile) naming a pid no process can have on this host: kill(0)
    overflowed (OverflowError, a traceback); no process holds it, so it is taken over in one line."""
    path = tmp_path / LOCK_NAME
    path.write_text(json.dumps(holder(pid)))
    said = []
    lock = OutputLock(tmp_path, "tokpack pack", log=said.append).acquire()
    assert json.loads(path.read_text())["token"] == lock.token
    assert len(said) == 1 and "taking over the stale lock" in said[0] and f"pid {pid}" in said[0]
    lock.release()
