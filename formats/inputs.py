"""Input readers for `pack`: datatrove folders, Megatron .bin/.idx, Parquet/Arrow (and HF
`save_to_disk` directories), numpy token arrays, raw token files and JSONL token lists.

Every reader streams: it yields `Block`s of whole documents, a few tens of MiB each, read
into one reused buffer, so memory does not depend on the input's size (only a single
document larger than a block is held whole). `check_input` runs the structural checks that
need no token scan (sizes, headers, indexes, schemas) so `pack` can refuse a bad input
before it writes anything; `Normalizer` does the token checks (ids in range, no negatives),
drops empty documents and appends missing EOS, vectorised over a whole block.

Raw text is not read here: `pack` tokenizes it with datatrove's DocumentTokenizer into a
datatrove folder, which is then read like any other.
"""

from __future__ import annotations

import gzip
import json
import os
import struct
import threading
import weakref
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Iterator

import numpy as np

from .errors import TokpackError
from .manifest import MANIFEST, TMP_MARK, parse_metadata_text

FORMATS = ("datatrove", "megatron", "parquet", "numpy", "jsonl", "text")
# Input bytes per block: big enough for sequential I/O and to amortise per-block numpy
# calls, small enough that its buffer stays in cache-friendly, already-faulted memory
# (touching fresh pages costs 2-3 s/GiB on these VMs, so buffers are reused per process).
BLOCK_BYTES = 16 << 20
INDEX_CHUNK = 1 << 20  # index entries (documents/sequences) loaded at a time
TABLE_ROWS = 8192  # Parquet/Arrow rows per record batch
PARQUET_READ_BYTES = 8 << 20  # Parquet column data is read in pieces of this size

_FREE_BUFFERS: dict = {}  # dtype -> [_Buffer]: reusable buffers that no live reader holds
_FREE_LOCK = threading.Lock()
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
RAW_DTYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64")
EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
# Hub tokenizers whose EOS id and vocabulary are fixed facts: datatrove metadata names them
# (its default is "gpt2") and tokpack never downloads, so without this they could not be used.
KNOWN_TOKENIZERS = {
    name: {"eos_id": 50256, "eos_token": "<|endoftext|>", "vocab_size": 50257}
    for name in ("gpt2", "openai-community/gpt2")
}
JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".ndjson")
ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")


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


def _err(message, path, **kw) -> TokpackError:
    return TokpackError(message, file=str(path), **kw)


# ------------------------------------------------------------------------ discovery


def discover(inputs: list[str], input_format: str = "auto", column: str | None = None,
             dtype: str | None = None) -> tuple[str, list[InputFile]]:
    """Expands INPUT paths into input files, in order, and tells their format.
    Returns (format, files); `format` is one of FORMATS."""
    if not inputs:
        raise TokpackError("no input given", hint="pass one or more files or directories")
    found: list[tuple[str, list[InputFile]]] = []
    for item in inputs:
        fmt, files = _discover_one(Path(item), input_format, column, dtype)
        found.append((fmt, files))
    formats = {fmt for fmt, _ in found}
    if len(formats) > 1:
        kinds = ", ".join(f"{item} is {fmt}" for item, (fmt, _) in zip(inputs, found))
        raise TokpackError("inputs of different formats in one pack", where="INPUT", expected="one format",
                           found=kinds, hint="pack each format into its own source, then shuffle them together")
    files = [f for _, fs in found for f in fs]
    if not files:
        raise TokpackError("no input files found", file=", ".join(inputs), expected="at least one file",
                           found="nothing", hint="check the paths and --format")
    _check_dtype_option(files, dtype)
    _check_consistent(files)
    return formats.pop(), files


def _discover_one(path: Path, want: str, column, dtype) -> tuple[str, list[InputFile]]:
    if not path.exists():
        if Path(f"{path}.bin").exists() and Path(f"{path}.idx").exists() and want in ("auto", "megatron"):
            return "megatron", [_megatron_file(Path(f"{path}.bin"))]
        raise _err("no such input", path, hint="give a file, a directory or a Megatron path prefix")
    if path.is_dir():
        return _discover_dir(path, want, column, dtype)
    name = path.name
    if want in ("auto", "datatrove") and name.endswith(".ds"):
        return "datatrove", [_datatrove_file(path, dtype)]
    if want in ("auto", "megatron") and path.suffix in (".bin", ".idx") and path.with_suffix(".idx").exists() \
            and path.with_suffix(".bin").exists():
        return "megatron", [_megatron_file(path.with_suffix(".bin"))]
    if want in ("auto", "parquet", "text") and path.suffix == ".parquet":
        return _table_file(path, "parquet", want, column)
    if want in ("auto", "parquet", "text") and path.suffix in ARROW_SUFFIXES:
        return _table_file(path, "arrow", want, column)
    if want in ("auto", "numpy") and path.suffix == ".npy":
        return "numpy", [_npy_file(path)]
    if want in ("auto", "jsonl", "text") and name.endswith(JSONL_SUFFIXES):
        return _jsonl_file(path, want, column)
    if want == "numpy" or (want == "auto" and dtype):
        return "numpy", [_raw_file(path, dtype)]
    raise _err("cannot tell the input format", path, expected="a known format for --format " + want,
               found=f"a file named {name!r}",
               hint="pass --format (and --dtype for raw token files), or rename the file with its usual extension")


