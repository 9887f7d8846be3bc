"""Loader wait in a training loop (issue 34, item 4): how long `next(loader)` keeps a training
step waiting, as a share of the step, for tokpack and its peers on the same tokens, from a
start at step 0 and at the incident's step 3,200,000 (global batch 576, seq_len 4096).

    python bench/train_loop.py [--size 1GiB] [--step-ms 100] [--steps 200] [--quick]

The loop (one child process per loader and start, so each one's peak RSS is its own):

    it = iter(loader)                   # time to first batch runs from building the loader ...
    batch = next(it)                    # ... to this batch
    for each timed step:
        t = perf_counter(); batch = next(it); wait += perf_counter() - t   # only the wait is timed
        sleep(step)                     # the simulated step

The simulated step is a fixed `time.sleep(--step-ms)` (100 ms; 10 ms with --quick): a GPU step
leaves the host CPU to the loader's workers, which a CPU-bound stand-in on this 2-core machine
would not. 100 ms is short for 9 x 4096 tokens a rank (a 1B model on an H100 takes ~0.5 s), so
the shares are an upper bound; `wait ms` (mean) and `median ms` are per step and do not depend
on the step length for a loader that prefetches. `wait %` = total wait / (total wait + total
step), over the steps after the first batch; tokens/s = input tokens served / that loop's wall
time. On a shared machine one descheduled `next()` (see `max wait` in the note) moves the mean;
the median is the steadier figure.

Every loader is one data-parallel rank taking m = 9 rows of seq_len + 1 tokens a step (rank 0
of W = 64 at GBS 576), yielding int64 tensors of token ids and position ids (from EOS):
- tokpack `TokpackDataset(rank=0, world_size=64, micro_batch=9, start_sample=step*576)` through
  torchdata's `StatefulDataLoader`, 0 and 2 workers. The run is virtual, as in bench/read.py: an
  epoch description of 12,502 shard entries that all name one sparse file whose first rows are
  the real epoch's, read by `SampleReader.from_manifests` (the dataset's reader is that one; a
  description on disk would need the totals of 15 TB of shards). Both starts read the same real
  rows at the same file offsets.
- datatrove `DatatroveFolderDataset(..., return_positions=True, positions_from_eos_token_id=0)`
  over the same shard file, through a torch DataLoader (2 workers) whose batch sampler yields
  rank 0's Megatron-order indices from consumed_samples = step*576, as nanotron's
  MegatronPretrainingSampler does. The start at 3.2M puts a sparse filler file of step*576
  rows (15 TB of holes, never read) before the shard, so the same rows are read.
  (Positions from the .ds.index instead of EOS re-read the index from its first entry on the
  first access, DatatroveFileDataset._get_pos_from_index_file: O(step) at a start; not run.)
- MosaicML streaming `StreamingDataset(local=MDS copy, shuffle=False, batch_size=9)` through
  its `StreamingDataLoader` (2 workers), one rank. Its start at 3.2M is its resume API,
  `load_state_dict({"epoch", "sample_in_epoch", ...})`, in epoch step*576 // N of the N real
  rows: each resume partitions the whole epoch into an int64 array over all of its samples
  (streaming/base/partition), which an epoch holding sample 1.84e9 cannot fit here. A second
  table times that partition at 1e6-5e7 samples and extrapolates it to such an epoch: its start
  cost and memory grow with the epoch's sample count (the run's length), not with the step.
- litdata `StreamingDataset(optimize() output, TokensLoader(block_size=4097))` through its
  `StreamingDataLoader` (2 workers), one rank; the start at 3.2M is its `load_state_dict` with
  `current_epoch` / `num_samples_yielded` patched into a state the loader itself produced, in
  the same epoch-of-the-real-rows form as MosaicML's.
Installing MosaicML streaming: its requirements pin numpy<2.2 and pull torchvision, azure, oci
and transformers, so it is not in the bench extra; `pip install --no-deps mosaicml-streaming==0.13.0
brotli python-snappy cramjam zstd catalogue` is what its StreamingDataset and MDSWriter import.
torchvision: MosaicML streaming's package imports its vision datasets (torchvision) at import;
the only torchvision wheels here are CUDA builds that do not load against the CPU torch, so its
child stubs `torchvision.datasets.VisionDataset` before the import (only the text path is used).

- the hand-off's floor: a dataset that yields, each step, one fresh tensor of the bytes of
  tokpack's batch (its four [m, seq_len] int64 fields), never written, made in shared memory
  with workers (where a tensor goes to cross from a worker), through the same StatefulDataLoader: nothing
  read, computed or copied, so its wait is what any batch pays to cross from a worker (0 and 2
  workers; it has no data, so no start step and no data row).

Peers that are not installed get a row saying so. --quick (tiny epoch, a few steps) is what
tests/test_bench_train_loop.py runs: it checks that every row has its numbers, never how fast.
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
from bench.common import REPO, machine_line, parse_size, print_table, python_cmd, run_measured  # noqa: E402
from bench.peers import missing  # noqa: E402
from bench.read import GBS, ROW_BYTES, SEQ_LEN, VIRTUAL_SHARD_SAMPLES, make_epoch, make_virtual_shard  # noqa: E402

WORLD = 64  # data-parallel ranks at the incident's global batch
MICRO = GBS // WORLD  # 9 rows a step for rank 0
STARTS = (0, 3_200_000)  # the steps each loader starts at
N_SHARDS = STARTS[-1] * GBS // VIRTUAL_SHARD_SAMPLES + 2  # the virtual epoch: past the later start and its reads
COLUMNS = [
    "loader",
    "start step",
    "workers",
    "first batch s",
    "wait ms",
    "median ms",
    "wait %",
    "tokens/s",
    "peak RSS MiB",
    "note",
]
NUMBERS = ["first batch s", "wait ms", "median ms", "wait %", "tokens/s", "peak RSS MiB"]  # every row must have these

# The loop every child runs after building `loader` (set up by the child's own preamble, which
# also sets `t_build`): the first batch, then `steps` timed waits each followed by the step.
# Peak RSS is each process's own VmHWM (wait4's would start at the launcher's, bench/read.py),
# the main process's plus its DataLoader workers', read while the workers are still alive.
LOOP = """
import time as _t
def _hwm(pid):
    try:
        return int([x.split()[1] for x in open(f"/proc/{pid}/status") if x.startswith("VmHWM")][0]) / 1024
    except (OSError, IndexError):
        return 0.0
