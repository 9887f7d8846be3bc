"""On-disk format v1: names, dtypes, checksums, and every manifest kind (source,
epoch, run, the partial-stage sidecar): its field table, builder, checker and canonical bytes.

docs/FORMAT.md is the specification; this module is its single implementation.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

import numpy as np
import xxhash

from .errors import IncompleteError, TokpackError
from .io import IO_BLOCK, as_path, fsync_dir, iter_file_blocks, write_bytes_atomic

FORMAT_NAME = "tokpack"
FORMAT_VERSION = 1
MANIFEST = "tokpack.json"
KINDS = ("source", "run", "epoch")
SHARD_NAME_DIGITS = 5
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
    for block in iter_file_blocks(path, buf if buf is not None else bytearray(IO_BLOCK)):
        h.update(block)
    return h.hexdigest()


def row_hash(row) -> int:
    """The per-sample hash summed into `sample_multiset_hash`: xxh3_64, seed 0."""
    return xxhash.xxh3_64_intdigest(row)


def row_hashes(rows: np.ndarray) -> np.ndarray:
    """xxh3_64 of each row of a 2-D array (or of each item of a 1-D np.void row array)."""
    rows = np.ascontiguousarray(rows)
    n = rows.shape[0]
    if n == 0:
        return np.empty(0, dtype=np.uint64)
    flat = memoryview(rows.reshape(-1).view(np.uint8))
    step = flat.nbytes // n
    digest = xxhash.xxh3_64_intdigest
    return np.fromiter((digest(flat[i : i + step]) for i in range(0, flat.nbytes, step)), dtype=np.uint64, count=n)


def multiset_hash_rows(rows: np.ndarray) -> int:
    """Sum mod 2^64 of xxh3_64 over the rows (uint64 sums wrap)."""
    return int(row_hashes(rows).sum(dtype=np.uint64))


def hash_hex64(value: int) -> str:
    return f"{value & 0xFFFFFFFFFFFFFFFF:016x}"


def fingerprint(shard_checksums: list[str], dtype: str, vocab_size: int, eos_id: int) -> str:
    """A source's identity: its data (shard checksums, in order) and how to read it."""
    h = xxhash.xxh3_128()
    h.update(f"tokpack-source-v1|{dtype}|{vocab_size}|{eos_id}|".encode())
    for c in shard_checksums:
        h.update(c.encode() + b"|")
    return h.hexdigest()


# ------------------------------------------------------------------ manifest fields

