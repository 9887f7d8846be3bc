"""How a shard entry vouches for its token file, and the digests that check that file as its
bytes stream by (docs/FORMAT.md, "Checksums"). A source's entry, and an epoch's or slice
epoch's written before row hashes alone vouched for its tokens, records the whole file's
xxh3-128 (`xxh3_128`). An epoch's or slice epoch's written since records none: its `.ds.rows`
(each row's xxh3-64), checked against `rows_xxh3_128`, proves the file row by row, which lets
`shuffle --to-nodes` record a shard whose tokens its owner never sees in order. Readers accept
both. Both digests take the file's bytes in pieces of any size, in order (a copy's blocks, a
memory map's ranges, a reader's buffer), so a reader checks the file in the pass it already
makes over it, and a refusal is one TokpackError line naming the file and the row."""

from __future__ import annotations

import numpy as np
import xxhash

from .constants import ROW_HASH_DTYPE, ROWS_SUFFIX
from .errors import TokpackError
from .hashes import hash_hex64, row_hashes
from .io.gate import iter_file_blocks, read_array

WHOLE = "xxh3_128"  # the token file's checksum: a source's, an epoch's written before row-hash-only entries
ROWS = "rows_xxh3_128"  # the checksum of its `.ds.rows`, whose entries vouch for it row by row


def token_check(entry: dict) -> tuple[str, str] | None:
    """(field, checksum) that vouches for a shard entry's token file: its `xxh3_128` when it
    has one, else its `rows_xxh3_128`; None when it has neither (formats/fields.py refuses such
    an epoch or slice-epoch entry)."""
    for key in (WHOLE, ROWS):
        if isinstance(entry.get(key), str):
            return key, entry[key]
    return None


class FileDigest:
    """The xxh3-128 of a file's bytes as they come, against its entry's `where` (a token file's
    `xxh3_128`, a `.ds.rows`'s `rows_xxh3_128`...)."""

    def __init__(self, expected: str, where: str = WHOLE):
        self.expected = expected
        self.where = where  # the entry's field, as a mismatch names it
        self.hash = xxhash.xxh3_128()

    def update(self, data) -> None:
        self.hash.update(data)

    def problem(self) -> tuple[str, object, object] | None:
        """(where, expected, found) when the bytes fed are not the file recorded; else None."""
        found = self.hash.hexdigest()
        return None if found == self.expected else (self.where, self.expected, found)


class RowDigest:
    """Each row's xxh3-64 of a token file's bytes as they come, against `recorded` (its
    `.ds.rows`, already checked against `rows_xxh3_128`: recorded_rows). A row cut between two
    pieces is kept until its end comes; after the first row that differs, rows are only counted."""

    def __init__(self, recorded: np.ndarray, row_bytes: int, rows_file: str = ".ds.rows"):
        self.recorded = recorded  # uint64, one a row
        self.row_bytes = row_bytes  # (seq_len + 1) * token_size
        self.rows_file = rows_file  # as errors name it
        self.rows = 0  # whole rows fed so far
        self.part = b""  # the bytes of a row begun but not ended
        self.bad: tuple[str, object, object] | None = None  # the first problem: (where, expected, found)

    def update(self, data) -> None:
        mv = memoryview(data).cast("B")
        L = self.row_bytes
        if self.part:
            take = min(L - len(self.part), mv.nbytes)
            self.part += bytes(mv[:take])
            mv = mv[take:]
            if len(self.part) == L:
                self._rows(self.part)
                self.part = b""
        k = mv.nbytes - mv.nbytes % L
        if k:
            self._rows(mv[:k])
        if k < mv.nbytes:
            self.part = bytes(mv[k:])

    def _rows(self, data) -> None:
        n = len(data) // self.row_bytes  # bytes, or a memoryview of bytes
        if self.bad is None:
            got = row_hashes(np.frombuffer(data, dtype=np.uint8).reshape(n, self.row_bytes))
            want = self.recorded[self.rows : self.rows + n]
            diff = np.flatnonzero(got[: len(want)] != want)
            if len(diff):
                k = self.rows + int(diff[0])
                self.bad = row_mismatch(
                    k, self.row_bytes, int(self.recorded[k]), int(got[k - self.rows]), self.rows_file
                )
            elif len(want) < n:
                self.bad = self._count_problem(self.rows + len(want), "more rows")
        self.rows += n

    def _count_problem(self, row: int, found: str) -> tuple[str, object, object]:
        n = len(self.recorded)
        return f"row {row}", f"{n} rows ({n * self.row_bytes} bytes, as {self.rows_file} has)", found

    def problem(self) -> tuple[str, object, object] | None:
        """(where, expected, found) of the first row that is not the row recorded, or of a file
        that holds fewer or more rows than recorded; else None."""
        if self.bad is None and (self.part or self.rows < len(self.recorded)):
            return self._count_problem(self.rows, f"{self.rows * self.row_bytes + len(self.part)} bytes")
        return self.bad


def row_mismatch(row: int, row_bytes: int, recorded: int, got: int, rows_file: str) -> tuple[str, str, str]:
    """(where, expected, found) of a token file's row whose xxh3-64 `got` is not its entry in `rows_file`."""
    return (
        f"row {row} (byte {row * row_bytes})",
        f"xxh3_64 {hash_hex64(recorded)} (its entry in {rows_file})",
        hash_hex64(got),
    )


def recorded_rows(ds, checksum: str, samples: int, hint: str) -> np.ndarray:
    """The `.ds.rows` of token file `ds` (a path or URL), through the gate at its size (8 bytes
    a sample), checked against `checksum` (the entry's `rows_xxh3_128`) before any of its
    entries is believed; a TokpackError line otherwise."""
    rows = f"{ds}{ROWS_SUFFIX}"
    try:
        got = read_array(rows, ROW_HASH_DTYPE, size=samples * ROW_HASH_DTYPE.itemsize, what="row hashes", hint=hint)
    except FileNotFoundError:
        raise TokpackError("row hashes listed in the manifest are missing", file=rows, where=ROWS, hint=hint) from None
    found = xxhash.xxh3_128_hexdigest(got.tobytes())
    if found != checksum:
        raise TokpackError("checksum mismatch", file=rows, where=ROWS, expected=checksum, found=found, hint=hint)
    return got


def digest_error(digest, file, message: str, hint: str) -> TokpackError | None:
    """One line for a digest fed the whole file (`message`: what the caller was doing), or None
    when the file is the one recorded."""
    got = digest.problem()
    if got is None:
        return None
    where, expected, found = got
    return TokpackError(message, file=file, where=where, expected=expected, found=found, hint=hint)


def verify_token_file(ds, check: tuple[str, str], samples: int, row_bytes: int, buf: bytearray, **say) -> None:
    """Token file `ds` of `samples` rows of `row_bytes` bytes read once, front to back (in `buf`),
    against its entry's `check` (token_check: a FileDigest, or a RowDigest over its checked
    `.ds.rows`): a TokpackError line (`say`: message, hint) naming the file and, checked by row, the row."""
    key, checksum = check
    if key == WHOLE:
        digest = FileDigest(checksum)
    else:
        rows_file = f"{ds}{ROWS_SUFFIX}".rsplit("/", 1)[-1]
        digest = RowDigest(recorded_rows(ds, checksum, samples, say["hint"]), row_bytes, rows_file)
    for block in iter_file_blocks(ds, buf, length=samples * row_bytes):
        digest.update(block)
    err = digest_error(digest, ds, say["message"], say["hint"])
    if err is not None:
        raise err
