"""The hand-off of a batch from a DataLoader worker to the training process (with
torch_adapter.py and trainer_forms.py, the only tokpack modules that import torch).

A DataLoader worker hands each item to the main process through a queue: every tensor in it
crosses on its own (torch moves its storage to shared memory and passes its file descriptor to
the main process, a socket connection to the worker and a handshake each), and a batch is five
to nine tensors. A worker's `Batch` holds its fields as views of one shared buffer and pickles
as that buffer and their layout, so a batch crosses as one buffer; the main process unpickles it
into the same fields, views of the buffer.

The buffer crosses by name, not by descriptor: a worker makes it a file of its own in /dev/shm
(the tmpfs where torch's shared memory lives too) and sends the name; the main process opens
it, removes the name at once and maps it, a few system calls with no reply from the worker
(torch's descriptor passing waits for the worker's sharing thread: about 0.6 ms a batch on a
busy 2-core machine, half the hand-off). The mapping is the same shared memory torch's own
would be (it crosses on to another process as any tensor does). A name the main process never
opens (the batches in flight when a loader stops early) is removed when the worker exits: a
worker keeps the last `NAMES_KEPT` names it made, far more than the batches a loader has in
flight (prefetch_factor a worker); the training process removes, at its exit, those of its
workers that were stopped with no cleanup (SIGTERM, as multiprocessing stops the workers of a
loader still running at exit). Names left by processes killed outright (SIGKILL), `tokpack-<pidns>-<pid>-*`
in /dev/shm, a few MiB, are removed by the next process that makes one, once a minute old and
their process gone. Where no such file can be made, the buffer is torch's shared memory, passed
by descriptor.
"""

from __future__ import annotations

import functools
import itertools
import math
import multiprocessing.util
import os
import secrets
import time
from collections import deque
from contextlib import suppress
from typing import Iterator

import numpy as np
import torch

from tokpack.formats.errors import TokpackError

_ALIGN = 8  # every field starts on a multiple of 8 bytes (the widest dtype, int64)

# The loader asks a worker for its next batch from inside the training process's `next(loader)`,
# which then still has its own share of the hand-off to finish (torch's bookkeeping, the thread
# that sends the request). A worker that starts reading and assembling at once takes a CPU from it
# where the cores are few: on a 2-core machine, the floor of bench/train_loop.py with 1 ms of work
# in its worker waited about 1 ms more, and tokpack's wait with 2 workers was twice the floor's.
# The worker has several steps of slack (its batch is asked for prefetch_factor batches ahead), so
# it starts each batch after its first this long after the request: far less than a step, and a
# worker still serves a batch every few milliseconds, far more than a GPU consumes. Without the
# pause, tokpack's median wait there was 1.4-2.3 ms; with it 0.9-1.05, below the floor's
# (bench/results/HISTORY.md, "The hand-off, before and after (04:38 UTC)").
HANDOFF_PAUSE_S = 0.001


