"""Best-fit's plan (tokpack.shuffle.packed): per source and pass the rows its documents pack
into (R_{s,p}, counted by packing the pass, group by group, within the plan's budget), the
mixture over rows, each source's chain from its cursor, the epoch order sigma_e; and what the
manifests record of it. The plan holds row counts only, O(#sources x passes); its row table is
tokpack.shuffle.packed.table's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np

from tokpack.formats.checks import chain_start
from tokpack.formats.constants import DEFAULT_PLAN_MEMORY
from tokpack.formats.errors import TokpackError
from tokpack.formats.packing import holdout_recorded, record_holdout
from tokpack.formats.shards import PackedSource

from ..holdout import Holdout, holdout_of
from ..plan import EpochPlan, check_samples, source_head, source_not_given
from ..mixture import check_passes, mixture
from .passes import (
    MIN_CHUNK,
    Buckets,
    check_real,
    document_count,
    iter_pass,
    one_group_passes,
    permuted_documents,
    scratch,
)

BEST_FIT = "best-fit"  # its `--packing` name (tokpack.shuffle.packings), and a run's `packing.method`
PACKED_ALGORITHM = "tokpack-bfd-feistel6-splitmix-xxh3-v1"  # the `shuffle` name of a packed epoch
# A group's documents and rows are held while it is packed (about 60 bytes a document); at 2^22
# tokens the padding of web-like lengths is under 0.5% at seq_len 4096 (BENCHMARKS.md, "Best-fit
# packing"), and a group is a few MB of plan state, far inside any --memory.
DEFAULT_GROUP_TOKENS = 1 << 22


@dataclass(frozen=True)
class PackedSourcePlan:
    """One source's share of a packed epoch; `windows` holds R_{s,0} (the rows of pass 0, the
    basis of the mixture), so the manifest's source fields keep their meaning for the summary."""

    index: int
    name: str
    path: str
    fingerprint: str
    weight: str | None
    tokens: int
    documents: int  # D_s
    windows: int  # R_{s,0}
    samples: int  # c_s
    base: int
    cursor: int | None = None
    offset: int = 0  # no jitter: kept so the manifest fields of both plans agree
    first_pass: int = 0
    passes: int = 0
    pass_rows: tuple[int, ...] = ()  # R_{s,p} for the passes this epoch touches
    held: int = 0  # k_s: its documents held out of every epoch (tokpack.shuffle.holdout)


@dataclass(frozen=True)
class PackedPlan:
    """A packed epoch (see the module docstring). Implements tokpack.shuffle.plan.SamplePlan."""

    seed: int
    epoch: int
    seq_len: int
    samples: int
    sources: tuple[PackedSourcePlan, ...]
    group_tokens: int
    pad_id: int
    jitter: bool = False
    holdout: dict | None = None  # `--holdout` as recorded (tokpack.shuffle.holdout.parse_holdout), or None
    split: bool = False  # the plan of RUN/holdout/: the held-out documents only (one pass over them)
    # The budget (bytes) its own work keeps within: counting a pass's rows permutes the pass's
    # documents within it, and so do the row table and the repeat count.
    memory: int = field(default=DEFAULT_PLAN_MEMORY, compare=False, repr=False)

    # The same chains and the same epoch order as the window plan.
    row_tokens = EpochPlan.row_tokens
    chain_start = EpochPlan.chain_start
    order = EpochPlan.order

    @property
    def algorithm(self) -> str:
        return PACKED_ALGORITHM

    def dropped_tokens(self) -> int:
        return 0

    def first_pass(self, s: int) -> int:
        return self.sources[s].first_pass

    def passes(self, s: int) -> int:
        return self.sources[s].passes

    def repeat_counts(self, s: int) -> tuple[int, int | None]:
        """(the rows of source s that hold a piece (a document or a fragment) an earlier row of
        its chain in this epoch holds, its samples): one unit, rows, the samples' (a pass's
        rows are packed afresh, so a row never repeats a row; its pieces repeat), as the window
        plan counts samples. None for the total when it takes one pass (not counted).

        Every pass holds every piece once, so the first pass the epoch takes whole holds every
        piece: each row after it repeats. The rows before it are those of the first pass, which
        repeat nothing, and (when that is partial) of the second, whose rows repeat when they
        hold a piece of the first's part (compared by keys, rows_holding_repeats)."""
        sp = self.sources[s]
        if sp.passes < 2:
            return 0, None
        src = PackedSource.open(sp.path, check_sizes=False)
        lo, hi = self.chain_start(s), self.chain_start(s) + sp.samples
        p0 = sp.first_pass
        at0 = pass_start(self, s, p0, src)
        at1 = at0 + pass_rows(self, s, p0, src)
        if lo == at0:  # the first pass is whole
            return hi - at1, sp.samples
        end1 = at1 + pass_rows(self, s, p0 + 1, src)
        later = max(0, hi - end1)  # the rows after the second pass, which is whole when they exist
        return later + rows_holding_repeats(self, s, src, (lo - at0, hi - at1)), sp.samples

    # As the window plan's: `repeats` counts the samples (rows) that hold a piece the epoch's
    # earlier rows of the source hold, out of `repeat_total` samples (`repeat_unit` names them
    # rows for the summary and the warnings, since no row repeats a row).
    source_report = EpochPlan.source_report
    repeat_unit = "rows"

    def source_entries(self) -> list[dict]:
        return [
            {
                **source_head(s),
                "first_pass": s.first_pass,
                "passes": s.passes,
                "windows": s.windows,
                "tokens": s.tokens,
                "offset": 0,
                "dropped_tokens": 0,
                "documents": s.documents,
                **({} if s.cursor is None else {"cursor": s.cursor}),
                **({} if self.holdout is None else {"held_documents": s.held}),
            }
            for s in self.sources
        ]

    def packing_entry(self, table_hash: str, padding: int, figures: dict | None = None) -> dict:
        """The epoch manifest's `packing` object; `figures`: RowFigures.fields() of its rows."""
        return {
            **packing_settings([], self.pad_id, self.group_tokens),  # its holdout fields go last
            "padding_tokens": padding,
            "table_xxh3_128": table_hash,
            **(figures or {}),
            **record_holdout(self.holdout, self.split, padded=True),
        }

    def holdout_of(self, s: int) -> "Holdout | None":
        """Source s's held-out documents (None: it holds none out)."""
        sp = self.sources[s]
        return Holdout(sp.documents, sp.held, self.seed, sp.fingerprint, self.split) if sp.held else None


