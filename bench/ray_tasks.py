"""What the Ray executor costs a shuffle of many small tasks (issue 27): the same two-epoch
shuffle of a 7 MiB source (2 scatter and 37 order tasks an epoch, --memory 8MiB --workers 2)
through the local executor and through a local Ray cluster started by the command, side by side
with `cp` of the source, in one run. Both outputs must be byte-identical.

    python bench/ray_tasks.py                 # ~1 min on 2 cores
    python bench/ray_tasks.py --runs 3        # the median of 3 of each

The Ray row's time includes starting the local cluster (as a user's command does); "a task"
is (Ray - local) / tasks, the executor's own cost per task beyond the local executor's.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repo, not bench/ (bench/shuffle.py)

from bench.common import (
    REPO,
    cp_sync,
    dir_bytes,
    machine_line,
    make_datatrove_corpus,
    median_of,
    parse_size,
    print_table,
    run_measured,
)

SHUFFLE = ["--seq-len", "2047", "--seed", "1", "--shard-samples", "49", "--epochs", "2", "--memory", "8MiB"]


def tokpack(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokpack.packer.cli", *args]


def same_tree(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    return files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()) and all(
        filecmp.cmp(a / f, b / f, shallow=False) for f in files
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="7MiB")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--work", default=None, help="work folder (default: a temporary one)")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="tokpack-ray-bench-"))
    size = parse_size(args.size)
    corpus = make_datatrove_corpus(work / "corpus", size, files=2)
    source = work / "src"
    run_measured(
        tokpack(
            "pack",
            str(corpus),
            "-o",
            str(source),
            "--eos-id",
            "0",
            "--overwrite",
            "--shard-tokens",
            str(size // 2 // 2 + 1),
        ),
        cwd=str(REPO),
        cold=False,
    )
    tasks = 0
    for line in run_plan(source, work, args.workers):
        tasks += int(line.split("): ")[1].split(" task")[0]) if line.lstrip().startswith("pass ") else 0

    def shuffle(executor: str):
        out = work / f"run-{executor}"

        def once():
            shutil.rmtree(out, ignore_errors=True)
            return run_measured(
                tokpack(
                    "shuffle",
                    str(source),
                    "-o",
                    str(out),
                    *SHUFFLE,
                    "--executor",
                    executor,
                    "--workers",
                    str(args.workers),
                ),
                cwd=str(REPO),
            )

        return median_of(once, args.runs), out

    cp = median_of(lambda: cp_sync(source, work / "cp"), args.runs)
    local, local_out = shuffle("local")
    ray, ray_out = shuffle("ray")
    assert same_tree(local_out, ray_out), "the Ray run's output differs from the local run's"
    per_task = (ray.seconds - local.seconds) / tasks
    rows = [
        {
            "case": f"cp source ({dir_bytes(source) / 2**20:.1f} MiB)",
            "seconds": cp.seconds,
            "x local": None,
            "peak RSS MB": cp.peak_rss_mb,
        },
        {
            "case": f"shuffle --executor local --workers {args.workers}",
            "seconds": local.seconds,
            "x local": 1.0,
            "peak RSS MB": local.peak_rss_mb,
        },
        {
            "case": f"shuffle --executor ray --workers {args.workers}",
            "seconds": ray.seconds,
            "x local": ray.seconds / local.seconds,
            "peak RSS MB": ray.peak_rss_mb,
        },
    ]
    print(f"{machine_line()}; {tasks} tasks over 2 epochs; outputs byte-identical")
    print_table(
        f"Ray vs local, {args.size} source, {' '.join(SHUFFLE)}", rows, ["case", "seconds", "x local", "peak RSS MB"]
    )
    print(
        f"\nRay's cost a task beyond the local executor's: {per_task:.3f} s "
        f"(projection at 20,490 order tasks on {args.workers} worker slots: "
        f"{per_task * 20490 / args.workers / 60:.1f} min)"
    )


def run_plan(source: Path, work: Path, workers: int) -> list[str]:
    import subprocess

    out = subprocess.run(
        tokpack("plan", "shuffle", str(source), "-o", str(work / "plan"), *SHUFFLE, "--workers", str(workers)),
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    return out.stdout.splitlines()


if __name__ == "__main__":
    main()
