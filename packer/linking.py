"""`pack --link`: an input whose files already are the packed shard's bytes is linked into the
output instead of copied (docs/COMMANDS.md, "Linking instead of copying").

A datatrove `.ds` (with its `.ds.index`, and `.ds.loss`) is such an input when it becomes one
shard of the same dtype: at most `--shard-tokens` tokens, every document ending with EOS, every
id below the vocabulary. Pack then

1. places the input's files in the task's part folder: a hard link (the same inode), else a
   reflink (`ioctl FICLONE`: a new inode sharing the extents, e.g. across btrfs subvolumes),
   else nothing, and the file is copied as today with a note saying why;
2. scans the placed files exactly as a copying pack scans the input (the Normalizer's id and
   EOS checks), through the same SourceShardWriter with `HashedFile` sinks, so the entry it records
   is the one a copy would record; it also hashes the bytes it read, and keeps the link only
   when they equal what a copy would have written (else the file is copied, with a note);
3. writes the shard's `.ds.metadata` as a copying pack does: it is pack's own text, and a link
   would save nothing there.

A placed file is never opened for writing afterwards: every writer in pack, shuffle and stage
writes a new temporary name and renames it (tokpack.formats.io), and --overwrite, a rerun
and a failure only unlink names. Renaming or unlinking a hard link leaves the input as it was.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from tokpack.formats.errors import TokpackError
from tokpack.formats.guard import existing_ancestor
from tokpack.formats.inputs import InputFile
from tokpack.formats.inputs.discover import read_blocks
from tokpack.formats.io.writes import HashedFile, tmp_path
from tokpack.formats.io.paths import as_path, is_url
from tokpack.formats.io.gate import open_new, regular_fd, regular_size
from tokpack.formats.io.progress_log import progress
from tokpack.formats.names import shard_name
from tokpack.formats.hashes import xxh3_128_file
from tokpack.formats.shards import SourceShardWriter
from tokpack.packer.vocab import Normalizer

FICLONE = 0x40049409  # linux/fs.h _IOW(0x94, 9, int): the destination shares the source's extents
# What a filesystem answers when it cannot link or clone (other errors are real failures).
_CANNOT_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EACCES}
_CANNOT_CLONE = _CANNOT_LINK | {errno.ENOTTY, errno.EINVAL, errno.EBADF}
SIDECARS = (".index", ".loss")  # placed beside the .ds; .metadata is written (see above)


def why_not(f: InputFile, out_dtype: np.dtype, shard_tokens: int) -> str | None:
    """Why input `f` cannot become one shard with its own bytes (None: it may, if its documents
    all end with EOS, which only the scan tells)."""
    if f.format != "datatrove":
        return f"a {f.format} input is rewritten, never linked"
    if is_url(f.path):
        return "a URL input is read, never linked"
    if np.dtype(f.dtype).newbyteorder("<") != np.dtype(out_dtype).newbyteorder("<"):
        return f"its {f.dtype} tokens are stored as {np.dtype(out_dtype).name}"
    tokens = as_path(f.path).stat().st_size // np.dtype(f.dtype).itemsize
    if tokens == 0:
        return "it holds no tokens"
    if tokens > shard_tokens:
        return f"its {tokens:,} tokens are cut into shards of --shard-tokens {shard_tokens:,}"
    return None


def sources(f: InputFile) -> dict[str, str]:
    """Suffix -> the input file that becomes the shard file NAME + suffix."""
    return {"": f.path, **{s: f.extra[s.lstrip(".")] for s in SIDECARS if f.extra.get(s.lstrip("."))}}


# ------------------------------------------------------------------------ placing


def place(src: str, dst: Path) -> tuple[str | None, str | None]:
    """Puts `src`'s bytes at `dst` without copying them: ('hardlink' or 'reflink', None), or
    (None, why neither can be made). Through a temporary name, renamed: never a symlink."""
    regular_size(src)  # the gate: a regular file (a FIFO or device is refused, one line)
    tmp = tmp_path(dst)
    try:
        os.link(src, tmp)  # follows a symlink: the link is to the file, never to the symlink
        how, why = "hardlink", None
    except OSError as e:
        if e.errno not in _CANNOT_LINK:
            raise
        how, why = _reflink(src, tmp)
        why = why and f"no hard link ({os.strerror(e.errno)}) and no reflink ({why})"
    if how is not None:
        os.replace(tmp, dst)
    return how, why


def _reflink(src: str, tmp: Path) -> tuple[str | None, str | None]:
    """('reflink', None) once `tmp` is a new file sharing `src`'s extents (fsync'd); else (None, why)."""
    fd_in = regular_fd(src)
    try:
        out = open_new(tmp, buffering=0)
        try:
            fcntl.ioctl(out.fileno(), FICLONE, fd_in)
            os.fsync(out.fileno())
        except BaseException as e:
            out.close()
            tmp.unlink(missing_ok=True)
            if isinstance(e, OSError) and e.errno in _CANNOT_CLONE:
                return None, os.strerror(e.errno)
            raise
        out.close()
        return "reflink", None
    finally:
        os.close(fd_in)


def _state(path) -> tuple:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


# ------------------------------------------------------------------------ the task


def link_part(
    f: InputFile,
    part_dir: Path,
    vocab_size: int,
    eos_id: int,
    out_dtype: np.dtype,
    tokenizer: str,
    shard_tokens: int,
    block_bytes: int,
) -> tuple[dict | None, str | None]:
    """Links input `f` as shard 0 of `part_dir` (an empty folder) once the scan has verified it:
    (its part record, the same as a copying pack's plus `link`, None); otherwise leaves `part_dir`
    empty and says why the input is copied: (None, why)."""

    def scan(files: dict) -> tuple[dict | None, str | None]:
        """(the entry a copying pack records, None) when the placed `files` hold exactly what it would
        write; else (None, why not)."""
        linked = InputFile(
            str(files[""]),
            f.format,
            f.dtype,
            f.size,
            tokenizer=f.tokenizer,
            extra={"index": str(files[".index"]), "loss": str(files[".loss"]) if ".loss" in files else None},
        )
        norm = Normalizer(f, vocab_size, eos_id, out_dtype)  # its messages name the input
        writer = SourceShardWriter(part_dir, name, out_dtype, tokenizer, ".loss" in files, sink=HashedFile)
        read = {s: xxhash.xxh3_128() for s in ("", ".loss")}  # the bytes as they are
        itemsize = np.dtype(f.dtype).itemsize
        bar = progress(f.size, f"pack --link {Path(f.path).name}")
        blocks = read_blocks(linked, eos_id, block_bytes)
        try:
            for block in blocks:
                read[""].update(memoryview(np.ascontiguousarray(block.tokens)).cast("B"))
                if block.loss is not None:
                    read[".loss"].update(memoryview(np.ascontiguousarray(block.loss)).cast("B"))
                tokens, ends, loss = norm(block)
                if norm.eos_appended or norm.empty_dropped:
                    return None, "a document does not end with EOS (pack appends it, so the bytes differ)"
                writer.write(tokens, ends, loss)
                bar.update(len(block.tokens) * itemsize)
        finally:
            blocks.close()
            bar.close()
        entry = writer.close()  # writes the shard's .ds.metadata, as a copying pack does
        same = (
            entry["xxh3_128"] == read[""].hexdigest()
            and entry["tokens"] * itemsize == os.stat(files[""]).st_size
            and entry["index_xxh3_128"] == xxh3_128_file(files[".index"])
            and entry.get("loss_xxh3_128", read[".loss"].hexdigest()) == read[".loss"].hexdigest()
        )
        return (entry, None) if same else (None, "its bytes differ from what pack writes")

    why = why_not(f, out_dtype, shard_tokens)
    if why is not None:
        return None, why
    name = shard_name(0)
    placed, methods = {}, set()
    try:
        for suffix, src in sources(f).items():
            dst = part_dir / f"{name}{suffix}"
            how, why = place(src, dst)
            if how is None:
                _empty(part_dir)
                return None, why
            placed[suffix] = (dst, _state(dst))  # what the scan must still find after it
            methods.add(how)
        entry, why = scan({s: p for s, (p, _) in placed.items()})
        for suffix, (dst, before) in placed.items():
            if _state(dst) != before:
                raise TokpackError(
                    "input changed while pack --link read it",
                    file=sources(f)[suffix],
                    expected=f"{before[2]} bytes, unchanged",
                    found=f"{_state(dst)[2]} bytes, modified",
                    hint="rerun once nothing writes to the input",
                )
    except BaseException:
        _empty(part_dir)
        raise
    if entry is None:
        _empty(part_dir)
        return None, why
    how = "hardlink" if methods == {"hardlink"} else "reflink"
    part = {
        "input": f.path,
        "shards": [entry],
        "tokens": entry["tokens"],
        "documents": entry["documents"],
        "eos_appended": 0,
        "empty_documents_dropped": 0,
        "link": {"how": how, "files": len(placed), "bytes": sum(p[1][2] for p in placed.values())},
    }
    return part, None


def _empty(part_dir: Path) -> None:
    """Unlinks what was placed (the input keeps its own names and bytes)."""
    shutil.rmtree(part_dir, ignore_errors=True)
    part_dir.mkdir(parents=True)


# ------------------------------------------------------------------------ planning and summaries


@dataclass
class LinkPlan:
    """Bytes of a pack's shard files (.ds, .ds.index, .ds.loss) by how they get there."""

    hardlink: int = 0  # on the output's filesystem: a hard link, once the scan verifies the input
    reflink: int = 0  # on another filesystem: a reflink where it allows one, else a copy
    copy: int = 0  # rewritten (another format or dtype, cut into shards, a URL)
    notes: list[str] = field(default_factory=list)  # per input not linked: why


def plan_links(files: list[InputFile], out: Path, out_dtype: np.dtype, shard_tokens: int, file_bytes) -> LinkPlan:
    """How `pack --link` will place each input's shard files; `file_bytes(f)` are their bytes."""
    plan, dev = LinkPlan(), os.stat(existing_ancestor(out)).st_dev
    for f in files:
        why = why_not(f, out_dtype, shard_tokens)
        if why is not None:
            plan.copy += file_bytes(f)
            plan.notes.append(f"{f.path}: copied: {why}")
        elif os.stat(f.path).st_dev == dev:
            plan.hardlink += file_bytes(f)
        else:
            plan.reflink += file_bytes(f)
    return plan


def summary(parts: list[dict]) -> dict:
    """The link figures of a pack's summary (PackResult), from its part records."""
    linked = [p["link"] for p in parts if p.get("link", {}).get("how") in ("hardlink", "reflink")]
    shard_files = sum(
        e["bytes"] + 8 * e["documents"] + (e["tokens"] if "loss_xxh3_128" in e else 0)
        for p in parts
        for e in p["shards"]
    )
    linked_bytes = sum(k["bytes"] for k in linked)
    return {
        "linked_files": sum(k["files"] for k in linked),
        "linked_bytes": linked_bytes,
        "reflinked_bytes": sum(k["bytes"] for k in linked if k["how"] == "reflink"),
        "copied_bytes": shard_files - linked_bytes,
        "link_notes": [
            f"{p['input']}: copied: {p['link']['why']}" for p in parts if p.get("link", {}).get("how") == "copy"
        ],
    }
