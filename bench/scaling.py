"""Shuffle scaling: wall time and peak RSS of `tokpack shuffle` at growing corpus sizes with one
fixed --memory, below the smallest corpus, so every size takes the out-of-core path. Linear time
and flat memory show as a straight fitted line (slope in s/GiB) and a small RSS spread.

    python bench/scaling.py [--sizes 0.5GiB,1GiB,2GiB,4GiB,8GiB] [--memory 256MiB] [--quick] [--cap-cache]

--cap-cache runs every timed command of a size in a memory cgroup capped at a third of that
size's data plus --memory and 160 MiB for the process itself (bench/common.cap_page_cache),
page cache included, so the bucket files reach the disk and come back, and times `cp -r && sync` of the source under the same cap: the `x cp`
column is the shuffle's time over that copy's.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path[0] = str(
    Path(__file__).resolve().parents[1]
)  # the repo, not bench/, where shuffle.py would hide the shuffle package
from bench.common import (
    PROCESS_ALLOWANCE,
    Measure,
    dir_bytes,
    make_datatrove_corpus,
    parse_size,
    print_table,
    run_measured,
)  # noqa: E402
from bench.peers import summary_of, tokpack_cmd  # noqa: E402

SIZES = ["0.5GiB", "1GiB", "2GiB", "4GiB", "8GiB"]
QUICK_SIZES = ["2MiB", "4MiB", "8MiB"]
MEMORY = "256MiB"
QUICK_MEMORY = "1MiB"
SEQ_LEN = 4096
COLUMNS = ["section", "case", "wall s", "MB/s", "peak RSS MB", "ratio", "x cp", "note"]


def make_source(
    corpus: Path, out: Path, eos_id: int = 0, vocab_size: int = 50257, use_pack: bool = True
) -> tuple[Path, str]:
    """A packed source of the datatrove `corpus` (untimed preparation): with `tokpack pack`
    when asked and it works, otherwise written directly with the project's shard writer, one
    shard per .ds file, in blocks that end on document boundaries."""
    reason = "the shuffle is what is measured"
    if use_pack:
        shutil.rmtree(out, ignore_errors=True)
        try:
            run_measured(
                tokpack_cmd(
                    "pack",
                    str(corpus),
                    "-o",
                    str(out),
                    "--format",
                    "datatrove",
                    "--eos-id",
                    str(eos_id),
                    "--vocab-size",
                    str(vocab_size),
                ),
                cold=False,
            )
            return out, "source from tokpack pack"
        except RuntimeError as e:
            reason = "tokpack pack failed: " + str(e).strip().splitlines()[-1][:120]
    from tokpack.formats.names import shard_name
    from tokpack.formats.reading import write_manifest
    from tokpack.formats.shards import SourceShardWriter
    from tokpack.formats.builders import source_manifest

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    dtype = np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")
    entries = []
    for i, f in enumerate(sorted(Path(corpus).glob("*.ds"))):
        tokens = np.memmap(f, dtype=dtype, mode="r")
        ends = np.fromfile(f"{f}.index", dtype="<u8").astype(np.int64)
        w = SourceShardWriter(out, shard_name(i), dtype, "gpt2")
        lo, first = 0, 0
        while first < len(ends):  # ~32 Mi tokens per write, cut after a document
            last = int(np.searchsorted(ends, lo + (32 << 20), side="right"))
            last = max(last, first + 1)
            w.write(np.asarray(tokens[lo : ends[last - 1]]), ends[first:last] - lo)
            lo, first = int(ends[last - 1]), last
        entries.append(w.close())
        del tokens
    write_manifest(out, source_manifest(entries, dtype, vocab_size, eos_id, "gpt2"))
    return out, f"source written directly ({reason})"


def shuffle_once(source: Path, out: Path, memory: int, seq_len: int, result: Path, cold: bool) -> Measure:
    shutil.rmtree(out, ignore_errors=True)
    m = run_measured(
        tokpack_cmd(
            "shuffle",
            str(source),
            "-o",
            str(out),
            "--seq-len",
            str(seq_len),
            "--seed",
            "0",
            "--epochs",
            "1",
            "--memory",
            str(memory),
            result=result,
        ),
        cold=cold,
    )
    return m


def fit(sizes_gib: list[float], seconds: list[float]) -> tuple[float, float, float]:
    """Least-squares line seconds = slope * GiB + intercept, and its R^2."""
    x, y = np.asarray(sizes_gib, float), np.asarray(seconds, float)
    slope, intercept = np.polyfit(x, y, 1)
    pred = slope * x + intercept
    ss = float(((y - y.mean()) ** 2).sum())
    r2 = 1 - float(((y - pred) ** 2).sum()) / ss if ss > 0 else 1.0
    return float(slope), float(intercept), r2


def main(
    size=None,
    quick: bool = False,
    *,
    sizes: list[str] | None = None,
    memory: str | None = None,
    runs: int | None = None,
    work: Path | None = None,
    cold: bool | None = None,
    seq_len: int = SEQ_LEN,
    cap_cache: bool = False,
) -> list[dict]:
    """Rows for each corpus size plus one fit row. `size` is ignored (the sizes are fixed by the
    issue); it is accepted so run_all can call every bench script the same way."""
    from bench.common import can_drop_caches, cap_page_cache

    sizes = sizes or (QUICK_SIZES if quick else SIZES)
    memory_b = parse_size(memory or (QUICK_MEMORY if quick else MEMORY))
    runs = runs or (1 if quick else 3)
    cold = can_drop_caches() if cold is None else cold
    own = work is None
    work = Path(work or tempfile.mkdtemp(prefix="tokpack-scaling-"))
    rows, xs, ys, rss = [], [], [], []
    try:
        for text in sizes:
            nbytes = parse_size(text)
            corpus = make_datatrove_corpus(work / f"corpus-{text}", nbytes, seed=1)
            source, note = make_source(corpus, work / f"source-{text}", use_pack=False)
            token_bytes = dir_bytes(corpus, ".ds")
            shutil.rmtree(corpus)
            measures, path, copy = [], "?", None
            try:
                if cap_cache:
                    # the process's own memory counts against a cgroup's limit: it gets --memory plus
                    # an interpreter's worth on top, so the page cache is what holds a third of the data
                    capped = cap_page_cache(dir_bytes(source, ".ds") // 3 + memory_b + PROCESS_ALLOWANCE)
                    copies = []
                    for _ in range(runs):
                        copies.append(run_measured(f"cp -r '{source}' '{work / 'copy'}' && sync", cold=cold).seconds)
                        shutil.rmtree(work / "copy", ignore_errors=True)
                    copy = statistics.median(copies)
                for _ in range(runs):
                    measures.append(shuffle_once(source, work / "out", memory_b, seq_len, work / "result.json", cold))
                    path = summary_of(work / "result.json").get("path", "?")
                    shutil.rmtree(work / "out", ignore_errors=True)
                sec = statistics.median(m.seconds for m in measures)
                peak = max(m.peak_rss_mb for m in measures)
                xs.append(nbytes / 2**30)
                ys.append(sec)
                rss.append(peak)
                rows.append(
                    {
                        "section": "scaling",
                        "case": f"shuffle {text}",
                        "wall s": sec,
                        "MB/s": token_bytes / 1e6 / sec,
                        "peak RSS MB": peak,
                        "ratio": None,
                        "x cp": sec / copy if copy else None,
                        "note": f"--memory {memory or (QUICK_MEMORY if quick else MEMORY)}, {path}, "
                        f"median of {runs}; {note}" + (f"; {capped}" if copy else ""),
                        "_required": True,
                    }
                )
            except Exception as e:  # one size failing must not hide the others
                rows.append(
                    {
                        "section": "scaling",
                        "case": f"shuffle {text}",
                        "wall s": None,
                        "note": f"FAILED: {str(e).strip().splitlines()[-1][:200]}",
                        "_required": True,
                    }
                )
            shutil.rmtree(source, ignore_errors=True)
        if len(xs) >= 2:
            slope, intercept, r2 = fit(xs, ys)
            for r, x, y in zip([r for r in rows if r.get("wall s") is not None], xs, ys):
                r["ratio"] = y / (slope * x + intercept)  # measured / fitted line: 1.0 = on the line
            rows.append(
                {
                    "section": "scaling",
                    "case": "fit",
                    "wall s": None,
                    "MB/s": None,
                    "peak RSS MB": max(rss),
                    "ratio": None,
                    "_required": False,
                    "note": f"slope {slope:.2f} s/GiB, intercept {intercept:.2f} s, R^2 {r2:.3f}; "
                    f"RSS spread {max(rss) - min(rss):.1f} MB ({min(rss):.0f}-{max(rss):.0f}); "
                    f"ratio = wall / the fitted line",
                }
            )
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=None, help=f"comma-separated corpus sizes [default: {','.join(SIZES)}]")
    ap.add_argument("--memory", default=None, help=f"fixed --memory for every size [default: {MEMORY}]")
    ap.add_argument("--size", default=None, help="ignored; for a uniform interface with the other bench scripts")
    ap.add_argument("--quick", action="store_true", help=f"tiny sizes ({','.join(QUICK_SIZES)}), one run")
    ap.add_argument(
        "--cap-cache",
        action="store_true",
        help="cap each timed command's page cache and memory at a third of the size's data (memory cgroup)",
    )
    args = ap.parse_args()
    out = main(
        args.size,
        args.quick,
        sizes=args.sizes.split(",") if args.sizes else None,
        memory=args.memory,
        cap_cache=args.cap_cache,
    )
    print_table("shuffle scaling", out, COLUMNS)
    sys.exit(1 if any(r["_required"] and r.get("wall s") is None for r in out) else 0)