_ROWS: dict[tuple, int] = {}  # _rows_key -> R_{s,p}
_PIECES: dict[tuple, int] = {}  # the same key -> the pass's pieces


def _rows_key(plan, s: int, p: int) -> tuple:
    """What pass p over source s's rows depend on: the source, the seed, the row and group sizes, and
    the documents held out of it."""
    sp = plan.sources[s]
    return (sp.fingerprint, plan.seed, s, p, plan.row_tokens, plan.group_tokens, sp.held, plan.split)


def one_group_of(plan, s: int, src: PackedSource, memory: int | None = None):
    """Source s's passes as one_group_passes gives them (None: packed one by one)."""
    return one_group_passes(
        src, plan.row_tokens, plan.group_tokens, plan.memory if memory is None else memory, plan.holdout_of(s)
    )


def _iter_plan_pass(plan, s: int, p: int, src: PackedSource, memory: int, scratch: str | None):
    """iter_pass over pass p of source s, with the plan's seed, sizes and holdout."""
    return iter_pass(src, s, p, plan.seed, plan.row_tokens, plan.group_tokens, memory, scratch, plan.holdout_of(s))


def pass_rows(plan, s: int, p: int, src: PackedSource) -> int:
    """R_{s,p}, the rows of pass p over source s: the pass is packed group by group (iter_pass,
    bounded by the plan's memory) and counted; the count is kept. A source of one group a pass
    has the same rows every pass, counted once (OneGroupPasses)."""
    key = _rows_key(plan, s, p)
    if key not in _ROWS:
        one = one_group_of(plan, s, src)
        if one is not None:
            return one.rows
        rows = pieces = 0
        for _, n, (row, *_) in _iter_plan_pass(plan, s, p, src, plan.memory, None):
            rows, pieces = rows + n, pieces + len(row)
        _ROWS[key], _PIECES[key] = rows, pieces
    return _ROWS[key]


def epoch_pieces(plan, s: int) -> tuple[int, int] | None:
    """(pieces packed in the passes of source s this epoch touches, pieces of s the epoch
    takes, each partial pass counted by its share of rows): known once the plan has counted
    those passes' rows in this process (pass_rows), else None. For `tokpack plan`'s time."""
    sp = plan.sources[s]
    lo, hi = plan.chain_start(s), plan.chain_start(s) + sp.samples
    one = one_group_of(plan, s, PackedSource.open(sp.path, check_sizes=False)) if sp.passes else None
    packed = taken = 0.0
    at = None
    for p in range(sp.first_pass, sp.first_pass + sp.passes):
        if one is not None:
            rows, pieces = one.rows, one.pieces
            at = p * rows if at is None else at
        else:
            key = _rows_key(plan, s, p)
            if key not in _PIECES:
                return None
            if at is None:
                at = sum(_ROWS.get(_rows_key(plan, s, k), 0) for k in range(p))
            rows, pieces = _ROWS[key], _PIECES[key]
        share = max(0, min(hi, at + rows) - max(lo, at)) / max(1, rows)
        packed, taken, at = packed + pieces, taken + pieces * share, at + rows
    return int(packed), int(taken)


