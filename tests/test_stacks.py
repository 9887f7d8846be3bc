"""Each trainer's form of the document boundaries, tested against that trainer's own code on the
same rows (issue 34, item 2): OLMo-core's `get_cumulative_document_lengths` and
`get_document_lengths`, Megatron-core's `_get_ltor_masks_and_position_ids` and
`PackedSeqParams`, Hugging Face's `DataCollatorWithFlattening` and causal-LM loss. Each
package is pinned in the [test] extra; a test skips only when its package is absent."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import random_docs, require, shuffle_run, write_source
from tokpack.loader.reader import SampleReader

torch = require("torch", "pip install torch")
from tokpack.loader.torch_adapter import TokpackDataset  # noqa: E402 (after the torch check)
from tokpack.loader.trainer_forms import (  # noqa: E402
    dense_document_mask,
    hf_flat_batch,
    megatron_batch,
    olmo_core_batch,
    packed_seq_params,
)

SEQ = 63
EOS = 0
M = 4  # micro-batch
PAD = 999  # a pad id that is not EOS: Megatron (EOS ends a document) then sees the padding as tokpack does


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("stack-src")
    rng = np.random.default_rng(8)
    return [
        write_source(root / "a", random_docs(rng, 300, 1000, EOS, 1, 40)),
        write_source(root / "b", random_docs(rng, 40, 1000, EOS, 1, 200)),
    ]


def _run(sources, out: Path, **kw) -> Path:
    shuffle_run(
        [str(s) for s in sources],
        str(out),
        weights=["2", "1"],
        seq_len=SEQ,
        seed=5,
        epochs=[0],
        samples=64,
        shard_samples=40,
        memory=64 << 20,
        **kw,
    )
    return out


@pytest.fixture(scope="module")
def runs(sources, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stack-runs")
    return {
        "best-fit": _run(sources, root / "bf", packing="best-fit"),  # padding is EOS tokens
        "best-fit-pad": _run(sources, root / "bfp", packing="best-fit", pad_id=PAD),
        "window": _run(sources, root / "win", packing="concat"),
    }


KINDS = ["best-fit", "best-fit-pad", "window"]


def batches(path: Path, **kw):
    """(micro-batch, the inputs that are real tokens [m, L] bool) over the run."""
    reader = SampleReader.open(path)
    for b, batch in enumerate(TokpackDataset(path, micro_batch=M, at_end="stop", **kw)):
        pad = reader.padding(M * b, M).astype(np.int64)
        yield batch, torch.from_numpy(np.arange(SEQ)[None, :] < (SEQ + 1 - pad)[:, None])


def row_cu(pos: torch.Tensor) -> torch.Tensor:
    """One row's cumulative segment lengths with a leading 0 (segments start where positions are 0)."""
    return torch.cat([torch.nonzero(pos == 0).flatten(), torch.tensor([pos.numel()])]).to(torch.int32)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("K", [None, 12])
def test_olmo_core_cumulative_document_lengths(runs, kind, K):
    olmo = require("olmo_core.data.utils", "pip install ai2-olmo-core==3.0.0")
    kw = {} if K is None else {"max_documents": K}
    for batch, real in batches(runs[kind], **kw):
        form = olmo_core_batch(batch)
        assert set(form) == {"input_ids", "labels", "doc_lens", "max_doc_lens"}
        doc_lens = form["doc_lens"]
        assert doc_lens.dtype == torch.int32 and (K is None or doc_lens.shape == (M, K))
        cu = batch["cu_seqlens"]
        segments = int((batch["position_ids"] == 0).sum())
        assert torch.equal(olmo.get_cumulative_document_lengths(doc_lens), cu[: segments + 1])
        for i in range(M):  # row by row
            assert torch.equal(
                olmo.get_cumulative_document_lengths(doc_lens[i : i + 1]), row_cu(batch["position_ids"][i])
            )
            assert form["max_doc_lens"][i] == int(doc_lens[i].max())
            # OLMo-core's own cut of the row at its EOS tokens: the documents; then tokpack's
            # padding segment (the inputs' padding, when the row has any).
            n = int(real[i].sum())
            theirs = olmo.get_document_lengths(batch["input_ids"][i, :n], EOS)
            padding = [SEQ - n] if n < SEQ else []
            assert doc_lens[i][doc_lens[i] > 0].tolist() == theirs.tolist() + padding
        assert torch.equal(form["labels"], batch["labels"]) and form["input_ids"].dtype == torch.int64


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("eod_mask_loss", [False, True])
def test_megatron_masks_and_position_ids(runs, kind, eod_mask_loss):
    gpt = require("megatron.core.datasets.gpt_dataset", "pip install megatron-core")
    whole_row = kind != "best-fit"  # a pad token that is EOS is a document of one to Megatron
    for batch, real in batches(runs[kind], eod_mask_loss=eod_mask_loss):
        form = megatron_batch(batch)
        mask = dense_document_mask(batch)
        assert mask.shape == (M, 1, SEQ, SEQ) and mask.dtype == torch.bool
        for i in range(M):
            theirs_mask, theirs_loss, theirs_pos = gpt._get_ltor_masks_and_position_ids(
                batch["input_ids"][i],
                EOS,
                reset_position_ids=True,
                reset_attention_mask=True,
                eod_mask_loss=eod_mask_loss,
                create_attention_mask=True,
            )
            keep = torch.ones(SEQ, dtype=torch.bool) if whole_row else real[i]
            assert torch.equal(form["position_ids"][i][keep], theirs_pos[keep])
            assert torch.equal(mask[i, 0][keep][:, keep], theirs_mask[0][keep][:, keep])
            # Megatron's loss mask (no padding of its own) where tokpack's labels are tokens.
            labelled = real[i].clone()
            labelled[:-1] = real[i][1:]
            labelled[-1] = bool(batch["loss_mask"][i, -1]) or (eod_mask_loss and batch["input_ids"][i, -1] == EOS)
            assert torch.equal(form["loss_mask"][i][labelled], theirs_loss[labelled])
        assert form["loss_mask"].dtype == torch.float32 and (form["labels"] >= 0).all()
        assert torch.equal(form["labels"][batch["labels"] >= 0], batch["labels"][batch["labels"] >= 0])


