"""What `tokpack pack` says when done: its result (PackResult, what --json prints), the lines for a
person, the warning of an EOS id that looks wrong (eos_warnings) and the refusal of one that is
(check_document_ends)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokpack.formats.errors import TokpackError
from tokpack.formats.units import counted
from tokpack.packer.shared import Result, optional_field


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
    input (it became one document; the data is packed as asked)."""
    lines = []
    for part in parts:
        name, docs, appended = part.get("input"), part.get("documents", 0), part.get("eos_appended", 0)
        if docs == 1 and appended == 1 and part.get("tokens", 0) >= ONE_DOCUMENT_TOKENS:
            lines.append(
                f"tokpack pack: {name}: no EOS id {eos_id} in its {part['tokens'] - 1:,} tokens, so it is "
                f"packed as one document. HINT: pass the id its documents end with as --eos-id (or "
                f"--tokenizer tokenizer.json), then pack again with --overwrite"
            )
    return lines


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


def say_result(result: PackResult, warnings: list[str], link: bool, shown, say) -> None:
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
