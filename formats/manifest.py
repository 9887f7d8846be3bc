"""On-disk format v1: names, dtypes, checksums, and every manifest kind (source, epoch, run,
node slice, the sidecars): its field table, builder, checker and canonical bytes. docs/FORMAT.md
is the specification; formats/ is its single implementation, one module an idea:

- `constants`: every constant of the format (names, suffixes, dtypes, widths, defaults);
- `names`: token dtypes, shard and epoch names, `.ds.metadata`'s text;
- `hashes`: checksums, row hashes, the multiset and order hashes, fingerprints;
- `fields`: each manifest kind's field table (FORMAT.md's tables) and its check;
- `checks`: a manifest's checks beyond its fields (an epoch's arithmetic, a run's epochs...);
- `builders`: the manifests and sidecars tokpack writes;
- `reading`: canonical bytes, the strict parser every manifest read goes through;
- `packing`: the packing record, `rows_padded`/`has_pad`, and where --holdout is recorded.

This module gathers their public names: `from tokpack.formats.manifest import X` as ever."""

# ruff: noqa: F401 (every import here is a re-export)
from .constants import (
    PAD_DTYPE,
    ROW_HASH_DTYPE,
    TOKEN_DTYPES,
    U64,
    DEFAULT_PLAN_MEMORY,
    DEFAULT_SHARD_TOKENS,
    DTYPES,
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
    PAD_ENTRY_BYTES,
    PAD_SUFFIX,
    PLAN_ALGORITHM,
    ROWS_SUFFIX,
    ROW_HASH_BYTES,
    SHARD_NAME_DIGITS,
    SHARD_SUFFIXES,
    SLICE,
    SLICE_EPOCH,
    SLICE_KINDS,
    STAGE_SIDECAR,
    TOKEN_DTYPE_NAMES,
    WORK_DIR,
)
from .names import (
    dtype_for_vocab,
    dtype_from_name,
    dtype_name,
    epoch_dir_name,
    metadata_text,
    metric_tokens,
    parse_metadata_text,
    shard_digits,
    shard_name,
)
from .hashes import (
    fingerprint,
    hash_hex64,
    multiset_hash_rows,
    order_hash,
    order_hash_terms,
    row_hash,
    row_hashes,
    xxh3_128_file,
)
from .fields import (
    HEX16,
    HEX32,
    MANIFEST_FIELDS,
    RENAMED,
    SHARD_FIELDS,
    SOURCE_FIELDS,
    STAGE_FIELDS,
    field_problems,
    type_ok,
    upgrade,
)
from .checks import EPOCH_DIR, chain_start, check_manifest, epoch_sizes_problem, pass_span, raise_first, row_bytes_of
from .builders import (
    ShuffleFields,
    TokenHeader,
    epoch_manifest,
    header_like,
    nodes_sidecar,
    run_manifest,
    source_manifest,
    stage_sidecar,
)
from .reading import (
    canonical_bytes,
    parse_manifest,
    partial_stage_absent,
    read_manifest,
    require_valid,
    strict_json,
    write_manifest,
)
from .packing import HOLDOUT_SPLIT, PackingRecord, has_pad, holdout_recorded, record_holdout, rows_padded, run_holdout