def _discover_dir(path: Path, want, column, dtype) -> tuple[str, list[InputFile]]:
    files = sorted(p for p in path.iterdir() if p.is_file() and TMP_MARK not in p.name)
    names = [p.name for p in files]
    if want in ("auto", "datatrove") and any(n.endswith(".ds") for n in names):
        # the order datatrove's own readers use (DataFolder.list_files sorts names)
        return "datatrove", [_datatrove_file(p, dtype) for p in files if p.name.endswith(".ds")]
    idx = {p.stem for p in files if p.suffix == ".idx"}
    bins = [p for p in files if p.suffix == ".bin" and p.stem in idx]
    if want in ("auto", "megatron") and bins:
        return "megatron", [_megatron_file(p) for p in bins]
    if (path / "dataset_dict.json").exists():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits")
        raise _err("a DatasetDict holds several splits", path, expected="one split's directory", found=splits,
                   hint=f"pass one split, e.g. {path / (splits or ['train'])[0]}")
    arrows = [p for p in files if p.suffix in ARROW_SUFFIXES]
    if want in ("auto", "parquet", "text") and (path / "state.json").exists() and arrows:
        state = json.loads((path / "state.json").read_text())
        listed = [path / d["filename"] for d in state.get("_data_files", [])]
        arrows = [p for p in listed if p.exists()] if listed else arrows
        fmt, out = None, []
        for p in arrows:
            fmt, fs = _table_file(p, "arrow", want, column)
            out += fs
        return fmt, out
    for suffixes, fmt_name in (((".parquet",), "parquet"), (ARROW_SUFFIXES, "arrow")):
        chosen = [p for p in files if p.suffix in suffixes]
        if want in ("auto", "parquet", "text") and chosen:
            fmt, out = None, []
            for p in chosen:
                fmt, fs = _table_file(p, fmt_name, want, column)
                out += fs
            return fmt, out
    if want in ("auto", "numpy") and any(p.suffix == ".npy" for p in files):
        return "numpy", [_npy_file(p) for p in files if p.suffix == ".npy"]
    jsonl = [p for p in files if p.name.endswith(JSONL_SUFFIXES) and p.name != MANIFEST]
    if want in ("auto", "jsonl", "text") and jsonl:
        fmt, out = None, []
        for p in jsonl:
            fmt, fs = _jsonl_file(p, want, column)
            out += fs
        return fmt, out
    if want == "numpy" and dtype:
        return "numpy", [_raw_file(p, dtype) for p in files]
    raise _err("no input files of a known format in directory", path,
               expected="*.ds, *.bin+*.idx, *.parquet, *.arrow, *.npy or *.jsonl" if want == "auto" else want,
               found=f"{len(files)} files" + (f" ({', '.join(names[:4])}...)" if names else ""),
               hint="check the path, or pass --format")


def _check_dtype_option(files: list[InputFile], dtype: str | None) -> None:
    """--dtype describes raw token files; an input that records its own dtype must agree with
    it, since silently ignoring the option would hide a wrong assumption about the data."""
    if dtype is None:
        return
    try:
        given = np.dtype(dtype).name
    except TypeError:
        given = dtype
    for f in files:
        if f.dtype is None:
            raise _err(f"--dtype applies only to raw token files, not to {f.format} input", f.path, where="--dtype",
                       expected="no --dtype", found=dtype, hint="drop --dtype")
        if np.dtype(f.dtype).name != given:
            raise _err(f"--dtype differs from the dtype the {f.format} input records", f.path, where="--dtype",
                       expected=f.dtype, found=dtype, hint="drop --dtype, it is only for raw token files")


def _check_consistent(files: list[InputFile]) -> None:
    """One pack, one token type: files of different dtypes or tokenizers are refused."""
    first = files[0]
    for f in files[1:]:
        if f.dtype != first.dtype:
            raise _err("mixed token dtypes in one pack", f.path, where="dtype", expected=f"{first.dtype} (as in {first.path})",
                       found=f.dtype, hint="pack inputs of one dtype together, or convert them first")
        if f.tokenizer != first.tokenizer:
            raise _err("mixed vocabularies in one pack", f.path, where="tokenizer",
                       expected=f"{first.tokenizer} (as in {first.path})", found=f.tokenizer,
                       hint="inputs tokenized with different tokenizers cannot share one packed source")
    with_loss = {bool(f.extra.get("loss")) for f in files}
    if len(with_loss) > 1:
        missing = next(f for f in files if not f.extra.get("loss"))
        raise _err("some datatrove files have a .ds.loss and others do not", missing.path, where=".ds.loss",
                   expected="all or none", found="missing here", hint="pack them separately")


