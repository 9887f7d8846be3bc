"""`tokpack pack` against the physical baseline, `cp -r` + `sync` of the same input files,
in one run. Both are timed cold (page cache dropped first when running as root), as child
processes, alternating cp and pack for --runs rounds; the ratio is the median of the
per-round ratios, with their range. Pack's time includes a `sync`, so its written data is on disk
like cp's. Goal (issue 2): pack <= 1.3x cp on >= 2 GiB of datatrove input.

Cases: datatrove uint16 and uint32 folders (bench/common.make_datatrove_corpus); the uint16
corpus also as Megatron .bin/.idx (the .bin hard-links the .ds: same bytes) and as Parquet
list<uint16> (uncompressed, written once, untimed).

    python bench/pack.py [--size 2GiB] [--runs 5] [--workers 1] [--quick]

`--link` runs the other section instead (issue 35): on one datatrove uint16 corpus, `tokpack
pack` (a copy), `tokpack pack --link` (hard links, once the scan verifies them), `cp -r` and
`cp -rl`, each followed by a `sync`, alternating for --runs rounds (default 3); it shows the
median time and the bytes each leaves new on the disk (files with one link only).

    python bench/pack.py --link [--size 1.5GiB] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path[0] = str(
    Path(__file__).resolve().parents[1]
)  # the repo, not bench/, where shuffle.py would hide the shuffle package
from bench.common import (
    REPO,
    alternate,
    can_drop_caches,
    cp_sync,
    dir_bytes,
    machine_line,
    make_datatrove_corpus,  # noqa: E402
    paired_ratio,
    parse_size,
    print_table,
    ratio_range,
    run_measured,
)

COLUMNS = ["case", "GB", "seconds", "MB/s", "peak RSS MB", "ratio to cp", "ratio range", "ratio excl. start-up"]
SIZE = "2GiB"
QUICK_SIZE = "64MiB"


def make_megatron(dt: Path, out: Path) -> Path:
    """The datatrove uint16 corpus as Megatron files: dtype code 8, one sequence per document."""
    out.mkdir(parents=True, exist_ok=True)
    for ds in sorted(dt.glob("*.ds")):
        prefix = out / ds.stem
        os.link(ds, f"{prefix}.bin")
        ends = np.fromfile(f"{ds}.index", dtype="<u8").astype(np.int64)
        sizes = np.diff(ends, prepend=0)
        with open(f"{prefix}.idx", "wb") as f:
            f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(sizes), len(sizes) + 1))
            f.write(sizes.astype("<i4").tobytes())
            f.write(((ends - sizes) * 2).astype("<i8").tobytes())
            f.write(np.arange(len(sizes) + 1, dtype="<i8").tobytes())
    return out


def make_parquet(dt: Path, out: Path, rows_per_group: int = 16384) -> Path:
    """The datatrove uint16 corpus as uncompressed Parquet, one file per .ds, row group by row group."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    schema = pa.schema({"input_ids": pa.list_(pa.uint16())})
    for ds in sorted(dt.glob("*.ds")):
        tokens = np.memmap(ds, dtype="<u2", mode="r")
        ends = np.fromfile(f"{ds}.index", dtype="<u8").astype(np.int64)
        with pq.ParquetWriter(out / f"{ds.stem}.parquet", schema, compression="none") as w:
            for i in range(0, len(ends), rows_per_group):
                e = ends[i : i + rows_per_group]
                start = int(ends[i - 1]) if i else 0
                offsets = np.concatenate([[0], e - start]).astype(np.int32)
                values = pa.array(np.asarray(tokens[start : int(e[-1])]))
                w.write_table(pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), values)}))
    return out


def pack_cmd(src: Path, dst: Path, workers: int, extra: list[str]) -> str:
    args = [
        sys.executable,
        "-m",
        "tokpack.packer.cli",
        "pack",
        str(src),
        "-o",
        str(dst),
        "--workers",
        str(workers),
        "--json",
        *extra,
    ]
    return f"cd {shlex.quote(str(REPO))} && {' '.join(shlex.quote(a) for a in args)} > /dev/null && sync"


