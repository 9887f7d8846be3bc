"""Issue 43, item 4: a batch crosses from a DataLoader worker as one tensor (one shared buffer
holding every field), and the main process sees the same fields, bit for bit, as without workers."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from conftest import random_docs, shuffle_run, write_source
from torch.utils.data import default_convert

from tokpack.loader.torch_adapter import Batch, TokpackDataset

SEQ, N, M = 15, 48, 2


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("handoff")
    src = write_source(base / "src", random_docs(np.random.default_rng(7), 120, 1000, 0))
    shuffle_run(
        [str(src)], str(base / "run"), seq_len=SEQ, seed=3, epochs=[0], samples=N, shard_samples=8, memory=8 << 20
    )
    return base / "run"


def storages(batch: dict) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in batch.values()}


@pytest.mark.parametrize("kw", [{}, {"max_documents": 6}, {"positions": None}])
def test_a_workers_batch_is_one_buffer_with_the_same_fields(run, kw):
    plain = list(TokpackDataset(run, micro_batch=M, at_end="stop", **kw))
    loader = StatefulDataLoader(TokpackDataset(run, micro_batch=M, at_end="stop", **kw), batch_size=None, num_workers=2)
    got = list(loader)
    assert len(got) == len(plain) == N // M
    for a, b in zip(plain, got):
        assert isinstance(b, dict) and list(a) == list(b)
        for key in a:
            assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape and torch.equal(a[key], b[key]), key
        assert len(storages(b)) == 1  # every field a view of the one buffer that crossed


def test_a_batch_pickles_as_one_tensor_until_a_field_changes():
    arrays = {"input_ids": np.arange(6, dtype=np.int64).reshape(2, 3), "cu_seqlens": np.array([0, 3, 6], np.int32)}
    arrays["consumed_samples"] = np.array(4, dtype=np.int64)
    batch = Batch.packed(arrays)
    rebuild, (buffer, layout) = batch.__reduce__()
    assert isinstance(buffer, torch.Tensor) and buffer.untyped_storage().is_shared()
    # what a DataLoader worker sends (batch_size=None: default_convert copies the dict, same views)
    assert default_convert(batch).__reduce__()[0] is rebuild
    again = pickle.loads(pickle.dumps(batch))
    assert type(again) is Batch and list(again) == list(arrays)
    for key, value in arrays.items():
        assert np.array_equal(again[key].numpy(), value) and again[key].numpy().dtype == value.dtype
    batch["input_ids"] = batch["input_ids"] + 1  # a collate_fn's change: pickled as it now is
    changed = pickle.loads(pickle.dumps(batch))
    assert np.array_equal(changed["input_ids"].numpy(), arrays["input_ids"] + 1) and len(storages(changed)) == 3
