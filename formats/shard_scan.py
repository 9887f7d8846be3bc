"""The streaming shard scan of `tokpack validate`: every check of one shard's files (.ds,
.ds.index, .ds.metadata, .ds.loss). Every mode checks sizes, `.ds.metadata` and each
`.ds.index` (strictly increasing, ending at the token count; in epochs every sample end is an
entry). Full mode adds one sequential pass over every file that hashes it (xxh3_128; an
epoch's token file whose entry records none: each row against its `.ds.rows`), scans
tokens (< vocab_size; a source's documents end with EOS; an epoch's index equals its EOS
positions plus sample ends) and recomputes the sample multiset hash (and, for `--against`,
the order hash of the shard's samples at their output positions).

Problems are collected, never raised: a CI log should list all of them, one line each.
"""

from __future__ import annotations

from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import xxhash

from .errors import IncompleteError, TokpackError
from .io.memory import give_buffers, take_buffer
from .io.gate import open_read, regular_size
from .io.reads import read_ahead, read_full
from .constants import INDEX_ENTRY_BYTES, INDEX_SUFFIX, LOSS_SUFFIX, METADATA_SUFFIX, ROW_HASH_BYTES, ROWS_SUFFIX, U64
from .constants import ROW_HASH_DTYPE
from .constants import EPOCH, MANIFEST, MASK64, SOURCE
from .hashes import hash_hex64, order_hash, row_hashes
from .names import metadata_text, parse_metadata_text
from .fields import type_ok
from .token_check import row_mismatch

MAX_METADATA = 1 << 16
# Read block: smaller than tokpack.formats.io.IO_BLOCK, and it keeps a cold read pipelined best
# with the read-ahead thread (BENCHMARKS.md, "validate").
BLOCK = 2 << 20


@dataclass
class Problem:
    """One thing wrong, as one line of the report."""

    file: str  # the file (or directory) at fault
    where: str | None  # field, byte/token offset, entry number...
    expected: object  # what the format requires
    found: object  # what is there
    message: str  # what is wrong, in words
    incomplete: bool = False  # unfinished output (rerun), rather than corrupt data
    hint: str | None = None  # what to do about it; a default by kind of problem when None
    unverified: bool = False  # a check that was asked for could not be made (nothing found wrong)
    missing: bool = False  # a path given that does not exist (a typo): nothing there to be corrupt

    @property
    def severity(self) -> str:
        flags = (("missing", self.missing), ("incomplete", self.incomplete), ("unverified", self.unverified))
        return next((name for name, flag in flags if flag), "corrupt")

    def line(self) -> str:
        return problem_line(self.to_json())

    def hint_text(self) -> str | None:
        if self.hint:
            return self.hint
        if self.incomplete:
            return "a run was interrupted or is still going; rerun the same command to finish it"
        if self.file.endswith(MANIFEST):
            return "the manifest was edited or belongs elsewhere; restore it or rerun the command that wrote it"
        return "the data changed after it was written; restore it from a good copy or rerun the stage that wrote it"

    def to_json(self) -> dict:
        s = lambda v: None if v is None else str(v)  # noqa: E731
        return {
            "file": self.file,
            "where": self.where,
            "expected": s(self.expected),
            "found": s(self.found),
            "message": self.message,
            "severity": self.severity,
            "hint": self.hint_text(),
        }

    @classmethod
    def from_error(cls, e: TokpackError) -> "Problem":
        return cls(e.file or "", e.where, e.expected, e.found, e.message, isinstance(e, IncompleteError), e.hint)


def problem_line(p: dict) -> str:
    """A problem (`Problem.to_json()`) as one line of the report."""
    return f"{p['severity'].upper()} " + str(
        TokpackError(
            p["message"], file=p["file"], where=p["where"], expected=p["expected"], found=p["found"], hint=p["hint"]
        )
    )


def worst_status(problems: list[Problem]) -> str:
    """'ok' only without problems; otherwise the gravest severity among them."""
    severities = {p.severity for p in problems}
    return next((s for s in ("corrupt", "missing", "incomplete", "unverified") if s in severities), "ok")


