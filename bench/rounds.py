"""The exchange's per-byte cost and memory by the size of its rounds (issue 33): `tokpack shuffle
--to-nodes` on 2 processes (a core each), sources in the page cache, DEST in RAM (tmpfs), with
--memory set so that a round moves about 8, 64 or 256 MiB of the tokens a process reads.

    python bench/rounds.py [--size 512MiB] [--runs 5] [--rounds-mib 8,64,256] [--out FILE] [--quick]

Why: bench/nodes.py's per-byte row (the scale model's code rate) runs rounds of about 27 MiB; at
the 11T-token scale a round is gigabytes. This shows whether the rate holds as rounds grow, and
what each process holds beyond --memory (peak RSS minus --memory; exchange.MEMORY_ALLOWANCE is
the bound). Baseline row: `cp` of the same sources into RAM, warm (the copy floor of one pass).
Cases run round-robin; medians quoted, the range beside them; the RSS column is the largest.
--quick (16 MiB, rounds of 1 and 4 MiB, one run) checks that every row runs: bench/run_all.py
--quick runs it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repo, not bench/
from bench.common import (
    dir_bytes,
    machine_line,
    make_datatrove_corpus,
    parse_size,
    print_table,  # noqa: E402
    run_measured,
)
from bench.nodes import (
    K,
    M,
    MODEL_TOKEN_BYTES,
    ROUND_ROOM,
    SEQ_LEN,
    mpi_env,
    mpi_missing,
    mpirun,  # noqa: E402
    rows_memory,
)
from bench.shuffle import pack_corpus  # noqa: E402

from tokpack.packer.node_epoch import TOKEN_OVERHEAD  # noqa: E402

# --memory a round's token byte needs beside the rows kept, as exchange.memory_plan counts it
ROUND_MEMORY_PER_BYTE = (4 * MODEL_TOKEN_BYTES + TOKEN_OVERHEAD) // MODEL_TOKEN_BYTES
SIZE, QUICK_SIZE = "512MiB", "16MiB"
COLUMNS = ["case", "round MiB", "rounds", "MB/s a process", "range", "peak RSS - --memory MB", "note"]


def one(src: Path, ram: Path, memory: int, res: Path) -> list[dict]:
    run = ram / "run"
    cmd = mpirun(
        2,
        "shuffle",
        src,
        "-o",
        run,
        "--to-nodes",
        ram / "node{node}",
        "--ranks-per-node",
        K,
        "--micro-batch",
        M,
        "--seq-len",
        SEQ_LEN,
        "--seed",
        1,
        "--shard-samples",
        2000,
        "--epoch",
        0,
        "--memory",
        memory,
    )
    run_measured(f"{cmd} > {shlex.quote(str(res))}", env=mpi_env(), cold=False)
    lines = [json.loads(x) for x in res.read_text().splitlines() if x.startswith("{")]
    for d in ram.iterdir():
        shutil.rmtree(d)
    if len(lines) != 2:
        raise RuntimeError(f"the exchange printed {len(lines)} results of 2")
    return lines


def main(
    size=None,
    quick: bool = False,
    *,
    runs: int | None = None,
    rounds_mib=None,
    out: Path | None = None,
    work: Path | None = None,
) -> list[dict]:
    why = mpi_missing()
    if why:
        raise SystemExit(f"rounds: {why}")
    size = size or (QUICK_SIZE if quick else SIZE)
    runs = runs or (1 if quick else 5)
    rounds_mib = rounds_mib or ((1, 4) if quick else (8, 64, 256))
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="tokpack-rounds-", dir=work))
    ram = Path(tempfile.mkdtemp(prefix="tokpack-rounds-", dir="/dev/shm" if Path("/dev/shm").is_dir() else work))
    try:
        corpus = make_datatrove_corpus(work / "corpus", size if isinstance(size, int) else parse_size(size), files=32)
        src = pack_corpus(corpus, work / "src")
        shutil.rmtree(corpus)
        token_bytes = dir_bytes(src, ".ds")
        subprocess.run(f"cat {shlex.quote(str(src))}/* > /dev/null", shell=True, check=True)
        base = rows_memory(token_bytes, 2) - ROUND_ROOM  # the rows a process keeps and owns
        memory = {r: base + ROUND_MEMORY_PER_BYTE * (r << 20) for r in rounds_mib}
        got: dict = {r: [] for r in rounds_mib}
        cp: list[float] = []
        cp_seconds: list[float] = []
        for _ in range(runs):
            m = run_measured(f"cp -r {shlex.quote(str(src))} {shlex.quote(str(ram / 'cp'))}", cold=False)
            cp.append(token_bytes / m.seconds / 1e6)
            cp_seconds.append(m.seconds)
            shutil.rmtree(ram / "cp")
            for r in rounds_mib:
                got[r].append(one(src, ram, memory[r], work / "out.json"))
        rows = [
            {
                "case": "cp -r of the sources into RAM, warm",
                "wall s": statistics.median(cp_seconds),
                "round MiB": "",
                "rounds": "",
                "MB/s a process": f"{statistics.median(cp):,.0f}",
                "range": f"{min(cp):,.0f}-{max(cp):,.0f}",
                "peak RSS - --memory MB": "",
                "note": "one process; the copy floor",
            }
        ]
        for r in rounds_mib:
            rates = [
                j["epochs_detail"][0]["tokens_kept"] * 2 / j["epochs_detail"][0]["seconds"] / 1e6
                for lines in got[r]
                for j in lines
            ]
            over = max((j["peak_rss_bytes"] - memory[r]) / 1e6 for lines in got[r] for j in lines)
            rounds = got[r][0][0]["epochs_detail"][0]["rounds"]
            moved = token_bytes / 2 / rounds / 2**20  # a process reads half the sources
            seconds = statistics.median(j["epochs_detail"][0]["seconds"] for lines in got[r] for j in lines)
            rows.append(
                {
                    "case": "exchange, 2 processes",
                    "wall s": seconds,
                    "round MiB": f"{moved:,.0f}",
                    "rounds": rounds,
                    "MB/s a process": f"{statistics.median(rates):,.0f}",
                    "range": f"{min(rates):,.0f}-{max(rates):,.0f}",
                    "peak RSS - --memory MB": f"{over:,.0f}",
                    "note": f"--memory {memory[r] / 2**20:,.0f} MiB; MB/s: its slice's token bytes over its "
                    "epoch seconds (--json)",
                }
            )
    finally:
        shutil.rmtree(ram, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    rows_shown = [{k: v for k, v in r.items() if k != "wall s"} for r in rows]
    title = f"the exchange's per-byte cost by round size ({token_bytes / 2**20:,.0f} MiB, seq_len {SEQ_LEN})"
    notes = [
        f"Machine: {machine_line()}, {time.strftime('%H:%M UTC', time.gmtime())}; {runs} runs, "
        f"cases round-robin, medians; sources cached, DEST in RAM",
        f"Total wall time: {time.perf_counter() - t0:,.0f} s",
    ]
    text = print_table(title, rows_shown, COLUMNS) + "\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    print("\n".join(f"- {n}" for n in notes))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        mib = ",".join(map(str, rounds_mib))
        out.write_text(f"Command: `python bench/rounds.py --size {size} --runs {runs} --rounds-mib {mib}`\n\n{text}")
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default=None, help=f"tokens to generate [default: {SIZE}; --quick: {QUICK_SIZE}]")
    ap.add_argument("--runs", type=int, default=None, help="runs of every case [default: 5; --quick: 1]")
    ap.add_argument("--rounds-mib", default=None, help="round sizes, MiB of tokens a process reads [default: 8,64,256]")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quick", action="store_true", help="a tiny corpus: checks that every row runs")
    a = ap.parse_args()
    main(
        a.size,
        a.quick,
        runs=a.runs,
        rounds_mib=a.rounds_mib and tuple(int(x) for x in a.rounds_mib.split(",")),
        out=a.out,
    )