def pass_start(plan, s: int, p: int, src: PackedSource) -> int:
    """Chain position of the first row of pass p: the rows of passes 0..p-1."""
    one = one_group_of(plan, s, src)
    if one is not None:
        return p * one.rows
    return sum(pass_rows(plan, s, k, src) for k in range(p))


def _locate_chain(plan, s: int, lo: int, n: int, src: PackedSource) -> tuple[int, int, tuple[int, ...]]:
    """(first pass, passes, their row counts) covering chain positions [lo, lo + n)."""
    one = one_group_of(plan, s, src)
    if one is not None:  # every pass the same rows: arithmetic
        first, last = lo // one.rows, (lo + n - 1) // one.rows
        return first, last - first + 1, (one.rows,) * (last - first + 1)
    p = at = 0
    counts = []  # of the passes from the first that ends past lo: the last ones the loop reads
    while at < lo + n:
        r = pass_rows(plan, s, p, src)
        if at + r > lo:
            counts.append(r)
        at, p = at + r, p + 1
    return p - len(counts), len(counts), tuple(counts)


class PackedOptions(NamedTuple):
    """A packed plan's settings past the epoch's own: its rows' group size and pad id (None: the
    defaults), a schedule's chains (each source's cursor and samples), and `--holdout` (the
    spec as recorded; `split`: the plan of RUN/holdout/, the held-out documents only)."""

    group_tokens: int | None = None
    pad_id: int | None = None
    cursors: list[int | None] | None = None
    counts: list[int] | None = None
    holdout: dict | None = None
    split: bool = False


def packed_epoch_plan(
    sources: list[PackedSource],
    *,
    seq_len: int,
    seed: int,
    epoch: int,
    weights: list[str | None] | None = None,
    samples: int | None = None,
    tokens: int | None = None,
    names: list[str] | None = None,
    memory: int = DEFAULT_PLAN_MEMORY,
    options: "PackedOptions | None" = None,
) -> PackedPlan:
    """The packed plan of one epoch. c_s: as the window plan apportions samples, with R_{s,0}
    (the rows of pass 0) in place of W_s. `options.counts` (a schedule's per-source samples)
    overrides it. `memory`: the plan's budget (bytes; shuffle's --memory), within which it counts
    its passes."""
    group_tokens, pad_id, cursors, counts, holdout, split = options or PackedOptions()
    if not sources:
        raise TokpackError("no sources given", hint="tokpack shuffle SOURCE[=WEIGHT]... -o OUT --packing best-fit")
    pad = sources[0].eos_id if pad_id is None else int(pad_id)
    if not 0 <= pad < sources[0].vocab_size:
        raise TokpackError(
            "pad id outside the vocabulary",
            where="--pad-id",
            expected=f"0..{sources[0].vocab_size - 1}",
            found=pad,
            hint="leave --pad-id out to pad with the EOS id",
        )
    for src in sources:
        check_real(src)
    documents = [document_count(src) for src in sources]
    held = [held_out(src, holdout, seed, memory).held for src in sources]
    stub = PackedPlan(
        int(seed),
        int(epoch),
        int(seq_len),
        0,
        tuple(
            PackedSourcePlan(
                s, "", str(src.home), src.fingerprint, None, src.tokens, documents[s], 0, 0, 0, held=held[s]
            )
            for s, src in enumerate(sources)
        ),
        int(group_tokens or DEFAULT_GROUP_TOKENS),
        pad,
        holdout=holdout,
        split=bool(split),
        memory=max(1, int(memory)),
    )
    rows0 = [pass_rows(stub, s, 0, src) for s, src in enumerate(sources)]
    for src, rows in zip(sources, rows0):
        if rows == 0:  # its chain would hold nothing to take
            raise TokpackError(
                "source holds no documents",
                file=src.path,
                where="documents",
                expected=">= 1 document",
                found=0,
                hint="drop this source",
            )
    weights = list(weights) if weights is not None else [None] * len(sources)
    if counts is None:
        counts = mixture(sources, weights, rows0, samples=samples, tokens=tokens, seq_len=seq_len)[1]
    check_passes(sources, counts, rows0, "rows a pass")
    plans, base = [], 0
    for s, sp in enumerate(stub.sources):
        cursor = None if cursors is None else cursors[s]
        sp = replace(
            sp,
            name=names[s] if names else sources[s].home.name,
            weight=None if weights[s] is None else str(weights[s]),
            windows=rows0[s],
            samples=counts[s],
            base=base,
            cursor=cursor,
        )
        if sp.samples:  # the passes its chain covers (the stub holds what a pass's rows depend on)
            first, k, rows = _locate_chain(stub, s, chain_start(stub.epoch, sp.samples, cursor), sp.samples, sources[s])
            sp = replace(sp, first_pass=first, passes=k, pass_rows=rows)
        plans.append(sp)
        base += counts[s]
    return replace(stub, samples=base, sources=tuple(plans))