@dataclass
class ShardJob:
    """One shard's files and what the manifest promises about them."""

    directory: Path  # where the shard lives
    entry: dict  # its manifest entry (fields already type-checked)
    kind: str  # SOURCE or EPOCH
    dtype: np.dtype  # token dtype from the manifest
    vocab_size: int  # token ids must be below it
    eos_id: int  # end-of-document id
    tokenizer: str  # expected in .ds.metadata
    row_tokens: int | None  # epoch: seq_len + 1 tokens per sample; None for sources
    quick: bool  # structure only: no checksums, no token scan
    first_sample: int | None = None  # epoch, full mode: output position of its first sample, to sum its
    # order hash (validate --against); None: no order hash

    def size(self) -> int:
        return int(self.entry["tokens"]) * self.dtype.itemsize


@dataclass
class Findings:
    """What checks found, in one shard (check_shard's result) or one directory (DirReport)."""

    problems: list[Problem] = field(default_factory=list)  # in check order
    files: int = 0  # files looked at
    bytes: int = 0  # bytes of those files (read in full mode, stat'ed in quick mode)
    multiset: int | None = None  # epoch, full mode: recomputed sum of sample hashes
    order: int | None = None  # epoch, full mode with ShardJob.first_sample: recomputed order hash

    def add(self, file, where, expected, found, message, **kw) -> None:
        self.problems.append(Problem(str(file), where, expected, found, message, **kw))

    def saw(self, nbytes: int) -> None:
        self.files += 1
        self.bytes += nbytes


