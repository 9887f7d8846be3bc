"""`tokpack pack`'s setup, decided before it writes a byte: what it makes (PackOptions), its inputs
found and checked (every check that needs no token scan), what OUT holds (fresh, resume, complete or
replace) and the bytes it will write (PackSetup). `pack` runs it; `tokpack plan pack` reports it."""

from __future__ import annotations

import os
import shutil
from contextlib import suppress
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from tokpack.formats.builders import source_manifest
from tokpack.formats.errors import TokpackError
from tokpack.formats.constants import DEFAULT_SHARD_TOKENS, LOCK_NAME, MANIFEST, SOURCE, WORK_DIR
from tokpack.formats.guard import bytes_under
from tokpack.formats.inputs import InputFile
from tokpack.formats.inputs.discover import check_input, discover
from tokpack.formats.inputs.tables import parquet_values
from tokpack.formats.io.paths import as_path, is_url
from tokpack.formats.io.writes import is_tmp_name
from tokpack.formats.io.gate import read_record
from tokpack.formats.names import dtype_for_vocab
from tokpack.formats.reading import read_manifest
from tokpack.formats.outputs import LocalOutput, Output
from tokpack.formats.shards import PackedSource, is_own_file
from tokpack.formats.units import counted
from tokpack.packer.shared import ExecutorConfig
from tokpack.packer.linking import LinkPlan, plan_links
from tokpack.packer.vocab import load_tokenizer, resolve_vocab_eos


def _is_ours(p: Path) -> bool:
    """What pack writes in OUT, by name and kind: the only entries --overwrite replaces."""
    if p.name == WORK_DIR:
        return p.is_dir() and not p.is_symlink()
    return is_own_file(p) or p.name == LOCK_NAME and p.is_file()


def _output_state(out: Path, request: dict, overwrite: bool) -> str:
    """'fresh', 'resume', 'complete' or 'replace' (an old pack to delete once inputs check out)."""
    if not out.exists():
        return "fresh"
    if not out.is_dir():
        raise TokpackError("output exists and is not a directory", file=out, hint="choose another -o")
    entries = [p for p in out.iterdir() if not (p.name == LOCK_NAME or is_tmp_name(p.name)) or not _is_ours(p)]
    if not entries:
        return "fresh"
    # request.json is the first file a pack writes: a work folder without it (a command killed
    # right after creating the folder) holds nothing to keep.
    if [p.name for p in entries] == [WORK_DIR] and not (out / WORK_DIR / "request.json").exists():
        return "replace"
    others = [p.name for p in entries if not _is_ours(p)]
    if others:
        raise TokpackError(
            "output directory holds other files",
            file=out,
            expected="an empty or tokpack directory",
            found=", ".join(sorted(others)[:5]),
            hint="choose another -o; --overwrite only replaces tokpack output, never other files",
        )
    if not (out / MANIFEST).exists() and not (out / WORK_DIR).exists():
        # shard-named files with neither marker: no state a pack leaves (clear_output deletes the
        # markers last), so nothing says they are tokpack's; --overwrite must not delete them
        raise TokpackError(
            "output directory holds shard-named files but no tokpack.json and no unfinished pack",
            file=out,
            expected="an empty or tokpack directory",
            found=", ".join(sorted(p.name for p in entries)[:5]),
            hint="choose another -o; if they are an old pack's, delete them yourself",
        )
    if (out / MANIFEST).exists():
        with suppress(TokpackError):  # a damaged pack is not complete
            if read_manifest(out, kind=SOURCE).get("request") == request:
                PackedSource.open(out)  # shard sizes match the manifest
                return "complete"
        if not overwrite:
            raise TokpackError(
                "output directory already holds a different packed source",
                file=out,
                where=MANIFEST,
                expected="the same inputs and options",
                found="another pack",
                hint="pass --overwrite to replace it, or choose another -o",
            )
        return "replace"
    work = out / WORK_DIR
    req = work / "request.json"
    record = read_record(req) if req.exists() else None  # None if damaged: it cannot be resumed, only replaced
    if record == request:
        return "resume"
    if not overwrite:
        raise TokpackError(
            "output directory holds an unfinished pack of other inputs",
            file=out,
            expected="the same inputs and options",
            found=f"a damaged {WORK_DIR}/request.json" if req.exists() and record is None else "another request",
            hint="rerun that pack to finish it, or pass --overwrite to replace it",
        )
    return "replace"


