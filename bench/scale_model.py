"""A scale model of the run tokpack exists for: 11T tokens (uint16, 22 TB), shuffled offline on
48 nodes in about an hour (issue 14).

    python bench/scale_model.py                    # by hand: 1/4000 of the corpus (5.5 GB), ~20 min
    python bench/scale_model.py --scale 1/4000 --node-mbps 2000 --shared-mbps 40000 --keep models.json
    python bench/scale_model.py --quick            # a tiny model: bench/run_all.py --quick

1. The full run's shape comes from `tokpack plan shuffle` (tokpack.packer.planning) on a virtual source
   of 11T tokens and 5.5B documents: 48 scatter tasks of 64 GiB (--memory 3TiB --workers 48),
   1 GiB shards, one bucket per shard.
2. The model runs the real engine here on a random corpus of `scale` x 11T tokens with that
   shape scaled down: a source of 48 shards, so 48 scatter tasks; shards and budgets scaled by
   `scale`, so the same buckets and order tasks; --workers 2 (this machine's cores). It runs
   twice, at `scale` and `scale`/4, out of core, each pass through the local executor:
   - the scatter pass in full. Its blocks are far smaller than the bucket count, so nearly
     every row is an append of its own (two bucket files opened): its time splits into a fixed
     part and a cost per append (rows grow with bytes, so the cost per byte is inside it); the
     full run's larger blocks carry about 32 rows an append (tokpack.shuffle.steps.ROWS_PER_APPEND);
   - the order pass on an even sample of its tasks (--order-sample, every k-th shard; the
     real OrderStep.order per task, through the same executor): 20,490 order tasks at about
     2 s each would take hours on 2 cores, and every order task has the same shape (one
     shard's buckets, from the files of all 48 scatter tasks). Its time per task splits into a
     fixed part and a cost per bucket file it maps (the models are sparse: some task x bucket
     files are empty; the counts come from the scatter tasks' records), less the part spent
     reading its buckets' records from the 48 scatter tasks, which is timed apart on record
     tables of the full run's size.
   No-op passes measure what the executor costs a task, locally and as a Slurm array element.
3. The projection gives each of the full run's passes its tasks spread over 48 nodes: each
   task's bytes at a node's throughput, min(--node-mbps, --shared-mbps / 48), over the
   out-of-core shuffle's measured ratio to `cp` (OOC_VS_CP), plus its per-row, per-file and
   per-task costs as measured here, and on Slurm a few array-element starts a node.
4. What stays bounded as the corpus grows 1,000x at a fixed budget: plan's figures for 11B to
   11T tokens (memory per task, files per folder, open files per task, manifest bytes), the
   scatter records each order task reads, and the peak RSS of the planning driver, which runs
   the code the shuffle driver runs first.

--quick shrinks the shape too (4 scatter tasks, about 64 shards) and runs every order task, so
the epoch is written and checked: it checks that every step runs, its projection means little.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

sys.path[0] = str(
    Path(__file__).resolve().parents[1]
)  # the repo, not bench/, where shuffle.py would hide the shuffle package
from bench.common import machine_line, make_datatrove_corpus, print_table, python_cmd, run_measured  # noqa: E402
from bench.shuffle import pack_corpus  # noqa: E402
import numpy as np  # noqa: E402
from tokpack.shuffle.steps import RECORD_BYTES  # noqa: E402
from datatrove.pipeline.base import PipelineStep  # noqa: E402

INCIDENT_TOKENS = 11 * 10**12
INCIDENT_DOCUMENTS = 55 * 10**8
INCIDENT_SECONDS = 3600  # the incident's offline pre-shuffle took about an hour
NODES = 48
SEQ_LEN = 4096
FULL_MEMORY = 3 << 40  # 64 GiB a task on 48 nodes
LOCAL_WORKERS = 2
ORDER_SAMPLE = 256  # order tasks the full-size model runs, out of about 20,490
OOC_VS_CP = 1.63  # the out-of-core shuffle's time over `cp -r && sync` (BENCHMARKS.md, 1d95acf): its bytes' rate


INCIDENT_COPY_SECONDS = 5400  # the incident's copy of the whole run to each node's NVMe from a healthy peer: 1.5 h
SLICE_RANKS_PER_NODE, SLICE_MICRO_BATCH, SLICE_SEQ_LEN = 8, 4, 4096  # the training the slices serve


def ready_rows(shuffle_s: float, node_mbps: float, shared_mbps: float, slice_vs_cp: float) -> list[dict]:
    """ "Ready on 48 nodes" at the incident's scale: the shuffle, then every node stages its node
    slice from the shared filesystem at once (each at min(node, shared / 48)), against the
    incident's hour of shuffle and 1.5 h copy of the whole run to each node; and a replacement
    node staging one slice alone (min(node, shared)). Bytes come from the format's arithmetic
    (slicing: kept = the run / 48; read adds 8 bytes of row hash a sample of the run),
    times at cp's rate times `slice_vs_cp`, the measured slice / cp ratio (bench/stage.py --slices)."""
    row_bytes = (SLICE_SEQ_LEN + 1) * 2
    samples = INCIDENT_TOKENS // SLICE_SEQ_LEN
    kept = samples // NODES * row_bytes
    read = kept + 8 * samples
    all_at_once = read / (min(node_mbps, shared_mbps / NODES) * 1e6) * slice_vs_cp
    alone = read / (min(node_mbps, shared_mbps) * 1e6) * slice_vs_cp
    return [
        {
            "case": "incident: shuffle + whole-run copy to each node",
            "shuffle min": INCIDENT_SECONDS / 60,
            "stage min": INCIDENT_COPY_SECONDS / 60,
            "ready min": (INCIDENT_SECONDS + INCIDENT_COPY_SECONDS) / 60,
            "per node GB": 2 * INCIDENT_TOKENS / 1e9,
            "note": "the incident's own figures",
        },
        {
            "case": "tokpack: shuffle + every node stages its slice",
            "shuffle min": shuffle_s / 60,
            "stage min": all_at_once / 60,
            "ready min": (shuffle_s + all_at_once) / 60,
            "per node GB": kept / 1e9,
            "note": f"reads {read / 1e9:,.0f} GB a node (x{read / kept:.3f}) at {min(node_mbps, shared_mbps / NODES):g} MB/s, "
            f"x{slice_vs_cp:g} cp",
        },
        {
            "case": "tokpack: a replacement node stages one slice",
            "shuffle min": 0.0,
            "stage min": alone / 60,
            "ready min": alone / 60,
            "per node GB": kept / 1e9,
            "note": f"alone at {min(node_mbps, shared_mbps):g} MB/s; the incident's: {INCIDENT_COPY_SECONDS / 60:.0f} min",
        },
    ]


