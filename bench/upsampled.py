"""An upsampled best-fit epoch against the same epoch with windows (issue 32's cliff).

    python bench/upsampled.py [--runs 3] [--samples 200000]

Two synthetic sources written with the tests' shard writer (tests/conftest.py): `big`, 40,000
documents of 1-600 tokens (12M tokens), and `tiny`, 500 documents (150k tokens). One epoch of
`--samples` samples at seq_len 512, weights 1:1, so `tiny` is drawn about 340 times. Each
case runs in a fresh process, timed inside it (the interpreter's start-up is not in the figure), and reports the
process's CPU seconds, the figure a busy shared machine distorts least, and its wall seconds;
then what `tokpack plan shuffle` predicts. Cases alternate so load drifts hit all alike.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def child(big: str, tiny: str, out: str, samples: str, packing: str) -> None:
    from conftest import shuffle_run

    c, w = time.process_time(), time.perf_counter()
    shuffle_run(
        [big, tiny],
        out,
        weights=["1", "1"],
        seq_len=512,
        seed=1,
        epochs=[0],
        samples=int(samples),
        memory=4 << 30,
        packing=packing,
    )
    print(time.process_time() - c, time.perf_counter() - w)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(*sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=200_000)
    args = ap.parse_args()
    import numpy as np
    from conftest import random_docs, write_source
    from tokpack.packer.api import plan

    work = Path(tempfile.mkdtemp(prefix="tokpack-upsampled-"))
    try:
        rng = np.random.default_rng(4)
        big = write_source(
            work / "big", random_docs(rng, 40_000, 50_000, 0, 1, 600), vocab_size=50_000, docs_per_shard=5_000
        )
        tiny = write_source(
            work / "tiny", random_docs(rng, 500, 50_000, 0, 1, 600), vocab_size=50_000, docs_per_shard=2_000
        )
        times: dict[str, list[tuple[float, float]]] = {"concat": [], "best-fit": []}
        for _ in range(args.runs):
            for packing in times:
                out = work / "run"
                shutil.rmtree(out, ignore_errors=True)
                # a fresh process a run: the packed passes a process keeps would serve the next run
                done = subprocess.run(
                    [sys.executable, __file__, "--child", str(big), str(tiny), str(out), str(args.samples), packing],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                cpu, wall = map(float, done.stdout.split())
                times[packing].append((cpu, wall))
        for packing, t in times.items():
            print(
                f"{packing}: median cpu {statistics.median(x for x, _ in t):.2f} s, "
                f"wall {statistics.median(y for _, y in t):.2f} s ({args.runs} runs)"
            )
        ratio = statistics.median(x for x, _ in times["best-fit"]) / statistics.median(x for x, _ in times["concat"])
        print(f"best-fit / concat (cpu): {ratio:.2f}x")
        got = plan(
            "shuffle",
            {str(big): "1", str(tiny): "1"},
            work / "p",
            seq_len=512,
            seed=1,
            samples=args.samples,
            memory=4 << 30,
            packing="best-fit",
        )
        print(f"plan predicts {got.predicted_seconds} s ({got.startup_seconds} s of it start-up)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
