"""What `tokpack stage` copies: the directory, a local path or any fsspec URL read through
tokpack.formats.io's one file-access layer (the gate), its manifests parsed and checked (Source);
its arguments (--epochs, --shards-of r/W, a node slice's --ranks A-B or --node n/N) parsed and
bounded; and the plan, the directories to copy (the root last, so its manifest is written after
everything) with their files, the shards ranks r of W do not read left out."""

from __future__ import annotations

import os
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from tokpack.formats.errors import TokpackError
from tokpack.formats.io.paths import as_path
from tokpack.formats.io.gate import contained, open_read, regular_size
from tokpack.formats.constants import EPOCH, HOLDOUT_DIR, MANIFEST, MAX_EPOCHS, MAX_MANIFEST_BYTES, NODES_SIDECAR
from tokpack.formats.constants import ROWS_SUFFIX, SOURCE
from tokpack.formats.names import epoch_dir_name
from tokpack.formats.fields import upgrade
from tokpack.formats.numbering import EpochNumbering, shuffle_command
from tokpack.formats.packing import run_holdout
from tokpack.formats.reading import parse_manifest, require_valid
from tokpack.formats.shards import contained_shard, shard_files, tokens_on_nodes
from tokpack.formats.token_check import ROWS, token_check
from tokpack.formats.slices import RankRows
from tokpack.formats.units import at_most, digits
from tokpack.packer.run_checks import refuse_epoch_of_another_run, refuse_holdout_of_another_run

# Per-worker copy buffer. Large blocks keep a disk or an object store streaming; with a
# handful of workers the memory stays at workers x STAGE_BLOCK.
STAGE_BLOCK = 32 << 20


def join_rel(*parts: str) -> str:
    return "/".join(p for p in parts if p)


SOURCE_HINT = "the source file is truncated or replaced; run `tokpack validate` on it"


class Source:
    """The directory being staged: a local path, or any fsspec URL through tokpack.formats.io's one
    file-access layer."""

    def __init__(self, path: str):
        self.path = str(path)  # as the user gave it
        try:
            self.root = as_path(self.path)  # a Path (plain os calls, kernel copies) or a RemotePath
        except TokpackError:
            raise  # its own line (a URL whose filesystem is not installed, an unknown scheme)
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

    def at(self, rel: str) -> str:
        """The file `rel` as errors name it: under the source's path as the user gave it."""
        return f"{self.path.rstrip('/')}/{rel}"

    def size_error(self, rel: str, size: int, found: str) -> TokpackError:
        """The file `rel` holds other than the `size` bytes its manifest records (`found`)."""
        return TokpackError(
            "file size does not match the manifest",
            file=self.at(rel),
            where="size",
            expected=f"{size} bytes",
            found=found,
            hint=SOURCE_HINT,
        )

    def read_error(self, rel: str, e: Exception) -> TokpackError:
        where = self.at(rel)
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

    def manifest(self, rel_dir: str, kind=None, raw: bool = False):
        """The manifest in `rel_dir`, parsed and checked; with `raw`, (it, its bytes as written)."""
        rel = join_rel(rel_dir, MANIFEST)
        where = self.at(rel)
        if rel_dir:  # an epoch directory of the run: inside it, not a symlink out
            contained(self.root, rel_dir, manifest=self.root / MANIFEST, where=f"epochs ({rel_dir})", regular=False)
        try:
            with self.open(rel) as f:
                data = f.read(MAX_MANIFEST_BYTES + 1)  # parse_manifest refuses more
        except (FileNotFoundError, NotADirectoryError):
            if not rel_dir and self.root.is_file():  # a file (or an object) given for the directory
                raise TokpackError(
                    "not a directory",
                    file=self.path,
                    expected="a tokpack directory",  # validate's words
                    found="a file",
                    hint="pass the directory that holds tokpack.json",
                ) from None
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
        manifest = parse_manifest(data, where, kind)
        require_valid(manifest, self.root / rel_dir if rel_dir else self.root)
        return (manifest, data) if raw else manifest


