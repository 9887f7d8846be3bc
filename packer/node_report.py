"""What `shuffle --to-nodes` reports (issue 42, item 5): what `tokpack shuffle` reports of the same
epochs (the summary's fields, each epoch's per-source counts and packing figures, the warnings
of sources drawn more than once), beside what only a node has (its slice, its rounds), and the
progress of the epoch's phases while they run (a bar on a terminal, lines in a log: node 0's,
whose share stands for every node's)."""

from __future__ import annotations

from tokpack.formats.io.progress_log import progress
from tokpack.shuffle import packings
from tokpack.shuffle.run import epoch_samples, repeat_warnings

PATH = "to-nodes"  # the summaries' "path": where the epoch's tokens went


def reading_bar(ne, shown: bool):
    """The exchange's bar over the tokens this process reads and sends: of each source, the rows
    the epoch takes of it in proportion to this process's share of its tokens (exact for windows,
    about right for best-fit's documents)."""
    if not shown:
        return progress(None, "", enabled=False)
    share: dict[int, int] = {}
    for s, k0, k1 in ne.runs():
        share[s] = share.get(s, 0) + sum(int(ne.sources[s].shards[k]["tokens"]) for k in range(k0, k1))
    rows = 0.0
    for s, r in enumerate(ne.plan.source_report()):
        every = sum(int(sh["tokens"]) for sh in ne.sources[s].shards)
        rows += r["samples"] * share.get(s, 0) / every if every else 0
    total = int(rows * ne.job.row_bytes)
    return progress(total, f"shuffle --to-nodes: epoch {ne.plan.epoch}: read and exchange (node {ne.node})")


def counted(reads, bar, size):
    """`reads` as they pass, each item's `size(item)` bytes counted on `bar`."""
    for item in reads:
        bar.update(size(item))
        yield item


def epoch_detail(job, stage, report: list[dict], manifest: dict, entries: list[dict], extra: dict) -> dict:
    """One epoch's entry of the summary: a plain shuffle's epochs_detail entry (run_epoch's), its
    bytes those of this node's slice, and `extra` (the node's rounds, buckets...)."""
    return {
        "epoch": job.plan.epoch,
        "path": PATH,
        "samples": job.plan.samples,
        "shards": job.n_shards,
        "shards_reused": 0,
        "bytes_written": sum(int(e["bytes"]) for e in entries),
        "sample_multiset_hash": manifest["sample_multiset_hash"],
        "packing": packings.shown(manifest),
        "stage": stage,
        "sources": report,
        **extra,
    }


def run_summary(setup, out, epochs: list[int], summaries: list[dict], skipped: list[int], seconds: float) -> dict:
    """The fields of a plain shuffle's summary (tokpack.shuffle.run.shuffle_run's), for this node."""
    sizes = epoch_samples(setup.runplan, epochs)
    written = sum(s["bytes_written"] for s in summaries)
    return {
        "output": str(out.absolute()),
        "epochs": epochs,
        "written": [s["epoch"] for s in summaries],
        "skipped": skipped,
        "reused_shards": 0,
        "samples_per_epoch": sizes[0] if len(set(sizes)) == 1 else None,
        "epoch_samples": sizes,
        "seq_len": setup.runplan.schedule.seq_len,
        "shard_samples": setup.shard_samples,
        "packing": setup.runplan.packing.name,
        "holdout": None,
        "path": PATH if summaries else "none",
        "bytes_written": written,
        "mb_per_s": round(written / 1e6 / seconds, 1) if seconds > 0 and written else None,
        "warnings": [w for s in summaries for w in repeat_warnings(s["epoch"], s["sources"], s["stage"])],
    }
