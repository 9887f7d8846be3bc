"""`tokpack pack`: tokenized inputs -> one packed source (docs/COMMANDS.md, "Packing"), and what
it says when done: its result (PackResult, what --json prints), the lines for a person, the warning
of an EOS id that looks wrong (eos_warnings) and the refusal of one that is (check_document_ends).

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
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokpack import __version__
from tokpack.formats.errors import TokpackError
from tokpack.formats.constants import SOURCE, WORK_DIR
from tokpack.formats.guard import check_space, locked_output
from tokpack.formats.inputs import BLOCK_BYTES, InputFile, input_stamp
from tokpack.formats.inputs.discover import check_input, discover, read_blocks
from tokpack.formats.inputs.tables import table_rows
from tokpack.formats.io.gate import read_record
from tokpack.formats.io.paths import as_path
from tokpack.formats.io.progress_log import progress
from tokpack.formats.io.writes import write_bytes_atomic
from tokpack.formats.reading import read_manifest
from tokpack.formats.names import shard_digits, shard_name
from tokpack.formats.outputs import LocalOutput, Output, ShardPlace, SourceShardFormat
from tokpack.formats.shards import shard_suffixes
from tokpack.formats.units import counted
from tokpack.packer.shared import ExecutorConfig, Result, optional_field
from tokpack.packer.executors import PipelineStep, run_steps, runs_in_process
from tokpack.packer.linking import link_part, summary as link_summary
from tokpack.packer.vocab import Normalizer
from tokpack.packer.pack_setup import PackOptions, PackSetup, clear_output, pack_tasks, setup_pack


# The manifest's created_by: the version tokpack/__init__.py looked up; a checkout never installed has none to name
CREATED_BY = "tokpack" if __version__ == "0+unknown" else f"tokpack {__version__}"


# ------------------------------------------------------------------------ the task


class PackStep(PipelineStep):
    """Packs input files `rank, rank + world_size, ...` into `work/part-NNNNN/` (N = file number)."""

    name = "📦 tokpack pack"
    type = "🔢 - TOKENIZER"

    def __init__(
        self,
        files: list[InputFile],
        work: str,
        setup: PackSetup,
        options: PackOptions,
        block_bytes: int = BLOCK_BYTES,
        output: Output = LocalOutput(),
    ):
        super().__init__()
        self.files = files  # every input file, in input order
        self.work = work  # OUT/.tokpack-work
        self.setup = setup  # vocabulary, EOS id, output dtype, tokenizer name (into each shard's .ds.metadata)
        self.options = options  # shard_tokens (a shard's most, but for one oversized document), link, append_eos
        self.block_bytes = block_bytes  # input bytes per read block
        self.output = output  # where the shards go (tokpack.formats.outputs): to a bucket, each is sent once written
        # The bar over every file, next to each file's own, when the ranks run in the command's
        # process (never pickled to a worker); moved by whole files: a JSONL block's bytes are not known.
        self.overall = None

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        for i in range(rank, len(self.files), world_size):
            try:
                # checked here, on a resumed part too: the driver writes no manifest for a refused input
                check_document_ends(self.pack_file(i), self.setup.eos, self.options.append_eos)
            except TokpackError as e:
                write_bytes_atomic(Path(self.work) / f"part-{i:05d}.error.json", json.dumps(e.to_json()).encode())
                raise
            if self.overall is not None:
                self.overall.update(self.files[i].size)

    def pack_file(self, i: int) -> dict:
        f, out_dtype = self.files[i], self.setup.out_dtype
        part_dir = Path(self.work) / f"part-{i:05d}"
        part_json = Path(self.work) / f"part-{i:05d}.json"
        part = read_record(part_json)  # a damaged record: the file is packed again
        stamp = input_stamp(f)  # taken before reading: a change while it is read shows at the rerun
        if part is not None and part.get("stamp") == stamp:  # else the input changed since: packed again
            shards = part.get("shards")
            if isinstance(shards, list) and all(self.output.has(part_dir, e, out_dtype.itemsize) for e in shards):
                return part  # done by an earlier run
        part_json.unlink(missing_ok=True)
        if part_dir.exists():
            shutil.rmtree(part_dir)
        self.output.remove_sent(part_dir)
        part_dir.mkdir(parents=True)
        copied = None  # pack --link: why this input is copied, not linked
        if self.options.link:
            part, copied = (
                (None, "the output is an object store")
                if not self.output.links_files
                else link_part(
                    f,
                    part_dir,
                    self.setup.vocab,
                    self.setup.eos,
                    out_dtype,
                    self.setup.tok_name,
                    self.options.shard_tokens,
                    self.block_bytes,
                )
            )
            if part is not None:
                return self._record(part_json, {**part, "stamp": stamp})
            check_space([(part_dir, f.size)], "pack", hint=f"{f.path} is copied: {copied}")
        norm = Normalizer(f, self.setup.vocab, self.setup.eos, out_dtype)
        with_loss = bool(f.extra.get("loss"))
        entries: list[dict] = []
        writer = None

        def close_shard() -> None:
            nonlocal writer
            entry, writer = writer.close(), None  # committed through the Output: to a bucket, sent
            entries.append(entry)

        fmt = SourceShardFormat(out_dtype, self.setup.tok_name, with_loss)
        in_itemsize = np.dtype(f.dtype).itemsize if f.dtype else 0
        bar = progress(f.size, f"pack {Path(f.path).name}")
        blocks = None  # the reader's generator, closed explicitly on failure
        try:
            blocks = read_blocks(f, self.setup.eos, self.block_bytes)
            for block in blocks:
                in_bytes = len(block.tokens) * in_itemsize
                tokens, ends, loss = norm(block)
                done = 0  # documents of this block already written
                while done < len(ends):
                    if writer is None:
                        k = len(entries)
                        writer = self.output.open_shard(ShardPlace(str(part_dir), shard_name(k), k, part=i), fmt)
                    base = int(ends[done - 1]) if done else 0
                    stop = int(np.searchsorted(ends, base + self.options.shard_tokens - writer.tokens, side="right"))
                    if stop == done:
                        if writer.tokens:  # the next document does not fit: start a new shard
                            close_shard()
                            continue
                        stop = done + 1  # a document larger than a shard: a shard of its own
                    end = int(ends[stop - 1])
                    writer.write(tokens[base:end], ends[done:stop] - base, None if loss is None else loss[base:end])
                    done = stop
                    if writer.tokens >= self.options.shard_tokens:
                        close_shard()
                bar.update(in_bytes)
            if writer is not None and writer.tokens:
                close_shard()
            elif writer is not None:
                writer.abort()
            if input_stamp(f) != stamp:  # written to while read: the shards may mix old and new bytes
                raise TokpackError(
                    "input changed while pack read it",
                    file=f.path,
                    expected="size, mtime and inode as when pack began reading it",
                    found="changed",
                    hint="rerun once nothing writes to the input",
                )
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
            "stamp": stamp,
        }
        if copied is not None:
            part["link"] = {"how": "copy", "why": copied}
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
            # named so that a log says which phase runs (it takes most of a text pack's time): for JSONL,
            # bytes of its text out of the file's size; for Parquet, documents out of its footer's row
            # count; for Arrow, documents
            name = f"tokenize {Path(f.path).name}"
            bar = progress(f.size, name) if kind == "jsonl" else progress(table_rows(f), name, unit="document")
            with bar:
                docs = counted_documents(reader.run(None, 0, 1), bar, f.size if kind == "jsonl" else None)
                writer.run(docs, rank=i, world_size=len(self.files))


def counted_documents(docs, bar, jsonl_size: int | None):
    """`docs` as they are read, each counted on `bar` (the tokenize bar's): a JSONL file's document
    counts its text's bytes and its line's end (`jsonl_size`: the file's), short of the file's by
    the JSON syntax and the other fields, so the bar reaches the file's size at its end, not
    before; another's counts 1."""
    done = 0
    for doc in docs:
        yield doc
        n = 1 if jsonl_size is None else len(doc.text.encode("utf-8", "replace")) + 1
        done += n
        bar.update(n)
    if jsonl_size is not None:
        bar.update(max(0, jsonl_size - done))


# ----------------------------------------------------------------------- the result


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


def pack_result(
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
        shards=len(manifest["shards"]),
        bytes=sum(s["bytes"] for s in manifest["shards"]),
        input_bytes=input_bytes,
        seconds=round(seconds, 3),
        mb_per_s=round(input_bytes / 1e6 / seconds, 1) if seconds > 0 and input_bytes else None,
        # the manifest's own figures, named as there
        **{k: manifest[k] for k in ("tokens", "documents", "dtype", "vocab_size", "eos_id", "fingerprint")},
        **{k: manifest.get(k, 0) for k in ("eos_appended", "empty_documents_dropped")},
        warnings=list(warnings),
        **(links or {}),
    )


# An input this large packed as one document is a wrong --eos-id, not a book (issue 32: a raw
# file of 3.4M tokens packed as "1 document").
ONE_DOCUMENT_TOKENS = 1 << 20


def eos_warnings(parts: list[dict], eos_id: int) -> list[str]:
    """The `tokpack pack:` lines for an EOS id that looks wrong, per input: no EOS in a large
    input (it became one document; the data is packed as asked)."""
    return [
        f"tokpack pack: {p.get('input')}: no EOS id {eos_id} in its {p['tokens'] - 1:,} tokens, so it is "
        f"packed as one document. HINT: pass the id its documents end with as --eos-id (or "
        f"--tokenizer tokenizer.json), then pack again with --overwrite"
        for p in parts
        if p.get("documents", 0) == 1 and p.get("eos_appended", 0) == 1 and p.get("tokens", 0) >= ONE_DOCUMENT_TOKENS
    ]


def check_document_ends(part: dict, eos_id: int, append_eos: bool) -> None:
    """Refuses an input (a pack task's part record) whose every document lacked the EOS id and
    ended with one same other id: that id is its EOS and --eos-id is wrong (issue 42, item 8: a
    warning let CI pass a corpus whose documents were never separated as meant). With
    `append_eos` the user asked for an EOS after each document, so it is packed."""
    docs, appended, end_id = part.get("documents", 0), part.get("eos_appended", 0), part.get("end_id")
    # 2 documents at least: one document ending with some id says nothing about the EOS
    if append_eos or docs < 2 or appended != docs or not isinstance(end_id, int):
        return
    raise TokpackError(
        "no document ends with the EOS id",
        file=part.get("input"),
        where=f"last token of each of its {docs:,} documents",
        expected=f"{eos_id} (--eos-id)",
        found=f"{end_id} ending all {docs:,}",
        hint=f"if {end_id} is its EOS, pass --eos-id {end_id}; to pack it as is, an EOS {eos_id} appended "
        "to each document, pass --append-eos",
    )


def say_result(result: PackResult, say) -> None:
    """pack's lines for a person, after the work: a pack that fails prints its one error line only."""
    for line in result.warnings:
        say(line)
    notes = result.link_notes or []
    for note in notes[:NOTES_SHOWN]:  # all of them are in --json's link_notes
        say(f"tokpack pack: {note}")
    if len(notes) > NOTES_SHOWN:
        say(
            f"tokpack pack: {counted(len(notes) - NOTES_SHOWN, 'more input')} copied (--json lists them under link_notes)"
        )
    say(
        f"tokpack pack: {counted(result.tokens, 'token')}, {counted(result.documents, 'document')}, "
        f"{result.shards} shard{'s' * (result.shards != 1)} -> {result.output} ({result.mb_per_s} MB/s)"
        + (
            ""
            if result.linked_files is None
            else f"; linked {counted(result.linked_files, 'file')}, {result.linked_bytes:,} bytes"
            f", copied {result.copied_bytes:,} bytes"
        )
    )


# ----------------------------------------------------------------------- the driver


def _raise_task_error(work: Path, out: Path, created: bool, cause: BaseException | None, to: Output) -> None:
    """A task's data error: remove the partial output and raise the task's own message."""
    errors = sorted(work.glob("part-*.error.json")) if work.exists() else []
    if not errors:
        if cause is not None:
            raise cause
        return
    err = read_record(errors[0])
    if err is None or not isinstance(err.get("message"), str):  # damaged: what failed is unknown, not a crash
        err = {"message": "a pack task failed, and its error record is damaged", "file": str(errors[0])}
        err["hint"] = "run the same pack command again; if it fails again, the task's own error is reported"
    to.remove_tree(work)
    if created and out.exists() and not any(out.iterdir()):
        out.rmdir()
    raise TokpackError(
        err["message"], **{k: err.get(k) for k in ("file", "where", "expected", "found", "hint")}
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


@locked_output("pack")
def pack(
    inputs: list[str],
    output: str,
    options: PackOptions,
    *,
    log=None,
    config: ExecutorConfig | None = None,
    block_bytes: int = BLOCK_BYTES,
    to: Output = LocalOutput(),
) -> PackResult:
    """Packs INPUTs (local paths or fsspec URLs, read where they are) into one packed source at
    the local `output`, or, `to` another Output (tokpack.formats.outputs), where it sends them from
    there (tokpack.packer.api.pack picks the Output). `options`: what the pack makes."""
    t0 = time.perf_counter()
    say = log or (lambda msg: None)
    out = Path(output).absolute()
    config = config or ExecutorConfig()
    setup = setup_pack(inputs, out, options, say=say, to=to)
    input_bytes = sum(f.size for f in setup.files)
    shown = to.shown(out)  # where the packed source is
    if setup.state == "complete":
        manifest = read_manifest(to.where(out), kind=SOURCE)
        # A pack killed between writing its manifest and removing its scratch left the scratch.
        to.remove_tree(out / WORK_DIR)
        say(f"tokpack pack: {shown} already holds this pack; nothing to do")
        return pack_result(
            manifest,
            shown,
            setup.fmt,
            time.perf_counter() - t0,
            0,
            "already complete",
            links=link_summary([]) if options.link else None,
        )

    work = out / WORK_DIR
    ntasks = pack_tasks(len(setup.files), config)
    check_space(
        [(out, setup.bytes_to_write(out, to, ntasks))], "pack", hint="free some space there, or choose another -o"
    )

    # Nothing has been written so far; from here on, OUT/.tokpack-work holds the run.
    created = not out.exists()
    if setup.state in ("fresh", "replace"):  # an old pack goes (to a bucket, a stale local copy too: the store decides)
        to.start(out, clear_output, replace=setup.state == "replace")
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(exist_ok=True)
    if not (work / "request.json").exists():
        write_bytes_atomic(work / "request.json", json.dumps(setup.request).encode())
        to.send_record(work / "request.json")
    for p in work.glob("part-*.error.json"):
        p.unlink()
    base_logs = Path(config.logging_dir) if config.logging_dir else work / "logs"

    plan_path = work / "finalize.json"
    if not plan_path.exists():
        if setup.fmt == "text":
            text_dir = work / "text"
            tokenize = TokenizeTextStep(setup.files, str(text_dir), setup.tokenizer, setup.eos_token)
            run_steps([(tokenize, len(setup.files), "tokenize", base_logs / "tokenize")], config)
            _, packed_files = discover([str(text_dir)], "datatrove", None, None)
            for f in packed_files:
                check_input(f)
        else:
            packed_files = setup.files
        step = PackStep(packed_files, str(work), setup, options, block_bytes, to)
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
                    size = e["tokens"] * setup.out_dtype.itemsize if suffix == "" else None
                    # relative to OUT: a rerun elsewhere (another scratch folder for a URL) finds them
                    moves.append((src.relative_to(out).as_posix(), f"{name}{suffix}", size))
                entries.append({**e, "path": name})
        # vocab_known: absent when known, as in older manifests
        manifest = setup.manifest(entries, CREATED_BY, parts, **({} if setup.vocab_known else {"vocab_known": False}))
        write_bytes_atomic(
            plan_path,
            json.dumps(
                {
                    "manifest": manifest,
                    "moves": moves,
                    "links": link_summary(parts),
                    "warnings": eos_warnings(parts, setup.eos),
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
    result = pack_result(
        manifest,
        shown,
        setup.fmt,
        time.perf_counter() - t0,
        input_bytes,
        "packed",
        [*setup.warnings, *plan.get("warnings", [])],
        links=plan.get("links", link_summary([])) if options.link else None,
    )
    say_result(result, say)
    return result
