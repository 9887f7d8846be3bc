"""A node's rows rebuilt from the sources alone, for a RUN `shuffle --to-nodes` wrote (issue 33,
items 3 and 6): the positions a node's ranks read (tokpack.formats.slices.RankRows), the source
tokens the plan puts there (windows: ranged reads of the sources; best-fit: rows assembled from
the row table), each row checked against RUN's row hashes (`.ds.rows`, and best-fit `.ds.pad`).

`stage RUN DEST --node n/N` on such a RUN (a replacement node) is `stage_replacement`: the rows
fed, in increasing position, to the rank files of tokpack.packer.rank_files.RankFiles, so its
bytes are the exchange's; DEST and RUN's manifests as tokpack.packer.stage_dest reads them.
"""

from __future__ import annotations

import pickle
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokpack.formats.errors import TokpackError
from tokpack.formats.constants import EPOCH, MANIFEST, PAD_DTYPE, SLICE, WORK_DIR
from tokpack.formats.guard import OutputLock, holder_name
from tokpack.formats.io.gate import open_files_share, read_limited
from tokpack.formats.names import EPOCH_DIR_PREFIX, epoch_dir_name
from tokpack.formats.reading import parse_manifest
from tokpack.formats.hashes import row_hashes
from tokpack.formats.numbering import EpochNumbering
from tokpack.formats.outputs import EpochShardFormat, LocalOutput, Output
from tokpack.formats.constants import PAD_SUFFIX, ROWS_SUFFIX
from tokpack.formats.shards import RowFacts, tokens_on_nodes
from tokpack.formats.slices import RankRows, slice_epoch_manifest
from tokpack.packer.kept_sources import file_xxh3_128
from tokpack.packer.lifetime import children_bound, set_parent_death_signal
from tokpack.packer.rank_files import RankFiles, ready_epoch_dir
from tokpack.packer.shared import Result
from tokpack.packer.stage_dest import epoch_in_place, finish_slice_root, own_dest, read_raw, slice_root_of_run
from tokpack.packer.run_checks import refuse_epoch_of_another_run
from tokpack.packer.stage_plan import listed_epochs, slice_ranks
from tokpack.packer.source_reads import SourceReader
from tokpack.shuffle import packings
from tokpack.shuffle.sources import open_source

# Best-fit: the fewest shard files its reader (asking the kernel for pieces, one thread) and its
# TokenPool (mapping them) each hold, whatever the open-files limit: each half the gate's share.
MIN_SHARE = 16


@dataclass
class ReplacementResult(Result):
    """What `stage RUN DEST --node n/N` on a --to-nodes RUN prints with --json."""

    kind: str
    source: str
    dest: str
    ranks: list[int]
    world_size: int
    micro_batch: int
    epochs: list[int]
    built_from: str  # "sources": no token file in RUN
    # the rows' source tokens (and the small gaps read with them), RUN's row hashes (and best-fit padding)
    bytes_read: int
    reads: int  # the ranged reads of the sources (windows; best-fit rows are copied from mapped shards)
    read_depth: int  # the most reads in flight at once (READ_DEPTH allows)
    bytes_kept: int
    read_amplification: float | None
    parts: int  # the node's rows are read and written a part at a time, each of at most part_rows rows
    part_rows: int  # what --memory allows (part_rows_of)
    seconds: float


def exchanged_run(run_dir) -> bool:
    """Whether RUN was written by --to-nodes: its epochs hold row hashes and no token file."""
    for m in sorted(Path(run_dir).glob(f"{EPOCH_DIR_PREFIX}*/{MANIFEST}")):
        shards = parse_manifest(read_raw(m), m, EPOCH).get("shards") or []
        if shards:
            return tokens_on_nodes(m.parent, shards)
    return False


