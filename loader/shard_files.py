"""The reader's I/O: where every sample of a chain of epochs lives (`ShardTable`, built from
the epochs' manifests by `chain_table`, each shard's size checked at open), and `ShardFiles`,
which reads chained rows with preads on at most MAX_OPEN_FILES open files, checksums a file
the first time it is read (verify), and reads a best-fit epoch's padding and the shards'
`.ds.index`. Every file is opened through tokpack.formats.io's gate.
"""

from __future__ import annotations

import bisect
import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from tokpack.formats.arguments import whole
from tokpack.formats.errors import TokpackError
from tokpack.formats.io.paths import as_path, is_url
from tokpack.formats.io.gate import open_read, regular_fd, regular_size, wrong_size
from tokpack.formats.io.reads import read_full
from tokpack.formats.names import dtype_from_name
from tokpack.formats.packing import has_pad, rows_padded
from tokpack.formats.hashes import xxh3_128_file
from tokpack.formats.numbering import EpochNumbering
from tokpack.formats.constants import PAD_DTYPE, PAD_SUFFIX, U64
from tokpack.formats.shards import contained_shard
from tokpack.formats.token_check import WHOLE, token_check, verify_token_file

from .assembly import positions_from_starts

# Entries of `.ds.index` read per pread when deriving positions from the index.
INDEX_CHUNK = 8192
# Open shard files kept at once: the current one and the next, plus slack for index files.
MAX_OPEN_FILES = 4


class ShardTable:
    """Where every sample of the chained stream lives. O(#shards); never grows with the step.
    Its shards are added in chain order (`add`: an epoch's shards, from `chain_table`, or a node
    slice's rank files), then its epochs placed (`place`)."""

    def __init__(self, absent: dict[str, str] | None = None):
        self.absent = dict(absent or {})  # shards a partial `tokpack stage --ranks` left out -> why
        self.paths: list[str] = []  # shard files, in chained-stream order
        # What vouches for each shard's token file (checked with verify=True): (field, checksum,
        # samples), formats/token_check.py's token_check and the rows it holds; None: nothing
        self.checksums: list[tuple[str, str, int] | None] = []
        self.index_checksums: list[str | None] = []  # manifest xxh3_128 of each shard's .ds.index
        # Best-fit epochs: per shard its .ds.pad (file, xxh3_128) or None; None when no shard has one
        self.pads: list[tuple[str, str] | None] | None = []
        self.pad_sizes: dict[str, int] = {}  # .ds.pad file -> its recorded bytes, checked by the gate at its open
        # Local token file -> its `file_identity` when the table was built: a file opened later
        # (first read, reopened, in a DataLoader worker) is checked against it (ShardFiles._same_file)
        self.seen: dict[str, tuple] = {}
        # (a shard's size is checked when the reader opens: one cut short later still serves the rows it holds)

    def add(self, f: str, s: dict, samples: int) -> None:
        """Token file `f` of shard entry `s`, which holds `samples` rows."""
        check = token_check(s)
        self.paths.append(f)
        if f not in self.seen and f not in self.absent and not is_url(f):  # a file named twice: stat'd once
            self.seen[f] = file_identity(f)
        self.checksums.append(None if check is None else (*check, samples))
        self.index_checksums.append(s.get("index_xxh3_128"))
        self.pads.append((f + PAD_SUFFIX, s["pad_xxh3_128"]) if has_pad(s) else None)
        if has_pad(s):
            self.pad_sizes[f + PAD_SUFFIX] = samples * PAD_DTYPE.itemsize

    def place(self, epoch_starts, epoch_ends, epochs: list[int], epoch_dirs: list[str], starts=None, ends=None):
        """The chain's epochs, and each shard's chained samples [starts, ends) (None: a node
        slice's rank files, which SliceReader._segments places)."""
        self.epoch_starts = np.asarray(epoch_starts, dtype=np.int64)  # chained index of each epoch's first sample
        self.epoch_ends = np.asarray(epoch_ends, dtype=np.int64)  # chained index after each epoch's last sample
        self.epochs, self.epoch_dirs = epochs, epoch_dirs  # epoch numbers and directories, in chain order
        # int64 [n]: chained index of each shard's first sample, and after its last
        self.starts, self.ends = starts, ends
        self.pads = self.pads if any(self.pads) else None

    def epoch_pos_of(self, g: int) -> int:
        """Position in `epochs` of the epoch holding g, or -1 when no chained epoch holds it."""
        pos = int(np.searchsorted(self.epoch_starts, g, side="right")) - 1
        return pos if pos >= 0 and g < self.epoch_ends[pos] else -1

    def reachable_end(self, g: int) -> int:
        """How far the stream runs from g before an epoch is missing (or the chain ends)."""
        pos = self.epoch_pos_of(g)
        if pos < 0:
            return g
        while pos + 1 < len(self.epochs) and self.epoch_starts[pos + 1] == self.epoch_ends[pos]:
            pos += 1
        return int(self.epoch_ends[pos])


