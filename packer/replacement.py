"""A node's rows rebuilt from the sources alone, for a RUN `shuffle --to-nodes` wrote (issue 33,
items 3 and 6): the positions a node's ranks read (tokpack.formats.slices.RankRows), the source
tokens the plan puts there (windows: ranged reads of the sources; best-fit: rows assembled from
the row table), each row checked against RUN's row hashes (`.ds.rows`, and best-fit `.ds.pad`).

`stage RUN DEST --node n/N` on such a RUN (a replacement node) is `stage_replacement`: the rows
fed, in increasing position, to the rank files of tokpack.packer.exchange.RankFiles, so its
bytes are the exchange's.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from tokpack.formats.errors import TokpackError
from tokpack.formats.guard import WORK_DIR, OutputLock, holder_name
from tokpack.formats.io import read_array, read_limited
from tokpack.formats.manifest import MANIFEST, MAX_MANIFEST_BYTES, epoch_dir_name, parse_manifest, row_hashes
from tokpack.formats.numbering import EpochNumbering
from tokpack.formats.outputs import EpochShardFormat, LocalOutput, Output
from tokpack.formats.shards import PAD_SUFFIX, ROWS_SUFFIX, U64, tokens_on_nodes
from tokpack.formats.slices import RankRows, slice_epoch_manifest
from tokpack.packer.exchange import _own_dest, _read_raw, _slice_root_of_run, write_rank_files
from tokpack.packer.shared import Result
from tokpack.packer.slicing import _epoch_in_place, slice_ranks
from tokpack.shuffle import packings
from tokpack.shuffle.packed import PackedTable
from tokpack.shuffle.plan import open_source




@dataclass
class ReplacementResult(Result):
    """What `stage RUN DEST --node n/N` on a --to-nodes RUN prints with --json."""

    kind: str
    source: str
    dest: str
    ranks: list[int]
    world_size: int
    micro_batch: int
    epochs: list[int]
    built_from: str  # "sources": no token file in RUN
    bytes_read: int  # the rows' source tokens and RUN's row hashes
    bytes_kept: int
    read_amplification: float | None
    seconds: float


def exchanged_run(run_dir) -> bool:
    """Whether RUN was written by --to-nodes: its epochs hold row hashes and no token file."""
    for m in sorted(Path(run_dir).glob(f"epoch-*/{MANIFEST}")):
        shards = parse_manifest(_read_raw(m), m, "epoch").get("shards") or []
        if shards:
            return tokens_on_nodes(m.parent, shards)
    return False


def stage_replacement(run_dir, dest, *, node, ranks_per_node: int, micro_batch: int, epochs=None, log=None,
                      memory: int = 256 << 20) -> "ReplacementResult":
    """`tokpack stage RUN DEST --node n/N --ranks-per-node K --micro-batch m` on a RUN --to-nodes
    wrote: node n's slice built from the sources alone, each of its rows read by a ranged read
    (windows: its source tokens) and verified against RUN's row hashes; the exchange's bytes.
    A best-fit epoch's rows are assembled from the row table (rebuilt in DEST's scratch, within
    `memory`, and checked against the manifest's table_xxh3_128), their padding checked against RUN's `.ds.pad`."""
    from tokpack.packer.staging import parse_epochs

    t0 = time.perf_counter()
    out, dest = Path(run_dir), Path(dest)
    a, b, w = slice_ranks(node=node, ranks_per_node=ranks_per_node)
    rows = RankRows(w, micro_batch, 0)
    with OutputLock(str(dest), holder_name("stage")):
        previous = _own_dest(dest, out, (a, b), w, micro_batch)
        run, root = _slice_root_of_run(out, (a, b), w, micro_batch, 0)
        numbering = EpochNumbering.of_run(run, out)
        chosen = sorted(int(e) for e in run.get("epochs") or []) if epochs is None else parse_epochs(epochs)
        output: Output = LocalOutput()
        read = kept = 0
        for e in chosen:
            d = dest / epoch_dir_name(e)
            first = numbering.first(e)
            raw = _read_raw(out / epoch_dir_name(e) / MANIFEST)
            m = parse_manifest(raw, out / epoch_dir_name(e) / MANIFEST, "epoch")
            want = slice_epoch_manifest(root, e, int(m["samples"]), first, raw)
            if e in previous and _epoch_in_place(d, want):
                continue
            packing = packings.of_manifest(m)
            padded = packing.name != packings.DEFAULT  # best-fit: rows from the row table's pieces
            sources = [open_source(src["path"]) if int(src["samples"]) or padded else None for src in m["sources"]]
            plan = packing.from_manifest(m, [src for src in sources if src is not None], memory)
            parts = list(rows.node_positions(first, plan.samples, (a, b), 1 << 20))
            positions = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
            epoch_dir = out / epoch_dir_name(e)
            if padded:
                tokens, got, pad, pads_read = _packed_rows(plan, sources, m, positions, epoch_dir,
                                                           dest / WORK_DIR / f"replace-{epoch_dir_name(e)}", memory)
            else:
                (tokens, got), pad, pads_read = _rows_from_sources(plan, sources, positions), None, 0
            expected, hashes_read = _run_row_hashes(epoch_dir, m, positions)
            bad = np.flatnonzero(got != expected)
            if len(bad):
                g = int(positions[bad[0]])
                raise TokpackError("a source row differs from the run's row hash", file=epoch_dir,
                                   where=f"sample {g}", hint="the sources changed since the run was shuffled: "
                                                             "run `tokpack validate` on them")
            fmt = EpochShardFormat(tokens.dtype, int(m["seq_len"]), int(m["eos_id"]), m["tokenizer"], padded=padded)
            entries = write_rank_files(output, d, rows, positions, first, (a, b), e, tokens, pad, fmt)
            hashes_read += pads_read
            want["shards"], want["tokens"] = entries, sum(x["tokens"] for x in entries)
            output.finish(d, want)
            read += tokens.nbytes + hashes_read
            kept += tokens.nbytes
            if log:
                log(f"stage: epoch {e}: {len(positions):,} rows of ranks {a}-{b} rebuilt from the sources")
        root["epochs"] = sorted(set(previous) | set(chosen))
        root["tokens"] = sum(int(parse_manifest(read_limited(dest / epoch_dir_name(e) / MANIFEST, MAX_MANIFEST_BYTES,
                                                             "manifest"), dest, "slice-epoch")["tokens"])
                             for e in root["epochs"])
        output.finish(dest, root)
    return ReplacementResult(kind="slice", source=str(out), dest=str(dest), ranks=root["ranks"], world_size=w,
                             micro_batch=micro_batch, epochs=root["epochs"], built_from="sources", bytes_read=read,
                             bytes_kept=kept, read_amplification=round(read / kept, 4) if kept else None,
                             seconds=round(time.perf_counter() - t0, 3))


def _packed_rows(plan, sources, m: dict, positions: np.ndarray, epoch_dir: Path, work: Path, memory: int):
    """A best-fit epoch's rows at `positions`, from the row table and the sources' documents, with
    their row hashes and padding (checked against RUN's `.ds.pad`); and the padding bytes read."""
    from tokpack.shuffle.packed import TokenPool, row_padding
    from tokpack.shuffle.steps import EpochJob

    first = next(src for src in sources if src is not None)
    job = EpochJob(plan, tuple(str(src.path) for src in sources), m["dtype"], int(m["eos_id"]), m["tokenizer"],
                   str(epoch_dir), str(work), int(m["shard_samples"]))
    prepared = packings.of_manifest(m).prepare(job, memory)
    if prepared["table_xxh3_128"] != m["packing"]["table_xxh3_128"]:
        raise TokpackError("the row table rebuilt from the sources is not the run's", file=epoch_dir / MANIFEST,
                           where="packing.table_xxh3_128", expected=m["packing"]["table_xxh3_128"],
                           found=prepared["table_xxh3_128"], hint="the sources changed since the run was shuffled")
    built = PackedTable.open(prepared["table"], prepared["table_xxh3_128"])

    def changed(src, k, tokens):
        pass  # each row is checked against RUN's row hash instead: the node reads only its rows' documents

    pool = TokenPool(plan, sources, changed)
    row = plan.row_tokens
    out = np.empty((len(positions), row), dtype=first.dtype)
    pad = np.empty(len(positions), dtype="<u4")
    cuts = np.flatnonzero(np.diff(positions) != 1) + 1  # runs of consecutive positions: a global batch's
    for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(positions)]):
        g0, g1 = int(positions[lo]), int(positions[hi - 1]) + 1
        table, starts = built.rows(g0, g1)
        out[lo:hi] = pool.rows(table, g0, g1, row, plan.pad_id, starts)
        pad[lo:hi] = row_padding(table, g1 - g0, row, g0)
    per, read = int(m["shard_samples"]), 0
    shard = positions // per
    for i in np.unique(shard).tolist():
        entry = m["shards"][i]
        path = epoch_dir / f"{entry['path']}{PAD_SUFFIX}"
        recorded = read_array(path, "<u4", int(entry["samples"]), folder=epoch_dir)
        read += recorded.nbytes
        if xxhash.xxh3_128_hexdigest(recorded.tobytes()) != entry["pad_xxh3_128"]:
            raise TokpackError("the run's padding does not match its manifest", file=path, where="pad_xxh3_128",
                               hint="rerun the --to-nodes command that wrote the run")
        sel = shard == i
        if (recorded[positions[sel] - i * per] != pad[sel]).any():
            raise TokpackError("a rebuilt row's padding differs from the run's", file=path,
                               hint="the sources changed since the run was shuffled")
    shutil.rmtree(work.parent, ignore_errors=True)
    return out, row_hashes(out), pad, read