def refuse_tokens_on_nodes(src: Source, rel: str, manifest: dict) -> None:
    """One line for an epoch of a RUN of `shuffle --to-nodes`, whose token files are in the
    nodes' slices (only its row hashes are here): a copy of it, or a slice cut from its token
    files, found the first one "missing" and hinted to restore it; a node's slice is rebuilt
    from the sources by `stage --node` (tokpack.packer.replacement)."""
    if not tokens_on_nodes(src.root / rel if rel else src.root, manifest.get("shards") or []):
        return
    raise TokpackError(
        "the epoch's token files are on the nodes: it was written by `shuffle --to-nodes`",
        file=src.at(join_rel(rel, MANIFEST)),
        expected="an epoch with its token files (.ds)",
        found=f"its row hashes only (.ds.rows; the run's {NODES_SIDECAR} names the nodes' DEST)",
        hint="rebuild a node's slice from the sources with `tokpack stage RUN DEST --node n/N --ranks-per-node K "
        f"--micro-batch m` (K and m as in {NODES_SIDECAR}; no --start-sample), or copy a node's DEST",
    )


# ------------------------------------------------------------------------ arguments

# The largest W of --shards-of r/W: bigger than any cluster, small enough that a list of ranks fits in memory.
MAX_WORLD_SIZE = 1 << 20
EPOCHS_HINT = f"epochs are numbered 0 to {MAX_EPOCHS - 1}; give those of the run"


def parse_epochs(
    spec, *, limit: int = MAX_EPOCHS, option: str = "--epochs", what: str = "epoch number"
) -> list[int] | None:
    """'0,1' / '0-3' / '0-2,5' / [0, 1] -> sorted epoch numbers; None -> None (all). Every
    number is checked against `limit` before a range is expanded."""
    if spec is None:
        return None
    if isinstance(spec, int):
        spec = [spec]
    if not isinstance(spec, str):
        numbers = {int(e) for e in spec}
        at_most(max(numbers, default=0), limit - 1, what, where=option, hint=EPOCHS_HINT)
        return sorted(numbers)
    spans = []
    try:
        for part in filter(None, (p.strip() for p in spec.split(","))):
            lo, sep, hi = part.partition("-")
            spans.append((digits(lo), digits(hi) if sep else digits(lo)))
    except ValueError:
        raise TokpackError(f"bad {option}", where=option, expected="e.g. '0,1' or '0-3'", found=spec) from None
    for _, hi in spans:
        at_most(hi, limit - 1, what, where=option, hint=EPOCHS_HINT)
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
        try:
            world = digits(tail) if sep else 0
        except ValueError:  # no number: refused below, as a spelling that is not 'r/W'
            world = 0
        at_most(
            world, MAX_WORLD_SIZE, "world size", where=option, hint="W in r/W is the number of ranks that read the run"
        )
        try:
            if not sep:
                raise ValueError
            world = digits(tail)
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


def whole_shard_ranks(shards_of, ranks, world_size, node, start_sample: int = 0, ranks_per_node=None):
    """The `ranks` a whole-shard stage (staging.stage) is given: `shards_of` ('r/W') parsed, its
    errors naming --shards-of; else `ranks` as given (its old spelling, or a node slice's A-B).
    `shards_of` with a node slice's options is refused: it copies whole shards, a slice rows; so is
    a `start_sample` without a node slice, and `ranks_per_node` without `node` (stage and plan
    stage alike)."""
    if ranks_per_node is not None and node is None:
        # a node's slice meant, --node forgotten: the whole run was copied onto the node, silently
        raise TokpackError(
            "--ranks-per-node applies only with --node",
            where="--ranks-per-node",
            expected="--node n/N --ranks-per-node K (the slice of node n)",
            found=f"--ranks-per-node {ranks_per_node} without --node",
            hint="add --node n/N to stage that node's slice, or leave --ranks-per-node out to copy the run",
        )
    if start_sample and world_size is None and node is None:
        # a copy's shards (--shards-of) are those of batches from sample 0: another start needs others
        raise TokpackError(
            "--start-sample applies only to a node slice",
            where="--start-sample",
            expected="a node slice (--ranks A-B --world-size W, or --node n/N)",
            found=f"--start-sample {start_sample} with a copy of whole shards",
            hint="give it with --ranks A-B --world-size W (or --node) to stage a slice for that batch grid, or leave it out",
        )
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


