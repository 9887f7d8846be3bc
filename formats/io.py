"""The I/O layer every stage reads and writes through: local paths and fsspec URLs behind one
set of file calls, read-until-full, anonymous private mappings, reusable buffers a reader owns,
memory-mapped reads, the one pipelining idiom (`Worker`: calls run in order in one thread, a
bounded number ahead), atomic and O_DIRECT writes, and progress (a bar on a terminal, a line every 30 s in a log)."""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import posixpath
import re
import stat
import sys
import threading
import time
import uuid
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Iterator

import numpy as np
import xxhash

from .errors import TokpackError

# Reads and checksums stream through buffers of this size: large enough to keep the
# disk busy, small enough that memory does not depend on file size.
IO_BLOCK = 16 << 20
TMP_MARK = ".tmp-"  # in the name of a file being written: never data, removed by the next run
DIRECT_ALIGN = 4096  # O_DIRECT wants buffer address, length and file offset aligned to the block size
DIRECT_STAGING = 4 << 20  # bytes staged for data that does not arrive aligned
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14
STOP_GRACE = 2.0  # seconds a stopped pool waits for its running calls (ThreadPool)

_FREE_BUFFERS: dict = {}  # (use, dtype) -> [Buffer]: reusable buffers that no live reader holds
_FREE_LOCK = threading.Lock()


# ---------------------------------------------------------------- local paths and URLs


def is_url(path) -> bool:
    return "://" in str(path)


def local_path(path) -> str | None:
    """The local path a plain path or a `file://` URL names; None for other fsspec URLs."""
    text = str(path)
    if not is_url(text):
        return text
    if text.startswith("file://"):
        from fsspec.implementations.local import make_path_posix

        return make_path_posix(text[len("file://") :])
    return None


def as_path(path) -> "Path | RemotePath":
    """A `pathlib.Path` for a local path (plain os calls, nothing in between), a RemotePath for
    any other fsspec URL."""
    if isinstance(path, (Path, RemotePath)):
        return path
    local = local_path(path)
    return Path(local) if local is not None else RemotePath(str(path))


class RemotePath:
    """A file or folder at an fsspec URL (s3://bucket/key...) with the pathlib calls tokpack's
    readers make, so one code path reads local files and objects alike. The filesystem is
    fsspec's (s3fs for s3://: credentials and endpoint from the standard AWS environment)."""

    def __init__(self, url: str, fs=None):
        self.url = url.rstrip("/")  # as given, scheme included: what messages and manifests name
        if fs is None:
            from fsspec.core import url_to_fs

            fs = url_to_fs(self.url)[0]
        self.fs = fs
        self.key = fs._strip_protocol(self.url)  # the path the filesystem knows it by

    def __str__(self) -> str:
        return self.url

    __repr__ = __str__

    def __eq__(self, other) -> bool:
        return isinstance(other, RemotePath) and self.url == other.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __lt__(self, other) -> bool:
        return self.url < str(other)

    def __truediv__(self, name) -> "RemotePath":
        return RemotePath(f"{self.url}/{name}", self.fs)

    name = property(lambda self: posixpath.basename(self.url))
    suffix = property(lambda self: posixpath.splitext(self.name)[1])
    stem = property(lambda self: posixpath.splitext(self.name)[0])
    parent = property(lambda self: RemotePath(posixpath.dirname(self.url), self.fs))

    def with_name(self, name: str) -> "RemotePath":
        return self.parent / name

    def with_suffix(self, suffix: str) -> "RemotePath":
        return self.parent / (self.stem + suffix)

    def is_absolute(self) -> bool:
        return True

    def resolve(self) -> "RemotePath":
        return self

    def call(self, method: str, *args, **kw):
        """The filesystem's `method` on this path. Its own errors other than OSError's (botocore's
        for an endpoint that does not answer, expired credentials...) become one line naming
        the URL; not found and denied stay OSErrors, as for a local file."""
        return self._guarded(getattr(self.fs, method), "read from", self.key, *args, **kw)

    def _guarded(self, fn, doing: str, *args, **kw):
        try:
            return fn(*args, **kw)
        except OSError as e:
            if e.filename is None:  # s3fs's errors name no object
                raise type(e)(e.errno, e.strerror or str(e), self.url) from None
            raise
        except Exception as e:  # noqa: BLE001 - whatever the fsspec backend raises
            raise TokpackError(
                f"cannot {doing} the object store",
                file=self.url,
                found=f"{type(e).__name__}: {e}",
                hint="check the URL, the endpoint (AWS_ENDPOINT_URL) and the credentials",
            ) from None

    def upload_from(self, local: str | Path) -> None:
        """This object written whole from a local file. An object store has no rename, but an
        object appears only once its upload is complete (one PUT, or a multipart upload's
        completion), which is what a rename gives a local file."""
        self._guarded(self.fs.put_file, "write to", str(local), self.key)

    def unlink(self, missing_ok: bool = False) -> None:
        if missing_ok and not self.exists():
            return
        self._guarded(self.fs.rm_file, "write to", self.key)

    def remove_tree(self) -> None:
        """Every object under this prefix deleted; nothing there is fine."""
        if self.exists():
            self._guarded(self.fs.rm, "write to", self.key, recursive=True)

    def replace(self, other: "RemotePath") -> None:
        """pathlib's rename onto `other`: a copy inside the store (no bytes through this
        machine), then this object deleted."""
        self._guarded(self.fs.mv, "write to", self.key, other.key)

    def exists(self) -> bool:
        return self.call("exists")

    def is_dir(self) -> bool:
        return self.call("isdir")

    def is_file(self) -> bool:
        return self.call("isfile")

    def is_symlink(self) -> bool:
        return False  # a store has no links

    def iterdir(self) -> Iterator["RemotePath"]:
        return (self / posixpath.basename(k.rstrip("/")) for k in self.call("ls", detail=False))

    def stat(self) -> os.stat_result:
        return os.stat_result((0, 0, 0, 0, 0, 0, self.call("size"), 0, 0, 0))

    def read_bytes(self) -> bytes:
        return self.call("cat_file")

    def read_text(self) -> str:
        return self.read_bytes().decode("utf-8")


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


