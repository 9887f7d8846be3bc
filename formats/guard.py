"""Guards for the commands that write a directory: one writer per output directory, and
enough free space before the first byte.

The lock is a file `OUT/tokpack.lock`, created atomically (a complete temporary file hard-linked
to its final name: `link` fails if the name exists, so two commands cannot both win, and a
reader never sees a half-written holder). It names the holder's host, pid and the start time
of that pid (from /proc), so a pid reused by another process after a crash is not mistaken for
the holder. Readers and validators ignore it: it is never data.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import json
import os
import re
import shutil
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

from .errors import TokpackError
from .io.gate import open_read, read_limited
from .constants import LOCK_NAME

_LOCK_TEMPORARY = re.compile(re.escape(f".{LOCK_NAME}.tmp-") + r"([0-9]+)-[0-9a-f]{8}")
MAX_LOCK_BYTES = 1 << 12  # a lock names a host, a pid and a command line: a larger file is not one of ours

# lock path -> (the thread holding it, nesting depth), for this process. Nesting is one thread's
# (an API entry point calling another); two threads of one process writing one directory at once
# (a notebook's thread pool) are two commands: both once took the lock, and wrote a corrupt epoch.
_held: dict[str, tuple[int, int]] = {}
_held_guard = threading.Lock()


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (the state) on, or None where /proc is absent."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: count from the last ')'
    return stat[stat.rfind(")") + 2 :].split()


def process_start(pid: int) -> str | None:
    """The start time of `pid` in clock ticks since boot (/proc/<pid>/stat field 22), or None
    where /proc is absent. Together with the pid it names one process, even after pid reuse."""
    fields = _stat_fields(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None


def process_state(pid: int) -> str | None:
    """The state letter of `pid` (/proc/<pid>/stat field 3: R, S, D, Z for a zombie...), or None
    where there is no such process or no /proc."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    # OverflowError: past any pid the kernel gives (a lock file's number, never checked there)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # someone else's process: alive
        return True
    # A zombie answers kill(0) until its parent reaps it, yet it holds no file and writes nothing
    # more: mpirun SIGKILLs the other ranks of a failed job and exits without reaping them, so a
    # rerun started at once met its own dead processes as live holders.
    if process_state(pid) not in ("Z", "X"):
        return True
    try:  # a leader thread that exited alone is a zombie too, while the process's other threads run
        return len(os.listdir(f"/proc/{pid}/task")) > 1
    except OSError:
        return False


def _os_error(e: OSError) -> str:
    return f"{e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)})"


def _first_bytes(path: Path) -> str:
    try:
        with open_read(path, ahead=False) as f:  # a FIFO in its place never blocks the message
            head = f.read(60)
    except OSError as e:
        return _os_error(e)
    except TokpackError as e:
        return e.found or e.message
    return repr(head.decode(errors="replace")) + ("..." if len(head) == 60 else "")


def _describe(holder: dict) -> str:
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(since)) if isinstance(since, (int, float)) else "?"
    return (
        f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {when}, "
        f"command `{holder.get('command', '?')}`"
    )