def listed_epochs(run: dict, run_dir: str, epochs=None) -> list[int]:
    """The epochs a slice of `run` stages: `epochs` ('0,1', '0-3'; None: all), each one the run's
    manifest lists (a run being shuffled lists its complete ones only), or one line naming the
    command that writes the first missing."""
    available = sorted(int(e) for e in run.get("epochs") or [])
    chosen = available if epochs is None else parse_epochs(epochs)
    missing = [e for e in chosen if e not in available]
    if missing:
        raise TokpackError(
            "epochs not in this run (yet)",
            file=run_dir,
            where="epochs",
            expected=f"some of {available}",
            found=missing,
            hint=f"write epoch {missing[0]} with `{shuffle_command(run, run_dir, missing[0])}`"
            " or stage the written ones",
        )
    return chosen


# Ranks one node slice holds: each is a file written at once during a stage, so the bound is the
# open files a process may hold, far above the GPUs a node has.
MAX_SLICE_RANKS = 256
# Samples in a global batch: far above any run's (2^48 rows is an exabyte at seq_len 4096), and
# low enough that the row arithmetic of formats/slices.py stays inside int64.
MAX_GLOBAL_BATCH = 1 << 48


def slice_ranks(
    ranks=None,
    world_size: int | None = None,
    node=None,
    ranks_per_node: int | None = None,
    micro_batch: int | None = None,
) -> tuple[int, int, int]:
    """(A, B, W) from `--ranks A-B --world-size W` or `--node n/N --ranks-per-node K` (W = N*K),
    with at most MAX_SLICE_RANKS ranks and, given `micro_batch` m, W*m at most MAX_GLOBAL_BATCH:
    checked before anything is written, for every command that makes a node slice."""
    a, b, w = _slice_ranks(ranks, world_size, node, ranks_per_node)
    at_most(
        b - a + 1,
        MAX_SLICE_RANKS,
        "ranks in one node slice",
        where="--ranks/--ranks-per-node",
        hint="a node slice holds the ranks of one node: stage each node's ranks (--node n/N) on that node",
    )
    at_most(
        w,
        MAX_WORLD_SIZE,
        "world size",
        where="--world-size",
        hint="W is the number of data-parallel ranks that read the run",
    )
    if micro_batch is not None:
        at_most(
            w * micro_batch,
            MAX_GLOBAL_BATCH,
            "samples in a global batch (W*m)",
            where="--world-size/--micro-batch",
            hint="W is the data-parallel ranks and m the samples each reads per step; a run holds far fewer samples",
        )
    return a, b, w


# what a refused --node should have been (an unset $SLURM_NODEID outside a job gives "/N")
NODE_HINT = 'give --node n/N (node n of N, 0 to N-1) and --ranks-per-node K; in a Slurm job, --node "$SLURM_NODEID/$SLURM_NNODES"'


