"""Finding the input files behind each INPUT path and telling their format; then, per format,
the structural checks pack runs before it writes (`check_input`) and the reader (`read_blocks`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import TokpackError
from ..io.writes import TMP_MARK
from ..io.paths import as_path
from ..io.gate import read_limited
from ..constants import MANIFEST, MAX_MANIFEST_BYTES
from . import BLOCK_BYTES, Block, InputFile, input_error as _err
from .datatrove_ds import check_datatrove, datatrove_blocks, datatrove_file
from .jsonl import JSONL_SUFFIXES, jsonl_blocks, jsonl_file
from .megatron_bin import check_megatron, megatron_blocks, megatron_file
from .npy_raw import eos_split_blocks, npy_file, raw_file
from .tables import ARROW_SUFFIXES, table_blocks, table_file

FORMATS = ("datatrove", "megatron", "parquet", "numpy", "jsonl", "text")


def discover(
    inputs: list[str], input_format: str = "auto", column: str | None = None, dtype: str | None = None
) -> tuple[str, list[InputFile]]:
    """Expands INPUT paths into input files, in order, and tells their format.
    Returns (format, files); `format` is one of FORMATS."""
    if not inputs:
        raise TokpackError("no input given", hint="pass one or more files or directories")
    found = [_discover_one(as_path(item), input_format, column, dtype) for item in inputs]
    formats = {fmt for fmt, _ in found}
    if len(formats) > 1:
        kinds = ", ".join(f"{item} is {fmt}" for item, (fmt, _) in zip(inputs, found))
        raise TokpackError(
            "inputs of different formats in one pack",
            where="INPUT",
            expected="one format",
            found=kinds,
            hint="pack each format into its own source, then shuffle them together",
        )
    _refuse_twice(inputs, found)
    files = [f for _, fs in found for f in fs]
    if not files:
        raise TokpackError(
            "no input files found",
            file=", ".join(inputs),
            expected="at least one file",
            found="nothing",
            hint="check the paths and --format",
        )
    _check_dtype_option(files, dtype)
    _check_consistent(files)
    return formats.pop(), files


def _refuse_twice(inputs: list[str], found: list[tuple[str, list[InputFile]]]) -> None:
    """One file reached twice (a path given twice, a symbolic or hard link to it, a folder and a
    file in it) would pack its tokens twice: refused, naming both arguments."""
    seen: dict = {}
    for item, (_, files) in zip(inputs, found):
        for f in files:
            path = as_path(f.path)
            key = (path.stat().st_dev, path.stat().st_ino) if isinstance(path, Path) else str(path)
            if key in seen:
                other, other_path = seen[key]
                same = f.path if other_path == f.path else f"{other_path} and {f.path}"
                raise TokpackError(
                    "the same input file is given twice",
                    file=f.path,
                    where="INPUT",
                    expected="each input file once",
                    found=f"{other!r} and {item!r} both reach {same}",
                    hint="give each input once; its tokens would be packed twice",
                )
            seen[key] = (item, f.path)


def _discover_one(path: Path, want: str, column, dtype) -> tuple[str, list[InputFile]]:
    if not path.exists():
        if as_path(f"{path}.bin").exists() and as_path(f"{path}.idx").exists() and want in ("auto", "megatron"):
            return "megatron", [megatron_file(as_path(f"{path}.bin"))]
        raise _err("no such input", path, hint="give a file, a directory or a Megatron path prefix")
    if path.is_dir():
        return _discover_dir(path, want, column, dtype)
    name = path.name
    if want in ("auto", "datatrove") and name.endswith(".ds"):
        return "datatrove", [datatrove_file(path, dtype)]
    if (
        want in ("auto", "megatron")
        and path.suffix in (".bin", ".idx")
        and path.with_suffix(".idx").exists()
        and path.with_suffix(".bin").exists()
    ):
        return "megatron", [megatron_file(path.with_suffix(".bin"))]
    if want == "megatron" and path.suffix in (".bin", ".idx"):
        raise _lone_megatron(path)
    if want in ("auto", "parquet", "text") and path.suffix in (".parquet", *ARROW_SUFFIXES):
        return table_file(path, "parquet" if path.suffix == ".parquet" else "arrow", want, column)
    if want in ("auto", "numpy") and path.suffix == ".npy":
        return "numpy", [npy_file(path)]
    if want in ("auto", "jsonl", "text") and name.endswith(JSONL_SUFFIXES):
        return jsonl_file(path, want, column)
    if want == "numpy" or (want == "auto" and dtype):
        return "numpy", [raw_file(path, dtype)]
    raise _err(
        "cannot tell the input format",
        path,
        expected="a known format for --format " + want,
        found=f"a file named {name!r}",
        hint="pass --format (and --dtype for raw token files), or rename the file with its usual extension",
    )


def _discover_dir(path: Path, want, column, dtype) -> tuple[str, list[InputFile]]:
    files = sorted(p for p in path.iterdir() if p.is_file() and TMP_MARK not in p.name)
    names = [p.name for p in files]
    if want in ("auto", "datatrove") and any(n.endswith(".ds") for n in names):
        # the order datatrove's own readers use (DataFolder.list_files sorts names)
        return "datatrove", [datatrove_file(p, dtype) for p in files if p.name.endswith(".ds")]
    idx = {p.stem for p in files if p.suffix == ".idx"}
    bins = [p for p in files if p.suffix == ".bin" and p.stem in idx]
    if want in ("auto", "megatron") and bins:
        stems = {p.stem for p in files if p.suffix == ".bin"}
        # a .bin whose .idx did not come along (a copy cut short) would be left out in silence
        for p in files:
            if (p.suffix == ".bin" and p.stem not in idx) or (p.suffix == ".idx" and p.stem not in stems):
                raise _lone_megatron(p)
        return "megatron", [megatron_file(p) for p in bins]
    if (path / "dataset_dict.json").exists():
        splits = json.loads(
            read_limited(path / "dataset_dict.json", MAX_MANIFEST_BYTES, "dataset_dict.json", user=True)
        ).get("splits")
        raise _err(
            "a DatasetDict holds several splits",
            path,
            expected="one split's directory",
            found=splits,
            hint=f"pass one split, e.g. {path / (splits or ['train'])[0]}",
        )
    arrows = [p for p in files if p.suffix in ARROW_SUFFIXES]
    if want in ("auto", "parquet", "text") and (path / "state.json").exists() and arrows:
        state = json.loads(read_limited(path / "state.json", MAX_MANIFEST_BYTES, "state.json", user=True))
        listed = [path / d["filename"] for d in state.get("_data_files", [])]
        missing = [p for p in listed if not p.exists()]
        if missing:  # an incomplete copy: the files left hold only part of the dataset's rows
            raise _err(
                "a file the dataset's state.json lists is missing",
                missing[0],
                where="state.json _data_files",
                expected=f"{len(listed)} files",
                found=f"{len(missing)} missing",
                hint="the dataset folder is incomplete: copy it again, or save_to_disk it again",
            )
        arrows = listed or arrows
        return _each(arrows, lambda p: table_file(p, "arrow", want, column))
    for suffixes, fmt_name in (((".parquet",), "parquet"), (ARROW_SUFFIXES, "arrow")):
        chosen = [p for p in files if p.suffix in suffixes]
        if want in ("auto", "parquet", "text") and chosen:
            return _each(chosen, lambda p: table_file(p, fmt_name, want, column))
    if want in ("auto", "numpy") and any(p.suffix == ".npy" for p in files):
        return "numpy", [npy_file(p) for p in files if p.suffix == ".npy"]
    jsonl = [p for p in files if p.name.endswith(JSONL_SUFFIXES) and p.name != MANIFEST]
    if want in ("auto", "jsonl", "text") and jsonl:
        return _each(jsonl, lambda p: jsonl_file(p, want, column))
    if want == "numpy" and dtype:
        return "numpy", [raw_file(p, dtype) for p in files]
    raise _err(
        "no input files of a known format in directory",
        path,
        expected="*.ds, *.bin+*.idx, *.parquet, *.arrow, *.npy or *.jsonl" if want == "auto" else want,
        found=f"{len(files)} files" + (f" ({', '.join(names[:4])}...)" if names else ""),
        hint="check the path, or pass --format",
    )


def _lone_megatron(path: Path) -> TokpackError:
    other = ".idx" if path.suffix == ".bin" else ".bin"
    return _err(
        f"Megatron {path.suffix} without its {other}",
        path,
        where=other,
        expected=f"{path.stem}{other} beside it",
        found="none",
        hint=f"copy the missing {other} (a Megatron dataset is the pair), or move this file out of the input",
    )


def _each(paths: list[Path], tell) -> tuple[str, list[InputFile]]:
    """The files of several paths of one kind; `tell(path)` gives (format, files) for one."""
    fmt, out = None, []
    for p in paths:
        fmt, files = tell(p)
        out += files
    return fmt, out


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
            raise _err(
                f"--dtype applies only to raw token files, not to {f.format} input",
                f.path,
                where="--dtype",
                expected="no --dtype",
                found=dtype,
                hint="drop --dtype",
            )
        if np.dtype(f.dtype).name != given:
            raise _err(
                f"--dtype differs from the dtype the {f.format} input records",
                f.path,
                where="--dtype",
                expected=f.dtype,
                found=dtype,
                hint="drop --dtype, it is only for raw token files",
            )


# (field, message, hint) of what every input of one pack shares, in the order it is checked
_ONE_OF_A_PACK = (
    ("dtype", "mixed token dtypes in one pack", "pack inputs of one dtype together, or convert them first"),
    (
        "tokenizer",
        "mixed vocabularies in one pack",
        "inputs tokenized with different tokenizers cannot share one packed source",
    ),
)


def _check_consistent(files: list[InputFile]) -> None:
    """One pack, one token type: files of different dtypes or tokenizers are refused."""
    first = files[0]
    for f in files[1:]:
        for key, message, hint in _ONE_OF_A_PACK:
            if getattr(f, key) != getattr(first, key):
                expected = f"{getattr(first, key)} (as in {first.path})"
                raise _err(message, f.path, where=key, expected=expected, found=getattr(f, key), hint=hint)
    with_loss = {bool(f.extra.get("loss")) for f in files}
    if len(with_loss) > 1:
        missing = next(f for f in files if not f.extra.get("loss"))
        raise _err(
            "some datatrove files have a .ds.loss and others do not",
            missing.path,
            where=".ds.loss",
            expected="all or none",
            found="missing here",
            hint="pack them separately",
        )


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
