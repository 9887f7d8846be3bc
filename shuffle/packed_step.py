"""The datatrove step that writes a best-fit epoch (shuffle.packed) in memory: one task reads
every used source once (verifying each shard's xxh3_128 against its manifest), builds the row
table, then assembles each output shard's rows from the documents, padding each row's tail
with the pad id, and writes them in output order through EpochJob.write_shard, with the
shard's `.pad` sidecar. One read, one write, as the window shuffle's InMemoryStep.

Memory: the used sources' tokens, the row table (PIECE, 36 bytes a piece) and the chunks of
rows in flight. shuffle/run.py runs an epoch here only when
that fits `--memory`, and refuses the epoch otherwise (the out-of-core path is not built yet).
"""

from __future__ import annotations

import xxhash

from formats.io import progress

from .packed import PIECE, TokenPool, read_table, row_padding
from .steps import RING, EpochJob, _Step

GATHER_TOKENS = 1 << 20  # tokens of rows assembled per call


def packed_memory(job, sources) -> int:
    """Bytes the in-memory best-fit path holds for the epoch `job`."""
    plan = job.plan
    used = [s for s, sp in enumerate(plan.sources) if sp.samples]
    tokens = sum(sources[s].tokens for s in used)
    docs = sum(int(sources[s].manifest.get("documents", 0)) for s in used)
    itemsize = job.token_dtype.itemsize
    pieces = docs * max(1, max((sp.passes for sp in plan.sources), default=1)) + plan.samples
    chunk = RING * GATHER_TOKENS * itemsize  # in flight: RING chunks
    return tokens * itemsize + pieces * (PIECE.itemsize * 2 + 16) + plan.samples * 12 + chunk


class PackedInMemoryStep(_Step):
    """One task: the row table, the sources read once, then every shard in output order."""

    name = "shuffle best-fit in memory"

    def __init__(self, job: EpochJob, table_file: str, table_hash: str, budget: int = 0):
        super().__init__(job, budget=budget)
        self.table_file, self.table_hash = table_file, table_hash  # the materialised row table

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        job, plan = self.job, self.job.plan
        todo = [i for i in range(rank, job.n_shards, world_size) if job.shard_done(i) is None]
        if not todo:
            return
        sources = job.open_sources()
        table = read_table(self.table_file, self.table_hash)
        pad = row_padding(table, plan.samples, plan.row_tokens)

        def check(src, k, tokens):
            found = xxhash.xxh3_128_hexdigest(tokens)
            if found != src.shards[k]["xxh3_128"]:
                job.source_changed(src.path / src.shards[k]["path"], src.shards[k]["xxh3_128"], found)

        pool = TokenPool(plan, sources, check)
        rows = max(1, GATHER_TOKENS // plan.row_tokens)

        def blocks(g0, g1):
            for a in range(g0, g1, rows):
                chunk = pool.rows(table, a, min(g1, a + rows), plan.row_tokens, plan.pad_id)
                yield chunk.reshape(-1).view(job.row_void)

        with progress(len(todo), f"epoch {plan.epoch}: write", unit="shard", enabled=job.show_progress) as bar:
            for i in todo:
                g0, g1 = job.shard_range(i)
                job.write_shard(i, blocks(g0, g1), pad=pad[g0:g1])
                bar.update(1)