# The machine a reader was opened on: a file's identity (device, inode) means something there only.
_HOST = os.uname().nodename


def file_identity(path: str, fd: int | None = None) -> tuple:
    """(host, device, inode, size, mtime in ns) of a local file, by its path or an open descriptor."""
    st = os.stat(path) if fd is None else os.fstat(fd)
    return (_HOST, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def no_such_sample(g: int, epochs) -> TokpackError:
    """Chained sample g is in no epoch this reader holds (past its end, or in an epoch of the run
    that is not written): one line, where an IndexError was raised."""
    return TokpackError(
        "sample is in no epoch of this chain", where=f"sample {g}", expected=f"a sample of epochs {list(epochs)}"
    )


def _working_dir() -> str | None:
    """The process's working directory; None once it is removed (a relative path then names nothing)."""
    try:
        return os.getcwd()
    except OSError:
        return None


def _close(fd) -> None:
    if isinstance(fd, int):
        os.close(fd)
    else:
        fd.close()


PAD_HINT = "the padding sidecar does not match its manifest (4 bytes a sample); run `tokpack validate` on it"
# A file verify finds changed: what it says, and what to do.
_CORRUPT = "checksum mismatch: the shard is corrupt"
_RESTORE = "restore the file (e.g. `tokpack stage` it again from the original)"
# What to do about a file missing or holding another size than its manifest's (`listed_size`).
_VALIDATE = "restore the file, or run `tokpack validate` on the directory"
_TRUNCATED = "the shard was truncated or replaced; run `tokpack validate` on the epoch"
_REPAD = "run `tokpack validate` on the epoch; restore it or shuffle it again"


def shard_error(message: str, path, **kw) -> TokpackError:
    return TokpackError(message, file=path, hint=kw.pop("hint", _VALIDATE), **kw)


def listed_size(
    f, what: str, size: int, hints: tuple[str, str], manifest: str = "manifest", found: int | None = None
) -> int:
    """The bytes of file `f`, which `manifest` lists as a `what` of `size` bytes (`found`: its
    size known already, else the gate's): one line when it is missing or holds another size
    (`hints`: what to do in each case)."""
    if found is None:
        try:
            found = regular_size(f)
        except FileNotFoundError:
            raise shard_error(f"{what} listed in the {manifest} is missing", f, hint=hints[0]) from None
    if found != size:
        raise wrong_size(f, what, size, found, hints[1], manifest)
    return found


def _padding_present(where: Path, m: dict, s: dict, k: int, f: str, size: int | None) -> None:
    """A best-fit epoch's shard without its `.ds.pad` (unlisted, or listed but gone) is refused at
    open: read as a window epoch, its padding would be trained on as tokens. `size`: the
    sidecar's recorded bytes, None for a shard a partial stage left out."""
    if rows_padded(m) and not has_pad(s):
        raise TokpackError(
            "best-fit epoch shard lacks its padding sidecar: its padding would be trained on as tokens",
            file=where,
            where=f"shards[{k}].pad_xxh3_128",
            expected="the checksum of its .ds.pad",
            found="none",
            hint=_REPAD,
        )
    if has_pad(s) and size is not None:
        listed_size(f + PAD_SUFFIX, "padding sidecar", size, (_REPAD, PAD_HINT))


def _epoch_shape(where: Path, m: dict) -> tuple[int, np.dtype, int, list]:
    """(seq_len, dtype, samples, shards) of an epoch manifest, or one line naming what it lacks."""
    try:
        e_seq, e_dtype = int(m["seq_len"]), dtype_from_name(m["dtype"])
        e_samples, shards = int(m["samples"]), list(m["shards"])
    except (KeyError, TypeError, ValueError) as err:
        raise TokpackError(
            "epoch manifest lacks a field the reader needs",
            file=where,
            where=str(err),
            expected="seq_len, dtype, samples, shards",
            found=sorted(m),
        ) from None
    if int(m.get("token_size", e_dtype.itemsize)) != e_dtype.itemsize:
        raise TokpackError(
            "token_size disagrees with dtype",
            file=where,
            where="token_size",
            expected=e_dtype.itemsize,
            found=m.get("token_size"),
        )
    return e_seq, e_dtype, e_samples, shards


def _chains_with(where: Path, first: tuple, this: tuple) -> None:
    """An epoch chains after the first one only with its (seq_len, dtype, eos_id)."""
    (seq_len, dtype, eos_id), (e_seq, e_dtype, e_eos) = first, this
    if (e_seq, e_dtype) != (seq_len, dtype):
        raise TokpackError(
            "epochs cannot be chained: sample shape differs",
            file=where,
            where="seq_len/dtype",
            expected=f"{seq_len}/{dtype.name}",
            found=f"{e_seq}/{e_dtype.name}",
            hint="read these epochs separately",
        )
    if e_eos != eos_id:  # position ids restart after EOS: one stream, one EOS
        raise TokpackError(
            "epochs cannot be chained: eos_id differs",
            file=where,
            where="eos_id",
            expected=eos_id,
            found=e_eos,
            hint="read these epochs separately",
        )


def _epoch_shards(
    table: ShardTable, sizes: dict[str, int], directory: Path, m: dict, shards: list, row_bytes: int
) -> np.ndarray:
    """Checks an epoch's shards and adds them to `table`; returns their samples. `sizes`: each
    distinct file's bytes, across the chain."""
    where = directory / "tokpack.json"
    per_shard = m.get("shard_samples")
    samples = []
    for k, s in enumerate(shards):
        f = str(contained_shard(directory, s, k))
        n = int(s["samples"])
        expected = n * row_bytes
        if int(s.get("bytes", expected)) != expected:
            raise TokpackError(
                "shard entry is inconsistent: bytes != samples * (seq_len+1) * token_size",
                file=where,
                where=f"shards[{k}]",
                expected=expected,
                found=s.get("bytes"),
            )
        if per_shard is not None and k < len(shards) - 1 and n != int(per_shard):
            raise TokpackError(
                "only the last shard may hold fewer than shard_samples samples",
                file=where,
                where=f"shards[{k}].samples",
                expected=per_shard,
                found=n,
            )
        # A file named twice is stat'd once; one a partial stage left out is an error only if a rank reads it.
        found = expected if f in table.absent else sizes.get(f)
        sizes[f] = listed_size(f, "shard", expected, (_VALIDATE, _TRUNCATED), found=found)
        _padding_present(where, m, s, k, f, None if f in table.absent else n * PAD_DTYPE.itemsize)
        table.add(f, s, n)
        samples.append(n)
    return np.asarray(samples, dtype=np.int64)


def chain_table(
    epochs: Sequence[tuple[str | Path, dict]], absent: dict[str, str] | None, numbering: EpochNumbering | None
) -> tuple[ShardTable, int, np.dtype, int | None]:
    """(table, seq_len, dtype, eos_id) of (epoch directory, epoch manifest) pairs, chained in order, every shard's
    size checked. With a run's `numbering`, epoch e starts at sample numbering.first(e) (epochs
    in increasing order); without one, each epoch starts where the one before it ends."""
    chain = ShardTable(absent)
    sizes: dict[str, int] = {}
    samples: list[np.ndarray] = []  # each epoch's shards' samples
    epoch_sizes: list[int] = []
    epoch_numbers: list[int] = []
    shape = None
    for pos, (directory, m) in enumerate(epochs):
        directory = as_path(directory)
        where = directory / "tokpack.json"
        e_seq, e_dtype, e_samples, entries = _epoch_shape(where, m)
        this = (e_seq, e_dtype, m.get("eos_id"))
        shape = shape or this  # the first epoch's: every epoch chains with it
        _chains_with(where, shape, this)
        samples.append(_epoch_shards(chain, sizes, directory, m, entries, (e_seq + 1) * e_dtype.itemsize))
        total = int(samples[-1].sum())
        if total != e_samples:
            raise TokpackError(
                "shards do not add up to the epoch's samples",
                file=where,
                where="samples",
                expected=e_samples,
                found=total,
            )
        epoch_sizes.append(total)
        epoch_numbers.append(int(m.get("epoch", pos)))
    if shape is None:
        raise TokpackError("nothing to read", hint="give a run directory or epoch directories")
    if numbering is None:
        epoch_starts = np.concatenate([[0], np.cumsum(epoch_sizes[:-1], dtype=np.int64)]).astype(np.int64)
    else:
        epoch_starts = np.array([numbering.first(e) for e in epoch_numbers], dtype=np.int64)
    epoch_ends = epoch_starts + np.asarray(epoch_sizes, dtype=np.int64)
    if np.any(epoch_starts[1:] < epoch_ends[:-1]):
        raise TokpackError("a run's epochs must be chained in increasing order", where="epochs", found=epoch_numbers)
    shard_ends = np.concatenate([start + np.cumsum(n) for start, n in zip(epoch_starts, samples)])
    shard_starts = shard_ends - np.concatenate(samples)
    chain.place(epoch_starts, epoch_ends, epoch_numbers, [str(d) for d, _ in epochs], shard_starts, shard_ends)
    seq_len, dtype, eos_id = shape
    return chain, seq_len, dtype, None if eos_id is None else int(eos_id)


class ShardFiles:
    """Chained rows read from the shard files of a `ShardTable` (SampleReader's I/O). Every
    shard's size was checked against its manifest when the table was built; with `verify=True`,
    each file is checked (`_check`) the first time it is read, before any of its data is returned."""

    def __init__(self, table: ShardTable, seq_len: int, dtype: np.dtype, eos_id: int | None, verify: bool = False):
        self.table = table  # the shard table (O(#shards))
        self.seq_len = seq_len  # a sample is seq_len + 1 tokens
        self.dtype = np.dtype(dtype).newbyteorder("<")  # token dtype on disk
        self.eos_id = eos_id  # for positions derived from EOS tokens
        self.verify = verify  # checksum each shard once, when first read
        self.row_tokens = seq_len + 1  # tokens per sample
        self.row_bytes = self.row_tokens * self.dtype.itemsize  # bytes per sample
        self._verified: set[str] = set()  # files already checksummed by this reader
        self._fds: dict[str, tuple[int, int]] = {}  # open files: path -> (fd, size), at most MAX_OPEN_FILES
        self._hash_buf: bytearray | None = None  # reused by verify
        self._index_buf = np.empty(INDEX_CHUNK, dtype=U64)  # reused by index-derived positions
        # The working directory a relative path was given in: the files are opened at the first
        # read (in each DataLoader worker too), after a script may have changed directory
        # (Hydra's job.chdir, a notebook's %cd): "file disappeared" before. Paths stay as given
        # in every message.
        self._cwd = _working_dir()
        self.reads = 0  # pread calls issued (a cost counter: tests check it does not depend on the step)
        self.bytes_read = 0  # bytes returned by those preads

    def _file(self, path: str) -> tuple[int, int]:
        got = self._fds.get(path)
        if got is None and path in self.table.absent:
            raise shard_error(
                "shard was left out by a partial stage",
                path,
                where="tokpack-stage.json",
                expected="a shard this rank reads",
                found=self.table.absent[path],
                hint="stage again with --ranks including this rank (same --micro-batch), or stage the whole run",
            )
        if got is None:
            if len(self._fds) >= MAX_OPEN_FILES:
                oldest = next(iter(self._fds))
                _close(self._fds.pop(oldest)[0])
            try:  # a URL: a file read at each place asked (pread needs a descriptor)
                sizes = self.table.pad_sizes
                rules = dict(size=sizes[path], what="padding sidecar", hint=PAD_HINT) if path in sizes else {}
                fd = open_read(path, ahead=False, **rules) if is_url(path) else regular_fd(self._local(path), **rules)
            except FileNotFoundError:
                raise shard_error("file disappeared after the reader was opened", path) from None
            if isinstance(fd, int):
                self._same_file(path, fd)
            got = self._fds[path] = (fd, os.fstat(fd).st_size if isinstance(fd, int) else fd.size)
        return got

    def _local(self, path: str) -> str:
        """A file's path as opened: a relative one from the directory the reader was opened in
        (as given while the process is still there)."""
        if is_url(path) or os.path.isabs(path) or self._cwd is None or _working_dir() == self._cwd:
            return path
        return os.path.join(self._cwd, path)

    def _same_file(self, path: str, fd: int) -> None:
        """A token file opened now (its first read, reopened, in a DataLoader worker) against what
        the reader's open saw at its path: another file there (an epoch directory replaced, a file
        renamed over it), or the file rewritten to its size, may hold other samples at the same
        offsets, read without a word before. A file cut short still serves the rows it holds
        (`_pread` names where it ends). Checked on the machine that opened the reader only: a
        reader sent to another host meets that host's copy."""
        seen = self.table.seen.get(path)
        if seen is None or seen[0] != _HOST:
            return
        now = file_identity(path, fd)
        if now[1:3] != seen[1:3] or (now[3] == seen[3] and now[4] != seen[4]):
            os.close(fd)
            raise shard_error(
                "file was replaced or rewritten after the reader was opened: it may hold other samples",
                path,
                where="inode/mtime",
                expected=f"inode {seen[2]}, modified {seen[4]} ns (at the reader's open)",
                found=f"inode {now[2]}, modified {now[4]} ns",
                hint="open the reader again (a new TokpackDataset) over the run as it is now; "
                "run `tokpack validate` on it first",
            )

    def _check(self, path: str, expected: str | None, rows: tuple[str, int] | None = None) -> None:
        """verify=True: the file against its manifest, once per file: its whole xxh3_128, or, for a
        token file vouched for row by row, `rows` (its entry's field and samples) against its
        `.ds.rows` (formats/token_check.py)."""
        if path in self._verified:
            return
        if not expected and rows is None:
            raise shard_error(
                "cannot verify: the manifest has no checksum for this file",
                path,
                where="xxh3_128",
                hint="read without --verify, or rewrite the epoch with a current tokpack",
            )
        if self._hash_buf is None:
            self._hash_buf = bytearray(4 << 20)
        try:
            if rows is None:
                found = xxh3_128_file(self._local(path), self._hash_buf)
            else:  # a mismatch is its own line, naming the row
                verify_token_file(
                    self._local(path),
                    (rows[0], expected),
                    rows[1],
                    self.row_bytes,
                    self._hash_buf,
                    message=_CORRUPT,
                    hint=_RESTORE,
                )
                found = expected
        except FileNotFoundError:  # as _file says it (a slice's .ds.pad gone was a raw FileNotFoundError here)
            raise shard_error("file disappeared after the reader was opened", path) from None
        if found != expected:
            raise shard_error(_CORRUPT, path, where="xxh3_128", expected=expected, found=found, hint=_RESTORE)
        self._verified.add(path)

    def _pread(self, fd: int, view: memoryview, offset: int, path: str) -> None:
        n = read_full(fd, view, offset)
        self.reads += 1
        self.bytes_read += n
        if n < view.nbytes:
            raise shard_error(
                "shard is shorter than its manifest says (changed while reading?)",
                path,
                where=f"byte {offset + n}",
                expected=f"{view.nbytes - n} more bytes",
                found="end of file",
            )

    def _segments(self, g: int, n: int) -> Iterator[tuple[int, int, int]]:
        """Splits chained rows [g, g+n) at shard boundaries: (shard, first row in shard, rows)."""
        starts, ends = self.table.starts, self.table.ends
        i = int(np.searchsorted(starts, g, side="right")) - 1
        while n > 0:
            if i < 0 or i >= len(starts) or not starts[i] <= g < ends[i]:
                raise no_such_sample(g, self.table.epochs)
            k = min(n, int(ends[i]) - g)
            yield i, g - int(starts[i]), k
            g += k
            n -= k
            i += 1

    @property
    def total_samples(self) -> int:
        """End of the chain: one past its last sample (in a run, a consumed-sample number)."""
        return int(self.table.epoch_ends[-1]) if len(self.table.epoch_ends) else 0

    def read_into(self, g: int, out: np.ndarray) -> np.ndarray:
        """Fills `out` ([n, seq_len+1] of the token dtype, C-contiguous) with chained rows [g, g+n)."""
        n = out.shape[0]
        if g < 0 or g + n > self.total_samples:
            raise IndexError(f"rows [{g}, {g + n}) outside the chained stream of {self.total_samples}")
        raw = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        for i, row, k in self._segments(g, n):
            path = self.table.paths[i]
            if self.verify:  # the token file against what its entry vouches for it with
                key, checksum, samples = self.table.checksums[i] or (WHOLE, None, 0)
                self._check(path, checksum, None if key == WHOLE else (key, samples))
            fd, _ = self._file(path)
            self._pread(fd, raw[done : done + k * self.row_bytes], row * self.row_bytes, path)
            done += k * self.row_bytes
        return out

    def rows_within(self, g, n) -> tuple[int, int]:
        """(g, n) of chained rows [g, g+n) a public method was asked for, checked: whole numbers
        within the chain, or one line (padding(-1, 2) was an IndexError, most_documents(0.5) a
        TypeError)."""
        g, n = whole(g, "g", optional=False), whole(n, "n", optional=False)
        if g + n > self.total_samples:
            raise TokpackError(
                "rows outside the chained stream",
                where="g, n",
                expected=f"g + n <= {self.total_samples}",
                found=f"g={g}, n={n}",
            )
        return g, n

    def read(self, g: int, n: int = 1) -> np.ndarray:
        """Chained rows [g, g+n) as a new [n, seq_len+1] array (random access, for tools and tests)."""
        g, n = self.rows_within(g, n)
        return self.read_into(g, np.empty((n, self.row_tokens), dtype=self.dtype))

    def advise(self, g: int, n: int) -> None:
        """Asks the kernel to start fetching chained rows [g, g+n) (read-ahead, non-blocking)."""
        n = min(n, self.total_samples - g)
        if n <= 0 or not hasattr(os, "posix_fadvise"):
            return
        for i, row, k in self._segments(g, n):
            fd, _ = self._file(self.table.paths[i])
            if isinstance(fd, int):
                os.posix_fadvise(fd, row * self.row_bytes, k * self.row_bytes, os.POSIX_FADV_WILLNEED)

    @property
    def packed(self) -> bool:
        """Whether any chained epoch is best-fit packed (its samples may end in padding)."""
        return self.table.pads is not None

    def padding(self, g: int, n: int) -> np.ndarray:
        """Padding tokens at the end of each of chained rows [g, g+n) (uint32; 0 for rows of
        an epoch without a `.ds.pad`). O(1) preads of 4 bytes a row."""
        return self._unchecked_padding(*self.rows_within(g, n))

    def _unchecked_padding(self, g: int, n: int) -> np.ndarray:
        """`padding` without its argument checks, for the batch assembly's rows of a stream: the
        checks cost a best-fit batch of 128 tokens 4% of its CPU (a sample past the chain is still
        no_such_sample's line, from `_segments`)."""
        out = np.zeros(n, dtype=PAD_DTYPE)
        if not self.packed:
            return out
        done = 0
        for i, row, k in self._segments(g, n):
            pad = self.table.pads[i]
            if pad is not None:
                if self.verify:
                    self._check(pad[0], pad[1])
                fd, _ = self._file(pad[0])
                self._pread(fd, memoryview(out[done : done + k].view(np.uint8)), row * PAD_DTYPE.itemsize, pad[0])
            done += k
        return out

    def index_positions(self, g: int, n: int) -> np.ndarray:
        """Positions of chained rows [g, g+n) derived from the shards' `.ds.index` (fragment ends),
        with datatrove's convention; equal to `positions_from_eos` on tokpack epochs."""
        g, n = self.rows_within(g, n)
        L = self.row_tokens
        starts = np.zeros((n, L), dtype=bool)
        starts[:, 0] = True
        flat = starts.reshape(-1)
        done = 0
        for i, row, k in self._segments(g, n):
            path = self.table.paths[i] + ".index"
            if self.verify:
                self._check(path, self.table.index_checksums[i])
            try:
                fd, size = self._file(path)
            except TokpackError:
                if not is_url(path) and os.path.lexists(path):
                    raise  # there, but not a file to read (a FIFO, a device): its own line
                raise shard_error(
                    "index file is missing (needed for positions from the index)",
                    path,
                    hint="use positions from EOS instead, or restore the file",
                ) from None
            lo, hi = row * L, (row + k) * L
            entries = size // 8
            j = self._index_search(fd, entries, lo, path)  # first entry > lo
            while j < entries:
                c = min(INDEX_CHUNK, entries - j)
                buf = self._index_buf[:c]
                self._pread(fd, memoryview(buf.view(np.uint8)), j * 8, path)
                ends = buf[buf < hi].astype(np.int64) - lo  # a fragment starts at each end < hi
                flat[done * L + ends] = True
                if c and buf[c - 1] >= hi:
                    break
                j += c
            done += k
        return positions_from_starts(starts)

    def _index_search(self, fd: int, entries: int, value: int, path: str) -> int:
        """First entry index whose value is > `value` (binary search with 8-byte preads: O(log n), O(1) memory)."""
        one = self._index_buf[:1]
        view = memoryview(one.view(np.uint8))

        def entry(i: int) -> int:
            self._pread(fd, view, i * 8, path)
            return int(one[0])

        return bisect.bisect_right(range(entries), value, key=entry)

    def close(self) -> None:
        for fd, _ in self._fds.values():
            _close(fd)
        self._fds.clear()

    def __enter__(self) -> "ShardFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __getstate__(self):
        # File descriptors do not survive pickling (DataLoader workers): reopen lazily.
        return {**self.__dict__, "_fds": {}, "_hash_buf": None}