# -------------------------------------------------------------------- datatrove


def _datatrove_file(path: Path, dtype: str | None) -> InputFile:
    meta = Path(f"{path}.metadata")
    tokenizer = None
    if meta.exists():
        tokenizer, token_size, _ = parse_metadata_text(meta.read_text(), meta)
        if token_size not in (2, 4):
            raise _err("unsupported token size in datatrove metadata", meta, where="token_size",
                       expected="2 or 4", found=token_size)
        name = "uint16" if token_size == 2 else "uint32"
        if tokenizer.startswith("Unknown Tokenizer"):
            tokenizer = None
    elif dtype in ("uint16", "uint32"):
        name = dtype
    else:
        raise _err("datatrove file without .ds.metadata: token size unknown", path, where=".ds.metadata",
                   expected="a metadata file", found="none", hint="pass --dtype uint16 or --dtype uint32")
    loss = Path(f"{path}.loss")
    size = sum(os.path.getsize(p) for p in (path, Path(f"{path}.index"), loss) if p.exists())
    return InputFile(str(path), "datatrove", name, size, tokenizer=tokenizer,
                     extra={"index": f"{path}.index", "loss": str(loss) if loss.exists() else None})


def _check_datatrove(f: InputFile) -> None:
    itemsize = np.dtype(f.dtype).itemsize
    size = os.path.getsize(f.path)
    if size % itemsize:
        raise _err(".ds size is not a multiple of the token size", f.path, where="size",
                   expected=f"a multiple of {itemsize} bytes ({f.dtype})", found=f"{size} bytes",
                   hint="the file is truncated or its .ds.metadata names the wrong token size")
    tokens = size // itemsize
    index = f.extra["index"]
    if not os.path.exists(index):
        raise _err("datatrove file without its .ds.index", f.path, where=".ds.index", expected="an index file",
                   found="none", hint="document boundaries are needed; rerun the datatrove tokenizer with save_index=True")
    isize = os.path.getsize(index)
    if isize % 8:
        raise _err(".ds.index size is not a multiple of 8", index, where="size", expected="uint64 entries",
                   found=f"{isize} bytes", hint="the index is truncated")
    count = isize // 8
    prev = 0
    for start in range(0, count, INDEX_CHUNK):
        ends = np.fromfile(index, dtype="<u8", count=min(INDEX_CHUNK, count - start), offset=start * 8)
        _check_increasing(ends, prev, index, start)
        prev = int(ends[-1])
    if prev != tokens:
        raise _err(".ds.index last entry differs from the token count", index, where=f"entry {count - 1}" if count else "end",
                   expected=tokens, found=prev, hint="the .ds or its index is truncated, or they come from different runs")
    if f.extra.get("loss") and os.path.getsize(f.extra["loss"]) != tokens:
        raise _err(".ds.loss size differs from the token count", f.extra["loss"], where="size",
                   expected=f"{tokens} bytes", found=f"{os.path.getsize(f.extra['loss'])} bytes")


def _check_increasing(ends: np.ndarray, prev: int, index, start: int) -> None:
    bad = np.flatnonzero(np.diff(ends.astype(np.int64), prepend=np.int64(prev)) <= 0) if len(ends) else []
    if ends.dtype.kind == "u" and len(ends) and ends.max() > np.iinfo(np.int64).max:
        bad = [int(np.argmax(ends))]
    if len(bad):
        i = int(bad[0])
        before = prev if i == 0 else int(ends[i - 1])
        raise _err(".ds.index does not increase", index, where=f"entry {start + i}",
                   expected=f"> {before}", found=int(ends[i]),
                   hint="document ends must be strictly increasing; the index is corrupt")


def _datatrove_blocks(f: InputFile, block_tokens: int) -> Iterator[Block]:
    dtype = np.dtype(f.dtype).newbyteorder("<")
    count = os.path.getsize(f.extra["index"]) // 8
    has_loss = bool(f.extra.get("loss"))

    def plan():  # (tokens, (ends, first document, token offset)) per block; runs in the read-ahead thread
        prev = 0  # token end of the previous document
        for start in range(0, count, INDEX_CHUNK):
            ends = np.fromfile(f.extra["index"], dtype="<u8", count=min(INDEX_CHUNK, count - start),
                               offset=start * 8).astype(np.int64)
            _check_increasing(ends, prev, f.extra["index"], start)
            i = 0
            while i < len(ends):
                j = max(int(np.searchsorted(ends, prev + block_tokens, side="right")), i + 1)
                yield int(ends[j - 1]) - prev, (ends[i:j] - prev, start + i, prev)
                prev = int(ends[j - 1])
                i = j

    with open(f.path, "rb", buffering=0) as ds, (open(f.extra["loss"], "rb", buffering=0) if has_loss else _nullctx()) as lf:
        _sequential(ds)

        def fill(slot, n, meta):
            tokens = slot[0].read(ds, n, f.path, meta[2])
            return tokens, slot[1].read(lf, n, f.extra["loss"], meta[2]) if has_loss else None

        slots = [(_take_buffer(dtype), _take_buffer(np.uint8)) for _ in range(2)]
        ahead = read_ahead(plan(), fill, slots)
        try:
            for (tokens, loss), (ends, first, offset) in ahead:
                yield Block(tokens, ends, loss, first, offset)
        finally:
            ahead.close()  # stops the read-ahead thread before the files close and the buffers go back
            _give_buffers([b for slot in slots for b in slot])