# Every manifest kind's fields, as the markdown rows docs/FORMAT.md shows (tests/test_format.py
# holds them equal): name, type, required, the kinds that carry it ("stages[]": the sidecar's
# `stages` entries), meaning. Readers ignore fields they do not know, so a newer writer may add
# optional ones.
_FIELD_TABLES = """
`tokpack.json`
| `format` | string | yes | source, epoch, run, slice, slice-epoch | `"tokpack"` |
| `version` | int | yes | source, epoch, run, slice, slice-epoch | `1`; see the version rule |
| `kind` | string | yes | source, epoch, run, slice, slice-epoch | `"source"`, `"epoch"`, `"run"`, `"slice"` or `"slice-epoch"` |
| `dtype` | string | yes | source, epoch, run, slice, slice-epoch | `"uint16"` if `vocab_size <= 65536`, else `"uint32"` |
| `token_size` | int >= 1 | yes | source, epoch, run, slice, slice-epoch | bytes per token: 2 or 4 |
| `vocab_size` | int >= 1 | yes | source, epoch, run, slice, slice-epoch | every token id is `< vocab_size` |
| `eos_id` | int >= 0 | yes | source, epoch, run, slice, slice-epoch | the end-of-document token, `< vocab_size` |
| `tokenizer` | string | yes | source, epoch, run, slice, slice-epoch | a name or path, informative |
| `tokens` | int >= 0 | yes | source, epoch, run, slice, slice-epoch | tokens in the shards (a run: in its written epochs; a slice: in its rank files) |
| `documents` | int >= 0 | yes | source | documents (index entries) over the shards |
| `fragments` | int >= 0 | yes | epoch, run | index entries over the shards (a run: its written epochs) |
| `fingerprint` | hex32 | yes | source | the source's identity (see Checksums) |
| `shards` | list | yes | source, epoch, slice-epoch | shard entries in stream order (table below; a slice epoch: one per rank) |
| `inputs` | list | no | source | `[{path, size, format}]` of the packed inputs |
| `shard_tokens` | int >= 1 | no | source | pack's shard size limit |
| `eos_appended` | int >= 0 | no | source | EOS tokens pack appended |
| `empty_documents_dropped` | int >= 0 | no | source | empty input documents pack dropped |
| `created_by` | string | no | source | the writing tokpack's version |
| `request` | object | no | source | pack's normalised options, which tell a rerun from another pack |
| `epoch` | int >= 0 | yes | epoch, slice-epoch | the epoch number, as in the directory name |
| `seed` | int | yes | epoch, run | the shuffle seed |
| `seq_len` | int >= 1 | yes | epoch, run, slice, slice-epoch | `L`: a sample is `L + 1` tokens |
| `samples` | int >= 0 | yes | epoch, run, slice-epoch | samples in the epoch (a run: in each epoch; a scheduled run: 0; a slice epoch: the run's epoch) |
| `epoch_samples` | list | no | run | sizes of epochs `0..k-1` when planned unequal (a scheduled run: every epoch) |
| `shard_samples` | int >= 1 | yes | epoch, run | samples in every shard but the last |
| `dropped_tokens` | int >= 0 | yes | epoch | source tokens outside every window |
| `jitter` | bool | yes | epoch, run | windows start at a per-epoch offset |
| `jitter_offsets` | list | yes | epoch | each source's window offset |
| `sources` | list | yes | epoch, run | source entries in command-line order (table below) |
| `weights` | list or null | yes | run | the weights as given, or null |
| `sample_multiset_hash` | hex16 | yes | epoch | sum of the shards' `multiset_hash` mod 2^64 |
| `shuffle` | string | yes | epoch, run | the shuffle algorithm's name |
| `epochs` | list | yes | run, slice | the epoch numbers written so far (a slice: staged) |
| `schedule` | list | no | run | a scheduled run: per epoch, `{stage, sources, weights, samples}` (see Schedules) |
| `schedule_file` | string | no | run | a scheduled run: the schedule file it was made from |
| `schedule_xxh3_128` | hex32 | no | run | a scheduled run: checksum of that file |
| `run` | object | yes | slice, slice-epoch | the run's manifest without `epochs`, `tokens`, `fragments`: its identity and sample numbering |
| `source` | string | no | slice | the run directory or URL it was staged from, informative |
| `world_size` | int >= 1 | yes | slice, slice-epoch | `W`: data-parallel ranks of the training it serves |
| `micro_batch` | int >= 1 | yes | slice, slice-epoch | `m`: samples per rank per global batch |
| `ranks` | list | yes | slice, slice-epoch | the consecutive ranks `A..B` it holds, in order |
| `batch_phase` | int >= 0 | yes | slice, slice-epoch | `G mod W*m` of every global batch's first sample (0: training from sample 0) |
| `first_sample` | int >= 0 | yes | slice-epoch | the run's consumed-sample number `G` of the epoch's first sample |
| `epoch_xxh3_128` | hex32 | yes | slice-epoch | checksum of the run's epoch manifest bytes: which epoch the rows came from |

`shards[]`
| `path` | string | yes | source, epoch, slice-epoch | the `.ds` file name |
| `tokens` | int >= 0 | yes | source, epoch, slice-epoch | tokens in the `.ds` file |
| `bytes` | int >= 0 | yes | source, epoch, slice-epoch | `tokens * token_size` |
| `documents` | int >= 0 | yes | source | documents, = index entries |
| `samples` | int >= 0 | yes | epoch, slice-epoch | samples in the shard |
| `fragments` | int >= 0 | yes | epoch, slice-epoch | index entries |
| `xxh3_128` | hex32 | yes | source, epoch, slice-epoch | checksum of the `.ds` file |
| `index_xxh3_128` | hex32 | yes | source, epoch, slice-epoch | checksum of `.ds.index` |
| `metadata_xxh3_128` | hex32 | yes | source, epoch, slice-epoch | checksum of `.ds.metadata` |
| `loss_xxh3_128` | hex32 | no | source | checksum of `.ds.loss`, when there is one |
| `multiset_hash` | hex16 | yes | epoch, slice-epoch | sum of xxh3-64 over the shard's samples mod 2^64 |
| `rows_xxh3_128` | hex32 | no | epoch, slice-epoch | checksum of `.ds.rows`, the xxh3-64 of each sample (written since node slices) |
| `rank` | int >= 0 | yes | slice-epoch | the rank whose rows the file holds |

`sources[]`
| `name` | string | yes | epoch, run | the source's name |
| `path` | string | yes | epoch, run | its directory as given |
| `fingerprint` | hex32 | yes | epoch, run | its manifest's `fingerprint` |
| `tokens` | int >= 0 | yes | epoch, run | its tokens |
| `weight` | string or null | yes | epoch, run | its weight as given, or null |
| `samples` | int >= 0 | yes | epoch | `c_s`: samples it gives the epoch |
| `first_pass` | int >= 0 | yes | epoch | the first pass over its windows the epoch uses |
| `passes` | int >= 0 | yes | epoch | how many passes the epoch uses |
| `windows` | int >= 0 | yes | epoch | `W_s`: its windows |
| `offset` | int >= 0 | yes | epoch | `o_s`: its window offset |
| `dropped_tokens` | int >= 0 | yes | epoch | its tokens outside every window |
| `cursor` | int >= 0 | no | epoch | a run of several stages: where in its chain the epoch starts |

`tokpack-stage.json`
| `format` | string | yes | sidecar | `"tokpack-stage"` |
| `partial` | bool | yes | sidecar | `true` |
| `note` | string | no | sidecar | for a human reader |
| `stages` | list | yes | sidecar | one entry per `stage --ranks` into this copy |
| `missing_shards` | object | yes | sidecar | `{"epoch-NNNNN": ["NNNNN.ds", ...]}`: shards not copied |
| `ranks` | list | yes | stages[] | the ranks staged |
| `world_size` | int >= 1 | yes | stages[] | `W` |
| `micro_batch` | int >= 1 | yes | stages[] | `m` |
"""
MANIFEST_FIELDS, SHARD_FIELDS, SOURCE_FIELDS, STAGE_FIELDS = (  # name -> (type, required, kinds, meaning)
    {name.strip("`"): (typ, required == "yes", kinds, meaning)
     for name, typ, required, kinds, meaning in (row[2:-2].split(" | ") for row in table.splitlines()[1:])}
    for table in _FIELD_TABLES.strip().split("\n\n"))

