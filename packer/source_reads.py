"""Rows read from the sources at a disk's pace (issue 41, item 4): a replacement node's windows
(tokpack.packer.replacement.SourceRows), many ranged reads in flight at once.

A node holds about 1/N of an epoch's rows, scattered over the sources: read one request at a
time, at a device's ~100 us a request, 56 million 8 KB rows of an 11 TB epoch are 1.5 hours of
waiting. So the rows wanted (sorted by source and offset, each once) become reads:

- adjacent rows of one shard file are one read (`plan_reads`), and so are rows a small gap apart
  (at most MAX_GAP_BYTES, and at most 1/GAP_SHARE of the rows on either side: the read
  amplification stays within 1/8 more), the gap's bytes read into a scratch buffer and dropped
  (one `preadv` scatters a read into the rows' places in the buffer and the gaps);
- a read is at most MAX_READ_BYTES (a long run of rows is several reads, in flight together);
- READ_DEPTH threads issue them (`preadv` on descriptors opened through the gate and shared:
  a positional read needs no seek), each into its rows' places in the caller's buffer, so the
  bytes do not depend on which read ends first;
- at most max_open() shard files are held open (the least recently used idle one closed first, never
  one a thread reads): a source may have more shards (20,000-100,000) than a cluster's hard
  limit on open files (4,096-65,536), where a descriptor kept for each shard failed with EMFILE.

Memory: the caller's buffer (its rows), and one scratch buffer of MAX_GAP_BYTES shared by every
read (a gap's bytes are never looked at). A stream that is not a local source's shard files (a
URL, --holdout's stream of kept documents) is read by its own `read_into`, one call a run of
adjacent rows, in the same threads."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from tokpack.formats.errors import TokpackError
from tokpack.formats.io.reads import ThreadPool
from tokpack.formats.io.gate import open_files_share, regular_fd
from tokpack.formats.shards import PackedSource

READ_DEPTH = 32  # reads in flight: an NVMe's queue wants dozens, a network filesystem as many
MAX_READ_BYTES = 4 << 20
MAX_GAP_BYTES = 32 << 10
GAP_SHARE = 16  # a gap is merged when at most 1/16 of the rows' bytes on either side of it
MAX_GAPS = 500  # a read's gaps: 2 iovecs each, within IOV_MAX (1024)
# The fewest shard files a reader holds open (max_open): twice READ_DEPTH, so that the shards its
# threads read at once (a part's reads go in source order) stay open from one read of a shard to
# the next, and a file is reopened only by a later part.
MIN_OPEN = 2 * READ_DEPTH


def max_open() -> int:
    """Shard files a reader holds open: the gate's share of the hard limit on open files (to
    which it raises the soft one at EMFILE), and at least MIN_OPEN. A source of fewer shards keeps
    every one open, as it did: a reopen costs the gate's checks (~35 us of CPU), and a rebuild of
    3,000 shards reopening each at every part (of 945 rows) took 1.9x the CPU seconds."""
    return max(MIN_OPEN, open_files_share())


def local_shards(stream) -> bool:
    """Whether `stream` is read as its shard files on this machine (positional reads, gaps merged)."""
    return isinstance(stream, PackedSource) and isinstance(stream.path, Path)


def plan_reads(us: np.ndarray, ust: np.ndarray, row: int, itemsize: int, streams) -> list[tuple[int, int]]:
    """The reads of rows (us[i], ust[i]): source, first token in its stream, sorted and unique;
    each read a range [lo, hi) of them, within one shard file of one source (a row across two
    shards is a read of its own, by the stream's read_into)."""
    n = len(us)
    if not n:
        return []
    row_bytes = row * itemsize
    gap = np.zeros(n, dtype=np.int64)  # tokens between row i-1's end and row i (i > 0, same source)
    gap[1:] = ust[1:] - ust[:-1] - row
    cut = np.ones(n, dtype=bool)  # a read starts at row i
    cut[1:] = (us[1:] != us[:-1]) | (gap[1:] != 0)
    # the runs of adjacent rows, and which gaps between two of them are merged
    run_of = np.cumsum(cut) - 1
    run_rows = np.bincount(run_of)
    heads = np.flatnonzero(cut)[1:]  # the first row of each run but the first
    gap_bytes = gap[heads] * itemsize
    both = (run_rows[run_of[heads] - 1] + run_rows[run_of[heads]]) * row_bytes
    merge = (us[heads] == us[heads - 1]) & (gap_bytes > 0) & (gap_bytes <= MAX_GAP_BYTES)
    merge &= gap_bytes * GAP_SHARE <= both
    gapped = np.array([local_shards(s) for s in streams], dtype=bool)[us[heads]]
    cut[heads[merge & gapped]] = False
    # a shard file a read: cut where a row's shard is not the row before's, and around a row across two
    for s in np.unique(us).tolist():
        stream = streams[s]
        sel = np.flatnonzero(us == s)
        if not local_shards(stream):
            continue
        first = np.searchsorted(stream.shard_starts, ust[sel], side="right") - 1
        last = np.searchsorted(stream.shard_starts, ust[sel] + row - 1, side="right") - 1
        changed = np.ones(len(sel), dtype=bool)
        changed[1:] = first[1:] != last[:-1]
        cut[sel[changed]] = True
        across = sel[first != last]
        cut[across] = True
        cut[across[across + 1 < n] + 1] = True
    starts = np.flatnonzero(cut)
    ends = np.append(starts[1:], n)
    reads = []
    for lo, hi in zip(starts.tolist(), ends.tolist()):
        reads.extend(_split(lo, hi, ust, row, itemsize))
    return reads


def _split(lo: int, hi: int, ust: np.ndarray, row: int, itemsize: int) -> list[tuple[int, int]]:
    """[lo, hi) as reads of at most MAX_READ_BYTES (but one row) and MAX_GAPS gaps each."""
    end = (ust[lo:hi] + row) * itemsize  # each row's end, in bytes of the stream
    gaps = np.zeros(hi - lo, dtype=np.int64)  # gaps before each row, from lo
    gaps[1:] = np.cumsum(ust[lo + 1 : hi] != ust[lo : hi - 1] + row)
    out, a = [], lo
    while a < hi:
        by_bytes = int(np.searchsorted(end, int(ust[a]) * itemsize + MAX_READ_BYTES, side="right"))
        by_gaps = int(np.searchsorted(gaps, int(gaps[a - lo]) + MAX_GAPS, side="right"))
        b = lo + max(a - lo + 1, min(by_bytes, by_gaps))
        out.append((a, b))
        a = b
    return out


def preadv_all(fd: int, views: list, offset: int) -> int:
    """`views` filled from the file at `offset` (positional: threads share the descriptor);
    a read that returns less goes on from where it stopped. Returns the bytes read (fewer: the
    file ended)."""
    total = sum(v.nbytes for v in views)
    done = 0
    while done < total:
        got = os.preadv(fd, views, offset + done)
        if not got:
            break
        done += got
        while views and got >= views[0].nbytes:
            got -= views[0].nbytes
            views = views[1:]
        if views and got:
            views = [views[0][got:], *views[1:]]
    return done


class SourceReader:
    """The rows' reads, READ_DEPTH of them in flight, through descriptors of the shard files,
    at most `max_open` of them kept open between reads (`_open`) until `close`. Counts `reads`,
    `bytes` (rows and merged gaps) and the most reads that were in flight at once
    (`max_in_flight`)."""

    def __init__(self):
        # (source folder, shard) -> [descriptor, threads using it], least recently used first
        self.fds: OrderedDict[tuple[str, int], list[int]] = OrderedDict()
        self.max_open = max_open()
        self.outside = 0  # descriptors outside `fds`: read_into's own, a file a thread
        self.lock = threading.Lock()
        self.reads = self.bytes = self.in_flight = self.max_in_flight = 0
        self.scratch = memoryview(bytearray(MAX_GAP_BYTES))
        self.pool = None

    def fill(self, streams, us: np.ndarray, ust: np.ndarray, row: int, buf: np.ndarray) -> None:
        """buf[i] (a row of tokens) <- stream us[i]'s tokens [ust[i], ust[i] + row), for (us, ust)
        sorted and unique."""
        itemsize = buf.dtype.itemsize
        reads = plan_reads(us, ust, row, itemsize, streams)
        if not reads:
            return
        if self.pool is None:
            self.pool = ThreadPool(READ_DEPTH, thread_name_prefix="tokpack-read")
        # a few tasks a thread, each a run of reads in source order: a thread's reads follow one another on the disk
        per = max(1, -(-len(reads) // (4 * READ_DEPTH)))
        tasks = [reads[i : i + per] for i in range(0, len(reads), per)]
        futures = [self.pool.submit(self._run, streams, us, ust, row, buf, task) for task in tasks]
        for f in futures:
            f.result()

    def _run(self, streams, us, ust, row, buf, task) -> None:
        raw = buf.reshape(-1).view(np.uint8)
        row_bytes = row * buf.dtype.itemsize
        for lo, hi in task:
            with self.lock:
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                n = self._read(streams[int(us[lo])], ust[lo:hi], row, raw[lo * row_bytes : hi * row_bytes])
            finally:
                with self.lock:
                    self.in_flight -= 1
            with self.lock:
                self.reads += 1
                self.bytes += n

    def _read(self, stream, starts: np.ndarray, row: int, out: np.ndarray) -> int:
        """One read: the rows at stream tokens `starts` (ascending) into `out` (uint8), their bytes
        one after another; returns the bytes read."""
        first, end = int(starts[0]), int(starts[-1]) + row
        k = int(np.searchsorted(stream.shard_starts, first, side="right")) - 1
        runs = (np.flatnonzero(starts[1:] != starts[:-1] + row) + 1).tolist()  # where a run of adjacent rows begins
        if not local_shards(stream) or end > int(stream.shard_starts[k + 1]):
            # a URL, a stream of kept documents, a row across two shards: the stream's own reads,
            # a call a run of adjacent rows (plan_reads merged no gap for them)
            tokens = out.view(stream.dtype)
            with self.lock:  # read_into opens a file at a time: counted in the bound
                self.outside += 1
                self._trim()
            try:
                for a, b in zip([0, *runs], [*runs, len(starts)]):
                    stream.read_into(int(starts[a]), tokens[a * row : b * row], None)
            finally:
                with self.lock:
                    self.outside -= 1
            return out.nbytes
        itemsize = stream.dtype.itemsize
        views, at, mv = [], 0, memoryview(out)
        for a in [*runs, len(starts)]:
            views.append(mv[at * row * itemsize : a * row * itemsize])
            if a < len(starts):  # the gap before row a: read, and dropped
                views.append(self.scratch[: (int(starts[a]) - int(starts[a - 1]) - row) * itemsize])
            at = a
        want = sum(v.nbytes for v in views)
        held = self._open(stream, k)
        try:
            got = preadv_all(held[0], views, (first - int(stream.shard_starts[k])) * itemsize)
        finally:
            self._done(held)
        if got < want:
            raise TokpackError("shard shorter than its manifest says", file=stream.path / stream.shards[k]["path"])
        return got

    def will_need(self, streams, source: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> None:
        """Best-fit: the pieces about to be copied from the mapped shards (source, first token in
        its stream, tokens) asked of the kernel at once (POSIX_FADV_WILLNEED: its read-ahead,
        as many reads in flight as the pieces; adjacent pieces one request), so the copies that
        follow find them in the page cache instead of faulting them in one after another."""
        if not len(source) or not hasattr(os, "posix_fadvise"):
            return
        order = np.lexsort((starts, source))
        s, a, n = source[order].astype(np.int64), starts[order].astype(np.int64), lengths[order].astype(np.int64)
        cut = np.ones(len(s), dtype=bool)
        cut[1:] = (s[1:] != s[:-1]) | (a[1:] > a[:-1] + n[:-1])
        heads = np.flatnonzero(cut)
        ends = np.maximum.reduceat(a + n, heads)
        asked = self.reads
        for i, head in enumerate(heads.tolist()):
            stream, lo, hi = streams[int(s[head])], int(a[head]), int(ends[i])
            if not local_shards(stream):
                continue
            k = int(np.searchsorted(stream.shard_starts, lo, side="right")) - 1
            while lo < hi:  # a range across shards: a request a shard
                top = min(hi, int(stream.shard_starts[k + 1]))
                base = int(stream.shard_starts[k])
                size = stream.dtype.itemsize
                held = self._open(stream, k)  # the kernel's read-ahead goes on once the file is closed
                try:
                    os.posix_fadvise(held[0], (lo - base) * size, (top - lo) * size, os.POSIX_FADV_WILLNEED)
                finally:
                    self._done(held)
                self.reads += 1
                lo, k = top, k + 1
        self.max_in_flight = max(self.max_in_flight, self.reads - asked)  # all asked at once, the kernel's to order

    def _open(self, stream, k: int) -> list[int]:
        """Shard file k of `stream` open through the gate ([descriptor, users]: kept from an
        earlier read, else opened now), in use by this thread until its `_done`: no other
        thread closes it meanwhile."""
        key = (str(stream.path), k)
        with self.lock:
            held = self.fds.get(key)
            if held is None:  # opened under the lock: outside it, 32 threads opening at once took 20% more CPU seconds
                self._trim(room=1)
                size = int(stream.shards[k]["tokens"]) * stream.dtype.itemsize
                held = self.fds[key] = [regular_fd(stream.path / stream.shards[k]["path"], size=size), 0]
            held[1] += 1
            self.fds.move_to_end(key)
            return held

    def _done(self, held: list[int]) -> None:
        with self.lock:
            held[1] -= 1
            self._trim()  # files over the bound while every one was in use: closed as each goes idle

    def _trim(self, room: int = 0) -> None:
        """Under the lock: the least recently used idle files closed until `room` more fit within
        `max_open`, read_into's own counted (more only while more threads than that read at once)."""
        while len(self.fds) + self.outside + room > self.max_open:
            idle = next((k for k, (_, users) in self.fds.items() if not users), None)
            if idle is None:
                break
            os.close(self.fds.pop(idle)[0])

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        for fd, _ in self.fds.values():
            os.close(fd)
        self.fds = OrderedDict()
