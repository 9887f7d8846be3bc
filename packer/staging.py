"""`tokpack stage`: a verified, resumable, parallel copy of a tokpack directory to local disk.

Every file is read once, in large sequential blocks through a buffer reused by its worker
thread, hashed (xxh3_128) as it streams, and written under a temporary name; it is renamed
into place only when its checksum equals the manifest's. Manifests are written last: each
epoch's after its shards, the run's after everything. So DEST never holds a manifest
vouching for a file that was not verified, and a rerun resumes by re-verifying the files
already in place (one read each) and copying the rest. Each verified file and each manifest is
committed through a tokpack.formats.outputs Output (a LocalOutput: DEST is local).

The source is opened through tokpack.formats.io (`as_path`: a local Path, or fsspec's
`url_to_fs` for a URL, so any fsspec URL works); datatrove is not used. DEST is a local path.

`--shards-of r/W --micro-batch m` (formerly `--ranks r/W`, still accepted: docs/COMMANDS.md,
"Words") copies only the epoch shards those ranks read under the
Megatron convention (global batch b = samples [b*W*m, (b+1)*W*m) of the staged epochs
chained in order, rank r takes [r*m, (r+1)*m) of it; complete global batches only). The manifests stay identical to the source's; a
`tokpack-stage.json` sidecar at DEST's root lists the ranks and the shards left out, so
such a copy serves only those ranks and `tokpack validate` reports the missing shards.
"""

from __future__ import annotations

import errno
import os
import re
import threading
import time
from collections import deque
from contextlib import nullcontext
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from itertools import islice
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from tokpack.formats.errors import TokpackError
from tokpack.formats.guard import check_space, locked_output
from tokpack.formats.units import at_most
from tokpack.formats.numbering import EpochNumbering, shuffle_command
from tokpack.formats.shards import contained_shard, shard_files
from tokpack.formats.slices import RUN_SELECTION_KEYS, RankRows, stage_command
from tokpack.formats.io import (
    ThreadPool,
    as_path,
    contained,
    hash_mapped,
    lent,
    open_new,
    open_read,
    progress,
    read_limited,
    regular_size,
    remove_tmp_files,
    tmp_path,
)
from tokpack.formats.manifest import (
    HOLDOUT_DIR,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    MAX_EPOCHS,
    STAGE_SIDECAR,
    canonical_bytes,
    epoch_dir_name,
    parse_manifest,
    require_valid,
    stage_sidecar,
    strict_json,
    upgrade,
)
from tokpack.formats.outputs import LocalOutput, Output
from tokpack.packer.shared import Result, optional_field
from tokpack.formats.packing import run_holdout

# Per-worker copy buffer. Large blocks keep a disk or an object store streaming; with a
# handful of workers the memory stays at workers x STAGE_BLOCK.
STAGE_BLOCK = 32 << 20
# The largest W of --shards-of r/W: bigger than any cluster, small enough that a list of ranks fits in memory.
MAX_WORLD_SIZE = 1 << 20
# A remote file is fetched in ranged reads of a quarter block, this many at a time per file (so
# memory stays at one block per file in flight): an object store serves one connection far
# slower than several, and a run may be a few large shards.
RANGES_IN_FLIGHT = 4
# copy_file_range errors that mean "not here" (old kernel, cross-filesystem, unsupported fs),
# not a bad file: stage falls back to read + write through its buffer.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EBADF}


@dataclass
class StageResult(Result):
    """What `stage --json` prints."""

    ok: bool
    kind: str
    source: str
    dest: str
    epochs: list[int] | None
    files: int
    copied_files: int
    skipped_files: int
    bytes_copied: int
    bytes_verified_in_place: int
    seconds: float
    mib_per_s: float | None
    partial: bool
    ranks: list[int] | None = optional_field()  # with --shards-of: the ranks and the shards left out
    world_size: int | None = optional_field()
    micro_batch: int | None = optional_field()
    shards_skipped: int | None = optional_field()
    shards_total: int | None = optional_field()


# ------------------------------------------------------------------------ arguments


def parse_epochs(
    spec,
    *,
    limit: int = MAX_EPOCHS,
    option: str = "--epochs",
    what: str = "epoch number",
    hint: str = f"epochs are numbered 0 to {MAX_EPOCHS - 1}; give those of the run",
) -> list[int] | None:
    """'0,1' / '0-3' / '0-2,5' / [0, 1] -> sorted epoch numbers; None -> None (all). Every
    number is checked against `limit` before a range is expanded."""
    if spec is None:
        return None
    if isinstance(spec, int):
        spec = [spec]
    if not isinstance(spec, str):
        numbers = {int(e) for e in spec}
        at_most(max(numbers, default=0), limit - 1, what, where=option, hint=hint)
        return sorted(numbers)
    spans = []
    try:
        for part in filter(None, (p.strip() for p in spec.split(","))):
            lo, sep, hi = part.partition("-")
            spans.append((int(lo), int(hi) if sep else int(lo)))
    except ValueError:
        raise TokpackError(f"bad {option}", where=option, expected="e.g. '0,1' or '0-3'", found=spec) from None
    for _, hi in spans:
        at_most(hi, limit - 1, what, where=option, hint=hint)
    out = {e for lo, hi in spans for e in range(lo, hi + 1)}
    if not out:
        raise TokpackError(f"bad {option}", where=option, expected="at least one epoch", found=spec)
    return sorted(out)


