"""`shuffle --to-nodes --keep-sources DIR`: the source shards a process reads, copied, verified,
to its node's disk once; later epochs read them there, not on the shared filesystem. DIR
holds a folder per source (its fingerprint: manifest and kept shards) and KEPT_RECORD, which
maps each source's location to it, so a later command plans from the copies (`kept_copies`,
for tokpack.shuffle.sources.use_kept_sources) and opens nothing in the shared source folders.

Trust (issue 42): DIR is refused inside DEST, RUN or a source folder before anything is written
(`kept_folder`); its disk's free space is checked before a copy, and a full one is named as
--keep-sources' folder; every kept copy is verified against the source manifest's checksum
before an epoch reads it, and a damaged one is copied again from the shared source (the source
is blamed only when its own bytes fail); RUN's fingerprints, not the record alone, say which
copy a source of RUN is read from, so a damaged record cannot swap sources."""

from __future__ import annotations

import errno
import json
import os
from dataclasses import replace
from pathlib import Path

import xxhash

from tokpack.formats.errors import TokpackError
from tokpack.formats.guard import check_space, is_no_space
from tokpack.formats.io.writes import commit_file, tmp_path, write_bytes_atomic
from tokpack.formats.io.paths import local_path
from tokpack.formats.io.gate import iter_mapped, open_new, read_limited
from tokpack.formats.constants import MANIFEST, MAX_MANIFEST_BYTES, RUN, SOURCE
from tokpack.formats.reading import canonical_bytes, read_manifest
from tokpack.packer.stage_dest import in_place, node_dest
from tokpack.shuffle.sources import is_virtual, open_source, source_location
from tokpack.shuffle.epoch_job import source_changed_error

# In a --keep-sources folder: each kept source's location (as manifests name it) -> its fingerprint,
# the subfolder holding its copy.
KEPT_RECORD = "kept-sources.json"
INDEX_SUFFIX = ".index"
KEEP_BLOCK = 8 << 20  # --keep-sources copy buffer
OPTION = "--keep-sources"

# What a process has itself copied or verified (path, device, inode, size, mtime): a later epoch
# of the same command does not hash it again (its reads verify it too).
_VERIFIED: set[tuple] = set()

# Where DIR may not lie, and why each is refused (its hint).
_PLACES = {
    "DEST": "DEST holds only the node's slice, whose later epochs refuse other files: give a node-local folder beside it",
    "RUN": "RUN holds only the run's manifests and row hashes: give a node-local folder outside it",
    "a source folder": "a source folder is the command's input, which a later pack or shuffle refuses with copies "
    "in it: give a node-local folder outside it",
}


def kept_folder(keep_sources, node: int, dest, out, sources, schedule=None) -> Path | None:
    """This process's --keep-sources folder (`{node}` -> node), or None without the option;
    refused (one line naming the folder and the option), before anything is written, when it
    is a URL or lies in (or is) this node's DEST, RUN or a local source folder (those given, or
    a schedule's)."""
    if keep_sources is None:
        return None
    if "://" in str(keep_sources):  # as given: a Path made of s3://b/d is a local s3:/b/d
        raise TokpackError(
            f"{OPTION} writes a local directory",
            file=str(keep_sources),
            where=OPTION,
            hint="give a folder on the node's own disk",
        )
    keep = node_dest(keep_sources, node)
    given = list(sources or [])
    if schedule is not None:
        given += [path for stage in schedule.stages for path in stage.paths]
    places = [("DEST", dest), ("RUN", out)]
    places += [("a source folder", p) for p in given if not is_virtual(p) and local_path(p) is not None]
    inside = Path(keep).resolve()
    for what, place in places:
        folder = Path(local_path(place) or place).resolve()
        if inside.is_relative_to(folder):
            raise TokpackError(
                f"{OPTION} DIR is inside {what}",
                file=keep,
                where=OPTION,
                found=f"{what} {folder}",
                hint=_PLACES[what],
            )
    return keep


