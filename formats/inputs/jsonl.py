"""JSON lines (optionally gzipped): a list of token ids per line, bare or under a key, or raw
text under a key."""

from __future__ import annotations

import gzip
import io
import json
import zlib
from contextlib import closing
from itertools import chain
from typing import Iterator

import numpy as np

from ..io.gate import open_read
from . import Block, InputFile, input_error as _err

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".ndjson")


def _open_text(path):
    binary = io.BufferedReader(open_read(path, user=True))  # a user's input: the regular-file rule only
    return (
        gzip.open(binary, "rt", encoding="utf-8")
        if str(path).endswith(".gz")
        else io.TextIOWrapper(binary, encoding="utf-8")
    )


def _lines(path) -> Iterator[str]:
    """The text lines of `path`. A gzip stream cut short or damaged, or bytes that are not UTF-8,
    are the input's fault: one line naming it and the line it stopped at, not a crash."""
    n = 0
    with _open_text(path) as fh:
        try:
            for n, line in enumerate(fh, 1):
                yield line
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise _err(
                "damaged gzip stream",
                path,
                where=f"after line {n}",
                expected="a complete gzip file",
                found=str(e),
                hint="the file is truncated or corrupt (or not gzip): copy or write it again",
            ) from None
        except UnicodeDecodeError as e:
            raise _err(
                "not UTF-8 text",
                path,
                where=f"after line {n}",  # decoded a chunk at a time: somewhere past the lines read
                expected="UTF-8 JSON lines",
                found=f"{e.reason} ({e.object[e.start : e.start + 4]!r})",
                hint="the file is not JSON lines, or not UTF-8: convert it to UTF-8",
            ) from None


def jsonl_file(path, want: str, column: str | None) -> tuple[str, list[InputFile]]:
    with closing(_lines(path)) as lines:
        first = next((line for line in lines if line.strip()), None)
    token_key, text_key = column or "input_ids", column or "text"
    fmt = "jsonl"
    if first is not None:
        try:
            obj = json.loads(first)
        except json.JSONDecodeError as e:
            raise _err(
                "invalid JSON", path, where="first line", expected="one JSON object per line", found=str(e)
            ) from None
        is_text = (
            isinstance(obj, dict) and isinstance(obj.get(text_key), str) and not isinstance(obj.get(token_key), list)
        )
        fmt = "text" if want == "text" or (want == "auto" and is_text) else "jsonl"
        if fmt == "jsonl" and not (isinstance(obj, list) or (isinstance(obj, dict) and token_key in obj)):
            raise _err(
                "JSONL key not found",
                path,
                where=f"line 1, key {token_key!r}",
                expected=f"a list under {token_key!r}",
                found=f"keys {list(obj)[:8]}" if isinstance(obj, dict) else type(obj).__name__,
                hint="pass --column with the key holding the token ids",
            )
    if fmt == "text":
        return "text", [
            InputFile(str(path), "text", None, path.stat().st_size, column=text_key, extra={"container": "jsonl"})
        ]
    return "jsonl", [InputFile(str(path), "jsonl", None, path.stat().st_size, column=token_key)]


def jsonl_blocks(f: InputFile, block_tokens: int) -> Iterator[Block]:
    lists: list[list] = []
    lines: list[int] = []  # the line number of each list, for messages
    pending = 0  # tokens in `lists`
    doc = offset = 0
    literals = False  # a line of the block spells true/false, which numpy would take as ids 1/0
    with closing(_lines(f.path)) as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise _err(
                    "invalid JSON", f.path, where=f"line {line_no}", expected="a JSON object", found=str(e)
                ) from None
            ids = obj if isinstance(obj, list) else obj.get(f.column) if isinstance(obj, dict) else None
            if not isinstance(ids, list):
                raise _err(
                    "JSONL line has no token list",
                    f.path,
                    where=f"line {line_no}, key {f.column!r}",
                    expected="a list of token ids",
                    found="no such key"
                    if isinstance(obj, dict) and f.column not in obj
                    else type(ids if isinstance(obj, dict) else obj).__name__,
                    hint="pass --column with the key holding the token ids",
                )
            lists.append(ids)
            lines.append(line_no)
            literals = literals or "true" in line or "false" in line
            pending += len(ids)
            if pending >= block_tokens:
                yield _jsonl_block(f, lists, lines, doc, offset, literals)
                doc += len(lists)
                offset += pending
                lists, lines, pending, literals = [], [], 0, False
    if lists:
        yield _jsonl_block(f, lists, lines, doc, offset, literals)


def _jsonl_block(f: InputFile, lists: list[list], lines: list[int], doc: int, offset: int, literals: bool) -> Block:
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    flat = list(chain.from_iterable(lists))
    try:
        tokens = np.array(flat) if flat else np.zeros(0, np.int64)
    except ValueError:  # nested lists of unequal lengths; found below
        tokens = None
    if literals or tokens is None or tokens.dtype.kind not in "iu" or tokens.ndim != 1:
        for k, ids in enumerate(lists):
            for pos, v in enumerate(ids):
                if not isinstance(v, int) or isinstance(v, bool) or not -(1 << 63) <= v < (1 << 64):
                    raise _err(
                        "token id is not a 64-bit integer",
                        f.path,
                        where=f"line {lines[k]} (document {doc + k}), position {pos}",
                        expected="an integer in [-2^63, 2^64)",
                        found=repr(v)[:40],
                    )
    if tokens.dtype.kind not in "iu" or tokens.ndim != 1:  # ids each in range, but no one dtype holds them all
        raise _err(
            "token ids do not fit one integer type",
            f.path,
            where=f"lines {lines[0]}-{lines[-1]}",
            expected="ids in [0, 2^64)",
            found=f"ids from {min(flat)} to {max(flat)}",
        )
    return Block(tokens, np.cumsum(lengths), None, doc, offset)
