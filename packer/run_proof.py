"""`validate RUN --against SOURCES` of an epoch `shuffle --to-nodes` wrote (issue 42, item 3): RUN
holds no token file, only each shard's row hashes (`.ds.rows`) and, best-fit, its padding
(`.ds.pad`), so the proof a materialised epoch gets from its scanned samples is made from those.

Each shard's order hash is recomputed from its `.ds.rows` (the order terms of docs/FORMAT.md,
"Checksums", keyed by each row's epoch position) and compared with the one the plan's replay gives
(tokpack.packer.validation's `replay`, which reads the sources once): equal for every shard, the
epoch's content and order are proven, and best-fit padding with them (the replay proves each
shard's `pad_xxh3_128`, dir_checks each `.ds.pad` against it). A shard that differs, or a replay
that refuses the epoch, sends the proof position by position: the rows the plan puts at each of
the shard's positions rebuilt from the sources by `source_rows` (tokpack.packer.replacement's
SourceRows, given by the caller: this layer imports nothing from shuffle/), a part at a time, their
xxh3-64 and padding against RUN's files, streamed. The first position that differs is one line
naming RUN's file, the position, what the sources give there and what RUN holds.
"""

from __future__ import annotations

import tempfile
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from tokpack.formats.constants import EPOCH, MASK64
from tokpack.formats.errors import TokpackError
from tokpack.formats.io.gate import open_read
from tokpack.formats.io.reads import read_full
from tokpack.formats.hashes import hash_hex64, order_hash, row_hashes
from tokpack.formats.packing import has_pad
from tokpack.formats.constants import PAD_DTYPE, PAD_SUFFIX, ROW_HASH_DTYPE, ROWS_SUFFIX
from tokpack.formats.shards import tokens_on_nodes

from .dir_checks import DirReport
from .slice_validation import RowDiffs

# Row hashes read at a time when an order hash is recomputed from `.ds.rows`: 8 MiB of hashes.
ORDER_BLOCK = 1 << 20

RESTORE_HINT = (
    "RUN's file was changed after the run was written (its checksum with it): restore RUN from a good copy, or "
    "rerun the --to-nodes command that wrote it (if a source is reported damaged too, restore the source first)"
)


def on_nodes(d: DirReport) -> bool:
    """Whether `d` is an epoch whose tokens `shuffle --to-nodes` wrote to the nodes (RUN has
    its row hashes only)."""
    m = d.manifest
    return d.kind == EPOCH and isinstance(m, dict) and tokens_on_nodes(d.path, m.get("shards") or [])


def prove_on_nodes(d: DirReport, planned: list[int] | None, source_rows) -> bool:
    """An epoch of a --to-nodes RUN against its plan: `planned`, each shard's order hash the
    replay gave (None: the replay refused the epoch). Marks `d.proven` when every shard's
    `.ds.rows` gives its planned order hash; otherwise finds the first position whose row (or
    padding) is not the plan's and reports it in one line. True when it reported a problem (the
    caller's coarser lines of the same fault, multiset or replay refusal, are then left out)."""
    m = d.manifest
    if not _sound(m):
        return False  # its manifest's own lines say what is wrong; there is nothing to follow
    shards, per = m["shards"], m["shard_samples"]
    if planned is not None:
        try:
            found = [
                _order_of(d.path / f"{s['path']}{ROWS_SUFFIX}", i * per, int(s["samples"]))
                for i, s in enumerate(shards)
            ]
        except (TokpackError, OSError):
            return False  # a row file that cannot be read whole: already reported by its own check
        wrong = [i for i, (have, want) in enumerate(zip(found, planned)) if have != want]
        if not wrong:
            what = "order, content and padding" if any(has_pad(s) for s in shards) else "order and content"
            d.proven = f"{what} proven from its row hashes against the sources"  # what the report says it holds
            return False
    else:
        wrong, found = list(range(len(shards))), None
    first = _locate(d, wrong, source_rows) if source_rows is not None else None
    if first is not None:
        first.report(d)
        return True
    if planned is None:
        return False  # nothing found position by position: the replay's own line says what is wrong
    i = wrong[0]
    d.add(  # no row rebuilt from the sources (unreadable, or no `source_rows`): the shard, not the position
        d.path / f"{shards[i]['path']}{ROWS_SUFFIX}",
        "order_hash",
        f"{hash_hex64(planned[i])} (replayed from the sources)",
        f"{hash_hex64(found[i])} (from its row hashes)",
        f"row hashes are not the plan's rows in the plan's order ({len(wrong)} of {len(shards)} shards differ)",
        hint=RESTORE_HINT,
    )
    return True


def _sound(m: dict) -> bool:
    """Whether the fields the proof follows are there: shard entries with a file name and a
    count of samples, and the epoch's shard size (a broken manifest is reported by its checks)."""
    shards, per = m.get("shards"), m.get("shard_samples")
    return (
        isinstance(shards, list)
        and type(per) is int
        and per > 0
        and all(
            isinstance(s, dict)
            and isinstance(s.get("path"), str)
            and type(s.get("samples")) is int
            and s["samples"] >= 0
            for s in shards
        )
    )


