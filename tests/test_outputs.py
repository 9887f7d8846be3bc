"""The output seam (formats/outputs.py): pack and shuffle write through one Output, the same
bytes to a local folder as to a bucket (moto's S3 server), each directory's manifest sent
after everything it lists, and no other module threading the store's plumbing again."""

from __future__ import annotations

import json
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from conftest import project_files, random_docs, shuffle_run, write_source
from tokpack.formats.io.writes import Outbox
from tokpack.formats.constants import MANIFEST
from tokpack.formats.names import epoch_dir_name
from tokpack.formats.outputs import BucketOutput, LocalOutput, ShardPlace
from tokpack.formats.slices import RankRows, rank_file_name
from tokpack.formats.constants import WORK_DIR
from tokpack.packer import pack, shuffle
from tokpack.packer.slicing import stage_slice

ROOT = Path(__file__).resolve().parents[1]


def recorded_sends(monkeypatch) -> list[str]:
    """Every object a command sends to a store, in the order it sends them."""
    sent: list[str] = []
    real = Outbox.send

    def send(self, *files, keep=False):
        sent.extend(str(self.remote_of(f)) for f in files)
        real(self, *files, keep=keep)

    monkeypatch.setattr(Outbox, "send", send)
    return sent


def bucket_tree(fs, url: str) -> dict[str, bytes]:
    fs.invalidate_cache()
    root = url.removeprefix("s3://")
    return {k[len(root) + 1 :]: fs.cat(k) for k in sorted(fs.find(root))}


def local_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_manifests_last(sent: list[str], url: str) -> None:
    """A folder's manifest is sent after every file under it; the output's own manifest is the
    last send, and each earlier send of it (a run's, listing the epochs so far) follows an epoch's."""
    top = f"{url}/{MANIFEST}"
    for i, name in enumerate(sent):
        if name.endswith("/" + MANIFEST) and name != top:
            folder = name[: -len(MANIFEST)]
            assert not [s for s in sent[i + 1 :] if s.startswith(folder)], name
        elif name == top and i < len(sent) - 1:
            assert sent[i - 1].endswith(f"/{MANIFEST}") and sent[i - 1] != top, sent[i - 1]
    assert sent[-1] == top, sent[-3:]


def test_shuffle_through_a_bucket_output_writes_the_local_output_bytes_manifests_last(s3_bucket, tmp_path, monkeypatch):
    """The same shuffle (out of core: a small memory) to a folder and to a bucket: the bucket
    holds exactly the folder's files, byte for byte, and nothing of the work folder; each shard's
    files are sent before the record that it is done, and each epoch's manifest after its shards."""
    fs, bucket = s3_bucket
    url = f"s3://{bucket}/run"
    src = write_source(tmp_path / "src", random_docs(np.random.default_rng(7), 400, 1000, 0), docs_per_shard=100)
    kw = dict(seq_len=63, seed=3, epochs=2, shard_samples=60, memory=40_000)
    local = shuffle(src, tmp_path / "run", **kw)
    sent = recorded_sends(monkeypatch)
    remote = shuffle(src, url, scratch=tmp_path / "scratch", **kw)
    assert local.output == str(tmp_path / "run") and remote.output == url
    assert remote.path == local.path == "out-of-core"
    files = local_tree(tmp_path / "run")
    assert sum(n.endswith(".ds") for n in files) >= 4
    assert bucket_tree(fs, url) == files
    assert_manifests_last(sent, url)
    shards = [s for s in sent if s.endswith(".ds")]
    for shard in shards:  # its files, then its record
        epoch, name = shard[len(url) + 1 :].split("/")
        record = next(i for i, s in enumerate(sent) if re.search(rf"/{epoch}-[0-9a-f]+/done/{name}\.json$", s))
        assert max(i for i, s in enumerate(sent) if s.startswith(shard)) < record
    assert len(shards) == sum(n.endswith(".ds") for n in files)  # each shard sent once