def _refuse_inputs_inside(files: list[InputFile], out) -> None:
    """An input inside OUT (a glob over an old pack's shards: `pack out/*.ds -o out`) is a file
    pack would replace or delete (--overwrite, a finished pack's renames): refused, so a user's
    tokens are never lost to their own pack. Sidecars (.ds.index, .idx) sit beside their file."""
    if not isinstance(out, Path):
        return  # a bucket: no local input lies in it
    where = Path(os.path.realpath(out))
    for f in files:
        if not is_url(f.path) and Path(os.path.realpath(f.path)).is_relative_to(where):
            raise TokpackError(
                "an input lies inside the output directory",
                file=f.path,
                where="INPUT",
                expected="inputs outside -o",
                found=f"inside {out}",
                hint="choose another -o; packing into the inputs' own folder would replace or delete them",
            )


def clear_output(out: Path) -> None:
    # the markers (tokpack.json, the work folder) go last: a run killed here leaves OUT still
    # known as tokpack's, which a rerun with --overwrite clears (_output_state)
    for p in sorted(out.iterdir(), key=lambda p: p.name in (MANIFEST, WORK_DIR)):
        if p.name == LOCK_NAME or not _is_ours(p):
            continue  # this command's own lock; what pack did not write (_output_state refused it)
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


def known_tokens(f: InputFile) -> int | None:
    """The input's token count where its size tells it (datatrove, Megatron, NumPy, raw) or its
    footer does (Parquet: tokpack.formats.inputs.tables.parquet_values, an estimate), else None."""
    if f.format in ("datatrove", "megatron"):
        return as_path(f.path).stat().st_size // np.dtype(f.dtype).itemsize
    if f.format == "parquet":
        return parquet_values(f)
    return int(f.extra["count"]) if f.format in ("numpy", "raw") else None


def _shard_bytes(f: InputFile, out_dtype: np.dtype) -> int:
    """Bytes of the shard files input `f` becomes, when its token count is told by its size or
    footer; Arrow, JSONL and text inputs count 0 here."""
    tokens = known_tokens(f) or 0
    total = tokens * out_dtype.itemsize
    if f.format == "datatrove":
        index = as_path(f.extra["index"]).stat().st_size if as_path(f.extra["index"]).exists() else 0
        total += index + (tokens if f.extra.get("loss") else 0)
    elif f.format == "megatron":
        total += 8 * int(f.extra.get("documents") or 0)
    return total


@dataclass(frozen=True)
class PackOptions:
    """What a pack makes of its inputs (pack's options less how the work runs); each default
    declared here, once. Two packs of the same inputs with equal options write the same bytes."""

    input_format: str = "auto"
    column: str | None = None
    dtype: str | None = None
    tokenizer: str | None = None
    eos_id: int | None = None
    vocab_size: int | None = None
    overwrite: bool = False
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    link: bool = False  # pack --link: an input that is its shard's bytes is linked, not copied
    # pack --append-eos: an input whose documents all end with one other id is packed, an EOS
    # appended to each, not refused (tokpack.packer.packing.check_document_ends)
    append_eos: bool = False

    @classmethod
    def of(cls, values: dict) -> PackOptions:
        """The options among `values` (pack's keyword arguments, which hold more)."""
        return cls(**{f.name: values[f.name] for f in fields(cls)})


