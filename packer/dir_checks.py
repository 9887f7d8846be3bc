"""`tokpack validate`'s checks of one directory (tokpack.packer.validation runs them): its
manifest, its listing, each shard entry's files (row hashes, padding sidecars), and the report
its problems go to, bounded (ProblemList, DirReport).
"""

from __future__ import annotations

import os
import re
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from tokpack.formats.errors import TokpackError
from tokpack.formats.io.writes import TMP_MARK
from tokpack.formats.io.paths import name_problem
from tokpack.formats.io.gate import read_limited
from tokpack.formats.constants import EPOCH, KINDS, LOSS_SUFFIX, MANIFEST, PAD_DTYPE, PAD_SUFFIX, ROWS_SUFFIX, SOURCE
from tokpack.formats.constants import SHARD_SUFFIXES, SLICE
from tokpack.formats.checks import check_manifest
from tokpack.formats.names import dtype_from_name
from tokpack.formats.packing import has_pad, rows_padded
from tokpack.formats.hashes import hash_hex64, name_hash
from tokpack.formats.fields import type_ok
from tokpack.formats.shard_scan import Findings, Problem, ShardJob, worst_status
from tokpack.formats.shards import contained_shard, shard_suffixes
from tokpack.formats.reading import ShardEntries, read_manifest_text

from .slice_validation import slice_shard_jobs

# One shard file rarely has more than a few independent faults worth reading about;
# past this many lines the rest are counted, not listed.
MAX_PROBLEMS_PER_FILE = 5
# A directory lists its first problems and counts the rest: a manifest of 1.5M broken shard
# entries had 9M problems, and validate grew to 3.3 GB holding them (issue 32).
MAX_PROBLEMS_LISTED = 100
SHARD_FILE = re.compile(r".*\.ds(\.index|\.metadata|\.loss|\.pad|\.rows)?$")


class ProblemList(list):
    """A directory's problems, bounded: the first MAX_PROBLEMS_LISTED are kept (at most
    MAX_PROBLEMS_PER_FILE of one file), the rest only counted (`total` counts all); the first
    unlisted problem of each severity is kept too, so the status is the gravest of all."""

    def __init__(self, problems=()):
        super().__init__()
        self.total = 0  # every problem added, listed or not
        self.per_file: dict[str, int] = {}  # problems added per file that has a listed one (bounded with the list)
        self.unlisted_first: dict[str, Problem] = {}  # severity -> its first unlisted problem
        self.extend(problems)

    def append(self, p: Problem) -> None:
        self.total += 1
        n = self.per_file.get(p.file)
        if n is None and len(self) < MAX_PROBLEMS_LISTED:
            n = self.per_file[p.file] = 0
        if n is not None:
            self.per_file[p.file] = n + 1
            if n < MAX_PROBLEMS_PER_FILE and len(self) < MAX_PROBLEMS_LISTED:
                super().append(p)
                return
        self.unlisted_first.setdefault(p.severity, p)

    def extend(self, problems) -> None:
        for p in problems:
            self.append(p)

    def __iadd__(self, problems):
        self.extend(problems)
        return self

    @property
    def status(self) -> str:
        return worst_status([*self, *self.unlisted_first.values()])

    def summarised(self, where) -> "ProblemList":
        """The listed problems, then one line per file with more than it lists and one for the
        rest of directory `where`; `total` and the status stay those of every problem."""
        out = ProblemList()
        list.extend(out, self)
        listed, counted = Counter(p.file for p in self), len(self)
        for f, n in self.per_file.items():
            if n > listed[f]:
                list.append(out, Problem(f, None, None, None, f"{n - listed[f]} more problems in this file"))
                counted += n - listed[f]
        if self.total > counted:
            list.append(
                out,
                Problem(
                    str(where),
                    None,
                    None,
                    None,
                    f"{self.total - counted:,} more problems in other files of this directory, "
                    f"not listed (the report lists the first {MAX_PROBLEMS_LISTED})",
                ),
            )
        out.total, out.per_file, out.unlisted_first = self.total, dict(self.per_file), dict(self.unlisted_first)
        return out


