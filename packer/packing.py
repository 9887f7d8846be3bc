"""`tokpack pack`: tokenized inputs -> one packed source (docs/COMMANDS.md, "Packing").

Layout decisions:

- One task per input file (a datatrove `PipelineStep`; task r packs input file r). Each
  input file is cut into shards of at most `shard_tokens` tokens at document boundaries;
  a document longer than that gets a shard of its own. A shard never holds documents of
  two input files, so the shard layout depends only on the inputs and `shard_tokens`, and
  the output is byte-identical for any `--workers`, `--tasks` or executor.
- Tasks write into `OUT/.tokpack-work/part-NNNNN/` and then, atomically and last, a part
  JSON. The driver renames the parts' shards to their global names in input order, writes
  `tokpack.json` last and removes the work folder. A killed run, rerun, redoes only the
  parts without a part JSON; a run killed while renaming finishes from `finalize.json`.
- Every check that needs no token scan (index monotonicity, sizes, headers, schemas,
  dtypes, EOS and vocabulary) runs before anything is written. A data error found by a
  task (an id >= vocab_size, a negative id) removes the work folder: OUT never holds a
  `tokpack.json` or a final-named shard from a failed run.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tokpack.formats.errors import TokpackError
from tokpack.formats.constants import DEFAULT_SHARD_TOKENS
from tokpack.formats.guard import LOCK_NAME, WORK_DIR, bytes_under, check_space, locked_output
from tokpack.formats.inputs import BLOCK_BYTES, InputFile
from tokpack.formats.inputs.discover import check_input, discover, read_blocks
from tokpack.formats.inputs.tables import parquet_values
from tokpack.formats.io import (
    MAX_RECORD_BYTES,
    as_path,
    is_tmp_name,
    is_url,
    progress,
    read_limited,
    read_record,
    write_bytes_atomic,
)
from tokpack.formats.manifest import (
    MANIFEST,
    dtype_for_vocab,
    read_manifest,
    shard_digits,
    shard_name,
    source_manifest,
)
from tokpack.formats.outputs import LocalOutput, Output, ShardPlace, SourceShardFormat
from tokpack.formats.shards import PackedSource, is_own_file, shard_suffixes
from tokpack.formats.units import counted
from tokpack.shuffle.sinks import app_sinks_kept
from tokpack.packer.shared import Result, optional_field
from tokpack.packer.executors import ExecutorConfig, run_steps, runs_in_process
from tokpack.packer.linking import Linked, LinkPlan, link_part, plan_links, summary as link_summary
from tokpack.packer.vocab import Normalizer, load_tokenizer, resolve_vocab_eos

# Importing datatrove's logging module removes every loguru sink; the application's must stay.
with app_sinks_kept():
    import datatrove.utils.logging  # noqa: F401
    from datatrove.pipeline.base import PipelineStep


def _version() -> str:
    try:
        from importlib.metadata import version

        return f"tokpack {version('tokpack')}"
    except Exception:
        return "tokpack"


# ------------------------------------------------------------------------ the task


class PackStep(PipelineStep):
    """Packs input files `rank, rank + world_size, ...` into `work/part-NNNNN/` (N = file number)."""

    name = "📦 tokpack pack"
    type = "🔢 - TOKENIZER"

    def __init__(
        self,
        files: list[InputFile],
        work: str,
        vocab_size: int,
        eos_id: int,
        dtype: str,
        tokenizer: str,
        shard_tokens: int,
        block_bytes: int = BLOCK_BYTES,
        output: Output = LocalOutput(),
        link: bool = False,
    ):
        super().__init__()
        self.files = files  # every input file, in input order
        self.work = work  # OUT/.tokpack-work
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.dtype = dtype  # output dtype name
        self.tokenizer = tokenizer  # written into each shard's .ds.metadata
        self.shard_tokens = shard_tokens  # max tokens per shard (but one oversized document)
        self.block_bytes = block_bytes  # input bytes per read block
        self.output = output  # where the shards go (tokpack.formats.outputs): to a bucket, each is sent once written
        self.link = link  # pack --link: an input that is its shard's bytes is linked (tokpack.packer.linking)
        # The bar over every file, next to each file's own, when the ranks run in the command's
        # process (never pickled to a worker); moved by whole files: a JSONL block's bytes are not known.
        self.overall = None

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        for i in range(rank, len(self.files), world_size):
            try:
                self.pack_file(i)
            except TokpackError as e:
                write_bytes_atomic(Path(self.work) / f"part-{i:05d}.error.json", json.dumps(e.to_json()).encode())
                raise
            if self.overall is not None:
                self.overall.update(self.files[i].size)

    def pack_file(self, i: int) -> dict:
        f = self.files[i]
        part_dir = Path(self.work) / f"part-{i:05d}"
        part_json = Path(self.work) / f"part-{i:05d}.json"
        part = read_record(part_json)  # a damaged record: the file is packed again
        if part is not None:
            shards = part.get("shards")
            if isinstance(shards, list) and all(
                self.output.has(part_dir, e, np.dtype(self.dtype).itemsize) for e in shards
            ):
                return part  # done by an earlier run
        part_json.unlink(missing_ok=True)
        if part_dir.exists():
            shutil.rmtree(part_dir)
        self.output.remove_sent(part_dir)
        part_dir.mkdir(parents=True)
        out_dtype = np.dtype(self.dtype)
        linked = None
        if self.link:
            linked = (
                Linked(note="the output is an object store")
                if not self.output.links_files
                else link_part(
                    f,
                    part_dir,
                    self.vocab_size,
                    self.eos_id,
                    out_dtype,
                    self.tokenizer,
                    self.shard_tokens,
                    self.block_bytes,
                )
            )
            if linked.part is not None:
                return self._record(part_json, linked.part)
            check_space([(part_dir, f.size)], "pack", hint=f"{f.path} is copied: {linked.note}")
        norm = Normalizer(f, self.vocab_size, self.eos_id, out_dtype)
        with_loss = bool(f.extra.get("loss"))
        entries: list[dict] = []
        writer = None

        def close_shard() -> None:
            nonlocal writer
            entry, writer = writer.close(), None  # committed through the Output: to a bucket, sent
            entries.append(entry)

        fmt = SourceShardFormat(out_dtype, self.tokenizer, with_loss)
        in_itemsize = np.dtype(f.dtype).itemsize if f.dtype else 0
        bar = progress(f.size, f"pack {Path(f.path).name}")
        blocks = None  # the reader's generator, closed explicitly on failure
        try:
            blocks = read_blocks(f, self.eos_id, self.block_bytes)
            for block in blocks:
                in_bytes = len(block.tokens) * in_itemsize
                tokens, ends, loss = norm(block)
                done = 0  # documents of this block already written
                while done < len(ends):
                    if writer is None:
                        k = len(entries)
                        writer = self.output.open_shard(ShardPlace(str(part_dir), shard_name(k), k, part=i), fmt)
                    base = int(ends[done - 1]) if done else 0
                    stop = int(np.searchsorted(ends, base + self.shard_tokens - writer.tokens, side="right"))
                    if stop == done:
                        if writer.tokens:  # the next document does not fit: start a new shard
                            close_shard()
                            continue
                        stop = done + 1  # a document larger than a shard: a shard of its own
                    end = int(ends[stop - 1])
                    writer.write(tokens[base:end], ends[done:stop] - base, None if loss is None else loss[base:end])
                    done = stop
                    if writer.tokens >= self.shard_tokens:
                        close_shard()
                bar.update(in_bytes)
            if writer is not None and writer.tokens:
                close_shard()
            elif writer is not None:
                writer.abort()
            writer = None
        except BaseException:
            if blocks is not None:
                blocks.close()  # stops the reader's read-ahead thread now, not at garbage collection
            if writer is not None:
                writer.abort()
            shutil.rmtree(part_dir, ignore_errors=True)
            raise
        finally:
            bar.close()
        part = {
            "input": f.path,
            "shards": entries,
            "tokens": sum(e["tokens"] for e in entries),
            "documents": sum(e["documents"] for e in entries),
            "eos_appended": norm.eos_appended,
            "empty_documents_dropped": norm.empty_dropped,
            "end_id": norm.end_id,  # the one id every document lacking EOS ended with, else None
        }
        if linked is not None:
            part["link"] = {"how": "copy", "why": linked.note}
        return self._record(part_json, part)

    def _record(self, part_json: Path, part: dict) -> dict:
        write_bytes_atomic(part_json, json.dumps(part).encode(), fsync=True)
        self.output.send_record(part_json)
        return part


class TokenizeTextStep(PipelineStep):
    """Task r tokenizes text input file r with datatrove's DocumentTokenizer into
    `work/text/` (file `r_unshuffled.ds`), keeping document order."""

    name = "🔤 tokpack tokenize"
    type = "🔢 - TOKENIZER"

    def __init__(self, files: list[InputFile], folder: str, tokenizer: str, eos_token: str):
        super().__init__()
        self.files = files  # text inputs, in input order
        self.folder = folder  # datatrove output folder
        self.tokenizer = tokenizer  # local tokenizer.json
        self.eos_token = eos_token  # appended to every document by the tokenizer's post-processor

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        from datatrove.pipeline.readers import IpcReader, JsonlReader, ParquetReader
        from datatrove.pipeline.tokens.tokenizer import DocumentTokenizer

        for i in range(rank, len(self.files), world_size):
            f = self.files[i]
            kind = f.extra.get("container")
            reader_cls = {"jsonl": JsonlReader, "parquet": ParquetReader, "arrow": IpcReader}[kind]
            kw = {"stream": True} if kind == "arrow" else {}
            reader = reader_cls(
                str(as_path(f.path).parent), glob_pattern=as_path(f.path).name, text_key=f.column, recursive=False, **kw
            )
            writer = DocumentTokenizer(
                self.folder, tokenizer_name_or_path=self.tokenizer, eos_token=self.eos_token, shuffle_documents=False
            )
            writer.run(reader.run(None, 0, 1), rank=i, world_size=len(self.files))


# ----------------------------------------------------------------------- the driver


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
    if (out / MANIFEST).exists():
        try:
            manifest = read_manifest(out, kind="source")
            same = manifest.get("request") == request
            if same:
                PackedSource.open(out)  # shard sizes match the manifest
        except TokpackError:
            same = False
        if same:
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


def _clear(out: Path) -> None:
    for p in out.iterdir():
        if p.name == LOCK_NAME or not _is_ours(p):
            continue  # this command's own lock; what pack did not write (_output_state refused it)
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


NOTES_SHOWN = 10  # pack --link: the inputs copied that the summary names one by one


@dataclass
class PackResult(Result):
    """What `pack --json` prints."""

    output: str
    status: str  # "packed" or "already complete"
    format: str
    inputs: int
    tokens: int
    documents: int
    shards: int
    bytes: int
    input_bytes: int
    seconds: float
    mb_per_s: float | None
    dtype: str
    vocab_size: int
    eos_id: int
    eos_appended: int
    empty_documents_dropped: int
    fingerprint: str
    warnings: list[str]
    # --link only (tokpack.packer.linking.summary): shard files linked (hard links and reflinks),
    # their bytes, the reflinks' bytes among them, the bytes written, and per input copied: why
    linked_files: int | None = optional_field()
    linked_bytes: int | None = optional_field()
    reflinked_bytes: int | None = optional_field()
    copied_bytes: int | None = optional_field()
    link_notes: list[str] | None = optional_field()


def _result(
    manifest: dict,
    out: Path,
    fmt: str,
    seconds: float,
    input_bytes: int,
    status: str,
    warnings: list[str] = (),
    links: dict | None = None,
) -> PackResult:
    return PackResult(
        output=str(out),
        status=status,
        format=fmt,
        inputs=len(manifest.get("inputs", [])),
        tokens=manifest["tokens"],
        documents=manifest["documents"],
        shards=len(manifest["shards"]),
        bytes=sum(s["bytes"] for s in manifest["shards"]),
        input_bytes=input_bytes,
        seconds=round(seconds, 3),
        mb_per_s=round(input_bytes / 1e6 / seconds, 1) if seconds > 0 and input_bytes else None,
        dtype=manifest["dtype"],
        vocab_size=manifest["vocab_size"],
        eos_id=manifest["eos_id"],
        eos_appended=manifest.get("eos_appended", 0),
        empty_documents_dropped=manifest.get("empty_documents_dropped", 0),
        fingerprint=manifest["fingerprint"],
        warnings=list(warnings),
        **(links or {}),
    )


# An input this large packed as one document is a wrong --eos-id, not a book (issue 32: a raw
# file of 3.4M tokens packed as "1 document").
ONE_DOCUMENT_TOKENS = 1 << 20


def eos_warnings(parts: list[dict], eos_id: int) -> list[str]:
    """The `tokpack pack:` lines for an EOS id that looks wrong, per input: no EOS in a large
    input (it became one document), or EOS appended to every document of an input whose
    documents all end with one other id (that id is likely its EOS)."""
    lines = []
    for part in parts:
        name, docs, appended = part.get("input"), part.get("documents", 0), part.get("eos_appended", 0)
        if docs == 1 and appended == 1 and part.get("tokens", 0) >= ONE_DOCUMENT_TOKENS:
            lines.append(
                f"tokpack pack: {name}: no EOS id {eos_id} in its {part['tokens'] - 1:,} tokens, so it is "
                f"packed as one document. HINT: pass the id its documents end with as --eos-id (or "
                f"--tokenizer tokenizer.json), then pack again with --overwrite"
            )
        elif docs >= 2 and appended == docs and isinstance(part.get("end_id"), int):
            lines.append(
                f"tokpack pack: {name}: all {docs:,} of its documents end with id {part['end_id']}, not "
                f"the EOS id {eos_id}, and got an EOS appended each. HINT: if {part['end_id']} is its "
                f"end-of-document id, pack again with --eos-id {part['end_id']} --overwrite"
            )
    return lines


def _raise_task_error(work: Path, out: Path, created: bool, cause: BaseException | None, to: Output) -> None:
    """A task's data error: remove the partial output and raise the task's own message."""
    errors = sorted(work.glob("part-*.error.json")) if work.exists() else []
    if not errors:
        if cause is not None:
            raise cause
        return
    err = json.loads(read_limited(errors[0], MAX_RECORD_BYTES, "record"))
    to.remove_tree(work)
    if created and out.exists() and not any(out.iterdir()):
        out.rmdir()
    raise TokpackError(
        err["message"],
        file=err.get("file"),
        where=err.get("where"),
        expected=err.get("expected"),
        found=err.get("found"),
        hint=err.get("hint"),
    ) from None


def _finalize(out: Path, work: Path, plan: dict, to: Output) -> dict:
    """Moves the parts' shards to their global names (inside the store, to a bucket), then
    writes tokpack.json last."""
    manifest = plan["manifest"]
    for src, dst, size in plan["moves"]:
        src, dst = (to.where(out / p) for p in (src, dst))
        if src.exists():
            src.replace(dst)
        elif not dst.exists() or (size is not None and dst.stat().st_size != size):
            raise TokpackError(
                "a shard disappeared while finishing the pack",
                file=dst,
                expected="the moved shard",
                found="nothing",
                hint="rerun with --overwrite to pack again from scratch",
            )
    to.finish(out, manifest)
    to.remove_tree(work)
    return manifest


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
    input_format, column, dtype, tokenizer = options.input_format, options.column, options.dtype, options.tokenizer
    eos_id, vocab_size, overwrite, shard_tokens = (
        options.eos_id,
        options.vocab_size,
        options.overwrite,
        options.shard_tokens,
    )
    if shard_tokens < 1:
        raise TokpackError("shard size must be positive", where="--shard-tokens", expected=">= 1", found=shard_tokens)
    if tokenizer is not None:
        tokenizer = str(Path(tokenizer).absolute()) if os.path.isfile(tokenizer) else tokenizer
        load_tokenizer(tokenizer)
    fmt, files = discover(list(inputs), input_format, column, dtype)
    say(
        f"tokpack pack: detected format {fmt}: {counted(len(files), 'file')}, "
        f"{', '.join(sorted({f.format + (' ' + f.dtype if f.dtype else '') for f in files}))}"
    )
    request = {
        "inputs": [
            {"path": f.path if is_url(f.path) else str(Path(f.path).absolute()), "size": f.size, "format": f.format}
            for f in files
        ],
        "format": fmt,
        "column": column,
        "dtype": dtype,
        "tokenizer": tokenizer,
        "eos_id": eos_id,
        "vocab_size": vocab_size,
        "shard_tokens": int(shard_tokens),
    }
    # `link` is not in the request: a linked pack's manifest and bytes are a copying pack's
    setup = PackSetup(
        fmt, files, tokenizer, request, _output_state(to.where(out), request, overwrite), link=options.link
    )
    if setup.state == "complete":
        return setup
    if fmt == "text":
        if tokenizer is None:
            raise TokpackError(
                "raw text needs a tokenizer",
                file=files[0].path,
                where="--tokenizer",
                expected="a local tokenizer.json",
                found="none",
                hint="pass --tokenizer tokenizer.json",
            )
        resolved = resolve_vocab_eos(files, tokenizer, eos_id, vocab_size)
        setup.vocab, setup.eos, setup.tok_name, setup.eos_token = resolved
        if setup.eos_token is None:
            raise TokpackError(
                "EOS id is not a token of the tokenizer",
                file=tokenizer,
                where="--eos-id",
                expected="an id the tokenizer knows",
                found=eos_id,
            )
    else:
        known: list = []
        setup.vocab, setup.eos, setup.tok_name, _ = resolve_vocab_eos(
            files, tokenizer, eos_id, vocab_size, say, setup.warnings, known
        )
        setup.vocab_known = bool(known and known[0])
        for f in files:
            check_input(f)
    setup.out_dtype = dtype_for_vocab(setup.vocab)
    return setup


def _say_result(result: PackResult, warnings: list[str], link: bool, shown, say) -> None:
    """pack's lines for a person, after the work: a pack that fails prints its one error line only."""
    for line in warnings:
        say(line)
    notes = result.link_notes or []
    for note in notes[:NOTES_SHOWN]:  # all of them are in --json's link_notes
        say(f"tokpack pack: {note}")
    if len(notes) > NOTES_SHOWN:
        say(
            f"tokpack pack: {counted(len(notes) - NOTES_SHOWN, 'more input')} copied (--json lists them under link_notes)"
        )
    say(
        f"tokpack pack: {result.tokens:,} token{'s' * (result.tokens != 1)}, {result.documents:,} "
        f"document{'s' * (result.documents != 1)}, {result.shards} shard{'s' * (result.shards != 1)} "
        f"-> {shown} ({result.mb_per_s} MB/s)"
        + (
            ""
            if not link
            else f"; linked {counted(result.linked_files, 'file')}, {result.linked_bytes:,} bytes"
            f", copied {result.copied_bytes:,} bytes"
        )
    )


