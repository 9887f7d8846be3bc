"""Every manifest kind's fields, one table each as docs/FORMAT.md shows them (tests/test_format.py
holds them equal), the check of an object against its table, and the keys earlier writers used."""

from __future__ import annotations

import re
from typing import Iterator

from .constants import EPOCH, RUN

# Every manifest kind's fields, as the markdown rows docs/FORMAT.md shows (tests/test_format.py
# holds them equal): name, type, required, the kinds that carry it ("stages[]": the sidecar's
# `stages` entries), meaning. Required is `yes`, `no`, the kinds among those where it is
# required, or "unless `F`": required where field F is absent (one of the two checksums that
# vouch for an epoch shard's tokens). Readers ignore fields they do not know, so a newer writer
# may add optional ones.
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
| `request` | object | no | source | pack's normalised options, which tell a rerun from another pack (`append_eos: true` only when `--append-eos` was given, so older manifests read the same) |
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
| `xxh3_128` | hex32 | source | source, epoch, slice-epoch | checksum of the `.ds` file; an epoch's or slice epoch's entry has it only when written before its row hashes alone vouched for the `.ds` (see History within version 1) |
| `index_xxh3_128` | hex32 | yes | source, epoch, slice-epoch | checksum of `.ds.index` |
| `metadata_xxh3_128` | hex32 | yes | source, epoch, slice-epoch | checksum of `.ds.metadata` |
| `loss_xxh3_128` | hex32 | no | source | checksum of `.ds.loss`, when there is one |
| `multiset_hash` | hex16 | yes | epoch, slice-epoch | sum of xxh3-64 over the shard's samples mod 2^64 |
| `pad_xxh3_128` | hex32 | no | epoch, slice-epoch | a best-fit epoch (or a node slice of one): checksum of `.ds.pad` |
| `rows_xxh3_128` | hex32 | unless `xxh3_128` | epoch, slice-epoch | checksum of `.ds.rows`, the xxh3-64 of each sample, which vouch for the `.ds` file where the entry has no `xxh3_128` (written since node slices; only entries written before them may lack it, and then have `xxh3_128`) |
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

`packing`
| `method` | string | yes | epoch, run | the name the packing is registered under (shuffle/packings.py); the format checks its type only |
| `group_tokens` | int >= 1 | yes | epoch, run | `G`: the source tokens packed together into rows, a group at a time |
| `pad_id` | int >= 0 | yes | epoch, run | the token that fills a row's tail |
| `padding_tokens` | int >= 0 | epoch | epoch | padding tokens over the epoch, the sum of its `.ds.pad` files |
| `table_xxh3_128` | hex32 | epoch | epoch | checksum of the epoch's row table |
| `documents_cut` | int >= 0 | no | epoch | documents longer than a row that the epoch holds a piece of, once per pass |
| `max_documents_per_row` | int >= 0 | no | epoch | the most segments of one row that start at one of its inputs |
| `holdout` | object | no | epoch, run | a run made with `--holdout`: it as recorded (see Held-out windows) |
| `split` | string | no | epoch | RUN/holdout/'s: `"holdout"` |

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


(
    MANIFEST_FIELDS,
    SHARD_FIELDS,
    SOURCE_FIELDS,
    PACKING_FIELDS,
    STAGE_FIELDS,
) = (  # name -> (type, required, kinds, meaning)
    {
        name.strip("`"): (typ, required, kinds, meaning)
        for name, typ, required, kinds, meaning in (row[2:-2].split(" | ") for row in table.splitlines()[1:])
    }
    for table in _FIELD_TABLES.strip().split("\n\n")
)


# Keys earlier writers used, by kind: readers accept them under the current name.
RENAMED = {EPOCH: {"documents": "fragments"}, RUN: {"documents": "fragments"}}
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
    """(name, required (True, False, or the field whose absence makes it required: "unless `F`"),
    exact JSON types, type names, lower bound or None, _HEX entry or None) of each field of
    `kind`: worked out once, since every command checks every shard entry."""
    spec = _SPECS.get((id(table), kind))
    if spec is None:
        spec = []
        for key, (type_name, required, kinds, _) in table.items():
            if kind in kinds.split(", "):
                types = type_name.split(" or ")
                if required.startswith("unless `"):
                    required = required[len("unless `") : -1]
                else:
                    required = required == "yes" or required != "no" and kind in required.split(", ")
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
            if required is True:
                yield key, f"field {key!r}", "no such field", "manifest field missing"
            elif required and required not in obj:
                yield key, f"field {key!r} or {required!r}", "neither", "manifest field missing"
            continue
        value = obj[key]
        # parsed JSON has exactly these types (a bool is no int here); a subclass is checked the long way
        if type(value) not in exact and not any(type_ok(value, _JSON[t]) for t in types):
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


def type_ok(value, typ) -> bool:
    return isinstance(value, typ) and not (isinstance(value, bool) and typ is not bool)
