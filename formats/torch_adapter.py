"""A torch `IterableDataset` over `SampleReader`: the only tokpack module that imports torch.

    ds = TokpackDataset(run_dir, rank=r, world_size=W, micro_batch=m, positions="eos")
    ds.load_state_dict(saved)                       # optional: resume, O(1)
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    for batch in loader:                            # one micro-batch per item
        batch["input_ids"], batch["labels"], batch["position_ids"]   # [m, seq_len] int64
        saved = ds.state_dict(batch)                # {"epoch", "sample", "consumed_samples"}

Each item is one micro-batch of rank r (global batch b, Megatron order). With DataLoader
workers, worker w of K serves global batches b with b % K == w; DataLoader returns items
round-robin from its workers, so the rank still sees b = 0, 1, 2, ... once each.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from .reader import SampleReader


class TokpackDataset(IterableDataset):
    """Rank r's micro-batches as dicts of int64 tensors: input_ids, labels (shifted by one),
    position_ids (restart after each EOS; with positions="eos" or "index") and
    consumed_samples (Megatron's counter once every rank has trained on this micro-batch)."""

    def __init__(self, path, *, rank: int = 0, world_size: int = 1, micro_batch: int = 1,
                 start_sample: int | None = None, consumed_tokens: int | None = None,
                 positions: str | None = "eos", verify: bool = False):
        # Opened here, in the main process, so a missing or truncated shard fails before training starts.
        self.reader = SampleReader.open(path, verify=verify)  # shard table; fds reopen in each worker
        self.rank = rank  # r
        self.world_size = world_size  # W
        self.micro_batch = micro_batch  # m
        self.positions = positions  # None, "eos" or "index"
        self.consumed = self.reader.start_from(start_sample=start_sample, consumed_tokens=consumed_tokens)  # G

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        stream = self.reader.batches(self.rank, self.world_size, self.micro_batch, self.consumed,
                                     positions=self.positions, worker=worker, num_workers=workers)
        for item in stream:
            rows, pos = item if self.positions else (item, None)
            tokens = torch.from_numpy(rows.astype(np.int64))
            batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
            if pos is not None:
                batch["position_ids"] = torch.from_numpy(pos[:, :-1].astype(np.int64))
            consumed = stream.state.consumed_after(stream.last_step)
            batch["consumed_samples"] = torch.tensor(consumed, dtype=torch.int64)
            if info is None:
                self.consumed = consumed  # in-process iteration: state_dict() follows by itself
            yield batch

    def state_dict(self, batch: dict | None = None) -> dict:
        """Where to resume: after `batch` (needed with DataLoader workers, whose progress the
        main process cannot see), else after the last micro-batch yielded in this process."""
        g = int(batch["consumed_samples"]) if batch is not None else self.consumed
        if g < self.reader.total_samples:
            epoch, sample = self.reader.locate(g)
        else:
            epoch = self.reader.epochs[-1]
            sample = g - int(self.reader.table.epoch_starts[-2])
        return {"epoch": epoch, "sample": sample, "consumed_samples": g}

    def load_state_dict(self, state: dict) -> None:
        """Resume at (epoch, sample); works with another world size (the global order is unchanged)."""
        if "epoch" in state:
            self.consumed = self.reader.position(int(state["epoch"]), int(state["sample"]))
        else:
            self.consumed = self.reader.start_from(start_sample=int(state["consumed_samples"]))
