"""Best-fit's rows rebuilt from the sources (tokpack.shuffle.packed): TokenPool assembles output
rows from a row table's pieces, for the in-memory engine, the replacement node and the replay;
the replay (`validate --against`) rebuilds every row from the manifest's parameters and the
sources alone and proves the row table, the packing rules and each shard's padding.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from tokpack.formats.constants import DEFAULT_PLAN_MEMORY
from tokpack.formats.errors import TokpackError
from tokpack.formats.io.gate import map_file, open_files_share
from tokpack.formats.hashes import hash_hex64, order_hash_terms, row_hashes
from tokpack.formats.shards import PackedSource

from ..plan import shard_count_checked
from .packed_plan import PackedPlan, check_planned_entries, packed_plan_from_manifest
from .passes import documents_of
from .table import row_padding, shard_places, table_rows

# -------------------------------------------------------------------- building rows

MIN_MAPPED = 64  # the fewest shards a TokenPool keeps mapped, whatever the open-files limit


class TokenPool:
    """Every used source's shards, memory-mapped (the page cache, no fresh memory), for the
    in-memory engine, the replacement node and the replay. A piece never spans two shards (no
    document does). `read_in=False`: the shards are not read in whole as they are mapped, only
    the pages of the pieces used (a replacement node's rows are 1/N of the source's, asked of
    the kernel ahead).

    At most `most` shards are mapped at once (the gate's share of the open-files limit: Python
    before 3.13 holds a file a mapping). A source of more shards, past a cluster's hard limit,
    failed with EMFILE; its shards are now mapped as pieces need them, the one mapped first
    unmapped first, each mapped once a call of `rows` (its pieces taken in shard order)."""

    def __init__(
        self, plan: PackedPlan, sources: list[PackedSource], on_shard=None, read_in: bool = True, most: int = 0
    ):
        used = [s for s, sp in enumerate(plan.sources) if sp.samples]
        self.dtype = sources[0].dtype
        self.files: list[tuple[PackedSource, int]] = []  # each part's (source, shard), in (source, shard) order
        self.first: dict[int, int] = {}  # source -> its first part
        for s in used:
            self.first[s] = len(self.files)
            self.files.extend((sources[s], k) for k in range(len(sources[s].shards)))
        self.most = most or max(MIN_MAPPED, open_files_share())
        self.maps: OrderedDict[int, np.ndarray] = OrderedDict()  # part -> its tokens, in the order mapped
        for p, (src, k) in enumerate(self.files):
            if p < self.most or on_shard is not None:  # every shard checked, and as many kept mapped as may be
                part = self._part(p, read_in)
                if on_shard is not None:
                    on_shard(src, k, part)
        self.read_in = read_in and len(self.files) <= self.most  # mapped as pieces need it: their pages alone
        self.parts = list(self.maps.values()) if len(self.files) <= self.most else None  # in part order
        self.sources = sources

    def _part(self, p: int, read_in: bool) -> np.ndarray:
        """Part p's tokens, mapped before or now (the one mapped first unmapped, past `most`)."""
        part = self.maps.get(p)
        if part is None:
            while len(self.maps) >= self.most:
                self.maps.popitem(last=False)  # its mapping, and file, closed as its last view goes
            src, k = self.files[p]
            n = int(src.shards[k]["tokens"])
            part = map_file(src.path / src.shards[k]["path"], 0, n * src.dtype.itemsize, read_in).view(src.dtype)
            self.maps[p] = part
        return part

    def rows(
        self, table: np.ndarray, g0: int, g1: int, row_tokens: int, pad_id: int, starts: np.ndarray | None = None
    ) -> np.ndarray:
        """Output rows [g0, g1) as an [n, row_tokens] token array. `starts`: each piece's first
        token in its source's stream (PackedTable.rows); None: from the sources' whole document
        tables (documents_of, O(documents): tests and small tools)."""
        out = np.full((g1 - g0, row_tokens), pad_id, dtype=self.dtype)
        a, b = np.searchsorted(table["g"], [g0, g1])
        t = table[a:b]
        if not len(t):
            return out
        src = t["source"].astype(np.int64)
        if starts is None:  # each piece's offset in its document, past the document's first token
            start = t["doc_offset"].astype(np.int64)
            for s in np.unique(src).tolist():
                start[src == s] += documents_of(self.sources[s])[0][t["doc"][src == s].astype(np.int64)]
        else:
            start = starts[a:b]
        part, local = shard_places(self.sources, self.first, src, start)
        dest = (t["g"].astype(np.int64) - g0) * row_tokens + t["row_offset"].astype(np.int64)
        # One slice copy per piece: pieces are documents, hundreds of tokens or more, and a loop
        # of memcpys measured 6x faster than gathering through per-token index arrays.
        flat, pieces = out.reshape(-1), (dest, part, local, t["length"])
        if self.parts is not None:  # every shard mapped: a list's index a piece (a lookup cost 15% more CPU)
            parts = self.parts
            for d, p, s, n in zip(*(x.tolist() for x in pieces)):
                flat[d : d + n] = parts[p][s : s + n]
            return out
        by = np.argsort(part, kind="stable")  # in shard order: each shard mapped once for this call
        last, tokens = -1, None
        for d, p, s, n in zip(*(x[by].tolist() for x in pieces)):
            if p != last:
                tokens, last = self._part(p, self.read_in), p
            flat[d : d + n] = tokens[s : s + n]
        return out