def _order_of(f: Path, g0: int, n: int) -> int:
    """The order hash of a `.ds.rows` of `n` row hashes whose first sits at epoch position g0,
    read ORDER_BLOCK hashes at a time."""
    total = 0
    buf = np.empty(min(max(n, 1), ORDER_BLOCK), dtype=ROW_HASH_DTYPE)
    with open_read(f, size=n * ROW_HASH_DTYPE.itemsize, what="row hashes") as fh:
        for a in range(0, n, len(buf)):
            k = min(len(buf), n - a)
            _read_exactly(fh, buf[:k], f, a)
            total += order_hash(np.arange(g0 + a, g0 + a + k, dtype=np.int64), buf[:k])
    return total & MASK64


def _read_exactly(fh, out: np.ndarray, f: Path, row: int) -> None:
    view = memoryview(out.view(np.uint8))
    if read_full(fh, view) != view.nbytes:
        raise TokpackError("file is shorter than its manifest says", file=f, where=f"row {row}")


class _Found:
    """Where RUN's `.ds.rows` and `.ds.pad` first differ from the rows the sources give, in the
    order found: per suffix, the file, its RowDiffs and the shards that differ."""

    def __init__(self):
        self.by_suffix: dict[str, tuple[Path, RowDiffs, set]] = {}

    def add(self, suffix: str, f: Path, i: int, a: int, pos: np.ndarray, want: np.ndarray, have: np.ndarray) -> None:
        if (want != have).any():
            _, diffs, shards = self.by_suffix.setdefault(suffix, (f, RowDiffs(), set()))
            diffs.add(a, pos, want, have)
            shards.add(i)

    def report(self, d: DirReport) -> None:
        e = d.manifest.get("epoch")
        for suffix, (f, diffs, shards) in self.by_suffix.items():
            row, want, position, have = diffs.first
            n = len(shards)
            more = f" ({diffs.count} rows differ in {n} shard{'s' * (n != 1)})" if diffs.count > 1 else ""
            expected, found, message = (
                (
                    f"{want:016x} (the row the plan puts there, rebuilt from the sources)",
                    f"{have:016x}",
                    "row hash is not the plan's row at that position: rows swapped, dropped, duplicated or altered",
                )
                if suffix == ROWS_SUFFIX
                else (
                    f"{want} padding tokens (the plan's row there, rebuilt from the sources)",
                    have,
                    "padding is not the plan's row's at that position: the loader would mask other tokens",
                )
            )
            where = f"row {row} (epoch {e}, sample {position})"
            d.add(f, where, expected, found, message + more, hint=RESTORE_HINT)


def _locate(d: DirReport, wrong: list[int], source_rows) -> _Found | None:
    """Shards `wrong` of epoch `d` compared position by position with the rows the sources give
    there (SourceRows, a part of its `part_rows` at a time); None when nothing differs, or the
    sources cannot be replayed (the replay's own line says why)."""
    m = d.manifest
    per = m["shard_samples"]
    out = _Found()
    with tempfile.TemporaryDirectory(prefix="tokpack-validate-") as work:
        try:
            rows = source_rows(d.path, m, Path(work) / "table")
        except (TokpackError, OSError):
            return None
        try:
            for i in wrong:
                _compare_shard(d.path, m["shards"][i], i, i * per, rows, out)
        except (TokpackError, OSError):
            return None  # a file that cannot be read whole is reported by its own check
        finally:
            rows.close()
    return out if out.by_suffix else None


def _compare_shard(folder: Path, s: dict, i: int, g0: int, rows, out: _Found) -> None:
    """Shard i's `.ds.rows` (and `.ds.pad`) against the rows `rows` rebuilds at its positions."""
    n = int(s["samples"])
    f, fp = folder / f"{s['path']}{ROWS_SUFFIX}", folder / f"{s['path']}{PAD_SUFFIX}"
    part = max(1, min(n, int(rows.part_rows)))
    have = np.empty(part, dtype=ROW_HASH_DTYPE)
    have_pad = np.empty(part, dtype=PAD_DTYPE)
    with (  # a shard without a `.ds.pad` (windows): no padding to compare
        open_read(f, size=n * ROW_HASH_DTYPE.itemsize, what="row hashes") as fh,
        open_read(fp, size=n * PAD_DTYPE.itemsize, what="padding sidecar") if has_pad(s) else nullcontext() as ph,
    ):
        for a in range(0, n, part):
            k = min(part, n - a)
            pos = np.arange(g0 + a, g0 + a + k, dtype=np.int64)
            tokens, pad = rows.rows(pos)
            _read_exactly(fh, have[:k], f, a)
            out.add(ROWS_SUFFIX, f, i, a, pos, row_hashes(tokens), have[:k])
            if ph is not None and pad is not None:
                _read_exactly(ph, have_pad[:k], fp, a)
                out.add(PAD_SUFFIX, fp, i, a, pos, pad, have_pad[:k])