class OutputLock:
    """An exclusive lock on an output directory for the life of one command (a context manager).

    A live holder makes `acquire` raise TokpackError at once. A holder on this host whose pid
    is gone, or now names another process, is stale: the lock is taken over and `log` says so.
    A holder on another host cannot be checked from here and is never taken over."""

    def __init__(self, directory: str | Path, command: str, log=None):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self.command = command  # shown to a second command that finds the lock held
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        self.token = uuid.uuid4().hex  # tells our lock file from a successor's
        self.created_dir = False  # the directory did not exist: removed again if left empty

    def _read(self, path: Path) -> dict | None:
        """The holder a lock file names; None if there is no such file; {} if it names none (not
        JSON, or not the fields tokpack writes: another program's file, or a damaged one)."""
        try:  # through the gate: a FIFO, a link out of the folder or a huge file names no holder
            holder = json.loads(read_limited(path, MAX_LOCK_BYTES, "lock file"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, UnicodeDecodeError, RecursionError, TokpackError):
            return {}
        valid = (
            isinstance(holder, dict)
            and isinstance(holder.get("host"), str)
            and type(holder.get("pid")) is int
            and holder["pid"] > 0
            and isinstance(holder.get("start"), (str, type(None)))
        )
        return holder if valid else {}

    def _stale(self, holder: dict) -> bool:
        if holder.get("host") != socket.gethostname():
            return False
        pid = holder.get("pid")
        if not isinstance(pid, int) or pid <= 0 or not _pid_alive(pid):
            return True
        start = process_start(pid)
        return start is not None and holder.get("start") is not None and start != holder.get("start")

    def acquire(self) -> "OutputLock":
        key = str(self.path.absolute())
        with _held_guard:
            owner, depth = _held.get(key, (None, 0))
            if owner == threading.get_ident():
                _held[key] = (owner, depth + 1)  # this thread holds it already: an API entry point calling another
                return self
            if owner is not None:
                raise TokpackError(
                    "output directory is in use by another tokpack command (another thread of this process, "
                    f"pid {os.getpid()})",
                    file=self.path,
                    hint="wait for it to finish, or write to another directory",
                )
        try:
            if self.directory.is_symlink() and not self.directory.exists():
                os.stat(self.directory)  # a symlink loop or a dangling link: its own error (ELOOP, ENOENT)
            if not self.directory.exists():
                self.directory.mkdir(parents=True, exist_ok=True)
                self.created_dir = True
        except OSError as e:
            raise TokpackError(
                "cannot create the output directory",
                file=self.directory,
                expected="a directory tokpack can create",
                found=_os_error(e),
                hint="check the path (symbolic links included) and that it is writable",
            ) from None
        if not self.directory.is_dir():
            raise TokpackError("output exists and is not a directory", file=self.directory, hint="choose another path")
        tmp = self.directory / f".{LOCK_NAME}.tmp-{os.getpid()}-{self.token[:8]}"
        try:
            mine = {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "start": process_start(os.getpid()),
                "since": time.time(),
                "command": self.command,
                "token": self.token,
            }
            tmp.write_text(json.dumps(mine))
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)  # a full disk may have let it be created
            raise TokpackError(
                "cannot write in the output directory",
                file=self.directory,
                expected="a writable directory",
                found=_os_error(e),
                hint="choose a writable directory (read-only filesystem, permissions, immutable attribute, full disk?)",
            ) from None
        try:
            for _ in range(8):  # each turn either wins, fails, or removes one stale lock
                with contextlib.suppress(FileExistsError):
                    os.link(tmp, self.path)
                    break
                holder = self._read(self.path)
                if holder is None:
                    continue  # released meanwhile
                if not holder:  # written whole before it is linked (above): not a tokpack lock
                    raise TokpackError(
                        "the output lock names no command that holds it",
                        file=self.path,
                        expected='a tokpack lock: {"host": ..., "pid": ..., ...}',
                        found=_first_bytes(self.path),
                        hint=f"if no tokpack command is writing {self.directory}, delete {self.path} and rerun",
                    )
                if not self._stale(holder):
                    hint = "wait for it to finish, or write to another directory"
                    if holder.get("host") != socket.gethostname():
                        hint += f"; if no tokpack command runs on {holder.get('host')} any more, delete {self.path}"
                    raise TokpackError(
                        f"output directory is in use by another tokpack command ({_describe(holder)})",
                        file=self.path,
                        hint=hint,
                    )
                if self._take_over(holder):
                    self.log(
                        f"tokpack: taking over the stale lock {self.path} of a command that is gone "
                        f"({_describe(holder)})"
                    )
            else:
                raise TokpackError(
                    "could not take the output lock: other commands keep taking it",
                    file=self.path,
                    hint="run one command at a time on this directory",
                )
        finally:
            tmp.unlink(missing_ok=True)
        with _held_guard:
            _held[key] = (threading.get_ident(), 1)
        self._remove_dead_temporaries()
        return self

    def _remove_dead_temporaries(self) -> None:
        """Removes the lock's temporary files left by commands killed while taking it (their
        creator, named in the file and its name, is gone); only its creator touches such a file."""
        for leftover in self.directory.glob(f".{LOCK_NAME}.tmp-[0-9]*"):
            named = _LOCK_TEMPORARY.fullmatch(leftover.name)  # exactly the name acquire() gives it
            if named is None or leftover.is_symlink() or not leftover.is_file():
                continue  # not one of ours: never touched
            holder = self._read(leftover)
            if not holder:  # killed while writing it: only its name says whose it is
                holder = {"host": socket.gethostname(), "pid": int(named.group(1))}
            if self._stale(holder):
                leftover.unlink(missing_ok=True)

    def _take_over(self, stale: dict) -> bool:
        """Removes the stale lock file unless another command replaced it meanwhile: it is moved
        aside first (atomic), and put back if what was moved is not the stale holder."""
        aside = self.directory / f".{LOCK_NAME}.tmp-stale-{self.token[:8]}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        moved = self._read(aside)
        if moved != stale:
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)  # a live successor's lock: restore it
            aside.unlink(missing_ok=True)
            return False
        aside.unlink(missing_ok=True)
        return True

    def release(self) -> None:
        key = str(self.path.absolute())
        with _held_guard:
            owner, depth = _held.get(key, (None, 0))
            if depth > 1:
                _held[key] = (owner, depth - 1)
                return
            _held.pop(key, None)
        holder = self._read(self.path)
        if holder and holder.get("token") == self.token:
            self.path.unlink(missing_ok=True)
        if self.created_dir:
            with contextlib.suppress(OSError):
                self.directory.rmdir()  # only if empty: a command that wrote nothing leaves nothing

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
        return False