def _children(pid):
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            out += [int(c) for c in open(f"/proc/{pid}/task/{task}/children").read().split()]
        except OSError:
            pass
    return out + [g for c in out for g in _children(c)]
it = iter(loader)
first = AS_BATCH(next(it))
t_first = _t.perf_counter() - t_build
tokens_per_batch = int(first[TOKENS].shape[0]) * SEQ_LEN
waits, tokens = [], 0
t_loop = _t.perf_counter()
for _ in range(STEPS):
    t = _t.perf_counter()
    batch = AS_BATCH(next(it))
    waits.append(_t.perf_counter() - t)
    assert batch[TOKENS].shape[0] == MICRO and batch[TOKENS].shape[1] >= SEQ_LEN, batch[TOKENS].shape
    assert POSITIONS in batch, sorted(batch)
    tokens += int(batch[TOKENS].shape[0]) * SEQ_LEN
    _t.sleep(STEP_S)
loop_s = _t.perf_counter() - t_loop
workers = _children(os.getpid())
rss_main = _hwm(os.getpid())
rss = rss_main + sum(_hwm(c) for c in workers)
json.dump({"head": [int(x) for x in first[TOKENS][0][:8]], "start_row": START_ROW, "first_s": t_first, "wait_s": sum(waits), "waits": waits, "loop_s": loop_s, "tokens": tokens,
           "steps": len(waits), "rss_mb": rss, "rss_main_mb": rss_main, "processes": 1 + len(workers)}, open(RESULT, "w"))