def _slice_ranks(ranks, world_size, node, ranks_per_node) -> tuple[int, int, int]:
    if node is not None:
        if ranks is not None:
            raise TokpackError("give --ranks or --node, not both", where="--node")
        try:
            n, _, count = str(node).partition("/")
            n, count = digits(n), digits(count)
        except ValueError:
            raise TokpackError(
                "bad --node", where="--node", expected="'n/N': node n of N", found=node, hint=NODE_HINT
            ) from None
        k = ranks_per_node
        if k is None or k < 1 or count < 1 or not 0 <= n < count:
            raise TokpackError(
                "bad --node",
                where="--node/--ranks-per-node",
                expected="0 <= n < N and K >= 1",
                found=f"{node}, --ranks-per-node {k}",
                hint=NODE_HINT,
            )
        if world_size is not None and world_size != count * k:
            raise TokpackError(
                "--world-size disagrees with --node and --ranks-per-node",
                where="--world-size",
                expected=f"{count * k} (N*K)",
                found=world_size,
            )
        return n * k, n * k + k - 1, count * k
    if ranks is None:
        raise TokpackError(
            "a node slice needs its ranks", where="--ranks", hint="add --ranks A-B, or --node n/N --ranks-per-node K"
        )
    head, sep, tail = str(ranks).partition("/")  # 'A-B', 'A' or 'A-B/W'
    lo, dash, hi = head.partition("-")
    try:
        a, b = digits(lo), digits(hi) if dash else digits(lo)
        w = digits(tail) if sep else None
    except ValueError:
        raise TokpackError(
            "bad --ranks", where="--ranks", expected="'A-B' (consecutive ranks of one node) or 'A'", found=ranks
        ) from None
    if a < 0 or b < a:
        raise TokpackError("bad --ranks", where="--ranks", expected="0 <= A <= B", found=ranks)
    if w is not None and world_size is not None and w != world_size:
        raise TokpackError("--ranks and --world-size disagree", where="--ranks", expected=f"/{world_size}", found=ranks)
    w = world_size if world_size is not None else w
    if w is None or w < 1 or b >= w:
        raise TokpackError(
            "bad --ranks",
            where="--ranks",
            expected=f"ranks in [0, {w})" if w else "a --world-size",
            found=ranks,
            hint="each rank must be below the world size W",
        )
    return a, b, w


# ----------------------------------------------------------------------------- plan


@dataclass
class CopyJob:
    rel: str  # path relative to the staged root, "/"-separated
    size: int | None  # expected bytes, when the manifest says
    checksum: str | None  # expected xxh3_128, when the manifest says
    dir_rel: str  # the directory whose manifest vouches for this file ("" = root)
    # An epoch shard's token file whose entry records no xxh3_128: (its `.ds.rows`'s rel, that
    # file's rows_xxh3_128, samples), the rows it is checked against, row by row, as it streams
    rows: tuple[str, str, int] | None = None
    key: str = "xxh3_128"  # the manifest's field `checksum` is (a .ds.rows's: rows_xxh3_128), as its error names it


@dataclass
class DirPlan:
    rel: str  # directory relative to the staged root ("" = root)
    manifest: dict  # what DEST's tokpack.json will hold
    jobs: CopyJobs | list = field(default_factory=list)  # its files (shards only; not the manifest)
    skipped_shards: list[str] = field(default_factory=list)  # shards left out by --ranks


class CopyJobs:
    """A directory's copy jobs, each CopyJob made from its manifest entry when its turn comes,
    not one held per file (60,000 files held 10 MB of them): the entries copied, by index, in
    the manifest's order, and their number of files."""

    def __init__(self, manifest: dict, dir_rel: str):
        self.manifest, self.dir_rel = manifest, dir_rel
        self.indices = array("q")
        self.files = 0

    def __len__(self) -> int:
        return self.files

    def __iter__(self):
        shards = self.manifest.get("shards") or []
        for i in self.indices:
            yield from entry_jobs(self.manifest, shards[i], self.dir_rel)


def entry_jobs(manifest: dict, s: dict, dir_rel: str) -> list[CopyJob]:
    """The files of one shard entry of a source or epoch manifest (formats/shards.py shard_files)."""
    check = token_check(s)
    by_rows = (
        (join_rel(dir_rel, s.get("path") + ROWS_SUFFIX), check[1], int(s["samples"]))
        if check and check[0] == ROWS
        else None
    )
    return [
        CopyJob(join_rel(dir_rel, s.get("path") + suffix), size, s.get(key), dir_rel, None if suffix else by_rows, key)
        for suffix, size, key in shard_files(s, source=manifest.get("kind") == SOURCE)
    ]


