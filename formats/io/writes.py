"""Durable writes: a file is written under a temporary name (`tmp_path`) and renamed into
place, so a reader never sees half of it; `DurableFile` writes with O_DIRECT where it can (no
page cache for data read again only by another command), hashing as it writes (unless told
not to); `PlacedFile` is written row by row in any order, each page once when its rows are in,
then hashed in order; `Outbox` sends a command's committed files to an object store."""

from __future__ import annotations

import errno
import os
import posixpath
import re
import uuid
from pathlib import Path

import numpy as np
import xxhash

from ..errors import TokpackError
from .memory import anonymous
from .paths import RemotePath


TMP_MARK = ".tmp-"  # in the name of a file being written: never data, removed by the next run
DIRECT_ALIGN = 4096  # O_DIRECT wants buffer address, length and file offset aligned to the block size
DIRECT_STAGING = 4 << 20  # bytes staged for data that does not arrive aligned


class Outbox:
    """A command's output that goes to an object store (`remote`, a URL): the command writes
    and commits its files under the local folder `local` exactly as for a local output, then
    sends each committed file to the same relative path under `remote`. A data file is removed
    here once sent, so the local disk holds a few shards at a time, not the output; state files
    (JSON: manifests, records of finished work) stay, and a rerun on a fresh machine fetches
    them first. The manifest is sent last: a partial upload never looks complete."""

    def __init__(self, local: str | Path, remote: str):
        self.local = str(Path(local).absolute())
        self.remote = remote.rstrip("/")

    def __repr__(self) -> str:
        return f"Outbox({self.local!r} -> {self.remote!r})"

    def remote_of(self, local: str | Path) -> RemotePath:
        """The object (or prefix) a local file (or folder) under `local` is sent to."""
        rel = Path(local).absolute().relative_to(self.local).as_posix()
        return RemotePath(self.remote if rel == "." else f"{self.remote}/{rel}")

    def send(self, *files: str | Path, keep: bool = False) -> None:
        """Uploads each file, in order, then removes it here unless `keep`."""
        for f in files:
            self.remote_of(f).upload_from(f)
            if not keep:
                os.unlink(f)

    def in_one_process(self) -> bool:
        """fsspec's memory:// lives in the process that writes it: a task elsewhere would send
        its shards where the command never sees them."""
        from fsspec.implementations.memory import MemoryFileSystem

        return isinstance(RemotePath(self.remote).fs, MemoryFileSystem)

    def check_bucket(self) -> None:
        """One line now, not a failed task later, when the bucket is not there."""
        root = RemotePath(self.remote)
        if self.in_one_process():
            return  # no buckets
        bucket = root.key.split("/", 1)[0]
        try:  # not exists(): s3fs answers False for an endpoint that does not answer too
            root._guarded(root.fs.info, "read from", bucket)
        except FileNotFoundError:
            raise TokpackError(
                "no such bucket",
                file=self.remote,
                expected=f"an existing bucket {bucket!r}",
                found="none",
                hint="create it first (aws s3 mb), or check the URL and the endpoint",
            ) from None
        if root.is_file():  # its state would be fetched onto the local folder itself
            raise TokpackError("output exists and is not a directory", file=self.remote, hint="choose another -o")

    def fetch_state(self, manifest: str) -> None:
        """Copies every JSON file under `remote` (the state an earlier run left) to `local`, after
        dropping the local manifests (named `manifest`) the store lacks: only a sent manifest
        makes something complete."""
        root = RemotePath(self.remote)
        found = set(root.call("find", detail=False)) if root.exists() else set()
        for p in Path(self.local).rglob(manifest):
            if posixpath.join(root.key, p.relative_to(self.local).as_posix()) not in found:
                p.unlink()
        keys = sorted(k for k in found if k.endswith(".json"))
        # one batch: fsspec's async stores (s3fs) fetch the many small records concurrently
        for key, data in (root._guarded(root.fs.cat, "read from", keys) if keys else {}).items():
            target = Path(self.local) / posixpath.relpath(key, root.key)
            target.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(target, data)