def read_ahead(plan, fill, slots: list) -> Iterator[tuple]:
    """Reads block k+1 in a thread while the caller checks, hashes and writes block k, so the
    disk never waits for the CPU (file reads release the GIL). `plan` yields (n, meta);
    `fill(slot, n, meta)` reads n tokens into one of the `slots` (reused buffers) and returns
    the views. Yields (views, meta) in plan order; a view is valid until the next item."""
    import queue
    import threading

    free: queue.Queue = queue.Queue()
    ready: queue.Queue = queue.Queue()
    for slot in slots:
        free.put(slot)
    stop = threading.Event()

    def worker():
        try:
            for n, meta in plan:
                slot = free.get()
                if stop.is_set():
                    return
                ready.put((slot, fill(slot, n, meta), meta))
            ready.put(None)
        except BaseException as e:  # handed to the caller, raised there
            ready.put(e)

    thread = threading.Thread(target=worker, name="tokpack-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            item = ready.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            slot, views, meta = item
            yield views, meta
            free.put(slot)
    finally:
        stop.set()
        free.put(None)  # wakes a worker waiting for a free slot
        thread.join()


class _nullctx:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _take_buffer(dtype: np.dtype) -> "_Buffer":
    """A buffer the caller owns until it gives it back: two live readers never share one, and
    packing file after file reuses the same pages instead of touching new memory."""
    with _FREE_LOCK:
        free = _FREE_BUFFERS.get(np.dtype(dtype).str)
        if free:
            return free.pop()
    return _Buffer(dtype)


def _give_buffers(buffers) -> None:
    with _FREE_LOCK:
        for b in buffers:
            _FREE_BUFFERS.setdefault(b.dtype.str, []).append(b)


def _sequential(fh) -> None:
    """Tells the kernel to read ahead: the inputs are read once, front to back."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)


class _Buffer:
    """One reusable read buffer that grows only for a document larger than a block."""

    def __init__(self, dtype: np.dtype):
        self.dtype = np.dtype(dtype)  # element type of the views handed out
        self.array = np.empty(0, self.dtype)  # the storage, reused from block to block

    def ensure(self, n: int) -> np.ndarray:
        if len(self.array) < n:
            self.array = np.empty(max(n, 2 * len(self.array)), self.dtype)
        return self.array

    def read(self, fh, n: int, path, offset: int) -> np.ndarray:
        """Reads the next n elements of `fh` into the buffer and returns a view of them."""
        out = self.ensure(n)[:n]
        _readinto_exact(fh, memoryview(out.view(np.uint8)), path, offset)
        return out


def _readinto_exact(fh, view: memoryview, path, offset: int) -> None:
    while view.nbytes:
        got = fh.readinto(view)
        if not got:
            raise _err("file ended early", path, where=f"token {offset}", expected="more data", found="end of file",
                       hint="the file is truncated or changed while packing")
        view = view[got:]


# --------------------------------------------------------------------- megatron


def _megatron_file(bin_path: Path) -> InputFile:
    idx = bin_path.with_suffix(".idx")
    with open(idx, "rb") as fh:
        head = fh.read(MEGATRON_HEADER)
    if len(head) < MEGATRON_HEADER or head[:9] != MEGATRON_MAGIC:
        raise _err("not a Megatron index: wrong magic", idx, where="byte 0", expected=repr(MEGATRON_MAGIC),
                   found=repr(head[:9]), hint="pass the .idx written with the .bin (Megatron's MMIDIDX format)")
    version, code, sequences, documents = struct.unpack("<QBQQ", head[9:])
    if version != 1:
        raise _err("unsupported Megatron index version", idx, where="byte 9 (version)", expected=1, found=version)
    if code not in MEGATRON_DTYPES:
        raise _err("unknown Megatron dtype code", idx, where="byte 17 (dtype code)",
                   expected="1-8 (uint8 int8 int16 int32 int64 float64 float32 uint16)", found=code)
    size = os.path.getsize(bin_path) + os.path.getsize(idx)
    return InputFile(str(bin_path), "megatron", MEGATRON_DTYPES[code].name, size,
                     extra={"idx": str(idx), "code": code, "sequences": sequences, "documents": documents})


def _megatron_layout(f: InputFile) -> tuple[int, int, int]:
    """Byte offsets in the .idx of the sizes, pointers and document indices arrays."""
    s = f.extra["sequences"]
    return MEGATRON_HEADER, MEGATRON_HEADER + 4 * s, MEGATRON_HEADER + 12 * s


def _check_megatron(f: InputFile) -> None:
    idx, seqs, docs = f.extra["idx"], f.extra["sequences"], f.extra["documents"]
    itemsize = np.dtype(f.dtype).itemsize
    expected = MEGATRON_HEADER + 12 * seqs + 8 * docs
    isize = os.path.getsize(idx)
    if isize not in (expected, expected + seqs):  # + one int8 mode per sequence in multimodal indexes
        raise _err("Megatron .idx size does not match its counts", idx, where="size",
                   expected=f"{expected} bytes for {seqs} sequences and {docs} document indices",
                   found=f"{isize} bytes", hint="the index is truncated or corrupt")
    bsize = os.path.getsize(f.path)
    if bsize % itemsize:
        raise _err("Megatron .bin size is not a multiple of the token size", f.path, where="size",
                   expected=f"a multiple of {itemsize} ({f.dtype})", found=f"{bsize} bytes")
    if docs < 1:
        raise _err("Megatron .idx has no document indices", idx, where="document count", expected=">= 1", found=docs)
    sizes_off, ptr_off, doc_off = _megatron_layout(f)
    for start in range(0, seqs, INDEX_CHUNK):
        n = min(INDEX_CHUNK, seqs - start)
        sizes = np.fromfile(idx, dtype="<i4", count=n, offset=sizes_off + 4 * start).astype(np.int64)
        ptrs = np.fromfile(idx, dtype="<i8", count=n, offset=ptr_off + 8 * start)
        bad = np.flatnonzero((sizes < 0) | (ptrs < 0) | (ptrs + sizes * itemsize > bsize))
        if len(bad):
            i = int(bad[0])
            raise _err("Megatron sequence pointer past the end of the .bin", idx, where=f"sequence {start + i}",
                       expected=f"pointer + size*{itemsize} <= {bsize} (the .bin size)",
                       found=f"pointer {int(ptrs[i])}, size {int(sizes[i])}",
                       hint="the .bin is truncated or belongs to another .idx")
    prev = 0
    for start in range(0, docs, INDEX_CHUNK):
        di = np.fromfile(idx, dtype="<i8", count=min(INDEX_CHUNK, docs - start), offset=doc_off + 8 * start)
        if start == 0 and di[0] != 0:
            raise _err("Megatron document indices do not start at 0", idx, where="document index 0", expected=0,
                       found=int(di[0]))
        bad = np.flatnonzero((np.diff(di, prepend=np.int64(prev)) < 0) | (di > seqs))
        if len(bad):
            i = int(bad[0])
            raise _err("Megatron document indices decrease or exceed the sequence count", idx,
                       where=f"document index {start + i}", expected=f"non-decreasing, <= {seqs}", found=int(di[i]))
        prev = int(di[-1])
    if prev != seqs:
        raise _err("Megatron document indices do not end at the sequence count", idx, where=f"document index {docs - 1}",
                   expected=seqs, found=prev)


def _megatron_blocks(f: InputFile, block_tokens: int) -> Iterator[Block]:
    idx, docs = f.extra["idx"], f.extra["documents"] - 1
    dtype = np.dtype(f.dtype)
    itemsize = dtype.itemsize
    sizes_off, ptr_off, doc_off = _megatron_layout(f)

    def plan():  # (tokens, (first seq, last seq, sizes, pointers, ends, first document)); read-ahead thread
        for dstart in range(0, docs, INDEX_CHUNK):
            nd = min(INDEX_CHUNK, docs - dstart)
            di = np.fromfile(idx, dtype="<i8", count=nd + 1, offset=doc_off + 8 * dstart)
            s0, s1 = int(di[0]), int(di[-1])
            sizes = np.fromfile(idx, dtype="<i4", count=s1 - s0, offset=sizes_off + 4 * s0).astype(np.int64)
            ptrs = np.fromfile(idx, dtype="<i8", count=s1 - s0, offset=ptr_off + 8 * s0)
            seq_cum = np.concatenate([[0], np.cumsum(sizes)])
            doc_ends = seq_cum[di[1:] - s0]  # token end of each document, relative to sequence s0
            i = 0
            while i < nd:
                base = int(seq_cum[di[i] - s0])
                j = max(int(np.searchsorted(doc_ends, base + block_tokens, side="right")), i + 1)
                a, b = int(di[i]) - s0, int(di[j]) - s0
                yield int(doc_ends[j - 1]) - base, (sizes[a:b], ptrs[a:b], doc_ends[i:j] - base, dstart + i)
                i = j

    with open(f.path, "rb", buffering=0) as fh:
        _sequential(fh)

        def fill(slot, n, meta):
            sizes, ptrs = meta[0], meta[1]
            out = slot.ensure(n)[:n]
            if n and (np.diff(ptrs) == sizes[:-1] * itemsize).all():  # sequences back to back in the .bin
                fh.seek(int(ptrs[0]))
                _readinto_exact(fh, memoryview(out.view(np.uint8)), f.path, int(ptrs[0]) // itemsize)
            else:  # out of order: one read per sequence
                pos = 0
                for m, ptr in zip(sizes.tolist(), ptrs.tolist()):
                    fh.seek(ptr)
                    _readinto_exact(fh, memoryview(out[pos : pos + m].view(np.uint8)), f.path, ptr // itemsize)
                    pos += m
            return out

        slots = [_take_buffer(dtype) for _ in range(2)]
        ahead = read_ahead(plan(), fill, slots)
        try:
            for tokens, (sizes, ptrs, ends, first) in ahead:
                yield Block(tokens, ends, None, first, int(ptrs[0]) // itemsize if len(ptrs) else 0)
        finally:
            ahead.close()
            _give_buffers(slots)


# --------------------------------------------------------------- parquet / arrow


def _arrow_kind(path: Path) -> str:
    with open(path, "rb") as fh:
        return "file" if fh.read(6) == b"ARROW1" else "stream"


def _table_schema(path: Path, kind: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind == "parquet":
        return pq.read_schema(path)
    with pa.memory_map(str(path)) as src:
        reader = pa.ipc.open_file(src) if _arrow_kind(path) == "file" else pa.ipc.open_stream(src)
        return reader.schema


def _table_file(path: Path, kind: str, want: str, column: str | None) -> tuple[str, list[InputFile]]:
    import pyarrow as pa

    try:
        schema = _table_schema(path, kind)
    except (pa.ArrowInvalid, OSError) as e:
        raise _err(f"unreadable {kind} file", path, expected=f"a {kind} file", found=str(e).splitlines()[0]) from None
    text_col = column or "text"
    token_col = column or "input_ids"
    if want == "text" or (want == "auto" and token_col not in schema.names and text_col in schema.names
                          and _is_string(schema.field(text_col).type)):
        if text_col not in schema.names:
            raise _missing_column(path, text_col, schema.names)
        if not _is_string(schema.field(text_col).type):
            raise _err("text column is not a string column", path, where=f"column {text_col!r}",
                       expected="string", found=str(schema.field(text_col).type), hint="pass --column with the text column")
        return "text", [InputFile(str(path), "text", None, os.path.getsize(path), column=text_col,
                                  extra={"container": kind})]
    if token_col not in schema.names:
        raise _missing_column(path, token_col, schema.names)
    typ = schema.field(token_col).type
    value = _list_value_type(typ)
    if value is None or not pa.types.is_integer(value):
        raise _err("column is not a list of integers", path, where=f"column {token_col!r}",
                   expected="list<int>", found=str(typ), hint="pass --column with the token-id column")
    name = np.dtype(value.to_pandas_dtype()).name
    return "parquet", [InputFile(str(path), kind, name, os.path.getsize(path), column=token_col)]


def _missing_column(path, col, names) -> TokpackError:
    return _err("column not found", path, where=f"column {col!r}", expected=col, found=f"columns {list(names)}",
                hint="pass --column with the right column name")


def _is_string(typ) -> bool:
    import pyarrow as pa

    return pa.types.is_string(typ) or pa.types.is_large_string(typ)


def _list_value_type(typ):
    import pyarrow as pa

    if pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ):
        return typ.value_type
    return None


def iter_record_batches(f: InputFile, columns: list[str]):
    """The file's record batches, one at a time (Parquet row batches; Arrow IPC memory-mapped)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    kind = f.extra.get("container", f.format)
    if kind == "parquet":
        # pyarrow's default pre-buffering reads ahead across row groups (a 512 MB file peaked at
        # 717 MB of Arrow memory); a buffered stream decodes one row group with 8 MiB reads
        # (186 MB for the same file: a row group's values plus its levels).
        pf = pq.ParquetFile(f.path, pre_buffer=False, buffer_size=PARQUET_READ_BYTES)
        yield from pf.iter_batches(batch_size=TABLE_ROWS, columns=columns)
        return
    with pa.memory_map(f.path) as src:
        if _arrow_kind(Path(f.path)) == "file":
            reader = pa.ipc.open_file(src)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i).select(columns)
        else:
            for batch in pa.ipc.open_stream(src):
                yield batch.select(columns)


