"""The reader's batch assembly: from a micro-batch's rows (numpy arrays of token ids, and a
best-fit epoch's padding per row), the arrays a trainer takes: shifted labels, the loss mask,
position ids restarting after each EOS, and the document boundaries (`cu_seqlens`, or the fixed
shapes of `fixed_boundaries`). Pure numpy: no file is read here (tokpack.loader.shard_files
reads the rows), and nothing imports torch.
"""

from __future__ import annotations

from contextlib import suppress

import numpy as np

from tokpack.formats.errors import TokpackError


def positions_from_starts(starts: np.ndarray) -> np.ndarray:
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
    return positions_from_starts(_eos_starts(np.atleast_2d(tokens), eos_id))


def _eos_starts(rows: np.ndarray, eos_id: int) -> np.ndarray:
    """[m, L] bool: True where a fragment begins, at every row start and on the token after each EOS."""
    starts = np.zeros(rows.shape, dtype=bool)
    starts[:, 0] = True
    np.equal(rows[:, :-1], eos_id, out=starts[:, 1:])
    return starts


def document_masks(rows: np.ndarray, pad: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(position ids, real-token mask) of [m, L+1] rows whose last `pad[i]` tokens are padding:
    positions restart after each EOS and at the padding, which is one segment of its own (so a
    pad id equal to EOS does not make each pad token a document)."""
    rows = np.atleast_2d(rows)
    m, width = rows.shape
    real = np.arange(width)[None, :] < (width - pad.astype(np.int64))[:, None]
    starts = _eos_starts(rows, eos_id)
    starts[:, 1:] &= real[:, 1:]
    first_pad = np.clip(width - pad.astype(np.int64), 0, width - 1)
    has = pad > 0
    starts[np.flatnonzero(has), first_pad[has]] = True
    return positions_from_starts(starts), real


def cu_seqlens(positions: np.ndarray) -> np.ndarray:
    """Cumulative document lengths (int32, from 0 to the token count) over a flattened batch of
    position ids, as flash-attn's varlen kernels and FlexAttention document masks take them:
    a document starts wherever its position is 0 (and at every row start)."""
    flat = positions.reshape(-1)
    return np.append(np.flatnonzero(flat == 0), flat.size).astype(np.int32)


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
        g = first_row + int(over[0])
        where = f"sample {g}"
        if locate is not None:
            with suppress(TokpackError):  # a row past the chain: named by its number alone
                epoch, sample = locate(g)
                where += f" (epoch {epoch}, sample {sample})"
        raise TokpackError(
            "a row holds more documents than max_documents",
            where=where,
            expected=f"at most {max_documents} documents (a row's padding is one of them)",
            found=f"{counts[over[0]]} documents",
            hint='raise max_documents to the largest count `tokpack inspect` reports ("documents per row") for the epoch',
        )
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


def eod_mask_needs_eos(eod_mask_loss: bool, eos_id: int | None) -> None:
    """eod_mask_loss masks the loss at each EOS input: an epoch without eos_id is refused."""
    if eod_mask_loss and eos_id is None:
        raise TokpackError(
            "eod_mask_loss needs eos_id, and the epoch manifest has none",
            where="eod_mask_loss",
            hint="leave eod_mask_loss off for this epoch",
        )


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
        real = None  # a window epoch: every label is a real token
    labels = rows[:, 1:].astype(np.int64)
    eod_mask_needs_eos(eod_mask_loss, eos_id)
    if eod_mask_loss:
        real = rows[:, :-1] != eos_id if real is None else real & (rows[:, :-1] != eos_id)
    if real is None:  # nothing to mask: the ones are written, not masked out (no step waits on a mask of all True)
        loss_mask = np.ones(labels.shape, dtype=np.int64)
    else:
        labels[~real] = -100
        loss_mask = real.astype(np.int64)
    out = {"input_ids": rows[:, :-1].astype(np.int64), "labels": labels, "loss_mask": loss_mask}
    if positions is not None:
        pos = positions[:, :-1]
        out["position_ids"] = pos.astype(np.int64)
        if max_documents is None:
            out["cu_seqlens"] = cu_seqlens(pos)
        else:
            out.update(fixed_boundaries(pos, max_documents, first_row, locate))
    return out


# ------------------------------------------------------------- a window epoch's batch, in place
#
# The common case (a window epoch: no padding; positions from EOS or none; no max_documents, no
# eod_mask_loss) written straight into the arrays the caller gives (views of the one buffer a
# batch crosses a process as), each field written once from the rows as read. Its cost is mostly
# the count of numpy calls (a training step leaves the caches cold: each call costs tens of
# microseconds there, more than its bytes), so what is constant for a batch shape is built once
# and the scratch arrays are reused. The values are `micro_batch`'s (tests check it).

WINDOW_KEYS = ("input_ids", "labels", "loss_mask")  # then position_ids and cu_seqlens, with positions
I64, I32 = np.dtype(np.int64), np.dtype(np.int32)


class WindowBatch:
    """Writes window-epoch micro-batches of [m, seq_len+1] rows (one stream's: not shared between
    threads). `eos_id` None: no positions (no position_ids, no cu_seqlens)."""

    def __init__(self, m: int, seq_len: int, eos_id: int | None):
        self.m, self.seq_len, self.eos_id = m, seq_len, eos_id
        if eos_id is not None:
            # Where a segment starts among the [m, L] inputs: each row's first input (always) and
            # each input after an EOS input (the columns from 1, written per batch).
            self._starts = np.zeros((m, seq_len), dtype=bool)
            self._starts[:, 0] = True
            self._narrow = np.min_scalar_type(max(seq_len - 1, 0))  # holds a column: uint16 up to 65,536
            self._columns = np.arange(seq_len, dtype=self._narrow)  # 0..L-1 on each row (broadcast)

    def starts(self, rows: np.ndarray) -> np.ndarray | None:
        """The flat indices, among the [m, L] inputs, where a segment starts (None without
        positions): `cu_seqlens(positions_from_eos(rows, eos_id)[:, :-1])[:-1]`."""
        if self.eos_id is None:
            return None
        np.equal(rows[:, : self.seq_len - 1], self.eos_id, out=self._starts[:, 1:])
        return np.flatnonzero(self._starts)

    def fields(self, starts: np.ndarray | None) -> list[tuple[str, np.dtype, tuple]]:
        """(key, dtype, shape) of the batch whose segments start at `starts`, in `micro_batch`'s order."""
        shape = (self.m, self.seq_len)
        fields = [(key, I64, shape) for key in WINDOW_KEYS]
        if starts is not None:
            fields += [("position_ids", I64, shape), ("cu_seqlens", I32, (len(starts) + 1,))]
        return fields

    def fill(self, out: list[np.ndarray], rows: np.ndarray, starts: np.ndarray | None) -> None:
        """Writes the batch of `rows` (`starts`: `self.starts(rows)`, the call just before) into
        `out`, arrays of `fields(starts)` in its order: `micro_batch(rows, None,
        positions_from_eos(rows, eos_id), eos_id)`'s values."""
        np.copyto(out[0], rows[:, :-1], casting="unsafe")  # input_ids: astype's cast, in place
        np.copyto(out[1], rows[:, 1:], casting="unsafe")  # labels
        out[2].fill(1)  # loss_mask: no padding, every label is a real token
        if starts is None:
            return
        # A position is the input's column less its segment's first column (every row starts a
        # segment, so a segment never spans rows): each segment's first column, repeated over it.
        m, L = self.m, self.seq_len
        cu = out[4]
        cu[:-1] = starts
        cu[-1] = m * L
        first = np.repeat((starts % L).astype(self._narrow), cu[1:] - cu[:-1])
        np.subtract(self._columns, first.reshape(m, L), out=out[3])
