"""`tokpack inspect`'s batch diversity (tokpack.packer.inspection): on the first K global batches
of B samples, distinct documents per batch and the largest share of a batch's tokens from one
document, BEFORE the shuffle (the sources' windows in order) and AFTER it (the epoch's order).
After the shuffle, each sample's documents come from its plan, through the packing's registry
entry (tokpack.shuffle.packings): a window located in its source (EpochPlan.locate), or a row
table's pieces (`table_rows`); checked against the epoch's bytes, else EOS-delimited fragments.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tokpack.formats.errors import TokpackError
from tokpack.formats.io.gate import map_array, read_array, regular_size
from tokpack.formats.constants import DEFAULT_PLAN_MEMORY, U64
from tokpack.formats.shards import PackedSource
from tokpack.loader.reader import SampleReader

DOC_ID_SHIFT = 48  # a document's id in a batch: source index << 48 | document number in the source


class DocumentMap:
    """Token position -> document, for one packed source, from its `.ds.index` files opened
    as memory maps (a lookup touches O(log n) pages, nothing is loaded whole)."""

    def __init__(self, src: PackedSource, source_index: int):
        self.src = src  # the packed source
        self.tag = source_index << DOC_ID_SHIFT  # high bits of this source's document ids
        docs = [int(s.get("documents", 0)) for s in src.shards]
        self.docs_before = np.concatenate([[0], np.cumsum(docs)]).astype(np.int64)  # per shard
        self._ends: dict[int, np.ndarray] = {}  # shard -> memory-mapped index

    def ends(self, shard: int) -> np.ndarray:
        if shard not in self._ends:
            path = self.src.path / f"{self.src.shards[shard]['path']}.index"
            # a URL: the shard's index read whole (a shard's documents x 8 bytes)
            if not isinstance(path, Path) or not regular_size(path):
                self._ends[shard] = read_array(path, U64)
            else:
                self._ends[shard] = map_array(path, U64)  # through the gate: a FIFO must not block
        return self._ends[shard]

    def documents(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(document ids, tokens of each inside [start, stop)) for a token range of the stream."""
        ids, counts = [], []
        starts = self.src.shard_starts
        i = int(np.searchsorted(starts, start, side="right")) - 1
        while start < stop:
            base = int(starts[i])
            hi = min(stop, int(starts[i + 1]))
            if hi > start:
                ends = self.ends(i)
                a, b = start - base, hi - base
                j0 = int(np.searchsorted(ends, a, side="right"))  # document holding token a
                j1 = int(np.searchsorted(ends, b - 1, side="right"))  # document holding token b-1
                cuts = np.concatenate([[a], np.asarray(ends[j0:j1], dtype=np.int64), [b]])
                ids.append(self.tag + self.docs_before[i] + np.arange(j0, j1 + 1, dtype=np.int64))
                counts.append(np.diff(cuts))
                start = hi
            i += 1
        return np.concatenate(ids), np.concatenate(counts)