def _table_blocks(f: InputFile, block_tokens: int) -> Iterator[Block]:
    import pyarrow.compute as pc

    row = offset = 0
    for batch in iter_record_batches(f, [f.column]):
        col = batch.column(0)
        lengths = pc.list_value_length(col).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        values = pc.list_flatten(col)
        if values.null_count:
            raise _err("null token id in a list", f.path, where=f"column {f.column!r}, rows {row}-{row + len(col) - 1}",
                       expected="integers", found="null", hint="drop or fill the nulls before packing")
        tokens = values.to_numpy(zero_copy_only=False)
        ends = np.cumsum(lengths)
        yield Block(tokens, ends, None, row, offset)
        row += len(col)
        offset += len(tokens)


# ------------------------------------------------------------------------ numpy


def _npy_file(path: Path) -> InputFile:
    with open(path, "rb") as fh:
        try:
            version = np.lib.format.read_magic(fh)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read_header(fh)
        except ValueError as e:
            raise _err("unreadable .npy header", path, where="header", expected="a numpy .npy file", found=str(e)) from None
        offset = fh.tell()
    if dtype.kind not in "iu":
        raise _err(".npy array is not of an integer type", path, where="dtype", expected="an integer dtype",
                   found=dtype.name, hint="token ids must be integers")
    if fortran and len(shape) > 1:
        raise _err(".npy array is in Fortran order", path, where="header", expected="C order", found="Fortran order")
    count = int(np.prod(shape, dtype=np.int64))
    expected = offset + count * dtype.itemsize
    if os.path.getsize(path) != expected:
        raise _err(".npy size does not match its header", path, where="size", expected=f"{expected} bytes",
                   found=f"{os.path.getsize(path)} bytes", hint="the file is truncated")
    return InputFile(str(path), "numpy", dtype.newbyteorder("=").name, os.path.getsize(path),
                     extra={"offset": offset, "count": count, "byteorder": dtype.str})


