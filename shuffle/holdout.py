"""A held-out split (`tokpack shuffle ... --holdout F`, issue 35 item 7): whole documents of each
source set aside from every training epoch, chosen from the run's seed alone.

Which documents: source s's D_s documents are permuted by rho_h = Bijection(D_s, "holdout",
seed, fingerprint_s) (keyed by the source's fingerprint, not its position, so that a source
holds out the same documents in every epoch, stage and place on the command line); the
documents at positions [0, k_s) of that order are held out. `F` is a fraction of the
documents (`0.01`, `1%`: k_s = ceil(F * D_s)) or a token count (`5M`, `20000`: the fewest
positions whose documents hold at least that many tokens). Document d is held out exactly
when rho_h^-1(d) < k_s: one evaluation of the bijection, no list of documents.

Both packings hold out the same documents (`Holdout.is_held`, the one home of the choice):

- best-fit (shuffle/packed.py) drops held-out documents from each pass before it packs it, so
  no row of any epoch holds a piece of one, and `validate --against`, which replays the plan
  from the manifest, rebuilds the rows without them (and checks every piece).
- concat (the default, shuffle/plan.py) cuts its windows from a stream, as Megatron's --split
  does: a training epoch's stream of source s is s's documents that are not held out,
  concatenated in source order (`KeptStream`), and RUN/holdout/'s is the held-out documents
  alone (`split`). Every window (jitter offset, W_s, the permutations, the mixture, the manifest's
  `tokens`, `offset`, `dropped_tokens`) is that of the stream, exactly as of a source that
  held those tokens: no kept token is lost beyond the usual tail, no window spans a gap. The
  engines, `validate --against`'s replay, `inspect` and a replacement node read a stream through
  the same `read_into` as a source (EpochPlan.stream): a read is a gather of the runs of
  consecutive kept documents it covers, each read from the raw shard. Memory at scale (10^10
  documents): one count per raw shard (`stream_table`: one scan of each shard's `.ds.index` by
  the process that plans, which the plan carries to its tasks in SourcePlan.kept_shards), and
  the runs of the one shard being read (its index, read when first touched: 8 bytes a document
  of that shard); never a per-document array of the source. A stream keeps the raw shards'
  numbering, so the engines split and verify the raw shards as before (`raw_pieces` hands the
  sweep's checksum the raw bytes). RUN/holdout/ is every whole window of the held-out stream,
  no jitter (its tail of < L+1 tokens dropped, as a source's); --to-nodes refuses --holdout.

Why this and not "drop every window that overlaps a held-out document": that keeps the reads
contiguous, but loses kept tokens around every held-out document (about one window's worth
each) and makes W_s depend on where the documents fall; the stream loses none and leaves the
window algorithm as it is, at the price of gathered reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from tokpack.formats.errors import TokpackError
from tokpack.formats.io.gate import regular_size
from tokpack.formats.units import holdout_amount

from .permutation import Bijection


def parse_holdout(text) -> dict | None:
    """`--holdout F` as the manifests record it: {"fraction": "1/100"} or {"tokens": N}; None for
    none (tokpack.formats.units.holdout_amount parses it)."""
    if text is None:
        return None
    kind, amount = holdout_amount(text)
    return {kind: str(amount) if kind == "fraction" else int(amount)}


@dataclass(frozen=True)
class Holdout:
    """One source's held-out documents: positions [0, held) of rho_h."""

    documents: int  # D_s
    held: int  # k_s
    seed: int
    fingerprint: str
    split: bool = False  # the plan of RUN/holdout/: it keeps the held-out documents and leaves out the others

    def left_out(self, docs: np.ndarray) -> np.ndarray:
        """Whether a plan of this split leaves each of `docs` out: a training epoch the held-out
        ones, RUN/holdout/ every other."""
        held = self.is_held(docs)
        return ~held if self.split else held

    def order(self) -> Bijection:
        return Bijection(max(self.documents, 1), "holdout", self.seed, self.fingerprint)

    def is_held(self, docs: np.ndarray) -> np.ndarray:
        """Whether each of the source's documents `docs` is held out."""
        docs = np.asarray(docs, dtype=np.int64)
        if not self.held or not len(docs):
            return np.zeros(len(docs), dtype=bool)
        return self.order().inverse(docs) < self.held

    def held_documents(self) -> np.ndarray:
        """The held-out documents, ascending (O(k_s): for tests and the holdout folder)."""
        return np.sort(self.order().forward(np.arange(self.held, dtype=np.int64)))


def holdout_of(src, spec: dict | None, seed: int, documents: int, lengths_in_order=None) -> Holdout:
    """Source `src`'s Holdout for `spec` (parse_holdout's), of its `documents` D_s. A token count
    reads the documents' lengths in rho_h's order (`lengths_in_order(order)`: chunks of
    lengths), until they reach it."""
    d = int(documents)
    h = Holdout(d, 0, int(seed), src.fingerprint)
    if spec is None:
        return h
    if "fraction" in spec:
        k = math.ceil(Fraction(spec["fraction"]) * d)
    else:
        k, total, want = 0, 0, int(spec["tokens"])
        for lengths in lengths_in_order(h.order()):
            cum = total + np.cumsum(lengths)
            i = int(np.searchsorted(cum, want, side="left"))
            if i < len(cum):
                k += i + 1
                break
            k, total = k + len(lengths), int(cum[-1]) if len(cum) else total
        else:  # the documents hold fewer tokens than that: all of them
            k = d
    if k >= d:
        raise TokpackError(
            "--holdout would hold out every document of a source",
            file=src.path,
            where="--holdout",
            expected=f"fewer than its {d} documents",
            found=f"{spec['tokens']:,} tokens" if "tokens" in spec else f"a fraction {spec['fraction']}",
            hint="hold out a smaller fraction or fewer tokens",
        )
    return Holdout(d, int(k), int(seed), src.fingerprint)


