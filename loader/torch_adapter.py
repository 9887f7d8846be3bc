"""A torch `IterableDataset` over `SampleReader`: the only tokpack module that imports torch.

    from torchdata.stateful_dataloader import StatefulDataLoader
    ds = TokpackDataset(run_dir, rank=r, world_size=W, micro_batch=m, positions="eos")
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=2)
    loader.load_state_dict(saved)                   # optional: resume, O(1)
    for batch in loader:                            # one micro-batch per item
        batch["input_ids"], batch["labels"], batch["position_ids"]   # [m, seq_len] int64
        saved = loader.state_dict()                 # exact, with or without workers

A best-fit epoch (`tokpack shuffle --packing best-fit`) adds, per micro-batch: `loss_mask`
[m, seq_len] (1 where the label is a real token, 0 where it is padding), `labels` -100 on
padding (torch's cross-entropy ignore_index), `position_ids` restarting at each document (the
padding is one segment of its own) and `cu_seqlens` [documents + 1] int32, the document
boundaries over the flattened micro-batch, for flash-attn varlen or a FlexAttention document
mask.

Each item is one micro-batch of rank r (global batch b, Megatron order). With DataLoader
workers, worker w of K serves global batches b with b % K == w; DataLoader returns items
round-robin from its workers, so the rank still sees b = 0, 1, 2, ... once each.

`TokpackDataset` implements torchdata's `Stateful` protocol: `StatefulDataLoader` keeps one
state per worker (where its share of the steps continues) and restores each worker's. A
state saved with workers resumes with another world size when the global batch W*m is the
same; for another global batch, `TokpackDataset.consumed_samples(loader_state)` gives the
consumed-sample count to start a fresh dataset from. Without StatefulDataLoader,
`ds.state_dict(batch)` names the position after a batch the loader returned.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from tokpack.formats.errors import TokpackError
from .reader import SampleReader, cu_seqlens, document_masks


def _ignore_set_vital_warning() -> None:
    """torchdata 0.11's StatefulDataLoader.__init__ calls torch.set_vital, which torch 2.13 no
    longer has: torch's module __getattr__ warns "'set_vital' is deprecated" and hands back a
    no-op. Every loader built over a TokpackDataset printed it; the call does nothing either way,
    so that one warning, raised from that one module, is ignored (nothing else from torch or
    torchdata). Installed by each TokpackDataset, which comes before its loader: a filter added
    at import would be lost with a `warnings.catch_warnings()` block the import ran in.
    Adding the same filter again replaces it: the list does not grow."""
    warnings.filterwarnings("ignore", message=r"'set_vital' is deprecated", category=UserWarning,
                            module=r"torchdata\.stateful_dataloader\.stateful_dataloader")

_RESTART_HINT = ("restart from the consumed-sample count: "
                 "TokpackDataset(..., start_sample=TokpackDataset.consumed_samples(loader_state)) "
                 "with a fresh StatefulDataLoader")


class TokpackDataset(IterableDataset):
    """Rank r's micro-batches as dicts of int64 tensors: input_ids, labels (shifted by one),
    position_ids (restart after each EOS; with positions="eos" or "index") and
    consumed_samples (Megatron's counter once every rank has trained on this micro-batch)."""

    def __init__(self, path, *, rank: int = 0, world_size: int = 1, micro_batch: int = 1,
                 start_sample: int | None = None, consumed_tokens: int | None = None,
                 positions: str | None = "eos", verify: bool = False):
        """Rank `rank` of `world_size` data-parallel ranks, `micro_batch` samples a step, over
        `path`: a run directory (its epochs chained, in order) or one epoch directory.

        Each item is a dict: `input_ids` and `labels` ([micro_batch, seq_len] int64, labels
        shifted by one), `position_ids` (same shape, restarting at 0 at each row start and on
        the token after each EOS: positions="eos" finds the EOS tokens, "index" reads the
        shards' .ds.index, the same on tokpack epochs; None: no such key) and `consumed_samples` (a 0-d
        int64 tensor: the consumed-sample count once every rank has trained on this global
        batch, i.e. Megatron's `consumed_samples` to checkpoint; `start_sample=` it to resume).
        `start_sample` (G) or `consumed_tokens` (T, G = T // seq_len): where to start, O(1),
        default 0. `verify`: checksum each shard when it is first read. The shard table is
        opened here, so a missing or truncated shard fails before training starts."""
        _ignore_set_vital_warning()
        # Opened here, in the main process, so a missing or truncated shard fails before training starts.
        self.reader = SampleReader.open(path, verify=verify)  # shard table; fds reopen in each worker
        self.rank = rank  # r
        self.world_size = world_size  # W
        self.micro_batch = micro_batch  # m
        self.positions = positions  # None, "eos" or "index"
        self.consumed = self.reader.start_from(start_sample=start_sample, consumed_tokens=consumed_tokens)  # G
        self.reader.serves(rank, world_size, micro_batch, self.consumed)  # a node slice of other ranks: refused now
        self._worker_resume: dict | None = None  # a worker's saved share of the steps, until __iter__ uses it
        self._stream = None  # the stream this process is iterating
        # Set by workers when they start iterating, seen by the main process (shared memory
        # survives both fork and spawn): the main process's own position is stale from then on.
        self._workers_iterating = torch.zeros(1, dtype=torch.int32).share_memory_()

    @property
    def global_batch(self) -> int:
        return self.world_size * self.micro_batch

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        self._workers_iterating[0] = 0 if info is None else 1
        start, first_step = self.consumed, None
        if self._worker_resume is not None:  # once: a later pass over the loader starts afresh
            start, first_step = self._resume_share(self._worker_resume, worker, workers)
            self._worker_resume = None
        stream = self._stream = self.reader.batches(self.rank, self.world_size, self.micro_batch, start,
                                                    positions=self.positions, worker=worker, num_workers=workers,
                                                    first_step=first_step)
        for item in stream:
            rows, pos = item if self.positions else (item, None)
            tokens = torch.from_numpy(rows.astype(np.int64))
            batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
            if pos is not None:
                batch["position_ids"] = torch.from_numpy(pos[:, :-1].astype(np.int64))
            if self.reader.packed:
                batch.update(self._documents(rows, stream.state.first_sample(stream.last_step)))
            consumed = stream.state.consumed_after(stream.last_step)
            batch["consumed_samples"] = torch.tensor(consumed, dtype=torch.int64)
            if info is None:
                self.consumed = consumed  # in-process iteration: state_dict() follows by itself
            yield batch

    def _documents(self, rows: np.ndarray, g: int) -> dict:
        """A best-fit micro-batch's masks: rows [g, g+m) with their padding from `.ds.pad`."""
        pos, real = document_masks(rows, self.reader.padding(g, len(rows)), self.reader.eos_id)
        labels = rows[:, 1:].astype(np.int64)
        labels[~real[:, 1:]] = -100
        out = {"labels": torch.from_numpy(labels), "loss_mask": torch.from_numpy(real[:, 1:].astype(np.int64))}
        if self.positions:
            pos = pos[:, :-1]
            out["position_ids"] = torch.from_numpy(pos.astype(np.int64))
            out["cu_seqlens"] = torch.from_numpy(cu_seqlens(pos))
        return out

    def _resume_share(self, saved: dict, worker: int, workers: int) -> tuple[int, int]:
        """(start, first step) of this worker's share of the steps, from its saved state."""
        if int(saved["num_workers"]) != workers:
            raise TokpackError("loader state was saved with another number of DataLoader workers",
                               where="num_workers", expected=saved["num_workers"], found=workers,
                               hint=f"use num_workers={saved['num_workers']}, or {_RESTART_HINT}")
        if int(saved["worker"]) != worker:
            raise TokpackError("loader state is the share of another DataLoader worker", where="worker",
                               expected=f"worker {saved['worker']} of {saved['num_workers']}",
                               found=f"worker {worker} of {workers}",
                               hint=f"load each worker's own state (a StatefulDataLoader does), or {_RESTART_HINT}")
        if int(saved["global_batch"]) != self.global_batch:
            raise TokpackError("loader state was saved with DataLoader workers and another global batch (W*m)",
                               where="global_batch", expected=saved["global_batch"], found=self.global_batch,
                               hint=_RESTART_HINT)
        return int(saved["start"]), int(saved["next_step"])

    def state_dict(self, batch: dict | None = None) -> dict:
        """Where to resume. torchdata's `StatefulDataLoader` calls it in each worker (that
        worker's share of the steps) or, without workers, in the main process. `batch`: the
        position after a batch the loader returned, {"epoch", "sample", "consumed_samples"}.
        In the main process while workers iterate, only the batch form is known."""
        if batch is not None:
            return self._position(int(batch["consumed_samples"]))
        info = get_worker_info()
        if info is not None:
            if self._stream is not None:
                st = self._stream.state
                start, step = st.start, st.step
            elif self._worker_resume is not None:
                start, step = self._resume_share(self._worker_resume, info.id, info.num_workers)
            else:
                start, step = self.consumed, info.id
            return {"start": int(start), "next_step": int(step), "worker": info.id,
                    "num_workers": info.num_workers, "global_batch": self.global_batch}
        if int(self._workers_iterating[0]):
            raise TokpackError("TokpackDataset.state_dict() in the main process cannot see what DataLoader "
                               "workers have served", where="num_workers > 0",
                               hint="save loader.state_dict() of a torchdata StatefulDataLoader, "
                                    "or call ds.state_dict(batch) with the last batch the loader returned")
        return self._position(self.consumed)

    def _position(self, g: int) -> dict:
        epoch, sample = self.reader.epoch_sample(g)
        return {"epoch": int(epoch), "sample": int(sample), "consumed_samples": int(g)}

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`: a worker's share (StatefulDataLoader, same workers, same
        W*m) or a position (epoch, sample) / consumed_samples (any world size). O(1)."""
        if "next_step" in state:
            self._worker_resume = dict(state)
            return
        self._worker_resume = None
        if "epoch" in state:
            self.consumed = self.reader.start_from(
                start_sample=self.reader.position(int(state["epoch"]), int(state["sample"])))
        else:
            self.consumed = self.reader.start_from(start_sample=int(state["consumed_samples"]))

    @staticmethod
    def consumed_samples(loader_state: dict) -> int:
        """The consumed-sample count G in a `StatefulDataLoader.state_dict()` of a TokpackDataset,
        with or without workers: start a fresh dataset there (`start_sample=G`) to resume with
        another world size, micro-batch or number of workers."""
        snapshot = loader_state.get("_snapshot")
        if snapshot is None:  # no workers: the dataset's own position
            state = loader_state.get("dataset_state")
            if not isinstance(state, dict) or "consumed_samples" not in state:
                raise TokpackError("not a StatefulDataLoader state of a TokpackDataset", where="dataset_state",
                                   expected="{epoch, sample, consumed_samples}", found=state)
            return int(state["consumed_samples"])
        shares = [w.get("dataset_state") for w in snapshot.get("_worker_snapshots", {}).values()]
        if not shares or not all(isinstance(s, dict) and "next_step" in s for s in shares):
            raise TokpackError("not a StatefulDataLoader state of a TokpackDataset", where="_worker_snapshots",
                               expected="one TokpackDataset state per worker", found=shares)
        # Steps below the smallest next step were all yielded (the loader yields in step order),
        # and so were the steps yielded since the snapshot.
        step = min(int(s["next_step"]) for s in shares) + int(loader_state.get("_steps_since_snapshot", 0))
        return int(shares[0]["start"]) + step * int(shares[0]["global_batch"])
