"""The time model of `shuffle --to-nodes` (tokpack.packer.exchange), in one place: `plan shuffle
--to-nodes` (tokpack.packer.plan_nodes) and bench/nodes.py both project with it.

Inputs: each phase's CPU seconds a byte (tokpack.packer.phases: a thread's user+sys, so the
machine's load does not move them; MEASURED, or a caller's), the bytes each phase moves on a node
(NodeWork: the exchange's own arithmetic), the rates (Rates: the shared filesystem's total and
its readers, a node's network and local disk, its processes and cores). Combined as the engine
runs them (`epoch`):

  keep        --keep-sources' first epoch: the process's source shards copied to its disk first.
  rounds      a window epoch's source blocks are read on a thread of their own (read_ahead)
              while the main thread cuts and routes (Alltoallv) a round and a thread of its own
              delivers (places) the round before (transport.exchange_rounds), so the rounds take
              the longest of their chains: the reading thread's I/O and its CPU (it asks the
              disk for the next block before it hashes this one: the two overlap), the main
              thread's CPU then its Alltoallv on the network (each round's collectives being
              synchronous), the delivering thread's CPU; a best-fit epoch reads in the main
              thread. Out of core the pieces received are appended to
              bucket files (written back by the kernel meanwhile: the local disk's bytes). In
              memory, windows, written through (NodeWork.write_through): each row a round
              completes also written to its rank file by a thread of its own (a third chain; its
              bytes the disk's during the rounds, what is left waited for by the write phase's fsync).
  write       then the slice's rank files: written, or (written through) hashed and indexed
              only, each row's facts for its owner taken from the same pass. Out of core, its
              buckets read back on a thread a bucket ahead of the main thread's write
              (node_store.Buckets: the longer of the two chains; the writes behind by writeback).
  facts       then the rows' facts sent to their epoch shards' owners (small arrays, a few
              dozen bytes a row: no network term) and the owned shards' entries built from
              them (tokpack.packer.owned_facts); no token moves.

Each phase takes the largest of its chains and of each resource's total (shared filesystem,
network, local disk (its reads and writes apart where it does both at once: Rates.disk_duplex),
CPU over the cores its threads can use); the phases add; the resource that
binds is the one whose terms hold most of the total. A replacement node (`replacement`) reads
its rows' merged ranges one after the other (READ_DEPTH at once, tokpack.packer.source_reads)
at a stated latency, checks and writes them: one chain, its disk writes behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokpack.packer.node_epoch import fact_row_bytes
from tokpack.packer.source_reads import READ_DEPTH

SHARED, NETWORK, DISK, CPU, REPLACEMENT_READS = (
    "shared filesystem",
    "network",
    "local disk",
    "CPU",
    "replacement reads",
)
# A local disk that reads and writes at once (Rates.disk_duplex), each direction its own resource
DISK_READS, DISK_WRITES = "local disk reads", "local disk writes"
START = "start-up"  # the launcher, the imports, MPI's wire-up: before any byte moves
READ_LATENCY_S = 100e-6  # one small read of the shared filesystem (issue 41: 100 us)
START_SECONDS = 0.5  # a process's start (tokpack.packer.plan_result.COMMAND_START_SECONDS)

# CPU seconds a byte of each phase on this machine's core (tokpack.packer.phases; bytes as each
# phase counts them: read and cut the source bytes read, route the bytes sent, place and
# bucket_write the bytes received, bucket_read the bytes read back, write the slice's token bytes,
# facts the owned shards' token bytes its rows' facts stand for). Measured by the run below; `python bench/nodes.py`
# prints them again ("s/byte") from its own 4-process run.
MEASURED = {
    "read": 0.209e-9,
    "cut": 0.0663e-9,
    "route": 0.55e-9,
    "place": 0.17e-9,
    "bucket_write": 0.883e-9,
    "bucket_read": 0.543e-9,
    "write": 0.436e-9,
    # the facts' rounds and the owned shards' entries (owned_facts), a byte of the owned shards'
    # tokens (none of which moves); 0.03 s/GB at 2 GiB (bench/nodes.py --against b0a2bc6): at
    # 512 MiB MPI's polling while a peer writes counts here too
    "facts": 0.0466e-9,
    # in memory, windows, where the host has the cores (node_store.write_through_pays): the rows'
    # pwrites into the page cache during the rounds (whole pages, a thread of their own), a byte
    # of the slice. The write phase after costs what it did (its hash and index: the O_DIRECT
    # write it no longer does was DMA).
    "write_through": 0.79e-9,
}
MEASURED_BY = (
    'bench/nodes.py --size 512MiB at 86ddb00 (with this model), 2026-12-06 15:14 UTC, quiet machine (BENCHMARKS.md, "Straight '
    "to the nodes\"): the 4-process first, later and out-of-core runs' --json phases summed (2-core Xeon VM); "
    "write_through: 4-process in-memory runs of 3 GiB with the write-through forced on, at 91a02bb, 08:10 UTC "
    "(0.59-0.84 over 1 and 3 GiB; its write phase after: 0.436 ns a byte, without it 0.437)"
)


@dataclass
class Rates:
    """What a node has: MB/s of the shared filesystem in all (`shared_mbps`, shared by `readers`
    nodes reading at once), of its network (`nic_mbps`; None: one machine, where MPI's copies are
    CPU, counted in route) and of its local disk (`disk_duplex`: reads and writes at once, each at
    `disk_mbps`, as an NVMe drive does; else one resource for both); `procs` processes a node,
    `cores` (None: enough for every thread, two a process)."""

    shared_mbps: float
    nic_mbps: float | None
    disk_mbps: float
    readers: int = 1
    procs: int = 1
    cores: int | None = None
    start_s: float = START_SECONDS
    disk_duplex: bool = False

    def disk(self, read: float = 0, written: float = 0) -> dict:
        """The local disk's seconds for `read` and `written` bytes: one term, or one a direction."""
        if not self.disk_duplex:
            return {DISK: _mbps(read + written, self.disk_mbps)}
        return {DISK_READS: _mbps(read, self.disk_mbps), DISK_WRITES: _mbps(written, self.disk_mbps)}


@dataclass
class NodeWork:
    """The bytes one node (all its processes) moves in one epoch."""

    source_bytes: int  # the source tokens its processes read
    from_shared: bool = True  # from the shared filesystem, else its local disk (kept sources)
    kept_copied: int = 0  # source bytes copied now to its disk (--keep-sources' first epoch)
    sent: int = 0  # network bytes out (to other nodes)
    received: int = 0  # network bytes in
    routed: int = 0  # tokens sent (each once, to its keeper), its own included (route's bytes)
    placed: int = 0  # tokens received into its store: its slice's
    slice_bytes: int = 0  # token bytes of its rank files
    small_bytes: int = 0  # the rest it writes on its disk: row hashes, index, padding
    owned_bytes: int = 0  # token bytes of the owned shards, whose rows' facts come to it (facts' bytes)
    out_of_core: bool = False  # the stores are bucket files: written in the rounds, read back after
    read_ahead: bool = True  # windows: read on a thread of their own; best-fit: in the main thread
    # in memory, windows: the slice's rows written to their rank files during the rounds
    # (node_store.open_slice_files), so that the write phase only hashes and indexes them
    write_through: bool = False
    memory_needed: int = 0  # --memory a process needs in memory (NodeEpoch.keep_bytes), for the report


@dataclass
class Phase:
    name: str
    seconds: float
    binding: str
    terms: dict  # resource or chain -> seconds


@dataclass
class Prediction:
    seconds: float
    binding: str
    phases: list = field(default_factory=list)
    by_resource: dict = field(default_factory=dict)  # seconds of the total each resource binds

    @property
    def minutes(self) -> float:
        return self.seconds / 60

    def as_dict(self) -> dict:
        return {
            "seconds": round(self.seconds, 3),
            "binding": self.binding,
            "phases": [
                {"phase": p.name, "seconds": round(p.seconds, 3), "binding": p.binding, "terms": _rounded(p.terms)}
                for p in self.phases
            ],
            "by_resource": _rounded(self.by_resource),
        }


def _only(terms: dict) -> dict:
    """A chain's disk step: the one direction it uses (Rates.disk gives both when duplex)."""
    return {k: v for k, v in terms.items() if v} or dict(list(terms.items())[:1])


def _rounded(d: dict) -> dict:
    return {k: round(v, 3) for k, v in d.items()}


