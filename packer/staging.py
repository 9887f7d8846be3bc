"""`tokpack stage`: a verified, resumable, parallel copy of a tokpack directory to local disk.

Every file is read once, in large sequential blocks through a buffer reused by its worker
thread, hashed (xxh3_128) as it streams, and written under a temporary name; it is renamed
into place only when its checksum equals the manifest's. An epoch shard's token file whose
entry records no xxh3_128 is checked row by row as it streams instead, each row's xxh3-64
against the shard's `.ds.rows` (read first, checked against its `rows_xxh3_128`:
formats/token_check.py). Manifests are written last: each
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
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from tokpack.formats.errors import TokpackError
from tokpack.formats.guard import check_space, locked_output
from tokpack.formats.io.reads import ThreadPool
from tokpack.formats.io.gate import hash_mapped, open_new, open_read
from tokpack.formats.io.memory import lent
from tokpack.formats.io.progress_log import progress
from tokpack.formats.io.writes import remove_tmp_files, tmp_path
from tokpack.formats.constants import EPOCH, HOLDOUT_DIR, SOURCE, STAGE_SIDECAR
from tokpack.formats.builders import stage_sidecar
from tokpack.formats.outputs import LocalOutput, Output
from tokpack.formats.slices import stage_command
from tokpack.formats.token_check import FileDigest, RowDigest, digest_error, recorded_rows
from tokpack.packer.shared import Result, optional_field
from tokpack.packer.stage_dest import local_dest, bytes_to_write, check_dest, small_manifest
from tokpack.packer.stage_plan import STAGE_BLOCK, CopyJob, DirPlan, Source, make_plan, parse_epochs, parse_ranks

# A remote file is fetched in ranged reads of a quarter block, this many at a time per file (so
# memory stays at one block per file in flight): an object store serves one connection far
# slower than several, and a run may be a few large shards.
RANGES_IN_FLIGHT = 4
# copy_file_range errors that mean "not here" (old kernel, cross-filesystem, unsupported fs),
# not a bad file: stage falls back to read + write through its buffer.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EBADF}
CORRUPT_HINT = "the source file is corrupt; run `tokpack validate` on the source"


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


# ----------------------------------------------------------------------------- copy


class _Stager:
    """Runs the copy jobs on a thread pool; reads and writes release the GIL."""

    def __init__(self, src: Source, dest: Path, block: int, fetchers: ThreadPoolExecutor | None, output: Output):
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
        digest = self._digest(job)
        if digest is not None and final.is_file() and (job.size is None or final.stat().st_size == job.size):
            if self._hash_local(final, digest()).problem() is None:
                self._count(False, final.stat().st_size)
                return
        tmp = tmp_path(final)
        try:
            n, got = self._copy(job.rel, tmp, job.size, digest or _Unchecked)
            err = digest_error(got, self.src.at(job.rel), "checksum mismatch while copying", hint=CORRUPT_HINT)
            if err is not None:
                raise err
            if job.size is not None and n != job.size:
                raise self.src.size_error(job.rel, job.size, f"{n} bytes")
            self._invalidate(job.dir_rel)
            self.output.commit_file(tmp, final)
        except OSError as e:  # disk full, permissions, I/O error: one line, not a traceback
            tmp.unlink(missing_ok=True)
            raise TokpackError(
                "copy failed",
                file=final,
                expected=f"a copy of {self.src.at(job.rel)}",
                found=f"{type(e).__name__}: {e.strerror or e}",
                hint="check free space and permissions at DEST; rerun to resume",
            ) from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._count(True, n)

    def _digest(self, job: CopyJob):
        """What makes a digest that checks the job's bytes (None: nothing recorded to check them
        against): its xxh3_128, or, for a token file vouched for by row hashes, its `.ds.rows`
        from the source, read once and checked against the manifest here."""
        if job.checksum:
            return lambda: FileDigest(job.checksum, job.key)
        if job.rows is None:
            return None
        rel, checksum, samples = job.rows
        try:
            recorded = recorded_rows(self.src.root / job.rel, checksum, samples, CORRUPT_HINT)
        except OSError as e:
            raise self.src.read_error(rel, e) from None
        row_bytes = job.size // samples if samples and job.size is not None else 1
        return lambda: RowDigest(recorded, row_bytes, rel.rsplit("/", 1)[-1])

    def _invalidate(self, dir_rel: str) -> None:
        """Before replacing a file under a directory DEST already calls complete, make it
        incomplete (and the root with it): its manifest returns only once all is verified."""
        with self.lock:
            if dir_rel in self.invalidated:
                return
            for d in {dir_rel, ""}:
                self.output.unfinish(self.dest / d)
                self.invalidated.add(d)

    def _copy(self, rel: str, tmp: Path, size: int | None, digest):
        """(bytes copied, a digest made by `digest()` and fed them all in order)."""
        if self.fetchers is not None and size is not None and size > self.block // RANGES_IN_FLIGHT:
            return self._copy_ranges(rel, tmp, size, digest())
        try:
            fin = self.src.open(rel, size)
        except Exception as e:  # noqa: BLE001 - any fsspec backend error
            raise self.src.read_error(rel, e) from None
        with fin, open_new(tmp, buffering=0) as fout:
            if self.kernel_copy and self.src.local_root is not None:
                try:
                    return self._copy_in_kernel(fin, fout, rel, digest())
                except OSError as e:
                    if e.errno not in _NO_KERNEL_COPY:
                        raise
                    self.kernel_copy = False  # e.g. EXDEV across filesystems: user-space copies from now on
                    fout.seek(0)
                    fout.truncate()
            h, total = digest(), 0
            with lent("", self.block) as (raw,):  # taken only on this path, then reused: fresh pages are not free here
                buf = memoryview(raw)
                while n := fin.readinto(buf):
                    chunk = buf[:n]
                    h.update(chunk)
                    while chunk.nbytes:
                        chunk = chunk[fout.write(chunk) :]
                    total += n
                    self._advance(n)
        return total, h

    def _copy_ranges(self, rel: str, tmp: Path, size: int, h):
        """A remote file of known size: RANGES_IN_FLIGHT ranged reads run ahead on the shared
        fetch pool while this thread hashes and writes the earlier ranges, in order."""
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
                        raise self.src.size_error(rel, size, f"{done + len(data)} bytes or fewer")
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
        return size, h

    def _copy_in_kernel(self, fin, fout, rel: str, h):
        """Local to local: `copy_file_range` moves the bytes inside the kernel (as `cp` does),
        and the hash reads the same source pages through a memory map, now in the page cache.
        Saves the two user-space copies of read+write (BENCHMARKS.md, "Figures cited by the code")."""
        size = os.fstat(fin.fileno()).st_size
        off = 0
        while off < size:
            n = os.copy_file_range(fin.fileno(), fout.fileno(), min(self.block, size - off), off, off)
            if n == 0:
                raise TokpackError(
                    "source file shrank while being copied",
                    file=self.src.at(rel),
                    where=f"byte {off}",
                    expected=f"{size} bytes",
                    found=f"{off} bytes",
                )
            hash_mapped(h, fin.fileno(), off, n)
            off += n
            self._advance(n)
        return size, h

    def _hash_local(self, path: Path, h):
        """`h` (a digest) fed DEST's file `path`, through a memory map: no buffer to allocate
        (fresh pages cost more than the hash)."""
        with open_read(path, ahead=False) as f:  # DEST's own file, through the gate all the same
            size = os.fstat(f.fileno()).st_size
            for off in range(0, size, self.block):
                n = min(self.block, size - off)
                hash_mapped(h, f.fileno(), off, n)
                self._advance(n)
        return h


class _Unchecked:
    """The digest of a file its manifest records no checksum of: nothing to check."""

    def update(self, data) -> None:
        pass

    def problem(self) -> None:
        return None


# ------------------------------------------------------- a --shards-of r/W copy (partial, or nearly whole)


def whole_copy_note(plans: list[DirPlan], ranks, micro_batch: int, source: str, dest: str) -> str | None:
    """One line when a `--shards-of r/W` stage copies (nearly) the whole run anyway: how much, why,
    and the node-slice command that copies only the ranks' rows."""
    if ranks is None:
        return None
    total = left = 0  # the run's shard bytes, and those of the shards left out
    for p in plans:
        for s in p.manifest.get("shards") or []:
            total += int(s.get("bytes") or 0)
            left += int(s.get("bytes") or 0) if s.get("path") in p.skipped_shards else 0
    if not total or left > total / 2:
        return None
    (rs, world), per = ranks, max([int(p.manifest.get("shard_samples") or 0) for p in plans] or [0])
    return (
        f"stage: whole-run copy ({100 * (total - left) / total:.0f}% of the run's shard bytes): --shards-of "
        f"{','.join(map(str, rs))}/{world} copies whole shards, and a shard ({per:,} samples) holds rows of these "
        f"ranks in any global batch it spans ({world * micro_batch:,} samples each); "
        f"`{stage_command(source, dest, rs[0], rs[-1], world, micro_batch)}` copies only their rows"
    )


