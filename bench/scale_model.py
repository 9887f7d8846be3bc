"""A scale model of the run tokpack exists for: 11T tokens (uint16, 22 TB), shuffled offline on
48 nodes in about an hour (issue 14).

    python bench/scale_model.py                    # by hand: 1/2000 of the corpus (11 GB), ~15 min
    python bench/scale_model.py --scale 1/4000 --node-mbps 2000 --shared-mbps 40000
    python bench/scale_model.py --quick            # a tiny model: bench/run_all.py --quick

1. The full run's shape comes from `tokpack plan shuffle` (packer.planning) on a virtual source
   of 11T tokens and 5.5B documents: 48 scatter tasks of 64 GiB (--memory 3TiB --workers 48),
   1 GiB shards, one bucket per shard.
2. The model runs the real engine here on a random corpus of `scale` x 11T tokens with that
   shape scaled down: the same 48 scatter tasks, shards and budgets scaled by `scale`, so the
   same buckets, bucket files per task and order tasks; --workers 2 (this machine's cores). It
   runs twice, at `scale` and `scale`/4: each pass's time then splits into a cost per byte and
   a cost per file (the files are the same in both).
3. The projection gives each of the full run's passes its bytes at the nodes' throughput,
   min(48 x --node-mbps, --shared-mbps), times the fraction of this machine's disk throughput
   (measured by plan's probe) the engine reached here, plus its files at the per-file cost
   measured here, spread over 48 nodes.
4. What stays bounded as the corpus grows 1,000x at a fixed budget: plan's figures for 11B to
   11T tokens (memory per task, files per folder, open files per task, manifest bytes) and the
   peak RSS of the planning driver, which runs the code the shuffle driver runs first.

--quick shrinks the shape too (4 scatter tasks, 64 shards): it checks that every step runs,
its projection means little.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repo, not bench/, where shuffle.py would hide the shuffle package
from bench.common import machine_line, make_datatrove_corpus, print_table, python_cmd, run_measured  # noqa: E402
from bench.shuffle import pack_corpus  # noqa: E402

INCIDENT_TOKENS = 11 * 10**12
INCIDENT_DOCUMENTS = 55 * 10**8
INCIDENT_SECONDS = 3600  # the incident's offline pre-shuffle took about an hour
NODES = 48
SEQ_LEN = 4096
FULL_MEMORY = 3 << 40  # 64 GiB a task on 48 nodes
LOCAL_WORKERS = 2


def full_plan(disk_mbps: float):
    from packer import ExecutorConfig, plan

    virtual = f"virtual:tokens={INCIDENT_TOKENS},documents={INCIDENT_DOCUMENTS},dtype=uint16"
    return plan("shuffle", virtual, "/nonexistent/run", seq_len=SEQ_LEN, seed=1, epochs=1, memory=FULL_MEMORY,
                executor=ExecutorConfig(executor="slurm", workers=NODES, tasks=NODES), disk_mbps=disk_mbps)


def run_model(work: Path, tokens: int, tasks: int, shard_samples: int, task_budget: int) -> dict:
    """The real engine, out of core, each pass timed: {pass: (seconds, bytes moved)}, files."""
    from packer.executors import ExecutorConfig, pass_runner
    from shuffle.run import min_memory, shuffle_run

    corpus = make_datatrove_corpus(work / "corpus", tokens * 2, files=8, mean_doc=INCIDENT_TOKENS // INCIDENT_DOCUMENTS)
    source = pack_corpus(corpus, work / "source")
    shutil.rmtree(corpus)
    real = pass_runner(ExecutorConfig(workers=LOCAL_WORKERS))
    timed: dict[str, float] = {}

    def run_passes(passes):
        for step, n, name, logs in passes:
            t0 = time.perf_counter()
            real([(step, n, name, logs)])
            timed[name.rsplit("-", 1)[1]] = time.perf_counter() - t0

    out = work / "run"
    t0 = time.perf_counter()
    # at least a shard a task (one bucket per shard, as in the full run), and above the engine's floor
    memory = max(LOCAL_WORKERS * max(task_budget, shard_samples * (SEQ_LEN + 1) * 2),
                 min_memory((SEQ_LEN + 1) * 2, LOCAL_WORKERS))
    result = shuffle_run([str(source)], str(out), seq_len=SEQ_LEN, seed=1, epochs=[0], shard_samples=shard_samples,
                         memory=memory, workers=LOCAL_WORKERS, tasks=tasks, run_passes=run_passes)
    wall = time.perf_counter() - t0
    assert result["path"] == "out-of-core", result["path"]
    data = sum(p.stat().st_size for p in source.glob("*.ds"))
    shards = len(list(out.glob("epoch-00000/*.ds")))
    shutil.rmtree(work)
    # scatter reads the source and writes every row with its position; order reads those and writes the epoch
    scratch = result["samples_per_epoch"] * ((SEQ_LEN + 1) * 2 + 8)
    return {"wall": wall, "shards": shards, "files": 2 * tasks * shards, "scatter": (timed["scatter"], data + scratch),
            "order": (timed["order"], scratch + result["samples_per_epoch"] * (SEQ_LEN + 1) * 2)}


def fit(big: dict, small: dict, name: str) -> tuple[float, float]:
    """(seconds per byte, seconds per file) of a pass, from two models with the same files."""
    (t1, b1), (t0, b0) = big[name], small[name]
    per_byte = max(0.0, (t1 - t0) / (b1 - b0))
    return per_byte, max(0.0, (t0 - per_byte * b0) / big["files"])


BOUNDED_TASK_BUDGET = 256 << 20  # small enough that even the smallest corpus shuffles out of core


def bounded_rows(budget_per_task: int = BOUNDED_TASK_BUDGET) -> list[dict]:
    """Plan's figures, and the planning driver's peak RSS, as the corpus grows 1,000x."""
    rows = []
    for tokens in (11 * 10**9, 11 * 10**10, 11 * 10**11, 11 * 10**12):
        docs = tokens // (INCIDENT_TOKENS // INCIDENT_DOCUMENTS)
        code = (f"from packer import ExecutorConfig, plan\n"
                f"r = plan('shuffle', 'virtual:tokens={tokens},documents={docs},dtype=uint16', '/nonexistent/run', "
                f"seq_len={SEQ_LEN}, seed=1, epochs=1, memory={NODES * budget_per_task}, "
                f"executor=ExecutorConfig(executor='slurm', workers={NODES}, tasks={NODES}), disk_mbps=1000)\n"
                f"import json, sys; json.dump(r.to_json(), open(sys.argv[-1], 'w'))")
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            m = run_measured(python_cmd(code) + [f.name], cold=False)
            r = json.loads(Path(f.name).read_text())
        e = r["epochs"][0]
        rows.append({"case": f"{tokens / 1e12:g}T tokens", "path": e["path"], "scatter tasks": e.get("scatter_tasks"),
                     "memory per task MiB": r["passes"][0]["memory_per_task"] / 2**20, "shards": e["shards"],
                     "bucket files": e.get("bucket_files"), "files per folder": e.get("files_per_folder"),
                     "open files per task": 2 * _max_open(), "epoch manifest MB": r["manifests"]["epoch-00000/tokpack.json"] / 1e6,
                     "driver peak RSS MB": m.peak_rss_mb})
    return rows


def _max_open() -> int:
    from shuffle.steps import MAX_OPEN_BUCKET_FILES

    return MAX_OPEN_BUCKET_FILES


def main(size=None, quick: bool = False, *, scale: Fraction = Fraction(1, 2000), node_mbps: float = 2000,
         shared_mbps: float = 40000, work: Path | None = None) -> list[dict]:
    """`size` is not used (bench/run_all.py passes one): the model's size is `scale` of 11T tokens."""
    from loguru import logger

    from packer.planning import measure_disk

    logger.remove()  # datatrove's executor logs every task; the tables are the output here
    scale = Fraction(1, 10**6) if quick else scale
    work = Path(tempfile.mkdtemp(prefix="tokpack-scale-model-", dir=work))
    try:
        disk_mbps, how = measure_disk(work)
        full = full_plan(node_mbps)
        fe = full.epochs[0]
        full_shard_samples = -(-full.samples_per_epoch // fe["shards"])
        tasks = 4 if quick else fe["scatter_tasks"]
        task_budget = full.passes[0]["memory_per_task"]
        models = []
        for s in (scale, scale / 4):
            tokens = int(INCIDENT_TOKENS * s)
            shard_samples = max(1, int(full_shard_samples * s)) if not quick else max(1, tokens // (SEQ_LEN + 1) // 64)
            models.append(run_model(work / f"model-{len(models)}", tokens, tasks, shard_samples, int(task_budget * s)))
        big, small = models
        rows = []
        aggregate = min(NODES * node_mbps, shared_mbps) * 1e6
        total = 0.0
        for i, name in enumerate(("scatter", "order")):
            per_byte, per_file = fit(big, small, name)
            efficiency = min(1.0, 1 / (per_byte * disk_mbps * 1e6)) if per_byte and disk_mbps else 1.0
            moved = full.passes[i]["read_bytes"] + full.passes[i]["written_bytes"]
            seconds = moved / (aggregate * efficiency) + fe["bucket_files"] * per_file * LOCAL_WORKERS / NODES
            total += seconds
            rows.append({"case": name, "model s (scale)": big[name][0], "model s (scale/4)": small[name][0],
                         "model GB": big[name][1] / 1e9, "us per file": per_file * 1e6,
                         "of disk rate": efficiency, "full TB moved": moved / 1e12, "projected s": seconds})
        rows.append({"case": "total", "projected s": total, "full TB moved": sum(r["full TB moved"] for r in rows),
                     "of disk rate": None})
        print(f"{machine_line()}; this disk {disk_mbps} MB/s read+write ({how})")
        print(f"model: {scale} of 11T tokens ({big['shards']:,} shards, {big['files']:,} bucket files, {tasks} scatter "
              f"tasks, --workers {LOCAL_WORKERS}), and {scale / 4}; full run: {fe['shards']:,} shards, "
              f"{fe['bucket_files']:,} bucket files, {NODES} nodes at {node_mbps:g} MB/s each, shared filesystem "
              f"{shared_mbps:g} MB/s")
        print_table(f"scale model: the 11T-token shuffle projected on {NODES} nodes: {total / 60:.1f} min "
                    f"(the incident's pre-shuffle: about {INCIDENT_SECONDS / 60:.0f} min)", rows,
                    ["case", "model s (scale)", "model s (scale/4)", "model GB", "us per file", "of disk rate",
                     "full TB moved", "projected s"])
        bounded = bounded_rows()
        print_table(f"what stays bounded as the corpus grows 1,000x (plan, {BOUNDED_TASK_BUDGET >> 20} MiB a task, "
                    f"{NODES} tasks)", bounded, list(bounded[0]))
        return rows + bounded
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="1/2000", help="fraction of the 11T-token corpus the model shuffles")
    ap.add_argument("--node-mbps", type=float, default=2000, help="each node's disk or network throughput, MB/s")
    ap.add_argument("--shared-mbps", type=float, default=40000, help="the shared filesystem's aggregate throughput, MB/s")
    ap.add_argument("--quick", action="store_true", help="a tiny model (4 tasks, 64 shards): checks that it runs")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default: system temp)")
    a = ap.parse_args()
    main(quick=a.quick, scale=Fraction(a.scale), node_mbps=a.node_mbps, shared_mbps=a.shared_mbps, work=a.work)
