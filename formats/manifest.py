"""On-disk format v1: names, dtypes, checksums, atomic writes and the `tokpack.json` manifest.

docs/FORMAT.md is the specification; this module is its single implementation of the
parts every stage shares.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np
import xxhash

from .errors import IncompleteError, TokpackError

FORMAT_NAME = "tokpack"
FORMAT_VERSION = 1
MANIFEST = "tokpack.json"
KINDS = ("source", "run", "epoch")
SHARD_NAME_DIGITS = 5
# Reads and checksums stream through buffers of this size: large enough to keep the
# disk busy, small enough that memory does not depend on file size.
IO_BLOCK = 16 << 20
TMP_MARK = ".tmp-"
# Written by `tokpack stage --ranks` at a run copy's root: which shards it left out.
STAGE_SIDECAR = "tokpack-stage.json"


# ---------------------------------------------------------------------------- dtypes


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """datatrove's rule: uint16 while every id fits, else uint32."""
    if vocab_size <= 1 << 16:
        return np.dtype("<u2")
    if vocab_size <= 1 << 32:
        return np.dtype("<u4")
    raise TokpackError(
        "vocabulary too large for format v1",
        where="vocab_size",
        expected="<= 2**32",
        found=vocab_size,
        hint="token ids must fit in uint32",
    )


def dtype_name(dtype: np.dtype) -> str:
    return {2: "uint16", 4: "uint32"}[np.dtype(dtype).itemsize]


def dtype_from_name(name: str) -> np.dtype:
    try:
        return {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}[name]
    except KeyError:
        raise TokpackError(
            "unknown token dtype", where="dtype", expected="uint16 or uint32", found=name
        ) from None


# ----------------------------------------------------------------------------- names


def shard_name(index: int, digits: int = SHARD_NAME_DIGITS) -> str:
    return f"{index:0{digits}d}.ds"


def shard_digits(count: int) -> int:
    """Same width for every shard of a directory, so names sort as plain strings."""
    return max(SHARD_NAME_DIGITS, len(str(max(count - 1, 0))))


def epoch_dir_name(epoch: int) -> str:
    return f"epoch-{epoch:05d}"


def metadata_text(tokenizer: str, token_size: int, tokens: int) -> str:
    """datatrove's `.ds.metadata` layout: "{tokenizer}|{token_size}\\n{tokens}\\n{humanized}"."""
    import humanize  # a datatrove dependency; its metric() is what datatrove writes

    return f"{tokenizer}|{token_size}\n{tokens}\n{humanize.metric(tokens, unit='T')}"


def parse_metadata_text(text: str, path: str | Path) -> tuple[str, int, int]:
    """Returns (tokenizer, token_size, tokens) from a `.ds.metadata` file's text."""
    lines = text.split("\n")
    head = lines[0].rsplit("|", 1)
    try:
        if len(head) != 2 or len(lines) < 2:
            raise ValueError
        return head[0], int(head[1]), int(lines[1])
    except ValueError:
        raise TokpackError(
            "unreadable datatrove metadata",
            file=path,
            where="line 1-2",
            expected='"{tokenizer}|{token_size}\\n{tokens}"',
            found=repr(text[:80]),
            hint="regenerate the metadata or pass --vocab-size/--eos-id explicitly",
        ) from None


# ------------------------------------------------------------------------- checksums