# Keys earlier writers used, by kind: readers accept them under the current name.
RENAMED = {"epoch": {"documents": "fragments"}, "run": {"documents": "fragments"}}
HEX32 = re.compile(r"^[0-9a-f]{32}$")
HEX16 = re.compile(r"^[0-9a-f]{16}$")
_JSON = {"string": str, "int": int, "bool": bool, "list": list, "object": dict, "null": type(None),
         "hex32": str, "hex16": str, "int >= 0": int, "int >= 1": int}


def field_problems(obj: dict, table: dict, kind: str) -> Iterator[tuple[str, str, object, str]]:
    """(field, expected, found, what is wrong) for each field of `kind` in `table` that `obj` breaks."""
    for key, (type_name, required, kinds, _) in table.items():
        if kind not in kinds.split(", "):
            continue
        if key not in obj:
            if required:
                yield key, f"field {key!r}", "no such field", "manifest field missing"
            continue
        value, types = obj[key], type_name.split(" or ")
        if not any(isinstance(value, _JSON[t]) and not (isinstance(value, bool) and t != "bool") for t in types):
            yield key, f"a JSON {'/'.join(_JSON[t].__name__ for t in types)}", f"{value!r}"[:60], \
                "manifest field has the wrong type"
        elif type_name.startswith("int >= ") and value < int(type_name[-1]):
            yield key, type_name[4:], value, "manifest field out of range"
        elif type_name == "hex32" and not HEX32.match(value):
            yield key, "32 lowercase hex digits", repr(value), "malformed checksum"
        elif type_name == "hex16" and not HEX16.match(value):
            yield key, "16 lowercase hex digits", repr(value), "malformed multiset hash"


