"""Node slices (`tokpack stage RUN DEST --ranks A-B --world-size W --micro-batch m`): only the
rows ranks A..B read, one plain file per rank and epoch, served as the full run serves them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import random_docs, require, write_source
from tokpack.formats.errors import TokpackError
from tokpack.formats.constants import MANIFEST
from tokpack.formats.names import epoch_dir_name
from tokpack.formats.slices import RankRows, rank_file_name
from tokpack.loader.reader import SampleReader
from tokpack.packer.cli import main
from tokpack.packer.slicing import stage_slice
from tests.conftest import as_written_before

REPO = Path(__file__).resolve().parents[1]
SEQ = 63
W, M = 4, 3  # global batch 12; the run's epochs (496 samples) are not a multiple of it


def make_run(out: Path, source: Path, epochs, seed: int = 0, seq_len: int = SEQ, shard_samples: int = 12) -> Path:
    from conftest import shuffle_run

    shuffle_run(
        [str(source)],
        str(out),
        seq_len=seq_len,
        seed=seed,
        epochs=list(epochs),
        samples=None,
        tokens=None,
        shard_samples=shard_samples,
        memory=8 << 20,
        jitter=False,
        log=None,
    )
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("slices")
    return write_source(root / "src", random_docs(np.random.default_rng(3), 200, 1000, 0), docs_per_shard=40)


@pytest.fixture(scope="module")
def run(source) -> Path:
    out = make_run(source.parent / "run", source, [0, 1])
    assert json.loads((out / MANIFEST).read_text())["samples"] % (W * M) != 0  # global batches straddle epochs
    return out


def tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "tokpack.lock"
    }


def cli(*args) -> tuple[int, str]:
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res.exit_code, res.output


def stream(reader: SampleReader, rank: int, start: int, positions=None) -> list:
    out = []
    for item in reader.batches(rank, W, M, start, positions=positions, at_end="stop"):
        out.append([x.tolist() for x in item] if positions else item.tolist())
    return out


# ------------------------------------------------------------------ the arithmetic


@settings(max_examples=300, deadline=None)
@given(
    w=st.integers(1, 9),
    m=st.integers(1, 5),
    phase=st.integers(0, 60),
    first=st.integers(0, 200),
    n=st.integers(0, 120),
    a=st.integers(0, 8),
    k=st.integers(1, 4),
    chunk=st.integers(1, 40),
)
def test_rank_arithmetic_equals_counting(w, m, phase, first, n, a, k, chunk):
    """Which samples a node's ranks read, and a sample's row in its rank file, equal a brute
    count over the epoch, for any world size, micro-batch, batch grid, epoch start and size."""
    a, b = min(a, w - 1), min(a + k - 1, w - 1)
    rows = RankRows(w, m, phase)
    owner = [((g - phase) % (w * m)) // m for g in range(first, first + n)]
    got = list(rows.node_positions(first, n, (a, b), chunk))
    assert all(len(arr) <= max(chunk, 1) for arr in got)  # memory: a chunk at most, even when a run is longer
    assert [int(p) for arr in got for p in arr] == [p for p, r in enumerate(owner) if a <= r <= b]
    for p, r in enumerate(owner):
        assert rows.rank_of(first + p) == r and rows.rows(r, first, first + p) == owner[:p].count(r)


@settings(max_examples=200, deadline=None)
@given(
    w=st.integers(1, 9),
    m=st.integers(1, 5),
    start=st.integers(0, 500),
    batches=st.integers(0, 6),
    tail=st.integers(0, 60),
    ranks=st.sets(st.integers(0, 8), min_size=1),
)
def test_one_rank_arithmetic_for_streams_slices_and_stage(w, m, start, batches, tail, ranks):
    """The whole-run stream (StreamState), the number of complete batches a reader serves and
    stage --ranks' shard choice ask RankRows, so they agree with a count of who reads what in
    the global batches from `start`: rank r takes rows [r*m, (r+1)*m) of each."""
    from tokpack.loader.reader import StreamState
    from tokpack.packer.stage_plan import shards_for_ranks

    rows, gb = RankRows(w, m, start), w * m
    end = start + batches * gb + tail % gb
    assert rows.batches(end) == batches and rows.batches(start - 1) == 0
    for r in range(w):
        st_r = StreamState(start, 0, r, w, m, 1, batches)
        for b in range(batches):
            g = st_r.first_sample(b)
            assert g == start + b * gb + r * m and rows.rank_of(g) == r and rows.run_left(g) == m
            assert [rows.rank_of(g + i) for i in range(m)] == [r] * m
            assert st_r.consumed_after(b) == start + (b + 1) * gb
    ranks = sorted(x for x in ranks if x < w) or [0]
    read = {start + b * gb + r * m + i for b in range(batches) for r in ranks for i in range(m)}
    sizes = [7] * (-(-(end - start) // 7))  # shards of 7 samples from `start`
    keep = shards_for_ranks(sizes, start, ranks, rows, end)
    assert keep == [any(start + 7 * j + i in read for i in range(7)) for j in range(len(sizes))]


# ------------------------------------------------------------------ the layout and the reader


@pytest.mark.parametrize("first,last", [(0, 0), (1, 2), (3, 3)])
def test_slice_serves_the_same_batches_as_the_run(run, tmp_path, first, last):
    """Rank 0, middle ranks, the last rank: every batch from several starts, across the epoch
    boundary (a global batch spans it), equal to the full run's, positions from the index too."""
    res = stage_slice(str(run), tmp_path / "s", ranks=f"{first}-{last}", world_size=W, micro_batch=M)
    assert res.epochs == [0, 1] and res.epochs_staged == [0, 1] and res.verified_by == "row hashes"
    full, part = SampleReader.open(run), SampleReader.open(tmp_path / "s")
    n = json.loads((run / MANIFEST).read_text())["samples"]
    for rank in range(first, last + 1):
        for start in (0, 12 * 7, (n // 12) * 12):  # from 0, mid-epoch, the global batch spanning epochs 0-1
            want = stream(full, rank, start, positions="index")
            assert want and stream(part, rank, start, positions="index") == want
    # the slice holds only its ranks' rows: (B-A+1)/W of the samples, give or take a global batch
    kept = sum(
        (tmp_path / "s" / epoch_dir_name(e) / rank_file_name(r)).stat().st_size
        for e in (0, 1)
        for r in range(first, last + 1)
    )
    assert kept == res.bytes_kept == res.rows_kept * (SEQ + 1) * 2
    assert abs(res.rows_kept - 2 * n * (last - first + 1) / W) <= M * (last - first + 1) * 2


def test_sample_reader_opens_a_slice_through_its_table_of_readers(run, tmp_path):
    """SampleReader.open finds the slice reader through tokpack.loader.reader's READERS, in a
    process that imported nothing else of tokpack: no module has to be imported first for its
    reader to register itself (formats/__init__.py imported slices for that, once)."""
    stage_slice(str(run), tmp_path / "s", ranks="1-2", world_size=W, micro_batch=M)
    code = (
        "import sys\nfrom tokpack.loader.reader import READERS, SampleReader\n"
        "assert 'tokpack.loader.slice_reader' not in sys.modules\n"
        f"reader = SampleReader.open({str(tmp_path / 's')!r})\n"
        "print(type(reader).__module__, type(reader).__name__, sorted(READERS))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["tokpack.loader.slice_reader", "SliceReader", "['slice']"]


def test_rank_files_are_the_ranks_rows_in_order_for_datatrove(run, tmp_path):
    """datatrove's own DatatroveFolderDataset on one rank's files (all epochs, shuffle off)
    yields exactly the samples that rank reads, in training order."""
    stage_slice(str(run), tmp_path / "s", ranks="1-2", world_size=W, micro_batch=M)
    full = SampleReader.open(run)
    rows = RankRows(W, M)
    want = [full.read(g)[0].tolist() for g in range(full.total_samples) if rows.rank_of(g) == 2]
    code = (
        "import json\nfrom datatrove.utils.dataset import DatatroveFolderDataset\n"
        f"ds = DatatroveFolderDataset({str(tmp_path / 's')!r}, {SEQ}, filename_pattern='**/{rank_file_name(2)}', "
        "token_size=2, shuffle=False)\n"
        "print(json.dumps([ds[i]['input_ids'].tolist() for i in range(len(ds))]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert json.loads(out.stdout) == want


@pytest.mark.parametrize("workers", [0, 2])
def test_torch_dataset_on_a_slice_equals_the_run(run, tmp_path, workers):
    """TokpackDataset through torchdata's StatefulDataLoader, 0 and 2 workers: the same batches
    and consumed_samples as on the full run, also resumed mid-epoch from a saved state."""
    require("torchdata", "pip install torchdata")
    from torchdata.stateful_dataloader import StatefulDataLoader

    from tokpack.loader.torch_adapter import TokpackDataset

    stage_slice(str(run), tmp_path / "s", ranks="3", world_size=W, micro_batch=M)

    def batches(path, start=0, state=None, take=None):
        ds = TokpackDataset(path, rank=3, world_size=W, micro_batch=M, start_sample=start, at_end="stop")
        loader = StatefulDataLoader(ds, batch_size=None, num_workers=workers)
        if state is not None:
            loader.load_state_dict(state)
        out, saved = [], None
        for i, b in enumerate(loader):
            out.append((b["input_ids"].tolist(), b["position_ids"].tolist(), int(b["consumed_samples"])))
            if take is not None and i + 1 == take:
                saved = loader.state_dict()
                break
        return out, saved

    want, _ = batches(run)
    got, _ = batches(tmp_path / "s")
    assert got == want and len(want) > 40
    head, state = batches(tmp_path / "s", take=10)
    rest, _ = batches(tmp_path / "s", state=state)
    assert head + rest == want
    later, _ = batches(tmp_path / "s", start=want[20][2])
    assert later == want[21:]


def test_a_scheduled_run_across_stages(tmp_path):
    """A run of two schedule stages of unequal epochs: the slice serves the global batch that
    spans the stage boundary as the run does."""
    from tokpack.packer.api import shuffle

    for k, (name, n) in enumerate([("web", 80), ("code", 40)]):
        write_source(tmp_path / name, random_docs(np.random.default_rng(k), n, 1000, 0), docs_per_shard=20)
    (tmp_path / "run.yaml").write_text(
        "seq_len: 31\nseed: 7\nshard_samples: 50\nstages:\n"
        "  - name: a\n    epochs: 1\n    sources: {web: 0.7, code: 0.3}\n"
        "  - name: b\n    tokens: 4K\n    sources: {web: 0.5, code: 0.5}\n"
    )
    shuffle(None, tmp_path / "run", schedule=tmp_path / "run.yaml", memory=1 << 20)
    stage_slice(str(tmp_path / "run"), tmp_path / "s", ranks="2-3", world_size=W, micro_batch=M)
    full, part = SampleReader.open(tmp_path / "run"), SampleReader.open(tmp_path / "s")
    sizes = json.loads((tmp_path / "run" / MANIFEST).read_text())["epoch_samples"]
    assert sizes[0] % (W * M)
    for rank in (2, 3):
        for start in (0, sizes[0] // 12 * 12):
            want = stream(full, rank, start)
            assert want and stream(part, rank, start) == want


def test_a_slice_refuses_what_it_does_not_hold(run, tmp_path):
    """Another world size, micro-batch, rank or batch grid: one line naming the slice's ranks
    and the `tokpack stage` command that makes the right slice."""
    stage_slice(str(run), tmp_path / "s", ranks="1-2", world_size=W, micro_batch=M)
    reader = SampleReader.open(tmp_path / "s")
    for rank, w, m, start in [(1, 8, M, 0), (1, W, 2, 0), (3, W, M, 0), (1, W, M, 5)]:
        with pytest.raises(TokpackError) as e:
            reader.batches(rank, w, m, start)
        line = str(e.value)
        assert "\n" not in line and "ranks 1-2 of world size 4, micro-batch 3" in line
        assert f"tokpack stage {run} " in line and f"--world-size {w} --micro-batch {m}" in line
    from tokpack.loader.torch_adapter import TokpackDataset

    with pytest.raises(TokpackError, match="does not hold that rank"):
        TokpackDataset(tmp_path / "s", rank=0, world_size=W, micro_batch=M)
    code, out = cli("read", tmp_path / "s", "--rank", 0, "--world-size", W, "--micro-batch", M)
    assert code == 1 and "tokpack stage" in out and "Traceback" not in out


def test_a_mismatch_found_at_read_time_hints_the_command_that_restages_this_node(run, tmp_path):
    """A slice staged for micro-batch 3 read with micro-batch 2 (or another world size): the hint
    restages this node, its ranks, in place of this slice (not one rank in a new folder), and
    the command, run as printed, makes the slice that stream reads."""
    dest = tmp_path / "node1"
    code, out = cli("stage", run, dest, "--node", "1/2", "--ranks-per-node", 2, "--micro-batch", M)
    assert code == 0, out
    for rank, w, m, ranks in [(2, W, 2, "2-3"), (3, W, 2, "2-3"), (2, 8, M, "2-3"), (0, W, M, "0-1")]:
        with pytest.raises(TokpackError) as e:
            SampleReader.open(dest).batches(rank, w, m, 0)
        hint = str(e.value).split("HINT: ", 1)[1]
        assert hint == (
            f"restage this node's slice for that stream: `rm -r {dest} && tokpack stage {run} {dest} "
            f"--ranks {ranks} --world-size {w} --micro-batch {m}`"
        )
    code, out = cli("read", dest, "--rank", 3, "--world-size", W, "--micro-batch", 2, "--count", 1)
    command = out.split("HINT: ", 1)[1].strip().split("`")[1]
    done = subprocess.run(
        ["bash", "-c", command],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"),
    )
    assert done.returncode == 0, done.stderr
    assert stream_of(SampleReader.open(dest), 3, W, 2) == stream_of(SampleReader.open(run), 3, W, 2)


def stream_of(reader: SampleReader, rank: int, w: int, m: int) -> list:
    return [batch.tolist() for batch in reader.batches(rank, w, m, 0, at_end="stop")]


@pytest.mark.parametrize("form", [["--node", "1/2", "--ranks-per-node", "2"], ["--ranks", "2-3", "--world-size", "4"]])
def test_a_node_slice_needs_its_micro_batch(run, tmp_path, form):
    """--micro-batch was 1 by default, and a forgotten one showed only when training started:
    a node slice is refused without it (stage and plan stage), nothing written; the shard-level
    --ranks r/W keeps its default."""
    for head in (["stage"], ["plan", "stage"]):
        r = CliRunner().invoke(main, [*head, str(run), str(tmp_path / "s"), *form])
        assert r.exit_code == 2 and "needs --micro-batch M" in r.output and "Traceback" not in r.output, r.output
        assert not (tmp_path / "s").exists()
    assert cli("stage", run, tmp_path / "whole", "--ranks", "1/4")[0] == 0


def test_stage_help_says_node_is_zero_based():
    shown = " ".join(CliRunner().invoke(main, ["stage", "--help"]).output.split())
    assert "node n of N, 0-based: n is 0 to N-1" in shown
    assert "--micro-batch" in shown and "required for a node slice" in shown


# ------------------------------------------------------------------ verified, resumable


def test_a_corrupt_byte_in_the_run_is_caught_and_nothing_kept(run, tmp_path):
    """A byte changed in a row the slice keeps: one line naming the shard and sample; the
    epoch holds no rank file or manifest that could pass for data."""
    bad = tmp_path / "run"
    subprocess.run(["cp", "-r", str(run), str(bad)], check=True)
    shard = bad / epoch_dir_name(1) / "00003.ds"
    raw = bytearray(shard.read_bytes())
    # epoch 1 starts at G = 496 (= 4 mod 12): its sample 8 is rank 0's; row 12 * 3 + 8 = 44
    g = 496 + 44
    assert RankRows(W, M).rank_of(g) == 0
    raw[(44 - 36) * (SEQ + 1) * 2 + 10] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(TokpackError) as e:
        stage_slice(str(bad), tmp_path / "s", ranks="0", world_size=W, micro_batch=M)
    assert "00003.ds" in str(e.value) and "sample 8" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "s" / epoch_dir_name(1) / MANIFEST).exists()
    assert not (tmp_path / "s" / MANIFEST).exists()
    assert not list((tmp_path / "s" / epoch_dir_name(1)).glob("rank-*"))
    # a slice of other ranks never reads that row: it stages, and serves rank 1 as the clean run does
    stage_slice(str(bad), tmp_path / "other", ranks="1", world_size=W, micro_batch=M)
    assert stream(SampleReader.open(tmp_path / "other"), 1, 0) == stream(SampleReader.open(run), 1, 0)
    # a damaged row-hash file is caught by its own checksum
    rows = run.parent / "run2"
    subprocess.run(["cp", "-r", str(run), str(rows)], check=True)
    f = rows / epoch_dir_name(0) / "00000.ds.rows"
    raw = bytearray(f.read_bytes())
    raw[3] ^= 1
    f.write_bytes(bytes(raw))
    with pytest.raises(TokpackError, match="00000.ds.rows .*checksum mismatch in the run"):
        stage_slice(str(rows), tmp_path / "s2", ranks="0", world_size=W, micro_batch=M)


def test_kill_9_during_stage_then_rerun_gives_identical_bytes(run, tmp_path):
    """SIGKILL after the first rank file of epoch 1 is committed; the rerun finishes the slice
    with the bytes of an uninterrupted stage."""
    clean = tmp_path / "clean"
    stage_slice(str(run), clean, ranks="1-2", world_size=W, micro_batch=M)
    script = (
        "import os, signal, sys\nsys.path.insert(0, 'tests')\n"
        "from tokpack.formats.shards import EpochShardWriter\nfrom tokpack.packer.slicing import stage_slice\n"
        "close, calls = EpochShardWriter.close, []\n"
        "def dying(self):\n    out = close(self)\n    calls.append(1)\n"
        "    if len(calls) == 3:\n        os.kill(os.getpid(), signal.SIGKILL)\n    return out\n"
        "EpochShardWriter.close = dying\n"
        f"stage_slice({str(run)!r}, {str(tmp_path / 'dest')!r}, ranks='1-2', world_size={W}, micro_batch={M})\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == -signal.SIGKILL
    dest = tmp_path / "dest"
    assert (dest / epoch_dir_name(0) / MANIFEST).exists() and not (dest / epoch_dir_name(1) / MANIFEST).exists()
    assert not (dest / MANIFEST).exists()
    with pytest.raises(TokpackError):
        SampleReader.open(dest)  # not a slice yet: no manifest vouches for the half-written epoch
    res = stage_slice(str(run), dest, ranks="1-2", world_size=W, micro_batch=M)
    assert res.epochs_in_place == [0] and res.epochs_staged == [1]
    assert tree(dest) == tree(clean)


def test_an_epoch_written_later_is_staged_without_recopying(source, tmp_path):
    """A run still being shuffled: only its complete epochs are staged; the next stage adds
    the new epoch and leaves the others' files untouched (same inode, same mtime)."""
    run = make_run(tmp_path / "run", source, [0])
    (run / epoch_dir_name(1)).mkdir()  # an epoch being written: no manifest, not listed
    (run / epoch_dir_name(1) / "00000.ds").write_bytes(b"partial")
    res = stage_slice(str(run), tmp_path / "s", ranks="0-1", world_size=W, micro_batch=M)
    assert res.epochs == [0]
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (tmp_path / "s" / epoch_dir_name(0)).iterdir()}
    (run / epoch_dir_name(1) / "00000.ds").unlink()
    make_run(run, source, [1])
    res = stage_slice(str(run), tmp_path / "s", ranks="0-1", world_size=W, micro_batch=M)
    assert res.epochs == [0, 1] and res.epochs_staged == [1] and res.epochs_in_place == [0]
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in before} == before
    full, part = SampleReader.open(run), SampleReader.open(tmp_path / "s")
    assert stream(part, 1, 0) == stream(full, 1, 0)


def test_a_slice_of_another_run_or_other_ranks_is_refused(source, run, tmp_path):
    stage_slice(str(run), tmp_path / "s", ranks="0", world_size=W, micro_batch=M)
    other = make_run(tmp_path / "seed1", source, [0, 1], seed=1)
    with pytest.raises(TokpackError, match="slice of another run"):
        stage_slice(str(other), tmp_path / "s", ranks="0", world_size=W, micro_batch=M)
    with pytest.raises(TokpackError, match="slice for other ranks"):
        stage_slice(str(run), tmp_path / "s", ranks="1", world_size=W, micro_batch=M)


@pytest.mark.parametrize("damage", [5, "x", {"seed": [1]}], ids=["int", "string", "odd run"])
def test_a_damaged_slice_manifest_in_dest_is_one_line_and_kept(run, tmp_path, damage):
    """DEST's slice manifest is input too: a `run` edited to a non-object once crashed stage
    (AttributeError, exit 70). Now one line, exit 1, and DEST's files untouched."""
    dest = tmp_path / "s"
    stage_slice(str(run), dest, ranks="0", world_size=W, micro_batch=M)
    m = json.loads((dest / MANIFEST).read_text())
    m["run"] = damage
    (dest / MANIFEST).write_text(json.dumps(m))
    before = tree(dest)
    code, out = cli("stage", run, dest, "--ranks", "0", "--world-size", W, "--micro-batch", M)
    lines = [x for x in out.splitlines() if x.startswith("tokpack")]
    assert code == 1 and len(lines) == 1 and "tokpack.json" in lines[0] and "HINT" in lines[0], out
    assert tree(dest) == before


def test_read_amplification_at_w8_m4(source, tmp_path):
    """Bytes read over bytes kept, counted by the stager, with 1 and 2 ranks a node at W=8,
    m=4 (4 and 8 rows a global batch): at most 1.25 (the rows read, plus 8 bytes of row hash
    per sample of the epoch)."""
    run = make_run(tmp_path / "run", source, [0], seq_len=1023, shard_samples=40)
    for ranks in ("5", "2-3"):
        res = stage_slice(str(run), tmp_path / f"s{ranks}", ranks=ranks, world_size=8, micro_batch=4)
        assert res.rows_kept > 0 and res.bytes_read / res.bytes_kept <= 1.25, res


def test_an_epoch_written_before_row_hashes_stages_from_whole_shards(run, tmp_path):
    """A run written before `.ds.rows`: every shard is read whole and checked against its
    manifest checksum, with one line saying so; the slice is the same."""
    old = tmp_path / "old"
    subprocess.run(["cp", "-r", str(run), str(old)], check=True)
    for e in (0, 1):
        as_written_before(old / epoch_dir_name(e), row_hashes=False)
    lines = []
    res = stage_slice(str(old), tmp_path / "s", ranks="1-2", world_size=W, micro_batch=M, log=lines.append)
    assert res.verified_by == "whole shards" and res.bytes_read > 2 * res.bytes_kept
    assert sum("without row hashes" in line for line in lines) == 2
    stage_slice(str(run), tmp_path / "new", ranks="1-2", world_size=W, micro_batch=M)
    data = lambda root: {k: v for k, v in tree(root).items() if not k.endswith(MANIFEST)}  # noqa: E731
    assert data(tmp_path / "s") == data(tmp_path / "new")  # the manifests name their sources: those differ
    # --against such a run rehashes its shards in blocks: it passes, and a flipped byte is the run's fault
    code, out = cli("validate", tmp_path / "s", "--against", old)
    assert code == 0, out
    shard = old / epoch_dir_name(1) / json.loads((old / epoch_dir_name(1) / MANIFEST).read_text())["shards"][0]["path"]
    raw = bytearray(shard.read_bytes())
    raw[5] ^= 1
    shard.write_bytes(bytes(raw))
    code, out = cli("validate", tmp_path / "s", "--against", old)
    assert code == 1 and "checksum mismatch in the run" in out and str(shard) in out, out


# ------------------------------------------------------------------ the command


def test_cli_node_form_and_rank_form_make_the_same_slice(run, tmp_path):
    code, out = cli("stage", run, tmp_path / "a", "--node", "1/2", "--ranks-per-node", 2, "--micro-batch", M, "--json")
    assert code == 0, out
    summary = json.loads(out)
    assert summary["ranks"] == [2, 3] and summary["world_size"] == 4 and summary["kind"] == "slice"
    code, out = cli("stage", run, tmp_path / "b", "--ranks", "2-3", "--world-size", W, "--micro-batch", M)
    assert code == 0, out
    assert tree(tmp_path / "a") == tree(tmp_path / "b")
    code, out = cli("stage", run, tmp_path / "c", "--ranks", "3-5", "--world-size", W, "--micro-batch", M)
    assert code == 1 and "bad --ranks" in out and "Traceback" not in out


# ------------------------------------------------------------------ validate


def _bump_first_shard_tokens(m):
    m["shards"][0]["tokens"] += 1


@pytest.mark.parametrize(
    "file,edit,wheres",
    [
        ("epoch", {"eos_id": 5000}, {"eos_id"}),
        (
            "epoch",
            lambda m: m.update(vocab_size=m["vocab_size"] + 1),
            {"vocab_size"},
        ),  # the dtype still fits: the run's differs
        ("epoch", {"dtype": "uint32"}, {"dtype", "token_size"}),
        ("epoch", {"tokens": 7}, {"tokens"}),
        ("epoch", _bump_first_shard_tokens, {"shards[0].tokens", "shards[0].bytes", "tokens"}),
        ("root", {"eos_id": 5000}, {"eos_id"}),
        ("root", {"seq_len": 64}, {"seq_len"}),
        ("run", {"eos_id": 5000}, {"eos_id"}),
    ],
    ids=["eos", "vocab", "dtype", "total", "rank-file", "root-eos", "root-seq-len", "run-eos"],
)
def test_validate_applies_every_manifest_invariant_to_slices(run, tmp_path, file, edit, wheres):
    """The dtype, EOS, vocabulary and totals invariants hold for slice manifests as for an
    epoch's (and the run's): each broken one is named, where they once passed with 0 problems."""
    s = tmp_path / "s"
    stage_slice(str(run), s, ranks="1-2", world_size=W, micro_batch=M)
    target = tmp_path / "run-copy" if file == "run" else s
    if file == "run":
        subprocess.run(["cp", "-r", str(run), str(target)], check=True)
    path = (target / epoch_dir_name(0) if file == "epoch" else target) / MANIFEST
    m = json.loads(path.read_text())
    edit(m) if callable(edit) else m.update(edit)
    path.write_text(json.dumps(m, indent=1) + "\n")
    code, out = cli("validate", target, "--json")
    report = json.loads(out)
    assert code == 1 and not report["ok"], out
    assert wheres <= {p["where"] for p in report["problems"] if p["file"] == str(path)}, report["problems"]


def _fewer_rows(m):
    s = m["shards"][1]
    s["samples"] -= 1
    s["tokens"] -= SEQ + 1
    s["bytes"] = s["tokens"] * m["token_size"]
    m["tokens"] -= SEQ + 1


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda m: m.update(micro_batch=M + 1), "slice epoch belongs to another slice"),
        (lambda m: m.update(first_sample=m["first_sample"] + 1), "slice epoch disagrees with its run's numbering"),
        (lambda m: m["shards"][0].update(rank=0), "slice epoch does not list one file per rank, in rank order"),
        (_fewer_rows, "rank file holds the wrong number of samples"),
    ],
    ids=["shape", "numbering", "order", "rows"],
)
def test_the_reader_and_validate_refuse_a_slice_epoch_alike(run, tmp_path, edit, message):
    """The slice epoch's checks are one function: the reader raises its first problem, validate
    reports it, in the same words."""
    s = tmp_path / "s"
    stage_slice(str(run), s, ranks="1-2", world_size=W, micro_batch=M)
    path = s / epoch_dir_name(1) / MANIFEST
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m, indent=1) + "\n")
    with pytest.raises(TokpackError, match=message):
        SampleReader.open(s)
    code, out = cli("validate", s, "--json")
    assert code == 1 and message in {p["message"] for p in json.loads(out)["problems"]}, out


