"""Reader benchmark (issue 4): throughput against a cold `cat` of the same shards, cost of
starting at the incident's step counts, and the memory a step-indexed loader needs there.

    python bench/read.py --size 64MiB [--quick]

1. Throughput: an epoch of `--size` bytes (seq_len 4096, uint16) is read cold by `cat` and
   by SampleReader (W=1, m=8; and with position ids from EOS). Goal: >= 0.9x cat.
2. Incident steps (global batch 576, seq_len 4096): the reader starts at step 32,000 and
   at step 3,200,000 (sample 1.84e9, 15 TB into the stream). The epoch description there
   is virtual: 12,502 shard entries that all name one sparse file whose first bytes are
   real data, so both starts read the same real bytes at the same file offset and no
   15 TB are written. Throughput ratio and peak RSS should be equal.
3. Step-indexed contrast: Nanoset keeps 16 B per sample (uint64 dataset index + int64
   sample index), the TokenizedBytes blend 10 B (int16 + int64), for steps x 576 samples.
   A child process allocates and fills those arrays as the loaders do: fully at step
   32,000; at step 3,200,000 (29.5 GB, more than this machine) a fraction, extrapolated.
"""

from __future__ import annotations

import argparse
import json
import os
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
    machine_line,
    median_of,
    parse_size,
    print_table,
    python_cmd,
    run_measured,
)  # noqa: E402

SEQ_LEN = 4096
GBS = 576
STEPS = (32_000, 3_200_000)
ROW_BYTES = (SEQ_LEN + 1) * 2
VIRTUAL_SHARD_SAMPLES = 147_456  # divides 32,000*576 and 3,200,000*576: both starts land at offset 0
NANOSET_B, BLEND_B = 16, 10


