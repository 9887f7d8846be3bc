"""On-disk format v1: names, dtypes, checksums, and every manifest kind (source,
epoch, run, the partial-stage sidecar): its field table, builder, checker and canonical bytes.

docs/FORMAT.md is the specification; this module is its single implementation.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Iterator

import numpy as np
import xxhash

from .errors import IncompleteError, TokpackError
from .io import IO_BLOCK, as_path, fsync_dir, iter_file_blocks, name_problem, read_limited, write_bytes_atomic

from .packing import has_pad, rows_padded  # noqa: F401 (importable from here as ever)
from .constants import (  # noqa: F401 (the format's constants, importable from here as ever)
    DEFAULT_PLAN_MEMORY,
    DEFAULT_SHARD_TOKENS,
    EPOCH_SHARD_SUFFIXES,
    FORMAT_NAME,
    FORMAT_VERSION,
    HOLDOUT_DIR,
    INDEX_ENTRY_BYTES,
    INDEX_SUFFIX,
    INT_RANGE,
    KINDS,
    LOCK_NAME,
    LOSS_SUFFIX,
    MANIFEST,
    MASK64,
    MAX_EPOCHS,
    MAX_MANIFEST_BYTES,
    MAX_MANIFEST_DEPTH,
    METADATA_SUFFIX,
    NODES_SIDECAR,
    PAD_DTYPE,
    PAD_SUFFIX,
    PLAN_ALGORITHM,
    ROW_HASH_BYTES,
    ROW_HASH_DTYPE,
    ROWS_SUFFIX,
    SHARD_NAME_DIGITS,
    SHARD_SUFFIXES,
    SLICE,
    SLICE_EPOCH,
    SLICE_KINDS,
    STAGE_SIDECAR,
    TOKEN_DTYPES,
    U64,
    WORK_DIR,
)


# ---------------------------------------------------------------------------- dtypes


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """datatrove's rule: uint16 while every id fits, else uint32."""
    if vocab_size <= 1 << 16:
        return TOKEN_DTYPES["uint16"]
    if vocab_size <= 1 << 32:
        return TOKEN_DTYPES["uint32"]
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
        return TOKEN_DTYPES[name]
    except KeyError:
        raise TokpackError("unknown token dtype", where="dtype", expected="uint16 or uint32", found=name) from None


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
    return f"{tokenizer}|{token_size}\n{tokens}\n{metric_tokens(tokens)}"