def _mbps(nbytes: float, mbps: float | None) -> float:
    return 0.0 if not nbytes or mbps is None else nbytes / (mbps * 1e6)


def _phase(name: str, chains: dict, resources: dict) -> Phase:
    """The phase's time: its longest chain or busiest resource. A chain (a thread's steps one
    after the other) binds by its largest step."""
    terms = {**{f"{k} (chain)": sum(v.values()) for k, v in chains.items()}, **resources}
    top = max(terms, key=terms.get) if terms else CPU
    if top.endswith(" (chain)"):
        steps = chains[top.removesuffix(" (chain)")]
        binding = max(steps, key=steps.get)
    else:
        binding = top
    return Phase(name, terms.get(top, 0.0), binding, terms)


def epoch(work: NodeWork, rates: Rates, costs: dict | None = None) -> Prediction:
    """One epoch on one node: its phases as the engine runs them (the module's docstring), their
    sum, and the resource that binds."""
    c = {**MEASURED, **(costs or {})}
    P = max(1, rates.procs)
    through = work.write_through and not work.out_of_core
    # a process's threads in the rounds: its main thread, its delivering thread (transport.
    # exchange_rounds), its reading thread (windows), its writing thread (written through:
    # node_store.InMemory)
    threads = P * (2 + work.read_ahead + through)
    cores_rounds = threads if rates.cores is None else min(rates.cores, threads)
    share = rates.shared_mbps / max(1, rates.readers)
    src_io = (
        {SHARED: _mbps(work.source_bytes, share)} if work.from_shared else _only(rates.disk(read=work.source_bytes))
    )
    keep_io = _mbps(work.kept_copied, share)
    store = "bucket_write" if work.out_of_core else "place"
    read_cpu = c["read"] * work.source_bytes
    main_cpu = c["cut"] * work.source_bytes + c["route"] * work.routed
    store_cpu = c[store] * work.placed  # a round's delivery, on a thread of its own during the next round
    write_cpu = c["write_through"] * work.slice_bytes if through else 0.0
    net = max(_mbps(work.sent, rates.nic_mbps), _mbps(work.received, rates.nic_mbps))
    main = {CPU: main_cpu / P, NETWORK: net}
    if not work.read_ahead:  # one chain: the main thread reads too
        main = {**src_io, CPU: (read_cpu + main_cpu) / P, NETWORK: net}
    # windows: the reading thread asks the disk for the next block before it hashes this one
    # (shuffle.source_windows.iter_source_windows, gate.will_need): its I/O and its CPU overlap, two chains
    chains = {"read": src_io, "hash": {CPU: read_cpu / P}, "main": main} if work.read_ahead else {"main": main}
    chains["deliver"] = {CPU: store_cpu / P}
    if through:
        chains["write"] = {CPU: write_cpu / P}
    read_rounds = 0 if work.from_shared else work.source_bytes
    # out of core every slice row to a bucket; written through, the slice's rows to their rank
    # files (what the disk has not taken when the rounds end, the write phase's fsync waits for:
    # counted here, the rounds' time the longer)
    written_rounds = work.slice_bytes if work.out_of_core or through else 0
    rounds = _phase(
        "rounds",
        chains,
        {
            SHARED: src_io.get(SHARED, 0.0),
            NETWORK: net,
            **rates.disk(read_rounds, written_rounds),
            CPU: (read_cpu + main_cpu + store_cpu + write_cpu) / cores_rounds,
        },
    )
    # --keep-sources' first epoch copies the process's shards to its disk before the rounds
    # (kept_sources: read from the shared filesystem, written behind by the kernel)
    keep = _phase("keep", {}, {SHARED: keep_io, **rates.disk(written=work.kept_copied)})
    phases = [keep, rounds] if work.kept_copied else [rounds]
    slice_written = work.small_bytes + (0 if through else work.slice_bytes)
    one = P if rates.cores is None else min(rates.cores, P)  # a main thread a process
    write_cpu = c["write"] * work.slice_bytes
    if not work.out_of_core:
        chains = {"write": {CPU: write_cpu / P}}
        phases.append(_phase("write", chains, {**rates.disk(written=slice_written), CPU: write_cpu / one}))
    else:
        # Out of core the slice's buckets are read back (both directions of the local disk:
        # written in the rounds, read here), on a thread a bucket ahead of the main thread's write.
        n = work.slice_bytes
        read_cpu = c["bucket_read"] * n
        chains = {"main": {CPU: write_cpu / P}, "read": {**_only(rates.disk(read=n)), CPU: read_cpu / P}}
        two = 2 * P if rates.cores is None else min(rates.cores, 2 * P)
        phases.append(_phase("write", chains, {**rates.disk(n, slice_written), CPU: (write_cpu + read_cpu) / two}))
    # the owners' part: the facts' rounds and the owned shards' entries, on the main thread
    facts_cpu = c["facts"] * work.owned_bytes
    phases.append(_phase("facts", {"main": {CPU: facts_cpu / P}}, {CPU: facts_cpu / one}))
    return _total(phases, rates.start_s)


