"""Megatron indexed datasets: `.bin` tokens and the `.idx` index (MMIDIDX) of sequence sizes,
pointers and document boundaries."""

from __future__ import annotations

import struct
from typing import Iterator

import numpy as np

from ..io.paths import as_path
from ..io.memory import give_buffers, take_buffer
from ..io.gate import open_read, read_array
from ..io.reads import read_ahead
from . import INDEX_CHUNK, Block, InputFile, input_error as _err, read_exact, token_count

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_HEADER = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + document count 8
# megatron.core.datasets.indexed_dataset.DType: every code Megatron defines.
MEGATRON_DTYPES = {
    1: np.dtype("<u1"),
    2: np.dtype("<i1"),
    3: np.dtype("<i2"),
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    6: np.dtype("<f8"),
    7: np.dtype("<f4"),
    8: np.dtype("<u2"),
}


def megatron_file(bin_path) -> InputFile:
    idx = bin_path.with_suffix(".idx")
    head = read_array(idx, np.uint8, MEGATRON_HEADER, user=True).tobytes()
    if head[:9] != MEGATRON_MAGIC:
        raise _err(
            "not a Megatron index: wrong magic",
            idx,
            where="byte 0",
            expected=repr(MEGATRON_MAGIC),
            found=repr(head[:9]),
            hint="pass the .idx written with the .bin (Megatron's MMIDIDX format)",
        )
    if len(head) < MEGATRON_HEADER:
        raise _err(
            "Megatron index header is truncated",
            idx,
            where="header",
            expected=f"{MEGATRON_HEADER} bytes",
            found=f"{len(head)} bytes",
            hint="the index is truncated or corrupt",
        )
    version, code, sequences, documents = struct.unpack("<QBQQ", head[9:])
    if version != 1:
        raise _err("unsupported Megatron index version", idx, where="byte 9 (version)", expected=1, found=version)
    if code not in MEGATRON_DTYPES:
        raise _err(
            "unknown Megatron dtype code",
            idx,
            where="byte 17 (dtype code)",
            expected="1-8 (uint8 int8 int16 int32 int64 float64 float32 uint16)",
            found=code,
        )
    size = bin_path.stat().st_size + idx.stat().st_size
    return InputFile(
        str(bin_path),
        "megatron",
        MEGATRON_DTYPES[code].name,
        size,
        extra={"idx": str(idx), "sequences": sequences, "documents": documents},
    )


def _megatron_layout(f: InputFile) -> tuple[int, int, int]:
    """Byte offsets in the .idx of the sizes, pointers and document indices arrays."""
    s = f.extra["sequences"]
    return MEGATRON_HEADER, MEGATRON_HEADER + 4 * s, MEGATRON_HEADER + 12 * s