@dataclass(kw_only=True)
class DirReport(Findings):
    """What validation found in one directory (a run's epochs get their own)."""

    problems: ProblemList = field(default_factory=ProblemList)  # bounded: the first problems, and a count

    path: Path  # the directory
    kind: str | None = None  # "source", "run", "epoch", or None when the manifest is unreadable
    manifest: dict | None = None  # its tokpack.json, when readable
    shard_orders: dict[str, int] = field(default_factory=dict)  # epoch: order hash recomputed per shard path
    proven: str | None = None  # an epoch of a --to-nodes RUN proven by --against: what (tokpack.packer.run_proof)

    @property
    def status(self) -> str:
        return self.problems.status


@dataclass
class ValidationReport:
    dirs: list[DirReport]  # every directory checked, runs before their epochs

    @property
    def problems(self) -> list[Problem]:
        return [p for d in self.dirs for p in d.problems]

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class Dir:
    report: DirReport  # filled in as checks run
    jobs: ShardJobs | list  # shard checks still to run (a list: none)
    partial: bool = False  # some shards absent by a partial stage: no whole-epoch sums to check


def open_manifest(path: Path, rep: DirReport, kinds) -> dict | None:
    """The directory's manifest, every problem reported (not the first): a source's or an
    epoch's `shards` read from its text entry by entry (ShardEntries), so validate's memory does
    not grow with the manifest's entries."""
    try:
        manifest, canonical, size = read_manifest_text(path, kinds)
    except TokpackError as e:
        rep.problems.append(Problem.from_error(e))
        return None
    if not canonical:  # as written, before earlier keys are renamed
        rep.add(
            path / MANIFEST,
            "bytes",
            "the JSON text tokpack writes",
            "different bytes (edited after writing?)",
            "manifest text was altered",
        )
    if manifest["kind"] not in (SOURCE, EPOCH) and isinstance(manifest.get("shards"), ShardEntries):
        manifest["shards"] = list(manifest["shards"])  # a slice's rank files: read as every command reads them
    rep.manifest = manifest
    rep.kind = manifest["kind"]
    rep.saw(size)
    return manifest


# The files a shard entry can have, after its name, each a bit of the entry's mask in check_listing.
_SUFFIX_BITS = {suffix: 1 << k for k, suffix in enumerate((*SHARD_SUFFIXES, ROWS_SUFFIX, PAD_SUFFIX))}


def check_listing(path: Path, shards: list[dict], rep: DirReport) -> None:
    """The directory holds no shard file the manifest does not list (the names were checked): a
    sidecar its entry does not record (a `.ds.pad` beside a window shard) is unlisted too."""
    # An entry's name as a 64-bit hash and its files as a bit mask, sorted by hash: 9 bytes an
    # entry, not a set of 4 names (validate's memory is not the manifest's length, issue 42).
    # A file is listed when its name less one of the suffixes hashes to a listed name whose
    # mask has that suffix; two names of one hash would only ever hide an unlisted file.
    n = len(shards)
    keys, masks = np.empty(n, np.uint64), np.empty(n, np.uint8)
    for i, s in enumerate(shards):
        keys[i] = name_hash(s["path"])
        # an unlisted loss mask has the shard scan's own line (formats/shard_scan.py)
        masks[i] = sum(_SUFFIX_BITS[x] for x in {*shard_suffixes(s), LOSS_SUFFIX})
    order = np.argsort(keys, kind="stable")
    keys, masks = keys[order], masks[order]
    del order

    def listed(name: str) -> bool:
        for suffix, bit in _SUFFIX_BITS.items():
            if name.endswith(suffix) and len(name) > len(suffix):
                key = np.uint64(name_hash(name[: len(name) - len(suffix)]))
                lo, hi = np.searchsorted(keys, key, "left"), np.searchsorted(keys, key, "right")
                if lo < hi and int(np.bitwise_or.reduce(masks[lo:hi])) & bit:
                    return True
        return False

    def unlisted(name: str) -> bool:  # a killed writer's leftover (TMP_MARK) is never data
        return TMP_MARK not in name and SHARD_FILE.match(name) is not None and not listed(name)

    if isinstance(path, Path):
        with os.scandir(path) as found:  # names only, one at a time: the unlisted ones are kept
            files = [path / name for name in sorted(e.name for e in found if unlisted(e.name))]
    else:  # a URL's listing
        files = sorted(p for p in path.iterdir() if unlisted(p.name))
    for p in files:
        rep.add(
            p,
            None,
            "only the files listed in the manifest",
            "an unlisted file",
            "file not listed in the manifest",
        )