del it
"""

PREAMBLE = """
import json, os, sys, time
import numpy as np
import torch
torch.set_num_threads(1)
RESULT, STEPS, STEP_S, SEQ_LEN, MICRO = {result!r}, {steps}, {step_s}, {seq}, {micro}
START, GBS, WORLD = {start}, {gbs}, {world}
AS_BATCH = lambda batch: batch  # the floor's one tensor viewed as the fields (FLOOR)
"""

TOKPACK = """
from torchdata.stateful_dataloader import StatefulDataLoader
from tokpack.loader.reader import SampleReader
from tokpack.loader.torch_adapter import TokpackDataset
TOKENS, POSITIONS = "input_ids", "position_ids"
shard = {shard}
manifest = {{"format": "tokpack", "version": 1, "kind": "epoch", "seq_len": SEQ_LEN, "dtype": "uint16",
            "token_size": 2, "eos_id": 0, "samples": {n_shards} * shard, "shard_samples": shard,
            "shards": [{{"path": "00000.ds", "samples": shard, "bytes": shard * {row_bytes}}}] * {n_shards}}}
t_build = time.perf_counter()
ds = TokpackDataset({epoch!r}, rank=0, world_size=WORLD, micro_batch=MICRO, positions="eos")
# The run is virtual (module docstring): the dataset reads it through the reader of its description.
ds.reader = SampleReader.from_manifests([({vdir!r}, manifest)])
ds.consumed = ds.reader.start_from(start_sample=START)
loader = StatefulDataLoader(ds, batch_size=None, num_workers={workers})
START_ROW = 0  # both starts land at offset 0 of the virtual shard
"""

FLOOR = """
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader
TOKENS, POSITIONS = "input_ids", "position_ids"
FIELD = MICRO * SEQ_LEN  # int64 values of one [m, seq_len] field
class Floor(IterableDataset):
    # One fresh tensor a step of tokpack's batch's bytes, never written: in a worker, made in
    # shared memory (where it must go to cross); without workers, plain memory (nothing crosses).
    def __iter__(self):
        from torch.utils.data import get_worker_info
        shared = get_worker_info() is not None
        while True:
            if shared:
                yield torch.empty(0, dtype=torch.int64).set_(torch.UntypedStorage._new_shared(4 * FIELD * 8))
            else:
                yield torch.empty(4 * FIELD, dtype=torch.int64)
def AS_BATCH(buffer):  # its fields, views of the one tensor, as a tokpack batch would be
    return {{"input_ids": buffer[:FIELD].view(MICRO, SEQ_LEN), "position_ids": buffer[3 * FIELD:].view(MICRO, SEQ_LEN)}}
t_build = time.perf_counter()
loader = StatefulDataLoader(Floor(), batch_size=None, num_workers={workers})
START_ROW = None  # no data: no row to check
"""

DATATROVE = """
from datatrove.utils.dataset import DatatroveFolderDataset
from torch.utils.data import DataLoader
TOKENS, POSITIONS = "input_ids", "positions"
class MegatronOrder:
    # Rank 0's micro-batches from consumed_samples, as nanotron's MegatronPretrainingSampler
    # yields them: global batch b holds samples [G + b*GBS, G + (b+1)*GBS), rank r the r-th m.
    def __init__(self, consumed, n):
        self.consumed, self.n = consumed, n
    def __len__(self):
        return self.n
    def __iter__(self):
        for b in range(self.n):
            lo = self.consumed + b * GBS
            yield list(range(lo, lo + MICRO))