def _rows_from_sources(plan, sources, positions: np.ndarray):
    """The rows at epoch `positions`: each window's tokens read from its source (in source order,
    so the reads go front to back), and their row hashes."""
    row = plan.row_tokens
    s, window, _ = plan.locate(positions)
    sources = [src for src in sources if src is not None]
    dtype = sources[0].dtype
    out = np.empty((len(positions), row), dtype=dtype)
    order = np.lexsort((window, s))
    handles: dict = {}
    for i in order.tolist():
        src = next(p for p in sources if p.fingerprint == plan.sources[int(s[i])].fingerprint)
        start, _ = plan.token_range(int(s[i]), int(window[i]))
        src.read_into(start, out[i], handles.setdefault(src.fingerprint, {}))
    for files in handles.values():
        for f in files.values():
            f.close()
    return out, row_hashes(out)


def _run_row_hashes(epoch_dir: Path, m: dict, positions: np.ndarray) -> tuple[np.ndarray, int]:
    """RUN's row hash of each position, from the shards' `.ds.rows` (each checked against its
    manifest's rows_xxh3_128 first); returns them and the bytes read."""
    per = int(m["shard_samples"])
    expected = np.empty(len(positions), dtype=U64)
    shard = positions // per
    read = 0
    for i in np.unique(shard).tolist():
        entry = m["shards"][i]
        path = epoch_dir / f"{entry['path']}{ROWS_SUFFIX}"
        table = read_array(path, U64, int(entry["samples"]), folder=epoch_dir)
        if xxhash.xxh3_128_hexdigest(table.tobytes()) != entry["rows_xxh3_128"]:
            raise TokpackError("the run's row hashes do not match their manifest", file=path,
                               where="rows_xxh3_128", hint="rerun the --to-nodes command that wrote the run")
        sel = shard == i
        expected[sel] = table[positions[sel] - i * per]
        read += table.nbytes
    return expected, read