class PlannedPadding:
    """The padding the plan gives each output row, as each shard's `.ds.pad` checksum and the
    epoch's total: what proves, position by position, the padding the loader will mask (validate
    checks each `.ds.pad` against its recorded checksum; this checks that checksum against the
    plan). Rows arrive in output order; memory: one shard's hasher."""

    def __init__(self, per: int):
        self.per, self.rows, self.total = per, 0, 0
        self.digests: list[str] = []
        self._h = xxhash.xxh3_128()

    def add(self, pad: np.ndarray) -> None:
        self.total += int(pad.sum(dtype=np.int64))
        while len(pad):
            k = min(len(pad), self.per - self.rows % self.per)
            self._h.update(pad[:k].tobytes())
            self.rows, pad = self.rows + k, pad[k:]
            if self.rows % self.per == 0:
                self.digests.append(self._h.hexdigest())
                self._h = xxhash.xxh3_128()

    def problem(self, manifest: dict) -> tuple | None:
        """(field, expected, found) of the first place the manifest's padding is not the plan's."""
        if self.rows % self.per:
            self.digests.append(self._h.hexdigest())
            self._h = xxhash.xxh3_128()
        recorded = (manifest.get("packing") or {}).get("padding_tokens")
        if recorded != self.total:
            return "packing.padding_tokens", f"{self.total} (replayed from the sources)", recorded
        for i, (s, want) in enumerate(zip(manifest.get("shards") or [], self.digests)):
            if not isinstance(s, dict) or s.get("pad_xxh3_128") != want:
                found = s.get("pad_xxh3_128") if isinstance(s, dict) else s
                return f"shards[{i}].pad_xxh3_128", f"{want} (the padding its plan gives the rows, replayed)", found
        return None


def replay_packed(
    manifest: dict, sources: list[PackedSource], order: bool = True, memory: int = DEFAULT_PLAN_MEMORY
) -> tuple[str, list[int]]:
    """`validate --against`'s replay of a packed epoch (tokpack.shuffle.packings): (multiset
    hash, per-shard order hashes), as `plan.replay_hashes`, recomputed from its manifest's
    parameters and its sources alone, within `memory`. Rows are rebuilt in output order, so the
    order terms need no inverse. Its row table must also hash to the recorded
    `packing.table_xxh3_128` and keep the packing rules; either failure is one TokpackError, and
    so must each shard's recorded padding (PlannedPadding)."""
    plan = packed_plan_from_manifest(manifest, sources, memory)
    per, listed = shard_count_checked(manifest, plan.samples) if order else (1, 0)
    by_fp = {s.fingerprint: s for s in sources}
    opened = [by_fp[sp.fingerprint] for sp in plan.sources]
    pool = TokenPool(plan, opened)
    total, step = 0, 1 << 14
    shard_orders = np.zeros(listed, dtype=np.uint64)
    pads = PlannedPadding(per if order else max(plan.samples, 1))
    with table_rows(plan, opened) as built:
        for g0 in range(0, plan.samples, step):
            g1 = min(plan.samples, g0 + step)
            table, starts = built.rows(g0, g1)
            for s, sp in enumerate(plan.sources):  # the proof that no held-out document is in a row
                held = plan.holdout_of(s)
                if held is not None and held.left_out(table["doc"][table["source"] == s].astype(np.int64)).any():
                    raise TokpackError(
                        "a document of the other split is in the epoch",
                        where=f"sources[{s}] ({sp.name})",
                        expected="a training epoch: no held-out document; RUN/holdout/: only those",
                        hint="the epoch is not its plan's: shuffle it again",
                    )
            pads.add(row_padding(table, g1 - g0, plan.row_tokens, g0))
            hashes = row_hashes(pool.rows(table, g0, g1, plan.row_tokens, plan.pad_id, starts))
            total += int(hashes.sum(dtype=np.uint64))
            if order:  # uint64 sums wrap: mod 2^64
                g = np.arange(g0, g1, dtype=np.int64)
                np.add.at(shard_orders, g // per, order_hash_terms(g, hashes))
    packing, problems = manifest.get("packing") or {}, built.problems
    recorded = packing.get("table_xxh3_128")
    if problems:
        raise TokpackError(
            problems[0], where="packing", expected="the best-fit packing rules", found="; ".join(problems)
        )
    if built.table_xxh3_128 != recorded:
        raise TokpackError(
            "epoch's row table is not the one its plan packs",
            where="packing.table_xxh3_128",
            expected=f"{built.table_xxh3_128} (replayed from the sources)",
            found=recorded,
        )
    for key, want in built.figures.items():  # what the summaries show of the rows: recorded by older epochs or not
        found = packing.get(key, want)
        if found != want:
            raise TokpackError(
                "epoch's recorded row figures are not its rows'",
                where=f"packing.{key}",
                expected=f"{want} (replayed from the sources)",
                found=found,
                hint="restore the epoch's manifest from a good copy, or shuffle it again",
            )
    check_planned_entries(manifest, plan)  # what the summaries show of its sources: the plan's too
    padding = pads.problem(manifest) if order else None
    if padding:
        where, expected, found = padding
        raise TokpackError(
            "epoch's padding is not where its plan puts it: the loader would mask other tokens",
            where=where,
            expected=expected,
            found=found,
            hint="restore the epoch's .ds.pad files and manifest from a good copy, or shuffle it again",
        )
    return hash_hex64(total), shard_orders.tolist()
