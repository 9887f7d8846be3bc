"""Benchmark of `tokpack validate`: full validation against a cold sequential read of the same
bytes (goal >= 0.8x the read's throughput), `--quick` on a directory of 10,000 shards, and the
cost of `--against`'s order proof beside the multiset-only comparison it extends.

    python bench/validate.py --size 64MiB          # small check
    python bench/validate.py --size 4GiB           # the lead's full-size run
    python bench/validate.py --size 1GiB --against-only   # the order proof's table alone
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path[0] = str(
    Path(__file__).resolve().parents[1]
)  # the repo, not bench/, where shuffle.py would hide the shuffle package
from bench.common import (  # noqa: E402
    alternate,
    cold_read,
    dir_bytes,
    drop_caches,
    machine_line,
    paired_ratio,
    parse_size,
    print_table,
    python_cmd,
    ratio_range,
    run_measured,
)

VOCAB, EOS, SEQ_LEN = 50257, 0, 2048


def make_source(out: Path, total_bytes: int, shards: int = 4, seed: int = 0) -> Path:
    """A packed source of random documents (mean 1,200 tokens), written with the shard writer in blocks."""
    from tokpack.formats.names import shard_name
    from tokpack.formats.reading import write_manifest
    from tokpack.formats.shards import SourceShardWriter
    from tokpack.formats.builders import source_manifest

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    per_shard = max(SEQ_LEN * 2, total_bytes // 2 // shards)
    entries = []
    for i in range(shards):
        w = SourceShardWriter(out, shard_name(i), np.dtype("<u2"), "gpt2")
        done = 0
        while done < per_shard:
            n = min(4 << 20, per_shard - done)
            toks = rng.integers(1, VOCAB, size=n, dtype=np.int64).astype("<u2")
            ends = np.cumsum(rng.geometric(1 / 1200, size=n // 600 + 8))
            ends = np.append(ends[ends < n], n)
            toks[ends - 1] = EOS
            w.write(toks, ends)
            done += n
        entries.append(w.close())
    write_manifest(out, source_manifest(entries, np.dtype("<u2"), VOCAB, EOS, "gpt2"))
    return out


def make_many_shards(out: Path, shards: int, samples_per_shard: int = 1, seq_len: int = 15) -> Path:
    """An epoch directory of `shards` tiny shards, written directly with the epoch shard writer."""
    from tokpack.formats.builders import ShuffleFields, TokenHeader, epoch_manifest
    from tokpack.formats.names import shard_name, shard_digits
    from tokpack.formats.reading import write_manifest
    from tokpack.formats.shards import EpochShardWriter

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    digits = shard_digits(shards)
    entries = []
    for i in range(shards):
        w = EpochShardWriter(out, shard_name(i, digits), np.dtype("<u2"), seq_len, EOS, "gpt2")
        w.write_rows(rng.integers(0, 1000, size=(samples_per_shard, seq_len + 1)).astype("<u2"))
        e = w.close()
        e["fragments"] = (out / f"{e['path']}.index").stat().st_size // 8
        entries.append(e)
    n = shards * samples_per_shard
    source = {
        "name": "synthetic",
        "path": "synthetic",
        "fingerprint": "0" * 32,
        "weight": None,
        "samples": n,
        "first_pass": 0,
        "passes": 1,
        "windows": n,
        "tokens": n * (seq_len + 1),
        "offset": 0,
        "dropped_tokens": 0,
    }
    write_manifest(
        out,
        epoch_manifest(
            entries,
            TokenHeader(np.dtype("<u2"), 1000, EOS, "gpt2"),
            ShuffleFields(
                seed=0, seq_len=seq_len, samples=n, shard_samples=samples_per_shard, jitter=False, shuffle="synthetic"
            ),
            tokens=n * (seq_len + 1),
            epoch=0,
            dropped_tokens=0,
            sources=[source],
        ),
    )
    return out


def validate_cmd(path: Path, *flags: str) -> list[str]:
    return python_cmd(f"from tokpack.packer.cli import main; main({['validate', str(path), *flags]!r})")


def _measure_ok(cmd) -> object:
    m = run_measured(cmd, check=False)
    if m.returncode != 0:
        raise RuntimeError(f"validation failed on clean data: {cmd}")
    return m


def _inner_seconds(path: Path, *flags: str) -> float:
    """The report's own `seconds` (cold cache again): validation without interpreter startup,
    which dominates at small sizes."""
    drop_caches()
    out = subprocess.run(validate_cmd(path, *flags, "--json"), capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["seconds"]


def _row(dirname: str, what: str, nbytes: int, ms: list, reads: list, inner: float | None) -> dict:
    """`ms`, `reads`: the case's and the cold read's measures, one per round."""
    seconds = statistics.median(m.seconds for m in ms)
    read = statistics.median(m.seconds for m in reads)
    # throughput ratio = read time / validate time; paired_ratio gives validate / read
    ratio, lo, hi = paired_ratio(ms, reads)
    return {
        "dir": dirname,
        "what": what,
        "MB": nbytes / 1e6,
        "seconds": seconds,
        "MB/s": nbytes / 1e6 / seconds,
        "vs read": 1 / ratio,
        "range": ratio_range(1 / hi, 1 / lo),
        "in-process s": inner,
        "vs read (in-process)": read / inner if inner else None,
        "peak RSS MB": max(m.peak_rss_mb for m in ms),
    }


def against_cmd(epoch: Path, src: Path, order: bool, scan: bool = True, workers: int = 2) -> list[str]:
    """`validate EPOCH --against SRC` as the CLI runs it, with (`order`) or without the order proof
    (without: the multiset-only comparison --against made before it); `scan=False`: the plan's
    replay over the source alone."""
    if not scan:
        return python_cmd(
            f"from tokpack.formats.reading import read_manifest; from tokpack.formats.shards import PackedSource\n"
            f"from tokpack.shuffle.plan import replay_hashes\n"
            f"replay_hashes(read_manifest({str(epoch)!r}), [PackedSource.open({str(src)!r})], {order})"
        )
    return python_cmd(
        f"from functools import partial\nfrom tokpack.packer.validation import _against, validate_dirs\n"
        f"from tokpack.shuffle.plan import replay_hashes\n"
        f"report = validate_dirs([{str(epoch)!r}, {str(src)!r}], workers={workers}, order={order})\n"
        f"assert report.ok and not _against(report, [{str(src)!r}], partial(replay_hashes, order={order}))\n"
        f"assert all(d.shard_orders for d in report.dirs if d.kind == 'epoch') == {order}"
    )


def against_rows(src: Path, epoch: Path, runs: int, workers: int) -> list[dict]:
    """The order proof's cost: `--against` with and without it, the replay alone with and without
    it, and plain validation of the same two directories, beside a cold read of them."""
    cases = {
        "tokpack validate EPOCH SRC (no --against)": lambda: _measure_ok(validate_cmd(epoch, str(src))),
        "--against, multiset only (before)": lambda: _measure_ok(against_cmd(epoch, src, False, workers=workers)),
        "--against, multiset + order proof": lambda: _measure_ok(against_cmd(epoch, src, True, workers=workers)),
        "tokpack validate EPOCH --against SRC": lambda: _measure_ok(validate_cmd(epoch, "--against", str(src))),
        "replay alone, multiset only (before)": lambda: _measure_ok(against_cmd(epoch, src, False, scan=False)),
        "replay alone, multiset + order": lambda: _measure_ok(against_cmd(epoch, src, True, scan=False)),
    }
    nbytes = dir_bytes(src) + dir_bytes(epoch)
    read = f"find '{src}' '{epoch}' -type f -print0 | xargs -0 cat > /dev/null"  # as cold_read, both folders
    res = alternate([("read", lambda: run_measured(read))] + list(cases.items()), runs)
    rows = [_row("epoch + source", "cold read (cat)", nbytes, res["read"], res["read"], None)]
    # the replay alone reads the source only: its MB/s counts those bytes ('vs read' stays a ratio of times)
    rows += [
        _row(
            "epoch + source",
            name,
            dir_bytes(src) if name.startswith("replay") else nbytes,
            res[name],
            res["read"],
            None,
        )
        for name in cases
    ]
    return rows


def order_terms_cpu(epoch: Path, rounds: int = 5) -> str:
    """The CPU the order proof adds per side, apart from the disk: its terms for as many samples
    as the epoch holds, timed warm in this process (best of `rounds`)."""
    from tokpack.formats.hashes import order_hash_terms, row_hashes
    from tokpack.formats.reading import read_manifest

    m = read_manifest(epoch)
    n = m["samples"]
    g, h = np.arange(n, dtype=np.int64), np.random.default_rng(0).integers(0, 2**63, n).astype(np.uint64)
    terms = min(_cpu(lambda: order_hash_terms(g, h)) for _ in range(rounds))
    rows = np.fromfile(epoch / m["shards"][0]["path"], dtype="<u2").reshape(-1, m["seq_len"] + 1)
    per_row = min(_cpu(lambda: row_hashes(rows)) for _ in range(rounds)) / len(rows)
    return (
        f"order terms for the epoch's {n:,} samples: {terms:.3f} s of CPU per side (scan, replay), "
        f"{terms / n * 1e9:.0f} ns a sample; the row hashes both sides compute already: "
        f"{per_row * n:.3f} s ({per_row * 1e9:.0f} ns a sample)"
    )


def _cpu(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def main(
    size: int,
    quick: bool = False,
    workers: int = 2,
    work: Path | None = None,
    runs: int = 5,
    against_only: bool = False,
) -> list[dict]:
    runs = 1 if quick else runs
    tmp = Path(tempfile.mkdtemp(prefix="tokpack-bench-validate-", dir=work))
    rows = []
    try:
        src = make_source(tmp / "src", size)
        from tokpack.packer.shared import ExecutorConfig
        from tokpack.packer.executors import pass_runner
        from tokpack.shuffle.run import shuffle_run
        from tokpack.shuffle.spec import ShuffleSpec

        spec = ShuffleSpec.given_as(sources=[str(src)], seq_len=SEQ_LEN, seed=0, epochs=[0], memory=max(size, 64 << 20))
        shuffle_run(spec, str(tmp / "run"), run_passes=pass_runner(ExecutorConfig()))
        rows += against_rows(src, tmp / "run" / "epoch-00000", runs, workers)
        cpu = order_terms_cpu(tmp / "run" / "epoch-00000")
        if against_only:
            print_table(
                f"tokpack validate --against: the order proof's cost, {size / 2**20:,.0f} MiB packed "
                f"source + its epoch (seq_len {SEQ_LEN}); {machine_line()}",
                rows,
                ["dir", "what", "MB", "seconds", "MB/s", "vs read", "range", "peak RSS MB"],
            )
            print(cpu)
            return rows
        for label, path in (("packed source", src), ("epoch", tmp / "run")):
            nbytes = dir_bytes(path)
            variants = [["--workers", str(w)] for w in sorted({1, workers})] + [["--quick"]]
            res = alternate(
                [("read", lambda: cold_read(path))]
                + [(" ".join(f), lambda f=f: _measure_ok(validate_cmd(path, *f))) for f in variants],
                runs,
            )
            read = res["read"]
            rows.append(_row(label, "cold read (cat)", nbytes, read, read, None))
            for flags in variants:
                rows.append(
                    _row(
                        label,
                        " ".join(["tokpack validate", *flags]),
                        nbytes,
                        res[" ".join(flags)],
                        read,
                        _inner_seconds(path, *flags),
                    )
                )
        shutil.rmtree(tmp / "src")
        shutil.rmtree(tmp / "run")
        n = 1000 if quick else 10_000
        t0 = time.perf_counter()
        many = make_many_shards(tmp / f"many-{n}", n)
        gen = time.perf_counter() - t0
        nbytes = dir_bytes(many)
        read = [cold_read(many)]
        rows.append(_row(f"{n:,} shards", "cold read (cat)", nbytes, read, read, None))
        for flags in (["--quick"], ["--quick", "--workers", str(workers)], []):
            m = [_measure_ok(validate_cmd(many, *flags))]
            rows.append(
                _row(
                    f"{n:,} shards",
                    " ".join(["tokpack validate", *flags]),
                    nbytes,
                    m,
                    read,
                    _inner_seconds(many, *flags),
                )
            )
        print(f"(generating {n:,} shards took {gen:.1f} s)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(
        f"tokpack validate, {size / 2**20:,.0f} MiB packed source + its epoch (seq_len {SEQ_LEN}); {machine_line()}",
        rows,
        [
            "dir",
            "what",
            "MB",
            "seconds",
            "MB/s",
            "vs read",
            "range",
            "in-process s",
            "vs read (in-process)",
            "peak RSS MB",
        ],
    )
    print(cpu)
    print(
        "goal: full validation >= 0.8x the cold read's throughput ('vs read' = read time / validate time; "
        "'in-process' leaves out the interpreter start, ~0.3-0.5 s here, which dominates small sizes)"
    )
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB", help="packed source size (IEC/SI units)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="1,000 shards instead of 10,000, one round")
    ap.add_argument("--runs", type=int, default=5, help="rounds of cold read and validate, alternating")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default: system temp)")
    ap.add_argument("--against-only", action="store_true", help="only the order proof's table (validate --against)")
    args = ap.parse_args()
    main(
        parse_size(args.size),
        quick=args.quick,
        workers=args.workers,
        work=args.work,
        runs=args.runs,
        against_only=args.against_only,
    )
