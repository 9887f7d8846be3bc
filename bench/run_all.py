"""Every tokpack benchmark side by side in one run, on one generated corpus, in ONE table.

    python bench/run_all.py [--size 4GiB] [--quick] [--runs 3] [--sections baseline,pack,...]

Sections (each row: wall s, MB/s of token bytes, peak RSS MB, ratio to the section's baseline):
  baseline  cold sequential read, cp -r + sync, in-memory row permutation (np.take mode="clip")
  pack      tokpack pack from datatrove .ds, Megatron .bin/.idx and Parquet, against cp + sync
  shuffle   tokpack in memory and out of core (--memory = data/8), datatrove's merger, HF datasets,
            litdata optimize; against cp + sync
  read      the tokpack reader against a cold cat, from step 0, 32,000 and 3,200,000 (GBS 576)
  index     step-indexed loaders (Nanoset, Megatron GPTDataset/BlendedDataset): index memory at
            those steps, computed and allocated; Megatron-style index build time with numpy
  validate  tokpack validate, full and --quick, against a cold read
  scaling   bench/scaling.py: shuffle time and RSS at 0.5..8 GiB, fixed --memory, fitted slope
  scripts   the rows of bench/{pack,shuffle,read,validate,stage}.py main(), when they exist, and
            with --quick bench/soak.py --quick (a few random kills; every failure count must be 0),
            bench/scale_model.py --quick, bench/nodes.py --quick (shuffle --to-nodes, 4 MPI processes) and
            bench/rounds.py --quick (the exchange by round size, 2 MPI processes)

Cases of a section run round-robin (A, B, C, A, B, C, ...) in child processes, and the table
quotes the median of --runs (3; 1 with --quick). The page cache is dropped before every timed
run when running as root; otherwise the notes say the cache was warm.

Exit status 1 when a row that should have a number has none (a crash, a missing command); a
peer that is not installed is shown with the reason and does not fail the run. --quick (tiny
corpus, one run) is what CI runs: it checks that every row produced a number, never how fast.
The table, the machine and the command are also written to bench/results/run_all.md.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import shlex
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


BENCH = Path(__file__).resolve().parent
sys.path[0] = str(BENCH.parent)  # the repo, not bench/, where shuffle.py would hide the shuffle package
from bench import peers, scaling  # noqa: E402
from bench.common import (  # noqa: E402
    Measure,
    can_drop_caches,
    cold_read,
    cp_sync,
    dir_bytes,
    machine_line,
    make_datatrove_corpus,
    parse_size,
    print_table,
    python_cmd,
    run_measured,
)
from bench.peers import summary_of, tokpack_cmd  # noqa: E402

COLUMNS = ["section", "case", "wall s", "MB/s", "peak RSS MB", "ratio", "note"]
SECTIONS = ["baseline", "pack", "shuffle", "read", "index", "validate", "scaling", "scripts"]
SCRIPTS = ["pack", "shuffle", "read", "validate", "stage", "train_loop"]
SEQ_LEN = 4096  # the incident's sequence length
GBS = 576  # the incident's global batch size
STEPS = [32_000, 3_200_000]  # the incident's step counts
EOS_ID, VOCAB = 0, 50257  # what make_datatrove_corpus writes (uint16 tokens)
QUICK_SIZE = "16MiB"
QUICK_INDEX_CAP = 16 << 20  # --quick allocates at most this much per index row
DEBUG = False  # --debug: print the traceback of every failing case


@dataclass
class Ctx:
    """Everything a section needs; filled in as sections run (later ones reuse earlier outputs)."""

    work: Path  # scratch folder, removed at the end
    corpus: Path  # the generated datatrove corpus
    token_bytes: int  # bytes of tokens in the corpus (.ds files), the MB/s numerator
    runs: int  # timed runs per case (median quoted)
    quick: bool  # tiny corpus, one run
    cold: bool  # page cache dropped before each timed run (needs root)
    workers: int  # --workers for tokpack and litdata
    index_cap: int  # bytes an index allocation may take on this machine
    source: Path | None = None  # packed source (from the pack section, else written directly)
    source_note: str = ""  # how the source was made
    run_dir: Path | None = None  # a shuffled run with epoch 0 (from the shuffle section)
    run_error: str = ""  # why run_dir could not be made
    reader_rss: dict = field(default_factory=dict)  # step -> tokpack reader peak RSS MB


@dataclass
class Case:
    """One contender of a section; `fn` runs it once (setup untimed inside) and returns a Measure."""

    name: str
    fn: Callable[[], Measure]
    note: str = ""
    nbytes: int | None = None  # token bytes it processes (MB/s); None = the corpus
    skip: str | None = None  # reason it cannot run at all (e.g. peer not installed)
    results: list = field(default_factory=list)
    error: str | None = None


def first_line(err: BaseException | str, limit: int = 200) -> str:
    lines = [x for x in str(err).strip().splitlines() if x.strip()]
    return (lines[-1] if lines else type(err).__name__)[:limit]


def cache_note(ctx: Ctx) -> str:
    return "cold cache" if ctx.cold else "warm cache (not root: cannot drop caches)"


def measure(section: str, cases: list[Case], ctx: Ctx, baseline: str | None) -> list[dict]:
    """Runs the cases round-robin ctx.runs times and returns one row per case (medians)."""
    for _ in range(ctx.runs):
        for c in cases:
            if c.skip or c.error:
                continue
            try:
                c.results.append(c.fn())
            except Exception as e:  # a failing case becomes a row that says why
                c.error = first_line(e)
                if DEBUG:
                    traceback.print_exc()
    base = next((c for c in cases if c.name == baseline and c.results), None)
    base_s = statistics.median(m.seconds for m in base.results) if base else None
    rows = []
    for c in cases:
        row = {"section": section, "case": c.name, "_required": not c.skip}  # a skipped peer never fails the run
        if c.results and not c.error:
            sec = statistics.median(m.seconds for m in c.results)
            nbytes = ctx.token_bytes if c.nbytes is None else c.nbytes
            runs = f"median of {len(c.results)}" if len(c.results) > 1 else "1 run"
            row.update(
                {
                    "wall s": sec,
                    "MB/s": nbytes / 1e6 / sec if nbytes else None,
                    "peak RSS MB": max(m.peak_rss_mb for m in c.results),
                    "ratio": sec / base_s if base_s else None,
                    "note": "; ".join(x for x in (c.note, runs) if x),
                }
            )
        else:
            row["note"] = c.skip or f"FAILED (run {len(c.results) + 1}): {c.error}"
        rows.append(row)
    return rows


def tokpack(*args: str, result: Path | None = None, cold: bool = True) -> Measure:
    return run_measured(tokpack_cmd(*args, result=result), cold=cold)


def from_child(cmd: list[str], result: Path, ctx: Ctx, cold: bool | None = None) -> tuple[Measure, dict]:
    """Runs a child that times its own inner loop into `result` (JSON): that time, with the
    child's peak RSS."""
    result.unlink(missing_ok=True)
    m = run_measured(cmd, cold=ctx.cold if cold is None else cold)
    data = peers.read_result(result)
    return Measure(data["seconds"], m.peak_rss_mb, 0), data


def fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    return path


def empty_dir(path: Path) -> Path:
    fresh(path).mkdir(parents=True)
    return path


# ------------------------------------------------------------------------------------ sections


def permute_in_memory_cmd(corpus: Path, row_bytes: int, result: Path) -> list[str]:
    """The corpus loaded into one buffer (untimed), then every row gathered in a random order
    into a reused 8 MiB buffer with np.take(..., out=, mode="clip") on a void view: the memory
    bound of any in-memory shuffle."""
    files = [str(f) for f in peers.token_files(corpus)]
    return python_cmd(
        "import json, os, time, numpy as np\n"
        f"files, rb = {files!r}, {row_bytes}\n"
        "data = np.empty(sum(os.path.getsize(f) for f in files), np.uint8)\n"
        "pos = 0\n"
        "for f in files:\n"
        "    with open(f, 'rb', buffering=0) as fh:\n"
        "        pos += fh.readinto(memoryview(data)[pos:])\n"
        "rows = data[:len(data) // rb * rb].view(np.dtype((np.void, rb)))\n"
        "perm = np.random.default_rng(0).permutation(len(rows))\n"
        "k = max(1, (8 << 20) // rb)\n"
        "buf = np.empty(k, rows.dtype)\n"
        "t = time.perf_counter()\n"
        "for i in range(0, len(rows), k):\n"
        "    idx = perm[i:i + k]\n"
        "    np.take(rows, idx, out=buf[:len(idx)], mode='clip')\n"
        "seconds = time.perf_counter() - t\n"
        f"json.dump({{'seconds': seconds, 'bytes': len(rows) * rb}}, open({str(result)!r}, 'w'))\n"
    )


