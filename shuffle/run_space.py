"""What a shuffle epoch holds, in memory and on disk: whether it runs in memory, each out-of-core
task's budget, its planned manifest, its bytes and scratch, and the peak bytes a run writes on OUT's
filesystem (checked before a byte is written, and reported by `tokpack plan shuffle`).
"""

from __future__ import annotations

from tokpack.formats.guard import bytes_under
from tokpack.formats.reading import canonical_bytes
from tokpack.formats.names import metadata_text
from tokpack.formats.shards import PackedSource

from . import packings
from .run_records import job_epoch_manifest
from .epoch_job import EpochJob


def memory_path(job: EpochJob, memory: int) -> tuple[int, int]:
    """(bytes of the windows to hold, bytes the in-memory path holds with its chunk buffers): the
    epoch runs in memory when the latter fits `memory`. Each packing says (a best-fit epoch: what
    its in-memory path holds, twice)."""
    return packings.of_plan(job.plan).memory_path(job, memory)


def task_budget(memory: int, workers: int) -> int:
    """Out of core, the bytes each of `workers` concurrent tasks may use."""
    return max(1, memory // workers)


def planned_epoch_manifest(job: EpochJob, sources: list[PackedSource]) -> dict:
    """The epoch manifest as the run will write it, but for its checksums and its fragment
    counts, which are estimates (a sample is cut at each document end: one fragment per sample
    plus the sources' documents per token): its size is the written one's to a few bytes."""
    docs, tokens = (sum(int(s.manifest.get(k, 0)) for s in sources) for k in ("documents", "tokens"))
    plan, per_row = job.plan, 1 + docs / max(1, tokens) * job.plan.row_tokens
    entries = []
    for i in range(job.n_shards):
        g0, g1 = job.shard_range(i)
        entries.append(
            {
                "path": job.shard_file(i),
                "tokens": (g1 - g0) * plan.row_tokens,
                "bytes": (g1 - g0) * job.row_bytes,
                "samples": g1 - g0,
                "index_xxh3_128": "0" * 32,
                "rows_xxh3_128": "0" * 32,
                "metadata_xxh3_128": "0" * 32,
                "multiset_hash": "0" * 16,
                "fragments": int((g1 - g0) * per_row),
            }
        )
    # the default packing's name whatever the packing: `plan` has always counted a planned
    # epoch manifest's bytes so
    return job_epoch_manifest(job, entries, packings.named(packings.DEFAULT).shuffle)


def epoch_bytes(job: EpochJob, manifest: dict) -> int:
    """Bytes of the epoch directory its planned manifest describes: each shard's rows, its
    index (8 bytes a fragment), its row hashes (8 bytes a sample), its .ds.metadata, and the manifest."""
    meta = sum(
        len(metadata_text(job.tokenizer, job.token_dtype.itemsize, s["tokens"]).encode()) for s in manifest["shards"]
    )
    return (
        manifest["tokens"] * job.token_dtype.itemsize
        + 8 * manifest["fragments"]
        + 8 * manifest["samples"]
        + meta
        + len(canonical_bytes(manifest))
    )


def scratch_bytes(job: EpochJob, out_of_core: bool = True) -> int:
    """The epoch's scratch, as its packing counts it: out of core, the window shuffle's buckets
    hold every output row and its 8-byte position; a best-fit epoch's also its row table, in
    memory or not (tokpack.shuffle.packed_step.packed_scratch_bytes)."""
    return packings.of_plan(job.plan).scratch_bytes(job, out_of_core)


def bytes_to_write(jobs: list[EpochJob], sources: list[PackedSource], memory: int, workers: int = 1) -> int:
    """Peak bytes on OUT's filesystem while these epochs are written, less what a resumed run has
    there already: the epochs written before, then this epoch's files with, out of core, its
    bucket scratch, of which the order pass deletes each shard's part once the shard is
    written: the peak is the scratch plus the first shard. To a bucket, the local folder holds
    the scratch and a shard per worker at most, each sent and removed once committed."""
    peak = written = 0
    for job in jobs:
        epoch = epoch_bytes(job, planned_epoch_manifest(job, sources))
        shard = epoch * min(1, job.shard_samples / max(job.plan.samples, 1))
        have = bytes_under(job.epoch_dir) + bytes_under(job.work_dir)
        during = job.output.local_need(epoch, workers * shard)
        if memory_path(job, memory)[1] > memory:
            during = scratch_bytes(job) + shard
        else:
            during += scratch_bytes(job, out_of_core=False)
        peak = max(peak, written + max(0, during - have))
        written += job.output.local_need(max(0, epoch - have), 0)
    return int(max(peak, written))
