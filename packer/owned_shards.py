"""The owner's role in `shuffle --to-nodes` (tokpack.packer.exchange): world process q of N*P
owns the epoch shards i with i mod N*P = q (node n with P = 1). Its rows stay with their keepers;
it gets each row's facts (tokpack.packer.owned_facts: its xxh3-64, padding and EOS columns) and
builds each shard's manifest entry through the epoch shard writer (`hashed_only`: no token is
asked for, write_known_index and write_pad) in its DEST's scratch, exactly as `tokpack shuffle`
records it, and sends of it to RUN only the row hashes (`.ds.rows`) and a best-fit shard's
padding (`.ds.pad`), through RUN's Output."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import xxhash

from tokpack.formats.errors import TokpackError
from tokpack.formats.io.gate import open_new, open_read
from tokpack.formats.io.writes import tmp_path
from tokpack.formats.outputs import EpochShardFormat, LocalOutput, Output, ShardPlace
from tokpack.formats.shards import PAD_SUFFIX, ROWS_SUFFIX, shard_files

COPY_BLOCK = 8 << 20  # the copy to RUN's buffer (a shard's row hashes: 8 bytes a row)


class OwnedShards:
    """The owned epoch shards of one epoch, each fed its rows' facts in order (`add`, in as
    many calls as the facts' rounds cut them into), its entry built as its last row is in
    (`close` of its writer), its row hashes (and padding) sent to RUN and its files in
    `scratch` removed; RUN's Output a LocalOutput (RUN is a shared filesystem's folder)."""

    def __init__(self, job, fmt: EpochShardFormat, scratch: Path, run_epoch: Path):
        self.job, self.fmt = job, replace(fmt, hashed_only=True)
        self.scratch, self.run_epoch = scratch, run_epoch
        self.output = LocalOutput()
        self.writers: dict[int, tuple] = {}  # shard -> (its place, its writer, rows given so far)
        self.entries: list[tuple[int, dict]] = []
        self.padding = 0  # the padding tokens of every row given: the epoch's cross-check (exchange)
        scratch.mkdir(parents=True, exist_ok=True)
        run_epoch.mkdir(parents=True, exist_ok=True)

    def add(self, i: int, ends: np.ndarray, hashes: np.ndarray, pad: np.ndarray) -> None:
        """Shard i's next rows: their fragment ends (relative to the first of them), hashes and
        padding; the shard is done once its last row is in."""
        if i not in self.writers:
            g0, g1 = self.job.shard_range(i)
            place = ShardPlace(
                str(self.scratch), self.job.shard_file(i), i, epoch=self.job.plan.epoch, samples=(g0, g1)
            )
            self.writers[i] = (place, LocalOutput().open_shard(place, self.fmt), 0)
        place, writer, done = self.writers[i]
        writer.write_known_index(len(hashes), ends, hashes)
        if self.fmt.padded:
            writer.write_pad(pad)
        self.padding += int(pad.sum())
        done += len(hashes)
        self.writers[i] = (place, writer, done)
        if done == place.samples[1] - place.samples[0]:
            del self.writers[i]
            try:
                entry = writer.close()
            except BaseException:
                writer.abort()
                raise
            send_to_run(self.output, self.scratch, self.run_epoch, entry)
            for f in place.files(entry):
                f.unlink(missing_ok=True)
            self.entries.append((i, entry))

    def abort(self) -> None:
        """The shards begun and not done: their temporary files gone."""
        for _, writer, _ in self.writers.values():
            writer.abort()
        self.writers = {}


def send_to_run(output: Output, scratch: Path, run_epoch: Path, entry: dict) -> None:
    """An owned shard's row hashes (and best-fit padding), written in `scratch`, to RUN's epoch
    folder through `output`: each read through the gate at the size its entry records, checked
    against its entry's checksum as it is copied, written under a temporary name and committed
    (Output.commit_file). Its token file, index and metadata stay on the nodes."""
    for suffix, size, key in shard_files(entry):
        if suffix not in (ROWS_SUFFIX, PAD_SUFFIX):
            continue
        name = f"{entry['path']}{suffix}"
        tmp, h = tmp_path(run_epoch / name), xxhash.xxh3_128()
        try:
            with open_read(scratch / name, size=size, what="sidecar") as fin, open_new(tmp) as fout:
                buf = memoryview(bytearray(min(max(size, 1), COPY_BLOCK)))
                while n := fin.readinto(buf):
                    h.update(buf[:n])
                    fout.write(buf[:n])
            if h.hexdigest() != entry[key]:
                raise TokpackError(
                    "a file of an owned epoch shard changed in this node's scratch",
                    file=scratch / name,
                    where=key,
                    expected=entry[key],
                    found=h.hexdigest(),
                    hint="check this node's local disk, then rerun the same command (the epoch is written again)",
                )
            output.commit_file(tmp, run_epoch / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