def metric_tokens(tokens: int) -> str:
    """A token count as datatrove's metadata line writes it, humanize's `metric(tokens, unit="T")`
    ("1.50 kT", "489 kT", "0 T"), made here: humanize is datatrove's dependency, not tokpack's.
    Three significant digits under an SI prefix; the same float steps, so the same digits."""
    exponent = math.floor(math.log10(tokens)) if tokens != 0 else 0  # tokens < 2**64: at most 10**19, prefix E
    old_bucket = exponent // 3 * 3
    value = tokens / 10**old_bucket  # int / int: correctly rounded, as humanize divides
    digits = max(0, 2 - exponent % 3)
    if round(value, digits) >= 10 ** (exponent % 3 + 1):  # 999.6 k -> 1.00 M
        exponent += 1
        value /= 10 ** (exponent // 3 * 3 - old_bucket)
        digits = max(0, 2 - exponent % 3)
    prefix = "kMGTPEZYRQ"[exponent // 3 - 1] if exponent >= 3 else ""
    return f"{value:.{digits}f} {prefix}T"


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


def order_hash_terms(positions: np.ndarray, hashes: np.ndarray) -> np.ndarray:
    """What a sample adds to an order hash: xxh3_64 (seed 0) of 16 bytes, its output position g
    in the epoch then its `row_hash`, each a little-endian uint64. Keyed by g, a term moves
    with its position, so samples swapped, shifted or permuted change the sum (docs/FORMAT.md,
    "Checksums"), where the multiset hash cannot see them."""
    pairs = np.empty((len(hashes), 2), dtype="<u8")
    pairs[:, 0] = positions
    pairs[:, 1] = hashes
    return row_hashes(pairs)


def order_hash(positions: np.ndarray, hashes: np.ndarray) -> int:
    """Sum mod 2^64 of `order_hash_terms`: the order hash of the samples at `positions`."""
    return int(order_hash_terms(positions, hashes).sum(dtype=np.uint64))


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
| `vocab_known` | bool | no | source | `false` when pack knew no vocabulary (no `--vocab-size`, no tokenizer): `vocab_size` is then the input dtype's width, the bound ids were checked against, not the tokenizer's vocabulary; absent: known (as in every manifest before it) |
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
| `packing` | object | no | epoch, run | a best-fit epoch or run: `{method, group_tokens, pad_id}`, an epoch also `padding_tokens`, `table_xxh3_128`, `documents_cut` and `max_documents_per_row`; with `--holdout` `holdout`, and RUN/holdout/'s `split` (see Packing) |
| `holdout` | object | no | epoch, run | a window (concat) run made with `--holdout`: it as recorded, `{"fraction": "1/100"}` or `{"tokens": N}`; RUN/holdout/'s also `"split": "holdout"` (see Held-out windows) |
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
| `pad_xxh3_128` | hex32 | no | epoch, slice-epoch | a best-fit epoch (or a node slice of one): checksum of `.ds.pad` |
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
| `documents` | int >= 0 | no | epoch | a best-fit epoch, or a window epoch with `--holdout`: `D_s`, the source's documents |
| `held_documents` | int >= 0 | no | epoch | a run made with `--holdout`: `k_s`, the source's documents held out |
| `held_tokens` | int >= 0 | no | epoch | a window epoch with `--holdout`: the tokens of its held-out documents (`tokens` is then its stream's) |

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
    {
        name.strip("`"): (typ, required == "yes", kinds, meaning)
        for name, typ, required, kinds, meaning in (row[2:-2].split(" | ") for row in table.splitlines()[1:])
    }
    for table in _FIELD_TABLES.strip().split("\n\n")
)

# Keys earlier writers used, by kind: readers accept them under the current name.
RENAMED = {"epoch": {"documents": "fragments"}, "run": {"documents": "fragments"}}
HEX32 = re.compile(r"^[0-9a-f]{32}$")
HEX16 = re.compile(r"^[0-9a-f]{16}$")
_JSON = {
    "string": str,
    "int": int,
    "bool": bool,
    "list": list,
    "object": dict,
    "null": type(None),
    "hex32": str,
    "hex16": str,
    "int >= 0": int,
    "int >= 1": int,
}


_SPECS: dict = {}  # (id of a field table, kind) -> its fields of that kind, ready to check
_HEX = {"hex32": (HEX32, 32, "malformed checksum"), "hex16": (HEX16, 16, "malformed multiset hash")}


def _spec(table: dict, kind: str) -> list[tuple]:
    """(name, required, exact JSON types, type names, lower bound or None, _HEX entry or None)
    of each field of `kind`: worked out once, since every command checks every shard entry."""
    spec = _SPECS.get((id(table), kind))
    if spec is None:
        spec = []
        for key, (type_name, required, kinds, _) in table.items():
            if kind in kinds.split(", "):
                types = type_name.split(" or ")
                spec.append(
                    (
                        key,
                        required,
                        frozenset(_JSON[t] for t in types),
                        types,
                        int(type_name[-1]) if type_name.startswith("int >= ") else None,
                        _HEX.get(type_name),
                    )
                )
        _SPECS[(id(table), kind)] = spec
    return spec


def field_problems(obj: dict, table: dict, kind: str) -> Iterator[tuple[str, str, object, str]]:
    """(field, expected, found, what is wrong) for each field of `kind` in `table` that `obj` breaks."""
    for key, required, exact, types, lower, hexa in _spec(table, kind):
        if key not in obj:
            if required:
                yield key, f"field {key!r}", "no such field", "manifest field missing"
            continue
        value = obj[key]
        # parsed JSON has exactly these types (a bool is no int here); a subclass is checked the long way
        if type(value) not in exact and not any(
            isinstance(value, _JSON[t]) and not (isinstance(value, bool) and t != "bool") for t in types
        ):
            yield (
                key,
                f"a JSON {'/'.join(_JSON[t].__name__ for t in types)}",
                f"{value!r}"[:60],
                "manifest field has the wrong type",
            )
        elif lower is not None and value < lower:
            yield key, f">= {lower}", value, "manifest field out of range"
        elif hexa is not None and not hexa[0].match(value):
            yield key, f"{hexa[1]} lowercase hex digits", repr(value), hexa[2]


def upgrade(manifest: dict) -> dict:
    """The manifest with the keys of earlier writers under their current names, in place."""
    renamed = {
        old: new
        for old, new in RENAMED.get(manifest.get("kind"), {}).items()
        if old in manifest and new not in manifest
    }
    return {renamed.get(k, k): v for k, v in manifest.items()} if renamed else manifest


# ------------------------------------------------------------------- manifest checks

# What every command checks of a manifest before it uses it, and `tokpack validate` reports:
# fields, the dtype rule, sums and the windowing arithmetic. `add(file, where, expected, found,
# message)` receives each problem; read_manifest's raises at the first (one line), validate's
# collects them all. The files on disk are the checks' of tokpack.packer.validation and shard_scan.

EPOCH_DIR = re.compile(r"^epoch-(\d+)$")


def type_ok(value, typ) -> bool:
    return isinstance(value, typ) and not (isinstance(value, bool) and typ is not bool)


def _fields(obj: dict, table: dict, kind: str, mfile: str, add, prefix: str = "") -> int:
    """The fields of `kind` in one of the field tables: presence, type, range. Returns the count."""
    n = 0
    for key, expected, found, why in field_problems(obj, table, kind):
        add(mfile, f"{prefix}{key}", expected, found, why)
        n += 1
    return n


def _entries(items: list, table: dict, kind: str, mfile: str, name: str, add) -> int:
    """Each entry of the manifest's list `name` ("shards", "sources") against its field table."""
    n = 0
    for i, s in enumerate(items):
        if isinstance(s, dict):
            n += _fields(s, table, kind, mfile, add, f"{name}[{i}].")
        else:
            add(mfile, f"{name}[{i}]", "an object", repr(s)[:40], f"bad {name[:-1]} entry")
            n += 1
    return n


def epoch_sizes_problem(samples, planned) -> str | None:
    """Why a run's `samples` and `epoch_samples` do not say how many samples each epoch holds
    (None when they do): `samples` > 0, or `samples` 0 with every epoch's size in `epoch_samples`."""
    if not (planned is None or isinstance(planned, list) and all(type_ok(n, int) and n >= 0 for n in planned)):
        return "epoch_samples is not a list of sample counts"
    if not type_ok(samples, int) or samples < 0 or (samples == 0 and not planned):
        return "samples is neither a positive count nor 0 with an epoch_samples list"
    return None


def check_manifest(m: dict, directory, add) -> bool:
    """The manifest-level checks of `m` (read from `directory`); True when its shard entries can
    drive the file checks (every field well-formed and the rows cut evenly)."""
    mfile = str(as_path(directory) / MANIFEST)
    kind = m["kind"]
    if kind == "run":
        _check_run_manifest(m, mfile, add)
        return False
    shards = m.get("shards") if isinstance(m.get("shards"), list) else []
    if _fields(m, MANIFEST_FIELDS, kind, mfile, add) + _entries(shards, SHARD_FIELDS, kind, mfile, "shards", add):
        return False  # a malformed manifest cannot drive the checks below
    if not _check_header(m, mfile, add):
        return False
    if kind in SLICE_KINDS:  # a node slice's: its totals here, its rank arithmetic in formats/slices.py
        _check_slice_manifest(m, shards, mfile, add)
        _check_shard_names(shards, mfile, add)
        return m["kind"] == SLICE or all(s["tokens"] == s["samples"] * (m["seq_len"] + 1) for s in shards)
    total = sum(s["tokens"] for s in shards)
    if total != m["tokens"]:
        add(mfile, "tokens", f"{total} (sum over shards)", m["tokens"], "token count wrong")
    _check_shard_names(shards, mfile, add)
    if kind == "source":
        docs = sum(s["documents"] for s in shards)
        if docs != m["documents"]:
            add(mfile, "documents", f"{docs} (sum over shards)", m["documents"], "document count wrong")
        fp = fingerprint([s["xxh3_128"] for s in shards], m["dtype"], m["vocab_size"], m["eos_id"])
        if fp != m["fingerprint"]:
            add(
                mfile,
                "fingerprint",
                fp,
                m["fingerprint"],
                "fingerprint disagrees with the shard checksums, dtype, vocab_size, eos_id",
            )
        for i, s in enumerate(shards):
            if s["documents"] > s["tokens"] or (s["tokens"] > 0) != (s["documents"] > 0):
                add(
                    mfile,
                    f"shards[{i}].documents",
                    f"1..{s['tokens']}",
                    s["documents"],
                    "document count impossible for the token count",
                )
        return True
    row = m["seq_len"] + 1
    _check_epoch_manifest(as_path(directory), m, mfile, add, row)
    # seq_len or the counts are wrong: rows cannot be cut, the lines above say why
    return all(s["tokens"] == s["samples"] * row for s in shards)


def _check_header(m: dict, mfile: str, add) -> bool:
    """The invariants every kind's header keeps: the dtype the vocabulary needs, its token size,
    an EOS id inside the vocabulary. False when the dtype cannot even be read."""
    try:
        dtype, rule = dtype_from_name(m["dtype"]), dtype_name(dtype_for_vocab(m["vocab_size"]))
    except TokpackError as e:
        add(mfile, e.where, e.expected, e.found, e.message)
        return False
    if m["dtype"] != rule:
        add(
            mfile,
            "dtype",
            f"{rule} (vocab_size {m['vocab_size']})",
            m["dtype"],
            "dtype label disagrees with the vocabulary size",
        )
    if m["token_size"] != dtype.itemsize:
        add(
            mfile,
            "token_size",
            f"{dtype.itemsize} ({m['dtype']})",
            m["token_size"],
            "token size disagrees with the dtype label",
        )
    if m["eos_id"] >= m["vocab_size"]:
        add(mfile, "eos_id", f"< {m['vocab_size']} (vocab_size)", m["eos_id"], "EOS id out of vocabulary")
    return True


# What a slice's tokens are, as its run says them: a slice of a run holds the run's tokens.
_SLICE_HEADER = ("dtype", "token_size", "vocab_size", "eos_id", "tokenizer", "seq_len")


def _check_slice_manifest(m: dict, shards: list[dict], mfile: str, add) -> None:
    """A slice's (or slice epoch's) header is its run's, and a slice epoch's totals add up: each
    rank file holds whole rows, their tokens sum to the epoch's, and no more rows than the run's epoch."""
    run = m["run"]
    for key in _SLICE_HEADER:
        if run.get(key) != m.get(key):
            add(mfile, key, f"{run.get(key)!r} (the run's, in run.{key})", m.get(key), "slice disagrees with its run")
    if m["kind"] != SLICE_EPOCH:
        return
    row = m["seq_len"] + 1
    for i, s in enumerate(shards):
        if s["tokens"] != s["samples"] * row:
            add(
                mfile,
                f"shards[{i}].tokens",
                f"{s['samples'] * row} (samples x {row})",
                s["tokens"],
                "rank file token count wrong",
            )
        if s["bytes"] != s["tokens"] * m["token_size"]:
            add(
                mfile,
                f"shards[{i}].bytes",
                f"{s['tokens'] * m['token_size']} (tokens x token_size)",
                s["bytes"],
                "rank file byte count wrong",
            )
    total = sum(s["tokens"] for s in shards)
    if total != m["tokens"]:
        add(mfile, "tokens", f"{total} (sum over rank files)", m["tokens"], "token count wrong")
    rows = sum(s["samples"] for s in shards)
    if rows > m["samples"]:
        add(
            mfile,
            "shards[].samples",
            f"at most {m['samples']} (the run epoch's samples)",
            rows,
            "rank files hold more samples than the epoch",
        )


def _check_shard_names(shards: list[dict], mfile: str, add) -> None:
    """Each shard's `path` a plain `.ds` file name (tokpack.formats.io's containment rule), once each,
    of one width, in sorted order."""
    listed = set()
    names = [s.get("path") for s in shards]
    for i, name in enumerate(names):
        why = name_problem(name)
        if why or name.startswith(".") or not name.endswith(".ds"):
            add(
                mfile,
                f"shards[{i}].path",
                "a plain NNNNN.ds file name",
                repr(name)[:120],
                f"bad shard path ({why})" if why else "bad shard path",
            )
            continue
        if name in listed:
            add(mfile, f"shards[{i}].path", "unique names", name, "shard listed twice")
        listed.add(name)
    if names != sorted(names, key=str) or len({len(n) for n in names if isinstance(n, str)}) > 1:
        add(mfile, "shards", "names of one width, in sorted order", names[:5], "shard names out of order")


def row_bytes_of(manifest: dict) -> int:
    """Bytes of one sample of an epoch, run or slice: `seq_len + 1` tokens of `token_size` bytes."""
    return (int(manifest["seq_len"]) + 1) * int(manifest["token_size"])


def _check_epoch_manifest(path, m: dict, mfile: str, add, row: int) -> None:
    shards = m["shards"]
    per = m["shard_samples"]
    for i, s in enumerate(shards):
        if s["tokens"] != s["samples"] * row:
            add(
                mfile,
                f"shards[{i}].tokens",
                f"{s['samples'] * row} (samples x {row})",
                s["tokens"],
                "shard token count wrong",
            )
        last = i == len(shards) - 1
        if (not last and s["samples"] != per) or (last and not 1 <= s["samples"] <= per):
            add(
                mfile,
                f"shards[{i}].samples",
                per if not last else f"1..{per}",
                s["samples"],
                "every shard but the last holds exactly shard_samples samples",
            )
    total = sum(s["samples"] for s in shards)
    if total != m["samples"]:
        add(mfile, "samples", f"{total} (sum over shards)", m["samples"], "sample count wrong")
    multiset = sum(int(s["multiset_hash"], 16) for s in shards) & MASK64
    if hash_hex64(multiset) != m["sample_multiset_hash"]:
        add(
            mfile,
            "sample_multiset_hash",
            f"{hash_hex64(multiset)} (sum of the shards' multiset_hash)",
            m["sample_multiset_hash"],
            "multiset hash disagrees with its shards",
        )
    srcs = m["sources"]
    for i, s in enumerate(srcs):
        if not isinstance(s, dict):
            add(mfile, f"sources[{i}]", "an object", repr(s)[:40], "bad source entry")
            return
        _fields(s, SOURCE_FIELDS, "epoch", mfile, add, f"sources[{i}].")
    if all(type_ok(s.get("samples"), int) for s in srcs) and sum(s["samples"] for s in srcs) != m["samples"]:
        add(
            mfile,
            "sources[].samples",
            f"{m['samples']} (the epoch's samples)",
            sum(s["samples"] for s in srcs),
            "per-source sample counts do not add up",
        )
    frags = [s.get("fragments") for s in shards]
    if "fragments" in m and all(type_ok(f, int) for f in frags) and sum(frags) != m["fragments"]:
        add(mfile, "fragments", f"{sum(frags)} (sum of the shards' fragments)", m["fragments"], "fragment count wrong")
    if not rows_padded(m):  # a padded epoch has no windows: its plan is proven by --against's replay
        _check_epoch_sources(m, srcs, row, lambda *a: add(mfile, *a))
    dir_epoch = EPOCH_DIR.match(path.name)
    if dir_epoch and int(dir_epoch.group(1)) != m["epoch"]:
        add(mfile, "epoch", f"{int(dir_epoch.group(1))} (from the directory name)", m["epoch"], "epoch number wrong")


def chain_start(epoch: int, samples: int, cursor: int | None = None) -> int:
    """Position in a source's chain of windows of an epoch's first sample from it: where the
    epochs before it left the chain (`cursor`, as a schedule records it), else `epoch * samples`."""
    return epoch * samples if cursor is None else cursor


def pass_span(start: int, samples: int, windows: int) -> tuple[int, int]:
    """(first pass, passes touched) of `samples` windows of a chain from position `start`, with
    `windows` windows a pass; (0, 0) when the source gives the epoch nothing."""
    if not samples:
        return 0, 0
    first = start // windows
    return first, (start + samples - 1) // windows - first + 1


def _check_epoch_sources(m: dict, srcs: list, row: int, add) -> None:
    """The windowing arithmetic of docs/COMMANDS.md ("The shuffle algorithm") for each source entry that
    records it: a corrupted count cannot hide behind a field nobody reads."""
    keys = ("tokens", "windows", "offset", "dropped_tokens", "samples", "first_pass", "passes")
    dropped = 0
    for i, s in enumerate(srcs):
        if not all(type_ok(s.get(k), int) and s[k] >= 0 for k in keys):
            return
        t, w, o, c = s["tokens"], s["windows"], s["offset"], s["samples"]
        if o >= row or (not m.get("jitter", False) and o):
            add(
                f"sources[{i}].offset",
                f"< {row}" + (" and 0 without jitter" if not m.get("jitter") else ""),
                o,
                "window offset impossible",
            )
        if w < 1 or o + w * row > t or t - w * row != s["dropped_tokens"]:
            add(
                f"sources[{i}].windows",
                f"windows x {row} + dropped_tokens == tokens ({t})",
                f"{w} x {row} + {s['dropped_tokens']}",
                "source window counts do not add up",
            )
            return
        first, passes = pass_span(
            chain_start(m["epoch"], c, s["cursor"] if type_ok(s.get("cursor"), int) else None), c, w
        )
        if (s["first_pass"], s["passes"]) != (first, passes):
            add(
                f"sources[{i}].first_pass/passes",
                f"{first}/{passes} (epoch {m['epoch']}, {c} of {w} windows)",
                f"{s['first_pass']}/{s['passes']}",
                "source pass bookkeeping wrong",
            )
        offsets = m.get("jitter_offsets")
        if isinstance(offsets, list) and (i >= len(offsets) or offsets[i] != o):
            add(
                f"jitter_offsets[{i}]",
                o,
                offsets[i] if i < len(offsets) else "no entry",
                "jitter offset disagrees with its source entry",
            )
        dropped += s["dropped_tokens"]
    if srcs and dropped != m["dropped_tokens"]:
        add("dropped_tokens", f"{dropped} (sum over sources)", m["dropped_tokens"], "dropped token count wrong")


def _check_run_manifest(m: dict, mfile: str, add) -> None:
    sources = m.get("sources") if isinstance(m.get("sources"), list) else []
    if _fields(m, MANIFEST_FIELDS, "run", mfile, add) + _entries(sources, SOURCE_FIELDS, "run", mfile, "sources", add):
        return
    if not _check_header(m, mfile, add):
        return
    epochs = m["epochs"]
    if not all(type_ok(e, int) and e >= 0 for e in epochs) or len(set(epochs)) != len(epochs):
        add(mfile, "epochs", "distinct epoch numbers >= 0", epochs[:8], "bad epoch list")
        return
    why = epoch_sizes_problem(m["samples"], m.get("epoch_samples"))
    planned = m.get("epoch_samples") or []
    if why is None and m["samples"] == 0 and any(e >= len(planned) for e in epochs):
        why = f"epoch {max(epochs)} is written but epoch_samples sizes only epochs 0..{len(planned) - 1}"
    if why:
        add(
            mfile,
            "samples/epoch_samples",
            "a size for every epoch the run lists",
            f"samples {m['samples']!r}, epoch_samples {repr(m.get('epoch_samples'))[:60]}",
            f"run manifest does not say how many samples its epochs hold: {why}",
        )


def _raise_first(file, where, expected, found, message, **kw):
    raise TokpackError(
        message,
        file=file,
        where=where,
        expected=expected,
        found=found,
        hint=kw.get("hint")
        or "the manifest was edited or damaged; restore it (or rerun the "
        "command that wrote it), and run `tokpack validate` on the directory",
    )


# ------------------------------------------------------------------ manifest builders


def _header(kind: str, dtype: np.dtype, vocab_size: int, eos_id: int, tokenizer: str, tokens: int) -> dict:
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "kind": kind,
        "dtype": dtype_name(dtype),
        "token_size": np.dtype(dtype).itemsize,
        "vocab_size": int(vocab_size),
        "eos_id": int(eos_id),
        "tokenizer": tokenizer,
        "tokens": int(tokens),
    }


def header_like(m: dict, kind: str) -> dict:
    """A manifest header of `kind` for tokens described as `m` describes them (a run's, for its
    slices): the same dtype, vocabulary, EOS id and tokenizer."""
    return _header(kind, dtype_from_name(m["dtype"]), m["vocab_size"], m["eos_id"], m["tokenizer"], 0)


def source_manifest(shards: list[dict], dtype: np.dtype, vocab_size: int, eos_id: int, tokenizer: str, **extra) -> dict:
    return {
        **_header("source", dtype, vocab_size, eos_id, tokenizer, sum(s["tokens"] for s in shards)),
        "documents": sum(s["documents"] for s in shards),
        "fingerprint": fingerprint([s["xxh3_128"] for s in shards], dtype_name(dtype), vocab_size, eos_id),
        "shards": shards,
        **extra,
    }


def epoch_manifest(
    shards: list[dict],
    dtype: np.dtype,
    vocab_size: int,
    eos_id: int,
    tokenizer: str,
    *,
    tokens: int,
    epoch: int,
    seed: int,
    seq_len: int,
    samples: int,
    shard_samples: int,
    dropped_tokens: int,
    jitter: bool,
    sources: list[dict],
    shuffle: str,
) -> dict:
    return {
        **_header("epoch", dtype, vocab_size, eos_id, tokenizer, tokens),
        "fragments": sum(s["fragments"] for s in shards),
        "shards": shards,
        "epoch": epoch,
        "seed": seed,
        "seq_len": seq_len,
        "samples": samples,
        "shard_samples": shard_samples,
        "dropped_tokens": dropped_tokens,
        "jitter": jitter,
        "jitter_offsets": [s["offset"] for s in sources],
        "sources": sources,
        "sample_multiset_hash": hash_hex64(sum(int(s["multiset_hash"], 16) for s in shards)),
        "shuffle": shuffle,
    }


def run_manifest(
    epochs: dict[int, dict],
    dtype: np.dtype,
    vocab_size: int,
    eos_id: int,
    tokenizer: str,
    *,
    sources: list[dict],
    weights: list | None,
    seq_len: int,
    seed: int,
    jitter: bool,
    samples: int,
    shard_samples: int,
    shuffle: str,
    extra: dict | None = None,
) -> dict:
    """`epochs`: the manifests of the epochs written so far, by number; `sources`: an epoch's entries;
    `extra`: a scheduled run's fields (epoch_samples, schedule...)."""
    written = [upgrade(m) for m in epochs.values()]
    sources = [{k: s[k] for k, field in SOURCE_FIELDS.items() if "run" in field[2]} for s in sources]
    return {
        **_header("run", dtype, vocab_size, eos_id, tokenizer, sum(int(m["tokens"]) for m in written)),
        "fragments": sum(int(m["fragments"]) for m in written),
        "sources": sources,
        "weights": weights,
        "seq_len": seq_len,
        "seed": seed,
        "jitter": jitter,
        "samples": samples,
        "shard_samples": shard_samples,
        "epochs": sorted(epochs),
        "shuffle": shuffle,
        **(extra or {}),
    }


def nodes_sidecar(nodes: int, ranks_per_node: int, micro_batch: int, dest: str) -> dict:
    return {
        "format": "tokpack-nodes",
        "note": "shuffle --to-nodes: the epochs' tokens are in node slices, on the nodes",
        "nodes": nodes,
        "ranks_per_node": ranks_per_node,
        "micro_batch": micro_batch,
        "dest": dest,
    }


def stage_sidecar(stages: list[dict], missing_shards: dict[str, list[str]]) -> dict:
    return {
        "format": "tokpack-stage",
        "partial": True,
        "note": "a --ranks stage: only the listed ranks' shards were copied; the manifests are the source's",
        "stages": stages,
        "missing_shards": missing_shards,
    }


# ------------------------------------------------------------------------ manifests


def canonical_bytes(manifest: dict) -> bytes:
    """The one serialisation of every manifest: a manifest whose bytes differ was edited."""
    return json.dumps(manifest, indent=1, sort_keys=False).encode() + b"\n"


def write_manifest(directory: str | Path, manifest: dict, name: str = MANIFEST) -> None:
    """Written last, atomically: its presence is what makes a directory complete (an Output that
    sends its files elsewhere sends it last too: tokpack.formats.outputs)."""
    fsync_dir(directory)  # the shards' renames are on disk before a manifest can claim them
    write_bytes_atomic(Path(directory) / name, canonical_bytes(manifest), fsync=True)
    fsync_dir(directory)


def read_manifest(directory: str | Path, kind: str | tuple[str, ...] | None = None, checked: bool = True) -> dict:
    """Reads a manifest, strictly and bounded (parse_manifest), and with `checked` applies
    check_manifest: its first problem is a TokpackError. Keys of earlier writers come under
    their current names. `checked=False` is for validate, which reports every problem."""
    directory = as_path(directory)
    path = directory / MANIFEST
    if not directory.exists():
        raise TokpackError("no such directory", file=directory, hint="check the path or URL")
    if not path.exists():
        if isinstance(directory, Path) and not directory.is_dir():  # a file given for a directory: nothing unfinished
            raise TokpackError(
                "not a directory",
                file=directory,
                expected="a tokpack directory",  # validate's words
                found="a file" if directory.is_file() else "neither a file nor a directory",
                hint="pass the directory that holds tokpack.json",
            )
        raise IncompleteError(
            "incomplete: no tokpack.json",
            file=directory,
            hint="the run that writes it was interrupted or is still running; rerun the same command to finish it",
        )
    manifest = upgrade(parse_manifest(read_limited(path, MAX_MANIFEST_BYTES, "manifest"), path, kind))
    if checked:
        require_valid(manifest, directory)
    return manifest


def require_valid(manifest: dict, directory) -> None:
    """check_manifest for a command about to use `manifest`: its first problem is a TokpackError."""
    check_manifest(upgrade(manifest), directory, _raise_first)


class _Refused(ValueError):
    """A JSON value the format never holds: (what was found, what was expected)."""


def _constant(name: str):
    raise _Refused(name, "a finite number (JSON has no NaN or Infinity)")


def _check_values(obj) -> None:
    """Every integer in range, every number finite, lists and objects nested at most
    MAX_MANIFEST_DEPTH deep: one walk without recursion (json's own parser does the work of
    reading the numbers, which a per-number hook would slow down 1.6x)."""
    stack = [(obj, 1)]
    while stack:
        o, depth = stack.pop()
        if depth > MAX_MANIFEST_DEPTH:
            raise _Refused("deeper", f"at most {MAX_MANIFEST_DEPTH} levels of lists and objects")
        for c in o.values() if type(o) is dict else o:
            kind = type(c)
            if kind is dict or kind is list:
                stack.append((c, depth + 1))
            elif kind is int and not INT_RANGE[0] <= c < INT_RANGE[1]:
                text = str(c)
                raise _Refused(f"{text[:24]}{'...' if len(text) > 24 else ''}", "an integer in [-2**63, 2**64)")
            elif kind is float and not math.isfinite(c):
                raise _Refused(repr(c), "a finite number")


def strict_json(raw: bytes, path, what: str = "manifest"):
    """JSON a tokpack file holds, read strictly and bounded (docs/COMMANDS.md, "Containment"):
    at most MAX_MANIFEST_BYTES, integers in [-2**63, 2**64), finite numbers only, lists and
    objects nested at most MAX_MANIFEST_DEPTH deep. Anything else is one TokpackError."""
    bad = dict(
        file=path,
        hint=f"this is not a {what} tokpack wrote; restore it from the run that wrote this "
        "directory, or rerun that run",
    )
    if len(raw) > MAX_MANIFEST_BYTES:
        raise TokpackError(
            f"{what} is too large", expected=f"at most {MAX_MANIFEST_BYTES:,} bytes", found=f"{len(raw):,} bytes", **bad
        )
    try:
        value = json.loads(raw, parse_constant=_constant)
        if type(value) is dict or type(value) is list:
            _check_values(value)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokpackError(
            f"{what} is not valid JSON",
            where=f"byte {getattr(e, 'pos', getattr(e, 'start', 0))}",
            expected="a JSON object",
            found=f"{len(raw)} bytes" if raw else "an empty file",
            **bad,
        ) from None
    except _Refused as e:
        raise TokpackError(
            f"{what} holds a value outside the format", expected=e.args[1], found=e.args[0], **bad
        ) from None
    except ValueError:  # an integer of more than 4300 digits, which int() refuses to read
        raise TokpackError(
            f"{what} holds a value outside the format",
            expected="an integer in [-2**63, 2**64)",
            found="an integer of thousands of digits",
            **bad,
        ) from None
    except RecursionError:
        raise TokpackError(
            f"{what} holds a value outside the format",
            expected=f"at most {MAX_MANIFEST_DEPTH} levels of lists and objects",
            found="deeper",
            **bad,
        ) from None
    return value


def parse_manifest(raw: bytes, path: str | Path, kind: str | tuple[str, ...] | None = None) -> dict:
    """A manifest's bytes as written (earlier writers' keys unchanged), read by strict_json, its
    header checked."""
    manifest = strict_json(raw, path)
    if not isinstance(manifest, dict):
        raise TokpackError(
            "manifest is not a JSON object",
            file=path,
            expected="object",
            found=type(manifest).__name__,
            hint="restore it from the run that wrote this directory",
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
    kinds = ((kind,) if isinstance(kind, str) else kind) or KINDS
    if manifest.get("kind") not in kinds:
        raise TokpackError(
            "wrong kind of tokpack directory",
            file=path,
            where="kind",
            expected=" or ".join(kinds),
            found=manifest.get("kind"),
        )
    return manifest


def partial_stage_absent(run_dir: Path) -> dict[str, str]:
    """Shards a `tokpack stage --ranks` copy left out, from its `tokpack-stage.json` sidecar:
    {shard path: "staged for ranks ... of W, micro-batch m"}."""
    sidecar = as_path(run_dir) / STAGE_SIDECAR
    if not sidecar.exists():
        return {}
    try:
        info = strict_json(
            read_limited(sidecar, MAX_MANIFEST_BYTES, "partial-stage sidecar"), sidecar, "partial-stage sidecar"
        )
        if any(field_problems(info, STAGE_FIELDS, "sidecar")) or any(
            any(field_problems(st, STAGE_FIELDS, "stages[]")) for st in info["stages"]
        ):
            raise ValueError
        stages = "; ".join(
            f"ranks {st['ranks']} of {st['world_size']}, micro-batch {st['micro_batch']}"
            for st in info.get("stages", [])
        )
        return {
            str(as_path(run_dir) / epoch / name): f"staged only for {stages}"
            for epoch, names in info.get("missing_shards", {}).items()
            for name in names
        }
    except (ValueError, KeyError, TypeError, AttributeError, TokpackError):
        raise TokpackError("unreadable partial-stage sidecar", file=sidecar, hint="stage the directory again") from None
