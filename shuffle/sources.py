"""The sources a shuffle reads: a packed source opened
where it is, or at its local copy under `shuffle --to-nodes --keep-sources`, or a virtual one
described by its counts for `tokpack plan`.
"""

from __future__ import annotations

import functools
import shlex
from dataclasses import replace
from pathlib import Path

import numpy as np
import xxhash

from tokpack.formats.constants import DEFAULT_SHARD_TOKENS, LOCK_NAME, SOURCE, WORK_DIR
from tokpack.formats.errors import IncompleteError, TokpackError
from tokpack.formats.io.paths import local_path
from tokpack.formats.names import dtype_from_name
from tokpack.formats.shards import PackedSource
from tokpack.formats.units import token_count


VIRTUAL = "virtual:"  # a source described by its counts, for `tokpack plan`: nothing is read
VIRTUAL_KEYS = {
    "tokens": "a token count (11T)",
    "documents": "a document count (5.5B)",
    "dtype": "uint16 or uint32",
    "shard_tokens": "tokens per shard [default: 2^30, as pack]",
    "vocab_size": "[default: the dtype's range]",
    "eos_id": "[default: 0]",
}


def is_virtual(path) -> bool:
    return str(path).startswith(VIRTUAL)


def open_source(path, check_sizes: bool = True) -> PackedSource:
    """A packed source directory, or a virtual one: `virtual:tokens=11T,documents=5.5B,dtype=uint16`.
    A source this process keeps a verified local copy of (use_kept_sources) is opened there: its
    manifest and files are read from the copy, and plans still name the source's own folder."""
    if is_virtual(path):
        return virtual_source(str(path))
    kept = _KEPT.get(source_location(path)) if _KEPT else None
    if kept is not None:
        return replace(PackedSource.open(kept, check_sizes=False), kept_from=Path(source_location(path)))
    try:
        return PackedSource.open(path, check_sizes=check_sizes)
    except IncompleteError:
        local = local_path(path)
        if local is None or any((Path(local) / name).exists() for name in (WORK_DIR, LOCK_NAME)):
            raise  # a pack interrupted or still running there: its rerun finishes it
        # No pack ever wrote here (the unpacked corpus, say): "rerun the same command" would not help.
        raise TokpackError(
            "not a packed source",
            file=path,
            expected="a directory `tokpack pack` wrote (its tokpack.json)",
            found="a folder without tokpack.json, that no pack is writing",
            hint=f"pack it first (`tokpack pack {shlex.quote(str(path))} -o PACKED`), then give PACKED as the SOURCE",
        ) from None
    except TokpackError as e:
        if e.where != "kind":
            raise
        # an epoch or run given as a SOURCE: the format's line says which kind, not what to give
        raise e.with_hint(
            "give a packed source (the directory `tokpack pack` writes); epochs and runs are shuffle's output"
        ) from None


# `shuffle --to-nodes --keep-sources DIR` (tokpack.packer.exchange): each source's location (as
# source_location gives it) -> this process's verified local copy, read in its place. One process
# is one command: filled once, before the run is planned.
_KEPT: dict[str, Path] = {}


def use_kept_sources(copies: dict[str, Path]) -> None:
    """From now on, this process opens each source of `copies` at its local copy (open_source)."""
    _KEPT.update({str(k): Path(v) for k, v in copies.items()})


def source_location(path) -> str:
    """Where a source lies, as plans and manifests record it: a local path (or file:// URL)
    resolved; an object-store URL or a virtual source's description as given."""
    local = None if is_virtual(path) else local_path(path)
    return str(path) if local is None else str(Path(local).resolve())


@functools.lru_cache(maxsize=16)
def virtual_source(spec: str) -> PackedSource:
    """A source with the counts `spec` gives and no files: shards of `shard_tokens` tokens (the
    last one shorter), so the planning code sees what a packed source of that size would be."""

    def bad(where: str, expected: str, found: str) -> TokpackError:
        hint = "e.g. virtual:tokens=11T,documents=5.5B,dtype=uint16"
        return TokpackError("bad virtual source", file=spec, where=where, expected=expected, found=found, hint=hint)

    fields: dict[str, str] = {}
    for item in filter(None, spec[len(VIRTUAL) :].split(",")):
        key, sep, value = item.partition("=")
        if key.strip() not in VIRTUAL_KEYS or not sep:
            raise bad(key.strip() or "(empty)", "key=value with key one of " + ", ".join(VIRTUAL_KEYS), item)
        fields[key.strip()] = value.strip()
    missing = [k for k in ("tokens", "documents", "dtype") if k not in fields]
    if missing:
        raise bad(missing[0], VIRTUAL_KEYS[missing[0]], "nothing")
    counts = {
        k: token_count(fields.get(k, default), what=f"count ({k}= of the virtual source)")
        for k, default in (("tokens", 0), ("documents", 0), ("shard_tokens", DEFAULT_SHARD_TOKENS), ("eos_id", 0))
    }
    dtype = dtype_from_name(fields["dtype"])
    vocab = token_count(
        fields.get("vocab_size", 1 << (8 * dtype.itemsize)), what="count (vocab_size= of the virtual source)"
    )
    per = max(1, counts["shard_tokens"])
    sizes = [per] * (counts["tokens"] // per) + ([counts["tokens"] % per] if counts["tokens"] % per else [])
    starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    manifest = {
        "kind": SOURCE,
        "dtype": fields["dtype"],
        "vocab_size": vocab,
        "eos_id": counts["eos_id"],
        "tokenizer": "virtual",
        "tokens": counts["tokens"],
        "documents": counts["documents"],
        "fingerprint": xxhash.xxh3_128_hexdigest(spec.encode()),
    }
    return PackedSource(Path(spec), manifest, dtype, [{"tokens": n} for n in sizes], starts)