t_build = time.perf_counter()
ds = DatatroveFolderDataset({folder!r}, SEQ_LEN, token_size=2, return_positions=True, positions_from_eos_token_id=0)
loader = DataLoader(ds, batch_sampler=MegatronOrder(START, STEPS + 1), num_workers={workers})
START_ROW = 0  # sample START is the data file's first row, after the filler
"""

# streaming imports its vision datasets, hence torchvision, at `import streaming` (docstring).
MOSAIC = """
import importlib.machinery, types
def _stub(name):
    m = types.ModuleType(name); m.__spec__ = importlib.machinery.ModuleSpec(name, None); sys.modules[name] = m; return m
_tv, _ds, _tr, _trf = (_stub(n) for n in ("torchvision", "torchvision.datasets", "torchvision.transforms",
                                          "torchvision.transforms.functional"))
_ds.VisionDataset, _trf.to_tensor, _tv.datasets, _tv.transforms, _tr.functional = object, None, _ds, _tr, _trf
from streaming import StreamingDataLoader, StreamingDataset
from streaming.base.util import clean_stale_shared_memory
TOKENS, POSITIONS = "input_ids", "positions"
def positions(rows):
    # position ids restarting after each EOS (0), as the other loaders give them
    pos = np.ones_like(rows); pos[:, 0] = 0
    ends = np.nonzero(rows[:, :-1] == 0)
    pos[ends[0], ends[1] + 1] = 0
    idx = np.where(pos == 0, np.arange(rows.shape[1]), 0)
    return np.arange(rows.shape[1]) - np.maximum.accumulate(idx, axis=1)
def collate(samples):
    rows = np.stack([s["tokens"] for s in samples]).astype(np.int64)
    return {{"input_ids": torch.from_numpy(rows), "positions": torch.from_numpy(positions(rows))}}
clean_stale_shared_memory()
t_build = time.perf_counter()
ds = StreamingDataset(local={mds!r}, shuffle=False, batch_size=MICRO, num_canonical_nodes=1)
N = ds.num_samples
epoch, sample = divmod(START, N)
sample = min(sample, N - (STEPS + 1) * MICRO)  # room for the loop's rows in that epoch
START_ROW = sample if START else 0
if START:
    ds.load_state_dict({{"epoch": epoch, "sample_in_epoch": sample, "num_canonical_nodes": 1,
                        "shuffle_seed": ds.shuffle_seed, "initial_physical_nodes": 1}})
loader = StreamingDataLoader(ds, batch_size=MICRO, num_workers={workers}, collate_fn=collate)
"""

LITDATA = """
from litdata import StreamingDataLoader, StreamingDataset
from litdata.streaming.item_loader import TokensLoader
TOKENS, POSITIONS = "input_ids", "positions"
def positions(rows):
    pos = np.ones_like(rows); pos[:, 0] = 0
    ends = np.nonzero(rows[:, :-1] == 0)
    pos[ends[0], ends[1] + 1] = 0
    idx = np.where(pos == 0, np.arange(rows.shape[1]), 0)
    return np.arange(rows.shape[1]) - np.maximum.accumulate(idx, axis=1)
def collate(samples):  # TokensLoader gives numpy blocks for numpy input
    rows = np.stack([np.asarray(s) for s in samples]).astype(np.int64)
    return {{"input_ids": torch.from_numpy(rows), "positions": torch.from_numpy(positions(rows))}}
def make():
    ds = StreamingDataset({lit!r}, item_loader=TokensLoader(block_size=SEQ_LEN + 1), shuffle=False)
    return ds, StreamingDataLoader(ds, batch_size=MICRO, num_workers={workers}, collate_fn=collate)
t_build = time.perf_counter()
ds, loader = make()
if START:
    N = len(ds)
    epoch, sample = divmod(START, N)
    sample = min(sample, N - (STEPS + 1) * MICRO) // MICRO * MICRO  # room for the loop's rows in that epoch
    state = loader.state_dict()  # the loader's own state, with the position it would have there
    state["current_epoch"] = state["dataset"]["current_epoch"] = epoch + 1  # litdata counts epochs from 1
    state["num_samples_yielded"] = state["dataset"]["num_samples_yielded"] = sample
    loader.load_state_dict(state)