def tmp_path(final: str | Path) -> Path:
    """A sibling name no reader treats as data (it does not end in .ds or .json)."""
    final = Path(final)
    return final.with_name(f"{final.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def is_tmp_name(name: str) -> bool:
    """Whether `name` is one tmp_path gives (FINAL.tmp-PID-RANDOM): nothing else is removed as
    a leftover."""
    return _TMP_NAME.fullmatch(name) is not None


_TMP_NAME = re.compile(".+" + re.escape(TMP_MARK) + "[0-9]+-[0-9a-f]{8}")


def commit_file(tmp: str | Path, final: str | Path, fsync: bool = False) -> None:
    if fsync:
        _fsync(tmp)
    os.replace(tmp, final)


def write_bytes_atomic(path: str | Path, data: bytes, fsync: bool = False) -> None:
    tmp = tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
    except OSError as e:
        if e.filename is None:  # a write's error (a full disk...) names no file: its line must say which
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    commit_file(tmp, path, fsync=fsync)


def fsync_dir(directory: str | Path) -> None:
    """Makes the renames into `directory` durable."""
    _fsync(directory, refusable=True)  # some filesystems refuse fsync on a directory; the renames are still atomic


def _fsync(path: str | Path, refusable: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        if not refusable:
            raise
    finally:
        os.close(fd)


def remove_tmp_files(directory: str | Path) -> None:
    """Leftovers of a killed run: never data, safe to delete."""
    directory = Path(directory)
    if directory.is_dir():
        for p in directory.iterdir():
            if is_tmp_name(p.name) and p.is_file():
                p.unlink(missing_ok=True)


class TmpFile:
    """A file under its temporary name (tmp_path), its bytes hashed and counted as they come
    (`count`), fsync'd and renamed into place (`commit_file`), or removed (`abort`): what
    DurableFile and PlacedFile share. `hashed=False`: counted only, for a file whose manifest
    entry records no checksum of it (an epoch shard's token file: its row hashes vouch for it,
    docs/FORMAT.md), which saves a pass over every byte."""

    def __init__(self, final: str | Path, hashed: bool = True):
        self.final = Path(final)  # the name it gets on commit
        self.tmp = tmp_path(final)  # the name it is written under
        self.fd: int | None = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # None once closed
        self.hash = xxhash.xxh3_128() if hashed else None  # of every byte counted
        self.bytes = 0  # counted so far

    def count(self, data) -> memoryview:
        """`data` hashed (if `hashed`) and counted, as the file's next bytes; returned as bytes."""
        mv = memoryview(data).cast("B")
        if self.hash is not None:
            self.hash.update(mv)
        self.bytes += mv.nbytes
        return mv

    def commit_file(self) -> str | None:
        """The file synced and renamed into place; its xxh3_128 hex digest (None: not `hashed`)."""
        os.fdatasync(self.fd)
        self._close()
        os.replace(self.tmp, self.final)
        return None if self.hash is None else self.hash.hexdigest()

    def _close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def abort(self) -> None:
        """Closes and deletes the temporary file; safe after a failed write or commit."""
        self._close()
        Path(self.tmp).unlink(missing_ok=True)


class DurableFile(TmpFile):
    """A file written under a temporary name, hashed as it goes, and fsync'd and renamed on
    commit: once committed, it survives a crash.

    `direct=True` (for shard data, written once in large pieces) writes with O_DIRECT: the
    disk reads the bytes straight from our buffers. Buffered writes first copy every byte into
    freshly allocated page-cache pages and only reach the disk at fsync, which takes about twice
    as long, and starting writeback early with sync_file_range does not help (BENCHMARKS.md,
    "Figures cited by the code": O_DIRECT shard writes). Data that arrives at an unaligned
    address is copied through a small staging buffer; the last partial block is written padded
    and the file truncated to its length. Filesystems without O_DIRECT (tmpfs) get buffered
    writes."""

    def __init__(self, final: str | Path, direct: bool = False, hashed: bool = True):
        # self.bytes: written so far (the file may hold fewer until commit, see _staged)
        super().__init__(final, hashed)
        self._staging: memoryview | None = None  # O_DIRECT only: the unaligned tail, not yet written
        self._staged = 0  # bytes in _staging
        try:
            self.direct = bool(direct) and _set_direct(self.fd, True)  # O_DIRECT in effect
            if self.direct:
                self._staging = memoryview(anonymous(DIRECT_STAGING))
        except BaseException:
            self.abort()
            raise

    def write(self, data) -> None:
        mv = self.count(data)
        if self._staging is None:
            self._write_all(mv)
            return
        while mv.nbytes:
            # straight from `mv` when aligned, but only once the staging block is written: the file
            # offset is unaligned until then
            if not self._staged and mv.nbytes >= DIRECT_ALIGN and _address(mv) % DIRECT_ALIGN == 0:
                k = mv.nbytes - mv.nbytes % DIRECT_ALIGN
                self._write_all(mv[:k])
                mv = mv[k:]
                continue
            take = min(mv.nbytes, DIRECT_STAGING - self._staged)
            self._staging[self._staged : self._staged + take] = mv[:take]
            self._staged += take
            mv = mv[take:]
            if self._staged == DIRECT_STAGING:
                self._write_all(self._staging)
                self._staged = 0

    def _write_all(self, mv: memoryview) -> None:
        while mv.nbytes:
            try:
                n = os.write(self.fd, mv)
            except OSError as e:
                if e.errno != errno.EINVAL or self._staging is None:
                    raise
                _set_direct(self.fd, False)  # this filesystem takes O_DIRECT at open but not at write
                self.direct = False
                n = os.write(self.fd, mv)
            mv = mv[n:]

    def commit(self) -> str | None:
        """Returns the xxh3_128 hex digest (None: not `hashed`)."""
        if self._staged:
            pad = -self._staged % DIRECT_ALIGN
            self._staging[self._staged : self._staged + pad] = bytes(pad)
            self._write_all(self._staging[: self._staged + pad])
            os.ftruncate(self.fd, self.bytes)
            self._staged = 0
        return self.commit_file()

    def _close(self) -> None:
        self._staging = None
        super()._close()


class HashedFile:
    """A DurableFile whose bytes are hashed and counted, never written: a file whose checksum a
    manifest needs where the file itself lives elsewhere (a linking pack's shard files, which
    are the input's; a --to-nodes owned epoch shard's index, the nodes' slices')."""

    def __init__(self, final: str | Path, direct: bool = False):
        self.final, self.hash, self.bytes = Path(final), xxhash.xxh3_128(), 0

    write = TmpFile.count  # hashed and counted, as a TmpFile's bytes are

    def commit(self) -> str:
        return self.hash.hexdigest()

    def abort(self) -> None:
        pass


PAGE = 4096  # the page cache's unit (4 KiB pages): what the kernel writes back at once, a whole page
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 16  # pieces a pwritev takes at most


class RowPages:
    """The pages of a file of `rows` rows of `row_bytes` bytes whose rows arrive in any order:
    which are complete (every byte's row in), so that each page is written once, whole, when
    its last row arrives, and the kernel writes it back once. A row's bytes stay where the
    caller said (its start in the caller's data) until its pages are written: its completion
    (one bool a row) and that start are all that is kept."""

    def __init__(self, rows: int, row_bytes: int):
        self.row_bytes, self.size = row_bytes, rows * row_bytes
        self.done = np.zeros(rows, dtype=bool)
        self.start = np.zeros(rows, dtype=np.int64)

    def add(self, rows: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Rows `rows` (each at most once a file) now complete, row rows[k]'s bytes at byte
        starts[k] of the caller's data: (lo, hi, pieces, cuts): the runs [lo, hi) of the file
        whose pages are complete now and were not before, in order, each page-aligned but at the
        file's end; run k's bytes are the caller's bytes [pieces[0][j], pieces[1][j]) for j in
        cuts[k]:cuts[k + 1], in order (a piece of a row each)."""
        rows, starts = np.asarray(rows, dtype=np.int64), np.asarray(starts, dtype=np.int64)
        order = np.argsort(rows, kind="stable")
        rows, starts = rows[order], starts[order]
        twice = self.done[rows]
        twice[1:] |= rows[1:] == rows[:-1]
        if twice.any():
            raise TokpackError(
                "internal error: a row was placed twice in its file",
                where=f"row {int(rows[twice][0])}",
                hint="report this with the command line",
            )
        self.done[rows], self.start[rows] = True, starts
        L = self.row_bytes
        first, last = rows * L // PAGE, ((rows + 1) * L - 1) // PAGE  # each row's first and last page
        # a row's pages between its first and last are its own; those two may share its neighbours'
        lo = np.where(self.complete(first), first, first + 1) * PAGE
        hi = np.minimum(np.where(self.complete(last), last + 1, last) * PAGE, self.size)
        keep = lo < hi
        lo, hi = lo[keep], hi[keep]
        # rows in file order: lo and hi never decrease; a run overlapping or touching the one
        # before (a page two rows complete at once) joins it
        new = np.ones(len(lo), dtype=bool)
        new[1:] = lo[1:] > hi[:-1]
        lo, hi = lo[new], hi[np.append(new[1:], True)[: len(new)]]  # each run's first lo, last hi
        return (lo, hi, *self.pieces(lo, hi))

    def complete(self, pages: np.ndarray) -> np.ndarray:
        """Whether every row with a byte in each of `pages` is in."""
        L = self.row_bytes
        r0, r1 = pages * PAGE // L, (np.minimum((pages + 1) * PAGE, self.size) - 1) // L
        ok = np.ones(len(pages), dtype=bool)
        for j in range(int((r1 - r0).max(initial=0)) + 1):  # a page's rows: 2 at most once rows are a page long
            ok &= self.done[np.minimum(r0 + j, r1)]
        return ok

    def pieces(self, lo: np.ndarray, hi: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
        """Runs [lo, hi) of complete rows' bytes as pieces of the caller's data, a row each."""
        L = self.row_bytes
        r0, r1 = lo // L, (hi - 1) // L
        n = r1 - r0 + 1
        cuts = np.zeros(len(n) + 1, dtype=np.int64)
        np.cumsum(n, out=cuts[1:])
        run = np.repeat(np.arange(len(n)), n)
        row = r0[run] + np.arange(cuts[-1]) - cuts[run]
        a, b = np.maximum(lo[run], row * L), np.minimum(hi[run], (row + 1) * L)
        s = self.start[row] - row * L
        return (a + s, b + s), cuts


class PlacedFile(TmpFile):
    """A file of equal rows written in place, in any order, as the caller completes them
    (`place`: `shuffle --to-nodes` writes each row of a rank file as its round places it):
    buffered writes of whole pages, each once, when all the rows it holds are in (RowPages), so
    that the kernel writes each page back once, past its background threshold
    (vm.dirty_background_*; what is below it, commit's fsync writes), while the caller goes on
    (3 GiB of 4098-byte rows in random order on 4 processes: 3.1 GB written to the disk, 4.6 GB
    when each row was written as it came, its pages shared with rows still to come). Nothing
    asks the kernel to start that writeback sooner: sync_file_range(SYNC_FILE_RANGE_WRITE)
    after each call blocked its caller 0.1-0.4 s a call, and on 2 cores the epoch was slower
    for it, though commit's fsync then had a third as much left to write.
    O_DIRECT would want aligned rows, and the pages are written from the caller's rows, not a
    copy. Those pages are the kernel's page cache, and the kernel holds a writer back past
    vm.dirty_ratio: memory stays bounded. Then the file's bytes in order are counted (and, if
    `hashed`, hashed) from the caller's copy (`write`: nothing read back or written again), and
    `commit` fsyncs and renames it, as DurableFile's. The bytes placed must be exactly those
    counted, or commit refuses."""

    def __init__(self, final: str | Path, hashed: bool = True):
        super().__init__(final, hashed)
        self.placed, self.size, self.pages = 0, 0, RowPages(0, 1)

    def reserve(self, rows: int, row_bytes: int) -> None:
        """The file at its final size, `rows` rows of `row_bytes` bytes (a sparse file: no block
        written twice), so that a row's place never depends on which came first."""
        os.ftruncate(self.fd, rows * row_bytes)
        self.size, self.pages = rows * row_bytes, RowPages(rows, row_bytes)

    def place(self, data: memoryview, starts: np.ndarray, rows: np.ndarray) -> None:
        """Rows `rows` of the file, now complete in `data` (bytes: the same buffer each call),
        row rows[k] at byte starts[k], left unchanged there until `write` hashes them: the pages
        they complete written now, a run of pages a write."""
        lo, hi, (a, b), cuts = self.pages.add(rows, starts)
        pieces = [data[x:y] for x, y in zip(a.tolist(), b.tolist())]
        c = cuts.tolist()
        for k, (o, n) in enumerate(zip(lo.tolist(), (hi - lo).tolist())):
            self.write_at(o, pieces[c[k] : c[k + 1]], n)

    def write_at(self, offset: int, pieces: list[memoryview], length: int) -> None:
        """`pieces` (bytes, `length` in all) one after the other at byte `offset` of the file:
        a pwritev (of IOV_MAX pieces at most), no copy."""
        at = offset
        for c in range(0, len(pieces), IOV_MAX):
            some = pieces if len(pieces) <= IOV_MAX else pieces[c : c + IOV_MAX]
            want = length if some is pieces else sum(p.nbytes for p in some)
            n = os.pwritev(self.fd, some, at)
            if n < want:  # a short write (a signal, a full disk): the rest, whose error is raised
                rest = memoryview(b"".join(some))
                while n < want:
                    n += os.pwrite(self.fd, rest[n:], at + n)
            at += want
        self.placed += length

    # The next bytes of the file, in order, already placed: hashed (if `hashed`), counted, not written.
    write = TmpFile.count

    def commit(self) -> str | None:
        """Returns the xxh3_128 hex digest (None: not `hashed`)."""
        if not self.bytes == self.placed == self.size:
            raise TokpackError(
                "internal error: a file's bytes written in place are not the bytes hashed",
                file=self.final,
                expected=f"{self.size} bytes placed and hashed",
                found=f"{self.placed} placed, {self.bytes} hashed",
                hint="report this with the command line",
            )
        return self.commit_file()


def _set_direct(fd: int, on: bool) -> bool:
    """Turns O_DIRECT on or off for an open file; False where the OS or filesystem refuses."""
    if not hasattr(os, "O_DIRECT"):
        return False
    import fcntl

    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError:
        return False
    return True


def _address(mv: memoryview) -> int:
    return np.frombuffer(mv, dtype=np.uint8).ctypes.data if mv.nbytes else 0
