"""The gate: every file tokpack reads that it did not just write is opened here (docs/COMMANDS.md,
"The gate"), and tests/test_layout.py fails when product code opens a file anywhere else (but
formats/io/writes.py, which opens only what it writes)."""

from __future__ import annotations

import json
import errno
import mmap
import io
import os
import stat
import threading
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import TokpackError
from .memory import populate
from .paths import RemotePath, as_path, name_problem

try:  # imported now: at EMFILE, importing it (opening its file) fails too
    import resource
except ImportError:  # not a Unix
    resource = None


# Every read of a file tokpack did not just write goes through the gate, `regular_size`
# (docs/COMMANDS.md, "The gate"): manifests, shards and their sidecars, rank files, the run a
# slice is checked against, work records and scratch files, and (regular-file rule only) a
# user's input files. Three rules:
# - containment (issue 24): the file resolves inside the folder whose manifest names it, or
#   whose work it holds; no `..`, no absolute name, no symlink leaving it, also through a
#   symlinked folder on the way. A name a manifest gives is checked first, as a string
#   (`contained`), so validate can report it without touching the disk;
# - regular files only: a FIFO, a socket, a device or a directory is refused before it can
#   block a read or feed endless bytes;
# - the recorded size, when the caller knows it: a longer or shorter file is refused before use.
# A bucket has no symlinks and no odd file types: a URL is checked by its size only.


# Reads and checksums stream through buffers of this size: large enough to keep the
# disk busy, small enough that memory does not depend on file size.
IO_BLOCK = 16 << 20
# A file read through its mapping is mapped this much at a time (iter_mapped).
MAP_WINDOW = 64 << 20


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


def regular_size(
    path, *, folder=None, size: int | None = None, user: bool = False, what: str = "file", hint: str | None = None
) -> int:
    """The gate: the one check before any file (local or URL) is read; returns its size. `path`
    must resolve inside `folder` (default: the folder it sits in; a folder named by a manifest
    is itself checked against its dataset with `contained` before its files are read), be a
    regular file, and, given `size` (what its manifest or record says), hold exactly that many
    bytes. `user=True`: a file the user named (a pack input, a schedule), which may live
    anywhere: only the regular-file rule. A missing file raises FileNotFoundError (its caller
    names what is missing); anything else refused is one TokpackError line naming the file."""
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
        raise wrong_size(path, what, size, found, hint)
    return found


def wrong_size(path, what: str, size: int, found: int, hint: str | None, manifest: str = "manifest") -> TokpackError:
    """The line refusing a file of `found` bytes that its `manifest` lists as a `what` of `size` bytes."""
    return TokpackError(
        f"{what} size does not match the {manifest}",
        file=path,
        where="size",
        expected=f"{size} bytes",
        found=f"{found} bytes",
        hint=hint
        or "the file was truncated, extended or replaced since its manifest was written; "
        "run `tokpack validate` on its dataset, or restore it from the original",
    )


def more_files(call, *args, **kwargs):
    """call(*args, **kwargs), an open or a map of the gate; at EMFILE, made once more after the
    soft limit on open files is raised to the hard one (as `ulimit -n` may). An in-memory step
    maps every source shard at once, and Python before 3.13 holds a file open for each mapping:
    a source of 1,500 shards failed at the usual soft limit, 1,024. Raised where it is met, in
    whatever process (a worker, an MPI process, a replacement node's reader); past the hard
    limit the EMFILE stands, and its line names the limit (errors.OPEN_FILES_HINT)."""
    try:
        return call(*args, **kwargs)
    except OSError as e:
        if e.errno != errno.EMFILE or not raise_open_files_limit():
            raise
    return call(*args, **kwargs)


_RAISED = False  # this process's soft limit on open files was raised (raise_open_files_limit)
_RAISING = threading.Lock()


def open_files_hard_limit() -> int | None:
    """The hard limit on this process's open files, the most its soft one may be raised to
    (Linux's fs.nr_open default, 2^20, for an unlimited one); None without a resource module."""
    if resource is None:
        return None
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return 1 << 20 if hard == resource.RLIM_INFINITY else hard