START_ROW = None if START else 0  # worker w resumes at sample // workers of its own part of the rows
"""


def _converter(template: str, out: str, **fields) -> None:
    """Runs a peer's conversion in a child (its imports stay out of this process), from a file:
    litdata's optimize() spawns its workers, which must import the row function by name."""
    script = Path(out + ".py")
    script.write_text(template.format(out=out, **fields))
    run_measured([sys.executable, str(script)], cwd=str(REPO), cold=False)
    index = Path(out) / "index.json"
    listed = json.loads(index.read_text()) if index.exists() else {}
    if not (listed.get("chunks") or listed.get("shards")):  # a litdata worker that died: exit status 0, no chunks
        raise RuntimeError(f"{script.name} wrote no chunks or shards to {index}")


MDS_WRITE = """
import importlib.machinery, sys, types
import numpy as np
def _stub(name):
    m = types.ModuleType(name); m.__spec__ = importlib.machinery.ModuleSpec(name, None); sys.modules[name] = m; return m
_tv, _ds, _tr, _trf = (_stub(n) for n in ("torchvision", "torchvision.datasets", "torchvision.transforms",
                                          "torchvision.transforms.functional"))
_ds.VisionDataset, _trf.to_tensor, _tv.datasets, _tv.transforms, _tr.functional = object, None, _ds, _tr, _trf
from streaming import MDSWriter
rows = np.memmap({shard!r}, dtype="<u2", mode="r", shape=({rows}, {row}))
with MDSWriter(out={out!r}, columns={{"tokens": "ndarray:uint16:{row}"}}, size_limit="256mb") as w:
    for r in rows:
        w.write({{"tokens": np.array(r)}})
"""

LIT_WRITE = """
import numpy as np
from litdata import optimize
from litdata.streaming.item_loader import TokensLoader
def rows(lo):
    tokens = np.memmap({shard!r}, dtype="<u2", mode="r", shape=({rows}, {row}))
    for r in tokens[lo:lo + {block}]:
        yield np.array(r)
if __name__ == "__main__":
    optimize(fn=rows, inputs=list(range(0, {rows}, {block})), output_dir={out!r}, chunk_bytes="64MB",
             item_loader=TokensLoader(), num_workers=1, mode="overwrite", verbose=False)
"""


# MosaicML's start cost as a function of the epoch's size: the partition every resume builds
# (StreamingDataset._get_work -> generate_work -> get_partitions), for this bench's shape (one
# rank, 2 workers, batch 9), resuming half-way through the epoch. Its workers then share it.
PARTITION = """
import json, time, importlib.machinery, sys, types
def _stub(name):
    m = types.ModuleType(name); m.__spec__ = importlib.machinery.ModuleSpec(name, None); sys.modules[name] = m; return m
_tv, _ds, _tr, _trf = (_stub(n) for n in ("torchvision", "torchvision.datasets", "torchvision.transforms",
                                          "torchvision.transforms.functional"))
_ds.VisionDataset, _trf.to_tensor, _tv.datasets, _tv.transforms, _tr.functional = object, None, _ds, _tr, _trf
from streaming.base.partition import get_partitions
def hwm():
    return int([x.split()[1] for x in open("/proc/self/status") if x.startswith("VmHWM")][0]) / 1024
before = hwm()
t = time.perf_counter()
ids = get_partitions("orig", {n}, 1, 1, 1, 2, {micro}, drop_first={n} // 2)
seconds = time.perf_counter() - t
json.dump({{"seconds": seconds, "mb": hwm() - before, "entries": int(ids.size)}}, open({result!r}, "w"))
"""