def timed(fn, runs: int):
    results = [fn() for _ in range(runs)]
    return statistics.median(r.seconds for r in results), max(r.peak_rss_mb for r in results)


def main(
    size: str | int = SIZE, quick: bool = False, runs: int = 5, workers: int = 1, workdir: str | None = None
) -> list[dict]:
    total = parse_size(QUICK_SIZE if quick else size) if isinstance(size, str) or quick else size
    runs = 1 if quick else runs
    root = Path(tempfile.mkdtemp(prefix="tokpack-bench-pack-", dir=workdir))
    rows = []
    try:
        dt16 = make_datatrove_corpus(root / "dt16", total, token_size=2, files=4)
        dt32 = make_datatrove_corpus(root / "dt32", total, token_size=4, files=4)
        cases = [
            ("datatrove uint16", dt16, ["--eos-id", "0"]),
            ("datatrove uint32", dt32, ["--eos-id", "0"]),
            ("megatron uint16", make_megatron(dt16, root / "mg"), ["--eos-id", "0", "--vocab-size", "50257"]),
            ("parquet list<uint16>", make_parquet(dt16, root / "pq"), ["--eos-id", "0", "--vocab-size", "50257"]),
        ]
        # Fixed cost of any `tokpack pack`: interpreter, datatrove's executor imports, its worker
        # manager. Measured on a 1 MiB input and shown so the per-byte cost can be read apart.
        tiny = make_datatrove_corpus(root / "tiny", 1 << 20, token_size=2, files=1)
        startup, _ = timed(
            lambda: (
                shutil.rmtree(root / "tiny-out", ignore_errors=True),
                run_measured(pack_cmd(tiny, root / "tiny-out", workers, ["--eos-id", "0"])),
            )[1],
            runs,
        )
        rows.append({"case": "tokpack pack start-up (1 MiB input)", "GB": 0.001, "seconds": startup})
        for name, src, extra in cases:
            nbytes = dir_bytes(src)
            dst = root / "out"

            def one_pack():
                shutil.rmtree(dst, ignore_errors=True)
                return run_measured(pack_cmd(src, dst, workers, extra))

            res = alternate([("cp", lambda: cp_sync(src, root / "cp")), ("pack", one_pack)], runs)
            shutil.rmtree(root / "cp", ignore_errors=True)
            shutil.rmtree(dst, ignore_errors=True)
            cp_s = statistics.median(m.seconds for m in res["cp"])
            pk_s = statistics.median(m.seconds for m in res["pack"])
            ratio, lo, hi = paired_ratio(res["pack"], res["cp"])
            no_start = statistics.median(
                max(p.seconds - startup, 0) / c.seconds for p, c in zip(res["pack"], res["cp"])
            )
            gb = nbytes / 1e9
            rows.append(
                {
                    "case": f"cp -r + sync ({name})",
                    "GB": gb,
                    "seconds": cp_s,
                    "MB/s": nbytes / 1e6 / cp_s,
                    "peak RSS MB": max(m.peak_rss_mb for m in res["cp"]),
                    "ratio to cp": 1.0,
                }
            )
            rows.append(
                {
                    "case": f"tokpack pack {name}" + (f" --workers {workers}" if workers > 1 else ""),
                    "GB": gb,
                    "seconds": pk_s,
                    "MB/s": nbytes / 1e6 / pk_s,
                    "peak RSS MB": max(m.peak_rss_mb for m in res["pack"]),
                    "ratio to cp": ratio,
                    "ratio range": ratio_range(lo, hi),
                    "ratio excl. start-up": no_start,
                }
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


LINK_COLUMNS = ["case", "GB", "seconds", "MB/s", "peak RSS MB", "ratio to cp -r", "ratio range", "new bytes on disk GB"]
LINK_SIZE = "1.5GiB"


def new_bytes(folder: Path) -> int:
    """Bytes of the files under `folder` that share their inode with no other name: what it
    added to the disk (a hard link adds nothing)."""
    return sum(p.stat().st_blocks * 512 for p in Path(folder).rglob("*") if p.is_file() and p.stat().st_nlink == 1)


def link_main(
    size: str | int = LINK_SIZE, quick: bool = False, runs: int = 3, workers: int = 1, workdir: str | None = None
) -> list[dict]:
    total = parse_size(QUICK_SIZE if quick else size) if isinstance(size, str) or quick else size
    runs = 1 if quick else runs
    root = Path(tempfile.mkdtemp(prefix="tokpack-bench-link-", dir=workdir))
    try:
        src = make_datatrove_corpus(root / "dt16", total, token_size=2, files=4)
        nbytes, dst = dir_bytes(src), root / "out"
        added: dict[str, int] = {}

        def case(name: str, cmd: str):
            def one():
                shutil.rmtree(dst, ignore_errors=True)
                m = run_measured(cmd)
                added[name] = new_bytes(dst)
                return m

            return name, one

        q = shlex.quote
        res = alternate(
            [
                case("cp -r", f"cp -r {q(str(src))} {q(str(dst))} && sync"),
                case("cp -rl", f"cp -rl {q(str(src))} {q(str(dst))} && sync"),
                case("tokpack pack", pack_cmd(src, dst, workers, ["--eos-id", "0"])),
                case("tokpack pack --link", pack_cmd(src, dst, workers, ["--eos-id", "0", "--link"])),
            ],
            runs,
        )
        shutil.rmtree(dst, ignore_errors=True)
        rows = []
        for name, measures in res.items():
            secs = statistics.median(m.seconds for m in measures)
            ratio, lo, hi = paired_ratio(measures, res["cp -r"])
            rows.append(
                {
                    "case": name + (" + sync" if name.startswith("cp") else ""),
                    "GB": nbytes / 1e9,
                    "seconds": secs,
                    "MB/s": nbytes / 1e6 / secs,
                    "peak RSS MB": max(m.peak_rss_mb for m in measures),
                    "ratio to cp -r": ratio,
                    "ratio range": ratio_range(lo, hi),
                    "new bytes on disk GB": added[name] / 1e9,
                }
            )
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default=SIZE, help="corpus size per case, e.g. 2GiB (default)")
    ap.add_argument("--runs", type=int, default=5, help="rounds of cp and pack, alternating; medians are shown")
    ap.add_argument("--workers", type=int, default=1, help="tokpack pack --workers")
    ap.add_argument("--workdir", default=None, help="where to generate the corpora (default: the temp dir)")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_SIZE}, one run")
    ap.add_argument("--link", action="store_true", help="pack, pack --link, cp -r and cp -rl instead (see above)")
    a = ap.parse_args()
    if a.link:
        size = a.size if a.size != SIZE else LINK_SIZE
        runs = a.runs if a.runs != 5 else 3
        rows = link_main(size, quick=a.quick, runs=runs, workers=a.workers, workdir=a.workdir)
        cache = (
            "cold (page cache dropped before each run)" if can_drop_caches() else "warm (not root: cannot drop caches)"
        )
        print(f"{machine_line()}; {cache}; {1 if a.quick else runs} alternating rounds")
        print_table(
            f"tokpack pack --link vs cp ({size if not a.quick else QUICK_SIZE} of datatrove uint16)", rows, LINK_COLUMNS
        )
        sys.exit(0)
    rows = main(a.size, quick=a.quick, runs=a.runs, workers=a.workers, workdir=a.workdir)
    cache = "cold (page cache dropped before each run)" if can_drop_caches() else "warm (not root: cannot drop caches)"
    print(f"{machine_line()}; {cache}; {1 if a.quick else a.runs} alternating rounds")
    print_table(f"tokpack pack vs cp -r + sync ({a.size if not a.quick else QUICK_SIZE} per case)", rows, COLUMNS)