def check_row_hashes(path: Path, shards: list[dict], rep: DirReport, quick: bool) -> None:
    """An epoch of `shuffle --to-nodes` holds its shards' row hashes only: each `.ds.rows` has
    one xxh3-64 per sample, its recorded checksum, and sums to the shard's multiset_hash (its
    rows are proven in each node slice, by `validate SLICE --against RUN`)."""
    for s in shards:
        f = path / f"{s['path']}{ROWS_SUFFIX}"
        want = 8 * int(s["samples"])
        try:
            data = read_limited(f, want, "row hashes")
        except TokpackError as e:
            rep.problems.append(Problem.from_error(e))
            continue
        rep.saw(len(data))
        if len(data) != want:
            rep.add(f, "size", f"{want} bytes (8 a sample)", f"{len(data)} bytes", "row hashes cut short")
        elif not quick and xxhash.xxh3_128_hexdigest(data) != s["rows_xxh3_128"]:
            rep.add(f, "rows_xxh3_128", s["rows_xxh3_128"], xxhash.xxh3_128_hexdigest(data), "row hashes damaged")
        elif not quick and hash_hex64(int(np.frombuffer(data, "<u8").sum(dtype=np.uint64))) != s["multiset_hash"]:
            rep.add(
                f,
                "multiset_hash",
                s["multiset_hash"],
                "another sum of the row hashes",
                "row hashes disagree with the shard's multiset hash",
            )


def check_pads(path: Path, shards: list[dict], rep: DirReport, row: int | None = None) -> int | None:
    """A best-fit epoch shard's `.ds.pad`: one uint32 per sample, each <= the sample's `row`
    tokens, matching its recorded checksum. Returns the padding summed over every shard, or None
    when some `.ds.pad` could not be read whole."""
    total = 0
    for i, s in enumerate(shards):
        # an entry of the wrong shape or types has its own lines (check_manifest): no file to read by it
        if not isinstance(s, dict) or not has_pad(s) or not isinstance(s.get("path"), str):
            continue
        if not type_ok(s.get("samples"), int):
            total = None  # nor a total without it
            continue
        f = path / f"{s['path']}{PAD_SUFFIX}"
        want = int(s.get("samples", -1)) * PAD_DTYPE.itemsize
        try:
            data = read_limited(f, max(want, 0), "padding sidecar")
        except TokpackError as e:
            rep.problems.append(Problem.from_error(e))
            total = None
            continue
        except FileNotFoundError:
            rep.add(f, None, "the padding sidecar the manifest lists", "no such file", "shard file missing")
            total = None
            continue
        rep.saw(len(data))  # counted with the shard's other files
        if len(data) != want:
            rep.add(
                f, "size", f"{want} bytes (4 per sample)", f"{len(data)} bytes", "padding sidecar has the wrong size"
            )
            total = None
            continue
        if xxhash.xxh3_128_hexdigest(data) != s["pad_xxh3_128"]:
            rep.add(f, "xxh3_128", s["pad_xxh3_128"], xxhash.xxh3_128_hexdigest(data), "checksum mismatch")
        pads = np.frombuffer(data, PAD_DTYPE)
        over = np.flatnonzero(pads > row) if row is not None else []
        if len(over):  # the loader would mask more than the row: its padding cannot be the row's
            rep.add(
                f,
                f"row {int(over[0])}",
                f"at most {row} padding tokens (seq_len + 1)",
                int(pads[over[0]]),
                f"padding longer than its row ({len(over)} row{'s' * (len(over) != 1)})",
                hint="restore the .ds.pad from a good copy, or shuffle the epoch again",
            )
            total = None  # no total to compare: the row is already wrong
        if total is not None:
            total += int(pads.sum(dtype=np.int64))
    return total


def check_padding(path: Path, m: dict, rep: DirReport) -> None:
    """A best-fit epoch (rows_padded): every shard entry lists its `.ds.pad` (without one the
    loader would serve padding as tokens), each fits its row, and together they sum to the
    recorded `packing.padding_tokens`."""
    # the entries that are objects, anew each time they are iterated: never a list of them
    shards = lambda: (s for s in m.get("shards") or [] if isinstance(s, dict))
    row = m["seq_len"] + 1 if type_ok(m.get("seq_len"), int) else None
    mfile = path / MANIFEST
    if rows_padded(m):
        for i, s in enumerate(shards()):
            if not has_pad(s):
                rep.add(
                    mfile,
                    f"shards[{i}].pad_xxh3_128",
                    "the checksum of the shard's .ds.pad (a best-fit epoch)",
                    "none",
                    "best-fit epoch shard lacks its padding sidecar: the loader would train on padding",
                    hint="restore the epoch from a good copy, or shuffle it again",
                )
    total = check_pads(path, shards(), rep, row)
    recorded = m.get("packing", {}).get("padding_tokens") if rows_padded(m) else None
    if total is not None and recorded is not None and all(has_pad(s) for s in shards()) and total != recorded:
        rep.add(
            mfile,
            "packing.padding_tokens",
            f"{total} (the sum of the shards' .ds.pad)",
            recorded,
            "padding total disagrees with the padding sidecars",
        )


