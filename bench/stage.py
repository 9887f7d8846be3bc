"""`tokpack stage` throughput against the physical baseline, `cp -r` + `sync`, on the same
packed source. Stage's time includes verifying every file's xxh3_128 while copying and
fsyncing it; the goal is at least 0.9x cp's throughput. The resume row re-stages onto a
complete copy: every file is re-read and verified in place, nothing is written.

    python bench/stage.py [--size 1GiB] [--shards 8] [--quick]
    python bench/stage.py --s3 [--size 1GiB]    # from a bucket on a local S3 server (moto), and shuffle -o s3://
    python bench/stage.py --slices [--s3] [--size 512MiB]   # node slices vs a whole stage vs cp of the slice

With --s3 the source sits in a bucket of moto's S3 server on 127.0.0.1 (one process, objects
in memory) and stage is compared with s3fs's own recursive `get` and `aws s3 cp --recursive`
(when the AWS CLI is installed) from the same server: the server, not the disk, is the limit.
A second table sends a shuffled epoch to the bucket (`shuffle -o s3://`, a shard at a time)
against writing it locally and uploading it with s3fs's `put`, with each one's peak local disk.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path[0] = str(
    Path(__file__).resolve().parents[1]
)  # the repo, not bench/, where shuffle.py would hide the shuffle package
from bench.common import (
    REPO,
    can_drop_caches,
    cold_read,
    cp_sync,
    dir_bytes,
    machine_line,
    median_of,  # noqa: E402
    parse_size,
    print_table,
    run_measured,
)

COLUMNS = ["case", "wall s", "MB/s", "vs cp", "vs cp excl. start-up", "peak RSS MB", "note"]
SIZE = "1GiB"
QUICK_SIZE = "64MiB"


def make_packed_source(out: Path, total_bytes: int, shards: int, seed: int = 0) -> Path:
    """A packed source of random uint16 documents, written with the project's shard writer in
    blocks (untimed preparation)."""
    from tokpack.formats.names import shard_name
    from tokpack.formats.reading import write_manifest
    from tokpack.formats.shards import SourceShardWriter
    from tokpack.formats.builders import source_manifest

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    per_shard = total_bytes // 2 // shards
    block = 4 << 20
    entries = []
    for i in range(shards):
        w = SourceShardWriter(out, shard_name(i), np.dtype("<u2"), "bench")
        left = per_shard
        while left:
            n = min(block, left)
            toks = rng.integers(1, 50257, size=n, dtype=np.uint16)
            ends = np.cumsum(rng.geometric(1 / 1200, size=n // 600 + 4))
            ends = np.append(ends[ends < n], n)
            toks[ends - 1] = 0
            w.write(toks, ends)
            left -= n
        entries.append(w.close())
    write_manifest(out, source_manifest(entries, np.dtype("<u2"), 50257, 0, "bench"))
    return out


def stage_cmd(src: Path, dst: Path, workers: int) -> str:
    args = [
        sys.executable,
        "-m",
        "tokpack.packer.cli",
        "stage",
        str(src),
        str(dst),
        "--workers",
        str(workers),
        "--json",
    ]
    return f"cd {shlex.quote(str(REPO))} && {' '.join(shlex.quote(a) for a in args)} > /dev/null"


def excl(cp, m, start) -> float | None:
    """cp's time over stage's time once stage's fixed start-up is subtracted."""
    copy = m.seconds - start.seconds
    return cp.seconds / copy if copy > 0 else None