def _views(buffer: torch.Tensor, layout: tuple) -> list[torch.Tensor]:
    """The fields of `layout` ((key, dtype, shape, offset), ...) as views of the uint8 `buffer`.
    A run of fields of one dtype and shape, back to back, is one view unbound into its fields: the
    main process builds these on every batch, and a torch call costs more than its bytes here.

    The fields of the first field's dtype view the buffer's storage; a field of another dtype
    (int32 `cu_seqlens` beside int64 `input_ids`) views a storage of its own over its bytes (no
    copy): torch.save refuses tensors that view one storage as two dtypes, so
    `torch.save(dict(batch))` of a DataLoader worker's batch failed."""
    out, i, raw = [], 0, None
    while i < len(layout):
        _, dtype, shape, offset = layout[i]
        n = math.prod(shape) * dtype.itemsize
        j = i + 1
        while j < len(layout) and layout[j][1:] == (dtype, shape, offset + (j - i) * n):
            j += 1
        if dtype == layout[0][1] or n == 0:
            block = buffer[offset : offset + (j - i) * n].view(dtype)
        else:
            raw = memoryview(buffer.numpy()) if raw is None else raw
            block = torch.frombuffer(raw, dtype=dtype, count=(j - i) * n // dtype.itemsize, offset=offset)
        out += [block.view(shape)] if j == i + 1 else block.view((j - i, *shape)).unbind(0)
        i = j
    return out


@functools.cache
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def _uint8(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage`."""
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _rebuild(buffer: torch.Tensor, layout: tuple) -> "Batch":
    batch = Batch(zip((key for key, *_ in layout), _views(buffer, layout)))
    batch._packed = (buffer, layout)
    return batch


class Batch(dict):
    """A TokpackDataset batch: a dict of tensors (its keys: TokpackDataset). Built in a DataLoader
    worker (`empty`, `packed`), it crosses as one buffer (the module's docstring); its fields keep
    the whole buffer alive while any of them lives. Once a field is replaced or added (a
    collate_fn's change), it pickles as its tensors, one by one."""

    _packed: tuple | None = None  # (buffer, layout)
    _name: list | None = None  # [the buffer's name in SHM_DIR], until it is pickled once (shared by copies)

    @classmethod
    def empty(cls, fields, shared: bool) -> tuple["Batch", list[np.ndarray]]:
        """A Batch of the (key, numpy dtype, shape) `fields` and the same fields as numpy arrays,
        for the caller to write the values into. `shared` (a DataLoader worker's): views of one
        new buffer in shared memory, where torch would move each tensor to send it, so that the
        batch crosses as that one tensor. Otherwise (the training process's own batch, which
        crosses nothing): a numpy array a field, made a tensor by torch.from_numpy. malloc hands
        the last batches' pages back for arrays of a field's size, where one buffer of the
        batch's (a MiB and more) came as fresh pages, a page fault each 4 KiB (132 a batch at
        seq_len 4096, m = 9), and so did torch.empty's."""
        if not shared:
            arrays = [np.empty(shape, dtype=dtype) for _, dtype, shape in fields]
            return cls(zip((key for key, *_ in fields), map(torch.from_numpy, arrays))), arrays
        layout, spans, offset = [], [], 0
        for key, dtype, shape in fields:
            n = math.prod(shape) * dtype.itemsize
            layout.append((key, _torch_dtype(dtype), shape, offset))
            spans.append((offset, n, dtype, shape))
            offset += -(-n // _ALIGN) * _ALIGN
        nbytes = max(offset, 1)
        buffer, name = _named_buffer(nbytes) or (_uint8(torch.UntypedStorage._new_shared(nbytes)), None)
        raw = buffer.numpy()
        arrays = [raw[o : o + n].view(dtype).reshape(shape) for o, n, dtype, shape in spans]
        batch = _rebuild(buffer, tuple(layout))
        batch._name = name
        return batch, arrays

    @classmethod
    def packed(cls, arrays: dict) -> "Batch":
        """The numpy `arrays` copied into one shared buffer (`empty`), each field a view of it."""
        batch, views = cls.empty([(key, value.dtype, value.shape) for key, value in arrays.items()], True)
        for view, value in zip(views, arrays.values()):
            view[...] = value
        return batch

    def __copy__(self) -> "Batch":
        """The same fields (DataLoader's default_convert copies each item it is given): the copy
        keeps the buffer's layout, so it still crosses a process as one tensor."""
        batch = Batch(self)
        batch._packed, batch._name = self._packed, self._name
        return batch

    def __reduce__(self):
        if self._packed is not None and self._as_built():
            buffer, layout = self._packed
            if self._name and self._name[0] is not None:
                # By name, once (the worker's queue; its receiver removes the name): pickled again,
                # the buffer goes as a tensor, as torch sends one.
                name, self._name[0] = self._name[0], None
                return _rebuild_named, (name, buffer.untyped_storage().nbytes(), layout)
            return _rebuild, (buffer, layout)
        return Batch, (dict(self),)

    def _as_built(self) -> bool:
        """Whether every field is still its view of the buffer. Checked by place, not by object:
        DataLoader's default_convert (batch_size=None) puts the same views in a copy."""
        buffer, layout = self._packed
        base = buffer.data_ptr()
        return len(self) == len(layout) and all(
            isinstance(t := self.get(key), torch.Tensor)
            and t.dtype == dtype
            and tuple(t.shape) == shape
            and t.data_ptr() == base + offset
            and t.is_contiguous()
            and base <= t.untyped_storage().data_ptr() <= base + offset  # the buffer's, or its dtype's own (_views)
            for key, dtype, shape, offset in layout
        )


# ------------------------------------------------------------- the buffer, by name

SHM_DIR = "/dev/shm"
NAMES_KEPT = 1024  # a worker's last names, removed at its exit (the batches in flight are a few)
SWEEP_AGE_S = 60  # a name left by a process gone is removed once this old (_sweep_gone)
_COUNT = itertools.count()


def _pid_namespace() -> int:
    """This process's PID namespace (its inode): a name's process id means a process only in it,
    so a container sharing /dev/shm with another never takes the other's names for orphans."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


PREFIX = f"tokpack-{_pid_namespace()}-"  # then the process id, a count and a random tag
_made: deque | None = None  # this process's last names made, once one is


def _forget_names() -> None:
    global _made, _senders
    _made = _senders = None  # a forked child: its own names from now, its own removal at its exit


os.register_at_fork(after_in_child=_forget_names)


def _remove(names) -> None:
    for name in list(names):  # a copy: the deque may still grow in another thread
        with suppress(OSError):  # opened (and removed) by the main process already
            os.unlink(name)


def _named_buffer(nbytes: int) -> tuple[torch.Tensor, list] | None:
    """A uint8 tensor of `nbytes` in shared memory, a new file of SHM_DIR, and [its name] (the
    Batch's one-shot name); None where no such file can be made (then torch's own)."""
    global _made
    name = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-{next(_COUNT)}-{secrets.token_hex(4)}")
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        os.ftruncate(fd, nbytes)
        storage = torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)
    except (OSError, RuntimeError, AttributeError):  # AttributeError: a torch without the private call
        _remove([name])
        return None
    finally:
        os.close(fd)
    if _made is None:
        _made = deque(maxlen=NAMES_KEPT)
        # Run when the process exits normally (a DataLoader worker once the loader stops it).
        multiprocessing.util.Finalize(None, _remove, args=(_made,), exitpriority=0)
        _sweep_gone()
    _made.append(name)
    return _uint8(storage), [name]


def _sweep_gone() -> None:
    """Removes the names of SHM_DIR that processes now gone left (killed outright, or stopped
    with no cleanup by a training process that then exited without its own): this user's, made a
    minute ago or more, in this PID namespace, by a process id no process has. Run once a
    process, at its first name."""
    now = time.time()
    gone: dict[int, bool] = {}
    for pid, path in _names():
        if pid not in gone:
            gone[pid] = not _running(pid)
        try:
            st = os.stat(path)
        except OSError:
            continue
        if gone[pid] and st.st_uid == os.getuid() and now - st.st_mtime >= SWEEP_AGE_S:
            _remove([path])


def _names() -> Iterator[tuple[int, str]]:
    """(process id, path) of each name in SHM_DIR that a process of this PID namespace made."""
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return
    for entry in entries:
        parts = entry[len(PREFIX) :].split("-")
        if entry.startswith(PREFIX) and len(parts) == 3 and parts[0].isdigit():
            yield int(parts[0]), os.path.join(SHM_DIR, entry)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: running
        return True
    return True


_senders: set[int] | None = None  # the main process's: the workers whose names it has opened


def _sweep(pids) -> None:
    """The names left in SHM_DIR by the processes `pids` (each gone by now)."""
    _remove([path for pid, path in _names() if pid in pids])


def _sender(name: str) -> None:
    """Records the worker that made `name`, and with it every child process then running (its
    loader's other workers, whose batches this process may never open). A worker stopped without
    its own cleanup (SIGTERM: torch's handler exits at once) leaves what it had in flight: when
    the training process exits with a loader still running, multiprocessing stops its workers so,
    and a loader whose worker does not stop within its timeout does. Those names are removed when
    this process exits, by a finalizer that runs after multiprocessing has joined its children."""
    global _senders
    pid = int(os.path.basename(name)[len(PREFIX) :].split("-")[0])
    if _senders is None:
        _senders = set()
        multiprocessing.util.Finalize(None, _sweep, args=(_senders,), exitpriority=-10)
    if pid not in _senders:  # a new worker: once, not every batch
        _senders.update(p.pid for p in multiprocessing.active_children())
        _senders.add(pid)


def _rebuild_named(name: str, nbytes: int, layout: tuple) -> "Batch":
    """The main process's side: the buffer opened by its name, the name removed, its fields."""
    _sender(name)
    try:
        fd = os.open(name, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        raise TokpackError(
            "a DataLoader worker's batch left shared memory before the training process took it",
            file=name,
            hint="keep /dev/shm as it is while a loader runs (nothing may remove tokpack-* files there)",
        ) from None
    try:
        os.unlink(name)
        storage = torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)
    finally:
        os.close(fd)
    return _rebuild(_uint8(storage), layout)
