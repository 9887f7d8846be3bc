"""The training-side reader: rank r of W, micro-batch m, from any sample, in O(1) state.

An epoch directory is a flat array of samples of `seq_len + 1` tokens, cut into shards of
`shard_samples` rows (docs/FORMAT.md). Several epochs (a run's `epochs`, in order, or a
list of epoch directories) are chained into one stream. Sample g of that stream sits at a
byte offset computed from g and a shard table of O(#shards) integers, so the reader never
builds anything that grows with the step count.

Order (Megatron's pretraining sampler): from consumed sample G, global batch b is the
chained samples [G + b*W*m, G + (b+1)*W*m) and rank r takes [r*m, (r+1)*m) of it. The
order of the stream does not depend on W, so resuming with another W (same global batch,
same G) continues the same sequence. Only complete global batches are served: the stream
stops when fewer than W*m samples remain, so every rank stops at the same step.

This module must not import torch (nor datatrove.utils.dataset, which imports it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .errors import TokpackError
from .manifest import dtype_from_name, epoch_dir_name, partial_stage_absent, read_manifest, xxh3_128_file

U64 = np.dtype("<u8")
# One contiguous read when the rank's rows are contiguous (W == 1): large enough to keep a
# disk or NFS busy, small enough not to matter next to a training process.
BLOCK_BYTES = 4 << 20
# How far ahead the kernel is asked to fetch (posix_fadvise WILLNEED) when rows are strided.
READAHEAD_BYTES = 8 << 20
# Entries of `.ds.index` read per pread when deriving positions from the index.
INDEX_CHUNK = 8192
# Open shard files kept at once: the current one and the next, plus slack for index files.
MAX_OPEN_FILES = 4


@dataclass
class ShardTable:
    """Where every sample of the chained stream lives. O(#shards); never grows with the step."""

    paths: list[str]  # shard files, in chained-stream order
    starts: np.ndarray  # int64 [n+1]: chained index of each shard's first sample, then the total
    epoch_of: np.ndarray  # int32 [n]: position in `epochs` of the epoch each shard belongs to
    epoch_starts: np.ndarray  # int64 [E+1]: chained index of each epoch's first sample, then the total
    epochs: list[int]  # epoch numbers, in chain order
    epoch_dirs: list[str]  # epoch directories, in chain order
    checksums: list[str | None]  # manifest xxh3_128 of each shard (checked with verify=True)
    index_checksums: list[str | None]  # manifest xxh3_128 of each shard's .ds.index

    @property
    def total(self) -> int:
        return int(self.starts[-1])

    def shard_of(self, g: int) -> int:
        return int(np.searchsorted(self.starts, g, side="right")) - 1

    def epoch_pos_of(self, g: int) -> int:
        return int(np.searchsorted(self.epoch_starts, g, side="right")) - 1


@dataclass
class StreamState:
    """Everything needed to continue a rank's stream: a handful of integers."""

    start: int  # G: chained samples consumed before this stream began (Megatron's consumed_samples)
    step: int  # next global batch b to serve, counted from `start`
    rank: int  # r: this rank takes rows [r*m, (r+1)*m) of every global batch
    world_size: int  # W: data-parallel ranks; a global batch is W*m samples
    micro_batch: int  # m: samples per rank per global batch
    stride: int  # steps advance by this (DataLoader workers split a rank's steps round-robin)
    end_step: int  # first step not served: the chained stream ends, or the caller's count

    @property
    def global_batch(self) -> int:
        return self.world_size * self.micro_batch

    def first_sample(self, step: int) -> int:
        """Chained index of this rank's first row in global batch `step`."""
        return self.start + step * self.global_batch + self.rank * self.micro_batch

    def consumed_after(self, step: int) -> int:
        """consumed_samples once every rank has trained on global batch `step`."""
        return self.start + (step + 1) * self.global_batch


@dataclass
class Sample:
    """One sample as a rank is fed it (for `tokpack read` and tests)."""

    epoch: int  # epoch number
    sample: int  # index of the sample within its epoch
    index: int  # index in the chained stream
    tokens: np.ndarray  # seq_len + 1 tokens


def _shard_error(message: str, path, **kw) -> TokpackError:
    return TokpackError(message, file=path, hint=kw.pop("hint", "restore the file, or run `tokpack validate` on the directory"), **kw)


def _positions_from_starts(starts: np.ndarray) -> np.ndarray:
    """starts[i, j] is True where a document fragment begins (always at j == 0); returns each
    token's offset in its fragment. Fragments are long, so repeating each start over its
    fragment is several times faster than a running maximum."""
    m, L = starts.shape
    first = np.flatnonzero(starts.reshape(-1))
    lengths = np.empty_like(first)
    np.subtract(first[1:], first[:-1], out=lengths[:-1])
    lengths[-1] = m * L - first[-1]
    pos = np.arange(m * L, dtype=np.int32)
    pos -= np.repeat(first.astype(np.int32), lengths)
    return pos.reshape(m, L)


def positions_from_eos(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """datatrove's convention: positions restart at 0 on the token AFTER each EOS, and at every row start."""
    tokens = np.atleast_2d(tokens)
    starts = np.zeros(tokens.shape, dtype=bool)
    starts[:, 0] = True
    np.equal(tokens[:, :-1], eos_id, out=starts[:, 1:])
    return _positions_from_starts(starts)


class SampleReader:
    """Sequential reader over chained epoch directories. Open with `SampleReader.open(path)`.

    Every shard's size is checked against its manifest when the reader is built, before any
    sample is returned. With `verify=True`, each shard is checksummed (xxh3_128) the first
    time it is read, before any of its data is returned.
    """

    def __init__(self, table: ShardTable, seq_len: int, dtype: np.dtype, eos_id: int | None, verify: bool = False):
        self.table = table  # the shard table (O(#shards))
        self.seq_len = seq_len  # a sample is seq_len + 1 tokens
        self.dtype = np.dtype(dtype).newbyteorder("<")  # token dtype on disk
        self.eos_id = eos_id  # for positions derived from EOS tokens
        self.verify = verify  # checksum each shard once, when first read
        self.row_tokens = seq_len + 1  # tokens per sample
        self.row_bytes = self.row_tokens * self.dtype.itemsize  # bytes per sample
        self._verified: set[str] = set()  # files already checksummed by this reader
        self.absent: dict[str, str] = {}  # shards a partial `tokpack stage --ranks` left out -> why
        self._fds: dict[str, tuple[int, int]] = {}  # open files: path -> (fd, size), at most MAX_OPEN_FILES
        self._hash_buf: bytearray | None = None  # reused by verify
        self._index_buf = np.empty(INDEX_CHUNK, dtype=U64)  # reused by index-derived positions
        self.reads = 0  # pread calls issued (a cost counter: tests check it does not depend on the step)
        self.bytes_read = 0  # bytes returned by those preads

    # ----------------------------------------------------------------- opening

    @classmethod
    def open(cls, path: str | Path | Sequence[str | Path], verify: bool = False) -> "SampleReader":
        """A run directory (its epochs in the order of its manifest's `epochs`), one epoch
        directory, or a list of either, chained in the order given."""
        paths = [path] if isinstance(path, (str, Path)) else list(path)
        if not paths:
            raise TokpackError("nothing to read", hint="give a run directory or epoch directories")
        epochs: list[tuple[Path, dict]] = []
        absent: dict[str, str] = {}
        for p in paths:
            p = Path(p)
            manifest = read_manifest(p, kind=("run", "epoch"))
            absent.update(partial_stage_absent(p))
            if manifest["kind"] == "epoch":
                epochs.append((p, manifest))
                continue
            listed = manifest.get("epochs")
            if not isinstance(listed, list) or not listed:
                raise TokpackError("run manifest lists no epochs", file=p / "tokpack.json", where="epochs",
                                   expected="a non-empty list", found=listed,
                                   hint="write an epoch with `tokpack shuffle ... --epoch E`")
            for e in listed:
                d = p / epoch_dir_name(int(e))
                m = read_manifest(d, kind="epoch")
                if "seq_len" in manifest and int(m.get("seq_len", -1)) != int(manifest["seq_len"]):
                    raise TokpackError("epoch seq_len differs from its run", file=d / "tokpack.json", where="seq_len",
                                       expected=manifest["seq_len"], found=m.get("seq_len"))
                epochs.append((d, m))
        return cls.from_manifests(epochs, verify=verify, absent=absent)

    @classmethod
    def from_manifests(cls, epochs: Sequence[tuple[str | Path, dict]], verify: bool = False,
                       absent: dict[str, str] | None = None) -> "SampleReader":
        """Builds the reader from (epoch directory, epoch manifest) pairs, chained in order.

        The manifests may be built in memory: a test or benchmark can describe a huge
        "virtual" epoch whose shard entries all name one small or sparse real file.
        """
        paths: list[str] = []
        shard_samples: list[int] = []
        epoch_of: list[int] = []
        epoch_sizes: list[int] = []
        epoch_numbers: list[int] = []
        checksums: list[str | None] = []
        index_checksums: list[str | None] = []
        seq_len = dtype = eos_id = None
        sizes: dict[str, int] = {}  # stat once per distinct file
        for pos, (directory, m) in enumerate(epochs):
            directory = Path(directory)
            where = directory / "tokpack.json"
            try:
                e_seq, e_dtype = int(m["seq_len"]), dtype_from_name(m["dtype"])
                e_samples, shards = int(m["samples"]), list(m["shards"])
            except (KeyError, TypeError, ValueError) as err:
                raise TokpackError("epoch manifest lacks a field the reader needs", file=where,
                                   where=str(err), expected="seq_len, dtype, samples, shards", found=sorted(m)) from None
            if int(m.get("token_size", e_dtype.itemsize)) != e_dtype.itemsize:
                raise TokpackError("token_size disagrees with dtype", file=where, where="token_size",
                                   expected=e_dtype.itemsize, found=m.get("token_size"))
            if seq_len is None:
                seq_len, dtype, eos_id = e_seq, e_dtype, m.get("eos_id")
            elif (e_seq, e_dtype) != (seq_len, dtype):
                raise TokpackError("epochs cannot be chained: sample shape differs", file=where,
                                   where="seq_len/dtype", expected=f"{seq_len}/{dtype.name}",
                                   found=f"{e_seq}/{e_dtype.name}", hint="read these epochs separately")
            row_bytes = (e_seq + 1) * e_dtype.itemsize
            per_shard = m.get("shard_samples")
            total = 0
            for k, s in enumerate(shards):
                f = str(directory / s["path"])
                n = int(s["samples"])
                expected = n * row_bytes
                if int(s.get("bytes", expected)) != expected:
                    raise TokpackError("shard entry is inconsistent: bytes != samples * (seq_len+1) * token_size",
                                       file=where, where=f"shards[{k}]", expected=expected, found=s.get("bytes"))
                if per_shard is not None and k < len(shards) - 1 and n != int(per_shard):
                    raise TokpackError("only the last shard may hold fewer than shard_samples samples",
                                       file=where, where=f"shards[{k}].samples", expected=per_shard, found=n)
                if absent and f in absent:
                    sizes[f] = expected  # left out by a partial stage: an error only if a rank reads it
                if f not in sizes:
                    try:
                        sizes[f] = os.stat(f).st_size
                    except FileNotFoundError:
                        raise _shard_error("shard listed in the manifest is missing", f) from None
                if sizes[f] != expected:
                    raise _shard_error("shard size does not match the manifest", f, where="size",
                                       expected=f"{expected} bytes", found=f"{sizes[f]} bytes",
                                       hint="the shard was truncated or replaced; run `tokpack validate` on the epoch")
                paths.append(f)
                shard_samples.append(n)
                epoch_of.append(pos)
                checksums.append(s.get("xxh3_128"))
                index_checksums.append(s.get("index_xxh3_128"))
                total += n
            if total != e_samples:
                raise TokpackError("shards do not add up to the epoch's samples", file=where, where="samples",
                                   expected=e_samples, found=total)
            epoch_sizes.append(total)
            epoch_numbers.append(int(m.get("epoch", pos)))
        if seq_len is None:
            raise TokpackError("nothing to read", hint="give a run directory or epoch directories")
        starts = np.zeros(len(paths) + 1, dtype=np.int64)
        np.cumsum(shard_samples, out=starts[1:])
        epoch_starts = np.zeros(len(epoch_sizes) + 1, dtype=np.int64)
        np.cumsum(epoch_sizes, out=epoch_starts[1:])
        table = ShardTable(paths, starts, np.asarray(epoch_of, dtype=np.int32), epoch_starts, epoch_numbers,
                           [str(d) for d, _ in epochs], checksums, index_checksums)
        reader = cls(table, seq_len, dtype, None if eos_id is None else int(eos_id), verify=verify)
        reader.absent = dict(absent or {})
        return reader

    # -------------------------------------------------------------- positions

    @property
    def total_samples(self) -> int:
        return self.table.total

    @property
    def epochs(self) -> list[int]:
        return list(self.table.epochs)

    def start_from(self, start_sample: int | None = None, consumed_tokens: int | None = None) -> int:
        """The chained sample G to start from: `start_sample`, or `consumed_tokens // seq_len`
        (each sample trains seq_len tokens). O(1); nothing is replayed."""
        if start_sample is not None and consumed_tokens is not None:
            raise TokpackError("give at most one of start_sample and consumed_tokens", where="start")
        g = start_sample if start_sample is not None else (consumed_tokens or 0) // self.seq_len
        if not 0 <= g <= self.total_samples:
            raise TokpackError("start is beyond the end of the chained epochs", file=self.table.epoch_dirs[-1],
                               where="start sample", expected=f"0..{self.total_samples}", found=g,
                               hint="write more epochs (`tokpack shuffle --epoch E`) or pass the run directory")
        return int(g)

    def locate(self, g: int) -> tuple[int, int]:
        """Chained sample g -> (epoch number, sample index within that epoch)."""
        if not 0 <= g < self.total_samples:
            raise IndexError(f"sample {g} outside the chained stream of {self.total_samples}")
        pos = self.table.epoch_pos_of(g)
        return self.table.epochs[pos], int(g - self.table.epoch_starts[pos])

    def position(self, epoch: int, sample: int) -> int:
        """(epoch number, sample within it) -> chained index; sample may equal the epoch's size."""
        try:
            pos = self.table.epochs.index(epoch)
        except ValueError:
            raise TokpackError("epoch not in this reader's chain", where="epoch", expected=self.table.epochs,
                               found=epoch) from None
        g = int(self.table.epoch_starts[pos]) + sample
        if not self.table.epoch_starts[pos] <= g <= self.table.epoch_starts[pos + 1]:
            raise TokpackError("sample outside its epoch", where=f"epoch {epoch}",
                               expected=f"0..{int(self.table.epoch_starts[pos + 1] - self.table.epoch_starts[pos])}",
                               found=sample)
        return g

    def steps(self, world_size: int, micro_batch: int, start: int = 0) -> int:
        """Complete global batches left from chained sample `start` (the stream stops there)."""
        return max(0, (self.total_samples - start) // (world_size * micro_batch))

    # ------------------------------------------------------------------ files

    def _file(self, path: str) -> tuple[int, int]:
        got = self._fds.get(path)
        if got is None and path in self.absent:
            raise _shard_error("shard was left out by a partial stage", path, where="tokpack-stage.json",
                               expected="a shard this rank reads", found=self.absent[path],
                               hint="stage again with --ranks including this rank (same --micro-batch), "
                                    "or stage the whole run")
        if got is None:
            if len(self._fds) >= MAX_OPEN_FILES:
                oldest = next(iter(self._fds))
                os.close(self._fds.pop(oldest)[0])
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise _shard_error("file disappeared after the reader was opened", path) from None
            got = self._fds[path] = (fd, os.fstat(fd).st_size)
        return got

    def _check(self, path: str, expected: str | None) -> None:
        """verify=True: the whole file's xxh3_128 against the manifest, once per file."""
        if path in self._verified:
            return
        if not expected:
            raise _shard_error("cannot verify: the manifest has no checksum for this file", path, where="xxh3_128",
                               hint="read without --verify, or rewrite the epoch with a current tokpack")
        if self._hash_buf is None:
            self._hash_buf = bytearray(4 << 20)
        found = xxh3_128_file(path, self._hash_buf)
        if found != expected:
            raise _shard_error("checksum mismatch: the shard is corrupt", path, where="xxh3_128",
                               expected=expected, found=found,
                               hint="restore the file (e.g. `tokpack stage` it again from the original)")
        self._verified.add(path)

    def _pread(self, fd: int, view: memoryview, offset: int, path: str) -> None:
        while view.nbytes:
            n = os.preadv(fd, [view], offset)
            self.reads += 1
            if n <= 0:
                raise _shard_error("shard is shorter than its manifest says (changed while reading?)", path,
                                   where=f"byte {offset}", expected=f"{view.nbytes} more bytes", found="end of file")
            self.bytes_read += n
            view = view[n:]
            offset += n

    def _segments(self, g: int, n: int) -> Iterator[tuple[int, int, int]]:
        """Splits chained rows [g, g+n) at shard boundaries: (shard, first row in shard, rows)."""
        starts = self.table.starts
        i = self.table.shard_of(g)
        while n > 0:
            k = min(n, int(starts[i + 1]) - g)
            yield i, g - int(starts[i]), k
            g += k
            n -= k
            i += 1

    def read_into(self, g: int, out: np.ndarray) -> np.ndarray:
        """Fills `out` ([n, seq_len+1] of the token dtype, C-contiguous) with chained rows [g, g+n)."""
        n = out.shape[0]
        if g < 0 or g + n > self.total_samples:
            raise IndexError(f"rows [{g}, {g + n}) outside the chained stream of {self.total_samples}")
        raw = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        for i, row, k in self._segments(g, n):
            path = self.table.paths[i]
            if self.verify:
                self._check(path, self.table.checksums[i])
            fd, _ = self._file(path)
            self._pread(fd, raw[done: done + k * self.row_bytes], row * self.row_bytes, path)
            done += k * self.row_bytes
        return out

    def read(self, g: int, n: int = 1) -> np.ndarray:
        """Chained rows [g, g+n) as a new [n, seq_len+1] array (random access, for tools and tests)."""
        return self.read_into(g, np.empty((n, self.row_tokens), dtype=self.dtype))

    def advise(self, g: int, n: int) -> None:
        """Asks the kernel to start fetching chained rows [g, g+n) (read-ahead, non-blocking)."""
        n = min(n, self.total_samples - g)
        if n <= 0 or not hasattr(os, "posix_fadvise"):
            return
        for i, row, k in self._segments(g, n):
            fd, _ = self._file(self.table.paths[i])
            os.posix_fadvise(fd, row * self.row_bytes, k * self.row_bytes, os.POSIX_FADV_WILLNEED)

    def index_positions(self, g: int, n: int) -> np.ndarray:
        """Positions of chained rows [g, g+n) derived from the shards' `.ds.index` (fragment ends),
        with datatrove's convention; equal to `positions_from_eos` on tokpack epochs."""
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
                raise _shard_error("index file is missing (needed for positions from the index)", path,
                                   hint="use positions from EOS instead, or restore the file") from None
            lo, hi = row * L, (row + k) * L
            j = self._index_search(fd, size // 8, lo, path)  # first entry > lo
            entries = size // 8
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
        return _positions_from_starts(starts)

    def _index_search(self, fd: int, entries: int, value: int, path: str) -> int:
        """First entry index whose value is > `value` (binary search with 8-byte preads: O(log n), O(1) memory)."""
        lo, hi = 0, entries
        one = self._index_buf[:1]
        view = memoryview(one.view(np.uint8))
        while lo < hi:
            mid = (lo + hi) // 2
            self._pread(fd, view, mid * 8, path)
            if int(one[0]) > value:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def close(self) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "SampleReader":
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
        state = dict(self.__dict__)
        state["_fds"] = {}
        state["_hash_buf"] = None
        return state

    # ------------------------------------------------------------------ streams

    def batches(self, rank: int, world_size: int, micro_batch: int, start: int = 0, *, positions: str | None = None,
                steps: int | None = None, worker: int = 0, num_workers: int = 1, copy: bool = True) -> "RankStream":
        """Rank r's micro-batches from chained sample `start`: arrays [m, seq_len+1] of the token
        dtype, or (tokens, positions) pairs with positions="eos" or "index".

        `worker`/`num_workers` split the rank's steps round-robin (step b goes to worker
        b % num_workers), for DataLoader workers. `copy=False` yields views of a reused
        buffer, valid until the next item.
        """
        return RankStream(self, rank, world_size, micro_batch, start, positions=positions, steps=steps,
                          worker=worker, num_workers=num_workers, copy=copy)

    def rank_samples(self, rank: int, world_size: int, micro_batch: int, start: int = 0,
                     count: int | None = None) -> Iterator[Sample]:
        """The samples rank r is fed, one by one, from chained sample `start`; at most `count`."""
        if count == 0:
            return
        steps = None if count is None else -(-count // micro_batch)
        left = count
        stream = self.batches(rank, world_size, micro_batch, start, steps=steps)
        for rows in stream:
            g = stream.state.first_sample(stream.last_step)
            for j in range(len(rows)):
                epoch, sample = self.locate(g + j)
                yield Sample(epoch, sample, g + j, rows[j])
                if left is not None:
                    left -= 1
                    if left == 0:
                        return


class RankStream:
    """Iterator over one rank's micro-batches. Its position is `state`: a few integers."""

    def __init__(self, reader: SampleReader, rank: int, world_size: int, micro_batch: int, start: int, *,
                 positions: str | None, steps: int | None, worker: int, num_workers: int, copy: bool):
        if not (world_size >= 1 and micro_batch >= 1 and 0 <= rank < world_size):
            raise ValueError(f"need 0 <= rank < world_size and micro_batch >= 1 (got {rank}, {world_size}, {micro_batch})")
        if not 0 <= worker < num_workers:
            raise ValueError(f"need 0 <= worker < num_workers (got {worker}, {num_workers})")
        if positions not in (None, "eos", "index"):
            raise ValueError(f"positions must be None, 'eos' or 'index', not {positions!r}")
        if positions == "eos" and reader.eos_id is None:
            raise TokpackError("positions from EOS need eos_id, and the epoch manifest has none", where="eos_id",
                               hint="use positions='index'")
        start = reader.start_from(start_sample=start)
        end = reader.steps(world_size, micro_batch, start)
        if steps is not None:
            end = min(end, steps)
        self.reader = reader  # the shared reader (shard table, open files)
        self.state = StreamState(start, worker, rank, world_size, micro_batch, num_workers, end)
        self.positions = positions  # None, "eos" or "index"
        self.copy = copy  # False: yield views of a reused buffer
        self.last_step = -1  # global batch of the last item yielded
        m, L = micro_batch, reader.row_tokens
        # W == 1 and one worker: the rank's rows are contiguous; read large blocks and slice them.
        self._contiguous = world_size == 1 and num_workers == 1
        rows = max(1, BLOCK_BYTES // (m * reader.row_bytes)) * m if self._contiguous else m
        self._buf = np.empty((rows, L), dtype=reader.dtype)  # reused read buffer
        self._buf_start = -1  # chained index of _buf's first row (contiguous mode), -1 when empty
        self._buf_rows = 0  # valid rows in _buf
        # Strided ranks: advise the kernel this many steps ahead.
        self._ahead = max(1, min(64, READAHEAD_BYTES // (m * reader.row_bytes)))
        self._advised = -1  # strided: last step advised; contiguous: chained row advised up to

    def __iter__(self) -> "RankStream":
        return self

    def __next__(self):
        st = self.state
        if st.step >= st.end_step:
            raise StopIteration
        step = st.step
        g = st.first_sample(step)
        m = st.micro_batch
        r = self.reader
        if self._contiguous:
            if not (self._buf_start <= g and g + m <= self._buf_start + self._buf_rows):
                last = st.first_sample(st.end_step - 1) + m  # end of this stream's rows
                n = min(len(self._buf), last - g)
                # Keep two blocks in flight ahead of the one being read, so the disk never idles.
                ahead = min(last, g + 3 * len(self._buf))
                if ahead > max(self._advised, g + n):
                    lo = max(self._advised, g + n)
                    r.advise(lo, ahead - lo)
                    self._advised = ahead
                r.read_into(g, self._buf[:n])
                self._buf_start, self._buf_rows = g, n
            rows = self._buf[g - self._buf_start: g - self._buf_start + m]
            if self.copy:
                rows = rows.copy()
        else:
            rows = np.empty((m, r.row_tokens), dtype=r.dtype) if self.copy else self._buf
            r.read_into(g, rows)
            first = max(self._advised + st.stride, step + st.stride)
            for s in range(first, min(st.end_step, step + st.stride * (self._ahead + 1)), st.stride):
                r.advise(st.first_sample(s), m)
                self._advised = s
        st.step += st.stride
        self.last_step = step
        if self.positions is None:
            return rows
        if self.positions == "eos":
            return rows, positions_from_eos(rows, r.eos_id)
        return rows, r.index_positions(g, m)
