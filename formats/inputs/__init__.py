"""Input readers for `pack`: datatrove folders, Megatron .bin/.idx, Parquet/Arrow (and HF
`save_to_disk` directories), numpy token arrays, raw token files and JSONL token lists; one
module per format, `discover` to find and tell them.

Every reader streams: it yields `Block`s of whole documents, a few tens of MiB each, read
into one reused buffer, so memory does not depend on the input's size (only a single
document larger than a block is held whole). `check_input` runs the structural checks that
need no token scan (sizes, headers, indexes, schemas) so `pack` can refuse a bad input
before it writes anything; pack's `Normalizer` then does the token checks.

Raw text is not read here: `pack` tokenizes it with datatrove's DocumentTokenizer into a
datatrove folder, which is then read like any other.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from .base import BLOCK_BYTES, Block, InputFile, input_error  # noqa: F401 - the package's names
from .datatrove_ds import check_datatrove, datatrove_blocks
from .discover import discover  # noqa: F401
from .jsonl import jsonl_blocks
from .megatron_bin import check_megatron, megatron_blocks
from .npy_raw import eos_split_blocks
from .tables import table_blocks


def check_input(f: InputFile) -> None:
    """Structural checks that need no token scan; run on every input before pack writes anything."""
    if f.format == "datatrove":
        check_datatrove(f)
    elif f.format == "megatron":
        check_megatron(f)


def read_blocks(f: InputFile, eos_id: int, block_bytes: int = BLOCK_BYTES) -> Iterator[Block]:
    """Whole documents of `f`, a block at a time, in file order."""
    itemsize = np.dtype(f.dtype).itemsize if f.dtype else 8
    block_tokens = max(1, block_bytes // itemsize)
    if f.format == "datatrove":
        return datatrove_blocks(f, block_tokens)
    if f.format == "megatron":
        return megatron_blocks(f, block_tokens)
    if f.format in ("parquet", "arrow"):
        return table_blocks(f, block_tokens)
    if f.format in ("numpy", "raw"):
        return eos_split_blocks(f, block_tokens, eos_id)
    if f.format == "jsonl":
        return jsonl_blocks(f, block_tokens)
    raise ValueError(f"no block reader for {f.format!r}")
