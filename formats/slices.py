"""Node slices (docs/FORMAT.md, "Node slices"): the rows that consecutive data-parallel ranks
A..B read, one plain file per rank and epoch.

Which rows a rank reads is arithmetic on the run's consumed-sample numbers G (Megatron's
sampler): global batches are the samples [phase + k*W*m, phase + (k+1)*W*m) and rank r takes
[r*m, (r+1)*m) of each. `epoch-NNNNN/rank-RRRRR.ds` holds the samples of epoch NNNNN that rank
r reads, in increasing G: every one of them, also those of a global batch that spans into the
next epoch, so the file never depends on which epochs exist. A rank's sample G therefore sits
at row `count(r, G) - count(r, first(e))` of its epoch's file, in O(1).

The reader that serves a slice is tokpack.loader.slice_reader; `validate`'s checks of one,
tokpack.packer.slice_validation.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Iterator

import numpy as np

from .errors import TokpackError
from .io.gate import contained
import xxhash

from .constants import MANIFEST, RUN_KEYS, SLICE, SLICE_EPOCH
from .names import epoch_dir_name
from .packing import HOLDOUT_SPLIT, PackingRecord, has_pad, holdout_recorded, rows_padded
from .builders import header_like

# Run-manifest fields that change as epochs are written: not part of the run's identity.
RUN_SELECTION_KEYS = ("epochs", "tokens", "fragments", "documents")
# What makes two slices the same slice: the ranks' shape, then the run (its identity). Every
# manifest of a slice, root and epochs, carries them equal; a restage compares them.
SLICE_SHAPE_KEYS = ("world_size", "micro_batch", "ranks", "batch_phase")
SLICE_KEYS = (*SLICE_SHAPE_KEYS, "run")
# What a slice epoch's manifest adds to name its rows: which epoch of the run, which version of it.
SLICE_EPOCH_KEYS = ("kind", "epoch", "epoch_xxh3_128", *SLICE_KEYS)


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.ds"


def run_identity(run: dict) -> dict:
    """What a slice records of its run: every field but those that grow as epochs are written."""
    return {k: v for k, v in run.items() if k not in RUN_SELECTION_KEYS}


def source_keys(sources: list) -> list:
    """What identifies a run's or epoch's sources: their fingerprints in order."""
    return [s.get("fingerprint") if isinstance(s, dict) else s for s in sources]


def _settings_disagreements(run: dict, m: dict, keys, message: str) -> Iterator[tuple[str, object, object, str]]:
    """The `keys` both manifests record with other values: an epoch's or a held-out split's against its run's."""
    for key in keys:
        if key in run and key in m and m[key] != run[key]:
            yield key, f"{run[key]!r} (the run's)", repr(m[key]), message


def epoch_disagreements(run: dict, e: int, em: dict) -> Iterator[tuple[str, object, object, str]]:
    """Each way epoch e's manifest `em` says it is not its `run`'s (where, expected, found,
    message): the settings both record (RUN_KEYS; a schedule's epochs differ in size), its
    sources' fields and weights, its number, its sources' fingerprints. `validate` reports them
    all; `stage` and the reader refuse the first: an epoch of another run (another seed or
    sources) put in a run's place has the run's shape but other samples."""
    scheduled = "schedule" in run
    keys = [k for k in RUN_KEYS if not (k == "samples" and scheduled)]
    yield from _settings_disagreements(run, em, keys, "epoch manifest belongs to another run")
    ours = run.get("sources") if isinstance(run.get("sources"), list) else []
    theirs = em.get("sources") if isinstance(em.get("sources"), list) else []
    if len(theirs) == len(ours):
        weights = run.get("weights")
        for i, (a, b) in enumerate(zip(ours, theirs)):
            if not (isinstance(a, dict) and isinstance(b, dict)):
                continue
            for key in sorted(a.keys() & b.keys() - ({"weight"} if scheduled else set())):
                if a[key] != b[key]:
                    yield (
                        f"sources[{i}].{key}",
                        f"{a[key]!r} (the run's)",
                        repr(b[key]),
                        "epoch source differs from the run's",
                    )
            if isinstance(weights, list) and i < len(weights) and "weight" in b and weights[i] != b["weight"]:
                yield f"sources[{i}].weight", repr(weights[i]), repr(b["weight"]), "epoch weight differs from the run's"
    if em.get("epoch") != e:
        yield "epoch", e, em.get("epoch"), "epoch manifest belongs to another epoch"
    if isinstance(em.get("sources"), list) and source_keys(em["sources"]) != source_keys(ours):
        yield (
            "sources",
            source_keys(ours),
            source_keys(em["sources"]),
            "epoch was shuffled from other sources than its run",
        )


