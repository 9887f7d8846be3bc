"""The text `tokpack plan` prints (`report_lines`): a PlanResult as lines for humans, with a
table of the nodes for plan shuffle --to-nodes.
"""

from __future__ import annotations


from tokpack.formats.units import counted
from tokpack.packer.plan_result import PlanResult, size_text


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"


def report_lines(r: PlanResult) -> list[str]:
    """The human summary of a plan; nothing has been written."""
    from tokpack.shuffle.packings import shown_line

    if r.per_node is not None:
        return _nodes_lines(r)

    shards = counted(r.shards, "shard")
    if r.command == "pack":
        shards = f"at least {shards}" if r.shards else "shards unknown (the inputs do not tell their token count)"
    written = (
        "nothing written"
        if not r.disk.startswith("measured")
        # the probe's file: gone, but written
        else "no output written (the disk probe wrote and read back a temporary file; --disk-mbps skips it)"
    )
    lines = [f"plan {r.command} -> {r.output}: {r.path}, {shards}; {written}"]
    if r.samples_per_epoch is not None:
        lines.append(f"  samples per epoch: {r.samples_per_epoch:,}")
    tokens = {s["name"]: s["tokens"] for s in r.sources or []}
    for e in r.epochs or []:
        extra = (
            ""
            if e["path"] != "out-of-core"
            else (
                f", {e['scatter_tasks']} scatter tasks, {e['buckets']:,} buckets (at most {e['bucket_files']:,} bucket "
                f"files), {size_text(e['scratch_bytes'])} scratch"
            )
        )
        if "table_bytes" in e:
            extra += f", row table of ~{e['table_pieces']:,} pieces ({size_text(e['table_bytes'])} scratch)"
        stage = "" if e["stage"] is None else f" (stage {e['stage']})"
        lines.append(
            f"  epoch {e['epoch']}{stage}: {e['path']}, {e['samples']:,} samples, {e.get('shards', 0):,} shards" + extra
        )
        unit = e["packing"]["unit"] if "packing" in e else "windows"  # a best-fit pass's rows, or windows
        if "packing" in e:
            lines.append(f"    packing: {shown_line(e['packing'])}")
        lines += [
            f"    source {s['name']}: {s['samples']:,} samples of {s['windows']:,} {unit}"
            + " a pass" * (unit != "windows")
            + (f" ({tokens[s['name']]:,} tokens)" if s["name"] in tokens else "")
            + f", {counted(s['passes'], 'pass', plural='passes')} from pass {s['first_pass']}, {s['repeats']:,} "
            + ("repeated" if s.get("repeat_unit", "samples") == "samples" else f"{s['repeat_unit']} repeated")
            for s in e["sources"]
        ]
    if r.holdout is not None:
        h = r.holdout
        lines.append(
            f"  holdout: {h['samples']:,} samples of held-out documents, {counted(h['shards'], 'shard')}, written "
            f"once to {h['path']} (" + ", ".join(f"{s['name']} {s['samples']:,}" for s in h["sources"]) + ")"
        )
    for p in r.passes:
        memory = "no set memory bound" if p["memory_per_task"] is None else f"{size_text(p['memory_per_task'])} memory"
        lines.append(
            f"  pass {p['name']}{'' if 'epoch' not in p else ' (epoch %d)' % p['epoch']}: "
            f"{counted(p['tasks'], 'task')}, {memory} per task, reads {size_text(p['read_bytes'])}, writes "
            f"{size_text(p['written_bytes'])}, {_duration(p['seconds'])}"
            + (f" (decoding Parquet: {_duration(p['decode_seconds'])})" if p.get("decode_seconds") else "")
            + (f" (packing: {_duration(p['pack_seconds'])})" if p.get("pack_seconds") else "")
        )
    for s in r.space:
        lines.append(
            f"  space on {s['filesystem']}: needs {size_text(s['needed_bytes'])} (scratch included), "
            f"{size_text(s['free_bytes'])} free: {'enough' if s['enough'] else 'NOT ENOUGH'}"
        )
    if r.bytes_per_node is not None:
        lines.append(
            f"  node slice: keeps {size_text(r.bytes_per_node)} on the node, reads "
            f"{size_text(r.passes[0]['read_bytes'])} (read amplification {r.read_amplification}x)"
        )
    if r.note:
        lines.append(f"  note: {r.note}")
    if r.copy_bytes is not None:
        lines.append(
            f"  shard files: copies {size_text(r.copy_bytes)}, links {size_text(r.link_bytes)} (hard links)"
            + (
                f", reflinks {size_text(r.reflink_bytes)} where its filesystem allows, else copies it"
                if r.reflink_bytes
                else ""
            )
        )
        lines += [f"    {note}" for note in r.link_notes or []]
    lines += [f"  manifest {name}: {n:,} bytes" for name, n in r.manifests.items() if n]
    lines.append(
        f"  predicted wall time: {_duration(r.predicted_seconds)} ({r.executor}, {counted(r.workers, 'worker')}, disk "
        f"{r.disk_mbps if r.disk_mbps is not None else '?'} MB/s {r.disk}; {r.startup_seconds:.1f} s of it "
        "start-up)"
    )
    return lines