def main(
    size=None, quick: bool = False, *, shards: int = 8, workers: tuple[int, ...] = (1, 4), work: Path | None = None
) -> list[dict]:
    nbytes = parse_size(size or (QUICK_SIZE if quick else SIZE))
    own = work is None
    work = Path(work or tempfile.mkdtemp(prefix="tokpack-stage-bench-"))
    rows = []
    try:
        src = make_packed_source(work / "src", nbytes, shards)
        total = dir_bytes(src)
        cold = can_drop_caches()
        note = "cold cache" if cold else "warm cache (not root: cannot drop caches)"
        cp = cp_sync(src, work / "cp")
        shutil.rmtree(work / "cp")
        rows.append(
            {
                "case": "cp -r + sync",
                "wall s": cp.seconds,
                "MB/s": total / 1e6 / cp.seconds,
                "vs cp": 1.0,
                "peak RSS MB": cp.peak_rss_mb,
                "note": note,
            }
        )
        rd = cold_read(src)
        rows.append(
            {
                "case": "cold read (cat)",
                "wall s": rd.seconds,
                "MB/s": total / 1e6 / rd.seconds,
                "vs cp": cp.seconds / rd.seconds,
                "peak RSS MB": rd.peak_rss_mb,
                "note": "read only",
            }
        )
        # The fixed cost of a Python command (interpreter and imports, loaded cold from disk after
        # the cache drop) dominates small copies; the last column subtracts it to show the copy rate.
        tiny = make_packed_source(work / "tiny", 1 << 12, 1)
        start = median_of(lambda: run_measured(stage_cmd(tiny, work / "tiny-dst", 1)), 3)
        for w in workers:
            shutil.rmtree(work / "dst", ignore_errors=True)
            m = run_measured(stage_cmd(src, work / "dst", w))
            rows.append(
                {
                    "case": f"tokpack stage --workers {w}",
                    "wall s": m.seconds,
                    "MB/s": total / 1e6 / m.seconds,
                    "vs cp": cp.seconds / m.seconds,
                    "vs cp excl. start-up": excl(cp, m, start),
                    "peak RSS MB": m.peak_rss_mb,
                    "note": "xxh3_128 verified while copying, fsync per file",
                }
            )
        rows.append(
            {
                "case": "tokpack stage of a 4 KiB source",
                "wall s": start.seconds,
                "MB/s": None,
                "vs cp": None,
                "peak RSS MB": start.peak_rss_mb,
                "note": "fixed start-up cost (median of 3): interpreter, imports",
            }
        )
        m = run_measured(stage_cmd(src, work / "dst", max(workers)))
        rows.append(
            {
                "case": f"tokpack stage resume --workers {max(workers)}",
                "wall s": m.seconds,
                "MB/s": total / 1e6 / m.seconds,
                "vs cp": cp.seconds / m.seconds,
                "vs cp excl. start-up": excl(cp, m, start),
                "peak RSS MB": m.peak_rss_mb,
                "note": "DEST complete: re-read and verify in place",
            }
        )
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{machine_line()}; {total / 2**20:,.0f} MiB in {shards} shards")
    print_table(f"stage vs cp -r + sync ({total / 2**20:,.0f} MiB)", rows, COLUMNS)
    return rows


