"""What `tokpack plan` returns (`PlanResult`) and how it predicts a time: the disk's throughput,
given or measured next to the output (`measure_disk`, the only file a plan touches), each pass's
seconds at that throughput over the tasks that run at once, and the start-up costs; the paths a
plan takes (local only) and the sizes its lines show. tokpack.packer.planning, plan_nodes and
plan_report build on it.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


from tokpack.formats.errors import TokpackError
from tokpack.formats.guard import space_needs
from tokpack.packer.shared import ExecutorConfig, Result, optional_field

MEASURE_BYTES = 256 << 20  # at most this much is written, then read back, to measure the disk
MEASURE_SECONDS = 1.0  # per direction
MEASURE_BLOCK = 8 << 20
# Decoding a Parquet list column runs at about this many values a second per core (BENCHMARKS.md,
# "Parquet decoded row group by row group in parallel": 150-190 MB/s of list<uint16>): a pack of
# Parquet is CPU-bound, not disk-bound, and a plan that counted bytes only predicted 1 s for 16 s.
PARQUET_VALUES_PER_CORE_S = 80e6
# Start-up, which dominates a small run (BENCHMARKS.md): the command itself ("tokpack pack
# start-up", 0.44 s), and each pass run through datatrove's executor rather than in the
# command's process ("datatrove executor start-up", 1.5-2 s: its import, its manager, the workers).
COMMAND_START_SECONDS = 0.5
EXECUTOR_START_SECONDS = 1.75


@dataclass
class PlanResult(Result):
    """What `tokpack plan ... --json` prints."""

    command: str  # shuffle | pack | stage
    output: str
    path: str  # shuffle: in-memory and/or out-of-core; pack: the input format; stage: the kind copied
    shards: int  # output shards (pack: at least this many, or 0 when the inputs' token counts are unknown)
    passes: list[dict]  # in order: name, epoch (shuffle), tasks, memory_per_task (pack: null), read_bytes,
    # written_bytes, decode_seconds (pack of Parquet: its CPU-bound list decoding), pack_seconds (shuffle
    # --packing best-fit: the "table" pass packing its documents on one core), seconds
    space: list[dict]  # per target filesystem: path, filesystem, needed_bytes, free_bytes, enough
    manifests: dict  # manifest file under the output -> bytes
    workers: int
    executor: str
    disk_mbps: float | None  # read + write throughput the prediction uses
    disk: str  # where disk_mbps comes from
    startup_seconds: float  # of predicted_seconds: the command's start, and datatrove's executor's per pass
    predicted_seconds: float | None
    samples_per_epoch: int | None = optional_field()  # shuffle: when every epoch planned has one size
    sources: list[dict] | None = optional_field()  # shuffle: per source of the first epoch planned
    epochs: list[dict] | None = optional_field()  # shuffle: per epoch asked for: its stage, samples, path, shards,
    # and per source what it takes (the `sources` of shuffle's epochs_detail)
    warnings: list[str] | None = optional_field()  # shuffle: the repeat warnings shuffle would give, and
    # an in-memory epoch larger than this machine's RAM
    buckets: int | None = optional_field()  # shuffle, out of core: over every epoch
    bucket_files: int | None = optional_field()  # at most: each scatter task writes 2 files per bucket its rows reach
    holdout: dict | None = optional_field()  # shuffle --holdout: RUN/holdout/ when this command would write it
    bytes_per_node: int | None = optional_field()  # stage, node slice: bytes its rank files hold
    read_amplification: float | None = optional_field()  # stage, node slice: bytes read / bytes kept
    note: str | None = optional_field()  # stage: one line worth knowing before it runs (e.g. a whole-run copy)
    # pack: the shard files' bytes (.ds, .ds.index, .ds.loss) it copies; with --link, those it
    # hard-links (on the output's filesystem), those it reflinks where their filesystem allows
    # (else copies), each once its scan verifies it, and per input it copies, why
    copy_bytes: int | None = optional_field()
    link_bytes: int | None = optional_field()
    reflink_bytes: int | None = optional_field()
    link_notes: list[str] | None = optional_field()
    # shuffle --to-nodes DEST: the command's layout (dest, ranks_per_node, micro_batch, world_size,
    # keep_sources, memory), and per node (per_node) its bytes read from the shared filesystem and
    # from its disk, sent and received, its disk needed against its free space ("not visible"
    # where this machine does not see DEST), its seconds; RUN's small files (run_files); the
    # shared filesystem's throughput (aggregate, shared by the nodes reading at once) and the NIC's
    nodes: int | None = optional_field()
    to_nodes: dict | None = optional_field()
    per_node: list[dict] | None = optional_field()
    run_files: dict | None = optional_field()
    slowest_node: int | None = optional_field()
    shared_mbps: float | None = optional_field()
    shared: str | None = optional_field()
    nic_mbps: float | None = optional_field()


# ------------------------------------------------------------------------ the disk


def measure_disk(directory: Path) -> tuple[float | None, str]:
    """(MB/s, how it was found) of a sequential write, fsync'd, then a read of the same file
    with its pages dropped from the cache, in `directory`; the file is removed before return."""
    try:
        fd, name = tempfile.mkstemp(prefix=".tokpack-plan-", dir=directory)
    except OSError as e:
        return None, f"not measured ({e.strerror or e} in {directory}); give --disk-mbps"
    moved, block = 0, memoryview(os.urandom(MEASURE_BLOCK))
    try:
        os.unlink(name)  # gone from the directory at once; the open descriptor keeps the data
        t0 = time.perf_counter()
        while moved < MEASURE_BYTES and time.perf_counter() - t0 < MEASURE_SECONDS:
            moved += os.write(fd, block)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the read-back comes from the disk
        read, buf = 0, bytearray(MEASURE_BLOCK)
        while n := os.preadv(fd, [buf], read):
            read += n
        seconds = time.perf_counter() - t0
    except OSError as e:
        return None, f"not measured ({e.strerror or e} in {directory}); give --disk-mbps"
    finally:
        os.close(fd)
    return round(2 * moved / 1e6 / seconds, 1), f"measured: {moved >> 20} MiB written and read back in {directory}"


def planned_result(
    command: str,
    output: str,
    passes: list[dict],
    needs: list[tuple],
    config: ExecutorConfig,
    disk_mbps: float | None,
    concurrent: bool,
    **fields,
) -> PlanResult:
    """`passes` get their predicted seconds; `concurrent`: whether tasks running at once have a
    disk each (slurm, ray), so a pass of T tasks moves its bytes min(T, workers) times faster."""
    space = [
        {
            "path": str(path),
            "filesystem": str(where),
            "needed_bytes": needed,
            "free_bytes": free,
            "enough": needed <= free,
        }
        for path, where, needed, free in space_needs(needs)
    ]
    mbps, disk = (float(disk_mbps), "given") if disk_mbps else measure_disk(Path(space[0]["filesystem"]))
    for p in passes:
        at_once = 1 if not concurrent else p["tasks"] if config.workers == 1 else min(config.workers, p["tasks"])
        moved = p["read_bytes"] + p["written_bytes"]
        p["seconds"] = (
            None
            if mbps is None
            else round(max(moved / (mbps * 1e6) / at_once, p.get("decode_seconds") or p.get("pack_seconds") or 0), 1)
        )
    from tokpack.packer.executors import runs_in_process

    startup = COMMAND_START_SECONDS + (0 if runs_in_process(config) else EXECUTOR_START_SECONDS * len(passes))
    total = None if mbps is None else round(sum(p["seconds"] for p in passes) + startup, 1)
    return PlanResult(
        command=command,
        output=str(output),
        passes=passes,
        space=space,
        workers=config.workers,
        executor=config.executor,
        disk_mbps=mbps,
        disk=disk,
        startup_seconds=startup,
        predicted_seconds=total,
        **fields,
    )


def plan_pass(name: str, tasks: int, memory: int | None, read: int, written: int, **extra) -> dict:
    return {
        "name": name,
        **extra,
        "tasks": tasks,
        "memory_per_task": memory,
        "read_bytes": read,
        "written_bytes": written,
    }


def local_only(paths: list[str]) -> list[str]:
    """The local paths (`file://` URLs included) a plan reads or writes next to; other URLs are refused."""
    from tokpack.formats.io.paths import local_path

    for p in paths:
        if local_path(p) is None:
            raise TokpackError(
                "tokpack plan reads local paths",
                file=p,
                expected="a local path or a virtual source",
                found="a URL",
                hint="plan with a local copy of the manifests, or a virtual: source",
            )
    return [local_path(p) for p in paths]


def size_text(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"