# ------------------------------------------------------------------------------- the gate

# Every read of a file tokpack did not just write goes through `gate` (docs/COMMANDS.md, "The
# gate"): manifests, shards and their sidecars, rank files, the run a slice is checked against,
# work records and scratch files, and (regular-file rule only) a user's input files. Three rules:
# - containment (issue 24): the file resolves inside the folder whose manifest names it, or
#   whose work it holds; no `..`, no absolute name, no symlink leaving it, also through a
#   symlinked folder on the way. A name a manifest gives is checked first, as a string
#   (`contained`), so validate can report it without touching the disk;
# - regular files only: a FIFO, a socket, a device or a directory is refused before it can
#   block a read or feed endless bytes;
# - the recorded size, when the caller knows it: a longer or shorter file is refused before use.
# A bucket has no symlinks and no odd file types: a URL is checked by its size only.
# tests/test_layout.py fails when product code opens a file anywhere but in this module.


def name_problem(name) -> str | None:
    """Why `name` is not a plain file name (None when it is): the string half of the rule,
    which needs no filesystem."""
    if not isinstance(name, str):
        return "not a string"
    if not name:
        return "empty"
    if "\0" in name:
        return "holds a NUL byte"
    if name.startswith("/"):
        return "an absolute path"
    if name in (".", "..") or ".." in name.split("/"):
        return "climbs out with '..'"
    if "/" in name or "\\" in name:
        return "holds a path separator"
    return None


def contained(
    directory, name, *, manifest=None, where: str | None = None, regular: bool = True, siblings: tuple[str, ...] = ()
) -> "Path | RemotePath":
    """`directory / name`, for a `name` that a manifest (`manifest`, its field `where`) gives,
    once it is known to stay inside `directory` (and, with `regular`, to be a regular file if it
    exists); so are `name + s` for each suffix s in `siblings` (a shard's other files). A
    TokpackError naming the field otherwise. Nothing is opened: validate reports such a name
    as CORRUPT without reading what it points at."""
    directory = as_path(directory)
    why, found = name_problem(name), name
    if not why and isinstance(directory, Path):
        base = os.fspath(directory)
        for found in (name, *(name + s for s in siblings)):
            why = _leaves(base, found, regular)
            if why:
                break
    if why:
        raise TokpackError(
            f"manifest names a file outside its folder ({why})",
            file=manifest if manifest is not None else directory,
            where=where,
            expected=f"a file name inside {directory}",
            found=repr(found)[:120],
            hint="a manifest names only files in its own folder (docs/FORMAT.md); restore the "
            "manifest (and files) from the run that wrote them, or do not trust this copy",
        )
    return directory / name


def _leaves(base: str, name: str, regular: bool) -> str | None:
    """How the file `name` of the local folder `base` leaves it (None: it does not, or is missing;
    a missing file is its reader's to report)."""
    path = os.path.join(base, name)
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISLNK(mode):
        why = _outside(path, base)
        if why:
            return why
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            return None
    if regular and not stat.S_ISREG(mode):
        raise _not_regular(path, mode)
    return None


def _outside(path: str, folder) -> str | None:
    """How the local `path` resolves outside `folder` (None: it stays inside): the symlink rule,
    for the file itself and for every folder on the way."""
    target, root = os.path.realpath(path), os.path.realpath(folder)
    if os.path.commonpath([root, target]) == root:
        return None
    if os.path.islink(path):
        return f"a symlink to {target}, outside the folder"
    return f"resolves to {target} through a symlinked folder, outside the folder"


_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _not_regular(path, mode: int) -> TokpackError:
    what = next((text for test, text in _FILE_KINDS if test(mode)), "not a regular file")
    return TokpackError(
        "not a regular file",
        file=path,
        expected="a regular file",
        found=what,
        hint="tokpack reads data only from regular files; remove or replace it",
    )


def gate(
    path, *, folder=None, size: int | None = None, user: bool = False, what: str = "file", hint: str | None = None
) -> int:
    """The one check before any file is read; returns its size. `path` must resolve inside
    `folder` (default: the folder it sits in; a folder named by a manifest is itself checked
    against its dataset with `contained` before its files are read), be a regular file, and,
    given `size` (what its manifest or record says), hold exactly that many bytes. `user=True`:
    a file the user named (a pack input, a schedule), which may live anywhere: only the
    regular-file rule. A missing file raises FileNotFoundError (its caller names what is
    missing); anything else refused is one TokpackError line naming the file."""
    path = as_path(path)
    if isinstance(path, RemotePath):
        found = path.stat().st_size
    else:
        if not user:
            why = _outside(os.fspath(path), path.parent if folder is None else folder)
            if why:
                raise TokpackError(
                    f"{what} is outside its folder ({why})",
                    file=path,
                    expected=f"a file inside {path.parent if folder is None else folder}",
                    found=os.path.realpath(path),
                    hint='a dataset\'s files stay in its folder (docs/COMMANDS.md, "Containment"): '
                    "replace the link by the file, or restore the dataset from the run that wrote it",
                )
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode)
        found = st.st_size
    if size is not None and found != size:
        raise _wrong_size(path, what, size, found, hint)
    return found


def _wrong_size(path, what: str, size: int, found: int, hint: str | None) -> TokpackError:
    return TokpackError(
        f"{what} size does not match the manifest",
        file=path,
        where="size",
        expected=f"{size} bytes",
        found=f"{found} bytes",
        hint=hint
        or "the file was truncated, extended or replaced since its manifest was written; "
        "run `tokpack validate` on its dataset, or restore it from the original",
    )


def regular_fd(path, **rules) -> int:
    """A read-only descriptor of the local file `path` once it passes the gate (`rules`: gate's
    keywords). A FIFO, a socket or a device never blocks the open: the file is checked first,
    then opened with O_NONBLOCK (in case it was swapped in between) and checked again on the
    descriptor."""
    gate(path, **rules)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode)
        if rules.get("size") is not None and st.st_size != rules["size"]:
            raise _wrong_size(path, rules.get("what", "file"), rules["size"], st.st_size, rules.get("hint"))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def regular_size(path, **rules) -> int:
    """The size of `path` (local or URL) once it passes the gate."""
    return gate(path, **rules)


def read_limited(path, limit: int, what: str, **rules) -> bytes:
    """The whole of a small file (a manifest, a record) of at most `limit` bytes, through the
    gate: its size is checked before anything is read, so a huge file costs no memory."""
    path = as_path(path)
    size = gate(path, what=what, **rules)
    if size > limit:
        raise TokpackError(
            f"{what} is too large",
            file=path,
            expected=f"at most {limit:,} bytes",
            found=f"{size:,} bytes",
            hint=f"this is not a {what} tokpack wrote; restore it",
        )
    if isinstance(path, RemotePath):
        return path.read_bytes()
    with open_read(path, ahead=False, **rules) as f:
        return f.read(size + 1)  # an unbuffered read allocates what it is asked for: the size, not the limit