def batch_stats(docs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[int, float]:
    """(distinct documents, largest single-document share of the batch's tokens) of a batch
    given as (document ids, tokens of each) per sample."""
    ids_all, counts_all = np.concatenate([i for i, _ in docs]), np.concatenate([c for _, c in docs])
    uniq, inv = np.unique(ids_all, return_inverse=True)
    per_doc = np.bincount(inv, weights=counts_all)
    return int(len(uniq)), float(per_doc.max() / counts_all.sum())


def diversity_before(maps: list[DocumentMap], row: int, batch: int, batches: int) -> dict:
    """Sequential windows of the sources in order (each source's stream cut from token 0)."""
    windows = [m.src.tokens // row for m in maps]

    def window_docs(w: int) -> tuple[np.ndarray, np.ndarray]:
        s = 0
        while w >= windows[s]:
            w -= windows[s]
            s += 1
        return maps[s].documents(w * row, (w + 1) * row)

    n = min(batches, sum(windows) // batch)
    return _series([batch_stats([window_docs(w) for w in range(b * batch, (b + 1) * batch)]) for b in range(n)])


def diversity_after_plan(plan, maps: list[DocumentMap], reader, batch: int, batches: int) -> tuple[dict | None, int]:
    """Epoch order (its `reader`'s) through the shuffle plan. Returns (series, samples whose bytes did
    not match their planned window); a mismatch means the plan does not describe this epoch."""
    stats, mismatches = [], 0
    window = np.empty(plan.row_tokens, dtype=reader.dtype)
    for b in range(min(batches, plan.samples // batch)):
        s_idx, w_idx, _ = plan.locate(np.arange(b * batch, (b + 1) * batch, dtype=np.int64))
        rows = reader.read(b * batch, batch)
        docs = []
        for k, (s, w) in enumerate(zip(s_idx.tolist(), w_idx.tolist())):
            start, stop = plan.token_range(s, w)
            stream = plan.stream(s, maps[s].src)  # with --holdout: the kept documents' stream
            stream.read_into(start, window)
            mismatches += not np.array_equal(window, rows[k])
            if stream is maps[s].src:
                docs.append(maps[s].documents(start, stop))
            else:  # the window's documents: those of each raw range it is gathered from
                parts = [maps[s].documents(raw, raw + y - x) for raw, x, y in stream.raw_pieces(start, stop - start)]
                docs.append(tuple(np.concatenate([p[i] for p in parts]) for i in (0, 1)))
        stats.append(batch_stats(docs))
    return _series(stats), mismatches


def diversity_after_table(plan, maps: list[DocumentMap], reader, batch: int, batches: int) -> tuple[dict | None, int]:
    """An epoch whose packing builds its rows from a row table (its registry entry's
    `table_rows`: best-fit), in order: each sample's documents from the table, built within the
    plan's memory and read a batch's rows at a time (never whole). Returns (series, samples whose
    bytes differ from the rows the table builds)."""
    from tokpack.shuffle.packings import of_plan

    entry = of_plan(plan)
    opened = [m.src for m in maps]
    pool = entry.token_pool(plan, opened)
    stats, mismatches = [], 0
    with entry.table_rows(plan, opened) as built:
        for b in range(min(batches, plan.samples // batch)):
            g0, g1 = b * batch, (b + 1) * batch
            rows = reader.read(g0, batch)
            t, starts = built.rows(g0, g1)
            mismatches += int((rows != pool.rows(t, g0, g1, plan.row_tokens, plan.pad_id, starts)).any(axis=1).sum())
            ids = (t["source"].astype(np.int64) << DOC_ID_SHIFT) + t["doc"].astype(np.int64)
            stats.append(batch_stats([(ids, t["length"].astype(np.int64))]))
    return _series(stats), mismatches


def diversity_after_eos(reader, manifest: dict, batch: int, batches: int) -> dict:
    """Epoch order (its `reader`'s), documents = EOS-delimited fragments within each sample."""
    eos = int(manifest["eos_id"])
    stats = []
    for b in range(min(batches, int(manifest["samples"]) // batch)):
        rows = reader.read(b * batch, batch)
        ends_mask = rows == eos
        ends_mask[:, -1] = True  # a sample end closes the fragment it cuts
        lengths = np.diff(np.flatnonzero(ends_mask.ravel()) + 1, prepend=0)
        stats.append((int(len(lengths)), float(lengths.max() / rows.size)))
    return _series(stats)


def _series(stats: list[tuple[int, float]]) -> dict:
    """Per batch (distinct documents, largest document share) -> the report's series and summary."""
    distinct, share = [d for d, _ in stats], [m for _, m in stats]
    out = {"batches": len(distinct), "distinct_documents": distinct, "max_doc_share": [round(x, 6) for x in share]}
    if distinct:
        out["summary"] = {  # the counts are ints, which round() keeps
            name: {"mean": round(float(np.mean(v)), d), "min": round(min(v), d), "max": round(max(v), d)}
            for name, v, d in (("distinct_documents", distinct, 2), ("max_doc_share", share, 4))
        }
    return out


def batch_diversity(
    sources: list[PackedSource], chosen, L: int, batch: int, batches: int, memory: int | None = None
) -> dict:
    """Before (sequential source windows) and after (the chosen epoch's order, documents
    identified through the shuffle plan, else EOS fragments)."""
    diversity: dict = {}
    maps = [DocumentMap(s, i) for i, s in enumerate(sources)]
    if maps:
        diversity["before"] = diversity_before(maps, L + 1, batch, batches)
    if chosen is None:
        return diversity
    e, edir, em = chosen
    reader = SampleReader.from_manifests([(edir, em)])
    after, method, note = None, "eos", "sources not reachable"
    if maps:
        try:
            from tokpack.shuffle.packings import of_manifest

            entry = of_manifest(em)
            plan = entry.from_manifest(em, sources, memory or DEFAULT_PLAN_MEMORY)
        except (ImportError, TokpackError, KeyError, ValueError) as err:
            note = f"shuffle plan unavailable ({type(err).__name__}: {err})"
        else:
            # A packing with a row table (best-fit) names each sample's documents; a window plan
            # locates each sample's window in its source.
            after, mismatches = (diversity_after_plan if entry.table_rows is None else diversity_after_table)(
                plan, maps, reader, batch, batches
            )
            note = None
            if mismatches:
                after, note = None, f"{mismatches} samples differ from their planned source window: plan not used"
            else:
                method = "plan"
    diversity.update(epoch=e, after=after or diversity_after_eos(reader, em, batch, batches), document_identity=method)
    if note:
        diversity["note"] = note
    return diversity
