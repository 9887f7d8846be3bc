"""tokpack shuffle against the physical floor and its peers, side by side in one run.

    python bench/shuffle.py [--size 2GiB] [--seq-len 2047] [--runs 5] [--quick]

Rows (each in a child process, page cache dropped first when running as root):
  cold read        every input file read sequentially once (the floor for one read)
  cp -r + sync     one read and one write of the data (the floor of the in-memory path)
  cp twice + sync  (--cap-cache only) cp -r, sync, cp -r of the copy, sync: two reads and two
                   writes, the floor of the out-of-core path on this disk under the same cap
  tokpack (in memory)     --memory large enough for every window: one read, one write
  tokpack (out of core)   --memory = 1/8 of the data: scatter + order, two reads and two writes
  datatrove merger        DocumentTokenizerMerger(shuffle=True): interleaves documents only,
                          no window cutting and no global window shuffle
  HF datasets             shuffle(seed).flatten_indices().save_to_disk() over the same windows
Goals from issue 3: in memory <= 1.3x cp+sync, out of core <= 2.3x, peak RSS <= --memory + 200 MB.

    python bench/shuffle.py --cap-cache [--size 2GiB]

runs every timed command in a memory cgroup capped at a third of the data (page cache
included), so the out-of-core path's bucket files must reach the disk and be read back, as on
a corpus larger than RAM. Rows: cold read, cp -r + sync, cp twice + sync (the floor) and the
out-of-core shuffle under the same cap (the in-memory path and the peers need more than the
cap); the "x floor" column is each case's per-round ratio to cp twice + sync. Goal from
issue 14: out of core <= 1.5x cp -r + sync under the cap.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path[0] = str(
    Path(__file__).resolve().parents[1]
)  # the repo, not bench/, where shuffle.py would hide the shuffle package
from bench import common  # noqa: E402
from bench.common import (
    REPO,
    cold_read,
    cp_sync,
    cp_twice_sync,
    make_datatrove_corpus,
    parse_size,
    print_table,
    run_measured,
)  # noqa: E402
from bench.peers import datatrove_merger_cmd, hf_shuffle_cmd, missing, prepare_hf_windows  # noqa: E402

FLOOR = "cp twice + sync"
COLUMNS = [
    "case",
    "seconds",
    "x cp+sync",
    "range",
    "x floor",
    "MB/s",
    "peak RSS MB",
    "--memory MB",
    "RSS - memory MB",
    "goal",
    "note",
]


def pack_corpus(corpus: Path, out: Path, vocab_size: int = 50257, eos_id: int = 0) -> Path:
    """The datatrove corpus as a tokpack packed source, one shard per .ds file (untimed setup;
    written with the project's shard writer so this bench does not depend on `pack`)."""
    from tokpack.formats.shards import SourceShardWriter
    from tokpack.formats.builders import source_manifest
    from tokpack.formats.reading import write_manifest
    from tokpack.formats.names import shard_name

    out.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype("<u2")
    entries = []
    for i, f in enumerate(sorted(corpus.glob("*.ds"))):
        w = SourceShardWriter(out, shard_name(i), dtype, "gpt2")
        w.write(np.fromfile(f, dtype=dtype), np.fromfile(f"{f}.index", dtype="<u8"))
        entries.append(w.close())
    write_manifest(out, source_manifest(entries, dtype, vocab_size, eos_id, "gpt2"))
    return out


def tokpack_cmd(source: Path, out: Path, seq_len: int, memory: int, workers: int = 1) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tokpack.packer.cli",
        "shuffle",
        str(source),
        "-o",
        str(out),
        "--seq-len",
        str(seq_len),
        "--seed",
        "1",
        "--epochs",
        "1",
        "--memory",
        str(memory),
        "--workers",
        str(workers),
        "--json",
    ]


def synced(cmd: list[str]) -> str:
    """Every writer is timed up to its data being on disk, as cp + sync is."""
    return f"{shlex.join(cmd)} && sync"


