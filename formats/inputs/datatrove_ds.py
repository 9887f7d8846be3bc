"""datatrove token files: `.ds` tokens, `.ds.index` document ends (uint64), optional
`.ds.metadata` (tokenizer and token size) and `.ds.loss` (one byte per token)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Iterator

import numpy as np

from ..constants import INDEX_ENTRY_BYTES, U64  # datatrove's .ds.index is the shard index tokpack writes
from ..io.paths import as_path
from ..io.memory import give_buffers, take_buffer
from ..io.gate import open_read, read_array, read_limited
from ..io.reads import read_ahead
from ..constants import MAX_MANIFEST_BYTES
from ..names import parse_metadata_text
from . import INDEX_CHUNK, Block, InputFile, input_error as _err, read_exact, token_count


def datatrove_file(path, dtype: str | None) -> InputFile:
    meta = as_path(f"{path}.metadata")
    tokenizer = recorded = None
    if meta.exists():
        tokenizer, token_size, recorded = parse_metadata_text(
            read_limited(meta, MAX_MANIFEST_BYTES, "metadata file", user=True).decode(), meta
        )
        if token_size not in (2, 4):
            raise _err(
                "unsupported token size in datatrove metadata",
                meta,
                where="token_size",
                expected="2 or 4",
                found=token_size,
            )
        name = "uint16" if token_size == 2 else "uint32"
        if tokenizer.startswith("Unknown Tokenizer"):
            tokenizer = None
    elif dtype in ("uint16", "uint32"):
        name = dtype
    else:
        raise _err(
            "datatrove file without .ds.metadata: token size unknown",
            path,
            where=".ds.metadata",
            expected="a metadata file",
            found="none",
            hint="pass --dtype uint16 or --dtype uint32",
        )
    loss = as_path(f"{path}.loss")
    size = sum(p.stat().st_size for p in (path, as_path(f"{path}.index"), loss) if p.exists())
    return InputFile(
        str(path),
        "datatrove",
        name,
        size,
        tokenizer=tokenizer,
        extra={"index": f"{path}.index", "loss": str(loss) if loss.exists() else None, "recorded": recorded},
    )


def check_datatrove(f: InputFile) -> None:
    hint = "the file is truncated or its .ds.metadata names the wrong token size"
    tokens = token_count(f.path, f.dtype, ".ds", hint=hint)[1]
    index = f.extra["index"]
    if not as_path(index).exists():
        raise _err(
            "datatrove file without its .ds.index",
            f.path,
            where=".ds.index",
            expected="an index file",
            found="none",
            hint="document boundaries are needed; rerun the datatrove tokenizer with save_index=True",
        )
    isize = as_path(index).stat().st_size
    if isize % INDEX_ENTRY_BYTES:
        raise _err(
            ".ds.index size is not a multiple of 8",
            index,
            where="size",
            expected="uint64 entries",
            found=f"{isize} bytes",
            hint="the index is truncated",
        )
    count = isize // INDEX_ENTRY_BYTES
    prev = max((int(ends[-1]) for _, ends in _index_chunks(index, count)), default=0)  # the last entry
    if prev != tokens:
        raise _err(
            ".ds.index last entry differs from the token count",
            index,
            where=f"entry {count - 1}" if count else "end",
            expected=tokens,
            found=prev,
            hint="the .ds or its index is truncated, or they come from different runs",
        )
    recorded = f.extra.get("recorded")
    if recorded is not None and recorded != tokens:
        # datatrove writes the count at close: a .ds and .ds.index cut at one document's end
        # (a copy stopped short) agree with each other, and only this count shows the loss
        raise _err(
            ".ds token count differs from its .ds.metadata",
            f.path,
            where="tokens",
            expected=f"{recorded} (line 2 of {as_path(f.path).name}.metadata)",
            found=tokens,
            hint="the .ds and its .ds.index are truncated, or the .ds.metadata belongs to another file",
        )
    loss_size = as_path(f.extra["loss"]).stat().st_size if f.extra.get("loss") else tokens
    if loss_size != tokens:
        raise _err(
            ".ds.loss size differs from the token count",
            f.extra["loss"],
            where="size",
            expected=f"{tokens} bytes",
            found=f"{loss_size} bytes",
        )


def _index_chunks(index, count: int) -> Iterator[tuple[int, np.ndarray]]:
    """(first entry, entries as int64) of `index`, INDEX_CHUNK at a time, each checked increasing."""
    prev = 0
    for start in range(0, count, INDEX_CHUNK):
        ends = read_array(index, U64, min(INDEX_CHUNK, count - start), start * INDEX_ENTRY_BYTES, user=True)
        # an entry past int64 turns negative here: the first such is caught as not increasing
        bad = np.flatnonzero(np.diff(ends.astype(np.int64), prepend=np.int64(prev)) <= 0)
        if len(bad):
            i = int(bad[0])
            before = prev if i == 0 else int(ends[i - 1])
            raise _err(
                ".ds.index does not increase",
                index,
                where=f"entry {start + i}",
                expected=f"> {before}",
                found=int(ends[i]),
                hint="document ends must be strictly increasing; the index is corrupt",
            )
        prev = int(ends[-1])
        yield start, ends.astype(np.int64)


def datatrove_blocks(f: InputFile, block_tokens: int) -> Iterator[Block]:
    dtype = np.dtype(f.dtype).newbyteorder("<")
    count = as_path(f.extra["index"]).stat().st_size // INDEX_ENTRY_BYTES
    has_loss = bool(f.extra.get("loss"))

    def plan():  # (tokens, (ends, first document, token offset)) per block; runs in the read-ahead thread
        prev = 0  # token end of the previous document
        for start, ends in _index_chunks(f.extra["index"], count):
            i = 0
            while i < len(ends):
                j = max(int(np.searchsorted(ends, prev + block_tokens, side="right")), i + 1)
                yield int(ends[j - 1]) - prev, (ends[i:j] - prev, start + i, prev)
                prev = int(ends[j - 1])
                i = j

    with open_read(f.path, user=True) as ds, open_read(f.extra["loss"], user=True) if has_loss else nullcontext() as lf:

        def fill(slot, n, meta):
            tokens = read_exact(ds, slot[0].ensure(n)[:n], f.path, meta[2])
            return tokens, read_exact(lf, slot[1].ensure(n)[:n], f.extra["loss"], meta[2]) if has_loss else None

        slots = [(take_buffer(dtype), take_buffer(np.uint8)) for _ in range(2)]
        ahead = read_ahead(plan(), fill, slots)
        try:
            for (tokens, loss), (ends, first, offset) in ahead:
                yield Block(tokens, ends, loss, first, offset)
        finally:
            ahead.close()  # stops the read-ahead thread before the files close and the buffers go back
            give_buffers([b for slot in slots for b in slot])