def keep_sources(
    sources: list, need: dict[int, set[int]], padded: bool, folder: Path, shared: bool = True
) -> tuple[list, int]:
    """The source shards `need` names (source -> shards: those a process reads, whole, and
    the next one, which its last windows may run into) copied, verified, into `folder` once.
    Also (`shared`) every source's manifest (each process plans every source) and, `padded` (a
    best-fit epoch), every source shard's `.ds.index` (the row table is built from all of them,
    small), and `folder`'s record of them (KEPT_RECORD): the files every process of a node
    reads, which one of them keeps (its leader, before the others: they open the copies by
    their manifests). Every copy already there is verified before the epoch reads it (once a
    command: _VERIFIED), a damaged one copied again from the source; the free space for what is
    copied is checked first. Returns (the sources, opened from their copies, the bytes copied now)."""
    wanted = _wanted(sources, need, padded and shared)
    try:
        missing = sum(
            size for s, name, size, _, _ in wanted if not in_place(folder / sources[s].fingerprint / name, size)
        )
        check_space([(folder, missing)], f"shuffle {OPTION}", hint=_FULL_HINT)
        return _keep(sources, wanted, folder, shared)
    except OSError as e:
        if is_no_space(e):
            raise TokpackError(
                f"disk full in the {OPTION} folder",
                file=folder,
                where=OPTION,
                found="No space left on device",
                hint=_FULL_HINT,
            ) from None
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM) and _inside(e.filename, folder):
            raise TokpackError(
                f"the {OPTION} folder cannot be written",
                file=folder,
                where=OPTION,
                expected="a folder this process can write, on the node's own disk",
                found=e.strerror,
                hint=f"give {OPTION} a writable folder (or drop it: the epoch reads the shared sources), "
                "then rerun the same command",
            ) from None
        raise


def _inside(name, folder: Path) -> bool:
    """Whether the file an OSError names lies in `folder` (not a source it was reading)."""
    if name is None:
        return False
    return Path(os.fsdecode(name)).absolute().is_relative_to(Path(folder).absolute())


_FULL_HINT = (
    f"free some space on this node's {OPTION} folder, give {OPTION} a folder on a larger disk (or "
    "drop it: the epoch reads the shared sources), then rerun the same command"
)


def _wanted(sources, need, padded: bool) -> list[tuple[int, str, int, str, int | None]]:
    """(source, file name, size, xxh3_128, the shard it is, None for an index) of every file
    `keep_sources` keeps."""
    wanted = []
    for s, src in enumerate(sources):
        for k in sorted(need.get(s, ())):
            shard = src.shards[k]
            wanted.append((s, shard["path"], int(shard["tokens"]) * src.dtype.itemsize, shard["xxh3_128"], k))
        if padded:  # one uint64 end a document
            wanted += [
                (s, f"{shard['path']}{INDEX_SUFFIX}", int(shard["documents"]) * 8, shard["index_xxh3_128"], None)
                for shard in src.shards
            ]
    return wanted


def _keep(sources: list, wanted: list[tuple], folder: Path, shared: bool = True) -> tuple[list, int]:
    copied = 0
    kept = list(sources)
    record = _kept_record(folder) if shared else {}
    for s, src in enumerate(sources):
        home = src.home  # the shared folder, also when `src` is already a kept copy
        d = folder / src.fingerprint
        d.mkdir(parents=True, exist_ok=True)
        if shared and not _manifest_is(d, src.fingerprint):  # new, or damaged: the source's own, again
            write_bytes_atomic(d / MANIFEST, read_limited(home / MANIFEST, MAX_MANIFEST_BYTES, "manifest"), fsync=True)
        hashed = set()
        for _, name, size, want, k in (item for item in wanted if item[0] == s):
            got, now = _keep_file(src, name, size, want, d)
            copied += got
            if now and k is not None:
                hashed.add(k)
        # its other shards are never read here; those hashed now are not hashed again by the epoch's reads
        kept[s] = replace(open_source(d, check_sizes=False), kept_from=home, hashed=frozenset(hashed))
        record[source_location(home)] = src.fingerprint
    if shared and record != _kept_record(folder):
        write_bytes_atomic(folder / KEPT_RECORD, canonical_bytes(record), fsync=True)
    return kept, copied