def section_baseline(ctx: Ctx) -> list[dict]:
    result = ctx.work / "perm.json"
    cases = [
        Case("cold sequential read (cat)", lambda: cold_read(ctx.corpus), cache_note(ctx)),
        Case("cp -r + sync", lambda: cp_sync(ctx.corpus, ctx.work / "cp"), cache_note(ctx)),
        Case(
            "in-memory row permutation",
            lambda: from_child(permute_in_memory_cmd(ctx.corpus, (SEQ_LEN + 1) * 2, result), result, ctx, cold=False)[
                0
            ],
            f"np.take(mode='clip') of {SEQ_LEN + 1}-token rows into a reused 8 MiB buffer; gather timed in-process",
        ),
    ]
    rows = measure("baseline", cases, ctx, baseline="cold sequential read (cat)")
    shutil.rmtree(ctx.work / "cp", ignore_errors=True)
    return rows


def section_pack(ctx: Ctx) -> list[dict]:
    inputs = ctx.work / "pack-inputs"
    megatron = peers.prepare_megatron(ctx.corpus, inputs / "megatron" / "corpus")
    parquet = peers.prepare_parquet(ctx.corpus, inputs / "parquet")
    out = ctx.work / "packed"
    common_args = ["--eos-id", str(EOS_ID), "--vocab-size", str(VOCAB), "--workers", str(ctx.workers)]

    def pack(src: str, fmt: str, *extra: str) -> Callable[[], Measure]:
        return lambda: tokpack("pack", src, "-o", str(fresh(out)), "--format", fmt, *common_args, *extra, cold=ctx.cold)

    cases = [
        Case("cp -r + sync", lambda: cp_sync(ctx.corpus, ctx.work / "cp"), cache_note(ctx)),
        Case("tokpack pack datatrove .ds", pack(str(ctx.corpus), "datatrove"), f"--workers {ctx.workers}"),
        Case("tokpack pack Megatron .bin/.idx", pack(str(megatron), "megatron"), "one .bin/.idx pair"),
        Case(
            "tokpack pack Parquet",
            pack(str(parquet), "parquet", "--column", "input_ids"),
            "list<int32> input_ids, one row per document",
        ),
    ]
    rows = measure("pack", cases, ctx, baseline="cp -r + sync")
    shutil.rmtree(ctx.work / "cp", ignore_errors=True)
    shutil.rmtree(inputs, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    return rows


def ensure_source(ctx: Ctx) -> Path:
    """The packed source: `tokpack pack` of the corpus (untimed), or written directly if pack fails."""
    if ctx.source is None:
        ctx.source, ctx.source_note = scaling.make_source(ctx.corpus, ctx.work / "source", EOS_ID, VOCAB)
    return ctx.source


def in_memory_budget(ctx: Ctx) -> int:
    return int(ctx.token_bytes * 1.1) + (96 << 20)


def ensure_run(ctx: Ctx) -> Path | None:
    """One shuffled run (epoch 0) of the source, for the read and validate sections (untimed)."""
    if ctx.run_dir is None:
        run_dir = fresh(ctx.work / "run")
        try:
            tokpack(
                "shuffle",
                str(ensure_source(ctx)),
                "-o",
                str(run_dir),
                "--seq-len",
                str(SEQ_LEN),
                "--seed",
                "0",
                "--epochs",
                "1",
                "--memory",
                str(in_memory_budget(ctx)),
                cold=False,
            )
            ctx.run_dir = run_dir
        except RuntimeError as e:
            ctx.run_error = first_line(e)
    return ctx.run_dir


def section_shuffle(ctx: Ctx) -> list[dict]:
    ensure_source(ctx)
    out, result = ctx.work / "shuffled", ctx.work / "shuffle.json"
    in_memory = in_memory_budget(ctx)
    out_of_core = max(1 << 20, ctx.token_bytes // 8)

    def shuffle(memory: int) -> Callable[[], Measure]:
        def run() -> Measure:
            m = tokpack(
                "shuffle",
                str(ctx.source),
                "-o",
                str(fresh(out)),
                "--seq-len",
                str(SEQ_LEN),
                "--seed",
                "0",
                "--epochs",
                "1",
                "--memory",
                str(memory),
                "--workers",
                str(ctx.workers),
                result=result,
                cold=ctx.cold,
            )
            path = summary_of(result).get("path")
            if path not in ("in-memory", "out-of-core"):
                raise RuntimeError(f"tokpack shuffle --json reported path {path!r}")
            paths[memory] = path
            return m

        return run

    paths: dict[int, str] = {}
    hf_arrow, hf_scratch = ctx.work / "hf-windows.arrow", ctx.work / "hf-cache"
    hf_missing = peers.missing("datasets")
    if not hf_missing:
        peers.prepare_hf_windows(ctx.corpus, hf_arrow, SEQ_LEN)
    lit_missing = peers.missing("litdata")
    peer_out = ctx.work / "peer-out"
    cases = [
        Case("cp -r + sync", lambda: cp_sync(ctx.source, ctx.work / "cp"), cache_note(ctx)),
        Case("tokpack shuffle in memory", shuffle(in_memory), f"--memory {in_memory >> 20}MiB"),
        Case("tokpack shuffle out of core", shuffle(out_of_core), f"--memory {out_of_core >> 20}MiB = data/8"),
        Case(
            "datatrove DocumentTokenizerMerger(shuffle=True)",
            lambda: run_measured(peers.datatrove_merger_cmd(ctx.corpus, fresh(peer_out)), cold=ctx.cold),
            "interleaves whole documents; no window shuffle",
        ),
        Case(
            "HF datasets shuffle().flatten_indices().save_to_disk()",
            lambda: run_measured(peers.hf_shuffle_cmd(hf_arrow, fresh(peer_out), empty_dir(hf_scratch)), cold=ctx.cold),
            f"over {SEQ_LEN + 1}-token windows (Arrow, memory-mapped)",
            skip=hf_missing and f"HF datasets {hf_missing}",
        ),
        Case(
            "litdata optimize(TokensLoader)",
            lambda: run_measured(
                peers.litdata_optimize_cmd(ctx.corpus, fresh(peer_out), SEQ_LEN, ctx.workers), cold=ctx.cold
            ),
            "conversion only: litdata shuffles at load time (StreamingDataset(shuffle=True))",
            skip=lit_missing and f"litdata {lit_missing}",
        ),
    ]
    rows = measure("shuffle", cases, ctx, baseline="cp -r + sync")
    for r, memory in zip(rows[1:3], (in_memory, out_of_core)):
        if r.get("wall s") is not None:
            r["note"] += f"; took the {paths.get(memory)} path"
    rows[0]["note"] = f"{rows[0].get('note', '')}; {ctx.source_note}".strip("; ")
    for p in (ctx.work / "cp", peer_out, hf_arrow, hf_scratch):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    return rows


def reader_cmd(epoch: Path, virtual_dir: Path, start: int, samples: int, result: Path) -> list[str]:
    """Rank 0 of W=1 reads the `samples` samples of `epoch` placed at chained sample `start`:
    a virtual epoch (SampleReader.from_manifests) in `virtual_dir`, whose first shard
    `filler.ds` is a sparse file of `start` samples, never read, followed by the real shards
    (hard links: a manifest names files inside its own folder only). The shard table has the
    same size for every start, so only the step number differs between the cases."""
    return python_cmd(
        "import json, time\n"
        "from pathlib import Path\n"
        "from tokpack.formats.reading import read_manifest\n"
        "from tokpack.loader.reader import SampleReader\n"
        f"e, start = Path({str(epoch)!r}), {start}\n"
        "m = read_manifest(e, kind='epoch')\n"
        "rb = (int(m['seq_len']) + 1) * int(m['token_size'])\n"
        "shards = [{'path': 'filler.ds', 'samples': start, 'bytes': start * rb}]\n"
        "shards += m['shards']\n"
        "virtual = {**m, 'samples': start + int(m['samples']), 'shards': shards}\n"
        "virtual.pop('shard_samples', None)\n"
        f"reader = SampleReader.from_manifests([({str(virtual_dir)!r}, virtual)])\n"
        "t = time.perf_counter()\n"
        "n = 0\n"
        f"for rows in reader.batches(0, 1, 1, start=start, steps={samples}, copy=False):\n"
        "    n += rows.nbytes\n"
        "seconds = time.perf_counter() - t\n"
        f"json.dump({{'seconds': seconds, 'bytes': n}}, open({str(result)!r}, 'w'))\n"
    )


def epoch_info(run_dir: Path) -> tuple[Path, int, int]:
    """(epoch 0 dir, samples, shard bytes) of a shuffled run."""
    from tokpack.formats.names import epoch_dir_name
    from tokpack.formats.reading import read_manifest

    e = run_dir / epoch_dir_name(read_manifest(run_dir, kind="run")["epochs"][0])
    m = read_manifest(e, kind="epoch")
    return e, int(m["samples"]), sum(int(s["bytes"]) for s in m["shards"])


def section_read(ctx: Ctx) -> list[dict]:
    if ensure_run(ctx) is None:
        return [
            {
                "section": "read",
                "case": "tokpack reader",
                "_required": True,
                "note": f"FAILED: no shuffled run to read: {ctx.run_error}",
            }
        ]
    epoch, samples, nbytes = epoch_info(ctx.run_dir)
    row_bytes = nbytes // samples
    result = ctx.work / "read.json"

    def read(step: int) -> Callable[[], Measure]:
        g = step * GBS
        vdir = ctx.work / f"virtual-{step}"
        vdir.mkdir(exist_ok=True)
        for f in epoch.iterdir():
            if ".ds" in f.name and not (vdir / f.name).exists():
                os.link(f, vdir / f.name)
        with open(vdir / "filler.ds", "wb") as f:  # sparse: holes take no disk and are never read
            f.truncate(g * row_bytes)

        def run() -> Measure:
            result.unlink(missing_ok=True)
            m = run_measured(reader_cmd(epoch, vdir, g, samples, result), cold=ctx.cold)
            got = peers.read_result(result)["bytes"]
            if got != nbytes:
                raise RuntimeError(f"reader returned {got} bytes, expected {nbytes}")
            return m

        return run

    cases = [Case("cold cat of the epoch shards", lambda: cold_read(epoch), cache_note(ctx), nbytes=nbytes)]
    for step in [0, *STEPS]:
        cases.append(
            Case(
                f"tokpack reader from step {step:,}",
                read(step),
                f"rank 0 of W=1 from sample {step * GBS:,} (step x GBS {GBS}); reads the epoch's "
                f"{samples:,} samples, placed after a sparse shard of the skipped samples",
                nbytes=nbytes,
            )
        )
    rows = measure("read", cases, ctx, baseline="cold cat of the epoch shards")
    for step, r in zip([0, *STEPS], rows[1:]):
        ctx.reader_rss[step] = r.get("peak RSS MB")
    for d in ctx.work.glob("virtual-*"):
        shutil.rmtree(d)
    return rows


def corpus_docs(corpus: Path) -> tuple[int, int]:
    """(documents, mean document length in tokens) of the uint16 corpus."""
    docs = max(1, dir_bytes(corpus, ".ds.index") // 8)
    return docs, max(1, dir_bytes(corpus, ".ds") // 2 // docs)


def mem_available() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 8 << 30


def section_index(ctx: Ctx) -> list[dict]:
    """What a step-indexed loader holds per rank at the incident's step counts, and how long a
    Megatron-style index takes to build. One run each: the figures are sizes, not races."""
    docs, mean_doc = corpus_docs(ctx.corpus)
    cap_note = f"allocation capped at {ctx.index_cap / 1e9:.2g} GB to fit this machine"
    # The build is timed on at most 2 GiB of index and scaled: a bigger one only takes longer.
    build_cap = min(ctx.index_cap, 2 << 30)
    build_note = f"build capped at {build_cap / 1e9:.2g} GB of index"
    rows = []
    for step in STEPS:
        samples = step * GBS
        base_rss = ctx.reader_rss.get(step)
        for style, label in (
            ("nanoset", "Nanoset index (16 B/sample)"),
            ("megatron-gpt", "Megatron GPTDataset index"),
            ("megatron-blended", "Megatron BlendedDataset + GPTDataset index"),
        ):
            need = peers.index_bytes(style, samples, SEQ_LEN, mean_doc)
            result = ctx.work / "index.json"
            row = {"section": "index", "case": f"{label} @ step {step:,}", "_required": True}
            try:
                m, data = from_child(
                    peers.allocate_index_cmd(style, samples, SEQ_LEN, mean_doc, ctx.index_cap, result),
                    result,
                    ctx,
                    cold=False,
                )
                alloc = f"allocated {data['bytes'] / 1e9:.2f} GB" + (
                    f" ({data['scale']:.2%}; {cap_note})" if data["scale"] < 1 else ""
                )
                docs_note = "" if style == "nanoset" else f", document index at {mean_doc:,} tokens/document"
                row.update(
                    {
                        "wall s": m.seconds,
                        "peak RSS MB": m.peak_rss_mb,
                        "ratio": m.peak_rss_mb / base_rss if base_rss else None,
                        "note": f"computed {need / 1e9:,.1f} GB per rank for {samples:,} samples{docs_note}; "
                        f"{alloc}; wall = allocate+touch; ratio = RSS / tokpack reader RSS at this step",
                    }
                )
            except Exception as e:
                row["note"] = f"FAILED: {first_line(e)}"
            rows.append(row)
        result = ctx.work / "build.json"
        row = {"section": "index", "case": f"Megatron-style index build (numpy) @ step {step:,}", "_required": True}
        try:
            m, data = from_child(
                peers.megatron_index_build_cmd(samples, docs, mean_doc, SEQ_LEN, build_cap, result),
                result,
                ctx,
                cold=False,
            )
            scaled = data["scale"] < 1
            row.update(
                {
                    "wall s": m.seconds / data["scale"],
                    "peak RSS MB": m.peak_rss_mb,
                    "note": "document, sample and shuffle index, RandomState.shuffle; "
                    + (
                        f"built {data['scale']:.2%} of it ({build_note}), time scaled up linearly "
                        "(a lower bound: bigger arrays shuffle slower per element)"
                        if scaled
                        else f"built whole ({samples:,} samples)"
                    ),
                }
            )
        except Exception as e:
            row["note"] = f"FAILED: {first_line(e)}"
        rows.append(row)
    return rows


def section_validate(ctx: Ctx) -> list[dict]:
    if ensure_run(ctx) is None:
        return [
            {
                "section": "validate",
                "case": "tokpack validate",
                "_required": True,
                "note": f"FAILED: no shuffled run to validate: {ctx.run_error}",
            }
        ]
    nbytes = dir_bytes(ctx.run_dir, ".ds")
    cases = [
        Case("cold read of the run", lambda: cold_read(ctx.run_dir), cache_note(ctx), nbytes=nbytes),
        Case(
            "tokpack validate",
            lambda: tokpack("validate", str(ctx.run_dir), cold=ctx.cold),
            "checksums + token scan of every shard",
            nbytes=nbytes,
        ),
        Case(
            "tokpack validate --quick",
            lambda: tokpack("validate", "--quick", str(ctx.run_dir), cold=ctx.cold),
            "structure and sizes only: reads no token bytes, so no MB/s",
            nbytes=0,
        ),
    ]
    return measure("validate", cases, ctx, baseline="cold read of the run")


def section_scaling(ctx: Ctx) -> list[dict]:
    for p in (ctx.source, ctx.run_dir):  # the later sections need neither: free the disk for 8 GiB
        if p is not None:
            shutil.rmtree(p, ignore_errors=True)
    ctx.source = ctx.run_dir = None
    return scaling.main(None, ctx.quick, work=ctx.work / "scaling", cold=ctx.cold, runs=ctx.runs)


def script_row(section: str, r: dict) -> dict:
    """A bench script's row in our columns. Scripts name things their own way: known keys map
    to columns, the rest goes to the note as key=value."""

    def first(*keys):
        return next((r[k] for k in keys if r.get(k) is not None), None)

    known = {
        "case",
        "seconds",
        "wall s",
        "MB/s",
        "peak RSS MB",
        "peak RSS MiB",
        "peak_rss_mb",
        "ratio",
        "ratio to baseline",
        "note",
        "section",
    }
    rest = [(k, v) for k, v in r.items() if k not in known and not k.startswith("_")]
    case = first("case")
    if case is None and rest:  # e.g. {"loader": ..., "step": ...}: the first two fields name the row
        case, rest = " ".join(str(v) for _, v in rest[:2]), rest[2:]
    extra = ", ".join(f"{k}={v:,.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in rest)
    return {
        "section": section,
        "case": case or "?",
        "wall s": first("wall s", "seconds"),
        "MB/s": first("MB/s"),
        "peak RSS MB": first("peak RSS MB", "peak RSS MiB", "peak_rss_mb"),
        "ratio": first("ratio", "ratio to baseline"),
        "note": "; ".join(x for x in (first("note"), extra) if x),
        "_required": False,
    }


def section_scripts(ctx: Ctx, size: str) -> list[dict]:
    """The other bench scripts' own rows (each makes its own corpus of `size` unless its main()
    accepts `corpus=`). A missing script is shown; one that raises fails the run."""
    rows = []
    # The fault soak's --quick (a few kills) is a smoke run; a full soak (bench/soak.py --kills 500)
    # takes over an hour and is run on its own. Likewise the scale model's tiny model and its full one, and
    # bench/nodes.py and bench/rounds.py (their full sizes hold a node's rows in memory: run on their own).
    for name in SCRIPTS + (["soak", "scale_model", "nodes", "rounds"] if ctx.quick else []):
        section = f"{name}.py"
        if not (BENCH / f"{name}.py").exists():
            rows.append(
                {"section": section, "case": "-", "_required": False, "note": f"bench/{name}.py does not exist"}
            )
            continue
        t = time.perf_counter()
        try:
            main = importlib.import_module(f"bench.{name}").main
            kwargs = {"quick": ctx.quick}
            params = inspect.signature(main).parameters
            if "corpus" in params:
                kwargs["corpus"] = ctx.corpus
            for key in ("workdir", "work"):  # their scratch goes under ours, removed with it
                if key in params:
                    kwargs[key] = (ctx.work / f"script-{name}").resolve()
                    kwargs[key].mkdir(parents=True, exist_ok=True)
                    if key == "workdir":
                        kwargs[key] = str(kwargs[key])
            got = main(parse_size(size), **kwargs)
        except BaseException as e:  # SystemExit from argparse-style mains too
            rows.append(
                {
                    "section": section,
                    "case": "main()",
                    "_required": True,
                    "note": f"FAILED: bench/{name}.py main() raised {type(e).__name__}: {first_line(e)}",
                }
            )
            continue
        for r in got or []:
            rows.append(script_row(section, r))
        if not got:
            rows.append(
                {
                    "section": section,
                    "case": "main()",
                    "_required": True,
                    "note": f"FAILED: bench/{name}.py main() returned no rows",
                }
            )
        print(f"run_all: bench/{name}.py took {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    return rows


# ----------------------------------------------------------------------------------------- main


def number_missing(row: dict) -> bool:
    return row.get("_required", True) and not isinstance(row.get("wall s"), (int, float))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default=None, help=f"corpus size [default: 4GiB; {QUICK_SIZE} with --quick]")
    ap.add_argument("--quick", action="store_true", help="tiny corpus, one run: the CI smoke run")
    ap.add_argument("--runs", type=int, default=None, help="timed runs per case [default: 3; 1 with --quick]")
    ap.add_argument("--workers", type=int, default=1, help="--workers for tokpack and litdata [default: 1]")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument(
        "--index-cap",
        default=None,
        help="most memory one index allocation may take [default: 16GiB or 60%% of MemAvailable, "
        "whichever is less; 16MiB with --quick]",
    )
    ap.add_argument("--work", default=None, help="scratch folder [default: a new temp dir, removed at the end]")
    ap.add_argument("--out", default=str(BENCH / "results" / "run_all.md"), help="where the table is written too")
    ap.add_argument("--debug", action="store_true", help="print tracebacks of failing cases")
    args = ap.parse_args(argv)
    global DEBUG
    DEBUG = args.debug
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    size = args.size or (QUICK_SIZE if args.quick else "4GiB")
    runs = args.runs or (1 if args.quick else 3)
    if args.index_cap:
        cap = parse_size(args.index_cap)
    else:
        cap = QUICK_INDEX_CAP if args.quick else min(16 << 30, int(mem_available() * 0.6))
    work = Path(args.work or tempfile.mkdtemp(prefix="tokpack-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows: list[dict] = []
    try:
        corpus = make_datatrove_corpus(work / "corpus", parse_size(size))
        ctx = Ctx(work, corpus, dir_bytes(corpus, ".ds"), runs, args.quick, can_drop_caches(), args.workers, cap)
        print(
            f"run_all: corpus {ctx.token_bytes / 2**20:.1f} MiB of uint16 tokens in {work}, {runs} run(s) per "
            f"case, {cache_note(ctx)}",
            file=sys.stderr,
            flush=True,
        )
        runners = {
            "baseline": section_baseline,
            "pack": section_pack,
            "shuffle": section_shuffle,
            "read": section_read,
            "index": section_index,
            "validate": section_validate,
            "scaling": section_scaling,
            "scripts": lambda c: section_scripts(c, size),
        }
        for name in SECTIONS:
            if name not in sections:
                continue
            ts = time.perf_counter()
            try:
                rows += runners[name](ctx)
            except Exception as e:  # a section's own setup failed: one row says so, the rest still run
                if DEBUG:
                    traceback.print_exc()
                rows.append(
                    {
                        "section": name,
                        "case": "(section)",
                        "_required": True,
                        "note": f"FAILED: {type(e).__name__}: {first_line(e)}",
                    }
                )
            print(f"run_all: {name} done in {time.perf_counter() - ts:.1f} s", file=sys.stderr, flush=True)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    command = "python bench/run_all.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    title = f"tokpack benchmarks, {size} corpus, seq_len {SEQ_LEN}"
    table = print_table(title, rows, COLUMNS)
    missing = [f"{r['section']}: {r['case']}" for r in rows if number_missing(r)]
    footer = [
        f"Machine: {machine_line()}",
        f"Command: `{command.strip()}`",
        f"Page cache: {'dropped before every timed run' if can_drop_caches() else 'warm (not root)'}; "
        f"{runs} run(s) per case, cases alternated round-robin, medians quoted",
        "MB/s counts token bytes. ratio = wall time / the section's first row (lower is faster); index "
        "rows: peak RSS / the tokpack reader's at the same step; scaling rows: wall / the fitted line",
        f"Total wall time: {time.perf_counter() - t0:.0f} s",
    ]
    print("\n".join(footer))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table + "\n\n" + "\n".join(f"- {x}" for x in footer) + "\n")
    if missing:
        print(f"run_all: {len(missing)} row(s) without a number:\n  " + "\n  ".join(missing), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