def open_files_share() -> int:
    """The open files one reader of many shard files may hold at once (descriptors, or mappings:
    Python before 3.13 holds a file a mapping): half the hard limit, the other half left to the
    process's other files. A source may have more shards (20,000-100,000) than a cluster's hard
    limit (4,096-65,536): such a reader closes, or unmaps, one file as it opens another."""
    return (open_files_hard_limit() or 0) // 2


def raise_open_files_limit() -> bool:
    """This process's soft limit on open files raised to its hard one (Linux's fs.nr_open
    default, 2^20, for an unlimited hard one); whether it was, now or before: a call that met
    EMFILE while another thread raised it is made again too."""
    global _RAISED
    with _RAISING:  # one thread at a time, so that none reads the limit raised before _RAISED says so
        try:
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            want = open_files_hard_limit()
            if soft != resource.RLIM_INFINITY and soft < want:
                resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
                _RAISED = True
        except (AttributeError, ValueError, OSError):  # no resource module (None), or a cap below the hard limit
            pass
        return _RAISED


def regular_fd(path, **rules) -> int:
    """A read-only descriptor of the local file `path` once it passes the gate (`rules`:
    regular_size's keywords). A FIFO, a socket or a device never blocks the open: the file is
    checked first, then opened with O_NONBLOCK (in case it was swapped in between) and checked
    again on the descriptor."""
    regular_size(path, **rules)
    fd = more_files(os.open, path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    return _blocking_regular(fd, path, rules.get("size"), rules.get("what", "file"), rules.get("hint"))


def _blocking_regular(fd: int, path, size: int | None = None, what: str = "file", hint: str | None = None) -> int:
    """`fd` (opened with O_NONBLOCK, so that a FIFO swapped in cannot block the open) made
    blocking once it shows a regular file (of `size` bytes, given it); closed when refused."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode)
        if size is not None and st.st_size != size:
            raise wrong_size(path, what, size, st.st_size, hint)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_limited(path, limit: int, what: str, **rules) -> bytes:
    """The whole of a small file (a manifest, a record) of at most `limit` bytes, through the
    gate: its size is checked before anything is read, so a huge file costs no memory."""
    path = as_path(path)
    size = regular_size(path, what=what, **rules)
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
            regular_size(path, **rules)
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
        regular_size(path, **rules)
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
    try:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = more_files(os.open, path, flags, 0o644)
    except OSError as e:  # a FIFO with no reader refuses a non-blocking write open (ENXIO)
        if e.errno != errno.ENXIO:
            raise
        raise _not_regular(path, os.stat(path).st_mode) from None
    return open(_blocking_regular(fd, path), "ab")


def open_new(path, buffering: int = -1):
    """A file tokpack creates to write whole (a temporary of tmp_path, or a file of a folder it
    is building under a temporary name, renamed once complete): created or truncated, never
    written through a symlink."""
    fd = more_files(os.open, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    return open(fd, "wb", buffering=buffering)


def hash_mapped(h, fd: int, offset: int, length: int) -> None:
    """Feeds bytes [offset, offset+length) of a gated descriptor to `h` through a memory map of
    just that range (page-cache pages, no copy), so resident memory stays at one block."""
    skip = offset % mmap.ALLOCATIONGRANULARITY  # map offsets must be aligned
    with more_files(mmap.mmap, fd, length + skip, offset=offset - skip, access=mmap.ACCESS_READ) as mm:
        if hasattr(mm, "madvise"):
            mm.madvise(mmap.MADV_SEQUENTIAL)
        with memoryview(mm) as view, view[skip:] as chunk:
            h.update(chunk)


def iter_mapped(path, size: int, block: int, **rules) -> Iterator[memoryview]:
    """A whole file of `size` bytes (through the gate: a regular file of that size, `rules`),
    front to back, at most `block` bytes at a time: views of its page-cache pages, mapped a
    window at a time, so nothing is copied into a buffer (a hash and a write read them where
    they are) and resident memory stays at a window. A view is valid until the next one. A
    URL's file is read into one reused buffer."""
    with open_read(path, size=size, **rules) as f:
        if not isinstance(f, io.FileIO):
            view = memoryview(bytearray(min(max(size, 1), block)))
            while n := f.readinto(view):
                yield view[:n]
            return
        window = max(mmap.ALLOCATIONGRANULARITY, MAP_WINDOW - MAP_WINDOW % mmap.ALLOCATIONGRANULARITY)
        for offset in range(0, size, window):
            mapped, _ = _mapped(f, offset, min(window, size - offset))  # unmapped once its views are gone
            with memoryview(mapped) as view:
                for a in range(0, len(view), block):
                    with view[a : a + block] as chunk:
                        yield chunk


def map_array(path, dtype, **rules) -> np.ndarray:
    """A whole local file, through the gate, as a read-only array (np.memmap: its pages are
    read when used, none up front)."""
    with open_read(path, ahead=False, **rules) as f:
        return more_files(np.memmap, f, dtype=dtype, mode="r")  # np.memmap dups the file for its mmap


def sequential(f) -> None:
    """Tells the kernel to read ahead: the file is read once, front to back."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)


def will_need(f, offset: int, length: int) -> None:
    """Asks the kernel to read [offset, offset+length) of `f` (open_read's) now, in the background
    (POSIX_FADV_WILLNEED), so that a read of it later finds it in memory: a reader that hashes a
    block while the next one comes from the disk. A URL's file: nothing (its reads are its own)."""
    if isinstance(f, io.FileIO) and hasattr(os, "posix_fadvise") and length > 0:
        os.posix_fadvise(f.fileno(), offset, length, os.POSIX_FADV_WILLNEED)


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


def map_file(path: Path, offset: int, length: int, read_in: bool = True, **rules) -> np.ndarray:
    """Bytes [offset, offset+length) of a file (through the gate: `rules`), memory-mapped
    read-only and read ahead in one sequential sweep. Mapping the page cache costs no fresh
    memory, unlike a read into a buffer. `read_in=False`: no sweep, each page read when used (a
    reader of a few pieces of many files, which it asks of the kernel itself)."""
    if length <= 0:
        regular_size(path, **rules)
        return np.empty(0, dtype=np.uint8)
    with open_read(path, ahead=False, **rules) as f:
        view, populated = _mapped(f, offset, length, read_in)
    if not populated:  # older kernels: a sequential read fills the page cache
        for _ in iter_file_blocks(path, bytearray(IO_BLOCK), offset, length, **rules):
            pass
    return view


def map_range(f, offset: int, length: int) -> np.ndarray | None:
    """Bytes [offset, offset+length) of a file open_read opened (local), memory-mapped
    read-only and read in now (MADV_POPULATE_READ, the GIL released): a reader's block as a view
    of the page cache, not a copy of it. The mapping lives as long as the view. None where the
    kernel cannot populate a mapping (the caller reads instead); a file shorter than the range
    raises (never a mapping past its end)."""
    if length <= 0 or not isinstance(f, io.FileIO):
        return None
    view, populated = _mapped(f, offset, length)
    return view if populated else None


def _mapped(f, offset: int, length: int, read_in: bool = True) -> tuple[np.ndarray, bool]:
    """Bytes [offset, offset+length) of an open local file, mapped read-only, and whether the
    kernel read them in (populate; `read_in=False`: not asked, True); a file shorter than that
    is one line, never a mapping past its end (whose read would kill the process with SIGBUS)."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    size = os.fstat(f.fileno()).st_size
    if size < offset + length:
        raise TokpackError(
            "file shorter than expected",
            file=f.name,
            where="size",
            expected=f">= {offset + length} bytes",
            found=f"{size} bytes",
            hint="the file was truncated or replaced since it was checked",
        )
    m = more_files(mmap.mmap, f.fileno(), offset + length - start, prot=mmap.PROT_READ, offset=start)
    view = np.frombuffer(m, dtype=np.uint8)
    return view[offset - start : offset - start + length], not read_in or populate(view.ctypes.data, len(m))


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