def stage_replacement(
    run_dir,
    dest,
    *,
    node,
    ranks_per_node: int,
    micro_batch: int,
    epochs=None,
    log=None,
    memory: int | None = None,
    workers: int = 1,
) -> "ReplacementResult":
    """`tokpack stage RUN DEST --node n/N --ranks-per-node K --micro-batch m` on a RUN --to-nodes
    wrote: node n's slice built from the sources alone (SourceRows), a part of at most
    `part_rows_of(memory)` rows at a time, each part's rows verified against RUN's row hashes
    (and best-fit padding) and fed to the rank files in increasing position; the exchange's bytes.
    `workers` processes (`stage --workers`) rebuild it at once, each the rank files of a share of
    the node's ranks within `memory // workers`: a node's CPU, as its exchange's P processes."""
    t0 = time.perf_counter()
    memory = DEFAULT_MEMORY if memory is None else int(memory)
    out, dest = Path(run_dir), Path(dest)
    a, b, w = slice_ranks(node=node, ranks_per_node=ranks_per_node, micro_batch=micro_batch)
    RankRows(w, micro_batch, 0)  # its checks, before DEST is locked
    with OutputLock(str(dest), holder_name("stage")):
        previous = own_dest(dest, out, (a, b), w, micro_batch)
        run, root = slice_root_of_run(out, (a, b), w, micro_batch)
        numbering = EpochNumbering.of_run(run, out)
        chosen = listed_epochs(run, str(out), epochs)
        for e in chosen:  # each epoch this run's, before anything is written (another run's would be rebuilt as its)
            path = out / epoch_dir_name(e) / MANIFEST
            refuse_epoch_of_another_run(run, str(out), e, parse_manifest(read_raw(path), path, EPOCH), str(path))
        output: Output = LocalOutput()
        read = kept = parts = per_part = reads = depth = 0
        for e in chosen:
            d = dest / epoch_dir_name(e)
            first = numbering.first(e)
            epoch_dir = out / epoch_dir_name(e)
            raw = read_raw(epoch_dir / MANIFEST)
            m = parse_manifest(raw, epoch_dir / MANIFEST, EPOCH)
            want = slice_epoch_manifest(root, e, int(m["samples"]), first, raw)
            if e in previous and epoch_in_place(d, want):
                continue
            job = (out, dest, e, (a, b), w, micro_batch, first, memory)
            entries, got = _rebuild_epoch(job, workers)
            read, kept, parts = read + got["bytes_read"], kept + got["bytes_kept"], parts + got["parts"]
            reads, depth, per_part, done = reads + got["reads"], max(depth, got["depth"]), got["part_rows"], got["rows"]
            want["shards"], want["tokens"] = entries, sum(x["tokens"] for x in entries)
            output.finish(d, want)
            if log:
                log(
                    f"stage: epoch {e}: {done:,} rows of ranks {a}-{b} rebuilt from the sources, "
                    f"in parts of at most {per_part:,} rows (--memory)"
                )
        finish_slice_root(output, dest, root, set(previous) | set(chosen))
    return ReplacementResult(
        kind=SLICE,
        source=str(out),
        dest=str(dest),
        ranks=root["ranks"],
        world_size=w,
        micro_batch=micro_batch,
        epochs=root["epochs"],
        built_from="sources",
        bytes_read=read,
        reads=reads,
        read_depth=depth,
        bytes_kept=kept,
        read_amplification=round(read / kept, 4) if kept else None,
        parts=parts,
        part_rows=per_part,
        seconds=round(time.perf_counter() - t0, 3),
    )


def _rebuild_epoch(job: tuple, workers: int) -> tuple[list[dict], dict]:
    """One epoch of a replacement node: its rank files' entries (in rank order) and the figures
    of their rebuilding, by `workers` processes (spawned: a forked copy of a threaded parent is
    not safe), process p writing the files of ranks r with (r - a) mod workers = p."""
    out, dest, e, ranks, *_ = job
    K = ranks[1] - ranks[0] + 1
    P = max(1, min(workers, K))
    if P == 1:
        return _rebuild_ranks(job, 0, 1)
    ready_epoch_dir(LocalOutput(), dest / epoch_dir_name(e))
    procs: list[subprocess.Popen] = []
    try:
        # Each in a session of its own: a Ctrl-C reaches the command's process group, whose
        # process alone answers it (one line, then it stops these); bound to it by lifetime.
        with children_bound():
            for p in range(P):
                cmd = [sys.executable, "-m", "tokpack.packer.replacement"]
                procs.append(
                    subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
                )
        for p, proc in enumerate(procs):
            proc.stdin.write(pickle.dumps((job, p, P)))
            proc.stdin.close()
        parts = []
        for proc in procs:  # what each sent back (our own child: its pickle is ours)
            kind, value = pickle.load(proc.stdout)
            if kind == "error":  # raised here as the command's one line
                raise value
            parts.append(value)
    except BaseException:  # Ctrl-C, SIGTERM or one process's error: the others stop now
        for proc in procs:
            proc.kill()
        raise
    finally:
        for proc in procs:
            proc.wait()
        shutil.rmtree(dest / WORK_DIR, ignore_errors=True)
    entries = sorted((x for got, _ in parts for x in got), key=lambda x: x["rank"])
    figures = {k: sum(f[k] for _, f in parts) for k in ("bytes_read", "bytes_kept", "parts", "reads", "rows")}
    figures.update(depth=sum(f["depth"] for _, f in parts), part_rows=max(f["part_rows"] for _, f in parts))
    return entries, figures