def open_read(path, block: int = IO_BLOCK, ahead: bool = True, **rules):
    """`path` (local path or URL), through the gate, opened for reads front to back (`readinto`,
    `read`, `seek`): a local file unbuffered, with the kernel's read-ahead; a URL through
    fsspec's read-ahead cache, one ranged GET per `block` bytes, so memory holds a block or two,
    never the file. `ahead=False`, for reads at scattered places: no read-ahead, a URL fetches
    what is asked."""
    path = as_path(path)
    if isinstance(path, RemotePath):
        if rules.get("size") is not None:
            gate(path, **rules)
        return path.call("open", "rb", block_size=block, cache_type="readahead" if ahead else "none")
    f = open(regular_fd(path, **rules), "rb", buffering=0)
    if ahead:
        sequential(f)
    return f


def read_array(path, dtype, count: int = -1, offset: int = 0, **rules) -> np.ndarray:
    """Up to `count` items (-1: to the end) of `dtype` at byte `offset`, through the gate; fewer
    where the file ends, as np.fromfile. A URL costs one ranged GET."""
    path = as_path(path)
    if isinstance(path, Path):
        with open_read(path, ahead=False, **rules) as f:
            return np.fromfile(f, dtype=dtype, count=count, offset=offset)
    if rules.get("size") is not None:
        gate(path, **rules)
    dtype = np.dtype(dtype)
    data = path.call("cat_file", start=offset, end=None if count < 0 else offset + count * dtype.itemsize)
    return np.frombuffer(data, dtype=dtype, count=len(data) // dtype.itemsize)


def open_append(path, *, folder):
    """A file of tokpack's own work folder `folder` (a bucket or scratch file) opened to append
    to: it must stay inside the folder and be a regular file if it exists (never a symlink out,
    never a FIFO that would block the write)."""
    why = _outside(os.fspath(path), folder)
    if why:
        raise TokpackError(
            f"work file is outside its work folder ({why})",
            file=path,
            expected=f"a file inside {folder}",
            hint="the work folder holds only tokpack's own files: delete it and rerun",
        )
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return open(fd, "ab")


def open_new(path, buffering: int = -1):
    """A file tokpack creates to write whole (a temporary of tmp_path, or a file of a folder it
    is building under a temporary name, renamed once complete): created or truncated, never
    written through a symlink."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    return open(fd, "wb", buffering=buffering)


def hash_mapped(h, fd: int, offset: int, length: int) -> None:
    """Feeds bytes [offset, offset+length) of a gated descriptor to `h` through a memory map of
    just that range (page-cache pages, no copy), so resident memory stays at one block."""
    skip = offset % mmap.ALLOCATIONGRANULARITY  # map offsets must be aligned
    with mmap.mmap(fd, length + skip, offset=offset - skip, access=mmap.ACCESS_READ) as mm:
        if hasattr(mm, "madvise"):
            mm.madvise(mmap.MADV_SEQUENTIAL)
        with memoryview(mm) as view, view[skip:] as chunk:
            h.update(chunk)


def map_array(path, dtype, **rules) -> np.ndarray:
    """A whole local file, through the gate, as a read-only array (np.memmap: its pages are
    read when used, none up front)."""
    with open_read(path, ahead=False, **rules) as f:
        return np.memmap(f, dtype=dtype, mode="r")


# ------------------------------------------------------------------------------ reads


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


def sequential(f) -> None:
    """Tells the kernel to read ahead: the file is read once, front to back."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)


def iter_file_blocks(
    path: str | Path, buf: bytearray, offset: int = 0, length: int | None = None, **rules
) -> Iterator[memoryview]:
    """Sequential `readinto` over [offset, offset+length) of a file (through the gate: `rules`),
    reusing one buffer."""
    view = memoryview(buf)
    with open_read(path, **rules) as f:
        f.seek(offset)
        remaining = length if length is not None else os.fstat(f.fileno()).st_size - offset
        while remaining > 0:
            n = f.readinto(view[: min(len(buf), remaining)])
            if not n:
                raise TokpackError(
                    "file shorter than expected",
                    file=path,
                    where=f"byte {offset}",
                    expected="more data",
                    found="end of file",
                )
            remaining -= n
            offset += n
            yield view[:n]


def map_file(path: Path, offset: int, length: int, **rules) -> np.ndarray:
    """Bytes [offset, offset+length) of a file (through the gate: `rules`), memory-mapped
    read-only and read ahead in one sequential sweep. Mapping the page cache costs no fresh
    memory, unlike a read into a buffer."""
    if length <= 0:
        gate(path, **rules)
        return np.empty(0, dtype=np.uint8)
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    with open_read(path, ahead=False, **rules) as f:
        m = mmap.mmap(f.fileno(), offset + length - start, prot=mmap.PROT_READ, offset=start)
    view = np.frombuffer(m, dtype=np.uint8)
    if not _populate(view.ctypes.data, len(m)):  # older kernels: a sequential read fills the page cache
        for _ in iter_file_blocks(path, bytearray(IO_BLOCK), offset, length, **rules):
            pass
    return view[offset - start : offset - start + length]


def _load_madvise():
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


_MADVISE = _load_madvise()


def _populate(address: int, length: int) -> bool:
    """MADV_POPULATE_READ: reads the mapping in with the kernel's read-ahead. Called through
    ctypes, which releases the GIL for the second it takes (mmap.madvise holds it), so other
    threads work on the parts already read."""
    return _MADVISE is not None and _MADVISE(address, length, MADV_POPULATE_READ) == 0


# ---------------------------------------------------------------------------- buffers


def anonymous(nbytes: int, populate: bool = False) -> np.ndarray:
    """A zero-filled uint8 buffer backed by an anonymous private mapping, with transparent huge
    pages requested: first-touch page faults cost less than on plain 4 KiB pages (BENCHMARKS.md,
    "Figures cited by the code": huge pages). `populate`: its pages faulted in at once, by the
    kernel in bulk (MAP_POPULATE), for a buffer that will be written whole: 256 MiB in 0.1 s
    where touching it page by page took 0.6 s here."""
    # MAP_PRIVATE: Python's default for anonymous maps is MAP_SHARED, which a forked worker
    # would share with its parent, and the two would overwrite each other's bytes.
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    m = mmap.mmap(-1, max(int(nbytes), 1), flags=flags)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return np.frombuffer(m, dtype=np.uint8)


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


# ------------------------------------------------------------------------- pipelining


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


# ----------------------------------------------------------------------------- writes


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


def read_record(path: str | Path, **rules) -> dict | None:
    """A JSON object tokpack wrote to record its work (a request, a finished task), read
    through the gate (`rules`: by default it stays in its folder); None when it is missing or
    damaged (truncated, edited, not an object, not a regular file, a link out of its folder):
    such a record vouches for nothing, and the work it names is done again or refused, never
    a crash."""
    try:
        record = json.loads(read_limited(path, MAX_RECORD_BYTES, "record", **rules))
    except (FileNotFoundError, ValueError, RecursionError, TokpackError):
        return None
    return record if isinstance(record, dict) else None


MAX_RECORD_BYTES = 1 << 30  # a pack's finishing plan lists every shard; no record comes near this


def write_bytes_atomic(path: str | Path, data: bytes, fsync: bool = False) -> None:
    tmp = tmp_path(path)
    with open(tmp, "wb") as f:
        f.write(data)
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


class DurableFile:
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

    def __init__(self, final: str | Path, direct: bool = False):
        self.final = Path(final)  # the name it gets on commit
        self.tmp = tmp_path(final)  # the name it is written under
        self.fd: int | None = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # None once closed
        self.hash = xxhash.xxh3_128()  # of every byte written
        self.bytes = 0  # written so far (the file may hold fewer until commit, see _staged)
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
        mv = memoryview(data).cast("B")
        self.hash.update(mv)
        self.bytes += mv.nbytes
        if self._staging is None:
            self._write_all(mv)
            return
        if self._staged:  # top the staging block up first: the file offset is unaligned until it is written
            take = min(mv.nbytes, DIRECT_STAGING - self._staged)
            self._staging[self._staged : self._staged + take] = mv[:take]
            self._staged += take
            mv = mv[take:]
            if self._staged == DIRECT_STAGING:
                self._write_all(self._staging)
                self._staged = 0
        if mv.nbytes >= DIRECT_ALIGN and _address(mv) % DIRECT_ALIGN == 0:
            k = mv.nbytes - mv.nbytes % DIRECT_ALIGN
            self._write_all(mv[:k])
            mv = mv[k:]
        while mv.nbytes:
            take = min(mv.nbytes, DIRECT_STAGING)
            self._staging[:take] = mv[:take]
            self._staged = take
            mv = mv[take:]
            if take == DIRECT_STAGING:
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

    def commit(self) -> str:
        """Returns the xxh3_128 hex digest."""
        if self._staged:
            pad = -self._staged % DIRECT_ALIGN
            self._staging[self._staged : self._staged + pad] = bytes(pad)
            self._write_all(self._staging[: self._staged + pad])
            os.ftruncate(self.fd, self.bytes)
            self._staged = 0
        os.fdatasync(self.fd)
        self._close()
        os.replace(self.tmp, self.final)
        return self.hash.hexdigest()

    def _close(self) -> None:
        fd, self.fd, self._staging = self.fd, None, None
        if fd is not None:
            os.close(fd)

    def abort(self) -> None:
        """Closes and deletes the temporary file; safe after a failed write or commit."""
        self._close()
        Path(self.tmp).unlink(missing_ok=True)


class HashedFile:
    """A DurableFile whose bytes are hashed and counted, never written: a file whose checksum a
    manifest needs where the file itself lives elsewhere (a linking pack's shard files, which
    are the input's; a --to-nodes owned epoch shard's tokens and index, the nodes' slices')."""

    def __init__(self, final: str | Path, direct: bool = False):
        self.final, self.hash, self.bytes = Path(final), xxhash.xxh3_128(), 0

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        self.hash.update(mv)
        self.bytes += mv.nbytes

    def commit(self) -> str:
        return self.hash.hexdigest()

    def abort(self) -> None:
        pass


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


# --------------------------------------------------------------------------- progress

# In a log (stderr not a terminal: sbatch, nohup, CI) a long step writes one line this often, in
# seconds, while it runs; 0: none. `--log-interval` sets it for a command and the worker processes
# it starts, through this variable (its one home).
LOG_INTERVAL_ENV = "TOKPACK_LOG_INTERVAL"
DEFAULT_LOG_INTERVAL = 30.0


def log_interval() -> float:
    """Seconds between two progress lines in a log: $TOKPACK_LOG_INTERVAL, else 30; 0: none."""
    text = os.environ.get(LOG_INTERVAL_ENV, "").strip()
    if not text:
        return DEFAULT_LOG_INTERVAL
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise TokpackError(
            f"${LOG_INTERVAL_ENV} is not a number of seconds",
            expected="a number >= 0 (0: no lines)",
            found=repr(text),
            hint=f"unset it for a line every {DEFAULT_LOG_INTERVAL:g} s",
        )
    return seconds


@contextlib.contextmanager
def logging_every(seconds: float | None):
    """Progress lines every `seconds` (0: none) inside the block, in this process and the worker
    processes it starts; None leaves the interval as it is."""
    if seconds is None:
        yield
        return
    before = os.environ.get(LOG_INTERVAL_ENV)
    os.environ[LOG_INTERVAL_ENV] = repr(float(seconds))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(LOG_INTERVAL_ENV, None)
        else:
            os.environ[LOG_INTERVAL_ENV] = before


def progress(total: int | None, desc: str, unit: str = "B", enabled: bool | None = None, unit_bytes: int | None = None):
    """The progress of one long step, for whoever watches it: a tqdm bar on a terminal; in a log
    (stderr not a terminal) one line every log_interval() seconds (_LogBar); nothing when
    `enabled` is False (a worker process, --json); True: a bar wherever stderr goes.
    `unit_bytes`: the bytes one unit stands for (a shard's), so that a log line gives MB/s for a
    bar counted in units."""
    if enabled is False:
        return _NoBar()
    if enabled is None and not sys.stderr.isatty():
        interval = log_interval()
        return _LogBar(total, desc, unit, interval, unit_bytes) if interval > 0 else _NoBar()
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=True,
        unit_divisor=1024 if unit == "B" else 1000,
        leave=False,
        file=sys.stderr,
    )