@contextlib.contextmanager
def moto_server():
    """moto's S3 server on 127.0.0.1 (one process, objects in memory), found by s3fs through
    AWS_ENDPOINT_URL and test credentials set in this process's environment; yields that environment."""
    import os
    import socket
    import subprocess
    import time
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    os.environ.update(env)
    try:
        while True:
            try:
                urllib.request.urlopen(env["AWS_ENDPOINT_URL"] + "/moto-api/", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        yield env
    finally:
        server.terminate()
        server.wait(10)


def s3_main(size=None, quick: bool = False, *, shards: int = 8, workers: tuple[int, ...] = (1, 4)) -> list[dict]:

    nbytes = parse_size(size or (QUICK_SIZE if quick else SIZE))
    work = Path(tempfile.mkdtemp(prefix="tokpack-stage-s3-bench-"))
    rows = []
    with moto_server():
        import s3fs

        fs = s3fs.S3FileSystem()
        fs.mkdir("bench")
        src = make_packed_source(work / "src", nbytes, shards)
        total = dir_bytes(src)
        fs.put(str(src), "bench/src", recursive=True)
        url = "s3://bench/src"
        cases = [
            (
                "s3fs get --recursive",
                lambda dst: [
                    sys.executable,
                    "-c",
                    "import s3fs, sys; s3fs.S3FileSystem().get('bench/src', sys.argv[1], recursive=True)",
                    str(dst),
                ],
            )
        ]
        if shutil.which("aws"):
            cases.append(
                ("aws s3 cp --recursive", lambda dst: ["aws", "s3", "cp", "--recursive", "--quiet", url, str(dst)])
            )
        cases += [
            (
                f"tokpack stage --workers {w}",
                lambda dst, w=w: [
                    sys.executable,
                    "-m",
                    "tokpack.packer.cli",
                    "stage",
                    url,
                    str(dst),
                    "--workers",
                    str(w),
                    "--json",
                ],
            )
            for w in workers
        ]
        base = None
        for name, argv in cases:
            times = []
            for _ in range(1 if quick else 3):
                shutil.rmtree(work / "dst", ignore_errors=True)
                times.append(run_measured(argv(work / "dst"), cwd=str(REPO), cold=False))
            m = sorted(times, key=lambda t: t.seconds)[len(times) // 2]
            if dir_bytes(work / "dst") != total:
                raise RuntimeError(f"{name} copied {dir_bytes(work / 'dst')} of {total} bytes")
            base = base or m
            rows.append(
                {
                    "case": name,
                    "wall s": m.seconds,
                    "MB/s": total / 1e6 / m.seconds,
                    "vs s3fs get": base.seconds / m.seconds,
                    "peak RSS MB": m.peak_rss_mb,
                    "note": "median of 3" if not quick else "one run",
                }
            )
        out_rows = shuffle_to_bucket(src, work, fs, quick)
    shutil.rmtree(work, ignore_errors=True)
    print(f"{machine_line()}; {total / 2**20:,.0f} MiB in {shards} shards, moto S3 server on 127.0.0.1")
    print_table(
        f"stage from a local S3 server vs s3fs get ({total / 2**20:,.0f} MiB)",
        rows,
        ["case", "wall s", "MB/s", "vs s3fs get", "peak RSS MB", "note"],
    )
    print_table(
        "shuffle -o s3:// (each shard sent once committed) vs shuffle to a local folder, then s3fs put",
        out_rows,
        ["case", "wall s", "MB/s", "vs local + put", "peak local MB", "peak RSS MB", "note"],
    )
    return rows + out_rows


OUTPUT_SHARDS = 16  # the run's shards: the scratch bound is about a shard per worker


def shuffle_to_bucket(src: Path, work: Path, fs, quick: bool) -> list[dict]:
    """One epoch of `src` shuffled in memory into the bucket, and the same written locally then
    uploaded by s3fs: wall time, and the peak disk use of the local folder the command writes."""
    import threading

    seq_len = 4095
    shard_samples = max(1, dir_bytes(src, ".ds") // OUTPUT_SHARDS // ((seq_len + 1) * 2))
    shuffle = [
        sys.executable,
        "-m",
        "tokpack.packer.cli",
        "shuffle",
        str(src),
        "--seq-len",
        str(seq_len),
        "--seed",
        "1",
        "--epochs",
        "1",
        "--shard-samples",
        str(shard_samples),
        "--workers",
        "2",
        "--json",
    ]
    local, scratch = work / "run", work / "scratch"
    cases = [
        (
            "tokpack shuffle -o DIR, then s3fs put --recursive",
            local,
            f"{shlex.join(shuffle + ['-o', str(local)])} && {shlex.quote(sys.executable)} -c "
            f"\"import s3fs; s3fs.S3FileSystem().put('{local}', 'bench/run-put', recursive=True)\"",
        ),
        ("tokpack shuffle -o s3://", scratch, shuffle + ["-o", "s3://bench/run", "--scratch", str(scratch)]),
    ]
    rows, base = [], None
    for name, folder, cmd in cases:
        times, peaks = [], []
        for _ in range(1 if quick else 3):
            for d in (local, scratch):
                shutil.rmtree(d, ignore_errors=True)
            scratch.mkdir()
            fs.rm("bench/run", recursive=True) if fs.exists("bench/run") else None
            fs.rm("bench/run-put", recursive=True) if fs.exists("bench/run-put") else None
            peak, done = [0], threading.Event()

            def watch():
                while not done.wait(0.02):
                    peak[0] = max(peak[0], dir_bytes(folder) if folder.exists() else 0)

            watcher = threading.Thread(target=watch)
            watcher.start()
            try:
                times.append(run_measured(cmd, cwd=str(REPO), cold=False))
            finally:
                done.set()
                watcher.join()
            peaks.append(peak[0])
        m = sorted(times, key=lambda t: t.seconds)[len(times) // 2]
        fs.invalidate_cache()
        sent = sum(fs.du("bench/run" if "s3://" in name else "bench/run-put", total=False).values())
        base = base or m
        rows.append(
            {
                "case": name,
                "wall s": m.seconds,
                "MB/s": sent / 1e6 / m.seconds,
                "vs local + put": base.seconds / m.seconds,
                "peak local MB": max(peaks) / 1e6,
                "peak RSS MB": m.peak_rss_mb,
                "note": f"{sent / 1e6:,.0f} MB in {OUTPUT_SHARDS} shards, 2 workers; "
                + ("median of 3" if not quick else "one run"),
            }
        )
    return rows


def slice_cmd(run: Path, dst: Path, args: list[str], out: Path) -> str:
    argv = [sys.executable, "-m", "tokpack.packer.cli", "stage", str(run), str(dst), *args, "--json"]
    return f"cd {shlex.quote(str(REPO))} && {' '.join(shlex.quote(a) for a in argv)} > {shlex.quote(str(out))}"


# The reads a slice of rank r of W (micro-batch m) makes, and nothing else: its row ranges in
# each epoch shard, announced to the kernel, then read in order (argv: run, r, W, m, a file that
# gets its own seconds, after the interpreter's start and imports).
STRIDED_READ = """
import json, os, sys, time
from pathlib import Path
from tokpack.formats.slices import RankRows
t0 = time.perf_counter()
run, r, w, m = Path(sys.argv[1]), *map(int, sys.argv[2:5])
rows = RankRows(w, m)
for d in sorted(run.glob("epoch-*")):
    e = json.loads((d / "tokpack.json").read_text())
    row, per, first = (e["seq_len"] + 1) * e["token_size"], e["shard_samples"], e["epoch"] * e["samples"]
    buf = bytearray(m * row)
    fds = {}
    for pos in rows.node_positions(first, e["samples"], (r, r), 1 << 20):
        starts = pos[::m]
        ranges = [(int(p) // per, int(p) % per * row) for p in starts]
        for i, off in ranges:
            if i not in fds:
                fds[i] = os.open(d / e["shards"][i]["path"], os.O_RDONLY)
            os.posix_fadvise(fds[i], off, len(buf), os.POSIX_FADV_WILLNEED)
        for i, off in ranges:
            os.preadv(fds[i], [buf], off)
Path(sys.argv[5]).write_text(str(time.perf_counter() - t0))
"""


def slices_main(size=None, quick: bool = False, *, workers: int = 4, s3: bool = False) -> list[dict]:
    """Node slices: a 1/8 slice (W=8, m=4, 1 rank a node; W=16, 2 ranks a node) of a shuffled
    run against the whole-run stage and against `cp -r && sync` of the slice's own bytes."""
    import json
    import subprocess

    nbytes = parse_size(size or ("64MiB" if quick else "512MiB"))
    work = Path(tempfile.mkdtemp(prefix="tokpack-slice-bench-"))
    rows = []
    try:
        src = make_packed_source(work / "src", nbytes, 8)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "tokpack.packer.cli",
                "shuffle",
                str(src),
                "-o",
                str(work / "run"),
                "--seq-len",
                "4095",
                "--seed",
                "1",
                "--epochs",
                "1",
                "--memory",
                "256MiB",
            ],
            cwd=REPO,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        run = work / "run"
        total = dir_bytes(run)
        if s3:  # moto copies a whole object for each ranged GET: the bucket's run has 8 MiB shards
            small_run = work / "run-8mib-shards"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "tokpack.packer.cli",
                    "shuffle",
                    str(src),
                    "-o",
                    str(small_run),
                    "--seq-len",
                    "4095",
                    "--seed",
                    "1",
                    "--epochs",
                    "1",
                    "--memory",
                    "256MiB",
                    "--shard-samples",
                    "1024",
                ],
                cwd=REPO,
                check=True,
                stdout=subprocess.DEVNULL,
            )
        note = "cold cache" if can_drop_caches() else "warm cache (not root: cannot drop caches)"
        # The fixed cost of a Python command (interpreter, imports) dominates a small slice: a
        # slice of a one-shard run, median of 3, shows it. The ratios "excl. start-up" take the
        # stage's own `seconds` (its JSON: from its call, after the interpreter and imports).
        tiny = make_packed_source(work / "tiny", 1 << 18, 1)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "tokpack.packer.cli",
                "shuffle",
                str(tiny),
                "-o",
                str(work / "tiny-run"),
                "--seq-len",
                "63",
                "--seed",
                "1",
                "--epochs",
                "1",
            ],
            cwd=REPO,
            check=True,
            stdout=subprocess.DEVNULL,
        )

        def tiny_slice():
            shutil.rmtree(work / "tiny-slice", ignore_errors=True)
            return run_measured(
                slice_cmd(
                    work / "tiny-run",
                    work / "tiny-slice",
                    ["--ranks", "3", "--world-size", "8", "--micro-batch", "4"],
                    work / "t.json",
                )
            )

        start = median_of(tiny_slice, 3)
        rows.append(
            {
                "case": "tokpack stage slice of a 256 KiB run",
                "wall s": start.seconds,
                "peak RSS MB": start.peak_rss_mb,
                "note": "fixed start-up cost (median of 3): interpreter, imports",
            }
        )
        m = run_measured(stage_cmd(run, work / "full", workers))
        shutil.rmtree(work / "full")
        rows.append(
            {
                "case": "tokpack stage (whole run)",
                "wall s": m.seconds,
                "read MB": total / 1e6,
                "kept MB": total / 1e6,
                "read/kept": 1.0,
                "vs cp of kept": None,
                "peak RSS MB": m.peak_rss_mb,
                "note": note,
            }
        )
        # Cold runs of a few hundred MB swing by a third from one minute to the next on a shared
        # VM: the floor, each slice and each cp are the median of 3.
        floor_own = []

        def one_floor():
            m = run_measured(
                [sys.executable, "-c", STRIDED_READ, str(run), "3", "8", "4", str(work / "floor.txt")], cwd=str(REPO)
            )
            floor_own.append(float((work / "floor.txt").read_text()))
            return m

        m = median_of(one_floor)
        floor = statistics.median(floor_own)
        rows.append(
            {
                "case": "cold read of the 1/8 slice's rows in place (median of 3)",
                "wall s": m.seconds,
                "peak RSS MB": m.peak_rss_mb,
                "note": f"own {floor:.2f} s: the physical floor of the slice's reads: its ranges, WILLNEED, "
                "then pread; no write",
            }
        )
        for name, args in [
            ("1 rank a node (W=8)", ["--ranks", "3", "--world-size", "8"]),
            ("2 ranks a node (W=16)", ["--ranks", "6-7", "--world-size", "16"]),
        ]:
            dst, out = work / "slice", work / "slice.json"

            inside = []  # the command's own seconds (its JSON): from its start, after the interpreter's and imports'

            def one_slice():
                shutil.rmtree(dst, ignore_errors=True)
                m = run_measured(slice_cmd(run, dst, [*args, "--micro-batch", "4", "--workers", str(workers)], out))
                inside.append(json.loads(out.read_text())["seconds"])
                return m

            def one_cp():
                m = cp_sync(dst, work / "cp")
                shutil.rmtree(work / "cp")
                return m

            m, cp = median_of(one_slice), median_of(one_cp)
            res = json.loads(out.read_text())
            kept = dir_bytes(dst)
            rows.append(
                {
                    "case": f"cp -r + sync of the slice, {name} (median of 3)",
                    "wall s": cp.seconds,
                    "read MB": kept / 1e6,
                    "kept MB": kept / 1e6,
                    "read/kept": 1.0,
                    "vs cp of kept": 1.0,
                    "peak RSS MB": cp.peak_rss_mb,
                    "note": "the slice's own files",
                }
            )
            rows.append(
                {
                    "case": f"tokpack stage slice, {name} (median of 3)",
                    "wall s": m.seconds,
                    "read MB": res["bytes_read"] / 1e6,
                    "kept MB": kept / 1e6,
                    "read/kept": res["read_amplification"],
                    "vs cp of kept": m.seconds / cp.seconds,
                    "excl. start-up": statistics.median(inside) / cp.seconds,
                    "vs cold read excl. start-up": statistics.median(inside) / floor,
                    "peak RSS MB": m.peak_rss_mb,
                    "note": f"own {statistics.median(inside):.2f} s; 1/8 of {total / 1e6:,.0f} MB; rows verified by "
                    ".ds.rows; read/kept over token bytes",
                }
            )
            if s3:
                rows.append(_slice_from_bucket(small_run, work, name, args, workers))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{machine_line()}; run of {total / 2**20:,.0f} MiB (seq_len 4095, uint16), --workers {workers}")
    print_table(
        "node slice vs whole-run stage vs cp of the slice's bytes",
        rows,
        [
            "case",
            "wall s",
            "read MB",
            "kept MB",
            "read/kept",
            "vs cp of kept",
            "excl. start-up",
            "vs cold read excl. start-up",
            "peak RSS MB",
            "note",
        ],
    )
    return rows


