"""The I/O layer every stage reads through: read-until-full, reusable buffers a reader owns,
and read-ahead (the one pipelining idiom: the next block is read in a thread while the caller
works on this one)."""

from __future__ import annotations

import os
import queue
import threading
from typing import Iterator

import numpy as np

_FREE_BUFFERS: dict = {}  # dtype -> [Buffer]: reusable buffers that no live reader holds
_FREE_LOCK = threading.Lock()


def read_full(f, view: memoryview, offset: int | None = None) -> int:
    """Reads into `view` until it is full or the file ends; returns the bytes read, so a short
    count means end of file (one read may return less on pipes, NFS or a signal). `f` is a file
    read from its position, or, given `offset`, a descriptor read there (pread: no seek, so
    threads may share it)."""
    n = 0
    while n < view.nbytes:
        got = f.readinto(view[n:]) if offset is None else os.preadv(f, [view[n:]], offset + n)
        if not got:
            break
        n += got
    return n


def sequential(f) -> None:
    """Tells the kernel to read ahead: the file is read once, front to back."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)


class Buffer:
    """One reusable buffer that grows only when asked for more than it holds."""

    def __init__(self, dtype: np.dtype):
        self.dtype = np.dtype(dtype)  # element type of the views handed out
        self.array = np.empty(0, self.dtype)  # the storage, reused from block to block

    def ensure(self, n: int) -> np.ndarray:
        if len(self.array) < n:
            self.array = np.empty(max(n, 2 * len(self.array)), self.dtype)
        return self.array


def take_buffer(dtype: np.dtype) -> Buffer:
    """A buffer the caller owns until it gives it back: two live readers never share one, and
    work done file after file reuses the same pages instead of touching new memory."""
    with _FREE_LOCK:
        free = _FREE_BUFFERS.get(np.dtype(dtype).str)
        if free:
            return free.pop()
    return Buffer(dtype)


def give_buffers(buffers) -> None:
    with _FREE_LOCK:
        for b in buffers:
            _FREE_BUFFERS.setdefault(b.dtype.str, []).append(b)


def read_ahead(plan, fill, slots: list) -> Iterator[tuple]:
    """Reads block k+1 in a thread while the caller checks, hashes and writes block k, so the
    disk never waits for the CPU (file reads release the GIL). `plan` yields (n, meta);
    `fill(slot, n, meta)` reads n items into one of the `slots` (reused buffers) and returns
    the views. Yields (views, meta) in plan order; a view is valid until the next item."""
    free: queue.Queue = queue.Queue()
    ready: queue.Queue = queue.Queue()
    for slot in slots:
        free.put(slot)
    stop = threading.Event()

    def worker():
        try:
            for n, meta in plan:
                slot = free.get()
                if stop.is_set():
                    return
                ready.put((slot, fill(slot, n, meta), meta))
            ready.put(None)
        except BaseException as e:  # handed to the caller, raised there
            ready.put(e)

    thread = threading.Thread(target=worker, name="tokpack-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            item = ready.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            slot, views, meta = item
            yield views, meta
            free.put(slot)
    finally:
        stop.set()
        free.put(None)  # wakes a worker waiting for a free slot
        thread.join()