class _NoBar:
    """What a disabled bar does, without importing tqdm (BENCHMARKS.md, "Figures cited by the code": tqdm import)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n: int = 1) -> None:
        pass

    close = update


class _LogBar(_NoBar):
    """A bar for a log: what it is doing, done/total, MB/s and an ETA, as one plain line (no
    carriage return: a Slurm log keeps every line), written by the process's _LogLines."""

    def __init__(
        self,
        total: int | None,
        desc: str,
        unit: str,
        interval: float,
        unit_bytes: int | None = None,
        clock=time.monotonic,
    ):
        self.total, self.desc, self.unit, self.unit_bytes, self.clock = total, desc, unit, unit_bytes, clock
        self.done = 0
        self.started = clock()
        _LOG_LINES.open(self, interval)

    def __exit__(self, *exc):
        self.close()
        return False

    def update(self, n: int = 1) -> None:
        self.done += n

    def close(self) -> None:
        _LOG_LINES.close(self)

    @property
    def finished(self) -> bool:
        return self.total is not None and self.done >= self.total

    def line(self, now: float | None = None) -> str:
        now = self.clock() if now is None else now
        elapsed = max(now - self.started, 1e-9)
        if self.unit == "B":
            scale, name = _byte_scale(self.total or self.done)
            count = (
                f"{self.done / scale:,.1f}" + ("" if self.total is None else f"/{self.total / scale:,.1f}") + f" {name}"
            )
        else:
            plural = self.unit if self.unit.endswith("s") else self.unit + "s"
            count = f"{self.done:,}" + ("" if self.total is None else f"/{self.total:,}") + f" {plural}"
        if self.total:
            count += f" ({100 * min(self.done, self.total) / self.total:.1f}%)"
        per_unit = 1 if self.unit == "B" else self.unit_bytes
        rate = (
            f"{self.done * per_unit / elapsed / 1e6:,.1f} MB/s"
            if per_unit is not None
            else f"{self.done / elapsed:,.2f} {plural}/s"
        )
        left = None if not self.total or not self.done else max(0.0, (self.total - self.done) * elapsed / self.done)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        return f"{stamp} tokpack: {self.desc}: {count}, {rate}, ETA {_duration(left)}"


