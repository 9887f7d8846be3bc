"""A stalled node stops `shuffle --to-nodes` within a bound (issue 41, item 5): `--stall-timeout
SECONDS`.

MPI has no timeout: when one process stops (SIGSTOP, a frozen machine, a node cut from the
network), the others wait in their next collective forever. So each process runs a thread of its
own (StallWatch) that sends a small heartbeat to every peer every timeout/10 seconds, on a
communicator of its own (the same MPI_THREAD_MULTIPLE condition as OnSigterm's listener), with
the count of the rounds its main thread has done (`progressed`). A process that has heard
nothing from peer k for the timeout counts k as stalled. The lowest-numbered process not
stalled writes one line naming the stalled node(s), where OnSigterm writes its lines (to the
launcher's stderr), and tells the others, which exit without a line; every one releases its
locks and exits at once, without MPI's finalize (which would wait for the stalled node), so the
launcher stops the job, the stalled process included (its SIGKILL takes a stopped process
too). A rerun of the same command resumes: the epochs complete on every node are kept, and
the output lock counts the killed holder as gone (formats/guard.py).

A heartbeat comes from a thread, not from the main thread: what it proves is that the process
runs and its network works, not that its main thread advances. A main thread blocked in a read
of a dead mount, its process running, is not named a stall (its thread still beats); a thread
that did not run for the timeout is (the process was stopped, or the machine did not schedule it).
A process that ends the command says so (BYE), so that one lingering after the others is not
taken for a stall of theirs."""

from __future__ import annotations

import math
import os
import threading
import time
from contextlib import suppress

import numpy as np

from tokpack.packer.transport import OnSigterm, process_name, release_all, settle, to_launcher

DEFAULT_STALL_TIMEOUT = 300.0  # seconds: minutes, far beyond any GC pause or slow write of a node that runs
BEAT, BYE, STALLED = 1, 2, 3  # a message's kind: [kind, value]


_watching: list = []  # the running watch: progressed() bumps it from wherever the rounds run


def progressed() -> None:
    """The exchange's progress (a round delivered, on the delivering thread): the heartbeats carry its count."""
    for watch in _watching:
        watch.progress += 1


class StallWatch:
    """This process's heartbeats to its peers, and its watch over theirs; `progressed()` counts the
    main thread's progress (the heartbeats carry it, the line names it); `close()` before MPI's
    finalize. Watches nothing where MPI serializes its threads, in a job of one, or with an
    infinite timeout."""

    TAG = 34
    POLL = 0.05  # seconds between the thread's looks at what arrived

    def __init__(self, MPI, comm, timeout: float | None, stop: OnSigterm, per_node: int = 1):
        self.progress = 0
        self.per_node = per_node  # processes a node: a line names the node (and process) of a world rank
        self.timeout = timeout
        self.stop_on = stop
        self.done = threading.Event()
        self.thread = None
        self.comm = None
        if timeout is None or not math.isfinite(timeout) or comm.Get_size() == 1:
            return
        if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
            return
        self.MPI = MPI
        self.comm = comm.Dup()  # collective: every process builds its watch at the same step
        self.thread = threading.Thread(target=self._watch, name="tokpack-stall", daemon=True)
        self.thread.start()
        _watching.append(self)

    def close(self) -> None:
        """Tells the peers this process ended the command (BYE) and stops the thread."""
        if self.thread is None:
            return
        _watching.remove(self)
        self.done.set()
        self.thread.join()
        self.thread = None

    def _watch(self) -> None:
        MPI, comm = self.MPI, self.comm
        node, N = comm.Get_rank(), comm.Get_size()
        peers = [k for k in range(N) if k != node]
        boxes = {k: np.zeros(2, np.int64) for k in peers}
        recvs = [comm.Irecv(boxes[k], source=k, tag=self.TAG) for k in peers]
        start = time.monotonic()
        heard = dict.fromkeys(peers, start)
        theirs = dict.fromkeys(peers, 0)
        gone: set[int] = set()
        sends: list = []  # (request, buffer): a buffer lives until its send completes
        interval = self.timeout / 10
        beat_at = last = start
        try:
            while not self.done.wait(0 if beat_at <= time.monotonic() else min(self.POLL, interval)):
                now = time.monotonic()
                if now - last > interval:  # this process did not run (stopped itself): that time is no peer's silence
                    heard = {k: t + (now - last) for k, t in heard.items()}
                last = now
                for i in MPI.Request.Testsome(recvs) or []:
                    k = peers[i]
                    kind, value = (int(v) for v in boxes[k])
                    heard[k] = now
                    if kind == BEAT:
                        theirs[k] = value
                    elif kind == BYE:
                        gone.add(k)
                    elif kind == STALLED:
                        self._exit(None)  # the reporter's line names the stalled node(s)
                    recvs[i] = comm.Irecv(boxes[k], source=k, tag=self.TAG)
                sends = [(r, b) for r, b in sends if not r.Test()]
                if now >= beat_at:
                    sends += self._send(peers, gone, BEAT, self.progress)
                    beat_at = now + interval
                stalled = [k for k in peers if k not in gone and now - heard[k] >= self.timeout]
                if stalled and min(k for k in range(N) if k not in stalled) == node:
                    self._report(stalled, {k: now - heard[k] for k in stalled}, theirs, peers, gone)
            settle(self._send(peers, gone, BYE, self.progress) + sends)
        finally:
            for r in recvs:  # the listening receives go before MPI's finalize
                with suppress(Exception):  # the process ends anyway
                    r.Cancel()
                    r.Wait()

    def _send(self, peers, gone, kind: int, value: int) -> list:
        out = []
        for k in peers:
            if k not in gone:
                buf = np.array([kind, value], np.int64)
                out.append((self.comm.Isend(buf, dest=k, tag=self.TAG), buf))
        return out

    def _report(self, stalled, silent, theirs, peers, gone) -> None:
        """The one line, then the others told (the stalled too, should it run again), then the exit."""
        OnSigterm.failing = True  # the launcher's SIGTERM, once a peer exits, adds no line of this process's
        ks = sorted(stalled)
        names = [process_name(k, self.per_node) for k in ks]
        which = names[0] if len(ks) == 1 else "nodes " + ", ".join(name.removeprefix("node ") for name in names)
        seconds = ", ".join(f"{silent[k]:.0f}" for k in ks)
        rounds = ", ".join(str(theirs[k]) for k in ks)
        to_launcher(
            f"tokpack: error: {which} stalled: no progress for {seconds} s (no heartbeat; its last after "
            f"{rounds} rounds of the exchange; --stall-timeout {self.timeout:g}); every node stops. HINT: find out why it stopped "
            f"(a signal, a frozen machine, the network), then rerun the same command: the epochs complete "
            f"on every node are kept\n"
        )
        self.stop_on.tell_peers()  # their SIGTERM from the launcher: silent
        settle(self._send(peers, gone, STALLED, 0))
        time.sleep(self.POLL * 2)  # their threads take the notice before the launcher's SIGTERM
        self._exit(1)

    def _exit(self, code: int | None) -> None:
        """Locks released, then out at once: MPI's finalize would wait for the stalled node.
        OnSigterm stays silent when the launcher's SIGTERM comes: this line is the job's."""
        OnSigterm.failing = True
        release_all(self.stop_on.locks)
        os._exit(1 if code is None else code)
