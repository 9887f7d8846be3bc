"""Input readers for `pack`, one module per foreign format (datatrove, Megatron, Parquet/Arrow,
.npy/raw tokens, JSONL); `discover` finds the files, tells their format and dispatches to it.
This module holds what they share.

Every reader streams: it yields `Block`s of whole documents, a few tens of MiB each, read into
one reused buffer, so memory does not depend on the input's size (only a single document
larger than a block is held whole). Raw text is not read here: `pack` tokenizes it with
datatrove's DocumentTokenizer into a datatrove folder, which is then read like any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import TokpackError
from ..io.paths import as_path
from ..io.reads import read_full

# Input bytes per block: big enough for sequential I/O and to amortise per-block numpy
# calls, small enough that its buffer stays in cache-friendly, already-faulted memory
# (touching fresh pages is slow, BENCHMARKS.md "Figures cited by the code": fresh memory, so
# buffers are reused per process).
BLOCK_BYTES = 16 << 20
INDEX_CHUNK = 1 << 20  # index entries (documents/sequences) loaded at a time


@dataclass
class Block:
    """Whole documents of one input file. `tokens` (and `loss`) may be views into a buffer
    the reader reuses for the next block: consume them before asking for the next."""

    tokens: np.ndarray  # token ids in the input's dtype
    ends: np.ndarray  # int64 document ends relative to tokens[0]; last == len(tokens); repeats = empty documents
    loss: np.ndarray | None  # uint8 per token, or None
    first_doc: int  # number of the block's first document within its file (for messages)
    offset: int  # token offset of tokens[0] within its file (for messages)


@dataclass
class InputFile:
    """One input file, as discovered. Small and picklable: tasks receive it."""

    path: str  # the file holding the tokens (.ds, .bin, .parquet, .arrow, .npy, .jsonl...)
    format: str  # datatrove | megatron | parquet | arrow | numpy | raw | jsonl | text
    dtype: str | None  # token dtype as stored; None when values carry no fixed width (JSON ints)
    size: int  # bytes of the input's files, for progress and the manifest
    column: str | None = None  # Parquet/Arrow column or JSONL key
    tokenizer: str | None = None  # the tokenizer the input's own metadata names
    extra: dict = field(default_factory=dict)  # per format: sidecar paths, header fields


def input_stamp(f: InputFile) -> list[list[int]]:
    """(size, mtime in ns, inode) of each file the input's tokens come from: a part packed from
    it is kept by a rerun only while its stamp is the same, since an input rewritten in place at
    the same size (the request records only sizes) would leave old tokens in the pack."""
    paths = [f.path, *(f.extra.get(k) for k in ("index", "loss", "idx"))]
    stamps = []
    for path in filter(None, paths):
        st = as_path(path).stat()
        stamps.append([st.st_size, st.st_mtime_ns, st.st_ino])
    return stamps


def input_error(message, path, **kw) -> TokpackError:
    return TokpackError(message, file=str(path), **kw)


def token_count(path, dtype: str, what: str, per_token: str = " bytes", hint: str | None = None) -> tuple[int, int]:
    """The size of the token file `path` and the `dtype` tokens it holds; one line naming `what`
    when that size is no whole number of tokens (`per_token`: the unit its message gives)."""
    itemsize = np.dtype(dtype).itemsize
    size = as_path(path).stat().st_size
    if size % itemsize:
        raise input_error(
            f"{what} size is not a multiple of the token size",
            path,
            where="size",
            expected=f"a multiple of {itemsize}{per_token} ({dtype})",
            found=f"{size} bytes",
            hint=hint,
        )
    return size, size // itemsize


def read_exact(fh, out: np.ndarray, path, offset: int) -> np.ndarray:
    """Fills `out` from `fh`; `offset` (tokens) names the place in messages."""
    if read_full(fh, memoryview(out.view(np.uint8))) < out.nbytes:
        raise input_error(
            "file ended early",
            path,
            where=f"token {offset}",
            expected="more data",
            found="end of file",
            hint="the file is truncated or changed while packing",
        )
    return out
