"""The document length distribution of packed sources, from their `.ds.index` files streamed
in blocks: constant memory whatever the corpus (`tokpack inspect`'s document_lengths)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np

from tokpack.formats.constants import U64
from tokpack.formats.errors import TokpackError
from tokpack.formats.io.gate import read_array, regular_size
from tokpack.formats.io.progress_log import progress
from tokpack.formats.shards import PackedSource

INDEX_BLOCK = 1 << 20  # index entries read at a time when streaming document lengths
MAX_LENGTH_SAMPLE = 1 << 25  # documents read for the length distribution; more are sampled by block
EXACT_LENGTHS = 1 << 16  # lengths below this are counted exactly; above, in 1/64-octave bins
LOG_BINS_PER_OCTAVE = 64
QUANTILES = (0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99)


class LengthHistogram:
    """Streaming distribution of document lengths: exact below 2^16 tokens, 1/64-octave
    bins above (about 1% relative error), so memory is constant whatever the corpus."""

    def __init__(self):
        self.exact = np.zeros(EXACT_LENGTHS, dtype=np.int64)  # count per exact length < 2^16
        self.log_bins: dict[int, int] = {}  # 1/64-octave bin above 2^16 -> count
        self.count = 0  # documents seen
        self.total = 0  # tokens seen
        self.min = None  # shortest document
        self.max = 0  # longest document
        self.corpus_documents = 0  # documents in the sources (more than `count` when sampled)

    def add(self, lengths: np.ndarray) -> None:
        if lengths.size == 0:
            return
        lengths = lengths.astype(np.int64, copy=False)
        small = lengths[lengths < EXACT_LENGTHS]
        self.exact += np.bincount(small, minlength=EXACT_LENGTHS)
        big = lengths[lengths >= EXACT_LENGTHS]
        if big.size:
            bins = np.floor(np.log2(big / EXACT_LENGTHS) * LOG_BINS_PER_OCTAVE).astype(np.int64)
            for b, c in zip(*np.unique(bins, return_counts=True)):
                self.log_bins[int(b)] = self.log_bins.get(int(b), 0) + int(c)
        self.count += int(lengths.size)
        self.total += int(lengths.sum())
        lo, hi = int(lengths.min()), int(lengths.max())
        self.min = lo if self.min is None else min(self.min, lo)
        self.max = max(self.max, hi)

    def _log_bin_value(self, b: int) -> float:
        return EXACT_LENGTHS * 2 ** ((b + 0.5) / LOG_BINS_PER_OCTAVE)

    def quantile(self, q: float) -> float:
        rank = q * (self.count - 1)  # the (0-based) rank of the wanted document in sorted order
        cum = np.cumsum(self.exact)
        if rank < cum[-1]:
            return float(np.searchsorted(cum, rank, side="right"))
        seen = int(cum[-1])
        for b in sorted(self.log_bins):
            seen += self.log_bins[b]
            if rank < seen:
                return min(float(self.max), self._log_bin_value(b))
        return float(self.max)

    def octaves(self) -> list[dict]:
        """Counts per power-of-two bucket [2^k, 2^(k+1)): compact enough for a report."""
        lengths = np.flatnonzero(self.exact)
        # frexp's exponent of a length n >= 1 is floor(log2 n) + 1, of 0 is 0: bucket k at k + 1 (length 0: -1)
        sums = np.bincount(np.frexp(lengths)[1], weights=self.exact[lengths])
        out = Counter({k - 1: int(c) for k, c in enumerate(sums) if c})
        for b, c in self.log_bins.items():
            out[16 + b // LOG_BINS_PER_OCTAVE] += c
        return [
            {"min": 0 if k < 0 else 1 << k, "max": 0 if k < 0 else (1 << (k + 1)) - 1, "documents": c}
            for k, c in sorted(out.items())
        ]

    def plot_bins(self, per_octave: int = 4) -> tuple[np.ndarray, np.ndarray]:
        """(bin edges, counts) on a log scale, for the figure."""
        top = math.floor(math.log2(max(self.max, 1)) * per_octave) + 1  # the last edge lies above the longest
        edges = 2.0 ** (np.arange(0, top + 1) / per_octave)
        lengths = np.flatnonzero(self.exact)
        counts = np.histogram(lengths, bins=edges, weights=self.exact[lengths])[0].astype(np.int64)
        for b, c in self.log_bins.items():
            counts[min(len(counts) - 1, max(0, np.searchsorted(edges, self._log_bin_value(b), side="right") - 1))] += c
        return edges, counts

    def report(self) -> dict:
        if not self.count:
            return {"documents": 0}
        return {
            "documents": self.count,
            **({"sampled_from_documents": self.corpus_documents} if self.corpus_documents > self.count else {}),
            "tokens": self.total,
            "mean": round(self.total / self.count, 2),
            "min": self.min,
            "max": self.max,
            "quantiles": {f"p{round(q * 100)}": round(self.quantile(q), 1) for q in QUANTILES},
            "histogram": self.octaves(),
        }


def document_lengths(
    sources: list[PackedSource], max_documents: int = MAX_LENGTH_SAMPLE, per_source: list | None = None
) -> LengthHistogram:
    """The length distribution from the `.ds.index` files. Above `max_documents` documents (an
    index is 8 bytes per document: 88 GB for an 11T-token corpus) it reads evenly spaced blocks
    of consecutive entries instead of everything, and says so in the report. `per_source`, if
    given, gets each source's own distribution (source_lengths), from the same blocks: the
    sources are read one after the other, so two histograms are held whatever their number.
    Per shard, only its document count is held (8 bytes, where a list of paths, sizes and blocks
    held 440); its entry is read again from the manifest's text when its blocks are read."""
    hist = LengthHistogram()
    bounds = np.cumsum([0] + [len(src.shards) for src in sources])  # each source's first shard, of all
    entries = (_index_path(src, s) for src in sources for s in src.shards)
    sizes = np.fromiter((regular_size(p) // U64.itemsize for p in entries), np.int64, int(bounds[-1]))
    hist.corpus_documents = int(sizes.sum())
    drawn, total = None, hist.corpus_documents  # drawn: the blocks read, as (shard, first entry); None: all
    if hist.corpus_documents > max_documents:
        keep = max(1, max_documents // INDEX_BLOCK)
        blocks = -(-sizes // INDEX_BLOCK)
        ends = np.cumsum(blocks)  # past each shard's last block, blocks counted over all shards
        # the keep evenly spaced blocks, distinct: keep <= max_documents / INDEX_BLOCK < the blocks
        drawn_blocks = [i * int(ends[-1]) // keep for i in range(keep)]
        shards = np.searchsorted(ends, drawn_blocks, side="right").tolist()
        drawn = {(j, (g - int(ends[j] - blocks[j])) * INDEX_BLOCK) for g, j in zip(drawn_blocks, shards)}
        total = sum(min(INDEX_BLOCK, int(sizes[j]) - a) for j, a in drawn)
    with progress(total * U64.itemsize, "document lengths") as bar:
        for k, src in enumerate(sources):
            lo, hi = int(bounds[k]), int(bounds[k + 1])
            own = LengthHistogram()
            own.corpus_documents = int(sizes[lo:hi].sum())
            for j, a, count in _blocks(sizes, lo, hi, drawn):
                lengths = _index_lengths(_index_path(src, src.shards[j - lo]), a, count)
                hist.add(lengths)
                own.add(lengths)
                bar.update(count * U64.itemsize)
            if per_source is not None:
                if not own.count and own.corpus_documents:  # sampled, and no block of it drawn: one of its own
                    j = int(np.flatnonzero(sizes[lo:hi])[0])
                    own.add(_index_lengths(_index_path(src, src.shards[j]), 0, min(INDEX_BLOCK, int(sizes[lo + j]))))
                # one source's line of `document_lengths.sources`: its report without its histogram
                per_source.append({k: v for k, v in own.report().items() if k != "histogram"})
    return hist


def _index_path(src: PackedSource, entry: dict) -> Path:
    return src.path / f"{entry['path']}.index"


def _blocks(sizes: np.ndarray, lo: int, hi: int, drawn: set | None):
    """(shard, first entry, count) of each block read of shards [lo, hi) (shard numbers over all
    sources), in order: every block, or those `drawn`."""
    if drawn is not None:
        yield from ((j, a, min(INDEX_BLOCK, int(sizes[j]) - a)) for j, a in sorted(drawn) if lo <= j < hi)
        return
    for j in range(lo, hi):
        n = int(sizes[j])
        yield from ((j, a, min(INDEX_BLOCK, n - a)) for a in range(0, n, INDEX_BLOCK))


def _index_lengths(path, a: int, count: int) -> np.ndarray:
    """The lengths of documents [a, a + count) of one shard, from its `.ds.index`."""
    prev = 0 if a == 0 else int(read_array(path, U64, 1, (a - 1) * U64.itemsize)[0])
    ends = read_array(path, U64, count, a * U64.itemsize)
    lengths = np.diff(ends.astype(np.int64), prepend=prev)
    bad = np.flatnonzero(lengths <= 0)
    if len(bad):  # the histogram would count negative lengths: name the entry instead
        k = a + int(bad[0])
        raise TokpackError(
            "document index is not increasing",
            file=path,
            where=f"entry {k}",
            expected=f"an end above {prev if k == a else int(ends[bad[0] - 1])}",
            found=int(ends[bad[0]]),
            hint="the packed source is corrupt: run `tokpack validate` on it, then pack it again",
        )
    return lengths
