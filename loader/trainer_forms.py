"""Each trainer's form of a TokpackDataset batch (tokpack.loader.torch_adapter): OLMo-core's,
Megatron's (with its PackedSeqParams), a dense document mask, Hugging Face's flattened batch.
Pure torch on the batch's fields: no reader, no file."""

from __future__ import annotations

import torch

from tokpack.formats.errors import TokpackError

# ------------------------------------------------------------- each stack's form
#
# A TokpackDataset batch in the keys and dtypes each trainer takes, from the batch alone (no
# rows are read again), so the conversion runs wherever the batch is: in the training loop, or
# in a DataLoader worker through a `collate_fn`. Each is tested against the stack's own code
# (tests/test_stacks.py). `consumed_samples` is left out: no stack takes it, and a
# StatefulDataLoader's state does not need it.


_BATCH_KEYS = ("input_ids", "labels", "loss_mask", "position_ids", "cu_seqlens")


def _boundaries(batch, form: str, keys: tuple[str, ...] = _BATCH_KEYS) -> dict:
    """The batch, checked to be a TokpackDataset batch with its document boundaries."""
    missing = [k for k in keys if not isinstance(batch, dict) or k not in batch]
    if missing:
        raise TokpackError(
            f"{form} takes a TokpackDataset batch with its document boundaries",
            where=form,
            expected=", ".join(keys),
            found=f"no {', '.join(missing)}" if isinstance(batch, dict) else type(batch).__name__,
            hint="build the dataset with positions='eos' (the default) or 'index'",
        )
    return batch


def _segment_lengths(batch: dict) -> torch.Tensor:
    """The segment lengths of a batch's flattened micro-batch (no zero-length padding)."""
    cu = batch["cu_seqlens"].to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    return lengths[lengths > 0]


def _longest(batch: dict) -> int:
    """The longest segment: the batch's own `max_seqlen` (max_documents), else of its boundaries."""
    return int(batch["max_seqlen"]) if "max_seqlen" in batch else int(_segment_lengths(batch).max())


def _doc_lens(batch: dict) -> torch.Tensor:
    """[m, K] int32, zero-padded: the batch's own (max_documents) or, without it, K = the most
    segments a row of this batch has (OLMo-core's collator pads so)."""
    if "doc_lens" in batch:
        return batch["doc_lens"]
    counts = (batch["position_ids"] == 0).sum(dim=1).tolist()  # every row starts a segment: a row's are its own
    lengths = _segment_lengths(batch).to(torch.int32).split(counts)
    return torch.nn.utils.rnn.pad_sequence(lengths, batch_first=True)  # each row's, zero-padded to the longest


def olmo_core_batch(batch: dict) -> dict:
    """OLMo-core's form: `input_ids` and `labels` [m, L] int64 (labels are tokpack's, shifted,
    -100 where no loss; OLMo-core's train module uses a batch's `labels` as they are),
    `doc_lens` [m, K] int32 zero-padded and `max_doc_lens` (a list of ints, one a row).
    `olmo_core.data.utils.get_cumulative_document_lengths(doc_lens)` is the batch's
    `cu_seqlens` without its repeated tail."""
    batch = _boundaries(batch, "olmo_core_batch")
    doc_lens = _doc_lens(batch)
    return {
        "input_ids": batch["input_ids"],
        "labels": batch["labels"],
        "doc_lens": doc_lens,
        "max_doc_lens": [int(x) for x in doc_lens.max(dim=1).values],
    }


def megatron_batch(batch: dict) -> dict:
    """Megatron-core's GPT batch: `tokens`, `labels` [m, L] int64, `loss_mask` [m, L] float32,
    `position_ids` [m, L] int64 (restarting after each EOS, as `_get_ltor_masks_and_position_ids(
    ..., reset_position_ids=True)` gives them), and the `thd` boundaries `cu_seqlens` int32 and
    `max_seqlen` (an int) that `packed_seq_params` wraps. A label without loss is 0, a valid id
    (Megatron's cross-entropy takes no -100; the loss mask is 0 there). No dense attention
    mask: it is [L, L] a row, and Transformer Engine's attention ignores it (use the thd
    boundaries); `dense_document_mask(batch)` builds Megatron's when a backend wants it."""
    batch = _boundaries(batch, "megatron_batch")
    return {
        "tokens": batch["input_ids"],
        "labels": batch["labels"].clamp(min=0),
        "loss_mask": batch["loss_mask"].to(torch.float32),
        "position_ids": batch["position_ids"],
        "cu_seqlens": batch["cu_seqlens"],
        "max_seqlen": _longest(batch),
    }


def packed_seq_params(batch: dict):
    """megatron.core's `PackedSeqParams` (qkv_format "thd") of a tokpack or `megatron_batch`
    batch: cu_seqlens_q/kv the int32 boundaries over the flattened micro-batch, max_seqlen_q/kv
    the longest segment. With max_documents the boundaries end in zero-length segments."""
    batch = _boundaries(batch, "packed_seq_params", ("cu_seqlens",))
    from megatron.core.packed_seq_params import PackedSeqParams

    longest, cu = _longest(batch), batch["cu_seqlens"]
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )


def dense_document_mask(batch: dict) -> torch.Tensor:
    """[m, 1, L, L] bool, True where attention is masked (Megatron's convention): a token sees
    the earlier tokens of its own segment only."""
    batch = _boundaries(batch, "dense_document_mask", ("position_ids",))
    pos = batch["position_ids"]
    segment = torch.cumsum((pos == 0).to(torch.int64), dim=1)
    L = pos.shape[1]
    causal = torch.ones((L, L), dtype=torch.bool).tril()
    same = segment[:, :, None] == segment[:, None, :]
    return ~(same & causal)[:, None]


def hf_flat_batch(batch: dict) -> dict:
    """Hugging Face's flattened form, as `DataCollatorWithFlattening(return_flash_attn_kwargs=
    True)` gives it: the micro-batch as one [1, m*L] sequence, `input_ids`, `position_ids`
    (int64, restarting at 0 at each segment), `labels` (int64, HF's unshifted convention: the
    token itself, -100 at each segment's first token and where tokpack has no loss),
    `cu_seq_lens_q/k` (int32, a leading 0; no zero-length segments) and `max_length_q/k`
    (ints). Plus `shift_labels`, tokpack's own shifted labels flattened: transformers' causal
    LM loss uses them as they are when given (`model(**hf_flat_batch(batch))`), so the loss
    is exactly tokpack's, the last label of each row included, which the unshifted `labels`
    cannot carry."""
    batch = _boundaries(batch, "hf_flat_batch")
    ids, pos = batch["input_ids"].reshape(1, -1), batch["position_ids"].reshape(1, -1)
    shifted = batch["labels"].reshape(1, -1)
    labels = ids.clone()
    # Unshifted, a token's label is itself; it trains when the label before it did (tokpack's
    # shifted label there is this token), and never at a segment start (HF's separator).
    trained = torch.zeros_like(labels, dtype=torch.bool)
    trained[:, 1:] = shifted[:, :-1] != -100
    labels[~trained | (pos == 0)] = -100
    lengths = _segment_lengths(batch)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(lengths, 0).to(torch.int32)])
    longest = int(lengths.max())
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": pos,
        "shift_labels": shifted,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }
