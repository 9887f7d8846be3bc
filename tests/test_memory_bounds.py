"""What a command holds does not grow with a source's number of shards (issue 42, item 7's rule
beyond validate): a front-to-back read of a source's windows keeps open the shards of the block
it reads, not every shard it has read (a 50,000-shard source held 50,000 files open)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np

from tests.conftest import random_docs, write_source
from tokpack.formats.shards import PackedSource
from tokpack.shuffle.source_windows import iter_source_windows


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_reading_a_sources_windows_keeps_open_only_the_shards_of_its_block(tmp_path):
    """200 one-document shards read a window at a time: at most a few files open at once (the
    block's and the next one's, asked of the kernel ahead), where every shard read stayed open
    until the source's last window; the windows are the source's tokens, in order."""
    docs = random_docs(np.random.default_rng(3), 200, 1000, 0, min_len=40, max_len=60)
    src = PackedSource.open(write_source(tmp_path / "s", docs, docs_per_shard=1))
    row = 16
    windows = src.tokens // row
    plan = SimpleNamespace(sources=[SimpleNamespace(windows=windows, offset=0)], row_tokens=row)
    tokens = np.concatenate(docs).astype(src.dtype)
    for mapped in (False, True):
        base, most, got = _open_files(), 0, []
        for a, rows in iter_source_windows(plan, 0, src, block_bytes=row * src.dtype.itemsize, mapped=mapped):
            most = max(most, _open_files() - base)
            got.append((a, np.array(rows).reshape(-1)))
        assert [a for a, _ in got] == list(range(windows)), mapped
        assert np.array_equal(np.concatenate([r for _, r in got]), tokens[: windows * row]), mapped
        assert len(src.shards) == 200 and most <= 6, f"{most} files open at once reading 200 shards (mapped={mapped})"
