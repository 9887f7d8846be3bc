"""The time model of `shuffle --to-nodes` (tokpack.packer.node_model), on hand-computed cases:
which resource binds when, the read-ahead thread's overlap against one chain, out of core's
both directions on the local disk, a replacement node's reads; and `plan shuffle --to-nodes
--json` naming the resource that binds. No wall clock: the model's arithmetic only."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import random_docs, write_source

from tokpack.packer.cli import main
from tokpack.packer.node_model import (
    CPU,
    DISK,
    DISK_READS,
    DISK_WRITES,
    NETWORK,
    REPLACEMENT_READS,
    SHARED,
    NodeWork,
    Rates,
    epoch,
    ranges_at_density,
    replacement,
    uniform_work,
)
from tokpack.packer.phases import PHASES, Phases

FREE = dict.fromkeys(PHASES, 0.0)  # CPU that costs nothing: only the resources count
GB = 10**9


def rates(**kw) -> Rates:
    return Rates(**{"shared_mbps": 1000.0, "nic_mbps": 1000.0, "disk_mbps": 1000.0, "start_s": 0.0, **kw})


def seconds_of(pred, name: str) -> float:
    return next(p.seconds for p in pred.phases if p.name == name)


def test_the_shared_filesystem_binds_when_its_share_is_the_slowest():
    # 10 GB read by each of 10 readers of a 1,000 MB/s filesystem: 100 MB/s each, 100 s
    work = NodeWork(source_bytes=10 * GB, sent=GB, received=GB)
    pred = epoch(work, rates(readers=10), FREE)
    assert pred.binding == SHARED
    assert seconds_of(pred, "rounds") == pytest.approx(100.0)
    assert pred.seconds == pytest.approx(100.0)  # nothing written, nothing to hash


def test_the_network_binds_when_a_node_sends_more_than_its_link_moves_first():
    # 2 GB out, 3 GB in at 100 MB/s (full duplex: the larger) against 1 GB read at 1,000 MB/s
    work = NodeWork(source_bytes=GB, sent=2 * GB, received=3 * GB)
    pred = epoch(work, rates(nic_mbps=100.0), FREE)
    assert pred.binding == NETWORK and seconds_of(pred, "rounds") == pytest.approx(30.0)


def test_the_cpu_binds_at_a_cost_a_byte_and_two_threads_a_process():
    # read 1 ns/B on the read-ahead thread, route 4 ns/B of 2 GB on the main thread: 2 s and 8 s
    costs = {**FREE, "read": 1e-9, "route": 4e-9}
    work = NodeWork(source_bytes=2 * GB, routed=2 * GB)
    fast = rates(shared_mbps=1e6, nic_mbps=1e6, disk_mbps=1e6)
    pred = epoch(work, fast, costs)
    assert pred.binding == CPU and seconds_of(pred, "rounds") == pytest.approx(8.0, rel=1e-3)
    # one core for the process: both threads' CPU on it, 10 s
    one = epoch(work, Rates(1e6, 1e6, 1e6, cores=1, start_s=0.0), costs)
    assert seconds_of(one, "rounds") == pytest.approx(10.0, rel=1e-3)
    # 4 processes a node share the work (and its 8 threads the CPU): a quarter
    four = epoch(work, Rates(1e6, 1e6, 1e6, procs=4, start_s=0.0), costs)
    assert seconds_of(four, "rounds") == pytest.approx(2.0, rel=1e-3)


def test_the_read_ahead_overlaps_the_rounds_and_a_best_fit_read_does_not():
    # reading thread: 5 s of I/O (5 GB at 1,000 MB/s) beside 7 s of hashing (the next block
    # asked of the disk before this one is hashed: they overlap, 7 s, not 12); main thread: 4 s
    # of route + 2 s on the network = 6 s
    costs = {**FREE, "read": 1.4e-9, "route": 2e-9}
    work = NodeWork(source_bytes=5 * GB, routed=2 * GB, sent=2 * GB, received=GB)
    r = rates()
    windows = epoch(work, r, costs)
    assert seconds_of(windows, "rounds") == pytest.approx(7.0, rel=1e-3)  # max(5, 7, 6)
    assert windows.binding == CPU  # the hash
    slow_disk = epoch(work, rates(shared_mbps=500.0), costs)
    assert seconds_of(slow_disk, "rounds") == pytest.approx(10.0, rel=1e-3) and slow_disk.binding == SHARED
    work.read_ahead = False
    best_fit = epoch(work, r, costs)
    assert seconds_of(best_fit, "rounds") == pytest.approx(18.0, rel=1e-3)  # 5 + 7 + 4 + 2


def test_out_of_core_writes_the_buckets_and_reads_them_back():
    # slice 3 GB, owned 2 GB; the disk at 1,000 MB/s. In memory: the slice written, 3 s.
    work = NodeWork(source_bytes=0, slice_bytes=3 * GB, owned_bytes=2 * GB)
    r = rates()
    mem = epoch(work, r, FREE)
    assert mem.seconds == pytest.approx(3.0) and mem.binding == DISK
    work.out_of_core = True
    ooc = epoch(work, r, FREE)
    # the slice's buckets (3 GB: the owned shards' rows are not there, only their facts come)
    # written in the rounds, read back, the slice written: 3 + 3 + 3
    assert seconds_of(ooc, "rounds") == pytest.approx(3.0)
    assert seconds_of(ooc, "write") == pytest.approx(6.0)
    assert seconds_of(ooc, "facts") == pytest.approx(0.0)
    assert ooc.seconds == pytest.approx(9.0) and ooc.binding == DISK


def test_out_of_core_reads_a_bucket_ahead_of_the_write():
    # the slice's 3 GB of buckets read back at 1,000 MB/s (3 s) and 1 ns/B (3 s) on the reading
    # thread, written at 2 ns/B (6 s) on the main thread: the write phase takes the longer, 6 s,
    # not the sum (12 s); on one core both threads' CPU (9 s) binds
    costs = {**FREE, "bucket_read": 1e-9, "write": 2e-9}
    work = NodeWork(source_bytes=0, slice_bytes=3 * GB, out_of_core=True)
    fast_disk = rates(disk_mbps=1e6)
    assert seconds_of(epoch(work, fast_disk, costs), "write") == pytest.approx(6.0, rel=1e-3)
    slow = epoch(work, rates(), costs)
    assert seconds_of(slow, "write") == pytest.approx(6.0, rel=1e-3)  # max(3 + 3, 6)
    one = epoch(work, Rates(1000.0, 1000.0, 1e6, cores=1, start_s=0.0), costs)
    assert seconds_of(one, "write") == pytest.approx(9.0, rel=1e-3) and one.binding == CPU


def test_written_through_the_slice_reaches_the_disk_during_the_rounds():
    # a later epoch: 3 GB of kept sources read from the local disk, a 3 GB slice written, the disk
    # at 1,000 MB/s each way (duplex)
    work = NodeWork(source_bytes=3 * GB, from_shared=False, slice_bytes=3 * GB)
    duplex = rates(disk_duplex=True)
    after = epoch(work, duplex, FREE)  # the rank files written after the rounds: 3 s + 3 s
    assert seconds_of(after, "rounds") == pytest.approx(3.0) and seconds_of(after, "write") == pytest.approx(3.0)
    work.write_through = True
    through = epoch(work, duplex, FREE)  # read and written at once: 3 s, the write phase none
    assert seconds_of(through, "rounds") == pytest.approx(3.0) and through.seconds == pytest.approx(3.0)
    assert through.binding in (DISK_READS, DISK_WRITES)
    # one disk for both directions: the 6 GB take 6 s whichever way
    assert epoch(work, rates(), FREE).seconds == pytest.approx(6.0) == epoch(work, rates(), FREE).phases[0].seconds
    # the rows' pwrite is its writing thread's CPU: 4 ns/B of 3 GB is 12 s on one process
    slow = epoch(work, duplex, {**FREE, "write_through": 4e-9})
    assert seconds_of(slow, "rounds") == pytest.approx(12.0, rel=1e-3) and slow.binding == CPU
    # out of core the rows are written after the rounds, through or not
    work.out_of_core = True
    assert seconds_of(epoch(work, duplex, FREE), "write") == pytest.approx(3.0)


def test_the_owned_shards_entries_follow_the_slice_from_their_rows_facts():
    # 3 GB of slice written at 1 ns/B, then the facts of 2 GB of owned shards at 1 ns/B: 3 s then
    # 2 s, in memory and out of core alike (the owner's rows are not in its store); its CPU only
    costs = {**FREE, "write": 1e-9, "facts": 1e-9}
    work = NodeWork(source_bytes=0, slice_bytes=3 * GB, owned_bytes=2 * GB, write_through=True)
    fast = rates(disk_mbps=1e9)
    mem = epoch(work, fast, costs)
    assert [p.name for p in mem.phases] == ["rounds", "write", "facts"]
    assert seconds_of(mem, "write") == pytest.approx(3.0, rel=1e-3) and mem.binding == CPU
    assert seconds_of(mem, "facts") == pytest.approx(2.0, rel=1e-3)
    one = epoch(work, Rates(1e9, 1e9, 1e9, cores=1, start_s=0.0), costs)
    assert seconds_of(one, "write") + seconds_of(one, "facts") == pytest.approx(5.0, rel=1e-3)
    work.out_of_core = True
    ooc = epoch(work, fast, costs)
    assert seconds_of(ooc, "write") + seconds_of(ooc, "facts") == pytest.approx(5.0, rel=1e-3)


def test_a_replacement_node_reads_its_ranges_at_a_latency_and_queue_depth():
    r = rates(shared_mbps=1e9, nic_mbps=1e9, disk_mbps=1e9)
    one = replacement(GB, 1_000_000, r, FREE, latency_s=100e-6, queue_depth=1)
    assert one.seconds == pytest.approx(100.0, rel=1e-6) and one.binding == REPLACEMENT_READS
    eight = replacement(GB, 1_000_000, r, FREE, latency_s=100e-6, queue_depth=8)
    assert eight.seconds == pytest.approx(12.5, rel=1e-6)
    # few ranges: the bandwidth (min(shared, NIC) for a node alone) binds
    wide = replacement(10 * GB, 10, rates(shared_mbps=40_000.0, nic_mbps=1000.0), FREE)
    assert wide.binding == SHARED and wide.seconds == pytest.approx(10.0, rel=1e-3)
    # `stage --workers 4`: four processes, each with its reads in flight and a core of its own
    four = replacement(
        GB,
        1_000_000,
        rates(shared_mbps=1e9, nic_mbps=1e9, disk_mbps=1e9, procs=4),
        FREE,
        latency_s=100e-6,
        queue_depth=8,
    )
    assert four.seconds == pytest.approx(12.5 / 4, rel=1e-6)
    cpu = replacement(
        GB, 1, rates(shared_mbps=1e9, nic_mbps=1e9, disk_mbps=1e9, procs=4), {"read": 1e-9, "write": 1e-9}
    )
    assert cpu.binding == CPU and cpu.seconds == pytest.approx(2 * GB * 1e-9 / 4, rel=1e-3)


def test_uniform_work_is_the_exchanges_arithmetic():
    # 48 nodes: a node reads 1/48, keeps 1/48 and owns 1/48; a row goes once, to its node:
    # (N-1)/N of what a node reads leaves it (its owner gets only its facts)
    w = uniform_work(48 * GB, 48, 8194)
    assert w.source_bytes == GB and w.slice_bytes == GB and w.owned_bytes == GB
    assert w.sent == pytest.approx(GB * (47 / 48) * (1 + 16 / 8194), rel=1e-6)
    assert w.routed == w.placed == GB
    assert ranges_at_density(4800, 48) == 4700


def test_phases_nest_and_count_bytes():
    ph = Phases()
    with ph.phase("route"):
        with ph.phase("place", 10):
            sum(range(200_000))
        ph.count("route", 7)
    s = ph.summary(process_cpu=1e9)
    assert set(PHASES) <= set(s) and s["place"]["bytes"] == 10 and s["route"]["bytes"] == 7
    assert s["place"]["cpu_s"] > 0 and s["other"]["cpu_s"] > 0


def test_plan_to_nodes_names_the_binding_resource(tmp_path):
    src = write_source(tmp_path / "src", random_docs(np.random.default_rng(3), 200, 1000, 0), docs_per_shard=40)
    args = ["plan", "shuffle", str(src), "-o", str(tmp_path / "run"), "--seq-len", "64", "--seed", "1"]
    args += ["--epochs", "1", "--to-nodes", str(tmp_path / "node{node}"), "--ranks-per-node", "2"]
    args += ["--micro-batch", "2", "--nodes", "4", "--disk-mbps", "1000", "--json"]
    # a slow shared filesystem binds; then a slow disk
    slow_shared = json.loads(CliRunner().invoke(main, [*args, "--shared-mbps", "0.001"]).stdout)
    assert slow_shared["to_nodes"]["binding"] == SHARED
    node = slow_shared["per_node"][slow_shared["slowest_node"]]
    assert node["binding"] == SHARED and node["model"]["epochs"][0]["phases"][0]["phase"] == "rounds"
    slow_disk = json.loads(
        CliRunner().invoke(main, [*args[:-3], "--disk-mbps", "0.001", "--shared-mbps", "1e6", "--json"]).stdout
    )
    assert slow_disk["to_nodes"]["binding"] == DISK
