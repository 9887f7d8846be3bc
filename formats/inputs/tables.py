"""Parquet and Arrow IPC files (and HF `save_to_disk` directories): a list<int> token column,
or a string column of raw text."""

from __future__ import annotations

import os
from typing import Iterator

import numpy as np

from ..errors import TokpackError
from ..io.paths import is_url
from ..io.gate import open_read
from ..io.reads import read_ahead
from . import Block, InputFile, input_error as _err

TABLE_ROWS = 8192  # Parquet/Arrow rows per record batch
PARQUET_READ_BYTES = 8 << 20  # Parquet column data is read in pieces of this size
# Decoding a list column takes one core per row group (BENCHMARKS.md, "Parquet decoding"), so
# row groups are decoded this many at a time, ahead of the packer...
PARQUET_DECODE_THREADS = max(1, min(4, os.cpu_count() or 1))
# ...when each is at most this large (in memory): decoding one holds about 6x its size (values,
# repetition and definition levels, the read buffer), so this many are held at once.
PARQUET_PARALLEL_GROUP_BYTES = 128 << 20
ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")


def _arrow_kind(path) -> str:
    with open_read(path, 1 << 16, user=True) as fh:
        return "file" if fh.read(6) == b"ARROW1" else "stream"


def _open_table(path, kind: str):
    """What pyarrow reads: a local path as it is (pyarrow's own reads; Arrow IPC memory-mapped),
    a URL as an fsspec file read in PARQUET_READ_BYTES ranges."""
    import pyarrow as pa

    if is_url(path):
        return open_read(path, PARQUET_READ_BYTES, user=True)
    return str(path) if kind == "parquet" else pa.memory_map(str(path))


def _table_schema(path, kind: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind == "parquet":
        return pq.read_schema(_open_table(path, kind))
    layout = _arrow_kind(path)  # before the open below: an in-memory fsspec filesystem shares one file object
    with _open_table(path, kind) as src:
        return (pa.ipc.open_file(src) if layout == "file" else pa.ipc.open_stream(src)).schema


def table_file(path, kind: str, want: str, column: str | None) -> tuple[str, list[InputFile]]:
    import pyarrow as pa

    try:
        schema = _table_schema(path, kind)
    except (pa.ArrowInvalid, OSError) as e:
        raise _err(f"unreadable {kind} file", path, expected=f"a {kind} file", found=str(e).splitlines()[0]) from None
    text_col = column or "text"
    token_col = column or "input_ids"
    if want == "text" or (
        want == "auto"
        and token_col not in schema.names
        and text_col in schema.names
        and _is_string(schema.field(text_col).type)
    ):
        if text_col not in schema.names:
            raise _missing_column(path, text_col, schema.names)
        if not _is_string(schema.field(text_col).type):
            raise _err(
                "text column is not a string column",
                path,
                where=f"column {text_col!r}",
                expected="string",
                found=str(schema.field(text_col).type),
                hint="pass --column with the text column",
            )
        return "text", [
            InputFile(str(path), "text", None, path.stat().st_size, column=text_col, extra={"container": kind})
        ]
    if token_col not in schema.names:
        raise _missing_column(path, token_col, schema.names)
    typ = schema.field(token_col).type
    listed = pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ)
    if not listed or not pa.types.is_integer(typ.value_type):
        raise _err(
            "column is not a list of integers",
            path,
            where=f"column {token_col!r}",
            expected="list<int>",
            found=str(typ),
            hint="pass --column with the token-id column",
        )
    name = np.dtype(typ.value_type.to_pandas_dtype()).name
    return "parquet", [InputFile(str(path), kind, name, path.stat().st_size, column=token_col)]


def parquet_values(f: InputFile) -> int | None:
    """The token ids a Parquet file's list column holds, from its footer alone: the row groups'
    value counts of the column's leaf (an empty or null list counts one there, so it is an
    estimate, over by the empty documents). None for another container, or a text column."""
    import pyarrow.parquet as pq

    if f.format != "parquet":
        return None
    meta = pq.ParquetFile(_open_table(f.path, "parquet")).metadata
    leaves = [j for j in range(meta.num_columns) if meta.schema.column(j).path.split(".")[0] == f.column]
    if len(leaves) != 1:
        return None
    return sum(meta.row_group(g).column(leaves[0]).num_values for g in range(meta.num_row_groups))