def parse_ranks(spec, option: str = "--ranks") -> tuple[list[int], int] | None:
    """'r/W', 'r1,r2/W' or 'a-b/W' -> (sorted ranks, W); None -> None (every rank). W is checked
    against MAX_WORLD_SIZE and each rank against W before a range is expanded. `option`: the
    flag the errors name (`--shards-of`, or its old spelling `--ranks`)."""
    if spec is None:
        return None
    if isinstance(spec, tuple):
        ranks, world = spec
        ranks = sorted(set(ranks))
    else:
        head, sep, tail = str(spec).partition("/")
        world = int(tail) if sep and tail.strip().isdigit() else 0
        at_most(
            world, MAX_WORLD_SIZE, "world size", where=option, hint="W in r/W is the number of ranks that read the run"
        )
        try:
            if not sep:
                raise ValueError
            world = int(tail)
            ranks = parse_epochs(head, limit=max(world, 1), option=option, what="rank") or []
        except (ValueError, TokpackError):
            raise TokpackError(
                f"bad {option}",
                where=option,
                expected=f"ranks in [0, {world})" if world > 0 else "'r/W', 'r1,r2/W' or 'a-b/W'",
                found=spec,
                hint="each rank must be below the world size W" if world > 0 else None,
            ) from None
    if world < 1 or not ranks or ranks[0] < 0 or ranks[-1] >= world:
        raise TokpackError(
            f"bad {option}",
            where=option,
            expected=f"ranks in [0, {world})",
            found=spec,
            hint="each rank must be below the world size W",
        )
    return ranks, world


def whole_shard_ranks(shards_of, ranks, world_size, node):
    """The `ranks` a whole-shard stage (staging.stage) is given: `shards_of` ('r/W') parsed, its
    errors naming --shards-of; else `ranks` as given (its old spelling, or a node slice's A-B).
    `shards_of` with a node slice's options is refused: it copies whole shards, a slice rows."""
    if shards_of is None:
        return ranks
    if ranks is not None or world_size is not None or node is not None:
        raise TokpackError(
            "give --shards-of alone, not with --ranks, --world-size or --node",
            where="--shards-of",
            hint="--shards-of r/W copies the whole shards ranks r of W read; "
            "--ranks A-B --world-size W makes a node slice of only their rows",
        )
    return parse_ranks(shards_of, option="--shards-of")


def shards_for_ranks(
    shard_samples: list[int], offset: int, ranks: list[int], rows: RankRows, end: int | None = None
) -> list[bool]:
    """Which shards the ranks read, for an epoch whose first sample is at `offset` in the
    chained stream of `end` samples (None: unbounded), readers serving complete global batches
    only. Each shard is decided in O(#ranks) from its sample range alone."""
    limit = None if end is None else rows.first(0, rows.batches(end))  # end of the last complete global batch
    out = []
    start = offset
    for n in shard_samples:
        stop = start + n if limit is None else min(start + n, limit)
        # an empty shard costs nothing, and readers may expect it present
        out.append(n <= 0 or (stop > start and rows.reads_any(ranks, start, stop)))
        start += n
    return out


# ----------------------------------------------------------------------------- plan


@dataclass
class CopyJob:
    rel: str  # path relative to the staged root, "/"-separated
    size: int | None  # expected bytes, when the manifest says
    checksum: str | None  # expected xxh3_128, when the manifest says
    dir_rel: str  # the directory whose manifest vouches for this file ("" = root)


@dataclass
class DirPlan:
    rel: str  # directory relative to the staged root ("" = root)
    manifest: dict  # what DEST's tokpack.json will hold
    jobs: list[CopyJob] = field(default_factory=list)  # its files (shards only; not the manifest)
    skipped_shards: list[str] = field(default_factory=list)  # shards left out by --ranks


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


def shard_jobs(
    manifest: dict, dir_rel: str, keep: list[bool] | None = None, root=None
) -> tuple[list[CopyJob], list[str]]:
    """The files of a source or epoch manifest's shards (formats/shards.py shard_files), each
    known to stay inside its folder under `root` (tokpack.formats.io.contained)."""
    jobs, skipped = [], []
    folder = None if root is None else root / dir_rel if dir_rel else root  # Source.manifest checked dir_rel
    for i, s in enumerate(manifest.get("shards") or []):
        name = s.get("path")
        if folder is not None:
            contained_shard(folder, s, i)
        if keep is not None and not keep[i]:
            skipped.append(name)
            continue
        jobs += [
            CopyJob(_join(dir_rel, name + suffix), size, s.get(key), dir_rel)
            for suffix, size, key in shard_files(s, source=manifest.get("kind") == "source")
        ]
    return jobs, skipped


SOURCE_HINT = "the source file is truncated or replaced; run `tokpack validate` on it"