def partial_sidecar(dest: Path, plans: list[DirPlan], ranks, micro_batch: int, output: Output) -> dict:
    """Records at DEST's root which shards a --ranks stage left out (those not present at
    DEST, counting earlier stages), or removes the record once nothing is missing."""
    previous = small_manifest(dest / STAGE_SIDECAR) or {}
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


def _copied(running: set, until) -> set:
    """The copies of `running` still running once `until` (FIRST_COMPLETED, FIRST_EXCEPTION: all
    of them) is met; a failed copy's error raised."""
    done, running = wait(running, return_when=until)
    failed = [f for f in done if f.exception() is not None]
    if failed:
        raise failed[0].exception()
    return running


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
    dest = local_dest(dest)
    src = Source(str(directory))
    kind, plans = make_plan(src, epochs, ranks, micro_batch)
    if dest.exists() and not dest.is_dir():
        raise TokpackError("DEST exists and is not a directory", file=dest, hint="choose a directory path")
    if src.local_root is not None and dest.is_dir() and os.path.samefile(src.local_root, dest):
        # Its files would be "in place", and its manifests rewritten as the copy's: with --epochs
        # the run's own manifest would list only the epochs staged, dropping the others.
        raise TokpackError(
            "DEST is the directory being staged",
            file=dest,
            expected="another folder (on the node's local disk)",
            found=f"the folder of {src.path}",
            hint="choose another DEST; a stage copies DIR, it never rewrites DIR itself",
        )
    check_dest(dest, kind, plans)
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

    files = sum(len(p.jobs) for p in plans)
    total = sum(j.size or 0 for p in plans for j in p.jobs)
    if log:
        log(f"stage: {kind} {src.path} -> {dest}: {files} files, {total / 2**20:,.1f} MiB, {workers} workers")
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
        # A few copies queued ahead of the pool, not a future per file: a source of 50,000 shards
        # (150,000 files) held 230 MB of futures, one of 1.5M entries would hold 7 GB. Each job is
        # made as its turn comes (stage_plan.CopyJobs): the queued copies' jobs are all that is held.
        remaining: set = set()
        try:
            for j in (j for p in plans for j in p.jobs):
                remaining.add(pool.submit(stager.run_job, j))
                if len(remaining) >= 4 * max(1, workers):
                    remaining = _copied(remaining, FIRST_COMPLETED)
            while remaining:
                remaining = _copied(remaining, FIRST_EXCEPTION)
            for rel, n in pending.items():  # every copy done: each directory's manifest after its shards
                if n and rel != "":
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
    missing = partial_sidecar(dest, plans, ranks, micro_batch, output)
    output.finish(dest, plans[-1].manifest)  # the root (make_plan's last); the directory fsync'd before and after

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
        epochs=[p.manifest.get(EPOCH) for p in plans if p.manifest.get("kind") == EPOCH and p.rel != HOLDOUT_DIR]
        if kind != SOURCE
        else None,
        files=files + len(plans),
        copied_files=stager.copied,
        skipped_files=stager.skipped,
        bytes_copied=stager.bytes_copied,
        bytes_verified_in_place=stager.bytes_verified,
        seconds=round(seconds, 3),
        mib_per_s=round(moved / 2**20 / seconds, 1) if seconds > 0 else None,
        partial=bool(missing),
        **selection,
    )
