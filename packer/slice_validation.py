"""`tokpack validate` of a node slice: its manifests agree with each other and with the rank
arithmetic (tokpack.formats.slices), and `--against RUN` compares each rank file with the run's
samples that rank reads. tokpack.packer.validation runs these checks and reports them.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import numpy as np

from tokpack.formats.errors import TokpackError
from tokpack.formats.io.gate import IO_BLOCK, open_read, read_limited, regular_size
from tokpack.formats.io.paths import as_path
from tokpack.formats.io.reads import read_full
from tokpack.formats.constants import EPOCH, MANIFEST, MAX_MANIFEST_BYTES, PAD_DTYPE, PAD_SUFFIX, RUN, SLICE_EPOCH
from tokpack.formats.checks import check_manifest, row_bytes_of
from tokpack.formats.names import dtype_from_name, epoch_dir_name
from tokpack.formats.packing import has_pad
from tokpack.formats.reading import read_manifest
from tokpack.formats.hashes import row_hashes
from tokpack.formats.numbering import EpochNumbering
from tokpack.formats.shards import RowFacts, contained_shard, tokens_on_nodes
from tokpack.formats.slices import (
    RankRows,
    contained_epoch_dir,
    epoch_disagreements,
    missing_padding,
    run_identity,
    slice_epoch_problems,
)


def slice_shard_jobs(path: Path, root: dict, rep, quick: bool) -> list:
    """`tokpack validate SLICE`: the slice's manifests agree with each other and with the rank
    arithmetic; returns the rank files' checks (every file an epoch-shard check: sizes, index,
    metadata, row hashes, checksums) for tokpack.packer.validation to run. Problems go into `rep`."""
    from tokpack.formats.shard_scan import ShardJob

    jobs = []
    try:
        numbering = EpochNumbering.of_run(root["run"], path)
        rows = RankRows(root["world_size"], root["micro_batch"], root["batch_phase"])
        dtype, row = dtype_from_name(root["dtype"]), int(root["seq_len"]) + 1
        shared = ("epoch", dtype, int(root["vocab_size"]), int(root["eos_id"]), root["tokenizer"], row, quick)
        ranks = [int(r) for r in root["ranks"]]
        epochs = [int(e) for e in root["epochs"]]
    except (KeyError, TypeError, ValueError, TokpackError) as e:
        rep.add(
            path / MANIFEST,
            getattr(e, "where", None) or str(e),
            "a slice manifest's fields",
            "missing or malformed",
            "slice manifest unusable",
        )
        return []
    if not ranks or ranks != list(range(ranks[0], ranks[0] + len(ranks))):
        rep.add(path / MANIFEST, "ranks", "consecutive ranks A..B", ranks, "slice ranks not consecutive")
        return []
    tokens = []  # of each epoch whose manifest is sound: the root's `tokens` is their sum
    for e in epochs:
        d = path / epoch_dir_name(e)
        try:
            d = contained_epoch_dir(path, e)
            m = read_manifest(d, kind=SLICE_EPOCH, checked=False)  # every problem reported, not the first
        except TokpackError as err:
            rep.add(err.file or d / MANIFEST, err.where, err.expected, err.found, err.message)
            continue
        if not check_manifest(m, d, rep.add):
            continue
        tokens.append(m["tokens"])
        first, n = numbering.first(e), numbering.size(e)
        bad = set()
        for r, err in slice_epoch_problems(d, root, m, e, first, n, rows):
            rep.add(err.file, err.where, err.expected, err.found, err.message, hint=err.hint)
            bad.add(r)
        if None in bad:
            continue
        for r, s in zip(ranks, m["shards"]):
            if r in bad:
                continue  # its file cannot be cut into the rows it should hold
            err = missing_padding(d, root, s)
            if err is not None:
                rep.add(err.file, err.where, err.expected, err.found, err.message, hint=err.hint)
            try:
                contained_shard(d, s, ranks.index(r))
            except TokpackError as err:  # a rank file or sidecar linked out of the slice: reported, never opened
                rep.add(err.file, err.where, err.expected, err.found, err.message, hint=err.hint)
                continue
            jobs.append(ShardJob(d, s, *shared))  # every rank file checked as an epoch shard
    if len(tokens) == len(epochs) and root.get("tokens") != sum(tokens):
        rep.add(
            path / MANIFEST,
            "tokens",
            f"{sum(tokens)} (sum over its epochs)",
            root.get("tokens"),
            "slice token count wrong",
        )
    return jobs


def _local_blocks(directory: Path, manifest: dict, row_bytes: int):
    """RowFacts' reads of a local run epoch: each file through the gate, at its recorded size; a
    shard (an epoch written before row hashes) in blocks of whole rows, so memory stays bounded."""

    def blocks(i: int, suffix: str, size: int):
        s = manifest["shards"][i]
        f = contained_shard(directory, s, i).with_name(s["path"] + suffix)
        if suffix:
            yield read_limited(f, size, "sidecar", size=size)
            return
        buf = np.empty(max(1, IO_BLOCK // row_bytes) * row_bytes, dtype=np.uint8)
        with open_read(f, size=size, what="shard") as fh:
            for a in range(0, size, len(buf)):
                view = memoryview(buf[: min(len(buf), size - a)])
                if read_full(fh, view) != view.nbytes:
                    raise TokpackError(
                        "shard is shorter than its manifest says",
                        file=f,
                        where=f"byte {a}",
                        hint="run `tokpack validate` on the run",
                    )
                yield view

    return blocks


def slice_against_run(path: Path, root: dict, run_path, rep, block: int = IO_BLOCK, source_rows=None) -> None:
    """`tokpack validate SLICE --against RUN`: each rank file holds exactly the run's samples
    that rank reads, in order: its rows' xxh3-64, position by position, against the run's
    row hashes (`.ds.rows`, or the run's shards for an epoch written before them), and a
    best-fit slice's `.ds.pad` against the run's. Rank files are read in blocks of about
    `block` bytes: memory does not grow with the slice.

    An epoch of a --to-nodes RUN (its tokens only on the nodes, and its row hashes written by
    the exchange itself) is also proven from the sources: `source_rows(epoch_dir, manifest,
    work)` (tokpack.packer.replacement.SourceRows, given by the caller) rebuilds the rows the
    plan puts at each position the rank file holds, a block at a time, and each is compared
    with the rank file's bytes (and padding)."""
    import tempfile

    import xxhash

    run_path = as_path(run_path)
    try:
        run = read_manifest(run_path, kind=RUN)
    except TokpackError as e:
        rep.add(e.file or run_path, e.where, e.expected, e.found, e.message)
        return
    if run_identity(run) != root.get("run"):
        rep.add(
            path / MANIFEST,
            "run",
            f"the run at {run_path}",
            "another run (seed, sources or plan differ)",
            "slice was not staged from this run",
        )
        return
    rows = RankRows(root["world_size"], root["micro_batch"], root["batch_phase"])
    numbering = EpochNumbering.of_run(run, run_path)
    row_bytes = row_bytes_of(root)
    buf = np.empty((max(1, block // row_bytes, rows.micro_batch), row_bytes), dtype=np.uint8)  # whole micro-batches
    for e in root["epochs"]:
        d, rd = path / epoch_dir_name(e), run_path / epoch_dir_name(e)
        try:
            d, rd = contained_epoch_dir(path, e), contained_epoch_dir(run_path, e)
            m = read_manifest(d, kind=SLICE_EPOCH)
            raw = read_limited(rd / MANIFEST, MAX_MANIFEST_BYTES, "manifest")
        except (TokpackError, OSError) as err:
            rep.add(getattr(err, "file", None) or rd, None, "a readable manifest", str(err), "cannot compare epoch")
            continue
        if xxhash.xxh3_128_hexdigest(raw) != m.get("epoch_xxh3_128"):
            rep.add(
                d / MANIFEST,
                "epoch_xxh3_128",
                m.get("epoch_xxh3_128"),
                xxhash.xxh3_128_hexdigest(raw),
                f"slice epoch {e} was staged from another version of the run's epoch",
            )
            continue
        em = read_manifest(rd, kind=EPOCH)
        # the run's epoch must be the run's own: one of another run (another seed) put in its
        # place, and staged before stage refused that, would prove a slice of other rows OK
        wrong = next(epoch_disagreements(run, e, em), None)
        if wrong is not None:
            where, expected, found, message = wrong
            rep.add(rd / MANIFEST, where, expected, found, message)
            continue
        shards = RowFacts(em, row_bytes, _local_blocks(rd, em, row_bytes), str(rd), "run `tokpack validate` on the run")
        with tempfile.TemporaryDirectory(prefix="tokpack-validate-") as work:  # a best-fit row table, rebuilt
            replay = None
            if source_rows is not None and tokens_on_nodes(rd, em.get("shards") or []):
                try:
                    replay = source_rows(rd, em, Path(work) / "table")
                except (TokpackError, OSError) as err:
                    rep.add(
                        getattr(err, "file", None) or getattr(err, "filename", None) or rd,
                        getattr(err, "where", None),
                        "the run's sources, readable as its epoch manifest names them",
                        str(err),
                        f"cannot replay epoch {e} from the sources",
                        hint="give the sources back at the paths the run's manifest names, then validate again",
                    )
            try:
                for s in m["shards"]:
                    r = int(s["rank"])
                    f = d / s["path"]
                    try:
                        _against_rank_file(f, s, r, e, numbering, rows, shards, buf, replay, rep)
                    except TokpackError as err:
                        rep.add(err.file or f, err.where, err.expected, err.found, err.message, hint=err.hint)
                    except OSError as err:
                        rep.add(
                            err.filename or f,
                            None,
                            "a readable rank file and run",
                            err.strerror,
                            "cannot compare rank file",
                        )
            finally:
                if replay is not None:
                    replay.close()


def _against_rank_file(f: Path, s: dict, r: int, e: int, numbering, rows: RankRows, shards: RowFacts, buf, replay, rep):
    """One rank file (and its `.ds.pad`) against the run's rows rank r reads in epoch e (its rows
    as `numbering` places them and `rows` deals them, their recorded hashes and padding `shards`),
    block by block in `buf` (whole micro-batches of rows); with `replay` (a SourceRows), also
    against the rows the sources give at those positions."""
    first, n, row_bytes = numbering.first(e), numbering.size(e), buf.shape[1]
    want_rows = rows.rows(r, first, first + n)
    size = regular_size(f)
    if size != want_rows * row_bytes:
        rep.add(
            f,
            "size",
            f"{want_rows * row_bytes} bytes ({want_rows} samples of rank {r})",
            f"{size} bytes",
            "rank file does not hold that rank's samples",
        )
        return
    pad_buf = np.empty(len(buf), dtype=PAD_DTYPE)
    done, bad_rows, bad_pads = 0, RowDiffs(), RowDiffs()
    proof = _Replayed(replay) if replay is not None else None
    pad = f.with_name(f.name + PAD_SUFFIX)
    # a rank file of a best-fit run without one is reported by the slice's own checks (missing_padding)
    pads = open_read(pad, size=want_rows * PAD_DTYPE.itemsize, what="padding sidecar") if has_pad(s) else nullcontext()
    with pads as pad_file, open_read(f) as fh:
        for pos in rows.node_positions(first, n, (r, r), len(buf)):
            k = len(pos)
            if not k:
                continue
            view = memoryview(buf[:k].reshape(-1))
            if read_full(fh, view) != view.nbytes:
                raise TokpackError("rank file ended early", file=f, where=f"row {done}")
            bad_rows.add(done, pos, shards.gather(pos, shards.hashes), row_hashes(buf[:k]))
            if proof is not None:
                proof.compare(done, pos, buf[:k])
            if pad_file is not None:
                pv = memoryview(pad_buf[:k].view(np.uint8))
                have = pad_buf[:k] if read_full(pad_file, pv) == pv.nbytes else None  # None: the file ended
                bad_pads.add(done, pos, shards.gather(pos, shards.pads), have)
                if proof is not None:
                    proof.compare_padding(done, pos, have)
            done += k
    if bad_rows.first is not None:
        k, want, p, found = bad_rows.first
        rep.add(
            f,
            f"row {k}",
            f"{want:016x} (run epoch {e}, sample {p})",
            f"{found:016x}",
            f"rank file row differs from the run's sample rank {r} reads there{bad_rows.more()}",
        )
    if bad_pads.first is not None:
        k, want, p, found = bad_pads.first
        rep.add(
            pad,
            f"row {k}",
            f"{want} padding tokens (run epoch {e}, sample {p})",
            found,
            f"rank file padding differs from the run's{bad_pads.more()}",
        )
    if proof is not None:
        proof.report(f, r, e, rep)


class RowDiffs:
    """Where a file's rows (a rank file's, or RUN's row hashes and padding: run_proof) first differ
    from those it should hold, as (row in the file, wanted, epoch position, found), and how many do."""

    def __init__(self):
        self.first, self.count = None, 0

    def add(self, done: int, pos: np.ndarray, want: np.ndarray, have: np.ndarray | None) -> None:
        """The file's rows from row `done` on, at epoch positions `pos` (`have` None: it ended before them)."""
        bad = np.flatnonzero(want != have) if have is not None else np.arange(len(pos))
        if len(bad) and self.first is None:
            j = int(bad[0])
            self.first = (done + j, int(want[j]), int(pos[j]), int(have[j]) if have is not None else "end of file")
        self.count += len(bad)

    def more(self) -> str:
        return f" ({self.count} rows differ)" if self.count > 1 else ""


class _Replayed:
    """A rank file's rows against those the sources give at the same epoch positions (the plan
    replayed by a SourceRows, within its part size): the first row and padding that differ."""

    def __init__(self, replay):
        self.replay, self.pad = replay, None
        self.bad_rows, self.bad_pads = 0, RowDiffs()
        self.first_row = None  # (row in the rank file, epoch position)

    def compare(self, done: int, pos: np.ndarray, have: np.ndarray) -> None:
        parts = []
        for c in range(0, len(pos), self.replay.part_rows):
            part = pos[c : c + self.replay.part_rows]
            tokens, pad = self.replay.rows(part)
            bad = np.flatnonzero((tokens.reshape(len(part), -1).view(np.uint8) != have[c : c + len(part)]).any(axis=1))
            if len(bad) and self.first_row is None:
                self.first_row = (done + c + int(bad[0]), int(part[bad[0]]))
            self.bad_rows += len(bad)
            parts.append(pad)
        self.pad = np.concatenate(parts) if parts and parts[0] is not None else None  # for compare_padding

    def compare_padding(self, done: int, pos: np.ndarray, have: np.ndarray | None) -> None:
        if self.pad is not None:
            self.bad_pads.add(done, pos, self.pad, have)

    def report(self, f: Path, r: int, e: int, rep) -> None:
        if self.first_row is not None:
            k, p = self.first_row
            rep.add(
                f,
                f"row {k}",
                f"the sources' row at run epoch {e}, sample {p}, as the run's plan places it",
                "other tokens",
                f"rank file row is not the one the plan puts at that position for rank {r}, "
                "replayed from the sources" + (f" ({self.bad_rows} rows differ)" if self.bad_rows > 1 else ""),
                hint=REBUILD_HINT,
            )
        if self.bad_pads.first is not None:
            k, want, p, found = self.bad_pads.first
            rep.add(
                f.with_name(f.name + PAD_SUFFIX),
                f"row {k}",
                f"{want} padding tokens (the sources' row at run epoch {e}, sample {p})",
                found,
                f"rank file padding is not the plan's, replayed from the sources{self.bad_pads.more()}",
                hint=REBUILD_HINT,
            )


REBUILD_HINT = (
    "rebuild this node's slice from the sources (`tokpack stage RUN DEST --node n/N --ranks-per-node K "
    "--micro-batch M`), or rerun the --to-nodes command"
)