def test_validate_a_slice_alone_and_against_its_run(run, tmp_path):
    """`validate SLICE` checks the rank files against the slice's manifests; `--against RUN`
    proves each holds the run's samples of its rank, in order: a swapped pair of rows, with
    every checksum of the slice rewritten to agree, passes the first and fails the second."""
    from tokpack.formats.shards import EpochShardWriter

    s = tmp_path / "s"
    stage_slice(str(run), s, ranks="1-2", world_size=W, micro_batch=M)
    code, out = cli("validate", s)
    assert code == 0, out
    code, out = cli("validate", s, "--against", run)
    assert code == 0, out
    # the same slice, rows 0 and 1 of rank 2 in epoch 1 swapped and the slice resealed
    d = s / epoch_dir_name(1)
    f = d / rank_file_name(2)
    rows = np.fromfile(f, dtype="<u2").reshape(-1, SEQ + 1)
    rows[[0, 1]] = rows[[1, 0]]
    m = json.loads((d / MANIFEST).read_text())
    w = EpochShardWriter(d, rank_file_name(2), np.dtype("<u2"), SEQ, 0, m["tokenizer"])
    w.write_rows(rows)
    entry = w.close()
    entry["fragments"] = (d / (rank_file_name(2) + ".index")).stat().st_size // 8
    m["shards"] = [s_ if s_["rank"] != 2 else {**entry, "rank": 2} for s_ in m["shards"]]
    (d / MANIFEST).write_text(json.dumps(m, indent=1) + "\n")
    code, out = cli("validate", s)
    assert code == 0, out  # consistent with itself...
    code, out = cli("validate", s, "--against", run)
    assert code != 0 and "rank-00002.ds [row 0]" in out and "rank 2 reads" in out, out  # ...not with the run
    # a byte changed in a rank file: caught by the slice alone
    raw = bytearray((s / epoch_dir_name(0) / rank_file_name(1)).read_bytes())
    raw[100] ^= 1
    (s / epoch_dir_name(0) / rank_file_name(1)).write_bytes(bytes(raw))
    code, out = cli("validate", s)
    row = 100 // ((SEQ + 1) * 2)  # the row the byte is in: its xxh3-64 is no longer its entry in .ds.rows
    assert code != 0 and f"rank-00001.ds [row {row} (byte {row * (SEQ + 1) * 2})]: checksum mismatch" in out, out