def packed_plan_from_manifest(
    manifest: dict, sources: list[PackedSource], memory: int = DEFAULT_PLAN_MEMORY
) -> PackedPlan:
    """The packed plan an epoch manifest was written from, against the opened sources (matched
    by fingerprint, in any order); `memory`: its budget, as in packed_epoch_plan."""
    pk = manifest.get("packing")
    if not isinstance(pk, dict) or pk.get("method") != BEST_FIT:
        raise TokpackError(
            "packed epoch without its packing", where="packing", expected=f"{{method: {BEST_FIT}, ...}}", found=pk
        )
    entries = manifest.get("sources") or []
    pool = {s.fingerprint: s for s in sources}
    for i, e in enumerate(entries):
        if e.get("fingerprint") not in pool:
            raise source_not_given(i, e, sources, "none")
    counts, cursors = [int(e["samples"]) for e in entries], [e.get("cursor") for e in entries]
    plan = packed_epoch_plan(
        [pool[e["fingerprint"]] for e in entries],
        seq_len=int(manifest["seq_len"]),
        seed=int(manifest["seed"]),
        epoch=int(manifest["epoch"]),
        weights=[e.get("weight") for e in entries],
        names=[e.get("name", "") for e in entries],
        memory=memory,
        options=PackedOptions(
            int(pk["group_tokens"]),
            int(pk["pad_id"]),
            None if all(c is None for c in cursors) else cursors,
            counts,
            *holdout_recorded(manifest),  # formats.packing knows where each packing records it
        ),
    )
    check_samples(manifest, plan.samples)
    return plan


# What a packed epoch's source entries record of its plan: shuffle's summary and inspect show
# them, and no check of the manifest alone can tell them from an edit (its passes, its rows).
_PLANNED = ("first_pass", "passes", "windows", "tokens", "offset", "dropped_tokens", "documents", "held_documents")


def check_planned_entries(manifest: dict, plan: PackedPlan) -> None:
    """Each source entry of `manifest` records the figures of `plan`, made from its sources."""
    for i, (e, want) in enumerate(zip(manifest.get("sources") or [], plan.source_entries())):
        for key in _PLANNED:
            if key in want and (type(e.get(key)) is not int or e[key] != want[key]):
                raise TokpackError(
                    "epoch manifest's source entry is not its plan's",
                    where=f"sources[{i}].{key}",
                    expected=f"{want[key]} (replayed from the sources)",
                    found=e.get(key, "no such field"),
                    hint="the manifest was edited or damaged: restore the epoch from a good copy, or shuffle it again",
                )


def chain_pieces(plan, s: int, src: PackedSource, memory: int, scratch: str | None):
    """The pieces of source s this epoch takes, group by group: (chain-derived output position
    q = base + chain position - cursor, row_offset, doc, doc_offset, length, first token in
    the stream, the document's length, the pass), passes packed by iter_pass; a source of one
    group a pass (OneGroupPasses), a batch of passes at a time within `memory`."""
    sp = plan.sources[s]
    lo, hi = plan.chain_start(s), plan.chain_start(s) + sp.samples
    one = one_group_of(plan, s, src, memory)
    if one is not None:
        end, step = sp.first_pass + sp.passes, one.batch(memory)
        for p0 in range(sp.first_pass, end, step):
            p, row, *rest = one.place(plan.seed, s, p0, min(end, p0 + step))
            chain = p * one.rows + row
            sel = np.flatnonzero((chain >= lo) & (chain < hi))
            yield (sp.base + chain[sel] - lo, *(c[sel] for c in rest), p[sel])
        return
    at = pass_start(plan, s, sp.first_pass, src)
    for p in range(sp.first_pass, sp.first_pass + sp.passes):
        a, b = lo - at, hi - at  # the pass's rows this epoch takes
        for first, n, (row, *rest) in _iter_plan_pass(plan, s, p, src, memory, scratch):
            if first + n <= a:
                continue
            if first >= b:
                break
            sel = np.flatnonzero((row >= a) & (row < b))
            yield (sp.base + at + row[sel] - lo, *(c[sel] for c in rest), np.full(len(sel), p, np.int64))
        at += pass_rows(plan, s, p, src)


