"""The loader's batch assembly: CPU time a batch, beside a memcpy of the batch's bytes.

    python bench/assembly.py [--baseline DIR] [--rounds 3]

`TokpackDataset(run, micro_batch=m, read_ahead=False)` with no workers, iterated over a whole
epoch of the sample corpus (examples/sample-corpus), a windows epoch and a best-fit one (whose
batches also read their padding), at the smallest batch (128 tokens, m=1: a fixed cost a batch
shows most) and at 1,024 tokens, m=4. Each case is a child process; the figure is the best of 3
passes of its CPU time (`time.process_time`) divided by the batches, in µs. The floor: a copy
of the batch's token bytes from memory (np.copyto), what any loader pays to hand a batch over.

`--baseline DIR`: a checkout of another commit (e.g. `git worktree add /tmp/base REV`); its
code runs the same cases on the same epochs, alternated with this tree's, once per round in a
new order. The table gives each tree's median and range over the rounds, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path[0] = str(
    Path(__file__).resolve().parents[1]
)  # the repo, not bench/, where shuffle.py would hide the shuffle package
from bench.common import REPO, machine_line, print_table  # noqa: E402

SHAPES = ((128, 1), (1024, 4))  # (seq_len, micro_batch)
PACKINGS = ("concat", "best-fit")

CHILD = """
import sys, time
import numpy as np
from tokpack.loader.torch_adapter import TokpackDataset
run, m, floor = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "floor"
best = None
for _ in range(3):
    ds = TokpackDataset(run, micro_batch=m, read_ahead=False, at_end="stop")
    if floor:  # the batch's bytes copied from memory, as many times as there are batches
        batches = sum(1 for _ in TokpackDataset(run, micro_batch=m, read_ahead=False, at_end="stop"))
        src = np.ones((m, ds.reader.row_tokens), ds.reader.dtype)
        dst = np.empty_like(src)
        t = time.process_time()
        for _ in range(batches):
            np.copyto(dst, src)
    else:
        t, batches = time.process_time(), 0
        for _ in ds:
            batches += 1
    us = (time.process_time() - t) / batches * 1e6
    best = us if best is None else min(best, us)
print(best)
"""


def child(tree: Path, run: Path, m: int, floor: bool = False) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree), "TOKPACK_PROGRESS": "0"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(run), str(m), "floor" if floor else "tree"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tree,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def epochs(work: Path) -> dict:
    """One epoch per (packing, shape), shuffled from the sample corpus by this tree's tokpack."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKPACK_PROGRESS": "0"}

    def tokpack(*args):
        subprocess.run(
            [sys.executable, "-m", "tokpack", *map(str, args)], env=env, cwd=REPO, check=True, capture_output=True
        )

    tokpack("pack", REPO / "examples" / "sample-corpus", "-o", work / "src")
    runs = {}
    for packing in PACKINGS:
        for seq_len, m in SHAPES:
            run = work / f"{packing}-{seq_len}"
            tokpack(
                "shuffle",
                work / "src",
                "-o",
                run,
                "--seq-len",
                seq_len,
                "--seed",
                1,
                "--epochs",
                1,
                "--packing",
                packing,
            )
            runs[packing, seq_len, m] = run / "epoch-00000"
    return runs


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, default=None, help="a checkout of another commit, run alternated")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    trees = {"this tree": REPO, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        runs = epochs(Path(tmp))
        got: dict = {}
        for _ in range(args.rounds):
            order = [(name, key) for name in trees for key in runs]
            rng.shuffle(order)  # alternated: a drift of the machine falls on both trees alike
            for name, key in order:
                got.setdefault((name, key), []).append(child(trees[name], runs[key], key[2]))
        rows = []
        for key in runs:
            packing, seq_len, m = key
            mine = got["this tree", key]
            row = {
                "epoch": "windows" if packing == "concat" else packing,
                "batch": f"{m} x {seq_len + 1} tokens",
                "this tree µs": f"{statistics.median(mine):.1f} ({min(mine):.1f}-{max(mine):.1f})",
            }
            if args.baseline:
                base = got["baseline", key]
                row["baseline µs"] = f"{statistics.median(base):.1f} ({min(base):.1f}-{max(base):.1f})"
                row["this / baseline"] = f"{statistics.median(mine) / statistics.median(base):.3f}"
            floor = child(REPO, runs[key], m, floor=True)
            row["memcpy floor µs"] = f"{floor:.2f}"
            rows.append(row)
    print(machine_line())
    print(
        f"Command: python bench/assembly.py{' --baseline ' + str(args.baseline) if args.baseline else ''} --rounds {args.rounds}"
    )
    print_table("The batch assembly, CPU µs a batch (no workers, no read-ahead)", rows, list(rows[0]))
    print(json.dumps({"ok": True, "rows": len(rows)}))
    return rows


if __name__ == "__main__":
    main()