def _slice_from_bucket(run: Path, work: Path, name: str, args: list[str], workers: int) -> dict:
    """The same slice staged from the run uploaded to moto's S3 server on 127.0.0.1."""
    import json

    with moto_server():
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        fs = s3fs.S3FileSystem()
        fs.mkdir("bench")
        fs.put(str(run), "bench/run", recursive=True)
        dst, out = work / "slice-s3", work / "slice-s3.json"
        m = run_measured(
            slice_cmd("s3://bench/run", dst, [*args, "--micro-batch", "4", "--workers", str(workers * 4)], out),
            cold=False,
        )
        res = json.loads(out.read_text())
        kept = dir_bytes(dst)
        shutil.rmtree(dst)
    return {
        "case": f"tokpack stage slice from s3 (moto), {name}",
        "wall s": m.seconds,
        "read MB": res["bytes_read"] / 1e6,
        "kept MB": kept / 1e6,
        "read/kept": res["read_amplification"],
        "vs cp of kept": None,
        "peak RSS MB": m.peak_rss_mb,
        "note": f"8 MiB shards, ranged GETs, --workers {workers * 4}; moto in one process",
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default=None, help=f"corpus size [default: {SIZE}; --quick: {QUICK_SIZE}]")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--workers", default="1,4", help="worker counts to measure, e.g. 1,4")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--s3", action="store_true", help="stage from a bucket on a local S3 server (moto)")
    ap.add_argument("--slices", action="store_true", help="node slices (W=8 and 16, m=4) against a whole stage and cp")
    a = ap.parse_args()
    if a.slices:
        slices_main(a.size, a.quick, s3=a.s3)
        sys.exit(0)
    (s3_main if a.s3 else main)(a.size, a.quick, shards=a.shards, workers=tuple(int(x) for x in a.workers.split(",")))
