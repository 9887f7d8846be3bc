"""`tokpack plan` against the run it plans, in one run: a pack of Parquet input and a shuffle of
a two-stage schedule. For each, the plan's predicted tokens, shards, bytes written and wall time
next to what the command then did (timed cold, as a child process, with peak RSS), and `cp -r` +
`sync` of the same input as the physical baseline. The plan measures the disk itself (no
--disk-mbps), as a user's would.

    python bench/plan_vs_actual.py [--size 512MiB] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path[0] = str(
    Path(__file__).resolve().parents[1]
)  # the repo, not bench/, where shuffle.py would hide the shuffle package
from bench.common import (
    REPO,
    cp_sync,
    dir_bytes,
    machine_line,
    make_datatrove_corpus,
    parse_size,
    print_table,
    run_measured,
)  # noqa: E402
from bench.pack import make_parquet  # noqa: E402

SIZE = "512MiB"
SEQ_LEN = 2047
MEMORY = "96MiB"  # well under an epoch's windows: the shuffle runs out of core


def tokpack(*args) -> list[str]:
    return [sys.executable, "-m", "tokpack.packer.cli", *map(str, args)]


def plan_json(*args) -> dict:
    out = subprocess.run(tokpack("plan", *args, "--json"), cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def manifest(path: Path) -> dict:
    return json.loads((path / "tokpack.json").read_text())


def rows(case: str, planned: dict, tokens: int, shards: int, written: int, measure, baseline) -> list[dict]:
    predicted_tokens = planned["predicted_tokens"]
    return [
        {
            "case": case,
            "quantity": "tokens",
            "predicted": f"{predicted_tokens:,}",
            "measured": f"{tokens:,}",
            "ratio": round(predicted_tokens / tokens, 3),
        },
        {
            "case": case,
            "quantity": "shards",
            "predicted": planned["shards"],
            "measured": shards,
            "ratio": round(planned["shards"] / shards, 3),
        },
        {
            "case": case,
            "quantity": "bytes written",
            "predicted": f"{planned['written']:,}",
            "measured": f"{written:,}",
            "ratio": round(planned["written"] / written, 3),
        },
        {
            "case": case,
            "quantity": "seconds",
            "predicted": planned["predicted_seconds"],
            "measured": round(measure.seconds, 2),
            "ratio": round(planned["predicted_seconds"] / measure.seconds, 3),
            "note": f"disk {planned['disk_mbps']} MB/s measured by plan; peak RSS {measure.peak_rss_mb:.0f} MB; "
            f"cp -r + sync of the input {baseline.seconds:.2f} s",
        },
    ]


def parquet_case(root: Path, size: int) -> list[dict]:
    dt = make_datatrove_corpus(root / "dt", size, files=2)
    pq = make_parquet(dt, root / "pq")
    shutil.rmtree(dt)
    args = [pq, "-o", root / "packed", "--eos-id", 0, "--vocab-size", 50257, "--workers", 2]
    planned = plan_json("pack", *args)
    (p,) = planned["passes"]
    planned.update(
        written=p["written_bytes"], predicted_tokens=p["written_bytes"] // 2
    )  # uint16 output: the planned bytes are its tokens
    baseline = cp_sync(pq, root / "pq-copy")
    shutil.rmtree(root / "pq-copy")
    measure = run_measured(" ".join(map(str, tokpack("pack", *args))) + " && sync", cwd=str(REPO))
    m = manifest(root / "packed")
    return rows(
        "pack Parquet list<uint16>",
        planned,
        m["tokens"],
        len(m["shards"]),
        dir_bytes(root / "packed", ".ds"),
        measure,
        baseline,
    )


def schedule_case(root: Path, size: int) -> list[dict]:
    names = {"web": 0.6, "code": 0.25, "math": 0.15}
    for k, (name, share) in enumerate(names.items()):
        dt = make_datatrove_corpus(root / f"dt-{name}", int(size * share), files=1, seed=k)
        subprocess.run(
            tokpack("pack", dt, "-o", root / "src" / name, "--eos-id", 0, "--vocab-size", 50257),
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        shutil.rmtree(dt)
    tokens = size // 2
    (root / "run.yaml").write_text(
        f"seq_len: {SEQ_LEN}\nseed: 1\nstages:\n"
        f"  - name: stable\n    tokens: {int(tokens * 0.8)}\n    sources: {{src/web: 0.7, src/code: 0.25, src/math: 0.05}}\n"
        f"  - name: decay\n    tokens: {int(tokens * 0.4)}\n    sources: {{src/web: 0.4, src/code: 0.3, src/math: 0.3}}\n"
    )
    args = ["--schedule", root / "run.yaml", "-o", root / "run", "--memory", MEMORY, "--workers", 2]
    planned = plan_json("shuffle", *args)
    samples = sum(e["samples"] for e in planned["epochs"])
    planned.update(written=sum(e["output_bytes"] for e in planned["epochs"]), predicted_tokens=samples * (SEQ_LEN + 1))
    baseline = cp_sync(root / "src", root / "src-copy")
    shutil.rmtree(root / "src-copy")
    measure = run_measured(" ".join(map(str, tokpack("shuffle", *args))) + " && sync", cwd=str(REPO))
    epochs = [manifest(p) for p in sorted((root / "run").glob("epoch-*"))]
    return rows(
        "shuffle 2-stage schedule",
        planned,
        sum(e["tokens"] for e in epochs),
        sum(len(e["shards"]) for e in epochs),
        sum(p.stat().st_size for p in (root / "run").rglob("*") if p.is_file()),
        measure,
        baseline,
    )


def main(size: int, workdir: str | None) -> list[dict]:
    root = Path(tempfile.mkdtemp(prefix="tokpack-bench-plan-", dir=workdir))
    try:
        results = parquet_case(root / "parquet", size) + schedule_case(root / "schedule", size)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    print_table(
        f"plan vs actual ({size / 2**20:,.0f} MiB of input per case; {machine_line()}; load average {load} at the end)",
        results,
        ["case", "quantity", "predicted", "measured", "ratio", "note"],
    )
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default=SIZE, help=f"input size per case (default {SIZE})")
    ap.add_argument("--workdir", default=None, help="where to generate the corpora (default: the temp dir)")
    a = ap.parse_args()
    main(parse_size(a.size), a.workdir)