class _IndexStream:
    """Reads a `.ds.index` front to back in chunks, hashing its bytes and checking that
    entries strictly increase. `upto(limit)` hands out the entries <= limit in order."""

    def __init__(self, path: Path, chunk_entries: int, hashed: bool, size: int):
        self.f = open_read(path, BLOCK)
        self.left = size  # bytes not yet read (the size was checked), so EOF costs no extra read
        self.buf = np.empty(max(chunk_entries, 1), dtype=U64)  # reused read buffer
        self.pending = self.buf[:0]  # read but not yet handed out
        self.hash = xxhash.xxh3_128() if hashed else None  # running checksum of the file
        self.last = 0  # last entry read; the next must exceed it (no leading 0)
        self.count = 0  # entries read so far
        self.broken: tuple | None = None  # (entry number, previous, found) of the first decrease

    def _fill(self) -> bool:
        raw = memoryview(self.buf.view(np.uint8))[: min(self.buf.nbytes, self.left)]
        n = read_full(self.f, raw)
        self.left -= n
        if self.hash is not None:
            self.hash.update(raw[:n])
        entries = self.buf[: n // U64.itemsize]
        if len(entries) and self.broken is None:
            prev = np.concatenate([np.array([self.last], dtype=U64), entries[:-1]])
            bad = np.flatnonzero(entries <= prev)
            if len(bad):
                k = int(bad[0])
                self.broken = (self.count + k, int(prev[k]), int(entries[k]))
        if len(entries):
            self.last = int(entries[-1])
        self.count += len(entries)
        self.pending = entries
        return len(entries) > 0

    def upto(self, limit: int) -> np.ndarray:
        pieces = []
        while True:
            if not len(self.pending) and not self._fill():
                break
            k = int(np.searchsorted(self.pending, limit, side="right")) if self.broken is None else len(self.pending)
            pieces.append(self.pending[:k].copy())
            self.pending = self.pending[k:]
            if len(self.pending) or self.broken is not None:
                break
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else np.empty(0, dtype=U64)

    def rest(self) -> int:
        """Reads to the end; returns how many entries were left over."""
        left = len(self.pending)
        self.pending = self.buf[:0]
        while self._fill():
            left += len(self.pending)
        self.pending = self.buf[:0]
        return left

    def close(self):
        self.f.close()


def _read_blocks(path: Path, total: int, block: int) -> Iterator[memoryview]:
    """Yields consecutive blocks of the first `total` bytes of a file, each valid until the next.
    A file of several blocks is read one block ahead (io.read_ahead), so the disk keeps working
    while the previous block is hashed and scanned. Stops early, with a short last block, if the
    file is shorter."""
    bufs = [take_buffer(np.uint8) for _ in range(1 if total <= block else 2)]

    def fill(buf, want: int, _) -> memoryview:
        view = memoryview(buf.ensure(block))[:want]
        return view[: read_full(f, view)]

    try:
        with open_read(path, block) as f:
            if total <= block:  # one block: no thread
                yield fill(bufs[0], total, None)
                return
            plan = ((min(block, total - off), None) for off in range(0, total, block))
            with closing(read_ahead(plan, fill, bufs)) as blocks:
                for view, _ in blocks:
                    yield view
                    if len(view) < block:  # the last block, or the file ended early: nothing follows
                        return
    finally:
        give_buffers(bufs)


def _file_size(path: Path, missing: str | None, out: Findings) -> int | None:
    """A shard file's size, or None where it is absent: then, if the manifest lists it, the
    problem `missing` (what is missing)."""
    try:
        return regular_size(path)
    except FileNotFoundError:
        if missing:
            out.add(path, None, "a file listed in the manifest", "no such file", missing)
        return None


def check_shard(job: ShardJob) -> Findings:
    """All checks of one shard (.ds, .ds.index, .ds.metadata, .ds.loss). One sequential pass
    over the token file does the hash, the vocabulary scan, the EOS/fragment-end check
    and the multiset hash together."""
    out = Findings()
    ds = job.directory / job.entry["path"]
    idx_path = ds.with_name(ds.name + INDEX_SUFFIX)
    tokens = int(job.entry["tokens"])
    ds_ok = _check_tokens_size(job, ds, tokens, out)
    idx_size, idx_ok = _check_index_size(job, idx_path, tokens, out)
    _check_metadata(job, ds.with_name(ds.name + METADATA_SUFFIX), tokens, out)
    _check_loss(job, ds.with_name(ds.name + LOSS_SUFFIX), tokens, out)
    rows = _row_hashes_file(job, ds.with_name(ds.name + ROWS_SUFFIX), out)

    # ---- index and tokens
    if idx_size is not None and idx_ok:
        # an epoch whose token count is not whole samples was reported from the manifest;
        # its rows cannot be cut, so only its index is checked
        whole_rows = not job.row_tokens or tokens % job.row_tokens == 0
        if job.quick or not ds_ok or not whole_rows:
            _index_only(job, idx_path, tokens, out, idx_size)
        else:
            out.multiset = _full_pass(job, ds, idx_path, tokens, out, idx_size, rows)
    if rows is not None and not job.quick:
        rows.finish(out)
    return out


def _check_tokens_size(job: ShardJob, ds: Path, tokens: int, out: Findings) -> bool:
    """The token file's size against the manifest's token count (every mode); True if it holds."""
    e, tsize = job.entry, job.dtype.itemsize
    ds_size = _file_size(ds, "shard missing", out)
    ds_ok = ds_size == tokens * tsize
    if ds_size is not None and not ds_ok:
        out.add(
            ds,
            "size",
            f"{tokens * tsize} bytes ({tokens} tokens x {tsize})",
            f"{ds_size} bytes",
            "shard size does not match the manifest" + (" (empty file)" if ds_size == 0 else ""),
        )
    if ds_size is not None:
        out.saw(ds_size)
    if ds_ok and e["bytes"] != tokens * tsize:
        out.add(
            job.directory / MANIFEST,
            f"shards[{e['path']}].bytes",
            tokens * tsize,
            e["bytes"],
            "manifest byte count disagrees with its token count",
        )
    return ds_ok


def _check_index_size(job: ShardJob, idx_path: Path, tokens: int, out: Findings) -> tuple[int | None, bool]:
    """The index's size against the manifest's document (source) or fragment and sample
    (epoch) counts (every mode): (its size or None if missing, whether it can be read)."""
    e, w = job.entry, INDEX_ENTRY_BYTES
    idx_size = _file_size(idx_path, "index missing", out)
    if idx_size is None:
        return None, False
    out.saw(idx_size)
    if job.kind == SOURCE and idx_size != w * int(e["documents"]):
        expected = f"{w * int(e['documents'])} bytes ({e['documents']} documents x {w})"
        why = "index size does not match the manifest's document count"
    elif job.kind == EPOCH and type_ok(e.get("fragments"), int) and idx_size != w * e["fragments"]:
        expected = f"{w * e['fragments']} bytes ({e['fragments']} fragments x {w})"
        why = "index size does not match the manifest's fragment count"
    elif job.kind == EPOCH and not (w * int(e["samples"]) <= idx_size <= w * tokens and idx_size % w == 0):
        expected = f"a multiple of {w} in [{w * int(e['samples'])}, {w * tokens}] bytes"
        why = "index size impossible for this shard"
    elif not (idx_size % w == 0 and idx_size > 0 or (idx_size == 0 and tokens == 0)):
        expected, why = f"a non-empty multiple of {w} bytes", "index size invalid"
    else:
        return idx_size, True
    out.add(idx_path, "size", expected, f"{idx_size} bytes", why)
    return idx_size, False


def _check_metadata(job: ShardJob, meta_path: Path, tokens: int, out: Findings) -> None:
    """`.ds.metadata` (every mode: small): its checksum (full mode), fields and exact text."""
    e, tsize = job.entry, job.dtype.itemsize
    try:
        with open_read(meta_path, MAX_METADATA) as f:
            raw = f.read(MAX_METADATA)  # a few dozen bytes; a replaced file must not be read whole
    except FileNotFoundError:
        out.add(meta_path, None, "a file listed in the manifest", "no such file", "metadata missing")
        return
    out.saw(len(raw))
    if not job.quick and xxhash.xxh3_128_hexdigest(raw) != e["metadata_xxh3_128"]:
        out.add(meta_path, "xxh3_128", e["metadata_xxh3_128"], xxhash.xxh3_128_hexdigest(raw), "checksum mismatch")
    try:
        tok, size, count = parse_metadata_text(raw.decode("utf-8", errors="replace"), meta_path)
    except TokpackError as err:
        out.add(meta_path, err.where, err.expected, err.found, err.message)
        return
    if tok != job.tokenizer:
        out.add(meta_path, "tokenizer", job.tokenizer, tok, "metadata tokenizer differs from the manifest")
    if size != tsize:
        out.add(meta_path, "token_size", tsize, size, "metadata token size differs from the manifest dtype")
    if count != tokens:
        out.add(meta_path, "tokens", tokens, count, "metadata token count differs from the manifest")
    if (tok, size, count) == (job.tokenizer, tsize, tokens) and raw != metadata_text(tok, size, count).encode():
        out.add(
            meta_path,
            "line 3",
            repr(metadata_text(tok, size, count)),
            repr(raw.decode(errors="replace")),
            "metadata text differs from what tokpack writes",
        )


def _check_loss(job: ShardJob, loss_path: Path, tokens: int, out: Findings) -> None:
    """The loss mask (optional, sources only): listed iff present, one byte a token, each 0 or
    1, and its checksum (full mode)."""
    e = job.entry
    has_loss = "loss_xxh3_128" in e
    loss_size = _file_size(loss_path, "loss mask missing" if has_loss else None, out)
    if loss_size is None:
        return
    out.saw(loss_size)
    if not has_loss:
        out.add(loss_path, None, "no .loss file (none listed)", f"{loss_size} bytes", "file not listed in the manifest")
    elif loss_size != tokens:
        out.add(loss_path, "size", f"{tokens} bytes (one per token)", f"{loss_size} bytes", "loss mask size wrong")
    elif not job.quick:
        h, offset = xxhash.xxh3_128(), 0
        for view in _read_blocks(loss_path, tokens, BLOCK):
            h.update(view)
            block = np.frombuffer(view, dtype=np.uint8)
            if block.max(initial=0) > 1:
                out.add(
                    loss_path,
                    f"byte {offset + int(np.argmax(block > 1))}",
                    "0 or 1",
                    int(block[np.argmax(block > 1)]),
                    "loss mask value invalid",
                )
            offset += len(view)
        if h.hexdigest() != e["loss_xxh3_128"]:
            out.add(loss_path, "xxh3_128", e["loss_xxh3_128"], h.hexdigest(), "checksum mismatch")


def _row_hashes_file(job: ShardJob, rows_path: Path, out: Findings) -> _RowHashes | None:
    """Row hashes (optional, epochs): their size here; their checksum and content are checked
    with the tokens, by the reader returned (None: none listed, or unusable)."""
    e = job.entry
    if "rows_xxh3_128" not in e:
        return None
    rows_size, want = _file_size(rows_path, "row hashes missing", out), ROW_HASH_BYTES * int(e.get("samples", 0))
    if rows_size == want:
        out.saw(rows_size)
        vouched = None if "xxh3_128" in e else job.directory / e["path"]  # formats/token_check.py
        return _RowHashes(rows_path, rows_size, e["rows_xxh3_128"], vouched, (job.row_tokens or 0) * job.dtype.itemsize)
    if rows_size is not None:
        out.add(
            rows_path,
            "size",
            f"{want} bytes ({ROW_HASH_BYTES} per sample)",
            f"{rows_size} bytes",
            "row hashes size wrong",
        )
    return None


class _RowHashes:
    """An epoch shard's `.ds.rows`, read alongside its tokens: each entry must be its row's xxh3_64.
    `vouched`: the token file, when its entry records no checksum of it (the row hashes alone
    vouch for it): a row that differs from its entry here, which matches its checksum, is that
    file's fault, and reported there."""

    def __init__(self, path: Path, size: int, checksum: str, vouched: Path | None = None, row_bytes: int = 0):
        self.path, self.size, self.checksum = path, size, checksum
        self.vouched, self.row_bytes = vouched, row_bytes
        self.hash = xxhash.xxh3_128()
        self.done = 0  # entries compared
        self.bad: tuple[int, int, int] | None = None  # first (row, recorded, recomputed) that differ

    def feed(self, f, hashes: np.ndarray) -> None:
        raw = f.read(ROW_HASH_BYTES * len(hashes))
        self.hash.update(raw)
        have = np.frombuffer(raw, dtype=ROW_HASH_DTYPE)
        if self.bad is None and len(have) == len(hashes) and not np.array_equal(have, hashes):
            k = int(np.flatnonzero(have != hashes)[0])
            self.bad = (self.done + k, int(have[k]), int(hashes[k]))
        self.done += len(hashes)

    def finish(self, out) -> None:
        if self.done * ROW_HASH_BYTES != self.size:  # not compared with the tokens (a bad .ds): the checksum alone
            with open_read(self.path, BLOCK) as f:
                self.hash = xxhash.xxh3_128(f.read(self.size))
        elif self.bad is not None and self.vouched is not None and self.hash.hexdigest() == self.checksum:
            row, have, calc = self.bad
            out.add(self.vouched, *row_mismatch(row, self.row_bytes, have, calc, self.path.name), "checksum mismatch")
        elif self.bad is not None:
            row, have, calc = self.bad
            out.add(
                self.path,
                f"entry {row}",
                f"{hash_hex64(calc)} (xxh3_64 of sample {row})",
                hash_hex64(have),
                "row hash disagrees with the sample",
            )
        if self.hash.hexdigest() != self.checksum:
            out.add(self.path, "xxh3_128", self.checksum, self.hash.hexdigest(), "checksum mismatch")


def _index_problems(stream: _IndexStream, idx_path: Path, tokens: int, out: Findings) -> None:
    if stream.broken is not None:
        k, prev, found = stream.broken
        out.add(
            idx_path, f"entry {k}", f"> {prev} (strictly increasing, no leading 0)", found, "index does not increase"
        )
    elif stream.last != tokens:
        out.add(
            idx_path,
            f"entry {stream.count - 1} (last)",
            f"{tokens} (the token count)",
            stream.last,
            "index does not end at the token count",
        )


def _index_only(job: ShardJob, idx_path: Path, tokens: int, out: Findings, idx_size: int) -> None:
    """Quick mode: the index alone, streamed. For epochs, every sample end must be an entry:
    entries are distinct, so counting the multiples of seq_len+1 per chunk is enough."""
    stream = _IndexStream(
        idx_path, min(BLOCK // INDEX_ENTRY_BYTES // 4, idx_size // INDEX_ENTRY_BYTES), hashed=False, size=idx_size
    )
    row = job.row_tokens
    try:
        prev_last = 0
        while stream._fill():
            if stream.broken is not None:
                break
            if row:
                ends = stream.pending
                hi = min(stream.last, tokens)
                lo = min(prev_last, hi)  # a chunk past the last sample end owes none
                want = hi // row - lo // row
                have = int(np.count_nonzero((ends % row == 0) & (ends <= tokens)))
                if have != want:
                    expect = np.arange((lo // row + 1) * row, hi + 1, row, dtype=np.int64)
                    missing = np.setdiff1d(expect, ends.astype(np.int64))
                    out.add(
                        idx_path,
                        f"sample end {int(missing[0]) if len(missing) else -1}",
                        "an index entry at every sample end",
                        "no entry",
                        "index misses a sample boundary",
                    )
                    return
                prev_last = stream.last
        _index_problems(stream, idx_path, tokens, out)
    finally:
        stream.close()


def _full_pass(
    job: ShardJob,
    ds: Path,
    idx_path: Path,
    tokens: int,
    out: Findings,
    idx_size: int,
    recorded: _RowHashes | None = None,
) -> int | None:
    """Full mode: one read of the token file, with the index streamed alongside."""
    tsize = job.dtype.itemsize
    row = job.row_tokens
    # Epoch blocks hold whole samples so each row is hashed once, in one piece.
    block_tokens = BLOCK // tsize if not row else max(1, BLOCK // (row * tsize)) * row
    stream = _IndexStream(idx_path, min(max(1024, block_tokens // 64), tokens), hashed=True, size=idx_size)
    whole = "xxh3_128" in job.entry  # else the row hashes alone vouch for the tokens (formats/token_check.py)
    h = xxhash.xxh3_128() if whole else None
    multiset = order = 0
    vocab_bad = eos_bad = index_bad = False
    a = 0  # token offset of the current block
    scratch = take_buffer(bool)  # EOS flags of a block's rows, reused from block to block
    rows_file = open_read(recorded.path, BLOCK) if recorded is not None else None
    try:
        for view in _read_blocks(ds, tokens * tsize, block_tokens * tsize):
            n = len(view)
            if n < min(block_tokens, tokens - a) * tsize:  # the file shrank under us
                out.add(ds, f"byte {a * tsize + n}", "more data", "end of file", "shard shorter than expected")
                return None
            if h is not None:
                h.update(view)
            blk = np.frombuffer(view, dtype=job.dtype, count=n // tsize)
            b = a + len(blk)
            if not vocab_bad and int(blk.max(initial=0)) >= job.vocab_size:
                k = int(np.argmax(blk >= job.vocab_size))
                out.add(
                    ds,
                    f"token {a + k} (byte {(a + k) * tsize})",
                    f"< {job.vocab_size} (vocab_size)",
                    int(blk[k]),
                    "token id out of vocabulary",
                )
                vocab_bad = True
            ends = stream.upto(b)
            if stream.broken is None and not index_bad:
                if row is None:
                    at = ends.astype(np.int64) - 1 - a
                    bad = np.flatnonzero(blk[at] != job.eos_id) if len(at) else at
                    if len(bad) and not eos_bad:
                        k = int(bad[0])
                        out.add(
                            ds,
                            f"token {int(ends[k]) - 1} (end of document {stream.count - len(stream.pending) - len(ends) + k})",
                            f"EOS id {job.eos_id}",
                            int(blk[at[k]]),
                            "document does not end with EOS",
                        )
                        eos_bad = True
                else:
                    rows = blk.reshape(-1, row)
                    is_end = np.equal(rows, job.eos_id, out=scratch.ensure(rows.size)[: rows.size].reshape(rows.shape))
                    is_end[:, -1] = True
                    calc = np.flatnonzero(is_end.ravel()).astype(U64) + np.uint64(a + 1)
                    if not np.array_equal(calc, ends):
                        n_both = min(len(calc), len(ends))
                        diff = np.flatnonzero(calc[:n_both] != ends[:n_both])
                        k = int(diff[0]) if len(diff) else n_both  # first disagreement
                        exp = int(calc[k]) if k < len(calc) else "no entry"
                        got_ = int(ends[k]) if k < len(ends) else "no entry"
                        out.add(
                            idx_path,
                            f"entry {stream.count - len(stream.pending) - len(ends) + k}",
                            f"{exp} (EOS positions + sample ends)",
                            got_,
                            "index disagrees with the tokens",
                        )
                        index_bad = True
            if row:
                hashes = row_hashes(blk.reshape(-1, row))
                multiset = (multiset + int(hashes.sum(dtype=np.uint64))) & MASK64
                if job.first_sample is not None:
                    g = np.arange(len(hashes), dtype=np.uint64) + np.uint64(job.first_sample + a // row)
                    order = (order + order_hash(g, hashes)) & MASK64
                if rows_file is not None:
                    recorded.feed(rows_file, hashes)
            a = b
        extra = stream.rest()
        if stream.broken is None and extra and not index_bad:
            out.add(
                idx_path,
                f"entry {stream.count - extra}",
                f"<= {tokens} (the token count)",
                f"{extra} more entries",
                "index runs past the end of the shard",
            )
        elif stream.broken is not None or not index_bad:
            _index_problems(stream, idx_path, tokens, out)
        if stream.hash.hexdigest() != job.entry["index_xxh3_128"]:
            out.add(idx_path, "xxh3_128", job.entry["index_xxh3_128"], stream.hash.hexdigest(), "checksum mismatch")
    finally:
        stream.close()
        if rows_file is not None:
            rows_file.close()
        give_buffers([scratch])
    if h is not None and h.hexdigest() != job.entry["xxh3_128"]:
        out.add(ds, "xxh3_128", job.entry["xxh3_128"], h.hexdigest(), "checksum mismatch")
    if row:
        if multiset != int(job.entry["multiset_hash"], 16):
            out.add(
                ds,
                "multiset_hash",
                job.entry["multiset_hash"],
                hash_hex64(multiset),
                "sample multiset hash of the shard differs from the manifest",
            )
        out.order = order if job.first_sample is not None else None
        return multiset
    return None