def _byte_scale(n: int) -> tuple[float, str]:
    """MB, GB or TB (10^n, as the units of README's byte sizes), whichever keeps the total short."""
    for scale, name in ((1e12, "TB"), (1e9, "GB")):
        if n >= 10 * scale:
            return scale, name
    return 1e6, "MB"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    s = int(round(seconds))
    days, s = divmod(s, 86400)
    return (f"{days}d " if days else "") + f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class _LogLines:
    """The one writer of a process's progress lines: every interval, the line of the oldest open
    bar short of its total (a command's outermost step: pack's bar over all its files, not a
    file's; a finished pass's bar may stay open while the next pass runs), else of the newest, so
    a log gets one line per interval however many bars are open. Bars are held weakly: one its
    owner dropped without closing it (as a tqdm bar closes when collected) writes no more lines."""

    def __init__(self):
        self.lock = threading.Lock()
        self.bars: list[weakref.ref] = []
        self.stop: threading.Event | None = None

    def open(self, bar: _LogBar, interval: float) -> None:
        with self.lock:
            self.bars.append(weakref.ref(bar))
            if self.stop is None:
                self.stop = threading.Event()
                threading.Thread(
                    target=self._write, args=(self.stop, interval), name="tokpack-progress-lines", daemon=True
                ).start()

    def close(self, bar: _LogBar | None) -> None:
        with self.lock:
            self.bars = [r for r in self.bars if r() is not None and r() is not bar]
            if not self.bars and self.stop is not None:
                self.stop.set()
                self.stop = None

    def _write(self, stop: threading.Event, interval: float) -> None:
        while not stop.wait(interval):
            self.close(None)  # forget the bars collected unclosed; the last one gone stops this thread
            with self.lock:
                live = [b for b in (r() for r in self.bars) if b is not None]
            bar = next((b for b in live if not b.finished), live[-1] if live else None)
            del live
            if bar is not None:
                try:
                    sys.stderr.write(bar.line() + "\n")
                    sys.stderr.flush()
                except (OSError, ValueError):  # stderr closed (a pipe whose reader left): nothing to tell
                    return
                del bar  # held no longer than its line: a bar dropped unclosed is collected


_LOG_LINES = _LogLines()
# A forked worker has none of its parent's bars, and not its writer thread.
os.register_at_fork(after_in_child=lambda: _LOG_LINES.__init__())
