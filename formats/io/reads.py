"""Reading a file into memory: read-until-full (one read may return less), and the one
pipelining idiom (`Worker`: calls run in order in one thread, a bounded number ahead;
`read_ahead`: a plan's blocks read ahead of their use)."""

from __future__ import annotations

import os
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Iterator


STOP_GRACE = 2.0  # seconds a stopped pool waits for its running calls (ThreadPool)


def read_full(f, view: memoryview, offset: int | None = None) -> int:
    """Reads into `view` until it is full or the file ends; returns the bytes read, so a short
    count means end of file (one read may return less on pipes, NFS or a signal). `f` is a file
    read from its position, or, given `offset`, a descriptor read there (pread: no seek, so
    threads may share it) or a file (open_read of a URL) read there after a seek."""
    if offset is not None and not isinstance(f, int):
        f.seek(offset)
        offset = None
    n = 0
    while n < view.nbytes:
        got = f.readinto(view[n:]) if offset is None else os.preadv(f, [view[n:]], offset + n)
        if not got:
            break
        n += got
    return n


class Worker:
    """The one pipelining idiom: a thread that runs the calls submitted to it in order while
    the caller goes on, with at most `depth` calls pending (a submit waits for the oldest), so
    a ring of `depth + 1` buffers is enough. A failed call raises at a later submit or when
    the `with` block ends, which waits for every pending call. With `threads` > 1, that many
    calls run at once (their results still come back in submission order)."""

    def __init__(self, depth: int | None = None, threads: int = 1):
        self.depth = depth  # None: no bound
        self.pending: deque[Future] = deque()  # submitted calls, oldest first
        self._pool = ThreadPoolExecutor(threads)

    def submit(self, fn, *args) -> Future:
        while self.pending and (self.pending[0].done() or self.depth is not None and len(self.pending) >= self.depth):
            self.pending.popleft().result()  # finished calls leave, so a long run holds no list of them
        self.pending.append(self._pool.submit(fn, *args))
        return self.pending[-1]

    def drain(self) -> None:
        while self.pending:
            self.pending.popleft().result()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, exc_type, *exc) -> bool:
        try:
            if exc_type is None:
                self.drain()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=exc_type is not None)
        return False


class ThreadPool(ThreadPoolExecutor):
    """A ThreadPoolExecutor whose `with` block, when it ends by an exception (a failure, Ctrl-C,
    SIGTERM), drops the calls not started and waits at most STOP_GRACE seconds for those
    running: a thread blocked in a read (a hung network mount) must not hold the command, which
    then unwinds (its lock, its one line) and exits; tokpack.packer.cli leaves such a thread behind."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._submitted = weakref.WeakSet()  # futures not yet collected

    def submit(self, *args, **kw) -> Future:
        future = super().submit(*args, **kw)
        self._submitted.add(future)
        return future

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            return super().__exit__(exc_type, exc, tb)
        self.shutdown(wait=False, cancel_futures=True)
        wait(list(self._submitted), timeout=STOP_GRACE)
        return False


def read_ahead(plan, fill, slots: list, threads: int = 1) -> Iterator[tuple]:
    """Reads block k+1 in a Worker while the caller checks, hashes and writes block k, so the
    disk never waits for the CPU (file reads release the GIL). `plan` yields (n, meta);
    `fill(slot, n, meta)` reads n items into one of the `slots` (reused buffers) and returns
    the views. Yields (views, meta) in plan order; a view is valid until the next item.
    `threads` > 1 fills several slots at once (a fill that decodes, not just reads)."""
    plan = iter(plan)
    with Worker(threads=threads) as reader:
        queued: deque = deque()  # (slot, its read, meta), oldest first

        def read_next(slot) -> None:
            item = next(plan, None)
            if item is not None:
                queued.append((slot, reader.submit(fill, slot, *item), item[1]))

        for slot in slots:
            read_next(slot)
        while queued:
            slot, views, meta = queued.popleft()
            yield views.result(), meta
            read_next(slot)
