"""Where a command's shards go: one interface for a local folder, a bucket and a node slice.

A writer writes and commits a shard's files in a local folder, as for any local output; the
Output opens that shard (`open_shard`), makes its committed files durable where they belong
(`commit`: nothing more for a local folder; sent, then the record of the shard, for a bucket),
says whether a shard recorded before is still there (`has`), and finishes a directory with its
manifest, written (and sent) last (`finish`). Shuffle's epoch shards and stage's node slices
(packer/slicing.py) go through it, so a one-pass "shuffle straight into node slices" is one
more Output, not another copy path.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .io import Outbox, RemotePath, kept_at
from .manifest import MANIFEST, write_manifest
from .shards import EpochShardWriter, shard_on_disk, shard_suffixes


class LocalOutput:
    """Shards committed in a local folder are where they belong."""

    outbox: Outbox | None = None

    def where(self, directory: str | Path) -> Path | RemotePath:
        """Where a committed file or folder under `directory` is kept."""
        return kept_at(directory, self.outbox)

    def open_shard(self, directory: str | Path, name: str, dtype: np.dtype, seq_len: int, eos_id: int,
                   tokenizer: str) -> EpochShardWriter:
        return EpochShardWriter(directory, name, dtype, seq_len, eos_id, tokenizer)

    def commit(self, directory: str | Path, entry: dict, record: str | Path | None = None) -> None:
        """The shard `entry` names is committed under `directory` (and `record`, the note that it is)."""

    def has(self, directory: str | Path, entry: dict, itemsize: int) -> bool:
        return shard_on_disk(self.where(directory), entry, itemsize)

    def finish(self, directory: str | Path, manifest: dict, name: str = MANIFEST) -> None:
        write_manifest(directory, manifest, name=name, outbox=self.outbox)


class BucketOutput(LocalOutput):
    """Shards go to an object store through an Outbox: each one's files are sent once committed,
    then its record; the manifest last."""

    def __init__(self, outbox: Outbox):
        self.outbox = outbox

    def commit(self, directory: str | Path, entry: dict, record: str | Path | None = None) -> None:
        self.outbox.send(*(Path(directory) / f"{entry['path']}{s}" for s in shard_suffixes(entry)))
        if record is not None:
            self.outbox.send(record, keep=True)


def output_for(outbox: Outbox | None) -> LocalOutput:
    """The Output of a command given its outbox (None: a local folder)."""
    return BucketOutput(outbox) if outbox else LocalOutput()
