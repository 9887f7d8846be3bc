"""Shard files: the writers for packed sources and epochs, and the packed-source reader.

A shard is datatrove's layout: `NNNNN.ds` (raw little-endian tokens), `NNNNN.ds.index`
(uint64 cumulative ends, no leading 0), `NNNNN.ds.metadata` and optionally
`NNNNN.ds.loss` (one byte per token); an epoch's shard also `NNNNN.ds.rows` (each row's
xxh3-64, which vouches for its token file) and a best-fit one `NNNNN.ds.pad`. Writers hash
while they write, so producing a manifest never costs a second read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from .errors import TokpackError
from .io.paths import as_path
from .io.gate import contained, map_range, open_read, read_array, regular_size, will_need
from .io.reads import read_full
from .io.writes import DurableFile, HashedFile, PlacedFile, is_tmp_name, write_bytes_atomic
from .constants import EPOCH_SHARD_SUFFIXES, LOSS_SUFFIX, SHARD_SUFFIXES
from .constants import PAD_DTYPE, PAD_SUFFIX, ROWS_SUFFIX, U64
from .constants import INDEX_ENTRY_BYTES, INDEX_SUFFIX, METADATA_SUFFIX, ROW_HASH_DTYPE
from .constants import MANIFEST, MASK64, NODES_SIDECAR
from .names import dtype_from_name, metadata_text
from .packing import has_pad
from .reading import read_source_manifest
from .hashes import row_hashes
from .token_check import FileDigest, digest_error


# The most files read_into's `handles` keep open. A block of a sweep touches a shard or two of a
# real source, but thousands of tiny ones (a shard a document): each kept, past the hard
# open-files limit, `validate --against` met EMFILE and called the epoch corrupt.
KEPT_HANDLES = 64

_SHARD_FILE = re.compile(
    "[0-9]+[.]ds(" + "|".join(re.escape(s) for s in (*SHARD_SUFFIXES, PAD_SUFFIX, ROWS_SUFFIX) if s) + ")?"
)


def row_segments(row: np.ndarray, offset: np.ndarray, rows: int, row_tokens: int) -> np.ndarray:
    """Each of `rows` rows' segment count, given where its segments start (`row`, `offset`
    within the row): the one definition of the count that `max_documents` must cover, used by
    the loader (from a row's positions) and by best-fit's figures (`max_documents_per_row`, from
    its pieces and padding). A segment is a document, a piece of one, or a best-fit row's
    padding; it counts when it starts at one of the row's row_tokens - 1 inputs. One that starts
    at the row's last token is there only as a label: no input position restarts for it."""
    keep = np.asarray(offset) < row_tokens - 1
    return np.bincount(np.asarray(row, dtype=np.int64)[keep], minlength=rows)


def is_own_file(path: Path) -> bool:
    """A file named as tokpack names what it writes in a packed directory: tokpack.json, a
    shard's files (manifest.shard_name: digits, .ds) or a temporary. A command deletes or
    replaces nothing else."""
    return path.is_file() and (
        path.name == MANIFEST or _SHARD_FILE.fullmatch(path.name) is not None or is_tmp_name(path.name)
    )


def shard_suffixes(entry: dict) -> tuple[str, ...]:
    """The files of the shard a manifest entry records: a loss mask, row hashes or a padding
    sidecar only where it has one."""
    base = SHARD_SUFFIXES if "loss_xxh3_128" in entry else EPOCH_SHARD_SUFFIXES
    return base + ((ROWS_SUFFIX,) if "rows_xxh3_128" in entry else ()) + ((PAD_SUFFIX,) if has_pad(entry) else ())


def shard_files(entry: dict, source: bool = False) -> list[tuple[str, int | None, str]]:
    """(suffix, recorded bytes or None where the entry cannot say, checksum field) of each file
    of the shard a manifest entry records; `source`: an entry of a packed source, whose index
    has an entry per document, where an epoch's has one per fragment. The token file's field,
    `xxh3_128`, is absent from an epoch's entry written since its row hashes alone vouch for it
    (formats/token_check.py says what checks it)."""

    def sized(key: str, per: int) -> int | None:
        return None if entry.get(key) is None else per * int(entry[key])

    files = {
        "": (sized("bytes", 1), "xxh3_128"),
        INDEX_SUFFIX: (sized("documents" if source else "fragments", INDEX_ENTRY_BYTES), "index_xxh3_128"),
        METADATA_SUFFIX: (None, "metadata_xxh3_128"),
        LOSS_SUFFIX: (sized("tokens", 1), "loss_xxh3_128"),
        ROWS_SUFFIX: (sized("samples", ROW_HASH_DTYPE.itemsize), "rows_xxh3_128"),
        PAD_SUFFIX: (sized("samples", PAD_DTYPE.itemsize), "pad_xxh3_128"),
    }
    return [(suffix, *files[suffix]) for suffix in shard_suffixes(entry)]


def tokens_on_nodes(directory, shards: list[dict]) -> bool:
    """Whether an epoch folder was written by `shuffle --to-nodes` (tokpack.packer.exchange): its
    run holds NODES_SIDECAR, its shards' row hashes are here and their token files are on the
    nodes' disks, in node slices."""
    directory = as_path(directory)
    if not isinstance(directory, Path):  # a bucket: --to-nodes writes RUN on a shared filesystem
        return False
    if not (directory.parent / NODES_SIDECAR).is_file():  # a run that says so, not token files gone missing
        return False
    return bool(shards) and all(
        isinstance(s, dict)
        and isinstance(s.get("path"), str)
        and "rows_xxh3_128" in s
        and not (directory / s["path"]).exists()
        and (directory / f"{s['path']}{ROWS_SUFFIX}").exists()
        for s in shards
    )


def contained_shard(directory, entry: dict, i: int, regular: bool = True) -> "Path":
    """The token file of shard `i` (its manifest entry), once it and every file of the shard are
    known to stay inside `directory` (tokpack.formats.io.contained; a TokpackError otherwise).
    `regular=False`: odd file types are left to the gate at each file's open (a reader that
    never opens a sidecar does not refuse it)."""
    return contained(
        directory,
        entry.get("path"),
        manifest=f"{str(directory).rstrip('/')}/{MANIFEST}",
        where=f"shards[{i}].path",
        regular=regular,
        siblings=(*SHARD_SUFFIXES[1:], PAD_SUFFIX, ROWS_SUFFIX),
    )


class RowFacts:
    """What a run epoch records of each of its rows, each file checked against the epoch
    manifest before use, one shard at a time: the row's xxh3-64 from `.ds.rows` (for an epoch
    written before row hashes, recomputed from the shard, whose checksum vouches for them) and
    its padding from `.ds.pad` (zeros for a shard without one, as readers take it). Staging a
    node slice and validating one against its run both ask this object. Positions asked for
    only increase, so the last two shards are kept: 12 bytes a row of two shards."""

    def __init__(self, manifest: dict, row_bytes: int, blocks, where: str, hint: str):
        self.shards = manifest["shards"]  # the epoch manifest's entries, already checked
        self.per = int(manifest["shard_samples"])  # rows of every shard but the last
        self.row_bytes = row_bytes  # (seq_len + 1) * token_size
        self.blocks = blocks  # (shard, suffix, size) -> the file's `size` bytes, in blocks of whole rows
        self.where = where.rstrip("/")  # the epoch folder, as errors name it
        self.hint = hint  # what to do when the run is damaged
        self._hashes: dict[int, np.ndarray] = {}
        self._pads: dict[int, np.ndarray] = {}

    def _verified(self, i: int, suffix: str, key: str, size: int, each) -> np.ndarray:
        s, digest, parts = self.shards[i], FileDigest(self.shards[i][key]), []
        for block in self.blocks(i, suffix, size):
            digest.update(block)
            parts.append(each(block))
        err = digest_error(digest, f"{self.where}/{s['path']}{suffix}", "checksum mismatch in the run", self.hint)
        if err is not None:
            raise err
        return np.concatenate(parts) if len(parts) > 1 else parts[0] if parts else each(b"")

    def hashes(self, i: int) -> np.ndarray:
        """Shard i's row hashes."""
        if "rows_xxh3_128" in self.shards[i]:
            return self._kept(self._hashes, i, ROWS_SUFFIX, "rows_xxh3_128", ROW_HASH_DTYPE)
        rows = np.dtype((np.void, self.row_bytes))  # an epoch written before row hashes: its rows, hashed
        return self._kept(self._hashes, i, "", "xxh3_128", rows, lambda b: row_hashes(np.frombuffer(b, dtype=rows)))

    def pads(self, i: int) -> np.ndarray:
        """Shard i's padding tokens per row."""
        if has_pad(self.shards[i]):
            return self._kept(self._pads, i, PAD_SUFFIX, "pad_xxh3_128", PAD_DTYPE)
        return np.zeros(int(self.shards[i]["samples"]), dtype=PAD_DTYPE)

    def _kept(self, kept: dict, i: int, suffix: str, key: str, dtype: np.dtype, each=None) -> np.ndarray:
        """Shard i's file `suffix`, a `dtype` item a row, checked against its entry's `key` (`each`:
        what a block of it gives, by default its items), from `kept`: that file's last two shards."""
        if i not in kept:
            each = each or (lambda b: np.frombuffer(bytes(b), dtype=dtype))
            got = self._verified(i, suffix, key, int(self.shards[i]["samples"]) * dtype.itemsize, each)
            for k in [k for k in kept if k <= i - 2]:
                del kept[k]
            kept[i] = got
        return kept[i]

    def gather(self, pos: np.ndarray, of) -> np.ndarray:
        """`of(shard)[row]` at epoch positions `pos` (increasing)."""
        shard = pos // self.per
        return np.concatenate([of(int(i))[pos[shard == i] - i * self.per] for i in np.unique(shard)] or [of(0)[:0]])


class _ShardFiles:
    """What both shard writers share: the `.ds.metadata` written at close, and an abort that
    leaves no descriptor or temporary file of the files open (None: not opened, or not this kind's)."""

    _ds = _index = _loss = _rows = _pad = None

    def _metadata(self, tokens: int) -> str:
        """Writes the shard's `.ds.metadata` for `tokens` tokens; returns its xxh3_128."""
        meta = metadata_text(self.tokenizer, self.dtype.itemsize, tokens).encode()
        write_bytes_atomic(self.directory / f"{self.name}.metadata", meta, fsync=True)
        return xxhash.xxh3_128_hexdigest(meta)

    def abort(self) -> None:
        for f in (self._ds, self._index, self._loss, self._rows, self._pad):
            if f is not None:
                f.abort()


class SourceShardWriter(_ShardFiles):
    """One shard of a packed source. Documents are appended whole; every one must end with EOS."""

    def __init__(
        self,
        directory: str | Path,
        name: str,
        dtype: np.dtype,
        tokenizer: str,
        with_loss: bool = False,
        sink=DurableFile,
    ):
        self.directory = Path(directory)
        self.name = name  # final file name, e.g. "00000.ds"
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.tokenizer = tokenizer
        self.tokens = 0  # tokens written so far
        self.documents = 0  # documents written so far
        try:
            # `sink`: DurableFile, or what pack --link uses to record the same entry without
            # writing the token files (formats/io.py HashedFile)
            self._ds = sink(self.directory / name, direct=True)
            self._index = sink(self.directory / f"{name}.index")
            self._loss = sink(self.directory / f"{name}.loss") if with_loss else None
        except BaseException:
            self.abort()  # the files already open: no descriptor or temporary file left behind
            raise

    def write(self, tokens: np.ndarray, doc_ends: np.ndarray, loss: np.ndarray | None = None) -> None:
        """`doc_ends`: ends of the documents in `tokens`, relative to its start, last == len(tokens)."""
        if len(tokens) == 0:
            return
        self._ds.write(np.ascontiguousarray(tokens, dtype=self.dtype))
        self._index.write(np.asarray(doc_ends, dtype=U64) + np.uint64(self.tokens))
        if self._loss is not None:
            self._loss.write(np.ascontiguousarray(loss, dtype=np.uint8))
        self.tokens += len(tokens)
        self.documents += len(doc_ends)

    def close(self) -> dict:
        """Commits the files and returns the shard's manifest entry."""
        entry = {
            "path": self.name,
            "tokens": self.tokens,
            "bytes": self._ds.bytes,
            "documents": self.documents,
            "xxh3_128": self._ds.commit(),
            "index_xxh3_128": self._index.commit(),
        }
        if self._loss is not None:
            entry["loss_xxh3_128"] = self._loss.commit()
        entry["metadata_xxh3_128"] = self._metadata(self.tokens)
        return entry


class EpochShardWriter(_ShardFiles):
    """One shard of an epoch: whole samples of `seq_len + 1` tokens, back to back, and every
    file beside them: `.ds.index`, `.ds.metadata`, `.ds.rows` and, `padded` (best-fit),
    `.ds.pad`. close() returns the shard's whole manifest entry, its fragment count included.

    The index lists every fragment end: the position after each EOS token and every
    sample end, strictly increasing.
    """

    def __init__(
        self,
        directory: str | Path,
        name: str,
        dtype: np.dtype,
        seq_len: int,
        eos_id: int,
        tokenizer: str,
        padded: bool = False,
        hashed_only: bool = False,
        placed: bool = False,
    ):
        """`hashed_only`: the `.ds` is neither written nor hashed and the `.ds.index` is hashed,
        not written (their entry is the same); the row hashes, padding and metadata are written.
        Then write_known_index and write_pad are all a caller needs: no token is asked for.
        `placed`: the `.ds` is written row by row in any order (`reserve`, then `write_at`),
        before write_rows gets the same rows in order, which then only counts their tokens
        (PlacedFile).

        The entry records no checksum of the `.ds` (docs/FORMAT.md): `.ds.rows` holds each
        row's xxh3-64 and `rows_xxh3_128` vouches for it, so a reader checks the tokens row by
        row, and nothing here hashes them a second time."""
        self.directory = Path(directory)
        self.name = name  # final file name
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.row_tokens = seq_len + 1
        self.eos_id = eos_id
        self.tokenizer = tokenizer
        self.samples = 0  # samples written so far
        self.multiset = 0  # running sum of xxh3_64 over samples, mod 2^64
        try:
            if placed and not hashed_only:
                self._ds = PlacedFile(self.directory / name, hashed=False)
            elif not hashed_only:
                self._ds = DurableFile(self.directory / name, direct=True, hashed=False)
            self._index = (HashedFile if hashed_only else DurableFile)(self.directory / f"{name}.index")
            # Each sample's xxh3_64: what lets a node copy and verify some rows without the others.
            self._rows = DurableFile(self.directory / f"{name}{ROWS_SUFFIX}")
            # A best-fit shard's padding per sample: the row hashes do not cover it, and a reader
            # must not train on it.
            self._pad = DurableFile(self.directory / f"{name}{PAD_SUFFIX}") if padded else None
        except BaseException:
            self.abort()  # the file already open: no descriptor or temporary file left behind
            raise

    def write_rows(self, rows: np.ndarray) -> None:
        """`rows`: [n, seq_len+1] tokens, or the same bytes as a 1-D np.void row view."""
        self.write_tokens(rows)
        self.write_index(rows)

    # write_rows in two halves that may run in two threads at once (each in order): one is
    # disk-bound, the other CPU-bound, and on two cores overlapping them is most of the speed.

    def _tokens(self, rows: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(rows).view(self.dtype).reshape(len(rows), self.row_tokens)

    def write_tokens(self, rows: np.ndarray) -> None:
        """The rows' bytes into the .ds file (`hashed_only`: nowhere)."""
        if len(rows) and self._ds is not None:
            self._ds.write(self._tokens(rows))

    def write_index(self, rows: np.ndarray, hashes: np.ndarray | None = None) -> None:
        """The rows' fragment ends into the .ds.index file, and their hashes (`hashes`: when known)."""
        if len(rows) == 0:
            return
        tokens = self._tokens(rows)
        counts, cols = eos_columns(tokens, self.eos_id)
        ends = fragment_ends(counts, cols, self.row_tokens)
        self.write_known_index(len(rows), ends, row_hashes(tokens) if hashes is None else hashes)

    def write_known_index(self, n: int, ends: np.ndarray, hashes: np.ndarray) -> None:
        """What write_index(rows) writes, for n rows whose fragment ends (relative to their
        first row, see RowFragments) and row hashes the caller already knows."""
        if n == 0:
            return
        self._index.write(ends.astype(U64) + np.uint64(self.samples * self.row_tokens))
        self._rows.write(np.ascontiguousarray(hashes, dtype=ROW_HASH_DTYPE))
        self.multiset = (self.multiset + int(hashes.sum(dtype=np.uint64))) & MASK64
        self.samples += n

    def reserve(self, rows: int) -> None:
        """A `placed` shard's token file at its final size: `rows` rows."""
        self._ds.reserve(rows, self.row_tokens * self.dtype.itemsize)

    def write_at(self, data: memoryview, starts: np.ndarray, rows: np.ndarray) -> None:
        """A `placed` shard's rows `rows` (in any order) now complete: each a row's bytes of
        `data` (the same buffer each call), from its byte of `starts` (the caller's rows, which
        it keeps unchanged until they reach write_rows in order); the pages they complete are
        written now (PlacedFile.place)."""
        self._ds.place(data, starts, rows)

    def write_pad(self, pad: np.ndarray) -> None:
        """The padding tokens (at the sample's end) of the next samples, in order, into `.pad`
        (a shard opened `padded`)."""
        self._pad.write(np.ascontiguousarray(pad, dtype=PAD_DTYPE))

    def close(self) -> dict:
        tokens = self.samples * self.row_tokens
        if self._ds is not None:
            self._ds.commit()  # no checksum: the row hashes are the token file's (__init__)
        entry = {
            "path": self.name,
            "tokens": tokens,
            "bytes": tokens * self.dtype.itemsize if self._ds is None else self._ds.bytes,
            "samples": self.samples,
            "index_xxh3_128": self._index.commit(),
            "rows_xxh3_128": self._rows.commit(),
        }
        entry["metadata_xxh3_128"] = self._metadata(tokens)
        entry["multiset_hash"] = f"{self.multiset:016x}"
        if self._pad is not None:
            entry["pad_xxh3_128"] = self._pad.commit()
        entry["fragments"] = self._index.bytes // INDEX_ENTRY_BYTES
        return entry


class RowFragments:
    """Per-row facts an epoch shard records, computed once per source row so that writing a
    shuffled chunk needs no second pass over its tokens: the ends of the EOS fragments in
    each row and each row's xxh3_64. Memory: about 24 bytes per row."""

    def __init__(self, row_tokens: int):
        self.row_tokens = row_tokens  # seq_len + 1
        self.cols: list[np.ndarray] = []  # per part: 1 + column of each EOS, row-major order
        self.counts: list[np.ndarray] = []  # per part: EOS per row
        self.hashes: list[np.ndarray] = []  # per part: xxh3_64 of each row
        self._first: np.ndarray | None = None  # index into cols of each row's first EOS, plus the total
        self._cols: np.ndarray | None = None
        self._hash: np.ndarray | None = None

    def add(self, rows: np.ndarray, dtype: np.dtype, eos_id: int, block_rows: int = 4096) -> None:
        """Appends the facts of `rows` (np.void rows of one part, in store order)."""
        n, width = len(rows), self.row_tokens
        cols, counts = [], np.zeros(n, dtype=np.int64)
        for a in range(0, n, block_rows):  # blocks bound the boolean temporary
            tokens = np.ascontiguousarray(rows[a : a + block_rows]).view(dtype).reshape(-1, width)
            c, k = eos_columns(tokens, eos_id)
            cols.append(k.astype(np.int32))
            counts[a : a + len(tokens)] = c
        self.cols.append(np.concatenate(cols) if cols else np.empty(0, np.int32))
        self.counts.append(counts)
        self.hashes.append(row_hashes(rows))

    def finish(self) -> None:
        counts = np.concatenate(self.counts) if self.counts else np.empty(0, np.int64)
        self._first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._cols = np.concatenate(self.cols) if self.cols else np.empty(0, np.int32)
        self._hash = np.concatenate(self.hashes) if self.hashes else np.empty(0, np.uint64)
        self.cols, self.counts, self.hashes = [], [], []

    def of(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(fragment ends relative to the first row, row hashes) of store rows `idx` laid
        out one after another: each EOS end, and every row end (fragment_ends)."""
        first, count = self._first[idx], self._first[idx + 1] - self._first[idx]
        starts = np.cumsum(count) - count  # first slot of each row in the output
        at = np.repeat(first - starts, count) + np.arange(int(count.sum()), dtype=np.int64)
        return fragment_ends(count, self._cols[at], self.row_tokens), self._hash[idx]


def eos_columns(tokens: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(EOS tokens in each row, 1 + the column of each, row by row) of `tokens`, [rows, width]:
    what a row's fragment ends are made of (fragment_ends)."""
    width = tokens.shape[1]
    flat = _where(tokens == eos_id)
    row = flat // width
    return np.bincount(row, minlength=len(tokens)), flat - row * width + 1


def _where(hit: np.ndarray) -> np.ndarray:
    """np.flatnonzero(hit) of a boolean array, faster where few are set (EOS tokens, one a
    document): the 8-byte words holding any are found first, then the hits inside them, instead
    of a look at every byte (0.03 s a GB against 0.10 here: rank_files.row_facts and the scatter
    pass both look for every EOS of the epoch)."""
    hit = np.ascontiguousarray(hit).reshape(-1)
    whole = len(hit) - len(hit) % 8
    words = np.flatnonzero(hit[:whole].view(np.uint64) != 0)
    if len(words) > whole // 64:  # dense: the candidates would outweigh the look they save
        return np.flatnonzero(hit)
    candidates = (words[:, None] * 8 + np.arange(8)).reshape(-1)
    return np.concatenate([candidates[hit[candidates]], whole + np.flatnonzero(hit[whole:])])


def fragment_ends(counts: np.ndarray, cols: np.ndarray, width: int) -> np.ndarray:
    """The fragment ends, relative to the first row, of rows of `width` tokens laid out one
    after another with `counts` EOS each at `cols` (1 + column, increasing within a row): each
    EOS end, then its row's end (an EOS at the row's last token is that end, once), in order,
    as the epoch index records them (EpochShardWriter.write_known_index), without a sort."""
    n = len(counts)
    row = np.repeat(np.arange(n, dtype=np.int64), counts)
    inner_sel = cols < width
    row, c = row[inner_sel], cols[inner_sel]
    inner = np.bincount(row, minlength=n)
    per = inner + 1
    start = np.cumsum(per) - per
    out = np.empty(int(per.sum()), np.int64)
    rank = np.arange(len(row)) - np.repeat(np.cumsum(inner) - inner, inner)
    out[start[row] + rank] = row * width + c
    out[start + inner] = (np.arange(n, dtype=np.int64) + 1) * width
    return out


def shard_on_disk(directory: str | Path, entry: dict, itemsize: int) -> bool:
    """Whether a shard its writer recorded (the entry close() returned) is still on disk: the
    token file at its recorded size, its other files (index, metadata, ...) present. Sizes, not checksums:
    each file is fsync'd before its rename and the entry recorded after, so a crash cannot
    leave a present file wrong; a change by hand since is what `tokpack validate` reports.
    `directory` may be a URL: a bucket output's shards are checked where they were sent."""
    directory = as_path(directory)
    name, tokens = (entry.get("path"), entry.get("tokens")) if isinstance(entry, dict) else (None, None)
    if not isinstance(name, str) or _SHARD_FILE.fullmatch(name) is None or type(tokens) is not int:
        return False  # a damaged record vouches for nothing: the shard is written again
    try:
        return (directory / name).stat().st_size == tokens * itemsize and all(
            (directory / f"{name}{suffix}").exists() for suffix in shard_suffixes(entry)[1:]
        )
    except FileNotFoundError:
        return False


@dataclass
class PackedSource:
    """A packed source opened for reading. Shard sizes are checked against the manifest
    when it is opened, so a truncated or missing shard fails here, not mid-run."""

    path: Path  # the source directory
    manifest: dict  # its tokpack.json
    dtype: np.dtype  # little-endian uint16 or uint32
    shards: list[dict]  # manifest entries, in stream order
    shard_starts: np.ndarray = field(repr=False)  # token offset of each shard in the stream, plus the total
    # A verified local copy (`shuffle --to-nodes --keep-sources`): the source's own folder, which
    # plans and manifests name; its files are read at `path`, the copy.
    kept_from: Path | None = None
    # Shards of such a copy whose bytes were hashed just now, before this epoch reads them (a
    # copy made or verified by --keep-sources): the epoch's reads do not hash them a second time.
    hashed: frozenset = frozenset()

    @property
    def home(self) -> Path:
        """The source's folder as plans and manifests name it (for a kept copy: not where it is read)."""
        return self.path if self.kept_from is None else self.kept_from

    @classmethod
    def open(cls, path: str | Path, check_sizes: bool = True) -> "PackedSource":
        path = as_path(path)
        manifest = read_source_manifest(path)  # its shard entries read from its text as used
        dtype = dtype_from_name(manifest.get("dtype"))
        shards = manifest.get("shards") or []
        starts = np.zeros(len(shards) + 1, dtype=np.int64)
        for i, s in enumerate(shards):
            starts[i + 1] = starts[i] + int(s["tokens"])
            f = contained_shard(path, s, i)
            if check_sizes:
                try:
                    regular_size(
                        f,
                        size=int(s["tokens"]) * dtype.itemsize,
                        what="shard",
                        hint="the shard was truncated or replaced; run `tokpack validate` on the source",
                    )
                except FileNotFoundError:
                    raise TokpackError(
                        "shard listed in the manifest is missing",
                        file=f,
                        hint="restore the file, or run `tokpack validate` on the source",
                    ) from None
        return cls(path, manifest, dtype, shards, starts)

    @property
    def tokens(self) -> int:
        return int(self.shard_starts[-1])

    @property
    def eos_id(self) -> int:
        return int(self.manifest["eos_id"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    def read_into(self, start: int, out: np.ndarray, handles: dict | None = None) -> np.ndarray:
        """Fills `out` (a 1-D token buffer) with the stream's tokens [start, start+len(out)),
        crossing shard boundaries with plain sequential reads. `handles`, for a caller that
        reads front to back: open files kept between calls (the caller closes them), so the
        kernel's read-ahead of each file carries over from one call to the next."""
        count = len(out)
        if start < 0 or start + count > self.tokens:
            raise IndexError(f"token range [{start}, {start + count}) outside the source's {self.tokens} tokens")
        raw = out.view(np.uint8)
        for i, in_shard, done, n in self._pieces(start, count):
            f = self._handle(i, handles)
            try:
                f.seek(in_shard * self.dtype.itemsize)
                view = memoryview(raw[done * self.dtype.itemsize : (done + n) * self.dtype.itemsize])
                if read_full(f, view) < view.nbytes:
                    raise TokpackError("shard shorter than its manifest says", file=self.path / self.shards[i]["path"])
            finally:
                if handles is None:
                    f.close()
        return out

    def mapped(self, start: int, count: int, handles: dict) -> np.ndarray | None:
        """Tokens [start, start+count) of one shard as a view of its page-cache pages (mapped
        and read in: gate.map_range), on read_into's `handles`: no copy into a buffer. None
        where they cross a shard's end or the file cannot be mapped (a URL): read_into them."""
        pieces = list(self._pieces(start, count)) if start >= 0 and count > 0 and start + count <= self.tokens else []
        if len(pieces) != 1:
            return None
        i, in_shard, _, n = pieces[0]
        f = self._handle(i, handles)
        try:
            view = map_range(f, in_shard * self.dtype.itemsize, n * self.dtype.itemsize)
        except TokpackError as e:
            raise TokpackError(
                "shard shorter than its manifest says",
                file=self.path / self.shards[i]["path"],
                where="size",
                expected=e.expected,
                found=e.found,
                hint="the shard was truncated or replaced since pack; run `tokpack validate` on the source",
            ) from None
        return None if view is None else view.view(self.dtype)

    def will_need(self, start: int, count: int, handles: dict) -> None:
        """Tokens [start, start+count) asked of the kernel now (gate.will_need), on read_into's
        `handles` (opened here if they are not yet): the reader's next read_into of them finds
        them in memory, read while it worked on the last. Past the stream's end: up to it."""
        count = min(count, self.tokens - start)
        for i, in_shard, _, n in self._pieces(start, count) if start >= 0 and count > 0 else ():
            will_need(self._handle(i, handles), in_shard * self.dtype.itemsize, n * self.dtype.itemsize)

    def _pieces(self, start: int, count: int):
        """(shard, first token in it, tokens before it in the range, tokens) of each shard that
        tokens [start, start+count) cross, in order."""
        done = 0
        i = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
        while done < count:
            n = min(count - done, int(self.shard_starts[i + 1]) - start - done)
            if n > 0:
                yield i, start + done - int(self.shard_starts[i]), done, n
            done += n
            i += 1

    def _handle(self, i: int, handles: dict | None):
        """Shard i open for reading: `handles`' (opened and kept there the first time, the one
        kept longest closed past KEPT_HANDLES), else a new one."""
        f = handles.get(i) if handles is not None else None
        if f is None:
            f = open_read(self.path / self.shards[i]["path"], ahead=handles is not None)
            if handles is not None:
                while len(handles) >= KEPT_HANDLES:
                    handles.pop(next(iter(handles))).close()
                handles[i] = f
        return f

    def doc_ends(self, shard: int) -> np.ndarray:
        """The shard's `.ds.index`: cumulative document ends in tokens."""
        return read_array(self.path / f"{self.shards[shard]['path']}{INDEX_SUFFIX}", U64)
