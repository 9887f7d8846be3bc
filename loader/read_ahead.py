"""A bounded read-ahead: the training process's next batch made by one background thread while
the training step runs, so that `next(loader)` without DataLoader workers finds it ready.

Pure Python (threading): nothing here reads a file or imports torch. tokpack.loader.torch_adapter
uses it for a TokpackDataset iterated in the training process (num_workers=0).
"""

from __future__ import annotations

import queue
import sys
import threading
from typing import Iterator

_END = object()  # the items ended (StopIteration in the thread)


class ReadAhead:
    """Iterates `items` (an iterator; a generator is closed in the thread when the read-ahead
    stops) in one daemon thread, one item ahead of what the consumer has taken: the thread makes
    item k + 1 once the consumer has taken item k, so at most one item is made and not yet taken. Items come out in the order `items` makes them, each object as made
    (never copied); an exception `items` raises comes out of `__next__` where its item would
    have, after every item made before it, and ends the iteration.

    `pause_s`: once the consumer has taken an item, the thread waits this long before making the
    next, so the consumer's own return from the loader (torch's bookkeeping) does not compete with
    it for the interpreter; a consumer already waiting for the next item cuts the pause short.

    `close()` (also at garbage collection) stops the thread and waits for it: it finishes the item
    it is making, if any, and exits. The thread ends by itself when `items` ends or raises."""

    def __init__(self, items: Iterator, pause_s: float = 0.0):
        self._ready: queue.SimpleQueue = queue.SimpleQueue()  # (item, error) in order
        self._room = threading.Semaphore(1)  # items the thread may make before the consumer takes one
        self._asked = threading.Event()  # the consumer waits for an item: no pause
        self._stop = threading.Event()
        self._done = False  # the consumer has seen the end (or an error)
        # The thread holds the channels, never this object: dropping it (garbage collection) closes it.
        self._thread = threading.Thread(
            target=_make,
            args=(items, self._ready, self._room, self._asked, self._stop, pause_s),
            name="tokpack-read-ahead",
            daemon=True,
        )
        # Bound now: a close at the interpreter's exit may run after this module's names are cleared.
        self._finalizing, self._current_thread = sys.is_finalizing, threading.current_thread
        self._thread.start()

    def __iter__(self) -> "ReadAhead":
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        try:
            item, err = self._ready.get_nowait()
        except queue.Empty:
            self._asked.set()
            item, err = self._ready.get()
        self._asked.clear()
        if err is not None or item is _END:
            self._done = True
            self.close()
            if err is not None:
                raise err
            raise StopIteration
        self._room.release()  # the thread may make the next item now (after its pause)
        return item

    def close(self) -> None:
        """Stops the thread and waits for it (it finishes the item it is making); idempotent."""
        self._stop.set()
        self._room.release()
        self._asked.set()
        thread = self._thread
        # At interpreter exit a daemon thread may already be frozen: joining it would hang. A
        # close run by the thread itself (a garbage collection there) cannot wait for itself.
        if thread.is_alive() and thread is not self._current_thread() and not self._finalizing():
            thread.join()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def _make(items, ready, room, asked, stop, pause_s: float) -> None:
    """The read-ahead thread: each item once the consumer has room for it, into `ready`."""
    first = True
    try:
        while True:
            room.acquire()
            if not first and pause_s and not stop.is_set():
                asked.wait(pause_s)
            if stop.is_set():
                return
            first = False
            try:
                item = next(items)
            except StopIteration:
                ready.put((_END, None))
                return
            except BaseException as err:  # delivered in order, raised in the consumer
                ready.put((None, err))
                return
            ready.put((item, None))
            del item
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()  # a generator's own cleanup, in the thread that ran it
