"""Per-phase CPU accounting of `shuffle --to-nodes` (tokpack.packer.exchange): each phase's CPU
seconds (its thread's user+sys, `time.thread_time`: the machine's load does not move them, a
wait does not count) and the bytes it moved, per epoch, in the process's --json summary
(`"phases": {name: {"cpu_s", "bytes", "wall_s"}}`; wall_s: a main-thread phase's wall time, its
waits included; the read-ahead thread's read has none). tokpack.packer.node_model turns them into seconds a
byte and a projection. Phases nest: an inner phase's time is its own, not its caller's.

The phases, and the thread each runs on:
  read         the source blocks read and their shards' xxh3_128 fed (windows: the read-ahead
               thread, tokpack.formats.io.reads.read_ahead; best-fit: the main thread maps and hashes)
  cut          the blocks cut into pieces of output rows (main thread)
  route        the rounds' agreement, counts, send buffers and Alltoallv (main thread; MPI's
               wait for its peers is CPU too where it polls); its bytes: the tokens sent (each
               piece once, to the process that keeps its row), the process's own included
  place        the pieces received put in their rows in memory (the delivering thread, a round
               behind the main thread's: tokpack.packer.transport.exchange_rounds)
  write_through  in memory, windows, where the host has the cores: the rows a round completed
               written to their place in their rank files (a thread of its own, behind the
               rounds: node_store.InMemory; the kernel writes them back meanwhile)
  bucket_write out of core: the pieces received appended to bucket files (the delivering thread)
  bucket_read  out of core: the buckets read back and checked (a thread a bucket ahead of
               write, tokpack.packer.node_store.BucketRead; wall_s: the
               main thread's wait for it)
  write        the slice's rank files written after the rounds, each row's facts for its owner
               taken from the same pass (main thread; with write_through, their tokens only
               hashed, indexed and fsync'd)
  facts        the rows' facts sent to their epoch shards' owners and the owned shards' entries
               built from them (tokpack.packer.owned_facts; main thread); its bytes: the owned
               shards' token bytes they stand for (none of which moves)
  other        the rest of the process's CPU (start-up, planning, manifests; every thread)
"""

from __future__ import annotations

import resource
import threading
import time
from contextlib import contextmanager, nullcontext

PHASES = ("read", "cut", "route", "place", "write_through", "bucket_write", "bucket_read", "write", "facts")


class Phases:
    """CPU seconds and bytes by phase, from any thread."""

    def __init__(self):
        self.cpu = dict.fromkeys(PHASES, 0.0)
        self.bytes = dict.fromkeys(PHASES, 0)
        self.wall = dict.fromkeys(PHASES, 0.0)  # a main-thread phase's wall time (its waits too)
        self._lock = threading.Lock()
        self._local = threading.local()  # a thread's open phases and its CPU at its last lap

    def _add(self, name: str, cpu: float, nbytes: int, wall: float = 0.0) -> None:
        with self._lock:
            self.cpu[name] = self.cpu.get(name, 0.0) + cpu
            self.bytes[name] = self.bytes.get(name, 0) + int(nbytes)
            self.wall[name] = self.wall.get(name, 0.0) + wall

    @contextmanager
    def phase(self, name: str, nbytes: int = 0):
        """The calling thread's CPU inside the block, to `name` (an enclosing phase pauses)."""
        stack = self._local.__dict__.setdefault("stack", [])
        now, wall = time.thread_time(), time.perf_counter()
        if stack:  # the enclosing phase's time until now is its own
            outer, since, since_wall = stack[-1]
            self._add(outer, now - since, 0, wall - since_wall)
        stack.append([name, now, wall])
        try:
            yield
        finally:
            now, wall = time.thread_time(), time.perf_counter()
            _, since, since_wall = stack.pop()
            self._add(name, now - since, nbytes, wall - since_wall)
            if stack:
                stack[-1][1:] = [now, wall]

    def count(self, name: str, nbytes: int) -> None:
        self._add(name, 0.0, nbytes)

    def lap(self, name: str, nbytes: int) -> None:
        """To `name`: the calling thread's CPU since its last lap (or since it started: a thread
        of its own, as the read-ahead thread is)."""
        now = time.thread_time()
        last = getattr(self._local, "lap", 0.0)
        self._local.lap = now
        self._add(name, now - last, nbytes)

    def generator(self, name: str, items, size=None):
        """`items` (a generator), each step's CPU to `name`, `size(item)` bytes each."""
        it = iter(items)
        while True:
            with self.phase(name):
                item = next(it, None)
                if item is not None and size is not None:
                    self._add(name, 0.0, size(item))
            if item is None:
                return
            yield item

    def summary(self, process_cpu: float) -> dict:
        """{phase: {"cpu_s", "bytes"}}, every phase (0 where it did not run); "other": what `process_cpu` (the
        process's CPU over the same span) holds beyond them."""
        with self._lock:
            out = {
                k: {"cpu_s": round(v, 4), "bytes": self.bytes[k], "wall_s": round(self.wall[k], 4)}
                for k, v in self.cpu.items()
            }
            spent = sum(self.cpu.values())
        out["other"] = {"cpu_s": round(max(0.0, process_cpu - spent), 4), "bytes": 0, "wall_s": 0.0}
        return out


def process_cpu() -> float:
    """This process's CPU seconds so far, every thread, user + sys."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# The epoch's collector, while an exchange runs in this process (one at a time): the read-ahead
# thread, which the engine starts deep in tokpack.shuffle, reaches it here.
_active: list[Phases] = []


@contextmanager
def collecting(phases: Phases):
    _active.append(phases)
    try:
        yield phases
    finally:
        _active.remove(phases)


def active() -> Phases | None:
    return _active[-1] if _active else None


def lapped(name: str, fn):
    """`fn(first, view)` (a reader's on_read), its thread's CPU since its last lap to `name` with
    the view's bytes, while a collector is active; else `fn` itself."""
    phases = active()
    if phases is None:
        return fn

    def call(first, view):
        fn(first, view)
        phases.lap(name, view.nbytes)

    return call


def phase(name: str, nbytes: int = 0):
    """Phases.phase on the active collector, or nothing."""
    phases = active()
    return nullcontext() if phases is None else phases.phase(name, nbytes)


def timed(name: str, items, size=None):
    """`items` with each step's CPU to `name` on the active collector (Phases.generator), or as they are."""
    phases = active()
    return items if phases is None else phases.generator(name, items, size)


def count(name: str, nbytes: int) -> None:
    """Bytes to `name` on the active collector, or nothing."""
    phases = active()
    if phases is not None:
        phases.count(name, nbytes)
