"""JSON lines (optionally gzipped): a list of token ids per line, bare or under a key, or raw
text under a key."""

from __future__ import annotations

import gzip
import io
import json
from itertools import chain
from typing import Iterator

import numpy as np

from ..io import is_url, open_read
from . import Block, InputFile, input_error as _err

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".ndjson")


def _open_text(path):
    binary = io.BufferedReader(open_read(path)) if is_url(path) else path
    return gzip.open(binary, "rt", encoding="utf-8") if str(path).endswith(".gz") else \
        io.TextIOWrapper(binary, encoding="utf-8") if is_url(path) else open(path, encoding="utf-8")


def jsonl_file(path, want: str, column: str | None) -> tuple[str, list[InputFile]]:
    first = None
    with _open_text(path) as fh:
        for line in fh:
            if line.strip():
                first = line
                break
    token_key, text_key = column or "input_ids", column or "text"
    fmt = "jsonl"
    if first is not None:
        try:
            obj = json.loads(first)
        except json.JSONDecodeError as e:
            raise _err("invalid JSON", path, where="first line", expected="one JSON object per line", found=str(e)) from None
        is_text = isinstance(obj, dict) and isinstance(obj.get(text_key), str) and not isinstance(obj.get(token_key), list)
        fmt = "text" if want == "text" or (want == "auto" and is_text) else "jsonl"
        if fmt == "jsonl" and not (isinstance(obj, list) or (isinstance(obj, dict) and token_key in obj)):
            raise _err("JSONL key not found", path, where=f"line 1, key {token_key!r}", expected=f"a list under {token_key!r}",
                       found=f"keys {list(obj)[:8]}" if isinstance(obj, dict) else type(obj).__name__,
                       hint="pass --column with the key holding the token ids")
    if fmt == "text":
        return "text", [InputFile(str(path), "text", None, path.stat().st_size, column=text_key,
                                  extra={"container": "jsonl"})]
    return "jsonl", [InputFile(str(path), "jsonl", None, path.stat().st_size, column=token_key)]


def jsonl_blocks(f: InputFile, block_tokens: int) -> Iterator[Block]:
    lists: list[list] = []
    pending = 0  # tokens in `lists`
    doc = offset = 0
    first_line = 1
    with _open_text(f.path) as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise _err("invalid JSON", f.path, where=f"line {line_no}", expected="a JSON object", found=str(e)) from None
            ids = obj if isinstance(obj, list) else obj.get(f.column) if isinstance(obj, dict) else None
            if not isinstance(ids, list):
                raise _err("JSONL line has no token list", f.path, where=f"line {line_no}, key {f.column!r}",
                           expected="a list of token ids", found=type(ids).__name__ if ids is not None else "no such key",
                           hint="pass --column with the key holding the token ids")
            if not lists:
                first_line = line_no
            lists.append(ids)
            pending += len(ids)
            if pending >= block_tokens:
                yield _jsonl_block(f, lists, doc, offset, first_line)
                doc += len(lists)
                offset += pending
                lists, pending = [], 0
    if lists:
        yield _jsonl_block(f, lists, doc, offset, first_line)


def _jsonl_block(f: InputFile, lists: list[list], doc: int, offset: int, first_line: int) -> Block:
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    flat = list(chain.from_iterable(lists))
    tokens = np.array(flat) if flat else np.zeros(0, np.int64)
    if tokens.dtype.kind not in "iu" or tokens.ndim != 1:
        for k, ids in enumerate(lists):
            for pos, v in enumerate(ids):
                if not isinstance(v, int) or isinstance(v, bool) or not -(1 << 63) <= v < (1 << 64):
                    raise _err("token id is not an integer", f.path,
                               where=f"document {doc + k} (from line {first_line}), position {pos}",
                               expected="an integer", found=repr(v)[:40])
        raise _err("token ids are not integers", f.path, where=f"lines from {first_line}", expected="integers",
                   found=str(tokens.dtype))
    return Block(tokens, np.cumsum(lengths), None, doc, offset)
