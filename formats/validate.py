"""Integrity checks of tokpack directories: packed sources, runs and epochs.

Every mode checks structure: the manifest (schema, version, byte-exact form, sums,
cross-field rules), that the listed files and only those exist, file sizes, `.ds.metadata`,
and each `.ds.index` (strictly increasing, ending at the token count; in epochs every
sample end is an entry). Full validation adds one sequential pass over every file that
hashes it (xxh3_128), scans tokens (< vocab_size; a source's documents end with EOS; an
epoch's index equals its EOS positions plus sample ends) and recomputes the sample
multiset hash. Shards are checked in parallel threads: reads and xxh3 release the GIL.

Problems are collected, never raised: a CI log should list all of them, one line each.
This module imports nothing from shuffle/ or packer/; `--against` lives in shuffle.verify.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from .errors import IncompleteError, TokpackError
from .io import read_ahead
from .io import TMP_MARK, progress
from .manifest import (
    MANIFEST,
    MANIFEST_FIELDS,
    SHARD_FIELDS,
    SOURCE_FIELDS,
    STAGE_SIDECAR,
    canonical_bytes,
    dtype_for_vocab,
    dtype_name,
    epoch_dir_name,
    field_problems,
    fingerprint,
    hash_hex64,
    metadata_text,
    multiset_hash_rows,
    parse_metadata_text,
    partial_stage_absent,
    read_manifest,
)
from .shards import SHARD_SUFFIXES, U64

MASK64 = 0xFFFFFFFFFFFFFFFF
# One shard file rarely has more than a few independent faults worth reading about;
# past this many lines the rest are counted, not listed.
MAX_PROBLEMS_PER_FILE = 5
MAX_METADATA = 1 << 16
# Read block. Smaller than formats.io.IO_BLOCK: with the read-ahead thread, 2 MiB blocks
# kept a cold read pipelined best here (measured 2-16 MiB), and fewer fresh pages are touched.
BLOCK = 2 << 20
SHARD_FILE = re.compile(r".*\.ds(\.index|\.metadata|\.loss)?$")
EPOCH_DIR = re.compile(r"^epoch-(\d+)$")


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

    @property
    def severity(self) -> str:
        return "incomplete" if self.incomplete else "unverified" if self.unverified else "corrupt"

    def line(self) -> str:
        err = TokpackError(self.message, file=self.file, where=self.where, expected=self.expected, found=self.found,
                           hint=self.hint_text())
        return f"{self.severity.upper()} {err}"

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
        return {"file": self.file, "where": self.where, "expected": s(self.expected), "found": s(self.found),
                "message": self.message, "severity": self.severity,
                "hint": self.hint_text()}

    @classmethod
    def from_error(cls, e: TokpackError) -> "Problem":
        return cls(e.file or "", e.where, e.expected, e.found, e.message, isinstance(e, IncompleteError), e.hint)


def worst_status(problems: list[Problem]) -> str:
    """'ok' only without problems; otherwise the gravest severity among them."""
    severities = {p.severity for p in problems}
    return next((s for s in ("corrupt", "incomplete", "unverified") if s in severities), "ok")


@dataclass
class DirReport:
    """What validation found in one directory (a run's epochs get their own)."""

    path: Path  # the directory
    kind: str | None  # "source", "run", "epoch", or None when the manifest is unreadable
    manifest: dict | None  # its tokpack.json, when readable
    problems: list[Problem] = field(default_factory=list)  # in discovery order
    files: int = 0  # data files checked
    bytes: int = 0  # bytes of those files (read in full mode, stat'ed in quick mode)
    multiset: int | None = None  # epoch, full mode: recomputed sum of sample hashes

    @property
    def status(self) -> str:
        return worst_status(self.problems)


@dataclass
class ValidationReport:
    dirs: list[DirReport]  # every directory checked, runs before their epochs
    seconds: float  # wall time

    @property
    def problems(self) -> list[Problem]:
        return [p for d in self.dirs for p in d.problems]

    @property
    def files(self) -> int:
        return sum(d.files for d in self.dirs)

    @property
    def bytes(self) -> int:
        return sum(d.bytes for d in self.dirs)

    @property
    def ok(self) -> bool:
        return not self.problems


# --------------------------------------------------------------------------- schema


def _type_ok(value, typ) -> bool:
    return isinstance(value, typ) and not (isinstance(value, bool) and typ is not bool)


def check_fields(obj: dict, table: dict, kind: str, file: str, prefix: str = "") -> list[Problem]:
    """The fields of `kind` in one of formats.manifest's field tables: presence, type, range."""
    return [Problem(file, f"{prefix}{key}", expected, found, why) for key, expected, found, why
            in field_problems(obj, table, kind)]


# ----------------------------------------------------------------------- shard jobs


@dataclass
class ShardJob:
    """One shard's files and what the manifest promises about them."""

    directory: Path  # where the shard lives
    entry: dict  # its manifest entry (fields already type-checked)
    kind: str  # "source" or "epoch"
    dtype: np.dtype  # token dtype from the manifest
    vocab_size: int  # token ids must be below it
    eos_id: int  # end-of-document id
    tokenizer: str  # expected in .ds.metadata
    row_tokens: int | None  # epoch: seq_len + 1 tokens per sample; None for sources
    quick: bool  # structure only: no checksums, no token scan

    def size(self) -> int:
        return int(self.entry["tokens"]) * self.dtype.itemsize


@dataclass
class ShardResult:
    problems: list[Problem]  # in check order
    files: int  # files looked at
    bytes: int  # bytes of those files
    multiset: int | None  # epoch, full mode: recomputed sum of sample hashes


class _Problems(list):
    """The problems of one shard check, added field by field."""

    def add(self, file, where, expected, found, message) -> None:
        self.append(Problem(str(file), where, expected, found, message))


class _IndexStream:
    """Reads a `.ds.index` front to back in chunks, hashing its bytes and checking that
    entries strictly increase. `upto(limit)` hands out the entries <= limit in order."""

    def __init__(self, path: Path, chunk_entries: int, hashed: bool, size: int):
        self.path = path
        self.f = open(path, "rb", buffering=0)
        self.left = size  # bytes not yet read (the size was checked), so EOF costs no extra read
        self.buf = np.empty(max(chunk_entries, 1), dtype=U64)  # reused read buffer
        self.pending = self.buf[:0]  # read but not yet handed out
        self.hash = xxhash.xxh3_128() if hashed else None  # running checksum of the file
        self.last = 0  # last entry read; the next must exceed it (no leading 0)
        self.count = 0  # entries read so far
        self.broken: tuple | None = None  # (entry number, previous, found) of the first decrease

    def _fill(self) -> bool:
        raw = memoryview(self.buf.view(np.uint8))[: min(self.buf.nbytes, self.left)]
        n = 0
        while n < raw.nbytes:
            got = self.f.readinto(raw[n:])
            if not got:
                break
            n += got
        self.left -= n
        if self.hash is not None:
            self.hash.update(raw[:n])
        entries = self.buf[: n // U64.itemsize]
        if len(entries) and self.broken is None:
            prev = np.empty(len(entries), dtype=U64)
            prev[0] = self.last
            prev[1:] = entries[:-1]
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


_local = threading.local()


def _buffer(which: int = 0, size: int | None = None) -> bytearray:
    """Read buffers per thread (two, for read-ahead), reused for every file it checks."""
    size = size or BLOCK
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = [None, None]
    if bufs[which] is None or len(bufs[which]) < size:
        bufs[which] = bytearray(size)
    return bufs[which]


def _read_blocks(path: Path, total: int, block: int):
    """Yields (buffer, nbytes) for consecutive blocks of the first `total` bytes of a file.
    A file of several blocks is read one block ahead (`read_ahead`), so the disk keeps working
    while the previous block is hashed and scanned; the two buffers are reused. Stops early,
    with a short last block, if the file is shorter."""
    with open(path, "rb", buffering=0) as f:
        if total <= block:  # one block: no thread
            buf = _buffer(0, block)
            yield buf, _read_full(f, buf, total)
            return
        if hasattr(os, "posix_fadvise"):  # a larger kernel read-ahead window for a cold read
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        plan = ((min(block, total - off), None) for off in range(0, total, block))
        for (buf, n), _ in read_ahead(plan, lambda buf, want, _: (buf, _read_full(f, buf, want)),
                                      [_buffer(0, block), _buffer(1, block)]):
            yield buf, n
            if n < block:  # the last block, or the file ended early: nothing follows
                return


def _read_full(f, buf: bytearray, want: int) -> int:
    """Reads up to `want` bytes into buf; fewer only at end of file."""
    view, n = memoryview(buf), 0
    while n < want:
        got = f.readinto(view[n:want])
        if not got:
            break
        n += got
    return n


def _scratch(n: int) -> np.ndarray:
    """A per-thread bool array of at least n items: fresh pages cost page faults on every block."""
    arr = getattr(_local, "scratch", None)
    if arr is None or len(arr) < n:
        arr = _local.scratch = np.empty(n, dtype=bool)
    return arr


def _file_size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def check_shard(job: ShardJob) -> ShardResult:
    """All checks of one shard (.ds, .ds.index, .ds.metadata, .ds.loss). One sequential pass
    over the token file does the hash, the vocabulary scan, the EOS/fragment-end check
    and the multiset hash together."""
    out = _Problems()
    e = job.entry
    ds = job.directory / e["path"]
    idx_path = ds.with_name(ds.name + ".index")
    meta_path = ds.with_name(ds.name + ".metadata")
    loss_path = ds.with_name(ds.name + ".loss")
    tokens = int(e["tokens"])
    tsize = job.dtype.itemsize
    files = nbytes = 0
    multiset = None

    # ---- sizes (every mode)
    ds_size = _file_size(ds)
    ds_ok = ds_size == tokens * tsize
    if ds_size is None:
        out.add(ds, None, "a file listed in the manifest", "no such file", "shard missing")
    elif not ds_ok:
        out.add(ds, "size", f"{tokens * tsize} bytes ({tokens} tokens x {tsize})", f"{ds_size} bytes",
                "shard size does not match the manifest" + (" (empty file)" if ds_size == 0 else ""))
    if ds_size is not None:
        files += 1
        nbytes += ds_size
    if ds_ok and e["bytes"] != tokens * tsize:
        out.add(job.directory / MANIFEST, f"shards[{e['path']}].bytes", tokens * tsize, e["bytes"],
                "manifest byte count disagrees with its token count")

    idx_size = _file_size(idx_path)
    idx_ok = idx_size is not None and idx_size % 8 == 0 and idx_size > 0 or (idx_size == 0 and tokens == 0)
    if idx_size is None:
        out.add(idx_path, None, "a file listed in the manifest", "no such file", "index missing")
    else:
        files += 1
        nbytes += idx_size
        if job.kind == "source" and idx_size != 8 * int(e["documents"]):
            out.add(idx_path, "size", f"{8 * int(e['documents'])} bytes ({e['documents']} documents x 8)",
                    f"{idx_size} bytes", "index size does not match the manifest's document count")
            idx_ok = False
        elif job.kind == "epoch" and _type_ok(e.get("fragments"), int) and idx_size != 8 * e["fragments"]:
            out.add(idx_path, "size", f"{8 * e['fragments']} bytes ({e['fragments']} fragments x 8)",
                    f"{idx_size} bytes", "index size does not match the manifest's fragment count")
            idx_ok = False
        elif job.kind == "epoch" and not (8 * int(e["samples"]) <= idx_size <= 8 * tokens and idx_size % 8 == 0):
            out.add(idx_path, "size", f"a multiple of 8 in [{8 * int(e['samples'])}, {8 * tokens}] bytes",
                    f"{idx_size} bytes", "index size impossible for this shard")
            idx_ok = False
        elif not idx_ok:
            out.add(idx_path, "size", "a non-empty multiple of 8 bytes", f"{idx_size} bytes", "index size invalid")

    # ---- metadata (every mode: small)
    try:
        with open(meta_path, "rb") as f:
            raw = f.read(MAX_METADATA)  # a few dozen bytes; a replaced file must not be read whole
    except FileNotFoundError:
        out.add(meta_path, None, "a file listed in the manifest", "no such file", "metadata missing")
    else:
        files += 1
        nbytes += len(raw)
        if not job.quick and xxhash.xxh3_128_hexdigest(raw) != e["metadata_xxh3_128"]:
            out.add(meta_path, "xxh3_128", e["metadata_xxh3_128"], xxhash.xxh3_128_hexdigest(raw), "checksum mismatch")
        try:
            tok, size, count = parse_metadata_text(raw.decode("utf-8", errors="replace"), meta_path)
        except TokpackError as err:
            out.add(meta_path, err.where, err.expected, err.found, err.message)
        else:
            if tok != job.tokenizer:
                out.add(meta_path, "tokenizer", job.tokenizer, tok, "metadata tokenizer differs from the manifest")
            if size != tsize:
                out.add(meta_path, "token_size", tsize, size, "metadata token size differs from the manifest dtype")
            if count != tokens:
                out.add(meta_path, "tokens", tokens, count, "metadata token count differs from the manifest")
            if (tok, size, count) == (job.tokenizer, tsize, tokens) and raw != metadata_text(tok, size, count).encode():
                out.add(meta_path, "line 3", repr(metadata_text(tok, size, count)), repr(raw.decode(errors="replace")),
                        "metadata text differs from what tokpack writes")

    # ---- loss (optional, sources only)
    has_loss = "loss_xxh3_128" in e
    loss_size = _file_size(loss_path)
    if has_loss and loss_size is None:
        out.add(loss_path, None, "a file listed in the manifest", "no such file", "loss mask missing")
    elif loss_size is not None:
        files += 1
        nbytes += loss_size
        if not has_loss:
            out.add(loss_path, None, "no .loss file (none listed)", f"{loss_size} bytes", "file not listed in the manifest")
        elif loss_size != tokens:
            out.add(loss_path, "size", f"{tokens} bytes (one per token)", f"{loss_size} bytes", "loss mask size wrong")
        elif not job.quick:
            h = xxhash.xxh3_128()
            buf = _buffer()
            with open(loss_path, "rb", buffering=0) as f:
                offset = 0
                while n := f.readinto(buf):
                    h.update(memoryview(buf)[:n])
                    block = np.frombuffer(buf, dtype=np.uint8, count=n)
                    if block.max(initial=0) > 1:
                        out.add(loss_path, f"byte {offset + int(np.argmax(block > 1))}", "0 or 1",
                                int(block[np.argmax(block > 1)]), "loss mask value invalid")
                    offset += n
            if h.hexdigest() != e["loss_xxh3_128"]:
                out.add(loss_path, "xxh3_128", e["loss_xxh3_128"], h.hexdigest(), "checksum mismatch")

    # ---- index and tokens
    if idx_size is not None and idx_ok:
        # an epoch whose token count is not whole samples was reported from the manifest;
        # its rows cannot be cut, so only its index is checked
        whole_rows = not job.row_tokens or tokens % job.row_tokens == 0
        if job.quick or not ds_ok or not whole_rows:
            _index_only(job, idx_path, tokens, out, idx_size)
        else:
            multiset = _full_pass(job, ds, idx_path, tokens, out, idx_size)
    return ShardResult(list(out), files, nbytes, multiset)


def _index_problems(stream: _IndexStream, job: ShardJob, idx_path: Path, tokens: int, out: _Problems) -> None:
    if stream.broken is not None:
        k, prev, found = stream.broken
        out.add(idx_path, f"entry {k}", f"> {prev} (strictly increasing, no leading 0)", found, "index does not increase")
    elif stream.last != tokens:
        out.add(idx_path, f"entry {stream.count - 1} (last)", f"{tokens} (the token count)", stream.last,
                "index does not end at the token count")


def _index_only(job: ShardJob, idx_path: Path, tokens: int, out: _Problems, idx_size: int) -> None:
    """Quick mode: the index alone, streamed. For epochs, every sample end must be an entry:
    entries are distinct, so counting the multiples of seq_len+1 per chunk is enough."""
    stream = _IndexStream(idx_path, min(BLOCK // 8 // 4, idx_size // 8), hashed=False, size=idx_size)
    row = job.row_tokens
    try:
        prev_last = 0
        while stream._fill():
            if stream.broken is not None:
                break
            if row:
                ends = stream.pending
                hi = min(stream.last, tokens)
                want = hi // row - prev_last // row
                have = int(np.count_nonzero((ends % row == 0) & (ends <= tokens)))
                if have != want:
                    missing = _first_missing_sample_end(ends, prev_last, hi, row)
                    out.add(idx_path, f"sample end {missing}", "an index entry at every sample end",
                            "no entry", "index misses a sample boundary")
                    return
                prev_last = stream.last
        _index_problems(stream, job, idx_path, tokens, out)
    finally:
        stream.close()


def _first_missing_sample_end(ends: np.ndarray, lo: int, hi: int, row: int) -> int:
    expect = np.arange((lo // row + 1) * row, hi + 1, row, dtype=np.int64)
    missing = np.setdiff1d(expect, ends.astype(np.int64))
    return int(missing[0]) if len(missing) else -1


def _full_pass(job: ShardJob, ds: Path, idx_path: Path, tokens: int, out: _Problems, idx_size: int) -> int | None:
    """Full mode: one read of the token file, with the index streamed alongside."""
    tsize = job.dtype.itemsize
    row = job.row_tokens
    # Epoch blocks hold whole samples so each row is hashed once, in one piece.
    block_tokens = BLOCK // tsize if not row else max(1, BLOCK // (row * tsize)) * row
    stream = _IndexStream(idx_path, min(max(1024, block_tokens // 64), tokens), hashed=True, size=idx_size)
    h = xxhash.xxh3_128()
    multiset = 0
    vocab_bad = eos_bad = index_bad = False
    a = 0  # token offset of the current block
    try:
        for buf, n in _read_blocks(ds, tokens * tsize, block_tokens * tsize):
            if n < min(block_tokens, tokens - a) * tsize:  # the file shrank under us
                out.add(ds, f"byte {a * tsize + n}", "more data", "end of file", "shard shorter than expected")
                return None
            h.update(memoryview(buf)[:n])
            blk = np.frombuffer(buf, dtype=job.dtype, count=n // tsize)
            b = a + len(blk)
            if not vocab_bad and int(blk.max(initial=0)) >= job.vocab_size:
                k = int(np.argmax(blk >= job.vocab_size))
                out.add(ds, f"token {a + k} (byte {(a + k) * tsize})", f"< {job.vocab_size} (vocab_size)",
                        int(blk[k]), "token id out of vocabulary")
                vocab_bad = True
            ends = stream.upto(b)
            if stream.broken is None and not index_bad:
                if row is None:
                    at = ends.astype(np.int64) - 1 - a
                    bad = np.flatnonzero(blk[at] != job.eos_id) if len(at) else at
                    if len(bad) and not eos_bad:
                        k = int(bad[0])
                        out.add(ds, f"token {int(ends[k]) - 1} (end of document {stream.count - len(stream.pending) - len(ends) + k})",
                                f"EOS id {job.eos_id}", int(blk[at[k]]), "document does not end with EOS")
                        eos_bad = True
                else:
                    rows = blk.reshape(-1, row)
                    is_end = np.equal(rows, job.eos_id, out=_scratch(rows.size)[: rows.size].reshape(rows.shape))
                    is_end[:, -1] = True
                    calc = np.flatnonzero(is_end.ravel()).astype(U64) + np.uint64(a + 1)
                    if not np.array_equal(calc, ends):
                        n_both = min(len(calc), len(ends))
                        diff = np.flatnonzero(calc[:n_both] != ends[:n_both])
                        k = int(diff[0]) if len(diff) else n_both  # first disagreement
                        exp = int(calc[k]) if k < len(calc) else "no entry"
                        got_ = int(ends[k]) if k < len(ends) else "no entry"
                        out.add(idx_path, f"entry {stream.count - len(stream.pending) - len(ends) + k}",
                                f"{exp} (EOS positions + sample ends)", got_, "index disagrees with the tokens")
                        index_bad = True
            if row:
                multiset = (multiset + multiset_hash_rows(blk.reshape(-1, row))) & MASK64
            a = b
        extra = stream.rest()
        if stream.broken is not None:
            _index_problems(stream, job, idx_path, tokens, out)
        elif extra and not index_bad:
            out.add(idx_path, f"entry {stream.count - extra}", f"<= {tokens} (the token count)",
                    f"{extra} more entries", "index runs past the end of the shard")
        elif not index_bad:
            _index_problems(stream, job, idx_path, tokens, out)
        if stream.hash.hexdigest() != job.entry["index_xxh3_128"]:
            out.add(idx_path, "xxh3_128", job.entry["index_xxh3_128"], stream.hash.hexdigest(), "checksum mismatch")
    finally:
        stream.close()
    if h.hexdigest() != job.entry["xxh3_128"]:
        out.add(ds, "xxh3_128", job.entry["xxh3_128"], h.hexdigest(), "checksum mismatch")
    if row:
        if multiset != int(job.entry["multiset_hash"], 16):
            out.add(ds, "multiset_hash", job.entry["multiset_hash"], hash_hex64(multiset),
                    "sample multiset hash of the shard differs from the manifest")
        return multiset
    return None


# ----------------------------------------------------------------- directory checks


@dataclass
class _Dir:
    report: DirReport  # filled in as checks run
    jobs: list[ShardJob]  # shard checks still to run
    partial: bool = False  # some shards absent by a partial stage: no whole-epoch sums to check


def _open_manifest(path: Path, rep: DirReport, kinds) -> dict | None:
    try:
        manifest = read_manifest(path, kind=kinds)
    except TokpackError as e:
        rep.problems.append(Problem.from_error(e))
        return None
    raw = (path / MANIFEST).read_bytes()
    if raw != canonical_bytes(json.loads(raw)):  # as written, before earlier keys are renamed
        rep.problems.append(Problem(str(path / MANIFEST), "bytes", "the JSON text tokpack writes",
                                    "different bytes (edited after writing?)", "manifest text was altered"))
    rep.manifest = manifest
    rep.kind = manifest["kind"]
    rep.files += 1
    rep.bytes += len(raw)
    return manifest


def _check_listing(path: Path, shards: list[dict], rep: DirReport) -> None:
    mfile = str(path / MANIFEST)
    listed = set()
    names = [s.get("path") for s in shards]
    for i, name in enumerate(names):
        if not isinstance(name, str) or "/" in name or name.startswith(".") or not name.endswith(".ds"):
            rep.problems.append(Problem(mfile, f"shards[{i}].path", "a plain NNNNN.ds file name", repr(name),
                                        "bad shard path"))
            continue
        if name in listed:
            rep.problems.append(Problem(mfile, f"shards[{i}].path", "unique names", name, "shard listed twice"))
        listed.add(name)
    if names != sorted(names, key=str) or len({len(n) for n in names if isinstance(n, str)}) > 1:
        rep.problems.append(Problem(mfile, "shards", "names of one width, in sorted order", names[:5],
                                    "shard names out of order"))
    allowed = {n + suffix for n in listed for suffix in SHARD_SUFFIXES}
    for p in sorted(path.iterdir()):
        if TMP_MARK in p.name:
            continue  # a killed writer's leftover: never data
        if SHARD_FILE.match(p.name) and p.name not in allowed:
            rep.problems.append(Problem(str(p), None, "only the files listed in the manifest", "an unlisted file",
                                        "file not listed in the manifest"))


def _check_data_manifest(path: Path, m: dict, rep: DirReport, quick: bool) -> list[ShardJob]:
    """Checks shared by sources and epochs; returns the shard jobs (empty if the manifest is unusable)."""
    mfile = str(path / MANIFEST)
    kind = m["kind"]
    problems = check_fields(m, MANIFEST_FIELDS, kind, mfile)
    shards = m.get("shards") if isinstance(m.get("shards"), list) else []
    for i, s in enumerate(shards):
        if not isinstance(s, dict):
            problems.append(Problem(mfile, f"shards[{i}]", "an object", repr(s)[:40], "bad shard entry"))
        else:
            problems += check_fields(s, SHARD_FIELDS, kind, mfile, f"shards[{i}].")
    rep.problems += problems
    if problems:
        return []  # a malformed manifest cannot drive the file checks
    if m["dtype"] not in ("uint16", "uint32"):
        rep.problems.append(Problem(mfile, "dtype", "uint16 or uint32", m["dtype"], "unknown token dtype"))
        return []
    dtype = np.dtype("<u2") if m["dtype"] == "uint16" else np.dtype("<u4")
    try:
        rule = dtype_name(dtype_for_vocab(m["vocab_size"]))
    except TokpackError as e:
        rep.problems.append(Problem(mfile, "vocab_size", e.expected, e.found, e.message))
        return []
    if m["dtype"] != rule:
        rep.problems.append(Problem(mfile, "dtype", f"{rule} (vocab_size {m['vocab_size']})", m["dtype"],
                                    "dtype label disagrees with the vocabulary size"))
    if m["token_size"] != dtype.itemsize:
        rep.problems.append(Problem(mfile, "token_size", f"{dtype.itemsize} ({m['dtype']})", m["token_size"],
                                    "token size disagrees with the dtype label"))
    if m["eos_id"] >= m["vocab_size"]:
        rep.problems.append(Problem(mfile, "eos_id", f"< {m['vocab_size']} (vocab_size)", m["eos_id"], "EOS id out of vocabulary"))
    total = sum(s["tokens"] for s in shards)
    if total != m["tokens"]:
        rep.problems.append(Problem(mfile, "tokens", f"{total} (sum over shards)", m["tokens"], "token count wrong"))
    _check_listing(path, shards, rep)
    row = None
    if kind == "source":
        docs = sum(s["documents"] for s in shards)
        if docs != m["documents"]:
            rep.problems.append(Problem(mfile, "documents", f"{docs} (sum over shards)", m["documents"], "document count wrong"))
        fp = fingerprint([s["xxh3_128"] for s in shards], m["dtype"], m["vocab_size"], m["eos_id"])
        if fp != m["fingerprint"]:
            rep.problems.append(Problem(mfile, "fingerprint", fp, m["fingerprint"],
                                        "fingerprint disagrees with the shard checksums, dtype, vocab_size, eos_id"))
        for i, s in enumerate(shards):
            if s["documents"] > s["tokens"] or (s["tokens"] > 0) != (s["documents"] > 0):
                rep.problems.append(Problem(mfile, f"shards[{i}].documents", f"1..{s['tokens']}", s["documents"],
                                            "document count impossible for the token count"))
    else:
        row = m["seq_len"] + 1
        _check_epoch_manifest(path, m, rep, row)
        if any(s["tokens"] != s["samples"] * row for s in shards):
            return []  # seq_len or the counts are wrong: rows cannot be cut, the lines above say why
    return [ShardJob(path, s, kind, dtype, m["vocab_size"], m["eos_id"], m["tokenizer"], row, quick) for s in shards]


def _check_epoch_manifest(path: Path, m: dict, rep: DirReport, row: int) -> None:
    mfile = str(path / MANIFEST)
    add = lambda *a: rep.problems.append(Problem(mfile, *a))  # noqa: E731
    shards = m["shards"]
    per = m["shard_samples"]
    for i, s in enumerate(shards):
        if s["tokens"] != s["samples"] * row:
            add(f"shards[{i}].tokens", f"{s['samples'] * row} (samples x {row})", s["tokens"], "shard token count wrong")
        last = i == len(shards) - 1
        if (not last and s["samples"] != per) or (last and not 1 <= s["samples"] <= per):
            add(f"shards[{i}].samples", per if not last else f"1..{per}", s["samples"],
                "every shard but the last holds exactly shard_samples samples")
    total = sum(s["samples"] for s in shards)
    if total != m["samples"]:
        add("samples", f"{total} (sum over shards)", m["samples"], "sample count wrong")
    multiset = sum(int(s["multiset_hash"], 16) for s in shards) & MASK64
    if hash_hex64(multiset) != m["sample_multiset_hash"]:
        add("sample_multiset_hash", f"{hash_hex64(multiset)} (sum of the shards' multiset_hash)",
            m["sample_multiset_hash"], "multiset hash disagrees with its shards")
    srcs = m["sources"]
    for i, s in enumerate(srcs):
        if not isinstance(s, dict):
            add(f"sources[{i}]", "an object", repr(s)[:40], "bad source entry")
            return
        rep.problems.extend(check_fields(s, SOURCE_FIELDS, "epoch", mfile, f"sources[{i}]."))
    if all(isinstance(s.get("samples"), int) for s in srcs) and sum(s["samples"] for s in srcs) != m["samples"]:
        add("sources[].samples", f"{m['samples']} (the epoch's samples)", sum(s["samples"] for s in srcs),
            "per-source sample counts do not add up")
    frags = [s.get("fragments") for s in shards]
    if "fragments" in m and all(_type_ok(f, int) for f in frags) and sum(frags) != m["fragments"]:
        add("fragments", f"{sum(frags)} (sum of the shards' fragments)", m["fragments"], "fragment count wrong")
    _check_epoch_sources(m, srcs, row, add)
    dir_epoch = EPOCH_DIR.match(path.name)
    if dir_epoch and int(dir_epoch.group(1)) != m["epoch"]:
        add("epoch", f"{int(dir_epoch.group(1))} (from the directory name)", m["epoch"], "epoch number wrong")


def _check_epoch_sources(m: dict, srcs: list, row: int, add) -> None:
    """The windowing arithmetic of docs/COMMANDS.md ("The shuffle algorithm") for each source entry that
    records it: a corrupted count cannot hide behind a field nobody reads."""
    keys = ("tokens", "windows", "offset", "dropped_tokens", "samples", "first_pass", "passes")
    dropped = 0
    for i, s in enumerate(srcs):
        if not all(_type_ok(s.get(k), int) and s[k] >= 0 for k in keys):
            return
        t, w, o, c = s["tokens"], s["windows"], s["offset"], s["samples"]
        if o >= row or (not m.get("jitter", False) and o):
            add(f"sources[{i}].offset", f"< {row}" + (" and 0 without jitter" if not m.get("jitter") else ""), o,
                "window offset impossible")
        if w < 1 or o + w * row > t or t - w * row != s["dropped_tokens"]:
            add(f"sources[{i}].windows", f"windows x {row} + dropped_tokens == tokens ({t})",
                f"{w} x {row} + {s['dropped_tokens']}", "source window counts do not add up")
            return
        first = m["epoch"] * c // w if c else 0
        passes = ((m["epoch"] + 1) * c - 1) // w - first + 1 if c else 0
        if (s["first_pass"], s["passes"]) != (first, passes):
            add(f"sources[{i}].first_pass/passes", f"{first}/{passes} (epoch {m['epoch']}, {c} of {w} windows)",
                f"{s['first_pass']}/{s['passes']}", "source pass bookkeeping wrong")
        offsets = m.get("jitter_offsets")
        if isinstance(offsets, list) and (i >= len(offsets) or offsets[i] != o):
            add(f"jitter_offsets[{i}]", o, offsets[i] if i < len(offsets) else "no entry", "jitter offset disagrees with its source entry")
        dropped += s["dropped_tokens"]
    if srcs and dropped != m["dropped_tokens"]:
        add("dropped_tokens", f"{dropped} (sum over sources)", m["dropped_tokens"], "dropped token count wrong")


def _source_keys(sources: list) -> list:
    """What identifies a run's or epoch's sources: their fingerprints in order."""
    return [s.get("fingerprint") if isinstance(s, dict) else s for s in sources]


# Fields a run and each of its epochs must agree on (when both record them).
RUN_KEYS = ("dtype", "token_size", "vocab_size", "eos_id", "tokenizer", "seq_len", "seed", "jitter", "samples",
            "shard_samples", "shuffle")


def _check_run(path: Path, m: dict, rep: DirReport, quick: bool, plan: list["_Dir"]) -> None:
    mfile = str(path / MANIFEST)
    problems = check_fields(m, MANIFEST_FIELDS, "run", mfile)
    for i, src in enumerate(m.get("sources") if isinstance(m.get("sources"), list) else []):
        if isinstance(src, dict):
            problems += check_fields(src, SOURCE_FIELDS, "run", mfile, f"sources[{i}].")
        else:
            problems.append(Problem(mfile, f"sources[{i}]", "an object", repr(src)[:40], "bad source entry"))
    rep.problems += problems
    if problems:
        return
    epochs = m["epochs"]
    if not all(_type_ok(e, int) and e >= 0 for e in epochs) or len(set(epochs)) != len(epochs):
        rep.problems.append(Problem(mfile, "epochs", "distinct epoch numbers >= 0", epochs, "bad epoch list"))
        return
    listed = {epoch_dir_name(e) for e in epochs}
    for p in sorted(path.iterdir()):
        if p.is_dir() and EPOCH_DIR.match(p.name) and p.name not in listed:
            rep.problems.append(Problem(str(p), None, "an epoch listed in the run's `epochs`", "an unlisted epoch directory",
                                        "epoch not yet recorded in the run manifest (interrupted shuffle?); rerun it",
                                        incomplete=True))
    # A `stage --ranks` copy: its absent shards are one problem, not one line per file.
    absent = partial_stage_absent(path)
    if absent:
        rep.problems.append(Problem(str(path / STAGE_SIDECAR), "missing_shards", "every shard of the run",
                                    f"{len(absent)} shards absent, {next(iter(absent.values()))}",
                                    "partial stage: serves only the ranks it was staged for"))
    totals = [0, 0, 0]  # tokens, documents, readable epochs
    for e in epochs:
        sub = path / epoch_dir_name(e)
        if not sub.is_dir():
            rep.problems.append(Problem(str(sub), None, "the epoch directory listed in the run manifest",
                                        "no such directory", "epoch missing"))
            continue
        d = _plan_dir(sub, quick, kinds="epoch")
        present = [j for j in d.jobs if str(j.directory / j.entry["path"]) not in absent]
        d.jobs, d.partial = present, len(present) < len(d.jobs)
        plan.append(d)
        em = d.report.manifest
        if em is None or em.get("kind") != "epoch":
            continue
        efile = str(sub / MANIFEST)
        for key in RUN_KEYS:
            if key in m and key in em and em[key] != m[key]:
                d.report.problems.append(Problem(efile, key, f"{m[key]!r} (the run's)", repr(em[key]),
                                                 "epoch manifest belongs to another run"))
        esrc = em.get("sources") if isinstance(em.get("sources"), list) else []
        if len(esrc) == len(m["sources"]):
            for i, (a, b) in enumerate(zip(m["sources"], esrc)):
                if isinstance(a, dict) and isinstance(b, dict):
                    for key in sorted(a.keys() & b.keys()):
                        if a[key] != b[key]:
                            d.report.problems.append(Problem(efile, f"sources[{i}].{key}", f"{a[key]!r} (the run's)",
                                                             repr(b[key]), "epoch source differs from the run's"))
                    if isinstance(m.get("weights"), list) and i < len(m["weights"]) and "weight" in b \
                            and m["weights"][i] != b["weight"]:
                        d.report.problems.append(Problem(efile, f"sources[{i}].weight", repr(m["weights"][i]),
                                                         repr(b["weight"]), "epoch weight differs from the run's"))
        totals[0] += em.get("tokens", 0) if _type_ok(em.get("tokens"), int) else 0
        totals[1] += em.get("fragments", 0) if _type_ok(em.get("fragments"), int) else 0
        totals[2] += 1
        if em.get("epoch") != e:
            d.report.problems.append(Problem(efile, "epoch", e, em.get("epoch"), "epoch manifest belongs to another epoch"))
        if isinstance(em.get("sources"), list) and _source_keys(em["sources"]) != _source_keys(m["sources"]):
            d.report.problems.append(Problem(efile, "sources", _source_keys(m["sources"]), _source_keys(em["sources"]),
                                             "epoch was shuffled from other sources than its run"))
    if totals[2] == len(epochs):
        for i, key in enumerate(("tokens", "fragments")):
            if _type_ok(m.get(key), int) and m[key] != totals[i]:
                rep.problems.append(Problem(mfile, key, f"{totals[i]} (sum over its epochs)", m[key],
                                            f"run {key} count wrong"))


def _plan_dir(path: Path, quick: bool, kinds=None) -> _Dir:
    rep = DirReport(path, None, None)
    d = _Dir(rep, [])
    if path.exists() and not path.is_dir():
        rep.problems.append(Problem(str(path), None, "a tokpack directory", "a file", "not a directory",
                                    hint="pass the directory that holds tokpack.json"))
        return d
    m = _open_manifest(path, rep, kinds)
    if m is None:
        return d
    if m["kind"] in ("source", "epoch"):
        d.jobs = _check_data_manifest(path, m, rep, quick)
    return d


def plan_validation(paths: list[str | Path], quick: bool) -> list[_Dir]:
    """Reads every manifest and runs the manifest-level checks; returns the shard jobs to run."""
    plan: list[_Dir] = []
    for p in paths:
        path = Path(p)
        d = _plan_dir(path, quick)
        plan.append(d)
        if d.report.kind == "run":
            _check_run(path, d.report.manifest, d.report, quick, plan)
    return plan


def validate_dirs(paths: list[str | Path], quick: bool = False, workers: int = 1,
                  show_progress: bool | None = None) -> ValidationReport:
    """Validates sources, runs (with their epochs) and epoch directories. Never raises for bad data."""
    t0 = time.perf_counter()
    plan = plan_validation(paths, quick)
    jobs = [(d, j) for d in plan for j in d.jobs]
    total = sum(j.size() for _, j in jobs) if not quick else len(jobs)
    with progress(total, "validate" + (" --quick" if quick else ""), unit="B" if not quick else "shard",
                  enabled=show_progress) as bar:
        def run(item):
            d, job = item
            try:
                res = check_shard(job)
            # Only an unreadable file is the data's fault (manifests were checked before their
            # shards); any other exception is a bug in tokpack and must not be blamed on the data.
            except (OSError, TokpackError) as e:
                res = ShardResult([Problem(str(job.directory / job.entry["path"]), None, "a checkable shard",
                                           f"{type(e).__name__}: {e}", "cannot check shard")], 0, 0, None)
            bar.update(job.size() if not quick else 1)
            return d, res

        if workers > 1 and len(jobs) > 1:
            with ThreadPoolExecutor(workers) as pool:
                results = list(pool.map(run, jobs))
        else:
            results = [run(j) for j in jobs]
    recomputed: dict[int, list] = {}
    for d, res in results:  # in job order, so the report is deterministic
        d.report.problems += res.problems
        d.report.files += res.files
        d.report.bytes += res.bytes
        recomputed.setdefault(id(d), []).append(res.multiset)
    for d in plan:
        rep, m = d.report, d.report.manifest
        if rep.kind == "epoch" and d.jobs and not quick and not d.partial:
            parts = recomputed.get(id(d), [])
            if all(x is not None for x in parts):
                rep.multiset = sum(parts) & MASK64
                if isinstance(m.get("sample_multiset_hash"), str) and hash_hex64(rep.multiset) != m["sample_multiset_hash"]:
                    rep.problems.append(Problem(str(d.report.path), "sample_multiset_hash",
                                                f"{m['sample_multiset_hash']} (recorded in {MANIFEST})",
                                                hash_hex64(rep.multiset) + " (recomputed from the samples)",
                                                "the epoch's samples are not the ones recorded"))
    for d in plan:
        d.report.problems = _cap_per_file(d.report.problems)
    return ValidationReport([d.report for d in plan], time.perf_counter() - t0)


def _cap_per_file(problems: list[Problem]) -> list[Problem]:
    """One broken field can break every shard entry; list a few lines per file, count the rest."""
    seen: dict[str, int] = {}
    out = []
    for p in problems:
        seen[p.file] = seen.get(p.file, 0) + 1
        if seen[p.file] <= MAX_PROBLEMS_PER_FILE:
            out.append(p)
    for f, n in seen.items():
        if n > MAX_PROBLEMS_PER_FILE:
            out.append(Problem(f, None, None, None, f"{n - MAX_PROBLEMS_PER_FILE} more problems in this file"))
    return out