def test_megatron_packed_seq_params(runs):
    require("megatron.core.packed_seq_params", "pip install megatron-core")
    for batch, _ in batches(runs["best-fit"], max_documents=12):
        params = packed_seq_params(batch)
        assert params.qkv_format == "thd"
        assert params.cu_seqlens_q is batch["cu_seqlens"] and params.cu_seqlens_kv is batch["cu_seqlens"]
        assert params.cu_seqlens_q.dtype == torch.int32 and params.cu_seqlens_q.shape == (M * 12 + 1,)
        lengths = torch.diff(batch["cu_seqlens"])
        assert params.max_seqlen_q == params.max_seqlen_kv == int(lengths.max()) == megatron_batch(batch)["max_seqlen"]


def _hf_features(batch, real) -> list[dict]:
    """The micro-batch's segments as separate examples, cut independently of tokpack: each row's
    real inputs after each EOS (numpy), then its padding; labels -100 on padding."""
    features = []
    for i in range(M):
        ids = batch["input_ids"][i].numpy()
        n = int(real[i].sum())
        cuts = np.flatnonzero(ids[:n] == EOS) + 1
        for seg in np.split(ids[:n], cuts[cuts < n]):
            features.append({"input_ids": seg.tolist(), "labels": seg.tolist()})
        if n < SEQ:
            features.append({"input_ids": ids[n:].tolist(), "labels": [-100] * (SEQ - n)})
    return features


@pytest.mark.parametrize("kind", KINDS)
def test_hf_data_collator_with_flattening(runs, kind):
    collator_module = require("transformers.data.data_collator", "pip install transformers==5.23.0")
    collator = collator_module.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")
    for batch, real in batches(runs[kind], max_documents=12):
        form = hf_flat_batch(batch)
        theirs = collator(_hf_features(batch, real))
        for key in ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k"):
            assert form[key].dtype == theirs[key].dtype and torch.equal(form[key], theirs[key]), key
        assert form["max_length_q"] == form["max_length_k"] == theirs["max_length_q"] == theirs["max_length_k"]
        assert torch.equal(form["shift_labels"], batch["labels"].reshape(1, -1))


def test_hf_causal_lm_loss_is_tokpacks(runs):
    """`model(**hf_flat_batch(batch))`: transformers' loss over `shift_labels` is the cross-entropy
    of the same logits against tokpack's labels, padding and all."""
    transformers = require("transformers", "pip install transformers==5.23.0")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    batch, _ = next(batches(runs["best-fit"]))
    form = hf_flat_batch(batch)
    with torch.no_grad():
        out = model(**form)
    want = torch.nn.functional.cross_entropy(
        out.logits.reshape(-1, 1000).float(), batch["labels"].reshape(-1), ignore_index=-100
    )
    assert torch.allclose(out.loss, want, rtol=0, atol=1e-6)


def test_forms_convert_in_the_loader_workers_and_resume(runs):
    """A form as the StatefulDataLoader's collate_fn (each item, in its worker): the items are
    the form of the dataset's batches, and a saved loader state resumes to the same items."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    path = runs["best-fit"]
    plain = [hf_flat_batch(b) for b in TokpackDataset(path, micro_batch=M, max_documents=12, at_end="stop")]
    ds = TokpackDataset(path, micro_batch=M, max_documents=12, at_end="stop")
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=2, collate_fn=hf_flat_batch)
    got, state = [], None
    for i, item in enumerate(loader):
        got.append(item)
        if i == 4:
            state = loader.state_dict()
    resumed = StatefulDataLoader(
        TokpackDataset(path, micro_batch=M, max_documents=12, at_end="stop"),
        batch_size=None,
        num_workers=2,
        collate_fn=hf_flat_batch,
    )
    resumed.load_state_dict(state)
    for want, items in ((plain, got), (plain[5:], list(resumed))):
        assert len(want) == len(items)
        for a, b in zip(want, items):
            assert a.keys() == b.keys() and all(
                torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
            )


def test_forms_refuse_a_batch_without_boundaries(runs):
    from tokpack.formats.errors import TokpackError

    batch = next(iter(TokpackDataset(runs["window"], micro_batch=M, positions=None)))
    for form in (olmo_core_batch, megatron_batch, hf_flat_batch, dense_document_mask, packed_seq_params):
        with pytest.raises(TokpackError, match=f"{form.__name__} takes a TokpackDataset batch") as err:
            form(batch)
        assert "positions='eos'" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(TokpackError, match="found list"):
        olmo_core_batch([1, 2])