REPEAT_KEY = np.dtype([("doc", "<u8"), ("doc_offset", "<u8"), ("row", "<i8")])  # row -1: a piece of the first pass


def rows_holding_repeats(plan, s: int, src: PackedSource, cut: tuple[int, int]) -> int:
    """The rows [0, cut[1]) of the second pass over source s this epoch touches that hold a
    piece of the first pass's rows [cut[0], ...): the pieces of both go, keyed, to bucket files
    by document range (one file when they fit the plan's memory), each bucket names the second
    pass's rows holding a key of the first, and those go to bucket files by row range, each
    counted once. Two passes' pieces, whatever the passes the epoch takes."""
    sp, memory = plan.sources[s], plan.memory
    first, second = sp.first_pass, sp.first_pass + 1
    per_doc = 2 * (1 + src.tokens // max(1, sp.documents * plan.row_tokens))  # pieces of a document in two passes
    per = max(MIN_CHUNK, memory // (4 * REPEAT_KEY.itemsize * per_doc))  # documents a bucket
    per_row = max(MIN_CHUNK, memory // (4 * 8))
    one = one_group_of(plan, s, src)
    with scratch() as d:
        keys, rows = Buckets(Path(d), "keys"), Buckets(Path(d), "rows")
        if one is not None:
            p, row, _, doc, do, *_ = one.place(plan.seed, s, first, second + 1)
            parts = [(row[p == q], doc[p == q], do[p == q], q == second) for q in (first, second)]
        else:
            parts = (
                (row, doc, do, p == second)
                for p in (first, second)
                for _, _, (row, _, doc, do, *_) in _iter_plan_pass(plan, s, p, src, memory, d)
            )
        for row, doc, do, later in parts:
            sel = row < cut[1] if later else row >= cut[0]
            rec = np.empty(int(sel.sum()), REPEAT_KEY)
            rec["doc"], rec["doc_offset"], rec["row"] = doc[sel], do[sel], row[sel] if later else -1
            if len(rec):
                keys.append(rec["doc"].astype(np.int64) // per, rec)
        for b in keys.names():
            rec = keys.read(b, REPEAT_KEY)
            rec = rec[np.lexsort((rec["row"], rec["doc_offset"], rec["doc"]))]
            new = np.ones(len(rec), bool)
            new[1:] = (rec["doc"][1:] != rec["doc"][:-1]) | (rec["doc_offset"][1:] != rec["doc_offset"][:-1])
            head = rec["row"][np.flatnonzero(new)][np.cumsum(new) - 1]  # the row of its key's first record
            hit = rec["row"][(rec["row"] >= 0) & (head < 0)]
            if len(hit):
                rows.append(hit // per_row, hit)
        return sum(len(np.unique(rows.read(b, "<i8"))) for b in rows.names())


def plan_options(pad_id: int | None = None, group_tokens: int | None = None) -> dict:
    """The options of a packed plan a run gives (None: the default)."""
    return {k: v for k, v in (("pad_id", pad_id), ("group_tokens", group_tokens)) if v is not None}


def packing_settings(
    sources: list[PackedSource], pad_id: int | None = None, group_tokens: int | None = None, holdout: dict | None = None
) -> dict:
    """What a packed run records (and a rerun must repeat) of its packing, from its options."""
    return {
        "method": BEST_FIT,
        "group_tokens": int(group_tokens or DEFAULT_GROUP_TOKENS),
        "pad_id": sources[0].eos_id if pad_id is None else int(pad_id),
        **record_holdout(holdout, padded=True),
    }


def held_out(src: PackedSource, spec: dict | None, seed: int, memory: int = DEFAULT_PLAN_MEMORY) -> "Holdout":
    """Source `src`'s held-out documents for `--holdout` `spec` (a token count reads the
    documents' lengths in the holdout's order, within `memory`)."""
    key = (src.fingerprint, int(seed), repr(spec))
    if key in _HELD:
        return _HELD[key]

    def lengths_in_order(order):
        return (lengths for _, _, lengths in permuted_documents(src, order, memory, None))

    _HELD[key] = holdout_of(src, spec, seed, document_count(src), lengths_in_order)
    return _HELD[key]


_HELD: dict[tuple, "Holdout"] = {}  # (fingerprint, seed, spec) -> its Holdout: planned once per process