def upgrade(manifest: dict) -> dict:
    """The manifest with the keys of earlier writers under their current names, in place."""
    renamed = {old: new for old, new in RENAMED.get(manifest.get("kind"), {}).items()
               if old in manifest and new not in manifest}
    return {renamed.get(k, k): v for k, v in manifest.items()} if renamed else manifest


# ------------------------------------------------------------------ manifest builders


def _header(kind: str, dtype: np.dtype, vocab_size: int, eos_id: int, tokenizer: str, tokens: int) -> dict:
    return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "kind": kind, "dtype": dtype_name(dtype),
            "token_size": np.dtype(dtype).itemsize, "vocab_size": int(vocab_size), "eos_id": int(eos_id),
            "tokenizer": tokenizer, "tokens": int(tokens)}


def source_manifest(shards: list[dict], dtype: np.dtype, vocab_size: int, eos_id: int, tokenizer: str,
                    **extra) -> dict:
    return {**_header("source", dtype, vocab_size, eos_id, tokenizer, sum(s["tokens"] for s in shards)),
            "documents": sum(s["documents"] for s in shards),
            "fingerprint": fingerprint([s["xxh3_128"] for s in shards], dtype_name(dtype), vocab_size, eos_id),
            "shards": shards, **extra}


def epoch_manifest(shards: list[dict], dtype: np.dtype, vocab_size: int, eos_id: int, tokenizer: str, *,
                   tokens: int, epoch: int, seed: int, seq_len: int, samples: int, shard_samples: int,
                   dropped_tokens: int, jitter: bool, sources: list[dict], shuffle: str) -> dict:
    return {**_header("epoch", dtype, vocab_size, eos_id, tokenizer, tokens),
            "fragments": sum(s["fragments"] for s in shards), "shards": shards, "epoch": epoch, "seed": seed,
            "seq_len": seq_len, "samples": samples, "shard_samples": shard_samples, "dropped_tokens": dropped_tokens,
            "jitter": jitter, "jitter_offsets": [s["offset"] for s in sources], "sources": sources,
            "sample_multiset_hash": hash_hex64(sum(int(s["multiset_hash"], 16) for s in shards)),
            "shuffle": shuffle}


def run_manifest(epochs: dict[int, dict], dtype: np.dtype, vocab_size: int, eos_id: int, tokenizer: str, *,
                 sources: list[dict], weights: list | None, seq_len: int, seed: int, jitter: bool, samples: int,
                 shard_samples: int, shuffle: str, extra: dict | None = None) -> dict:
    """`epochs`: the manifests of the epochs written so far, by number; `sources`: an epoch's entries;
    `extra`: a scheduled run's fields (epoch_samples, schedule...)."""
    written = [upgrade(m) for m in epochs.values()]
    sources = [{k: s[k] for k, field in SOURCE_FIELDS.items() if "run" in field[2]} for s in sources]
    return {**_header("run", dtype, vocab_size, eos_id, tokenizer, sum(int(m["tokens"]) for m in written)),
            "fragments": sum(int(m["fragments"]) for m in written), "sources": sources, "weights": weights,
            "seq_len": seq_len, "seed": seed, "jitter": jitter, "samples": samples, "shard_samples": shard_samples,
            "epochs": sorted(epochs), "shuffle": shuffle, **(extra or {})}


def stage_sidecar(stages: list[dict], missing_shards: dict[str, list[str]]) -> dict:
    return {"format": "tokpack-stage", "partial": True,
            "note": "a --ranks stage: only the listed ranks' shards were copied; the manifests are the source's",
            "stages": stages, "missing_shards": missing_shards}


