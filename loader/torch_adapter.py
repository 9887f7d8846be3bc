"""A torch `IterableDataset` over `SampleReader`: with tokpack.loader.trainer_forms (each
trainer's form of its batch) and tokpack.loader.handoff (a worker's batch crossing to the
training process), the only tokpack modules that import torch.

    from torchdata.stateful_dataloader import StatefulDataLoader
    ds = TokpackDataset(run_dir, rank=r, world_size=W, micro_batch=m, positions="eos")
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=2)
    loader.load_state_dict(saved)                   # optional: resume, O(1) (another worker count: one line)
    for batch in loader:                            # one micro-batch per item
        batch["input_ids"], batch["labels"], batch["position_ids"]   # [m, seq_len] int64
        saved = loader.state_dict()                 # exact, with or without workers

Every epoch gives, per micro-batch, the same keys: `loss_mask` [m, seq_len] (1 where the
label is a real token, 0 where it is padding) and, with positions, `cu_seqlens` [documents + 1]
int32, the document boundaries over the flattened micro-batch (from the EOS tokens), for
flash-attn varlen or a FlexAttention document mask. A best-fit epoch (`tokpack shuffle
--packing best-fit`) has padding: `labels` -100 there (torch's cross-entropy ignore_index),
and its `position_ids` make the padding one segment of its own; a window epoch has none
(loss_mask all ones). `max_documents=K` makes the boundaries' shapes fixed (TokpackDataset).

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

import os
import threading
import time
import warnings
from contextlib import contextmanager

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from tokpack.formats.arguments import flag, text, whole
from tokpack.formats.errors import TokpackError
from tokpack.formats.slices import RankRows
from .assembly import I64, WindowBatch, eod_mask_needs_eos
from .handoff import HANDOFF_PAUSE_S, Batch
from .read_ahead import ReadAhead
from .reader import AT_END, SampleReader, stream_shape


def _ignore_set_vital_warning() -> None:
    """torchdata 0.11's StatefulDataLoader.__init__ calls torch.set_vital, which torch 2.13 no
    longer has: torch's module __getattr__ warns "'set_vital' is deprecated" and hands back a
    no-op. Every loader built over a TokpackDataset printed it; the call does nothing either way,
    so that one warning, raised from that one module, is ignored (nothing else from torch or
    torchdata). Installed by each TokpackDataset, which comes before its loader: a filter added
    at import would be lost with a `warnings.catch_warnings()` block the import ran in.
    Adding the same filter again replaces it: the list does not grow."""
    warnings.filterwarnings(
        "ignore",
        message=r"'set_vital' is deprecated",
        category=UserWarning,
        module=r"torchdata\.stateful_dataloader\.stateful_dataloader",
    )


def _check_worker_count_at_iteration() -> None:
    """torchdata's StatefulDataLoader checks a state saved with workers loaded into a loader
    without (or the reverse) by a bare AssertionError ("State doesn't contain key '_num_yielded'
    ...") when the loader next makes its iterator, before any dataset code sees the state; a
    change between two counts of workers reached the dataset in the workers. So the method that
    makes the iterator (`_get_iterator`, which `iter(loader)` and `loader.state_dict()` call) is
    wrapped once: for a loader over a TokpackDataset with a loaded state, a worker count other
    than the state's is the one TokpackError line `load_loader_state` gives, in the main process,
    before any worker starts. Any other loader, or a torchdata without that method, is untouched."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:  # no torchdata: no StatefulDataLoader to check
        return
    made = getattr(StatefulDataLoader, "_get_iterator", None)
    if made is None or getattr(made, "_tokpack_checks_workers", False):
        return

    def _get_iterator(loader):
        state = getattr(loader, "next_iter_state", None)
        if state is not None and isinstance(loader.dataset, TokpackDataset):
            _same_workers(len(_worker_snapshots(_loader_state(state))), loader.num_workers)
            if state.get("_iterator_finished") is True and _worker_snapshots(state):
                # A state saved once the iteration ended (at_end="stop"): torchdata makes the
                # iterator of the state, sees it finished and makes a fresh one, its workers
                # forked from the dataset's own position (where it was built: the run again
                # from its start). Without workers the state reaches the dataset first. So the
                # dataset takes the state's count here, and the iterator starts fresh from it.
                loader.dataset.resume_ended(state)
                loader.next_iter_state = None
        return made(loader)

    _get_iterator._tokpack_checks_workers = True
    StatefulDataLoader._get_iterator = _get_iterator


_RESTART_HINT = (
    "restart from the consumed-sample count: "
    "TokpackDataset(..., start_sample=TokpackDataset.consumed_samples(loader_state)) "
    "with a fresh StatefulDataLoader"
)


_SHARE_FIELDS = {"start": 0, "next_step": 0, "worker": 0, "num_workers": 1, "global_batch": 1}  # least values
_STATE_FORMS = "{start, next_step, worker, num_workers, global_batch}, {epoch, sample} or {consumed_samples}"


def _state_int(state: dict, key: str, least: int | None = 0) -> int:
    """One integer field of a loader state, or one line naming it (a damaged or foreign state)."""
    if key not in state:
        raise TokpackError(
            "loader state lacks a field",
            where=key,
            expected=_STATE_FORMS,
            found=sorted(map(str, state)),
            hint=_RESTART_HINT,
        )
    value = state[key]
    if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_floating_point():
        value = value.item()
    return whole(value, f"loader state {key}", least=least, optional=False)


def _as_state(state) -> dict:
    if not isinstance(state, dict):
        raise TokpackError(
            "not a TokpackDataset state",
            where="state",
            expected=_STATE_FORMS,
            found=type(state).__name__,
            hint=_RESTART_HINT,
        )
    return state


def _same_workers(saved: int, found: int) -> None:
    """A loader state saved with `saved` DataLoader workers, loaded where there are `found`."""
    if saved != found:
        raise TokpackError(
            "loader state was saved with another number of DataLoader workers",
            where="num_workers",
            expected=saved,
            found=found,
            hint=f"use num_workers={saved}, or {_RESTART_HINT}",
        )


# A reader's open files and reused buffers serve one batch at a time: a read-ahead thread and
# another iteration over the same dataset in the process take turns (a batch each). A child
# forked while a thread held it starts with it free.
_READING = threading.Lock()


def _free_reading() -> None:
    global _READING
    _READING = threading.Lock()


os.register_at_fork(after_in_child=_free_reading)


class WorkerError(TokpackError):
    """A TokpackError raised in a DataLoader worker, as the training loop sees it: one line.

    torch re-raises a worker's exception in the main process as `type(err)(text)`, the text being
    "Caught ... in DataLoader worker process k. Original Traceback ...", the whole traceback; a
    TokpackError would carry it all. Built from that text, this class keeps the error's own line
    (the traceback's last), so a worker's error reads as the same error without workers does."""

    def __init__(self, message: str, **fields):
        if not fields and message.startswith("Caught ") and "Original Traceback" in message:
            last = message.rstrip().rsplit("\n", 1)[-1]
            head = f"{type(self).__module__}.{type(self).__qualname__}: "
            if last.startswith(head):
                message = last[len(head) :]
        super().__init__(message, **fields)

    @classmethod
    def of(cls, err: TokpackError) -> "WorkerError":
        return cls(err.message, file=err.file, where=err.where, expected=err.expected, found=err.found, hint=err.hint)


@contextmanager
def _one_line_from_workers(caught: type = TokpackError):
    """In a DataLoader worker, a TokpackError leaves as a WorkerError (one line in the main process).
    `caught` is bound when the function is defined: an iterator left suspended until the
    interpreter's exit is closed after the module's names are cleared ("catching classes that do
    not inherit from BaseException", printed at exit)."""
    try:
        yield
    except caught as err:
        if get_worker_info() is None or isinstance(err, WorkerError):
            raise
        raise WorkerError.of(err) from None


def _loader_state(state) -> dict:
    """A StatefulDataLoader's state ("_snapshot" with workers, "dataset_state" without), or one
    line: a TokpackDataset's own state loaded into the loader was torchdata's bare AssertionError
    ("State doesn't contain key '_num_yielded'") at the next iter(loader)."""
    state = _as_state(state)
    if "_snapshot" not in state and "dataset_state" not in state:
        own = any(key in state for key in ("consumed_samples", "next_step"))
        raise _foreign(
            "loader state",
            "StatefulDataLoader.state_dict()",
            "a TokpackDataset's own state" if own else sorted(map(str, state))[:8],
            hint="load ds.state_dict() with ds.load_state_dict(state), and loader.state_dict() with "
            "loader.load_state_dict(state)",
        )
    return state


def _worker_snapshots(loader_state) -> dict:
    """A StatefulDataLoader state's snapshot of each DataLoader worker ({}: saved without workers)."""
    snapshot = _as_state(loader_state).get("_snapshot")
    if snapshot is None:
        return {}
    shares = snapshot.get("_worker_snapshots") if isinstance(snapshot, dict) else None
    if not isinstance(shares, dict) or not shares:
        raise _foreign("_worker_snapshots", _PER_WORKER, shares, hint=_RESTART_HINT)
    return shares


_PER_WORKER = "one TokpackDataset state per worker"


def _batch_consumed(batch) -> int:
    """The consumed-sample count after `batch`, a batch a loader over a TokpackDataset returned:
    its 0-d `consumed_samples`, or a collating loader's (its micro-batches' counts stacked, in
    order: the last). A trainer's form drops the count, so it names no position: one line, as
    for anything else (int() of it was a KeyError, a ValueError, or a negative epoch)."""
    value = batch.get("consumed_samples") if isinstance(batch, dict) else None
    if isinstance(value, torch.Tensor) and value.ndim == 1 and len(value):
        value = value[-1]
    if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_floating_point():
        value = value.item()
    if value is None:
        raise TokpackError(
            "state_dict(batch) takes a batch the loader returned, with its consumed_samples",
            where="batch",
            expected="a TokpackDataset batch (before a trainer form such as hf_flat_batch, which drops the count)",
            found=type(batch).__name__ if not isinstance(batch, dict) else f"keys {sorted(map(str, batch))}"[:120],
        )
    return whole(value, "batch consumed_samples", optional=False)


def _foreign(where: str, expected: str, found, hint: str | None = None) -> TokpackError:
    """A loader state that is not a StatefulDataLoader's over a TokpackDataset: one line."""
    message = "not a StatefulDataLoader state of a TokpackDataset"
    return TokpackError(message, where=where, expected=expected, found=found, hint=hint)


class TokpackDataset(IterableDataset):
    """Rank r's micro-batches as dicts of tensors (`__init__`); docs/API.md, "Reading", lists
    every key."""

    def __init__(  # noqa: PLR0913 -- the public constructor's keywords, each one setting, as packer/api.py's
        self,
        path,
        *,
        rank: int = 0,
        world_size: int = 1,
        micro_batch: int = 1,
        start_sample: int | None = None,
        consumed_tokens: int | None = None,
        positions: str | None = "eos",
        verify: bool = False,
        max_documents: int | None = None,
        eod_mask_loss: bool = False,
        at_end: str = "error",
        read_ahead: bool = True,
    ):
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
        opened here, so a missing or truncated shard fails before training starts.

        Every epoch also gives `loss_mask` and, with positions, `cu_seqlens` (the module's
        docstring). `max_documents` (K): boundaries of fixed shapes, so torch.compile does not
        recompile as the document count changes: `cu_seqlens` [m*K+1], `max_seqlen`, `doc_lens`
        [m, K], `max_doc_lens` [m]; a row of more than K documents is an error naming it
        (`tokpack inspect` gives the largest count).
        `eod_mask_loss`: Megatron's option, no loss on the label after an EOS input.

        `at_end`: where the written epochs end (a start there included), "error" (the default)
        raises one TokpackError naming the epoch to write, the line `tokpack read` prints at that
        sample, so a job resumed past the written epochs does not finish with zero steps; "stop"
        ends the iteration there. An epoch that is not written, with written ones after it, is an
        error either way. With DataLoader workers, the error reaches the loop as one line too
        (`WorkerError`, a TokpackError).

        `read_ahead` (default on): iterated in the training process (no DataLoader workers), the
        next batch is made by one background thread while the training step runs, so that
        `next(loader)` finds it made; with workers it does nothing (they read ahead already).
        It is on by default because nothing a consumer sees changes: the same batches, byte for
        byte, in the same order; `state_dict()` is the position after the last batch handed out
        (never the one made ahead), so a resume is exact; an error comes where its batch would
        have; at most one batch is made ahead (one batch's memory), 1 ms after the last was taken
        (`ReadAhead`'s pause). The thread ends with the iteration: at its end or error, and when
        the iterator is dropped or garbage-collected (a StatefulDataLoader keeps its last iterator
        until the loader goes); a daemon thread, it holds neither Ctrl-C nor the interpreter's
        exit. Off (`read_ahead=False`): each batch is made inside `next(loader)`, in the training
        thread. A process forked while the thread lives (the workers of another loader, forked by
        default on Linux) starts without it; Python 3.12 and later warn at such a fork
        (DeprecationWarning), as at any fork of a process with threads (torch's pin_memory thread
        alike)."""
        _ignore_set_vital_warning()
        _check_worker_count_at_iteration()
        rank, world_size, micro_batch = stream_shape(rank, world_size, micro_batch)
        text(positions, "positions", choices=(None, "eos", "index"))
        flag(verify, "verify")
        flag(eod_mask_loss, "eod_mask_loss")
        text(at_end, "at_end", optional=False, choices=AT_END)
        max_documents = whole(max_documents, "max_documents", least=1)
        if max_documents is not None and positions is None:
            raise TokpackError(
                "max_documents shapes the document boundaries, which need positions",
                where="max_documents",
                expected="positions='eos' or 'index'",
                found="positions=None",
            )
        self.reader = SampleReader.open(path, verify=verify)  # shard table; fds reopen in each worker
        eod_mask_needs_eos(eod_mask_loss, self.reader.eos_id)  # refused here, not at the first batch
        self.rank = rank  # r
        self.world_size = world_size  # W
        self.micro_batch = micro_batch  # m
        self.positions = positions  # None, "eos" or "index"
        self.max_documents = max_documents  # K: fixed-shape boundaries; None: cu_seqlens of the documents there are
        self.eod_mask_loss = eod_mask_loss  # no loss on the label of an EOS input (Megatron's eod_mask_loss)
        self.at_end = at_end  # where the written epochs end: "error" or "stop"
        self.read_ahead = flag(read_ahead, "read_ahead")  # without workers: one batch made ahead by a thread
        self.consumed = self.reader.start_from(start_sample=start_sample, consumed_tokens=consumed_tokens)  # G
        self.reader.serves(rank, world_size, micro_batch, self.consumed)  # a node slice of other ranks: refused now
        self._worker_resume: dict | None = None  # a worker's saved share of the steps, until __iter__ uses it
        self._stream = None  # the stream this process is iterating
        # Set by workers when they start iterating, seen by the main process (shared memory
        # survives both fork and spawn): the main process's own position is stale from then on.
        self._workers_iterating = torch.zeros(1, dtype=torch.int32).share_memory_()

    @property
    def global_batch(self) -> int:
        return RankRows(self.world_size, self.micro_batch).global_batch

    def __iter__(self):
        with _one_line_from_workers():
            yield from self._batches()

    def _batches(self):
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        self._workers_iterating[0] = 0 if info is None else 1
        start, first_step = self.consumed, None
        if self._worker_resume is not None:  # once: a later pass over the loader starts afresh
            start, first_step = self._resume_share(self._worker_resume, worker, workers)
            self._worker_resume = None
        # A window epoch's batch (no padding, positions from EOS or none, no max_documents, no
        # eod_mask_loss) is written straight into the buffer it is handed over in, from the rows
        # as read (assembly.fill_window); any other goes through micro_batch's arrays.
        window = (
            not self.reader.packed
            and (self.positions is None or (self.positions == "eos" and self.reader.eos_id is not None))
            and self.max_documents is None
            and not self.eod_mask_loss
        )
        stream = self._stream = self.reader.batches(
            self.rank,
            self.world_size,
            self.micro_batch,
            start,
            positions=None if window else self.positions,
            worker=worker,
            num_workers=workers,
            first_step=first_step,
            at_end=self.at_end,
            copy=not window,  # the window batch copies the rows into its buffer: the read buffer is reused
        )
        assembly = (
            WindowBatch(self.micro_batch, self.reader.seq_len, self.reader.eos_id if self.positions else None)
            if window
            else None
        )
        made = self._made(stream, assembly, info is not None)
        if info is not None:
            for batch, _ in made:
                yield batch
                time.sleep(HANDOFF_PAUSE_S)  # resumed by the loader's next request: the hand-off first
            return
        if self.read_ahead:  # made by a thread while the step runs (the class docstring)
            made = ReadAhead(made, pause_s=HANDOFF_PAUSE_S)
        try:
            for batch, consumed in made:
                # What the consumer has received, not what the read-ahead has made: state_dict()
                # follows the batches handed out.
                self.consumed = consumed
                yield batch
        finally:
            made.close()  # a loop left early, or this iterator dropped: no thread outlives it

    def _made(self, stream, assembly: WindowBatch | None, shared: bool):
        """(batch, consumed samples after it) for each item of `stream`; `assembly`: a window
        epoch's batch written in place (None: micro_batch's arrays); `shared`: a DataLoader
        worker's batch, one buffer in shared memory (handoff.Batch). Runs in the read-ahead thread
        too, under `_READING`."""
        items = iter(stream)
        while True:
            with _READING:
                try:
                    item = next(items)
                except StopIteration:
                    return
                consumed = stream.state.consumed_after(stream.last_step)
                if assembly is not None:
                    starts = assembly.starts(item)
                    batch, out = Batch.empty(assembly.fields(starts) + [("consumed_samples", I64, ())], shared)
                    assembly.fill(out, item, starts)
                    out[-1][...] = consumed
                else:
                    rows, pos = item if self.positions else (item, None)
                    arrays = self.reader.micro_batch(
                        rows,
                        pos,
                        stream.state.first_sample(stream.last_step),
                        max_documents=self.max_documents,
                        eod_mask_loss=self.eod_mask_loss,
                    )
                    arrays["consumed_samples"] = np.array(consumed, dtype=np.int64)
                    if shared:  # crosses to the main process as one tensor
                        batch = Batch.packed(arrays)
                    else:
                        batch = Batch({key: torch.from_numpy(value) for key, value in arrays.items()})
            yield batch, consumed

    def _resume_share(self, saved: dict, worker: int, workers: int) -> tuple[int, int]:
        """(start, first step) of this worker's share of the steps, from its saved state."""
        _same_workers(int(saved["num_workers"]), workers)
        if int(saved["worker"]) != worker:
            raise TokpackError(
                "loader state is the share of another DataLoader worker",
                where="worker",
                expected=f"worker {saved['worker']} of {saved['num_workers']}",
                found=f"worker {worker} of {workers}",
                hint=f"load each worker's own state (a StatefulDataLoader does), or {_RESTART_HINT}",
            )
        if int(saved["global_batch"]) != self.global_batch:
            raise TokpackError(
                "loader state was saved with DataLoader workers and another global batch (W*m)",
                where="global_batch",
                expected=saved["global_batch"],
                found=self.global_batch,
                hint=_RESTART_HINT,
            )
        return int(saved["start"]), int(saved["next_step"])

    @_one_line_from_workers()
    def state_dict(self, batch: dict | None = None) -> dict:
        """Where to resume. torchdata's `StatefulDataLoader` calls it in each worker (that worker's
        share of the steps) or, without workers, in the main process. `batch`: the position after
        a batch the loader returned, {"epoch", "sample", "consumed_samples"}. In the main process
        while workers iterate, only the batch form is known."""
        if batch is not None:
            return self._position(_batch_consumed(batch))
        info = get_worker_info()
        if info is not None:
            if self._stream is not None:
                start, step = self._stream.state.start, self._stream.state.step
            elif self._worker_resume is not None:
                start, step = self._resume_share(self._worker_resume, info.id, info.num_workers)
            else:
                start, step = self.consumed, info.id
            return {
                "start": int(start),
                "next_step": int(step),
                "worker": info.id,
                "num_workers": info.num_workers,
                "global_batch": self.global_batch,
                **self._samples_named(),
            }
        if int(self._workers_iterating[0]):
            raise TokpackError(
                "TokpackDataset.state_dict() in the main process cannot see what DataLoader workers have served",
                where="num_workers > 0",
                hint="save loader.state_dict() of a torchdata StatefulDataLoader, "
                "or call ds.state_dict(batch) with the last batch the loader returned",
            )
        return self._position(self.consumed)

    def _position(self, g: int) -> dict:
        epoch, sample = self.reader.epoch_sample(g)
        return {"epoch": int(epoch), "sample": int(sample), "consumed_samples": int(g), **self._samples_named()}

    def _samples_named(self) -> dict:
        """What a state records of the samples its numbers name: the seq_len and the run (its
        digest; none for a chain of epoch directories). A count names other samples in another
        run or at another seq_len, so a state saved there is refused at its load."""
        digest = self.reader.run_digest
        return {"seq_len": self.reader.seq_len, **({} if digest is None else {"run": digest})}

    def _same_samples(self, state: dict) -> None:
        """A loaded state's seq_len and run, where it records them (a state of an older tokpack
        does not), against this dataset's: one line when its numbers name other samples."""
        if "seq_len" in state:
            seq_len = _state_int(state, "seq_len", least=1)
            if seq_len != self.reader.seq_len:
                raise TokpackError(
                    "loader state was saved reading another seq_len: its counts are of other samples",
                    where="loader state seq_len",
                    expected=self.reader.seq_len,
                    found=seq_len,
                    hint="restart from the tokens consumed: TokpackDataset(..., consumed_tokens="
                    f"TokpackDataset.consumed_samples(loader_state) * {seq_len}) with a fresh StatefulDataLoader",
                )
        digest = self.reader.run_digest
        saved = _state_int(state, "run") if "run" in state else digest
        if digest is not None and saved != digest:
            raise TokpackError(
                "loader state was saved over another run: its counts name that run's samples",
                file=self.reader.run[0],
                where="loader state run",
                expected=f"{digest} (this run's identity)",
                found=saved,
                hint="load a state saved over this run (or its staged copy or node slice), or " + _RESTART_HINT,
            )

    @_one_line_from_workers()
    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`: a worker's share (StatefulDataLoader, same workers, same
        W*m) or a position (epoch, sample) / consumed_samples (any world size). O(1)."""
        state = _as_state(state)
        self._same_samples(state)
        if "next_step" in state:
            self._worker_resume = self._checked_share(state)
            return
        if "epoch" in state:
            epoch, sample = _state_int(state, "epoch"), _state_int(state, "sample")
            g = self.reader.position(epoch, sample)
            # Both forms saved: they must name one sample (an edited count was ignored here). A
            # chain of epoch directories may hold one epoch number twice (epoch 0 of two runs):
            # (epoch, sample) names the first; its count says which, and must be one it names.
            counted = _state_int(state, "consumed_samples") if "consumed_samples" in state else g
            if counted != g and self.reader.epoch_sample(counted) == (epoch, sample):
                g = counted
            if counted != g:
                raise TokpackError(
                    "loader state is damaged: its consumed_samples is not the sample its epoch and sample name",
                    where="loader state consumed_samples",
                    expected=f"{g} (epoch {state['epoch']}, sample {state['sample']})",
                    found=state["consumed_samples"],
                    hint="load the state as it was saved, over the run it was saved over",
                )
        else:
            g = _state_int(state, "consumed_samples")
        self.consumed = self._within_run(g, "consumed_samples")
        self._worker_resume = None

    def _within_run(self, g: int, field: str) -> int:
        """Chained sample g of a loaded state, refused past the end of the run (the state is of
        another, longer run) or in an epoch that is not written (start_from's line)."""
        numbering = self.reader.numbering
        if g > self.reader.total_samples and (numbering is None or numbering.locate(g) is None):
            raise TokpackError(
                "loader state is past the end of the run",
                file=self.reader.table.epoch_dirs[-1],
                where=f"loader state {field}",
                expected=f"0..{self.reader.total_samples}",
                found=g,
                hint="load a state saved over this run, or " + _RESTART_HINT,
            )
        return self.reader.start_from(start_sample=g)

    def _checked_share(self, state: dict) -> dict:
        """A worker's saved share, its fields whole numbers that fit each other and this run."""
        share = {key: _state_int(state, key, least) for key, least in _SHARE_FIELDS.items()}
        workers, worker, step = share["num_workers"], share["worker"], share["next_step"]
        if worker >= workers or step % workers != worker:
            raise TokpackError(
                "loader state is damaged: a worker's next step is not its own",
                where="next_step",
                expected=f"a step b with b % {workers} == {worker} (worker {worker} of {workers})",
                found=step,
                hint=_RESTART_HINT,
            )
        start = self._within_run(share["start"], "start")
        # A share records W*m only: its global batches read as one rank's. The last step served
        # from `start` is at most steps - 1, so a worker's next is below steps + workers.
        batches = RankRows(1, share["global_batch"], start)
        if step >= batches.batches(self.reader.total_samples) + workers:
            self._within_run(batches.first(0, step), "next_step")
        return share

    def resume_ended(self, loader_state: dict) -> None:
        """Where a StatefulDataLoader state saved with workers once its iteration ended goes on:
        its consumed-sample count, each worker's share checked as a loaded share is."""
        for share in _worker_snapshots(loader_state).values():
            state = _as_state(share.get("dataset_state") if isinstance(share, dict) else None)
            self._same_samples(state)
            self._checked_share(state)
        self.consumed = self._within_run(self.consumed_samples(loader_state), "consumed_samples")
        self._worker_resume = None

    def load_loader_state(self, loader, loader_state: dict) -> None:
        """`loader.load_state_dict(loader_state)` for a StatefulDataLoader over this dataset, after
        checking that the state was saved with the loader's number of workers: the line that
        `iter(loader)` gives otherwise (`_check_worker_count_at_iteration`), at the load."""
        if not callable(getattr(loader, "load_state_dict", None)) or not hasattr(loader, "num_workers"):
            raise TokpackError(  # was an AttributeError
                "load_loader_state takes a torchdata StatefulDataLoader",
                where="loader",
                expected="a StatefulDataLoader over this dataset",
                found=type(loader).__name__,
                hint="torch's DataLoader keeps no state: use torchdata.stateful_dataloader.StatefulDataLoader",
            )
        _same_workers(len(_worker_snapshots(_loader_state(loader_state))), loader.num_workers)
        loader.load_state_dict(loader_state)

    @staticmethod
    def consumed_samples(loader_state: dict) -> int:
        """The consumed-sample count G in a `StatefulDataLoader.state_dict()` of a TokpackDataset,
        with or without workers: start a fresh dataset there (`start_sample=G`) to resume with
        another world size, micro-batch or number of workers."""
        snapshots = _worker_snapshots(loader_state)
        if not snapshots:  # no workers: the dataset's own position
            state = loader_state.get("dataset_state")
            if not isinstance(state, dict) or "consumed_samples" not in state:
                raise _foreign("dataset_state", "{epoch, sample, consumed_samples}", state)
            return _state_int(state, "consumed_samples")
        shares = [w.get("dataset_state") if isinstance(w, dict) else None for w in snapshots.values()]
        if not all(isinstance(s, dict) and "next_step" in s for s in shares):
            raise _foreign("_worker_snapshots", _PER_WORKER, shares)
        # Steps below the smallest next step were all yielded (the loader yields in step order),
        # and so were the steps yielded since the snapshot.
        since = _state_int(loader_state, "_steps_since_snapshot") if "_steps_since_snapshot" in loader_state else 0
        step = min(_state_int(s, "next_step") for s in shares) + since
        return RankRows(1, _state_int(shares[0], "global_batch", 1), _state_int(shares[0], "start")).first(0, step)