def test_pack_through_a_bucket_output_writes_the_local_output_bytes_manifest_last(s3_bucket, tmp_path, monkeypatch):
    """pack's shard writer commits through the Output as shuffle's does: to a bucket, each part's
    shards are sent before its part record, the plan before the manifest, the manifest last, and
    the bucket ends holding the local pack's files exactly."""
    fs, bucket = s3_bucket
    url = f"s3://{bucket}/packed"
    (tmp_path / "in").mkdir()
    rng = np.random.default_rng(5)
    for name in ("a", "b"):
        np.save(tmp_path / "in" / f"{name}.npy", np.concatenate(random_docs(rng, 200, 1000, 0)).astype(np.uint16))
    kw = dict(input_format="numpy", eos_id=0, vocab_size=1000, shard_tokens=4000)
    local = pack(tmp_path / "in", tmp_path / "packed", **kw)
    sent = recorded_sends(monkeypatch)
    remote = pack(tmp_path / "in", url, scratch=tmp_path / "scratch", **kw)
    assert remote.output == url and local.output == str(tmp_path / "packed") and local.shards >= 4
    assert bucket_tree(fs, url) == local_tree(tmp_path / "packed")
    assert_manifests_last(sent, url)
    for part in sorted({s.rsplit("/", 1)[0] for s in sent if "/part-" in s and s.endswith(".ds")}):
        record = sent.index(f"{part}.json")
        assert max(i for i, s in enumerate(sent) if s.startswith(part + "/")) < record
    plan = sent.index(f"{url}/{WORK_DIR}/finalize.json")
    assert all(
        sent.index(f"{url}/{WORK_DIR}/{p.rsplit('/', 1)[-1]}") < plan for p in sent if re.search(r"/part-\d+\.json$", p)
    )


def test_outputs_travel_to_tasks_and_answer_for_their_place(tmp_path):
    """An EpochJob (pickled to executor tasks) keeps its Output; each Output names and sizes
    its own place, and a local folder's removal removes it."""
    from tokpack.shuffle.epoch_job import EpochJob

    bucket = BucketOutput(Outbox(tmp_path / "out", "s3://b/run/"))
    job = EpochJob(None, (), "uint16", 0, "", str(tmp_path / "out" / "epoch-00000"), "w", 10, output=bucket)
    again = pickle.loads(pickle.dumps(job))
    assert type(again.output) is BucketOutput and again.output.where(job.epoch_dir).url == "s3://b/run/epoch-00000"
    assert pickle.loads(pickle.dumps(LocalOutput())) == LocalOutput()
    assert bucket.shown(tmp_path / "out") == "s3://b/run" and LocalOutput().shown(tmp_path) == str(tmp_path)
    assert bucket.staged and not LocalOutput.staged
    # a bucket's folder holds what is in flight only; a local folder all that is written, less what is there
    assert bucket.local_need(10_000, 300, here=50) == 300 and LocalOutput().local_need(10_000, 300, here=50) == 9_950
    (tmp_path / "work" / "x").mkdir(parents=True)
    LocalOutput().remove_tree(tmp_path / "work")
    assert not (tmp_path / "work").exists()


def test_only_the_seam_knows_about_the_store_plumbing():
    """The local-or-bucket choice is made once (packer/executors.py picks the Output) and
    carried out once (formats/outputs.py over formats/io/writes.py's Outbox). No other module of
    formats/, loader/, shuffle/ or packer/ names an outbox, so it cannot be threaded through again."""
    allowed = {"formats/io/writes.py", "formats/io/__init__.py", "formats/outputs.py", "packer/executors.py"}
    naming = sorted(
        p.relative_to(ROOT).as_posix()
        for p in project_files("formats", "loader", "shuffle", "packer", pattern="*.py")
        if re.search("outbox", p.read_text(), re.IGNORECASE)
    )
    assert set(naming) <= allowed, sorted(set(naming) - allowed)
    assert "formats/outputs.py" in naming  # the check looks where the name is