def main(
    size: int | str = "2GiB",
    quick: bool = False,
    seq_len: int = 2047,
    workdir: str | None = None,
    runs: int = 1,
    cap_cache: bool = False,
) -> list[dict]:
    """Builds the corpus, runs every case `runs` times round robin, prints and returns the rows
    (median seconds, largest peak RSS). --quick: a tiny corpus, to check that every row runs."""
    size = parse_size(size) if isinstance(size, str) else int(size)
    if quick:
        size, runs = min(size, 16 << 20), 1
    tmp = Path(tempfile.mkdtemp(prefix="tokpack-bench-shuffle-", dir=workdir))
    try:
        corpus = make_datatrove_corpus(tmp / "corpus", size, files=4)
        source = pack_corpus(corpus, tmp / "source")
        data = common.dir_bytes(source, ".ds")
        in_mem = int(data * 1.1) + (64 << 20)
        ooc = max(1 << 20, data // 8)
        # a third of the data, which holds the process too; never below what the process needs
        # (a tiny --quick corpus would get a cap that kills the interpreter)
        capped = common.cap_page_cache(max(data // 3, ooc + common.PROCESS_ALLOWANCE)) if cap_cache else None
        cases = [  # (case, command or callable, --memory, note, output to remove after each run)
            ("cold read", lambda: cold_read(source), None, "", None),
            ("cp -r + sync", lambda: cp_sync(source, tmp / "copy"), None, "", tmp / "copy"),
            (
                FLOOR,
                lambda: cp_twice_sync(source, tmp / "copy", tmp / "copy2"),
                None,
                "two reads, two writes: the out-of-core floor",
                tmp / "copy2",
            ),
            (
                "tokpack shuffle (in memory)",
                synced(tokpack_cmd(source, tmp / "epochs", seq_len, in_mem)),
                in_mem,
                "one read, one write",
                tmp / "epochs",
            ),
            (
                "tokpack shuffle (out of core, --memory = data/8)",
                synced(tokpack_cmd(source, tmp / "epochs", seq_len, ooc)),
                ooc,
                "two reads, two writes",
                tmp / "epochs",
            ),
            (
                "datatrove DocumentTokenizerMerger(shuffle=True)",
                synced(datatrove_merger_cmd(corpus, tmp / "merged")),
                None,
                "interleaves whole documents; no windows, no global shuffle",
                tmp / "merged",
            ),
        ]
        if capped:  # the in-memory path and the peers hold more than the cap
            cases = [c for c in cases if c[0] in ("cold read", "cp -r + sync", FLOOR) or "out of core" in c[0]]
        else:
            cases = [c for c in cases if c[0] != FLOOR]
        why = "not run under the cache cap" if capped else missing("datasets")
        if why is None:
            arrow = prepare_hf_windows(corpus, tmp / "windows.arrow", seq_len)
            cases.append(
                (
                    "HF datasets shuffle().flatten_indices().save_to_disk()",
                    synced(hf_shuffle_cmd(arrow, tmp / "hf", tmp / "hf-cache.arrow")),
                    None,
                    "same windows",
                    tmp / "hf",
                )
            )

        def timed(cmd, out):
            def run():
                m = cmd() if callable(cmd) else run_measured(cmd, cwd=str(REPO))
                for junk in (out, tmp / "hf-cache.arrow"):
                    if junk is not None and junk.exists():
                        shutil.rmtree(junk) if junk.is_dir() else junk.unlink()
                return m

            return run

        measures = common.alternate([(case, timed(cmd, out)) for case, cmd, _mem, _note, out in cases], runs)
        rows = []
        for case, _cmd, memory, note, _out in cases:
            ms = measures[case]
            r = {
                "case": case,
                "seconds": statistics.median(m.seconds for m in ms),
                "peak RSS MB": max(m.peak_rss_mb for m in ms),
                "note": note,
            }
            r["MB/s"] = data / 1e6 / r["seconds"]
            if memory:
                r["--memory MB"] = memory / 2**20
                r["RSS - memory MB"] = r["peak RSS MB"] - memory / 2**20
            rows.append(r)
        if why is not None:
            rows.append({"case": "HF datasets shuffle().flatten_indices().save_to_disk()", "note": why})
        for r in rows:
            if r.get("seconds"):
                ratio, lo, hi = common.paired_ratio(measures[r["case"]], measures["cp -r + sync"])
                r["x cp+sync"], r["range"] = ratio, common.ratio_range(lo, hi)
                if FLOOR in measures:
                    ratio, lo, hi = common.paired_ratio(measures[r["case"]], measures[FLOOR])
                    r["x floor"] = f"{ratio:.2f} ({common.ratio_range(lo, hi)})"
            if r["case"].startswith("tokpack"):
                limit = 1.3 if "in memory" in r["case"] else 1.5 if capped else 2.3
                slack = 100 if capped else 200  # issue 14 asks for --memory + 100 MB, issue 3 for + 200 MB
                ok = r["x cp+sync"] <= limit and r["RSS - memory MB"] <= slack
                r["goal"] = f"<= {limit}x, RSS <= mem+{slack}MB: {'met' if ok else 'MISSED'}"
        cache = "page cache dropped before each run" if common.can_drop_caches() else "WARM page cache (not root)"
        cache += f"; {capped}" if capped else ""
        print_table(
            f"shuffle, {data / 2**20:.0f} MiB of tokens, seq_len {seq_len}, {runs} rounds, medians and "
            f"median per-round ratio to cp; "
            f"{common.machine_line()}; {cache}",
            rows,
            COLUMNS if capped else [c for c in COLUMNS if c != "x floor"],
        )
        return rows
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GiB", help="generated corpus size (default 2GiB)")
    ap.add_argument("--seq-len", type=int, default=2047)
    ap.add_argument("--workdir", default=None, help="where to put the temporary corpus (default: $TMPDIR)")
    ap.add_argument("--runs", type=int, default=5, help="rounds, every case once per round; the table quotes medians")
    ap.add_argument("--quick", action="store_true", help="16 MiB corpus, one run: checks that every row runs")
    ap.add_argument(
        "--cap-cache",
        action="store_true",
        help="cap each timed command's page cache and memory at a third of the data (memory cgroup)",
    )
    a = ap.parse_args()
    main(a.size, quick=a.quick, seq_len=a.seq_len, workdir=a.workdir, runs=a.runs, cap_cache=a.cap_cache)
