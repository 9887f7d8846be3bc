"""The training-side reader: rank r of W, micro-batch m, from any sample, in O(1) state.

An epoch directory is a flat array of samples of `seq_len + 1` tokens, cut into shards of
`shard_samples` rows (docs/FORMAT.md). Several epochs (a run's `epochs`, in order, or a
list of epoch directories) are chained into one stream. Sample g of that stream sits at a
byte offset computed from g and a shard table of O(#shards) integers, so the reader never
builds anything that grows with the step count.

In a run directory, g is the run's consumed-sample number: it lies in epoch g div N
(`EpochNumbering`), whichever epochs are written, so writing a missing epoch later never
moves a sample. A list of epoch directories is numbered from 0 in the order given.

Order (Megatron's pretraining sampler): from consumed sample G, global batch b is the
chained samples [G + b*W*m, G + (b+1)*W*m) and rank r takes [r*m, (r+1)*m) of it. The
order of the stream does not depend on W, so resuming with another W (same global batch,
same G) continues the same sequence. Only complete global batches are served: the stream
stops when fewer than W*m samples remain, so every rank stops at the same step.

This module must not import torch (nor datatrove.utils.dataset, which imports it).
"""

from __future__ import annotations

import importlib
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from tokpack.formats.arguments import flag, text, tokens, whole
from tokpack.formats.errors import TokpackError
from tokpack.formats.io import as_path, contained, is_url, open_read, read_full, read_limited, regular_fd, regular_size
from tokpack.formats.manifest import (
    NODES_SIDECAR,
    dtype_from_name,
    epoch_dir_name,
    has_pad,
    partial_stage_absent,
    read_manifest,
    rows_padded,
    xxh3_128_file,
)
from tokpack.formats.numbering import EpochNumbering, shuffle_command
from tokpack.formats.shards import PAD_DTYPE, PAD_SUFFIX, U64, contained_shard, row_segments
from tokpack.formats.slices import SLICE, RankRows
from tokpack.formats.units import counted

# One contiguous read when the rank's rows are contiguous (W == 1): large enough to keep a
# disk or NFS busy, small enough not to matter next to a training process.
BLOCK_BYTES = 4 << 20
# How far ahead the kernel is asked to fetch (posix_fadvise WILLNEED) when rows are strided.
READAHEAD_BYTES = 8 << 20
# Entries of `.ds.index` read per pread when deriving positions from the index.
INDEX_CHUNK = 8192
# Tokens a block of `most_documents`'s scan: its position arrays (several bytes a token) stay
# about a MB, within what `tokpack inspect --memory` allows beside its plan.
SCAN_TOKENS = 1 << 16
# Open shard files kept at once: the current one and the next, plus slack for index files.
MAX_OPEN_FILES = 4


@dataclass
class ShardTable:
    """Where every sample of the chained stream lives. O(#shards); never grows with the step."""

    paths: list[str]  # shard files, in chained-stream order
    starts: np.ndarray  # int64 [n]: chained index of each shard's first sample
    ends: np.ndarray  # int64 [n]: chained index after each shard's last sample
    epoch_starts: np.ndarray  # int64 [E]: chained index of each epoch's first sample
    epoch_ends: np.ndarray  # int64 [E]: chained index after each epoch's last sample
    epochs: list[int]  # epoch numbers, in chain order
    epoch_dirs: list[str]  # epoch directories, in chain order
    checksums: list[str | None]  # manifest xxh3_128 of each shard (checked with verify=True)
    index_checksums: list[str | None]  # manifest xxh3_128 of each shard's .ds.index

    @property
    def total(self) -> int:
        """End of the chained stream: after the last sample of the last epoch."""
        return int(self.epoch_ends[-1]) if len(self.epoch_ends) else 0

    def shard_of(self, g: int) -> int:
        return int(np.searchsorted(self.starts, g, side="right")) - 1

    def epoch_pos_of(self, g: int) -> int:
        """Position in `epochs` of the epoch holding g, or -1 when no chained epoch holds it."""
        pos = int(np.searchsorted(self.epoch_starts, g, side="right")) - 1
        return pos if pos >= 0 and g < self.epoch_ends[pos] else -1

    def reachable_end(self, g: int) -> int:
        """How far the stream runs from g before an epoch is missing (or the chain ends)."""
        pos = self.epoch_pos_of(g)
        if pos < 0:
            return g
        while pos + 1 < len(self.epochs) and self.epoch_starts[pos + 1] == self.epoch_ends[pos]:
            pos += 1
        return int(self.epoch_ends[pos])


@dataclass
class StreamState:
    """Everything needed to continue a rank's stream: a handful of integers."""

    start: int  # G: chained samples consumed before this stream began (Megatron's consumed_samples)
    step: int  # next global batch b to serve, counted from `start`
    rank: int  # r: this rank takes rows [r*m, (r+1)*m) of every global batch
    world_size: int  # W: data-parallel ranks; a global batch is W*m samples
    micro_batch: int  # m: samples per rank per global batch
    stride: int  # steps advance by this (DataLoader workers split a rank's steps round-robin)
    end_step: int  # first step not served: the chained stream ends, or the caller's count

    def __post_init__(self):
        self.rows = RankRows(self.world_size, self.micro_batch, self.start)  # which samples rank r reads

    @property
    def global_batch(self) -> int:
        return self.rows.global_batch

    def first_sample(self, step: int) -> int:
        """Chained index of this rank's first row in global batch `step`."""
        return self.rows.first(self.rank, step)

    def consumed_after(self, step: int) -> int:
        """consumed_samples once every rank has trained on global batch `step`."""
        return self.rows.first(0, step + 1)


@dataclass
class Sample:
    """One sample as a rank is fed it (for `tokpack read` and tests)."""

    epoch: int  # epoch number
    sample: int  # index of the sample within its epoch
    index: int  # index in the chained stream
    tokens: np.ndarray  # seq_len + 1 tokens


def _close(fd) -> None:
    if isinstance(fd, int):
        os.close(fd)
    else:
        fd.close()


PAD_HINT = "the padding sidecar does not match its manifest (4 bytes a sample); run `tokpack validate` on it"


def _shard_error(message: str, path, **kw) -> TokpackError:
    return TokpackError(
        message, file=path, hint=kw.pop("hint", "restore the file, or run `tokpack validate` on the directory"), **kw
    )


def _positions_from_starts(starts: np.ndarray) -> np.ndarray:
    """starts[i, j] is True where a document fragment begins (always at j == 0); returns each
    token's offset in its fragment. Fragments are long, so repeating each start over its
    fragment is several times faster than a running maximum."""
    m, L = starts.shape
    first = np.flatnonzero(starts.reshape(-1))
    lengths = np.empty_like(first)
    np.subtract(first[1:], first[:-1], out=lengths[:-1])
    lengths[-1] = m * L - first[-1]
    pos = np.arange(m * L, dtype=np.int32)
    pos -= np.repeat(first.astype(np.int32), lengths)
    return pos.reshape(m, L)