def check_megatron(f: InputFile) -> None:
    idx, seqs, docs = f.extra["idx"], f.extra["sequences"], f.extra["documents"]
    itemsize = np.dtype(f.dtype).itemsize
    expected = MEGATRON_HEADER + 12 * seqs + 8 * docs
    isize = as_path(idx).stat().st_size
    if isize not in (expected, expected + seqs):  # + one int8 mode per sequence in multimodal indexes
        raise _err(
            "Megatron .idx size does not match its counts",
            idx,
            where="size",
            expected=f"{expected} bytes for {seqs} sequences and {docs} document indices",
            found=f"{isize} bytes",
            hint="the index is truncated or corrupt",
        )
    bsize = token_count(f.path, f.dtype, "Megatron .bin", per_token="")[0]
    if docs < 1:
        raise _err("Megatron .idx has no document indices", idx, where="document count", expected=">= 1", found=docs)
    sizes_off, ptr_off, doc_off = _megatron_layout(f)
    for start in range(0, seqs, INDEX_CHUNK):
        n = min(INDEX_CHUNK, seqs - start)
        sizes = read_array(idx, "<i4", n, sizes_off + 4 * start, user=True).astype(np.int64)
        ptrs = read_array(idx, "<i8", n, ptr_off + 8 * start, user=True)
        bad = np.flatnonzero((sizes < 0) | (ptrs < 0) | (ptrs + sizes * itemsize > bsize))
        if len(bad):
            i = int(bad[0])
            raise _err(
                "Megatron sequence lies outside the .bin",
                idx,
                where=f"sequence {start + i}",
                expected=f"pointer >= 0, size >= 0, pointer + size*{itemsize} <= {bsize} (the .bin size)",
                found=f"pointer {int(ptrs[i])}, size {int(sizes[i])}",
                hint="the .bin is truncated or belongs to another .idx",
            )
    prev = 0
    for start in range(0, docs, INDEX_CHUNK):
        di = read_array(idx, "<i8", min(INDEX_CHUNK, docs - start), doc_off + 8 * start, user=True)
        if start == 0 and di[0] != 0:
            raise _err(
                "Megatron document indices do not start at 0",
                idx,
                where="document index 0",
                expected=0,
                found=int(di[0]),
            )
        bad = np.flatnonzero((np.diff(di, prepend=np.int64(prev)) < 0) | (di > seqs))
        if len(bad):
            i = int(bad[0])
            raise _err(
                "Megatron document indices decrease or exceed the sequence count",
                idx,
                where=f"document index {start + i}",
                expected=f"non-decreasing, <= {seqs}",
                found=int(di[i]),
            )
        prev = int(di[-1])
    if prev != seqs:
        raise _err(
            "Megatron document indices do not end at the sequence count",
            idx,
            where=f"document index {docs - 1}",
            expected=seqs,
            found=prev,
        )


def megatron_blocks(f: InputFile, block_tokens: int) -> Iterator[Block]:
    idx, docs = f.extra["idx"], f.extra["documents"] - 1
    dtype = np.dtype(f.dtype)
    itemsize = dtype.itemsize
    sizes_off, ptr_off, doc_off = _megatron_layout(f)

    def plan():  # (tokens, (first seq, last seq, sizes, pointers, ends, first document)); read-ahead thread
        for dstart in range(0, docs, INDEX_CHUNK):
            nd = min(INDEX_CHUNK, docs - dstart)
            di = read_array(idx, "<i8", nd + 1, doc_off + 8 * dstart, user=True)
            s0, s1 = int(di[0]), int(di[-1])
            sizes = read_array(idx, "<i4", s1 - s0, sizes_off + 4 * s0, user=True).astype(np.int64)
            ptrs = read_array(idx, "<i8", s1 - s0, ptr_off + 8 * s0, user=True)
            seq_cum = np.concatenate([[0], np.cumsum(sizes)])
            doc_ends = seq_cum[di[1:] - s0]  # token end of each document, relative to sequence s0
            i = 0
            while i < nd:
                base = int(seq_cum[di[i] - s0])
                j = max(int(np.searchsorted(doc_ends, base + block_tokens, side="right")), i + 1)
                a, b = int(di[i]) - s0, int(di[j]) - s0
                yield int(doc_ends[j - 1]) - base, (sizes[a:b], ptrs[a:b], doc_ends[i:j] - base, dstart + i)
                i = j

    with open_read(f.path, user=True) as fh:

        def fill(slot, n, meta):
            sizes, ptrs = meta[0], meta[1]
            out = slot.ensure(n)[:n]
            if n and (np.diff(ptrs) == sizes[:-1] * itemsize).all():  # sequences back to back in the .bin
                fh.seek(int(ptrs[0]))
                read_exact(fh, out, f.path, int(ptrs[0]) // itemsize)
            else:  # out of order: one read per sequence
                pos = 0
                for m, ptr in zip(sizes.tolist(), ptrs.tolist()):
                    fh.seek(ptr)
                    read_exact(fh, out[pos : pos + m], f.path, ptr // itemsize)
                    pos += m
            return out

        slots = [take_buffer(dtype) for _ in range(2)]
        ahead = read_ahead(plan(), fill, slots)
        try:
            for tokens, (sizes, ptrs, ends, first) in ahead:
                yield Block(tokens, ends, None, first, int(ptrs[0]) // itemsize if len(ptrs) else 0)
        finally:
            ahead.close()
            give_buffers(slots)
