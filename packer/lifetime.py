"""Every process tokpack starts ends with it, however tokpack ends, SIGKILL included.

A process cannot run code after SIGKILL, so the cleanup lives in another one: the first time
tokpack is about to start processes (`children_bound()`), it starts a small watchdog, the
reading end of a pipe whose writing end only tokpack holds. The kernel closes that end when
tokpack dies, by any signal; the watchdog then reads EOF and kills:

- every process whose environment carries this tokpack's marker (`TOKPACK_LIFETIME=<token>`,
  set while processes are started, so exec'd children, their own children and daemons that
  left the process tree, like a local Ray cluster's raylet and GCS, all carry it);
- every descendant of tokpack it saw while tokpack lived (it looks twice a second);
- the Slurm jobs tokpack submitted (`scancel`): by the ids registered through the pipe, and by
  the marker, which rides in each job's `--comment`, so a job submitted a moment before the
  kill is found too.

Forked children that never exec (multiprocess's manager, pool workers forked by the
forkserver) keep the environment they were exec'd with, so they also get a parent-death signal
(PR_SET_PDEATHSIG) from an `os.register_at_fork` hook, installed in tokpack while it starts
processes and in multiprocess's forkserver through its preload list.

The watchdog ignores SIGINT, SIGTERM and SIGHUP (a Ctrl-C or a signal sent to the process
group must not take it down before it has cleaned up) and exits once it has. This module
imports only the standard library: the watchdog runs it as a script.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time

MARKER_VAR = "TOKPACK_LIFETIME"
_PR_SET_PDEATHSIG = 1
_POLL_SECONDS = 0.5  # how often the watchdog records tokpack's descendants
_KILL_ROUNDS_SECONDS = 3.0  # how long the watchdog keeps looking for marked processes after tokpack died

_lock = threading.Lock()
_watchdog: subprocess.Popen | None = None  # started once per process, lives as long as it
_marker: str | None = None
_depth = 0  # nesting of children_bound(): forks inside it get a parent-death signal
_saved_env: str | None = None
_hook_installed = False
_forking_from_main = False
_fork_parent = 0


# ---------------------------------------------------------------------------------- children


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Asks the kernel to send `sig` to this process when its parent thread exits (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def _before_fork() -> None:
    global _forking_from_main, _fork_parent
    _forking_from_main = threading.current_thread() is threading.main_thread()
    _fork_parent = os.getpid()


def _after_fork_in_child() -> None:
    global _watchdog
    # Only tokpack may hold the pipe's writing end: its end must mean tokpack's end.
    if _watchdog is not None:
        with contextlib.suppress(OSError, ValueError):
            _watchdog.stdin.close()
        _watchdog = None
    # The signal follows the thread that forked, not the process: a child forked from a
    # short-lived helper thread would be killed when that thread ends, so only the main thread's.
    if _depth > 0 and _forking_from_main:
        set_parent_death_signal()
        if os.getppid() != _fork_parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), signal.SIGKILL)


def install_fork_hook(always: bool = False) -> None:
    """Children forked from now on (while inside `children_bound()`, or always) die with their
    parent. `always` is for processes that exist only to fork workers, like the forkserver."""
    global _hook_installed, _depth
    if always:
        _depth = max(_depth, 1)
    if not _hook_installed:
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _hook_installed = True


_WORKER_MODULES = (
    "tokpack.packer.executors",
    "tokpack.packer.packing",
    "tokpack.shuffle.steps",
    "tokpack.shuffle.packed_step",
    "datatrove.pipeline.base",
)


def _forkserver_preload() -> None:
    """multiprocess's forkserver (datatrove's local pool) imports this module before it forks
    the pool's workers: each worker then dies with the forkserver, which exits with tokpack."""
    try:
        from multiprocess import forkserver
    except ImportError:
        return
    modules = list(getattr(forkserver._forkserver, "_preload_modules", ["__main__"]))
    if __name__ not in modules and __name__ != "__main__":
        # The passes' own modules too: imported once in the forkserver, not again in every
        # worker of every pass (a pool is made per pass).
        forkserver.set_forkserver_preload(modules + [__name__, *_WORKER_MODULES])


# ---------------------------------------------------------------------------------- watchdog


def _send(line: str) -> None:
    if _watchdog is not None and _watchdog.poll() is None:
        with contextlib.suppress(BrokenPipeError, ValueError, OSError):
            _watchdog.stdin.write((line + "\n").encode())
            _watchdog.stdin.flush()


