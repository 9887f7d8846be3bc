"""A node of `shuffle --to-nodes` is P processes (issue 41): `mpirun --map-by ppr:P:node` starts
P a node (typically one a GPU), in blocks: world process q is process p = q mod P of node
n = q // P. This module says what P is (`--procs-per-node`, else the launcher's layout), refuses
a world that is not N nodes of P processes each on one host, and gives the node's own
communicator (tokpack.packer.exchange shares the node's DEST, lock, manifests, kept sources and
memory among its processes through it)."""

from __future__ import annotations

from dataclasses import dataclass

from tokpack.formats.errors import TokpackError
from tokpack.packer.transport import together

OPTION = "--procs-per-node"
HINT = "start P processes a node, in blocks: `mpirun -n N*P --map-by ppr:P:node ...` (docs/CLUSTER.md)"


@dataclass
class Node:
    """This process's place: world `comm` (q of W), node n of N, process p of its P, and
    `local`, the communicator of its node's processes (p is its rank there)."""

    MPI: object
    comm: object
    local: object
    q: int
    n: int
    N: int
    p: int
    P: int
    on_host: int = 1  # the processes on this one's host (several nodes share one under --oversubscribe)

    @property
    def leader(self) -> bool:
        """The node's process that takes DEST's lock and writes its manifests and shared files."""
        return self.p == 0

    def together(self, fn):
        """tokpack.packer.transport.together over the world, each process named by its node."""
        return together(self.comm, fn, self.P)


def node_of_process(MPI, comm, given: int | None) -> Node:
    """This process's Node: P is `given` (--procs-per-node), else the processes on each host when
    the job spans several hosts with as many on each, in blocks (what `--map-by ppr:P:node`
    gives), else 1 (each process a node: how one machine runs several nodes, under
    --oversubscribe). Refused, the same line on every process and before anything is written:
    a world size that is not a multiple of P, and a node whose processes are not on one host
    (they share its local disk)."""
    W, q = comm.Get_size(), comm.Get_rank()
    host = comm.Split_type(MPI.COMM_TYPE_SHARED, key=q)  # the processes sharing this one's memory
    try:
        first = min(host.allgather(q))
    finally:
        host.Free()
    hosts = comm.allgather(first)  # each process's host, named by its first process
    P = launcher_procs(hosts) if given is None else given
    if W % P:
        raise TokpackError(
            f"the world of {W} processes is not nodes of {P} processes each",
            where=OPTION,
            expected=f"a multiple of {P} processes",
            found=W,
            hint=HINT,
        )
    for r in range(W):
        lead = (r // P) * P
        if hosts[r] != hosts[lead]:
            raise TokpackError(
                f"the processes of node {r // P} are not on one host: processes {lead} and {r} "
                f"run on different hosts, and a node's processes share its local disk",
                where=OPTION,
                expected=f"{P} processes a host, in blocks",
                hint=HINT,
            )
    n = q // P
    local = comm.Split(n, q)
    return Node(MPI, comm, local, q, n, W // P, q % P, P, hosts.count(first))


def launcher_procs(hosts: list[int]) -> int:
    """P as the launcher placed the processes (`hosts`: each process's host): the count on each
    host, when there are several hosts, each a block of as many processes; else 1."""
    W = len(hosts)
    first = hosts.count(hosts[0])
    if first == W or W % first or any(hosts[r] != hosts[(r // first) * first] for r in range(W)):
        return 1
    if len({hosts[r] for r in range(0, W, first)}) != W // first:  # a host's processes in two blocks
        return 1
    return first
