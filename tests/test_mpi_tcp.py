"""The node engine over Open MPI's TCP transport on loopback (issue 41 item 7), not only shared
memory: a cluster's nodes talk over the network, where messages arrive in other fragments and
at other times than through shared memory. The bytes must not depend on the transport."""

from __future__ import annotations

import pytest

from test_mpi import (
    MEMORY,
    SEQ,
    assert_no_token_bytes,
    assert_same_slices,
    source,  # noqa: F401 (the module's fixture)
    staged,
    summaries,
    to_nodes,
)

# ob1 with the TCP byte transfer layer only (and self, a process's messages to itself), on the
# loopback interface: Open MPI reads OMPI_MCA_* from the environment of the launcher.
TCP = {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "tcp,self", "OMPI_MCA_btl_tcp_if_include": "lo"}


@pytest.mark.parametrize("packing", ["concat", "best-fit"])
def test_over_tcp_equals_shuffle_then_stage_node(source, tmp_path, packing):
    args = [source, "--seq-len", SEQ, "--seed", 4, "--epochs", 2, "--shard-samples", 12, "--packing", packing]
    run, dests = staged(tmp_path, args)
    exchanged = tmp_path / "exchanged"
    done = to_nodes(exchanged, str(tmp_path / "node{node}"), *args, "--memory", MEMORY, env=TCP)
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(d["rounds"] > 1 for s in summaries(done).values() for d in s["epochs_detail"])
    assert_same_slices(run, dests, exchanged, tmp_path / "node")
    assert_no_token_bytes(exchanged, run)


def test_the_transport_setting_reaches_the_processes(source, tmp_path):
    """Without a transport between processes (self only) the same job cannot run: the variables
    above do choose what carries the bytes, so the test above ran over TCP."""
    args = [source, "--seq-len", SEQ, "--seed", 4, "--epochs", 1, "--shard-samples", 12]
    done = to_nodes(tmp_path / "run", str(tmp_path / "n{node}"), *args, env={**TCP, "OMPI_MCA_btl": "self"}, timeout=60)
    assert done.returncode != 0
