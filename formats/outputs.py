"""Where a command's output goes: the one seam between the commands that write shards and the
place their files end up.

Every writer works in a local folder exactly as for a local output: it writes a file under a
temporary name, renames it, and then tells its Output. The Output decides what else happens:

- `LocalOutput`: the local folder is the output. Nothing else happens.
- `BucketOutput`: the local folder is a working copy of an object-store prefix, driven through
  a `tokpack.formats.io.Outbox`. Each committed shard is sent and then removed here, so the local disk
  holds only a few shards at a time. Records of finished work are sent and kept here. The
  manifest is sent last, so a partial upload never looks complete.

An Output opens a shard (`open_shard`) and commits it (`commit`: the shard's files, then the
record that it is done). It says whether a shard recorded earlier is still there (`has`), and
finishes a directory with its manifest, written and sent last (`finish`). Around those it keeps
a command's state files (`send_record`), removes a folder in both places (`remove_tree`,
`remove_sent`), says where a committed file is kept (`where`) and what the user calls it
(`shown`), and says how many bytes the local folder needs while files are written
(`local_need`). `pack` (packer/packing.py), `shuffle` (shuffle/run.py, shuffle/steps.py) and
stage's node slices (packer/slicing.py) write through it. packer/executors.py `local_paths`
picks the Output from the user's -o.

A one-pass "shuffle straight into node slices" is one more Output, not another copy path. Its
`open_shard` and `commit` would route each committed shard's rows to the rank files of the
nodes that read them. Its `finish` would write each slice's manifests. Shuffle's writers would
not change.

Outputs are small and picklable: shuffle's EpochJob carries one to the executor's tasks.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .io import Outbox, RemotePath
from .manifest import MANIFEST, write_manifest
from .shards import EpochShardWriter, shard_on_disk, shard_suffixes


@dataclass(frozen=True)
class LocalOutput:
    """The local folder is the output: a committed file is where it belongs."""

    # The local folder is only a working copy: a store decides what exists, and committed files leave it.
    staged = False

    def where(self, directory: str | Path) -> Path | RemotePath:
        """Where a committed file or folder under `directory` is kept."""
        return Path(directory)

    def shown(self, directory: str | Path) -> str:
        """The user's name for `directory` (the -o they gave, or what is under it)."""
        return str(directory)

    def open_shard(self, directory: str | Path, name: str, dtype: np.dtype, seq_len: int, eos_id: int,
                   tokenizer: str) -> EpochShardWriter:
        return EpochShardWriter(directory, name, dtype, seq_len, eos_id, tokenizer)

    def commit(self, directory: str | Path, entry: dict, record: str | Path | None = None) -> None:
        """The shard `entry` names is committed under `directory` (and `record`, the note that it is)."""

    def send_record(self, path: str | Path) -> None:
        """`path`, a state file just written (a record of finished work, a plan), is kept with the output."""

    def has(self, directory: str | Path, entry: dict, itemsize: int) -> bool:
        return shard_on_disk(self.where(directory), entry, itemsize)

    def finish(self, directory: str | Path, manifest: dict, name: str = MANIFEST) -> None:
        """`directory` is complete: its manifest is written last."""
        write_manifest(directory, manifest, name=name)

    def remove_sent(self, directory: str | Path) -> None:
        """What was sent from `directory` is removed from where it went."""

    def remove_tree(self, directory: str | Path) -> None:
        """`directory` is removed wherever it is kept."""
        self.remove_sent(directory)
        shutil.rmtree(directory, ignore_errors=True)

    def local_need(self, written: int, in_flight: int, here: int = 0) -> int:
        """Bytes the local folder needs while `written` bytes are committed there, at most
        `in_flight` of them written and not yet committed at once, `here` of them already there."""
        return written - here


@dataclass(frozen=True)
class BucketOutput(LocalOutput):
    """The output is an object-store prefix: each file is sent there through the Outbox when it
    is committed, then the record that it is done. The manifest is sent last."""

    outbox: Outbox
    staged = True

    def where(self, directory: str | Path) -> RemotePath:
        return self.outbox.remote_of(directory)

    def shown(self, directory: str | Path) -> str:
        return str(self.where(directory))

    def commit(self, directory: str | Path, entry: dict, record: str | Path | None = None) -> None:
        self.outbox.send(*(Path(directory) / f"{entry['path']}{s}" for s in shard_suffixes(entry)))
        if record is not None:
            self.send_record(record)

    def send_record(self, path: str | Path) -> None:
        self.outbox.send(path, keep=True)

    def finish(self, directory: str | Path, manifest: dict, name: str = MANIFEST) -> None:
        super().finish(directory, manifest, name)
        self.send_record(Path(directory) / name)

    def remove_sent(self, directory: str | Path) -> None:
        self.where(directory).remove_tree()

    def local_need(self, written: int, in_flight: int, here: int = 0) -> int:
        return min(written, in_flight)  # each file leaves once committed: the rest never sits here
