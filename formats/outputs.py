"""Where a command's output goes: the one sink between the commands that write files and the
place those files end up.

`Output` is the interface every command is given and annotates. It is a sink: a command opens
each shard at its place in the plan (`open_shard(ShardPlace, format)`) and gets the writer of
every file of that shard: `.ds`, `.ds.index`, `.ds.metadata`, `.ds.loss` or `.ds.rows`,
`.ds.pad`, the fragment count in its entry and its done record. The writer's `close()`
commits them all and hands them to the Output (`commit`); no caller writes a shard's file
beside it. A directory ends with its manifest (`finish`), written and sent last. Its other
methods (state files, a verified copy, a manifest withdrawn, a folder started afresh or removed)
keep the local folder and the place the output is kept in step; each says what it does.

The implementations differ only in `where`, `shown`, `send`, `remove_sent` and `local_need`:

- `LocalOutput`: the local folder is the output. Nothing is sent.
- `BucketOutput`: the local folder is a working copy of an object-store prefix, driven through
  a `tokpack.formats.io.Outbox`. Each committed shard file is sent and then removed here, so
  the local disk holds only a few shards at a time. Records of finished work are sent and kept
  here. The manifest is sent last, so a partial upload never looks complete.

`pack` (packer/packing.py), `shuffle` (shuffle/run.py, shuffle/steps.py), the whole-run
`stage` (packer/staging.py) and stage's node slices (packer/slicing.py) write through it.
packer/executors.py `local_paths` picks the Output from the user's -o.

An Output that writes node slices straight from the shuffle (docs/ARCHITECTURE.md, "Writing
through an Output") overrides `open_shard`: the place gives the epoch and the samples
[g0, g1) the shard holds, in order, which is all the slice arithmetic needs to route each row
to its rank's file. tests/test_outputs.py runs such a sketch.

Outputs are small and picklable: shuffle's EpochJob carries one to the executor's tasks.
"""

from __future__ import annotations

import json
import shutil
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar

import numpy as np

from .io.writes import Outbox, commit_file, write_bytes_atomic
from .io.paths import RemotePath
from .constants import MANIFEST
from .reading import write_manifest
from .shards import EpochShardWriter, SourceShardWriter, shard_on_disk, shard_suffixes


@dataclass(frozen=True)
class ShardPlace:
    """Where a shard sits in its command's plan: what an Output may route it by."""

    directory: str  # the local folder its files are written in
    name: str  # its token file: NNNNN.ds (an epoch's or a pack part's shard), rank-RRRRR.ds (a node slice's)
    shard: int  # its number: shard i of the epoch, the k-th shard of a pack part, a node slice's rank
    epoch: int | None = None  # the epoch it belongs to; None for a packed source's shard
    samples: tuple[int, int] | None = None  # an epoch shard: the epoch's samples [g0, g1) it holds, in order
    part: int | None = None  # a pack part's shard: the input file it comes from
    rank: int | None = None  # a node slice's rank file: that rank
    record: str | None = None  # its done record (its entry as JSON), written after its files; None: none

    def files(self, entry: dict) -> list[Path]:
        """The shard's files under `directory`, in the order they are sent."""
        return [Path(self.directory) / f"{entry['path']}{s}" for s in shard_suffixes(entry)]


@dataclass(frozen=True)
class EpochShardFormat:
    """An epoch shard's (or a node slice's rank file's) rows: what its writer needs."""

    dtype: np.dtype
    seq_len: int
    eos_id: int
    tokenizer: str
    padded: bool = False  # best-fit: a `.ds.pad` beside the rows
    hashed_only: bool = False  # tokens and index hashed for the manifest, not written (EpochShardWriter)
    placed: bool = False  # tokens written row by row in any order first, then hashed in order (EpochShardWriter)
    writer: ClassVar[type] = EpochShardWriter  # whose arguments its fields are


@dataclass(frozen=True)
class SourceShardFormat:
    """A packed source's shard: whole documents."""

    dtype: np.dtype
    tokenizer: str
    with_loss: bool = False
    writer: ClassVar[type] = SourceShardWriter  # whose arguments its fields are


class ShardWriter:
    """The writer an Output gives for one shard: the format's writer of its files (its write
    methods are that writer's), whose close() commits every file, writes the done record and
    hands the shard to the Output. abort() leaves no temporary file, also after a close."""

    def __init__(self, output: "Output", place: ShardPlace, files: EpochShardWriter | SourceShardWriter):
        self.output, self.place, self.files = output, place, files

    def __getattr__(self, name: str):  # write_rows, write_tokens, write_index, write_pad, write, abort, samples...
        if name == "files":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.files, name)

    def close(self) -> dict:
        entry = self.files.close()
        if self.place.record is not None:
            record = Path(self.place.record)
            record.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(record, json.dumps(entry).encode(), fsync=True)
        self.output.commit(self.place, entry)
        return entry