def _total(phases: list, start_s: float) -> Prediction:
    by: dict = {}
    for p in phases:
        if p.seconds > 0:
            by[p.binding] = by.get(p.binding, 0.0) + p.seconds
    if start_s:
        phases = [*phases, Phase("start", start_s, START, {START: start_s})]
        by[START] = by.get(START, 0.0) + start_s
    seconds = sum(p.seconds for p in phases)
    return Prediction(seconds, max(by, key=by.get) if by else CPU, phases, by)


def replacement(
    nbytes: int,
    ranges: int,
    rates: Rates,
    costs: dict | None = None,
    *,
    latency_s: float = READ_LATENCY_S,
    queue_depth: int = READ_DEPTH,
) -> Prediction:
    """A replacement node alone (`stage RUN DEST --node n/N` on a --to-nodes RUN): its rows'
    `ranges` (merged ranged reads) at `latency_s` each, `queue_depth` at once, their `nbytes` at
    what the shared filesystem gives one node (min(its total, the NIC)); each part checked (its
    rows hashed: read's cost a byte) and written (write's), one after the other in each of its
    `rates.procs` processes (`stage --workers`); the disk writes behind."""
    c = {**MEASURED, **(costs or {})}
    alone = rates.shared_mbps if rates.nic_mbps is None else min(rates.shared_mbps, rates.nic_mbps)
    P = max(1, rates.procs)  # `stage --workers P`: each process its share of the ranks, its own reads in flight
    chain = {
        REPLACEMENT_READS: ranges * latency_s / (max(1, queue_depth) * P),
        SHARED: _mbps(nbytes, alone),
        CPU: (c["read"] + c["write"]) * nbytes / P,
    }
    return _total([_phase("replacement", {"main": chain}, rates.disk(written=nbytes))], rates.start_s)


def ranges_at_density(rows: int, nodes: int) -> int:
    """A node's rows' merged ranges when its windows are 1/nodes of the sources' at random (a
    shuffled epoch): a row's window follows the node's previous one with chance about 1/nodes."""
    return max(0, round(rows * (1 - 1 / max(1, nodes)))) if rows else 0


def uniform_work(token_bytes: float, nodes: int, row_bytes: int, **kw) -> NodeWork:
    """One node's bytes when the epoch's `token_bytes` spread evenly over `nodes` (the exchange's
    arithmetic: every row read once and sent once, to the node whose ranks read it; a node keeps
    1/nodes and owns 1/nodes, whose rows' facts come to it). What bench/nodes.py projects for a
    size it cannot plan."""
    N = max(1, nodes)
    B = token_bytes / N
    # a row read on node m goes elsewhere unless its node is m; with 16 bytes of WIRE_PIECE a row
    wire = 1 + 16 / row_bytes
    off = (N - 1) / N
    return NodeWork(
        source_bytes=int(B),
        sent=int(B * off * wire),
        received=int(B * off * wire),
        routed=int(B),  # every piece once, its own included
        placed=int(B),  # what arrives: its slice's rows
        slice_bytes=int(B),
        small_bytes=int(B / row_bytes * 16),
        owned_bytes=int(B),
        # NodeEpoch.keep_bytes: the rows, their unfilled counts and positions, their facts
        memory_needed=int(B * (1 + (16 + fact_row_bytes(row_bytes // 2)) / row_bytes)),  # uint16 tokens
        **kw,
    )
