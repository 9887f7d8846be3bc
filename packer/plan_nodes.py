"""`tokpack plan shuffle --to-nodes`: what `mpirun -n NODES tokpack shuffle ... --to-nodes DEST`
would do, per node (`plan_to_nodes`), from the exchange's own arithmetic (tokpack.packer.exchange,
node_epoch): each node's shared-filesystem, network and local-disk bytes, its space, and their time.
"""

from __future__ import annotations

import math
from collections import Counter
import os
from pathlib import Path

import numpy as np

from tokpack.formats.errors import TokpackError
from tokpack.formats.constants import MANIFEST
from tokpack.formats.reading import canonical_bytes
from tokpack.formats.names import epoch_dir_name
from tokpack.packer.node_model import MEASURED, MEASURED_BY, NodeWork, Rates, epoch as epoch_time
from tokpack.packer.plan_result import COMMAND_START_SECONDS, PlanResult, local_only, measure_disk, size_text
from tokpack.packer.plan_result import space_report


NIC_MBPS = 25_000.0  # --nic-mbps default: a node's InfiniBand/RoCE link (issue 33, "25-50 GB/s a node")
# Windows taken through the epoch's permutation to count each node's sends exactly (about 4 s
# on one core); beyond, every k-th block of SAMPLE_BLOCK windows, and the counts scaled.
EXACT_WINDOWS = 1 << 25
SAMPLE_BLOCK = 1 << 18


def _visible(path: Path) -> Path | None:
    """`path`, or its nearest existing parent below the root, when this machine sees one: a
    node-local DEST seen from a login node is usually not there (its root, "/", is this
    machine's and says nothing of the node's disk)."""
    p = Path(path).absolute()
    for q in (p, *p.parents):
        if q.exists():
            return q if q != Path(q.anchor) else None
    return None


def _rate(given: float | None, option: str, where: Path | None, measured: dict) -> tuple[float | None, str]:
    """(MB/s, how it was found): given, or measured in `where` (once a filesystem), or unknown."""
    if given is not None:
        if given <= 0:
            raise TokpackError("throughput must be positive", where=option, expected="> 0", found=given)
        return float(given), "given"
    if where is None:
        return None, f"not measured (not visible from here); give {option}"
    dev = os.stat(where).st_dev
    if dev not in measured:
        measured[dev] = measure_disk(where)
    mbps, how = measured[dev]
    return mbps, how if mbps is not None else how.replace("--disk-mbps", option)


def _node_epoch_figures(
    job, manifest: dict, figures, first: int, nodes: int, ranks_per_node: int, rows, memory: int
) -> list[dict]:
    """Each node's part of one epoch, from the exchange's own arithmetic (tokpack.packer.exchange):
    its NodeEpoch (the slice's positions, the owned shards, keep_bytes), its runs of source
    shards (split_shards), memory_plan, and the destination exchange_epoch sends each piece to
    (the node that reads its row; its shard's owner gets only the row's facts)."""
    from tokpack.formats.constants import U64
    from tokpack.packer.node_epoch import NodeEpoch, memory_plan
    from tokpack.packer.pieces import WIRE_PIECE
    from tokpack.packer.slicing import slice_files
    from tokpack.packer.stage_plan import slice_ranks
    from tokpack.shuffle import packings
    from tokpack.shuffle.steps import shard_segments

    plan, entry = job.plan, packings.of_plan(job.plan)
    padded = entry.padded  # document pieces from a row table, and padding
    sources = job.open_sources()
    item, row = job.token_dtype.itemsize, plan.row_tokens
    table = entry.table_estimate(job, sources) if entry.table_estimate is not None else None
    data_tokens = plan.samples * row - (figures.padding_tokens if figures is not None else 0)
    per_row = int(manifest["fragments"]) / max(1, plan.samples)  # the index's fragments, at the epoch's mean
    out, nes = [], []
    for n in range(nodes):
        a, b, _ = slice_ranks(node=f"{n}/{nodes}", ranks_per_node=ranks_per_node, micro_batch=rows.micro_batch)
        # the row table itself is the command's to build (plan_shuffle counts it by table_estimate)
        ne = NodeEpoch(job, sources, rows, first, n, nodes, (a, b), {})
        nes.append(ne)
        shards = [(s, k) for s, k0, k1 in ne.runs() for k in range(k0, k1)]
        read = sum(int(sources[s].shards[k]["tokens"]) * sources[s].dtype.itemsize for s, k in shards)
        kept_shards = [(s, k) for s, ks in ne.kept_shards().items() for k in ks]
        rank_rows = [rows.rows(r, first, first + plan.samples) for r in range(a, b + 1)]  # as plan_slice counts
        if sum(rank_rows) != len(ne.positions):  # what the exchange keeps is what stage --node would
            raise TokpackError(
                "internal error: a node's rows differ from its ranks' counts",
                where=f"node {n}",
                hint="report this with the command line",
            )
        tokens = len(ne.positions) * job.row_bytes
        index = sum(U64.itemsize * max(k, math.ceil(k * per_row)) for k in rank_rows)  # as slice_files counts it
        owned_sizes = [job.shard_range(i)[1] - job.shard_range(i)[0] for i in ne.owned]
        try:
            per_round, bucket_rows = memory_plan(ne, memory)
        except TokpackError:
            per_round = bucket_rows = None  # not even out of core: the command refuses it
        out.append(
            {
                "node": n,
                "ranks": [a, b],
                "source_shards": len(shards),
                "source_bytes": read,
                # (fingerprint, shard file, bytes): where exchange.keep_sources keeps it, under DIR
                "kept_shards": sorted(
                    (
                        sources[s].fingerprint,
                        sources[s].shards[k].get("path", str(k)),  # virtual: none
                        int(sources[s].shards[k]["tokens"]) * sources[s].dtype.itemsize,
                    )
                    for s, k in kept_shards
                ),
                "epoch_source_shards": sum(len(sources[s].shards) for s, sp in enumerate(plan.sources) if sp.samples),
                "rows": len(ne.positions),
                "rank_rows": rank_rows,
                "slice_token_bytes": tokens,
                "slice_rows_bytes": U64.itemsize * len(ne.positions),
                "slice_pad_bytes": 4 * len(ne.positions) if padded else 0,
                "slice_index_bytes": index,
                # what stage --node's space check counts for these rank files
                "slice_on_disk": sum(slice_files(k, job.row_bytes, per_row, padded) for k in rank_rows),
                "owned_shards": len(ne.owned),
                "owned_rows": ne.owned_rows,
                # each owned shard's row hashes (and padding) in scratch, copied to RUN; its index only
                # hashed, from its rows' facts (owned_facts.OwnedShards): its tokens never come here
                "owned_bytes": ne.owned_rows * (U64.itemsize + 4 * padded),
                "owned_token_bytes": ne.owned_rows * job.row_bytes,  # their facts come, not them (the model's facts)
                "owned_peak": max([k * (U64.itemsize + 4 * padded) for k in owned_sizes], default=0),
                "run_rows_bytes": U64.itemsize * ne.owned_rows,
                "run_pad_bytes": 4 * ne.owned_rows if padded else 0,
                "keep_bytes": ne.keep_bytes,
                "per_round_tokens": per_round,
                # out of core: every slice row goes through DEST's bucket
                # files once, its tokens and a piece record (a window: one; best-fit: about one a document piece)
                "bucket_bytes": 0 if bucket_rows is None else ne.store_rows * (job.row_bytes + WIRE_PIECE.itemsize),
                "table_bytes": table["table_bytes"] if table else 0,
            }
        )
        # What follows needs each node's destinations, not its positions (8 bytes a row of the
        # epoch over all nodes: 21 GB for 11T tokens of 4096-token rows)
        ne.positions = np.zeros(0, dtype=np.int64)  # not a view: that would keep the whole array
    # What each node m reads (pieces, tokens: a row of an upsampled source once per use) and
    # sends to each node d (pieces[m, d], tokens[m, d]).
    pieces = np.zeros((nodes, nodes), dtype=np.int64)
    moved = np.zeros((nodes, nodes), dtype=np.int64)
    reads = np.zeros((nodes, 2), dtype=np.int64)
    block_rounds = [0] * nodes  # windows: each node's rounds
    exact = not padded
    if not padded:
        segments = [shard_segments(plan, sources, ne.runs()) for ne in nes]
        windows = sum(w1 - w0 for segs in segments for _, w0, w1, _, _ in segs)
        # Every window through the epoch's permutation, up to EXACT_WINDOWS of them (a few
        # seconds); a larger epoch's through every k-th block of them, scaled: an estimate
        every = max(1, -(-windows // EXACT_WINDOWS))
        exact = every == 1
        for m, ne in enumerate(nes):
            seen = taken = 0
            # In memory a round takes whole pieces of as many read blocks as it holds (mappings
            # of the sources, which stay valid: node_epoch.source_pieces), up to per_round tokens
            # and one piece more (transport.exchange_rounds): ceil(per_round / row) windows a
            # round. Out of core the source is read a block of `per` rows at a time from each
            # segment's start into a reused buffer, and a round sends pieces of one block, `per`
            # at most.
            mapped = out[m]["bucket_bytes"] == 0
            per = max(1, (out[m]["per_round_tokens"] or row) // row)
            for s, w0, w1, _, _ in segments[m]:
                uses = np.zeros(-(-(w1 - w0) // per), dtype=np.int64)  # pieces of each block
                for c in range(w0, w1, SAMPLE_BLOCK):
                    seen += min(w1, c + SAMPLE_BLOCK) - c
                    if (c - w0) // SAMPLE_BLOCK % every:
                        continue
                    taken += min(w1, c + SAMPLE_BLOCK) - c
                    for _, used, g in plan.outputs_of(s, np.arange(c, min(w1, c + SAMPLE_BLOCK), dtype=np.int64)):
                        # each piece once, to the node that reads its row (exchange_epoch's
                        # destination; its shard's owner gets the row's facts only)
                        pieces[m] += np.bincount(ne.node_of(g), minlength=nodes)
                        reads[m] += (len(g), len(g) * row)
                        uses += np.bincount((c - w0 + used) // per, minlength=len(uses))
                block_rounds[m] += int((-(-uses // per)).sum())
            if taken and taken < seen:
                # sampled: each block as many pieces as the sample's windows had, on average
                rate = reads[m, 0] / taken
                block_rounds[m] = sum(
                    (w1 - w0) // per * math.ceil(rate) + math.ceil(rate * ((w1 - w0) % per) / per)
                    for _, w0, w1, _, _ in segments[m]
                )
                pieces[m] = np.round(pieces[m] * (seen / taken)).astype(np.int64)
                reads[m] = np.round(reads[m] * (seen / taken)).astype(np.int64)
            if mapped:
                block_rounds[m] = -(-int(reads[m, 0]) // -(-(out[m]["per_round_tokens"] or row) // row))
        moved = pieces * row
    else:  # which node reads which piece is in the row table, which only the command builds: the
        # table's pieces and data tokens spread over the nodes by their source bytes, and over
        # the destinations as exchange_epoch sends the epoch's rows
        total = sum(f["source_bytes"] for f in out) or 1
        dests, every, taken = np.zeros(nodes, dtype=np.int64), max(1, -(-plan.samples // EXACT_WINDOWS)), 0
        for c in range(0, plan.samples, SAMPLE_BLOCK * every):  # a large epoch's: every k-th block
            g = np.arange(c, min(plan.samples, c + SAMPLE_BLOCK), dtype=np.int64)
            # a row's destinations do not depend on who sends it
            dests += np.bincount(nes[0].node_of(g), minlength=nodes)
            taken += len(g)
        share = dests / max(1, taken)  # per destination: copies it gets of a piece sent
        for m, f in enumerate(out):
            part = f["source_bytes"] / total
            reads[m] = (round(table["pieces"] * part), round(data_tokens * part))
            pieces[m] = np.round(share * reads[m, 0]).astype(np.int64)
            moved[m] = np.round(share * reads[m, 1]).astype(np.int64)
    wire = pieces * WIRE_PIECE.itemsize + moved * item
    for n, f in enumerate(out):
        f["sent_bytes"] = int(wire[n].sum() - wire[n, n])  # to the others
        f["received_bytes"] = int(wire[:, n].sum() - wire[n, n])
        f["to_itself_bytes"] = int(wire[n, n])  # Alltoallv's part to itself: no network
        f["exchanged_exact"] = exact
        # Rounds: every process takes part until the last has sent all; a round takes whole pieces
        # up to its per_round tokens, and one piece more while under it (exchange_epoch's cut),
        # windows, in memory ceil(per_round / row) pieces a round, out of core of one read
        # block (block_rounds); best-fit, of as many shards as it holds.
        p, t = f["per_round_tokens"], int(reads[n, 1])
        f["rounds"] = None if p is None else 0 if not t else block_rounds[n] if not padded else -(-t // p)
        f["rounds_exact"] = exact
    return out


def _planned_manifest(job, sources, memory: int):
    """(the epoch manifest as RUN will get it but for its checksums and fragment counts, the
    epoch's row figures or None): a best-fit epoch's with its packing's fields (its padding
    counted by packing its passes once more, as plan shuffle shows it) and each shard's
    pad_xxh3_128, which --to-nodes RUNs hold (tokpack.shuffle.run.epoch_manifest_of)."""
    from tokpack.shuffle import packings
    from tokpack.shuffle.run import planned_epoch_manifest
    from tokpack.shuffle.run_setup import epoch_manifest_of

    manifest, entry = planned_epoch_manifest(job, sources), packings.of_plan(job.plan)
    if entry.figures is None:
        return manifest, None
    fig = entry.figures(job.plan, sources, memory)
    shards = [{**s, "pad_xxh3_128": "0" * 32} for s in manifest["shards"]]
    return epoch_manifest_of(
        job, shards, {"table_xxh3_128": "0" * 32, "padding": fig.padding_tokens, "figures": fig.fields()}
    ), fig


def _work(f: dict, kept: bool, kept_now: int, slice_bytes: int, padded: bool) -> NodeWork:
    """One node's epoch (_node_epoch_figures' `f`) as the model's NodeWork: with --keep-sources
    it reads its own disk (what it copies now read from the shared filesystem first)."""
    return NodeWork(
        source_bytes=f["source_bytes"],
        from_shared=not kept,
        kept_copied=kept_now,
        sent=f["sent_bytes"],
        received=f["received_bytes"],
        routed=f["sent_bytes"] + f["to_itself_bytes"],
        placed=f["received_bytes"] + f["to_itself_bytes"],
        slice_bytes=f["slice_token_bytes"],
        small_bytes=slice_bytes - f["slice_token_bytes"] + f["owned_bytes"] + f["table_bytes"],
        owned_bytes=f["owned_token_bytes"],
        out_of_core=bool(f["bucket_bytes"]),
        read_ahead=not padded,  # windows are read on a thread of their own; best-fit documents are not
        # in memory, windows: the rank files written during the rounds, where a node has the cores
        # (node_store.write_through_pays; the model's nodes have them: Rates.cores None)
        write_through=not padded,
        memory_needed=f["keep_bytes"],
    )


def _predict(works: list, rates: Rates) -> dict:
    """A node's epochs one after the other: their seconds add; the binding resource holds most of them."""
    preds = [epoch_time(w, rates) for w in works]
    by: Counter = Counter()
    for p in preds:
        by.update(p.by_resource)
    return {
        "seconds": round(sum(p.seconds for p in preds), 3),
        "binding": max(by, key=by.get) if by else None,
        "by_resource": {k: round(v, 3) for k, v in by.items()},
        "epochs": [p.as_dict() for p in preds],
    }


def planned(manifest: dict) -> tuple[int, dict]:
    """What a plan keeps of an epoch's planned manifest: its size and its totals, not a dict per
    shard of every epoch planned (epochs x shards)."""
    from tokpack.shuffle.run_setup import epoch_totals

    return len(canonical_bytes(manifest)), epoch_totals(manifest)


def shuffle_figures(setup, written: dict, details: list[dict]) -> dict:
    """A planned shuffle's (or --to-nodes') fields over its epochs `details`: the manifests' sizes
    (each epoch's of `written`, by `planned`, then RUN's), shards, samples_per_epoch, epochs."""
    from tokpack.shuffle.packed.passes import release_passes

    manifests = {f"{epoch_dir_name(e)}/{MANIFEST}": size for e, (size, _) in written.items()}
    if written:
        totals = {e: t for e, (_, t) in written.items()}
        manifests[MANIFEST] = len(canonical_bytes(setup.run_manifest(totals, setup.todo[-1][1])))
    release_passes()  # the best-fit passes the plan packed and kept: a caller's process does not keep them
    return {
        "manifests": manifests,
        "shards": sum(d.get("shards", 0) for d in details),
        "samples_per_epoch": details[0]["samples"] if len({d["samples"] for d in details}) == 1 else None,
        "epochs": details,
    }


def plan_to_nodes(
    spec,
    *,
    nodes: int,
    shared_mbps: float | None = None,
    nic_mbps: float | None = None,
    disk_mbps: float | None = None,
) -> PlanResult:
    """What `mpirun -n NODES tokpack shuffle ... --to-nodes DEST` would do, per node (docs/COMMANDS.md,
    "Straight to the nodes"): from the exchange's own arithmetic (_node_epoch_figures), then the
    time of each node's shared-filesystem, network and local-disk bytes; the slowest node's is the run's."""
    from tokpack.formats.builders import nodes_sidecar
    from tokpack.formats.slices import RankRows
    from tokpack.shuffle import packings
    from tokpack.packer.slicing import SLICE_ENTRY_BYTES, SLICE_HEADER_BYTES
    from tokpack.packer.stage_plan import slice_ranks
    from tokpack.packer.stage_dest import dest_template, in_place, local_dirs, node_dest, on_disk, run_numbering
    from tokpack.shuffle.run import repeat_warnings
    from tokpack.shuffle.run_setup import setup_run

    dest, keep_sources, memory = spec.nodes.dest, spec.nodes.keep_sources, spec.memory
    ranks_per_node, micro_batch = spec.nodes.ranks_per_node, spec.nodes.micro_batch
    slice_ranks(node=f"0/{nodes}", ranks_per_node=ranks_per_node, micro_batch=micro_batch)  # before a list a node
    nic = float(nic_mbps or NIC_MBPS)
    *paths, output = local_only(list(spec.sources) + [str(spec.output)])
    local_dirs("--to-nodes/--keep-sources", dest, keep_sources)
    out = Path(output)
    setup = setup_run(spec.with_settings(sources=paths), str(output), workers=1)
    numbering = run_numbering(setup, out)
    opened = setup.sources
    rows = RankRows(nodes * ranks_per_node, micro_batch, 0)  # its checks (tokpack.formats.slices) before any arithmetic
    dests = [node_dest(dest, n) for n in range(nodes)]
    keeps = [None if keep_sources is None else node_dest(keep_sources, n) for n in range(nodes)]
    notes: list[str] = []
    # The kept sources already there: seen, or, where DIR is not visible, assumed for a later
    # epoch (RUN lists one already: the command that wrote it kept them).
    have: list[dict] = [{} for _ in range(nodes)]
    assumed = keep_sources is not None and any(_visible(k) is None for k in keeps) and bool(setup.done_epochs)
    zero = (
        "shared_source_bytes",
        "shared_manifest_bytes",
        "shared_written_bytes",
        "local_source_bytes",
        "kept_copied_bytes",
        "sent_bytes",
        "received_bytes",
        "slice_bytes",
        "slice_on_disk",
        "kept_source_bytes",
        "scratch_bytes",
        "scratch_written_bytes",
        "out_of_core_bytes",
        "local_written_bytes",
        "local_read_bytes",
    )
    totals = [{**dict.fromkeys(zero, 0), "epochs": []} for _ in range(nodes)]
    works: list[list] = [[] for _ in range(nodes)]  # per node, each epoch's NodeWork (tokpack.packer.node_model)
    details, written_manifests, run_rows = [], {}, {"rows_bytes": 0, "pad_bytes": 0}
    for epoch, plan, job in setup.todo:
        if job is None:
            details.append({"epoch": epoch, "path": "complete already", "samples": plan.samples})
            continue
        # the warnings shuffle --to-nodes gives (a plain shuffle's), counted before the epoch's table
        notes += repeat_warnings(epoch, plan.source_report(), setup.runplan.stage_name(epoch))
        manifest, padding = _planned_manifest(job, opened, memory)
        written_manifests[epoch] = planned(manifest)
        figures = _node_epoch_figures(
            job, manifest, padding, numbering.first(epoch), nodes, ranks_per_node, rows, memory
        )
        rounds = [f["rounds"] for f in figures]
        padded = any(f["slice_pad_bytes"] for f in figures)
        details.append(
            {
                "epoch": epoch,
                "path": "to-nodes",
                "samples": plan.samples,
                "shards": job.n_shards,
                "rounds": None if None in rounds else max(rounds),
                "rounds_exact": all(f["rounds_exact"] for f in figures),
                "packing": packings.of_plan(plan).name,
                # best-fit: which node reads a piece is in the row table only the command builds
                "rounds_bound": "at least" if padded else "estimated",
            }
        )
        idle = [f["node"] for f in figures if not f["source_shards"]]
        if idle:  # split_shards gives at most one process a shard
            notes.append(
                f"epoch {epoch}: {'node' if len(idle) == 1 else 'nodes'} {', '.join(map(str, idle))} read no source shard (the epoch uses "
                f"{figures[0]['epoch_source_shards']} source "
                f"shards, fewer than {nodes} nodes); they still receive their rows"
            )
        big = [f for f in figures if f["per_round_tokens"] is None]
        if big:
            names = (
                "every node"
                if len(big) == nodes
                else ("node " if len(big) == 1 else "nodes ") + ", ".join(str(f["node"]) for f in big)
            )
            notes.append(
                f"epoch {epoch}: the rows of {names} (up to {size_text(max(f['keep_bytes'] for f in big))} "
                f"with their facts for the owners) do not fit --memory {size_text(memory)}, even out of core: shuffle "
                "--to-nodes refuses such a node; give more --memory or more nodes"
            )
        run_rows["rows_bytes"] += sum(f["run_rows_bytes"] for f in figures)
        run_rows["pad_bytes"] += sum(f["run_pad_bytes"] for f in figures)
        for n, f in enumerate(figures):
            t = totals[n]
            kept_now = 0
            if keeps[n] is not None:
                for fingerprint, name, size in f["kept_shards"]:
                    there = keeps[n] / fingerprint / name
                    if (fingerprint, name) not in have[n] and not assumed and not in_place(there, size):
                        kept_now += size  # kept_sources._keep_file copies it: read from shared, written here
                    have[n][fingerprint, name] = size
                t["kept_source_bytes"] = sum(have[n].values())
            from_shared = 0 if keeps[n] is not None else f["source_bytes"]
            local = f["source_bytes"] if keeps[n] is not None else 0
            ooc = f["bucket_bytes"]
            slice_bytes = f["slice_token_bytes"] + f["slice_rows_bytes"] + f["slice_pad_bytes"] + f["slice_index_bytes"]
            scratch = f["owned_peak"] + f["table_bytes"] + ooc
            scratch_written = f["owned_bytes"] + f["table_bytes"] + ooc
            t["shared_source_bytes"] += from_shared + kept_now
            t["shared_written_bytes"] += f["run_rows_bytes"] + f["run_pad_bytes"]
            t["local_source_bytes"] += local
            t["kept_copied_bytes"] += kept_now
            t["sent_bytes"] += f["sent_bytes"]
            t["received_bytes"] += f["received_bytes"]
            t["slice_bytes"] += slice_bytes
            t["slice_on_disk"] += f["slice_on_disk"] + on_disk(
                SLICE_HEADER_BYTES + SLICE_ENTRY_BYTES * len(f["rank_rows"])
            )
            t["scratch_bytes"] = max(t["scratch_bytes"], scratch)
            t["scratch_written_bytes"] += scratch_written
            t["out_of_core_bytes"] = max(t["out_of_core_bytes"], ooc)
            t["local_written_bytes"] += kept_now + slice_bytes + scratch_written
            t["local_read_bytes"] += local + f["table_bytes"] + ooc
            works[n].append(_work(f, keeps[n] is not None, kept_now, slice_bytes, padded))
            t["epochs"].append(
                {
                    "epoch": epoch,
                    "source_shards": f["source_shards"],
                    "source_bytes": f["source_bytes"],
                    "from": "kept sources" if keeps[n] is not None else "shared filesystem",
                    "kept_copied_bytes": kept_now,
                    "rows": f["rows"],
                    "rank_rows": f["rank_rows"],
                    "slice_token_bytes": f["slice_token_bytes"],
                    "slice_rows_bytes": f["slice_rows_bytes"],
                    "slice_pad_bytes": f["slice_pad_bytes"],
                    "slice_index_bytes": f["slice_index_bytes"],
                    "owned_shards": f["owned_shards"],
                    "owned_rows": f["owned_rows"],
                    "run_rows_bytes": f["run_rows_bytes"],
                    "run_pad_bytes": f["run_pad_bytes"],
                    "sent_bytes": f["sent_bytes"],
                    "received_bytes": f["received_bytes"],
                    "to_itself_bytes": f["to_itself_bytes"],
                    "exchanged_exact": f["exchanged_exact"],
                    "keep_bytes": f["keep_bytes"],
                    "fits_memory": f["per_round_tokens"] is not None and not f["bucket_bytes"],
                    "out_of_core_bytes": ooc,
                    "rounds": f["rounds"],
                }
            )
    figures = shuffle_figures(setup, written_manifests, details)
    manifests = figures["manifests"]
    for t in totals:  # each process reads RUN's manifests back, the run's once an epoch (exchange.commit_slice_epoch)
        t["shared_manifest_bytes"] = sum(manifests.values()) + manifests.get(MANIFEST, 0) * max(
            0, len(written_manifests) - 1
        )
    # the sidecar names node 0's DEST, as process 0 writes it (exchange._declare_nodes)
    sidecar = len(canonical_bytes(nodes_sidecar(nodes, ranks_per_node, micro_batch, dest_template(dest))))
    run_files = {"manifests_bytes": sum(manifests.values()), "nodes_sidecar_bytes": sidecar, **run_rows}
    run_files["bytes"] = sum(run_files.values())
    if assumed:
        notes.append(
            "--keep-sources DIR is not visible from here and RUN lists epochs already: the sources are "
            "taken as kept by the command that wrote them"
        )
    procs = int(spec.nodes.procs_per_node or 1)  # processes a node (its CPU: that many cores)
    if procs > 1:  # the node's bytes are its processes' together; their memory plans are not modelled apart
        notes.append(
            f"--procs-per-node {procs}: each node's figures are its {procs} processes' together, planned "
            f"as one process with the node's --memory (each process plans with --memory / {procs})"
        )
    # Throughputs: given, or measured where this machine sees the filesystem (one probe each).
    measured: dict = {}
    seen = [_visible(d) for d in dests]
    disk, disk_how = _rate(disk_mbps, "--disk-mbps", next((p for p in seen if p is not None), None), measured)
    shared, shared_how = _rate(shared_mbps, "--shared-mbps", _visible(out), measured)
    readers = max(1, sum(1 for t in totals if t["shared_source_bytes"]))
    per_node = []
    for n, t in enumerate(totals):
        need = t["slice_on_disk"] + t["scratch_bytes"]
        kept = [(keeps[n], t["kept_source_bytes"])] if keeps[n] is not None and _visible(keeps[n]) is not None else []
        space = "not visible" if seen[n] is None else space_report([(dests[n], need), *kept])
        # The nodes read the shared filesystem at once: each gets its share of --shared-mbps.
        shared_s = (
            None
            if shared is None
            else (
                t["shared_source_bytes"] / (shared * 1e6 / readers)
                + (t["shared_manifest_bytes"] + t["shared_written_bytes"]) / (shared * 1e6 / nodes)
            )
        )
        network_s = max(t["sent_bytes"], t["received_bytes"]) / (nic * 1e6)  # full duplex
        disk_s = None if disk is None else (t["local_read_bytes"] + t["local_written_bytes"]) / (disk * 1e6)
        # The time: the model of the engine (tokpack.packer.node_model), its phases' CPU a byte
        # measured (node_model.MEASURED), which overlap, the resource that binds.
        model = (
            None
            if shared is None or disk is None
            else _predict(works[n], Rates(shared, nic, disk, readers=readers, procs=procs, start_s=0.0))
        )
        seconds = None if model is None else round(model["seconds"] + COMMAND_START_SECONDS, 1)
        per_node.append(
            {
                "node": n,
                "dest": str(dests[n]),
                "keep_sources": None if keeps[n] is None else str(keeps[n]),
                **t,
                "local_needed_bytes": need + t["kept_source_bytes"],
                "space": space,
                "shared_seconds": None if shared_s is None else round(shared_s, 1),
                "network_seconds": round(network_s, 1),
                "disk_seconds": None if disk_s is None else round(disk_s, 1),
                "predicted_seconds": seconds,
                "binding": None if model is None else model["binding"],  # the resource that binds this node
                "model": model,
            }
        )
    times = [p["predicted_seconds"] for p in per_node]
    slowest = None if None in times else max(range(nodes), key=lambda n: times[n])
    return PlanResult(
        command="shuffle",
        output=str(output),
        path="to-nodes",
        passes=[],
        space=[dict(s, node=p["node"]) for p in per_node if isinstance(p["space"], list) for s in p["space"]],
        workers=nodes,
        executor="mpi",
        disk_mbps=disk,
        disk=disk_how,
        startup_seconds=COMMAND_START_SECONDS,
        predicted_seconds=None if slowest is None else times[slowest],
        nodes=nodes,
        to_nodes={
            "dest": str(dest),
            "ranks_per_node": ranks_per_node,
            "micro_batch": micro_batch,
            "world_size": nodes * ranks_per_node,
            "keep_sources": keep_sources,
            "memory": memory,
            "procs_per_node": procs,
            # the slowest node's binding resource, and where the model's CPU a byte comes from
            "binding": None if slowest is None else per_node[slowest]["binding"],
            "cpu_seconds_a_byte": MEASURED,
            "cpu_measured_by": MEASURED_BY,
        },
        per_node=per_node,
        run_files=run_files,
        slowest_node=slowest,
        shared_mbps=shared,
        shared=shared_how,
        nic_mbps=nic,
        warnings=notes or None,
        **figures,
    )