def lock_holder(directory) -> tuple[dict, bool] | None:
    """The holder the lock of `directory` names and whether it may still run (False: a command
    on this host that is gone, whose lock the next command takes over); None without a tokpack
    lock. For a reader that explains an unfinished directory: it never takes nor removes the lock."""
    lock = OutputLock(directory, "")
    holder = lock._read(lock.path)
    if not holder:
        return None
    return holder, not lock._stale(holder)


def holder_name(command: str) -> str:
    """How a second command that finds the lock held is told who holds it: the command line
    that runs it, or the Python API's entry point."""
    if command not in sys.argv[1:]:
        return f"tokpack {command} (Python API)"
    argv = list(sys.argv)
    argv[0] = (
        "tokpack" if argv[0].endswith(("cli.py", "__main__.py", "-c")) or argv[0] == "-m" else os.path.basename(argv[0])
    )
    return " ".join(argv)


def locked_output(command: str, arg: str = "output"):
    """Decorator for a Python API entry point that writes the directory named by its argument
    `arg`: the call holds that directory's OutputLock from start to end (error and Ctrl-C
    included). Tasks it runs on an executor never take the lock; their submitter holds it."""

    def wrap(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def locked(*args, **kwargs):
            target = str(signature.bind(*args, **kwargs).arguments[arg])
            if "://" in target:  # not a local directory: the entry point refuses it or stages it
                return fn(*args, **kwargs)
            with OutputLock(target, holder_name(command)):
                return fn(*args, **kwargs)

        return locked

    return wrap


# --------------------------------------------------------------------------- free space


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def existing_ancestor(path: Path) -> Path:
    """`path` itself if it exists, else its nearest existing parent: the filesystem a path not
    yet made will be written on (free space, a hard link's device)."""
    path = Path(path).absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def space_needs(needs: list[tuple[str | Path, int]]) -> list[tuple[Path, Path, int, int]]:
    """(first path, its nearest existing directory, bytes to write, free bytes) per filesystem
    among `needs` (path, bytes to write there)."""
    by_fs: dict[int, list] = {}
    for path, nbytes in needs:
        where = existing_ancestor(Path(path))
        entry = by_fs.setdefault(os.stat(where).st_dev, [Path(path), where, 0])
        entry[2] += max(0, int(nbytes))
    return [(path, where, needed, shutil.disk_usage(where).free) for path, where, needed in by_fs.values()]


def check_space(needs: list[tuple[str | Path, int]], command: str, hint: str | None = None) -> None:
    """Raises TokpackError (needed, available, where) when any filesystem among `needs`
    (path, bytes to write there) has less free space than is to be written on it."""
    for path, where, needed, free in space_needs(needs):
        if needed > free:
            raise TokpackError(
                f"not enough free space for tokpack {command}",
                file=path,
                expected=f"{_mib(needed)} free ({needed} bytes, scratch included)",
                # in bytes on both sides: rounded to 0.1 MiB, a small shortfall read as two equal sides
                found=f"{_mib(free)} free ({free} bytes) on the filesystem of {where}",
                hint=hint or "free some space there, or write somewhere else",
            )


def physical_memory() -> int | None:
    """This machine's RAM in bytes (MemTotal in /proc/meminfo), or None where it is unknown."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo", "rb") as f:
        for line in f:
            if line.startswith(b"MemTotal:"):
                return int(line.split()[1]) * 1024  # in kB
    return None


def is_no_space(exc: BaseException | None) -> bool:
    """Whether `exc`, or an exception it was raised from, is a full disk (ENOSPC, EDQUOT)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def bytes_under(path: str | Path) -> int:
    """Bytes of the files below `path` (0 if it does not exist): what a resumed command has
    already written and need not find free again."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total