def _raw_file(path: Path, dtype: str | None) -> InputFile:
    if dtype not in RAW_DTYPES:
        raise _err("raw token file needs --dtype", path, where="--dtype", expected=" | ".join(RAW_DTYPES), found=dtype,
                   hint="pass --dtype with the width the tokens were written in")
    itemsize = np.dtype(dtype).itemsize
    size = os.path.getsize(path)
    if size % itemsize:
        raise _err("raw token file size is not a multiple of the token size", path, where="size",
                   expected=f"a multiple of {itemsize} bytes ({dtype})", found=f"{size} bytes")
    return InputFile(str(path), "raw", dtype, size, extra={"offset": 0, "count": size // itemsize,
                                                           "byteorder": np.dtype(dtype).newbyteorder("<").str})


def _eos_split_blocks(f: InputFile, block_tokens: int, eos_id: int) -> Iterator[Block]:
    """Documents end after each EOS; tokens after the last EOS form a final document."""
    dtype = np.dtype(f.extra["byteorder"])
    count = f.extra["count"]
    buf = _Buffer(dtype)  # private: it carries a partial document between blocks
    buf.ensure(min(block_tokens, max(count, 1)))
    carry = 0  # tokens at the front of the buffer: a document not yet ended
    pos = 0  # tokens read from the file
    doc = offset = 0
    with open(f.path, "rb", buffering=0) as fh:
        fh.seek(f.extra["offset"])
        while pos < count or carry:
            if pos < count:
                if carry == len(buf.array):  # one document longer than the buffer: grow it
                    old = buf.array
                    buf.array = np.empty(2 * len(old), dtype)
                    buf.array[:carry] = old[:carry]
                n = min(len(buf.array) - carry, count - pos)
                _readinto_exact(fh, memoryview(buf.array[carry : carry + n].view(np.uint8)), f.path, pos)
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