def mosaic_partition_rows(work: Path, quick: bool) -> list[dict]:
    """Time and memory of MosaicML's partition at growing epoch sizes, and the straight line from
    the largest to an epoch that holds the step-3.2M start (its cost is linear in the samples)."""
    target = STARTS[-1] * GBS + GBS
    rows, last = [], None
    for n in (100_000, 1_000_000) if quick else (1_000_000, 10_000_000, 50_000_000):
        result = work / "partition.json"
        result.unlink(missing_ok=True)
        run_measured(python_cmd(PARTITION.format(n=n, micro=MICRO, result=str(result))), cwd=str(REPO), cold=False)
        last = json.loads(result.read_text()) | {"n": n}
        rows.append(
            {"epoch samples": f"{n:,}", "partition s": last["seconds"], "partition MiB": last["mb"], "note": "measured"}
        )
    scale = target / last["n"]
    rows.append(
        {
            "epoch samples": f"{target:,}",
            "partition s": last["seconds"] * scale,
            "partition MiB": last["mb"] * scale,
            "note": f"extrapolated x{scale:,.0f} from {last['n']:,} (an epoch holding the step-3.2M start)",
        }
    )
    for r in rows:  # run_all's scripts section: the case and the seconds in its columns
        r.update(
            {
                "_table": "partition",
                "case": f"MosaicML resume partition, epoch of {r['epoch samples']} samples",
                "seconds": r["partition s"],
            }
        )
    print_table(
        "MosaicML streaming: the partition a resume builds, by the epoch's sample count (one rank, "
        f"2 workers, batch {MICRO}, resuming half-way)",
        rows,
        ["epoch samples", "partition s", "partition MiB", "note"],
    )
    return rows


def _measure(work: Path, body: str, steps: int, step_s: float, start: int, **fields) -> dict:
    result = work / f"loop-{os.getpid()}.json"
    result.unlink(missing_ok=True)
    code = (
        PREAMBLE.format(
            result=str(result), steps=steps, step_s=step_s, seq=SEQ_LEN, micro=MICRO, start=start, gbs=GBS, world=WORLD
        )
        + body.format(**fields)
        + LOOP
    )
    run_measured(
        python_cmd(code),
        cwd=str(REPO),
        cold=False,
        env={"PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"},
    )
    return json.loads(result.read_text())


def _started_right(res: dict, shard: Path, start: int) -> int:
    """The data row the first batch begins with; raises when it is not the row the loader was
    asked to start at (a resume a peer ignored would otherwise time a start at step 0). litdata
    splits the rows between its workers (worker w starts at its own part) and says no row:
    there, a resume must at least not begin where a start at step 0 does."""
    rows = np.memmap(shard, dtype="<u2", mode="r").reshape(-1, SEQ_LEN + 1)
    found = np.flatnonzero((rows[:, :8] == np.asarray(res["head"], dtype="<u2")).all(axis=1))
    at = int(found[0]) if len(found) else -1
    want = res["start_row"]
    if (want is not None and at != want) or (want is None and start and at in (-1, 0)):
        raise RuntimeError(
            f"the first batch begins with data row {at}, not the start's row "
            f"{'(any but row 0)' if want is None else want}"
        )
    return at


def _row(loader: str, step: int, workers: int, res: dict, step_s: float, note: str) -> dict:
    return {
        "loader": loader,
        "start step": f"{step:,}",
        "workers": workers,
        "first batch s": res["first_s"],
        "wait ms": res["wait_s"] / res["steps"] * 1e3,
        "median ms": float(np.median(res["waits"])) * 1e3,
        "wait %": 100 * res["wait_s"] / (res["wait_s"] + res["steps"] * step_s),
        "tokens/s": res["tokens"] / res["loop_s"],
        "peak RSS MiB": res["rss_mb"],
        "note": note
        + f"; max wait {max(res['waits']) * 1e3:.1f} ms"
        + (
            f"; RSS of {res['processes']} processes (main {res['rss_main_mb']:.0f} MiB; shared pages counted in each)"
            if res["processes"] > 1
            else ""
        ),
        # run_all's scripts section: the case, the loop's wall time and the RSS in its columns
        "case": f"{loader}, {workers} workers, from step {step:,}",
        "seconds": res["loop_s"],
    }


