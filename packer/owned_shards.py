"""The owner's role in `shuffle --to-nodes` (tokpack.packer.exchange): world process q of N*P
owns the epoch shards i with i mod N*P = q (node n with P = 1). It passes each through the epoch shard writer (`hashed_only`: its
tokens and index are hashed, not written) in its DEST's scratch, which gives the shard's
manifest entry exactly as `tokpack shuffle` records it, and sends of it to RUN only the row
hashes (`.ds.rows`) and a best-fit shard's padding (`.ds.pad`), through RUN's Output."""

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
from tokpack.packer.node_epoch import NodeEpoch
from tokpack.packer.rank_files import write_rows

COPY_BLOCK = 8 << 20  # the copy to RUN's buffer (a shard's row hashes: 8 bytes a row)


def hash_owned_shards(
    ne: NodeEpoch,
    stores,
    pad: np.ndarray,
    scratch: Path,
    run_epoch: Path,
    fmt: EpochShardFormat,
    output: Output | None = None,
    stop=None,
) -> list[tuple[int, dict]]:
    """Each owned epoch shard through the epoch shard writer (in `scratch`, local), its rows taken
    from the stores (at once in memory, bucket by bucket out of core): its manifest entry as
    `tokpack shuffle` records it; its row hashes (and padding) go to RUN. Its tokens and index are
    hashed, not written (the nodes' slices hold those bytes): a node's disk gets its slice once.
    `output`: RUN's (a LocalOutput: RUN is a shared filesystem's folder); `stop` (an Event), set
    when the epoch failed elsewhere: no shard after it is begun."""
    output = LocalOutput() if output is None else output
    job = ne.job
    fmt = replace(fmt, hashed_only=True)
    scratch.mkdir(parents=True, exist_ok=True)
    run_epoch.mkdir(parents=True, exist_ok=True)
    out = []
    for i in ne.owned:
        if stop is not None and stop.is_set():
            break
        g0, g1 = job.shard_range(i)
        place = ShardPlace(str(scratch), job.shard_file(i), i, epoch=job.plan.epoch, samples=(g0, g1))
        writer = LocalOutput().open_shard(place, fmt)
        try:
            lo = int(ne.owned_base[i])  # the shard's rows: store rows P + lo ..
            for a, rows in stores.rows(len(ne.positions) + lo, len(ne.positions) + lo + g1 - g0):
                a -= len(ne.positions)
                write_rows(writer, rows, pad[a : a + len(rows)] if fmt.padded else None, np.arange(len(rows)))
            entry = writer.close()
        except BaseException:
            writer.abort()
            raise
        send_to_run(output, scratch, run_epoch, entry)
        for f in place.files(entry):
            f.unlink(missing_ok=True)
        out.append((i, entry))
    return out


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