# the node table's columns of bytes: heading -> field of a per_node entry
_NODE_SIZES = {
    "shared read": "shared_source_bytes",
    "local read": "local_source_bytes",
    "sent": "sent_bytes",
    "received": "received_bytes",
    "slice": "slice_bytes",
    "kept sources": "kept_source_bytes",
    "scratch": "scratch_bytes",
    "needs": "local_needed_bytes",
}


def _nodes_lines(r: PlanResult) -> list[str]:
    """plan shuffle --to-nodes: a line per epoch, a table of the nodes, RUN's files, the time."""
    t = r.to_nodes
    written = (
        "nothing written"
        if not (r.disk.startswith("measured") or (r.shared or "").startswith("measured"))
        else "no output written (the disk probe wrote and read back a temporary file; --disk-mbps and "
        "--shared-mbps skip it)"
    )
    lines = [
        f"plan shuffle -> {r.output} --to-nodes {t['dest']}: {counted(r.nodes, 'node')} of {t['ranks_per_node']} ranks "
        f"(W = {t['world_size']}), micro-batch {t['micro_batch']}; {written}"
    ]
    for e in r.epochs:
        if e["path"] != "to-nodes":
            lines.append(f"  epoch {e['epoch']}: {e['path']}, {e['samples']:,} samples")
            continue
        rounds = (
            "rounds unknown (a node's rows do not fit --memory)"
            if e["rounds"] is None
            else (
                counted(e["rounds"], "exchange round")
                + ("" if e["rounds_exact"] else " at least" if e["rounds_bound"] == "at least" else " (estimated)")
            )
        )
        lines.append(
            f"  epoch {e['epoch']}: {e['packing']}, {e['samples']:,} samples, {e['shards']:,} epoch shards, {rounds}"
        )
    head = ("node", *_NODE_SIZES, "free", "time")
    table = [head]
    for p in r.per_node:
        space = p["space"]
        free = (
            "not visible"
            if space == "not visible"
            else ", ".join(f"{size_text(s['free_bytes'])}{'' if s['enough'] else ' NOT ENOUGH'}" for s in space)
        )
        sizes = [size_text(p[k]) for k in _NODE_SIZES.values()]
        table.append((str(p["node"]), *sizes, free, _duration(p["predicted_seconds"])))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    if any(not d["exchanged_exact"] for p in r.per_node for d in p["epochs"]):
        lines.append(
            "  (sent and received are estimates: of a best-fit epoch, whose row table that places each "
            "piece only the command builds; of a large epoch, from a sample of its windows)"
        )
    if any(p["out_of_core_bytes"] for p in r.per_node):
        lines.append(
            "  (scratch includes the bucket files of an out-of-core order: every row of the node's slice, "
            "with its record)"
        )
    f = r.run_files
    lines.append(
        f"  RUN (shared filesystem) gets {size_text(f['bytes'])}: manifests {f['manifests_bytes']:,} bytes, "
        f"row hashes {size_text(f['rows_bytes'])}"
        + (f", padding {size_text(f['pad_bytes'])}" if f["pad_bytes"] else "")
        + f", {f['nodes_sidecar_bytes']:,} bytes of sidecar; no token file"
    )
    slow = (
        ""
        if r.slowest_node is None
        else f"the slowest node's, node {r.slowest_node}, bound by {r.to_nodes['binding']}; "
    )
    lines.append(
        f"  predicted wall time: {_duration(r.predicted_seconds)} ({slow}shared filesystem "
        f"{r.shared_mbps if r.shared_mbps is not None else '?'} MB/s {r.shared}, for all nodes; "
        f"network {r.nic_mbps:g} MB/s a node; disk {r.disk_mbps if r.disk_mbps is not None else '?'} MB/s "
        f"{r.disk}; {r.startup_seconds:.1f} s of it start-up)"
    )
    return lines