LOADERS = ("tokpack", "floor", "datatrove", "streaming", "litdata")


def main(
    size: int,
    quick: bool = False,
    workdir: str | None = None,
    step_ms: float | None = None,
    steps: int | None = None,
    loaders: tuple[str, ...] = LOADERS,
) -> list[dict]:
    step_s = (step_ms if step_ms is not None else (10 if quick else 100)) / 1e3
    work = Path(tempfile.mkdtemp(prefix="tokpack-bench-loop-", dir=workdir))
    rows: list[dict] = []
    try:
        epoch = make_epoch(work / "epoch", size)
        vdir = work / "virtual"
        real = make_virtual_shard(epoch, vdir)  # vdir/00000.ds: the real rows, then holes
        # Rank 0 reads rows b*576 + [0, 9) of each step b from either start (both land at offset 0 of
        # the virtual shard): every timed step must fall in the real rows.
        steps = min(steps or (8 if quick else 200), real // GBS - 1)
        if steps < 1:
            raise SystemExit(f"train_loop: --size gives {real} rows, fewer than 2 global batches of {GBS}")
        print(
            f"# training-loop wait: {real:,} real rows ({real * ROW_BYTES / 2**20:,.0f} MiB), {steps} timed steps "
            f"after the first batch, step = sleep({step_s * 1e3:g} ms), rank 0 of {WORLD}, m={MICRO}; "
            f"{machine_line()}",
            flush=True,
        )
        cases = []
        for workers in (0, 2) if "tokpack" in loaders else ():
            for start in STARTS:
                cases.append(
                    (
                        "tokpack TokpackDataset + StatefulDataLoader",
                        start,
                        workers,
                        TOKPACK,
                        dict(
                            shard=VIRTUAL_SHARD_SAMPLES,
                            n_shards=N_SHARDS,
                            row_bytes=ROW_BYTES,
                            epoch=str(epoch),
                            vdir=str(vdir),
                            workers=workers,
                        ),
                        "virtual run; start_sample = step x 576, O(1)",
                    )
                )
        for workers in (0, 2) if "floor" in loaders else ():
            cases.append(
                (
                    "floor: one tensor of the batch's bytes + StatefulDataLoader",
                    0,
                    workers,
                    FLOOR,
                    dict(workers=workers),
                    "the hand-off alone: nothing read, computed or copied",
                )
            )
        if "datatrove" not in loaders:
            pass
        elif (why := missing("datatrove")) is None:
            for start in STARTS:
                folder = work / f"datatrove-{start}"
                folder.mkdir()
                os.link(vdir / "00000.ds", folder / "00001_data.ds")
                if start:  # sparse: the holes take no disk and are never read
                    with open(folder / "00000_filler.ds", "wb") as f:
                        f.truncate(start * GBS * ROW_BYTES)
                cases.append(
                    (
                        "datatrove DatatroveFolderDataset + DataLoader",
                        start,
                        2,
                        DATATROVE,
                        dict(folder=str(folder), workers=2),
                        "Megatron-order sampler from consumed_samples, O(1)"
                        + ("; a sparse filler of the skipped rows" if start else ""),
                    )
                )
        else:
            rows.append({"loader": "datatrove DatatroveFolderDataset", "note": why, "_absent": True})
        shard = vdir / "00000.ds"
        for name, module, writer, body, key in (
            ("MosaicML streaming StreamingDataset", "streaming", MDS_WRITE, MOSAIC, "mds"),
            ("litdata StreamingDataset", "litdata", LIT_WRITE, LITDATA, "lit"),
        ):
            if module not in loaders:
                continue
            if (why := missing(module)) is not None:
                if module == "streaming":  # not in the bench extra: its own requirements pin numpy<2.2 (docstring)
                    why = (
                        "not installed (pip install --no-deps mosaicml-streaming==0.13.0 brotli python-snappy "
                        "cramjam zstd catalogue)"
                    )
                rows.append({"loader": name, "note": why, "_absent": True})
                continue
            out = work / key
            try:  # untimed: the peer's own copy of the rows the loop reads
                _converter(writer, shard=str(shard), rows=real, row=SEQ_LEN + 1, out=str(out), block=max(1, real // 8))
            except RuntimeError as e:
                rows.append({"loader": name, "note": f"FAILED: conversion: {str(e).splitlines()[0][:200]}"})
                continue
            for start in STARTS:
                cases.append(
                    (
                        f"{name} + StreamingDataLoader",
                        start,
                        2,
                        body,
                        {key: str(out), "workers": 2},
                        "its resume API (load_state_dict), in epoch step*576 // N of the N rows"
                        if start
                        else "one rank, batch 9, shuffle off",
                    )
                )
        for loader, start, workers, body, fields, note in cases:
            try:
                res = _measure(work, body, steps, step_s, start * GBS, **fields)
                if body is not FLOOR:
                    note += f"; first row = data row {_started_right(res, shard, start):,}"
                rows.append(_row(loader, start, workers, res, step_s, note))
            except Exception as e:  # one loader failing leaves its row, saying why
                rows.append(
                    {
                        "loader": loader,
                        "start step": f"{start:,}",
                        "workers": workers,
                        "note": f"FAILED: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__}",
                    }
                )
            print(f"train_loop: {loader} from step {start:,}, {workers} workers: done", file=sys.stderr, flush=True)
        print_table(
            f"Loader wait in a training loop (rank 0 of {WORLD}, m={MICRO}, GBS {GBS}, seq_len {SEQ_LEN}; "
            f"{steps} timed steps, step = sleep({step_s * 1e3:g} ms))",
            [r for r in rows if "_table" not in r],
            COLUMNS,
        )
        if "streaming" in loaders and missing("streaming") is None:
            try:
                rows += mosaic_partition_rows(work, quick)
            except Exception as e:
                rows.append({"_table": "partition", "note": f"FAILED: {str(e).strip().splitlines()[-1][:300]}"})
        return rows
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default=None, help="real rows of the epoch [default: 1GiB; 40MiB with --quick]")
    ap.add_argument("--step-ms", type=float, default=None, help="the simulated step [default: 100; 10 with --quick]")
    ap.add_argument("--steps", type=int, default=None, help="timed steps [default: 200; 8 with --quick]")
    ap.add_argument("--quick", action="store_true", help="a tiny epoch and a few steps: the test's smoke run")
    ap.add_argument("--loaders", default=",".join(LOADERS), help=f"a comma-separated subset of {','.join(LOADERS)}")
    ap.add_argument("--workdir", default=None, help="where to write the epoch (default: $TMPDIR)")
    ap.add_argument("--json", default=None, help="also write the rows to this file (a JSON list)")
    args = ap.parse_args()
    chosen = tuple(x.strip() for x in args.loaders.split(",") if x.strip())
    if unknown := sorted(set(chosen) - set(LOADERS)):
        ap.error(f"unknown loaders {unknown}; choose from {','.join(LOADERS)}")
    got = main(
        parse_size(args.size or ("40MiB" if args.quick else "1GiB")),
        quick=args.quick,
        workdir=args.workdir,
        step_ms=args.step_ms,
        steps=args.steps,
        loaders=chosen,
    )
    if args.json:
        tmp = Path(args.json + ".tmp")  # written whole, then renamed: a reader never sees half a file
        tmp.write_text(json.dumps(got, indent=1))
        os.replace(tmp, args.json)
    bad = [
        r.get("loader", "partition")
        for r in got
        if not r.get("_absent")
        and not all(
            isinstance(r.get(c), (int, float)) for c in (("partition s", "partition MiB") if "_table" in r else NUMBERS)
        )
    ]
    if bad:
        print(f"train_loop: {len(bad)} row(s) without a number: {bad}", file=sys.stderr)
        sys.exit(1)