# ------------------------------------------------------------------------ manifests


def canonical_bytes(manifest: dict) -> bytes:
    """The one serialisation of every manifest: a manifest whose bytes differ was edited."""
    return json.dumps(manifest, indent=1, sort_keys=False).encode() + b"\n"


def write_manifest(directory: str | Path, manifest: dict, name: str = MANIFEST, outbox=None) -> None:
    """Written last, atomically: its presence is what makes a directory complete. To an outbox
    (formats.io.Outbox), also sent last, after everything it lists."""
    fsync_dir(directory)  # the shards' renames are on disk before a manifest can claim them
    write_bytes_atomic(Path(directory) / name, canonical_bytes(manifest), fsync=True)
    fsync_dir(directory)
    if outbox is not None:
        outbox.send(Path(directory) / name, keep=True)


def read_manifest(directory: str | Path, kind: str | tuple[str, ...] | None = None) -> dict:
    """Reads and checks the parts of a manifest every reader relies on; keys of earlier writers
    come under their current names."""
    directory = as_path(directory)
    path = directory / MANIFEST
    if not directory.exists():
        raise TokpackError("no such directory", file=directory, hint="check the path or URL")
    if not path.exists():
        raise IncompleteError("incomplete: no tokpack.json", file=directory, hint="the run that writes it was "
                              "interrupted or is still running; rerun the same command to finish it")
    return upgrade(parse_manifest(path.read_bytes(), path, kind))


def parse_manifest(raw: bytes, path: str | Path, kind: str | tuple[str, ...] | None = None) -> dict:
    """A manifest's bytes as written (earlier writers' keys unchanged), its header checked."""
    try:
        manifest = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokpackError("manifest is not valid JSON", file=path, where=f"byte {getattr(e, 'pos', 0)}",
                           expected="a JSON object", found=f"{len(raw)} bytes" if raw else "an empty file",
                           hint="restore it from the run that wrote this directory, or rerun that run") from None
    if not isinstance(manifest, dict):
        raise TokpackError("manifest is not a JSON object", file=path, expected="object",
                           found=type(manifest).__name__)
    if manifest.get("format") != FORMAT_NAME:
        raise TokpackError("not a tokpack manifest", file=path, where="format", expected=FORMAT_NAME,
                           found=manifest.get("format"))
    if manifest.get("version") != FORMAT_VERSION:
        raise TokpackError("unsupported format version", file=path, where="version", expected=FORMAT_VERSION,
                           found=manifest.get("version"), hint="use the tokpack release that wrote this directory")
    kinds = ((kind,) if isinstance(kind, str) else kind) or KINDS
    if manifest.get("kind") not in kinds:
        raise TokpackError("wrong kind of tokpack directory", file=path, where="kind", expected=" or ".join(kinds),
                           found=manifest.get("kind"))
    return manifest


def partial_stage_absent(run_dir: Path) -> dict[str, str]:
    """Shards a `tokpack stage --ranks` copy left out, from its `tokpack-stage.json` sidecar:
    {shard path: "staged for ranks ... of W, micro-batch m"}."""
    sidecar = as_path(run_dir) / STAGE_SIDECAR
    if not sidecar.exists():
        return {}
    try:
        info = json.loads(sidecar.read_text())
        if any(field_problems(info, STAGE_FIELDS, "sidecar")) or any(
                any(field_problems(st, STAGE_FIELDS, "stages[]")) for st in info["stages"]):
            raise ValueError
        stages = "; ".join(f"ranks {st['ranks']} of {st['world_size']}, micro-batch {st['micro_batch']}"
                           for st in info.get("stages", []))
        return {str(as_path(run_dir) / epoch / name): f"staged only for {stages}"
                for epoch, names in info.get("missing_shards", {}).items() for name in names}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise TokpackError("unreadable partial-stage sidecar", file=sidecar,
                           hint="stage the directory again") from None