def _keep_file(src, name: str, size: int, want: str, folder: Path) -> tuple[int, bool]:
    """A source shard's file `name` (the shard, or its document index), of `size` bytes and
    xxh3_128 `want` (the source manifest's), copied from the source's own folder into `folder`
    (its xxh3_128 checked as it streams, renamed into place once whole); a copy already there is
    kept once its size and xxh3_128 are the manifest's (verified once a command), else copied
    again. Only the source's own bytes failing the checksum blame the source. Returns (the
    bytes copied, whether the copy's bytes were hashed now)."""
    target = folder / name
    if in_place(target, size):
        if _stamp(target) in _VERIFIED:
            return 0, False
        if file_xxh3_128(target, size) == want:
            _VERIFIED.add(_stamp(target))
            return 0, True
    tmp = tmp_path(target)
    h = xxhash.xxh3_128()
    try:
        with open_new(tmp) as fout:
            # The source's pages mapped, not read into a buffer: hashed and written from the page cache.
            for block in iter_mapped(src.home / name, size, KEEP_BLOCK):
                h.update(block)
                fout.write(block)
        if h.hexdigest() != want:
            raise source_changed_error({"shard": str(src.home / name), "expected": want, "found": h.hexdigest()})
        commit_file(tmp, target, fsync=True)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _VERIFIED.add(_stamp(target))
    return size, True


def _stamp(path: Path) -> tuple:
    st = os.stat(path)
    return (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def file_xxh3_128(path: Path, size: int) -> str:
    """A file's xxh3_128 (a source shard's, a kept copy's), streamed from its mapped pages."""
    h = xxhash.xxh3_128()
    for block in iter_mapped(path, size, KEEP_BLOCK):  # through the gate: a regular file of its recorded size
        h.update(block)
    return h.hexdigest()


def _manifest_is(folder: Path, fingerprint: str) -> bool:
    """Whether `folder` holds a source manifest, valid, of this fingerprint (a kept copy's)."""
    if not (folder / MANIFEST).is_file():
        return False
    try:
        return read_manifest(folder, kind=SOURCE).get("fingerprint") == fingerprint
    except TokpackError:
        return False


_RECORD_HINT = "delete this file (only it): the next run rebuilds it from the sources and keeps the copies, verified"


def _kept_record(folder: Path) -> dict:
    path = folder / KEPT_RECORD
    if not path.is_file():
        return {}
    try:
        record = json.loads(read_limited(path, MAX_MANIFEST_BYTES, "kept sources record"))
    except ValueError:
        raise TokpackError("the kept sources' record is not JSON", file=path, where=OPTION, hint=_RECORD_HINT) from None
    if not isinstance(record, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v and "/" not in v and v not in (".", "..")
        for k, v in record.items()
    ):
        raise TokpackError(
            "the kept sources' record is malformed",
            file=path,
            where=OPTION,
            expected="{location: fingerprint}",
            hint=_RECORD_HINT,
        )
    return record


def kept_copies(folder: Path, run=None) -> dict[str, Path]:
    """The sources a --keep-sources folder holds copies of (their location -> the copy), for
    tokpack.shuffle.sources.use_kept_sources before the run is planned. A source RUN (`run`, when
    it has a manifest) names is read from the copy of RUN's fingerprint, whatever the record
    says (a damaged or stale record cannot put another source's copy in its place), or from
    its own folder when no valid copy of it is kept; a copy whose manifest is damaged is not
    used (keep_sources writes it again)."""
    chosen = dict(_kept_record(folder))
    chosen.update(_run_fingerprints(run))
    return {loc: folder / fp for loc, fp in chosen.items() if _manifest_is(folder / fp, fp)}


def _run_fingerprints(run) -> dict[str, str]:
    """RUN's sources (location -> fingerprint), or none before its first manifest."""
    if run is None or not (Path(run) / MANIFEST).is_file():
        return {}
    try:
        sources = read_manifest(run, kind=RUN).get("sources") or []
    except TokpackError:  # planning the run reports it, in its words
        return {}
    return {
        source_location(e["path"]): e["fingerprint"]
        for e in sources
        if isinstance(e, dict) and isinstance(e.get("path"), str) and isinstance(e.get("fingerprint"), str)
    }