class Source:
    """The directory being staged: a local path, or any fsspec URL through tokpack.formats.io's one
    file-access layer."""

    def __init__(self, path: str):
        self.path = str(path)  # as the user gave it
        try:
            self.root = as_path(self.path)  # a Path (plain os calls, kernel copies) or a RemotePath
        except Exception as e:  # noqa: BLE001 - fsspec raises anything (ImportError, ValueError, auth...)
            raise TokpackError(
                "cannot open the source",
                file=self.path,
                expected="a readable local path or fsspec URL",
                found=f"{type(e).__name__}: {e}",
                hint="install the fsspec backend it names (e.g. pip install s3fs)"
                if isinstance(e, ImportError)
                else "check the path or URL, and the credentials of its filesystem",
            ) from None
        self.local_root = str(self.root.absolute()) if isinstance(self.root, Path) else None  # None: remote

    def open(self, rel: str, size: int | None = None):
        """The file `rel` through the gate (inside its folder, a regular file: a FIFO must not
        block the copy; `size`, when its manifest records one)."""
        if self.local_root is not None:
            return open_read(os.path.join(self.local_root, rel), ahead=False, size=size, hint=SOURCE_HINT)
        return open_read(self.root / rel, block=STAGE_BLOCK, size=size, hint=SOURCE_HINT)

    def check(self, rel: str, size: int, what: str = "file", hint: str | None = None) -> None:
        """The file `rel` passes the gate with the size its manifest records (nothing read)."""
        try:
            regular_size(self.root / rel, size=size, what=what, hint=hint or SOURCE_HINT)
        except OSError as e:
            raise self.read_error(rel, e) from None

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of a remote file: one ranged GET on an object store."""
        try:
            return (self.root / rel).call("cat_file", start=start, end=end)
        except OSError as e:
            raise self.read_error(rel, e) from None

    def read_error(self, rel: str, e: Exception) -> TokpackError:
        where = f"{self.path.rstrip('/')}/{rel}"
        if isinstance(e, TokpackError):
            return e
        if isinstance(e, FileNotFoundError):
            return TokpackError(
                "file listed in the manifest is missing",
                file=where,
                hint="restore it, or run `tokpack validate` on the source",
            )
        return TokpackError(
            "cannot read the source", file=where, expected="a readable file", found=f"{type(e).__name__}: {e}"
        )

    def manifest(self, rel_dir: str, kind=None) -> dict:
        rel = _join(rel_dir, MANIFEST)
        where = f"{self.path.rstrip('/')}/{rel}"
        if rel_dir:  # an epoch directory of the run: inside it, not a symlink out
            contained(self.root, rel_dir, manifest=self.root / MANIFEST, where=f"epochs ({rel_dir})", regular=False)
        try:
            with self.open(rel) as f:
                raw = f.read(MAX_MANIFEST_BYTES + 1)  # parse_manifest refuses more
        except FileNotFoundError:
            if rel_dir:
                raise TokpackError(
                    "incomplete: no tokpack.json",
                    file=where,
                    hint="the run that writes it was interrupted or is still running",
                ) from None
            raise TokpackError(
                "not a tokpack directory, or unreachable: no tokpack.json",
                file=where,
                hint="check the path; stage copies sources, runs and epochs",
            ) from None
        except Exception as e:  # noqa: BLE001 - network/auth errors of any fsspec backend
            raise TokpackError(
                "cannot read the source",
                file=where,
                expected="a readable file",
                found=e.found if isinstance(e, TokpackError) else f"{type(e).__name__}: {e}",
                hint="check the path or URL, and the credentials of its filesystem",
            ) from None
        manifest = parse_manifest(raw, where, kind)
        require_valid(manifest, self.root / rel_dir if rel_dir else self.root)
        return manifest


def make_plan(src: Source, epochs=None, ranks=None, micro_batch: int = 1) -> tuple[str, list[DirPlan]]:
    """(kind, [directories]): the root is last, so its manifest is written after everything."""
    root = src.manifest("")
    kind = root["kind"]
    if kind == "source":
        if epochs is not None or ranks is not None:
            raise TokpackError(
                "--epochs and --ranks apply to runs and epochs, not to a packed source",
                file=src.path,
                where="kind",
                expected="run or epoch",
                found="source",
                hint="stage the source without them, or stage the run shuffled from it",
            )
        jobs, _ = shard_jobs(root, "", root=src.root)
        return kind, [DirPlan("", root, jobs)]
    if kind == "epoch":
        if epochs is not None and epochs != [root.get("epoch")]:
            raise TokpackError(
                "--epochs does not match this epoch directory",
                file=src.path,
                where="epoch",
                expected=epochs,
                found=root.get("epoch"),
            )
        keep = _rank_keep(root, 0, _samples(root), ranks, micro_batch)
        jobs, skipped = shard_jobs(root, "", keep, root=src.root)
        return kind, [DirPlan("", root, jobs, skipped)]
    # A run: its epochs in order, then the run manifest restricted to them.
    available = [int(e) for e in root.get("epochs") or []]
    chosen = sorted(available) if epochs is None else epochs
    missing = sorted(set(chosen) - set(available))
    if missing:
        raise TokpackError(
            "epochs not in this run",
            file=src.path,
            where="epochs",
            expected=f"some of {available}",
            found=missing,
            hint=f"write epoch {missing[0]} with `{shuffle_command(root, src.path, missing[0])}`"
            + (", and likewise the others," if len(missing) > 1 else "")
            + " or pick others",
        )
    manifests = [src.manifest(epoch_dir_name(e), kind="epoch") for e in chosen]
    # A reader of DEST numbers samples as the run does (epoch e starts at numbering.first(e)),
    # so the ranks' shards are chosen at those positions, not where the staged epochs chain.
    numbering = EpochNumbering.of_run(root, src.path) if ranks is not None else None
    end = None if numbering is None else numbering.first(chosen[-1]) + _samples(manifests[-1])
    plans = []
    for e, m in zip(chosen, manifests):
        rel = epoch_dir_name(e)
        offset = None if numbering is None else numbering.first(e)
        jobs, skipped = shard_jobs(m, rel, _rank_keep(m, offset, end, ranks, micro_batch), root=src.root)
        plans.append(DirPlan(rel, m, jobs, skipped))
    run = {**root, "epochs": list(chosen)}
    if chosen != available:  # the run's totals cover the epochs it lists
        staged = [upgrade(p.manifest) for p in plans]
        for key in ("tokens", "fragments", "documents"):  # `documents`: earlier writers' name for fragments
            if key in root:
                run[key] = sum(int(m.get("fragments" if key == "documents" else key, 0)) for m in staged)
    if ranks is None and run_holdout(root) is not None:
        # shuffle --holdout's held-out documents (an epoch directory the run never lists) come
        # with a copy of the run's epochs: eval reads them beside the training epochs
        held = src.manifest(HOLDOUT_DIR, kind="epoch")
        jobs, skipped = shard_jobs(held, HOLDOUT_DIR, root=src.root)
        plans.append(DirPlan(HOLDOUT_DIR, held, jobs, skipped))
    plans.append(DirPlan("", run))
    return kind, plans


def _samples(manifest: dict) -> int:
    return int(manifest.get("samples") or sum(int(s.get("samples", 0)) for s in manifest.get("shards") or []))


def _rank_keep(manifest: dict, offset: int, end: int, ranks, micro_batch: int) -> list[bool] | None:
    if ranks is None:
        return None
    return shards_for_ranks(
        [int(s.get("samples", 0)) for s in manifest.get("shards") or []],
        offset,
        ranks[0],
        RankRows(ranks[1], micro_batch),
        end,
    )


# ----------------------------------------------------------------------------- copy


class _Stager:
    """Runs the copy jobs on a thread pool; reads and writes release the GIL."""

    def __init__(
        self,
        src: Source,
        dest: Path,
        block: int,
        fetchers: ThreadPoolExecutor | None = None,
        output: Output = LocalOutput(),
    ):
        self.src = src  # where files come from
        self.dest = dest  # local root they go to
        self.output = output  # what each verified file is committed through
        self.block = block  # bytes per read
        self.fetchers = fetchers  # remote sources: the pool that runs every file's ranged reads
        self.lock = threading.Lock()  # guards the counters and `invalidated`
        self.invalidated: set[str] = set()  # dirs whose DEST manifest was removed before a rewrite
        self.copied = self.skipped = 0  # files
        self.bytes_copied = self.bytes_verified = 0  # bytes written / bytes re-verified in place
        self.bar = None  # tqdm bar, bytes
        self.kernel_copy = hasattr(os, "copy_file_range")  # cleared once the OS or filesystem refuses it

    def _count(self, copied: bool, n: int) -> None:
        with self.lock:
            if copied:
                self.copied += 1
                self.bytes_copied += n
            else:
                self.skipped += 1
                self.bytes_verified += n

    def _advance(self, n: int) -> None:
        if self.bar is not None:
            with self.lock:
                self.bar.update(n)

    def run_job(self, job: CopyJob) -> None:
        final = self.dest / job.rel
        if job.checksum and final.is_file() and (job.size is None or final.stat().st_size == job.size):
            if self._hash_local(final) == job.checksum:
                self._count(False, final.stat().st_size)
                return
        tmp = tmp_path(final)
        try:
            n, digest = self._copy(job.rel, tmp, job.size)
            if job.checksum and digest != job.checksum:
                raise TokpackError(
                    "checksum mismatch while copying",
                    file=f"{self.src.path.rstrip('/')}/{job.rel}",
                    where="xxh3_128",
                    expected=job.checksum,
                    found=digest,
                    hint="the source file is corrupt; run `tokpack validate` on the source",
                )
            if job.size is not None and n != job.size:
                raise TokpackError(
                    "file size does not match the manifest",
                    file=f"{self.src.path.rstrip('/')}/{job.rel}",
                    where="size",
                    expected=f"{job.size} bytes",
                    found=f"{n} bytes",
                    hint="the source file is truncated or replaced; run `tokpack validate` on it",
                )
            self._invalidate(job.dir_rel)
            self.output.commit_file(tmp, final)
        except OSError as e:  # disk full, permissions, I/O error: one line, not a traceback
            tmp.unlink(missing_ok=True)
            raise TokpackError(
                "copy failed",
                file=final,
                expected=f"a copy of {self.src.path.rstrip('/')}/{job.rel}",
                found=f"{type(e).__name__}: {e.strerror or e}",
                hint="check free space and permissions at DEST; rerun to resume",
            ) from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._count(True, n)

    def _invalidate(self, dir_rel: str) -> None:
        """Before replacing a file under a directory DEST already calls complete, make it
        incomplete (and the root with it): its manifest returns only once all is verified."""
        with self.lock:
            if dir_rel in self.invalidated:
                return
            for d in {dir_rel, ""}:
                self.output.unfinish(self.dest / d)
                self.invalidated.add(d)

    def _copy(self, rel: str, tmp: Path, size: int | None) -> tuple[int, str]:
        if self.fetchers is not None and size is not None and size > self.block // RANGES_IN_FLIGHT:
            return self._copy_ranges(rel, tmp, size)
        try:
            fin = self.src.open(rel, size)
        except Exception as e:  # noqa: BLE001 - any fsspec backend error
            raise self.src.read_error(rel, e) from None
        with fin, open_new(tmp, buffering=0) as fout:
            if self.kernel_copy and self.src.local_root is not None:
                try:
                    return self._copy_in_kernel(fin, fout, rel)
                except OSError as e:
                    if e.errno not in _NO_KERNEL_COPY:
                        raise
                    self.kernel_copy = False  # e.g. EXDEV across filesystems: user-space copies from now on
                    fout.seek(0)
                    fout.truncate()
            h = xxhash.xxh3_128()
            total = 0
            with lent("", self.block) as (raw,):  # taken only on this path, then reused: fresh pages are not free here
                buf = memoryview(raw)
                while n := fin.readinto(buf):
                    chunk = buf[:n]
                    h.update(chunk)
                    while chunk.nbytes:
                        chunk = chunk[fout.write(chunk) :]
                    total += n
                    self._advance(n)
        return total, h.hexdigest()

    def _copy_ranges(self, rel: str, tmp: Path, size: int) -> tuple[int, str]:
        """A remote file of known size: RANGES_IN_FLIGHT ranged reads run ahead on the shared
        fetch pool while this thread hashes and writes the earlier ranges, in order."""
        h = xxhash.xxh3_128()
        span = max(1, self.block // RANGES_IN_FLIGHT)
        offsets = iter(range(0, size, span))

        def fetch(off: int) -> bytes:
            return self.src.read_range(rel, off, min(size, off + span))

        queued = deque(self.fetchers.submit(fetch, off) for off in islice(offsets, RANGES_IN_FLIGHT))
        try:
            with open_new(tmp, buffering=0) as fout:
                done = 0
                while queued:
                    data = queued.popleft().result()
                    want = min(span, size - done)
                    if len(data) != want:  # the object is shorter than its manifest says
                        raise TokpackError(
                            "file size does not match the manifest",
                            file=f"{self.src.path.rstrip('/')}/{rel}",
                            where="size",
                            expected=f"{size} bytes",
                            found=f"{done + len(data)} bytes or fewer",
                            hint="the source file is truncated or replaced; run `tokpack validate` on it",
                        )
                    nxt = next(offsets, None)
                    if nxt is not None:
                        queued.append(self.fetchers.submit(fetch, nxt))
                    h.update(data)
                    view = memoryview(data)
                    while view.nbytes:
                        view = view[fout.write(view) :]
                    done += len(data)
                    self._advance(len(data))
        finally:
            for f in queued:
                f.cancel()
        return size, h.hexdigest()

    def _copy_in_kernel(self, fin, fout, rel: str) -> tuple[int, str]:
        """Local to local: `copy_file_range` moves the bytes inside the kernel (as `cp` does),
        and the hash reads the same source pages through a memory map, now in the page cache.
        Saves the two user-space copies of read+write (BENCHMARKS.md, "Figures cited by the code")."""
        size = os.fstat(fin.fileno()).st_size
        h = xxhash.xxh3_128()
        if size == 0:
            return 0, h.hexdigest()
        off = 0
        while off < size:
            n = os.copy_file_range(fin.fileno(), fout.fileno(), min(self.block, size - off), off, off)
            if n == 0:
                raise TokpackError(
                    "source file shrank while being copied",
                    file=f"{self.src.path.rstrip('/')}/{rel}",
                    where=f"byte {off}",
                    expected=f"{size} bytes",
                    found=f"{off} bytes",
                )
            hash_mapped(h, fin.fileno(), off, n)
            off += n
            self._advance(n)
        return size, h.hexdigest()

    def _hash_local(self, path: Path) -> str:
        """Through a memory map: no buffer to allocate (fresh pages cost more than the hash)."""
        h = xxhash.xxh3_128()
        with open_read(path, ahead=False) as f:  # DEST's own file, through the gate all the same
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return h.hexdigest()
            for off in range(0, size, self.block):
                n = min(self.block, size - off)
                hash_mapped(h, f.fileno(), off, n)
                self._advance(n)
        return h.hexdigest()


def in_place(path: Path, size: int | None) -> bool:
    """A file a rerun will verify in place, not copy again (or so its size says)."""
    return size is not None and path.is_file() and path.stat().st_size == size


def bytes_to_copy(dest: Path, plans: list[DirPlan]) -> int:
    """Bytes of the files a stage into `dest` copies: those not in place already."""
    return sum(j.size or 0 for p in plans for j in p.jobs if not in_place(dest / j.rel, j.size))


# A filesystem allocates whole blocks (4 KiB on ext4, xfs and tmpfs): a run's many small sidecars
# and manifests each take one at least, which a sum of their bytes does not see.
FS_BLOCK = 4096


def on_disk(n: int | None) -> int:
    """The bytes a file of `n` bytes takes on disk; a small file of unrecorded size (a shard's
    .metadata) takes one block."""
    return FS_BLOCK if n is None else -(-int(n) // FS_BLOCK) * FS_BLOCK


def bytes_to_write(dest: Path, plans: list[DirPlan]) -> int:
    """What a stage into `dest` writes, as the space check counts it: every file not in place
    already (shards and all their sidecars: .index, .metadata, .rows, .loss, .pad), every
    manifest and the partial-copy record, each rounded up to whole blocks. (bytes_to_copy is
    the bytes copied, which plan's timing uses.)"""
    files = sum(
        on_disk(j.size)
        for p in plans
        for j in p.jobs  # a file of unrecorded size replaces itself
        if not (in_place(dest / j.rel, j.size) or j.size is None and (dest / j.rel).is_file())
    )
    manifests = sum(on_disk(len(canonical_bytes(p.manifest))) for p in plans)
    return files + manifests + (FS_BLOCK if any(p.skipped_shards for p in plans) else 0)


def _check_dest(dest: Path, kind: str, plans: list[DirPlan]) -> None:
    """Refuse to mix two datasets in one DEST, before anything is written: DEST holds nothing
    tokpack wrote, or a copy (finished or not) of this same directory, whose files alone a stage
    replaces. An existing manifest must describe the same data."""
    held = dest_holds(dest)
    if held.kind not in (None, "damaged", "other", kind, UNFINISHED[kind]):
        raise refuse_dest(held, f"nothing, or a copy of this {kind}")
    damaged = []
    for p in plans:
        path = dest / p.rel / MANIFEST
        if not path.is_file():
            continue
        try:
            have = strict_json(read_limited(path, MAX_MANIFEST_BYTES, "manifest"), path)
        except (OSError, TokpackError):
            damaged.append(path)  # an unreadable manifest at DEST vouches for nothing; rewritten at the end
            continue
        want = p.manifest
        if kind == "run" and p.rel == "":  # the same run staged with another --epochs selection
            have = {k: v for k, v in have.items() if k not in RUN_SELECTION_KEYS}
            want = {k: v for k, v in want.items() if k not in RUN_SELECTION_KEYS}
        if have != want:
            # DEST's root manifest says what it holds; without one, the epoch's says what was left there
            # (an epoch of this run is written the same every time: one that differs is another run's)
            raise refuse_dest(
                held if held.path == dest / MANIFEST else dest_holds(dest, path, other_run=True),
                f"a copy of this {kind}",
            )
    for p in plans:  # a folder no manifest vouches for yet: its shard files must be this copy's
        _check_unvouched(dest, p)
    if kind == "run" and held.kind == UNFINISHED["run"]:
        # Epochs of an unfinished copy that this stage does not write: no run manifest vouches
        # for them yet, so each must come from this run (another --epochs selection of it).
        run, planned = plans[-1].manifest, {p.rel for p in plans}
        for d in sorted(dest.glob("epoch-*/" + MANIFEST)):
            if d.parent.name not in planned and not _same_run(_small_manifest(d), run):
                raise refuse_dest(dest_holds(dest, d, other_run=True), "a copy of this run")
    for path in damaged:  # removed once DEST is known to be this copy: nothing is written before
        path.unlink()


def _check_unvouched(dest: Path, p: DirPlan) -> None:
    """Refuses the shard files of a DEST folder without a manifest (a killed stage's) that are
    not this copy's: a name its manifest does not list (another source's or epoch's shards), or
    sizes other than the recorded ones for more of its files than match. A killed stage of this
    copy leaves the files it verified, at their sizes (and temporaries, removed), and at most a
    few of the copy's own files damaged before a repair began: those a rerun replaces."""
    from tokpack.formats.io import is_tmp_name
    from tokpack.formats.shards import is_own_file

    folder = dest / p.rel if p.rel else dest
    if (folder / MANIFEST).is_file() or not folder.is_dir():
        return
    every, _ = shard_jobs(p.manifest, "")  # every shard's files, those --shards-of leaves out too
    sizes = {j.rel: j.size for j in every}
    matched, other = 0, []
    for f in sorted(folder.iterdir()):
        if f.name == MANIFEST or is_tmp_name(f.name) or not is_own_file(f):
            continue
        want = sizes.get(f.name, -1)
        if want == -1:
            other = [(f, "not a file of this copy")]
            break
        if want is not None:
            if f.stat().st_size == want:
                matched += 1
            else:
                other.append((f, f"{f.stat().st_size} bytes, this copy's is {want}"))
    if other and (other[0][1] == "not a file of this copy" or len(other) > matched):
        f, found = other[0]
        raise refuse_dest(
            Held(
                UNFINISHED.get(p.manifest.get("kind"), "other"),
                f"an unfinished copy of another directory ({_join(p.rel, f.name)}: {found})",
                f,
            ),
            f"nothing, or a copy of this {p.manifest.get('kind')}",
        )


# ------------------------------------------------------------------------ what DEST holds

# What a stage of each kind may resume: its own copy that a killed stage left without a root manifest.
UNFINISHED = {
    "source": "unfinished copy",
    "epoch": "unfinished copy",
    "run": "unfinished run copy",
    "slice": "unfinished slice",
}
# An epoch manifest's fields that say which run it belongs to (besides its sources' fingerprints).
_EPOCH_RUN_KEYS = ("dtype", "seed", "seq_len", "shard_samples", "shuffle", "jitter", "packing", "tokenizer")
_RANK_FILE = re.compile(r"rank-(\d+)[.]ds([.].*)?")


@dataclass
class Held:
    """What DEST holds, for the line that refuses it."""

    kind: str | None  # a root manifest's kind, an UNFINISHED value, "damaged", "other" or None (nothing)
    words: str  # e.g. "a node slice of ranks 0-1 of 4 (micro-batch 3) of the run with seed 0"
    path: Path  # the file or folder that says so
    manifest: dict | None = None  # DEST's root manifest, when it has one


def _small_manifest(path: Path) -> dict | None:
    try:
        m = strict_json(read_limited(path, MAX_MANIFEST_BYTES, "manifest"), path)
    except (OSError, TokpackError):
        return None
    return m if isinstance(m, dict) else None


def _same_run(epoch: dict | None, run: dict) -> bool:
    """Whether an epoch manifest comes from `run` (its settings and its sources' fingerprints)."""
    if epoch is None or epoch.get("kind") != "epoch":
        return False
    prints = [[s.get("fingerprint") for s in m.get("sources") or [] if isinstance(s, dict)] for m in (epoch, run)]
    return prints[0] == prints[1] and all(epoch.get(k) == run.get(k) for k in _EPOCH_RUN_KEYS if k in run)


def _describe(m: dict) -> str:
    """A manifest's copy in words: its kind and what tells it from another copy of that kind."""
    kind, run = m.get("kind"), m.get("run") if isinstance(m.get("run"), dict) else m
    of_run = f"the run with seed {run.get('seed')}, seq_len {run.get('seq_len')}"
    if kind == "source":
        return f"a copy of a packed source ({len(m.get('shards') or [])} shards, {m.get('tokens')} tokens)"
    if kind == "run":
        return f"a whole-run copy of {of_run} (epochs {m.get('epochs')})"
    if kind == "epoch":
        return f"a copy of epoch {m.get('epoch')} of {of_run}"
    if kind in ("slice", "slice-epoch"):
        ranks = m.get("ranks") if isinstance(m.get("ranks"), list) and m.get("ranks") else ["?"]
        return (
            f"a node slice of ranks {ranks[0]}-{ranks[-1]} of {m.get('world_size')} "
            f"(micro-batch {m.get('micro_batch')}) of {of_run}"
        )
    return f"a tokpack.json of kind {kind!r}"


def dest_holds(dest: Path, path: Path | None = None, other_run: bool = False) -> Held:
    """What DEST holds: its root manifest's copy; without one (a stage killed before its end),
    the unfinished copy its epoch folders and shard or rank files are; `path`: the manifest to
    name (one that differs from the stage's)."""
    dest = Path(dest)
    root = dest / MANIFEST
    if path is not None and path != root:
        m = _small_manifest(path)
        words = _describe(m) if m else "an unreadable tokpack.json"
        if m and m.get("kind") == "epoch":  # no root manifest: a whole-run copy a stage left unfinished
            words = f"an unfinished whole-run copy{' of another run' if other_run else ''} ({path.parent.name}: {words[2:]})"
        return Held(m.get("kind") if m else "damaged", words, path, m)
    if root.is_file():
        m = _small_manifest(root)
        if m is None:
            return Held("damaged", "an unreadable tokpack.json", root)
        kind = m.get("kind")
        words = _describe(m)
        if kind == "run" and (dest / STAGE_SIDECAR).is_file():
            words += f", staged for some ranks only ({STAGE_SIDECAR})"
        return Held(kind if kind in UNFINISHED else "other", words, root, m)
    if not dest.is_dir():
        return Held(None, "nothing", dest)
    from tokpack.formats.io import is_tmp_name
    from tokpack.formats.shards import is_own_file

    held = Held(None, "nothing", dest)
    for p in sorted(dest.iterdir()):
        if p.name in ("tokpack.lock", STAGE_SIDECAR) or is_tmp_name(p.name):
            if p.name == STAGE_SIDECAR:
                held = Held(UNFINISHED["run"], f"an unfinished whole-run copy for some ranks ({p.name})", p)
            continue
        if p.is_dir() and p.name.startswith("epoch-"):
            m = _small_manifest(p / MANIFEST) if (p / MANIFEST).is_file() else None
            if m is not None and m.get("kind") == "slice-epoch":
                return Held(
                    UNFINISHED["slice"],
                    f"an unfinished {_describe(m)[2:]} ({p.name} and no slice manifest yet)",
                    p / MANIFEST,
                    m,
                )
            if m is not None and m.get("kind") == "epoch":
                held = Held(
                    UNFINISHED["run"],
                    f"an unfinished whole-run copy ({p.name} and no run manifest yet)",
                    p / MANIFEST,
                    m,
                )
                continue
            names = sorted(q.name for q in p.iterdir())
            rank = next((n for n in names if _RANK_FILE.fullmatch(n)), None)
            if rank is not None:
                return Held(
                    UNFINISHED["slice"], f"an unfinished node slice ({p.name}/{rank}, no manifest yet)", p / rank
                )
            shard = next((n for n in names if is_own_file(p / n) and n != MANIFEST and not is_tmp_name(n)), None)
            if shard is not None and held.kind is None:
                held = Held(
                    UNFINISHED["run"], f"an unfinished whole-run copy ({p.name}/{shard}, no manifest yet)", p / shard
                )
            continue
        if is_own_file(p):
            if held.kind is None:
                held = Held(
                    UNFINISHED["source"], f"an unfinished copy of a source or epoch ({p.name}, no manifest yet)", p
                )
            continue
        if held.kind is None:
            held = Held("other", f"files tokpack did not write ({p.name})", p)
    return held


def refuse_dest(held: Held, expected: str) -> TokpackError:
    """The one line refusing a DEST: what it holds, and that a stage writes over its own copy only."""
    return TokpackError(
        "DEST already holds a different tokpack directory",
        file=held.path,
        expected=expected,
        found=held.words,
        hint="remove DEST or choose another destination: a stage replaces only the files it wrote for this same copy",
    )


@locked_output("stage", arg="dest")
def stage(
    directory,
    dest,
    *,
    workers: int = 4,
    epochs=None,
    ranks=None,
    micro_batch: int = 1,
    log=None,
    block: int = STAGE_BLOCK,
) -> StageResult:
    """Copies DIRECTORY (source, run or epoch; any fsspec path) to the local DEST, verified.

    Raises TokpackError on a bad source, a checksum mismatch or a
    DEST holding other data; DEST then has no manifest for anything unverified."""
    t0 = time.perf_counter()
    epochs = parse_epochs(epochs)
    ranks = parse_ranks(ranks)
    if micro_batch < 1:
        raise TokpackError("bad --micro-batch", where="--micro-batch", expected=">= 1", found=micro_batch)
    if "://" in str(dest):
        raise TokpackError(
            "DEST must be a local path",
            file=dest,
            expected="a local directory (e.g. on NVMe)",
            found="a URL",
            hint="stage reads from any fsspec URL but writes to local disk",
        )
    src = Source(str(directory))
    kind, plans = make_plan(src, epochs, ranks, micro_batch)
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise TokpackError("DEST exists and is not a directory", file=dest, hint="choose a directory path")
    _check_dest(dest, kind, plans)
    output: Output = LocalOutput()  # DEST is a local path (checked above): what is copied there is the copy
    check_space(
        [(dest, bytes_to_write(dest, plans))],
        "stage",
        hint="free some space there, choose another DEST, or stage fewer epochs (--epochs, --ranks)",
    )
    try:
        for p in plans:
            (dest / p.rel).mkdir(parents=True, exist_ok=True)
            remove_tmp_files(dest / p.rel)  # leftovers of an interrupted stage: never data
    except OSError as e:
        raise TokpackError(
            "cannot create DEST",
            file=dest,
            found=f"{type(e).__name__}: {e.strerror or e}",
            hint="check the path and its permissions",
        ) from None

    jobs = [j for p in plans for j in p.jobs]
    total = sum(j.size or 0 for j in jobs)
    if log:
        log(f"stage: {kind} {src.path} -> {dest}: {len(jobs)} files, {total / 2**20:,.1f} MiB, {workers} workers")
        note = whole_copy_note(plans, ranks, micro_batch, src.path, str(dest))
        if note:
            log(note)
    pending = {p.rel: len(p.jobs) for p in plans}
    by_dir = {p.rel: p for p in plans}
    # A remote source's ranged reads share one pool; it closes after the copies that use it.
    fetch_pool = ThreadPool(max_workers=max(1, workers)) if src.local_root is None else nullcontext()
    with progress(total, "stage") as bar, fetch_pool as fetchers, ThreadPool(max_workers=max(1, workers)) as pool:
        stager = _Stager(src, dest, block, fetchers, output)
        stager.bar = bar
        futures = {pool.submit(stager.run_job, j): j for j in jobs}
        remaining = set(futures)
        try:
            while remaining:
                done, remaining = wait(remaining, return_when=FIRST_EXCEPTION)
                failed = [f for f in done if f.exception() is not None]
                if failed:
                    raise failed[0].exception()
                for f in done:
                    rel = futures[f].dir_rel
                    pending[rel] -= 1
                    # An epoch's manifest follows its own shards, so a long stage completes epoch by epoch.
                    if pending[rel] == 0 and rel != "":
                        output.finish(dest / rel, by_dir[rel].manifest)
        except BaseException:
            # A failure or Ctrl-C: drop the queued copies; the pool's exit waits (at most
            # tokpack.formats.io.STOP_GRACE) for the few in flight, each of which commits a verified file
            # or removes its temporary; one blocked in a read is left (a rerun removes its temporary).
            for f in remaining:
                f.cancel()
            raise

    # Directories without jobs (e.g. every shard filtered out) and the root come last.
    for p in plans:
        if p.rel != "" and not p.jobs:
            output.finish(dest / p.rel, p.manifest)
    missing = _partial_sidecar(dest, plans, ranks, micro_batch, output)
    root = next(p for p in plans if p.rel == "")
    output.finish(dest, root.manifest)  # like every manifest: the directory is fsync'd before and after

    seconds = time.perf_counter() - t0
    moved = stager.bytes_copied + stager.bytes_verified
    selection = (
        {}
        if ranks is None
        else dict(
            ranks=ranks[0],
            world_size=ranks[1],
            micro_batch=micro_batch,
            shards_skipped=sum(len(p.skipped_shards) for p in plans),
            shards_total=sum(len(p.manifest.get("shards") or []) for p in plans),
        )
    )
    if log:
        log(
            f"stage: {stager.copied} files copied, {stager.skipped} already in place and verified"
            + (f"; partial copy for ranks {ranks[0]}/{ranks[1]} (see {STAGE_SIDECAR})" if missing else "")
        )
    return StageResult(
        ok=True,
        kind=kind,
        source=src.path,
        dest=str(dest),
        epochs=[p.manifest.get("epoch") for p in plans if p.manifest.get("kind") == "epoch" and p.rel != HOLDOUT_DIR]
        if kind != "source"
        else None,
        files=len(jobs) + len(plans),
        copied_files=stager.copied,
        skipped_files=stager.skipped,
        bytes_copied=stager.bytes_copied,
        bytes_verified_in_place=stager.bytes_verified,
        seconds=round(seconds, 3),
        mib_per_s=round(moved / 2**20 / seconds, 1) if seconds > 0 else None,
        partial=bool(missing),
        **selection,
    )


def whole_copy_note(plans: list[DirPlan], ranks, micro_batch: int, source: str, dest: str) -> str | None:
    """One line when a `--shards-of r/W` stage copies (nearly) the whole run anyway: how much, why,
    and the node-slice command that copies only the ranks' rows."""
    if ranks is None:
        return None
    total = sum(int(s.get("bytes") or 0) for p in plans for s in p.manifest.get("shards") or [])
    left = sum(
        int(s.get("bytes") or 0)
        for p in plans
        for s in p.manifest.get("shards") or []
        if s.get("path") in p.skipped_shards
    )
    if not total or left > total / 2:
        return None
    (rs, world), per = ranks, max([int(p.manifest.get("shard_samples") or 0) for p in plans] or [0])
    return (
        f"stage: whole-run copy ({100 * (total - left) / total:.0f}% of the run's shard bytes): --shards-of "
        f"{','.join(map(str, rs))}/{world} copies whole shards, and a shard ({per:,} samples) holds rows of these "
        f"ranks in any global batch it spans ({world * micro_batch:,} samples each); "
        f"`{stage_command(source, dest, rs[0], rs[-1], world, micro_batch)}` copies only their rows"
    )


def _partial_sidecar(dest: Path, plans: list[DirPlan], ranks, micro_batch: int, output: Output) -> dict:
    """Records at DEST's root which shards a --ranks stage left out (those not present at
    DEST, counting earlier stages), or removes the record once nothing is missing."""
    path = dest / STAGE_SIDECAR
    try:
        previous = (
            strict_json(read_limited(path, MAX_MANIFEST_BYTES, STAGE_SIDECAR), path, STAGE_SIDECAR)
            if path.is_file()
            else {}
        )
    except (OSError, TokpackError):
        previous = {}
    missing = {}
    for p in plans:
        absent = [s for s in p.skipped_shards if not (dest / p.rel / s).is_file()]
        if absent:
            missing[p.rel or "."] = absent
    if not missing:
        output.unfinish(dest, STAGE_SIDECAR)
        return {}
    stages = list(previous.get("stages", []))
    if ranks is not None:
        stages.append({"ranks": ranks[0], "world_size": ranks[1], "micro_batch": micro_batch})
    output.finish(dest, stage_sidecar(stages, missing), STAGE_SIDECAR)
    return missing
