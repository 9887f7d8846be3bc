"""Probes that watch a tested command from outside: which of its processes are still alive
(a marker in their environment), and what every one of its Python processes opened or changed
on disk (an audit hook installed by tests/audit_site/sitecustomize.py)."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

from tokpack.formats.guard import process_state

AUDIT_SITE = str(Path(__file__).resolve().parent / "audit_site")
MARK = "TOKPACK_TEST_MARK"


def default_sigint() -> None:
    """preexec_fn of a child a test sends SIGINT: a test run as a background job of a
    non-interactive shell (or under nohup) inherits SIGINT ignored, and so would the child, whose
    Python would then not even see the signal the test sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def ignore_sigint() -> None:
    """preexec_fn of a child started as such a background job is: SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def marked(token: str) -> list[int]:
    """Pids of live processes whose environment carries TOKPACK_TEST_MARK=token."""
    needle = f"{MARK}={token}\0".encode()
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    env = f.read()
            except OSError:
                continue
            if needle in env + b"\0" and process_state(int(name)) not in (None, "Z"):
                found.append(int(name))
    return found


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b"?"


def describe(pids: list[int]) -> list[str]:
    return [f"{pid}: {cmdline(pid).replace(bytes(1), b' ').decode(errors='replace')[:150]}" for pid in pids]


def kill_marked(token: str) -> list[str]:
    """Kills whatever still carries the marker; returns what it found (empty: nothing was left)."""
    left = marked(token)
    found = describe(left)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return found


@dataclass(frozen=True)
class Access:
    pid: int
    event: str  # "open", "os.remove", "shutil.rmtree", ...
    path: str  # absolute, as the process named it (symbolic links not resolved)
    mode: str  # open(): "r", "wb", ...; os.open(): ""
    flags: int

    @property
    def writes(self) -> bool:
        if self.event != "open":
            return True
        return any(c in self.mode for c in "wax+") or bool(self.flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))


def audit_env(log: str | Path, root: str | Path) -> dict[str, str]:
    """Environment variables that make every Python process started with them record its file
    accesses under `root` (and under /dev) in `log`; the caller adds AUDIT_SITE to PYTHONPATH."""
    return {"TOKPACK_AUDIT_LOG": str(log), "TOKPACK_AUDIT_ROOT": str(root)}


def hashed(log: str | Path) -> dict[str, int]:
    """Bytes hashed (xxh3_128) by the processes that had $TOKPACK_HASH_LOG = `log` (and
    AUDIT_SITE on PYTHONPATH), by the module that fed them."""
    found: dict[str, int] = {}
    for line in Path(log).read_text().splitlines() if Path(log).exists() else ():
        _, module, n = line.split("\t")
        found[module] = found.get(module, 0) + int(n)
    return found


def audited(log: str | Path) -> list[Access]:
    try:
        text = Path(log).read_bytes().decode("utf-8", "surrogateescape")
    except FileNotFoundError:
        return []
    found = []
    for line in text.splitlines():
        pid, event, path, mode, flags = line.split("\t")
        found.append(Access(int(pid), event, path, mode, int(flags)))
    return found


def page_cache(files: list[Path], evict: bool = False) -> tuple[int, int]:
    """(pages of `files` in the page cache, their pages), by mincore on a fresh mapping of each;
    `evict`: each file's pages dropped from the cache first (written back, then
    POSIX_FADV_DONTNEED), so that what is resident afterwards is what a command read."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    resident = total = 0
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            if evict:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            size = os.fstat(fd).st_size
            if not size:
                continue
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            pages = (ctypes.c_ubyte * ((size + page - 1) // page))()
            try:
                assert libc.mincore(address, size, pages) == 0, os.strerror(ctypes.get_errno())
            finally:
                libc.munmap(address, size)
            resident, total = resident + sum(p & 1 for p in pages), total + len(pages)
        finally:
            os.close(fd)
    return resident, total