# ------------------------------------------------------------------------ jsonl


def _open_text(path):
    return gzip.open(path, "rt", encoding="utf-8") if str(path).endswith(".gz") else open(path, encoding="utf-8")


def _jsonl_file(path: Path, want: str, column: str | None) -> tuple[str, list[InputFile]]:
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
        return "text", [InputFile(str(path), "text", None, os.path.getsize(path), column=text_key,
                                  extra={"container": "jsonl"})]
    return "jsonl", [InputFile(str(path), "jsonl", None, os.path.getsize(path), column=token_key)]


def _jsonl_blocks(f: InputFile, block_tokens: int) -> Iterator[Block]:
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


# ------------------------------------------------------------------------- API


def check_input(f: InputFile) -> None:
    """Structural checks that need no token scan; run on every input before pack writes anything."""
    if f.format == "datatrove":
        _check_datatrove(f)
    elif f.format == "megatron":
        _check_megatron(f)


def read_blocks(f: InputFile, eos_id: int, block_bytes: int = BLOCK_BYTES) -> Iterator[Block]:
    """Whole documents of `f`, a block at a time, in file order."""
    itemsize = np.dtype(f.dtype).itemsize if f.dtype else 8
    block_tokens = max(1, block_bytes // itemsize)
    if f.format == "datatrove":
        return _datatrove_blocks(f, block_tokens)
    if f.format == "megatron":
        return _megatron_blocks(f, block_tokens)
    if f.format in ("parquet", "arrow"):
        return _table_blocks(f, block_tokens)
    if f.format in ("numpy", "raw"):
        return _eos_split_blocks(f, block_tokens, eos_id)
    if f.format == "jsonl":
        return _jsonl_blocks(f, block_tokens)
    raise ValueError(f"no block reader for {f.format!r}")


def native_vocab(dtype: str | None) -> int | None:
    """The vocabulary a dtype can address, when that bounds it usefully (not 64-bit or float)."""
    if dtype is None:
        return None
    dt = np.dtype(dtype)
    if dt.kind == "f" or dt.itemsize == 8:
        return None
    return int(np.iinfo(dt).max) + 1


def load_tokenizer(path: str):
    """A local tokenizer.json; nothing is ever downloaded."""
    if not os.path.isfile(path):
        raise TokpackError("tokenizer is not a local file", file=path, where="--tokenizer",
                           expected="a path to a tokenizer.json", found="no such file",
                           hint="tokpack never downloads; save the tokenizer with tokenizer.save('tokenizer.json')")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises plain Exceptions for bad files
        raise TokpackError("unreadable tokenizer", file=path, expected="a tokenizers JSON file",
                           found=str(e).splitlines()[0][:120]) from None


def tokenizer_eos(tokenizer) -> tuple[int, str] | None:
    """(id, token) of the tokenizer's end-of-document token, by its usual names."""
    for token in EOS_TOKENS:
        tid = tokenizer.token_to_id(token)
        if tid is not None:
            return tid, token
    return None


class Normalizer:
    """Turns a reader's blocks into packed-source blocks: checks ids, drops empty documents,
    appends missing EOS and casts to the output dtype. Vectorised over the block; the EOS
    present case costs one max/min pass and a gather at the document ends."""

    def __init__(self, f: InputFile, vocab_size: int, eos_id: int, out_dtype: np.dtype):
        self.f = f  # the input, for messages
        self.vocab_size = vocab_size  # ids must be below it
        self.eos_id = eos_id  # every output document ends with it
        self.out_dtype = np.dtype(out_dtype).newbyteorder("<")  # uint16 or uint32
        self.out = _take_buffer(self.out_dtype)  # reused cast target, this normalizer's own
        weakref.finalize(self, _give_buffers, [self.out])
        self.eos_appended = 0  # documents that lacked EOS
        self.empty_dropped = 0  # documents with no tokens

    def __call__(self, b: Block) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        tokens, ends, loss = b.tokens, b.ends, b.loss
        if len(tokens):
            self._check_ids(b)
        starts = np.empty_like(ends)
        starts[0:1] = 0
        starts[1:] = ends[:-1]
        keep = ends > starts
        if not keep.all():
            self.empty_dropped += int(len(ends) - keep.sum())
            ends = ends[keep]
        if len(ends) == 0:
            return tokens[:0].astype(self.out_dtype), ends, None if loss is None else loss[:0]
        missing = tokens[ends - 1] != self.eos_id
        if missing.any():
            at = ends[missing]
            self.eos_appended += len(at)
            tokens = np.insert(tokens.astype(self.out_dtype, copy=False), at, self.eos_id)
            if loss is not None:
                loss = np.insert(loss, at, 1)
            ends = ends + np.cumsum(missing)
        if tokens.dtype != self.out_dtype:
            out = self.out.ensure(len(tokens))[: len(tokens)]
            np.copyto(out, tokens, casting="unsafe")
            tokens = out
        return tokens, ends, loss

    def _check_ids(self, b: Block) -> None:
        t = b.tokens
        if t.dtype.kind == "f":
            bad = np.flatnonzero(~np.isfinite(t) | (t != np.floor(t)))
            if len(bad):
                self._fail("token id is not an integer", b, int(bad[0]), "integer values", t[bad[0]])
        if t.dtype.kind != "u" and t.min() < 0:
            i = int(np.argmax(t < 0))
            self._fail("negative token id", b, i, f"ids in [0, {self.vocab_size})", int(t[i]),
                       "the input holds negative ids; check --dtype or the input's dtype")
        if t.max() >= self.vocab_size:
            i = int(np.argmax(t >= self.vocab_size))
            self._fail("token id at or above vocab_size", b, i, f"< {self.vocab_size}", int(t[i]),
                       "pass the right --vocab-size or --tokenizer, or fix the input")

    def _fail(self, message, b: Block, pos: int, expected, found, hint=None):
        doc = b.first_doc + int(np.searchsorted(b.ends, pos, side="right"))
        raise _err(message, self.f.path, where=f"document {doc}, token offset {b.offset + pos}",
                   expected=expected, found=found, hint=hint)