# ---------------------------------------------------------------- the sink, seen from an Output

SHUFFLES = {  # one real shuffle down each writing path
    "windows out of core": dict(memory=40_000),
    "best-fit in memory": dict(packing="best-fit", memory=64 << 20),
    "best-fit out of core": dict(packing="best-fit", memory=1 << 20),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sink")
    return write_source(root / "src", random_docs(np.random.default_rng(11), 300, 1000, 0), docs_per_shard=60)


def sink_shuffle(src: Path, out: Path, **kw):
    args = dict(seq_len=63, seed=5, epochs=[0, 1], samples=300, shard_samples=64, **kw)
    return shuffle_run([str(src)], str(out), **args)


@dataclass(frozen=True)
class RecordingOutput(LocalOutput):
    """A LocalOutput that notes, in the file `log` (tasks may run elsewhere), each shard's
    place as it is opened and every file it is given, in order."""

    log: str = ""

    def _note(self, *fields) -> None:
        with open(self.log, "a") as f:
            f.write("\t".join(map(str, fields)) + "\n")

    def open_shard(self, place: ShardPlace, fmt):
        self._note("open", place.epoch, place.shard, *place.samples, Path(place.directory).absolute() / place.name)
        return super().open_shard(place, fmt)

    def send(self, *files, keep: bool = False) -> None:
        for f in files:
            self._note("keep" if keep else "file", Path(f).absolute())


@pytest.mark.parametrize("case", SHUFFLES)
def test_the_shard_writer_sends_every_file_of_every_shard_through_the_output(corpus, tmp_path, case):
    """One real shuffle through an Output that records what it receives: each shard is opened at
    its place (epoch, shard, samples [g0, g1), which tile the epoch), then every one of its files
    (.ds, .index, .metadata, .rows, and .pad for best-fit) is given to the Output before the
    shard's done record, each epoch's manifest after its shards' records, the run's manifest
    last; and the run is byte for byte the one a plain LocalOutput writes."""
    kw = SHUFFLES[case]
    sink_shuffle(corpus, tmp_path / "plain", **kw)
    log = tmp_path / "sink.log"
    sink_shuffle(corpus, tmp_path / "run", to=RecordingOutput(str(log)), **kw)
    assert local_tree(tmp_path / "run") == local_tree(tmp_path / "plain")

    run = (tmp_path / "run").absolute()
    events = [line.split("\t") for line in log.read_text().splitlines()]
    sent = [(i, e[1]) for i, e in enumerate(events) if e[0] in ("file", "keep")]
    suffixes = ("", ".index", ".metadata", ".rows") + ((".pad",) if kw.get("packing") == "best-fit" else ())
    opened = [(i, e) for i, e in enumerate(events) if e[0] == "open"]
    assert len(opened) == sum(n.endswith(".ds") for n in local_tree(run))  # every shard, once
    for epoch in (0, 1):
        spans = sorted((int(e[3]), int(e[4])) for _, e in opened if e[1] == str(epoch))
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        samples = json.loads((run / epoch_dir_name(epoch) / MANIFEST).read_text())["samples"]
        assert spans[-1][1] == samples
    for at, e in opened:
        shard = Path(e[5])
        record = next(i for i, s in sent if re.search(rf"/{shard.parent.name}-[0-9a-f]+/done/{shard.name}\.json$", s))
        files = [(i, s) for i, s in sent if s.startswith(str(shard))]
        assert sorted(s for _, s in files) == sorted(f"{shard}{x}" for x in suffixes), files
        assert all(at < i < record for i, _ in files) and events[record][0] == "keep"
        manifest = next(i for i, s in sent if s == str(shard.parent / MANIFEST))
        assert record < manifest
    assert sent[-1][1] == str(run / MANIFEST) and events[-1][0] == "keep"


class _RowRouter:
    """A shard writer that also writes each row (and, best-fit, its padding) that the node's
    ranks read into that rank's file at DEST, at the row the slice arithmetic gives it. It
    needs nothing but the place: the epoch and the samples [g0, g1) the shard holds, in order."""

    def __init__(self, writer, out: "SliceSketchOutput", place: ShardPlace):
        self.writer, self.out = writer, out
        self.rows = RankRows(out.world_size, out.micro_batch)
        self.first = out.firsts[place.epoch]  # the epoch's first sample number in the run
        self.next = {"": place.samples[0], ".pad": place.samples[0]}  # g of the next row each file gets
        self.folder = Path(out.dest) / epoch_dir_name(place.epoch)
        self.folder.mkdir(parents=True, exist_ok=True)

    def __getattr__(self, name):
        if name == "writer":
            raise AttributeError(name)
        return getattr(self.writer, name)

    def _route(self, raw: np.ndarray, suffix: str) -> None:
        g0, (a, b) = self.next[suffix], self.out.ranks
        for k, row in enumerate(raw):
            g = self.first + g0 + k
            r = self.rows.rank_of(g)
            if a <= r <= b:
                fd = os.open(self.folder / f"{rank_file_name(r)}{suffix}", os.O_WRONLY | os.O_CREAT, 0o644)
                try:
                    os.pwrite(fd, row.tobytes(), self.rows.rows(r, self.first, g) * row.nbytes)
                finally:
                    os.close(fd)
        self.next[suffix] += len(raw)

    def write_tokens(self, rows) -> None:
        self.writer.write_tokens(rows)
        self._route(np.ascontiguousarray(rows).view(np.uint8).reshape(len(rows), -1), "")

    def write_pad(self, pad) -> None:
        self.writer.write_pad(pad)
        self._route(np.ascontiguousarray(pad, dtype="<u4").view(np.uint8).reshape(len(pad), -1), ".pad")


@dataclass(frozen=True)
class SliceSketchOutput(LocalOutput):
    """The sketch of a node-slice Output (docs/ARCHITECTURE.md, "Writing through an Output"):
    beside the run's own files, the rank files of ranks A..B of W (micro-batch m) at DEST."""

    dest: str = ""
    world_size: int = 1
    micro_batch: int = 1
    ranks: tuple[int, int] = (0, 0)
    firsts: tuple[int, ...] = ()

    def open_shard(self, place: ShardPlace, fmt):
        return _RowRouter(super().open_shard(place, fmt), self, place)


@pytest.mark.parametrize("case", SHUFFLES)
def test_a_node_slice_output_routes_rows_by_the_shard_place_alone(corpus, tmp_path, case):
    """The places and rows a shuffle gives its Output are enough to write a node slice: an
    Output that routes each row by its shard's place writes, during the shuffle, the rank
    files (tokens and best-fit padding) that `stage --ranks` copies from the finished run."""
    kw = SHUFFLES[case]
    sink_shuffle(corpus, tmp_path / "ref", **kw)
    W, M, ranks = 4, 3, (1, 2)
    staged = tmp_path / "staged"
    stage_slice(str(tmp_path / "ref"), staged, ranks=f"{ranks[0]}-{ranks[1]}", world_size=W, micro_batch=M)
    firsts = tuple(json.loads((staged / epoch_dir_name(e) / MANIFEST).read_text())["first_sample"] for e in (0, 1))
    sketch = SliceSketchOutput(str(tmp_path / "routed"), W, M, ranks, firsts)
    sink_shuffle(corpus, tmp_path / "run", to=sketch, **kw)
    assert local_tree(tmp_path / "run") == local_tree(tmp_path / "ref")
    suffixes = ("", ".pad") if kw.get("packing") == "best-fit" else ("",)
    for e in (0, 1):
        for r in range(ranks[0], ranks[1] + 1):
            for x in suffixes:
                name = f"{epoch_dir_name(e)}/{rank_file_name(r)}{x}"
                assert (tmp_path / "routed" / name).read_bytes() == (staged / name).read_bytes(), name