def test_validate_against_a_run_holding_another_runs_epoch_refuses_a_slice_staged_from_it(
    source, run, tmp_path, monkeypatch
):
    """A run whose epoch 1 is another run's (seed 7), and a slice staged from it before stage
    refused such a run: `validate SLICE --against RUN` proved the slice's rows against that
    epoch's row hashes and said OK. It now checks each of RUN's epochs against RUN's manifest,
    as `validate RUN` does, and names the field."""
    import shutil

    from tokpack.packer import slicing

    mixed, other = tmp_path / "mixed", make_run(tmp_path / "other", source, [0, 1], seed=7)
    shutil.copytree(run, mixed)
    shutil.rmtree(mixed / epoch_dir_name(1))
    shutil.copytree(other / epoch_dir_name(1), mixed / epoch_dir_name(1))
    monkeypatch.setattr(slicing, "refuse_epoch_of_another_run", lambda *a, **k: None)  # the stage of before
    s = tmp_path / "s"
    stage_slice(str(mixed), s, ranks="1-2", world_size=W, micro_batch=M)
    code, out = cli("validate", s)
    assert code == 0, out  # the slice agrees with itself
    code, out = cli("validate", s, "--against", mixed)
    assert code == 1 and "epoch-00001/tokpack.json [seed]: epoch manifest belongs to another run" in out, out
    code, out = cli("validate", s, "--against", run)
    assert code == 1, out  # against the run it claims, its epoch 1 is another version