def full_plan(disk_mbps: float):
    from tokpack.packer import ExecutorConfig, plan

    virtual = f"virtual:tokens={INCIDENT_TOKENS},documents={INCIDENT_DOCUMENTS},dtype=uint16"
    return plan(
        "shuffle",
        virtual,
        "/nonexistent/run",
        seq_len=SEQ_LEN,
        seed=1,
        epochs=1,
        memory=FULL_MEMORY,
        executor=ExecutorConfig(executor="slurm", workers=NODES, tasks=NODES),
        disk_mbps=disk_mbps,
    )


class SampledOrder(PipelineStep):
    """Rank r of the executor runs the real order task of shard r x stride: an even sample of
    the order pass, each task as the engine runs it."""

    name = "shuffle order (sample)"
    type = "tokpack"

    def __init__(self, order, stride: int):
        super().__init__()
        self.order, self.stride = order, stride

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        self.order.order(rank * self.stride)


class NoopStep(PipelineStep):
    """A task that does nothing: what the executor itself costs a task."""

    name = "no-op"
    type = "tokpack"

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        pass


def task_overhead(executor: str, tasks: int, work: Path) -> float | None:
    """Worker seconds the executor costs a task (start, log file, completion marker; on Slurm
    the array element's start): from a pass of `tasks` no-op tasks less a pass of a quarter as
    many (both start the same worker pool)."""
    from bench.scale_model import NoopStep  # by module name, so a Slurm job can unpickle it
    from tokpack.packer.shared import ExecutorConfig
    from tokpack.packer.executors import pass_runner

    if executor == "slurm" and not shutil.which("sinfo"):
        return None
    if executor == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            return None
    run = pass_runner(ExecutorConfig(executor=executor, workers=LOCAL_WORKERS, poll_seconds=0.5))
    if executor == "ray":  # the cluster and its rank runners start once a command, not once a pass
        run([(NoopStep(), LOCAL_WORKERS, "noop-start", str(work / "noop-ray-start"))])
    seconds = []
    counts = (max(LOCAL_WORKERS, tasks // 4), tasks)
    for n in counts:
        t0 = time.perf_counter()
        run([(NoopStep(), n, f"noop-{n}", str(work / f"noop-{executor}-{n}"))])
        seconds.append(time.perf_counter() - t0)
    return max(0.0, seconds[1] - seconds[0]) * LOCAL_WORKERS / (counts[1] - counts[0])


class _Sampled(Exception):
    """The model stops after the sampled order tasks: the epoch is not complete."""


def parse_records(layout) -> tuple[float, int]:
    """(seconds, bytes) to read the scatter tasks' records of one shard's buckets, as each order
    task does (Layout.recorded)."""
    t0 = time.perf_counter()
    buckets = range(int(layout.shard_buckets[0]), int(layout.shard_buckets[1]))
    size = sum(layout.recorded(t, buckets).nbytes for t in range(layout.tasks))
    return time.perf_counter() - t0, size


def records_read(work: Path, tasks: int, buckets: int, per_shard: int) -> tuple[float, int]:
    """(seconds, bytes) an order task of a run with `tasks` scatter tasks and `buckets` buckets
    takes to read its `per_shard` buckets' records, on record tables of that size written here."""
    folder = work / "records"
    folder.mkdir()
    for t in range(tasks):
        np.zeros(buckets * 3, dtype="<u8").tofile(folder / f"{t}.records")
    mid = buckets // 2 * RECORD_BYTES
    t0 = time.perf_counter()
    size = sum(
        np.fromfile(folder / f"{t}.records", dtype="<u8", count=3 * per_shard, offset=mid).nbytes for t in range(tasks)
    )
    seconds = time.perf_counter() - t0
    shutil.rmtree(folder)
    return seconds, size


def appends_per_row(block_rows: int, buckets: int) -> float:
    """A scatter block of `block_rows` rows reaches about buckets x (1 - e^(-block/buckets))
    buckets, an append (two files opened and written) each."""
    return buckets * -math.expm1(-block_rows / buckets) / block_rows


def run_model(work: Path, tokens: int, tasks: int, shard_samples: int, task_budget: int, order_sample: int) -> dict:
    """The real engine, out of core, each pass timed through the local executor."""
    from tokpack.packer.shared import ExecutorConfig
    from tokpack.packer.executors import pass_runner
    from tokpack.shuffle.run_setup import min_memory
    from tokpack.shuffle.run import shuffle_run
    from tokpack.shuffle.spec import ShuffleSpec

    # one source shard per scatter task (the engine gives a task whole shards)
    corpus = make_datatrove_corpus(
        work / "corpus", tokens * 2, files=tasks, mean_doc=INCIDENT_TOKENS // INCIDENT_DOCUMENTS
    )
    source = pack_corpus(corpus, work / "source")
    shutil.rmtree(corpus)
    data = sum(p.stat().st_size for p in source.glob("*.ds"))
    real = pass_runner(ExecutorConfig(workers=LOCAL_WORKERS))
    m: dict = {}

    def run_passes(passes):
        (scatter, n_scatter, *_), (order, n_order, order_name, order_logs) = passes
        lay = order.layout
        t0 = time.perf_counter()
        real([passes[0]])
        m["scatter_s"] = time.perf_counter() - t0
        counts = np.concatenate([lay.recorded(t, range(len(lay.bucket_starts) - 1))[:, 0] for t in range(lay.tasks)])
        m.update(
            scatter_tasks=n_scatter,
            order_tasks=n_order,
            buckets=len(lay.bucket_starts) - 1,
            files=2 * int(np.count_nonzero(counts)),
            rows=int(counts.sum()),
            block_rows=lay.block_rows,
        )
        m["parse_s"], m["record_bytes"] = min(parse_records(lay) for _ in range(3))
        stride = max(1, n_order // order_sample)
        sample = -(-n_order // stride)
        t0 = time.perf_counter()
        real([(SampledOrder(order, stride) if stride > 1 else order, sample, order_name, order_logs)])
        m["order_s"], m["order_sampled"] = time.perf_counter() - t0, sample
        if stride > 1:
            raise _Sampled

    out = work / "run"
    row_bytes = (SEQ_LEN + 1) * 2
    # at least a shard a task (one bucket per shard, as in the full run), and above the engine's floor
    memory = max(LOCAL_WORKERS * max(task_budget, shard_samples * row_bytes * 2), min_memory(row_bytes, LOCAL_WORKERS))
    try:
        spec = ShuffleSpec.given_as(
            sources=[str(source)], seq_len=SEQ_LEN, seed=1, epochs=[0], shard_samples=shard_samples, memory=memory
        )
        result = shuffle_run(spec, str(out), workers=LOCAL_WORKERS, tasks=tasks, run_passes=run_passes)
        assert result["path"] == "out-of-core", result["path"]
        assert len(list(out.glob("epoch-00000/*.ds"))) == m["order_tasks"]
    except _Sampled:
        pass
    shutil.rmtree(work)
    samples = m["rows"]
    # scatter reads the source and writes every row with its position; order reads those and writes the epoch
    scratch = samples * (row_bytes + 8)
    return {
        **m,
        "tokens": tokens,
        "samples": samples,
        "scatter_bytes": data + scratch,
        "order_task_bytes": (scratch + samples * row_bytes) / m["order_tasks"],
    }


def solve2(a: tuple[float, float, float], b: tuple[float, float, float]) -> tuple[float, float]:
    """(x, y) with x*a0 + y*a1 = a2 and x*b0 + y*b1 = b2, each at least 0 (a negative share is
    noise: the other term then takes the whole time)."""
    det = a[0] * b[1] - a[1] * b[0]
    x = (a[2] * b[1] - a[1] * b[2]) / det if det else 0.0
    y = (a[0] * b[2] - a[2] * b[0]) / det if det else 0.0
    if x < 0:
        return 0.0, a[2] / a[1]
    if y < 0:
        return a[2] / a[0], 0.0
    return x, y


BOUNDED_TASK_BUDGET = 256 << 20  # small enough that even the smallest corpus shuffles out of core


def bounded_rows(budget_per_task: int = BOUNDED_TASK_BUDGET) -> list[dict]:
    """Plan's figures, and the planning driver's peak RSS, as the corpus grows 1,000x."""
    rows = []
    for tokens in (11 * 10**9, 11 * 10**10, 11 * 10**11, 11 * 10**12):
        docs = tokens // (INCIDENT_TOKENS // INCIDENT_DOCUMENTS)
        code = (
            f"from packer import ExecutorConfig, plan\n"
            f"r = plan('shuffle', 'virtual:tokens={tokens},documents={docs},dtype=uint16', '/nonexistent/run', "
            f"seq_len={SEQ_LEN}, seed=1, epochs=1, memory={NODES * budget_per_task}, "
            f"executor=ExecutorConfig(executor='slurm', workers={NODES}, tasks={NODES}), disk_mbps=1000)\n"
            f"import json, sys; json.dump(r.to_json(), open(sys.argv[-1], 'w'))"
        )
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            m = run_measured(python_cmd(code) + [f.name], cold=False)
            r = json.loads(Path(f.name).read_text())
        e = r["epochs"][0]
        rows.append(
            {
                "case": f"{tokens / 1e12:g}T tokens",
                "path": e["path"],
                "scatter tasks": e.get("scatter_tasks"),
                "memory per task MiB": r["passes"][0]["memory_per_task"] / 2**20,
                "shards": e["shards"],
                "bucket files": e.get("bucket_files"),
                "files per bucket folder": e.get("files_per_folder"),
                # a shard's .ds, .index and .metadata; datatrove's log, marker and stats per order task
                "files in epoch folder": 3 * e["shards"] + 1,
                "files in a log folder": e["shards"],
                "open files per task": 2 * _max_open(),
                "epoch manifest MB": r["manifests"]["epoch-00000/tokpack.json"] / 1e6,
                # an order task reads its buckets' records from every scatter task (Layout.recorded)
                "scatter records read per order task kB": RECORD_BYTES
                * e.get("scatter_tasks", 0)
                * e.get("buckets", 0)
                / e["shards"]
                / 1e3,
                "driver peak RSS MB": m.peak_rss_mb,
            }
        )
    return rows


def _max_open() -> int:
    from tokpack.shuffle.steps import MAX_OPEN_BUCKET_FILES

    return MAX_OPEN_BUCKET_FILES


def main(
    size=None,
    quick: bool = False,
    *,
    scale: Fraction = Fraction(1, 4000),
    node_mbps: float = 2000,
    slice_vs_cp: float = 1.0,
    shared_mbps: float = 40000,
    order_sample: int = ORDER_SAMPLE,
    work: Path | None = None,
    keep: Path | None = None,
) -> list[dict]:
    """`size` is not used (bench/run_all.py passes one): the model's size is `scale` of 11T tokens.
    `keep`: a JSON file of the models' measurements, written as each model ends and read back on
    the next run with the same arguments (the projection is then redone without them)."""
    from loguru import logger

    from tokpack.packer.executors import SLURM_ELEMENTS_PER_WORKER
    from tokpack.packer.plan_result import measure_disk

    logger.remove()  # datatrove's executor logs every task; the tables are the output here
    scale = Fraction(1, 10**6) if quick else scale
    order_sample = 10**9 if quick else order_sample  # the tiny model writes its whole epoch
    work = Path(tempfile.mkdtemp(prefix="tokpack-scale-model-", dir=work))
    started = time.perf_counter()
    try:
        disk_mbps, how = measure_disk(work)
        full = full_plan(node_mbps)
        fe = full.epochs[0]
        full_shard_samples = -(-full.samples_per_epoch // fe["shards"])
        tasks = 4 if quick else fe["scatter_tasks"]
        task_budget = full.passes[0]["memory_per_task"]
        models = []
        kept = json.loads(keep.read_text()) if keep and keep.exists() else {}
        for s in (scale, scale / 4):
            tokens = int(INCIDENT_TOKENS * s)
            shard_samples = (
                max(1, round(full_shard_samples * s)) if not quick else max(1, tokens // (SEQ_LEN + 1) // 64)
            )
            key = f"{s} {tasks} {shard_samples} {order_sample}"
            if key not in kept:
                kept[key] = run_model(
                    work / f"model-{len(models)}", tokens, tasks, shard_samples, int(task_budget * s), order_sample
                )
                if keep:
                    keep.write_text(json.dumps(kept, indent=1))
            models.append(kept[key])
        big, small = models
        # the order pass's per-task cost holds the local executor's; the full run's tasks are Slurm array elements
        local_task = task_overhead("local", 16 if quick else 400, work)
        slurm_task = None if quick else task_overhead("slurm", 16, work)
        ray_task = None if quick else task_overhead("ray", 400, work)
        node_rate = min(node_mbps, shared_mbps / NODES) * 1e6  # bytes/s a node moves when all 48 run at once
        byte_rate = node_rate / OOC_VS_CP  # the engine's bytes, at its measured ratio to cp
        full_buckets, full_tasks = fe["bucket_files"] // (2 * NODES), fe["scatter_tasks"]
        rows = []
        # scatter: wall = fixed + per append x appends (an append: one bucket's two files opened and
        # written). The model's blocks are far smaller than its bucket count, so its appends are about
        # its rows, and rows grow with bytes: the per-append cost holds the per-byte cost too. The full
        # run's blocks give each append about ROWS_PER_APPEND rows (tokpack.shuffle.steps.make_layout).
        model_appends = [
            m["rows"] * (appends_per_row(m["block_rows"], m["buckets"]) if "block_rows" in m else 1.0) for m in models
        ]  # measurements kept from before block_rows was recorded: a row each
        per_append, scatter_fixed = solve2(*((a, 1.0, m["scatter_s"]) for a, m in zip(model_appends, models)))
        per_append *= LOCAL_WORKERS  # worker seconds
        full_appends = full.samples_per_epoch / full_tasks * appends_per_row(fe["scatter_block_rows"], fe["buckets"])
        full_scatter_bytes = full.passes[0]["read_bytes"] + full.passes[0]["written_bytes"]
        scatter_task = (
            full_scatter_bytes / full_tasks / byte_rate
            + full_appends * per_append
            + scatter_fixed * LOCAL_WORKERS / big["scatter_tasks"]
        )
        scatter_s = scatter_task * -(-full_tasks // NODES)
        rows.append(
            {
                "case": "scatter",
                "model s (scale)": big["scatter_s"],
                "model s (scale/4)": small["scatter_s"],
                "model MB/s": big["scatter_bytes"] / big["scatter_s"] / 1e6,
                "us per append": per_append * 1e6,
                "ms per task": None,
                "full TB moved": full_scatter_bytes / 1e12,
                "full s per node in bytes": full_scatter_bytes / NODES / byte_rate,
                "projected s": scatter_s,
            }
        )
        # order, per task on one worker: fixed + per bucket file x files it maps, plus reading its
        # buckets' scatter records (timed here on tables of the full run's size); its bytes (0.5 MB a
        # task here) are too few to time, and go at byte_rate
        per_task = [
            (m["files"] / m["order_tasks"], 1.0, m["order_s"] * LOCAL_WORKERS / m["order_sampled"] - m["parse_s"])
            for m in models
        ]
        per_file, order_fixed = solve2(*per_task)
        full_parse, full_record_bytes = records_read(work, full_tasks, fe["buckets"], fe["buckets"] // fe["shards"])
        full_order_bytes = full.passes[1]["read_bytes"] + full.passes[1]["written_bytes"]
        order_costs = order_fixed + 2 * full_tasks * per_file + full_parse  # all but its bytes
        order_task = full_order_bytes / fe["shards"] / byte_rate + order_costs
        order_tasks_per_node = -(-fe["shards"] // NODES)
        # on Slurm a node starts SLURM_ELEMENTS_PER_WORKER array elements, each running its tasks in turn
        slurm_starts = 0.0 if slurm_task is None else SLURM_ELEMENTS_PER_WORKER * slurm_task
        order_s = order_task * order_tasks_per_node + slurm_starts
        rows.append(
            {
                "case": "order",
                "model s (scale)": big["order_s"] * big["order_tasks"] / big["order_sampled"],
                "model s (scale/4)": small["order_s"] * small["order_tasks"] / small["order_sampled"],
                "model MB/s": None,
                "us per append": None,
                "ms per task": order_costs * 1e3,
                "full TB moved": full_order_bytes / 1e12,
                "full s per node in bytes": full_order_bytes / NODES / byte_rate,
                "projected s": order_s,
            }
        )
        total = scatter_s + order_s
        rows.append(
            {
                "case": "total",
                "projected s": total,
                "full TB moved": sum(r["full TB moved"] for r in rows),
                "full s per node in bytes": sum(r["full s per node in bytes"] for r in rows),
            }
        )
        print(f"{machine_line()}; this disk {disk_mbps} MB/s read+write ({how})")
        print(
            f"model: {scale} of 11T tokens ({big['samples']:,} samples, {big['scatter_tasks']} scatter tasks, "
            f"{big['buckets']:,} buckets, {big['files']:,} bucket files, {big['order_tasks']:,} order tasks of "
            f"which {big['order_sampled']} run), and {scale / 4} ({small['files']:,} bucket files, "
            f"{small['order_sampled']} order tasks run); --workers {LOCAL_WORKERS}; {time.perf_counter() - started:.0f} s"
        )
        print(
            f"scatter records an order task reads: model {big['record_bytes'] / 1e3:.1f} kB in "
            f"{big['parse_s'] * 1e3:.1f} ms; full run {full_record_bytes / 1e3:.1f} kB in {full_parse * 1e3:.1f} ms"
        )
        print(
            f"executor cost a task (no-op tasks, worker seconds): local {local_task * 1e3:.0f} ms, Slurm array "
            f"element "
            + (
                "not measured"
                if slurm_task is None
                else f"{slurm_task * 1e3:.0f} ms (this machine's "
                f"one-node cluster): {order_tasks_per_node * slurm_task:.0f} s a node if every order task were an "
                f"element, {slurm_starts:.0f} s with {SLURM_ELEMENTS_PER_WORKER} elements a node"
            )
        )
        print(
            "Ray (rank runners started once a command, ranks in turn): "
            + (
                "not measured"
                if ray_task is None
                else f"{ray_task * 1e3:.0f} ms a task (this machine's local "
                f"cluster): {order_tasks_per_node * ray_task:.0f} s a node for the full run's "
                f"{fe['shards']:,} order tasks ({order_tasks_per_node} a node)"
            )
        )
        print(
            f"order task: {order_fixed * 1e3:.0f} ms fixed (local executor included) + {per_file * 1e3:.1f} ms a "
            f"bucket file (96 in the full run) + {full_parse * 1e3:.1f} ms of scatter records; scatter: "
            f"{per_append * 1e6:.0f} us an append (model: {model_appends[0] / big['rows']:.2f} a row; full run "
            f"{full.samples_per_epoch / full_tasks / 1e6:.0f}M rows a task in {full_appends / 1e6:.2f}M appends, "
            f"blocks of {fe.get('scatter_block_rows'):,} rows over {full_buckets:,} buckets)"
        )
        print(
            f"full run: {fe['shards']:,} shards, {fe['bucket_files']:,} bucket files, {NODES} nodes at "
            f"{node_mbps:g} MB/s each, shared filesystem {shared_mbps:g} MB/s: {node_rate / 1e6:g} MB/s a node"
        )
        print_table(
            f"scale model: the 11T-token shuffle projected on {NODES} nodes: {total / 60:.1f} min "
            f"(the incident's pre-shuffle: about {INCIDENT_SECONDS / 60:.0f} min)",
            rows,
            [
                "case",
                "model s (scale)",
                "model s (scale/4)",
                "model MB/s",
                "us per append",
                "ms per task",
                "full TB moved",
                "full s per node in bytes",
                "projected s",
            ],
        )
        ready = ready_rows(total, node_mbps, shared_mbps, slice_vs_cp)
        print_table(f"ready on {NODES} nodes: shuffle, then node slices", ready, list(ready[0]))
        bounded = bounded_rows()
        print_table(
            f"what stays bounded as the corpus grows 1,000x (plan, {BOUNDED_TASK_BUDGET >> 20} MiB a task, "
            f"{NODES} tasks)",
            bounded,
            list(bounded[0]),
        )
        return rows + bounded
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="1/4000", help="fraction of the 11T-token corpus the model shuffles")
    ap.add_argument("--node-mbps", type=float, default=2000, help="each node's disk or network throughput, MB/s")
    ap.add_argument(
        "--shared-mbps", type=float, default=40000, help="the shared filesystem's aggregate throughput, MB/s"
    )
    ap.add_argument(
        "--order-sample", type=int, default=ORDER_SAMPLE, help="order tasks each model runs (an even sample)"
    )
    ap.add_argument("--quick", action="store_true", help="a tiny model (4 tasks, 64 shards): checks that it runs")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default: system temp)")
    ap.add_argument("--keep", type=Path, default=None, help="JSON file keeping the models' measurements between runs")
    ap.add_argument(
        "--slice-vs-cp",
        type=float,
        default=1.0,
        help="a node slice's time over cp of its bytes (bench/stage.py --slices), for the ready table",
    )
    ap.add_argument(
        "--ready-only",
        type=float,
        default=None,
        metavar="SHUFFLE_MIN",
        help="print only the ready-on-48-nodes table, for a shuffle of this many minutes (no model run)",
    )
    a = ap.parse_args()
    if a.ready_only is not None:
        rows = ready_rows(a.ready_only * 60, a.node_mbps, a.shared_mbps, a.slice_vs_cp)
        print_table(f"ready on {NODES} nodes: shuffle, then node slices", rows, list(rows[0]))
        sys.exit(0)
    main(
        quick=a.quick,
        slice_vs_cp=a.slice_vs_cp,
        scale=Fraction(a.scale),
        node_mbps=a.node_mbps,
        shared_mbps=a.shared_mbps,
        order_sample=a.order_sample,
        work=a.work,
        keep=a.keep,
    )