def _rebuild_ranks(job: tuple, p: int, P: int) -> tuple[list[dict], dict]:
    """Process p of P: the rank files of its share of the node's ranks (all of them, P = 1)."""
    out, dest, e, ranks, w, micro_batch, first, memory = job
    epoch_dir, rows = out / epoch_dir_name(e), RankRows(w, micro_batch, 0)
    m = parse_manifest(read_raw(epoch_dir / MANIFEST), epoch_dir / MANIFEST, EPOCH)
    # P > 1: a folder of its own below the epoch's (SourceRows.close removes its `work`, or the
    # whole scratch when `work` is its child: the other processes' too)
    work = dest / WORK_DIR / f"replace-{epoch_dir_name(e)}"
    work = work if P == 1 else work / f"process-{p}"
    mine = None if P == 1 else [r for r in range(ranks[0], ranks[1] + 1) if (r - ranks[0]) % P == p]
    source = SourceRows(epoch_dir, m, memory // P, work)
    figures = {"parts": 0, "rows": 0, "bytes_kept": 0}
    try:
        files = RankFiles(LocalOutput(), dest / epoch_dir_name(e), rows, first, ranks, e, source.format, mine)
        try:
            for positions in rows.node_positions(first, source.plan.samples, ranks, source.part_rows):
                if mine is not None and len(positions):
                    positions = positions[(rows.rank_of(positions + first) - ranks[0]) % P == p]
                if not len(positions):
                    continue
                tokens, pad = source.rows(positions)
                source.check(positions, tokens, pad)
                files.add(positions, tokens, pad)
                figures["parts"] += 1
                figures["rows"] += len(positions)
                figures["bytes_kept"] += tokens.nbytes
            entries = files.close()
        except BaseException:
            files.abort()
            raise
    finally:
        source.close()
    figures.update(
        bytes_read=source.bytes_read,
        reads=source.reader.reads,
        depth=source.reader.max_in_flight,
        part_rows=source.part_rows,
    )
    return entries, figures


# Best-fit: the runs (a global batch's rows each) whose pieces are asked of the kernel before
# the run being copied: their reads in flight while it is.
LOOKAHEAD_RUNS = 4
DEFAULT_MEMORY = 256 << 20  # a replacement node's (and validate --against RUN's) budget without --memory
# Bytes a part holds per row beside its tokens twice (read order, then position order): its
# position, source, window and start (int64 each), the row hash, the sort's and gather's indices.
PART_ROW_OVERHEAD = 96
# Bytes kept aside from --memory for what does not grow with a part: RUN's row hashes and padding
# of one epoch shard at a time, the open files, the interpreter's temporaries.
PART_FIXED = 1 << 16


def part_rows_of(row_bytes: int, memory: int) -> int:
    """Rows of one part: its rows twice (as read, in source order, and in position order) and
    their arithmetic within `memory`; fewer than one row is refused with one line."""
    n = (memory - PART_FIXED) // (2 * row_bytes + PART_ROW_OVERHEAD)
    if n < 1:
        raise TokpackError(
            "--memory is too small to rebuild a row from the sources",
            where="--memory",
            expected=f">= {PART_FIXED + 2 * row_bytes + PART_ROW_OVERHEAD} bytes",
            found=f"{memory} bytes",
            hint="give more --memory (256MiB by default)",
        )
    return int(n)


class SourceRows:
    """An epoch of a --to-nodes RUN, its rows at given positions rebuilt from the sources alone
    (RUN's plan: its epoch manifest): a replacement node's reads, and `validate SLICE --against
    RUN`'s proof. Windows: each part's windows read in source order, a window the part uses
    twice once, adjacent windows (and windows a small gap apart) merged into one ranged read,
    READ_DEPTH reads in flight (tokpack.packer.source_reads; files kept open from part to part). Best-fit: the row table rebuilt in `work` (checked against the manifest's
    table_xxh3_128), rows assembled per run of consecutive positions from their documents.
    `bytes_read` counts the source tokens read and RUN's row hashes and padding."""

    def __init__(self, epoch_dir: Path, m: dict, memory: int, work: Path):
        packing = packings.of_manifest(m)
        self.epoch_dir, self.m, self.work, self.packing = Path(epoch_dir), m, Path(work), packing
        self.padded = packing.padded  # rows from the row table's pieces, and their padding
        self.sources = [open_source(src["path"]) for src in m["sources"] if int(src["samples"]) or self.padded]
        self.dtype = self.sources[0].dtype
        self.plan = packing.from_manifest(m, self.sources, memory)
        self.row = self.plan.row_tokens
        self.part_rows = part_rows_of(self.row * self.dtype.itemsize, memory)
        self.format = EpochShardFormat(
            self.dtype, int(m["seq_len"]), int(m["eos_id"]), m["tokenizer"], padded=self.padded
        )
        # windows: what each plan source's windows are read from (EpochPlan.stream: --holdout's kept stream)
        self.of_plan = []
        if not self.padded:
            by_fingerprint = {src.fingerprint: src for src in self.sources}
            found = [by_fingerprint.get(sp.fingerprint) for sp in self.plan.sources]
            self.of_plan = [None if src is None else self.plan.stream(i, src) for i, src in enumerate(found)]
        self.reader = SourceReader()  # its descriptors kept from part to part
        self.bytes_read = 0
        # RUN's row hashes and padding, each file read through the gate and checked against the manifest
        self.facts = RowFacts(
            m,
            self.row * self.dtype.itemsize,
            self._run_file,
            str(self.epoch_dir),
            "rerun the --to-nodes command that wrote the run",
        )
        self.built = self.pool = None
        if self.padded:
            self._rebuild_table(packing, memory)

    def _rebuild_table(self, packing, memory: int) -> None:
        from tokpack.shuffle.epoch_job import EpochJob

        m = self.m
        job = EpochJob(
            self.plan,
            tuple(str(src.path) for src in self.sources),
            m["dtype"],
            int(m["eos_id"]),
            m["tokenizer"],
            str(self.epoch_dir),
            str(self.work),
            int(m["shard_samples"]),
        )
        prepared = packing.prepare(job, memory)
        if prepared["table_xxh3_128"] != m["packing"]["table_xxh3_128"]:
            raise TokpackError(
                "the row table rebuilt from the sources is not the run's",
                file=self.epoch_dir / MANIFEST,
                where="packing.table_xxh3_128",
                expected=m["packing"]["table_xxh3_128"],
                found=prepared["table_xxh3_128"],
                hint="the sources changed since the run was shuffled",
            )
        self.built = packing.open_table(prepared["table"], prepared["table_xxh3_128"])
        # no source shard is verified whole, nor read whole: each row is checked against RUN's row
        # hash (or the slice) instead, and only its documents are read (will_need, then the map)
        # the reader (its files asked of the kernel) and the pool's mappings share the open files
        self.reader.max_open = max(MIN_SHARE, open_files_share() // 2)
        self.pool = packing.token_pool(self.plan, self.sources, read_in=False, most=self.reader.max_open)

    def rows(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(the rows at epoch `positions`, increasing, as an [n, row] array; best-fit: their padding)."""
        if self.padded:
            return self._packed_rows(positions)
        return self._window_rows(positions), None

    def _window_rows(self, positions: np.ndarray) -> np.ndarray:
        s, window, _ = self.plan.locate(positions)
        offsets = np.array([sp.offset for sp in self.plan.sources], dtype=np.int64)
        start = offsets[s] + window * self.row
        order = np.lexsort((start, s))  # source order, front to back
        ss, st = s[order], start[order]
        new = np.ones(len(order), dtype=bool)
        new[1:] = (ss[1:] != ss[:-1]) | (st[1:] != st[:-1])  # a window used twice (upsampled) is read once
        unique_of = np.cumsum(new) - 1
        us, ust = ss[new], st[new]
        buf = np.empty((len(us), self.row), dtype=self.dtype)
        # adjacent windows of one source (and small gaps) one read each, READ_DEPTH reads in flight
        before = self.reader.bytes
        self.reader.fill(self.of_plan, us, ust, self.row, buf)
        self.bytes_read += self.reader.bytes - before
        where = np.empty(len(order), dtype=np.int64)
        where[order] = unique_of
        return buf[where]

    def _packed_rows(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = np.empty((len(positions), self.row), dtype=self.dtype)
        pad = np.empty(len(positions), dtype=PAD_DTYPE)
        cuts = np.flatnonzero(np.diff(positions) != 1) + 1  # runs of consecutive positions: a global batch's
        runs = list(zip([0, *cuts.tolist()], [*cuts.tolist(), len(positions)]))
        ahead: list = []  # the next runs' tables, their pieces asked of the kernel already
        for r in range(len(runs)):
            while len(ahead) < min(LOOKAHEAD_RUNS, len(runs) - r):
                lo, hi = runs[r + len(ahead)]
                table, starts = self.built.rows(int(positions[lo]), int(positions[hi - 1]) + 1)
                a, b = np.searchsorted(table["g"], [int(positions[lo]), int(positions[hi - 1]) + 1])
                self.reader.will_need(self.sources, table["source"][a:b], starts[a:b], table["length"][a:b])
                ahead.append((table, starts))
            lo, hi = runs[r]
            g0, g1 = int(positions[lo]), int(positions[hi - 1]) + 1
            table, starts = ahead.pop(0)
            out[lo:hi] = self.pool.rows(table, g0, g1, self.row, self.plan.pad_id, starts)
            pad[lo:hi] = self.packing.row_padding(table, g1 - g0, self.row, g0)
        self.bytes_read += int(self.row * len(positions) - pad.astype(np.int64).sum()) * self.dtype.itemsize
        return out, pad

    def check(self, positions: np.ndarray, tokens: np.ndarray, pad: np.ndarray | None) -> None:
        """The rebuilt rows (and padding) against RUN's row hashes (and `.ds.pad`): one line naming
        the first position that differs and the file at fault (`_blame`: a source shard that
        changed since the run was shuffled, or RUN's file)."""
        got = row_hashes(tokens)
        per = int(self.m["shard_samples"])
        shard = positions // per
        for i in np.unique(shard).tolist():
            hashes = self.facts.hashes(i)
            pads = self.facts.pads(i) if self.padded else None
            sel = np.flatnonzero(shard == i)
            local = positions[sel] - i * per
            bad = np.flatnonzero(hashes[local] != got[sel])
            if len(bad):
                self._blame(i, ROWS_SUFFIX, f"sample {int(positions[sel[bad[0]]])}", "row hash")
            if pad is not None and (pads[local] != pad[sel]).any():
                self._blame(i, PAD_SUFFIX, f"shard {i}", "padding")

    def _blame(self, i: int, suffix: str, where: str, what: str) -> None:
        """A rebuilt row that differs from RUN's record of it (its `what`, in epoch shard i's
        `suffix` file, whose checksum matched RUN's manifest): the sources are verified whole,
        and the first source shard that fails its manifest's checksum is named; all intact, the
        run's file is."""
        for src in self.sources:
            for shard in src.shards:
                path = src.path / shard["path"]
                found = file_xxh3_128(path, int(shard["tokens"]) * src.dtype.itemsize)
                if found != shard["xxh3_128"]:
                    raise TokpackError(
                        f"a source row differs from the run's {what}: its source shard changed since the run "
                        "was shuffled",
                        file=path,
                        where="xxh3_128",
                        expected=shard["xxh3_128"],
                        found=found,
                        hint="restore the source as it was packed (run `tokpack validate` on it), or shuffle "
                        "the run again from the changed source",
                    )
        raise TokpackError(
            f"the run's {what} differs from the row its intact sources give",
            file=self.epoch_dir / f"{self.m['shards'][i]['path']}{suffix}",
            where=where,
            hint="the run's file was changed after it was written (its manifest's checksum with it): restore "
            "the run, or write it again with the --to-nodes command that wrote it",
        )

    def _run_file(self, i: int, suffix: str, size: int):
        """RowFacts' read of epoch shard i's `suffix` file in RUN (row hashes, padding): through the
        gate, at its recorded size; counted in bytes_read."""
        path = self.epoch_dir / f"{self.m['shards'][i]['path']}{suffix}"
        data = read_limited(path, size, "sidecar", size=size, folder=self.epoch_dir)
        self.bytes_read += len(data)
        return [data]

    def close(self) -> None:
        self.reader.close()
        self.pool = self.built = self.facts = None
        shutil.rmtree(self.work.parent if self.work.parent.name == WORK_DIR else self.work, ignore_errors=True)


if __name__ == "__main__":  # a rebuilding process of _rebuild_epoch: (job, p, P) on stdin, its part on stdout
    set_parent_death_signal()
    job_p_P = pickle.load(sys.stdin.buffer)
    try:
        result = ("part", _rebuild_ranks(*job_p_P))
    except (TokpackError, OSError) as e:
        result = ("error", e)
    except BaseException as e:  # noqa: BLE001 - a bug: the command's process reports it (as text: it may not pickle)
        result = ("error", RuntimeError(f"{type(e).__name__}: {e}"))
    pickle.dump(result, sys.stdout.buffer)
