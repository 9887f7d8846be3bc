"""Memory a reader owns: anonymous private mappings (pages populated up front where the kernel
can), and reusable buffers handed from one reader to the next instead of allocated per call."""

from __future__ import annotations

import contextlib
import mmap
import sys
import threading
from typing import Iterator

import numpy as np


MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
_FREE_BUFFERS: dict = {}  # (use, dtype) -> [Buffer]: reusable buffers that no live reader holds
_FREE_LOCK = threading.Lock()


def _load_madvise():
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


_MADVISE = _load_madvise()


def populate(address: int, length: int) -> bool:
    """MADV_POPULATE_READ: reads the mapping in with the kernel's read-ahead. Called through
    ctypes, which releases the GIL for the second it takes (mmap.madvise holds it), so other
    threads work on the parts already read."""
    return _MADVISE is not None and _MADVISE(address, length, MADV_POPULATE_READ) == 0


def anonymous(nbytes: int, populate: bool = False) -> np.ndarray:
    """A zero-filled uint8 buffer backed by an anonymous private mapping, with transparent huge
    pages requested: first-touch page faults cost less than on plain 4 KiB pages (BENCHMARKS.md,
    "Figures cited by the code": huge pages). `populate`: its pages faulted in at once, by the
    kernel in bulk, for a buffer that will be written whole: 256 MiB in 0.1 s where touching it
    page by page took 0.6 s here. In bulk after the huge pages are asked for
    (MADV_POPULATE_WRITE): MAP_POPULATE faults the pages in before any madvise can ask, as 4 KiB
    pages, which took 1.7x the CPU (537 MiB: 0.11 s against 0.065 s, Linux 6.18)."""
    # MAP_PRIVATE: Python's default for anonymous maps is MAP_SHARED, which a forked worker
    # would share with its parent, and the two would overwrite each other's bytes.
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    size = max(int(nbytes), 1)
    m = mmap.mmap(-1, size, flags=flags)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            m.madvise(mmap.MADV_HUGEPAGE)
    if populate and not _populated(m):  # a kernel before 5.14: at mapping time, as 4 KiB pages
        m.close()
        m = mmap.mmap(-1, size, flags=flags | getattr(mmap, "MAP_POPULATE", 0))
    return np.frombuffer(m, dtype=np.uint8)


def _populated(m: mmap.mmap) -> bool:
    if not sys.platform.startswith("linux"):  # the advice's number is Linux's
        return False
    try:
        m.madvise(MADV_POPULATE_WRITE)
    except OSError:
        return False
    return True


class Buffer:
    """One reusable buffer that grows only when asked for more than it holds."""

    def __init__(self, dtype: np.dtype, use: str = ""):
        self.dtype = np.dtype(dtype)  # element type of the views handed out
        self.use = use  # what it holds: the pool keeps buffers of one use together
        self.array = np.empty(0, self.dtype)  # the storage, reused from block to block

    def ensure(self, n: int) -> np.ndarray:
        if len(self.array) < n:
            self.array = anonymous(max(n, 2 * len(self.array)) * self.dtype.itemsize).view(self.dtype)
        return self.array


def take_buffer(dtype: np.dtype, use: str = "") -> Buffer:
    """A buffer the caller owns until it gives it back: two live readers never share one, and
    work done file after file (or task after task) reuses the same pages instead of touching
    new memory, which is slow (BENCHMARKS.md, "Figures cited by the code": fresh memory)."""
    with _FREE_LOCK:
        free = _FREE_BUFFERS.get((use, np.dtype(dtype).str))
        if free:
            return free.pop()
    return Buffer(dtype, use)


def give_buffers(buffers) -> None:
    with _FREE_LOCK:
        for b in buffers:
            _FREE_BUFFERS.setdefault((b.use, b.dtype.str), []).append(b)


def drop_buffers(*uses: str) -> None:
    """Frees the pooled buffers of these uses, so work that needs them no more (another pass
    run in the same process) does not hold their memory on top of its own."""
    with _FREE_LOCK:
        for key in [k for k in _FREE_BUFFERS if k[0] in uses]:
            del _FREE_BUFFERS[key]


@contextlib.contextmanager
def lent(use: str, nbytes: int, count: int = 1) -> Iterator[list[np.ndarray]]:
    """`count` uint8 buffers of `nbytes` each from the pool, given back when the block ends."""
    owned = [take_buffer(np.uint8, use) for _ in range(count)]
    try:
        yield [b.ensure(nbytes)[: max(int(nbytes), 1)] for b in owned]
    finally:
        give_buffers(owned)
