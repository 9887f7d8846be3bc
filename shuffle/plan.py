"""Epoch plans: which window of which source goes to which output position.

A plan is stateless and O(#sources): every question ("what is at output position g?",
"where do these windows go?") is answered by evaluating keyed bijections
(tokpack.shuffle.permutation), never by materialising an index.

The algorithm (windows, jitter, mixture, chains, the epoch permutation) is specified in
docs/COMMANDS.md, "The shuffle algorithm", and pinned by tests/test_plan_golden.py; the names
below follow it (L, W_s, o_s, c_s, N, pi_{s,p}, sigma_e). Its sources (tokpack.shuffle.sources) and
an epoch's mixture (tokpack.shuffle.mixture) have modules of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, NamedTuple, Protocol

import numpy as np

from tokpack.formats.errors import TokpackError
from tokpack.formats.packing import holdout_recorded
from tokpack.formats.constants import PLAN_ALGORITHM
from tokpack.formats.checks import chain_start, pass_span
from tokpack.formats.hashes import hash_hex64, order_hash_terms, row_hashes
from tokpack.formats.shards import PackedSource

from .holdout import Holdout, KeptStream, stream_table
from .mixture import (
    check_passes,
    jitter_offset,
    mixture,
    windows_of,
)
from .permutation import Bijection
from .source_windows import iter_source_windows
from .sources import (
    is_virtual,
)


class SamplePlan(Protocol):
    """What an epoch holds and in which order, as the engines, `validate --against` and the
    summaries ask it. Two implementations: EpochPlan (windows, O(#sources), nothing stored) and
    tokpack.shuffle.packed.PackedPlan (best-fit rows, a materialised and checksummed row table)."""

    seed: int
    epoch: int
    seq_len: int
    samples: int  # N: rows in the epoch
    sources: tuple  # per source: index, name, path, fingerprint, weight, tokens, windows, samples, base, cursor
    jitter: bool

    @property
    def row_tokens(self) -> int: ...  # L + 1

    @property
    def algorithm(self) -> str: ...  # the manifests' `shuffle` name

    def chain_start(self, s: int) -> int: ...  # where source s's chain is at this epoch's first sample

    def first_pass(self, s: int) -> int: ...

    def passes(self, s: int) -> int: ...  # passes over source s this epoch touches

    def order(self) -> "Bijection": ...  # sigma_e: epoch-list position q -> output position g

    def dropped_tokens(self) -> int: ...

    def source_report(self) -> list[dict]: ...  # per source: samples, windows, passes, repeats...

    def source_entries(self) -> list[dict]: ...  # the epoch manifest's `sources`


def source_head(sp) -> dict:
    """The fields both packings' `source_report` and `source_entries` open each source's entry with."""
    return {k: getattr(sp, k) for k in ("name", "path", "fingerprint", "weight", "samples")}


@dataclass(frozen=True)
class SourcePlan:
    """One source's share of one epoch."""

    index: int  # s: position on the command line, part of every key
    name: str  # directory name, for humans
    path: str  # where it was read from
    fingerprint: str  # the source manifest's fingerprint
    weight: str | None  # as given (exact decimal/fraction text), None without weights
    tokens: int  # T_s
    offset: int  # o_s: first token of window 0 in this epoch
    windows: int  # W_s: windows per pass
    samples: int  # c_s: windows this epoch takes
    base: int  # first epoch-list position q of this source
    cursor: int | None = None  # chain position of its first sample; None: epoch * c_s (one mixture for the run)
    # A run made with --holdout (tokpack.shuffle.holdout): `tokens` are its stream's (the documents
    # not held out, or RUN/holdout/'s held-out ones), of its `documents` D_s, `held` k_s held out,
    # holding `held_tokens`; `kept_shards`: the tokens not held out of each raw shard (KeptStream's
    # table, carried to the tasks so that none scans the index again; not in any manifest).
    documents: int = 0
    held: int = 0
    held_tokens: int = 0
    kept_shards: tuple = field(default=(), repr=False, compare=False)


# A SourcePlan's holdout fields and the epoch manifest's names of them.
HELD_FIELDS = (("documents", "documents"), ("held", "held_documents"), ("held_tokens", "held_tokens"))


@dataclass(frozen=True)
class EpochPlan:
    """What epoch `epoch` holds and in which order. Small and picklable."""

    seed: int  # the run's seed
    epoch: int  # e
    seq_len: int  # L
    jitter: bool  # window starts shifted per epoch
    samples: int  # N
    sources: tuple[SourcePlan, ...]  # in command-line order
    holdout: dict | None = None  # `--holdout` as recorded (tokpack.shuffle.holdout.parse_holdout), or None
    split: bool = False  # the plan of RUN/holdout/: windows of the held-out documents' stream

    # ---------------------------------------------------------------- per source

    def stream(self, s: int, src: PackedSource):
        """What source s's windows are cut from: the source itself, or with --holdout its
        stream of the documents this plan keeps (tokpack.shuffle.holdout.KeptStream), which
        reads as a source does in the stream's offsets."""
        if self.holdout is None:
            return src
        sp = self.sources[s]
        return KeptStream(
            src, Holdout(sp.documents, sp.held, self.seed, sp.fingerprint, self.split), sp.kept_shards or None
        )

    @property
    def row_tokens(self) -> int:
        return self.seq_len + 1

    @property
    def algorithm(self) -> str:
        return PLAN_ALGORITHM

    def chain_start(self, s: int) -> int:
        """Position in source s's chain of this epoch's first sample from it: where the epochs
        before it left the chain."""
        return chain_start(self.epoch, self.sources[s].samples, self.sources[s].cursor)

    def first_pass(self, s: int) -> int:
        return pass_span(self.chain_start(s), self.sources[s].samples, self.sources[s].windows)[0]

    def passes(self, s: int) -> int:
        """Number of passes of the chain this epoch touches (0 when the source contributes nothing)."""
        return pass_span(self.chain_start(s), self.sources[s].samples, self.sources[s].windows)[1]

    def repeats(self, s: int) -> int:
        """Samples of source s in this epoch that repeat a window the epoch already holds:
        its samples minus the distinct windows they cover. Nonzero when the source is
        upsampled (more samples than windows), and also when the epoch straddles two passes,
        whose permutations differ. Costs one permutation evaluation per window of the
        smaller straddling part, in batches."""
        src = self.sources[s]
        if not src.samples:
            return 0
        lo = self.chain_start(s)
        hi = lo + src.samples
        w = src.windows
        p0, p1 = lo // w, (hi - 1) // w
        if p0 == p1:
            return 0
        a, b = lo - p0 * w, hi - p1 * w  # pass p0 from position a on, pass p1 up to position b
        if p1 - p0 >= 2 or a == 0 or b == w:  # a whole pass inside: every window is there
            return src.samples - w
        # Windows of the tail of pass p0 that the head of pass p1 takes again.
        first, second = self.window_perm(s, p0), self.window_perm(s, p1)
        both, batch = 0, 1 << 20
        if w - a <= b:
            for x in range(a, w, batch):
                ks = np.arange(x, min(w, x + batch), dtype=np.int64)
                both += int((second.inverse(first.forward(ks)) < b).sum())
        else:
            for x in range(0, b, batch):
                ks = np.arange(x, min(b, x + batch), dtype=np.int64)
                both += int((first.inverse(second.forward(ks)) >= a).sum())
        return both

    repeat_unit = "samples"  # what source_report's repeats count (PackedPlan's: rows)

    def repeat_counts(self, s: int) -> tuple[int, int | None]:
        """(repeats, the samples they are out of) of source s, as source_report gives them."""
        return self.repeats(s), self.sources[s].samples

    def source_report(self) -> list[dict]:
        """Per source, what this epoch takes from it: for summaries and warnings."""
        return [
            {
                **source_head(src),
                "windows": src.windows,
                "passes": self.passes(i),
                "first_pass": self.first_pass(i),
                "repeats": repeats,
                "repeat_total": total,
                "repeat_unit": self.repeat_unit,
            }
            for i, src in enumerate(self.sources)
            for repeats, total in [self.repeat_counts(i)]
        ]

    def window_perm(self, s: int, p: int) -> Bijection:
        return Bijection(self.sources[s].windows, "window", self.seed, s, p)

    def order(self) -> Bijection:
        return Bijection(self.samples, "epoch", self.seed, self.epoch)

    def dropped_tokens(self) -> int:
        return sum(src.tokens - src.windows * self.row_tokens for src in self.sources)

    def token_range(self, s: int, window: int) -> tuple[int, int]:
        start = self.sources[s].offset + window * self.row_tokens
        return start, start + self.row_tokens

    # ---------------------------------------------------------------- queries

    def locate(self, g) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For output positions g: (source index, window index, pass), as int64 arrays."""
        g = np.asarray(g, dtype=np.int64)
        q = self.order().inverse(g)
        bases = np.array([src.base for src in self.sources], dtype=np.int64)
        s = np.searchsorted(bases, q, side="right") - 1
        # sources with samples == 0 share their base with the next one; searchsorted(right)
        # picks the last of equal bases, which is the one that owns q.
        wins = np.array([max(src.windows, 1) for src in self.sources], dtype=np.int64)
        starts = np.array([self.chain_start(i) for i in range(len(self.sources))], dtype=np.int64)
        pos = starts[s] + (q - bases[s])
        p = pos // wins[s]
        k = pos % wins[s]
        window = np.empty_like(k)
        first = np.array([self.first_pass(i) for i in range(len(self.sources))], dtype=np.int64)
        group = (s << 32) | (p - first[s])  # (source, pass within this epoch): a handful of groups
        order = np.argsort(group, kind="stable")
        cuts = np.flatnonzero(np.diff(group[order])) + 1
        for sel in np.split(order, cuts) if g.size else ():
            si, pi = int(s[sel[0]]), int(p[sel[0]])
            window[sel] = self.window_perm(si, pi).forward(k[sel])
        return s, window, p

    def outputs_of(self, s: int, windows: np.ndarray) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """Where windows of source s go this epoch: yields (pass, rows, g) per pass touched, where
        `rows` indexes into `windows` and `g` are their output positions. A window appears once
        per pass at most, so several times only when the source is upsampled."""
        src = self.sources[s]
        if not src.samples or len(windows) == 0:
            return
        lo = self.chain_start(s)
        hi = lo + src.samples
        order = self.order()
        for p in range(self.first_pass(s), self.first_pass(s) + self.passes(s)):
            pos = self.window_perm(s, p).inverse(windows) + p * src.windows
            rows = np.flatnonzero((pos >= lo) & (pos < hi))
            if rows.size:
                yield p, rows, order.forward(pos[rows] - lo + src.base)

    # ---------------------------------------------------------------- manifests

    def source_entries(self) -> list[dict]:
        return [
            {
                **source_head(src),
                "first_pass": self.first_pass(i),
                "passes": self.passes(i),
                "windows": src.windows,
                "tokens": src.tokens,
                "offset": src.offset,
                "dropped_tokens": src.tokens - src.windows * self.row_tokens,
                **({} if src.cursor is None else {"cursor": src.cursor}),
                **({} if self.holdout is None else {n: getattr(src, k) for k, n in HELD_FIELDS}),
            }
            for i, src in enumerate(self.sources)
        ]

    @classmethod
    def from_manifest(
        cls, manifest: dict, sources: list[PackedSource], held_out: "HeldOut | None" = None
    ) -> "EpochPlan":
        """The plan an epoch manifest was written from, against the opened sources (matched by
        fingerprint, in any order). `held_out`: a manifest with --holdout (holdout_recorded)
        recomputes each source's held-out documents by it (the registry gives
        tokpack.shuffle.packed.held_out)."""
        if manifest.get("shuffle") != PLAN_ALGORITHM:
            raise TokpackError(
                "epoch shuffled by another shuffle algorithm",
                where="shuffle",
                expected=PLAN_ALGORITHM,
                found=manifest.get("shuffle"),
                hint="use the tokpack version that wrote the epoch to replay its plan",
            )
        entries = manifest.get("sources") or []
        pool = list(sources)
        plans, base = [], 0
        row = int(manifest["seq_len"]) + 1
        spec, split = holdout_recorded(manifest)
        for i, e in enumerate(entries):
            match = next((p for p in pool if p.fingerprint == e.get("fingerprint")), None)
            held = {} if spec is None else {k: int(e.get(n, -1)) for k, n in HELD_FIELDS}
            if match is None and int(e["samples"]) != 0:  # a scheduled run lists every source; this epoch may use none
                raise source_not_given(i, e, pool, "none left")
            windows, offset = int(e["windows"]), int(e["offset"])
            tokens = int(e["tokens"]) if match is None else match.tokens
            if match is not None:
                pool.remove(match)
                # the run's rule, applied again: the held-out documents are not the manifest's word
                if spec is not None:
                    want = stream_counts(match, spec, int(manifest["seed"]), split, held_out)
                    for k, n in HELD_FIELDS:
                        if held[k] != want[k]:
                            raise TokpackError(
                                "epoch manifest's held-out documents are not its --holdout's",
                                file=match.path,
                                where=f"sources[{i}].{n}",
                                expected=want[k],
                                found=e.get(n),
                                hint="the epoch was not shuffled with the run's --holdout; shuffle it again",
                            )
                    tokens, held["kept_shards"] = want["tokens"], want["kept_shards"]
                if offset + windows * row > tokens:
                    raise TokpackError(
                        "epoch manifest windows exceed the source",
                        file=match.path,
                        where=f"sources[{i}]",
                        expected=f"<= {tokens} tokens",
                        found=offset + windows * row,
                    )
            plans.append(
                SourcePlan(
                    i,
                    e.get("name", ""),
                    e.get("path", ""),
                    e.get("fingerprint"),
                    e.get("weight"),
                    tokens,
                    offset,
                    windows,
                    int(e["samples"]),
                    base,
                    e.get("cursor"),
                    **held,
                )
            )
            base += int(e["samples"])
        check_samples(manifest, base)
        return cls(
            int(manifest["seed"]),
            int(manifest["epoch"]),
            int(manifest["seq_len"]),
            bool(manifest.get("jitter", False)),
            base,
            tuple(plans),
            spec,
            split,
        )


def source_not_given(i: int, entry: dict, given: list[PackedSource], none: str) -> TokpackError:
    """The one line for an epoch manifest's source entry i that none of the sources `given` is."""
    return TokpackError(
        "source of the epoch not given",
        where=f"sources[{i}] ({entry.get('name')})",
        expected=f"a source with fingerprint {entry.get('fingerprint')}",
        found=", ".join(str(p.path) for p in given) or none,
        hint="pass every source the epoch was shuffled from, unchanged",
    )


def check_samples(manifest: dict, total: int) -> None:
    """An epoch manifest's samples must be its sources' `total`."""
    if total != int(manifest["samples"]):
        raise TokpackError(
            "epoch manifest source samples do not add up",
            where="sources[].samples",
            expected=manifest["samples"],
            found=total,
        )


def epoch_plan(
    sources: list[PackedSource],
    *,
    seq_len: int,
    seed: int,
    epoch: int,
    weights: list[str | None] | None = None,
    samples: int | None = None,
    tokens: int | None = None,
    jitter: bool = False,
    names: list[str] | None = None,
    holdout: "HoldoutChoice | None" = None,
) -> EpochPlan:
    """The plan of one epoch. Cheap: O(#sources) plus a few hashes (with a `holdout` spec,
    parse_holdout's: the windows of each source's stream of the documents not held out, or with
    its `split` of the held-out ones; its table is one scan of the source's document index, once
    per process)."""
    if not sources:
        raise TokpackError("no sources given", hint="tokpack shuffle SOURCE[=WEIGHT]... -o OUT")
    weights = list(weights) if weights is not None else [None] * len(sources)
    spec, split, held_out = holdout or HoldoutChoice()
    held = [stream_counts(src, spec, seed, split, held_out) for src in sources]
    wins = []
    for s, src in enumerate(sources):
        w = windows_of(held[s].get("tokens", src.tokens), seq_len, jitter)
        if w <= 0 and split:
            raise TokpackError(
                "--holdout holds out fewer tokens of a source than one window",
                file=src.path,
                where="--holdout",
                expected=f"at least {seq_len + 1} held-out tokens (RUN/holdout/ is windows of them)",
                found=f"{held[s]['tokens']} tokens in {held[s]['held']} documents",
                hint=f"hold out more: a larger fraction, or a token count of at least {seq_len + 1}",
            )
        if w <= 0:
            raise TokpackError(
                "seq_len is larger than the source",
                file=src.path,
                where="--seq-len",
                expected=f"a source of at least {seq_len + 1 + (seq_len if jitter else 0)} tokens",
                found=f"{src.tokens} tokens",
                hint="lower --seq-len or drop this source",
            )
        wins.append(w)
    n, counts = mixture(sources, weights, wins, samples=samples, tokens=tokens, seq_len=seq_len)
    check_passes(sources, counts, wins, "windows")
    plans, base = [], 0
    for s, src in enumerate(sources):
        offset = jitter_offset(seed, epoch, s, seq_len) if jitter else 0
        name = names[s] if names else src.home.name
        extra = {k: v for k, v in held[s].items() if k != "tokens"}
        plans.append(
            SourcePlan(
                s,
                name,
                str(src.home),
                src.fingerprint,
                None if weights[s] is None else str(weights[s]),
                held[s].get("tokens", src.tokens),
                offset,
                wins[s],
                counts[s],
                base,
                **extra,
            )
        )
        base += counts[s]
    return EpochPlan(int(seed), int(epoch), int(seq_len), bool(jitter), n, tuple(plans), spec, bool(split))


# (source, --holdout as recorded, seed) -> its Holdout: the one rule both packings share,
# tokpack.shuffle.packed.held_out, which the registry (tokpack.shuffle.packings) passes in.
HeldOut = Callable[[PackedSource, dict, int], Holdout]


class HoldoutChoice(NamedTuple):
    """`--holdout` as a plan takes it: the spec as recorded (None: nothing held out), whether the
    plan is RUN/holdout/'s (`split`: the held-out documents only), and the rule that picks them."""

    spec: dict | None = None
    split: bool = False
    held_out: HeldOut | None = None


def stream_counts(src: PackedSource, spec: dict | None, seed: int, split: bool, held_out: HeldOut | None) -> dict:
    """A SourcePlan's holdout fields for source `src` ({} without a holdout), its stream's
    `tokens` among them: of its held-out documents for `--holdout` `spec` (`split`: RUN/holdout/'s
    view of them, the held-out documents' stream)."""
    if spec is None:
        return {}
    if held_out is None:
        raise TokpackError(
            "internal error: a plan with --holdout needs the rule that holds documents out",
            where="held_out",
            hint="plan it through tokpack.shuffle.packings",
        )
    if is_virtual(src.path):
        raise TokpackError(
            "--holdout needs the documents of the source",
            file=src.path,
            where="--holdout",
            hint="plan a run with --holdout on packed sources, not virtual ones",
        )
    h = replace(held_out(src, spec, seed), split=bool(split))
    table = stream_table(src, h)
    kept = int(table.sum())
    return {
        "tokens": kept if not split else src.tokens - kept,
        "documents": h.documents,
        "held": h.held,
        "held_tokens": src.tokens - kept,
        "kept_shards": tuple(table.tolist()),
    }


def chained_plan(
    plan: EpochPlan,
    members: list[int],
    sources: list[PackedSource],
    names: list[str],
    cursors: list[int],
    held_out: HeldOut | None = None,
) -> EpochPlan:
    """An epoch of a schedule of several stages, from its stage's plan (over the stage's
    sources, `members` of the schedule's): the epoch lists every source of the schedule (its
    position is its key), and each source's chain starts at its cursor, where the epochs before
    this one left it."""
    stage_of = dict(zip(members, plan.sources))
    seq_len, seed, epoch = plan.seq_len, plan.seed, plan.epoch
    entries, base = [], 0
    for u, src in enumerate(sources):
        offset = jitter_offset(seed, epoch, u, seq_len) if plan.jitter else 0
        held = {} if u in stage_of else stream_counts(src, plan.holdout, seed, plan.split, held_out)
        tokens = held.pop("tokens", src.tokens)
        sp = stage_of.get(u) or SourcePlan(
            u,
            names[u],
            str(src.home),
            src.fingerprint,
            None,
            tokens,
            offset,
            windows_of(tokens, seq_len, plan.jitter),
            0,
            base,
            **held,
        )
        entries.append(replace(sp, index=u, offset=offset, base=base, cursor=cursors[u]))
        base += sp.samples
    return replace(plan, sources=tuple(entries))


# -------------------------------------------------------------------- verification


def shard_count_checked(epoch_manifest: dict, samples: int) -> tuple[int, int]:
    """(shard_samples, shards listed), once the listed shards are known to hold the plan's
    samples: checked by arithmetic before any per-shard sum is allocated."""
    per, listed = int(epoch_manifest["shard_samples"]), len(epoch_manifest["shards"])
    if per < 1 or -(-samples // per) != listed:
        raise TokpackError(
            "epoch manifest's shards do not hold its samples",
            where="shards",
            expected=f"{-(-samples // max(per, 1))} shards ({samples} samples, {per} a shard)",
            found=f"{listed} shards",
        )
    # A one-shard epoch may record any shard_samples of at least its samples, even past int64
    # (numpy's `g // per`); its samples' shard, 0, is the same with `per` at most `samples`.
    return min(per, max(samples, 1)), listed


def replay_hashes(
    epoch_manifest: dict,
    sources: list[PackedSource],
    order: bool = True,
    plan: EpochPlan | None = None,
    held_out: HeldOut | None = None,
) -> tuple[str, list[int]]:
    """What the epoch must hold, recomputed from its sources through the plan: its
    `sample_multiset_hash` (each window's row_hash times the number of times the epoch uses it)
    and, with `order`, each output shard's order hash (docs/FORMAT.md, "Checksums": the sum of
    the order terms of the samples the plan puts at the shard's positions). Each source is read
    once, sequentially in its own order, and each window's terms are added at every position the
    plan sends it to (`outputs_of`), so the epoch's order needs no table. Memory: one IO block,
    O(block rows) index arrays and 8 bytes per output shard. `plan`: the epoch's plan, when the
    caller made it (a packing of windows in another order, tokpack.shuffle.packings)."""
    plan = EpochPlan.from_manifest(epoch_manifest, sources, held_out) if plan is None else plan
    per, listed = shard_count_checked(epoch_manifest, plan.samples) if order else (1, 0)
    multiset, shard_orders = 0, np.zeros(listed if order else 0, dtype=np.uint64)
    for s, sp in enumerate(plan.sources):
        if not sp.samples:
            continue
        src = next(p for p in sources if p.fingerprint == sp.fingerprint)
        for a, rows in iter_source_windows(plan, s, plan.stream(s, src)):
            uses = list(plan.outputs_of(s, np.arange(a, a + len(rows), dtype=np.int64)))
            if not uses:
                continue
            used = np.unique(np.concatenate([sel for _, sel, _ in uses]))
            hashes = np.zeros(len(rows), dtype=np.uint64)  # only the windows the epoch uses are hashed
            hashes[used] = row_hashes(rows if len(used) == len(rows) else rows[used])
            for _, sel, g in uses:
                multiset += int(hashes[sel].sum(dtype=np.uint64))
                if order:  # uint64 sums wrap: mod 2^64
                    np.add.at(shard_orders, g // per, order_hash_terms(g, hashes[sel]))
    return hash_hex64(multiset), shard_orders.tolist()