@locked_output("pack")
def pack(
    inputs: list[str],
    output: str,
    options: PackOptions | None = None,
    *,
    log=None,
    config: ExecutorConfig | None = None,
    block_bytes: int = BLOCK_BYTES,
    to: Output = LocalOutput(),
    **settings,
) -> PackResult:
    """Packs INPUTs (local paths or fsspec URLs, read where they are) into one packed source at
    the local `output`, or, `to` another Output (tokpack.formats.outputs), where it sends them from
    there (tokpack.packer.api.pack picks the Output). `options`: what the pack makes (PackOptions;
    tests may give its fields as keywords instead)."""
    options = options or PackOptions(**settings)
    link, shard_tokens = options.link, options.shard_tokens
    t0 = time.perf_counter()
    say = log or (lambda msg: None)
    out = Path(output).absolute()
    config = config or ExecutorConfig()
    setup = setup_pack(inputs, out, options, say=say, to=to)
    fmt, files, tokenizer, request, state = setup.fmt, setup.files, setup.tokenizer, setup.request, setup.state
    input_bytes = sum(f.size for f in files)
    shown = to.shown(out)  # where the packed source is
    if state == "complete":
        manifest = read_manifest(to.where(out), kind="source")
        # A pack killed between writing its manifest and removing its scratch left the scratch.
        to.remove_tree(out / WORK_DIR)
        say(f"tokpack pack: {shown} already holds this pack; nothing to do")
        return _result(
            manifest,
            shown,
            fmt,
            time.perf_counter() - t0,
            0,
            "already complete",
            links=link_summary([]) if link else None,
        )

    work = out / WORK_DIR
    vocab, eos, tok_name, eos_token, warnings = setup.vocab, setup.eos, setup.tok_name, setup.eos_token, setup.warnings
    out_dtype = setup.out_dtype
    ntasks = pack_tasks(len(files), config)
    check_space(
        [(out, setup.bytes_to_write(out, to, ntasks))], "pack", hint="free some space there, or choose another -o"
    )

    # Nothing has been written so far; from here on, OUT/.tokpack-work holds the run.
    created = not out.exists()
    if state in ("fresh", "replace"):  # an old pack goes (to a bucket, a stale local copy too: the store decides)
        to.start(out, _clear, replace=state == "replace")
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(exist_ok=True)
    if not (work / "request.json").exists():
        write_bytes_atomic(work / "request.json", json.dumps(request).encode())
        to.send_record(work / "request.json")
    for p in work.glob("part-*.error.json"):
        p.unlink()
    base_logs = Path(config.logging_dir) if config.logging_dir else work / "logs"

    plan_path = work / "finalize.json"
    if not plan_path.exists():
        if fmt == "text":
            text_dir = work / "text"
            run_steps(
                [
                    (
                        TokenizeTextStep(files, str(text_dir), tokenizer, eos_token),
                        len(files),
                        "tokenize",
                        base_logs / "tokenize",
                    )
                ],
                config,
            )
            _, packed_files = discover([str(text_dir)], "datatrove", None, None)
            for f in packed_files:
                check_input(f)
        else:
            packed_files = files
        step = PackStep(
            packed_files, str(work), vocab, eos, out_dtype.name, tok_name, int(shard_tokens), block_bytes, to, link=link
        )
        ntasks = pack_tasks(len(packed_files), config)
        if runs_in_process(config):
            step.overall = progress(sum(f.size for f in packed_files), f"pack: {counted(len(packed_files), 'file')}")
        try:
            run_steps([(step, ntasks, "pack", base_logs / "pack")], config)
        except Exception as e:
            _raise_task_error(work, out, created, e, to)
        finally:
            if step.overall is not None:
                step.overall.close()
                step.overall = None
        _raise_task_error(work, out, created, None, to)
        parts = []
        for i in range(len(packed_files)):
            part_json = work / f"part-{i:05d}.json"
            part = read_record(part_json)
            if part is None:
                raise TokpackError(
                    "a pack task finished without its part record, or it is damaged",
                    file=part_json,
                    hint="rerun the same command to redo it",
                )
            parts.append(part)
        total = sum(len(p["shards"]) for p in parts)
        if total == 0:
            to.remove_tree(work)
            if created and out.exists() and not any(out.iterdir()):
                out.rmdir()
            raise TokpackError(
                "empty input: no documents",
                file=", ".join(inputs),
                expected="at least one document",
                found="0 tokens",
                hint="check the inputs (and --column)",
            )
        digits = shard_digits(total)
        entries, moves = [], []
        for i, part in enumerate(parts):
            for e in part["shards"]:
                name = shard_name(len(entries), digits)
                for suffix in shard_suffixes(e):
                    src = work / f"part-{i:05d}" / f"{e['path']}{suffix}"
                    size = e["tokens"] * out_dtype.itemsize if suffix == "" else None
                    # relative to OUT: a rerun elsewhere (another scratch folder for a URL) finds them
                    moves.append((src.relative_to(out).as_posix(), f"{name}{suffix}", size))
                entries.append({**e, "path": name})
        manifest = source_manifest(
            entries,
            out_dtype,
            vocab,
            eos,
            tok_name,
            inputs=[{"path": r["path"], "size": r["size"], "format": r["format"]} for r in request["inputs"]],
            shard_tokens=int(shard_tokens),
            eos_appended=sum(p["eos_appended"] for p in parts),
            empty_documents_dropped=sum(p["empty_documents_dropped"] for p in parts),
            created_by=_version(),
            request=request,
            **({} if setup.vocab_known else {"vocab_known": False}),  # absent when known, as in older manifests
        )
        write_bytes_atomic(
            plan_path,
            json.dumps(
                {
                    "manifest": manifest,
                    "moves": moves,
                    "links": link_summary(parts),
                    "warnings": eos_warnings(parts, eos),
                }
            ).encode(),
        )
        to.send_record(plan_path)  # from here a rerun only finishes the moves
    plan = read_record(plan_path)
    if plan is None:
        raise TokpackError(
            "pack's finishing record is damaged: the shards it moved cannot be found again",
            file=plan_path,
            hint="rerun with --overwrite to pack again from scratch",
        )
    manifest = _finalize(out, work, plan, to)
    warnings = [*warnings, *plan.get("warnings", [])]
    seconds = time.perf_counter() - t0
    result = _result(
        manifest,
        shown,
        fmt,
        seconds,
        input_bytes,
        "packed",
        warnings,
        links=plan.get("links", link_summary([])) if link else None,
    )
    _say_result(result, warnings, link, shown, say)
    return result