@dataclass
class PackSetup:
    """What a pack will read and write, decided before it writes a byte: `pack` runs it,
    `tokpack plan pack` (packer/planning.py) reports it."""

    fmt: str
    files: list[InputFile]
    tokenizer: str | None  # absolute when a local file
    request: dict  # pack's normalised options (see _output_state)
    state: str  # 'fresh', 'resume', 'complete' or 'replace'
    vocab: int = 0  # the rest is resolved unless the pack is complete already
    eos: int = 0
    tok_name: str = ""
    eos_token: str | None = None
    warnings: list[str] = field(default_factory=list)
    out_dtype: np.dtype | None = None
    link: bool = False  # pack --link
    vocab_known: bool = True  # False: vocab is only the input dtype's width (the manifest's vocab_known)

    def links(self, out: Path, to: Output = LocalOutput()) -> LinkPlan:
        """The shard files' bytes by how they will get there: all copied, but with --link."""
        if not self.link or not to.links_files:
            return LinkPlan(copy=sum(_shard_bytes(f, self.out_dtype) for f in self.files))
        return plan_links(
            self.files,
            out,
            self.out_dtype,
            int(self.request["shard_tokens"]),
            lambda f: _shard_bytes(f, self.out_dtype),
        )

    def manifest(self, entries: list[dict], created_by: str, parts: list[dict] = (), **fields) -> dict:
        """The source manifest of shards `entries`, packed by the tasks whose records are `parts`."""
        return source_manifest(
            entries,
            self.out_dtype,
            self.vocab,
            self.eos,
            self.tok_name,
            inputs=self.request["inputs"],
            shard_tokens=self.request["shard_tokens"],
            eos_appended=sum(p["eos_appended"] for p in parts),
            empty_documents_dropped=sum(p["empty_documents_dropped"] for p in parts),
            created_by=created_by,
            request=self.request,
            **fields,
        )

    def bytes_to_write(self, out: Path, to: Output = LocalOutput(), tasks: int = 1) -> int:
        """Shards are renamed out of the work folder, never copied: one copy of the output at
        most. What OUT holds already (a resumed or a replaced pack) is not needed again. To a
        bucket, OUT holds a shard per task at most, each sent once written. A hard link takes
        no space (a file whose scan finds it cannot be linked checks for its own before it is copied)."""
        plan = self.links(out, to)
        total = plan.copy + plan.reflink
        shard = int(self.request["shard_tokens"]) * self.out_dtype.itemsize
        return to.local_need(total, tasks * shard, here=bytes_under(out))


def pack_tasks(files: int, config: ExecutorConfig) -> int:
    return min(config.tasks or files, files)


def setup_pack(
    inputs: list[str],
    out: Path,
    options: PackOptions = PackOptions(),
    *,
    say=lambda msg: None,
    to: Output = LocalOutput(),
) -> PackSetup:
    """Finds the inputs, checks them (every check that needs no token scan) and OUT (to a
    bucket: what the store holds). Reads only."""
    tokenizer = options.tokenizer
    if tokenizer is not None:
        tokenizer = str(Path(tokenizer).absolute()) if os.path.isfile(tokenizer) else tokenizer
        load_tokenizer(tokenizer)
    fmt, files = discover(list(inputs), options.input_format, options.column, options.dtype)
    say(
        f"tokpack pack: detected format {fmt}: {counted(len(files), 'file')}, "
        f"{', '.join(sorted({f.format + (' ' + f.dtype if f.dtype else '') for f in files}))}"
    )
    _refuse_inputs_inside(files, to.where(out))
    request = {
        "inputs": [
            {"path": f.path if is_url(f.path) else str(Path(f.path).absolute()), "size": f.size, "format": f.format}
            for f in files
        ],
        "format": fmt,
        "column": options.column,
        "dtype": options.dtype,
        "tokenizer": tokenizer,
        "eos_id": options.eos_id,
        "vocab_size": options.vocab_size,
        "shard_tokens": int(options.shard_tokens),
        # only when given, so a request without it (and its manifest) is as before; in it at all,
        # so a pack refused without it is not taken for complete by a rerun of the accepted one
        **({"append_eos": True} if options.append_eos else {}),
    }
    # `link` is not in the request: a linked pack's manifest and bytes are a copying pack's
    setup = PackSetup(
        fmt, files, tokenizer, request, _output_state(to.where(out), request, options.overwrite), link=options.link
    )
    if setup.state == "complete":
        return setup
    if fmt == "text" and tokenizer is None:
        raise TokpackError(
            "raw text needs a tokenizer",
            file=files[0].path,
            where="--tokenizer",
            expected="a local tokenizer.json",
            found="none",
            hint="pass --tokenizer tokenizer.json",
        )
    # text: its tokenizer gives the vocabulary and the EOS, so it says no warning nor known tokenizer's line
    setup.vocab, setup.eos, setup.tok_name, setup.eos_token, setup.vocab_known = resolve_vocab_eos(
        files, tokenizer, options.eos_id, options.vocab_size, say, setup.warnings
    )
    if fmt == "text" and setup.eos_token is None:
        raise TokpackError(
            "EOS id is not a token of the tokenizer",
            file=tokenizer,
            where="--eos-id",
            expected="an id the tokenizer knows",
            found=options.eos_id,
        )
    if fmt != "text":
        for f in files:
            check_input(f)
    setup.out_dtype = dtype_for_vocab(setup.vocab)
    return setup