def check_data_manifest(path: Path, m: dict, rep: DirReport, quick: bool) -> ShardJobs | list:
    """The manifest checks (tokpack.formats.checks.check_manifest, which every command applies) and the
    listing; returns the shard jobs (empty if the manifest cannot drive them)."""
    usable = check_manifest(m, path, rep.add)
    shards = m.get("shards")  # not a list: check_manifest's line says so, and no file is listed by it
    if isinstance(shards, list) and all(isinstance(s, dict) and name_problem(s.get("path")) is None for s in shards):
        check_listing(path, shards, rep)
        check_padding(path, m, rep)
    if not usable:
        return []
    kind = m["kind"]
    dtype = dtype_from_name(m["dtype"])
    row = m["seq_len"] + 1 if kind == EPOCH else None
    jobs = ShardJobs(path, shards, (kind, dtype, m["vocab_size"], m["eos_id"], m["tokenizer"], row, quick))
    for i, s in enumerate(shards):
        if name_problem(s["path"]):
            continue  # reported by check_manifest; never opened
        try:
            contained_shard(path, s, i)
        except TokpackError as e:  # a symlink out of the folder: reported, never opened
            rep.problems.append(Problem.from_error(e))
            continue
        jobs.indices.append(i)
    return jobs


class ShardJobs:
    """A directory's shard checks, each ShardJob made from its manifest entry when its turn comes
    (not one held per shard): the entries' indices, and what every job shares."""

    def __init__(self, path: Path, shards: list, shared: tuple):
        self.path, self.shards, self.shared = path, shards, shared
        self.indices = array("q")  # the entries that are checked
        self.per: int | None = None  # number_samples: samples a shard
        self.last: dict[str, int] = {}  # number_samples: a name listed twice -> its last entry

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self):
        for i in self.indices:
            s = self.shards[i]
            job = ShardJob(self.path, s, *self.shared)
            if self.per is not None:
                job.first_sample = self.last.get(s["path"], i) * self.per
            yield job

    def entries(self):
        """The checked entries, in order, each read from the manifest's text as it comes."""
        return (self.shards[i] for i in self.indices)

    def number_samples(self, per: int) -> None:
        """Each job's first_sample: its entry's index times `per` (shard_samples); for a name
        listed twice, its last entry's, as a name -> position table has it."""
        keys = np.fromiter((name_hash(s["path"]) for s in self.shards), np.uint64, len(self.shards))
        order = np.argsort(keys, kind="stable")
        same = np.flatnonzero(keys[order][1:] == keys[order][:-1])
        for i in np.union1d(order[same], order[same + 1]):  # the entries sharing a hash, in order
            self.last[self.shards[int(i)]["path"]] = int(i)
        self.per = per


def plan_dir(path: Path, quick: bool, kinds=None) -> Dir:
    rep = DirReport(path=path)
    d = Dir(rep, [])
    if not path.exists():
        rep.add(path, None, None, None, "no such directory", missing=True, hint="check the path or URL")
        return d
    if not path.is_dir():
        rep.add(
            path,
            None,
            "a tokpack directory",
            "a file",
            "not a directory",
            hint="pass the directory that holds tokpack.json",
        )
        return d
    m = open_manifest(path, rep, kinds or (*KINDS, SLICE))
    if m is None:
        return d
    if m["kind"] in (SOURCE, EPOCH):
        d.jobs = check_data_manifest(path, m, rep, quick)
    elif m["kind"] == SLICE:  # a node slice: its rank files are checked as epoch shards
        d.jobs = slice_shard_jobs(path, m, rep, quick) if check_manifest(m, path, rep.add) else []
        row = m["seq_len"] + 1 if type_ok(m.get("seq_len"), int) else None
        for job in d.jobs:  # a slice of a best-fit run: each rank file's padding sidecar
            check_pads(job.directory, [job.entry], rep, row)
    return d
