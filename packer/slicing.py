"""`tokpack stage RUN DEST --ranks A-B --world-size W --micro-batch m`: a node slice.

Only the rows that ranks A..B read are copied (formats/slices.py says which), each into its
rank's file of its epoch, in the order the rank reads them. Per global batch those rows are
one run of (B-A+1)*m consecutive samples of the epoch, so the copy reads those runs (ranged
reads, several in flight) and never the other nodes' rows.

Every row kept is checked against the xxh3-64 the shuffle recorded for it (`NNNNN.ds.rows`,
itself checked against its manifest checksum). A best-fit epoch's padding per row (`.ds.pad`,
which the row hashes do not cover) comes from the shard's sidecar read whole and checked
against its `pad_xxh3_128`, and goes into the rank's `.ds.pad`. An epoch written before row
hashes existed is verified by reading its shards whole (their manifest checksums), with one
line saying so.

Resumable: an epoch is committed by its slice manifest, written after its rank files; a
rerun skips the committed epochs (they are not read or rewritten) and redoes the others, with
the same bytes. The root manifest is written last.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from tokpack.formats.errors import TokpackError
from tokpack.formats.guard import check_space, is_no_space, locked_output
from tokpack.formats.io.gate import IO_BLOCK, regular_fd
from tokpack.formats.io.reads import Worker, read_full
from tokpack.formats.reading import canonical_bytes
from tokpack.formats.packing import has_pad
from tokpack.formats.checks import row_bytes_of
from tokpack.formats.constants import EPOCH, MANIFEST, PAD_DTYPE, PAD_SUFFIX, ROWS_SUFFIX, RUN, SLICE, U64
from tokpack.formats.names import dtype_from_name, epoch_dir_name
from tokpack.formats.hashes import hash_hex64, row_hashes
from tokpack.formats.numbering import EpochNumbering
from tokpack.formats.outputs import EpochShardFormat, LocalOutput, Output, ShardWriter
from tokpack.formats.shards import RowFacts, contained_shard, shard_files
from tokpack.formats.slices import RankRows, run_identity, slice_epoch_manifest, slice_manifest

from tokpack.packer.rank_files import RankFiles, ready_epoch_dir
from tokpack.packer.run_checks import refuse_epoch_of_another_run
from tokpack.packer.shared import Result
from tokpack.packer.stage_dest import epoch_in_place, local_dest, on_disk, previous_slice, small_json
from tokpack.packer.stage_plan import Source, listed_epochs, refuse_tokens_on_nodes, slice_ranks
from tokpack.shuffle.packings import of_manifest

# Rows gathered per step: three chunks in flight (read, verified, written), so memory stays near
# 3x this whatever the epoch's size.
CHUNK_BYTES = IO_BLOCK


@dataclass
class SliceResult(Result):
    """What `stage --ranks A-B --world-size W --json` prints."""

    ok: bool
    kind: str
    source: str
    dest: str
    ranks: list[int]
    world_size: int
    micro_batch: int
    batch_phase: int
    epochs: list[int]  # every epoch the slice holds
    epochs_staged: list[int]  # copied by this call
    epochs_in_place: list[int]  # already complete at DEST, not read again
    verified_by: str  # "row hashes", "whole shards" or "row hashes, whole shards"
    rows_kept: int
    bytes_kept: int
    bytes_read: int
    read_amplification: float | None  # bytes read / bytes kept (rank-file token bytes)
    seconds: float
    mib_per_s: float | None


class _Reads:
    """Ranged reads of the source's shard files, counted: preads of a local file, ranged GETs of a URL."""

    def __init__(self, src: Source, pool: ThreadPoolExecutor):
        self.src, self.pool = src, pool
        self.bytes = 0
        self.sizes: dict[str, int] = {}  # file -> the bytes its manifest records: what the gate checks at its open
        self._fds: dict[str, int] = {}
        self._checked: set[str] = set()  # remote files already through the gate
        self._lock = threading.Lock()  # the read-ahead and the reader threads open files

    def _fd(self, rel: str) -> int:
        with self._lock:  # once per file, whichever thread comes first
            fd = self._fds.get(rel)
            if fd is None:
                try:  # through the gate: inside its epoch folder, a regular file (a FIFO would block), its size
                    fd = self._fds[rel] = regular_fd(
                        os.path.join(self.src.local_root, rel), size=self.sizes[rel], what="run file", hint=RUN_HINT
                    )
                except OSError as e:
                    raise self.src.read_error(rel, e) from None
            return fd

    def read_all(self, jobs: list[tuple[str, int, memoryview]], advised: bool = False) -> None:
        """Every (file, offset, buffer): a local file's ranges are all announced to the kernel
        first (its read-ahead fetches them concurrently) and then read in order, in this thread;
        a remote file's are ranged GETs, `workers` in flight."""
        if self.src.local_root is None:
            list(self.pool.map(lambda j: self.read(*j), jobs))
            return
        if not advised:
            self.advise([(rel, start, out.nbytes) for rel, start, out in jobs])
        for job in jobs:
            self.read(*job)

    def advise(self, ranges: list[tuple[str, int, int]]) -> None:
        """Announces (file, offset, length) ranges of local files to the kernel, which starts
        fetching them (WILLNEED); a no-op for a URL."""
        if self.src.local_root is not None and hasattr(os, "posix_fadvise"):
            for rel, start, size in ranges:
                os.posix_fadvise(self._fd(rel), start, size, os.POSIX_FADV_WILLNEED)

    def read(self, rel: str, start: int, out: memoryview) -> None:
        if self.src.local_root is not None:
            done = read_full(self._fd(rel), out, start)
        else:
            if rel not in self._checked:
                self.src.check(rel, self.sizes[rel], what="run file", hint=RUN_HINT)
                self._checked.add(rel)
            data = self.src.read_range(rel, start, start + out.nbytes)
            done = len(data)
            out[:done] = data
        if done != out.nbytes:
            raise TokpackError(
                "shard is shorter than its manifest says",
                file=self.src.at(rel),
                where=f"byte {start + done}",
                expected=f"{out.nbytes - done} more bytes",
                found="end of file",
                hint="run `tokpack validate` on the run",
            )
        self.bytes += done

    def whole(self, rel: str, size: int) -> bytes:
        buf = bytearray(size)
        view = memoryview(buf)
        self.read_all([(rel, off, view[off : off + CHUNK_BYTES]) for off in range(0, size, CHUNK_BYTES)])
        return bytes(buf)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class _EpochStager:
    """Copies one epoch's rows of the node's ranks into their rank files, verified row by row."""

    def __init__(self, reads: _Reads, rel: str, m: dict, rows: RankRows, ranks: tuple[int, int], first: int):
        self.reads, self.rel, self.m = reads, rel, m
        self.rows, self.ranks, self.first = rows, ranks, first
        self.shards = m["shards"]
        self.per_shard = int(m["shard_samples"])
        self.row_bytes = row_bytes_of(m)
        # Row hashes and padding as the run records them, each sidecar checked before use.
        self.facts = RowFacts(
            m,
            self.row_bytes,
            lambda i, suffix, size: [reads.whole(self.shard_path(i) + suffix, size)],
            reads.src.at(rel),
            "the run's file is corrupt: run `tokpack validate` on the run; nothing was kept",
        )
        self.by_rows = all("rows_xxh3_128" in s for s in self.shards)
        self.packed = of_manifest(m).padded  # its rank files get a `.ds.pad` (best-fit)
        self.format = EpochShardFormat(
            dtype_from_name(m["dtype"]), int(m["seq_len"]), int(m["eos_id"]), m["tokenizer"], padded=self.packed
        )
        for s in self.shards:
            reads.sizes.update((f"{rel}/{name}", size) for name, size in run_files(s, self.row_bytes))

    def shard_path(self, i: int) -> str:
        return f"{self.rel}/{self.shards[i]['path']}"

    def _ranges(self, pos: np.ndarray) -> tuple[np.ndarray, list[tuple[str, int, int, int]]]:
        """(shard of each position, [(shard file, byte offset, first, end)]): consecutive
        positions in one shard are one range, rows [first, end) of the chunk."""
        shard = pos // self.per_shard
        breaks = np.flatnonzero((np.diff(pos) != 1) | (np.diff(shard) != 0)) + 1
        lo = np.concatenate([[0], breaks]).tolist()
        hi = np.concatenate([breaks, [len(pos)]]).tolist()
        offs = ((pos[lo] - shard[lo] * self.per_shard) * self.row_bytes).tolist()
        names = shard[lo].tolist()
        return shard, [(self.shard_path(i), off, a, b) for i, off, a, b in zip(names, offs, lo, hi)]

    def _fill(self, slot: list, pos: np.ndarray, shard: np.ndarray, ranges: list) -> tuple:
        """In the reader thread: the rows at epoch positions `pos` read into the slot's buffer,
        with what the run recorded for them (row hashes; best-fit, padding), gathered here so
        that the sidecar caches are used by this thread only. Returns (rows, shard of each,
        expected hashes, padding or None)."""
        k = len(pos)
        if slot[0] is None or len(slot[0]) < k:  # one buffer a slot for every chunk: fresh pages cost
            slot[0] = np.empty((k, self.row_bytes), dtype=np.uint8)
        buf = slot[0][:k]
        flat = memoryview(buf.reshape(-1))
        rb = self.row_bytes
        self.reads.read_all([(rel, off, flat[a * rb : b * rb]) for rel, off, a, b in ranges], advised=True)
        want = self.facts.gather(pos, self.facts.hashes)
        pad = self.facts.gather(pos, self.facts.pads) if self.packed else None
        return buf, shard, want, pad

    def run(self, writers: dict[int, ShardWriter]) -> int:
        """Writes the rows (and, best-fit, their padding) into the rank files; returns the rows kept.

        Three stages overlap, each in order: a reader thread reads chunks c+1 and c+2 (their
        ranges announced to the kernel as soon as they are planned), this thread verifies and
        indexes chunk c, a disk thread writes chunk c's tokens. Reads and writes are the disk's,
        hashing the CPU's: overlapped, the stage takes about its slowest part rather than their
        sum. Three buffers rotate: one being written, two being read."""
        n = int(self.m["samples"])
        max_rows = max(1, CHUNK_BYTES // self.row_bytes)
        plan = (p for p in self.rows.node_positions(self.first, n, self.ranks, max_rows) if len(p))
        slots = [[None] for _ in range(3)]
        written: list = [None] * 3  # per slot: the disk's last job using it
        kept = 0
        dtype = writers[self.ranks[0]].dtype
        with Worker() as ahead, Worker() as reader, Worker() as disk:
            queued: deque = deque()

            def read_next(j: int) -> None:
                if written[j] is not None:
                    written[j].result()  # its rows are on disk: the buffer is free
                pos = next(plan, None)
                if pos is not None:
                    shard, ranges = self._ranges(pos)
                    # announced now, read once the chunks before it are: the disk has a queue
                    ahead.submit(self.reads.advise, [(rel, off, (b - a) * self.row_bytes) for rel, off, a, b in ranges])
                    queued.append((pos, reader.submit(self._fill, slots[j], pos, shard, ranges)))

            read_next(0)
            read_next(1)
            for c in itertools.count():
                if not queued:
                    break
                pos, job = queued.popleft()
                buf, shard, want, pad = job.result()
                found = row_hashes(buf)
                bad = np.flatnonzero(want != found)
                if len(bad):
                    b = int(bad[0])
                    i = int(shard[b])
                    k = int(pos[b] - i * self.per_shard)
                    raise TokpackError(
                        "sample differs from the run's row hash",
                        file=self.reads.src.at(self.shard_path(i)),
                        where=f"sample {k} (byte {k * self.row_bytes})",
                        expected=hash_hex64(int(want[b])),
                        found=hash_hex64(int(found[b])),
                        hint="the run's shard is corrupt: run `tokpack validate` on the run; nothing was kept",
                    )
                tokens = buf.view(dtype)
                if len(writers) == 1:  # every row is this rank's: no gather
                    parts = [(r, tokens, found, pad) for r in writers]
                else:
                    rank = self.rows.rank_of(pos + self.first)
                    parts = [
                        (r, tokens[sel], found[sel], None if pad is None else pad[sel])
                        for r, sel in ((r, rank == r) for r in writers)
                        if sel.any()
                    ]
                for r, t, h, p in parts:
                    last = disk.submit(writers[r].write_tokens, t)
                    writers[r].write_index(t, h)
                    if p is not None:
                        writers[r].write_pad(p)
                written[c % 3] = last
                read_next((c + 2) % 3)
                kept += len(pos)
        return kept


RUN_HINT = "the run's file does not match its manifest: run `tokpack validate` on the run; nothing was staged from it"


def run_files(entry: dict, row_bytes: int) -> list[tuple[str, int]]:
    """(name, recorded bytes) of the files a node slice reads of one run shard: its tokens, and
    its row hashes and padding where it has them."""
    return [
        (entry["path"] + suffix, int(entry["samples"]) * row_bytes if suffix == "" else size)
        for suffix, size, _ in shard_files(entry)
        if suffix in ("", ROWS_SUFFIX, PAD_SUFFIX)
    ]


def check_run_files(src: Source, epochs: list[int], row_bytes: int) -> None:
    """Every run file the stage reads, through the gate (inside its epoch folder, a regular file,
    the size its manifest records), before anything is written: one linked out of the run, or
    longer or shorter than recorded, is one line and DEST is left as it was."""
    for e in epochs:
        rel = epoch_dir_name(e)
        m = src.manifest(rel, kind=EPOCH)
        refuse_tokens_on_nodes(src, rel, m)  # here, not in plan_slice: `plan stage --node` plans a replacement node
        for i, s in enumerate(m["shards"]):
            contained_shard(src.root / rel, s, i)
            if of_manifest(m).padded and not has_pad(s):  # found by tests/test_fuzz.py: staged as zero padding
                raise TokpackError(
                    "best-fit epoch shard lacks its padding sidecar: the slice would train on its padding as tokens",
                    file=src.at(f"{rel}/{MANIFEST}"),
                    where=f"shards[{i}].pad_xxh3_128",
                    expected="the checksum of its .ds.pad",
                    found="none",
                    hint=RUN_HINT,
                )
            for name, size in run_files(s, row_bytes):
                src.check(f"{rel}/{name}", size, what="run file", hint=RUN_HINT)


@dataclass
class SlicePlan:
    """What a node slice of a run costs, by arithmetic on its manifests (nothing read but them)."""

    ranks: tuple[int, int]
    world_size: int
    rows: RankRows
    run: dict
    epochs: list[int]
    kept: dict[int, int]  # epoch -> bytes of its rank files
    read: dict[int, int]  # epoch -> bytes the stage reads: the kept rows, plus row hashes or whole shards
    by_rows: dict[int, bool]  # epoch -> verified by row hashes (else by whole shards)
    written: dict[int, int] = field(default_factory=dict)  # epoch -> bytes on disk of all it writes (SLICE_FILES)
    root_bytes: int = 0  # bytes on disk of the slice's root manifest


# A slice epoch's manifest: a header with the run's identity, then one entry a rank (path, sizes,
# five checksums: about 450 bytes); counted at these generous sizes, before the entries exist.
SLICE_HEADER_BYTES = 1024
SLICE_ENTRY_BYTES = 1024


def slice_files(rows: int, row_bytes: int, fragments_per_row: float, padded: bool) -> int:
    """Bytes on disk of one rank file of `rows` rows and its sidecars: .ds, .ds.rows (8 B a row),
    .ds.pad (4 B a row, best-fit), .ds.metadata (a block) and .ds.index (8 B a fragment). The
    fragments are known only once the rows are read: counted at the epoch's mean per row, and
    at least one a row (each row ends one)."""
    index = U64.itemsize * max(rows, math.ceil(rows * fragments_per_row))
    return (
        on_disk(rows * row_bytes)
        + on_disk(U64.itemsize * rows)
        + on_disk(index)
        + on_disk(None)
        + (on_disk(PAD_DTYPE.itemsize * rows) if padded else 0)
    )


def plan_slice(
    src: Source,
    ranks=None,
    world_size: int | None = None,
    micro_batch: int = 1,
    node=None,
    ranks_per_node: int | None = None,
    start_sample: int = 0,
    epochs=None,
) -> SlicePlan:
    a, b, w = slice_ranks(ranks, world_size, node, ranks_per_node, micro_batch)
    rows = RankRows(w, micro_batch, start_sample)
    run = src.manifest("")
    if run["kind"] != RUN:
        raise TokpackError(
            "a node slice is staged from a run",
            file=src.path,
            where="kind",
            expected="run",
            found=run["kind"],
            hint="give the run directory (the one holding epoch-NNNNN/)",
        )
    numbering = EpochNumbering.of_run(run, src.path)
    chosen = listed_epochs(run, src.path, epochs)  # complete epochs only: a run being shuffled lists those
    row_bytes = row_bytes_of(run)
    kept, read, by_rows, written = {}, {}, {}, {}
    header = SLICE_HEADER_BYTES + len(canonical_bytes(run_identity(run)))
    for e in chosen:
        m = src.manifest(epoch_dir_name(e), kind=EPOCH)
        # another run's epoch, sliced beside this run's, would be fed as this run's
        refuse_epoch_of_another_run(run, src.path, e, m, src.at(f"{epoch_dir_name(e)}/{MANIFEST}"))
        first, n = numbering.first(e), numbering.size(e)
        per_rank = [rows.rows(r, first, first + n) for r in range(a, b + 1)]
        kept[e] = sum(per_rank) * row_bytes
        padded = of_manifest(m).padded
        per_row = int(m.get("fragments") or 0) / max(1, int(m.get("samples") or 0))
        written[e] = sum(slice_files(k, row_bytes, per_row, padded) for k in per_rank) + on_disk(
            header + SLICE_ENTRY_BYTES * len(per_rank)
        )
        by_rows[e] = all("rows_xxh3_128" in s for s in m.get("shards") or [])
        pad = sum(PAD_DTYPE.itemsize * int(s["samples"]) for s in m.get("shards") or [] if has_pad(s))
        read[e] = kept[e] + (8 * n if by_rows[e] else n * row_bytes) + pad
    return SlicePlan((a, b), w, rows, run, chosen, kept, read, by_rows, written, on_disk(header))


@locked_output("stage", arg="dest")
def stage_slice(directory, dest, *, epochs=None, workers: int = 4, log=None, **ranks) -> SliceResult:
    """Writes the node slice of ranks A..B of a run (local or any fsspec URL) into the local DEST;
    `ranks`: plan_slice's ranks, world_size, micro_batch, node, ranks_per_node and start_sample, by keyword."""
    t0 = time.perf_counter()
    dest = local_dest(dest)
    src = Source(str(directory))
    plan = plan_slice(src, epochs=epochs, **ranks)
    (a, b), w, rows, run, chosen = plan.ranks, plan.world_size, plan.rows, plan.run, plan.epochs
    numbering = EpochNumbering.of_run(run, src.path)
    root = slice_manifest(run, src.local_root or src.path, rows, a, b)
    previous = previous_slice(dest, root, src.path)
    row_bytes = row_bytes_of(run)
    check_run_files(src, chosen, row_bytes)
    dest.mkdir(parents=True, exist_ok=True)
    # Every file it writes: rank files with their sidecars, epoch manifests, the root manifest.
    check_space(
        [(dest, sum(plan.written[e] for e in chosen if e not in previous) + plan.root_bytes)],
        "stage",
        hint="free some space there, choose another DEST, or stage fewer epochs (--epochs)",
    )

    output: Output = LocalOutput()  # a node slice is written on the node (tokpack.formats.outputs: the shared sink)
    staged, in_place, verified_by, kept_rows = [], [], set(), 0
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        reads = _Reads(src, pool)
        try:
            for e in chosen:
                rel = epoch_dir_name(e)
                m, raw = src.manifest(rel, kind=EPOCH, raw=True)
                first = numbering.first(e)
                if int(m["samples"]) != numbering.size(e) or int(m["seq_len"]) != int(run["seq_len"]):
                    raise TokpackError(
                        "epoch does not belong to its run",
                        file=src.at(rel),
                        where="samples/seq_len",
                        expected=(numbering.size(e), run["seq_len"]),
                        found=(m.get("samples"), m.get("seq_len")),
                        hint="run `tokpack validate` on the run",
                    )
                want = slice_epoch_manifest(root, e, int(m["samples"]), first, raw)
                d = dest / rel
                if epoch_in_place(d, want):
                    in_place.append(e)
                    continue
                ready_epoch_dir(output, d)
                stager = _EpochStager(reads, rel, m, rows, (a, b), first)
                verified_by.add("row hashes" if stager.by_rows else "whole shards")
                if log and not stager.by_rows:
                    log(
                        f"stage: epoch {e} was written without row hashes (.ds.rows): verifying it by reading its "
                        f"shards whole, about {w / (b - a + 1):.0f}x the slice's bytes; rewrite the epoch with this "
                        "tokpack to stage only the slice"
                    )
                files = None
                try:
                    files = RankFiles(output, d, rows, first, (a, b), e, stager.format, mine=range(a, b + 1))
                    kept_rows += stager.run(files.writers)
                    entries = files.close()
                except BaseException as err:
                    if files is not None:  # (RankFiles removes its own when one fails to open)
                        files.abort()
                    if is_no_space(err):  # the rank files' temporaries are gone: the disk is not left full
                        raise TokpackError(
                            f"disk full while staging epoch {e}; its partial rank files were removed",
                            file=d,
                            expected="free space",
                            found="No space left on device",
                            hint="free some space there (or choose another DEST), then rerun the "
                            "same command: the epochs already staged are kept",
                        ) from None
                    raise
                want["shards"] = entries
                want["tokens"] = sum(s["tokens"] for s in entries)
                output.finish(d, want)
                staged.append(e)
                if log:
                    log(
                        f"stage: epoch {e}: {sum(s['samples'] for s in entries):,} rows of ranks {a}-{b} "
                        f"({want['tokens'] * int(run['token_size']) / 2**20:,.1f} MiB)"
                    )
        finally:
            reads.close()
    root["epochs"] = sorted(set(previous) | set(chosen))
    root["tokens"] = sum(int(small_json(dest / epoch_dir_name(e) / MANIFEST)["tokens"]) for e in root["epochs"])
    output.finish(dest, root)
    seconds = time.perf_counter() - t0
    kept = kept_rows * row_bytes
    if log:
        log(
            f"stage: slice of ranks {a}-{b} of {w} (micro-batch {rows.micro_batch}) at {dest}: "
            f"epochs {root['epochs']}, {len(staged)} staged, {len(in_place)} already in place; "
            f"read {reads.bytes / 2**20:,.1f} MiB for {kept / 2**20:,.1f} MiB kept"
        )
    return SliceResult(
        ok=True,
        kind=SLICE,
        source=src.path,
        dest=str(dest),
        ranks=root["ranks"],
        world_size=w,
        micro_batch=rows.micro_batch,
        batch_phase=rows.phase,
        epochs=root["epochs"],
        epochs_staged=staged,
        epochs_in_place=in_place,
        verified_by=", ".join(sorted(verified_by)),
        rows_kept=kept_rows,
        bytes_kept=kept,
        bytes_read=reads.bytes,
        read_amplification=round(reads.bytes / kept, 4) if kept else None,
        seconds=round(seconds, 3),
        mib_per_s=round(reads.bytes / 2**20 / seconds, 1) if seconds > 0 else None,
    )
