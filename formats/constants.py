"""The format's constants, each defined once: the names, suffixes, dtypes, widths and bounds of
what tokpack writes (docs/FORMAT.md), and the defaults that decide a written layout. Every other
module, in formats/ and outside it, imports them from here.

This module imports nothing, numpy included (`import packer` stays light, tests/test_api.py): the
dtypes are named here as strings and made numpy dtypes when first imported (`__getattr__`)."""

from __future__ import annotations

FORMAT_NAME = "tokpack"
FORMAT_VERSION = 1
MANIFEST = "tokpack.json"
SOURCE = "source"  # kind of a packed source's manifest
RUN = "run"  # kind of a run's root manifest (RUN/tokpack.json)
EPOCH = "epoch"  # kind of an epoch's manifest (a run's epoch-NNNNN/, or RUN/holdout/)
KINDS = (SOURCE, RUN, EPOCH)
SLICE = "slice"  # kind of a node slice's root manifest (docs/FORMAT.md, "Node slices")
SLICE_EPOCH = "slice-epoch"  # kind of a node slice epoch's manifest
SLICE_KINDS = (SLICE, SLICE_EPOCH)

# ------------------------------------------------------------------- names in a directory
SHARD_NAME_DIGITS = 5
# Written by `tokpack stage --ranks` at a run copy's root: which shards it left out.
STAGE_SIDECAR = "tokpack-stage.json"
# A run whose epochs' tokens are in node slices (shuffle --to-nodes): written in RUN before its
# first epoch, it is what lets an epoch folder lack its token files; without it they are missing.
NODES_SIDECAR = "tokpack-nodes.json"
LOCK_NAME = "tokpack.lock"  # the lock of the command writing a directory (formats/guard.py)
WORK_DIR = ".tokpack-work"  # a command's scratch inside OUT, removed when it finishes
HOLDOUT_DIR = "holdout"  # RUN/holdout/: the held-out documents of `shuffle --holdout`, an epoch directory
# Fields a run and each of its epochs agree on (when both record them): validate's check of a
# run's epochs and the reader's at open, which refuses an epoch of another run put in its place.
RUN_KEYS = (
    "dtype",
    "token_size",
    "vocab_size",
    "eos_id",
    "tokenizer",
    "seq_len",
    "seed",
    "jitter",
    "samples",
    "shard_samples",
    "shuffle",
)
# Epoch numbers run from 0 to MAX_EPOCHS - 1: their five digits keep a run's epoch-NNNNN folders
# listed in order, and a run manifest lists each epoch written.
MAX_EPOCHS = 10**5

# ------------------------------------------------------------------ a shard's files
# A shard is datatrove's layout, NNNNN.ds (raw little-endian tokens) and, after its name:
INDEX_SUFFIX = ".index"  # uint64 LE cumulative ends, no leading 0
METADATA_SUFFIX = ".metadata"  # "{tokenizer}|{token_size}\n{tokens}\n{humanized}"
LOSS_SUFFIX = ".loss"  # a source shard's loss mask, one byte a token, when its entry has loss_xxh3_128
ROWS_SUFFIX = ".rows"  # an epoch shard's row hashes (docs/FORMAT.md): present when its entry has rows_xxh3_128
PAD_SUFFIX = ".pad"  # a best-fit epoch shard: uint32 LE per sample, its padding tokens (at the sample's end)
SHARD_SUFFIXES = ("", INDEX_SUFFIX, METADATA_SUFFIX, LOSS_SUFFIX)  # the files of one shard, after its name
EPOCH_SHARD_SUFFIXES = tuple(s for s in SHARD_SUFFIXES if s != LOSS_SUFFIX)  # an epoch's shards carry no loss mask

# numpy dtypes by the name they are imported as; each is a numpy dtype once imported
DTYPES = {
    "U64": "<u8",  # .ds.index entries
    "ROW_HASH_DTYPE": "<u8",  # .ds.rows: one row's xxh3-64, a sample
    "PAD_DTYPE": "<u4",  # .ds.pad: one row's padding tokens, a sample
}
TOKEN_DTYPE_NAMES = {"uint16": "<u2", "uint32": "<u4"}  # a manifest's `dtype`: TOKEN_DTYPES by name
INDEX_ENTRY_BYTES = 8  # one .ds.index entry (U64)
ROW_HASH_BYTES = 8  # one .ds.rows entry (ROW_HASH_DTYPE)


def __getattr__(name: str):
    """U64, ROW_HASH_DTYPE, PAD_DTYPE and TOKEN_DTYPES, made with numpy when first imported."""
    if name not in DTYPES and name != "TOKEN_DTYPES":  # e.g. `__path__`, which every from-import asks for
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import numpy as np

    if name in DTYPES:
        value = np.dtype(DTYPES[name])
    else:
        value = {k: np.dtype(v) for k, v in TOKEN_DTYPE_NAMES.items()}
    globals()[name] = value
    return value


# ------------------------------------------------------------------ plan and bounds
# The `shuffle` a run and its epochs record: names the plan (shuffle/plan.py, shuffle/permutation.py).
# A change to which window lands where is a new name, not a new format version.
PLAN_ALGORITHM = "tokpack-feistel6-splitmix-xxh3-v1"
# A manifest larger than this is refused by its size, before it is read. An epoch manifest
# takes about 330 bytes per shard: this allows some 800,000 shards in one directory (at the
# default shard size, some 800 TB), far beyond a real run, while a hostile file costs no memory.
MAX_MANIFEST_BYTES = 256 << 20
MAX_MANIFEST_DEPTH = 32  # lists and objects in lists and objects; a manifest tokpack writes nests 4
INT_RANGE = (-(1 << 63), 1 << 64)  # every integer in a manifest; a seed may use 64 unsigned bits
MASK64 = 0xFFFFFFFFFFFFFFFF  # multiset and order hashes sum modulo 2**64

# ------------------------------------------------------------------ defaults of a layout
DEFAULT_SHARD_TOKENS = 1 << 30  # `pack --shard-tokens`: where a source's shards are cut
DEFAULT_PLAN_MEMORY = 256 << 20  # a plan's budget when no --memory bounds it (validate --against, inspect)
