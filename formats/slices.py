"""Node slices (docs/FORMAT.md, "Node slices"): the rows that consecutive data-parallel ranks
A..B read, one plain file per rank and epoch, and the reader that serves them as the run does.

Which rows a rank reads is arithmetic on the run's consumed-sample numbers G (Megatron's
sampler): global batches are the samples [phase + k*W*m, phase + (k+1)*W*m) and rank r takes
[r*m, (r+1)*m) of each. `epoch-NNNNN/rank-RRRRR.ds` holds the samples of epoch NNNNN that rank
r reads, in increasing G: every one of them, also those of a global batch that spans into the
next epoch, so the file never depends on which epochs exist. A rank's sample G therefore sits
at row `count(r, G) - count(r, first(e))` of its epoch's file, in O(1).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Iterator

import numpy as np

from .errors import TokpackError
from .io import IO_BLOCK, as_path, open_read, read_full, read_limited, regular_size
from .manifest import (MANIFEST, MAX_MANIFEST_BYTES, check_manifest, dtype_from_name, epoch_dir_name, read_manifest,
                       row_hashes)
from .reader import OPENERS, EpochNumbering, SampleReader, ShardTable, _shard_error
from .shards import PAD_SUFFIX

SLICE = "slice"  # kind of a slice's root manifest
SLICE_EPOCH = "slice-epoch"  # kind of a slice epoch's manifest
# Run-manifest fields that change as epochs are written: not part of the run's identity.
RUN_SELECTION_KEYS = ("epochs", "tokens", "fragments", "documents")


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.ds"


def run_identity(run: dict) -> dict:
    """What a slice records of its run: every field but those that grow as epochs are written."""
    return {k: v for k, v in run.items() if k not in RUN_SELECTION_KEYS}


def stage_command(source: str, dest: str, first: int, last: int, world_size: int, micro_batch: int,
                  phase: int = 0) -> str:
    """The `tokpack stage` command that writes the slice of ranks first..last."""
    ranks = f"{first}" if first == last else f"{first}-{last}"
    cmd = (f"tokpack stage {shlex.quote(str(source))} {shlex.quote(str(dest))} --ranks {ranks} "
           f"--world-size {world_size} --micro-batch {micro_batch}")
    return cmd + (f" --start-sample {phase}" if phase else "")


class RankRows:
    """Which consumed-sample numbers each rank reads: W ranks, micro-batch m, global batches
    starting at G = phase (mod W*m). Pure arithmetic, a few integers."""

    def __init__(self, world_size: int, micro_batch: int, phase: int = 0):
        self.world_size, self.micro_batch = int(world_size), int(micro_batch)
        self.global_batch = self.world_size * self.micro_batch
        self.phase = int(phase) % self.global_batch

    def rank_of(self, g: int) -> int:
        return ((g - self.phase) % self.global_batch) // self.micro_batch

    def count(self, rank: int, g: int) -> int:
        """Samples rank `rank` reads below G (up to a constant: use differences)."""
        y = g - self.phase
        return (y // self.global_batch) * self.micro_batch + min(max(y % self.global_batch - rank * self.micro_batch, 0),
                                                                 self.micro_batch)

    def rows(self, rank: int, first: int, g: int) -> int:
        """Samples of rank `rank` in [first, g): the row of G in the file of an epoch starting at `first`."""
        return self.count(rank, g) - self.count(rank, first)

    def node_positions(self, first: int, n: int, ranks: tuple[int, int], max_rows: int) -> Iterator[np.ndarray]:
        """Positions within an epoch of `n` samples starting at G = `first` that ranks
        ranks[0]..ranks[1] read, in increasing order, in arrays of about `max_rows` (whole runs
        of (B-A+1)*m rows, one run per global batch)."""
        gb, k_rows = self.global_batch, (ranks[1] - ranks[0] + 1) * self.micro_batch
        off = self.phase + ranks[0] * self.micro_batch  # G of a run's first row, mod W*m
        k_lo = -((off + k_rows - 1 - first) // gb)  # first run ending after `first`
        k_hi = (first + n - 1 - off) // gb  # last run starting before the epoch's end
        if k_rows > max_rows:  # a run longer than a chunk (up to a global batch past the epoch): its rows in the epoch, a chunk at a time
            for k in range(k_lo, k_hi + 1):
                start = off - first + k * gb
                lo, hi = max(start, 0), min(start + k_rows, n)
                for c in range(lo, hi, max_rows):
                    yield np.arange(c, min(c + max_rows, hi), dtype=np.int64)
            return
        step = max_rows // k_rows
        span = np.arange(k_rows, dtype=np.int64)
        for k in range(k_lo, k_hi + 1, step):
            ks = np.arange(k, min(k + step, k_hi + 1), dtype=np.int64)
            pos = ((off - first) + ks * gb)[:, None] + span
            pos = pos.ravel()
            yield pos[(pos >= 0) & (pos < n)]


def slice_error(message: str, path, manifest: dict, rank: int, world_size: int, micro_batch: int,
                phase: int) -> TokpackError:
    """One line: what the slice holds, and the command that restages this node, in place of the
    slice, for the stream asked for: the slice's count of ranks, the one holding `rank`."""
    ranks = manifest["ranks"]
    source = manifest.get("source") or "RUN"
    k = len(ranks)
    first = max(0, ranks[0] + (rank - ranks[0]) // k * k)
    last = min(first + k, world_size) - 1
    here = str(path).rstrip("/")
    return TokpackError(message, file=path, where="rank/world_size/micro_batch",
                        expected=f"ranks {ranks[0]}-{ranks[-1]} of world size {manifest['world_size']}, "
                                 f"micro-batch {manifest['micro_batch']}"
                                 + (f", global batches from sample {manifest['batch_phase']} mod W*m"
                                    if manifest["batch_phase"] else ""),
                        found=f"rank {rank} of world size {world_size}, micro-batch {micro_batch}",
                        hint=f"restage this node's slice for that stream: `rm -r {shlex.quote(here)} && "
                             + stage_command(source, here, first, last, world_size, micro_batch, phase) + "`")


def missing_padding(path: Path, root: dict, entry: dict) -> TokpackError | None:
    """The error for a rank file of a best-fit run's slice without its `.ds.pad` (staged before
    slices carried it): read anyway, its padding would be trained on as tokens."""
    packing = root.get("run", {}).get("packing") if isinstance(root.get("run"), dict) else None
    if not isinstance(packing, dict) or packing.get("method") != "best-fit" or "pad_xxh3_128" in entry:
        return None
    ranks = root.get("ranks") or [0]
    return TokpackError("node slice of a best-fit run lacks the padding of its rows (.ds.pad)", file=path / MANIFEST,
                        where=f"shards[rank {entry.get('rank')}].pad_xxh3_128", expected="the rank file's padding sidecar",
                        found="none (staged by a tokpack before slices carried it)",
                        hint="stage it again, which rewrites the epochs lacking it: `" + stage_command(
                            root.get("source") or "RUN", str(path.parent), ranks[0], ranks[-1], root.get("world_size"),
                            root.get("micro_batch"), root.get("batch_phase") or 0) + "`")


def check_slice_epoch(path: Path, root: dict, m: dict) -> None:
    """An epoch manifest of a slice must describe the slice its root describes."""
    for key in ("world_size", "micro_batch", "ranks", "batch_phase", "run", "seq_len", "dtype"):
        if m.get(key) != root.get(key):
            raise TokpackError("slice epoch belongs to another slice", file=path / MANIFEST, where=key,
                               expected=root.get(key) if key != "run" else "the root's run",
                               found=m.get(key) if key != "run" else "another run",
                               hint="stage the slice again into an empty directory")


class SliceReader(SampleReader):
    """A SampleReader over a node slice: the run's consumed-sample numbers, the rows of its ranks only."""

    @classmethod
    def open_slice(cls, path: str | Path, root: dict, verify: bool = False) -> "SliceReader":
        path = as_path(path)
        ranks = [int(r) for r in root["ranks"]]
        numbering = EpochNumbering.of_run(root["run"], path)
        rows = RankRows(root["world_size"], root["micro_batch"], root["batch_phase"])
        row_bytes = (int(root["seq_len"]) + 1) * int(root["token_size"])
        paths, checksums, index_checksums, starts, ends, epochs, dirs = [], [], [], [], [], [], []
        pads: list[tuple[str, str] | None] = []  # per rank file: a best-fit epoch's (.pad file, its xxh3_128)
        for e in sorted(int(e) for e in root.get("epochs") or []):
            d = path / epoch_dir_name(e)
            m = read_manifest(d, kind=SLICE_EPOCH)
            check_slice_epoch(d, root, m)
            first, n = numbering.first(e), numbering.size(e)
            if (int(m["epoch"]), int(m["first_sample"]), int(m["samples"])) != (e, first, n):
                raise TokpackError("slice epoch disagrees with its run's numbering", file=d / MANIFEST,
                                   where="epoch/first_sample/samples", expected=(e, first, n),
                                   found=(m.get("epoch"), m.get("first_sample"), m.get("samples")))
            by_rank = {int(s["rank"]): s for s in m["shards"]}
            for r in ranks:
                s = by_rank.get(r)
                f = d / rank_file_name(r)
                want = rows.rows(r, first, first + n) * row_bytes
                if s is None or s.get("path") != f.name or int(s.get("bytes", -1)) != want:
                    raise TokpackError("slice epoch lacks a rank's file", file=d / MANIFEST, where=f"rank {r}",
                                       expected=f"{f.name}, {want} bytes", found=s, hint="stage the slice again")
                try:
                    size = regular_size(f)  # a FIFO or device in its place: refused here, in one line
                except FileNotFoundError:
                    raise _shard_error("rank file listed in the slice manifest is missing", f,
                                       hint="stage the slice again: the same command resumes") from None
                if size != want:
                    raise _shard_error("rank file size does not match the slice manifest", f, where="size",
                                       expected=f"{want} bytes", found=f"{size} bytes",
                                       hint="stage the slice again: the same command resumes")
                err = missing_padding(d, root, s)
                if err is not None:
                    raise err
                paths.append(str(f))
                checksums.append(s.get("xxh3_128"))
                index_checksums.append(s.get("index_xxh3_128"))
                pads.append((str(f) + PAD_SUFFIX, s["pad_xxh3_128"]) if "pad_xxh3_128" in s else None)
            starts.append(first)
            ends.append(first + n)
            epochs.append(e)
            dirs.append(str(d))
        if not epochs:
            raise TokpackError("node slice holds no epoch", file=path / MANIFEST, where="epochs",
                               expected="a non-empty list", found=root.get("epochs"), hint="stage the slice again")
        starts_a, ends_a = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
        table = ShardTable(paths, np.repeat(starts_a, len(ranks)), np.repeat(ends_a, len(ranks)), starts_a, ends_a,
                           epochs, dirs, checksums, index_checksums)
        reader = cls(table, int(root["seq_len"]), dtype_from_name(root["dtype"]), int(root["eos_id"]), verify=verify)
        reader.numbering = numbering
        reader.pads = pads if any(pads) else None
        reader.run = (root.get("source") or str(path), root["run"])
        reader.slice_path, reader.slice = str(path), root
        reader.rank_rows, reader.slice_ranks = rows, ranks
        return reader

    def serves(self, rank: int, world_size: int, micro_batch: int, start: int) -> None:
        """Refuses, in one line, a stream this slice does not hold."""
        rr = self.rank_rows
        if (world_size, micro_batch) != (rr.world_size, rr.micro_batch) or rank not in self.slice_ranks:
            raise slice_error("this node slice does not hold that rank's rows", self.slice_path, self.slice, rank,
                              world_size, micro_batch, start % (world_size * micro_batch))
        if start % rr.global_batch != rr.phase:
            raise slice_error(f"this node slice serves global batches starting at samples = {rr.phase} mod "
                              f"{rr.global_batch}, not at {start}", self.slice_path, self.slice, rank, world_size,
                              micro_batch, start % rr.global_batch)

    def _segments(self, g: int, n: int) -> Iterator[tuple[int, int, int]]:
        """Chained rows [g, g+n) -> (rank file, row in it, rows): split at epoch ends and where
        the rank changes; a row of a rank outside the slice is an error."""
        rr, table, k_ranks = self.rank_rows, self.table, len(self.slice_ranks)
        while n > 0:
            pos = table.epoch_pos_of(g)
            if pos < 0:
                raise IndexError(f"sample {g} is in no epoch of this slice")
            r = rr.rank_of(g)
            if r not in self.slice_ranks:
                raise slice_error(f"sample {g} is read by rank {r}, which this node slice does not hold",
                                  self.slice_path, self.slice, r, rr.world_size, rr.micro_batch, rr.phase)
            k = min(n, int(table.epoch_ends[pos]) - g, rr.micro_batch - (g - rr.phase) % rr.micro_batch)
            yield pos * k_ranks + (r - self.slice_ranks[0]), rr.rows(r, int(table.epoch_starts[pos]), g), k
            g += k
            n -= k


# ------------------------------------------------------------------ validate


def slice_shard_jobs(path: Path, root: dict, rep, quick: bool) -> list:
    """`tokpack validate SLICE`: the slice's manifests agree with each other and with the rank
    arithmetic; returns the rank files' checks (every file an epoch-shard check: sizes, index,
    metadata, row hashes, checksums) for tokpack.formats.dir_checks to run. Problems go into `rep`."""
    from .shard_scan import ShardJob

    jobs = []
    try:
        numbering = EpochNumbering.of_run(root["run"], path)
        rows = RankRows(root["world_size"], root["micro_batch"], root["batch_phase"])
        dtype, row = dtype_from_name(root["dtype"]), int(root["seq_len"]) + 1
        ranks = [int(r) for r in root["ranks"]]
        epochs = [int(e) for e in root["epochs"]]
    except (KeyError, TypeError, ValueError, TokpackError) as e:
        rep.add(path / MANIFEST, getattr(e, "where", None) or str(e), "a slice manifest's fields", "missing or malformed",
                "slice manifest unusable")
        return []
    if not ranks or ranks != list(range(ranks[0], ranks[0] + len(ranks))):
        rep.add(path / MANIFEST, "ranks", "consecutive ranks A..B", ranks, "slice ranks not consecutive")
        return []
    for e in epochs:
        d = path / epoch_dir_name(e)
        try:
            m = read_manifest(d, kind=SLICE_EPOCH, checked=False)  # every problem reported, not the first
        except TokpackError as err:
            rep.add(err.file or d / MANIFEST, err.where, err.expected, err.found, err.message)
            continue
        if not check_manifest(m, d, rep.add):
            continue
        try:
            check_slice_epoch(d, root, m)
        except TokpackError as err:
            rep.add(err.file or d / MANIFEST, err.where, err.expected, err.found, err.message)
            continue
        first, n = numbering.first(e), numbering.size(e)
        if (m.get("epoch"), m.get("first_sample"), m.get("samples")) != (e, first, n):
            rep.add(d / MANIFEST, "epoch/first_sample/samples", (e, first, n),
                    (m.get("epoch"), m.get("first_sample"), m.get("samples")), "slice epoch disagrees with its run's numbering")
            continue
        entries = m.get("shards") if isinstance(m.get("shards"), list) else []
        if [s.get("rank") for s in entries] != ranks or [s.get("path") for s in entries] != [rank_file_name(r) for r in ranks]:
            rep.add(d / MANIFEST, "shards", [rank_file_name(r) for r in ranks], [s.get("path") for s in entries],
                    "slice epoch does not list one file per rank, in rank order")
            continue
        for r, s in zip(ranks, entries):
            want = rows.rows(r, first, first + n)
            if s.get("samples") != want:
                rep.add(d / MANIFEST, f"shards[rank {r}].samples", f"{want} (the samples rank {r} reads in epoch {e})",
                        s.get("samples"), "rank file holds the wrong number of samples")
                continue
            err = missing_padding(d, root, s)
            if err is not None:
                rep.add(err.file, err.where, err.expected, err.found, err.message, hint=err.hint)
            jobs.append(ShardJob(d, s, "epoch", dtype, int(root["vocab_size"]), int(root["eos_id"]), root["tokenizer"],
                                 row, quick))
    return jobs


class _RunShards:
    """The run epoch's per-row facts, one shard at a time (each checked against the epoch's
    manifest; the last two kept): row hashes from `.ds.rows`, or for an epoch written before
    them from its shard read in blocks; padding from `.ds.pad`. Memory: 12 bytes a row of two shards."""

    def __init__(self, directory: Path, manifest: dict, row_bytes: int):
        self.dir, self.shards, self.row_bytes = directory, manifest["shards"], row_bytes
        self.per = int(manifest["shard_samples"])
        self._hashes: dict[int, np.ndarray] = {}
        self._pads: dict[int, np.ndarray] = {}

    def _sidecar(self, i: int, suffix: str, key: str, dtype) -> np.ndarray:
        import xxhash

        s = self.shards[i]
        f = self.dir / (s["path"] + suffix)
        data = read_limited(f, int(s["samples"]) * np.dtype(dtype).itemsize, "sidecar")
        if xxhash.xxh3_128_hexdigest(data) != s[key]:
            raise TokpackError("checksum mismatch in the run", file=f, where="xxh3_128", expected=s[key],
                               found=xxhash.xxh3_128_hexdigest(data), hint="run `tokpack validate` on the run")
        return np.frombuffer(data, dtype=dtype)

    def hashes(self, i: int) -> np.ndarray:
        if i not in self._hashes:
            import xxhash

            from .shards import ROWS_SUFFIX, U64

            s = self.shards[i]
            if "rows_xxh3_128" in s:
                got = self._sidecar(i, ROWS_SUFFIX, "rows_xxh3_128", U64)
            else:  # an epoch written before row hashes: the shard in blocks of whole rows
                f, n = self.dir / s["path"], int(s["samples"])
                got, whole = np.empty(n, dtype=U64), xxhash.xxh3_128()
                k = max(1, IO_BLOCK // self.row_bytes)
                buf = np.empty((k, self.row_bytes), dtype=np.uint8)
                with open_read(f) as fh:
                    for a in range(0, n, k):
                        b = min(n, a + k)
                        view = memoryview(buf[: b - a].reshape(-1))
                        if read_full(fh, view) != view.nbytes:
                            raise TokpackError("shard is shorter than its manifest says", file=f,
                                               where=f"sample {a}", hint="run `tokpack validate` on the run")
                        whole.update(view)
                        got[a:b] = row_hashes(buf[: b - a])
                if whole.hexdigest() != s["xxh3_128"]:
                    raise TokpackError("checksum mismatch in the run", file=f, where="xxh3_128", expected=s["xxh3_128"],
                                       found=whole.hexdigest(), hint="run `tokpack validate` on the run")
            self._hashes = {k: v for k, v in self._hashes.items() if k > i - 2}  # positions only increase
            self._hashes[i] = got
        return self._hashes[i]

    def pads(self, i: int) -> np.ndarray:
        if i not in self._pads:
            from .shards import PAD_DTYPE

            s = self.shards[i]
            self._pads = {k: v for k, v in self._pads.items() if k > i - 2}
            self._pads[i] = (self._sidecar(i, PAD_SUFFIX, "pad_xxh3_128", PAD_DTYPE) if "pad_xxh3_128" in s
                             else np.zeros(int(s["samples"]), dtype=PAD_DTYPE))
        return self._pads[i]

    def gather(self, pos: np.ndarray, of) -> np.ndarray:
        """`of(shard)[row]` of epoch positions `pos` (increasing)."""
        shard = pos // self.per
        return np.concatenate([of(int(i))[pos[shard == i] - i * self.per] for i in np.unique(shard)]
                              or [of(0)[:0]])


def slice_against_run(path: Path, root: dict, run_path, rep, block: int = IO_BLOCK) -> None:
    """`tokpack validate SLICE --against RUN`: each rank file holds exactly the run's samples
    that rank reads, in order: its rows' xxh3-64, position by position, against the run's
    row hashes (`.ds.rows`, or the run's shards for an epoch written before them), and a
    best-fit slice's `.ds.pad` against the run's. Rank files are read in blocks of about
    `block` bytes: memory does not grow with the slice."""
    import xxhash

    run_path = as_path(run_path)
    try:
        run = read_manifest(run_path, kind="run")
    except TokpackError as e:
        rep.add(e.file or run_path, e.where, e.expected, e.found, e.message)
        return
    if run_identity(run) != root.get("run"):
        rep.add(path / MANIFEST, "run", f"the run at {run_path}", "another run (seed, sources or plan differ)",
                "slice was not staged from this run")
        return
    rows = RankRows(root["world_size"], root["micro_batch"], root["batch_phase"])
    numbering = EpochNumbering.of_run(run, run_path)
    row_bytes = (int(root["seq_len"]) + 1) * int(root["token_size"])
    buf = np.empty((max(1, block // row_bytes, rows.micro_batch), row_bytes), dtype=np.uint8)  # a chunk: whole micro-batches
    for e in root["epochs"]:
        d, rd = path / epoch_dir_name(e), run_path / epoch_dir_name(e)
        try:
            m = read_manifest(d, kind=SLICE_EPOCH)
            raw = read_limited(rd / MANIFEST, MAX_MANIFEST_BYTES, "manifest")
        except (TokpackError, OSError) as err:
            rep.add(getattr(err, "file", None) or rd, None, "a readable manifest", str(err), "cannot compare epoch")
            continue
        if xxhash.xxh3_128_hexdigest(raw) != m.get("epoch_xxh3_128"):
            rep.add(d / MANIFEST, "epoch_xxh3_128", m.get("epoch_xxh3_128"), xxhash.xxh3_128_hexdigest(raw),
                    f"slice epoch {e} was staged from another version of the run's epoch")
            continue
        shards = _RunShards(rd, read_manifest(rd, kind="epoch"), row_bytes)
        first, n = numbering.first(e), numbering.size(e)
        for s in m["shards"]:
            r = int(s["rank"])
            f = d / s["path"]
            try:
                _against_rank_file(f, s, r, e, rows, first, n, shards, buf, row_bytes, rep)
            except TokpackError as err:
                rep.add(err.file or f, err.where, err.expected, err.found, err.message, hint=err.hint)
            except OSError as err:
                rep.add(err.filename or f, None, "a readable rank file and run", err.strerror, "cannot compare rank file")


def _against_rank_file(f: Path, s: dict, r: int, e: int, rows: RankRows, first: int, n: int, shards: _RunShards,
                       buf: np.ndarray, row_bytes: int, rep) -> None:
    """One rank file (and its `.ds.pad`) against the run's rows rank r reads in epoch e, block by block."""
    from .shards import PAD_DTYPE

    want_rows = rows.rows(r, first, first + n)
    size = regular_size(f)
    if size != want_rows * row_bytes:
        rep.add(f, "size", f"{want_rows * row_bytes} bytes ({want_rows} samples of rank {r})", f"{size} bytes",
                "rank file does not hold that rank's samples")
        return
    # a rank file of a best-fit run without one is reported by the slice's own checks (missing_padding)
    pad_file = open_read(f.with_name(f.name + PAD_SUFFIX)) if "pad_xxh3_128" in s else None
    pad_buf = np.empty(len(buf), dtype=PAD_DTYPE)
    done, bad_rows, bad_pads, first_bad, first_pad = 0, 0, 0, None, None
    try:
        with open_read(f) as fh:
            for pos in rows.node_positions(first, n, (r, r), len(buf)):
                k = len(pos)
                if not k:
                    continue
                view = memoryview(buf[:k].reshape(-1))
                if read_full(fh, view) != view.nbytes:
                    raise TokpackError("rank file ended early", file=f, where=f"row {done}")
                found, want = row_hashes(buf[:k]), shards.gather(pos, shards.hashes)
                bad = np.flatnonzero(found != want)
                if len(bad) and first_bad is None:
                    j = int(bad[0])
                    first_bad = (done + j, int(want[j]), int(pos[j]), int(found[j]))
                bad_rows += len(bad)
                if pad_file is not None:
                    pv = memoryview(pad_buf[:k].view(np.uint8))
                    got = read_full(pad_file, pv)
                    wp = shards.gather(pos, shards.pads)
                    bad = np.flatnonzero(pad_buf[:k] != wp) if got == pv.nbytes else np.arange(k)
                    if len(bad) and first_pad is None:
                        j = int(bad[0])
                        first_pad = (done + j, int(wp[j]), int(pos[j]), int(pad_buf[j]) if got == pv.nbytes else "end of file")
                    bad_pads += len(bad)
                done += k
    finally:
        if pad_file is not None:
            pad_file.close()
    if first_bad is not None:
        k, want, p, found = first_bad
        rep.add(f, f"row {k}", f"{want:016x} (run epoch {e}, sample {p})", f"{found:016x}",
                f"rank file row differs from the run's sample rank {r} reads there"
                + (f" ({bad_rows} rows differ)" if bad_rows > 1 else ""))
    if first_pad is not None:
        k, want, p, found = first_pad
        rep.add(f.with_name(f.name + PAD_SUFFIX), f"row {k}", f"{want} padding tokens (run epoch {e}, sample {p})",
                found, "rank file padding differs from the run's" + (f" ({bad_pads} rows differ)" if bad_pads > 1 else ""))


OPENERS[SLICE] = SliceReader.open_slice