# The run's settings RUN/holdout/ records as the run does: not its size (`samples`), nor
# `jitter` (the held-out split is cut without), nor the sources' weights (it holds every
# held-out window once).
HOLDOUT_KEYS = tuple(k for k in RUN_KEYS if k not in ("samples", "jitter"))


def holdout_disagreements(run: dict, hm: dict) -> Iterator[tuple[str, object, object, str]]:
    """Each way RUN/holdout/'s manifest `hm` says it is not its `run`'s held-out split (where,
    expected, found, message): the settings both record (HOLDOUT_KEYS), the run's `--holdout`
    and the split's mark, the packing's settings, the sources' fingerprints. The held-out
    documents are chosen by the seed, the sources and --holdout alone, so a split of another
    run (another seed or sources, copied in) is well formed and would pass as eval data the
    run trained on."""
    yield from _settings_disagreements(run, hm, HOLDOUT_KEYS, "held-out split belongs to another run")
    held, split = holdout_recorded(hm)
    home = "packing." if rows_padded(hm) else ""  # where holdout_recorded found it
    if not split:
        where = f"{home}split" if home else "holdout.split"
        yield where, repr(HOLDOUT_SPLIT), "no such mark", "not a held-out split: an epoch put in RUN/holdout/"
    ours = holdout_recorded(run)[0]
    if held != ours:
        yield f"{home}holdout", f"{ours!r} (the run's --holdout)", repr(held), "held-out split of another --holdout"
    mine, theirs = PackingRecord.of(run), PackingRecord.of(hm)
    if (mine is None) != (theirs is None):
        method = ("windows (concat)", "packed rows")
        yield (
            "packing",
            f"{method[mine is not None]} (the run's)",
            method[theirs is not None],
            ("held-out split packed otherwise than its run"),
        )
    elif mine is not None:
        for key in ("method", "group_tokens", "pad_id"):
            if getattr(mine, key) != getattr(theirs, key):
                yield (
                    f"packing.{key}",
                    f"{getattr(mine, key)!r} (the run's)",
                    repr(getattr(theirs, key)),
                    ("held-out split packed otherwise than its run"),
                )
    ours_src = run.get("sources") if isinstance(run.get("sources"), list) else []
    if source_keys(hm.get("sources") if isinstance(hm.get("sources"), list) else []) != source_keys(ours_src):
        yield (
            "sources",
            source_keys(ours_src),
            source_keys(hm.get("sources") or []),
            "held-out split of other sources than its run",
        )


def run_digest(run: dict) -> int:
    """A digest of a run's identity (`run_identity`): equal for the run, its staged copies and
    its node slices, as epochs are added; a loader state records it, so that a state of another
    run, whose consumed-sample numbers name other samples, is refused at its load. 63 bits: a
    state's fields are integers that fit an int64. Keys sorted: the digest does not depend on
    the order a manifest lists them in."""
    return xxhash.xxh3_64_intdigest(json.dumps(run_identity(run), sort_keys=True).encode()) >> 1


def stage_command(
    source: str, dest: str, first: int, last: int, world_size: int, micro_batch: int, phase: int = 0
) -> str:
    """The `tokpack stage` command that writes the slice of ranks first..last."""
    ranks = f"{first}" if first == last else f"{first}-{last}"
    cmd = (
        f"tokpack stage {shlex.quote(str(source))} {shlex.quote(str(dest))} --ranks {ranks} "
        f"--world-size {world_size} --micro-batch {micro_batch}"
    )
    return cmd + (f" --start-sample {phase}" if phase else "")