def make_epoch(out: Path, size: int, seed: int = 0) -> Path:
    """An epoch directory of random documents (EOS = 0) written with the real shard writer."""
    from tokpack.formats.constants import PLAN_ALGORITHM
    from tokpack.formats.builders import ShuffleFields, TokenHeader, epoch_manifest
    from tokpack.formats.names import shard_name
    from tokpack.formats.reading import write_manifest
    from tokpack.formats.shards import EpochShardWriter

    out.mkdir(parents=True, exist_ok=True)
    samples = max(8, size // ROW_BYTES)
    shard_samples = max(1, min(16_384, samples // 4))  # several shards even at small sizes
    rng = np.random.default_rng(seed)
    shards = []
    for i, lo in enumerate(range(0, samples, shard_samples)):
        w = EpochShardWriter(out, shard_name(i), np.uint16, SEQ_LEN, 0, "bench")
        for b in range(lo, min(samples, lo + shard_samples), 1024):
            n = min(1024, lo + shard_samples - b, samples - b)
            rows = rng.integers(1, 50_000, size=(n, SEQ_LEN + 1), dtype=np.uint16)
            rows[rng.random(rows.shape) < 1 / 1200] = 0
            w.write_rows(rows)
        shards.append(w.close())
    for s in shards:
        s["fragments"] = (out / f"{s['path']}.index").stat().st_size // 8
    row = SEQ_LEN + 1
    # One stand-in source whose windows are the epoch's samples: the manifest checks every reader
    # applies (tokpack.formats.checks.check_manifest) hold, as for an epoch the shuffle wrote.
    source = {
        "name": "bench",
        "path": "bench",
        "fingerprint": "0" * 32,
        "tokens": samples * row,
        "weight": None,
        "samples": samples,
        "first_pass": 0,
        "passes": 1,
        "windows": samples,
        "offset": 0,
        "dropped_tokens": 0,
    }
    write_manifest(
        out,
        epoch_manifest(
            shards,
            TokenHeader(np.dtype("<u2"), 50_257, 0, "bench"),
            ShuffleFields(
                seed=seed,
                seq_len=SEQ_LEN,
                samples=samples,
                shard_samples=shard_samples,
                jitter=False,
                shuffle=PLAN_ALGORITHM,
            ),
            tokens=samples * row,
            epoch=0,
            dropped_tokens=0,
            sources=[source],
        ),
    )
    return out


def make_virtual_shard(epoch: Path, out: Path) -> int:
    """A sparse file of VIRTUAL_SHARD_SAMPLES rows whose first rows are the epoch's real data;
    returns how many real rows it holds."""
    out.mkdir(parents=True, exist_ok=True)
    real = 0
    with open(out / "00000.ds", "wb") as f:
        f.truncate(VIRTUAL_SHARD_SAMPLES * ROW_BYTES)
        for shard in sorted(epoch.glob("*.ds")):
            with open(shard, "rb") as src:
                while real < VIRTUAL_SHARD_SAMPLES and (
                    chunk := src.read(min(1024, VIRTUAL_SHARD_SAMPLES - real) * ROW_BYTES)
                ):
                    f.write(chunk)
                    real += len(chunk) // ROW_BYTES
    return real


# The child programs write their own timings and peak RSS to a JSON file: the child's wall
# time would include interpreter start-up, which dwarfs a small read, and wait4's ru_maxrss
# starts at the parent's RSS (Linux carries the high-water mark across fork+exec), so it
# cannot show a child smaller than this script. /proc/self/status VmHWM is the child's own.
HWM = "int([x.split()[1] for x in open('/proc/self/status') if x.startswith('VmHWM')][0]) / 1024"
READ_CHILD = """
import json, time
from tokpack.loader.reader import SampleReader
t0 = time.perf_counter()
r = SampleReader.open({path!r})
t1 = time.perf_counter()
n = 0
for item in r.batches(0, 1, 8, positions={positions!r}, copy=False, at_end="stop"):
    n += (item[0] if isinstance(item, tuple) else item).nbytes
t2 = time.perf_counter()
json.dump({{"open_s": t1 - t0, "read_s": t2 - t1, "bytes": n, "rss_mb": {hwm}}}, open({result!r}, "w"))
"""

VIRTUAL_CHILD = """
import json, time
from tokpack.loader.reader import SampleReader
rows, shard = {rows}, {shard}
m = {{"format": "tokpack", "version": 1, "kind": "epoch", "seq_len": {seq}, "dtype": "uint16", "token_size": 2,
     "eos_id": 0, "samples": {n_shards} * shard, "shard_samples": shard,
     "shards": [{{"path": "00000.ds", "samples": shard, "bytes": shard * {row_bytes}}}] * {n_shards}}}
t0 = time.perf_counter()
r = SampleReader.from_manifests([({dir!r}, m)])
g = r.start_from(start_sample={start})
t1 = time.perf_counter()
n = 0
for item in r.batches(0, {world}, {micro}, g, steps=rows // ({world} * {micro}), copy=False):
    n += item.nbytes
t2 = time.perf_counter()
json.dump({{"open_s": t1 - t0, "read_s": t2 - t1, "bytes": n, "rss_mb": {hwm}}}, open({result!r}, "w"))
"""

DATATROVE_CHILD = """
import json, time
from datatrove.utils.dataset import DatatroveFolderDataset
t0 = time.perf_counter()
ds = DatatroveFolderDataset({path!r}, {seq}, token_size=2)
n = 0
for i in range(len(ds)):
    n += ds[i]["input_ids"].numel() * 2
json.dump({{"open_s": 0.0, "read_s": time.perf_counter() - t0, "bytes": n, "rss_mb": {hwm}}}, open({result!r}, "w"))
"""

ALLOC_CHILD = """
import json
import numpy as np
import tokpack.loader.reader
n = {n}
# Allocated and filled the way the loader's index builder does (every entry is written).
a = np.empty(n, dtype={first!r}); a[:] = 1
b = np.empty(n, dtype="int64"); b[:] = 1
json.dump({{"read_s": 0.0, "rss_mb": {hwm}}}, open({result!r}, "w"))
"""


def _child(work: Path, template: str, runs: int, cold: bool = True, **fields) -> tuple[dict, float]:
    """Median internal timings over `runs` cold runs, and the largest peak RSS (MiB)."""
    results = []
    for k in range(runs):
        result = work / f"result-{os.getpid()}-{k}.json"
        run_measured(python_cmd(template.format(result=str(result), hwm=HWM, **fields)), cwd=str(REPO), cold=cold)
        results.append(json.loads(result.read_text()))
    results.sort(key=lambda r: r["read_s"])
    return results[len(results) // 2], max(r["rss_mb"] for r in results)


def _mbps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e6


def main(size: int, quick: bool = False, workdir: str | None = None) -> list[dict]:
    runs = 1 if quick else 3
    work = Path(tempfile.mkdtemp(prefix="tokpack-bench-read-", dir=workdir))
    rows: list[dict] = []
    try:
        epoch = make_epoch(work / "epoch", size)
        shards = sorted(epoch.glob("*.ds"))
        nbytes = sum(p.stat().st_size for p in shards)
        cold = "cold" if can_drop_caches() else "WARM (cannot drop caches)"
        print(f"# read benchmark: {nbytes / 2**20:.0f} MiB epoch, seq_len {SEQ_LEN}, caches {cold}; {machine_line()}")

        # 1. throughput
        cat = median_of(lambda: run_measured("cat " + " ".join(f"'{p}'" for p in shards) + " > /dev/null"), runs)
        rows.append({"case": "cat *.ds (physical baseline)", "MB/s": _mbps(nbytes, cat.seconds), "vs cat": 1.0})
        for label, positions in (
            ("tokpack SampleReader W=1 m=8", None),
            ("tokpack SampleReader + position ids", "eos"),
        ):
            res, rss = _child(work, READ_CHILD, runs, path=str(epoch), positions=positions)
            rows.append(
                {
                    "case": label,
                    "MB/s": _mbps(res["bytes"], res["read_s"]),
                    "vs cat": cat.seconds / res["read_s"],
                    "peak RSS MiB": rss,
                    "note": f"open {res['open_s'] * 1e3:.1f} ms",
                }
            )
        res, rss = _child(work, DATATROVE_CHILD, 1, path=str(epoch), seq=SEQ_LEN)
        rows.append(
            {
                "case": "datatrove DatatroveFolderDataset (peer)",
                "MB/s": _mbps(res["bytes"], res["read_s"]),
                "vs cat": cat.seconds / res["read_s"],
                "peak RSS MiB": rss,
                "note": "imports torch",
            }
        )
        print_table("Sequential read throughput", rows, ["case", "MB/s", "vs cat", "peak RSS MiB", "note"])

        # 2. incident steps, over a virtual epoch description
        vdir = work / "virtual"
        real_rows = make_virtual_shard(epoch, vdir)
        read_rows = real_rows // 8 * 8
        n_shards = STEPS[-1] * GBS // VIRTUAL_SHARD_SAMPLES + 2
        incident = []
        for world, micro in ((1, 8), (64, GBS // 64)):  # one reader of everything; rank 0 of 64 (strided)
            for step in STEPS:
                res, rss = _child(
                    work,
                    VIRTUAL_CHILD,
                    runs,
                    rows=read_rows,
                    shard=VIRTUAL_SHARD_SAMPLES,
                    seq=SEQ_LEN,
                    n_shards=n_shards,
                    row_bytes=ROW_BYTES,
                    dir=str(vdir),
                    start=step * GBS,
                    world=world,
                    micro=micro,
                )
                incident.append(
                    {
                        "start step": f"{step:,}",
                        "start sample": f"{step * GBS:,}",
                        "rank": f"0 of {world}, m={micro}",
                        "MB read": res["bytes"] / 1e6,
                        "MB/s": _mbps(res["bytes"], res["read_s"]),
                        "open ms": res["open_s"] * 1e3,
                        "peak RSS MiB": rss,
                    }
                )
        for r in incident:
            base = next(x for x in incident if x["rank"] == r["rank"])["MB/s"]  # the step-32,000 row
            r["throughput ratio"] = r["MB/s"] / base
        print_table(
            f"Start at the incident's steps (GBS {GBS}, seq_len {SEQ_LEN}; the same {read_rows} global-stream rows "
            f"from each start, cold; a virtual description of {n_shards:,} shards)",
            incident,
            ["start step", "start sample", "rank", "MB read", "MB/s", "throughput ratio", "open ms", "peak RSS MiB"],
        )

        # 3. step-indexed contrast
        empty = _child(work, ALLOC_CHILD, 1, cold=False, n=0, first="uint64")[1]
        contrast = []
        for step in STEPS:
            samples = step * GBS
            fraction = 1.0 if step == STEPS[0] else (1 / 100 if quick else 1 / 16)
            n = int(samples * fraction)
            for name, first, per in (("Nanoset", "uint64", NANOSET_B), ("TokenizedBytes blend", "int16", BLEND_B)):
                rss = _child(work, ALLOC_CHILD, 1, cold=False, n=n, first=first)[1]
                contrast.append(
                    {
                        "loader": name,
                        "step": f"{step:,}",
                        "formula GB": samples * per / 1e9,
                        "measured fraction": fraction,
                        "measured index MiB": rss - empty,
                        "implied GB": (rss - empty) / fraction * 2**20 / 1e9,
                    }
                )
            tok = next(r for r in incident if r["start step"] == f"{step:,}")
            contrast.append(
                {
                    "loader": "tokpack SampleReader",
                    "step": f"{step:,}",
                    "formula GB": 0.0,
                    "measured fraction": 1.0,
                    "measured index MiB": tok["peak RSS MiB"] - empty,
                    "implied GB": (tok["peak RSS MiB"] - empty) * 2**20 / 1e9,
                }
            )
        print_table(
            "Per-rank memory of step-indexed loaders vs tokpack (index = peak RSS minus an idle numpy "
            f"interpreter, {empty:.0f} MiB)",
            contrast,
            ["loader", "step", "formula GB", "measured fraction", "measured index MiB", "implied GB"],
        )
        return rows + incident + contrast
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB", help="epoch size (e.g. 64MiB for a check, 4GiB for the real run)")
    ap.add_argument("--quick", action="store_true", help="one run per case; a 1/100 fraction at step 3.2M")
    ap.add_argument("--workdir", default=None, help="where to write the epoch (default: $TMPDIR)")
    args = ap.parse_args()
    main(parse_size(args.size), quick=args.quick, workdir=args.workdir)