def positions_from_eos(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """datatrove's convention: positions restart at 0 on the token AFTER each EOS, and at every row start."""
    tokens = np.atleast_2d(tokens)
    starts = np.zeros(tokens.shape, dtype=bool)
    starts[:, 0] = True
    np.equal(tokens[:, :-1], eos_id, out=starts[:, 1:])
    return _positions_from_starts(starts)


def document_masks(rows: np.ndarray, pad: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(position ids, real-token mask) of [m, L+1] rows whose last `pad[i]` tokens are padding:
    positions restart after each EOS and at the padding, which is one segment of its own (so a
    pad id equal to EOS does not make each pad token a document)."""
    rows = np.atleast_2d(rows)
    m, width = rows.shape
    real = np.arange(width)[None, :] < (width - pad.astype(np.int64))[:, None]
    starts = np.zeros(rows.shape, dtype=bool)
    starts[:, 0] = True
    np.equal(rows[:, :-1], eos_id, out=starts[:, 1:])
    starts[:, 1:] &= real[:, 1:]
    first_pad = np.clip(width - pad.astype(np.int64), 0, width - 1)
    has = pad > 0
    starts[np.flatnonzero(has), first_pad[has]] = True
    return _positions_from_starts(starts), real


def cu_seqlens(positions: np.ndarray) -> np.ndarray:
    """Cumulative document lengths (int32, from 0 to the token count) over a flattened batch of
    position ids, as flash-attn's varlen kernels and FlexAttention document masks take them:
    a document starts wherever its position is 0 (and at every row start)."""
    flat = positions.reshape(-1)
    return np.append(np.flatnonzero(flat == 0), flat.size).astype(np.int32)


def _schedule_end_hint(numbering: EpochNumbering, run_dir=None) -> str:
    """Where a scheduled run's chain ends, and how to train longer (no `shuffle --epoch` can
    write an epoch past its schedule)."""
    k = len(numbering.planned)
    run = "the run's schedule" if run_dir is None else f"the schedule of run {run_dir}"
    return (
        f"{run} plans {k} epoch{'s' * (k != 1)}, ending at sample {numbering.first(k)}: "
        "to train longer, add a stage to the schedule"
    )


def _too_many_documents(first_row: int, row: int, count: int, max_documents: int, locate=None) -> TokpackError:
    g = first_row + row
    where = f"sample {g}"
    if locate is not None:
        try:
            epoch, sample = locate(g)
            where += f" (epoch {epoch}, sample {sample})"
        except IndexError:
            pass
    return TokpackError(
        "a row holds more documents than max_documents",
        where=where,
        expected=f"at most {max_documents} documents (a row's padding is one of them)",
        found=f"{count} documents",
        hint='raise max_documents to the largest count `tokpack inspect` reports ("documents per row") for the epoch',
    )


def fixed_boundaries(positions: np.ndarray, max_documents: int, first_row: int = 0, locate=None) -> dict:
    """The document boundaries of a micro-batch in shapes that do not depend on its rows, so a
    compiled model (torch.compile, CUDA graphs) sees the same shapes every step.

    `positions` [m, L] restart at 0 at each segment (a document, or a row's padding, which is
    one segment of its own). K = `max_documents` segments a row at most:
    - `cu_seqlens` [m*K + 1] int32: the offsets of `cu_seqlens(positions)`, then the total
      repeated (zero-length segments, which varlen attention kernels accept);
    - `max_seqlen` (0-d int32): the longest segment;
    - `doc_lens` [m, K] int32: each row's segment lengths, zero-padded (OLMo-core's form; its
      `get_cumulative_document_lengths(doc_lens)` drops the zeros and gives `cu_seqlens`
      without its repeated tail);
    - `max_doc_lens` [m] int32: each row's longest segment.
    A row of more than K segments is a TokpackError naming the row (chained sample
    `first_row + i`, and its epoch and sample through `locate`), its count and K."""
    m, L = positions.shape
    starts = positions == 0
    counts = starts.sum(axis=1)
    over = np.flatnonzero(counts > max_documents)
    if over.size:
        row = int(over[0])
        raise _too_many_documents(first_row, row, int(counts[row]), max_documents, locate)
    first = np.flatnonzero(starts.reshape(-1))  # every row starts a segment: row i's first is at i*L
    lengths = np.diff(np.append(first, m * L)).astype(np.int32)
    row_of = first // L
    slot = np.arange(first.size) - np.repeat(np.cumsum(counts) - counts, counts)  # segment's index in its row
    doc_lens = np.zeros((m, max_documents), dtype=np.int32)
    doc_lens[row_of, slot] = lengths
    cu = np.full(m * max_documents + 1, m * L, dtype=np.int32)
    cu[: first.size] = first
    return {
        "cu_seqlens": cu,
        "max_seqlen": np.array(lengths.max(), dtype=np.int32),
        "doc_lens": doc_lens,
        "max_doc_lens": doc_lens.max(axis=1),
    }


def most_documents(positions: np.ndarray) -> int:
    """The largest segment count of a row of [n, L] positions (what `max_documents` must cover)."""
    return int((np.atleast_2d(positions) == 0).sum(axis=1).max(initial=0))


def micro_batch(
    rows: np.ndarray,
    pad: np.ndarray | None,
    positions: np.ndarray | None,
    eos_id: int | None,
    *,
    max_documents: int | None = None,
    eod_mask_loss: bool = False,
    first_row: int = 0,
    locate=None,
) -> dict:
    """One micro-batch's training arrays from its [m, L+1] rows (numpy; the torch adapter makes
    each a tensor), the same keys on a best-fit and on a window epoch:

    - `input_ids`, `labels` [m, L] int64: rows[:, :-1] and rows[:, 1:];
    - `loss_mask` [m, L] int64: 1 where the label is a real token; with `pad` (a best-fit
      epoch's padding per row) 0 on padding, whose labels are -100 (torch's ignore_index);
      a window epoch (pad None) has no padding, so all ones;
    - with `positions` ([m, L+1] from the stream, "eos" or "index"; None: none of these keys)
      `position_ids` [m, L] int64, restarting after each EOS (and at a best-fit row's
      padding, one segment of its own) and `cu_seqlens` int32 over the flattened
      micro-batch: [segments + 1], or, with `max_documents`, the fixed shapes of
      `fixed_boundaries` (plus `max_seqlen`, `doc_lens`, `max_doc_lens`).

    What an in-row EOS predicts: the label at an EOS input is the next document's first token
    (the rows are the tokens as they lie), and its loss counts. `eod_mask_loss=True` is
    Megatron's option of that name: the loss at every EOS input is masked (loss_mask 0,
    label -100), so no token is trained on predicting across a document boundary."""
    rows = np.atleast_2d(rows)
    if pad is not None:
        found, real = document_masks(rows, pad, eos_id)
        real = real[:, 1:]  # the label of input j is token j + 1
        positions = None if positions is None else found  # the padding one segment, whatever the stream's
    else:
        real = np.ones((rows.shape[0], rows.shape[1] - 1), dtype=bool)
    labels = rows[:, 1:].astype(np.int64)
    if eod_mask_loss:
        if eos_id is None:
            raise TokpackError(
                "eod_mask_loss needs eos_id, and the epoch manifest has none",
                where="eod_mask_loss",
                hint="leave eod_mask_loss off for this epoch",
            )
        real = real & (rows[:, :-1] != eos_id)
    labels[~real] = -100
    out = {"input_ids": rows[:, :-1].astype(np.int64), "labels": labels, "loss_mask": real.astype(np.int64)}
    if positions is not None:
        pos = positions[:, :-1]
        out["position_ids"] = pos.astype(np.int64)
        if max_documents is None:
            out["cu_seqlens"] = cu_seqlens(pos)
        else:
            out.update(fixed_boundaries(pos, max_documents, first_row, locate))
    return out


# The readers of the directory kinds that are neither a run nor an epoch, by manifest kind: the
# one table SampleReader.open dispatches through (module, class; the class's `open_dir` builds
# it). Each subclasses SampleReader, so this module names it and imports it only when a directory
# of its kind is opened (an import of it here would be a cycle), as tokpack/__init__.py's _PUBLIC
# names the public API: nothing registers itself by being imported.
READERS: dict[str, tuple[str, str]] = {SLICE: ("tokpack.loader.slice_reader", "SliceReader")}


def _padding_present(where: Path, m: dict, s: dict, k: int, f: str, size: int | None) -> None:
    """A best-fit epoch's shard without its `.ds.pad` (unlisted, or listed but gone) is refused at
    open: read as a window epoch, its padding would be trained on as tokens. `size`: the
    sidecar's recorded bytes, None for a shard a partial stage left out."""
    if rows_padded(m) and not has_pad(s):
        raise TokpackError(
            "best-fit epoch shard lacks its padding sidecar: its padding would be trained on as tokens",
            file=where,
            where=f"shards[{k}].pad_xxh3_128",
            expected="the checksum of its .ds.pad",
            found="none",
            hint="run `tokpack validate` on the epoch; restore it or shuffle it again",
        )
    if has_pad(s) and size is not None:
        try:
            regular_size(f + PAD_SUFFIX, size=size, what="padding sidecar", hint=PAD_HINT)
        except FileNotFoundError:
            raise _shard_error(
                "padding sidecar listed in the manifest is missing",
                f + PAD_SUFFIX,
                hint="run `tokpack validate` on the epoch; restore it or shuffle it again",
            ) from None