def xxh3_128_file(path: str | Path, buf: bytearray | None = None) -> str:
    """Streaming xxh3_128 of a whole file, as 32 lowercase hex digits."""
    h = xxhash.xxh3_128()
    buf = buf if buf is not None else bytearray(IO_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def xxh3_128_bytes(data) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def row_hash(row) -> int:
    """The per-sample hash summed into `sample_multiset_hash`: xxh3_64, seed 0."""
    return xxhash.xxh3_64_intdigest(row)


def multiset_hash_rows(rows: np.ndarray) -> int:
    """Sum mod 2^64 of xxh3_64 over the rows of a 2-D C-contiguous array."""
    rows = np.ascontiguousarray(rows)
    n = rows.shape[0]
    if n == 0:
        return 0
    flat = memoryview(rows.reshape(-1).view(np.uint8))
    step = flat.nbytes // n
    digest = xxhash.xxh3_64_intdigest
    return sum(digest(flat[i : i + step]) for i in range(0, flat.nbytes, step)) & 0xFFFFFFFFFFFFFFFF


def hash_hex64(value: int) -> str:
    return f"{value & 0xFFFFFFFFFFFFFFFF:016x}"


def fingerprint(shard_checksums: list[str], dtype: str, vocab_size: int, eos_id: int) -> str:
    """A source's identity: its data (shard checksums, in order) and how to read it."""
    h = xxhash.xxh3_128()
    h.update(f"tokpack-source-v1|{dtype}|{vocab_size}|{eos_id}|".encode())
    for c in shard_checksums:
        h.update(c.encode() + b"|")
    return h.hexdigest()


# --------------------------------------------------------------------- atomic writes


def tmp_path(final: str | Path) -> Path:
    """A sibling name no reader treats as data (it does not end in .ds or .json)."""
    final = Path(final)
    return final.with_name(f"{final.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def commit_file(tmp: str | Path, final: str | Path, fsync: bool = False) -> None:
    if fsync:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.replace(tmp, final)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    tmp = tmp_path(path)
    with open(tmp, "wb") as f:
        f.write(data)
    commit_file(tmp, path)


def remove_tmp_files(directory: str | Path) -> None:
    """Leftovers of a killed run: never data, safe to delete."""
    directory = Path(directory)
    if directory.is_dir():
        for p in directory.iterdir():
            if TMP_MARK in p.name and p.is_file():
                p.unlink(missing_ok=True)


# ----------------------------------------------------------------------- manifests


def write_manifest(directory: str | Path, manifest: dict) -> None:
    """Written last, atomically: its presence is what makes a directory complete."""
    data = json.dumps(manifest, indent=1, sort_keys=False).encode() + b"\n"
    write_bytes_atomic(Path(directory) / MANIFEST, data)


def read_manifest(directory: str | Path, kind: str | tuple[str, ...] | None = None) -> dict:
    """Reads and checks the parts of a manifest every reader relies on."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.exists():
        raise TokpackError(
            "no such directory", file=directory, hint="check the path; tokpack reads local directories"
        )
    if not path.exists():
        raise IncompleteError(
            "incomplete: no tokpack.json",
            file=directory,
            hint="the run that writes it was interrupted or is still running; rerun the same command to finish it",
        )
    raw = path.read_bytes()
    try:
        manifest = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokpackError(
            "manifest is not valid JSON",
            file=path,
            where=f"byte {getattr(e, 'pos', 0)}",
            expected="a JSON object",
            found=f"{len(raw)} bytes" if raw else "an empty file",
            hint="restore it from the run that wrote this directory, or rerun that run",
        ) from None
    check_manifest_header(manifest, path, kind)
    return manifest


def check_manifest_header(manifest: object, path: str | Path, kind=None) -> None:
    if not isinstance(manifest, dict):
        raise TokpackError(
            "manifest is not a JSON object", file=path, expected="object", found=type(manifest).__name__
        )
    if manifest.get("format") != FORMAT_NAME:
        raise TokpackError(
            "not a tokpack manifest", file=path, where="format", expected=FORMAT_NAME, found=manifest.get("format")
        )
    if manifest.get("version") != FORMAT_VERSION:
        raise TokpackError(
            "unsupported format version",
            file=path,
            where="version",
            expected=FORMAT_VERSION,
            found=manifest.get("version"),
            hint="use the tokpack release that wrote this directory",
        )
    kinds = (kind,) if isinstance(kind, str) else kind
    if manifest.get("kind") not in (kinds or KINDS):
        raise TokpackError(
            "wrong kind of tokpack directory",
            file=path,
            where="kind",
            expected=" or ".join(kinds or KINDS),
            found=manifest.get("kind"),
        )


def manifest_kind(directory: str | Path) -> str:
    return read_manifest(directory)["kind"]


def partial_stage_absent(run_dir: Path) -> dict[str, str]:
    """Shards a `tokpack stage --ranks` copy left out, from its `tokpack-stage.json` sidecar:
    {shard path: "staged for ranks ... of W, micro-batch m"}."""
    sidecar = Path(run_dir) / STAGE_SIDECAR
    if not sidecar.exists():
        return {}
    try:
        info = json.loads(sidecar.read_text())
        stages = "; ".join(f"ranks {st['ranks']} of {st['world_size']}, micro-batch {st['micro_batch']}"
                           for st in info.get("stages", []))
        return {str(Path(run_dir) / epoch / name): f"staged only for {stages}"
                for epoch, names in info.get("missing_shards", {}).items() for name in names}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise TokpackError("unreadable partial-stage sidecar", file=sidecar,
                           hint="stage the directory again") from None


# ------------------------------------------------------------------------ progress


def progress(total: int | None, desc: str, unit: str = "B", enabled: bool | None = None):
    """A tqdm bar on a terminal, silent otherwise (CI logs, --json)."""
    from tqdm import tqdm

    if enabled is None:
        enabled = sys.stderr.isatty()
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=True,
        unit_divisor=1024 if unit == "B" else 1000,
        disable=not enabled,
        leave=False,
        file=sys.stderr,
    )


def iter_file_blocks(path: str | Path, buf: bytearray, offset: int = 0, length: int | None = None) -> Iterator[memoryview]:
    """Sequential `readinto` over [offset, offset+length) of a file, reusing one buffer."""
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        remaining = length if length is not None else os.fstat(f.fileno()).st_size - offset
        while remaining > 0:
            n = f.readinto(view[: min(len(buf), remaining)])
            if not n:
                raise TokpackError(
                    "file shorter than expected", file=path, where=f"byte {offset}", expected="more data", found="end of file"
                )
            remaining -= n
            offset += n
            yield view[:n]
