"""Flat token streams: numpy `.npy` arrays and raw token files (given --dtype); documents end
after each EOS."""

from __future__ import annotations

from typing import Iterator

import numpy as np

from ..io.memory import Buffer
from ..io.gate import open_read
from . import Block, InputFile, input_error as _err, read_exact, token_count

RAW_DTYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64")


def npy_file(path) -> InputFile:
    with open_read(path, 1 << 16, user=True) as fh:
        try:
            version = np.lib.format.read_magic(fh)
            read_header = (
                np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read_header(fh)
        except ValueError as e:
            raise _err(
                "unreadable .npy header", path, where="header", expected="a numpy .npy file", found=str(e)
            ) from None
        offset = fh.tell()
    if dtype.kind not in "iu":
        raise _err(
            ".npy array is not of an integer type",
            path,
            where="dtype",
            expected="an integer dtype",
            found=dtype.name,
            hint="token ids must be integers",
        )
    if fortran and len(shape) > 1:
        raise _err(".npy array is in Fortran order", path, where="header", expected="C order", found="Fortran order")
    count = int(np.prod(shape, dtype=np.int64))
    expected = offset + count * dtype.itemsize
    size = path.stat().st_size
    if size != expected:
        raise _err(
            ".npy size does not match its header",
            path,
            where="size",
            expected=f"{expected} bytes",
            found=f"{size} bytes",
            hint="the file is truncated",
        )
    return InputFile(
        str(path),
        "numpy",
        dtype.newbyteorder("=").name,
        size,
        extra={"offset": offset, "count": count, "byteorder": dtype.str},
    )


def raw_file(path, dtype: str | None) -> InputFile:
    if dtype not in RAW_DTYPES:
        raise _err(
            "raw token file needs --dtype" if dtype is None else "raw token file needs an integer --dtype",
            path,
            where="--dtype",
            expected=" | ".join(RAW_DTYPES),
            found=dtype,
            hint="pass --dtype with the width the tokens were written in",
        )
    size, count = token_count(path, dtype, "raw token file")
    return InputFile(
        str(path),
        "raw",
        dtype,
        size,
        extra={"offset": 0, "count": count, "byteorder": np.dtype(dtype).newbyteorder("<").str},
    )


def eos_split_blocks(f: InputFile, block_tokens: int, eos_id: int) -> Iterator[Block]:
    """Documents end after each EOS; tokens after the last EOS form a final document."""
    dtype = np.dtype(f.extra["byteorder"])
    count = f.extra["count"]
    buf = Buffer(dtype)  # private: it carries a partial document between blocks
    buf.ensure(min(block_tokens, max(count, 1)))
    carry = 0  # tokens at the front of the buffer: a document not yet ended
    pos = 0  # tokens read from the file
    doc = offset = 0
    with open_read(f.path, user=True) as fh:
        fh.seek(f.extra["offset"])
        while pos < count or carry:
            if pos < count:
                if carry == len(buf.array):  # one document longer than the buffer: grow it
                    buf.array = np.concatenate([buf.array, np.empty_like(buf.array)])
                n = min(len(buf.array) - carry, count - pos)
                read_exact(fh, buf.array[carry : carry + n], f.path, pos)
                pos += n
                total = carry + n
            else:
                total = carry
            tokens = buf.array[:total]
            ends = np.flatnonzero(tokens == eos_id) + 1
            if pos >= count and (len(ends) == 0 or ends[-1] != total):
                ends = np.append(ends, total)
            if len(ends) == 0:
                carry = total
                continue
            last = int(ends[-1])
            yield Block(tokens[:last], ends, None, doc, offset)
            carry = total - last
            if carry:
                buf.array[:carry] = buf.array[last:total].copy()
            doc += len(ends)
            offset += last