def slurm_submitting() -> None:
    """Jobs are about to be submitted: if tokpack dies, the watchdog asks squeue for the jobs whose
    --comment is this process's marker (see `slurm_comment`), even those not registered yet."""
    _send("submitting -")


def slurm_comment() -> str | None:
    """The <token> of this process's `TOKPACK_LIFETIME=<token>`, once its watchdog runs: a job's --comment."""
    return _marker


def register_slurm_job(job_id: str) -> None:
    """The watchdog scancels this job if tokpack dies before it is done."""
    _send(f"slurm {job_id}")


def forget_slurm_job(job_id: str) -> None:
    _send(f"done {job_id}")


@contextlib.contextmanager
def children_bound():
    """Processes started inside this block end when this process ends, by any signal. Reentrant;
    the watchdog starts on first use and stays until the process exits."""
    global _depth, _saved_env, _watchdog, _marker
    with _lock:
        if _watchdog is None:
            token = f"{os.getpid()}-{secrets.token_hex(8)}"
            # -I -S: stdlib only, nothing from the environment or site-packages; fast to start.
            # A new session: a signal sent to tokpack's process group or terminal does not reach it.
            _watchdog = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), "--watch", str(os.getpid()), token],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
            )
            _marker = token
        install_fork_hook()
        _forkserver_preload()
        if _depth == 0:
            _saved_env = os.environ.get(MARKER_VAR)
            os.environ[MARKER_VAR] = _marker
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                if _saved_env is None:
                    os.environ.pop(MARKER_VAR, None)
                else:
                    os.environ[MARKER_VAR] = _saved_env


# Imported in multiprocess's forkserver (see _forkserver_preload): its forks die with it.
if (
    os.environ.get(MARKER_VAR)
    and __name__ != "__main__"
    and sys.argv[:1] == ["-c"]
    and "multiprocess.forkserver" in sys.modules
):
    install_fork_hook(always=True)


# --------------------------------------------------------------------- the watchdog process


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat: tells a process from a later one that reuses its pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2 :].split()[19].decode()


def _children(pid: int) -> list[int]:
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def marked(var: str, value: str) -> list[int]:
    """Live processes (zombies left out: they hold nothing) whose environment has var=value,
    which every descendant inherits."""
    needle = f"{var}={value}\0".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read() + b"\0"
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if needle in env and state != b"Z":
            found.append(int(name))
    return found


def _scancel(job_ids: set[str], token: str) -> None:
    try:
        listed = subprocess.run(["squeue", "-h", "-o", "%A|%k"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        listed = ""
    ids = set(job_ids) | {line.split("|", 1)[0] for line in listed.splitlines() if line.endswith("|" + token)}
    if ids:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(["scancel", *sorted(ids)], capture_output=True, timeout=30)


def _kill_all(seen: dict[int, str], token: str) -> None:
    me = os.getpid()
    deadline = time.monotonic() + _KILL_ROUNDS_SECONDS
    while True:
        victims = {pid for pid, start in seen.items() if _start_time(pid) == start}
        victims |= set(marked(MARKER_VAR, token))
        for pid in list(victims):
            victims |= set(_descendants(pid))
        victims.discard(me)
        for pid in victims:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if not victims or time.monotonic() > deadline:
            return
        time.sleep(0.1)


def _watch(owner: int, token: str) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    seen: dict[int, str] = {}
    jobs: set[str] = set()
    submitted = False
    buffer = b""
    fd = sys.stdin.fileno()
    owner_start = _start_time(owner)
    while _start_time(owner) == owner_start:  # also ends if a stray fork kept the pipe open
        ready, _, _ = select.select([fd], [], [], _POLL_SECONDS)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                kind, _, job = line.decode().partition(" ")
                if kind == "submitting":
                    submitted = True
                elif kind == "slurm":
                    jobs.add(job)
                elif kind == "done":
                    jobs.discard(job)
        for pid in _descendants(owner):
            if pid not in seen:
                start = _start_time(pid)
                if start is not None:
                    seen[pid] = start
    if submitted or jobs:
        _scancel(jobs, token)
    _kill_all(seen, token)


if __name__ == "__main__" and sys.argv[1:2] == ["--watch"]:
    _watch(int(sys.argv[2]), sys.argv[3])
