"""`shuffle --to-nodes --keep-sources DIR`: the source shards a process reads, copied, verified,
to its node's disk once; later epochs read them there, not on the shared filesystem. DIR
holds a folder per source (its fingerprint: manifest and kept shards) and KEPT_RECORD, which
maps each source's location to it, so a later command plans from the copies (`kept_copies`,
for tokpack.shuffle.plan.use_kept_sources) and opens nothing in the shared source folders."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import xxhash

from tokpack.formats.errors import TokpackError
from tokpack.formats.io import commit_file, open_new, open_read, read_limited, tmp_path, write_bytes_atomic
from tokpack.formats.manifest import MANIFEST, MAX_MANIFEST_BYTES, canonical_bytes
from tokpack.shuffle.plan import open_source, source_location
from tokpack.shuffle.steps import source_changed_error

# In a --keep-sources folder: each kept source's location (as manifests name it) -> its fingerprint,
# the subfolder holding its copy.
KEPT_RECORD = "kept-sources.json"
INDEX_SUFFIX = ".index"
KEEP_BLOCK = 8 << 20  # --keep-sources copy buffer


def keep_sources(sources: list, runs, need: dict[int, set[int]], padded: bool, folder: Path) -> tuple[list, int]:
    """The source shards `need` names (source -> shards: those a process reads, `runs` whole, and
    the next one, which its last windows may run into) copied, verified, into `folder` once.
    Also every source's manifest (each process plans every source) and, `padded` (a best-fit
    epoch), every source shard's `.ds.index` (the row table is built from all of them, small),
    and `folder`'s record of them (KEPT_RECORD). Returns (the sources, opened from their copies,
    the bytes copied now)."""
    copied = 0
    # the shards this epoch reads whole (checked by ShardHashes as they are read); the next
    # one, which its last windows run into, and best-fit's indexes are read in part or
    # elsewhere: their copies are checked here, each epoch
    whole = {(s, k) for s, k0, k1 in runs for k in range(k0, k1)}
    kept = list(sources)
    record = _kept_record(folder)
    for s, src in enumerate(sources):
        home = src.home  # the shared folder, also when `src` is already a kept copy
        d = folder / src.fingerprint
        d.mkdir(parents=True, exist_ok=True)
        if not (d / MANIFEST).exists():
            write_bytes_atomic(d / MANIFEST, read_limited(home / MANIFEST, MAX_MANIFEST_BYTES, "manifest"), fsync=True)
        for k in sorted(need.get(s, ())):  # one read whole by this epoch is verified as it is read
            copied += _keep_shard(src, k, d, verify=(s, k) not in whole)
        if padded:
            for k in range(len(src.shards)):
                copied += _keep_shard(src, k, d, INDEX_SUFFIX, verify=True)
        kept[s] = replace(open_source(d, check_sizes=False), kept_from=home)  # its other shards are never read here
        record[source_location(home)] = src.fingerprint
    if record != _kept_record(folder):
        write_bytes_atomic(folder / KEPT_RECORD, canonical_bytes(record), fsync=True)
    return kept, copied


def _keep_shard(src, k: int, folder: Path, suffix: str = "", verify: bool = False) -> int:
    """Source shard k (with `suffix` ".index": its document index) copied from the source's own
    folder into `folder` (its xxh3_128 checked as it streams, renamed into place once whole); a
    copy already there at its size is kept: as it is (the epoch's reads verify it), or, `verify`,
    once its xxh3_128 is the manifest's (a copy that differs is copied again). Returns the bytes copied."""
    shard = src.shards[k]
    if suffix:
        size, want = int(shard["documents"]) * 8, shard["index_xxh3_128"]  # one uint64 end a document
    else:
        size, want = int(shard["tokens"]) * src.dtype.itemsize, shard["xxh3_128"]
    name = f"{shard['path']}{suffix}"
    target = folder / name
    if target.is_file() and target.stat().st_size == size and (not verify or _hash_of(target, size) == want):
        return 0
    tmp = tmp_path(target)
    h = xxhash.xxh3_128()
    try:
        with open_read(src.home / name, size=size) as fin, open_new(tmp) as fout:
            buf = memoryview(bytearray(min(max(size, 1), KEEP_BLOCK)))
            while n := fin.readinto(buf):
                h.update(buf[:n])
                fout.write(buf[:n])
        if h.hexdigest() != want:
            raise source_changed_error({"shard": str(src.home / name), "expected": want, "found": h.hexdigest()})
        commit_file(tmp, target, fsync=True)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


def _hash_of(path: Path, size: int) -> str:
    h = xxhash.xxh3_128()
    with open_read(path, size=size) as f:  # through the gate: a regular file of its recorded size
        buf = memoryview(bytearray(min(max(size, 1), KEEP_BLOCK)))
        while n := f.readinto(buf):
            h.update(buf[:n])
    return h.hexdigest()


def _kept_record(folder: Path) -> dict:
    path = folder / KEPT_RECORD
    if not path.is_file():
        return {}
    try:
        record = json.loads(read_limited(path, MAX_MANIFEST_BYTES, "kept sources record"))
    except ValueError:
        raise TokpackError(
            "the kept sources' record is not JSON",
            file=path,
            hint="remove the --keep-sources folder: the next epoch keeps the sources again",
        ) from None
    if not isinstance(record, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v and "/" not in v and v not in (".", "..")
        for k, v in record.items()
    ):
        raise TokpackError(
            "the kept sources' record is malformed",
            file=path,
            expected="{location: fingerprint}",
            hint="remove the --keep-sources folder: the next epoch keeps the sources again",
        )
    return record


def kept_copies(folder: Path) -> dict[str, Path]:
    """The sources a --keep-sources folder holds copies of (their location -> the copy), for
    tokpack.shuffle.plan.use_kept_sources before the run is planned."""
    return {loc: folder / fp for loc, fp in _kept_record(folder).items() if (folder / fp / MANIFEST).is_file()}