def shard_jobs(manifest: dict, dir_rel: str, keep: list[bool] | None = None, root=None) -> tuple[CopyJobs, list[str]]:
    """The files of a source or epoch manifest's shards, each known to stay inside its folder
    under `root` (tokpack.formats.io.contained) and its entry checked (entry_jobs), before any copy."""
    jobs, skipped = CopyJobs(manifest, dir_rel), []
    folder = None if root is None else root / dir_rel if dir_rel else root  # Source.manifest checked dir_rel
    for i, s in enumerate(manifest.get("shards") or []):
        name = s.get("path")
        if folder is not None:
            contained_shard(folder, s, i)
        if keep is not None and not keep[i]:
            skipped.append(name)
            continue
        jobs.indices.append(i)
        jobs.files += len(entry_jobs(manifest, s, dir_rel))  # made and dropped: the entry's checks, here
    return jobs, skipped


def make_plan(src: Source, epochs=None, ranks=None, micro_batch: int = 1) -> tuple[str, list[DirPlan]]:
    """(kind, [directories]): the root is last, so its manifest is written after everything."""
    root = src.manifest("")
    kind = root["kind"]
    if kind == SOURCE and (epochs is not None or ranks is not None):
        raise TokpackError(
            "--epochs and --ranks apply to runs and epochs, not to a packed source",
            file=src.path,
            where="kind",
            expected="run or epoch",
            found="source",
            hint="stage the source without them, or stage the run shuffled from it",
        )
    if kind == EPOCH and epochs is not None and epochs != [root.get(EPOCH)]:
        raise TokpackError(
            "--epochs does not match this epoch directory",
            file=src.path,
            where="epoch",
            expected=epochs,
            found=root.get("epoch"),
        )
    if kind == EPOCH:
        refuse_tokens_on_nodes(src, "", root)
    if kind in (SOURCE, EPOCH):  # one directory: a source's ranks are None (refused above)
        keep = _rank_keep(root, 0, _samples(root), ranks, micro_batch)
        return kind, [DirPlan("", root, *shard_jobs(root, "", keep, root=src.root))]
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
    manifests = [src.manifest(epoch_dir_name(e), kind=EPOCH) for e in chosen]
    for e, m in zip(chosen, manifests):  # each epoch this run's, as validate checks it: never another run's copied
        refuse_epoch_of_another_run(root, src.path, e, m, src.at(join_rel(epoch_dir_name(e), MANIFEST)))
        refuse_tokens_on_nodes(src, epoch_dir_name(e), m)
    # A reader of DEST numbers samples as the run does (epoch e starts at numbering.first(e)),
    # so the ranks' shards are chosen at those positions, not where the staged epochs chain.
    numbering = EpochNumbering.of_run(root, src.path) if ranks is not None else None
    end = None if numbering is None else numbering.first(chosen[-1]) + _samples(manifests[-1])
    plans = []
    for e, m in zip(chosen, manifests):
        rel = epoch_dir_name(e)
        offset = None if numbering is None else numbering.first(e)
        plans.append(
            DirPlan(rel, m, *shard_jobs(m, rel, _rank_keep(m, offset, end, ranks, micro_batch), root=src.root))
        )
    run = {**root, "epochs": list(chosen)}
    if chosen != available:  # the run's totals cover the epochs it lists
        staged = [upgrade(p.manifest) for p in plans]
        for key in ("tokens", "fragments", "documents"):  # `documents`: earlier writers' name for fragments
            if key in root:
                run[key] = sum(int(m.get("fragments" if key == "documents" else key, 0)) for m in staged)
    if ranks is None and run_holdout(root) is not None:
        # shuffle --holdout's held-out documents (an epoch directory the run never lists) come
        # with a copy of the run's epochs: eval reads them beside the training epochs
        held = src.manifest(HOLDOUT_DIR, kind=EPOCH)
        refuse_holdout_of_another_run(root, src.path, held, src.at(join_rel(HOLDOUT_DIR, MANIFEST)))
        plans.append(DirPlan(HOLDOUT_DIR, held, *shard_jobs(held, HOLDOUT_DIR, root=src.root)))
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
