"""Every process of a `shuffle --to-nodes` job runs the same shuffle (issue 42, item 1): before
anything is written, one collective comparison of what each process was started with (each
setting of its ShuffleSpec, tokpack's version); once the sources are opened, a second of their
fingerprints (a node's kept copy, or its view of the shared folder). A launcher that gives one
node another `--seed`, `--epochs` or `--pad-id` (a wrapper script, an environment that differs
per node) would otherwise hang the job, or write that node's rows otherwise than RUN records.
A mismatch is the same one line on every process, naming the node(s) and the setting: a usage
error (exit 2), since no data is at fault. What a peer sends is checked before it is compared:
it is input like any other."""

from __future__ import annotations

import dataclasses
from collections import Counter

from tokpack import __version__
from tokpack.formats.errors import TokpackError
from tokpack.packer.transport import process_name, together
from tokpack.shuffle.spec import ShuffleSpec

# A setting as the user names it (the CLI's option; the Python API's keyword is the field's name).
OPTION = {
    "sources": "SOURCES",
    "weights": "the sources' weights",
    "output": "-o RUN",
    "seq_len": "--seq-len",
    "seed": "--seed",
    "epochs": "--epochs",
    "samples": "--samples",
    "tokens": "--tokens",
    "shard_samples": "--shard-samples",
    "memory": "--memory",
    "jitter": "--jitter",
    "packing": "--packing",
    "pad_id": "--pad-id",
    "holdout": "--holdout",
    "schedule": "--schedule",
    "like": "--like",
    "nodes.dest": "--to-nodes",
    "nodes.ranks_per_node": "--ranks-per-node",
    "nodes.micro_batch": "--micro-batch",
    "nodes.keep_sources": "--keep-sources",
    "nodes.procs_per_node": "--procs-per-node",
    "nodes.stall_timeout": "--stall-timeout",
    "version": "tokpack's version",
}
MAX_FACT_CHARS = 1 << 16  # a setting's text: a spec's longest is a list of source paths


def spec_facts(spec: ShuffleSpec, version: str) -> dict[str, str]:
    """What this process was started with, as text a peer can compare: each setting and the
    version (the sources' content is compared once they are opened: agree_sources)."""
    facts = {"version": version}
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if f.name == "given":
            continue
        if f.name == "nodes" and value is not None:
            facts.update({f"nodes.{g.name}": repr(getattr(value, g.name)) for g in dataclasses.fields(value)})
        elif f.name == "schedule" and value is not None:
            facts["schedule"] = f"{value.file} ({value.file_hash})"
        else:
            facts[f.name] = repr(value)
    return facts


def agree(comm, spec: ShuffleSpec) -> None:
    """Raises on every process, with the same line, unless every process of `comm` runs the same
    spec_facts. One allgather: a few KiB a process."""
    mine = together(comm, lambda: spec_facts(spec, __version__))
    gathered = comm.allgather(mine)
    # Processes a node, to name each process by its node: --procs-per-node when every process was
    # given the same (else each is named by its world rank, as a node of one).
    values = {facts.get("nodes.procs_per_node") if isinstance(facts, dict) else None for facts in gathered}
    given = values.pop() if len(values) == 1 else None
    per_node = int(given) if isinstance(given, str) and given.isdigit() and int(given) > 0 else 1
    line = disagreement(gathered, per_node=per_node)
    if line is not None:
        raise line


def agree_sources(comm, opened, per_node: int = 1) -> None:
    """The sources each process opened (the shared folders, or a node's kept copies of them)
    hold the same data: their fingerprints (each source manifest's xxh3_128) agree. Read from
    what the run opened, so that a later epoch from kept sources opens no shared file for it."""
    # keyed by place, not path: a node reading its kept copy and one reading the shared folder
    # (a rerun after one node's copy was refused) open the same source under two names
    facts = {f"source {i}": str(src.fingerprint) for i, src in enumerate(opened)}
    line = disagreement(comm.allgather(facts), SOURCES_DIFFER, per_node)
    if line is not None:
        raise line


STARTED_DIFFERENTLY = (
    "the job's processes were started with different {what}",
    "start every process with the same command line and environment (a wrapper script or a per-node "
    "variable differs), then rerun",
)
SOURCES_DIFFER = (
    "the job's processes read different data as {what} (its manifest's fingerprint)",
    "every node must see the same packed source: one node's view of the shared filesystem is stale, or "
    "it was re-packed during the job; rerun once every node sees the same",
)


def disagreement(
    gathered: list, words: tuple[str, str] = STARTED_DIFFERENTLY, per_node: int = 1
) -> TokpackError | None:
    """The error for the first fact the processes (node k's facts at index k) disagree on: the
    nodes that differ from the most common value (node 0's on a tie) are named, with both values."""
    for k, facts in enumerate(gathered):
        if not _well_formed(facts):
            return MismatchError(
                f"{process_name(k, per_node)} sent a malformed description of its shuffle",
                where="the job's processes",
                expected="a dict of settings as text",
                found=type(facts).__name__,
                hint="start every process from the same tokpack installation",
            )
    for name in sorted(set().union(*(facts.keys() for facts in gathered)), key=_order):
        values = [facts.get(name, "(none)") for facts in gathered]
        if len(set(values)) == 1:
            continue
        usual = Counter(values).most_common(1)[0][0]  # of a tie, the first seen: node 0's if it is one
        odd = [k for k, v in enumerate(values) if v != usual]
        what = OPTION.get(name, name)
        return MismatchError(
            words[0].format(what=what),
            where=what,
            expected=f"{usual} (as on {process_name(values.index(usual), per_node)})",
            found="; ".join(f"{values[k]} on {process_name(k, per_node)}" for k in odd[:4])
            + (" and more" if len(odd) > 4 else ""),
            hint=words[1],
        )
    return None


def _well_formed(facts) -> bool:
    return (
        isinstance(facts, dict)
        and len(facts) <= 4 * len(OPTION) + 4096
        and all(isinstance(k, str) and isinstance(v, str) and len(v) <= MAX_FACT_CHARS for k, v in facts.items())
    )


def _order(name: str) -> tuple[int, str]:
    """The settings first, in OPTION's order, then the sources' manifests."""
    keys = list(OPTION)
    return (keys.index(name), "") if name in keys else (len(keys), name)


class MismatchError(TokpackError):
    """The processes of one job disagree: a usage error (exit 2), not bad data."""

    exit_status = 2