def table_rows(f: InputFile) -> int | None:
    """The rows (documents) a Parquet file holds, from its footer alone (tokenizing its text shows
    progress against it); None for another container."""
    import pyarrow.parquet as pq

    if f.extra.get("container", f.format) != "parquet":
        return None
    return pq.ParquetFile(_open_table(f.path, "parquet")).metadata.num_rows


def _missing_column(path, col, names) -> TokpackError:
    return _err(
        "column not found",
        path,
        where=f"column {col!r}",
        expected=col,
        found=f"columns {list(names)}",
        hint="pass --column with the right column name",
    )


def _is_string(typ) -> bool:
    import pyarrow as pa

    return pa.types.is_string(typ) or pa.types.is_large_string(typ)


def iter_record_batches(f: InputFile, columns: list[str]):
    """The file's record batches, one at a time (Parquet row batches; Arrow IPC memory-mapped)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    kind = f.extra.get("container", f.format)
    if kind == "parquet":
        # pyarrow's default pre-buffering reads ahead across row groups (a 512 MB file peaked at
        # 717 MB of Arrow memory); a buffered stream decodes one row group with 8 MiB reads
        # (186 MB for the same file: a row group's values plus its levels).
        def reader():
            return pq.ParquetFile(_open_table(f.path, kind), pre_buffer=False, buffer_size=PARQUET_READ_BYTES)

        pf = reader()
        groups = pf.num_row_groups
        largest = max((pf.metadata.row_group(i).total_byte_size for i in range(groups)), default=0)
        if PARQUET_DECODE_THREADS < 2 or groups < 2 or largest > PARQUET_PARALLEL_GROUP_BYTES:
            yield from pf.iter_batches(batch_size=TABLE_ROWS, columns=columns)
            return

        def decode(_slot, _n, group: int) -> list:  # a reader per call: one ParquetFile is not shared by threads
            return list(
                reader().iter_batches(batch_size=TABLE_ROWS, row_groups=[group], columns=columns, use_threads=False)
            )

        ahead = read_ahead(
            ((1, g) for g in range(groups)), decode, [None] * PARQUET_DECODE_THREADS, threads=PARQUET_DECODE_THREADS
        )
        try:
            for batches, _ in ahead:
                yield from batches
        finally:
            ahead.close()
        return
    layout = _arrow_kind(f.path)
    with _open_table(f.path, kind) as src:
        if layout == "file":
            reader = pa.ipc.open_file(src)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i).select(columns)
        else:
            for batch in pa.ipc.open_stream(src):
                yield batch.select(columns)


def _decoded(f: InputFile, batches: Iterator, row: int):
    """The next of `batches`, or None at the end. pyarrow's words for damaged data (ArrowInvalid,
    or an OSError with no errno: 'Corrupt snappy compressed data') are the file's fault: one line
    naming it; an OSError with an errno is this machine's and stays what it is."""
    import pyarrow as pa

    try:
        return next(batches, None)
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, OSError) and e.errno is not None:
            raise
        kind = f.extra.get("container", f.format)
        raise _err(
            f"unreadable {kind} data",
            f.path,
            where=f"after row {row}",
            expected=f"a readable {kind} file",
            found=str(e).splitlines()[0].rstrip(".") if str(e) else type(e).__name__,
            hint="the file is corrupt or truncated: write or copy it again",
        ) from None


def table_blocks(f: InputFile, block_tokens: int) -> Iterator[Block]:
    import pyarrow.compute as pc

    row = offset = 0
    batches = iter_record_batches(f, [f.column])
    while (batch := _decoded(f, batches, row)) is not None:
        col = batch.column(0)
        lengths = pc.list_value_length(col).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        values = pc.list_flatten(col)
        if values.null_count:  # named by its row, which does not depend on how the file is batched
            first = pc.list_parent_indices(col)[pc.index(values.is_null(), True).as_py()].as_py()
            raise _err(
                "null token id in a list",
                f.path,
                where=f"column {f.column!r}, row {row + first}",
                expected="integers",
                found="null",
                hint="drop or fill the nulls before packing",
            )
        tokens = values.to_numpy(zero_copy_only=False)
        ends = np.cumsum(lengths)
        yield Block(tokens, ends, None, row, offset)
        row += len(col)
        offset += len(tokens)