class RankRows:
    """Which consumed-sample numbers each rank reads: W ranks, micro-batch m, global batches
    starting at G = start (mod W*m). Pure arithmetic, a few integers, and the only place it is
    written: the whole-run reader's streams, the slice reader, `stage --ranks` (both forms) and
    the node-slice writer all ask this class."""

    def __init__(self, world_size: int, micro_batch: int, phase: int = 0):
        self.world_size, self.micro_batch = int(world_size), int(micro_batch)
        self.global_batch = self.world_size * self.micro_batch
        self.start = int(phase)  # G of global batch 0's first sample
        self.phase = self.start % self.global_batch

    def first(self, rank: int, batch: int) -> int:
        """G of rank `rank`'s first sample in global batch `batch` (counted from `start`)."""
        return self.start + batch * self.global_batch + rank * self.micro_batch

    def batches(self, end: int) -> int:
        """Complete global batches from `start` below G = `end`: readers serve no partial one."""
        return max(0, (end - self.start) // self.global_batch)

    def rank_of(self, g):
        """The rank that reads sample G (an int, or an array of them)."""
        return ((g - self.phase) % self.global_batch) // self.micro_batch

    def run_left(self, g: int) -> int:
        """Samples from G to the end of the micro-batch it is in: the rows its rank reads in one run."""
        return self.micro_batch - (g - self.phase) % self.micro_batch

    def count(self, rank: int, g: int) -> int:
        """Samples rank `rank` reads below G (up to a constant: use differences)."""
        y = g - self.phase
        return (y // self.global_batch) * self.micro_batch + min(
            max(y % self.global_batch - rank * self.micro_batch, 0), self.micro_batch
        )

    def rows(self, rank: int, first: int, g: int) -> int:
        """Samples of rank `rank` in [first, g): the row of G in the file of an epoch starting at `first`."""
        return self.count(rank, g) - self.count(rank, first)

    def file_rows(self, first: int, g: np.ndarray) -> np.ndarray:
        """Each sample G's row in its rank's file of an epoch starting at `first`: rows(rank_of(G),
        first, G) of an array at once (G lies in its rank's micro-batch: count's clamp is that of
        `first` alone)."""
        rank, gb, m = self.rank_of(g), self.global_batch, self.micro_batch
        y, y0 = g - self.phase, first - self.phase
        return (y // gb - y0 // gb) * m + (y % gb - rank * m) - np.clip(y0 % gb - rank * m, 0, m)

    def reads_any(self, ranks, lo: int, hi: int) -> bool:
        """Whether any of `ranks` reads a sample in [lo, hi)."""
        return any(self.rows(r, lo, hi) for r in ranks)

    def node_positions(self, first: int, n: int, ranks: tuple[int, int], max_rows: int) -> Iterator[np.ndarray]:
        """Positions within an epoch of `n` samples starting at G = `first` that ranks
        ranks[0]..ranks[1] read, in increasing order, in arrays of about `max_rows` (whole runs
        of (B-A+1)*m rows, one run per global batch)."""
        gb, k_rows = self.global_batch, (ranks[1] - ranks[0] + 1) * self.micro_batch
        off = self.phase + ranks[0] * self.micro_batch  # G of a run's first row, mod W*m
        k_lo = -((off + k_rows - 1 - first) // gb)  # first run ending after `first`
        k_hi = (first + n - 1 - off) // gb  # last run starting before the epoch's end
        # a run longer than a chunk (up to a global batch past the epoch): its rows in the epoch, a chunk at a time
        if k_rows > max_rows:
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


def slice_manifest(run: dict, source: str, rows: RankRows, first: int, last: int) -> dict:
    """The root manifest of the slice of ranks first..last of `run` (its manifest), staged from `source`."""
    return {
        **header_like(run, SLICE),
        "seq_len": run["seq_len"],
        "run": run_identity(run),
        "source": source,
        "world_size": rows.world_size,
        "micro_batch": rows.micro_batch,
        "ranks": list(range(first, last + 1)),
        "batch_phase": rows.phase,
        "epochs": [],
    }


def slice_epoch_manifest(root: dict, epoch: int, samples: int, first_sample: int, run_epoch: bytes) -> dict:
    """Epoch `epoch`'s manifest in the slice `root`, before its rank files are listed: the run's
    epoch of `samples` samples from G = `first_sample`, whose manifest's bytes are `run_epoch`."""
    return {
        **header_like(root, SLICE_EPOCH),
        "seq_len": root["seq_len"],
        "run": root["run"],
        **{k: root[k] for k in SLICE_SHAPE_KEYS},
        "epoch": epoch,
        "samples": samples,
        "first_sample": first_sample,
        "epoch_xxh3_128": xxhash.xxh3_128_hexdigest(run_epoch),
        "shards": [],
    }


def missing_padding(path: Path, root: dict, entry: dict) -> TokpackError | None:
    """The error for a rank file of a best-fit run's slice without its `.ds.pad` (staged before
    slices carried it): read anyway, its padding would be trained on as tokens."""
    run = root.get("run") if isinstance(root.get("run"), dict) else {}
    if not rows_padded(run) or has_pad(entry):
        return None
    ranks = root.get("ranks") or [0]
    return TokpackError(
        "node slice of a best-fit run lacks the padding of its rows (.ds.pad)",
        file=path / MANIFEST,
        where=f"shards[rank {entry.get('rank')}].pad_xxh3_128",
        expected="the rank file's padding sidecar",
        found="none (staged by a tokpack before slices carried it)",
        hint="stage it again, which rewrites the epochs lacking it: `"
        + stage_command(
            root.get("source") or "RUN",
            str(path.parent),
            ranks[0],
            ranks[-1],
            root.get("world_size"),
            root.get("micro_batch"),
            root.get("batch_phase") or 0,
        )
        + "`",
    )


def contained_epoch_dir(path, e: int):
    """Epoch e's folder of a slice or run, once known to stay inside it (not a symlink out)."""
    return contained(path, epoch_dir_name(e), manifest=path / MANIFEST, where=f"epochs ({e})", regular=False)


def slice_epoch_problems(
    d: Path, root: dict, m: dict, e: int, first: int, n: int, rows: RankRows
) -> Iterator[tuple[int | None, TokpackError]]:
    """Each way the manifest `m` of epoch e (the run's samples [first, first + n)) in the slice
    `root` at folder `d` disagrees with the slice and its rank arithmetic, as (the rank whose
    file cannot be read, or None for the whole epoch, the error). The reader raises the first;
    `validate` reports them all. A problem of the whole epoch is the last one given: what would
    follow means nothing. (A rank file's missing padding is `missing_padding`'s.)"""

    def bad(rank, message: str, key: str, expected, found, hint: str = "stage the slice again"):
        return rank, TokpackError(message, file=d / MANIFEST, where=key, expected=expected, found=found, hint=hint)

    for key in (*SLICE_KEYS, "seq_len", "dtype"):
        if m.get(key) != root.get(key):
            yield bad(
                None,
                "slice epoch belongs to another slice",
                key,
                root.get(key) if key != "run" else "the root's run",
                m.get(key) if key != "run" else "another run",
                "stage the slice again into an empty directory",
            )
            return
    found = (m.get("epoch"), m.get("first_sample"), m.get("samples"))
    if found != (e, first, n):
        yield bad(
            None, "slice epoch disagrees with its run's numbering", "epoch/first_sample/samples", (e, first, n), found
        )
        return
    ranks = [int(r) for r in root["ranks"]]
    entries = m.get("shards") if isinstance(m.get("shards"), list) else []
    names = [rank_file_name(r) for r in ranks]
    paths = [s.get("path") for s in entries]
    if [s.get("rank") for s in entries] != ranks or paths != names:
        yield bad(None, "slice epoch does not list one file per rank, in rank order", "shards", names, paths)
        return
    for r, s in zip(ranks, entries):
        want = rows.rows(r, first, first + n)
        if s.get("samples") != want:
            yield bad(
                r,
                "rank file holds the wrong number of samples",
                f"shards[rank {r}].samples",
                f"{want} (the samples rank {r} reads in epoch {e})",
                s.get("samples"),
            )