def test_plan_stage_predicts_the_slice_and_the_old_path_says_whole_run_copy(run, tmp_path):
    """`plan stage --ranks A-B --world-size W`: the bytes a node keeps and reads, as the stage
    then counts them; the shard-level `--ranks r/W` says on one line that it copies the whole
    run, and why, in plan and in stage."""
    code, out = cli(
        "plan",
        "stage",
        run,
        tmp_path / "s",
        "--ranks",
        "1-2",
        "--world-size",
        W,
        "--micro-batch",
        M,
        "--disk-mbps",
        100,
        "--json",
    )
    assert code == 0, out
    planned = json.loads(out)
    res = stage_slice(str(run), tmp_path / "s", ranks="1-2", world_size=W, micro_batch=M)
    assert planned["bytes_per_node"] == res.bytes_kept
    assert planned["passes"][0]["read_bytes"] == res.bytes_read
    assert planned["read_amplification"] == res.read_amplification
    code, out = cli("plan", "stage", run, tmp_path / "old", "--ranks", "1/4", "--micro-batch", M, "--disk-mbps", 100)
    assert code == 0 and out.count("whole-run copy") == 1 and "--ranks 1 --world-size 4 --micro-batch 3" in out, out
    code, out = cli("stage", run, tmp_path / "old", "--ranks", "1/4", "--micro-batch", M)
    assert code == 0 and out.count("whole-run copy") == 1, out