# ---------------------------------------------------------------------- the concat stream


class KeptStream:
    """Source `raw`'s documents that `holdout` does not leave out (Holdout.left_out: a training
    epoch's the kept ones, RUN/holdout/'s the held-out ones), concatenated in source order: read
    as a PackedSource is (`tokens`, `shard_starts`, `read_into`), in stream offsets. Its shards
    are the raw shards, each holding its kept documents' tokens."""

    def __init__(self, raw, holdout: Holdout, kept: tuple | None = None):
        """`kept`: the tokens of each raw shard's documents not held out, as `stream_table` gives
        them (a plan carries them to its tasks, which then scan no index); None: computed here."""
        self.raw, self.holdout = raw, holdout
        self.path, self.manifest, self.dtype, self.shards = raw.path, raw.manifest, raw.dtype, raw.shards
        self.doc_starts = doc_starts(raw)  # first document of each raw shard
        kept = stream_table(raw, holdout) if kept is None else np.asarray(kept, dtype=np.int64)
        if holdout.split:  # the held-out documents' stream: the rest of each shard
            kept = np.diff(np.asarray(raw.shard_starts, dtype=np.int64)) - kept
        self.shard_starts = np.concatenate([[0], np.cumsum(kept, dtype=np.int64)])
        self._runs: tuple[int, tuple] | None = None  # (shard, its runs): the shard read last

    tokens = property(lambda self: int(self.shard_starts[-1]))
    eos_id = property(lambda self: self.raw.eos_id)
    vocab_size = property(lambda self: self.raw.vocab_size)
    fingerprint = property(lambda self: self.raw.fingerprint)

    def runs(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Raw shard k's runs of consecutive documents the stream keeps: (stream offset of each
        run in the shard, its raw offset in the shard, its length), plus the shard's kept total
        at the end of the first array."""
        if self._runs is None or self._runs[0] != k:
            ends = self.raw.doc_ends(k).astype(np.int64)
            starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
            keep = ~self.holdout.left_out(np.arange(len(ends), dtype=np.int64) + int(self.doc_starts[k]))
            # a run begins at a kept document whose predecessor is not kept
            first = np.flatnonzero(keep & ~np.concatenate([[False], keep[:-1]]))
            last = np.flatnonzero(keep & ~np.concatenate([keep[1:], [False]]))
            raw0, lens = starts[first], ends[last] - starts[first]
            self._runs = (k, (np.concatenate([[0], np.cumsum(lens)]).astype(np.int64), raw0, lens))
        return self._runs[1]

    def raw_pieces(self, start: int, count: int):
        """The raw ranges stream tokens [start, start+count) lie in, in order: (raw first token,
        first and end position in the range)."""
        if start < 0 or start + count > self.tokens:
            raise IndexError(f"token range [{start}, {start + count}) outside the stream's {self.tokens} tokens")
        done = 0
        k = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
        while done < count:
            base = int(self.shard_starts[k])
            lo, hi = start + done - base, min(start + count, int(self.shard_starts[k + 1])) - base
            if hi > lo:
                offs, raw0, lens = self.runs(k)
                i = int(np.searchsorted(offs, lo, side="right")) - 1
                raw_base = int(self.raw.shard_starts[k])
                while lo < hi:
                    n = min(hi, int(offs[i + 1])) - lo
                    yield raw_base + int(raw0[i]) + lo - int(offs[i]), done, done + n
                    done, lo, i = done + n, lo + n, i + 1
            k += 1

    def read_into(self, start: int, out: np.ndarray, handles: dict | None = None) -> np.ndarray:
        """Fills `out` with stream tokens [start, start+len(out)): one raw read per run it covers."""
        for raw, a, b in list(self.raw_pieces(start, len(out))):
            self.raw.read_into(raw, out[a:b], handles)
        return out


_STREAMS: dict[tuple, np.ndarray] = {}  # (fingerprint, seed, documents, held) -> stream_table's: once per process


def doc_starts(raw) -> np.ndarray:
    """The first document of each raw shard, and D_s at the end: from the sizes of the shards'
    `.ds.index` files (8 bytes a document end)."""
    counts = [regular_size(Path(raw.path) / f"{sh['path']}.index") // 8 for sh in raw.shards]
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)


def stream_table(raw, holdout: Holdout) -> np.ndarray:
    """The tokens of each raw shard's documents not held out: one scan of each shard's
    `.ds.index` (8 bytes a document of one shard held at a time; O(shards) kept), and one
    evaluation of rho_h^-1 per document. Cached per process; a plan carries it to its tasks."""
    key = (raw.fingerprint, holdout.seed, holdout.documents, holdout.held)
    holdout = Holdout(holdout.documents, holdout.held, holdout.seed, holdout.fingerprint)  # the kept documents
    if key not in _STREAMS:
        first, kept = doc_starts(raw), np.zeros(len(raw.shards), dtype=np.int64)
        for k in range(len(raw.shards)):
            ends = raw.doc_ends(k).astype(np.int64)
            lens = np.diff(ends, prepend=0)
            kept[k] = int(lens[~holdout.left_out(np.arange(len(ends), dtype=np.int64) + int(first[k]))].sum())
        _STREAMS[key] = kept
    return _STREAMS[key]