class Output(ABC):
    """Where a command's files go (module docstring). Callers see only this interface."""

    # The local folder is only a working copy: a store decides what exists, and committed files leave it.
    staged: ClassVar[bool] = False

    @property
    def links_files(self) -> bool:
        """Whether a file hard-linked into the local folder is the output's file (pack --link): only
        where the local folder is the output, not a working copy whose files leave it."""
        return not self.staged

    # ------------------------------------------------ what differs between outputs

    @abstractmethod
    def where(self, directory: str | Path) -> Path | RemotePath:
        """Where a committed file or folder under `directory` is kept."""

    @abstractmethod
    def shown(self, directory: str | Path) -> str:
        """The user's name for `directory` (the -o they gave, or what is under it)."""

    @abstractmethod
    def send(self, *files: str | Path, keep: bool = False) -> None:
        """`files`, just committed under the local folder, go where the output is kept, in order;
        `keep`: they stay here too (state a rerun reads: records, manifests)."""

    @abstractmethod
    def remove_sent(self, directory: str | Path) -> None:
        """What was sent from `directory` is removed from where it went."""

    @abstractmethod
    def local_need(self, written: int, in_flight: int, here: int = 0) -> int:
        """Bytes the local folder needs while `written` bytes are committed there, at most
        `in_flight` of them written and not yet committed at once, `here` of them already there."""

    # ------------------------------------------------ the sink, the same for every output

    def open_shard(self, place: ShardPlace, fmt: EpochShardFormat | SourceShardFormat) -> ShardWriter:
        """The writer of every file of the shard at `place`."""
        return ShardWriter(self, place, fmt.writer(place.directory, place.name, **vars(fmt)))

    def commit(self, place: ShardPlace, entry: dict) -> None:
        """The shard at `place` (its manifest entry `entry`) is committed: its files, then its record."""
        self.send(*place.files(entry))
        if place.record is not None:
            self.send_record(place.record)

    def commit_file(self, tmp: str | Path, final: str | Path) -> None:
        """A verified file written as `tmp` takes its name `final` (fsync'd first) and is sent."""
        commit_file(tmp, final, fsync=True)
        self.send(final)

    def send_record(self, path: str | Path) -> None:
        """`path`, a state file just written (a record of finished work, a plan), is kept with the output."""
        self.send(path, keep=True)

    def finish(self, directory: str | Path, manifest: dict, name: str = MANIFEST) -> None:
        """`directory` is complete: its manifest (or the record `name`) is written and sent last."""
        write_manifest(directory, manifest, name=name)
        self.send_record(Path(directory) / name)

    def unfinish(self, directory: str | Path, name: str = MANIFEST) -> None:
        """`directory` is about to change: the manifest (or record `name`) that called it complete
        goes, here and where it was sent."""
        path = Path(directory) / name
        path.unlink(missing_ok=True)
        self.remove_sent(path)

    def start(self, directory: str | Path, clear: Callable[[Path], None], replace: bool) -> None:
        """`directory` is written from scratch. With `replace`, the output there is removed:
        `clear` deletes the command's own files here, and what was sent goes too. A working copy
        (`staged`) left here while the store holds nothing is stale, and goes the same way."""
        if replace or (self.staged and Path(directory).exists()):
            clear(Path(directory))
            self.remove_sent(directory)

    def has(self, directory: str | Path, entry: dict, itemsize: int) -> bool:
        """Whether the shard a record names (`entry`) is still where it was committed."""
        return shard_on_disk(self.where(directory), entry, itemsize)

    def remove_tree(self, directory: str | Path) -> None:
        """`directory` is removed wherever it is kept."""
        self.remove_sent(directory)
        shutil.rmtree(directory, ignore_errors=True)


@dataclass(frozen=True)
class LocalOutput(Output):
    """The local folder is the output: a committed file is where it belongs."""

    def where(self, directory: str | Path) -> Path:
        return Path(directory)

    def shown(self, directory: str | Path) -> str:
        return str(directory)

    def send(self, *files: str | Path, keep: bool = False) -> None:
        pass  # already where it belongs

    def remove_sent(self, directory: str | Path) -> None:
        pass  # nothing was sent

    def local_need(self, written: int, in_flight: int, here: int = 0) -> int:
        return written - here


@dataclass(frozen=True)
class BucketOutput(Output):
    """The output is an object-store prefix: each file is sent there through the Outbox when it
    is committed, then the record that it is done. The manifest is sent last."""

    outbox: Outbox
    staged: ClassVar[bool] = True

    def where(self, directory: str | Path) -> RemotePath:
        return self.outbox.remote_of(directory)

    def shown(self, directory: str | Path) -> str:
        return str(self.where(directory))

    def send(self, *files: str | Path, keep: bool = False) -> None:
        self.outbox.send(*files, keep=keep)

    def remove_sent(self, directory: str | Path) -> None:
        self.where(directory).remove_tree()

    def local_need(self, written: int, in_flight: int, here: int = 0) -> int:
        return min(written, in_flight)  # each file leaves once committed: the rest never sits here