# ------------------------------------------------------------------ best-fit runs

BW, BM = 4, 2  # global batch 8; the best-fit epochs (250 samples) are not a multiple of it


@pytest.fixture(scope="module")
def packed_run(tmp_path_factory) -> Path:
    from conftest import shuffle_run

    root = tmp_path_factory.mktemp("packed-slices")
    rng = np.random.default_rng(5)
    sources = [
        write_source(root / "big", random_docs(rng, 300, 1000, 0, 30, 60)),
        write_source(root / "small", random_docs(rng, 60, 1000, 0, 1, 400)),
    ]
    shuffle_run(
        [str(s) for s in sources],
        str(root / "run"),
        weights=["2", "1"],
        seq_len=SEQ,
        seed=9,
        epochs=[0, 1],
        samples=250,
        shard_samples=40,
        memory=8 << 20,
        packing="best-fit",
        jitter=False,
        log=None,
    )
    return root / "run"


def packed_batches(path, rank: int, start: int = 0) -> list:
    from tokpack.loader.torch_adapter import TokpackDataset

    ds = TokpackDataset(path, rank=rank, world_size=BW, micro_batch=BM, start_sample=start, at_end="stop")
    return [{k: v.tolist() for k, v in b.items()} for b in ds]


@pytest.mark.parametrize("first,last", [(0, 0), (1, 2), (3, 3)])
def test_a_slice_of_a_best_fit_run_serves_its_masks(packed_run, tmp_path, first, last):
    """A best-fit run's slice carries each rank's padding (`.ds.pad`): TokpackDataset yields the
    same batches as on the run, loss_mask, labels (-100 on padding), position_ids and
    cu_seqlens included, from 0 and from the global batch spanning the epochs; the rank
    files' `.ds.index` gives the run's positions."""
    require("torch", "pip install torch")
    s = tmp_path / "s"
    res = stage_slice(str(packed_run), s, ranks=f"{first}-{last}", world_size=BW, micro_batch=BM)
    assert res.epochs_staged == [0, 1]
    n = json.loads((packed_run / MANIFEST).read_text())["samples"]
    assert n % (BW * BM)
    for e in (0, 1):
        m = json.loads((s / epoch_dir_name(e) / MANIFEST).read_text())
        assert all(
            "pad_xxh3_128" in x and (s / epoch_dir_name(e) / (x["path"] + ".pad")).is_file() for x in m["shards"]
        )
    for rank in range(first, last + 1):
        for start in ((n // 8) * 8, 0):
            want = packed_batches(packed_run, rank, start)
            assert want and packed_batches(s, rank, start) == want
            assert {"loss_mask", "cu_seqlens"} <= set(want[0])
        assert any(0 in row for b in want for row in b["loss_mask"])  # padding is there, and masked alike
        full, part = SampleReader.open(packed_run), SampleReader.open(s)
        got = [[x.tolist() for x in it] for it in part.batches(rank, BW, BM, 0, positions="index", at_end="stop")]
        assert got == [
            [x.tolist() for x in it] for it in full.batches(rank, BW, BM, 0, positions="index", at_end="stop")
        ]


def test_a_best_fit_slice_validates_and_a_flipped_pad_byte_is_caught(packed_run, tmp_path):
    """`validate SLICE` and `--against RUN` pass; a flipped byte in a rank's `.ds.pad` fails
    the first (its checksum), and with the checksum resealed, the second (the run's padding);
    a flipped byte in the run's `.ds.pad` stops the stage with one line, nothing kept."""
    from tokpack.packer.slicing import plan_slice
    from tokpack.packer.stage_plan import Source

    s = tmp_path / "s"
    res = stage_slice(str(packed_run), s, ranks="1-2", world_size=BW, micro_batch=BM)
    planned = plan_slice(Source(str(packed_run)), "1-2", BW, BM)
    assert sum(planned.read.values()) == res.bytes_read  # the rows, the .ds.rows and the .ds.pad read
    again = stage_slice(str(packed_run), s, ranks="1-2", world_size=BW, micro_batch=BM)
    assert again.epochs_in_place == [0, 1] and again.bytes_read == 0
    for args in ((), ("--against", packed_run)):
        code, out = cli("validate", s, *args)
        assert code == 0, out
    d = s / epoch_dir_name(1)
    pad = d / (rank_file_name(2) + ".pad")
    raw = bytearray(pad.read_bytes())
    raw[4 * 3] ^= 1
    pad.write_bytes(bytes(raw))
    code, out = cli("validate", s)
    assert code != 0 and "rank-00002.ds.pad [xxh3_128]: checksum mismatch" in out, out
    import xxhash

    m = json.loads((d / MANIFEST).read_text())
    m["shards"] = [
        {**x, "pad_xxh3_128": xxhash.xxh3_128_hexdigest(bytes(raw))} if x["rank"] == 2 else x for x in m["shards"]
    ]
    (d / MANIFEST).write_text(json.dumps(m, indent=1) + "\n")
    code, out = cli("validate", s)
    assert code == 0, out  # consistent with itself...
    code, out = cli("validate", s, "--against", packed_run)
    assert code != 0 and "rank-00002.ds.pad [row 3]" in out and "padding differs" in out, out  # ...not with the run
    bad = tmp_path / "run"
    subprocess.run(["cp", "-r", str(packed_run), str(bad)], check=True)
    f = bad / epoch_dir_name(0) / "00000.ds.pad"
    raw = bytearray(f.read_bytes())
    raw[0] ^= 1
    f.write_bytes(bytes(raw))
    with pytest.raises(TokpackError) as e:
        stage_slice(str(bad), tmp_path / "s2", ranks="0", world_size=BW, micro_batch=BM)
    assert (
        "00000.ds.pad" in str(e.value) and "checksum mismatch in the run" in str(e.value) and "\n" not in str(e.value)
    )
    assert not (tmp_path / "s2" / MANIFEST).exists() and not list((tmp_path / "s2").rglob("rank-*"))


def test_validate_against_reads_rank_files_in_bounded_memory(tmp_path):
    """`validate SLICE --against RUN` streams: on a slice whose rank files are MBs, the peak of
    Python and numpy allocations stays far below one rank file (it read them whole before), and
    the streamed comparison still finds a flipped byte and a swapped pair of rows."""
    import tracemalloc

    from tokpack.packer.dir_checks import DirReport
    from tokpack.formats.reading import read_manifest
    from tokpack.packer.slice_validation import slice_against_run

    big = write_source(tmp_path / "src", random_docs(np.random.default_rng(4), 600, 1000, 0, 4000, 6000))
    run = make_run(tmp_path / "run", big, [0], seq_len=1023, shard_samples=64)
    s = tmp_path / "s"
    stage_slice(str(run), s, ranks="1", world_size=2, micro_batch=2)
    f = s / epoch_dir_name(0) / rank_file_name(1)
    size = f.stat().st_size
    assert size > 2 << 20
    root = read_manifest(s, kind="slice")

    def against(block=64 << 10) -> list:
        rep = DirReport(path=s)
        slice_against_run(s, root, run, rep, block=block)
        return rep.problems

    tracemalloc.start()
    try:
        assert against() == []
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < size / 8, (peak, size)
    raw = bytearray(f.read_bytes())
    row = 1024 * 2
    raw[row * 100 + 7] ^= 1
    f.write_bytes(bytes(raw))
    problems = against()
    assert len(problems) == 1 and problems[0].where == "row 100", problems
    raw[row * 100 + 7] ^= 1
    raw[row * 300 : row * 301], raw[row * 301 : row * 302] = raw[row * 301 : row * 302], raw[row * 300 : row * 301]
    f.write_bytes(bytes(raw))
    problems = against()
    assert len(problems) == 1 and problems[0].where == "row 300" and "(2 rows differ)" in problems[0].message, problems


# ------------------------------------------------------------------ regular files only


@pytest.mark.parametrize("victim", ["00001.ds", "00001.ds.rows", "00001.ds.pad"])
def test_a_fifo_in_the_run_stops_stage_promptly(packed_run, tmp_path, victim):
    """A FIFO where a run shard's file (tokens, row hashes, padding) should be: `stage --ranks`
    gives one line naming it and exits 1, within the timeout, instead of blocking in open()."""
    from test_containment import one_line, tokpack

    run = tmp_path / "run"
    subprocess.run(["cp", "-r", str(packed_run), str(run)], check=True)
    (run / epoch_dir_name(0) / victim).unlink()
    os.mkfifo(run / epoch_dir_name(0) / victim)
    r, _ = tokpack(tmp_path, "stage", run, tmp_path / "s", "--ranks", "0-1", "--world-size", BW, "--micro-batch", BM)
    line = one_line(r)
    assert "a FIFO" in line and victim in line, line


@pytest.mark.parametrize("victim", [rank_file_name(1), rank_file_name(1) + ".pad", rank_file_name(1) + ".index"])
def test_a_fifo_in_a_slice_is_refused_promptly(packed_run, tmp_path, victim):
    """A FIFO in place of a rank file or its sidecars: `validate SLICE`, `validate SLICE
    --against RUN` and `read SLICE` (or, for the sidecars `read` does not open, the torch
    dataset) finish within the timeout with an error naming it."""
    from test_containment import corrupt, one_line, tokpack

    s = tmp_path / "s"
    stage_slice(str(packed_run), s, ranks="0-1", world_size=BW, micro_batch=BM)
    (s / epoch_dir_name(1) / victim).unlink()
    os.mkfifo(s / epoch_dir_name(1) / victim)
    for args in ((), ("--against", packed_run)):
        r, _ = tokpack(tmp_path, "validate", s, *args)
        assert "a FIFO" in corrupt(r) and victim in r.stderr, r.stderr
    r, _ = tokpack(
        tmp_path, "read", s, "--rank", 1, "--world-size", BW, "--micro-batch", BM, "--start-sample", 248, "--count", 8
    )
    if victim.endswith(".ds"):
        line = one_line(r)
        assert "a FIFO" in line and victim in line, line
        return
    assert r.returncode == 0, r.stderr  # `read` prints tokens: it opens neither sidecar
    require("torch", "pip install torch")
    from tokpack.loader.torch_adapter import TokpackDataset

    ds = TokpackDataset(s, rank=1, world_size=BW, micro_batch=BM, start_sample=248, positions="index")
    with pytest.raises(TokpackError, match=f"{victim}.*a FIFO"):
        next(iter(ds))


def test_a_best_fit_slice_without_its_padding_is_refused(packed_run, tmp_path):
    """A slice of a best-fit run whose rank files lack `.ds.pad` (as slices were staged before
    they carried it) would train on padding as tokens: the reader refuses it in one line with the
    command that stages it again, and validate reports it."""
    s = tmp_path / "s"
    stage_slice(str(packed_run), s, ranks="2", world_size=BW, micro_batch=BM)
    d = s / epoch_dir_name(0)
    (d / (rank_file_name(2) + ".pad")).unlink()
    m = json.loads((d / MANIFEST).read_text())
    m["shards"] = [{k: v for k, v in x.items() if k != "pad_xxh3_128"} for x in m["shards"]]
    (d / MANIFEST).write_text(json.dumps(m, indent=1) + "\n")
    with pytest.raises(TokpackError) as e:
        SampleReader.open(s)
    assert "lacks the padding" in str(e.value) and "tokpack stage" in str(e.value) and "\n" not in str(e.value)
    for args in ((), ("--against", packed_run)):
        code, out = cli("validate", s, *args)
        assert code != 0 and "lacks the padding of its rows" in out and "internal error" not in out, out
    again = stage_slice(str(packed_run), s, ranks="2", world_size=BW, micro_batch=BM)  # the command the hint gives
    assert again.epochs_staged == [0] and again.epochs_in_place == [1]
    assert packed_batches(s, 2) == packed_batches(packed_run, 2)