def reader_class(kind: str) -> type:
    """The SampleReader subclass that reads a directory of manifest kind `kind` (a key of READERS)."""
    module, name = READERS[kind]
    return getattr(importlib.import_module(module), name)


class SampleReader:
    """Sequential reader over chained epoch directories. Open with `SampleReader.open(path)`.

    Every shard's size is checked against its manifest when the reader is built, before any
    sample is returned. With `verify=True`, each shard is checksummed (xxh3_128) the first
    time it is read, before any of its data is returned.
    """

    def __init__(self, table: ShardTable, seq_len: int, dtype: np.dtype, eos_id: int | None, verify: bool = False):
        self.table = table  # the shard table (O(#shards))
        self.seq_len = seq_len  # a sample is seq_len + 1 tokens
        self.dtype = np.dtype(dtype).newbyteorder("<")  # token dtype on disk
        self.eos_id = eos_id  # for positions derived from EOS tokens
        self.verify = verify  # checksum each shard once, when first read
        self.row_tokens = seq_len + 1  # tokens per sample
        self.row_bytes = self.row_tokens * self.dtype.itemsize  # bytes per sample
        self._verified: set[str] = set()  # files already checksummed by this reader
        self.absent: dict[str, str] = {}  # shards a partial `tokpack stage --ranks` left out -> why
        self.pads: list[tuple[str, str] | None] | None = None  # best-fit epochs: per shard its .pad (file, xxh3_128)
        self.sizes: dict[str, int] = {}  # .pad files -> their recorded bytes, checked by the gate at their open
        # (a shard's size is checked when the reader opens: one cut short later still serves the rows it holds)
        self.numbering: EpochNumbering | None = None  # a run's numbering; None: chain order from 0
        self.run: tuple[str, dict] | None = None  # (run directory, run manifest), for the command hints
        self._fds: dict[str, tuple[int, int]] = {}  # open files: path -> (fd, size), at most MAX_OPEN_FILES
        self._hash_buf: bytearray | None = None  # reused by verify
        self._index_buf = np.empty(INDEX_CHUNK, dtype=U64)  # reused by index-derived positions
        self.reads = 0  # pread calls issued (a cost counter: tests check it does not depend on the step)
        self.bytes_read = 0  # bytes returned by those preads

    # ----------------------------------------------------------------- opening

    @classmethod
    def open(cls, path: str | Path | Sequence[str | Path], verify: bool = False) -> "SampleReader":
        """A run directory (its epochs in the order of its manifest's `epochs`), one epoch
        directory, or a list of either, chained in the order given."""
        flag(verify, "verify")
        paths = [path] if isinstance(path, (str, Path)) else list(path)
        epochs: list[tuple[Path, dict]] = []
        absent: dict[str, str] = {}
        numbering = run = None
        for p in paths:
            p = as_path(p)
            manifest = read_manifest(p, kind=("run", "epoch", *READERS))
            if manifest["kind"] in READERS:  # a node slice (loader/slice_reader.py): its ranks' rows, the run's numbers
                if len(paths) != 1:
                    raise TokpackError(
                        "a node slice is read on its own, not chained",
                        file=p,
                        where="paths",
                        expected="one slice directory",
                        found=len(paths),
                    )
                return reader_class(manifest["kind"]).open_dir(p, manifest, verify=verify)
            absent.update(partial_stage_absent(p))
            if manifest["kind"] == "epoch":
                epochs.append((p, manifest))
                continue
            if not is_url(str(p)) and (p / NODES_SIDECAR).is_file():  # its tokens are on the nodes, not here
                raise TokpackError(
                    "this run's tokens are in node slices (shuffle --to-nodes), not in the run",
                    file=p / NODES_SIDECAR,
                    where="dest",
                    expected="a node slice",
                    found="a run that holds manifests and row hashes only",
                    hint=f"open this node's slice, written to {_nodes_dest(p / NODES_SIDECAR)} "
                    "({node}: the node's number), e.g. `tokpack read DEST ...`",
                )
            listed = manifest.get("epochs")
            if not isinstance(listed, list) or not listed:
                raise TokpackError(
                    "run manifest lists no epochs",
                    file=p / "tokpack.json",
                    where="epochs",
                    expected="a non-empty list",
                    found=listed,
                    hint=f"write one with `{shuffle_command(manifest, p, 0)}`",
                )
            if len(paths) == 1:  # a run on its own: its consumed-sample numbers (a chain of several counts from 0)
                numbering, run = EpochNumbering.of_run(manifest, p), (str(p), manifest)
            for e in sorted(int(e) for e in listed):
                d = contained(p, epoch_dir_name(e), manifest=p / "tokpack.json", where=f"epochs ({e})", regular=False)
                m = read_manifest(d, kind="epoch")
                if "seq_len" in manifest and int(m.get("seq_len", -1)) != int(manifest["seq_len"]):
                    raise TokpackError(
                        "epoch seq_len differs from its run",
                        file=d / "tokpack.json",
                        where="seq_len",
                        expected=manifest["seq_len"],
                        found=m.get("seq_len"),
                    )
                if numbering is not None and not (numbering.has(e) and int(m.get("samples", -1)) == numbering.size(e)):
                    raise TokpackError(
                        "epoch size differs from its run's",
                        file=d / "tokpack.json",
                        where="samples",
                        expected=numbering.size(e) if numbering.has(e) else "no such epoch in the run's plan",
                        found=m.get("samples"),
                        hint="the epoch belongs to another run; run `tokpack validate` on the run",
                    )
                epochs.append((d, m))
        return cls.from_manifests(epochs, verify=verify, absent=absent, numbering=numbering, run=run)

    @classmethod
    def from_manifests(
        cls,
        epochs: Sequence[tuple[str | Path, dict]],
        verify: bool = False,
        absent: dict[str, str] | None = None,
        numbering: EpochNumbering | None = None,
        run: tuple[str, dict] | None = None,
    ) -> "SampleReader":
        """Builds the reader from (epoch directory, epoch manifest) pairs, chained in order.
        With a run's `numbering`, epoch e starts at sample numbering.first(e) (epochs in
        increasing order); without one, each epoch starts where the one before it ends.

        The manifests may be built in memory: a test or benchmark can describe a huge
        "virtual" epoch whose shard entries all name one small or sparse real file.
        """
        paths: list[str] = []
        shard_samples: list[int] = []
        epoch_of: list[int] = []
        epoch_sizes: list[int] = []
        epoch_numbers: list[int] = []
        checksums: list[str | None] = []
        index_checksums: list[str | None] = []
        pads: list[tuple[str, str] | None] = []  # per shard: a best-fit epoch's (.pad file, its xxh3_128)
        seq_len = dtype = eos_id = None
        sizes: dict[str, int] = {}  # stat once per distinct file
        pad_sizes: dict[str, int] = {}
        for pos, (directory, m) in enumerate(epochs):
            directory = as_path(directory)
            where = directory / "tokpack.json"
            try:
                e_seq, e_dtype = int(m["seq_len"]), dtype_from_name(m["dtype"])
                e_samples, shards = int(m["samples"]), list(m["shards"])
            except (KeyError, TypeError, ValueError) as err:
                raise TokpackError(
                    "epoch manifest lacks a field the reader needs",
                    file=where,
                    where=str(err),
                    expected="seq_len, dtype, samples, shards",
                    found=sorted(m),
                ) from None
            if int(m.get("token_size", e_dtype.itemsize)) != e_dtype.itemsize:
                raise TokpackError(
                    "token_size disagrees with dtype",
                    file=where,
                    where="token_size",
                    expected=e_dtype.itemsize,
                    found=m.get("token_size"),
                )
            e_eos = m.get("eos_id")
            if seq_len is None:
                seq_len, dtype, eos_id = e_seq, e_dtype, e_eos
            elif (e_seq, e_dtype) != (seq_len, dtype):
                raise TokpackError(
                    "epochs cannot be chained: sample shape differs",
                    file=where,
                    where="seq_len/dtype",
                    expected=f"{seq_len}/{dtype.name}",
                    found=f"{e_seq}/{e_dtype.name}",
                    hint="read these epochs separately",
                )
            elif e_eos != eos_id:  # position ids restart after EOS: one stream, one EOS
                raise TokpackError(
                    "epochs cannot be chained: eos_id differs",
                    file=where,
                    where="eos_id",
                    expected=eos_id,
                    found=e_eos,
                    hint="read these epochs separately",
                )
            row_bytes = (e_seq + 1) * e_dtype.itemsize
            per_shard = m.get("shard_samples")
            total = 0
            for k, s in enumerate(shards):
                f = str(contained_shard(directory, s, k))
                n = int(s["samples"])
                expected = n * row_bytes
                if int(s.get("bytes", expected)) != expected:
                    raise TokpackError(
                        "shard entry is inconsistent: bytes != samples * (seq_len+1) * token_size",
                        file=where,
                        where=f"shards[{k}]",
                        expected=expected,
                        found=s.get("bytes"),
                    )
                if per_shard is not None and k < len(shards) - 1 and n != int(per_shard):
                    raise TokpackError(
                        "only the last shard may hold fewer than shard_samples samples",
                        file=where,
                        where=f"shards[{k}].samples",
                        expected=per_shard,
                        found=n,
                    )
                if absent and f in absent:
                    sizes[f] = expected  # left out by a partial stage: an error only if a rank reads it
                if f not in sizes:
                    try:
                        sizes[f] = regular_size(
                            f,
                            size=expected,
                            what="shard",
                            hint="the shard was truncated or replaced; run `tokpack validate` on the epoch",
                        )
                    except FileNotFoundError:
                        raise _shard_error("shard listed in the manifest is missing", f) from None
                if sizes[f] != expected:  # a file named twice, with two sizes
                    raise _shard_error(
                        "shard size does not match the manifest",
                        f,
                        where="size",
                        expected=f"{expected} bytes",
                        found=f"{sizes[f]} bytes",
                        hint="the shard was truncated or replaced; run `tokpack validate` on the epoch",
                    )
                if has_pad(s):
                    pad_sizes[f + PAD_SUFFIX] = n * PAD_DTYPE.itemsize
                _padding_present(where, m, s, k, f, None if absent and f in absent else n * PAD_DTYPE.itemsize)
                paths.append(f)
                shard_samples.append(n)
                epoch_of.append(pos)
                checksums.append(s.get("xxh3_128"))
                index_checksums.append(s.get("index_xxh3_128"))
                pads.append((f + PAD_SUFFIX, s["pad_xxh3_128"]) if has_pad(s) else None)
                total += n
            if total != e_samples:
                raise TokpackError(
                    "shards do not add up to the epoch's samples",
                    file=where,
                    where="samples",
                    expected=e_samples,
                    found=total,
                )
            epoch_sizes.append(total)
            epoch_numbers.append(int(m.get("epoch", pos)))
        if seq_len is None:
            raise TokpackError("nothing to read", hint="give a run directory or epoch directories")
        if numbering is None:
            epoch_starts = np.concatenate([[0], np.cumsum(epoch_sizes[:-1], dtype=np.int64)]).astype(np.int64)
        else:
            epoch_starts = np.array([numbering.first(e) for e in epoch_numbers], dtype=np.int64)
        epoch_ends = epoch_starts + np.asarray(epoch_sizes, dtype=np.int64)
        if np.any(epoch_starts[1:] < epoch_ends[:-1]):
            raise TokpackError(
                "a run's epochs must be chained in increasing order", where="epochs", found=epoch_numbers
            )
        shard_starts, at, prev = [], 0, -1
        for pos, n in zip(epoch_of, shard_samples):
            if pos != prev:
                at, prev = int(epoch_starts[pos]), pos
            shard_starts.append(at)
            at += n
        shard_starts = np.asarray(shard_starts, dtype=np.int64)
        table = ShardTable(
            paths,
            shard_starts,
            shard_starts + np.asarray(shard_samples, dtype=np.int64),
            epoch_starts,
            epoch_ends,
            epoch_numbers,
            [str(d) for d, _ in epochs],
            checksums,
            index_checksums,
        )
        reader = cls(table, seq_len, dtype, None if eos_id is None else int(eos_id), verify=verify)
        reader.absent = dict(absent or {})
        reader.numbering, reader.run = numbering, run
        reader.pads = pads if any(pads) else None
        reader.sizes = pad_sizes
        return reader

    # -------------------------------------------------------------- positions

    @property
    def total_samples(self) -> int:
        """End of the chain: one past its last sample (in a run, a consumed-sample number)."""
        return self.table.total

    @property
    def epochs(self) -> list[int]:
        return list(self.table.epochs)

    def start_from(self, start_sample: int | None = None, consumed_tokens: int | None = None) -> int:
        """The chained sample G to start from: `start_sample`, or `consumed_tokens // seq_len`
        (each sample trains seq_len tokens). O(1); nothing is replayed. G may be the end of
        the chain; a G in an epoch that is not written is an error naming the command."""
        if start_sample is not None and consumed_tokens is not None:
            raise TokpackError("give at most one of start_sample and consumed_tokens", where="start")
        if isinstance(start_sample, numbers.Integral) and not isinstance(start_sample, bool) and start_sample < 0:
            raise TokpackError("start must not be negative", where="start sample", found=start_sample)
        start_sample = whole(start_sample, "start_sample")
        consumed_tokens = tokens(consumed_tokens, "consumed_tokens")
        g = start_sample if start_sample is not None else (consumed_tokens or 0) // self.seq_len
        if g == self.total_samples or self.table.epoch_pos_of(g) >= 0:
            return g
        missing = self.numbering.locate(g) if self.numbering is not None else None
        if missing is not None:
            raise self.missing_epoch_error(g, missing[0])
        if self.run is not None:  # the run was passed, and its schedule's epochs all end before g
            hint = _schedule_end_hint(self.numbering)
        else:
            parent = as_path(self.table.epoch_dirs[-1]).parent  # the run, when the epochs are still in it
            run = {"kind": "run"} if (parent / "tokpack.json").is_file() else {}
            nxt, numbering = max(self.table.epochs) + 1, None
            if run:
                try:
                    numbering = EpochNumbering.of_run(read_manifest(parent), parent)
                except (TokpackError, OSError):
                    pass  # a run manifest this reader cannot read: the generic hint
            if numbering is not None and not numbering.has(nxt):  # a schedule that ends with these epochs
                hint = _schedule_end_hint(numbering, parent)
            else:
                hint = f"write more epochs (`{shuffle_command(run, parent, nxt)}`) or pass the run directory"
        raise TokpackError(
            "start is beyond the end of the chained epochs",
            file=self.table.epoch_dirs[-1],
            where="start sample",
            expected=f"0..{self.total_samples}",
            found=g,
            hint=hint,
        )

    def missing_epoch_error(self, g: int, epoch: int) -> TokpackError:
        """Sample g lies in `epoch`, which this run does not hold (yet): say which command writes it."""
        run_dir, run = self.run if self.run is not None else (self.table.epoch_dirs[-1], {})
        hint = f"write it with `{shuffle_command(run, run_dir, epoch)}`"
        later = [pos for pos, first in enumerate(self.table.epoch_starts) if first > g]
        if later:  # e.g. a staged copy of some epochs: the user may mean a written one
            hint += (
                f", or start at a written epoch (epoch {self.table.epochs[later[0]]} "
                f"starts at sample {int(self.table.epoch_starts[later[0]])})"
            )
        return TokpackError(
            f"sample {g} is in epoch {epoch}, which is not written yet",
            file=run_dir,
            where=f"epoch {epoch}",
            expected=f"epoch {epoch} among the run's epochs",
            found=self.epochs,
            hint=hint,
        )

    def locate(self, g: int) -> tuple[int, int]:
        """Chained sample g -> (epoch number, sample index within that epoch)."""
        pos = self.table.epoch_pos_of(g)
        if pos < 0:
            raise IndexError(f"sample {g} is in no epoch of this chain")
        return self.table.epochs[pos], int(g - self.table.epoch_starts[pos])

    def epoch_sample(self, g: int) -> tuple[int, int]:
        """(epoch, sample) naming any position G, also one past the last written sample (a
        resume point): the run's numbering, else the chain's (the end is the last epoch's size)."""
        if self.numbering is not None:
            where = self.numbering.locate(g)
            if where is not None:
                return where
        pos = self.table.epoch_pos_of(g)
        if pos < 0:
            pos = len(self.table.epochs) - 1
        return self.table.epochs[pos], int(g - self.table.epoch_starts[pos])

    def position(self, epoch: int, sample: int) -> int:
        """(epoch number, sample within it) -> chained index; sample may equal the epoch's size.
        In a run the epoch need not be written (the position is the run's; reading it is not)."""
        epoch, sample = whole(epoch, "epoch", optional=False), whole(sample, "sample", least=None, optional=False)
        if self.numbering is not None and self.numbering.has(epoch):
            first, size = self.numbering.first(epoch), self.numbering.size(epoch)
        else:
            try:
                pos = self.table.epochs.index(epoch)
            except ValueError:
                raise TokpackError(
                    "epoch not in this reader's chain", where="epoch", expected=self.table.epochs, found=epoch
                ) from None
            first = int(self.table.epoch_starts[pos])
            size = int(self.table.epoch_ends[pos]) - first
        if not 0 <= sample <= size:
            raise TokpackError("sample outside its epoch", where=f"epoch {epoch}", expected=f"0..{size}", found=sample)
        return first + sample

    def steps(self, world_size: int, micro_batch: int, start: int = 0) -> int:
        """Complete global batches from chained sample `start` before the chain ends or an
        epoch is missing (the stream stops, or raises `missing_epoch_error`, there)."""
        return RankRows(world_size, micro_batch, start).batches(self.table.reachable_end(start))

    def blocked_at(self, start: int) -> int | None:
        """Where the stream from `start` meets an epoch that is not written, or None when it
        runs to the end of the chain."""
        end = self.table.reachable_end(start)
        return end if end < self.total_samples else None

    def require_batch(self, world_size: int, micro_batch: int, start: int) -> None:
        """One global batch of W*m samples must be left from `start`, else one line why not."""
        if self.steps(world_size, micro_batch, start):
            return
        raise self.end_error(world_size, micro_batch, start)

    def end_error(self, world_size: int, micro_batch: int, start: int) -> TokpackError:
        """Why no global batch of W*m samples is left from `start` (an epoch not written there,
        or the end of the chain, with the command that writes the next epoch): the line `tokpack
        read` prints at that sample, and what a stream that reaches it raises."""
        gap = self.blocked_at(start)
        if gap is not None:
            return self.missing_epoch_error(gap, self.epoch_sample(gap)[0])
        left = self.total_samples - start
        hint = "start earlier, or use a smaller --world-size/--micro-batch"
        if self.numbering is not None and self.numbering.locate(self.total_samples) is not None:
            nxt = self.epoch_sample(self.total_samples)[0]
            hint += f", or write the next epoch: `{shuffle_command(self.run[1], self.run[0], nxt)}`"
        where = self.run[0] if self.run is not None else self.table.epoch_dirs[-1]
        return TokpackError(
            "less than one global batch left to read",
            file=where,
            where=f"sample {start}",
            expected=f"{counted(world_size * micro_batch, 'sample')} (W*m)",
            found=f"{left} left",
            hint=hint,
        )

    # ------------------------------------------------------------------ files

    def _file(self, path: str) -> tuple[int, int]:
        got = self._fds.get(path)
        if got is None and path in self.absent:
            raise _shard_error(
                "shard was left out by a partial stage",
                path,
                where="tokpack-stage.json",
                expected="a shard this rank reads",
                found=self.absent[path],
                hint="stage again with --ranks including this rank (same --micro-batch), or stage the whole run",
            )
        if got is None:
            if len(self._fds) >= MAX_OPEN_FILES:
                oldest = next(iter(self._fds))
                _close(self._fds.pop(oldest)[0])
            try:  # a URL: a file read at each place asked (pread needs a descriptor)
                rules = dict(size=self.sizes[path], what="padding sidecar", hint=PAD_HINT) if path in self.sizes else {}
                fd = open_read(path, ahead=False, **rules) if is_url(path) else regular_fd(path, **rules)
            except FileNotFoundError:
                raise _shard_error("file disappeared after the reader was opened", path) from None
            got = self._fds[path] = (fd, os.fstat(fd).st_size if isinstance(fd, int) else fd.size)
        return got

    def _check(self, path: str, expected: str | None) -> None:
        """verify=True: the whole file's xxh3_128 against the manifest, once per file."""
        if path in self._verified:
            return
        if not expected:
            raise _shard_error(
                "cannot verify: the manifest has no checksum for this file",
                path,
                where="xxh3_128",
                hint="read without --verify, or rewrite the epoch with a current tokpack",
            )
        if self._hash_buf is None:
            self._hash_buf = bytearray(4 << 20)
        try:
            found = xxh3_128_file(path, self._hash_buf)
        except FileNotFoundError:  # as _file says it (a slice's .ds.pad gone was a raw FileNotFoundError here)
            raise _shard_error("file disappeared after the reader was opened", path) from None
        if found != expected:
            raise _shard_error(
                "checksum mismatch: the shard is corrupt",
                path,
                where="xxh3_128",
                expected=expected,
                found=found,
                hint="restore the file (e.g. `tokpack stage` it again from the original)",
            )
        self._verified.add(path)

    def _pread(self, fd: int, view: memoryview, offset: int, path: str) -> None:
        n = read_full(fd, view, offset)
        self.reads += 1
        self.bytes_read += n
        if n < view.nbytes:
            raise _shard_error(
                "shard is shorter than its manifest says (changed while reading?)",
                path,
                where=f"byte {offset + n}",
                expected=f"{view.nbytes - n} more bytes",
                found="end of file",
            )

    def _segments(self, g: int, n: int) -> Iterator[tuple[int, int, int]]:
        """Splits chained rows [g, g+n) at shard boundaries: (shard, first row in shard, rows)."""
        starts, ends = self.table.starts, self.table.ends
        i = self.table.shard_of(g)
        while n > 0:
            if i < 0 or i >= len(starts) or not starts[i] <= g < ends[i]:
                raise IndexError(f"sample {g} is in no epoch of this chain")
            k = min(n, int(ends[i]) - g)
            yield i, g - int(starts[i]), k
            g += k
            n -= k
            i += 1

    def read_into(self, g: int, out: np.ndarray) -> np.ndarray:
        """Fills `out` ([n, seq_len+1] of the token dtype, C-contiguous) with chained rows [g, g+n)."""
        n = out.shape[0]
        if g < 0 or g + n > self.total_samples:
            raise IndexError(f"rows [{g}, {g + n}) outside the chained stream of {self.total_samples}")
        raw = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        for i, row, k in self._segments(g, n):
            path = self.table.paths[i]
            if self.verify:
                self._check(path, self.table.checksums[i])
            fd, _ = self._file(path)
            self._pread(fd, raw[done : done + k * self.row_bytes], row * self.row_bytes, path)
            done += k * self.row_bytes
        return out

    def read(self, g: int, n: int = 1) -> np.ndarray:
        """Chained rows [g, g+n) as a new [n, seq_len+1] array (random access, for tools and tests)."""
        g, n = whole(g, "g", optional=False), whole(n, "n", optional=False)
        if g + n > self.total_samples:
            raise TokpackError(
                "rows outside the chained stream",
                where="g, n",
                expected=f"g + n <= {self.total_samples}",
                found=f"g={g}, n={n}",
            )
        return self.read_into(g, np.empty((n, self.row_tokens), dtype=self.dtype))

    def advise(self, g: int, n: int) -> None:
        """Asks the kernel to start fetching chained rows [g, g+n) (read-ahead, non-blocking)."""
        n = min(n, self.total_samples - g)
        if n <= 0 or not hasattr(os, "posix_fadvise"):
            return
        for i, row, k in self._segments(g, n):
            fd, _ = self._file(self.table.paths[i])
            if isinstance(fd, int):
                os.posix_fadvise(fd, row * self.row_bytes, k * self.row_bytes, os.POSIX_FADV_WILLNEED)

    @property
    def packed(self) -> bool:
        """Whether any chained epoch is best-fit packed (its samples may end in padding)."""
        return self.pads is not None

    def padding(self, g: int, n: int) -> np.ndarray:
        """Padding tokens at the end of each of chained rows [g, g+n) (uint32; 0 for rows of
        an epoch without a `.ds.pad`). O(1) preads of 4 bytes a row."""
        out = np.zeros(n, dtype=PAD_DTYPE)
        if not self.packed:
            return out
        done = 0
        for i, row, k in self._segments(g, n):
            pad = self.pads[i]
            if pad is not None:
                if self.verify:
                    self._check(pad[0], pad[1])
                fd, _ = self._file(pad[0])
                self._pread(fd, memoryview(out[done : done + k].view(np.uint8)), row * PAD_DTYPE.itemsize, pad[0])
            done += k
        return out

    def micro_batch(
        self,
        rows: np.ndarray,
        positions: np.ndarray | None,
        g: int,
        *,
        max_documents: int | None = None,
        eod_mask_loss: bool = False,
    ) -> dict:
        """The training arrays (`micro_batch`, same keys on every epoch) of chained rows
        [g, g+m) as a stream yielded them: `rows`, and `positions` (None for a stream without).

            stream = reader.batches(r, W, m, start, positions="eos")
            for rows, pos in stream:
                arrays = reader.micro_batch(rows, pos, stream.state.first_sample(stream.last_step), max_documents=K)
        """
        pad = self.padding(g, len(rows)) if self.packed else None
        return micro_batch(
            rows,
            pad,
            positions,
            self.eos_id,
            max_documents=max_documents,
            eod_mask_loss=eod_mask_loss,
            first_row=g,
            locate=self.locate,
        )

    def row_documents(self, g: int, n: int) -> np.ndarray:
        """Each of chained rows [g, g+n)'s segment count, as `micro_batch` counts them against
        `max_documents` (documents of its inputs, and its padding as one)."""
        rows = self.read(g, n)
        if self.packed:
            pos = document_masks(rows, self.padding(g, n), self.eos_id)[0]
        else:
            pos = positions_from_eos(rows, self.eos_id)
        row, offset = np.nonzero(pos == 0)
        return row_segments(row, offset, len(rows), self.row_tokens)

    def most_documents(self, start: int = 0, stop: int | None = None) -> tuple[int, int]:
        """(largest segment count of a row, first chained row that has it) over rows [start,
        stop) (default: the whole chain), read in blocks of SCAN_TOKENS: one pass, O(1) memory.
        The smallest `max_documents` these rows take."""
        stop = self.total_samples if stop is None else stop
        best, where = 0, start
        block = max(1, SCAN_TOKENS // self.row_tokens)
        for g in range(start, stop, block):
            counts = self.row_documents(g, min(block, stop - g))
            i = int(counts.argmax())  # the first row of the block with its largest count
            if counts[i] > best:
                best, where = int(counts[i]), g + i
        return best, where

    def index_positions(self, g: int, n: int) -> np.ndarray:
        """Positions of chained rows [g, g+n) derived from the shards' `.ds.index` (fragment ends),
        with datatrove's convention; equal to `positions_from_eos` on tokpack epochs."""
        L = self.row_tokens
        starts = np.zeros((n, L), dtype=bool)
        starts[:, 0] = True
        flat = starts.reshape(-1)
        done = 0
        for i, row, k in self._segments(g, n):
            path = self.table.paths[i] + ".index"
            if self.verify:
                self._check(path, self.table.index_checksums[i])
            try:
                fd, size = self._file(path)
            except TokpackError:
                if not is_url(path) and os.path.lexists(path):
                    raise  # there, but not a file to read (a FIFO, a device): its own line
                raise _shard_error(
                    "index file is missing (needed for positions from the index)",
                    path,
                    hint="use positions from EOS instead, or restore the file",
                ) from None
            lo, hi = row * L, (row + k) * L
            j = self._index_search(fd, size // 8, lo, path)  # first entry > lo
            entries = size // 8
            while j < entries:
                c = min(INDEX_CHUNK, entries - j)
                buf = self._index_buf[:c]
                self._pread(fd, memoryview(buf.view(np.uint8)), j * 8, path)
                ends = buf[buf < hi].astype(np.int64) - lo  # a fragment starts at each end < hi
                flat[done * L + ends] = True
                if c and buf[c - 1] >= hi:
                    break
                j += c
            done += k
        return _positions_from_starts(starts)

    def _index_search(self, fd: int, entries: int, value: int, path: str) -> int:
        """First entry index whose value is > `value` (binary search with 8-byte preads: O(log n), O(1) memory)."""
        lo, hi = 0, entries
        one = self._index_buf[:1]
        view = memoryview(one.view(np.uint8))
        while lo < hi:
            mid = (lo + hi) // 2
            self._pread(fd, view, mid * 8, path)
            if int(one[0]) > value:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def close(self) -> None:
        for fd, _ in self._fds.values():
            _close(fd)
        self._fds.clear()

    def __enter__(self) -> "SampleReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __getstate__(self):
        # File descriptors do not survive pickling (DataLoader workers): reopen lazily.
        state = dict(self.__dict__)
        state["_fds"] = {}
        state["_hash_buf"] = None
        return state

    # ------------------------------------------------------------------ streams

    def batches(  # noqa: PLR0913 -- the public stream's keywords, each one setting, as packer/api.py's
        self,
        rank: int,
        world_size: int,
        micro_batch: int,
        start: int = 0,
        *,
        positions: str | None = None,
        steps: int | None = None,
        worker: int = 0,
        num_workers: int = 1,
        copy: bool = True,
        first_step: int | None = None,
        at_end: str = "error",
    ) -> "RankStream":
        """Rank r's micro-batches from chained sample `start`: arrays [m, seq_len+1] of the token
        dtype, or (tokens, positions) pairs with positions="eos" or "index".

        `worker`/`num_workers` split the rank's steps round-robin (step b goes to worker
        b % num_workers), for DataLoader workers; `first_step` (default: `worker`) resumes a
        worker's share. `copy=False` yields views of a reused buffer, valid until the next item.
        A stream that reaches an epoch that is not written raises `missing_epoch_error` there.
        One that runs out of written samples before `steps` (None: no count) raises `end_error`
        there, the line `tokpack read` prints at that sample, so a job resumed past the written
        epochs fails instead of training zero steps; `at_end="stop"` ends the stream there.
        """
        rank, world_size, micro_batch = stream_shape(rank, world_size, micro_batch)
        num_workers = whole(num_workers, "num_workers", least=1, optional=False)
        worker = whole(worker, "worker", optional=False)
        steps = whole(steps, "steps")
        if worker >= num_workers:
            raise TokpackError("worker is out of range", where="worker", expected=f"0..{num_workers - 1}", found=worker)
        first_step = worker if first_step is None else whole(first_step, "first_step")
        if first_step % num_workers != worker:
            raise TokpackError(
                "a worker's first step is not its own",
                where="first_step",
                expected=f"a step b with b % {num_workers} == {worker} (worker {worker} of {num_workers})",
                found=first_step,
            )
        text(positions, "positions", choices=(None, "eos", "index"))
        text(at_end, "at_end", optional=False, choices=AT_END)
        if positions == "eos" and self.eos_id is None:
            raise TokpackError(
                "positions from EOS need eos_id, and the epoch manifest has none",
                where="eos_id",
                hint="use positions='index'",
            )
        start = self.start_from(start_sample=start)
        self.serves(rank, world_size, micro_batch, start)
        end = self.steps(world_size, micro_batch, start)
        # The written samples end before the caller's count: an error there (or a stop, when asked).
        short = steps is None or steps > end
        state = StreamState(start, first_step, rank, world_size, micro_batch, num_workers, end if short else steps)
        return RankStream(self, state, positions=positions, copy=copy, at_end=at_end if short else None)

    def serves(self, rank: int, world_size: int, micro_batch: int, start: int) -> None:
        """Raises when this reader cannot serve that rank's stream (a node slice of other ranks)."""

    def rank_samples(
        self, rank: int, world_size: int, micro_batch: int, start: int = 0, count: int | None = None
    ) -> Iterator[Sample]:
        """The samples rank r is fed, one by one, from chained sample `start`; at most `count`,
        as `tokpack read` prints them: no global batch left at `start` is `end_error`, and the
        samples stop at the end of the written epochs (an epoch not written is an error)."""
        count = whole(count, "count")
        if count == 0:
            return
        rank, world_size, micro_batch = stream_shape(rank, world_size, micro_batch)
        self.require_batch(world_size, micro_batch, self.start_from(start_sample=start))
        steps = None if count is None else -(-count // micro_batch)
        left = count
        stream = self.batches(rank, world_size, micro_batch, start, steps=steps, at_end="stop")
        for rows in stream:
            g = stream.state.first_sample(stream.last_step)
            for j in range(len(rows)):
                epoch, sample = self.locate(g + j)
                yield Sample(epoch, sample, g + j, rows[j])
                if left is not None:
                    left -= 1
                    if left == 0:
                        return


# What a stream does where the written samples end: raise `end_error` (the default), or stop.
AT_END = ("error", "stop")


def stream_shape(rank, world_size, micro_batch) -> tuple[int, int, int]:
    """(r, W, m) checked as `read --rank/--world-size/--micro-batch` are: 0 <= r < W, m >= 1."""
    world_size = whole(world_size, "world_size", least=1, optional=False)
    micro_batch = whole(micro_batch, "micro_batch", least=1, optional=False)
    rank = whole(rank, "rank", optional=False)
    if rank >= world_size:
        raise TokpackError("rank is out of range", where="rank", expected=f"0..{world_size - 1}", found=rank)
    return rank, world_size, micro_batch


class RankStream:
    """Iterator over one rank's micro-batches (`SampleReader.batches` builds it, checking its
    arguments). Its position is `state`: a few integers."""

    def __init__(
        self, reader: SampleReader, state: StreamState, *, positions: str | None, copy: bool, at_end: str | None
    ):
        self.reader = reader  # the shared reader (shard table, open files)
        self.state = state
        self.positions = positions  # None, "eos" or "index"
        self.copy = copy  # False: yield views of a reused buffer
        # Where the written samples end before the caller's count: "error" raises `end_error` there,
        # "stop" stops (but an epoch not written, with written ones after it, is an error either
        # way); None: the caller's count of steps ends the stream first.
        self.at_end = at_end
        self.last_step = -1  # global batch of the last item yielded
        m, L = state.micro_batch, reader.row_tokens
        # W == 1 and one worker: the rank's rows are contiguous; read large blocks and slice them.
        self._contiguous = state.world_size == 1 and state.stride == 1
        rows = max(1, BLOCK_BYTES // (m * reader.row_bytes)) * m if self._contiguous else m
        self._buf = np.empty((rows, L), dtype=reader.dtype)  # reused read buffer
        self._buf_start = -1  # chained index of _buf's first row (contiguous mode), -1 when empty
        self._buf_rows = 0  # valid rows in _buf
        # Strided ranks: advise the kernel this many steps ahead.
        self._ahead = max(1, min(64, READAHEAD_BYTES // (m * reader.row_bytes)))
        self._advised = -1  # strided: last step advised; contiguous: chained row advised up to

    def __iter__(self) -> "RankStream":
        return self

    def __next__(self):
        st = self.state
        if st.step >= st.end_step:
            if self.at_end is not None:
                end = st.rows.first(0, st.end_step)  # the first global batch not served
                if self.at_end == "error" or self.reader.blocked_at(end) is not None:
                    raise self.reader.end_error(st.world_size, st.micro_batch, end)
            raise StopIteration
        step = st.step
        g = st.first_sample(step)
        m = st.micro_batch
        r = self.reader
        if self._contiguous:
            if not (self._buf_start <= g and g + m <= self._buf_start + self._buf_rows):
                last = st.first_sample(st.end_step - 1) + m  # end of this stream's rows
                n = min(len(self._buf), last - g)
                # Keep two blocks in flight ahead of the one being read, so the disk never idles.
                ahead = min(last, g + 3 * len(self._buf))
                if ahead > max(self._advised, g + n):
                    lo = max(self._advised, g + n)
                    r.advise(lo, ahead - lo)
                    self._advised = ahead
                r.read_into(g, self._buf[:n])
                self._buf_start, self._buf_rows = g, n
            rows = self._buf[g - self._buf_start : g - self._buf_start + m]
            if self.copy:
                rows = rows.copy()
        else:
            rows = np.empty((m, r.row_tokens), dtype=r.dtype) if self.copy else self._buf
            r.read_into(g, rows)
            first = max(self._advised + st.stride, step + st.stride)
            for s in range(first, min(st.end_step, step + st.stride * (self._ahead + 1)), st.stride):
                r.advise(st.first_sample(s), m)
                self._advised = s
        st.step += st.stride
        self.last_step = step
        if self.positions is None:
            return rows
        if self.positions == "eos":
            return rows, positions_from_eos(rows, r.eos_id)
        return rows, r.index_positions(g, m)


def _nodes_dest(sidecar: Path) -> str:
    """The --to-nodes DEST a run's sidecar names (with {node}), or "the --to-nodes DEST"."""
    import json

    try:
        dest = json.loads(read_limited(sidecar, 1 << 16, "sidecar")).get("dest")
    except (TokpackError, ValueError, AttributeError):
        dest = None
    return dest if isinstance(dest, str) and len(dest) < 4096 else "the --to-nodes DEST"
